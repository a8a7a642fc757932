"""What the converger observes, what it plans, and the state it keeps across crashes.

`Observed` is everything one pass reads (holds on disk, env files, slices,
inventory, vendor CDI spec, VFIO claims, and the converger's own journal);
`Plan` is what the pure planner returns: ordered steps, failures, and the
section status the pass aims for. `ConvergerState` is the journal on disk:
intent recorded before side effects (boot id stamped), which holds have been
reported Bound, which failures and section status were reported, and the generation
of each allocation's last reported Released (`ConvergerState.released`, the newest
`RELEASED_KEPT`): a hold file found afterwards for such an allocation, at that
generation or older, is a stale copy (plan.stale_hold_files), removed, never adopted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import msgspec

from shared.holdfiles import HoldContent, HoldOnDisk
from shared.schemas import (
    ClaimSharing,
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    Condition,
    FailureReason,
    GpuOp,
    Inventory,
    Limits,
    NodeSpec,
    SectionStatus,
)
from shared.vendorcdi import VendorCdi

from .releases import PendingRelease

SECTION = "devices"

# ---------------------------------------------------------------------------- journal


class Intent(msgspec.Struct, frozen=True, kw_only=True):
    """An operation started and not yet completed (written before its first side effect)."""

    op: Literal["bind", "release"]
    allocation_id: str
    reservation_id: str
    generation: int
    devices: list[str]
    event_id: str
    boot_id: str
    started_at: datetime
    cgroup_parent: str = ""
    sliced: bool = False


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """An AllocationFailed in the outbox: final at its generation (DESIGN 12)."""

    generation: int
    reason: str
    message: str


class MigLayoutRecord(msgspec.Struct, kw_only=True):
    """A card's desired MIG layout and where it stands (gpuops.plan_mig_layouts)."""

    layout: str
    #: "operator" (bcd gpu mig-layout; kept over the node's configuration) or "config" (--mig-layouts)
    source: str = "operator"
    #: Pending | Applying | Applied | Failed
    state: str = "Pending"
    message: str = ""
    since: datetime
    #: the boot in which a mode change waits for a GPU reset: not tried again in it
    blocked_boot: str = ""


class RelayoutCard(msgspec.Struct, kw_only=True):
    """One card of a MIG re-layout (relayout.py): its target, the layout to roll back to, its step."""

    target: str
    #: the layout before ("" for MIG on with no instance: nothing to roll back to)
    before: str
    #: waiting | draining | applying | rebooting | rollback | done
    step: str = "waiting"
    #: "" while it runs; success | failed
    outcome: str = ""
    message: str = ""
    #: kube_reaper was asked to evict the pods using it (asked again while they stay)
    evicted: bool = False
    #: its target failed: it goes back to `before` (a reboot the rollback waits for keeps this)
    rolling_back: bool = False
    #: a failed all-disabled was tried once more
    retried: bool = False


class RelayoutJob(msgspec.Struct, kw_only=True):
    """The node's MIG re-layout from its Node label (relayout.py), journaled before each step acts."""

    #: the `nvidia.com/mig.config` value it applies
    config: str
    #: pausing | draining | applying | finishing | done
    step: str
    #: "" while it runs; success | failed (set before finishing)
    outcome: str = ""
    message: str = ""
    started_at: datetime
    step_since: datetime
    cards: dict[str, RelayoutCard] = {}
    #: `nvidia.com/gpu.deploy.*` labels the job paused -> their value before
    paused: dict[str, str] = {}
    #: the job adds the taint / the cordon (they were not there): it takes them back
    tainted: bool = False
    cordoned: bool = False


class ClaimMig(msgspec.Struct, kw_only=True):
    """The MIG instance a claim's device is made of, step by step (journaled before each NVML step).

    step: "gi-asked" (create-gi asked; `gi` unknown until answered), "gi-made",
    "ci-asked", "ci-made"; on unprepare "ci-gone" once the compute instance is
    destroyed. A restart finds here what may exist, so no instance is left that
    nobody owns.
    """

    profile: str
    start: int
    step: str = "gi-asked"
    gi: int | None = None
    ci: int | None = None
    uuid: str = ""


class ClaimVfio(msgspec.Struct, kw_only=True):
    """A claim's card passed through (VfioDeviceConfig), step by step: "switch-asked" (the switch
    to vfio-pci asked; whether it happened is the switcher's to say), "switched", "back-asked"
    (the switch back to the native driver asked)."""

    step: str = "switch-asked"
    iommu_group: int | None = None


