"""The operator's `bcd` against a real node (`bcd up`), a stopped one and none at all.

A node that is down: every read command ends within its --timeout (plus the
interpreter's start) with one line on stderr, no traceback and exit 3. A
running node: `--json` of doctor, releases and events is JSON, `gpu list ADDR`
shows only that card, a closed stdout (`bcd status | head -1`) and Ctrl-C end
quietly. One node serves the module; the last test stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bcd.exits import Exit

from .harness import EXAMPLE_HOSTS, REPO
from .wholenode import Node, bcd, wait_for

pytestmark = pytest.mark.integration

#: every read command, as typed (`gpu list` takes its action)
READ = (("status",), ("doctor",), ("ping",), ("inventory",), ("key",), ("bus",), ("gpu", "list"), ("releases",), ("events", "--no-follow"))
#: the ones that need the node bus (releases and events read the node's files)
BUS = tuple(c for c in READ if c[0] not in ("releases", "events"))
#: --timeout plus a python start on a busy 2-core machine
MARGIN_S = 12.0


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory):
    node = Node(tmp_path_factory.mktemp("cli")).start()
    try:
        yield node
    finally:
        node.stop()


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bcd: "), out.stderr
    return lines[0]


def test_doctor_releases_and_events_print_json(running: Node) -> None:
    s = str(running.state)
    doctor = bcd("doctor", "--state-dir", s, "--json")
    assert doctor.returncode in (0, 1), doctor.stderr
    d = json.loads(doctor.stdout)
    assert d["node_id"] == "node-1" and d["healthy"] == (doctor.returncode == 0)
    assert {c["check"] for c in d["checks"]} >= {"bus", "service.inventory"}
    assert all(set(c) == {"level", "check", "message"} and c["level"] in ("ok", "warn", "fail") for c in d["checks"])

    releases = bcd("releases", "--state-dir", s, "--json")
    assert releases.returncode == 0, releases.stderr
    assert json.loads(releases.stdout) == {"node_id": "node-1", "releases": [], "unreadable_marker": None, "error": None}

    # the bridge's Hello and inventory reach the control plane's log soon after start
    wait_for(lambda: (running.cp_dir / "events.jsonl").exists() and running.events(), 60, "a first event in the control plane's log")
    events = bcd("events", "--state-dir", s, "--json", "--no-follow", "--all")
    assert events.returncode == 0, events.stderr
    records = [json.loads(line) for line in events.stdout.splitlines()]
    assert records and all(r["node_id"] == "node-1" and "outcome" in r and "received_at" in r for r in records)
    last = bcd("events", "--state-dir", s, "--json", "--no-follow", "--last", "1")
    assert len(last.stdout.splitlines()) == 1 and json.loads(last.stdout)["received_at"]


def test_gpu_list_with_an_address_shows_only_that_card(running: Node) -> None:
    s = str(running.state)
    every = json.loads(bcd("gpu", "list", "--state-dir", s, "--json").stdout)
    assert len(every) == 8
    pci = every[2]["pci_address"]
    one = bcd("gpu", "list", pci, "--state-dir", s, "--json")
    assert one.returncode == 0, one.stderr
    assert [g["pci_address"] for g in json.loads(one.stdout)] == [pci]
    short = bcd("gpu", "list", pci.removeprefix("0000:").upper(), "--state-dir", s)  # 3A:00.0 is 0000:3a:00.0
    assert short.returncode == 0, short.stderr
    rows = short.stdout.splitlines()[1:]
    assert rows and rows[0].startswith(pci) and not any(g["pci_address"] in short.stdout for g in every if g["pci_address"] != pci)

    unknown = bcd("gpu", "list", "0000:ff:1f.7", "--state-dir", s)
    assert unknown.returncode == Exit.USAGE and unknown.stdout == ""
    assert "no card 0000:ff:1f.7" in _one_line(unknown)


def test_a_closed_stdout_ends_quietly(running: Node) -> None:
    """`bcd status | head -1`: no BrokenPipeError traceback; the reader gone first is exit 141."""
    cmd = [sys.executable, "-m", "bcd.cli", "status", "--state-dir", str(running.state)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=_env()) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        try:
            err = proc.stderr.read().decode()
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == Exit.BROKEN_PIPE and err == "", (rc, err)

    # as a shell runs it: head reads one line and goes
    for line in ("status", "gpu list", "bus"):
        shell = f"'{sys.executable}' -m bcd.cli {line} --state-dir '{running.state}' | head -1"
        out = subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=60, cwd=REPO, env=_env())
        assert len(out.stdout.splitlines()) == 1, out
        assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_ctrl_c_ends_events_quietly_with_130(running: Node) -> None:
    cmd = [sys.executable, "-m", "bcd.cli", "events", "--state-dir", str(running.state), "--last", "1"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=_env()) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            os.set_blocking(proc.stdout.fileno(), False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not proc.stdout.read(1):  # following: it printed the last event
                time.sleep(0.1)
            assert proc.poll() is None, "events stopped instead of following"
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(30)
            err = proc.stderr.read().decode()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == Exit.INTERRUPTED, (rc, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_no_node_at_the_state_dir(tmp_path: Path) -> None:
    for command in READ:
        t0 = time.monotonic()
        out = bcd(*command, "--state-dir", str(tmp_path), "--timeout", "2", timeout=60)
        assert time.monotonic() - t0 < 2 + MARGIN_S, command
        assert out.returncode == Exit.UNREACHABLE, (command, out)
        assert out.stdout == ""
        assert f"no node at {tmp_path}" in _one_line(out), command


def _readme_exit_codes() -> dict[int, str]:
    """README's exit-code table ("The `bcd` command"): code -> meaning, as the operator reads it."""
    text = (REPO / "README.md").read_text()
    table = text[text.index("| code | meaning |") :].split("\n\n", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    return {int(code.strip()): meaning.strip() for code, meaning in rows}


def _interrupted(cmd: list[str]) -> int:
    """Ctrl-C (SIGINT) a following command once it printed something; its exit code."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, env=_env()) as proc:
        assert proc.stdout is not None
        try:
            os.set_blocking(proc.stdout.fileno(), False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not proc.stdout.read(1):
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            return proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _stdout_closed(cmd: list[str]) -> int:
    """The reader gone before the command writes (`| head -1`); its exit code."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, env=_env()) as proc:
        assert proc.stdout is not None
        proc.stdout.close()
        return proc.wait(60)


def test_every_code_of_readmes_exit_code_table_comes_from_a_real_command(running: Node, tmp_path: Path) -> None:
    """Issue 41.9: README said 2 for an address the inventory does not list, `bcd gpu` gave 1. Each
    row of README's table is driven here by real commands against a real node; a row without a
    command, or a command that ends otherwise, fails, so README and the code cannot drift apart."""
    s = ("--state-dir", str(running.state))
    cli = [sys.executable, "-m", "bcd.cli"]
    inventory_pid = running.pids()["inventory"]

    def no_service() -> list[int]:
        os.kill(inventory_pid, signal.SIGSTOP)  # the bus answers, the inventory does not
        try:
            return [bcd("inventory", *s, timeout=60).returncode]
        finally:
            os.kill(inventory_pid, signal.SIGCONT)

    drive = {
        0: lambda: [bcd("ping", *s, timeout=60).returncode, bcd("gpu", "list", "0000:18:00.0", *s, timeout=60).returncode],
        # the demo's plan refuses three of its holds; nothing is put
        1: lambda: [bcd("apply", str(REPO / "examples/specs/demo.json"), "--dry-run", *s, timeout=60).returncode],
        2: lambda: [
            bcd("gpu", *argv, *s, timeout=60).returncode
            for argv in (("exclude", "0000:99:00.0"), ("include", "zz:zz"), ("reclaim", "0000:99:00.0"), ("recheck", "zz:zz"),
                         ("reset", "0000:99:00.0"), ("diag", "0000:99:00.0", "--level", "1"), ("mig-layout", "zz:zz", "all-disabled"),
                         ("diag", "0000:18:00.0", "--level", "0"))
        ] + [bcd("status", "--no-such-flag", *s, timeout=60).returncode],  # fmt: skip
        3: lambda: [bcd("status", "--state-dir", str(tmp_path), timeout=60).returncode],
        4: no_service,
        130: lambda: [_interrupted([*cli, "events", *s, "--last", "1"])],
        141: lambda: [_stdout_closed([*cli, "status", *s])],
    }
    table = _readme_exit_codes()
    assert set(table) == set(drive), f"README's exit codes {sorted(table)} and the commands that drive them {sorted(drive)} differ"
    running.apply({"node_id": "node-1", "devices": [{"allocation_id": "a1", "reservation_id": "rsv-a1", "binding": "BINDING_HOLD", "devices": []}]})
    for code, driver in drive.items():
        got = driver()
        assert got == [code] * len(got), f"README: {code} = {table[code]!r}; the commands gave {got}"


def test_zz_a_stopped_node(running: Node) -> None:
    """Runs last: stops the module's node, then every read command ends at once, in one line."""
    running.stop()
    assert running.proc is not None and running.proc.poll() is not None
    s = str(running.state)
    for command in BUS:
        t0 = time.monotonic()
        out = bcd(*command, "--state-dir", s, "--timeout", "2", timeout=60)
        took = time.monotonic() - t0
        assert out.returncode == Exit.UNREACHABLE, (command, out)
        assert took < 2 + MARGIN_S, (command, took)
        line = _one_line(out)
        assert "not reachable (connection refused)" in line and f"is `bcd up` running? (--state-dir {s})" in line, line
        for flag in ("--json",):  # --json changes the output, never the failure
            out = bcd(*command, "--state-dir", s, "--timeout", "2", flag, timeout=60)
            assert out.returncode == Exit.UNREACHABLE, (command, out)
            if command[0] == "status":
                # status --json prints its documented shape with the node down (issue 28.8), the rest nothing
                doc = json.loads(out.stdout)
                assert doc["reachable"] is False and "not reachable (connection refused)" in doc["error"], out.stdout
            else:
                assert out.stdout == "", (command, out)
            _one_line(out)
    # what reads the node's files still works with the node stopped
    for command in (("releases",), ("events", "--no-follow", "--last", "2")):
        out = bcd(*command, "--state-dir", s, timeout=60)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (command, out)


def _bus_only(node_bus, state: Path, **extra: str) -> Path:
    """A node.json for a node bus with no service running (the harness's bare nats-server)."""
    state.mkdir()
    doc = {"node_id": node_bus.node_id, "nats_url": node_bus.url, "creds_dir": str(node_bus.creds["cli"].parent), "services": ["inventory", "signer"], **extra}
    (state / "node.json").write_text(json.dumps(doc))
    return state


def test_a_service_that_is_down_is_exit_4_naming_it(node_bus, tmp_path: Path) -> None:
    s = str(_bus_only(node_bus, tmp_path / "state"))
    for command, service in ((("inventory",), "inventory"), (("key",), "signer"), (("gpu", "list"), "inventory"), (("gpu", "exclude", "0000:18:00.0"), "inventory")):
        out = bcd(*command, "--state-dir", s, timeout=60)
        assert out.returncode == Exit.NO_SERVICE, (command, out)
        assert f"service {service} is not running" in _one_line(out), command
    # status and doctor report the missing services (unhealthy, exit 1) rather than fail
    status = bcd("status", "--state-dir", s, "--json", timeout=60)
    assert status.returncode == Exit.FAILED and "Traceback" not in status.stderr, status
    assert "service inventory does not answer $SRV.PING" in json.loads(status.stdout)["problems"]
    doctor = bcd("doctor", "--state-dir", s, timeout=60)
    assert doctor.returncode == Exit.FAILED and "FAIL  service.inventory" in doctor.stdout and "Traceback" not in doctor.stderr, doctor


async def test_ping_fails_naming_a_service_the_node_runs_that_does_not_answer(node_bus, tmp_path: Path) -> None:
    """node.json lists inventory and signer; only the signer runs: ping lists it and exits 1
    naming the inventory (it used to exit 0 with any one answer)."""
    node_bus.start_service("signer", BCD_FAKE_HOST=str(EXAMPLE_HOSTS / "h200x8.json"))
    await node_bus.wait_service("signer")
    s = str(_bus_only(node_bus, tmp_path / "state"))
    for extra in ((), ("--json",)):
        out = await asyncio.to_thread(bcd, "ping", "--state-dir", s, "--wait", "1", *extra, timeout=60)
        assert out.returncode == Exit.FAILED, out
        assert "signer" in out.stdout and "inventory" not in out.stdout, out.stdout
        assert "no answer within 1s from inventory" in out.stderr, out.stderr


def test_a_wrong_password_is_exit_3_in_one_line(node_bus, tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "cli.password").write_text("not-the-password\n")
    s = str(_bus_only(node_bus, tmp_path / "state", creds_dir=str(creds)))
    for command in (("ping",), ("status",)):  # status keeps the error in its report, then ends with it
        out = bcd(*command, "--state-dir", s, "--timeout", "3", timeout=60)
        assert out.returncode == Exit.UNREACHABLE, out
        line = _one_line(out)
        assert "authorization violation" in line and "is `bcd up` running" not in line, line
