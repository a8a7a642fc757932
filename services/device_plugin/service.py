"""The device_plugin micro service: `status` and `withdraw` on the node bus; the kubelet plugin servers.

- `bcd.<n>.device_plugin.status`   Empty -> DevicePluginStatus: resources,
  whether each is registered with the kubelet that is there now, and each
  Kubernetes hold's devices and whether they are advertised.
- `bcd.<n>.device_plugin.withdraw` DevicesQuery -> WithdrawReply: the
  converger withdrew a Kubernetes hold; answered once the kubelet's
  ListAndWatch streams took the list without it (or 2 s passed).

It listens to `inventory.changed` (health, topology, MIG profiles) and
`converger.holds_changed` (a pass wrote or removed hold files), and reads
the disk again every --rescan-interval seconds whatever it heard. When it
is down the converger carries on: withdraw is best effort with a short
deadline, and a restarted plugin advertises from the holds on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from shared.runtime import Option, ServiceApp, ServiceContext, StartupError, call, guarded, main_for
from shared.schemas import (
    DEVICE_PLUGIN_STATUS_CODEC,
    DEVICES_QUERY_CODEC,
    EMPTY_CODEC,
    INVENTORY_CODEC,
    WITHDRAW_REPLY_CODEC,
    BadMessage,
    DevicePluginStatus,
    DevicesQuery,
    Empty,
    Inventory,
    WithdrawReply,
)

from .advertise import DRA_RESOURCE_DOMAIN, BadResourceName, ResourceNames
from .plugin import DevicePlugin, Metrics
from .proto import DEVICE_PLUGIN_DIR

#: how long one inventory request may take (the node bus is local).
INVENTORY_TIMEOUT_S = 3.0


class DevicePluginApp(ServiceApp):
    name = "device_plugin"
    description = "advertises the devices of Kubernetes holds to the kubelet (device plugin API v1beta1)"

    def __init__(self) -> None:
        self.plugin: DevicePlugin | None = None

    def options(self) -> list[Option]:
        return [
            Option("--kubelet-dir", "the kubelet's root directory (its device-plugins/ holds the sockets)", default=Path(DEVICE_PLUGIN_DIR).parent, type=Path),
            Option("--cdi-dir", "CDI spec directory (the converger's)", default=Path("/etc/cdi"), type=Path),
            Option("--run-dir", "runtime directory (the converger's; env files)", default=Path("/run/bcd"), type=Path),
            Option("--resource-domain", "domain of the extended resources", default="bcd.dev"),
            Option("--gpu-resource", "resource name of whole GPUs", default="gpu"),
            Option("--mig-resource", "resource name of MIG instances; {profile} is the MIG profile", default="mig-{profile}"),
            Option("--slot-resource", "resource name of GPU slots", default="gpu-slot"),
            Option(
                "--dra-domain",
                "domain of the DRA driver's extended resources (its DeviceClasses' extendedResourceName); refused as --resource-domain",
                default=DRA_RESOURCE_DOMAIN,
            ),
            Option("--rescan-interval", "seconds between reads of the holds on disk", default=2.0, type=float),
            Option("--watch-interval", "seconds between looks at the kubelet's socket", default=1.0, type=float),
        ]

    async def setup(self, ctx: ServiceContext) -> None:
        o = ctx.opts
        if o.rescan_interval <= 0 or o.watch_interval <= 0:
            raise StartupError("--rescan-interval and --watch-interval must be positive")
        try:
            names = ResourceNames(o.resource_domain, o.gpu_resource, o.mig_resource, o.slot_resource).check(o.dra_domain)
        except BadResourceName as exc:
            raise StartupError(f"resource names: {exc}") from None
        reg = ctx.registry
        metrics = Metrics(
            registrations=Counter("bcd_device_plugin_registrations", "Register calls to the kubelet by outcome", ["resource", "outcome"], registry=reg),
            registered=Gauge("bcd_device_plugin_registered", "1 when the resource is registered with the kubelet there now", ["resource"], registry=reg),
            advertised=Gauge("bcd_device_plugin_advertised_devices", "Devices advertised to the kubelet", ["resource", "health"], registry=reg),
            allocations=Counter("bcd_device_plugin_allocations", "Allocate calls by outcome", ["resource", "outcome"], registry=reg),
            kube_holds=Gauge("bcd_device_plugin_kubernetes_holds", "Kubernetes holds on disk", registry=reg),
        )
        metrics.kube_holds.set(0)

        async def inventory() -> Inventory:
            return await call(ctx.nc, ctx.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=INVENTORY_TIMEOUT_S)

        plugin = self.plugin = DevicePlugin(
            plugin_dir=o.kubelet_dir / "device-plugins",
            cdi_dir=o.cdi_dir,
            run_dir=o.run_dir,
            names=names,
            inventory=inventory,
            log=ctx.log,
            metrics=metrics,
            watch_interval=o.watch_interval,
            rescan_interval=o.rescan_interval,
        )
        for resource in (names.gpu_name, names.slot_name):
            metrics.registered.labels(resource=resource).set(0)
            for outcome in ("ok", "failed"):
                metrics.registrations.labels(resource=resource, outcome=outcome)
            for outcome in ("ok", "refused"):
                metrics.allocations.labels(resource=resource, outcome=outcome)
        ctx.metadata.update({"kubelet_socket": str(plugin.kubelet_socket), "resources": f"{names.gpu_name},{names.mig_pattern},{names.slot_name}"})

        @guarded(ctx.log, "inventory notice")
        async def on_inventory(msg: Any) -> None:
            try:
                inv = INVENTORY_CODEC.decode(msg.data)
            except BadMessage:
                return
            await plugin.refresh(inv)

        @guarded(ctx.log, "holds notice")
        async def on_holds(msg: Any) -> None:
            await plugin.refresh()

        await ctx.nc.subscribe(ctx.subjects.inventory_changed, cb=on_inventory)
        await ctx.nc.subscribe(ctx.subjects.converger_holds_changed, cb=on_holds)
        await ctx.endpoint("status", ctx.subjects.device_plugin_status, self.status, EMPTY_CODEC, allow_empty=True, reply=DEVICE_PLUGIN_STATUS_CODEC)
        await ctx.endpoint("withdraw", ctx.subjects.device_plugin_withdraw, self.withdraw, DEVICES_QUERY_CODEC, reply=WITHDRAW_REPLY_CODEC)

    async def status(self, _: Empty) -> DevicePluginStatus:
        assert self.plugin is not None
        return self.plugin.status()

    async def withdraw(self, q: DevicesQuery) -> WithdrawReply:
        assert self.plugin is not None
        return await self.plugin.withdraw(q.allocation_id)

    async def run(self, ctx: ServiceContext) -> None:
        assert self.plugin is not None
        await self.plugin.fetch_inventory()
        await self.plugin.refresh()
        await self.plugin.watch(ctx.stopping)

    async def close(self, ctx: ServiceContext) -> None:
        if self.plugin is not None:
            await self.plugin.close()


main = main_for(DevicePluginApp)

__all__ = ["DevicePluginApp", "main"]
