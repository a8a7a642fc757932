"""Atom ids: what class of device an id names, and whether this node has it.

Every device of an assignment is an atom resolved against the node's current
inventory (seed: Atoms). A malformed MIG or slot id, or another class
(`nic.vf/...`, `disk/...`), is `unsupported-device`; a well-formed id the
inventory does not list is `device-missing`, with the seed's wording
(`GPU-… has no MIG instance gi1/ci0`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from shared.schemas import Gpu, Inventory

_UUID = r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
GPU_RE = re.compile(rf"^(?P<gpu>{_UUID})$")
MIG_RE = re.compile(rf"^(?P<gpu>{_UUID})/gi(?P<gi>0|[1-9][0-9]{{0,3}})/ci(?P<ci>0|[1-9][0-9]{{0,3}})$")
SLOT_RE = re.compile(rf"^(?P<gpu>{_UUID})/slot(?P<slot>0|[1-9][0-9]{{0,3}})$")

AtomKind = Literal["gpu", "mig", "slot"]


@dataclass(frozen=True)
class AtomRef:
    """A well-formed atom id, split into its parts."""

    id: str
    kind: AtomKind
    gpu: str  # the GPU's atom id, GPU-<uuid>
    gi: int = -1
    ci: int = -1
    slot: int = -1


class AtomError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def parse_atom(atom_id: str) -> AtomRef:
    """Split an atom id; AtomError(unsupported-device) when it is no GPU atom."""
    if m := GPU_RE.match(atom_id):
        return AtomRef(atom_id, "gpu", m["gpu"])
    if m := MIG_RE.match(atom_id):
        return AtomRef(atom_id, "mig", m["gpu"], gi=int(m["gi"]), ci=int(m["ci"]))
    if m := SLOT_RE.match(atom_id):
        return AtomRef(atom_id, "slot", m["gpu"], slot=int(m["slot"]))
    if atom_id.startswith("GPU-") or "/" not in atom_id:
        # a bare word ("gpu0") is no device class: it is a malformed atom id (issue 28.8)
        raise AtomError("unsupported-device", f"{atom_id} is not a well-formed GPU, MIG instance or slot id")
    cls = atom_id.split("/", 1)[0]
    raise AtomError("unsupported-device", f"{atom_id}: device class {cls} is not supported by this node")


@dataclass(frozen=True)
class ResolvedAtom:
    ref: AtomRef
    gpu: Gpu
    #: what NVIDIA_VISIBLE_DEVICES takes: the MIG uuid for a MIG instance, else the GPU uuid.
    visible_id: str


class AtomIndex:
    """The inventory's GPUs and atoms, indexed once per pass."""

    def __init__(self, inventory: Inventory | None) -> None:
        self.inventory = inventory
        self.gpus: dict[str, Gpu] = {}
        self.by_pci: dict[str, Gpu] = {}
        self.atoms: set[str] = set()
        self.mig_uuid: dict[str, str] = {}
        if inventory is not None:
            for g in inventory.gpus:
                if g.atom_id:
                    self.gpus[g.atom_id] = g
                self.by_pci[g.pci_address] = g
                for m in g.mig_instances:
                    self.mig_uuid[m.atom_id] = m.uuid
            self.atoms = {a.id for a in inventory.atoms}

    def resolve(self, atom_id: str) -> ResolvedAtom:
        ref = parse_atom(atom_id)
        gpu = self.gpus.get(ref.gpu)
        if gpu is None:
            raise AtomError("device-missing", f"{ref.gpu} is not on this node")
        if atom_id not in self.atoms:
            if ref.kind == "mig":
                raise AtomError("device-missing", f"{ref.gpu} has no MIG instance gi{ref.gi}/ci{ref.ci}")
            if ref.kind == "slot":
                raise AtomError("device-missing", f"{ref.gpu} has no slot{ref.slot}")
            raise AtomError("device-missing", f"{ref.gpu} is not on this node")
        if ref.kind == "mig":
            visible = self.mig_uuid.get(atom_id, "")
            if not visible:
                # exposing the whole card for a MIG instance would grant too much
                raise AtomError("device-missing", f"{ref.gpu} reports no MIG device uuid for gi{ref.gi}/ci{ref.ci}")
            return ResolvedAtom(ref, gpu, visible)
        return ResolvedAtom(ref, gpu, gpu.uuid)

    def all_gpus(self) -> list[str]:
        return sorted(self.gpus)


__all__ = ["AtomKind", "AtomRef", "AtomError", "parse_atom", "ResolvedAtom", "AtomIndex"]
