"""services.inventory.sharing_unit, what bcd's root template units run: it takes nothing on trust.

The instance name is checked before anything is built from it; the spec is the inventory's
regular file and must name the unit's control id; every device it names, and a time slice's
card, must be one `nvidia-smi -L` lists on this node; the daemon runs only where its /dev/shm is
its own shm directory; every refusal is one line on stderr with exit 1 (a step) or 2 (usage),
and nothing runs for a refused one. The steps run in systemd's order (prepare, start; stop,
cleanup) on a recording runner and mounts.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from services.inventory import sharing_unit
from services.inventory.adapters.base import mps_dirs, mps_spec_file
from shared.schemas import MpsDaemonSpec
from tests.unit.test_mpsroot import RecordingMounts
from tests.unit.test_nvidia_sharing import CONTROL, GPU_A, GPU_B, GPU_X, MIG_A, FakeTools, direct, root  # noqa: F401 - root is a fixture

OTHER = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-ffffff"


def hand_over(root: Path, spec: MpsDaemonSpec, control: str = CONTROL) -> Path:
    path = mps_spec_file(root, control)
    path.write_bytes(msgspec.json.encode(spec))
    return path


def run(tools: FakeTools, root: Path, *argv: str, shm: str | None = None, mounts: RecordingMounts | None = None) -> int:
    daemon_shm = shm if shm is not None else str(root / CONTROL / "shm")
    return sharing_unit.main(list(argv), sharing=direct(tools), environ={"BCD_MPS_ROOT": str(root)}, mounts=mounts or tools.mounts, daemon_shm=daemon_shm)


def test_the_mps_steps_in_systemds_order(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools(root)
    hand_over(root, MpsDaemonSpec(control=CONTROL, uuids=[GPU_A, MIG_A], active_thread_percentage=20))
    pipe, log = mps_dirs(root, CONTROL)
    assert run(tools, root, "mps-prepare", CONTROL) == 0
    assert tools.mounts.mounted == [(str(root / CONTROL / "shm"), "size=50%,mode=1777")] and tools.calls == []
    assert run(tools, root, "mps-start", CONTROL) == 0
    assert tools.daemons[str(pipe)] == ["set_default_active_thread_percentage 20"]
    assert tools.calls[0].argv[1:] == ["-L"] and tools.calls[1].argv[1:] == ["-d"]
    assert tools.calls[1].env["CUDA_VISIBLE_DEVICES"] == f"{GPU_A},{MIG_A}" and tools.calls[1].env["CUDA_MPS_LOG_DIRECTORY"] == str(log)
    assert run(tools, root, "mps-stop", CONTROL) == 0
    assert str(pipe) not in tools.daemons and pipe.is_dir()  # the stop quits; the cleanup removes
    assert run(tools, root, "mps-cleanup", CONTROL) == 0
    assert os.listdir(root) == [] and mps_spec_file(root, CONTROL).exists()  # the inventory's to remove
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"directories of MPS daemon {CONTROL} made (shm: tmpfs size=50%)",
        f"MPS daemon {CONTROL} runs for {GPU_A}, {MIG_A}",
        f"MPS daemon {CONTROL} quit",
        f"directories of MPS daemon {CONTROL} removed",
    ]
    assert run(tools, root, "mps-cleanup", CONTROL) == 0
    assert capsys.readouterr().out == f"MPS daemon {CONTROL} left nothing\n"


def test_the_shm_size_is_the_units(root: Path) -> None:
    tools = FakeTools(root)
    env = {"BCD_MPS_ROOT": str(root), "BCD_MPS_SHM_SIZE": "8g"}
    assert sharing_unit.main(["mps-prepare", CONTROL], sharing=direct(tools), environ=env, mounts=tools.mounts) == 0
    assert tools.mounts.mounted[0][1] == "size=8g,mode=1777"
    env["BCD_MPS_SHM_SIZE"] = "8g,uid=1000"
    assert sharing_unit.main(["mps-prepare", OTHER], sharing=direct(tools), environ=env, mounts=tools.mounts) == 1
    assert not (root / OTHER).exists()


def test_a_daemon_whose_dev_shm_is_not_its_own_is_never_started(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without the unit's BindPaths= the daemon would see the host's /dev/shm, and the claim's
    containers would not share its shared memory: refused."""
    tools = FakeTools(root)
    hand_over(root, MpsDaemonSpec(control=CONTROL, uuids=[GPU_A]))
    assert run(tools, root, "mps-prepare", CONTROL) == 0
    host_shm = tmp_path / "dev-shm"
    host_shm.mkdir()
    assert run(tools, root, "mps-start", CONTROL, shm=str(host_shm)) == 1
    err = capsys.readouterr().err
    assert err.startswith("bcd sharing unit: refused: ") and "BindPaths=" in err and err.count("\n") == 1
    assert tools.calls == []


