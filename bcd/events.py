"""`bcd events`: follow the reference control plane's verified event log (`events.jsonl`)."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import msgspec

from shared.schemas.codec import BoundedDecoder

from .controlplane import EventRecord, format_line

_DECODER = BoundedDecoder(EventRecord, max_bytes=4 * 1024 * 1024, what="event record")


def _render(line: bytes) -> str | None:
    try:
        return format_line(_DECODER.decode(line))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


async def follow_events(path: Path, *, follow: bool = True, last: int = 50, poll: float = 0.3) -> None:
    """Print the last `last` events, then (with `follow`) every new one as it is appended."""
    while not path.exists():
        if not follow:
            print(f"(no events yet: {path} does not exist)")
            return
        await asyncio.sleep(poll)
    with open(path, "rb") as f:
        tail: deque[bytes] = deque(f, maxlen=max(0, last))
        for line in tail:
            if (text := _render(line)) is not None:
                print(text, flush=True)
        if not follow:
            return
        pending = b""
        while True:
            chunk = f.readline()
            if not chunk:
                await asyncio.sleep(poll)
                continue
            pending += chunk
            if not pending.endswith(b"\n"):
                continue
            if (text := _render(pending)) is not None:
                print(text, flush=True)
            pending = b""


__all__ = ["follow_events"]
