"""The converger's view of vfio_switcher: a port, and its node-bus client.

The switcher answers every well-formed request with a SwitchReply, refusals
included; only a switcher that cannot be reached (no responders, a timeout,
an error answer, an unreadable reply) raises `SwitchUnavailable`, which the
pass retries.
"""

from __future__ import annotations

from typing import Protocol

import nats.errors
from nats.aio.client import Client

from shared.runtime import ServiceCallError, call
from shared.schemas import SWITCH_REPLY_CODEC, BadMessage, SwitchReply, SwitchRequest
from shared.subjects import NodeSubjects


class SwitchUnavailable(Exception):
    """No SwitchReply came back: the switch may or may not have happened; retried."""


class Switcher(Protocol):
    async def switch(self, request: SwitchRequest) -> SwitchReply: ...


class BusSwitcher:
    def __init__(self, nc: Client, subjects: NodeSubjects, timeout: float = 60.0) -> None:
        self.nc, self.subjects, self.timeout = nc, subjects, timeout

    async def switch(self, request: SwitchRequest) -> SwitchReply:
        try:
            return await call(self.nc, self.subjects.vfio_switch, request, SWITCH_REPLY_CODEC, timeout=self.timeout)
        except ServiceCallError as exc:
            raise SwitchUnavailable(f"vfio_switcher answered {exc.code}: {exc.description}") from None
        except (nats.errors.Error, TimeoutError, BadMessage) as exc:
            raise SwitchUnavailable(f"vfio_switcher unreachable: {str(exc) or type(exc).__name__}") from None


class NoSwitcher:
    """A node without a vfio_switcher: every switch is unavailable (retried)."""

    async def switch(self, request: SwitchRequest) -> SwitchReply:
        raise SwitchUnavailable("no vfio_switcher on this node")


__all__ = ["SwitchUnavailable", "Switcher", "BusSwitcher", "NoSwitcher"]
