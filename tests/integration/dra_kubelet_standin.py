"""The kubelet's side of DRA, on the official protos: its plugin watcher and its DRAPlugin client.

What the kubelet does with a DRA plugin (pkg/kubelet/pluginmanager and cm/dra):
its plugin watcher finds `<driver>-reg.sock` in `plugins_registry/`, dials it,
asks `Registration.GetInfo`, checks the type (DRAPlugin) and the name, picks
the DRAPlugin version it will call from the plugin's `supported_versions`,
dials the endpoint the plugin named, and tells the plugin through
`NotifyRegistrationStatus`. Then, for each pod's claims, `NodePrepareResources`
before the containers start and `NodeUnprepareResources` after the pod is
gone, in the version it picked; both may be called again for the same claims.
This stand-in does exactly that, for tests (no real kubelet runs on these
machines), as the kubelet of a release (`version`, 1.32 to 1.37) does.

How a release picks (`choose_service`, from kubernetes pkg/kubelet/cm/dra/plugin,
validateSupportedServices): 1.32 and 1.33 (registration.go / plugins_store.go)
walk their own list, v1beta1.DRAPlugin then v1alpha3.NodeService (the v1alpha4
API), take the first the plugin lists, and fall back to v1alpha4 when it lists
neither (plugins older than 1.32 advertised nothing): such a plugin registers,
and every call then goes to `/v1alpha3.Node/...`. 1.34 to 1.37
(dra_plugin_manager.go, servicesSupportedByKubelet = v1.DRAPlugin,
v1beta1.DRAPlugin) walk the plugin's list in its order, take the first they
know, and refuse the registration when there is none. v1alpha4 was removed in
1.34 (kubernetes PR 132574), v1 added (PR 132700). The v1alpha4 messages are
the v1beta1 ones field for field (kubelet v0.32.0 pkg/apis/dra/v1alpha4/api.proto),
so its calls are made with the v1beta1 messages on the v1alpha4 method paths.

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
from typing import Any

import grpc

from services.dra_plugin.proto import DRA_PLUGIN_SERVICE, DRA_PLUGIN_SERVICE_V1BETA1, DRA_PLUGIN_TYPE
from services.dra_plugin.proto import dra_health_v1_pb2 as health_v1_pb
from services.dra_plugin.proto import dra_health_v1_pb2_grpc as health_v1_grpc
from services.dra_plugin.proto import dra_health_v1alpha1_pb2 as health_v1alpha1_pb
from services.dra_plugin.proto import dra_health_v1alpha1_pb2_grpc as health_v1alpha1_grpc
from services.dra_plugin.proto import dra_v1_pb2 as dra_pb
from services.dra_plugin.proto import dra_v1beta1_pb2 as dra_v1beta1_pb
from services.dra_plugin.proto import pluginregistration_v1_pb2 as reg_pb
from services.dra_plugin.proto import pluginregistration_v1_pb2_grpc as reg_grpc

#: what the v1alpha4 API is advertised as (kubelet v0.32.0 pkg/apis/dra/v1alpha4/types.go NodeService)
V1ALPHA4_SERVICE = "v1alpha3.NodeService"
#: the DRAPlugin services each kubelet release calls, newest first
KUBELET_SERVICES: dict[str, tuple[str, ...]] = {
    "1.32": (DRA_PLUGIN_SERVICE_V1BETA1, V1ALPHA4_SERVICE),
    "1.33": (DRA_PLUGIN_SERVICE_V1BETA1, V1ALPHA4_SERVICE),
    **{v: (DRA_PLUGIN_SERVICE, DRA_PLUGIN_SERVICE_V1BETA1) for v in ("1.34", "1.35", "1.36", "1.37")},
}
#: service -> (gRPC service name in the method paths, the messages module)
_WIRE = {
    DRA_PLUGIN_SERVICE: ("k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", dra_pb),
    DRA_PLUGIN_SERVICE_V1BETA1: ("k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin", dra_v1beta1_pb),
    V1ALPHA4_SERVICE: ("v1alpha3.Node", dra_v1beta1_pb),
}


class RegistrationRefused(AssertionError):
    pass


def choose_service(version: str, offered: list[str]) -> tuple[str, str]:
    """(the service a kubelet of `version` calls, "") or ("", why it refuses the plugin)."""
    mine = KUBELET_SERVICES[version]
    if not offered:
        return "", "empty list of supported gRPC services (aka supported versions)"
    if version in ("1.32", "1.33"):
        return next((s for s in mine if s in offered), V1ALPHA4_SERVICE), ""
    chosen = next((s for s in offered if s in mine), "")
    return (chosen, "") if chosen else ("", f"none of services supported by the plugin ({offered}) are supported by the kubelet ({list(mine)})")


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
    def __init__(self, kubelet_dir: Path, *, plugin_root: str = "", version: str = "1.37") -> None:
        """`plugin_root`: the kubelet dir as the plugin sees it, when that differs from ours (a
        container with the directory mounted elsewhere): its endpoint is dialled under ours.
        `version`: the kubelet release whose choice of DRAPlugin version this one makes."""
        if version not in KUBELET_SERVICES:
            raise ValueError(f"kubelet {version}: not one of {sorted(KUBELET_SERVICES)}")
        self.kubelet_dir = Path(kubelet_dir)
        self.plugin_root = plugin_root
        self.version = version
        self.registry = self.kubelet_dir / "plugins_registry"
        self.endpoint: str = ""
        #: the DRAPlugin service picked at registration (what prepare and unprepare call)
        self.service: str = ""
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
                        service, problem = choose_service(self.version, list(info.supported_versions))
                        problem = self._refusal(info, driver) or problem
                        await reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                            reg_pb.RegistrationStatus(plugin_registered=not problem, error=problem), timeout=5
                        )
                    if problem:
                        raise RegistrationRefused(problem)
                    endpoint = info.endpoint
                    if self.plugin_root and endpoint.startswith(self.plugin_root.rstrip("/") + "/"):
                        endpoint = str(self.kubelet_dir / endpoint[len(self.plugin_root.rstrip("/")) + 1 :])
                    self.info, self.endpoint, self.service = info, endpoint, service
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
        if not Path(info.endpoint).is_absolute():
            return f"endpoint {info.endpoint!r} is not an absolute path"
        return ""

    def health_service(self, release: str = "") -> str:
        """The health service the kubelet of `release` (this one's by default) opens on the registered plugin ("" for none)."""
        release = release or self.version
        if self.info is None:
            raise AssertionError("no DRA plugin registered")
        if tuple(int(x) for x in release.split(".")) < (1, 37):
            return HEALTH_V1ALPHA1
        return next((s for s in (HEALTH_V1, HEALTH_V1ALPHA1) if s in self.info.supported_versions), "")

    def watch_health(self, release: str = "", service: str = "") -> HealthWatch:
        """Open NodeWatchResources as that kubelet would (or the `service` named)."""
        release = release or self.version
        chosen = service or self.health_service(release)
        if not chosen:
            raise AssertionError(f"a {release} kubelet opens no health stream: {list(self.info.supported_versions) if self.info else []} advertise none")
        return HealthWatch(self.endpoint, chosen)

    async def _call(self, method: str, claims: tuple[tuple[str, str, str], ...], timeout: float) -> dict[str, Any]:
        """One DRAPlugin call in the version picked at registration (its method path and messages)."""
        if not self.endpoint:
            raise AssertionError("no DRA plugin registered")
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.endpoint}")
        name, pb = _WIRE[self.service]
        request, response = getattr(pb, f"{method}Request"), getattr(pb, f"{method}Response")
        call = self._channel.unary_unary(f"/{name}/{method}", request_serializer=request.SerializeToString, response_deserializer=response.FromString)
        reply = await call(request(claims=[pb.Claim(namespace=ns, name=n, uid=u) for ns, n, u in claims]), timeout=timeout)
        return dict(reply.claims)

    async def prepare(self, *claims: tuple[str, str, str], timeout: float = 120.0) -> dict[str, Any]:
        """(namespace, name, uid) of each claim -> the plugin's answer per uid (a
        NodePrepareResourceResponse of the version picked: share_id only in v1)."""
        return await self._call("NodePrepareResources", claims, timeout)

    async def unprepare(self, *claims: tuple[str, str, str], timeout: float = 120.0) -> dict[str, Any]:
        return await self._call("NodeUnprepareResources", claims, timeout)

    async def _close_channel(self) -> None:
        ch, self._channel = self._channel, None
        if ch is not None:
            await ch.close()

    async def close(self) -> None:
        await self._close_channel()


__all__ = ["HEALTH_V1", "HEALTH_V1ALPHA1", "DraKubelet", "HealthWatch", "KUBELET_SERVICES", "RegistrationRefused", "V1ALPHA4_SERVICE", "choose_service"]
