"""The device plugin itself: one kubelet DevicePlugin server per resource, registration, the kubelet watch.

`DevicePlugin` owns the current `Advertisement` (refreshed from the holds on
disk and the last inventory: `refresh`), a `ResourceServer` per extended
resource, each on its own socket in the kubelet's device-plugins directory,
and the loop that keeps them registered (`watch`):

* The kubelet is there when `kubelet.sock` is. A new kubelet (its socket
  re-created: another inode) or our socket gone (a restarting kubelet deletes
  every socket in the directory) means: serve again where needed, Register
  again. A failed Register is retried each tick, the error kept for status.
* ListAndWatch streams get the device list at once and then every change.
  `withdraw` waits (bounded) until every open stream took the update, so
  the converger asks the reaper to evict only after the kubelet was told.
* Allocate re-reads the disk first (a hold withdrawn a moment ago is refused
  even if no notice came yet) and answers the CDI names bcd wrote plus the
  hold's env (`advertise.allocation_env`).

Nothing here knows NATS: the service hands in the inventory getter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from shared.holddisk import DiskView, read_disk
from shared.schemas import AdvertisedHold, DevicePluginStatus, Inventory, PluginResource, WithdrawReply
from shared.schemas.common import clip

from .advertise import (
    Advertisement,
    AdvertisedDevice,
    AllocateRefused,
    ResourceNames,
    allocation_env,
    plan_advertisement,
    preferred_allocation,
    socket_name,
)
from .proto import HEALTHY, KUBELET_SOCKET, UNHEALTHY, VERSION
from .proto import deviceplugin_v1beta1_pb2 as pb
from .proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

#: a unix socket path must fit sockaddr_un.sun_path (108 bytes with its NUL).
SOCKET_PATH_MAX = 107
#: how long a withdrawal waits for the kubelet's streams to take the update.
WITHDRAW_WAIT_S = 2.0
#: how long one Register may take.
REGISTER_TIMEOUT_S = 5.0


class PluginError(Exception):
    pass


@dataclass
class Metrics:
    """The plugin's Prometheus instruments (any object with .labels()/.set()/.inc() works)."""

    registrations: Any = None  # Counter [resource, outcome]
    registered: Any = None  # Gauge [resource]
    advertised: Any = None  # Gauge [resource, health]
    allocations: Any = None  # Counter [resource, outcome]
    kube_holds: Any = None  # Gauge


