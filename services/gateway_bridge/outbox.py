"""Reading the node-bus outbox: what the converger journaled, in stream order, as it is stored.

The bridge forwards the outbox upstream (forward.py) and takes out what
upstream acknowledged (purge.py); this module owns only the reading: an
ephemeral pull consumer that takes no acks (`OutboxReader`), so an event is
delivered the moment it is stored, with its stream sequence, and at most two
windows of it are ever held in memory.
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

import nats
import nats.errors
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

#: the outbox consumer's pull request asks the server for heartbeats this often while it waits ...
PULL_HEARTBEAT_S = 1.0
#: ... and is made again this often (the server answers 408 when it expires).
PULL_EXPIRES_S = 30.0
#: the server drops the bridge's consumer after this long without a pull request.
CONSUMER_INACTIVE_S = 60.0


@dataclass(frozen=True)
class OutboxMsg:
    """One outbox message as the bridge's consumer delivered it."""

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
    """The outbox as the node-bus server stores it: an ephemeral pull consumer that takes no acks.

    One pull request for up to `window` messages (lingering PULL_EXPIRES_S,
    with idle heartbeats) waits at the server whenever fewer than `window`
    delivered messages wait here, so a message is delivered the moment it is
    stored, with its stream sequence in its metadata, and no more than two
    windows are ever held in memory (while upstream is away the outbox grows
    on disk, not here). The consumer never moves back by itself: `rewind(seq)`
    makes a new one from `seq` (what the bridge forwards again after a
    failure is read again, so a message an operator took out is not sent). A
    consumer lost (a node-bus restart, no heartbeat for 3 x
    PULL_HEARTBEAT_S, a 409 Consumer Deleted) is made again after the last
    message delivered; a new process, and a stream made again (another
    creation time), start at the first message still in the stream.
    """

    def __init__(self, nc: Client, stream: str, filter_subject: str, window: int, log: Any) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=5)
        self.stream = stream
        self.filter_subject = filter_subject
        self.window = window
        self.log = log
        self.buffer: deque[OutboxMsg] = deque()
        #: the stream sequence to read from next (None: the stream's first).
        self.next_seq: int | None = None
        #: incremented when the stream is found made again
        self.epoch = 0
        self.created: datetime | None = None
        self.consumer: str | None = None
        self.sub: Any = None
        self.inbox = ""
        self.token = 0
        #: messages the outstanding pull request may still deliver (0: none outstanding).
        self.requested = 0
        #: when the server last said anything to the consumer's inbox (or a request went).
        self.heard = 0.0
        self.lost = True
        self._arrival: asyncio.Future[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def ready(self) -> bool:
        return self.sub is not None and not self.lost

    async def open(self) -> None:
        """A new consumer from `next_seq` (NotFoundError while there is no stream)."""
        await self.close()
        info = await self.js.stream_info(self.stream)
        state = info.state
        made_again = (self.created is not None and info.created is not None and info.created != self.created) or (
            self.next_seq is not None and self.next_seq > state.last_seq + 1
        )
        if made_again:
            # what was delivered from the old one still goes upstream, but is not deleted from this one
            self.log.warning("the outbox stream was made again; reading it from its start", first_seq=state.first_seq)
            self.epoch += 1
            self.next_seq = None
        self.created = info.created
        self.token += 1
        token = self.token

        async def on_msg(msg: Any) -> None:
            if token == self.token:
                await self._on_msg(msg)

        self.inbox = self.nc.new_inbox()
        self.sub = await self.nc.subscribe(self.inbox, cb=on_msg)
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            filter_subject=self.filter_subject,
            inactive_threshold=CONSUMER_INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
        )
        if self.next_seq is None:
            config.deliver_policy = DeliverPolicy.ALL
        else:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self.next_seq
        try:
            self.consumer = (await self.js.add_consumer(self.stream, config=config)).name
        except BaseException:
            await self.close()
            raise
        self.lost = False
        self.requested = 0
        await self._request()

    async def take(self, limit: int) -> list[OutboxMsg]:
        """Up to `limit` delivered messages, in stream order, without waiting."""
        out = [self.buffer.popleft() for _ in range(min(limit, len(self.buffer)))]
        await self._request()
        return out

    def arrival(self) -> asyncio.Future[None]:
        """Done when the consumer delivers something (or needs looking at)."""
        if self._arrival is None or self._arrival.done():
            self._arrival = asyncio.get_running_loop().create_future()
            if self.buffer or not self.ready:
                self._arrival.set_result(None)
        return self._arrival

    def rewind(self, seq: int) -> None:
        """Read again from `seq` on: what was delivered from it on is dropped, a new consumer made."""
        self.token += 1  # nothing the old consumer still delivers lands in the buffer
        self.buffer.clear()
        self.next_seq = seq
        self.requested = 0
        self.lost = True

    def check(self) -> None:
        """A pull request the server has said nothing about for 3 heartbeats: the consumer is lost."""
        if self.ready and self.requested and time.monotonic() - self.heard > 3 * PULL_HEARTBEAT_S:
            self.log.warning("the outbox consumer went silent; making it again", next_seq=self.next_seq)
            self.lost = True

    async def close(self) -> None:
        self.token += 1
        self.requested = 0
        self.lost = True
        sub, self.sub = self.sub, None
        name, self.consumer = self.consumer, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        if name is not None:
            # in the background, so a reopen never waits for it; the server drops
            # it after CONSUMER_INACTIVE_S anyway
            task = asyncio.create_task(self._delete_consumer(name))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _delete_consumer(self, name: str) -> None:
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await self.js.delete_consumer(self.stream, name)

    async def _request(self) -> None:
        if not self.ready or self.requested > 0 or len(self.buffer) >= self.window:
            return
        body = {"batch": self.window, "expires": int(PULL_EXPIRES_S * 1e9), "idle_heartbeat": int(PULL_HEARTBEAT_S * 1e9)}
        self.requested = self.window
        self.heard = time.monotonic()
        # a request that does not go (the bus is away) is seen by `check` as silence
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}", json.dumps(body).encode(), reply=self.inbox)

    def _wake(self) -> None:
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    async def _on_msg(self, msg: Any) -> None:
        self.heard = time.monotonic()
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is None:
            try:
                seq = msg.metadata.sequence.stream
            except (AttributeError, IndexError, ValueError, TypeError):
                return  # not a JetStream delivery
            self.buffer.append(OutboxMsg(seq, msg.subject, msg.data or b"", dict(headers), self.epoch))
            self.next_seq = seq + 1
            self.requested -= 1
            self._wake()
        elif status == "100":
            return  # idle heartbeat
        elif status in ("404", "408"):
            self.requested = 0  # the request expired: another one
        elif status == "409" and "deleted" not in _description(headers).lower():
            self.requested = 0  # e.g. a leadership change: ask again
        else:
            # 409 Consumer Deleted, 503 no responders (no such consumer): make it again
            self.log.info("the outbox consumer is gone; making it again", status=status, next_seq=self.next_seq)
            self.lost = True
            self._wake()
            return
        if self.requested <= 0:
            self.requested = 0
            await self._request()


__all__ = ["CONSUMER_INACTIVE_S", "PULL_EXPIRES_S", "PULL_HEARTBEAT_S", "OutboxMsg", "OutboxReader"]
