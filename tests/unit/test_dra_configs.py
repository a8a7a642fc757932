"""bcd's opaque DRA configs (services/dra_plugin/configs.py) as tables: every kind decoded with
its defaults, every refusal and its message (with the JSON path), strict decoding (unknown and
duplicate keys, apiVersion, kind, size, depth), the peers' precedence between class and claim
configs, Kubernetes quantities, the consumed capacity of a shared allocation; and a property:
any JSON value as parameters gives a ClaimSharing that msgspec accepts, or a ConfigError."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.dra_plugin.configs import (
    API_VERSION,
    PARAMETERS_MAX_BYTES,
    PARAMETERS_MAX_DEPTH,
    ConfigError,
    GpuConfig,
    GpuSharing,
    MpsConfig,
    consumed,
    decode_config,
    device_sharing,
    parse_quantity,
    strict_object_pairs,
)
from shared.schemas import ClaimSharing

DRIVER = "gpu.bcd.dev"
GPU_UUID = "GPU-12345678-1234-1234-1234-123456789abc"
MIG_UUID = "MIG-12345678-1234-1234-1234-123456789abc"
MIB = 2**20
GIB = 2**30
EXCLUSIVE = ClaimSharing()


def roundtrips(sharing: ClaimSharing) -> ClaimSharing:
    """Every ClaimSharing produced passes msgspec's own validation of the schema, both ways."""
    assert isinstance(sharing, ClaimSharing)
    assert msgspec.json.decode(msgspec.json.encode(sharing), type=ClaimSharing) == sharing
    assert msgspec.convert(msgspec.to_builtins(sharing), type=ClaimSharing) == sharing
    return sharing


def decoded(parameters) -> tuple[str, ClaimSharing]:
    kind, sharing = decode_config(parameters)
    return kind, roundtrips(sharing)


def gpu(**fields) -> dict:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", **fields}


def mig(**fields) -> dict:
    return {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", **fields}


def vfio(**fields) -> dict:
    return {"apiVersion": API_VERSION, "kind": "VfioDeviceConfig", **fields}


def mps(**mps_config) -> dict:
    return {"strategy": "MPS", "mpsConfig": mps_config}


# --------------------------------------------------------------------------- decoding with defaults

DECODED = [
    pytest.param(gpu(), "GpuConfig", EXCLUSIVE, id="gpu-no-sharing-is-exclusive"),
    pytest.param(gpu(sharing=None), "GpuConfig", EXCLUSIVE, id="gpu-null-sharing-is-exclusive"),
    pytest.param(gpu(sharing={"strategy": "TimeSlicing"}), "GpuConfig", ClaimSharing(strategy="TimeSlicing"), id="gpu-timeslicing-default-interval"),
    pytest.param(
        gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
        "GpuConfig",
        ClaimSharing(strategy="TimeSlicing", interval="Default"),
        id="gpu-timeslicing-config-without-interval",
    ),
    pytest.param(
        gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": None}}),
        "GpuConfig",
        ClaimSharing(strategy="TimeSlicing", interval="Default"),
        id="gpu-timeslicing-null-interval",
    ),
    *[
        pytest.param(
            gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": i}}),
            "GpuConfig",
            ClaimSharing(strategy="TimeSlicing", interval=i),
            id=f"gpu-timeslicing-{i}",
        )
        for i in ("Default", "Short", "Medium", "Long")
    ],
    pytest.param(gpu(sharing={"strategy": "MPS"}), "GpuConfig", ClaimSharing(strategy="MPS"), id="gpu-mps-no-config"),
    pytest.param(gpu(sharing=mps()), "GpuConfig", ClaimSharing(strategy="MPS"), id="gpu-mps-empty-config"),
    pytest.param(
        gpu(sharing=mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi")),
        "GpuConfig",
        ClaimSharing(strategy="MPS", active_thread_percentage=50, pinned_memory_bytes=10 * GIB),
        id="gpu-mps-nvidia-quickstart",
    ),
    pytest.param(
        gpu(sharing=mps(defaultActiveThreadPercentage=1)),
        "GpuConfig",
        ClaimSharing(strategy="MPS", active_thread_percentage=1),
        id="gpu-mps-percentage-1",
    ),
    pytest.param(
        gpu(sharing=mps(defaultActiveThreadPercentage=100)),
        "GpuConfig",
        ClaimSharing(strategy="MPS", active_thread_percentage=100),
        id="gpu-mps-percentage-100",
    ),
    pytest.param(
        gpu(sharing=mps(defaultPinnedDeviceMemoryLimit="1500Ki")),
        "GpuConfig",
        ClaimSharing(strategy="MPS", pinned_memory_bytes=MIB),
        id="gpu-mps-pinned-rounded-down-to-mib",
    ),
    pytest.param(
        gpu(sharing=mps(defaultPinnedDeviceMemoryLimit=3 * MIB + 1)),
        "GpuConfig",
        ClaimSharing(strategy="MPS", pinned_memory_bytes=3 * MIB),
        id="gpu-mps-pinned-as-json-number",
    ),
    pytest.param(
        gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={"0": "1Gi", "31": "2Gi", GPU_UUID: "1.5Gi"})),
        "GpuConfig",
        ClaimSharing(strategy="MPS", pinned_memory={"0": GIB, "31": 2 * GIB, GPU_UUID: 1536 * MIB}),
        id="gpu-mps-per-device-index-and-uuid",
    ),
    pytest.param(
        gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={str(i): "1Mi" for i in range(32)})),
        "GpuConfig",
        ClaimSharing(strategy="MPS", pinned_memory={str(i): MIB for i in range(32)}),
        id="gpu-mps-per-device-32-entries",
    ),
    pytest.param(
        gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit=None)), "GpuConfig", ClaimSharing(strategy="MPS"), id="gpu-mps-null-per-device"
    ),
    pytest.param(mig(), "MigDeviceConfig", EXCLUSIVE, id="mig-no-sharing-is-exclusive"),
    pytest.param(mig(sharing={"strategy": "TimeSlicing"}), "MigDeviceConfig", EXCLUSIVE, id="mig-timeslicing-changes-nothing"),
    pytest.param(mig(sharing={"strategy": "MPS"}), "MigDeviceConfig", ClaimSharing(strategy="MPS"), id="mig-mps"),
    pytest.param(
        mig(sharing=mps(defaultActiveThreadPercentage=25, defaultPerDevicePinnedMemoryLimit={MIG_UUID: "4Gi"})),
        "MigDeviceConfig",
        ClaimSharing(strategy="MPS", active_thread_percentage=25, pinned_memory={MIG_UUID: 4 * GIB}),
        id="mig-mps-limits",
    ),
    pytest.param(vfio(), "VfioDeviceConfig", ClaimSharing(strategy="Vfio"), id="vfio"),
]


