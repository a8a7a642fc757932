"""Property tests (hypothesis) of the converger on the example host.

(a) For any spec, and any spec after it, the plan right after a successful
    apply is empty.
(b) Random sequences of specs with outside drift between passes (env files
    deleted, foreign CDI files dropped in, fake slices removed, a GPU vanishing
    from the host, the process killed - between passes or at any crash point -
    and a reboot) never put one atom in two holds on disk, never leave a hold on
    disk unreported (its Bound, by event id, in the outbox and no Released
    after it), never send a Released that follows no Bound, and after every
    completed pass the plan is empty.

Deterministic (derandomize, no example database) and sized to run in a few
seconds. Files go to /dev/shm where it exists: the converger fsyncs every
write, and tmpfs makes that free.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.converger.crash import CRASH_POINTS, VFIO_POINTS
from shared.schemas import DeviceAssignment, HugePages, InstanceGpus, Limits, NodeSpec

from tests.converger_kit import GPU, H200, Node, check_hold_invariants, fast_dir, host_copy, host_inventory

G = GPU
HOST_DOC = json.loads(H200.read_text())
ATOMS = sorted(a.id for a in host_inventory().atoms)
PCIS = [g["pci_address"] for g in HOST_DOC["gpus"]]
BOGUS = ["disk/sda", f"{G[7]}/gi1/ci0", "GPU-5f1c2a90-0000-4000-8000-000000000009", f"{G[4]}/slot9", f"{G[6]}/gi1"]
ALLOCS = [f"a{i}" for i in range(7)]

PROFILE = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine on a private loop (leaves the test's event loop alone)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


# ------------------------------------------------------------------------------ strategies

LIMITS = st.sampled_from(
    [
        None,
        None,
        None,
        Limits(cpus="0-1"),
        Limits(memory_bytes=1 << 30),
        Limits(cpus="2", cpu_millis=500, hugepages=[HugePages(page_size_kib=2048, count=16)], mems="1"),
        Limits(hugepages=[HugePages(page_size_kib=1048576, count=40)], mems="0"),  # two of these do not fit node 0
    ]
)
DEVICE = st.sampled_from(ATOMS * 4 + BOGUS)
BINDING = st.sampled_from(["BINDING_HOLD"] * 8 + ["BINDING_KUBERNETES", "BINDING_INSTANCE"])


@st.composite
def assignment(draw: st.DrawFn) -> DeviceAssignment:
    alloc = draw(st.sampled_from(ALLOCS))
    return DeviceAssignment(
        allocation_id=alloc,
        reservation_id=f"rsv-{alloc}-{draw(st.integers(0, 1))}",
        binding=draw(BINDING),
        devices=draw(st.lists(DEVICE, min_size=1, max_size=3)),
        limits=draw(LIMITS),
    )


ASSIGNMENTS = st.lists(assignment(), max_size=5, unique_by=lambda a: a.allocation_id)
INSTANCES = st.lists(st.sampled_from(PCIS), max_size=1).map(
    lambda pcis: [InstanceGpus(instance_id="vm-1", gpus=pcis)] if pcis else []
)


def node_spec(gen: int, devices: list[DeviceAssignment], instances: list[InstanceGpus]) -> NodeSpec:
    return NodeSpec(node_id="node-1", generation=gen, devices=devices, instances=instances)


async def settle(node: Node, s: NodeSpec):
    """Converge; a withdrawn Kubernetes hold is reported by the pass after (no pod holds it here)."""
    p, r = await node.converge(s)
    if p.pending and not r.errors:
        p, r = await node.converge(s)
    return p, r


# ------------------------------------------------------------------------------ (a)


@PROFILE
@given(first=ASSIGNMENTS, second=ASSIGNMENTS, instances=INSTANCES)
def test_plan_after_apply_is_empty(first: list[DeviceAssignment], second: list[DeviceAssignment], instances: list[InstanceGpus]) -> None:
    async def scenario(root: Path) -> None:
        node = Node(root)
        for gen, devices in ((1, first), (2, second)):
            s = node_spec(gen, devices, instances)
            p, r = await settle(node, s)
            assert not r.errors, r.errors
            assert node.plan(s).steps == (), node.plan(s).kinds()
            vfio_settled(node, s)
            live = check_hold_invariants(node)
            # what is held is exactly what is wanted and did not fail (a kept hold
            # is never checked again, so it never fails)
            failed = {f.allocation_id for f in p.failures}
            wanted = {a.allocation_id for a in devices if a.binding in ("BINDING_HOLD", "BINDING_KUBERNETES")}
            assert set(live) == wanted - failed

    with fast_dir("bcd-prop-") as root:
        run(scenario(root))


def vfio_settled(node: Node, s: NodeSpec) -> None:
    """The VFIO record after a converged pass: every listed card an instance wants is on
    vfio-pci and recorded (or waits for a hold), and no listed card is recorded that no
    instance wants."""
    listed = {g.pci_address for g in node.inventory.gpus}
    claimed = {pci for inst in s.instances for pci in inst.gpus} & listed
    recorded = set(node.state.vfio) & listed
    assert recorded <= claimed, (recorded, claimed)
    waiting = set(node.plan(s).vfio_waiting)
    assert claimed - waiting == recorded, (claimed, waiting, recorded)
    assert all(node.switcher.drivers.get(pci) == "vfio-pci" for pci in recorded), node.switcher.drivers
    assert all(d != "vfio-pci" for pci, d in node.switcher.drivers.items() if pci in listed - recorded), node.switcher.drivers


# ------------------------------------------------------------------------------ (b)


class Crash(BaseException):
    """kill -9 at a crash point: nothing in the converger catches it."""


def crash_at(point: str | int, nth: int = 1):  # noqa: ANN201
    """Crash at the nth time `point` is reached; an int k: at the k-th crash point of any name."""
    left = [nth if isinstance(point, str) else point]

    def hook(name: str) -> None:
        if isinstance(point, int) or name == point:
            left[0] -= 1
            if left[0] == 0:
                raise Crash(name)

    return hook


SPEC = st.tuples(st.just("spec"), ASSIGNMENTS, INSTANCES)
CRASH = st.tuples(
    st.just("crash"),
    st.lists(assignment(), min_size=1, max_size=5, unique_by=lambda a: a.allocation_id),
    INSTANCES,
    st.one_of(st.sampled_from(CRASH_POINTS + VFIO_POINTS), st.integers(1, 24)),
    st.sampled_from([1, 1, 1, 2]),
)
ACTION = st.one_of(
    SPEC,
    SPEC,
    CRASH,
    CRASH,
    st.tuples(st.just("rm_env"), st.integers(0, 9)),
    st.tuples(st.just("rm_slice"), st.integers(0, 9)),
    st.tuples(st.just("vanish"), st.integers(0, 7)),
    st.just(("restore",)),
    st.just(("foreign",)),
    st.just(("restart",)),
    st.just(("reboot",)),
    st.just(("pass",)),
)


def vanish(doc: dict, index: int) -> None:
    gone = next(g for g in doc["gpus"] if g["index"] == index)
    doc["gpus"] = [g for g in doc["gpus"] if g["index"] != index]
    doc["processes"] = [p for p in doc["processes"] if p["gpu_uuid"] != gone["uuid"]]
    for d in doc["domains"]:
        d["gpus"] = [p for p in d["gpus"] if p != gone["pci_address"]]


@settings(PROFILE, max_examples=120)
@given(first=SPEC, rest=st.lists(ACTION, min_size=1, max_size=8))
def test_drift_and_crashes_never_break_the_invariants(first: tuple, rest: list[tuple]) -> None:
    actions = [first, *rest]

    async def converged(node: Node, s: NodeSpec) -> None:
        p, r = await settle(node, s)
        assert not r.errors, r.errors
        check_hold_invariants(node)
        assert node.plan(s).steps == (), node.plan(s).kinds()

    async def scenario(root: Path) -> None:
        host = host_copy(root / "host")
        node = Node(root / "node", host)
        gen = 0
        current = node_spec(0, [], [])
        doc = copy.deepcopy(HOST_DOC)
        interrupted = False  # a crash left a pass unfinished; the next pass finishes it
        for action in actions:
            kind = action[0]
            event(kind)
            if kind == "spec":
                gen += 1
                current = node_spec(gen, action[1], action[2])
                await converged(node, current)
            elif kind == "crash":
                gen += 1
                current = node_spec(gen, action[1], action[2])
                node = node.restart(crash=crash_at(action[3], action[4]))
                try:
                    p, r = await node.converge(current)
                except Crash:
                    event("crashed")
                    interrupted = True
                else:
                    assert not r.errors, r.errors
                    check_hold_invariants(node)
                    interrupted = False
                node = node.restart()
            elif kind == "pass":
                await converged(node, current)
            elif kind == "rm_env":
                envs = sorted((node.run_dir / "allocations").glob("*.env")) if (node.run_dir / "allocations").exists() else []
                if envs:
                    envs[action[1] % len(envs)].unlink()
            elif kind == "rm_slice":
                names = node.slice_names()
                if names:
                    node.slices.path(names[action[1] % len(names)]).unlink()
            elif kind == "vanish":
                if any(g["index"] == action[1] for g in doc["gpus"]):
                    vanish(doc, action[1])
                    host.write_text(json.dumps(doc))
                    node.rescan()
            elif kind == "restore":
                doc = copy.deepcopy(HOST_DOC)
                host.write_text(json.dumps(doc))
                node.rescan()
            elif kind == "foreign":
                (node.cdi_dir / "bcd-foreign.json").write_text('{"cdiVersion": "0.6.0", "kind": "acme.com/x", "devices": []}')
                (node.cdi_dir / "bcd-broken.json").write_text("{")
            elif kind == "restart":
                node = node.restart()
            elif kind == "reboot":
                shutil.rmtree(node.run_dir)
                node.run_dir.mkdir()
                node = node.restart(boot_id=f"boot-{gen}")
            else:  # pragma: no cover
                raise AssertionError(kind)
            if kind in ("spec", "pass"):
                interrupted = False
            # drift never breaks what the control plane believes, even before the
            # next pass; only an interrupted pass may leave a hold not yet reported
            check_hold_invariants(node, settled=False, reported=not interrupted)
        # and a final pass always converges to the spec
        await converged(node, current)
        assert node.state.intents == {}
        vfio_settled(node, current)
        if (node.cdi_dir / "bcd-broken.json").exists():
            assert (node.cdi_dir / "bcd-broken.json").read_text() == "{"

    with fast_dir("bcd-prop-") as root:
        run(scenario(root))
