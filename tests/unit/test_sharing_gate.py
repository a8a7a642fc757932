"""services.inventory.sharing_gate: the inventory starts or stops exactly its sharing units, and nothing else.

What a compromised inventory (or another local user) would send, each refused before systemctl
runs: another unit, a verb of its own, a job mode (`flush` cancels every job queued on the
host), a bad name, a second line, too many bytes, a peer that is not the inventory's user.
What is accepted runs `systemctl --no-ask-password --job-mode=fail` of exactly one unit. The
connection is a real socket pair (SO_PEERCRED is the kernel's), and `main` is run once as
systemd runs it, with the connection on stdin.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from services.inventory import sharing_gate
from tests.unit.test_nvidia_sharing import ALL_TOOLS, BIN, CONTROL, GPU_A, Call, FakeTools, which_in

ME = os.geteuid()
MPS_UNIT = f"bcd-mps@{CONTROL}.service"
SLICE_UNIT = f"bcd-timeslice@{GPU_A}:Long.service"


class Recorder:
    """systemctl that records what it was asked and succeeds (the units are tested elsewhere)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    def run(self, argv: Sequence[str], env: Mapping[str, str], stdin: str, timeout: float) -> tuple[int, str, str]:
        self.calls.append(Call(list(argv), dict(env), stdin, timeout))
        return 0, "", ""


def handle(line: str) -> tuple[str, list[list[str]]]:
    rec = Recorder()
    answer = sharing_gate.handle(line, runner=rec, which=which_in(*ALL_TOOLS))
    return answer, [c.argv for c in rec.calls]


@pytest.mark.parametrize(
    ("line", "verb", "unit"),
    [(f"mps-start {CONTROL}", "start", MPS_UNIT), (f"mps-stop {CONTROL}", "stop", MPS_UNIT), (f"timeslice {GPU_A}:Long", "start", SLICE_UNIT)],
)
def test_each_request_is_one_unit_with_job_mode_fail(line: str, verb: str, unit: str) -> None:
    answer, calls = handle(line)
    assert answer == f"done {verb} {unit}"
    assert calls == [[f"{BIN}/systemctl", "--no-ask-password", "--job-mode=fail", verb, unit]]


@pytest.mark.parametrize(
    "line",
    [
        "start bcd-helper.service",
        "stop bcd-converger.service",
        f"mps-start {CONTROL} --job-mode=flush",
        f"mps-start {CONTROL} flush",
        f"mps-start --job-mode=replace-irreversibly {CONTROL}",
        f"mps-restart {CONTROL}",
        f"isolate {CONTROL}",
        f"timeslice-stop {GPU_A}:Long",
        f"mps-start  {CONTROL}",
        f"mps-start {CONTROL} ",
        f"mps-start\t{CONTROL}",
        "mps-start ../../etc",
        "mps-start x",
        f"mps-start {CONTROL.upper()}",
        f"mps-start {CONTROL}.service",
        f"mps-stop bcd-mps@{CONTROL}.service",
        f"timeslice {GPU_A}:Forever",
        f"timeslice {GPU_A}",
        f"timeslice MIG-{GPU_A[4:]}:Long",
        f"timeslice {GPU_A};reboot:Long",
        "",
        "mps-start",
    ],
)
def test_anything_else_is_refused_and_runs_nothing(line: str) -> None:
    answer, calls = handle(line)
    assert answer.startswith("refused "), answer
    assert calls == []


def test_a_failed_job_names_the_units_journal() -> None:
    tools = FakeTools()
    tools.fail["--no-ask-password"] = (1, "Job for x failed.\nSee system logs\n")
    answer = sharing_gate.handle(f"mps-stop {CONTROL}", runner=tools, which=which_in(*ALL_TOOLS))
    assert answer == f"failed Job for x failed. (journalctl -u {MPS_UNIT})"
    assert sharing_gate.handle(f"mps-stop {CONTROL}", runner=tools, which=which_in()) == "not-supported systemctl is not on PATH"


# --------------------------------------------------------------------------- a connection


def serve(send: bytes, *, client: int = ME, close_write: bool = True) -> tuple[str, str, list[list[str]]]:
    """(what the peer reads, the gate's answer, the systemctl calls) for one connection."""
    gate_end, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    rec = Recorder()
    with gate_end, peer:
        peer.sendall(send)
        if close_write:
            peer.shutdown(socket.SHUT_WR)
        answer = sharing_gate.serve(gate_end, client, runner=rec, which=which_in(*ALL_TOOLS))
        gate_end.shutdown(socket.SHUT_WR)
        got = peer.recv(4096).decode()
    return got, answer, [c.argv for c in rec.calls]


