"""The converger's view of kube_reaper: a port, and its node-bus client.

The converger asks whether any pod still holds a withdrawn allocation's
devices (unreachable counts as held), asks for the evictions, and asks
whether any pod holds a bcd GPU of an allocation the node does not know (to
clear the unreadable-releases marker).
"""

from __future__ import annotations

from typing import Protocol

import nats.errors
from nats.aio.client import Client

from shared import logs
from shared.runtime import ServiceCallError, call
from shared.schemas import (
    EVICT_REPLY_CODEC,
    HELD_REPLY_CODEC,
    ORPHAN_REPLY_CODEC,
    BadMessage,
    DevicesQuery,
    OrphanQuery,
)
from shared.subjects import NodeSubjects

log = logs.get_logger("bcd.converger.reaper")


class Reaper(Protocol):
    async def held(self, allocation_id: str, devices: list[str]) -> bool:
        """True when any pod holds any of the devices, or when that cannot be established."""
        ...

    async def evict(self, allocation_id: str, devices: list[str]) -> None:
        """Ask for the pods holding the devices to be evicted (best effort; retried each pass)."""
        ...

    async def no_orphans(self, known_devices: list[str]) -> bool:
        """True only when it is established that no pod holds a bcd GPU outside `known_devices`."""
        ...


class BusReaper:
    def __init__(self, nc: Client, subjects: NodeSubjects, timeout: float = 5.0) -> None:
        self.nc, self.subjects, self.timeout = nc, subjects, timeout

    async def held(self, allocation_id: str, devices: list[str]) -> bool:
        try:
            reply = await call(self.nc, self.subjects.reaper_held, DevicesQuery(allocation_id=allocation_id, devices=devices), HELD_REPLY_CODEC, timeout=self.timeout)
        except (ServiceCallError, nats.errors.Error, TimeoutError, BadMessage) as exc:
            log.warning("kube_reaper unreachable: devices count as held", allocation_id=allocation_id, error=str(exc) or type(exc).__name__)
            return True
        if not reply.reachable:
            log.warning("pod holders cannot be established: devices count as held", allocation_id=allocation_id, detail=reply.detail)
        return reply.held or not reply.reachable

    async def evict(self, allocation_id: str, devices: list[str]) -> None:
        try:
            reply = await call(self.nc, self.subjects.reaper_evict, DevicesQuery(allocation_id=allocation_id, devices=devices), EVICT_REPLY_CODEC, timeout=self.timeout)
        except (ServiceCallError, nats.errors.Error, TimeoutError, BadMessage) as exc:
            log.warning("eviction request not delivered; the next pass asks again", allocation_id=allocation_id, error=str(exc) or type(exc).__name__)
            return
        if reply.evicting:
            log.info("evicting pods that hold withdrawn devices", allocation_id=allocation_id, pods=reply.evicting)

    async def no_orphans(self, known_devices: list[str]) -> bool:
        try:
            reply = await call(self.nc, self.subjects.reaper_orphans, OrphanQuery(known_devices=known_devices), ORPHAN_REPLY_CODEC, timeout=self.timeout)
        except (ServiceCallError, nats.errors.Error, TimeoutError, BadMessage):
            return False
        if reply.orphans:
            log.warning("pods hold bcd GPUs of allocations this node does not know", pods=reply.orphans)
        return reply.reachable and not reply.orphans


class NoReaper:
    """A node without Kubernetes: nothing is ever established free (releases stay claimed)."""

    async def held(self, allocation_id: str, devices: list[str]) -> bool:
        return True

    async def evict(self, allocation_id: str, devices: list[str]) -> None:
        return None

    async def no_orphans(self, known_devices: list[str]) -> bool:
        return False


__all__ = ["Reaper", "BusReaper", "NoReaper"]
