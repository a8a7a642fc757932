"""The GpuTracker (services/inventory/gpustate.py) as tables on fake time, and its state file.

The rules themselves are physicalgpu's tables (tests/unit/test_physicalgpu.py);
here: that the tracker feeds them the right facts, remembers what they need
between evaluations (the orphan timer, reclaim requests, the boot id at a
disruption, exclusions, the last status), turns every change into exactly one
GpuChanged, and that its file survives a restart (or is set aside when it is
unreadable).
"""

from __future__ import annotations

import json
import logging
import re
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.inventory.build import derive_status, gpu_atom_id
from services.inventory.gpustate import (
    STATE_FILE,
    GpuState,
    GpuStateStore,
    GpuTracker,
    StateFileError,
    claim_text,
    claims_by_card,
    decode_state,
    encode_state,
    reclaim_accepted,
    reclaim_condition,
    state_dir_from,
)
from services.inventory.physicalgpu import ORPHAN_GRACE, RECLAIM_TIMEOUT
from services.inventory.adapters.base import HealthCheck, HealthEvent
from services.inventory.health import HealthPolicy
from shared.eventids import gpu_id
from shared.schemas import (
    Claims,
    Condition,
    Gpu,
    GpuClaim,
    HostResources,
    Inventory,
    PhysicalGPUStatus,
    SwitchReply,
)
from shared.schemas.common import EVENT_ID_PATTERN

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
PCI = "0000:3b:00.0"
PCI2 = "0000:5e:00.0"
NODE = "node-1"
BOOT = "boot-a"
ALMOST = timedelta(minutes=1, seconds=59)
TWO = timedelta(minutes=2)


class Clock:
    def __init__(self, now: datetime = T0) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, by: timedelta) -> datetime:
        self.now += by
        return self.now


def gpu(pci: str = PCI, driver: str = "nvidia", *, base: str = "nvidia", index: int = 0, readable: bool = True) -> Gpu:
    uuid = f"GPU-0000000{index}-1111-2222-3333-444444444444"
    return Gpu(
        atom_id=gpu_atom_id(uuid),
        uuid=uuid,
        index=index,
        pci_address=pci,
        driver=driver,
        base_driver=base,
        status=derive_status(driver, now=T0, readable=readable),
    )


def inv(*gpus: Gpu, boot: str = BOOT, virtualized: bool = False) -> Inventory:
    return Inventory(
        node_id=NODE,
        observed_at=T0,
        boot_id=boot,
        gpus=list(gpus) or [gpu()],
        host=HostResources(virtualized=virtualized),
    )


def claims(*items: tuple[str, str, str]) -> Claims:
    """(pci, kind, holder) triples."""
    return Claims(claims=[GpuClaim(pci_address=p, kind=k, holder=h) for p, k, h in items], at=T0)  # type: ignore[arg-type]


FREE = claims()


def tracker(clock: Clock | None = None, **kw: Any) -> GpuTracker:
    return GpuTracker(NODE, clock=clock or Clock(), **kw)


def status_of(t: GpuTracker, pci: str = PCI) -> PhysicalGPUStatus:
    rec = t.card(pci)
    assert rec is not None and rec.status is not None
    return rec.status


def cond(status: PhysicalGPUStatus, type_: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == type_), None)


def sr(status: PhysicalGPUStatus, type_: str) -> tuple[str, str] | None:
    c = cond(status, type_)
    return None if c is None else (c.status, c.reason)


def answer(status: PhysicalGPUStatus) -> tuple[str, str, str]:
    """(phase, managementState, Managed reason)."""
    managed = cond(status, "Managed")
    assert managed is not None
    return status.phase, status.driver_binding.management_state, managed.reason


def switch_reply(
    outcome: str = "DisruptionRequired",
    *,
    pci: str = PCI,
    event: str = "VFIOUnprepareFailed",
    boot: str = BOOT,
    at: datetime = T0,
    message: str = "GPU 0000:3b:00.0 is left without a driver; a node reboot is needed",
    target: str = "native",
) -> SwitchReply:
    return SwitchReply(
        pci=pci,
        target=target,
        outcome=outcome,
        reason="RollbackImpossible" if outcome == "DisruptionRequired" else outcome,
        message=message,
        event=event,
        boot_id=boot,
        at=at,
    )


# --------------------------------------------------------------------------- claims


def test_claims_by_card_reads_the_first_claim_in_kind_order() -> None:
    c = claims(
        (PCI, "domain", "vm-a"),
        (PCI, "instance", "i-1"),
        (PCI, "release", "k-1"),
        (PCI, "allocation", "a-1"),
        (PCI2, "domain", "vm-b"),
    )
    by = claims_by_card(c)
    assert [x.kind for x in by[PCI]] == ["allocation", "release", "instance", "domain"]
    assert claim_text(by[PCI]) == "allocation a-1"
    assert claim_text(by[PCI2]) == "domain vm-b"
    assert claim_text([]) is None
    assert claims_by_card(None) == {}


# --------------------------------------------------------------------------- the five answers

ANSWER_CASES = [
    # (id, card, claims, excluded, (phase, managementState, Managed reason), AdapterReady (status, reason))
    ("unclaimed", gpu(), FREE, False, ("Ready", "Unclaimed", "NoBackingAllocation"), ("True", "AdapterReady")),
    (
        "allocation",
        gpu(),
        claims((PCI, "allocation", "a-1")),
        False,
        ("Ready", "Managed", "BackingAllocation"),
        ("True", "AdapterReady"),
    ),
    (
        "release-pending",
        gpu(),
        claims((PCI, "release", "(pending Kubernetes releases that could not be read)")),
        False,
        ("Ready", "Managed", "BackingAllocation"),
        ("True", "AdapterReady"),
    ),
    (
        "instance-on-vfio",
        gpu(driver="vfio-pci"),
        claims((PCI, "instance", "vm-1")),
        False,
        ("Passthrough", "Managed", "BackingAllocation"),
        ("False", "Passthrough"),
    ),
    (
        "domain-on-vfio",
        gpu(driver="vfio-pci"),
        claims((PCI, "domain", "vm-1")),
        False,
        ("Passthrough", "Managed", "BackingAllocation"),
        ("False", "Passthrough"),
    ),
    ("excluded-no-driver", gpu(driver=""), FREE, True, ("Initializing", "Excluded", "Excluded"), ("False", "NoDriver")),
    (
        "excluded-free-compute",
        gpu(),
        FREE,
        True,
        ("Ready", "Excluded", "Excluded"),
        ("True", "AdapterReady"),
    ),
    (
        "excluded-live-binding",
        gpu(),
        claims((PCI, "allocation", "a-1")),
        True,
        ("Ready", "Managed", "ExcludedReleasePending"),
        ("True", "AdapterReady"),
    ),
    (
        "excluded-on-vfio",
        gpu(driver="vfio-pci"),
        FREE,
        True,
        ("Passthrough", "Managed", "ExcludedReleasePending"),
        ("False", "Passthrough"),
    ),
    (
        "excluded-claimed",
        gpu(driver=""),
        claims((PCI, "allocation", "a-1")),
        True,
        ("Initializing", "Managed", "ExcludedReleasePending"),
        ("False", "NoDriver"),
    ),
    ("no-live-binding", gpu(driver=""), FREE, False, ("Initializing", "Unknown", "NoLiveBinding"), ("False", "NoDriver")),
    (
        "orphan-pending",
        gpu(driver="vfio-pci"),
        FREE,
        False,
        ("Passthrough", "Unknown", "OrphanPending"),
        ("False", "Passthrough"),
    ),
    ("indeterminate", gpu(), None, False, ("Ready", "Unknown", "Indeterminate"), ("True", "AdapterReady")),
    (
        "indeterminate-on-vfio",
        gpu(driver="vfio-pci"),
        None,
        True,
        ("Passthrough", "Unknown", "Indeterminate"),
        ("False", "Passthrough"),
    ),
    (
        "lost-to-the-library",
        gpu(readable=False),
        FREE,
        False,
        ("Initializing", "Unclaimed", "NoBackingAllocation"),
        ("False", "VendorLibraryCannotRead"),
    ),
]


