"""GPU health (issue 30): the rules (health.py) as tables, the tracker that keeps them in gpus.json,
the fake host's watch and checks, and the inventory's options."""

from __future__ import annotations

import json
import shutil
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.inventory.adapters.base import AdapterError, HealthCheck, HealthEvent, HealthWatcher
from services.inventory.adapters.fakehost import HostFileError, load_host_file
from services.inventory.adapters.fakehw import FakeHwAdapter
from services.inventory.build import build_inventory
from services.inventory.gpustate import GpuTracker, decode_state, encode_state
from services.inventory.health import (
    CHECKED,
    ECC_CORRECTABLE,
    ECC_UNCORRECTABLE,
    GPU_LOST,
    NOT_CHECKED,
    ROW_REMAP_FAILED,
    ROW_REMAP_PENDING,
    UNMONITORED,
    XID_CRITICAL,
    CardHealth,
    HealthPolicy,
    apply_check,
    apply_event,
    healthy_condition,
    off_library,
)
from services.inventory.healthintake import HealthIntake, policy_from, watched_cards
from services.inventory.healthwatch import HealthNews, HealthThread
from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[2]
ONE_GPU = REPO / "examples" / "hosts" / "one-gpu.json"
PCI = "0000:01:00.0"
T0 = datetime(2026, 12, 3, 10, 0, tzinfo=timezone.utc)
POLICY = HealthPolicy()


def xid(n: int, at: datetime = T0, **kw: Any) -> HealthEvent:
    return HealthEvent(PCI, "xid", at, xid=n, **kw)


def check(**kw: Any) -> HealthCheck:
    return HealthCheck(PCI, **kw)


# --------------------------------------------------------------------------- the rules: events


@pytest.mark.parametrize(
    ("event", "outcome", "reasons"),
    [
        pytest.param(xid(79), "fatal", {XID_CRITICAL}, id="xid-79-fallen-off-the-bus"),
        pytest.param(xid(48), "fatal", {XID_CRITICAL}, id="xid-48-dbe"),
        pytest.param(xid(94), "fatal", {XID_CRITICAL}, id="xid-94-contained"),
        pytest.param(xid(95), "fatal", {XID_CRITICAL}, id="xid-95-uncontained"),
        pytest.param(xid(63), "fatal", {XID_CRITICAL}, id="xid-63-row-remap"),
        pytest.param(xid(64), "fatal", {XID_CRITICAL}, id="xid-64-remap-failure"),
        pytest.param(xid(119), "fatal", {XID_CRITICAL}, id="xid-119-gsp-timeout"),
        pytest.param(xid(120), "fatal", {XID_CRITICAL}, id="xid-120-gsp"),
        pytest.param(xid(9999), "fatal", {XID_CRITICAL}, id="unknown-xid-is-fatal"),
        *[pytest.param(xid(n), "ignored", set(), id=f"application-xid-{n}") for n in (13, 31, 43, 45, 68, 109)],
        pytest.param(HealthEvent(PCI, "ecc-uncorrectable", T0), "fatal", {ECC_UNCORRECTABLE}, id="dbe-event"),
        pytest.param(HealthEvent(PCI, "ecc-correctable", T0), "noted", set(), id="sbe-event-counted-only"),
        pytest.param(HealthEvent(PCI, "gone", T0), "fatal", {GPU_LOST}, id="gone"),
        pytest.param(HealthEvent(PCI, "unmonitored", T0, message="no events"), "unmonitored", {UNMONITORED}, id="unmonitored"),
    ],
)
def test_an_event_makes_its_fault(event: HealthEvent, outcome: str, reasons: set[str]) -> None:
    h = CardHealth()
    got, changed = apply_event(h, event, POLICY, "boot-1")
    assert got == outcome
    assert set(h.faults) == reasons
    assert changed == bool(reasons)


def test_the_operator_chooses_which_xids_count() -> None:
    policy = HealthPolicy(ignored_xids=POLICY.ignored_xids | {79}, fatal_xids=frozenset({43}))
    h = CardHealth()
    assert apply_event(h, xid(79), policy, "b")[0] == "ignored"
    assert apply_event(h, xid(43), policy, "b")[0] == "fatal"
    assert set(h.faults) == {XID_CRITICAL}
    assert "XID 43" in h.faults[XID_CRITICAL].message


