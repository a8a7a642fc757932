"""The PhysicalGPU derivation tables (seed 003, issue 6): every row, the 2-minute rules on fake time,
and a reclaim attempt on each managementState value."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.inventory.physicalgpu import (
    MANAGED_REASONS,
    MANAGEMENT_ROWS,
    ORPHAN_GRACE,
    PHASE_ROWS,
    RECLAIM_TIMEOUT,
    CardFacts,
    DisruptionFacts,
    derive_phase,
    disruption_flow,
    establish_occupancy,
    management_row,
    management_state,
    phase_row,
    reclaim_answer_applies,
    reclaim_gate,
    reclaim_progress,
    track_orphan,
)
from shared.schemas import Condition

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
PCI = "0000:3b:00.0"
ALMOST = timedelta(minutes=1, seconds=59)
TWO = timedelta(minutes=2)


def cond(type_: str, status: str, reason: str = "", since: datetime = T0) -> Condition:
    return Condition(type=type_, status=status, reason=reason, since=since)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- phase

READY = cond("AdapterReady", "True", "AdapterReady")
NOT_READY = cond("AdapterReady", "False", "NoDriver")
BARE_METAL = cond("AdapterReady", "False", "VFIORequiresBareMetal")
READY_UNKNOWN = cond("AdapterReady", "Unknown")
SICK = cond("Healthy", "False", "XidCritical")


def reconf(reason: str, status: str = "True") -> Condition:
    return cond("Reconfiguring", status, reason)


PHASE_CASES = [
    # (row, mode, conditions, phase)
    pytest.param("passthrough", "Passthrough", [], "Passthrough", id="passthrough-no-conditions"),
    pytest.param("passthrough", "Passthrough", [NOT_READY], "Passthrough", id="passthrough-adapter-not-ready"),
    pytest.param(
        "passthrough", "Passthrough", [BARE_METAL, reconf("DisruptionRequired")], "Passthrough", id="passthrough-wins"
    ),
    pytest.param("unhealthy", "Compute", [READY, SICK], "Failed", id="unhealthy-xid"),
    pytest.param("unhealthy", "None", [NOT_READY, cond("Healthy", "False", "GpuLost")], "Failed", id="unhealthy-lost"),
    pytest.param("unhealthy", "Compute", [READY, SICK, reconf("DisruptionRequired")], "Failed", id="unhealthy-before-reconf"),
    pytest.param("passthrough", "Passthrough", [SICK], "Passthrough", id="passthrough-before-unhealthy"),
    pytest.param("ready", "Compute", [READY, cond("Healthy", "Unknown", "Unmonitored")], "Ready", id="ready-unmonitored"),
    pytest.param("ready", "Compute", [READY, cond("Healthy", "True", "Checked")], "Ready", id="ready-healthy"),
    pytest.param("failed", "Compute", [BARE_METAL], "Failed", id="failed-bare-metal"),
    pytest.param("failed", "None", [BARE_METAL, reconf("RebootRequested")], "Failed", id="failed-before-reconf"),
    *[
        pytest.param("reconfiguring", "Compute", [READY, reconf(r)], "Reconfiguring", id=f"reconfiguring-{r}")
        for r in (
            "Requested",
            "Draining",
            "InProgress",
            "Completing",
            "DisruptionRequired",
            "DisruptionPending",
            "RebootRequested",
        )
    ],
    pytest.param("reconfiguring", "None", [NOT_READY, reconf("DisruptionRequired")], "Reconfiguring", id="reconf-nodrv"),
    pytest.param(
        "reconfiguring-unknown-reason", "Compute", [READY, reconf("Something")], "Initializing", id="reconf-unknown"
    ),
    pytest.param("ready", "Compute", [READY], "Ready", id="ready"),
    pytest.param("ready", "Compute", [READY, reconf("Completed", "False")], "Ready", id="ready-reconf-cleared"),
    pytest.param("initializing", "None", [NOT_READY], "Initializing", id="initializing-no-driver"),
    pytest.param("initializing", "Compute", [], "Initializing", id="initializing-no-conditions"),
    pytest.param("initializing", "Compute", [READY_UNKNOWN], "Initializing", id="initializing-unknown"),
    pytest.param("initializing", "Compute", [NOT_READY], "Initializing", id="initializing-not-ready"),
]


@pytest.mark.parametrize(("row", "mode", "conditions", "phase"), PHASE_CASES)
def test_phase_table(row: str, mode: Any, conditions: list[Condition], phase: str) -> None:
    assert phase_row(mode, conditions).name == row
    assert derive_phase(mode, conditions) == phase


def test_every_phase_row_is_tested() -> None:
    tested = {c.values[0] for c in PHASE_CASES}
    assert tested == {r.name for r in PHASE_ROWS}


def test_back_on_compute_leaves_passthrough() -> None:
    assert derive_phase("Passthrough", [READY]) == "Passthrough"
    assert derive_phase("Compute", [READY]) == "Ready"


# --------------------------------------------------------------------------- management state


def facts(**kw: Any) -> CardFacts:
    base: dict[str, Any] = dict(
        now=T0 + timedelta(minutes=10),
        pci_address=PCI,
        driver="nvidia",
        base_driver="nvidia",
        mode="Compute",
        claim=None,
        claim_known=True,
    )
    base.update(kw)
    return CardFacts(**base)


PT = dict(driver="vfio-pci", mode="Passthrough")
NONE = dict(driver="", mode="None")
NOW = T0 + timedelta(minutes=10)

MANAGEMENT_CASES = [
    # (row, facts, state, Managed status, reason)
    pytest.param("no-identity", facts(pci_address=""), "Unknown", "Unknown", "Indeterminate", id="no-pci"),
    pytest.param("no-identity", facts(pci_address="3b:00.0"), "Unknown", "Unknown", "Indeterminate", id="bad-pci"),
    pytest.param(
        "no-identity", facts(pci_address="", claim="a1"), "Unknown", "Unknown", "Indeterminate", id="no-pci-claimed"
    ),
    pytest.param("claim-lookup-failed", facts(claim_known=False), "Unknown", "Unknown", "Indeterminate", id="lookup"),
    pytest.param(
        "claim-lookup-failed",
        facts(claim_known=False, excluded=True, **NONE),
        "Unknown",
        "Unknown",
        "Indeterminate",
        id="lookup-excluded",
    ),
    pytest.param(
        "claim-lookup-failed",
        facts(claim_known=False, passthrough_unclaimed_since=T0, **PT),
        "Unknown",
        "Unknown",
        "Indeterminate",
        id="lookup-passthrough",
    ),
    pytest.param("excluded", facts(excluded=True), "Excluded", "False", "Excluded", id="excluded-free-compute-at-once"),
    pytest.param(
        "excluded-release-pending",
        facts(excluded=True, claim="a1"),
        "Managed",
        "True",
        "ExcludedReleasePending",
        id="excluded-compute-claimed",
    ),
    pytest.param(
        "excluded-release-pending",
        facts(excluded=True, passthrough_unclaimed_since=T0, **PT),
        "Managed",
        "True",
        "ExcludedReleasePending",
        id="excluded-on-vfio-is-not-excluded-yet",
    ),
    pytest.param(
        "excluded-release-pending",
        facts(excluded=True, claim="a1", **NONE),
        "Managed",
        "True",
        "ExcludedReleasePending",
        id="excluded-claim-no-driver",
    ),
    pytest.param("excluded", facts(excluded=True, **NONE), "Excluded", "False", "Excluded", id="excluded-released"),
    pytest.param("backing-allocation", facts(claim="a1"), "Managed", "True", "BackingAllocation", id="claim-compute"),
    pytest.param(
        "backing-allocation", facts(claim="vm1", **PT), "Managed", "True", "BackingAllocation", id="claim-passthrough"
    ),
    pytest.param(
        "backing-allocation", facts(claim="vm1", **NONE), "Managed", "True", "BackingAllocation", id="claim-no-driver"
    ),
    pytest.param("unclaimed", facts(), "Unclaimed", "True", "NoBackingAllocation", id="free-compute"),
    pytest.param(
        "orphaned",
        facts(passthrough_unclaimed_since=NOW - TWO, **PT),
        "Orphaned",
        "False",
        "Orphaned",
        id="orphaned-at-2m00",
    ),
    pytest.param(
        "orphaned",
        facts(passthrough_unclaimed_since=NOW - timedelta(hours=1), **PT),
        "Orphaned",
        "False",
        "Orphaned",
        id="orphaned-long",
    ),
    pytest.param(
        "orphan-pending",
        facts(passthrough_unclaimed_since=NOW - ALMOST, **PT),
        "Unknown",
        "Unknown",
        "OrphanPending",
        id="pending-at-1m59",
    ),
    pytest.param(
        "orphan-pending",
        facts(passthrough_unclaimed_since=None, **PT),
        "Unknown",
        "Unknown",
        "OrphanPending",
        id="pending-timer-not-started",
    ),
    pytest.param("no-live-binding", facts(**NONE), "Unknown", "Unknown", "NoLiveBinding", id="no-driver-no-claim"),
    pytest.param("bad-mode", facts(mode="Bogus"), "Unknown", "Unknown", "Indeterminate", id="bad-mode"),
]


@pytest.mark.parametrize(("row", "card", "state", "status", "reason"), MANAGEMENT_CASES)
def test_management_table(row: str, card: CardFacts, state: str, status: str, reason: str) -> None:
    assert management_row(card).name == row
    got_state, managed = management_state(card)
    assert got_state == state
    assert (managed.type, managed.status, managed.reason) == ("Managed", status, reason)
    assert managed.since == card.now
    assert managed.message


def test_every_management_row_is_tested() -> None:
    assert {c.values[0] for c in MANAGEMENT_CASES} == {r.name for r in MANAGEMENT_ROWS}


def test_the_six_managed_reasons_are_all_reachable() -> None:
    reached = {management_state(c.values[1])[1].reason for c in MANAGEMENT_CASES}
    assert MANAGED_REASONS <= reached


def test_an_unclaimed_compute_card_never_enters_the_grace_period() -> None:
    card = facts(now=NOW)
    assert track_orphan(None, card, NOW) is None
    # even with a stale timer handed in, Compute reads Unclaimed, never Orphaned
    state, managed = management_state(replace(card, passthrough_unclaimed_since=NOW - timedelta(hours=1)))
    assert (state, managed.status, managed.reason) == ("Unclaimed", "True", "NoBackingAllocation")


# --------------------------------------------------------------------------- the orphan timer

BREAKS = [
    pytest.param(dict(claim="vm1"), id="a-claim"),
    pytest.param(dict(driver="nvidia", mode="Compute"), id="compute-driver"),
    pytest.param(dict(driver="", mode="None"), id="no-driver"),
    pytest.param(dict(claim_known=False), id="lookup-failed"),
    pytest.param(dict(excluded=True), id="excluded"),
    pytest.param(dict(pci_address=""), id="identity-lost"),
]


@pytest.mark.parametrize(
    ("previous", "change", "expected"),
    [
        pytest.param(None, {}, "now", id="starts"),
        pytest.param(T0, {}, "previous", id="keeps"),
        *[pytest.param(T0, b.values[0], None, id=f"reset-by-{b.id}") for b in BREAKS],
        *[pytest.param(None, b.values[0], None, id=f"not-started-by-{b.id}") for b in BREAKS],
    ],
)
def test_track_orphan_table(previous: datetime | None, change: dict[str, Any], expected: str | None) -> None:
    now = T0 + timedelta(seconds=30)
    card = facts(now=now, **{**PT, **change})
    got = track_orphan(previous, card, now)
    assert got == {"now": now, "previous": previous, None: None}[expected]


def observe(since: datetime | None, now: datetime, **kw: Any) -> tuple[datetime | None, str, str]:
    """One evaluation, the way the service runs it: update the timer, then derive."""
    card = facts(now=now, **{**PT, **kw})
    since = track_orphan(since, card, now)
    state, managed = management_state(replace(card, passthrough_unclaimed_since=since))
    return since, state, managed.reason


def test_orphaned_needs_two_unbroken_minutes_on_fake_time() -> None:
    since, state, reason = observe(None, T0)
    assert (since, state, reason) == (T0, "Unknown", "OrphanPending")
    since, state, reason = observe(since, T0 + timedelta(minutes=1))
    assert (state, reason) == ("Unknown", "OrphanPending")
    since, state, reason = observe(since, T0 + ALMOST)
    assert (state, reason) == ("Unknown", "OrphanPending")
    since, state, reason = observe(since, T0 + TWO)
    assert (since, state, reason) == (T0, "Orphaned", "Orphaned")


@pytest.mark.parametrize("brk", BREAKS)
def test_a_break_resets_the_orphan_timer(brk: dict[str, Any]) -> None:
    since, _, _ = observe(None, T0)
    since, _, _ = observe(since, T0 + timedelta(minutes=1, seconds=30))
    since, _, _ = observe(since, T0 + timedelta(minutes=1, seconds=45), **brk)
    assert since is None
    # back to an unclaimed passthrough binding: the two minutes start over
    restart = T0 + timedelta(minutes=1, seconds=50)
    since, state, reason = observe(since, restart)
    assert since == restart
    since, state, reason = observe(since, T0 + timedelta(minutes=2, seconds=30))
    assert (state, reason) == ("Unknown", "OrphanPending")  # would be Orphaned without the break
    since, state, reason = observe(since, restart + ALMOST)
    assert (state, reason) == ("Unknown", "OrphanPending")
    since, state, reason = observe(since, restart + TWO)
    assert (state, reason) == ("Orphaned", "Orphaned")


# --------------------------------------------------------------------------- reclaim gate

STATES = ["Managed", "Excluded", "Unclaimed", "Orphaned", "Unknown"]


@pytest.mark.parametrize(
    ("state", "reason", "known", "occupied", "verdict", "rc_reason", "message"),
    [
        pytest.param("Unknown", "OrphanPending", True, False, "hold", "Held", None, id="orphan-pending-held"),
        pytest.param("Unknown", "OrphanPending", False, True, "hold", "Held", None, id="held-before-occupancy"),
        pytest.param(
            "Managed", "BackingAllocation", True, False, "refuse", "Refused", "managementState is Managed",
            id="managed",
        ),
        pytest.param(
            "Managed", "ExcludedReleasePending", True, False, "refuse", "Refused",
            "managementState is Managed", id="managed-excluded-release-pending",
        ),
        pytest.param(
            "Excluded", "Excluded", True, False, "refuse", "Refused", "managementState is Excluded",
            id="excluded",
        ),
        pytest.param(
            "Unclaimed", "NoBackingAllocation", True, False, "refuse", "Refused",
            "managementState is Unclaimed", id="unclaimed",
        ),
        pytest.param(
            "Unknown", "NoLiveBinding", True, False, "refuse", "Refused", "managementState is Unknown",
            id="unknown-no-live-binding",
        ),
        pytest.param(
            "Unknown", "Indeterminate", True, False, "refuse", "Refused", "managementState is Unknown",
            id="unknown-indeterminate",
        ),
        pytest.param(
            "Orphaned", "Orphaned", False, False, "refuse", "OccupancyUnknown", None, id="orphaned-occupancy-unknown"
        ),
        pytest.param("Orphaned", "Orphaned", True, True, "refuse", "Occupied", None, id="orphaned-claim-found"),
        pytest.param("Orphaned", "Orphaned", True, False, "admit", "InProgress", None, id="orphaned-admitted"),
    ],
)
def test_reclaim_gate_table(
    state: Any, reason: str, known: bool, occupied: bool, verdict: str, rc_reason: str, message: str | None
) -> None:
    d = reclaim_gate(state, reason, known, occupied)
    assert (d.verdict, d.reason) == (verdict, rc_reason)
    assert d.keeps_request == (verdict == "hold")
    if message is not None:
        assert d.message == message  # names the value, not the reason behind it
    c = d.condition(T0)
    assert (c.type, c.reason, c.since) == ("Reclaim", rc_reason, T0)
    assert c.status == ("False" if verdict == "refuse" else "Unknown")


@pytest.mark.parametrize(
    "card",
    [c.values[1] for c in MANAGEMENT_CASES],
    ids=[c.id for c in MANAGEMENT_CASES],
)
def test_a_reclaim_on_each_derived_management_state(card: CardFacts) -> None:
    """End to end through both tables: only Orphaned admits, OrphanPending holds, the rest refuse by name."""
    state, managed = management_state(card)
    known, occupied = establish_occupancy("node-a", card.pci_address, card.claim_known, card.claim)
    d = reclaim_gate(state, managed.reason, known, occupied)
    if state == "Orphaned":
        assert d.verdict == "admit"
    elif managed.reason == "OrphanPending":
        assert d.verdict == "hold"
    else:
        assert (d.verdict, d.message) == ("refuse", f"managementState is {state}")


def test_each_management_state_value_is_tried() -> None:
    seen = {management_state(c.values[1])[0] for c in MANAGEMENT_CASES}
    assert seen == set(STATES)


def test_a_held_reclaim_starts_by_itself_once_orphaned() -> None:
    since, state, reason = observe(None, T0)
    assert reclaim_gate(state, reason, True, False).verdict == "hold"  # type: ignore[arg-type]
    since, state, reason = observe(since, T0 + ALMOST)
    assert reclaim_gate(state, reason, True, False).verdict == "hold"  # type: ignore[arg-type]
    since, state, reason = observe(since, T0 + TWO)
    assert reclaim_gate(state, reason, True, False).verdict == "admit"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("node", "pci", "claim_known", "claim", "expected"),
    [
        pytest.param("node-a", PCI, True, None, (True, False), id="free"),
        pytest.param("node-a", PCI, True, "vm1", (True, True), id="claimed"),
        pytest.param("", PCI, True, None, (False, False), id="no-node-name"),
        pytest.param("node-a", "", True, None, (False, False), id="no-pci"),
        pytest.param("node-a", "3b:00.0", True, None, (False, False), id="non-canonical-pci"),
        pytest.param("node-a", PCI, False, None, (False, False), id="lookup-failed"),
    ],
)
def test_establish_occupancy(node: str, pci: str, claim_known: bool, claim: str | None, expected: Any) -> None:
    assert establish_occupancy(node, pci, claim_known, claim) == expected


# --------------------------------------------------------------------------- reclaim progress


@pytest.mark.parametrize(
    ("elapsed", "mode", "status", "reason", "words"),
    [
        pytest.param(timedelta(seconds=5), "Compute", "True", "Succeeded", (), id="succeeded"),
        pytest.param(timedelta(minutes=5), "Compute", "True", "Succeeded", (), id="succeeded-late"),
        pytest.param(timedelta(0), "Passthrough", "Unknown", "InProgress", (), id="just-started"),
        pytest.param(ALMOST, "Passthrough", "Unknown", "InProgress", (), id="passthrough-1m59"),
        pytest.param(ALMOST, "None", "Unknown", "InProgress", (), id="no-driver-1m59"),
        pytest.param(
            TWO, "Passthrough", "False", "Failed", ("driverBinding.mode is still Passthrough", "reboot may be needed"),
            id="passthrough-2m00-failed",
        ),
        pytest.param(
            timedelta(minutes=7), "Passthrough", "False", "Failed", ("still Passthrough", "reboot"), id="long-failed"
        ),
        pytest.param(
            TWO, "None", "False", "Failed", ("driverBinding.mode is None", "reboot may be needed"), id="no-driver-failed"
        ),
    ],
)
def test_reclaim_progress_table(elapsed: timedelta, mode: Any, status: str, reason: str, words: tuple[str, ...]) -> None:
    c = reclaim_progress(T0, T0 + elapsed, mode)
    assert (c.type, c.status, c.reason) == ("Reclaim", status, reason)
    for w in words:
        assert w in c.message


def test_reclaim_timeout_is_two_minutes() -> None:
    assert RECLAIM_TIMEOUT == ORPHAN_GRACE == TWO


@pytest.mark.parametrize(
    ("reason", "previous", "state", "mode", "kept"),
    [
        # a refusal stands while the managementState it was answered in does (issue 12)
        pytest.param("Refused", "Excluded", "Excluded", "None", True, id="refused-state-unchanged"),
        # ... and only off the compute driver: on it there is nothing to reclaim (issue 41)
        pytest.param("Refused", "Excluded", "Excluded", "Compute", False, id="refused-on-the-compute-driver"),
        pytest.param("Refused", "Managed", "Managed", "Passthrough", True, id="refused-vm-card-still-on-vfio"),
        pytest.param("Refused", "Excluded", "Unclaimed", "Compute", False, id="refused-after-include"),
        pytest.param("Refused", "Unclaimed", "Managed", "Compute", False, id="refused-then-claimed"),
        pytest.param("Refused", None, "Unclaimed", "Compute", False, id="refused-no-previous-status"),
        pytest.param("Occupied", "Orphaned", "Orphaned", "Passthrough", True, id="occupied-still-orphaned"),
        pytest.param("Occupied", "Orphaned", "Managed", "Passthrough", False, id="occupied-then-managed"),
        pytest.param("OccupancyUnknown", "Orphaned", "Unknown", "Passthrough", False, id="occupancy-unknown-then-unknown"),
        # Succeeded while on a compute driver, Failed while not
        pytest.param("Succeeded", "Unclaimed", "Managed", "Compute", True, id="succeeded-then-claimed-on-compute"),
        pytest.param("Succeeded", "Unclaimed", "Managed", "Passthrough", False, id="succeeded-then-on-vfio-again"),
        pytest.param("Failed", "Orphaned", "Orphaned", "Passthrough", True, id="failed-still-on-vfio"),
        pytest.param("Failed", "Orphaned", "Unknown", "None", True, id="failed-left-without-a-driver"),
        pytest.param("Failed", "Orphaned", "Unclaimed", "Compute", False, id="failed-back-on-compute-after-a-reboot"),
        # a live request's reasons mean nothing without the request
        pytest.param("Held", "Unknown", "Unknown", "Passthrough", False, id="held-without-a-request"),
        pytest.param("InProgress", "Orphaned", "Orphaned", "Passthrough", False, id="in-progress-without-a-request"),
        pytest.param("SomethingNewer", "Unclaimed", "Unclaimed", "Compute", False, id="unknown-reason"),
    ],
)
def test_reclaim_answer_applies_table(reason: str, previous: Any, state: Any, mode: Any, kept: bool) -> None:
    status = {"Succeeded": "True", "Held": "Unknown", "InProgress": "Unknown"}.get(reason, "False")
    assert reclaim_answer_applies(cond("Reclaim", status, reason), previous, state, mode) is kept


def test_reclaim_answer_applies_only_to_reclaim() -> None:
    assert reclaim_answer_applies(cond("Managed", "False", "Refused"), "Excluded", "Excluded", "Compute") is False


# --------------------------------------------------------------------------- disruption flow

BOOT_A = "boot-a"
BOOT_B = "boot-b"


def dfacts(**kw: Any) -> DisruptionFacts:
    base: dict[str, Any] = dict(
        now=T0 + timedelta(minutes=1),
        pci_address=PCI,
        driver="",
        base_driver="nvidia",
        boot_id_now=BOOT_A,
        boot_id_at_disruption=BOOT_A,
    )
    base.update(kw)
    return DisruptionFacts(**base)


BACK = dict(driver="nvidia", boot_id_now=BOOT_B)  # on the base driver after a new boot
OTHER = reconf("InProgress")
CLEARED = reconf("Completed", "False")


@pytest.mark.parametrize(
    ("previous", "f", "expected"),
    [
        pytest.param(None, dfacts(rollback_impossible=True), "DisruptionRequired", id="raise-no-driver"),
        pytest.param(
            None, dfacts(driver="vfio-pci", rollback_impossible=True), "DisruptionRequired", id="raise-stuck-on-vfio"
        ),
        pytest.param(CLEARED, dfacts(rollback_impossible=True), "DisruptionRequired", id="raise-over-cleared"),
        pytest.param(OTHER, dfacts(rollback_impossible=True), "DisruptionRequired", id="raise-over-reconfiguration"),
        pytest.param(None, dfacts(), None, id="untouched-none"),
        pytest.param(OTHER, dfacts(), "keep", id="untouched-other-flow"),
        pytest.param(CLEARED, dfacts(), "keep", id="untouched-cleared"),
        pytest.param(reconf("Completing"), dfacts(rollback_impossible=True), "DisruptionRequired", id="re-raise"),
        pytest.param(reconf("DisruptionRequired"), dfacts(), "DisruptionPending", id="pending"),
        pytest.param(
            reconf("DisruptionRequired"), dfacts(rollback_impossible=True), "DisruptionPending", id="pending-repeat"
        ),
        pytest.param(reconf("DisruptionPending"), dfacts(), "RebootRequested", id="reboot"),
        pytest.param(reconf("RebootRequested"), dfacts(**BACK), "Completing", id="completing"),
        pytest.param(reconf("RebootRequested"), dfacts(), "RebootRequested", id="wait-reboot-same-boot"),
        pytest.param(
            reconf("RebootRequested"), dfacts(driver="nvidia"), "RebootRequested", id="wait-base-driver-without-reboot"
        ),
        pytest.param(
            reconf("RebootRequested"), dfacts(boot_id_now=BOOT_B), "RebootRequested", id="wait-rebooted-no-driver"
        ),
        pytest.param(
            reconf("RebootRequested"),
            dfacts(driver="vfio-pci", boot_id_now=BOOT_B),
            "RebootRequested",
            id="wait-rebooted-still-vfio",
        ),
        pytest.param(
            reconf("RebootRequested"),
            dfacts(boot_id_at_disruption="", **BACK),
            "RebootRequested",
            id="wait-boot-id-unknown",
        ),
        pytest.param(
            reconf("RebootRequested"),
            dfacts(base_driver="", driver="", boot_id_now=BOOT_B),
            "RebootRequested",
            id="wait-base-driver-unknown",
        ),
        pytest.param(
            reconf("RebootRequested"), dfacts(rollback_impossible=True), "RebootRequested", id="wait-repeat-failure"
        ),
        pytest.param(reconf("Completing"), dfacts(**BACK), None, id="clear"),
        pytest.param(reconf("Completing"), dfacts(boot_id_now=BOOT_B), "RebootRequested", id="relapse"),
    ],
)
def test_disruption_flow_table(previous: Condition | None, f: DisruptionFacts, expected: str | None) -> None:
    got = disruption_flow(previous, f)
    if expected == "keep":
        assert got is previous
        return
    if expected is None:
        assert got is None
        return
    assert got is not None
    assert (got.type, got.status, got.reason) == ("Reconfiguring", "True", expected)
    assert PCI in got.message
    if expected != "Completing":
        assert "reboot is needed" in got.message
    # a new stage starts now; an unchanged one keeps its time
    if previous is not None and previous.reason == expected:
        assert got.since == previous.since
    else:
        assert got.since == f.now


def test_disruption_flow_walk_through_a_reboot() -> None:
    t = T0
    c = disruption_flow(None, dfacts(now=t, rollback_impossible=True))
    boot_at = BOOT_A  # the caller records boot_id_now when DisruptionRequired is raised
    seen = [c.reason if c else None]
    for step, kw in enumerate([{}, {}, {}, BACK, BACK], start=1):
        f = dfacts(now=t + timedelta(seconds=10 * step), boot_id_at_disruption=boot_at, **kw)
        c = disruption_flow(c, f)
        seen.append(c.reason if c else None)
    assert seen == [
        "DisruptionRequired",
        "DisruptionPending",
        "RebootRequested",
        "RebootRequested",
        "Completing",
        None,
    ]


def test_disruption_stages_drive_the_phase() -> None:
    c = disruption_flow(None, dfacts(rollback_impossible=True))
    assert c is not None
    assert derive_phase("None", [NOT_READY, c]) == "Reconfiguring"
    # stuck on vfio-pci: the mode is read first
    assert derive_phase("Passthrough", [NOT_READY, c]) == "Passthrough"
