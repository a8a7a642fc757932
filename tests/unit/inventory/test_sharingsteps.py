"""sharingsteps.py alone, with a fake sharer (no bus, no app): a refusal is an answer and runs
nothing, a time slice waits for its card's MIG lock, an MPS list is cut at MPS_LIST_MAX, a control
id no directory can be built of is refused. (The steps on the fake host:
tests/unit/test_inventory_sharing.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from services.inventory.sharingsteps import SharingSteps, control_of, mps_devices_refusal, sharing_missing
from shared.schemas import MpsDaemonSpec, SharingStepRequest
from shared.schemas.bus import MPS_LIST_MAX

from .rig import MIG_CARD, WHOLE, Log, facts, host, scan

WHOLE_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000001"
MIG_UUID = "MIG-7d3e61b0-0007-4002-8000-000000000001"
CONTROL = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-a1b2c3"
OWNER = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13"


class Sharer:
    def __init__(self, controls: list[str] | None = None) -> None:
        self.controls = controls or []
        self.calls: list[tuple[Any, ...]] = []

    def mps_start(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        self.calls.append(("start", spec.control, pipe_dir, log_dir))

    def mps_stop(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        self.calls.append(("stop", control, pipe_dir, log_dir))

    def mps_list(self, root: Path) -> list[str]:
        self.calls.append(("list", root))
        return list(self.controls)

    def set_timeslice(self, pci_address: str, gpu_uuid: str, interval: str) -> None:
        self.calls.append(("timeslice", pci_address, gpu_uuid, interval))


def room(tmp_path: Path, adapter: Any) -> tuple[SharingSteps, Log]:
    log = Log()
    steps = SharingSteps(facts(tmp_path, adapter, current=scan(host(tmp_path))), mps_root=tmp_path / "mps", adapter_name="fakehw", log=log)
    return steps, log


def ask(**kw: Any) -> SharingStepRequest:
    return SharingStepRequest(owner=OWNER, **kw)


async def test_a_refused_step_is_an_answer_and_runs_nothing(tmp_path: Path) -> None:
    adapter = Sharer()
    steps, log = room(tmp_path, adapter)
    reply = await steps.step(ask(step="mps-start", mps=MpsDaemonSpec(control=CONTROL, uuids=[WHOLE_UUID], pinned_memory={MIG_UUID: 2**30})))
    assert (reply.outcome, reply.step) == ("refused", "mps-start")
    assert reply.message == f"a pinned memory limit is for a device the daemon does not serve: {MIG_UUID}"
    assert adapter.calls == []
    assert log.said("sharing step started") == []
    [(level, kw)] = log.said("sharing step answered")
    assert (level, kw["outcome"], kw["control"], kw["owner"]) == ("warning", "refused", CONTROL, OWNER)


async def test_an_adapter_that_shares_nothing_answers_not_supported(tmp_path: Path) -> None:
    steps, _ = room(tmp_path, object())
    reply = await steps.step(ask(step="mps-list"))
    assert (reply.outcome, reply.message) == ("not-supported", "the fakehw adapter shares no GPUs")


async def test_a_time_slice_waits_for_its_cards_mig_lock_and_mps_steps_do_not(tmp_path: Path) -> None:
    adapter = Sharer()
    steps, _ = room(tmp_path, adapter)
    lock = steps.facts.mig_lock(WHOLE)
    await lock.acquire()  # a MIG change of the card runs
    timeslice = asyncio.create_task(steps.step(ask(step="timeslice-set", pci=WHOLE, interval="Long")))
    listed = await asyncio.wait_for(steps.step(ask(step="mps-list")), 5.0)
    assert listed.ok and not timeslice.done()
    assert ("timeslice", WHOLE, WHOLE_UUID, "Long") not in adapter.calls
    lock.release()
    reply = await asyncio.wait_for(timeslice, 5.0)
    assert (reply.outcome, reply.message) == ("done", f"time slice of {WHOLE} set to Long")
    assert adapter.calls[-1] == ("timeslice", WHOLE, WHOLE_UUID, "Long")


async def test_a_long_list_is_cut_and_says_so(tmp_path: Path) -> None:
    controls = [f"{OWNER}-{n:06x}" for n in range(MPS_LIST_MAX + 3)]
    steps, _ = room(tmp_path, Sharer(controls))
    reply = await steps.step(ask(step="mps-list"))
    assert reply.controls == controls[:MPS_LIST_MAX]
    assert reply.message == f"{MPS_LIST_MAX + 3} MPS daemon(s) under {tmp_path / 'mps'}; the first {MPS_LIST_MAX} are listed"


async def test_start_and_stop_run_in_the_daemons_directories(tmp_path: Path) -> None:
    adapter = Sharer()
    steps, _ = room(tmp_path, adapter)
    started = await steps.step(ask(step="mps-start", mps=MpsDaemonSpec(control=CONTROL, uuids=[MIG_UUID])))
    assert started.ok and f"MPS daemon {CONTROL} runs for {MIG_UUID}" in started.message
    stopped = await steps.step(ask(step="mps-stop", control=CONTROL))
    assert (stopped.outcome, stopped.message) == ("done", f"MPS daemon {CONTROL} stopped, {tmp_path / 'mps' / CONTROL} removed")
    root = tmp_path / "mps" / CONTROL
    assert adapter.calls == [("start", CONTROL, root / "pipe", root / "log"), ("stop", CONTROL, root / "pipe", root / "log")]


def test_the_module_rules_name_what_is_wrong(tmp_path: Path) -> None:
    cards = scan(host(tmp_path)).gpus
    assert sharing_missing(ask(step="mps-stop")) == "mps-stop needs control"
    assert sharing_missing(ask(step="mps-list")) == ""
    assert control_of(ask(step="mps-start", mps=MpsDaemonSpec(control=CONTROL, uuids=[WHOLE_UUID]), control="ignored")) == CONTROL
    assert mps_devices_refusal([MIG_UUID], {}, cards) == ""
    card7 = next(g for g in cards if g.pci_address == MIG_CARD)
    assert "is in MIG mode" in mps_devices_refusal([card7.uuid], {}, cards)
    assert "named twice" in mps_devices_refusal([WHOLE_UUID, WHOLE_UUID], {}, cards)


async def test_a_control_id_no_directory_can_be_built_of_is_refused(tmp_path: Path) -> None:
    adapter = Sharer()
    steps, _ = room(tmp_path, adapter)
    # the schema's pattern keeps such an id off the bus; the room does not count on it
    reply = await steps.step(ask(step="mps-stop", control="../etc"))
    assert reply.outcome == "refused" and adapter.calls == []
