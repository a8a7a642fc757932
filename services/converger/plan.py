"""The pure planner: `plan(spec, observed, config)` -> ordered steps, failures, section.

It follows the seed's pass to the letter ("One pass"), one function per step:
0. `stale_hold_files`: files of an allocation whose Released the node already
   reported (ConvergerState.released), found again at that generation or older,
   are stale copies: removed (RemoveStaleHold, counted as drift) and left out of
   everything after, so they are never adopted as a hold, released again, made a
   pending Kubernetes release or a claim;
1. `plan_kubernetes_releases`: pending Kubernetes releases reported or dropped;
2. `plan_releases`: holds no longer wanted released (so a GPU can move
   between allocations in one generation);
3. `plan_leftover_slices`: leftover empty slices stopped, consumer copies
   without a hold spec removed;
4. `plan_kept_holds`: holds still wanted kept (missing slice, env file or
   consumer copy recreated, a slice changed from outside applied again; a DRA
   claim's missing consumer copy too);
5. `plan_new_holds`: new holds in spec order through the checks - binding,
   privilege, atoms, conflicts (`check_new_hold`), host admission
   (admission.py); the first failure decides - counting every atom bound
   earlier in the same pass;
6. `plan_failures`: one AllocationFailed per failure, once per generation;
a refusal is final at its generation (ConvergerState.refusals).
Last come the VFIO side's driver switches (vfio.plan_vfio), after every
release of the pass. It reads nothing and writes nothing: the same inputs
always give the same plan, and a plan made right after a successful apply is
empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from shared.eventids import bound_id, failed_id, released_id
from shared.fsutil import content_digest
from shared.holdfiles import KIND, HoldContent, HoldDevice, HoldOnDisk, NotAHold, device_name, hold_file_bytes, hold_file_name, parse_hold
from shared.vendorcdi import VendorCdi, VendorSpecError
from shared.schemas import (
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    Condition,
    DeviceAssignment,
    Limits,
    NodeSpec,
    SectionStatus,
    TEXT_MAX,
    clip,
    summarise,
)
from shared.schemas.inventory import health_text
from shared.schemas.strict import UNKNOWN_FIELDS_CONDITION
from shared.slices import slice_differences, slice_name

from .atoms import AtomError, AtomIndex, ResolvedAtom, parse_atom
from .admission import HostLedger, needs_admission, topology_problem
from .model import (
    SECTION,
    ClaimRecord,
    ConvergerState,
    Intent,
    BindHold,
    ClearUnreadableMarker,
    DropPendingRelease,
    EnsureSlice,
    Failure,
    Observed,
    Plan,
    PlanConfig,
    RecordWritten,
    ReleaseHold,
    RemoveConsumer,
    RemoveStaleHold,
    RemoveTemp,
    RestoreHold,
    ReportBound,
    ReportFailed,
    ReportKubeRelease,
    SetCondition,
    SetHoldCondition,
    Step,
    StopSlice,
    WithdrawKubeHold,
    WriteConsumer,
    WriteEnv,
    Written,
)
from .releases import PendingRelease
from .vfio import UNREADABLE_RELEASES_HOLDER, excluded, plan_vfio

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

    def discard(self, atom_id: str) -> None:
        self.atoms.pop(atom_id, None)
        for kinds in self.parts.values():
            for held in kinds.values():
                held.pop(atom_id, None)

    def conflict(self, resolved: ResolvedAtom) -> str | None:
        """The overlap message for one atom, naming the holder, or None."""
        ref = resolved.ref
        if self.all_gpus_held_by:
            return f"{ref.id}: every GPU of this node is held by {self.all_gpus_held_by}"
        if ref.gpu in self.vfio:
            return f"{ref.id}: {ref.gpu} is claimed by {self.vfio[ref.gpu]}"
        if ref.gpu in self.excluded:
            # not "held by (excluded by the operator)" (issue 28.8): nobody holds it, it is taken out
            return f"{ref.id}: {ref.gpu} is excluded by the operator"
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
    sliced, limits = recorded_limits(assignment)
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
        limits=limits,
    )


def recorded_limits(assignment: DeviceAssignment) -> tuple[bool, Limits | None]:
    """(whether the hold is sliced, the limits its spec records in bcd.dev/limits).

    A Kubernetes hold gets no slice, but what it booked stays on record: host
    admission counts it while the hold lives."""
    kubernetes = assignment.binding == "BINDING_KUBERNETES"
    sliced = assignment.sliced and not kubernetes
    return sliced, assignment.limits if (sliced or (kubernetes and assignment.sliced)) else None


def _listed(values: Iterable[str], limit: int = 4) -> str:
    values = list(values)
    shown = ", ".join(values[:limit])
    return (shown + f" +{len(values) - limit} more" if len(values) > limit else shown) or "none"


def assignment_changes(assignment: DeviceAssignment, hold: HoldOnDisk) -> tuple[str, ...]:
    """What the assignment asks that the hold on disk does not say (() when it is the same hold).

    An allocation's hold is what its assignment says (docs/upstream.md): one that
    changed is released and bound again. Limits are compared only where the hold
    records them (a hold of an older bcd may not); devices as a set."""
    changes: list[str] = []
    if assignment.binding != hold.binding:
        changes.append(f"binding {hold.binding} -> {assignment.binding}")
    if assignment.reservation_id != hold.reservation_id:
        changes.append(f"reservation {hold.reservation_id} -> {assignment.reservation_id}")
    if sorted(assignment.devices) != sorted(hold.devices):
        gone = [d for d in hold.devices if d not in assignment.devices]
        new = [d for d in assignment.devices if d not in hold.devices]
        long = max(len(hold.devices), len(assignment.devices)) > 4
        changes.append(f"devices {_listed(hold.devices)} -> {_listed(assignment.devices)}" + (f" (-{_listed(gone)} +{_listed(new)})" if long else ""))
    sliced, limits = recorded_limits(assignment)
    if sliced != bool(hold.cgroup_parent):
        changes.append("limits: now sliced" if sliced else "limits: no longer sliced")
    elif hold.limits is not None and limits != hold.limits:
        changes.append(f"limits {msgspec.json.encode(hold.limits).decode()} -> {msgspec.json.encode(limits).decode() if limits else 'none'}")
    if tuple(assignment.env) != hold.env:
        gone = [e.split("=", 1)[0] for e in hold.env if e not in assignment.env]
        new = [e.split("=", 1)[0] for e in assignment.env if e not in hold.env]
        changes.append(f"env -{_listed(gone)} +{_listed(new)}" if (gone or new) else "env order")
    return tuple(changes)


@dataclass
class _Pass:
    """One pass's working set: the inputs, and what the steps so far decided."""

    spec: NodeSpec
    observed: Observed
    config: PlanConfig
    #: allocation -> assignment, for the assignments that make holds.
    wanted: dict[str, DeviceAssignment]
    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: allocations released (or being released) in this pass.
    released: set[str] = field(default_factory=set)
    #: Kubernetes releases still pending after this pass, by allocation.
    pending: dict[str, PendingRelease] = field(default_factory=dict)
    #: pending releases the spec wants again: dropped unreported when the hold binds
    #: again on the same devices in this pass, else still pending.
    taken_back: dict[str, PendingRelease] = field(default_factory=dict)
    #: held allocations whose assignment changed: what differs; released, then bound again.
    changed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: wanted allocations that wait for their old hold's pending Kubernetes release: why.
    waiting: dict[str, str] = field(default_factory=dict)
    #: holds whose spec on disk is not what bcd wrote (trusted_holds): put back from the record.
    drifted: frozenset[str] = frozenset()
    #: allocations whose files on disk are stale copies of a reported release (stale_hold_files):
    #: their RemoveStaleHold takes the consumer copy too.
    stale: frozenset[str] = frozenset()

    @property
    def gen(self) -> int:
        return self.spec.generation

    @property
    def node(self) -> str:
        return self.config.node_id

    @property
    def state(self) -> ConvergerState:
        return self.observed.state


