"""GPU sharing with NVIDIA's tools (`nvidia_sharing.NvidiaSharing`, the nvidia adapter's GpuSharer).

Two ways: a recording CommandRunner that plays nvidia-cuda-mps-control, nvidia-smi and
systemctl (every argv, env and stdin, in order, and each failure path; its systemctl runs a
template unit's step with the unit's own code, services.inventory.sharing_unit), and the
default SubprocessRunner for real against small shell scripts of the same names put first on
PATH, which log what they were given and keep a fake daemon's state in its pipe directory (its
systemctl runs `python -m services.inventory.sharing_unit`, as the unit files do).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services.inventory.adapters.base import GpuSharer, SharingStepError, mps_dirs
from services.inventory.adapters.fakehost import load_host_file
from services.inventory.adapters.nvidia import NvidiaAdapter
from services.inventory import sharing_unit
from services.inventory.adapters.nvidia_sharing import MPS_UNIT, OUTPUT_MAX, SPEC_FILE, NvidiaSharing, SubprocessRunner
from shared.schemas import MpsDaemonSpec
from tests.unit.test_inventory_adapters import H200, FakeNvml, materialize

GPU_A = "GPU-5f1c2a90-0000-4000-8000-000000000001"
GPU_B = "GPU-5f1c2a90-0000-4000-8000-000000000002"
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
    """CommandRunner playing NVIDIA's tools: MPS daemons by pipe directory, failures by command word."""

    def __init__(self) -> None:
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
        #: the MPS root the template units name (BCD_MPS_ROOT), and the unit jobs asked
        self.unit_root = Path("/run/bcd/mps")
        self.units: list[str] = []

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
        return 0, "", ""

    def _systemctl(self, argv: Sequence[str]) -> tuple[int, str, str]:
        """systemd with bcd's template units: a start or stop runs the unit's step (the unit's
        code, on these same tools, as root would); is-active is whether the daemon runs."""
        args = [a for a in argv[1:] if not a.startswith("--")]
        verb, unit = args
        template, instance = unit.removesuffix(".service").split("@", 1)
        direct = NvidiaSharing(runner=self, which=which_in(*ALL_TOOLS), units=False, sleep=lambda _: None, euid=lambda: 0)
        if verb == "is-active":
            return (0 if template == "bcd-mps" and str(self.unit_root / instance / "pipe") in self.daemons else 3), "", ""
        self.units.append(f"{verb} {unit}")
        step = {("bcd-mps", "start"): "mps-start", ("bcd-mps", "stop"): "mps-stop", ("bcd-timeslice", "start"): "timeslice"}[(template, verb)]
        code = sharing_unit.main([step, instance], sharing=direct, environ={"BCD_MPS_ROOT": str(self.unit_root)})
        return (0, "", "") if code == 0 else (1, "", f"Job for {unit} failed because the control process exited with error code.\n")

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

    def words(self) -> list[str]:
        """Each call in short: the tool and its arguments, or the control commands it was given."""
        out = []
        for c in self.calls:
            what = " ".join(c.argv[1:]) if len(c.argv) > 1 else "|".join(c.stdin.splitlines())
            out.append(f"{c.tool}: {what}")
        return out


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


