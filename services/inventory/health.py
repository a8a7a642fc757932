"""A card's health as one condition, `Healthy` (issue 30): the rules, pure, with no clock and no I/O.

What the vendor library says between scans (a `HealthEvent`: an XID, an ECC error, the card
lost) and what each periodic check finds (a `HealthCheck`: the library still answers the card,
rows wait to be remapped, the volatile ECC counters) become faults in the card's `CardHealth`,
which the GpuTracker keeps in gpus.json, so a kill -9 of the inventory forgets nothing.

Two kinds of fault:

- sticky (GpuLost, XidCritical, EccUncorrectable, RowRemapFailed): never cleared by time or by
  a later clean check alone. A card comes back only when someone acted: a reboot (a fault from
  an earlier boot clears at the first clean check of a new boot) or an operator's `bcd gpu
  recheck` after a reset (every sticky fault clears when that check is clean; the service asks
  for that only on a card nothing holds: a held card cannot have been reset);
- level (RowRemapPending, EccCorrectable over its threshold, Unmonitored): each check sets or
  clears it. Remapped rows stay pending until a reset, so this too needs someone to act.

The condition is False with the worst reason (HEALTH_ORDER) while any fault but Unmonitored
stands, Unknown/Unmonitored when only watching is impossible, True/Checked when a check of the
card on its compute driver found nothing, Unknown/NotChecked before such a check; its
message is the worst fault's, then `also <Reason>: <message>` for each other one.

A card off its compute driver (on vfio-pci, or on none) is one the vendor library cannot see:
no event and no check reads it, so nothing says it is healthy now. It reads NotChecked
(`healthy_condition(..., unseen=...)`), and `off_library` forgets its last check, so a card
back from a VM reads NotChecked too until the first check of it on its compute driver. A fault
it had stays (a sticky one as always; a level one until a check clears it): only a check of
the card can say it is gone; Unmonitored, which is about registering the card's events, clears. Healthy=False makes the phase Failed (physicalgpu.PHASE_ROWS).

Which XIDs are fatal follows NVIDIA's device plugin: every XID but the application ones
(13, 31, 43, 45, 68, 109: a program's fault, not the card's) and those an operator ignores;
`fatal_xids` makes an ignored one fatal again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import msgspec

from shared.schemas import Condition
from shared.schemas.inventory import HEALTHY_CONDITION

from .adapters.base import HealthCheck, HealthEvent

HEALTHY = HEALTHY_CONDITION

GPU_LOST = "GpuLost"
XID_CRITICAL = "XidCritical"
ECC_UNCORRECTABLE = "EccUncorrectable"
ROW_REMAP_FAILED = "RowRemapFailed"
ROW_REMAP_PENDING = "RowRemapPending"
ECC_CORRECTABLE = "EccCorrectable"
UNMONITORED = "Unmonitored"
#: the reason of Healthy=True
CHECKED = "Checked"
#: Healthy=Unknown before any check saw the card (one on vfio-pci since the inventory started)
NOT_CHECKED = "NotChecked"

#: worst first: the condition's reason is the first fault of this order that stands.
HEALTH_ORDER: tuple[str, ...] = (GPU_LOST, XID_CRITICAL, ECC_UNCORRECTABLE, ROW_REMAP_FAILED, ROW_REMAP_PENDING, ECC_CORRECTABLE, UNMONITORED)
STICKY_FAULTS = frozenset({GPU_LOST, XID_CRITICAL, ECC_UNCORRECTABLE, ROW_REMAP_FAILED})

#: XIDs a program causes, not the card (NVIDIA's device plugin skips the same ones).
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})

#: what an XID means, for messages (NVIDIA's XID catalogue); others read "XID <n>".
XID_TEXT: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    32: "invalid or corrupted push buffer stream",
    38: "driver firmware error",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "NVDEC0 exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout error",
    119: "GSP RPC timeout",
    120: "GSP error",
    121: "C2C link corrected error",
    140: "unrecovered ECC error",
    154: "GPU recovery action changed",
}

#: how many faults' messages a condition's message lists (every reason once at most).
_MESSAGE_MAX = 1000


@dataclass(frozen=True)
class HealthPolicy:
    """What an operator configures: which XIDs are fatal, the ECC thresholds, whether to watch at all."""

    #: False: no watching (`--health-checks off`); every card reads Healthy=Unknown/Unmonitored.
    enabled: bool = True
    ignored_xids: frozenset[int] = APPLICATION_XIDS
    #: fatal even when ignored (an operator who wants XID 43 to take a card out)
    fatal_xids: frozenset[int] = frozenset()
    #: more uncorrectable (double-bit) errors since the last reset than this: EccUncorrectable
    ecc_uncorrectable_max: int = 0
    #: more correctable (single-bit) errors since the last reset than this: EccCorrectable; None: no limit
    ecc_correctable_max: int | None = None

    def xid_fatal(self, xid: int) -> bool:
        return xid in self.fatal_xids or xid not in self.ignored_xids


class HealthFault(msgspec.Struct, kw_only=True):
    """One reason a card is not healthy, as first seen (a repeat only counts)."""

    reason: str
    message: str
    #: when it was first seen
    at: datetime
    #: the boot it was seen in (a sticky fault of an earlier boot clears at a clean check)
    boot_id: str = ""
    xid: int | None = None
    count: int = 1


class CardHealth(msgspec.Struct, kw_only=True):
    """A card's faults (by reason) and what its last check read: part of its CardRecord in gpus.json."""

    faults: dict[str, HealthFault] = {}
    checked_at: datetime | None = None
    ecc_uncorrectable: int | None = None
    ecc_correctable: int | None = None

    def sticky(self) -> bool:
        return any(r in STICKY_FAULTS for r in self.faults)


