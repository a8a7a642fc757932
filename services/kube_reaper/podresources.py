"""The `PodResources` port: the kubelet's pod-resources v1 gRPC API, and a fake.

The kubelet serves `v1.PodResourcesLister` on a unix socket (default
/var/lib/kubelet/pod-resources/kubelet.sock). Each List opens its own channel:
after a kubelet restart the socket is a new file, and a long-lived channel
could sit in gRPC's reconnect backoff for minutes while the kubelet is back.
Every call has a deadline. grpc and the generated protobuf modules are
imported on the first List that finds the socket, so a node without a kubelet
never loads them (about 10 MiB per process).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from .ports import PodDevice, SourceUnreachable

if TYPE_CHECKING:
    from .proto import podresources_v1_pb2 as pb

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
#: the kubelet's answer grows with pods x devices; dcgm-exporter allows 16 MiB too.
MAX_RECEIVE_BYTES = 16 * 1024 * 1024


def devices_of(response: pb.ListPodResourcesResponse) -> list[PodDevice]:
    """Flatten a List answer: one PodDevice per (pod, container, device id).

    Device-plugin devices carry the plugin's ids. Devices from Dynamic
    Resource Allocation carry CDI device names (`vendor.com/class=name`); the
    name part is kept as the device id, so a DRA driver naming devices by
    GPU or MIG uuid (or by bcd atom id) is seen too.
    """
    out: list[PodDevice] = []
    for pod in response.pod_resources:
        for c in pod.containers:
            for dev in c.devices:
                out.extend(PodDevice(pod.namespace, pod.name, c.name, dev.resource_name, d) for d in dev.device_ids)
            for dyn in c.dynamic_resources:
                for claim in dyn.claim_resources:
                    resource = f"dra:{claim.driver_name or dyn.claim_name}"
                    for cdi in claim.cdi_devices:
                        name = cdi.name.partition("=")[2] or cdi.name
                        out.append(PodDevice(pod.namespace, pod.name, c.name, resource, name))
    return out


class KubeletPodResources:
    """PodResources on the kubelet's socket (grpc.aio, one channel per call, per-call deadline)."""

    def __init__(self, socket: Path = DEFAULT_SOCKET, timeout: float = 5.0) -> None:
        self.socket = Path(socket)
        self.timeout = timeout

    @property
    def target(self) -> str:
        return "unix://" + os.path.abspath(self.socket)

    async def list_devices(self) -> list[PodDevice]:
        if not self.socket.exists():
            raise SourceUnreachable(f"kubelet pod-resources socket {self.socket} does not exist")
        import grpc.aio

        from .proto import podresources_v1_pb2 as pb
        from .proto import podresources_v1_pb2_grpc as pb_grpc

        options = [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES), ("grpc.enable_http_proxy", 0)]
        async with grpc.aio.insecure_channel(self.target, options=options) as channel:
            stub = pb_grpc.PodResourcesListerStub(channel)
            try:
                response = await stub.List(pb.ListPodResourcesRequest(), timeout=self.timeout)
            except grpc.aio.AioRpcError as exc:
                raise SourceUnreachable(
                    f"kubelet pod-resources List on {self.socket}: {exc.code().name}: {exc.details()}"
                ) from None
        return devices_of(response)

    async def close(self) -> None:
        return None


class FakePodResources:
    """PodResources from a list the test sets; `unreachable` makes every call fail with it."""

    def __init__(self, devices: Iterable[PodDevice] = ()) -> None:
        self.devices = list(devices)
        self.unreachable: str = ""
        self.calls = 0

    async def list_devices(self) -> list[PodDevice]:
        self.calls += 1
        if self.unreachable:
            raise SourceUnreachable(self.unreachable)
        return list(self.devices)

    async def close(self) -> None:
        return None


__all__ = ["DEFAULT_SOCKET", "devices_of", "KubeletPodResources", "FakePodResources"]