def plan(spec: NodeSpec, observed: Observed, config: PlanConfig) -> Plan:
    """The seed's "One pass", one function per step, in its order."""
    observed, drifted = trusted_holds(observed)
    observed, stale = without_stale_files(observed)
    p = _Pass(
        spec=spec,
        observed=observed,
        config=config,
        wanted={a.allocation_id: a for a in spec.devices if a.binding in HOLD_BINDINGS},
        drifted=drifted,
        stale=frozenset(s.allocation_id for s in stale),
    )
    p.steps.extend(RemoveTemp(path) for path in observed.temp_files)
    p.steps.extend(stale)  # 0: before any release or bind (a rebind of the id writes after it)
    plan_kubernetes_releases(p)  # 1
    plan_releases(p)  # 2
    plan_leftover_slices(p)  # 3
    index = AtomIndex(observed.inventory)
    mps = mps_gpus(observed)
    claims, unreadable = claims_after_releases(p, index)
    ledger = HostLedger(observed.inventory.host if observed.inventory else None, config.system_reserve_bytes)
    kept = plan_kept_holds(p, index, claims, ledger, mps)  # 4
    failures = plan_new_holds(p, index, claims, ledger, mps, kept)  # 5
    plan_failures(p, failures)  # 6
    p.steps.extend(plan_hold_health(observed, index, kept))
    p.steps.extend(_conditions(observed, config, p.pending, unreadable, spec.generation))
    # the VFIO side's driver switches, after every release of this pass (a card
    # moves from a hold to an instance in one generation)
    # a card under maintenance is not switched meanwhile either
    vfio = plan_vfio(spec, observed, {**_held_cards(claims, index), **observed.maintenance})
    p.steps.extend(vfio.steps)
    return Plan(
        generation=spec.generation,
        steps=tuple(p.steps),
        failures=tuple(failures),
        section=section_status(spec.generation, failures, (p.waiting[a] for a in sorted(p.waiting))),
        notes=tuple(p.notes),
        pending=tuple(sorted(p.pending)),
        changed=tuple(sorted(p.changed.items())),
        waiting=tuple(sorted(p.waiting)),
        vfio_waiting=vfio.waiting,
        vfio_notes=vfio.notes,
    )


def written_record(content: HoldContent, vendor: VendorCdi | None) -> Written:
    """What the files of `content` are when a writer writes them now (the same function renders
    them in the writer and the root helper): the record journaled before they are written."""
    try:
        cdi = content_digest(hold_file_bytes("cdi", content, vendor))
    except (VendorSpecError, ValueError):
        cdi = b""  # the write refuses it too (retried); no digest matches, so nothing is adopted
    return Written(content=content, cdi=cdi, env=content_digest(hold_file_bytes("allocation-env", content, vendor)))


