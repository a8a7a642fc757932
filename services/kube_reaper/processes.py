"""The `HostProcesses` port: GPU compute processes and their cgroups.

A process whose cgroup lies under the kubelet's `kubepods` hierarchy belongs to
a pod and holds its whole GPU, whatever pod-resources says (a container given
every GPU through NVIDIA_VISIBLE_DEVICES, say). Backends:

- `nvml`: nvidia-ml-py's `nvmlDeviceGetComputeRunningProcesses` on every card
  NVML sees, plus `<proc_root>/<pid>/cgroup`. Without NVML (no driver, no
  library) every query fails as unreachable; the service does not die of it.
- `fake`: the `processes` list of the fake host file
  (`{"processes": [{"pid": .., "gpu_uuid": .., "cgroup": ..}]}`), read again
  on every query so a test can change it.
- `none`: no processes (a node where only pod-resources counts).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from shared.fsutil import read_regular
from shared.host import HOST_FILE_MAX_BYTES
from shared.schemas.codec import bounded_json_loads

from .devices import cgroup_paths, is_kubepods_path
from .ports import GpuProcess, SourceUnreachable


def cgroup_of(text: str) -> str:
    """The path to report for a /proc/<pid>/cgroup file: a kubepods one when any line has it."""
    paths = cgroup_paths(text)
    for p in paths:
        if is_kubepods_path(p):
            return p
    return paths[0] if paths else ""


class NoHostProcesses:
    async def list_processes(self) -> list[GpuProcess]:
        return []

    async def close(self) -> None:
        return None


class FakeHostProcesses:
    """The fake host file's `processes`, re-read on every query."""

    def __init__(self, fake_host: Path) -> None:
        self.path = Path(fake_host)

    async def list_processes(self) -> list[GpuProcess]:
        try:
            host = bounded_json_loads(read_regular(self.path, max_bytes=HOST_FILE_MAX_BYTES), HOST_FILE_MAX_BYTES, "host file")
        except (OSError, ValueError) as exc:
            raise SourceUnreachable(f"fake host {self.path}: {exc}") from None
        entries = host.get("processes", []) if isinstance(host, dict) else None
        if not isinstance(entries, list):
            raise SourceUnreachable(f"fake host {self.path}: processes is not a list")
        out = []
        for i, p in enumerate(entries):
            try:
                out.append(GpuProcess(pid=int(p["pid"]), gpu_uuid=str(p["gpu_uuid"]), cgroup=str(p.get("cgroup", ""))))
            except (KeyError, TypeError, ValueError):
                raise SourceUnreachable(f"fake host {self.path}: processes[{i}] needs pid and gpu_uuid") from None
        return out

    async def close(self) -> None:
        return None


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlHostProcesses:
    """NVML's compute processes per card, with each one's cgroup from `<proc_root>/<pid>/cgroup`."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = Path(proc_root)
        self._lock = threading.Lock()
        self._initialised = False

    def _read_cgroup(self, pid: int) -> str:
        try:
            return cgroup_of((self.proc_root / str(pid) / "cgroup").read_text(errors="replace"))
        except OSError:
            return ""  # the process is gone (or hidden): it holds nothing we can name

    def _list(self) -> list[GpuProcess]:
        try:
            import pynvml
        except ImportError as exc:  # nvidia-ml-py is a dependency; be explicit anyway
            raise SourceUnreachable(f"NVML is not available: {exc}") from None
        with self._lock:
            try:
                if not self._initialised:
                    pynvml.nvmlInit()
                    self._initialised = True
                found: list[GpuProcess] = []
                for i in range(pynvml.nvmlDeviceGetCount()):
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        found.append(GpuProcess(pid=int(p.pid), gpu_uuid=uuid, cgroup=self._read_cgroup(int(p.pid))))
                return found
            except pynvml.NVMLError as exc:
                if isinstance(exc, pynvml.NVMLError_Uninitialized):
                    self._initialised = False
                what = "NVML is not available" if not self._initialised else "NVML process query failed"
                raise SourceUnreachable(f"{what}: {exc}") from None

    async def list_processes(self) -> list[GpuProcess]:
        return await asyncio.to_thread(self._list)

    def _shutdown(self) -> None:
        with self._lock:
            if not self._initialised:
                return
            self._initialised = False
            try:
                import pynvml

                pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down; nothing to do about it
                pass

    async def close(self) -> None:
        await asyncio.to_thread(self._shutdown)


__all__ = ["cgroup_of", "NoHostProcesses", "FakeHostProcesses", "NvmlHostProcesses"]
