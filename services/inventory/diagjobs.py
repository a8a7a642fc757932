"""The vendor's diagnostic on one listed card (`diag`, the converger's `bcd gpu diag`), as a job it polls.

Started by the first request of its op id (answered Running at once), its
result answered to a poll (jobs.py). A poll for an id this process does not
know (it restarted meanwhile) is an Error, so the converger never waits for
a run that died with an earlier inventory. A request without an op id is
answered when the diagnostic is done. The run is bounded by DIAG_RUN_S of
its level and goes on in a daemon thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from shared.schemas import DiagReply, DiagRequest
from shared.schemas.bus import DIAG_RUN_S
from shared.schemas.common import clip

from .adapters.base import Diagnosable
from .facts import InventoryFacts
from .jobs import Job, JobTable, in_daemon_thread


class DiagJobs:
    def __init__(self, facts: InventoryFacts, *, jobs: JobTable, adapter_name: str, log: Any) -> None:
        self.facts = facts
        self.jobs = jobs
        self.adapter_name = adapter_name
        self.log = log

    async def diag(self, req: DiagRequest) -> DiagReply:
        """The vendor's diagnostic on one listed card, as a job: started by the first request of its
        op id (answered Running at once), its result answered to a poll. A poll for an id this
        process does not know (it restarted meanwhile) is an Error, so the converger never waits
        for a run that died with an earlier inventory."""
        job = self.jobs.get(req.op_id)
        if job is not None:
            if job.pci != req.pci or job.args != req.level:
                return DiagReply(pci=req.pci, level=req.level, outcome="Error", message=f"diagnostic {req.op_id} is of another card or level")
            return job.result or DiagReply(pci=req.pci, level=req.level, outcome="Running", message=f"diagnostic {req.op_id} runs")
        if req.poll:
            return DiagReply(
                pci=req.pci, level=req.level, outcome="Error",
                message=f"the inventory knows no diagnostic {req.op_id or '(no id)'}: it restarted while it ran, so there is no result",
            )
        if not self.facts.listed(req.pci):
            return DiagReply(pci=req.pci, level=req.level, outcome="Error", message=f"the inventory lists no GPU at {req.pci}")
        if not isinstance(self.facts.adapter, Diagnosable):
            return DiagReply(pci=req.pci, level=req.level, outcome="NotInstalled", message=f"the {self.adapter_name} adapter runs no diagnostics")
        job = Job(pci=req.pci, args=req.level)
        if not req.op_id:
            # no id to poll with: answered when done
            return await self._run(job)
        self.jobs.keep(req.op_id, job)
        job.task = asyncio.create_task(self._run(job), name=f"diag {req.op_id}")
        return DiagReply(pci=req.pci, level=req.level, outcome="Running", message=f"diagnostic {req.op_id} started")

    async def _run(self, job: Job) -> DiagReply:
        level, log = job.args, self.log
        log.info("diagnostic started", pci=job.pci, level=level)
        result = await in_daemon_thread(self.facts.adapter.run_diag, job.pci, level, DIAG_RUN_S.get(level, 3600.0))
        (log.info if result.outcome == "Passed" else log.warning)(
            "diagnostic done", pci=job.pci, level=level, outcome=result.outcome, detail=result.message, failures=list(result.failures)
        )
        job.result = DiagReply(
            pci=job.pci, level=level, outcome=result.outcome, message=clip(result.message), failures=[clip(f) for f in result.failures[:64]]
        )
        return job.result


__all__ = ["DiagJobs"]