@pytest.mark.parametrize(
    ("card", "given", "excluded", "expected", "ready"),
    [c[1:] for c in ANSWER_CASES],
    ids=[c[0] for c in ANSWER_CASES],
)
def test_each_management_answer(
    card: Gpu, given: Claims | None, excluded: bool, expected: tuple[str, str, str], ready: tuple[str, str]
) -> None:
    t = tracker()
    if excluded:
        assert t.exclude(PCI) is True
    result = t.evaluate(inv(card), given)
    status = result.inventory.gpus[0].status
    assert answer(status) == expected
    assert sr(status, "AdapterReady") == ready
    assert status.driver_binding.driver == card.driver
    assert status.driver_binding.mode == card.status.driver_binding.mode
    assert result.claims_known is (given is not None)
    assert status == status_of(t)


def test_every_management_state_value_is_reached() -> None:
    assert {c[4][1] for c in ANSWER_CASES} | {"Orphaned"} == {"Managed", "Excluded", "Unclaimed", "Orphaned", "Unknown"}


def test_the_managed_message_names_the_claim() -> None:
    t = tracker()
    status = t.evaluate(inv(gpu()), claims((PCI, "allocation", "a-1"), (PCI, "instance", "i-9"))).inventory.gpus[0].status
    managed = cond(status, "Managed")
    assert managed is not None and "allocation a-1" in managed.message


# --------------------------------------------------------------------------- VFIO on a virtualized node


def test_an_instance_claim_on_a_virtualized_node_fails_with_vfio_requires_bare_metal() -> None:
    t = tracker()
    status = t.evaluate(inv(gpu(), virtualized=True), claims((PCI, "instance", "vm-1"))).inventory.gpus[0].status
    assert sr(status, "AdapterReady") == ("False", "VFIORequiresBareMetal")
    assert status.phase == "Failed"
    ready = cond(status, "AdapterReady")
    assert ready is not None and "vm-1" in ready.message and "bare metal" in ready.message
    # the claim goes: the card is Ready again
    status = t.evaluate(inv(gpu(), virtualized=True), FREE).inventory.gpus[0].status
    assert (status.phase, sr(status, "AdapterReady")) == ("Ready", ("True", "AdapterReady"))


@pytest.mark.parametrize(
    ("virtualized", "kind", "phase"),
    [
        (False, "instance", "Ready"),  # bare metal: the converger switches it; nothing fails here
        (True, "allocation", "Ready"),  # a hold on a guest's GPU is fine
        (True, "domain", "Ready"),
    ],
)
def test_only_an_instance_claim_on_a_virtualized_node_fails(virtualized: bool, kind: str, phase: str) -> None:
    status = tracker().evaluate(inv(gpu(), virtualized=virtualized), claims((PCI, kind, "x"))).inventory.gpus[0].status
    assert status.phase == phase


def test_a_vfio_card_on_a_virtualized_node_is_still_passthrough() -> None:
    status = tracker().evaluate(inv(gpu(driver="vfio-pci"), virtualized=True), claims((PCI, "instance", "vm-1")))
    assert status.inventory.gpus[0].status.phase == "Passthrough"


# --------------------------------------------------------------------------- the orphan rule on fake time


def test_orphaned_after_two_unbroken_minutes() -> None:
    clock = Clock()
    t = tracker(clock)
    card = inv(gpu(driver="vfio-pci"))
    assert answer(t.evaluate(card, FREE).inventory.gpus[0].status)[1:] == ("Unknown", "OrphanPending")
    assert t.timers_running()
    clock.advance(ALMOST)
    assert answer(t.evaluate(card, FREE).inventory.gpus[0].status)[1:] == ("Unknown", "OrphanPending")
    clock.advance(timedelta(seconds=1))
    status = t.evaluate(card, FREE).inventory.gpus[0].status
    assert answer(status) == ("Passthrough", "Orphaned", "Orphaned")
    assert sr(status, "Managed") == ("False", "Orphaned")
    t.sent(len(t.outbox))
    assert not t.timers_running()  # nothing changes with time alone any more


BREAKS = [
    pytest.param(lambda: (inv(gpu(driver="vfio-pci")), claims((PCI, "instance", "vm-1"))), id="a-claim"),
    pytest.param(lambda: (inv(gpu(driver="vfio-pci")), None), id="claim-lookup-failed"),
    pytest.param(lambda: (inv(gpu(driver="nvidia")), FREE), id="back-on-nvidia"),
    pytest.param(lambda: (inv(gpu(driver="")), FREE), id="no-driver"),
    pytest.param(lambda: (inv(gpu(driver="vfio-pci"), boot="boot-b"), FREE), id="a-reboot"),
    pytest.param(lambda: (inv(gpu(PCI2, index=1)), FREE), id="card-not-listed"),
]


@pytest.mark.parametrize("brk", BREAKS)
def test_a_break_restarts_the_two_minutes(brk: Any) -> None:
    clock = Clock()
    t = tracker(clock)
    card = inv(gpu(driver="vfio-pci"))
    t.evaluate(card, FREE)
    clock.advance(timedelta(minutes=1))
    broken, given = brk()
    t.evaluate(broken, given)
    boot = broken.boot_id
    card = inv(gpu(driver="vfio-pci"), boot=boot)
    clock.advance(timedelta(seconds=30))
    restarted = clock.now
    assert answer(t.evaluate(card, FREE).inventory.gpus[0].status)[1:] == ("Unknown", "OrphanPending")
    # 2 minutes after the first sighting, but not after the break: still pending
    clock.now = T0 + TWO + timedelta(seconds=1)
    assert answer(t.evaluate(card, FREE).inventory.gpus[0].status)[1:] == ("Unknown", "OrphanPending")
    clock.now = restarted + TWO
    assert answer(t.evaluate(card, FREE).inventory.gpus[0].status)[1:] == ("Orphaned", "Orphaned")


def test_a_short_grace_for_tests_changes_the_rule_and_its_message() -> None:
    clock = Clock()
    t = tracker(clock, orphan_grace=timedelta(seconds=3))
    card = inv(gpu(driver="vfio-pci"))
    pending = cond(t.evaluate(card, FREE).inventory.gpus[0].status, "Managed")
    assert pending is not None and "0m3s" in pending.message
    clock.advance(timedelta(seconds=3))
    assert answer(t.evaluate(card, FREE).inventory.gpus[0].status)[1] == "Orphaned"


def test_the_default_grace_is_the_seeds_two_minutes() -> None:
    assert tracker().orphan_grace == ORPHAN_GRACE == TWO
    assert tracker().reclaim_timeout == RECLAIM_TIMEOUT == TWO


# --------------------------------------------------------------------------- reclaim on each managementState value


def _orphaned(clock: Clock, t: GpuTracker) -> Inventory:
    card = inv(gpu(driver="vfio-pci"))
    t.evaluate(card, FREE)
    clock.advance(TWO)
    assert answer(t.evaluate(card, FREE).inventory.gpus[0].status)[1] == "Orphaned"
    return card


