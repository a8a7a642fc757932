"""How the operator commands find and reach a running node: `<state>/node.json` and the `cli` user."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
from nats.aio.client import Client

from shared.runtime import call
from shared.schemas.codec import BoundedDecoder, Codec, bounded_json_loads
from shared.subjects import OPERATOR_USER, inbox_prefix

from .exits import ServiceUnavailable, Unreachable

T = TypeVar("T")

#: seconds `connect` waits for the node bus, unless told; `bcd --timeout` sets it for the whole command.
DEFAULT_CONNECT_TIMEOUT = 5.0
_connect_timeout = DEFAULT_CONNECT_TIMEOUT


def set_connect_timeout(seconds: float) -> None:
    """The connect timeout of every later `connect` without its own (`bcd --timeout`, set once by main)."""
    global _connect_timeout  # noqa: PLW0603 - one CLI invocation, one setting
    _connect_timeout = float(seconds)


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """`<state>/node.json`: where a running node's bus, files and control plane are."""

    node_id: str
    nats_url: str
    creds_dir: str
    monitor_url: str = ""
    metrics: dict[str, str] = {}
    supervisor_pid: int = 0
    services: list[str] = []
    cdi_dir: str = ""
    #: where the converger writes each hold spec's consumer copy (shared.holdfiles.consumer_spec)
    cdi_consumer_dir: str = ""
    run_dir: str = ""
    data_dir: str = ""
    #: the embedded reference control plane ("" when joined to an existing upstream).
    controlplane_dir: str = ""
    #: how a spec is put for this node when `bcd apply` cannot put it itself ("" when it can): the
    #: compose node's control plane signs in its own container (`SPEC` stands for the spec file)
    put_command: str = ""
    upstream_url: str = ""


class NodeUnreachable(Unreachable):
    """The node bus did not answer (exit 3); the text says why, e.g. `node bus at URL not reachable (connection refused)`.

    The line ends in "is `bcd up` running?" only when that is the likely cause: not
    for a bus that refused the password, nor for a password file bcd cannot read.
    Judged from the text, so a report that kept only `str(exc)` (status, bus) and
    raises it again gets the same line.
    """

    @property
    def state_hint(self) -> bool:  # type: ignore[override]
        text = str(self)
        return "authorization violation" not in text and not text.startswith("cannot read the ")


class NodeNotFound(NodeUnreachable):
    """No (readable) `<state>/node.json`: no node was started there (exit 3)."""

    state_hint = False


def node_info(state: Path) -> NodeInfo:
    path = Path(state) / "node.json"
    try:
        return BoundedDecoder(NodeInfo, max_bytes=1024 * 1024, what=str(path)).decode(path.read_bytes())
    except FileNotFoundError:
        raise NodeNotFound(f"no node at {state} ({path} missing): start one with `bcd up --state-dir {state}`") from None
    except OSError as exc:
        raise NodeNotFound(f"cannot read {path}: {exc.strerror or exc}") from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise NodeNotFound(f"{path} is not a node description ({exc}); `bcd up --state-dir {state}` writes it") from None


def write_node_info(state: Path, info: NodeInfo) -> None:
    (Path(state) / "node.json").write_bytes(msgspec.json.format(msgspec.json.encode(info)) + b"\n")


def _is_auth(exc: BaseException | None) -> bool:
    """The server said `-ERR 'Authorization Violation'` (nats-py raises a plain nats.errors.Error for it)."""
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


def _why(exc: BaseException | None, timeout: float) -> str:
    """A few words for why a connect failed: `connection refused`, `no answer within 5 s`, ..."""
    if exc is None:
        return "no answer"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, asyncio.TimeoutError):  # nats.errors.TimeoutError is one too
        return f"no answer within {timeout:g} s"
    if _is_auth(exc):
        return "authorization violation: the node bus refused this user's password"
    if isinstance(exc, OSError):
        return (exc.strerror or str(exc) or type(exc).__name__).lower()
    return str(exc) or type(exc).__name__


