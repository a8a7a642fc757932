"""Outbox forwarding: every event the node journaled goes upstream to `BCD_EVENTS`, in order, none lost.

The outbox (read by outbox.py) is forwarded in sequence order with
`Nats-Msg-Id`, up to FORWARD_WINDOW events in flight: an event is published at
once on the one upstream connection while fewer than FORWARD_WINDOW wait for
their PubAck (a sliding window, no round trip of its own), and a Bound never
while a Released before it is unacknowledged. A local message is taken out
only after upstream's PubAck, in the background (purge.py). The first
unacknowledged one and all after it are read again from the outbox (from its
sequence) and sent again (upstream drops the repeats by
`Nats-Msg-Id`), one at a time until one succeeds. A new process starts at the
first message still in the outbox. While upstream is away the outbox grows on
disk, the bridge holds at most two windows; nothing is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client
from nats.js.errors import NoStreamResponseError, NotFoundError
from prometheus_client import Counter

from services.gateway_bridge.outbox import PULL_HEARTBEAT_S, OutboxMsg, OutboxReader
from services.gateway_bridge.purge import OutboxPurger
from shared.eventorder import Cards, cards_from_header, shares_gpu
from shared.runtime import LoopGuard, describe
from shared.subjects import MSG_ID_HEADER, NodeSubjects, upstream_event

if TYPE_CHECKING:
    from services.gateway_bridge.upstream import Upstream

#: outbox events sent upstream before the first of them must be acknowledged: a
#: generation's events travel in a few round trips, not three per event.
FORWARD_WINDOW = 64
#: a PubAck is waited for this long after its publish (publish_async futures have no
#: timeout of their own); what is not acked by then is sent again.
ACK_TIMEOUT_S = 5.0


def _header_bytes(headers: dict[str, str]) -> int:
    """What headers add to a message's size: a server's max_payload counts them, nats-py's check does not."""
    return len(b"NATS/1.0\r\n\r\n") + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())


@dataclass
class InFlight:
    msg: OutboxMsg
    event_type: str
    event_id: str
    future: asyncio.Future[Any]
    #: past it without a PubAck, it counts as not acknowledged.
    deadline: float
    #: the cards it names (its GPUS_HEADER; None: every card).
    cards: Cards = None


def _ack_error(fut: asyncio.Future[Any]) -> BaseException | None:
    """Why a publish_async future is not a PubAck (None: it is); taking it, so none is logged as never retrieved."""
    if fut.cancelled():
        return asyncio.TimeoutError(f"no PubAck within {ACK_TIMEOUT_S}s")
    return fut.exception()


async def settle(flight: deque[InFlight], loop: asyncio.AbstractEventLoop) -> None:
    """Wait for what is in flight (each until its deadline); what has no PubAck by then is cancelled."""
    pending = [s.future for s in flight if not s.future.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, max(s.deadline for s in flight) - loop.time()))
    for s in flight:
        # nothing else times them out; a late PubAck for a cancelled one is ignored
        s.future.cancel()
        _ack_error(s.future)


async def send(
    up: Client, node_id: str, up_js: Any, held: deque[OutboxMsg], flight: deque[InFlight], window: int
) -> tuple[OutboxMsg, str, BaseException] | None:
    """Publish from the head of `held` what may go now, in order, without waiting for PubAcks.

    Returns the message it could not publish (it stays at the head), its
    event id and why; None when all went or the rest waits for the
    window, for a Released in flight or for an empty flight.
    """
    deadline = asyncio.get_running_loop().time() + ACK_TIMEOUT_S
    while held and len(flight) < window:
        msg = held[0]
        event_type = msg.subject.rsplit(".", 1)[-1]
        event_id = msg.headers.get(MSG_ID_HEADER, f"{node_id}.seq{msg.seq}")
        cards = cards_from_header(msg.headers) if event_type in ("bound", "released") else None
        if event_type == "bound" and any(s.event_type == "released" and shares_gpu(s.cards, cards) for s in flight):
            # a Bound may take a GPU a Released before it frees: it goes only once every
            # such Released is acked, so not even a refusal of one message in flight lets
            # a control plane see the Bound first (shared.eventorder)
            return None
        headers = {MSG_ID_HEADER: event_id}
        try:
            subject = upstream_event(node_id, event_type)
            size = len(msg.data) + _header_bytes(headers)
            if size > up.max_payload:
                if flight:
                    return None  # it goes once nothing is in flight: nothing behind it goes first
                # the server would close the connection on it, losing what follows
                raise ValueError(f"{size} bytes with headers exceed upstream's max_payload of {up.max_payload}")
            fut = await up_js.publish_async(subject, msg.data, headers=headers)
        except (nats.errors.Error, ValueError) as exc:
            return msg, event_id, exc
        held.popleft()
        # publish_async futures have no timeout of their own
        flight.append(InFlight(msg, event_type, event_id, fut, deadline, cards))
    return None


