"""The inventory micro service: scan through the vendor adapter, publish on change.

The current Inventory lives in the node-bus KV bucket
`bcd_node_<node_id>_inventory` under the key `<node_id>`; every change also
goes out as a plain message on `bcd.<node>.inventory.changed` so the
converger can run a pass. `get` answers the last scan; `rescan` scans now.
A periodic rescan catches what changed behind our back (a MIG instance
created, a driver rebound). The revision only moves when the content does.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue
from prometheus_client import Counter, Gauge, Histogram

from shared.runtime import Option, Refused, ServiceApp, ServiceContext, StartupError, main_for
from shared.schemas import EMPTY_CODEC, INVENTORY_CODEC, BadMessage, Inventory, encode

from .adapters import AdapterError, AdapterUnavailable, load_adapter
from .build import build_inventory, inventory_content_key


class InventoryApp(ServiceApp):
    name = "inventory"
    description = "discovers GPUs, MIG instances, slots and host resources"

    def __init__(self) -> None:
        self.adapter: Any = None
        self.kv: KeyValue | None = None
        self.current: Inventory | None = None
        self.content_key: bytes = b""
        self.lock = asyncio.Lock()
        self.wake = asyncio.Event()

    def options(self) -> list[Option]:
        return [
            Option("--adapter", "vendor adapter", default="nvidia", choices=("nvidia", "fakehw")),
            Option("--fake-host", "fake host description file (fakehw adapter)", type=Path),
            Option("--cdi-dir", "CDI spec directory", default=Path("/etc/cdi"), type=Path),
            Option("--sysfs-root", "root of /sys", default=Path("/sys"), type=Path),
            Option("--proc-root", "root of /proc", default=Path("/proc"), type=Path),
            Option("--rescan-interval", "seconds between periodic rescans", default=30.0, type=float),
            Option("--slots-per-gpu", "slots configured on each GPU not in MIG mode (nvidia adapter)", default=0, type=int),
            Option("--mps-pipe-dir", "MPS pipe directory (nvidia adapter)", default="/tmp/nvidia-mps"),
        ]

    # ------------------------------------------------------------------ setup

    async def setup(self, ctx: ServiceContext) -> None:
        o = ctx.opts
        if o.adapter == "fakehw" and o.fake_host is None:
            raise StartupError("--adapter fakehw needs --fake-host FILE (or BCD_FAKE_HOST)")
        try:
            self.adapter = load_adapter(
                o.adapter,
                fake_host=o.fake_host,
                cdi_dir=o.cdi_dir,
                sysfs_root=o.sysfs_root,
                proc_root=o.proc_root,
                slots_per_gpu=o.slots_per_gpu,
                mps_pipe_dir=o.mps_pipe_dir,
            )
            wrote = self.adapter.write_cdi_spec()
        except AdapterUnavailable as exc:
            raise StartupError(str(exc)) from None
        except AdapterError as exc:
            raise StartupError(f"{o.adapter} adapter: {exc}") from None
        if wrote:
            ctx.log.info("vendor CDI spec written", cdi_dir=str(o.cdi_dir))

        reg = ctx.registry
        self.m_scans = Counter("bcd_inventory_scans", "Inventory scans by outcome", ["outcome"], registry=reg)
        self.m_scan_seconds = Histogram("bcd_inventory_scan_duration_seconds", "Time one scan takes", registry=reg)
        self.m_revision = Gauge("bcd_inventory_revision", "Revision of the published inventory", registry=reg)
        self.m_gpus = Gauge("bcd_inventory_gpus", "GPUs on this node", registry=reg)
        self.m_atoms = Gauge("bcd_inventory_atoms", "Atoms on this node by kind", ["kind"], registry=reg)
        self.m_phase = Gauge("bcd_gpu_phase", "1 for each GPU's current PhysicalGPU phase", ["pci_address", "phase"], registry=reg)

        js = ctx.nc.jetstream()
        bucket = ctx.subjects.inventory_bucket
        try:
            self.kv = await js.key_value(bucket)
        except BucketNotFoundError:
            self.kv = await js.create_key_value(bucket=bucket, history=1, description="bcd node inventory")
        await self._load_last(ctx)
        await self.scan_and_publish(ctx, reason="start")
        await ctx.endpoint("get", ctx.subjects.inventory_get, lambda _: self.get(), EMPTY_CODEC, allow_empty=True)
        await ctx.endpoint("rescan", ctx.subjects.inventory_rescan, lambda _: self.rescan(ctx), EMPTY_CODEC, allow_empty=True)

    async def _load_last(self, ctx: ServiceContext) -> None:
        """Continue the revision of what an earlier run published."""
        assert self.kv is not None
        try:
            entry = await self.kv.get(ctx.opts.node_id)
        except KeyNotFoundError:
            return
        if entry.value:
            try:
                last = INVENTORY_CODEC.decode(entry.value)
            except BadMessage as exc:
                ctx.log.warning("ignoring unreadable inventory in KV", error=str(exc))
                return
            self.current = last
            self.content_key = inventory_content_key(last)

    # ------------------------------------------------------------------ work

    async def scan_and_publish(self, ctx: ServiceContext, reason: str) -> Inventory:
        async with self.lock:
            started = time.perf_counter()
            revision = self.current.revision if self.current else 0
            try:
                inv = await asyncio.to_thread(
                    build_inventory,
                    self.adapter,
                    node_id=ctx.opts.node_id,
                    revision=revision,
                    now=datetime.now(timezone.utc),
                    previous=self.current,
                )
            except (AdapterError, OSError) as exc:
                self.m_scans.labels(outcome="error").inc()
                ctx.log.error("scan failed; keeping the last inventory", reason=reason, error=str(exc))
                if self.current is None:
                    raise
                return self.current
            finally:
                self.m_scan_seconds.observe(time.perf_counter() - started)
            inv = msgspec.structs.replace(inv, adapter=ctx.opts.adapter)
            key = inventory_content_key(inv)
            if self.current is not None and key == self.content_key:
                self.m_scans.labels(outcome="unchanged").inc()
                return self.current
            inv = _with_revision(inv, revision + 1)
            assert self.kv is not None
            payload = encode(inv)
            await self.kv.put(ctx.opts.node_id, payload)
            await ctx.nc.publish(ctx.subjects.inventory_changed, payload)
            self.current, self.content_key = inv, key
            self.m_scans.labels(outcome="changed").inc()
            self._observe(inv)
            ctx.log.info(
                "inventory published",
                reason=reason,
                revision=inv.revision,
                gpus=len(inv.gpus),
                atoms=len(inv.atoms),
                bucket=ctx.subjects.inventory_bucket,
            )
            return inv

    def _observe(self, inv: Inventory) -> None:
        self.m_revision.set(inv.revision)
        self.m_gpus.set(len(inv.gpus))
        for kind in ("gpu", "mig", "slot"):
            self.m_atoms.labels(kind=kind).set(sum(1 for a in inv.atoms if a.kind == kind))
        self.m_phase.clear()
        for g in inv.gpus:
            self.m_phase.labels(pci_address=g.pci_address, phase=g.status.phase).set(1)

    async def get(self) -> Inventory:
        if self.current is None:
            raise Refused("no inventory yet", code="503")
        return self.current

    async def rescan(self, ctx: ServiceContext) -> Inventory:
        return await self.scan_and_publish(ctx, reason="request")

    async def run(self, ctx: ServiceContext) -> None:
        interval = max(0.1, float(ctx.opts.rescan_interval))
        while not ctx.stopping.is_set():
            try:
                await asyncio.wait_for(ctx.stopping.wait(), timeout=interval)
            except asyncio.TimeoutError:
                try:
                    await self.scan_and_publish(ctx, reason="periodic")
                except Exception:  # noqa: BLE001 - keep scanning; the error is logged
                    ctx.log.exception("periodic scan failed")

    async def close(self, ctx: ServiceContext) -> None:
        if self.adapter is not None:
            self.adapter.close()


def _with_revision(inv: Inventory, revision: int) -> Inventory:
    return msgspec.structs.replace(inv, revision=revision)


main = main_for(InventoryApp)

__all__ = ["InventoryApp", "main"]
