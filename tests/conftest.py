"""Strictness for every test: warnings are errors (pyproject), and an async
test that leaves a task running fails."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(autouse=True)
async def no_leaked_tasks():
    yield
    current = asyncio.current_task()
    # tasks cancelled during teardown (a closed NATS client's subscriptions, a closed gRPC
    # channel's calls) finish within a few ticks; a busy machine takes more of them. They get
    # a bounded grace; a task nobody cancelled is a leak at once.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    await asyncio.sleep(0)
    while loop.time() < deadline and any(t is not current and not t.done() and t.cancelling() for t in asyncio.all_tasks()):
        await asyncio.sleep(0.01)
    leaked = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for t in leaked:
        t.cancel()
    assert not leaked, f"test leaked asyncio tasks: {leaked}"