class ClaimMps(msgspec.Struct, kw_only=True):
    """A claim's MPS control daemon (one per claim), journaled before it is started or stopped:
    "start-asked", "started", "stop-asked". What it serves and its limits are what was asked."""

    control: str
    uuids: list[str] = []
    active_thread_percentage: int | None = None
    pinned_memory: dict[str, int] = {}
    step: str = "start-asked"


class ClaimTimeslice(msgspec.Struct, kw_only=True):
    """A card's time slice a claim set (TimeSlicing), journaled: "set-asked", "set", "reset-asked".
    The card's compute policy is the card's, not the claim's: it goes back to Default only when
    no other claim on the card still holds a time slice."""

    pci: str
    uuid: str
    interval: str
    step: str = "set-asked"


class ClaimDeviceRecord(msgspec.Struct, kw_only=True):
    """One device of a claim: what the kubelet plugin asked for, and the atom it became."""

    requests: list[str] = []
    pool: str
    device: str
    pci: str
    kind: str
    #: the atom held (GPU-<uuid>, or GPU-<uuid>/gi<N>/ci<M> once its MIG instance exists)
    atom: str = ""
    mig: ClaimMig | None = None
    #: what the claim's opaque config asked of the device (Exclusive: nothing)
    sharing: ClaimSharing = ClaimSharing()
    #: a share of a card beside other claims (consumable capacity): its shareID and what it consumed
    share_id: str = ""
    share_percent: int | None = None
    memory_bytes: int | None = None
    vfio: ClaimVfio | None = None
    #: admin access (KEP-5018): read-only, no holder of its card, makes no MIG, MPS, time slice or
    #: switch; a MIG device names the instance found at its placement (`atom`, "" for none), never `mig`
    admin_access: bool = False

    @property
    def shared(self) -> bool:
        return bool(self.share_id)

    @property
    def percent(self) -> int:
        """What the device takes of its card: its share, or all of it."""
        return (self.share_percent or 100) if self.share_id else 100


class ClaimRecord(msgspec.Struct, kw_only=True):
    """A DRA claim's hold (`bcd-claim-<uid>.json`): journaled before its first side effect."""

    uid: str
    namespace: str
    name: str
    #: preparing | prepared | unpreparing
    state: str = "preparing"
    devices: list[ClaimDeviceRecord] = []
    boot_id: str = ""
    since: datetime
    message: str = ""
    #: its MPS daemon (devices whose config asks MPS); None for none
    mps: ClaimMps | None = None
    #: the time slices it set, one per card
    timeslices: list[ClaimTimeslice] = []

    @property
    def holder(self) -> str:
        return f"DRA claim {self.namespace}/{self.name}"


class Written(msgspec.Struct, frozen=True, kw_only=True):
    """What bcd wrote for a hold: its typed fields and the digests of its hold spec and env file.

    Journaled before the files are written (a bind, a put-back), so a restart still knows
    what the files must say and never adopts an edited file as truth: a file on disk whose
    digest differs is drift, put back from `content` (the same function renders the same
    bytes; only a vendor spec changed since renders other edits, and then the record
    follows what was written). The consumer copy is a pure function of the hold spec."""

    content: HoldContent
    cdi: bytes
    env: bytes


#: how many reported Releases `ConvergerState.released` keeps (the oldest go first): a stale
#: copy of an allocation released longer ago is a hold spec the node never knew (released again)
RELEASED_KEPT = 1024


