"""Taking forwarded events out of the outbox, in the background, once upstream has acknowledged them.

Its own job so the forwarding never waits for a purge: an event leaves the
node only after upstream's PubAck, and the acknowledged stretch is purged in
one request (`OutboxPurger`), tried again until it goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import nats.errors
from nats.aio.client import Client

from services.gateway_bridge.outbox import OutboxMsg, OutboxReader
from shared.runtime import LoopGuard, describe


class OutboxPurger:
    """Takes forwarded messages out of the outbox in the background, so the next window never waits for it.

    Upstream acknowledges the outbox in order, so what is forwarded is always
    everything before one sequence (the stream holds nothing the reader does
    not read): one purge up to it (`{"seq": N}` keeps N and all after) takes a
    whole window in one request and one disk sync, where a delete each would
    cost one of each per message (1000 deletes took ~2 s on the test machine's
    bus, which syncs every write, slowing the converger's own appends). A purge that fails is tried again, backing off, or covered by the
    next; a bridge stopped before it forwards that stretch again after its
    restart (upstream drops the repeats by `Nats-Msg-Id`). What was read from a
    stream since made again is never purged from the new one.
    """

    def __init__(self, nc: Client, stream: str, reader: OutboxReader, log: Any) -> None:
        self.nc = nc
        self.stream = stream
        self.reader = reader
        self.log = log
        #: everything below it (in `epoch`) is acknowledged upstream ...
        self.upto = 0
        self.epoch = 0
        #: ... and everything below this is purged already.
        self.purged = 0
        self.wake = asyncio.Event()

    def add(self, msg: OutboxMsg) -> None:
        """`msg` and everything before it are acknowledged upstream."""
        if msg.epoch != self.reader.epoch:
            return  # read from a stream made again since
        if msg.epoch != self.epoch:
            self.epoch, self.upto, self.purged = msg.epoch, 0, 0
        self.upto = max(self.upto, msg.seq + 1)
        self.wake.set()

    async def run(self) -> None:
        guard = LoopGuard(self.log, "outbox purge")
        backoff = 0.5
        while True:
            if self.purged >= self.upto:
                await self.wake.wait()
            self.wake.clear()
            async with guard:
                backoff = await self._purge(backoff)

    async def _purge(self, backoff: float) -> float:
        """One purge up to `upto`; the backoff for the next failure."""
        epoch, upto = self.epoch, self.upto
        if upto <= self.purged:
            return backoff
        if epoch != self.reader.epoch:
            self.purged = upto  # the stream was made again: nothing of the old one is purged from it
            return 0.5
        # never an empty request: that would purge the whole stream
        assert upto >= 2
        try:
            msg = await self.nc.request(f"$JS.API.STREAM.PURGE.{self.stream}", json.dumps({"seq": upto}).encode(), timeout=5)
            reply = json.loads(msg.data)
            if "error" in reply and reply["error"].get("code") != 404:
                raise nats.errors.Error(f"{reply['error'].get('description', 'purge refused')} ({reply['error'].get('err_code')})")
        except (nats.errors.Error, asyncio.TimeoutError, ValueError) as exc:
            self.log.warning(
                "taking forwarded events out of the outbox failed; trying again", below_seq=upto, error=describe(exc), retry_in_s=backoff
            )
            await asyncio.sleep(backoff)
            self.wake.set()
            return min(backoff * 2, 5.0)
        if self.epoch == epoch:
            self.purged = max(self.purged, upto)
        return 0.5

    async def flush(self, timeout: float) -> None:
        """At the stop (its task is gone): the last purge, if it goes within `timeout`."""

        async def last() -> None:
            backoff = 0.1
            while self.purged < self.upto:
                backoff = await self._purge(backoff)

        with contextlib.suppress(asyncio.TimeoutError, nats.errors.Error):
            await asyncio.wait_for(last(), timeout)


__all__ = ["OutboxPurger"]
