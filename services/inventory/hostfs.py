"""Readers of host facts from sysfs and procfs, each under an explicit root.

The nvidia adapter (and later the VFIO switcher and the converger's host
admission) need the same few files: a PCI device's NUMA node and bound driver,
host and per-node memory, huge page pools, online CPUs, the boot id and a
process's cgroup. They live here once, and every function takes the root it
reads under (`sysfs_root`, default /sys; `proc_root`, default /proc), so the
real code runs unchanged against a fake tree in tests.

A host fact that cannot be read is reported as absent (None, "" or an empty
list), never raised: the inventory must still describe a host whose /proc is
odd, and the consumers (admission, status) have explicit rules for "unknown".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from shared.schemas import HostResources, HugePagePool, NumaNode
from shared.schemas.common import CPULIST_PATTERN

DEFAULT_SYSFS_ROOT = Path("/sys")
DEFAULT_PROC_ROOT = Path("/proc")

#: PCI vendor id of NVIDIA, as sysfs spells it.
NVIDIA_PCI_VENDOR = "0x10de"
#: display controller classes a GPU may report: VGA (0x0300) and 3D (0x0302).
GPU_PCI_CLASS_PREFIXES = ("0x0300", "0x0302")

_CPULIST_RE = re.compile(CPULIST_PATTERN)
# NVML spells the domain with 8 hex digits ("00000000:3B:00.0"), lspci and
# sysfs with 4; a bare "3b:00.0" means domain 0.
_PCI_ANY_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7])$"
)
_HUGEPAGES_DIR_RE = re.compile(r"^hugepages-(\d+)kB$")
_NODE_DIR_RE = re.compile(r"^node(\d+)$")


# --------------------------------------------------------------------------- small readers


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        # ValueError covers UnicodeDecodeError: a garbled file is unreadable.
        return None


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _cpulist(text: str | None) -> str:
    """A cpulist as sysfs gives it, or "" when absent or not cpulist syntax."""
    if text is None:
        return ""
    value = text.strip()
    return value if _CPULIST_RE.search(value) else ""


# --------------------------------------------------------------------------- PCI


def normalize_pci(address: str) -> str:
    """Canonical PCI address ("0000:3b:00.0") from NVML's, lspci's or sysfs' spelling.

    Raises ValueError for anything that is not a PCI address, or whose domain
    does not fit the four hex digits the canonical form (and the schema) has.
    """
    m = _PCI_ANY_RE.match(address.strip())
    if m is None:
        raise ValueError(f"not a PCI address: {address!r}")
    domain = int(m.group("domain") or "0", 16)
    if domain > 0xFFFF:
        raise ValueError(f"PCI domain of {address!r} does not fit in 16 bits")
    return f"{domain:04x}:{m.group('bus').lower()}:{m.group('dev').lower()}.{m.group('fn')}"


def pci_device_dir(sysfs_root: Path | str, pci: str) -> Path:
    return Path(sysfs_root) / "bus" / "pci" / "devices" / pci


def read_numa_node(sysfs_root: Path | str, pci: str) -> int | None:
    """The device's NUMA node; None when unknown (the kernel writes -1 on one-node hosts)."""
    value = _read_int(pci_device_dir(sysfs_root, pci) / "numa_node")
    return value if value is not None and value >= 0 else None


def read_iommu_group(sysfs_root: Path | str, pci: str) -> int | None:
    """The device's IOMMU group (the number its `iommu_group` link names); None without an IOMMU."""
    try:
        name = os.path.basename(os.readlink(pci_device_dir(sysfs_root, pci) / "iommu_group"))
    except OSError:
        return None
    return int(name) if name.isdigit() and len(name) <= 5 and int(name) <= 65535 else None


def read_bound_driver(sysfs_root: Path | str, pci: str) -> str:
    """Name of the kernel driver bound to the device now; "" when none is."""
    try:
        return os.path.basename(os.readlink(pci_device_dir(sysfs_root, pci) / "driver"))
    except OSError:
        return ""