def sharing(tools: FakeTools, *, which: Any = None, systemd: bool = False, **kw: Any) -> NvidiaSharing:
    clock = Clock()
    kw.setdefault("euid", lambda: 0)
    return NvidiaSharing(
        runner=tools, which=which or which_in(*ALL_TOOLS), systemd_booted=lambda: systemd, sleep=clock.sleep, clock=clock, **kw
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "mps"


def test_a_start_runs_the_daemon_waits_for_it_and_sets_its_limits_in_order(root: Path) -> None:
    tools = FakeTools()
    pipe, log = mps_dirs(root, CONTROL)
    sharing(tools).mps_start(spec(active_thread_percentage=40, pinned_memory={GPU_B: 3 * 1024 * MIB, GPU_A: MIB + 5}), pipe, log)
    assert tools.words() == [
        "nvidia-cuda-mps-control: get_server_list",  # none runs yet
        "nvidia-cuda-mps-control: -d",
        "nvidia-cuda-mps-control: get_server_list",  # it answers
        f"nvidia-cuda-mps-control: set_default_active_thread_percentage 40|set_default_device_pinned_mem_limit {GPU_A} 1M"
        f"|set_default_device_pinned_mem_limit {GPU_B} 3072M",
    ]
    env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": f"{GPU_A},{GPU_B}", "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    assert all(c.env == env for c in tools.calls)
    assert tools.calls[-1].stdin.endswith("\n") and all(c.timeout == 30.0 for c in tools.calls)
    assert all(stat.S_IMODE(os.lstat(d).st_mode) == 0o755 for d in (root, pipe.parent, pipe, log))
    assert MpsDaemonSpec(**json.loads((pipe.parent / SPEC_FILE).read_text())) == spec(
        active_thread_percentage=40, pinned_memory={GPU_B: 3 * 1024 * MIB, GPU_A: MIB + 5}
    )


def test_a_daemon_with_no_limits_gets_no_control_commands(root: Path) -> None:
    tools = FakeTools()
    sharing(tools).mps_start(spec(), *mps_dirs(root, CONTROL))
    assert [w.split(": ")[1] for w in tools.words()] == ["get_server_list", "-d", "get_server_list"]


def test_a_start_asked_again_is_done_and_sets_the_limits_again(root: Path) -> None:
    tools = FakeTools()
    s = sharing(tools)
    s.mps_start(spec(active_thread_percentage=40), *mps_dirs(root, CONTROL))
    tools.calls.clear()
    s.mps_start(spec(active_thread_percentage=40), *mps_dirs(root, CONTROL))
    assert tools.words() == ["nvidia-cuda-mps-control: get_server_list", "nvidia-cuda-mps-control: set_default_active_thread_percentage 40"]


def test_a_start_with_another_spec_is_refused_and_runs_nothing(root: Path) -> None:
    tools = FakeTools()
    s = sharing(tools)
    s.mps_start(spec(), *mps_dirs(root, CONTROL))
    tools.calls.clear()
    with pytest.raises(SharingStepError) as caught:
        s.mps_start(spec(uuids=[GPU_A]), *mps_dirs(root, CONTROL))
    assert caught.value.outcome == "refused" and "another spec" in str(caught.value)
    assert tools.calls == []


def test_a_daemon_bcd_did_not_start_is_refused(root: Path) -> None:
    tools = FakeTools()
    pipe, log = mps_dirs(root, CONTROL)
    tools.daemons[str(pipe)] = []
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(), pipe, log)
    assert caught.value.outcome == "refused" and SPEC_FILE in str(caught.value)


def test_a_failed_limit_quits_the_daemon_and_removes_its_directories(root: Path) -> None:
    tools = FakeTools()
    tools.fail["set_default_active_thread_percentage"] = (1, "Invalid percentage\nmore\n")
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(active_thread_percentage=40), pipe, log)
    assert caught.value.outcome == "failed"
    assert str(caught.value) == f"setting the limits of MPS daemon {CONTROL} failed: Invalid percentage"
    assert tools.words()[-3:] == ["nvidia-cuda-mps-control: get_server_list", "nvidia-cuda-mps-control: quit", "nvidia-cuda-mps-control: get_server_list"]
    assert tools.daemons == {} and not pipe.parent.exists() and root.is_dir()


def test_a_daemon_that_never_answers_fails_the_start_within_the_wait(root: Path) -> None:
    tools = FakeTools()
    tools.slow_probes = 10_000
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError, match=r"did not answer get_server_list within 2 s") as caught:
        sharing(tools, ready_wait=2.0, poll_interval=0.5).mps_start(spec(), pipe, log)
    assert caught.value.outcome == "failed"
    assert sum(1 for w in tools.words() if w.endswith("get_server_list")) == 7  # before -d, then at 0, .5, 1, 1.5, 2 s, and the cleanup's
    assert not pipe.parent.exists()


def test_a_daemon_that_answers_after_a_while_is_waited_for(root: Path) -> None:
    tools = FakeTools()
    tools.slow_probes = 3
    sharing(tools).mps_start(spec(), *mps_dirs(root, CONTROL))
    assert str(mps_dirs(root, CONTROL)[0]) in tools.daemons


