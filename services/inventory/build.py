"""The vendor-neutral core of the inventory: adapter facts in, an `Inventory` out.

Pure (no clock, no files of its own; everything comes from the adapter and the
arguments), so the same host read yields byte-identical content and the
service can tell a change from a re-read by `inventory_content_key`.

It owns three things no adapter may decide:
- atom ids: a GPU's atom id IS its vendor uuid ("GPU-..."), a MIG instance is
  "GPU-<uuid>/gi<N>/ci<M>", a slot "GPU-<uuid>/slot<K>" (K from 0);
- which atoms exist: MIG instances and slots only on a card driven by its
  compute driver, never slots on a card in MIG mode (a GPU instance with no
  compute instance is listed in `gpu_instances`, but is no atom);
- the first PhysicalGPU status of each card (seed 003): driverBinding from the
  bound driver, the AdapterReady condition, and the phase derived from them by
  physicalgpu's `derive_phase` table, never set directly. managementState
  stays Unknown (Managed=Unknown/Indeterminate) here; the service's
  GpuTracker (gpustate.py) derives the rest from the claims and its state.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import msgspec

from shared.schemas import (
    Atom,
    Condition,
    DriverBinding,
    Gpu,
    GpuInstance,
    Inventory,
    MigInstance,
    MigPlacement,
    MigProfile,
    PhysicalGPUStatus,
    Slot,
)
from shared.schemas.inventory import DriverMode

from .adapters.base import GpuFacts, GpuSharer, MigCapable, MigInstancer, SharingCapable, VendorAdapter, VfioCapable
from .features import card_labels
from .physicalgpu import (
    ADAPTER_READY,
    FAILED_REASONS,
    INDETERMINATE,
    MANAGED,
    RECONFIGURING,
    VFIO_DRIVER,
    condition_of,
    derive_phase,
)

# The PhysicalGPU constants and the phase table live in physicalgpu.py (one
# table for the first status here and the full one the GpuTracker derives).
# --------------------------------------------------------------------------- atom ids


def gpu_atom_id(uuid: str) -> str:
    """The atom id of a whole GPU: NVML's uuid as is ("GPU-..."), never "GPU-GPU-..."."""
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def mig_atom_id(gpu_uuid: str, gi: int, ci: int) -> str:
    return f"{gpu_atom_id(gpu_uuid)}/gi{gi}/ci{ci}"


def slot_atom_id(gpu_uuid: str, k: int) -> str:
    return f"{gpu_atom_id(gpu_uuid)}/slot{k}"


# --------------------------------------------------------------------------- PhysicalGPU status


def driver_mode(driver: str) -> DriverMode:
    """Mode of the binding: vfio-pci is Passthrough, no driver None, any other driver Compute."""
    if driver == VFIO_DRIVER:
        return "Passthrough"
    if not driver:
        return "None"
    return "Compute"


def adapter_ready(mode: DriverMode, driver: str, *, now: datetime, readable: bool = True) -> Condition:
    """The AdapterReady condition the binding (and whether the vendor library reads the card) implies."""
    if mode == "Compute" and not readable:
        # bound to its driver, yet the vendor library cannot read it (a GPU
        # that fell off the bus): never Ready, so nothing is placed on it.
        return Condition(
            type=ADAPTER_READY,
            status="False",
            reason="VendorLibraryCannotRead",
            message=f"bound to {driver}, but the vendor library does not see the card",
            since=now,
        )
    if mode == "Compute":
        return Condition(
            type=ADAPTER_READY,
            status="True",
            reason="AdapterReady",
            message=f"bound to {driver}; the vendor adapter reads the card",
            since=now,
        )
    if mode == "Passthrough":
        # a card on vfio-pci legitimately has no adapter readiness (seed 003);
        # derive_phase reads the mode first, so this never makes it Initializing.
        return Condition(
            type=ADAPTER_READY,
            status="False",
            reason="Passthrough",
            message=f"bound to {VFIO_DRIVER}; the vendor adapter does not drive a card in passthrough",
            since=now,
        )
    return Condition(
        type=ADAPTER_READY,
        status="False",
        reason="NoDriver",
        message="no kernel driver is bound to the card",
        since=now,
    )


