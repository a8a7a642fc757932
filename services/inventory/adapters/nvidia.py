"""The `nvidia` adapter: NVML (through nvidia-ml-py) for the cards, sysfs/procfs for the rest.

NVML sits behind a small port, `NvmlPort`, so the adapter's logic (PCI
normalisation, cards NVML cannot see, MIG profile naming, processes and their
cgroups) runs in tests against `FakeNvml` and a fake sysfs/proc tree, and only
`PynvmlNvml` touches the library. Every file read takes a root (sysfs_root,
proc_root, cdi_dir).

Two NVML facts shape the code:
- a card bound to vfio-pci (or to no driver) is invisible to NVML, and NVML's
  indices of the remaining cards shift. The adapter therefore also lists
  NVIDIA display devices from sysfs, and numbers every card by its position in
  PCI order among all of them: NVML's own order when every card is on the
  nvidia driver, and stable across a passthrough switch. A card seen only in
  sysfs keeps the facts of its last NVML sighting (or the uuid from
  `known_uuids`, which the service may persist).
- listing GPU instances may need privileges an unprivileged inventory lacks,
  while MIG device handles do not; MIG devices are therefore read from their
  handles, and GPU instance profiles only name them (with a fallback by slice
  count and memory when the GPU instance list is refused).

MIG instances for DRA are made one step at a time (`MigInstancer`): a GPU
instance at a placement NVML lists for its profile
(nvmlDeviceGetGpuInstancePossiblePlacements, then
nvmlDeviceCreateGpuInstanceWithPlacement), then one compute instance spanning
it; destroyed in the reverse order. NVML's IN_USE and NOT_FOUND answers are
kept apart from other failures, so the converger knows a busy instance from a
gone one.

Sharing (`GpuSharer`: MPS control daemons, time slices) is not NVML's: it is
done with NVIDIA's command-line tools by `nvidia_sharing.NvidiaSharing`, which
the adapter delegates to (the paths come from the inventory).

Health (`HealthWatcher`, issue 30) is NVML's event set and three reads per
card. The watch registers XID, double-bit and single-bit ECC events on every
card NVML sees (a MIG card's on its parent: its events name the GPU and
compute instance) in an event set of its own, which only the inventory's
health thread waits on; `check_health` reads remapped rows and the volatile
ECC counters. A card NVML cannot see (on vfio-pci) is in neither. What NVML
answers is sorted three ways: the library as a whole gone (uninitialized,
driver not loaded, library missing, library/driver mismatch) raises
AdapterError, which makes every card GpuLost; one card lost (GPU_IS_LOST,
RESET_REQUIRED) is that card's `gone` / `answers=False`; a feature the card
lacks (NOT_SUPPORTED) is no fault: a check reads None, a registration that
fails is that card's `unmonitored`.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol, TypeVar

import pynvml

from shared.schemas import MigPlacement, MigProfile, MpsDaemonSpec, RunningProcess

from .. import hostfs
from .base import (
    VENDOR_CDI_FILE,
    AdapterError,
    AdapterUnavailable,
    DiagResult,
    GpuInstanceFacts,
    HealthCheck,
    HealthEvent,
    MigLayoutResult,
    GpuFacts,
    HostScan,
    MigInstanceFacts,
    MigStepError,
    VendorCdi,
    read_vendor_cdi,
)
from .nvidia_sharing import NvidiaSharing

NATIVE_DRIVER = "nvidia"
MIB = 1024 * 1024
#: NVML's "not a MIG process" value for gpuInstanceId / computeInstanceId.
_NO_INSTANCE = 0xFFFFFFFF
#: the most placements read for one profile (the schema's bound; NVML's cards have at most 8)
_PLACEMENTS_MAX = 64

T = TypeVar("T")


class NvmlError(Exception):
    """An NVML call failed; `code` is NVML's return code when known."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- the port


@dataclass(frozen=True)
class NvmlGiProfile:
    """A GPU instance profile as NVML describes it."""

    profile_id: int
    name: str  # NVML spells it "MIG 1g.18gb"
    slice_count: int
    instance_count: int
    memory_mib: int
    #: the engines of one GPU instance (multiprocessorCount, copyEngineCount, decoderCount,
    #: encoderCount, jpegCount, ofaCount)
    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


@dataclass(frozen=True)
class NvmlGpuInstance:
    gi_id: int
    profile_id: int
    #: its placement (nvmlGpuInstanceGetInfo's placement), in memory slices
    start: int | None = None
    size: int | None = None


@dataclass(frozen=True)
class NvmlMigDevice:
    """A MIG device (compute instance) read from its MIG device handle."""

    #: the MIG device index under its parent (nvidia-ctk's "<gpu>:<index>" names).
    index: int
    gi_id: int
    ci_id: int
    uuid: str
    memory_bytes: int
    gi_slice_count: int
    ci_slice_count: int


@dataclass(frozen=True)
class NvmlProcess:
    pid: int
    gi_id: int | None = None
    ci_id: int | None = None


@dataclass(frozen=True)
class NvmlEvent:
    """One event out of an NVML event set (nvmlEventSetWait_v2's nvmlEventData_t)."""

    #: the NVML index of the card it came from; None when the port does not know the handle
    index: int | None
    #: nvmlEventType* (one bit)
    event_type: int
    #: eventData: the XID's number for an XID event
    data: int = 0
    #: the MIG GPU / compute instance it came from; None: the whole card (NVML's 0xFFFFFFFF)
    gi_id: int | None = None
    ci_id: int | None = None
    #: NVML's spelling of the card's PCI bus id, read only when `index` is None
    pci_bus_id: str = ""


class NvmlPort(Protocol):
    """The NVML calls the adapter makes, by NVML device index; failures raise NvmlError."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def cuda_driver_version(self) -> str:
        """The CUDA version the driver supports, "<major>.<minor>"."""
        ...
    def device_count(self) -> int: ...
    def device_uuid(self, index: int) -> str: ...
    def device_name(self, index: int) -> str: ...
    def device_memory_total(self, index: int) -> int: ...
    def device_pci_bus_id(self, index: int) -> str: ...
    def device_compute_capability(self, index: int) -> tuple[int, int]: ...
    def device_mig_mode(self, index: int) -> bool: ...
    def gpu_instance_profiles(self, index: int) -> list[NvmlGiProfile]: ...
    def gpu_instances(self, index: int) -> list[NvmlGpuInstance]: ...
    def mig_devices(self, index: int) -> list[NvmlMigDevice]: ...
    def compute_processes(self, index: int) -> list[NvmlProcess]: ...
    # MIG changes (bcd gpu mig-layout); they need NVML's MIG config capability (root)
    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        """Set MIG mode; True when the new mode is pending until the GPU is reset."""
        ...
    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None: ...
    def destroy_gpu_instance(self, index: int, gi_id: int) -> None: ...
    def create_gpu_instance(self, index: int, profile_id: int) -> int:
        """A GPU instance of that profile (NVML places it); its id."""
        ...
    def create_compute_instance(self, index: int, gi_id: int) -> int:
        """One compute instance spanning the whole GPU instance; its id."""
        ...
    # MIG instances at a placement (DRA)
    def gpu_instance_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        """(start, size) of every placement a GPU instance of the profile may take (nvmlDeviceGetGpuInstancePossiblePlacements)."""
        ...
    def create_gpu_instance_with_placement(self, index: int, profile_id: int, start: int, size: int) -> int:
        """A GPU instance of that profile at that placement (nvmlDeviceCreateGpuInstanceWithPlacement); its id."""
        ...
    # health (issue 30): an event set, and the reads of a check
    def event_set_create(self) -> object:
        """A new, empty event set (nvmlEventSetCreate); opaque to the caller."""
        ...
    def event_set_free(self, event_set: object) -> None:
        """nvmlEventSetFree."""
        ...
    def device_supported_event_types(self, index: int) -> int:
        """The nvmlEventType* bits the card can report (nvmlDeviceGetSupportedEventTypes)."""
        ...
    def device_register_events(self, index: int, event_types: int, event_set: object) -> None:
        """nvmlDeviceRegisterEvents of those types on the card, into the set."""
        ...
    def event_set_wait(self, event_set: object, timeout_ms: int) -> NvmlEvent | None:
        """The next event, waiting at most timeout_ms (nvmlEventSetWait_v2); None when none came (TIMEOUT)."""
        ...
    def device_remapped_rows(self, index: int) -> tuple[int, int, bool, bool]:
        """(correctable rows, uncorrectable rows, remap pending, remap failed) (nvmlDeviceGetRemappedRows)."""
        ...
    def device_total_ecc_errors(self, index: int, uncorrected: bool) -> int:
        """The volatile (since the last reset) count of uncorrected or corrected ECC errors (nvmlDeviceGetTotalEccErrors)."""
        ...


def _text(value: object) -> str:
    # ctypes char arrays come back as bytes; the convertStrBytes wrappers give str.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _handle_key(handle: object) -> object:
    """What identifies a device handle: the address a ctypes pointer holds (an event's `device` is a
    new pointer object to the same device), or the object's identity for anything else (a stub's)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


