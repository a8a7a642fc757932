"""nvidia_mig alone: `NvidiaMig` on a scan (`NvidiaDiscovery`) of the example host through the MIG
fake NVML of test_mig_layouts, recording the changes it asks NVML for; and its pure helpers
(profile names, the sort of a step's NVML failure, the profile guessed for a MIG device)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pynvml
import pytest

from services.inventory.adapters.base import MigStepError
from services.inventory.adapters.fakehost import load_host_file
from services.inventory.adapters.nvidia_discovery import NvidiaDiscovery
from services.inventory.adapters.nvidia_mig import NvidiaMig, guess_profile, profile_name, step_error
from services.inventory.adapters.nvidia_nvml import MIB, NvmlError, NvmlGiProfile, NvmlGpuInstance, NvmlMigDevice, NvmlProcess
from tests.unit.test_inventory_adapters import H200, materialize
from tests.unit.test_mig_layouts import MigNvml

CARD = "0000:db:00.0"  # NVML index 7: 3g.71gb at 4 (gi 2) and 1g.18gb at 0, 1, 2 (gi 9, 10, 11), one compute instance each
CARD_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000008"
PLAIN = "0000:18:00.0"
CHANGES = ("set_mig_mode", "destroy_compute_instance", "destroy_gpu_instance", "create_gpu_instance", "create_gpu_instance_with_placement", "create_compute_instance")


class RecordingNvml(MigNvml):
    """MigNvml that records every change asked of it, in order."""

    def __init__(self, host: Any, fault: str = "") -> None:
        super().__init__(host, fault)
        self.changes: list[tuple[Any, ...]] = []

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name in CHANGES:

            def record(*args: Any) -> Any:
                self.changes.append((name, *args))
                return attr(*args)

            return record
        return attr


def rig(tmp_path: Path, *, fault: str = "", scan: bool = True, nvml_class: type[MigNvml] = RecordingNvml, **kw: Any) -> tuple[NvidiaMig, Any, NvidiaDiscovery]:
    host = load_host_file(H200)
    roots = materialize(host, tmp_path / "root")
    nvml = nvml_class(host, fault, **kw)
    discovery = NvidiaDiscovery(nvml, sysfs_root=roots.sysfs, proc_root=roots.proc)
    if scan:
        discovery.read_capabilities()
    return NvidiaMig(nvml, discovery), nvml, discovery


def refused(outcome: str, fn: Any, *args: Any) -> str:
    with pytest.raises(MigStepError) as caught:
        fn(*args)
    assert caught.value.outcome == outcome, str(caught.value)
    return str(caught.value)


# --------------------------------------------------------------------------- the pure helpers


@pytest.mark.parametrize(("nvml", "name"), [("MIG 1g.18gb", "1g.18gb"), ("MIG 1g.18gb+me", "1g.18gb+me"), ("1g.18gb", "1g.18gb"), ("MIGHTY 1g", "MIGHTY 1g")])
def test_profile_name(nvml: str, name: str) -> None:
    assert profile_name(nvml) == name


@pytest.mark.parametrize(
    ("exc", "outcome", "says"),
    [
        (NvmlError("In use by another client", pynvml.NVML_ERROR_IN_USE), "in-use", "in use"),
        (pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE), "in-use", "in use"),
        (NvmlError("Not Found", pynvml.NVML_ERROR_NOT_FOUND), "not-found", "not found"),
        (pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND), "not-found", "not found"),
        (NvmlError("Insufficient Resources", pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES), "failed", "NVML failed"),
        (NvmlError("no code"), "failed", "NVML failed"),
    ],
)
def test_a_steps_nvml_failure_keeps_in_use_and_not_found_apart(exc: BaseException, outcome: str, says: str) -> None:
    err = step_error("0000:db:00.0: GPU instance 3", exc)
    assert err.outcome == outcome
    assert str(err) == f"0000:db:00.0: GPU instance 3: {says} ({exc})"


def _profile(pid: int, slices: int, mib: int) -> NvmlGiProfile:
    return NvmlGiProfile(profile_id=pid, name=f"MIG p{pid}", slice_count=slices, instance_count=1, memory_mib=mib)


def _device(gi_slices: int, mib: int) -> NvmlMigDevice:
    return NvmlMigDevice(index=0, gi_id=1, ci_id=0, uuid="MIG-x", memory_bytes=mib * MIB, gi_slice_count=gi_slices, ci_slice_count=gi_slices)


def test_the_profile_guessed_for_a_mig_device() -> None:
    profiles = [_profile(20, 1, 17920), _profile(19, 1, 17920), _profile(15, 1, 35840), _profile(14, 2, 35840)]
    # same slices, nearest memory (a MIG device reports a little less than its profile)
    assert guess_profile(profiles, _device(1, 35000)) == profiles[2]
    # a tie: the lowest id (the plain profile before "+me")
    assert guess_profile(profiles, _device(1, 17800)) == profiles[1]
    assert guess_profile(profiles, _device(2, 1)) == profiles[3]  # slices decide before memory
    assert guess_profile(profiles, _device(3, 71000)) is None
    assert guess_profile([], _device(1, 17920)) is None


# --------------------------------------------------------------------------- the scan's MIG facts


class ManyPlacements(RecordingNvml):
    """Placements listed out of order, twice over, and more than the schema takes."""

    def gpu_instance_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        return [(start, 1) for start in reversed(range(80))] * 2


def test_placements_are_sorted_unique_and_bounded(tmp_path: Path) -> None:
    mig, _, _ = rig(tmp_path, nvml_class=ManyPlacements)
    profiles = mig.mig_profiles(CARD_UUID)
    assert profiles and all([(p.start, p.size) for p in m.placements] == [(k, 1) for k in range(64)] for m in profiles)


def test_profiles_carry_nvmls_facts(tmp_path: Path) -> None:
    mig, _, _ = rig(tmp_path)
    three = next(p for p in mig.mig_profiles(CARD_UUID) if p.name == "3g.71gb")
    assert (three.profile_id, three.slices, three.memory_bytes, three.instances_max) == (9, 3, 71936 * MIB, 2)
    assert [(p.start, p.size) for p in three.placements] == [(0, 4), (4, 4)]


class Shuffled(RecordingNvml):
    """NVML's lists in no particular order."""

    def gpu_instances(self, index: int) -> list[NvmlGpuInstance]:
        return list(reversed(super().gpu_instances(index)))

    def mig_devices(self, index: int) -> list[NvmlMigDevice]:
        return list(reversed(super().mig_devices(index)))


