"""Request and reply bodies of node-bus endpoints (never seen upstream)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from .common import (
    END,
    HUGEPAGE_MAX_KIB,
    HUGEPAGE_MIN_KIB,
    HUGEPAGES_MAX_COUNT,
    LIMITS_MAX_CPU,
    LIMITS_MAX_CPU_MILLIS,
    LIMITS_MAX_MEMORY_BYTES,
    LIMITS_MAX_NUMA_NODE,
    AtomId,
    Condition,
    EventId,
    Generation,
    Id,
    KeyId,
    Name,
    NonNegInt,
    PciAddress,
    Text,
)
from .events import AttestedEvent, AttestedReport, SectionStatus
from .inventory import Gpu
from .kubenode import RelayoutStatus


class SignRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the signer for an AttestedReport.

    `purpose` is a plain string so an unknown purpose reaches the signer and is
    refused with a reason instead of failing as a decode error.
    """

    purpose: Annotated[str, msgspec.Meta(max_length=64)]
    event_id: EventId
    event: AttestedEvent


#: the most reports one batch sign request asks for (the converger cuts a pass's
#: reports into requests of at most this many, and of a bounded size).
SIGN_BATCH_MAX = 256


class SignItem(msgspec.Struct, frozen=True, kw_only=True):
    """One report body to sign: the signer stamps node id, boot id and time itself."""

    event_id: EventId
    event: AttestedEvent


class SignBatchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the signer for one AttestedReport per item, in item order (one request per pass).

    The whole batch is refused when `purpose` is one the signer does not sign.
    """

    purpose: Annotated[str, msgspec.Meta(max_length=64)]
    items: Annotated[list[SignItem], msgspec.Meta(max_length=SIGN_BATCH_MAX)]


class SignBatchReply(msgspec.Struct, frozen=True, kw_only=True):
    """The reports of a SignBatchRequest, one per item and in its order."""

    reports: Annotated[list[AttestedReport], msgspec.Meta(max_length=SIGN_BATCH_MAX)]


class SignerKey(msgspec.Struct, frozen=True, kw_only=True):
    node_id: Id
    public_key: bytes
    key_id: KeyId
    boot_id: Name


class Empty(msgspec.Struct, frozen=True, kw_only=True):
    """A request with no arguments (an empty body also decodes as this)."""




class SpecAck(msgspec.Struct, frozen=True, kw_only=True):
    """The converger's answer to a handed-over NodeSpec."""

    generation: Generation
    #: False when the spec was the one already applied (nothing new to do).
    changed: bool = True


class HoldSummary(msgspec.Struct, frozen=True, kw_only=True):
    allocation_id: str
    reservation_id: str
    generation: Generation
    binding: str
    devices: list[str]
    cgroup_parent: str = ""
    reported: bool = True
    #: the DevicesHealthy condition said upstream for it (a card under it is unhealthy), or None
    condition: Condition | None = None


class PendingReleaseSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A withdrawn Kubernetes hold whose Released waits until no pod holds its devices."""

    allocation_id: str
    reservation_id: str
    #: the generation that released it (its Released carries it)
    generation: Generation
    devices: list[str]
    since: datetime
    #: the operator said no pod holds them (`bcd releases --free`): reported at the next pass
    freed: bool = False


#: the most problems a ConvergerStatus lists (the last says how many more there are).
PROBLEMS_MAX = 32


class ConvergerStatus(msgspec.Struct, frozen=True, kw_only=True):
    generation: Generation | None = None
    section: SectionStatus | None = None
    holds: list[HoldSummary] = []
    #: allocation id -> reason, for the failures of the current generation.
    failures: dict[str, str] = {}
    last_pass_at: datetime | None = None
    next_retry_in_s: float | None = None
    #: the converger can write CDI specs and slices (root, fake host or helper).
    privileged: bool = True
    #: bindings it binds as holds.
    bindings: list[str] = []
    #: the vendor's CDI spec the holds copy edits from ("" when there is none).
    vendor_cdi_spec: str = ""
    #: why that vendor spec cannot be read ("" when it reads or there is none):
    #: no new hold is bound while it is unreadable (retried).
    vendor_cdi_error: Text = ""
    #: what an operator should look at (entries of the hold directories that are
    #: not regular files and were skipped, a reduced outbox), at most PROBLEMS_MAX.
    problems: Annotated[list[Text], msgspec.Meta(max_length=PROBLEMS_MAX)] = []
    #: where the journal and the hold files disagree now (a reported hold whose spec, env file
    #: or consumer copy is not on disk, a hold spec the journal never bound), one line each;
    #: the next pass, woken within --watch-interval, puts them right
    drift: Annotated[list[Text], msgspec.Meta(max_length=PROBLEMS_MAX)] = []
    #: regular files in the hold directories that are none of bcd's (a `bcd-*.json` that is not a hold,
    #: an env file of no hold, `junk` in the env dir), one line each naming it: reported, never opened
    #: again nor removed
    odd_files: Annotated[list[Text], msgspec.Meta(max_length=PROBLEMS_MAX)] = []
    #: the outbox is smaller than --outbox-max-bytes asked (the server refused the reservation), or "".
    outbox_warning: Text = ""
    #: the outbox stream could not be created (no room even for its floor): no event is journaled, or "".
    outbox_error: Text = ""
    #: the node conditions the converger raised, as last published (NodeSpecUnknownFields,
    #: KubernetesReleaseStuck, ...), by type; status False ones are cleared ones.
    conditions: Annotated[list[Condition], msgspec.Meta(max_length=PROBLEMS_MAX)] = []
    #: host memory the converger never promises to holds (--system-reserve-bytes): what a dry run plans with.
    system_reserve_bytes: NonNegInt = 0
    #: maintenance operations: those running, then the last of each kind per card.
    gpu_ops: Annotated[list["GpuOp"], msgspec.Meta(max_length=4096)] = []
    #: the cards with a desired MIG layout and where each stands.
    mig_layouts: Annotated[list["MigLayoutState"], msgspec.Meta(max_length=1024)] = []
    #: the MIG re-layout its Kubernetes Node's `nvidia.com/mig.config` drives (None: no Node API answered yet)
    relayout: RelayoutStatus | None = None
    #: the DRA claims held as holds of their own (bcd-claim-<uid>.json)
    claims: Annotated[list["ClaimSummary"], msgspec.Meta(max_length=4096)] = []
    #: Kubernetes holds withdrawn and not yet released (their devices stay claimed), oldest first
    pending_releases: Annotated[list[PendingReleaseSummary], msgspec.Meta(max_length=4096)] = []
    #: why the VFIO side leaves a card an instance names where it is (an unhealthy card, an
    #: excluded one, a holder to wait for), one line each, from the last pass
    vfio_notes: Annotated[list[Text], msgspec.Meta(max_length=PROBLEMS_MAX)] = []


class HolderQuery(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU by canonical PCI address or GPU atom id."""

    gpu: Annotated[str, msgspec.Meta(max_length=128)]


