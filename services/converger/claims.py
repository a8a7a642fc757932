"""DRA claims as holds of their own: `<cdi_dir>/bcd-claim-<uid>.json` (DESIGN 10).

The kubelet plugin (services/dra_plugin) asks `converger.claim_prepare` with the
devices the scheduler allocated to a ResourceClaim, resolved to cards; this
module decides (`check_claim`, pure: the same conflicts as any hold, naming the
holder) and makes the hold: the claim is journaled in `ConvergerState.claims`
before its first side effect, each MIG instance it needs is made through the
inventory one NVML step at a time with the step journaled before it is asked
(`ClaimMig`), then the CDI spec is written through the same HostWriter as every
hold. Unprepare removes the CDI spec first (no new container gets the device),
then destroys compute instance, then GPU instance.

Restarts (`ClaimKeeper.reconcile`): a claim still `preparing` is rolled back
(what it made or may have made is destroyed: a GPU instance asked for whose
answer was lost is found by its placement), an `unpreparing` one is finished,
and a prepared one from an earlier boot whose MIG instance is gone is dropped
(the kubelet prepares it again). MIG instances of prepared claims are kept.

Admin access (KEP-5018, `adminAccess: true` on an allocation result): a monitoring claim's look
at a device that others may hold. Such a device is checked only for what it can see (the card is
there, on this node's driver: never one passed through to a VM or a VFIO claim), is held by
nobody (other claims, holds and VMs pass it over, `claim_holders` leaves it out), and makes
nothing: no MIG instance (a MIG device names the instance another claim made at its placement,
or nothing), no MPS daemon, time slice or switch. Its CDI spec is the same read of the device.

Claims are Kubernetes' business: nothing here goes upstream. They are in the
node's card claims (kind "claim"), so VMs, resets, diagnostics, MIG layouts and
new holds see them, and a pass never releases them.

claimdesk.py runs each prepare and unprepare under the pass lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from shared import logs
import msgspec

from shared.holdfiles import BINDING_CLAIM, KIND, HoldContent, HoldDevice, HoldOnDisk, claim_hold_id, claim_mps_pipe_dir, device_name
from shared.schemas import (
    ClaimDevice,
    ClaimSharing,
    MpsDaemonSpec,
    SharingStepReply,
    SharingStepRequest,
    SwitchReply,
    SwitchRequest,
    ClaimPrepareReply,
    ClaimPrepareRequest,
    ClaimSummary,
    ClaimUnprepareReply,
    Gpu,
    GpuClaim,
    Inventory,
    MigInstanceReply,
    MigInstanceRequest,
    PreparedDevice,
)
from shared.schemas.common import clip
from shared.schemas.inventory import health_text

from .hostwriter import HostWriteError, HostWriter
from .model import ClaimDeviceRecord, ClaimMig, ClaimMps, ClaimRecord, ClaimTimeslice, ClaimVfio, ConvergerState

log = logs.get_logger("bcd.converger.claims")


# ---------------------------------------------------------------------------- pure rules


@dataclass(frozen=True)
class Refusal:
    reason: str
    message: str


def _placement_size(gpu: Gpu, profile: str, start: int) -> int | None:
    p = next((p for p in gpu.mig_profiles if p.name == profile), None)
    if p is None:
        return None
    return next((pl.size for pl in p.placements if pl.start == start), None)


def _span(start: int, size: int) -> range:
    return range(start, start + max(size, 1))


def _overlaps(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


def owned_gis(records: Mapping[str, ClaimRecord], *, but: str = "") -> dict[str, dict[int, str]]:
    """PCI address -> GPU instance id -> holder, of every claim's made GPU instances (`but` left out)."""
    out: dict[str, dict[int, str]] = {}
    for uid, rec in records.items():
        if uid == but:
            continue
        for d in rec.devices:
            if d.mig is not None and d.mig.gi is not None:
                out.setdefault(d.pci, {})[d.mig.gi] = rec.holder
    return out


