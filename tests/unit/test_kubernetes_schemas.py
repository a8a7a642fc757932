"""Every Kubernetes object bcd writes or ships, read by Kubernetes' own rules for 1.34 to 1.37.

Two readers: `kubernetes-validate` (PyPI: the OpenAPI schemas Kubernetes publishes, strict, so
an unknown field fails) and the API server stand-in's port of `pkg/apis/resource/validation`
(tests/integration/kubeapi_standin.py) under each release's feature-gate defaults, the
strategy's drops first, as a stock API server of that release would take the object.

What is read: the ResourceSlices the DRA plugin publishes for every example host
(examples/hosts/*.json), as they are and with their MIG cards emptied (so MIG placements and
counter sets are published), with the plugin's defaults and with every optional feature on
(binding conditions, shared cards, taints); and every document of every manifest under
deploy/kubernetes/ (globbed: a manifest added there is read without touching this file).
"""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from pathlib import Path

import kubernetes_validate
import msgspec
import pytest
import yaml

from services.dra_plugin import devices as dev
from shared.schemas import Claims, Inventory
from tests.converger_kit import host_inventory
from tests.integration.kubeapi_claims_validation import validate_manifest
from tests.integration.kubeapi_standin import (
    GATES_BY_RELEASE,
    RELEASES,
    decode_resource_slice,
    drop_disabled_fields,
    validate_resource_slice,
)

REPO = Path(__file__).resolve().parents[2]
HOSTS = sorted((REPO / "examples" / "hosts").glob("*.json"))
MANIFESTS = sorted((REPO / "deploy" / "kubernetes").rglob("*.y*ml"))
NODE = "node-1"
NODE_UID = "0d9c1f9e-0000-4000-8000-000000000001"
FEATURES = {
    "defaults": {},
    "all-features": {"binding_conditions": True, "shared_cards": True, "device_taints": True},
}


def _without_mig_instances(inv: Inventory) -> Inventory:
    """The host as DRA finds a MIG card it may partition: MIG mode on, no instance yet."""
    return msgspec.structs.replace(
        inv, gpus=[msgspec.structs.replace(g, mig_instances=[], gpu_instances=[]) for g in inv.gpus]
    )


def published_slices(tmp_path: Path) -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = []
    claims = Claims(at=datetime(2026, 1, 1, tzinfo=timezone.utc))
    for host in HOSTS:
        inv = host_inventory(host, cdi_dir=tmp_path)
        for shape, inventory in (("as-is", inv), ("mig-empty", _without_mig_instances(inv))):
            for feature, kw in FEATURES.items():
                pool = dev.plan_pool(inventory, claims, **kw)
                for s in dev.render_slices(pool, node_name=NODE, generation=1, node_uid=NODE_UID):
                    out.append((f"{host.stem}/{shape}/{feature}/{s['metadata']['name']}", s))
    return out


def test_every_example_host_and_every_manifest_is_read() -> None:
    """The globs find what the tests below are meant to read (an empty glob passes nothing)."""
    assert {h.stem for h in HOSTS} >= {"h200x8", "one-gpu", "virtualized"}
    assert any(m.name == "dra-deviceclasses.yaml" for m in MANIFESTS)


def test_published_slices_cover_mig_counters_taints_and_shares(tmp_path: Path) -> None:
    slices = [s for _, s in published_slices(tmp_path)]
    devices = [d for s in slices for d in s["spec"].get("devices") or ()]
    assert any(s["spec"].get("sharedCounters") for s in slices)
    assert any(d.get("consumesCounters") for d in devices)
    assert any(d.get("allowMultipleAllocations") for d in devices)
    assert any(d.get("bindingConditions") for d in devices)


