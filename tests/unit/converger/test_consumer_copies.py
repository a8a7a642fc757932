"""The consumer copies of the hold specs through the converger's pass (docs/cdi-runtimes.md).

Each hold spec gets its copy in the same group commit, after the spec and
before the env file; a release takes the copy first, so a runtime never finds
a device whose hold spec is gone; a copy removed or changed from outside is
put back from the hold spec on disk with no second Bound; a copy whose hold
spec is gone is removed. The crash points of the copy are in
test_apply's crash tables (every point, replayed to exactly one Bound).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.converger.crash import CRASH_POINTS
from shared.holdfiles import HoldContent, HoldDevice, consumer_spec

from tests.converger_kit import GPU, FakeReaper, FaultyWriter, Node, check_hold_invariants, fast_dir, files_match, hold, spec

G = GPU
GIB = 1 << 30
S1 = spec(1, hold("a1", G[0], cpus="0-3", memory_bytes=GIB), hold("a2", f"{G[6]}/gi1/ci0"), hold("a3", f"{G[4]}/slot0"))


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


def _files(node: Node, alloc: str) -> tuple[bool, bool, bool]:
    """(hold spec, consumer copy, env file) on disk."""
    return (
        (node.cdi_dir / f"bcd-{alloc}.json").exists(),
        (node.consumer_dir / f"bcd-{alloc}.json").exists(),
        (node.run_dir / "allocations" / f"{alloc}.env").exists(),
    )


async def test_every_hold_gets_its_copy_in_the_bind_order(root: Path) -> None:
    seen: dict[str, tuple[bool, bool, bool]] = {}
    node: Node | None = None

    def hook(point: str) -> None:
        assert point in CRASH_POINTS
        if node is not None and point in ("bind.cdi-written", "bind.consumer-written", "bind.env-written"):
            seen.setdefault(point, _files(node, "a1"))

    node = Node(root, crash=hook)
    _, r = await node.converge(S1)
    assert not r.errors, r.errors
    # spec, then its copy, then the env file
    assert seen == {
        "bind.cdi-written": (True, False, False),
        "bind.consumer-written": (True, True, False),
        "bind.env-written": (True, True, True),
    }
    files_match(node, S1)
    assert node.plan(S1).steps == ()


async def test_a_release_takes_the_copy_before_the_hold_spec(root: Path) -> None:
    node = Node(root)
    await node.converge(S1)
    seen: dict[str, tuple[bool, bool, bool]] = {}

    def hook(point: str) -> None:
        if point in ("release.consumer-removed", "release.cdi-removed"):
            seen.setdefault(point, _files(node, "a2"))

    node = node.restart(crash=hook)
    _, r = await node.converge(spec(2, hold("a1", G[0], cpus="0-3", memory_bytes=GIB), hold("a3", f"{G[4]}/slot0")))
    assert not r.errors, r.errors
    assert seen == {"release.consumer-removed": (True, False, True), "release.cdi-removed": (False, False, True)}
    assert _files(node, "a2") == (False, False, False)


async def test_a_copy_removed_or_changed_from_outside_is_put_back_without_a_second_bound(root: Path) -> None:
    node = Node(root)
    await node.converge(S1)
    copies = node.consumer_copies()
    sends = node.outbox.sends
    (node.consumer_dir / "bcd-a2.json").unlink()
    edited = node.consumer_dir / "bcd-a3.json"
    edited.write_text(edited.read_text().replace('"env": [', '"env": ["INJECTED=1", ', 1))
    p, r = await node.converge(S1)
    assert not r.errors and p.kinds() == ["WriteConsumer", "WriteConsumer"]
    assert node.consumer_copies() == copies
    assert node.outbox.sends == sends
    assert node.plan(S1).steps == ()
    check_hold_invariants(node)


async def test_a_copy_whose_hold_spec_went_is_removed(root: Path) -> None:
    node = Node(root)
    await node.converge(S1)
    # a hold spec removed from outside: its Released goes, and its copy with it
    (node.cdi_dir / "bcd-a2.json").unlink()
    # and a copy no hold of this node ever had
    (node.consumer_dir / "bcd-stray.json").write_text((node.consumer_dir / "bcd-a1.json").read_text())
    _, r = await node.converge(spec(2, hold("a1", G[0], cpus="0-3", memory_bytes=GIB), hold("a3", f"{G[4]}/slot0")))
    assert not r.errors, r.errors
    assert set(node.consumer_copies()) == {"a1", "a3"}
    assert "node-1.a2.released.g2" in node.outbox.ids("released")


async def test_a_failed_copy_undoes_the_bind_and_sends_nothing(root: Path) -> None:
    node = Node(root)
    node.applier.writer = FaultyWriter(node.writer, fail={"write_consumer"})
    _, r = await node.converge(S1)
    assert r.errors
    # no hold spec is left without its copy: the next pass binds afresh
    assert node.holds() == {} and node.consumer_copies() == {}
    assert node.outbox.ids("bound") == []
    node.applier.writer = node.writer
    _, r = await node.converge(S1)
    assert not r.errors, r.errors
    files_match(node, S1)
    assert sorted(node.outbox.ids("bound")) == ["node-1.a1.bound.g1", "node-1.a2.bound.g1", "node-1.a3.bound.g1"]


async def test_a_kept_hold_whose_copy_cannot_be_written_is_not_reported(root: Path) -> None:
    """The hold spec landed, the process died before its copy: the next pass puts the
    copy back before the Bound; while the copy cannot be written, no Bound goes."""

    class Died(BaseException):
        pass

    def hook(point: str) -> None:
        if point == "bind.cdi-written":
            raise Died

    node = Node(root, crash=hook)
    with pytest.raises(Died):
        await node.converge(spec(1, hold("a1", G[0])))
    node = node.restart()
    node.applier.writer = FaultyWriter(node.writer, fail={"write_consumer"})
    p, r = await node.converge(spec(1, hold("a1", G[0])))
    assert p.kinds() == ["WriteEnv", "WriteConsumer", "ReportBound"] and r.errors
    assert node.outbox.ids("bound") == []
    node.applier.writer = node.writer
    _, r = await node.converge(spec(1, hold("a1", G[0])))
    assert not r.errors
    assert node.outbox.ids("bound") == ["node-1.a1.bound.g1"]
    assert node.consumer_copies()["a1"] == consumer_spec(node.holds()["a1"])


async def test_a_kubernetes_release_withdraws_the_copy_with_the_spec(root: Path) -> None:
    reaper = FakeReaper(pod_atoms={G[2]})
    node = Node(root, reaper=reaper, supported_bindings=frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"}))
    await node.converge(spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")))
    assert set(node.consumer_copies()) == {"k1"}
    _, r = await node.converge(spec(2))
    assert not r.errors
    # withdrawn at once (the pods still hold the card: no Released yet), the copy too
    assert _files(node, "k1") == (False, False, False)
    assert node.outbox.ids("released") == []


async def test_a_dra_claims_missing_copy_is_put_back_by_the_pass_and_never_released(root: Path) -> None:
    node = Node(root)
    claim = HoldContent(
        allocation_id="claim-5d1e", reservation_id="claim-5d1e", generation=0, binding="BINDING_CLAIM",
        devices=(HoldDevice.for_gpu(G[5], 5),),
    )  # fmt: skip
    node.writer.write_cdi(claim)
    p = node.plan(spec(1))
    # the claim's hold is the kubelet plugin's: the pass only gives it the copy it lacks
    assert p.kinds() == ["WriteConsumer"]
    _, r = await node.converge(spec(1))
    assert not r.errors
    assert node.consumer_copies()["claim-5d1e"] == consumer_spec(node.holds()["claim-5d1e"])
    assert node.plan(spec(1)).steps == ()


async def test_a_withdrawn_kubernetes_holds_copy_that_comes_back_is_removed_pending_and_after(root: Path) -> None:
    """Issue 41.3: a copy put back (from outside, or by an older bcd) while its hold's release is
    pending, or after the release was reported, is removed by the next pass: the copies that may
    exist are those of the hold specs the pass keeps, and an old-CDI runtime must never resolve a
    withdrawn device."""
    reaper = FakeReaper(pod_atoms={G[2]})
    node = Node(root, reaper=reaper, supported_bindings=frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"}))
    await node.converge(spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")))
    copy = node.consumer_dir / "bcd-k1.json"
    saved = copy.read_bytes()
    _, r = await node.converge(spec(2))
    assert not r.errors and not copy.exists()
    copy.write_bytes(saved)  # back while the release is pending
    p, r = await node.converge(spec(2))
    assert not r.errors and "RemoveConsumer" in p.kinds()
    assert not copy.exists()
    assert node.outbox.ids("released") == []  # still pending: the pods hold the card
    reaper.pod_atoms.clear()
    _, r = await node.converge(spec(2))
    assert not r.errors and node.outbox.ids("released") == ["node-1.k1.released.g2"]
    copy.write_bytes(saved)  # back after the release was reported
    _, r = await node.converge(spec(2))
    assert not r.errors and not copy.exists()
    assert node.plan(spec(2)).steps == ()
