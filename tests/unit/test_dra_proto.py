"""The kubelet DRA plugin API v1 and v1beta1 and plugin registration API v1 (services/dra_plugin/proto): the
checked-in code is what the .protos generate today, it names the kubelet's services, messages and
field numbers, and a real gRPC client and server speak both over unix sockets."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.dra_plugin.proto import DRA_PLUGIN_SERVICE, DRA_PLUGIN_SERVICE_V1BETA1, DRA_PLUGIN_TYPE, generate
from services.dra_plugin.proto import dra_v1_pb2 as dra
from services.dra_plugin.proto import dra_v1_pb2_grpc as dra_grpc
from services.dra_plugin.proto import dra_v1beta1_pb2 as dra_v1beta1
from services.dra_plugin.proto import pluginregistration_v1_pb2 as reg
from services.dra_plugin.proto import pluginregistration_v1_pb2_grpc as reg_grpc
from shared.protogen import normalised

REPO = Path(__file__).resolve().parents[2]


def test_checked_in_code_matches_a_fresh_generation(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the `test` extra) is not installed; cannot regenerate")
    for path in generate.generate(tmp_path):
        checked_in = generate.HERE / path.name
        assert checked_in.exists(), f"{checked_in.relative_to(REPO)} is missing; run `make proto`"
        assert normalised(checked_in.read_text()) == normalised(path.read_text()), (
            f"{checked_in.relative_to(REPO)} is stale: run `make proto` and check the result in"
        )


def test_the_code_speaks_the_kubelet_s_v1_apis() -> None:
    # the package is part of every method path the kubelet calls
    assert dra.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    plugin = dra.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert set(plugin.methods_by_name) == {"NodePrepareResources", "NodeUnprepareResources"}
    assert {f.name: f.number for f in dra.Claim.DESCRIPTOR.fields} == {"namespace": 1, "uid": 2, "name": 3}
    assert {f.name: f.number for f in dra.Device.DESCRIPTOR.fields} == {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5}
    assert {f.name: f.number for f in dra.NodePrepareResourceResponse.DESCRIPTOR.fields} == {"devices": 1, "error": 2}
    assert reg.DESCRIPTOR.package == "pluginregistration"
    assert set(reg.DESCRIPTOR.services_by_name["Registration"].methods_by_name) == {"GetInfo", "NotifyRegistrationStatus"}
    assert {f.name: f.number for f in reg.PluginInfo.DESCRIPTOR.fields} == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    assert (DRA_PLUGIN_SERVICE, DRA_PLUGIN_TYPE) == ("v1.DRAPlugin", "DRAPlugin")


def test_the_code_speaks_the_kubelet_s_v1beta1_api() -> None:
    # what kubelets 1.32 and 1.33 call: /k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/..., the
    # messages of v1 without Device.share_id
    assert dra_v1beta1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    plugin = dra_v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert plugin.full_name == "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"
    assert set(plugin.methods_by_name) == {"NodePrepareResources", "NodeUnprepareResources"}
    assert {f.name: f.number for f in dra_v1beta1.Claim.DESCRIPTOR.fields} == {"namespace": 1, "uid": 2, "name": 3}
    assert {f.name: f.number for f in dra_v1beta1.Device.DESCRIPTOR.fields} == {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4}
    assert {f.name: f.number for f in dra_v1beta1.NodePrepareResourceResponse.DESCRIPTOR.fields} == {"devices": 1, "error": 2}
    assert {f.name: f.number for f in dra_v1beta1.NodeUnprepareResourceResponse.DESCRIPTOR.fields} == {"error": 1}
    assert DRA_PLUGIN_SERVICE_V1BETA1 == "v1beta1.DRAPlugin"


async def test_registration_and_a_prepare_go_over_unix_sockets(tmp_path: Path) -> None:
    class Registration(reg_grpc.RegistrationServicer):
        async def GetInfo(self, request, context):  # noqa: N802 - the proto's name
            return reg.PluginInfo(type=DRA_PLUGIN_TYPE, name="gpu.bcd.dev", endpoint=str(tmp_path / "dra.sock"), supported_versions=[DRA_PLUGIN_SERVICE])

        async def NotifyRegistrationStatus(self, request, context):  # noqa: N802
            return reg.RegistrationStatusResponse()

    class Plugin(dra_grpc.DRAPluginServicer):
        async def NodePrepareResources(self, request, context):  # noqa: N802
            return dra.NodePrepareResourcesResponse(
                claims={
                    c.uid: dra.NodePrepareResourceResponse(devices=[dra.Device(pool_name="node-1", device_name="gpu-0", cdi_device_ids=[f"bcd.dev/gpu=claim-{c.uid}"])])
                    for c in request.claims
                }
            )

    servers = []
    for servicer, add, sock in (
        (Registration(), reg_grpc.add_RegistrationServicer_to_server, tmp_path / "reg.sock"),
        (Plugin(), dra_grpc.add_DRAPluginServicer_to_server, tmp_path / "dra.sock"),
    ):
        server = grpc.aio.server()
        add(servicer, server)
        server.add_insecure_port(f"unix://{sock}")
        await server.start()
        servers.append(server)
    try:
        async with grpc.aio.insecure_channel(f"unix://{tmp_path / 'reg.sock'}") as ch:
            info = await reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest())
            await reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(reg.RegistrationStatus(plugin_registered=True))
        assert (info.type, list(info.supported_versions)) == ("DRAPlugin", ["v1.DRAPlugin"])
        async with grpc.aio.insecure_channel(f"unix://{info.endpoint}") as ch:
            answer = await dra_grpc.DRAPluginStub(ch).NodePrepareResources(
                dra.NodePrepareResourcesRequest(claims=[dra.Claim(namespace="team-a", uid="u-1", name="gpu-claim")])
            )
        assert list(answer.claims["u-1"].devices[0].cdi_device_ids) == ["bcd.dev/gpu=claim-u-1"]
    finally:
        for server in servers:
            await server.stop(None)
