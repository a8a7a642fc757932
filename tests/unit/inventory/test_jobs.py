"""jobs.py alone: the op table keeps finished jobs for their polls (never drops one still running),
a stop cancels what runs, and a vendor call in a daemon thread answers its value or its error."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.inventory.jobs import Job, JobTable, in_daemon_thread


def done(pci: str) -> Job:
    return Job(pci=pci, args=1, result="finished")


def test_the_table_drops_the_oldest_finished_jobs_beyond_what_it_keeps() -> None:
    table = JobTable(kept=2)
    for n in range(3):
        table.keep(f"op-{n}", done(f"card-{n}"))
    assert list(table.jobs) == ["op-1", "op-2"]
    assert table.get("op-0") is None and table.get("op-2").pci == "card-2"  # type: ignore[union-attr]
    assert table.get("") is None  # a request without an op id names no job


def test_a_running_job_is_never_dropped_for_room() -> None:
    table = JobTable(kept=2)
    table.keep("running", Job(pci="a", args=1))
    table.keep("op-1", done("b"))
    table.keep("op-2", done("c"))
    # the oldest is still running: the table grows rather than lose a job the converger polls
    assert list(table.jobs) == ["running", "op-1", "op-2"]


async def test_close_cancels_the_jobs_still_running_and_leaves_finished_ones() -> None:
    table = JobTable()
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    job = Job(pci="a", args=1)
    job.task = asyncio.create_task(forever())
    table.keep("op-1", job)
    table.keep("op-2", done("b"))
    await started.wait()
    await asyncio.wait_for(table.close(), 2.0)
    assert job.task.cancelled()
    assert table.get("op-2").result == "finished"  # type: ignore[union-attr]


async def test_a_call_in_a_daemon_thread_answers_its_value_or_raises_its_error() -> None:
    seen: list[tuple[str, bool]] = []

    def work(x: int) -> int:
        seen.append((threading.current_thread().name, threading.current_thread().daemon))
        return x * 2

    assert await in_daemon_thread(work, 21) == 42
    assert seen == [("bcd-diagnostic", True)]

    def broken() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await in_daemon_thread(broken)
