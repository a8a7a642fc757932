"""A pass that could not reach a service it needs runs again as soon as that service answers.

The ports the pass goes through (the signer, the root helper, the inventory)
note here each service they could not reach: no responders, or no answer in
time. When a pass ends with something left to retry, the services noted during
it are watched: every `interval` each is asked one cheap question it answers
(the signer its key, the helper its info, the inventory its inventory), and the
first answer wakes a pass. Before, such a pass waited for the 30-s retry: one
kill -9 restart in 25 found the signer not up yet at its first pass and sat
PROGRESSING for 30 s with every service running. The watch asks nothing while
no pass waits for a service, and a pass that converges forgets what it waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client

from shared import logs
from shared.runtime import LoopGuard
from shared.subjects import NodeSubjects

#: how often a service a pass waits for is asked (only while one is waited for)
PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.0


def probe_subjects(subjects: NodeSubjects) -> dict[str, str]:
    """The question each watched service answers (the converger may ask each: subjects.routes())."""
    return {
        "signer": subjects.signer_key,
        "helper": subjects.helper_info,
        "inventory": subjects.inventory_get,
    }


def waiting_after(waiting: frozenset[str], noted: frozenset[str], *, retry: bool) -> frozenset[str]:
    """What a pass that ended waits for: what it could not reach, with what earlier passes
    could not and still wait for, while it left something to retry; nothing once it did not."""
    return waiting | noted if retry else frozenset()


class ComebackWatch:
    def __init__(
        self,
        nc: Client,
        subjects: NodeSubjects,
        *,
        trigger: Callable[[str], None],
        log: logs.StructLogger,
        interval: float = PROBE_INTERVAL_S,
    ) -> None:
        self.nc = nc
        self.probes = probe_subjects(subjects)
        self.trigger = trigger
        self.log = log
        self.interval = interval
        #: the services found unreachable since the last pass ended (ports call `unreached`;
        #: the root helper's transport does from its own thread: a set add is atomic)
        self.noted: set[str] = set()
        #: the services the last pass waits for
        self.waiting: frozenset[str] = frozenset()

    def unreached(self, service: str) -> None:
        if service in self.probes:
            self.noted.add(service)

    def pass_ended(self, *, retry: bool) -> None:
        noted, self.noted = frozenset(self.noted), set()
        before, self.waiting = self.waiting, waiting_after(self.waiting, noted, retry=retry)
        if self.waiting - before:
            self.log.info("a pass waits for a service that did not answer; it runs again when it answers", waiting=sorted(self.waiting))

    async def answers(self, service: str) -> bool:
        """Does anything answer `service`'s question now (an error answer is an answer)?"""
        try:
            await self.nc.request(self.probes[service], b"{}", timeout=PROBE_TIMEOUT_S)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, asyncio.TimeoutError):
            return False
        return True

    async def look(self) -> None:
        """Ask each service waited for; the first that answers wakes a pass (which then says
        what it still waits for)."""
        for service in sorted(self.waiting):
            if await self.answers(service):
                self.waiting = frozenset()
                self.log.info("a service the pass waited for answers again: a pass runs now", service=service)
                self.trigger(f"{service} answers again")
                return

    async def run(self, stopping: asyncio.Event) -> None:
        guard = LoopGuard(self.log, "service comeback watch")
        while not stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.interval)
            async with guard:
                if not stopping.is_set() and self.waiting:
                    await self.look()


__all__ = ["ComebackWatch", "PROBE_INTERVAL_S", "probe_subjects", "waiting_after"]
