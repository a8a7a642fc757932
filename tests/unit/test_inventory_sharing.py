"""GPU sharing on the fake host (`GpuSharer` over the host file), and the inventory's `sharing`
step handler (sharingsteps.py, built alone) with its refusals (no bus: the endpoint on a real bus is
tests/integration/test_inventory_sharing.py).

The host is a copy of the example's 8 x H200: card 0 (0000:18:00.0) is a whole card, card 7
(0000:db:00.0) is in MIG mode with four MIG devices.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.inventory.adapters.base import GpuSharer, MigStepError, SharingStepError, mps_dirs
from services.inventory.adapters.fakehost import HostFileError, load_host_file
from services.inventory.adapters.fakehw import MPS_CONTROL_FIFO, FakeHwAdapter
from services.inventory.build import build_inventory
from services.inventory.facts import InventoryFacts
from services.inventory.gpustate import GpuStateStore, GpuTracker
from services.inventory.health import HealthPolicy
from services.inventory.publishing import mps_root_named
from services.inventory.service import InventoryApp
from services.inventory.sharingsteps import SharingSteps
from shared.schemas import MpsDaemonSpec, SharingStepRequest
from tests.unit.test_inventory_adapters import H200

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
WHOLE = "0000:18:00.0"
WHOLE_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000001"
OTHER_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000002"
MIG_CARD = "0000:db:00.0"
MIG_CARD_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000008"
MIG_UUID = "MIG-7d3e61b0-0007-4002-8000-000000000001"  # gi 2 ci 0 of card 7
CONTROL = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-a1b2c3"
CONTROL2 = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-d4e5f6"


def spec(control: str = CONTROL, uuids: list[str] | None = None, **kw: Any) -> MpsDaemonSpec:
    return MpsDaemonSpec(control=control, uuids=uuids or [WHOLE_UUID], **kw)


class Rig:
    """The fakehw adapter over a copy of the example host, with an MPS root in tmp."""

    def __init__(self, tmp_path: Path, *, faults: dict[int, dict[str, str]] | None = None) -> None:
        data = json.loads(H200.read_text())
        for index, fault in (faults or {}).items():
            data["gpus"][index]["faults"] = fault
        self.host_file = tmp_path / "host.json"
        self.host_file.write_text(json.dumps(data))
        self.root = tmp_path / "mps"
        self.adapter = FakeHwAdapter(self.host_file, cdi_dir=tmp_path / "cdi")

    def dirs(self, control: str = CONTROL) -> tuple[Path, Path]:
        return mps_dirs(self.root, control)

    def start(self, s: MpsDaemonSpec) -> None:
        self.adapter.mps_start(s, *self.dirs(s.control))

    def stop(self, control: str = CONTROL) -> None:
        self.adapter.mps_stop(control, *self.dirs(control))

    def doc(self) -> dict[str, Any]:
        return json.loads(self.host_file.read_text())

    def refused(self, outcome: str, fn: Any, *args: Any) -> str:
        with pytest.raises(SharingStepError) as caught:
            fn(*args)
        assert caught.value.outcome == outcome, str(caught.value)
        return str(caught.value)


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


# --------------------------------------------------------------------------- MPS daemons


def test_the_fake_host_is_a_gpu_sharer(rig: Rig) -> None:
    assert isinstance(rig.adapter, GpuSharer)


def test_a_start_records_the_daemon_and_makes_its_directories_shm_and_fifo(rig: Rig) -> None:
    pipe, log = rig.dirs()
    rig.start(spec(uuids=[WHOLE_UUID, OTHER_UUID], active_thread_percentage=50, pinned_memory={OTHER_UUID: 2 * 2**30}))
    daemon = load_host_file(rig.host_file).mps_daemons[0]  # the host file is still valid
    assert (daemon.control, daemon.uuids, daemon.active_thread_percentage) == (CONTROL, [WHOLE_UUID, OTHER_UUID], 50)
    assert daemon.pinned_memory == {OTHER_UUID: 2 * 2**30}
    assert (daemon.pipe_dir, daemon.log_dir) == (str(pipe), str(log))
    for d in (rig.root, pipe.parent, pipe, log):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o755 and stat.S_ISDIR(os.lstat(d).st_mode), d
    assert stat.S_ISFIFO(os.lstat(pipe / MPS_CONTROL_FIFO).st_mode)
    # the daemon's shared memory, which the claim's CDI spec mounts at /dev/shm (as a /dev/shm: 1777)
    assert stat.S_IMODE(os.lstat(pipe.parent / "shm").st_mode) == 0o1777


def test_a_start_asked_again_with_the_same_spec_is_done_and_repairs_the_fifo(rig: Rig) -> None:
    rig.start(spec())
    pipe, _ = rig.dirs()
    (pipe / MPS_CONTROL_FIFO).unlink()
    before = rig.doc()["mps_daemons"]
    rig.start(spec())
    assert rig.doc()["mps_daemons"] == before
    assert stat.S_ISFIFO(os.lstat(pipe / MPS_CONTROL_FIFO).st_mode)


def test_a_start_for_a_running_control_with_another_spec_is_refused(rig: Rig) -> None:
    rig.start(spec())
    message = rig.refused("refused", rig.start, spec(uuids=[OTHER_UUID]))
    assert "another spec" in message
    assert rig.refused("refused", rig.start, spec(active_thread_percentage=10))
    assert [d["uuids"] for d in rig.doc()["mps_daemons"]] == [[WHOLE_UUID]]


def test_a_start_on_a_device_the_host_does_not_have_is_refused(rig: Rig) -> None:
    assert "no GPU or MIG device" in rig.refused("refused", rig.start, spec(uuids=["GPU-00000000-0000-4000-8000-00000000ffff"]))
    assert rig.refused("refused", rig.start, spec(uuids=["MIG-00000000-0007-4002-8000-00000000ffff"]))
    assert "mps_daemons" not in rig.doc() and not rig.root.exists()


def test_a_daemon_on_a_mig_device_is_recorded(rig: Rig) -> None:
    rig.start(spec(uuids=[MIG_UUID]))
    assert load_host_file(rig.host_file).mps_daemons[0].uuids == [MIG_UUID]


def test_a_stop_removes_record_and_directory_then_answers_not_found(rig: Rig) -> None:
    rig.start(spec())
    rig.start(spec(CONTROL2, [OTHER_UUID]))
    rig.stop()
    assert [d["control"] for d in rig.doc()["mps_daemons"]] == [CONTROL2]
    assert not (rig.root / CONTROL).exists() and (rig.root / CONTROL2).is_dir()
    assert "nothing of one is left" in rig.refused("not-found", rig.stop)


def test_a_stop_removes_what_a_dead_daemon_left(rig: Rig) -> None:
    pipe, log = rig.dirs()
    pipe.mkdir(parents=True)
    log.mkdir()
    (log / "control.log").write_text("left\n")
    rig.stop()
    assert not pipe.parent.exists()


def test_directories_that_are_not_the_daemons_are_refused(rig: Rig) -> None:
    pipe, log = rig.dirs()
    other_pipe, _ = rig.dirs(CONTROL2)
    rig.refused("refused", rig.adapter.mps_start, spec(), other_pipe, log)
    rig.refused("refused", rig.adapter.mps_stop, CONTROL, pipe, rig.root / "elsewhere" / "log")
    with pytest.raises(ValueError):
        mps_dirs(rig.root, "../etc")


def test_the_list_has_records_and_left_directories_and_ignores_everything_else(rig: Rig, tmp_path: Path) -> None:
    rig.start(spec())
    left = "1b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000"
    (rig.root / left).mkdir()
    (rig.root / "not-a-control").mkdir()
    (rig.root / "2b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000").write_text("a file")
    outside = tmp_path / "outside"
    outside.mkdir()
    (rig.root / "3b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-000000").symlink_to(outside)
    assert rig.adapter.mps_list(rig.root) == sorted([CONTROL, left])
    assert (rig.root / "not-a-control").is_dir() and outside.is_dir()
    assert rig.adapter.mps_list(tmp_path / "no-such-root") == []


def test_a_host_file_with_wrong_daemons_is_refused(rig: Rig) -> None:
    rig.start(spec())
    doc = rig.doc()
    doc["mps_daemons"].append(dict(doc["mps_daemons"][0]))
    rig.host_file.write_text(json.dumps(doc))
    with pytest.raises(HostFileError, match=r"appears twice - at `\$.mps_daemons\[1\].control`"):
        load_host_file(rig.host_file)
    doc["mps_daemons"] = [dict(doc["mps_daemons"][0], uuids=["GPU-00000000-0000-4000-8000-00000000ffff"])]
    rig.host_file.write_text(json.dumps(doc))
    with pytest.raises(HostFileError, match=r"not a GPU or MIG device of this host - at `\$.mps_daemons\[0\].uuids\[0\]`"):
        load_host_file(rig.host_file)


def test_a_mig_device_a_daemon_serves_is_in_use(rig: Rig) -> None:
    rig.start(spec(uuids=[MIG_UUID]))
    with pytest.raises(MigStepError) as caught:
        rig.adapter.destroy_compute_instance(MIG_CARD, 2, 0)
    assert caught.value.outcome == "in-use" and CONTROL in str(caught.value)
    layout = rig.adapter.apply_mig_layout(MIG_CARD, ["7g.141gb"], disable=False)
    assert (layout.outcome, layout.left) == ("Failed", "as before") and CONTROL in layout.message
    assert len(load_host_file(rig.host_file).gpus[7].mig_instances) == 4


# --------------------------------------------------------------------------- faults


def test_the_start_fault_fires_once_on_the_card_of_the_first_device(tmp_path: Path) -> None:
    rig = Rig(tmp_path, faults={0: {"sharing": "mps-start-fail"}})
    rig.start(spec(uuids=[OTHER_UUID, WHOLE_UUID]))  # its first device is card 1: no fault
    assert "mps-start-fail" in rig.refused("failed", rig.start, spec(CONTROL2, [WHOLE_UUID]))
    assert not (rig.root / CONTROL2).exists()
    assert rig.doc()["gpus"][0]["faults"]["sharing"] == ""
    rig.start(spec(CONTROL2, [WHOLE_UUID]))
    assert [d["control"] for d in rig.doc()["mps_daemons"]] == [CONTROL, CONTROL2]


def test_the_start_fault_of_a_mig_card_fires_for_its_mig_devices(tmp_path: Path) -> None:
    rig = Rig(tmp_path, faults={7: {"sharing": "mps-start-fail"}})
    rig.refused("failed", rig.start, spec(uuids=[MIG_UUID]))
    rig.start(spec(uuids=[MIG_UUID]))


def test_the_stop_fault_fires_once_and_the_daemon_keeps_running(tmp_path: Path) -> None:
    rig = Rig(tmp_path, faults={0: {"sharing": "mps-stop-fail"}})
    rig.start(spec())
    assert "still runs" in rig.refused("failed", rig.stop)
    assert rig.adapter.mps_list(rig.root) == [CONTROL] and (rig.root / CONTROL).is_dir()
    rig.stop()
    assert rig.adapter.mps_list(rig.root) == []


def test_the_timeslice_fault_fires_once(tmp_path: Path) -> None:
    rig = Rig(tmp_path, faults={0: {"sharing": "timeslice-fail"}})
    rig.refused("failed", rig.adapter.set_timeslice, WHOLE, WHOLE_UUID, "Long")
    assert load_host_file(rig.host_file).gpus[0].timeslice == "Default"
    rig.adapter.set_timeslice(WHOLE, WHOLE_UUID, "Long")
    assert load_host_file(rig.host_file).gpus[0].timeslice == "Long"


# --------------------------------------------------------------------------- time slices


def test_a_time_slice_is_set_on_whole_cards_only(rig: Rig) -> None:
    rig.adapter.set_timeslice(WHOLE, WHOLE_UUID, "Short")
    assert load_host_file(rig.host_file).gpus[0].timeslice == "Short"
    assert "MIG mode" in rig.refused("refused", rig.adapter.set_timeslice, MIG_CARD, MIG_CARD_UUID, "Short")
    rig.refused("refused", rig.adapter.set_timeslice, WHOLE, OTHER_UUID, "Short")
    rig.refused("refused", rig.adapter.set_timeslice, "0000:99:00.0", WHOLE_UUID, "Short")
    rig.refused("refused", rig.adapter.set_timeslice, WHOLE, WHOLE_UUID, "Forever")


# --------------------------------------------------------------------------- the inventory's step handler


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, msg: str, **kw: Any) -> None:
        self.lines.append((msg, kw))

    warning = exception = info


def handler(rig: Rig, *, adapter: Any = None) -> tuple[SharingSteps, Any]:
    facts = InventoryFacts(
        adapter=adapter if adapter is not None else rig.adapter,
        tracker=GpuTracker("node-1"),
        store=GpuStateStore(rig.root.parent / "state"),
        health_policy=HealthPolicy(),
        current=build_inventory(rig.adapter, node_id="node-1", revision=1, now=NOW),
    )
    ctx = SimpleNamespace(log=Log())
    return SharingSteps(facts, mps_root=rig.root, adapter_name="fakehw", log=ctx.log), ctx


def ask(steps: SharingSteps, ctx: Any, **kw: Any) -> Any:
    return asyncio.run(steps.step(SharingStepRequest(owner="0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13", **kw)))


def test_the_handler_runs_each_step_and_logs_it(rig: Rig) -> None:
    app, ctx = handler(rig)
    started = ask(app, ctx, step="mps-start", mps=spec(uuids=[MIG_UUID]))
    assert (started.step, started.outcome) == ("mps-start", "done"), started.message
    assert (rig.root / CONTROL / "pipe" / MPS_CONTROL_FIFO).exists()
    assert ask(app, ctx, step="mps-list").controls == [CONTROL]
    assert ask(app, ctx, step="timeslice-set", pci=WHOLE, interval="Medium").ok
    assert load_host_file(rig.host_file).gpus[0].timeslice == "Medium"
    assert ask(app, ctx, step="mps-stop", control=CONTROL).ok
    gone = ask(app, ctx, step="mps-stop", control=CONTROL)
    assert gone.outcome == "not-found", gone.message
    assert [m for m, _ in ctx.log.lines].count("sharing step started") == 5
    assert [m for m, _ in ctx.log.lines].count("sharing step answered") == 5


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        ({"step": "mps-start"}, "mps-start needs mps"),
        ({"step": "mps-stop"}, "mps-stop needs control"),
        ({"step": "timeslice-set"}, "timeslice-set needs pci"),
        ({"step": "timeslice-set", "pci": "0000:99:00.0"}, "lists no GPU at 0000:99:00.0"),
        ({"step": "timeslice-set", "pci": MIG_CARD}, "time slices are for whole cards"),
        ({"step": "mps-start", "mps": spec(uuids=["GPU-00000000-0000-4000-8000-00000000ffff"])}, "lists no GPU or MIG device"),
        ({"step": "mps-start", "mps": spec(uuids=[MIG_CARD_UUID])}, "serves its MIG devices, not the card"),
        ({"step": "mps-start", "mps": spec(uuids=[WHOLE_UUID, WHOLE_UUID])}, "named twice"),
        ({"step": "mps-start", "mps": spec(pinned_memory={OTHER_UUID: 2**30})}, "does not serve"),
    ],
)
def test_the_handler_answers_a_wrong_request_as_refused(rig: Rig, request_: dict[str, Any], why: str) -> None:
    app, ctx = handler(rig)
    reply = ask(app, ctx, **request_)
    assert (reply.outcome, reply.step) == ("refused", request_["step"]) and why in reply.message, reply.message
    assert "mps_daemons" not in rig.doc() and not rig.root.exists()


def test_the_handler_refuses_a_card_in_passthrough(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    doc = rig.doc()
    doc["gpus"][0]["driver"] = "vfio-pci"
    rig.host_file.write_text(json.dumps(doc))
    app, ctx = handler(rig)
    assert "compute driver" in ask(app, ctx, step="timeslice-set", pci=WHOLE).message
    assert "compute driver" in ask(app, ctx, step="mps-start", mps=spec()).message


def test_an_adapter_that_shares_nothing_answers_not_supported(rig: Rig) -> None:
    app, ctx = handler(rig, adapter=object())
    reply = ask(app, ctx, step="mps-list")
    assert reply.outcome == "not-supported" and "shares no GPUs" in reply.message


def test_an_adapter_failure_is_an_answer(rig: Rig) -> None:
    class Broken(FakeHwAdapter):
        def mps_list(self, root: Path) -> list[str]:
            raise RuntimeError("boom")

    app, ctx = handler(rig, adapter=Broken(rig.host_file, cdi_dir=rig.host_file.parent / "cdi"))
    reply = ask(app, ctx, step="mps-list")
    assert reply.outcome == "failed" and "boom" in reply.message


def test_the_mps_root_must_be_absolute(tmp_path: Path) -> None:
    from shared.runtime import StartupError

    ctx = SimpleNamespace(opts=SimpleNamespace(adapter="fakehw", fake_host=tmp_path / "host.json", mps_root=Path("run/mps")))
    with pytest.raises(StartupError, match="--mps-root must be an absolute path"):
        asyncio.run(InventoryApp().setup(ctx))  # type: ignore[arg-type]


def test_the_inventory_names_its_mps_root_only_with_a_sharer(rig: Rig) -> None:
    assert mps_root_named(rig.adapter, rig.root) == str(rig.root)
    assert mps_root_named(object(), rig.root) == ""