def check_claim(
    req: ClaimPrepareRequest,
    inventory: Inventory,
    card_claims: Sequence[GpuClaim],
    records: Mapping[str, ClaimRecord],
    *,
    privileged: bool,
    vfio: Mapping[str, str] = {},
    maintenance: Mapping[str, str] = {},
) -> Refusal | None:
    """privilege, devices, configs, conflicts, capacity: the first failure decides (the reasons of
    AllocationFailed where they apply; `invalid-config` for a config this node cannot honour,
    `in-use` for a card something runs on).

    Shares: a whole card allocated with a shareID (consumable capacity) may be held by other
    claims' shares beside it, never beside an exclusive device; the node adds the shares up
    itself, whatever the scheduler allowed: at most 100 sharePercent and the card's memory, and
    one time slice per card (time-sliced claims must agree on the interval)."""
    if not privileged:
        return Refusal("node-unprivileged", "this node runs unprivileged (not root, no helper): it cannot write CDI specs")
    refusal = _config_refusal(req)
    if refusal is not None:
        return refusal
    by_pci = {g.pci_address: g for g in inventory.gpus}
    others = {u: r for u, r in records.items() if u != req.uid}
    theirs = owned_gis(records, but=req.uid)
    mine: list[tuple[str, range | None, str]] = []  # (pci, memory slices or None for the whole card, device)
    for d in req.devices:
        gpu = by_pci.get(d.pci)
        what = f"{d.device} ({d.pci})"
        if gpu is None or not gpu.atom_id:
            return Refusal("device-missing", f"{what}: no GPU at {d.pci} on this node")
        if d.admin_access:
            refusal = _admin_refusal(what, d, gpu, card_claims, others, vfio)
            if refusal is not None:
                return refusal
            continue
        if (sick := gpu.status.unhealthy()) is not None:
            # before who holds it: a sick card is given to nobody new, and this says why
            return Refusal("device-unhealthy", f"{what}: the card is unhealthy: {health_text(sick)}")
        if d.sharing.strategy == "Vfio":
            refusal = _vfio_refusal(what, gpu, inventory)
            if refusal is not None:
                return refusal
        # who holds the card first: "held by instance vm1" says more than "Passthrough, not Ready"
        for c in card_claims:
            # another claim's part of the card is checked below, by placement: claims may share a card
            if c.pci_address == d.pci and c.kind != "claim":
                return Refusal("overlap", f"{what}: the card is held by {c.kind} {c.holder}")
        if d.pci in vfio:
            return Refusal("overlap", f"{what}: the card is held by {vfio[d.pci]} (VFIO)")
        if d.pci in maintenance:
            return Refusal("overlap", f"{what}: the card is held by {maintenance[d.pci]}")
        if gpu.status.phase != "Ready":
            return Refusal("device-missing", f"{what}: the card is {gpu.status.phase}, not Ready")
        if gpu.status.driver_binding.management_state == "Excluded":
            return Refusal("overlap", f"{what}: the card is excluded from bcd's management")
        if gpu.driver == "vfio-pci":
            return Refusal("overlap", f"{what}: the card is bound to vfio-pci (passthrough)")
        span: range | None = None
        if d.kind == "mig":
            if not gpu.mig_mode:
                return Refusal("unsupported-device", f"{what}: the card is not in MIG mode")
            if d.start is None:
                return Refusal("unsupported-device", f"{what}: a MIG device needs its placement")
            size = _placement_size(gpu, d.profile, d.start)
            if size is None:
                return Refusal("device-missing", f"{what}: the card has no MIG profile {d.profile} at placement {d.start}")
            span = _span(d.start, size)
        for pci, other, name in mine:
            if pci == d.pci and (span is None or other is None or _overlaps(span, other)):
                return Refusal("overlap", f"{what} and {name} of this claim overlap on one card")
        mine.append((d.pci, span, d.device))
        for rec in others.values():
            for od in rec.devices:
                if od.pci != d.pci or od.admin_access:
                    continue  # an admin-access device holds nothing
                if d.share_id and od.shared:
                    continue  # shares of one card: added up below
                ospan = None if od.kind != "mig" or od.mig is None else _span(od.mig.start, _placement_size(gpu, od.mig.profile, od.mig.start) or 1)
                if span is None or ospan is None or _overlaps(span, ospan):
                    held = f"{od.device} of the card is held by {rec.holder}" + (" (a share of it)" if od.shared else "")
                    return Refusal("overlap", f"{what}: {held}")
        if d.share_id:
            refusal = _share_refusal(what, d, gpu, others)
            if refusal is not None:
                return refusal
        # GPU instances nobody's claim made (a layout, a crash's leftover) hold their slices too
        for gi in gpu.gpu_instances:
            if gi.gi in theirs.get(d.pci, {}):
                continue
            gspan = _span(gi.placement.start, gi.placement.size) if gi.placement is not None else None
            if span is None or gspan is None or _overlaps(span, gspan):
                where = f" at memory slices {gspan.start}-{gspan.stop - 1}" if gspan is not None else ""
                return Refusal("overlap", f"{what}: GPU instance {gi.gi} ({gi.profile or 'unknown profile'}){where} is on the card and no claim owns it")
    return None


def _config_refusal(req: ClaimPrepareRequest) -> Refusal | None:
    """What a claim's configs ask together that one claim cannot have."""
    vfio = [d for d in req.devices if d.sharing.strategy == "Vfio"]
    if vfio and len(vfio) != len(req.devices):
        names = ", ".join(d.device for d in vfio)
        return Refusal("invalid-config", f"only some of the claim's devices are passed through ({names}, VfioDeviceConfig): a claim passes all its cards through or none")
    mps = {msgspec.json.encode(d.sharing) for d in req.devices if d.sharing.strategy == "MPS"}
    if len(mps) > 1:
        return Refusal(
            "invalid-config",
            "the claim's MPS devices ask for different MPS settings: one MPS daemon serves a claim (one CUDA_MPS_PIPE_DIRECTORY "
            "per container), so its MPS devices share one config",
        )
    for d in req.devices:
        what = f"{d.device} ({d.pci})"
        changes = _admin_changes(d.sharing)
        if d.admin_access and changes:
            return Refusal(
                "invalid-config",
                f"{what}: allocated with adminAccess, which is read-only here, but its config asks {changes}: "
                "an admin-access claim changes nothing on a card others may hold (use a class without that config)",
            )
        if d.share_id and d.kind != "gpu":
            return Refusal("invalid-config", f"{what}: allocated as a share (shareID {d.share_id}), but only whole cards are shared")
        if d.sharing.strategy == "Vfio" and d.kind != "gpu":
            return Refusal("invalid-config", f"{what}: a MIG device cannot be passed through: VfioDeviceConfig is for whole cards")
        if d.sharing.strategy == "Vfio" and d.share_id:
            return Refusal("invalid-config", f"{what}: passed through (VfioDeviceConfig) but allocated as a share of the card (shareID {d.share_id}): VFIO needs the card to itself")
        if d.sharing.strategy == "TimeSlicing" and d.kind == "mig" and d.sharing.interval != "Default":
            return Refusal("invalid-config", f"{what}: a MIG device has no time slice of its own (interval {d.sharing.interval})")
    return None


def _admin_changes(sharing: ClaimSharing) -> str:
    """What a device config would change on the card ("" for nothing): what admin access may not ask."""
    if sharing.strategy == "Vfio":
        return "passthrough (VfioDeviceConfig: the card to vfio-pci)"
    if sharing.strategy == "MPS":
        return "an MPS daemon"
    if sharing.strategy == "TimeSlicing" and sharing.interval != "Default":
        return f"the time slice {sharing.interval}"
    return ""


