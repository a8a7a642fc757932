"""The dra_plugin micro service: the kubelet DRA plugin (API v1) on bcd's holds, and `status` on the node bus.

- `bcd.<n>.dra_plugin.status` Empty -> DraPluginStatus: registration, the
  pool published (generation, slices, devices, cards and why others are left
  out, the unhealthy cards published tainted and whether taints are kept),
  the claims in the checkpoint.

It prepares claims through the converger (`converger.claim_prepare` /
`claim_unprepare`: the converger owns every hold, checks conflicts and makes
MIG instances), reads the inventory and the converger's claims, and listens to
`inventory.changed` and `converger.claims_changed` to publish the pool again.
The Kubernetes API (ResourceClaims, ResourceSlices, the Node) comes from a
kubeconfig or the pod's service account; with none (`--kube-api none`, or no
credentials) it still registers with the kubelet but refuses every prepare
with the reason and publishes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from shared.host import HostFactError, read_boot_id
from shared.runtime import Option, ServiceApp, ServiceContext, StartupError, call, guarded, main_for
from shared.schemas import (
    CLAIM_PREPARE_REPLY_CODEC,
    CLAIM_UNPREPARE_REPLY_CODEC,
    CLAIMS_CODEC,
    CONVERGER_STATUS_CODEC,
    DRA_PLUGIN_STATUS_CODEC,
    EMPTY_CODEC,
    INVENTORY_CODEC,
    ClaimPrepareReply,
    ClaimPrepareRequest,
    Claims,
    ClaimSummary,
    ClaimUnprepareReply,
    ClaimUnprepareRequest,
    DraPluginStatus,
    Empty,
    Inventory,
)

from .checkpoint import CheckpointStore
from .kubeapi import ClusterApi, KubeApi
from .plugin import Calls, DraPlugin, Metrics
from .proto import DEFAULT_DRIVER, PLUGINS_DIR

#: how long the converger may take to make a claim's hold (MIG instances are made one NVML step at a time).
PREPARE_CALL_TIMEOUT_S = 240.0
UNPREPARE_CALL_TIMEOUT_S = 120.0
#: a DNS-1123 subdomain, at most 63 long (the API's driver name rule).
_DRIVER_MAX = 63


def _driver_problem(name: str) -> str:
    import re

    if len(name) > _DRIVER_MAX or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name):
        return f"{name!r} is not a DNS subdomain of at most {_DRIVER_MAX} characters"
    return ""


class DraPluginApp(ServiceApp):
    name = "dra_plugin"
    description = "the kubelet DRA plugin: ResourceSlices of the node's cards and MIG placements, claims prepared as holds"

    def __init__(self) -> None:
        self.plugin: DraPlugin | None = None
        self.api: KubeApi | None = None

    def options(self) -> list[Option]:
        return [
            Option("--kubelet-dir", "the kubelet's root directory (plugins_registry/ and plugins/ are under it)", default=Path(PLUGINS_DIR).parent, type=Path),
            Option("--driver", "the DRA driver name", default=DEFAULT_DRIVER),
            Option("--node-name", "this node's Kubernetes Node name (the pool's name; default: the node id)", default=""),
            Option("--data-dir", "state directory (the checkpoint is <data-dir>/dra_plugin/checkpoint.json)", default=Path("/var/lib/bcd"), type=Path),
            Option("--kube-api", "the Kubernetes API: kubernetes (kubeconfig or in-cluster) or none", default="kubernetes", choices=("kubernetes", "none")),
            Option("--kubeconfig", "kubeconfig (default: $KUBECONFIG or ~/.kube/config)", type=Path),
            Option(
                "--in-cluster",
                "use the pod's service account: true, false, or auto (when no --kubeconfig and KUBERNETES_SERVICE_HOST is set)",
                default="auto",
                choices=("auto", "true", "false"),
            ),
            Option(
                "--binding-conditions",
                "publish devices with bindsToNode, bindingConditions [Ready] and bindingFailureConditions [BindingFailed] (seed 003), "
                "and set Ready or BindingFailed on the allocated claims (needs the DRADeviceBindingConditions feature)",
                default="false",
                choices=("true", "false"),
            ),
            Option(
                "--mig-devices",
                "publish every MIG placement as a partitionable device (needs the DRAPartitionableDevices feature on the API server "
                "and scheduler: without it the counters are dropped and placements could be allocated twice); false: whole cards only",
                default="true",
                choices=("true", "false"),
            ),
            Option(
                "--shared-cards",
                "publish whole cards as shareable (consumable capacity: allowMultipleAllocations with sharePercent and memory; "
                "needs the DRAConsumableCapacity feature: without it the API server drops the fields and cards are published "
                "exclusive again); false: exclusive cards only",
                default="true",
                choices=("true", "false"),
            ),
            Option(
                "--device-taints",
                "publish an unhealthy card (Healthy=False) with device taints on all its devices (gpu.bcd.dev/xid, gpu-lost, ecc, "
                "row-remap; needs the DRADeviceTaints feature: without it the API server drops them and such cards are withdrawn "
                "again); false: unhealthy cards are left out of the slices",
                default="true",
                choices=("true", "false"),
            ),
            Option("--proc-root", "root of /proc (boot id)", default=Path("/proc"), type=Path),
            Option("--fake-host", "fake host description file (boot id)", type=Path),
            Option("--watch-interval", "seconds between looks at the sockets", default=1.0, type=float),
            Option("--resync-interval", "seconds between publications of the pool whatever was heard", default=30.0, type=float),
        ]

    async def setup(self, ctx: ServiceContext) -> None:
        o = ctx.opts
        if o.watch_interval <= 0 or o.resync_interval <= 0:
            raise StartupError("--watch-interval and --resync-interval must be positive")
        problem = _driver_problem(o.driver)
        if problem:
            raise StartupError(f"--driver: {problem}")
        node_name = o.node_name or o.node_id
        try:
            boot = read_boot_id(o.proc_root, o.fake_host)
        except HostFactError as exc:
            raise StartupError(str(exc)) from None
        if o.kube_api == "kubernetes":
            api = ClusterApi(kubeconfig=o.kubeconfig, in_cluster=o.in_cluster)
            try:
                source = await api.connect()
                ctx.log.info("Kubernetes credentials loaded", source=source)
                self.api = api
            except Exception as exc:  # noqa: BLE001 - said once, the plugin runs without an API server
                ctx.log.warning("no Kubernetes API: claims cannot be prepared, no ResourceSlice is published", reason=str(exc))
                await api.close()
        reg = ctx.registry
        metrics = Metrics(
            prepares=Counter("bcd_dra_prepares", "NodePrepareResources claims by outcome", ["outcome"], registry=reg),
            unprepares=Counter("bcd_dra_unprepares", "NodeUnprepareResources claims by outcome", ["outcome"], registry=reg),
            registered=Gauge("bcd_dra_plugin_registered", "1 once the kubelet registered the DRA plugin", registry=reg),
            published_devices=Gauge("bcd_dra_published_devices", "Devices in the node's ResourceSlices, by kind", ["kind"], registry=reg),
            pool_generation=Gauge("bcd_dra_pool_generation", "Generation of the node's ResourceSlice pool", registry=reg),
            publishes=Counter("bcd_dra_slice_publications", "ResourceSlice publications by outcome", ["outcome"], registry=reg),
            prepared=Gauge("bcd_dra_prepared_claims", "Claims prepared (PrepareCompleted in the checkpoint)", registry=reg),
        )
        for outcome in ("ok", "failed"):
            metrics.prepares.labels(outcome=outcome)
            metrics.unprepares.labels(outcome=outcome)
            metrics.publishes.labels(outcome=outcome)
        metrics.registered.set(0)
        metrics.pool_generation.set(0)
        metrics.prepared.set(0)
        for kind in ("gpu", "mig"):
            metrics.published_devices.labels(kind=kind).set(0)

        async def prepare(req: ClaimPrepareRequest) -> ClaimPrepareReply:
            return await call(ctx.nc, ctx.subjects.converger_claim_prepare, req, CLAIM_PREPARE_REPLY_CODEC, timeout=PREPARE_CALL_TIMEOUT_S)

        async def unprepare(uid: str) -> ClaimUnprepareReply:
            return await call(ctx.nc, ctx.subjects.converger_claim_unprepare, ClaimUnprepareRequest(uid=uid), CLAIM_UNPREPARE_REPLY_CODEC, timeout=UNPREPARE_CALL_TIMEOUT_S)

        async def inventory() -> Inventory:
            return await call(ctx.nc, ctx.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=3.0)

        async def claims() -> Claims:
            return await call(ctx.nc, ctx.subjects.converger_claims, Empty(), CLAIMS_CODEC, timeout=5.0)

        async def claim_holds() -> list[ClaimSummary]:
            return list((await call(ctx.nc, ctx.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=5.0)).claims)

        self.plugin = DraPlugin(
            kubelet_dir=o.kubelet_dir,
            driver=o.driver,
            node_name=node_name,
            calls=Calls(prepare=prepare, unprepare=unprepare, inventory=inventory, claims=claims, claim_holds=claim_holds),
            api=self.api,
            store=CheckpointStore(Path(o.data_dir) / "dra_plugin"),
            boot_id=boot,
            metrics=metrics,
            binding_conditions=o.binding_conditions == "true",
            mig_devices=o.mig_devices == "true",
            shared_cards=o.shared_cards == "true",
            device_taints=o.device_taints == "true",
            watch_interval=o.watch_interval,
            resync_interval=o.resync_interval,
        )
        plugin = self.plugin
        await plugin.start()
        ctx.metadata.update({"driver": o.driver, "registration_socket": str(plugin.reg_path), "plugin_socket": str(plugin.dra_path)})

        @guarded(ctx.log, "notice")
        async def on_notice(msg: Any) -> None:
            plugin.wake()

        await ctx.nc.subscribe(ctx.subjects.inventory_changed, cb=on_notice)
        await ctx.nc.subscribe(ctx.subjects.converger_claims_changed, cb=on_notice)
        await ctx.endpoint("status", ctx.subjects.dra_plugin_status, self.status, EMPTY_CODEC, allow_empty=True, reply=DRA_PLUGIN_STATUS_CODEC)

    async def status(self, _: Empty) -> DraPluginStatus:
        assert self.plugin is not None
        return self.plugin.status()

    async def run(self, ctx: ServiceContext) -> None:
        assert self.plugin is not None
        self.plugin.wake()
        await self.plugin.run(ctx.stopping)

    async def close(self, ctx: ServiceContext) -> None:
        if self.plugin is not None:
            await self.plugin.close()
        if self.api is not None:
            await self.api.close()


main = main_for(DraPluginApp)

__all__ = ["DraPluginApp", "main"]
