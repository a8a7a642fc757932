"""GPU sharing with NVIDIA's tools (`nvidia_sharing.NvidiaSharing`, the nvidia adapter's GpuSharer).

The inventory asks root for each step through the gate (services/inventory/sharing_gate.py),
which runs `systemctl --job-mode=fail` of exactly one of bcd's units, whose steps are
services.inventory.sharing_unit's. Two ways: a recording CommandRunner that plays
nvidia-cuda-mps-control, nvidia-smi and systemctl with bcd's units (every argv, env and stdin,
in order, and each failure path; its systemctl runs each unit's steps with the unit's own code,
in systemd's order), and the default SubprocessRunner for real against small shell scripts of
the same names put first on PATH, with the gate serving a real unix socket (its systemctl runs
`services.inventory.sharing_unit`, as the unit files do).
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.inventory import sharing_gate, sharing_unit
from services.inventory.adapters.base import GpuSharer, SharingStepError, mps_dirs, mps_spec_file
from services.inventory.adapters.fakehost import load_host_file
from services.inventory.adapters.nvidia import NvidiaAdapter
from services.inventory.adapters.nvidia_sharing import MPS_UNIT, OUTPUT_MAX, NvidiaSharing, SubprocessRunner, ask_gate
from shared.schemas import MpsDaemonSpec
from tests.unit.test_inventory_adapters import H200, FakeNvml, materialize
from tests.unit.test_mpsroot import RecordingMounts

GPU_A = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU_B = "GPU-5f1c2a90-0000-4000-8000-000000000002"
MIG_A = "MIG-7d3e61b0-0007-4002-8000-000000000001"
#: a card of another node
GPU_X = "GPU-5f1c2a90-0000-4000-8000-0000000000ff"
CONTROL = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-a1b2c3"
MIB = 1024 * 1024
BIN = "/opt/nvidia/bin"


def spec(**kw: Any) -> MpsDaemonSpec:
    kw.setdefault("uuids", [GPU_A, GPU_B])
    return MpsDaemonSpec(control=CONTROL, **kw)


# --------------------------------------------------------------------------- a recording runner


@dataclass
class Call:
    argv: list[str]
    env: dict[str, str]
    stdin: str
    timeout: float

    @property
    def tool(self) -> str:
        return Path(self.argv[0]).name


class FakeTools:
    """CommandRunner playing NVIDIA's tools and systemd with bcd's units: MPS daemons by pipe
    directory, the node's devices for `nvidia-smi -L`, failures by command word."""

    def __init__(self, root: Path | None = None) -> None:
        self.calls: list[Call] = []
        #: pipe directory -> the control commands its daemon took
        self.daemons: dict[str, list[str]] = {}
        #: a command word (-d, set_default_..., quit, compute-policy, ...) -> (exit status, stderr)
        self.fail: dict[str, tuple[int, str]] = {}
        #: a daemon started answers only after this many get_server_list probes
        self.slow_probes = 0
        #: a daemon ignores quit
        self.stubborn = False
        self.raise_on: dict[str, BaseException] = {}
        #: what `nvidia-smi -L` lists
        self.node = [GPU_A, GPU_B, MIG_A]
        #: the MPS root the template units name (BCD_MPS_ROOT), and the unit jobs asked
        self.unit_root = root or Path("/run/bcd/mps")
        self.units: list[str] = []
        self.mounts = RecordingMounts()

    def run(self, argv: Sequence[str], env: Mapping[str, str], stdin: str, timeout: float) -> tuple[int, str, str]:
        call = Call(list(argv), dict(env), stdin, timeout)
        self.calls.append(call)
        word = argv[1] if len(argv) > 1 else (stdin.split() or [""])[0]
        if word in self.raise_on:
            raise self.raise_on[word]
        if word in self.fail:
            code, err = self.fail[word]
            return code, "", err
        if call.tool == "systemctl":
            return self._systemctl(argv)
        if call.tool == "nvidia-cuda-mps-control":
            return self._mps(argv, env, stdin)
        if call.tool == "nvidia-smi" and argv[1:] == ["-L"]:
            return 0, "".join(_listed(i, u) for i, u in enumerate(self.node)), ""
        return 0, "", ""

    def step(self, *argv: str) -> int:
        """One step of a unit, as root runs it (the unit's own code, on these same tools)."""
        clock = Clock()
        direct = NvidiaSharing(runner=self, which=which_in(*ALL_TOOLS), units=False, sleep=clock.sleep, clock=clock, euid=lambda: 0)
        control = argv[1] if len(argv) > 1 else ""
        shm = str(self.unit_root / control / "shm")  # what BindPaths= makes the daemon's /dev/shm
        return sharing_unit.main(list(argv), sharing=direct, environ={"BCD_MPS_ROOT": str(self.unit_root)}, mounts=self.mounts, daemon_shm=shm)

    def _systemctl(self, argv: Sequence[str]) -> tuple[int, str, str]:
        """systemd with bcd's template units: a start or stop runs the unit's steps in the order
        systemd runs them (ExecStartPre=, ExecStart=, ExecStopPost= on a failure; ExecStop=,
        ExecStopPost=); is-active is whether the daemon runs."""
        args = [a for a in argv[1:] if not a.startswith("--")]
        verb, unit = args
        template, instance = unit.removesuffix(".service").split("@", 1)
        if verb == "is-active":
            return (0 if template == "bcd-mps" and str(self.unit_root / instance / "pipe") in self.daemons else 3), "", ""
        assert "--job-mode=fail" in argv, argv  # the gate never lets a job replace another
        self.units.append(f"{verb} {unit}")
        if (template, verb) == ("bcd-timeslice", "start"):
            ok = self.step("timeslice", instance) == 0
        elif (template, verb) == ("bcd-mps", "start"):
            ok = self.step("mps-prepare", instance) == 0 and self.step("mps-start", instance) == 0
            if not ok:
                self.step("mps-cleanup", instance)
        elif (template, verb) == ("bcd-mps", "stop"):
            pipe = str(self.unit_root / instance / "pipe")
            if pipe not in self.daemons:
                return 0, "", ""  # a unit that does not run: none of its steps runs
            self.step("mps-stop", instance)
            self.daemons.pop(pipe, None)  # what ExecStop= left, systemd kills (KillMode=control-group)
            ok = self.step("mps-cleanup", instance) == 0
        else:
            return 5, "", f"Unit {unit} not found.\n"
        return (0, "", "") if ok else (1, "", f"Job for {unit} failed because the control process exited with error code.\n")

    def _mps(self, argv: Sequence[str], env: Mapping[str, str], stdin: str) -> tuple[int, str, str]:
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        if argv[1:] == ["-d"]:
            if pipe in self.daemons:
                return 1, "", "An instance of this daemon is already running\n"
            self.daemons[pipe] = []
            return 0, "", ""
        if pipe not in self.daemons:
            return 1, "", "Cannot find MPS control daemon process\n"
        for line in stdin.splitlines():
            if line == "get_server_list" and self.slow_probes:
                self.slow_probes -= 1
                return 1, "", "starting\n"
            if line == "quit" and not self.stubborn:
                del self.daemons[pipe]
                break
            if line not in ("get_server_list", "quit"):
                self.daemons[pipe].append(line)
        return 0, "", ""

    def words(self, tool: str = "") -> list[str]:
        """Each call in short: the tool and its arguments, or the control commands it was given."""
        out = []
        for c in self.calls:
            if tool and c.tool != tool:
                continue
            what = " ".join(c.argv[1:]) if len(c.argv) > 1 else "|".join(c.stdin.splitlines())
            out.append(f"{c.tool}: {what}")
        return out


