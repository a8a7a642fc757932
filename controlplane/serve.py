"""The serve loop: ControlPlane, which wires the parts over one upstream connection and consumes BCD_EVENTS.

This module owns the durable pull consumer and the order of a batch. Events are
taken a batch at a time: whatever the consumer has, up to EVENT_BATCH, never
waited for to fill. They are judged in stream order (judge.py), applied and
saved with one state.json write (commit.py), logged to events.jsonl and stdout
(ledger.py), and only then acked. Nothing after a batch is delivered before it
is acked. A step that fails is retried in place, with the batch kept in
progress, so no later event is ever applied before an earlier one. A control
plane killed with a batch unacked resets the consumer to its ack floor at the
next start, so those events come back at once, first and in order, and what
was saved already is a duplicate by its event id.

ControlPlane also answers for the parts it wires: the upstream objects
(buckets.py), spec puts (publish.py), and the nodes' Hellos and reports
(nodes.py). Those keep the names callers used before the split. The command
line (cli.py) runs it alone, and `bcd up` starts that command.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared import logs
from shared.schemas import Condition, Hello, Inventory, NodeSpec, SectionStatus
from shared.signing import Ed25519PrivateKey, key_id
from shared.stopping import sleep_unless
from shared.subjects import UPSTREAM_EVENTS_STREAM, UPSTREAM_NODES_BUCKET, upstream_events_filter

from .buckets import UpstreamObjects
from .commit import commit_batch
from .judge import Judge, Transient, Verdict
from .ledger import EVENTS_FILE, EventLedger, EventRecord, format_line
from .nodes import Nodes
from .publish import SpecPublisher
from .specs import PutResult
from .state import Reservation, StateStore

log = logs.get_logger("controlplane")

CONSUMER_NAME = "controlplane"
#: the most events taken in one fetch, and the consumer's max_ack_pending: a batch (whatever
#: is there now, never waited for) is applied in memory, saved with one state.json write and
#: only then acked, before the next fetch (a generation of 64 releases + 64 binds is one batch).
EVENT_BATCH = 128
#: the consumer's ack_wait (s): the stall if acks are lost on a connection that stays up.
ACK_WAIT_S = 10.0


class ControlPlane:
    """The reference control plane over one connected upstream client.

    `nc` must be connected as `controlplane` with `inbox_prefix("controlplane")`
    (its permissions allow nothing else).
    """

    def __init__(
        self,
        nc: Client,
        key: Ed25519PrivateKey,
        state_dir: Path,
        *,
        out: TextIO | None = sys.stdout,
        fetch_batch: int = EVENT_BATCH,
        fetch_timeout: float = 0.5,
        js_timeout: float = 5.0,
        replicas: int = 1,
    ) -> None:
        self.nc = nc
        #: JetStream replicas of the stream and buckets it creates (3 on a 3-server cluster).
        self.replicas = replicas
        self.key = key
        self.key_id = key_id(key)
        self.state_dir = Path(state_dir)
        self.store = StateStore(self.state_dir)
        self.events_path = self.state_dir / EVENTS_FILE
        self.js = nc.jetstream(timeout=js_timeout)
        self._out = out
        self._fetch_batch = fetch_batch
        self._fetch_timeout = fetch_timeout
        self.objects = UpstreamObjects(self.js, replicas)
        self.nodes = Nodes(self.objects, self.store)
        self.publisher = SpecPublisher(key, self.objects, self.store, self.nodes, max_payload=lambda: nc.max_payload)
        self.judge = Judge(self.nodes)
        self.ledger = EventLedger(self.events_path)
        #: set while `run` consumes (its subscriptions are in place on the server).
        self.consuming = asyncio.Event()
        self.ledger.load()

    # ------------------------------------------------------------------ upstream objects

    async def ensure_upstream(self) -> None:
        """Create the buckets and the stream when missing (idempotent); fix allow_direct if off."""
        await self.objects.ensure()

    # ------------------------------------------------------------------ specs

    async def put_spec(
        self,
        spec: NodeSpec | dict[str, Any] | str | bytes,
        *,
        allow_unknown_fields: bool = False,
        require_known_node: bool = False,
        hello_wait: float = 0.0,
    ) -> PutResult:
        """Sign and put one node's spec at `bcd_nodespecs/<node_id>` (publish.SpecPublisher.put)."""
        return await self.publisher.put(spec, allow_unknown_fields=allow_unknown_fields, require_known_node=require_known_node, hello_wait=hello_wait)

    async def node_known(self, node_id: str, *, wait: float = 0.0) -> bool:
        """Has `node_id` ever put a Hello (a boot id on record, or a Hello in `bcd_nodes` now)?

        Waits up to `wait` seconds for a Hello to appear (a node that is starting).
        """
        return await self.nodes.known(node_id, wait=wait)

    # ------------------------------------------------------------------ nodes

    async def node_hello(self, node_id: str) -> Hello | None:
        """The node's current Hello from `bcd_nodes` (fetched now; None when absent or invalid)."""
        return await self.nodes.hello(node_id)

    async def node_inventory(self, node_id: str) -> Inventory | None:
        return await self.nodes.inventory(node_id)

    async def node_conditions(self, node_id: str) -> dict[str, Condition]:
        """The latest condition per type that the node reported (from the processed events)."""
        return self.nodes.conditions(node_id)

    async def node_sections(self, node_id: str) -> dict[str, SectionStatus]:
        """The latest SectionStatus per section that the node reported."""
        return self.nodes.sections(node_id)

    def boot_ids(self, node_id: str) -> list[str]:
        return self.nodes.boot_ids(node_id)

    # ------------------------------------------------------------------ events

    def _consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=CONSUMER_NAME,
            description="bcd reference control plane",
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            filter_subject=upstream_events_filter(),
            # One batch in flight: `run` fetches again only once the batch before is
            # saved and acked. The short ack_wait bounds a stall if acks are lost on a
            # live connection; a slow judgement sends in_progress.
            ack_wait=ACK_WAIT_S,
            max_ack_pending=self._fetch_batch,
            max_deliver=-1,
        )

    async def _ensure_consumer(self) -> None:
        """Create the durable consumer, or bring an older one's settings up to date; then, when
        events are still unacked from a control plane that died, restart delivery at the ack floor.

        Those events would come back only after ack_wait, and the ones after them (up to
        max_ack_pending) would be delivered first: a node's Released applied before its
        Bound. A consumer reset (nats-server 2.14+) drops the dead instance's deliveries
        and delivers everything above the ack floor again, in stream order, at once;
        what was applied already is then a duplicate by its event id.
        """
        info = await self.js.add_consumer(UPSTREAM_EVENTS_STREAM, config=self._consumer_config())
        if info.num_ack_pending:
            reset = await self.js.reset_consumer(UPSTREAM_EVENTS_STREAM, CONSUMER_NAME)
            log.warning(
                "events left unacked by an earlier run; delivering again from the ack floor, in order",
                unacked=info.num_ack_pending,
                from_stream_seq=reset.reset_seq,
            )

    async def run(self, stopping: asyncio.Event) -> None:
        """Consume BCD_EVENTS until `stopping` is set, a batch at a time.

        A batch is whatever the consumer has now, up to `fetch_batch` (never waited
        for to fill): judged message by message in stream order, applied in memory,
        saved with one state.json write, its events.jsonl lines written, and only
        then acked. Nothing after a batch is delivered before it is acked.
        """
        await self._ensure_consumer()
        psub = await self.js.pull_subscribe_bind(CONSUMER_NAME, stream=UPSTREAM_EVENTS_STREAM)
        hello_sub = await self.nc.subscribe(f"$KV.{UPSTREAM_NODES_BUCKET}.>", cb=self.nodes.on_hello_msg)
        await self.nc.flush()
        self.consuming.set()
        log.info("consuming events", stream=UPSTREAM_EVENTS_STREAM, consumer=CONSUMER_NAME, state_dir=str(self.state_dir))
        try:
            while not stopping.is_set():
                try:
                    msgs = await self._fetch(psub)
                except asyncio.TimeoutError:  # nats' own TimeoutError too; fetch raises both
                    continue
                except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                    raise
                except nats.errors.Error as exc:
                    log.warning("fetch failed; retrying", error=str(exc) or type(exc).__name__)
                    await sleep_unless(stopping, 1.0)
                    continue
                await self._consume(msgs, stopping)
        finally:
            self.consuming.clear()
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)  # the last batch's acks reach the server before we say we stopped
            for sub in (hello_sub, psub):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            task = getattr(hello_sub, "_wait_for_msgs_task", None)
            if isinstance(task, asyncio.Task):
                await asyncio.wait({task}, timeout=1.0)

    async def _fetch(self, psub: Any) -> list[Msg]:
        """The next batch: one message waited for (up to fetch_timeout), then, without
        waiting, the ones the consumer already holds after it (its num_pending), up to
        fetch_batch. (A lone event reaches us as fast as with one message in flight; one
        fetch of fetch_batch handed it over ~0.2 ms later, measured with nats-py 2.16.)"""
        msgs = await psub.fetch(1, timeout=self._fetch_timeout)
        more = 0
        with contextlib.suppress(Exception):
            more = min(msgs[-1].metadata.num_pending, self._fetch_batch - len(msgs))
        if more > 0:
            try:
                msgs += await psub.fetch(more, timeout=self._fetch_timeout)
            except (asyncio.TimeoutError, nats.errors.Error) as exc:  # the ones in hand are judged all the same
                if not isinstance(exc, asyncio.TimeoutError):
                    log.warning("fetch failed; going on with the events in hand", error=str(exc) or type(exc).__name__)
        return msgs

    async def _consume(self, msgs: list[Msg], stopping: asyncio.Event) -> list[EventRecord]:
        """Judge, apply, save, log, then ack one fetched batch, in stream order.

        A step that fails is retried in place, the batch kept (in_progress), so no
        later event is ever applied before an earlier one: upstream trouble while
        judging every second, anything else (a full disk) every 5 s. When stopping
        meanwhile, what is left unacked is delivered again, in order, at the next start.
        """
        verdicts: list[Verdict] = []
        for msg in msgs:
            verdict = await self._in_place(lambda msg=msg: self._judge(msg), msgs, stopping, msg.subject)
            if verdict is None:
                break  # stopping; the judged ones are still applied and acked
            verdicts.append(verdict)
        if not verdicts:
            return []

        async def commit() -> list[EventRecord]:
            return self._commit(verdicts)

        records = await self._in_place(commit, msgs, stopping, "state.json")
        if records is None:
            return []

        async def write() -> bool:
            self._write_records(records)
            return True

        if await self._in_place(write, msgs, stopping, str(self.events_path)) is None:
            return []  # saved, not logged: the redelivery writes the lines (and applies nothing again)
        for verdict in verdicts:
            try:
                await verdict.msg.ack()
            except Exception as exc:  # noqa: BLE001 - applied and saved: a redelivery is only a duplicate
                log.warning("ack failed; the event will be redelivered as a duplicate", subject=verdict.msg.subject, error=str(exc))
                break
        return records

    async def _in_place(self, step: Callable[[], Any], batch: list[Msg], stopping: asyncio.Event, what: str) -> Any:
        """`await step()` until it succeeds (its result) or `stopping` is set (None)."""
        while True:
            try:
                return await step()
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the consumer
                transient = isinstance(exc, Transient)
                if transient:
                    log.warning("upstream lookup failed; retrying the event", subject=what, error=str(exc))
                else:
                    log.exception("event handling failed; retrying it in place", what=what)
                if stopping.is_set():
                    return None
                for msg in batch:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
                await sleep_unless(stopping, 1.0 if transient else 5.0)

    async def handle(self, msg: Msg) -> EventRecord:
        """Judge, apply, persist, log, then ack one message of BCD_EVENTS (a batch of one; errors raise)."""
        [rec] = self._commit([await self._judge(msg)])
        self._write_records([rec])
        await msg.ack()
        return rec

    async def _judge(self, msg: Msg) -> Verdict:
        return await self.judge.judge(msg)

    def _commit(self, verdicts: list[Verdict]) -> list[EventRecord]:
        """Apply judged events in stream order (commit.commit_batch): the records to log, in the same order."""
        return commit_batch(self.store, verdicts, self.ledger.logged_applied)

    def _write_records(self, records: list[EventRecord]) -> None:
        """Append the batch's lines to events.jsonl (one write), then remember them; print them."""
        self.ledger.append(records)
        lines = []
        for rec in records:
            if rec.outcome == "duplicate":
                log.info("duplicate event ignored", node_id=rec.node_id, type=rec.type, event_id=rec.event_id)
            lines.append(format_line(rec) + "\n")
        if self._out is not None:
            with contextlib.suppress(OSError, ValueError):
                self._out.write("".join(lines))
                self._out.flush()

    # ------------------------------------------------------------------ accessors

    def reservations(self) -> dict[str, Reservation]:
        return dict(self.store.refresh().reservations)

    def events(self) -> list[EventRecord]:
        """Events applied (this state dir's whole log, oldest first)."""
        return list(self.ledger.applied)

    def rejected(self) -> list[EventRecord]:
        return list(self.ledger.rejected)

    def duplicates(self) -> list[EventRecord]:
        return list(self.ledger.duplicates)

    def rejected_count(self) -> int:
        return self.store.refresh().rejected_count

    def last_generation(self, node_id: str) -> int:
        rec = self.store.refresh().nodes.get(node_id)
        return rec.last_generation if rec else 0


__all__ = ["CONSUMER_NAME", "EVENT_BATCH", "ACK_WAIT_S", "ControlPlane"]
