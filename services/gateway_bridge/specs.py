"""Spec intake: the node's signed spec from upstream, verified, handed to the converger.

The only way a spec reaches the node. It reads `bcd_nodespecs/<node_id>` by
direct get and follows the key's subject (a KV put is a publish there);
verifies the SignedNodeSpec against the configured control-plane keys
(shared/spectrust.py: unsigned only with the lab-only opt-out); refuses a bad
signature, another node's spec or an older generation (the last good spec
stays; condition NodeSpecRejected is raised, through the outbox like every
event); hands the rest to the converger as the signed envelope, byte for byte
as it came from upstream. The converger verifies it again itself (issue 40:
every hop checks, so whoever reaches `converger.spec` without the control
plane's signature owns nothing); checking here too refuses early, and raises
NodeSpecRejected upstream. Never backwards: the newest verified spec waits as
`pending` until the converger acknowledges it and is handed over again every
HANDOVER_RETRY_S while the converger does not answer; an older one is
refused, never handed over after a newer.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client
from prometheus_client import Counter

from shared.eventids import condition_id
from shared.runtime import LoopGuard, ServiceCallError, call, describe
from shared.schemas import (
    NODE_EVENT_CODEC,
    SPEC_ACK_CODEC,
    BadMessage,
    Condition,
    NodeCondition,
    NodeSpec,
    SchemaViolation,
    clip,
    takes_rebase,
)
from shared.signing import VerificationError
from shared.spectrust import SpecTrust
from shared.subjects import MSG_ID_HEADER, NodeSubjects, upstream_spec_get_subject, upstream_spec_key_subject

if TYPE_CHECKING:
    from services.gateway_bridge.upstream import Upstream

NODE_SPEC_REJECTED = "NodeSpecRejected"
#: one hand-over to the converger waits this long for its answer; then it is tried again.
HANDOVER_TIMEOUT_S = 2.0
#: while the converger does not take the newest spec, it is handed over again this often.
HANDOVER_RETRY_S = 0.5


class SpecIntake:
    """Specs in: `nc` is the node bus (the converger, the outbox), `upstream` where specs come from.

    `trust` is how specs are checked (the control-plane keys, or the lab
    opt-out); `outcomes` is bcd_node_specs.
    """

    def __init__(
        self,
        nc: Client,
        subjects: NodeSubjects,
        node_id: str,
        trust: SpecTrust,
        upstream: Upstream,
        resync_interval: float,
        outcomes: Counter,
        log: Any,
        stopping: asyncio.Event,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.node_id = node_id
        self.trust = trust
        self.upstream = upstream
        self.resync_interval = resync_interval
        self.outcomes = outcomes
        self.log = log
        self.stopping = stopping
        self.wake = asyncio.Event()
        #: the newest raw spec put on the key (a KV put is a publish), not yet read.
        self.latest: bytes | None = None
        #: the newest verified spec the converger has not acknowledged yet: handed
        #: over again every HANDOVER_RETRY_S until it is; a newer one replaces it.
        self.pending: NodeSpec | None = None
        #: the SignedNodeSpec JSON `pending` was verified from, as upstream put it: what the
        #: converger gets, to verify itself; its inner bytes carry the fields this schema
        #: does not know too (NodeSpecUnknownFields).
        self.pending_raw: bytes | None = None
        #: the converger answered the last hand-over (False: the next success is logged).
        self.converger_reachable = True
        self.applied_generation = -1
        self.rejected: Condition | None = None
        self.rejection_unknown = True

    # ------------------------------------------------------------------ where specs come from

    async def subscribe(self, up: Client) -> None:
        """Follow the spec key on the upstream connection: each put wakes the loop at once."""
        await up.subscribe(upstream_spec_key_subject(self.node_id), cb=self.on_spec)

    async def on_spec(self, msg: Any) -> None:
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
            return
        self.latest = msg.data
        self.wake.set()

    def converger_changed(self) -> None:
        """A converger that speaks again takes the spec that waits for it now."""
        if self.pending is not None:
            self.wake.set()

    async def _get_spec(self) -> bytes | None:
        up = self.upstream.nc
        assert up is not None
        try:
            msg = await up.request(upstream_spec_get_subject(self.node_id), b"", timeout=3)
        except nats.errors.NoRespondersError:
            self.upstream.waiting_for("KV bucket bcd_nodespecs")
            return None
        self.upstream.found("KV bucket bcd_nodespecs")
        headers = msg.headers or {}
        status = headers.get("Status") or headers.get("Nats-Status")
        if status == "404" or (not msg.data and status):
            return None
        if headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data

    async def run(self) -> None:
        guard = LoopGuard(self.log, "specs loop")
        while not self.stopping.is_set():
            if self.pending is None:
                # a spec already taken goes to the converger (on the node bus) while upstream is away
                await self.upstream.connected.wait()
            # cleared before the work, so a wake set during it (a retry, a new put) is kept
            self.wake.clear()
            async with guard:
                try:
                    data = self.latest
                    self.latest = None
                    if data is None and self.pending is None:
                        data = await self._get_spec()
                    if data is not None:
                        await self.take(data)
                    if self.pending is not None:
                        await self.hand_over()
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    self.log.warning("reading the node spec failed; retrying", error=describe(exc))
            # a spec the converger has not taken yet is handed over again soon; a new put wakes at once
            wait = HANDOVER_RETRY_S if self.pending is not None else self.resync_interval
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), wait)

    # ------------------------------------------------------------------ verifying, handing over

    async def take(self, data: bytes) -> None:
        """Verify one SignedNodeSpec; the newest good one waits in `pending` for the hand-over.

        Never goes backwards: a spec older than the applied generation, or
        than the one already waiting for the converger, is refused.
        """
        try:
            _, spec = self.trust.open(data, self.node_id)
        except VerificationError as exc:
            await self.reject(f"refused: {exc}")
            return
        limit = self.nc.max_payload
        if len(data) > limit:
            # relayed as it came: an envelope the node bus cannot carry would be retried forever
            await self.reject(f"refused: the signed spec is {len(data)} bytes, above the node bus's max_payload of {limit}")
            return
        # lower is refused (an old spec replayed), but for the control plane's signed rebase of a
        # node put where no generation follows (docs/upstream.md, "Generations")
        if spec.generation < self.applied_generation and not takes_rebase(spec, self.applied_generation):
            await self.reject(f"refused: generation {spec.generation} is lower than the applied {self.applied_generation}")
            return
        if self.pending is not None and spec.generation < self.pending.generation:
            await self.reject(
                f"refused: generation {spec.generation} is lower than generation {self.pending.generation}, "
                "which waits for the converger"
            )
            return
        self.pending, self.pending_raw = spec, bytes(data)

    async def hand_over(self) -> None:
        """Hand the pending spec to the converger; kept pending (retried soon) when it does not answer."""
        spec, payload = self.pending, self.pending_raw
        assert spec is not None and payload is not None
        # the envelope as upstream put it, not a re-encoding: the converger checks the
        # control plane's signature over it itself, and reports the fields a newer
        # control plane added (inside the signed bytes)
        try:
            ack = await call(self.nc, self.subjects.converger_spec, payload, SPEC_ACK_CODEC, timeout=HANDOVER_TIMEOUT_S)
        except ServiceCallError as exc:
            if exc.code in ("400", "409"):
                self._handed(spec)
                self.converger_reachable = True
                await self.reject(f"refused by the converger: {exc.description}")
                return
            self._unreachable(spec, f"{exc.code}: {exc.description}")
            return
        except (nats.errors.Error, asyncio.TimeoutError, BadMessage) as exc:
            self._unreachable(spec, describe(exc))
            return
        self._handed(spec)
        # a rebase the converger took moves the applied generation down; nothing else does
        rebased = ack.generation == spec.generation and takes_rebase(spec, self.applied_generation)
        self.applied_generation = ack.generation if rebased else max(self.applied_generation, ack.generation)
        if not self.converger_reachable:
            self.converger_reachable = True
            self.log.info("converger reachable again; spec handed over", generation=ack.generation, changed=ack.changed)
        if ack.changed:
            self.outcomes.labels(outcome="accepted").inc()
            self.log.info("node spec handed to the converger", generation=ack.generation, signed=not self.trust.accept_unsigned)
        await self.clear_rejection()

    def _handed(self, spec: NodeSpec) -> None:
        # only what was handed over leaves `pending`; a newer spec taken meanwhile stays
        if self.pending is spec:
            self.pending, self.pending_raw = None, None

    def _unreachable(self, spec: NodeSpec, error: str) -> None:
        # the first miss of an outage is a WARNING; the retries every HANDOVER_RETRY_S are DEBUG
        (self.log.warning if self.converger_reachable else self.log.debug)(
            "converger not reachable; the newest spec is handed over again as soon as it answers",
            generation=spec.generation,
            error=error,
            retry_in_s=HANDOVER_RETRY_S,
        )
        self.converger_reachable = False

    # ------------------------------------------------------------------ NodeSpecRejected

    async def reject(self, message: str) -> None:
        self.outcomes.labels(outcome="rejected").inc()
        self.log.error("node spec rejected; keeping the last good spec", reason=message, applied_generation=self.applied_generation)
        message = clip(message)  # a condition's message is a bounded Text
        if self.rejected is not None and self.rejected.message == message:
            return
        self.rejected = Condition(
            type=NODE_SPEC_REJECTED, status="True", reason="SpecRefused", message=message, since=datetime.now(timezone.utc)
        )
        await self.publish_condition(self.rejected)

    async def clear_rejection(self) -> None:
        # After a restart the bridge does not know whether it had raised the
        # condition: the first good spec clears it once, so it never sticks.
        if self.rejected is None and not self.rejection_unknown:
            return
        self.rejected = None
        self.rejection_unknown = False
        await self.publish_condition(
            Condition(
                type=NODE_SPEC_REJECTED,
                status="False",
                reason="SpecAccepted",
                message=f"generation {self.applied_generation} accepted",
                since=datetime.now(timezone.utc),
            )
        )

    async def publish_condition(self, condition: Condition) -> None:
        """Through the outbox like every event, so it survives an upstream outage."""
        event = NodeCondition(condition=condition)
        event_id = condition_id(self.node_id, condition)
        js = self.nc.jetstream()
        try:
            payload = NODE_EVENT_CODEC.encode_valid(event)
            await js.publish(self.subjects.outbox_subject("condition"), payload, headers={MSG_ID_HEADER: event_id})
        except (nats.errors.Error, asyncio.TimeoutError, SchemaViolation) as exc:
            self.log.error("could not journal a condition", condition=condition.type, error=describe(exc))


__all__ = ["HANDOVER_RETRY_S", "HANDOVER_TIMEOUT_S", "NODE_SPEC_REJECTED", "SpecIntake"]
