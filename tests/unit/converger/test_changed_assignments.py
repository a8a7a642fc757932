"""A held allocation whose assignment changed is released and bound again (issue 28.1).

Before, the planner kept the hold as it was (the dry run said keep, the apply
printed "kept ... (bound at an earlier generation)", the section converged),
while the control plane believed the node held what the new assignment says.
Now the hold is what its assignment says (docs/upstream.md): one whose
devices, binding, reservation, limits or env changed is released, reported,
and bound again at the new generation, in the seed's release-before-bind
order, in one pass; a Kubernetes hold's release is split, so the new
assignment waits (PROGRESSING) until no pod holds the old devices. A kill at
any crash point of that pass replays to one Released and one Bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.converger.crash import CRASH_POINTS
from shared.slices import slice_properties

from tests.converger_kit import GPU, FakeReaper, Node, check_hold_invariants, fast_dir, files_match, hold, spec

G = GPU
GIB = 1 << 30
KUBE = frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"})


class Crash(BaseException):
    """Stands for kill -9."""


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


def hold_events(node: Node) -> list[tuple[str, str]]:
    return [(kind, event_id) for kind, event_id, _, _ in node.outbox.hold_events(node.signer)]


@pytest.mark.parametrize(
    ("before", "after", "what"),
    [
        (hold("job-a", G[3]), hold("job-a", G[4]), f"devices {G[3]} -> {G[4]}"),
        (hold("job-a", G[3], env=("A=1",)), hold("job-a", G[3], env=("A=2", "B=1")), "env -A +A, B"),
        (hold("job-a", G[3], cpus="0-3", memory_bytes=GIB), hold("job-a", G[3], cpus="0-7", memory_bytes=GIB), "limits"),
        (hold("job-a", G[3]), hold("job-a", G[3], rsv="rsv-new"), "reservation rsv-job-a -> rsv-new"),
        (hold("job-a", G[3], binding="BINDING_KUBERNETES"), hold("job-a", G[3]), "binding BINDING_KUBERNETES -> BINDING_HOLD"),
    ],
    ids=["devices", "env", "limits", "reservation", "binding"],
)
async def test_a_changed_assignment_is_released_and_bound_again(root: Path, before, after, what: str) -> None:
    node = Node(root, supported_bindings=KUBE)
    _, r = await node.converge(spec(1, before, hold("other", G[0])))
    assert not r.errors
    s2 = spec(2, after, hold("other", G[0]))
    first = node.plan(s2)
    assert what in "; ".join(dict(first.changed)["job-a"]), first.changed
    p, r = await node.converge(s2)
    if before.binding == "BINDING_KUBERNETES":
        # the old hold's release is split: no pod holds it here, so it is reported at the next pass
        assert p.waiting == ("job-a",) and node.outbox.of_type("section")[-1]["state"] == "PROGRESSING"
        p, r = await node.converge(s2)
    assert not r.errors, r.errors
    # the control plane saw the old hold go, then the new one come, at the new generation
    assert hold_events(node)[-2:] == [("released", "node-1.job-a.released.g2"), ("bound", "node-1.job-a.bound.g2")]
    files_match(node, s2)
    assert node.holds()["job-a"]["annotations"]["bcd.dev/generation"] == "2"
    assert set(after.env) <= set(node.env("job-a").splitlines())
    if after.limits is not None:
        assert node.slices.properties("job-a")["AllowedCPUs"] == dict(slice_properties("job-a", after.limits))["AllowedCPUs"]
    assert node.outbox.of_type("section")[-1]["state"] == "CONVERGED"
    assert node.plan(s2).steps == ()
    check_hold_invariants(node)


async def test_the_plan_says_what_changed(root: Path) -> None:
    node = Node(root)
    await node.converge(spec(1, hold("job-a", G[3], env=("A=1",))))
    p = node.plan(spec(2, hold("job-a", G[4], env=("A=1",))))
    assert p.changed == (("job-a", (f"devices {G[3]} -> {G[4]}",)),)
    assert p.kinds() == ["ReleaseHold", "BindHold"]
    # the same assignment at a new generation is the same hold: nothing to do
    assert node.plan(spec(2, hold("job-a", G[3], env=("A=1",)))).steps == ()


async def test_a_kubernetes_hold_moved_waits_for_its_pods_then_binds(root: Path) -> None:
    reaper = FakeReaper(pod_atoms={G[2]})
    node = Node(root, reaper=reaper, supported_bindings=KUBE)
    await node.converge(spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")))
    s2 = spec(2, hold("k1", G[3], binding="BINDING_KUBERNETES"))
    p, r = await node.converge(s2)
    assert not r.errors and p.kinds() == ["WithdrawKubeHold"] and p.waiting == ("k1",)
    section = node.outbox.of_type("section")[-1]
    assert section["state"] == "PROGRESSING" and "k1: waits for its pending Kubernetes release" in section["message"]
    p, r = await node.converge(s2)  # a pod still holds the old card: nothing moves
    assert p.waiting == ("k1",) and node.outbox.ids("released") == []
    reaper.pod_atoms = set()
    p, r = await node.converge(s2)
    assert not r.errors and p.kinds() == ["ReportKubeRelease", "BindHold"]
    assert hold_events(node)[-2:] == [("released", "node-1.k1.released.g2"), ("bound", "node-1.k1.bound.g2")]
    assert node.outbox.of_type("section")[-1]["state"] == "CONVERGED"
    assert node.holds()["k1"]["devices"][0]["annotations"]["bcd.dev/device-id"] == G[3]
    assert node.plan(s2).steps == ()
    check_hold_invariants(node)


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_a_crash_while_moving_a_hold_replays_to_one_released_and_one_bound(root: Path, point: str) -> None:
    node = Node(root)
    await node.converge(spec(1, hold("job-a", G[3], cpus="0-1", memory_bytes=GIB), hold("keep", G[0])))
    hit = [False]

    def hook(name: str) -> None:
        if name == point and not hit[0]:
            hit[0] = True
            raise Crash(point)

    s2 = spec(2, hold("job-a", G[4], cpus="0-3", memory_bytes=GIB), hold("keep", G[0]))
    node = node.restart(crash=hook)
    try:
        await node.converge(s2)
    except Crash:
        pass
    node = node.restart()
    _, r = await node.converge(s2)
    assert not r.errors, r.errors
    files_match(node, s2)
    assert node.plan(s2).steps == ()
    assert check_hold_invariants(node) == {"job-a": "node-1.job-a.bound.g2", "keep": "node-1.keep.bound.g1"}
    assert node.outbox.ids("released") == ["node-1.job-a.released.g2"]
    assert sorted(node.outbox.ids("bound")) == ["node-1.job-a.bound.g1", "node-1.job-a.bound.g2", "node-1.keep.bound.g1"]
