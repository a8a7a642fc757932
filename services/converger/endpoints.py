"""The converger's NATS surface: every endpoint and subscription it serves, and the answers
that are reads (status, holder, claims) or hand-overs (spec, pass).

Endpoints: `spec` (the bridge relays the control plane's SignedNodeSpec as it
came; verified here again against the control-plane keys - whoever reaches the
subject without the control plane's signature changes nothing - and kept on
disk, envelope and all, so a restart converges without it), `status`, `holder` (which allocation,
instance or domain holds a GPU - asked before a VFIO switch, reset or MIG
change), `claims` (every card's claims, and the cards the converger put on
vfio-pci: what the inventory derives managementState from), `pass` (run one
now). Those with work behind them are handed to the room that does it:
`gpu_op` to maintenance.py, `claim_prepare` / `claim_unprepare` to
claimdesk.py. Subscriptions: the inventory's `inventory.changed`
(intake.py) and the reaper's freed notice, which wakes a pass.
"""

from __future__ import annotations

import asyncio
import os
from datetime import datetime
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

from shared import logs
from shared.holdfiles import VendorCache
from shared.holddisk import DiskView
from shared.runtime import Refused, ServiceContext, guarded
from shared.schemas import (
    RelayoutStatus,
    CLAIM_PREPARE_REPLY_CODEC,
    CLAIM_PREPARE_REQUEST_CODEC,
    CLAIM_UNPREPARE_REPLY_CODEC,
    CLAIM_UNPREPARE_REQUEST_CODEC,
    CLAIMS_CODEC,
    CONVERGER_STATUS_CODEC,
    EMPTY_CODEC,
    FREED_CODEC,
    GPU_OP_REPLY_CODEC,
    GPU_OP_REQUEST_CODEC,
    HOLDER_QUERY_CODEC,
    HOLDER_REPLY_CODEC,
    SIGNED_NODE_SPEC_CODEC,
    SPEC_ACK_CODEC,
    BadMessage,
    Claims,
    ConvergerStatus,
    Empty,
    HolderQuery,
    HolderReply,
    HoldSummary,
    NodeSpec,
    PendingReleaseSummary,
    SignedNodeSpec,
    SpecAck,
    takes_rebase,
)
from shared.schemas.bus import PASSTHROUGH_CLAIM, PROBLEMS_MAX
from shared.schemas.common import clip
from shared.schemas.strict import unknown_fields_of_json
from shared.signing import VerificationError
from shared.spectrust import SpecTrust
from shared.vendorcdi import VENDOR_CDI_FILE, VendorSpecError

from .cardclaims import CardClaims
from .claimdesk import ClaimDesk
from .claims import ClaimKeeper
from .drift import journal_disagreements
from .facts import NodeFacts
from .holddirs import HoldDirs
from .intake import InventoryIntake
from .loop import PassLoop
from .maintenance import Maintenance
from .outbox import JetStreamOutbox
from .releases import ReleasesStore


class LastPass(Protocol):
    """What the status says of the last pass (passes.PassRunner keeps it)."""

    failures: dict[str, str]
    vfio_noted: set[str]
    last_pass_at: datetime | None


