"""The control plane's connection to the upstream NATS: credentials, verified TLS, retries said once.

This module owns how the control plane reaches the upstream, as the
`controlplane` user with its nkey or password and its own inbox prefix, over
verified TLS when asked. It owns what a failed connection says: serve retries
and logs each distinct reason once, while a put tries once and raises one line
naming the cause. It also owns how renewed TLS files on disk take effect at the
next reconnect, and how a connection is closed. Both the serve command and
a put connect through here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path
from typing import Any

import nats.errors
from nats.aio.client import Client

from shared import logs
from shared.stopping import sleep_unless, unless_stopped
from shared.subjects import inbox_prefix, server_list
from shared.tlsconfig import TlsConfigError, TlsFiles, UpstreamTls, client_context, connect_options, explain, new_client, upstream_tls


log = logs.get_logger("controlplane")

#: how often `serve` looks at its TLS files for a renewal (seconds; it is used at the next reconnect)
TLS_CHECK_S = 10.0


def tls_from_args(args: argparse.Namespace) -> UpstreamTls:
    """The TLS the command line and BCD_CP_* ask for (TlsConfigError: a certificate without its key)."""
    return upstream_tls(
        args.nats_url, ca=args.ca_file, cert=args.cert_file, key=args.key_file, server_name=args.server_name, required=args.tls_required
    )


class _Reasons:
    """What went wrong connecting, each distinct reason said once until a connection is up again
    (nats-py retries every second and calls back each time)."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def first(self, reason: str) -> bool:
        if reason in self.said:
            return False
        self.said.add(reason)
        return True

    def clear(self) -> None:
        self.said.clear()


async def connect_upstream(
    url: str,
    user: str,
    password_file: Path | None,
    *,
    nkey_file: Path | None = None,
    tls: UpstreamTls | None = None,
    reconnect: bool = True,
    timeout: float = 5.0,
) -> Client:
    """Connect as the control plane: with `nkey_file` as that nkey user (else with the password
    of `password_file`, else without credentials), and with `tls` (UpstreamTls) over verified TLS.

    `reconnect=True` (serve): tries until connected, each distinct failure logged once, as one
    line (`explain`: another CA, an expired certificate, a name mismatch, a plain-text server,
    a client certificate refused). `reconnect=False` (one put): one try within `timeout`
    seconds, then ConnectionError naming the cause in that one line (nats-py alone would retry
    a refused server forever and log each failure). TlsConfigError when the TLS files do not
    load (reconnect=True); a ConnectionError saying so with reconnect=False."""
    tls = tls or UpstreamTls()
    try:
        ctx = client_context(tls) if tls.enabled else None
    except TlsConfigError as exc:
        if reconnect:
            raise
        raise ConnectionError(f"upstream {url}: {exc}") from None
    password = Path(password_file).read_text().strip() if password_file and nkey_file is None else None
    errors: list[Exception] = []
    reasons = _Reasons()

    async def on_error(exc: Exception) -> None:
        if not reconnect:
            errors.append(exc)  # said once, in the ConnectionError
            return
        reason = explain(exc)
        if nc.is_connected:
            log.warning("nats error", error=reason)
        elif reasons.first(reason):
            log.warning("upstream connection failed; retrying", reason=reason, tls=tls.describe())

    nc = new_client(tls)

    async def on_disconnect() -> None:
        # a close we asked for is not news
        if not (nc.is_closed or nc.is_draining):
            log.warning("disconnected from upstream")

    async def on_reconnect() -> None:
        reasons.clear()
        log.info("reconnected to upstream")

    options: dict[str, Any] = dict(
        name="bcd-controlplane",
        user=user if password is not None else None,
        password=password,
        inbox_prefix=inbox_prefix(user).encode(),
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        allow_reconnect=reconnect,
        **connect_options(tls, ctx),
    )
    if nkey_file is not None:
        options["nkeys_seed"] = str(nkey_file)
    if reconnect:
        await nc.connect(server_list(url), max_reconnect_attempts=-1, reconnect_time_wait=1, connect_timeout=5, **options)
        reasons.clear()
        return nc
    try:
        await asyncio.wait_for(
            nc.connect(server_list(url), max_reconnect_attempts=1, reconnect_time_wait=min(0.25, timeout / 4), connect_timeout=max(0.1, timeout), **options),
            timeout=max(0.1, timeout),
        )
    except Exception as exc:  # noqa: BLE001 - whatever the client raises, upstream is not there for us
        with contextlib.suppress(Exception):
            await nc.close()
        cause: BaseException = errors[-1] if errors and isinstance(exc, (nats.errors.NoServersError, asyncio.TimeoutError)) else exc
        why = "connection refused" if isinstance(cause, ConnectionRefusedError) else (
            f"no answer within {timeout:g} s" if isinstance(cause, asyncio.TimeoutError) else explain(cause)
        )
        raise ConnectionError(f"upstream {url} not reachable ({why})") from None
    return nc


async def watch_tls(files: TlsFiles, nc: Client, stopping: asyncio.Event, every: float) -> None:
    """A renewed certificate, key or CA bundle on disk becomes the context of the next reconnect;
    one that does not load is said once and the files in use are kept."""
    said: str | None = None
    while not stopping.is_set():
        await sleep_unless(stopping, every)
        if files.refresh():
            files.install(nc)
            said = None
            log.info("upstream TLS files renewed: used at the next reconnect", tls=files.tls.describe(), generation=files.generation)
        elif files.error and files.error != said:
            said = files.error
            log.warning("upstream TLS renewal does not load; keeping the files in use", reason=files.error)


async def close(nc: Client) -> None:
    """Drain the connection (up to 3 s), else close it; nothing when it is closed already."""
    if nc.is_closed:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.drain(), 3.0)
    if not nc.is_closed:
        with contextlib.suppress(Exception):
            await nc.close()


async def connect_serving(args: argparse.Namespace, tls: UpstreamTls, stopping: asyncio.Event) -> tuple[Client, TlsFiles] | None:
    """Connected (None: stopped first). TLS files that do not load (yet) are said once per
    reason and tried again, alive (a supervisor would only loop on an exit); the connection's
    own failures likewise, in connect_upstream."""
    said: set[str] = set()
    while True:
        try:
            files = TlsFiles(tls)
            break
        except TlsConfigError as exc:
            if str(exc) not in said:
                said.add(str(exc))
                log.warning("upstream TLS files do not load; retrying", reason=str(exc))
            await sleep_unless(stopping, 5.0)
            if stopping.is_set():
                return None
    # one cancel can be lost in nats-py's retry loop (shared/stopping.py): cancelled until it ends
    nc = await unless_stopped(connect_upstream(args.nats_url, args.user, args.password_file, nkey_file=args.nkey_file, tls=tls), stopping)
    if nc is None:
        return None
    return nc, files


__all__ = ["TLS_CHECK_S", "tls_from_args", "connect_upstream", "watch_tls", "close", "connect_serving"]
