"""Atoms against the device ids pods hold: pure functions, no I/O.

bcd books atoms: `GPU-<uuid>` (a whole GPU), `GPU-<uuid>/gi<N>/ci<M>` (a MIG
instance) and `GPU-<uuid>/slot<K>` (a slot, which for the driver is the whole
GPU). Pods see what the device plugin reported to the kubelet: GPU uuids,
MIG uuids (`MIG-<uuid>`, or `MIG-GPU-<uuid>/<gi>/<ci>` from old drivers) and
time-sliced replicas (`GPU-<uuid>::<n>`, `MIG-<uuid>::<n>`). The node's
inventory ties MIG uuids to atoms.

Two relations, both on a `Device` (a held device id resolved to its GPU and,
for a MIG device, its MIG instance):

- `holds(device, atom)`, for "is this atom held": a whole-GPU or slot atom is
  held by any device of its GPU (the GPU itself, a replica, any of its MIG
  devices); a MIG atom by its own MIG device or by the whole GPU. An atom whose
  MIG instance the inventory does not know is held by any device of its GPU
  (when in doubt, held).
- `within(device, atom)`, for orphans: the device lies inside what the atom
  booked (a whole GPU inside the GPU or one of its slots; a MIG device inside
  its MIG atom or its GPU's whole-GPU atom). A whole GPU is not within one of
  its MIG atoms.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from shared.schemas import Inventory

_UUID_BODY = r"[0-9A-Za-z][0-9A-Za-z-]{0,126}"
_GPU_ATOM = re.compile(rf"^(GPU-{_UUID_BODY})$")
_MIG_ATOM = re.compile(rf"^(GPU-{_UUID_BODY})/gi([0-9]{{1,4}})/ci([0-9]{{1,4}})$")
_SLOT_ATOM = re.compile(rf"^(GPU-{_UUID_BODY})/slot([0-9]{{1,4}})$")
#: MIG device ids of drivers before R470: MIG-GPU-<uuid>/<gi>/<ci>.
_LEGACY_MIG = re.compile(rf"^MIG-(GPU-{_UUID_BODY})/([0-9]{{1,4}})/([0-9]{{1,4}})$")
#: a time-sliced (shared) replica: <device id>::<n>.
_REPLICA = re.compile(r"^(.+?)::[0-9]+$")


class InvalidAtom(ValueError):
    """Not an atom id of any kind bcd books."""


@dataclass(frozen=True)
class Atom:
    """A parsed atom id; `mig_uuid` is filled from the inventory when it knows the instance."""

    id: str
    kind: str  # "gpu" | "mig" | "slot"
    gpu_uuid: str
    gi: int | None = None
    ci: int | None = None
    slot: int | None = None
    mig_uuid: str = ""


@dataclass(frozen=True)
class Device:
    """A held device, resolved: its GPU, and its MIG uuid when it is a MIG device."""

    gpu_uuid: str
    mig_uuid: str = ""

    @property
    def whole_gpu(self) -> bool:
        return not self.mig_uuid


def parse_atom(atom_id: str) -> Atom:
    if m := _GPU_ATOM.match(atom_id):
        return Atom(atom_id, "gpu", m.group(1))
    if m := _MIG_ATOM.match(atom_id):
        return Atom(atom_id, "mig", m.group(1), gi=int(m.group(2)), ci=int(m.group(3)))
    if m := _SLOT_ATOM.match(atom_id):
        return Atom(atom_id, "slot", m.group(1), slot=int(m.group(2)))
    raise InvalidAtom(f"{atom_id!r} is not an atom id (GPU-<uuid>, GPU-<uuid>/gi<N>/ci<M> or GPU-<uuid>/slot<K>)")


def strip_replica(device_id: str) -> str:
    """`GPU-<uuid>::3` -> `GPU-<uuid>` (a time-sliced replica is its device)."""
    m = _REPLICA.match(device_id)
    return m.group(1) if m else device_id


class DeviceMap:
    """The node's GPUs and MIG instances, from one Inventory."""

    def __init__(self, inventory: Inventory | None = None) -> None:
        self.gpus: set[str] = set()
        #: MIG uuid -> (GPU uuid, atom id)
        self.mig_by_uuid: dict[str, tuple[str, str]] = {}
        #: MIG atom id -> MIG uuid
        self.mig_by_atom: dict[str, str] = {}
        if inventory is not None:
            for g in inventory.gpus:
                self.gpus.add(g.uuid)
                for mi in g.mig_instances:
                    if mi.uuid:
                        self.mig_by_uuid[mi.uuid] = (g.uuid, mi.atom_id)
                        self.mig_by_atom[mi.atom_id] = mi.uuid

    def atom(self, atom_id: str) -> Atom:
        """Parse an atom id and attach its MIG uuid when the inventory knows it."""
        a = parse_atom(atom_id)
        if a.kind == "mig":
            uuid = self.mig_by_atom.get(a.id, "")
            if uuid:
                return Atom(a.id, a.kind, a.gpu_uuid, gi=a.gi, ci=a.ci, mig_uuid=uuid)
        return a

    def device(self, device_id: str) -> Device | None:
        """Resolve a device id as pods see it; None when it is not a GPU of this node."""
        did = strip_replica(device_id.strip())
        if did in self.gpus:
            return Device(did)
        if did in self.mig_by_uuid:
            return Device(self.mig_by_uuid[did][0], did)
        if m := _LEGACY_MIG.match(did):
            atom_id = f"{m.group(1)}/gi{int(m.group(2))}/ci{int(m.group(3))}"
            if m.group(1) in self.gpus:
                return Device(m.group(1), self.mig_by_atom.get(atom_id, atom_id))
            return None
        # an atom id used as a device id (a CDI device named after it, DRA)
        try:
            a = self.atom(did)
        except InvalidAtom:
            return None
        if a.gpu_uuid not in self.gpus:
            return None
        if a.kind == "mig":
            return Device(a.gpu_uuid, a.mig_uuid or a.id)
        return Device(a.gpu_uuid)

    def device_ids(self, atom: Atom) -> frozenset[str]:
        """The device ids (before any `::n`) that would hold `atom` (the mapping table)."""
        if atom.kind == "mig":
            ids = {atom.gpu_uuid}
            if atom.mig_uuid:
                ids.add(atom.mig_uuid)
            return frozenset(ids)
        ids = {atom.gpu_uuid}
        ids.update(uuid for uuid, (gpu, _) in self.mig_by_uuid.items() if gpu == atom.gpu_uuid)
        return frozenset(ids)


