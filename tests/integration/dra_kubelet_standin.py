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
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc

from services.dra_plugin.proto import DRA_PLUGIN_SERVICE, DRA_PLUGIN_TYPE
from services.dra_plugin.proto import dra_v1_pb2 as dra_pb
from services.dra_plugin.proto import dra_v1_pb2_grpc as dra_grpc
from services.dra_plugin.proto import pluginregistration_v1_pb2 as reg_pb
from services.dra_plugin.proto import pluginregistration_v1_pb2_grpc as reg_grpc


class RegistrationRefused(AssertionError):
    pass


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


__all__ = ["DraKubelet", "RegistrationRefused"]
