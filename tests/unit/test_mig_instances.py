"""MIG instances made one step at a time at a placement (DRA): the adapters' `MigInstancer` as one
contract (fakehw over a host file, nvidia over a fake NVML that models placements), the NVML
bindings' placement calls against a stand-in for the library, and the inventory's `mig_instance`
endpoint on a real node bus.

The card is the example's 0000:db:00.0: a 3g.71gb GPU instance at 4 (memory slices 4-7) and
three 1g.18gb ones at 0, 1 and 2, so slice 3 is the one free place.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pynvml
import pytest

from services.inventory.adapters.base import MigCapable, MigInstancer, MigStepError
from services.inventory.adapters.fakehost import HostFileError, load_host_file
from services.inventory.adapters.fakehw import FakeHwAdapter
from services.inventory.adapters.nvidia import NvidiaAdapter
from services.inventory.adapters.nvidia_nvml import PynvmlNvml
from services.inventory.build import build_inventory, mig_atom_id
from shared.runtime import call
from shared.schemas import INVENTORY_CODEC, MIG_INSTANCE_REPLY_CODEC, Empty, Gpu, GpuInstance, Inventory, MigInstanceRequest, MigPlacement
from shared.subjects import NodeSubjects
from tests.unit.test_inventory_adapters import H200, materialize
from tests.unit.test_mig_layouts import MigNvml

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
CARD = "0000:db:00.0"
CARD_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000008"
PLAIN = "0000:18:00.0"  # a card not in MIG mode
KINDS = ["fakehw", "nvidia"]
#: the card's GPU instances as the example has them: (gi, profile, start, size, compute instances)
EXAMPLE_GIS = [(2, "3g.71gb", 4, 4, 1), (9, "1g.18gb", 0, 1, 1), (10, "1g.18gb", 1, 1, 1), (11, "1g.18gb", 2, 1, 1)]


class Rig:
    """One adapter over a copy of the example host, with a fault and extra host processes."""

    def __init__(self, kind: str, tmp_path: Path, *, fault: str = "", processes: list[dict[str, Any]] | None = None) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        data = json.loads(H200.read_text())
        data["mps_pipe_dir"] = str(tmp_path / "mps")
        data["processes"] += processes or []
        card = next(g for g in data["gpus"] if g["pci_address"] == CARD)
        if fault and kind == "fakehw":
            card["faults"] = {"mig_instance": fault}
        self.host_file = tmp_path / "host.json"
        self.host_file.write_text(json.dumps(data))
        host = load_host_file(self.host_file)
        self.adapter: Any
        if kind == "fakehw":
            self.adapter = FakeHwAdapter(self.host_file, cdi_dir=tmp_path / "cdi")
        else:
            roots = materialize(host, tmp_path / "root")
            self.adapter = NvidiaAdapter(
                nvml=MigNvml(host, fault), sysfs_root=roots.sysfs, proc_root=roots.proc, cdi_dir=tmp_path / "cdi",
                known_uuids={g.pci_address: g.uuid for g in host.gpus},
            )
        self.scan()  # the inventory always scans before it takes a request

    def scan(self) -> Inventory:
        return build_inventory(self.adapter, node_id="node-1", revision=1, now=NOW)

    def card(self) -> Gpu:
        return next(g for g in self.scan().gpus if g.pci_address == CARD)

    def gis(self) -> list[tuple[int, str, int | None, int | None, int]]:
        return [
            (g.gi, g.profile, g.placement.start if g.placement else None, g.placement.size if g.placement else None, g.compute_instances)
            for g in self.card().gpu_instances
        ]

    def refused(self, outcome: str, fn: Any, *args: Any) -> str:
        with pytest.raises(MigStepError) as caught:
            fn(*args)
        assert caught.value.outcome == outcome, str(caught.value)
        return str(caught.value)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_both_adapters_make_mig_instances(tmp_path: Path, kind: str) -> None:
    adapter = Rig(kind, tmp_path).adapter
    assert isinstance(adapter, MigInstancer) and isinstance(adapter, MigCapable)


def test_placements_engine_counts_and_gpu_instances_are_listed(tmp_path: Path, kind: str) -> None:
    card = Rig(kind, tmp_path).card()
    profiles = {p.name: p for p in card.mig_profiles}
    assert [(p.start, p.size) for p in profiles["1g.18gb"].placements] == [(s, 1) for s in range(7)]
    assert [(p.start, p.size) for p in profiles["3g.71gb"].placements] == [(0, 4), (4, 4)]
    assert [(p.start, p.size) for p in profiles["7g.141gb"].placements] == [(0, 8)]
    seven = profiles["7g.141gb"]
    assert (seven.multiprocessors, seven.copy_engines, seven.decoders, seven.encoders, seven.jpeg_engines, seven.ofa_engines) == (132, 8, 7, 0, 7, 1)
    assert profiles["1g.18gb+me"].ofa_engines == 1 and profiles["1g.18gb"].ofa_engines == 0
    assert [(g.gi, g.profile, g.profile_id, g.placement, g.compute_instances) for g in card.gpu_instances] == [
        (gi, name, 9 if name == "3g.71gb" else 19, MigPlacement(start=start, size=size), cis) for gi, name, start, size, cis in EXAMPLE_GIS
    ]
    assert {m.gi: m.placement for m in card.mig_instances} == {gi: MigPlacement(start=s, size=n) for gi, _, s, n, _ in EXAMPLE_GIS}


def test_a_card_not_in_mig_mode_lists_no_gpu_instances(tmp_path: Path, kind: str) -> None:
    inv = Rig(kind, tmp_path).scan()
    plain = next(g for g in inv.gpus if g.pci_address == PLAIN)
    assert not plain.mig_mode and plain.gpu_instances == []


def test_a_gpu_instance_at_a_placement_is_listed_with_no_compute_instance(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path)
    gi = rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3)
    assert gi not in {g for g, *_ in EXAMPLE_GIS}
    assert (gi, "1g.18gb", 3, 1, 0) in rig.gis()
    # a GPU instance with no compute instance is no atom
    assert not any(a.id.startswith(f"{CARD_UUID}/gi{gi}/") for a in rig.scan().atoms)


def test_a_compute_instance_makes_a_mig_instance_with_uuid_and_placement(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path)
    gi = rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3)
    made = rig.adapter.create_compute_instance(CARD, gi)
    assert (made.gi, made.profile, made.start, made.size) == (gi, "1g.18gb", 3, 1)
    assert made.uuid.startswith("MIG-") and made.memory_bytes == 18790481920
    inv = rig.scan()
    atom = mig_atom_id(CARD_UUID, gi, made.ci)
    assert atom in {a.id for a in inv.atoms}
    card = next(g for g in inv.gpus if g.pci_address == CARD)
    mig = next(m for m in card.mig_instances if m.atom_id == atom)
    assert (mig.uuid, mig.profile, mig.placement) == (made.uuid, "1g.18gb", MigPlacement(start=3, size=1))
    assert (gi, "1g.18gb", 3, 1, 1) in rig.gis()
    # one compute instance spans the whole GPU instance: a second does not fit
    rig.refused("refused", rig.adapter.create_compute_instance, CARD, gi)


@pytest.mark.parametrize(
    ("profile", "start", "why"),
    [
        ("1g.18gb", 4, "overlaps GPU instance 2"),
        ("3g.71gb", 0, "overlaps GPU instance 9"),
        ("2g.35gb", 3, "no placement at 3"),
        ("1g.18gb", 7, "no placement at 7"),
        ("9g.999gb", 0, "no MIG profile 9g.999gb"),
        ("4g.71gb", 0, "overlaps"),
    ],
    ids=["inside-3g", "over-1gs", "not-a-2g-start", "past-the-1g-starts", "unknown-profile", "4g-over-1gs"],
)
def test_a_placement_that_is_taken_or_not_the_profiles_is_refused(tmp_path: Path, kind: str, profile: str, start: int, why: str) -> None:
    rig = Rig(kind, tmp_path)
    assert why in rig.refused("refused", rig.adapter.create_gpu_instance, CARD, profile, start)
    assert rig.gis() == EXAMPLE_GIS


def test_a_card_not_in_mig_mode_or_not_there_is_refused(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path)
    assert "not in MIG mode" in rig.refused("refused", rig.adapter.create_gpu_instance, PLAIN, "1g.18gb", 0)
    rig.refused("refused", rig.adapter.create_gpu_instance, "0000:99:00.0", "1g.18gb", 0)
    rig.refused("refused", rig.adapter.create_compute_instance, PLAIN, 1)


def test_destroy_the_compute_instance_then_the_gpu_instance(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path)
    gi = rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3)
    made = rig.adapter.create_compute_instance(CARD, gi)
    # the GPU instance cannot go while its compute instance is there
    rig.refused("in-use", rig.adapter.destroy_gpu_instance, CARD, gi)
    rig.adapter.destroy_compute_instance(CARD, gi, made.ci)
    assert (gi, "1g.18gb", 3, 1, 0) in rig.gis()
    rig.adapter.destroy_gpu_instance(CARD, gi)
    assert rig.gis() == EXAMPLE_GIS
    # an example instance the same way: its GPU instance outlives its compute instance
    rig.adapter.destroy_compute_instance(CARD, 9, 0)
    assert (9, "1g.18gb", 0, 1, 0) in rig.gis()
    assert f"{CARD_UUID}/gi9/ci0" not in {a.id for a in rig.scan().atoms}
    rig.adapter.destroy_gpu_instance(CARD, 9)
    assert [g for g, *_ in rig.gis()] == [2, 10, 11]
    # the place it left is free again
    assert rig.adapter.create_gpu_instance(CARD, "1g.18gb", 0) not in (2, 10, 11)


def test_destroying_what_is_gone_is_not_found(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path)
    rig.refused("not-found", rig.adapter.destroy_compute_instance, CARD, 9, 5)
    rig.refused("not-found", rig.adapter.destroy_compute_instance, CARD, 42, 0)
    rig.refused("not-found", rig.adapter.destroy_gpu_instance, CARD, 42)
    rig.refused("not-found", rig.adapter.create_compute_instance, CARD, 42)
    rig.refused("not-found", rig.adapter.destroy_gpu_instance, PLAIN, 1)  # no MIG mode: nothing to destroy
    gi = rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3)
    rig.adapter.destroy_gpu_instance(CARD, gi)
    rig.refused("not-found", rig.adapter.destroy_gpu_instance, CARD, gi)
    assert rig.gis() == EXAMPLE_GIS


def test_a_process_on_a_mig_device_makes_its_destroy_in_use(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path, processes=[{"pid": 4242, "gpu_uuid": CARD_UUID, "gi": 10, "ci": 0}])
    assert "process 4242" in rig.refused("in-use", rig.adapter.destroy_compute_instance, CARD, 10, 0)
    rig.adapter.destroy_compute_instance(CARD, 9, 0)  # another MIG device of the card is free to go
    assert [(g, cis) for g, _, _, _, cis in rig.gis()] == [(2, 1), (9, 0), (10, 1), (11, 1)]


def test_the_destroy_in_use_fault_answers_in_use_once(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path, fault="destroy-in-use")
    rig.refused("in-use", rig.adapter.destroy_compute_instance, CARD, 9, 0)
    rig.adapter.destroy_compute_instance(CARD, 9, 0)
    rig.adapter.destroy_gpu_instance(CARD, 9)
    assert [g for g, *_ in rig.gis()] == [2, 10, 11]


def test_a_failed_compute_instance_leaves_its_gpu_instance_listed_and_destroyable(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path, fault="ci-fail")
    gi = rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3)
    rig.refused("failed", rig.adapter.create_compute_instance, CARD, gi)
    assert (gi, "1g.18gb", 3, 1, 0) in rig.gis()
    assert not any(m.gi == gi for m in rig.card().mig_instances)
    rig.adapter.destroy_gpu_instance(CARD, gi)
    assert rig.gis() == EXAMPLE_GIS


def test_a_failed_gpu_instance_leaves_nothing(tmp_path: Path, kind: str) -> None:
    rig = Rig(kind, tmp_path, fault="gi-fail")
    rig.refused("failed", rig.adapter.create_gpu_instance, CARD, "1g.18gb", 3)
    assert rig.gis() == EXAMPLE_GIS
    # consumed: the next one is made
    assert (rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3), "1g.18gb", 3, 1, 0) in rig.gis()


def test_the_adapters_agree_after_the_same_steps(tmp_path: Path) -> None:
    """Same hardware, same steps: the same inventory, but for the MIG uuids (NVML's are its own)."""
    seen = []
    for kind in KINDS:
        rig = Rig(kind, tmp_path / kind)
        gi = rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3)
        rig.adapter.create_compute_instance(CARD, gi)
        rig.adapter.destroy_compute_instance(CARD, 2, 0)
        card = rig.card()
        seen.append((card.gpu_instances, [(m.atom_id, m.profile, m.memory_bytes, m.placement) for m in card.mig_instances]))
    assert seen[0] == seen[1]
    assert GpuInstance(gi=2, profile="3g.71gb", profile_id=9, placement=MigPlacement(start=4, size=4), compute_instances=0) in seen[0][0]