class ConvergerState(msgspec.Struct, kw_only=True):
    """`<data_dir>/converger/state.json` (0600, written atomically)."""

    boot_id: str = ""
    #: allocation id -> event id of the Bound in the outbox.
    reported: dict[str, str] = {}
    #: allocation id -> what its reported Bound said, so a hold whose CDI spec
    #: vanished from outside is still released with a Released, or re-created
    #: without a second Bound.
    bound: dict[str, Intent] = {}
    #: allocation id -> generation whose AllocationFailed is in the outbox.
    reported_failures: dict[str, int] = {}
    #: allocation id -> the failure reported for it (its generation, reason and
    #: message): the assignment stays refused with it for that whole generation,
    #: whatever changes on the node, so a control plane that re-placed the
    #: booking never sees it bound here too.
    refusals: dict[str, Refusal] = {}
    last_section: SectionStatus | None = None
    #: node conditions as last published (type -> condition).
    conditions: dict[str, Condition] = {}
    intents: dict[str, Intent] = {}
    #: PCI address -> domain name, for domains running at the last pass.
    domain_gpus: dict[str, str] = {}
    #: the VFIO record: PCI address -> instance id (or "reclaim") of each card
    #: the converger put on vfio-pci, or is switching. Written BEFORE the
    #: switch request, so a crash in between converges on restart; a card
    #: leaves the record once it is back on its native driver.
    vfio: dict[str, str] = {}
    #: PCI address -> boot id of a switch that answered DisruptionRequired: no
    #: switch of that card is asked for again in that boot.
    vfio_stuck: dict[str, str] = {}
    #: PCI address -> the maintenance operation running on it (gpuops.py): written
    #: before it is asked of anyone; the card is claimed while it is here.
    gpu_ops: dict[str, GpuOp] = {}
    #: "<op> <pci>" -> the last finished operation of that kind on that card.
    gpu_op_results: dict[str, GpuOp] = {}
    #: PCI address -> the card's desired MIG layout and its state.
    mig_layouts: dict[str, MigLayoutRecord] = {}
    #: claim uid -> the DRA claim held as a hold of its own (claims.py).
    claims: dict[str, ClaimRecord] = {}
    #: allocation id -> the DevicesHealthy condition last said upstream of its live hold (HoldCondition);
    #: absent while nothing was ever wrong under it
    hold_conditions: dict[str, Condition] = {}
    #: allocation id -> what bcd wrote for its hold (Written): the truth the disk is compared
    #: with. A hold bound by a bcd without this record is taken as found once (RecordWritten).
    written: dict[str, Written] = {}
    #: allocation id -> the generation of its last Released in the outbox (a plain hold's or a
    #: Kubernetes one's), oldest first, at most RELEASED_KEPT; dropped when the allocation is
    #: reported Bound again. A hold spec (or env file) of such an allocation that is not live
    #: again, at that generation or older, is a copy of what was released (put back from a
    #: backup, left by an older bcd): removed as drift, never a hold, a claim or a new Released.
    released: dict[str, int] = {}
    #: the MIG re-layout its Kubernetes Node's label asks for, while it runs (relayout.py)
    relayout: RelayoutJob | None = None
    #: the last one that ended (what the state label says, and why)
    relayout_last: RelayoutJob | None = None
    #: the Node's `nvidia.com/mig.config` as last read ("": none): while set, the label owns the
    #: node's MIG layouts and `bcd gpu mig-layout` is refused
    relayout_label: str = ""

    def note_released(self, allocation_id: str, generation: int) -> None:
        """Record a Released now in the outbox (newest last; the oldest beyond RELEASED_KEPT go)."""
        self.released.pop(allocation_id, None)
        self.released[allocation_id] = generation
        while len(self.released) > RELEASED_KEPT:
            del self.released[next(iter(self.released))]


# ---------------------------------------------------------------------------- observed


@dataclass(frozen=True)
class Observed:
    holds: Mapping[str, HoldOnDisk] = field(default_factory=dict)
    #: allocation id -> env file content, for the env files present.
    env_files: Mapping[str, bytes] = field(default_factory=dict)
    #: allocation ids with a bcd-alloc-<id>.slice present, and those of them that are empty.
    slices: frozenset[str] = frozenset()
    empty_slices: frozenset[str] = frozenset()
    #: allocation -> what its slice reads back (`Slices.properties`), for the present slices of
    #: holds on disk with a cgroup parent; None where it does not read. The plan compares it
    #: with what the hold's limits make (`shared.slices.slice_differences`).
    slice_props: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    #: the slice backend reads huge page limits (False: they are not compared)
    slice_hugepages: bool = True
    inventory: Inventory | None = None
    vendor: VendorCdi | None = None
    #: PCI address -> holder text, GPUs claimed by the VFIO side (instance specs, running domains).
    vfio_claims: Mapping[str, str] = field(default_factory=dict)
    #: PCI address -> holder text, GPUs a maintenance operation (reset, diagnostic) claims now.
    maintenance: Mapping[str, str] = field(default_factory=dict)
    #: PCI address -> where a switch since the inventory was read left the card
    #: ("vfio-pci", "native", or the driver a DisruptionRequired left it on, "" for
    #: none): the inventory does not show it yet.
    switched: Mapping[str, str] = field(default_factory=dict)
    #: leftover temp files of interrupted atomic writes.
    temp_files: tuple[str, ...] = ()
    state: ConvergerState = field(default_factory=ConvergerState)
    #: devices of Kubernetes releases still pending: atom id -> allocation
    #: (derived from `pending_releases` by `with_releases`; tests may set it directly).
    pending_release_atoms: Mapping[str, str] = field(default_factory=dict)
    #: the releases file could not be read (or its marker is still there): every GPU counts as held.
    releases_unreadable: bool = False
    #: Kubernetes releases recorded in releasing.json, by allocation.
    pending_releases: Mapping[str, PendingRelease] = field(default_factory=dict)
    #: the reaper's answer per pending release: False = no pod holds any of its
    #: devices (reachable); True or absent = held, or could not be established.
    release_held: Mapping[str, bool] = field(default_factory=dict)
    #: the reaper established that no pod holds a bcd GPU of an allocation this
    #: node does not know (clears the unreadable marker).
    no_orphans: bool = False
    now: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    #: fields of the spec as received that NodeSpec does not declare, as `$.path: unknown field`
    #: (ignored; condition NodeSpecUnknownFields names them once per generation).
    spec_unknown_fields: tuple[str, ...] = ()
    #: the DRA claims' holds on disk (bcd-claim-<uid>.json): never released by a pass, held against every new hold.
    claim_holds: Mapping[str, HoldOnDisk] = field(default_factory=dict)
    #: allocation -> digest of its consumer copy in the consumer dir; None: consumer copies are
    #: not kept (no consumer dir), so none is planned.
    consumer_copies: Mapping[str, bytes] | None = None


