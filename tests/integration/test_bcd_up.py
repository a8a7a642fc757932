"""`bcd up` as a user runs it: a supervisor process, the node bus and every service.

Checks that every service answers `$SRV.PING`, that a crashed service is
restarted, and that SIGTERM leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.runtime import VERSION
from shared.statestamp import STAMP_NAME, STATE_FORMAT

from .harness import EXAMPLE_HOSTS, REPO

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes only once reaped; check its state
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def bcd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bcd.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def ping(state: Path) -> dict[str, dict]:
    out = bcd("ping", "--state-dir", str(state), "--json", "--wait", "1.0")
    if out.returncode != 0:
        return {}
    return {r["name"]: r for r in json.loads(out.stdout)}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def up(tmp_path):
    state = tmp_path / "state"
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "bcd.cli", "up",
            "--state-dir", str(state),
            "--fake-host", str(EXAMPLE_HOSTS / "h200x8.json"),
            "--node-id", "node-up",
            "--any-ports",
        ],
        stdout=log, stderr=log, cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("BCD_")},
    )
    try:
        yield proc, state, tmp_path / "up.log"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_up_runs_every_service_restarts_crashes_and_stops_clean(up):
    proc, state, log = up
    services = wait_for(lambda: (lambda p: p if {"inventory", "signer", "converger"} <= set(p) else None)(ping(state)), 60, "services to answer $SRV.PING")
    assert all(s["metadata"]["node_id"] == "node-up" for s in services.values())

    inv = bcd("inventory", "--state-dir", str(state), "--json")
    assert inv.returncode == 0, inv.stderr
    assert len(json.loads(inv.stdout)["gpus"]) == 8

    node = json.loads((state / "node.json").read_text())
    monitor = node["monitor_url"]
    assert monitor.startswith("http://127.0.0.1:")

    # with --any-ports each service takes a free metrics port: node.json names them (issue 28.8),
    # and every one of them answers with Prometheus text
    metrics = wait_for(lambda: json.loads((state / "node.json").read_text()).get("metrics") or None, 30, "node.json to name the metrics endpoints")
    assert {"inventory", "signer", "converger"} <= set(metrics)
    assert len(set(metrics.values())) == len(metrics), metrics
    for name, url in metrics.items():
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert b"# TYPE" in resp.read(), name
    assert "metrics      converger" in log.read_text()

    # each service's state says which bcd wrote it (an older bcd refuses it: statestamp.py)
    for name in ("signer", "inventory", "converger"):
        stamp = json.loads((state / "data" / name / STAMP_NAME).read_text())
        assert stamp["format"] == STATE_FORMAT and stamp["written_by"] == f"bcd {VERSION}", (name, stamp)

    # kill -9 one service: the supervisor starts it again
    old_pid = int(services["inventory"]["metadata"]["pid"])
    os.kill(old_pid, signal.SIGKILL)
    restarted = wait_for(
        lambda: (lambda p: p.get("inventory") if p.get("inventory") and int(p["inventory"]["metadata"]["pid"]) != old_pid else None)(ping(state)),
        60,
        "inventory to be restarted",
    )
    assert "restarting" in log.read_text()

    pids = {int(s["metadata"]["pid"]) for s in ping(state).values()} | {int(restarted["metadata"]["pid"])}
    bus_pid = int(subprocess.run(["pgrep", "-f", str(state / "bus" / "nats.conf")], capture_output=True, text=True).stdout.split()[0])
    pids.add(bus_pid)
    assert all(alive(p) for p in pids)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    left = [p for p in pids if alive(p)]
    assert not left, f"processes left behind: {left}\n{log.read_text()[-3000:]}"


def test_kill_9_of_the_supervisor_takes_the_children_down(up):
    proc, state, log = up
    services = wait_for(lambda: (lambda p: p if {"inventory", "signer", "converger"} <= set(p) else None)(ping(state)), 60, "services")
    pids = {int(s["metadata"]["pid"]) for s in services.values()}
    proc.kill()
    proc.wait()
    wait_for(lambda: not any(alive(p) for p in pids), 15, "children to die with their supervisor")


def test_an_older_bcd_refuses_a_state_a_newer_one_wrote_in_one_line_and_starts_nothing(tmp_path):
    """As this bcd is to a bcd one state format ahead: `bcd up` says which bcd wrote the state
    and stops with exit 2 before the bus or any service starts (it once ran without a word)."""
    state = tmp_path / "state"
    (state / "data" / "converger").mkdir(parents=True)
    (state / "data" / "converger" / STAMP_NAME).write_text(json.dumps({"format": STATE_FORMAT + 1, "written_by": "bcd 9.9.9"}))
    out = bcd("up", "--state-dir", str(state), "--fake-host", str(EXAMPLE_HOSTS / "h200x8.json"), "--any-ports")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"bcd up: state dir {state.resolve() / 'data' / 'converger'} was written by bcd 9.9.9 (state format {STATE_FORMAT + 1}); "
        f"this bcd {VERSION} reads format {STATE_FORMAT} at most: run bcd 9.9.9 or newer on it (docs/install.md, Downgrades)"
    ], out.stderr
    assert not (state / "bus").exists() and not (state / "node.json").exists()