def managed_unknown(*, now: datetime) -> Condition:
    return Condition(
        type=MANAGED,
        status="Unknown",
        reason=INDETERMINATE,
        message="management state not derived yet",
        since=now,
    )


def _keep_since(conditions: list[Condition], previous: Sequence[Condition]) -> list[Condition]:
    """A condition whose status and reason did not change keeps its transition time."""
    out: list[Condition] = []
    for c in conditions:
        old = condition_of(previous, c.type)
        if old is not None and old.status == c.status and old.reason == c.reason:
            c = msgspec.structs.replace(c, since=old.since)
        out.append(c)
    return out


def derive_status(
    driver: str,
    *,
    now: datetime,
    readable: bool = True,
    previous: PhysicalGPUStatus | None = None,
) -> PhysicalGPUStatus:
    """A card's first PhysicalGPU status from what the kernel has bound to it."""
    mode = driver_mode(driver)
    conditions = [adapter_ready(mode, driver, now=now, readable=readable), managed_unknown(now=now)]
    if previous is not None:
        conditions = _keep_since(conditions, previous.conditions)
    return PhysicalGPUStatus(
        phase=derive_phase(mode, conditions),
        driver_binding=DriverBinding(driver=driver, mode=mode, management_state="Unknown"),
        conditions=conditions,
    )


# --------------------------------------------------------------------------- the inventory


def _placement(start: int | None, size: int | None) -> MigPlacement | None:
    return MigPlacement(start=start, size=size) if start is not None and size is not None else None


def _build_gpu(
    adapter: VendorAdapter,
    facts: GpuFacts,
    *,
    vendor: str,
    mps_running: bool,
    now: datetime,
    previous: Gpu | None,
) -> Gpu:
    if isinstance(adapter, VfioCapable):
        driver, base_driver = adapter.driver_binding(facts.pci_address)
    else:
        # an adapter without VFIO knows only cards its vendor library drives,
        # i.e. cards on their native driver, which it names after the vendor.
        driver, base_driver = adapter.vendor(), adapter.vendor()
    status = derive_status(
        driver, now=now, readable=facts.readable, previous=previous.status if previous is not None else None
    )
    # MIG instances and slots only on a card its compute driver runs and the vendor library reads.
    compute = status.driver_binding.mode == "Compute" and facts.readable
    uuid = facts.uuid
    atom = gpu_atom_id(uuid) if uuid else ""

    profiles: list[MigProfile] = []
    instances: list[MigInstance] = []
    gpu_instances: list[GpuInstance] = []
    slots: list[Slot] = []
    if compute and uuid:
        if isinstance(adapter, MigCapable):
            profiles = sorted(adapter.mig_profiles(uuid), key=lambda p: (p.profile_id, p.name))
            if facts.mig_mode:
                instances = [
                    MigInstance(
                        atom_id=mig_atom_id(uuid, m.gi, m.ci),
                        uuid=m.uuid,
                        gi=m.gi,
                        ci=m.ci,
                        profile=m.profile,
                        memory_bytes=m.memory_bytes,
                        placement=_placement(m.start, m.size),
                    )
                    for m in sorted(adapter.mig_instances(uuid), key=lambda m: (m.gi, m.ci))
                ]
        if facts.mig_mode and isinstance(adapter, MigInstancer):
            gpu_instances = [
                GpuInstance(
                    gi=g.gi,
                    profile=g.profile,
                    profile_id=g.profile_id,
                    placement=_placement(g.start, g.size),
                    compute_instances=g.compute_instances,
                )
                for g in sorted(adapter.gpu_instances(uuid), key=lambda g: g.gi)
            ]
        if not facts.mig_mode and isinstance(adapter, SharingCapable):
            slots = [Slot(atom_id=slot_atom_id(uuid, k), index=k) for k in range(max(adapter.slots_per_gpu(uuid), 0))]

    return Gpu(
        atom_id=atom,
        uuid=uuid,
        index=facts.index,
        pci_address=facts.pci_address,
        name=facts.name,
        vendor=vendor,
        memory_bytes=facts.memory_bytes,
        numa_node=facts.numa_node,
        driver=driver,
        base_driver=base_driver,
        compute_capability=facts.compute_capability,
        mig_mode=facts.mig_mode,
        mig_profiles=profiles,
        mig_instances=instances,
        gpu_instances=gpu_instances,
        slots=slots,
        mps_running=bool(slots) and mps_running,
        iommu_group=facts.iommu_group,
        status=status,
    )


