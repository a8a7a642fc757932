"""Group commit (services/converger/batch.py): a pass's releases and binds as one batch.

What a batch costs (one intent record before any side effect, one sign
request, a Released wave (with the Bounds on other cards) then the Bounds that
take a released card, one completion record), that a
GPU's Released still comes before the Bound that takes it, that one hold's
failed file does not hold back the others, and that a crash between any two
files, after the batch sign or after some acks replays to exactly one Bound
per bind and one Released per release, by event id.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.converger.crash import BIND_POINTS, RELEASE_POINTS
from services.converger.hostwriter import HostWriteError
from tests.converger_kit import GPU, Node, check_hold_invariants, fast_dir, files_match, hold, spec

G = GPU
GIB = 1 << 30

#: gen 1: three holds (r1 sliced) on G0-G2, k1 kept on G3.
GEN1 = spec(1, hold("r1", G[0], cpus="0-1", memory_bytes=GIB), hold("r2", G[1]), hold("r3", G[2]), hold("k1", G[3]))
#: gen 2: the same three GPUs move to three new allocations (b1 sliced): 3 releases, 3 binds.
GEN2 = spec(2, hold("k1", G[3]), hold("b1", G[0], cpus="2-3", memory_bytes=GIB), hold("b2", G[1]), hold("b3", G[2]))


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


class Crash(BaseException):
    """Stands for kill -9: nothing in the converger may catch it."""


def crash_at(point: str, nth: int = 1):  # noqa: ANN201
    left = [nth]

    def hook(name: str) -> None:
        if name == point:
            left[0] -= 1
            if left[0] == 0:
                raise Crash(f"{point}:{nth}")

    return hook


def released_before_bound_on_each_gpu(node: Node) -> None:
    """In outbox order, a GPU's Released comes before the Bound of the next holder."""
    holder: dict[str, str] = {}
    for kind, _, alloc, _ in node.outbox.hold_events(node.signer):
        body = next(r for r in node.outbox.reports(kind, node.signer) if r.event.allocation_id == alloc)
        for atom in body.event.devices:
            if kind == "bound":
                assert atom not in holder or holder[atom] == alloc, f"{alloc} bound {atom} before {holder[atom]} was released"
                holder[atom] = alloc
            elif holder.get(atom) == alloc:
                del holder[atom]


class CountingSaves:
    """Wraps the journal's save: what was on disk, and which intents were journaled, at each save."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.inner = node.applier.save_state
        self.saves: list[dict] = []
        node.applier.save_state = self  # type: ignore[assignment]

    def __call__(self, state) -> None:  # noqa: ANN001
        self.saves.append({"holds": set(self.node.holds()), "intents": {a: i.op for a, i in state.intents.items()}})
        self.inner(state)


async def test_a_generation_is_one_intent_record_one_sign_two_waves_one_completion(root: Path) -> None:
    node = Node(root)
    _, r = await node.converge(GEN1)
    assert not r.errors
    saves = CountingSaves(node)
    node.signer.batches = node.outbox.waves = 0  # type: ignore[attr-defined]
    _, r = await node.converge(GEN2)
    assert not r.errors, r.errors
    # the intents of all six steps journaled at once, while the old holds are all still on disk
    first = saves.saves[0]
    assert first["holds"] == {"r1", "r2", "r3", "k1"}
    assert first["intents"] == {"r1": "release", "r2": "release", "r3": "release", "b1": "bind", "b2": "bind", "b3": "bind"}
    # then one record with completion and the section status: nothing journaled is left
    assert len(saves.saves) == 2
    assert saves.saves[1]["intents"] == {}
    assert node.signer.batches == 1  # type: ignore[attr-defined]
    # Released wave, Bound wave, then the section status
    assert node.outbox.waves == 2  # type: ignore[attr-defined]
    files_match(node, GEN2)
    order = [(k, a) for k, _, a, _ in node.outbox.hold_events(node.signer)]
    assert order[-6:] == [("released", "r1"), ("released", "r2"), ("released", "r3"), ("bound", "b1"), ("bound", "b2"), ("bound", "b3")]
    released_before_bound_on_each_gpu(node)
    assert check_hold_invariants(node) == {"k1": "node-1.k1.bound.g1", "b1": "node-1.b1.bound.g2", "b2": "node-1.b2.bound.g2", "b3": "node-1.b3.bound.g2"}
    assert node.plan(GEN2).steps == ()


async def test_one_holds_failed_file_holds_back_only_that_hold(root: Path) -> None:
    node = Node(root)
    (node.run_dir / "allocations").mkdir(parents=True)
    (node.run_dir / "allocations" / "b2.env").mkdir()  # in the way: bcd never removes it
    s = spec(1, hold("b1", G[0]), hold("b2", G[1]), hold("b3", G[2]))
    _, r = await node.converge(s)
    assert [e for e in r.errors if e.startswith("b2:")] and all(e.startswith("b2:") for e in r.errors), r.errors
    assert set(node.holds()) == {"b1", "b3"}  # b2's CDI spec removed again: no hold without its env file
    assert sorted(node.outbox.ids("bound")) == ["node-1.b1.bound.g1", "node-1.b3.bound.g1"]
    assert node.outbox.of_type("section")[-1]["state"] == "PROGRESSING"
    (node.run_dir / "allocations" / "b2.env").rmdir()
    _, r = await node.converge(s)
    assert not r.errors, r.errors
    files_match(node, s)
    assert check_hold_invariants(node) == {a: f"node-1.{a}.bound.g1" for a in ("b1", "b2", "b3")}


class FailRemovalOf:
    """The node's writer, except that removing the CDI spec of the allocations in `fail` fails."""

    def __init__(self, inner, fail: set[str]) -> None:  # noqa: ANN001
        self.inner, self.fail = inner, fail

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def remove_many(self, kind, ids, done=lambda _: None, *, dirs=None):  # noqa: ANN001, ANN201
        bad = {a: HostWriteError(f"cannot remove {a}: injected") for a in ids if kind == "cdi" and a in self.fail}
        return {**bad, **self.inner.remove_many(kind, [a for a in ids if a not in bad], done, dirs=dirs)}