def _listed(index: int, uuid: str) -> str:
    if uuid.startswith("MIG-"):
        return f"  MIG 3g.71gb     Device  0: (UUID: {uuid})\n"
    return f"GPU {index}: NVIDIA H200 (UUID: {uuid})\n"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def which_in(*names: str) -> Any:
    return lambda name: f"{BIN}/{name}" if name in names else None


ALL_TOOLS = ("nvidia-cuda-mps-control", "nvidia-smi", "systemctl")


def sharing(tools: FakeTools, *, which: Any = None, systemd: bool = True, **kw: Any) -> NvidiaSharing:
    """The inventory's NvidiaSharing; its gate is the real gate's handler on the same tools."""
    clock = Clock()
    kw.setdefault("euid", lambda: 0)
    w = which or which_in(*ALL_TOOLS)
    kw.setdefault("gate", lambda line: sharing_gate.handle(line, runner=tools, which=w))
    return NvidiaSharing(runner=tools, which=w, systemd_booted=lambda: systemd, sleep=clock.sleep, clock=clock, **kw)


def direct(tools: FakeTools, **kw: Any) -> NvidiaSharing:
    """NvidiaSharing as the units run it (its steps in this process), on a clock of its own."""
    clock = Clock()
    return NvidiaSharing(runner=tools, which=which_in(*ALL_TOOLS), units=False, sleep=clock.sleep, clock=clock, euid=lambda: 0, **kw)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "mps"
    r.mkdir()
    (tmp_path / "mps-specs").mkdir()
    return r


@pytest.fixture
def tools(root: Path) -> FakeTools:
    return FakeTools(root)


def handed(root: Path) -> MpsDaemonSpec:
    return msgspec.json.decode(mps_spec_file(root, CONTROL).read_bytes(), type=MpsDaemonSpec)


# --------------------------------------------------------------------------- MPS: the inventory's side


