"""The pure planner: `plan(spec, observed, config)` -> ordered steps, failures, section.

It follows the seed's pass to the letter ("One pass"): releases first (so a
GPU can move between allocations in one generation), then leftover slices,
then the holds still wanted (missing slice or env file recreated), then new
holds in spec order through the checks - binding, privilege, atoms,
conflicts, host admission; the first failure decides - counting every atom
bound earlier in the same pass; last, the VFIO side's driver switches
(vfio.plan_vfio), after every release of the pass. It reads nothing and
writes nothing: the same inputs always give the same plan, and a plan made
right after a successful apply is empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from shared.eventids import bound_id, failed_id, released_id
from shared.holdfiles import KIND, HoldContent, HoldDevice, HoldOnDisk, device_name
from shared.schemas import (
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    Condition,
    DeviceAssignment,
    HostResources,
    Limits,
    NodeSpec,
    SectionStatus,
)
from shared.slices import slice_name

from .atoms import AtomError, AtomIndex, ResolvedAtom, parse_atom
from .model import (
    SECTION,
    BindHold,
    ClearUnreadableMarker,
    DropPendingRelease,
    EnsureSlice,
    Failure,
    Observed,
    Plan,
    PlanConfig,
    ReleaseHold,
    RemoveTemp,
    ReportBound,
    ReportFailed,
    ReportKubeRelease,
    SetCondition,
    Step,
    StopSlice,
    WithdrawKubeHold,
    WriteEnv,
)
from .releases import PendingRelease
from .vfio import EXCLUDED_HOLDER, UNREADABLE_RELEASES_HOLDER, excluded, plan_vfio

MIB = 1024 * 1024
HOLD_BINDINGS = frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"})


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# ------------------------------------------------------------------------------ claims


@dataclass
class Claims:
    """Who holds what in this pass: atoms, whole GPUs, and each GPU's partition style."""

    #: atom id -> holder (allocation id or a parenthesised reason).
    atoms: dict[str, str] = field(default_factory=dict)
    #: GPU atom id -> holders of its MIG instances / slots: {"mig"|"slot": {atom: holder}}.
    parts: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    #: GPU atom id -> holder of the whole card through the VFIO side.
    vfio: dict[str, str] = field(default_factory=dict)
    #: GPU atom ids of the cards the operator excluded (Excluded / ExcludedReleasePending):
    #: no new hold takes them.
    excluded: set[str] = field(default_factory=set)
    all_gpus_held_by: str = ""

    def add(self, atom_id: str, holder: str) -> None:
        self.atoms[atom_id] = holder
        try:
            ref = parse_atom(atom_id)
        except AtomError:
            return
        if ref.kind != "gpu":
            self.parts.setdefault(ref.gpu, {}).setdefault(ref.kind, {})[atom_id] = holder

    def conflict(self, resolved: ResolvedAtom) -> str | None:
        """The overlap message for one atom, naming the holder, or None."""
        ref = resolved.ref
        if self.all_gpus_held_by:
            return f"{ref.id}: every GPU of this node is held by {self.all_gpus_held_by}"
        if ref.gpu in self.vfio:
            return f"{ref.id}: {ref.gpu} is claimed by {self.vfio[ref.gpu]}"
        if ref.gpu in self.excluded:
            return f"{ref.id}: {ref.gpu} is held by {EXCLUDED_HOLDER}"
        if ref.id in self.atoms:
            return f"{ref.id} is held by {self.atoms[ref.id]}"
        parts = self.parts.get(ref.gpu, {})
        if ref.kind == "gpu":
            for kind in ("mig", "slot"):
                if parts.get(kind):
                    atom, holder = sorted(parts[kind].items())[0]
                    return f"{ref.id}: its {'MIG instance' if kind == 'mig' else 'slot'} {atom.split('/', 1)[1]} is held by {holder}"
            return None
        if ref.gpu in self.atoms:
            return f"{ref.id}: {ref.gpu} is held whole by {self.atoms[ref.gpu]}"
        other = "slot" if ref.kind == "mig" else "mig"
        if parts.get(other):
            atom, holder = sorted(parts[other].items())[0]
            return (
                f"{ref.id}: {ref.gpu} is partitioned by {'slots' if other == 'slot' else 'MIG'} "
                f"({atom.split('/', 1)[1]} held by {holder}); MIG instances and slots do not mix on one GPU"
            )
        return None


