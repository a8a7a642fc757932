"""The vendor adapter contract suite, and the pure inventory builder.

One set of tests runs on both adapters: `fakehw` reading a copy of
examples/hosts/h200x8.json, and `nvidia` against a fake sysfs/proc/cdi tree
materialised from the same file with NVML replaced behind `NvmlPort` by
`FakeNvml`. Both see the same facts, so both must yield the same inventory
(test_adapters_yield_the_same_inventory).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.inventory.adapters import (
    AdapterError,
    AdapterUnavailable,
    FakeHwAdapter,
    HostFileError,
    MigCapable,
    NvidiaAdapter,
    SharingCapable,
    VendorAdapter,
    VendorSpecError,
    VfioCapable,
    load_adapter,
)
from services.inventory.adapters.base import DomainLister, GpuFacts, HostScan, VendorCdi, read_vendor_cdi
from services.inventory.adapters.fakehost import FakeHost, HostGpuFaults, gpu_instances_of, load_host_file
from services.inventory.adapters.nvidia import unavailable_message
from services.inventory.adapters.nvidia_nvml import (
    NvmlError,
    NvmlGiProfile,
    NvmlGpuInstance,
    NvmlMigDevice,
    NvmlPort,
    NvmlProcess,
    PynvmlNvml,
)
from services.inventory.build import (
    build_inventory,
    derive_phase,
    derive_status,
    gpu_atom_id,
    inventory_content_key,
    mig_atom_id,
    next_revision,
    slot_atom_id,
)
from shared.schemas import INVENTORY_CODEC, Condition, HostResources, Inventory

REPO = Path(__file__).resolve().parents[2]
HOSTS = REPO / "examples" / "hosts"
H200 = HOSTS / "h200x8.json"
CDI_SCHEMA_DIR = REPO.parent / "shared" / "reference" / "cdi-schema"
MIB = 1024 * 1024
NOW = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)
UUID = "GPU-5f1c2a90-0000-4000-8000-00000000000{}".format


# --------------------------------------------------------------------------- FakeNvml


_CI_PROFILE = re.compile(r"^(\d+)c\.(.+)$")


class FakeNvml:
    """NvmlPort over a host description: what NVML would say about that host.

    Cards not on the nvidia driver are invisible, as they are to NVML.
    """

    def __init__(
        self,
        host: FakeHost,
        *,
        init_error: Exception | None = None,
        deny_gpu_instances: bool = False,
        lost_uuid_index: int | None = None,
    ) -> None:
        self.host = host
        self.cards = sorted((g for g in host.gpus if g.driver == "nvidia" and g.present), key=lambda g: g.pci_address)
        self.init_error = init_error
        self.deny_gpu_instances = deny_gpu_instances
        self.lost_uuid_index = lost_uuid_index
        self.inits = 0
        self.shutdowns = 0

    def hide(self, pci: str) -> None:
        """The card left the nvidia driver (e.g. switched to vfio-pci)."""
        self.cards = [g for g in self.cards if g.pci_address != pci]

    def _card(self, index: int) -> Any:
        if not 0 <= index < len(self.cards):
            raise NvmlError("Invalid Argument", 2)
        return self.cards[index]

    def init(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.inits += 1

    def shutdown(self) -> None:
        self.shutdowns += 1

    def driver_version(self) -> str:
        return self.host.driver_version

    def cuda_driver_version(self) -> str:
        if not self.host.cuda_version:
            raise NvmlError("Not Supported", 3)
        return self.host.cuda_version

    def device_count(self) -> int:
        return len(self.cards)

    def device_uuid(self, index: int) -> str:
        if index == self.lost_uuid_index:
            raise NvmlError("GPU is lost", 15)
        return str(self._card(index).uuid)

    def device_name(self, index: int) -> str:
        return str(self._card(index).name)

    def device_memory_total(self, index: int) -> int:
        return int(self._card(index).memory_bytes)

    def device_pci_bus_id(self, index: int) -> str:
        domain, bus, rest = self._card(index).pci_address.split(":")
        return f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}"  # NVML's spelling

    def device_compute_capability(self, index: int) -> tuple[int, int]:
        major, minor = self._card(index).compute_capability.split(".")
        return int(major), int(minor)

    def device_mig_mode(self, index: int) -> bool:
        return bool(self._card(index).mig_mode)

    def gpu_instance_profiles(self, index: int) -> list[NvmlGiProfile]:
        return [
            NvmlGiProfile(
                profile_id=p.profile_id,
                name=f"MIG {p.name}",
                slice_count=p.slices,
                instance_count=p.instances_max,
                memory_mib=p.memory_bytes // MIB,
                multiprocessors=p.multiprocessors,
                copy_engines=p.copy_engines,
                decoders=p.decoders,
                encoders=p.encoders,
                jpeg_engines=p.jpeg_engines,
                ofa_engines=p.ofa_engines,
            )
            for p in self._card(index).mig_profiles
        ]

    def gpu_instance_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        profile = next((p for p in self._card(index).mig_profiles if p.profile_id == profile_id), None)
        if profile is None:
            raise NvmlError("Invalid Argument", 2)
        return [(start, profile.size) for start in profile.placements]

    def _gi_profile(self, card: Any, profile: str) -> Any:
        m = _CI_PROFILE.match(profile)
        base = m.group(2) if m else profile
        return next(p for p in card.mig_profiles if p.name == base)

    def gpu_instances(self, index: int) -> list[NvmlGpuInstance]:
        if self.deny_gpu_instances:
            raise NvmlError("Insufficient Permissions", 4)
        # the GPU instances the host file describes, those with no MIG device too
        return [
            NvmlGpuInstance(gi_id=g.gi, profile_id=self._gi_profile(self._card(index), g.profile).profile_id, start=g.start, size=g.size)
            for g in gpu_instances_of(self._card(index)).values()
        ]

    def mig_devices(self, index: int) -> list[NvmlMigDevice]:
        card = self._card(index)
        out = []
        for k, m in enumerate(sorted(card.mig_instances, key=lambda m: (m.gi, m.ci))):
            gi_slices = self._gi_profile(card, m.profile).slices
            ci = _CI_PROFILE.match(m.profile)
            out.append(
                NvmlMigDevice(
                    index=k,
                    gi_id=m.gi,
                    ci_id=m.ci,
                    uuid=m.uuid,
                    memory_bytes=m.memory_bytes,
                    gi_slice_count=gi_slices,
                    ci_slice_count=int(ci.group(1)) if ci else gi_slices,
                )
            )
        return out

    def compute_processes(self, index: int) -> list[NvmlProcess]:
        uuid = self._card(index).uuid
        return [NvmlProcess(pid=p.pid, gi_id=p.gi, ci_id=p.ci) for p in self.host.processes if p.gpu_uuid == uuid]


def test_fake_nvml_implements_the_port() -> None:
    port: NvmlPort = FakeNvml(load_host_file(H200))
    assert port.device_count() == 8


# --------------------------------------------------------------------------- a fake host tree


@dataclass(frozen=True)
class Roots:
    sysfs: Path
    proc: Path


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def materialize(host: FakeHost, root: Path) -> Roots:
    """The sysfs and procfs a real host with this description would show."""
    sysfs, proc = root / "sys", root / "proc"
    devices = sysfs / "bus" / "pci" / "devices"
    for g in host.gpus:
        if not g.present:
            continue  # dropped off the bus: no sysfs entry
        d = devices / g.pci_address
        _w(d / "vendor", "0x10de\n")
        _w(d / "class", "0x030200\n")
        _w(d / "numa_node", f"{-1 if g.numa_node is None else g.numa_node}\n")
        _w(d / "driver_override", "(null)\n")
        if g.iommu_group is not None:
            # /sys/kernel/iommu_groups/<n>, linked from the device as the kernel does
            group = sysfs / "kernel" / "iommu_groups" / str(g.iommu_group)
            group.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(group, d), d / "iommu_group")
        if g.driver:
            target = sysfs / "bus" / "pci" / "drivers" / g.driver
            target.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(target, d), d / "driver")
    # neighbours that are not GPUs: an NVSwitch and a NIC.
    _w(devices / "0000:05:00.0" / "vendor", "0x10de\n")
    _w(devices / "0000:05:00.0" / "class", "0x068000\n")
    _w(devices / "0000:31:00.0" / "vendor", "0x8086\n")
    _w(devices / "0000:31:00.0" / "class", "0x020000\n")

    sums: dict[int, list[int]] = {}
    for n in host.numa_nodes:
        nd = sysfs / "devices" / "system" / "node" / f"node{n.node}"
        _w(nd / "cpulist", n.cpus + "\n")
        if n.memory_bytes is not None:
            _w(nd / "meminfo", f"Node {n.node} MemTotal:       {n.memory_bytes // 1024} kB\n")
        for p in n.hugepages:
            hp = nd / "hugepages" / f"hugepages-{p.page_size_kib}kB"
            _w(hp / "nr_hugepages", f"{p.total}\n")
            _w(hp / "free_hugepages", f"{p.free}\n")
            s = sums.setdefault(p.page_size_kib, [0, 0])
            s[0] += p.total
            s[1] += p.free
    for size, (total, free) in sums.items():
        hp = sysfs / "kernel" / "mm" / "hugepages" / f"hugepages-{size}kB"
        _w(hp / "nr_hugepages", f"{total}\n")
        _w(hp / "free_hugepages", f"{free}\n")
    _w(sysfs / "devices" / "system" / "cpu" / "online", host.cpus + "\n")

    lines = []
    if host.memory.total_bytes is not None:
        lines.append(f"MemTotal:       {host.memory.total_bytes // 1024} kB")
    lines.append("MemFree:        1024 kB")
    if host.memory.available_bytes is not None:
        lines.append(f"MemAvailable:   {host.memory.available_bytes // 1024} kB")
    if host.memory.total_bytes is not None or host.memory.available_bytes is not None:
        _w(proc / "meminfo", "\n".join(lines) + "\n")
    _w(proc / "sys" / "kernel" / "random" / "boot_id", host.boot_id + "\n")
    flags = "fpu vme de pse tsc msr" + (" hypervisor" if host.virtualized else "")
    _w(proc / "cpuinfo", f"processor\t: 0\nflags\t\t: {flags}\n")
    for proc_ in host.processes:
        _w(proc / str(proc_.pid) / "cgroup", f"0::{proc_.cgroup}\n")
    return Roots(sysfs=sysfs, proc=proc)


def write_vendor_spec(host: FakeHost, cdi_dir: Path) -> None:
    """What nvidia-ctk would have left in cdi_dir on a real host."""
    if host.vendor_cdi_spec is not None:
        cdi_dir.mkdir(parents=True, exist_ok=True)
        (cdi_dir / "nvidia.json").write_bytes(msgspec.json.encode(host.vendor_cdi_spec))


# --------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    kind: str
    adapter: Any
    host: FakeHost
    host_file: Path
    cdi_dir: Path
    nvml: FakeNvml | None = None
    roots: Roots | None = None


Mutate = Callable[[dict[str, Any]], None]

# Materialised trees are only read by the adapter, so tests describing the same
# host share one (a few hundred files each; the suite stays fast on slow disks).
_TREES: dict[str, Roots] = {}
_TREES_DIR: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def _shared_trees(tmp_path_factory: pytest.TempPathFactory) -> Any:
    _TREES.clear()
    _TREES_DIR[:] = [tmp_path_factory.mktemp("trees")]
    yield
    _TREES.clear()


def tree_for(data: dict[str, Any], host: FakeHost, tmp_path: Path, *, private: bool) -> Roots:
    if private:
        return materialize(host, tmp_path / "root")
    # the pipe dir is per test and not part of the tree
    key = json.dumps({k: v for k, v in data.items() if k != "mps_pipe_dir"}, sort_keys=True)
    if key not in _TREES:
        _TREES[key] = materialize(host, _TREES_DIR[0] / f"host{len(_TREES)}")
    return _TREES[key]


def make_rig(
    kind: str,
    tmp_path: Path,
    mutate: Mutate | None = None,
    *,
    vendor_spec: bool = True,
    private_tree: bool = False,
    **nvml_kw: Any,
) -> Rig:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = json.loads(H200.read_text())
    # a pipe dir of this test's own, so neither adapter looks at the real /tmp.
    data["mps_pipe_dir"] = str(tmp_path / "mps")
    if mutate is not None:
        mutate(data)
    host_file = tmp_path / "host.json"
    host_file.write_text(json.dumps(data))
    host = load_host_file(host_file)
    cdi_dir = tmp_path / "cdi"
    if host.mps_running:
        _w(tmp_path / "mps" / "control", "")
    if kind == "fakehw":
        fake = FakeHwAdapter(host_file, cdi_dir=cdi_dir)
        if vendor_spec:
            fake.write_cdi_spec()
        return Rig(kind, fake, host, host_file, cdi_dir)
    roots = tree_for(data, host, tmp_path, private=private_tree)
    if vendor_spec:
        write_vendor_spec(host, cdi_dir)
    nvml = FakeNvml(host, **nvml_kw)
    adapter = NvidiaAdapter(
        nvml=nvml,
        sysfs_root=roots.sysfs,
        proc_root=roots.proc,
        cdi_dir=cdi_dir,
        slots_per_gpu={g.uuid: g.slots for g in host.gpus if g.slots},
        mps_pipe_dir=host.mps_pipe_dir,
        # what the service would have persisted from earlier scans.
        known_uuids={g.pci_address: g.uuid for g in host.gpus},
    )
    return Rig(kind, adapter, host, host_file, cdi_dir, nvml, roots)


@pytest.fixture(params=["fakehw", "nvidia"])
def rig(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Rig]:
    def make(mutate: Mutate | None = None, **kw: Any) -> Rig:
        return make_rig(request.param, tmp_path, mutate, **kw)

    return make


def build(adapter: VendorAdapter, now: datetime = NOW, **kw: Any) -> Inventory:
    return build_inventory(adapter, node_id="gpu-node-1", revision=kw.pop("revision", 1), now=now, **kw)


def set_gpu(position: int, /, **fields: Any) -> Mutate:
    def mutate(data: dict[str, Any]) -> None:
        data["gpus"][position].update(fields)

    return mutate


# --------------------------------------------------------------------------- the contract


EXPECTED_ATOMS = [
    UUID(1),
    UUID(2),
    UUID(3),
    UUID(4),
    UUID(5),
    *(f"{UUID(5)}/slot{k}" for k in range(4)),
    UUID(6),
    *(f"{UUID(6)}/slot{k}" for k in range(4)),
    UUID(7),
    f"{UUID(7)}/gi1/ci0",
    f"{UUID(7)}/gi1/ci1",
    f"{UUID(7)}/gi13/ci0",
    f"{UUID(7)}/gi5/ci0",
    UUID(8),
    f"{UUID(8)}/gi10/ci0",
    f"{UUID(8)}/gi11/ci0",
    f"{UUID(8)}/gi2/ci0",
    f"{UUID(8)}/gi9/ci0",
]


def test_vendor_and_capabilities(rig: Callable[..., Rig]) -> None:
    adapter = rig().adapter
    assert adapter.vendor() == "nvidia"
    for capability in (MigCapable, VfioCapable, SharingCapable):
        assert isinstance(adapter, capability)


def test_atoms_of_every_gpu_mig_instance_and_slot(rig: Callable[..., Rig]) -> None:
    inv = build(rig().adapter)
    assert [a.id for a in inv.atoms] == EXPECTED_ATOMS
    kinds = {a.id: a.kind for a in inv.atoms}
    assert kinds[UUID(1)] == "gpu" and kinds[f"{UUID(7)}/gi1/ci1"] == "mig" and kinds[f"{UUID(5)}/slot3"] == "slot"
    by_id = {a.id: a for a in inv.atoms}
    assert by_id[f"{UUID(8)}/gi9/ci0"].gpu_uuid == UUID(8)
    assert by_id[f"{UUID(8)}/gi9/ci0"].pci_address == "0000:db:00.0"
    # the atom id of a GPU is its NVML uuid, not "GPU-GPU-..."
    assert all(not a.id.startswith("GPU-GPU-") for a in inv.atoms)
    assert [g.atom_id for g in inv.gpus] == [UUID(i) for i in range(1, 9)]


def test_mig_cards_have_instances_and_no_slots(rig: Callable[..., Rig]) -> None:
    r = rig()
    inv = build(r.adapter)
    assert inv.mps_pipe_dir == r.host.mps_pipe_dir
    gpu6, gpu7 = inv.gpus[6], inv.gpus[7]
    assert gpu6.mig_mode and gpu7.mig_mode
    assert gpu6.slots == [] and gpu7.slots == []
    assert [(m.gi, m.ci, m.profile) for m in gpu6.mig_instances] == [
        (1, 0, "1c.3g.71gb"),
        (1, 1, "2c.3g.71gb"),
        (5, 0, "2g.35gb"),
        (13, 0, "1g.18gb"),
    ]
    first = gpu6.mig_instances[0]
    assert first.atom_id == mig_atom_id(UUID(7), 1, 0)
    assert first.uuid == "MIG-7d3e61b0-0006-4001-8000-000000000001"
    assert first.memory_bytes == 71936 * MIB
    assert {p.name: p.profile_id for p in gpu6.mig_profiles} == {
        "7g.141gb": 0,
        "4g.71gb": 5,
        "3g.71gb": 9,
        "2g.35gb": 14,
        "1g.35gb": 15,
        "1g.18gb": 19,
        "1g.18gb+me": 20,
    }
    one_g = next(p for p in gpu6.mig_profiles if p.profile_id == 19)
    assert (one_g.slices, one_g.instances_max, one_g.memory_bytes) == (1, 7, 17920 * MIB)
    # the slot cards are not in MIG mode, and their slots see MPS running
    assert [len(g.slots) for g in inv.gpus] == [0, 0, 0, 0, 4, 4, 0, 0]
    assert [g.mps_running for g in inv.gpus] == [False, False, False, False, True, True, False, False]
    assert inv.gpus[4].slots[2].atom_id == slot_atom_id(UUID(5), 2) and inv.gpus[4].slots[2].index == 2


def test_mps_not_running(rig: Callable[..., Rig]) -> None:
    inv = build(rig(lambda d: d.update(mps_running=False)).adapter)
    assert len(inv.gpus[4].slots) == 4
    assert not any(g.mps_running for g in inv.gpus)


def test_gpu_facts(rig: Callable[..., Rig]) -> None:
    inv = build(rig().adapter)
    assert inv.vendor == "nvidia"
    assert inv.driver_version == "550.127.05"
    g = inv.gpus[3]
    assert (g.index, g.uuid, g.name, g.vendor) == (3, UUID(4), "NVIDIA H200", "nvidia")
    assert g.memory_bytes == 150754820096
    assert g.compute_capability == "9.0"
    assert [x.numa_node for x in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_pci_addresses_are_canonical(rig: Callable[..., Rig]) -> None:
    inv = build(rig().adapter)
    assert [g.pci_address for g in inv.gpus] == [
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:3a:00.0",
        "0000:5d:00.0",
        "0000:9a:00.0",
        "0000:ab:00.0",
        "0000:ba:00.0",
        "0000:db:00.0",
    ]


def test_numa_nodes_hugepages_memory(rig: Callable[..., Rig]) -> None:
    host = build(rig().adapter).host
    assert host.memory_bytes == 2 * 1024**4
    assert host.memory_available_bytes == 1920 * 1024**3
    assert host.cpus == "0-223"
    assert host.virtualized is False
    assert [(n.node, n.cpus, n.memory_bytes) for n in host.numa_nodes] == [
        (0, "0-55,112-167", 1024**4),
        (1, "56-111,168-223", 1024**4),
    ]
    assert [(p.page_size_kib, p.total, p.free) for p in host.numa_nodes[0].hugepages] == [(2048, 4096, 3072), (1048576, 64, 60)]
    assert [(p.page_size_kib, p.total, p.free) for p in host.numa_nodes[1].hugepages] == [(2048, 4096, 4096), (1048576, 64, 64)]
    assert [(p.page_size_kib, p.total, p.free) for p in host.hugepages] == [(2048, 8192, 7168), (1048576, 128, 124)]


def test_unreadable_host_memory_is_none_not_an_error(rig: Callable[..., Rig]) -> None:
    def no_memory(d: dict[str, Any]) -> None:
        d["memory"] = {"total_bytes": None, "available_bytes": None}

    inv = build(rig(no_memory).adapter)
    assert inv.host.memory_bytes is None
    assert inv.host.memory_available_bytes is None
    assert len(inv.gpus) == 8  # the rest of the host is still described


def test_driver_binding_and_base_driver(rig: Callable[..., Rig]) -> None:
    r = rig(set_gpu(2, driver="vfio-pci"))
    assert r.adapter.driver_binding("0000:18:00.0") == ("nvidia", "nvidia")
    assert r.adapter.driver_binding("0000:3a:00.0") == ("vfio-pci", "nvidia")
    inv = build(r.adapter)
    assert [(g.driver, g.base_driver) for g in inv.gpus][1:4] == [
        ("nvidia", "nvidia"),
        ("vfio-pci", "nvidia"),
        ("nvidia", "nvidia"),
    ]


def test_phase_from_driver_binding(rig: Callable[..., Rig]) -> None:
    inv = build(rig(set_gpu(2, driver="vfio-pci")).adapter)
    status = {g.index: g.status for g in inv.gpus}
    assert status[0].phase == "Ready"
    assert status[0].driver_binding.mode == "Compute"
    ready = {c.type: c for c in status[0].conditions}
    assert (ready["AdapterReady"].status, ready["AdapterReady"].reason) == ("True", "AdapterReady")
    assert (ready["Managed"].status, ready["Managed"].reason) == ("Unknown", "Indeterminate")
    assert status[0].driver_binding.management_state == "Unknown"
    assert status[2].phase == "Passthrough"
    assert status[2].driver_binding.mode == "Passthrough"
    # a passthrough card keeps its GPU atom (the VFIO side claims it) but has no slots or MIG atoms
    assert UUID(3) in [a.id for a in inv.atoms]


def test_passthrough_card_with_slots_or_mig_has_only_its_gpu_atom(rig: Callable[..., Rig]) -> None:
    def both(d: dict[str, Any]) -> None:
        d["gpus"][4]["driver"] = "vfio-pci"
        d["gpus"][7]["driver"] = "vfio-pci"

    inv = build(rig(both).adapter)
    ids = [a.id for a in inv.atoms]
    assert UUID(5) in ids and UUID(8) in ids
    assert not any(i.startswith(f"{UUID(5)}/") or i.startswith(f"{UUID(8)}/") for i in ids)
    assert inv.gpus[4].slots == [] and inv.gpus[7].mig_instances == []


def test_card_without_driver_is_initializing(rig: Callable[..., Rig]) -> None:
    inv = build(rig(set_gpu(1, driver="")).adapter)
    gpu = inv.gpus[1]
    assert gpu.driver == "" and gpu.base_driver == "nvidia"
    assert gpu.status.driver_binding.mode == "None"
    assert gpu.status.phase == "Initializing"
    ready = next(c for c in gpu.status.conditions if c.type == "AdapterReady")
    assert (ready.status, ready.reason) == ("False", "NoDriver")


def test_a_card_off_the_bus_is_not_listed(rig: Callable[..., Rig]) -> None:
    def vanish(d: dict[str, Any]) -> None:
        d["gpus"][1]["present"] = False
        # a process the host file still lists on it is gone with it
        d["processes"][0]["gpu_uuid"] = UUID(2)

    r = rig(vanish)
    inv = build(r.adapter)
    assert [g.pci_address for g in inv.gpus] == [g.pci_address for g in r.host.gpus if g.present]
    assert len(inv.gpus) == 7 and "0000:2a:00.0" not in {g.pci_address for g in inv.gpus}
    assert not any(a.gpu_uuid == UUID(2) for a in inv.atoms)
    assert UUID(2) not in {p.gpu_uuid for p in inv.processes}
    assert r.adapter.driver_binding("0000:2a:00.0")[0] == ""  # nothing bound to a card that is not there


def test_vfio_card_on_a_virtualized_host_is_still_passthrough(rig: Callable[..., Rig]) -> None:
    def guest(d: dict[str, Any]) -> None:
        d["virtualized"] = True
        d["gpus"][0]["driver"] = "vfio-pci"

    inv = build(rig(guest).adapter)
    assert inv.host.virtualized is True
    assert inv.gpus[0].status.phase == "Passthrough"


def test_boot_id(rig: Callable[..., Rig]) -> None:
    adapter = rig().adapter
    assert build(adapter).boot_id == "3f0c9a52-6e1d-4b8a-9c47-1d2e5f6a7b80"
    assert adapter.read_capabilities().boot_id == "3f0c9a52-6e1d-4b8a-9c47-1d2e5f6a7b80"


def test_cuda_driver_version_and_card_labels(rig: Callable[..., Rig]) -> None:
    """Both adapters read the CUDA version the driver supports (NVML: nvmlSystemGetCudaDriverVersion)
    for the feature labels, and each card carries the seed's PhysicalGPU labels; unknown reads ""."""
    inv = build(rig().adapter)
    assert inv.cuda_driver_version == "12.4"
    assert inv.gpus[0].labels == {
        "gpu.deckhouse.io/vendor": "nvidia",
        "gpu.deckhouse.io/device": "NVIDIA-H200",
        "gpu.deckhouse.io/node": "gpu-node-1",
        "gpu.deckhouse.io/sharing.mps": "true",
        "gpu.deckhouse.io/sharing.ts": "true",
    }
    assert inv.gpus[6].labels["gpu.deckhouse.io/sharing.ts"] == "false"  # in MIG mode

    def unknown(d: dict[str, Any]) -> None:
        d["cuda_version"] = ""

    assert build(rig(unknown).adapter).cuda_driver_version == ""