def test_instances_are_listed_in_id_order(tmp_path: Path) -> None:
    mig, _, _ = rig(tmp_path, nvml_class=Shuffled)
    assert [(g.gi, g.profile, g.profile_id, g.start, g.size, g.compute_instances) for g in mig.gpu_instances(CARD_UUID)] == [
        (2, "3g.71gb", 9, 4, 4, 1),
        (9, "1g.18gb", 19, 0, 1, 1),
        (10, "1g.18gb", 19, 1, 1, 1),
        (11, "1g.18gb", 19, 2, 1, 1),
    ]
    assert [(m.gi, m.ci, m.profile, m.start) for m in mig.mig_instances(CARD_UUID)] == [
        (2, 0, "3g.71gb", 4),
        (9, 0, "1g.18gb", 0),
        (10, 0, "1g.18gb", 1),
        (11, 0, "1g.18gb", 2),
    ]


def test_without_the_gpu_instance_list_profiles_are_guessed_and_placements_unknown(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path)

    def denied(index: int) -> list[NvmlGpuInstance]:
        raise NvmlError("Insufficient Permissions", pynvml.NVML_ERROR_NO_PERMISSION)

    nvml.gpu_instances = denied
    assert [(g.gi, g.profile, g.profile_id, g.start, g.compute_instances) for g in mig.gpu_instances(CARD_UUID)] == [
        (2, "3g.71gb", 9, None, 1),
        (9, "1g.18gb", 19, None, 1),
        (10, "1g.18gb", 19, None, 1),
        (11, "1g.18gb", 19, None, 1),
    ]
    assert [(m.gi, m.profile, m.start) for m in mig.mig_instances(CARD_UUID)] == [(2, "3g.71gb", None), (9, "1g.18gb", None), (10, "1g.18gb", None), (11, "1g.18gb", None)]


