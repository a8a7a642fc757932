"""The nvidia adapter's health watch (issue 30): HealthWatcher on NVML's event set and checks.

The adapter runs against `HealthNvml`, the contract suite's FakeNvml with NVML's event set and
health reads added (scripted events, cards lost, counters, features a card lacks, the library
gone). `PynvmlNvml`'s own mapping runs against the real `pynvml` module with its functions
replaced one by one (monkeypatch fails on a name the module lacks), and every `pynvml` name
the nvidia adapter's modules use is checked to exist in the installed nvidia-ml-py, so a
misspelt NVML name fails here rather than on a host with GPUs. `NvidiaHealth` (nvidia_health.py)
also runs alone, on a scan of its own with no adapter around it.
"""

from __future__ import annotations

import ctypes
import re
import threading
import time
from pathlib import Path
from typing import Any

import pynvml
import pytest

from services.inventory.adapters import nvidia_health
from services.inventory.adapters.base import AdapterError, HealthCheck, HealthWatcher
from services.inventory.adapters.fakehost import load_host_file
from services.inventory.adapters.nvidia import NvidiaAdapter
from services.inventory.adapters.nvidia_discovery import NvidiaDiscovery
from services.inventory.adapters.nvidia_health import NvidiaHealth
from services.inventory.adapters.nvidia_nvml import NvmlError, NvmlEvent, NvmlPort, PynvmlNvml
from tests.unit.test_inventory_adapters import H200, FakeNvml, materialize

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
SBE = pynvml.nvmlEventTypeSingleBitEccError
HEALTH = XID | DBE | SBE
NO_INSTANCE = 0xFFFFFFFF

#: the example host's cards in NVML's order (all eight on the nvidia driver; the last two in MIG mode)
PCI = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]