def _admin_refusal(
    what: str, d: ClaimDevice, gpu: Gpu, card_claims: Sequence[GpuClaim], others: Mapping[str, ClaimRecord], vfio: Mapping[str, str]
) -> Refusal | None:
    """An admin-access device: only what it can see is checked. Holders do not matter (admin
    access is for cards in use, a sick card included: looking at it is what monitoring is for),
    but a card passed through is not the host's to look at: the seed gives a VM (or a VFIO claim)
    the card alone, so admin access to it is refused, as is one the card's bcd management excludes."""
    for c in card_claims:
        if c.pci_address == d.pci and c.kind in ("instance", "domain"):
            return Refusal("overlap", f"{what}: the card is passed through to {c.kind} {c.holder} (VFIO): admin access cannot reach it")
    if d.pci in vfio:
        return Refusal("overlap", f"{what}: the card is passed through to {vfio[d.pci]} (VFIO): admin access cannot reach it")
    for rec in others.values():
        if any(od.pci == d.pci and (od.vfio is not None or od.sharing.strategy == "Vfio") for od in rec.devices):
            return Refusal("overlap", f"{what}: the card is passed through to {rec.holder} (VFIO): admin access cannot reach it")
    if gpu.driver == "vfio-pci":
        return Refusal("overlap", f"{what}: the card is bound to vfio-pci (passthrough): admin access cannot reach it")
    if gpu.status.driver_binding.management_state == "Excluded":
        return Refusal("overlap", f"{what}: the card is excluded from bcd's management")
    if d.kind == "mig":
        if not gpu.mig_mode:
            return Refusal("unsupported-device", f"{what}: the card is not in MIG mode")
        if d.start is None or _placement_size(gpu, d.profile, d.start) is None:
            return Refusal("device-missing", f"{what}: the card has no MIG profile {d.profile} at placement {d.start}")
        if admin_instance(gpu, d.profile, d.start) is None:
            # making one would be MIG state a read-only claim has no business making
            return Refusal("device-missing", f"{what}: no MIG instance is at that placement, and admin access makes none")
    return None


def admin_instance(gpu: Gpu, profile: str, start: int | None) -> tuple[int, int, str] | None:
    """(gi, ci, MIG uuid) of the MIG instance at a placement, made by whoever made it; None when
    there is none: admin access names what is there and makes nothing."""
    size = _placement_size(gpu, profile, start) if start is not None else None
    for gi in gpu.gpu_instances:
        if gi.placement is None or start is None or (gi.placement.start, gi.placement.size) != (start, size) or gi.profile != profile:
            continue
        for m in gpu.mig_instances:
            if m.gi == gi.gi and m.uuid:
                return m.gi, m.ci, m.uuid
    return None


def _vfio_refusal(what: str, gpu: Gpu, inventory: Inventory) -> Refusal | None:
    """A card that cannot be passed through here: a virtualized node, no known IOMMU group, processes on it."""
    if inventory.host.virtualized:
        # the seed's AdapterReady=False VFIORequiresBareMetal, for a claim
        return Refusal("unsupported-device", f"{what}: VFIO passthrough requires bare metal (VFIORequiresBareMetal): this node is virtualized")
    if gpu.iommu_group is None:
        return Refusal("unsupported-device", f"{what}: the card's IOMMU group is not known (no /sys/bus/pci/devices/{gpu.pci_address}/iommu_group: is the IOMMU on?)")
    running = sorted(p.pid for p in inventory.processes if p.gpu_uuid in (gpu.uuid, gpu.atom_id))
    if running:
        pids = ", ".join(str(p) for p in running[:8]) + (", ..." if len(running) > 8 else "")
        return Refusal("in-use", f"{what}: {len(running)} process(es) run on the card (pid {pids}): a card is passed through only with nothing running on it")
    return None


def _share_refusal(what: str, d: ClaimDevice, gpu: Gpu, others: Mapping[str, ClaimRecord]) -> Refusal | None:
    """A share of a card beside the other claims' shares: the sum stays within the card, one time slice."""
    held = [(rec, od) for rec in others.values() for od in rec.devices if od.pci == d.pci and od.shared and not od.admin_access]
    percent = sum(od.percent for _, od in held) + (d.share_percent or 100)
    if percent > 100:
        by = "; ".join(f"{od.percent}% by {rec.holder}" for rec, od in held)
        return Refusal("resources-exhausted", f"{what}: its {d.share_percent or 100}% share would make the card's shares {percent}% ({by}): at most 100")
    if gpu.memory_bytes and d.memory_bytes:
        memory = sum(od.memory_bytes or 0 for _, od in held) + d.memory_bytes
        if memory > gpu.memory_bytes:
            return Refusal(
                "resources-exhausted",
                f"{what}: its {d.memory_bytes} bytes of memory would make the card's shares {memory} bytes, the card has {gpu.memory_bytes}",
            )
    if d.sharing.strategy == "TimeSlicing":
        for rec, od in held:
            if od.sharing.strategy == "TimeSlicing" and od.sharing.interval != d.sharing.interval:
                return Refusal(
                    "overlap",
                    f"{what}: the card is time-sliced at {od.sharing.interval} for {rec.holder}, this claim asks {d.sharing.interval}: one time slice per card",
                )
    return None


def same_request(rec: ClaimRecord, req: ClaimPrepareRequest) -> bool:
    """The claim's devices, configs and shares are what the record holds (the kubelet retries a prepare)."""

    def key(pci: str, kind: str, profile: str, start: int | None, device: str, pool: str, sharing: ClaimSharing, share: tuple) -> tuple:
        return (pci, kind, profile if kind == "mig" else "", start if kind == "mig" else None, device, pool, msgspec.json.encode(sharing), share)

    # an admin-access MIG device keeps no placement of its own (no `mig`): its device name says it
    have = sorted(
        key(d.pci, d.kind, d.mig.profile if d.mig else "", d.mig.start if d.mig else None, d.device, d.pool, d.sharing, (d.share_id, d.share_percent, d.memory_bytes, d.admin_access))
        for d in rec.devices
    )
    want = sorted(
        key(d.pci, d.kind, "" if d.admin_access else d.profile, None if d.admin_access else d.start, d.device, d.pool, d.sharing, (d.share_id, d.share_percent, d.memory_bytes, d.admin_access))
        for d in req.devices
    )
    return have == want


