"""What the inventory does itself about GPU health: the start scan's check, a recheck of one card, the health thread's news.

The thread (healthwatch.py) reports and healthintake.py hands each piece of
news to the tracker; this room runs them on the event loop, under
`facts.lock`: `HealthChecks` asks the adapter itself (the first check, with
the start scan, so the first inventory published already says each card's
health; a recheck of one card, after a reset or asked for with `bcd gpu
recheck`), and `HealthDesk` turns news that changed a card, or a recheck,
into gpus.json and an evaluation published (publishing.py). An XID storm, or
the same check every interval, costs no scan and no publish.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from shared.schemas import Claims, Inventory

from .adapters import AdapterError
from .adapters.base import HealthNotRead
from .facts import InventoryFacts
from .healthintake import HealthIntake, watched_cards
from .healthwatch import HealthNews


class Publishing(Protocol):
    """What the health desk asks of publishing.py's Publisher."""

    async def scan(self, reason: str) -> Inventory | None: ...

    async def fetch_claims(self) -> Claims | None: ...

    def save(self, *, strict: bool = False) -> None: ...

    async def evaluate_and_publish(self, base: Inventory, claims: Claims | None, reason: str, *, scanned: bool = True) -> Inventory: ...


class HealthChecks:
    def __init__(self, facts: InventoryFacts, *, intake: HealthIntake, log: Any) -> None:
        self.facts = facts
        self.intake = intake
        self.log = log

    async def first(self, base: Inventory) -> None:
        """The start scan's check, so the first inventory published already says each card's health."""
        facts = self.facts
        if not facts.watching():
            return
        try:
            checks = await asyncio.to_thread(facts.adapter.check_health)
        except HealthNotRead as exc:
            self.log.warning("GPU health not read at start; the health thread tries again", error=str(exc))
            return
        except AdapterError as exc:
            news = HealthNews("gone", message=str(exc))
        else:
            news = HealthNews("checks", checks=checks)
        self.intake.note(facts.tracker, news, listed=watched_cards(base), boot_id=base.boot_id)

    async def recheck(self, pci: str, *, clear: bool = True) -> tuple[bool, str, list[str]]:
        """Check one card now, letting a clean check clear its sticky faults when `clear` (the card
        was reset: after a reset bcd made, or on a free card an operator says was); (done, why
        not, cleared). Runs under facts.lock."""
        facts = self.facts
        try:
            checks = await asyncio.to_thread(facts.adapter.check_health)
        except HealthNotRead as exc:
            return False, f"the check could not be made now: {exc}", []
        except AdapterError as exc:
            return False, f"the vendor library does not answer: {exc}", []
        check = next((c for c in checks if c.pci_address == pci), None)
        if check is None:
            return False, f"the vendor library does not see {pci} (not on its compute driver, or off the bus): nothing to check", []
        boot_id = facts.last_base.boot_id if facts.last_base is not None else ""
        _, cleared = facts.tracker.note_health_checks([check], recheck=pci if clear else "", boot_id=boot_id)
        return True, "", cleared.get(pci, [])


class HealthDesk:
    def __init__(self, facts: InventoryFacts, *, checks: HealthChecks, publisher: Publishing, log: Any) -> None:
        self.facts = facts
        self.checks = checks
        self.publisher = publisher
        self.log = log
        #: cards on their compute driver the last health check did not name (each scanned for once)
        self.unseen: set[str] = set()

    async def run(self, news: asyncio.Queue[HealthNews]) -> None:
        """The health thread's news, one at a time, on the event loop."""
        while True:
            item = await news.get()
            try:
                await self.on_news(item)
            except Exception:  # noqa: BLE001 - one bad piece of news never stops the watch
                self.log.exception("health news not handled", kind=item.kind)

    async def on_news(self, news: HealthNews) -> None:
        facts, publisher = self.facts, self.publisher
        async with facts.lock:
            base = facts.last_base
            if base is None:
                return
            watched = watched_cards(facts.current or base)
            # a card on its compute driver the check does not name: the library lost sight of it (off
            # the bus, or moved to vfio-pci meanwhile): the scan says which, now, not at the next rescan
            # (once per card: one the library never reads, a card it cannot name, costs no scan per check)
            missed = set(watched) - {c.pci_address for c in news.checks} if news.kind == "checks" else self.unseen
            unseen = bool(missed - self.unseen)
            self.unseen = missed
            if not self.checks.intake.note(facts.tracker, news, listed=watched, boot_id=base.boot_id) and not unseen:
                return  # an ignored XID, a fault seen again: nothing to publish (a storm costs no scan)
            publisher.save()  # the fault is on disk before anyone hears of it
            if news.kind == "events" or unseen:
                # an XID can come with the card leaving NVML: read the host again (the last scan when that fails)
                base = await publisher.scan("health event") or base
            claims = await publisher.fetch_claims()
            await publisher.evaluate_and_publish(base, claims, f"health {news.kind}", scanned=news.kind == "events" or unseen)

    async def recheck_logged(self, pci: str, why: str) -> None:
        """Check a card again after `why` (a reset), let a clean check clear its faults, publish; never raises."""
        facts, publisher = self.facts, self.publisher
        try:
            async with facts.lock:
                done, problem, cleared = await self.checks.recheck(pci)
                if not done:
                    self.log.warning("GPU not checked again", pci=pci, after=why, reason=problem)
                    return
                if cleared:
                    self.log.info("GPU healthy again: a clean check cleared its faults", pci=pci, after=why, cleared=cleared)
                base = facts.last_base
                if base is not None:
                    await publisher.evaluate_and_publish(base, await publisher.fetch_claims(), f"recheck after {why}", scanned=False)
        except Exception:  # noqa: BLE001 - a notice never kills the service
            self.log.exception("recheck failed", pci=pci)


__all__ = ["HealthChecks", "HealthDesk", "Publishing"]
