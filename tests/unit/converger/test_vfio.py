"""The VFIO side of the converger: the switch rules as a table, the record and
its retries through apply, and every card's claims.

Rows plan against a real inventory of the example host (tests/converger_kit.py),
changed per row: drivers bound (the fake switcher's kernel), a card's status
(Excluded, Reclaim, Reconfiguring), the host (virtualized, domains), the
converger's record, and what the pass observed (pending releases, an
unreadable releases file). Every row is then applied with the fake switcher
and planned again: a plan right after a successful apply has no steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.converger.hostwriter import HostWriteError
from services.converger.model import Intent, RecordVfio, SwitchGpu
from services.converger.plan import UNREADABLE_RELEASES_HOLDER, plan
from services.converger.switcher import BusSwitcher, NoSwitcher, SwitchUnavailable
from services.converger.vfio import VfioPlan, card_claims, plan_vfio, switched_targets
from shared.schemas import Condition, GpuClaim, Inventory, InstanceGpus, NodeSpec, SwitchRequest

from tests.converger_kit import GPU, FakeSwitcher, FaultyWriter, Node, fast_dir, hold, host_copy, host_inventory, spec, with_status

G = GPU
PCI = {0: "0000:18:00.0", 1: "0000:2a:00.0", 4: "0000:9a:00.0", 6: "0000:ba:00.0"}
NOT_HERE = "0000:01:00.0"
VFIO = "vfio-pci"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
BOOT = "boot-1"


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


def vm(instance: str, *pcis: str) -> InstanceGpus:
    return InstanceGpus(instance_id=instance, gpus=list(pcis))


def cond(type_: str, status: str, reason: str) -> Condition:
    return Condition(type=type_, status=status, reason=reason, message=f"{reason} (test)", since=T0)


def status(pci: str, *conditions: Condition, state: str | None = None) -> Callable[[Inventory], Inventory]:
    return lambda inv: with_status(inv, pci, management_state=state, conditions=conditions)


EXCLUDED = cond("Managed", "False", "Excluded")
EXCLUDED_PENDING = cond("Managed", "True", "ExcludedReleasePending")
RECLAIMING = cond("Reclaim", "Unknown", "InProgress")


def virtualized(doc: dict) -> None:
    doc["virtualized"] = True


def domain_on(pci: str) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        doc["domains"] = [{"name": "build-vm-01", "gpus": [pci]}]

    return change


def bind_intent(alloc: str, *devices: str) -> Intent:
    return Intent(
        op="bind", allocation_id=alloc, reservation_id=f"rsv-{alloc}", generation=1, devices=list(devices),
        event_id=f"node-1.{alloc}.bound.g1", boot_id=BOOT, started_at=T0,
    )  # fmt: skip


def switch(pci: str, target: str, why: str, holder: str) -> tuple:
    return ("switch", pci, target, why, holder)


def record(pci: str, holder: str | None) -> tuple:
    return ("record", pci, holder)


def to_vfio(pci: str, inst: str) -> tuple:
    return switch(pci, VFIO, f"instance {inst}", inst)


def back(pci: str, inst: str) -> tuple:
    return switch(pci, "native", f"instance {inst} no longer claims it", inst)


def reclaim(pci: str) -> tuple:
    return switch(pci, "native", "reclaim", "reclaim")


def waits(pci: str, inst: str, holder: str) -> str:
    return f"instance {inst}: {pci} waits for {holder} to let go before it goes to vfio-pci"


STUCK_NOTE = "needs a node reboot (a switch could not be rolled back in this boot); not switched again"


@dataclass
class Row:
    id: str
    spec: NodeSpec
    #: the VFIO steps, in order: switch(...) / record(...)
    vfio: list[tuple]
    #: kinds of the other steps (holds, conditions)
    kinds: list[str] = field(default_factory=list)
    notes: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    before: NodeSpec | None = None
    host: Callable[[dict], None] | None = None
    #: drivers bound now (the fake switcher's kernel), by PCI address
    drivers: dict[str, str] = field(default_factory=dict)
    #: the converger's VFIO record and stuck cards
    record: dict[str, str] = field(default_factory=dict)
    stuck: dict[str, str] = field(default_factory=dict)
    intents: dict[str, Intent] = field(default_factory=dict)
    inventory: Callable[[Inventory], Inventory] | None = None
    observed: dict[str, Any] = field(default_factory=dict)
    #: changes the node after `before` (its state, its disk)
    drift: Callable[[Node], None] | None = None
    #: allocations refused (overlap)
    failures: list[str] = field(default_factory=list)


def unreported(alloc: str) -> Callable[[Node], None]:
    """The hold is on disk, its bind journaled, its Bound not (a crash after the CDI spec)."""

    def drift(node: Node) -> None:
        intent = node.state.bound.pop(alloc)
        node.state.reported.pop(alloc)
        node.state.intents[alloc] = intent

    return drift


ROWS = [
    # -------------------------------------------------------------- nothing to do
    Row("nothing-to-do-no-instances", spec(1), []),
    Row("nothing-to-do-holds-only", spec(1, hold("a1", G[0])), [], kinds=["BindHold"]),
    Row("nothing-to-do-instance-card-on-vfio-and-recorded", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        drivers={PCI[0]: VFIO}, record={PCI[0]: "vm-a"}),
    Row("nothing-to-do-switch-done-inventory-not-yet-rescanned", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        record={PCI[0]: "vm-a"}, observed={"switched": {PCI[0]: VFIO}}),
    Row("nothing-to-do-foreign-vfio-card-never-switched-back", spec(1), [], drivers={PCI[1]: VFIO}),
    # -------------------------------------------------------------- to vfio-pci
    Row("switch-instance-card", spec(1, instances=[vm("vm-a", PCI[0])]), [to_vfio(PCI[0], "vm-a")]),
    Row("switch-in-spec-order-first-instance-names-it", spec(1, instances=[vm("vm-b", PCI[6], PCI[0]), vm("vm-a", PCI[0])]),
        [to_vfio(PCI[6], "vm-b"), to_vfio(PCI[0], "vm-b")]),
    Row("switch-mig-card-whole", spec(1, instances=[vm("vm-a", PCI[6])]), [to_vfio(PCI[6], "vm-a")]),
    Row("switch-stuck-in-an-earlier-boot", spec(1, instances=[vm("vm-a", PCI[0])]), [to_vfio(PCI[0], "vm-a")],
        stuck={PCI[0]: "boot-0"}),
    Row("already-on-vfio-only-recorded", spec(1, instances=[vm("vm-a", PCI[0])]), [record(PCI[0], "vm-a")],
        drivers={PCI[0]: VFIO}),
    Row("already-on-vfio-record-names-another-instance", spec(2, instances=[vm("vm-b", PCI[0])]), [record(PCI[0], "vm-b")],
        drivers={PCI[0]: VFIO}, record={PCI[0]: "vm-a"}),
    Row("already-on-vfio-reclaim-record-taken-by-instance", spec(1, instances=[vm("vm-a", PCI[0])]), [record(PCI[0], "vm-a")],
        drivers={PCI[0]: VFIO}, record={PCI[0]: "reclaim"}, inventory=status(PCI[0], RECLAIMING)),
    # -------------------------------------------------------------- waits: hold, bind intent, pending release
    Row("wait-live-hold", spec(2, hold("a1", G[0]), instances=[vm("vm-a", PCI[0])]), [],
        notes=(waits(PCI[0], "vm-a", "a1"),), waiting=(PCI[0],), before=spec(1, hold("a1", G[0]))),
    Row("wait-live-hold-on-a-mig-instance", spec(2, hold("a1", f"{G[6]}/gi1/ci0"), instances=[vm("vm-a", PCI[6])]), [],
        notes=(waits(PCI[6], "vm-a", "a1"),), waiting=(PCI[6],), before=spec(1, hold("a1", f"{G[6]}/gi1/ci0"))),
    Row("wait-live-hold-on-a-slot", spec(2, hold("a1", f"{G[4]}/slot1"), instances=[vm("vm-a", PCI[4])]), [],
        notes=(waits(PCI[4], "vm-a", "a1"),), waiting=(PCI[4],), before=spec(1, hold("a1", f"{G[4]}/slot1"))),
    # a bind interrupted after its CDI spec landed: the hold is live until reported
    Row("wait-interrupted-bind-with-its-hold-on-disk", spec(2, hold("a1", G[0]), instances=[vm("vm-a", PCI[0])]), [],
        kinds=["ReportBound"], notes=(waits(PCI[0], "vm-a", "a1"),), waiting=(PCI[0],), before=spec(1, hold("a1", G[0])),
        drift=unreported("a1")),
    # an interrupted bind whose spec never landed is checked again, and loses to the instance
    Row("interrupted-bind-retried-loses-to-the-instance", spec(1, hold("a1", G[0]), instances=[vm("vm-a", PCI[0])]),
        [to_vfio(PCI[0], "vm-a")], kinds=["ReleaseHold", "ReportFailed"], failures=["a1"], intents={"a1": bind_intent("a1", G[0])}),
    Row("wait-pending-kubernetes-release", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        notes=(waits(PCI[0], "vm-a", "k9 (pending Kubernetes release)"),), waiting=(PCI[0],),
        observed={"pending_release_atoms": {G[0]: "k9"}}),
    Row("wait-releases-unreadable", spec(1, instances=[vm("vm-a", PCI[0])]), [], kinds=["SetCondition"],
        notes=(waits(PCI[0], "vm-a", UNREADABLE_RELEASES_HOLDER),), waiting=(PCI[0],), observed={"releases_unreadable": True}),
    Row("wait-only-the-held-card", spec(2, hold("a1", G[0]), instances=[vm("vm-a", PCI[0], PCI[1])]), [to_vfio(PCI[1], "vm-a")],
        notes=(waits(PCI[0], "vm-a", "a1"),), waiting=(PCI[0],), before=spec(1, hold("a1", G[0]))),
    # releases come first: a card moves from a hold to an instance in one generation
    Row("move-hold-to-instance-in-one-generation", spec(2, instances=[vm("vm-a", PCI[0])]), [to_vfio(PCI[0], "vm-a")],
        kinds=["ReleaseHold"], before=spec(1, hold("a1", G[0]))),
    Row("interrupted-bind-undone-then-switched", spec(1, instances=[vm("vm-a", PCI[0])]), [to_vfio(PCI[0], "vm-a")],
        kinds=["ReleaseHold"], intents={"a1": bind_intent("a1", G[0])}),
    # -------------------------------------------------------------- no switch: the card or the host says no
    Row("virtualized-host", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        notes=(f"instance vm-a: {PCI[0]} stays on nvidia: VFIO passthrough needs a bare-metal host",), host=virtualized),
    Row("excluded-card", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        notes=(f"instance vm-a: {PCI[0]} is excluded by the operator; not switched to vfio-pci",),
        inventory=status(PCI[0], EXCLUDED, state="Excluded")),
    Row("excluded-release-pending-card", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        notes=(f"instance vm-a: {PCI[0]} is excluded by the operator; not switched to vfio-pci",),
        inventory=status(PCI[0], EXCLUDED_PENDING, state="Managed")),
    Row("excluded-by-management-state-only", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        notes=(f"instance vm-a: {PCI[0]} is excluded by the operator; not switched to vfio-pci",),
        inventory=status(PCI[0], state="Excluded")),
    Row("reconfiguring-card-waits-for-the-inventory", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        notes=(f"instance vm-a: {PCI[0]} waits: Reconfiguring=RebootRequested",),
        inventory=status(PCI[0], cond("Reconfiguring", "True", "RebootRequested"))),
    Row("stuck-in-this-boot", spec(1, instances=[vm("vm-a", PCI[0])]), [],
        notes=(f"instance vm-a: {PCI[0]} {STUCK_NOTE}",), stuck={PCI[0]: BOOT}, record={PCI[0]: "vm-a"}, drivers={PCI[0]: ""}),
    Row("instance-names-an-unknown-card", spec(1, instances=[vm("vm-a", NOT_HERE)]), [],
        notes=(f"instance vm-a: {NOT_HERE} is not a GPU this node lists; not switched to vfio-pci",)),
    # -------------------------------------------------------------- back to native
    Row("back-when-the-instance-goes", spec(2), [back(PCI[0], "vm-a")], drivers={PCI[0]: VFIO}, record={PCI[0]: "vm-a"}),
    Row("back-when-the-instance-drops-the-card", spec(2, instances=[vm("vm-a", PCI[6])]), [back(PCI[0], "vm-a")],
        drivers={PCI[0]: VFIO, PCI[6]: VFIO}, record={PCI[0]: "vm-a", PCI[6]: "vm-a"}),
    Row("back-on-a-virtualized-host-too", spec(2), [back(PCI[0], "vm-a")], drivers={PCI[0]: VFIO}, record={PCI[0]: "vm-a"},
        host=virtualized),
    Row("back-from-no-driver", spec(2), [back(PCI[0], "vm-a")], drivers={PCI[0]: ""}, record={PCI[0]: "vm-a"}),
    Row("back-excluded-card-too", spec(2), [back(PCI[0], "vm-a")], drivers={PCI[0]: VFIO}, record={PCI[0]: "vm-a"},
        inventory=status(PCI[0], EXCLUDED_PENDING, state="Managed")),
    Row("back-reclaim-record-finishes", spec(2), [reclaim(PCI[0])], drivers={PCI[0]: VFIO}, record={PCI[0]: "reclaim"}),
    Row("kept-while-a-running-domain-has-it", spec(2), [], drivers={PCI[1]: VFIO}, record={PCI[1]: "vm-a"}, host=domain_on(PCI[1])),
    Row("record-dropped-card-already-native", spec(2), [record(PCI[0], None)], record={PCI[0]: "vm-a"}),
    Row("record-dropped-switch-back-done-inventory-not-yet-rescanned", spec(2), [record(PCI[0], None)],
        drivers={PCI[0]: VFIO}, record={PCI[0]: "vm-a"}, observed={"switched": {PCI[0]: "native"}}),
    Row("record-kept-card-not-listed", spec(2), [], record={NOT_HERE: "vm-a"},
        notes=(f"{NOT_HERE} (vm-a) is not a GPU this node lists; kept in the VFIO record",)),
    Row("record-kept-stuck-in-this-boot", spec(2), [], drivers={PCI[0]: ""}, record={PCI[0]: "vm-a"}, stuck={PCI[0]: BOOT},
        notes=(f"{PCI[0]} {STUCK_NOTE}",)),
    # -------------------------------------------------------------- reclaim
    Row("reclaim-admitted-foreign-vfio-card", spec(1), [reclaim(PCI[1])], drivers={PCI[1]: VFIO},
        inventory=status(PCI[1], RECLAIMING)),
    Row("reclaim-held-is-not-started", spec(1), [], drivers={PCI[1]: VFIO}, inventory=status(PCI[1], cond("Reclaim", "Unknown", "Held"))),
    Row("reclaim-failed-is-not-retried", spec(1), [], drivers={PCI[1]: VFIO}, inventory=status(PCI[1], cond("Reclaim", "False", "Failed"))),
    Row("reclaim-succeeded-nothing", spec(1), [], inventory=status(PCI[1], cond("Reclaim", "True", "Succeeded"))),
    Row("reclaim-in-progress-card-already-native", spec(1), [], inventory=status(PCI[1], RECLAIMING)),
    Row("reclaim-claimed-by-an-instance", spec(1, instances=[vm("vm-a", PCI[1])]), [record(PCI[1], "vm-a")], drivers={PCI[1]: VFIO},
        inventory=status(PCI[1], RECLAIMING)),
    Row("reclaim-claimed-by-a-running-domain", spec(1), [], drivers={PCI[1]: VFIO}, host=domain_on(PCI[1]),
        inventory=status(PCI[1], RECLAIMING)),
    Row("reclaim-named-by-a-pending-release", spec(1), [], drivers={PCI[1]: VFIO}, inventory=status(PCI[1], RECLAIMING),
        notes=(f"reclaim of {PCI[1]} waits: k9 (pending Kubernetes release) names it",), observed={"pending_release_atoms": {G[1]: "k9"}}),
    Row("reclaim-releases-unreadable", spec(1), [], kinds=["SetCondition"], drivers={PCI[1]: VFIO}, inventory=status(PCI[1], RECLAIMING),
        notes=(f"reclaim of {PCI[1]} waits: {UNREADABLE_RELEASES_HOLDER} names it",), observed={"releases_unreadable": True}),
    Row("reclaim-stuck-in-this-boot", spec(1), [], drivers={PCI[1]: VFIO}, inventory=status(PCI[1], RECLAIMING), stuck={PCI[1]: BOOT},
        notes=(f"reclaim of {PCI[1]}: it needs a node reboot (a switch could not be rolled back in this boot)",)),
]


def vfio_steps(p) -> list[tuple]:  # noqa: ANN001
    out = []
    for s in p.steps:
        if isinstance(s, SwitchGpu):
            out.append(switch(s.pci, s.target, s.why, s.holder))
        elif isinstance(s, RecordVfio):
            out.append(record(s.pci, s.holder))
    return out


def _node(row: Row, root: Path) -> Node:
    host = host_copy(root / "host", row.host)
    node = Node(root / "node", host, switcher=FakeSwitcher(drivers=dict(row.drivers)))
    return node


def _observe(row: Row, node: Node):  # noqa: ANN202
    if row.inventory is not None:
        node.inventory = row.inventory(node.inventory)
    observed = node.observe(row.spec)
    if row.observed:
        observed = dataclasses.replace(observed, **row.observed)
    return observed


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
async def test_vfio_rule(row: Row, root: Path) -> None:
    node = _node(row, root)
    if row.before is not None:
        _, result = await node.converge(row.before)
        assert not result.errors, result.errors
    node.rescan()
    node.state.vfio.update(row.record)
    node.state.vfio_stuck.update(row.stuck)
    node.state.intents.update(row.intents)
    if row.drift is not None:
        row.drift(node)
    observed = _observe(row, node)
    p = plan(row.spec, observed, node.config)

    assert vfio_steps(p) == row.vfio
    assert [k for k in p.kinds() if k not in ("SwitchGpu", "RecordVfio")] == row.kinds
    assert p.kinds()[len(row.kinds):] == [("SwitchGpu" if v[0] == "switch" else "RecordVfio") for v in row.vfio], "VFIO steps come last"
    assert p.vfio_notes == row.notes and p.notes == ()
    assert p.vfio_waiting == row.waiting
    assert [(f.allocation_id, f.reason) for f in p.failures] == [(a, "overlap") for a in row.failures]
    # pure: the same inputs give the same plan
    assert plan(row.spec, observed, node.config) == p

    # applied with a switcher that succeeds, the next plan has nothing left to do
    result = await node.applier.apply(p, node.state)
    assert not result.errors and not result.vfio_retry
    assert node.switcher.asked == [(v[1], v[2]) for v in row.vfio if v[0] == "switch"]
    for v in row.vfio:
        if v[0] == "switch":
            # to vfio-pci: recorded with its holder; back to native: dropped
            assert node.state.vfio.get(v[1]) == (v[4] if v[2] == VFIO else None)
        else:
            assert node.state.vfio.get(v[1]) == v[2]
    assert node.store.load().vfio == node.state.vfio
    again = plan(row.spec, _observe(row, node), node.config)
    assert again.steps == (), again.kinds()
    assert again.vfio_waiting == row.waiting
    # and still nothing once the inventory shows the switches
    node.rescan()
    again = plan(row.spec, _observe(row, node), node.config)
    assert again.steps == (), again.kinds()


def test_plan_vfio_without_an_inventory_does_nothing() -> None:
    from services.converger.model import ConvergerState, Observed

    observed = Observed(inventory=None, state=ConvergerState(vfio={PCI[0]: "vm-a"}))
    v = plan_vfio(spec(1, instances=[vm("vm-a", PCI[1])]), observed, {})
    assert v == VfioPlan()


def test_switched_targets_apply_only_to_an_inventory_read_before_the_reply() -> None:
    inv = host_inventory()  # observed at 2026-01-01
    before, after = datetime(2025, 12, 31, tzinfo=timezone.utc), datetime(2026, 1, 2, tzinfo=timezone.utc)
    switched = {PCI[0]: (VFIO, after), PCI[1]: ("native", before)}
    assert switched_targets(switched, inv) == {PCI[0]: VFIO}
    assert switched_targets(switched, None) == {PCI[0]: VFIO, PCI[1]: "native"}


# ------------------------------------------------------------------------------ apply: record, outcomes, retries


INST0 = spec(1, instances=[vm("vm-a", PCI[0])])


async def test_the_record_is_saved_before_the_switch_is_asked(root: Path) -> None:
    node = Node(root)
    seen: list[dict[str, str]] = []
    inner = node.switcher

    class Peeking:
        async def switch(self, request: SwitchRequest):  # noqa: ANN202
            seen.append(dict(node.store.load().vfio))
            return await inner.switch(request)

    node.applier.switcher = Peeking()  # type: ignore[assignment]
    p, r = await node.converge(INST0)
    assert vfio_steps(p) == [to_vfio(PCI[0], "vm-a")]
    assert seen == [{PCI[0]: "vm-a"}]
    assert inner.requests == [SwitchRequest(pci=PCI[0], target=VFIO, why="instance vm-a")]
    assert node.switch_counts == {(VFIO, "Succeeded"): 1}

    # back: the record stays until the switch succeeded
    seen.clear()
    await node.converge(spec(2))
    assert seen == [{PCI[0]: "vm-a"}]
    assert node.state.vfio == {} and node.store.load().vfio == {}
    assert node.switcher.drivers[PCI[0]] == "nvidia"


async def test_a_reclaim_is_recorded_before_the_switch(root: Path) -> None:
    node = Node(root, switcher=FakeSwitcher(drivers={PCI[1]: VFIO}, script={PCI[1]: ["Failed"]}))
    node.inventory = with_status(node.inventory, PCI[1], conditions=(RECLAIMING,))
    p, r = await node.converge(spec(1))
    assert vfio_steps(p) == [reclaim(PCI[1])] and r.vfio_retry
    assert node.store.load().vfio == {PCI[1]: "reclaim"}
    # the reclaim condition may be gone by now: the record alone finishes it
    node.rescan()
    p, r = await node.converge(spec(1))
    assert vfio_steps(p) == [reclaim(PCI[1])] and not r.vfio_retry
    assert node.state.vfio == {} and node.switcher.drivers[PCI[1]] == "nvidia"


@pytest.mark.parametrize("outcome", ["Refused", "Failed"])
async def test_refused_or_failed_is_retried_and_leaves_the_section_alone(root: Path, outcome: str) -> None:
    node = Node(root, switcher=FakeSwitcher(script={PCI[0]: [outcome]}))
    s = spec(1, hold("a1", G[1]), instances=[vm("vm-a", PCI[0])])
    p, r = await node.converge(s)
    assert r.vfio_retry and not r.errors and not r.retry
    assert r.section is not None and r.section.state == "CONVERGED"
    assert node.outbox.of_type("section")[-1]["state"] == "CONVERGED"
    assert set(node.holds()) == {"a1"}
    assert node.state.vfio == {PCI[0]: "vm-a"}  # the intent stays recorded
    assert node.state.vfio_stuck == {}
    # the retry asks again, and succeeds
    p, r = await node.converge(s)
    assert vfio_steps(p) == [to_vfio(PCI[0], "vm-a")] and not r.vfio_retry
    assert node.switcher.asked == [(PCI[0], VFIO)] * 2
    assert node.switch_counts == {(VFIO, outcome): 1, (VFIO, "Succeeded"): 1}
    assert node.plan(s).steps == ()


async def test_an_unreachable_switcher_is_retried(root: Path) -> None:
    node = Node(root, switcher=FakeSwitcher(reachable=False))
    p, r = await node.converge(INST0)
    assert r.vfio_retry and not r.errors
    assert node.state.vfio == {PCI[0]: "vm-a"}
    assert node.switch_counts == {(VFIO, "Unreachable"): 1}
    node.switcher.reachable = True
    p, r = await node.converge(INST0)
    assert not r.vfio_retry and node.switcher.drivers == {PCI[0]: VFIO}
    assert node.plan(INST0).steps == ()


async def test_no_switcher_is_unavailable() -> None:
    with pytest.raises(SwitchUnavailable):
        await NoSwitcher().switch(SwitchRequest(pci=PCI[0], target=VFIO))


async def test_a_reply_for_another_request_is_retried(root: Path) -> None:
    node = Node(root)
    inner = node.switcher

    class Confused:
        async def switch(self, request: SwitchRequest):  # noqa: ANN202
            return msgspec.structs.replace(await inner.switch(request), pci=PCI[1])

    node.applier.switcher = Confused()  # type: ignore[assignment]
    p, r = await node.converge(INST0)
    assert r.vfio_retry and node.state.vfio == {PCI[0]: "vm-a"}


async def test_disruption_required_is_not_retried_in_this_boot(root: Path) -> None:
    node = Node(root, switcher=FakeSwitcher(script={PCI[0]: ["DisruptionRequired"]}))
    p, r = await node.converge(INST0)
    assert vfio_steps(p) == [to_vfio(PCI[0], "vm-a")]
    assert not r.vfio_retry and not r.errors
    assert node.state.vfio_stuck == {PCI[0]: BOOT} and node.store.load().vfio_stuck == {PCI[0]: BOOT}
    assert node.state.vfio == {PCI[0]: "vm-a"}
    assert node.switch_counts == {(VFIO, "DisruptionRequired"): 1}
    p, r = await node.converge(INST0)
    assert p.steps == () and p.vfio_waiting == () and not r.vfio_retry
    assert p.vfio_notes == (f"instance vm-a: {PCI[0]} {STUCK_NOTE}",)
    # the instance goes: not switched back either (the card has no driver; a reboot is needed)
    p, r = await node.converge(spec(2))
    assert p.steps == () and node.switcher.asked == [(PCI[0], VFIO)]
    assert p.vfio_notes == (f"{PCI[0]} {STUCK_NOTE}",)
    node.rescan()  # the inventory sees the card with no driver: the same
    assert node.plan(spec(2)).steps == () and node.plan(INST0).steps == ()
    # a restart in the same boot remembers it
    node = node.restart()
    assert node.plan(spec(2)).steps == () and node.plan(INST0).steps == ()

    # a reboot: the card is back on nvidia, the instance still wants it: switched again
    node = node.restart(boot_id="boot-2")
    assert node.state.vfio_stuck == {}
    p, r = await node.converge(spec(3, instances=[vm("vm-a", PCI[0])]))
    assert vfio_steps(p) == [to_vfio(PCI[0], "vm-a")] and not r.vfio_retry
    assert node.switcher.drivers == {PCI[0]: VFIO}


async def test_a_disruption_on_the_way_back_keeps_the_record(root: Path) -> None:
    node = Node(root)
    await node.converge(INST0)
    node.switcher.script[PCI[0]] = ["DisruptionRequired"]
    p, r = await node.converge(spec(2))
    assert vfio_steps(p) == [back(PCI[0], "vm-a")]
    assert node.state.vfio == {PCI[0]: "vm-a"} and node.state.vfio_stuck == {PCI[0]: BOOT}
    assert node.plan(spec(2)).steps == ()
    # after a reboot the card is on nvidia again: the record is dropped, nothing is switched
    node = node.restart(boot_id="boot-2")
    p, r = await node.converge(spec(3))
    assert vfio_steps(p) == [record(PCI[0], None)] and node.state.vfio == {}
    assert node.switcher.asked == []


async def test_a_failed_release_holds_back_the_switch_to_vfio(root: Path) -> None:
    node = Node(root)
    await node.converge(spec(1, hold("a1", G[0])))
    fail = {"remove_cdi"}
    node.applier.writer = FaultyWriter(node.writer, fail)  # type: ignore[assignment]
    s = spec(2, instances=[vm("vm-a", PCI[0])])
    p, r = await node.converge(s)
    assert vfio_steps(p) == [to_vfio(PCI[0], "vm-a")]
    assert r.errors and r.vfio_retry
    assert node.switcher.asked == [] and node.state.vfio == {}
    fail.clear()
    p, r = await node.converge(s)
    assert p.kinds() == ["ReleaseHold", "SwitchGpu"] and not r.errors and not r.vfio_retry
    assert node.switcher.asked == [(PCI[0], VFIO)]


class Crash(BaseException):
    """kill -9 at a crash point: nothing in the converger catches it."""


def crash_at(point: str, nth: int = 1) -> Callable[[str], None]:
    left = [nth]

    def hook(name: str) -> None:
        if name == point:
            left[0] -= 1
            if left[0] == 0:
                raise Crash(name)

    return hook


@pytest.mark.parametrize("nth", [1, 2])
async def test_a_crash_between_the_record_and_the_switch_converges_on_restart(root: Path, nth: int) -> None:
    """nth=1: killed on the way to vfio-pci; nth=2: on the way back."""
    node = Node(root, crash=crash_at("vfio.recorded", nth))
    if nth == 1:
        with pytest.raises(Crash):
            await node.converge(INST0)
        assert node.store.load().vfio == {PCI[0]: "vm-a"} and node.switcher.asked == []
        node = node.restart()
        p, r = await node.converge(INST0)
        assert vfio_steps(p) == [to_vfio(PCI[0], "vm-a")] and not r.vfio_retry
        assert node.plan(INST0).steps == ()
    else:
        await node.converge(INST0)
        with pytest.raises(Crash):
            await node.converge(spec(2))
        assert node.store.load().vfio == {PCI[0]: "vm-a"}
        node = node.restart()
        p, r = await node.converge(spec(2))
        assert vfio_steps(p) == [back(PCI[0], "vm-a")]
        assert node.state.vfio == {} and node.switcher.drivers == {PCI[0]: "nvidia"}
        assert node.plan(spec(2)).steps == ()


async def test_a_crash_before_the_record_when_the_instance_went_meanwhile(root: Path) -> None:
    """Recorded, killed before the switch, and the next spec no longer wants the card: only the record goes."""
    node = Node(root, crash=crash_at("vfio.recorded"))
    with pytest.raises(Crash):
        await node.converge(INST0)
    node = node.restart()
    p, r = await node.converge(spec(2))
    assert vfio_steps(p) == [record(PCI[0], None)]
    assert node.state.vfio == {} and node.switcher.asked == []


async def test_bus_switcher_unreachable_raises_switch_unavailable() -> None:
    import nats

    from shared.subjects import NodeSubjects

    class NoResponders:
        async def request(self, subject: str, data: bytes, timeout: float):  # noqa: ANN202
            raise nats.errors.NoRespondersError

    with pytest.raises(SwitchUnavailable, match="unreachable"):
        await BusSwitcher(NoResponders(), NodeSubjects("node-1")).switch(SwitchRequest(pci=PCI[0], target=VFIO))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ claims


INV = host_inventory()


def claim(pci: str, kind: str, holder: str) -> GpuClaim:
    return GpuClaim(pci_address=pci, kind=kind, holder=holder)  # type: ignore[arg-type]


CLAIM_ROWS = [
    pytest.param({}, [], id="nothing"),
    pytest.param({"holds": {"a1": [G[0]]}}, [claim(PCI[0], "allocation", "a1")], id="hold-whole-card"),
    pytest.param({"holds": {"a2": [f"{G[6]}/gi1/ci0"], "a1": [f"{G[6]}/gi2/ci0"]}},
                 [claim(PCI[6], "allocation", "a1"), claim(PCI[6], "allocation", "a2")], id="holds-of-mig-instances-sorted"),
    pytest.param({"intents": {"b1": [f"{G[4]}/slot0"]}}, [claim(PCI[4], "allocation", "b1")], id="bind-intent"),
    pytest.param({"holds": {"b1": [G[0]]}, "intents": {"b1": [G[0]]}}, [claim(PCI[0], "allocation", "b1")], id="hold-and-its-intent-once"),
    pytest.param({"pending": {"k9": [G[1]]}}, [claim(PCI[1], "release", "k9")], id="pending-release"),
    pytest.param({"unreadable": True}, [claim(g.pci_address, "release", UNREADABLE_RELEASES_HOLDER) for g in sorted(INV.gpus, key=lambda g: g.pci_address)],
                 id="releases-unreadable-every-card"),
    pytest.param({"spec": spec(1, instances=[vm("vm-a", PCI[0]), vm("vm-b", PCI[0], NOT_HERE)])},
                 [claim(NOT_HERE, "instance", "vm-b"), claim(PCI[0], "instance", "vm-a"), claim(PCI[0], "instance", "vm-b")],
                 id="instances-spec-order-unknown-card-too"),
    pytest.param({"domains": {PCI[1]: "build-vm-01"}}, [claim(PCI[1], "domain", "build-vm-01")], id="running-domain"),
    pytest.param(
        {"holds": {"a1": [G[0]]}, "pending": {"k9": [G[0]]}, "spec": spec(1, instances=[vm("vm-a", PCI[0])]), "domains": {PCI[0]: "d1"},
         "intents": {"z1": [G[0]]}},
        [claim(PCI[0], "allocation", "a1"), claim(PCI[0], "allocation", "z1"), claim(PCI[0], "release", "k9"),
         claim(PCI[0], "instance", "vm-a"), claim(PCI[0], "domain", "d1")],
        id="kind-order-allocation-release-instance-domain"),
    pytest.param({"holds": {"x1": ["disk/sda", "GPU-5f1c2a90-0000-4000-8000-000000000009"]}}, [], id="atoms-of-no-card-claim-nothing"),
    pytest.param({"domains": {PCI[1]: "d" * 300}}, [claim(PCI[1], "domain", "d" * 256)], id="holder-clipped-to-the-wire-limit"),
]  # fmt: skip


@pytest.mark.parametrize(("given", "want"), CLAIM_ROWS)
def test_card_claims(given: dict, want: list[GpuClaim]) -> None:
    got = card_claims(
        inventory=INV,
        holds=given.get("holds", {}),
        intents=given.get("intents", {}),
        pending=given.get("pending", {}),
        releases_unreadable=given.get("unreadable", False),
        spec=given.get("spec"),
        domain_gpus=given.get("domains", {}),
    )
    assert got == want
    # every answer decodes on the inventory's side
    from shared.schemas import CLAIMS_CODEC, Claims

    CLAIMS_CODEC.decode(CLAIMS_CODEC.encode(Claims(claims=got, at=T0)))