def test_a_start_hands_the_spec_over_and_root_runs_the_daemon_in_its_unit(root: Path, tools: FakeTools) -> None:
    """The inventory writes the spec in its own directory and asks the gate; the gate starts
    bcd-mps@<control>.service with job mode fail; the unit (root) makes the directories and the
    daemon's tmpfs, checks the devices are this node's, starts the daemon, waits for it and
    sets its limits in order."""
    pipe, log = mps_dirs(root, CONTROL)
    s = spec(active_thread_percentage=40, pinned_memory={GPU_B: 3 * 1024 * MIB, GPU_A: MIB + 5})
    sharing(tools).mps_start(s, pipe, log)
    unit = MPS_UNIT.format(control=CONTROL)
    assert tools.words("systemctl") == [f"systemctl: is-active --quiet {unit}", f"systemctl: --no-ask-password --job-mode=fail start {unit}"]
    assert tools.words("nvidia-smi") == ["nvidia-smi: -L"]
    assert tools.words("nvidia-cuda-mps-control") == [
        "nvidia-cuda-mps-control: -d",
        "nvidia-cuda-mps-control: get_server_list",  # it answers
        f"nvidia-cuda-mps-control: set_default_active_thread_percentage 40|set_default_device_pinned_mem_limit {GPU_A} 1M"
        f"|set_default_device_pinned_mem_limit {GPU_B} 3072M",
    ]
    env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}", "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    assert all(c.env == env for c in tools.calls if c.tool == "nvidia-cuda-mps-control")
    # systemctl and nvidia-smi get PATH only
    assert all(c.env == {"PATH": os.environ["PATH"]} for c in tools.calls if c.tool != "nvidia-cuda-mps-control")
    assert all(stat.S_IMODE(os.lstat(d).st_mode) == 0o755 for d in (pipe.parent, pipe, log, pipe.parent / "shm"))
    assert tools.mounts.mounted == [(str(pipe.parent / "shm"), "size=50%,mode=1777")]
    assert handed(root) == s and not (pipe.parent / "spec.json").exists()


def test_a_start_asked_again_is_done_while_its_unit_runs(root: Path, tools: FakeTools) -> None:
    s = sharing(tools)
    s.mps_start(spec(active_thread_percentage=40), *mps_dirs(root, CONTROL))
    tools.calls.clear()
    s.mps_start(spec(active_thread_percentage=40), *mps_dirs(root, CONTROL))
    assert tools.words() == [f"systemctl: is-active --quiet {MPS_UNIT.format(control=CONTROL)}"]
    assert tools.units == [f"start {MPS_UNIT.format(control=CONTROL)}"]


def test_a_start_with_another_spec_is_refused_and_runs_nothing(root: Path, tools: FakeTools) -> None:
    s = sharing(tools)
    s.mps_start(spec(), *mps_dirs(root, CONTROL))
    tools.calls.clear()
    with pytest.raises(SharingStepError) as caught:
        s.mps_start(spec(uuids=[GPU_A]), *mps_dirs(root, CONTROL))
    assert caught.value.outcome == "refused" and "another spec" in str(caught.value)
    assert tools.calls == [] and handed(root) == spec()


def test_a_daemon_bcd_did_not_start_is_refused(root: Path, tools: FakeTools) -> None:
    pipe, log = mps_dirs(root, CONTROL)
    tools.daemons[str(pipe)] = []  # its unit is active, but no spec was handed over
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(), pipe, log)
    assert caught.value.outcome == "refused" and str(mps_spec_file(root, CONTROL)) in str(caught.value)


def test_a_daemon_an_older_bcd_started_is_known_by_the_spec_it_kept(root: Path, tools: FakeTools) -> None:
    """Upgraded with a claim's daemon running: its spec is beside its directories, where the
    older inventory wrote it; the same start asked again is done, another is refused."""
    pipe, log = mps_dirs(root, CONTROL)
    pipe.mkdir(parents=True)
    (pipe.parent / "spec.json").write_bytes(msgspec.json.encode(spec()))
    tools.daemons[str(pipe)] = []
    s = sharing(tools)
    s.mps_start(spec(), pipe, log)
    with pytest.raises(SharingStepError, match="another spec"):
        s.mps_start(spec(uuids=[GPU_B]), pipe, log)
    assert tools.units == []


def test_a_failed_limit_quits_the_daemon_and_its_unit_removes_everything(root: Path, tools: FakeTools) -> None:
    tools.fail["set_default_active_thread_percentage"] = (1, "Invalid percentage\nmore\n")
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(active_thread_percentage=40), pipe, log)
    unit = MPS_UNIT.format(control=CONTROL)
    assert (caught.value.outcome, str(caught.value)) == (
        "failed",
        f"starting MPS daemon {CONTROL} failed: Job for {unit} failed because the control process exited with error code. (journalctl -u {unit})",
    )
    assert tools.words("nvidia-cuda-mps-control")[-3:] == ["nvidia-cuda-mps-control: get_server_list", "nvidia-cuda-mps-control: quit", "nvidia-cuda-mps-control: get_server_list"]
    assert tools.daemons == {} and os.listdir(root) == [] and not mps_spec_file(root, CONTROL).exists()


def test_a_device_that_is_not_this_nodes_is_refused_before_any_daemon_runs(root: Path, tools: FakeTools) -> None:
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(uuids=[GPU_A, GPU_X]), pipe, log)
    assert caught.value.outcome == "failed"
    assert not any(w.endswith(": -d") for w in tools.words()) and os.listdir(root) == []


def test_a_daemon_that_cannot_start_says_why_and_leaves_nothing(root: Path, tools: FakeTools) -> None:
    tools.fail["-d"] = (1, "\nnvidia-cuda-mps-control: cannot open log directory\n")
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(), *mps_dirs(root, CONTROL))
    assert caught.value.outcome == "failed" and f"(journalctl -u {MPS_UNIT.format(control=CONTROL)})" in str(caught.value)
    assert os.listdir(root) == [] and not mps_spec_file(root, CONTROL).exists()


