"""An upgrade in place from the last release keeps every hold and loses no event (issue 40).

Issue 40 changed what a node keeps: every identity has a bus account of its own (the
node's JetStream stays in the account it had, NODE), the bus setup makes the streams
(the release's converger and inventory made them), the bridge reads the outbox by direct
get (the stream needs direct gets, which the release's converger did not ask for), the
converger keeps the signed envelope of its spec (the release kept a bare NodeSpec).

The last release's own code runs first, from a worktree of its commit: it binds holds,
then, with its bridge stopped, journals an event that never goes upstream, and is killed.
This code then starts on the same state directory, as `make run` does again. What must
hold: the hold files are the same files, nothing is bound or released twice, the event
the release journaled reaches the control plane once, and the node converges.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from .harness import REPO
from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = pytest.mark.integration

#: the last release before issue 40 (landed, CI passed: `issues stops`, stop 38)
LAST_RELEASE = "8999cbb21498ae5d42dc41dd1a320d82eccc6493"
FREE_CARD = "0000:3a:00.0"


def is_excluded(e) -> bool:  # noqa: ANN001 - an EventRecord
    event = e.event or {}
    return e.type == "gpu" and event.get("pci_address") == FREE_CARD and event.get("management_state") == "Excluded"


def _git(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def release(tmp_path: Path):
    """A worktree of the last release's commit (the clone's own history)."""
    if shutil.which("git") is None or _git("cat-file", "-e", f"{LAST_RELEASE}^{{commit}}").returncode != 0:
        pytest.skip(f"the last release's commit {LAST_RELEASE[:12]} is not in this checkout's history (a clone has it)")
    where = tmp_path / "release"
    added = _git("worktree", "add", "--detach", str(where), LAST_RELEASE)
    assert added.returncode == 0, added.stderr
    try:
        yield where
    finally:
        _git("worktree", "remove", "--force", str(where))


@pytest.mark.timeout(300)
def test_an_upgrade_from_the_last_release_keeps_every_hold_and_every_event(tmp_path: Path, release: Path) -> None:
    # the hardware as the release's own example host describes it (a newer example may carry fields
    # it does not know, like cuda_version); the upgrade keeps the same host file
    host = tmp_path / "host.json"
    host.write_bytes((release / "examples" / "hosts" / "h200x8.json").read_bytes())
    old = Node(tmp_path, repo=release, host=host).start()
    bridge = 0
    try:
        gen = old.apply({"node_id": "node-1", "devices": [assignment("keep-a", GPU[0]), assignment("keep-b", GPU[1], memory_bytes=1 << 30)]})
        old.wait_generation(gen)
        assert old.holds() == {"keep-a", "keep-b"}
        bound = {e.allocation_id for e in applied(old, "bound")}
        assert bound == {"keep-a", "keep-b"}
        # the release's bridge stopped: an event journaled now stays in the outbox
        bridge = old.pids()["gateway_bridge"]
        os.kill(bridge, signal.SIGSTOP)
        excluded = bcd("gpu", "exclude", FREE_CARD, "--state-dir", str(old.state), repo=release)
        assert excluded.returncode == 0, excluded.stdout + excluded.stderr
        wait_for(lambda: (old.status().get("outbox") or {}).get("messages", 0) >= 1, 30, "the release's gpu event journaled")
        files = {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted((old.state / "cdi").glob("bcd-*.json"))}
    finally:
        # killed, as a crash or a power cut would: every service dies with its supervisor
        if old.proc is not None and old.proc.poll() is None:
            old.proc.kill()
            old.proc.wait(30)
        # a stopped process never acts on the signal its dying supervisor sends it: it stayed,
        # stopped, after every run of this test; a power cut takes it too
        if bridge:
            with contextlib.suppress(ProcessLookupError):
                os.kill(bridge, signal.SIGKILL)
    before = old.events()

    assert not [e for e in before if is_excluded(e)], "the release's bridge sent it before it was stopped"

    new = Node(tmp_path, host=host).start()
    try:
        # the event the release journaled goes upstream, once
        def excluded_upstream() -> list:
            return [e for e in new.events() if is_excluded(e) and e.outcome == "applied"]

        wait_for(excluded_upstream, 90, "the release's journaled gpu event upstream")
        st = wait_for(lambda: (lambda s: s if (s.get("converger") or {}).get("section", {}) and s["converger"]["section"]["state"] == "CONVERGED" and (s.get("outbox") or {}).get("messages") == 0 else None)(new.status()), 90, "the node converged again")
        assert {h["allocation_id"] for h in st["converger"]["holds"]} == {"keep-a", "keep-b"}
        # the same files: nothing rebound
        assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted((new.state / "cdi").glob("bcd-*.json"))} == files
        after = new.events()
        for kind in ("bound", "released"):
            ids = [e.event_id for e in after if e.type == kind and e.outcome == "applied"]
            assert len(ids) == len(set(ids)), f"a {kind} twice: {ids}"
        assert {e.allocation_id for e in applied(new, "bound")} == {"keep-a", "keep-b"}
        assert not applied(new, "released")
        assert len(excluded_upstream()) == 1, excluded_upstream()
        doctor = bcd("doctor", "--state-dir", str(new.state))
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    finally:
        new.stop()
