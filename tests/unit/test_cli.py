"""The `bcd` command's own infrastructure, without a node: the parser (help on every flag,
--version), the generated completion scripts and man page, the exit codes and the one
wrapper that maps every failure to one line, and the bounded connect to a node bus.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bcd import cli
from bcd.client import NodeNotFound, NodeUnreachable, connect_url, node_info
from bcd.exits import EXIT_CODES, CliError, Exit, ServiceUnavailable, UsageError, exit_codes_text, run_command
from shared.runtime import VERSION, ServiceCallError

REPO = Path(__file__).resolve().parents[2]


def walk(parser: argparse.ArgumentParser, path: str = "bcd"):
    """(command path, parser, action) for every action of every (sub)parser."""
    for action in parser._actions:
        yield path, parser, action
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from walk(subparser, f"{path} {name}")


def subcommands(parser: argparse.ArgumentParser | None = None) -> list[str]:
    parser = parser or cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def bcd(*args: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}
    return subprocess.run([sys.executable, "-m", "bcd.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env, **kw)


# ------------------------------------------------------------------------- the parser


def test_every_flag_and_argument_of_every_command_has_help() -> None:
    missing = []
    for path, _parser, action in walk(cli.build_parser()):
        if isinstance(action, argparse._SubParsersAction):
            # the subparsers action itself, and each command's line in the listing
            if not action.help:
                missing.append(f"{path}: the command list")
            missing.extend(f"{path} {c.dest}: no help in the command list" for c in action._choices_actions if not (c.help or "").strip())
            continue
        name = "/".join(action.option_strings) or action.dest
        if action.help is None or action.help == argparse.SUPPRESS or not str(action.help).strip():
            missing.append(f"{path} {name}")
    assert not missing, "actions without help text:\n" + "\n".join(missing)


def test_the_walk_sees_every_command_and_their_common_flags() -> None:
    """The help test above is only as good as its walk: it reaches every subcommand's flags."""
    seen = {(path, opt) for path, _p, a in walk(cli.build_parser()) for opt in a.option_strings}
    for name in cli.READ_COMMANDS:
        for flag in ("--state-dir", "--json", "--timeout", "--debug"):
            assert (f"bcd {name}", flag) in seen, (name, flag)
    assert ("bcd up", "--upstream-creds") in seen and ("bcd events", "--all") in seen


def test_version_is_the_runtime_version_and_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"bcd {VERSION}"
    assert importlib.metadata.version("bcd") == VERSION, "pyproject.toml's version and shared.runtime.VERSION differ"


def test_debug_is_accepted_before_and_after_the_command() -> None:
    p = cli.build_parser()
    assert p.parse_args(["--debug", "status"]).debug is True
    assert p.parse_args(["status", "--debug"]).debug is True
    assert p.parse_args(["status"]).debug is False


def test_events_defaults_to_the_last_20_and_all_excludes_last() -> None:
    p = cli.build_parser()
    args = p.parse_args(["events"])
    assert (args.last, args.all, args.no_follow) == (20, False, False)
    assert p.parse_args(["events", "--all"]).all is True
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["events", "--all", "--last", "3"])
    assert exc.value.code == Exit.USAGE


@pytest.mark.parametrize("value", ["0", "-1", "abc", "99999"])
def test_timeout_must_be_a_sane_number_of_seconds(value: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["status", "--timeout", value])
    assert exc.value.code == Exit.USAGE


def test_up_refuses_an_unknown_service_as_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["up", "--services", "inventory,nonsense"])
    assert exc.value.code == Exit.USAGE


@pytest.mark.parametrize(("given", "canonical"), [("0000:3b:00.0", "0000:3b:00.0"), ("3B:00.0", "0000:3b:00.0"), (" 0000:3A:00.0 ", "0000:3a:00.0")])
def test_gpu_addresses_are_read_as_the_inventory_spells_them(given: str, canonical: str) -> None:
    assert cli._canonical_pci(given) == canonical