@pytest.mark.parametrize(("parameters", "kind", "expected"), DECODED)
def test_decode_config(parameters, kind, expected):
    assert decoded(parameters) == (kind, expected)
    # the same parameters as raw JSON text (str and bytes) decode the same
    text = json.dumps(parameters)
    assert decoded(text) == (kind, expected)
    assert decoded(text.encode()) == (kind, expected)


def test_built_configs_encode_to_the_peers_json():
    """The Structs are the schema: what they encode is what a user writes."""
    config = GpuConfig(sharing=GpuSharing(strategy="MPS", mps_config=MpsConfig(default_active_thread_percentage=50)))
    as_json = msgspec.to_builtins(config)
    assert as_json == {
        "kind": "GpuConfig",
        "apiVersion": API_VERSION,
        "sharing": {
            "strategy": "MPS",
            "timeSlicingConfig": None,
            "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": None, "defaultPerDevicePinnedMemoryLimit": None},
        },
    }
    assert decoded(as_json) == ("GpuConfig", ClaimSharing(strategy="MPS", active_thread_percentage=50))


# --------------------------------------------------------------------------- refusals and their messages

REFUSED = [
    # what the config is
    pytest.param([], "$: parameters are a JSON object, not an array", id="not-an-object"),
    pytest.param(None, "$: parameters are a JSON object, not null", id="null"),
    pytest.param("7", "$: parameters are a JSON object, not an integer", id="raw-number"),
    pytest.param("{", "parameters are not JSON: ", id="raw-not-json"),
    pytest.param(b"\xff{}", "parameters are not JSON: ", id="raw-not-utf8"),
    pytest.param({"kind": "GpuConfig"}, "$.apiVersion: required (resource.bcd.dev/v1beta1)", id="no-apiversion"),
    pytest.param(
        {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"},
        '$.apiVersion: "resource.nvidia.com/v1beta1" is not resource.bcd.dev/v1beta1',
        id="nvidia-apiversion",
    ),
    pytest.param({"apiVersion": "resource.bcd.dev/v1", "kind": "GpuConfig"}, '$.apiVersion: "resource.bcd.dev/v1" is not', id="wrong-version"),
    pytest.param({"apiVersion": "Resource.bcd.dev/v1beta1", "kind": "GpuConfig"}, "$.apiVersion: ", id="apiversion-case-sensitive"),
    pytest.param({"apiVersion": 1, "kind": "GpuConfig"}, "$.apiVersion: 1 is not resource.bcd.dev/v1beta1", id="apiversion-not-a-string"),
    pytest.param(
        {"apiVersion": API_VERSION}, "$.kind: required (this driver knows GpuConfig, MigDeviceConfig, VfioDeviceConfig)", id="no-kind"
    ),
    pytest.param(
        {"apiVersion": API_VERSION, "kind": "ComputeDomainChannelConfig"},
        '$.kind: unknown kind "ComputeDomainChannelConfig" (this driver knows GpuConfig, MigDeviceConfig, VfioDeviceConfig)',
        id="unknown-kind",
    ),
    pytest.param({"apiVersion": API_VERSION, "kind": "gpuconfig"}, '$.kind: unknown kind "gpuconfig"', id="kind-case-sensitive"),
    pytest.param({"apiVersion": API_VERSION, "kind": ["GpuConfig"]}, "$.kind: unknown kind ['GpuConfig']", id="kind-not-a-string"),
    # unknown fields, with their path
    pytest.param(gpu(Sharing={}), "$.Sharing: unknown field (did you mean sharing?)", id="key-case-sensitive"),
    pytest.param(gpu(metadata={}), "$.metadata: unknown field", id="unknown-top-field"),
    pytest.param(
        gpu(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercantage": 5}}),
        "$.sharing.mpsConfig.defaultActiveThreadPercantage: unknown field (did you mean defaultActiveThreadPercentage?)",
        id="misspelt-field",
    ),
    pytest.param(
        gpu(sharing={"strategy": "MPS", "mps_config": {}}), "$.sharing.mps_config: unknown field (did you mean mpsConfig?)", id="snake-case"
    ),
    pytest.param(
        gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long", "slice": 3}}),
        "$.sharing.timeSlicingConfig.slice: unknown field",
        id="unknown-interval-field",
    ),
    pytest.param(
        mig(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}),
        "$.sharing.timeSlicingConfig: unknown field (MIG devices cannot be time-sliced)",
        id="mig-has-no-timeslicingconfig",
    ),
    pytest.param(vfio(iommu={"backendPolicy": "LegacyOnly"}), "$.iommu: unknown field (VfioDeviceConfig has only apiVersion and kind)", id="vfio-takes-nothing"),
    pytest.param(vfio(sharing=None), "$.sharing: unknown field (VfioDeviceConfig has only apiVersion and kind)", id="vfio-no-sharing"),
    pytest.param(gpu(**{"a b": 1}), '$["a b"]: unknown field', id="odd-key-quoted"),
    # types
    pytest.param(gpu(sharing=[]), "$.sharing: expected object, got array", id="sharing-not-object"),
    pytest.param(gpu(sharing={}), "$.sharing.strategy: required", id="no-strategy"),
    pytest.param(gpu(sharing={"strategy": 1}), "$.sharing.strategy: expected str, got int", id="strategy-not-a-string"),
    pytest.param(gpu(sharing=mps(defaultActiveThreadPercentage="50")), "$.sharing.mpsConfig.defaultActiveThreadPercentage: expected int, got str", id="percentage-string"),
    pytest.param(gpu(sharing=mps(defaultActiveThreadPercentage=50.0)), "$.sharing.mpsConfig.defaultActiveThreadPercentage: expected int, got float", id="percentage-float"),
    pytest.param(gpu(sharing=mps(defaultActiveThreadPercentage=True)), "$.sharing.mpsConfig.defaultActiveThreadPercentage: expected int, got bool", id="percentage-bool"),
    pytest.param(gpu(sharing=mps(defaultPinnedDeviceMemoryLimit=1.5)), "$.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: expected int | str, got float", id="limit-float"),
    pytest.param(gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit=[])), "$.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: expected object, got array", id="per-device-not-object"),
    # values
    pytest.param(gpu(sharing={"strategy": "Exclusive"}), '$.sharing.strategy: "Exclusive" is not a sharing strategy (TimeSlicing or MPS;', id="strategy-exclusive"),
    pytest.param(gpu(sharing={"strategy": "mps"}), '$.sharing.strategy: "mps" is not a sharing strategy', id="strategy-case-sensitive"),
    pytest.param(gpu(sharing={"strategy": ""}), '$.sharing.strategy: "" is not a sharing strategy', id="strategy-empty"),
    pytest.param(mig(sharing={"strategy": "Vfio"}), '$.sharing.strategy: "Vfio" is not a sharing strategy', id="mig-strategy-unknown"),
    pytest.param(
        gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "long"}}),
        '$.sharing.timeSlicingConfig.interval: "long" is not a time-slice interval (Default, Short, Medium, Long)',
        id="interval-unknown",
    ),
    pytest.param(
        gpu(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}), "$.sharing.mpsConfig: cannot be used with strategy TimeSlicing", id="timeslicing-with-mps"
    ),
    pytest.param(
        mig(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}), "$.sharing.mpsConfig: cannot be used with strategy TimeSlicing", id="mig-timeslicing-with-mps"
    ),
    pytest.param(
        gpu(sharing={"strategy": "MPS", "timeSlicingConfig": {}}), "$.sharing.timeSlicingConfig: cannot be used with strategy MPS", id="mps-with-timeslicing"
    ),
    pytest.param(
        gpu(sharing=mps(defaultActiveThreadPercentage=0)),
        "$.sharing.mpsConfig.defaultActiveThreadPercentage: 0 is not 1..100 (the percentage of the device's threads each client may use; 0 would leave it none)",
        id="percentage-0",
    ),
    pytest.param(gpu(sharing=mps(defaultActiveThreadPercentage=101)), "$.sharing.mpsConfig.defaultActiveThreadPercentage: 101 is not 1..100", id="percentage-101"),
    pytest.param(gpu(sharing=mps(defaultActiveThreadPercentage=-1)), "$.sharing.mpsConfig.defaultActiveThreadPercentage: -1 is not 1..100", id="percentage-negative"),
    pytest.param(
        gpu(sharing=mps(defaultPinnedDeviceMemoryLimit="1023Ki")),
        '$.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "1023Ki" is less than 1Mi (MPS takes whole MiB)',
        id="limit-below-1mi",
    ),
    pytest.param(gpu(sharing=mps(defaultPinnedDeviceMemoryLimit="0")), '$.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "0" is less than 1Mi', id="limit-0"),
    pytest.param(gpu(sharing=mps(defaultPinnedDeviceMemoryLimit="-1Gi")), '$.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "-1Gi" is negative', id="limit-negative"),
    pytest.param(gpu(sharing=mps(defaultPinnedDeviceMemoryLimit="1.5")), '$.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "1.5" is not a whole number', id="limit-fraction"),
    pytest.param(gpu(sharing=mps(defaultPinnedDeviceMemoryLimit="2Pi")), '$.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "2Pi" is more than 1125899906842624', id="limit-too-big"),
    pytest.param(gpu(sharing=mps(defaultPinnedDeviceMemoryLimit="10 Gi")), '$.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "10 Gi" is not a quantity', id="limit-not-a-quantity"),
    pytest.param(
        gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={"gpu0": "1Gi"})),
        "$.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.gpu0: the key is a device uuid (GPU-... or MIG-...) or the index of a device of the claim (0..31)",
        id="per-device-bad-key",
    ),
    pytest.param(gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={"-1": "1Gi"})), '.defaultPerDevicePinnedMemoryLimit["-1"]: the key is', id="per-device-negative-index"),
    pytest.param(gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={"01": "1Gi"})), '.defaultPerDevicePinnedMemoryLimit["01"]: the key is', id="per-device-leading-zero"),
    pytest.param(gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={"32": "1Gi"})), '.defaultPerDevicePinnedMemoryLimit["32"]: the key is', id="per-device-index-32"),
    pytest.param(gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={"GPU-1": "1Gi"})), '.defaultPerDevicePinnedMemoryLimit["GPU-1"]: the key is', id="per-device-short-uuid"),
    pytest.param(
        gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={GPU_UUID: "1Ki"})),
        f'.defaultPerDevicePinnedMemoryLimit["{GPU_UUID}"]: "1Ki" is less than 1Mi',
        id="per-device-limit-below-1mi",
    ),
    pytest.param(
        gpu(sharing=mps(defaultPerDevicePinnedMemoryLimit={str(i): "1Gi" for i in range(32)} | {GPU_UUID: "1Gi"})),
        "$.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: 33 entries, more than 32",
        id="per-device-33-entries",
    ),
    # strictness and bounds
    pytest.param('{"apiVersion": "resource.bcd.dev/v1beta1", "kind": "GpuConfig", "kind": "GpuConfig"}', "$.kind: duplicate key", id="duplicate-top-key"),
    pytest.param(
        '{"apiVersion": "resource.bcd.dev/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS", "strategy": "TimeSlicing"}}',
        "$.sharing.strategy: duplicate key",
        id="duplicate-nested-key",
    ),
    pytest.param(
        json.loads('{"apiVersion": "resource.bcd.dev/v1beta1", "kind": "VfioDeviceConfig", "a b": 1, "a b": 2}', object_pairs_hook=strict_object_pairs),
        '$["a b"]: duplicate key',
        id="duplicate-in-parsed-with-hook",
    ),
    pytest.param(gpu(pad="x" * PARAMETERS_MAX_BYTES), f"bytes, more than {PARAMETERS_MAX_BYTES} (OpaqueParametersMaxLength)", id="over-10kib"),
    pytest.param(
        json.dumps(gpu(pad="x" * PARAMETERS_MAX_BYTES)), f"bytes, more than {PARAMETERS_MAX_BYTES} (OpaqueParametersMaxLength)", id="raw-over-10kib"
    ),
    pytest.param(gpu(pad=[0] * (PARAMETERS_MAX_BYTES + 1)), f"parameters are more than {PARAMETERS_MAX_BYTES} bytes", id="over-10kib-in-nodes"),
    pytest.param(
        gpu(pad=json.loads("[" * PARAMETERS_MAX_DEPTH + "]" * PARAMETERS_MAX_DEPTH)), f"nested deeper than {PARAMETERS_MAX_DEPTH} levels", id="too-deep"
    ),
    pytest.param("[" * 6000 + "]" * 6000, f"parameters are 12000 bytes, more than {PARAMETERS_MAX_BYTES}", id="raw-deep-and-big"),
    pytest.param("[" * 2000 + "]" * 2000, f"parameters are nested 2000 levels deep, more than {PARAMETERS_MAX_DEPTH}", id="raw-too-deep"),
    pytest.param(gpu(sharing={1: 2}), "$.sharing: a key is an integer, not a string", id="non-string-key"),
    pytest.param(gpu(sharing=("MPS",)), "$.sharing: tuple is not a JSON value", id="not-json"),
]


