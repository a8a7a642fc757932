"""healthdesk.py alone, with a fake health watcher and a fake publisher (no bus, no thread, no app):
the start scan's check, a recheck that clears sticky faults only when told, the rechecks after a
reset, and the health news loop that scans once for a card the library stopped naming and outlives
a piece of news it could not handle."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from services.inventory.adapters.base import AdapterError, HealthCheck, HealthEvent, HealthNotRead
from services.inventory.health import GPU_LOST, XID_CRITICAL, HealthPolicy
from services.inventory.healthdesk import HealthChecks, HealthDesk
from services.inventory.healthintake import HealthIntake
from services.inventory.healthwatch import HealthNews
from shared.schemas import Claims, Inventory

from .rig import NOW, WHOLE, Log, facts, host, scan, until


class Watcher:
    """A HealthWatcher whose checks are what the test says: `checks`, or `fail` raised."""

    def __init__(self, checks: list[HealthCheck] | None = None, fail: Exception | None = None) -> None:
        self.checks = checks or []
        self.fail = fail
        self.asked = 0

    def open_health_watch(self) -> list[HealthEvent]:
        return []

    def wait_health_events(self, timeout: float) -> list[HealthEvent]:
        return []

    def check_health(self) -> list[HealthCheck]:
        self.asked += 1
        if self.fail is not None:
            raise self.fail
        return list(self.checks)

    def close_health_watch(self) -> None:
        pass


class Publisher:
    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.calls: list[tuple[Any, ...]] = []

    async def scan(self, reason: str) -> Inventory | None:
        self.calls.append(("scan", reason))
        return None  # the scan failed: the last one stands

    async def fetch_claims(self) -> Claims | None:
        return Claims(at=NOW)

    def save(self, *, strict: bool = False) -> None:
        self.calls.append(("save",))

    async def evaluate_and_publish(self, base: Inventory, claims: Claims | None, reason: str, *, scanned: bool = True) -> Inventory:
        self.calls.append(("publish", reason, scanned))
        if self.fail is not None:
            raise self.fail
        return base


class Room:
    def __init__(self, tmp_path: Path, adapter: Any, *, policy: HealthPolicy | None = None, publisher: Publisher | None = None) -> None:
        self.log = Log()
        self.registry = CollectorRegistry()
        inv = scan(host(tmp_path))
        self.facts = facts(tmp_path, adapter, current=inv, policy=policy)
        self.facts.last_base = inv
        self.checks = HealthChecks(self.facts, intake=HealthIntake(self.registry, self.log), log=self.log)
        self.publisher = publisher or Publisher()
        self.desk = HealthDesk(self.facts, checks=self.checks, publisher=self.publisher, log=self.log)

    def fatal(self, pci: str = WHOLE) -> None:
        self.facts.tracker.note_health_event(HealthEvent(pci, "xid", NOW, xid=79))
        assert self.facts.tracker.sticky_faults(pci) == [XID_CRITICAL]


def clean(inv: Inventory) -> list[HealthCheck]:
    return [HealthCheck(g.pci_address) for g in inv.gpus]


# --------------------------------------------------------------------------- the start scan's check


async def test_the_first_check_asks_nothing_when_health_is_not_watched(tmp_path: Path) -> None:
    adapter = Watcher()
    room = Room(tmp_path, adapter, policy=HealthPolicy(enabled=False))
    await room.checks.first(room.facts.last_base)  # type: ignore[arg-type]
    assert adapter.asked == 0


async def test_the_first_check_that_cannot_be_read_is_left_to_the_thread(tmp_path: Path) -> None:
    room = Room(tmp_path, Watcher(fail=HealthNotRead("host file half written")))
    await room.checks.first(room.facts.last_base)  # type: ignore[arg-type]
    assert [lvl for lvl, _ in room.log.said("GPU health not read at start; the health thread tries again")] == ["warning"]
    assert room.facts.tracker.sticky_faults(WHOLE) == []


async def test_a_library_that_does_not_answer_at_start_makes_every_watched_card_lost(tmp_path: Path) -> None:
    room = Room(tmp_path, Watcher(fail=AdapterError("NVML: driver not loaded")))
    await room.checks.first(room.facts.last_base)  # type: ignore[arg-type]
    assert room.facts.tracker.sticky_faults(WHOLE) == [GPU_LOST]
    assert room.registry.get_sample_value("bcd_gpu_health_checks_total", {"outcome": "failed"}) == 1


# --------------------------------------------------------------------------- rechecks


async def test_a_recheck_clears_sticky_faults_only_when_told(tmp_path: Path) -> None:
    room = Room(tmp_path, Watcher())
    room.checks.facts.adapter.checks = clean(room.facts.last_base)  # type: ignore[arg-type]
    room.fatal()
    assert await room.checks.recheck(WHOLE, clear=False) == (True, "", [])
    assert room.facts.tracker.sticky_faults(WHOLE) == [XID_CRITICAL]  # a held card was not reset
    assert await room.checks.recheck(WHOLE) == (True, "", [XID_CRITICAL])
    assert room.facts.tracker.sticky_faults(WHOLE) == []


async def test_a_recheck_of_a_card_the_library_does_not_see_or_cannot_read_is_not_done(tmp_path: Path) -> None:
    room = Room(tmp_path, Watcher(checks=[]))
    done, why, cleared = await room.checks.recheck(WHOLE)
    assert (done, cleared) == (False, []) and why.startswith(f"the vendor library does not see {WHOLE}")
    room.facts.adapter.fail = HealthNotRead("busy")
    assert await room.checks.recheck(WHOLE) == (False, "the check could not be made now: busy", [])
    room.facts.adapter.fail = AdapterError("gone")
    assert await room.checks.recheck(WHOLE) == (False, "the vendor library does not answer: gone", [])


async def test_a_recheck_after_a_reset_publishes_the_last_scan_again(tmp_path: Path) -> None:
    room = Room(tmp_path, Watcher())
    room.facts.adapter.checks = clean(room.facts.last_base)  # type: ignore[arg-type]
    room.fatal()
    await room.desk.recheck_logged(WHOLE, "reset")
    assert room.publisher.calls == [("publish", "recheck after reset", False)]
    [(_, kw)] = room.log.said("GPU healthy again: a clean check cleared its faults")
    assert (kw["pci"], kw["cleared"]) == (WHOLE, [XID_CRITICAL])


async def test_a_recheck_after_a_reset_that_cannot_check_or_fails_is_logged_not_raised(tmp_path: Path) -> None:
    room = Room(tmp_path, Watcher(checks=[]))
    await room.desk.recheck_logged(WHOLE, "reset")
    assert room.publisher.calls == [] and room.log.said("GPU not checked again")
    broken = Room(tmp_path, Watcher(), publisher=Publisher(fail=RuntimeError("bus gone")))
    broken.facts.adapter.checks = clean(broken.facts.last_base)  # type: ignore[arg-type]
    await broken.desk.recheck_logged(WHOLE, "reset")
    assert [lvl for lvl, _ in broken.log.said("recheck failed")] == ["exception"]


# --------------------------------------------------------------------------- the news


async def test_a_card_the_checks_stop_naming_is_scanned_for_once(tmp_path: Path) -> None:
    room = Room(tmp_path, Watcher())
    inv = room.facts.last_base
    assert inv is not None
    without = [c for c in clean(inv) if c.pci_address != WHOLE]
    await room.desk.on_news(HealthNews("checks", checks=without))
    assert ("scan", "health event") in room.publisher.calls
    assert room.publisher.calls[-1] == ("publish", "health checks", True)
    room.publisher.calls.clear()
    await room.desk.on_news(HealthNews("checks", checks=without))
    assert room.publisher.calls == []  # the same card missed again: no scan per check


async def test_the_news_loop_outlives_news_it_could_not_handle(tmp_path: Path) -> None:
    room = Room(tmp_path, Watcher(), publisher=Publisher(fail=RuntimeError("boom")))
    news: asyncio.Queue[HealthNews] = asyncio.Queue()
    task = asyncio.create_task(room.desk.run(news))
    try:
        news.put_nowait(HealthNews("events", events=[HealthEvent(WHOLE, "xid", NOW, xid=79)]))
        await until("the failure logged", lambda: room.log.said("health news not handled"))
        news.put_nowait(HealthNews("events", events=[HealthEvent(WHOLE, "xid", NOW, xid=48)]))
        news.put_nowait(HealthNews("gone", message="NVML gone"))
        await until("the next news handled", lambda: len(room.log.said("health news not handled")) == 2)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