@pytest.mark.parametrize("release", RELEASES)
def test_published_slices_pass_kubernetes_openapi_schemas(tmp_path: Path, release: str) -> None:
    failures = []
    for name, s in published_slices(tmp_path):
        try:
            kubernetes_validate.validate(s, release, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{name}: {exc.message} at {list(exc.path)}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("release", RELEASES)
def test_published_slices_pass_the_api_server_validation(tmp_path: Path, release: str) -> None:
    failures = []
    for name, s in published_slices(tmp_path):
        obj, warnings = decode_resource_slice(copy.deepcopy(s))
        assert not warnings, (name, warnings)
        drop_disabled_fields(obj["spec"], None, GATES_BY_RELEASE[release])
        failures += [f"{name}: {e}" for e in validate_resource_slice(obj)]
    assert not failures, "\n".join(failures)


def _documents() -> list[tuple[str, dict]]:
    return [(f"{m.relative_to(REPO)}#{i}", d) for m in MANIFESTS for i, d in enumerate(yaml.safe_load_all(m.read_text())) if d]


@pytest.mark.parametrize("release", RELEASES)
def test_manifests_pass_kubernetes_openapi_schemas(release: str) -> None:
    docs = _documents()
    assert docs
    failures = []
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, release, strict=True)
        except kubernetes_validate.ValidationError as exc:
            failures.append(f"{name}: {exc.message} at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{name}: {exc.message}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("release", RELEASES)
def test_resource_manifests_pass_the_api_server_validation(release: str) -> None:
    """DeviceClasses, ResourceClaims and ResourceClaimTemplates under deploy/kubernetes, by the
    stand-in's port of their validation (the other kinds are the OpenAPI test's alone)."""
    failures = []
    for name, doc in _documents():
        failures += [f"{name}: {e}" for e in validate_manifest(doc, GATES_BY_RELEASE[release])]
    assert not failures, "\n".join(failures)


def test_kubernetes_validate_knows_every_release() -> None:
    known = {".".join(v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()}
    assert set(RELEASES) <= known, sorted(known)


def test_release_gate_defaults() -> None:
    """pkg/features' versioned specs: partitionable devices, taints, binding conditions and
    consumable capacity off in 1.34 and 1.35, on from 1.36; admin access on throughout."""
    beta_in_1_36 = ("DRAPartitionableDevices", "DRADeviceTaints", "DRADeviceBindingConditions", "DRAConsumableCapacity", "DRAExtendedResource")
    for release, on in (("1.34", False), ("1.35", False), ("1.36", True), ("1.37", True)):
        gates = GATES_BY_RELEASE[release]
        assert all(gates[g] is on for g in beta_in_1_36), (release, gates)
        assert gates["DRAAdminAccess"] and gates["DRAResourceClaimDeviceStatus"] and gates["DRAPrioritizedList"]
        assert not gates["DRAListTypeAttributes"] and not gates["DRAOptionalNodeOperations"]


CLASS = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu.bcd.dev"},
         "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.bcd.dev"'}}]}}
CLAIM = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "one-gpu", "namespace": "ml"},
         "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.bcd.dev"}}]}}}


def _with(doc: dict, path: str, value: object) -> dict:
    out = copy.deepcopy(doc)
    node: object = out
    *parents, last = path.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]  # type: ignore[index]
    node[int(last) if isinstance(node, list) else last] = value  # type: ignore[index]
    return out


