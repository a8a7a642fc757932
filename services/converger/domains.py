"""The Domains port: which VMs run on this host, and with which GPUs (read-only).

The VFIO side claims a GPU named by a current instance spec or attached to a
domain running at the last pass, so a GPU dropped from a running VM's spec
stays the VM's until its next start. The fake host lists its domains; a
libvirt backend (the VFIO issue) reads them from the hypervisor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.host import read_host_file
from shared.schemas import PCI_RE


@dataclass(frozen=True)
class RunningDomain:
    name: str
    gpus: tuple[str, ...]


class DomainsError(Exception):
    """The domain list could not be read; the pass keeps the last known claims."""


class Domains(Protocol):
    def running(self) -> list[RunningDomain]: ...


class NoDomains:
    """A host without a hypervisor: no domain ever claims a GPU."""

    def running(self) -> list[RunningDomain]:
        return []


class FakeDomains:
    """`domains` of a fake host description file: [{"name": ..., "gpus": ["0000:3b:00.0", ...]}]."""

    def __init__(self, host_file: Path) -> None:
        self.host_file = Path(host_file)

    def running(self) -> list[RunningDomain]:
        try:
            raw = read_host_file(self.host_file).get("domains", [])
        except (OSError, ValueError, AttributeError) as exc:
            raise DomainsError(f"{self.host_file}: cannot read domains ({exc})") from None
        out = []
        for d in raw:
            gpus = tuple(p for p in d.get("gpus", []) if isinstance(p, str) and PCI_RE.match(p))
            out.append(RunningDomain(str(d.get("name", "?")), gpus))
        return out


__all__ = ["RunningDomain", "DomainsError", "Domains", "NoDomains", "FakeDomains"]