LOST = NvmlError("nvmlDeviceGetRemappedRows: GPU is lost", pynvml.NVML_ERROR_GPU_IS_LOST)
NOT_SUPPORTED = NvmlError("Not Supported", pynvml.NVML_ERROR_NOT_SUPPORTED)
DRIVER_GONE = NvmlError("nvmlDeviceGetCount: Driver Not Loaded", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


class HealthNvml(FakeNvml):
    """FakeNvml with NVML's event set and health reads, scripted by the test.

    `events`: what successive waits get (an NvmlEvent, or an exception the wait raises); a wait
    with none left times out (None). `lost`: cards whose every health read (and registration)
    answers GPU_IS_LOST. `errors`: (method, index) -> an exception that call raises. `gone`: the
    library as a whole raises it from every call."""

    def __init__(self, host: Any, **kw: Any) -> None:
        super().__init__(host, **kw)
        self.supported: dict[int, int] = {}
        self.events: list[NvmlEvent | Exception] = []
        self.lost: set[int] = set()
        self.errors: dict[tuple[str, int | None], Exception] = {}
        self.gone: Exception | None = None
        self.rows: dict[int, tuple[int, int, bool, bool]] = {}
        self.ecc: dict[tuple[int, bool], int] = {}
        self.sets: list[dict[int, int]] = []  # set id -> index -> registered types
        self.freed: list[int] = []
        self.waits: list[tuple[int, int]] = []  # (set id, timeout_ms)
        self.blocking: threading.Event | None = None  # a wait blocks until this is set

    def _check(self, method: str, index: int | None = None) -> None:
        if self.gone is not None:
            raise self.gone
        err = self.errors.get((method, index))
        if err is not None:
            raise err

    def _lost(self, index: int, call: str) -> None:
        if index in self.lost:
            raise NvmlError(f"{call}: GPU is lost", pynvml.NVML_ERROR_GPU_IS_LOST)

    def device_count(self) -> int:
        self._check("device_count")
        return super().device_count()

    def device_pci_bus_id(self, index: int) -> str:
        self._check("device_pci_bus_id", index)
        return super().device_pci_bus_id(index)

    def event_set_create(self) -> object:
        self._check("event_set_create")
        self.sets.append({})
        return len(self.sets) - 1

    def event_set_free(self, event_set: object) -> None:
        assert isinstance(event_set, int) and event_set not in self.freed, "a set freed twice"
        self.freed.append(event_set)

    def device_supported_event_types(self, index: int) -> int:
        self._check("device_supported_event_types", index)
        self._card(index)
        return self.supported.get(index, HEALTH | pynvml.nvmlEventTypePState)

    def device_register_events(self, index: int, event_types: int, event_set: object) -> None:
        self._check("device_register_events", index)
        self._lost(index, "nvmlDeviceRegisterEvents")
        assert isinstance(event_set, int) and event_set not in self.freed
        self.sets[event_set][index] = event_types

    def event_set_wait(self, event_set: object, timeout_ms: int) -> NvmlEvent | None:
        self._check("event_set_wait")
        assert isinstance(event_set, int) and event_set not in self.freed, "a wait on a freed set"
        self.waits.append((event_set, timeout_ms))
        if self.blocking is not None:
            assert self.blocking.wait(5)
        if not self.events:
            return None
        got = self.events.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    def device_remapped_rows(self, index: int) -> tuple[int, int, bool, bool]:
        self._check("device_remapped_rows", index)
        self._lost(index, "nvmlDeviceGetRemappedRows")
        return self.rows.get(index, (0, 0, False, False))

    def device_total_ecc_errors(self, index: int, uncorrected: bool) -> int:
        self._check("device_total_ecc_errors", index)
        self._lost(index, "nvmlDeviceGetTotalEccErrors")
        return self.ecc.get((index, uncorrected), 0)


def make(tmp_path: Path, **kw: Any) -> tuple[NvidiaAdapter, HealthNvml]:
    nvml = HealthNvml(load_host_file(H200), **kw)
    adapter = NvidiaAdapter(nvml=nvml, sysfs_root=tmp_path / "sys", proc_root=tmp_path / "proc", cdi_dir=tmp_path / "cdi")
    return adapter, nvml


def test_the_adapter_is_a_health_watcher_and_the_fake_a_port(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    port: NvmlPort = nvml
    assert isinstance(adapter, HealthWatcher)
    assert port.device_count() == 8


# --------------------------------------------------------------------------- open


def test_open_registers_the_health_events_of_every_card_on_one_set(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.supported[0] = XID  # a card without ECC: its XIDs are still watched
    assert adapter.open_health_watch() == []
    assert len(nvml.sets) == 1
    # only the health events, of those the card supports (not PState, which it supports too)
    assert nvml.sets[0] == {0: XID, **{i: HEALTH for i in range(1, 8)}}


def test_a_card_whose_registration_is_not_supported_is_unmonitored(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.errors[("device_register_events", 2)] = NvmlError("nvmlDeviceRegisterEvents: Not Supported", pynvml.NVML_ERROR_NOT_SUPPORTED)
    nvml.supported[4] = pynvml.nvmlEventTypePState  # none of the health events
    nvml.errors[("device_supported_event_types", 5)] = NvmlError("nvmlDeviceGetSupportedEventTypes: No Permission", pynvml.NVML_ERROR_NO_PERMISSION)
    events = adapter.open_health_watch()
    assert [(e.pci_address, e.kind) for e in events] == [(PCI[2], "unmonitored"), (PCI[4], "unmonitored"), (PCI[5], "unmonitored")]
    assert events[0].message == "NVML does not support health events on this card (nvmlDeviceRegisterEvents: Not Supported)"
    assert "none of NVML's health events (XID, ECC)" in events[1].message
    assert "No Permission" in events[2].message
    assert sorted(nvml.sets[0]) == [0, 1, 3, 6, 7]
    # the checks still run on them, and say why they are not watched
    checks = {c.pci_address: c for c in adapter.check_health()}
    assert checks[PCI[2]].unmonitored == events[0].message and checks[PCI[2]].answers
    assert checks[PCI[0]].unmonitored == ""


def test_a_card_lost_at_registration_is_gone(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.lost.add(3)
    events = adapter.open_health_watch()
    assert [(e.pci_address, e.kind) for e in events] == [(PCI[3], "gone")]
    assert "GPU is lost" in events[0].message
    assert 3 not in nvml.sets[0]


def test_no_event_set_leaves_every_card_unmonitored_and_the_waits_only_wait(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.errors[("event_set_create", None)] = NvmlError("nvmlEventSetCreate: Not Supported", pynvml.NVML_ERROR_NOT_SUPPORTED)
    events = adapter.open_health_watch()
    assert [e.pci_address for e in events] == PCI and {e.kind for e in events} == {"unmonitored"}
    assert "cannot make an event set" in events[0].message
    assert adapter.wait_health_events(0.01) == [] and nvml.waits == []
    assert all(c.unmonitored for c in adapter.check_health())


def test_a_card_nvml_cannot_see_is_neither_watched_nor_checked(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.hide(PCI[1])  # on vfio-pci
    assert adapter.open_health_watch() == []
    assert len(nvml.sets[0]) == 7
    assert [c.pci_address for c in adapter.check_health()] == [p for p in PCI if p != PCI[1]]


def test_open_again_replaces_the_watch(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    adapter.open_health_watch()
    assert nvml.freed == [0] and len(nvml.sets) == 2
    adapter.wait_health_events(0)
    assert nvml.waits == [(1, 0)]


# --------------------------------------------------------------------------- events


def test_an_xid_is_mapped_to_its_card_and_mig_instance(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.events = [
        NvmlEvent(index=7, event_type=XID, data=79, gi_id=2, ci_id=0),
        NvmlEvent(index=0, event_type=XID, data=48),
        # a compute instance without its GPU instance names no MIG device
        NvmlEvent(index=1, event_type=XID, data=13, gi_id=None, ci_id=0),
    ]
    events = adapter.wait_health_events(0.5)
    assert [(e.pci_address, e.kind, e.xid, e.gi, e.ci) for e in events] == [
        (PCI[7], "xid", 79, 2, 0),
        (PCI[0], "xid", 48, None, None),
        (PCI[1], "xid", 13, None, None),
    ]
    assert all(e.at.tzinfo is not None for e in events)
    # the first wait waits, the rest only take what is queued
    assert [ms for _, ms in nvml.waits] == [500, 0, 0, 0]


def test_ecc_events(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.events = [NvmlEvent(index=2, event_type=DBE), NvmlEvent(index=3, event_type=SBE), NvmlEvent(index=3, event_type=pynvml.nvmlEventTypePState)]
    events = adapter.wait_health_events(0.1)
    assert [(e.pci_address, e.kind) for e in events] == [(PCI[2], "ecc-uncorrectable"), (PCI[3], "ecc-correctable")]
    assert "double-bit" in events[0].message and "single-bit" in events[1].message


def test_a_timeout_is_no_events(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    assert adapter.wait_health_events(0.25) == []
    assert adapter.wait_health_events(-1) == []
    assert nvml.waits == [(0, 250), (0, 0)]


def test_an_event_of_a_handle_the_port_does_not_know(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.events = [NvmlEvent(index=None, event_type=XID, data=31, pci_bus_id="00000000:5D:00.0"), NvmlEvent(index=None, event_type=XID, data=31)]
    assert [(e.pci_address, e.xid) for e in adapter.wait_health_events(0)] == [(PCI[3], 31)]


def test_one_wait_takes_a_bounded_number_of_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvidia_health, "_EVENTS_MAX", 3)
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.events = [NvmlEvent(index=0, event_type=XID, data=k) for k in range(5)]
    assert [e.xid for e in adapter.wait_health_events(0)] == [0, 1, 2]
    assert [e.xid for e in adapter.wait_health_events(0)] == [3, 4]


def test_gpu_is_lost_in_the_wait_is_gone_for_the_lost_card(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.lost.add(4)
    nvml.events = [NvmlError("nvmlEventSetWait_v2: GPU is lost", pynvml.NVML_ERROR_GPU_IS_LOST)]
    events = adapter.wait_health_events(0.1)
    assert [(e.pci_address, e.kind) for e in events] == [(PCI[4], "gone")]
    assert "GPU is lost" in events[0].message
    # the set is made again without the lost card, so the others' events still come
    assert nvml.freed == [0] and sorted(nvml.sets[1]) == [0, 1, 2, 3, 5, 6, 7]
    nvml.events = [NvmlEvent(index=6, event_type=XID, data=94)]
    assert [(e.pci_address, e.xid) for e in adapter.wait_health_events(0)] == [(PCI[6], 94)]
    # the wait answering so again, for the card already reported: nothing new, and no spin
    nvml.events = [NvmlError("nvmlEventSetWait_v2: GPU is lost", pynvml.NVML_ERROR_GPU_IS_LOST)]
    started = time.monotonic()
    assert adapter.wait_health_events(0.05) == []
    assert time.monotonic() - started >= 0.04
    # and the check says the same of the card
    checks = {c.pci_address: c for c in adapter.check_health()}
    assert not checks[PCI[4]].answers and "GPU is lost" in checks[PCI[4]].message
    assert all(c.answers for p, c in checks.items() if p != PCI[4])


def test_gpu_is_lost_in_the_wait_with_no_card_lost_is_an_adapter_error(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.events = [NvmlError("nvmlEventSetWait_v2: GPU is lost", pynvml.NVML_ERROR_GPU_IS_LOST)]
    with pytest.raises(AdapterError, match="no card it watches reads as lost"):
        adapter.wait_health_events(0)


def test_a_wait_that_fails_leaves_its_cards_unmonitored(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.errors[("device_register_events", 0)] = NOT_SUPPORTED
    adapter.open_health_watch()
    nvml.events = [NvmlError("nvmlEventSetWait_v2: Unknown Error", pynvml.NVML_ERROR_UNKNOWN)]
    events = adapter.wait_health_events(0)
    assert [e.pci_address for e in events] == PCI[1:] and {e.kind for e in events} == {"unmonitored"}
    assert "event wait failed" in events[0].message
    assert nvml.freed == [0]
    assert adapter.wait_health_events(0) == [] and len(nvml.waits) == 1
    assert all(c.unmonitored for c in adapter.check_health())


# --------------------------------------------------------------------------- checks


def test_checks_read_remapped_rows_and_the_volatile_ecc_counters(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.rows[1] = (2, 1, True, False)
    nvml.rows[2] = (0, 8, False, True)
    nvml.ecc[(3, True)] = 2
    nvml.ecc[(3, False)] = 17
    checks = adapter.check_health()
    assert [c.pci_address for c in checks] == PCI
    assert checks[0] == HealthCheck(PCI[0], ecc_uncorrectable=0, ecc_correctable=0)
    assert (checks[1].row_remap_pending, checks[1].row_remap_failed) == (True, False)
    assert (checks[2].row_remap_pending, checks[2].row_remap_failed) == (False, True)
    assert (checks[3].ecc_uncorrectable, checks[3].ecc_correctable) == (2, 17)


def test_reads_a_card_does_not_support_are_no_fault(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.errors[("device_remapped_rows", 0)] = NOT_SUPPORTED
    nvml.errors[("device_total_ecc_errors", 0)] = NOT_SUPPORTED
    nvml.errors[("device_total_ecc_errors", 1)] = NvmlError("Function Not Found", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    checks = adapter.check_health()
    assert checks[0] == HealthCheck(PCI[0], answers=True, ecc_uncorrectable=None, ecc_correctable=None)
    assert (checks[1].answers, checks[1].ecc_uncorrectable, checks[1].ecc_correctable) == (True, None, None)


def test_a_lost_card_does_not_answer_its_check(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.lost.add(5)
    nvml.errors[("device_total_ecc_errors", 6)] = NvmlError("Reset Required", pynvml.NVML_ERROR_RESET_REQUIRED)
    checks = {c.pci_address: c for c in adapter.check_health()}
    assert checks[PCI[5]] == HealthCheck(PCI[5], answers=False, message="NVML: nvmlDeviceGetRemappedRows: GPU is lost")
    assert not checks[PCI[6]].answers and "Reset Required" in checks[PCI[6]].message
    assert sum(c.answers for c in checks.values()) == 6


def test_a_card_whose_pci_info_is_lost_is_named_by_the_last_scan(tmp_path: Path) -> None:
    host = load_host_file(H200)
    roots = materialize(host, tmp_path / "root")
    nvml = HealthNvml(host)
    adapter = NvidiaAdapter(nvml=nvml, sysfs_root=roots.sysfs, proc_root=roots.proc, cdi_dir=tmp_path / "cdi")
    adapter.read_capabilities()
    nvml.errors[("device_pci_bus_id", 2)] = NvmlError("nvmlDeviceGetPciInfo: GPU is lost", pynvml.NVML_ERROR_GPU_IS_LOST)
    nvml.errors[("device_pci_bus_id", 3)] = NvmlError("nvmlDeviceGetHandleByIndex: No Permission", pynvml.NVML_ERROR_NO_PERMISSION)
    checks = {c.pci_address: c for c in adapter.check_health()}
    assert len(checks) == 8
    assert not checks[PCI[2]].answers and "GPU is lost" in checks[PCI[2]].message
    assert not checks[PCI[3]].answers and "No Permission" in checks[PCI[3]].message
    events = adapter.open_health_watch()
    assert [(e.pci_address, e.kind) for e in events] == [(PCI[2], "gone"), (PCI[3], "unmonitored")]


def test_a_card_nvml_never_named_is_left_out(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)  # no scan: nothing to name it by
    nvml.errors[("device_pci_bus_id", 2)] = LOST
    assert [c.pci_address for c in adapter.check_health()] == [p for p in PCI if p != PCI[2]]


# --------------------------------------------------------------------------- the library gone


@pytest.mark.parametrize(
    "error",
    [
        DRIVER_GONE,
        NvmlError("nvmlEventSetCreate: Uninitialized", pynvml.NVML_ERROR_UNINITIALIZED),
        pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
        NvmlError("RM has detected an NVML/RM version mismatch", pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH),
    ],
    ids=["driver-not-loaded", "uninitialized", "library-not-found", "version-mismatch"],
)
def test_the_library_gone_is_an_adapter_error_everywhere(tmp_path: Path, error: Exception) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.gone = error
    for call in (adapter.open_health_watch, adapter.check_health, lambda: adapter.wait_health_events(0)):
        with pytest.raises(AdapterError) as err:
            call()
        message = str(err.value)
        assert message.startswith("NVML does not answer: ") and "\n" not in message and str(error) in message
        assert err.value.__cause__ is None
        adapter.close_health_watch()
        nvml.gone = None
        adapter.open_health_watch()
        nvml.gone = error


def test_the_library_gone_mid_open_frees_the_new_set(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    nvml.errors[("device_register_events", 4)] = DRIVER_GONE
    with pytest.raises(AdapterError, match="Driver Not Loaded"):
        adapter.open_health_watch()
    assert nvml.freed == [0]
    with pytest.raises(AdapterError, match="not open"):
        adapter.wait_health_events(0)


def test_the_library_gone_mid_wait(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.events = [NvmlEvent(index=0, event_type=XID, data=79), NvmlError("nvmlEventSetWait_v2: Driver Not Loaded", pynvml.NVML_ERROR_DRIVER_NOT_LOADED)]
    with pytest.raises(AdapterError, match="^NVML does not answer: nvmlEventSetWait_v2: Driver Not Loaded$"):
        adapter.wait_health_events(0)


# --------------------------------------------------------------------------- closing


def test_close_is_idempotent_and_the_adapter_closes_the_watch(tmp_path: Path) -> None:
    adapter, nvml = make(tmp_path)
    adapter.close_health_watch()  # none open: nothing to free
    adapter.open_health_watch()
    adapter.close_health_watch()
    adapter.close_health_watch()
    assert nvml.freed == [0]
    with pytest.raises(AdapterError, match="not open"):
        adapter.wait_health_events(0)
    adapter.open_health_watch()
    adapter.close()
    adapter.close()
    assert nvml.freed == [0, 1] and nvml.shutdowns == 1
    adapter.close_health_watch()
    for call in (adapter.open_health_watch, adapter.check_health, lambda: adapter.wait_health_events(0)):
        with pytest.raises(AdapterError, match="closed"):
            call()


def test_a_close_never_frees_the_set_under_a_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The health thread may still be in NVML's wait when the inventory stops: the close waits for it,
    and past its patience leaves freeing the set to that wait."""
    monkeypatch.setattr(nvidia_health, "_CLOSE_WAIT_SECONDS", 0.05)
    adapter, nvml = make(tmp_path)
    adapter.open_health_watch()
    nvml.blocking = threading.Event()
    result: list[Any] = []
    waiter = threading.Thread(target=lambda: result.append(adapter.wait_health_events(5)))
    waiter.start()
    while not nvml.waits:
        time.sleep(0.005)
    adapter.close_health_watch()
    assert nvml.freed == []  # the wait still holds it
    nvml.blocking.set()
    waiter.join(5)
    assert result == [[]] and nvml.freed == [0]
    with pytest.raises(AdapterError, match="not open"):
        adapter.wait_health_events(0)


# --------------------------------------------------------------------------- nvidia_health alone


def health_on(tmp_path: Path) -> tuple[NvidiaHealth, HealthNvml, NvidiaDiscovery]:
    """NvidiaHealth on its own: the port initialised by the test, a scan of its own (no adapter)."""
    host = load_host_file(H200)
    roots = materialize(host, tmp_path / "root")
    nvml = HealthNvml(host)
    nvml.init()
    scan = NvidiaDiscovery(nvml, sysfs_root=roots.sysfs, proc_root=roots.proc)
    return NvidiaHealth(nvml, scan), nvml, scan


def test_health_names_cards_by_the_scan_it_shares_as_that_scan_changes(tmp_path: Path) -> None:
    """The watch reads the scan's index -> PCI map at each call (the scan replaces it whole), so a card
    whose PCI info NVML no longer reads is named by the newest scan, at its new NVML index."""
    health, nvml, scan = health_on(tmp_path)

    def rescan() -> None:
        nvml.errors.pop(("device_pci_bus_id", 3), None)
        scan.read_capabilities()
        nvml.errors[("device_pci_bus_id", 3)] = LOST  # from now on NVML cannot read index 3's PCI info

    nvml.errors[("device_pci_bus_id", 3)] = LOST
    assert PCI[3] not in {c.pci_address for c in health.check_health()}  # no scan yet: nothing to name it by
    rescan()
    assert [c.pci_address for c in health.check_health() if not c.answers] == [PCI[3]]
    nvml.hide(PCI[0])  # NVML's indices shift down by one; index 3 is now 0000:9a:00.0
    rescan()
    checks = health.check_health()
    assert [c.pci_address for c in checks if not c.answers] == [PCI[4]]
    assert [c.pci_address for c in checks] == PCI[1:]


def test_health_close_refuses_every_later_call_and_leaves_nvml_to_its_owner(tmp_path: Path) -> None:
    health, nvml, _ = health_on(tmp_path)
    assert health.open_health_watch() == []
    health.close()
    assert nvml.freed == [0]
    assert nvml.shutdowns == 0  # shutting NVML down is the adapter's, after this
    for call in (health.open_health_watch, health.check_health, lambda: health.wait_health_events(0)):
        with pytest.raises(AdapterError, match=r"^NVML is shut down: the nvidia adapter is closed$"):
            call()
    health.close_health_watch()
    health.close()
    assert nvml.freed == [0]


def test_health_sorts_each_nvml_failure_three_ways(tmp_path: Path) -> None:
    """At registration: a card lost is gone, a feature lacking or another refusal is unmonitored (each
    with its own reason), and the library gone is an AdapterError that leaves no set behind."""
    health, nvml, _ = health_on(tmp_path)
    nvml.errors[("device_register_events", 1)] = NvmlError("Reset Required", pynvml.NVML_ERROR_RESET_REQUIRED)
    nvml.errors[("device_register_events", 2)] = NvmlError("Function Not Found", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    nvml.errors[("device_register_events", 3)] = NvmlError("No Permission", pynvml.NVML_ERROR_NO_PERMISSION)
    nvml.supported[4] = pynvml.nvmlEventTypePState  # none of the health events
    events = {e.pci_address: e for e in health.open_health_watch()}
    assert {pci: e.kind for pci, e in events.items()} == {PCI[1]: "gone", PCI[2]: "unmonitored", PCI[3]: "unmonitored", PCI[4]: "unmonitored"}
    assert events[PCI[2]].message == "NVML does not support health events on this card (Function Not Found)"
    assert events[PCI[3]].message == "NVML could not register health events for this card (No Permission)"
    assert events[PCI[4]].message.startswith("the card reports none of NVML's health events")
    assert sorted(nvml.sets[0]) == [0, 5, 6, 7]
    assert {c.pci_address: c.unmonitored != "" for c in health.check_health()} == {p: k in (2, 3, 4) for k, p in enumerate(PCI)}
    nvml.errors[("device_register_events", 5)] = NvmlError("Uninitialized", pynvml.NVML_ERROR_UNINITIALIZED)
    with pytest.raises(AdapterError, match="^NVML does not answer: Uninitialized$"):
        health.open_health_watch()
    assert nvml.freed == [0, 1]  # the old watch's set, and the new one it was building


# --------------------------------------------------------------------------- PynvmlNvml on pynvml


def _pynvml_names() -> set[str]:
    """Every `pynvml.<name>` the nvidia adapter's modules (nvidia.py and nvidia_*.py) use."""
    modules = sorted(Path(nvidia_health.__file__).parent.glob("nvidia*.py"))
    assert {m.name for m in modules} >= {"nvidia.py", "nvidia_nvml.py", "nvidia_discovery.py", "nvidia_mig.py", "nvidia_health.py"}
    return {name for m in modules for name in re.findall(r"\bpynvml\.(\w+)", m.read_text())}


def test_every_pynvml_name_the_adapter_uses_exists() -> None:
    names = _pynvml_names()
    for needed in (
        "nvmlEventSetCreate",
        "nvmlEventSetFree",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait_v2",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetTotalEccErrors",
        "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
        "NVML_MEMORY_ERROR_TYPE_CORRECTED",
        "NVML_VOLATILE_ECC",
        "nvmlEventTypeXidCriticalError",
        "nvmlEventTypeDoubleBitEccError",
        "nvmlEventTypeSingleBitEccError",
        "NVML_ERROR_TIMEOUT",
        "NVML_ERROR_GPU_IS_LOST",
    ):
        assert needed in names
    assert sorted(n for n in names if not hasattr(pynvml, n)) == []
    # the event data's fields, read by name from NVML's struct
    fields = {name for name, _ in pynvml.c_nvmlEventData_t._fields_}
    assert {"device", "eventType", "eventData", "gpuInstanceId", "computeInstanceId"} <= fields


class StubNvml:
    """The library behind pynvml's functions: two cards, an event queue, counters; records the calls."""

    def __init__(self) -> None:
        self.buffers = [ctypes.c_int(k) for k in range(3)]  # what the handles point at (kept alive)
        self.handles = [ctypes.cast(ctypes.pointer(b), pynvml.c_nvmlDevice_t) for b in self.buffers]
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.queue: list[Any] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def fn(name: str, body: Any) -> None:
            def call(*args: Any) -> Any:
                self.calls.append((name, args))
                return body(*args)

            call.__name__ = name
            monkeypatch.setattr(pynvml, name, call)  # raising: a name pynvml lacks fails here

        def pci(handle: Any) -> Any:
            k = next(k for k, h in enumerate(self.handles) if ctypes.cast(h, ctypes.c_void_p).value == ctypes.cast(handle, ctypes.c_void_p).value)
            info = pynvml.nvmlPciInfo_t()
            info.busId = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:99:00.0"][k].encode()
            return info

        def wait(event_set: Any, timeout_ms: int) -> Any:
            if not self.queue:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            got = self.queue.pop(0)
            if isinstance(got, Exception):
                raise got
            return got

        def ecc(handle: Any, kind: int, counter: int) -> int:
            assert counter == pynvml.NVML_VOLATILE_ECC
            return 5 if kind == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 40

        def rows(handle: Any) -> tuple[int, int, int, int]:
            if ctypes.cast(handle, ctypes.c_void_p).value == ctypes.cast(self.handles[1], ctypes.c_void_p).value:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return (3, 1, 1, 0)

        fn("nvmlInit", lambda: None)
        fn("nvmlShutdown", lambda: None)
        fn("nvmlDeviceGetCount", lambda: 2)
        fn("nvmlDeviceGetHandleByIndex", lambda k: self.handles[k])
        fn("nvmlDeviceGetPciInfo", pci)
        fn("nvmlEventSetCreate", lambda: "the-set")
        fn("nvmlEventSetFree", lambda s: None)
        fn("nvmlDeviceGetSupportedEventTypes", lambda h: HEALTH | pynvml.nvmlEventTypeClock)
        fn("nvmlDeviceRegisterEvents", lambda h, types, s: None)
        fn("nvmlEventSetWait_v2", wait)
        fn("nvmlDeviceGetRemappedRows", rows)
        fn("nvmlDeviceGetTotalEccErrors", ecc)

    def event(self, k: int, event_type: int, data: int = 0, gi: int = NO_INSTANCE, ci: int = NO_INSTANCE) -> Any:
        e = pynvml.c_nvmlEventData_t()
        # a new pointer object to the same device, as NVML's event data holds
        e.device = ctypes.cast(ctypes.pointer(self.buffers[k]), pynvml.c_nvmlDevice_t)
        e.eventType, e.eventData, e.gpuInstanceId, e.computeInstanceId = event_type, data, gi, ci
        return e

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [args for n, args in self.calls if n == name]


def test_pynvml_port_maps_events_and_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = StubNvml()
    stub.install(monkeypatch)
    port = PynvmlNvml()
    port.init()
    event_set = port.event_set_create()
    assert port.device_supported_event_types(1) == HEALTH | pynvml.nvmlEventTypeClock
    port.device_register_events(0, HEALTH, event_set)
    port.device_register_events(1, XID, event_set)
    assert stub.named("nvmlDeviceRegisterEvents") == [(stub.handles[0], HEALTH, "the-set"), (stub.handles[1], XID, "the-set")]

    stub.queue = [stub.event(1, XID, 79, gi=3, ci=0), stub.event(0, DBE), stub.event(2, XID, 48)]
    assert port.event_set_wait(event_set, 500) == NvmlEvent(index=1, event_type=XID, data=79, gi_id=3, ci_id=0)
    assert stub.named("nvmlEventSetWait_v2")[-1] == ("the-set", 500)
    assert port.event_set_wait(event_set, 0) == NvmlEvent(index=0, event_type=DBE, data=0, gi_id=None, ci_id=None)
    # a handle the port never got: named by its PCI bus id
    assert port.event_set_wait(event_set, 0) == NvmlEvent(index=None, event_type=XID, data=48, pci_bus_id="00000000:99:00.0")
    assert port.event_set_wait(event_set, 0) is None  # NVML_ERROR_TIMEOUT

    stub.queue = [pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)]
    with pytest.raises(NvmlError) as err:
        port.event_set_wait(event_set, 0)
    assert err.value.code == pynvml.NVML_ERROR_GPU_IS_LOST and str(err.value) == "nvmlEventSetWait_v2: GPU is lost"

    assert port.device_remapped_rows(0) == (3, 1, True, False)
    with pytest.raises(NvmlError) as err:
        port.device_remapped_rows(1)
    assert err.value.code == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert port.device_total_ecc_errors(0, uncorrected=True) == 5
    assert port.device_total_ecc_errors(0, uncorrected=False) == 40
    assert [args[1:] for args in stub.named("nvmlDeviceGetTotalEccErrors")] == [
        (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
        (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC),
    ]
    port.event_set_free(event_set)
    assert stub.named("nvmlEventSetFree") == [("the-set",)]


def test_the_adapter_on_pynvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """open, wait, check and close through PynvmlNvml, with only pynvml's functions stubbed."""
    stub = StubNvml()
    stub.install(monkeypatch)
    adapter = NvidiaAdapter(sysfs_root=tmp_path, proc_root=tmp_path, cdi_dir=tmp_path)
    assert isinstance(adapter.nvml, PynvmlNvml)
    assert adapter.open_health_watch() == []
    assert len(stub.named("nvmlDeviceRegisterEvents")) == 2
    stub.queue = [stub.event(1, XID, 79, gi=1, ci=0), stub.event(0, SBE)]
    events = adapter.wait_health_events(0.2)
    assert [(e.pci_address, e.kind, e.xid, e.gi, e.ci) for e in events] == [("0000:2a:00.0", "xid", 79, 1, 0), ("0000:18:00.0", "ecc-correctable", None, None, None)]
    assert [args[1] for args in stub.named("nvmlEventSetWait_v2")] == [200, 0, 0]
    checks = adapter.check_health()
    assert checks == [
        HealthCheck("0000:18:00.0", row_remap_pending=True, ecc_uncorrectable=5, ecc_correctable=40),
        HealthCheck("0000:2a:00.0", ecc_uncorrectable=5, ecc_correctable=40),  # no row remapper: not a fault
    ]
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: (_ for _ in ()).throw(pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)))
    with pytest.raises(AdapterError, match="^NVML does not answer: .*Uninitialized$"):
        adapter.check_health()
    adapter.close()
    assert stub.named("nvmlEventSetFree") == [("the-set",)]
    assert len(stub.named("nvmlShutdown")) == 1


def test_real_nvml_health_watch(tmp_path: Path) -> None:
    """On a host where NVML works: the watch opens, waits, checks and closes on the real library."""
    probe = PynvmlNvml()
    try:
        probe.init()
    except NvmlError:
        pytest.skip("NVML is not available on this machine")
    probe.shutdown()
    adapter = NvidiaAdapter(sysfs_root=tmp_path, proc_root=tmp_path, cdi_dir=tmp_path)
    try:
        unwatched = adapter.open_health_watch()
        assert {e.kind for e in unwatched} <= {"unmonitored", "gone"}
        assert isinstance(adapter.wait_health_events(0.1), list)
        checks = adapter.check_health()
        assert len(checks) == adapter.nvml.device_count()
        assert all(c.answers for c in checks), checks
    finally:
        adapter.close()
