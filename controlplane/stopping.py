"""The one way the control plane's long-running parts wait: a sleep that a stop cuts short.

Retries after a failed fetch, a failed state write, TLS files that do not load,
or a cluster still electing all wait through `sleep_unless`. That way a SIGTERM
never waits out a retry delay. It is its own module because both the serve
loop and the upstream connection use it and neither owns the other.
"""

from __future__ import annotations

import asyncio
import contextlib


async def sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or less when `stopping` is set meanwhile."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


__all__ = ["sleep_unless"]
