"""Health on an NVIDIA host (`HealthWatcher`, issue 30): NVML's event set and three reads per card.

The watch registers XID, double-bit and single-bit ECC events on every card NVML sees (a MIG card's
on its parent: its events name the GPU and compute instance) in an event set of its own, which only
the inventory's health thread waits on; `check_health` reads remapped rows and the volatile ECC
counters. A card NVML cannot see (on vfio-pci) is in neither. A card whose PCI info NVML no longer
reads is named by the last scan (`NvidiaDiscovery.nvml_pci`).

What NVML answers is sorted three ways: the library as a whole gone (uninitialized, driver not
loaded, library missing, library/driver mismatch) raises AdapterError, which makes every card
GpuLost; one card lost (GPU_IS_LOST, RESET_REQUIRED) is that card's `gone` / `answers=False`; a
feature the card lacks (NOT_SUPPORTED) is no fault: a check reads None, a registration that fails is
that card's `unmonitored`.

Open, wait and close are serialised by one lock, so the event set is never freed while NVML waits on
it; a close that cannot get the lock in time leaves freeing the set to the wait in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import TypeVar

import pynvml

from .. import hostfs
from .base import AdapterError, HealthCheck, HealthEvent
from .nvidia_discovery import NvidiaDiscovery
from .nvidia_nvml import NVML_ERRORS, NvmlEvent, NvmlPort, nvml_code

T = TypeVar("T")

#: the events the watch registers, of those a card supports
_HEALTH_EVENTS = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypeSingleBitEccError
#: NVML answers that mean the library as a whole does not answer, not one card
_LIBRARY_GONE = frozenset(
    {pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_DRIVER_NOT_LOADED, pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH}
)
#: NVML answers that mean one card is lost (fallen off the bus, or unusable until a reset)
_CARD_LOST = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED})
#: NVML answers that mean the card (or this driver) lacks the feature: no fault
_NOT_SUPPORTED = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_VGPU_ECC_NOT_SUPPORTED})
#: the most events one wait takes from the set: the rest are the next wait's, so a storm of XIDs cannot hold the thread
_EVENTS_MAX = 256
#: how long closing the watch waits for a wait in flight; past that, that wait frees the set when it returns
_CLOSE_WAIT_SECONDS = 5.0

def _library_gone(exc: BaseException) -> AdapterError:
    return AdapterError(f"NVML does not answer: {exc or type(exc).__name__}")


class _CardLost(Exception):
    """A read of one card answered GPU_IS_LOST (or RESET_REQUIRED); the text is NVML's answer."""


@dataclass
class _HealthWatch:
    """An open watch: NVML's event set and what it holds. Only the health thread touches it
    (under NvidiaHealth._watch_lock)."""

    #: None: NVML could make no event set (every card is unmonitored); waits then only wait
    event_set: object | None
    #: NVML index -> PCI address of the cards registered on the set
    cards: dict[int, str]
    #: NVML index -> PCI address of the cards reported `gone`: not registered, not reported again
    gone: dict[int, str]


