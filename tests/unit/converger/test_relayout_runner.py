"""The MIG re-layout runner (services/converger/relayoutrun.py) alone: its steps against a Node that keeps
Kubernetes' resourceVersion rule, pods that leave when evicted (or not, under a budget), and cards whose
layout the maintenance room makes; a converger killed after any step resumes from its journal and leaves
no taint, cordon or paused label behind. The same flow end to end, over the bus and the API server
stand-in, is tests/integration/test_mig_relayout.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from services.converger.crash import RELAYOUT_POINTS
from services.converger.facts import NodeFacts
from services.converger.metrics import ConvergerMetrics
from services.converger.model import PlanConfig
from services.converger.relayoutrun import RelayoutRunner
from services.converger.state import StateStore
from shared import logs
from shared.schemas import Gpu, GpuClaim, Inventory, MigInstance, MigProfile, NodeChange, NodeReply, NodeTaint, NodeView
from shared.schemas.kubenode import RELAYOUT_MESSAGE_ANNOTATION

CFG, ST = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
DP = "nvidia.com/gpu.deploy.device-plugin"
A, B = "0000:1a:00.0", "0000:1b:00.0"
BOOT = "boot-1"


def card(pci: str, *, mig: bool = True) -> Gpu:
    uuid = "GPU-" + pci.replace(":", "").replace(".", "")
    return Gpu(atom_id=uuid, uuid=uuid, index=0, pci_address=pci, mig_profiles=[MigProfile(name="1g.18gb", profile_id=19, instances_max=7), MigProfile(name="3g.71gb", profile_id=9, instances_max=2)] if mig else [])


@dataclass
class FakeNode:
    """A Node as the API server keeps it: every change checked against the resourceVersion it was made from."""

    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    taints: list[NodeTaint] = field(default_factory=list)
    unschedulable: bool = False
    rv: int = 1
    changes: list[NodeChange] = field(default_factory=list)
    down: bool = False
    #: pods using a card: pci -> names; a name in `budgeted` is never let go (a PodDisruptionBudget)
    pods: dict[str, list[str]] = field(default_factory=dict)
    budgeted: set[str] = field(default_factory=set)
    atoms: dict[str, str] = field(default_factory=dict)
    #: another writer changes the Node between the next read and change
    race_next: bool = False
    drain_stopped: int = 0

    def view(self) -> NodeView:
        return NodeView(
            name="n1",
            resource_version=str(self.rv),
            labels=dict(self.labels),
            annotations={k: v for k, v in self.annotations.items() if k == RELAYOUT_MESSAGE_ANNOTATION},
            taints=list(self.taints),
            unschedulable=self.unschedulable,
        )

    async def read(self) -> NodeReply:
        if self.down:
            return NodeReply(ok=False, reachable=False, detail="down")
        return NodeReply(ok=True, node=self.view())

    async def change(self, req: NodeChange) -> NodeReply:
        if self.down:
            return NodeReply(ok=False, reachable=False, detail="down")
        if self.race_next:
            self.race_next = False
            self.bump()
        if req.resource_version != str(self.rv):
            return NodeReply(ok=False, conflict=True, detail="409")
        self.changes.append(req)
        for k, v in req.labels.items():
            if v is None:
                self.labels.pop(k, None)
            else:
                self.labels[k] = v
        for k, v in req.annotations.items():
            if v is None:
                self.annotations.pop(k, None)
            else:
                self.annotations[k] = v
        taint = NodeTaint(key="mig-reconfigure", value="true", effect="NoSchedule")
        if req.relayout_taint is True and taint not in self.taints:
            self.taints.append(taint)
        if req.relayout_taint is False:
            self.taints = [t for t in self.taints if t.key != "mig-reconfigure"]
        if req.unschedulable is not None:
            self.unschedulable = req.unschedulable
        self.rv += 1
        return NodeReply(ok=True, node=self.view())

    async def drain(self, allocation_id: str, devices: list[str], *, evict: bool) -> tuple[bool, list[str], str]:
        pcis = [p for p, a in self.atoms.items() if a in devices]
        if evict:
            for p in pcis:
                self.pods[p] = [n for n in self.pods.get(p, []) if n in self.budgeted]
        holders = [n for p in pcis for n in self.pods.get(p, [])]
        return bool(holders), holders, ""

    async def stop_drain(self, allocation_id: str) -> None:
        self.drain_stopped += 1

    def bump(self) -> None:
        """Somebody else wrote the Node (a kubelet heartbeat, another controller)."""
        self.rv += 1


class Intake:
    def __init__(self, inv: Inventory) -> None:
        self.inventory: Inventory | None = inv

    async def fetch(self, wake: bool = True) -> None:
        return None


class Claims:
    def __init__(self) -> None:
        self.claims: list[GpuClaim] = []

    def read(self, inv: Inventory) -> list[GpuClaim]:
        return list(self.claims)


class Hardware:
    """The maintenance room and the adapter, as far as the re-layout sees them: a desired-layout record
    is made (Applied), fails (Failed), or waits for a reboot (Pending in this boot)."""

    def __init__(self, gpus: list[Gpu]) -> None:
        self.gpus = {g.pci_address: g for g in gpus}
        self.fail: set[tuple[str, str]] = set()
        self.needs_reboot: set[str] = set()

    def inventory(self) -> Inventory:
        return Inventory(node_id="n1", observed_at=datetime(2026, 12, 7, tzinfo=timezone.utc), gpus=list(self.gpus.values()))

    def run(self, state) -> None:  # noqa: ANN001 - ConvergerState
        for pci, rec in state.mig_layouts.items():
            if rec.state in ("Applied", "Failed") or (rec.blocked_boot and rec.blocked_boot == state.boot_id):
                continue
            g = self.gpus[pci]
            if (pci, rec.layout) in self.fail:
                rec.state, rec.message = "Failed", f"NVML refused {rec.layout}"
                continue
            if pci in self.needs_reboot:
                self.needs_reboot.discard(pci)
                rec.state, rec.blocked_boot, rec.message = "Pending", state.boot_id, "waits for a GPU reset or a node reboot"
                continue
            if rec.layout == "all-disabled":
                self.gpus[pci] = msgspec.structs.replace(g, mig_mode=False, mig_instances=[])
            else:
                profiles = rec.layout.split(",")
                self.gpus[pci] = msgspec.structs.replace(
                    g, mig_mode=True, mig_instances=[MigInstance(atom_id=f"{g.atom_id}/gi{i}/ci0", gi=i, ci=0, profile=p) for i, p in enumerate(profiles, 1)]
                )
            rec.state = "Applied"


class Killed(BaseException):
    """kill -9 at a crash point: nothing after it runs, only what is on disk survives."""


class World:
    def __init__(self, tmp: Path, gpus: list[Gpu], labels: dict[str, str]) -> None:
        self.dir = tmp / "converger"
        self.hw = Hardware(gpus)
        self.node = FakeNode(labels=dict(labels), atoms={g.pci_address: g.atom_id for g in gpus})
        self.claims = Claims()
        self.runner = self.start()

    def start(self, crash_at: str = "") -> RelayoutRunner:
        """A converger (re)started: the journal read again from disk; `crash_at` kills it at that crash point."""

        def crash(point: str) -> None:
            if point == crash_at:
                raise Killed(point)

        store = StateStore(self.dir)
        state = store.load()
        state.boot_id = state.boot_id or BOOT
        facts = NodeFacts(state=state, store=store, config=PlanConfig(node_id="n1"))
        intake = Intake(self.hw.inventory())
        self.intake = intake
        return RelayoutRunner(
            facts,
            intake=intake,  # type: ignore[arg-type]
            claims=self.claims,  # type: ignore[arg-type]
            node=self.node,
            metrics=ConvergerMetrics(CollectorRegistry()),
            trigger=lambda why: None,
            log=logs.get_logger("test.relayout"),
            drain_timeout=30.0,
            crash=crash,
        )

    @property
    def state(self):  # noqa: ANN201
        return self.runner.facts.state

    async def tick(self) -> None:
        self.intake.inventory = self.hw.inventory()
        await self.runner.step()
        self.hw.run(self.state)
        self.intake.inventory = self.hw.inventory()

    async def settle(self, most: int = 20, *, kill_after: int | None = None) -> None:
        for i in range(most):
            if kill_after is not None and i == kill_after:
                self.runner = self.start()  # kill -9: only the journal on disk survives
            try:
                await self.tick()
            except Killed:
                self.runner = self.start()
                self.killed = True
            if self.state.relayout is None and i > 0:
                return

    def clean(self) -> None:
        """What a finished job leaves: no taint, no cordon, no paused label."""
        assert not any(t.key == "mig-reconfigure" for t in self.node.taints), self.node.taints
        assert not self.node.unschedulable
        assert not any(v == "paused-for-mig-change" for v in self.node.labels.values()), self.node.labels


def layout_of(g: Gpu) -> str:
    return "all-disabled" if not g.mig_mode else ",".join(sorted(m.profile for m in g.mig_instances))


ALL7 = ",".join(["1g.18gb"] * 7)


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path, [card(A), card(B, mig=False)], {CFG: "all-1g.18gb", DP: "true"})


async def test_the_flow_from_label_to_success(world: World) -> None:
    world.node.pods = {A: ["gpu/train-0"], B: ["gpu/other"]}
    journaled: list[str] = []
    change = world.node.change

    async def watched(req: NodeChange) -> NodeReply:
        on_disk = StateStore(world.dir).load().relayout
        journaled.append(on_disk.step if on_disk is not None else "nothing")
        return await change(req)

    world.node.change = watched  # type: ignore[method-assign]
    await world.tick()
    assert journaled == ["pausing"], "the job is journaled before the Node is touched"
    assert world.node.labels[ST] == "pending" and world.node.labels[DP] == "paused-for-mig-change"
    assert any(t.key == "mig-reconfigure" for t in world.node.taints) and world.node.unschedulable
    await world.settle()
    assert world.node.labels[ST] == "success"
    assert world.node.labels[DP] == "true"
    world.clean()
    assert layout_of(world.hw.gpus[A]) == ALL7
    assert world.hw.gpus[B].mig_mode is False, "a card without MIG is never touched"
    assert world.node.pods[A] == [] and world.node.pods[B] == ["gpu/other"], "only pods using a changed card are evicted"
    assert world.state.relayout_last is not None and world.state.relayout_last.outcome == "success"
    await world.settle(3)
    assert world.state.relayout is None, "nothing to do once success is said"


@pytest.mark.parametrize("kill_after", range(0, 6))
async def test_a_kill_at_any_step_resumes_and_leaves_nothing_behind(world: World, kill_after: int) -> None:
    world.node.pods = {A: ["gpu/train-0"]}
    await world.settle(30, kill_after=kill_after)
    assert world.node.labels[ST] == "success", (kill_after, world.node.labels)
    world.clean()
    assert layout_of(world.hw.gpus[A]) == ALL7


@pytest.mark.parametrize("point", RELAYOUT_POINTS)
async def test_a_kill_at_each_crash_point_resumes_and_leaves_nothing_behind(world: World, point: str) -> None:
    world.node.pods = {A: ["gpu/train-0"]}
    world.killed = False
    world.runner = world.start(crash_at=point)
    await world.settle(30)
    assert world.killed, f"{point} was never reached"
    assert world.node.labels[ST] == "success", (point, world.node.labels)
    assert world.node.labels[DP] == "true"
    world.clean()
    assert layout_of(world.hw.gpus[A]) == ALL7
    assert world.state.relayout_last is not None and world.state.relayout_last.outcome == "success"


async def test_a_lost_race_is_read_again(world: World) -> None:
    world.node.race_next = True
    await world.tick()
    assert world.state.relayout is not None and world.state.relayout.step == "pausing"
    assert world.node.changes == [] and ST not in world.node.labels, "a change made from a stale read is not made"
    await world.settle()
    assert world.node.labels[ST] == "success"
    world.clean()


async def test_the_node_api_away_mid_job_waits_and_then_finishes(world: World) -> None:
    await world.tick()
    await world.tick()
    world.node.down = True
    for _ in range(3):
        await world.tick()
    assert world.state.relayout is not None, "the job waits in the journal"
    world.node.down = False
    await world.settle()
    assert world.node.labels[ST] == "success"
    world.clean()


async def test_a_held_card_is_refused_before_anything_changes(world: World) -> None:
    world.claims.claims = [GpuClaim(pci_address=A, kind="allocation", holder="train-01")]
    await world.settle()
    assert world.node.labels[ST] == "failed"
    assert "train-01" in world.node.annotations[RELAYOUT_MESSAGE_ANNOTATION]
    assert not any(c.relayout_taint or c.unschedulable for c in world.node.changes), "no taint, no cordon for a refused job"
    assert world.node.labels[DP] == "true"
    assert world.hw.gpus[A].mig_mode is False
    # it stays failed until the label changes (or the state label goes)
    world.claims.claims = []
    await world.settle(3)
    assert world.node.labels[ST] == "failed"
    del world.node.labels[ST]
    await world.settle()
    assert world.node.labels[ST] == "success"


async def test_a_drain_a_budget_blocks_fails_without_changing_the_card(world: World) -> None:
    world.node.pods = {A: ["gpu/train-0", "gpu/guarded"]}
    world.node.budgeted = {"gpu/guarded"}
    world.runner.drain_timeout = 0.0
    await world.settle()
    assert world.node.labels[ST] == "failed"
    assert "gpu/guarded" in world.node.annotations[RELAYOUT_MESSAGE_ANNOTATION]
    assert world.hw.gpus[A].mig_mode is False and A not in world.state.mig_layouts
    assert world.node.drain_stopped >= 1, "kube_reaper stops evicting for a drain that failed"
    world.clean()


async def test_a_failed_apply_rolls_back_to_the_layout_before(tmp_path: Path) -> None:
    before = msgspec.structs.replace(card(A), mig_mode=True, mig_instances=[MigInstance(atom_id="x/gi1/ci0", gi=1, ci=0, profile="3g.71gb")])
    w = World(tmp_path, [before], {CFG: "all-1g.18gb"})
    w.hw.fail.add((A, ALL7))
    await w.settle()
    assert w.node.labels[ST] == "failed"
    assert layout_of(w.hw.gpus[A]) == "3g.71gb"
    assert "rolled back to 3g.71gb" in w.node.annotations[RELAYOUT_MESSAGE_ANNOTATION]
    w.clean()


async def test_all_disabled_rolls_mig_back_and_removes_both_labels(tmp_path: Path) -> None:
    on = msgspec.structs.replace(card(A), mig_mode=True, mig_instances=[MigInstance(atom_id="x/gi1/ci0", gi=1, ci=0, profile="3g.71gb")])
    w = World(tmp_path, [on], {CFG: "all-disabled"})
    await w.settle()
    assert CFG not in w.node.labels and ST not in w.node.labels
    assert w.hw.gpus[A].mig_mode is False
    w.clean()
    await w.settle(3)
    assert w.state.relayout is None


async def test_a_mode_change_waiting_for_a_reboot_says_rebooting_and_finishes_after_it(world: World) -> None:
    world.hw.needs_reboot.add(A)
    for _ in range(8):
        await world.tick()
    assert world.node.labels[ST] == "rebooting"
    assert any(t.key == "mig-reconfigure" for t in world.node.taints), "the taint stays while the card waits"
    # the node reboots: the converger starts again in a new boot
    world.runner = world.start()
    world.state.boot_id = "boot-2"
    await world.settle()
    assert world.node.labels[ST] == "success"
    world.clean()


async def test_a_node_without_a_mig_card_is_never_touched(tmp_path: Path) -> None:
    w = World(tmp_path, [card(A, mig=False)], {CFG: "all-1g.18gb"})
    await w.settle(3)
    assert w.node.changes == []
    assert "no MIG-capable card" in w.runner.note
    st = w.runner.status()
    assert st is not None and st.desired == "all-1g.18gb" and st.running is None and "no MIG-capable card" in st.note


async def test_cards_are_claimed_while_the_job_runs(world: World) -> None:
    from services.converger.service import maintenance_claims

    world.node.pods = {A: ["gpu/guarded"]}
    world.node.budgeted = {"gpu/guarded"}
    await world.tick()
    await world.tick()
    held = maintenance_claims(world.state)
    assert A in held and "MIG re-layout" in held[A] and B not in held
    assert world.runner.status().running.step == "draining"


async def test_the_runner_loop_stops_with_the_service(world: World) -> None:
    stopping = asyncio.Event()
    world.runner.idle_interval = world.runner.busy_interval = 0.01
    task = asyncio.create_task(world.runner.run(stopping))
    await asyncio.sleep(0.1)
    stopping.set()
    await asyncio.wait_for(task, 2)
    assert world.state.relayout is not None or world.state.relayout_last is not None


async def test_a_new_config_set_mid_job_runs_after_it(world: World) -> None:
    for _ in range(3):
        await world.tick()
    assert world.state.relayout is not None and world.state.relayout.config == "all-1g.18gb"
    world.node.labels[CFG] = "all-3g.71gb"
    world.node.bump()
    await world.settle()
    await world.settle()
    assert world.node.labels[CFG] == "all-3g.71gb" and world.node.labels[ST] == "success"
    assert layout_of(world.hw.gpus[A]) == "3g.71gb,3g.71gb"
    assert world.state.relayout_last.config == "all-3g.71gb"
    world.clean()


async def test_all_disabled_done_while_a_new_config_was_set_keeps_the_new_one(tmp_path: Path) -> None:
    on = msgspec.structs.replace(card(A), mig_mode=True, mig_instances=[MigInstance(atom_id="x/gi1/ci0", gi=1, ci=0, profile="3g.71gb")])
    w = World(tmp_path, [on], {CFG: "all-disabled"})
    for _ in range(3):
        await w.tick()
    w.node.labels[CFG] = "all-1g.18gb"
    w.node.bump()
    await w.settle()
    await w.settle()
    assert w.node.labels[CFG] == "all-1g.18gb" and w.node.labels[ST] == "success"
    assert layout_of(w.hw.gpus[A]) == ALL7


async def test_a_card_the_inventory_stops_listing_mid_drain_fails_the_job_at_the_drain_timeout(world: World) -> None:
    world.node.pods = {A: ["gpu/guarded"]}
    world.node.budgeted = {"gpu/guarded"}
    await world.tick()
    assert world.state.relayout.step == "draining"
    del world.hw.gpus[A]  # off the bus: the inventory no longer lists it
    world.runner.drain_timeout = 0.0
    await world.settle()
    assert world.node.labels[ST] == "failed"
    assert "does not list" in world.node.annotations[RELAYOUT_MESSAGE_ANNOTATION]
    world.clean()