RECLAIM_CASES = [
    # (id, card, claims, excluded, Reclaim (status, reason), message words, request kept)
    # (on its compute driver a refusal is the request's answer only: the card keeps no Reclaim condition)
    ("managed", gpu(), claims((PCI, "allocation", "a-1")), False, None, "managementState is Managed: the card is on its compute driver", False),
    ("managed-vm", gpu(driver="vfio-pci"), claims((PCI, "instance", "vm-1")), False, ("False", "Refused"), "managementState is Managed", False),
    ("excluded", gpu(driver=""), FREE, True, ("False", "Refused"), "managementState is Excluded", False),
    ("unclaimed", gpu(), FREE, False, None, "managementState is Unclaimed: the card is on its compute driver (nvidia), nothing to reclaim", False),
    ("no-live-binding", gpu(driver=""), FREE, False, ("False", "Refused"), "managementState is Unknown", False),
    ("indeterminate", gpu(driver="vfio-pci"), None, False, ("False", "Refused"), "managementState is Unknown", False),
    ("orphan-pending", gpu(driver="vfio-pci"), FREE, False, ("Unknown", "Held"), "held", True),
]


@pytest.mark.parametrize(
    ("card", "given", "excluded", "expected", "words", "kept"),
    [c[1:] for c in RECLAIM_CASES],
    ids=[c[0] for c in RECLAIM_CASES],
)
def test_a_reclaim_on_each_management_state(
    card: Gpu, given: Claims | None, excluded: bool, expected: tuple[str, str] | None, words: str, kept: bool
) -> None:
    t = tracker()
    if excluded:
        t.exclude(PCI)
    assert t.request_reclaim(PCI) is True
    result = t.evaluate(inv(card), given)
    status = result.inventory.gpus[0].status
    assert sr(status, "Reclaim") == expected
    reclaim = t.take_answer(PCI, status)
    assert reclaim is not None and reclaim.reason in ("Refused", "Held")
    assert reclaim.message.startswith(words)
    assert not reclaim.message.lower().startswith("refused")  # the reason says it; the reply prints it
    assert reclaim_accepted(reclaim) is kept
    rec = t.card(PCI)
    assert rec is not None and (rec.reclaim is not None) is kept
    assert result.reclaims == (["held"] if kept else ["refused"])


def test_a_reclaim_on_an_orphaned_card_is_admitted_and_succeeds_on_the_compute_driver() -> None:
    clock = Clock()
    t = tracker(clock)
    card = _orphaned(clock, t)
    t.request_reclaim(PCI)
    result = t.evaluate(card, FREE)
    assert result.reclaims == ["admitted"]
    status = result.inventory.gpus[0].status
    assert sr(status, "Reclaim") == ("Unknown", "InProgress")
    assert t.timers_running()
    clock.advance(timedelta(seconds=30))
    status = t.evaluate(card, FREE).inventory.gpus[0].status
    assert sr(status, "Reclaim") == ("Unknown", "InProgress")
    reclaim = reclaim_condition(status)
    assert reclaim is not None and "0m30s" in reclaim.message
    assert reclaim.since == T0 + TWO  # unchanged status and reason keep their since
    clock.advance(timedelta(seconds=10))
    result = t.evaluate(inv(gpu(driver="nvidia")), FREE)
    status = result.inventory.gpus[0].status
    assert result.reclaims == ["succeeded"]
    assert sr(status, "Reclaim") == ("True", "Succeeded")
    assert answer(status) == ("Ready", "Unclaimed", "NoBackingAllocation")
    rec = t.card(PCI)
    assert rec is not None and rec.reclaim is None
    # the request ended; the condition stays (and keeps its since)
    clock.advance(timedelta(minutes=5))
    later = t.evaluate(inv(gpu(driver="nvidia")), FREE)
    assert sr(later.inventory.gpus[0].status, "Reclaim") == ("True", "Succeeded")
    assert later.reclaims == [] and later.events == []
    t.sent(len(t.outbox))
    assert not t.timers_running()


def test_a_held_reclaim_starts_by_itself_once_orphaned() -> None:
    clock = Clock()
    t = tracker(clock)
    card = inv(gpu(driver="vfio-pci"))
    t.evaluate(card, FREE)
    clock.advance(timedelta(seconds=30))
    t.request_reclaim(PCI)
    assert t.evaluate(card, FREE).reclaims == ["held"]
    assert sr(status_of(t), "Reclaim") == ("Unknown", "Held")
    clock.advance(timedelta(seconds=60))
    assert t.evaluate(card, FREE).reclaims == []  # still held: counted once
    assert sr(status_of(t), "Reclaim") == ("Unknown", "Held")
    clock.now = T0 + TWO
    result = t.evaluate(card, FREE)
    assert result.reclaims == ["admitted"]
    assert answer(status_of(t))[1] == "Orphaned"
    assert sr(status_of(t), "Reclaim") == ("Unknown", "InProgress")


def test_a_held_reclaim_is_refused_when_a_claim_appears() -> None:
    clock = Clock()
    t = tracker(clock)
    card = inv(gpu(driver="vfio-pci"))
    t.evaluate(card, FREE)
    t.request_reclaim(PCI)
    t.evaluate(card, FREE)
    clock.advance(timedelta(seconds=10))
    result = t.evaluate(card, claims((PCI, "instance", "vm-1")))
    assert result.reclaims == ["refused"]
    reclaim = reclaim_condition(status_of(t))
    assert reclaim is not None and (reclaim.status, reclaim.reason) == ("False", "Refused")
    assert reclaim.message == "managementState is Managed"
    rec = t.card(PCI)
    assert rec is not None and rec.reclaim is None


def test_a_held_reclaim_is_refused_when_the_claims_cannot_be_read() -> None:
    clock = Clock()
    t = tracker(clock)
    card = inv(gpu(driver="vfio-pci"))
    t.evaluate(card, FREE)
    t.request_reclaim(PCI)
    t.evaluate(card, FREE)
    assert t.evaluate(card, None).reclaims == ["refused"]  # fail-closed
    assert sr(status_of(t), "Reclaim") == ("False", "Refused")


def test_a_reclaim_still_on_vfio_two_minutes_after_it_started_fails() -> None:
    clock = Clock()
    t = tracker(clock)
    card = _orphaned(clock, t)
    started = clock.now
    t.request_reclaim(PCI)
    t.evaluate(card, FREE)
    clock.now = started + ALMOST
    assert t.evaluate(card, FREE).reclaims == []
    assert sr(status_of(t), "Reclaim") == ("Unknown", "InProgress")
    clock.now = started + TWO
    result = t.evaluate(card, FREE)
    assert result.reclaims == ["failed"]
    reclaim = reclaim_condition(status_of(t))
    assert reclaim is not None and (reclaim.status, reclaim.reason) == ("False", "Failed")
    assert "reboot may be needed" in reclaim.message and "still Passthrough" in reclaim.message
    rec = t.card(PCI)
    assert rec is not None and rec.reclaim is None
    # terminal: the condition stays, nothing is timed any more (the card is still Orphaned)
    clock.advance(timedelta(minutes=10))
    assert t.evaluate(card, FREE).events == []
    assert sr(status_of(t), "Reclaim") == ("False", "Failed")
    t.sent(len(t.outbox))
    assert not t.timers_running()


def test_a_short_reclaim_timeout_for_tests() -> None:
    clock = Clock()
    t = tracker(clock, orphan_grace=timedelta(seconds=1), reclaim_timeout=timedelta(seconds=2))
    card = inv(gpu(driver="vfio-pci"))
    t.evaluate(card, FREE)
    clock.advance(timedelta(seconds=1))
    t.request_reclaim(PCI)
    assert t.evaluate(card, FREE).reclaims == ["admitted"]
    clock.advance(timedelta(seconds=2))
    assert t.evaluate(card, FREE).reclaims == ["failed"]


def test_a_second_reclaim_request_while_one_is_pending_is_not_a_new_one() -> None:
    t = tracker()
    assert t.request_reclaim(PCI) is True
    assert t.request_reclaim(PCI) is False


def test_a_new_reclaim_after_a_refusal_is_gated_again() -> None:
    clock = Clock()
    t = tracker(clock)
    t.request_reclaim(PCI)
    t.evaluate(inv(gpu(driver="vfio-pci")), claims((PCI, "instance", "vm-1")))
    assert sr(status_of(t), "Reclaim") == ("False", "Refused")
    clock.advance(timedelta(seconds=5))
    t.request_reclaim(PCI)
    t.evaluate(inv(gpu(driver="vfio-pci")), FREE)
    assert sr(status_of(t), "Reclaim") == ("Unknown", "Held")


