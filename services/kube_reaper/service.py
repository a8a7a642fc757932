"""The kube_reaper micro service: `held`, `evict`, `orphans` on the node bus; `freed` when watched devices free up.

- `bcd.<n>.kube_reaper.held`    DevicesQuery -> HeldReply: does any pod (or
  kubepods process) hold any of these atoms? When the kubelet, the host's
  processes or the inventory cannot be read: held, reachable=False, and the
  detail says why (unreachable counts as held).
- `bcd.<n>.kube_reaper.evict`   DevicesQuery -> EvictReply: evict every pod
  holding those atoms, in the background with backoff, and watch the
  allocation as withdrawn.
- `bcd.<n>.kube_reaper.orphans` OrphanQuery -> OrphanReply: pods holding a GPU
  or MIG device of this node that lies in no known atom.
- `bcd.<n>.kube_reaper.node`    NodeRead | NodeChange -> NodeReply: the node's
  own Kubernetes Node (--node-name) for the converger's MIG re-layout: read it,
  or change the flow's labels, its annotation, the re-layout taint and the
  cordon in one patch at a resourceVersion (nodeapi.py checks every key first).
- `bcd.<n>.kube_reaper.freed`   Freed, published once per watched allocation
  when a reachable recheck (every --recheck-interval seconds) finds none of
  its devices held.

The allocations watched live in memory: after a restart the converger's next
pass asks `evict` again for the releases it still has pending.
"""

from __future__ import annotations

from pathlib import Path
from prometheus_client import Counter, Gauge

from shared.runtime import Option, ServiceApp, ServiceContext, StartupError, call, main_for
from shared.schemas import (
    FREED_CODEC,
    DEVICES_QUERY_CODEC,
    EVICT_REPLY_CODEC,
    HELD_REPLY_CODEC,
    INVENTORY_CODEC,
    NODE_REPLY_CODEC,
    NODE_REQUEST_CODEC,
    ORPHAN_QUERY_CODEC,
    ORPHAN_REPLY_CODEC,
    Empty,
    Freed,
    Inventory,
)

from .evictor import EvictorUnavailable, KubernetesEvictor, NoEvictor
from .nodeapi import KubernetesNodeApi, NodeApi, NodeApiError, NodeEndpoint, NoNodeApi, is_dns1123_subdomain
from .podresources import DEFAULT_SOCKET, KubeletPodResources
from .ports import Evictor, HostProcesses
from .processes import FakeHostProcesses, NoHostProcesses, NvmlHostProcesses
from .reaper import Metrics, Reaper

#: how long one inventory request may take (the node bus is local).
INVENTORY_TIMEOUT_S = 3.0