def trusted_holds(observed: Observed) -> tuple[Observed, frozenset[str]]:
    """The holds as bcd wrote them, and which specs on disk are not that (drift by content).

    A hold spec is the record only while it is what bcd wrote (`ConvergerState.written`): one
    edited from outside that still parses (devices, env, annotations) is replaced here by the
    hold its record renders, so no decision of the pass (kept, changed, released, its consumer
    copy) follows the edit, and plan_kept_holds puts the file back."""
    written = observed.state.written
    holds = dict(observed.holds)
    drifted: set[str] = set()
    for alloc, hold in observed.holds.items():
        rec = written.get(alloc)
        if rec is None or not hold.digest or hold.digest == rec.cdi:
            continue
        drifted.add(alloc)
        try:
            holds[alloc] = parse_hold(hold_file_name(alloc), hold_file_bytes("cdi", rec.content, observed.vendor))
        except (NotAHold, VendorSpecError, ValueError):
            pass  # the record does not render (vendor spec unreadable): the disk's, put back when it does
    if not drifted:
        return observed, frozenset()
    return dataclasses.replace(observed, holds=holds), frozenset(drifted)


def stale_hold_files(
    state: ConvergerState,
    holds: Mapping[str, HoldOnDisk],
    env_files: Iterable[str] = (),
    pending: Iterable[str] = (),
) -> dict[str, int]:
    """Allocation -> the generation of its reported Released, for each allocation whose files on
    disk are stale copies of that released hold.

    The node reported the allocation Released at generation R (`state.released`) and nothing
    made it live since (no Bound reported, no intent, no pending Kubernetes release): its hold
    spec at generation <= R, or (no hold spec) its env file, can only be a copy of what was
    released. A hold spec newer than R is one the node never knew (handled as any such spec).

    | row                   | journal                        | on disk               | stale |
    |-----------------------|--------------------------------|-----------------------|-------|
    | put back              | released at 3                  | spec gen 1 (+env)     | yes   |
    | env file alone        | released at 3                  | env file              | yes   |
    | newer spec            | released at 3                  | spec gen 4            | no    |
    | live again            | released at 3, reported Bound  | spec                  | no    |
    | bind or release going | an intent                      | spec                  | no    |
    | release pending       | releasing.json has it          | spec                  | no    |
    | never known           | nothing                        | spec                  | no    |
    """
    out: dict[str, int] = {}
    busy = set(pending)
    env = set(env_files)
    for alloc, gen in state.released.items():
        if alloc in state.reported or alloc in state.intents or alloc in busy:
            continue
        hold = holds.get(alloc)
        if hold is not None and hold.generation <= gen:
            out[alloc] = gen
        elif hold is None and alloc in env:
            out[alloc] = gen
    return out


def without_stale_files(observed: Observed) -> tuple[Observed, list[RemoveStaleHold]]:
    """The observation without stale copies of released holds (stale_hold_files), and the
    steps that remove them: the rest of the pass never sees them."""
    stale = stale_hold_files(observed.state, observed.holds, observed.env_files, observed.pending_releases)
    if not stale:
        return observed, []
    copies = observed.consumer_copies or {}
    steps = [
        RemoveStaleHold(
            alloc,
            gen,
            tuple(
                kind
                for kind, there in (
                    ("cdi-consumer", alloc in copies),
                    ("cdi", alloc in observed.holds),
                    ("allocation-env", alloc in observed.env_files),
                )
                if there
            ),
        )
        for alloc, gen in sorted(stale.items())
    ]
    observed = dataclasses.replace(
        observed,
        holds={a: h for a, h in observed.holds.items() if a not in stale},
        env_files={a: e for a, e in observed.env_files.items() if a not in stale},
    )
    return observed, steps


def section_status(generation: int, failures: Iterable[Failure], waiting: Iterable[str] = ()) -> SectionStatus:
    """CONVERGED; FAILED listing `<allocation>: <reason>` as far as the message's bound allows;
    PROGRESSING while a wanted hold waits (for its old hold's pending release), saying why."""
    lines = [f"{f.allocation_id}: {f.reason}" for f in failures]
    waits = list(waiting)
    return SectionStatus(
        section=SECTION,
        state="FAILED" if lines else "PROGRESSING" if waits else "CONVERGED",
        observed_generation=generation,
        message=summarise([*lines, *waits]),
    )


# ------------------------------------------------------------------------------ 1. Kubernetes releases


def wanted_again(assignment: DeviceAssignment | None, rel: PendingRelease) -> bool:
    """The spec wants the released hold back as it was: a Kubernetes hold of the same
    reservation on the same devices (seed: taken back, dropped unreported). Anything else
    is another hold under the same id: the release goes on, and that hold waits for it."""
    return (
        assignment is not None
        and assignment.binding == "BINDING_KUBERNETES"
        and assignment.reservation_id == rel.reservation_id
        and sorted(assignment.devices) == sorted(rel.devices)
    )


def plan_kubernetes_releases(p: _Pass) -> None:
    """Pending releases: reported once no pod holds them, dropped unreported when wanted again."""
    for alloc, rel in sorted(p.observed.pending_releases.items()):
        again = wanted_again(p.wanted.get(alloc), rel)
        if again and alloc in p.observed.holds:
            # recorded, then a crash before the withdraw, and wanted again: the hold is still whole
            p.steps.append(DropPendingRelease(alloc))
            continue
        if again:
            # taken back only if the hold binds again in this pass (plan_new_holds
            # decides); until then its devices stay claimed
            p.taken_back[alloc] = rel
            continue
        if alloc in p.wanted:
            p.changed.setdefault(alloc, (f"devices {_listed(rel.devices)} -> {_listed(p.wanted[alloc].devices)}",) if sorted(rel.devices) != sorted(p.wanted[alloc].devices) else ("another hold under this id",))
        p.released.add(alloc)
        if alloc in p.observed.holds:
            # recorded, then a crash before the withdraw: finish withdrawing first
            p.steps.append(WithdrawKubeHold(alloc, rel))
        if p.observed.release_held.get(alloc) is False:
            p.steps.append(ReportKubeRelease(alloc, rel))
        else:
            p.pending[alloc] = rel


