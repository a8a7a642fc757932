"""The fake host's health watch: NVML's event set and health checks, played back from the host file.

Each card's `health` in the host file (fakehost.HostGpuHealth) is what NVML would say. The watch
behaves as NVML's does: it reports what happens after it opened (an XID added to `xids`, a
rise of an ECC counter, `gone` turning true) and nothing from before, so a restarted inventory
knows an earlier XID only from its own gpus.json. A host file that cannot be read is
HealthNotRead (nothing is concluded), never the library gone. It polls the file (every POLL_SECONDS, and
decodes it only when its inode, size or mtime moved), from the inventory's health thread.
Cards NVML cannot see (on vfio-pci, off the bus) are neither watched nor checked; a watched card
that goes off the bus (`present` turning false) is a `gone` event, as NVML's GPU_IS_LOST is.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from pathlib import Path

from .base import AdapterError, HealthCheck, HealthEvent, HealthNotRead
from .fakehost import NVML_GONE, FakeHost, HostFileError, HostGpu, load_host_file

#: how often the watch looks at the host file while it waits
POLL_SECONDS = 0.1


def _watched(card: HostGpu) -> bool:
    """NVML sees the card: on the bus and on its native driver (a vfio-pci card is the VM's)."""
    return card.present and not card.real_sysfs and card.driver == card.base_driver and bool(card.driver)


def read_host(path: Path) -> FakeHost:
    """The host file; HealthNotRead when it cannot be read or decoded now (a typo says nothing of the
    cards: the scan keeps its last inventory meanwhile too)."""
    try:
        return load_host_file(path)
    except HostFileError as exc:
        raise HealthNotRead(str(exc)) from None


def check_host(host: FakeHost) -> list[HealthCheck]:
    """One check of every card NVML would see (HealthWatcher.check_health)."""
    if host.nvml_gone:
        raise AdapterError(NVML_GONE)
    out = []
    for card in host.gpus:
        if not _watched(card):
            continue
        h = card.health
        out.append(
            HealthCheck(
                pci_address=card.pci_address,
                answers=not h.gone,
                row_remap_pending=h.row_remap_pending,
                row_remap_failed=h.row_remap_failed,
                ecc_uncorrectable=h.ecc_uncorrectable,
                ecc_correctable=h.ecc_correctable,
                unmonitored="events cannot be registered for this card (fake host: unmonitored)" if h.unmonitored else "",
                message="GPU_IS_LOST (fake host: gone)" if h.gone else "",
            )
        )
    return out


class _Seen:
    """What the watch has reported of one card."""

    def __init__(self, card: HostGpu) -> None:
        self.xids = len(card.health.xids)
        self.ecc_uncorrectable = card.health.ecc_uncorrectable
        self.ecc_correctable = card.health.ecc_correctable
        self.gone = card.health.gone


class FakeHealthWatch:
    """One open watch over a host file (what NVML's event set is to the nvidia adapter)."""

    def __init__(self, host_file: Path) -> None:
        self.host_file = host_file
        self.seen: dict[str, _Seen] = {}
        self._stamp: tuple[int, int, int] | None = None

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.host_file)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def open(self) -> list[HealthEvent]:
        host = read_host(self.host_file)
        if host.nvml_gone:
            raise AdapterError(NVML_GONE)
        self._stamp = self._file_stamp()
        self.seen = {c.pci_address: _Seen(c) for c in host.gpus if _watched(c)}
        now = datetime.now(timezone.utc)
        return [
            HealthEvent(c.pci_address, "unmonitored", now, message="events cannot be registered for this card (fake host: unmonitored)")
            for c in host.gpus
            if _watched(c) and c.health.unmonitored
        ]

    def wait(self, timeout: float) -> list[HealthEvent]:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            stamp = self._file_stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                events = self._new_events(read_host(self.host_file))
                if events:
                    return events
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            time.sleep(min(POLL_SECONDS, left))

    def _new_events(self, host: FakeHost) -> list[HealthEvent]:
        if host.nvml_gone:
            raise AdapterError(NVML_GONE)
        now = datetime.now(timezone.utc)
        events: list[HealthEvent] = []
        for card in host.gpus:
            if not _watched(card):
                continue
            pci, h = card.pci_address, card.health
            seen = self.seen.get(pci)
            if seen is None:
                # a card NVML sees again (back from vfio-pci): watched from now on, as after a registration
                self.seen[pci] = _Seen(card)
                continue
            for x in h.xids[seen.xids :]:
                events.append(HealthEvent(pci, "xid", x.at, xid=x.xid, gi=x.gi, ci=x.ci, message=x.message))
            if h.ecc_uncorrectable > seen.ecc_uncorrectable:
                events.append(HealthEvent(pci, "ecc-uncorrectable", now, message=f"volatile count {h.ecc_uncorrectable}"))
            if h.ecc_correctable > seen.ecc_correctable:
                events.append(HealthEvent(pci, "ecc-correctable", now, message=f"volatile count {h.ecc_correctable}"))
            if h.gone and not seen.gone:
                events.append(HealthEvent(pci, "gone", now, message="GPU_IS_LOST (fake host: gone)"))
            seen.xids, seen.ecc_uncorrectable, seen.ecc_correctable, seen.gone = (
                len(h.xids),
                h.ecc_uncorrectable,
                h.ecc_correctable,
                h.gone,
            )
        for pci in [p for p in self.seen if not any(c.pci_address == p and _watched(c) for c in host.gpus)]:
            del self.seen[pci]
            if not any(c.pci_address == pci and c.present for c in host.gpus):
                # a watched card that fell off the bus: NVML says so at once (GPU_IS_LOST), not at the next scan
                events.append(HealthEvent(pci, "gone", now, message="the card fell off the bus (fake host: present false)"))
        return events


__all__ = ["POLL_SECONDS", "check_host", "FakeHealthWatch"]