def test_a_daemon_that_cannot_start_says_why_and_leaves_nothing(root: Path) -> None:
    tools = FakeTools()
    tools.fail["-d"] = (1, "\nnvidia-cuda-mps-control: cannot open log directory\n")
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(), pipe, log)
    assert (caught.value.outcome, str(caught.value)) == ("failed", f"starting MPS daemon {CONTROL} failed: nvidia-cuda-mps-control: cannot open log directory")
    assert not pipe.parent.exists()


def test_where_systemd_runs_the_host_the_daemon_is_a_unit_of_its_own(root: Path) -> None:
    """The inventory makes the directories and the spec, then asks systemd for
    bcd-mps@<control>.service; the unit (root) starts the daemon, waits for it and sets its
    limits, reading the spec the inventory wrote. Asked again: the unit is active, done."""
    tools = FakeTools()
    tools.unit_root = root
    pipe, log = mps_dirs(root, CONTROL)
    s = sharing(tools, systemd=True)
    s.mps_start(spec(active_thread_percentage=40), pipe, log)
    unit = MPS_UNIT.format(control=CONTROL)
    assert unit == f"bcd-mps@{CONTROL}.service"
    assert [c.argv for c in tools.calls if c.tool == "systemctl"] == [
        [f"{BIN}/systemctl", "is-active", "--quiet", unit],
        [f"{BIN}/systemctl", "--no-ask-password", "start", unit],
    ]
    # systemctl gets the inventory's PATH only; the daemon its CUDA_* from the unit's step
    assert all(c.env == {"PATH": os.environ["PATH"]} for c in tools.calls if c.tool == "systemctl")
    started = [c for c in tools.calls if c.argv[1:] == ["-d"]]
    assert len(started) == 1 and started[0].env["CUDA_VISIBLE_DEVICES"] == f"{GPU_A},{GPU_B}"
    assert tools.daemons[str(pipe)] == ["set_default_active_thread_percentage 40"]
    assert json.loads((pipe.parent / SPEC_FILE).read_text())["control"] == CONTROL
    s.mps_start(spec(active_thread_percentage=40), pipe, log)
    assert tools.units == [f"start {unit}"]
    s.mps_stop(CONTROL, pipe, log)
    assert tools.units == [f"start {unit}", f"stop {unit}"]
    assert str(pipe) not in tools.daemons and not pipe.parent.exists()


def test_a_unit_that_fails_to_start_leaves_no_directories_and_names_its_journal(root: Path) -> None:
    tools = FakeTools()
    tools.unit_root = root
    tools.fail["-d"] = (1, "nvidia-cuda-mps-control: cannot open log directory\n")
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        sharing(tools, systemd=True).mps_start(spec(), pipe, log)
    unit = MPS_UNIT.format(control=CONTROL)
    assert str(caught.value) == (
        f"starting MPS daemon {CONTROL} failed: Job for {unit} failed because the control process exited with error code. (journalctl -u {unit})"
    )
    assert not pipe.parent.exists()


def test_where_systemd_runs_the_host_a_time_slice_is_a_one_shot_unit() -> None:
    tools = FakeTools()
    sharing(tools, systemd=True).set_timeslice("0000:18:00.0", GPU_A, "Short")
    unit = f"bcd-timeslice@{GPU_A}:Short.service"
    assert [c.argv for c in tools.calls][0] == [f"{BIN}/systemctl", "--no-ask-password", "start", unit]
    # the unit ran nvidia-smi, as root would
    assert [c.argv[1:] for c in tools.calls[1:]] == [["-i", GPU_A, "-c", "DEFAULT"], ["compute-policy", "-i", GPU_A, "--set-timeslice", "1"]]


