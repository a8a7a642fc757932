"""One spec put as a one-off (`bcd-controlplane put`, `bcd apply`; a rebase too): connect, check, sign, put, close.

This module owns a put that does not run the serve loop. Everything that can be
judged offline is judged before connecting. Then one connection try is made
(ConnectionError naming the cause), the upstream objects are ensured, and the
spec is put through publish.SpecPublisher against the same state dir and key as
the serving control plane, whose state.json lock keeps generations unique. It is
kept apart from serve.py so that the node-side `bcd apply` (bcd/putspec.py) loads
what a put needs and none of the event consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any
from pathlib import Path

import nats.errors

from shared.tlsconfig import UpstreamTls

from .buckets import UpstreamObjects
from .keys import load_or_create_cp_key
from .nodes import Nodes
from .publish import SpecPublisher
from .specs import PutResult, SpecTooLarge, check_spec
from .state import StateStore
from .upstream import close, connect_upstream

#: how long `bcd apply` waits for the Hello of the node it runs beside (a node still starting);
#: also `bcd-controlplane put --hello-wait`'s default.
LOCAL_HELLO_WAIT_S = 15.0


async def put_spec_file(
    nats_url: str,
    user: str,
    password_file: Path | None,
    state_dir: Path,
    spec: Path | str | bytes,
    *,
    allow_unknown_fields: bool = False,
    require_known_node: bool = False,
    hello_wait: float | Callable[[str], float] = 0.0,
    connect_timeout: float = 5.0,
    replicas: int = 1,
    nkey_file: Path | None = None,
    tls: UpstreamTls | None = None,
) -> PutResult:
    """Connect, ensure the upstream objects, sign and put one spec (a file path, or the JSON bytes).

    Raises BadMessage (a ValueError) for a spec that does not decode,
    UnknownFieldsError (a BadMessage) for fields NodeSpec does not declare
    (unless allowed), UnknownNode (a ValueError, with `require_known_node`),
    OSError for an unreadable file, ConnectionError when upstream cannot be
    reached (with TLS: the one line `shared.tlsconfig.explain` gives, or the TLS
    files that do not load). `hello_wait` may depend on the spec's node id;
    `nkey_file` and `tls` as for `connect_upstream`.
    """
    data = spec if isinstance(spec, bytes) else Path(spec).read_bytes()
    # everything that can be judged offline is judged before connecting
    checked = check_spec(data, allow_unknown_fields=allow_unknown_fields)
    wait = hello_wait(checked.draft.node_id) if callable(hello_wait) else hello_wait
    async with _publisher(nats_url, user, password_file, state_dir, connect_timeout, replicas, nkey_file, tls) as (publisher, nc):
        try:
            return await publisher.put(data, allow_unknown_fields=allow_unknown_fields, require_known_node=require_known_node, hello_wait=wait)
        except nats.errors.MaxPayloadError:
            # check_fits refuses such a spec before a generation is reserved; should the server
            # say it anyway, it is still the spec's size, not an unreachable upstream
            raise SpecTooLarge(f"spec: its signed envelope is above upstream {nats_url}'s max_payload of {nc.max_payload} bytes") from None




async def rebase_node(
    nats_url: str,
    user: str,
    password_file: Path | None,
    state_dir: Path,
    node_id: str,
    *,
    connect_timeout: float = 5.0,
    replicas: int = 1,
    nkey_file: Path | None = None,
    tls: UpstreamTls | None = None,
) -> PutResult:
    """`bcd rebase`, `bcd-controlplane rebase`: SpecPublisher.rebase as a one-off, like a put.

    Raises RebaseRefused (nothing to rebase, or not this control plane's spec), ConnectionError
    when upstream cannot be reached.
    """
    async with _publisher(nats_url, user, password_file, state_dir, connect_timeout, replicas, nkey_file, tls) as (publisher, _):
        return await publisher.rebase(node_id)


@contextlib.asynccontextmanager
async def _publisher(
    nats_url: str,
    user: str,
    password_file: Path | None,
    state_dir: Path,
    connect_timeout: float,
    replicas: int,
    nkey_file: Path | None,
    tls: UpstreamTls | None,
) -> AsyncIterator[tuple[SpecPublisher, Any]]:
    """A one-off SpecPublisher on its own upstream connection, the objects ensured; a bus error
    inside is ConnectionError naming the upstream (put and rebase alike)."""
    key, _ = load_or_create_cp_key(state_dir)
    nc = await connect_upstream(nats_url, user, password_file, nkey_file=nkey_file, tls=tls, reconnect=False, timeout=connect_timeout)
    try:
        store = StateStore(Path(state_dir))
        objects = UpstreamObjects(nc.jetstream(timeout=5.0), replicas)
        publisher = SpecPublisher(key, objects, store, Nodes(objects, store), max_payload=lambda: nc.max_payload)
        try:
            await objects.ensure()
            yield publisher, nc
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            if isinstance(exc, nats.errors.MaxPayloadError):
                raise
            raise ConnectionError(f"upstream {nats_url}: {exc or type(exc).__name__}") from None
    finally:
        await close(nc)

__all__ = ["LOCAL_HELLO_WAIT_S", "put_spec_file", "rebase_node"]