#: HolderReply.kind of a card a DRA claim passes through (VfioDeviceConfig): the converger switches it
PASSTHROUGH_CLAIM = "passthrough-claim"


class HolderReply(msgspec.Struct, frozen=True, kw_only=True):
    held: bool
    #: "allocation", "claim", "passthrough-claim", "instance", "domain", "release" or "" when free.
    kind: str = ""
    holder: str = ""
    gpu: str = ""




# --------------------------------------------------------------------------- kube_reaper


class DevicesQuery(msgspec.Struct, frozen=True, kw_only=True):
    """Devices (atom ids) of one allocation, asked about or to be freed."""

    allocation_id: Id
    devices: Annotated[list[AtomId], msgspec.Meta(max_length=64)]


class HeldReply(msgspec.Struct, frozen=True, kw_only=True):
    #: True when a pod (or a kubepods process) holds any of the devices, or when
    #: that could not be established (unreachable kubelet counts as held).
    held: bool
    reachable: bool = True
    #: "namespace/pod" (or "pid N") per holder.
    holders: list[str] = []
    detail: str = ""


class EvictReply(msgspec.Struct, frozen=True, kw_only=True):
    #: pods an eviction was requested for (asynchronously, with backoff on 429).
    evicting: list[str] = []
    errors: list[str] = []


class Freed(msgspec.Struct, frozen=True, kw_only=True):
    """Published by kube_reaper when no pod holds the devices of a withdrawn allocation any more."""

    allocation_id: Id
    devices: list[AtomId] = []


# --------------------------------------------------------------------------- device_plugin

#: the most resources, holds and devices a DevicePluginStatus lists.
DEVICE_PLUGIN_LIST_MAX = 4096


class PluginResource(msgspec.Struct, frozen=True, kw_only=True):
    """One extended resource the device plugin serves (one socket, one Register)."""

    #: e.g. "bcd.dev/gpu".
    name: Name
    #: the plugin's socket file name in the kubelet's device-plugins directory.
    endpoint: Name
    registered: bool = False
    devices: NonNegInt = 0
    healthy: NonNegInt = 0
    #: ListAndWatch streams the kubelet holds open.
    streams: NonNegInt = 0
    #: why the last Register failed, or "".
    error: Text = ""


class AdvertisedHold(msgspec.Struct, frozen=True, kw_only=True):
    """A Kubernetes hold as the device plugin sees it."""

    allocation_id: Id
    advertised: bool
    #: the kubelet device ids (CDI device names) advertised, in file order.
    devices: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    resources: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    #: why it is not advertised (withdrawn, atom unknown to the inventory), or the unhealthy reason.
    reason: Text = ""


class DevicePluginStatus(msgspec.Struct, frozen=True, kw_only=True):
    #: the kubelet's Registration socket.
    kubelet_socket: Text
    #: that socket exists.
    kubelet_present: bool = False
    #: every resource is registered with the kubelet that is there now.
    registered: bool = False
    resources: Annotated[list[PluginResource], msgspec.Meta(max_length=DEVICE_PLUGIN_LIST_MAX)] = []
    holds: Annotated[list[AdvertisedHold], msgspec.Meta(max_length=DEVICE_PLUGIN_LIST_MAX)] = []
    #: Allocate calls answered since start.
    allocations: NonNegInt = 0


class WithdrawReply(msgspec.Struct, frozen=True, kw_only=True):
    """The device plugin's answer to a withdrawal: what left the advertisement, and whom it told."""

    #: device ids no longer advertised.
    withdrawn: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    #: ListAndWatch streams that were sent the update (and took it) before this reply.
    streams: NonNegInt = 0
    detail: Text = ""


class OrphanQuery(msgspec.Struct, frozen=True, kw_only=True):
    """Atoms of every allocation the node knows; anything else a pod holds is an orphan."""

    known_devices: Annotated[list[AtomId], msgspec.Meta(max_length=65536)] = []