def test_a_compute_instance_smaller_than_its_gpu_instance_is_named_for_its_slices(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path)
    base = nvml.mig_devices

    def split(index: int) -> list[NvmlMigDevice]:
        return [NvmlMigDevice(d.index, d.gi_id, d.ci_id, d.uuid, d.memory_bytes, d.gi_slice_count, 1 if d.gi_id == 2 else d.ci_slice_count) for d in base(index)]

    nvml.mig_devices = split
    assert [m.profile for m in mig.mig_instances(CARD_UUID)] == ["1c.3g.71gb", "1g.18gb", "1g.18gb", "1g.18gb"]


def test_cards_not_in_mig_mode_or_unseen_list_nothing(tmp_path: Path) -> None:
    mig, _, discovery = rig(tmp_path)
    plain_uuid = discovery.last[PLAIN].uuid
    assert mig.gpu_instances(plain_uuid) == [] and mig.mig_instances(plain_uuid) == []
    assert mig.gpu_instances("GPU-unknown") == [] and mig.mig_profiles("GPU-unknown") == []


# --------------------------------------------------------------------------- steps


def test_before_a_scan_no_card_is_known(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path, scan=False)
    assert "NVML does not see the card at 0000:db:00.0" in refused("refused", mig.create_gpu_instance, CARD, "1g.18gb", 3)
    result = mig.apply_mig_layout(CARD, ["1g.18gb"], disable=False)
    assert (result.outcome, result.left) == ("Failed", "as before")
    assert mig.mig_profiles(CARD_UUID) == []
    assert nvml.changes == []


def test_a_gpu_instance_is_made_only_where_it_fits(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path)
    assert "overlaps GPU instance 2 (at 4, 4 slice(s))" in refused("refused", mig.create_gpu_instance, CARD, "1g.18gb", 4)
    assert "has no placement at 7" in refused("refused", mig.create_gpu_instance, CARD, "1g.18gb", 7)
    assert "has no MIG profile 5g.99gb" in refused("refused", mig.create_gpu_instance, CARD, "5g.99gb", 0)
    assert "is not in MIG mode" in refused("refused", mig.create_gpu_instance, PLAIN, "1g.18gb", 0)
    assert nvml.changes == []  # every refusal before NVML was asked to change anything
    gi = mig.create_gpu_instance(CARD, "1g.18gb", 3)
    assert nvml.changes == [("create_gpu_instance_with_placement", 7, 19, 3, 1)]
    made = mig.create_compute_instance(CARD, gi)
    assert (made.gi, made.ci, made.profile, made.start, made.size, made.uuid) == (gi, 0, "1g.18gb", 3, 1, f"MIG-fake-7-{gi}-0")
    assert "has a compute instance already" in refused("refused", mig.create_compute_instance, CARD, gi)


def test_a_profile_at_its_most_instances_or_beside_an_unplaced_one_is_refused(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path)
    for gi in (9, 10, 11):  # slices 0-3 free
        mig.destroy_compute_instance(CARD, gi, 0)
        mig.destroy_gpu_instance(CARD, gi)
    st = nvml.state[7]
    three = st["gis"][2]  # 3g.71gb: at most two
    st["gis"][98], st["starts"][98] = three, 8  # a second one, somewhere that overlaps nothing
    nvml.changes.clear()
    assert "has 2 GPU instance(s) of 3g.71gb already, its most" in refused("refused", mig.create_gpu_instance, CARD, "3g.71gb", 0)
    st["starts"][98] = None  # NVML gives no placement for it: nothing is placed beside it
    assert "GPU instance 98 on 0000:db:00.0 has no known placement" in refused("refused", mig.create_gpu_instance, CARD, "1g.18gb", 3)
    assert nvml.changes == []
    del st["gis"][98], st["starts"][98]
    assert mig.create_gpu_instance(CARD, "3g.71gb", 0)


