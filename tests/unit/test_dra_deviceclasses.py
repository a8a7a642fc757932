"""deploy/kubernetes/dra-deviceclasses.yaml and the claim templates in deploy/kubernetes/examples/
ask for what the DRA plugin publishes: its driver, and attribute names and values its devices carry
(a typo there would match no device, silently)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import yaml

from services.dra_plugin import configs
from services.dra_plugin import devices as dev
from shared.schemas import Claims
from tests.converger_kit import host_inventory

FILE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "dra-deviceclasses.yaml"
EXAMPLES = FILE.parent / "examples"


def _load() -> list[dict]:
    """The DeviceClasses and the examples' claim templates (the examples' Pods are not DRA objects)."""
    docs = [d for d in yaml.safe_load_all(FILE.read_text()) if d]
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] != "Pod"]
    return docs


def _expressions(doc: dict) -> list[str]:
    out: list[str] = []

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if "expression" in x:
                out.append(x["expression"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    return out


def test_device_classes_select_attributes_the_plugin_publishes() -> None:
    docs = _load()
    assert {d["kind"] for d in docs} == {"DeviceClass", "ResourceClaimTemplate"}
    assert all(d["apiVersion"] == dev.API_VERSION for d in docs)
    inv = host_inventory()
    # card 6 as DRA finds it: MIG mode, no instance yet
    inv = msgspec.structs.replace(inv, gpus=[msgspec.structs.replace(g, mig_instances=[], gpu_instances=[]) if g.index == 6 else g for g in inv.gpus])
    pool = dev.plan_pool(inv, Claims(at=datetime.now(timezone.utc)))
    published = [d.to_api() for d in pool.devices]
    attrs = {name.split("/", 1)[1]: {str(next(iter(v.values()))) for d in published for n, v in d["attributes"].items() if n == name} for d in published for name in d["attributes"]}
    for expr in (e for d in docs for e in _expressions(d)):
        for driver in re.findall(r'device\.driver == "([^"]+)"', expr):
            assert driver == dev.DEFAULT_DRIVER
        for domain, name, value in re.findall(r'device\.attributes\["([^"]+)"\]\.(\w+) == "([^"]+)"', expr):
            assert domain == dev.ATTRIBUTE_DOMAIN
            assert name in attrs, (name, sorted(attrs))
            assert value in attrs[name], (name, value, sorted(attrs[name]))


def _opaque_configs(doc: dict) -> list[dict]:
    spec = doc["spec"] if doc["kind"] == "DeviceClass" else doc["spec"]["spec"]["devices"]
    return [c for c in spec.get("config", []) if "opaque" in c]


def test_every_opaque_config_decodes_strictly_and_names_this_driver() -> None:
    """A config with a typo would fail every prepare of its class: each one decodes with the
    plugin's own strict reader, the sharing each asks is the one its comment promises."""
    docs = _load()
    found: dict[str, tuple[str, str]] = {}
    for d in docs:
        for c in _opaque_configs(d):
            assert c["opaque"]["driver"] == dev.DEFAULT_DRIVER
            kind, sharing = configs.decode_config(c["opaque"]["parameters"])
            found[d["metadata"]["name"]] = (kind, sharing.strategy)
    assert found == {
        "mps.gpu.bcd.dev": ("GpuConfig", "MPS"),
        "timeslice.gpu.bcd.dev": ("GpuConfig", "TimeSlicing"),
        "vfio.gpu.bcd.dev": ("VfioDeviceConfig", "Vfio"),
        "mps-half": ("GpuConfig", "MPS"),
        "mig-1g-mps": ("MigDeviceConfig", "MPS"),
    }


def test_a_claim_config_overrides_its_class_config_as_the_comments_say() -> None:
    docs = {d["metadata"]["name"]: d for d in _load()}
    klass, claim = docs["mps.gpu.bcd.dev"], docs["mps-half"]
    allocation = [{"source": "FromClass", **c} for c in _opaque_configs(klass)]
    allocation += [{"source": "FromClaim", **c} for c in _opaque_configs(claim)]
    (sharing,) = configs.device_sharing(allocation, driver=dev.DEFAULT_DRIVER, results=[("gpu", "gpu")])
    assert sharing.strategy == "MPS"
    assert sharing.pinned_memory_bytes == 40 << 30


def test_capacity_requests_name_capacities_a_shared_card_publishes() -> None:
    docs = _load()
    pool = dev.plan_pool(host_inventory(), Claims(at=datetime.now(timezone.utc)), shared_cards=True)
    shared = [d.to_api() for d in pool.devices if d.to_api().get("allowMultipleAllocations")]
    assert shared, "the example host publishes shared cards"
    names = set(shared[0]["capacity"])
    asked = [
        (name, value)
        for d in docs
        if d["kind"] == "ResourceClaimTemplate"
        for r in d["spec"]["spec"]["devices"]["requests"]
        for name, value in r.get("exactly", {}).get("capacity", {}).get("requests", {}).items()
    ]
    assert asked
    for name, value in asked:
        assert name in names, (name, sorted(names))
        configs.parse_quantity(value)