@dataclass(frozen=True)
class PlanConfig:
    node_id: str
    privileged: bool = True
    #: bindings this node binds as holds.
    supported_bindings: frozenset[str] = frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"})
    system_reserve_bytes: int = 0
    #: a Kubernetes release pending longer than this raises KubernetesReleaseStuck.
    stuck_after: timedelta = timedelta(minutes=5)


# ---------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class ReleaseHold:
    allocation_id: str
    event_id: str
    event: AllocationReleased
    sliced: bool
    #: False for a bind that was never reported (abandoned): undo files, send nothing.
    report: bool = True


@dataclass(frozen=True)
class StopSlice:
    allocation_id: str


@dataclass(frozen=True)
class EnsureSlice:
    """Create a kept hold's missing slice, or apply its limits again to one that reads back
    otherwise (changed from outside: `drifted` names the properties; counted as drift, no
    second Bound). The backends' apply is idempotent either way."""

    allocation_id: str
    limits: Limits
    #: the properties that differ from what the limits make; () for a missing slice
    drifted: tuple[str, ...] = ()


@dataclass(frozen=True)
class WriteEnv:
    allocation_id: str
    content: HoldContent


@dataclass(frozen=True)
class WriteConsumer:
    """(Re)write a kept hold's consumer copy from its hold spec on disk: missing (tmpfs after a
    reboot, removed from outside) or not what the hold spec makes."""

    allocation_id: str
    #: the copy is there but not what its spec makes (edited from outside): counted as drift
    drifted: bool = False


@dataclass(frozen=True)
class RestoreHold:
    """Files of a kept hold that are on disk but not what bcd wrote (edited from outside, still
    parsing): `written` is journaled, then each of `files` ("cdi", "allocation-env") is written
    again from its content, unreported (no second Bound)."""

    allocation_id: str
    written: Written
    files: tuple[str, ...]


@dataclass(frozen=True)
class RecordWritten:
    """A kept hold with no record of what bcd wrote (bound by an older bcd): its files as found
    are recorded once, so an edit after this is seen."""

    allocation_id: str
    written: Written


@dataclass(frozen=True)
class RemoveConsumer:
    """Remove a consumer copy whose hold spec is gone: a runtime must never find a device no hold backs."""

    allocation_id: str


@dataclass(frozen=True)
class RemoveStaleHold:
    """Files of an allocation whose Released the node already reported (ConvergerState.released),
    found again at that generation or older (put back from outside): removed, consumer copy
    first, each counted as drift; nothing is reported and no claim is made."""

    allocation_id: str
    #: the generation of the Released the files predate
    released_generation: int
    #: of "cdi-consumer", "cdi", "allocation-env", in that order: the ones on disk
    files: tuple[str, ...]


@dataclass(frozen=True)
class BindHold:
    """Slice (when limits), CDI spec, env file, then AllocationBound.

    The step carries typed fields, not file bytes: the HostWriter builds the
    files itself (the root helper must never take content from the wire).
    """

    allocation_id: str
    event_id: str
    event: AllocationBound
    content: HoldContent
    #: False when re-creating the files of a hold already reported Bound.
    report: bool = True
    #: what the files will say (journaled with the intent, before they are written); None: not recorded
    written: Written | None = None