def test_a_device_that_is_not_this_nodes_is_refused_before_the_daemon(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools(root)
    hand_over(root, MpsDaemonSpec(control=CONTROL, uuids=[GPU_A, GPU_X]))
    assert run(tools, root, "mps-prepare", CONTROL) == 0
    assert run(tools, root, "mps-start", CONTROL) == 1
    assert capsys.readouterr().err.endswith(f"refused: {GPU_X}: not a device of this node (nvidia-smi -L)\n")
    assert [c.argv[1:] for c in tools.calls] == [["-L"]]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["mps-start", "../../etc"], "'../../etc' is not an MPS control id"),
        (["mps-prepare", "../../etc"], "'../../etc' is not an MPS control id"),
        (["mps-cleanup", "/"], "'/' is not an MPS control id"),
        (["mps-start", CONTROL.upper()], "is not an MPS control id"),
        (["mps-stop", CONTROL + "\n"], "is not an MPS control id"),
        (["timeslice", f"{GPU_A}:Forever"], "is not <GPU uuid>:<Default|Short|Medium|Long>"),
        (["timeslice", f"MIG-{GPU_A[4:]}:Long"], "is not <GPU uuid>"),
        (["timeslice", f"{GPU_A};reboot:Long"], "is not <GPU uuid>"),
        (["reboot", CONTROL], "unknown step 'reboot'"),
        (["mps-start"], "usage:"),
        (["mps-adopt", CONTROL], "unknown step 'mps-adopt'"),
    ],
)
def test_a_bad_instance_is_a_usage_error_and_runs_nothing(root: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    tools = FakeTools(root)
    assert run(tools, root, *argv) == 2
    assert said in capsys.readouterr().err
    assert tools.calls == [] and tools.mounts.mounted == [] and os.listdir(root) == []


def test_a_relative_mps_root_is_refused(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools(root)
    assert sharing_unit.main(["mps-start", CONTROL], sharing=direct(tools), environ={"BCD_MPS_ROOT": "run/mps"}) == 2
    assert "BCD_MPS_ROOT must be an absolute path" in capsys.readouterr().err and tools.calls == []


def test_the_default_root_is_the_inventorys() -> None:
    assert sharing_unit.mps_root({}) == Path("/run/bcd/mps")


@pytest.mark.parametrize("case", ["no spec", "another control's spec", "a symlinked spec", "not a spec"])
def test_mps_start_refuses_a_spec_that_is_not_the_inventorys_for_this_unit(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    tools = FakeTools(root)
    assert run(tools, root, "mps-prepare", CONTROL) == 0
    spec_file = mps_spec_file(root, CONTROL)
    if case == "another control's spec":
        spec_file.write_bytes(msgspec.json.encode(MpsDaemonSpec(control=OTHER, uuids=[GPU_A])))
    elif case == "a symlinked spec":
        target = tmp_path / "elsewhere.json"
        target.write_bytes(msgspec.json.encode(MpsDaemonSpec(control=CONTROL, uuids=[GPU_A])))
        os.symlink(target, spec_file)
    elif case == "not a spec":
        spec_file.write_text('{"control": "x"}')
    capsys.readouterr()
    assert run(tools, root, "mps-start", CONTROL) == 1
    err = capsys.readouterr().err
    assert err.startswith("bcd sharing unit: refused: ") and err.count("\n") == 1, err
    assert tools.calls == []


@pytest.mark.parametrize("which", ["pipe", "log", "shm"])
def test_mps_start_and_stop_refuse_a_daemon_directory_replaced_by_a_symlink(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str) -> None:
    tools = FakeTools(root)
    hand_over(root, MpsDaemonSpec(control=CONTROL, uuids=[GPU_A]))
    assert run(tools, root, "mps-prepare", CONTROL) == 0
    etc = tmp_path / "etc"
    etc.mkdir()
    (root / CONTROL / which).rmdir()
    (root / CONTROL / which).symlink_to(etc)
    for step in ("mps-start", "mps-stop"):
        assert run(tools, root, step, CONTROL, shm=str(etc)) == 1
        assert "is a symlink or not a directory: never followed" in capsys.readouterr().err
    assert tools.calls == [] and os.listdir(etc) == []


def test_a_time_slice_runs_nvidia_smi_for_a_card_of_this_node(root: Path) -> None:
    tools = FakeTools(root)
    assert run(tools, root, "timeslice", f"{GPU_B}:Medium") == 0
    assert [c.argv[1:] for c in tools.calls] == [["-L"], ["-i", GPU_B, "-c", "DEFAULT"], ["compute-policy", "-i", GPU_B, "--set-timeslice", "2"]]


def test_a_time_slice_on_a_card_that_is_not_this_nodes_sets_nothing(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools(root)
    assert run(tools, root, "timeslice", f"{GPU_X}:Long") == 1
    assert capsys.readouterr().err == f"bcd sharing unit: refused: {GPU_X}: not a device of this node (nvidia-smi -L)\n"
    assert [c.argv[1:] for c in tools.calls] == [["-L"]]


def test_a_failed_step_is_one_line_and_exit_1(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools(root)
    tools.fail["compute-policy"] = (4, "Insufficient Permissions\n")
    assert run(tools, root, "timeslice", f"{GPU_A}:Long") == 1
    assert capsys.readouterr().err == "bcd sharing unit: failed: nvidia-smi compute-policy --set-timeslice 3 on " + GPU_A + " failed: Insufficient Permissions\n"


def test_adopt_says_how_many_daemons_it_took_over(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tools = FakeTools(root)
    assert run(tools, root, "mps-adopt") == 0
    assert capsys.readouterr().out == "0 MPS daemon(s) taken over by root\n"
