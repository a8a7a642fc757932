"""TLS to the upstream NATS: the client context, refusing a plain-text server, one line per failure, rotation.

The bridge and the reference control plane dial the upstream over the network;
this module is how they do it with TLS (docs/install.md, "TLS to the upstream"):

- `UpstreamTls` is what an operator configures: a CA bundle (else the system's
  trust store), an optional client certificate and key (mutual TLS), an optional
  server name (else the URL's host). TLS is on when the URL says `tls://`, when
  any of those files is given, or when it is required outright; `nats://` with a
  CA is TLS all the same.
- nats-py upgrades a connection only when the server's INFO asks for TLS, so a
  server (or an impostor) that offers plain text would get the credentials in
  clear. `TlsClient` refuses such a server before CONNECT is sent
  (`PlainTextUpstream`): with TLS configured, nothing crosses in clear.
- `explain` turns what the handshake raised into one line an operator can act
  on: another CA, an expired or not-yet-valid certificate, a name mismatch, a
  plain-text server, a client certificate the server refused.
- `TlsFiles` watches the files' identity (inode, size, mtime): a renewed
  certificate or bundle becomes a new context, swapped into the client's
  options, which nats-py reads at each (re)connect. The connection that is up
  stays as it was verified; the next reconnect (a server restart, a network
  cut, three missed pings) uses the new files. A renewal that does not load
  (a key that does not match its certificate, half a file) keeps the old
  context and is said once.
- A connection given up (three unanswered pings over a stalled link) is dropped
  without TLS's goodbye, which would hold the reconnect back 30 s.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import nats.errors
from nats.aio.client import Client


#: X509_V_ERR_* codes OpenSSL puts in SSLCertVerificationError.verify_code
_EXPIRED = 10
_NOT_YET_VALID = 9
_NAME_MISMATCH = {62, 63, 64}  # host name, e-mail, IP address
_UNTRUSTED = {2, 18, 19, 20, 21, 27}
#: a server's TLS alerts that are about the client's certificate (or its lack of one)
_CLIENT_CERT_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    "TLSV1_ALERT_UNKNOWN_CA",
    "SSLV3_ALERT_BAD_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    "TLSV1_ALERT_DECRYPT_ERROR",
}


class _NoEofNote(logging.Filter):
    """asyncio says "returning true from eof_received() has no effect when using ssl" each time a
    TLS connection nats-py upgraded closes (its StreamReaderProtocol answers True): not news."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


logging.getLogger("asyncio").addFilter(_NoEofNote())


class TlsConfigError(ValueError):
    """The configured TLS files cannot make a context (one line, naming the file)."""


class PlainTextUpstream(nats.errors.Error):
    """The upstream offered no TLS although this client requires it."""

    def __init__(self, host: str) -> None:
        super().__init__(f"upstream {host} offers no TLS (plain text) but TLS is configured: refused before sending credentials")

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class UpstreamTls:
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str = ""
    required: bool = False

    @property
    def enabled(self) -> bool:
        return self.required or self.ca is not None or self.cert is not None

    def files(self) -> list[Path]:
        return [p for p in (self.ca, self.cert, self.key) if p is not None]

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        parts = [f"CA {self.ca}" if self.ca else "CA: system trust store"]
        if self.cert:
            parts.append(f"client certificate {self.cert}")
        if self.server_name:
            parts.append(f"server name {self.server_name}")
        return "on (" + ", ".join(parts) + ")"


def url_wants_tls(url: str) -> bool:
    return any(urlparse(u.strip()).scheme == "tls" for u in url.split(",") if u.strip())


def upstream_tls(
    url: str, *, ca: Path | str | None = None, cert: Path | str | None = None, key: Path | str | None = None, server_name: str = "", required: bool = False
) -> UpstreamTls:
    """The TLS an upstream URL and the configured files ask for; TlsConfigError for a half pair."""
    cert_p = Path(cert) if cert else None
    key_p = Path(key) if key else None
    if (cert_p is None) != (key_p is None):
        raise TlsConfigError("a client certificate needs its key and a key its certificate (--upstream-cert with --upstream-key)")
    return UpstreamTls(
        ca=Path(ca) if ca else None,
        cert=cert_p,
        key=key_p,
        server_name=server_name or "",
        required=required or url_wants_tls(url),
    )