def xid_text(xid: int) -> str:
    what = XID_TEXT.get(xid)
    return f"XID {xid} ({what})" if what else f"XID {xid}"


def _where(event: HealthEvent) -> str:
    if event.gi is None:
        return ""
    return f" on MIG gi{event.gi}" + (f"/ci{event.ci}" if event.ci is not None else "")


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ") if at.utcoffset() is not None else at.isoformat()


def _raise(health: CardHealth, reason: str, message: str, at: datetime, boot_id: str, xid: int | None = None) -> bool:
    """Record a fault; True when the card's condition changes (a reason it did not have).

    A fault seen again only counts (and notes the boot it was seen in): its first words and
    instant stay, so a storm of one XID, or a check that finds the same thing every interval,
    publishes nothing new and says nothing new upstream (the XID counter counts each one)."""
    old = health.faults.get(reason)
    if old is None:
        health.faults[reason] = HealthFault(reason=reason, message=message, at=at, boot_id=boot_id, xid=xid)
        return True
    old.count += 1
    if boot_id and old.boot_id != boot_id:
        old.boot_id = boot_id  # seen again in this boot: a reboot alone does not clear it now
    return False


def _clear(health: CardHealth, reasons: Iterable[str]) -> bool:
    gone = [r for r in reasons if r in health.faults]
    for r in gone:
        del health.faults[r]
    return bool(gone)


#: what apply_event made of an event (for the metrics and the log).
EventOutcome = str  # "fatal" | "ignored" | "noted" | "unmonitored"


