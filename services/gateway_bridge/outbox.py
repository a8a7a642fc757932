"""Reading the node-bus outbox: what the converger journaled, in stream order, as it is stored.

The bridge forwards the outbox upstream (forward.py) and takes out what
upstream acknowledged (purge.py); this module owns only the reading, with
batched direct gets by sequence (`OutboxReader`). No consumer exists: no
service may make one (docs/security.md; a consumer's deliver subject would let
its maker have the server publish for it), and a direct get keeps no state at
the server, so reading again from any sequence is just asking for it. The
writers say when they journaled (`converger.journaled`, `inventory.journaled`:
`poke`), and an idle bridge looks anyway every poll interval, so an event is
read the moment it is stored or a poll later; at most two windows of it are
ever held in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import nats.errors
from nats.aio.client import Client

#: an idle bridge looks at the outbox at least this often (the writers' notices can be lost)
PULL_HEARTBEAT_S = 1.0
#: one batched direct get waits this long for its end-of-batch before it is asked again
FETCH_TIMEOUT_S = 5.0
#: an idle reader reads the stream's info again this often: a stream made again is found
REVALIDATE_S = 10.0
#: one batch carries at most this many bytes of messages (the server stops the batch there)
FETCH_MAX_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class OutboxMsg:
    """One outbox message as a direct get returned it."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]
    #: the incarnation of the stream it was read from: it is deleted from that one only.
    epoch: int


def _description(headers: dict[Any, str]) -> str:
    """A status message's Description (nats-py keys it by an enum member equal to the string)."""
    return next((str(v) for k, v in headers.items() if k == "Description"), "")


class OutboxReader:
    """The outbox as the node-bus server stores it, read by sequence with batched direct gets.

    One batch for up to `window` minus what waits here is asked whenever fewer
    than `window` read messages wait and something may be new (a writer's notice,
    `poke`; the idle poll, `check`; a batch that came back full), so no more than
    two windows are ever held. `rewind(seq)` reads again from `seq` (what the
    bridge forwards again after a failure is read again, so a message an
    operator took out is not sent). A new process, and a stream made again
    (another creation time, found at `open` or by the idle revalidation), start
    at the first message still in the stream.
    """

    def __init__(self, nc: Client, stream: str, direct_get: str, window: int, log: Any) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=5)
        self.stream = stream
        self.direct_get = direct_get
        self.window = window
        self.log = log
        self.buffer: deque[OutboxMsg] = deque()
        #: the stream sequence to read from next (None: the stream's first).
        self.next_seq: int | None = None
        #: incremented when the stream is found made again
        self.epoch = 0
        self.created: datetime | None = None
        self.sub: Any = None
        self.inbox = ""
        #: the batch being read: its reply subject's last token (0: none in flight)
        self.token = 0
        self._tokens = 0
        #: what the batch in flight was asked for, and has brought so far
        self._expect = 0
        self._got = 0
        self._fetch_deadline = 0.0
        #: something may have been stored since the batch in flight was asked
        self._again = False
        self.opened_at = 0.0
        self.lost = True
        self._arrival: asyncio.Future[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def ready(self) -> bool:
        return self.sub is not None and not self.lost

    async def open(self) -> None:
        """Read from `next_seq` (NotFoundError while there is no stream)."""
        await self.close()
        info = await self.js.stream_info(self.stream)
        state = info.state
        made_again = (self.created is not None and info.created is not None and info.created != self.created) or (
            self.next_seq is not None and self.next_seq > state.last_seq + 1
        )
        if made_again:
            # what was read from the old one still goes upstream, but is not deleted from this one
            self.log.warning("the outbox stream was made again; reading it from its start", first_seq=state.first_seq)
            self.epoch += 1
            self.next_seq = None
        self.created = info.created
        self.inbox = self.nc.new_inbox()
        self.sub = await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_msg)
        self.lost = False
        self.opened_at = time.monotonic()
        await self.poke()

    async def take(self, limit: int) -> list[OutboxMsg]:
        """Up to `limit` read messages, in stream order, without waiting."""
        out = [self.buffer.popleft() for _ in range(min(limit, len(self.buffer)))]
        await self._fetch()
        return out

    def arrival(self) -> asyncio.Future[None]:
        """Done when a batch brought something (or the reader needs looking at)."""
        if self._arrival is None or self._arrival.done():
            self._arrival = asyncio.get_running_loop().create_future()
            if self.buffer or not self.ready:
                self._arrival.set_result(None)
        return self._arrival

    async def poke(self) -> None:
        """Something may have been journaled: read it (after the batch in flight, if one is)."""
        self._again = True
        await self._fetch()

    def rewind(self, seq: int) -> None:
        """Read again from `seq` on: what was read from it on is dropped."""
        self.token = 0  # what the batch in flight still brings is not kept
        self.buffer.clear()
        self.next_seq = seq
        self._again = True
        self._in_background(self._fetch())

    def _in_background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def check(self) -> None:
        """The idle look (every poll interval): a batch that never ended is given up, the
        stream's identity is checked again now and then (`open`), and the outbox is read."""
        if not self.ready:
            return
        now = time.monotonic()
        if self.token and now > self._fetch_deadline:
            self.log.warning("an outbox read got no end of batch; reading again", next_seq=self.next_seq)
            self.token = 0
        if now - self.opened_at > REVALIDATE_S:
            self.lost = True  # the forwarder opens it again: a stream made again is found there
            self._wake()
            return
        self._again = True
        self._in_background(self._fetch())

    async def close(self) -> None:
        self.token = 0
        self.lost = True
        sub, self.sub = self.sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _fetch(self) -> None:
        room = self.window - len(self.buffer)
        if not self.ready or self.token or room <= 0 or not self._again:
            return
        self._again = False
        self._tokens += 1
        self.token = self._tokens
        self._fetch_deadline = time.monotonic() + FETCH_TIMEOUT_S
        body = {"seq": self.next_seq or 1, "batch": room, "max_bytes": FETCH_MAX_BYTES}
        self._expect = room
        self._got = 0
        # a request that does not go (the bus is away) is given up by `check`
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(self.direct_get, json.dumps(body).encode(), reply=f"{self.inbox}.{self.token}")

    def _wake(self) -> None:
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    async def _on_msg(self, msg: Any) -> None:
        if not self.token or msg.subject != f"{self.inbox}.{self.token}":
            return  # a batch given up or rewound past
        headers = dict(msg.headers or {})
        status = headers.get("Status")
        if status is None:
            try:
                seq = int(headers["Nats-Sequence"])
                subject = headers["Nats-Subject"]
            except (KeyError, ValueError):
                return  # not a stored message
            self.buffer.append(OutboxMsg(seq, subject, msg.data or b"", headers, self.epoch))
            self.next_seq = seq + 1
            self._got += 1
            self._wake()
            return
        # the batch ended: 204 EOB (its Nats-Num-Pending says whether more is stored), 404
        # nothing at or after next_seq, anything else (408, 503 no stream) a look later
        self.token = 0
        if status == "204":
            try:
                pending = int(headers.get("Nats-Num-Pending", "0"))
            except ValueError:
                pending = 0
            if pending > 0 or self._got >= self._expect:
                self._again = True
        elif status != "404":
            self.log.info("the outbox read ended early", status=status, description=_description(headers), next_seq=self.next_seq)
        await self._fetch()


__all__ = ["FETCH_TIMEOUT_S", "PULL_HEARTBEAT_S", "REVALIDATE_S", "OutboxMsg", "OutboxReader"]