class OrphanReply(msgspec.Struct, frozen=True, kw_only=True):
    reachable: bool
    #: "namespace/pod: device" for each bcd GPU held by a pod outside known allocations.
    orphans: list[str] = []

# --------------------------------------------------------------------------- VFIO and PhysicalGPU


class SwitchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask vfio_switcher to move one GPU between its native driver and vfio-pci.

    Plain bounded strings, not patterns: a malformed address or an unknown
    target reaches the switcher and is refused with a reason (InvalidAddress,
    InvalidRequest) instead of failing as an anonymous decode error.
    """

    pci: Annotated[str, msgspec.Meta(max_length=64)]
    #: "vfio-pci" or "native"; "reset": a PCI function reset instead of a switch
    target: Annotated[str, msgspec.Meta(max_length=16)]
    #: who asks and why (logs and the result notice only)
    why: Annotated[str, msgspec.Meta(max_length=256)] = ""


class SwitchReply(msgspec.Struct, frozen=True, kw_only=True):
    """What a switch did; also published as a notice on `vfio_switcher.result`."""

    pci: Annotated[str, msgspec.Meta(max_length=128)]
    target: Annotated[str, msgspec.Meta(max_length=32)]
    #: Succeeded | Unchanged | Refused | Failed | DisruptionRequired
    outcome: Name
    #: machine-readable cause (see services/vfio_switcher/switch.py SwitchResult.reason)
    reason: Name
    message: Text = ""
    #: VFIOPrepareSucceeded | VFIOPrepareFailed | VFIOUnprepareFailed, or "" (refusals, no-ops)
    event: Name = ""
    #: the driver seen last ("" for none or not read)
    driver: Name = ""
    rolled_back: bool = False
    #: who holds the GPU, for reason Held
    holder: Name = ""
    #: the boot the switch ran in (a DisruptionRequired clears only after another one)
    boot_id: Name = ""
    why: Annotated[str, msgspec.Meta(max_length=256)] = ""
    at: datetime

    @property
    def ok(self) -> bool:
        return self.outcome in ("Succeeded", "Unchanged")


ClaimKind = Literal["allocation", "release", "instance", "domain", "claim"]


class GpuClaim(msgspec.Struct, frozen=True, kw_only=True):
    """One thing that claims a GPU: a hold, a pending Kubernetes release, an instance spec, a running domain."""

    pci_address: PciAddress
    kind: ClaimKind
    holder: Name


#: the MIG layout that turns MIG mode off on a card.
MIG_ALL_DISABLED = "all-disabled"


class MigLayoutState(msgspec.Struct, frozen=True, kw_only=True):
    """Where a card's desired MIG layout stands (the converger's; the inventory shows it as condition MigLayout)."""

    pci_address: PciAddress
    #: "all-disabled", or the GPU instance profiles, comma-separated ("1g.18gb,1g.18gb,3g.71gb")
    layout: Annotated[str, msgspec.Meta(max_length=1024)]
    #: Pending | Applying | Applied | Failed
    state: Name
    message: Text = ""
    since: datetime


class Claims(msgspec.Struct, frozen=True, kw_only=True):
    """The converger's claims on every GPU (endpoint `converger.claims`, notice `converger.claims_changed`).

    A GPU absent from `claims` is claimed by nothing the converger knows.
    `vfio` lists the GPUs the converger itself put on vfio-pci (and will
    return); a card on vfio-pci that is not listed was bound by someone else.
    """

    claims: list[GpuClaim] = []
    vfio: list[PciAddress] = []
    generation: Generation | None = None
    at: datetime
    #: the cards with a desired MIG layout, and where each stands.
    mig_layouts: Annotated[list[MigLayoutState], msgspec.Meta(max_length=1024)] = []


#: recheck: the operator reset the card (or thinks it well again): check it now, and let a clean
#: check clear its sticky health faults (a fatal XID, an uncorrectable ECC error, the card lost)
GpuAction = Literal["exclude", "include", "reclaim", "recheck"]


class GpuRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An operator's request on one card (`bcd gpu exclude|include|reclaim|recheck <pci>`), answered by the inventory."""

    action: GpuAction
    #: bounded plain string: a non-canonical address is refused with a reason.
    pci: Annotated[str, msgspec.Meta(max_length=64)]


class GpuReply(msgspec.Struct, frozen=True, kw_only=True):
    pci: Annotated[str, msgspec.Meta(max_length=128)]
    action: Name
    #: False: refused (the message says why; for reclaim, the Reclaim condition too)
    accepted: bool
    message: Text = ""
    #: the card after the request, with its PhysicalGPU status
    gpu: Gpu | None = None



GpuOpKind = Literal["reset", "diag", "mig-layout"]
#: DCGM's diagnostic levels (`dcgmi diag -r N`): 1 quick, 2 medium, 3 long, 4 extended.
DIAG_LEVEL_MAX = 4
#: how long one diagnostic may run, by level (DCGM's own run times with room); the
#: converger waits a minute longer for the answer.
DIAG_RUN_S: dict[int, float] = {1: 240.0, 2: 1140.0, 3: 3540.0, 4: 3 * 3600.0 - 60.0}


class GpuOpRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An operator's maintenance operation on one card (`bcd gpu reset|diag <pci>`), run by the converger."""

    #: "reset" or "diag" (a plain bounded string: anything else is refused with a reason)
    op: Annotated[str, msgspec.Meta(max_length=16)]
    pci: Annotated[str, msgspec.Meta(max_length=64)]
    #: the diagnostic level (1-4); 0 for a reset
    level: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    #: mig-layout: "all-disabled" or GPU instance profiles, comma-separated
    layout: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class GpuOp(msgspec.Struct, frozen=True, kw_only=True):
    """One maintenance operation: journaled (state "running") before it starts, "done" with one outcome."""

    id: Name
    op: Name
    pci: Annotated[str, msgspec.Meta(max_length=128)]
    level: NonNegInt = 0
    #: mig-layout: the layout being made
    layout: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    state: Literal["running", "done"] = "running"
    #: reset: Succeeded | Failed | Refused | Interrupted; diag: Passed | Failed | NotInstalled | Error | Interrupted
    outcome: Name = ""
    message: Text = ""
    #: the card is claimed while it runs (a reset, a diagnostic from level 2): no hold, switch or VM takes it
    claims_card: bool = True
    started_at: datetime
    finished_at: datetime | None = None
    boot_id: Name = ""


class GpuOpReply(msgspec.Struct, frozen=True, kw_only=True):
    #: False: refused (the message names the holder, or says what is wrong with the request)
    accepted: bool
    message: Text = ""
    op: GpuOp | None = None


class DiagRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The vendor's diagnostic on one card (inventory.diag; the converger asks, having claimed the card).

    The first request of an `op_id` starts the run and is answered at once
    (outcome Running); asking again (`poll`) answers Running or the result. An
    `op_id` the inventory does not know when polled (it restarted) is Error.
    """

    pci: PciAddress
    level: Annotated[int, msgspec.Meta(ge=1, le=DIAG_LEVEL_MAX)]
    op_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    poll: bool = False


class MigLayoutRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Make a card's MIG layout this (inventory.mig_layout; the converger asks, having claimed the card).

    A job like DiagRequest: the first request of an `op_id` starts it, a `poll` asks how it stands.
    """

    pci: PciAddress
    #: GPU instance profiles, one full compute instance in each; empty with `disable`
    profiles: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    #: MIG mode off (all-disabled)
    disable: bool = False
    op_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    poll: bool = False


class MigLayoutReply(msgspec.Struct, frozen=True, kw_only=True):
    pci: Annotated[str, msgspec.Meta(max_length=128)]
    #: Running | Applied | Failed | DisruptionRequired | NotSupported | Error
    outcome: Name
    message: Text = ""
    #: after a failure: "rolled back" (as before), "all-disabled", or "unknown"
    left: Name = ""


class DiagReply(msgspec.Struct, frozen=True, kw_only=True):
    pci: Annotated[str, msgspec.Meta(max_length=128)]
    level: NonNegInt
    #: Running | Passed | Failed | NotInstalled | Error
    outcome: Name
    message: Text = ""
    #: the tests that did not pass, as the tool names them (at most 64)
    failures: Annotated[list[Text], msgspec.Meta(max_length=64)] = []


# --------------------------------------------------------------------------- MIG instances on demand (DRA)

MigStep = Literal["create-gi", "create-ci", "destroy-ci", "destroy-gi"]


class MigInstanceRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One NVML step on a card's MIG instances (inventory.mig_instance; only the converger asks).

    The converger journals each step before it asks for it, so a crash between
    two steps leaves a record of what may exist: create-gi (profile at the
    placement `start`) answers the GPU instance's id, create-ci (one compute
    instance spanning GPU instance `gi`) answers the compute instance's id and
    the MIG device's uuid; destroy-ci and destroy-gi undo them.
    """

    step: MigStep
    pci: PciAddress
    profile: Name = ""
    start: Annotated[int, msgspec.Meta(ge=0, le=64)] | None = None
    gi: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    ci: Annotated[int, msgspec.Meta(ge=0, le=1024)] | None = None
    #: who the step is for (a claim uid), for the inventory's log
    owner: Annotated[str, msgspec.Meta(max_length=128)] = ""


class MigInstanceReply(msgspec.Struct, frozen=True, kw_only=True):
    pci: Annotated[str, msgspec.Meta(max_length=128)]
    step: Name
    #: done | failed | in-use (destroy: a process uses it) | not-found (destroy: already gone) |
    #: not-supported (the adapter cannot) | refused (the request is wrong for this card)
    outcome: Name
    message: Text = ""
    gi: NonNegInt | None = None
    ci: NonNegInt | None = None
    #: create-ci: the MIG device's uuid (MIG-...), what NVIDIA_VISIBLE_DEVICES takes
    uuid: Annotated[str, msgspec.Meta(max_length=160)] = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "done"


# --------------------------------------------------------------------------- DRA claims (dra_plugin -> converger)

#: a Kubernetes object uid (RFC 4122, as the API server writes it): it names the claim's hold file.
CLAIM_UID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}" + END
ClaimUid = Annotated[str, msgspec.Meta(pattern=CLAIM_UID_PATTERN, description="a Kubernetes uid (lowercase RFC 4122)")]
#: a DNS-1123 subdomain (namespace, claim, pool and device names are at most this long)
K8sName = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
CLAIM_DEVICES_MAX = 32


#: how a claim's device is shared (its opaque config, services/dra_plugin/configs.py): not at all,
#: time-sliced with the card's others, through an MPS control daemon of the claim's own, or passed
#: through to a VM (vfio-pci)
SharingStrategy = Literal["Exclusive", "TimeSlicing", "MPS", "Vfio"]
#: the time slice of a time-sliced card (nvidia-smi compute-policy --set-timeslice 0..3)
TimeSliceInterval = Literal["Default", "Short", "Medium", "Long"]
#: an MPS pinned device memory limit, in bytes (MPS takes whole MiB)
MPS_PINNED_MEMORY_MAX = 2**50
#: a consumed capacity of memory (bytes) a shared card's claim may carry
CLAIM_MEMORY_MAX = 2**50


#: a shared card's allocation (consumable capacity) is named by its shareID ("" for none)
OptionalShareId = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})?$",
        description="empty, or the share id of a shared card's allocation: a lowercase RFC 4122 uuid",
    ),
]


class ClaimSharing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a claim's opaque config asks of one device (decoded, defaulted and checked by the plugin).

    MPS: `active_thread_percentage` (set_default_active_thread_percentage), `pinned_memory_bytes`
    (every device's default pinned memory limit) and `pinned_memory` (per device: the key is a
    device uuid or an index into the devices of the claim that share this config, as NVIDIA's
    defaultPerDevicePinnedMemoryLimit; the converger resolves it once the uuids are known).
    """

    strategy: SharingStrategy = "Exclusive"
    interval: TimeSliceInterval = "Default"
    active_thread_percentage: Annotated[int, msgspec.Meta(ge=1, le=100)] | None = None
    pinned_memory_bytes: Annotated[int, msgspec.Meta(ge=1048576, le=MPS_PINNED_MEMORY_MAX)] | None = None
    pinned_memory: Annotated[
        dict[Annotated[str, msgspec.Meta(min_length=1, max_length=160)], Annotated[int, msgspec.Meta(ge=1048576, le=MPS_PINNED_MEMORY_MAX)]],
        msgspec.Meta(max_length=32),
    ] = {}


