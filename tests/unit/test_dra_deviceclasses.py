"""deploy/kubernetes/dra-deviceclasses.yaml asks for what the DRA plugin publishes: its driver,
and attribute names and values its devices carry (a typo there would match no device, silently)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import yaml

from services.dra_plugin import devices as dev
from shared.schemas import Claims
from tests.converger_kit import host_inventory

FILE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "dra-deviceclasses.yaml"


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
    docs = [d for d in yaml.safe_load_all(FILE.read_text()) if d]
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
