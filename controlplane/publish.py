"""Putting one node's spec into `bcd_nodespecs`: its generation reserved, the spec signed, the put recorded.

This module owns the order of a put, which is what keeps generations unique
across processes. The spec is checked first (specs.check_spec), so a bad spec
never costs a generation. Then the node must be known, when asked. Then the next
generation is reserved in state.json under its lock, taking the one already in
the bucket into account. Then the spec is signed with the control plane's key,
put, and applied to the reservations. Both the serve loop's ControlPlane and a
one-off `put` (put.py) put through here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.js.errors

from shared import logs
from shared.schemas import GENERATION_SAFE_MAX, NODE_SPEC_CODEC, SIGNED_NODE_SPEC_CODEC, BadMessage, NodeSpec, encode
from shared.schemas.codec import DEFAULT_MAX_BYTES, bounded_json_loads
from shared.signing import Ed25519PrivateKey, VerificationError, key_id, sign_node_spec, verify_node_spec
from shared.subjects import UPSTREAM_NODESPECS_BUCKET

from .buckets import UpstreamObjects
from .nodes import Nodes
from .specs import PutResult, UnknownNode, check_fits, check_spec, signed_bytes
from .state import StateStore, apply_spec, next_generation, now_utc, rebase_target, record_rebase, reserve_generation

log = logs.get_logger("controlplane")

#: what a spec in the bucket is read as when it is re-signed by a rebase (a node decodes at most 1 MiB)
SPEC_MAX_JSON = DEFAULT_MAX_BYTES


class RebaseRefused(Exception):
    """Nothing to rebase, or not this control plane's to rebase; the text says why."""

    #: an operator's situation (bcd.exits: one line, not an internal error)
    operator_error = True


