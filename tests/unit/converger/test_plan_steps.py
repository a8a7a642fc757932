"""One table per step of the pass (plan.py's step functions, each on its own).

Every row sets up a node on real files (tests/converger_kit.py), converges a
`before` spec when given, drifts the disk or the observation, then runs ONE
step function on a fresh pass and checks the steps it added (kind and
allocation) and what it left for the steps after it. Each table has a
"nothing to do" row. The whole pass, rule by rule, is test_plan_rules.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from services.converger.admission import HostLedger
from services.converger.atoms import AtomIndex
from services.converger.model import Observed
from services.converger.plan import (
    _Pass,
    claims_after_releases,
    mps_gpus,
    plan_failures,
    plan_kept_holds,
    plan_kubernetes_releases,
    plan_leftover_slices,
    plan_new_holds,
    plan_releases,
)
from services.converger.releases import PendingRelease
from shared.schemas import Limits, NodeSpec

from tests.converger_kit import GPU, Node, hold, spec

G = GPU
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def pending(alloc: str, *devices: str) -> PendingRelease:
    return PendingRelease(
        allocation_id=alloc, reservation_id=f"rsv-{alloc}", devices=list(devices), generation=1, since=T0, event_id=f"node-1.{alloc}.released.g1"
    )


def _pass(node: Node, s: NodeSpec, observed: Observed) -> _Pass:
    return _Pass(spec=s, observed=observed, config=node.config, wanted={a.allocation_id: a for a in s.devices if a.binding != "BINDING_INSTANCE"})


def _kinds(p: _Pass) -> list[tuple[str, str]]:
    return [(type(s).__name__, getattr(s, "allocation_id", "")) for s in p.steps]


@dataclass
class Row:
    id: str
    spec: NodeSpec
    steps: list[tuple[str, str]]
    before: NodeSpec | None = None
    drift: Callable[[Node], None] | None = None
    observed: dict[str, Any] = field(default_factory=dict)
    #: allocations the step marked released / left pending
    released: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)


async def _setup(row: Row, root: Path) -> tuple[Node, _Pass]:
    node = Node(root)
    if row.before is not None:
        _, result = await node.converge(row.before)
        assert not result.errors, result.errors
    if row.drift is not None:
        row.drift(node)
    observed = node.observe(row.spec)
    if row.observed:
        observed = dataclasses.replace(observed, **row.observed)
    return node, _pass(node, row.spec, observed)


# ------------------------------------------------------------------------------ 1. Kubernetes releases

K1 = pending("k1", G[2])
KUBE_ROWS = [
    Row("nothing-to-do", spec(1), []),
    Row("still-held-stays-pending", spec(2), [], observed={"pending_releases": {"k1": K1}, "release_held": {"k1": True}},
        released={"k1"}, pending={"k1"}),
    Row("unknown-counts-as-held", spec(2), [], observed={"pending_releases": {"k1": K1}}, released={"k1"}, pending={"k1"}),
    Row("free-is-reported", spec(2), [("ReportKubeRelease", "k1")], observed={"pending_releases": {"k1": K1}, "release_held": {"k1": False}},
        released={"k1"}),
    # wanted again: taken back only if it binds again on the same devices (plan_new_holds decides)
    Row("wanted-again-waits-for-its-bind", spec(2, hold("k1", G[2], binding="BINDING_KUBERNETES")), [],
        observed={"pending_releases": {"k1": K1}, "release_held": {"k1": True}}),
    Row("crash-before-withdraw-finishes-it", spec(2), [("WithdrawKubeHold", "k1")],
        before=spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")), observed={"pending_releases": {"k1": K1}},
        released={"k1"}, pending={"k1"}),
]


@pytest.mark.parametrize("row", KUBE_ROWS, ids=[r.id for r in KUBE_ROWS])
async def test_plan_kubernetes_releases(row: Row, tmp_path: Path) -> None:
    _, p = await _setup(row, tmp_path)
    plan_kubernetes_releases(p)
    assert _kinds(p) == row.steps
    assert p.released == row.released
    assert set(p.pending) == row.pending


# ------------------------------------------------------------------------------ 2. releases

RELEASE_ROWS = [
    Row("nothing-to-do", spec(2, hold("a1", G[0])), [], before=spec(1, hold("a1", G[0]))),
    Row("unwanted-plain-hold", spec(2), [("ReleaseHold", "a1")], before=spec(1, hold("a1", G[0])), released={"a1"}),
    Row("unwanted-kubernetes-hold-split", spec(2), [("WithdrawKubeHold", "k1")], before=spec(1, hold("k1", G[0], binding="BINDING_KUBERNETES")),
        released={"k1"}, pending={"k1"}),
    Row("vanished-reported-hold-still-released", spec(2), [("ReleaseHold", "a1")], before=spec(1, hold("a1", G[0])),
        drift=lambda n: (n.cdi_dir / "bcd-a1.json").unlink(), released={"a1"}),
    Row("two-in-allocation-order", spec(2, hold("c1", G[2])), [("ReleaseHold", "a1"), ("ReleaseHold", "b1")],
        before=spec(1, hold("b1", G[1]), hold("a1", G[0]), hold("c1", G[2])), released={"a1", "b1"}),
]


@pytest.mark.parametrize("row", RELEASE_ROWS, ids=[r.id for r in RELEASE_ROWS])
async def test_plan_releases(row: Row, tmp_path: Path) -> None:
    _, p = await _setup(row, tmp_path)
    plan_releases(p)
    assert _kinds(p) == row.steps
    assert p.released == row.released
    assert set(p.pending) == row.pending


async def test_plan_releases_a_kubernetes_release_records_what_it_booked(tmp_path: Path) -> None:
    node = Node(tmp_path)
    await node.converge(spec(1, hold("k1", G[0], binding="BINDING_KUBERNETES", memory_bytes=1 << 30)))
    p = _pass(node, spec(2), node.observe(spec(2)))
    plan_releases(p)
    assert p.pending["k1"].limits == Limits(memory_bytes=1 << 30)


# ------------------------------------------------------------------------------ 3. leftover slices


def _leftover(alloc: str, busy: bool = False) -> Callable[[Node], None]:
    def run(node: Node) -> None:
        node.slices.apply(alloc, Limits(cpus="0"))
        if busy:
            node.slices.set_pids(alloc, [4242])

    return run


SLICE_ROWS = [
    Row("nothing-to-do", spec(1), []),
    Row("empty-leftover-stopped", spec(1), [("StopSlice", "old1")], drift=_leftover("old1")),
    Row("busy-leftover-kept", spec(1), [], drift=_leftover("old1", busy=True)),
    Row("wanted-not-stopped", spec(1, hold("old1", G[0], cpus="0")), [], drift=_leftover("old1")),
]


@pytest.mark.parametrize("row", SLICE_ROWS, ids=[r.id for r in SLICE_ROWS])
async def test_plan_leftover_slices(row: Row, tmp_path: Path) -> None:
    _, p = await _setup(row, tmp_path)
    plan_leftover_slices(p)
    assert _kinds(p) == row.steps


async def test_plan_leftover_slices_skips_one_released_in_this_pass(tmp_path: Path) -> None:
    node = Node(tmp_path)
    _leftover("a1")(node)
    p = _pass(node, spec(1), node.observe(spec(1)))
    p.released.add("a1")
    plan_leftover_slices(p)
    assert p.steps == []


# ------------------------------------------------------------------------------ 4. kept holds

S_KEPT = spec(1, hold("a1", G[0], cpus="0-3"), hold("a2", G[1]))
KEPT_ROWS = [
    Row("nothing-to-do", S_KEPT, [], before=S_KEPT),
    Row("missing-env-rewritten", S_KEPT, [("WriteEnv", "a2")], before=S_KEPT, drift=lambda n: (n.run_dir / "allocations" / "a2.env").unlink()),
    Row("missing-slice-recreated", S_KEPT, [("EnsureSlice", "a1")], before=S_KEPT, drift=lambda n: n.slices.path("a1").unlink()),
    Row("unreported-bound-reported", S_KEPT, [("ReportBound", "a1"), ("ReportBound", "a2")], before=S_KEPT,
        drift=lambda n: n.state.reported.clear()),
]


@pytest.mark.parametrize("row", KEPT_ROWS, ids=[r.id for r in KEPT_ROWS])
async def test_plan_kept_holds(row: Row, tmp_path: Path) -> None:
    node, p = await _setup(row, tmp_path)
    index = AtomIndex(p.observed.inventory)
    claims, _ = claims_after_releases(p, index)
    ledger = HostLedger(p.observed.inventory.host if p.observed.inventory else None, 0)
    kept = plan_kept_holds(p, index, claims, ledger, mps_gpus(p.observed))
    assert _kinds(p) == row.steps
    assert set(kept) == {"a1", "a2"}
    # what the kept holds hold is claimed for the new holds after them
    assert claims.atoms[G[0]] == "a1" and claims.atoms[G[1]] == "a2"


# ------------------------------------------------------------------------------ 5. new holds

NEW_ROWS = [
    Row("nothing-to-do", spec(1, hold("a1", G[0])), [], before=spec(1, hold("a1", G[0]))),
    Row("bind-in-spec-order", spec(1, hold("b1", G[1]), hold("a1", G[0])), [("BindHold", "b1"), ("BindHold", "a1")]),
    Row("earlier-in-pass-counts", spec(1, hold("a1", G[0]), hold("b1", G[0])), [("BindHold", "a1")]),
    Row("instance-binding-refused", spec(1, hold("v1", G[0], binding="BINDING_INSTANCE")), []),
]


@pytest.mark.parametrize("row", NEW_ROWS, ids=[r.id for r in NEW_ROWS])
async def test_plan_new_holds(row: Row, tmp_path: Path) -> None:
    node, p = await _setup(row, tmp_path)
    p.wanted = {a.allocation_id: a for a in row.spec.devices if a.binding in ("BINDING_HOLD", "BINDING_KUBERNETES")}
    index = AtomIndex(p.observed.inventory)
    claims, _ = claims_after_releases(p, index)
    ledger = HostLedger(p.observed.inventory.host if p.observed.inventory else None, 0)
    kept = plan_kept_holds(p, index, claims, ledger, mps_gpus(p.observed))
    p.steps.clear()
    failures = plan_new_holds(p, index, claims, ledger, mps_gpus(p.observed), kept)
    assert _kinds(p) == row.steps
    bound = {s.allocation_id for s in p.steps}
    assert {f.allocation_id for f in failures} == {a.allocation_id for a in row.spec.devices} - bound - set(kept)


# ------------------------------------------------------------------------------ 6. failures


async def test_plan_failures_table(tmp_path: Path) -> None:
    from services.converger.model import Failure

    node = Node(tmp_path)
    f = Failure("b1", "rsv-b1", "overlap", f"{G[0]} is held by a1")
    rows = [
        # (failures, already reported at generation, steps)
        ([], None, []),
        ([f], None, [("ReportFailed", "b1")]),
        ([f], 3, []),  # reported once per generation
        ([f], 2, [("ReportFailed", "b1")]),  # and again in the next
    ]
    for failures, reported_at, steps in rows:
        node.state.reported_failures = {"b1": reported_at} if reported_at is not None else {}
        p = _pass(node, spec(3), node.observe(spec(3)))
        plan_failures(p, failures)
        assert _kinds(p) == steps, (failures, reported_at)
        for s in p.steps:
            assert s.event.generation == 3 and s.event_id == "node-1.b1.failed.g3"  # type: ignore[union-attr]


async def test_plan_kept_holds_reports_no_bound_while_its_env_file_cannot_be_rebuilt(tmp_path: Path) -> None:
    """A kept hold, never reported, whose env file is gone and whose GPU left the inventory: a note, no Bound.
    (Its files were written by a bcd that kept no record of them: with a record, ConvergerState.written,
    the env file is put back from it, test_hold_content_drift.)"""
    from tests.converger_kit import host_copy, rewrite_host

    node = Node(tmp_path / "node", host_copy(tmp_path / "host"))
    s = spec(1, hold("a1", G[0]), hold("a2", G[1]))
    await node.converge(s)
    node.state.reported.clear()
    node.state.written.pop("a2")
    (node.run_dir / "allocations" / "a2.env").unlink()
    rewrite_host(node.host_file, lambda d: d["gpus"].pop(1))
    node.rescan()
    p = _pass(node, s, node.observe(s))
    index = AtomIndex(p.observed.inventory)
    claims, _ = claims_after_releases(p, index)
    plan_kept_holds(p, index, claims, HostLedger(None, 0), mps_gpus(p.observed))
    assert _kinds(p) == [("ReportBound", "a1")]
    assert p.notes == [f"a2: what bcd wrote cannot be recorded: {G[1]} is not on this node", f"a2: env file missing and cannot be rebuilt: {G[1]} is not on this node"]


@pytest.mark.parametrize(
    ("assignment", "steps", "still_pending"),
    [
        pytest.param(hold("k1", G[2], binding="BINDING_KUBERNETES"), [("DropPendingRelease", "k1"), ("BindHold", "k1")], False, id="same-devices-taken-back"),
        pytest.param(hold("k1", G[1]), [], True, id="other-devices-release-goes-on"),
    ],
)
async def test_a_release_is_taken_back_only_when_the_hold_binds_again_on_its_devices(tmp_path: Path, assignment, steps, still_pending) -> None:
    """A dropped release whose hold then failed its checks left upstream a Bound with no hold and no Released."""
    node = Node(tmp_path)
    await node.converge(spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")))
    node.reaper.pod_atoms = {G[2]}
    await node.converge(spec(2))  # withdrawn, pending: a pod still has it
    s = spec(3, assignment)
    plan_ = node.plan(s)
    assert [(type(x).__name__, getattr(x, "allocation_id", "")) for x in plan_.steps if type(x).__name__ in ("DropPendingRelease", "BindHold")] == steps
    assert ("k1" in plan_.pending) is still_pending
    if still_pending:
        # another hold under the same id waits for the release (issue 28.1): no refusal
        assert plan_.failures == () and plan_.waiting == ("k1",)
        assert plan_.section is not None and plan_.section.state == "PROGRESSING" and "k1: waits for its pending Kubernetes release" in plan_.section.message
    _, r = await node.converge(s)
    assert not r.errors
    from tests.converger_kit import check_hold_invariants

    check_hold_invariants(node)
