"""Runs the MIG re-layout its Kubernetes Node asks for, by the rules of relayout.py.

A loop of its own (the Node's labels change without a pass): every IDLE_INTERVAL_S (BUSY_INTERVAL_S
while a job runs) it reads the Node through kube_reaper, then, under the pass lock, either starts a
job (journaled before anything is done) or moves the running one one step on. Every step is safe to
run again after a crash: the Node change carries the resourceVersion it was computed from (a lost
race is read again), an eviction is asked again, a card's layout is a desired-layout record the
maintenance room applies (and finishes as Interrupted and starts again after a restart). A node
whose kube_reaper has no Node API (or none at all) runs no job; status says so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Protocol

import nats.errors
from nats.aio.client import Client

from shared import logs
from shared.runtime import ServiceCallError, call
from shared.schemas import (
    EVICT_REPLY_CODEC,
    HELD_REPLY_CODEC,
    NODE_REPLY_CODEC,
    BadMessage,
    DevicesQuery,
    NodeChange,
    NodeRead,
    NodeReply,
    NodeView,
    RelayoutStatus,
)
from shared.schemas.bus import MIG_ALL_DISABLED
from shared.schemas.common import clip
from shared.schemas.kubenode import MIG_CONFIG_LABEL, MIG_STATE_LABEL
from shared.subjects import NodeSubjects

from . import gpuops, relayout
from .cardclaims import CardClaims
from .facts import NodeFacts
from .intake import InventoryIntake
from .metrics import ConvergerMetrics
from .model import MigLayoutRecord, RelayoutJob

#: one request to kube_reaper (it makes one API request of at most 10 s)
NODE_TIMEOUT_S = 15.0
#: the "allocation" kube_reaper watches for the drain
DRAIN_ID = "mig-relayout"
#: drain rounds (BUSY_INTERVAL_S each) between two eviction requests while the cards stay held
EVICT_AGAIN_ROUNDS = 3
#: how a drain answer says kube_reaper was not reached
UNANSWERED = "kube_reaper did not answer"


class NodePort(Protocol):
    async def read(self) -> NodeReply: ...

    async def change(self, req: NodeChange) -> NodeReply: ...

    async def drain(self, allocation_id: str, devices: list[str], *, evict: bool) -> tuple[bool, list[str], str]:
        """(still held, holders, detail) of these devices; first asks kube_reaper to evict their pods when `evict`."""
        ...

    async def stop_drain(self, allocation_id: str) -> None:
        """kube_reaper stops evicting for this drain (a failed job must not evict a pod later, when a budget allows)."""
        ...


class BusNode:
    """kube_reaper's `node`, `evict` and `held` endpoints."""

    def __init__(self, nc: Client, subjects: NodeSubjects) -> None:
        self.nc, self.subjects = nc, subjects

    async def _node(self, req: NodeRead | NodeChange) -> NodeReply:
        try:
            return await call(self.nc, self.subjects.reaper_node, req, NODE_REPLY_CODEC, timeout=NODE_TIMEOUT_S)
        except (ServiceCallError, nats.errors.Error, TimeoutError, BadMessage) as exc:
            return NodeReply(ok=False, reachable=False, detail=f"kube_reaper did not answer: {type(exc).__name__}: {exc}".rstrip(": "))

    async def read(self) -> NodeReply:
        return await self._node(NodeRead())

    async def change(self, req: NodeChange) -> NodeReply:
        return await self._node(req)

    async def drain(self, allocation_id: str, devices: list[str], *, evict: bool) -> tuple[bool, list[str], str]:
        query = DevicesQuery(allocation_id=allocation_id, devices=devices)
        try:
            if evict:
                await call(self.nc, self.subjects.reaper_evict, query, EVICT_REPLY_CODEC, timeout=NODE_TIMEOUT_S)
            reply = await call(self.nc, self.subjects.reaper_held, query, HELD_REPLY_CODEC, timeout=NODE_TIMEOUT_S)
        except (ServiceCallError, nats.errors.Error, TimeoutError, BadMessage) as exc:
            return True, [], f"{UNANSWERED}: {type(exc).__name__}"
        return reply.held or not reply.reachable, list(reply.holders), reply.detail

    async def stop_drain(self, allocation_id: str) -> None:
        # the watch replaced by one of no devices: free at once, and the evictions nobody wants are cancelled
        with contextlib.suppress(ServiceCallError, nats.errors.Error, TimeoutError, BadMessage):
            await call(self.nc, self.subjects.reaper_evict, DevicesQuery(allocation_id=allocation_id, devices=[]), EVICT_REPLY_CODEC, timeout=NODE_TIMEOUT_S)