# --------------------------------------------------------------------------- an ended request's answer (issue 12)


def test_a_refusal_on_an_excluded_card_is_cleared_once_it_is_included() -> None:
    """exclude -> reclaim (refused: Excluded) -> include: the card read Unclaimed with the stale refusal.
    (A card with no driver: on its compute driver a refusal never sits on the card, issue 41.)"""
    clock = Clock()
    t = tracker(clock)
    bare = gpu(driver="")
    t.evaluate(inv(bare), FREE)
    assert t.exclude(PCI) is True
    assert answer(t.evaluate(inv(bare), FREE).inventory.gpus[0].status)[1] == "Excluded"
    t.request_reclaim(PCI)
    refused = t.evaluate(inv(bare), FREE)
    assert refused.reclaims == ["refused"]
    reclaim = reclaim_condition(status_of(t))
    assert reclaim is not None and (reclaim.status, reclaim.reason) == ("False", "Refused")
    assert reclaim.message == "managementState is Excluded"
    # the refusal stands while the card still reads Excluded
    clock.advance(timedelta(seconds=30))
    assert t.evaluate(inv(bare), FREE).events == []
    assert sr(status_of(t), "Reclaim") == ("False", "Refused")

    assert t.include(PCI) is True
    clock.advance(timedelta(seconds=1))
    result = t.evaluate(inv(bare), FREE)
    status = result.inventory.gpus[0].status
    assert answer(status)[1:] == ("Unknown", "NoLiveBinding")
    assert reclaim_condition(status) is None
    # one event says so, and the cleared condition does not come back
    assert len(result.events) == 1 and reclaim_condition(result.events[0].event.status) is None
    clock.advance(timedelta(seconds=1))
    managed = t.evaluate(inv(gpu()), claims((PCI, "allocation", "a-1"))).inventory.gpus[0].status
    assert managed.driver_binding.management_state == "Managed"
    assert reclaim_condition(status_of(t)) is None


def test_a_refused_reclaim_leaves_nothing_on_a_healthy_free_card() -> None:
    """Issue 41 (10): a refused reclaim left Reclaim=False/Refused on a free card on its compute driver
    until a restart, its message "refused: refused: ...". The answer goes to the request only."""
    clock = Clock()
    t = tracker(clock)
    t.evaluate(inv(gpu()), FREE)
    t.sent(len(t.outbox))
    t.request_reclaim(PCI)
    result = t.evaluate(inv(gpu()), FREE)
    assert result.reclaims == ["refused"]
    assert reclaim_condition(result.inventory.gpus[0].status) is None
    assert result.events == []  # nothing about the card changed: no event
    said = t.take_answer(PCI, result.inventory.gpus[0].status)
    assert said is not None and (said.status, said.reason) == ("False", "Refused")
    assert said.message == "managementState is Unclaimed: the card is on its compute driver (nvidia), nothing to reclaim"
    # taken once; a later request's answer is its own
    assert t.take_answer(PCI, result.inventory.gpus[0].status) is None
    clock.advance(timedelta(minutes=5))
    assert reclaim_condition(t.evaluate(inv(gpu()), FREE).inventory.gpus[0].status) is None


def test_a_refusal_on_vfio_is_cleared_when_the_card_is_back_on_its_compute_driver() -> None:
    """The class of issue 41 (10): a refusal describes the present. Refused while a VM held the card on
    vfio-pci; the VM's card goes back to its compute driver and the claim with it: the refusal goes."""
    clock = Clock()
    t = tracker(clock)
    t.request_reclaim(PCI)
    assert t.evaluate(inv(gpu(driver="vfio-pci")), claims((PCI, "instance", "vm-1"))).reclaims == ["refused"]
    assert sr(status_of(t), "Reclaim") == ("False", "Refused")
    clock.advance(timedelta(seconds=5))
    # the same managementState (Managed, now by a hold) but the card is on its compute driver
    t.evaluate(inv(gpu()), claims((PCI, "allocation", "a-1")))
    assert reclaim_condition(status_of(t)) is None


STALE_ANSWER_CASES = [
    # (id, card then claims to reach the answer, the card and claims after, Reclaim after)
    ("refused-unclaimed-stays-unclaimed", (gpu(), FREE), (gpu(), FREE), None),  # issue 41: nothing on a free card
    ("refused-unclaimed-then-claimed", (gpu(), FREE), (gpu(), claims((PCI, "allocation", "a-1"))), None),
    ("refused-managed-then-released", (gpu(), claims((PCI, "allocation", "a-1"))), (gpu(), FREE), None),
    ("refused-managed-vm-then-orphan-pending", (gpu(driver="vfio-pci"), claims((PCI, "instance", "vm-1"))), (gpu(driver="vfio-pci"), FREE), None),
    ("refused-unknown-no-driver-then-driver", (gpu(driver=""), FREE), (gpu(), FREE), None),
    ("refused-indeterminate-then-claims-answer", (gpu(), None), (gpu(), FREE), None),
]


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [c[1:] for c in STALE_ANSWER_CASES],
    ids=[c[0] for c in STALE_ANSWER_CASES],
)
def test_a_refusal_stands_only_while_the_state_it_named_does(
    before: tuple[Gpu, Claims | None], after: tuple[Gpu, Claims | None], expected: tuple[str, str] | None
) -> None:
    clock = Clock()
    t = tracker(clock)
    t.request_reclaim(PCI)
    assert t.evaluate(inv(before[0]), before[1]).reclaims == ["refused"]
    clock.advance(timedelta(seconds=5))
    assert sr(t.evaluate(inv(after[0]), after[1]).inventory.gpus[0].status, "Reclaim") == expected


def test_succeeded_is_cleared_when_the_card_leaves_its_compute_driver() -> None:
    clock = Clock()
    t = tracker(clock)
    card = _orphaned(clock, t)
    t.request_reclaim(PCI)
    t.evaluate(card, FREE)
    clock.advance(timedelta(seconds=10))
    t.evaluate(inv(gpu(driver="nvidia")), FREE)
    assert sr(status_of(t), "Reclaim") == ("True", "Succeeded")
    # a hold takes it on its compute driver: still back on it
    t.evaluate(inv(gpu(driver="nvidia")), claims((PCI, "allocation", "a-1")))
    assert sr(status_of(t), "Reclaim") == ("True", "Succeeded")
    # a VM takes it to vfio-pci: "back on its compute driver" is no longer true
    t.evaluate(inv(gpu(driver="vfio-pci")), claims((PCI, "instance", "vm-1")))
    assert reclaim_condition(status_of(t)) is None


def test_failed_stays_until_the_card_is_on_its_compute_driver_again() -> None:
    clock = Clock()
    t = tracker(clock)
    card = _orphaned(clock, t)
    t.request_reclaim(PCI)
    t.evaluate(card, FREE)
    clock.advance(TWO)
    assert t.evaluate(card, FREE).reclaims == ["failed"]
    t.exclude(PCI)  # the state moves (Managed/ExcludedReleasePending), the card is still stuck: Failed stands
    t.evaluate(card, FREE)
    assert sr(status_of(t), "Reclaim") == ("False", "Failed")
    # after a reboot the card is on its compute driver
    clock.advance(timedelta(minutes=5))
    t.evaluate(inv(gpu(driver="nvidia"), boot="boot-b"), FREE)
    assert reclaim_condition(status_of(t)) is None


# --------------------------------------------------------------------------- exclusion


