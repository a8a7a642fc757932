"""A TLS connection whose link stalls is given up at once (issue 31, seen in the container suite).

A cut network loses no TCP connection, it stalls it. nats-py finds the stall by its pings and
then closes the old connection before dialling again; a TLS close waits for the peer's
close_notify (asyncio's 30 s shutdown timeout), which never comes over a stalled link, so the
node came back ~15 s later over TLS than in plain text. The connection is dead by then:
`TlsClient` drops it without the goodbye. A proxy between client and nats-server stalls the
first connection (it forwards nothing more, closes nothing) and passes later ones.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.tlsconfig import client_context, connect_options, new_client, upstream_tls

from .test_tlsconfig import certs, server, tls_block  # noqa: F401 - fixtures

#: pings every 0.3 s, 2 unanswered: the stall is found within ~1 s; the reconnect must follow at once
PING_S = 0.3
BACK_WITHIN_S = 8.0


class StallingProxy:
    """Forwards 127.0.0.1:port -> the server; `stall()` freezes every connection open now."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.frozen: set[asyncio.StreamWriter] = set()
        self.stalled: set[asyncio.StreamWriter] = set()
        self.tasks: set[asyncio.Task] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.srv = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.srv.sockets[0].getsockname()[1]

    def stall(self) -> None:
        self.stalled |= set(self.writers)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [w, uw]
        for a, b in ((r, uw), (ur, w)):
            t = asyncio.create_task(self._pipe(a, b, w))
            self.tasks.add(t)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, client: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                if client in self.stalled:
                    continue  # swallowed: a link that carries nothing and says nothing
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass

    async def aclose(self) -> None:
        self.srv.close()
        for w in self.writers:
            w.transport.abort()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.srv.wait_closed()


@pytest.mark.timeout(60)
async def test_a_stalled_tls_connection_is_dropped_and_dialled_again_at_once(server, certs):  # noqa: F811
    srv = server(tls_block(certs["server"]))
    proxy = StallingProxy(srv.port)
    port = await proxy.start()
    url = f"tls://127.0.0.1:{port}"
    tls = upstream_tls(url, ca=certs["ca"].cert)
    lost, back = asyncio.Event(), asyncio.Event()

    async def on_disconnect() -> None:
        lost.set()

    async def on_reconnect() -> None:
        back.set()

    async def quiet(_exc: Exception) -> None:
        pass

    nc = new_client(tls)
    await nc.connect(
        url, ping_interval=PING_S, max_outstanding_pings=2, reconnect_time_wait=0.1, max_reconnect_attempts=-1,
        disconnected_cb=on_disconnect, reconnected_cb=on_reconnect, error_cb=quiet, **connect_options(tls, client_context(tls)),
    )
    try:
        await nc.flush(2)
        stalled_at = time.monotonic()
        proxy.stall()
        await asyncio.wait_for(back.wait(), BACK_WITHIN_S)
        took = time.monotonic() - stalled_at
        assert lost.is_set()
        await nc.flush(2)  # the new connection works
        assert took < BACK_WITHIN_S
    finally:
        await nc.close()
        await proxy.aclose()
