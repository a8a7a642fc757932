"""The fake host's file: the JSON that stands for a host's NVML and sysfs, decoded and checked.

One file describes a whole host (its cards, MIG instances and layouts, faults and health,
processes, VM domains, MPS daemons). It is decoded with msgspec Structs that refuse unknown
fields, so a typo names the field (`$.gpus[3].pci_address`), and checked as a whole
(`host_problem`: duplicate ids, overlapping GPU instances, daemons on unknown cards), so a file
that could not be a host is an error, not a silently missing GPU. The adapter (fakehw.py) and
its health watch (fakehw_health.py) both read it through `load_host_file`; neither imports the
other for it.
"""

from __future__ import annotations

import re
from datetime import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from shared.fsutil import read_regular
from shared.host import HOST_FILE_MAX_BYTES
from shared.schemas import MpsDaemonSpec
from shared.schemas.bus import MPS_LIST_MAX, MpsControlId, MpsDeviceUuids, MpsPinnedMemory, ThreadPercentage, TimeSliceInterval
from shared.schemas.codec import BoundedDecoder
from shared.schemas.common import END, CpuList, Name, NonNegInt, PciAddress, PositiveInt

from .base import AdapterError, GpuInstanceFacts, vendor_cdi_from_json

GpuUuid = Annotated[str, msgspec.Meta(pattern=r"^GPU-[0-9A-Za-z-]{1,80}" + END, description="GPU-<uuid>")]
MigUuid = Annotated[str, msgspec.Meta(pattern=r"^MIG-[0-9A-Za-z/-]{1,120}" + END, description="MIG-<uuid>")]
DriverName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{0,64}" + END, description="kernel driver, e.g. nvidia, vfio-pci")]
AbsPath = Annotated[str, msgspec.Meta(pattern=r"^/[^\n\r\x00]{0,1023}" + END, description="absolute path")]
#: a placement's start, in memory slices (NVML's cards have at most 8)
SliceIndex = Annotated[int, msgspec.Meta(ge=0, le=64)]
#: "2c.3g.71gb": a compute instance of 2 slices in a 3g.71gb GPU instance
_CI_PROFILE = re.compile(r"^(\d+)c\.(.+)$")


#: what a scan, a check and the watch answer on a host whose NVML does not answer (nvml_gone)
NVML_GONE = "NVML does not answer: Driver Not Loaded (fake host: nvml_gone)"


class HostFileError(AdapterError):
    """The host description file cannot be read or does not decode; the text names the field."""


class _HostStruct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the host file's types: a field the format does not know is an error."""


class HostMemory(_HostStruct, frozen=True, kw_only=True):
    #: null describes a host whose memory cannot be read (admission is skipped).
    total_bytes: NonNegInt | None = None
    available_bytes: NonNegInt | None = None


class HostHugePages(_HostStruct, frozen=True, kw_only=True):
    page_size_kib: PositiveInt
    total: NonNegInt
    free: NonNegInt


class HostNumaNode(_HostStruct, frozen=True, kw_only=True):
    node: NonNegInt
    cpus: CpuList | Literal[""] = ""
    memory_bytes: NonNegInt | None = None
    hugepages: list[HostHugePages] = []


class HostMigProfile(_HostStruct, frozen=True, kw_only=True):
    name: Name
    profile_id: NonNegInt
    slices: NonNegInt = 0
    memory_bytes: NonNegInt = 0
    instances_max: NonNegInt = 0
    #: the starts (memory slices) a GPU instance of this profile may take; none: it can be made
    #: by a layout only (NVML places it), never at a placement
    placements: Annotated[list[SliceIndex], msgspec.Meta(max_length=64)] = []
    #: memory slices one GPU instance of it spans (0: as many as its `slices`; 3g takes 4 on an H200)
    placement_size: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    #: the engines of one GPU instance of it (NVML's profile info): DRA's counters
    multiprocessors: NonNegInt = 0
    copy_engines: NonNegInt = 0
    decoders: NonNegInt = 0
    encoders: NonNegInt = 0
    jpeg_engines: NonNegInt = 0
    ofa_engines: NonNegInt = 0

    @property
    def size(self) -> int:
        return self.placement_size or self.slices


