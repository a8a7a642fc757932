"""A NodeSpec as a put takes it: checked before anything is reserved or signed, and what a put returns.

This module owns the rules a spec must pass before it costs a generation. Unknown
fields are refused unless allowed, and every one is named. Then the schema is
checked, naming the field, and then the node id, which may not be a reserved
subject token. It also owns the shape of a put's answer (PutResult) and the
refusal of a spec for a node that never said Hello (UnknownNode). `bcd apply`
(with `--dry-run` too) runs the same check on the node's side, so the rules
live apart from the code that talks to the upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from shared.schemas import GENERATION_SAFE_MAX, NODE_SPEC_CODEC, SIGNED_NODE_SPEC_CODEC, BadMessage, NodeSpec, SignedNodeSpec, encode
from shared.schemas.codec import DEFAULT_MAX_BYTES, bounded_json_loads
from shared.schemas.common import INT64_MAX
from shared.schemas.strict import UnknownField, UnknownFieldsError, unknown_fields
from shared.subjects import UPSTREAM_NODES_BUCKET, upstream_spec_key_subject


@dataclass(frozen=True)
class PutResult:
    """What `put_spec` put: the signed spec, its KV revision, and whether the generation was bumped."""

    spec: NodeSpec
    revision: int
    #: the generation the caller gave (None: none given, so last + 1 was used).
    requested_generation: int | None
    #: non-empty when the requested generation was not above the last one and was bumped.
    note: str = ""
    #: fields NodeSpec does not declare, put as given (only with allow_unknown_fields).
    unknown_fields: tuple[UnknownField, ...] = ()
    #: `time.perf_counter()` just before the KV put was sent (signed already): where a
    #: latency measurement of the node's answer starts (bench/e2e.py).
    put_at: float = 0.0

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def bumped(self) -> bool:
        return bool(self.note)


def _spec_fields(spec: NodeSpec | dict[str, Any] | str | bytes) -> dict[str, Any]:
    if isinstance(spec, NodeSpec):
        return msgspec.to_builtins(spec)
    if isinstance(spec, (str, bytes, bytearray)):
        if not spec.strip():
            raise BadMessage("spec: empty (a NodeSpec is a JSON object)")
        # bounded_json_loads says "spec: not valid JSON (...)" itself (it was said twice, issue 28.8)
        data = bounded_json_loads(spec, 4 * DEFAULT_MAX_BYTES, "spec")
    else:
        data = spec
    if not isinstance(data, dict):
        raise BadMessage("spec: expected a JSON object")
    return dict(data)


#: the largest generation a put may ask for (a spec that carries one): 2^52, half of the range every
#: JSON reader takes exactly (up to GENERATION_SAFE_MAX, 2^53 - 1). The other half is the control
#: plane's count's and the rebases': a rebase goes to one above the highest generation ever issued
#: at or below 2^53 - 1, so a put asked at 2^53 - 1 left a node no way back (issue 41.5, seen from
#: outside after the first fix). The count (last + 1) never crosses 2^53 - 1 (state.next_generation);
#: a node found above it (put there by an earlier release or another control plane) is rebased.
GENERATION_REQUEST_MAX = 2**52


@dataclass(frozen=True)
class CheckedSpec:
    """A spec as `check_spec` read it: valid, with any generation it asked for."""

    #: the spec decoded (generation: the requested one, or 0 when none was given).
    draft: NodeSpec
    requested: int | None
    #: the JSON object as given.
    fields: dict[str, Any]
    #: fields NodeSpec does not declare (empty unless allowed).
    unknown: list[UnknownField]


def check_spec(spec: NodeSpec | dict[str, Any] | str | bytes, *, allow_unknown_fields: bool = False) -> CheckedSpec:
    """What a put checks before anything is reserved or signed (also `bcd apply --dry-run`).

    Unknown fields first (UnknownFieldsError names every one, unless allowed),
    then the schema (BadMessage naming the field), then the node id.
    """
    fields = _spec_fields(spec)
    unknown = unknown_fields(NodeSpec, fields)
    if unknown and not allow_unknown_fields:
        raise UnknownFieldsError(unknown)
    requested = fields.get("generation")
    # Validate first (with any generation), so a bad spec never consumes one.
    draft = NODE_SPEC_CODEC.decode(encode({**fields, "generation": requested if isinstance(requested, int) and requested >= 0 else 0}))
    if fields.get("rebase_from") is not None:
        # a rebase is the control plane's own act (SpecPublisher.rebase), never a spec's field
        raise BadMessage("spec: rebase_from is set by a rebase only (`bcd rebase`, `python -m controlplane rebase`) - at `$.rebase_from`")
    if requested is not None:
        NODE_SPEC_CODEC.decode(encode(fields))  # a malformed generation fails here, named
        if requested > GENERATION_REQUEST_MAX:
            # the schema takes it (an int64), but a put at it leaves the node no generation to go
            # on with (issue 41.5: 2^63 - 1 wedged a node for good)
            raise BadMessage(
                f"spec: generation {requested} is above the largest a put may ask for ({GENERATION_REQUEST_MAX}, 2^52): "
                "a node put there could never be given another spec; leave `generation` out and the control plane "
                "puts the next one - at `$.generation`"
            )
    try:
        upstream_spec_key_subject(draft.node_id)  # refuses a reserved node id
    except ValueError as exc:
        raise BadMessage(f"spec: {exc}") from None
    return CheckedSpec(draft=draft, requested=requested, fields=fields, unknown=unknown)


#: the envelope around an empty spec with the widest key id and signature a put writes (16 hex
#: digits, 64 signature bytes): what a signed spec adds besides its bytes' base64
_ENVELOPE_OVERHEAD = len(encode(SignedNodeSpec(spec=b"", key_id="0" * 16, signature=b"\0" * 64)))


def signed_size(spec_bytes: int) -> int:
    """The bytes of the SignedNodeSpec that carries `spec_bytes` of NodeSpec JSON (base64 with padding)."""
    return _ENVELOPE_OVERHEAD + 4 * -(-spec_bytes // 3)


def spec_limit(max_payload: int) -> int:
    """The most NodeSpec JSON bytes a put can carry over a bus whose max_payload is `max_payload`.

    THE limit (issue 41.6: the dry run accepted a 991 KB spec the apply could not put): the
    largest spec whose signed envelope fits the node bus's max_payload, within what the node
    decodes (a NodeSpec of at most 1 MiB, an envelope of at most 2 MiB). `bcd apply --dry-run`
    and every put (SpecPublisher.put, before a generation is reserved) call check_fits with it.
    """
    room = min(max_payload, SIGNED_NODE_SPEC_CODEC.max_bytes) - _ENVELOPE_OVERHEAD
    return max(0, min(DEFAULT_MAX_BYTES, room // 4 * 3))


def signed_bytes(checked: "CheckedSpec", generation: int) -> bytes:
    """The exact NodeSpec JSON a put signs for `checked` at `generation`: fields a newer node knows
    (allowed) travel as given, else the spec as this schema encodes it."""
    if checked.unknown:
        return encode({**checked.fields, "generation": generation})
    return spec_json(msgspec.structs.replace(checked.draft, generation=generation))


def spec_json(spec: NodeSpec) -> bytes:
    """A NodeSpec's JSON as a control plane signs it: `rebase_from` only on a rebase, so a node of
    an earlier release (which does not know the field) never reads it in an ordinary spec."""
    doc = msgspec.to_builtins(spec)
    if doc.get("rebase_from") is None:
        doc.pop("rebase_from", None)
    return encode(doc)


class SpecTooLarge(BadMessage):
    """A spec whose signed envelope the bus cannot carry: an input error, said before anything is reserved."""


def check_fits(checked: "CheckedSpec", max_payload: int) -> None:
    """SpecTooLarge unless `checked`, signed at any generation, fits `max_payload` (spec_limit).

    Measured at the widest generation (19 digits), so the answer is the same whatever
    generation the put takes, for the dry run and the put alike.
    """
    size, limit = len(signed_bytes(checked, INT64_MAX)), spec_limit(max_payload)
    if size > limit:
        raise SpecTooLarge(
            f"spec: {size} bytes as signed, above the {limit} bytes a spec may be here (the node bus's max_payload "
            f"of {max_payload} bytes less the signed envelope: base64, key id and signature); nothing was put"
        )


class UnknownNode(ValueError):
    """A spec for a node that never put a Hello (a typo, or a node not yet joined)."""

    def __init__(self, node_id: str) -> None:
        super().__init__(f"node {node_id} has never announced itself (no Hello in {UPSTREAM_NODES_BUCKET})")
        self.node_id = node_id


__all__ = ["GENERATION_REQUEST_MAX", "PutResult", "CheckedSpec", "check_spec", "UnknownNode", "SpecTooLarge", "check_fits", "signed_bytes", "signed_size", "spec_json", "spec_limit"]
