"""The reaper's three sources, as ports: pods' devices, host GPU processes, evictions.

Each port has a real backend (kubelet gRPC, NVML + procfs, the Eviction API)
and a fake one; the service only sees these Protocols. A source that cannot
answer raises `SourceUnreachable` with the reason, which the service turns into
"held, not reachable" (unreachable counts as held).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class SourceUnreachable(Exception):
    """A source could not answer (socket missing, timeout, NVML absent, file unreadable)."""


@dataclass(frozen=True)
class PodDevice:
    """One device id given to one container of one pod."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str

    @property
    def pod_ref(self) -> str:
        return f"{self.namespace}/{self.pod}"


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on a GPU, with its cgroup (path or the whole /proc/<pid>/cgroup)."""

    pid: int
    gpu_uuid: str
    cgroup: str


class PodResources(Protocol):
    """The kubelet's pod-resources List: every device id every pod on the node was given."""

    async def list_devices(self) -> list[PodDevice]: ...

    async def close(self) -> None: ...


class HostProcesses(Protocol):
    """GPU compute processes on this host (a pod's process holds its whole GPU)."""

    async def list_processes(self) -> list[GpuProcess]: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class EvictionResult:
    """One eviction attempt. `outcome`: evicted, gone, throttled, server_error, error, unavailable."""

    outcome: str
    detail: str = ""
    #: seconds the server asked us to wait (Retry-After), when it said.
    retry_after: float | None = None

    @property
    def final(self) -> bool:
        return self.outcome in ("evicted", "gone")


class Evictor(Protocol):
    """Asks the API server to evict one pod (policy/v1 Eviction)."""

    #: False for the `none` backend: pods are never evicted.
    enabled: bool

    async def evict(self, namespace: str, pod: str) -> EvictionResult: ...

    async def close(self) -> None: ...


__all__ = [
    "SourceUnreachable",
    "PodDevice",
    "GpuProcess",
    "PodResources",
    "HostProcesses",
    "EvictionResult",
    "Evictor",
]