def test_a_repeated_xid_counts_and_keeps_its_first_instant() -> None:
    h = CardHealth()
    assert apply_event(h, xid(79, T0, gi=1, ci=0), POLICY, "b") == ("fatal", True)
    # seen again (another fatal XID too): counted, nothing new to say or publish
    assert apply_event(h, xid(48, T0 + timedelta(seconds=5)), POLICY, "b") == ("fatal", False)
    f = h.faults[XID_CRITICAL]
    assert (f.at, f.count, f.xid) == (T0, 2, 79)
    assert f.message.startswith("XID 79 (GPU has fallen off the bus) on MIG gi1/ci0 at 2026-12-03T10:00:00Z")
    assert apply_check(h, check(row_remap_pending=True), POLICY, boot_id="b", now=T0)[0] is True
    assert apply_check(h, check(row_remap_pending=True), POLICY, boot_id="b", now=T0)[0] is False  # the same every interval
    first = CardHealth()
    apply_event(first, xid(79, T0, gi=1, ci=0), POLICY, "b")
    assert "XID 79 (GPU has fallen off the bus) on MIG gi1/ci0 at 2026-12-03T10:00:00Z" == first.faults[XID_CRITICAL].message


# --------------------------------------------------------------------------- the rules: checks and recovery


def sick(*reasons: str, boot: str = "boot-1") -> CardHealth:
    h = CardHealth(checked_at=T0)
    for r in reasons:
        if r == XID_CRITICAL:
            apply_event(h, xid(79), POLICY, boot)
        elif r == GPU_LOST:
            apply_event(h, HealthEvent(PCI, "gone", T0), POLICY, boot)
        elif r == ECC_UNCORRECTABLE:
            apply_event(h, HealthEvent(PCI, "ecc-uncorrectable", T0), POLICY, boot)
        else:
            apply_check(h, check(row_remap_pending=r == ROW_REMAP_PENDING, row_remap_failed=r == ROW_REMAP_FAILED), POLICY, boot_id=boot, now=T0)
    return h


CHECK_CASES = [
    # (row, faults before, the check, boot now, recheck, faults after)
    pytest.param((), check(), "boot-1", False, set(), id="nothing-to-do"),
    pytest.param((), check(answers=False), "boot-1", False, {GPU_LOST}, id="lost"),
    pytest.param((), check(row_remap_pending=True), "boot-1", False, {ROW_REMAP_PENDING}, id="remap-pending"),
    pytest.param((ROW_REMAP_PENDING,), check(), "boot-1", False, set(), id="remap-done-after-a-reset"),
    pytest.param((), check(row_remap_failed=True), "boot-1", False, {ROW_REMAP_FAILED}, id="remap-failed"),
    pytest.param((), check(ecc_uncorrectable=1), "boot-1", False, {ECC_UNCORRECTABLE}, id="dbe-counter"),
    pytest.param((), check(ecc_uncorrectable=0, ecc_correctable=10**6), "boot-1", False, set(), id="sbe-no-limit"),
    pytest.param((XID_CRITICAL,), check(), "boot-1", False, {XID_CRITICAL}, id="xid-stays-after-a-clean-check"),
    pytest.param((GPU_LOST,), check(), "boot-1", False, {GPU_LOST}, id="lost-stays-after-a-clean-check"),
    pytest.param((XID_CRITICAL, ECC_UNCORRECTABLE), check(), "boot-2", False, set(), id="reboot-and-clean-clears"),
    pytest.param((XID_CRITICAL,), check(ecc_uncorrectable=3), "boot-2", False, {XID_CRITICAL, ECC_UNCORRECTABLE}, id="reboot-unclean-stays"),
    pytest.param((XID_CRITICAL,), check(answers=False), "boot-2", False, {XID_CRITICAL, GPU_LOST}, id="reboot-still-lost"),
    pytest.param((XID_CRITICAL, GPU_LOST), check(), "boot-1", True, set(), id="recheck-after-reset-clears"),
    pytest.param((XID_CRITICAL,), check(row_remap_pending=True), "boot-1", True, {XID_CRITICAL, ROW_REMAP_PENDING}, id="recheck-unclean-stays"),
    pytest.param((ROW_REMAP_FAILED,), check(), "boot-1", True, set(), id="recheck-clears-remap-failed"),
]


