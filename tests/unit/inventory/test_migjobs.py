"""migjobs.py alone, with a fake adapter and a fake publish (no bus, no app): the MIG layout job
table (a second request of an op id answers the running job, a poll for an op id this process does
not know is an Error), the DisruptionRequired notice, and the instance steps with their refusals,
each under the card's lock and followed by a scan published before the answer."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.inventory.adapters.base import MigInstanceFacts, MigLayoutResult, MigStepError
from services.inventory.jobs import JobTable
from services.inventory.migjobs import MigJobs, mig_step_missing
from shared.schemas import Inventory, MigInstanceRequest, MigLayoutRequest, SwitchReply

from .rig import MIG_CARD, NOT_LISTED, WHOLE, Log, facts, host, scan, until


class Partitioner:
    """apply_mig_layout waits for `gate` (a layout that takes its time), then answers `result`."""

    def __init__(self, result: MigLayoutResult | None = None) -> None:
        self.result = result or MigLayoutResult("Applied", "7g.141gb made")
        self.gate = threading.Event()
        self.calls: list[tuple[str, tuple[str, ...], bool]] = []

    def apply_mig_layout(self, pci_address: str, profiles: Any, *, disable: bool) -> MigLayoutResult:
        self.calls.append((pci_address, tuple(profiles), disable))
        self.gate.wait(5.0)
        return self.result


class Instancer:
    """The MigInstancer steps, recorded; `fail` raises from each."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.calls: list[tuple[Any, ...]] = []

    def _do(self, *call: Any) -> None:
        self.calls.append(call)
        if self.fail is not None:
            raise self.fail

    def gpu_instances(self, gpu_uuid: str) -> list[Any]:
        return []

    def create_gpu_instance(self, pci_address: str, profile: str, start: int) -> int:
        self._do("create-gi", pci_address, profile, start)
        return 5

    def create_compute_instance(self, pci_address: str, gi: int) -> MigInstanceFacts:
        self._do("create-ci", pci_address, gi)
        return MigInstanceFacts(gi=gi, ci=0, uuid="MIG-00000000-0000-4000-8000-000000000005")

    def destroy_compute_instance(self, pci_address: str, gi: int, ci: int) -> None:
        self._do("destroy-ci", pci_address, gi, ci)

    def destroy_gpu_instance(self, pci_address: str, gi: int) -> None:
        self._do("destroy-gi", pci_address, gi)


class Room:
    def __init__(self, tmp_path: Path, adapter: Any, *, publish_fails: bool = False, edit: Any = None) -> None:
        self.log = Log()
        self.published: list[tuple[str, SwitchReply | None]] = []
        self.facts = facts(tmp_path, adapter, current=scan(host(tmp_path, edit)))
        self.jobs = JobTable()

        async def publish(reason: str, switch: SwitchReply | None) -> Inventory:
            self.published.append((reason, switch))
            if publish_fails:
                raise RuntimeError("bucket gone")
            assert self.facts.current is not None
            return self.facts.current

        self.mig = MigJobs(self.facts, jobs=self.jobs, publish=publish, adapter_name="fakehw", log=self.log)


def layout(op_id: str = "op-1", **kw: Any) -> MigLayoutRequest:
    return MigLayoutRequest(pci=kw.pop("pci", MIG_CARD), profiles=kw.pop("profiles", ["7g.141gb"]), op_id=op_id, **kw)


# --------------------------------------------------------------------------- layouts


async def test_a_second_request_of_an_op_id_answers_the_running_job_and_then_its_result(tmp_path: Path) -> None:
    adapter = Partitioner()
    room = Room(tmp_path, adapter)
    first = await room.mig.layout(layout())
    assert (first.outcome, first.message) == ("Running", "MIG layout change op-1 started")
    await until("the layout change to start", lambda: adapter.calls)
    # the converger asks again with the same op id (a retry, or a poll): the job that runs answers
    again = await room.mig.layout(layout())
    polled = await room.mig.layout(layout(poll=True))
    assert again.outcome == polled.outcome == "Running" and "op-1 runs" in polled.message
    # the same op id for other arguments is not that job
    other = await room.mig.layout(layout(profiles=["3g.71gb", "3g.71gb"]))
    assert other.outcome == "Error" and "of another card or layout" in other.message
    elsewhere = await room.mig.layout(layout(pci=WHOLE))
    assert elsewhere.outcome == "Error"
    adapter.gate.set()
    await until("the result", lambda: room.jobs.get("op-1").result is not None)  # type: ignore[union-attr]
    result = await room.mig.layout(layout(poll=True))
    assert (result.outcome, result.message) == ("Applied", "7g.141gb made")
    assert adapter.calls == [(MIG_CARD, ("7g.141gb",), False)]  # one change, however often asked
    # the card was scanned and published before the result could be polled
    assert room.published == [("MIG layout changed", None)]