def test_a_stop_quits_the_daemon_waits_and_removes_its_directory(root: Path) -> None:
    tools = FakeTools()
    s = sharing(tools)
    pipe, log = mps_dirs(root, CONTROL)
    s.mps_start(spec(), pipe, log)
    tools.calls.clear()
    s.mps_stop(CONTROL, pipe, log)
    assert tools.words() == ["nvidia-cuda-mps-control: get_server_list", "nvidia-cuda-mps-control: quit", "nvidia-cuda-mps-control: get_server_list"]
    assert "CUDA_VISIBLE_DEVICES" not in tools.calls[1].env and tools.calls[1].env["CUDA_MPS_LOG_DIRECTORY"] == str(log)
    assert not pipe.parent.exists() and tools.daemons == {}
    with pytest.raises(SharingStepError) as caught:
        s.mps_stop(CONTROL, pipe, log)
    assert caught.value.outcome == "not-found"


def test_a_daemon_that_will_not_quit_fails_the_stop_and_keeps_its_directory(root: Path) -> None:
    tools = FakeTools()
    s = sharing(tools, quit_wait=1.0)
    pipe, log = mps_dirs(root, CONTROL)
    s.mps_start(spec(), pipe, log)
    tools.stubborn = True
    with pytest.raises(SharingStepError, match="still answers 1 s after quit") as caught:
        s.mps_stop(CONTROL, pipe, log)
    assert caught.value.outcome == "failed" and pipe.is_dir()


def test_a_stop_removes_what_a_dead_daemon_left(root: Path) -> None:
    tools = FakeTools()
    pipe, log = mps_dirs(root, CONTROL)
    pipe.mkdir(parents=True)
    (pipe / "control").write_text("")
    sharing(tools).mps_stop(CONTROL, pipe, log)
    assert tools.words() == ["nvidia-cuda-mps-control: get_server_list"]
    assert not pipe.parent.exists()


def test_the_list_is_the_control_directories_and_nothing_else(root: Path, tmp_path: Path) -> None:
    tools = FakeTools()
    s = sharing(tools)
    s.mps_start(spec(), *mps_dirs(root, CONTROL))
    left = "1b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000"
    (root / left).mkdir()
    (root / "lost+found").mkdir()
    (root / "2b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000").write_text("")
    (root / "3b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000").symlink_to(tmp_path)
    tools.calls.clear()
    assert s.mps_list(root) == sorted([CONTROL, left])
    assert s.mps_list(tmp_path / "none") == []
    assert tools.calls == []


def test_a_missing_binary_is_not_supported(root: Path) -> None:
    s = sharing(FakeTools(), which=which_in())
    pipe, log = mps_dirs(root, CONTROL)
    for step in (lambda: s.mps_start(spec(), pipe, log), lambda: s.set_timeslice("0000:18:00.0", GPU_A, "Short")):
        with pytest.raises(SharingStepError) as caught:
            step()
        assert caught.value.outcome == "not-supported" and "is not on PATH" in str(caught.value)
    pipe.mkdir(parents=True)
    with pytest.raises(SharingStepError) as caught:
        s.mps_stop(CONTROL, pipe, log)
    assert caught.value.outcome == "not-supported"


@pytest.mark.parametrize(("error", "text"), [(TimeoutError("late"), "no answer within 30 s"), (PermissionError(13, "Permission denied"), "could not run (Permission denied)")])
def test_a_command_that_hangs_or_cannot_run_fails_the_step(root: Path, error: BaseException, text: str) -> None:
    tools = FakeTools()
    tools.raise_on["get_server_list"] = error
    with pytest.raises(SharingStepError, match=r"get_server_list failed: .*" + text.replace("(", r"\(").replace(")", r"\)")) as caught:
        sharing(tools).mps_start(spec(), *mps_dirs(root, CONTROL))
    assert caught.value.outcome == "failed"


def test_directories_that_are_not_the_daemons_are_refused(root: Path) -> None:
    tools = FakeTools()
    pipe, _ = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).mps_start(spec(), pipe, root / "other" / "log")
    assert caught.value.outcome == "refused" and tools.calls == []


