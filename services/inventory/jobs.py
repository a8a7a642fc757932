"""The jobs the converger polls by op id (a diagnostic, a MIG layout change), and the threads the inventory's long steps run in.

A job is started by the first request of its op id and answered Running;
each poll for the same id answers its result once there is one. The table
keeps JOBS_KEPT finished ones for their polls (the oldest go first); one
still running is never dropped. A stop cancels what runs and does not wait
for the vendor's call under it: that runs in a daemon thread
(`in_daemon_thread`), so a diagnostic of an hour never holds a stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from typing import Any

#: finished jobs (diagnostics, MIG layout changes) kept for the converger's polls.
JOBS_KEPT = 64


@dataclasses.dataclass
class Job:
    """A diagnostic or a MIG layout change the converger polls by its op id."""

    pci: str
    #: what was asked (the level, or (profiles, disable)): a poll for other arguments is an error
    args: Any
    result: Any = None
    task: asyncio.Task[Any] | None = None


class JobTable:
    """op id -> a diagnostic or MIG layout change started or done (the converger polls it)."""

    def __init__(self, kept: int = JOBS_KEPT) -> None:
        self.kept = kept
        self.jobs: dict[str, Job] = {}

    def get(self, op_id: str) -> Job | None:
        """The job of `op_id` ("" names none)."""
        return self.jobs.get(op_id) if op_id else None

    def keep(self, op_id: str, job: Job) -> None:
        """Keep a job for its polls; the oldest finished ones go beyond `kept`."""
        self.jobs[op_id] = job
        while len(self.jobs) > self.kept:
            oldest = next(iter(self.jobs))
            if self.jobs[oldest].result is None:
                break
            del self.jobs[oldest]

    async def close(self) -> None:
        """Cancel every job still running. Its vendor call is not waited for (a daemon thread); the
        converger's next poll finds no such job and ends the operation as an Error."""
        running = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def in_daemon_thread(fn: Any, *args: Any) -> Any:
    """fn(*args) in a daemon thread: a stop of the service never waits for it (a diagnostic can take an hour)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def worker() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            value, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=worker, name="bcd-diagnostic", daemon=True).start()
    return await done


__all__ = ["JOBS_KEPT", "Job", "JobTable", "in_daemon_thread"]
