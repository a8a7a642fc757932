"""A whole node as a user runs it: `bcd up` (supervisor, nats-server, every service,
the reference control plane) on a fake host, driven through the `bcd` command.

Shared by the end-to-end suites; the `node` fixture in conftest.py starts one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from controlplane.ledger import EventRecord
from controlplane.state import ControlPlaneState

from .harness import EXAMPLE_HOSTS, REPO

GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]
SERVICES = ("signer", "inventory", "converger", "gateway_bridge")


def bcd(*args: str, timeout: float = 20, repo: Path = REPO) -> subprocess.CompletedProcess[str]:
    """The `bcd` command of the checkout at `repo` (this one, or an older release's worktree)."""
    try:
        return subprocess.run([sys.executable, "-m", "bcd.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=repo)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, 124, "", f"timed out after {timeout}s")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


class Node:
    def __init__(
        self, tmp: Path, *extra: str, host: Path | None = None, env: dict[str, str] | None = None, repo: Path = REPO
    ) -> None:
        self.tmp = tmp
        #: the checkout whose code runs the node (an older release's worktree for an upgrade)
        self.repo = repo
        self.state = tmp / "state"
        self.log_path = tmp / "up.log"
        self.host = host or (tmp / "host.json")
        if host is None:
            self.host.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
        self.extra = extra
        #: BCD_* settings passed to `bcd up` (and through it to every service)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Node":
        log = open(self.log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bcd.cli", "up", "--state-dir", str(self.state), "--fake-host", str(self.host), "--any-ports", *self.extra],
            stdout=log,
            stderr=log,
            cwd=self.repo,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("BCD_")}, **self.env},
        )
        log.close()
        wait_for(lambda: SERVICES_UP(self), 60, "every service to answer $SRV.PING")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def ping(self) -> dict[str, dict]:
        out = bcd("ping", "--state-dir", str(self.state), "--json", "--wait", "0.7", repo=self.repo)
        return {r["name"]: r for r in json.loads(out.stdout)} if out.returncode == 0 else {}

    def apply(self, spec: dict) -> int:
        path = self.tmp / f"spec-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(spec))
        out = bcd("apply", str(path), "--state-dir", str(self.state), repo=self.repo)
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split("generation")[1].split()[0])

    def status(self) -> dict:
        out = bcd("status", "--state-dir", str(self.state), "--json", repo=self.repo)
        try:
            return json.loads(out.stdout)
        except ValueError:
            return {}

    def section(self) -> dict | None:
        conv = self.status().get("converger") or {}
        return conv.get("section")

    def wait_generation(self, generation: int, timeout: float = 60) -> dict:
        def done():
            st = self.status()
            sec = (st.get("converger") or {}).get("section")
            out = st.get("outbox") or {}
            if sec and sec["observed_generation"] == generation and sec["state"] != "PROGRESSING" and out.get("messages") == 0:
                return st
            return None

        return wait_for(done, timeout, f"generation {generation} converged and the outbox drained")

    @property
    def cp_dir(self) -> Path:
        return self.state / "controlplane"

    def events(self) -> list[EventRecord]:
        path = self.cp_dir / "events.jsonl"
        if not path.exists():
            return []
        dec = msgspec.json.Decoder(EventRecord)
        return [dec.decode(line) for line in path.read_bytes().splitlines() if line.strip()]

    def cp_state(self) -> ControlPlaneState:
        return msgspec.json.decode((self.cp_dir / "state.json").read_bytes(), type=ControlPlaneState)

    def holds(self) -> set[str]:
        return {p.name[4:-5] for p in (self.state / "cdi").glob("bcd-*.json")}

    def pids(self) -> dict[str, int]:
        return {name: int(r["metadata"]["pid"]) for name, r in self.ping().items()}


def SERVICES_UP(node: Node) -> bool:  # noqa: N802
    return set(SERVICES) <= set(node.ping())


def assignment(alloc: str, *devices: str, **limits) -> dict:
    a: dict = {"allocation_id": alloc, "reservation_id": f"rsv-{alloc}", "binding": "BINDING_HOLD", "devices": list(devices)}
    if limits:
        a["limits"] = limits
    return a


def applied(node: Node, kind: str) -> list[EventRecord]:
    return [e for e in node.events() if e.type == kind and e.outcome == "applied"]


__all__ = ["GPU", "SERVICES", "bcd", "wait_for", "Node", "SERVICES_UP", "assignment", "applied"]