def test_without_systemd_no_mps_daemon_is_started(root: Path, tools: FakeTools) -> None:
    """Nothing would give the daemon a /dev/shm of its own: not-supported, nothing run."""
    with pytest.raises(SharingStepError) as caught:
        sharing(tools, systemd=False).mps_start(spec(), *mps_dirs(root, CONTROL))
    assert caught.value.outcome == "not-supported" and "systemd" in str(caught.value)
    assert tools.calls == [] and os.listdir(root) == [] and not mps_spec_file(root, CONTROL).exists()


def test_a_stop_asks_root_to_stop_the_unit_which_quits_and_removes(root: Path, tools: FakeTools) -> None:
    s = sharing(tools)
    pipe, log = mps_dirs(root, CONTROL)
    s.mps_start(spec(), pipe, log)
    tools.calls.clear()
    s.mps_stop(CONTROL, pipe, log)
    unit = MPS_UNIT.format(control=CONTROL)
    assert tools.words("systemctl") == [f"systemctl: --no-ask-password --job-mode=fail stop {unit}"]
    assert tools.words("nvidia-cuda-mps-control") == ["nvidia-cuda-mps-control: get_server_list", "nvidia-cuda-mps-control: quit", "nvidia-cuda-mps-control: get_server_list"]
    quit_ = next(c for c in tools.calls if c.stdin == "quit\n")
    assert "CUDA_VISIBLE_DEVICES" not in quit_.env and quit_.env["CUDA_MPS_LOG_DIRECTORY"] == str(log)
    assert os.listdir(root) == [] and tools.daemons == {} and not mps_spec_file(root, CONTROL).exists()
    with pytest.raises(SharingStepError) as caught:
        s.mps_stop(CONTROL, pipe, log)
    assert caught.value.outcome == "not-found"


def test_what_a_unit_that_no_longer_runs_left_is_said_not_hidden(root: Path, tools: FakeTools) -> None:
    """Stopping a unit that is not running runs none of its steps (systemd's way): what it left
    is reported, with the journal to read."""
    pipe, log = mps_dirs(root, CONTROL)
    pipe.mkdir(parents=True)
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_stop(CONTROL, pipe, log)
    assert caught.value.outcome == "failed" and f"{pipe.parent} is left" in str(caught.value)


def test_a_spec_handed_over_for_a_start_that_never_ran_goes_at_the_stop(root: Path, tools: FakeTools) -> None:
    path = mps_spec_file(root, CONTROL)
    path.write_bytes(msgspec.json.encode(spec()))
    s = sharing(tools)
    assert s.mps_list(root) == [CONTROL]
    s.mps_stop(CONTROL, *mps_dirs(root, CONTROL))
    assert not path.exists() and s.mps_list(root) == []


def test_the_list_is_the_control_directories_and_handed_specs_and_nothing_else(root: Path, tools: FakeTools, tmp_path: Path) -> None:
    s = sharing(tools)
    s.mps_start(spec(), *mps_dirs(root, CONTROL))
    left = "1b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000"
    handed_only = "4b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000"
    (root / left).mkdir()
    (root / "lost+found").mkdir()
    (root / "2b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000").write_text("")
    (root / "3b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000").symlink_to(tmp_path)
    mps_spec_file(root, handed_only).write_text("{}")
    (mps_spec_file(root, CONTROL).parent / "notes.json").write_text("{}")
    tools.calls.clear()
    assert s.mps_list(root) == sorted([CONTROL, left, handed_only])
    assert s.mps_list(tmp_path / "none") == []
    assert tools.calls == []


def test_directories_that_are_not_the_daemons_are_refused(root: Path, tools: FakeTools) -> None:
    pipe, _ = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(), pipe, root / "other" / "log")
    assert caught.value.outcome == "refused" and tools.calls == []


@pytest.mark.parametrize(
    ("answer", "outcome", "text"),
    [
        (OSError(errno.ECONNREFUSED, "Connection refused"), "failed", "did not answer: Connection refused (docs/install.md, 'DRA sharing')"),
        (OSError(errno.EACCES, "Permission denied"), "failed", "Permission denied; the inventory runs as uid 10007, and only group bcd-inventory may connect"),
        ("refused uid 10007 is not the inventory's (998)", "refused", "failed: uid 10007 is not the inventory's (998)"),
        ("yes", "failed", "root's side of sharing answered 'yes'"),
        ("", "failed", "root's side of sharing answered ''"),
    ],
)
def test_what_the_gate_answers_is_the_steps_outcome(root: Path, tools: FakeTools, answer: Any, outcome: str, text: str) -> None:
    def gate(line: str) -> str:
        if isinstance(answer, BaseException):
            raise answer
        return answer

    with pytest.raises(SharingStepError) as caught:
        sharing(tools, gate=gate, euid=lambda: 10007).mps_start(spec(), *mps_dirs(root, CONTROL))
    assert caught.value.outcome == outcome and text in str(caught.value), str(caught.value)
    assert not mps_spec_file(root, CONTROL).exists()