# ------------------------------------------------------------------------------ 2. releases


def _release(alloc: str, event_id: str, reservation_id: str, generation: int, devices: Iterable[str], *, sliced: bool, report: bool = True) -> ReleaseHold:
    return ReleaseHold(
        alloc,
        event_id,
        AllocationReleased(allocation_id=alloc, reservation_id=reservation_id, generation=generation, devices=list(devices)),
        sliced=sliced,
        report=report,
    )


def plan_releases(p: _Pass) -> None:
    """Holds no longer wanted are released (and releases a crash interrupted are finished)."""
    state, observed, gen, node = p.state, p.observed, p.gen, p.node
    for alloc, intent in sorted(state.intents.items()):
        if intent.op == "release":
            p.steps.append(_release(alloc, intent.event_id, intent.reservation_id, intent.generation, intent.devices, sliced=intent.sliced))
            p.released.add(alloc)
    for alloc, hold in sorted(observed.holds.items()):
        if alloc in p.released:
            continue
        if alloc in p.wanted:
            changes = assignment_changes(p.wanted[alloc], hold)
            if not changes:
                continue
            # the hold is what its assignment says: this one is released, and the
            # assignment bound again after it (plan_new_holds), in the seed's order
            p.changed[alloc] = changes
            p.notes.append(f"{alloc}: its assignment changed ({'; '.join(changes)}): released, then bound again")
        intent = state.intents.get(alloc)
        if alloc not in state.reported and intent is not None and intent.op == "bind":
            # A bind interrupted after its CDI spec landed may already have its
            # Bound in the outbox (a crash between the publish and the journal's
            # "completed"): report the Bound first (same event id: a duplicate is
            # dropped), then release it reported; apply skips the release when
            # this report fails. A bind whose CDI spec never landed (below)
            # cannot have published and is undone silently.
            p.steps.append(ReportBound(alloc, intent.event_id, _bound_event(hold)))
        p.released.add(alloc)
        if hold.binding == "BINDING_KUBERNETES":
            # split release: recorded, withdrawn, reported only once no pod holds it
            rel = PendingRelease(
                allocation_id=alloc,
                reservation_id=hold.reservation_id,
                devices=list(hold.devices),
                generation=gen,
                since=observed.now,
                event_id=released_id(node, alloc, gen),
                limits=hold.limits,
            )
            p.steps.append(WithdrawKubeHold(alloc, rel))
            p.pending[alloc] = rel
            continue
        p.steps.append(_release(alloc, released_id(node, alloc, gen), hold.reservation_id, gen, hold.devices, sliced=bool(hold.cgroup_parent)))
    for alloc, facts in sorted(state.bound.items()):
        # a reported hold whose CDI spec vanished from outside, now unwanted (or
        # wanted on other devices): it still gets its Released (and its env file
        # and slice go)
        if alloc in observed.holds or alloc in p.released or alloc not in state.reported or alloc in observed.pending_releases:
            continue  # (a withdrawn Kubernetes hold is reported by its pending release)
        wanted = p.wanted.get(alloc)
        if wanted is not None and sorted(wanted.devices) == sorted(facts.devices) and wanted.reservation_id == facts.reservation_id:
            continue  # re-created as it was bound, unreported (plan_new_holds)
        if wanted is not None:
            p.changed[alloc] = (f"devices {_listed(facts.devices)} -> {_listed(wanted.devices)}",)
        p.steps.append(_release(alloc, released_id(node, alloc, gen), facts.reservation_id, gen, facts.devices, sliced=facts.sliced))
        p.released.add(alloc)
    for alloc, intent in sorted(state.intents.items()):
        # an interrupted bind whose CDI spec never landed and that is no longer wanted
        if intent.op == "bind" and alloc not in p.wanted and alloc not in observed.holds and alloc not in p.released:
            p.steps.append(_undo_bind(alloc, intent, gen))
            p.released.add(alloc)


def _undo_bind(alloc: str, intent: Intent, generation: int) -> ReleaseHold:
    """Undo an interrupted bind that never reached its CDI spec: its files and slice go, nothing is sent."""
    return _release(alloc, intent.event_id, intent.reservation_id, generation, intent.devices, sliced=intent.sliced, report=False)


# ------------------------------------------------------------------------------ 3. leftover slices


def plan_leftover_slices(p: _Pass) -> None:
    """Slices whose hold is neither wanted nor released in this pass are stopped once empty;
    consumer copies whose hold spec is gone are removed (a runtime would hand out their
    devices with no hold behind them)."""
    for alloc in sorted(p.observed.slices):
        if alloc not in p.wanted and alloc not in p.released and alloc in p.observed.empty_slices:
            p.steps.append(StopSlice(alloc))
    # The copies that may exist are derived from state each pass: those of the hold specs on
    # disk that this pass keeps (or binds again), and the DRA claims'. Any other copy goes,
    # whenever it appears: one without a hold spec, and one of a hold being released or
    # withdrawn (a copy put back while its Kubernetes release is pending, or after it was
    # reported, would let an old-CDI runtime resolve the withdrawn device).
    copies = p.observed.consumer_copies
    for alloc in sorted(copies or ()):
        if alloc in p.observed.claim_holds or alloc in p.stale:
            continue  # (a stale copy of a released hold goes with its RemoveStaleHold)
        if alloc in p.observed.holds and alloc not in p.released:
            continue
        if alloc in p.observed.holds and any(
            isinstance(s, (ReleaseHold, WithdrawKubeHold)) and s.allocation_id == alloc for s in p.steps
        ):
            continue  # the release's own step takes the copy first, in its order
        p.steps.append(RemoveConsumer(alloc))