class KubeReaperApp(ServiceApp):
    name = "kube_reaper"
    description = "tells whether pods hold devices; evicts pods holding withdrawn devices; reads and changes its own Node for the MIG re-layout"

    def __init__(self) -> None:
        self.reaper: Reaper | None = None
        self.pods: KubeletPodResources | None = None
        self.processes: HostProcesses | None = None
        self.evictor: Evictor | None = None
        self.node_api: NodeApi | None = None

    def options(self) -> list[Option]:
        return [
            Option("--pod-resources-socket", "the kubelet's pod-resources socket", default=DEFAULT_SOCKET, type=Path),
            Option("--kubeconfig", "kubeconfig for the Eviction API (default: $KUBECONFIG or ~/.kube/config)", type=Path),
            Option(
                "--in-cluster",
                "use the pod's service account: true, false, or auto (when no --kubeconfig and KUBERNETES_SERVICE_HOST is set)",
                default="auto",
                choices=("auto", "true", "false"),
            ),
            Option("--evictor", "how pods are evicted: kubernetes (Eviction API) or none", default="kubernetes", choices=("kubernetes", "none")),
            Option(
                "--node-api",
                "the node's own Kubernetes Node (kube_reaper.node): kubernetes, none, or auto (kubernetes when --evictor kubernetes)",
                default="auto",
                choices=("auto", "kubernetes", "none"),
            ),
            Option("--node-name", "this node's Kubernetes Node name (default: the node id)", default=""),
            Option("--processes", "GPU processes: nvml, fake (the fake host file) or none", default="nvml", choices=("nvml", "fake", "none")),
            Option("--fake-host", "fake host description file (--processes fake reads its processes)", type=Path),
            Option("--proc-root", "root of /proc (process cgroups)", default=Path("/proc"), type=Path),
            Option("--recheck-interval", "seconds between rechecks of withdrawn allocations", default=5.0, type=float),
            Option("--kubelet-timeout", "deadline of one pod-resources call, seconds", default=5.0, type=float),
        ]

    async def setup(self, ctx: ServiceContext) -> None:
        o = ctx.opts
        if o.recheck_interval <= 0 or o.kubelet_timeout <= 0:
            raise StartupError("--recheck-interval and --kubelet-timeout must be positive")
        if o.processes == "fake":
            if o.fake_host is None:
                raise StartupError("--processes fake needs --fake-host FILE (or BCD_FAKE_HOST)")
            self.processes = FakeHostProcesses(o.fake_host)
        elif o.processes == "nvml":
            self.processes = NvmlHostProcesses(o.proc_root)
        else:
            self.processes = NoHostProcesses()
        self.pods = KubeletPodResources(o.pod_resources_socket, timeout=o.kubelet_timeout)
        if o.evictor == "kubernetes":
            evictor = KubernetesEvictor(o.kubeconfig, o.in_cluster)
            try:
                source = await evictor.connect()
                ctx.log.info("Kubernetes credentials loaded", source=source)
            except EvictorUnavailable as exc:
                ctx.log.warning("evictions will fail until Kubernetes credentials load", reason=str(exc))
            self.evictor = evictor
        else:
            self.evictor = NoEvictor()
        node_api = o.evictor if o.node_api == "auto" else o.node_api
        node_name = o.node_name or o.node_id
        if node_api == "kubernetes":
            if not is_dns1123_subdomain(node_name):
                raise StartupError(f"--node-name {node_name!r} is no Kubernetes Node name (a DNS-1123 subdomain)")
            kube_node = KubernetesNodeApi(node_name, o.kubeconfig, o.in_cluster)
            try:
                await kube_node.connect()
            except NodeApiError as exc:
                ctx.log.warning("Node requests will fail until Kubernetes credentials load", reason=str(exc))
            self.node_api = kube_node
        else:
            self.node_api = NoNodeApi()

        reg = ctx.registry
        metrics = Metrics(
            evictions=Counter("bcd_reaper_evictions", "Eviction attempts by outcome", ["outcome"], registry=reg),
            held_checks=Counter("bcd_reaper_held_checks", "held requests by result (held, free, unreachable)", ["result"], registry=reg),
            watched=Gauge("bcd_reaper_watched_allocations", "Withdrawn allocations being watched", registry=reg),
            kubelet_reachable=Gauge("bcd_reaper_kubelet_reachable", "1 when the last pod-resources List answered", registry=reg),
        )
        # every series from the start, so rate() and increase() see the first one
        for outcome in ("evicted", "gone", "throttled", "server_error", "error", "unavailable"):
            metrics.evictions.labels(outcome=outcome)
        for result in ("held", "free", "unreachable"):
            metrics.held_checks.labels(result=result)
        node_requests = Counter("bcd_reaper_node_requests", "kube_reaper.node requests by verb and outcome", ["verb", "outcome"], registry=reg)

        async def inventory() -> Inventory:
            return await call(ctx.nc, ctx.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=INVENTORY_TIMEOUT_S)

        async def publish_freed(msg: Freed) -> None:
            await ctx.nc.publish(ctx.subjects.reaper_freed, FREED_CODEC.encode_valid(msg))
            await ctx.nc.flush(timeout=INVENTORY_TIMEOUT_S)

        self.reaper = Reaper(
            pods=self.pods,
            processes=self.processes,
            evictor=self.evictor,
            inventory=inventory,
            publish_freed=publish_freed,
            log=ctx.log,
            metrics=metrics,
            recheck_interval=o.recheck_interval,
        )
        ctx.metadata.update(
            {
                "pod_resources_socket": str(o.pod_resources_socket),
                "evictor": o.evictor,
                "processes": o.processes,
                "node_api": node_api,
                "node_name": node_name if node_api == "kubernetes" else "",
            }
        )
        reaper = self.reaper
        await ctx.endpoint("held", ctx.subjects.reaper_held, reaper.held, DEVICES_QUERY_CODEC, reply=HELD_REPLY_CODEC)
        await ctx.endpoint("evict", ctx.subjects.reaper_evict, reaper.evict, DEVICES_QUERY_CODEC, reply=EVICT_REPLY_CODEC)
        await ctx.endpoint("orphans", ctx.subjects.reaper_orphans, reaper.orphans, ORPHAN_QUERY_CODEC, allow_empty=True, reply=ORPHAN_REPLY_CODEC)
        node = NodeEndpoint(self.node_api, node_requests, ctx.log)
        await ctx.endpoint("node", ctx.subjects.reaper_node, node, NODE_REQUEST_CODEC, reply=NODE_REPLY_CODEC)

    async def run(self, ctx: ServiceContext) -> None:
        assert self.reaper is not None
        await self.reaper.watch(ctx.stopping)

    async def close(self, ctx: ServiceContext) -> None:
        if self.reaper is not None:
            await self.reaper.cancel_evictions()
        for part in (self.evictor, self.node_api, self.processes, self.pods):
            if part is not None:
                try:
                    await part.close()
                except Exception as exc:  # noqa: BLE001 - stopping anyway
                    ctx.log.warning("close failed", part=type(part).__name__, error=str(exc))


main = main_for(KubeReaperApp)

__all__ = ["KubeReaperApp", "main"]
