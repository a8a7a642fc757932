"""The operator's requests on one card (`gpu`, from `bcd gpu exclude|include|reclaim|recheck <pci>`).

Each runs under `facts.lock`: the converger's claims are asked and the host
scanned, the card must be in the scan or still listed (a card off the bus
is lost, not gone; an excluded card may always be included again), the
intent is recorded in gpus.json first (a request that cannot be recorded is
not taken, and the tracker goes back to before it), then the card is
evaluated and published. A reclaim is answered with its Reclaim condition;
a recheck checks the card now (healthdesk.py) and is accepted when it reads
healthy after, keeping the sticky faults of a card that is held (no reset
can have happened to it).
"""

from __future__ import annotations

from typing import Any

from shared.runtime import Refused
from shared.schemas import Claims, Gpu, GpuReply, GpuRequest, Inventory
from shared.schemas.common import PCI_RE
from shared.schemas.inventory import health_text

from .facts import InventoryFacts
from .gpustate import StateFileError, claim_text, claims_by_card, reclaim_accepted
from .healthdesk import HealthChecks, Publishing


class GpuRequests:
    def __init__(self, facts: InventoryFacts, *, publisher: Publishing, checks: HealthChecks, adapter_name: str, log: Any) -> None:
        self.facts = facts
        self.publisher = publisher
        self.checks = checks
        self.adapter_name = adapter_name
        self.log = log

    async def request(self, req: GpuRequest) -> GpuReply:
        """`bcd gpu exclude|include|reclaim <pci>`: recorded in gpus.json first, then evaluated."""
        pci, action = req.pci, req.action
        facts, publisher, log = self.facts, self.publisher, self.log

        def refuse(message: str, gpu: Gpu | None = None) -> GpuReply:
            log.info("gpu request refused", action=action, pci=pci, reason=message)
            return GpuReply(pci=pci, action=action, accepted=False, message=message, gpu=gpu)

        if not PCI_RE.match(pci):
            return refuse(
                f"{pci!r} is not a canonical PCI address (domain:bus:device.function in lowercase hex, e.g. 0000:3b:00.0)"
            )
        tracker = facts.tracker
        async with facts.lock:
            claims = await publisher.fetch_claims()
            base = await publisher.scan(f"gpu {action}")
            if base is None:
                raise Refused("the host cannot be scanned right now; try again", code="503")
            # a card off the bus is not in the scan but still listed (lost): it is asked about too
            listed = any(g.pci_address == pci for g in base.gpus) or facts.listed(pci)
            record = tracker.card(pci)
            if not listed and not (action == "include" and record is not None and record.excluded):
                return refuse(f"no GPU at {pci} in this node's inventory")
            snapshot = tracker.snapshot()
            if action == "recheck":
                return await self._recheck(pci, base, claims, snapshot)
            if action == "exclude":
                changed = tracker.exclude(pci)
                note = "excluded" if changed else "already excluded"
            elif action == "include":
                changed = tracker.include(pci)
                note = "exclusion lifted" if changed else "not excluded"
            else:
                changed = tracker.request_reclaim(pci)
                note = "" if changed else "a reclaim of this card is already pending"
            if changed:
                # intent first: a request that cannot be recorded is not taken
                try:
                    publisher.save(strict=True)
                except StateFileError as exc:
                    tracker.restore(snapshot)
                    return refuse(f"cannot record the request: {exc}")
            inv = await publisher.evaluate_and_publish(base, claims, f"gpu {action}")
        card = next((g for g in inv.gpus if g.pci_address == pci), None)
        if action == "reclaim":
            condition = tracker.take_answer(pci, card.status if card is not None else None)
            text = condition.message if condition is not None else "no Reclaim condition"
            accepted = not changed or reclaim_accepted(condition)
            message = f"{note}: {text}" if note else text
            if not accepted:
                return refuse(message, card)
        else:
            accepted = True
            state = card.status.driver_binding.management_state if card is not None else "not listed"
            message = f"{note}; managementState is {state}"
        log.info("gpu request", action=action, pci=pci, accepted=accepted, message=message)
        return GpuReply(pci=pci, action=action, accepted=accepted, message=message, gpu=card)

    async def _recheck(self, pci: str, base: Inventory, claims: Claims | None, snapshot: bytes) -> GpuReply:
        """`bcd gpu recheck <pci>` (under facts.lock): accepted when the card reads healthy after the check."""
        facts, publisher = self.facts, self.publisher
        tracker = facts.tracker
        if not facts.watching():
            why = "health checks are off (--health-checks off)" if not facts.health_policy.enabled else f"the {self.adapter_name} adapter cannot watch GPU health"
            return GpuReply(pci=pci, action="recheck", accepted=False, message=f"not checked: {why}")
        # a reset is what a sticky fault waits for, and no reset happens to a held card (bcd refuses
        # it, the driver refuses a reset of a card in use): a recheck of a held card checks and says,
        # but keeps its sticky faults. Claims not known count as held (fail-closed).
        holders = claims_by_card(claims).get(pci, []) if claims is not None else None
        held_by = claim_text(holders) if holders else ("someone (the converger's claims did not answer)" if holders is None else "")
        done, problem, cleared = await self.checks.recheck(pci, clear=not held_by)
        if not done:
            return GpuReply(pci=pci, action="recheck", accepted=False, message=f"not checked: {problem}")
        try:
            publisher.save(strict=True)
        except StateFileError as exc:
            tracker.restore(snapshot)
            return GpuReply(pci=pci, action="recheck", accepted=False, message=f"cannot record the check: {exc}")
        inv = await publisher.evaluate_and_publish(base, claims, "gpu recheck")
        card = next((g for g in inv.gpus if g.pci_address == pci), None)
        health = card.status.health() if card is not None else None
        said = health_text(health) if health is not None else "no Healthy condition"
        accepted = health is not None and health.status != "False"
        kept = tracker.sticky_faults(pci)
        if held_by and kept:
            message = (
                f"kept {', '.join(kept)}: the card is held ({held_by}), so it cannot have been reset; "
                "sticky faults stay until the hold is released and the card is reset (bcd gpu reset) or the node rebooted; " + said
            )
        else:
            message = (f"cleared {', '.join(cleared)}; " if cleared else "nothing cleared; ") + said
            if not accepted:
                message += " (a reset that worked and a clean check clear a fatal fault; a pending row remap needs the reset)"
        self.log.info("gpu request", action="recheck", pci=pci, accepted=accepted, message=message)
        return GpuReply(pci=pci, action="recheck", accepted=accepted, message=message, gpu=card)


__all__ = ["GpuRequests"]
