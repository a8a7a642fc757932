"""diagjobs.py alone, with a fake adapter (no bus, no app): a diagnostic is a job the converger
polls by op id; a second request of the id answers the running job, a poll for an id this process
does not know is an Error, and the refusals come before anything runs."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from services.inventory.adapters.base import DiagResult
from services.inventory.diagjobs import DiagJobs
from services.inventory.jobs import JobTable
from shared.schemas import DiagRequest
from shared.schemas.bus import DIAG_RUN_S

from .rig import NOT_LISTED, WHOLE, Log, facts, host, scan, until


class Diagnoser:
    def __init__(self, result: DiagResult | None = None) -> None:
        self.result = result or DiagResult("Passed", "all tests passed")
        self.gate = threading.Event()
        self.calls: list[tuple[str, int, float]] = []

    def run_diag(self, pci_address: str, level: int, timeout: float) -> DiagResult:
        self.calls.append((pci_address, level, timeout))
        self.gate.wait(5.0)
        return self.result


def room(tmp_path: Path, adapter: Any) -> tuple[DiagJobs, JobTable, Log]:
    log, jobs = Log(), JobTable()
    return DiagJobs(facts(tmp_path, adapter, current=scan(host(tmp_path))), jobs=jobs, adapter_name="fakehw", log=log), jobs, log


async def test_a_second_request_of_an_op_id_answers_the_running_diagnostic_then_its_result(tmp_path: Path) -> None:
    adapter = Diagnoser()
    diags, jobs, log = room(tmp_path, adapter)
    ask = DiagRequest(pci=WHOLE, level=2, op_id="op-1")
    first = await diags.diag(ask)
    assert (first.outcome, first.message) == ("Running", "diagnostic op-1 started")
    await until("the diagnostic to start", lambda: adapter.calls)
    again = await diags.diag(ask)
    assert (again.outcome, again.message) == ("Running", "diagnostic op-1 runs")
    other = await diags.diag(DiagRequest(pci=WHOLE, level=3, op_id="op-1"))
    assert other.outcome == "Error" and "of another card or level" in other.message
    adapter.gate.set()
    await until("the result", lambda: jobs.get("op-1").result is not None)  # type: ignore[union-attr]
    done = await diags.diag(DiagRequest(pci=WHOLE, level=2, op_id="op-1", poll=True))
    assert (done.outcome, done.message) == ("Passed", "all tests passed")
    # one run, bounded by its level's run time
    assert adapter.calls == [(WHOLE, 2, DIAG_RUN_S[2])]
    assert [kw["outcome"] for _, kw in log.said("diagnostic done")] == ["Passed"]


async def test_a_poll_for_an_op_id_this_process_does_not_know_is_an_error(tmp_path: Path) -> None:
    adapter = Diagnoser()
    diags, jobs, _ = room(tmp_path, adapter)
    reply = await diags.diag(DiagRequest(pci=WHOLE, level=1, op_id="op-before-restart", poll=True))
    assert reply.outcome == "Error"
    assert "knows no diagnostic op-before-restart: it restarted while it ran, so there is no result" in reply.message
    assert adapter.calls == [] and jobs.jobs == {}


async def test_a_card_not_listed_or_an_adapter_without_diagnostics_is_refused(tmp_path: Path) -> None:
    diags, _, _ = room(tmp_path, Diagnoser())
    missing = await diags.diag(DiagRequest(pci=NOT_LISTED, level=1, op_id="op-1"))
    assert (missing.outcome, missing.message) == ("Error", f"the inventory lists no GPU at {NOT_LISTED}")
    none, _, _ = room(tmp_path, object())
    reply = await none.diag(DiagRequest(pci=WHOLE, level=1, op_id="op-1"))
    assert (reply.outcome, reply.message) == ("NotInstalled", "the fakehw adapter runs no diagnostics")


async def test_a_diagnostic_without_an_op_id_is_answered_when_done_with_its_failures_cut(tmp_path: Path) -> None:
    adapter = Diagnoser(DiagResult("Failed", "memory test failed", failures=tuple(f"test {n}" for n in range(80))))
    adapter.gate.set()
    diags, jobs, log = room(tmp_path, adapter)
    reply = await diags.diag(DiagRequest(pci=WHOLE, level=1))
    assert (reply.outcome, reply.level, reply.message) == ("Failed", 1, "memory test failed")
    assert reply.failures == [f"test {n}" for n in range(64)]
    assert jobs.jobs == {}
    assert log.said("diagnostic done")[0][0] == "warning"
