"""The node's durable outbox and the signer, as ports of the converger.

Bound and Released are signed by the signer first; every event then goes
into the node-bus JetStream stream `BCD_OUTBOX_<node>` with `Nats-Msg-Id` set
to its deterministic event id, so a replay after a crash is dropped by the
stream's duplicate window. An event counts as sent once JetStream acked it
(the bus syncs every write: `sync_interval: always`); the bridge drains the
stream upstream.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Protocol

import nats.errors
from nats.aio.client import Client
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from shared.runtime import ServiceCallError, call
from shared.schemas import ATTESTED_REPORT_CODEC, AttestedEvent, AttestedReport, SignRequest
from shared.subjects import MSG_ID_HEADER, NodeSubjects

EVENT_TYPE_HEADER = "Bcd-Event-Type"
#: long enough to cover any restart: a replayed event id inside it is dropped.
DUPLICATE_WINDOW = timedelta(hours=24)


class OutboxError(Exception):
    """The event did not reach the outbox (or the signer); retryable."""


class Signer(Protocol):
    async def sign(self, event_id: str, event: AttestedEvent) -> AttestedReport: ...


class Outbox(Protocol):
    async def publish(self, event_type: str, event_id: str, payload: bytes) -> None: ...

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
    ) -> None:
        self.js = nc.jetstream(timeout=timeout)
        self.subjects = subjects
        self.max_msgs = max_msgs
        self.max_bytes = max_bytes
        self.headroom = min(headroom, max(1, max_msgs // 4))

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.subjects.outbox_stream,
            description="bcd events waiting for upstream acknowledgement",
            subjects=[self.subjects.outbox_filter],
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.NEW,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW.total_seconds(),
            max_msgs=self.max_msgs,
            max_bytes=self.max_bytes,
        )

    async def has_room(self) -> bool:
        try:
            info = await self.js.stream_info(self.subjects.outbox_stream)
        except (nats.errors.Error, TimeoutError):
            return False
        return info.state.messages + self.headroom < self.max_msgs and info.state.bytes < self.max_bytes * 0.9

    async def ensure(self) -> None:
        try:
            await self.js.stream_info(self.subjects.outbox_stream)
        except NotFoundError:
            await self.js.add_stream(self.config())
        else:
            await self.js.update_stream(self.config())

    async def publish(self, event_type: str, event_id: str, payload: bytes) -> None:
        try:
            await self.js.publish(
                self.subjects.outbox_subject(event_type),
                payload,
                headers={MSG_ID_HEADER: event_id, EVENT_TYPE_HEADER: event_type},
            )
        except (nats.errors.Error, TimeoutError) as exc:
            raise OutboxError(f"outbox: {exc or type(exc).__name__}") from None


__all__ = ["EVENT_TYPE_HEADER", "OutboxError", "Signer", "Outbox", "BusSigner", "JetStreamOutbox"]
