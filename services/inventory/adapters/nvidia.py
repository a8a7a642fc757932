"""The `nvidia` adapter: NVML (through nvidia-ml-py) for the cards, sysfs/procfs for the rest.

`NvidiaAdapter` is the one object the inventory holds; it implements every port of base.py the
host supports and hands each job to the module that owns it, all sharing one NVML port and one
scan:

- `nvidia_nvml`: NVML behind a port (`NvmlPort`, its value types, `PynvmlNvml` on the library) and
  the failure helpers every part shares (`NvmlError`, `NVML_ERRORS`, `nvml_code`, `try_value`).
- `nvidia_discovery`: the scan (`VendorAdapter.read_capabilities`): cards by NVML and sysfs, PCI
  order, cards NVML cannot see, processes and their cgroups, host resources; and what it leaves
  for the others (the NVML index of each card, its MIG mode, the last facts of each card).
- `nvidia_mig`: `MigCapable` (profiles, placements, instances), `MigInstancer` (GPU and compute
  instances made and destroyed one step at a placement) and `MigPartitioner` (whole layouts).
- `nvidia_health`: `HealthWatcher` (NVML's event set, the health reads, the three-way sort of NVML's
  failures).
- `nvidia_sharing`: `GpuSharer` (MPS control daemons, time slices) with NVIDIA's command-line tools.
- `dcgm`: `Diagnosable` (`dcgmi diag`).
This module keeps what is only wiring: `VfioCapable` (the bound driver, from sysfs),
`SharingCapable` (slots per card, the MPS pipe directory), the CDI spec (nvidia-ctk's, read only),
and the adapter's life (NVML initialised once, shut down once, after the health watch).

NVML sits behind the port, so all of this runs in tests against a fake port (`FakeNvml`) and a fake
sysfs/proc tree; every file read takes a root (sysfs_root, proc_root, cdi_dir).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from shared.schemas import MigProfile, MpsDaemonSpec

from .. import hostfs
from .base import (
    VENDOR_CDI_FILE,
    AdapterUnavailable,
    DiagResult,
    GpuInstanceFacts,
    HealthCheck,
    HealthEvent,
    HostScan,
    MigInstanceFacts,
    MigLayoutResult,
    VendorCdi,
    read_vendor_cdi,
)
from .nvidia_discovery import NvidiaDiscovery
from .nvidia_health import NvidiaHealth
from .nvidia_mig import NvidiaMig
from .nvidia_nvml import NVML_ERRORS, NvmlPort, PynvmlNvml
from .nvidia_sharing import NvidiaSharing

NATIVE_DRIVER = "nvidia"


def unavailable_message(reason: str) -> str:
    return (
        f"NVML is not available on this host: {reason}; "
        "use --adapter fakehw with --fake-host FILE on a machine without NVIDIA GPUs"
    )


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
        #: MPS daemons and time slices, with nvidia-cuda-mps-control and nvidia-smi
        self.sharing = sharing if sharing is not None else NvidiaSharing()
        #: the scan, and what the last one saw (MIG and health find their cards by it)
        self.discovery = NvidiaDiscovery(self.nvml, sysfs_root=self.sysfs_root, proc_root=self.proc_root, known_uuids=known_uuids)
        self.mig = NvidiaMig(self.nvml, self.discovery)
        self.health = NvidiaHealth(self.nvml, self.discovery)
        self._closed = False
        try:
            self.nvml.init()
        except NVML_ERRORS as exc:
            raise AdapterUnavailable(unavailable_message(str(exc) or type(exc).__name__)) from None

    # ----------------------------------------------------------------- required (nvidia_discovery)

    def vendor(self) -> str:
        return "nvidia"

    def read_capabilities(self) -> HostScan:
        return self.discovery.read_capabilities()

    def known_uuids(self) -> dict[str, str]:
        """PCI address -> GPU uuid of every card this adapter has identified (for the service to persist)."""
        return self.discovery.known_uuids()

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
        self.health.close()
        try:
            self.nvml.shutdown()
        except NVML_ERRORS:
            pass

    # ----------------------------------------------------------------- MigCapable (nvidia_mig)

    def mig_profiles(self, gpu_uuid: str) -> list[MigProfile]:
        return self.mig.mig_profiles(gpu_uuid)

    def mig_instances(self, gpu_uuid: str) -> list[MigInstanceFacts]:
        return self.mig.mig_instances(gpu_uuid)

    # ----------------------------------------------------------------- MigInstancer (nvidia_mig)

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceFacts]:
        return self.mig.gpu_instances(gpu_uuid)

    def create_gpu_instance(self, pci_address: str, profile: str, start: int) -> int:
        return self.mig.create_gpu_instance(pci_address, profile, start)

    def create_compute_instance(self, pci_address: str, gi: int) -> MigInstanceFacts:
        return self.mig.create_compute_instance(pci_address, gi)

    def destroy_compute_instance(self, pci_address: str, gi: int, ci: int) -> None:
        self.mig.destroy_compute_instance(pci_address, gi, ci)

    def destroy_gpu_instance(self, pci_address: str, gi: int) -> None:
        self.mig.destroy_gpu_instance(pci_address, gi)

    # ----------------------------------------------------------------- MigPartitioner (nvidia_mig)

    def apply_mig_layout(self, pci_address: str, profiles: Sequence[str], *, disable: bool) -> MigLayoutResult:
        return self.mig.apply_mig_layout(pci_address, profiles, disable=disable)

    # ----------------------------------------------------------------- HealthWatcher (nvidia_health)

    def open_health_watch(self) -> list[HealthEvent]:
        return self.health.open_health_watch()

    def wait_health_events(self, timeout: float) -> list[HealthEvent]:
        return self.health.wait_health_events(timeout)

    def check_health(self) -> list[HealthCheck]:
        return self.health.check_health()

    def close_health_watch(self) -> None:
        self.health.close_health_watch()

    # ----------------------------------------------------------------- Diagnosable (dcgm)

    def run_diag(self, pci_address: str, level: int, timeout: float) -> DiagResult:
        """DCGM's `dcgmi diag` on the card NVML listed at that address in the last scan."""
        from .dcgm import run_dcgmi

        facts = self.discovery.last.get(pci_address)
        if facts is None or not facts.readable:
            return DiagResult("Error", f"NVML does not see the card at {pci_address} (not on its native driver?): no diagnostic")
        return run_dcgmi(facts.index, level, timeout)

    # ----------------------------------------------------------------- VfioCapable

    def driver_binding(self, pci_address: str) -> tuple[str, str]:
        return hostfs.read_bound_driver(self.sysfs_root, pci_address), NATIVE_DRIVER

    # ----------------------------------------------------------------- SharingCapable

    def slots_per_gpu(self, gpu_uuid: str) -> int:
        if isinstance(self._slots, int):
            return self._slots
        if gpu_uuid in self._slots:
            return self._slots[gpu_uuid]
        for pci, facts in self.discovery.last.items():
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

    # ----------------------------------------------------------------- GpuSharer (nvidia_sharing)

    def mps_start(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        self.sharing.mps_start(spec, pipe_dir, log_dir)

    def mps_stop(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        self.sharing.mps_stop(control, pipe_dir, log_dir)

    def mps_list(self, root: Path) -> list[str]:
        return self.sharing.mps_list(root)

    def set_timeslice(self, pci_address: str, gpu_uuid: str, interval: str) -> None:
        self.sharing.set_timeslice(pci_address, gpu_uuid, interval)


__all__ = ["NATIVE_DRIVER", "NvidiaAdapter", "unavailable_message"]