# --------------------------------------------------------------------------- MPS: the unit's steps (root's)


def test_the_daemon_is_waited_for_until_it_answers(root: Path, tools: FakeTools) -> None:
    tools.slow_probes = 3
    pipe, log = mps_dirs(root, CONTROL)
    direct(tools).run_daemon(spec(), pipe, log)
    assert str(pipe) in tools.daemons and len(tools.words()) == 5


def test_a_daemon_that_never_answers_fails_the_start_within_the_wait(root: Path, tools: FakeTools) -> None:
    tools.slow_probes = 10_000
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError, match=r"did not answer get_server_list within 2 s") as caught:
        direct(tools, ready_wait=2.0, poll_interval=0.5).run_daemon(spec(), pipe, log)
    assert caught.value.outcome == "failed"
    assert sum(1 for w in tools.words() if w.endswith("get_server_list")) == 6  # at 0, .5, 1, 1.5, 2 s, and the cleanup's


def test_a_daemon_that_will_not_quit_fails_its_quit(root: Path, tools: FakeTools) -> None:
    pipe, log = mps_dirs(root, CONTROL)
    tools.daemons[str(pipe)] = []
    tools.stubborn = True
    with pytest.raises(SharingStepError, match="still answers 1 s after quit") as caught:
        direct(tools, quit_wait=1.0).quit_daemon(CONTROL, pipe, log)
    assert caught.value.outcome == "failed"


@pytest.mark.parametrize(("error", "text"), [(TimeoutError("late"), "no answer within 30 s"), (PermissionError(13, "Permission denied"), "could not run (Permission denied)")])
def test_a_command_that_hangs_or_cannot_run_fails_the_step(root: Path, tools: FakeTools, error: BaseException, text: str) -> None:
    tools.daemons[str(mps_dirs(root, CONTROL)[0])] = []
    tools.raise_on["get_server_list"] = error
    with pytest.raises(SharingStepError, match=r"get_server_list failed: .*" + text.replace("(", r"\(").replace(")", r"\)")) as caught:
        direct(tools).quit_daemon(CONTROL, *mps_dirs(root, CONTROL))
    assert caught.value.outcome == "failed"


def test_the_node_lists_its_gpus_and_mig_devices(tools: FakeTools) -> None:
    assert direct(tools).node_uuids() == {GPU_A, GPU_B, MIG_A}
    tools.fail["-L"] = (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\n")
    with pytest.raises(SharingStepError, match="nvidia-smi -L failed: NVIDIA-SMI has failed"):
        direct(tools).node_uuids()


# --------------------------------------------------------------------------- time slices


def test_where_systemd_runs_the_host_a_time_slice_is_a_one_shot_unit_root_starts(tools: FakeTools) -> None:
    sharing(tools).set_timeslice("0000:18:00.0", GPU_A, "Short")
    unit = f"bcd-timeslice@{GPU_A}:Short.service"
    assert tools.words() == [
        f"systemctl: --no-ask-password --job-mode=fail start {unit}",
        "nvidia-smi: -L",  # the unit's check: a card of this node
        f"nvidia-smi: -i {GPU_A} -c DEFAULT",
        f"nvidia-smi: compute-policy -i {GPU_A} --set-timeslice 1",
    ]


@pytest.mark.parametrize("uuid", [GPU_X, MIG_A.replace("MIG-", "GPU-")])
def test_a_time_slice_on_a_card_that_is_not_this_nodes_is_refused_by_the_unit(tools: FakeTools, uuid: str) -> None:
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).set_timeslice("0000:18:00.0", uuid, "Long")
    assert caught.value.outcome == "failed" and "(journalctl -u bcd-timeslice@" in str(caught.value)
    assert tools.words("nvidia-smi") == ["nvidia-smi: -L"]


@pytest.mark.parametrize(("interval", "code"), [("Default", "0"), ("Short", "1"), ("Medium", "2"), ("Long", "3")])
def test_a_time_slice_is_the_default_compute_mode_then_the_policy(tools: FakeTools, interval: str, code: str) -> None:
    sharing(tools, systemd=False).set_timeslice("0000:18:00.0", GPU_A, interval)
    assert [c.argv for c in tools.calls] == [
        [f"{BIN}/nvidia-smi", "-i", GPU_A, "-c", "DEFAULT"],
        [f"{BIN}/nvidia-smi", "compute-policy", "-i", GPU_A, "--set-timeslice", code],
    ]
    assert all(c.env == {"PATH": os.environ["PATH"]} and c.stdin == "" for c in tools.calls)


def test_a_failed_compute_mode_sets_no_policy(tools: FakeTools) -> None:
    tools.fail["-i"] = (6, "Unable to set the compute mode for GPU 00000000:18:00.0: Insufficient Permissions\n")
    with pytest.raises(SharingStepError) as caught:
        sharing(tools, systemd=False).set_timeslice("0000:18:00.0", GPU_A, "Long")
    assert str(caught.value) == (
        "nvidia-smi -c DEFAULT on 0000:18:00.0 failed: Unable to set the compute mode for GPU 00000000:18:00.0: Insufficient Permissions"
    )
    assert len(tools.calls) == 1


