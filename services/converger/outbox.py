"""The node's durable outbox and the signer, as ports of the converger.

Bound and Released are signed by the signer first; every event then goes
into the node-bus JetStream stream `BCD_OUTBOX_<node>` with `Nats-Msg-Id` set
to its deterministic event id, so a replay after a crash is dropped by the
stream's duplicate window. An event counts as sent once JetStream acked it
(the bus syncs every write: `sync_interval: always`); the bridge drains the
stream upstream.

A pass reports in batches: `BusSigner.sign_many` signs its reports in one
`sign_batch` request (cut to stay far below the bus's max payload), and
`JetStreamOutbox.publish_many` sends a wave of events in order without
waiting for each PubAck in turn (JetStream async publish), then awaits the
acks in order. The stream stores a connection's messages in the order sent.

The converger never makes or changes the stream (no service may: docs/security.md):
the bus setup makes it (bcd/busstreams.py) at the size asked, or smaller where the
node-bus JetStream has too little room. `recheck()` reads what is there before each
pass: the limits `has_room` keeps to, a `warning` when it is smaller than asked (its
metadata says what was asked), an `error` while there is none (every event waits,
retryable).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import nats.errors
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from shared import logs
from shared.eventorder import Cards, gpus_header
from shared.busstreams import WANTED_BYTES_KEY, reduced_warning
from shared.runtime import ServiceCallError, call
from shared.schemas import (
    ATTESTED_REPORT_CODEC,
    NODE_EVENT_CODEC,
    REPORT_BODY_CODEC,
    REPORT_PURPOSE,
    SIGN_BATCH_MAX,
    SIGN_BATCH_REPLY_CODEC,
    AttestedEvent,
    AttestedReport,
    BadMessage,
    SignBatchRequest,
    SignItem,
    SignRequest,
)
from shared.schemas import encode
from shared.subjects import MSG_ID_HEADER, NodeSubjects

EVENT_TYPE_HEADER = "Bcd-Event-Type"
#: the event types that travel as a signed AttestedReport; the others are plain NodeEvents.
ATTESTED_TYPES = ("bound", "released")

log = logs.get_logger("bcd.converger.outbox")


class OutboxError(Exception):
    """The event did not reach the outbox (or the signer); retryable."""


def check_event(event_type: str, payload: bytes) -> None:
    """Journal only what upstream can decode: an attested report (bound, released) or a NodeEvent of that type.

    The same bounded decode a control plane runs (one extra decode per event);
    a payload its own schema refuses is an OutboxError naming the field, so
    the pass says why and nothing undecodable reaches the outbox.
    """
    try:
        if event_type in ATTESTED_TYPES:
            REPORT_BODY_CODEC.decode(ATTESTED_REPORT_CODEC.decode(payload).body)
            return
        event = NODE_EVENT_CODEC.decode(payload)
    except BadMessage as exc:
        raise OutboxError(f"outbox: the {event_type} event violates its schema and is not journaled: {exc}") from None
    tag = type(event).__struct_config__.tag
    if tag != event_type:
        raise OutboxError(f"outbox: a {tag} event journaled as {event_type}")


#: what one batch sign request carries at most, encoded: far below the node bus's 1 MiB
#: max payload, so the reply (each body base64'd and signed, ~1.4x) fits too.
SIGN_BATCH_BYTES = 256 * 1024
#: how long a pipelined publish waits for all its acks.
ACK_TIMEOUT_S = 5.0
#: how long a has_room reading well below the limits stands for the next ones.
ROOM_VOUCHES_S = 5.0
#: how long a found outbox stream's limits stand before a pass reads them again.
RECHECK_S = 30.0


class Signer(Protocol):
    async def sign(self, event_id: str, event: AttestedEvent) -> AttestedReport: ...

    async def sign_many(self, items: list[tuple[str, AttestedEvent]]) -> list[AttestedReport]:
        """One report per (event id, event), in order; OutboxError when any could not be signed."""
        ...


#: one event of a pipelined publish: (event type, event id, payload).
OutboxItem = tuple[str, str, bytes]


class Outbox(Protocol):
    async def publish(self, event_type: str, event_id: str, payload: bytes) -> None: ...

    async def publish_many(
        self, items: list[OutboxItem], acked: Callable[[OutboxItem], None] = ..., gpus: Mapping[str, Cards] | None = None
    ) -> list[OutboxError | None]:
        """Publish every item in order without waiting for each ack in turn; then wait for all.

        The result has one entry per item: None when journaled, else why not.
        `acked` is called for each acked item, in order (a crash point).
        `gpus`: the cards each event id names, put in its GPUS_HEADER (shared.eventorder).
        """
        ...

    async def has_room(self) -> bool:
        """False when the outbox is full: new binds wait (retryable) until it drains."""
        ...


class BusSigner:
    def __init__(self, nc: Client, subjects: NodeSubjects, timeout: float = 5.0, unreached: Callable[[str], None] = lambda _: None) -> None:
        self.nc, self.subjects, self.timeout = nc, subjects, timeout
        #: told when no signer answered (comeback.py: a pass runs again once one does)
        self.unreached = unreached

    def _error(self, exc: BaseException) -> OutboxError:
        if isinstance(exc, (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError)):
            self.unreached("signer")
        return OutboxError(f"signer: {exc or type(exc).__name__}")

    async def sign(self, event_id: str, event: AttestedEvent) -> AttestedReport:
        try:
            return await call(
                self.nc,
                self.subjects.signer_sign,
                SignRequest(purpose="attested-report", event_id=event_id, event=event),
                ATTESTED_REPORT_CODEC,
                timeout=self.timeout,
            )
        except (ServiceCallError, nats.errors.Error, TimeoutError) as exc:
            raise self._error(exc) from None

    async def sign_many(self, items: list[tuple[str, AttestedEvent]]) -> list[AttestedReport]:
        """As few `sign_batch` requests as the bounds allow (usually one per pass)."""
        reports: list[AttestedReport] = []
        for chunk in sign_chunks(items):
            try:
                reply = await call(
                    self.nc,
                    self.subjects.signer_sign_batch,
                    SignBatchRequest(purpose=REPORT_PURPOSE, items=[SignItem(event_id=i, event=e) for i, e in chunk]),
                    SIGN_BATCH_REPLY_CODEC,
                    timeout=self.timeout,
                )
            except (ServiceCallError, nats.errors.Error, TimeoutError) as exc:
                raise self._error(exc) from None
            reports.extend(checked_reports(chunk, reply.reports))
        return reports


def sign_chunks(items: list[tuple[str, AttestedEvent]]) -> list[list[tuple[str, AttestedEvent]]]:
    """Cut items into requests of at most SIGN_BATCH_MAX items and about SIGN_BATCH_BYTES each."""
    chunks: list[list[tuple[str, AttestedEvent]]] = []
    size = 0
    for item in items:
        n = len(encode(item[1])) + len(item[0]) + 64
        if not chunks or len(chunks[-1]) >= SIGN_BATCH_MAX or size + n > SIGN_BATCH_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += n
    return chunks


def checked_reports(items: list[tuple[str, AttestedEvent]], reports: list[AttestedReport]) -> list[AttestedReport]:
    """The signer's reports, one per item, each for its item's event id and event (else OutboxError)."""
    if len(reports) != len(items):
        raise OutboxError(f"signer: {len(reports)} reports for {len(items)} events")
    for (event_id, event), report in zip(items, reports):
        try:
            body = REPORT_BODY_CODEC.decode(report.body)
        except BadMessage as exc:
            raise OutboxError(f"signer: the report for {event_id} does not decode: {exc}") from None
        if body.event_id != event_id or body.event != event:
            raise OutboxError(f"signer: the report for {event_id} is for another event ({body.event_id})")
    return reports


class JetStreamOutbox:
    """Messages leave the stream only when the bridge deletes them after upstream's PubAck.

    The stream (made by the bus setup) is bounded (`max_msgs`, `max_bytes`) with
    discard-new: a full outbox refuses new events instead of dropping old ones, and
    `has_room` lets a pass hold back new binds (with headroom for the releases and
    failures that must still be reported).
    """

    def __init__(self, nc: Client, subjects: NodeSubjects, *, headroom: int = 64, timeout: float = 5.0) -> None:
        self.js = nc.jetstream(timeout=timeout)
        self.nc = nc
        self.subjects = subjects
        self.headroom = headroom
        #: the stream's limits, as last read (recheck)
        self.max_msgs = 0
        self.max_bytes = 0
        #: the stream exists (recheck found it).
        self.ready = False
        #: the outbox is smaller than asked (the operator should know), or "".
        self.warning = ""
        #: the outbox has no stream: the bus setup has not made it (yet), or "".
        self.error = ""
        #: (messages, bytes, loop time) of the stream at the last has_room reading.
        self._room_known: tuple[int, int, float] | None = None
        #: (events, bytes) journaled since that reading.
        self._since = (0, 0)
        #: loop time of the last recheck that read the stream
        self._read_at = 0.0

    async def has_room(self) -> bool:
        # The last reading vouches for a few seconds when it was below half the limits,
        # counting what this converger journaled since: the outbox only grows by events
        # (a few per pass from the other services) and shrinks as the bridge drains it.
        known = self._room_known
        if known is not None:
            messages, size, at = known
            if (
                asyncio.get_running_loop().time() - at < ROOM_VOUCHES_S
                and messages + self._since[0] + self.headroom < self.max_msgs // 2
                and size + self._since[1] < self.max_bytes * 0.45
            ):
                return True
        try:
            info = await self.js.stream_info(self.subjects.outbox_stream)
        except (nats.errors.Error, TimeoutError):
            self._room_known = None
            return False
        self._limits(info)
        self._room_known = (info.state.messages, info.state.bytes, asyncio.get_running_loop().time())
        self._since = (0, 0)
        return info.state.messages + self.headroom < self.max_msgs and info.state.bytes < self.max_bytes * 0.9

    def _limits(self, info: Any) -> None:
        self.max_msgs = info.config.max_msgs if (info.config.max_msgs or 0) > 0 else 2**63 - 1
        self.max_bytes = info.config.max_bytes if (info.config.max_bytes or 0) > 0 else 2**63 - 1
        # never more headroom than a quarter of the outbox
        self.headroom = min(self.headroom, max(1, self.max_msgs // 4))

    async def recheck(self) -> None:
        """Read the stream the bus setup made: its limits, whether it is smaller than asked.

        Before each pass; a stream found stands for RECHECK_S (a setup run again may have
        grown it), a missing one is looked for every time."""
        now = asyncio.get_running_loop().time()
        if self.ready and now - self._read_at < RECHECK_S:
            return
        self._read_at = now
        try:
            info = await self.js.stream_info(self.subjects.outbox_stream)
        except NotFoundError:
            self._missing()
            return
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("the outbox stream could not be read", error=str(exc) or type(exc).__name__)
            return
        self._limits(info)
        self.ready, self.error = True, ""
        try:
            wanted = int((info.config.metadata or {}).get(WANTED_BYTES_KEY, "0"))
        except ValueError:
            wanted = 0
        warning = reduced_warning(self.max_bytes, wanted) if wanted else ""
        if warning and warning != self.warning:
            log.warning("outbox stream smaller than asked: JetStream refused the full reservation", granted_bytes=self.max_bytes, wanted_bytes=wanted)
        self.warning = warning

    def _missing(self) -> None:
        if not self.error:
            log.error("no outbox stream: no event can be journaled until the bus setup makes it", stream=self.subjects.outbox_stream)
        self.ready = False
        self.warning = ""
        self.error = (
            f"outbox missing: the node bus has no stream {self.subjects.outbox_stream}; the bus setup makes it "
            "(`bcd up`, bcd-bus-setup.service, the compose bus-setup container) and says why it could not "
            "(insufficient storage: free space on the node bus's store or lower --outbox-max-bytes)"
        )

    async def publish(self, event_type: str, event_id: str, payload: bytes) -> None:
        check_event(event_type, payload)
        try:
            await self.js.publish(
                self.subjects.outbox_subject(event_type),
                payload,
                headers={MSG_ID_HEADER: event_id, EVENT_TYPE_HEADER: event_type},
            )
        except (nats.errors.Error, TimeoutError) as exc:
            raise self._error(exc) from None
        self._since = (self._since[0] + 1, self._since[1] + len(payload))
        await self._journaled()

    async def _journaled(self) -> None:
        """Tell the bridge there is something to read (it reads the outbox with direct gets and
        has no consumer to be woken by); lost, it finds it at its next look anyway."""
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(self.subjects.converger_journaled, b"")

    def _error(self, exc: BaseException) -> OutboxError:
        if self.error:
            return OutboxError(self.error)
        return OutboxError(f"outbox: {exc or type(exc).__name__}")

    async def publish_many(
        self, items: list[OutboxItem], acked: Callable[[OutboxItem], None] = lambda _: None, gpus: Mapping[str, Cards] | None = None
    ) -> list[OutboxError | None]:
        """JetStream async publish: every item sent in order on the one connection (so the
        stream stores them in that order), then the acks awaited together, within ACK_TIMEOUT_S."""
        results: list[OutboxError | None] = [None] * len(items)
        futures: list[asyncio.Future[Any] | None] = []
        for k, (event_type, event_id, payload) in enumerate(items):
            try:
                check_event(event_type, payload)
                fut = await self.js.publish_async(
                    self.subjects.outbox_subject(event_type),
                    payload,
                    wait_stall=ACK_TIMEOUT_S,
                    headers={MSG_ID_HEADER: event_id, EVENT_TYPE_HEADER: event_type, **gpus_header(gpus.get(event_id) if gpus else None)},
                )
            except OutboxError as exc:
                results[k] = exc
                fut = None
            except (nats.errors.Error, TimeoutError) as exc:
                results[k] = self._error(exc)
                fut = None
            futures.append(fut)
        # the acks in order, each as it comes (a crash point after the k-th sees
        # later ones still in flight), all within one deadline
        deadline = asyncio.get_running_loop().time() + ACK_TIMEOUT_S
        told = False
        for k, fut in enumerate(futures):
            if fut is None:
                continue
            left = deadline - asyncio.get_running_loop().time()
            if not fut.done() and left > 0:
                await asyncio.wait([fut], timeout=left)
            if not fut.done():
                fut.cancel()  # its done-callback frees the async publish's slot
                results[k] = OutboxError(f"outbox: no ack within {ACK_TIMEOUT_S:g}s")
            elif fut.cancelled():
                results[k] = OutboxError("outbox: publish cancelled")
            elif fut.exception() is not None:
                results[k] = self._error(fut.exception())  # type: ignore[arg-type]
            else:
                self._since = (self._since[0] + 1, self._since[1] + len(items[k][2]))
                if not told:
                    told = True
                    await self._journaled()
                acked(items[k])
        return results


__all__ = [
    "EVENT_TYPE_HEADER",
    "ATTESTED_TYPES",
    "OutboxError",
    "OutboxItem",
    "check_event",
    "Signer",
    "Outbox",
    "BusSigner",
    "JetStreamOutbox",
    "sign_chunks",
    "checked_reports",
]