class ClaimDevice(msgspec.Struct, frozen=True, kw_only=True):
    """One device of a claim's allocation for this driver, resolved by the plugin to a card."""

    #: the claim's request names this result answers (DRA: request or request/subrequest)
    requests: Annotated[list[K8sName], msgspec.Meta(max_length=32)] = []
    pool: K8sName
    device: K8sName
    pci: PciAddress
    kind: Literal["gpu", "mig"]
    #: mig: the GPU instance profile and its placement start (memory slice)
    profile: Name = ""
    start: Annotated[int, msgspec.Meta(ge=0, le=64)] | None = None
    #: what the claim's opaque config asks of the device (Exclusive: no config)
    sharing: ClaimSharing = ClaimSharing()
    #: consumable capacity (a card published with allowMultipleAllocations): the allocation's
    #: shareID ("" for an exclusive allocation) and what it consumed of the card
    share_id: OptionalShareId = ""
    share_percent: Annotated[int, msgspec.Meta(ge=1, le=100)] | None = None
    memory_bytes: Annotated[int, msgspec.Meta(ge=0, le=CLAIM_MEMORY_MAX)] | None = None
    #: the allocation result's `adminAccess` (KEP-5018): a monitoring claim's look at a device
    #: others may hold; prepared read-only, holding nothing and changing nothing on the card
    admin_access: bool = False


class ClaimPrepareRequest(msgspec.Struct, frozen=True, kw_only=True):
    """converger.claim_prepare: make the claim's hold (idempotent: a prepared claim answers its devices again)."""

    uid: ClaimUid
    namespace: K8sName
    name: K8sName
    devices: Annotated[list[ClaimDevice], msgspec.Meta(min_length=1, max_length=CLAIM_DEVICES_MAX)]


class PreparedDevice(msgspec.Struct, frozen=True, kw_only=True):
    requests: list[Name] = []
    pool: Name
    device: Name
    #: the atom the claim holds (GPU-<uuid> or GPU-<uuid>/gi<N>/ci<M>)
    atom: Name = ""
    #: qualified CDI device names (bcd.dev/gpu=<name>)
    cdi_ids: list[Name] = []


class ClaimPrepareReply(msgspec.Struct, frozen=True, kw_only=True):
    uid: Name
    ok: bool
    #: refused: overlap | device-missing | device-unhealthy | unsupported-device | node-unprivileged | mig-failed | write-failed | busy
    reason: Name = ""
    message: Text = ""
    devices: list[PreparedDevice] = []


class ClaimUnprepareRequest(msgspec.Struct, frozen=True, kw_only=True):
    """converger.claim_unprepare: remove the claim's hold, destroy its MIG instances (idempotent)."""

    uid: ClaimUid


class ClaimUnprepareReply(msgspec.Struct, frozen=True, kw_only=True):
    uid: Name
    ok: bool
    message: Text = ""


class ClaimSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A DRA claim the converger holds (ConvergerStatus.claims)."""

    uid: Name
    namespace: Name
    name: Name
    #: preparing | prepared | unpreparing
    state: Name
    devices: list[PreparedDevice] = []
    message: Text = ""
    since: datetime
    boot_id: Name = ""
    #: how it shares or passes its cards, in words ("" for exclusive): "MPS daemon <control>
    #: (50% threads, 40 GiB pinned)", "time slice Long on <pci>", "passed through (vfio-pci,
    #: /dev/vfio/42)", "a 50% share of gpu-0"
    sharing: Text = ""
    #: the MPS daemon it runs ("" for none), its time-sliced cards, and its shares (pci -> percent)
    mps_control: Name = ""
    timeslices: Annotated[dict[PciAddress, Name], msgspec.Meta(max_length=64)] = {}
    shares: Annotated[dict[PciAddress, NonNegInt], msgspec.Meta(max_length=64)] = {}
    vfio: Annotated[list[PciAddress], msgspec.Meta(max_length=64)] = []


class DraClaimStatus(msgspec.Struct, frozen=True, kw_only=True):
    uid: Name
    namespace: Name
    name: Name
    #: PrepareStarted | PrepareCompleted (the plugin's checkpoint)
    state: Name
    devices: list[PreparedDevice] = []
    since: datetime


class DraPluginStatus(msgspec.Struct, frozen=True, kw_only=True):
    """What the DRA kubelet plugin publishes and has prepared (dra_plugin.status)."""

    driver: Name
    node_name: Name
    #: the kubelet's plugin watcher registered us (NotifyRegistrationStatus said so)
    registered: bool = False
    registration_error: Text = ""
    registration_socket: Text = ""
    plugin_socket: Text = ""
    #: "" while the API server answers, else why not
    api_error: Text = ""
    pool_generation: Generation = 0
    slices: NonNegInt = 0
    #: devices published in the pool (whole cards and MIG placements)
    devices: NonNegInt = 0
    #: the cards published, by PCI address
    cards: Annotated[list[PciAddress], msgspec.Meta(max_length=1024)] = []
    #: why cards are not published, one line per card
    left_out: Annotated[list[Text], msgspec.Meta(max_length=1024)] = []
    published_at: datetime | None = None
    claims: Annotated[list[DraClaimStatus], msgspec.Meta(max_length=4096)] = []
    #: whole cards are published as shareable (consumable capacity); False: exclusive only
    shared_cards: bool = False
    #: unhealthy cards (Healthy=False) are published with device taints (DRADeviceTaints); False:
    #: they are left out (the API server drops taints, --device-taints false, or an older plugin)
    device_taints: bool = False
    #: the unhealthy cards published tainted, one line per card ("<pci> gpu-<i>: published tainted <key>=<value>:<effect>, ... (Healthy=False ...)")
    tainted: Annotated[list[Text], msgspec.Meta(max_length=1024)] = []


# --------------------------------------------------------------------------- root helper
#
# Requests to the root helper (services/helper) forbid unknown fields: a field
# the helper does not know (a path, a hook, a device node, a mount) is refused
# at decode instead of being ignored. No field names a path: the helper builds
# every path from the allocation id and its own directories, and the CDI
# content from these typed fields plus the vendor spec on its disk. Ids are
# plain bounded strings, checked by the helper, so a malformed one is refused
# with a reason that names it.

#: the three files of a hold: its CDI spec, the spec's consumer copy (shared.holdfiles.consumer_spec), its env file.
HelperFileKind = Literal["cdi", "cdi-consumer", "allocation-env"]
HelperDeviceKind = Literal["gpu", "mig", "slot", "vfio"]

#: an MPS control daemon's id (shared with the sharing steps below): `<claim uid>-<6 hex>`
_MPS_CONTROL = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}-[0-9a-f]{6}"

#: NVML's GPU uuid, with or without its "GPU-" prefix.
GPU_UUID_PATTERN = r"^(GPU-)?[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}" + END
#: a MIG device uuid as NVML names it ("MIG-<uuid>", or the older "MIG-GPU-<uuid>/<gi>/<ci>").
MIG_UUID_PATTERN = r"^MIG-[A-Za-z0-9][A-Za-z0-9/-]{0,127}" + END
#: the largest CPU number (and NUMA node number) a helper request may name.
HELPER_MAX_CPU = LIMITS_MAX_CPU
HELPER_MAX_NUMA_NODE = LIMITS_MAX_NUMA_NODE

_HelperId = Annotated[str, msgspec.Meta(max_length=128)]
_AtomPart = Annotated[int, msgspec.Meta(ge=0, le=9999)]


class HelperStruct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the helper's requests: an unknown field is refused, never ignored."""


class HelperDevice(HelperStruct, frozen=True, kw_only=True):
    """One atom of a hold, as typed parts (the helper derives the atom id, the
    visible id and the vendor device names from them)."""

    kind: HelperDeviceKind
    gpu_uuid: Annotated[str, msgspec.Meta(pattern=GPU_UUID_PATTERN, description="an NVML GPU uuid, GPU-<8-4-4-4-12 hex digits> (the GPU- prefix optional)")]
    gpu_index: Annotated[int, msgspec.Meta(ge=0, le=1023)]
    #: MIG: GPU instance and compute instance ids; None otherwise.
    gi: _AtomPart | None = None
    ci: _AtomPart | None = None
    #: slot number of a slot; None otherwise.
    slot: _AtomPart | None = None
    #: MIG: the MIG device's uuid (what NVIDIA_VISIBLE_DEVICES takes); "" otherwise.
    mig_uuid: Annotated[str, msgspec.Meta(max_length=160)] = ""
    #: vfio (a card passed through, a DRA claim's): its IOMMU group, /dev/vfio/<group>; None otherwise.
    iommu_group: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    #: a DRA claim's share of a card (consumable capacity): its shareID names its CDI device; "" otherwise.
    share_id: OptionalShareId = ""


class HelperHugePages(HelperStruct, frozen=True, kw_only=True):
    page_size_kib: Annotated[int, msgspec.Meta(ge=HUGEPAGE_MIN_KIB, le=HUGEPAGE_MAX_KIB)]
    count: Annotated[int, msgspec.Meta(ge=0, le=HUGEPAGES_MAX_COUNT)]