def test_exclude_and_include() -> None:
    t = tracker()
    assert t.exclude(PCI) is True and t.exclude(PCI) is False
    assert t.excluded() == [PCI]
    assert answer(t.evaluate(inv(gpu()), claims((PCI, "allocation", "a-1"))).inventory.gpus[0].status)[1:] == ("Managed", "ExcludedReleasePending")
    assert answer(t.evaluate(inv(gpu()), FREE).inventory.gpus[0].status)[1:] == ("Excluded", "Excluded")
    assert answer(t.evaluate(inv(gpu(driver="vfio-pci")), FREE).inventory.gpus[0].status)[1:] == ("Managed", "ExcludedReleasePending")
    assert t.include(PCI) is True and t.include(PCI) is False
    assert t.include(PCI2) is False
    assert answer(t.evaluate(inv(gpu()), FREE).inventory.gpus[0].status)[1:] == ("Unclaimed", "NoBackingAllocation")


def test_an_exclusion_of_a_card_not_listed_is_kept() -> None:
    t = tracker()
    t.exclude(PCI2)
    t.evaluate(inv(gpu()), FREE)
    assert t.excluded() == [PCI2]
    status = t.evaluate(inv(gpu(), gpu(PCI2, index=1, driver="")), FREE).inventory.gpus[1].status
    assert status.driver_binding.management_state == "Excluded"


# --------------------------------------------------------------------------- the disruption flow


def test_the_disruption_flow_across_a_new_boot_id() -> None:
    clock = Clock()
    t = tracker(clock)
    t.evaluate(inv(gpu()), FREE)
    # the switcher could not roll back: the card is left without a driver
    clock.advance(timedelta(seconds=1))
    t.note_switch(switch_reply(at=clock.now))
    assert t.timers_running()
    stuck = inv(gpu(driver=""))
    walk = []
    for _ in range(4):
        status = t.evaluate(stuck, FREE).inventory.gpus[0].status
        walk.append((status.phase, sr(status, "Reconfiguring")))
        clock.advance(timedelta(seconds=5))
    assert walk == [
        ("Reconfiguring", ("True", "DisruptionRequired")),
        ("Reconfiguring", ("True", "DisruptionPending")),
        ("Reconfiguring", ("True", "RebootRequested")),
        ("Reconfiguring", ("True", "RebootRequested")),
    ]
    rec = t.card(PCI)
    assert rec is not None and rec.disruption is not None and rec.disruption.boot_id == BOOT
    reconf = cond(status_of(t), "Reconfiguring")
    assert reconf is not None and PCI in reconf.message and "reboot" in reconf.message
    # back on nvidia in the same boot proves nothing
    assert sr(t.evaluate(inv(gpu()), FREE).inventory.gpus[0].status, "Reconfiguring") == ("True", "RebootRequested")
    # a new boot, still no driver: still waiting
    status = t.evaluate(inv(gpu(driver=""), boot="boot-b"), FREE).inventory.gpus[0].status
    assert sr(status, "Reconfiguring") == ("True", "RebootRequested")
    reconf = cond(status, "Reconfiguring")
    assert reconf is not None and "rebooted" in reconf.message
    # the new boot with the card on its base driver: Completing, then cleared
    status = t.evaluate(inv(gpu(), boot="boot-b"), FREE).inventory.gpus[0].status
    assert (status.phase, sr(status, "Reconfiguring")) == ("Reconfiguring", ("True", "Completing"))
    status = t.evaluate(inv(gpu(), boot="boot-b"), FREE).inventory.gpus[0].status
    assert (status.phase, sr(status, "Reconfiguring")) == ("Ready", None)
    rec = t.card(PCI)
    assert rec is not None and rec.disruption is None
    t.sent(len(t.outbox))
    assert not t.timers_running()


def test_a_disruption_stuck_on_vfio_reads_passthrough_with_the_condition() -> None:
    t = tracker()
    t.note_switch(switch_reply(target="native"))
    status = t.evaluate(inv(gpu(driver="vfio-pci")), FREE).inventory.gpus[0].status
    assert status.phase == "Passthrough"
    assert sr(status, "Reconfiguring") == ("True", "DisruptionRequired")


def test_a_disruption_without_a_boot_id_records_the_boot_it_was_seen_in() -> None:
    t = tracker()
    t.note_switch(switch_reply(boot=""))
    t.evaluate(inv(gpu(driver=""), boot="boot-x"), FREE)
    rec = t.card(PCI)
    assert rec is not None and rec.disruption is not None and rec.disruption.boot_id == "boot-x"


@pytest.mark.parametrize("outcome", ["Succeeded", "Unchanged", "Refused", "Failed"])
def test_other_outcomes_record_no_disruption(outcome: str) -> None:
    t = tracker()
    t.note_switch(switch_reply(outcome))
    assert t.card(PCI) is None
    assert not t.timers_running()


def test_a_repeated_failure_while_waiting_does_not_restart_the_flow() -> None:
    t = tracker()
    t.note_switch(switch_reply())
    for _ in range(3):
        t.evaluate(inv(gpu(driver="")), FREE)
    t.note_switch(switch_reply(boot=BOOT))
    assert sr(t.evaluate(inv(gpu(driver="")), FREE).inventory.gpus[0].status, "Reconfiguring") == (
        "True",
        "RebootRequested",
    )


def test_a_disruption_on_a_card_that_vanished_waits_for_it() -> None:
    t = tracker()
    t.evaluate(inv(gpu(), gpu(PCI2, index=1)), FREE)
    t.note_switch(switch_reply())
    t.evaluate(inv(gpu(PCI2, index=1)), FREE)  # dropped off the bus
    rec = t.card(PCI)
    assert rec is not None and rec.disruption is not None and rec.disruption.pending
    status = t.evaluate(inv(gpu(driver=""), gpu(PCI2, index=1), boot="boot-b"), FREE).inventory.gpus[0].status
    assert sr(status, "Reconfiguring") == ("True", "DisruptionRequired")


# --------------------------------------------------------------------------- since and events


def test_since_stays_while_status_and_reason_do_not_change() -> None:
    clock = Clock()
    t = tracker(clock)
    t.evaluate(inv(gpu()), claims((PCI, "allocation", "a-1")))
    clock.advance(timedelta(minutes=3))
    # another holder, same status and reason: since stays (the message follows the claim)
    status = t.evaluate(inv(gpu()), claims((PCI, "allocation", "a-2"))).inventory.gpus[0].status
    managed = cond(status, "Managed")
    assert managed is not None and managed.since == T0 and "a-2" in managed.message
    clock.advance(timedelta(minutes=1))
    status = t.evaluate(inv(gpu()), FREE).inventory.gpus[0].status
    managed = cond(status, "Managed")
    assert managed is not None and managed.since == clock.now
    ready = cond(status, "AdapterReady")
    assert ready is not None and ready.since == T0


def test_every_change_is_one_event_and_no_change_is_none() -> None:
    clock = Clock()
    t = tracker(clock)
    first = t.evaluate(inv(gpu(), gpu(PCI2, index=1)), None)
    assert [e.event.pci_address for e in first.events] == [PCI, PCI2]  # first sight of each card
    clock.advance(timedelta(seconds=5))
    assert t.evaluate(inv(gpu(), gpu(PCI2, index=1)), None).events == []
    clock.advance(timedelta(seconds=5))
    second = t.evaluate(inv(gpu(), gpu(PCI2, index=1)), claims((PCI2, "allocation", "a-1")))
    assert [(e.event.pci_address, e.event.management_state) for e in second.events] == [
        (PCI, "Unclaimed"),
        (PCI2, "Managed"),
    ]
    e = second.events[1].event
    assert e.uuid == gpu(PCI2, index=1).uuid and e.phase == "Ready" and e.reason == ""
    assert e.status == status_of(t, PCI2)
    # a message change alone is no event
    clock.advance(timedelta(seconds=5))
    assert t.evaluate(inv(gpu(), gpu(PCI2, index=1)), claims((PCI2, "allocation", "a-2"))).events == []
    # the journal holds every event, in order
    assert [p.event_id for p in t.outbox] == [p.event_id for p in first.events + second.events]


