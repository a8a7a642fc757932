"""A hold to and from the root helper: `hold_to_wire`/`hold_from_wire` carry a HoldContent as typed fields only.

No path, device node, mount or hook crosses: the helper rebuilds every atom
id, visible id and vendor name from the typed parts exactly as the
converger's planner derives them from the inventory, and checks the limits
against its own bounds, so a request can ask for nothing the helper would not
write itself. `hold_to_wire` refuses a hold the helper would not rebuild unchanged.
"""

from __future__ import annotations

import re
from pathlib import PurePath

import msgspec

from shared.schemas import HugePages, Limits
from shared.schemas.bus import (
    GPU_UUID_PATTERN,
    HELPER_MAX_CPU,
    HELPER_MAX_NUMA_NODE,
    MIG_UUID_PATTERN,
    HelperDevice,
    HelperHold,
    HelperHugePages,
    HelperLimits,
)
from shared.schemas.common import ID_RE
from shared.slices import parse_cpulist, slice_name

from .content import HoldContent, HoldDevice, checked_id, claim_mps_pipe_dir

# Patterns end in `\Z`, not `$`: `$` also matches before a trailing newline.
_GPU_UUID_RE = re.compile(GPU_UUID_PATTERN)
_MIG_UUID_RE = re.compile(MIG_UUID_PATTERN)


def gpu_atom_of(gpu_uuid: str) -> str:
    """The atom id of a whole GPU from NVML's uuid ("GPU-..." as is; a bare uuid gets the prefix)."""
    return gpu_uuid if gpu_uuid.startswith("GPU-") else f"GPU-{gpu_uuid}"


def device_from_wire(w: HelperDevice) -> HoldDevice:
    """A HoldDevice from typed parts: atom id, visible id and vendor names are derived here,
    exactly as the converger's planner derives them from the inventory."""
    if not _GPU_UUID_RE.search(w.gpu_uuid):
        raise ValueError(f"gpu uuid {w.gpu_uuid!r} is not an NVML GPU uuid")
    gpu = gpu_atom_of(w.gpu_uuid)
    if w.kind == "mig":
        if w.gi is None or w.ci is None or w.slot is not None:
            raise ValueError(f"{gpu}: a MIG device needs gi and ci and no slot")
        if not _MIG_UUID_RE.search(w.mig_uuid):
            raise ValueError(f"{gpu}/gi{w.gi}/ci{w.ci}: MIG uuid {w.mig_uuid!r} is not of the form MIG-...")
        return HoldDevice(f"{gpu}/gi{w.gi}/ci{w.ci}", "mig", w.gpu_uuid, w.gpu_index, w.mig_uuid, (w.mig_uuid,))
    if w.gi is not None or w.ci is not None or w.mig_uuid:
        raise ValueError(f"{gpu}: gi, ci and mig_uuid are for MIG devices only")
    if w.share_id and w.kind != "gpu":
        raise ValueError(f"{gpu}: a share id is a whole card's")
    if w.kind == "vfio":
        if w.iommu_group is None or w.slot is not None:
            raise ValueError(f"{gpu}: a card passed through needs its IOMMU group and no slot")
        return HoldDevice.for_vfio(w.gpu_uuid, w.gpu_index, w.iommu_group)
    if w.iommu_group is not None:
        raise ValueError(f"{gpu}: an IOMMU group is for a card passed through (vfio) only")
    names = (w.gpu_uuid, str(w.gpu_index))
    if w.kind == "slot":
        if w.slot is None:
            raise ValueError(f"{gpu}: a slot needs its number")
        return HoldDevice(f"{gpu}/slot{w.slot}", "slot", w.gpu_uuid, w.gpu_index, w.gpu_uuid, names)
    if w.slot is not None:
        raise ValueError(f"{gpu}: slot is for slots only")
    return HoldDevice(gpu, "gpu", w.gpu_uuid, w.gpu_index, w.gpu_uuid, names, share_id=w.share_id)


_MIG_SUFFIX_RE = re.compile(r"^/gi(0|[1-9][0-9]{0,3})/ci(0|[1-9][0-9]{0,3})\Z")
_SLOT_SUFFIX_RE = re.compile(r"^/slot(0|[1-9][0-9]{0,3})\Z")


