"""Each card's PhysicalGPU status over time: the GpuTracker and the file it lives in.

`physicalgpu.py` holds the rules as pure tables; this module remembers what
those tables need between evaluations and applies them to every card of a
scan:

- the orphan timer (since when a passthrough binding has had no claim,
  without a break),
- the operator's exclusions,
- reclaim requests (held ones are re-gated on every evaluation and start by
  themselves once the card reads Orphaned; started ones run until Succeeded or
  Failed; the Reclaim condition stays after the request ends only while it
  still applies, `reclaim_answer_applies`: a refusal while the managementState
  it named lasts, Succeeded while the card is on its compute driver, Failed
  while it is not),
- disruptions (the boot id at the DisruptionRequired notice; the flow steps
  once per evaluation and clears only on the base driver under a new boot id),
- each card's last listing (who it is), so a card missing from a scan stays listed, lost
  (AdapterReady=False/NotOnBus, Healthy=False/GpuLost) with every hold on it accounted for, until
  it is back or a reboot without it finds nothing claiming it,
- the last status of each card, so an unchanged condition keeps its `since`
  and only a real change (phase, managementState, a condition's status or
  reason) becomes a GpuChanged event,
- what was last said upstream of each card: while the converger's claims are
  not known (at start or later) the status stands fail-closed here, but an
  event says what the claims decide as last said (`reported`), so a converger
  that does not answer for a while is no news upstream,
- the events not yet accepted by the node-bus outbox (journaled before sent).

`GpuTracker` does no I/O; its only outside input is the clock it is given,
so every 2-minute rule runs on fake time in tests. `GpuStateStore` keeps the
tracker's `GpuState` in `<state dir>/gpus.json` (0600, written atomically,
stamped with the boot id); an unreadable file is renamed aside and the
tracker starts fresh, with a warning.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import msgspec

from shared import logs
from shared.eventids import gpu_id
from shared.fsutil import atomic_write, fsync_dir, read_regular
from shared.schemas import Claims, Condition, DriverBinding, Gpu, GpuChanged, GpuClaim, Inventory, MigLayoutState, PhysicalGPUStatus, SwitchReply
from shared.schemas.codec import BoundedDecoder
from shared.schemas.common import PCI_RE
from shared.schemas.inventory import HEALTHY_CONDITION

from .adapters.base import HealthCheck, HealthEvent
from .health import (
    STICKY_FAULTS,
    CardHealth,
    HealthPolicy,
    apply_check,
    apply_event,
    healthy_condition,
    lost_everywhere,
    lost_off_bus,
    note_watched,
    off_bus_condition,
    off_library,
)
from .physicalgpu import (
    ADAPTER_READY,
    DISRUPTION_REASONS,
    DISRUPTION_REQUIRED,
    MANAGED,
    NOT_ON_BUS,
    ORPHAN_GRACE,
    RECLAIM,
    RECLAIM_FAILED,
    RECLAIM_HELD,
    RECLAIM_IN_PROGRESS,
    RECLAIM_SUCCEEDED,
    RECLAIM_TIMEOUT,
    RECONFIGURING,
    CardFacts,
    DisruptionFacts,
    condition_of,
    derive_phase,
    disruption_flow,
    establish_occupancy,
    management_state,
    reclaim_answer_applies,
    reclaim_gate,
    reclaim_progress,
    refusal_stays,
    track_orphan,
)

STATE_FILE = "gpus.json"
STATE_VERSION = 1
#: the largest state file read back (per-card records of a few KiB).
STATE_MAX_BYTES = 16 * 1024 * 1024

#: the order in which claims of one card are read: the first one names the card's claim.
CLAIM_ORDER: tuple[str, ...] = ("allocation", "release", "instance", "domain")

VFIO_REQUIRES_BARE_METAL = "VFIORequiresBareMetal"

#: a Text field's bound (shared.schemas.common.Text); messages are cut to it.
_TEXT_MAX = 4096


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


# --------------------------------------------------------------------------- the persisted state


class ReclaimRequest(msgspec.Struct, kw_only=True):
    requested_at: datetime
    #: None while the request is held (re-gated on every evaluation).
    started_at: datetime | None = None


class Disruption(msgspec.Struct, kw_only=True):
    """A driver switch on the card could not be rolled back (the switcher's DisruptionRequired)."""

    #: the boot the disruption happened in ("" until known: then the boot of the next evaluation).
    boot_id: str = ""
    #: a notice the next evaluation has not consumed yet (it raises or re-raises the flow).
    pending: bool = False
    at: datetime | None = None


class CardRecord(msgspec.Struct, kw_only=True):
    #: the card's vendor uuid as last seen (the nvidia adapter names a vfio-pci card by it).
    uuid: str = ""
    #: the status the last evaluation derived (None before the first).
    status: PhysicalGPUStatus | None = None
    #: the status the last `gpu` event said upstream (None: none yet; from a state file of an
    #: older bcd, `status` stands for it): an event says a change from this, never from a status
    #: held back while the claims are not known yet at start
    said: PhysicalGPUStatus | None = None
    #: since when the card has been a passthrough binding with no claim, without a break.
    orphan_since: datetime | None = None
    excluded: bool = False
    reclaim: ReclaimRequest | None = None
    disruption: Disruption | None = None
    #: the card's health faults and last check (health.py); None before any was seen
    health: CardHealth | None = None
    #: the card as last listed, its identity only (uuid, index, name, memory, NUMA node, drivers):
    #: a card missing from a scan stays listed from it, lost, so every hold on it is accounted for
    listing: Gpu | None = None
    #: since when the card has been missing from the scans (None: listed), and in which boot it went
    missing_since: datetime | None = None
    missing_boot: str = ""

    def keeps_state(self) -> bool:
        """Something beyond the last status must survive while the card is not listed
        (a card that fell off the bus and comes back is still the card that threw the XID)."""
        return self.excluded or self.reclaim is not None or self.disruption is not None or (self.health is not None and self.health.sticky())


class PendingEvent(msgspec.Struct, kw_only=True):
    """A GpuChanged journaled but not yet accepted by the node-bus outbox."""

    event_id: str
    event: GpuChanged


class GpuState(msgspec.Struct, kw_only=True):
    """Everything `gpus.json` holds."""

    version: int = STATE_VERSION
    #: the boot of the last evaluation (a new one is a break of every orphan timer).
    boot_id: str = ""
    saved_at: datetime | None = None
    cards: dict[str, CardRecord] = {}
    outbox: list[PendingEvent] = []


_ENCODER = msgspec.json.Encoder()
_DECODER = BoundedDecoder(GpuState, max_bytes=16 * 1024 * 1024, what="gpus.json")


def encode_state(state: GpuState) -> bytes:
    return _ENCODER.encode(state)


def decode_state(data: bytes) -> GpuState:
    """Decode `gpus.json`; msgspec errors (DecodeError, ValidationError) or ValueError when unreadable."""
    state = _DECODER.decode(data)
    if state.version != STATE_VERSION:
        raise ValueError(f"version {state.version} is not {STATE_VERSION}")
    for pci in state.cards:
        if not PCI_RE.match(pci):
            raise ValueError(f"card key {pci!r} is not a canonical PCI address")
    return state


# --------------------------------------------------------------------------- the tracker


@dataclass
class Evaluation:
    """What one evaluation produced."""

    inventory: Inventory
    #: GpuChanged events this evaluation journaled (also appended to the state's outbox).
    events: list[PendingEvent] = field(default_factory=list)
    #: reclaim outcomes for the metrics: admitted, held, refused, succeeded, failed.
    reclaims: list[str] = field(default_factory=list)
    #: the boot id moved since the last evaluation (orphan timers were reset).
    new_boot: bool = False
    #: the Claims this evaluation used were known (a failed lookup reads Indeterminate).
    claims_known: bool = False


def claims_by_card(claims: Claims | None) -> dict[str, list[GpuClaim]]:
    """Each card's claims, in CLAIM_ORDER (then as listed); empty when `claims` is None."""
    out: dict[str, list[GpuClaim]] = {}
    if claims is None:
        return out
    rank = {kind: i for i, kind in enumerate(CLAIM_ORDER)}
    for c in sorted(claims.claims, key=lambda c: rank.get(c.kind, len(rank))):
        out.setdefault(c.pci_address, []).append(c)
    return out


def claim_text(claims: Sequence[GpuClaim]) -> str | None:
    """The card's claim as CardFacts reads it: the first claim in kind order, as "<kind> <holder>"."""
    if not claims:
        return None
    first = claims[0]
    return f"{first.kind} {first.holder}".strip()


def _cut(text: str) -> str:
    return text if len(text) <= _TEXT_MAX else text[: _TEXT_MAX - 1] + "…"


#: the condition a card's desired MIG layout shows as (status True once Applied).
MIG_LAYOUT = "MigLayout"


def with_mig_layout(status: PhysicalGPUStatus, previous: PhysicalGPUStatus | None, layouts: Mapping[str, MigLayoutState] | None, pci: str) -> PhysicalGPUStatus:
    """`status` with condition MigLayout from the converger's layout state of the card (the one it had
    when the claims could not be read; none when no layout is desired)."""
    if layouts is None:
        kept = condition_of(previous.conditions, MIG_LAYOUT) if previous is not None else None
        return status if kept is None else msgspec.structs.replace(status, conditions=[*status.conditions, kept])
    m = layouts.get(pci)
    if m is None:
        return status
    old = condition_of(previous.conditions, MIG_LAYOUT) if previous is not None else None
    cond = Condition(
        type=MIG_LAYOUT,
        status="True" if m.state == "Applied" else "False",
        reason=m.state,
        message=_cut(f"{m.layout}: {m.message}" if m.message else m.layout),
        since=old.since if old is not None and old.reason == m.state and old.status == ("True" if m.state == "Applied" else "False") else m.since,
    )
    return msgspec.structs.replace(status, conditions=[*status.conditions, cond])


def status_key(status: PhysicalGPUStatus | None) -> tuple[Any, ...] | None:
    """What makes a change an event: phase, managementState, each condition's status and reason."""
    if status is None:
        return None
    return (
        status.phase,
        status.driver_binding.management_state,
        tuple(sorted((c.type, c.status, c.reason) for c in status.conditions)),
    )


#: what a card's status says without the claims: a change here is news even while the claims are
#: not known (the rest, managementState, Managed, Reclaim, MigLayout and the phase they make, is not)
_CLAIM_BLIND = (ADAPTER_READY, RECONFIGURING, HEALTHY_CONDITION)


def with_claimed_parts(status: PhysicalGPUStatus, said: PhysicalGPUStatus) -> PhysicalGPUStatus:
    """`status` with what the claims decide (managementState and every condition but AdapterReady,
    Reconfiguring and Healthy, and AdapterReady=False/VFIORequiresBareMetal, which an instance claim
    makes) as `said` had it, the phase derived again: what upstream may hear of a card while the
    claims are not known (at start or later: nothing it was told changes by itself)."""
    own = {c.type: c for c in status.conditions if c.type in _CLAIM_BLIND}
    told = {c.type: c for c in said.conditions if c.type not in _CLAIM_BLIND}
    ready = condition_of(said.conditions, ADAPTER_READY)
    if ready is not None and ready.reason == VFIO_REQUIRES_BARE_METAL and own.get(ADAPTER_READY, ready).status != "False":
        own[ADAPTER_READY] = ready  # made by an instance claim, not by the card: the claims decide it
    order = [ADAPTER_READY, MANAGED, RECLAIM, RECONFIGURING, HEALTHY_CONDITION, MIG_LAYOUT]
    merged = {**own, **told}
    conditions = [merged[t] for t in order if t in merged] + [c for t, c in merged.items() if t not in order]
    binding = msgspec.structs.replace(status.driver_binding, management_state=said.driver_binding.management_state)
    return PhysicalGPUStatus(phase=derive_phase(binding.mode, conditions), driver_binding=binding, conditions=conditions)


def reported(status: PhysicalGPUStatus, said: PhysicalGPUStatus | None, claims_known: bool) -> PhysicalGPUStatus:
    """What a `gpu` event may say of `status`: itself once the claims are known (or when nothing was
    said of the card yet), else with the claimed parts as last said (with_claimed_parts)."""
    return status if claims_known or said is None else with_claimed_parts(status, said)


def _change_text(status: PhysicalGPUStatus, extra: str = "") -> str:
    key = status_key(status)
    return f"{key!r}|{extra}"


def _keep_since(conditions: list[Condition], previous: Sequence[Condition]) -> list[Condition]:
    out = []
    for c in conditions:
        old = condition_of(previous, c.type)
        if old is not None and old.status == c.status and old.reason == c.reason and old.since != c.since:
            c = msgspec.structs.replace(c, since=old.since)
        out.append(c)
    return out


class GpuTracker:
    """Derives every card's PhysicalGPU status from a scan, the converger's claims and its own state."""

    def __init__(
        self,
        node_id: str,
        *,
        clock: Callable[[], datetime] = utcnow,
        orphan_grace: timedelta = ORPHAN_GRACE,
        reclaim_timeout: timedelta = RECLAIM_TIMEOUT,
        state: GpuState | None = None,
        max_outbox: int = 10_000,
        health: HealthPolicy | None = None,
        health_watched: bool = True,
    ) -> None:
        self.node_id = node_id
        #: None: no Healthy condition at all (a tracker that is not told about health)
        self.health = health
        #: the adapter watches health (False: every card reads Healthy=Unknown/Unmonitored)
        self.health_watched = health_watched
        self.clock = clock
        self.orphan_grace = orphan_grace
        self.reclaim_timeout = reclaim_timeout
        self.state = state if state is not None else GpuState()
        self.max_outbox = max_outbox
        #: whether the last evaluation had the claims (None before the first).
        self.claims_known: bool | None = None
        #: events dropped because the outbox queue was full (the oldest go first).
        self.dropped_events = 0
        #: PCI address -> the answer to a reclaim request that the card's status does not carry
        #: (a refusal on a card on its compute driver): the request's reply takes it (`take_answer`)
        self.answers: dict[str, Condition] = {}

    # ------------------------------------------------------------------ state access

    def card(self, pci: str) -> CardRecord | None:
        return self.state.cards.get(pci)

    def _record(self, pci: str) -> CardRecord:
        return self.state.cards.setdefault(pci, CardRecord())

    def snapshot(self) -> bytes:
        return encode_state(self.state)

    def restore(self, snapshot: bytes) -> None:
        self.state = decode_state(snapshot)

    def excluded(self) -> list[str]:
        return sorted(pci for pci, rec in self.state.cards.items() if rec.excluded)

    def known_uuids(self) -> dict[str, str]:
        return {pci: rec.uuid for pci, rec in self.state.cards.items() if rec.uuid}

    @property
    def outbox(self) -> list[PendingEvent]:
        return self.state.outbox

    def sent(self, count: int) -> None:
        """The first `count` queued events are in the outbox now."""
        del self.state.outbox[:count]

    def timers_running(self) -> bool:
        """Something changes with time alone: evaluate on the short tick, not only on the rescan interval.

        An orphan grace period, a held or started reclaim, a disruption in
        flight, a failed claim lookup (retried), events waiting for the outbox.
        """
        if self.claims_known is False or self.state.outbox:
            return True
        for rec in self.state.cards.values():
            if rec.reclaim is not None or rec.disruption is not None:
                return True
            if rec.orphan_since is not None and (
                rec.status is None or rec.status.driver_binding.management_state != "Orphaned"
            ):
                return True
        return False

    # ------------------------------------------------------------------ operator requests and notices

    def exclude(self, pci: str) -> bool:
        """Exclude the card; False when it already was."""
        rec = self._record(pci)
        if rec.excluded:
            return False
        rec.excluded = True
        return True

    def include(self, pci: str) -> bool:
        """Lift an exclusion; False when the card was not excluded."""
        rec = self.state.cards.get(pci)
        if rec is None or not rec.excluded:
            return False
        rec.excluded = False
        return True

    def request_reclaim(self, pci: str) -> bool:
        """Store a reclaim request (gated on the next evaluation); False when one is already pending."""
        rec = self._record(pci)
        if rec.reclaim is not None:
            return False
        self.answers.pop(pci, None)  # an answer to an earlier request is not this one's
        rec.reclaim = ReclaimRequest(requested_at=self.clock())
        return True

    def take_answer(self, pci: str, status: PhysicalGPUStatus | None) -> Condition | None:
        """The answer to the card's last reclaim request: the one the status does not carry, else its Reclaim condition."""
        kept = self.answers.pop(pci, None)
        return kept if kept is not None else (condition_of(status.conditions, RECLAIM) if status is not None else None)

    def note_switch(self, reply: SwitchReply) -> None:
        """The switcher's result notice: a DisruptionRequired is recorded with the boot it happened in."""
        if reply.outcome != DISRUPTION_REQUIRED or not PCI_RE.match(reply.pci):
            return
        rec = self._record(reply.pci)
        old = rec.disruption
        rec.disruption = Disruption(
            boot_id=reply.boot_id or (old.boot_id if old is not None else ""),
            pending=True,
            at=reply.at,
        )

    # ------------------------------------------------------------------ health (health.py)

    def _health(self, pci: str) -> CardHealth:
        rec = self._record(pci)
        if rec.health is None:
            rec.health = CardHealth()
        return rec.health

    def sticky_faults(self, pci: str) -> list[str]:
        """The card's sticky faults (those only a reset, a reboot or an operator's check after one clear)."""
        rec = self.state.cards.get(pci)
        return sorted(r for r in rec.health.faults if r in STICKY_FAULTS) if rec is not None and rec.health is not None else []

    def note_health_event(self, event: HealthEvent, *, boot_id: str = "") -> tuple[str, bool]:
        """One event of the watch; (fatal | ignored | noted | unmonitored, whether a card's health changed)."""
        if self.health is None or not PCI_RE.match(event.pci_address):
            return "ignored", False
        if event.kind == "xid" and event.xid is not None and not self.health.xid_fatal(event.xid):
            return "ignored", False  # an ignored XID changes nothing (not even a record)
        return apply_event(self._health(event.pci_address), event, self.health, boot_id or self.state.boot_id)

    def note_health_checks(
        self, checks: Sequence[HealthCheck], *, recheck: str = "", boot_id: str = ""
    ) -> tuple[bool, dict[str, list[str]]]:
        """One periodic check of every card; (changed, the sticky reasons cleared, by card).
        `recheck`: the card an operator asked to check again after a reset (its sticky faults may clear)."""
        if self.health is None:
            return False, {}
        now = self.clock()
        changed, cleared = False, {}
        for check in checks:
            if not PCI_RE.match(check.pci_address):
                continue
            c, gone = apply_check(
                self._health(check.pci_address), check, self.health, boot_id=boot_id or self.state.boot_id, now=now, recheck=check.pci_address == recheck
            )
            changed |= c
            if gone:
                cleared[check.pci_address] = gone
        return changed, cleared

    def note_health_watched(self, pcis: Sequence[str]) -> bool:
        """Events are registered for these cards again: their Unmonitored clears."""
        changed = False
        for pci in pcis:
            rec = self.state.cards.get(pci)
            if rec is not None and rec.health is not None:
                changed |= note_watched(rec.health)
        return changed

    def note_library_gone(self, pcis: Sequence[str], message: str, *, boot_id: str = "") -> bool:
        """The vendor library does not answer at all: each of these cards is lost (GpuLost, sticky)."""
        if self.health is None:
            return False
        now = self.clock()
        changed = False
        for pci in pcis:
            if PCI_RE.match(pci):
                changed |= lost_everywhere(self._health(pci), message, now=now, boot_id=boot_id or self.state.boot_id)
        return changed

    # ------------------------------------------------------------------ evaluation

    def _missing(self, inv: Inventory, by_card: Mapping[str, list[GpuClaim]], claims_known: bool, known: Inventory | None, now: datetime) -> list[Gpu]:
        """The cards this scan misses that stay listed, lost (AdapterReady=False/NotOnBus, Healthy=False/GpuLost).

        A card that was listed and is not any more fell off the bus (or was taken out): it stays
        listed from its last listing, so a hold on it is still accounted for (the converger's claims
        keep naming it, its hold says DevicesHealthy=False) and a card that comes back is known to be
        held before it is reported. It goes only after a reboot in which it is still missing, once
        the claims are known and none names it (the machine was rebuilt without it).
        """
        listed = {g.pci_address for g in inv.gpus}
        before = {g.pci_address: g for g in known.gpus} if known is not None else {}
        out: list[Gpu] = []
        for pci, rec in sorted(self.state.cards.items()):
            if pci in listed:
                continue
            last = rec.listing or _identity(before.get(pci))
            if last is None:
                continue  # never listed (an exclusion made before the card was seen): nothing to relist
            if rec.missing_since is None:
                rec.missing_since, rec.missing_boot = now, inv.boot_id
                if self.health is not None:
                    lost_off_bus(self._health(pci), at=now, boot_id=inv.boot_id)
            elif rec.missing_boot and inv.boot_id and rec.missing_boot != inv.boot_id and claims_known and not by_card.get(pci):
                del self.state.cards[pci]  # missing through a reboot and held by nothing: gone for good
                continue
            rec.listing = last
            out.append(_lost_gpu(last, rec.missing_since))
        return out

    def evaluate(
        self, inv: Inventory, claims: Claims | None, *, switch: SwitchReply | None = None, known: Inventory | None = None
    ) -> Evaluation:
        """Every listed card's status, from `inv` (a fresh scan) and `claims` (None: the lookup failed).

        Returns the inventory with each Gpu.status replaced, and journals a
        GpuChanged for every card whose phase, managementState or a
        condition's status or reason changed. `switch`, the notice that
        caused this evaluation, adds its event (VFIOPrepareSucceeded, ...) to
        its card's report. A card the scan misses stays listed, lost (`_missing`);
        `known` (the last published inventory) names such a card when a state
        file of an older bcd kept no listing of it.
        """
        now = self.clock()
        state = self.state
        new_boot = bool(state.boot_id) and bool(inv.boot_id) and inv.boot_id != state.boot_id
        if new_boot:
            # a reboot is a break: the binding was made again in the new boot
            for rec in state.cards.values():
                rec.orphan_since = None
        if inv.boot_id:
            state.boot_id = inv.boot_id
        claims_known = claims is not None
        self.claims_known = claims_known
        by_card = claims_by_card(claims)
        layouts = {m.pci_address: m for m in claims.mig_layouts} if claims is not None else None
        result = Evaluation(inventory=inv, new_boot=new_boot, claims_known=claims_known)
        switch_event = switch if switch is not None and switch.event else None

        gpus: list[Gpu] = []
        listed: set[str] = set()
        scanned = {g.pci_address for g in inv.gpus}
        lost = self._missing(inv, by_card, claims_known, known, now)
        for g in sorted([*inv.gpus, *lost], key=lambda g: (g.index, g.pci_address)):
            pci = g.pci_address
            listed.add(pci)
            rec = self._record(pci)
            if g.uuid:
                rec.uuid = g.uuid
            if pci in scanned:
                rec.listing, rec.missing_since, rec.missing_boot = _identity(g), None, ""
            previous = rec.status
            status = self._derive(
                g,
                rec,
                now=now,
                claims_known=claims_known,
                claims=by_card.get(pci, []),
                virtualized=inv.host.virtualized,
                boot_id=inv.boot_id,
                outcomes=result.reclaims,
            )
            status = with_mig_layout(status, rec.status, layouts, pci)
            rec.status = status
            gpus.append(msgspec.structs.replace(g, status=status))
            if rec.said is None and previous is not None:
                rec.said = previous  # a state file of an older bcd: its last status was said
            notice = switch_event if switch_event is not None and switch_event.pci == pci else None
            # what upstream may hear: while the claims are not known (the converger does not answer,
            # at start or later) the status stands fail-closed here, but what only the claims decide
            # is no news: it is said as it was last said, so upstream hears only a change of the card
            # itself (its health, driver, Reconfiguring), never an Unknown that did not happen
            told = reported(status, rec.said, claims_known)
            if notice is not None:
                result.events.append(self._event(pci, g.uuid, told, now, notice))
                rec.said = told
            elif status_key(rec.said) != status_key(told):
                result.events.append(self._event(pci, g.uuid, told, now))
                rec.said = told

        if switch_event is not None and switch_event.pci not in listed and PCI_RE.match(switch_event.pci):
            # the card is not on the bus any more (it vanished during the switch): report what is known
            rec = state.cards.get(switch_event.pci)
            last = rec.status if rec is not None and rec.status is not None else PhysicalGPUStatus()
            gone = msgspec.structs.replace(
                last, driver_binding=msgspec.structs.replace(last.driver_binding, driver="", mode="None")
            )
            gone = reported(gone, rec.said if rec is not None else None, claims_known)
            result.events.append(
                self._event(switch_event.pci, rec.uuid if rec is not None else "", gone, switch_event.at, switch_event)
            )

        for pci in list(state.cards):
            if pci in listed:
                continue
            rec = state.cards[pci]
            rec.orphan_since = None  # not listed: no binding to time
            if not rec.keeps_state():
                del state.cards[pci]

        self._journal(result.events)
        result.inventory = msgspec.structs.replace(inv, gpus=gpus)
        return result

    def _derive(
        self,
        g: Gpu,
        rec: CardRecord,
        *,
        now: datetime,
        claims_known: bool,
        claims: Sequence[GpuClaim],
        virtualized: bool,
        boot_id: str,
        outcomes: list[str],
    ) -> PhysicalGPUStatus:
        pci = g.pci_address
        previous = rec.status.conditions if rec.status is not None else []
        mode = g.status.driver_binding.mode
        driver, base = g.driver, g.base_driver

        # AdapterReady: what the scan says, unless a VFIO claim cannot be honoured here
        ready = condition_of(g.status.conditions, ADAPTER_READY)
        instance = next((c for c in claims if c.kind == "instance"), None)
        if virtualized and instance is not None:
            ready = Condition(
                type=ADAPTER_READY,
                status="False",
                reason=VFIO_REQUIRES_BARE_METAL,
                message=_cut(
                    f"instance {instance.holder} claims {pci} for VFIO passthrough, "
                    "but this node is virtualized: VFIO passthrough requires bare metal"
                ),
                since=now,
            )

        # Managed and managementState
        facts = CardFacts(
            now=now,
            pci_address=pci,
            driver=driver,
            base_driver=base,
            mode=mode,
            claim=claim_text(claims) if claims_known else None,
            claim_known=claims_known,
            excluded=rec.excluded,
            orphan_grace=self.orphan_grace,
        )
        rec.orphan_since = track_orphan(rec.orphan_since, facts, now)
        facts = replace(facts, passthrough_unclaimed_since=rec.orphan_since)
        mstate, managed = management_state(facts)

        # Reclaim
        reclaim = condition_of(previous, RECLAIM)
        request = rec.reclaim
        if request is not None and request.started_at is None:
            occupancy_known, occupied = establish_occupancy(self.node_id, pci, claims_known, facts.claim)
            decision = reclaim_gate(mstate, managed.reason, occupancy_known, occupied)
            reclaim = decision.condition(now)
            if decision.verdict == "admit":
                request.started_at = now
                outcomes.append("admitted")
            elif decision.verdict == "refuse":
                rec.reclaim = None
                outcomes.append("refused")
                if not refusal_stays(mode):
                    # on its compute driver there is nothing to reclaim: the request hears it, the card keeps nothing
                    self.answers[pci] = msgspec.structs.replace(
                        reclaim, message=_cut(f"{reclaim.message}: the card is on its compute driver ({driver or 'none'}), nothing to reclaim")
                    )
                    reclaim = None
            elif _newly_held(previous):
                outcomes.append("held")
        elif request is not None and request.started_at is not None:
            reclaim = reclaim_progress(request.started_at, now, mode, timeout=self.reclaim_timeout)
            if reclaim.reason in (RECLAIM_SUCCEEDED, RECLAIM_FAILED):
                rec.reclaim = None
                outcomes.append("succeeded" if reclaim.reason == RECLAIM_SUCCEEDED else "failed")
        elif reclaim is not None:
            # no request: the answer of the last one stays only while it still describes the card
            previous_state = rec.status.driver_binding.management_state if rec.status is not None else None
            if not reclaim_answer_applies(reclaim, previous_state, mstate, mode):
                reclaim = None

        # Reconfiguring (the disruption flow; it waits, as it was, while the card is missing from the scans)
        reconf = condition_of(previous, RECONFIGURING)
        disruption = rec.disruption
        if rec.missing_since is None:
            pending = disruption is not None and disruption.pending
            at_disruption = disruption.boot_id if disruption is not None and disruption.boot_id else boot_id
            reconf = disruption_flow(
                reconf,
                DisruptionFacts(
                    now=now,
                    pci_address=pci,
                    driver=driver,
                    base_driver=base,
                    boot_id_now=boot_id,
                    boot_id_at_disruption=at_disruption if disruption is not None else "",
                    rollback_impossible=pending,
                ),
            )
            if disruption is not None:
                disruption.pending = False
                if not disruption.boot_id:
                    disruption.boot_id = boot_id
                if reconf is None or reconf.reason not in DISRUPTION_REASONS:
                    rec.disruption = None  # cleared: the card is back on its base driver after a new boot

        # a card off its compute driver is one the vendor library cannot see: its last check is
        # forgotten (a card back from a VM is NotChecked until checked again), it is never Checked
        unseen = "" if mode == "Compute" or rec.missing_since is not None else (f"on {driver}" if driver else "on no driver")
        if unseen and rec.health is not None:
            off_library(rec.health)
        healthy = (
            healthy_condition(rec.health, self.health, now=now, watched=self.health_watched, unseen=unseen) if self.health is not None else None
        )
        if healthy is not None and rec.missing_since is not None and healthy.status != "False":
            # health not watched: the scan alone says the card is lost
            healthy = off_bus_condition(rec.missing_since)
        conditions = [c for c in (ready, managed, reclaim, reconf, healthy) if c is not None]
        conditions = _keep_since(conditions, previous)
        return PhysicalGPUStatus(
            phase=derive_phase(mode, conditions),
            driver_binding=DriverBinding(driver=driver, mode=mode, management_state=mstate),
            conditions=conditions,
        )

    # ------------------------------------------------------------------ events

    def _event(self, pci: str, uuid: str, status: PhysicalGPUStatus, at: datetime, reply: SwitchReply | None = None) -> PendingEvent:
        """A `gpu` event of a status change, or of the switch `reply` behind it (its instant and its event)."""
        extra = f"{reply.event}|{reply.outcome}|{reply.target}|{reply.reason}" if reply is not None else ""
        return PendingEvent(
            event_id=gpu_id(self.node_id, pci, reply.at if reply is not None else at, _change_text(status, extra)),
            event=GpuChanged(
                pci_address=pci,
                uuid=uuid,
                phase=status.phase,
                management_state=status.driver_binding.management_state,
                status=status,
                reason=reply.event if reply is not None else "",
                message=_cut(reply.message) if reply is not None else "",
            ),
        )

    def _journal(self, events: list[PendingEvent]) -> None:
        queue = self.state.outbox
        queue.extend(events)
        over = len(queue) - self.max_outbox
        if over > 0:
            del queue[:over]
            self.dropped_events += over


def _identity(g: Gpu | None) -> Gpu | None:
    """What a listing of a card keeps while it is away: who it is, not what it had (no MIG instances,
    slots or status: a lost card has no atoms but its whole-card id, which names its holds)."""
    if g is None or not g.uuid:
        return None
    return msgspec.structs.replace(
        g, mig_profiles=[], mig_instances=[], gpu_instances=[], slots=[], mps_running=False, mig_mode=False, status=PhysicalGPUStatus()
    )


def _lost_gpu(last: Gpu, since: datetime) -> Gpu:
    """A card missing from the scan as the scan would have listed it: no driver, AdapterReady=False/NotOnBus."""
    ready = Condition(
        type=ADAPTER_READY,
        status="False",
        reason=NOT_ON_BUS,
        message=_cut(f"the card is not on the bus any more: missing from every scan since {since.strftime('%Y-%m-%dT%H:%M:%SZ')}"),
        since=since,
    )
    return msgspec.structs.replace(
        last, driver="", status=PhysicalGPUStatus(driver_binding=DriverBinding(driver="", mode="None"), conditions=[ready])
    )


def _newly_held(previous: Sequence[Condition]) -> bool:
    """A held request counts as held once: when the card did not read Reclaim Held before."""
    old = condition_of(previous, RECLAIM)
    return old is None or old.reason != RECLAIM_HELD


def reclaim_condition(status: PhysicalGPUStatus | None) -> Condition | None:
    return condition_of(status.conditions, RECLAIM) if status is not None else None


def reclaim_accepted(condition: Condition | None) -> bool:
    """A reclaim request that is held or running (not refused)."""
    return condition is not None and condition.reason in (RECLAIM_HELD, RECLAIM_IN_PROGRESS)


# --------------------------------------------------------------------------- the file


class StateFileError(Exception):
    """The state file cannot be read or written (the text says which and why)."""


class GpuStateStore:
    """`<directory>/gpus.json`: 0600, written atomically; an unreadable one is renamed aside."""

    def __init__(self, directory: Path | str, *, log: Any = None, clock: Callable[[], float] = time.time) -> None:
        self.directory = Path(directory)
        self.path = self.directory / STATE_FILE
        self.log = log if log is not None else logs.get_logger("bcd.inventory")
        self.clock = clock
        #: the content (without saved_at) of the last save or load: an unchanged state is not rewritten.
        self._last: bytes | None = None
        #: why the file must not be written ("" when it may): a file that exists but could not be
        #: read (or set aside) is never overwritten with a fresh state.
        self.disabled = ""

    def ensure_dir(self) -> None:
        """Create the directory (0700) when missing; StateFileError when that fails."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StateFileError(f"cannot create {self.directory}: {exc.strerror or exc}") from None

    def load(self) -> GpuState:
        """The saved state; a fresh one when there is none or it cannot be decoded (renamed aside)."""
        try:
            data = read_regular(self.path, max_bytes=STATE_MAX_BYTES)
        except FileNotFoundError:
            return GpuState()
        except OSError as exc:
            self.disabled = f"cannot read {self.path}: {exc.strerror or exc}"
            raise StateFileError(self.disabled) from None
        try:
            state = decode_state(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            aside = self.path.with_name(f"{self.path.name}.unreadable-{int(self.clock())}")
            try:
                os.replace(self.path, aside)
                fsync_dir(self.directory)
            except OSError as move_exc:
                self.disabled = f"{self.path} is unreadable ({exc}) and cannot be moved aside: {move_exc}"
                raise StateFileError(self.disabled) from None
            self.log.warning(
                "GPU state file unreadable; renamed aside, starting with no exclusions, reclaims or disruptions",
                path=str(self.path),
                renamed_to=str(aside),
                error=str(exc),
            )
            return GpuState()
        self._last = encode_state(msgspec.structs.replace(state, saved_at=None))
        return state

    def save(self, state: GpuState, *, now: datetime | None = None) -> bool:
        """Write the state when it changed since the last save or load; True when it wrote."""
        if self.disabled:
            raise StateFileError(f"not saving: {self.disabled}")
        key = encode_state(msgspec.structs.replace(state, saved_at=None))
        if key == self._last:
            return False
        data = encode_state(msgspec.structs.replace(state, saved_at=now or datetime.now(timezone.utc)))
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write(self.path, data, 0o600)
        except OSError as exc:
            raise StateFileError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        self._last = key
        return True


def state_dir_from(data_dir: Path | str) -> Path:
    """Where the inventory keeps its state under a node's data dir (like `<data_dir>/converger`)."""
    return Path(data_dir) / "inventory"


__all__ = [
    "STATE_FILE",
    "CLAIM_ORDER",
    "VFIO_REQUIRES_BARE_METAL",
    "ReclaimRequest",
    "Disruption",
    "CardRecord",
    "PendingEvent",
    "GpuState",
    "encode_state",
    "decode_state",
    "Evaluation",
    "claims_by_card",
    "claim_text",
    "status_key",
    "GpuTracker",
    "reclaim_condition",
    "reclaim_accepted",
    "StateFileError",
    "GpuStateStore",
    "state_dir_from",
]
