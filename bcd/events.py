"""`bcd events`: follow the reference control plane's verified event log (`events.jsonl`)."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path

import msgspec

from controlplane.ledger import EventRecord, format_line
from shared.schemas.codec import BoundedDecoder

_DECODER = BoundedDecoder(EventRecord, max_bytes=4 * 1024 * 1024, what="event record")


def _render(line: bytes, as_json: bool = False) -> str | None:
    """One record as its text line, or (`as_json`) as one line of JSON; None for a line that is no record."""
    try:
        rec = _DECODER.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return msgspec.json.encode(rec).decode() if as_json else format_line(rec)


async def follow_events(path: Path, *, follow: bool = True, last: int | None = 20, poll: float = 0.3, as_json: bool = False) -> None:
    """Print the last `last` events (every one when None), then (with `follow`) every new one as it is appended.

    `as_json`: each event is one line of JSON (an `EventRecord`), a stream `jq` reads as it comes.
    """
    while not path.exists():
        if not follow:
            if not as_json:  # JSON lines: no event is an empty stream
                print(f"(no events yet: {path} does not exist)")
            return
        await asyncio.sleep(poll)
    with open(path, "rb") as f:
        tail: deque[bytes] = deque(f, maxlen=None if last is None else max(0, last))
        for line in tail:
            if (text := _render(line, as_json)) is not None:
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
            if (text := _render(pending, as_json)) is not None:
                print(text, flush=True)
            pending = b""


__all__ = ["follow_events"]
