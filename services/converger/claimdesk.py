"""The DRA claim endpoints' work around the ClaimKeeper: the pass lock, the metrics, the publication.

claims.py decides a claim and makes (or removes) its hold. This desk runs
each `claim_prepare` / `claim_unprepare` under the pass lock (no pass or
maintenance check in between), first looks once per start at the claims the
last stop cut short (`reconcile`, with the inventory known), counts the
outcome, publishes the card claims after it (cardclaims.py), and wakes a
pass after an unprepare (a hold or switch that waited for the card goes).

The `bus_*` functions are how the ClaimKeeper reaches the inventory (one
NVML step on a MIG instance, one sharing step) and the switcher (counted
like the pass's switches).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from nats.aio.client import Client

from shared.runtime import call
from shared.schemas import (
    MIG_INSTANCE_REPLY_CODEC,
    SHARING_STEP_REPLY_CODEC,
    ClaimPrepareReply,
    ClaimPrepareRequest,
    ClaimUnprepareReply,
    ClaimUnprepareRequest,
    Inventory,
    MigInstanceReply,
    MigInstanceRequest,
    SharingStepReply,
    SharingStepRequest,
    SwitchReply,
    SwitchRequest,
)
from shared.subjects import NodeSubjects

from . import gpuops
from .claims import ClaimKeeper
from .metrics import ConvergerMetrics
from .model import ConvergerState
from .switcher import Switcher

#: an MPS daemon starts, sets its limits and answers its pipe within this (the inventory bounds each command)
SHARING_STEP_TIMEOUT_S = 90.0


class ClaimDesk:
    def __init__(
        self,
        keeper: ClaimKeeper,
        *,
        state: ConvergerState,
        lock: asyncio.Lock,
        inventory: Callable[[], Awaitable[Inventory | None]],
        publish: Callable[[], Awaitable[None]],
        trigger: Callable[[str], None],
        metrics: ConvergerMetrics,
    ) -> None:
        self.keeper = keeper
        self.state = state
        self.lock = lock
        self.inventory = inventory
        self.publish = publish
        self.trigger = trigger
        self.metrics = metrics
        #: the DRA claims cut short by the last stop were looked at (once the inventory is known)
        self.reconciled = False

    async def prepare(self, req: ClaimPrepareRequest) -> ClaimPrepareReply:
        async with self.lock:
            await self.reconcile()
            reply = await self.keeper.prepare(req)
        self.metrics.claim_ops.labels(op="prepare", outcome="ok" if reply.ok else reply.reason or "refused").inc()
        self.metrics.claims_gauge(self.state.claims.values())
        await self.publish()
        return reply

    async def unprepare(self, req: ClaimUnprepareRequest) -> ClaimUnprepareReply:
        async with self.lock:
            await self.reconcile()
            reply = await self.keeper.unprepare(req.uid)
        self.metrics.claim_ops.labels(op="unprepare", outcome="ok" if reply.ok else "failed").inc()
        self.metrics.claims_gauge(self.state.claims.values())
        await self.publish()
        # a hold or switch that waited for the card goes now
        self.trigger(f"claim {req.uid} unprepared")
        return reply

    async def reconcile(self) -> None:
        """Once per start, with the inventory known (under the lock): claims cut short by the last stop."""
        if self.reconciled:
            return
        inv = await self.inventory()
        if inv is None:
            return
        self.reconciled = True
        # always: with no claim on record an MPS daemon may still be left to stop
        await self.keeper.reconcile(inv)
        self.metrics.claims_gauge(self.state.claims.values())


def bus_mig_step(nc: Client, subjects: NodeSubjects) -> Callable[[MigInstanceRequest], Awaitable[MigInstanceReply]]:
    """One NVML step on a MIG instance, asked of the inventory (which rescans after it)."""

    async def mig_step(req: MigInstanceRequest) -> MigInstanceReply:
        return await call(nc, subjects.inventory_mig_instance, req, MIG_INSTANCE_REPLY_CODEC, timeout=gpuops.MIG_STEP_TIMEOUT_S)

    return mig_step


def bus_sharing_step(nc: Client, subjects: NodeSubjects) -> Callable[[SharingStepRequest], Awaitable[SharingStepReply]]:
    """One sharing step (time slice, MPS daemon), asked of the inventory."""

    async def sharing_step(req: SharingStepRequest) -> SharingStepReply:
        return await call(nc, subjects.inventory_sharing, req, SHARING_STEP_REPLY_CODEC, timeout=SHARING_STEP_TIMEOUT_S)

    return sharing_step


def counted_switch(switcher: Switcher, count: Callable[[str, str], None]) -> Callable[[SwitchRequest], Awaitable[SwitchReply]]:
    """A DRA claim's switch: counted like the pass's, and the inventory rescans on the switcher's notice."""

    async def switch(req: SwitchRequest) -> SwitchReply:
        reply = await switcher.switch(req)
        count(req.target, reply.outcome)
        return reply

    return switch


__all__ = ["ClaimDesk", "SHARING_STEP_TIMEOUT_S", "bus_mig_step", "bus_sharing_step", "counted_switch"]
