"""The converger's view of the Kubernetes consumers of its holds: the device plugin, a port and its bus client.

When a Kubernetes release starts, the hold's files are withdrawn and then
the device plugin is told, and only then is the reaper asked to evict: so
the kubelet's ListAndWatch has dropped the devices before any pod is
evicted, and no new pod is admitted onto them meanwhile. The plugin is
optional and may be down: the call has a short deadline, and a plugin that
does not answer changes nothing here (it advertises from the disk, where
the hold is gone already, once it is back).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import nats.errors
from nats.aio.client import Client

from shared import logs
from shared.runtime import ServiceCallError, call
from shared.schemas import WITHDRAW_REPLY_CODEC, BadMessage, DevicesQuery
from shared.subjects import NodeSubjects

log = logs.get_logger("bcd.converger.consumers")

#: the plugin answers once the kubelet's streams took the update (it waits at most 2 s).
WITHDRAW_TIMEOUT_S = 3.0
#: after a withdrawal timed out, the next ones for this long are not waited for (a pass
#: with many releases and a hung plugin would otherwise wait the timeout for each).
UNANSWERED_BACKOFF_S = 30.0


class KubeConsumers(Protocol):
    async def withdraw(self, allocation_id: str, devices: list[str]) -> None:
        """Tell the device plugin a hold was withdrawn; returns when it says so, or gave up."""
        ...

    async def holds_changed(self) -> None:
        """Hold files were written or removed (a hint: the plugin reads the disk again)."""
        ...


class BusKubeConsumers:
    def __init__(self, nc: Client, subjects: NodeSubjects, timeout: float = WITHDRAW_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.nc, self.subjects, self.timeout, self.clock = nc, subjects, timeout, clock
        #: until when a timed-out plugin is not waited for (it still reads the disk itself)
        self.quiet_until = 0.0

    async def withdraw(self, allocation_id: str, devices: list[str]) -> None:
        if self.clock() < self.quiet_until:
            # its next read of the disk (every 2 s, and on holds_changed) drops the hold anyway
            log.info("device plugin unanswered lately; not waiting for it", allocation_id=allocation_id)
            return
        try:
            reply = await call(self.nc, self.subjects.device_plugin_withdraw, DevicesQuery(allocation_id=allocation_id, devices=devices), WITHDRAW_REPLY_CODEC, timeout=self.timeout)
        except nats.errors.NoRespondersError:
            log.debug("no device plugin runs; nothing to withdraw from the kubelet", allocation_id=allocation_id)
            return
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            self.quiet_until = self.clock() + UNANSWERED_BACKOFF_S
            log.warning(
                "device plugin did not confirm the withdrawal; evicting anyway",
                allocation_id=allocation_id,
                error=str(exc) or type(exc).__name__,
                not_waited_for_s=UNANSWERED_BACKOFF_S,
            )
            return
        except (ServiceCallError, nats.errors.Error, BadMessage) as exc:
            log.warning("device plugin did not confirm the withdrawal; evicting anyway", allocation_id=allocation_id, error=str(exc) or type(exc).__name__)
            return
        self.quiet_until = 0.0
        if reply.detail:
            log.warning("device plugin withdrawal incomplete", allocation_id=allocation_id, detail=reply.detail)

    async def holds_changed(self) -> None:
        try:
            await self.nc.publish(self.subjects.converger_holds_changed, b"")
        except nats.errors.Error as exc:
            log.debug("holds_changed not published", error=str(exc) or type(exc).__name__)


class NoKubeConsumers:
    async def withdraw(self, allocation_id: str, devices: list[str]) -> None:
        return None

    async def holds_changed(self) -> None:
        return None


__all__ = ["KubeConsumers", "BusKubeConsumers", "NoKubeConsumers", "WITHDRAW_TIMEOUT_S", "UNANSWERED_BACKOFF_S"]