# --------------------------------------------------------------------------- the fake host file


def test_fakehw_writes_each_step_into_the_host_file_and_consumes_its_fault(tmp_path: Path) -> None:
    rig = Rig("fakehw", tmp_path, fault="ci-fail")
    gi = rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3)
    rig.refused("failed", rig.adapter.create_compute_instance, CARD, gi)
    card = next(g for g in json.loads(rig.host_file.read_text())["gpus"] if g["pci_address"] == CARD)
    assert card["faults"]["mig_instance"] == ""
    assert card["gpu_instances"] == [{"gi": gi, "profile": "1g.18gb", "placement_start": 3}]
    made = rig.adapter.create_compute_instance(CARD, gi)
    # a MIG device's uuid follows from the card, the GPU instance and its profile
    again = Rig("fakehw", tmp_path / "again")
    assert again.adapter.create_compute_instance(CARD, again.adapter.create_gpu_instance(CARD, "1g.18gb", 3)).uuid == made.uuid
    assert load_host_file(rig.host_file).gpus[7].mig_instances[-1].uuid == made.uuid


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.update(gpu_instances=[{"gi": 2, "profile": "1g.18gb"}]), "GPU instance 2 has another profile"),
        (lambda c: c["mig_instances"][0].update(placement_start=0), r"GPU instance 9 \(1g.18gb at 0, 1 slice\(s\)\) overlaps GPU instance 2"),
        (lambda c: c["mig_instances"][0].update(placement_start=3), "3g.71gb has no placement at 3"),
        (lambda c: c.update(gpu_instances=[{"gi": 3, "profile": "1g.18gb"}, {"gi": 3, "profile": "1g.18gb"}]), "appears twice"),
        (lambda c: c.update(gpu_instances=[{"gi": 3, "profile": "1g.18gb", "placement_start": 2}]), "overlap"),
    ],
    ids=["profile-disagrees", "overlap", "not-a-placement", "duplicate", "bare-overlap"],
)
def test_fakehw_host_file_gpu_instances_must_agree(tmp_path: Path, change: Any, message: str) -> None:
    data = json.loads(H200.read_text())
    change(next(g for g in data["gpus"] if g["pci_address"] == CARD))
    path = tmp_path / "host.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HostFileError, match=message):
        load_host_file(path)