class HostMigInstance(_HostStruct, frozen=True, kw_only=True):
    gi: NonNegInt
    ci: NonNegInt
    profile: Name = ""
    uuid: MigUuid
    memory_bytes: NonNegInt = 0
    #: where its GPU instance sits (memory slices); null: the file does not say
    placement_start: SliceIndex | None = None


class HostGpuInstance(_HostStruct, frozen=True, kw_only=True):
    """A GPU instance named on its own: one with no compute instance lives only here (a MIG
    instance's GPU instance may be named here too, and then the two must agree)."""

    gi: NonNegInt
    #: the GPU instance profile ("3g.71gb")
    profile: Name
    placement_start: SliceIndex | None = None


class HostGpuFaults(_HostStruct, frozen=True, kw_only=True):
    """Kernel misbehaviour the fake vfio_switcher backend plays back (each is consumed when it fires).

    unbind: "fail" (the write errors, the driver stays), "hang" (never returns,
    the driver stays), "hang-unbound" (never returns, the driver already let go);
    fail_bind: drivers whose bind (probe) fails on this card;
    vanish_at: the write at which the card drops off the bus.
    """

    unbind: Literal["", "fail", "hang", "hang-unbound"] = ""
    fail_bind: list[DriverName] = []
    vanish_at: Literal["", "unbind", "set_driver_override", "bind", "drivers_probe", "reset"] = ""
    #: a function reset: "fail" (once), "hang" (once: never returns), "unsupported" (the kernel offers none; kept)
    reset: Literal["", "fail", "hang", "unsupported"] = ""
    #: a MIG layout change: "fail" (a compute instance fails; rolled back), "fail-rollback" (the rollback
    #: fails too: MIG off), "needs-reset" (the mode change waits for a GPU reset); each once
    mig: Literal["", "fail", "fail-rollback", "needs-reset"] = ""
    #: a MIG instance step (DRA): "gi-fail" (the next create-gi fails, nothing made), "ci-fail" (the next
    #: create-ci fails and its GPU instance is left behind), "destroy-in-use" (the next destroy answers in-use)
    mig_instance: Literal["", "ci-fail", "destroy-in-use", "gi-fail"] = ""
    #: a sharing step (DRA): "mps-start-fail" (the next MPS daemon serving this card first fails to
    #: start, nothing made), "mps-stop-fail" (the next stop of such a daemon fails, it keeps running),
    #: "timeslice-fail" (the next time slice change of this card fails, the slice stays)
    sharing: Literal["", "mps-start-fail", "mps-stop-fail", "timeslice-fail"] = ""


class HostXid(_HostStruct, frozen=True, kw_only=True):
    """An XID the fake driver reports (the health watch reports each one added while it runs)."""

    xid: Annotated[int, msgspec.Meta(ge=0, le=65535)]
    at: datetime
    #: the MIG GPU and compute instance it came from (null: the whole card)
    gi: NonNegInt | None = None
    ci: NonNegInt | None = None
    message: Annotated[str, msgspec.Meta(max_length=1024)] = ""


class HostGpuHealth(_HostStruct, frozen=True, kw_only=True):
    """What NVML would tell of a card's health (fakehw_health.py plays it back).

    xids: XIDs in the order they happened; the watch reports those added after it opened
    (as NVML reports only events after registration). ecc_*: the volatile counters (since
    the last reset); a rise of either is an ECC event too. gone: NVML answers GPU_IS_LOST
    for the card. unmonitored: events cannot be registered for it.
    """

    xids: Annotated[list[HostXid], msgspec.Meta(max_length=1024)] = []
    ecc_uncorrectable: NonNegInt = 0
    ecc_correctable: NonNegInt = 0
    gone: bool = False
    row_remap_pending: bool = False
    row_remap_failed: bool = False
    unmonitored: bool = False


