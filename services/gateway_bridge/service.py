"""The gateway_bridge micro service: the node's only door to upstream.

Three loops, each surviving an unreachable upstream on its own:
- specs: read `bcd_nodespecs/<node_id>` by direct get and follow the key's
  subject (a KV put is a publish there); verify the SignedNodeSpec against the
  configured control-plane keys (none: accept unsigned, and say so), refuse a
  bad signature, another node's spec or an older generation (the last good
  spec stays; condition NodeSpecRejected is raised), hand the rest to the
  converger. Never backwards: the newest verified spec waits as `pending`
  until the converger acknowledges it and is handed over again every
  HANDOVER_RETRY_S while the converger does not answer; an older one is
  refused, never handed over after a newer;
- records: put Hello and the Inventory into `bcd_nodes` / `bcd_inventory`: an
  inventory change puts the inventory only (the Hello too when its adapter, all
  the Hello takes from it, changed); the Hello goes again when the converger says
  its status changed, on a reconnect and with the periodic re-put of both;
- outbox: forward the node-bus outbox to `BCD_EVENTS` in sequence order with
  `Nats-Msg-Id`, up to FORWARD_WINDOW events in flight. An ephemeral pull
  consumer without acks (`OutboxReader`) keeps a lingering pull request at the
  server, so an event is delivered as soon as it is stored, with its stream
  sequence; it is published at once on the one upstream connection while fewer
  than FORWARD_WINDOW wait for their PubAck (a sliding window, no round trip of
  its own), and a Bound never while a Released before it is unacknowledged.
  A local message is taken out only after upstream's PubAck, in the background:
  the acknowledged stretch is purged up to its end in one request
  (`OutboxPurger`, tried again until it goes). The first unacknowledged one
  and all after it are read again from the outbox (a new consumer from its
  sequence) and sent again (upstream drops the repeats by `Nats-Msg-Id`), one
  at a time until one succeeds. A new process starts at the first message
  still in the outbox. While upstream is away the outbox grows on disk, the
  bridge holds at most two windows; nothing is dropped.
It waits for buckets and streams that do not exist yet and never creates them.
No message and no peer's reply stops a loop: each iteration runs under a
`LoopGuard` (logged, backed off, carried on), and what the bridge puts
upstream or journals is encoded through its codec's `encode_valid`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NoStreamResponseError, NotFoundError
from prometheus_client import Counter, Gauge

from shared.eventids import condition_id
from shared.eventorder import Cards, cards_from_header, shares_gpu
from shared.jsutil import StreamMissing, stream_depth
from shared.runtime import (
    VERSION,
    LoopGuard,
    Option,
    ServiceApp,
    ServiceCallError,
    ServiceContext,
    StartupError,
    call,
    describe,
    guarded,
    main_for,
)
from shared.schemas import (
    CONVERGER_STATUS_CODEC,
    HELLO_CODEC,
    INVENTORY_CODEC,
    NODE_EVENT_CODEC,
    SIGNED_NODE_SPEC_CODEC,
    SIGNER_KEY_CODEC,
    SPEC_ACK_CODEC,
    BadMessage,
    Condition,
    Empty,
    Hello,
    Inventory,
    NodeCondition,
    NodeSpec,
    SchemaViolation,
    SignerKey,
    clip,
)
from shared.signing import VerificationError, load_public_key_file, verify_node_spec
from shared.subjects import (
    MSG_ID_HEADER,
    UPSTREAM_INVENTORY_BUCKET,
    UPSTREAM_NODES_BUCKET,
    inbox_prefix,
    server_list,
    upstream_event,
    upstream_node_user,
    upstream_spec_get_subject,
    upstream_spec_key_subject,
)
from shared.tlsconfig import TlsConfigError, TlsFiles, UpstreamTls, connect_options, explain, local_problems, new_client, upstream_tls

NODE_SPEC_REJECTED = "NodeSpecRejected"
#: one hand-over to the converger waits this long for its answer; then it is tried again.
HANDOVER_TIMEOUT_S = 2.0
#: while the converger does not take the newest spec, it is handed over again this often.
HANDOVER_RETRY_S = 0.5
#: outbox events sent upstream before the first of them must be acknowledged: a
#: generation's events travel in a few round trips, not three per event.
FORWARD_WINDOW = 64
#: a PubAck is waited for this long after its publish (publish_async futures have no
#: timeout of their own); what is not acked by then is sent again.
ACK_TIMEOUT_S = 5.0
#: the outbox consumer's pull request asks the server for heartbeats this often while it waits ...
PULL_HEARTBEAT_S = 1.0
#: ... and is made again this often (the server answers 408 when it expires).
PULL_EXPIRES_S = 30.0
#: the server drops the bridge's consumer after this long without a pull request.
CONSUMER_INACTIVE_S = 60.0


#: the upstream connection's pings (nats-py's default is one every 120 s, two unanswered).
UPSTREAM_PING_S = 5.0
UPSTREAM_PINGS_OUTSTANDING = 3


def _header_bytes(headers: dict[str, str]) -> int:
    """What headers add to a message's size: a server's max_payload counts them, nats-py's check does not."""
    return len(b"NATS/1.0\r\n\r\n") + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())


