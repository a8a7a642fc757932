"""The bridge's Prometheus metrics: made in one place, and the outbox depth measured on its own.

Every job reports into the service's one registry, so the metrics are made
here once (`BridgeMetrics`) and each job is handed only the ones it moves.
The outbox depth and age are the one figure no job produces as a side effect:
`OutboxDepth` measures them every 2 s, especially while upstream is away (the
outbox grows then), so no round trip stands between an event and its forward.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timezone
from typing import Any

import nats.errors
from nats.aio.client import Client
from prometheus_client import CollectorRegistry, Counter, Gauge

from shared.jsutil import StreamMissing, stream_depth
from shared.runtime import LoopGuard


class BridgeMetrics:
    """The bridge's metrics, registered in `registry` (None: the default one)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        reg = registry
        self.up = Gauge("bcd_upstream_connected", "1 while connected upstream", registry=reg)
        self.depth = Gauge("bcd_outbox_depth", "Events in the outbox waiting for upstream", registry=reg)
        self.age = Gauge("bcd_outbox_oldest_age_seconds", "Age of the oldest event in the outbox", registry=reg)
        self.forwarded = Counter("bcd_outbox_forwarded", "Events acknowledged by upstream, by type", ["type"], registry=reg)
        self.forward_errors = Counter("bcd_outbox_forward_errors", "Failed forwards (retried)", registry=reg)
        self.specs = Counter("bcd_node_specs", "Node specs received, by outcome", ["outcome"], registry=reg)
        for outcome in ("accepted", "rejected"):
            self.specs.labels(outcome=outcome)


class OutboxDepth:
    """The outbox's depth and the age of its oldest event, into two gauges."""

    def __init__(self, nc: Client, stream: str, depth: Gauge, age: Gauge, log: Any) -> None:
        self.nc = nc
        self.stream = stream
        self.depth = depth
        self.age = age
        self.log = log

    async def update(self) -> None:
        """Measure once; a stream not there (yet) or a bus away leaves the gauges as they are."""
        try:
            depth = await stream_depth(self.nc, self.stream)
        except (StreamMissing, nats.errors.Error, asyncio.TimeoutError):
            return
        self.depth.set(depth.messages)
        self.age.set((datetime.now(timezone.utc) - depth.oldest).total_seconds() if depth.oldest else 0)

    async def run(self, stopping: asyncio.Event) -> None:
        """The outbox depth and age, also (especially) while upstream is away."""
        guard = LoopGuard(self.log, "outbox depth")
        while not stopping.is_set():
            async with guard:
                await self.update()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), 2.0)


__all__ = ["BridgeMetrics", "OutboxDepth"]
