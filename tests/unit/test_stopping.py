"""shared/stopping.py: a stop ends a wait even when one cancel is lost on the way.

`Deaf` is the Python 3.11 wait_for race made deterministic: the task swallows the first
`swallow` cancels the way nats-py's connect loop did when the cancel met a finished
handshake, and goes on retrying."""

from __future__ import annotations

import asyncio

import pytest

from shared.stopping import cancel_surely, unless_stopped


class Deaf:
    def __init__(self, swallow: int) -> None:
        self.swallow = swallow
        self.swallowed = 0
        self.tries = 0

    async def connect(self) -> str:
        while True:
            self.tries += 1
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if self.swallowed >= self.swallow:
                    raise
                self.swallowed += 1


async def test_one_lost_cancel_no_longer_hangs_the_stop():
    deaf = Deaf(swallow=2)
    task = asyncio.ensure_future(deaf.connect())
    await asyncio.sleep(0.05)
    assert await cancel_surely(task, within=5, every=0.05)
    assert task.cancelled() and deaf.swallowed == 2


async def test_a_single_cancel_would_have_left_it_running():
    """The symptom, kept: what the services did before (one cancel, then wait) does not end."""
    deaf = Deaf(swallow=1)
    task = asyncio.ensure_future(deaf.connect())
    await asyncio.sleep(0.05)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done and deaf.swallowed == 1
    assert await cancel_surely(task, within=2, every=0.05)


async def test_a_task_that_never_ends_is_given_up_within_the_bound():
    deaf = Deaf(swallow=10**9)
    task = asyncio.ensure_future(deaf.connect())
    await asyncio.sleep(0.05)  # running: a task cancelled before its first step never starts
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert not await cancel_surely(task, within=0.3, every=0.05)
    assert 0.3 <= loop.time() - t0 < 2
    deaf.swallow = 0  # let it go, so the test leaks no task
    assert await cancel_surely(task, within=2, every=0.05)


async def test_a_failed_task_counts_as_ended_and_its_error_is_retrieved():
    async def boom() -> None:
        raise RuntimeError("x")

    task = asyncio.ensure_future(boom())
    await asyncio.sleep(0)
    assert await cancel_surely(task)  # no "exception was never retrieved" (warnings are errors)


async def test_unless_stopped_returns_the_result_when_it_comes_first():
    async def quick() -> int:
        return 7

    assert await unless_stopped(quick(), asyncio.Event()) == 7


async def test_unless_stopped_raises_what_the_awaitable_raised():
    async def bad() -> None:
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError, match="refused"):
        await unless_stopped(bad(), asyncio.Event())


async def test_a_stop_ends_a_wait_that_swallows_cancels():
    deaf = Deaf(swallow=3)
    stopping = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stopping.set)
    assert await asyncio.wait_for(unless_stopped(deaf.connect(), stopping, within=5), 5) is None
    assert deaf.swallowed == 3


async def test_a_caller_cancelled_meanwhile_takes_the_awaitable_with_it():
    ended = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    outer = asyncio.ensure_future(unless_stopped(forever(), asyncio.Event()))
    await asyncio.sleep(0.01)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert ended.is_set()


async def test_the_control_planes_connect_ends_on_a_stop_that_loses_cancels(monkeypatch):
    """controlplane serve's connect (test_serve_says_a_tls_failure_once_while_it_retries hung in
    CI on one lost cancel): a stop ends it although its first cancels are swallowed."""
    import argparse

    from controlplane import upstream
    from shared.tlsconfig import UpstreamTls

    deaf = Deaf(swallow=2)
    monkeypatch.setattr(upstream, "connect_upstream", lambda *a, **k: deaf.connect())
    monkeypatch.setattr(upstream, "TlsFiles", lambda tls: object())
    args = argparse.Namespace(nats_url="nats://127.0.0.1:1", user="controlplane", password_file=None, nkey_file=None)
    stopping = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, stopping.set)
    assert await asyncio.wait_for(upstream.connect_serving(args, UpstreamTls(), stopping), 5) is None
    assert deaf.swallowed == 2
