"""Runs the maintenance operations on one card (`bcd gpu reset`, `diag`, `mig-layout`) whose rules are gpuops.py.

`gpu_op` (the endpoint) checks a request and, under the pass lock, that
nothing holds the card, journals the operation (the card is claimed by it
from then on) and starts it in the background; a desired MIG layout is only
journaled, and `mig_step` (after each pass) starts it once the card is free.
The work is asked of the process that can do it (the switcher's reset, the
inventory's diagnostic and MIG layout jobs, polled until they end); its
answer is the outcome, journaled under the lock, counted, and a pass is
woken (holds and switches that waited for the card go). `close` cancels
what runs: the journal still says running and the next start finishes it as
Interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client

from shared import logs
from shared.runtime import ServiceCallError, call
from shared.schemas import (
    DIAG_REPLY_CODEC,
    MIG_LAYOUT_REPLY_CODEC,
    SWITCH_REPLY_CODEC,
    DiagRequest,
    GpuOp,
    GpuOpReply,
    GpuOpRequest,
    Inventory,
    MigLayoutRequest,
    SwitchRequest,
)
from shared.schemas.common import clip
from shared.subjects import NodeSubjects

from . import gpuops, relayout
from .cardclaims import CardClaims
from .facts import NodeFacts
from .intake import InventoryIntake
from .metrics import ConvergerMetrics
from .model import MigLayoutRecord


class JobTimeout(Exception):
    """An inventory job (diagnostic, MIG layout change) did not end in time; the text says which."""


class Maintenance:
    def __init__(
        self,
        facts: NodeFacts,
        *,
        intake: InventoryIntake,
        claims: CardClaims,
        metrics: ConvergerMetrics,
        trigger: Callable[[str], None],
        nc: Client,
        subjects: NodeSubjects,
        log: logs.StructLogger,
    ) -> None:
        self.facts = facts
        self.intake = intake
        self.claims = claims
        self.metrics = metrics
        self.trigger = trigger
        self.nc = nc
        self.subjects = subjects
        self.log = log
        #: operations in flight (their results come back through the journal)
        self.tasks: set[asyncio.Task[None]] = set()

    async def gpu_op(self, req: GpuOpRequest) -> GpuOpReply:
        """Start a reset or a diagnostic on one card: checked and journaled under the pass lock, run after."""
        problem = gpuops.check_request(req)
        if problem:
            return GpuOpReply(accepted=False, message=problem)
        state = self.facts.state
        async with self.facts.lock:
            inv = self.intake.inventory
            if inv is None:
                await self.intake.fetch(wake=False)
                inv = self.intake.inventory
            if inv is None:
                return GpuOpReply(accepted=False, message=f"no inventory yet, so whether anything holds it is not known")
            relaid = relayout.claimed_cards(state.relayout).get(req.pci)
            if relaid:
                self.metrics.gpu_ops.labels(op=req.op, outcome="Refused").inc()
                return GpuOpReply(accepted=False, message=f"{req.pci} is claimed by {relaid} until it ends (bcd status shows its step)")
            if req.op == "mig-layout":
                return await self._set_mig_layout(req, inv)
            claims = await asyncio.to_thread(self.claims.read, inv)
            problem = gpuops.refusal(req, (g.pci_address for g in inv.gpus), claims, state.gpu_ops)
            if problem:
                self.log.info("maintenance operation refused", op=req.op, pci=req.pci, level=req.level, reason=problem)
                self.metrics.gpu_ops.labels(op=req.op, outcome="Refused").inc()
                return GpuOpReply(accepted=False, message=problem)
            op = gpuops.new_op(req, now=datetime.now(timezone.utc), boot_id=state.boot_id)
            # recorded first: from here the card is claimed, and a crash finishes it as Interrupted
            state.gpu_ops[req.pci] = op
            await asyncio.to_thread(self.facts.store.save, state)
        self._start(op)
        return GpuOpReply(accepted=True, message=f"{op.op} of {op.pci} started ({op.id})", op=op)

    async def _set_mig_layout(self, req: GpuOpRequest, inv: Inventory) -> GpuOpReply:
        """`bcd gpu mig-layout`: the card's desired layout, journaled; a pass applies it once nothing holds the card."""
        gpu = next((g for g in inv.gpus if g.pci_address == req.pci), None)
        if gpu is None:
            return GpuOpReply(accepted=False, message=f"the inventory lists no GPU at that address")
        label = self.facts.state.relayout_label
        if label and gpu.mig_profiles:
            # two owners of one layout would undo each other, and the Node would say what is not so
            return GpuOpReply(
                accepted=False,
                message=f"this node's MIG layouts are its Kubernetes Node's label nvidia.com/mig.config={label}: change or remove the label instead (docs/mig-relayout.md)",
            )
        profiles, disable = gpuops.parse_layout(req.layout)
        problem = gpuops.layout_problem(gpu, profiles, disable)
        if problem:
            return GpuOpReply(accepted=False, message=f"{problem}")
        layout = gpuops.layout_text(profiles, disable)
        state = self.facts.state
        state.mig_layouts[req.pci] = MigLayoutRecord(layout=layout, source="operator", since=datetime.now(timezone.utc))
        await asyncio.to_thread(self.facts.store.save, state)
        self.log.info("MIG layout set", pci=req.pci, layout=layout)
        self.trigger(f"MIG layout of {req.pci} set")
        return GpuOpReply(accepted=True, message=f"MIG layout of {req.pci} set to {layout}: applied once nothing holds the card")

    async def mig_step(self) -> None:
        """After a pass: where every desired MIG layout stands; a free card's layout is started."""
        state = self.facts.state
        if not state.mig_layouts or self.intake.inventory is None:
            return
        async with self.facts.lock:
            inv = self.intake.inventory
            claims = await asyncio.to_thread(self.claims.read, inv)
            plan = gpuops.plan_mig_layouts(
                state.mig_layouts, {g.pci_address: g for g in inv.gpus}, claims, state.gpu_ops, boot_id=state.boot_id
            )
            now = datetime.now(timezone.utc)
            changed, started = False, []
            for pci, (st, message) in plan.items():
                rec = state.mig_layouts[pci]
                if st == "start":
                    op = gpuops.new_op(GpuOpRequest(op="mig-layout", pci=pci, layout=rec.layout), now=now, boot_id=state.boot_id)
                    state.gpu_ops[pci] = op
                    st, message = "Applying", f"{op.id} runs"
                    started.append(op)
                if (st, message) != (rec.state, rec.message):
                    if st != rec.state:
                        rec.since = now
                        self.log.info("MIG layout", pci=pci, layout=rec.layout, state=st, detail=message)
                    rec.state, rec.message = st, message
                    changed = True
            if changed or started:
                await asyncio.to_thread(self.facts.store.save, state)
        for op in started:
            self._start(op)

    def _start(self, op: GpuOp) -> None:
        """Run a journaled operation in the background (its result comes back through the journal)."""
        self.metrics.gpu_ops_running.labels(op=op.op).inc()
        self.log.info("maintenance operation started", op=op.op, id=op.id, pci=op.pci, level=op.level, layout=op.layout, claims_card=op.claims_card)
        task = asyncio.create_task(self._run(op), name=f"gpu op {op.id}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, op: GpuOp) -> None:
        try:
            if op.op == "reset":
                reply = await call(
                    self.nc, self.subjects.vfio_switch, SwitchRequest(pci=op.pci, target="reset", why=f"bcd gpu reset ({op.id})"),
                    SWITCH_REPLY_CODEC, timeout=gpuops.RESET_TIMEOUT_S,
                )
                outcome, message = reply.outcome, reply.message
            elif op.op == "mig-layout":
                mig = await self._mig(op)
                outcome = mig.outcome
                message = mig.message + (f"; the card was left {mig.left}" if mig.left and outcome != "Applied" else "")
            else:
                answer = await self._diag(op)
                outcome = answer.outcome
                message = answer.message + (f" (failed: {', '.join(answer.failures)})" if answer.failures else "")
        except asyncio.CancelledError:
            raise  # stopping: the journal still says running; the next start finishes it as Interrupted
        except Exception as exc:  # noqa: BLE001 - the answer did not come: that is the outcome
            who = "vfio_switcher" if op.op == "reset" else "the inventory"
            outcome = "Failed" if op.op == "reset" else "Error"
            message = str(exc) if isinstance(exc, JobTimeout) else f"{who} did not answer: {type(exc).__name__}: {exc}".rstrip(": ")
        done = gpuops.finished(op, outcome, clip(message), now=datetime.now(timezone.utc))
        state = self.facts.state
        async with self.facts.lock:
            if state.gpu_ops.get(op.pci) == op:
                del state.gpu_ops[op.pci]
            state.gpu_op_results[gpuops.result_key(done)] = done
            rec = state.mig_layouts.get(op.pci) if op.op == "mig-layout" else None
            if rec is not None and rec.layout == op.layout:
                rec.since = done.finished_at or rec.since
                if outcome == "Applied":
                    rec.state, rec.message = "Applied", message
                elif outcome == "DisruptionRequired":
                    # the existing disruption path says what to do (Reconfiguring on the card); not again in this boot
                    rec.state, rec.blocked_boot = "Pending", state.boot_id
                    rec.message = f"{message}: waits for a GPU reset or a node reboot (Reconfiguring=DisruptionRequired)"
                else:
                    rec.state, rec.message = "Failed", message
            await asyncio.to_thread(self.facts.store.save, state)
        self.metrics.gpu_ops_running.labels(op=op.op).dec()
        self.metrics.count_op(done)
        (self.log.info if outcome in gpuops.OK_OUTCOMES else self.log.warning)(
            "maintenance operation done", op=op.op, id=op.id, pci=op.pci, level=op.level, outcome=outcome, detail=message
        )
        # the card is free again: holds and switches that waited for it go now
        self.trigger(f"{op.op} of {op.pci} done")

    async def _job(self, subject: str, req: Any, codec: Any, timeout: float, what: str) -> Any:
        """Start an inventory job (a diagnostic, a MIG layout change), then poll it until it ends: an
        inventory that restarts meanwhile answers that it knows no such job. Unanswered polls are
        retried until `timeout`; then JobTimeout, whose text is the operation's message."""
        deadline = time.monotonic() + timeout
        answer = await call(self.nc, subject, req, codec, timeout=gpuops.POLL_TIMEOUT_S)
        poll = msgspec.structs.replace(req, poll=True)
        unanswered = ""
        while answer.outcome == "Running":
            if time.monotonic() > deadline:
                raise JobTimeout(f"the {what} did not end in {timeout:.0f} s" + unanswered)
            await asyncio.sleep(gpuops.POLL_INTERVAL_S)
            try:
                answer = await call(self.nc, subject, poll, codec, timeout=gpuops.POLL_TIMEOUT_S)
                unanswered = ""
            except (nats.errors.Error, TimeoutError, ServiceCallError) as exc:
                unanswered = f"; the inventory did not answer the last poll ({type(exc).__name__})"
        return answer

    async def _mig(self, op: GpuOp) -> Any:
        profiles, disable = gpuops.parse_layout(op.layout)
        req = MigLayoutRequest(pci=op.pci, profiles=list(profiles), disable=disable, op_id=op.id)
        return await self._job(self.subjects.inventory_mig_layout, req, MIG_LAYOUT_REPLY_CODEC, gpuops.MIG_TIMEOUT_S, "MIG layout change")

    async def _diag(self, op: GpuOp) -> Any:
        req = DiagRequest(pci=op.pci, level=op.level, op_id=op.id)
        timeout = gpuops.DIAG_TIMEOUT_S.get(op.level, 3600.0)
        return await self._job(self.subjects.inventory_diag, req, DIAG_REPLY_CODEC, timeout, f"level {op.level} diagnostic")

    async def close(self) -> None:
        """Stopping: an operation cut short stays "running" in the journal; the next start says Interrupted."""
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


__all__ = ["JobTimeout", "Maintenance"]