@pytest.mark.parametrize(("before", "the_check", "boot", "recheck", "after"), CHECK_CASES)
def test_check_table(before: tuple[str, ...], the_check: HealthCheck, boot: str, recheck: bool, after: set[str]) -> None:
    h = sick(*before)
    apply_check(h, the_check, POLICY, boot_id=boot, now=T0 + timedelta(minutes=1), recheck=recheck)
    assert set(h.faults) == after


def test_the_correctable_threshold_is_a_level() -> None:
    policy = HealthPolicy(ecc_correctable_max=100)
    h = CardHealth()
    apply_check(h, check(ecc_correctable=101), policy, boot_id="b", now=T0)
    assert set(h.faults) == {ECC_CORRECTABLE}
    apply_check(h, check(ecc_correctable=0), policy, boot_id="b", now=T0)
    assert h.faults == {}


def test_a_fault_seen_again_in_the_new_boot_is_not_cleared_by_the_reboot() -> None:
    h = sick(XID_CRITICAL, boot="boot-1")
    apply_event(h, xid(79, T0 + timedelta(hours=1)), POLICY, "boot-2")  # it threw again after the reboot
    apply_check(h, check(), POLICY, boot_id="boot-2", now=T0 + timedelta(hours=1))
    assert set(h.faults) == {XID_CRITICAL}


@pytest.mark.parametrize(
    ("faults", "policy", "watched", "status", "reason"),
    [
        pytest.param((), POLICY, True, "True", CHECKED, id="healthy"),
        pytest.param((XID_CRITICAL,), POLICY, True, "False", XID_CRITICAL, id="xid"),
        pytest.param((ROW_REMAP_PENDING, GPU_LOST, XID_CRITICAL), POLICY, True, "False", GPU_LOST, id="worst-first"),
        pytest.param((UNMONITORED,), POLICY, True, "Unknown", UNMONITORED, id="unmonitored-alone"),
        pytest.param((UNMONITORED, ROW_REMAP_PENDING), POLICY, True, "False", ROW_REMAP_PENDING, id="unmonitored-and-sick"),
        pytest.param((), HealthPolicy(enabled=False), True, "Unknown", UNMONITORED, id="checks-off"),
        pytest.param((), POLICY, False, "Unknown", UNMONITORED, id="adapter-cannot-watch"),
    ],
)
def test_condition_table(faults: tuple[str, ...], policy: HealthPolicy, watched: bool, status: str, reason: str) -> None:
    h = CardHealth(checked_at=T0)
    for r in faults:
        if r == UNMONITORED:
            apply_event(h, HealthEvent(PCI, "unmonitored", T0, message="cannot register"), POLICY, "b")
        else:
            h.faults.update(sick(r).faults)
    c = healthy_condition(h, policy, now=T0, watched=watched)
    assert (c.type, c.status, c.reason) == ("Healthy", status, reason)
    if policy.enabled and watched and faults:
        assert not c.message.startswith(f"{reason}:")  # the reason is the condition's, not repeated
        for r in faults:
            if r != reason:
                assert f"also {r}:" in c.message


def test_a_card_never_checked_reads_unknown() -> None:
    assert healthy_condition(None, POLICY, now=T0).reason == NOT_CHECKED
    assert healthy_condition(CardHealth(), POLICY, now=T0).status == "Unknown"