def test_event_ids_are_deterministic_and_valid() -> None:
    def run() -> list[str]:
        clock = Clock()
        t = tracker(clock)
        ids = [e.event_id for e in t.evaluate(inv(gpu(driver="vfio-pci")), FREE).events]
        clock.advance(TWO)
        ids += [e.event_id for e in t.evaluate(inv(gpu(driver="vfio-pci")), FREE).events]
        return ids

    ids = run()
    assert ids == run()
    assert len(ids) == len(set(ids)) == 2
    assert all(re.match(EVENT_ID_PATTERN, i) for i in ids)
    assert ids[0].startswith(f"{NODE}.gpu.{PCI}.20250101t120000000000.")


def test_gpu_id() -> None:
    a = gpu_id("node-a" * 10, "ffff:ff:1f.7", T0, "x" * 1000)
    assert re.match(EVENT_ID_PATTERN, a)
    assert gpu_id(NODE, PCI, T0, "a") != gpu_id(NODE, PCI, T0, "b")
    assert gpu_id(NODE, PCI, T0, "a") != gpu_id(NODE, PCI, T0 + timedelta(microseconds=1), "a")
    # the same instant in another zone is the same id
    from datetime import timezone

    other = T0.astimezone(timezone(timedelta(hours=3)))
    assert gpu_id(NODE, PCI, other, "a") == gpu_id(NODE, PCI, T0, "a")


def test_a_switch_notice_is_reported_with_its_event_even_without_a_change() -> None:
    clock = Clock()
    t = tracker(clock)
    t.evaluate(inv(gpu()), FREE)
    # a failed prepare that rolled back: the card is where it was
    failed = switch_reply("Failed", event="VFIOPrepareFailed", message="bind to vfio-pci failed; rolled back", target="vfio-pci")
    result = t.evaluate(inv(gpu()), FREE, switch=failed)
    assert len(result.events) == 1
    e = result.events[0].event
    assert (e.reason, e.message, e.management_state) == ("VFIOPrepareFailed", "bind to vfio-pci failed; rolled back", "Unclaimed")
    assert re.match(EVENT_ID_PATTERN, result.events[0].event_id)


def test_a_switch_notice_and_the_change_it_caused_are_one_event() -> None:
    t = tracker()
    t.evaluate(inv(gpu()), claims((PCI, "instance", "vm-1")))
    ok = switch_reply("Succeeded", event="VFIOPrepareSucceeded", message="switched to vfio-pci", target="vfio-pci")
    result = t.evaluate(inv(gpu(driver="vfio-pci")), claims((PCI, "instance", "vm-1")), switch=ok)
    assert [(e.event.phase, e.event.management_state, e.event.reason) for e in result.events] == [
        ("Passthrough", "Managed", "VFIOPrepareSucceeded")
    ]


def test_a_notice_without_an_event_adds_nothing() -> None:
    t = tracker()
    t.evaluate(inv(gpu()), FREE)
    assert t.evaluate(inv(gpu()), FREE, switch=switch_reply("Unchanged", event="")).events == []


def test_a_switch_notice_for_a_card_that_vanished_is_still_reported() -> None:
    t = tracker()
    t.evaluate(inv(gpu(), gpu(PCI2, index=1)), FREE)
    result = t.evaluate(inv(gpu(PCI2, index=1)), FREE, switch=switch_reply())
    e = result.events[0].event
    assert (e.pci_address, e.reason, e.status.driver_binding.mode) == (PCI, "VFIOUnprepareFailed", "None")


def test_the_journal_is_bounded_and_counts_what_it_dropped() -> None:
    clock = Clock()
    t = tracker(clock, max_outbox=3)
    for k in range(4):
        t.evaluate(inv(gpu(driver="" if k % 2 else "nvidia")), FREE)
        clock.advance(timedelta(seconds=1))
    assert len(t.outbox) == 3 and t.dropped_events == 1
    t.sent(2)
    assert len(t.outbox) == 1


# --------------------------------------------------------------------------- timers


def test_timers_running_table() -> None:
    clock = Clock()
    t = tracker(clock)
    assert not t.timers_running()  # nothing evaluated yet
    t.evaluate(inv(gpu()), None)
    assert t.timers_running()  # claims unknown: retried on the tick
    t.evaluate(inv(gpu()), FREE)
    assert t.timers_running()  # events journaled, not sent
    t.sent(len(t.outbox))
    assert not t.timers_running()
    t.request_reclaim(PCI)
    assert t.timers_running()
    t.evaluate(inv(gpu()), FREE)  # refused: Unclaimed
    t.sent(len(t.outbox))
    assert not t.timers_running()


# --------------------------------------------------------------------------- the state file


def test_state_round_trip_through_the_file(tmp_path: Path) -> None:
    clock = Clock()
    t = tracker(clock)
    t.exclude(PCI2)
    t.evaluate(inv(gpu(driver="vfio-pci")), FREE)
    t.request_reclaim(PCI)
    t.note_switch(switch_reply(pci=PCI2))
    t.evaluate(inv(gpu(driver="vfio-pci")), FREE)
    store = GpuStateStore(tmp_path / "inventory")
    store.ensure_dir()
    assert store.save(t.state) is True
    assert store.save(t.state) is False  # unchanged: not rewritten
    path = tmp_path / "inventory" / STATE_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    on_disk = json.loads(path.read_text())
    assert on_disk["boot_id"] == BOOT and on_disk["saved_at"]

    loaded = GpuStateStore(tmp_path / "inventory").load()
    assert encode_state(msgspec.structs.replace(loaded, saved_at=None)) == encode_state(t.state)
    again = tracker(clock, state=loaded)
    assert again.excluded() == [PCI2]
    # the orphan timer continues in the same boot: Orphaned 2 minutes after the first sighting
    clock.now = T0 + TWO
    result = again.evaluate(inv(gpu(driver="vfio-pci")), FREE)
    assert answer(result.inventory.gpus[0].status)[1] == "Orphaned"
    assert result.reclaims == ["admitted"]  # the held request survived and started by itself
    rec = again.card(PCI2)
    assert rec is not None and rec.disruption is not None and rec.disruption.pending
    assert again.outbox[: len(t.outbox)] == t.outbox  # unsent events survive too


def test_a_new_boot_after_a_restart_restarts_the_orphan_timer(tmp_path: Path) -> None:
    clock = Clock()
    t = tracker(clock)
    t.evaluate(inv(gpu(driver="vfio-pci")), FREE)
    store = GpuStateStore(tmp_path)
    store.save(t.state)
    again = tracker(clock, state=GpuStateStore(tmp_path).load())
    clock.now = T0 + TWO
    result = again.evaluate(inv(gpu(driver="vfio-pci"), boot="boot-b"), FREE)
    assert result.new_boot
    assert answer(result.inventory.gpus[0].status)[1:] == ("Unknown", "OrphanPending")


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"version": 1, "cards": {"0000:3b:00.0": {"excluded": "yes"}}}',
        b'{"version": 99}',
        b'{"version": 1, "cards": {"3b:00.0": {}}}',
        b"",
    ],
    ids=["not-json", "wrong-type", "future-version", "bad-pci-key", "empty"],
)
def test_a_corrupt_state_file_is_renamed_aside_and_started_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    path = tmp_path / STATE_FILE
    path.write_bytes(content)
    store = GpuStateStore(tmp_path, clock=lambda: 1700000000.0)
    with caplog.at_level(logging.WARNING):
        state = store.load()
    assert state == GpuState()
    assert not path.exists()
    aside = tmp_path / f"{STATE_FILE}.unreadable-1700000000"
    assert aside.read_bytes() == content
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "renamed aside" in warnings[0].getMessage()
    fields = getattr(warnings[0], "fields", {})
    assert fields["renamed_to"] == str(aside)
    # and it saves afresh
    assert store.save(state) is True
    assert decode_state(path.read_bytes()).cards == {}