def hold_content(rec: ClaimRecord, inventory: Inventory) -> HoldContent:
    """The claim's CDI spec as typed content; ValueError when a device's card or instance is not known.

    A card passed through is its IOMMU group's node; a share's device name is its own (its
    shareID); with an MPS daemon the spec mounts the daemon's pipe directory, which the
    inventory keeps under its MPS root."""
    by_pci = {g.pci_address: g for g in inventory.gpus}
    devices: list[HoldDevice] = []
    for d in rec.devices:
        gpu = by_pci.get(d.pci)
        if gpu is None:
            raise ValueError(f"{d.device}: no GPU at {d.pci}")
        if d.kind == "gpu" and d.vfio is not None:
            if d.vfio.iommu_group is None:
                raise ValueError(f"{d.device}: the card's IOMMU group is not known")
            devices.append(HoldDevice.for_vfio(gpu.uuid, gpu.index, d.vfio.iommu_group))
            continue
        if d.kind == "gpu":
            whole = HoldDevice.for_gpu(gpu.uuid, gpu.index)
            devices.append(dataclasses.replace(whole, share_id=d.share_id) if d.share_id else whole)
            continue
        if d.admin_access:
            # the instance found at its placement when prepared (someone else's: never `mig`)
            found = next((m for m in gpu.mig_instances if m.atom_id == d.atom and m.uuid), None) if d.atom else None
            if found is None:
                raise ValueError(f"{d.device}: the MIG instance {d.atom or 'at its placement'} is gone")
            devices.append(HoldDevice.for_mig(gpu.uuid, gpu.index, found.gi, found.ci, found.uuid))
            continue
        m = d.mig
        if m is None or m.gi is None or m.ci is None or not m.uuid:
            raise ValueError(f"{d.device}: its MIG instance is not made")
        devices.append(HoldDevice.for_mig(gpu.uuid, gpu.index, m.gi, m.ci, m.uuid))
    alloc = claim_hold_id(rec.uid)
    mps_control = rec.mps.control if rec.mps is not None else ""
    mps_pipe = ""
    if mps_control:
        if not inventory.mps_root:
            raise ValueError("the inventory names no MPS root: it keeps no MPS daemons")
        mps_pipe = claim_mps_pipe_dir(inventory.mps_root, mps_control)
    return HoldContent(
        allocation_id=alloc, reservation_id=alloc, generation=0, binding=BINDING_CLAIM, devices=tuple(devices), mps_control=mps_control, mps_pipe_dir=mps_pipe
    )


def cdi_name(d: ClaimDeviceRecord) -> str:
    """The qualified CDI name of a claim's device, as hold_content names it."""
    base = device_name(d.atom)
    return f"{KIND}={base}_{d.share_id}" if d.share_id and d.vfio is None else f"{KIND}={base}"


def prepared_devices(rec: ClaimRecord) -> list[PreparedDevice]:
    return [PreparedDevice(requests=list(d.requests), pool=d.pool, device=d.device, atom=d.atom, cdi_ids=[cdi_name(d)] if d.atom else []) for d in rec.devices]


def _gib(n: int) -> str:
    return f"{n / 2**30:g} GiB"


def sharing_text(rec: ClaimRecord) -> str:
    """How a claim shares or passes its cards, in words ("" for exclusive cards)."""
    parts: list[str] = []
    for d in rec.devices:
        if d.admin_access:
            parts.append(f"admin access (read-only) to {d.device}")
            continue
        if d.share_id:
            parts.append(f"a {d.percent}% share of {d.device}" + (f" with {_gib(d.memory_bytes)}" if d.memory_bytes else ""))
        if d.vfio is not None:
            parts.append(f"{d.device} passed through (vfio-pci, /dev/vfio/{d.vfio.iommu_group})" + ("" if d.vfio.step == "switched" else f" [{d.vfio.step}]"))
    if rec.mps is not None:
        limits = [f"{rec.mps.active_thread_percentage}% threads"] if rec.mps.active_thread_percentage else []
        limits += [f"{_gib(v)} pinned" for v in sorted(set(rec.mps.pinned_memory.values()))]
        parts.append(f"MPS daemon {rec.mps.control}" + (f" ({', '.join(limits)})" if limits else "") + ("" if rec.mps.step == "started" else f" [{rec.mps.step}]"))
    parts += [f"time slice {t.interval} on {t.pci}" + ("" if t.step == "set" else f" [{t.step}]") for t in rec.timeslices]
    return "; ".join(parts)


def summary(rec: ClaimRecord) -> ClaimSummary:
    return ClaimSummary(
        uid=rec.uid,
        namespace=rec.namespace,
        name=rec.name,
        state=rec.state,
        devices=prepared_devices(rec),
        message=clip(rec.message),
        since=rec.since,
        boot_id=rec.boot_id,
        sharing=clip(sharing_text(rec)),
        mps_control=rec.mps.control if rec.mps is not None else "",
        timeslices={t.pci: t.interval for t in rec.timeslices if t.step == "set"},
        shares={d.pci: d.percent for d in rec.devices if d.share_id},
        vfio=[d.pci for d in rec.devices if d.vfio is not None and d.vfio.step == "switched"],
    )


# ---------------------------------------------------------------------------- the keeper


class ClaimFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


MigStepper = Callable[[MigInstanceRequest], Awaitable[MigInstanceReply]]
SharingStepper = Callable[[SharingStepRequest], Awaitable[SharingStepReply]]
VfioSwitch = Callable[[SwitchRequest], Awaitable[SwitchReply]]


async def _no_sharing(req: SharingStepRequest) -> SharingStepReply:
    return SharingStepReply(step=req.step, outcome="not-supported", message="this converger was started without the inventory's sharing steps")


async def _no_switch(req: SwitchRequest) -> SwitchReply:
    return SwitchReply(pci=req.pci, target=req.target, outcome="Refused", reason="NoSwitcher", message="no vfio_switcher", at=datetime.now(timezone.utc))


