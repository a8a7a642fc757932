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

Claims are Kubernetes' business: nothing here goes upstream. They are in the
node's card claims (kind "claim"), so VMs, resets, diagnostics, MIG layouts and
new holds see them, and a pass never releases them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from shared import logs
from shared.holdfiles import BINDING_CLAIM, HoldContent, HoldDevice, HoldOnDisk, claim_hold_id, device_name, KIND
from shared.schemas import (
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

from .hostwriter import HostWriteError, HostWriter
from .model import ClaimDeviceRecord, ClaimMig, ClaimRecord, ConvergerState

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
    """privilege, devices, conflicts: the first failure decides (the reasons of AllocationFailed where they apply)."""
    if not privileged:
        return Refusal("node-unprivileged", "this node runs unprivileged (not root, no helper): it cannot write CDI specs")
    by_pci = {g.pci_address: g for g in inventory.gpus}
    others = {u: r for u, r in records.items() if u != req.uid}
    theirs = owned_gis(records, but=req.uid)
    mine: list[tuple[str, range | None, str]] = []  # (pci, memory slices or None for the whole card, device)
    for d in req.devices:
        gpu = by_pci.get(d.pci)
        what = f"{d.device} ({d.pci})"
        if gpu is None or not gpu.atom_id:
            return Refusal("device-missing", f"{what}: no GPU at {d.pci} on this node")
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
                if od.pci != d.pci:
                    continue
                ospan = None if od.kind != "mig" or od.mig is None else _span(od.mig.start, _placement_size(gpu, od.mig.profile, od.mig.start) or 1)
                if span is None or ospan is None or _overlaps(span, ospan):
                    return Refusal("overlap", f"{what}: {od.device} of the card is held by {rec.holder}")
        # GPU instances nobody's claim made (a layout, a crash's leftover) hold their slices too
        for gi in gpu.gpu_instances:
            if gi.gi in theirs.get(d.pci, {}):
                continue
            gspan = _span(gi.placement.start, gi.placement.size) if gi.placement is not None else None
            if span is None or gspan is None or _overlaps(span, gspan):
                where = f" at memory slices {gspan.start}-{gspan.stop - 1}" if gspan is not None else ""
                return Refusal("overlap", f"{what}: GPU instance {gi.gi} ({gi.profile or 'unknown profile'}){where} is on the card and no claim owns it")
    return None


def same_request(rec: ClaimRecord, req: ClaimPrepareRequest) -> bool:
    def key(pci: str, kind: str, profile: str, start: int | None, device: str, pool: str) -> tuple:
        return (pci, kind, profile if kind == "mig" else "", start if kind == "mig" else None, device, pool)

    have = sorted(key(d.pci, d.kind, d.mig.profile if d.mig else "", d.mig.start if d.mig else None, d.device, d.pool) for d in rec.devices)
    want = sorted(key(d.pci, d.kind, d.profile, d.start, d.device, d.pool) for d in req.devices)
    return have == want


def hold_content(rec: ClaimRecord, inventory: Inventory) -> HoldContent:
    """The claim's CDI spec as typed content; ValueError when a device's card or instance is not known."""
    by_pci = {g.pci_address: g for g in inventory.gpus}
    devices: list[HoldDevice] = []
    for d in rec.devices:
        gpu = by_pci.get(d.pci)
        if gpu is None:
            raise ValueError(f"{d.device}: no GPU at {d.pci}")
        if d.kind == "gpu":
            devices.append(HoldDevice.for_gpu(gpu.uuid, gpu.index))
            continue
        m = d.mig
        if m is None or m.gi is None or m.ci is None or not m.uuid:
            raise ValueError(f"{d.device}: its MIG instance is not made")
        devices.append(HoldDevice.for_mig(gpu.uuid, gpu.index, m.gi, m.ci, m.uuid))
    alloc = claim_hold_id(rec.uid)
    return HoldContent(allocation_id=alloc, reservation_id=alloc, generation=0, binding=BINDING_CLAIM, devices=tuple(devices))


def prepared_devices(rec: ClaimRecord) -> list[PreparedDevice]:
    return [
        PreparedDevice(requests=list(d.requests), pool=d.pool, device=d.device, atom=d.atom, cdi_ids=[f"{KIND}={device_name(d.atom)}"] if d.atom else [])
        for d in rec.devices
    ]


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
    )


# ---------------------------------------------------------------------------- the keeper


class ClaimFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


MigStepper = Callable[[MigInstanceRequest], Awaitable[MigInstanceReply]]


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
    ) -> None:
        self._crash = crash
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
                    atom=next(g.atom_id for g in inv.gpus if g.pci_address == d.pci) if d.kind == "gpu" else "",
                )
                for d in req.devices
            ],
        )
        state.claims[req.uid] = rec
        await self._save()  # the intent, before any side effect
        try:
            for d, want in zip(rec.devices, req.devices):
                if d.kind == "mig":
                    await self._make_mig(rec, d, want.profile, want.start or 0, inv)
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

    @staticmethod
    def _instance_there(inv: Inventory, d: ClaimDeviceRecord) -> bool:
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
        for d in reversed(rec.devices):
            if d.mig is None:
                continue
            problem = await self._undo_mig(rec, d, inv)
            if problem:
                rec.message = problem
                await self._save()
                return
        state.claims.pop(rec.uid, None)
        await self._save()

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
                if all(self._instance_there(inv, d) for d in rec.devices):
                    rec.boot_id = boot
                    await self._save()
                else:
                    log.info("claim of an earlier boot lost its MIG instances; dropped until prepared again", uid=uid)
                    await self._roll_back(rec, inv)

    def summaries(self) -> list[ClaimSummary]:
        return [summary(r) for _, r in sorted(self._state().claims.items())]


__all__ = ["Refusal", "check_claim", "same_request", "hold_content", "prepared_devices", "summary", "owned_gis", "ClaimKeeper", "ClaimFailed"]