def consumer_copy_stale(observed: Observed, hold: HoldOnDisk) -> bool:
    """The hold's consumer copy is missing or not the one its hold spec makes (consumer copies kept)."""
    copies = observed.consumer_copies
    return copies is not None and copies.get(hold.allocation_id) != hold.consumer_digest


# ------------------------------------------------------------------------------ who holds what


def claim_holders(claim_holds: Mapping[str, HoldOnDisk], journal: Mapping[str, ClaimRecord]) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Hold id -> (holder text, atoms) of every DRA claim: its hold on disk (``claim_holds``), and
    claims the journal (``ConvergerState.claims``, by uid) shows being prepared or unprepared
    (their atoms are claimed before and after the file). A claim's admin-access devices are left
    out (they hold nothing): a claim of admin access only is no holder at all."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    by_id = {f"claim-{uid}": rec for uid, rec in journal.items()}
    for alloc, hold in claim_holds.items():
        rec = by_id.get(alloc)
        if rec is None:
            # a claim hold the journal does not know: what it names is held (admin access or not)
            out[alloc] = (f"DRA claim {alloc.removeprefix('claim-')}", hold.devices)
            continue
        # an admin-access device (KEP-5018) holds nothing: its atom is another's, or nobody's
        looked_at = {d.atom for d in rec.devices if d.admin_access} - {d.atom for d in rec.devices if not d.admin_access}
        atoms = tuple(a for a in hold.devices if a not in looked_at)
        if atoms:
            out[alloc] = (rec.holder, atoms)
    for alloc, rec in by_id.items():
        atoms = tuple(d.atom for d in rec.devices if d.atom and not d.admin_access)
        if atoms:
            held = out.get(alloc, (rec.holder, ()))
            out[alloc] = (rec.holder, tuple(dict.fromkeys((*held[1], *atoms))))
    return out


def claims_after_releases(p: _Pass, index: AtomIndex) -> tuple[Claims, bool]:
    """The claims new holds are checked against (before the kept holds add theirs), and
    whether the releases file is unreadable (every GPU held)."""
    observed = p.observed
    claims = Claims()
    for pci, holder in observed.vfio_claims.items():
        gpu = index.by_pci.get(pci)
        if gpu is not None and gpu.atom_id:
            claims.vfio[gpu.atom_id] = holder
    for pci, holder in observed.maintenance.items():
        gpu = index.by_pci.get(pci)
        if gpu is not None and gpu.atom_id:
            claims.vfio.setdefault(gpu.atom_id, holder)
    claims.excluded = {g.atom_id for g in index.by_pci.values() if g.atom_id and excluded(g)}
    for atom, alloc in observed.pending_release_atoms.items():
        claims.add(atom, f"{alloc} (pending Kubernetes release)")
    for alloc, holder in sorted(claim_holders(observed.claim_holds, observed.state.claims).items()):
        for atom in holder[1]:
            claims.add(atom, holder[0])
    for alloc, rel in [*p.pending.items(), *p.taken_back.items()]:
        for atom in rel.devices:
            claims.add(atom, f"{alloc} (pending Kubernetes release)")
    unreadable = observed.releases_unreadable and not observed.no_orphans
    if observed.releases_unreadable and observed.no_orphans:
        p.steps.append(ClearUnreadableMarker())
    if unreadable:
        claims.all_gpus_held_by = UNREADABLE_RELEASES_HOLDER
    return claims, unreadable


# ------------------------------------------------------------------------------ 4. kept holds


