"""hostfs: the sysfs/procfs readers, against fake trees, including bad and missing files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.inventory import hostfs
from shared.schemas import HugePagePool, NumaNode


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def pci_dev(sysfs: Path, pci: str, *, vendor: str = "0x10de", cls: str = "0x030200", numa: str | None = "0", driver: str | None = "nvidia") -> Path:
    d = sysfs / "bus" / "pci" / "devices" / pci
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(cls + "\n")
    if numa is not None:
        (d / "numa_node").write_text(numa + "\n")
    if driver is not None:
        target = sysfs / "bus" / "pci" / "drivers" / driver
        target.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(target, d), d / "driver")
    return d


# --------------------------------------------------------------------------- PCI


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),  # NVML
        ("0000:3b:00.0", "0000:3b:00.0"),  # sysfs
        ("3b:00.0", "0000:3b:00.0"),  # lspci without domain
        ("0001:AB:1f.7", "0001:ab:1f.7"),
        ("  0000:18:00.0\n", "0000:18:00.0"),
    ],
)
def test_normalize_pci(raw: str, canonical: str) -> None:
    assert hostfs.normalize_pci(raw) == canonical


@pytest.mark.parametrize("raw", ["", "zz", "0000:3b:00.8", "0000:3b:0.0", "10000:00:00.0", "0000:3b:00.0/extra", "GPU-1"])
def test_normalize_pci_refuses(raw: str) -> None:
    with pytest.raises(ValueError):
        hostfs.normalize_pci(raw)


def test_pci_device_facts(tmp_path: Path) -> None:
    pci_dev(tmp_path, "0000:18:00.0", numa="1", driver="nvidia")
    d = pci_dev(tmp_path, "0000:2a:00.0", numa="-1", driver="vfio-pci")
    (d / "driver_override").write_text("vfio-pci\n")
    d = pci_dev(tmp_path, "0000:3a:00.0", numa="garbage", driver=None)
    (d / "driver_override").write_text("(null)\n")

    assert hostfs.read_numa_node(tmp_path, "0000:18:00.0") == 1
    assert hostfs.read_numa_node(tmp_path, "0000:2a:00.0") is None  # -1: one-node host
    assert hostfs.read_numa_node(tmp_path, "0000:3a:00.0") is None  # garbage
    assert hostfs.read_numa_node(tmp_path, "0000:ff:00.0") is None  # missing device

    assert hostfs.read_bound_driver(tmp_path, "0000:18:00.0") == "nvidia"
    assert hostfs.read_bound_driver(tmp_path, "0000:2a:00.0") == "vfio-pci"
    assert hostfs.read_bound_driver(tmp_path, "0000:3a:00.0") == ""
    assert hostfs.read_bound_driver(tmp_path, "0000:ff:00.0") == ""

    assert hostfs.read_driver_override(tmp_path, "0000:2a:00.0") == "vfio-pci"
    assert hostfs.read_driver_override(tmp_path, "0000:3a:00.0") == ""
    assert hostfs.read_driver_override(tmp_path, "0000:18:00.0") == ""  # file missing


def test_list_nvidia_gpus_filters_vendor_and_class(tmp_path: Path) -> None:
    pci_dev(tmp_path, "0000:db:00.0")
    pci_dev(tmp_path, "0000:18:00.0", cls="0x030000")  # VGA class
    pci_dev(tmp_path, "0000:18:00.1", cls="0x040300")  # the card's HDMI audio function
    pci_dev(tmp_path, "0000:05:00.0", cls="0x068000")  # NVSwitch
    pci_dev(tmp_path, "0000:31:00.0", vendor="0x8086", cls="0x020000")  # a NIC
    (tmp_path / "bus" / "pci" / "devices" / "not-a-device").mkdir()
    assert hostfs.list_nvidia_gpus(tmp_path) == ["0000:18:00.0", "0000:db:00.0"]
    assert len(hostfs.list_pci_devices(tmp_path)) == 5
    assert hostfs.list_nvidia_gpus(tmp_path / "missing") == []


# --------------------------------------------------------------------------- /proc


MEMINFO = """MemTotal:       2147483648 kB
MemFree:        1900000000 kB
MemAvailable:   2013265920 kB
HugePages_Total:    8192
HugePages_Free:     7168
Hugepagesize:       2048 kB
garbage line
Broken:        notanumber kB
"""


def test_read_meminfo(tmp_path: Path) -> None:
    write(tmp_path / "meminfo", MEMINFO)
    info = hostfs.read_meminfo(tmp_path)
    assert info["MemTotal"] == 2147483648 * 1024
    assert info["MemAvailable"] == 2013265920 * 1024
    assert info["HugePages_Total"] == 8192  # a count, not bytes
    assert info["Hugepagesize"] == 2048 * 1024
    assert "Broken" not in info
    assert hostfs.read_meminfo(tmp_path / "missing") == {}


def test_read_boot_id(tmp_path: Path) -> None:
    assert hostfs.read_boot_id(tmp_path) == ""
    write(tmp_path / "sys/kernel/random/boot_id", "3f0c9a52-6e1d-4b8a-9c47-1d2e5f6a7b80\n")
    assert hostfs.read_boot_id(tmp_path) == "3f0c9a52-6e1d-4b8a-9c47-1d2e5f6a7b80"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("0::/kubepods.slice/pod1.slice/cri-containerd-ab.scope\n", "/kubepods.slice/pod1.slice/cri-containerd-ab.scope"),
        ("12:memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/system.slice/x.service\n", "/system.slice/x.service"),
        ("12:memory:/docker/abc\n1:name=systemd:/docker/abc\n", "/docker/abc"),
        ("nonsense\n", ""),
        (b"\xff\xfe\x00", ""),
    ],
)
def test_read_cgroup(tmp_path: Path, content: str | bytes, expected: str) -> None:
    write(tmp_path / "4242" / "cgroup", content)
    assert hostfs.read_cgroup(tmp_path, 4242) == expected


def test_read_cgroup_of_a_gone_process(tmp_path: Path) -> None:
    assert hostfs.read_cgroup(tmp_path, 99999) == ""


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [
        ("processor\t: 0\nflags\t\t: fpu vme de pse hypervisor lahf_lm\n", True),
        ("processor\t: 0\nflags\t\t: fpu vme de pse lahf_lm\n", False),
        ("processor\t: 0\nmodel name\t: hypervisor-themed CPU\n", False),  # only the flags line counts
        (None, False),
    ],
)
def test_is_virtualized(tmp_path: Path, cpuinfo: str | None, expected: bool) -> None:
    if cpuinfo is not None:
        write(tmp_path / "cpuinfo", cpuinfo)
    assert hostfs.is_virtualized(tmp_path) is expected


# --------------------------------------------------------------------------- CPUs, NUMA, huge pages


def numa_tree(sysfs: Path) -> None:
    node = sysfs / "devices/system/node"
    write(node / "node0/cpulist", "0-55,112-167\n")
    write(node / "node0/meminfo", "Node 0 MemTotal:       1073741824 kB\nNode 0 MemFree:        1000 kB\n")
    write(node / "node0/hugepages/hugepages-2048kB/nr_hugepages", "4096\n")
    write(node / "node0/hugepages/hugepages-2048kB/free_hugepages", "3072\n")
    write(node / "node0/hugepages/hugepages-1048576kB/nr_hugepages", "64\n")
    write(node / "node0/hugepages/hugepages-1048576kB/free_hugepages", "60\n")
    # a memory-only node (CXL): empty cpulist.
    write(node / "node1/cpulist", "\n")
    write(node / "node1/meminfo", "Node 1 MemTotal:       1048576 kB\n")
    write(node / "node1/hugepages/hugepages-2048kB/nr_hugepages", "garbage\n")
    write(node / "node1/hugepages/hugepages-2048kB/free_hugepages", "0\n")
    write(node / "possible", "0-1\n")  # a file next to the node dirs
    (node / "node_x").mkdir()


def test_read_numa_nodes(tmp_path: Path) -> None:
    numa_tree(tmp_path)
    assert hostfs.read_numa_nodes(tmp_path) == [
        NumaNode(
            node=0,
            cpus="0-55,112-167",
            memory_bytes=1073741824 * 1024,
            hugepages=[
                HugePagePool(page_size_kib=2048, total=4096, free=3072),
                HugePagePool(page_size_kib=1048576, total=64, free=60),
            ],
        ),
        NumaNode(node=1, cpus="", memory_bytes=1048576 * 1024, hugepages=[]),
    ]
    assert hostfs.read_numa_nodes(tmp_path / "missing") == []


def test_online_cpus(tmp_path: Path) -> None:
    assert hostfs.read_online_cpus(tmp_path) == ""
    write(tmp_path / "devices/system/cpu/online", "0-223\n")
    assert hostfs.read_online_cpus(tmp_path) == "0-223"
    write(tmp_path / "devices/system/cpu/online", "zero to many\n")
    assert hostfs.read_online_cpus(tmp_path) == ""


def test_host_resources_full(tmp_path: Path) -> None:
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    numa_tree(sysfs)
    write(sysfs / "devices/system/cpu/online", "0-223\n")
    write(sysfs / "kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "8192\n")
    write(sysfs / "kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "7168\n")
    write(proc / "meminfo", MEMINFO)
    write(proc / "cpuinfo", "flags\t: fpu\n")
    host = hostfs.read_host_resources(sysfs, proc)
    assert host.memory_bytes == 2147483648 * 1024
    assert host.memory_available_bytes == 2013265920 * 1024
    assert host.cpus == "0-223"
    assert [n.node for n in host.numa_nodes] == [0, 1]
    # the host-wide sysfs pools win over the node sum
    assert host.hugepages == [HugePagePool(page_size_kib=2048, total=8192, free=7168)]
    assert host.virtualized is False


def test_host_hugepages_fall_back_to_node_sum_then_meminfo(tmp_path: Path) -> None:
    sysfs, proc = tmp_path / "sys", tmp_path / "proc"
    numa_tree(sysfs)
    write(proc / "meminfo", MEMINFO)
    assert hostfs.read_host_resources(sysfs, proc).hugepages == [
        HugePagePool(page_size_kib=2048, total=4096, free=3072),
        HugePagePool(page_size_kib=1048576, total=64, free=60),
    ]
    bare = tmp_path / "bare-sys"
    bare.mkdir()
    assert hostfs.read_host_resources(bare, proc).hugepages == [HugePagePool(page_size_kib=2048, total=8192, free=7168)]


@pytest.mark.parametrize("meminfo", [None, b"\xff\xfe garbage", "MemFree: 12 kB\n", "MemTotal: -5 kB\n"])
def test_unreadable_host_memory_is_none(tmp_path: Path, meminfo: str | bytes | None) -> None:
    if meminfo is not None:
        write(tmp_path / "proc" / "meminfo", meminfo)
    host = hostfs.read_host_resources(tmp_path / "sys", tmp_path / "proc")
    assert host.memory_bytes is None
    assert host.memory_available_bytes is None
    assert host.numa_nodes == [] and host.hugepages == [] and host.cpus == ""
