"""The node's records upstream: its Hello in `bcd_nodes` and its Inventory in `bcd_inventory`.

A control plane knows a node, and verifies its reports, by these two records,
so they are kept put here, each on its own: an inventory change puts the
inventory only (the Hello too when its adapter, all the Hello takes from it,
changed); the Hello goes again when the converger says its status changed, on
a reconnect and with the periodic re-put of both. `published` is set once a
Hello went: no report goes upstream before the Hello with this boot's key.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.client import Client
from nats.js.errors import NoStreamResponseError

from shared.runtime import VERSION, LoopGuard, ServiceCallError, call, describe
from shared.schemas import (
    CONVERGER_STATUS_CODEC,
    HELLO_CODEC,
    INVENTORY_CODEC,
    SIGNER_KEY_CODEC,
    BadMessage,
    Empty,
    Hello,
    Inventory,
    SignerKey,
)
from shared.subjects import UPSTREAM_INVENTORY_BUCKET, UPSTREAM_NODES_BUCKET, NodeSubjects

if TYPE_CHECKING:
    from services.gateway_bridge.upstream import Upstream


def capabilities(privileged: bool, bindings: list[str], adapter: str) -> list[str]:
    """The seed's Hello capabilities: none of cdi/devices.limits/binding.kubernetes unprivileged."""
    caps: list[str] = []
    if privileged:
        caps += ["cdi", "devices.limits"]
        if "BINDING_KUBERNETES" in bindings:
            caps.append("binding.kubernetes")
    if adapter == "nvidia":
        caps.append("nvml")
    return caps


class Records:
    """Hello and inventory out: `nc` is the node bus (signer, converger, inventory), `upstream` where they go."""

    def __init__(
        self,
        nc: Client,
        subjects: NodeSubjects,
        node_id: str,
        upstream: Upstream,
        resync_interval: float,
        started_at: datetime,
        log: Any,
        stopping: asyncio.Event,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.node_id = node_id
        self.upstream = upstream
        self.resync_interval = resync_interval
        self.started_at = started_at
        self.log = log
        self.stopping = stopping
        self.signer: SignerKey | None = None
        self.inventory: Inventory | None = None
        self.inventory_dirty = asyncio.Event()
        self.hello_dirty = asyncio.Event()
        self.wake = asyncio.Event()
        #: a Hello went upstream (with this boot's key and boot id)
        self.published = asyncio.Event()
        #: the inventory adapter the last Hello was made with (what the Hello takes from the inventory).
        self.hello_adapter: str | None = None

    def mark(self, *, hello: bool = True, inventory: bool = True) -> None:
        """Hello and/or inventory need (re-)putting: a change, a reconnect (both), or the periodic re-put (both)."""
        if hello:
            self.hello_dirty.set()
        if inventory:
            self.inventory_dirty.set()
        if hello or inventory:
            self.wake.set()

    async def on_inventory(self, msg: Any) -> None:
        """An inventory-changed notice (decoded here: a BadMessage is the subscription guard's)."""
        self.inventory = INVENTORY_CODEC.decode(msg.data)
        # the inventory record only: the Hello takes just the adapter from it (its nvml
        # capability), so it is put again only when that changed
        self.mark(hello=self.inventory.adapter != self.hello_adapter, inventory=True)

    async def _put(self, subject: str, payload: bytes, what: str) -> bool:
        up = self.upstream.nc
        assert up is not None
        try:
            await up.jetstream(timeout=5).publish(subject, payload)
        except (nats.errors.NoRespondersError, NoStreamResponseError):
            # nats-py 2.16's JetStream publish raises the latter for a missing bucket
            self.upstream.waiting_for(what)
            return False
        self.upstream.found(what)
        return True

    async def run(self) -> None:
        self.mark()
        guard = LoopGuard(self.log, "records loop")
        while not self.stopping.is_set():
            await self.upstream.connected.wait()
            self.wake.clear()
            async with guard:
                try:
                    # each flag is cleared before its put and set again when it did not go:
                    # a change noticed during the put is not lost
                    if self.hello_dirty.is_set():
                        self.hello_dirty.clear()
                        put = False
                        try:
                            hello = await self.hello()
                            put = hello is not None and await self._put(
                                f"$KV.{UPSTREAM_NODES_BUCKET}.{self.node_id}", HELLO_CODEC.encode_valid(hello), "KV bucket bcd_nodes"
                            )
                        finally:
                            if not put:
                                self.hello_dirty.set()
                        if put and hello is not None:
                            self.published.set()
                            self.log.info("hello published", capabilities=hello.capabilities, boot_id=hello.boot_id, key_id=hello.key_id)
                    if self.inventory_dirty.is_set():
                        self.inventory_dirty.clear()
                        put = False
                        try:
                            if self.inventory is None:
                                await self._fetch_inventory()
                            put = self.inventory is not None and await self._put(
                                f"$KV.{UPSTREAM_INVENTORY_BUCKET}.{self.node_id}",
                                INVENTORY_CODEC.encode_valid(self.inventory),
                                "KV bucket bcd_inventory",
                            )
                        finally:
                            if not put:
                                self.inventory_dirty.set()
                except (nats.errors.Error, asyncio.TimeoutError, ServiceCallError) as exc:
                    self.log.warning("publishing node records failed; retrying", error=describe(exc))
            # something left to put: retry in a second; else wait for a change or the periodic re-put
            unfinished = self.hello_dirty.is_set() or self.inventory_dirty.is_set()
            try:
                await asyncio.wait_for(self.wake.wait(), 1.0 if unfinished else self.resync_interval)
            except asyncio.TimeoutError:
                if not unfinished:
                    # periodic re-put: cheap, and repairs a bucket recreated upstream
                    self.mark()

    async def _fetch_inventory(self) -> None:
        with contextlib.suppress(ServiceCallError, nats.errors.Error, asyncio.TimeoutError, BadMessage):
            self.inventory = await call(self.nc, self.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=3)

    async def hello(self) -> Hello | None:
        try:
            key = await call(self.nc, self.subjects.signer_key, Empty(), SIGNER_KEY_CODEC, timeout=3)
            status = await call(self.nc, self.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=3)
        except (ServiceCallError, nats.errors.Error, asyncio.TimeoutError) as exc:
            self.log.info("hello waits for the signer and converger", error=describe(exc))
            return None
        except BadMessage as exc:
            # a peer's reply its own schema refuses: said, and asked again (the records loop retries)
            self.log.error("hello waits: the signer's or converger's reply does not decode", error=str(exc))
            return None
        if self.inventory is None:
            await self._fetch_inventory()
        adapter = self.inventory.adapter if self.inventory is not None else ""
        self.hello_adapter = adapter
        self.signer = key
        return Hello(
            node_id=self.node_id,
            boot_id=key.boot_id,
            public_key=key.public_key,
            key_id=key.key_id,
            capabilities=capabilities(status.privileged, status.bindings, adapter),
            agent_version=VERSION,
            started_at=self.started_at,
        )


__all__ = ["Records", "capabilities"]