def client_context(tls: UpstreamTls) -> ssl.SSLContext:
    """A verifying client context (TLS 1.2 or later, the server's name checked)."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca) if tls.ca else None)
    except FileNotFoundError:
        raise TlsConfigError(f"the CA bundle {tls.ca} does not exist") from None
    except (ssl.SSLError, OSError) as exc:
        raise TlsConfigError(f"the CA bundle {tls.ca} cannot be read: {_ssl_words(exc)}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    if tls.cert is not None and tls.key is not None:
        try:
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
        except FileNotFoundError as exc:
            raise TlsConfigError(f"the client certificate or key does not exist ({exc.filename or tls.cert})") from None
        except (ssl.SSLError, OSError) as exc:
            raise TlsConfigError(f"the client certificate {tls.cert} and key {tls.key} do not load: {_ssl_words(exc)}") from None
    return ctx


def local_problems(tls: UpstreamTls, *, now: datetime | None = None) -> list[str]:
    """What is wrong with the TLS files themselves, before any handshake (doctor, the bridge's start)."""
    if not tls.files():
        return []
    from .pki import certificate_problem  # cryptography only where there are files to read

    out = []
    if tls.ca is not None:
        p = certificate_problem(tls.ca, "the CA bundle", now=now)
        if p:
            out.append(p)
    if tls.cert is not None:
        p = certificate_problem(tls.cert, "this client's certificate", now=now)
        if p:
            out.append(p)
    return out


def _ssl_words(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    if reason == "KEY_VALUES_MISMATCH":
        return "the key is not the certificate's"
    if reason:
        return str(reason).lower().replace("_", " ")
    return str(exc) or type(exc).__name__


def explain(exc: BaseException, *, server: str = "") -> str:
    """One line saying why a TLS connection to the upstream failed (else the error as it is)."""
    at = f"upstream {server}" if server else "the upstream"
    if isinstance(exc, (PlainTextUpstream, ClientCertRefused)):
        return str(exc)
    if isinstance(exc, TlsConfigError):
        return str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        if code == _EXPIRED:
            return f"{at}'s certificate has expired: renew it"
        if code == _NOT_YET_VALID:
            return f"{at}'s certificate is not valid yet (its start is in the future: check both clocks)"
        if code in _NAME_MISMATCH:
            return f"{at}'s certificate does not name the host dialled ({exc.verify_message}): set the server name or fix the certificate"
        if code in _UNTRUSTED:
            return f"{at}'s certificate is not signed by the configured CA ({exc.verify_message}): a wrong CA bundle, or not our upstream"
        return f"{at}'s certificate was refused: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        reason = str(getattr(exc, "reason", "") or "")
        if reason == "WRONG_VERSION_NUMBER":
            return f"{at} does not speak TLS there (plain text or another protocol)"
        if reason in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_HANDSHAKE_FAILURE") :
            return f"{at} requires a client certificate (mutual TLS) and got none: set --upstream-cert and --upstream-key"
        if reason in ("TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE", "TLSV1_ALERT_DECRYPT_ERROR"):
            return f"{at} refused this node's client certificate (not signed by a CA it trusts)"
        if reason == "SSLV3_ALERT_CERTIFICATE_EXPIRED":
            return f"{at} refused this node's client certificate: it has expired (renew it)"
        return f"TLS with {at} failed: {_ssl_words(exc)}"
    return str(exc) or type(exc).__name__


class ClientCertRefused(nats.errors.Error):
    """The upstream closed the connection right after the TLS handshake: with TLS 1.3 that is
    how a server that verifies clients refuses this one's certificate (or its lack of one)."""

    def __str__(self) -> str:
        return str(self.args[0])


def _refusal(tls: UpstreamTls, host: str) -> ClientCertRefused:
    from .pki import certificate_problem  # cryptography: ~7 MiB a process, loaded only to say this

    if tls.cert is None:
        why = "requires a client certificate (mutual TLS) and this node has none: set --upstream-cert and --upstream-key"
    else:
        own = certificate_problem(tls.cert, "this node's client certificate")
        why = f"refused this node's client certificate: {own}" if own else (
            f"refused this node's client certificate {tls.cert} (not signed by a CA the upstream trusts?)"
        )
    return ClientCertRefused(f"upstream {host} {why}")


class TlsClient(Client):
    """nats-py's client that refuses a server offering no TLS when TLS is required
    (nats-py itself would go on in plain text and send CONNECT, credentials included),
    and says so when a server drops the connection right after the handshake."""

    require_tls: bool = False
    tls_config: UpstreamTls | None = None

    async def _process_connect_init(self) -> None:
        try:
            await self._connect_init_said()
        except BaseException:
            self._drop_dead_writer()
            raise

    async def _attempt_reconnect(self) -> None:
        # the connection is given up (stale pings, EOF, an error): nats-py closes it before
        # dialling again, and a TLS close waits for the peer's close_notify - 30 s (asyncio's
        # shutdown timeout) over a stalled link that will never carry it. Dropped at once.
        writer = getattr(self._transport, "_io_writer", None)
        if writer is not None:
            writer.transport.abort()
        await super()._attempt_reconnect()

    def _drop_dead_writer(self) -> None:
        # asyncio's start_tls hands the TCP transport to its SSL protocol and, when the handshake
        # fails, closes it; the stream writer nats-py kept never learns, and nats-py's close (or
        # its next try) would wait on it for ever
        transport = self._transport
        writer = getattr(transport, "_io_writer", None)
        if writer is not None and writer.transport.is_closing():
            writer.transport.abort()
            transport._io_writer = None  # type: ignore[union-attr]

    async def _connect_init_said(self) -> None:
        try:
            await super()._process_connect_init()
        except PlainTextUpstream:
            raise
        except ssl.SSLError as exc:
            # the server's alert about our certificate, when it comes before the close: the
            # same line as the close without one, so a reason is one reason however it arrives
            if str(getattr(exc, "reason", "")) in _CLIENT_CERT_ALERTS:
                raise self._refused() from exc
            raise
        except (ConnectionResetError, BrokenPipeError, nats.errors.UnexpectedEOF) as exc:
            if not self._upgraded():
                raise
            raise self._refused() from exc
        except nats.errors.Error as exc:
            # nats-py's words for a connection closed before the server's first line
            if "empty response" in str(exc) and self._upgraded():
                raise self._refused() from exc
            raise

    def _refused(self) -> ClientCertRefused:
        srv = self._current_server
        host = f"{srv.uri.hostname}:{srv.uri.port}" if srv is not None else "?"
        return _refusal(self.tls_config or UpstreamTls(), host)

    def _upgraded(self) -> bool:
        writer = getattr(self._transport, "_io_writer", None)
        return writer is not None and writer.get_extra_info("ssl_object") is not None

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and self.require_tls and not info.get("tls_required"):
            srv = self._current_server
            host = f"{srv.uri.hostname}:{srv.uri.port}" if srv is not None else "?"
            raise PlainTextUpstream(host)
        await super()._process_info(info, initial_connection=initial_connection)


def connect_options(tls: UpstreamTls, ctx: ssl.SSLContext | None) -> dict[str, Any]:
    """nats-py's connect() keyword arguments for `tls` (nothing when TLS is off)."""
    if not tls.enabled or ctx is None:
        return {}
    kw: dict[str, Any] = {"tls": ctx}
    if tls.server_name:
        kw["tls_hostname"] = tls.server_name
    return kw


def new_client(tls: UpstreamTls) -> TlsClient:
    nc = TlsClient()
    nc.require_tls = tls.enabled
    nc.tls_config = tls
    return nc


def _identity(paths: Sequence[Path]) -> tuple[object, ...]:
    out: list[object] = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns))
        except OSError as exc:
            out.append(type(exc).__name__)
    return tuple(out)


