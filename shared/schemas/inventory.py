"""What a node has: GPUs, their MIG instances and slots (atoms), host resources,
and each card's PhysicalGPU status.

The inventory service is the only writer; the converger resolves atoms against
it, the bridge forwards it upstream (KV `bcd_inventory/<node_id>`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from .common import Condition, CpuListOrEmpty, Id, Int64, Name, NonNegInt, PciAddress, Struct

#: a Kubernetes label's name ([prefix/]name) and value; services/inventory/features.py checks the syntax
LabelName = Annotated[str, msgspec.Meta(min_length=1, max_length=317)]
LabelValue = Annotated[str, msgspec.Meta(max_length=63)]

AtomKind = Literal["gpu", "mig", "slot"]

#: derived from conditions, never set directly (seed 003).
Phase = Literal["Initializing", "Ready", "Passthrough", "Reconfiguring", "Failed"]
DriverMode = Literal["Compute", "Passthrough", "None"]
ManagementState = Literal["Managed", "Excluded", "Unclaimed", "Orphaned", "Unknown"]

#: Reconfiguring reasons of the disruption flow (seed 003), in order: a driver
#: switch that could not be rolled back, until the card is back after a reboot.
DISRUPTION_REASONS: tuple[str, ...] = ("DisruptionRequired", "DisruptionPending", "RebootRequested", "Completing")
#: the disruption stages that wait for a node reboot (an operator's to-do).
REBOOT_WAIT_REASONS: tuple[str, ...] = DISRUPTION_REASONS[:3]
#: every Reconfiguring reason: the reconfiguration flow (Requested -> Draining ->
#: InProgress -> Completing) and the disruption flow.
RECONFIGURING_REASONS = frozenset({"Requested", "Draining", "InProgress", *DISRUPTION_REASONS})


class DriverBinding(Struct, kw_only=True):
    """What the kernel really has bound to the card, and who manages it."""

    driver: Name = ""
    mode: DriverMode = "None"
    management_state: ManagementState = "Unknown"


#: the condition of a card's health (issue 30; services/inventory/health.py makes it): False
#: (GpuLost, XidCritical, EccUncorrectable, RowRemapFailed, RowRemapPending, EccCorrectable) means
#: the card is given to nobody new; Unknown/Unmonitored that it cannot be watched.
HEALTHY_CONDITION = "Healthy"


class PhysicalGPUStatus(Struct, kw_only=True):
    phase: Phase = "Initializing"
    driver_binding: DriverBinding = DriverBinding()
    conditions: list[Condition] = []

    def health(self) -> Condition | None:
        """The Healthy condition (None from an inventory that does not watch health)."""
        return next((c for c in self.conditions if c.type == HEALTHY_CONDITION), None)

    def unhealthy(self) -> Condition | None:
        """The Healthy condition when it is False: nothing new may be given this card."""
        c = self.health()
        return c if c is not None and c.status == "False" else None


def health_text(c: Condition) -> str:
    """How a consumer names a card's health in a refusal: `Healthy=False XidCritical: <message>`."""
    return f"{c.type}={c.status} {c.reason}" + (f": {c.message}" if c.message else "")


class MigPlacement(Struct, kw_only=True):
    """Where a GPU instance sits on its card, in memory slices (NVML's nvmlGpuInstancePlacement_t)."""

    start: NonNegInt
    size: NonNegInt


class MigProfile(Struct, kw_only=True):
    """A GPU instance profile the card supports (e.g. 1g.18gb)."""

    name: Name
    profile_id: NonNegInt
    slices: NonNegInt = 0
    memory_bytes: NonNegInt = 0
    instances_max: NonNegInt = 0
    #: every placement a GPU instance of this profile may take on the card (DRA publishes each one)
    placements: Annotated[list[MigPlacement], msgspec.Meta(max_length=64)] = []
    #: the engines one GPU instance of this profile has (NVML's GpuInstanceProfileInfo counts):
    #: DRA's shared counters, so the scheduler keeps placements exclusive by itself.
    multiprocessors: NonNegInt = 0
    copy_engines: NonNegInt = 0
    decoders: NonNegInt = 0
    encoders: NonNegInt = 0
    jpeg_engines: NonNegInt = 0
    ofa_engines: NonNegInt = 0


class MigInstance(Struct, kw_only=True):
    atom_id: Name  # GPU-<uuid>/gi<N>/ci<M>
    uuid: Name = ""  # MIG-<uuid>, what NVIDIA_VISIBLE_DEVICES takes
    gi: NonNegInt
    ci: NonNegInt
    profile: Name = ""
    memory_bytes: NonNegInt = 0
    #: the placement of its GPU instance, when the vendor says
    placement: MigPlacement | None = None


