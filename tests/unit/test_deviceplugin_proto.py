"""The kubelet device plugin API v1beta1 (services/device_plugin/proto): the checked-in code
is what the .proto generates today, it names the kubelet's services, messages and field
numbers, and a real gRPC client and server speak it over a unix socket."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from services.device_plugin.proto import HEALTHY, VERSION, generate
from services.device_plugin.proto import deviceplugin_v1beta1_pb2 as pb
from services.device_plugin.proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc
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


def test_the_code_speaks_the_kubelet_s_v1beta1() -> None:
    assert pb.DESCRIPTOR.package == "v1beta1" and VERSION == "v1beta1"
    plugin = pb.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert set(plugin.methods_by_name) == {"GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"}
    assert plugin.methods_by_name["ListAndWatch"].server_streaming
    assert set(pb.DESCRIPTOR.services_by_name["Registration"].methods_by_name) == {"Register"}
    # field numbers are the kubelet's (k8s.io/kubelet pkg/apis/deviceplugin/v1beta1/api.proto)
    assert {f.name: f.number for f in pb.RegisterRequest.DESCRIPTOR.fields} == {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert {f.name: f.number for f in pb.Device.DESCRIPTOR.fields} == {"ID": 1, "health": 2, "topology": 3}
    assert {f.name: f.number for f in pb.ContainerAllocateResponse.DESCRIPTOR.fields} == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    assert {f.name: f.number for f in pb.CDIDevice.DESCRIPTOR.fields} == {"name": 1}


async def test_a_registration_and_an_allocate_go_over_a_unix_socket(tmp_path: Path) -> None:
    registered: list[pb.RegisterRequest] = []

    class Kubelet(pb_grpc.RegistrationServicer):
        async def Register(self, request, context):  # noqa: N802 - the proto's name
            registered.append(request)
            return pb.Empty()

    class Plugin(pb_grpc.DevicePluginServicer):
        async def ListAndWatch(self, request, context):  # noqa: N802
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID="GPU-1", health=HEALTHY)])

        async def Allocate(self, request, context):  # noqa: N802
            return pb.AllocateResponse(
                container_responses=[
                    pb.ContainerAllocateResponse(cdi_devices=[pb.CDIDevice(name=f"bcd.dev/gpu={d}") for d in r.devices_ids])
                    for r in request.container_requests
                ]
            )

    kubelet_sock, plugin_sock = tmp_path / "kubelet.sock", tmp_path / "bcd.sock"
    servers = []
    for servicer, add, sock in ((Kubelet(), pb_grpc.add_RegistrationServicer_to_server, kubelet_sock), (Plugin(), pb_grpc.add_DevicePluginServicer_to_server, plugin_sock)):
        server = grpc.aio.server()
        add(servicer, server)
        server.add_insecure_port(f"unix://{sock}")
        await server.start()
        servers.append(server)
    try:
        async with grpc.aio.insecure_channel(f"unix://{kubelet_sock}") as ch:
            await pb_grpc.RegistrationStub(ch).Register(pb.RegisterRequest(version=VERSION, endpoint="bcd.sock", resource_name="bcd.dev/gpu"))
        assert [(r.version, r.endpoint, r.resource_name) for r in registered] == [("v1beta1", "bcd.sock", "bcd.dev/gpu")]
        async with grpc.aio.insecure_channel(f"unix://{plugin_sock}") as ch:
            stub = pb_grpc.DevicePluginStub(ch)
            first = [r async for r in stub.ListAndWatch(pb.Empty())]
            assert [(d.ID, d.health) for d in first[0].devices] == [("GPU-1", "Healthy")]
            got = await stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["GPU-1"])]))
            assert [c.name for c in got.container_responses[0].cdi_devices] == ["bcd.dev/gpu=GPU-1"]
    finally:
        for server in servers:
            await server.stop(None)