class Endpoints:
    def __init__(
        self,
        facts: NodeFacts,
        *,
        node_id: str,
        trust: SpecTrust,
        loop: PassLoop,
        last_pass: LastPass,
        intake: InventoryIntake,
        claims: CardClaims,
        keeper: ClaimKeeper,
        dirs: HoldDirs,
        vendor: VendorCache,
        outbox: JetStreamOutbox,
        releases: ReleasesStore,
        system_reserve_bytes: int,
        log: logs.StructLogger,
        relayout: Callable[[], RelayoutStatus | None] = lambda: None,
    ) -> None:
        self.facts = facts
        self.node_id = node_id
        #: the control-plane keys every spec must be signed with (or the lab opt-out)
        self.trust = trust
        self.loop = loop
        self.last_pass = last_pass
        self.intake = intake
        self.card_claims = claims
        self.keeper = keeper
        self.dirs = dirs
        #: the vendor CDI spec as the status reads it (decoded again only when it changes).
        self.vendor = vendor
        self.outbox = outbox
        self.releases = releases
        self.system_reserve_bytes = system_reserve_bytes
        self.log = log
        #: the MIG re-layout's part of the status (relayoutrun.py)
        self.relayout = relayout

    # ------------------------------------------------------------------ hand-overs

    async def take_spec(self, signed: SignedNodeSpec, envelope: bytes) -> SpecAck:
        """A SignedNodeSpec as the control plane put it (`envelope`, the bytes it decoded from):
        verified and for this node, or refused 400 and nothing changes."""
        facts = self.facts
        try:
            spec = self.trust.verify(signed, self.node_id)
        except VerificationError as exc:
            # whoever sent it, it is not the control plane's word: said loudly, nothing applied
            applied = facts.spec.generation if facts.spec is not None else None
            self.log.warning("node spec refused; nothing applied", reason=str(exc), applied_generation=applied)
            raise Refused(f"refused: {exc}", code="400") from None
        body = signed.spec
        current = facts.spec.generation if facts.spec is not None else -1
        # lower is refused (an old spec replayed), but for the control plane's signed rebase of a
        # node put where no generation follows (docs/upstream.md, "Generations")
        rebase = takes_rebase(spec, current)
        if spec.generation < current and not rebase:
            raise Refused(f"generation {spec.generation} is lower than the applied {current}", code="409")
        if facts.spec is not None and spec == facts.spec:
            return SpecAck(generation=spec.generation, changed=False)
        if spec.generation == current:
            raise Refused(f"generation {spec.generation} is already applied with different content", code="409")
        # decoded already (within its bounds): what the typed spec dropped is named here,
        # from the exact bytes the control plane signed
        unknown = tuple(str(f) for f in unknown_fields_of_json(NodeSpec, body))
        # the envelope as received: a restart verifies it again (StateStore.load_spec_with_unknown)
        await asyncio.to_thread(facts.store.save_spec, bytes(envelope))
        facts.spec, facts.spec_unknown = spec, unknown
        self.log.info(
            "spec accepted",
            generation=spec.generation,
            **({"rebased_from": current} if rebase else {}),
            assignments=len(spec.devices),
            instances=len(spec.instances),
            # False: taken unchecked under --accept-unsigned-specs (lab only)
            signed=not self.trust.accept_unsigned,
        )
        if unknown:
            self.log.warning("the spec carries fields this node does not know; ignored", generation=spec.generation, fields=list(unknown[:20]), count=len(unknown))
        self.loop.trigger(f"spec generation {spec.generation}")
        return SpecAck(generation=spec.generation)

    async def request_pass(self, _: Empty) -> SpecAck:
        self.loop.trigger("requested")
        spec = self.facts.spec
        return SpecAck(generation=spec.generation if spec else -1, changed=False)

    async def on_freed(self, msg: Any) -> None:
        """The reaper's notice that a pending release's devices are free: a pass reports it."""
        try:
            freed = FREED_CODEC.decode(msg.data)
        except BadMessage:
            return
        self.loop.trigger(f"devices of {freed.allocation_id} freed")

    # ------------------------------------------------------------------ reads

    def _disk_now(self) -> tuple[DiskView, str]:
        """The hold directories as read now, and why the vendor CDI spec does not read ("" when it does)."""
        disk = self.dirs.disk()
        try:
            self.vendor.get()
        except VendorSpecError as exc:
            return disk, str(exc)
        return disk, ""

    async def status(self, _: Empty) -> ConvergerStatus:
        state, last = self.facts.state, self.last_pass
        disk, vendor_error = await asyncio.to_thread(self._disk_now)
        holds = disk.holds
        vendor = Path(self.dirs.cdi_dir) / VENDOR_CDI_FILE
        problems = [*disk.problems, *(p for p in (self.outbox.warning, self.outbox.error) if p)]
        pending, _ = await asyncio.to_thread(self.releases.peek)
        freed = await asyncio.to_thread(self.releases.freed) if pending else set()
        sliced = sorted(a for a, rec in state.written.items() if a in state.reported and rec.content.cgroup_parent)
        slices_now = await asyncio.to_thread(self.dirs.slices_now, sliced) if sliced else None
        drift = journal_disagreements(state, disk, pending, slices_now)
        # an env file whose hold spec is not on disk and that no bind or release is writing or removing
        orphans = [
            f"{Path(self.dirs.run_dir) / 'allocations' / (a + '.env')}: an env file of no hold on disk: left alone"
            for a in sorted(disk.env_files)
            if a not in holds and a not in state.intents and a not in state.bound
        ]
        spec = self.facts.spec
        return ConvergerStatus(
            drift=bounded_problems(drift),
            odd_files=bounded_problems([*disk.odd, *orphans]),
            pending_releases=[
                PendingReleaseSummary(
                    allocation_id=r.allocation_id,
                    reservation_id=r.reservation_id,
                    generation=r.generation,
                    devices=list(r.devices),
                    since=r.since,
                    freed=r.allocation_id in freed,
                )
                for r in sorted(pending.values(), key=lambda r: (r.since, r.allocation_id))
            ],
            generation=spec.generation if spec else None,
            section=state.last_section,
            holds=[
                HoldSummary(
                    allocation_id=h.allocation_id,
                    reservation_id=h.reservation_id,
                    generation=h.generation,
                    binding=h.binding,
                    devices=list(h.devices),
                    cgroup_parent=h.cgroup_parent,
                    reported=h.allocation_id in state.reported,
                    condition=state.hold_conditions.get(h.allocation_id),
                )
                for h in sorted(holds.values(), key=lambda h: h.allocation_id)
            ],
            failures=dict(last.failures),
            vfio_notes=bounded_problems(sorted(last.vfio_noted)),
            last_pass_at=last.last_pass_at,
            next_retry_in_s=self.loop.next_retry_in(),
            privileged=self.facts.privileged,
            bindings=sorted(self.facts.config.supported_bindings),
            # lexists: a symlink or FIFO there is a vendor spec that does not read, not a missing one
            vendor_cdi_spec=str(vendor) if os.path.lexists(vendor) else "",
            vendor_cdi_error=clip(vendor_error),
            problems=bounded_problems(problems),
            outbox_warning=clip(self.outbox.warning),
            outbox_error=clip(self.outbox.error),
            conditions=sorted(state.conditions.values(), key=lambda c: c.type)[:PROBLEMS_MAX],
            system_reserve_bytes=self.system_reserve_bytes,
            gpu_ops=[*sorted(state.gpu_ops.values(), key=lambda o: o.pci), *sorted(state.gpu_op_results.values(), key=lambda o: (o.pci, o.op))],
            mig_layouts=self.card_claims.mig_states(),
            relayout=self.relayout(),
            claims=self.keeper.summaries(),
        )

    async def holder(self, q: HolderQuery) -> HolderReply:
        inv = self.intake.inventory
        gpu = None
        if inv is not None:
            gpu = next((g for g in inv.gpus if q.gpu in (g.pci_address, g.atom_id)), None)
        if gpu is None or inv is None:
            raise Refused(f"{q.gpu} is not a GPU of this node", code="404")
        claims = await asyncio.to_thread(self.card_claims.read, inv)
        first = next((c for c in claims if c.pci_address == gpu.pci_address), None)
        if first is None:
            return HolderReply(held=False, gpu=gpu.pci_address)
        kind = first.kind
        if kind == "claim" and self._passes_through(first.holder, gpu.pci_address):
            # a DRA claim that passes the card through (VfioDeviceConfig): the converger asks for
            # its switches itself, as for an instance; the switcher lets those through, not a reset
            kind = PASSTHROUGH_CLAIM
        return HolderReply(held=True, kind=kind, holder=first.holder, gpu=gpu.pci_address)

    def _passes_through(self, holder: str, pci: str) -> bool:
        return any(
            rec.holder == holder and any(d.pci == pci and d.sharing.strategy == "Vfio" for d in rec.devices) for rec in self.facts.state.claims.values()
        )

    async def claims(self, _: Empty) -> Claims:
        c = await self.card_claims.snapshot()
        if c is None:
            raise Refused("no inventory yet: claims cannot be matched to cards", code="503")
        return c


