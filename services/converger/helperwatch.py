"""The root helper as this converger sees it: does one answer that can serve it, and is the node
privileged through it.

An unprivileged converger writes through the root helper (hostwriter.py's
HelperHostWriter). `HelperFinder` is one look: a helper answers its `info`
and writes where this converger reads (hostwriter.helper_mismatch); setup
takes its first answer as the node's privilege. `RootHelperWatch` keeps
looking (--writer auto: while unprivileged, and while privileged through
it), promotes or demotes the node as `watch_helper` (the pure rule) says,
and tells the rest: the plan config's `privileged` (facts.py), the bridge
(`converger_status_changed`: it sends a Hello with the capabilities as they
are now) and a pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import nats.errors
from nats.aio.client import Client

from shared import logs
from shared.runtime import LoopGuard, ServiceCallError, call
from shared.schemas import HELPER_INFO_CODEC, BadMessage, Empty, HelperInfo
from shared.subjects import NodeSubjects

from .facts import NodeFacts
from .hostwriter import HelperHostWriter, helper_mismatch


@dataclasses.dataclass(frozen=True)
class HelperWatch:
    """What the converger last knew of its root helper (`--writer auto`): whether holds bind
    through it (privileged) and since when (monotonic seconds) it has not answered."""

    privileged: bool
    gone_since: float | None = None


def watch_helper(watch: HelperWatch, *, answered: bool, now: float, lost_after: float) -> tuple[HelperWatch, str]:
    """One look at the helper -> (the new watch, what to do: "promote", "demote" or "").

    A helper that answers makes the node privileged at once. One that stops answering is given
    ``lost_after`` seconds (a `systemctl restart` of it, a bus blip) before the node counts as
    unprivileged again (seed: no helper, no holds): its Hello then claims no host capability and
    a new plain hold fails with node-unprivileged instead of waiting, retried, for a helper that
    may never come back. ``lost_after`` <= 0: never demoted."""
    if answered:
        return HelperWatch(privileged=True), "" if watch.privileged else "promote"
    if not watch.privileged:
        return watch, ""
    since = watch.gone_since if watch.gone_since is not None else now
    if lost_after > 0 and now - since >= lost_after:
        return HelperWatch(privileged=False), "demote"
    return HelperWatch(privileged=True, gone_since=since), ""


async def find_helper(nc: Client, subjects: NodeSubjects, timeout: float = 2.0) -> tuple[HelperInfo | None, str]:
    """Ask the root helper's `info` on the converger's own connection: (info, "") or (None, why not)."""
    try:
        return await call(nc, subjects.helper_info, Empty(), HELPER_INFO_CODEC, timeout=timeout), ""
    except nats.errors.NoRespondersError:
        return None, "no root helper answers"
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return None, f"the root helper did not answer within {timeout:g}s"
    except (ServiceCallError, BadMessage, nats.errors.Error) as exc:
        return None, f"the root helper's info failed: {exc or type(exc).__name__}"


class HelperFinder:
    """Does a root helper answer that writes where this converger reads? `note` says why not."""

    def __init__(
        self, nc: Client, subjects: NodeSubjects, writer: HelperHostWriter, *, cdi_dir: Path, run_dir: Path, consumer_dir: Path | None, log: logs.StructLogger
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.writer = writer
        self.cdi_dir = cdi_dir
        self.run_dir = run_dir
        self.consumer_dir = consumer_dir
        self.log = log
        #: why the last look found no helper that serves ("" when it did)
        self.note = ""

    async def look(self) -> bool:
        info, why = await find_helper(self.nc, self.subjects)
        if info is not None:
            why = helper_mismatch(info, self.cdi_dir, self.run_dir, self.writer.slices_backend, self.consumer_dir)
            if not why:
                self.writer.info = info
                return True
            if why != self.note:
                self.log.error("a root helper answers but cannot serve this converger", why=why)
        self.note = why
        return False


class RootHelperWatch:
    def __init__(
        self,
        finder: HelperFinder,
        facts: NodeFacts,
        *,
        mode: str,
        recheck_interval: float,
        lost_after: float,
        trigger: Callable[[str], None],
        log: logs.StructLogger,
    ) -> None:
        self.finder = finder
        self.facts = facts
        #: --writer: auto (the helper may come and go) or helper (required)
        self.mode = mode
        self.recheck_interval = recheck_interval
        self.lost_after = lost_after
        self.trigger = trigger
        self.log = log
        #: monotonic time the helper first missed a look while holds bind through it (None: answering)
        self.gone_since: float | None = None

    async def look(self) -> None:
        """One look at the root helper (--writer auto): promote or demote the node as watch_helper says."""
        answered = await self.finder.look()
        watch = HelperWatch(privileged=self.facts.privileged, gone_since=self.gone_since)
        # --writer helper: the helper is required, never given up on (its writes fail, retried)
        lost_after = self.lost_after if self.mode == "auto" else 0.0
        watch, action = watch_helper(watch, answered=answered, now=time.monotonic(), lost_after=lost_after)
        if watch.gone_since is not None and self.gone_since is None:
            self.log.warning(
                "the root helper does not answer",
                why=self.finder.note,
                unprivileged_in_s=lost_after if lost_after > 0 else None,
            )
        elif answered and self.gone_since is not None:
            self.log.info("the root helper answers again")
        self.gone_since = watch.gone_since
        if action == "promote":
            await self._set_privileged(True, "root helper found: holds bind through it from now on")
        elif action == "demote":
            await self._set_privileged(
                False,
                "root helper gone: the node is unprivileged until it answers again "
                "(new plain holds fail with node-unprivileged; kept holds stay)",
            )

    async def _set_privileged(self, privileged: bool, why: str) -> None:
        if self.facts.privileged == privileged:
            return
        self.facts.config = dataclasses.replace(self.facts.config, privileged=privileged)
        if privileged:
            self.log.info(why)
        else:
            self.log.warning(why, why_not=self.finder.note)
        # the bridge reads the status again and sends a Hello with the capabilities as they are now
        with contextlib.suppress(Exception):
            await self.finder.nc.publish(self.finder.subjects.converger_status_changed, b"")
        self.trigger("root helper found" if privileged else "root helper gone")

    async def run(self, stopping: asyncio.Event) -> None:
        """--writer auto: look for the root helper while unprivileged (every --helper-recheck-interval;
        every second in the first half minute: a helper started at the same time connects late),
        and make sure it still answers while privileged through it (every 5 s at most, every second
        once it has missed one; --helper-lost-after of silence makes the node unprivileged again)."""
        started = asyncio.get_running_loop().time()
        guard = LoopGuard(self.log, "helper watch")
        while not stopping.is_set():
            interval = self.recheck_interval
            if self.facts.privileged:
                interval = min(interval, 5.0)
            if self.gone_since is not None or asyncio.get_running_loop().time() - started < 30:
                interval = min(interval, 1.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval)
            async with guard:
                if not stopping.is_set():
                    await self.look()


__all__ = ["HelperWatch", "watch_helper", "find_helper", "HelperFinder", "RootHelperWatch"]
