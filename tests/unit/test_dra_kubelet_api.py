"""The DRAPlugin service in each kubelet version (services/dra_plugin/kubelet_api.py): both versions
are served on one socket over the same prepare and unprepare, advertised newest first, and only v1
carries a device's share id (v1beta1 has no such field)."""

from __future__ import annotations

from pathlib import Path

import grpc

from services.dra_plugin import kubelet_api
from services.dra_plugin.kubelet_api import ClaimRef, PrepareResult
from services.dra_plugin.proto import dra_v1_pb2 as v1
from services.dra_plugin.proto import dra_v1_pb2_grpc as v1_grpc
from services.dra_plugin.proto import dra_v1beta1_pb2 as v1beta1
from services.dra_plugin.proto import dra_v1beta1_pb2_grpc as v1beta1_grpc
from shared.schemas import PreparedDevice

SHARE = "0b8f5a3e-5f1c-4c8e-9a52-3f0f3e8d7c11"


class Preparer:
    """Two devices for claim u-1 (one of them a share), an error for u-2; remembers every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ClaimRef]] = []

    async def prepare_claim(self, claim: ClaimRef) -> PrepareResult:
        self.calls.append(("prepare", claim))
        if claim.uid == "u-2":
            return PrepareResult(error="device gpu-9 of pool node-1 is not one this node publishes")
        return PrepareResult(
            devices=[
                PreparedDevice(requests=["gpu"], pool="node-1", device="gpu-0", cdi_ids=["bcd.dev/gpu=GPU-0"]),
                PreparedDevice(requests=["half"], pool="node-1", device="gpu-1", cdi_ids=[f"bcd.dev/gpu=GPU-1_{SHARE}"]),
            ],
            share_ids={"gpu-1": SHARE},
        )

    async def unprepare_claim(self, claim: ClaimRef) -> str:
        self.calls.append(("unprepare", claim))
        return "" if claim.uid == "u-1" else "the converger did not answer"


def test_v1_is_advertised_before_v1beta1() -> None:
    # a 1.34+ kubelet takes the first of the plugin's list it knows: v1 must come first
    assert kubelet_api.supported_versions() == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


async def test_both_versions_answer_on_one_socket_over_one_implementation(tmp_path: Path) -> None:
    preparer = Preparer()
    server = grpc.aio.server()
    kubelet_api.add_services(server, preparer)
    sock = tmp_path / "dra.sock"
    assert server.add_insecure_port(f"unix://{sock}") != 0
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
            new = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace="ml", name="a", uid="u-1"), v1.Claim(namespace="ml", name="b", uid="u-2")])
            )
            old = await v1beta1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1beta1.NodePrepareResourcesRequest(claims=[v1beta1.Claim(namespace="ml", name="a", uid="u-1"), v1beta1.Claim(namespace="ml", name="b", uid="u-2")])
            )
            gone_new = await v1_grpc.DRAPluginStub(ch).NodeUnprepareResources(v1.NodeUnprepareResourcesRequest(claims=[v1.Claim(namespace="ml", name="a", uid="u-1")]))
            gone_old = await v1beta1_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                v1beta1.NodeUnprepareResourcesRequest(claims=[v1beta1.Claim(namespace="ml", name="b", uid="u-2")])
            )
    finally:
        await server.stop(None)

    def devices(reply) -> list[tuple]:
        return [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in reply.claims["u-1"].devices]

    # the same devices in both versions
    assert devices(new) == devices(old) == [
        (["gpu"], "node-1", "gpu-0", ["bcd.dev/gpu=GPU-0"]),
        (["half"], "node-1", "gpu-1", [f"bcd.dev/gpu=GPU-1_{SHARE}"]),
    ]
    # the share id in v1 for the shared device only: absent (not "") for the exclusive one
    d0, d1 = new.claims["u-1"].devices
    assert not d0.HasField("share_id") and (d1.HasField("share_id"), d1.share_id) == (True, SHARE)
    assert "share_id" not in {f.name for f in v1beta1.Device.DESCRIPTOR.fields}
    # an error is the claim's, with no devices, in both
    for reply in (new, old):
        assert reply.claims["u-2"].error.startswith("device gpu-9") and not reply.claims["u-2"].devices
    assert gone_new.claims["u-1"].error == "" and gone_old.claims["u-2"].error == "the converger did not answer"
    # one implementation behind both: every call reached it with the claim as the kubelet named it
    assert [(k, c.uid) for k, c in preparer.calls] == [("prepare", "u-1"), ("prepare", "u-2")] * 2 + [("unprepare", "u-1"), ("unprepare", "u-2")]
    assert preparer.calls[0][1] == ClaimRef(namespace="ml", name="a", uid="u-1")