def test_a_missing_state_file_is_a_fresh_start(tmp_path: Path) -> None:
    assert GpuStateStore(tmp_path / "nope").load() == GpuState()


def test_an_unwritable_state_dir_is_a_state_file_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = GpuStateStore(blocker / "inventory")
    with pytest.raises(StateFileError, match="cannot create"):
        store.ensure_dir()
    with pytest.raises(StateFileError, match="cannot write"):
        store.save(GpuState(boot_id="x"))


def test_an_unreadable_state_file_is_an_error_and_never_overwritten(tmp_path: Path) -> None:
    # a path that cannot be read as a file (even by root): a directory in its place
    (tmp_path / STATE_FILE).mkdir()
    (tmp_path / STATE_FILE / "keep").write_text("x")
    store = GpuStateStore(tmp_path)
    with pytest.raises(StateFileError, match="cannot read"):
        store.load()
    with pytest.raises(StateFileError, match="not saving: cannot read"):
        store.save(GpuState(boot_id="x"))
    assert (tmp_path / STATE_FILE / "keep").read_text() == "x"


def test_the_state_dir_is_under_the_data_dir() -> None:
    assert state_dir_from("/var/lib/bcd") == Path("/var/lib/bcd/inventory")


def test_snapshot_and_restore() -> None:
    t = tracker()
    snap = t.snapshot()
    t.exclude(PCI)
    t.restore(snap)
    assert t.excluded() == []


def test_known_uuids_are_remembered() -> None:
    t = tracker()
    t.exclude(PCI2)
    t.evaluate(inv(gpu(), gpu(PCI2, index=1)), FREE)
    assert t.known_uuids() == {PCI: gpu().uuid, PCI2: gpu(PCI2, index=1).uuid}
    t.evaluate(inv(gpu()), FREE)  # PCI2 vanished; its exclusion (and uuid) stay
    assert t.known_uuids() == {PCI: gpu().uuid, PCI2: gpu(PCI2, index=1).uuid}


def test_a_restart_says_nothing_upstream_that_did_not_happen() -> None:
    """Issue 28.7: every restart published a gpu event with managementState Unknown for every card
    (the converger not answering its claims yet), held ones too, then the real state 30 ms later.
    Now what exists only while the claims are not known at start is kept (fail-closed) but not said."""
    clock = Clock()
    before = tracker(clock)
    held = claims((PCI2, "allocation", "a-1"))
    first = before.evaluate(inv(gpu(), gpu(PCI2, index=1)), held)
    assert [(e.event.pci_address, e.event.management_state) for e in first.events] == [(PCI, "Unclaimed"), (PCI2, "Managed")]
    snapshot = before.snapshot()

    clock.advance(timedelta(minutes=5))
    after = tracker(clock)  # the restarted inventory, its state from disk
    after.restore(snapshot)
    starting = after.evaluate(inv(gpu(), gpu(PCI2, index=1)), None)
    assert starting.events == []
    assert status_of(after, PCI2).driver_binding.management_state == "Unknown"  # fail-closed all the same
    clock.advance(timedelta(milliseconds=30))
    answered = after.evaluate(inv(gpu(), gpu(PCI2, index=1)), held)
    assert answered.events == []  # the same as before the restart: nothing to say
    assert status_of(after, PCI2).driver_binding.management_state == "Managed"
    assert list(after.outbox) == list(before.outbox)

    # a converger that stays away is no change of the cards either (D4 after issue 41): it is
    # the converger's own news (its status), never each card's said Unknown
    clock.advance(timedelta(seconds=20))
    gone = after.evaluate(inv(gpu(), gpu(PCI2, index=1)), None)
    assert gone.events == []
    assert status_of(after, PCI2).driver_binding.management_state == "Unknown"


def test_claims_unknown_later_say_no_unknown_that_did_not_happen() -> None:
    """D4 (after issue 41): with the converger stopped (kill -STOP) for 12 s long after the start, every
    card was said upstream as `Unknown` (Managed=Unknown/Indeterminate), held ones too, then Managed
    again. Whenever the claims are unknown, an event carries what they decide as last said; the card's
    own news (its health) is still said at once; locally the status stays fail-closed."""
    clock = Clock()
    t = tracker(clock, health=HealthPolicy())
    t.note_health_checks([HealthCheck(pci_address=p, answers=True) for p in (PCI, PCI2)], boot_id=BOOT)
    held = claims((PCI2, "allocation", "a-1"))
    first = t.evaluate(inv(gpu(), gpu(PCI2, index=1)), held)
    assert [(e.event.pci_address, e.event.management_state) for e in first.events] == [(PCI, "Unclaimed"), (PCI2, "Managed")]
    said_before = {e.event.pci_address: e.event.status for e in first.events}

    for _ in range(4):  # long after the start: no grace of any kind
        clock.advance(timedelta(minutes=1))
        assert t.evaluate(inv(gpu(), gpu(PCI2, index=1)), None).events == []
        assert status_of(t, PCI2).driver_binding.management_state == "Unknown"  # fail-closed here
        assert sr(status_of(t, PCI2), "Managed") == ("Unknown", "Indeterminate")

    # the card's own news while the claims are unknown: said, with the claimed parts as last said
    t.note_health_event(HealthEvent(PCI2, "xid", clock.now, xid=79), boot_id=BOOT)
    sick = t.evaluate(inv(gpu(), gpu(PCI2, index=1)), None)
    [e] = [p.event for p in sick.events]
    assert e.pci_address == PCI2 and e.management_state == "Managed" and e.phase == "Failed"
    assert sr(e.status, "Managed") == sr(said_before[PCI2], "Managed") and sr(e.status, "Managed")[0] == "True"
    assert sr(e.status, "Healthy") == ("False", "XidCritical")

    # a switch notice while the claims are unknown says no Unknown either
    notice = t.evaluate(inv(gpu(), gpu(PCI2, index=1)), None, switch=switch_reply(pci=PCI, at=clock.now))
    assert [p.event.management_state for p in notice.events] == ["Unclaimed"]

    # the claims answer again, unchanged: nothing to say
    clock.advance(timedelta(seconds=12))
    assert t.evaluate(inv(gpu(), gpu(PCI2, index=1)), held).events == []
    assert status_of(t, PCI2).driver_binding.management_state == "Managed"


def test_a_state_file_of_an_older_bcd_says_nothing_at_its_first_evaluation() -> None:
    """Upgrades too: a card record without `said` takes its last status as said."""
    clock = Clock()
    old = tracker(clock)
    old.evaluate(inv(gpu()), FREE)
    state = old.state
    for rec in state.cards.values():
        rec.said = None  # what an older bcd wrote
    new = tracker(clock, state=state)
    assert new.evaluate(inv(gpu()), FREE).events == []


def test_an_upgrade_from_a_state_file_without_healthy_says_no_unknown_that_did_not_happen() -> None:
    """Issue 41 (12): from a gpus.json with no Healthy condition (a bcd older than GPU health), the
    start said a `gpu` event with managementState Unknown for every card (the converger not answering
    yet), then Managed again. The start computes Healthy and carries what was said forward."""
    clock = Clock()
    old = tracker(clock)  # an older bcd: no health at all
    held = claims((PCI2, "allocation", "a-1"))
    old.evaluate(inv(gpu(), gpu(PCI2, index=1)), held)
    state = decode_state(old.snapshot())
    for rec in state.cards.values():
        assert rec.status is not None and cond(rec.status, "Healthy") is None
        rec.said = None  # what an older bcd wrote: its last status stands for what was said

    clock.advance(timedelta(minutes=5))
    new = tracker(clock, state=state, health=HealthPolicy())
    new.note_health_checks([HealthCheck(pci_address=p, answers=True) for p in (PCI, PCI2)], boot_id=BOOT)
    starting = new.evaluate(inv(gpu(), gpu(PCI2, index=1)), None)
    said = {e.event.pci_address: e.event for e in starting.events}
    # the news is the card's own (Healthy=True); what the claims decide is what was said before
    assert {p: e.management_state for p, e in said.items()} == {PCI: "Unclaimed", PCI2: "Managed"}
    assert all(sr(e.status, "Healthy") == ("True", "Checked") and e.phase == "Ready" for e in said.values())
    assert all(sr(e.status, "Managed")[0] == "True" for e in said.values())
    assert status_of(new, PCI2).driver_binding.management_state == "Unknown"  # fail-closed here all the same
    clock.advance(timedelta(milliseconds=100))
    assert new.evaluate(inv(gpu(), gpu(PCI2, index=1)), held).events == []  # the claims change nothing