@pytest.mark.parametrize("euid", [0, 10007])
def test_a_time_slice_refused_for_want_of_root_says_so_where_the_inventory_is_not_root(tools: FakeTools, euid: int) -> None:
    tools.fail["compute-policy"] = (4, "Insufficient Permissions\n")
    with pytest.raises(SharingStepError) as caught:
        sharing(tools, systemd=False, euid=lambda: euid).set_timeslice("0000:18:00.0", GPU_A, "Long")
    text = "nvidia-smi compute-policy --set-timeslice 3 on 0000:18:00.0 failed: Insufficient Permissions"
    hint = f" (the inventory runs as uid {euid}: nvidia-smi sets a compute mode and policy for root only; docs/install.md, 'DRA sharing')"
    assert caught.value.outcome == "failed" and str(caught.value) == (text + hint if euid else text)
    # a tool that is not there is not a matter of rights
    with pytest.raises(SharingStepError) as missing:
        sharing(FakeTools(), systemd=False, which=which_in(), euid=lambda: euid).set_timeslice("0000:18:00.0", GPU_A, "Long")
    assert missing.value.outcome == "not-supported" and "uid" not in str(missing.value)


def test_a_failure_without_stderr_says_the_exit_status(tools: FakeTools) -> None:
    tools.fail["compute-policy"] = (2, "")
    with pytest.raises(SharingStepError, match="--set-timeslice 3 on 0000:18:00.0 failed: exit status 2"):
        sharing(tools, systemd=False).set_timeslice("0000:18:00.0", GPU_A, "Long")


def test_a_missing_binary_is_not_supported(root: Path, tools: FakeTools) -> None:
    s = sharing(tools, which=which_in())
    pipe, log = mps_dirs(root, CONTROL)
    for step in (lambda: s.mps_start(spec(), pipe, log), lambda: sharing(tools, systemd=False, which=which_in()).set_timeslice("0000:18:00.0", GPU_A, "Short")):
        with pytest.raises(SharingStepError) as caught:
            step()
        assert caught.value.outcome == "not-supported" and "is not on PATH" in str(caught.value)
    # the unit's own: nvidia-cuda-mps-control missing is not-supported there (its journal says so)
    clock = Clock()
    unit_side = NvidiaSharing(runner=tools, which=which_in("systemctl", "nvidia-smi"), units=False, sleep=clock.sleep, clock=clock)
    with pytest.raises(SharingStepError) as caught:
        unit_side.run_daemon(spec(), pipe, log)
    assert caught.value.outcome == "not-supported" and tools.calls == []


def test_the_nvidia_adapter_delegates_sharing(root: Path, tools: FakeTools, tmp_path: Path) -> None:
    host = load_host_file(H200)
    roots = materialize(host, tmp_path / "root")
    adapter = NvidiaAdapter(nvml=FakeNvml(host), sysfs_root=roots.sysfs, proc_root=roots.proc, cdi_dir=tmp_path / "cdi", sharing=sharing(tools))
    assert isinstance(adapter, GpuSharer)
    pipe, log = mps_dirs(root, CONTROL)
    adapter.mps_start(spec(), pipe, log)
    assert adapter.mps_list(root) == [CONTROL]
    adapter.set_timeslice("0000:18:00.0", GPU_A, "Medium")
    adapter.mps_stop(CONTROL, pipe, log)
    assert adapter.mps_list(root) == []
    assert isinstance(NvidiaAdapter(nvml=FakeNvml(host), sysfs_root=roots.sysfs, proc_root=roots.proc).sharing, NvidiaSharing)


# --------------------------------------------------------------------------- the real runner, fake tools on PATH

MPS_SCRIPT = r"""#!/bin/sh
LOG='@LOG@'
FAIL='@FAIL@'
state="$CUDA_MPS_PIPE_DIRECTORY/fake-daemon"
printf 'run %s [%s] CVD=%s PIPE=%s LOGDIR=%s\n' "${0##*/}" "$*" "${CUDA_VISIBLE_DEVICES-unset}" "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" >> "$LOG"
if [ "$1" = "-d" ]; then
  if [ -e "$FAIL/-d" ]; then echo "fake: the daemon could not start" >&2; exit 1; fi
  if [ -e "$state" ]; then echo "An instance of this daemon is already running" >&2; exit 1; fi
  printf 'serves %s\n' "$CUDA_VISIBLE_DEVICES" > "$state"
  exit 0
fi
while IFS= read -r line; do
  printf 'stdin %s\n' "$line" >> "$LOG"
  if [ ! -e "$state" ]; then echo "Cannot find MPS control daemon process" >&2; exit 1; fi
  cmd=${line%% *}
  if [ -e "$FAIL/$cmd" ]; then echo "fake: $cmd refused" >&2; exit 1; fi
  case "$cmd" in
    quit) rm -f "$state" ;;
    get_server_list) ;;
    *) printf '%s\n' "$line" >> "$state" ;;
  esac
done
exit 0
"""

