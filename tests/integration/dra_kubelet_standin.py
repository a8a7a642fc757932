"""The kubelet's side of DRA, on the official protos: its plugin watcher and its DRAPlugin client.

What the kubelet does with a DRA plugin (pkg/kubelet/pluginmanager and cm/dra):
its plugin watcher finds `<driver>-reg.sock` in `plugins_registry/`, dials it,
asks `Registration.GetInfo`, checks the type (DRAPlugin), the name and that a
version it speaks (`v1.DRAPlugin`) is offered, dials the endpoint the plugin
named, and tells the plugin through `NotifyRegistrationStatus`. Then, for each
pod's claims, `NodePrepareResources` before the containers start and
`NodeUnprepareResources` after the pod is gone; both may be called again for
the same claims. This stand-in does exactly that, for tests (no real kubelet
runs on these machines).

Device health (KEP 4680, `HealthWatch`): the kubelet opens
`DRAResourceHealth/NodeWatchResources` on the same endpoint and keeps it open,
reconnecting when it ends (wait.UntilWithContext, every 5 s). Which version:
a kubelet of 1.37 picks the newest the plugin advertised at registration and
opens none when none is (pickHealthService in pkg/kubelet/cm/dra/plugin,
TestPickHealthService: v1 before v1alpha1); an older one asks for v1alpha1
whatever is advertised (dra_plugin_manager.go add(), ResourceHealthStatus on).
Each message is the full list; the kubelet stamps each device when it hears
of it and reads it Unknown 30 s later (healthinfo.go healthTimeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc

from services.dra_plugin.proto import DRA_PLUGIN_SERVICE, DRA_PLUGIN_TYPE
from services.dra_plugin.proto import dra_health_v1_pb2 as health_v1_pb
from services.dra_plugin.proto import dra_health_v1_pb2_grpc as health_v1_grpc
from services.dra_plugin.proto import dra_health_v1alpha1_pb2 as health_v1alpha1_pb
from services.dra_plugin.proto import dra_health_v1alpha1_pb2_grpc as health_v1alpha1_grpc
from services.dra_plugin.proto import dra_v1_pb2 as dra_pb
from services.dra_plugin.proto import dra_v1_pb2_grpc as dra_grpc
from services.dra_plugin.proto import pluginregistration_v1_pb2 as reg_pb
from services.dra_plugin.proto import pluginregistration_v1_pb2_grpc as reg_grpc


class RegistrationRefused(AssertionError):
    pass


#: the kubelet's names of the health services (k8s.io/kubelet pkg/apis/dra-health/*/types.go), newest first
HEALTH_V1, HEALTH_V1ALPHA1 = "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"
_HEALTH = {HEALTH_V1: (health_v1_pb, health_v1_grpc), HEALTH_V1ALPHA1: (health_v1alpha1_pb, health_v1alpha1_grpc)}


class HealthWatch:
    """One NodeWatchResources stream, read in the background: `updates` holds every message as
    {(pool, device): (HEALTHY|UNHEALTHY|UNKNOWN, message, last_updated_time)}."""

    def __init__(self, endpoint: str, service: str) -> None:
        self.service = service
        self.updates: list[dict[tuple[str, str], tuple[str, str, int]]] = []
        self.received_at: list[float] = []
        self.ended: str = ""
        self._new = asyncio.Event()
        pb, stubs = _HEALTH[service]
        self._pb = pb
        self._channel = grpc.aio.insecure_channel(f"unix://{endpoint}")
        self._call = stubs.DRAResourceHealthStub(self._channel).NodeWatchResources(pb.NodeWatchResourcesRequest())
        self._task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self._call:
                self.updates.append(
                    {
                        (d.device.pool_name, d.device.device_name): (self._pb.HealthStatus.Name(d.health), d.message, d.last_updated_time)
                        for d in msg.devices
                    }
                )
                self.received_at.append(time.monotonic())
                self._new.set()
            self.ended = "the plugin ended the stream"
        except grpc.aio.AioRpcError as exc:
            self.ended = f"{exc.code()}: {exc.details()}"
        self._new.set()

    async def wait(self, predicate, what: str, timeout: float = 30.0) -> dict[tuple[str, str], tuple[str, str, int]]:
        """The first message (already received or to come) the predicate holds for."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for update in self.updates[seen:]:
                if predicate(update):
                    return update
            seen = len(self.updates)
            if self.ended:
                raise AssertionError(f"{self.service} stream ended ({self.ended}) before {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.service}: no message with {what} in {timeout:.0f} s; last: {self.updates[-1:]}")
            self._new.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new.wait(), left)

    async def close(self) -> None:
        self._call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._channel.close()


