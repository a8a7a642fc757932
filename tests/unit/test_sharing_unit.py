"""services.inventory.sharing_unit, what bcd's root template units run: it takes nothing on trust.

The instance name is checked before anything is built from it, the spec is the inventory's
regular file under the unit's MPS root and must name the unit's control id, and every refusal
is one line on stderr with exit 1 (a step) or 2 (usage); nothing runs for a refused one.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from services.inventory import sharing_unit
from services.inventory.adapters.base import mps_dirs
from services.inventory.adapters.nvidia_sharing import SPEC_FILE, NvidiaSharing
from shared.schemas import MpsDaemonSpec
from tests.unit.test_nvidia_sharing import ALL_TOOLS, CONTROL, GPU_A, FakeTools, which_in

OTHER = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-ffffff"


def direct(tools: FakeTools) -> NvidiaSharing:
    return NvidiaSharing(runner=tools, which=which_in(*ALL_TOOLS), units=False, sleep=lambda _: None, euid=lambda: 0)


def write_spec(root: Path, control: str, spec: MpsDaemonSpec) -> Path:
    pipe, log = mps_dirs(root, control)
    pipe.mkdir(parents=True)
    log.mkdir()
    (pipe.parent / SPEC_FILE).write_bytes(msgspec.json.encode(spec))
    return pipe


def run(tools: FakeTools, root: Path, *argv: str) -> int:
    return sharing_unit.main(list(argv), sharing=direct(tools), environ={"BCD_MPS_ROOT": str(root)})


def test_mps_start_runs_the_daemon_of_the_spec_beside_its_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools()
    pipe = write_spec(tmp_path, CONTROL, MpsDaemonSpec(control=CONTROL, uuids=[GPU_A], active_thread_percentage=20))
    assert run(tools, tmp_path, "mps-start", CONTROL) == 0
    assert tools.daemons[str(pipe)] == ["set_default_active_thread_percentage 20"]
    assert capsys.readouterr().out == f"MPS daemon {CONTROL} runs for {GPU_A}\n"
    assert run(tools, tmp_path, "mps-stop", CONTROL) == 0
    assert str(pipe) not in tools.daemons
    # the directories are the inventory's to remove (it made them)
    assert pipe.is_dir()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["mps-start", "../../etc"], "'../../etc' is not an MPS control id"),
        (["mps-start", CONTROL.upper()], "is not an MPS control id"),
        (["mps-stop", CONTROL + "\n"], "is not an MPS control id"),
        (["timeslice", f"{GPU_A}:Forever"], "is not <GPU uuid>:<Default|Short|Medium|Long>"),
        (["timeslice", f"MIG-{GPU_A[4:]}:Long"], "is not <GPU uuid>"),
        (["timeslice", f"{GPU_A};reboot:Long"], "is not <GPU uuid>"),
        (["reboot", CONTROL], "unknown step 'reboot'"),
        (["mps-start"], "usage:"),
    ],
)
def test_a_bad_instance_is_a_usage_error_and_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    tools = FakeTools()
    assert run(tools, tmp_path, *argv) == 2
    assert said in capsys.readouterr().err
    assert tools.calls == []


def test_a_relative_mps_root_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools()
    assert sharing_unit.main(["mps-start", CONTROL], sharing=direct(tools), environ={"BCD_MPS_ROOT": "run/mps"}) == 2
    assert "BCD_MPS_ROOT must be an absolute path" in capsys.readouterr().err and tools.calls == []


def test_the_default_root_is_the_inventorys() -> None:
    assert sharing_unit.mps_root({}) == Path("/run/bcd/mps")


@pytest.mark.parametrize("case", ["no spec", "another control's spec", "a symlinked spec", "not a spec"])
def test_mps_start_refuses_a_spec_that_is_not_the_inventorys_for_this_unit(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    tools = FakeTools()
    pipe, log = mps_dirs(tmp_path, CONTROL)
    pipe.mkdir(parents=True)
    log.mkdir()
    spec_file = pipe.parent / SPEC_FILE
    if case == "another control's spec":
        spec_file.write_bytes(msgspec.json.encode(MpsDaemonSpec(control=OTHER, uuids=[GPU_A])))
    elif case == "a symlinked spec":
        target = tmp_path / "elsewhere.json"
        target.write_bytes(msgspec.json.encode(MpsDaemonSpec(control=CONTROL, uuids=[GPU_A])))
        os.symlink(target, spec_file)
    elif case == "not a spec":
        spec_file.write_text('{"control": "x"}')
    assert run(tools, tmp_path, "mps-start", CONTROL) == 1
    err = capsys.readouterr().err
    assert err.startswith("bcd sharing unit: refused: ") and err.count("\n") == 1, err
    assert not any(c.argv[1:] == ["-d"] for c in tools.calls)


def test_a_time_slice_runs_nvidia_smi_for_the_instance(tmp_path: Path) -> None:
    tools = FakeTools()
    assert run(tools, tmp_path, "timeslice", f"{GPU_A}:Medium") == 0
    assert [c.argv[1:] for c in tools.calls] == [["-i", GPU_A, "-c", "DEFAULT"], ["compute-policy", "-i", GPU_A, "--set-timeslice", "2"]]


def test_a_failed_step_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools()
    tools.fail["compute-policy"] = (4, "Insufficient Permissions\n")
    assert run(tools, tmp_path, "timeslice", f"{GPU_A}:Long") == 1
    assert capsys.readouterr().err == "bcd sharing unit: failed: nvidia-smi compute-policy --set-timeslice 3 on " + GPU_A + " failed: Insufficient Permissions\n"