async def connect_url(url: str, *, timeout: float | None = None, **options: Any) -> Client:
    """`nats.connect` that gives up: one try (and one retry) within `timeout` seconds, then NodeUnreachable.

    nats-py's own connect retries a refused server forever, even with
    `allow_reconnect=False` (its `max_reconnect_attempts=0` means no limit), and
    reports each failure with a traceback through its default error callback.
    Here the errors are collected quietly and the last one names the cause.
    """
    t = _connect_timeout if timeout is None else float(timeout)
    errors: list[BaseException] = []

    async def quiet(exc: Exception) -> None:
        errors.append(exc)

    nc = Client()
    try:
        await asyncio.wait_for(
            nc.connect(
                url,
                error_cb=quiet,
                allow_reconnect=False,
                connect_timeout=max(0.1, t),
                max_reconnect_attempts=1,  # the server is dropped from the pool after its 2nd failure
                reconnect_time_wait=min(0.25, t / 4),
                **options,
            ),
            timeout=max(0.1, t),
        )
    except Exception as exc:  # noqa: BLE001 - whatever the client raises, the node bus is not there for us
        with contextlib.suppress(Exception):
            await nc.close()
        cause = exc if not isinstance(exc, nats.errors.NoServersError) or not errors else errors[-1]
        if isinstance(exc, asyncio.TimeoutError) and errors:
            cause = errors[-1]
        raise NodeUnreachable(f"node bus at {url} not reachable ({_why(cause, t)})") from exc
    return nc


async def connect(info: NodeInfo, user: str = OPERATOR_USER, *, timeout: float | None = None) -> Client:
    """The node bus as `user` (the operator's `cli` user by default); NodeUnreachable within `timeout` s when it is not there."""
    path = Path(info.creds_dir) / f"{user}.password"
    try:
        password = path.read_text().strip()
    except OSError as exc:
        raise NodeUnreachable(f"cannot read the {user} password at {path} ({exc.strerror or exc}); `bcd up` writes it, readable by its owner") from None
    return await connect_url(
        info.nats_url, timeout=timeout, user=user, password=password, inbox_prefix=inbox_prefix(user).encode()
    )


async def request(nc: Client, subject: str, payload: object, reply: Codec[T], *, timeout: float = 5.0) -> T:
    """`shared.runtime.call`, with a service that does not answer as ServiceUnavailable (exit 4) naming it."""
    try:
        return await call(nc, subject, payload, reply, timeout=timeout)
    except nats.errors.NoRespondersError:
        raise ServiceUnavailable(f"{_service_of(subject)} is not running: nobody answers {subject}; see `bcd ping`") from None
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        raise ServiceUnavailable(f"{_service_of(subject)} did not answer {subject} within {timeout:g} s; see `bcd ping`") from None


def _service_of(subject: str) -> str:
    """`bcd.<node>.<service>.<verb>` -> "service <service>"."""
    parts = subject.split(".")
    return f"service {parts[2]}" if len(parts) >= 4 and parts[0] == "bcd" else "the service"


async def ping_all(nc: Client, wait: float = 0.5) -> list[dict[str, Any]]:
    """Every micro service that answers `$SRV.PING` within `wait` seconds."""
    inbox = nc.new_inbox()
    replies: list[dict[str, Any]] = []
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish("$SRV.PING", b"", reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (left := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            if not msg.data:  # a status message (503: nobody subscribed yet), not a reply
                continue
            try:
                replies.append(bounded_json_loads(msg.data, 1024 * 1024, "ping reply"))
            except ValueError:
                continue
    finally:
        await sub.unsubscribe()
    return sorted(replies, key=lambda r: r.get("name", ""))


__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "NodeInfo",
    "NodeNotFound",
    "NodeUnreachable",
    "connect",
    "connect_url",
    "node_info",
    "ping_all",
    "request",
    "set_connect_timeout",
    "write_node_info",
]