class NvidiaHealth:
    """HealthWatcher on NVML, for the cards NVML sees; `close` refuses every later call."""

    def __init__(self, nvml: NvmlPort, scan: NvidiaDiscovery) -> None:
        self.nvml = nvml
        self.scan = scan
        #: the health watch (health thread only); _watch_lock serialises open, wait and close, so
        #: the event set is never freed while NVML waits on it
        self._watch: _HealthWatch | None = None
        self._watch_lock = threading.Lock()
        #: a close gave up waiting for a wait in flight: that wait frees the set
        self._watch_abandoned = False
        #: PCI address -> why the card is not watched, of the open watch; replaced whole (check_health
        #: runs in other threads and reads it without a lock)
        self._unmonitored: dict[str, str] = {}
        self._closed = False

    def close(self) -> None:
        """The watch closed, and every later call refused (NVML is about to be shut down)."""
        self._closed = True
        self.close_health_watch()

    def open_health_watch(self) -> list[HealthEvent]:
        with self._watch_lock:
            self._free_watch()  # a watch left open (the thread re-opens after a failure) is replaced
            self._watch_abandoned = False
            self._refuse_closed()
            now = datetime.now(timezone.utc)
            cards = self._health_cards()
            events: list[HealthEvent] = []
            gone: dict[int, str] = {}
            unmonitored: dict[str, str] = {}
            readable: dict[int, str] = {}
            for i, pci, err in cards:
                if err is None:
                    readable[i] = pci
                elif nvml_code(err) in _CARD_LOST:
                    gone[i] = pci
                    events.append(HealthEvent(pci, "gone", now, message=f"NVML: {err}"))
                else:
                    unmonitored[pci] = f"NVML cannot read the card ({err}): its health events cannot be registered"
            try:
                event_set: object | None = self.nvml.event_set_create()
            except NVML_ERRORS as exc:
                if nvml_code(exc) in _LIBRARY_GONE:
                    raise _library_gone(exc) from None
                # no event set at all: every card is unmonitored, its checks still run
                event_set = None
                unmonitored.update({pci: f"NVML cannot make an event set ({exc}): health events cannot be registered" for pci in readable.values()})
                registered: dict[int, str] = {}
            else:
                try:
                    registered = self._register(event_set, readable, gone, unmonitored, events, now)
                except AdapterError:
                    self._free_set(event_set)
                    raise
            self._watch = _HealthWatch(event_set, registered, gone)
            self._unmonitored = dict(unmonitored)
            events.extend(HealthEvent(pci, "unmonitored", now, message=why) for pci, why in unmonitored.items())
            return sorted(events, key=lambda e: e.pci_address)

    def _register(
        self, event_set: object, cards: Mapping[int, str], gone: dict[int, str], unmonitored: dict[str, str], events: list[HealthEvent], now: datetime
    ) -> dict[int, str]:
        """Register the health events of each card on the set; the cards registered. A card lost meanwhile
        goes to `gone` (with its event), one that cannot be registered to `unmonitored`."""
        registered: dict[int, str] = {}
        for i, pci in sorted(cards.items()):
            try:
                types = self.nvml.device_supported_event_types(i) & _HEALTH_EVENTS
                if not types:
                    unmonitored[pci] = "the card reports none of NVML's health events (XID, ECC): they cannot be registered"
                    continue
                self.nvml.device_register_events(i, types, event_set)
            except NVML_ERRORS as exc:
                code = nvml_code(exc)
                if code in _LIBRARY_GONE:
                    raise _library_gone(exc) from None
                if code in _CARD_LOST:
                    gone[i] = pci
                    events.append(HealthEvent(pci, "gone", now, message=f"NVML: {exc}"))
                elif code in _NOT_SUPPORTED:
                    unmonitored[pci] = f"NVML does not support health events on this card ({exc})"
                else:
                    unmonitored[pci] = f"NVML could not register health events for this card ({exc})"
                continue
            registered[i] = pci
        return registered

    def wait_health_events(self, timeout: float) -> list[HealthEvent]:
        timeout = max(0.0, timeout)
        deadline = time.monotonic() + timeout
        with self._watch_lock:
            try:
                return self._wait(timeout, deadline)
            finally:
                if self._watch_abandoned:
                    self._watch_abandoned = False
                    self._free_watch()

    def _wait(self, timeout: float, deadline: float) -> list[HealthEvent]:
        self._refuse_closed()
        watch = self._watch
        if watch is None:
            raise AdapterError("the health watch is not open")
        if watch.event_set is None or not watch.cards:
            time.sleep(timeout)  # nothing to wait on: the thread still paces itself by this wait
            return []
        events: list[HealthEvent] = []
        timeout_ms = int(timeout * 1000)
        for _ in range(_EVENTS_MAX):
            try:
                got = self.nvml.event_set_wait(watch.event_set, timeout_ms)
            except NVML_ERRORS as exc:
                code = nvml_code(exc)
                if code in _LIBRARY_GONE:
                    raise _library_gone(exc) from None
                if code in _CARD_LOST:
                    events.extend(self._lost_in_wait(watch, exc, deadline))
                else:
                    # the set cannot be waited on: its cards are unmonitored (their checks still run)
                    now = datetime.now(timezone.utc)
                    why = f"NVML's event wait failed ({exc}): health events are no longer watched"
                    events.extend(HealthEvent(pci, "unmonitored", now, message=why) for pci in watch.cards.values())
                    self._unmonitored = {**self._unmonitored, **{pci: why for pci in watch.cards.values()}}
                    self._free_set(watch.event_set)
                    watch.event_set, watch.cards = None, {}
                break
            if got is None:
                break
            timeout_ms = 0  # what else is queued already, without waiting again
            event = self._health_event(watch, got)
            if event is not None:
                events.append(event)
        return events

    def _health_event(self, watch: _HealthWatch, got: NvmlEvent) -> HealthEvent | None:
        pci = watch.cards.get(got.index, watch.gone.get(got.index)) if got.index is not None else None
        if pci is None and got.pci_bus_id:
            try:
                pci = hostfs.normalize_pci(got.pci_bus_id)
            except ValueError:
                pci = None
        if pci is None:
            return None  # no card to name: a HealthEvent needs one
        now = datetime.now(timezone.utc)  # NVML gives no wall time
        gi = got.gi_id
        ci = got.ci_id if gi is not None else None
        if got.event_type & pynvml.nvmlEventTypeXidCriticalError:
            return HealthEvent(pci, "xid", now, xid=int(got.data), gi=gi, ci=ci)
        if got.event_type & pynvml.nvmlEventTypeDoubleBitEccError:
            return HealthEvent(pci, "ecc-uncorrectable", now, gi=gi, ci=ci, message="NVML event: double-bit ECC error")
        if got.event_type & pynvml.nvmlEventTypeSingleBitEccError:
            return HealthEvent(pci, "ecc-correctable", now, gi=gi, ci=ci, message="NVML event: single-bit ECC error")
        return None  # a type the watch did not register

    def _lost_in_wait(self, watch: _HealthWatch, exc: BaseException, deadline: float) -> list[HealthEvent]:
        """The wait answered GPU_IS_LOST without saying which card: each card on the set (and each already
        gone) is read to find it. Those newly lost are `gone`, and the set is made again without them, so
        the others' events still come. When no card reads as lost the set cannot be trusted: AdapterError."""
        lost: dict[int, str] = {}
        for i, pci in sorted({**watch.cards, **watch.gone}.items()):
            check = self._check_card(i, pci)
            if not check.answers:
                lost[i] = check.message
        if not lost:
            raise AdapterError(f"NVML's event wait answered {exc}, and no card it watches reads as lost")
        now = datetime.now(timezone.utc)
        new = {i: watch.cards[i] for i in lost if i in watch.cards}
        events = [HealthEvent(pci, "gone", now, message=lost[i]) for i, pci in new.items()]
        if not new:
            # only a card already reported: the wait may keep answering so; it must not spin
            time.sleep(max(0.0, deadline - time.monotonic()))
            return events
        watch.gone.update(new)
        try:
            event_set = self.nvml.event_set_create()
        except NVML_ERRORS as exc2:
            if nvml_code(exc2) in _LIBRARY_GONE:
                raise _library_gone(exc2) from None
            raise AdapterError(f"NVML cannot make the event set again after a card was lost ({exc2})") from None
        unmonitored: dict[str, str] = {}
        rest = {i: pci for i, pci in watch.cards.items() if i not in new}
        try:
            registered = self._register(event_set, rest, watch.gone, unmonitored, events, now)
        except AdapterError:
            self._free_set(event_set)
            raise
        self._free_set(watch.event_set)
        watch.event_set, watch.cards = event_set, registered
        if unmonitored:
            self._unmonitored = {**self._unmonitored, **unmonitored}
            events.extend(HealthEvent(pci, "unmonitored", now, message=why) for pci, why in unmonitored.items())
        return events

    def check_health(self) -> list[HealthCheck]:
        self._refuse_closed()
        unmonitored = self._unmonitored  # one snapshot: the health thread replaces it whole
        out: list[HealthCheck] = []
        for i, pci, err in self._health_cards():
            if err is not None:
                out.append(HealthCheck(pci, answers=False, message=f"NVML cannot read the card: {err}"))
            else:
                out.append(replace(self._check_card(i, pci), unmonitored=unmonitored.get(pci, "")))
        return sorted(out, key=lambda c: c.pci_address)

    def _check_card(self, index: int, pci: str) -> HealthCheck:
        """Remapped rows and the volatile ECC counters of one card; answers=False when it is lost."""
        try:
            rows = self._health_read(lambda: self.nvml.device_remapped_rows(index))
            uncorrectable = self._health_read(lambda: self.nvml.device_total_ecc_errors(index, uncorrected=True))
            correctable = self._health_read(lambda: self.nvml.device_total_ecc_errors(index, uncorrected=False))
        except _CardLost as lost:
            return HealthCheck(pci, answers=False, message=f"NVML: {lost}")
        return HealthCheck(
            pci,
            row_remap_pending=bool(rows[2]) if rows is not None else False,
            row_remap_failed=bool(rows[3]) if rows is not None else False,
            ecc_uncorrectable=uncorrectable,
            ecc_correctable=correctable,
        )

    @staticmethod
    def _health_read(fn: Callable[[], T]) -> T | None:
        """One read of a check: None when the card lacks it (or NVML refuses it: no fault either);
        _CardLost when the card is lost; AdapterError when the library is."""
        try:
            return fn()
        except NVML_ERRORS as exc:
            code = nvml_code(exc)
            if code in _LIBRARY_GONE:
                raise _library_gone(exc) from None
            if code in _CARD_LOST:
                raise _CardLost(str(exc) or type(exc).__name__) from None
            return None

    def _health_cards(self) -> list[tuple[int, str, BaseException | None]]:
        """(NVML index, PCI address, why NVML cannot read it or None) of each card NVML sees. A card whose
        PCI info NVML no longer reads is named by the last scan; one it never named is left out."""
        try:
            count = self.nvml.device_count()
        except NVML_ERRORS as exc:
            raise _library_gone(exc) from None
        known = self.scan.nvml_pci
        out: list[tuple[int, str, BaseException | None]] = []
        for i in range(count):
            try:
                out.append((i, hostfs.normalize_pci(self.nvml.device_pci_bus_id(i)), None))
            except NVML_ERRORS as exc:
                if nvml_code(exc) in _LIBRARY_GONE:
                    raise _library_gone(exc) from None
                if i in known:
                    out.append((i, known[i], exc))
            except ValueError:
                continue  # not a PCI address: no card to name
        return out

    def _refuse_closed(self) -> None:
        if self._closed:
            raise AdapterError("NVML is shut down: the nvidia adapter is closed")

    def close_health_watch(self) -> None:
        if not self._watch_lock.acquire(timeout=_CLOSE_WAIT_SECONDS):
            # a wait stuck in the driver: freeing the set under it would crash NVML; the wait frees it
            self._watch_abandoned = True
            return
        try:
            self._free_watch()
        finally:
            self._watch_lock.release()

    def _free_watch(self) -> None:
        """Under _watch_lock."""
        watch, self._watch = self._watch, None
        self._unmonitored = {}
        if watch is not None and watch.event_set is not None:
            self._free_set(watch.event_set)

    def _free_set(self, event_set: object) -> None:
        try:
            self.nvml.event_set_free(event_set)
        except NVML_ERRORS:
            pass  # a library that is gone has freed it with everything else


__all__ = ["NvidiaHealth"]