def plan_kept_holds(p: _Pass, index: AtomIndex, claims: Claims, ledger: HostLedger, mps: frozenset[str]) -> dict[str, HoldOnDisk]:
    """Holds still wanted are kept: a missing slice or env file is recreated, an unreported Bound sent."""
    state, observed = p.state, p.observed
    kept = {a: h for a, h in observed.holds.items() if a in p.wanted and a not in p.released}
    # what is promised before any new hold: kept holds, and pending releases (their pods still run)
    for alloc, hold in sorted(kept.items()):
        for atom in hold.devices:
            claims.add(atom, alloc)
        ledger.promise(hold.limits)
    for rel in [*p.pending.values(), *p.taken_back.values()]:
        ledger.promise(rel.limits)
    for alloc, hold in sorted(kept.items()):
        assignment = p.wanted[alloc]
        if hold.legacy_slice and (
            alloc not in observed.slices or alloc in observed.empty_slices or alloc not in observed.env_files
        ):
            _rename_legacy_slice(p, index, mps, alloc, hold, assignment)
            continue
        if hold.cgroup_parent:
            _plan_slice(p, alloc, hold, hold.limits or assignment.limits)
        files_in_place = True
        rec = state.written.get(alloc)
        if rec is None and not hold.legacy_slice:
            # bound by a bcd that kept no record of what it wrote: its files as found, once (a
            # hold under a legacy slice name is recorded when it is rewritten under the new one)
            try:
                devices = hold_devices(index.resolve(a) for a in hold.devices)
                content = _with_hold(hold_content(assignment, devices, observed, mps), hold)
            except AtomError as exc:
                p.notes.append(f"{alloc}: what bcd wrote cannot be recorded: {exc.message}")
            except ValueError as exc:
                p.notes.append(f"{alloc}: what bcd wrote cannot be recorded: {exc}")
            else:
                env = observed.env_files.get(alloc)
                rec = Written(content=content, cdi=hold.digest, env=content_digest(env) if env is not None else written_record(content, observed.vendor).env)
                p.steps.append(RecordWritten(alloc, rec))
        restore: list[str] = []
        if alloc in p.drifted:
            restore.append("cdi")
        env = observed.env_files.get(alloc)
        if rec is not None and env is not None and content_digest(env) != rec.env:
            restore.append("allocation-env")
        if rec is not None and restore:
            # put back from the record, journaled first; never reported again
            p.steps.append(RestoreHold(alloc, written_record(rec.content, observed.vendor), tuple(restore)))
        if alloc not in observed.env_files:
            if rec is not None:
                p.steps.append(WriteEnv(alloc, rec.content))
            else:
                try:
                    devices = hold_devices(index.resolve(a) for a in hold.devices)
                except AtomError as exc:
                    p.notes.append(f"{alloc}: env file missing and cannot be rebuilt: {exc.message}")
                    files_in_place = False
                else:
                    p.steps.append(WriteEnv(alloc, _with_hold(hold_content(assignment, devices, observed, mps), hold)))
        if consumer_copy_stale(observed, hold):
            # made from the hold spec on disk alone (put back first when it drifted)
            copies = observed.consumer_copies or {}
            p.steps.append(WriteConsumer(alloc, drifted=alloc in copies))
        # seed: no event is sent until every file is in place
        if alloc not in state.reported and files_in_place:
            intent = state.intents.get(alloc)
            event_id = intent.event_id if intent is not None and intent.op == "bind" else bound_id(p.node, alloc, hold.generation)
            p.steps.append(ReportBound(alloc, event_id, _bound_event(hold)))
    for alloc, hold in sorted(observed.claim_holds.items()):
        # a DRA claim's hold is the kubelet plugin's, but its consumer copy is a file like any
        if consumer_copy_stale(observed, hold):
            p.steps.append(WriteConsumer(alloc))
    return kept


def _plan_slice(p: _Pass, alloc: str, hold: HoldOnDisk, limits: Limits | None) -> None:
    """A kept sliced hold's slice: made when missing, applied again when it reads back other
    than its limits make (changed from outside: drift by content, counted, never reported).

    | row        | slice                                        | step                         |
    |------------|----------------------------------------------|------------------------------|
    | missing    | not listed                                   | EnsureSlice                  |
    | same       | reads back what the limits make              | nothing                      |
    | changed    | a property differs (MemoryMax edited)        | EnsureSlice, drifted=(names) |
    | unreadable | listed, its properties do not read           | EnsureSlice, ("unreadable",) |
    | not read   | listed, not read (legacy name, backend down) | nothing                      |
    """
    observed = p.observed
    if limits is None:
        return
    if alloc not in observed.slices:
        p.steps.append(EnsureSlice(alloc, limits))
        return
    if hold.legacy_slice or alloc not in observed.slice_props:
        # (a legacy-named slice is rewritten under the new name by _rename_legacy_slice; applying
        # the limits here would make a second slice beside the busy one)
        return
    try:
        differs = slice_differences(alloc, limits, observed.slice_props[alloc], hugepages=observed.slice_hugepages)
    except ValueError as exc:
        p.notes.append(f"{alloc}: its slice cannot be compared with its limits: {exc}")
        return
    if differs:
        p.steps.append(EnsureSlice(alloc, limits, drifted=differs))


def _rename_legacy_slice(
    p: _Pass, index: AtomIndex, mps: frozenset[str], alloc: str, hold: HoldOnDisk, assignment: DeviceAssignment
) -> None:
    """A kept hold bound under the legacy slice name (`bcd-alloc-a\\x2d1.slice`) is rewritten
    under `slice_name` (`bcd-alloc-a.1.slice`) once nothing runs in its slice or a
    file of it must be written again anyway: the old slice is stopped once empty,
    then slice, CDI spec and env file are written like a bind of the same generation
    (reported only if its Bound never was). While a workload runs in the old slice
    and every file is there, the hold is left as it is (plan_kept_holds)."""
    limits = hold.limits or assignment.limits
    try:
        devices = hold_devices(index.resolve(a) for a in hold.devices)
    except AtomError as exc:
        p.notes.append(f"{alloc}: cannot be rewritten under slice {slice_name(alloc)}: {exc.message}")
        return
    if limits is None:
        p.notes.append(f"{alloc}: cannot be rewritten under slice {slice_name(alloc)}: its limits are unknown")
        return
    content = dataclasses.replace(
        hold_content(assignment, devices, p.observed, mps),
        reservation_id=hold.reservation_id,
        generation=hold.generation,
        binding=hold.binding,
        cgroup_parent=slice_name(alloc),
        limits=limits,
    )
    report = alloc not in p.state.reported
    intent = p.state.intents.get(alloc)
    event_id = intent.event_id if intent is not None and intent.op == "bind" else bound_id(p.node, alloc, hold.generation)
    p.steps.append(StopSlice(alloc))
    p.steps.append(
        BindHold(
            alloc,
            event_id,
            AllocationBound(
                allocation_id=alloc,
                reservation_id=hold.reservation_id,
                generation=hold.generation,
                devices=list(hold.devices),
                cgroup_parent=content.cgroup_parent,
                cdi_devices=_qualified(content),
            ),
            content,
            report=report,
            written=written_record(content, p.observed.vendor),
        )
    )


