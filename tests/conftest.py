"""Strictness for every test: warnings are errors (pyproject), and an async
test that leaves a task running fails."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(autouse=True)
async def no_leaked_tasks():
    yield
    current = asyncio.current_task()
    # one tick for tasks that were cancelled during teardown to finish
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for t in leaked:
        t.cancel()
    assert not leaked, f"test leaked asyncio tasks: {leaked}"
