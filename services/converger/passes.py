"""What one pass does: observe -> pure plan -> idempotent apply, and everything it tells afterwards.

loop.py says when a pass runs; `PassRunner.run` is the pass itself. Under
the pass lock it reads the node (observe.py: the spec, the inventory, the
hold directories, releasing.json and the reaper's answers, domains, the
journal), plans (plan.py), applies (apply.py), then sets the metrics, logs
the outcome, hints the device plugin when the Kubernetes holds changed and
asks the reaper again for every pending release. Around it: a look at the
root helper while unprivileged, the DRA claims a stop cut short (once), the
MIG layout step (maintenance.py) and the claims publication (cardclaims.py).
What the last pass found (failures, VFIO notes, when) is kept for the status.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime, timezone

from shared import logs
from shared.holdfiles import HoldOnDisk
from shared.slices import Slices

from . import gpuops, relayout
from .apply import Applier
from .cardclaims import CardClaims
from .claimdesk import ClaimDesk
from .consumers import KubeConsumers
from .domains import Domains
from .facts import NodeFacts
from .helperwatch import RootHelperWatch
from .holddirs import HoldDirs
from .holdwatch import HoldDirWatch
from .intake import InventoryIntake
from .maintenance import Maintenance
from .metrics import ConvergerMetrics
from .observe import observe, release_facts
from .outbox import JetStreamOutbox
from .plan import UNREADABLE, plan
from .reaper import Reaper
from .releases import PendingRelease, ReleasesStore


class PassRunner:
    def __init__(
        self,
        facts: NodeFacts,
        *,
        intake: InventoryIntake,
        applier: Applier,
        outbox: JetStreamOutbox,
        releases: ReleasesStore,
        reaper: Reaper,
        consumers: KubeConsumers,
        slices: Slices,
        domains: Domains,
        dirs: HoldDirs,
        dir_watch: HoldDirWatch,
        claims: CardClaims,
        claim_desk: ClaimDesk,
        maintenance: Maintenance,
        helper: RootHelperWatch | None,
        metrics: ConvergerMetrics,
        retry_interval: float,
        log: logs.StructLogger,
    ) -> None:
        self.facts = facts
        self.intake = intake
        self.applier = applier
        self.outbox = outbox
        self.releases = releases
        self.reaper = reaper
        self.consumers = consumers
        self.slices = slices
        self.domains = domains
        self.dirs = dirs
        self.dir_watch = dir_watch
        self.claims = claims
        self.claim_desk = claim_desk
        self.maintenance = maintenance
        self.helper = helper
        self.m = metrics
        self.retry_interval = retry_interval
        self.log = log
        #: allocation -> reason of each hold the last pass refused
        self.failures: dict[str, str] = {}
        self.last_pass_at: datetime | None = None
        #: the VFIO notes of the last pass (logged again only at DEBUG).
        self.vfio_noted: set[str] = set()
        #: the Kubernetes releases still pending after the last pass
        self.pending: dict[str, PendingRelease] = {}
        #: the Kubernetes holds after the last pass (allocation -> generation, devices).
        self.kube_holds_seen: dict[str, tuple[int, tuple[str, ...]]] | None = None
        #: the holds on disk as read right after the last pass (None: not read by it).
        self.holds_after_pass: dict[str, HoldOnDisk] | None = None

    async def run(self, reason: str) -> bool:
        """One pass, then the claims if they changed; returns True when something is left to retry."""
        if self.helper is not None and not self.facts.privileged:
            await self.helper.look()
        self.holds_after_pass = None
        if not self.claim_desk.reconciled:
            async with self.facts.lock:
                await self.claim_desk.reconcile()
        retry = await self._pass(reason)
        try:
            await self.maintenance.mig_step()
        except Exception:  # noqa: BLE001 - the next pass looks again
            self.log.exception("MIG layout step failed")
        # the hold directories as the pass left them, read once for the metric and the claims
        await self.claims.publish(self.holds_after_pass)
        return retry

    async def _pass(self, reason: str) -> bool:
        async with self.facts.lock:
            try:
                return await self._pass_locked(reason)
            finally:
                # what the pass left: a later change is someone else's (the watch wakes a pass)
                await self.dir_watch.pass_ended()

    async def _pass_locked(self, reason: str) -> bool:
        facts, state = self.facts, self.facts.state
        if facts.spec is None:
            return False
        if self.intake.inventory is None:
            await self.intake.fetch(wake=False)
            if self.intake.inventory is None:
                return True
        spec, log, m = facts.spec, self.log, self.m
        with m.pass_duration.time():
            await self.outbox.recheck()
            rel_facts = await release_facts(self.releases, self.reaper, self.dirs.cdi_dir, self.dirs.run_dir)
            observed = await asyncio.to_thread(
                observe,
                releases=rel_facts,
                spec=spec,
                cdi_dir=self.dirs.cdi_dir,
                run_dir=self.dirs.run_dir,
                slices=self.slices,
                inventory=self.intake.inventory,
                domains=self.domains,
                state=state,
                warned=self.dirs.warned,
                switched=self.applier.switched,
                spec_unknown_fields=facts.spec_unknown,
                consumer_dir=self.dirs.consumer_dir,
            )
            observed = dataclasses.replace(observed, maintenance={**relayout.claimed_cards(state.relayout), **gpuops.maintenance_claims(state.gpu_ops)})
            # a success the inventory already shows no longer needs remembering
            for pci in [pci for pci in self.applier.switched if pci not in observed.switched]:
                del self.applier.switched[pci]
            p = plan(spec, observed, facts.config)
            for note in p.notes:
                log.warning(note)
            # a card that waits is noted at every retry: WARN once, then DEBUG while it lasts
            for note in p.vfio_notes:
                (log.debug if note in self.vfio_noted else log.warning)(note)
            self.vfio_noted = set(p.vfio_notes)
            new_failures = [f for f in p.failures if state.reported_failures.get(f.allocation_id) != spec.generation]
            result = await self.applier.apply(p, state)
        if result.switch_requests:
            # the inventory rescans on the switcher's notice (inventory.changed
            # follows); read it now too, in case that came before our reply
            await self.intake.fetch()
        m.vfio.set(len(state.vfio))
        self.last_pass_at = datetime.now(timezone.utc)
        self.pending = {a: r for a, r in rel_facts.pending.items() if a in p.pending}
        m.pending.set(len(p.pending))
        oldest = min((r.since for r in rel_facts.pending.values() if r.allocation_id in p.pending), default=None)
        m.pending_age.set((self.last_pass_at - oldest).total_seconds() if oldest else 0)
        unreadable = state.conditions.get(UNREADABLE)
        m.unreadable.set(1 if unreadable is not None and unreadable.status == "True" else 0)
        self.failures = {f.allocation_id: f.reason for f in p.failures}
        for f in new_failures:
            m.failures.labels(reason=f.reason).inc()
        section = result.section
        outcome = "retry" if result.retry else ("failed" if p.failures else "converged")
        m.passes.labels(outcome=outcome).inc()
        m.generation.set(spec.generation)
        if section is not None:
            m.section.clear()
            m.section.labels(state=section.state).set(1)
        holds_now = self.holds_after_pass = await asyncio.to_thread(self.dirs.holds)
        m.holds.clear()
        for binding in ("BINDING_HOLD", "BINDING_KUBERNETES"):
            m.holds.labels(binding=binding).set(sum(1 for h in holds_now.values() if h.binding == binding))
        # the device plugin advertises the Kubernetes holds: a hint when they changed
        kube_now = {a: (h.generation, h.devices) for a, h in holds_now.items() if h.binding == "BINDING_KUBERNETES"}
        if kube_now != self.kube_holds_seen:
            self.kube_holds_seen = kube_now
            await self.consumers.holds_changed()
        fields = dict(reason=reason, generation=spec.generation, steps=len(p.steps), done=result.done)
        if result.vfio_retry or p.vfio_waiting:
            fields.update(vfio_retry_in_s=self.retry_interval, vfio_waiting=list(p.vfio_waiting))
        if result.retry:
            # seed: section failures are logged WARN while retrying, ERROR when failed
            log.warning("pass incomplete; retrying", errors=result.errors, retry_in_s=self.retry_interval, **fields)
        elif p.failures:
            log.error("section failed", failures={f.allocation_id: f"{f.reason}: {f.message}" for f in p.failures}, **fields)
        elif p.steps:
            log.info("pass converged", **fields)
        else:
            log.debug("nothing to do", **fields)
        # the reaper keeps its watches in memory: ask again for every pending
        # release (idempotent there), so a restarted reaper resumes evicting
        for alloc in p.pending:
            rel = self.pending.get(alloc) or rel_facts.pending.get(alloc)
            if rel is not None:
                await self.reaper.evict(alloc, list(rel.devices))
        # a pending Kubernetes release is rechecked every retry interval (the
        # reaper's "freed" message usually comes first)
        # a driver switch refused, failed or unanswered, or waiting for a hold
        # to go, is asked for again at the next retry interval
        return result.retry or bool(p.pending) or result.vfio_retry or bool(p.vfio_waiting)


__all__ = ["PassRunner"]