class HelperLimits(HelperStruct, frozen=True, kw_only=True):
    """A slice's limits, bounded (the helper also checks the highest CPU and NUMA node)."""

    cpus: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    cpu_millis: Annotated[int, msgspec.Meta(ge=0, le=LIMITS_MAX_CPU_MILLIS)] | None = None
    memory_bytes: Annotated[int, msgspec.Meta(ge=0, le=LIMITS_MAX_MEMORY_BYTES)] | None = None
    hugepages: Annotated[list[HelperHugePages], msgspec.Meta(max_length=8)] = []
    mems: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class HelperHold(HelperStruct, frozen=True, kw_only=True):
    """What a hold's two files say, as typed fields (shared/holdfiles/wire.py maps it to HoldContent)."""

    allocation_id: _HelperId
    reservation_id: _HelperId
    generation: Generation
    binding: Literal["BINDING_HOLD", "BINDING_KUBERNETES", "BINDING_CLAIM"]
    devices: Annotated[list[HelperDevice], msgspec.Meta(min_length=1, max_length=64)]
    #: the hold runs in its slice (the helper names it bcd-alloc-<id>.slice itself).
    sliced: bool = False
    #: the assignment's KEY=VALUE lines (keys bcd sets itself are refused).
    env: Annotated[list[Annotated[str, msgspec.Meta(max_length=4300)]], msgspec.Meta(max_length=128)] = []
    #: slots with MPS running: the helper adds its own MPS pipe directory.
    mps: bool = False
    limits: HelperLimits | None = None
    #: a DRA claim's MPS daemon: the helper mounts `<its mps root>/<control>/pipe` (no path on the wire)
    mps_control: Annotated[
        str, msgspec.Meta(pattern="^(" + _MPS_CONTROL + ")?" + END, description="empty, or an MPS control id: <claim uid>-<6 hex digits>")
    ] = ""


class HelperFileWrite(HelperStruct, frozen=True, kw_only=True):
    """`helper.file.write`: write the CDI spec or the env file of one hold."""

    kind: HelperFileKind
    hold: HelperHold


class HelperFileCopy(HelperStruct, frozen=True, kw_only=True):
    """`helper.file.copy`: write the consumer copy of the hold spec `bcd-<allocation_id>.json`
    in the helper's own CDI dir (shared.holdfiles.consumer_file_bytes of its bytes), into the
    helper's consumer dir: no content crosses the wire, only the id."""

    allocation_id: _HelperId


class HelperFileRemove(HelperStruct, frozen=True, kw_only=True):
    """`helper.file.remove`: remove a hold's CDI spec, its consumer copy or its env file, or
    (temp_pid) the temp file a write by that process left behind."""

    kind: HelperFileKind
    allocation_id: _HelperId
    temp_pid: Annotated[int, msgspec.Meta(ge=1, le=2**22)] | None = None


class HelperSliceApply(HelperStruct, frozen=True, kw_only=True):
    """`helper.slice.apply`: create or update `bcd-alloc-<allocation_id>.slice`."""

    allocation_id: _HelperId
    limits: HelperLimits


class HelperSliceRemove(HelperStruct, frozen=True, kw_only=True):
    """`helper.slice.remove`: stop `bcd-alloc-<allocation_id>.slice` if no process is in it."""

    allocation_id: _HelperId


class HelperReply(msgspec.Struct, frozen=True, kw_only=True):
    """The helper's answer to every request, like vfio_switcher's: a refusal is a
    reply too, with its reason (a body that does not decode included)."""

    ok: bool
    #: "done", "refused" (the request is not acceptable; nothing was written) or
    #: "failed" (the host failed it: disk, permissions, systemd; worth a retry)
    outcome: Name
    reason: Text = ""
    #: a file or slice was written, changed or removed (False: it was already so).
    changed: bool = False
    #: slice.remove: the slice is gone (False: kept, a process runs in it).
    gone: bool = True
    #: the file written or removed.
    path: Text = ""


class HelperInfo(msgspec.Struct, frozen=True, kw_only=True):
    """`helper.info`: where the helper writes; the converger checks it reads the same places."""

    cdi_dir: Text
    run_dir: Text
    #: "fake" or "systemd"
    slices: Name
    mps_pipe_dir: Text
    euid: NonNegInt
    version: Name = ""
    #: where it writes the hold specs' consumer copies ("" from a helper older than them).
    cdi_consumer_dir: Text = ""
    #: the MPS root whose `<control>/pipe` a DRA claim's hold spec mounts ("" from an older helper).
    mps_root: Text = ""