def test_processes_with_cgroup(rig: Callable[..., Rig]) -> None:
    inv = build(rig().adapter)
    assert [(p.pid, p.gpu_uuid) for p in inv.processes] == [(48213, UUID(1)), (51877, UUID(5))]
    assert inv.processes[0].cgroup.startswith("/kubepods.slice/kubepods-burstable.slice/")
    assert inv.processes[1].cgroup == "/user.slice/user-1000.slice/session-4.scope"


def test_cdi_edits_when_the_vendor_spec_exists(rig: Callable[..., Rig]) -> None:
    r = rig()
    edits = r.adapter.cdi_edits()
    assert isinstance(edits, VendorCdi)
    assert edits.kind == "nvidia.com/gpu" and edits.cdi_version == "0.5.0"
    assert edits.path == str(r.cdi_dir / "nvidia.json")
    common = [n["path"] for n in edits.container_edits["deviceNodes"]]
    assert "/dev/nvidiactl" in common and "/dev/nvidia-uvm" in common
    assert edits.container_edits["hooks"][0]["path"] == "/usr/bin/nvidia-cdi-hook"
    assert edits.devices["0"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert edits.devices[UUID(1)] == edits.devices["0"]
    assert [n["path"] for n in edits.devices["6:0"]["deviceNodes"]][0] == "/dev/nvidia6"
    assert edits.edits_for("MIG-7d3e61b0-0006-4001-8000-000000000001", "6:0") == edits.devices["6:0"]
    assert edits.edits_for("nope") is None


def test_cdi_edits_none_without_a_vendor_spec(rig: Callable[..., Rig]) -> None:
    assert rig(vendor_spec=False).adapter.cdi_edits() is None


def test_cdi_edits_of_a_broken_vendor_spec_name_the_field(rig: Callable[..., Rig]) -> None:
    r = rig(vendor_spec=False)
    r.cdi_dir.mkdir(parents=True, exist_ok=True)
    (r.cdi_dir / "nvidia.json").write_text('{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"containerEdits": {}}]}')
    with pytest.raises(VendorSpecError, match=r"nvidia\.json: .*`\$\.devices\[0\]`"):
        r.adapter.cdi_edits()


def test_build_is_deterministic_and_the_content_key_ignores_time(rig: Callable[..., Rig]) -> None:
    adapter = rig().adapter
    first = build(adapter)
    again = build(adapter)
    later = build(adapter, now=NOW + timedelta(minutes=5), revision=7)
    assert INVENTORY_CODEC.encode(first) == INVENTORY_CODEC.encode(again)
    assert inventory_content_key(first) == inventory_content_key(again) == inventory_content_key(later)
    assert later.observed_at != first.observed_at
    assert b"observed_at" not in inventory_content_key(first)


def test_inventory_round_trips_through_the_wire_codec(rig: Callable[..., Rig]) -> None:
    inv = build(rig().adapter)
    assert INVENTORY_CODEC.decode(INVENTORY_CODEC.encode(inv)) == inv


def test_adapters_yield_the_same_inventory(tmp_path: Path) -> None:
    fake = make_rig("fakehw", tmp_path / "f")
    nvidia = make_rig("nvidia", tmp_path / "n")
    # the rigs live in different temp dirs; give them the same pipe dir.
    a = msgspec.structs.replace(build(fake.adapter), mps_pipe_dir="")
    b = msgspec.structs.replace(build(nvidia.adapter), mps_pipe_dir="")
    assert inventory_content_key(a) == inventory_content_key(b)


def test_adapters_agree_on_a_passthrough_card_nvidia_saw_before(tmp_path: Path) -> None:
    """NVML loses a card switched to vfio-pci; the adapter keeps what it knew of it."""
    nvidia = make_rig("nvidia", tmp_path / "n", private_tree=True)  # the test rebinds a driver
    build(nvidia.adapter)
    assert nvidia.nvml is not None and nvidia.roots is not None
    nvidia.nvml.hide("0000:5d:00.0")
    link = nvidia.roots.sysfs / "bus/pci/devices/0000:5d:00.0/driver"
    link.unlink()
    (nvidia.roots.sysfs / "bus/pci/drivers/vfio-pci").mkdir(parents=True, exist_ok=True)
    os.symlink("../../../bus/pci/drivers/vfio-pci", link)
    fake = make_rig("fakehw", tmp_path / "f", set_gpu(3, driver="vfio-pci"))
    a = msgspec.structs.replace(build(fake.adapter), mps_pipe_dir="")
    b = msgspec.structs.replace(build(nvidia.adapter), mps_pipe_dir="")
    assert b.gpus[3].status.phase == "Passthrough"
    assert b.gpus[4].index == 4  # NVML renumbered, the inventory did not
    assert inventory_content_key(a) == inventory_content_key(b)


# --------------------------------------------------------------------------- phase table


def cond(type_: str, status: str, reason: str = "") -> Condition:
    return Condition(type=type_, status=status, reason=reason, since=NOW)  # type: ignore[arg-type]


READY = cond("AdapterReady", "True", "AdapterReady")
NOT_READY = cond("AdapterReady", "False", "NoDriver")
BARE_METAL = cond("AdapterReady", "False", "VFIORequiresBareMetal")
RECONF = cond("Reconfiguring", "True", "DisruptionRequired")
RECONF_DONE = cond("Reconfiguring", "False", "Completed")
MANAGED = cond("Managed", "Unknown", "Indeterminate")


@pytest.mark.parametrize(
    ("mode", "conditions", "phase"),
    [
        # row 1: passthrough wins over every condition
        ("Passthrough", [], "Passthrough"),
        ("Passthrough", [NOT_READY], "Passthrough"),
        ("Passthrough", [BARE_METAL, RECONF], "Passthrough"),
        # row 2: a failure reason
        ("Compute", [BARE_METAL], "Failed"),
        ("None", [BARE_METAL, RECONF], "Failed"),
        # row 3: reconfiguring
        ("Compute", [READY, RECONF], "Reconfiguring"),
        ("None", [NOT_READY, RECONF], "Reconfiguring"),
        # row 4: ready
        ("Compute", [READY, MANAGED], "Ready"),
        ("Compute", [READY, RECONF_DONE], "Ready"),
        # row 5: everything else
        ("None", [NOT_READY, MANAGED], "Initializing"),
        ("Compute", [], "Initializing"),
        ("Compute", [cond("AdapterReady", "Unknown")], "Initializing"),
        ("Compute", [NOT_READY], "Initializing"),
        # build.py uses physicalgpu's table: a Reconfiguring reason outside both flows fails closed
        ("Compute", [READY, cond("Reconfiguring", "True", "Something")], "Initializing"),
    ],
)
def test_derive_phase_table(mode: str, conditions: list[Condition], phase: str) -> None:
    assert derive_phase(mode, conditions) == phase  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("driver", "readable", "mode", "phase", "ready", "reason"),
    [
        ("nvidia", True, "Compute", "Ready", "True", "AdapterReady"),
        ("nvidia", False, "Compute", "Initializing", "False", "VendorLibraryCannotRead"),
        ("vfio-pci", True, "Passthrough", "Passthrough", "False", "Passthrough"),
        ("vfio-pci", False, "Passthrough", "Passthrough", "False", "Passthrough"),
        ("", False, "None", "Initializing", "False", "NoDriver"),
        ("nouveau", True, "Compute", "Ready", "True", "AdapterReady"),
    ],
)
def test_derive_status_from_driver(driver: str, readable: bool, mode: str, phase: str, ready: str, reason: str) -> None:
    status = derive_status(driver, now=NOW, readable=readable)
    assert status.driver_binding.driver == driver
    assert status.driver_binding.mode == mode
    assert status.driver_binding.management_state == "Unknown"
    assert status.phase == phase
    c = {x.type: x for x in status.conditions}
    assert (c["AdapterReady"].status, c["AdapterReady"].reason) == (ready, reason)
    assert (c["Managed"].status, c["Managed"].reason) == ("Unknown", "Indeterminate")