def test_a_card_the_library_cannot_see_is_never_checked_and_keeps_its_faults() -> None:
    """D2: a card on vfio-pci whose record holds a clean check of earlier read True/Checked ('the
    vendor library answers'). Off the library it is NotChecked; a fault it had stays; Unmonitored
    (about registering its events) does not describe it any more."""
    h = CardHealth()
    apply_check(h, check(), POLICY, boot_id="b", now=T0)
    assert healthy_condition(h, POLICY, now=T0).reason == CHECKED
    c = healthy_condition(h, POLICY, now=T0, unseen="on vfio-pci")
    assert (c.status, c.reason) == ("Unknown", NOT_CHECKED)
    assert "on vfio-pci" in c.message and "answers" not in c.message
    apply_event(h, HealthEvent(PCI, "unmonitored", T0, message="no events"), POLICY, "b")
    assert healthy_condition(h, POLICY, now=T0, unseen="on vfio-pci").reason == NOT_CHECKED
    apply_event(h, xid(79), POLICY, "b")
    c = healthy_condition(h, POLICY, now=T0, unseen="on vfio-pci")
    assert (c.status, c.reason) == ("False", XID_CRITICAL) and "Unmonitored" not in c.message


def test_off_library_forgets_the_last_check_and_keeps_the_faults() -> None:
    h = CardHealth()
    apply_check(h, check(row_remap_pending=True, ecc_correctable=3, unmonitored="no events"), POLICY, boot_id="b", now=T0)
    apply_event(h, xid(79), POLICY, "b")
    assert off_library(h)
    assert h.checked_at is None and h.ecc_correctable is None
    assert set(h.faults) == {XID_CRITICAL, ROW_REMAP_PENDING}
    assert not off_library(h)  # idempotent
    assert healthy_condition(CardHealth(faults={}), POLICY, now=T0).reason == NOT_CHECKED


# --------------------------------------------------------------------------- the tracker


def inventory(host: Path) -> Any:
    adapter = FakeHwAdapter(host, cdi_dir=host.parent)
    return build_inventory(adapter, node_id="node-1", revision=1, now=T0)


def tracker(**kw: Any) -> GpuTracker:
    clock = [T0]
    t = GpuTracker("node-1", clock=lambda: clock[0], health=HealthPolicy(), **kw)
    t.clock_cell = clock  # type: ignore[attr-defined]
    return t


def test_a_fatal_xid_makes_the_card_failed_and_says_so_upstream(tmp_path: Path) -> None:
    inv = inventory(ONE_GPU)
    t = tracker()
    t.note_health_checks([check()], boot_id=inv.boot_id)
    first = t.evaluate(inv, None)
    card = first.inventory.gpus[0]
    assert card.status.health().status == "True"  # type: ignore[union-attr]
    assert card.status.phase == "Ready"
    outcome, changed = t.note_health_event(xid(79), boot_id=inv.boot_id)
    assert (outcome, changed) == ("fatal", True)
    second = t.evaluate(inv, None)
    card = second.inventory.gpus[0]
    assert card.status.phase == "Failed"
    assert card.status.unhealthy() is not None and card.status.unhealthy().reason == XID_CRITICAL  # type: ignore[union-attr]
    [event] = second.events
    assert event.event.phase == "Failed"
    assert any(c.type == "Healthy" and c.status == "False" for c in event.event.status.conditions)


def test_an_ignored_xid_changes_nothing() -> None:
    inv = inventory(ONE_GPU)
    t = tracker()
    t.note_health_checks([check()], boot_id=inv.boot_id)
    t.evaluate(inv, None)
    before = encode_state(t.state)
    assert t.note_health_event(xid(43), boot_id=inv.boot_id) == ("ignored", False)
    assert encode_state(t.state) == before
    assert t.evaluate(inv, None).events == []


def test_health_survives_the_state_file_and_a_card_that_fell_off_the_bus(tmp_path: Path) -> None:
    inv = inventory(ONE_GPU)
    t = tracker()
    t.note_health_checks([check()], boot_id=inv.boot_id)
    t.note_health_event(HealthEvent(PCI, "gone", T0), boot_id=inv.boot_id)
    t.evaluate(inv, None)
    gone = type(inv)(**{**{f: getattr(inv, f) for f in inv.__struct_fields__}, "gpus": [], "atoms": []})
    t.evaluate(gone, None)  # not listed: a sticky fault keeps the record
    restored = GpuTracker("node-1", clock=lambda: T0, health=HealthPolicy(), state=decode_state(encode_state(t.state)))
    back = restored.evaluate(inv, None).inventory.gpus[0]
    assert back.status.unhealthy() is not None and back.status.unhealthy().reason == GPU_LOST  # type: ignore[union-attr]


