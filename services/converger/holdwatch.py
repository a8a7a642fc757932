"""The hold directory watch: a change there that no pass made (a spec, env file or consumer copy
removed or edited from outside) wakes a pass, which puts it right.

What the directories held when the last pass ended is kept (`pass_ended`,
called by the pass under its lock); every --watch-interval they are read
again (drift.dirs_signature, through HoldDirs) and a difference found while
no pass runs triggers one. Polling, not inotify: see drift.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from shared import logs
from shared.runtime import LoopGuard

from .holddirs import HoldDirs


class HoldDirWatch:
    def __init__(self, dirs: HoldDirs, *, lock: asyncio.Lock, trigger: Callable[[str], None], log: logs.StructLogger, interval: float) -> None:
        self.dirs = dirs
        self.lock = lock
        self.trigger = trigger
        self.log = log
        self.interval = interval
        #: what the hold directories held when the last pass ended (None: no pass yet)
        self.seen: tuple | None = None

    async def pass_ended(self) -> None:
        """What the pass left: a later change is someone else's (the watch wakes a pass)."""
        self.seen = await asyncio.to_thread(self.dirs.signature)

    async def run(self, stopping: asyncio.Event) -> None:
        """Every --watch-interval: the hold directories changed since the last pass (a spec, env
        file or consumer copy removed or edited from outside): wake a pass, which puts them back."""
        guard = LoopGuard(self.log, "hold directory watch")
        while not stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.interval)
            async with guard:
                if stopping.is_set() or self.lock.locked() or self.seen is None:
                    continue
                now = await asyncio.to_thread(self.dirs.signature)
                if now != self.seen and not self.lock.locked():
                    self.seen = now
                    self.log.info("hold directories changed outside a pass: a pass puts them right")
                    self.trigger("hold files changed")


__all__ = ["HoldDirWatch"]
