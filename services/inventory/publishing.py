"""Scans the host, evaluates every card's PhysicalGPU status, publishes on change and sends the GPU events.

A scan (`scan`) reads the host through the adapter (build.py); an
evaluation (`evaluate_and_publish`) runs the GpuTracker over it and the
converger's claims (`fetch_claims`, asked at every evaluation; no answer
reads Indeterminate). An inventory whose content changed gets the next
revision, goes into the bucket (`bcd_node_<node>_inventory`, where the next
start continues its revision: `load_last`) and out on `inventory.changed`;
one that breaks its own schema is not published. The tracker's state is
saved (gpus.json) after every evaluation, and the GPU events it journaled
go to the node-bus outbox in order (`flush_events`; those the outbox did
not take stay journaled and are retried). Everything runs under
`facts.lock`: `scan_and_publish` takes it, the other rooms call the
parts while they hold it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client

from shared.jsutil import StreamMissing, last_value
from shared.runtime import ServiceCallError, call
from shared.schemas import CLAIMS_CODEC, INVENTORY_CODEC, NODE_EVENT_CODEC, BadMessage, Claims, Empty, Inventory, SchemaViolation, SwitchReply
from shared.subjects import MSG_ID_HEADER, NodeSubjects

from .adapters import AdapterError
from .adapters.base import GpuSharer
from .build import build_inventory, inventory_content_key
from .facts import InventoryFacts
from .features import FeatureKeeper
from .gpustate import StateFileError
from .metrics import InventoryMetrics


def mps_root_named(adapter: Any, mps_root: Path | str) -> str:
    """The MPS root the inventory names (the converger's claim specs mount `<root>/<control>/pipe`);
    "" with an adapter that keeps no MPS daemons."""
    return str(mps_root) if isinstance(adapter, GpuSharer) else ""


class Publisher:
    def __init__(
        self,
        facts: InventoryFacts,
        *,
        metrics: InventoryMetrics,
        nc: Client,
        subjects: NodeSubjects,
        node_id: str,
        adapter_name: str,
        mps_root: Path | str,
        claims_timeout: float,
        log: Any,
        features: FeatureKeeper | None = None,
        save_error: str = "",
        first_scan: Callable[[Inventory], Awaitable[None]] | None = None,
    ) -> None:
        self.facts = facts
        self.metrics = metrics
        self.nc = nc
        self.subjects = subjects
        self.node_id = node_id
        self.adapter_name = adapter_name
        self.mps_root = mps_root
        self.claims_timeout = claims_timeout
        self.log = log
        #: the NFD feature file (features.py); None when --feature-dir is empty
        self.features = features
        #: run once with the start scan, before its evaluation (the first health check)
        self.first_scan = first_scan
        #: the last put into the bucket failed (said once)
        self.record_failing = False
        #: the last claims lookup failed (logged once per outage).
        self.claims_failing = False
        #: the outbox did not take the last event (logged once per outage).
        self.outbox_waiting = False
        #: the outbox stream has acknowledged a publish since this process started
        self.outbox_answered = False
        #: the last error writing the state file (logged once until it changes).
        self.save_error = save_error
        #: the revision the per-GPU gauges show (None: not set yet).
        self.observed_revision: int | None = None

    # ------------------------------------------------------------------ the bucket and the notice

    async def load_last(self) -> None:
        """Continue the revision of what an earlier run published."""
        try:
            value = await last_value(self.nc, self.subjects.inventory_key_get)
        except (StreamMissing, nats.errors.Error, asyncio.TimeoutError) as exc:
            self.log.warning("the last inventory could not be read; revisions start again", error=str(exc) or type(exc).__name__)
            return
        if value:
            try:
                last = INVENTORY_CODEC.decode(value)
            except BadMessage as exc:
                self.log.warning("ignoring unreadable inventory in KV", error=str(exc))
                return
            self.facts.current = last
            self.facts.content_key = inventory_content_key(last)

    async def announce(self) -> None:
        """Say the inventory again now that `inventory.get` answers.

        The start scan's notice can go out before a peer listens, and a peer that asked
        meanwhile got no answer (the endpoints come after the scan): the converger's
        pass for a spec that came first would wait for its retry interval. Peers take
        a notice of a revision they hold as nothing new.
        """
        if self.facts.current is None:
            return
        try:
            await self.nc.publish(self.subjects.inventory_changed, INVENTORY_CODEC.encode_valid(self.facts.current))
        except Exception as exc:  # noqa: BLE001 - the next change notifies again
            self.log.warning("inventory not announced", error=str(exc) or type(exc).__name__)

    async def _record(self, payload: bytes) -> None:
        """Put the inventory into its bucket, where the next start continues its revision; the
        peers have it from the notice and `get`, so a bucket away costs only that (said once)."""
        try:
            await self.nc.jetstream(timeout=5.0).publish(self.subjects.inventory_key, payload)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            if not self.record_failing:
                self.log.warning("the inventory's bucket took no put (the bus setup makes it)", error=str(exc) or type(exc).__name__)
            self.record_failing = True
            return
        if self.record_failing:
            self.log.info("the inventory's bucket takes puts again")
        self.record_failing = False

    # ------------------------------------------------------------------ work

    async def scan_and_publish(
        self,
        reason: str,
        *,
        claims: Claims | None = None,
        switch: SwitchReply | None = None,
        rescan: bool = True,
        flush: bool = True,
    ) -> Inventory:
        """Scan, evaluate every card's PhysicalGPU status, publish on change, send the GPU events
        (`flush=False`: journaled only, sent by the caller).

        `claims` given (a claims_changed notice) are used as they are;
        otherwise the converger is asked. `switch` is the switcher's notice
        that caused this scan. `rescan=False` evaluates the last scan again
        (a scan happens when there is none yet).
        """
        facts = self.facts
        async with facts.lock:
            if claims is None:
                claims = await self.fetch_claims()
            scanned = rescan or facts.last_base is None
            base = await self.scan(reason) if scanned else facts.last_base
            if base is None:
                assert facts.current is not None
                return facts.current
            if switch is not None:
                facts.tracker.note_switch(switch)
            if self.first_scan is not None:
                first, self.first_scan = self.first_scan, None
                await first(base)
            return await self.evaluate_and_publish(base, claims, reason, switch=switch, scanned=scanned, flush=flush)

    async def refresh_logged(self, reason: str, **kw: Any) -> None:
        try:
            await self.scan_and_publish(reason, **kw)
        except Exception:  # noqa: BLE001 - a notice never kills the service; the error is logged
            self.log.exception("scan failed", reason=reason)

    async def fetch_claims(self) -> Claims | None:
        """The converger's claims; None (Indeterminate, fail-closed) when it does not answer in time."""
        try:
            claims = await call(self.nc, self.subjects.converger_claims, Empty(), CLAIMS_CODEC, timeout=float(self.claims_timeout))
        except (ServiceCallError, nats.errors.Error, asyncio.TimeoutError, BadMessage) as exc:
            self.metrics.claims_errors.inc()
            if not self.claims_failing:
                self.log.warning(
                    "claims lookup failed; every card reads managementState Unknown (Indeterminate) until it answers",
                    subject=self.subjects.converger_claims,
                    error=str(exc) or type(exc).__name__,
                )
            self.claims_failing = True
            return None
        if self.claims_failing:
            self.log.info("claims lookup answers again", claims=len(claims.claims))
        self.claims_failing = False
        return claims

    async def scan(self, reason: str) -> Inventory | None:
        """One read of the host (no PhysicalGPU evaluation yet); None when it failed and a last inventory exists."""
        facts = self.facts
        started = time.perf_counter()
        revision = facts.current.revision if facts.current else 0
        try:
            inv = await asyncio.to_thread(
                build_inventory,
                facts.adapter,
                node_id=self.node_id,
                revision=revision,
                now=datetime.now(timezone.utc),
                previous=facts.current,
            )
        except (AdapterError, OSError) as exc:
            self.metrics.scans.labels(outcome="error").inc()
            self.log.error("scan failed; keeping the last inventory", reason=reason, error=str(exc))
            if facts.current is None:
                raise
            return None
        finally:
            self.metrics.scan_seconds.observe(time.perf_counter() - started)
            facts.last_scan = time.monotonic()
        facts.last_base = msgspec.structs.replace(inv, adapter=self.adapter_name, mps_root=mps_root_named(facts.adapter, self.mps_root))
        return facts.last_base

    async def evaluate_and_publish(
        self,
        base: Inventory,
        claims: Claims | None,
        reason: str,
        *,
        switch: SwitchReply | None = None,
        scanned: bool = True,
        flush: bool = True,
    ) -> Inventory:
        """`scanned`: `base` is a scan made for this evaluation (counted in bcd_inventory_scans)."""
        facts, m = self.facts, self.metrics
        tracker = facts.tracker
        revision = facts.current.revision if facts.current else 0
        result = tracker.evaluate(base, claims, switch=switch, known=facts.current)
        for outcome in result.reclaims:
            m.reclaims.labels(outcome=outcome).inc()
        if result.new_boot:
            self.log.info("new boot id; orphan timers restart", boot_id=base.boot_id)
        for pe in result.events:
            e = pe.event
            self.log.info(
                "gpu changed",
                pci=e.pci_address,
                phase=e.phase,
                management_state=e.management_state,
                conditions={c.type: f"{c.status}/{c.reason}" for c in e.status.conditions},
                switch_event=e.reason,
                event_id=pe.event_id,
            )
        m.events.inc(len(result.events))
        self.save()
        inv = result.inventory
        key = inventory_content_key(inv)
        if facts.current is not None and key == facts.content_key:
            self._count_scan(scanned, "unchanged")
            inv = facts.current
            if self.observed_revision != inv.revision:
                # after a restart the last inventory comes from KV: the gauges start from it
                self._observe(inv)
        else:
            inv = msgspec.structs.replace(inv, revision=revision + 1)
            try:
                payload = INVENTORY_CODEC.encode_valid(inv)
            except SchemaViolation as exc:
                # what the host reported does not fit the schema: the peers keep the last
                # good inventory rather than get one they cannot decode
                self._count_scan(scanned, "invalid")
                self.log.error("inventory not published: it breaks its own schema", reason=reason, error=str(exc))
                if flush:
                    await self.flush_events()
                return facts.current if facts.current is not None else inv
            await self._record(payload)
            await self.nc.publish(self.subjects.inventory_changed, payload)
            facts.current, facts.content_key = inv, key
            self._count_scan(scanned, "changed")
            self._observe(inv)
            self.log.info(
                "inventory published",
                reason=reason,
                revision=inv.revision,
                gpus=len(inv.gpus),
                atoms=len(inv.atoms),
                bucket=self.subjects.inventory_bucket,
            )
        if flush:
            await self.flush_events()
        if self.features is not None:
            self.features.sync(inv)
        facts.wake.set()
        return inv

    def _count_scan(self, scanned: bool, outcome: str) -> None:
        """bcd_inventory_scans counts scans: an evaluation of the last scan again (a claims notice) is not one."""
        if scanned:
            self.metrics.scans.labels(outcome=outcome).inc()

    def _observe(self, inv: Inventory) -> None:
        self.observed_revision = inv.revision
        self.metrics.observe(inv)

    def save(self, *, strict: bool = False) -> None:
        """Write gpus.json when the tracker's state changed; errors are logged (raised when strict)."""
        store = self.facts.store
        try:
            store.save(self.facts.tracker.state)
        except StateFileError as exc:
            self.metrics.state_errors.inc()
            if str(exc) != self.save_error:
                self.log.error("cannot save the GPU state", error=str(exc))
                self.save_error = str(exc)
            if strict:
                raise
            return
        if self.save_error:
            self.log.info("GPU state saved again", path=str(store.path))
            self.save_error = ""

    async def flush_events(self) -> None:
        """Hand the journaled GPU events to the node-bus outbox, in order; stop at the first refusal."""
        tracker = self.facts.tracker
        if tracker.dropped_events:
            self.log.error("GPU events dropped: the journal was full", dropped=tracker.dropped_events)
            tracker.dropped_events = 0
        # Until the bus setup has made the outbox stream a publish gets no PubAck and
        # would wait out the whole timeout each time: probe with a short one, use the
        # long one once the stream answered.
        js = self.nc.jetstream(timeout=1.0 if self.outbox_waiting or not self.outbox_answered else 5.0)
        subject = self.subjects.outbox_subject("gpu")
        sent = 0
        for pe in list(tracker.outbox):
            try:
                payload = NODE_EVENT_CODEC.encode_valid(pe.event)
            except SchemaViolation as exc:
                # never sendable (upstream would refuse it), and it would block every
                # event after it: dropped, loudly
                self.log.error("GPU event dropped: it breaks its own schema", event_id=pe.event_id, error=str(exc))
                tracker.outbox.remove(pe)
                continue
            try:
                await js.publish(subject, payload, headers={MSG_ID_HEADER: pe.event_id})
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                if not self.outbox_waiting:
                    self.log.warning(
                        "GPU events wait for the node outbox (the bus setup makes it); retrying",
                        stream=self.subjects.outbox_stream,
                        queued=len(tracker.outbox) - sent,
                        error=str(exc) or type(exc).__name__,
                    )
                self.outbox_waiting = True
                break
            sent += 1
            self.outbox_answered = True
        if sent:
            tracker.sent(sent)
            self.save()
            # the bridge reads the outbox when told (it has no consumer to be woken by)
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(self.subjects.inventory_journaled, b"")
            if self.outbox_waiting and not tracker.outbox:
                self.log.info("GPU events reach the node outbox again")
        if not tracker.outbox:
            self.outbox_waiting = False
        self.metrics.events_pending.set(len(tracker.outbox))


__all__ = ["Publisher", "mps_root_named"]
