"""When passes run: on a trigger (new spec, inventory change, a request), on the
30-second retry while anything is retryable, and on the 10-minute drift pass.

The timing rule is the pure `next_deadline`; the loop waits on a `Clock`, so
tests drive it on fake time (`FakeClock.advance(30)`) instead of sleeping.
What a pass does is passes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from shared import logs

log = logs.get_logger("bcd.converger.loop")


def next_deadline(last_pass_end: float, retry_needed: bool, retry_s: float, drift_s: float) -> float:
    """When the next untriggered pass is due."""
    return last_pass_end + (min(retry_s, drift_s) if retry_needed else drift_s)


class Clock(Protocol):
    def monotonic(self) -> float: ...

    async def wait(self, event: asyncio.Event, deadline: float) -> bool:
        """Wait for `event` or for `deadline`; True when the event fired."""
        ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def wait(self, event: asyncio.Event, deadline: float) -> bool:
        timeout = max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


@dataclass
class FakeClock:
    """Time moves only when a test calls `advance`."""

    now: float = 0.0
    _waiters: list[tuple[float, asyncio.Future[None]]] = field(default_factory=list)

    def monotonic(self) -> float:
        return self.now

    async def wait(self, event: asyncio.Event, deadline: float) -> bool:
        if event.is_set():
            return True
        if deadline <= self.now:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((deadline, fut))
        ev = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({ev, fut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ev.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ev
            self._waiters = [(d, f) for d, f in self._waiters if f is not fut]
        return event.is_set()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for deadline, fut in list(self._waiters):
            if deadline <= self.now and not fut.done():
                fut.set_result(None)

    @property
    def waiting(self) -> int:
        return len(self._waiters)


class PassLoop:
    """Runs `run_pass(reason) -> retry_needed` serially; triggers coalesce."""

    def __init__(
        self,
        run_pass: Callable[[str], Awaitable[bool]],
        *,
        retry_s: float = 30.0,
        drift_s: float = 600.0,
        clock: Clock | None = None,
    ) -> None:
        self.run_pass = run_pass
        self.retry_s = retry_s
        self.drift_s = drift_s
        self.clock = clock or RealClock()
        self.wake = asyncio.Event()
        self.reasons: list[str] = []
        self.retry_needed = False
        self.deadline = 0.0
        self.passes = 0

    def trigger(self, reason: str) -> None:
        self.reasons.append(reason)
        self.wake.set()

    def next_retry_in(self) -> float | None:
        if not self.retry_needed:
            return None
        return max(0.0, self.deadline - self.clock.monotonic())

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            reason = ", ".join(dict.fromkeys(self.reasons)) or "start"
            self.reasons.clear()
            self.wake.clear()
            try:
                self.retry_needed = await self.run_pass(reason)
            except Exception:  # noqa: BLE001 - a pass that blew up is retried like a failed write
                log.exception("pass failed")
                self.retry_needed = True
            self.passes += 1
            self.deadline = next_deadline(self.clock.monotonic(), self.retry_needed, self.retry_s, self.drift_s)
            fired = await self._wait(stopping)
            if not fired and not stopping.is_set():
                self.reasons.append("retry" if self.retry_needed else "drift")

    async def _wait(self, stopping: asyncio.Event) -> bool:
        stop = asyncio.ensure_future(stopping.wait())
        tick = asyncio.ensure_future(self.clock.wait(self.wake, self.deadline))
        try:
            await asyncio.wait({stop, tick}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stop, tick):
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        return self.wake.is_set()


__all__ = ["next_deadline", "Clock", "RealClock", "FakeClock", "PassLoop"]