# ------------------------------------------------------------------------------ 5. new holds


def plan_new_holds(
    p: _Pass, index: AtomIndex, claims: Claims, ledger: HostLedger, mps: frozenset[str], kept: Mapping[str, HoldOnDisk]
) -> list[Failure]:
    """New holds in spec order through their checks; each that passes is bound, each that fails collected.

    Every atom (and every page of memory) a new hold takes counts against the holds after it.
    """
    state, observed, gen = p.state, p.observed, p.gen
    failures: list[Failure] = []
    undo: list[Step] = []
    admission = _Admission(ledger)
    for assignment in p.spec.devices:
        alloc = assignment.allocation_id
        if alloc in kept:
            continue
        taken_back = p.taken_back.get(alloc)
        if taken_back is not None:
            for atom in taken_back.devices:  # its own release does not stand in its way
                claims.discard(atom)
        try:
            if alloc in observed.claim_holds:
                rec = observed.state.claims.get(alloc.removeprefix("claim-"))
                holder = rec.holder if rec is not None else f"DRA claim {alloc.removeprefix('claim-')}"
                raise _Refused("overlap", f"{alloc}: its hold file bcd-{alloc}.json is {holder}'s")
            refused = state.refusals.get(alloc)
            if refused is not None and refused.generation == gen and state.reported_failures.get(alloc) == gen:
                # FAILED is terminal at its generation: what was refused stays
                # refused until a later generation asks again, even if the
                # cause (an excluded card, a full host) has gone since.
                raise _Refused(refused.reason, refused.message)
            if alloc in p.pending:
                # its old hold is a Kubernetes release still pending: this one binds in the
                # pass that reports it (the section reads PROGRESSING until then)
                rel = p.pending[alloc]
                p.waiting[alloc] = (
                    f"{alloc}: waits for its pending Kubernetes release from {_listed(rel.devices)} "
                    "(pods may still hold them); bound once that release is reported"
                )
                continue
            resolved = check_new_hold(assignment, index, claims, p.config)
            if taken_back is None:
                admission.check(assignment.limits, p.notes)
        except _Refused as exc:
            if taken_back is not None:
                # not taken back: the release goes on (reported once no pod holds it)
                p.pending[alloc] = taken_back
                for atom in taken_back.devices:
                    claims.add(atom, f"{alloc} (pending Kubernetes release)")
            failures.append(Failure(alloc, assignment.reservation_id, exc.reason, clip(exc.message)))  # type: ignore[arg-type]
            intent = state.intents.get(alloc)
            if intent is not None and intent.op == "bind" and alloc not in observed.holds and alloc not in p.released:
                # an interrupted bind (intent journaled, maybe its slice, no CDI
                # spec) whose assignment now fails: undone unreported after the
                # binds (its atoms are on no disk, nothing waits for it)
                undo.append(_undo_bind(alloc, intent, gen))
            continue
        if taken_back is not None:
            p.steps.append(DropPendingRelease(alloc))
        devices = hold_devices(resolved)
        # a hold already reported Bound whose files vanished is re-created as it
        # was bound (same generation, same event id) and not reported again
        again = state.bound.get(alloc) if alloc in state.reported and alloc not in p.released else None
        hold_gen = again.generation if again is not None else gen
        content = dataclasses.replace(hold_content(assignment, devices, observed, mps), generation=hold_gen)
        for r in resolved:
            claims.add(r.ref.id, alloc)
        if taken_back is None:  # a taken-back hold's booking was promised with its release
            ledger.promise(assignment.limits)
        p.steps.append(
            BindHold(
                alloc,
                again.event_id if again is not None else bound_id(p.node, alloc, gen),
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
                written=written_record(content, observed.vendor),
            )
        )
    p.steps.extend(undo)
    return failures


@dataclass
class _Admission:
    """Host admission for the new holds of one pass: the host is read once, when first needed."""

    ledger: HostLedger
    noted: bool = False

    def check(self, limits: Limits | None, notes: list[str]) -> None:
        problem = topology_problem(limits, self.ledger.host)
        if problem:
            raise _Refused("resources-exhausted", problem)
        if limits is None or not needs_admission(limits):
            return
        if not self.ledger.readable():
            if not self.noted:
                notes.append("host memory unreadable; binding without host-side admission")
            self.noted = True
            return
        problem = self.ledger.admit(limits)
        if problem:
            raise _Refused("resources-exhausted", problem)


# ------------------------------------------------------------------------------ 6. failures