def test_condition_since_is_kept_while_nothing_changes(tmp_path: Path) -> None:
    adapter = make_rig("fakehw", tmp_path).adapter
    first = build(adapter)
    later = build(adapter, now=NOW + timedelta(hours=1), previous=first)
    assert all(c.since == NOW for g in later.gpus for c in g.status.conditions)
    changed = derive_status("vfio-pci", now=NOW + timedelta(hours=2), previous=first.gpus[0].status)
    since = {c.type: c.since for c in changed.conditions}
    assert since["AdapterReady"] == NOW + timedelta(hours=2)  # status changed
    assert since["Managed"] == NOW  # unchanged


def test_next_revision(tmp_path: Path) -> None:
    adapter = make_rig("fakehw", tmp_path).adapter
    first = build(adapter, revision=1)
    same = build(adapter, now=NOW + timedelta(seconds=30))
    assert next_revision(None, first) == 1
    assert next_revision(first, same) == 1
    changed = msgspec.structs.replace(same, boot_id="another-boot")
    assert next_revision(first, changed) == 2


def test_gpu_atom_id_never_doubles_the_prefix() -> None:
    assert gpu_atom_id("GPU-5f1c2a90") == "GPU-5f1c2a90"
    assert gpu_atom_id("5f1c2a90") == "GPU-5f1c2a90"
    assert mig_atom_id("GPU-x", 2, 0) == "GPU-x/gi2/ci0"
    assert slot_atom_id("GPU-x", 3) == "GPU-x/slot3"