def test_a_reboot_and_a_clean_check_bring_the_card_back() -> None:
    inv = inventory(ONE_GPU)
    t = tracker()
    t.note_health_event(xid(79), boot_id="boot-1")
    t.note_health_checks([check()], boot_id="boot-1")
    assert t.evaluate(inv, None).inventory.gpus[0].status.phase == "Failed"
    changed, cleared = t.note_health_checks([check()], boot_id="boot-2")
    assert changed and cleared == {PCI: [XID_CRITICAL]}
    assert t.evaluate(inv, None).inventory.gpus[0].status.phase == "Ready"


def test_the_library_gone_loses_every_watched_card() -> None:
    inv = inventory(ONE_GPU)
    t = tracker()
    assert t.note_library_gone(watched_cards(inv), "NVML: Driver Not Loaded", boot_id="b")
    card = t.evaluate(inv, None).inventory.gpus[0]
    assert card.status.unhealthy().reason == GPU_LOST  # type: ignore[union-attr]
    assert "Driver Not Loaded" in card.status.unhealthy().message  # type: ignore[union-attr]


def on_driver(inv: Any, driver: str) -> Any:
    """`inv` with its one card bound to `driver` (as a scan reads it: vfio-pci is Passthrough)."""
    from shared.schemas import DriverBinding

    g = inv.gpus[0]
    mode = "Passthrough" if driver == "vfio-pci" else ("None" if not driver else "Compute")
    status = type(g.status)(
        phase=g.status.phase, driver_binding=DriverBinding(driver=driver, mode=mode, management_state="Unknown"), conditions=g.status.conditions
    )
    card = type(g)(**{**{f: getattr(g, f) for f in g.__struct_fields__}, "driver": driver, "status": status})
    return type(inv)(**{**{f: getattr(inv, f) for f in inv.__struct_fields__}, "gpus": [card]})


def test_a_card_moved_to_vfio_reads_not_checked_until_a_check_on_its_compute_driver() -> None:
    """D2: the card moved to vfio-pci kept Healthy=True/Checked from its last check on nvidia; back
    on nvidia it must read NotChecked until the library checked it again there."""
    inv = inventory(ONE_GPU)
    t = tracker()
    t.note_health_checks([check()], boot_id=inv.boot_id)
    assert t.evaluate(inv, None).inventory.gpus[0].status.health().reason == CHECKED  # type: ignore[union-attr]
    for driver in ("vfio-pci", ""):
        c = t.evaluate(on_driver(inv, driver), None).inventory.gpus[0].status.health()
        assert c is not None and (c.status, c.reason) == ("Unknown", NOT_CHECKED), driver
        assert "answers" not in c.message
    back = t.evaluate(inv, None).inventory.gpus[0].status.health()
    assert back is not None and back.reason == NOT_CHECKED  # no check of it since it came back
    t.note_health_checks([check()], boot_id=inv.boot_id)
    assert t.evaluate(inv, None).inventory.gpus[0].status.health().reason == CHECKED  # type: ignore[union-attr]
    # a sticky fault it had stays through the passthrough
    t.note_health_event(xid(79), boot_id=inv.boot_id)
    c = t.evaluate(on_driver(inv, "vfio-pci"), None).inventory.gpus[0].status.health()
    assert c is not None and (c.status, c.reason) == ("False", XID_CRITICAL)


def test_a_tracker_told_nothing_of_health_adds_no_condition() -> None:
    inv = inventory(ONE_GPU)
    t = GpuTracker("node-1", clock=lambda: T0)
    assert t.evaluate(inv, None).inventory.gpus[0].status.health() is None


# --------------------------------------------------------------------------- the fake host's watch


def host_copy(tmp_path: Path) -> Path:
    path = tmp_path / "host.json"
    shutil.copy(ONE_GPU, path)
    return path


