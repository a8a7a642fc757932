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
