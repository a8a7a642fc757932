"""nvidia_discovery alone: `NvidiaDiscovery` scanning the example host (8 x H200) through `FakeNvml`
and a materialised sysfs/proc tree, and what a scan leaves for MIG work and the health watch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.inventory.adapters.base import AdapterError, GpuFacts
from services.inventory.adapters.fakehost import FakeHost, load_host_file
from services.inventory.adapters.nvidia_discovery import NvidiaDiscovery
from services.inventory.adapters.nvidia_nvml import NvmlError
from tests.unit.test_inventory_adapters import H200, FakeNvml, Roots, materialize

PCI = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]
UUID = "GPU-5f1c2a90-0000-4000-8000-00000000000{}".format


@pytest.fixture(scope="module")
def host() -> FakeHost:
    return load_host_file(H200)


@pytest.fixture(scope="module")
def roots(host: FakeHost, tmp_path_factory: pytest.TempPathFactory) -> Roots:
    return materialize(host, tmp_path_factory.mktemp("discovery"))  # only read: shared by the module's tests


def scanner(host: FakeHost, roots: Roots, **kw: object) -> tuple[NvidiaDiscovery, FakeNvml]:
    nvml = FakeNvml(host)
    return NvidiaDiscovery(nvml, sysfs_root=roots.sysfs, proc_root=roots.proc, **kw), nvml  # type: ignore[arg-type]


def test_one_cards_facts(host: FakeHost, roots: Roots) -> None:
    scan, _ = scanner(host, roots)
    gpus = scan.read_capabilities().gpus
    assert [g.pci_address for g in gpus] == PCI
    assert gpus[0] == GpuFacts(
        uuid=UUID(1),
        index=0,
        pci_address="0000:18:00.0",  # NVML's "00000000:18:00.0", canonical
        name="NVIDIA H200",
        memory_bytes=150754820096,
        compute_capability="9.0",
        mig_mode=False,
        numa_node=0,
        iommu_group=20,
    )
    assert (gpus[7].mig_mode, gpus[7].numa_node, gpus[7].iommu_group) == (True, 1, 27)


def test_the_scan_reads_driver_host_and_processes(host: FakeHost, roots: Roots) -> None:
    got = scanner(host, roots)[0].read_capabilities()
    assert (got.driver_version, got.cuda_driver_version, got.boot_id) == (host.driver_version, host.cuda_version, host.boot_id)
    assert [(p.pid, p.gpu_uuid, p.cgroup) for p in got.processes] == sorted((p.pid, p.gpu_uuid, p.cgroup) for p in host.processes)
    assert got.host.cpus == host.cpus


def test_what_a_scan_leaves_for_mig_and_health(host: FakeHost, roots: Roots) -> None:
    scan, nvml = scanner(host, roots)
    assert scan.index_at(PCI[3]) is None  # nothing before the first scan
    scan.read_capabilities()
    assert scan.nvml_index == {UUID(k + 1): k for k in range(8)}
    assert scan.nvml_pci == dict(enumerate(PCI))
    assert scan.mig_mode == {UUID(k + 1): k >= 6 for k in range(8)}
    assert [scan.index_at(p) for p in PCI] == list(range(8))
    assert scan.index_at("0000:99:00.0") is None


def test_a_card_nvml_stops_seeing_keeps_its_place_and_its_facts(host: FakeHost, roots: Roots) -> None:
    """After a switch to vfio-pci NVML's indices shift; positions (PCI order) do not, and the card keeps
    what NVML last said of it, marked unreadable. MIG and health find the others at their new index."""
    scan, nvml = scanner(host, roots)
    before = scan.read_capabilities().gpus
    pci_before = scan.nvml_pci
    nvml.hide(PCI[3])
    after = scan.read_capabilities().gpus
    assert [g.pci_address for g in after] == PCI
    assert after[3] == replace(before[3], readable=False)
    assert after[4].index == 4 and after[4].readable
    assert scan.index_at(PCI[3]) is None
    assert [scan.index_at(p) for p in PCI[4:]] == [3, 4, 5, 6]  # NVML's indices, not positions
    assert UUID(4) not in scan.nvml_index and UUID(4) not in scan.mig_mode
    # replaced whole, never changed in place: the health thread may hold the old map
    assert pci_before == dict(enumerate(PCI)) and scan.nvml_pci is not pci_before
    assert scan.nvml_pci == {k: p for k, p in enumerate(PCI[:3] + PCI[4:])}


def test_a_card_nvml_never_saw_is_named_by_the_known_uuids(host: FakeHost, roots: Roots) -> None:
    nvml = FakeNvml(host)
    nvml.hide(PCI[0])
    scan = NvidiaDiscovery(nvml, sysfs_root=roots.sysfs, proc_root=roots.proc, known_uuids={PCI[0]: UUID(1), "0000:99:00.0": "GPU-elsewhere"})
    first = scan.read_capabilities().gpus[0]
    assert (first.uuid, first.index, first.readable, first.name, first.numa_node) == (UUID(1), 0, False, "", 0)
    # known_uuids: the ones given, and every card the scan identified
    assert scan.known_uuids() == {PCI[0]: UUID(1), "0000:99:00.0": "GPU-elsewhere", **{p: UUID(k + 1) for k, p in enumerate(PCI) if k}}
    unknown = NvidiaDiscovery(nvml, sysfs_root=roots.sysfs, proc_root=roots.proc)
    assert unknown.read_capabilities().gpus[0].uuid == ""
    assert PCI[0] not in unknown.known_uuids()


def test_a_card_nvml_cannot_identify_is_listed_from_sysfs(host: FakeHost, roots: Roots) -> None:
    nvml = FakeNvml(host, lost_uuid_index=1)
    scan = NvidiaDiscovery(nvml, sysfs_root=roots.sysfs, proc_root=roots.proc)
    gpus = scan.read_capabilities().gpus
    assert (gpus[1].pci_address, gpus[1].uuid, gpus[1].readable) == (PCI[1], "", False)
    assert 1 not in scan.nvml_pci and scan.index_at(PCI[1]) is None
    assert len(gpus) == 8


def test_optional_facts_refused_leave_the_card_listed(host: FakeHost, roots: Roots) -> None:
    scan, nvml = scanner(host, roots)

    def refuse(*_: object) -> object:
        raise NvmlError("Not Supported", 3)

    nvml.device_name = refuse  # type: ignore[method-assign]
    nvml.device_compute_capability = refuse  # type: ignore[method-assign]
    nvml.compute_processes = refuse  # type: ignore[method-assign]
    nvml.cuda_driver_version = refuse  # type: ignore[method-assign]
    got = scan.read_capabilities()
    assert all(g.readable and g.uuid and g.name == "" and g.compute_capability == "" for g in got.gpus)
    assert got.gpus[0].memory_bytes == 150754820096
    assert got.processes == () and got.cuda_driver_version == ""


def test_nvml_that_cannot_count_its_cards_is_an_adapter_error(host: FakeHost, roots: Roots) -> None:
    scan, nvml = scanner(host, roots)

    def lost() -> int:
        raise NvmlError("Driver Not Loaded", 9)

    nvml.device_count = lost  # type: ignore[method-assign]
    with pytest.raises(AdapterError, match=r"^NVML: cannot list devices \(Driver Not Loaded\)$"):
        scan.read_capabilities()


def test_a_pci_id_nvml_spells_oddly_is_not_a_card(host: FakeHost, roots: Roots) -> None:
    scan, nvml = scanner(host, roots)
    nvml.device_pci_bus_id = lambda i: "not a bus id" if i == 2 else FakeNvml.device_pci_bus_id(nvml, i)  # type: ignore[method-assign]
    gpus = scan.read_capabilities().gpus
    # still in sysfs, so listed, but as a card NVML did not identify
    assert (gpus[2].pci_address, gpus[2].readable) == (PCI[2], False)
    assert 2 not in scan.nvml_pci