class PynvmlNvml:
    """NvmlPort on the real library (nvidia-ml-py's `pynvml` module)."""

    def __init__(self) -> None:
        self._handles: dict[int, object] = {}
        # scans and the health thread both get handles; NVML itself is thread-safe, this cache is not
        self._handles_lock = threading.Lock()

    @staticmethod
    def _call(fn: Callable[..., T], *args: object) -> T:
        try:
            return fn(*args)
        except pynvml.NVMLError as exc:
            raise NvmlError(f"{getattr(fn, '__name__', 'nvml')}: {exc}", getattr(exc, "value", None)) from None

    def _handle(self, index: int) -> object:
        with self._handles_lock:
            if index not in self._handles:
                self._handles[index] = self._call(pynvml.nvmlDeviceGetHandleByIndex, index)
            return self._handles[index]

    def _index_of(self, handle: object) -> int | None:
        """The index a handle was got for (every card registered for events was got through _handle)."""
        key = _handle_key(handle)
        with self._handles_lock:
            return next((i for i, h in self._handles.items() if _handle_key(h) == key), None)

    def init(self) -> None:
        with self._handles_lock:
            self._handles.clear()
        self._call(pynvml.nvmlInit)

    def shutdown(self) -> None:
        with self._handles_lock:
            self._handles.clear()
        self._call(pynvml.nvmlShutdown)

    def driver_version(self) -> str:
        return _text(self._call(pynvml.nvmlSystemGetDriverVersion))

    def cuda_driver_version(self) -> str:
        # NVML answers 1000 * major + 10 * minor (12040 is 12.4), as GFD reads it
        version = int(self._call(pynvml.nvmlSystemGetCudaDriverVersion))
        return f"{version // 1000}.{version % 1000 // 10}"

    def device_count(self) -> int:
        return int(self._call(pynvml.nvmlDeviceGetCount))

    def device_uuid(self, index: int) -> str:
        return _text(self._call(pynvml.nvmlDeviceGetUUID, self._handle(index)))

    def device_name(self, index: int) -> str:
        return _text(self._call(pynvml.nvmlDeviceGetName, self._handle(index)))

    def device_memory_total(self, index: int) -> int:
        return int(self._call(pynvml.nvmlDeviceGetMemoryInfo, self._handle(index)).total)

    def device_pci_bus_id(self, index: int) -> str:
        return _text(self._call(pynvml.nvmlDeviceGetPciInfo, self._handle(index)).busId)

    def device_compute_capability(self, index: int) -> tuple[int, int]:
        major, minor = self._call(pynvml.nvmlDeviceGetCudaComputeCapability, self._handle(index))
        return int(major), int(minor)

    def device_mig_mode(self, index: int) -> bool:
        try:
            current, _pending = self._call(pynvml.nvmlDeviceGetMigMode, self._handle(index))
        except NvmlError as exc:
            if exc.code == pynvml.NVML_ERROR_NOT_SUPPORTED:
                return False  # not a MIG-capable card
            raise
        return bool(int(current) == pynvml.NVML_DEVICE_MIG_ENABLE)

    def gpu_instance_profiles(self, index: int) -> list[NvmlGiProfile]:
        handle = self._handle(index)
        profiles: dict[int, NvmlGiProfile] = {}
        for profile_index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = self._call(pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, profile_index)
            except NvmlError:
                continue  # this card (or driver) has no such profile
            profiles.setdefault(
                int(info.id),
                NvmlGiProfile(
                    profile_id=int(info.id),
                    name=_text(info.name),
                    slice_count=int(info.sliceCount),
                    instance_count=int(info.instanceCount),
                    memory_mib=int(info.memorySizeMB),
                    multiprocessors=int(info.multiprocessorCount),
                    copy_engines=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpeg_engines=int(info.jpegCount),
                    ofa_engines=int(info.ofaCount),
                ),
            )
        return list(profiles.values())

    def gpu_instances(self, index: int) -> list[NvmlGpuInstance]:
        handle = self._handle(index)
        found: list[NvmlGpuInstance] = []
        for profile in self.gpu_instance_profiles(index):
            capacity = max(profile.instance_count, 1)
            array = (pynvml.c_nvmlGpuInstance_t * capacity)()
            count = ctypes.c_uint(0)
            self._call(pynvml.nvmlDeviceGetGpuInstances, handle, profile.profile_id, array, ctypes.byref(count))
            for k in range(count.value):
                info = self._call(pynvml.nvmlGpuInstanceGetInfo, array[k])
                found.append(
                    NvmlGpuInstance(
                        gi_id=int(info.id), profile_id=int(info.profileId), start=int(info.placement.start), size=int(info.placement.size)
                    )
                )
        return found

    def gpu_instance_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        handle = self._handle(index)
        # the _v2 call with no array answers how many there are; then it fills an array that large
        count = ctypes.c_uint(0)
        self._call(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, profile_id, None, ctypes.byref(count))
        capacity = min(int(count.value), _PLACEMENTS_MAX)
        if capacity == 0:
            return []
        array = (pynvml.c_nvmlGpuInstancePlacement_t * capacity)()
        count = ctypes.c_uint(capacity)
        self._call(pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, profile_id, array, ctypes.byref(count))
        return [(int(array[k].start), int(array[k].size)) for k in range(min(int(count.value), capacity))]

    def create_gpu_instance_with_placement(self, index: int, profile_id: int, start: int, size: int) -> int:
        placement = pynvml.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        # pynvml hands `placement` to NVML as is, and NVML takes a pointer to it
        gi = self._call(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement, self._handle(index), profile_id, ctypes.byref(placement))
        return int(self._call(pynvml.nvmlGpuInstanceGetInfo, gi).id)

    def mig_devices(self, index: int) -> list[NvmlMigDevice]:
        handle = self._handle(index)
        found: list[NvmlMigDevice] = []
        for k in range(int(self._call(pynvml.nvmlDeviceGetMaxMigDeviceCount, handle))):
            try:
                mig = self._call(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, k)
            except NvmlError:
                continue  # NOT_FOUND: no MIG device at this index
            try:
                attrs = self._call(pynvml.nvmlDeviceGetAttributes, mig)
                slices = (int(attrs.gpuInstanceSliceCount), int(attrs.computeInstanceSliceCount))
            except NvmlError:
                slices = (0, 0)  # only profile naming suffers
            found.append(
                NvmlMigDevice(
                    index=k,
                    gi_id=int(self._call(pynvml.nvmlDeviceGetGpuInstanceId, mig)),
                    ci_id=int(self._call(pynvml.nvmlDeviceGetComputeInstanceId, mig)),
                    uuid=_text(self._call(pynvml.nvmlDeviceGetUUID, mig)),
                    memory_bytes=int(self._call(pynvml.nvmlDeviceGetMemoryInfo, mig).total),
                    gi_slice_count=slices[0],
                    ci_slice_count=slices[1],
                )
            )
        return found

    def set_mig_mode(self, index: int, enabled: bool) -> bool:
        handle = self._handle(index)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        self._call(pynvml.nvmlDeviceSetMigMode, handle, mode)
        current, pending = self._call(pynvml.nvmlDeviceGetMigMode, handle)
        return int(current) != int(mode) or int(pending) != int(mode)

    def destroy_compute_instance(self, index: int, gi_id: int, ci_id: int) -> None:
        gi = self._call(pynvml.nvmlDeviceGetGpuInstanceById, self._handle(index), gi_id)
        self._call(pynvml.nvmlComputeInstanceDestroy, self._call(pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, ci_id))

    def destroy_gpu_instance(self, index: int, gi_id: int) -> None:
        self._call(pynvml.nvmlGpuInstanceDestroy, self._call(pynvml.nvmlDeviceGetGpuInstanceById, self._handle(index), gi_id))

    def create_gpu_instance(self, index: int, profile_id: int) -> int:
        gi = self._call(pynvml.nvmlDeviceCreateGpuInstance, self._handle(index), profile_id)
        return int(self._call(pynvml.nvmlGpuInstanceGetInfo, gi).id)

    def create_compute_instance(self, index: int, gi_id: int) -> int:
        gi = self._call(pynvml.nvmlDeviceGetGpuInstanceById, self._handle(index), gi_id)
        best = None
        for k in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = self._call(pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo, gi, k, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            except NvmlError:
                continue
            if best is None or int(info.sliceCount) > int(best.sliceCount):
                best = info  # the largest compute instance: the whole GPU instance
        if best is None:
            raise NvmlError("no compute instance profile on this GPU instance")
        ci = self._call(pynvml.nvmlGpuInstanceCreateComputeInstance, gi, int(best.id))
        return int(self._call(pynvml.nvmlComputeInstanceGetInfo, ci).id)

    def compute_processes(self, index: int) -> list[NvmlProcess]:
        procs = self._call(pynvml.nvmlDeviceGetComputeRunningProcesses, self._handle(index))
        out: list[NvmlProcess] = []
        for p in procs:
            gi = getattr(p, "gpuInstanceId", _NO_INSTANCE)
            ci = getattr(p, "computeInstanceId", _NO_INSTANCE)
            out.append(
                NvmlProcess(
                    pid=int(p.pid),
                    gi_id=None if gi is None or gi == _NO_INSTANCE else int(gi),
                    ci_id=None if ci is None or ci == _NO_INSTANCE else int(ci),
                )
            )
        return out

    # health

    def event_set_create(self) -> object:
        return self._call(pynvml.nvmlEventSetCreate)

    def event_set_free(self, event_set: object) -> None:
        self._call(pynvml.nvmlEventSetFree, event_set)

    def device_supported_event_types(self, index: int) -> int:
        return int(self._call(pynvml.nvmlDeviceGetSupportedEventTypes, self._handle(index)))

    def device_register_events(self, index: int, event_types: int, event_set: object) -> None:
        self._call(pynvml.nvmlDeviceRegisterEvents, self._handle(index), event_types, event_set)

    def event_set_wait(self, event_set: object, timeout_ms: int) -> NvmlEvent | None:
        try:
            data = self._call(pynvml.nvmlEventSetWait_v2, event_set, timeout_ms)
        except NvmlError as exc:
            if exc.code == pynvml.NVML_ERROR_TIMEOUT:
                return None
            raise
        index = self._index_of(data.device)
        bus_id = ""
        if index is None:
            # a handle this port never got: NVML still names its card
            try:
                bus_id = _text(self._call(pynvml.nvmlDeviceGetPciInfo, data.device).busId)
            except NvmlError:
                pass
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        return NvmlEvent(
            index=index,
            event_type=int(data.eventType),
            data=int(data.eventData),
            gi_id=None if gi == _NO_INSTANCE else gi,
            ci_id=None if ci == _NO_INSTANCE else ci,
            pci_bus_id=bus_id,
        )

    def device_remapped_rows(self, index: int) -> tuple[int, int, bool, bool]:
        corr, unc, pending, failed = self._call(pynvml.nvmlDeviceGetRemappedRows, self._handle(index))
        return int(corr), int(unc), bool(pending), bool(failed)

    def device_total_ecc_errors(self, index: int, uncorrected: bool) -> int:
        kind = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED if uncorrected else pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        return int(self._call(pynvml.nvmlDeviceGetTotalEccErrors, self._handle(index), kind, pynvml.NVML_VOLATILE_ECC))


# --------------------------------------------------------------------------- the adapter


def unavailable_message(reason: str) -> str:
    return (
        f"NVML is not available on this host: {reason}; "
        "use --adapter fakehw with --fake-host FILE on a machine without NVIDIA GPUs"
    )


def _profile_name(nvml_name: str) -> str:
    return nvml_name[4:] if nvml_name.startswith("MIG ") else nvml_name


def _step_error(what: str, exc: BaseException) -> MigStepError:
    """An NVML failure of a MIG step: IN_USE and NOT_FOUND keep their meaning, the rest failed."""
    code = exc.code if isinstance(exc, NvmlError) else getattr(exc, "value", None)
    if code == pynvml.NVML_ERROR_IN_USE:
        return MigStepError("in-use", f"{what}: in use ({exc})")
    if code == pynvml.NVML_ERROR_NOT_FOUND:
        return MigStepError("not-found", f"{what}: not found ({exc})")
    return MigStepError("failed", f"{what}: NVML failed ({exc})")


# --------------------------------------------------------------------------- health (issue 30)

#: the events the watch registers, of those a card supports
_HEALTH_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypeSingleBitEccError
#: NVML answers that mean the library as a whole does not answer, not one card
_LIBRARY_GONE = frozenset(
    {pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH}
)
#: NVML answers that mean one card is lost (fallen off the bus, or unusable until a reset)
_CARD_LOST = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED})
#: NVML answers that mean the card (or this driver) lacks the feature: no fault
_NOT_SUPPORTED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_VGPU_ECC_NOT_SUPPORTED})
#: the most events one wait takes from the set: the rest are the next wait's, so a storm of XIDs cannot hold the thread
_EVENTS_MAX = 256
#: how long closing the watch waits for a wait in flight; past that, that wait frees the set when it returns
_CLOSE_WAIT_SECONDS = 5.0