@pytest.mark.parametrize(("parameters", "message"), REFUSED)
def test_decode_config_refuses(parameters, message):
    with pytest.raises(ConfigError) as info:
        decode_config(parameters)
    text = str(info.value)
    assert message in text
    assert "\n" not in text and len(text) <= 400


def test_at_the_bounds_is_accepted():
    # PARAMETERS_MAX_BYTES exactly, compact JSON (what the dict is measured as)
    base = gpu(pad="")
    pad = PARAMETERS_MAX_BYTES - len(json.dumps(base, separators=(",", ":")))
    with pytest.raises(ConfigError, match=r"^\$\.pad: unknown field$"):  # size is not the problem
        decode_config(gpu(pad="x" * pad))
    with pytest.raises(ConfigError, match="more than 10240"):
        decode_config(gpu(pad="x" * (pad + 1)))
    # PARAMETERS_MAX_DEPTH levels exactly
    deep = json.loads("[" * (PARAMETERS_MAX_DEPTH - 1) + "]" * (PARAMETERS_MAX_DEPTH - 1))
    with pytest.raises(ConfigError, match=r"^\$\.pad: unknown field$"):
        decode_config(gpu(pad=deep))
    with pytest.raises(ConfigError, match=r"^\$\.pad: unknown field$"):
        decode_config(json.dumps(gpu(pad=deep)))