__all__ = [
    "SharingStrategy",
    "TimeSliceInterval",
    "ClaimSharing",
    "MPS_PINNED_MEMORY_MAX",
    "CLAIM_MEMORY_MAX",
    "SharingStep",
    "MPS_CONTROL_PATTERN",
    "MpsControlId",
    "DeviceUuid",
    "MpsDaemonSpec",
    "SharingStepRequest",
    "SharingStepReply",
    "SwitchRequest",
    "SwitchReply",
    "ClaimKind",
    "GpuClaim",
    "Claims",
    "GpuAction",
    "GpuRequest",
    "GpuOpKind",
    "GpuOpRequest",
    "GpuOp",
    "GpuOpReply",
    "DiagRequest",
    "DiagReply",
    "MigLayoutRequest",
    "MigLayoutReply",
    "MigLayoutState",
    "MIG_ALL_DISABLED",
    "DIAG_LEVEL_MAX",
    "DIAG_RUN_S",
    "GpuReply",
    "SignRequest",
    "SIGN_BATCH_MAX",
    "SignItem",
    "SignBatchRequest",
    "SignBatchReply",
    "SignerKey",
    "Empty",
    "SpecAck",
    "HoldSummary",
    "PendingReleaseSummary",
    "ConvergerStatus",
    "PROBLEMS_MAX",
    "HolderQuery",
    "HolderReply",
    "DevicesQuery",
    "HeldReply",
    "PluginResource",
    "AdvertisedHold",
    "DevicePluginStatus",
    "WithdrawReply",
    "DEVICE_PLUGIN_LIST_MAX",
    "EvictReply",
    "Freed",
    "OrphanQuery",
    "OrphanReply",
    "HelperFileKind",
    "HelperFileCopy",
    "HelperDeviceKind",
    "GPU_UUID_PATTERN",
    "MIG_UUID_PATTERN",
    "HELPER_MAX_CPU",
    "HELPER_MAX_NUMA_NODE",
    "HelperStruct",
    "HelperDevice",
    "HelperHugePages",
    "HelperLimits",
    "HelperHold",
    "HelperFileWrite",
    "HelperFileRemove",
    "HelperSliceApply",
    "HelperSliceRemove",
    "HelperReply",
    "HelperInfo",
]


# --------------------------------------------------------------------------- GPU sharing (converger -> inventory, DRA)
#
# The converger journals each step before it asks (services/converger/claims.py), as for MIG
# instance steps; the inventory's vendor adapter takes it (nvidia: nvidia-cuda-mps-control and
# nvidia-smi; fakehw: recorded in the host file). An MPS daemon's directories are the inventory's
# `<mps root>/<control>/pipe` and `.../log`: no path crosses the bus, only the control id.

SharingStep = Literal["mps-start", "mps-stop", "mps-list", "timeslice-set"]
#: an MPS control daemon's id: the claim's uid and 6 hex digits of the devices and config it serves
MPS_CONTROL_PATTERN = "^" + _MPS_CONTROL + END
MpsControlId = Annotated[str, msgspec.Meta(pattern=MPS_CONTROL_PATTERN, description="<claim uid>-<6 hex digits>")]
#: a device an MPS daemon serves: a whole card's GPU uuid or a MIG device's uuid
DeviceUuid = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^(GPU-[0-9a-fA-F-]{36}|MIG-[A-Za-z0-9][A-Za-z0-9/-]{0,127})" + END,
        description="a whole card's GPU-<uuid> or a MIG device's MIG-<uuid>",
    ),
]
MPS_DEVICES_MAX = 32
MPS_LIST_MAX = 1024
#: what an MPS daemon serves and is held to (MpsDaemonSpec; the fake host keeps the same)
MpsDeviceUuids = Annotated[list[DeviceUuid], msgspec.Meta(min_length=1, max_length=MPS_DEVICES_MAX)]
ThreadPercentage = Annotated[int, msgspec.Meta(ge=1, le=100)]
MpsPinnedMemory = Annotated[
    dict[DeviceUuid, Annotated[int, msgspec.Meta(ge=1048576, le=MPS_PINNED_MEMORY_MAX)]], msgspec.Meta(max_length=MPS_DEVICES_MAX)
]


class MpsDaemonSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One MPS control daemon: the devices it serves (CUDA_VISIBLE_DEVICES) and its limits."""

    control: MpsControlId
    uuids: MpsDeviceUuids
    #: set_default_active_thread_percentage (None: MPS's own default, 100)
    active_thread_percentage: ThreadPercentage | None = None
    #: set_default_device_pinned_mem_limit <uuid> <MiB>M, per device uuid (each one of `uuids`)
    pinned_memory: MpsPinnedMemory = {}


class SharingStepRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One sharing step (inventory.sharing; only the converger asks).

    mps-start (`mps`): start the daemon, set its limits, answer once it answers its control pipe
    (a daemon already running for the control id with the same spec: done). mps-stop (`control`):
    quit the daemon and remove its directories (none running: not-found). mps-list: the control ids
    of the daemons running under the MPS root. timeslice-set (`pci`, `interval`): the card's
    compute policy (Default: as a card is without bcd).
    """

    step: SharingStep
    #: who the step is for (a claim uid), for the inventory's log
    owner: Annotated[str, msgspec.Meta(max_length=128)] = ""
    mps: MpsDaemonSpec | None = None
    control: Annotated[
        str, msgspec.Meta(pattern="^(" + _MPS_CONTROL + ")?" + END, description="empty, or an MPS control id: <claim uid>-<6 hex digits>")
    ] = ""
    pci: PciAddress | None = None
    interval: TimeSliceInterval = "Default"


class SharingStepReply(msgspec.Struct, frozen=True, kw_only=True):
    step: Name
    #: done | failed | not-found (mps-stop: no such daemon) | not-supported (the adapter cannot) |
    #: refused (the request is wrong for this host)
    outcome: Name
    message: Text = ""
    #: mps-list: the daemons running under the MPS root
    controls: Annotated[list[MpsControlId], msgspec.Meta(max_length=MPS_LIST_MAX)] = []

    @property
    def ok(self) -> bool:
        return self.outcome == "done"