async def serve(ctx: ServiceContext, endpoints: Endpoints, *, intake: InventoryIntake, claim_desk: ClaimDesk, maintenance: Maintenance) -> None:
    """Subscribe to the notices and add every endpoint (setup: they answer once the service starts)."""
    subjects, log = ctx.subjects, ctx.log
    await ctx.nc.subscribe(subjects.inventory_changed, cb=guarded(log, "inventory notice")(intake.on_notice))
    await ctx.nc.subscribe(subjects.reaper_freed, cb=guarded(log, "freed notice")(endpoints.on_freed))
    # the envelope decoded at the boundary (a 400 naming the field otherwise), verified by take_spec
    await ctx.endpoint("spec", subjects.converger_spec, endpoints.take_spec, SIGNED_NODE_SPEC_CODEC, reply=SPEC_ACK_CODEC, with_body=True)
    await ctx.endpoint("status", subjects.converger_status, endpoints.status, EMPTY_CODEC, allow_empty=True, reply=CONVERGER_STATUS_CODEC)
    await ctx.endpoint("holder", subjects.converger_holder, endpoints.holder, HOLDER_QUERY_CODEC, reply=HOLDER_REPLY_CODEC)
    await ctx.endpoint("claims", subjects.converger_claims, endpoints.claims, EMPTY_CODEC, allow_empty=True, reply=CLAIMS_CODEC)
    await ctx.endpoint("pass", subjects.converger_pass, endpoints.request_pass, EMPTY_CODEC, allow_empty=True, reply=SPEC_ACK_CODEC)
    await ctx.endpoint("gpu_op", subjects.converger_gpu_op, maintenance.gpu_op, GPU_OP_REQUEST_CODEC, reply=GPU_OP_REPLY_CODEC)
    await ctx.endpoint("claim_prepare", subjects.converger_claim_prepare, claim_desk.prepare, CLAIM_PREPARE_REQUEST_CODEC, reply=CLAIM_PREPARE_REPLY_CODEC)
    await ctx.endpoint(
        "claim_unprepare", subjects.converger_claim_unprepare, claim_desk.unprepare, CLAIM_UNPREPARE_REQUEST_CODEC, reply=CLAIM_UNPREPARE_REPLY_CODEC
    )


def bounded_problems(problems: list[str]) -> list[str]:
    """At most PROBLEMS_MAX, each clipped to its bound; the last says how many more there are."""
    out = [clip(p) for p in dict.fromkeys(problems)]
    if len(out) > PROBLEMS_MAX:
        out = [*out[: PROBLEMS_MAX - 1], f"... and {len(out) - PROBLEMS_MAX + 1} more"]
    return out


__all__ = ["Endpoints", "LastPass", "serve", "bounded_problems"]
