"""An outside review of the MIG re-layout (issue 43): each test here is a defect found in the runner
(services/converger/relayoutrun.py) or its rules (services/converger/relayout.py), and fails on the code
as reviewed. They reuse the fakes of test_relayout_runner.py (a Node with Kubernetes' resourceVersion
rule, pods that leave when evicted, cards the maintenance room changes) and add a kube_reaper whose
eviction retries live in its memory, as the real one's do (services/kube_reaper/reaper.py)."""

from __future__ import annotations

import shutil
from datetime import datetime, timezone
from pathlib import Path

import msgspec

from bcd.status import relayout_lines, relayout_problems
from services.converger import gpuops, relayout
from services.converger.model import MigLayoutRecord, RelayoutCard
from shared.schemas import GpuClaim, GpuOpRequest, MigInstance, NodeView
from shared.schemas.kubenode import RELAYOUT_MESSAGE_ANNOTATION
from tests.unit.converger.test_relayout_runner import ALL7, BOOT, CFG, DP, ST, A, World, card, layout_of, world  # noqa: F401 - world is the fixture

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)


def mig_on(pci: str, *profiles: str):  # noqa: ANN201 - a Gpu
    return msgspec.structs.replace(
        card(pci), mig_mode=True, mig_instances=[MigInstance(atom_id=f"x/gi{i}/ci0", gi=i, ci=0, profile=p) for i, p in enumerate(profiles, 1)]
    )


# ---------------------------------------------------------------------------------- the drain


async def test_an_eviction_kube_reaper_did_not_answer_is_asked_again(world: World) -> None:
    """kube_reaper away when the drain starts (restarting, or the bus call timed out): BusNode.drain
    swallows the failed `evict` and answers "held"; the runner marks every card `evicted` anyway
    and never asks again, so the pods stay and the drain fails at its timeout."""
    world.node.pods = {A: ["gpu/train-0"]}
    reaper_up = False
    drain = world.node.drain

    async def bus_drain(allocation_id: str, devices: list[str], *, evict: bool) -> tuple[bool, list[str], str]:
        if not reaper_up:  # what BusNode.drain answers when the evict call raises
            return True, [], "kube_reaper did not answer: NoRespondersError"
        return await drain(allocation_id, devices, evict=evict)

    world.node.drain = bus_drain  # type: ignore[method-assign]
    await world.tick()  # journaled, paused: draining
    await world.tick()  # the first drain: kube_reaper away
    assert world.state.relayout is not None and world.state.relayout.step == "draining"
    reaper_up = True
    for _ in range(5):
        await world.tick()
    assert world.node.pods[A] == [], "kube_reaper is back, but nobody asked it to evict the pods using the card"


