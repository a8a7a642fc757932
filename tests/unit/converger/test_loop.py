"""PassLoop on fake time: when passes run, how triggers coalesce, and a clean stop.

Time moves only through FakeClock.advance; the loop is a real asyncio task,
stopped in every test (the suite fails a test that leaks a task).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from services.converger.loop import FakeClock, PassLoop, RealClock, next_deadline


async def until(cond: Callable[[], bool], what: str = "condition") -> None:
    """Let the loop run until `cond` holds (bounded: fake time never moves here)."""
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"timed out waiting for {what}")


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


class Harness:
    def __init__(self, results: list[bool] | Callable[[str], Awaitable[bool]] | bool = False, **kw: float) -> None:
        self.clock = FakeClock()
        self.calls: list[tuple[float, str]] = []
        self.results = results
        self.loop = PassLoop(self._run_pass, clock=self.clock, **kw)
        self.stopping = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def _run_pass(self, reason: str) -> bool:
        self.calls.append((self.clock.now, reason))
        if callable(self.results):
            return await self.results(reason)
        if isinstance(self.results, list):
            return self.results.pop(0) if self.results else False
        return self.results

    async def start(self) -> None:
        self.task = asyncio.create_task(self.loop.run(self.stopping))
        await self.idle()

    async def idle(self) -> None:
        """The loop finished its pass and waits on the clock."""
        await until(lambda: self.clock.waiting == 1 and not self.loop.wake.is_set(), "the loop to wait")

    async def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await settle()
        await self.idle()

    async def stop(self) -> None:
        self.stopping.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, 1)


@pytest.fixture
async def make() -> AsyncIterator[Callable[..., Awaitable[Harness]]]:
    made: list[Harness] = []

    async def factory(*args, **kw) -> Harness:  # noqa: ANN002, ANN003
        h = Harness(*args, **kw)
        made.append(h)
        await h.start()
        return h

    yield factory
    for h in made:
        if h.task is not None and not h.task.done():
            await h.stop()


# ------------------------------------------------------------------------------ timing


@pytest.mark.parametrize(
    ("last", "retry", "retry_s", "drift_s", "due"),
    [
        (0.0, True, 30.0, 600.0, 30.0),
        (0.0, False, 30.0, 600.0, 600.0),
        (100.0, True, 30.0, 600.0, 130.0),
        (5.0, True, 60.0, 20.0, 25.0),  # a retry never waits longer than a drift pass
        (5.0, False, 60.0, 20.0, 25.0),
    ],
    ids=["retry", "drift", "retry-from-last-pass-end", "retry-capped-by-drift", "drift-short"],
)
def test_next_deadline(last: float, retry: bool, retry_s: float, drift_s: float, due: float) -> None:
    assert next_deadline(last, retry, retry_s, drift_s) == due


async def test_retryable_pass_runs_again_after_exactly_retry_s(make) -> None:  # noqa: ANN001
    h = await make([True, True, False])
    assert h.calls == [(0.0, "start")]
    assert h.loop.next_retry_in() == 30.0
    await h.advance(29.9)
    assert len(h.calls) == 1
    assert h.loop.next_retry_in() == pytest.approx(0.1)
    await h.advance(0.1)
    assert h.calls[-1] == (30.0, "retry")
    await h.advance(30.0)
    assert h.calls[-1] == (60.0, "retry")
    # converged now: no retry is pending, the next pass is the drift pass
    assert h.loop.next_retry_in() is None
    await h.advance(30.0)
    assert len(h.calls) == 3
    await h.stop()


async def test_drift_pass_after_drift_s_when_converged(make) -> None:  # noqa: ANN001
    h = await make(False)
    await h.advance(599.9)
    assert h.calls == [(0.0, "start")]
    await h.advance(0.1)
    assert h.calls == [(0.0, "start"), (600.0, "drift")]
    await h.advance(600.0)
    assert h.calls[-1] == (1200.0, "drift")
    assert h.loop.passes == 3


async def test_intervals_are_configurable(make) -> None:  # noqa: ANN001
    h = await make([True, False], retry_s=5.0, drift_s=60.0)
    await h.advance(4.99)
    assert len(h.calls) == 1
    await h.advance(0.01)
    assert h.calls[-1] == (5.0, "retry")
    await h.advance(59.0)
    assert len(h.calls) == 2
    await h.advance(1.0)
    assert h.calls[-1] == (65.0, "drift")


async def test_trigger_runs_a_pass_at_once_and_restarts_the_timer(make) -> None:  # noqa: ANN001
    h = await make(False)
    await h.advance(100.0)
    h.loop.trigger("spec generation 2")
    await settle()
    await h.idle()
    assert h.calls[-1] == (100.0, "spec generation 2")
    await h.advance(599.0)
    assert len(h.calls) == 2
    await h.advance(1.0)
    assert h.calls[-1] == (700.0, "drift")


async def test_triggers_during_a_pass_coalesce_into_one_pass(make) -> None:  # noqa: ANN001
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def slow(reason: str) -> bool:
        if reason != "start":
            return False
        entered.set()
        await gate.wait()
        return False

    h = Harness(slow)
    h.task = asyncio.create_task(h.loop.run(h.stopping))
    try:
        await asyncio.wait_for(entered.wait(), 1)
        for reason in ("spec generation 2", "inventory changed", "spec generation 2", "requested"):
            h.loop.trigger(reason)
        gate.set()
        await settle()
        await h.idle()
        assert [r for _, r in h.calls] == ["start", "spec generation 2, inventory changed, requested"]
        assert h.loop.passes == 2
        await settle()
        assert h.loop.passes == 2  # no third pass from the coalesced triggers
    finally:
        gate.set()
        await h.stop()


async def test_triggers_while_waiting_coalesce(make) -> None:  # noqa: ANN001
    h = await make(False)
    h.loop.trigger("a")
    h.loop.trigger("b")
    await settle()
    await h.idle()
    assert [r for _, r in h.calls] == ["start", "a, b"]


async def test_a_pass_that_raises_is_retried(make) -> None:  # noqa: ANN001
    async def boom(reason: str) -> bool:
        if reason == "start":
            raise RuntimeError("pass blew up")
        return False

    h = await make(boom)
    assert h.loop.retry_needed
    await h.advance(30.0)
    assert [r for _, r in h.calls] == ["start", "retry"]
    assert not h.loop.retry_needed


# ------------------------------------------------------------------------------ stopping


async def test_stops_cleanly_while_waiting(make) -> None:  # noqa: ANN001
    h = await make(True)
    await h.stop()
    assert h.task is not None and h.task.done() and h.task.exception() is None
    assert h.clock.waiting == 0
    # a trigger after the stop does nothing
    h.loop.trigger("late")
    await settle()
    assert len(h.calls) == 1


async def test_stop_during_a_pass_ends_after_it(make) -> None:  # noqa: ANN001
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def slow(reason: str) -> bool:
        entered.set()
        await gate.wait()
        return True

    h = Harness(slow)
    h.task = asyncio.create_task(h.loop.run(h.stopping))
    await asyncio.wait_for(entered.wait(), 1)
    h.stopping.set()
    gate.set()
    await asyncio.wait_for(h.task, 1)
    assert h.loop.passes == 1 and h.clock.waiting == 0


async def test_stopped_before_start_runs_no_pass() -> None:
    h = Harness(False)
    h.stopping.set()
    await asyncio.wait_for(h.loop.run(h.stopping), 1)
    assert h.calls == []


async def test_real_clock_retries_on_real_time() -> None:
    calls: list[str] = []

    async def run_pass(reason: str) -> bool:
        calls.append(reason)
        return len(calls) < 3

    stopping = asyncio.Event()
    loop = PassLoop(run_pass, retry_s=0.01, drift_s=60.0, clock=RealClock())
    task = asyncio.create_task(loop.run(stopping))
    try:
        await asyncio.wait_for(until_async(lambda: len(calls) >= 3), 2)
        await asyncio.sleep(0.05)
        assert calls == ["start", "retry", "retry"]  # converged: the next is a drift pass in 60 s
    finally:
        stopping.set()
        await asyncio.wait_for(task, 1)


async def until_async(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.005)