def _atoms(gpu: Gpu) -> list[Atom]:
    if not gpu.atom_id:
        return []  # a card whose uuid is unknown cannot be booked by atom id
    atoms = [Atom(id=gpu.atom_id, kind="gpu", gpu_uuid=gpu.uuid, pci_address=gpu.pci_address)]
    atoms += [Atom(id=m.atom_id, kind="mig", gpu_uuid=gpu.uuid, pci_address=gpu.pci_address) for m in gpu.mig_instances]
    atoms += [Atom(id=s.atom_id, kind="slot", gpu_uuid=gpu.uuid, pci_address=gpu.pci_address) for s in gpu.slots]
    return atoms


def build_inventory(
    adapter: VendorAdapter,
    *,
    node_id: str,
    revision: int,
    now: datetime,
    previous: Inventory | None = None,
) -> Inventory:
    """Read the host through `adapter` once and describe it.

    `previous` (the last published inventory) only carries condition
    transition times over, so an unchanged condition keeps its `since`.
    """
    scan = adapter.read_capabilities()
    vendor = adapter.vendor()
    sharing = adapter if isinstance(adapter, SharingCapable) else None
    mps_running = sharing.mps_running() if sharing is not None else False
    before = {g.pci_address: g for g in previous.gpus} if previous is not None else {}

    gpus = [
        _build_gpu(adapter, f, vendor=vendor, mps_running=mps_running, now=now, previous=before.get(f.pci_address))
        for f in sorted(scan.gpus, key=lambda f: (f.index, f.pci_address))
    ]
    # each PhysicalGPU's labels (seed 003): vendor, device, node, the sharing it supports
    sharer = isinstance(adapter, GpuSharer)
    gpus = [msgspec.structs.replace(g, labels=card_labels(g, node_id=node_id, sharer=sharer).labels) for g in gpus]
    position = {g.uuid: g.index for g in gpus}
    atoms = sorted((a for g in gpus for a in _atoms(g)), key=lambda a: (position[a.gpu_uuid], a.id))
    return Inventory(
        node_id=node_id,
        revision=revision,
        observed_at=now,
        vendor=vendor,
        driver_version=scan.driver_version,
        cuda_driver_version=scan.cuda_driver_version,
        boot_id=scan.boot_id,
        gpus=gpus,
        atoms=atoms,
        host=scan.host,
        mps_pipe_dir=sharing.mps_pipe_dir() if sharing is not None else "",
        processes=sorted(scan.processes, key=lambda p: (p.pid, p.gpu_uuid)),
    )


def inventory_content_key(inv: Inventory) -> bytes:
    """The inventory's content as bytes, without observed_at, revision and condition times.

    Two reads of an unchanged host give the same key; the service bumps the
    revision only when the key changes.
    """
    data = msgspec.to_builtins(inv)
    data.pop("observed_at", None)
    data.pop("revision", None)
    for gpu in data.get("gpus", []):
        for condition in gpu.get("status", {}).get("conditions", []):
            condition.pop("since", None)
    return msgspec.json.encode(data)


def next_revision(previous: Inventory | None, candidate: Inventory) -> int:
    """The revision `candidate` should carry: the previous one, plus one when the content changed."""
    if previous is None:
        return max(candidate.revision, 1)
    if inventory_content_key(previous) == inventory_content_key(candidate):
        return previous.revision
    return previous.revision + 1


__all__ = [
    "VFIO_DRIVER",
    "ADAPTER_READY",
    "MANAGED",
    "RECONFIGURING",
    "FAILED_REASONS",
    "gpu_atom_id",
    "mig_atom_id",
    "slot_atom_id",
    "driver_mode",
    "adapter_ready",
    "managed_unknown",
    "derive_phase",
    "derive_status",
    "build_inventory",
    "inventory_content_key",
    "next_revision",
]