@pytest.mark.parametrize(("interval", "code"), [("Default", "0"), ("Short", "1"), ("Medium", "2"), ("Long", "3")])
def test_a_time_slice_is_the_default_compute_mode_then_the_policy(interval: str, code: str) -> None:
    tools = FakeTools()
    sharing(tools).set_timeslice("0000:18:00.0", GPU_A, interval)
    assert [c.argv for c in tools.calls] == [
        [f"{BIN}/nvidia-smi", "-i", GPU_A, "-c", "DEFAULT"],
        [f"{BIN}/nvidia-smi", "compute-policy", "-i", GPU_A, "--set-timeslice", code],
    ]
    assert all(c.env == {"PATH": os.environ["PATH"]} and c.stdin == "" for c in tools.calls)


def test_a_failed_compute_mode_sets_no_policy() -> None:
    tools = FakeTools()
    tools.fail["-i"] = (6, "Unable to set the compute mode for GPU 00000000:18:00.0: Insufficient Permissions\n")
    with pytest.raises(SharingStepError) as caught:
        sharing(tools).set_timeslice("0000:18:00.0", GPU_A, "Long")
    assert str(caught.value) == (
        "nvidia-smi -c DEFAULT on 0000:18:00.0 failed: Unable to set the compute mode for GPU 00000000:18:00.0: Insufficient Permissions"
    )
    assert len(tools.calls) == 1


@pytest.mark.parametrize("euid", [0, 10007])
def test_a_step_refused_for_want_of_root_says_so_where_the_inventory_is_not_root(root: Path, euid: int) -> None:
    """The shipped unit runs the inventory as bcd-inventory: a time slice (nvidia-smi is root's)
    or a daemon's unit (systemd's, granted by a polkit rule) it could not have says why, and
    where to read on."""
    tools = FakeTools()
    tools.fail["compute-policy"] = (4, "Insufficient Permissions\n")
    with pytest.raises(SharingStepError) as slice_failed:
        sharing(tools, euid=lambda: euid).set_timeslice("0000:18:00.0", GPU_A, "Long")
    unit = MPS_UNIT.format(control=CONTROL)
    tools.fail["--no-ask-password"] = (1, f"Failed to start {unit}: Interactive authentication required.\nSee system logs\n")
    with pytest.raises(SharingStepError) as unit_failed:
        sharing(tools, systemd=True, euid=lambda: euid).mps_start(spec(), *mps_dirs(root, CONTROL))
    hints = (
        f" (the inventory runs as uid {euid}: nvidia-smi sets a compute mode and policy for root only; docs/install.md, 'DRA sharing')",
        f" (the inventory runs as uid {euid}: systemd lets it manage these units only through the polkit rule bcd ships; docs/install.md, 'DRA sharing')",
    )
    texts = (
        "nvidia-smi compute-policy --set-timeslice 3 on 0000:18:00.0 failed: Insufficient Permissions",
        f"starting MPS daemon {CONTROL} failed: Failed to start {unit}: Interactive authentication required. (journalctl -u {unit})",
    )
    for caught, text, hint in zip((slice_failed, unit_failed), texts, hints):
        assert caught.value.outcome == "failed"
        assert str(caught.value) == (text + hint if euid else text)
    # a tool that is not there is not a matter of rights
    with pytest.raises(SharingStepError) as missing:
        sharing(FakeTools(), which=which_in(), euid=lambda: euid).set_timeslice("0000:18:00.0", GPU_A, "Long")
    assert missing.value.outcome == "not-supported" and "uid" not in str(missing.value)


def test_a_failure_without_stderr_says_the_exit_status() -> None:
    tools = FakeTools()
    tools.fail["compute-policy"] = (2, "")
    with pytest.raises(SharingStepError, match="--set-timeslice 3 on 0000:18:00.0 failed: exit status 2"):
        sharing(tools).set_timeslice("0000:18:00.0", GPU_A, "Long")