def capabilities(privileged: bool, bindings: list[str], adapter: str) -> list[str]:
    """The seed's Hello capabilities: none of cdi/devices.limits/binding.kubernetes unprivileged."""
    caps: list[str] = []
    if privileged:
        caps += ["cdi", "devices.limits"]
        if "BINDING_KUBERNETES" in bindings:
            caps.append("binding.kubernetes")
    if adapter == "nvidia":
        caps.append("nvml")
    return caps


@dataclass(frozen=True)
class OutboxMsg:
    """One outbox message as the bridge's consumer delivered it."""

    seq: int
    subject: str
    data: bytes
    headers: dict[str, str]
    #: the incarnation of the stream it was read from: it is deleted from that one only.
    epoch: int


@dataclass
class _InFlight:
    msg: OutboxMsg
    event_type: str
    event_id: str
    future: asyncio.Future[Any]
    #: past it without a PubAck, it counts as not acknowledged.
    deadline: float
    #: the cards it names (its GPUS_HEADER; None: every card).
    cards: Cards = None


def _description(headers: dict[Any, str]) -> str:
    """A status message's Description (nats-py keys it by an enum member equal to the string)."""
    return next((str(v) for k, v in headers.items() if k == "Description"), "")


def _ack_error(fut: asyncio.Future[Any]) -> BaseException | None:
    """Why a publish_async future is not a PubAck (None: it is); taking it, so none is logged as never retrieved."""
    if fut.cancelled():
        return asyncio.TimeoutError(f"no PubAck within {ACK_TIMEOUT_S}s")
    return fut.exception()


async def _settle(flight: deque[_InFlight], loop: asyncio.AbstractEventLoop) -> None:
    """Wait for what is in flight (each until its deadline); what has no PubAck by then is cancelled."""
    pending = [s.future for s in flight if not s.future.done()]
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, max(s.deadline for s in flight) - loop.time()))
    for s in flight:
        # nothing else times them out; a late PubAck for a cancelled one is ignored
        s.future.cancel()
        _ack_error(s.future)


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