def change(path: Path, fn: Any) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def health_of(doc: dict) -> dict:
    return doc["gpus"][0].setdefault("health", {})


def test_the_fake_adapter_is_a_health_watcher(tmp_path: Path) -> None:
    assert isinstance(FakeHwAdapter(host_copy(tmp_path), cdi_dir=tmp_path), HealthWatcher)


def test_the_fake_watch_reports_what_happens_after_it_opened(tmp_path: Path) -> None:
    path = host_copy(tmp_path)
    change(path, lambda d: health_of(d).update(xids=[{"xid": 48, "at": "2026-12-03T09:00:00Z"}]))
    a = FakeHwAdapter(path, cdi_dir=tmp_path)
    assert a.open_health_watch() == []
    assert a.wait_health_events(0.05) == []  # the XID from before the watch is not news
    change(path, lambda d: health_of(d)["xids"].append({"xid": 79, "at": "2026-12-03T10:00:00Z", "gi": 1, "ci": 0}))
    [e] = a.wait_health_events(2.0)
    assert (e.pci_address, e.kind, e.xid, e.gi, e.ci, e.at) == (PCI, "xid", 79, 1, 0, T0)
    change(path, lambda d: health_of(d).update(ecc_uncorrectable=2, ecc_correctable=5, gone=True))
    kinds = sorted(e.kind for e in a.wait_health_events(2.0))
    assert kinds == ["ecc-correctable", "ecc-uncorrectable", "gone"]
    assert a.wait_health_events(0.05) == []


def test_a_watched_card_that_falls_off_the_bus_is_a_gone_event_and_one_on_vfio_is_not(tmp_path: Path) -> None:
    """Issue 41 (2): `present: false` was only seen by the next scan (30 s); NVML says GPU_IS_LOST at once."""
    path = host_copy(tmp_path)
    a = FakeHwAdapter(path, cdi_dir=tmp_path)
    assert a.open_health_watch() == []
    change(path, lambda d: d["gpus"][0].update(driver="vfio-pci"))
    assert a.wait_health_events(0.3) == []  # moved to vfio-pci: out of NVML's sight, not lost
    change(path, lambda d: d["gpus"][0].update(driver="nvidia"))
    assert a.wait_health_events(0.3) == []  # watched again
    change(path, lambda d: d["gpus"][0].update(present=False))
    [e] = a.wait_health_events(2.0)
    assert (e.pci_address, e.kind) == (PCI, "gone") and "fell off the bus" in e.message
    assert a.wait_health_events(0.2) == []  # said once


def test_the_fake_checks_and_the_library_gone(tmp_path: Path) -> None:
    path = host_copy(tmp_path)
    a = FakeHwAdapter(path, cdi_dir=tmp_path)
    assert a.check_health() == [HealthCheck(PCI, ecc_uncorrectable=0, ecc_correctable=0)]
    change(path, lambda d: health_of(d).update(row_remap_pending=True, unmonitored=True))
    [c] = a.check_health()
    assert c.row_remap_pending and c.unmonitored
    assert [e.kind for e in a.open_health_watch()] == ["unmonitored"]
    change(path, lambda d: d["gpus"][0].update(driver="vfio-pci"))
    assert a.check_health() == []  # NVML does not see a card on vfio-pci
    change(path, lambda d: d.update(nvml_gone=True))
    for call in (a.check_health, a.open_health_watch, a.read_capabilities):
        with pytest.raises(AdapterError, match="Driver Not Loaded"):
            call()


def test_a_gone_card_is_not_read(tmp_path: Path) -> None:
    path = host_copy(tmp_path)
    change(path, lambda d: health_of(d).update(gone=True))
    [card] = FakeHwAdapter(path, cdi_dir=tmp_path).read_capabilities().gpus
    assert card.readable is False


def test_a_host_file_health_typo_is_refused(tmp_path: Path) -> None:
    path = host_copy(tmp_path)
    change(path, lambda d: health_of(d).update(xid=[79]))
    with pytest.raises(HostFileError, match=r"health"):
        load_host_file(path)