async def test_a_poll_for_an_op_id_this_process_does_not_know_is_an_error(tmp_path: Path) -> None:
    adapter = Partitioner()
    room = Room(tmp_path, adapter)
    reply = await room.mig.layout(layout("op-from-before-a-restart", poll=True))
    assert (reply.outcome, reply.left) == ("Error", "unknown")
    assert "knows no MIG layout change op-from-before-a-restart: it restarted while it ran" in reply.message
    assert adapter.calls == [] and room.published == [] and room.jobs.jobs == {}


async def test_a_layout_for_a_card_not_listed_or_an_adapter_that_cannot_is_refused(tmp_path: Path) -> None:
    room = Room(tmp_path, Partitioner())
    missing = await room.mig.layout(layout(pci=NOT_LISTED))
    assert (missing.outcome, missing.left, missing.message) == ("Error", "as before", f"the inventory lists no GPU at {NOT_LISTED}")
    cannot = await Room(tmp_path, object()).mig.layout(layout())
    assert (cannot.outcome, cannot.left) == ("NotSupported", "as before") and "fakehw adapter changes no MIG layout" in cannot.message
    assert room.jobs.jobs == {}


async def test_a_layout_without_an_op_id_is_answered_when_done(tmp_path: Path) -> None:
    adapter = Partitioner(MigLayoutResult("Failed", "a process uses it", left="rolled back"))
    adapter.gate.set()
    room = Room(tmp_path, adapter)
    reply = await room.mig.layout(layout(""))
    assert (reply.outcome, reply.left, reply.message) == ("Failed", "rolled back", "a process uses it")
    assert room.jobs.jobs == {}  # nothing to poll
    assert room.log.said("MIG layout change done")[0][0] == "warning"


async def test_a_mode_change_that_waits_for_a_reset_is_published_as_a_disruption(tmp_path: Path) -> None:
    adapter = Partitioner(MigLayoutResult("DisruptionRequired", "MIG mode pending: reset the GPU"))
    adapter.gate.set()
    room = Room(tmp_path, adapter)
    reply = await room.mig.layout(layout(""))
    assert reply.outcome == "DisruptionRequired"
    [(reason, switch)] = room.published
    assert reason == "MIG layout changed" and switch is not None
    assert (switch.pci, switch.target, switch.outcome, switch.reason) == (MIG_CARD, "mig-layout", "DisruptionRequired", "MigModePending")
    assert switch.boot_id == room.facts.current.boot_id != ""  # type: ignore[union-attr]
    assert switch.message == "MIG mode pending: reset the GPU"


async def test_a_failed_scan_after_the_change_leaves_the_result_standing(tmp_path: Path) -> None:
    adapter = Partitioner()
    adapter.gate.set()
    room = Room(tmp_path, adapter, publish_fails=True)
    reply = await room.mig.layout(layout(""))
    assert reply.outcome == "Applied"
    assert [level for level, _ in room.log.said("scan after a MIG layout change failed")] == ["exception"]


# --------------------------------------------------------------------------- instance steps


