"""The gateway_bridge micro service: the node's only door to upstream.

This module is the wiring: the options, the one upstream connection and the
jobs made in `setup`, their loops started in `run`. Each job is a module of
its own, with what it needs handed in:

- upstream.py: the connection upstream (connect, reconnect, TLS files renewed,
  `upstream_state`/`upstream_error` in the PING metadata, the upstream
  buckets and streams waited for);
- specs.py: specs in: read `bcd_nodespecs/<node_id>`, verify against the
  control-plane keys (shared/spectrust.py: no key and no lab opt-out, no
  start), hand the newest good one to the converger as the signed envelope it
  came in, never backwards (NodeSpecRejected otherwise);
- records.py: the Hello and the Inventory put into `bcd_nodes` / `bcd_inventory`;
- forward.py: the node-bus outbox forwarded to `BCD_EVENTS` in sequence order
  with `Nats-Msg-Id`, a sliding window in flight; outbox.py reads the outbox,
  purge.py takes out what upstream acknowledged;
- metrics.py: the bridge's metrics, and the outbox depth measured on its own.

Each loop survives an unreachable upstream on its own. The bridge waits for
buckets and streams that do not exist yet and never creates them. No message
and no peer's reply stops a loop: each iteration runs under a `LoopGuard`
(logged, backed off, carried on), and what the bridge puts upstream or
journals is encoded through its codec's `encode_valid`.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from services.gateway_bridge.forward import Forwarder
from services.gateway_bridge.metrics import BridgeMetrics, OutboxDepth
from services.gateway_bridge.records import Records
from services.gateway_bridge.specs import SpecIntake
from services.gateway_bridge.upstream import UPSTREAM_PING_S, Upstream
from shared.runtime import Option, ServiceApp, ServiceContext, StartupError, guarded, main_for
from shared.spectrust import announce, load_trust, trust_options
from shared.tlsconfig import TlsConfigError, upstream_tls


class BridgeApp(ServiceApp):
    name = "gateway_bridge"
    description = "the node's only upstream connection: specs in, records and events out"

    def __init__(self) -> None:
        self.started_at = datetime.now(timezone.utc)

    def options(self) -> list[Option]:
        return [
            Option("--upstream-url", "upstream (control plane) NATS URL", required=True),
            Option("--upstream-user", "upstream NATS user (default node-<node_id>)"),
            Option("--upstream-password-file", "file holding the upstream password", type=Path),
            Option("--upstream-token-file", "file holding an upstream token", type=Path),
            Option("--upstream-nkey-file", "upstream nkey seed file", type=Path),
            Option("--upstream-creds", "upstream .creds file (JWT + nkey)", type=Path),
            *trust_options(),
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
        # before anything else: a bridge that cannot tell the control plane's specs from
        # anyone else's does not start (DESIGN 3), it does not merely warn
        self.trust = load_trust(o.cp_key, o.accept_unsigned_specs)
        ctx.metadata["upstream"] = o.upstream_url
        try:
            tls = upstream_tls(
                o.upstream_url,
                ca=o.upstream_ca,
                cert=o.upstream_cert,
                key=o.upstream_key,
                server_name=o.upstream_server_name,
                required=o.upstream_tls == "required",
            )
        except TlsConfigError as exc:
            raise StartupError(str(exc)) from None
        m = self.metrics = BridgeMetrics(ctx.registry)
        self.upstream = Upstream(o, tls, ctx.metadata, ctx.log, ctx.stopping, m.up, on_reconnect=self._reconnected)
        announce(self.trust, metadata=ctx.metadata, log=ctx.log, registry=ctx.registry)
        s = ctx.subjects
        self.depth = OutboxDepth(ctx.nc, s.outbox_stream, m.depth, m.age, ctx.log)
        self.specs = SpecIntake(ctx.nc, s, o.node_id, self.trust, self.upstream, o.resync_interval, m.specs, ctx.log, ctx.stopping)
        self.records = Records(ctx.nc, s, o.node_id, self.upstream, o.resync_interval, self.started_at, ctx.log, ctx.stopping)
        self.forward = Forwarder(
            ctx.nc,
            s,
            o.node_id,
            self.upstream,
            self.records.published,
            o.outbox_poll,
            m.forwarded,
            m.forward_errors,
            self.depth.update,
            ctx.log,
            ctx.stopping,
        )

        async def on_converger_changed(_: Any) -> None:
            # the converger found (or lost) the root helper: the Hello's capabilities change now;
            # a converger that speaks again takes the spec that waits for it now, too
            self.records.mark(hello=True, inventory=False)
            self.specs.converger_changed()

        await ctx.nc.subscribe(ctx.subjects.inventory_changed, cb=guarded(ctx.log, "inventory notice")(self.records.on_inventory))
        # the writers say when they journaled: the bridge reads the outbox then
        for journaled in (ctx.subjects.converger_journaled, ctx.subjects.inventory_journaled):
            await ctx.nc.subscribe(journaled, cb=guarded(ctx.log, "outbox notice")(self.forward.on_outbox))
        await ctx.nc.subscribe(ctx.subjects.converger_status_changed, cb=on_converger_changed)

    def _reconnected(self) -> None:
        """Upstream is back: both records are put again, the spec read again, the outbox looked at."""
        self.records.mark()
        self.specs.wake.set()
        self.forward.wake.set()

    @property
    def up(self) -> Client | None:
        """The upstream connection (None until the first connect)."""
        return self.upstream.nc

    # ------------------------------------------------------------------ run

    async def run(self, ctx: ServiceContext) -> None:
        depth = asyncio.create_task(self.depth.run(ctx.stopping), name="bridge.depth")
        watch = asyncio.create_task(self.upstream.tls_loop(), name="bridge.tls")
        try:
            await self.upstream.connect(on_connect=self.specs.subscribe)
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
            asyncio.create_task(self.specs.run(), name="bridge.specs"),
            asyncio.create_task(self.records.run(), name="bridge.records"),
            asyncio.create_task(self.forward.run(), name="bridge.outbox"),
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
        # after the restart, and dropped upstream)
        await self.forward.close()
        await self.upstream.close()


main = main_for(BridgeApp)

__all__ = ["BridgeApp", "main"]