class HostPciDevice(_HostStruct, frozen=True, kw_only=True):
    """A PCI device that is not a GPU (a NIC, an NVMe drive): the switcher must refuse it."""

    pci_address: PciAddress
    pci_class: Annotated[str, msgspec.Meta(pattern=r"^0x[0-9a-fA-F]{6}" + END)] = "0x020000"
    driver: DriverName = ""


class HostGpu(_HostStruct, frozen=True, kw_only=True):
    uuid: GpuUuid
    index: NonNegInt
    pci_address: PciAddress
    name: Name = ""
    memory_bytes: NonNegInt = 0
    numa_node: NonNegInt | None = None
    #: the kernel driver bound now; "" for none.
    driver: DriverName = "nvidia"
    #: the card's native driver, to switch back to after passthrough.
    base_driver: DriverName = "nvidia"
    #: the card is a real PCI device of this machine (the VM tests' emulated display, switched
    #: by the real sysfs vfio_switcher): the driver bound now is read from
    #: /sys/bus/pci/devices/<pci_address>/driver, and `driver` is ignored.
    real_sysfs: bool = False
    compute_capability: Name = ""
    mig_mode: bool = False
    mig_profiles: list[HostMigProfile] = []
    mig_instances: list[HostMigInstance] = []
    #: GPU instances named on their own (those with no compute instance; see HostGpuInstance)
    gpu_instances: Annotated[list[HostGpuInstance], msgspec.Meta(max_length=64)] = []
    #: configured sharing slots (MPS / time-slicing); none on a card in MIG mode.
    slots: NonNegInt = 0
    #: the card's time slice (nvidia-smi compute-policy --set-timeslice; Default: as without bcd)
    timeslice: TimeSliceInterval = "Default"
    #: what the fake kernel keeps in sysfs `driver_override` ("" for none); the
    #: vfio_switcher's fake backend writes it together with `driver`.
    driver_override: DriverName = ""
    #: False once the card has dropped off the PCI bus (an injected vanish):
    #: the inventory no longer lists it.
    present: bool = True
    #: failures the vfio_switcher's fake backend injects on this card.
    faults: HostGpuFaults = HostGpuFaults()
    #: the card's IOMMU group (null: no IOMMU; a DRA claim cannot pass the card through)
    iommu_group: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    #: function resets the vfio_switcher's fake backend did on this card.
    resets: NonNegInt = 0
    #: what DCGM's diagnostic says of this card (`bcd gpu diag`), and after how long.
    diag: Literal["pass", "fail"] = "pass"
    diag_message: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    diag_seconds: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.0
    #: what NVML's events and checks say of the card's health
    health: HostGpuHealth = HostGpuHealth()


class HostProcess(_HostStruct, frozen=True, kw_only=True):
    pid: NonNegInt
    gpu_uuid: GpuUuid
    cgroup: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    #: the MIG device it runs on (NVML's gpuInstanceId / computeInstanceId); null: the whole card
    gi: NonNegInt | None = None
    ci: NonNegInt | None = None


class HostDomain(_HostStruct, frozen=True, kw_only=True):
    name: Name
    gpus: list[PciAddress] = []


class HostMpsDaemon(_HostStruct, frozen=True, kw_only=True):
    """An MPS control daemon running on the host: its spec (MpsDaemonSpec) and its directories."""

    control: MpsControlId
    #: the devices it serves (CUDA_VISIBLE_DEVICES): GPU uuids or MIG device uuids of this file
    uuids: MpsDeviceUuids
    active_thread_percentage: ThreadPercentage | None = None
    pinned_memory: MpsPinnedMemory = {}
    pipe_dir: AbsPath
    log_dir: AbsPath

    def spec(self) -> MpsDaemonSpec:
        return MpsDaemonSpec(
            control=self.control, uuids=list(self.uuids), active_thread_percentage=self.active_thread_percentage, pinned_memory=dict(self.pinned_memory)
        )