def mps_daemon(rec: ClaimRecord, inventory: Inventory) -> MpsDaemonSpec | None:
    """The MPS daemon a claim's MPS devices need (None: none asks MPS); ValueError for a
    per-device limit that names no device of them.

    Limits: the config's, else the node's own from the allocation: a share's sharePercent is the
    daemon's active thread percentage and its consumed memory each device's pinned memory limit,
    so a share is held to what the scheduler gave it on the GPU too, not only in the ledger."""
    devices = [d for d in rec.devices if d.sharing.strategy == "MPS"]
    if not devices:
        return None
    by_pci = {g.pci_address: g for g in inventory.gpus}
    uuids: list[str] = []
    for d in devices:
        if d.kind == "mig":
            if d.mig is None or not d.mig.uuid:
                raise ValueError(f"{d.device}: its MIG instance is not made")
            uuids.append(d.mig.uuid)
        else:
            gpu = by_pci.get(d.pci)
            if gpu is None:
                raise ValueError(f"{d.device}: no GPU at {d.pci}")
            uuids.append(gpu.uuid)
    sharing = devices[0].sharing
    shares = [d.share_percent for d in devices if d.share_id and d.share_percent is not None and d.share_percent < 100]
    active = sharing.active_thread_percentage or (min(shares) if shares else None)
    keys = {**{u: u for u in uuids}, **{str(i): u for i, u in enumerate(uuids)}}
    unknown = sorted(k for k in sharing.pinned_memory if k not in keys)
    if unknown:
        raise ValueError(f"defaultPerDevicePinnedMemoryLimit names {', '.join(unknown)}: not a device uuid of the claim's MPS devices nor an index 0..{len(uuids) - 1}")
    pinned: dict[str, int] = {}
    for i, (d, uuid) in enumerate(zip(devices, uuids)):
        limit = sharing.pinned_memory.get(uuid) or sharing.pinned_memory.get(str(i)) or sharing.pinned_memory_bytes
        if limit is None and d.share_id and d.memory_bytes and d.memory_bytes >= 1 << 20:
            limit = d.memory_bytes
        if limit is not None:
            pinned[uuid] = limit
    body = msgspec.json.encode({"uuids": uuids, "active": active, "pinned": pinned})
    control = f"{rec.uid}-{hashlib.sha256(body).hexdigest()[:6]}"
    return MpsDaemonSpec(control=control, uuids=uuids, active_thread_percentage=active, pinned_memory=pinned)


def claim_timeslices(rec: ClaimRecord, inventory: Inventory) -> list[ClaimTimeslice]:
    """The time slices a claim's whole cards ask (TimeSlicing at another interval than Default)."""
    by_pci = {g.pci_address: g for g in inventory.gpus}
    out: list[ClaimTimeslice] = []
    for d in rec.devices:
        gpu = by_pci.get(d.pci)
        if d.kind == "gpu" and d.sharing.strategy == "TimeSlicing" and d.sharing.interval != "Default" and gpu is not None:
            out.append(ClaimTimeslice(pci=d.pci, uuid=gpu.uuid, interval=d.sharing.interval))
    return out


def _first_atom(inv: Inventory, d: ClaimDevice) -> str:
    """The atom a device holds from the start: its card's (whole card), the instance found at its
    placement (admin access to a MIG device), else "" (a MIG instance not made yet)."""
    gpu = next(g for g in inv.gpus if g.pci_address == d.pci)
    if d.kind == "gpu":
        return gpu.atom_id
    if d.admin_access:
        found = admin_instance(gpu, d.profile, d.start)
        return f"{gpu.atom_id}/gi{found[0]}/ci{found[1]}" if found is not None else ""
    return ""


