"""How the operator commands find and reach a running node: `<state>/node.json` and the `cli` user."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client

from shared.schemas.codec import BoundedDecoder, bounded_json_loads
from shared.subjects import OPERATOR_USER, inbox_prefix


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
    run_dir: str = ""
    data_dir: str = ""
    #: the embedded reference control plane ("" when joined to an existing upstream).
    controlplane_dir: str = ""
    upstream_url: str = ""


class NodeUnreachable(Exception):
    pass


def node_info(state: Path) -> NodeInfo:
    path = Path(state) / "node.json"
    try:
        return BoundedDecoder(NodeInfo, max_bytes=1024 * 1024, what=str(path)).decode(path.read_bytes())
    except FileNotFoundError:
        raise SystemExit(f"bcd: no node at {state} ({path} missing): start one with `bcd up --state-dir {state}`") from None


def write_node_info(state: Path, info: NodeInfo) -> None:
    (Path(state) / "node.json").write_bytes(msgspec.json.format(msgspec.json.encode(info)) + b"\n")


async def connect(info: NodeInfo, user: str = OPERATOR_USER) -> Client:
    password = (Path(info.creds_dir) / f"{user}.password").read_text().strip()
    try:
        return await nats.connect(
            info.nats_url,
            user=user,
            password=password,
            inbox_prefix=inbox_prefix(user).encode(),
            allow_reconnect=False,
            connect_timeout=3,
            max_reconnect_attempts=0,
        )
    except Exception as exc:  # noqa: BLE001 - the operator gets a sentence, not a traceback
        raise NodeUnreachable(f"node bus {info.nats_url} unreachable: {exc or type(exc).__name__}") from None


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


__all__ = ["NodeInfo", "NodeUnreachable", "node_info", "write_node_info", "connect", "ping_all"]