class FakeHost(_HostStruct, frozen=True, kw_only=True):
    """A whole host description file (examples/hosts/README.md documents it)."""

    #: "" (or left out): the real host's own, read from /proc - GPUs described on a real host
    #: (the VM suites' guest) reboot with it
    boot_id: Annotated[str, msgspec.Meta(max_length=256)] = ""
    virtualized: bool = False
    vendor: Name = "nvidia"
    driver_version: Name = ""
    #: the CUDA version the driver supports ("12.4", NVML's nvmlSystemGetCudaDriverVersion); "" unknown
    cuda_version: Annotated[str, msgspec.Meta(pattern=r"^(\d{1,3}\.\d{1,3})?$")] = ""
    #: the vendor's CDI spec, written to <cdi_dir>/nvidia.json; null for none.
    vendor_cdi_spec: dict[str, Any] | None = None
    mps_pipe_dir: AbsPath = "/tmp/nvidia-mps"
    mps_running: bool = False
    memory: HostMemory = HostMemory()
    cpus: CpuList | Literal[""] = ""
    numa_nodes: list[HostNumaNode] = []
    gpus: list[HostGpu] = []
    processes: list[HostProcess] = []
    domains: list[HostDomain] = []
    #: other PCI devices (not GPUs), for the vfio_switcher's fake backend.
    pci_devices: list[HostPciDevice] = []
    #: the MPS control daemons running (GpuSharer's mps_start records one, mps_stop removes it)
    mps_daemons: Annotated[list[HostMpsDaemon], msgspec.Meta(max_length=MPS_LIST_MAX)] = []
    #: NVML does not answer at all (the driver unloaded or hung): scans, health checks and the
    #: health watch fail with NVML's "Driver Not Loaded"
    nvml_gone: bool = False


HOST_DECODER = BoundedDecoder(FakeHost, max_bytes=HOST_FILE_MAX_BYTES, what="host file")


def _dup(values: Sequence[object], at: str) -> str | None:
    """The first value seen twice, with its `$` path (`at` has an `{i}` for the index)."""
    seen: set[object] = set()
    for i, value in enumerate(values):
        if value in seen:
            return f"{value!r} appears twice - at `{at.format(i=i)}`"
        seen.add(value)
    return None


def _gi_profile_name(profile: str) -> str:
    """The GPU instance profile of a MIG device's profile ("2c.3g.71gb" -> "3g.71gb")."""
    m = _CI_PROFILE.match(profile)
    return m.group(2) if m else profile


def gpu_instances_of(card: HostGpu) -> dict[int, GpuInstanceFacts]:
    """Every GPU instance of a card, by id: those its MIG devices name and those named on their own."""
    profiles = {p.name: p for p in card.mig_profiles}
    named = {g.gi: g for g in card.gpu_instances}
    devices: dict[int, list[HostMigInstance]] = {}
    for m in card.mig_instances:
        devices.setdefault(m.gi, []).append(m)
    out: dict[int, GpuInstanceFacts] = {}
    for gi in sorted(set(named) | set(devices)):
        own, cis = named.get(gi), devices.get(gi, [])
        name = own.profile if own is not None else _gi_profile_name(cis[0].profile)
        starts = [own.placement_start] if own is not None else []
        start = next((s for s in starts + [m.placement_start for m in cis] if s is not None), None)
        profile = profiles.get(name)
        out[gi] = GpuInstanceFacts(
            gi=gi,
            profile=name,
            profile_id=profile.profile_id if profile is not None else None,
            start=start,
            size=profile.size if profile is not None and start is not None else None,
            compute_instances=len(cis),
        )
    return out


def overlaps(a: GpuInstanceFacts, start: int, size: int) -> bool:
    return a.start is not None and a.size is not None and a.start < start + size and start < a.start + a.size