SMI_SCRIPT = r"""#!/bin/sh
LOG='@LOG@'
FAIL='@FAIL@'
printf 'run %s [%s]\n' "${0##*/}" "$*" >> "$LOG"
if [ -e "$FAIL/nvidia-smi-$1" ]; then echo "fake: nvidia-smi $1 refused" >&2; exit 3; fi
if [ "$1" = "-L" ]; then
  echo "GPU 0: NVIDIA H200 (UUID: @GPU_A@)"
  echo "GPU 1: NVIDIA H200 (UUID: @GPU_B@)"
fi
exit 0
"""

SYSTEMCTL_SCRIPT = r"""#!/bin/sh
# systemd with bcd's two template units: a start or stop runs what the unit file's Exec*= lines
# run, in systemd's order, with the unit's BCD_MPS_ROOT and no environment of the caller's
# (the mount is left out: it needs root; the daemon's /dev/shm is taken to be its shm directory,
# which BindPaths= makes it)
LOG='@LOG@'
printf 'run %s [%s]\n' "${0##*/}" "$*" >> "$LOG"
[ "$1" = "--no-ask-password" ] && shift
case "$1" in --job-mode=fail) shift ;; --job-mode=*) echo "a job mode bcd never asks for: $1" >&2; exit 9 ;; esac
verb=$1; unit=$2
[ "$verb" = is-active ] && unit=$3
inst=${unit#*@}; inst=${inst%.service}
step() {
  cd '@REPO@' && env -i PATH="$PATH" BCD_MPS_ROOT='@ROOT@' '@PYTHON@' -c '
import sys
from services.inventory import sharing_unit
from tests.unit.test_mpsroot import RecordingMounts
sys.exit(sharing_unit.main(sys.argv[1:], mounts=RecordingMounts(), daemon_shm="@ROOT@/" + sys.argv[2] + "/shm" if len(sys.argv) > 2 else "/dev/shm"))
' "$@" 2>> "$LOG"
}
case "$verb:${unit%%@*}" in
  is-active:bcd-mps) test -e '@ROOT@'/"$inst"/pipe/fake-daemon; exit $? ;;
  start:bcd-mps) if step mps-prepare "$inst" && step mps-start "$inst"; then exit 0; fi; step mps-cleanup "$inst"; exit 1 ;;
  stop:bcd-mps) test -e '@ROOT@'/"$inst"/pipe/fake-daemon || exit 0; step mps-stop "$inst"; step mps-cleanup "$inst"; exit 0 ;;
  start:bcd-timeslice) step timeslice "$inst"; exit $? ;;
  *) echo "Unit $unit not found." >&2; exit 5 ;;
esac
"""


