"""How a wait that may never end on its own ends on a stop: a task cancelled until it is done.

One cancel is not enough on Python 3.11. `asyncio.wait_for` there swallows a cancel that
arrives just as its inner future finishes (bpo-42130; 3.12 rewrote wait_for on timeouts),
and nats-py's connect runs each handshake under wait_for inside a loop that retries for
ever: a lost cancel left `controlplane serve` and the services deaf to SIGTERM while
their server was unreachable. `cancel_surely` cancels again until the task has ended,
bounded; `unless_stopped` runs an awaitable until it is done or a stop is asked;
`sleep_unless` is a retry delay a stop cuts short (a SIGTERM never waits one out).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

#: how long a cancelled task gets before it is cancelled again
RECANCEL_S = 0.5
#: how long cancel_surely keeps at it before it gives up (the task is left behind)
CANCEL_WITHIN_S = 10.0


async def sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less when `stopping` is set meanwhile."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


async def cancel_surely(task: asyncio.Future, *, within: float = CANCEL_WITHIN_S, every: float = RECANCEL_S) -> bool:
    """Cancel `task` until it is done, for at most `within` seconds: True once it has ended
    (its outcome retrieved, so none is reported as never retrieved), False when it outlived that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not task.done():
        left = deadline - loop.time()
        if left <= 0:
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(every, left))
    if not task.cancelled():
        task.exception()
    return True


async def unless_stopped(aw: Awaitable[T], stopping: asyncio.Event, *, within: float = CANCEL_WITHIN_S) -> T | None:
    """`aw`'s result, or None when `stopping` was set first (then `aw` is cancelled surely).
    What `aw` raises is raised here; a caller cancelled meanwhile cancels `aw` too."""
    task = asyncio.ensure_future(aw)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            await cancel_surely(task, within=within)
    if task.cancelled() or not task.done():
        return None
    return task.result()


__all__ = ["CANCEL_WITHIN_S", "RECANCEL_S", "cancel_surely", "sleep_unless", "unless_stopped"]