def device_to_wire(d: HoldDevice) -> HelperDevice:
    """The typed parts of a HoldDevice; ValueError when the helper would not rebuild it exactly."""
    gpu = gpu_atom_of(d.gpu_uuid)
    suffix = d.atom_id[len(gpu):] if d.atom_id.startswith(gpu) else None
    gi = ci = slot = None
    if d.kind == "mig" and suffix is not None and (m := _MIG_SUFFIX_RE.match(suffix)):
        gi, ci = int(m[1]), int(m[2])
    elif d.kind == "slot" and suffix is not None and (m := _SLOT_SUFFIX_RE.match(suffix)):
        slot = int(m[1])
    elif not (d.kind in ("gpu", "vfio") and suffix == ""):
        raise ValueError(f"{d.atom_id}: atom id does not follow from GPU uuid {d.gpu_uuid!r} and kind {d.kind}")
    try:
        w = HelperDevice(
            kind=d.kind,
            gpu_uuid=d.gpu_uuid,
            gpu_index=d.gpu_index,
            gi=gi,
            ci=ci,
            slot=slot,
            mig_uuid=d.visible_id if d.kind == "mig" else "",
            iommu_group=d.iommu_group,
            share_id=d.share_id,
        )
        again = device_from_wire(w)
    except ValueError as exc:
        raise ValueError(f"{d.atom_id} cannot be written through the root helper: {exc}") from None
    if again != d:
        raise ValueError(f"{d.atom_id} cannot be written through the root helper: its visible id or vendor names are not the derived ones")
    return w


def _bounded_list(text: str, what: str, highest: int) -> str:
    try:
        numbers = parse_cpulist(text)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if numbers[-1] > highest:
        raise ValueError(f"{what} {text!r}: {numbers[-1]} is above the highest allowed, {highest}")
    return text


def limits_from_wire(w: HelperLimits) -> Limits:
    """Limits from a helper request, within the helper's bounds; ValueError names what is out of bounds."""
    if w.cpus is not None:
        _bounded_list(w.cpus, "cpus", HELPER_MAX_CPU)
    if w.mems is not None:
        _bounded_list(w.mems, "mems", HELPER_MAX_NUMA_NODE)
    if w.cpu_millis is not None and w.cpu_millis <= 0:
        raise ValueError(f"cpu_millis {w.cpu_millis}: a CPU quota must be positive")
    for h in w.hugepages:
        if h.page_size_kib & (h.page_size_kib - 1):
            raise ValueError(f"hugepages: page size {h.page_size_kib} KiB is not a power of two")
    try:
        return Limits(
            cpus=w.cpus,
            cpu_millis=w.cpu_millis,
            memory_bytes=w.memory_bytes,
            hugepages=[HugePages(page_size_kib=h.page_size_kib, count=h.count) for h in w.hugepages],
            mems=w.mems,
        )
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ValueError(f"limits: {exc}") from None


def limits_to_wire(limits: Limits) -> HelperLimits:
    return HelperLimits(
        cpus=limits.cpus,
        cpu_millis=limits.cpu_millis,
        memory_bytes=limits.memory_bytes,
        hugepages=[HelperHugePages(page_size_kib=h.page_size_kib, count=h.count) for h in limits.hugepages],
        mems=limits.mems,
    )


def hold_from_wire(w: HelperHold, mps_pipe_dir: str, *, mps_root: str = "") -> HoldContent:
    """The HoldContent a helper request describes; `mps_pipe_dir` is the helper's own (slots), and
    a claim's MPS pipe directory is `<mps_root>/<control>/pipe` (the helper's root, never the wire's).

    ValueError (the text says what) for anything HoldContent refuses: a bad id,
    a malformed env line or one whose key no spec may set (bcd's own, or one the loader,
    libc, the runtime's hook or a shell reads: common.env_key_problem), an atom twice, a
    sliced Kubernetes hold.
    """
    checked_id(w.allocation_id)
    if not ID_RE.match(w.reservation_id):
        raise ValueError(f"reservation id {w.reservation_id!r} is not a valid id")
    return HoldContent(
        allocation_id=w.allocation_id,
        reservation_id=w.reservation_id,
        generation=w.generation,
        binding=w.binding,
        devices=tuple(device_from_wire(d) for d in w.devices),
        cgroup_parent=slice_name(w.allocation_id) if w.sliced else "",
        env=tuple(w.env),
        mps_pipe_dir=claim_mps_pipe_dir(mps_root, w.mps_control) if w.mps_control else (mps_pipe_dir if w.mps else ""),
        limits=limits_from_wire(w.limits) if w.limits is not None else None,
        mps_control=w.mps_control,
    )


def hold_to_wire(c: HoldContent) -> HelperHold:
    """The typed fields of a HoldContent; ValueError when the helper would not rebuild it exactly."""
    w = HelperHold(
        allocation_id=c.allocation_id,
        reservation_id=c.reservation_id,
        generation=c.generation,
        binding=c.binding,  # type: ignore[arg-type]
        devices=[device_to_wire(d) for d in c.devices],
        sliced=bool(c.cgroup_parent),
        env=list(c.env),
        mps=bool(c.mps_pipe_dir) and not c.mps_control,
        limits=limits_to_wire(c.limits) if c.limits is not None else None,
        mps_control=c.mps_control,
    )
    # a claim's pipe directory is <root>/<control>/pipe: the root it was built from
    root = str(PurePath(c.mps_pipe_dir).parent.parent) if c.mps_control else ""
    if hold_from_wire(w, c.mps_pipe_dir, mps_root=root) != c:
        raise ValueError(f"{c.allocation_id}: the hold cannot be written through the root helper unchanged")
    return w