# --------------------------------------------------------------- completion and man page


@pytest.mark.parametrize("shell", ["bash", "zsh", "tcsh"])
def test_completion_script_names_every_subcommand(shell: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.cmd_completion(argparse.Namespace(shell=shell)) == 0
    script = capsys.readouterr().out
    for name in subcommands():
        assert name in script, f"{shell} completion does not mention `bcd {name}`"
    if shell != "tcsh":  # shtab's tcsh script completes commands and choices, not every subcommand's flags
        for flag in ("--state-dir", "--timeout", "--json", "--all"):
            assert flag in script


def test_bash_completion_parses_and_completes_commands_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    cli.cmd_completion(argparse.Namespace(shell="bash"))
    script = capsys.readouterr().out
    probe = (
        "source /dev/stdin\n"
        "COMP_WORDS=(bcd st); COMP_CWORD=1; COMP_LINE='bcd st'; COMP_POINT=${#COMP_LINE}; _shtab_bcd; echo \"cmd: ${COMPREPLY[*]}\"\n"
        "COMP_WORDS=(bcd status --ti); COMP_CWORD=2; COMP_LINE='bcd status --ti'; COMP_POINT=${#COMP_LINE}; _shtab_bcd; echo \"flag: ${COMPREPLY[*]}\"\n"
    )
    out = subprocess.run(["bash", "--norc", "-c", probe], input=script, capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert "cmd: status" in out.stdout, out.stdout
    assert "flag: --timeout" in out.stdout, out.stdout


def test_man_page_builds_and_lists_every_subcommand() -> None:
    page = cli.manpage()
    assert page.startswith(".TH BCD"), page[:80]
    for name in subcommands():
        assert f"'bcd {name}'" in page, f"the man page has no section for `bcd {name}`"
    assert "\\-\\-timeout" in page and "exit codes:" in page
    if shutil.which("groff"):
        out = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z"], input=page, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_man_writes_the_page_to_a_file(tmp_path: Path) -> None:
    target = tmp_path / "man" / "bcd.1"
    assert cli.cmd_man(argparse.Namespace(output=target)) == 0
    assert target.read_text() == cli.manpage()


# ----------------------------------------------------------------------------- exit codes


def test_exit_codes_are_defined_once_and_documented_in_help_and_readme() -> None:
    codes = [int(c) for c, _ in EXIT_CODES]
    assert len(set(codes)) == len(codes) and set(codes) == {int(e) for e in Exit}
    help_text = cli.build_parser().format_help()
    readme = (REPO / "README.md").read_text()
    for code, meaning in EXIT_CODES:
        assert f"  {int(code):<4} {meaning}" in help_text
        assert f"\n| {int(code)} | " in readme, f"README's exit code table has no row for {int(code)}"


def test_readme_documents_the_json_shape_of_every_read_command() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("**JSON output.**") :]
    for name in cli.READ_COMMANDS:
        assert f"\n| `{name}" in table, f"README's JSON table has no row for `bcd {name}`"


def _raiser(exc: BaseException):
    def func(_args: object) -> int:
        raise exc

    return func


@pytest.mark.parametrize(
    ("exc", "code", "text"),
    [
        pytest.param(NodeUnreachable("node bus at nats://127.0.0.1:1 not reachable (connection refused)"), 3, "is `bcd up` running? (--state-dir st)", id="bus-down"),
        pytest.param(NodeNotFound("no node at st (st/node.json missing)"), 3, "no node at st", id="no-node"),
        pytest.param(ServiceUnavailable("service inventory is not running"), 4, "service inventory", id="no-service"),
        pytest.param(UsageError("gpu list: no card 0000:99:00.0"), 2, "no card", id="usage"),
        pytest.param(CliError("it failed"), 1, "it failed", id="failed"),
        pytest.param(ServiceCallError("400", "Expected `str` - at `$.pci`"), 2, "the node refused", id="refused-400"),
        pytest.param(ServiceCallError("409", "busy"), 1, "the node refused", id="refused-409"),
        pytest.param(asyncio.TimeoutError(), 4, "did not answer", id="timeout"),
        pytest.param(RuntimeError("bug"), 1, "internal error: RuntimeError: bug", id="bug"),
    ],
)
def test_every_failure_is_one_line_and_its_code(exc: BaseException, code: int, text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(_raiser(exc), argparse.Namespace(state_dir=Path("st"))) == code
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bcd: ") and text in lines[0], captured.err
    assert "Traceback" not in captured.err


def test_debug_shows_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(_raiser(RuntimeError("bug")), argparse.Namespace(), debug=True) == Exit.FAILED
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.rstrip().endswith("(rerun with --debug for the traceback)")


def test_ctrl_c_is_130_and_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_command(_raiser(KeyboardInterrupt()), argparse.Namespace()) == Exit.INTERRUPTED
    assert capsys.readouterr().err == ""


def test_a_closed_stdout_is_141_and_quiet() -> None:
    """`bcd completion bash | head -0`: the reader is gone before bcd writes; no BrokenPipeError traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}
    with subprocess.Popen([sys.executable, "-m", "bcd.cli", "completion", "bash"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # nobody reads: the first flush gets EPIPE
        try:
            err = proc.stderr.read().decode()
            rc = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert rc == Exit.BROKEN_PIPE, err
    assert err == "", err


def test_exit_codes_text_lists_every_code() -> None:
    text = exit_codes_text()
    assert all(f"  {int(c):<4} " in text for c, _ in EXIT_CODES)


# ------------------------------------------------------------------ no node, a bus that is down


def test_node_info_of_an_empty_dir_or_a_bad_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NodeNotFound, match="no node at"):
        node_info(tmp_path)
    (tmp_path / "node.json").write_text("{not json")
    with pytest.raises(NodeNotFound, match="is not a node description"):
        node_info(tmp_path)


async def test_connect_to_a_refused_port_gives_up_at_once() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(NodeUnreachable, match=rf"^node bus at nats://127.0.0.1:{port} not reachable \(connection refused\)$"):
        await connect_url(f"nats://127.0.0.1:{port}", timeout=5)
    assert time.monotonic() - t0 < 3


async def test_connect_to_a_bus_that_never_answers_gives_up_after_the_timeout() -> None:
    """A listener that accepts and never sends INFO: nats-py alone would wait on it, and retry forever."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(NodeUnreachable, match=r"no answer within 0.5 s"):
            await connect_url(f"nats://127.0.0.1:{port}", timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 3


def test_a_command_against_a_black_hole_bus_ends_within_its_timeout(tmp_path: Path) -> None:
    """The whole command: `bcd status --timeout 1` against a bus that accepts and never answers."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        (tmp_path / "creds").mkdir()
        (tmp_path / "creds" / "cli.password").write_text("x\n")
        (tmp_path / "node.json").write_text(
            json.dumps({"node_id": "n1", "nats_url": f"nats://127.0.0.1:{srv.getsockname()[1]}", "creds_dir": str(tmp_path / "creds")})
        )
        t0 = time.monotonic()
        out = bcd("status", "--state-dir", str(tmp_path), "--timeout", "1", timeout=30)
        took = time.monotonic() - t0
    assert out.returncode == Exit.UNREACHABLE, out
    assert out.stdout == "" and len(out.stderr.splitlines()) == 1 and "no answer within 1 s" in out.stderr, out.stderr
    assert took < 1 + 10, took  # the timeout plus the interpreter's start on a busy machine


# ---------------------------------------------------------------------------------- events


def _event_log(path: Path, n: int) -> None:
    from datetime import datetime, timezone

    import msgspec

    from controlplane.ledger import EventRecord

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    lines = [
        msgspec.json.encode(EventRecord(received_at=now, node_id="node-1", type="bound", outcome="applied", allocation_id=f"a{i}", reservation_id=f"r{i}"))
        for i in range(n)
    ]
    path.write_bytes(b"\n".join([*lines[:2], b"not a record", *lines[2:]]) + b"\n")


@pytest.mark.parametrize(("last", "expect"), [(20, 20), (3, 3), (0, 0), (None, 30)])
async def test_events_print_the_last_n_or_all(tmp_path: Path, capsys: pytest.CaptureFixture[str], last: int | None, expect: int) -> None:
    from bcd.events import follow_events

    _event_log(tmp_path / "events.jsonl", 30)
    await follow_events(tmp_path / "events.jsonl", follow=False, last=last)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == expect
    if expect:
        assert "a29 (r29)" in lines[-1]


async def test_events_json_is_one_record_per_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bcd.events import follow_events

    _event_log(tmp_path / "events.jsonl", 5)
    await follow_events(tmp_path / "events.jsonl", follow=False, last=None, as_json=True)
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["allocation_id"] for r in records] == [f"a{i}" for i in range(5)]
    assert {"received_at", "node_id", "type", "outcome", "event"} <= set(records[0])
    await follow_events(tmp_path / "missing.jsonl", follow=False, as_json=True)
    assert capsys.readouterr().out == ""  # no log yet: an empty JSON Lines stream, not a sentence


# ------------------------------------------------------------------------------ bcd up's banner


def test_the_banner_of_an_upstream_node_suggests_only_what_works_there() -> None:
    from bcd.up import look_lines

    embedded = "\n".join(look_lines("state"))
    assert "bcd apply SPEC.json --state-dir state" in embedded and "bcd events --state-dir state" in embedded
    joined = look_lines("st", "nats://cp:4222")
    commands = [line.split("#")[0] for line in joined if "bin/bcd " in line]
    assert commands and not any(" apply " in c or " events " in c for c in commands), joined
    assert any("bcd status --state-dir st" in c for c in commands) and any("bcd doctor" in c for c in commands)
    assert "control plane at nats://cp:4222" in joined[-1]


def test_events_of_a_node_that_joined_an_upstream_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "node.json").write_text(json.dumps({"node_id": "n1", "nats_url": "nats://127.0.0.1:1", "creds_dir": "/nonexistent", "upstream_url": "nats://cp:4222"}))
    out = bcd("events", "--state-dir", str(tmp_path), "--no-follow")
    assert out.returncode == Exit.USAGE and out.stdout == ""
    assert out.stderr.splitlines() == ["bcd: events: node n1 joined an existing upstream (nats://cp:4222); its control plane keeps the event log"]


def test_status_json_with_the_node_down_prints_the_documented_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 28.8: `bcd status --json` printed nothing on stdout with the node down."""
    from bcd.cli import main
    from bcd.client import NodeInfo, write_node_info

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    write_node_info(tmp_path, NodeInfo(node_id="node-1", nats_url=f"nats://127.0.0.1:{port}", creds_dir=str(tmp_path)))
    (tmp_path / "cli.password").write_text("x")
    with pytest.raises(SystemExit) as done:
        main(["status", "--state-dir", str(tmp_path), "--json"])
    out = capsys.readouterr()
    assert done.value.code == 3
    doc = json.loads(out.out)
    assert doc["reachable"] is False and doc["node_id"] == "node-1" and "not reachable" in doc["error"]
    assert set(doc) >= {"services", "converger", "outbox", "problems"} and doc["problems"] == [doc["error"]]
    assert "is `bcd up` running?" in out.err


@pytest.mark.parametrize(
    ("info", "metadata", "shown"),
    [
        pytest.param(dict(metrics={"converger": "http://127.0.0.1:40001/metrics"}), {"metrics": "0.0.0.0:40001"}, "http://127.0.0.1:40001/metrics", id="node.json-names-it"),
        pytest.param(dict(), {"metrics": "127.0.0.1:9462"}, "127.0.0.1:9462", id="a-node-on-this-host"),
        pytest.param(dict(put_command="deploy/compose/node.sh apply D SPEC"), {"metrics": "0.0.0.0:9462"}, "(in its container: 0.0.0.0:9462)", id="compose-container-port"),
        pytest.param(dict(put_command="x"), {}, "", id="no-metrics"),
    ],
)
def test_ping_shows_the_metrics_endpoint_as_this_host_reaches_it(info: dict, metadata: dict, shown: str) -> None:
    from bcd.client import NodeInfo

    node = NodeInfo(node_id="n", nats_url="nats://127.0.0.1:1", creds_dir="/x", **info)
    assert cli._metrics_seen_from_here(node, "converger", metadata) == shown


# ------------------------------------------------------------------ bcd gpu recheck, gpu list's health (issue 30)

CARD = "0000:18:00.0"
XID_79 = "XidCritical: XID 79 (GPU has fallen off the bus) at 2026-12-03T10:00:00Z"


def _healthy(status: str, reason: str, message: str):
    from datetime import datetime, timezone

    from shared.schemas import Condition

    return Condition(type="Healthy", status=status, reason=reason, message=message, since=datetime(2026, 12, 3, 10, tzinfo=timezone.utc))


def _card(status: str, reason: str, message: str):
    """The fake host's first card, with a Healthy condition."""
    import msgspec

    from tests.converger_kit import host_inventory

    g = host_inventory().gpus[0]
    phase = "Failed" if status == "False" else "Ready"
    return msgspec.structs.replace(g, status=msgspec.structs.replace(g.status, phase=phase, conditions=[*g.status.conditions, _healthy(status, reason, message)]))


class _Bus:
    async def close(self) -> None:
        return None


def _fake_node(monkeypatch: pytest.MonkeyPatch, answers: dict) -> list:
    """`bcd` against a node whose endpoints answer `answers` (subject -> reply, or an exception to raise);
    returns what was asked, (subject, request), in order."""
    from bcd.client import NodeInfo

    monkeypatch.setattr(cli, "node_info", lambda _state: NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir="/nonexistent"))

    async def connect(_info: object) -> _Bus:
        return _Bus()

    asked: list = []

    async def request(_nc: object, subject: str, payload: object, _codec: object, timeout: float = 5) -> object:
        asked.append((subject, payload))
        answer = answers[subject]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(cli, "connect", connect)
    monkeypatch.setattr(cli, "request", request)
    return asked


def _main(*argv: str) -> int:
    with pytest.raises(SystemExit) as done:
        cli.main(list(argv))
    return int(done.value.code)


@pytest.mark.parametrize(
    ("accepted", "message", "card", "code", "said"),
    [
        pytest.param(
            True,
            "cleared XidCritical; Healthy=True Checked: no fatal XID, ECC within limits, the vendor library answers",
            ("True", "Checked", "no fatal XID, ECC within limits, the vendor library answers"),
            0,
            f"recheck {CARD}: accepted: cleared XidCritical; Healthy=True Checked",
            id="cleared",
        ),
        pytest.param(
            True,
            "nothing cleared; Healthy=True Checked: no fatal XID",
            ("True", "Checked", "no fatal XID"),
            0,
            f"recheck {CARD}: accepted: nothing cleared",
            id="healthy-already",
        ),
        pytest.param(
            False,
            "cleared XidCritical; Healthy=False RowRemapPending: RowRemapPending: remapped rows are pending (a reset that worked and a clean check clear a fatal fault; a pending row remap needs the reset)",
            ("False", "RowRemapPending", "RowRemapPending: remapped rows are pending"),
            1,
            f"recheck {CARD}: REFUSED: cleared XidCritical; Healthy=False RowRemapPending",
            id="still-unhealthy",
        ),
        pytest.param(False, "not checked: health checks are off (--health-checks off)", None, 1, f"recheck {CARD}: REFUSED: not checked: health checks are off", id="checks-off"),
    ],
)
def test_gpu_recheck_asks_the_inventory_and_exits_0_only_when_accepted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], accepted: bool, message: str, card: tuple | None, code: int, said: str
) -> None:
    from shared.schemas import Empty, GpuReply, GpuRequest
    from shared.subjects import NodeSubjects

    from tests.converger_kit import host_inventory

    gpu = _card(*card) if card is not None else None
    s = NodeSubjects("node-1")
    inv = host_inventory()
    asked = _fake_node(monkeypatch, {s.inventory_get: inv, s.inventory_gpu: GpuReply(pci=CARD, action="recheck", accepted=accepted, message=message, gpu=gpu)})
    assert _main("gpu", "recheck", CARD, "--state-dir", "st") == code
    # the address checked against the inventory first, then the same endpoint and request as
    # exclude, include and reclaim
    assert asked == [(s.inventory_get, Empty()), (s.inventory_gpu, GpuRequest(action="recheck", pci=CARD))]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(said), lines
    if gpu is not None:
        health = next(c for c in gpu.status.conditions if c.type == "Healthy")
        assert f"  Healthy={health.status} {health.reason}: {health.message}" in lines
    # --json: the GpuReply as it came
    _fake_node(monkeypatch, {s.inventory_get: inv, s.inventory_gpu: GpuReply(pci=CARD, action="recheck", accepted=accepted, message=message, gpu=gpu)})
    assert _main("gpu", "recheck", CARD, "--state-dir", "st", "--json") == code
    doc = json.loads(capsys.readouterr().out)
    assert (doc["action"], doc["accepted"], doc["message"]) == ("recheck", accepted, message)