R0 = "spec.devices.requests[0]"
#: (id, document, gates release, expected field paths; empty = accepted)
CLAIM_ROWS = [
    ("class fine", CLASS, "1.37", set()),
    ("class name not a subdomain", _with(CLASS, "metadata.name", "GPU_class"), "1.37", {"metadata.name"}),
    ("class selector without cel", _with(CLASS, "spec.selectors", [{}]), "1.37", {"spec.selectors[0].cel"}),
    ("class selector too long", _with(CLASS, "spec.selectors", [{"cel": {"expression": "x" * 10241}}]), "1.37", {"spec.selectors[0].cel.expression"}),
    ("class 33 selectors", _with(CLASS, "spec.selectors", CLASS["spec"]["selectors"] * 33), "1.37", {"spec.selectors"}),
    ("class config without opaque", _with(CLASS, "spec.config", [{}]), "1.37", {"spec.config[0].opaque"}),
    ("class config driver bad", _with(CLASS, "spec.config", [{"opaque": {"driver": "GPU_x", "parameters": {}}}]), "1.37", {"spec.config[0].opaque.driver"}),
    ("class extended resource name", _with(CLASS, "spec.extendedResourceName", "gpu.bcd.dev/gpu"), "1.37", set()),
    ("class extended resource name in kubernetes.io", _with(CLASS, "spec.extendedResourceName", "kubernetes.io/gpu"), "1.37", {"spec.extendedResourceName"}),
    ("class extended resource name without a domain", _with(CLASS, "spec.extendedResourceName", "gpu"), "1.37", {"spec.extendedResourceName"}),
    ("class extended resource name dropped in 1.35", _with(CLASS, "spec.extendedResourceName", "gpu"), "1.35", set()),
    ("claim fine", CLAIM, "1.37", set()),
    ("claim request name not a label", _with(CLAIM, "spec.devices.requests.0.name", "GPU"), "1.37", {f"{R0}.name"}),
    ("claim request without class", _with(CLAIM, "spec.devices.requests.0.exactly", {}), "1.37", {f"{R0}.exactly.deviceClassName"}),
    ("claim request neither exactly nor firstAvailable", _with(CLAIM, "spec.devices.requests.0", {"name": "gpu"}), "1.37", {R0}),
    # pkg/apis/resource/v1/defaults.go: ExactCount with count 0 is defaulted to count 1
    ("claim count zero", _with(CLAIM, "spec.devices.requests.0.exactly.count", 0), "1.37", set()),
    ("claim count negative", _with(CLAIM, "spec.devices.requests.0.exactly.count", -1), "1.37", {f"{R0}.exactly.count"}),
    ("claim mode empty", _with(CLAIM, "spec.devices.requests.0.exactly.allocationMode", ""), "1.37", set()),
    ("claim namespace not a label", _with(CLAIM, "metadata.namespace", "ML_team"), "1.37", {"metadata.namespace"}),
    ("claim without a namespace", _with(CLAIM, "metadata", {"name": "one-gpu"}), "1.37", set()),
    ("class with a namespace", _with(CLASS, "metadata.namespace", "ml"), "1.37", {"metadata.namespace"}),
    ("class extended resource name with requests.", _with(CLASS, "spec.extendedResourceName", "requests.gpu.bcd.dev/gpu"), "1.37", {"spec.extendedResourceName"}),
    ("class extended resource name in a kubernetes.io subdomain", _with(CLASS, "spec.extendedResourceName", "gpu.kubernetes.io/gpu"), "1.37", {"spec.extendedResourceName"}),
    ("class extended resource name two slashes", _with(CLASS, "spec.extendedResourceName", "gpu.bcd.dev/a/b"), "1.37", {"spec.extendedResourceName"}),
    # validateDeviceToleration; an empty operator is Equal (+default="Equal")
    ("claim toleration operator empty", _with(CLAIM, "spec.devices.requests.0.exactly.tolerations", [{"key": "gpu.bcd.dev/xid", "operator": "", "value": "79"}]), "1.37", set()),
    ("claim toleration Exists with a value", _with(CLAIM, "spec.devices.requests.0.exactly.tolerations", [{"key": "gpu.bcd.dev/xid", "operator": "Exists", "value": "79"}]), "1.37", {f"{R0}.exactly.tolerations[0].value"}),
    ("claim toleration operator unknown", _with(CLAIM, "spec.devices.requests.0.exactly.tolerations", [{"operator": "In"}]), "1.37", {f"{R0}.exactly.tolerations[0].operator"}),
    ("claim toleration effect None", _with(CLAIM, "spec.devices.requests.0.exactly.tolerations", [{"operator": "Exists", "effect": "None"}]), "1.37", set()),
    ("claim tolerations dropped in 1.35", _with(CLAIM, "spec.devices.requests.0.exactly.tolerations", [{"operator": "In"}]), "1.35", set()),
    # resourceclaimspec.DropDisabledFields: distinctAttribute dropped with DRAConsumableCapacity off
    ("claim distinctAttribute", _with(CLAIM, "spec.devices.constraints", [{"distinctAttribute": "gpu.bcd.dev/uuid"}]), "1.37", set()),
    ("claim distinctAttribute dropped in 1.35", _with(CLAIM, "spec.devices.constraints", [{"distinctAttribute": "gpu.bcd.dev/uuid"}]), "1.35", {"spec.devices.constraints[0].matchAttribute"}),
    ("claim constraint empty", _with(CLAIM, "spec.devices.constraints", [{}]), "1.37", {"spec.devices.constraints[0]"}),
    ("claim mode All with a count", _with(CLAIM, "spec.devices.requests.0.exactly", {"deviceClassName": "c", "allocationMode": "All", "count": 2}), "1.37", {f"{R0}.exactly.count"}),
    ("claim mode unknown", _with(CLAIM, "spec.devices.requests.0.exactly.allocationMode", "Some"), "1.37", {f"{R0}.exactly.allocationMode"}),
    ("claim duplicate requests", _with(CLAIM, "spec.devices.requests", CLAIM["spec"]["devices"]["requests"] * 2), "1.37", {"spec.devices.requests[1]"}),
    ("claim config for an unknown request", _with(CLAIM, "spec.devices.config", [{"requests": ["nic"], "opaque": {"driver": "gpu.bcd.dev", "parameters": {}}}]), "1.37", {"spec.devices.config[0].requests[0]"}),
    ("claim constraint not fully qualified", _with(CLAIM, "spec.devices.constraints", [{"matchAttribute": "numa"}]), "1.37", {"spec.devices.constraints[0].matchAttribute"}),
    ("claim toleration effect unknown", _with(CLAIM, "spec.devices.requests.0.exactly.tolerations", [{"key": "gpu.bcd.dev/xid", "operator": "Exists", "effect": "Evict"}]), "1.37", {f"{R0}.exactly.tolerations[0].effect"}),
    ("claim firstAvailable", _with(CLAIM, "spec.devices.requests.0", {"name": "gpu", "firstAvailable": [{"name": "big", "deviceClassName": "c"}, {"name": "small", "deviceClassName": "c"}]}), "1.37", set()),
]


@pytest.mark.parametrize(("doc", "release", "expected"), [r[1:] for r in CLAIM_ROWS], ids=[r[0] for r in CLAIM_ROWS])
def test_device_class_and_claim_rules(doc: dict, release: str, expected: set[str]) -> None:
    assert {e.field for e in validate_manifest(doc, GATES_BY_RELEASE[release])} == expected
