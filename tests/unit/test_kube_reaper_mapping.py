"""kube_reaper's pure mapping: atoms against the device ids pods hold, and kubepods cgroups."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from services.kube_reaper.devices import (
    Device,
    DeviceMap,
    InvalidAtom,
    holds,
    is_kubepods_cgroup,
    is_kubepods_path,
    parse_atom,
    pod_uid,
    strip_replica,
    within,
)
from shared.schemas import Gpu, Inventory, MigInstance, Slot

A = "GPU-aaaaaaaa-0000-4000-8000-000000000001"  # a whole card
B = "GPU-bbbbbbbb-0000-4000-8000-000000000002"  # MIG mode: gi1/ci0, gi2/ci0
C = "GPU-cccccccc-0000-4000-8000-000000000003"  # two slots
MIG_B10 = "MIG-bbbbbbbb-0001-4000-8000-000000000010"
MIG_B20 = "MIG-bbbbbbbb-0002-4000-8000-000000000020"


def short(value: object) -> str:
    """Test ids with the uuids named by their letters."""
    text = str(value)
    for uuid, name in ((MIG_B10, "MIG_B10"), (MIG_B20, "MIG_B20"), (A, "A"), (B, "B"), (C, "C")):
        text = text.replace(uuid, name)
    return text


def inventory() -> Inventory:
    return Inventory(
        node_id="node-1",
        observed_at=datetime(2026, 1, 1, tzinfo=timezone.utc),
        gpus=[
            Gpu(atom_id=A, uuid=A, index=0, pci_address="0000:18:00.0"),
            Gpu(
                atom_id=B,
                uuid=B,
                index=1,
                pci_address="0000:2a:00.0",
                mig_mode=True,
                mig_instances=[
                    MigInstance(atom_id=f"{B}/gi1/ci0", uuid=MIG_B10, gi=1, ci=0),
                    MigInstance(atom_id=f"{B}/gi2/ci0", uuid=MIG_B20, gi=2, ci=0),
                ],
            ),
            Gpu(
                atom_id=C,
                uuid=C,
                index=2,
                pci_address="0000:3a:00.0",
                slots=[Slot(atom_id=f"{C}/slot0", index=0), Slot(atom_id=f"{C}/slot1", index=1)],
            ),
        ],
    )


@pytest.fixture
def dmap() -> DeviceMap:
    return DeviceMap(inventory())


# --------------------------------------------------------------------------- atoms


@pytest.mark.parametrize(
    ("atom_id", "kind", "gpu", "extra"),
    [
        (A, "gpu", A, {}),
        (f"{B}/gi1/ci0", "mig", B, {"gi": 1, "ci": 0}),
        (f"{B}/gi13/ci2", "mig", B, {"gi": 13, "ci": 2}),
        (f"{C}/slot1", "slot", C, {"slot": 1}),
    ],
)
def test_atom_ids_parse(atom_id, kind, gpu, extra):
    a = parse_atom(atom_id)
    assert (a.kind, a.gpu_uuid) == (kind, gpu)
    for k, v in extra.items():
        assert getattr(a, k) == v


@pytest.mark.parametrize(
    "atom_id",
    ["not-an-atom", MIG_B10, "0000:18:00.0", f"{A}/gi1", f"{A}/gi1/ci", f"{A}/slot", f"{A}::1", f"{A}/mig1", "GPU-", ""],
    ids=short,
)
def test_invalid_atoms_are_refused(atom_id):
    with pytest.raises(InvalidAtom):
        parse_atom(atom_id)


# --------------------------------------------------------------------------- the mapping table

MAPPING = [
    # atom -> the device ids (before ::n) that hold it
    (A, {A}),
    (f"{B}/gi1/ci0", {B, MIG_B10}),
    (f"{B}/gi2/ci0", {B, MIG_B20}),
    (B, {B, MIG_B10, MIG_B20}),
    (f"{C}/slot0", {C}),
    (f"{C}/slot1", {C}),
    (f"{B}/gi9/ci0", {B}),  # an instance the inventory does not know: only its card is known
]


@pytest.mark.parametrize(("atom_id", "device_ids"), MAPPING, ids=[short(m[0]) for m in MAPPING])
def test_atom_to_device_ids(dmap, atom_id, device_ids):
    assert dmap.device_ids(dmap.atom(atom_id)) == device_ids


@pytest.mark.parametrize(
    ("device_id", "device"),
    [
        (A, Device(A)),
        (f"{A}::0", Device(A)),  # time-sliced replicas are their card
        (f"{A}::17", Device(A)),
        (MIG_B10, Device(B, MIG_B10)),
        (f"{MIG_B20}::3", Device(B, MIG_B20)),  # a replica of a MIG device
        (f"MIG-{B}/1/0", Device(B, MIG_B10)),  # pre-R470 MIG device id
        (f"MIG-{B}/7/0", Device(B, f"{B}/gi7/ci0")),  # ... of an instance the inventory does not know
        (f"{B}/gi2/ci0", Device(B, MIG_B20)),  # an atom id as a device id (CDI device name under DRA)
        (f"{C}/slot1", Device(C)),
        ("GPU-99999999-0000-4000-8000-000000000009", None),  # not a card of this node
        ("MIG-99999999-0000-4000-8000-000000000009", None),
        ("0", None),  # device plugins' index ids are not GPU ids
        ("nvidia0", None),
    ],
    ids=short,
)
def test_device_ids_resolve_through_the_inventory(dmap, device_id, device):
    assert dmap.device(device_id) == device


def test_strip_replica():
    assert strip_replica(f"{A}::3") == A
    assert strip_replica(A) == A
    assert strip_replica("odd::name::2") == "odd::name"


HELD = [
    # (atom, held device id, held?)
    (A, A, True),
    (A, f"{A}::4", True),
    (A, B, False),
    (f"{B}/gi1/ci0", MIG_B10, True),
    (f"{B}/gi1/ci0", f"{MIG_B10}::1", True),
    (f"{B}/gi1/ci0", MIG_B20, False),  # the sibling instance does not hold it
    (f"{B}/gi1/ci0", B, True),  # the whole card does
    (B, MIG_B10, True),  # the card is held when any MIG device of it is
    (B, MIG_B20, True),
    (B, f"{B}::2", True),
    (f"{C}/slot0", C, True),  # a slot is the whole card for the driver
    (f"{C}/slot1", f"{C}::0", True),
    (f"{C}/slot1", A, False),
    (f"{B}/gi9/ci0", MIG_B10, True),  # an unknown instance: any device of its card may be it
    (f"{B}/gi9/ci0", A, False),
]


@pytest.mark.parametrize(("atom_id", "device_id", "expected"), HELD, ids=short)
def test_holds(dmap, atom_id, device_id, expected):
    dev = dmap.device(device_id)
    assert dev is not None
    assert holds(dev, dmap.atom(atom_id)) is expected


WITHIN = [
    # (held device id, known atom, inside what the atom booked?)
    (A, A, True),
    (f"{A}::1", A, True),
    (MIG_B10, f"{B}/gi1/ci0", True),
    (MIG_B10, f"{B}/gi2/ci0", False),
    (MIG_B10, B, True),
    (B, f"{B}/gi1/ci0", False),  # the whole card is more than one of its instances
    (C, f"{C}/slot0", True),
    (f"{C}::1", f"{C}/slot1", True),
    (A, C, False),
]


@pytest.mark.parametrize(("device_id", "atom_id", "expected"), WITHIN, ids=short)
def test_within_for_orphans(dmap, device_id, atom_id, expected):
    dev = dmap.device(device_id)
    assert dev is not None
    assert within(dev, dmap.atom(atom_id)) is expected


def test_without_an_inventory_nothing_resolves():
    empty = DeviceMap()
    assert empty.device(A) is None and empty.device(MIG_B10) is None
    assert empty.atom(f"{B}/gi1/ci0").mig_uuid == ""


# --------------------------------------------------------------------------- kubepods cgroups

KUBEPODS = [
    # cgroup v2, systemd driver (burstable, besteffort, guaranteed)
    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod3c1e7a52_9b0d_4f61_a8e2_5d7c4b1f0a93.slice/cri-containerd-8f2b6c1d.scope",
    "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f5e2b7c_1a2b_4c3d_8e9f_0a1b2c3d4e5f.slice/crio-4a7c0e9d.scope",
    "/kubepods.slice/kubepods-pod0f5e2b7c_1a2b_4c3d_8e9f_0a1b2c3d4e5f.slice/cri-containerd-1.scope",
    # cgroupfs driver (v1 and v2)
    "/kubepods/besteffort/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c0e9d1b2f",
    "/kubepods/burstable/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c0e9d1b2f",
    "/kubepods/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c0e9d1b2f",
    # a kubelet inside a container (kind, docker-in-docker)
    "/docker/1d2e3f/kubepods/besteffort/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c",
    "/system.slice/docker-1d2e3f.scope/kubepods.slice/kubepods-burstable.slice/x.scope",
]

NOT_KUBEPODS = [
    "/user.slice/user-1000.slice/session-4.scope",
    "/system.slice/containerd.service",
    "/system.slice/bcd-alloc-alloc_1.slice/job.scope",
    "/bcd-alloc-kubepods.slice",  # the word alone is not the hierarchy
    "/mykubepods/pod1",
    "/",
    "",
]


@pytest.mark.parametrize("path", KUBEPODS)
def test_kubepods_paths(path):
    assert is_kubepods_path(path) and is_kubepods_cgroup(path)


@pytest.mark.parametrize("path", NOT_KUBEPODS)
def test_paths_outside_kubepods(path):
    assert not is_kubepods_path(path) and not is_kubepods_cgroup(path)


def test_whole_proc_cgroup_files():
    v2 = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f5e2b7c_1a2b_4c3d_8e9f_0a1b2c3d4e5f.slice/cri-containerd-1.scope\n"
    v1 = (
        "12:pids:/kubepods/besteffort/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c\n"
        "11:devices:/kubepods/besteffort/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c\n"
        "1:name=systemd:/kubepods/besteffort/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c\n"
    )
    hybrid_user = "12:pids:/user.slice/user-1000.slice\n1:name=systemd:/user.slice/user-1000.slice/session-4.scope\n0::/user.slice/user-1000.slice/session-4.scope\n"
    assert is_kubepods_cgroup(v2)
    assert is_kubepods_cgroup(v1)
    assert not is_kubepods_cgroup(hybrid_user)
    assert not is_kubepods_cgroup("0::/\n")


@pytest.mark.parametrize(
    ("cgroup", "uid"),
    [
        (KUBEPODS[0], "3c1e7a52-9b0d-4f61-a8e2-5d7c4b1f0a93"),
        (KUBEPODS[3], "0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f"),
        (NOT_KUBEPODS[0], ""),
    ],
)
def test_pod_uid_from_cgroup(cgroup, uid):
    assert pod_uid(cgroup) == uid