class MinimalAdapter:
    """Only the three required operations (no MIG, VFIO or sharing)."""

    def __init__(self, scan: HostScan) -> None:
        self.scan = scan

    def vendor(self) -> str:
        return "acme"

    def read_capabilities(self) -> HostScan:
        return self.scan

    def cdi_edits(self) -> VendorCdi | None:
        return None

    def write_cdi_spec(self) -> bool:
        return False

    def close(self) -> None:
        return None


def test_build_with_an_adapter_without_optional_interfaces() -> None:
    scan = HostScan(
        driver_version="1.0",
        gpus=(
            GpuFacts(uuid="GPU-b", index=1, pci_address="0000:02:00.0", mig_mode=True),
            GpuFacts(uuid="GPU-a", index=0, pci_address="0000:01:00.0"),
        ),
        host=HostResources(),
        boot_id="b",
    )
    adapter = MinimalAdapter(scan)
    assert not isinstance(adapter, (MigCapable, VfioCapable, SharingCapable))
    inv = build(adapter)
    assert [a.id for a in inv.atoms] == ["GPU-a", "GPU-b"]
    assert [g.status.phase for g in inv.gpus] == ["Ready", "Ready"]
    assert inv.mps_pipe_dir == "" and inv.host.memory_bytes is None


# --------------------------------------------------------------------------- nvidia specifics


