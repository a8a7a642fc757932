"""Drift of the hold files: the journal against the disk, and the directory signature (services/converger/drift.py).

Issue 28.3: a hold whose CDI spec was removed from outside vanished from
`bcd status` (card Unclaimed, CONVERGED, healthy, doctor ok) until the next
generation or the 10-minute drift pass. The status now says where the journal
and the disk disagree (a table, with its "nothing to say" row), `bcd status`
counts it unhealthy and doctor warns; the watch's signature changes with every
change a pass did not make.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bcd.status import NodeReport, doctor_checks, problems, render_status
from services.converger.drift import dirs_signature, journal_disagreements
from shared.holddisk import read_disk
from shared.schemas import ConvergerStatus

from tests.converger_kit import GPU, FakeReaper, Node, fast_dir, hold, spec

G = GPU
S = spec(1, hold("a1", G[0]), hold("a2", G[1]))


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


def _rm(*parts: str) -> Callable[[Node], None]:
    def run(node: Node) -> None:
        base = {"cdi": node.cdi_dir, "env": node.run_dir / "allocations", "copy": node.consumer_dir}[parts[0]]
        (base / parts[1]).unlink()

    return run


def _edit_copy(node: Node) -> None:
    p = node.consumer_dir / "bcd-a2.json"
    p.write_text(p.read_text().replace('"env": [', '"env": ["X=1", ', 1))


def _foreign_hold(node: Node) -> None:
    (node.cdi_dir / "bcd-a9.json").write_bytes((node.cdi_dir / "bcd-a1.json").read_bytes().replace(b'"a1"', b'"a9"').replace(b"-a1", b"-a9"))


ROWS = [
    pytest.param(None, [], id="nothing-to-say"),
    pytest.param(_rm("cdi", "bcd-a1.json"), [f"a1: reported bound (generation 1, {G[0]}) but its CDI spec bcd-a1.json is not on disk: put back by the next pass"], id="spec-removed"),
    pytest.param(_rm("env", "a2.env"), ["a2: bound, but its env file is not in place: put back by the next pass"], id="env-removed"),
    pytest.param(_rm("copy", "bcd-a2.json"), ["a2: bound, but its consumer copy is not in place: put back by the next pass"], id="copy-removed"),
    pytest.param(_edit_copy, ["a2: bound, but a consumer copy that is not what its spec makes is not in place: put back by the next pass"], id="copy-edited"),
    pytest.param(_foreign_hold, ["a9: bcd-a9.json is on disk but the journal has no bind of it: the next pass reports it, or releases it if the spec does not want it"], id="spec-the-journal-never-bound"),
]


@pytest.mark.parametrize(("drift", "lines"), ROWS)
async def test_the_journal_against_the_disk(root: Path, drift, lines: list[str]) -> None:  # noqa: ANN001
    node = Node(root)
    _, r = await node.converge(S)
    assert not r.errors
    if drift is not None:
        drift(node)
    disk = read_disk(node.cdi_dir, node.run_dir, warned=set(), consumer_dir=node.consumer_dir)
    assert journal_disagreements(node.state, disk) == lines
    # the pass puts it right, and then there is nothing to say
    _, r = await node.converge(S)
    assert not r.errors
    disk = read_disk(node.cdi_dir, node.run_dir, warned=set(), consumer_dir=node.consumer_dir)
    assert journal_disagreements(node.state, disk) == []


async def test_a_withdrawn_kubernetes_hold_is_no_drift(root: Path) -> None:
    node = Node(root, reaper=FakeReaper(pod_atoms={G[2]}), supported_bindings=frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"}))
    await node.converge(spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")))
    await node.converge(spec(2))  # withdrawn, a pod still holds it: its files are gone by design
    pending, _ = node.releases.load()
    disk = read_disk(node.cdi_dir, node.run_dir, warned=set(), consumer_dir=node.consumer_dir)
    assert journal_disagreements(node.state, disk, pending) == []


def test_status_and_doctor_say_the_disagreement() -> None:
    line = "a1: reported bound (generation 1, GPU-x) but its CDI spec bcd-a1.json is not on disk: put back by the next pass"
    report = NodeReport(node_id="node-1", reachable=True, services={}, converger=ConvergerStatus(drift=[line]))
    assert f"hold files drifted: {line}" in problems(report)
    assert f"  DRIFT {line}" in render_status(report).splitlines()
    assert ("warn", "hold-drift", line) in doctor_checks(report)
    healthy = NodeReport(node_id="node-1", reachable=True, services={}, converger=ConvergerStatus())
    assert not [p for p in problems(healthy) if "drifted" in p]


def test_the_signature_changes_with_every_change_and_only_then(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "bcd-x.json").write_text("{}")
    first = dirs_signature([a, b, None])
    assert dirs_signature([a, b, None]) == first  # nothing changed, a missing dir included
    (a / "bcd-x.json").write_text('{"x": 1}')
    second = dirs_signature([a, b])
    assert second != first
    os.replace(a / "bcd-x.json", a / "bcd-y.json")
    third = dirs_signature([a, b])
    assert third != second
    b.mkdir()
    os.symlink("/dev/zero", b / "bcd-z.json")  # listed by its own lstat, never followed
    assert dirs_signature([a, b]) != third


async def test_odd_regular_files_in_the_hold_dirs_are_named_by_status_and_doctor(root: Path) -> None:
    """Issue 41.4: files that are none of bcd's, named by `bcd cdi list`, are named by status
    (a line, unhealthy) and doctor (a warn row each); a FIFO is never opened."""
    node = Node(root)
    await node.converge(S)
    (node.cdi_dir / "bcd-garbage.json").write_bytes(os.urandom(64))
    (node.cdi_dir / "bcd-noann.json").write_text('{"cdiVersion": "0.6.0", "kind": "bcd.dev/gpu", "devices": []}')
    (node.run_dir / "allocations" / "junk.txt").write_text("x")
    os.mkfifo(node.run_dir / "allocations" / "fifo.txt")
    disk = read_disk(node.cdi_dir, node.run_dir, warned=set(), consumer_dir=node.consumer_dir)
    assert [o.split(":", 1)[0] for o in disk.odd] == [
        str(node.cdi_dir / "bcd-garbage.json"),
        str(node.cdi_dir / "bcd-noann.json"),
        str(node.run_dir / "allocations" / "junk.txt"),
    ]
    report = NodeReport(node_id="node-1", reachable=True, services={}, converger=ConvergerStatus(odd_files=disk.odd))
    assert [p for p in problems(report) if p.startswith("odd file in the hold dirs: ")] == [f"odd file in the hold dirs: {o}" for o in disk.odd]
    assert [line for line in render_status(report).splitlines() if line.startswith("  ODD FILE ")] == [f"  ODD FILE {o}" for o in disk.odd]
    assert [c for c in doctor_checks(report) if c[1] == "hold-files"] == [("warn", "hold-files", f"odd file: {o}") for o in disk.odd]
    clean = NodeReport(node_id="node-1", reachable=True, services={}, converger=ConvergerStatus())
    assert [c[0] for c in doctor_checks(clean) if c[1] == "hold-files"] == ["ok"]
