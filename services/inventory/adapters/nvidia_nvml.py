"""NVML behind a port: `NvmlPort`, its value types, `PynvmlNvml` (the port on nvidia-ml-py), and the
error helpers every part of the nvidia adapter shares.

The adapter's logic (discovery, MIG, health) calls NVML only through `NvmlPort`, by NVML device
index, so it runs in tests against a fake port; `PynvmlNvml` is the one class that touches the
library. Each of its calls turns pynvml's NVMLError into `NvmlError`, keeping NVML's return code
(`code`), so callers sort failures by code without knowing pynvml. `NVML_ERRORS`, `nvml_code`,
`try_value` and `try_list` are how the rest of the adapter catches and reads those failures (a port
that lets pynvml's own error through is caught the same way).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import pynvml

MIB = 1024 * 1024
#: NVML's "not a MIG process" value for gpuInstanceId / computeInstanceId.
_NO_INSTANCE = 0xFFFFFFFF
#: the most placements read for one profile (the schema's bound; NVML's cards have at most 8)
PLACEMENTS_MAX = 64

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
        capacity = min(int(count.value), PLACEMENTS_MAX)
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


# --------------------------------------------------------------------------- failures, shared

#: what an NVML call raises: the port's NvmlError, or pynvml's own from a port that lets it through
NVML_ERRORS = (NvmlError, pynvml.NVMLError)


def nvml_code(exc: BaseException) -> int | None:
    """NVML's return code of a failure (NVML_ERROR_*), when it carries one."""
    return exc.code if isinstance(exc, NvmlError) else getattr(exc, "value", None)


def try_value(fn: Callable[[], T], default: T) -> T:
    """An optional NVML fact: a card that refuses one still gets listed."""
    try:
        return fn()
    except NVML_ERRORS:
        return default


def try_list(fn: Callable[[], list[T]]) -> list[T]:
    """An optional NVML list: empty when NVML refuses it."""
    try:
        return fn()
    except NVML_ERRORS:
        return []


__all__ = [
    "MIB",
    "NVML_ERRORS",
    "PLACEMENTS_MAX",
    "NvmlError",
    "NvmlEvent",
    "NvmlGiProfile",
    "NvmlGpuInstance",
    "NvmlMigDevice",
    "NvmlPort",
    "NvmlProcess",
    "PynvmlNvml",
    "nvml_code",
    "try_list",
    "try_value",
]