def test_nvidia_init_failure_is_adapter_unavailable(tmp_path: Path) -> None:
    nvml = FakeNvml(load_host_file(H200), init_error=NvmlError("NVML Shared Library Not Found", 12))
    with pytest.raises(AdapterUnavailable) as err:
        NvidiaAdapter(nvml=nvml, sysfs_root=tmp_path, proc_root=tmp_path, cdi_dir=tmp_path)
    assert str(err.value) == (
        "NVML is not available on this host: NVML Shared Library Not Found; "
        "use --adapter fakehw with --fake-host FILE on a machine without NVIDIA GPUs"
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_real_nvml_on_this_machine_is_adapter_unavailable(tmp_path: Path) -> None:
    probe = PynvmlNvml()
    try:
        probe.init()
    except NvmlError:
        pass
    else:
        probe.shutdown()
        pytest.skip("NVML works on this machine; the unavailable path cannot be seen here")
    expected = r"^NVML is not available on this host: .+; use --adapter fakehw with --fake-host FILE"
    with pytest.raises(AdapterUnavailable, match=expected):
        load_adapter("nvidia", sysfs_root=tmp_path, proc_root=tmp_path, cdi_dir=tmp_path)


def test_nvidia_lists_a_card_nvml_cannot_identify_from_sysfs(tmp_path: Path) -> None:
    r = make_rig("nvidia", tmp_path, lost_uuid_index=1)
    inv = build(r.adapter)
    gpu = inv.gpus[1]
    assert (gpu.pci_address, gpu.uuid, gpu.driver) == ("0000:2a:00.0", UUID(2), "nvidia")  # uuid from known_uuids
    assert len(inv.gpus) == 8
    # on its driver but unreadable (GPU lost): not Ready, nothing to place on but the card itself
    assert gpu.status.phase == "Initializing"
    ready = next(c for c in gpu.status.conditions if c.type == "AdapterReady")
    assert (ready.status, ready.reason) == ("False", "VendorLibraryCannotRead")
    assert inv.gpus[0].status.phase == "Ready"


def test_nvidia_passthrough_card_with_unknown_uuid_has_no_atoms(tmp_path: Path) -> None:
    r = make_rig("nvidia", tmp_path, set_gpu(0, driver="vfio-pci"))
    assert r.roots is not None
    # a fresh adapter that never saw the card on the nvidia driver, and no persisted uuids
    adapter = NvidiaAdapter(
        nvml=FakeNvml(r.host), sysfs_root=r.roots.sysfs, proc_root=r.roots.proc, cdi_dir=r.cdi_dir, mps_pipe_dir=str(tmp_path / "mps")
    )
    inv = build(adapter)
    gpu = inv.gpus[0]
    assert (gpu.uuid, gpu.atom_id, gpu.pci_address, gpu.status.phase) == ("", "", "0000:18:00.0", "Passthrough")
    assert all(a.pci_address != "0000:18:00.0" for a in inv.atoms)
    assert INVENTORY_CODEC.decode(INVENTORY_CODEC.encode(inv)) == inv
    assert adapter.known_uuids()["0000:2a:00.0"] == UUID(2)
    assert "0000:18:00.0" not in adapter.known_uuids()


def test_nvidia_scan_failure_is_an_adapter_error(tmp_path: Path) -> None:
    r = make_rig("nvidia", tmp_path)
    assert r.nvml is not None

    def broken() -> int:
        raise NvmlError("GPU is lost", 15)

    r.nvml.device_count = broken  # type: ignore[method-assign]
    with pytest.raises(AdapterError, match="NVML: cannot list devices"):
        r.adapter.read_capabilities()


def test_nvidia_names_mig_profiles_without_gpu_instance_privileges(tmp_path: Path) -> None:
    allowed = build(make_rig("nvidia", tmp_path / "a").adapter)
    denied = build(make_rig("nvidia", tmp_path / "d", deny_gpu_instances=True).adapter)
    assert [(m.atom_id, m.profile) for g in denied.gpus for m in g.mig_instances] == [
        (m.atom_id, m.profile) for g in allowed.gpus for m in g.mig_instances
    ]


def test_nvidia_slots_as_one_count_for_every_card(tmp_path: Path) -> None:
    r = make_rig("nvidia", tmp_path)
    assert r.roots is not None
    adapter = NvidiaAdapter(
        nvml=FakeNvml(r.host),
        sysfs_root=r.roots.sysfs,
        proc_root=r.roots.proc,
        cdi_dir=r.cdi_dir,
        slots_per_gpu=2,
        mps_pipe_dir=str(tmp_path / "none"),
    )
    inv = build(adapter)
    assert [len(g.slots) for g in inv.gpus] == [2, 2, 2, 2, 2, 2, 0, 0]  # none on MIG cards
    assert not any(g.mps_running for g in inv.gpus)  # no control pipe in that dir
    with pytest.raises(ValueError):
        NvidiaAdapter(nvml=FakeNvml(r.host), slots_per_gpu=-1)


def test_nvidia_close_shuts_nvml_down_once(tmp_path: Path) -> None:
    r = make_rig("nvidia", tmp_path)
    assert r.nvml is not None and r.nvml.inits == 1
    r.adapter.close()
    r.adapter.close()
    assert r.nvml.shutdowns == 1


def test_nvidia_does_not_write_the_vendor_spec(tmp_path: Path) -> None:
    r = make_rig("nvidia", tmp_path, vendor_spec=False)
    assert r.adapter.write_cdi_spec() is False
    assert not (r.cdi_dir / "nvidia.json").exists()


def test_unavailable_message_wording() -> None:
    assert unavailable_message("Driver Not Loaded").startswith("NVML is not available on this host: Driver Not Loaded; ")


# --------------------------------------------------------------------------- fakehw specifics


def test_fakehw_writes_the_vendor_spec_atomically(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    adapter = FakeHwAdapter(H200, cdi_dir=cdi)
    assert adapter.cdi_edits() is None
    assert adapter.write_cdi_spec() is True
    path = cdi / "nvidia.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert json.loads(path.read_text()) == json.loads(H200.read_text())["vendor_cdi_spec"]
    assert sorted(os.listdir(cdi)) == ["nvidia.json"]  # no temp file left
    mtime = path.stat().st_mtime_ns
    assert adapter.write_cdi_spec() is True
    assert path.stat().st_mtime_ns == mtime  # unchanged spec, not rewritten
    assert isinstance(read_vendor_cdi(cdi), VendorCdi)


def test_fakehw_without_vendor_spec_writes_nothing(tmp_path: Path) -> None:
    adapter = FakeHwAdapter(HOSTS / "one-gpu.json", cdi_dir=tmp_path / "cdi")
    assert adapter.write_cdi_spec() is False
    assert not (tmp_path / "cdi").exists()
    assert adapter.cdi_edits() is None


def test_fakehw_domains(tmp_path: Path) -> None:
    adapter = FakeHwAdapter(H200, cdi_dir=tmp_path)
    assert isinstance(adapter, DomainLister)
    assert [(d.name, d.gpus) for d in adapter.domains()] == [("build-vm-01", ())]


def test_fakehw_rereads_the_host_file(tmp_path: Path) -> None:
    r = make_rig("fakehw", tmp_path)
    data = json.loads(r.host_file.read_text())
    data["boot_id"] = "after-reboot"
    r.host_file.write_text(json.dumps(data))
    assert build(r.adapter).boot_id == "after-reboot"


def test_fakehw_without_a_boot_id_boots_as_the_real_host(tmp_path: Path) -> None:
    """GPUs described on a real host (the VM suites' guest): the host's own boot id, from /proc,
    for the inventory and for every service that reads the file's (shared.host.read_boot_id)."""
    from shared.host import read_boot_id

    path = tmp_path / "host.json"
    path.write_text(_host_with(_del("boot_id")))
    real = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert real
    assert build(FakeHwAdapter(path, cdi_dir=tmp_path / "cdi")).boot_id == real
    assert read_boot_id(fake_host=path) == real
    path.write_text(_host_with(lambda d: d.update(boot_id="")))
    assert build(FakeHwAdapter(path, cdi_dir=tmp_path / "cdi")).boot_id == real
    # one the file names is still the file's
    path.write_text(_host_with(lambda d: d.update(boot_id="described")))
    assert read_boot_id(fake_host=path) == "described"


def _host_with(mutate: Mutate) -> str:
    data = json.loads(H200.read_text())
    mutate(data)
    return json.dumps(data)


def _del(key: str) -> Mutate:
    return lambda d: d.pop(key)


HOST_FILE_ERRORS: list[tuple[str, str | Mutate, str]] = [
    ("not json", "{not json", "not valid JSON"),
    ("boot id not a string", lambda d: d.update(boot_id=7), "`$.boot_id`"),
    ("wrong type", set_gpu(0, index="zero"), "`$.gpus[0].index`"),
    ("unknown field", set_gpu(0, nmae="typo"), "unknown field `nmae` - at `$.gpus[0]`"),
    ("pci not canonical", set_gpu(1, pci_address="0000:2A:00.0"), "`$.gpus[1].pci_address`"),
    ("gpu uuid", set_gpu(2, uuid="5f1c2a90"), "`$.gpus[2].uuid`"),
    ("duplicate uuid", set_gpu(1, uuid=UUID(1)), "appears twice - at `$.gpus[1].uuid`"),
    ("duplicate index", set_gpu(1, index=0), "appears twice - at `$.gpus[1].index`"),
    ("slots on a MIG card", set_gpu(6, slots=2), "a card in MIG mode has no slots - at `$.gpus[6].slots`"),
    ("MIG instances on a non-MIG card", set_gpu(7, mig_mode=False), "not in MIG mode (mig_mode is false) - at `$.gpus[7].mig_instances`"),
    ("unknown numa node", set_gpu(0, numa_node=5), "NUMA node 5 is not in numa_nodes - at `$.gpus[0].numa_node`"),
    ("bad cpulist", lambda d: d.update(cpus="all"), "`$.cpus`"),
    ("negative memory", lambda d: d["memory"].update(total_bytes=-1), "`$.memory.total_bytes`"),
    ("process on an unknown GPU", lambda d: d["processes"][1].update(gpu_uuid=UUID(9)), "is not a GPU of this host - at `$.processes[1].gpu_uuid`"),
    ("free > total", lambda d: d["numa_nodes"][0]["hugepages"][1].update(free=65), "at `$.numa_nodes[0].hugepages[1].free`"),
    ("duplicate MIG instance", lambda d: d["gpus"][7]["mig_instances"][2].update(gi=9), "at `$.gpus[7].mig_instances[2]`"),
    ("vendor spec without kind", lambda d: d["vendor_cdi_spec"].pop("kind"), "missing required field `kind` - at `$.vendor_cdi_spec`"),
    ("vendor spec device name", lambda d: d["vendor_cdi_spec"]["devices"][3].pop("name"), "at `$.vendor_cdi_spec.devices[3]`"),
    ("domain with an unknown GPU", lambda d: d["domains"][0].update(gpus=["0000:77:00.0"]), "at `$.domains[0].gpus[0]`"),
    ("relative pipe dir", lambda d: d.update(mps_pipe_dir="tmp/mps"), "`$.mps_pipe_dir`"),
    ("unknown unbind fault", set_gpu(0, faults={"unbind": "explode"}), "`$.gpus[0].faults.unbind`"),
    ("unknown vanish point", set_gpu(0, faults={"vanish_at": "remove"}), "`$.gpus[0].faults.vanish_at`"),
    ("unknown reset fault", set_gpu(0, faults={"reset": "explode"}), "`$.gpus[0].faults.reset`"),
    ("unknown diag result", set_gpu(0, diag="maybe"), "`$.gpus[0].diag`"),
    ("diag too slow", set_gpu(0, diag_seconds=601), "`$.gpus[0].diag_seconds`"),
    ("unknown fault", set_gpu(0, faults={"melt": True}), "unknown field `melt` - at `$.gpus[0].faults`"),
    ("present not a bool", set_gpu(0, present="no"), "`$.gpus[0].present`"),
    ("bad driver_override", set_gpu(0, driver_override="vfio pci"), "`$.gpus[0].driver_override`"),
    ("bad pci class", lambda d: d.update(pci_devices=[{"pci_address": "0000:31:00.0", "pci_class": "nic"}]), "`$.pci_devices[0].pci_class`"),
    (
        "duplicate pci device",
        lambda d: d.update(pci_devices=[{"pci_address": "0000:31:00.0"}, {"pci_address": "0000:31:00.0"}]),
        "appears twice - at `$.pci_devices[1].pci_address`",
    ),
    (
        "pci device that is a GPU",
        lambda d: d.update(pci_devices=[{"pci_address": "0000:31:00.0"}, {"pci_address": "0000:18:00.0"}]),
        "is a GPU of this host (gpus[]) - at `$.pci_devices[1].pci_address`",
    ),
]


@pytest.mark.parametrize(("case", "change", "message"), HOST_FILE_ERRORS, ids=[c[0] for c in HOST_FILE_ERRORS])
def test_fakehw_host_file_errors_name_the_field(tmp_path: Path, case: str, change: str | Mutate, message: str) -> None:
    path = tmp_path / "host.json"
    path.write_text(change if isinstance(change, str) else _host_with(change))
    with pytest.raises(HostFileError) as err:
        FakeHwAdapter(path, cdi_dir=tmp_path)
    assert str(err.value).startswith(f"fake host file {path}: ")
    assert message in str(err.value)


def test_fakehw_decodes_the_vfio_fields(tmp_path: Path) -> None:
    def vfio(d: dict[str, Any]) -> None:
        d["gpus"][0].update(
            driver="",
            driver_override="vfio-pci",
            faults={"unbind": "hang-unbound", "fail_bind": ["nvidia"], "vanish_at": "drivers_probe"},
        )
        d["gpus"][1].update(present=True)
        d["pci_devices"] = [
            {"pci_address": "0000:31:00.0", "pci_class": "0x020000", "driver": "mlx5_core"},
            {"pci_address": "0000:05:00.0", "pci_class": "0x068000"},
        ]

    path = tmp_path / "host.json"
    path.write_text(_host_with(vfio))
    host = load_host_file(path)
    g = host.gpus[0]
    assert (g.driver, g.driver_override, g.present) == ("", "vfio-pci", True)
    assert (g.faults.unbind, g.faults.fail_bind, g.faults.vanish_at) == ("hang-unbound", ["nvidia"], "drivers_probe")
    assert host.gpus[2].faults == HostGpuFaults() and host.gpus[2].driver_override == ""
    assert [(d.pci_address, d.pci_class, d.driver) for d in host.pci_devices] == [
        ("0000:31:00.0", "0x020000", "mlx5_core"),
        ("0000:05:00.0", "0x068000", ""),
    ]
    inv = build(FakeHwAdapter(path, cdi_dir=tmp_path / "cdi"))
    # driver "" is mode None; other PCI devices are not GPUs and are not listed
    assert inv.gpus[0].status.driver_binding.mode == "None" and inv.gpus[0].status.phase == "Initializing"
    assert len(inv.gpus) == 8


def test_fakehw_missing_host_file(tmp_path: Path) -> None:
    with pytest.raises(HostFileError, match="cannot read"):
        load_adapter("fakehw", fake_host=tmp_path / "nope.json", cdi_dir=tmp_path)


def test_load_adapter_options(tmp_path: Path) -> None:
    adapter = load_adapter("fakehw", fake_host=H200, cdi_dir=tmp_path, sysfs_root="/ignored", slots_per_gpu=3)
    assert isinstance(adapter, FakeHwAdapter)
    with pytest.raises(AdapterUnavailable, match="--fake-host FILE"):
        load_adapter("fakehw", cdi_dir=tmp_path)
    with pytest.raises(AdapterUnavailable, match="unknown adapter 'amd'"):
        load_adapter("amd")
    with pytest.raises(TypeError, match="frobnicate"):
        load_adapter("fakehw", fake_host=H200, cdi_dir=tmp_path, frobnicate=1)
    nvml = FakeNvml(load_host_file(H200))
    assert isinstance(load_adapter("nvidia", nvml=nvml, fake_host=None, cdi_dir=tmp_path), NvidiaAdapter)


# --------------------------------------------------------------------------- the example hosts


@pytest.mark.parametrize("name", ["h200x8", "one-gpu", "virtualized"])
def test_example_hosts_build(tmp_path: Path, name: str) -> None:
    adapter = FakeHwAdapter(HOSTS / f"{name}.json", cdi_dir=tmp_path)
    inv = build(adapter)
    assert INVENTORY_CODEC.decode(INVENTORY_CODEC.encode(inv)) == inv
    assert all(g.status.phase == "Ready" for g in inv.gpus)
    if name == "virtualized":
        assert inv.host.virtualized is True and len(inv.gpus) == 2 and len(inv.host.numa_nodes) == 1
    if name == "one-gpu":
        assert [a.id for a in inv.atoms] == [inv.gpus[0].uuid] and not adapter.write_cdi_spec()


@pytest.mark.parametrize("name", ["h200x8", "virtualized"])
def test_example_vendor_specs_are_valid_cdi(name: str) -> None:
    if not (CDI_SCHEMA_DIR / "schema.json").exists():
        pytest.skip(f"CDI schema not found at {CDI_SCHEMA_DIR}")
    jsonschema = pytest.importorskip("jsonschema")
    referencing = pytest.importorskip("referencing")
    pytest.importorskip("referencing.jsonschema")
    schema = json.loads((CDI_SCHEMA_DIR / "schema.json").read_text())
    defs = json.loads((CDI_SCHEMA_DIR / "defs.json").read_text())
    registry = referencing.Registry().with_resource("defs.json", referencing.jsonschema.DRAFT7.create_resource(defs))
    spec = json.loads((HOSTS / f"{name}.json").read_text())["vendor_cdi_spec"]
    jsonschema.Draft7Validator(schema, registry=registry).validate(spec)
    names = [d["name"] for d in spec["devices"]]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?", n) for n in names)


def test_fakehw_real_sysfs_card_reads_its_driver_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host-file card marked real_sysfs (the VM tests' emulated display) reports the driver the
    kernel bound, as the real sysfs switcher leaves it, not the file's `driver`."""
    from services.inventory.adapters import fakehw

    data = json.loads(H200.read_text())
    data["mps_pipe_dir"] = str(tmp_path / "mps")
    pci = data["gpus"][0]["pci_address"]
    data["gpus"][0].update(real_sysfs=True, driver="nvidia", base_driver="bochs-drm")
    host_file = tmp_path / "host.json"
    host_file.write_text(json.dumps(data))
    devices = tmp_path / "sys" / "bus" / "pci" / "devices"
    (devices / pci).mkdir(parents=True)
    (tmp_path / "sys" / "bus" / "pci" / "drivers" / "vfio-pci").mkdir(parents=True)
    monkeypatch.setattr(fakehw, "SYSFS_PCI_DEVICES", devices)
    adapter = FakeHwAdapter(host_file, cdi_dir=tmp_path / "cdi")
    assert adapter.driver_binding(pci) == ("", "bochs-drm")  # nothing bound
    (devices / pci / "driver").symlink_to("../../../bus/pci/drivers/vfio-pci")
    assert adapter.driver_binding(pci) == ("vfio-pci", "bochs-drm")
    # the other cards still read the file
    assert adapter.driver_binding(data["gpus"][1]["pci_address"]) == ("nvidia", "nvidia")


def test_iommu_groups_are_read_from_the_device_link(rig: Callable[..., Rig]) -> None:
    """A card passed through to a DRA claim is /dev/vfio/<group>: both adapters read the group
    (nvidia from the sysfs `iommu_group` link, fakehw from the host file); none without an IOMMU."""
    assert [g.iommu_group for g in build(rig().adapter).gpus] == list(range(20, 28))
    assert [g.iommu_group for g in build(rig(set_gpu(2, iommu_group=None)).adapter).gpus][2] is None