def test_long_values_are_clipped_in_messages():
    with pytest.raises(ConfigError) as info:
        decode_config(gpu(sharing={"strategy": "x" * 5000}))
    assert len(str(info.value)) <= 400
    assert "..." in str(info.value)


def test_strict_object_pairs_marks_only_objects_with_duplicates():
    assert type(json.loads('{"a": {"b": 1}}', object_pairs_hook=strict_object_pairs)) is dict
    marked = json.loads('{"a": 1, "a": 2, "b": 0, "b": 1, "a": 3}', object_pairs_hook=strict_object_pairs)
    assert marked == {"a": 3, "b": 1} and marked.duplicates == ("a", "b")


# --------------------------------------------------------------------------- precedence


def entry(source: str, parameters, requests=None, driver: str = DRIVER) -> dict:
    out: dict = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        out["requests"] = requests
    return out


TS_LONG = gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
TS_SHORT = gpu(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}})
MPS_50 = gpu(sharing=mps(defaultActiveThreadPercentage=50))
MIG_MPS = mig(sharing=mps(defaultActiveThreadPercentage=30))
LONG = ClaimSharing(strategy="TimeSlicing", interval="Long")
SHORT = ClaimSharing(strategy="TimeSlicing", interval="Short")
MPS50 = ClaimSharing(strategy="MPS", active_thread_percentage=50)
MIGMPS = ClaimSharing(strategy="MPS", active_thread_percentage=30)
VFIO = ClaimSharing(strategy="Vfio")

PRECEDENCE = [
    pytest.param([], [("gpu", "gpu")], [EXCLUSIVE], id="no-config-exclusive"),
    pytest.param(None, [("gpu", "gpu"), ("m", "mig")], [EXCLUSIVE, EXCLUSIVE], id="config-null"),
    pytest.param([entry("FromClass", TS_LONG)], [("gpu", "gpu"), ("b", "gpu")], [LONG, LONG], id="class-config-to-all"),
    pytest.param([entry("FromClass", TS_LONG), entry("FromClaim", MPS_50)], [("gpu", "gpu")], [MPS50], id="claim-over-class"),
    pytest.param([entry("FromClaim", MPS_50), entry("FromClass", TS_LONG)], [("gpu", "gpu")], [MPS50], id="claim-over-class-whatever-order"),
    pytest.param([entry("FromClaim", TS_LONG), entry("FromClaim", TS_SHORT)], [("gpu", "gpu")], [SHORT], id="later-claim-wins"),
    pytest.param([entry("FromClass", TS_SHORT), entry("FromClass", TS_LONG)], [("gpu", "gpu")], [LONG], id="later-class-wins"),
    pytest.param(
        [entry("FromClaim", MPS_50, ["a"]), entry("FromClaim", TS_LONG)], [("a", "gpu"), ("b", "gpu")], [LONG, LONG], id="later-requestless-wins"
    ),
    pytest.param(
        [entry("FromClaim", TS_LONG), entry("FromClaim", MPS_50, ["a"])], [("a", "gpu"), ("b", "gpu")], [MPS50, LONG], id="request-specific-for-its-request"
    ),
    pytest.param(
        [entry("FromClaim", MPS_50, ["a"]), entry("FromClass", TS_LONG)], [("a", "gpu"), ("b", "gpu")], [MPS50, LONG], id="claim-request-over-class"
    ),
    pytest.param([entry("FromClaim", MPS_50, ["a", "b"])], [("a", "gpu"), ("b", "gpu"), ("c", "gpu")], [MPS50, MPS50, EXCLUSIVE], id="several-requests"),
    pytest.param([entry("FromClaim", MPS_50, ["main"])], [("main/sub", "gpu"), ("main", "gpu")], [MPS50, MPS50], id="main-matches-subrequests"),
    pytest.param([entry("FromClaim", MPS_50, ["main/a"])], [("main/a", "gpu"), ("main/b", "gpu"), ("main", "gpu")], [MPS50, EXCLUSIVE, EXCLUSIVE], id="subrequest-exact"),
    pytest.param([entry("FromClaim", MPS_50, ["mai"])], [("main/sub", "gpu"), ("main", "gpu")], [EXCLUSIVE, EXCLUSIVE], id="no-prefix-match"),
    pytest.param([entry("FromClaim", MPS_50, ["main/sub"])], [("main", "gpu")], [EXCLUSIVE], id="sub-does-not-match-main"),
    pytest.param([entry("FromClaim", MPS_50, [])], [("a", "gpu")], [MPS50], id="empty-requests-is-all"),
    pytest.param(
        [entry("FromClaim", MPS_50), entry("FromClaim", {"garbage": True}, driver="gpu.nvidia.com")], [("a", "gpu")], [MPS50], id="other-driver-skipped"
    ),
    pytest.param([entry("FromClaim", TS_LONG, driver="gpu.nvidia.com")], [("a", "gpu")], [EXCLUSIVE], id="only-other-driver"),
    pytest.param([entry("FromClass", TS_LONG)], [("gpu", "gpu"), ("m", "mig")], [LONG, EXCLUSIVE], id="requestless-gpuconfig-skips-mig"),
    pytest.param([entry("FromClass", MIG_MPS), entry("FromClass", TS_LONG)], [("gpu", "gpu"), ("m", "mig")], [LONG, MIGMPS], id="each-kind-its-requestless-config"),
    pytest.param([entry("FromClaim", MIG_MPS)], [("gpu", "gpu")], [EXCLUSIVE], id="requestless-migconfig-skips-gpu"),
    pytest.param([entry("FromClaim", MIG_MPS, ["m"]), entry("FromClaim", TS_LONG)], [("m", "mig")], [MIGMPS], id="requestless-mismatch-falls-to-earlier"),
    pytest.param([entry("FromClaim", vfio())], [("g", "gpu"), ("m", "mig")], [VFIO, EXCLUSIVE], id="requestless-vfio-skips-mig"),
    pytest.param([entry("FromClaim", vfio(), ["g"])], [("g", "gpu")], [VFIO], id="vfio-whole-gpu"),
    pytest.param([entry("FromClaim", mig(sharing={"strategy": "TimeSlicing"}), ["m"])], [("m", "mig")], [EXCLUSIVE], id="mig-timeslicing-is-exclusive"),
    pytest.param([entry("FromClaim", MPS_50)], [], [], id="no-results"),
]