def _identity(path: Path) -> tuple[int, int, int] | None:
    """The socket at `path` (device, inode, ctime): None when absent or not a socket."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def _pb_device(d: AdvertisedDevice) -> pb.Device:
    topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa_node)]) if d.numa_node is not None else None
    return pb.Device(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY, topology=topology)


class ResourceServer(pb_grpc.DevicePluginServicer):
    """The DevicePlugin service of one extended resource, on `<plugin dir>/bcd-<name>.sock`."""

    def __init__(self, plugin: "DevicePlugin", resource: str, path: Path) -> None:
        self.plugin = plugin
        self.resource = resource
        self.path = path
        self.server: grpc.aio.Server | None = None
        self.socket: tuple[int, int, int] | None = None
        #: the kubelet socket identity this resource is registered with (None: not registered).
        self.registered_with: tuple[int, int, int] | None = None
        self.error = ""
        self.next_try = 0.0
        self.failures = 0
        self.devices: tuple[pb.Device, ...] = ()
        self.streams: set[asyncio.Queue[tuple[pb.Device, ...]]] = set()

    # ------------------------------------------------------------------ serving

    async def start(self) -> None:
        if len(str(self.path)) > SOCKET_PATH_MAX:
            raise PluginError(f"{self.path}: longer than a unix socket path may be ({SOCKET_PATH_MAX} bytes)")
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            if not stat.S_ISSOCK(st.st_mode):
                raise PluginError(f"{self.path} exists and is not a socket: left alone, not served")
            os.unlink(self.path)  # a socket a previous run (or a killed one) left
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self, server)
        if server.add_insecure_port(f"unix://{self.path}") == 0:
            raise PluginError(f"cannot listen on {self.path}")
        await server.start()
        self.server = server
        self.socket = _identity(self.path)
        self.registered_with = None

    async def stop(self, grace: float = 0.5) -> None:
        server, self.server = self.server, None
        self.registered_with = None
        if server is not None:
            await server.stop(grace)
        # ours only: a kubelet may have made a new file of that name meanwhile
        if self.socket is not None and _identity(self.path) == self.socket:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.socket = None

    def socket_ok(self) -> bool:
        return self.server is not None and self.socket is not None and _identity(self.path) == self.socket

    def publish(self, devices: tuple[pb.Device, ...]) -> int:
        """Send the list to every open stream when it changed; how many streams were sent it."""
        if devices == self.devices:
            return 0
        self.devices = devices
        for q in self.streams:
            q.put_nowait(devices)
        return len(self.streams)

    async def drained(self, timeout: float) -> bool:
        """True once every open stream wrote what it was sent (False on timeout)."""
        queues = list(self.streams)
        if not queues:
            return True
        try:
            await asyncio.wait_for(asyncio.gather(*(q.join() for q in queues)), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # ------------------------------------------------------------------ the kubelet's calls

    async def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:  # noqa: N802 - the proto's name
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: pb.Empty, context: Any):  # noqa: N802, ANN201 - a server stream
        q: asyncio.Queue[tuple[pb.Device, ...]] = asyncio.Queue()
        self.streams.add(q)
        self.plugin.log.info("kubelet watches devices", resource=self.resource, devices=len(self.devices))
        try:
            yield pb.ListAndWatchResponse(devices=list(self.devices))
            while True:
                devices = await q.get()
                try:
                    yield pb.ListAndWatchResponse(devices=list(devices))
                finally:
                    q.task_done()
        finally:
            self.streams.discard(q)
            # whoever waits on this stream's drain is not kept waiting
            while not q.empty():
                q.get_nowait()
                q.task_done()

    async def GetPreferredAllocation(self, request: pb.PreferredAllocationRequest, context: Any) -> pb.PreferredAllocationResponse:  # noqa: N802
        mine = {d.id: d for d in self.plugin.advert.devices_of(self.resource)}
        responses = []
        for r in request.container_requests:
            ids = preferred_allocation(mine, list(r.available_deviceIDs), list(r.must_include_deviceIDs), int(r.allocation_size))
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:  # noqa: N802
        try:
            return await self.plugin.allocate(self.resource, [list(r.devices_ids) for r in request.container_requests])
        except AllocateRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # abort raises; this is never reached

    async def PreStartContainer(self, request: pb.PreStartContainerRequest, context: Any) -> pb.PreStartContainerResponse:  # noqa: N802
        return pb.PreStartContainerResponse()


class DevicePlugin:
    def __init__(
        self,
        *,
        plugin_dir: Path,
        cdi_dir: Path,
        run_dir: Path,
        names: ResourceNames,
        inventory: Callable[[], Awaitable[Inventory]],
        log: Any,
        metrics: Metrics | None = None,
        watch_interval: float = 1.0,
        rescan_interval: float = 2.0,
        register_timeout: float = REGISTER_TIMEOUT_S,
    ) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self.cdi_dir, self.run_dir = Path(cdi_dir), Path(run_dir)
        self.names = names
        self._inventory = inventory
        self.log = log
        self.m = metrics or Metrics()
        self.watch_interval = max(0.05, watch_interval)
        self.rescan_interval = max(0.05, rescan_interval)
        self.register_timeout = register_timeout
        self.inventory: Inventory | None = None
        self.disk = DiskView()
        self.advert = Advertisement()
        #: allocations the converger withdrew whose hold file is still seen (dropped once it is gone).
        self.withdrawn: set[str] = set()
        self.servers: dict[str, ResourceServer] = {}
        self.allocations = 0
        self._lock = asyncio.Lock()
        self._warned: set[str] = set()
        self._kubelet_seen: bool | None = None
        self.wake = asyncio.Event()

    # ------------------------------------------------------------------ looking

    async def fetch_inventory(self) -> None:
        try:
            inv = await self._inventory()
        except Exception as exc:  # noqa: BLE001 - the last one (or none: all Unhealthy) stands
            self.log.warning("inventory unavailable; keeping the last one", error=f"{type(exc).__name__}: {exc}")
            return
        self.inventory = inv

    async def refresh(self, inventory: Inventory | None = None) -> int:
        """Read the holds again and send what changed to the kubelet; how many streams were told."""
        async with self._lock:
            if inventory is not None:
                self.inventory = inventory
            self.disk = await asyncio.to_thread(read_disk, self.cdi_dir, self.run_dir, warned=self._warned)
            self.withdrawn &= set(self.disk.holds)
            self.advert = plan_advertisement(self.disk.holds, self.inventory, self.names, self.withdrawn, served=self.servers)
            self._count_metrics()
            await self._ensure_servers()
            told = 0
            for resource, server in self.servers.items():
                told += server.publish(tuple(_pb_device(d) for d in self.advert.devices_of(resource)))
            return told

    def _count_metrics(self) -> None:
        if self.m.kube_holds is not None:
            self.m.kube_holds.set(len(self.advert.holds))
        if self.m.advertised is not None:
            for resource, devices in self.advert.resources.items():
                healthy = sum(1 for d in devices if d.healthy)
                self.m.advertised.labels(resource=resource, health="healthy").set(healthy)
                self.m.advertised.labels(resource=resource, health="unhealthy").set(len(devices) - healthy)

    async def withdraw(self, allocation_id: str) -> WithdrawReply:
        """Stop advertising one hold now; answered once the kubelet's streams took it (bounded)."""
        before = set(self.advert.holds.get(allocation_id).devices) if allocation_id in self.advert.holds else set()
        if allocation_id in self.disk.holds or allocation_id in self.advert.holds:
            self.withdrawn.add(allocation_id)
        told = await self.refresh()
        still = {d.id for d in self.advert.by_id.values() if d.allocation_id == allocation_id}
        ok = all(await asyncio.gather(*(s.drained(WITHDRAW_WAIT_S) for s in self.servers.values())))
        detail = "" if ok else f"a ListAndWatch stream did not take the update within {WITHDRAW_WAIT_S:.0f} s"
        if still:
            detail = f"still advertised: {', '.join(sorted(still))}"
        self.log.info("hold withdrawn from the kubelet", allocation_id=allocation_id, devices=sorted(before), streams=told)
        return WithdrawReply(withdrawn=sorted(before - still), streams=told, detail=detail)

    # ------------------------------------------------------------------ Allocate

    async def allocate(self, resource: str, containers: list[list[str]]) -> pb.AllocateResponse:
        await self.refresh()
        responses = []
        try:
            for ids in containers:
                if not ids:
                    raise AllocateRefused("a container request names no device")
                devices = []
                for i in ids:
                    d = self.advert.by_id.get(i)
                    if d is None or d.resource != resource:
                        raise AllocateRefused(f"{resource} device {i} is not advertised (any more): its hold is withdrawn or gone")
                    if not d.healthy:
                        raise AllocateRefused(f"{resource} device {i} is Unhealthy: {d.why}")
                    devices.append(d)
                env = allocation_env(devices, self.disk.env_files)
                responses.append(pb.ContainerAllocateResponse(envs=env, cdi_devices=[pb.CDIDevice(name=d.cdi_name) for d in devices]))
        except AllocateRefused as exc:
            self._count(self.m.allocations, resource=resource, outcome="refused")
            self.log.warning("Allocate refused", resource=resource, devices=containers, reason=str(exc))
            raise
        self.allocations += 1
        self._count(self.m.allocations, resource=resource, outcome="ok")
        self.log.info("devices allocated to a container", resource=resource, devices=containers)
        return pb.AllocateResponse(container_responses=responses)

    # ------------------------------------------------------------------ serving and registering

    async def _ensure_servers(self) -> None:
        if not self.plugin_dir.is_dir():
            return
        for resource in self.advert.resources:
            if resource in self.servers:
                continue
            server = ResourceServer(self, resource, self.plugin_dir / socket_name(resource))
            try:
                await server.start()
            except (PluginError, RuntimeError, OSError) as exc:
                self._warn_once(f"serve:{resource}", "cannot serve a resource", resource=resource, error=str(exc))
                server.error = clip(str(exc))
                continue
            self.servers[resource] = server
            self._gauge_registered(server)

    async def _register(self, server: ResourceServer, kubelet: tuple[int, int, int]) -> None:
        request = pb.RegisterRequest(
            version=VERSION,
            endpoint=server.path.name,
            resource_name=server.resource,
            options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
        )
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
                await pb_grpc.RegistrationStub(channel).Register(request, timeout=self.register_timeout)
        except grpc.aio.AioRpcError as exc:
            server.failures += 1
            server.error = clip(f"Register refused or failed: {exc.code().name}: {exc.details()}")
            server.next_try = time.monotonic() + min(30.0, 0.5 * 2 ** min(server.failures, 6))
            self._count(self.m.registrations, resource=server.resource, outcome="failed")
            self.log.warning("Register with the kubelet failed; retrying", resource=server.resource, error=server.error)
            return
        server.registered_with, server.error, server.failures = kubelet, "", 0
        self._count(self.m.registrations, resource=server.resource, outcome="ok")
        self._gauge_registered(server)
        self.log.info("registered with the kubelet", resource=server.resource, endpoint=server.path.name)

    async def tick(self) -> None:
        """One look at the kubelet: serve again what it deleted, Register what it does not have."""
        kubelet = _identity(self.kubelet_socket)
        present = kubelet is not None
        if present != self._kubelet_seen:
            if present:
                self.log.info("kubelet socket present", socket=str(self.kubelet_socket))
            else:
                self.log.warning("no kubelet socket; waiting for the kubelet", socket=str(self.kubelet_socket))
            self._kubelet_seen = present
        if kubelet is None:
            for s in self.servers.values():
                s.registered_with = None
                self._gauge_registered(s)
            return
        if not self.servers:
            await self.refresh()
        now = time.monotonic()
        for server in list(self.servers.values()):
            if not server.socket_ok():
                self.log.info("plugin socket gone (kubelet restarted?); serving it again", resource=server.resource)
                await server.stop(0)
                try:
                    await server.start()
                except (PluginError, RuntimeError, OSError) as exc:
                    server.error = clip(str(exc))
                    self._gauge_registered(server)
                    continue
            if server.registered_with != kubelet:
                if server.registered_with is not None or server.next_try <= now:
                    server.registered_with = None
                    self._gauge_registered(server)
                    await self._register(server, kubelet)

    async def watch(self, stopping: asyncio.Event) -> None:
        last_scan = 0.0
        while not stopping.is_set():
            try:
                now = time.monotonic()
                if now - last_scan >= self.rescan_interval or self.wake.is_set():
                    self.wake.clear()
                    last_scan = now
                    if self.inventory is None:
                        await self.fetch_inventory()
                    await self.refresh()
                await self.tick()
            except Exception:  # noqa: BLE001 - keep serving; the error is logged
                self.log.exception("device plugin tick failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake_or_stop(stopping), timeout=self.watch_interval)

    async def _wake_or_stop(self, stopping: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(self.wake.wait()), asyncio.ensure_future(stopping.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def close(self) -> None:
        for server in self.servers.values():
            await server.stop(0.5)

    # ------------------------------------------------------------------ status

    def status(self) -> DevicePluginStatus:
        kubelet = _identity(self.kubelet_socket)
        resources = [
            PluginResource(
                name=s.resource,
                endpoint=s.path.name,
                registered=kubelet is not None and s.registered_with == kubelet,
                devices=len(self.advert.devices_of(s.resource)),
                healthy=sum(1 for d in self.advert.devices_of(s.resource) if d.healthy),
                streams=len(s.streams),
                error=s.error,
            )
            for s in sorted(self.servers.values(), key=lambda s: s.resource)
        ]
        holds = [
            AdvertisedHold(
                allocation_id=h.allocation_id,
                advertised=h.advertised and any(r.registered for r in resources if r.name in h.resources),
                devices=list(h.devices),
                resources=list(h.resources),
                reason=clip(h.reason or ("" if kubelet is not None else "no kubelet")),
            )
            for h in self.advert.holds.values()
        ]
        return DevicePluginStatus(
            kubelet_socket=str(self.kubelet_socket),
            kubelet_present=kubelet is not None,
            registered=bool(resources) and all(r.registered for r in resources),
            resources=resources,
            holds=holds,
            allocations=self.allocations,
        )

    # ------------------------------------------------------------------ small things

    def _gauge_registered(self, server: ResourceServer) -> None:
        if self.m.registered is not None:
            self.m.registered.labels(resource=server.resource).set(1 if server.registered_with is not None else 0)

    @staticmethod
    def _count(c: Any, **labels: str) -> None:
        if c is not None:
            c.labels(**labels).inc()

    def _warn_once(self, key: str, message: str, **fields: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message, **fields)


__all__ = ["DevicePlugin", "Metrics", "PluginError", "ResourceServer"]