async def test_a_failed_release_in_the_batch_binds_nothing(root: Path) -> None:
    node = Node(root)
    await node.converge(GEN1)
    fail = {"r2"}
    node.applier.writer = FailRemovalOf(node.writer, fail)  # type: ignore[assignment]
    _, r = await node.converge(GEN2)
    assert any(e.startswith("r2:") for e in r.errors), r.errors
    assert [e for e in r.errors if "not bound in this pass: a release before it failed" in e] != []
    assert not [i for i in node.outbox.ids("bound") if i.endswith(".g2")], "no Bound of gen 2 while a release of it failed"
    assert not (set(node.holds()) & {"b1", "b2", "b3"})
    # the other releases went, reported; r2 stays journaled as a release
    assert sorted(node.outbox.ids("released")) == ["node-1.r1.released.g2", "node-1.r3.released.g2"]
    # the journal is as it was for the binds that never started
    assert {a: i.op for a, i in node.state.intents.items()} == {"r2": "release"}
    fail.clear()
    _, r = await node.converge(GEN2)
    assert not r.errors, r.errors
    files_match(node, GEN2)
    released_before_bound_on_each_gpu(node)
    check_hold_invariants(node)


#: every crash point gen 2 passes more than once, at its 2nd and 3rd time, plus each single one.
_PER_HOLD = {
    "release.cdi-removed",
    "release.env-removed",
    "release.slice-stopped",
    "release.published",
    "bind.cdi-temp-written",
    "bind.cdi-written",
    "bind.env-temp-written",
    "bind.env-written",
    "bind.published",
}
CRASHES = [(p, 1) for p in RELEASE_POINTS + BIND_POINTS] + [(p, n) for p in sorted(_PER_HOLD) for n in (2, 3)]


@pytest.mark.parametrize(("point", "nth"), CRASHES, ids=[f"{p}:{n}" for p, n in CRASHES])
async def test_a_crash_anywhere_in_the_batch_replays_to_one_event_per_step(root: Path, point: str, nth: int) -> None:
    node = Node(root)
    _, r = await node.converge(GEN1)
    assert not r.errors
    node = node.restart(crash=crash_at(point, nth))
    with pytest.raises(Crash):
        await node.converge(GEN2)
    check_hold_invariants(node, reported=False, settled=False)

    node = node.restart()
    _, r = await node.converge(GEN2)
    assert not r.errors, r.errors
    files_match(node, GEN2)
    assert node.plan(GEN2).steps == ()
    released_before_bound_on_each_gpu(node)
    assert check_hold_invariants(node) == {"k1": "node-1.k1.bound.g1", "b1": "node-1.b1.bound.g2", "b2": "node-1.b2.bound.g2", "b3": "node-1.b3.bound.g2"}
    assert sorted(node.outbox.ids("released")) == ["node-1.r1.released.g2", "node-1.r2.released.g2", "node-1.r3.released.g2"]
    assert sorted(node.outbox.ids("bound")) == sorted(f"node-1.{a}.bound.g{1 if a[0] in 'rk' else 2}" for a in ("r1", "r2", "r3", "k1", "b1", "b2", "b3"))
    # every event of a replayed step kept its id: nothing new upstream but what was missing
    assert len(node.outbox.order) == len(set(node.outbox.order))


async def test_the_crash_table_reaches_every_point(root: Path) -> None:
    """Guard for the table above: gen 2 passes each (point, nth) of it."""
    seen: dict[str, int] = {}
    node = Node(root)
    await node.converge(GEN1)
    node = node.restart(crash=lambda name: seen.__setitem__(name, seen.get(name, 0) + 1))
    await node.converge(GEN2)
    for point, nth in CRASHES:
        assert seen.get(point, 0) >= nth, (point, nth, seen)
    assert json.loads(json.dumps(seen))