def test_fakehw_layouts_place_their_gpu_instances(tmp_path: Path) -> None:
    rig = Rig("fakehw", tmp_path)
    gi = rig.adapter.create_gpu_instance(CARD, "1g.18gb", 3)  # a bare GPU instance: a layout destroys it too
    assert gi
    result = rig.adapter.apply_mig_layout(CARD, ["1g.18gb", "3g.71gb", "2g.35gb"], disable=False)
    assert result.outcome == "Applied", result.message
    assert rig.gis() == [(1, "1g.18gb", 1, 1, 1), (2, "3g.71gb", 4, 4, 1), (3, "2g.35gb", 2, 2, 1)]
    assert rig.adapter.apply_mig_layout(CARD, ["3g.71gb", "3g.71gb", "1g.18gb"], disable=False).outcome == "Failed"


# --------------------------------------------------------------------------- the NVML bindings


def test_pynvml_placement_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """PynvmlNvml's ctypes plumbing against a stand-in for the library: the possible placements are
    asked for twice (how many, then into an array that large), a placement is handed over by
    reference, and a GPU instance's placement comes from nvmlGpuInstanceGetInfo."""
    calls: list[Any] = []

    def possible(handle: object, profile_id: int, placements: Any, count: Any) -> int:
        calls.append(("possible", profile_id, placements is None))
        if placements is None:
            count._obj.value = 2
        else:
            assert len(placements) == 2
            for k, start in enumerate((0, 4)):
                placements[k].start, placements[k].size = start, 4
            count._obj.value = 2
        return pynvml.NVML_SUCCESS

    def create(handle: object, profile_id: int, placement: Any) -> str:
        p = placement._obj
        calls.append(("create", profile_id, p.start, p.size))
        return "gi-handle"

    def info(gi: object) -> Any:
        out = pynvml.c_nvmlGpuInstanceInfo_t()
        out.id, out.profileId = 7, 9
        out.placement.start, out.placement.size = 4, 4
        return out

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: f"dev{index}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstancePossiblePlacements", possible)
    monkeypatch.setattr(pynvml, "nvmlDeviceCreateGpuInstanceWithPlacement", create)
    monkeypatch.setattr(pynvml, "nvmlGpuInstanceGetInfo", info)
    port = PynvmlNvml()
    assert port.gpu_instance_placements(0, 9) == [(0, 4), (4, 4)]
    assert port.create_gpu_instance_with_placement(0, 9, 4, 4) == 7
    assert calls == [("possible", 9, True), ("possible", 9, False), ("create", 9, 4, 4)]