def apply_event(health: CardHealth, event: HealthEvent, policy: HealthPolicy, boot_id: str) -> tuple[EventOutcome, bool]:
    """Record one event; (what it was, whether the card's faults changed)."""
    at = event.at
    where = _where(event)
    if event.kind == "xid":
        xid = event.xid if event.xid is not None else -1
        if not policy.xid_fatal(xid):
            return "ignored", False
        text = f"{xid_text(xid)}{where} at {_stamp(at)}" + (f": {event.message}" if event.message else "")
        return "fatal", _raise(health, XID_CRITICAL, text, at, boot_id, xid)
    if event.kind == "ecc-uncorrectable":
        text = f"uncorrectable (double-bit) ECC error{where} at {_stamp(at)}" + (f": {event.message}" if event.message else "")
        return "fatal", _raise(health, ECC_UNCORRECTABLE, text, at, boot_id)
    if event.kind == "gone":
        text = f"the card stopped answering at {_stamp(at)}" + (f": {event.message}" if event.message else "")
        return "fatal", _raise(health, GPU_LOST, text, at, boot_id)
    if event.kind == "unmonitored":
        text = event.message or "events cannot be registered for this card"
        return "unmonitored", _raise(health, UNMONITORED, text, at, boot_id)
    # a single-bit ECC error is corrected: counted, and judged by the threshold at the next check
    return "noted", False


def check_clean(check: HealthCheck, policy: HealthPolicy) -> bool:
    """The check finds nothing wrong with the card (what recovery needs)."""
    return (
        check.answers
        and not check.row_remap_pending
        and not check.row_remap_failed
        and (check.ecc_uncorrectable is None or check.ecc_uncorrectable <= policy.ecc_uncorrectable_max)
    )


def apply_check(
    health: CardHealth, check: HealthCheck, policy: HealthPolicy, *, boot_id: str, now: datetime, recheck: bool = False
) -> tuple[bool, list[str]]:
    """Record one check; (whether the faults changed, the sticky reasons it cleared).

    A clean check clears the sticky faults of an earlier boot (the card was rebooted since), or
    every sticky fault when `recheck` (the operator reset the card and asked for this check).
    """
    changed = False
    cleared: list[str] = []
    if check_clean(check, policy):
        stale = [r for r, f in health.faults.items() if r in STICKY_FAULTS and (recheck or (boot_id and f.boot_id and f.boot_id != boot_id))]
        if _clear(health, stale):
            changed, cleared = True, sorted(stale)
    if not check.answers:
        changed |= _raise(health, GPU_LOST, "the vendor library does not answer the card" + (f": {check.message}" if check.message else ""), now, boot_id)
    if check.row_remap_failed:
        changed |= _raise(health, ROW_REMAP_FAILED, "a row could not be remapped: the card needs service", now, boot_id)
    if check.row_remap_pending:
        changed |= _raise(health, ROW_REMAP_PENDING, "remapped rows are pending: reset the card (bcd gpu reset) or reboot", now, boot_id)
    else:
        changed |= _clear(health, [ROW_REMAP_PENDING])
    if check.ecc_uncorrectable is not None and check.ecc_uncorrectable > policy.ecc_uncorrectable_max:
        changed |= _raise(
            health,
            ECC_UNCORRECTABLE,
            f"{check.ecc_uncorrectable} uncorrectable ECC errors since the last reset (limit {policy.ecc_uncorrectable_max})",
            now,
            boot_id,
        )
    limit = policy.ecc_correctable_max
    if limit is not None and check.ecc_correctable is not None and check.ecc_correctable > limit:
        changed |= _raise(health, ECC_CORRECTABLE, f"{check.ecc_correctable} correctable ECC errors since the last reset (limit {limit})", now, boot_id)
    else:
        changed |= _clear(health, [ECC_CORRECTABLE])
    if check.unmonitored:
        changed |= _raise(health, UNMONITORED, check.unmonitored, now, boot_id)
    health.checked_at = now
    health.ecc_uncorrectable, health.ecc_correctable = check.ecc_uncorrectable, check.ecc_correctable
    return changed, cleared


def lost_off_bus(health: CardHealth, *, at: datetime, boot_id: str) -> bool:
    """The card is missing from a scan of the host (it fell off the bus): lost, sticky like any GpuLost."""
    return _raise(health, GPU_LOST, f"the card is not on the bus any more: missing from the scan since {_stamp(at)}", at, boot_id)


