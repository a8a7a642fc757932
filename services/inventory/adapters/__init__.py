"""Vendor adapters of the inventory, and `load_adapter`, the one place that picks one by name.

`fakehw` reads a host description file; `nvidia` reads NVML and sysfs. The
service passes all its options to `load_adapter`; each adapter takes the ones
it understands, so one command line serves both. `nvidia` (and NVML's
bindings, pynvml and ctypes: about 3.5 MiB) is imported when it is picked or one
of its names is asked for, so a fakehw inventory never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (
    VENDOR_CDI_FILE,
    AdapterError,
    AdapterUnavailable,
    DomainLister,
    GpuFacts,
    HostScan,
    MigCapable,
    MigInstanceFacts,
    RunningDomain,
    SharingCapable,
    VendorAdapter,
    VendorCdi,
    VendorSpecError,
    VfioCapable,
    read_vendor_cdi,
)
from .fakehost import HostFileError, load_host_file
from .fakehw import FakeHwAdapter

if TYPE_CHECKING:
    from .nvidia import NvidiaAdapter
    from .nvidia_nvml import NvmlError, NvmlPort, PynvmlNvml

_NVML_NAMES = frozenset({"NvmlError", "NvmlPort", "PynvmlNvml"})


def __getattr__(name: str) -> Any:
    if name == "NvidiaAdapter":
        from .nvidia import NvidiaAdapter

        return NvidiaAdapter
    if name in _NVML_NAMES:
        from . import nvidia_nvml

        return getattr(nvidia_nvml, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ADAPTERS: tuple[str, ...] = ("fakehw", "nvidia")

#: the keyword arguments each adapter takes from load_adapter.
_FAKEHW_ARGS = frozenset({"fake_host", "host_file", "cdi_dir"})
_NVIDIA_ARGS = frozenset(
    {"nvml", "sysfs_root", "proc_root", "cdi_dir", "slots_per_gpu", "mps_pipe_dir", "known_uuids"}
)
_ALL_ARGS = _FAKEHW_ARGS | _NVIDIA_ARGS


def load_adapter(name: str, **kw: Any) -> VendorAdapter:
    """The adapter called `name`, built from the options it understands.

    fakehw: `fake_host` (or `host_file`), `cdi_dir`.
    nvidia: `sysfs_root`, `proc_root`, `cdi_dir`, `slots_per_gpu` (an int for every
    card, or a mapping keyed by GPU uuid or PCI address), `mps_pipe_dir`,
    `known_uuids` (PCI address -> uuid), `nvml` (an NvmlPort; tests only).
    None values are ignored.
    Options meant for the other adapter are ignored; unknown options are a
    TypeError. Raises AdapterUnavailable (clear text, no traceback needed) when
    the adapter cannot run here, and HostFileError for a bad host file.
    """
    unknown = set(kw) - _ALL_ARGS
    if unknown:
        raise TypeError(f"load_adapter: unknown option(s) {', '.join(sorted(unknown))}")
    if name == "fakehw":
        host_file = kw.get("fake_host") or kw.get("host_file")
        if not host_file:
            raise AdapterUnavailable("the fakehw adapter needs a host description: --fake-host FILE")
        if not kw.get("cdi_dir"):
            raise AdapterUnavailable("the fakehw adapter needs a CDI directory: --cdi-dir DIR")
        return FakeHwAdapter(host_file, cdi_dir=kw["cdi_dir"])
    if name == "nvidia":
        from .nvidia import NvidiaAdapter

        args = {k: v for k, v in kw.items() if k in _NVIDIA_ARGS and v is not None}
        return NvidiaAdapter(**args)
    raise AdapterUnavailable(f"unknown adapter {name!r}; choose one of: {', '.join(ADAPTERS)}")


__all__ = [
    "ADAPTERS",
    "load_adapter",
    "VENDOR_CDI_FILE",
    "AdapterError",
    "AdapterUnavailable",
    "VendorSpecError",
    "HostFileError",
    "GpuFacts",
    "HostScan",
    "MigInstanceFacts",
    "RunningDomain",
    "VendorCdi",
    "read_vendor_cdi",
    "VendorAdapter",
    "MigCapable",
    "VfioCapable",
    "SharingCapable",
    "DomainLister",
    "FakeHwAdapter",
    "load_host_file",
    "NvidiaAdapter",
    "NvmlError",
    "NvmlPort",
    "PynvmlNvml",
]
