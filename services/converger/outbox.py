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

A node-bus JetStream with too little room for the stream's reservation
(`--outbox-max-bytes`, 256 MiB by default; JetStream's own limit is 75% of
the free space of its store unless `max_file_store` says otherwise) refuses
it with err_code 10047. The outbox then steps down to the largest size the
server accepts, less a quarter of it left for the node's other streams, never
below `MIN_OUTBOX_BYTES`, and says so (`warning`); below that floor it has no
stream (`error`), every event waits (retryable) and `ensure()` is tried
again before each pass.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import nats.errors
from nats.aio.client import Client
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from shared import logs
from shared.eventorder import Cards, gpus_header
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
#: long enough to cover any restart: a replayed event id inside it is dropped.
DUPLICATE_WINDOW = timedelta(hours=24)
#: JetStream's "insufficient storage resources available".
INSUFFICIENT_STORAGE = 10047
MIB = 1024 * 1024
#: the smallest outbox worth having (thousands of events); below it the stream is not created.
MIN_OUTBOX_BYTES = 16 * MIB
#: how close the step-down gets to the largest size the server accepts.
_STEP = MIB
#: a reduced outbox leaves at least this (and a quarter of what the server would take) unreserved.
MIN_HEADROOM_BYTES = 8 * MIB

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
    def __init__(self, nc: Client, subjects: NodeSubjects, timeout: float = 5.0) -> None:
        self.nc, self.subjects, self.timeout = nc, subjects, timeout

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
            raise OutboxError(f"signer: {exc or type(exc).__name__}") from None

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
                raise OutboxError(f"signer: {exc or type(exc).__name__}") from None
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

    The stream is bounded (`max_msgs`, `max_bytes`) with discard-new: a full
    outbox refuses new events instead of dropping old ones, and `has_room`
    lets a pass hold back new binds (with headroom for the releases and
    failures that must still be reported).
    """

    def __init__(
        self,
        nc: Client,
        subjects: NodeSubjects,
        *,
        max_msgs: int = 100_000,
        max_bytes: int = 256 * 1024 * 1024,
        headroom: int = 64,
        timeout: float = 5.0,
        min_bytes: int = MIN_OUTBOX_BYTES,
        state_dir: Path | str | None = None,
    ) -> None:
        self.js = nc.jetstream(timeout=timeout)
        self.subjects = subjects
        self.max_msgs = max_msgs
        #: what --outbox-max-bytes asked for.
        self.wanted_bytes = max_bytes
        #: what the stream has (smaller when the server refused the wanted size).
        self.max_bytes = max_bytes
        self.min_bytes = min(min_bytes, max_bytes)
        #: where the free space is read for the messages (the state filesystem).
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.headroom = min(headroom, max(1, max_msgs // 4))
        #: the stream exists (ensure() succeeded).
        self.ready = False
        #: the outbox is smaller than asked (the operator should know), or "".
        self.warning = ""
        #: the outbox has no stream: the server refused even the floor, or "".
        self.error = ""
        #: (messages, bytes, loop time) of the stream at the last has_room reading.
        self._room_known: tuple[int, int, float] | None = None
        #: (events, bytes) journaled since that reading.
        self._since = (0, 0)

    def config(self, max_bytes: int | None = None) -> StreamConfig:
        return StreamConfig(
            name=self.subjects.outbox_stream,
            description="bcd events waiting for upstream acknowledgement",
            subjects=[self.subjects.outbox_filter],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.NEW,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW.total_seconds(),
            max_msgs=self.max_msgs,
            max_bytes=self.max_bytes if max_bytes is None else max_bytes,
        )

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
        self._room_known = (info.state.messages, info.state.bytes, asyncio.get_running_loop().time())
        self._since = (0, 0)
        return info.state.messages + self.headroom < self.max_msgs and info.state.bytes < self.max_bytes * 0.9

    async def ensure(self) -> None:
        """Create or update the stream at the wanted size, or smaller when the server refuses it.

        A refusal for storage (10047) is not raised: see the module docstring;
        `warning` / `error` say what happened. Other errors are raised.
        """
        try:
            info = await self.js.stream_info(self.subjects.outbox_stream)
        except NotFoundError:
            info = None
        if await self._try(self.wanted_bytes, exists=info is not None):
            self._granted(self.wanted_bytes)
            return
        # the largest size the server takes, to within _STEP, only ever growing the
        # stream: an existing one starts from the size it has (never shrunk, which
        # would delete its oldest events), a new one from the floor
        have = max(0, info.config.max_bytes or 0) if info is not None else 0
        # what an existing stream holds is never cut (that would delete events)
        floor = self.min_bytes if info is None else max(self.min_bytes, -(-(info.state.bytes or 0) // _STEP) * _STEP)
        if 0 < have < self.wanted_bytes:
            ok = have
        elif floor < self.wanted_bytes and await self._try(floor, exists=info is not None):
            ok = floor
        else:
            self._refused(exists=info is not None)
            return
        bad = self.wanted_bytes
        while bad - ok > _STEP:
            mid = (ok + bad) // 2 // _STEP * _STEP
            if mid <= ok:
                break
            if await self._try(mid, exists=True):
                ok = mid
            else:
                bad = mid
        # a refused update leaves the stream as it was: at `ok`, the largest size taken.
        # Leave the rest of the node room: its other streams (the inventory's KV bucket,
        # an embedded upstream's) reserve nothing and are refused once the store is
        # fully reserved. Never below what the stream had, nor the floor.
        target = max((ok - max(ok // 4, MIN_HEADROOM_BYTES)) // _STEP * _STEP, have, floor)
        if target < ok and await self._try(target, exists=True):
            ok = target
        self._granted(ok)

    def _refused(self, *, exists: bool) -> None:
        self.ready = exists
        self.warning = ""
        self.error = (
            f"outbox refused: the node-bus JetStream has no room for even a {self.min_bytes // MIB} MiB outbox "
            f"(asked {self.wanted_bytes // MIB} MiB; {self._free()}); events wait until it has: "
            f"free space on the node bus's store or lower --outbox-max-bytes (BCD_OUTBOX_MAX_BYTES)"
        )
        log.error("outbox stream refused for storage; no event can be journaled until it is created", problem=self.error)

    async def _try(self, max_bytes: int, *, exists: bool) -> bool:
        """One create/update at `max_bytes`: False when refused for storage."""
        cfg = self.config(max_bytes)
        try:
            if exists:
                await self.js.update_stream(cfg)
            else:
                await self.js.add_stream(cfg)
        except APIError as exc:
            if exc.err_code == INSUFFICIENT_STORAGE:
                return False
            raise
        return True

    def _granted(self, max_bytes: int) -> None:
        self.ready = True
        self.error = ""
        self.max_bytes = max_bytes
        if max_bytes >= self.wanted_bytes:
            self.warning = ""
            return
        self.warning = (
            f"outbox reduced to {max_bytes // MIB} MiB of the {self.wanted_bytes // MIB} MiB asked: the node-bus "
            f"JetStream refused the reservation (insufficient storage; {self._free()}; a quarter of what it "
            f"would take is left to the node's other streams); "
            f"free space on the node bus's store or set --outbox-max-bytes (BCD_OUTBOX_MAX_BYTES)"
        )
        log.warning(
            "outbox stream smaller than asked: JetStream refused the full reservation",
            granted_bytes=max_bytes,
            wanted_bytes=self.wanted_bytes,
            free=self._free(),
        )

    def _free(self) -> str:
        if self.state_dir is None:
            return "free space unknown"
        try:
            st = os.statvfs(self.state_dir)
        except OSError:
            return f"free space of {self.state_dir} unknown"
        return f"{st.f_bavail * st.f_frsize // MIB} MiB free on the state filesystem ({self.state_dir})"

    async def recheck(self) -> None:
        """Before a pass: try again to create a stream the server refused."""
        if not self.ready:
            try:
                await self.ensure()
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("outbox stream still missing", error=str(exc) or type(exc).__name__)

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
    "MIN_OUTBOX_BYTES",
    "INSUFFICIENT_STORAGE",
]