@dataclass(frozen=True)
class ReportBound:
    """A hold on disk whose Bound is not in the outbox yet (a bind interrupted after its files)."""

    allocation_id: str
    event_id: str
    event: AllocationBound


@dataclass(frozen=True)
class ReportFailed:
    allocation_id: str
    event_id: str
    event: AllocationFailed


@dataclass(frozen=True)
class RemoveTemp:
    path: str


@dataclass(frozen=True)
class WithdrawKubeHold:
    """Record the release in releasing.json, then remove CDI spec and env file, then ask for evictions."""

    allocation_id: str
    release: PendingRelease


@dataclass(frozen=True)
class ReportKubeRelease:
    """No pod holds the devices any more: AllocationReleased, then drop the record."""

    allocation_id: str
    release: PendingRelease


@dataclass(frozen=True)
class DropPendingRelease:
    """A later spec wants the allocation again: the release is dropped unreported."""

    allocation_id: str


@dataclass(frozen=True)
class SetCondition:
    """Publish a node condition (through the outbox) when it changed."""

    condition: Condition


@dataclass(frozen=True)
class SetHoldCondition:
    """Say upstream (through the outbox) that a live hold's cards turned unhealthy or are well again."""

    allocation_id: str
    reservation_id: str
    generation: int
    devices: tuple[str, ...]
    condition: Condition


@dataclass(frozen=True)
class ClearUnreadableMarker:
    pass


@dataclass(frozen=True)
class SwitchGpu:
    """Record the card in the VFIO record (before anything else), then ask vfio_switcher to switch it.

    `holder` is what the record keeps for the card: the instance id, or
    "reclaim". A switch back to native keeps the record until it succeeded.
    """

    pci: str
    target: Literal["vfio-pci", "native"]
    why: str
    holder: str


@dataclass(frozen=True)
class RecordVfio:
    """The card is already where the VFIO side wants it: only the record changes (None drops it)."""

    pci: str
    holder: str | None


Step = (
    ReleaseHold
    | StopSlice
    | EnsureSlice
    | WriteEnv
    | WriteConsumer
    | RestoreHold
    | RecordWritten
    | RemoveConsumer
    | RemoveStaleHold
    | BindHold
    | ReportBound
    | ReportFailed
    | RemoveTemp
    | WithdrawKubeHold
    | ReportKubeRelease
    | DropPendingRelease
    | SetCondition
    | SetHoldCondition
    | ClearUnreadableMarker
    | SwitchGpu
    | RecordVfio
)


@dataclass(frozen=True)
class Failure:
    allocation_id: str
    reservation_id: str
    reason: FailureReason
    message: str


@dataclass(frozen=True)
class Plan:
    generation: int
    steps: tuple[Step, ...] = ()
    failures: tuple[Failure, ...] = ()
    #: what the section reads when every step succeeds.
    section: SectionStatus | None = None
    #: log lines the pass should emit (the planner is pure and does not log).
    notes: tuple[str, ...] = ()
    #: Kubernetes releases still pending after this pass (the pass rechecks them).
    pending: tuple[str, ...] = ()
    #: cards an instance wants on vfio-pci that wait for a hold, bind intent or
    #: pending release to go (the pass retries them).
    vfio_waiting: tuple[str, ...] = ()
    #: why a card the VFIO side wants is not switched (logged when they change).
    vfio_notes: tuple[str, ...] = ()
    #: held allocations whose assignment changed, and what differs: released, then bound again.
    changed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: wanted allocations that wait for their old hold's pending Kubernetes release (bound in the
    #: pass that reports it; the pass rechecks them with the pending releases).
    waiting: tuple[str, ...] = ()

    def kinds(self) -> list[str]:
        return [type(s).__name__ for s in self.steps]


__all__ = [
    "SECTION",
    "Intent",
    "Refusal",
    "ConvergerState",
    "Observed",
    "PlanConfig",
    "ReleaseHold",
    "StopSlice",
    "EnsureSlice",
    "WriteEnv",
    "WriteConsumer",
    "RestoreHold",
    "RecordWritten",
    "Written",
    "RemoveConsumer",
    "RemoveStaleHold",
    "RELEASED_KEPT",
    "BindHold",
    "ReportBound",
    "ReportFailed",
    "RemoveTemp",
    "WithdrawKubeHold",
    "ReportKubeRelease",
    "DropPendingRelease",
    "SetCondition",
    "SetHoldCondition",
    "ClearUnreadableMarker",
    "SwitchGpu",
    "RecordVfio",
    "Step",
    "Failure",
    "Plan",
    "NodeSpec",
]