def test_gpu_recheck_needs_an_address(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    asked = _fake_node(monkeypatch, {})
    assert _main("gpu", "recheck", "--state-dir", "st") == Exit.USAGE
    assert asked == [] and "gpu recheck: a PCI address is needed" in capsys.readouterr().err
    assert cli.build_parser().parse_args(["gpu", "recheck", CARD]).action == "recheck"


GPU_ACTIONS = ("list", "exclude", "include", "reclaim", "recheck", "reset", "diag", "mig-layout")


def _action_argv(action: str, address: str) -> list[str]:
    """`bcd gpu ACTION ADDRESS` with whatever else the action needs."""
    extra = {"diag": ["--level", "1"], "mig-layout": ["all-disabled"]}.get(action, [])
    return ["gpu", action, address, *extra, "--state-dir", "st"]


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("action", GPU_ACTIONS)
@pytest.mark.parametrize(
    ("address", "said"),
    [
        pytest.param("0000:99:00.0", "no card 0000:99:00.0 on node node-1 (its cards: 0000:18:00.0", id="not-listed"),
        pytest.param("zz:zz", "'zz:zz' is not a PCI address (like 0000:3b:00.0)", id="not-an-address"),
        pytest.param("0000:18:00.0;rm", "is not a PCI address", id="trailing-junk"),
    ],
)
def test_every_gpu_subcommand_refuses_a_bad_or_unknown_address_with_exit_2_asking_no_action(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], action: str, address: str, said: str
) -> None:
    """Issue 41.9: README's table says an address the inventory does not list is 2, for every `bcd gpu`
    action (exclude/include/reclaim/recheck went to the inventory and got 1, reset/diag/mig-layout to
    the converger and got 1); nothing but the inventory's listing is asked."""
    from tests.converger_kit import host_inventory
    from shared.subjects import NodeSubjects

    s = NodeSubjects("node-1")
    asked = _fake_node(monkeypatch, {s.inventory_get: host_inventory()})
    assert _main(*_action_argv(action, address)) == Exit.USAGE
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1, err
    assert [subject for subject, _ in asked] in ([], [s.inventory_get]), asked