def test_the_inventorys_request_is_done_and_answered(capsys: pytest.CaptureFixture[str]) -> None:
    got, answer, calls = serve(f"mps-start {CONTROL}\n".encode())
    assert got == f"done start {MPS_UNIT}\n" == answer + "\n" and len(calls) == 1
    # a line without its newline, the peer's write side closed: the same
    assert serve(f"mps-stop {CONTROL}".encode())[0] == f"done stop {MPS_UNIT}\n"
    assert f"uid {ME} asked 'mps-start {CONTROL}': done start {MPS_UNIT}" in capsys.readouterr().err


def test_a_peer_that_is_not_the_inventorys_user_is_refused_before_its_line_is_read() -> None:
    """The socket's mode admits group bcd-inventory; of that group only the inventory's uid asks."""
    got, _, calls = serve(f"mps-start {CONTROL}\n".encode(), client=ME + 1)
    assert got == f"refused uid {ME} is not the inventory's ({ME + 1})\n" and calls == []


@pytest.mark.parametrize(
    ("send", "why"),
    [
        (f"mps-start {CONTROL}\nmps-stop {CONTROL}\n".encode(), "one line"),
        (f"mps-start {CONTROL}\n\n".encode(), "one line"),
        (b"mps-start " + b"a" * 200 + b"\n", "at most 128 bytes"),
        (f"mps-start {CONTROL}\r\n".encode(), "is not 'mps-start"),
        (f"mps-start {CONTROL[:-1]}\xe9\n".encode(), "ASCII"),
        (f"mps-start {CONTROL}\0\n".encode(), "is not 'mps-start"),
    ],
)
def test_a_request_that_is_not_one_short_ascii_line_is_refused(send: bytes, why: str) -> None:
    got, _, calls = serve(send)
    assert got.startswith("refused ") and why in got, got
    assert calls == []


def test_a_peer_that_sends_nothing_is_refused_in_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharing_gate, "READ_TIMEOUT_S", 0.2)
    got, _, calls = serve(b"", close_write=False)
    assert got == "refused no request line within 0.2 s\n" and calls == []


def test_main_serves_the_connection_systemd_hands_it_on_stdin(tmp_path: Path) -> None:
    """`python -m services.inventory.sharing_gate` as bcd-sharing@.service runs it (the
    connection as fd 0, StandardInput=socket), with a systemctl on PATH that logs its argv."""
    log = tmp_path / "systemctl.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_dir / "systemctl").chmod(0o755)
    gate_end, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    me = pwd.getpwuid(ME).pw_name
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "BCD_SHARING_CLIENT": me}
    repo = Path(__file__).resolve().parents[2]
    with gate_end, peer:
        peer.sendall(f"timeslice {GPU_A}:Long\n".encode())
        proc = subprocess.run([sys.executable, "-m", "services.inventory.sharing_gate"], stdin=gate_end, capture_output=True, env=env, cwd=repo, timeout=60)
        answer = peer.recv(4096).decode()
    assert (proc.returncode, answer) == (0, f"done start {SLICE_UNIT}\n"), proc.stderr
    assert log.read_text() == f"--no-ask-password --job-mode=fail start {SLICE_UNIT}\n"
    # not started by systemd (stdin is no socket): a usage error, nothing run
    proc = subprocess.run([sys.executable, "-m", "services.inventory.sharing_gate"], stdin=subprocess.DEVNULL, capture_output=True, env=env, cwd=repo, timeout=60)
    assert proc.returncode == 2 and b"run by bcd-sharing.socket" in proc.stderr


def test_main_with_no_such_client_user_refuses_everyone(tmp_path: Path) -> None:
    gate_end, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = {"PATH": os.environ["PATH"], "BCD_SHARING_CLIENT": "bcd-no-such-user"}
    repo = Path(__file__).resolve().parents[2]
    with gate_end, peer:
        peer.sendall(f"mps-stop {CONTROL}\n".encode())
        proc = subprocess.run([sys.executable, "-m", "services.inventory.sharing_gate"], stdin=gate_end, capture_output=True, env=env, cwd=repo, timeout=60)
        answer = peer.recv(4096).decode()
    assert proc.returncode == 1 and answer == f"refused uid {ME} is not the inventory's (-1)\n"
    assert b"no user 'bcd-no-such-user'" in proc.stderr