class DraKubelet:
    def __init__(self, kubelet_dir: Path, *, plugin_root: str = "") -> None:
        """`plugin_root`: the kubelet dir as the plugin sees it, when that differs from ours (a
        container with the directory mounted elsewhere): its endpoint is dialled under ours."""
        self.kubelet_dir = Path(kubelet_dir)
        self.plugin_root = plugin_root
        self.registry = self.kubelet_dir / "plugins_registry"
        self.endpoint: str = ""
        self.info: reg_pb.PluginInfo | None = None
        self._channel: grpc.aio.Channel | None = None

    async def register(self, driver: str, timeout: float = 60.0) -> reg_pb.PluginInfo:
        """Wait for the driver's registration socket, then register it as the kubelet does."""
        sock = self.registry / f"{driver}-reg.sock"
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            if sock.exists():
                try:
                    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
                        info = await reg_grpc.RegistrationStub(ch).GetInfo(reg_pb.InfoRequest(), timeout=5)
                        problem = self._refusal(info, driver)
                        await reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                            reg_pb.RegistrationStatus(plugin_registered=not problem, error=problem), timeout=5
                        )
                    if problem:
                        raise RegistrationRefused(problem)
                    endpoint = info.endpoint
                    if self.plugin_root and endpoint.startswith(self.plugin_root.rstrip("/") + "/"):
                        endpoint = str(self.kubelet_dir / endpoint[len(self.plugin_root.rstrip("/")) + 1 :])
                    self.info, self.endpoint = info, endpoint
                    await self._close_channel()
                    return info
                except grpc.aio.AioRpcError as exc:
                    last = f"{exc.code()}: {exc.details()}"
            if time.monotonic() > deadline:
                raise TimeoutError(f"no DRA plugin registered at {sock} in {timeout:.0f} s ({last or 'no socket'})")
            await asyncio.sleep(0.2)

    @staticmethod
    def _refusal(info: reg_pb.PluginInfo, driver: str) -> str:
        if info.type != DRA_PLUGIN_TYPE:
            return f"plugin type {info.type!r} is not {DRA_PLUGIN_TYPE}"
        if info.name != driver:
            return f"plugin name {info.name!r} is not {driver!r}"
        if DRA_PLUGIN_SERVICE not in info.supported_versions:
            return f"none of {list(info.supported_versions)} is {DRA_PLUGIN_SERVICE}"
        if not Path(info.endpoint).is_absolute():
            return f"endpoint {info.endpoint!r} is not an absolute path"
        return ""

    def health_service(self, release: str = "1.37") -> str:
        """The health service the kubelet of `release` opens on the registered plugin ("" for none)."""
        if self.info is None:
            raise AssertionError("no DRA plugin registered")
        if tuple(int(x) for x in release.split(".")) < (1, 37):
            return HEALTH_V1ALPHA1
        return next((s for s in (HEALTH_V1, HEALTH_V1ALPHA1) if s in self.info.supported_versions), "")

    def watch_health(self, release: str = "1.37", service: str = "") -> HealthWatch:
        """Open NodeWatchResources as that kubelet would (or the `service` named)."""
        chosen = service or self.health_service(release)
        if not chosen:
            raise AssertionError(f"a {release} kubelet opens no health stream: {list(self.info.supported_versions) if self.info else []} advertise none")
        return HealthWatch(self.endpoint, chosen)

    def _stub(self) -> dra_grpc.DRAPluginStub:
        if not self.endpoint:
            raise AssertionError("no DRA plugin registered")
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.endpoint}")
        return dra_grpc.DRAPluginStub(self._channel)

    async def prepare(self, *claims: tuple[str, str, str], timeout: float = 120.0) -> dict[str, dra_pb.NodePrepareResourceResponse]:
        """(namespace, name, uid) of each claim -> the plugin's answer per uid."""
        req = dra_pb.NodePrepareResourcesRequest(claims=[dra_pb.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims])
        reply = await self._stub().NodePrepareResources(req, timeout=timeout)
        return dict(reply.claims)

    async def unprepare(self, *claims: tuple[str, str, str], timeout: float = 120.0) -> dict[str, dra_pb.NodeUnprepareResourceResponse]:
        req = dra_pb.NodeUnprepareResourcesRequest(claims=[dra_pb.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims])
        reply = await self._stub().NodeUnprepareResources(req, timeout=timeout)
        return dict(reply.claims)

    async def _close_channel(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        await self._close_channel()


__all__ = ["HEALTH_V1", "HEALTH_V1ALPHA1", "DraKubelet", "HealthWatch", "RegistrationRefused"]