def step(name: str, **kw: Any) -> MigInstanceRequest:
    return MigInstanceRequest(step=name, pci=kw.pop("pci", MIG_CARD), owner="claim-1", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "why"),
    [
        (step("create-gi", pci=NOT_LISTED, profile="1g.18gb", start=0), f"the inventory lists no GPU at {NOT_LISTED}"),
        (step("create-gi", pci=WHOLE, profile="1g.18gb", start=0), f"{WHOLE} is not in MIG mode"),
        (step("create-gi"), "create-gi needs profile and start"),
        (step("create-gi", profile="1g.18gb"), "create-gi needs start"),
        (step("create-ci"), "create-ci needs gi"),
        (step("destroy-ci", gi=2), "destroy-ci needs ci"),
        (step("destroy-gi"), "destroy-gi needs gi"),
    ],
)
async def test_a_step_that_is_wrong_for_the_card_is_refused_as_an_answer(tmp_path: Path, request_: MigInstanceRequest, why: str) -> None:
    adapter = Instancer()
    room = Room(tmp_path, adapter)
    reply = await room.mig.instance(request_)
    assert (reply.outcome, reply.message, reply.step) == ("refused", why, request_.step)
    assert adapter.calls == [] and room.published == []
    assert room.log.said("MIG instance step answered")[0][0] == "warning"


async def test_a_step_on_a_card_off_its_compute_driver_is_refused(tmp_path: Path) -> None:
    def passthrough(data: dict[str, Any]) -> None:
        data["gpus"][7]["driver"] = "vfio-pci"

    room = Room(tmp_path, Instancer(), edit=passthrough)
    reply = await room.mig.instance(step("destroy-gi", gi=2))
    assert reply.outcome == "refused" and "is not on its compute driver (vfio-pci)" in reply.message


async def test_an_adapter_that_makes_no_instances_answers_not_supported(tmp_path: Path) -> None:
    reply = await Room(tmp_path, Partitioner()).mig.instance(step("destroy-gi", gi=2))
    assert (reply.outcome, reply.message) == ("not-supported", "the fakehw adapter makes no MIG instances")


async def test_each_step_runs_and_the_card_is_published_before_the_answer(tmp_path: Path) -> None:
    adapter = Instancer()
    room = Room(tmp_path, adapter)
    made = await room.mig.instance(step("create-gi", profile="1g.18gb", start=3))
    assert (made.outcome, made.gi, made.ci) == ("done", 5, None) and "GPU instance 5 (1g.18gb at 3) made" in made.message
    ci = await room.mig.instance(step("create-ci", gi=5))
    assert (ci.gi, ci.ci, ci.uuid) == (5, 0, "MIG-00000000-0000-4000-8000-000000000005")
    assert (await room.mig.instance(step("destroy-ci", gi=5, ci=0))).ok
    assert (await room.mig.instance(step("destroy-gi", gi=5))).ok
    assert [c[0] for c in adapter.calls] == ["create-gi", "create-ci", "destroy-ci", "destroy-gi"]
    assert room.published == [("MIG create-gi", None), ("MIG create-ci", None), ("MIG destroy-ci", None), ("MIG destroy-gi", None)]


async def test_a_vendor_refusal_or_an_adapter_bug_is_an_answer(tmp_path: Path) -> None:
    in_use = Room(tmp_path, Instancer(MigStepError("in-use", "a process uses MIG device 2/0")))
    reply = await in_use.mig.instance(step("destroy-ci", gi=2, ci=0))
    assert (reply.outcome, reply.message) == ("in-use", "a process uses MIG device 2/0")
    assert in_use.published == [("MIG destroy-ci", None)]  # what the step left is read again all the same
    bug = Room(tmp_path, Instancer(KeyError("gi")))
    reply = await bug.mig.instance(step("destroy-gi", gi=2))
    assert reply.outcome == "failed" and reply.message.startswith(f"destroy-gi on {MIG_CARD} failed:")
    assert bug.log.said("MIG instance step raised")[0][0] == "exception"


async def test_a_step_waits_for_the_cards_mig_lock(tmp_path: Path) -> None:
    adapter = Instancer()
    room = Room(tmp_path, adapter)
    lock = room.facts.mig_lock(MIG_CARD)
    await lock.acquire()  # a layout change of the same card runs
    task = asyncio.create_task(room.mig.instance(step("destroy-gi", gi=2)))
    await asyncio.sleep(0.1)
    assert not task.done() and adapter.calls == []
    lock.release()
    assert (await asyncio.wait_for(task, 5.0)).ok


def test_what_a_step_lacks_is_named() -> None:
    assert mig_step_missing(step("create-gi", profile="1g.18gb", start=0)) == ""
    assert mig_step_missing(step("create-gi", start=0)) == "profile"
    assert mig_step_missing(msgspec.structs.replace(step("destroy-ci"), gi=1)) == "ci"
