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
- records: put Hello and the Inventory into `bcd_nodes` / `bcd_inventory`;
- outbox: forward the node-bus outbox to `BCD_EVENTS` in sequence order with
  `Nats-Msg-Id`, deleting a local message only after upstream's PubAck. While
  upstream is away the outbox grows on disk; nothing is dropped.
It waits for buckets and streams that do not exist yet and never creates them.
No message and no peer's reply stops a loop: each iteration runs under a
`LoopGuard` (logged, backed off, carried on), and what the bridge puts
upstream or journals is encoded through its codec's `encode_valid`.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client
from nats.js.errors import APIError, NotFoundError
from prometheus_client import Counter, Gauge

from shared.eventids import condition_id
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
    upstream_event,
    upstream_node_user,
    upstream_spec_get_subject,
    upstream_spec_key_subject,
)

NODE_SPEC_REJECTED = "NodeSpecRejected"
#: one hand-over to the converger waits this long for its answer; then it is tried again.
HANDOVER_TIMEOUT_S = 2.0
#: while the converger does not take the newest spec, it is handed over again this often.
HANDOVER_RETRY_S = 0.5


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
            Option("--outbox-poll", "seconds between outbox checks when idle", default=1.0, type=float),
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
            self.mark_records()

        async def on_outbox(_: Any) -> None:
            self.outbox_wake.set()

        async def on_converger_changed(_: Any) -> None:
            # the converger found (or lost) the root helper: the Hello's capabilities change now;
            # a converger that speaks again takes the spec that waits for it now, too
            self.mark_records()
            if self.pending is not None:
                self.spec_wake.set()

        await ctx.nc.subscribe(ctx.subjects.inventory_changed, cb=on_inventory)
        await ctx.nc.subscribe(ctx.subjects.outbox_filter, cb=on_outbox)
        await ctx.nc.subscribe(ctx.subjects.converger_status_changed, cb=on_converger_changed)

    # ------------------------------------------------------------------ upstream connection

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
            self.log.warning("upstream disconnected; the outbox keeps events until it is back")

        async def on_reconnect() -> None:
            self.up_connected.set()
            self.m_up.set(1)
            self.log.info("upstream reconnected")
            self.mark_records()
            self.spec_wake.set()
            self.outbox_wake.set()

        async def on_error(exc: Exception) -> None:
            self.log.warning("upstream error", error=str(exc))

        delay = 0.5
        while not self.ctx.stopping.is_set():
            try:
                self.up = await nats.connect(
                    o.upstream_url,
                    name=f"bcd-bridge-{o.node_id}",
                    inbox_prefix=inbox_prefix(user).encode(),
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=1,
                    connect_timeout=3,
                    allow_reconnect=True,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    error_cb=on_error,
                    **kw,
                )
                break
            except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
                self.log.warning("upstream unreachable; retrying", url=o.upstream_url, error=str(exc) or type(exc).__name__, retry_in_s=delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.ctx.stopping.wait(), delay)
                delay = min(delay * 2, 10.0)
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
        self.log.info("connected upstream", url=o.upstream_url, user=user)

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
        except nats.errors.NoRespondersError:
            self._waiting_for(what)
            return False
        self._found(what)
        return True

    def mark_records(self) -> None:
        """Hello and inventory need (re-)putting: a change, a reconnect, or the periodic re-put."""
        self.hello_dirty.set()
        self.inventory_dirty.set()
        self.records_wake.set()

    async def records_loop(self) -> None:
        self.mark_records()
        guard = LoopGuard(self.log, "records loop")
        while not self.ctx.stopping.is_set():
            await self.up_connected.wait()
            self.records_wake.clear()
            async with guard:
                try:
                    if self.hello_dirty.is_set():
                        hello = await self.hello()
                        if hello is not None and await self._put(
                            f"$KV.{UPSTREAM_NODES_BUCKET}.{self.opts.node_id}", HELLO_CODEC.encode_valid(hello), "KV bucket bcd_nodes"
                        ):
                            self.hello_dirty.clear()
                            self.hello_published.set()
                            self.log.info("hello published", capabilities=hello.capabilities, boot_id=hello.boot_id, key_id=hello.key_id)
                    if self.inventory_dirty.is_set():
                        if self.inventory is None:
                            await self._fetch_inventory()
                        if self.inventory is not None and await self._put(
                            f"$KV.{UPSTREAM_INVENTORY_BUCKET}.{self.opts.node_id}",
                            INVENTORY_CODEC.encode_valid(self.inventory),
                            "KV bucket bcd_inventory",
                        ):
                            self.inventory_dirty.clear()
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
        js = self.ctx.nc.jetstream(timeout=5)
        stream = self.ctx.subjects.outbox_stream
        cursor = 0
        backoff = 0.5
        # a control plane verifies a report against the node's Hello: none goes
        # upstream before the Hello (with this boot's key and boot id) is there
        await self.hello_published.wait()
        guard = LoopGuard(self.log, "outbox loop")
        while not self.ctx.stopping.is_set():
            await self.up_connected.wait()
            async with guard:
                try:
                    # the first message at or after the cursor (earlier ones are deleted)
                    msg = await js.get_msg(stream, seq=max(cursor, 1), subject=self.ctx.subjects.outbox_filter, next=True)
                except NotFoundError:
                    # empty (or the converger has not created it yet)
                    await self._update_depth(js, stream)
                    self.outbox_wake.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.outbox_wake.wait(), self.opts.outbox_poll)
                    continue
                except (nats.errors.Error, asyncio.TimeoutError, APIError) as exc:
                    self.log.warning("outbox unreadable; retrying", error=str(exc) or type(exc).__name__)
                    await asyncio.sleep(1)
                    continue
                event_type = msg.subject.rsplit(".", 1)[-1]
                headers = dict(msg.headers or {})
                event_id = headers.get(MSG_ID_HEADER, f"{self.opts.node_id}.seq{msg.seq}")
                try:
                    assert self.up is not None
                    await self.up.jetstream(timeout=5).publish(
                        upstream_event(self.opts.node_id, event_type), msg.data or b"", headers={MSG_ID_HEADER: event_id}
                    )
                except nats.errors.NoRespondersError:
                    self._waiting_for("stream BCD_EVENTS")
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    continue
                except (nats.errors.Error, asyncio.TimeoutError, APIError, ValueError) as exc:
                    self.m_forward_errors.inc()
                    self.log.warning("forwarding an event failed; it stays in the outbox", event_id=event_id, error=str(exc) or type(exc).__name__)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
                    await self._update_depth(js, stream)
                    continue
                self._found("stream BCD_EVENTS")
                backoff = 0.5
                self.m_forwarded.labels(type=event_type).inc()
                try:
                    await js.delete_msg(stream, msg.seq)
                except NotFoundError:
                    pass
                cursor = msg.seq + 1
                self.log.debug("event forwarded", event_id=event_id, type=event_type)

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
        try:
            await self._connect_upstream()
        finally:
            if self.up is None:
                depth.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await depth
        if self.up is None:
            return
        tasks = [
            depth,
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
        if self.up is not None and not self.up.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.up.close(), 3)


main = main_for(BridgeApp)

__all__ = ["BridgeApp", "capabilities", "main", "NODE_SPEC_REJECTED"]