def read_driver_override(sysfs_root: Path | str, pci: str) -> str:
    """The device's driver_override; "" when unset (the kernel shows "(null)")."""
    text = _read_text(pci_device_dir(sysfs_root, pci) / "driver_override")
    value = (text or "").strip()
    return "" if value == "(null)" else value


def list_pci_devices(
    sysfs_root: Path | str,
    *,
    vendor: str | None = None,
    class_prefixes: tuple[str, ...] = (),
) -> list[str]:
    """Canonical addresses of the PCI devices in sysfs, filtered by vendor and class, sorted."""
    base = Path(sysfs_root) / "bus" / "pci" / "devices"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    found: list[str] = []
    for name in names:
        try:
            pci = normalize_pci(name)
        except ValueError:
            continue
        if vendor is not None and (_read_text(base / name / "vendor") or "").strip().lower() != vendor:
            continue
        if class_prefixes:
            cls = (_read_text(base / name / "class") or "").strip().lower()
            if not cls.startswith(class_prefixes):
                continue
        found.append(pci)
    return found


def list_nvidia_gpus(sysfs_root: Path | str) -> list[str]:
    """NVIDIA display devices in sysfs whatever driver holds them (NVML misses vfio-pci cards)."""
    return list_pci_devices(sysfs_root, vendor=NVIDIA_PCI_VENDOR, class_prefixes=GPU_PCI_CLASS_PREFIXES)


# --------------------------------------------------------------------------- /proc


def read_meminfo(proc_root: Path | str) -> dict[str, int]:
    """/proc/meminfo as numbers: "kB" lines in bytes, unit-less lines (HugePages_*) as counts.

    Returns {} when the file is unreadable; lines that do not parse are skipped.
    """
    return _parse_meminfo(_read_text(Path(proc_root) / "meminfo"))


def _parse_meminfo(text: str | None) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        # per-node meminfo prefixes every line with "Node <n>".
        if len(parts) >= 2 and parts[0] == "Node":
            parts = parts[2:]
        if len(parts) < 2 or not parts[0].endswith(":"):
            continue
        try:
            number = int(parts[1])
        except ValueError:
            continue
        if number < 0:
            continue
        if len(parts) >= 3 and parts[2] == "kB":
            number *= 1024
        values[parts[0][:-1]] = number
    return values


def read_boot_id(proc_root: Path | str) -> str:
    """/proc/sys/kernel/random/boot_id; "" when unreadable."""
    return (_read_text(Path(proc_root) / "sys" / "kernel" / "random" / "boot_id") or "").strip()


def read_cgroup(proc_root: Path | str, pid: int) -> str:
    """The cgroup path of a process; "" when the process is gone or the file is odd.

    cgroup v2 has the single line "0::<path>"; on a hybrid v1 host the unified
    line is preferred, else the first named hierarchy's path.
    """
    text = _read_text(Path(proc_root) / str(pid) / "cgroup")
    if not text:
        return ""
    fallback = ""
    for line in text.splitlines():
        hid, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not sep or not sep2:
            continue
        if hid == "0" and controllers == "":
            return path
        if not fallback and path:
            fallback = path
    return fallback


def is_virtualized(proc_root: Path | str) -> bool:
    """True when the CPU flags carry "hypervisor" (the kernel sets it inside a guest)."""
    text = _read_text(Path(proc_root) / "cpuinfo") or ""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags" and "hypervisor" in value.split():
            return True
    return False


# --------------------------------------------------------------------------- CPUs, NUMA, huge pages


def read_online_cpus(sysfs_root: Path | str) -> str:
    return _cpulist(_read_text(Path(sysfs_root) / "devices" / "system" / "cpu" / "online"))