class OutboxPurger:
    """Takes forwarded messages out of the outbox in the background, so the next window never waits for it.

    Upstream acknowledges the outbox in order, so what is forwarded is always
    everything before one sequence (the stream holds nothing the consumer does
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


class BridgeApp(ServiceApp):
    name = "gateway_bridge"
    description = "the node's only upstream connection: specs in, records and events out"

    def __init__(self) -> None:
        self.up: Client | None = None
        self.up_connected = asyncio.Event()
        self.keys: list[Any] = []
        self.signer: SignerKey | None = None
        self.inventory: Inventory | None = None
        self.inventory_dirty = asyncio.Event()
        self.hello_dirty = asyncio.Event()
        self.records_wake = asyncio.Event()
        self.hello_published = asyncio.Event()
        self.outbox_wake = asyncio.Event()
        self.spec_wake = asyncio.Event()
        #: the newest raw spec put on the key (a KV put is a publish), not yet read.
        self.latest_spec: bytes | None = None
        #: the newest verified spec the converger has not acknowledged yet: handed
        #: over again every HANDOVER_RETRY_S until it is; a newer one replaces it.
        self.pending: NodeSpec | None = None
        #: the exact JSON bytes `pending` was verified from: what the converger gets, so
        #: it sees the fields this schema does not know too (NodeSpecUnknownFields).
        self.pending_raw: bytes | None = None
        #: the converger answered the last hand-over (False: the next success is logged).
        self.converger_reachable = True
        self.applied_generation = -1
        self.rejected: Condition | None = None
        self.rejection_unknown = True
        self.started_at = datetime.now(timezone.utc)
        self.waiting: set[str] = set()
        #: the inventory adapter the last Hello was made with (what the Hello takes from the inventory).
        self.hello_adapter: str | None = None
        self.reader: OutboxReader | None = None
        self.purger: OutboxPurger | None = None
        #: the client still making its first connection (the TLS watch renews it too)
        self.connecting: Client | None = None
        self.last_upstream_error = ""

    def options(self) -> list[Option]:
        return [
            Option("--upstream-url", "upstream (control plane) NATS URL", required=True),
            Option("--upstream-user", "upstream NATS user (default node-<node_id>)"),
            Option("--upstream-password-file", "file holding the upstream password", type=Path),
            Option("--upstream-token-file", "file holding an upstream token", type=Path),
            Option("--upstream-nkey-file", "upstream nkey seed file", type=Path),
            Option("--upstream-creds", "upstream .creds file (JWT + nkey)", type=Path),
            Option("--cp-key", "control-plane public key files (PEM or base64 raw), comma-separated", default=""),
            Option("--resync-interval", "seconds between re-reads of the spec and re-puts of the records", default=30.0, type=float),
            Option(
                "--upstream-ping-interval",
                "seconds between pings upstream; after 3 unanswered the connection is dropped and made afresh",
                default=UPSTREAM_PING_S,
                type=float,
            ),
            Option("--outbox-poll", "seconds between outbox checks when idle", default=1.0, type=float),
            Option("--upstream-ca", "CA bundle (PEM) the upstream's certificate must chain to; TLS on, plain text refused", type=Path),
            Option("--upstream-cert", "this node's client certificate (PEM), for an upstream that verifies clients (mutual TLS)", type=Path),
            Option("--upstream-key", "the client certificate's private key (PEM)", type=Path),
            Option("--upstream-server-name", "the name the upstream's certificate must carry (default: the URL's host)", default=""),
            Option(
                "--upstream-tls",
                "'required': TLS even without a CA file (the system trust store); 'auto': TLS when the URL is tls:// or a CA or certificate is given",
                default="auto",
                choices=("auto", "required"),
            ),
            Option(
                "--upstream-tls-check",
                "seconds between looks at the TLS files: a renewed certificate or bundle is used at the next reconnect",
                default=10.0,
                type=float,
            ),
        ]

    # ------------------------------------------------------------------ setup

    async def setup(self, ctx: ServiceContext) -> None:
        o = self.opts = ctx.opts
        self.ctx = ctx
        self.log = ctx.log
        for name in [p for p in str(o.cp_key).split(",") if p.strip()]:
            try:
                self.keys.append(load_public_key_file(Path(name.strip())))
            except (OSError, ValueError) as exc:
                raise StartupError(f"--cp-key {name}: {exc}") from None
        ctx.metadata["cp_keys"] = str(len(self.keys))
        ctx.metadata["upstream"] = o.upstream_url
        try:
            self.tls: UpstreamTls = upstream_tls(
                o.upstream_url,
                ca=o.upstream_ca,
                cert=o.upstream_cert,
                key=o.upstream_key,
                server_name=o.upstream_server_name,
                required=o.upstream_tls == "required",
            )
        except TlsConfigError as exc:
            raise StartupError(str(exc)) from None
        self.tls_files = TlsFiles(self.tls)
        ctx.metadata["upstream_tls"] = self.tls.describe()
        self._set_state("connecting", self.tls_files.error or "")
        for problem in local_problems(self.tls):
            ctx.log.warning("upstream TLS file problem", problem=problem)
        if self.tls_files.error:
            ctx.log.error("upstream TLS files do not load; waiting for them", error=self.tls_files.error)
        if self.keys:
            ctx.log.info("verifying node specs", keys=len(self.keys))
        else:
            ctx.log.warning("no control-plane keys configured: accepting UNSIGNED node specs (set --cp-key)")
        reg = ctx.registry
        self.m_up = Gauge("bcd_upstream_connected", "1 while connected upstream", registry=reg)
        self.m_depth = Gauge("bcd_outbox_depth", "Events in the outbox waiting for upstream", registry=reg)
        self.m_age = Gauge("bcd_outbox_oldest_age_seconds", "Age of the oldest event in the outbox", registry=reg)
        self.m_forwarded = Counter("bcd_outbox_forwarded", "Events acknowledged by upstream, by type", ["type"], registry=reg)
        self.m_forward_errors = Counter("bcd_outbox_forward_errors", "Failed forwards (retried)", registry=reg)
        self.m_specs = Counter("bcd_node_specs", "Node specs received, by outcome", ["outcome"], registry=reg)
        self.m_unsigned = Gauge("bcd_unsigned_specs_accepted", "1 when no control-plane key is configured", registry=reg)
        self.m_unsigned.set(0 if self.keys else 1)
        for outcome in ("accepted", "rejected"):
            self.m_specs.labels(outcome=outcome)

        @guarded(ctx.log, "inventory notice")
        async def on_inventory(msg: Any) -> None:
            self.inventory = INVENTORY_CODEC.decode(msg.data)
            # the inventory record only: the Hello takes just the adapter from it (its nvml
            # capability), so it is put again only when that changed
            self.mark_records(hello=self.inventory.adapter != self.hello_adapter, inventory=True)

        async def on_outbox(_: Any) -> None:
            self.outbox_wake.set()

        async def on_converger_changed(_: Any) -> None:
            # the converger found (or lost) the root helper: the Hello's capabilities change now;
            # a converger that speaks again takes the spec that waits for it now, too
            self.mark_records(hello=True, inventory=False)
            if self.pending is not None:
                self.spec_wake.set()

        await ctx.nc.subscribe(ctx.subjects.inventory_changed, cb=on_inventory)
        await ctx.nc.subscribe(ctx.subjects.outbox_filter, cb=on_outbox)
        await ctx.nc.subscribe(ctx.subjects.converger_status_changed, cb=on_converger_changed)

    # ------------------------------------------------------------------ upstream connection

    def _set_state(self, state: str, error: str) -> None:
        """What `bcd status` and `bcd doctor` say of the upstream (the PING metadata)."""
        self.ctx.metadata["upstream_state"] = state
        self.ctx.metadata["upstream_error"] = error

    def _upstream_failed(self, why: str) -> None:
        """An error from upstream or on the way there, said once per distinct reason (nats-py
        tries again each second, and each try that fails reports here)."""
        connected = self.up is not None and self.up.is_connected
        self._set_state("connected" if connected else ("connecting" if self.up is None else "disconnected"), why)
        if why == self.last_upstream_error:
            return
        self.last_upstream_error = why
        if connected:
            self.log.warning("upstream error", error=why)
        else:
            self.log.warning("upstream refused or unreachable; retrying (holds and outbox kept)", url=self.opts.upstream_url, error=why)

    def _upstream_ok(self) -> None:
        self.last_upstream_error = ""
        self._set_state("connected", self.tls_files.error or "")

    async def tls_loop(self) -> None:
        """Looks at the TLS files every --upstream-tls-check s: a renewed set goes into the
        client, used at its next (re)connect; one that does not load is said, the old kept."""
        said = ""
        while not self.ctx.stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stopping.wait(), max(0.05, float(self.opts.upstream_tls_check)))
            if self.ctx.stopping.is_set():
                return
            if self.tls_files.refresh():
                for nc in (self.up, self.connecting):
                    if nc is not None:
                        self.tls_files.install(nc)
                self.log.info(
                    "upstream TLS files renewed: the next reconnect uses them (the connection up now stays as verified)",
                    tls=self.tls.describe(),
                    renewal=self.tls_files.generation,
                )
                for problem in local_problems(self.tls):
                    self.log.warning("upstream TLS file problem", problem=problem)
                said = ""
                if self.up is not None and self.up.is_connected:
                    self._set_state("connected", "")
            elif self.tls_files.error and self.tls_files.error != said:
                said = self.tls_files.error
                self.log.warning("upstream TLS files changed but do not load; the ones in use are kept", error=said)
                if self.up is not None and self.up.is_connected:
                    self._set_state("connected", f"renewed TLS files not used: {said}")

    async def _connect_upstream(self) -> None:
        o = self.opts
        user = o.upstream_user or upstream_node_user(o.node_id)
        kw: dict[str, Any] = {}
        if o.upstream_creds:
            kw["user_credentials"] = str(o.upstream_creds)
        elif o.upstream_nkey_file:
            kw["nkeys_seed"] = str(o.upstream_nkey_file)
        elif o.upstream_token_file:
            kw["token"] = Path(o.upstream_token_file).read_text().strip()
        elif o.upstream_password_file:
            kw["user"] = user
            kw["password"] = Path(o.upstream_password_file).read_text().strip()

        async def on_disconnect() -> None:
            self.up_connected.clear()
            self.m_up.set(0)
            self._set_state("disconnected", self.ctx.metadata.get("upstream_error", ""))
            self.log.warning("upstream disconnected; the outbox keeps events until it is back")

        async def on_reconnect() -> None:
            self.up_connected.set()
            self.m_up.set(1)
            self._upstream_ok()
            self.log.info("upstream reconnected")
            self.mark_records()
            self.spec_wake.set()
            self.outbox_wake.set()

        async def on_error(exc: Exception) -> None:
            nc = self.up or self.connecting
            srv = getattr(nc, "_current_server", None)
            where = f"{srv.uri.hostname}:{srv.uri.port}" if srv is not None and srv.uri is not None else ""
            self._upstream_failed(explain(exc, server=where))

        delay = 0.5
        while not self.ctx.stopping.is_set():
            if not self.tls_files.ready:
                # files that do not load yet: said once, looked at again each check
                self._upstream_failed(self.tls_files.error or "TLS files not loaded")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.ctx.stopping.wait(), max(0.05, float(o.upstream_tls_check)))
                self.tls_files.refresh()
                continue
            nc = self.connecting = new_client(self.tls)
            try:
                await nc.connect(
                    server_list(o.upstream_url),
                    name=f"bcd-bridge-{o.node_id}",
                    inbox_prefix=inbox_prefix(user).encode(),
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=1,
                    connect_timeout=3,
                    # a cut network loses no TCP connection, it stalls it: what the server
                    # sends meanwhile waits for TCP's retransmission backoff (20 s and more
                    # after a 30 s cut, measured in tests/containers/test_fleet.py). Pings
                    # find the stall and a fresh connection goes out as soon as the path is back.
                    ping_interval=o.upstream_ping_interval,
                    max_outstanding_pings=UPSTREAM_PINGS_OUTSTANDING,
                    allow_reconnect=True,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    error_cb=on_error,
                    **connect_options(self.tls, self.tls_files.context),
                    **kw,
                )
                self.up = nc
                break
            except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
                self._upstream_failed(explain(exc))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.ctx.stopping.wait(), delay)
                delay = min(delay * 2, 10.0)
            finally:
                self.connecting = None
        if self.up is None:
            return

        async def on_spec(msg: Any) -> None:
            if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
                return
            self.latest_spec = msg.data
            self.spec_wake.set()

        await self.up.subscribe(upstream_spec_key_subject(o.node_id), cb=on_spec)
        self.up_connected.set()
        self.m_up.set(1)
        self._upstream_ok()
        self.log.info("connected upstream", url=o.upstream_url, user=user, tls=self.tls.describe())

    def _waiting_for(self, what: str) -> None:
        if what not in self.waiting:
            self.waiting.add(what)
            self.log.warning(f"waiting for upstream {what} (the control plane creates it)")

    def _found(self, what: str) -> None:
        if what in self.waiting:
            self.waiting.discard(what)
            self.log.info(f"upstream {what} is there")

    # ------------------------------------------------------------------ specs

    async def _get_spec(self) -> bytes | None:
        assert self.up is not None
        try:
            msg = await self.up.request(upstream_spec_get_subject(self.opts.node_id), b"", timeout=3)
        except nats.errors.NoRespondersError:
            self._waiting_for("KV bucket bcd_nodespecs")
            return None
        self._found("KV bucket bcd_nodespecs")
        headers = msg.headers or {}
        status = headers.get("Status") or headers.get("Nats-Status")
        if status == "404" or (not msg.data and status):
            return None
        if headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        return msg.data

    async def specs_loop(self) -> None:
        guard = LoopGuard(self.log, "specs loop")
        while not self.ctx.stopping.is_set():
            if self.pending is None:
                # a spec already taken goes to the converger (on the node bus) while upstream is away
                await self.up_connected.wait()
            # cleared before the work, so a wake set during it (a retry, a new put) is kept
            self.spec_wake.clear()
            async with guard:
                try:
                    data = self.latest_spec
                    self.latest_spec = None
                    if data is None and self.pending is None:
                        data = await self._get_spec()
                    if data is not None:
                        await self.take(data)
                    if self.pending is not None:
                        await self.hand_over()
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    self.log.warning("reading the node spec failed; retrying", error=describe(exc))
            # a spec the converger has not taken yet is handed over again soon; a new put wakes at once
            wait = HANDOVER_RETRY_S if self.pending is not None else self.opts.resync_interval
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.spec_wake.wait(), wait)

    async def take(self, data: bytes) -> None:
        """Verify one SignedNodeSpec; the newest good one waits in `pending` for the hand-over.

        Never goes backwards: a spec older than the applied generation, or
        than the one already waiting for the converger, is refused.
        """
        node = self.opts.node_id
        try:
            signed = SIGNED_NODE_SPEC_CODEC.decode(data)
            spec = verify_node_spec(signed, self.keys)
        except (BadMessage, VerificationError) as exc:
            await self.reject(f"refused: {exc}")
            return
        if spec.node_id != node:
            await self.reject(f"refused: the spec names node {spec.node_id}, this is {node}")
            return
        if spec.generation < self.applied_generation:
            await self.reject(f"refused: generation {spec.generation} is lower than the applied {self.applied_generation}")
            return
        if self.pending is not None and spec.generation < self.pending.generation:
            await self.reject(
                f"refused: generation {spec.generation} is lower than generation {self.pending.generation}, "
                "which waits for the converger"
            )
            return
        self.pending, self.pending_raw = spec, signed.spec

    async def hand_over(self) -> None:
        """Hand the pending spec to the converger; kept pending (retried soon) when it does not answer."""
        spec = self.pending
        assert spec is not None
        # the verified bytes as signed (they decoded as this spec), not a re-encoding:
        # fields a newer control plane added reach the converger, which reports them
        payload = self.pending_raw if self.pending_raw is not None else spec
        try:
            ack = await call(self.ctx.nc, self.ctx.subjects.converger_spec, payload, SPEC_ACK_CODEC, timeout=HANDOVER_TIMEOUT_S)
        except ServiceCallError as exc:
            if exc.code in ("400", "409"):
                self._handed(spec)
                self.converger_reachable = True
                await self.reject(f"refused by the converger: {exc.description}")
                return
            self._unreachable(spec, f"{exc.code}: {exc.description}")
            return
        except (nats.errors.Error, asyncio.TimeoutError, BadMessage) as exc:
            self._unreachable(spec, describe(exc))
            return
        self._handed(spec)
        self.applied_generation = max(self.applied_generation, ack.generation)
        if not self.converger_reachable:
            self.converger_reachable = True
            self.log.info("converger reachable again; spec handed over", generation=ack.generation, changed=ack.changed)
        if ack.changed:
            self.m_specs.labels(outcome="accepted").inc()
            self.log.info("node spec handed to the converger", generation=ack.generation, signed=bool(self.keys))
        await self.clear_rejection()

    def _handed(self, spec: NodeSpec) -> None:
        # only what was handed over leaves `pending`; a newer spec taken meanwhile stays
        if self.pending is spec:
            self.pending, self.pending_raw = None, None

    def _unreachable(self, spec: NodeSpec, error: str) -> None:
        # the first miss of an outage is a WARNING; the retries every HANDOVER_RETRY_S are DEBUG
        (self.log.warning if self.converger_reachable else self.log.debug)(
            "converger not reachable; the newest spec is handed over again as soon as it answers",
            generation=spec.generation,
            error=error,
            retry_in_s=HANDOVER_RETRY_S,
        )
        self.converger_reachable = False

    async def reject(self, message: str) -> None:
        self.m_specs.labels(outcome="rejected").inc()
        self.log.error("node spec rejected; keeping the last good spec", reason=message, applied_generation=self.applied_generation)
        message = clip(message)  # a condition's message is a bounded Text
        if self.rejected is not None and self.rejected.message == message:
            return
        self.rejected = Condition(
            type=NODE_SPEC_REJECTED, status="True", reason="SpecRefused", message=message, since=datetime.now(timezone.utc)
        )
        await self.publish_condition(self.rejected)

    async def clear_rejection(self) -> None:
        # After a restart the bridge does not know whether it had raised the
        # condition: the first good spec clears it once, so it never sticks.
        if self.rejected is None and not self.rejection_unknown:
            return
        self.rejected = None
        self.rejection_unknown = False
        await self.publish_condition(
            Condition(
                type=NODE_SPEC_REJECTED,
                status="False",
                reason="SpecAccepted",
                message=f"generation {self.applied_generation} accepted",
                since=datetime.now(timezone.utc),
            )
        )

    async def publish_condition(self, condition: Condition) -> None:
        """Through the outbox like every event, so it survives an upstream outage."""
        event = NodeCondition(condition=condition)
        event_id = condition_id(self.opts.node_id, condition)
        js = self.ctx.nc.jetstream()
        try:
            payload = NODE_EVENT_CODEC.encode_valid(event)
            await js.publish(self.ctx.subjects.outbox_subject("condition"), payload, headers={MSG_ID_HEADER: event_id})
        except (nats.errors.Error, asyncio.TimeoutError, SchemaViolation) as exc:
            self.log.error("could not journal a condition", condition=condition.type, error=describe(exc))

    # ------------------------------------------------------------------ Hello and inventory

    async def _put(self, subject: str, payload: bytes, what: str) -> bool:
        assert self.up is not None
        try:
            await self.up.jetstream(timeout=5).publish(subject, payload)
        except (nats.errors.NoRespondersError, NoStreamResponseError):
            # nats-py 2.16's JetStream publish raises the latter for a missing bucket
            self._waiting_for(what)
            return False
        self._found(what)
        return True

    def mark_records(self, *, hello: bool = True, inventory: bool = True) -> None:
        """Hello and/or inventory need (re-)putting: a change, a reconnect (both), or the periodic re-put (both)."""
        if hello:
            self.hello_dirty.set()
        if inventory:
            self.inventory_dirty.set()
        if hello or inventory:
            self.records_wake.set()

    async def records_loop(self) -> None:
        self.mark_records()
        guard = LoopGuard(self.log, "records loop")
        while not self.ctx.stopping.is_set():
            await self.up_connected.wait()
            self.records_wake.clear()
            async with guard:
                try:
                    # each flag is cleared before its put and set again when it did not go:
                    # a change noticed during the put is not lost
                    if self.hello_dirty.is_set():
                        self.hello_dirty.clear()
                        put = False
                        try:
                            hello = await self.hello()
                            put = hello is not None and await self._put(
                                f"$KV.{UPSTREAM_NODES_BUCKET}.{self.opts.node_id}", HELLO_CODEC.encode_valid(hello), "KV bucket bcd_nodes"
                            )
                        finally:
                            if not put:
                                self.hello_dirty.set()
                        if put and hello is not None:
                            self.hello_published.set()
                            self.log.info("hello published", capabilities=hello.capabilities, boot_id=hello.boot_id, key_id=hello.key_id)
                    if self.inventory_dirty.is_set():
                        self.inventory_dirty.clear()
                        put = False
                        try:
                            if self.inventory is None:
                                await self._fetch_inventory()
                            put = self.inventory is not None and await self._put(
                                f"$KV.{UPSTREAM_INVENTORY_BUCKET}.{self.opts.node_id}",
                                INVENTORY_CODEC.encode_valid(self.inventory),
                                "KV bucket bcd_inventory",
                            )
                        finally:
                            if not put:
                                self.inventory_dirty.set()
                except (nats.errors.Error, asyncio.TimeoutError, ServiceCallError) as exc:
                    self.log.warning("publishing node records failed; retrying", error=describe(exc))
            # something left to put: retry in a second; else wait for a change or the periodic re-put
            unfinished = self.hello_dirty.is_set() or self.inventory_dirty.is_set()
            try:
                await asyncio.wait_for(self.records_wake.wait(), 1.0 if unfinished else self.opts.resync_interval)
            except asyncio.TimeoutError:
                if not unfinished:
                    # periodic re-put: cheap, and repairs a bucket recreated upstream
                    self.mark_records()

    async def _fetch_inventory(self) -> None:
        with contextlib.suppress(ServiceCallError, nats.errors.Error, asyncio.TimeoutError, BadMessage):
            self.inventory = await call(self.ctx.nc, self.ctx.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=3)

    async def hello(self) -> Hello | None:
        try:
            key = await call(self.ctx.nc, self.ctx.subjects.signer_key, Empty(), SIGNER_KEY_CODEC, timeout=3)
            status = await call(self.ctx.nc, self.ctx.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=3)
        except (ServiceCallError, nats.errors.Error, asyncio.TimeoutError) as exc:
            self.log.info("hello waits for the signer and converger", error=describe(exc))
            return None
        except BadMessage as exc:
            # a peer's reply its own schema refuses: said, and asked again (records_loop retries)
            self.log.error("hello waits: the signer's or converger's reply does not decode", error=str(exc))
            return None
        if self.inventory is None:
            await self._fetch_inventory()
        adapter = self.inventory.adapter if self.inventory is not None else ""
        self.hello_adapter = adapter
        self.signer = key
        return Hello(
            node_id=self.opts.node_id,
            boot_id=key.boot_id,
            public_key=key.public_key,
            key_id=key.key_id,
            capabilities=capabilities(status.privileged, status.bindings, adapter),
            agent_version=VERSION,
            started_at=self.started_at,
        )

    # ------------------------------------------------------------------ outbox

    async def outbox_loop(self) -> None:
        """Forward the outbox upstream: a sliding window of up to FORWARD_WINDOW publishes in flight."""
        js = self.ctx.nc.jetstream(timeout=5)
        stream = self.ctx.subjects.outbox_stream
        # a control plane verifies a report against the node's Hello: none goes
        # upstream before the Hello (with this boot's key and boot id) is there
        await self.hello_published.wait()
        assert self.up is not None
        # one context for the loop's life: publish_async subscribes its reply inbox on
        # its first publish, and the connection re-subscribes it after a reconnect
        up_js = self.up.jetstream(timeout=5)
        reader = self.reader = OutboxReader(self.ctx.nc, stream, self.ctx.subjects.outbox_filter, FORWARD_WINDOW, self.log)
        purger = self.purger = OutboxPurger(self.ctx.nc, stream, reader, self.log)
        purging = asyncio.create_task(purger.run(), name="bridge.outbox-purge")
        loop = asyncio.get_running_loop()
        guard = LoopGuard(self.log, "outbox loop")
        #: read from the outbox, not published yet (what waits behind a Released in flight)
        held: deque[OutboxMsg] = deque()
        #: published, their PubAcks awaited, in outbox order
        flight: deque[_InFlight] = deque()
        window, backoff = FORWARD_WINDOW, 0.5
        try:
            while not self.ctx.stopping.is_set():
                if not flight:
                    await self.up_connected.wait()
                async with guard:
                    if not reader.ready and not flight:
                        # cleared before the open: an event journaled during it wakes the wait at once
                        self.outbox_wake.clear()
                        try:
                            await reader.open()
                        except NotFoundError:
                            # the converger has not created the stream yet
                            with contextlib.suppress(asyncio.TimeoutError):
                                await asyncio.wait_for(self.outbox_wake.wait(), self.opts.outbox_poll)
                            continue
                        except (nats.errors.Error, asyncio.TimeoutError) as exc:
                            self.log.warning("outbox unreadable; retrying", error=describe(exc))
                            await asyncio.sleep(1)
                            continue
                    room = window - len(held) - len(flight)
                    if room > 0 and reader.ready:
                        held.extend(await reader.take(room))
                    refused = await self._send(up_js, held, flight, window)
                    if not flight:
                        if refused is None:
                            # idle (held is empty: with nothing in flight, the head of held always goes or is refused)
                            # (the depth gauge is depth_loop's: no round trip here stands between an event and its forward)
                            done, _ = await asyncio.wait({reader.arrival()}, timeout=min(self.opts.outbox_poll, PULL_HEARTBEAT_S))
                            if not done:
                                reader.check()
                            continue
                        msg, event_id, exc = refused
                        reader.rewind(msg.seq)
                        held.clear()
                        window = 1
                        backoff = await self._forward_failed(js, stream, event_id, exc, backoff)
                        continue
                    # wait for the oldest PubAck; also for new messages while they could go at once
                    head = flight[0]
                    waits: set[asyncio.Future[Any]] = {head.future}
                    if refused is None and not held and len(flight) < window and reader.ready:
                        waits.add(reader.arrival())
                    await asyncio.wait(waits, timeout=max(0.0, head.deadline - loop.time()), return_when=asyncio.FIRST_COMPLETED)
                    failed: tuple[_InFlight, BaseException] | None = None
                    while flight and flight[0].future.done():
                        sent = flight.popleft()
                        exc = _ack_error(sent.future)
                        if exc is not None:
                            failed = (sent, exc)
                            break
                        self._found("stream BCD_EVENTS")
                        backoff, window = 0.5, FORWARD_WINDOW
                        self.m_forwarded.labels(type=sent.event_type).inc()
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
                    await _settle(flight, loop)
                    flight.clear()
                    held.clear()
                    sent, exc = failed
                    reader.rewind(sent.msg.seq)
                    window = 1
                    backoff = await self._forward_failed(js, stream, sent.event_id, exc, backoff)
        finally:
            for sent in flight:
                sent.future.cancel()
            purging.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await purging

    async def _send(
        self, up_js: Any, held: deque[OutboxMsg], flight: deque[_InFlight], window: int
    ) -> tuple[OutboxMsg, str, BaseException] | None:
        """Publish from the head of `held` what may go now, in order, without waiting for PubAcks.

        Returns the message it could not publish (it stays at the head), its
        event id and why; None when all went or the rest waits for the
        window, for a Released in flight or for an empty flight.
        """
        assert self.up is not None
        deadline = asyncio.get_running_loop().time() + ACK_TIMEOUT_S
        while held and len(flight) < window:
            msg = held[0]
            event_type = msg.subject.rsplit(".", 1)[-1]
            event_id = msg.headers.get(MSG_ID_HEADER, f"{self.opts.node_id}.seq{msg.seq}")
            cards = cards_from_header(msg.headers) if event_type in ("bound", "released") else None
            if event_type == "bound" and any(s.event_type == "released" and shares_gpu(s.cards, cards) for s in flight):
                # a Bound may take a GPU a Released before it frees: it goes only once every
                # such Released is acked, so not even a refusal of one message in flight lets
                # a control plane see the Bound first (shared.eventorder)
                return None
            headers = {MSG_ID_HEADER: event_id}
            try:
                subject = upstream_event(self.opts.node_id, event_type)
                size = len(msg.data) + _header_bytes(headers)
                if size > self.up.max_payload:
                    if flight:
                        return None  # it goes once nothing is in flight: nothing behind it goes first
                    # the server would close the connection on it, losing what follows
                    raise ValueError(f"{size} bytes with headers exceed upstream's max_payload of {self.up.max_payload}")
                fut = await up_js.publish_async(subject, msg.data, headers=headers)
            except (nats.errors.Error, ValueError) as exc:
                return msg, event_id, exc
            held.popleft()
            # publish_async futures have no timeout of their own
            flight.append(_InFlight(msg, event_type, event_id, fut, deadline, cards))
        return None

    async def _forward_failed(self, js: Any, stream: str, event_id: str, exc: BaseException, backoff: float) -> float:
        """Say why, wait `backoff`; the next one."""
        if isinstance(exc, (nats.errors.NoRespondersError, NoStreamResponseError)):
            self._waiting_for("stream BCD_EVENTS")
            await asyncio.sleep(backoff)
            return min(backoff * 2, 5.0)
        self.m_forward_errors.inc()
        self.log.warning("forwarding an event failed; it stays in the outbox", event_id=event_id, error=str(exc) or type(exc).__name__)
        await asyncio.sleep(backoff)
        await self._update_depth(js, stream)
        return min(backoff * 2, 5.0)

    async def _update_depth(self, js: Any, stream: str) -> None:
        try:
            depth = await stream_depth(self.ctx.nc, stream)
        except (StreamMissing, nats.errors.Error, asyncio.TimeoutError):
            return
        self.m_depth.set(depth.messages)
        self.m_age.set((datetime.now(timezone.utc) - depth.oldest).total_seconds() if depth.oldest else 0)

    async def depth_loop(self) -> None:
        """The outbox depth and age, also (especially) while upstream is away."""
        js = self.ctx.nc.jetstream(timeout=5)
        guard = LoopGuard(self.log, "outbox depth")
        while not self.ctx.stopping.is_set():
            async with guard:
                await self._update_depth(js, self.ctx.subjects.outbox_stream)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stopping.wait(), 2.0)

    # ------------------------------------------------------------------ run

    async def run(self, ctx: ServiceContext) -> None:
        depth = asyncio.create_task(self.depth_loop(), name="bridge.depth")
        watch = asyncio.create_task(self.tls_loop(), name="bridge.tls")
        try:
            await self._connect_upstream()
        finally:
            if self.up is None:
                for t in (depth, watch):
                    t.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
        if self.up is None:
            return
        tasks = [
            depth,
            watch,
            asyncio.create_task(self.specs_loop(), name="bridge.specs"),
            asyncio.create_task(self.records_loop(), name="bridge.records"),
            asyncio.create_task(self.outbox_loop(), name="bridge.outbox"),
        ]
        try:
            stop = asyncio.create_task(ctx.stopping.wait())
            done, _ = await asyncio.wait({stop, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            for t in [*tasks]:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            with contextlib.suppress(Exception):
                stop.cancel()
                await stop

    async def close(self, ctx: ServiceContext) -> None:
        # what upstream acknowledged is deleted now if it can be (else forwarded again
        # after the restart, and dropped upstream); the consumer goes with it
        if self.purger is not None:
            await self.purger.flush(2.0)
        if self.reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.reader.close(), 1.0)
                await asyncio.wait_for(asyncio.gather(*self.reader._background, return_exceptions=True), 1.0)
        if self.up is not None and not self.up.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.up.close(), 3)


main = main_for(BridgeApp)

__all__ = ["BridgeApp", "capabilities", "main", "NODE_SPEC_REJECTED"]
