"""Small JetStream reads nats-py does not expose in full, or not without stream or consumer rights.

The stream's first timestamp (`stream_depth`), and the last value of one KV key by direct get
(`last_value`): a service reads its bucket with the one direct-get subject its account
imports, never through nats-py's KeyValue (which asks for the stream's info first)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from nats.aio.client import Client


@dataclass(frozen=True)
class StreamDepth:
    messages: int
    bytes: int
    #: when the oldest message still in the stream was stored (None when empty).
    oldest: datetime | None


class StreamMissing(Exception):
    pass


async def stream_depth(nc: Client, stream: str, timeout: float = 3.0) -> StreamDepth:
    msg = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=timeout)
    info = json.loads(msg.data)
    if "error" in info:
        raise StreamMissing(info["error"].get("description", "stream not found"))
    state = info.get("state", {})
    oldest = None
    if state.get("messages") and state.get("first_ts") and not state["first_ts"].startswith("0001-"):
        # nanosecond precision: trim to what fromisoformat takes
        ts = state["first_ts"].replace("Z", "+00:00")
        head, _, tail = ts.partition(".")
        if tail:
            frac, _, zone = tail.partition("+")
            ts = f"{head}.{frac[:6]}+{zone}" if zone else f"{head}.{frac[:6]}"
        oldest = datetime.fromisoformat(ts)
    return StreamDepth(messages=int(state.get("messages", 0)), bytes=int(state.get("bytes", 0)), oldest=oldest)


async def last_value(nc: Client, get_subject: str, timeout: float = 3.0) -> bytes | None:
    """The last value of one KV key through its direct-get subject; None when it has none (or
    was deleted). StreamMissing when the bucket is not there (nobody answers)."""
    import nats.errors

    try:
        msg = await nc.request(get_subject, b"", timeout=timeout)
    except nats.errors.NoRespondersError:
        raise StreamMissing(f"no bucket answers {get_subject}") from None
    headers = msg.headers or {}
    status = headers.get("Status") or headers.get("Nats-Status")
    if status == "404" or headers.get("KV-Operation") in ("DEL", "PURGE"):
        return None
    if status:
        raise StreamMissing(f"{get_subject}: status {status}")
    return msg.data


__all__ = ["StreamDepth", "StreamMissing", "stream_depth", "last_value"]