# ------------------------------------------------------------------------------ host admission


@dataclass
class HostLedger:
    """Host memory and huge pages left for holds, read once per pass (lazily)."""

    host: HostResources | None
    reserve: int
    promised_memory: int = 0
    #: (page_size_kib, frozenset of nodes or None for host-wide) -> pages promised.
    #: (Perf fix: a dict summed per key, not a list of every promise: pages_left
    #: walked all earlier promises for each new hold, O(holds^2) per pass.)
    promised_pages: dict[tuple[int, frozenset[int] | None], int] = field(default_factory=dict)

    def promise(self, limits: Limits | None) -> None:
        if limits is None:
            return
        self.promised_memory += limits.memory_bytes or 0
        nodes = frozenset(expand_list(limits.mems)) if limits.mems else None
        for hp in limits.hugepages:
            key = (hp.page_size_kib, nodes)
            self.promised_pages[key] = self.promised_pages.get(key, 0) + hp.count

    def readable(self) -> bool:
        return self.host is not None and self.host.memory_bytes is not None

    def admit(self, limits: Limits) -> str | None:
        """None when the hold fits; else the seed's ResourcesExhausted message."""
        assert self.host is not None and self.host.memory_bytes is not None
        if limits.memory_bytes:
            left = max(0, self.host.memory_bytes - self.promised_memory - self.reserve)
            if limits.memory_bytes > left:
                need = -(-limits.memory_bytes // MIB)
                return f"ResourcesExhausted: {need} MiB of memory needed, {left // MIB} MiB left on this host"
        nodes = frozenset(expand_list(limits.mems)) if limits.mems else None
        for hp in limits.hugepages:
            if hp.count == 0:
                continue
            free = self.pages_left(hp.page_size_kib, nodes)
            if hp.count > free:
                return f"ResourcesExhausted: {hp.count} hugepages of {hp.page_size_kib} KiB needed, {free} free"
        return None

    def pages_left(self, size: int, nodes: frozenset[int] | None) -> int:
        assert self.host is not None
        if self.host.numa_nodes:
            pools = [
                p
                for n in self.host.numa_nodes
                if nodes is None or n.node in nodes
                for p in n.hugepages
                if p.page_size_kib == size
            ]
        else:
            pools = [p for p in self.host.hugepages if p.page_size_kib == size]
        total = sum(p.total for p in pools)
        free = sum(p.free for p in pools)
        promised = sum(
            count
            for (s, held_nodes), count in self.promised_pages.items()
            if s == size and (nodes is None or held_nodes is None or held_nodes & nodes)
        )
        # free already excludes pages workloads use; total - promised excludes pages
        # promised to holds whose workload has not started: take the smaller.
        return max(0, min(free, total - promised))


def expand_list(text: str | None) -> list[int]:
    """cpulist / nodelist syntax to numbers ("0-2,5" -> [0, 1, 2, 5])."""
    out: list[int] = []
    for part in (text or "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


# ------------------------------------------------------------------------------ the plan


def hold_devices(resolved: Iterable[ResolvedAtom]) -> tuple[HoldDevice, ...]:
    return tuple(
        HoldDevice(
            atom_id=r.ref.id,
            kind=r.ref.kind,
            gpu_uuid=r.gpu.uuid,
            gpu_index=r.gpu.index,
            visible_id=r.visible_id,
            vendor_names=_vendor_names(r),
        )
        for r in resolved
    )


def _vendor_names(r: ResolvedAtom) -> tuple[str, ...]:
    if r.ref.kind == "mig":
        return (r.visible_id,) if r.visible_id.startswith("MIG-") else ()
    return (r.gpu.uuid, str(r.gpu.index))


def mps_gpus(observed: Observed) -> frozenset[str]:
    """uuids of the GPUs with MPS running."""
    inv = observed.inventory
    return frozenset(g.uuid for g in inv.gpus if g.mps_running) if inv is not None else frozenset()


def hold_content(
    assignment: DeviceAssignment,
    devices: tuple[HoldDevice, ...],
    observed: Observed,
    mps_running: frozenset[str] | None = None,
) -> HoldContent:
    """`mps_running`: mps_gpus(observed), computed once per pass by the caller.

    (Perf fix: this used to build a uuid -> GPU map of the whole inventory for
    every assignment with a slot, O(assignments x GPUs) per pass.)
    """
    sliced = assignment.sliced and assignment.binding != "BINDING_KUBERNETES"
    inv = observed.inventory
    mps = ""
    if inv is not None and any(d.kind == "slot" for d in devices):
        running = mps_gpus(observed) if mps_running is None else mps_running
        if any(d.gpu_uuid in running for d in devices if d.kind == "slot"):
            mps = inv.mps_pipe_dir
    return HoldContent(
        allocation_id=assignment.allocation_id,
        reservation_id=assignment.reservation_id,
        generation=0,
        binding=assignment.binding,
        devices=devices,
        cgroup_parent=slice_name(assignment.allocation_id) if sliced else "",
        env=tuple(assignment.env),
        mps_pipe_dir=mps,
        limits=assignment.limits if sliced else None,
    )


def plan(spec: NodeSpec, observed: Observed, config: PlanConfig) -> Plan:
    state = observed.state
    gen = spec.generation
    node = config.node_id
    wanted: dict[str, DeviceAssignment] = {
        a.allocation_id: a for a in spec.devices if a.binding in HOLD_BINDINGS
    }
    steps: list[Step] = [RemoveTemp(p) for p in observed.temp_files]
    notes: list[str] = []

    # 1. Kubernetes releases pending from earlier passes: reported once no pod
    #    holds them, dropped unreported when the spec wants the allocation again.
    released: set[str] = set()
    pending: dict[str, PendingRelease] = {}
    for alloc, rel in sorted(observed.pending_releases.items()):
        if alloc in wanted:
            steps.append(DropPendingRelease(alloc))
            continue
        released.add(alloc)
        if alloc in observed.holds:
            # recorded, then a crash before the withdraw: finish withdrawing first
            steps.append(WithdrawKubeHold(alloc, rel))
        if observed.release_held.get(alloc) is False:
            steps.append(ReportKubeRelease(alloc, rel))
        else:
            pending[alloc] = rel

    # 2. Release holds no longer wanted (and finish releases a crash interrupted).
    for alloc, intent in sorted(state.intents.items()):
        if intent.op == "release":
            steps.append(
                ReleaseHold(
                    alloc,
                    intent.event_id,
                    AllocationReleased(
                        allocation_id=alloc,
                        reservation_id=intent.reservation_id,
                        generation=intent.generation,
                        devices=list(intent.devices),
                    ),
                    sliced=intent.sliced,
                )
            )
            released.add(alloc)
    for alloc, hold in sorted(observed.holds.items()):
        if alloc in released or alloc in wanted:
            continue
        intent = state.intents.get(alloc)
        if alloc not in state.reported and intent is not None and intent.op == "bind":
            # Fix: a bind interrupted after its CDI spec landed may already have its
            # Bound in the outbox (a crash between the publish and the journal's
            # "completed"): releasing it unreported left upstream a Bound with no
            # Released. Report the Bound first (same event id: a duplicate is
            # dropped), then release it reported; apply skips the release when this
            # report fails. A bind whose CDI spec never landed (below) cannot have
            # published and is still undone silently.
            steps.append(ReportBound(alloc, intent.event_id, _bound_event(hold)))
        if hold.binding == "BINDING_KUBERNETES":
            # split release: recorded, withdrawn, reported only once no pod holds it
            rel = PendingRelease(
                allocation_id=alloc,
                reservation_id=hold.reservation_id,
                devices=list(hold.devices),
                generation=gen,
                since=observed.now,
                event_id=released_id(node, alloc, gen),
            )
            steps.append(WithdrawKubeHold(alloc, rel))
            pending[alloc] = rel
            released.add(alloc)
            continue
        steps.append(
            ReleaseHold(
                alloc,
                released_id(node, alloc, gen),
                AllocationReleased(
                    allocation_id=alloc, reservation_id=hold.reservation_id, generation=gen, devices=list(hold.devices)
                ),
                sliced=bool(hold.cgroup_parent),
            )
        )
        released.add(alloc)
    for alloc, facts in sorted(state.bound.items()):
        # a reported hold whose CDI spec vanished from outside, now unwanted: it
        # still gets its Released (and its env file and slice go)
        if alloc not in wanted and alloc not in observed.holds and alloc not in released and alloc in state.reported:
            steps.append(
                ReleaseHold(
                    alloc,
                    released_id(node, alloc, gen),
                    AllocationReleased(
                        allocation_id=alloc, reservation_id=facts.reservation_id, generation=gen, devices=list(facts.devices)
                    ),
                    sliced=facts.sliced,
                )
            )
            released.add(alloc)
    for alloc, intent in sorted(state.intents.items()):
        # an interrupted bind whose CDI spec never landed and that is no longer wanted
        if intent.op == "bind" and alloc not in wanted and alloc not in observed.holds and alloc not in released:
            steps.append(
                ReleaseHold(
                    alloc,
                    intent.event_id,
                    AllocationReleased(
                        allocation_id=alloc, reservation_id=intent.reservation_id, generation=gen, devices=list(intent.devices)
                    ),
                    sliced=intent.sliced,
                    report=False,
                )
            )
            released.add(alloc)

    # 3. Leftover slices whose hold is neither wanted nor released in this pass.
    for alloc in sorted(observed.slices):
        if alloc not in wanted and alloc not in released and alloc in observed.empty_slices:
            steps.append(StopSlice(alloc))

    # Who holds what after the releases: kept holds, pending releases, VFIO side.
    index = AtomIndex(observed.inventory)
    mps = mps_gpus(observed)
    claims = Claims()
    for pci, holder in observed.vfio_claims.items():
        gpu = index.by_pci.get(pci)
        if gpu is not None and gpu.atom_id:
            claims.vfio[gpu.atom_id] = holder
    claims.excluded = {g.atom_id for g in index.by_pci.values() if g.atom_id and excluded(g)}
    for atom, alloc in observed.pending_release_atoms.items():
        claims.add(atom, f"{alloc} (pending Kubernetes release)")
    for alloc, rel in pending.items():
        for atom in rel.devices:
            claims.add(atom, f"{alloc} (pending Kubernetes release)")
    unreadable = observed.releases_unreadable and not observed.no_orphans
    if observed.releases_unreadable and observed.no_orphans:
        steps.append(ClearUnreadableMarker())
    if unreadable:
        claims.all_gpus_held_by = UNREADABLE_RELEASES_HOLDER
    ledger = HostLedger(observed.inventory.host if observed.inventory else None, config.system_reserve_bytes)

    # 4. Holds still wanted are kept; a missing slice or env file is recreated.
    kept: dict[str, HoldOnDisk] = {a: h for a, h in observed.holds.items() if a in wanted and a not in released}
    for alloc, hold in sorted(kept.items()):
        for atom in hold.devices:
            claims.add(atom, alloc)
        ledger.promise(hold.limits)
    for alloc, hold in sorted(kept.items()):
        assignment = wanted[alloc]
        if hold.cgroup_parent and alloc not in observed.slices:
            limits = hold.limits or assignment.limits
            if limits is not None:
                steps.append(EnsureSlice(alloc, limits))
        if alloc not in observed.env_files:
            try:
                devices = hold_devices(index.resolve(a) for a in hold.devices)
            except AtomError as exc:
                notes.append(f"{alloc}: env file missing and cannot be rebuilt: {exc.message}")
            else:
                steps.append(WriteEnv(alloc, _with_hold(hold_content(assignment, devices, observed, mps), hold)))
        if alloc not in state.reported:
            intent = state.intents.get(alloc)
            event_id = intent.event_id if intent is not None and intent.op == "bind" else bound_id(node, alloc, hold.generation)
            steps.append(ReportBound(alloc, event_id, _bound_event(hold)))

    # 5. New holds, in spec order: check, then bind or collect the failure.
    failures: list[Failure] = []
    undo: list[Step] = []
    host_checked = False
    for assignment in spec.devices:
        alloc = assignment.allocation_id
        if alloc in kept:
            continue
        try:
            resolved = _check(assignment, index, claims, config)
            limits = assignment.limits if assignment.binding != "BINDING_KUBERNETES" else None
            if limits is not None and (limits.memory_bytes or any(h.count for h in limits.hugepages)):
                if not ledger.readable():
                    if not host_checked:
                        notes.append("host memory unreadable; binding without host-side admission")
                    host_checked = True
                else:
                    problem = ledger.admit(limits)
                    if problem:
                        raise _Refused("resources-exhausted", problem)
        except _Refused as exc:
            failures.append(Failure(alloc, assignment.reservation_id, exc.reason, exc.message))  # type: ignore[arg-type]
            intent = state.intents.get(alloc)
            if intent is not None and intent.op == "bind" and alloc not in observed.holds and alloc not in released:
                # Fix: an interrupted bind (intent journaled, maybe its slice, no CDI
                # spec) whose assignment now fails its checks was left journaled
                # forever: its slice stayed and the holder query named it as holding
                # the GPU. Undo it unreported, like one that is no longer wanted
                # (after the binds: its atoms are on no disk, nothing waits for it).
                undo.append(
                    ReleaseHold(
                        alloc,
                        intent.event_id,
                        AllocationReleased(
                            allocation_id=alloc, reservation_id=intent.reservation_id, generation=gen, devices=list(intent.devices)
                        ),
                        sliced=intent.sliced,
                        report=False,
                    )
                )
            continue
        devices = hold_devices(resolved)
        # a hold already reported Bound whose files vanished is re-created as it
        # was bound (same generation, same event id) and not reported again
        again = state.bound.get(alloc) if alloc in state.reported and alloc not in released else None
        hold_gen = again.generation if again is not None else gen
        content = dataclasses.replace(hold_content(assignment, devices, observed, mps), generation=hold_gen)
        for r in resolved:
            claims.add(r.ref.id, alloc)
        ledger.promise(content.limits)
        steps.append(
            BindHold(
                alloc,
                again.event_id if again is not None else bound_id(node, alloc, gen),
                AllocationBound(
                    allocation_id=alloc,
                    reservation_id=assignment.reservation_id,
                    generation=hold_gen,
                    devices=[r.ref.id for r in resolved],
                    cgroup_parent=content.cgroup_parent,
                    cdi_devices=_qualified(content),
                ),
                content,
                report=again is None,
            )
        )

    steps.extend(undo)

    # 6. One AllocationFailed per failing allocation, once per generation.
    for f in failures:
        if state.reported_failures.get(f.allocation_id) != gen:
            steps.append(
                ReportFailed(
                    f.allocation_id,
                    failed_id(node, f.allocation_id, gen),
                    AllocationFailed(
                        allocation_id=f.allocation_id,
                        reservation_id=f.reservation_id,
                        generation=gen,
                        reason=f.reason,
                        message=f.message,
                    ),
                )
            )
    steps.extend(_conditions(observed, config, pending, unreadable))

    # 7. The VFIO side: driver switches, after every release of this pass (a
    #    card moves from a hold to an instance in one generation).
    vfio = plan_vfio(spec, observed, _held_cards(claims, index))
    steps.extend(vfio.steps)
    section = SectionStatus(
        section=SECTION,
        state="FAILED" if failures else "CONVERGED",
        observed_generation=gen,
        message="\n".join(f"{f.allocation_id}: {f.reason}" for f in failures),
    )
    return Plan(
        generation=gen,
        steps=tuple(steps),
        failures=tuple(failures),
        section=section,
        notes=tuple(notes),
        pending=tuple(sorted(pending)),
        vfio_waiting=vfio.waiting,
        vfio_notes=vfio.notes,
    )


def _held_cards(claims: Claims, index: AtomIndex) -> dict[str, str]:
    """PCI address -> holder of each card a hold or pending release names after this pass's releases."""
    if claims.all_gpus_held_by:
        return {pci: claims.all_gpus_held_by for pci in sorted(index.by_pci)}
    held: dict[str, str] = {}
    for atom, holder in sorted(claims.atoms.items()):
        try:
            ref = parse_atom(atom)
        except AtomError:
            continue
        gpu = index.gpus.get(ref.gpu)
        if gpu is not None:
            held.setdefault(gpu.pci_address, holder)
    return held


STUCK = "KubernetesReleaseStuck"
UNREADABLE = "KubernetesReleasesUnreadable"


def _conditions(observed: Observed, config: PlanConfig, pending: Mapping[str, PendingRelease], unreadable: bool) -> list[Step]:
    """KubernetesReleaseStuck and KubernetesReleasesUnreadable, raised and cleared on change."""
    now = observed.now
    stuck = sorted(a for a, r in pending.items() if now - r.since > config.stuck_after)
    wanted: list[Condition] = []
    if stuck:
        mins = int(config.stuck_after.total_seconds() // 60)
        wanted.append(
            Condition(
                type=STUCK,
                status="True",
                reason="PodsHoldDevices",
                message=f"pods still hold the devices of {', '.join(stuck)} (pending longer than {mins} min)",
                since=now,
            )
        )
    elif STUCK in observed.state.conditions:
        wanted.append(Condition(type=STUCK, status="False", reason="ReleasesReported", message="no Kubernetes release is stuck", since=now))
    if unreadable:
        wanted.append(
            Condition(
                type=UNREADABLE,
                status="True",
                reason="ReleasesFileUnreadable",
                message="releasing.json was unreadable: every GPU counts as claimed until no pod holds a GPU of an unknown allocation",
                since=now,
            )
        )
    elif UNREADABLE in observed.state.conditions:
        wanted.append(
            Condition(type=UNREADABLE, status="False", reason="ReleasesFileReadable", message="no unreadable releases remain", since=now)
        )
    steps: list[Step] = []
    for cond in wanted:
        last = observed.state.conditions.get(cond.type)
        if last is None or last.status != cond.status or last.message != cond.message:
            # a condition keeps its `since` while its status holds
            if last is not None and last.status == cond.status:
                cond = msgspec.structs.replace(cond, since=last.since)
            steps.append(SetCondition(cond))
    return steps


def _bound_event(hold: HoldOnDisk) -> AllocationBound:
    """The AllocationBound of a hold as its CDI spec on disk says it was bound."""
    return AllocationBound(
        allocation_id=hold.allocation_id,
        reservation_id=hold.reservation_id,
        generation=hold.generation,
        devices=list(hold.devices),
        cgroup_parent=hold.cgroup_parent,
        cdi_devices=list(hold.cdi_names),
    )


def _with_hold(content: HoldContent, hold: HoldOnDisk) -> HoldContent:
    """A kept hold's env file is rebuilt from the hold as bound, not from a newer assignment."""
    return dataclasses.replace(
        content,
        reservation_id=hold.reservation_id,
        generation=hold.generation,
        # Fix: the binding too. An assignment whose binding changed after the
        # bind (HOLD sliced -> KUBERNETES) made HoldContent refuse "a Kubernetes
        # hold is never sliced" and plan() raise, so every pass failed.
        binding=hold.binding,
        cgroup_parent=hold.cgroup_parent,
        limits=hold.limits,
    )


def _qualified(content: HoldContent) -> list[str]:
    """`<kind>=<name>` of each device, as build_cdi_spec names them.

    (Perf fix: the planner used to build the whole CDI spec - deep copies of
    the vendor's edits - only to read these names back; the HostWriter builds
    the spec when it writes it.)
    """
    return [f"{KIND}={device_name(d.atom_id)}" for d in content.devices]


def _check(assignment: DeviceAssignment, index: AtomIndex, claims: Claims, config: PlanConfig) -> list[ResolvedAtom]:
    """binding, privilege, atoms, conflicts: the first failure decides."""
    if assignment.binding not in config.supported_bindings:
        if assignment.binding == "BINDING_INSTANCE":
            msg = "BINDING_INSTANCE is not a hold: GPUs for VMs come in the instances section"
        else:
            msg = f"{assignment.binding} is not supported by this node"
        raise _Refused("unsupported-binding", msg)
    if not config.privileged:
        raise _Refused(
            "node-unprivileged",
            "this node runs unprivileged (not root, no helper): it cannot write CDI specs or create slices",
        )
    if not assignment.devices:
        raise _Refused("unsupported-device", "the assignment lists no devices")
    resolved: list[ResolvedAtom] = []
    for atom in assignment.devices:
        try:
            resolved.append(index.resolve(atom))
        except AtomError as exc:
            raise _Refused(exc.reason, exc.message) from None
    seen: set[str] = set()
    mine = Claims()
    for r in resolved:
        if r.ref.id in seen:
            raise _Refused("overlap", f"{r.ref.id} is listed twice in this assignment")
        seen.add(r.ref.id)
        # a card on vfio-pci for an instance is refused naming the instance (below)
        if r.gpu.driver == "vfio-pci" and r.ref.gpu not in claims.vfio:
            raise _Refused("overlap", f"{r.ref.id}: {r.ref.gpu} is bound to vfio-pci (passthrough)")
        problem = claims.conflict(r) or mine.conflict(r)
        if problem:
            raise _Refused("overlap", problem)
        # Fix: the holder of the assignment's own earlier atoms is named
        # "this assignment" directly. A text replace of "held by <alloc>" missed
        # "held whole by <alloc>" and also hit a prefix ("held by a10" for a1).
        mine.add(r.ref.id, "this assignment")
    return resolved


__all__ = ["plan", "Claims", "HostLedger", "expand_list", "hold_devices", "hold_content", "UNREADABLE_RELEASES_HOLDER"]
