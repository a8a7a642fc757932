"""MIG layouts: the adapters' `apply_mig_layout` as one contract (fakehw over the host file, nvidia over a
fake NVML that models MIG changes), and the converger's pure rules (`gpuops.plan_mig_layouts`)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from services.converger import gpuops
from services.converger.model import MigLayoutRecord
from services.inventory.adapters.base import MigPartitioner
from services.inventory.adapters.fakehost import gpu_instances_of, load_host_file
from services.inventory.adapters.fakehw import FakeHwAdapter
from services.inventory.adapters.nvidia import NvidiaAdapter
from services.inventory.adapters.nvidia_nvml import NvmlError, NvmlGpuInstance, NvmlMigDevice
from services.inventory.build import build_inventory
from shared.schemas import GpuClaim
from tests.unit.test_inventory_adapters import H200, FakeNvml, materialize

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
CARD = "0000:db:00.0"  # the example's MIG card with 3g.71gb + 3 x 1g.18gb


class MigNvml(FakeNvml):
    """FakeNvml whose MIG state changes as NVML's does: instances destroyed and created (at a placement
    too), MIG mode set.

    Faults as the fake host file's: `fault` "fail" (the last compute instance of a layout fails),
    "fail-rollback" (every create fails from then on), "needs-reset" (a mode change is pending); and
    its MIG instance faults, each once: "gi-fail" (a GPU instance at a placement fails), "ci-fail" (a
    compute instance fails, its GPU instance stays), "destroy-in-use" (a destroy answers IN_USE)."""

    def __init__(self, host: Any, fault: str = "") -> None:
        super().__init__(host)
        self.fault = fault
        self.state: dict[int, dict[str, Any]] = {}
        self.creating = 0

    def _mig(self, index: int) -> dict[str, Any]:
        if index not in self.state:
            card = self._card(index)
            gis, starts = {}, {}
            for g in gpu_instances_of(card).values():
                gis[g.gi], starts[g.gi] = self._gi_profile(card, g.profile), g.start
            self.state[index] = {"mode": bool(card.mig_mode), "gis": gis, "starts": starts, "cis": {(m.gi, m.ci): m.uuid for m in card.mig_instances}}
        return self.state[index]

    def _fires(self, fault: str) -> bool:
        if self.fault != fault:
            return False
        self.fault = ""
        return True

    def device_mig_mode(self, index: int) -> bool:
        return bool(self._mig(index)["mode"])

    def gpu_instances(self, index: int) -> list[NvmlGpuInstance]:
        st = self._mig(index)
        return [
            NvmlGpuInstance(gi_id=gi, profile_id=p.profile_id, start=st["starts"].get(gi), size=p.size if st["starts"].get(gi) is not None else None)
            for gi, p in sorted(st["gis"].items())
        ]

    def create_gpu_instance_with_placement(self, index: int, profile_id: int, start: int, size: int) -> int:
        st = self._mig(index)
        if not st["mode"]:
            raise NvmlError("Not Supported", 3)
        profile = next((p for p in self._card(index).mig_profiles if p.profile_id == profile_id), None)
        if profile is None or start not in profile.placements or size != profile.size:
            raise NvmlError("Invalid Argument", 2)
        for gi, other in st["gis"].items():
            at = st["starts"].get(gi)
            if at is not None and at < start + size and start < at + other.size:
                raise NvmlError("Insufficient Resources", 23)
        if self._fires("gi-fail"):
            raise NvmlError("Unknown Error", 999)
        gi = next(k for k in range(1, len(st["gis"]) + 2) if k not in st["gis"])
        st["gis"][gi], st["starts"][gi] = profile, start
        return gi

    def mig_devices(self, index: int) -> list[NvmlMigDevice]:
        st = self._mig(index)
        return [
            NvmlMigDevice(
                index=k, gi_id=gi, ci_id=ci, uuid=uuid, memory_bytes=st["gis"][gi].memory_bytes,
                gi_slice_count=st["gis"][gi].slices, ci_slice_count=st["gis"][gi].slices,
            )
            for k, ((gi, ci), uuid) in enumerate(sorted(st["cis"].items()))
        ]

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        st = self._mig(index)
        if self.fault == "needs-reset" and st["mode"] != enabled:
            self.fault = ""
            return True
        if not enabled and st["gis"]:
            raise NvmlError("In use by another client", 19)
        st["mode"] = enabled
        return False

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        st = self._mig(index)
        if gi_id not in st["gis"] or (gi_id, ci_id) not in st["cis"]:
            raise NvmlError("Not Found", 6)
        if self._fires("destroy-in-use"):
            raise NvmlError("In use by another client", 19)
        del st["cis"][(gi_id, ci_id)]

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        st = self._mig(index)
        if gi_id not in st["gis"]:
            raise NvmlError("Not Found", 6)
        if self._fires("destroy-in-use") or any(gi == gi_id for gi, _ in st["cis"]):
            raise NvmlError("In use by another client", 19)
        del st["gis"][gi_id]
        st["starts"].pop(gi_id, None)

    def create_gpu_instance(self, index: int, profile_id: int) -> int:
        st = self._mig(index)
        if not st["mode"]:
            raise NvmlError("Not Supported", 3)
        if self.fault == "fail-rollback" and self.creating:
            raise NvmlError("Insufficient Resources", 23)
        profile = next(p for p in self._card(index).mig_profiles if p.profile_id == profile_id)
        # NVML places it itself: here at the highest placement nothing overlaps
        taken = [(st["starts"][g], p.size) for g, p in st["gis"].items() if st["starts"].get(g) is not None]
        free = [s for s in profile.placements if all(s + profile.size <= a or a + n <= s for a, n in taken)]
        if profile.placements and not free:
            raise NvmlError("Insufficient Resources", 23)
        gi = max(st["gis"], default=0) + 1
        st["gis"][gi], st["starts"][gi] = profile, max(free, default=None)
        return gi

    def create_compute_instance(self, index: int, gi_id: int) -> int:
        self.creating += 1
        if self.fault in ("fail", "fail-rollback") and self.creating == 2:
            if self.fault == "fail":
                self.fault = ""
            raise NvmlError("Insufficient Resources", 23)
        st = self._mig(index)
        if gi_id not in st["gis"]:
            raise NvmlError("Not Found", 6)
        if self._fires("ci-fail"):
            raise NvmlError("Insufficient Resources", 23)
        st["cis"][(gi_id, 0)] = f"MIG-fake-{index}-{gi_id}-0"
        return 0


def adapters(tmp_path: Path, fault: str) -> dict[str, Any]:
    data = json.loads(H200.read_text())
    data["mps_pipe_dir"] = str(tmp_path / "mps")
    if fault:
        next(g for g in data["gpus"] if g["pci_address"] == CARD)["faults"] = {"mig": fault}
    host_file = tmp_path / "host.json"
    host_file.write_text(json.dumps(data))
    host = load_host_file(host_file)
    roots = materialize(host, tmp_path / "root")
    nvidia = NvidiaAdapter(
        nvml=MigNvml(host, fault), sysfs_root=roots.sysfs, proc_root=roots.proc, cdi_dir=tmp_path / "cdi",
        known_uuids={g.pci_address: g.uuid for g in host.gpus},
    )
    return {"fakehw": FakeHwAdapter(host_file, cdi_dir=tmp_path / "cdi"), "nvidia": nvidia}


def layout_of(adapter: Any) -> tuple[bool, list[str]]:
    inv = build_inventory(adapter, node_id="node-1", revision=1, now=NOW)
    card = next(g for g in inv.gpus if g.pci_address == CARD)
    return card.mig_mode, sorted(m.profile for m in card.mig_instances)


@pytest.mark.parametrize("kind", ["fakehw", "nvidia"])
@pytest.mark.parametrize(
    ("fault", "profiles", "disable", "outcome", "left", "after"),
    [
        ("", ["1g.18gb", "1g.18gb"], False, "Applied", "", (True, ["1g.18gb", "1g.18gb"])),
        ("", [], True, "Applied", "", (False, [])),
        ("", ["9g.999gb"], False, "Failed", "as before", (True, ["1g.18gb", "1g.18gb", "1g.18gb", "3g.71gb"])),
        ("fail", ["3g.71gb", "3g.71gb"], False, "Failed", "rolled back", (True, ["1g.18gb", "1g.18gb", "1g.18gb", "3g.71gb"])),
        ("fail-rollback", ["3g.71gb", "3g.71gb"], False, "Failed", "all-disabled", (False, [])),
        ("needs-reset", [], True, "DisruptionRequired", None, None),
    ],
    ids=["two-instances", "all-disabled", "unknown-profile", "rolled-back", "rollback-fails", "needs-reset"],
)
def test_apply_mig_layout_is_one_contract(tmp_path, kind, fault, profiles, disable, outcome, left, after):
    adapter = adapters(tmp_path, fault)[kind]
    assert isinstance(adapter, MigPartitioner)
    layout_of(adapter)  # a scan first, as the inventory has always done one
    result = adapter.apply_mig_layout(CARD, profiles, disable=disable)
    assert result.outcome == outcome, result.message
    if left is not None:
        assert result.left == left, result.message
    if after is not None:
        assert layout_of(adapter) == after


def test_a_card_without_mig_is_not_supported_by_either(tmp_path):
    for kind, adapter in adapters(tmp_path, "").items():
        layout_of(adapter)
        result = adapter.apply_mig_layout("0000:18:00.0", ["1g.18gb"], disable=False)
        assert result.outcome in ("NotSupported", "Failed") and result.left == "as before", (kind, result)


# --------------------------------------------------------------------------- the converger's rules


def rec(layout: str, state: str = "Pending", **kw: Any) -> MigLayoutRecord:
    return MigLayoutRecord(layout=layout, state=state, since=NOW, **kw)


@pytest.fixture(scope="module")
def gpus() -> dict[str, Any]:
    from tests.converger_kit import host_inventory

    return {g.pci_address: g for g in host_inventory().gpus}


def test_plan_mig_layouts(gpus):
    # the MIG card whose instances each span their GPU instance (a layout names GPU instance profiles)
    mig = next(p for p, g in gpus.items() if g.mig_mode and all("c." not in m.profile for m in g.mig_instances))
    plain = next(p for p, g in gpus.items() if not g.mig_profiles)
    held = GpuClaim(pci_address=mig, kind="allocation", holder="a1")
    profiles = sorted(m.profile for m in gpus[mig].mig_instances)
    base = {mig: rec("1g.18gb")}
    assert gpuops.plan_mig_layouts({}, gpus, [], {}, boot_id="b") == {}  # nothing to do
    assert gpuops.plan_mig_layouts(base, gpus, [], {}, boot_id="b")[mig][0] in ("start", "Failed")
    assert gpuops.plan_mig_layouts(base, gpus, [held], {}, boot_id="b")[mig] == ("Pending", f"waits: {mig} is held by a1")
    assert gpuops.plan_mig_layouts({mig: rec(",".join(profiles), "Applying")}, gpus, [], {}, boot_id="b")[mig] == ("Applied", "")
    assert gpuops.plan_mig_layouts({mig: rec("1g.18gb", "Failed", message="x")}, gpus, [], {}, boot_id="b")[mig] == ("Failed", "x")
    blocked = {mig: rec("1g.18gb", blocked_boot="b", message="waits for a reset")}
    assert gpuops.plan_mig_layouts(blocked, gpus, [], {}, boot_id="b")[mig] == ("Pending", "waits for a reset")
    assert gpuops.plan_mig_layouts(blocked, gpus, [], {}, boot_id="c")[mig][0] != "Pending"
    assert gpuops.plan_mig_layouts({plain: rec("1g.18gb")}, gpus, [], {}, boot_id="b")[plain] == ("Failed", f"{plain} supports no MIG profiles")
    assert gpuops.plan_mig_layouts({plain: rec("all-disabled")}, gpus, [], {}, boot_id="b")[plain] == ("Applied", "")
    assert gpuops.plan_mig_layouts({"0000:99:00.0": rec("1g.18gb")}, gpus, [], {}, boot_id="b")["0000:99:00.0"][0] == "Pending"


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("all-disabled", ((), True)), ("1g.18gb", (("1g.18gb",), False)), (" 1g.18gb , 3g.71gb ", (("1g.18gb", "3g.71gb"), False)), ("1g.18gb+me", (("1g.18gb+me",), False))],
)
def test_layouts_parse(text, parsed):
    assert gpuops.parse_layout(text) == parsed


@pytest.mark.parametrize("text", ["", "x", "1g.18gb,,1g.18gb", "all-disabled,1g.18gb", ",".join(["1g.18gb"] * 8), "1c.3g.71gb"])
def test_bad_layouts_are_refused(text):
    with pytest.raises(ValueError):
        gpuops.parse_layout(text)
