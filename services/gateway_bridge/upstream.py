"""The one connection upstream: connecting, reconnecting, TLS files renewed, its state said in the PING metadata.

The bridge is the node's only door upstream and every job goes through this
one connection (specs in, records and events out), so its life is owned here
once: the first connect (tried until it goes), nats-py's reconnects, the TLS
files looked at again and used at the next reconnect, and what `bcd status`
and `bcd doctor` show of it (`upstream_state`, `upstream_error`). It also keeps
the list of upstream buckets and streams the bridge waits for (the control
plane creates them, the bridge never does), so each is said once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.client import Client
from prometheus_client import Gauge

from shared.stopping import sleep_unless
from shared.subjects import inbox_prefix, server_list, upstream_node_user
from shared.tlsconfig import TlsFiles, UpstreamTls, connect_options, explain, local_problems, new_client

#: the upstream connection's pings (nats-py's default is one every 120 s, two unanswered).
UPSTREAM_PING_S = 5.0
UPSTREAM_PINGS_OUTSTANDING = 3


class Upstream:
    """The upstream connection (`nc`, None until the first connect) and `connected` while it is up.

    `opts` are the bridge's options (node_id, the --upstream-* ones);
    `metadata` the service's PING metadata, where the state goes; `gauge` is
    bcd_upstream_connected; `on_reconnect` is called after each reconnect
    (what the other jobs put or read again then).
    """

    def __init__(
        self,
        opts: Any,
        tls: UpstreamTls,
        metadata: dict[str, str],
        log: Any,
        stopping: asyncio.Event,
        gauge: Gauge,
        on_reconnect: Callable[[], None],
    ) -> None:
        self.opts = opts
        self.tls = tls
        self.metadata = metadata
        self.log = log
        self.stopping = stopping
        self.gauge = gauge
        self.on_reconnect = on_reconnect
        self.nc: Client | None = None
        self.connected = asyncio.Event()
        #: the client still making its first connection (the TLS watch renews it too)
        self.connecting: Client | None = None
        self.last_error = ""
        #: the upstream buckets and streams found missing (said once each)
        self.waiting: set[str] = set()
        self.tls_files = TlsFiles(tls)
        metadata["upstream_tls"] = tls.describe()
        self.set_state("connecting", self.tls_files.error or "")
        for problem in local_problems(tls):
            log.warning("upstream TLS file problem", problem=problem)
        if self.tls_files.error:
            log.error("upstream TLS files do not load; waiting for them", error=self.tls_files.error)

    # ------------------------------------------------------------------ state

    def set_state(self, state: str, error: str) -> None:
        """What `bcd status` and `bcd doctor` say of the upstream (the PING metadata)."""
        self.metadata["upstream_state"] = state
        self.metadata["upstream_error"] = error

    def failed(self, why: str) -> None:
        """An error from upstream or on the way there, said once per distinct reason (nats-py
        tries again each second, and each try that fails reports here)."""
        connected = self.nc is not None and self.nc.is_connected
        self.set_state("connected" if connected else ("connecting" if self.nc is None else "disconnected"), why)
        if why == self.last_error:
            return
        self.last_error = why
        if connected:
            self.log.warning("upstream error", error=why)
        else:
            self.log.warning("upstream refused or unreachable; retrying (holds and outbox kept)", url=self.opts.upstream_url, error=why)

    def ok(self) -> None:
        self.last_error = ""
        self.set_state("connected", self.tls_files.error or "")

    def waiting_for(self, what: str) -> None:
        if what not in self.waiting:
            self.waiting.add(what)
            self.log.warning(f"waiting for upstream {what} (the control plane creates it)")

    def found(self, what: str) -> None:
        if what in self.waiting:
            self.waiting.discard(what)
            self.log.info(f"upstream {what} is there")

    # ------------------------------------------------------------------ TLS files

    async def tls_loop(self) -> None:
        """Looks at the TLS files every --upstream-tls-check s: a renewed set goes into the
        client, used at its next (re)connect; one that does not load is said, the old kept."""
        said = ""
        while not self.stopping.is_set():
            await sleep_unless(self.stopping, max(0.05, float(self.opts.upstream_tls_check)))
            if self.stopping.is_set():
                return
            if self.tls_files.refresh():
                for nc in (self.nc, self.connecting):
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
                if self.nc is not None and self.nc.is_connected:
                    self.set_state("connected", "")
            elif self.tls_files.error and self.tls_files.error != said:
                said = self.tls_files.error
                self.log.warning("upstream TLS files changed but do not load; the ones in use are kept", error=said)
                if self.nc is not None and self.nc.is_connected:
                    self.set_state("connected", f"renewed TLS files not used: {said}")

    # ------------------------------------------------------------------ connecting

    async def connect(self, on_connect: Callable[[Client], Awaitable[None]]) -> Client | None:
        """Connect, trying until it goes or the service stops (None then).

        `on_connect` runs on the new connection before it counts as up (the
        spec subscription); nats-py makes every later reconnect itself.
        """
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
            self.connected.clear()
            self.gauge.set(0)
            self.set_state("disconnected", self.metadata.get("upstream_error", ""))
            self.log.warning("upstream disconnected; the outbox keeps events until it is back")

        async def on_reconnect() -> None:
            self.connected.set()
            self.gauge.set(1)
            self.ok()
            self.log.info("upstream reconnected")
            self.on_reconnect()

        async def on_error(exc: Exception) -> None:
            nc = self.nc or self.connecting
            srv = getattr(nc, "_current_server", None)
            where = f"{srv.uri.hostname}:{srv.uri.port}" if srv is not None and srv.uri is not None else ""
            self.failed(explain(exc, server=where))

        delay = 0.5
        while not self.stopping.is_set():
            if not self.tls_files.ready:
                # files that do not load yet: said once, looked at again each check
                self.failed(self.tls_files.error or "TLS files not loaded")
                await sleep_unless(self.stopping, max(0.05, float(o.upstream_tls_check)))
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
                self.nc = nc
                break
            except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
                self.failed(explain(exc))
                await sleep_unless(self.stopping, delay)
                delay = min(delay * 2, 10.0)
            finally:
                self.connecting = None
        if self.nc is None:
            return None
        await on_connect(self.nc)
        self.connected.set()
        self.gauge.set(1)
        self.ok()
        self.log.info("connected upstream", url=o.upstream_url, user=user, tls=self.tls.describe())
        return self.nc

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 3)


__all__ = ["UPSTREAM_PINGS_OUTSTANDING", "UPSTREAM_PING_S", "Upstream"]