def test_the_nvidia_adapter_delegates_sharing(tmp_path: Path) -> None:
    host = load_host_file(H200)
    roots = materialize(host, tmp_path / "root")
    tools = FakeTools()
    adapter = NvidiaAdapter(nvml=FakeNvml(host), sysfs_root=roots.sysfs, proc_root=roots.proc, cdi_dir=tmp_path / "cdi", sharing=sharing(tools))
    assert isinstance(adapter, GpuSharer)
    pipe, log = mps_dirs(tmp_path / "mps", CONTROL)
    adapter.mps_start(spec(), pipe, log)
    assert adapter.mps_list(tmp_path / "mps") == [CONTROL]
    adapter.set_timeslice("0000:18:00.0", GPU_A, "Medium")
    adapter.mps_stop(CONTROL, pipe, log)
    assert adapter.mps_list(tmp_path / "mps") == []
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
exit 0
"""

SYSTEMCTL_SCRIPT = r"""#!/bin/sh
# systemd with bcd's two template units: a start or stop runs what the unit file's ExecStart=
# or ExecStop= runs, with the unit's BCD_MPS_ROOT and no environment of the caller's
LOG='@LOG@'
printf 'run %s [%s]\n' "${0##*/}" "$*" >> "$LOG"
[ "$1" = "--no-ask-password" ] && shift
verb=$1; unit=$2
[ "$verb" = is-active ] && unit=$3
inst=${unit#*@}; inst=${inst%.service}
case "$verb:${unit%%@*}" in
  is-active:bcd-mps) test -e '@ROOT@'/"$inst"/pipe/fake-daemon; exit $? ;;
  start:bcd-mps) step=mps-start ;;
  stop:bcd-mps) step=mps-stop ;;
  start:bcd-timeslice) step=timeslice ;;
  *) echo "Unit $unit not found." >&2; exit 5 ;;
esac
cd '@REPO@' && exec env -i PATH="$PATH" BCD_MPS_ROOT='@ROOT@' '@PYTHON@' -m services.inventory.sharing_unit "$step" "$inst" 2>> "$LOG"
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
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeBin:
    fb = FakeBin(tmp_path / "bin", tmp_path / "tools.log", tmp_path / "fail")
    fb.bin.mkdir()
    fb.fail.mkdir()
    repo = Path(__file__).resolve().parents[2]
    for name, script in (("nvidia-cuda-mps-control", MPS_SCRIPT), ("nvidia-smi", SMI_SCRIPT), ("systemctl", SYSTEMCTL_SCRIPT)):
        path = fb.bin / name
        for key, value in (("@LOG@", fb.log), ("@FAIL@", fb.fail), ("@ROOT@", tmp_path / "mps"), ("@REPO@", repo), ("@PYTHON@", sys.executable)):
            script = script.replace(key, str(value))
        path.write_text(script)
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fb.bin}{os.pathsep}{os.environ['PATH']}")
    return fb


def real(*, systemd: bool = False) -> NvidiaSharing:
    return NvidiaSharing(systemd_booted=lambda: systemd, poll_interval=0.02, ready_wait=5.0, quit_wait=5.0, command_timeout=10.0)


def test_the_real_runner_starts_lists_and_stops_a_daemon(fake_bin: FakeBin, root: Path) -> None:
    s = real()
    pipe, log = mps_dirs(root, CONTROL)
    s.mps_start(spec(active_thread_percentage=25, pinned_memory={GPU_B: 512 * MIB}), pipe, log)
    daemon = f"CVD={GPU_A},{GPU_B} PIPE={pipe} LOGDIR={log}"
    assert fake_bin.lines() == [
        f"run nvidia-cuda-mps-control [] {daemon}",
        "stdin get_server_list",
        f"run nvidia-cuda-mps-control [-d] {daemon}",
        f"run nvidia-cuda-mps-control [] {daemon}",
        "stdin get_server_list",
        f"run nvidia-cuda-mps-control [] {daemon}",
        "stdin set_default_active_thread_percentage 25",
        f"stdin set_default_device_pinned_mem_limit {GPU_B} 512M",
    ]
    assert (pipe / "fake-daemon").read_text().splitlines() == [
        f"serves {GPU_A},{GPU_B}", "set_default_active_thread_percentage 25", f"set_default_device_pinned_mem_limit {GPU_B} 512M",
    ]
    assert s.mps_list(root) == [CONTROL]
    s.mps_start(spec(active_thread_percentage=25, pinned_memory={GPU_B: 512 * MIB}), pipe, log)  # again: done
    assert sum(1 for line in fake_bin.lines() if "[-d]" in line) == 1
    start = len(fake_bin.lines())
    s.mps_stop(CONTROL, pipe, log)
    stop = f"CVD=unset PIPE={pipe} LOGDIR={log}"
    assert fake_bin.lines()[start:] == [
        f"run nvidia-cuda-mps-control [] {stop}", "stdin get_server_list",
        f"run nvidia-cuda-mps-control [] {stop}", "stdin quit",
        f"run nvidia-cuda-mps-control [] {stop}", "stdin get_server_list",
    ]
    assert not pipe.parent.exists() and s.mps_list(root) == []


