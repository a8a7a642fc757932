"""What the inventory's rooms share: the adapter, the GPU tracker and its file, the last scan and inventory, the locks.

Made once at setup and handed to each room (publishing.py, healthdesk.py,
migjobs.py, sharingsteps.py, diagjobs.py, gpurequests.py), so that none
reaches into the app for them. Each field says who writes it; the others read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from shared.schemas import Gpu, Inventory

from .adapters.base import HealthWatcher
from .gpustate import GpuStateStore, GpuTracker
from .health import HealthPolicy


@dataclass
class InventoryFacts:
    #: the vendor adapter (loaded at setup); what it can do is asked with isinstance
    adapter: Any
    #: every card's PhysicalGPU state; evaluated and changed under `lock`
    tracker: GpuTracker
    #: where the tracker's state is kept (gpus.json)
    store: GpuStateStore
    #: GPU health (issue 30): the operator's options
    health_policy: HealthPolicy
    #: the Inventory published last, with its content key (publishing.py writes them; None: none yet)
    current: Inventory | None = None
    content_key: bytes = b""
    #: the last successful scan, before its evaluation (what a claims notice is evaluated against)
    last_base: Inventory | None = None
    #: time.monotonic() of the last scan, tried or done (the run loop's clock)
    last_scan: float = 0.0
    #: one scan, evaluation or gpu request at a time
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: set after every evaluation: the run loop re-reads whether a timer runs
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: PCI address -> the lock every MIG change of that card runs under (a layout, an instance
    #: step; a time slice too)
    mig_locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def mig_lock(self, pci: str) -> asyncio.Lock:
        return self.mig_locks.setdefault(pci, asyncio.Lock())

    def card(self, pci: str | None) -> Gpu | None:
        """The card the last published inventory lists at `pci` (None: not listed)."""
        if self.current is None:
            return None
        return next((g for g in self.current.gpus if g.pci_address == pci), None)

    def listed(self, pci: str) -> bool:
        return self.current is not None and any(g.pci_address == pci for g in self.current.gpus)

    def watching(self) -> bool:
        """Is GPU health watched (checks on, and an adapter that can)?"""
        return self.health_policy.enabled and isinstance(self.adapter, HealthWatcher)


__all__ = ["InventoryFacts"]
