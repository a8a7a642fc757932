"""Judging one message of BCD_EVENTS: what event it carries and whether to believe it, before anything is applied.

This module owns the checks every event passes:
- the subject must be `bcd.events.<node>.<type>`;
- a bound or released event must travel as an AttestedReport, verified against
  the key in the node's Hello: the signature, the body's node and event type,
  a boot id the node announced, and a `Nats-Msg-Id` equal to the body's event id;
- any other event must be a plain node event of its subject's type.

The answer is a Verdict: the fields of the event's record and the event to
apply, or a rejection with its reason. One check needs the state and is made
where the state is, under its lock (commit.py): the event's generation must be
one this control plane put for the node; `refuse` turns such a verdict into a
rejection logged and recorded like every other. Nothing is applied or acked here, so the
serve loop can judge a whole batch first and commit it with one state write
(commit.py). A Hello lookup that the upstream does not answer raises Transient:
the message is retried, never judged on a network failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from shared import logs
from shared.schemas import ATTESTED_REPORT_CODEC, NODE_EVENT_CODEC, REPORT_BODY_CODEC, BadMessage, HoldCondition, NodeCondition, ReportBody
from shared.schemas.events import EVENT_TYPES
from shared.signing import VerificationError, verify_report
from shared.subjects import MSG_ID_HEADER

from .ledger import describe
from .nodes import Nodes
from .state import now_utc

log = logs.get_logger("controlplane")

#: the event types a node signs (AttestedReport); the others travel plain.
ATTESTED_TYPES = frozenset({"bound", "released"})


class _Rejected(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Transient(Exception):
    """Upstream did not answer (a Hello lookup); the message is retried, not judged."""


_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (nats.errors.Error, asyncio.TimeoutError, TimeoutError)


@dataclass
class Verdict:
    """One message judged, nothing applied yet: its record's fields (all but the
    outcome), and the event to apply, or `rejected` (the reason is in the fields)."""

    msg: Msg
    fields: dict[str, Any]
    event_id: str
    event: Any = None
    rejected: bool = False


class Judge:
    """Judges messages of BCD_EVENTS against the nodes' Hellos."""

    def __init__(self, nodes: Nodes) -> None:
        self._nodes = nodes

    async def judge(self, msg: Msg) -> Verdict:
        received = now_utc()
        seq = 0
        with contextlib.suppress(Exception):
            seq = msg.metadata.sequence.stream
        tokens = msg.subject.split(".")
        node_id = tokens[2] if len(tokens) > 2 else ""
        etype = tokens[-1]
        base: dict[str, Any] = dict(received_at=received, node_id=node_id, type=etype, subject=msg.subject, stream_seq=seq)
        header_id = (msg.headers or {}).get(MSG_ID_HEADER)
        if len(tokens) != 4 or tokens[:2] != ["bcd", "events"] or etype not in EVENT_TYPES:
            return _reject(msg, base, f"subject {msg.subject} is not bcd.events.<node>.<{'|'.join(EVENT_TYPES)}>", header_id)
        if etype in ATTESTED_TYPES:
            return await self._judge_attested(msg, base, node_id, etype, header_id)
        return _judge_plain(msg, base, node_id, etype, header_id)

    async def _judge_attested(self, msg: Msg, base: dict[str, Any], node_id: str, etype: str, header_id: str | None) -> Verdict:
        try:
            report = ATTESTED_REPORT_CODEC.decode(msg.data)
        except BadMessage as exc:
            return _reject(msg, base, f"not an AttestedReport ({exc})", header_id, verified=False)
        claimed = _unverified_body(report.body)
        base.update(key_id=report.key_id)
        if claimed is not None:
            base.update(_claimed_fields(claimed))
        try:
            body = await self._verify(node_id, etype, report, header_id)
        except _Rejected as rej:
            return _reject(msg, base, rej.reason, header_id or (claimed.event_id if claimed else ""), verified=False)
        return _accept(msg, base, body.event, body.event_id, verified=True, time=body.time, boot_id=body.boot_id)

    async def _verify(self, node_id: str, etype: str, report: Any, header_id: str | None) -> ReportBody:
        try:
            hello = self._nodes.cached_hello(node_id)
            if hello is None or hello.key_id != report.key_id:
                hello, problem = await self._nodes.fetch_hello(node_id)
                if hello is None:
                    raise _Rejected(problem)
            try:
                body = verify_report(report, hello.public_key)
            except VerificationError as exc:
                raise _Rejected(str(exc)) from None
            if body.node_id != node_id:
                raise _Rejected(f"body names node {body.node_id} on {node_id}'s subject")
            if body.event.__struct_config__.tag != etype:
                raise _Rejected(f"body carries a {body.event.__struct_config__.tag} event on a {etype} subject")
            if body.boot_id not in self._nodes.boot_ids(node_id):
                # The node may have rebooted since we last looked.
                fresh, _ = await self._nodes.fetch_hello(node_id)
                if fresh is None or body.boot_id not in self._nodes.boot_ids(node_id):
                    raise _Rejected(f"boot id {body.boot_id} was never announced by {node_id}")
            if header_id is not None and header_id != body.event_id:
                raise _Rejected(f"{MSG_ID_HEADER} {header_id} is not the body's event_id {body.event_id}")
            return body
        except _TRANSIENT_ERRORS as exc:
            raise Transient(f"{type(exc).__name__}: {exc}") from None