def test_the_real_runner_cleans_up_after_a_failed_limit(fake_bin: FakeBin, root: Path) -> None:
    fake_bin.fail_on("set_default_device_pinned_mem_limit")
    pipe, log = mps_dirs(root, CONTROL)
    with pytest.raises(SharingStepError) as caught:
        real().mps_start(spec(pinned_memory={GPU_A: 2 * MIB}), pipe, log)
    assert (caught.value.outcome, str(caught.value)) == ("failed", f"setting the limits of MPS daemon {CONTROL} failed: fake: set_default_device_pinned_mem_limit refused")
    assert "stdin quit" in fake_bin.lines()
    assert not pipe.parent.exists()


def test_the_real_runner_goes_through_the_units_the_unit_files_name(fake_bin: FakeBin, root: Path) -> None:
    """systemctl (a stand-in that runs what bcd-mps@.service and bcd-timeslice@.service run:
    `python -m services.inventory.sharing_unit`) starts the daemon from the spec the inventory
    wrote, with the environment the unit's step gives it, and quits it at the stop."""
    pipe, log = mps_dirs(root, CONTROL)
    s = real(systemd=True)
    s.mps_start(spec(active_thread_percentage=30), pipe, log)
    unit = MPS_UNIT.format(control=CONTROL)
    daemon = f"CVD={GPU_A},{GPU_B} PIPE={pipe} LOGDIR={log}"
    assert fake_bin.lines() == [
        f"run systemctl [is-active --quiet {unit}]",
        f"run systemctl [--no-ask-password start {unit}]",
        f"run nvidia-cuda-mps-control [-d] {daemon}",
        f"run nvidia-cuda-mps-control [] {daemon}",
        "stdin get_server_list",
        f"run nvidia-cuda-mps-control [] {daemon}",
        "stdin set_default_active_thread_percentage 30",
    ]
    assert s.mps_list(root) == [CONTROL]
    s.mps_start(spec(active_thread_percentage=30), pipe, log)  # again: the unit is active, done
    assert sum(1 for line in fake_bin.lines() if "[-d]" in line) == 1
    s.mps_stop(CONTROL, pipe, log)
    assert "stdin quit" in fake_bin.lines() and not pipe.parent.exists()
    s.set_timeslice("0000:18:00.0", GPU_A, "Long")
    assert fake_bin.lines()[-2:] == [f"run nvidia-smi [-i {GPU_A} -c DEFAULT]", f"run nvidia-smi [compute-policy -i {GPU_A} --set-timeslice 3]"]
    # a step the unit cannot take fails the start with the unit's name, and what it said is in its journal
    fake_bin.fail_on("-d")
    with pytest.raises(SharingStepError, match=rf"starting MPS daemon {CONTROL} failed: .*\(journalctl -u {unit}\)"):
        s.mps_start(spec(), pipe, log)
    assert "bcd sharing unit: failed: starting MPS daemon" in fake_bin.log.read_text()
    assert not pipe.parent.exists()


def test_the_real_runner_sets_a_time_slice_and_reports_a_failure(fake_bin: FakeBin) -> None:
    real().set_timeslice("0000:18:00.0", GPU_A, "Medium")
    assert fake_bin.lines() == [f"run nvidia-smi [-i {GPU_A} -c DEFAULT]", f"run nvidia-smi [compute-policy -i {GPU_A} --set-timeslice 2]"]
    fake_bin.fail_on("nvidia-smi-compute-policy")
    with pytest.raises(SharingStepError, match="--set-timeslice 3 on 0000:18:00.0 failed: fake: nvidia-smi compute-policy refused"):
        real().set_timeslice("0000:18:00.0", GPU_A, "Long")


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
