"""Who claims each card, read now, and its publication on `claims_changed`.

A card's claims (vfio.card_claims: holds on disk, bind intents, pending
Kubernetes releases, the spec's instances, running domains, DRA claims) are
what a reset, a diagnostic, a MIG layout change, a DRA claim and the holder
endpoint check the card against, and what the inventory derives each card's
managementState from. `CardClaims.read` makes them from what is there now (a
stale copy of a released hold, plan.stale_hold_files, claims nothing);
`publish` sends the Claims message (with the VFIO record and the MIG layouts)
when it changed since the last one, after each pass and each claim
prepare/unprepare (and the first time).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from nats.aio.client import Client

from shared import logs
from shared.holdfiles import BINDING_CLAIM, HoldOnDisk
from shared.schemas import CLAIMS_CODEC, Claims, GpuClaim, Inventory, MigLayoutState
from shared.schemas.common import clip
from shared.subjects import NodeSubjects

from .facts import NodeFacts
from .holddirs import HoldDirs
from .intake import InventoryIntake
from .plan import claim_holders, stale_hold_files
from .releases import ReleasesStore
from .vfio import card_claims


class CardClaims:
    def __init__(
        self,
        facts: NodeFacts,
        *,
        dirs: HoldDirs,
        releases: ReleasesStore,
        intake: InventoryIntake,
        nc: Client,
        subjects: NodeSubjects,
        log: logs.StructLogger,
    ) -> None:
        self.facts = facts
        self.dirs = dirs
        self.releases = releases
        self.intake = intake
        self.nc = nc
        self.subjects = subjects
        self.log = log
        #: the content (claims, vfio, MIG layouts) of the last Claims published.
        self.sent: tuple | None = None

    def read(self, inv: Inventory, holds: dict[str, HoldOnDisk] | None = None) -> list[GpuClaim]:
        """Every card's claims, read now: holds on disk (or as just read), intents, releasing.json, spec, domains."""
        state = self.facts.state
        if holds is None:
            holds = self.dirs.holds()
        pending, unreadable = self.releases.peek()
        # a stale copy of a released hold is no hold: the card stays as free as its release left it
        stale = stale_hold_files(state, holds, (), pending)
        holds = {a: h for a, h in holds.items() if a not in stale}
        dra = claim_holders({a: h for a, h in holds.items() if h.binding == BINDING_CLAIM}, state.claims)
        return card_claims(
            inventory=inv,
            holds={a: h.devices for a, h in holds.items() if h.binding != BINDING_CLAIM},
            dra_claims={holder: atoms for holder, atoms in dra.values()},
            intents={a: i.devices for a, i in state.intents.items()},
            pending={a: r.devices for a, r in pending.items()},
            releases_unreadable=unreadable,
            spec=self.facts.spec,
            domain_gpus=dict(state.domain_gpus),
        )

    def mig_states(self) -> list[MigLayoutState]:
        return [
            MigLayoutState(pci_address=pci, layout=r.layout, state=r.state, message=clip(r.message), since=r.since)
            for pci, r in sorted(self.facts.state.mig_layouts.items())
        ]

    async def snapshot(self, holds: dict[str, HoldOnDisk] | None = None) -> Claims | None:
        """The Claims message as it would go now; None while no inventory can be read."""
        inv = self.intake.inventory
        if inv is None:
            await self.intake.fetch()
            inv = self.intake.inventory
        if inv is None:
            return None
        claims = await asyncio.to_thread(self.read, inv, holds)
        spec = self.facts.spec
        return Claims(
            claims=claims,
            vfio=sorted(self.facts.state.vfio),
            generation=spec.generation if spec is not None else None,
            at=datetime.now(timezone.utc),
            mig_layouts=self.mig_states(),
        )

    async def publish(self, holds: dict[str, HoldOnDisk] | None = None) -> None:
        """Publish the claims when they changed since the last publication (and the first time)."""
        c = await self.snapshot(holds)
        if c is None:
            return
        # a new generation with the same claims is nothing new for the inventory
        key = (c.claims, c.vfio, [(m.pci_address, m.layout, m.state, m.message) for m in c.mig_layouts])
        if key == self.sent:
            return
        try:
            await self.nc.publish(self.subjects.converger_claims_changed, CLAIMS_CODEC.encode_valid(c))
        except Exception as exc:  # noqa: BLE001 - published again after the next pass
            self.log.warning("claims not published; next pass tries again", error=str(exc) or type(exc).__name__)
            return
        self.sent = key
        self.log.info("claims published", cards=len({x.pci_address for x in c.claims}), vfio=c.vfio, generation=c.generation)


__all__ = ["CardClaims"]
