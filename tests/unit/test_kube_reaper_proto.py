"""The checked-in pod-resources code is what the .proto generates today (`make proto` regenerates it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.kube_reaper.proto import generate
from shared.protogen import normalised

REPO = Path(__file__).resolve().parents[2]

def test_checked_in_code_matches_a_fresh_generation(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the `test` extra) is not installed; cannot regenerate")
    fresh = generate.generate(tmp_path)
    for path in fresh:
        checked_in = generate.HERE / path.name
        assert checked_in.exists(), f"{checked_in.relative_to(REPO)} is missing; run `make proto`"
        assert normalised(checked_in.read_text()) == normalised(path.read_text()), (
            f"{checked_in.relative_to(REPO)} is stale: run `make proto` and check the result in"
        )


def test_normalising_keeps_the_code_and_drops_only_version_stamps():
    text = (generate.HERE / "podresources_v1_pb2.py").read_text()
    assert normalised(text) != text
    assert "ValidateProtobufRuntimeVersion(\n    _runtime_version.Domain.PUBLIC,\n<protobuf>\n    ''," in normalised(text)
    assert "PodResourcesLister" in normalised(text)


def test_the_generated_code_imports_as_a_package_and_speaks_v1():
    from services.kube_reaper.proto import podresources_v1_pb2 as pb
    from services.kube_reaper.proto import podresources_v1_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.package == "v1"
    service = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.methods_by_name["List"].input_type.name == "ListPodResourcesRequest"
    # field numbers are the kubelet's (k8s.io/kubelet pkg/apis/podresources/v1/api.proto)
    numbers = {f.name: f.number for f in pb.ContainerResources.DESCRIPTOR.fields}
    assert numbers == {"name": 1, "devices": 2, "cpu_ids": 3, "memory": 4, "dynamic_resources": 5}
    assert {f.name: f.number for f in pb.ContainerDevices.DESCRIPTOR.fields} == {"resource_name": 1, "device_ids": 2, "topology": 3}
    assert {f.name: f.number for f in pb.PodResources.DESCRIPTOR.fields} == {"name": 1, "namespace": 2, "containers": 3}
    assert {f.name: f.number for f in pb.ClaimResource.DESCRIPTOR.fields} == {
        "cdi_devices": 1,
        "driver_name": 2,
        "pool_name": 3,
        "device_name": 4,
    }
    assert hasattr(pb_grpc, "PodResourcesListerStub") and hasattr(pb_grpc, "add_PodResourcesListerServicer_to_server")