@dataclass
class FakeBin:
    bin: Path
    log: Path
    fail: Path

    def lines(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []

    def fail_on(self, word: str) -> None:
        (self.fail / word).write_text("")


@pytest.fixture
def fake_bin(tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> FakeBin:
    fb = FakeBin(tmp_path / "bin", tmp_path / "tools.log", tmp_path / "fail")
    fb.bin.mkdir()
    fb.fail.mkdir()
    repo = Path(__file__).resolve().parents[2]
    subst = {"@LOG@": fb.log, "@FAIL@": fb.fail, "@ROOT@": root, "@REPO@": repo, "@PYTHON@": sys.executable, "@GPU_A@": GPU_A, "@GPU_B@": GPU_B}
    for name, script in (("nvidia-cuda-mps-control", MPS_SCRIPT), ("nvidia-smi", SMI_SCRIPT), ("systemctl", SYSTEMCTL_SCRIPT)):
        path = fb.bin / name
        for key, value in subst.items():
            script = script.replace(key, str(value))
        path.write_text(script)
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fb.bin}{os.pathsep}{os.environ['PATH']}")
    return fb


@pytest.fixture
def gate_socket(tmp_path: Path) -> Iterator[Path]:
    """The gate on a real unix socket, one connection at a time, as systemd's Accept=yes gives
    each its own instance (here a thread), the peer checked by SO_PEERCRED against this uid."""
    path = tmp_path / "sharing.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(4)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                sharing_gate.serve(conn, os.geteuid(), runner=SubprocessRunner())

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield path
    finally:
        stop.set()
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        t.join(5)


def real(gate_path: Path | None = None, *, systemd: bool = True) -> NvidiaSharing:
    gate = (lambda line: ask_gate(line, gate_path, 30.0)) if gate_path else None
    return NvidiaSharing(systemd_booted=lambda: systemd, poll_interval=0.02, ready_wait=5.0, quit_wait=5.0, command_timeout=10.0, gate=gate)


def test_the_real_runner_goes_through_the_gate_and_the_units_the_unit_files_name(fake_bin: FakeBin, gate_socket: Path, root: Path) -> None:
    """The inventory's request over a real unix socket; the gate runs systemctl (a stand-in that
    runs what bcd-mps@.service and bcd-timeslice@.service run: services.inventory.sharing_unit)
    with job mode fail; the unit starts the daemon from the spec handed over, with the
    environment the unit's step gives it, and quits it at the stop."""
    pipe, log = mps_dirs(root, CONTROL)
    s = real(gate_socket)
    s.mps_start(spec(active_thread_percentage=30), pipe, log)
    unit = MPS_UNIT.format(control=CONTROL)
    daemon = f"CVD={GPU_A},{GPU_B} PIPE={pipe} LOGDIR={log}"
    assert fake_bin.lines() == [
        f"run systemctl [is-active --quiet {unit}]",
        f"run systemctl [--no-ask-password --job-mode=fail start {unit}]",
        "run nvidia-smi [-L]",
        f"run nvidia-cuda-mps-control [-d] {daemon}",
        f"run nvidia-cuda-mps-control [] {daemon}",
        "stdin get_server_list",
        f"run nvidia-cuda-mps-control [] {daemon}",
        "stdin set_default_active_thread_percentage 30",
    ]
    assert (pipe / "fake-daemon").read_text().splitlines() == [f"serves {GPU_A},{GPU_B}", "set_default_active_thread_percentage 30"]
    assert s.mps_list(root) == [CONTROL]
    s.mps_start(spec(active_thread_percentage=30), pipe, log)  # again: the unit is active, done
    assert sum(1 for line in fake_bin.lines() if "[-d]" in line) == 1
    start = len(fake_bin.lines())
    s.mps_stop(CONTROL, pipe, log)
    stop = f"CVD=unset PIPE={pipe} LOGDIR={log}"
    assert fake_bin.lines()[start:] == [
        f"run systemctl [--no-ask-password --job-mode=fail stop {unit}]",
        f"run nvidia-cuda-mps-control [] {stop}", "stdin get_server_list",
        f"run nvidia-cuda-mps-control [] {stop}", "stdin quit",
        f"run nvidia-cuda-mps-control [] {stop}", "stdin get_server_list",
    ]
    assert os.listdir(root) == [] and s.mps_list(root) == []
    s.set_timeslice("0000:18:00.0", GPU_A, "Long")
    assert fake_bin.lines()[-3:] == ["run nvidia-smi [-L]", f"run nvidia-smi [-i {GPU_A} -c DEFAULT]", f"run nvidia-smi [compute-policy -i {GPU_A} --set-timeslice 3]"]
    # a step the unit cannot take fails the start with the unit's name, and what it said is in its journal
    fake_bin.fail_on("-d")
    with pytest.raises(SharingStepError, match=rf"starting MPS daemon {CONTROL} failed: .*\(journalctl -u {unit}\)"):
        s.mps_start(spec(), pipe, log)
    assert "bcd sharing unit: failed: starting MPS daemon" in fake_bin.log.read_text()
    assert os.listdir(root) == [] and not mps_spec_file(root, CONTROL).exists()


def test_the_real_runner_cleans_up_after_a_failed_limit(fake_bin: FakeBin, gate_socket: Path, root: Path) -> None:
    fake_bin.fail_on("set_default_device_pinned_mem_limit")
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        real(gate_socket).mps_start(spec(pinned_memory={GPU_A: 2 * MIB}), pipe, log)
    assert caught.value.outcome == "failed"
    assert "stdin quit" in fake_bin.lines()
    assert "bcd sharing unit: failed: setting the limits of MPS daemon" in fake_bin.log.read_text()
    assert os.listdir(root) == []


def test_the_real_runner_sets_a_time_slice_and_reports_a_failure(fake_bin: FakeBin) -> None:
    real(systemd=False).set_timeslice("0000:18:00.0", GPU_A, "Medium")
    assert fake_bin.lines() == [f"run nvidia-smi [-i {GPU_A} -c DEFAULT]", f"run nvidia-smi [compute-policy -i {GPU_A} --set-timeslice 2]"]
    fake_bin.fail_on("nvidia-smi-compute-policy")
    with pytest.raises(SharingStepError, match="--set-timeslice 3 on 0000:18:00.0 failed: fake: nvidia-smi compute-policy refused"):
        real(systemd=False).set_timeslice("0000:18:00.0", GPU_A, "Long")


def test_the_subprocess_runner_is_bounded_in_time_and_output(tmp_path: Path) -> None:
    runner = SubprocessRunner()
    env = {"PATH": os.environ["PATH"]}
    code, out, err = runner.run(["sh", "-c", "head -c 200000 /dev/zero | tr '\\0' x; echo oops >&2; exit 4"], env, "", 10.0)
    assert (code, len(out), err) == (4, OUTPUT_MAX, "oops\n")
    code, out, _ = runner.run(["sh", "-c", "cat; echo \"$FOO\""], {**env, "FOO": "bar"}, "in\n", 10.0)
    assert (code, out) == (0, "in\nbar\n")
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        runner.run(["sh", "-c", "sleep 30 & sleep 30"], env, "", 0.5)
    assert time.monotonic() - started < 5
    # a command that leaves a child holding its output (as `-d` leaves the daemon) still ends
    marker = tmp_path / "child"
    started = time.monotonic()
    code, _, _ = runner.run(["sh", "-c", f"(sleep 8; touch {marker}) & echo started"], env, "", 10.0)
    assert code == 0 and time.monotonic() - started < 6
