"""The two files of a hold: CDI spec and env file, their parser and the CDI-rule validators.

Inputs are realistic: the vendor spec of examples/hosts/h200x8.json (as
`nvidia-ctk cdi generate` writes it) and the seed's own example. Every spec
built here must validate against the official CDI schema (team folder
../shared/reference/cdi-schema) and pass bcd's own CDI-rule checks.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shared.holdfiles import (
    CDI_VERSIONS,
    KIND,
    HoldContent,
    HoldDevice,
    NotAHold,
    build_cdi_spec,
    check_cdi_rules,
    device_name,
    env_lines,
    hold_file_name,
    min_cdi_version,
    parse_hold,
    qualified_names,
    render_cdi_spec,
    render_env_file,
    slice_name,
    validate_against_schema,
)
from shared.schemas import HugePages, Limits
from shared.vendorcdi import VendorCdi, vendor_cdi_from_json

REPO = Path(__file__).resolve().parents[2]
SCHEMA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "reference" / "cdi-schema"
H200 = json.loads((REPO / "examples" / "hosts" / "h200x8.json").read_text())
H200_VENDOR = vendor_cdi_from_json(json.dumps(H200["vendor_cdi_spec"]).encode(), "/etc/cdi/nvidia.json")
MPS_DIR = H200["mps_pipe_dir"]


def uuid(n: int) -> str:
    return f"GPU-5f1c2a90-0000-4000-8000-00000000000{n}"


def gpu(index: int) -> HoldDevice:
    return HoldDevice.for_gpu(uuid(index + 1), index)


def mig_facts(index: int, gi: int, ci: int) -> tuple[str, int]:
    """(MIG uuid, NVML MIG index) of a MIG instance of the example host."""
    instances = H200["gpus"][index]["mig_instances"]
    pos = next(i for i, m in enumerate(instances) if (m["gi"], m["ci"]) == (gi, ci))
    return instances[pos]["uuid"], pos


# ---------------------------------------------------------------------------- the seed's example

ALLOC, RSV = "alloc_01jz8k2v", "rsv_01jz8k1q"
SEED_LIMITS = Limits(cpus="0-7", memory_bytes=4 * 1024**3)

#: the vendor spec behind the seed's example, as the seed shows it (shortened).
SEED_VENDOR_SPEC: dict[str, Any] = {
    "cdiVersion": "0.7.0",
    "kind": "nvidia.com/gpu",
    "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
        {"name": uuid(1), "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
    ],
    "containerEdits": {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}],
        "mounts": [
            {
                "hostPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06",
                "containerPath": "/usr/lib/x86_64-linux-gnu/libcuda.so.580.65.06",
                "options": ["ro", "nosuid", "nodev", "bind"],
            }
        ],
        "hooks": [
            {
                "hookName": "createContainer",
                "path": "/usr/bin/nvidia-cdi-hook",
                "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"],
            }
        ],
        "additionalGids": [44],
    },
}
SEED_VENDOR = vendor_cdi_from_json(json.dumps(SEED_VENDOR_SPEC).encode(), "/etc/cdi/nvidia.json")

#: the seed's example exactly, but for two decisions: the device's `"env": null`
#: is left out (the schema types env as an array), and the binding and limits
#: annotations are added so the hold reads back whole.
SEED_EXPECTED: dict[str, Any] = {
    "cdiVersion": "0.7.0",
    "kind": "bcd.dev/gpu",
    "annotations": {
        "bcd.dev/allocation-id": "alloc_01jz8k2v",
        "bcd.dev/reservation-id": "rsv_01jz8k1q",
        "bcd.dev/generation": "42",
        "bcd.dev/cgroup-parent": "bcd-alloc-alloc_01jz8k2v.slice",
        "bcd.dev/binding": "BINDING_HOLD",
        "bcd.dev/limits": '{"cpus":"0-7","cpu_millis":null,"memory_bytes":4294967296,"hugepages":[],"mems":null}',
    },
    "devices": [
        {
            "name": "GPU-5f1c2a90-0000-4000-8000-000000000001",
            "annotations": {"bcd.dev/device-id": "GPU-5f1c2a90-0000-4000-8000-000000000001"},
            "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]},
        }
    ],
    "containerEdits": {
        "env": [
            "BCD_ALLOCATION_ID=alloc_01jz8k2v",
            "BCD_CGROUP_PARENT=bcd-alloc-alloc_01jz8k2v.slice",
            "NVIDIA_VISIBLE_DEVICES=GPU-5f1c2a90-0000-4000-8000-000000000001",
        ],
        "deviceNodes": SEED_VENDOR_SPEC["containerEdits"]["deviceNodes"],
        "mounts": SEED_VENDOR_SPEC["containerEdits"]["mounts"],
        "hooks": SEED_VENDOR_SPEC["containerEdits"]["hooks"],
        "additionalGids": [44],
    },
}


def hold(
    devices: tuple[HoldDevice, ...],
    *,
    alloc: str = ALLOC,
    binding: str = "BINDING_HOLD",
    sliced: bool = False,
    limits: Limits | None = None,
    mps: bool = False,
    env: tuple[str, ...] = (),
    generation: int = 42,
) -> HoldContent:
    return HoldContent(
        allocation_id=alloc,
        reservation_id=RSV,
        generation=generation,
        binding=binding,
        devices=devices,
        cgroup_parent=slice_name(alloc) if sliced else "",
        env=env,
        mps_pipe_dir=MPS_DIR if mps else "",
        limits=limits,
    )


def seed_hold() -> HoldContent:
    return hold((gpu(0),), sliced=True, limits=SEED_LIMITS)


def test_the_seed_example_is_built_exactly() -> None:
    spec = build_cdi_spec(seed_hold(), SEED_VENDOR)
    assert spec == SEED_EXPECTED
    # same keys in the same order: the file reads like the seed's.
    assert render_cdi_spec(spec) == (json.dumps(SEED_EXPECTED, indent=2) + "\n").encode()
    assert spec["cdiVersion"] == "0.7.0"  # additionalGids, copied from the vendor spec
    assert render_env_file(seed_hold()) == (
        b"BCD_ALLOCATION_ID=alloc_01jz8k2v\n"
        b"BCD_CGROUP_PARENT=bcd-alloc-alloc_01jz8k2v.slice\n"
        b"BCD_RESERVATION_ID=rsv_01jz8k1q\n"
        b"NVIDIA_VISIBLE_DEVICES=GPU-5f1c2a90-0000-4000-8000-000000000001\n"
    )


# ---------------------------------------------------------------------------- scenarios

mig_uuid_6_5, mig_index_6_5 = mig_facts(6, 5, 0)
#: the example host's vendor spec with only index names ("0", "6:2"), as the
#: toolkit's default device-name strategy writes it.
INDEX_ONLY_VENDOR = VendorCdi(
    path="/etc/cdi/nvidia.json",
    cdi_version=H200_VENDOR.cdi_version,
    kind=H200_VENDOR.kind,
    container_edits=H200_VENDOR.container_edits,
    devices={k: v for k, v in H200_VENDOR.devices.items() if not k.startswith(("GPU-", "MIG-"))},
)

#: name -> (hold, vendor). Each is built, validated, checked and read back below.
SCENARIOS: dict[str, tuple[HoldContent, VendorCdi | None]] = {
    "seed": (seed_hold(), SEED_VENDOR),
    "gpu-h200": (hold((gpu(0),), alloc="alloc_gpu"), H200_VENDOR),
    "two-gpus-with-env": (
        hold((gpu(2), gpu(3)), alloc="alloc_env", env=("HF_HOME=/data/hf", "OMP_NUM_THREADS=8")),
        H200_VENDOR,
    ),
    "mig": (hold((HoldDevice.for_mig(uuid(7), 6, 5, 0, mig_uuid_6_5),), alloc="alloc_mig"), H200_VENDOR),
    "mig-by-index": (
        hold((HoldDevice.for_mig(uuid(7), 6, 5, 0, mig_uuid_6_5, mig_index_6_5),), alloc="alloc_migidx"),
        INDEX_ONLY_VENDOR,
    ),
    "slot0-mps": (hold((HoldDevice.for_slot(uuid(5), 4, 0),), alloc="alloc_s0", mps=True), H200_VENDOR),
    "slot1-mps": (hold((HoldDevice.for_slot(uuid(5), 4, 1),), alloc="alloc_s1", mps=True), H200_VENDOR),
    "two-slots-one-hold": (
        hold((HoldDevice.for_slot(uuid(6), 5, 2), HoldDevice.for_slot(uuid(6), 5, 3)), alloc="alloc_s23"),
        H200_VENDOR,
    ),
    "kubernetes": (hold((gpu(1),), alloc="alloc_kube", binding="BINDING_KUBERNETES"), H200_VENDOR),
    "no-vendor-spec": (hold((gpu(0), HoldDevice.for_slot(uuid(5), 4, 0)), alloc="alloc_novendor"), None),
    "sliced-hugepages": (
        hold((gpu(3),), alloc="alloc_hp", sliced=True, limits=Limits(hugepages=[HugePages(page_size_kib=1048576, count=8)], mems="1")),
        H200_VENDOR,
    ),
}


def built(name: str) -> dict[str, Any]:
    h, vendor = SCENARIOS[name]
    return build_cdi_spec(h, vendor)


def spec_env(spec: dict[str, Any]) -> list[str]:
    return spec["containerEdits"]["env"]


def test_a_whole_gpu_copies_the_vendor_edits_but_never_the_vendor_env() -> None:
    spec = built("gpu-h200")
    assert spec["cdiVersion"] == "0.6.0"  # annotations; the example host's spec has no additionalGids
    assert spec["devices"][0]["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidia0"}]}
    edits = spec["containerEdits"]
    for key in ("deviceNodes", "mounts", "hooks"):
        assert edits[key] == H200["vendor_cdi_spec"]["containerEdits"][key]
    assert "NVIDIA_VISIBLE_DEVICES=void" not in edits["env"]
    assert "bcd.dev/cgroup-parent" not in spec["annotations"] and "bcd.dev/limits" not in spec["annotations"]


def test_vendor_edits_are_copied_not_shared() -> None:
    spec = built("gpu-h200")
    spec["devices"][0]["containerEdits"]["deviceNodes"].append({"path": "/dev/evil"})
    spec["containerEdits"]["mounts"].clear()
    assert H200_VENDOR.devices["0"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert H200_VENDOR.container_edits["mounts"]


def test_a_mig_hold_names_the_instance_and_copies_its_capabilities() -> None:
    spec = built("mig")
    (device,) = spec["devices"]
    assert device["name"] == f"{uuid(7)}_gi5_ci0"
    assert device["annotations"] == {"bcd.dev/device-id": f"{uuid(7)}/gi5/ci0"}
    assert device["containerEdits"] == dict(H200_VENDOR.devices[mig_uuid_6_5])
    assert f"NVIDIA_VISIBLE_DEVICES={mig_uuid_6_5}" in spec_env(spec)


def test_a_mig_index_name_is_the_nvml_mig_index_not_the_gpu_instance_id() -> None:
    device = HoldDevice.for_mig(uuid(7), 6, 5, 0, mig_uuid_6_5, mig_index_6_5)
    assert device.vendor_names == (mig_uuid_6_5, "6:2")  # gi5 is the third MIG device of card 6
    spec = built("mig-by-index")
    assert spec["devices"][0]["containerEdits"] == dict(H200_VENDOR.devices["6:2"])
    # without the index, an index-only vendor spec has nothing for the instance: stand-in env.
    bare = build_cdi_spec(hold((HoldDevice.for_mig(uuid(7), 6, 5, 0, mig_uuid_6_5),)), INDEX_ONLY_VENDOR)
    assert bare["devices"][0]["containerEdits"] == {
        "env": [f"BCD_DEVICE_{uuid(7).replace('-', '_')}_gi5_ci0={uuid(7)}/gi5/ci0"]
    }


def test_a_mig_device_without_uuid_or_index_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="visible id"):
        HoldDevice.for_mig(uuid(7), 6, 5, 0, "")
    assert HoldDevice.for_mig(uuid(7), 6, 5, 0, "", 2).visible_id == "6:2"


def test_two_slot_holds_on_one_gpu_get_distinct_names_and_share_a_directory() -> None:
    s0, s1 = built("slot0-mps"), built("slot1-mps")
    assert s0["devices"][0]["name"] == f"{uuid(5)}_slot0"
    assert s1["devices"][0]["name"] == f"{uuid(5)}_slot1"
    # each slot copies its GPU's edits
    assert s0["devices"][0]["containerEdits"] == s1["devices"][0]["containerEdits"] == {
        "deviceNodes": [{"path": "/dev/nvidia4"}]
    }
    for spec in (s0, s1):
        assert f"CUDA_MPS_PIPE_DIRECTORY={MPS_DIR}" in spec_env(spec)
        assert f"NVIDIA_VISIBLE_DEVICES={uuid(5)}" in spec_env(spec)
    directory = {"bcd-alloc_s0.json": s0, "bcd-alloc_s1.json": s1, "nvidia.json": H200["vendor_cdi_spec"]}
    assert check_cdi_rules(directory) == []
    assert qualified_names(s0) == [f"bcd.dev/gpu={uuid(5)}_slot0"]


def test_slots_without_mps_running_have_no_pipe_directory() -> None:
    spec = built("two-slots-one-hold")
    assert not any(e.startswith("CUDA_MPS_PIPE_DIRECTORY=") for e in spec_env(spec))
    # two slots of one card: the card once in NVIDIA_VISIBLE_DEVICES
    assert f"NVIDIA_VISIBLE_DEVICES={uuid(6)}" in spec_env(spec)
    assert [d["name"] for d in spec["devices"]] == [f"{uuid(6)}_slot2", f"{uuid(6)}_slot3"]


def test_a_kubernetes_hold_has_no_visible_devices_in_cdi_but_has_them_in_the_env_file() -> None:
    h, _ = SCENARIOS["kubernetes"]
    spec = built("kubernetes")
    assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in spec_env(spec))
    assert spec["annotations"]["bcd.dev/binding"] == "BINDING_KUBERNETES"
    assert f"NVIDIA_VISIBLE_DEVICES={uuid(2)}" in env_lines(h)


def test_without_a_vendor_spec_each_device_carries_a_harmless_env_entry() -> None:
    spec = built("no-vendor-spec")
    assert spec["cdiVersion"] == "0.6.0"  # annotations need it
    assert [d["containerEdits"] for d in spec["devices"]] == [
        {"env": [f"BCD_DEVICE_{uuid(1).replace('-', '_')}={uuid(1)}"]},
        {"env": [f"BCD_DEVICE_{uuid(5).replace('-', '_')}_slot0={uuid(5)}/slot0"]},
    ]
    assert set(spec["containerEdits"]) == {"env"}
    assert check_cdi_rules({"bcd-alloc_novendor.json": spec}) == []


def test_a_vendor_device_with_only_gids_still_gets_an_env_entry() -> None:
    vendor = VendorCdi(path="x", cdi_version="0.7.0", kind="nvidia.com/gpu", devices={uuid(1): {"additionalGids": [44]}})
    spec = build_cdi_spec(hold((gpu(0),)), vendor)
    assert spec["devices"][0]["containerEdits"] == {
        "env": [f"BCD_DEVICE_{uuid(1).replace('-', '_')}={uuid(1)}"],
        "additionalGids": [44],
    }
    assert spec["cdiVersion"] == "0.7.0"
    assert check_cdi_rules({"bcd-alloc_01jz8k2v.json": spec}) == []


def test_assignment_env_comes_last() -> None:
    spec = built("two-gpus-with-env")
    assert spec_env(spec) == [
        "BCD_ALLOCATION_ID=alloc_env",
        f"NVIDIA_VISIBLE_DEVICES={uuid(3)},{uuid(4)}",
        "HF_HOME=/data/hf",
        "OMP_NUM_THREADS=8",
    ]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_built_spec_passes_the_cdi_rules_and_declares_its_minimum_version(name: str) -> None:
    spec = built(name)
    assert spec["cdiVersion"] == min_cdi_version(spec)
    assert check_cdi_rules({hold_file_name(SCENARIOS[name][0].allocation_id): spec}) == []
    assert spec["kind"] == KIND


def test_holds_of_one_host_share_a_directory_with_the_vendor_spec() -> None:
    # scenarios whose atoms do not overlap, as the converger's conflict checks guarantee on a host.
    together = ["seed", "kubernetes", "two-gpus-with-env", "mig", "slot0-mps", "slot1-mps", "two-slots-one-hold"]
    directory: dict[str, Any] = {"nvidia.json": H200["vendor_cdi_spec"]}
    for name in together:
        h, vendor = SCENARIOS[name]
        directory[hold_file_name(h.allocation_id)] = build_cdi_spec(h, vendor)
    assert len(directory) == len(together) + 1
    assert check_cdi_rules(directory) == []


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_rendering_is_deterministic(name: str) -> None:
    data = render_cdi_spec(built(name))
    assert data == render_cdi_spec(built(name))
    assert data.endswith(b"}\n") and b"\n  " in data
    assert json.loads(data) == built(name)


# ---------------------------------------------------------------------------- the env file


#: every combination, less a sliced Kubernetes hold (never sliced).
ENV_COMBINATIONS = [
    pytest.param(sliced, mps, binding, env, id=f"{binding}-{'sliced' if sliced else 'plain'}-mps{int(mps)}-env{len(env)}")
    for sliced, mps, binding, env in itertools.product(
        (False, True), (False, True), ("BINDING_HOLD", "BINDING_KUBERNETES"), ((), ("ZZ=last", "AA=first"))
    )
    if not (sliced and binding == "BINDING_KUBERNETES")
]


@pytest.mark.parametrize(("sliced", "mps", "binding", "env"), ENV_COMBINATIONS)
def test_env_file_and_cdi_env_order(sliced: bool, mps: bool, binding: str, env: tuple[str, ...]) -> None:
    devices = (HoldDevice.for_slot(uuid(5), 4, 0), HoldDevice.for_slot(uuid(5), 4, 1), gpu(0))
    h = hold(devices, binding=binding, sliced=sliced, mps=mps, env=env)
    visible = f"NVIDIA_VISIBLE_DEVICES={uuid(5)},{uuid(1)}"
    head = [f"BCD_ALLOCATION_ID={ALLOC}"]
    head += [f"BCD_CGROUP_PARENT=bcd-alloc-{ALLOC}.slice"] if sliced else []
    head += [f"CUDA_MPS_PIPE_DIRECTORY={MPS_DIR}"] if mps else []
    assert env_lines(h) == [*head, f"BCD_RESERVATION_ID={RSV}", visible, *env]
    assert render_env_file(h) == ("\n".join(env_lines(h)) + "\n").encode()
    cdi = [*head, *([visible] if binding == "BINDING_HOLD" else []), *env]
    assert spec_env(build_cdi_spec(h, H200_VENDOR)) == cdi


# ---------------------------------------------------------------------------- reading back


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_built_spec_reads_back(name: str) -> None:
    h, vendor = SCENARIOS[name]
    spec = build_cdi_spec(h, vendor)
    on_disk = parse_hold(hold_file_name(h.allocation_id), render_cdi_spec(spec))
    assert on_disk.allocation_id == h.allocation_id
    assert on_disk.reservation_id == h.reservation_id
    assert on_disk.generation == h.generation
    assert on_disk.binding == h.binding
    assert on_disk.devices == tuple(d.atom_id for d in h.devices)
    assert on_disk.cgroup_parent == h.cgroup_parent
    assert on_disk.limits == h.limits
    assert on_disk.cdi_names == tuple(f"bcd.dev/gpu={device_name(d.atom_id)}" for d in h.devices)


def test_parse_hold_takes_a_path() -> None:
    data = render_cdi_spec(built("seed"))
    assert parse_hold(f"/etc/cdi/{hold_file_name(ALLOC)}", data).allocation_id == ALLOC


@pytest.mark.parametrize(
    ("name", "binding"), [("gpu-h200", "BINDING_HOLD"), ("kubernetes", "BINDING_KUBERNETES")]
)
def test_a_spec_without_the_binding_annotation_is_read_by_its_visible_devices(name: str, binding: str) -> None:
    # the seed's writer had no bcd.dev/binding; it left NVIDIA_VISIBLE_DEVICES out for Kubernetes holds only.
    spec = built(name)
    del spec["annotations"]["bcd.dev/binding"]
    h = SCENARIOS[name][0]
    assert parse_hold(hold_file_name(h.allocation_id), render_cdi_spec(spec)).binding == binding


def _edit(change: Callable[[dict[str, Any]], object]) -> bytes:
    spec = copy.deepcopy(built("seed"))
    change(spec)
    return render_cdi_spec(spec)


def _set_ann(key: str, value: Any) -> Callable[[dict[str, Any]], object]:
    return lambda s: s["annotations"].__setitem__(key, value)


def _del_ann(key: str) -> Callable[[dict[str, Any]], object]:
    return lambda s: s["annotations"].pop(key)


REFUSALS: list[tuple[str, str, bytes, str]] = [
    ("truncated", "bcd-alloc_01jz8k2v.json", render_cdi_spec(built("seed"))[:-20], "not valid JSON"),
    ("not utf-8", "bcd-alloc_01jz8k2v.json", b"\xff\xfe{}", "not valid JSON"),
    ("array", "bcd-alloc_01jz8k2v.json", b"[]", "not a JSON object"),
    ("wrong kind", "bcd-alloc_01jz8k2v.json", _edit(lambda s: s.__setitem__("kind", "nvidia.com/gpu")), "kind is"),
    ("no annotations", "bcd-alloc_01jz8k2v.json", _edit(lambda s: s.pop("annotations")), "no annotations"),
    (
        "no allocation",
        "bcd-alloc_01jz8k2v.json",
        _edit(_del_ann("bcd.dev/allocation-id")),
        "no bcd.dev/allocation-id annotation",
    ),
    ("bad allocation", "bcd-Alloc!.json", _edit(_set_ann("bcd.dev/allocation-id", "Alloc!")), "is not a valid id"),
    (
        "allocation with newline",
        "bcd-alloc_01jz8k2v\n.json",
        _edit(_set_ann("bcd.dev/allocation-id", "alloc_01jz8k2v\n")),
        "is not a valid id",
    ),
    ("other file name", "bcd-alloc_other.json", render_cdi_spec(built("seed")), "does not match the file name"),
    ("no reservation", "bcd-alloc_01jz8k2v.json", _edit(_del_ann("bcd.dev/reservation-id")), "bcd.dev/reservation-id"),
    ("bad generation", "bcd-alloc_01jz8k2v.json", _edit(_set_ann("bcd.dev/generation", "4x")), "bcd.dev/generation"),
    ("no generation", "bcd-alloc_01jz8k2v.json", _edit(_del_ann("bcd.dev/generation")), "bcd.dev/generation"),
    (
        "foreign slice",
        "bcd-alloc_01jz8k2v.json",
        _edit(_set_ann("bcd.dev/cgroup-parent", "system.slice")),
        "bcd.dev/cgroup-parent",
    ),
    (
        "instance binding",
        "bcd-alloc_01jz8k2v.json",
        _edit(_set_ann("bcd.dev/binding", "BINDING_INSTANCE")),
        "bcd.dev/binding",
    ),
    ("limits not JSON", "bcd-alloc_01jz8k2v.json", _edit(_set_ann("bcd.dev/limits", "{cpus")), "bcd.dev/limits"),
    (
        "limits invalid",
        "bcd-alloc_01jz8k2v.json",
        _edit(_set_ann("bcd.dev/limits", '{"cpus": "7-0"}')),
        "bcd.dev/limits",
    ),
    ("limits not a string", "bcd-alloc_01jz8k2v.json", _edit(_set_ann("bcd.dev/limits", 5)), "bcd.dev/limits"),
    ("no devices", "bcd-alloc_01jz8k2v.json", _edit(lambda s: s.__setitem__("devices", [])), "no devices"),
    (
        "device without id",
        "bcd-alloc_01jz8k2v.json",
        _edit(lambda s: s["devices"][0].pop("annotations")),
        "devices[0] has no valid bcd.dev/device-id",
    ),
    (
        "device id with a space",
        "bcd-alloc_01jz8k2v.json",
        _edit(lambda s: s["devices"][0]["annotations"].__setitem__("bcd.dev/device-id", "GPU-1 2")),
        "devices[0] has no valid bcd.dev/device-id",
    ),
    (
        "device without name",
        "bcd-alloc_01jz8k2v.json",
        _edit(lambda s: s["devices"][0].pop("name")),
        "devices[0] has no name",
    ),
]


@pytest.mark.parametrize(("filename", "data", "reason"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_parse_hold_refuses_what_is_not_a_hold(filename: str, data: bytes, reason: str) -> None:
    with pytest.raises(NotAHold) as info:
        parse_hold(filename, data)
    assert reason in info.value.reason
    assert info.value.filename == filename
    assert str(info.value).startswith(f"{filename}: ")


# ---------------------------------------------------------------------------- hold content


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: hold(()), "at least one device"),
        (lambda: hold((gpu(0),), alloc="Bad"), "not a valid id"),
        (lambda: hold((gpu(0),), binding="BINDING_INSTANCE"), "does not make a hold"),
        (lambda: hold((gpu(0),), binding="BINDING_KUBERNETES", sliced=True), "never sliced"),
        (lambda: hold((gpu(0),), mps=True), "without slots"),
        (lambda: hold((gpu(0), gpu(0))), "appears twice"),
        (lambda: hold((gpu(0),), env=("NVIDIA_VISIBLE_DEVICES=all",)), "not allowed"),
        (lambda: hold((gpu(0),), env=("BCD_X=1",)), "not allowed"),
        (lambda: hold((gpu(0),), generation=-1), "negative"),
        (lambda: HoldContent(ALLOC, RSV, 1, "BINDING_HOLD", (gpu(0),), cgroup_parent="user.slice"), "cgroup parent"),
        (
            lambda: HoldContent(ALLOC, RSV, 1, "BINDING_HOLD", (HoldDevice.for_slot(uuid(5), 4, 0),), mps_pipe_dir="/a\nB=1"),
            "env value",
        ),
        (lambda: HoldDevice("GPU-1", "vgpu", "GPU-1", 0, "GPU-1"), "unknown device kind"),  # type: ignore[arg-type]
        (lambda: HoldDevice("GPU-1", "gpu", "GPU-1", 0, "GPU-1,GPU-2"), "visible id"),
        (lambda: HoldDevice("GPU 1", "gpu", "GPU 1", 0, "GPU-1"), "not an atom id"),
    ],
)
def test_hold_content_refuses_what_could_not_be_written_or_read_back(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


# ---------------------------------------------------------------------------- device names


@pytest.mark.parametrize(
    ("atom", "name"),
    [
        (uuid(1), uuid(1)),
        (f"{uuid(1)}/gi1/ci0", f"{uuid(1)}_gi1_ci0"),
        (f"{uuid(1)}/slot2", f"{uuid(1)}_slot2"),
        ("nic.vf/0000:3b:00.2", "nic.vf_0000:3b:00.2"),
    ],
)
def test_device_names_of_well_formed_atoms(atom: str, name: str) -> None:
    assert device_name(atom) == name


@pytest.mark.parametrize("atom", ["a_b", "a//b", "-a", "a/", "GPU-1 /x", "x@y", "_", "/"])
def test_other_atoms_get_a_hashed_name(atom: str) -> None:
    name = device_name(atom)
    assert "__" in name
    assert check_cdi_rules({"bcd-a.json": _spec_with_device_names([name])}) == []


def test_device_names_do_not_collide_between_plain_and_hashed_forms() -> None:
    atoms = ["a/b", "a_b", "a//b", "a/_b", "a__b", f"{uuid(1)}/slot1", f"{uuid(1)}_slot1"]
    names = [device_name(a) for a in atoms]
    assert len(set(names)) == len(atoms)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.from_regex(r"[!-~]{1,40}", fullmatch=True), min_size=2, max_size=6, unique=True))
def test_device_names_are_valid_and_unique_for_any_atoms(atoms: list[str]) -> None:
    names = [device_name(a) for a in atoms]
    assert len(set(names)) == len(names)
    assert check_cdi_rules({"bcd-a.json": _spec_with_device_names(names)}) == []


# ---------------------------------------------------------------------------- cdiVersion


def _spec(edits: dict[str, Any] | None = None, *, kind: str = "vendor.com/x", **device: Any) -> dict[str, Any]:
    dev = {"name": "a", "containerEdits": {"env": ["A=1"]}, **device}
    spec: dict[str, Any] = {"cdiVersion": "", "kind": kind, "devices": [dev]}
    if edits is not None:
        spec["containerEdits"] = edits
    return spec


MIN_VERSIONS: list[tuple[str, dict[str, Any], str]] = [
    ("minimal", _spec(), "0.3.0"),
    ("hook env and timeout", _spec({"hooks": [{"hookName": "x", "path": "/h", "env": ["A=1"], "timeout": 5}]}), "0.3.0"),
    ("dotted vendor only", _spec(kind="vendor.example.com/gpu"), "0.3.0"),
    ("empty additionalGids", _spec({"additionalGids": []}), "0.3.0"),
    ("null intelRdt", _spec({"intelRdt": None}), "0.3.0"),
    ("mount type", _spec({"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]}), "0.4.0"),
    ("device mount type", _spec(containerEdits={"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "x"}]}), "0.4.0"),
    ("device node hostPath", _spec({"deviceNodes": [{"path": "/dev/a", "hostPath": "/dev/b"}]}), "0.5.0"),
    ("name starts with a digit", _spec(name="0"), "0.5.0"),
    ("spec annotations", {**_spec(), "annotations": {"a": "b"}}, "0.6.0"),
    ("device annotations", _spec(annotations={"a": "b"}), "0.6.0"),
    ("dot in class", _spec(kind="vendor.com/gpu.mig"), "0.6.0"),
    ("additionalGids", _spec({"additionalGids": [44]}), "0.7.0"),
    ("device additionalGids", _spec(containerEdits={"additionalGids": [44]}), "0.7.0"),
    ("intelRdt", _spec({"intelRdt": {"closID": "x"}}), "0.7.0"),
    ("intelRdt monitoring off", _spec({"intelRdt": {"enableMonitoring": False}}), "0.7.0"),
    ("intelRdt schemata", _spec({"intelRdt": {"schemata": []}}), "1.1.0"),
    ("intelRdt monitoring", _spec(containerEdits={"intelRdt": {"enableMonitoring": True}}), "1.1.0"),
    ("netDevices", _spec({"netDevices": [{"hostInterfaceName": "eth1", "name": "net1"}]}), "1.1.0"),
    ("device netDevices", _spec(containerEdits={"netDevices": [{"hostInterfaceName": "e", "name": "n"}]}), "1.1.0"),
    ("the example host's vendor spec", H200["vendor_cdi_spec"], "0.5.0"),
    ("the seed's vendor spec", SEED_VENDOR_SPEC, "0.7.0"),
]


@pytest.mark.parametrize(("spec", "version"), [m[1:] for m in MIN_VERSIONS], ids=[m[0] for m in MIN_VERSIONS])
def test_min_cdi_version(spec: dict[str, Any], version: str) -> None:
    assert min_cdi_version(spec) == version
    assert version in CDI_VERSIONS


# ---------------------------------------------------------------------------- check_cdi_rules


def _spec_with_device_names(names: list[str], *, version: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": KIND,
        "devices": [{"name": n, "containerEdits": {"env": [f"N{i}=1"]}} for i, n in enumerate(names)],
    }
    spec["cdiVersion"] = version or min_cdi_version(spec)
    return spec


def test_a_name_in_two_files_is_caught() -> None:
    # the same atom held twice (the converger's overlap check prevents it): both files name it.
    a = build_cdi_spec(hold((gpu(0),), alloc="alloc_a"), H200_VENDOR)
    b = build_cdi_spec(hold((gpu(0),), alloc="alloc_b"), H200_VENDOR)
    problems = check_cdi_rules({"bcd-alloc_a.json": a, "bcd-alloc_b.json": b})
    assert problems == [
        f"device bcd.dev/gpu={uuid(1)} appears in bcd-alloc_a.json, bcd-alloc_b.json: a runtime drops it from every file"
    ]


def test_the_same_name_under_another_kind_is_fine() -> None:
    ours = build_cdi_spec(hold((gpu(0),)), H200_VENDOR)
    assert check_cdi_rules({"bcd-alloc_01jz8k2v.json": ours, "nvidia.json": H200["vendor_cdi_spec"]}) == []


def test_a_name_twice_in_one_file_is_caught() -> None:
    problems = check_cdi_rules({"bcd-a.json": _spec_with_device_names(["x", "x"])})
    assert problems == ["bcd-a.json: devices[1]: name 'x' appears twice in the file"]


@pytest.mark.parametrize("edits", [{}, {"env": []}, {"additionalGids": [44]}, None])
def test_an_empty_device_edit_is_caught(edits: dict[str, Any] | None) -> None:
    spec = _spec_with_device_names(["x"])
    if edits is None:
        del spec["devices"][0]["containerEdits"]
    else:
        spec["devices"][0]["containerEdits"] = edits
    spec["cdiVersion"] = min_cdi_version(spec)
    assert check_cdi_rules({"bcd-a.json": spec}) == [
        "bcd-a.json: devices[0]: containerEdits are empty (a runtime rejects the device)"
    ]


@pytest.mark.parametrize("name", [f"{uuid(1)}/gi1/ci0", "-a", "a-", "", "a b", "a/b", "a\n", "é", 5])
def test_a_bad_device_name_is_caught(name: Any) -> None:
    problems = check_cdi_rules({"bcd-a.json": _spec_with_device_names([name])})
    assert len(problems) == 1 and "is not a valid CDI device name" in problems[0]


@pytest.mark.parametrize("name", ["0", "a", "6:0", f"{uuid(1)}_gi1_ci0", "a.b-c_d:e"])
def test_good_device_names_pass(name: str) -> None:
    assert check_cdi_rules({"bcd-a.json": _spec_with_device_names([name])}) == []


def test_a_wrong_cdi_version_is_caught() -> None:
    spec = build_cdi_spec(hold((gpu(0),)), H200_VENDOR)
    assert spec["cdiVersion"] == "0.6.0"
    for version, expected in [
        ("0.7.0", "bcd-x.json: cdiVersion is 0.7.0, the lowest that expresses the content is 0.6.0"),
        ("0.5.0", "bcd-x.json: cdiVersion is 0.5.0, the lowest that expresses the content is 0.6.0"),
        ("0.9.0", "bcd-x.json: cdiVersion '0.9.0' is not a released CDI version"),
        ("v0.6.0", "bcd-x.json: cdiVersion 'v0.6.0' is not a released CDI version"),
    ]:
        assert check_cdi_rules({"bcd-x.json": {**spec, "cdiVersion": version}}) == [expected]


def test_a_foreign_file_needs_only_at_least_its_minimum_version() -> None:
    vendor = H200["vendor_cdi_spec"]  # minimum 0.5.0
    assert check_cdi_rules({"nvidia.json": {**vendor, "cdiVersion": "0.7.0"}}) == []
    assert check_cdi_rules({"nvidia.json": {**vendor, "cdiVersion": "v0.5.0"}}) == []
    assert check_cdi_rules({"nvidia.json": {**vendor, "cdiVersion": "0.4.0"}}) == [
        "nvidia.json: cdiVersion is 0.4.0, the content needs at least 0.5.0"
    ]


@pytest.mark.parametrize("kind", ["gpu", "bcd.dev/", "/gpu", "bcd.dev/gpu/x", "-x.com/gpu", "x.com/gpu-", "x.com/1gpu", None])
def test_a_bad_kind_is_caught(kind: Any) -> None:
    spec = {**_spec_with_device_names(["x"]), "kind": kind}
    problems = check_cdi_rules({"other.json": {**spec, "cdiVersion": min_cdi_version(spec)}})
    assert problems == [f"other.json: kind {kind!r} is not of the form vendor.com/class"]


def test_other_problems_are_caught() -> None:
    spec = _spec_with_device_names(["x"])
    assert check_cdi_rules({"bcd-a.json": {**spec, "devices": []}}) == ["bcd-a.json: no devices (a runtime rejects the spec)"]
    assert check_cdi_rules({"bcd-a.json": []}) == ["bcd-a.json: not a JSON object"]
    bad_ann = {**spec, "annotations": {"bcd.dev/ok": "1", "Bad Key": "1", "bcd.dev/n": 2}}
    bad_ann["cdiVersion"] = min_cdi_version(bad_ann)
    assert check_cdi_rules({"bcd-a.json": bad_ann}) == [
        "bcd-a.json: annotation key 'Bad Key' is not a qualified name",
        "bcd-a.json: annotation 'bcd.dev/n' is not a string",
    ]
    bad_env = copy.deepcopy(spec)
    bad_env["devices"][0]["containerEdits"]["env"] = ["=x", "NOEQUALS"]
    assert check_cdi_rules({"bcd-a.json": bad_env}) == [
        "bcd-a.json: devices[0]: containerEdits: env entry '=x' is not KEY=VALUE",
        "bcd-a.json: devices[0]: containerEdits: env entry 'NOEQUALS' is not KEY=VALUE",
    ]


# ---------------------------------------------------------------------------- the official schema


def _schema_dir() -> Path:
    if not (SCHEMA_DIR / "schema.json").is_file():
        pytest.skip(f"CDI schema not found at {SCHEMA_DIR}")
    return SCHEMA_DIR


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_built_spec_validates_against_the_official_schema(name: str) -> None:
    assert validate_against_schema(built(name), _schema_dir()) == []


def test_the_schema_check_resolves_defs_and_catches_errors() -> None:
    schema_dir = _schema_dir()
    # the seed's literal `"env": null` in a device is what the schema refuses.
    spec = copy.deepcopy(SEED_EXPECTED)
    spec["devices"][0]["containerEdits"]["env"] = None
    assert validate_against_schema(spec, schema_dir) == ["$.devices[0].containerEdits.env: None is not of type 'array'"]
    # a rule that lives in defs.json ($ref), so the reference resolved.
    spec = copy.deepcopy(SEED_EXPECTED)
    spec["containerEdits"]["deviceNodes"].append({"hostPath": "/dev/x"})
    assert validate_against_schema(spec, schema_dir) == ["$.containerEdits.deviceNodes[2]: 'path' is a required property"]
    spec = copy.deepcopy(SEED_EXPECTED)
    spec["containerEdits"]["additionalGids"] = [-1]
    assert validate_against_schema(spec, schema_dir) == ["$.containerEdits.additionalGids[0]: -1 is less than the minimum of 0"]
    assert validate_against_schema({"kind": KIND}, schema_dir) == [
        "$: 'cdiVersion' is a required property",
        "$: 'devices' is a required property",
    ]


def test_the_vendor_specs_validate_too() -> None:
    schema_dir = _schema_dir()
    assert validate_against_schema(H200["vendor_cdi_spec"], schema_dir) == []
    assert validate_against_schema(SEED_VENDOR_SPEC, schema_dir) == []


# ---------------------------------------------------------------------------- the vendor reader in shared


def test_the_inventory_keeps_its_vendor_names_on_top_of_shared() -> None:
    import shared.vendorcdi as shared_vendorcdi
    from services.inventory.adapters import AdapterError, VendorSpecError, read_vendor_cdi
    from services.inventory.adapters import base

    assert base.VendorCdi is shared_vendorcdi.VendorCdi
    assert base.VENDOR_CDI_FILE == shared_vendorcdi.VENDOR_CDI_FILE == "nvidia.json"
    assert issubclass(VendorSpecError, AdapterError)
    assert issubclass(VendorSpecError, shared_vendorcdi.VendorSpecError)
    with pytest.raises(VendorSpecError, match="not valid JSON"):
        base.vendor_cdi_from_json(b"{", "nvidia.json")
    with pytest.raises(shared_vendorcdi.VendorSpecError, match="not valid JSON"):
        shared_vendorcdi.vendor_cdi_from_json(b"{", "nvidia.json")
    assert read_vendor_cdi(REPO / "does-not-exist") is None


_JSON_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | _JSON_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_JSON_TEXT, inner, max_size=4),
    max_leaves=20,
)


@example({"\x7f": None})  # DEL: ASCII, yet json escapes it (msgspec did not: hypothesis found it)
@given(st.dictionaries(_JSON_TEXT, _JSON, max_size=6))
def test_render_cdi_spec_writes_what_json_dumps_writes(spec: dict) -> None:
    """The fast path (msgspec) and the fallback (json, for non-ASCII text) give json.dumps's bytes."""
    assert render_cdi_spec(spec) == (json.dumps(spec, indent=2) + "\n").encode()
