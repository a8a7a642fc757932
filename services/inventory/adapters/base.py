"""The vendor adapter contract: what the vendor-neutral inventory asks of a vendor.

Three required operations (DESIGN 6): the vendor's name, a read of the host's
capabilities, and the vendor's CDI edits (described from the vendor spec on
disk, and written where the adapter is the one that produces that spec).
Everything a vendor may or may not offer is an optional, runtime-checkable
capability interface (MIG partitioning, VFIO driver binding, MPS /
time-slicing), so `build_inventory` asks `isinstance(adapter, MigCapable)`
instead of knowing vendors. `MigInstancer` makes and destroys one MIG instance
at a time at a placement (DRA's prepare and unprepare), one NVML step per call,
so the converger can journal each step before it asks for the next.
`GpuSharer` does the same for sharing (DRA's MPS and time-slicing configs): one
MPS control daemon started, stopped or listed, or one card's time slice set, per
call. An MPS daemon's directories are `<mps root>/<control>/pipe`, `.../log` and
`.../shm` (made by root on a real host: services/inventory/mpsroot.py), their
paths built here (`mps_dirs`) only from a control id that matches
MPS_CONTROL_PATTERN.

The facts an adapter returns are frozen dataclasses with no atom ids in them:
naming atoms is the vendor-neutral core's job (build.py), so two adapters that
see the same hardware yield the same inventory.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from shared import vendorcdi as _vendorcdi
from shared.schemas import HostResources, MigProfile, MpsDaemonSpec, RunningProcess
from shared.schemas.bus import MPS_CONTROL_PATTERN

# The vendor-spec reader lives in shared (the converger reads the same file);
# its names stay importable from here.
from shared.vendorcdi import VENDOR_CDI_FILE, VendorCdi


class AdapterError(Exception):
    """An adapter could not do what it was asked; the text is for an operator."""


class AdapterUnavailable(AdapterError):
    """The vendor library (or host file) this adapter needs is not on this host.

    Raised at construction; the service prints the message and exits, with no
    traceback, so the text must say what to do instead.
    """


class VendorSpecError(AdapterError, _vendorcdi.VendorSpecError):
    """The vendor CDI spec exists but cannot be read or decoded; the text names file and field.

    Both an AdapterError (the inventory's catch sites) and shared's
    VendorSpecError (what a reader of shared.vendorcdi catches). shared cannot
    subclass an inventory class, so the readers below re-raise shared's error
    as this one.
    """


#: what a MIG step that did not succeed answers (MigInstanceReply.outcome without "done").
MigStepOutcome = Literal["failed", "refused", "not-supported", "in-use", "not-found"]


class MigStepError(AdapterError):
    """A MIG instance step did not happen (or not wholly); `outcome` says how, the text says why.

    refused: the request is wrong for this card (a placement the profile does
    not have, one that overlaps a GPU instance, a card not in MIG mode);
    in-use: a process or a compute instance still uses what is to be destroyed;
    not-found: what is to be destroyed is already gone; failed: the vendor
    library failed (what it left is read again by the next scan).
    """

    def __init__(self, outcome: MigStepOutcome, message: str) -> None:
        super().__init__(message)
        self.outcome: MigStepOutcome = outcome


#: what a sharing step that did not succeed answers (SharingStepReply.outcome without "done").
SharingStepOutcome = Literal["failed", "refused", "not-supported", "not-found"]


class SharingStepError(AdapterError):
    """A sharing step (an MPS daemon, a time slice) did not happen; `outcome` says how, the text says why.

    refused: the request is wrong for this host (a device it does not have, a daemon
    running for the control id with another spec); not-found: mps-stop found no daemon
    and nothing left of one; not-supported: the vendor's tool is not on this host;
    failed: the vendor's tool failed (its first line of error is in the text).
    """

    def __init__(self, outcome: SharingStepOutcome, message: str) -> None:
        super().__init__(message)
        self.outcome: SharingStepOutcome = outcome


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class MigInstanceFacts:
    """One MIG device (a compute instance inside a GPU instance) as the vendor reports it."""

    gi: int
    ci: int
    #: "3g.71gb", or "1c.3g.71gb" for a compute instance smaller than its GPU instance.
    profile: str = ""
    #: MIG-<uuid>, what NVIDIA_VISIBLE_DEVICES takes.
    uuid: str = ""
    memory_bytes: int = 0
    #: the placement of its GPU instance (memory slices), when the vendor says
    start: int | None = None
    size: int | None = None


@dataclass(frozen=True)
class GpuInstanceFacts:
    """One GPU instance, with or without compute instances (one without any holds its slices all the same)."""

    gi: int
    #: the GPU instance profile's name ("3g.71gb"); "" when the vendor would not say
    profile: str = ""
    profile_id: int | None = None
    #: its placement in memory slices; None when the vendor would not say
    start: int | None = None
    size: int | None = None
    compute_instances: int = 0


@dataclass(frozen=True)
class GpuFacts:
    """A physical card. `uuid` is the vendor's full id ("GPU-..."); it is the GPU's atom id.

    `uuid` is "" for a card the adapter sees only on the PCI bus (e.g. bound to
    vfio-pci, so NVML cannot see it) and whose id it never learned.
    """

    uuid: str
    index: int
    pci_address: str  # canonical, "0000:3b:00.0"
    name: str = ""
    memory_bytes: int = 0
    numa_node: int | None = None
    compute_capability: str = ""  # "9.0"
    mig_mode: bool = False
    #: the vendor library reads the card now. False for a card seen only on the
    #: PCI bus: on vfio-pci or no driver (expected), or on the native driver but
    #: lost to the library (e.g. NVML's GPU_IS_LOST), which must not look Ready.
    readable: bool = True
    #: the card's IOMMU group (/sys/bus/pci/devices/<pci>/iommu_group); None without an IOMMU
    iommu_group: int | None = None


@dataclass(frozen=True)
class HostScan:
    """One read of the host: what `read_capabilities` returns."""

    driver_version: str
    gpus: tuple[GpuFacts, ...]
    host: HostResources
    boot_id: str
    #: compute processes on the GPUs, with their cgroup (for the Kubernetes reaper).
    processes: tuple[RunningProcess, ...] = ()
    #: the CUDA version the driver supports ("12.4"), "" when not known (the feature labels' cuda.runtime.*)
    cuda_driver_version: str = ""


@dataclass(frozen=True)
class RunningDomain:
    """A running VM and the GPUs (canonical PCI addresses) passed through to it."""

    name: str
    gpus: tuple[str, ...] = ()


#: what a health event says of a card (HealthEvent.kind): an XID (its number in `xid`), a
#: single- or double-bit ECC error, the card lost to the vendor library ("gone"), or the
#: card no longer watched ("unmonitored": events cannot be registered or the wait failed)
HealthEventKind = Literal["xid", "ecc-correctable", "ecc-uncorrectable", "gone", "unmonitored"]


@dataclass(frozen=True)
class HealthEvent:
    """One thing the vendor library told of a card between scans (NVML's event set)."""

    pci_address: str
    kind: HealthEventKind
    #: when it happened (the adapter's clock when the library gives no time)
    at: datetime
    #: the XID's number (kind "xid")
    xid: int | None = None
    #: the MIG GPU and compute instance it came from (None: the whole card)
    gi: int | None = None
    ci: int | None = None
    message: str = ""


@dataclass(frozen=True)
class HealthCheck:
    """One periodic check of one card: what events cannot say."""

    pci_address: str
    #: the vendor library still answers the card (False: lost, e.g. NVML's GPU_IS_LOST)
    answers: bool = True
    #: remapped rows wait for a reset (NVML's nvmlDeviceGetRemappedRows isPending)
    row_remap_pending: bool = False
    #: a row could not be remapped (failureOccurred): the card needs service
    row_remap_failed: bool = False
    #: volatile (since the last reset) ECC error counts; None: not supported or ECC off
    ecc_uncorrectable: int | None = None
    ecc_correctable: int | None = None
    #: why the card cannot be watched ("" when it is): a check that works but events that do not
    unmonitored: str = ""
    message: str = ""


@dataclass(frozen=True)
class DiagResult:
    """One run of the vendor's diagnostic on one card."""

    #: Passed | Failed | NotInstalled | Error
    outcome: str
    message: str
    #: the tests that failed, as the tool names them
    failures: tuple[str, ...] = ()


# --------------------------------------------------------------------------- reading the vendor spec


def vendor_cdi_from_json(data: bytes, path: str) -> VendorCdi:
    """Decode a vendor CDI spec (shared.vendorcdi); VendorSpecError names the file and the field."""
    try:
        return _vendorcdi.vendor_cdi_from_json(data, path)
    except _vendorcdi.VendorSpecError as exc:
        raise VendorSpecError(str(exc)) from None


def read_vendor_cdi(cdi_dir: Path | str, filename: str = VENDOR_CDI_FILE) -> VendorCdi | None:
    """The vendor spec `<cdi_dir>/<filename>` (shared.vendorcdi); None when there is none."""
    try:
        return _vendorcdi.read_vendor_cdi(cdi_dir, filename)
    except _vendorcdi.VendorSpecError as exc:
        raise VendorSpecError(str(exc)) from None


# --------------------------------------------------------------------------- the contract


class VendorAdapter(Protocol):
    """The three required operations, plus writing the vendor spec and closing."""

    def vendor(self) -> str:
        """The vendor's name as the inventory reports it ("nvidia")."""
        ...

    def read_capabilities(self) -> HostScan:
        """Driver version, GPUs, host resources, boot id, compute processes: one read."""
        ...

    def cdi_edits(self) -> VendorCdi | None:
        """The vendor's CDI edits from `<cdi_dir>/nvidia.json`; None when that file does not exist.

        Raises VendorSpecError when it exists but is unreadable or malformed.
        """
        ...

    def write_cdi_spec(self) -> bool:
        """Write the vendor spec into cdi_dir where this adapter produces it.

        Returns True when the adapter's spec is on disk afterwards, False when
        this adapter does not produce one (the NVIDIA toolkit writes it on a
        real host) or has none to write.
        """
        ...

    def close(self) -> None:
        """Release the vendor library (NVML shutdown); idempotent."""
        ...


@runtime_checkable
class MigCapable(Protocol):
    def mig_profiles(self, gpu_uuid: str) -> Sequence[MigProfile]:
        """GPU instance profiles the card supports (empty when it supports none)."""
        ...

    def mig_instances(self, gpu_uuid: str) -> Sequence[MigInstanceFacts]:
        """The MIG devices that exist on the card now."""
        ...


@runtime_checkable
class MigInstancer(Protocol):
    """MIG instances made one NVML step at a time, at a placement (Kubernetes DRA).

    Every step is blocking and raises MigStepError when it did not happen; an
    adapter that has this interface is also MigCapable, and its `mig_profiles`
    fill placements and engine counts (DRA publishes them as counters).
    """

    def gpu_instances(self, gpu_uuid: str) -> Sequence[GpuInstanceFacts]:
        """Every GPU instance on the card now, those with no compute instance too."""
        ...

    def create_gpu_instance(self, pci_address: str, profile: str, start: int) -> int:
        """A GPU instance of `profile` at placement `start`; its id. A start that is not one of the
        profile's placements, one that overlaps a GPU instance, or a card not in MIG mode: refused."""
        ...

    def create_compute_instance(self, pci_address: str, gi: int) -> MigInstanceFacts:
        """One compute instance spanning the whole GPU instance `gi`; the MIG device, uuid filled."""
        ...

    def destroy_compute_instance(self, pci_address: str, gi: int, ci: int) -> None:
        """in-use while a process runs on it; not-found when it is already gone."""
        ...

    def destroy_gpu_instance(self, pci_address: str, gi: int) -> None:
        """in-use while a compute instance (or a process) is in it; not-found when it is already gone."""
        ...


@runtime_checkable
class VfioCapable(Protocol):
    def driver_binding(self, pci_address: str) -> tuple[str, str]:
        """(driver bound now or "", the card's native driver to switch back to)."""
        ...


@runtime_checkable
class SharingCapable(Protocol):
    def slots_per_gpu(self, gpu_uuid: str) -> int:
        """Configured slots (MPS / time-slicing bookkeeping units) of a card."""
        ...

    def mps_running(self) -> bool:
        """The MPS control daemon's pipe is present in the pipe directory."""
        ...

    def mps_pipe_dir(self) -> str: ...


@runtime_checkable
class GpuSharer(Protocol):
    """MPS control daemons and time slices, one step per call (Kubernetes DRA's sharing configs).

    Every step is blocking and raises SharingStepError when it did not happen. The paths come
    from the inventory (`mps_dirs`), never from the bus.
    """

    def mps_start(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        """Start the control daemon serving spec.uuids with its pipe, log and shm directories
        (`<mps root>/<control>/`, made for it), set its limits, return once it answers. A daemon
        already running for spec.control with the same spec: done (the converger retries after
        a crash); with another spec: refused."""
        ...

    def mps_stop(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        """Quit the daemon and remove `<mps root>/<control>` (the parent of both directories).
        not-found when none runs and nothing is left; what a dead daemon left is removed: done."""
        ...

    def mps_list(self, root: Path) -> list[str]:
        """The control ids of the daemons running (or directories left) under `root`; only names
        that match MPS_CONTROL_PATTERN count, nothing else there is touched or followed."""
        ...

    def set_timeslice(self, pci_address: str, gpu_uuid: str, interval: str) -> None:
        """The card's compute policy: its time slice (Default, Short, Medium, Long)."""
        ...


@dataclass(frozen=True)
class MigLayoutResult:
    """What making a card's MIG layout did."""

    #: Applied | Failed | DisruptionRequired | NotSupported
    outcome: str
    message: str
    #: after a failure: "as before" (nothing changed), "rolled back", "all-disabled" or "unknown"
    left: str = ""


@runtime_checkable
class MigPartitioner(Protocol):
    def apply_mig_layout(self, pci_address: str, profiles: Sequence[str], *, disable: bool) -> MigLayoutResult:
        """Make the card's MIG layout exactly `profiles` (GPU instances, one full compute instance each),
        or MIG mode off with `disable`: every instance there now is destroyed first. A failure is rolled
        back to what was there, or, where that fails too, to MIG off; the result says which. A mode
        change the card takes only after a GPU reset is DisruptionRequired. Blocking; never raises."""
        ...


@runtime_checkable
class Diagnosable(Protocol):
    def run_diag(self, pci_address: str, level: int, timeout: float) -> DiagResult:
        """Run the vendor's diagnostic at `level` on one card (blocking; bounded by `timeout`); never raises."""
        ...


class HealthNotRead(Exception):
    """A health check or wait could not be made this time for a reason that says nothing of the
    cards (the fake host file is being fixed): nothing is concluded, the next one tries again.
    Not an AdapterError, which means the vendor library does not answer (every card lost)."""


@runtime_checkable
class HealthWatcher(Protocol):
    """A card's health between scans (issue 30): events the vendor library pushes, and a periodic
    check of what it cannot push. The inventory calls these from one thread of its own, never
    from its event loop: `wait_health_events` blocks."""

    def open_health_watch(self) -> list[HealthEvent]:
        """Register for events on every card the library sees (the same set the next waits use);
        returns an `unmonitored` event for each card that cannot be registered. Raises AdapterError
        when the library does not answer at all."""
        ...

    def wait_health_events(self, timeout: float) -> list[HealthEvent]:
        """Events since the last call, waiting at most `timeout` seconds for the first; [] when none.
        Raises AdapterError when the library stops answering (the caller re-opens the watch)."""
        ...

    def check_health(self) -> list[HealthCheck]:
        """One check of every card the library sees; AdapterError when the library does not answer."""
        ...

    def close_health_watch(self) -> None:
        """Free the event set (idempotent)."""
        ...


@runtime_checkable
class DomainLister(Protocol):
    """Running VMs and their GPUs, read-only (the converger's Domains port builds on it)."""

    def domains(self) -> Sequence[RunningDomain]: ...


# --------------------------------------------------------------------------- MPS directories

_MPS_CONTROL_RE = re.compile(MPS_CONTROL_PATTERN)
#: the mode of the directories made for a daemon (a container bind-mounts them)
MPS_DIR_MODE = 0o755


def is_mps_control(name: str) -> bool:
    """`name` is an MPS control id (`<claim uid>-<6 hex digits>`): safe as one path component."""
    return _MPS_CONTROL_RE.match(name) is not None


def mps_dirs(root: Path, control: str) -> tuple[Path, Path]:
    """(pipe, log) directories of the daemon `control` under the MPS root; ValueError for a name
    that is not a control id (checked again here: no other name becomes a path)."""
    if not is_mps_control(control):
        raise ValueError(f"{control!r} is not an MPS control id (<claim uid>-<6 hex digits>)")
    return root / control / "pipe", root / control / "log"


def mps_spec_dir(root: Path) -> Path:
    """`<root>-specs`: the inventory's own directory beside root's MPS root, where it hands root
    each daemon's spec (tmpfiles.d makes /run/bcd/mps-specs the inventory's)."""
    return root.parent / f"{root.name}-specs"


def mps_spec_file(root: Path, control: str) -> Path:
    """`<root>-specs/<control>.json`, the spec of the daemon `control` (services/inventory/mpsroot.py
    reads it as root, without following); ValueError for a name that is not a control id."""
    if not is_mps_control(control):
        raise ValueError(f"{control!r} is not an MPS control id (<claim uid>-<6 hex digits>)")
    return mps_spec_dir(root) / f"{control}.json"


def mps_control_dir(control: str, pipe_dir: Path, log_dir: Path) -> Path:
    """`<mps root>/<control>`, the parent of a daemon's pipe and log directories; refused when
    the two do not sit side by side under a directory named for the control id."""
    parent = pipe_dir.parent
    if not is_mps_control(control) or parent.name != control or log_dir.parent != parent:
        raise SharingStepError("refused", f"{pipe_dir} and {log_dir} are not the directories of MPS daemon {control!r}")
    return parent


def make_mps_dirs(*dirs: Path) -> None:
    """Each directory, and every missing one above it, made 0755 (umask does not apply)."""
    for directory in dirs:
        missing = [d for d in (directory, *directory.parents) if not os.path.lexists(d)]
        for d in reversed(missing):
            try:
                d.mkdir(mode=MPS_DIR_MODE)
            except FileExistsError:
                pass  # made meanwhile
            else:
                os.chmod(d, MPS_DIR_MODE)
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            raise SharingStepError("failed", f"{directory} is in the way (not a directory)")


def mps_dirs_under(root: Path) -> list[str]:
    """The control ids that name a directory under `root` (lstat: a symlink is not one); every
    other name there is ignored. None at all when `root` does not exist."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SharingStepError("failed", f"the MPS root {root} cannot be listed: {exc.strerror or exc}") from None
    found = []
    for name in names:
        if not is_mps_control(name):
            continue
        try:
            if stat.S_ISDIR(os.lstat(root / name).st_mode):
                found.append(name)
        except OSError:
            continue  # gone meanwhile
    return sorted(found)


def remove_mps_dir(control_dir: Path) -> bool:
    """Remove a daemon's `<mps root>/<control>` and all in it (never following a symlink);
    False when there was none."""
    try:
        mode = os.lstat(control_dir).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(mode):
        raise SharingStepError("failed", f"{control_dir} is not a directory; it is left as it is")
    try:
        shutil.rmtree(control_dir)
    except OSError as exc:
        raise SharingStepError("failed", f"{control_dir} could not be removed: {exc.strerror or exc}") from None
    return True


__all__ = [
    "VENDOR_CDI_FILE",
    "AdapterError",
    "AdapterUnavailable",
    "VendorSpecError",
    "MigStepOutcome",
    "MigStepError",
    "SharingStepOutcome",
    "SharingStepError",
    "GpuSharer",
    "MPS_DIR_MODE",
    "is_mps_control",
    "mps_dirs",
    "mps_control_dir",
    "mps_spec_dir",
    "mps_spec_file",
    "make_mps_dirs",
    "mps_dirs_under",
    "remove_mps_dir",
    "MigInstanceFacts",
    "GpuInstanceFacts",
    "GpuFacts",
    "HostScan",
    "RunningDomain",
    "DiagResult",
    "Diagnosable",
    "HealthEventKind",
    "HealthEvent",
    "HealthCheck",
    "HealthWatcher",
    "HealthNotRead",
    "MigLayoutResult",
    "MigPartitioner",
    "VendorCdi",
    "vendor_cdi_from_json",
    "read_vendor_cdi",
    "VendorAdapter",
    "MigCapable",
    "MigInstancer",
    "VfioCapable",
    "SharingCapable",
    "DomainLister",
]