class Forwarder:
    """The outbox forward: `nc` is the node bus (the outbox), `upstream` where the events go.

    `hello_published` is set once the Hello is upstream: a control plane
    verifies a report against it, so nothing goes before; `forwarded` and
    `errors` are bcd_outbox_forwarded and bcd_outbox_forward_errors;
    `update_depth` measures the outbox again (after a failed forward).
    """

    def __init__(
        self,
        nc: Client,
        subjects: NodeSubjects,
        node_id: str,
        upstream: Upstream,
        hello_published: asyncio.Event,
        outbox_poll: float,
        forwarded: Counter,
        errors: Counter,
        update_depth: Callable[[], Awaitable[None]],
        log: Any,
        stopping: asyncio.Event,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.node_id = node_id
        self.upstream = upstream
        self.hello_published = hello_published
        self.outbox_poll = outbox_poll
        self.forwarded = forwarded
        self.errors = errors
        self.update_depth = update_depth
        self.log = log
        self.stopping = stopping
        #: set when something was journaled (or upstream is back): the idle loop looks at once.
        self.wake = asyncio.Event()
        self.reader: OutboxReader | None = None
        self.purger: OutboxPurger | None = None

    async def on_outbox(self, _: Any) -> None:
        """A writer journaled: look now (the reader has no consumer to be woken by)."""
        self.wake.set()
        if self.reader is not None:
            await self.reader.poke()

    async def run(self) -> None:
        """Forward the outbox upstream: a sliding window of up to FORWARD_WINDOW publishes in flight."""
        stream = self.subjects.outbox_stream
        # a control plane verifies a report against the node's Hello: none goes
        # upstream before the Hello (with this boot's key and boot id) is there
        await self.hello_published.wait()
        up = self.upstream.nc
        assert up is not None
        # one context for the loop's life: publish_async subscribes its reply inbox on
        # its first publish, and the connection re-subscribes it after a reconnect
        up_js = up.jetstream(timeout=5)
        reader = self.reader = OutboxReader(self.nc, stream, self.subjects.outbox_direct_get, FORWARD_WINDOW, self.log)
        purger = self.purger = OutboxPurger(self.nc, stream, reader, self.log)
        purging = asyncio.create_task(purger.run(), name="bridge.outbox-purge")
        loop = asyncio.get_running_loop()
        guard = LoopGuard(self.log, "outbox loop")
        #: read from the outbox, not published yet (what waits behind a Released in flight)
        held: deque[OutboxMsg] = deque()
        #: published, their PubAcks awaited, in outbox order
        flight: deque[InFlight] = deque()
        window, backoff = FORWARD_WINDOW, 0.5
        try:
            while not self.stopping.is_set():
                if not flight:
                    await self.upstream.connected.wait()
                async with guard:
                    if not reader.ready and not flight:
                        # cleared before the open: an event journaled during it wakes the wait at once
                        self.wake.clear()
                        try:
                            await reader.open()
                        except NotFoundError:
                            # the bus setup has not made the stream yet
                            with contextlib.suppress(asyncio.TimeoutError):
                                await asyncio.wait_for(self.wake.wait(), self.outbox_poll)
                            continue
                        except (nats.errors.Error, asyncio.TimeoutError) as exc:
                            self.log.warning("outbox unreadable; retrying", error=describe(exc))
                            await asyncio.sleep(1)
                            continue
                    room = window - len(held) - len(flight)
                    if room > 0 and reader.ready:
                        held.extend(await reader.take(room))
                    refused = await send(up, self.node_id, up_js, held, flight, window)
                    if not flight:
                        if refused is None:
                            # idle (held is empty: with nothing in flight, the head of held always goes or is refused)
                            # (the depth gauge is the depth loop's: no round trip here stands between an event and its forward)
                            done, _ = await asyncio.wait({reader.arrival()}, timeout=min(self.outbox_poll, PULL_HEARTBEAT_S))
                            if not done:
                                reader.check()
                            continue
                        msg, event_id, exc = refused
                        reader.rewind(msg.seq)
                        held.clear()
                        window = 1
                        backoff = await self._forward_failed(event_id, exc, backoff)
                        continue
                    # wait for the oldest PubAck; also for new messages while they could go at once
                    head = flight[0]
                    waits: set[asyncio.Future[Any]] = {head.future}
                    if refused is None and not held and len(flight) < window and reader.ready:
                        waits.add(reader.arrival())
                    await asyncio.wait(waits, timeout=max(0.0, head.deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED)
                    failed: tuple[InFlight, BaseException] | None = None
                    while flight and flight[0].future.done():
                        sent = flight.popleft()
                        exc = _ack_error(sent.future)
                        if exc is not None:
                            failed = (sent, exc)
                            break
                        self.upstream.found("stream BCD_EVENTS")
                        backoff, window = 0.5, FORWARD_WINDOW
                        self.forwarded.labels(type=sent.event_type).inc()
                        self.log.debug("event forwarded", event_id=sent.event_id, type=sent.event_type)
                        purger.add(sent.msg)
                    if failed is None and flight and loop.time() >= flight[0].deadline:
                        sent = flight.popleft()
                        sent.future.cancel()
                        failed = (sent, asyncio.TimeoutError(f"no PubAck within {ACK_TIMEOUT_S}s"))
                    if failed is None:
                        continue
                    # it and everything after it go again (upstream drops the repeats by
                    # Nats-Msg-Id), read again from the outbox, one at a time until one goes
                    # through: a message upstream refuses is retried alone, so the window
                    # behind it is not sent ahead of it again and again
                    await settle(flight, loop)
                    flight.clear()
                    held.clear()
                    sent, exc = failed
                    reader.rewind(sent.msg.seq)
                    window = 1
                    backoff = await self._forward_failed(sent.event_id, exc, backoff)
        finally:
            for sent in flight:
                sent.future.cancel()
            purging.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await purging

    async def _forward_failed(self, event_id: str, exc: BaseException, backoff: float) -> float:
        """Say why, wait `backoff`; the next one."""
        if isinstance(exc, (nats.errors.NoRespondersError, NoStreamResponseError)):
            self.upstream.waiting_for("stream BCD_EVENTS")
            await asyncio.sleep(backoff)
            return min(backoff * 2, 5.0)
        self.errors.inc()
        self.log.warning("forwarding an event failed; it stays in the outbox", event_id=event_id, error=str(exc) or type(exc).__name__)
        await asyncio.sleep(backoff)
        await self.update_depth()
        return min(backoff * 2, 5.0)

    async def close(self) -> None:
        """At the stop (the loop is gone): what upstream acknowledged is deleted now if it can be
        (else forwarded again after the restart, and dropped upstream)."""
        if self.purger is not None:
            await self.purger.flush(2.0)
        if self.reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.reader.close(), 1.0)
                await asyncio.wait_for(asyncio.gather(*self.reader._background, return_exceptions=True), 1.0)


__all__ = ["ACK_TIMEOUT_S", "FORWARD_WINDOW", "Forwarder", "send"]