class MemoryReaper:
    """kube_reaper as it is: `evict` starts a watch whose retries (a PodDisruptionBudget's 429) live in
    its memory; a restart forgets them (reaper.py: "after a restart the converger's next pass asks
    `evict` again")."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.watched: set[str] = set()

    async def drain(self, allocation_id: str, devices: list[str], *, evict: bool) -> tuple[bool, list[str], str]:
        node = self.world.node
        pcis = [p for p, a in node.atoms.items() if a in devices]
        if evict:
            self.watched.add(allocation_id)
        if allocation_id in self.watched:  # the background retry: a pod goes once its budget lets it
            for p in pcis:
                node.pods[p] = [n for n in node.pods.get(p, []) if n in node.budgeted]
        holders = [n for p in pcis for n in node.pods.get(p, [])]
        return bool(holders), holders, ""

    def restart(self) -> None:
        self.watched.clear()


async def test_a_kube_reaper_restarted_mid_drain_is_asked_to_evict_again(world: World) -> None:
    world.node.pods = {A: ["gpu/guarded"]}
    world.node.budgeted = {"gpu/guarded"}
    reaper = MemoryReaper(world)
    world.node.drain = reaper.drain  # type: ignore[method-assign]
    await world.tick()
    await world.tick()  # evict asked; the budget answers 429, kube_reaper retries in the background
    assert reaper.watched
    reaper.restart()  # kube_reaper restarted (an upgrade, an OOM kill): its retries are gone
    world.node.budgeted = set()  # the budget now lets the pod go
    for _ in range(5):
        await world.tick()
    assert world.node.pods[A] == [], "the pod is free to go, but no eviction is asked for after kube_reaper's restart"


async def test_a_drain_with_no_inventory_in_hand_does_not_pass_for_drained(world: World) -> None:
    """A converger restarted at `draining` reads the Node before its inventory arrived: the drain asks
    kube_reaper about no device at all (card_atoms skips cards it cannot find), which answers "not held"
    (reaper.py: no atoms, no holders), and the job goes on to change a card pods still use."""
    world.node.pods = {A: ["gpu/train-0"]}
    await world.tick()  # journaled, paused: draining
    assert world.state.relayout is not None and world.state.relayout.step == "draining"
    world.runner = world.start()  # the converger restarted
    world.intake.inventory = None  # its first inventory not read yet
    await world.runner.step()
    assert world.node.pods[A] == ["gpu/train-0"]
    assert world.state.relayout.step == "draining", "applying while a pod still uses the card: the drain checked no card"


# ---------------------------------------------------------------------------------- the Node says what is true


async def test_a_label_changed_mid_job_is_not_answered_with_the_old_jobs_success(world: World) -> None:
    await world.tick()  # the job for all-1g.18gb runs
    world.node.labels[CFG] = "all-3g.71gb"  # the cluster asks for another layout meanwhile
    world.node.bump()
    await world.settle()  # the all-1g.18gb job ends
    assert layout_of(world.hw.gpus[A]) == ALL7
    assert not (world.node.labels.get(CFG) == "all-3g.71gb" and world.node.labels.get(ST) == "success"), (
        "the Node says all-3g.71gb succeeded while the card has 7 x 1g.18gb"
    )


async def test_a_new_config_set_during_an_all_disabled_job_is_not_removed(tmp_path: Path) -> None:
    w = World(tmp_path, [mig_on(A, "3g.71gb")], {CFG: "all-disabled"})
    await w.tick()  # the all-disabled job runs
    w.node.labels[CFG] = "all-1g.18gb"  # the cluster asks for MIG again meanwhile
    w.node.bump()
    await w.settle()
    assert w.node.labels.get(CFG) == "all-1g.18gb", "the job's finish removed a mig.config it did not run: the request is lost"


async def test_a_lost_journal_leaves_no_taint_cordon_or_paused_label(world: World) -> None:
    """The converger's journal lost mid-job (a wiped /var/lib, a reinstall): the job taken over from
    `state=pending` takes the taint, the cordon and the paused labels for the operator's, and never
    removes them (the NVIDIA mig-manager the seed follows sets every paused label back to true)."""
    await world.tick()  # paused, tainted, cordoned
    assert world.node.labels[DP] == "paused-for-mig-change"
    shutil.rmtree(world.dir)
    world.runner = world.start()
    await world.settle()
    assert world.node.labels[ST] == "success"
    world.clean()


async def test_a_card_under_a_running_maintenance_operation_is_refused(world: World) -> None:
    """docs/mig-relayout.md step 3: a card held by a maintenance operation refuses the job before it
    touches anything. plan_start is given only CardClaims.read, which has no maintenance operations."""
    world.state.gpu_ops[A] = gpuops.new_op(GpuOpRequest(op="diag", pci=A, level=3), now=NOW, boot_id=BOOT)
    await world.tick()
    assert world.node.labels.get(ST) == "failed", world.node.labels
    assert "diag" in world.node.annotations.get(RELAYOUT_MESSAGE_ANNOTATION, "")
    assert not any(t.key == "mig-reconfigure" for t in world.node.taints) and not world.node.unschedulable


async def test_a_failed_job_stays_a_problem_while_the_node_cannot_be_read(world: World) -> None:
    world.claims.claims = [GpuClaim(pci_address=A, kind="allocation", holder="train-01")]
    await world.settle()
    assert world.node.labels[ST] == "failed"
    now = datetime.now(timezone.utc)
    assert relayout_problems(world.runner.status(), now), "doctor fails mig-relayout while the label asks for a failed config"
    world.node.down = True  # kube_reaper or the API server away for a moment
    await world.tick()
    st = world.runner.status()
    assert not any("mig.config=(none)" in line for line in relayout_lines(st, now)), "bcd status says no label is set: it could not read it"
    assert relayout_problems(st, now), "doctor says `no MIG re-layout runs; none failed` while the Node still asks for the failed config"


# ---------------------------------------------------------------------------------- rollback


def test_a_rollback_that_waits_for_a_reboot_is_still_a_rollback_after_it() -> None:
    """plan_card turns a rollback whose mode change waits for a reboot into `rebooting`; from then on
    `want` is the target again (card.step is no longer "rollback"), so the next pass, in the same boot
    or after the reboot, asks for the layout that failed instead of the one before."""
    gpu = msgspec.structs.replace(card(A), mig_mode=True)  # MIG on, the target's instances failed
    failing = RelayoutCard(target=ALL7, before="all-disabled", step="rollback", rolling_back=True, message=f"{ALL7} failed: NVML")
    waiting = MigLayoutRecord(layout="all-disabled", source="node-label", state="Pending", since=NOW, blocked_boot=BOOT)
    move = relayout.plan_card(failing, gpu, waiting, boot_id=BOOT, disable=False)
    assert move.step == "rebooting"
    failing.step, failing.message = move.step, move.message
    same_boot = relayout.plan_card(failing, gpu, waiting, boot_id=BOOT, disable=False)
    assert same_boot.set_layout != ALL7, "the next pass in the same boot asks for the layout that failed"
    after = relayout.plan_card(failing, msgspec.structs.replace(gpu, mig_mode=False), waiting, boot_id="boot-2", disable=False)
    assert after.set_layout != ALL7, "after the reboot the rollback asks for the layout that failed, not the one before"


async def test_a_rollback_waiting_for_a_reboot_does_not_apply_the_failed_layout_again(world: World) -> None:
    world.hw.needs_reboot.add(A)  # MIG on needs a reboot
    for _ in range(8):
        await world.tick()
    assert world.node.labels[ST] == "rebooting"
    # the node reboots: MIG is on, but the instances cannot be made; MIG off again waits for a reboot too
    world.runner = world.start()
    world.state.boot_id = "boot-2"
    world.hw.gpus[A] = msgspec.structs.replace(world.hw.gpus[A], mig_mode=True)
    world.hw.fail.add((A, ALL7))
    world.hw.needs_reboot.add(A)
    asked: list[str] = []
    for _ in range(6):
        await world.tick()
        asked.append(world.state.mig_layouts[A].layout)
        job = world.state.relayout
        if job is not None and job.cards[A].step == "rebooting":
            break
    assert asked[-1] == "all-disabled", asked
    # the rollback waits for the reboot: the pass after that must not go back to the layout that failed
    await world.tick()
    assert world.state.mig_layouts[A].layout == "all-disabled", "the rollback waiting for a reboot asked for the layout that failed again"


# ---------------------------------------------------------------------------------- what is paused


def test_the_driver_and_toolkit_are_not_paused_as_gpu_clients() -> None:
    """The seed pauses the card's GPU clients; NVIDIA's mig-manager pauses device-plugin,
    gpu-feature-discovery, dcgm-exporter, dcgm and nvsm. plan_start pauses every
    nvidia.com/gpu.deploy.* label, the GPU operator's driver and container toolkit too (their
    DaemonSets select on =true: pausing takes their pods off the node mid-job)."""
    n = NodeView(
        name="n1",
        resource_version="7",
        labels={
            CFG: "all-1g.18gb",
            "nvidia.com/gpu.deploy.device-plugin": "true",
            "nvidia.com/gpu.deploy.driver": "true",
            "nvidia.com/gpu.deploy.container-toolkit": "true",
        },
    )
    got = relayout.plan_start(n, [card(A)], [], None, now=NOW)
    assert isinstance(got, relayout.Begin)
    assert "nvidia.com/gpu.deploy.device-plugin" in got.job.paused
    assert "nvidia.com/gpu.deploy.driver" not in got.job.paused, "the GPU driver DaemonSet is paused off the node"
    assert "nvidia.com/gpu.deploy.container-toolkit" not in got.job.paused, "the container toolkit DaemonSet is paused off the node"


# ---------------------------------------------------------------------------------- the message annotation


async def test_a_long_failure_message_does_not_keep_the_taint_for_good(tmp_path: Path) -> None:
    """The finish change carries the job's message, clipped to 4096 characters (shared.schemas.clip);
    kube_reaper decodes a NodeChange whose annotation values are at most 1024 (kubenode.NodeValue) and
    refuses more (nodeapi.MESSAGE_MAX). Eight cards that fail name eight reasons: the finish is refused
    at every try, and the taint, the cordon and the paused label stay while the cards are free again."""
    from services.kube_reaper.nodeapi import check_change
    from shared.schemas import NODE_REQUEST_CODEC, NodeChange, NodeReply
    from shared.schemas.codec import encode

    pcis = [f"0000:{0x1a + i:02x}:00.0" for i in range(8)]
    w = World(tmp_path, [mig_on(p, "3g.71gb") for p in pcis], {CFG: "all-1g.18gb", DP: "true"})
    for p in pcis:
        w.hw.fail.add((p, ALL7))
    change = w.node.change

    async def through_kube_reaper(req: NodeChange) -> NodeReply:
        try:  # the endpoint decodes the request with its codec first
            NODE_REQUEST_CODEC.decode(encode(req))
        except Exception as exc:  # noqa: BLE001 - any refusal of the decoder
            return NodeReply(ok=False, reachable=False, detail=f"kube_reaper did not answer: ServiceCallError: {exc}")
        problem = check_change(req)
        if problem:
            return NodeReply(ok=False, detail=f"refused, nothing sent: {problem}")
        return await change(req)

    w.node.change = through_kube_reaper  # type: ignore[method-assign]
    await w.settle(40)
    assert all(layout_of(w.hw.gpus[p]) == "3g.71gb" for p in pcis), "every card rolled back"
    assert w.state.relayout is None, f"the job is stuck at {w.state.relayout.step if w.state.relayout else ''}: its finish change is refused"
    assert w.node.labels[ST] == "failed"
    w.clean()


# ---------------------------------------------------------------------------------- bcd gpu mig-layout


async def test_bcd_gpu_mig_layout_after_a_success_does_not_leave_the_node_saying_success(world: World) -> None:
    """The Node label's job succeeded; `bcd gpu mig-layout` on one of its cards is accepted (only a
    running job claims the card) and applied, and nothing runs again (state success for this config):
    the Node keeps saying the label's layout is applied while the card has another."""
    from prometheus_client import CollectorRegistry

    from services.converger.maintenance import Maintenance
    from services.converger.metrics import ConvergerMetrics
    from shared import logs

    await world.settle()
    assert world.node.labels[ST] == "success" and layout_of(world.hw.gpus[A]) == ALL7
    room = Maintenance(
        world.runner.facts,
        intake=world.intake,  # type: ignore[arg-type]
        claims=world.claims,  # type: ignore[arg-type]
        metrics=ConvergerMetrics(CollectorRegistry()),
        trigger=lambda why: None,
        nc=None,  # type: ignore[arg-type]
        subjects=None,  # type: ignore[arg-type]
        log=logs.get_logger("test.relayout"),
    )
    reply = await room.gpu_op(GpuOpRequest(op="mig-layout", pci=A, layout="3g.71gb,3g.71gb"))
    for _ in range(3):
        await world.tick()
    if reply.accepted:
        assert not (layout_of(world.hw.gpus[A]) != ALL7 and world.node.labels.get(ST) == "success"), (
            f"the Node says {world.node.labels[CFG]} is applied (success) while the card has {layout_of(world.hw.gpus[A])}"
        )