class GpuInstance(Struct, kw_only=True):
    """A GPU instance on a MIG card, with or without compute instances: one without any is
    no atom, but it holds its slices (a crash between creating it and its compute instance
    leaves one; the converger finds it here)."""

    gi: NonNegInt
    profile: Name = ""
    profile_id: NonNegInt | None = None
    placement: MigPlacement | None = None
    compute_instances: NonNegInt = 0


class Slot(Struct, kw_only=True):
    atom_id: Name  # GPU-<uuid>/slot<K>
    index: NonNegInt


class Gpu(Struct, kw_only=True):
    atom_id: Name  # GPU-<uuid>
    uuid: Name
    index: NonNegInt
    pci_address: PciAddress
    name: Name = ""
    vendor: Name = ""
    memory_bytes: NonNegInt = 0
    numa_node: Int64 | None = None
    #: kernel driver bound now ("" when none).
    driver: Name = ""
    #: the card's native driver, to switch back to after passthrough.
    base_driver: Name = ""
    compute_capability: Name = ""
    mig_mode: bool = False
    mig_profiles: list[MigProfile] = []
    mig_instances: list[MigInstance] = []
    #: every GPU instance on the card (those with no compute instance too)
    gpu_instances: Annotated[list[GpuInstance], msgspec.Meta(max_length=64)] = []
    slots: list[Slot] = []
    #: the MPS control daemon's pipe was found (slots only).
    mps_running: bool = False
    #: the card's IOMMU group (/sys/bus/pci/devices/<pci>/iommu_group), None when not known: a card
    #: passed through to a DRA claim is /dev/vfio/<group> in its CDI spec
    iommu_group: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    status: PhysicalGPUStatus = PhysicalGPUStatus()
    #: the PhysicalGPU's labels (seed 003): gpu.deckhouse.io/vendor, device, node, and the sharing
    #: strategies the card supports (sharing.mps, sharing.ts: "true" | "false"); Kubernetes label syntax
    labels: Annotated[dict[LabelName, LabelValue], msgspec.Meta(max_length=32)] = {}


class Atom(Struct, kw_only=True):
    """Flat index of every atom, for resolving a spec's device ids."""

    id: Name
    kind: AtomKind
    gpu_uuid: Name
    pci_address: PciAddress


class HugePagePool(Struct, kw_only=True):
    page_size_kib: NonNegInt
    total: NonNegInt
    free: NonNegInt


class NumaNode(Struct, kw_only=True):
    node: NonNegInt
    cpus: CpuListOrEmpty = ""
    memory_bytes: NonNegInt | None = None
    hugepages: list[HugePagePool] = []


class HostResources(Struct, kw_only=True):
    #: None when the host's memory could not be read (admission is skipped).
    memory_bytes: NonNegInt | None = None
    memory_available_bytes: NonNegInt | None = None
    cpus: CpuListOrEmpty = ""
    numa_nodes: list[NumaNode] = []
    #: host-wide huge page pools (sum over nodes, or /proc/meminfo's default size).
    hugepages: list[HugePagePool] = []
    virtualized: bool = False


class RunningProcess(Struct, kw_only=True):
    """A compute process on a GPU (for the Kubernetes reaper)."""

    pid: NonNegInt
    gpu_uuid: Name
    cgroup: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class Inventory(Struct, kw_only=True):
    node_id: Id
    #: increases whenever the content (not only observed_at) changes.
    revision: NonNegInt = 0
    observed_at: datetime
    vendor: Name = ""
    #: the adapter that read the host ("nvidia": NVML answered; "fakehw").
    adapter: Name = ""
    driver_version: Name = ""
    #: the CUDA version the driver supports ("12.4"; NVML's nvmlSystemGetCudaDriverVersion), "" when not known
    cuda_driver_version: Name = ""
    boot_id: Name = ""
    gpus: list[Gpu] = []
    atoms: list[Atom] = []
    host: HostResources = HostResources()
    mps_pipe_dir: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    processes: list[RunningProcess] = []
    #: where the inventory keeps DRA claims' MPS daemons (`<root>/<control>/pipe`); "" when it keeps none
    mps_root: Annotated[str, msgspec.Meta(max_length=1024)] = ""


__all__ = [
    "AtomKind",
    "Phase",
    "DriverMode",
    "ManagementState",
    "DISRUPTION_REASONS",
    "REBOOT_WAIT_REASONS",
    "RECONFIGURING_REASONS",
    "DriverBinding",
    "HEALTHY_CONDITION",
    "health_text",
    "PhysicalGPUStatus",
    "MigPlacement",
    "MigProfile",
    "MigInstance",
    "GpuInstance",
    "Slot",
    "Gpu",
    "Atom",
    "HugePagePool",
    "NumaNode",
    "HostResources",
    "RunningProcess",
    "Inventory",
]