def refuse(v: Verdict, reason: str) -> Verdict:
    """A verdict refused after judging (commit.py: a generation never put), logged and recorded like any rejection."""
    return _reject(v.msg, v.fields, reason, v.event_id, verified=v.fields.get("verified"), event=v.event)


def _judge_plain(msg: Msg, base: dict[str, Any], node_id: str, etype: str, header_id: str | None) -> Verdict:
    try:
        event = NODE_EVENT_CODEC.decode(msg.data)
    except BadMessage as exc:
        return _reject(msg, base, f"not a node event ({exc})", header_id)
    tag = event.__struct_config__.tag
    if tag != etype:
        return _reject(msg, base, f"a {tag} event on a {etype} subject (bound and released travel signed)", header_id, event=event)
    event_id = header_id or f"{node_id}.{etype}.sha256-{hashlib.sha256(msg.data).hexdigest()[:32]}"
    when = event.condition.since if isinstance(event, (NodeCondition, HoldCondition)) else None
    return _accept(msg, base, event, event_id, verified=None, time=when)


def _accept(
    msg: Msg, base: dict[str, Any], event: Any, event_id: str, *, verified: bool | None, time: datetime | None, boot_id: str = ""
) -> Verdict:
    alloc, rsv, _what, gen, detail = describe(event)
    fields = dict(
        base,
        time=time,
        event_id=event_id,
        verified=verified,
        allocation_id=alloc,
        reservation_id=rsv,
        generation=gen,
        boot_id=boot_id,
        detail=detail,
        event=msgspec.to_builtins(event),
    )
    return Verdict(msg=msg, fields=fields, event_id=event_id, event=event)


def _reject(
    msg: Msg, base: dict[str, Any], reason: str, event_id: str | None, *, verified: bool | None = None, event: Any = None
) -> Verdict:
    fields = dict(base)
    if event is not None:
        alloc, rsv, _what, gen, detail = describe(event)
        fields.update(allocation_id=alloc, reservation_id=rsv, generation=gen, detail=detail, event=msgspec.to_builtins(event))
    log.warning("event rejected", node_id=base["node_id"], type=base["type"], subject=base["subject"], reason=reason, event_id=event_id or "")
    fields.update(event_id=event_id or "", verified=verified, reason=reason)
    return Verdict(msg=msg, fields=fields, event_id=event_id or "", rejected=True)


def _unverified_body(body: bytes) -> ReportBody | None:
    """What a report claims, for the log of a rejected one; never trusted."""
    try:
        return REPORT_BODY_CODEC.decode(body)
    except BadMessage:
        return None


def _claimed_fields(body: ReportBody) -> dict[str, Any]:
    alloc, rsv, _what, gen, detail = describe(body.event)
    return dict(
        allocation_id=alloc,
        reservation_id=rsv,
        generation=gen,
        detail=detail,
        boot_id=body.boot_id,
        time=body.time,
        event=msgspec.to_builtins(body.event),
    )


__all__ = ["ATTESTED_TYPES", "Transient", "Verdict", "Judge", "refuse"]
