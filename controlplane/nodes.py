"""What the control plane knows of each node from the upstream: its Hello, its inventory, what it last reported.

A Hello (`bcd_nodes/<node>`) is a node's announcement of its public key and its
boot id. Every signed report is verified against it, and a put asks whether
the node ever said one. This module owns how a Hello is fetched, checked (the
node, the key's length and id), cached, and learnt live from the bucket's
updates, so each new boot id or key lands in state.json once and one way. It
also answers for the node's inventory (`bcd_inventory`) and for the conditions
and sections its processed events left in state.json.
"""

from __future__ import annotations

import asyncio

import nats.js.errors
from nats.aio.msg import Msg

from shared import logs
from shared.schemas import HELLO_CODEC, INVENTORY_CODEC, BadMessage, Condition, Hello, Inventory, SectionStatus
from shared.signing import key_id
from shared.subjects import UPSTREAM_INVENTORY_BUCKET, UPSTREAM_NODES_BUCKET

from .buckets import UpstreamObjects
from .state import StateStore, remember_boot

log = logs.get_logger("controlplane")

KV_OPERATION_HEADER = "KV-Operation"


def check_hello(node_id: str, data: bytes) -> tuple[Hello | None, str]:
    """(Hello, "") when `data` is a Hello that `node_id` may have put, else (None, why)."""
    try:
        hello = HELLO_CODEC.decode(data)
    except BadMessage as exc:
        return None, f"{node_id}'s Hello does not decode ({exc})"
    if hello.node_id != node_id:
        return None, f"Hello under key {node_id} names node {hello.node_id}"
    if len(hello.public_key) != 32:
        return None, f"{node_id}'s Hello public key is {len(hello.public_key)} bytes, not 32"
    if key_id(hello.public_key) != hello.key_id:
        return None, f"{node_id}'s Hello key_id {hello.key_id} does not match its public key"
    return hello, ""


class Nodes:
    """The nodes' Hellos (the last one seen of each, cached), inventories and reported state."""

    def __init__(self, objects: UpstreamObjects, store: StateStore) -> None:
        self._objects = objects
        self._store = store
        self._hellos: dict[str, Hello] = {}

    def cached_hello(self, node_id: str) -> Hello | None:
        """The node's Hello as last seen (no lookup)."""
        return self._hellos.get(node_id)

    async def hello(self, node_id: str) -> Hello | None:
        """The node's current Hello from `bcd_nodes` (fetched now; None when absent or invalid)."""
        hello, _ = await self.fetch_hello(node_id)
        return hello

    async def fetch_hello(self, node_id: str) -> tuple[Hello | None, str]:
        """(Hello, "") or (None, why). Network trouble raises (transient)."""
        kv = await self._objects.bucket(UPSTREAM_NODES_BUCKET)
        try:
            entry = await kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            self._hellos.pop(node_id, None)
            return None, f"{node_id} has no Hello in {UPSTREAM_NODES_BUCKET}"
        hello, problem = check_hello(node_id, entry.value or b"")
        if hello is not None:
            self._learn(hello)
        return hello, problem

    def _learn(self, hello: Hello) -> None:
        self._hellos[hello.node_id] = hello
        rec = self._store.refresh().nodes.get(hello.node_id)
        if rec is None or hello.boot_id not in rec.boot_ids or rec.key_id != hello.key_id:
            with self._store.transaction() as st:
                if remember_boot(st, hello):
                    log.info("node boot announced", node_id=hello.node_id, boot_id=hello.boot_id, key_id=hello.key_id)

    async def on_hello_msg(self, msg: Msg) -> None:
        """A Hello put seen live (`$KV.bcd_nodes.<node>`): remember its boot id at once."""
        node_id = msg.subject.rsplit(".", 1)[-1]
        if (msg.headers or {}).get(KV_OPERATION_HEADER) in ("DEL", "PURGE"):
            self._hellos.pop(node_id, None)
            return
        hello, problem = check_hello(node_id, msg.data)
        if hello is None:
            log.warning("ignoring a bad Hello", node_id=node_id, reason=problem)
            return
        try:
            self._learn(hello)
        except Exception:  # noqa: BLE001 - a subscription callback must not die
            log.exception("could not record a Hello", node_id=node_id)

    def boot_ids(self, node_id: str) -> list[str]:
        rec = self._store.refresh().nodes.get(node_id)
        return list(rec.boot_ids) if rec else []

    async def known(self, node_id: str, *, wait: float = 0.0) -> bool:
        """Has `node_id` ever put a Hello (a boot id on record, or a Hello in `bcd_nodes` now)?

        Waits up to `wait` seconds for a Hello to appear (a node that is starting).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            if self.boot_ids(node_id) or await self.hello(node_id) is not None:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))

    async def inventory(self, node_id: str) -> Inventory | None:
        kv = await self._objects.bucket(UPSTREAM_INVENTORY_BUCKET)
        try:
            entry = await kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            return None
        try:
            return INVENTORY_CODEC.decode(entry.value or b"")
        except BadMessage as exc:
            log.warning("inventory does not decode", node_id=node_id, error=str(exc))
            return None

    def conditions(self, node_id: str) -> dict[str, Condition]:
        """The latest condition per type that the node reported (from the processed events)."""
        rec = self._store.refresh().nodes.get(node_id)
        return dict(rec.conditions) if rec else {}

    def sections(self, node_id: str) -> dict[str, SectionStatus]:
        """The latest SectionStatus per section that the node reported."""
        rec = self._store.refresh().nodes.get(node_id)
        return dict(rec.sections) if rec else {}


__all__ = ["KV_OPERATION_HEADER", "check_hello", "Nodes"]