def test_pynvml_gpu_instances_carry_their_placement_and_profiles_their_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    def profile_info(handle: object, profile_index: int) -> Any:
        if profile_index != pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.instanceCount, info.memorySizeMB, info.name = 9, 3, 2, 71936, b"MIG 3g.71gb"
        info.multiprocessorCount, info.copyEngineCount, info.decoderCount = 60, 3, 3
        info.encoderCount, info.jpegCount, info.ofaCount = 0, 3, 0
        return info

    def instances(handle: object, profile_id: int, array: Any, count: Any) -> int:
        array[0] = pynvml.c_nvmlGpuInstance_t()
        count._obj.value = 1
        return pynvml.NVML_SUCCESS

    def info(gi: object) -> Any:
        out = pynvml.c_nvmlGpuInstanceInfo_t()
        out.id, out.profileId = 2, 9
        out.placement.start, out.placement.size = 4, 4
        return out

    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: f"dev{index}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstanceProfileInfo", profile_info)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstances", instances)
    monkeypatch.setattr(pynvml, "nvmlGpuInstanceGetInfo", info)
    port = PynvmlNvml()
    [profile] = port.gpu_instance_profiles(0)
    assert (profile.multiprocessors, profile.copy_engines, profile.decoders, profile.encoders, profile.jpeg_engines, profile.ofa_engines) == (60, 3, 3, 0, 3, 0)
    [gi] = port.gpu_instances(0)
    assert (gi.gi_id, gi.profile_id, gi.start, gi.size) == (2, 9, 4, 4)


