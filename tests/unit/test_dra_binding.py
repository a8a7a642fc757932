"""Binding conditions (services/dra_plugin/binding.py): which allocated devices get Ready, which
BindingFailed, and which are left alone, as a table with a "nothing to do" row."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from services.dra_plugin.binding import FAILED, READY, plan_binding
from services.dra_plugin.devices import Pool, PublishedDevice

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
DRIVER, POOL = "gpu.bcd.dev", "node-1"
PUBLISHED = Pool(devices=(PublishedDevice(name="gpu-0", pci="0000:18:00.0", uuid="GPU-0", index=0, kind="gpu"),))


def claim(*results: tuple[str, str, str], devices: list[dict] | None = None) -> dict:
    c: dict = {
        "metadata": {"name": "c", "namespace": "ml", "generation": 2, "resourceVersion": "7"},
        "status": {"allocation": {"devices": {"results": [{"request": "gpu", "driver": d, "pool": p, "device": n} for d, p, n in results]}}},
    }
    if devices is not None:
        c["status"]["devices"] = devices
    return c


def cond(t: str) -> dict:
    return {"type": t, "status": "True", "reason": "x", "message": "", "lastTransitionTime": "2026-12-01T11:00:00Z"}


ROWS = [
    ("a published device: Ready", claim((DRIVER, POOL, "gpu-0")), {"gpu-0": READY}),
    ("a device no longer published: BindingFailed", claim((DRIVER, POOL, "gpu-3")), {"gpu-3": FAILED}),
    ("nothing to do: already Ready", claim((DRIVER, POOL, "gpu-0"), devices=[{"driver": DRIVER, "pool": POOL, "device": "gpu-0", "conditions": [cond(READY)]}]), None),
    ("nothing to do: already failed", claim((DRIVER, POOL, "gpu-3"), devices=[{"driver": DRIVER, "pool": POOL, "device": "gpu-3", "conditions": [cond(FAILED)]}]), None),
    ("nothing to do: another driver's device", claim(("other.dev", POOL, "gpu-0")), None),
    ("nothing to do: another node's pool", claim((DRIVER, "node-2", "gpu-0")), None),
    ("nothing to do: not allocated", {"metadata": {"name": "c", "namespace": "ml"}, "status": {}}, None),
    ("only ours of a mixed claim", claim((DRIVER, POOL, "gpu-0"), ("other.dev", "p", "nic-0")), {"gpu-0": READY}),
]


@pytest.mark.parametrize(("obj", "want"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_plan_binding(obj: dict, want: dict | None) -> None:
    got = plan_binding([obj], driver=DRIVER, pool_name=POOL, pool=PUBLISHED, now=NOW)
    if want is None:
        assert got == []
        return
    assert len(got) == 1 and dict(got[0].set) == want
    body = got[0].body
    assert body["metadata"]["resourceVersion"] == "7"  # the PUT is conditional
    entries = {d["device"]: d for d in body["status"]["devices"]}
    for device, type_ in want.items():
        c = entries[device]["conditions"][-1]
        assert (c["type"], c["status"], c["observedGeneration"]) == (type_, "True", 2)
    assert obj.get("status", {}).get("devices") in (None, [])  # the input is not changed