# --------------------------------------------------------------------------- the thread and the intake


class ScriptedWatcher:
    """A HealthWatcher whose answers a test scripts."""

    def __init__(self) -> None:
        self.events: list[list[HealthEvent]] = []
        self.gone = False
        self.opened = 0
        self.closed = 0

    def open_health_watch(self) -> list[HealthEvent]:
        if self.gone:
            raise AdapterError("NVML: Driver Not Loaded")
        self.opened += 1
        return []

    def wait_health_events(self, timeout: float) -> list[HealthEvent]:
        if self.gone:
            raise AdapterError("NVML: Driver Not Loaded")
        time.sleep(min(timeout, 0.01))
        return self.events.pop(0) if self.events else []

    def check_health(self) -> list[HealthCheck]:
        if self.gone:
            raise AdapterError("NVML: Driver Not Loaded")
        return [check()]

    def close_health_watch(self) -> None:
        self.closed += 1


def test_the_thread_reports_events_checks_and_the_library_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    import services.inventory.healthwatch as hw

    monkeypatch.setattr(hw, "RETRY_SECONDS", 0.05)
    watcher = ScriptedWatcher()
    watcher.events.append([xid(79)])
    got: list[HealthNews] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        thread = HealthThread(watcher, loop, got.append, interval=0.05, log=SimpleNamespace(exception=lambda *a, **k: None))
        thread.start()
        try:
            await wait_for(lambda: any(n.kind == "events" for n in got) and any(n.kind == "checks" for n in got))
            watcher.gone = True
            await wait_for(lambda: any(n.kind == "gone" for n in got))
            watcher.gone = False
            opened = watcher.opened
            await wait_for(lambda: watcher.opened > opened)
        finally:
            await asyncio.to_thread(thread.stop)
        assert not thread.thread.is_alive()

    async def wait_for(cond: Any) -> None:
        import asyncio

        for _ in range(400):
            if cond():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"not reached; news: {[n.kind for n in got]}")

    asyncio.run(main())
    kinds = [n.kind for n in got]
    assert kinds[0] == "opened"
    assert [n for n in got if n.kind == "gone"][0].message == "NVML: Driver Not Loaded"
    assert kinds.count("gone") == 1  # one outage, one piece of news


def test_the_intake_counts_xids_and_hands_them_on() -> None:
    reg = CollectorRegistry()
    intake = HealthIntake(reg, SimpleNamespace(info=lambda *a, **k: None, error=lambda *a, **k: None, warning=lambda *a, **k: None))
    t = tracker()
    assert intake.note(t, HealthNews("events", events=[xid(43), xid(79)]), listed=[PCI], boot_id="b")
    assert reg.get_sample_value("bcd_gpu_xid_events_total", {"pci_address": PCI, "xid": "43", "severity": "ignored"}) == 1
    assert reg.get_sample_value("bcd_gpu_xid_events_total", {"pci_address": PCI, "xid": "79", "severity": "critical"}) == 1
    assert intake.note(t, HealthNews("gone", message="NVML gone"), listed=[PCI], boot_id="b")
    assert reg.get_sample_value("bcd_gpu_health_checks_total", {"outcome": "failed"}) == 1


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        pytest.param({}, None, id="defaults"),
        pytest.param({"xid_ignore": "79, 48", "xid_fatal": "43"}, None, id="lists"),
        pytest.param({"xid_ignore": "79;48"}, "--xid-ignore", id="bad-list"),
        pytest.param({"xid_fatal": "99999999"}, "--xid-fatal", id="too-big"),
        pytest.param({"ecc_uncorrectable_max": -1}, "--ecc-uncorrectable-max", id="negative-max"),
        pytest.param({"ecc_correctable_max": -2}, "--ecc-correctable-max", id="negative-limit"),
        pytest.param({"health_interval": 0}, "--health-interval", id="zero-interval"),
    ],
)
def test_policy_from_options(changes: dict, error: str | None) -> None:
    opts = SimpleNamespace(
        **{
            "health_checks": "on",
            "health_interval": 10.0,
            "xid_ignore": "",
            "xid_fatal": "",
            "ecc_uncorrectable_max": 0,
            "ecc_correctable_max": -1,
            **changes,
        }
    )
    if error is not None:
        with pytest.raises(ValueError, match=error):
            policy_from(opts)
        return
    p = policy_from(opts)
    if "xid_ignore" in changes:
        assert not p.xid_fatal(79) and not p.xid_fatal(48) and p.xid_fatal(43)
    else:
        assert p.xid_fatal(79) and not p.xid_fatal(43) and p.ecc_correctable_max is None