def _read_pools(directory: Path) -> list[HugePagePool]:
    """Huge page pools under a `hugepages/` directory (host-wide or per node)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    pools: list[HugePagePool] = []
    for name in names:
        m = _HUGEPAGES_DIR_RE.match(name)
        if m is None:
            continue
        total = _read_int(directory / name / "nr_hugepages")
        free = _read_int(directory / name / "free_hugepages")
        if total is None or free is None or total < 0 or free < 0:
            continue
        pools.append(HugePagePool(page_size_kib=int(m.group(1)), total=total, free=free))
    return sorted(pools, key=lambda p: p.page_size_kib)


def read_numa_nodes(sysfs_root: Path | str) -> list[NumaNode]:
    base = Path(sysfs_root) / "devices" / "system" / "node"
    try:
        names = os.listdir(base)
    except OSError:
        return []
    nodes: list[NumaNode] = []
    for name in names:
        m = _NODE_DIR_RE.match(name)
        if m is None:
            continue
        directory = base / name
        meminfo = _parse_meminfo(_read_text(directory / "meminfo"))
        nodes.append(
            NumaNode(
                node=int(m.group(1)),
                cpus=_cpulist(_read_text(directory / "cpulist")),
                memory_bytes=meminfo.get("MemTotal"),
                hugepages=_read_pools(directory / "hugepages"),
            )
        )
    return sorted(nodes, key=lambda n: n.node)


def read_hugepage_pools(sysfs_root: Path | str) -> list[HugePagePool]:
    """Host-wide pools of every page size, from /sys/kernel/mm/hugepages."""
    return _read_pools(Path(sysfs_root) / "kernel" / "mm" / "hugepages")


def sum_pools(nodes: list[NumaNode]) -> list[HugePagePool]:
    totals: dict[int, tuple[int, int]] = {}
    for node in nodes:
        for pool in node.hugepages:
            t, f = totals.get(pool.page_size_kib, (0, 0))
            totals[pool.page_size_kib] = (t + pool.total, f + pool.free)
    return [HugePagePool(page_size_kib=k, total=t, free=f) for k, (t, f) in sorted(totals.items())]


def read_host_resources(sysfs_root: Path | str = DEFAULT_SYSFS_ROOT, proc_root: Path | str = DEFAULT_PROC_ROOT) -> HostResources:
    """Memory, CPUs, NUMA nodes and huge pages of the host; unreadable parts stay None/empty."""
    meminfo = read_meminfo(proc_root)
    nodes = read_numa_nodes(sysfs_root)
    # Most to least precise: the host-wide sysfs pools know every size; the
    # per-node sum is the same number when the host-wide dir is hidden; meminfo
    # only knows the default size.
    pools = read_hugepage_pools(sysfs_root) or sum_pools(nodes)
    if not pools and "Hugepagesize" in meminfo and "HugePages_Total" in meminfo:
        pools = [
            HugePagePool(
                page_size_kib=meminfo["Hugepagesize"] // 1024,
                total=meminfo["HugePages_Total"],
                free=meminfo.get("HugePages_Free", 0),
            )
        ]
    return HostResources(
        memory_bytes=meminfo.get("MemTotal"),
        memory_available_bytes=meminfo.get("MemAvailable"),
        cpus=read_online_cpus(sysfs_root),
        numa_nodes=nodes,
        hugepages=pools,
        virtualized=is_virtualized(proc_root),
    )


__all__ = [
    "DEFAULT_SYSFS_ROOT",
    "DEFAULT_PROC_ROOT",
    "NVIDIA_PCI_VENDOR",
    "GPU_PCI_CLASS_PREFIXES",
    "normalize_pci",
    "pci_device_dir",
    "read_numa_node",
    "read_bound_driver",
    "read_driver_override",
    "list_pci_devices",
    "list_nvidia_gpus",
    "read_meminfo",
    "read_boot_id",
    "read_cgroup",
    "is_virtualized",
    "read_online_cpus",
    "read_numa_nodes",
    "read_hugepage_pools",
    "sum_pools",
    "read_host_resources",
]
