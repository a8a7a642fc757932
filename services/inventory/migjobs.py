"""MIG changes the converger asks for: a whole layout of one card (a job it polls) and one step on one MIG instance (DRA).

`layout` makes one listed card's MIG layout what was asked, as a job
(jobs.py): started by the first request of its op id and answered Running,
polled after; a poll for an id this process does not know (it restarted
while the job ran) is an Error. A mode change that waits for a GPU reset
goes the DisruptionRequired way (Reconfiguring on the card, through the
switch notice the evaluation reads). `instance` runs one step (create a GPU
instance at a placement, its compute instance, destroy them) on a listed
card in MIG mode on its compute driver, answered when done; every refusal
is an answer, never an error. Both run under the card's lock
(`facts.mig_lock`: never two MIG changes at once on one card), and the card
is scanned and published again (`publish`) before the answer goes out, so
the converger's next `get` lists what the change made, or what a failure
left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

from shared.schemas import Inventory, MigInstanceReply, MigInstanceRequest, MigLayoutReply, MigLayoutRequest, SwitchReply
from shared.schemas.common import clip

from .adapters.base import MigInstancer, MigPartitioner, MigStepError
from .facts import InventoryFacts
from .jobs import Job, JobTable, in_daemon_thread

#: scan and publish again: (reason, the switch notice the evaluation takes or None) -> the inventory
Publish = Callable[[str, SwitchReply | None], Awaitable[Inventory]]


def mig_step_missing(req: MigInstanceRequest) -> str:
    """What a MIG instance step needs and the request lacks ("" when nothing)."""
    needs = {"create-gi": ("profile", "start"), "create-ci": ("gi",), "destroy-ci": ("gi", "ci"), "destroy-gi": ("gi",)}[req.step]
    return " and ".join(name for name in needs if getattr(req, name) in (None, ""))


class MigJobs:
    def __init__(self, facts: InventoryFacts, *, jobs: JobTable, publish: Publish, adapter_name: str, log: Any) -> None:
        self.facts = facts
        self.jobs = jobs
        self.publish = publish
        self.adapter_name = adapter_name
        self.log = log

    # ------------------------------------------------------------------ layouts

    async def layout(self, req: MigLayoutRequest) -> MigLayoutReply:
        """Make one listed card's MIG layout this, as a job (like `diag`): started by the first request of
        its op id, polled after. The card is scanned again when it is done; a mode change that waits
        for a GPU reset goes the DisruptionRequired way (Reconfiguring on the card)."""
        layout = (tuple(req.profiles), req.disable)
        job = self.jobs.get(req.op_id)
        if job is not None:
            if job.pci != req.pci or job.args != layout:
                return MigLayoutReply(pci=req.pci, outcome="Error", message=f"MIG layout change {req.op_id} is of another card or layout")
            return job.result or MigLayoutReply(pci=req.pci, outcome="Running", message=f"MIG layout change {req.op_id} runs")
        if req.poll:
            return MigLayoutReply(
                pci=req.pci, outcome="Error", left="unknown",
                message=f"the inventory knows no MIG layout change {req.op_id or '(no id)'}: it restarted while it ran; the card is read again",
            )
        if not self.facts.listed(req.pci):
            return MigLayoutReply(pci=req.pci, outcome="Error", message=f"the inventory lists no GPU at {req.pci}", left="as before")
        if not isinstance(self.facts.adapter, MigPartitioner):
            return MigLayoutReply(pci=req.pci, outcome="NotSupported", message=f"the {self.adapter_name} adapter changes no MIG layout", left="as before")
        job = Job(pci=req.pci, args=layout)
        if req.op_id:
            self.jobs.keep(req.op_id, job)
        job.task = asyncio.create_task(self._run_layout(job), name=f"mig layout {req.op_id}")
        if not req.op_id:
            return await job.task
        return MigLayoutReply(pci=req.pci, outcome="Running", message=f"MIG layout change {req.op_id} started")

    async def _run_layout(self, job: Job) -> MigLayoutReply:
        async with self.facts.mig_lock(job.pci):
            return await self._run_layout_locked(job)

    async def _run_layout_locked(self, job: Job) -> MigLayoutReply:
        profiles, disable = job.args
        adapter = self.facts.adapter
        self.log.info("MIG layout change started", pci=job.pci, profiles=list(profiles), disable=disable)
        result = await in_daemon_thread(lambda: adapter.apply_mig_layout(job.pci, profiles, disable=disable))
        (self.log.info if result.outcome == "Applied" else self.log.warning)(
            "MIG layout change done", pci=job.pci, outcome=result.outcome, detail=result.message, left=result.left
        )
        reply = MigLayoutReply(pci=job.pci, outcome=result.outcome, message=clip(result.message), left=result.left)
        # the card as it is now (new MIG atoms, or what a failure left), before the converger hears the result
        disruption = None
        if result.outcome == "DisruptionRequired":
            current = self.facts.current
            disruption = SwitchReply(
                pci=job.pci, target="mig-layout", outcome="DisruptionRequired", reason="MigModePending",
                message=clip(result.message), boot_id=current.boot_id if current is not None else "", at=datetime.now(timezone.utc),
            )
        try:
            await self.publish("MIG layout changed", disruption)
        except Exception:  # noqa: BLE001 - the periodic scan sees it; the result stands
            self.log.exception("scan after a MIG layout change failed")
        job.result = reply
        return reply

    # ------------------------------------------------------------------ instance steps

    async def instance(self, req: MigInstanceRequest) -> MigInstanceReply:
        """One MIG instance step on one listed card in MIG mode (DRA; the converger journaled it before asking).

        Answered when done, after the card was scanned and the inventory published again: the
        converger's next `get` lists what the step made (or what a failure left). Every refusal is
        an answer (outcome refused / not-supported), never an error.
        """
        log = self.log

        def answer(outcome: str, message: str, *, gi: int | None = req.gi, ci: int | None = req.ci, uuid: str = "") -> MigInstanceReply:
            (log.info if outcome == "done" else log.warning)(
                "MIG instance step answered", step=req.step, pci=req.pci, owner=req.owner, outcome=outcome, gi=gi, ci=ci, uuid=uuid, detail=message
            )
            return MigInstanceReply(pci=req.pci, step=req.step, outcome=outcome, message=clip(message), gi=gi, ci=ci, uuid=uuid)

        if not isinstance(self.facts.adapter, MigInstancer):
            return answer("not-supported", f"the {self.adapter_name} adapter makes no MIG instances")
        card = self.facts.card(req.pci)
        if card is None:
            return answer("refused", f"the inventory lists no GPU at {req.pci}")
        if not card.mig_mode:
            return answer("refused", f"{req.pci} is not in MIG mode")
        if card.status.driver_binding.mode != "Compute":
            return answer("refused", f"{req.pci} is not on its compute driver ({card.driver or 'no driver'})")
        missing = mig_step_missing(req)
        if missing:
            return answer("refused", f"{req.step} needs {missing}")
        log.info("MIG instance step started", step=req.step, pci=req.pci, owner=req.owner, profile=req.profile, start=req.start, gi=req.gi, ci=req.ci)
        async with self.facts.mig_lock(req.pci):
            reply = await self._step(req, answer)
            # the card as the step left it, published before the converger hears the result
            try:
                await self.publish(f"MIG {req.step}", None)
            except Exception:  # noqa: BLE001 - the periodic scan sees it; the result stands
                log.exception("scan after a MIG instance step failed", step=req.step, pci=req.pci)
        return reply

    async def _step(self, req: MigInstanceRequest, answer: Any) -> MigInstanceReply:
        adapter, pci = self.facts.adapter, req.pci
        try:
            if req.step == "create-gi":
                start = req.start
                gi = await in_daemon_thread(adapter.create_gpu_instance, pci, req.profile, start)
                return answer("done", f"GPU instance {gi} ({req.profile} at {start}) made on {pci}", gi=gi, ci=None)
            if req.step == "create-ci":
                made = await in_daemon_thread(adapter.create_compute_instance, pci, req.gi)
                return answer("done", f"compute instance {made.ci} of GPU instance {made.gi} made on {pci}", gi=made.gi, ci=made.ci, uuid=made.uuid)
            if req.step == "destroy-ci":
                await in_daemon_thread(adapter.destroy_compute_instance, pci, req.gi, req.ci)
                return answer("done", f"compute instance {req.ci} of GPU instance {req.gi} destroyed on {pci}")
            await in_daemon_thread(adapter.destroy_gpu_instance, pci, req.gi)
            return answer("done", f"GPU instance {req.gi} destroyed on {pci}")
        except MigStepError as exc:
            return answer(exc.outcome, str(exc))
        except Exception as exc:  # noqa: BLE001 - an adapter bug answers failed; the service stays up
            self.log.exception("MIG instance step raised", step=req.step, pci=pci)
            return answer("failed", f"{req.step} on {pci} failed: {exc or type(exc).__name__}")


__all__ = ["MigJobs", "mig_step_missing"]