def off_bus_condition(at: datetime) -> Condition:
    """Healthy of a card missing from the scans when health is not watched: the scan alone says it is lost."""
    return Condition(type=HEALTHY, status="False", reason=GPU_LOST, message=f"the card is not on the bus any more: missing from the scan since {_stamp(at)}", since=at)


def off_library(health: CardHealth) -> bool:
    """The card is where the vendor library cannot see it (vfio-pci, no driver): its last check no
    longer describes it (forgotten: it reads NotChecked until a check of it on its compute driver)
    and Unmonitored, about registering its events, clears; its faults stay. True when something changed."""
    changed = health.checked_at is not None or health.ecc_uncorrectable is not None or health.ecc_correctable is not None
    health.checked_at = None
    health.ecc_uncorrectable = health.ecc_correctable = None
    return _clear(health, [UNMONITORED]) or changed


def note_watched(health: CardHealth) -> bool:
    """Events are registered for the card again: Unmonitored clears."""
    return _clear(health, [UNMONITORED])


def lost_everywhere(health: CardHealth, message: str, *, now: datetime, boot_id: str) -> bool:
    """The vendor library does not answer at all (NVML gone): the card cannot be used or watched."""
    return _raise(health, GPU_LOST, f"the vendor library does not answer: {message}", now, boot_id)


def healthy_condition(health: CardHealth | None, policy: HealthPolicy, *, now: datetime, watched: bool = True, unseen: str = "") -> Condition:
    """The card's Healthy condition. `watched`: the adapter watches health at all. `unseen`: where the
    card is that the vendor library cannot see it ("on vfio-pci"; "": it can): no check of it stands
    then, whatever the record says, so it is never True/Checked; a fault it had stays."""
    if not policy.enabled:
        return Condition(type=HEALTHY, status="Unknown", reason=UNMONITORED, message="health checks are off (--health-checks off)", since=now)
    if not watched:
        return Condition(type=HEALTHY, status="Unknown", reason=UNMONITORED, message="this adapter cannot watch GPU health", since=now)
    faults = [health.faults[r] for r in HEALTH_ORDER if health is not None and r in health.faults and not (unseen and r == UNMONITORED)]
    if not faults and unseen:
        return Condition(
            type=HEALTHY, status="Unknown", reason=NOT_CHECKED, message=f"not checked: the card is {unseen}, where the vendor library cannot see it", since=now
        )
    if not faults and (health is None or health.checked_at is None):
        return Condition(
            type=HEALTHY, status="Unknown", reason=NOT_CHECKED, message="not checked yet: the vendor library has not seen the card (on vfio-pci, or not read yet)", since=now
        )
    if not faults:
        return Condition(type=HEALTHY, status="True", reason=CHECKED, message="no fatal XID, ECC within limits, the vendor library answers", since=now)
    worst = faults[0]
    # the worst fault's own words (the reason is the condition's), then each other one by its reason
    message = "; ".join(("" if i == 0 else f"also {f.reason}: ") + f.message for i, f in enumerate(faults))
    if len(message) > _MESSAGE_MAX:
        message = message[: _MESSAGE_MAX - 1] + "…"
    status = "Unknown" if worst.reason == UNMONITORED else "False"
    return Condition(type=HEALTHY, status=status, reason=worst.reason, message=message, since=worst.at)


__all__ = [
    "HEALTHY",
    "GPU_LOST",
    "XID_CRITICAL",
    "ECC_UNCORRECTABLE",
    "ROW_REMAP_FAILED",
    "ROW_REMAP_PENDING",
    "ECC_CORRECTABLE",
    "UNMONITORED",
    "CHECKED",
    "NOT_CHECKED",
    "HEALTH_ORDER",
    "STICKY_FAULTS",
    "APPLICATION_XIDS",
    "XID_TEXT",
    "HealthPolicy",
    "HealthFault",
    "CardHealth",
    "xid_text",
    "apply_event",
    "check_clean",
    "apply_check",
    "note_watched",
    "off_library",
    "lost_everywhere",
    "lost_off_bus",
    "off_bus_condition",
    "healthy_condition",
]