def _check_gpu_instances(gpu: HostGpu, at: str) -> str | None:
    """The GPU instances a card's MIG devices and its `gpu_instances` describe agree, and fit."""
    if gpu.gpu_instances and not gpu.mig_mode:
        return f"the card is not in MIG mode (mig_mode is false) - at `{at}.gpu_instances`"
    problem = _dup([g.gi for g in gpu.gpu_instances], at + ".gpu_instances[{i}].gi")
    if problem:
        return problem
    named = {g.gi: g for g in gpu.gpu_instances}
    first: dict[int, HostMigInstance] = {}
    for i, m in enumerate(gpu.mig_instances):
        where = f"{at}.mig_instances[{i}]"
        one = first.setdefault(m.gi, m)
        own = named.get(m.gi)
        if _gi_profile_name(m.profile) != (own.profile if own is not None else _gi_profile_name(one.profile)):
            return f"GPU instance {m.gi} has another profile elsewhere in this card - at `{where}.profile`"
        starts = {s for s in (m.placement_start, one.placement_start, own.placement_start if own else None) if s is not None}
        if len(starts) > 1:
            return f"GPU instance {m.gi} has another placement_start elsewhere in this card - at `{where}.placement_start`"
    profiles = {p.name: p for p in gpu.mig_profiles}
    placed: list[GpuInstanceFacts] = []
    for gi, g in gpu_instances_of(gpu).items():
        profile = profiles.get(g.profile)
        if g.start is None or g.size is None or profile is None:
            continue
        if profile.placements and g.start not in profile.placements:
            return f"GPU instance {gi}: {g.profile} has no placement at {g.start} (it has {profile.placements}) - at `{at}`"
        other = next((p for p in placed if overlaps(p, g.start, g.size)), None)
        if other is not None:
            return f"GPU instance {gi} ({g.profile} at {g.start}, {g.size} slice(s)) overlaps GPU instance {other.gi} - at `{at}`"
        placed.append(g)
    return None


def host_problem(host: FakeHost) -> str | None:
    """Cross-field rules the types cannot say; returns the first violation."""
    for problem in (
        _dup([g.uuid for g in host.gpus], "$.gpus[{i}].uuid"),
        _dup([g.index for g in host.gpus], "$.gpus[{i}].index"),
        _dup([g.pci_address for g in host.gpus], "$.gpus[{i}].pci_address"),
        _dup([n.node for n in host.numa_nodes], "$.numa_nodes[{i}].node"),
        _dup([d.pci_address for d in host.pci_devices], "$.pci_devices[{i}].pci_address"),
    ):
        if problem:
            return problem
    nodes = {n.node for n in host.numa_nodes}
    for i, node in enumerate(host.numa_nodes):
        sizes = [p.page_size_kib for p in node.hugepages]
        problem = _dup(sizes, f"$.numa_nodes[{i}].hugepages[{{i}}].page_size_kib")
        if problem:
            return problem
        for j, pool in enumerate(node.hugepages):
            if pool.free > pool.total:
                return f"free ({pool.free}) exceeds total ({pool.total}) - at `$.numa_nodes[{i}].hugepages[{j}].free`"
    for i, gpu in enumerate(host.gpus):
        at = f"$.gpus[{i}]"
        if gpu.numa_node is not None and nodes and gpu.numa_node not in nodes:
            return f"NUMA node {gpu.numa_node} is not in numa_nodes - at `{at}.numa_node`"
        if gpu.mig_mode and gpu.slots:
            return f"a card in MIG mode has no slots - at `{at}.slots`"
        if gpu.mig_instances and not gpu.mig_mode:
            return f"the card is not in MIG mode (mig_mode is false) - at `{at}.mig_instances`"
        problem = _dup([f"gi{m.gi}/ci{m.ci}" for m in gpu.mig_instances], at + ".mig_instances[{i}]") or _dup(
            [m.uuid for m in gpu.mig_instances], at + ".mig_instances[{i}].uuid"
        )
        if problem:
            return problem
        problem = _check_gpu_instances(gpu, at)
        if problem:
            return problem
    gpu_pcis = {g.pci_address for g in host.gpus}
    for i, dev in enumerate(host.pci_devices):
        if dev.pci_address in gpu_pcis:
            return f"{dev.pci_address!r} is a GPU of this host (gpus[]) - at `$.pci_devices[{i}].pci_address`"
    gpu_uuids = {g.uuid for g in host.gpus}
    for i, proc in enumerate(host.processes):
        if proc.gpu_uuid not in gpu_uuids:
            return f"{proc.gpu_uuid!r} is not a GPU of this host - at `$.processes[{i}].gpu_uuid`"
    for i, domain in enumerate(host.domains):
        for j, pci in enumerate(domain.gpus):
            if pci not in gpu_pcis:
                return f"{pci!r} is not a GPU of this host - at `$.domains[{i}].gpus[{j}]`"
    problem = _check_mps_daemons(host)
    if problem:
        return problem
    if host.vendor_cdi_spec is not None:
        try:
            vendor_cdi_from_json(msgspec.json.encode(host.vendor_cdi_spec), "vendor_cdi_spec")
        except AdapterError as exc:
            # vendor_cdi_from_json's paths start at the spec; re-root them at the file.
            message = str(exc).removeprefix("vendor_cdi_spec: ")
            if " - at `$" in message:
                return message.replace(" - at `$", " - at `$.vendor_cdi_spec")
            return f"{message} - at `$.vendor_cdi_spec`"
    return None