def test_gpu_diag_offers_only_the_levels_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41.14: `--level 0` was offered (choices 0-4 in help and completion) and then refused."""
    level = next(a for a in _subparser("gpu")._actions if a.dest == "level")
    assert list(level.choices) == [1, 2, 3, 4]
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["gpu", "diag", CARD, "--level", "0"])
    assert exc.value.code == Exit.USAGE
    assert cli.build_parser().parse_args(["gpu", "reset", CARD]).level is None
    assert cli.cmd_completion(argparse.Namespace(shell="bash")) == 0
    script = capsys.readouterr().out
    assert "0 1 2 3 4" not in script


@pytest.mark.parametrize(("argv", "said"), [(["gpu", "diag", CARD], "--level N is needed"), (["gpu", "reset", CARD, "--level", "2"], "--level is for diag")])
def test_gpu_flags_are_checked_before_the_node_is_asked(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    asked = _fake_node(monkeypatch, {})
    assert _main(*argv, "--state-dir", "st") == Exit.USAGE
    assert asked == [] and said in capsys.readouterr().err


def test_gpu_list_shows_each_cards_health_and_why(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import msgspec

    from tests.converger_kit import host_inventory
    from shared.subjects import NodeSubjects

    inv = host_inventory()
    sick = _card("False", "XidCritical", XID_79)
    inv = msgspec.structs.replace(inv, gpus=[sick, *inv.gpus[1:]])
    subjects = NodeSubjects("node-1")
    _fake_node(monkeypatch, {subjects.inventory_get: inv, subjects.converger_status: asyncio.TimeoutError()})
    assert _main("gpu", "list", "--state-dir", "st") == 0
    out = capsys.readouterr().out.splitlines()
    assert "HEALTH" in out[0].split()
    i = next(k for k, line in enumerate(out) if line.startswith(CARD))
    assert "XidCritical" in out[i].split() and "Healthy=False/XidCritical" in out[i]
    assert out[i + 1].strip() == f"Healthy: {XID_79}"
    # (host_inventory's claims never answered: the advice holds whether or not a hold is on the card)
    assert f"move any work on it, then reset it (`bcd gpu reset {CARD}`)" in out[i + 2]
    # --json: the Healthy condition is one of the card's conditions
    _fake_node(monkeypatch, {subjects.inventory_get: inv, subjects.converger_status: asyncio.TimeoutError()})
    assert _main("gpu", "list", CARD, "--state-dir", "st", "--json") == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["phase"] == "Failed"
    assert {"type": "Healthy", "status": "False", "reason": "XidCritical", "message": XID_79}.items() <= next(c for c in row["conditions"] if c["type"] == "Healthy").items()


def test_a_command_prints_no_bare_service_log_line_unless_debug(monkeypatch, capsys) -> None:
    """`bcd apply --dry-run` printed "not a bcd hold; leaving it alone" twice on a node with odd
    files: a shared module's warning, through Python's last-resort handler, without its file."""
    import logging

    from bcd import cli
    from shared import logs

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)

    def command(func, args, *, debug):  # noqa: ANN001, ANN202
        logs.get_logger("shared.holddisk").warning("not a bcd hold; leaving it alone", file="/x")
        return 0

    monkeypatch.setattr(cli, "run_command", command)
    with pytest.raises(SystemExit) as done:
        cli.main(["status"])
    assert done.value.code == 0 and capsys.readouterr().err == ""
    monkeypatch.setattr(root, "handlers", [])
    with pytest.raises(SystemExit):
        cli.main(["status", "--debug"])
    assert "not a bcd hold; leaving it alone" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [["status", "--bogus"], ["gpu", "diag", "3a:00.0", "--level", "0"], ["frob"], ["apply"], ["events", "--last", "x"]],
    ids=["unknown-flag", "bad-choice", "unknown-command", "missing-argument", "bad-number"],
)
def test_a_usage_error_is_one_line_and_exit_2(argv: list[str], capsys) -> None:
    """README: whatever goes wrong ends in one line on stderr; argparse printed its usage block too."""
    from bcd import cli

    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and err.startswith("bcd"), err
    assert "--help`)" in err and "usage:" not in err, err