def test_a_change_of_the_card_itself_is_said_at_start_while_the_claims_are_not_known() -> None:
    """The grace holds back only what the missing claims make (managementState Unknown); a reboot's
    Reconfiguring Completing is the card's own news and must reach upstream even if the converger
    has not answered yet (the e2e reboot test lost it: Completing then cleared, neither said)."""
    clock = Clock()
    before = tracker(clock)
    before.evaluate(inv(gpu()), FREE)
    clock.advance(timedelta(seconds=1))
    before.note_switch(switch_reply(at=clock.now))
    for _ in range(3):
        before.evaluate(inv(gpu(driver="")), FREE)
        clock.advance(timedelta(seconds=5))
    assert sr(status_of(before), "Reconfiguring") == ("True", "RebootRequested")
    snapshot = before.snapshot()

    after = tracker(clock)  # rebooted: a new boot, the card back on its base driver
    after.restore(snapshot)
    first = after.evaluate(inv(gpu(), boot="boot-b"), None)
    assert [sr(e.event.status, "Reconfiguring") for e in first.events] == [("True", "Completing")]
    second = after.evaluate(inv(gpu(), boot="boot-b"), None)
    assert [sr(e.event.status, "Reconfiguring") for e in second.events] == [None]
    # what the claims then add (Unclaimed for Unknown) is said once they are known
    third = after.evaluate(inv(gpu(), boot="boot-b"), FREE)
    assert [e.event.management_state for e in third.events] == ["Unclaimed"]


# --------------------------------------------------------------------------- a card missing from the scan (issue 41, point 2)


def _lost_case(**kw: Any) -> tuple[Clock, GpuTracker]:
    clock = Clock()
    t = tracker(clock, health=HealthPolicy(), **kw)
    t.note_health_checks([HealthCheck(pci_address=p, answers=True) for p in (PCI, PCI2)], boot_id=BOOT)
    t.evaluate(inv(gpu(), gpu(PCI2, index=1)), claims((PCI2, "allocation", "train-01")))
    t.sent(len(t.outbox))
    return clock, t


def test_a_held_card_missing_from_the_scan_stays_listed_lost_and_said() -> None:
    """Issue 41 (2): with `present: false` on a held card it silently dropped out of the inventory while
    its hold stayed; no gpu event, nothing unhealthy. It stays listed: Healthy=False/GpuLost, phase
    Failed, still Managed by its hold, and one gpu event says so."""
    clock, t = _lost_case()
    clock.advance(timedelta(seconds=1))
    result = t.evaluate(inv(gpu()), claims((PCI2, "allocation", "train-01")))
    lost = next(g for g in result.inventory.gpus if g.pci_address == PCI2)
    assert [g.pci_address for g in result.inventory.gpus] == [PCI, PCI2]
    assert lost.atom_id == gpu(PCI2, index=1).atom_id  # the id its holds name
    assert sr(lost.status, "Healthy") == ("False", "GpuLost")
    assert sr(lost.status, "AdapterReady") == ("False", "NotOnBus")
    assert answer(lost.status) == ("Failed", "Managed", "BackingAllocation")
    assert (lost.driver, lost.status.driver_binding.mode) == ("", "None")
    assert "not on the bus any more" in cond(lost.status, "Healthy").message
    assert [(e.event.pci_address, e.event.phase) for e in result.events] == [(PCI2, "Failed")]
    # still missing: nothing new to say
    clock.advance(timedelta(seconds=30))
    assert t.evaluate(inv(gpu()), claims((PCI2, "allocation", "train-01"))).events == []


def test_a_held_card_that_comes_back_is_never_said_unclaimed_and_stays_lost() -> None:
    """Issue 41 (2): the card that came back was first said Ready/Unclaimed while held. The claims kept
    naming it (it stayed listed), and its GpuLost is sticky until a person acts."""
    clock, t = _lost_case()
    held = claims((PCI2, "allocation", "train-01"))
    t.evaluate(inv(gpu()), held)
    clock.advance(timedelta(seconds=5))
    back = t.evaluate(inv(gpu(), gpu(PCI2, index=1)), held)
    card = next(g for g in back.inventory.gpus if g.pci_address == PCI2)
    assert card.status.driver_binding.management_state == "Managed"
    assert sr(card.status, "Healthy") == ("False", "GpuLost")
    assert all(e.event.management_state != "Unclaimed" for e in back.events if e.event.pci_address == PCI2)
    assert t.card(PCI2).missing_since is None and sr(card.status, "AdapterReady") == ("True", "AdapterReady")


def test_a_free_card_missing_from_the_scan_is_lost_until_a_reboot_without_it() -> None:
    clock, t = _lost_case()
    clock.advance(timedelta(seconds=1))
    gone = t.evaluate(inv(gpu(PCI2, index=1)), claims((PCI2, "allocation", "train-01")))
    lost = next(g for g in gone.inventory.gpus if g.pci_address == PCI)
    assert sr(lost.status, "Healthy") == ("False", "GpuLost") and lost.status.phase == "Failed"
    # a reboot without it: the claims not known yet, it stays; known and naming nothing on it, it goes
    assert PCI in [g.pci_address for g in t.evaluate(inv(gpu(PCI2, index=1), boot="boot-b"), None).inventory.gpus]
    after = t.evaluate(inv(gpu(PCI2, index=1), boot="boot-b"), claims((PCI2, "allocation", "train-01")))
    assert [g.pci_address for g in after.inventory.gpus] == [PCI2]
    assert t.card(PCI) is None


def test_a_held_card_missing_through_a_reboot_stays_listed() -> None:
    clock, t = _lost_case()
    held = claims((PCI2, "allocation", "train-01"))
    t.evaluate(inv(gpu()), held)
    after = t.evaluate(inv(gpu(), boot="boot-b"), held)
    assert sr(next(g for g in after.inventory.gpus if g.pci_address == PCI2).status, "Healthy") == ("False", "GpuLost")


def test_a_missing_card_is_lost_even_when_health_is_not_watched() -> None:
    clock = Clock()
    t = tracker(clock, health=HealthPolicy(enabled=False))
    t.evaluate(inv(gpu(), gpu(PCI2, index=1)), FREE)
    lost = next(g for g in t.evaluate(inv(gpu()), FREE).inventory.gpus if g.pci_address == PCI2)
    assert sr(lost.status, "Healthy") == ("False", "GpuLost") and lost.status.phase == "Failed"


def test_a_state_file_without_listings_relists_a_missing_card_from_the_last_inventory() -> None:
    """An older bcd's gpus.json keeps no listing: the last published inventory names the card."""
    clock, t = _lost_case()
    last = t.evaluate(inv(gpu(), gpu(PCI2, index=1)), FREE).inventory
    state = decode_state(t.snapshot())
    for rec in state.cards.values():
        rec.listing = None
    after = tracker(clock, state=state, health=HealthPolicy())
    result = after.evaluate(inv(gpu()), FREE, known=last)
    assert [g.pci_address for g in result.inventory.gpus] == [PCI, PCI2]