class SpecPublisher:
    """Signs with `key` and puts into `bcd_nodespecs`, keeping the generations in `store`."""

    def __init__(self, key: Ed25519PrivateKey, objects: UpstreamObjects, store: StateStore, nodes: Nodes, *, max_payload: Callable[[], int]) -> None:
        self.key = key
        #: the upstream bus's max_payload now (the server's INFO, read at each put: a reconnect may
        #: land on another server): a spec whose envelope it cannot carry is refused before a
        #: generation is reserved (specs.check_fits, the dry run's check too)
        self.max_payload = max_payload
        self.key_id = key_id(key)
        self._objects = objects
        self._store = store
        self._nodes = nodes

    async def put(
        self,
        spec: NodeSpec | dict[str, Any] | str | bytes,
        *,
        allow_unknown_fields: bool = False,
        require_known_node: bool = False,
        hello_wait: float = 0.0,
    ) -> PutResult:
        """Sign and put one node's spec at `bcd_nodespecs/<node_id>`.

        A dict or JSON without `generation` gets the last put generation + 1;
        a given generation not above the last is bumped the same way, and the
        result's `note` says so. Raises BadMessage when the spec does not decode,
        UnknownFieldsError (a BadMessage) naming every field NodeSpec does not
        declare unless `allow_unknown_fields` (then they are put as given, for a
        newer node), and UnknownNode with `require_known_node` when the node has
        never put a Hello (waiting up to `hello_wait` seconds for one).
        """
        checked = check_spec(spec, allow_unknown_fields=allow_unknown_fields)
        draft, requested, node_id = checked.draft, checked.requested, checked.draft.node_id
        if require_known_node and not await self._nodes.known(node_id, wait=hello_wait):
            raise UnknownNode(node_id)
        # before the reservation: a put the bus cannot carry must not cost a generation (issue 41.6)
        check_fits(checked, self.max_payload())
        published = await self.published_generation(node_id)
        with self._store.transaction() as st:
            gen, note = next_generation(st, node_id, requested, published)
            # reserve it now: a concurrent put (another process) gets the next one, and an
            # event at it is believed (commit.py refuses generations never issued)
            reserve_generation(st, node_id, gen)
        final = msgspec.structs.replace(draft, generation=gen)
        # fields this schema does not know (allowed) travel as given: they are for a newer node
        signed = sign_node_spec(self.key, signed_bytes(checked, gen))
        kv = await self._objects.bucket(UPSTREAM_NODESPECS_BUCKET)
        payload = encode(signed)
        put_at = time.perf_counter()
        revision = await kv.put(node_id, payload)
        with self._store.transaction() as st:
            apply_spec(st, final, now_utc())
        if note:
            log.warning("generation bumped", node_id=node_id, note=note)
        log.info(
            "spec put",
            node_id=node_id,
            generation=gen,
            revision=revision,
            assignments=len(final.devices),
            key_id=self.key_id,
            # allowed fields this control plane does not know: put as given, for a newer node
            **({"unknown_fields": [str(f) for f in checked.unknown][:20]} if checked.unknown else {}),
        )
        return PutResult(
            spec=final, revision=revision, requested_generation=requested, note=note, unknown_fields=tuple(checked.unknown), put_at=put_at
        )

    async def rebase(self, node_id: str) -> PutResult:
        """Bring a node put above GENERATION_SAFE_MAX back to this control plane's count, its holds kept.

        The spec in the bucket must be this control plane's (its signature verifies with our
        key: nobody else's spec is re-signed). The same spec, as signed (fields a newer node
        knows included), is put again at rebase_target with `rebase_from` naming the generation
        it replaces, which the node's bridge and converger take though it is lower
        (shared.schemas.takes_rebase) and nothing else does. Same assignments: the node keeps
        every hold (no release, no second Bound) and reports the new generation's section.
        Raises RebaseRefused saying why when there is nothing to rebase.
        """
        kv = await self._objects.bucket(UPSTREAM_NODESPECS_BUCKET)
        try:
            entry = await kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            raise RebaseRefused(f"node {node_id} has no spec in {UPSTREAM_NODESPECS_BUCKET}: nothing to rebase") from None
        try:
            signed = SIGNED_NODE_SPEC_CODEC.decode(entry.value or b"")
            spec = verify_node_spec(signed, [self.key.verify_key])
        except (BadMessage, VerificationError) as exc:
            raise RebaseRefused(f"node {node_id}'s spec in {UPSTREAM_NODESPECS_BUCKET} is not this control plane's to rebase ({exc})") from None
        stuck = spec.generation
        if stuck <= GENERATION_SAFE_MAX:
            raise RebaseRefused(
                f"node {node_id} is at generation {stuck}, which its control plane's count follows: nothing to rebase "
                f"(a rebase is for a node above {GENERATION_SAFE_MAX})"
            )
        with self._store.transaction() as st:
            try:
                gen = rebase_target(st, node_id, stuck)
            except ValueError as exc:
                raise RebaseRefused(str(exc)) from None
            # intent first: both generations issued, the count from `gen`, before anything is put
            record_rebase(st, node_id, stuck, gen)
        fields = bounded_json_loads(signed.spec, SPEC_MAX_JSON, "spec")
        payload = encode({**fields, "generation": gen, "rebase_from": stuck})
        final = NODE_SPEC_CODEC.decode(payload)  # the node decodes the same bytes
        put_at = time.perf_counter()
        revision = await kv.put(node_id, encode(sign_node_spec(self.key, payload)))
        with self._store.transaction() as st:
            apply_spec(st, final, now_utc())
        log.warning("node rebased", node_id=node_id, generation=gen, rebased_from=stuck, revision=revision, key_id=self.key_id)
        return PutResult(spec=final, revision=revision, requested_generation=None, note=f"rebased from generation {stuck}", put_at=put_at)

    async def published_generation(self, node_id: str) -> int:
        """The generation of the spec in the bucket now (0: none, or one that does not decode)."""
        kv = await self._objects.bucket(UPSTREAM_NODESPECS_BUCKET)
        try:
            entry = await kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            return 0
        try:
            signed = SIGNED_NODE_SPEC_CODEC.decode(entry.value or b"")
            return NODE_SPEC_CODEC.decode(signed.spec).generation
        except BadMessage as exc:
            log.warning("spec in bucket does not decode; ignoring its generation", node_id=node_id, error=str(exc))
            return 0


__all__ = ["SpecPublisher", "RebaseRefused"]