def device_cards(host: FakeHost) -> dict[str, HostGpu]:
    """Every device uuid of the host (cards' and MIG devices'), with the card it is on."""
    out: dict[str, HostGpu] = {}
    for g in host.gpus:
        out[g.uuid] = g
        out.update({m.uuid: g for m in g.mig_instances})
    return out


def card_index_of(host: FakeHost, uuid: str) -> int | None:
    """The index (in gpus) of the card a device uuid is (or is on); None for none."""
    card = device_cards(host).get(uuid)
    return None if card is None else next(i for i, g in enumerate(host.gpus) if g.uuid == card.uuid)


def _check_mps_daemons(host: FakeHost) -> str | None:
    """Daemons' controls are unique, and each serves devices of this host (its limits too)."""
    problem = _dup([d.control for d in host.mps_daemons], "$.mps_daemons[{i}].control")
    if problem:
        return problem
    devices = device_cards(host)
    for i, daemon in enumerate(host.mps_daemons):
        at = f"$.mps_daemons[{i}]"
        problem = _dup(daemon.uuids, at + ".uuids[{i}]")
        if problem:
            return problem
        for j, uuid in enumerate(daemon.uuids):
            if uuid not in devices:
                return f"{uuid!r} is not a GPU or MIG device of this host - at `{at}.uuids[{j}]`"
        for uuid in daemon.pinned_memory:
            if uuid not in daemon.uuids:
                return f"{uuid!r} is not one of the daemon's uuids - at `{at}.pinned_memory`"
    return None
def load_host_file(path: Path | str) -> FakeHost:
    """Read and check a host description; HostFileError names the file and the field."""
    try:
        data = read_regular(path, max_bytes=HOST_FILE_MAX_BYTES)
    except OSError as exc:
        raise HostFileError(f"fake host file {path}: cannot read ({exc.strerror})") from None
    try:
        host = HOST_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise HostFileError(f"fake host file {path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise HostFileError(f"fake host file {path}: not valid JSON ({exc})") from None
    problem = host_problem(host)
    if problem:
        raise HostFileError(f"fake host file {path}: {problem}")
    return host


__all__ = [
    "NVML_GONE",
    "HOST_DECODER",
    "HostFileError",
    "FakeHost",
    "HostMemory",
    "HostHugePages",
    "HostNumaNode",
    "HostMigProfile",
    "HostMigInstance",
    "HostGpuInstance",
    "HostGpu",
    "HostGpuFaults",
    "HostGpuHealth",
    "HostXid",
    "HostPciDevice",
    "HostProcess",
    "HostDomain",
    "HostMpsDaemon",
    "load_host_file",
    "host_problem",
    "gpu_instances_of",
    "overlaps",
    "device_cards",
    "card_index_of",
]
