"""The kubelet's DRAPlugin gRPC service in each version bcd serves: thin adapters over one prepare/unprepare.

A kubelet speaks the DRAPlugin version it picked at registration (from the
plugin's `supported_versions`); what it asks is the same in every version
(claims by namespace, name and uid; devices with pool, name, requests and CDI
ids). This module owns that translation and nothing else: each version's
servicer turns the request into `ClaimRef`s, asks the `Preparer` (the
DraPlugin: one implementation, checkpoint, converger and all) and writes its
`PrepareResult` in that version's messages.

* `v1.DRAPlugin` (kubelets 1.34 and later): Device.share_id (added to v1 in
  1.35; a 1.34 kubelet skips the unknown field) carries the allocation
  result's shareID for a device of a shared card, and is left absent
  otherwise: the field is optional, and the kubelet keeps "" as a share.
* `v1beta1.DRAPlugin` (kubelets 1.32 and 1.33; 1.34 to 1.37 still accept it):
  the same messages without share_id.

`SERVICES` is the order they are advertised in, the newest first, because of
how each kubelet picks (pkg/kubelet/cm/dra/plugin, validateSupportedServices):
1.32 and 1.33 walk their own list (v1beta1.DRAPlugin, then
v1alpha3.NodeService) and take the first the plugin offers, falling back to
v1alpha4 when it offers neither (a v1-only plugin is "registered" and every
prepare then fails Unimplemented); 1.34 to 1.37 walk the plugin's list and
take the first they know (v1.DRAPlugin or v1beta1.DRAPlugin), refusing the
plugin when there is none. v1 first is what gives 1.34+ the newer version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from shared.schemas import PreparedDevice

from .proto import DRA_PLUGIN_SERVICE, DRA_PLUGIN_SERVICE_V1BETA1
from .proto import dra_v1_pb2 as v1
from .proto import dra_v1_pb2_grpc as v1_grpc
from .proto import dra_v1beta1_pb2 as v1beta1
from .proto import dra_v1beta1_pb2_grpc as v1beta1_grpc


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it, in any version."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PrepareResult:
    devices: list[PreparedDevice] = field(default_factory=list)
    #: device name -> the shareID of its allocation result (a device of a shared card only)
    share_ids: dict[str, str] = field(default_factory=dict)
    #: non-empty: the claim was not prepared (the kubelet retries)
    error: str = ""


class Preparer(Protocol):
    async def prepare_claim(self, claim: ClaimRef) -> PrepareResult: ...

    async def unprepare_claim(self, claim: ClaimRef) -> str: ...


class _V1(v1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(self, request: v1.NodePrepareResourcesRequest, context: Any) -> v1.NodePrepareResourcesResponse:  # noqa: N802 - the proto's name
        out = v1.NodePrepareResourcesResponse()
        for c in request.claims:
            got = await self.preparer.prepare_claim(ClaimRef(c.namespace, c.name, c.uid))
            answer = out.claims[c.uid]
            if got.error:
                answer.error = got.error
                continue
            for d in got.devices:
                device = answer.devices.add(request_names=list(d.requests), pool_name=d.pool, device_name=d.device, cdi_device_ids=list(d.cdi_ids))
                if got.share_ids.get(d.device):
                    device.share_id = got.share_ids[d.device]
        return out

    async def NodeUnprepareResources(self, request: v1.NodeUnprepareResourcesRequest, context: Any) -> v1.NodeUnprepareResourcesResponse:  # noqa: N802
        out = v1.NodeUnprepareResourcesResponse()
        for c in request.claims:
            out.claims[c.uid].error = await self.preparer.unprepare_claim(ClaimRef(c.namespace, c.name, c.uid))
        return out


class _V1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(self, request: v1beta1.NodePrepareResourcesRequest, context: Any) -> v1beta1.NodePrepareResourcesResponse:  # noqa: N802
        out = v1beta1.NodePrepareResourcesResponse()
        for c in request.claims:
            got = await self.preparer.prepare_claim(ClaimRef(c.namespace, c.name, c.uid))
            answer = out.claims[c.uid]
            if got.error:
                answer.error = got.error
                continue
            # no share_id in v1beta1: the kubelet of 1.32/1.33 knows devices, not shares
            for d in got.devices:
                answer.devices.add(request_names=list(d.requests), pool_name=d.pool, device_name=d.device, cdi_device_ids=list(d.cdi_ids))
        return out

    async def NodeUnprepareResources(self, request: v1beta1.NodeUnprepareResourcesRequest, context: Any) -> v1beta1.NodeUnprepareResourcesResponse:  # noqa: N802
        out = v1beta1.NodeUnprepareResourcesResponse()
        for c in request.claims:
            out.claims[c.uid].error = await self.preparer.unprepare_claim(ClaimRef(c.namespace, c.name, c.uid))
        return out


#: (name in supported_versions, how to serve it), in the order they are advertised (see above)
SERVICES: tuple[tuple[str, Callable[[grpc.aio.Server, Preparer], None]], ...] = (
    (DRA_PLUGIN_SERVICE, lambda server, p: v1_grpc.add_DRAPluginServicer_to_server(_V1(p), server)),
    (DRA_PLUGIN_SERVICE_V1BETA1, lambda server, p: v1beta1_grpc.add_DRAPluginServicer_to_server(_V1beta1(p), server)),
)


def supported_versions() -> list[str]:
    """What the plugin lists in PluginInfo.supported_versions for its DRAPlugin services."""
    return [name for name, _ in SERVICES]


def add_services(server: grpc.aio.Server, preparer: Preparer) -> None:
    """Every version of the DRAPlugin service on one server (one socket: the kubelet dials the one endpoint)."""
    for _, add in SERVICES:
        add(server, preparer)


__all__ = ["ClaimRef", "PrepareResult", "Preparer", "SERVICES", "add_services", "supported_versions"]