_NvmlErrors = (NvmlError, pynvml.NVMLError)


def _nvml_code(exc: BaseException) -> int | None:
    return exc.code if isinstance(exc, NvmlError) else getattr(exc, "value", None)


def _library_gone(exc: BaseException) -> AdapterError:
    return AdapterError(f"NVML does not answer: {exc or type(exc).__name__}")


class _CardLost(Exception):
    """A read of one card answered GPU_IS_LOST (or RESET_REQUIRED); the text is NVML's answer."""


@dataclass
class _HealthWatch:
    """An open watch: NVML's event set and what it holds. Only the health thread touches it
    (under NvidiaAdapter._watch_lock)."""

    #: None: NVML could make no event set (every card is unmonitored); waits then only wait
    event_set: object | None
    #: NVML index -> PCI address of the cards registered on the set
    cards: dict[int, str]
    #: NVML index -> PCI address of the cards reported `gone`: not registered, not reported again
    gone: dict[int, str]


class NvidiaAdapter:
    """VendorAdapter + MigCapable + MigPartitioner + MigInstancer + VfioCapable + SharingCapable + GpuSharer
    + Diagnosable + HealthWatcher on NVML, sysfs, DCGM and NVIDIA's tools."""

    def __init__(
        self,
        *,
        nvml: NvmlPort | None = None,
        sysfs_root: Path | str = hostfs.DEFAULT_SYSFS_ROOT,
        proc_root: Path | str = hostfs.DEFAULT_PROC_ROOT,
        cdi_dir: Path | str = "/etc/cdi",
        slots_per_gpu: int | Mapping[str, int] = 0,
        mps_pipe_dir: str = "/tmp/nvidia-mps",
        known_uuids: Mapping[str, str] | None = None,
        sharing: NvidiaSharing | None = None,
    ) -> None:
        counts = [slots_per_gpu] if isinstance(slots_per_gpu, int) else list(slots_per_gpu.values())
        if any(c < 0 for c in counts):
            raise ValueError("slots_per_gpu must be >= 0")
        self.nvml: NvmlPort = nvml if nvml is not None else PynvmlNvml()
        self.sysfs_root = Path(sysfs_root)
        self.proc_root = Path(proc_root)
        self.cdi_dir = Path(cdi_dir)
        # one count for every card, or per card keyed by uuid or PCI address.
        self._slots: int | dict[str, int] = slots_per_gpu if isinstance(slots_per_gpu, int) else dict(slots_per_gpu)
        self._mps_pipe_dir = mps_pipe_dir
        self._known_uuids = dict(known_uuids or {})
        #: MPS daemons and time slices, with nvidia-cuda-mps-control and nvidia-smi
        self.sharing = sharing if sharing is not None else NvidiaSharing()
        #: last facts per PCI address, for cards NVML stops seeing (passthrough).
        self._last: dict[str, GpuFacts] = {}
        #: uuid -> NVML index, of the cards NVML saw in the last scan.
        self._nvml_index: dict[str, int] = {}
        self._mig_mode: dict[str, bool] = {}
        #: NVML index -> PCI address of the last scan: the health watch names a card by it when NVML
        #: no longer reads its PCI info. Replaced whole by each scan, never changed in place, so the
        #: health thread reads it without a lock.
        self._nvml_pci: dict[int, str] = {}
        #: the health watch (health thread only); _watch_lock serialises open, wait and close, so
        #: the event set is never freed while NVML waits on it
        self._watch: _HealthWatch | None = None
        self._watch_lock = threading.Lock()
        #: a close gave up waiting for a wait in flight: that wait frees the set
        self._watch_abandoned = False
        #: PCI address -> why the card is not watched, of the open watch; replaced whole (check_health
        #: runs in other threads and reads it without a lock)
        self._unmonitored: dict[str, str] = {}
        self._closed = False
        try:
            self.nvml.init()
        except (NvmlError, pynvml.NVMLError) as exc:
            raise AdapterUnavailable(unavailable_message(str(exc) or type(exc).__name__)) from None

    # ----------------------------------------------------------------- MIG layouts

    def apply_mig_layout(self, pci_address: str, profiles: Sequence[str], *, disable: bool) -> MigLayoutResult:
        """Every compute and GPU instance destroyed, MIG mode set, then one GPU instance per profile with one
        full compute instance each; a failure is rolled back to what was there, or to MIG off."""
        facts = self._last.get(pci_address)
        index = self._nvml_index.get(facts.uuid) if facts is not None else None
        if facts is None or index is None:
            return MigLayoutResult("Failed", f"NVML does not see the card at {pci_address} (not on its native driver?)", "as before")
        try:
            known = {_profile_name(p.name): p for p in self.nvml.gpu_instance_profiles(index)}
            before = [(d.gi_id, d.ci_id) for d in self.nvml.mig_devices(index)] if self.nvml.device_mig_mode(index) else []
            before_profiles = self._gi_profiles_now(index, known)
        except (NvmlError, pynvml.NVMLError) as exc:
            return MigLayoutResult("Failed", f"{pci_address}: NVML could not read the card's MIG state: {exc}", "as before")
        if not disable:
            unknown = [p for p in profiles if p not in known]
            if unknown:
                return MigLayoutResult("Failed", f"{pci_address} has no MIG profile {', '.join(unknown)} (it has {', '.join(sorted(known))})", "as before")
        try:
            self._destroy_all(index, before)
            if self.nvml.set_mig_mode(index, not disable):
                return MigLayoutResult(
                    "DisruptionRequired", f"MIG mode {'on' if not disable else 'off'} on {pci_address} is pending until the GPU is reset", "unknown"
                )
            if disable:
                return MigLayoutResult("Applied", f"MIG mode off on {pci_address} (all-disabled)")
            self._make(index, [known[p].profile_id for p in profiles])
        except (NvmlError, pynvml.NVMLError) as exc:
            return self._roll_back(index, pci_address, exc, before_profiles)
        return MigLayoutResult("Applied", f"{pci_address}: {len(profiles)} GPU instance(s): {', '.join(profiles)}")

    def _gi_profiles_now(self, index: int, known: Mapping[str, NvmlGiProfile]) -> list[int]:
        """The profile ids of the GPU instances there now, to restore them after a failure."""
        if not self.nvml.device_mig_mode(index):
            return []
        return [gi.profile_id for gi in sorted(self.nvml.gpu_instances(index), key=lambda g: g.gi_id)]

    def _destroy_all(self, index: int, devices: Sequence[tuple[int, int]]) -> None:
        for gi, ci in devices:
            self.nvml.destroy_compute_instance(index, gi, ci)
        # GPU instances with no compute instance too (a DRA step that failed half-way leaves one):
        # they hold their slices, so what is made next would not fit
        bare = {g.gi_id for g in self._try_list(lambda: self.nvml.gpu_instances(index))} if self.nvml.device_mig_mode(index) else set()
        for gi in sorted({gi for gi, _ in devices} | bare):
            self.nvml.destroy_gpu_instance(index, gi)

    def _make(self, index: int, profile_ids: Sequence[int]) -> None:
        for pid in profile_ids:
            gi = self.nvml.create_gpu_instance(index, pid)
            self.nvml.create_compute_instance(index, gi)

    def _roll_back(self, index: int, pci: str, exc: BaseException, before: Sequence[int]) -> MigLayoutResult:
        why = f"{pci}: NVML failed ({exc})"
        try:
            self._destroy_all(index, [(d.gi_id, d.ci_id) for d in self.nvml.mig_devices(index)])
            if before:
                self._make(index, before)
            return MigLayoutResult("Failed", f"{why}; the layout before was restored", "rolled back")
        except (NvmlError, pynvml.NVMLError) as again:
            try:
                self._destroy_all(index, [(d.gi_id, d.ci_id) for d in self.nvml.mig_devices(index)])
                self.nvml.set_mig_mode(index, False)
            except (NvmlError, pynvml.NVMLError) as last:
                return MigLayoutResult("Failed", f"{why}; restoring failed ({again}) and so did turning MIG off ({last})", "unknown")
            return MigLayoutResult("Failed", f"{why}; restoring the layout before failed ({again}): MIG is off", "all-disabled")

    # ----------------------------------------------------------------- diagnostics

    def run_diag(self, pci_address: str, level: int, timeout: float) -> DiagResult:
        """DCGM's `dcgmi diag` on the card NVML listed at that address in the last scan."""
        from .dcgm import run_dcgmi

        facts = self._last.get(pci_address)
        if facts is None or not facts.readable:
            return DiagResult("Error", f"NVML does not see the card at {pci_address} (not on its native driver?): no diagnostic")
        return run_dcgmi(facts.index, level, timeout)

    # ----------------------------------------------------------------- helpers

    @staticmethod
    def _try(fn: Callable[[], T], default: T) -> T:
        """An optional NVML fact: a card that refuses one still gets listed."""
        try:
            return fn()
        except (NvmlError, pynvml.NVMLError):
            return default

    @staticmethod
    def _try_list(fn: Callable[[], list[T]]) -> list[T]:
        try:
            return fn()
        except (NvmlError, pynvml.NVMLError):
            return []

    def known_uuids(self) -> dict[str, str]:
        """PCI address -> GPU uuid of every card this adapter has identified (for the service to persist)."""
        out = dict(self._known_uuids)
        out.update({pci: f.uuid for pci, f in self._last.items() if f.uuid})
        return out

    def _cc(self, index: int) -> str:
        major, minor = self.nvml.device_compute_capability(index)
        return f"{major}.{minor}"

    # ----------------------------------------------------------------- required

    def vendor(self) -> str:
        return "nvidia"

    def read_capabilities(self) -> HostScan:
        try:
            driver_version = self.nvml.driver_version()
            count = self.nvml.device_count()
        except (NvmlError, pynvml.NVMLError) as exc:
            raise AdapterError(f"NVML: cannot list devices ({exc})") from None

        seen: dict[str, GpuFacts] = {}
        nvml_index: dict[str, int] = {}
        nvml_pci: dict[int, str] = {}
        for i in range(count):
            try:
                uuid = self.nvml.device_uuid(i)
                pci = hostfs.normalize_pci(self.nvml.device_pci_bus_id(i))
            except (NvmlError, pynvml.NVMLError, ValueError):
                # a card NVML cannot identify is still on the PCI bus; the sysfs
                # pass below lists it with what is remembered.
                continue
            seen[pci] = GpuFacts(
                uuid=uuid,
                index=i,
                pci_address=pci,
                name=self._try(lambda: self.nvml.device_name(i), ""),
                memory_bytes=self._try(lambda: self.nvml.device_memory_total(i), 0),
                compute_capability=self._try(lambda: self._cc(i), ""),
                mig_mode=self._try(lambda: self.nvml.device_mig_mode(i), False),
            )
            nvml_index[uuid] = i
            nvml_pci[i] = pci

        for pci in hostfs.list_nvidia_gpus(self.sysfs_root):
            if pci in seen:
                continue
            last = self._last.get(pci)
            if last is not None:
                seen[pci] = replace(last, readable=False)
            else:
                seen[pci] = GpuFacts(uuid=self._known_uuids.get(pci, ""), index=0, pci_address=pci, readable=False)

        gpus: list[GpuFacts] = []
        for position, pci in enumerate(sorted(seen)):
            facts = replace(
                seen[pci], index=position, numa_node=hostfs.read_numa_node(self.sysfs_root, pci), iommu_group=hostfs.read_iommu_group(self.sysfs_root, pci)
            )
            gpus.append(facts)
        # what NVML said is worth remembering; a sysfs-only sighting adds nothing.
        self._last.update({g.pci_address: g for g in gpus if g.readable})
        self._nvml_index = nvml_index
        self._nvml_pci = nvml_pci
        self._mig_mode = {g.uuid: g.mig_mode for g in gpus if g.uuid in nvml_index}

        processes: dict[tuple[int, str], RunningProcess] = {}
        for uuid, i in nvml_index.items():
            for p in self._try_list(lambda: self.nvml.compute_processes(i)):
                processes[(p.pid, uuid)] = RunningProcess(
                    pid=p.pid, gpu_uuid=uuid, cgroup=hostfs.read_cgroup(self.proc_root, p.pid)
                )

        return HostScan(
            driver_version=driver_version,
            cuda_driver_version=self._try(self.nvml.cuda_driver_version, ""),
            gpus=tuple(gpus),
            host=hostfs.read_host_resources(self.sysfs_root, self.proc_root),
            boot_id=hostfs.read_boot_id(self.proc_root),
            processes=tuple(processes[k] for k in sorted(processes)),
        )

    def cdi_edits(self) -> VendorCdi | None:
        return read_vendor_cdi(self.cdi_dir, VENDOR_CDI_FILE)

    def write_cdi_spec(self) -> bool:
        # `nvidia-ctk cdi generate` (or the toolkit's service) owns nvidia.json.
        return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # the event set first: NVML frees it only while initialised
        self.close_health_watch()
        try:
            self.nvml.shutdown()
        except (NvmlError, pynvml.NVMLError):
            pass

    # ----------------------------------------------------------------- HealthWatcher

    def open_health_watch(self) -> list[HealthEvent]:
        with self._watch_lock:
            self._free_watch()  # a watch left open (the thread re-opens after a failure) is replaced
            self._watch_abandoned = False
            self._refuse_closed()
            now = datetime.now(timezone.utc)
            cards = self._health_cards()
            events: list[HealthEvent] = []
            gone: dict[int, str] = {}
            unmonitored: dict[str, str] = {}
            readable: dict[int, str] = {}
            for i, pci, err in cards:
                if err is None:
                    readable[i] = pci
                elif _nvml_code(err) in _CARD_LOST:
                    gone[i] = pci
                    events.append(HealthEvent(pci, "gone", now, message=f"NVML: {err}"))
                else:
                    unmonitored[pci] = f"NVML cannot read the card ({err}): its health events cannot be registered"
            try:
                event_set: object | None = self.nvml.event_set_create()
            except _NvmlErrors as exc:
                if _nvml_code(exc) in _LIBRARY_GONE:
                    raise _library_gone(exc) from None
                # no event set at all: every card is unmonitored, its checks still run
                event_set = None
                unmonitored.update({pci: f"NVML cannot make an event set ({exc}): health events cannot be registered" for pci in readable.values()})
                registered: dict[int, str] = {}
            else:
                try:
                    registered = self._register(event_set, readable, gone, unmonitored, events, now)
                except AdapterError:
                    self._free_set(event_set)
                    raise
            self._watch = _HealthWatch(event_set, registered, gone)
            self._unmonitored = dict(unmonitored)
            events.extend(HealthEvent(pci, "unmonitored", now, message=why) for pci, why in unmonitored.items())
            return sorted(events, key=lambda e: e.pci_address)

    def _register(
        self, event_set: object, cards: Mapping[int, str], gone: dict[int, str], unmonitored: dict[str, str], events: list[HealthEvent], now: datetime
    ) -> dict[int, str]:
        """Register the health events of each card on the set; the cards registered. A card lost meanwhile
        goes to `gone` (with its event), one that cannot be registered to `unmonitored`."""
        registered: dict[int, str] = {}
        for i, pci in sorted(cards.items()):
            try:
                types = self.nvml.device_supported_event_types(i) & _HEALTH_EVENTS
                if not types:
                    unmonitored[pci] = "the card reports none of NVML's health events (XID, ECC): they cannot be registered"
                    continue
                self.nvml.device_register_events(i, types, event_set)
            except _NvmlErrors as exc:
                code = _nvml_code(exc)
                if code in _LIBRARY_GONE:
                    raise _library_gone(exc) from None
                if code in _CARD_LOST:
                    gone[i] = pci
                    events.append(HealthEvent(pci, "gone", now, message=f"NVML: {exc}"))
                elif code in _NOT_SUPPORTED:
                    unmonitored[pci] = f"NVML does not support health events on this card ({exc})"
                else:
                    unmonitored[pci] = f"NVML could not register health events for this card ({exc})"
                continue
            registered[i] = pci
        return registered

    def wait_health_events(self, timeout: float) -> list[HealthEvent]:
        timeout = max(0.0, timeout)
        deadline = time.monotonic() + timeout
        with self._watch_lock:
            try:
                return self._wait(timeout, deadline)
            finally:
                if self._watch_abandoned:
                    self._watch_abandoned = False
                    self._free_watch()

    def _wait(self, timeout: float, deadline: float) -> list[HealthEvent]:
        self._refuse_closed()
        watch = self._watch
        if watch is None:
            raise AdapterError("the health watch is not open")
        if watch.event_set is None or not watch.cards:
            time.sleep(timeout)  # nothing to wait on: the thread still paces itself by this wait
            return []
        events: list[HealthEvent] = []
        timeout_ms = int(timeout * 1000)
        for _ in range(_EVENTS_MAX):
            try:
                got = self.nvml.event_set_wait(watch.event_set, timeout_ms)
            except _NvmlErrors as exc:
                code = _nvml_code(exc)
                if code in _LIBRARY_GONE:
                    raise _library_gone(exc) from None
                if code in _CARD_LOST:
                    events.extend(self._lost_in_wait(watch, exc, deadline))
                else:
                    # the set cannot be waited on: its cards are unmonitored (their checks still run)
                    now = datetime.now(timezone.utc)
                    why = f"NVML's event wait failed ({exc}): health events are no longer watched"
                    events.extend(HealthEvent(pci, "unmonitored", now, message=why) for pci in watch.cards.values())
                    self._unmonitored = {**self._unmonitored, **{pci: why for pci in watch.cards.values()}}
                    self._free_set(watch.event_set)
                    watch.event_set, watch.cards = None, {}
                break
            if got is None:
                break
            timeout_ms = 0  # what else is queued already, without waiting again
            event = self._health_event(watch, got)
            if event is not None:
                events.append(event)
        return events

    def _health_event(self, watch: _HealthWatch, got: NvmlEvent) -> HealthEvent | None:
        pci = watch.cards.get(got.index, watch.gone.get(got.index)) if got.index is not None else None
        if pci is None and got.pci_bus_id:
            try:
                pci = hostfs.normalize_pci(got.pci_bus_id)
            except ValueError:
                pci = None
        if pci is None:
            return None  # no card to name: a HealthEvent needs one
        now = datetime.now(timezone.utc)  # NVML gives no wall time
        gi = got.gi_id
        ci = got.ci_id if gi is not None else None
        if got.event_type & pynvml.nvmlEventTypeXidCriticalError:
            return HealthEvent(pci, "xid", now, xid=int(got.data), gi=gi, ci=ci)
        if got.event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            return HealthEvent(pci, "ecc-uncorrectable", now, gi=gi, ci=ci, message="NVML event: double-bit ECC error")
        if got.event_type & pynvml.nvmlEventTypeSingleBitEccError:
            return HealthEvent(pci, "ecc-correctable", now, gi=gi, ci=ci, message="NVML event: single-bit ECC error")
        return None  # a type the watch did not register

    def _lost_in_wait(self, watch: _HealthWatch, exc: BaseException, deadline: float) -> list[HealthEvent]:
        """The wait answered GPU_IS_LOST without saying which card: each card on the set (and each already
        gone) is read to find it. Those newly lost are `gone`, and the set is made again without them, so
        the others' events still come. When no card reads as lost the set cannot be trusted: AdapterError."""
        lost: dict[int, str] = {}
        for i, pci in sorted({**watch.cards, **watch.gone}.items()):
            check = self._check_card(i, pci)
            if not check.answers:
                lost[i] = check.message
        if not lost:
            raise AdapterError(f"NVML's event wait answered {exc}, and no card it watches reads as lost")
        now = datetime.now(timezone.utc)
        new = {i: watch.cards[i] for i in lost if i in watch.cards}
        events = [HealthEvent(pci, "gone", now, message=lost[i]) for i, pci in new.items()]
        if not new:
            # only a card already reported: the wait may keep answering so; it must not spin
            time.sleep(max(0.0, deadline - time.monotonic()))
            return events
        watch.gone.update(new)
        try:
            event_set = self.nvml.event_set_create()
        except _NvmlErrors as exc2:
            if _nvml_code(exc2) in _LIBRARY_GONE:
                raise _library_gone(exc2) from None
            raise AdapterError(f"NVML cannot make the event set again after a card was lost ({exc2})") from None
        unmonitored: dict[str, str] = {}
        rest = {i: pci for i, pci in watch.cards.items() if i not in new}
        try:
            registered = self._register(event_set, rest, watch.gone, unmonitored, events, now)
        except AdapterError:
            self._free_set(event_set)
            raise
        self._free_set(watch.event_set)
        watch.event_set, watch.cards = event_set, registered
        if unmonitored:
            self._unmonitored = {**self._unmonitored, **unmonitored}
            events.extend(HealthEvent(pci, "unmonitored", now, message=why) for pci, why in unmonitored.items())
        return events

    def check_health(self) -> list[HealthCheck]:
        self._refuse_closed()
        unmonitored = self._unmonitored  # one snapshot: the health thread replaces it whole
        out: list[HealthCheck] = []
        for i, pci, err in self._health_cards():
            if err is not None:
                out.append(HealthCheck(pci, answers=False, message=f"NVML cannot read the card: {err}"))
            else:
                out.append(replace(self._check_card(i, pci), unmonitored=unmonitored.get(pci, "")))
        return sorted(out, key=lambda c: c.pci_address)

    def _check_card(self, index: int, pci: str) -> HealthCheck:
        """Remapped rows and the volatile ECC counters of one card; answers=False when it is lost."""
        try:
            rows = self._health_read(lambda: self.nvml.device_remapped_rows(index))
            uncorrectable = self._health_read(lambda: self.nvml.device_total_ecc_errors(index, uncorrected=True))
            correctable = self._health_read(lambda: self.nvml.device_total_ecc_errors(index, uncorrected=False))
        except _CardLost as lost:
            return HealthCheck(pci, answers=False, message=f"NVML: {lost}")
        return HealthCheck(
            pci,
            row_remap_pending=bool(rows[2]) if rows is not None else False,
            row_remap_failed=bool(rows[3]) if rows is not None else False,
            ecc_uncorrectable=uncorrectable,
            ecc_correctable=correctable,
        )

    @staticmethod
    def _health_read(fn: Callable[[], T]) -> T | None:
        """One read of a check: None when the card lacks it (or NVML refuses it: no fault either);
        _CardLost when the card is lost; AdapterError when the library is."""
        try:
            return fn()
        except _NvmlErrors as exc:
            code = _nvml_code(exc)
            if code in _LIBRARY_GONE:
                raise _library_gone(exc) from None
            if code in _CARD_LOST:
                raise _CardLost(str(exc) or type(exc).__name__) from None
            return None

    def _health_cards(self) -> list[tuple[int, str, BaseException | None]]:
        """(NVML index, PCI address, why NVML cannot read it or None) of each card NVML sees. A card whose
        PCI info NVML no longer reads is named by the last scan; one it never named is left out."""
        try:
            count = self.nvml.device_count()
        except _NvmlErrors as exc:
            raise _library_gone(exc) from None
        known = self._nvml_pci
        out: list[tuple[int, str, BaseException | None]] = []
        for i in range(count):
            try:
                out.append((i, hostfs.normalize_pci(self.nvml.device_pci_bus_id(i)), None))
            except _NvmlErrors as exc:
                if _nvml_code(exc) in _LIBRARY_GONE:
                    raise _library_gone(exc) from None
                if i in known:
                    out.append((i, known[i], exc))
            except ValueError:
                continue  # not a PCI address: no card to name
        return out

    def _refuse_closed(self) -> None:
        if self._closed:
            raise AdapterError("NVML is shut down: the nvidia adapter is closed")

    def close_health_watch(self) -> None:
        if not self._watch_lock.acquire(timeout=_CLOSE_WAIT_SECONDS):
            # a wait stuck in the driver: freeing the set under it would crash NVML; the wait frees it
            self._watch_abandoned = True
            return
        try:
            self._free_watch()
        finally:
            self._watch_lock.release()

    def _free_watch(self) -> None:
        """Under _watch_lock."""
        watch, self._watch = self._watch, None
        self._unmonitored = {}
        if watch is not None and watch.event_set is not None:
            self._free_set(watch.event_set)

    def _free_set(self, event_set: object) -> None:
        try:
            self.nvml.event_set_free(event_set)
        except _NvmlErrors:
            pass  # a library that is gone has freed it with everything else

    # ----------------------------------------------------------------- MigCapable

    def mig_profiles(self, gpu_uuid: str) -> list[MigProfile]:
        i = self._nvml_index.get(gpu_uuid)
        if i is None:
            return []
        return [
            MigProfile(
                name=_profile_name(p.name),
                profile_id=p.profile_id,
                slices=p.slice_count,
                memory_bytes=p.memory_mib * MIB,
                instances_max=p.instance_count,
                placements=self._placements(i, p.profile_id),
                multiprocessors=p.multiprocessors,
                copy_engines=p.copy_engines,
                decoders=p.decoders,
                encoders=p.encoders,
                jpeg_engines=p.jpeg_engines,
                ofa_engines=p.ofa_engines,
            )
            for p in self._try_list(lambda: self.nvml.gpu_instance_profiles(i))
        ]

    def _placements(self, index: int, profile_id: int) -> list[MigPlacement]:
        # a card not in MIG mode (or a driver that will not say) lists none: DRA then offers none
        found = self._try_list(lambda: self.nvml.gpu_instance_placements(index, profile_id))
        return [MigPlacement(start=start, size=size) for start, size in sorted(set(found))[:_PLACEMENTS_MAX]]

    def mig_instances(self, gpu_uuid: str) -> list[MigInstanceFacts]:
        i = self._nvml_index.get(gpu_uuid)
        if i is None or not self._mig_mode.get(gpu_uuid, False):
            return []
        devices = self._try_list(lambda: self.nvml.mig_devices(i))
        if not devices:
            return []
        profiles = {p.profile_id: p for p in self._try_list(lambda: self.nvml.gpu_instance_profiles(i))}
        gis = {g.gi_id: g for g in self._try_list(lambda: self.nvml.gpu_instances(i))}
        out: list[MigInstanceFacts] = []
        for dev in devices:
            gi = gis.get(dev.gi_id)
            profile = profiles.get(gi.profile_id) if gi is not None else None
            if profile is None:
                profile = self._guess_profile(profiles.values(), dev)
            name = _profile_name(profile.name) if profile is not None else ""
            if name and 0 < dev.ci_slice_count < dev.gi_slice_count:
                name = f"{dev.ci_slice_count}c.{name}"
            out.append(
                MigInstanceFacts(
                    gi=dev.gi_id, ci=dev.ci_id, profile=name, uuid=dev.uuid, memory_bytes=dev.memory_bytes,
                    start=gi.start if gi is not None else None, size=gi.size if gi is not None else None,
                )
            )
        return sorted(out, key=lambda m: (m.gi, m.ci))

    # ----------------------------------------------------------------- MigInstancer

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceFacts]:
        i = self._nvml_index.get(gpu_uuid)
        if i is None or not self._mig_mode.get(gpu_uuid, False):
            return []
        profiles = {p.profile_id: p for p in self._try_list(lambda: self.nvml.gpu_instance_profiles(i))}
        devices = self._try_list(lambda: self.nvml.mig_devices(i))
        cis: dict[int, int] = {}
        for dev in devices:
            cis[dev.gi_id] = cis.get(dev.gi_id, 0) + 1
        try:
            gis = self.nvml.gpu_instances(i)
        except (NvmlError, pynvml.NVMLError):
            # no privilege to list GPU instances: those with a MIG device are still known, not where they sit
            out: list[GpuInstanceFacts] = []
            for gi_id in sorted(cis):
                dev = next(d for d in devices if d.gi_id == gi_id)
                guess = self._guess_profile(profiles.values(), dev)
                out.append(
                    GpuInstanceFacts(
                        gi=gi_id, profile=_profile_name(guess.name) if guess else "", profile_id=guess.profile_id if guess else None,
                        compute_instances=cis[gi_id],
                    )
                )
            return out
        out = []
        for g in sorted(gis, key=lambda g: g.gi_id):
            profile = profiles.get(g.profile_id)
            out.append(
                GpuInstanceFacts(
                    gi=g.gi_id, profile=_profile_name(profile.name) if profile is not None else "", profile_id=g.profile_id,
                    start=g.start, size=g.size, compute_instances=cis.get(g.gi_id, 0),
                )
            )
        return out

    def _step_index(self, pci_address: str) -> int:
        """The NVML index of a card the last scan saw; refused for one NVML does not see."""
        facts = self._last.get(pci_address)
        index = self._nvml_index.get(facts.uuid) if facts is not None else None
        if facts is None or index is None:
            raise MigStepError("refused", f"NVML does not see the card at {pci_address} (not on its native driver?)")
        return index

    def create_gpu_instance(self, pci_address: str, profile: str, start: int) -> int:
        index = self._step_index(pci_address)
        what = f"{pci_address}: a GPU instance of {profile} at {start}"
        try:
            if not self.nvml.device_mig_mode(index):
                raise MigStepError("refused", f"{pci_address} is not in MIG mode")
            known = {_profile_name(p.name): p for p in self.nvml.gpu_instance_profiles(index)}
            wanted = known.get(profile)
            if wanted is None:
                raise MigStepError("refused", f"{pci_address} has no MIG profile {profile} (it has {', '.join(sorted(known)) or 'none'})")
            placements = dict(self.nvml.gpu_instance_placements(index, wanted.profile_id))
            if start not in placements:
                raise MigStepError("refused", f"{profile} on {pci_address} has no placement at {start} (its starts: {sorted(placements) or 'none'})")
            size = placements[start]
            there = self.nvml.gpu_instances(index)
            for g in there:
                if g.start is None or g.size is None:
                    raise MigStepError("refused", f"GPU instance {g.gi_id} on {pci_address} has no known placement; no instance is placed beside it")
                if g.start < start + size and start < g.start + g.size:
                    raise MigStepError("refused", f"{profile} at {start} on {pci_address} overlaps GPU instance {g.gi_id} (at {g.start}, {g.size} slice(s))")
            same = sum(1 for g in there if g.profile_id == wanted.profile_id)
            if wanted.instance_count and same >= wanted.instance_count:
                raise MigStepError("refused", f"{pci_address} has {same} GPU instance(s) of {profile} already, its most")
            return self.nvml.create_gpu_instance_with_placement(index, wanted.profile_id, start, size)
        except (NvmlError, pynvml.NVMLError) as exc:
            raise _step_error(what, exc) from None

    def create_compute_instance(self, pci_address: str, gi: int) -> MigInstanceFacts:
        index = self._step_index(pci_address)
        what = f"{pci_address}: the compute instance of GPU instance {gi}"
        try:
            if not self.nvml.device_mig_mode(index):
                raise MigStepError("refused", f"{pci_address} is not in MIG mode")
            there = next((g for g in self.nvml.gpu_instances(index) if g.gi_id == gi), None)
            if there is None:
                raise MigStepError("not-found", f"{pci_address} has no GPU instance {gi}")
            if any(d.gi_id == gi for d in self.nvml.mig_devices(index)):
                raise MigStepError("refused", f"GPU instance {gi} on {pci_address} has a compute instance already")
            ci = self.nvml.create_compute_instance(index, gi)
            # the MIG device's uuid is what the claim hands the container
            device = next((d for d in self.nvml.mig_devices(index) if (d.gi_id, d.ci_id) == (gi, ci)), None)
            profiles = {p.profile_id: p for p in self.nvml.gpu_instance_profiles(index)}
        except (NvmlError, pynvml.NVMLError) as exc:
            raise _step_error(what, exc) from None
        if device is None:
            raise MigStepError("failed", f"{what}: compute instance {ci} was made, but NVML lists no MIG device for it")
        profile = profiles.get(there.profile_id)
        return MigInstanceFacts(
            gi=gi, ci=ci, profile=_profile_name(profile.name) if profile is not None else "", uuid=device.uuid,
            memory_bytes=device.memory_bytes, start=there.start, size=there.size,
        )

    def destroy_compute_instance(self, pci_address: str, gi: int, ci: int) -> None:
        index = self._step_index(pci_address)
        what = f"{pci_address}: compute instance {ci} of GPU instance {gi}"
        try:
            if not self.nvml.device_mig_mode(index) or not any((d.gi_id, d.ci_id) == (gi, ci) for d in self.nvml.mig_devices(index)):
                raise MigStepError("not-found", f"{pci_address} has no compute instance {ci} in GPU instance {gi}")
            self._refuse_in_use(index, what, gi, ci)
            self.nvml.destroy_compute_instance(index, gi, ci)
        except (NvmlError, pynvml.NVMLError) as exc:
            raise _step_error(what, exc) from None

    def destroy_gpu_instance(self, pci_address: str, gi: int) -> None:
        index = self._step_index(pci_address)
        what = f"{pci_address}: GPU instance {gi}"
        try:
            if not self.nvml.device_mig_mode(index) or not any(g.gi_id == gi for g in self.nvml.gpu_instances(index)):
                raise MigStepError("not-found", f"{pci_address} has no GPU instance {gi}")
            left = sum(1 for d in self.nvml.mig_devices(index) if d.gi_id == gi)
            if left:
                raise MigStepError("in-use", f"GPU instance {gi} on {pci_address} still has {left} compute instance(s)")
            self._refuse_in_use(index, what, gi, None)
            self.nvml.destroy_gpu_instance(index, gi)
        except (NvmlError, pynvml.NVMLError) as exc:
            raise _step_error(what, exc) from None

    def _refuse_in_use(self, index: int, what: str, gi: int, ci: int | None) -> None:
        """in-use while NVML lists a process on it; a list NVML refuses leaves it to the destroy's own IN_USE."""
        for p in self._try_list(lambda: self.nvml.compute_processes(index)):
            if p.gi_id == gi and (ci is None or p.ci_id is None or p.ci_id == ci):
                raise MigStepError("in-use", f"{what}: process {p.pid} runs on it")

    @staticmethod
    def _guess_profile(profiles: Iterable[NvmlGiProfile], dev: NvmlMigDevice) -> NvmlGiProfile | None:
        """The GPU instance profile a MIG device most likely has, when NVML would not list GPU instances."""
        candidates = [p for p in profiles if p.slice_count == dev.gi_slice_count]
        if not candidates:
            return None
        mib = dev.memory_bytes / MIB
        # same slices, nearest memory; the lowest id breaks ties (the plain profile before "+me").
        return min(candidates, key=lambda p: (abs(p.memory_mib - mib), p.profile_id))

    # ----------------------------------------------------------------- VfioCapable

    def driver_binding(self, pci_address: str) -> tuple[str, str]:
        return hostfs.read_bound_driver(self.sysfs_root, pci_address), NATIVE_DRIVER

    # ----------------------------------------------------------------- SharingCapable

    def slots_per_gpu(self, gpu_uuid: str) -> int:
        if isinstance(self._slots, int):
            return self._slots
        if gpu_uuid in self._slots:
            return self._slots[gpu_uuid]
        for pci, facts in self._last.items():
            if facts.uuid == gpu_uuid:
                return self._slots.get(pci, 0)
        return 0

    def mps_running(self) -> bool:
        # the control daemon creates its `control` pipe in the pipe directory.
        try:
            return (Path(self._mps_pipe_dir) / "control").exists()
        except OSError:
            return False

    def mps_pipe_dir(self) -> str:
        return self._mps_pipe_dir

    # ----------------------------------------------------------------- GpuSharer

    def mps_start(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        self.sharing.mps_start(spec, pipe_dir, log_dir)

    def mps_stop(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        self.sharing.mps_stop(control, pipe_dir, log_dir)

    def mps_list(self, root: Path) -> list[str]:
        return self.sharing.mps_list(root)

    def set_timeslice(self, pci_address: str, gpu_uuid: str, interval: str) -> None:
        self.sharing.set_timeslice(pci_address, gpu_uuid, interval)


__all__ = [
    "NATIVE_DRIVER",
    "NvmlError",
    "NvmlEvent",
    "NvmlGiProfile",
    "NvmlGpuInstance",
    "NvmlMigDevice",
    "NvmlProcess",
    "NvmlPort",
    "PynvmlNvml",
    "NvidiaAdapter",
    "unavailable_message",
]