class TlsFiles:
    """The TLS files, watched: `refresh()` makes a new context when any of them changed on disk.

    Files that do not load at the start leave `context` None and the reason in
    `error`: the caller waits and refreshes (a node started before its
    certificate was copied in comes up when it is), never exits on it."""

    def __init__(self, tls: UpstreamTls) -> None:
        self.tls = tls
        self._stamp = _identity(tls.files())
        self.context: ssl.SSLContext | None = None
        #: why the files on disk are not what is in use (None: they are)
        self.error: str | None = None
        #: how many times a changed set of files was loaded (0: the first)
        self.generation = 0
        #: the files as they were at the last look that failed to load (None: it loaded)
        self._failed: tuple[object, ...] | None = None
        if tls.enabled:
            try:
                self.context = client_context(tls)
            except TlsConfigError as exc:
                self.error = str(exc)

    @property
    def ready(self) -> bool:
        return not self.tls.enabled or self.context is not None

    def refresh(self) -> bool:
        """True when a changed set of files loaded into a new `context`; a set that does not
        load leaves the old context in place and, once it fails at two looks in a row unchanged
        (or while no context was ever loaded), its reason in `error` (tried again next time)."""
        if not self.tls.enabled:
            return False
        stamp = _identity(self.tls.files())
        if stamp == self._stamp and self.context is not None:
            return False
        try:
            ctx = client_context(self.tls)
        except TlsConfigError as exc:
            # a renewal in flight: its writer puts the certificate and the key one after the
            # other (`bcd fleet renew`, and any other), and a look between read a pair that does
            # not match. Said once the same files fail at the next look too.
            settled = stamp == self._failed or self.context is None
            self._failed = stamp
            if settled:
                self.error = str(exc)
            return False
        first = self.context is None
        self._failed = None
        self._stamp = stamp
        self.context = ctx
        self.error = None
        if not first:
            self.generation += 1
        return True

    def install(self, nc: Client) -> None:
        """The current context into a client: its next (re)connect uses it."""
        if self.context is not None:
            nc.options["tls"] = self.context


__all__ = [
    "UpstreamTls",
    "TlsConfigError",
    "PlainTextUpstream",
    "ClientCertRefused",
    "TlsClient",
    "TlsFiles",
    "upstream_tls",
    "url_wants_tls",
    "client_context",
    "local_problems",
    "explain",
    "connect_options",
    "new_client",
]