class ClaimKeeper:
    """Prepare, unprepare and reconcile claims; every call runs under the converger's pass lock."""

    def __init__(
        self,
        *,
        state: Callable[[], ConvergerState],
        save: Callable[[], Awaitable[None]],
        writer: Callable[[], HostWriter],
        mig: MigStepper,
        inventory: Callable[[], Awaitable[Inventory | None]],
        card_claims: Callable[[Inventory], Awaitable[list[GpuClaim]]],
        claim_holds: Callable[[], Awaitable[Mapping[str, HoldOnDisk]]],
        privileged: Callable[[], bool],
        boot_id: Callable[[], str],
        vfio: Callable[[], Mapping[str, str]],
        maintenance: Callable[[], Mapping[str, str]],
        crash: Callable[[str], None] = lambda _: None,
        sharing: SharingStepper = _no_sharing,
        switch: VfioSwitch = _no_switch,
    ) -> None:
        self._crash = crash
        self._sharing, self._switch = sharing, switch
        self._state, self._save, self._writer, self._mig = state, save, writer, mig
        self._inventory, self._card_claims, self._claim_holds = inventory, card_claims, claim_holds
        self._privileged, self._boot_id, self._vfio, self._maintenance = privileged, boot_id, vfio, maintenance

    # -------------------------------------------------------------- prepare

    async def prepare(self, req: ClaimPrepareRequest) -> ClaimPrepareReply:
        state = self._state()
        rec = state.claims.get(req.uid)
        if rec is not None and not same_request(rec, req):
            return self._refused(req, "overlap", f"claim {req.uid} is prepared here with other devices ({', '.join(d.device for d in rec.devices)})")
        if rec is not None and rec.state == "unpreparing":
            return self._refused(req, "busy", f"claim {req.namespace}/{req.name} is being unprepared: {rec.message or 'retried'}")
        inv = await self._inventory()
        if inv is None:
            return self._refused(req, "busy", "no inventory yet")
        holds = await self._claim_holds()
        alloc = claim_hold_id(req.uid)
        if rec is not None and rec.state == "prepared":
            if rec.boot_id == self._boot_id() and alloc in holds and all(self._instance_there(inv, d) for d in rec.devices):
                return ClaimPrepareReply(uid=req.uid, ok=True, devices=prepared_devices(rec))
            # its file went, or a reboot took its MIG instances: made again from the start
            log.info("claim prepared earlier is made again", claim=f"{req.namespace}/{req.name}", uid=req.uid, file=alloc in holds)
            await self._roll_back(rec, inv)
            rec = None
        if rec is not None and rec.state == "preparing":
            # a prepare that failed half-way and could not be undone then: undo it now
            await self._roll_back(rec, inv)
            if req.uid in state.claims:
                return self._refused(req, "busy", f"an earlier prepare of this claim could not be undone yet: {state.claims[req.uid].message}")
        refusal = check_claim(
            req,
            inv,
            await self._card_claims(inv),
            state.claims,
            privileged=self._privileged(),
            vfio=self._vfio(),
            maintenance=self._maintenance(),
        )
        if refusal is not None:
            return self._refused(req, refusal.reason, refusal.message)
        rec = ClaimRecord(
            uid=req.uid,
            namespace=req.namespace,
            name=req.name,
            state="preparing",
            boot_id=self._boot_id(),
            since=datetime.now(timezone.utc),
            devices=[
                ClaimDeviceRecord(
                    requests=list(d.requests),
                    pool=d.pool,
                    device=d.device,
                    pci=d.pci,
                    kind=d.kind,
                    atom=_first_atom(inv, d),
                    sharing=d.sharing,
                    share_id=d.share_id,
                    share_percent=d.share_percent,
                    memory_bytes=d.memory_bytes,
                    admin_access=d.admin_access,
                )
                for d in req.devices
            ],
        )
        state.claims[req.uid] = rec
        await self._save()  # the intent, before any side effect
        try:
            for d, want in zip(rec.devices, req.devices):
                if d.kind == "mig" and not d.admin_access:  # admin access makes no MIG instance
                    await self._make_mig(rec, d, want.profile, want.start or 0, inv)
            inv = await self._inventory() or inv
            for d in rec.devices:
                if d.sharing.strategy == "Vfio":
                    await self._pass_through(rec, d, inv)
            await self._start_mps(rec, inv)
            await self._set_timeslices(rec, inv)
            inv = await self._inventory() or inv
            content = hold_content(rec, inv)
            await asyncio.to_thread(self._writer().write_cdi, content)
            self._crash("claim.cdi-written")
            # its consumer copy, made from the spec just written (docs/cdi-runtimes.md)
            await asyncio.to_thread(self._writer().write_consumer, alloc)
            self._crash("claim.consumer-written")
        except (ClaimFailed, HostWriteError, ValueError) as exc:
            reason, message = (exc.reason, exc.message) if isinstance(exc, ClaimFailed) else ("write-failed", str(exc))
            log.warning("claim not prepared; undoing", claim=f"{req.namespace}/{req.name}", uid=req.uid, reason=reason, error=message)
            rec.message = message
            await self._roll_back(rec, inv)
            left = "" if req.uid not in state.claims else f" (undoing it failed too: {state.claims[req.uid].message}; retried)"
            return self._refused(req, reason, message + left)
        rec.state, rec.message = "prepared", ""
        await self._save()
        log.info("claim prepared", claim=f"{req.namespace}/{req.name}", uid=req.uid, devices=[d.atom for d in rec.devices])
        return ClaimPrepareReply(uid=req.uid, ok=True, devices=prepared_devices(rec))

    def _refused(self, req: ClaimPrepareRequest, reason: str, message: str) -> ClaimPrepareReply:
        log.warning("claim refused", claim=f"{req.namespace}/{req.name}", uid=req.uid, reason=reason, message=message)
        return ClaimPrepareReply(uid=req.uid, ok=False, reason=reason, message=clip(message))

    async def _step(self, req: MigInstanceRequest) -> MigInstanceReply:
        try:
            return await self._mig(req)
        except Exception as exc:  # noqa: BLE001 - an unanswered step: what it did is unknown, found by its placement later
            return MigInstanceReply(pci=req.pci, step=req.step, outcome="failed", message=f"the inventory did not answer: {type(exc).__name__}: {exc}".rstrip(": "))

    async def _make_mig(self, rec: ClaimRecord, d: ClaimDeviceRecord, profile: str, start: int, inv: Inventory) -> None:
        d.mig = ClaimMig(profile=profile, start=start, step="gi-asked")
        await self._save()
        r = await self._step(MigInstanceRequest(step="create-gi", pci=d.pci, profile=profile, start=start, owner=rec.uid))
        self._crash("claim.gi-created")
        if not r.ok or r.gi is None:
            raise ClaimFailed("mig-failed", f"{d.device}: creating the GPU instance {profile} at placement {start} failed: {r.outcome}: {r.message}")
        d.mig.gi, d.mig.step = r.gi, "gi-made"
        await self._save()
        d.mig.step = "ci-asked"
        await self._save()
        r = await self._step(MigInstanceRequest(step="create-ci", pci=d.pci, gi=d.mig.gi, owner=rec.uid))
        self._crash("claim.ci-created")
        if not r.ok or r.ci is None or not r.uuid:
            raise ClaimFailed("mig-failed", f"{d.device}: creating the compute instance in GPU instance {d.mig.gi} failed: {r.outcome}: {r.message}")
        gpu = next(g for g in inv.gpus if g.pci_address == d.pci)
        d.mig.ci, d.mig.uuid, d.mig.step = r.ci, r.uuid, "ci-made"
        d.atom = f"{gpu.atom_id}/gi{d.mig.gi}/ci{d.mig.ci}"
        await self._save()

    async def _sharing_step(self, req: SharingStepRequest) -> SharingStepReply:
        try:
            return await self._sharing(req)
        except Exception as exc:  # noqa: BLE001 - an unanswered step: what it did is unknown; the journal says what may exist
            return SharingStepReply(step=req.step, outcome="failed", message=f"the inventory did not answer: {type(exc).__name__}: {exc}".rstrip(": "))

    async def _switch_card(self, req: SwitchRequest) -> SwitchReply:
        try:
            return await self._switch(req)
        except Exception as exc:  # noqa: BLE001 - unanswered: where the card is, the inventory says next
            return SwitchReply(pci=req.pci, target=req.target, outcome="Failed", reason="NoAnswer", message=f"vfio_switcher did not answer: {type(exc).__name__}: {exc}".rstrip(": "), at=datetime.now(timezone.utc))

    async def _pass_through(self, rec: ClaimRecord, d: ClaimDeviceRecord, inv: Inventory) -> None:
        """The card to vfio-pci through vfio_switcher (its rollback and disruption rules), journaled first."""
        gpu = next(g for g in inv.gpus if g.pci_address == d.pci)
        d.vfio = ClaimVfio(step="switch-asked", iommu_group=gpu.iommu_group)
        await self._save()
        r = await self._switch_card(SwitchRequest(pci=d.pci, target="vfio-pci", why=f"{rec.holder} (VfioDeviceConfig)"))
        self._crash("claim.vfio-switched")
        if not r.ok:
            held = f" (held by {r.holder})" if r.holder else ""
            raise ClaimFailed("vfio-failed", f"{d.device}: switching the card to vfio-pci: {r.outcome} ({r.reason}){held}: {r.message}".rstrip(": "))
        d.vfio.step = "switched"
        await self._save()

    async def _start_mps(self, rec: ClaimRecord, inv: Inventory) -> None:
        try:
            spec = mps_daemon(rec, inv)
        except ValueError as exc:
            raise ClaimFailed("invalid-config", str(exc)) from None
        if spec is None:
            return
        rec.mps = ClaimMps(control=spec.control, uuids=list(spec.uuids), active_thread_percentage=spec.active_thread_percentage, pinned_memory=dict(spec.pinned_memory))
        await self._save()  # the daemon may exist from here on: a restart stops it
        r = await self._sharing_step(SharingStepRequest(step="mps-start", owner=rec.uid, mps=spec))
        self._crash("claim.mps-started")
        if not r.ok:
            raise ClaimFailed("sharing-failed", f"starting the claim's MPS daemon {spec.control}: {r.outcome}: {r.message}".rstrip(": "))
        rec.mps.step = "started"
        await self._save()

    async def _set_timeslices(self, rec: ClaimRecord, inv: Inventory) -> None:
        for ts in claim_timeslices(rec, inv):
            rec.timeslices.append(ts)
            await self._save()
            r = await self._sharing_step(SharingStepRequest(step="timeslice-set", owner=rec.uid, pci=ts.pci, interval=ts.interval))  # type: ignore[arg-type]
            self._crash("claim.timeslice-set")
            if not r.ok:
                raise ClaimFailed("sharing-failed", f"setting the time slice {ts.interval} on {ts.pci}: {r.outcome}: {r.message}".rstrip(": "))
            ts.step = "set"
            await self._save()

    @staticmethod
    def _instance_there(inv: Inventory, d: ClaimDeviceRecord) -> bool:
        if d.admin_access and d.kind == "mig":
            gpu = next((g for g in inv.gpus if g.pci_address == d.pci), None)
            return gpu is not None and any(x.atom_id == d.atom for x in gpu.mig_instances)
        if d.vfio is not None:
            gpu = next((g for g in inv.gpus if g.pci_address == d.pci), None)
            return gpu is not None and gpu.driver == "vfio-pci"
        if d.kind != "mig":
            return True
        gpu = next((g for g in inv.gpus if g.pci_address == d.pci), None)
        m = d.mig
        if gpu is None or m is None or m.ci is None:
            return False
        return any(x.gi == m.gi and x.ci == m.ci and (not m.uuid or x.uuid == m.uuid) for x in gpu.mig_instances)

    # -------------------------------------------------------------- unprepare

    async def unprepare(self, uid: str) -> ClaimUnprepareReply:
        state = self._state()
        rec = state.claims.get(uid)
        alloc = claim_hold_id(uid)
        if rec is None:
            holds = await self._claim_holds()
            if alloc in holds:
                # a claim hold the journal does not know (state set aside): its file goes
                try:
                    await asyncio.to_thread(self._writer().remove_consumer, alloc)
                    await asyncio.to_thread(self._writer().remove_cdi, alloc)
                except HostWriteError as exc:
                    return ClaimUnprepareReply(uid=uid, ok=False, message=clip(f"removing {alloc}'s CDI spec failed: {exc}"))
            return ClaimUnprepareReply(uid=uid, ok=True)
        rec.state = "unpreparing"
        await self._save()
        inv = await self._inventory()
        await self._roll_back(rec, inv)
        if uid in state.claims:
            return ClaimUnprepareReply(uid=uid, ok=False, message=clip(state.claims[uid].message))
        log.info("claim unprepared", claim=f"{rec.namespace}/{rec.name}", uid=uid)
        return ClaimUnprepareReply(uid=uid, ok=True)

    async def _roll_back(self, rec: ClaimRecord, inv: Inventory | None) -> None:
        """Remove the claim's CDI spec, then destroy its MIG instances (compute, then GPU instance),
        journaling each; the record goes once nothing of it is left, else it stays with a message."""
        state = self._state()
        alloc = claim_hold_id(rec.uid)
        try:
            await asyncio.to_thread(self._writer().remove_consumer, alloc)
            await asyncio.to_thread(self._writer().remove_cdi, alloc)
        except HostWriteError as exc:
            rec.message = f"removing the CDI spec failed: {exc}"
            await self._save()
            return
        problem = await self._stop_mps(rec) or await self._reset_timeslices(rec)
        if problem:
            rec.message = problem
            await self._save()
            return
        for d in reversed(rec.devices):
            if d.mig is None:
                continue
            problem = await self._undo_mig(rec, d, inv)
            if problem:
                rec.message = problem
                await self._save()
                return
        for d in reversed(rec.devices):
            if d.vfio is None:
                continue
            problem = await self._undo_vfio(rec, d)
            if problem:
                rec.message = problem
                await self._save()
                return
        state.claims.pop(rec.uid, None)
        await self._save()

    async def _stop_mps(self, rec: ClaimRecord) -> str:
        """Quit the claim's MPS daemon ("" when none is left)."""
        if rec.mps is None:
            return ""
        rec.mps.step = "stop-asked"
        await self._save()
        r = await self._sharing_step(SharingStepRequest(step="mps-stop", owner=rec.uid, control=rec.mps.control))
        if not r.ok and r.outcome != "not-found":
            return f"stopping the claim's MPS daemon {rec.mps.control}: {r.outcome}: {r.message}".rstrip(": ")
        rec.mps = None
        await self._save()
        return ""

    async def _reset_timeslices(self, rec: ClaimRecord) -> str:
        """Each card's time slice back to Default, unless another claim on the card still has it set."""
        for ts in list(rec.timeslices):
            kept = [o for u, o in self._state().claims.items() if u != rec.uid and any(t.pci == ts.pci and t.step == "set" for t in o.timeslices)]
            if not kept:
                ts.step = "reset-asked"
                await self._save()
                r = await self._sharing_step(SharingStepRequest(step="timeslice-set", owner=rec.uid, pci=ts.pci, interval="Default"))
                if not r.ok:
                    return f"setting the time slice of {ts.pci} back to Default: {r.outcome}: {r.message}".rstrip(": ")
            rec.timeslices.remove(ts)
            await self._save()
        return ""

    async def _undo_vfio(self, rec: ClaimRecord, d: ClaimDeviceRecord) -> str:
        """The card back to its native driver ("" once it is, or once only a reboot can bring it back)."""
        assert d.vfio is not None
        d.vfio.step = "back-asked"
        await self._save()
        r = await self._switch_card(SwitchRequest(pci=d.pci, target="native", why=f"{rec.holder} unprepared"))
        if not r.ok and r.outcome != "DisruptionRequired":
            return f"{d.device}: switching the card back to its driver: {r.outcome} ({r.reason}): {r.message}".rstrip(": ")
        if r.outcome == "DisruptionRequired":
            # the switcher could not roll back: the inventory's Reconfiguring asks for a reboot; the
            # claim is gone all the same, nothing more of it can be undone in this boot
            log.error("the card of an unprepared claim needs a reboot", claim=f"{rec.namespace}/{rec.name}", pci=d.pci, detail=r.message)
        d.vfio = None
        await self._save()
        return ""

    async def _undo_mig(self, rec: ClaimRecord, d: ClaimDeviceRecord, inv: Inventory | None) -> str:
        m = d.mig
        assert m is not None
        if m.gi is None:
            # create-gi was asked and its answer lost: the instance, if any, is found by its placement
            inv = await self._inventory() or inv
            if inv is None:
                return f"{d.device}: the inventory is not known; the GPU instance asked for is looked for again"
            gpu = next((g for g in inv.gpus if g.pci_address == d.pci), None)
            owned = owned_gis(self._state().claims, but=rec.uid).get(d.pci, {})
            found = [
                g.gi
                for g in (gpu.gpu_instances if gpu is not None else [])
                if g.gi not in owned and g.placement is not None and g.placement.start == m.start and (not g.profile or g.profile == m.profile)
            ]
            if not found:
                d.mig = None
                await self._save()
                return ""
            m.gi, m.step = found[0], "ci-asked"
            await self._save()
        if m.step in ("ci-asked", "ci-made"):
            ci = m.ci
            if ci is None:
                inv = await self._inventory() or inv
                gpu = next((g for g in inv.gpus if g.pci_address == d.pci), None) if inv is not None else None
                ci = next((x.ci for x in (gpu.mig_instances if gpu is not None else []) if x.gi == m.gi), None)
            if ci is not None:
                r = await self._step(MigInstanceRequest(step="destroy-ci", pci=d.pci, gi=m.gi, ci=ci, owner=rec.uid))
                if not r.ok and r.outcome != "not-found":
                    return f"{d.device}: destroying compute instance {ci} of GPU instance {m.gi} failed: {r.outcome}: {r.message}"
            m.step, m.ci, m.uuid = "ci-gone", None, ""
            d.atom = ""
            await self._save()
        r = await self._step(MigInstanceRequest(step="destroy-gi", pci=d.pci, gi=m.gi, owner=rec.uid))
        if not r.ok and r.outcome != "not-found":
            return f"{d.device}: destroying GPU instance {m.gi} failed: {r.outcome}: {r.message}"
        d.mig = None
        await self._save()
        return ""

    # -------------------------------------------------------------- restart

    async def reconcile(self, inv: Inventory) -> None:
        """At start (inventory known): roll back claims cut short while preparing, finish unprepares,
        drop prepared claims whose MIG instances a reboot took."""
        state = self._state()
        boot = self._boot_id()
        for uid, rec in sorted(state.claims.items()):
            if rec.state in ("preparing", "unpreparing"):
                log.warning("claim cut short by a restart; undoing it", uid=uid, claim=f"{rec.namespace}/{rec.name}", state=rec.state)
                await self._roll_back(rec, inv)
            elif rec.boot_id != boot:
                if rec.mps is not None or rec.timeslices or any(d.vfio is not None for d in rec.devices):
                    # a reboot took its MPS daemon, time slice or passthrough: prepared again by the kubelet
                    log.info("claim of an earlier boot lost its MPS daemon, time slice or passthrough; dropped until prepared again", uid=uid)
                    await self._roll_back(rec, inv)
                elif all(self._instance_there(inv, d) for d in rec.devices):
                    rec.boot_id = boot
                    await self._save()
                else:
                    log.info("claim of an earlier boot lost its MIG instances; dropped until prepared again", uid=uid)
                    await self._roll_back(rec, inv)
        await self.stop_stray_daemons()

    async def stop_stray_daemons(self) -> None:
        """At start: an MPS daemon under the MPS root that no claim's record names is stopped (a
        claim unprepared while the node was down, a journal set aside)."""
        r = await self._sharing_step(SharingStepRequest(step="mps-list"))
        if not r.ok:
            if r.outcome != "not-supported":
                log.warning("MPS daemons not listed; strays are looked for at the next start", outcome=r.outcome, detail=r.message)
            return
        owned = {rec.mps.control for rec in self._state().claims.values() if rec.mps is not None}
        for control in r.controls:
            if control in owned:
                continue
            stop = await self._sharing_step(SharingStepRequest(step="mps-stop", control=control))
            (log.info if stop.ok or stop.outcome == "not-found" else log.warning)(
                "an MPS daemon no claim owns stopped", control=control, outcome=stop.outcome, detail=stop.message
            )

    def summaries(self) -> list[ClaimSummary]:
        return [summary(r) for _, r in sorted(self._state().claims.items())]


__all__ = [
    "Refusal",
    "check_claim",
    "same_request",
    "hold_content",
    "cdi_name",
    "prepared_devices",
    "summary",
    "owned_gis",
    "mps_daemon",
    "claim_timeslices",
    "ClaimKeeper",
    "ClaimFailed",
]