def holds(device: Device, atom: Atom) -> bool:
    """Does holding `device` hold (any part of) `atom`?"""
    if device.gpu_uuid != atom.gpu_uuid:
        return False
    if atom.kind in ("gpu", "slot") or device.whole_gpu:
        return True
    # a MIG device against a MIG atom: its own instance, or any when the
    # inventory does not know the atom's instance (in doubt, held)
    return not atom.mig_uuid or device.mig_uuid == atom.mig_uuid


def within(device: Device, atom: Atom) -> bool:
    """Does `device` lie inside what `atom` booked?"""
    if device.gpu_uuid != atom.gpu_uuid:
        return False
    if atom.kind in ("gpu", "slot"):
        return True
    return not device.whole_gpu and device.mig_uuid in (atom.mig_uuid, atom.id)


def within_any(device: Device, atoms: Iterable[Atom]) -> bool:
    return any(within(device, a) for a in atoms)


# --------------------------------------------------------------------------- cgroups


def is_kubepods_path(path: str) -> bool:
    """Is this cgroup path inside the kubelet's pods hierarchy?

    systemd driver: `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/...`;
    cgroupfs driver: `/kubepods/besteffort/pod<uid>/<container>`; both possibly
    nested (a kubelet in a container: `/docker/<id>/kubepods/...`).
    """
    for part in path.split("/"):
        if part in ("kubepods", "kubepods.slice") or (part.startswith("kubepods-") and part.endswith(".slice")):
            return True
    return False


def cgroup_paths(text: str) -> list[str]:
    """The paths of a /proc/<pid>/cgroup file (v2 `0::<path>`, v1 `<id>:<controllers>:<path>`)."""
    paths = []
    for line in text.splitlines():
        _, sep, rest = line.partition(":")
        _, sep2, path = rest.partition(":")
        if sep and sep2 and path:
            paths.append(path)
    return paths


def is_kubepods_cgroup(cgroup: str) -> bool:
    """A cgroup path, or a whole /proc/<pid>/cgroup file: any of its hierarchies under kubepods."""
    if "\n" in cgroup.strip() or re.match(r"^[0-9]+:[^:]*:", cgroup):
        return any(is_kubepods_path(p) for p in cgroup_paths(cgroup))
    return is_kubepods_path(cgroup)


_POD_UID = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12})")


def pod_uid(cgroup: str) -> str:
    """The pod uid a kubepods cgroup names ("" when none); systemd spells its dashes as underscores."""
    m = _POD_UID.search(cgroup)
    return m.group(1).replace("_", "-").lower() if m else ""


__all__ = [
    "Atom",
    "Device",
    "DeviceMap",
    "InvalidAtom",
    "parse_atom",
    "strip_replica",
    "holds",
    "within",
    "within_any",
    "is_kubepods_path",
    "is_kubepods_cgroup",
    "cgroup_paths",
    "pod_uid",
]