def plan_failures(p: _Pass, failures: Iterable[Failure]) -> None:
    """One AllocationFailed per failing allocation, once per generation."""
    for f in failures:
        if p.state.reported_failures.get(f.allocation_id) != p.gen:
            p.steps.append(
                ReportFailed(
                    f.allocation_id,
                    failed_id(p.node, f.allocation_id, p.gen),
                    AllocationFailed(
                        allocation_id=f.allocation_id,
                        reservation_id=f.reservation_id,
                        generation=p.gen,
                        reason=f.reason,
                        message=f.message,
                    ),
                )
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


#: the condition a live hold carries upstream about its cards' health (HoldCondition)
DEVICES_HEALTHY = "DevicesHealthy"


def plan_hold_health(observed: Observed, index: AtomIndex, kept: Mapping[str, HoldOnDisk]) -> list[Step]:
    """A HoldCondition for each kept hold whose cards' health changed since it was last said.

    A hold on a card that turned unhealthy is kept (the seed releases only what the spec no
    longer wants) but says DevicesHealthy=False, naming each sick card and its Healthy condition,
    so the control plane can move the work; True follows once every card is well again. A hold
    that never had a sick card says nothing.

    | row         | its cards                       | last said | step                      |
    |-------------|---------------------------------|-----------|---------------------------|
    | quiet       | all healthy                     | none/True | nothing                   |
    | sick        | one unhealthy                   | none/True | False (the card's reason) |
    | still sick  | unchanged                       | False     | nothing                   |
    | worse       | another card, another message   | False     | False again (since kept)  |
    | well again  | all healthy                     | False     | True                      |
    """
    steps: list[Step] = []
    said = observed.state.hold_conditions
    for alloc, hold in sorted(kept.items()):
        sick: list[tuple[str, str, Condition]] = []
        for atom in hold.devices:
            try:
                ref = parse_atom(atom)
            except AtomError:
                continue
            gpu = index.gpus.get(ref.gpu)
            bad = gpu.status.unhealthy() if gpu is not None else None
            if gpu is not None and bad is not None:
                sick.append((atom, gpu.pci_address, bad))
        last = said.get(alloc)
        if sick:
            text = "; ".join(f"{atom} on {pci}: {health_text(c)}" for atom, pci, c in sick)
            cond = Condition(type=DEVICES_HEALTHY, status="False", reason=sick[0][2].reason, message=clip(text), since=observed.now)
            devices = tuple(dict.fromkeys(atom for atom, _, _ in sick))
        elif last is not None and last.status == "False":
            cond = Condition(type=DEVICES_HEALTHY, status="True", reason="Healthy", message="every card of the hold is healthy again", since=observed.now)
            devices = tuple(hold.devices)
        else:
            continue
        if last is not None and (last.status, last.reason, last.message) == (cond.status, cond.reason, cond.message):
            continue
        if last is not None and last.status == cond.status:
            cond = msgspec.structs.replace(cond, since=last.since)
        steps.append(SetHoldCondition(alloc, hold.reservation_id, hold.generation, devices, cond))
    return steps


STUCK = "KubernetesReleaseStuck"
UNKNOWN_FIELDS = UNKNOWN_FIELDS_CONDITION
UNREADABLE = "KubernetesReleasesUnreadable"


def _conditions(observed: Observed, config: PlanConfig, pending: Mapping[str, PendingRelease], unreadable: bool, generation: int = 0) -> list[Step]:
    """KubernetesReleaseStuck, KubernetesReleasesUnreadable and NodeSpecUnknownFields, raised and cleared on change."""
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
                message=f"pods still hold the devices of {summarise(stuck, TEXT_MAX - 64, sep=', ')} (pending longer than {mins} min)",
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
    wanted.extend(_unknown_fields_condition(observed, generation))
    steps: list[Step] = []
    for cond in wanted:
        last = observed.state.conditions.get(cond.type)
        if last is None or last.status != cond.status or last.message != cond.message:
            # a condition keeps its `since` while its status holds; NodeSpecUnknownFields
            # is a report per generation, so each one is a new event (its id has `since`)
            if last is not None and last.status == cond.status and cond.type != UNKNOWN_FIELDS:
                cond = msgspec.structs.replace(cond, since=last.since)
            steps.append(SetCondition(cond))
    return steps


def _unknown_fields_condition(observed: Observed, generation: int) -> list[Condition]:
    """NodeSpecUnknownFields: True naming the fields (once per generation), False once a spec has none."""
    fields = observed.spec_unknown_fields
    if fields:
        head = f"generation {generation}: {len(fields)} field{'s' if len(fields) != 1 else ''} this node does not know, ignored: "
        return [
            Condition(
                type=UNKNOWN_FIELDS,
                status="True",
                reason="UnknownFields",
                message=head + summarise(list(fields), TEXT_MAX - len(head), sep="; "),
                since=observed.now,
            )
        ]
    last = observed.state.conditions.get(UNKNOWN_FIELDS)
    if last is not None and last.status == "True":
        return [
            Condition(
                type=UNKNOWN_FIELDS,
                status="False",
                reason="NoUnknownFields",
                message=f"generation {generation}: every field of the spec is known",
                since=observed.now,
            )
        ]
    return []


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


def check_new_hold(assignment: DeviceAssignment, index: AtomIndex, claims: Claims, config: PlanConfig) -> list[ResolvedAtom]:
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
    for r in resolved:
        # part of the atoms check: a card with a fatal XID, an uncorrectable ECC error or lost is
        # given to nobody new (a hold already on it is kept: the seed releases only what is unwanted)
        if (sick := r.gpu.status.unhealthy()) is not None:
            raise _Refused("device-unhealthy", f"{r.ref.id}: the card {r.gpu.pci_address} is unhealthy: {health_text(sick)}")
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


__all__ = [
    "plan",
    "plan_kubernetes_releases",
    "plan_releases",
    "plan_leftover_slices",
    "claims_after_releases",
    "plan_kept_holds",
    "trusted_holds",
    "stale_hold_files",
    "without_stale_files",
    "written_record",
    "consumer_copy_stale",
    "assignment_changes",
    "wanted_again",
    "recorded_limits",
    "plan_new_holds",
    "plan_failures",
    "check_new_hold",
    "section_status",
    "Claims",
    "hold_devices",
    "hold_content",
    "UNREADABLE_RELEASES_HOLDER",
]