@pytest.mark.parametrize(("configs", "results", "expected"), PRECEDENCE)
def test_device_sharing_precedence(configs, results, expected):
    got = device_sharing(configs, driver=DRIVER, results=results)
    assert got == expected
    for sharing in got:
        roundtrips(sharing)


PRECEDENCE_REFUSED = [
    pytest.param(
        [entry("FromClaim", TS_LONG, ["m"])],
        [("m", "mig")],
        'config[0] (FromClaim, GpuConfig): a GpuConfig cannot apply to the MIG device of request "m" (a MIG device takes MigDeviceConfig)',
        id="gpuconfig-named-for-mig",
    ),
    pytest.param(
        [entry("FromClass", TS_LONG), entry("FromClaim", MIG_MPS, ["g"])],
        [("g", "gpu")],
        'config[1] (FromClaim, MigDeviceConfig): a MigDeviceConfig cannot apply to the whole GPU of request "g" (a whole GPU takes GpuConfig or VfioDeviceConfig)',
        id="migconfig-named-for-gpu",
    ),
    pytest.param(
        [entry("FromClaim", vfio(), ["main"])],
        [("main/m", "mig")],
        'config[0] (FromClaim, VfioDeviceConfig): a VfioDeviceConfig cannot apply to the MIG device of request "main/m"',
        id="vfio-named-for-mig-subrequest",
    ),
    pytest.param([{"source": "FromElsewhere", "opaque": {"driver": DRIVER, "parameters": MPS_50}}], [("a", "gpu")], 'config[0]: invalid source "FromElsewhere" (FromClass or FromClaim)', id="invalid-source"),
    pytest.param([{"opaque": {"driver": DRIVER, "parameters": MPS_50}}], [("a", "gpu")], "config[0]: invalid source None", id="no-source"),
    pytest.param(
        [entry("FromClass", TS_LONG), {"source": "FromClaim", "requests": ["a"]}],
        [("a", "gpu")],
        "config[1] (FromClaim): only opaque parameters are supported by this driver",
        id="no-opaque",
    ),
    pytest.param([{"source": "FromClaim", "opaque": {"driver": DRIVER}}], [("a", "gpu")], "config[0] (FromClaim): opaque.parameters: required", id="no-parameters"),
    pytest.param([{"source": "FromClaim", "opaque": "x"}], [("a", "gpu")], "config[0] (FromClaim): opaque is an object, not a string", id="opaque-not-object"),
    pytest.param([entry("FromClaim", MPS_50, "a")], [("a", "gpu")], "config[0] (FromClaim): requests are a list of request names", id="requests-not-a-list"),
    pytest.param(["x"], [("a", "gpu")], "config[0]: an object, not a string", id="entry-not-object"),
    pytest.param({"source": "FromClaim"}, [("a", "gpu")], "allocation config: a list, not an object", id="config-not-a-list"),
    pytest.param(
        [entry("FromClass", TS_LONG), entry("FromClaim", gpu(sharing=mps(defaultActiveThreadPercantage=5)), ["other"])],
        [("a", "gpu")],
        "config[1] (FromClaim, GpuConfig): $.sharing.mpsConfig.defaultActiveThreadPercantage: unknown field (did you mean defaultActiveThreadPercentage?)",
        id="unused-config-still-checked",
    ),
    pytest.param(
        [entry("FromClaim", {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"})],
        [("a", "gpu")],
        'config[0] (FromClaim): $.apiVersion: "resource.nvidia.com/v1beta1" is not resource.bcd.dev/v1beta1',
        id="nvidia-config-for-our-driver",
    ),
    pytest.param(
        [entry("FromClaim", '{"apiVersion":"resource.bcd.dev/v1beta1","kind":"GpuConfig","kind":"GpuConfig"}')],
        [("a", "gpu")],
        "config[0] (FromClaim): $.kind: duplicate key",
        id="raw-parameters-duplicate",
    ),
    pytest.param(
        [entry("FromClaim", TS_SHORT), entry("FromClaim", gpu(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}))],
        [("a", "gpu")],
        "config[1] (FromClaim, GpuConfig): $.sharing.mpsConfig: cannot be used with strategy TimeSlicing",
        id="first-problem-in-order",
    ),
]


@pytest.mark.parametrize(("configs", "results", "message"), PRECEDENCE_REFUSED)
def test_device_sharing_refuses(configs, results, message):
    with pytest.raises(ConfigError) as info:
        device_sharing(configs, driver=DRIVER, results=results)
    text = str(info.value)
    assert text.startswith(message)
    assert "\n" not in text and len(text) <= 400


def test_other_drivers_configs_are_not_looked_into():
    configs = [{"source": "FromClaim", "opaque": {"driver": "gpu.nvidia.com", "parameters": "not even JSON"}, "requests": 7}]
    assert device_sharing(configs, driver=DRIVER, results=[("a", "gpu")]) == [EXCLUSIVE]
    # the driver name is this driver's, whatever it is configured to
    configs = [entry("FromClaim", MPS_50, driver="gpu.example.com")]
    assert device_sharing(configs, driver="gpu.example.com", results=[("a", "gpu")]) == [MPS50]
    assert device_sharing(configs, driver=DRIVER, results=[("a", "gpu")]) == [EXCLUSIVE]


def test_each_config_decoded_once(monkeypatch):
    from services.dra_plugin import configs as module

    calls = []
    real = module.decode_config

    def counting(parameters):
        calls.append(parameters)
        return real(parameters)

    monkeypatch.setattr(module, "decode_config", counting)
    got = module.device_sharing([entry("FromClass", TS_LONG), entry("FromClaim", MPS_50, ["a"])], driver=DRIVER, results=[("a", "gpu")] * 5 + [("b", "gpu")] * 5)
    assert got == [MPS50] * 5 + [LONG] * 5
    assert calls == [TS_LONG, MPS_50]


def test_unknown_device_kind_is_a_caller_bug():
    with pytest.raises(ValueError, match="device kind 'vgpu'"):
        device_sharing([], driver=DRIVER, results=[("a", "vgpu")])


# --------------------------------------------------------------------------- quantities

QUANTITIES = [
    pytest.param("0", 0, id="zero"),
    pytest.param("-0", 0, id="minus-zero"),
    pytest.param("+5", 5, id="plus"),
    pytest.param("1048576", MIB, id="plain"),
    pytest.param(1048576, MIB, id="json-number"),
    pytest.param("1Ki", 1024, id="Ki"),
    pytest.param("512Mi", 512 * MIB, id="Mi"),
    pytest.param("10Gi", 10 * GIB, id="Gi"),
    pytest.param("1Ti", 2**40, id="Ti"),
    pytest.param("1Pi", 2**50, id="Pi-is-the-maximum"),
    pytest.param("1.5Gi", 1536 * MIB, id="fraction-with-binary-suffix"),
    pytest.param(".5Ki", 512, id="leading-dot"),
    pytest.param("2.Ki", 2048, id="trailing-dot"),
    pytest.param("1k", 1000, id="k"),
    pytest.param("1M", 10**6, id="M"),
    pytest.param("1G", 10**9, id="G"),
    pytest.param("1T", 10**12, id="T"),
    pytest.param("1P", 10**15, id="P"),
    pytest.param("1000m", 1, id="milli-whole"),
    pytest.param("1e3", 1000, id="exponent"),
    pytest.param("1E3", 1000, id="exponent-upper"),
    pytest.param("1e+3", 1000, id="exponent-plus"),
    pytest.param("1000e-3", 1, id="exponent-negative-whole"),
    pytest.param("1.5e3", 1500, id="exponent-fraction"),
    pytest.param(str(2**50), 2**50, id="maximum-plain"),
    pytest.param("0001", 1, id="leading-zeros"),
]


@pytest.mark.parametrize(("text", "value"), QUANTITIES)
def test_parse_quantity(text, value):
    assert parse_quantity(text) == value


QUANTITIES_REFUSED = [
    pytest.param("", "is not a quantity", id="empty"),
    pytest.param("-1", "is negative", id="negative"),
    pytest.param("-1Mi", "is negative", id="negative-suffix"),
    pytest.param(-1, "-1 is negative", id="negative-number"),
    pytest.param("1.5", "is not a whole number", id="fractional-bytes"),
    pytest.param("0.1Ki", "is not a whole number", id="fractional-ki"),
    pytest.param("1500m", "is not a whole number", id="milli"),
    pytest.param("1e-3", "is not a whole number", id="small-exponent"),
    pytest.param(str(2**50 + 1), "is more than 1125899906842624", id="over-maximum"),
    pytest.param("1025Ti", "is more than", id="over-maximum-suffix"),
    pytest.param("1E", "is more than", id="exa"),
    pytest.param("1Ei", "is more than", id="exbi"),
    pytest.param("1e99", "exponent out of range", id="huge-exponent"),
    pytest.param("1e999999999", "exponent out of range", id="absurd-exponent"),
    pytest.param("1" * 65, "longer than 64 characters", id="too-long"),
    pytest.param("10 Gi", "is not a quantity", id="space"),
    pytest.param(" 10Gi", "is not a quantity", id="leading-space"),
    pytest.param("10gi", "is not a quantity", id="suffix-case"),
    pytest.param("10GiB", "is not a quantity", id="suffix-b"),
    pytest.param("10K", "is not a quantity", id="upper-k"),
    pytest.param("1e", "is not a quantity", id="bare-e"),
    pytest.param(".", "is not a quantity", id="dot"),
    pytest.param("0x10", "is not a quantity", id="hex"),
    pytest.param("1,5Gi", "is not a quantity", id="comma"),
    pytest.param("١٢", "is not a quantity", id="non-ascii-digits"),
    pytest.param(True, "not a boolean", id="bool"),
    pytest.param(1.0, "not a number", id="float"),
    pytest.param(None, "not null", id="null"),
]


@pytest.mark.parametrize(("text", "message"), QUANTITIES_REFUSED)
def test_parse_quantity_refuses(text, message):
    with pytest.raises(ConfigError, match=None) as info:
        parse_quantity(text)
    assert message in str(info.value)


def test_parse_quantity_maximum():
    assert parse_quantity("100", maximum=100) == 100
    with pytest.raises(ConfigError, match='"101" is more than 100'):
        parse_quantity("101", maximum=100)


# --------------------------------------------------------------------------- consumed capacity

SHARE = "3f2b6c1e-8a0d-4c57-9b1e-2d6f0a9c7e11"

CONSUMED = [
    pytest.param({"request": "gpu"}, ("", None, None), id="exclusive"),
    pytest.param({"shareID": None, "consumedCapacity": None}, ("", None, None), id="nulls"),
    pytest.param(
        {"shareID": SHARE, "consumedCapacity": {"gpu.bcd.dev/sharePercent": "50", "gpu.bcd.dev/memory": "8Gi"}}, (SHARE, 50, 8 * GIB), id="qualified"
    ),
    pytest.param({"shareID": SHARE, "consumedCapacity": {"sharePercent": "50", "memory": "8Gi"}}, (SHARE, 50, 8 * GIB), id="unqualified"),
    pytest.param(
        {"shareID": SHARE, "consumedCapacity": {"sharePercent": "100", "memory": "0", "slots": "1", "gpu.bcd.dev/multiprocessors": "0"}},
        (SHARE, 100, 0),
        id="other-capacities-ignored",
    ),
    pytest.param({"shareID": SHARE, "consumedCapacity": {"gpu.bcd.dev/sharePercent": "1"}}, (SHARE, 1, None), id="percent-1-no-memory"),
    pytest.param({"shareID": SHARE, "consumedCapacity": {"memory": str(2**50)}}, (SHARE, None, 2**50), id="memory-maximum"),
    pytest.param({"shareID": SHARE, "consumedCapacity": {"sharePercent": "1e2", "memory": 1024}}, (SHARE, 100, 1024), id="exponent-and-number"),
    pytest.param({"shareID": SHARE}, (SHARE, None, None), id="share-without-capacity"),
    pytest.param({"consumedCapacity": {"other.example.com/memory": "1Gi"}}, ("", None, None), id="other-domain-ignored"),
]


@pytest.mark.parametrize(("result", "expected"), CONSUMED)
def test_consumed(result, expected):
    assert consumed(result) == expected


CONSUMED_REFUSED = [
    pytest.param({"shareID": SHARE.upper()}, "shareID: ", id="uppercase-uuid"),
    pytest.param({"shareID": ""}, 'shareID: "" is not a lowercase RFC 4122 uuid', id="empty-share-id"),
    pytest.param({"shareID": SHARE + "0"}, "shareID: ", id="long-uuid"),
    pytest.param({"shareID": "{" + SHARE + "}"}, "shareID: ", id="braced-uuid"),
    pytest.param({"shareID": 7}, "shareID: 7 is not", id="share-id-not-a-string"),
    pytest.param({"consumedCapacity": []}, "consumedCapacity: an object, not an array", id="capacity-not-object"),
    pytest.param({"consumedCapacity": {"sharePercent": "0"}}, "consumedCapacity[sharePercent]: 0 is not 1..100", id="percent-0"),
    pytest.param({"consumedCapacity": {"gpu.bcd.dev/sharePercent": "101"}}, 'consumedCapacity[gpu.bcd.dev/sharePercent]: "101" is more than 100', id="percent-101"),
    pytest.param({"consumedCapacity": {"sharePercent": "50.5"}}, 'consumedCapacity[sharePercent]: "50.5" is not a whole number', id="percent-fraction"),
    pytest.param({"consumedCapacity": {"sharePercent": "500m"}}, "consumedCapacity[sharePercent]: ", id="percent-milli"),
    pytest.param({"consumedCapacity": {"memory": "-1"}}, 'consumedCapacity[memory]: "-1" is negative', id="memory-negative"),
    pytest.param({"consumedCapacity": {"memory": "2Pi"}}, 'consumedCapacity[memory]: "2Pi" is more than 1125899906842624', id="memory-too-big"),
    pytest.param({"consumedCapacity": {"memory": "8 GiB"}}, "consumedCapacity[memory]: ", id="memory-not-quantity"),
    pytest.param({"consumedCapacity": {"memory": "1Gi", "gpu.bcd.dev/memory": "1Gi"}}, "consumedCapacity: both gpu.bcd.dev/memory and memory", id="both-spellings"),
    pytest.param(["x"], "allocation result: an object, not an array", id="result-not-object"),
]


@pytest.mark.parametrize(("result", "message"), CONSUMED_REFUSED)
def test_consumed_refuses(result, message):
    with pytest.raises(ConfigError) as info:
        consumed(result)
    assert str(info.value).startswith(message)


# --------------------------------------------------------------------------- properties

JSON_LEAF = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
ANY_JSON = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=30)

# near-valid configs: the real field names and values, mixed with anything, so the checks past
# apiVersion and kind are reached too
NAMES = st.sampled_from(
    [
        "sharing",
        "strategy",
        "timeSlicingConfig",
        "interval",
        "mpsConfig",
        "defaultActiveThreadPercentage",
        "defaultPinnedDeviceMemoryLimit",
        "defaultPerDevicePinnedMemoryLimit",
        "0",
        "31",
        "32",
        GPU_UUID,
        MIG_UUID,
        "Sharing",
    ]
)
VALUES = st.sampled_from(["TimeSlicing", "MPS", "Default", "Long", "Short", "10Gi", "1.5Gi", "1Mi", "1Ki", "0", "2Pi", "-1", 0, 1, 50, 100, 101, 2**20, 2**50])
NEAR_LEAF = VALUES | JSON_LEAF
NEAR = st.recursive(NEAR_LEAF, lambda inner: st.dictionaries(NAMES | st.text(max_size=5), inner, max_size=4) | st.lists(inner, max_size=3), max_leaves=25)
def rarely(good, bad):
    """`good`, and one time in five `bad` (not `good | bad`: `|` flattens a union of unions,
    so a one_of of many leaves would drown `good`)."""
    return st.integers(0, 4).flatmap(lambda i: bad if i == 0 else good)


DEVICE_KEYS = rarely(st.sampled_from(["0", "1", "31", GPU_UUID, MIG_UUID]), st.from_regex(r"\A[0-9]{1,3}\Z") | NAMES)
QUANTITY = rarely(
    st.one_of(
        st.integers(min_value=2**20, max_value=2**50),
        st.sampled_from(["1Mi", "1.5Gi", "10Gi", "1e6", "1Pi", "1.000001Mi"]),
        st.builds(lambda n, s: f"{n}{s}", st.integers(1, 2**10), st.sampled_from(["Mi", "Gi", "M", "G"])),
    ),
    st.one_of(
        st.integers(min_value=-(2**51), max_value=2**51),
        st.sampled_from(["1023Ki", "0", "2Pi", "-1Mi", "0.5", "1e99"]),
        st.builds(lambda n, s: f"{n}{s}", st.integers(0, 2**20), st.sampled_from(["", "Ki", "k", "m", "e3", "Ei"])),
    ),
)
MPS_CONFIG = st.fixed_dictionaries(
    {},
    optional={
        "defaultActiveThreadPercentage": rarely(st.integers(-2, 102), NEAR_LEAF),
        "defaultPinnedDeviceMemoryLimit": rarely(QUANTITY, NEAR_LEAF),
        "defaultPerDevicePinnedMemoryLimit": rarely(st.dictionaries(DEVICE_KEYS, QUANTITY, max_size=4), NEAR),
    },
)
TIME_SLICING = st.fixed_dictionaries({}, optional={"interval": rarely(st.sampled_from(["Default", "Short", "Medium", "Long"]), NEAR_LEAF)})
STRATEGY = rarely(st.sampled_from(["TimeSlicing", "MPS"]), NEAR_LEAF)
GPU_SHARING = st.fixed_dictionaries(
    {"strategy": STRATEGY}, optional={"timeSlicingConfig": rarely(TIME_SLICING, NEAR), "mpsConfig": rarely(MPS_CONFIG, NEAR)}
)
MIG_SHARING = st.fixed_dictionaries({"strategy": STRATEGY}, optional={"mpsConfig": rarely(MPS_CONFIG, NEAR)})
#: our apiVersion and kinds, each with its own fields and now and then something else in a
#: field, so most examples get past the head checks (ANY_JSON and NEAR try everything else)
CONFIGS = st.one_of(
    st.fixed_dictionaries({"apiVersion": st.just(API_VERSION), "kind": st.just("GpuConfig")}, optional={"sharing": rarely(GPU_SHARING, NEAR)}),
    st.fixed_dictionaries({"apiVersion": st.just(API_VERSION), "kind": st.just("MigDeviceConfig")}, optional={"sharing": rarely(MIG_SHARING, NEAR)}),
    rarely(st.just(vfio()), st.fixed_dictionaries({"apiVersion": st.just(API_VERSION), "kind": st.just("VfioDeviceConfig"), "x": NEAR})),
)

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def outcome(parameters):
    try:
        kind, sharing = decode_config(parameters)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message and len(message) <= 400
        return None
    assert kind in ("GpuConfig", "MigDeviceConfig", "VfioDeviceConfig")
    return kind, roundtrips(sharing)


@PROPERTY
@given(st.one_of(ANY_JSON, NEAR, CONFIGS.map(lambda c: c), CONFIGS.map(lambda c: c)))
def test_any_json_decodes_to_valid_sharing_or_config_error(parameters):
    parsed = outcome(parameters)
    # the same value as raw JSON text decodes the same (compact: the size the dict is measured at)
    text = json.dumps(parameters, separators=(",", ":"), ensure_ascii=False)
    assert outcome(text) == parsed


@PROPERTY
@given(st.sampled_from(["GpuConfig", "MigDeviceConfig"]), MPS_CONFIG)
def test_mps_limits_are_whole_mib_rounded_down(kind, mps_config):
    parameters = {"apiVersion": API_VERSION, "kind": kind, "sharing": {"strategy": "MPS", "mpsConfig": mps_config}}
    got = outcome(parameters)
    if got is None:
        return
    _, sharing = got
    assert sharing.strategy == "MPS"
    assert sharing.active_thread_percentage == mps_config.get("defaultActiveThreadPercentage")
    given_limits = {"": mps_config.get("defaultPinnedDeviceMemoryLimit")} | (mps_config.get("defaultPerDevicePinnedMemoryLimit") or {})
    got_limits = {"": sharing.pinned_memory_bytes} | sharing.pinned_memory
    assert got_limits.keys() == given_limits.keys()
    for key, value in given_limits.items():
        if value is None:
            assert got_limits[key] is None
        else:
            assert got_limits[key] == parse_quantity(value) // MIB * MIB >= MIB


ALLOCATION_CONFIG = st.fixed_dictionaries(
    {
        "source": st.sampled_from(["FromClass", "FromClaim"]),
        "opaque": st.fixed_dictionaries({"driver": st.sampled_from([DRIVER, "gpu.nvidia.com"]), "parameters": CONFIGS}),
    },
    optional={"requests": st.lists(st.sampled_from(["a", "b", "a/x"]), max_size=2)},
)
RESULTS = st.lists(st.tuples(st.sampled_from(["a", "b", "a/x", "c"]), st.sampled_from(["gpu", "mig"])), max_size=4)


@PROPERTY
@given(st.lists(ALLOCATION_CONFIG, max_size=4), RESULTS)
def test_any_configs_give_one_valid_sharing_per_result_or_config_error(configs, results):
    try:
        got = device_sharing(configs, driver=DRIVER, results=results)
    except ConfigError as exc:
        assert "\n" not in str(exc) and len(str(exc)) <= 400
        return
    assert len(got) == len(results)
    for sharing, (_, device_kind) in zip(got, results, strict=True):
        roundtrips(sharing)
        # what a device gets fits it: no Vfio and no time slicing on a MIG device
        if device_kind == "mig":
            assert sharing.strategy in ("Exclusive", "MPS")


CAPACITY = st.dictionaries(
    st.sampled_from(["sharePercent", "memory", "gpu.bcd.dev/sharePercent", "gpu.bcd.dev/memory", "slots"]), QUANTITY | NEAR_LEAF, max_size=3
)
ALLOCATION_RESULT = st.fixed_dictionaries(
    {"request": st.just("gpu")}, optional={"shareID": rarely(st.just(SHARE), NEAR_LEAF), "consumedCapacity": rarely(CAPACITY, NEAR)}
)


@PROPERTY
@given(ALLOCATION_RESULT)
def test_consumed_gives_valid_values_or_config_error(result):
    try:
        share_id, percent, memory = consumed(result)
    except ConfigError:
        return
    assert share_id == "" or len(share_id) == 36
    assert percent is None or 1 <= percent <= 100
    assert memory is None or 0 <= memory <= 2**50