def test_threads_left_running() -> None:
    assert not [t for t in threading.enumerate() if t.name == "bcd-health-watch"]


def test_the_thread_registers_again_when_a_wait_stops_watching_a_card(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    import services.inventory.healthwatch as hw

    monkeypatch.setattr(hw, "RETRY_SECONDS", 0.05)
    watcher = ScriptedWatcher()
    watcher.events.append([HealthEvent(PCI, "unmonitored", T0, message="the wait failed")])
    got: list[HealthNews] = []

    async def main() -> None:
        thread = HealthThread(watcher, asyncio.get_running_loop(), got.append, interval=10, log=None)
        thread.start()
        try:
            for _ in range(400):
                if watcher.opened >= 2:
                    break
                await asyncio.sleep(0.01)
        finally:
            await asyncio.to_thread(thread.stop)

    asyncio.run(main())
    assert watcher.opened >= 2
    assert [n.kind for n in got][:3] == ["opened", "events", "opened"]


def test_a_host_file_that_cannot_be_read_concludes_nothing(tmp_path: Path) -> None:
    """A typo in the fake host file is not NVML gone: HealthNotRead, never AdapterError (every card lost)."""
    from services.inventory.adapters.base import HealthNotRead

    path = host_copy(tmp_path)
    a = FakeHwAdapter(path, cdi_dir=tmp_path)
    a.open_health_watch()
    path.write_text('{"gpus": [{"uuid": "GPU-x"')  # half a file
    with pytest.raises(HealthNotRead):
        a.wait_health_events(1.0)
    with pytest.raises(HealthNotRead):
        a.check_health()
    assert not isinstance(HealthNotRead("x"), AdapterError)
    shutil.copy(ONE_GPU, path)
    change(path, lambda d: health_of(d).update(xids=[{"xid": 79, "at": "2026-12-03T10:00:00Z"}]))
    assert [e.xid for e in a.wait_health_events(2.0)] == [79]  # the watch goes on once the file reads again


def test_news_that_changes_nothing_is_not_published(tmp_path: Path) -> None:
    """An XID storm (or the same check every interval) costs no scan and no publish."""
    import asyncio

    from services.inventory.facts import InventoryFacts
    from services.inventory.gpustate import GpuStateStore
    from services.inventory.healthdesk import HealthChecks, HealthDesk

    log = SimpleNamespace(info=lambda *a, **k: None, error=lambda *a, **k: None, warning=lambda *a, **k: None)
    facts = InventoryFacts(adapter=None, tracker=tracker(), store=GpuStateStore(tmp_path), health_policy=HealthPolicy())
    facts.last_base = inventory(ONE_GPU)
    scans: list[str] = []

    class Publisher:
        async def scan(self, reason: str) -> Any:
            scans.append(reason)
            return facts.last_base

        async def evaluate_and_publish(self, *a: Any, **k: Any) -> Any:
            scans.append("published")

        async def fetch_claims(self) -> None:
            return None

        def save(self, **k: Any) -> None:
            pass

    checks = HealthChecks(facts, intake=HealthIntake(CollectorRegistry(), log), log=log)
    desk = HealthDesk(facts, checks=checks, publisher=Publisher(), log=log)

    async def main() -> None:
        await desk.on_news(HealthNews("events", events=[xid(43), xid(13)]))
        assert scans == []
        await desk.on_news(HealthNews("events", events=[xid(79)]))
        assert scans == ["health event", "published"]
        await desk.on_news(HealthNews("events", events=[xid(79), xid(48)]))
        assert scans == ["health event", "published"]

    asyncio.run(main())