class RelayoutRunner:
    def __init__(
        self,
        facts: NodeFacts,
        *,
        intake: InventoryIntake,
        claims: CardClaims,
        node: NodePort,
        metrics: ConvergerMetrics,
        trigger: Callable[[str], None],
        log: logs.StructLogger,
        drain_timeout: float = relayout.DRAIN_TIMEOUT_S,
        idle_interval: float = relayout.IDLE_INTERVAL_S,
        busy_interval: float = relayout.BUSY_INTERVAL_S,
        crash: Callable[[str], None] = lambda point: None,
    ) -> None:
        self.facts = facts
        self.intake = intake
        self.claims = claims
        self.node = node
        self.metrics = metrics
        self.trigger = trigger
        self.log = log
        self.drain_timeout = drain_timeout
        self.idle_interval = idle_interval
        self.busy_interval = busy_interval
        #: crash points (crash.py RELAYOUT_POINTS): a test kills the process there
        self.crash = crash
        self.view: NodeView | None = None
        self.read_at: datetime | None = None
        self.read_error = ""
        self.disabled = False
        self.note = ""
        self._noted = ""
        #: drain rounds the cards stayed held since kube_reaper was last asked to evict (None: never asked by this process)
        self._held_rounds: int | None = None

    # ------------------------------------------------------------------ the loop

    async def run(self, stopping: asyncio.Event) -> None:
        self.metrics.relayout_gauges(self.facts.state.relayout)
        while not stopping.is_set():
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next round looks again; the job is in the journal
                self.log.exception("MIG re-layout step failed")
            busy = self.facts.state.relayout is not None
            delay = self.busy_interval if busy else self.idle_interval * (12 if self.disabled else 1)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=delay)

    async def step(self) -> None:
        """Read the Node; start a job or move the running one on."""
        reply = await self.node.read()
        now = datetime.now(timezone.utc)
        self.disabled = reply.disabled
        if not reply.ok or reply.node is None:
            # the last view stays what status shows, beside why it is not read now
            self.read_error = reply.detail or "the Node could not be read"
            return
        self.view, self.read_at, self.read_error = reply.node, now, ""
        state = self.facts.state
        async with self.facts.lock:
            asked = reply.node.labels.get(MIG_CONFIG_LABEL, "")
            if asked != state.relayout_label:
                state.relayout_label = asked
                await self._save()
            job = state.relayout
            if job is None:
                await self._maybe_start(reply.node, now)
                job = state.relayout
                if job is None:
                    return
            await self._advance(job, reply.node, now)
        self.metrics.relayout_gauges(state.relayout)

    # ------------------------------------------------------------------ starting

    async def _maybe_start(self, node: NodeView, now: datetime) -> None:
        inv = self.intake.inventory
        if inv is None:
            await self.intake.fetch(wake=False)
            inv = self.intake.inventory
        if inv is None:
            return
        state = self.facts.state
        claims = await asyncio.to_thread(self.claims.read, inv)
        decision = relayout.plan_start(node, inv.gpus, claims, state.relayout_last, now=now, busy=gpuops.maintenance_claims(state.gpu_ops))
        if isinstance(decision, relayout.Idle):
            self.note = decision.note
            if decision.note and decision.note != self._noted:
                self.log.info("MIG re-layout not started", detail=decision.note)
            self._noted = decision.note
            return
        self.note = ""
        job = decision.job
        # the Node label owns these cards from now: an operator's earlier `bcd gpu mig-layout` gives way
        for pci in job.cards:
            if pci in state.mig_layouts and job.step != "finishing":
                del state.mig_layouts[pci]
        state.relayout = job
        self._held_rounds = None
        # recorded first: a crash from here on resumes this job and undoes what it did
        await asyncio.to_thread(self.facts.store.save, state)
        self.crash("relayout.journaled")
        self.log.info("MIG re-layout started", config=job.config, step=job.step, cards=sorted(job.cards), detail=job.message)
        self.trigger("MIG re-layout claims cards")

    # ------------------------------------------------------------------ the steps

    async def _advance(self, job: RelayoutJob, node: NodeView, now: datetime) -> None:
        if job.step == "pausing":
            reply = await self.node.change(relayout.pause_change(job, node))
            if reply.ok:
                self.crash("relayout.paused")
                self._to(job, "draining", now, f"re-layout to {job.config}: draining the pods that use {', '.join(sorted(job.cards))}")
                await self._save()
            else:
                self._refused(reply, "pausing")
            return
        if job.step == "draining":
            await self._drain(job, node, now)
            return
        if job.step == "applying":
            await self._apply(job, node, now)
            return
        if job.step == "finishing":
            await self._finish(job, node, now)

    async def _drain(self, job: RelayoutJob, node: NodeView, now: datetime) -> None:
        inv = self.intake.inventory
        gpus = {g.pci_address: g for g in inv.gpus} if inv is not None else {}
        missing = sorted(p for p in job.cards if p not in gpus)
        if missing:
            # no inventory yet (a converger just restarted), or a card it does not list now: which
            # pods use the cards cannot be asked, and nothing asked about is no drain
            self.log.info("MIG re-layout waits for the inventory to list its cards before the drain", cards=missing)
            if (now - job.step_since).total_seconds() > self.drain_timeout:
                self._fail_drain(job, now, f"the inventory does not list {', '.join(missing)}")
                await self._save()
            return
        atoms = relayout.card_atoms(gpus, job.cards)
        # kube_reaper keeps its eviction retries in memory: asked at once after our own start, and
        # again every few rounds while the cards are held (it may have restarted, or not heard us)
        ask = self._held_rounds is None or self._held_rounds >= EVICT_AGAIN_ROUNDS
        held, holders, detail = await self.node.drain(DRAIN_ID, atoms, evict=ask)
        if ask:
            # not heard: asked again at the next round
            self._held_rounds = EVICT_AGAIN_ROUNDS if detail.startswith(UNANSWERED) else 0
        else:
            self._held_rounds = (self._held_rounds or 0) + 1
        if not all(c.evicted for c in job.cards.values()):
            for c in job.cards.values():
                c.evicted, c.step = True, "draining"
            await self._save()
        if not held:
            self._held_rounds = None
            self.crash("relayout.drained")
            self._to(job, "applying", now, f"re-layout to {job.config}: applying")
            await self._save()
            self.trigger("MIG re-layout applies")
            return
        waited = (now - job.step_since).total_seconds()
        if waited > self.drain_timeout:
            self._fail_drain(job, now, "still using the cards: " + (", ".join(holders) or detail or "the holders could not be established"))
            await self._save()
            return
        change = relayout.state_change(node, "pending", job.message)
        if change is not None:
            reply = await self.node.change(change)
            if not reply.ok:
                self._refused(reply, "draining")

    async def _apply(self, job: RelayoutJob, node: NodeView, now: datetime) -> None:
        state = self.facts.state
        inv = self.intake.inventory
        gpus = {g.pci_address: g for g in inv.gpus} if inv is not None else {}
        disable = job.config == MIG_ALL_DISABLED
        changed = False
        for pci, card in sorted(job.cards.items()):
            move = relayout.plan_card(card, gpus.get(pci), state.mig_layouts.get(pci), boot_id=state.boot_id, disable=disable)
            if move.set_layout:
                state.mig_layouts[pci] = MigLayoutRecord(layout=move.set_layout, source="node-label", since=now)
            if move.rolling_back is not None:
                card.rolling_back = move.rolling_back
            if move.retried is not None:
                card.retried = move.retried
            if move.step is not None:
                card.step, card.outcome = move.step, move.outcome
                card.message = move.message
                self.log.info("MIG re-layout card", pci=pci, step=card.step, outcome=card.outcome, detail=card.message)
            changed = changed or bool(move.set_layout) or move.step is not None
        if all(c.step == "done" for c in job.cards.values()):
            result = relayout.overall(job)
            job.outcome = result.outcome
            self._to(job, "finishing", now, result.message)
            changed = True
        if changed:
            await self._save()
            if any(c.step == "applying" for c in job.cards.values()):
                self.crash("relayout.applying")
            self.trigger("MIG re-layout applies")
        if job.step == "applying":
            rebooting = any(c.step == "rebooting" for c in job.cards.values())
            message = f"re-layout to {job.config}: " + (
                "a card waits for a node reboot to change its MIG mode" if rebooting else "applying"
            )
            job.message = message
            change = relayout.state_change(node, "rebooting" if rebooting else "pending", message)
            if change is not None:
                reply = await self.node.change(change)
                if not reply.ok:
                    self._refused(reply, "applying")

    async def _finish(self, job: RelayoutJob, node: NodeView, now: datetime) -> None:
        if job.outcome != "success" and any(c.evicted for c in job.cards.values()):
            await self.node.stop_drain(DRAIN_ID)
        reply = await self.node.change(relayout.finish_change(job, node))
        if not reply.ok:
            self._refused(reply, "finishing")
            return
        self.crash("relayout.finished")
        state = self.facts.state
        job.step, job.step_since = "done", now
        state.relayout, state.relayout_last = None, job
        await self._save()
        self.metrics.relayouts.labels(outcome=job.outcome or "failed").inc()
        (self.log.info if job.outcome == "success" else self.log.warning)(
            "MIG re-layout done", config=job.config, outcome=job.outcome, detail=job.message
        )
        self.trigger("MIG re-layout done: the cards are free")

    # ------------------------------------------------------------------ helpers

    def _fail_drain(self, job: RelayoutJob, now: datetime, why: str) -> None:
        job.outcome = "failed"
        for c in job.cards.values():
            c.step, c.outcome, c.message = "done", "failed", "not changed: the drain did not finish"
        self._to(job, "finishing", now, f"{job.config} not applied: the drain did not finish in {self.drain_timeout:.0f} s; {why}")

    def _to(self, job: RelayoutJob, step: str, now: datetime, message: str) -> None:
        self.log.info("MIG re-layout step", config=job.config, step=step, detail=message)
        job.step, job.step_since, job.message = step, now, clip(message)

    def _refused(self, reply: NodeReply, step: str) -> None:
        what = "lost a race with another writer (read again)" if reply.conflict else reply.detail
        self.log.warning("MIG re-layout: the Node change did not go through; tried again", step=step, detail=what)

    async def _save(self) -> None:
        await asyncio.to_thread(self.facts.store.save, self.facts.state)

    def status(self) -> RelayoutStatus | None:
        state = self.facts.state
        # a node whose kube_reaper has no Node API (or that never answered): nothing to say
        if (self.disabled or self.read_at is None) and state.relayout is None and state.relayout_last is None:
            return None
        labels = self.view.labels if self.view is not None else {}
        return RelayoutStatus(
            desired=labels.get(MIG_CONFIG_LABEL, ""),
            state_label=labels.get(MIG_STATE_LABEL, ""),
            read_at=self.read_at,
            read_error=clip(self.read_error),
            running=relayout.job_state(state.relayout) if state.relayout is not None else None,
            last=relayout.job_state(state.relayout_last) if state.relayout_last is not None else None,
            note=clip(self.note),
        )


__all__ = ["BusNode", "NodePort", "RelayoutRunner"]