def test_destroys_refuse_what_is_in_use_or_gone(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path)
    assert "still has 1 compute instance(s)" in refused("in-use", mig.destroy_gpu_instance, CARD, 9)
    assert "has no GPU instance 42" in refused("not-found", mig.destroy_gpu_instance, CARD, 42)
    assert "has no compute instance 3 in GPU instance 9" in refused("not-found", mig.destroy_compute_instance, CARD, 9, 3)
    nvml.compute_processes = lambda index: [NvmlProcess(pid=4242, gi_id=9, ci_id=0)]
    assert "process 4242 runs on it" in refused("in-use", mig.destroy_compute_instance, CARD, 9, 0)
    assert nvml.changes == []
    # a process list NVML refuses leaves it to the destroy's own answer
    nvml.compute_processes = lambda index: (_ for _ in ()).throw(NvmlError("Insufficient Permissions", pynvml.NVML_ERROR_NO_PERMISSION))
    mig.destroy_compute_instance(CARD, 9, 0)
    assert nvml.changes == [("destroy_compute_instance", 7, 9, 0)]


# --------------------------------------------------------------------------- layouts


def test_a_layout_destroys_everything_in_order_then_makes_each_profile(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path)
    bare = mig.create_gpu_instance(CARD, "1g.18gb", 3)  # a GPU instance with no compute instance: destroyed too
    nvml.changes.clear()
    result = mig.apply_mig_layout(CARD, ["1g.18gb", "3g.71gb"], disable=False)
    assert (result.outcome, result.message) == ("Applied", "0000:db:00.0: 2 GPU instance(s): 1g.18gb, 3g.71gb")
    assert nvml.changes == [
        ("destroy_compute_instance", 7, 2, 0),
        ("destroy_compute_instance", 7, 9, 0),
        ("destroy_compute_instance", 7, 10, 0),
        ("destroy_compute_instance", 7, 11, 0),
        *(("destroy_gpu_instance", 7, gi) for gi in sorted([2, 9, 10, 11, bare])),
        ("set_mig_mode", 7, True),
        ("create_gpu_instance", 7, 19),
        ("create_compute_instance", 7, 1),
        ("create_gpu_instance", 7, 9),
        ("create_compute_instance", 7, 2),
    ]


def test_a_failed_layout_is_rolled_back_to_the_profiles_before_in_id_order(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path, fault="fail")
    result = mig.apply_mig_layout(CARD, ["3g.71gb", "3g.71gb"], disable=False)
    assert (result.outcome, result.left) == ("Failed", "rolled back"), result.message
    assert result.message.startswith("0000:db:00.0: NVML failed (Insufficient Resources); the layout before was restored")
    restored = [c[2] for c in nvml.changes[nvml.changes.index(("set_mig_mode", 7, True)) :] if c[0] == "create_gpu_instance"]
    assert restored == [9, 9, 9, 19, 19, 19]  # the two of the layout, then gi 2 (3g.71gb), 9, 10, 11 (1g.18gb) again


def test_a_layout_with_an_unknown_profile_changes_nothing(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path)
    result = mig.apply_mig_layout(CARD, ["1g.18gb", "9g.999gb"], disable=False)
    assert (result.outcome, result.left) == ("Failed", "as before")
    assert result.message.startswith("0000:db:00.0 has no MIG profile 9g.999gb (it has 1g.18gb, 1g.18gb+me, 1g.35gb, ")
    assert nvml.changes == []


def test_all_disabled_turns_mig_off_after_destroying_everything(tmp_path: Path) -> None:
    mig, nvml, _ = rig(tmp_path)
    result = mig.apply_mig_layout(CARD, [], disable=True)
    assert (result.outcome, result.message) == ("Applied", "MIG mode off on 0000:db:00.0 (all-disabled)")
    assert nvml.changes[-1] == ("set_mig_mode", 7, False)
    assert not any(c[0].startswith("create") for c in nvml.changes)