@pytest.mark.parametrize(("code", "outcome"), [(19, "in-use"), (6, "not-found"), (999, "failed")])
def test_nvml_failures_keep_in_use_and_not_found_apart(tmp_path: Path, code: int, outcome: str) -> None:
    from services.inventory.adapters.nvidia_nvml import NvmlError

    rig = Rig("nvidia", tmp_path)

    def broken(*_: object) -> None:
        raise NvmlError("NVML said no", code)

    rig.adapter.nvml.destroy_compute_instance = broken
    rig.refused(outcome, rig.adapter.destroy_compute_instance, CARD, 9, 0)


# --------------------------------------------------------------------------- the inventory's endpoint


@pytest.mark.integration
async def test_the_inventory_endpoint_makes_and_destroys_a_mig_instance(tmp_path: Path) -> None:
    """inventory.mig_instance on a real node bus, as the converger asks it: each step's answer comes
    after the inventory that shows it was published; a wrong request is answered, not an error."""
    from tests.integration.harness import NodeBus

    host_file = tmp_path / "host.json"
    host_file.write_bytes(H200.read_bytes())
    bus = NodeBus(tmp_path).start()
    try:
        bus.start_service("inventory", BCD_ADAPTER="fakehw", BCD_FAKE_HOST=str(host_file), BCD_CDI_DIR=str(tmp_path / "cdi"))
        await bus.wait_service("inventory")
        subjects = NodeSubjects(bus.node_id)
        nc = await bus.connect("converger")

        async def step(**kw: Any) -> Any:
            req = MigInstanceRequest(pci=kw.pop("pci", CARD), owner="0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13", **kw)
            return await call(nc, subjects.inventory_mig_instance, req, MIG_INSTANCE_REPLY_CODEC, timeout=15)

        async def card() -> Gpu:
            inv = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC)
            return next(g for g in inv.gpus if g.pci_address == CARD)

        made = await step(step="create-gi", profile="1g.18gb", start=3)
        assert (made.outcome, made.step) == ("done", "create-gi"), made.message
        assert GpuInstance(gi=made.gi, profile="1g.18gb", profile_id=19, placement=MigPlacement(start=3, size=1)) in (await card()).gpu_instances
        ci = await step(step="create-ci", gi=made.gi)
        assert ci.ok and ci.uuid.startswith("MIG-") and ci.ci == 0, ci.message
        mig = next(m for m in (await card()).mig_instances if m.gi == made.gi)
        assert (mig.uuid, mig.placement) == (ci.uuid, MigPlacement(start=3, size=1))

        # wrong for this card, or for any: answered, and nothing changes
        assert (await step(step="create-gi", profile="1g.18gb", start=4)).outcome == "refused"
        assert (await step(step="create-gi", pci=PLAIN, profile="1g.18gb", start=0)).outcome == "refused"
        assert (await step(step="create-gi", pci="0000:99:00.0", profile="1g.18gb", start=0)).outcome == "refused"
        assert (await step(step="destroy-ci", gi=made.gi)).outcome == "refused"  # no ci named
        assert (await step(step="destroy-gi", gi=made.gi)).outcome == "in-use"

        assert (await step(step="destroy-ci", gi=made.gi, ci=ci.ci)).ok
        assert (await step(step="destroy-gi", gi=made.gi)).ok
        gone = await step(step="destroy-gi", gi=made.gi)
        assert gone.outcome == "not-found", gone.message
        assert made.gi not in {g.gi for g in (await card()).gpu_instances}
    finally:
        await bus.aclose()
