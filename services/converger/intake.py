"""The inventory as this converger last had it, and every way a new one arrives.

The inventory service publishes `inventory.changed` after each rescan (the
notice carries the whole Inventory); a pass, a claim, a maintenance
operation or the claims publication may also read it at once
(`inventory.get`). Every arrival goes through `take`, which keeps it and,
when asked to, wakes a pass if it plans differently (vfio.planner_view).
The converger never plans without an inventory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client

from shared import logs
from shared.runtime import ServiceCallError, call
from shared.schemas import INVENTORY_CODEC, BadMessage, Empty, Inventory
from shared.subjects import NodeSubjects

from .vfio import planner_view


class InventoryIntake:
    def __init__(
        self,
        nc: Client,
        subjects: NodeSubjects,
        *,
        trigger: Callable[[str], None],
        log: logs.StructLogger,
        unreached: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.trigger = trigger
        #: told when no inventory answered (comeback.py: a pass runs again once one does)
        self.unreached = unreached
        self.log = log
        #: the newest inventory read or heard (None: none yet)
        self.inventory: Inventory | None = None

    def take(self, inv: Inventory, *, wake: bool) -> None:
        """Keep `inv` as the inventory; with `wake`, run a pass when it plans differently.

        Every way an inventory arrives goes through here, so a pass that waited for
        one (no inventory yet) is woken by whichever comes first: the notice, or the
        read the claims endpoint makes when the inventory asks for claims before its
        own first notice reached us. Without that, the pass waited for the retry
        interval (30 s), as a node's first spec did when it came before the inventory.
        """
        before, self.inventory = self.inventory, inv
        # a claims change (our own pass's) rewrites only what the planner does not
        # read: the next pass sees the new inventory, but none runs for it alone
        if wake and (before is None or planner_view(before) != planner_view(inv)):
            self.trigger("inventory changed")

    async def fetch(self, *, wake: bool = True) -> None:
        """Read the inventory now. `wake=False` inside a pass, which uses what it read."""
        try:
            inv = await call(self.nc, self.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=3)
        except (ServiceCallError, BadMessage, Exception) as exc:  # noqa: BLE001 - logged, retried
            if isinstance(exc, (nats.errors.NoRespondersError, TimeoutError)):
                self.unreached("inventory")
            self.log.warning("inventory not available yet; waiting for it", error=str(exc) or type(exc).__name__)
            return
        if self.inventory is None or inv.revision >= self.inventory.revision:
            self.take(inv, wake=wake)

    async def now(self) -> Inventory | None:
        """The inventory as the inventory service has it now (after a MIG step it rescanned)."""
        await self.fetch(wake=False)
        return self.inventory

    async def on_notice(self, msg: Any) -> None:
        """`inventory.changed` (subscribed through runtime.guarded)."""
        try:
            inv = INVENTORY_CODEC.decode(msg.data)
        except BadMessage as exc:
            self.log.warning("ignoring a bad inventory message", error=str(exc))
            return
        if self.inventory is None or inv.revision != self.inventory.revision:
            self.take(inv, wake=True)


__all__ = ["InventoryIntake"]
