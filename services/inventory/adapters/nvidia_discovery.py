"""Discovery on an NVIDIA host: one scan (`read_capabilities`) of NVML for the cards and of sysfs/procfs
for the rest, and what the scan leaves for the other parts of the adapter.

NVML's one fact that shapes the scan: a card bound to vfio-pci (or to no driver) is invisible to
NVML, and NVML's indices of the remaining cards shift. The scan therefore also lists NVIDIA display
devices from sysfs, and numbers every card by its position in PCI order among all of them: NVML's own
order when every card is on the nvidia driver, and stable across a passthrough switch. A card seen
only in sysfs keeps the facts of its last NVML sighting (or the uuid from `known_uuids`, which the
service may persist).

What a scan leaves (`last`, `nvml_index`, `mig_mode`, `nvml_pci`) is how MIG work and the health
watch find a card's NVML index; each map but `last` is replaced whole by the next scan, never changed
in place, so the health thread reads them without a lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from shared.schemas import RunningProcess

from .. import hostfs
from .base import AdapterError, GpuFacts, HostScan
from .nvidia_nvml import NVML_ERRORS, NvmlPort, try_list, try_value


class NvidiaDiscovery:
    """The scan of an NVIDIA host, and the facts of the last one."""

    def __init__(self, nvml: NvmlPort, *, sysfs_root: Path, proc_root: Path, known_uuids: Mapping[str, str] | None = None) -> None:
        self.nvml = nvml
        self.sysfs_root = sysfs_root
        self.proc_root = proc_root
        self._known_uuids = dict(known_uuids or {})
        #: last facts per PCI address, for cards NVML stops seeing (passthrough).
        self.last: dict[str, GpuFacts] = {}
        #: uuid -> NVML index, of the cards NVML saw in the last scan.
        self.nvml_index: dict[str, int] = {}
        #: uuid -> MIG mode, of the cards NVML saw in the last scan.
        self.mig_mode: dict[str, bool] = {}
        #: NVML index -> PCI address of the last scan: the health watch names a card by it when NVML
        #: no longer reads its PCI info.
        self.nvml_pci: dict[int, str] = {}

    def index_at(self, pci_address: str) -> int | None:
        """The NVML index of the card the last scan saw at that address; None when NVML did not see it."""
        facts = self.last.get(pci_address)
        return self.nvml_index.get(facts.uuid) if facts is not None else None

    def known_uuids(self) -> dict[str, str]:
        """PCI address -> GPU uuid of every card this adapter has identified (for the service to persist)."""
        out = dict(self._known_uuids)
        out.update({pci: f.uuid for pci, f in self.last.items() if f.uuid})
        return out

    def _cc(self, index: int) -> str:
        major, minor = self.nvml.device_compute_capability(index)
        return f"{major}.{minor}"

    def read_capabilities(self) -> HostScan:
        try:
            driver_version = self.nvml.driver_version()
            count = self.nvml.device_count()
        except NVML_ERRORS as exc:
            raise AdapterError(f"NVML: cannot list devices ({exc})") from None

        seen: dict[str, GpuFacts] = {}
        nvml_index: dict[str, int] = {}
        nvml_pci: dict[int, str] = {}
        for i in range(count):
            try:
                uuid = self.nvml.device_uuid(i)
                pci = hostfs.normalize_pci(self.nvml.device_pci_bus_id(i))
            except (*NVML_ERRORS, ValueError):
                # a card NVML cannot identify is still on the PCI bus; the sysfs
                # pass below lists it with what is remembered.
                continue
            seen[pci] = GpuFacts(
                uuid=uuid,
                index=i,
                pci_address=pci,
                name=try_value(lambda: self.nvml.device_name(i), ""),
                memory_bytes=try_value(lambda: self.nvml.device_memory_total(i), 0),
                compute_capability=try_value(lambda: self._cc(i), ""),
                mig_mode=try_value(lambda: self.nvml.device_mig_mode(i), False),
            )
            nvml_index[uuid] = i
            nvml_pci[i] = pci

        for pci in hostfs.list_nvidia_gpus(self.sysfs_root):
            if pci in seen:
                continue
            last = self.last.get(pci)
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
        self.last.update({g.pci_address: g for g in gpus if g.readable})
        self.nvml_index = nvml_index
        self.nvml_pci = nvml_pci
        self.mig_mode = {g.uuid: g.mig_mode for g in gpus if g.uuid in nvml_index}

        processes: dict[tuple[int, str], RunningProcess] = {}
        for uuid, i in nvml_index.items():
            for p in try_list(lambda: self.nvml.compute_processes(i)):
                processes[(p.pid, uuid)] = RunningProcess(
                    pid=p.pid, gpu_uuid=uuid, cgroup=hostfs.read_cgroup(self.proc_root, p.pid)
                )

        return HostScan(
            driver_version=driver_version,
            cuda_driver_version=try_value(self.nvml.cuda_driver_version, ""),
            gpus=tuple(gpus),
            host=hostfs.read_host_resources(self.sysfs_root, self.proc_root),
            boot_id=hostfs.read_boot_id(self.proc_root),
            processes=tuple(processes[k] for k in sorted(processes)),
        )


__all__ = ["NvidiaDiscovery"]
