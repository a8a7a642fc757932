"""Apply a plan: idempotent steps, in order, intent journaled before side effects.

A bind records its intent (boot id stamped), then writes slice, CDI spec and
env file, has the signer sign AllocationBound, puts it in the outbox and only
then records completion. A release records intent (with everything its
Released event needs, since the CDI spec is about to go), removes CDI spec and
env file, stops the slice once empty, and reports. Every step can be run
again after a crash and does the same thing, and every event keeps its id.

A failed write or an unreachable signer/outbox is retryable: the step stops,
no event for it is sent, the section reads PROGRESSING and the pass is tried
again. If any release fails, no bind runs in this pass: a bind must never
take an atom whose old hold is still on disk (nor a switch to vfio-pci).

A driver switch records the card in the VFIO record (state.vfio) before it
asks vfio_switcher, so a crash in between converges on restart. Its outcome
never touches the section: a refused or failed switch, or a switcher that
cannot be reached, is retried at the next retry interval (WARN); a
DisruptionRequired marks the card stuck for this boot (no retries).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import msgspec

from shared import logs
from shared.eventids import condition_id, section_id
from shared.schemas import AllocationReleased, Condition, NodeCondition, SectionStatus, SwitchRequest, encode, summarise

from .hostwriter import HostWriteError, HostWriter
from .model import (
    BindHold,
    ClearUnreadableMarker,
    DropPendingRelease,
    ReportKubeRelease,
    SetCondition,
    WithdrawKubeHold,
    ConvergerState,
    EnsureSlice,
    Intent,
    Refusal,
    Plan,
    ReleaseHold,
    RemoveTemp,
    ReportBound,
    RecordVfio,
    ReportFailed,
    Step,
    StopSlice,
    SwitchGpu,
    WriteEnv,
)
from .outbox import Outbox, OutboxError, Signer
from .reaper import NoReaper, Reaper
from .releases import PendingRelease, ReleasesStore
from .switcher import NoSwitcher, Switcher, SwitchUnavailable
from .vfio import NATIVE, VFIO_DRIVER

log = logs.get_logger("bcd.converger.apply")


@dataclass
class ApplyResult:
    errors: list[str] = field(default_factory=list)
    done: int = 0
    section: SectionStatus | None = None
    #: a driver switch is to be asked for again (refused, failed, switcher unreachable).
    vfio_retry: bool = False
    #: switch requests sent in this pass.
    switch_requests: int = 0

    @property
    def retry(self) -> bool:
        return bool(self.errors)


class Applier:
    def __init__(
        self,
        *,
        node_id: str,
        writer: HostWriter,
        signer: Signer,
        outbox: Outbox,
        save_state: Callable[[ConvergerState], None],
        boot_id: Callable[[], str],
        crash: Callable[[str], None] = lambda _: None,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        releases: ReleasesStore | None = None,
        reaper: Reaper | None = None,
        switcher: Switcher | None = None,
        count_switch: Callable[[str, str], None] = lambda target, outcome: None,
    ) -> None:
        self.releases = releases
        self.reaper = reaper or NoReaper()
        self.switcher = switcher or NoSwitcher()
        #: (target, outcome) of each switch request, for the metric.
        self.count_switch = count_switch
        #: PCI address -> (where the card is, when the reply came) after each
        #: switch that succeeded ("vfio-pci" / "native") or could not be rolled
        #: back (the driver it was left on, "" for none); observe() applies those
        #: newer than the inventory (vfio.switched_targets).
        self.switched: dict[str, tuple[str, datetime]] = {}
        self.node_id = node_id
        self.writer = writer
        self.signer = signer
        self.outbox = outbox
        self.save_state = save_state
        self.boot_id = boot_id
        self.crash = crash
        self.clock = clock

    async def apply(self, plan: Plan, state: ConvergerState) -> ApplyResult:
        """Run the steps; mutates and saves `state`. Publishes the section when it changes."""
        result = ApplyResult()
        release_failed = False
        unreported: set[str] = set()
        #: kept holds whose slice or env file could not be put back in this pass:
        #: no Bound for them until every file is in place (seed: "What a bind writes").
        incomplete: set[str] = set()
        # A full outbox holds back new binds (their Bound could not be journaled);
        # releases and failure reports still go, into the headroom.
        room = True
        if any(isinstance(s, BindHold) for s in plan.steps):
            room = await self.outbox.has_room()
        for step in plan.steps:
            if release_failed and isinstance(step, BindHold):
                result.errors.append(f"{step.allocation_id}: not bound in this pass: a release before it failed")
                continue
            if not room and isinstance(step, BindHold):
                why = getattr(self.outbox, "error", "") or "the outbox is full (upstream not draining)"
                result.errors.append(f"{step.allocation_id}: not bound in this pass: {why}")
                continue
            if isinstance(step, ReportBound) and step.allocation_id in incomplete:
                result.errors.append(f"{step.allocation_id}: Bound not reported in this pass: its files are not all in place")
                unreported.add(step.allocation_id)
                continue
            if isinstance(step, SwitchGpu):
                if release_failed and step.target == VFIO_DRIVER:
                    log.warning("switch to vfio-pci held back: a release before it failed", pci=step.pci, why=step.why)
                    result.vfio_retry = True
                    continue
                await self._switch(step, state, result)
                continue
            if isinstance(step, ReleaseHold) and step.allocation_id in unreported:
                # Fix: the plan reports an interrupted bind's Bound before releasing
                # it; if that report failed, a Released now would follow no Bound.
                result.errors.append(f"{step.allocation_id}: not released in this pass: its Bound could not be reported")
                release_failed = True
                continue
            try:
                await self._run(step, state)
                result.done += 1
            except (HostWriteError, OutboxError) as exc:
                result.errors.append(f"{_alloc(step)}: {exc}")
                log.warning("step failed; will retry", step=type(step).__name__, allocation_id=_alloc(step), error=str(exc))
                if isinstance(step, ReleaseHold):
                    release_failed = True
                elif isinstance(step, ReportBound):
                    unreported.add(step.allocation_id)
                elif isinstance(step, (WriteEnv, EnsureSlice)):
                    incomplete.add(step.allocation_id)
        section = plan.section
        if section is not None and result.errors:
            # the failures first (as the plan bounded them), then the errors, within the message's bound
            lines = section.message.splitlines() if section.message else []
            section = msgspec.structs.replace(section, state="PROGRESSING", message=summarise([*lines, *map(str, result.errors)]))
        result.section = section
        if section is not None and section != state.last_section:
            try:
                await self._publish_section(section)
                state.last_section = section
                self.save_state(state)
            except OutboxError as exc:
                result.errors.append(f"section status: {exc}")
        return result

    async def _publish_section(self, section: SectionStatus) -> None:
        event_id = section_id(self.node_id, section.section, section.observed_generation, section.state, section.message)
        await self.outbox.publish("section", event_id, encode(section))

    # ------------------------------------------------------------------ steps

    async def _run(self, step: Step, state: ConvergerState) -> None:
        if isinstance(step, RemoveTemp):
            self.writer.remove_temp(step.path)
        elif isinstance(step, ReleaseHold):
            await self._release(step, state)
        elif isinstance(step, StopSlice):
            if self.writer.stop_slice(step.allocation_id):
                log.info("leftover slice stopped", allocation_id=step.allocation_id)
        elif isinstance(step, EnsureSlice):
            self.writer.apply_slice(step.allocation_id, step.limits)
            log.info("slice recreated", allocation_id=step.allocation_id)
        elif isinstance(step, WriteEnv):
            self.writer.write_env(step.content)
            log.info("env file rewritten", allocation_id=step.allocation_id)
        elif isinstance(step, BindHold):
            await self._bind(step, state)
        elif isinstance(step, ReportBound):
            await self._report_bound(step.allocation_id, step.event_id, step.event, state)
        elif isinstance(step, ReportFailed):
            await self.outbox.publish("failed", step.event_id, encode(step.event))
            state.reported_failures[step.allocation_id] = step.event.generation
            state.refusals[step.allocation_id] = Refusal(
                generation=step.event.generation, reason=step.event.reason, message=step.event.message
            )
            self.save_state(state)
            log.warning(
                "hold refused",
                allocation_id=step.allocation_id,
                reason=step.event.reason,
                detail=step.event.message,
                generation=step.event.generation,
            )
        elif isinstance(step, WithdrawKubeHold):
            await self._withdraw(step)
        elif isinstance(step, ReportKubeRelease):
            await self._report_kube_release(step, state)
        elif isinstance(step, DropPendingRelease):
            self._update_releases(lambda rels: rels.pop(step.allocation_id, None))
            log.info("pending Kubernetes release taken back: the spec wants the allocation again", allocation_id=step.allocation_id)
        elif isinstance(step, SetCondition):
            await self._set_condition(step.condition, state)
        elif isinstance(step, RecordVfio):
            if step.holder is None:
                state.vfio.pop(step.pci, None)
                log.info("card back on its native driver; dropped from the VFIO record", pci=step.pci)
            else:
                state.vfio[step.pci] = step.holder
                log.info("card on vfio-pci for an instance; recorded", pci=step.pci, instance=step.holder)
            self.save_state(state)
        elif isinstance(step, ClearUnreadableMarker):
            assert self.releases is not None
            try:
                self.releases.clear_marker()
            except OSError as exc:
                raise HostWriteError(f"cannot remove {self.releases.marker}: {exc.strerror}") from None
            log.info("unreadable-releases marker cleared: no pod holds a GPU of an unknown allocation")
        else:  # pragma: no cover - the Step union is closed
            raise AssertionError(step)

    # ------------------------------------------------------------------ VFIO switches

    async def _switch(self, step: SwitchGpu, state: ConvergerState, result: ApplyResult) -> None:
        """Record, ask, and record the outcome; never raises (the outcome decides the retry)."""
        pci, target = step.pci, step.target
        if target == VFIO_DRIVER or pci not in state.vfio:
            if state.vfio.get(pci) != step.holder:
                state.vfio[pci] = step.holder
                self.save_state(state)
        self.crash("vfio.recorded")
        result.switch_requests += 1
        try:
            reply = await self.switcher.switch(SwitchRequest(pci=pci, target=target, why=step.why))
        except SwitchUnavailable as exc:
            self.count_switch(target, "Unreachable")
            result.vfio_retry = True
            log.warning("switch not done: vfio_switcher unavailable; retrying", pci=pci, target=target, why=step.why, error=str(exc))
            return
        self.count_switch(target, reply.outcome)
        if reply.pci != pci or reply.target != target:
            result.vfio_retry = True
            log.warning("switch reply names another request; retrying", pci=pci, target=target, reply_pci=reply.pci, reply_target=reply.target)
            return
        if reply.ok:
            if target == NATIVE:
                state.vfio.pop(pci, None)
            else:
                state.vfio[pci] = step.holder
            self.save_state(state)
            self.switched[pci] = (target, self.clock())
            result.done += 1
            log.info("GPU switched", pci=pci, target=target, outcome=reply.outcome, driver=reply.driver, why=step.why)
        elif reply.outcome == "DisruptionRequired":
            state.vfio_stuck[pci] = self.boot_id()
            self.save_state(state)
            # where the card was left ("" for no driver), until the inventory shows it
            self.switched[pci] = (reply.driver, self.clock())
            log.error(
                "GPU switch could not be rolled back: a node reboot is needed; not retried in this boot",
                pci=pci,
                target=target,
                reason=reply.reason,
                detail=reply.message,
                driver=reply.driver,
            )
        else:
            result.vfio_retry = True
            log.warning(
                "GPU switch not done; retrying",
                pci=pci,
                target=target,
                outcome=reply.outcome,
                reason=reply.reason,
                detail=reply.message,
                holder=reply.holder,
                rolled_back=reply.rolled_back,
            )

    # ------------------------------------------------------------------ Kubernetes releases

    def _update_releases(self, change: Callable[[dict[str, PendingRelease]], object]) -> None:
        assert self.releases is not None, "Kubernetes releases need a ReleasesStore"
        try:
            rels, _ = self.releases.load()
            change(rels)
            self.releases.save(rels)
        except OSError as exc:
            raise HostWriteError(f"cannot write {self.releases.path}: {exc.strerror or exc}") from None

    async def _withdraw(self, step: WithdrawKubeHold) -> None:
        rel = step.release
        # recorded first: a crash after this never loses the release
        self._update_releases(lambda rels: rels.setdefault(step.allocation_id, rel))
        self.crash("kube.recorded")
        self.writer.remove_cdi(step.allocation_id)
        self.writer.remove_env(step.allocation_id)
        self.crash("kube.withdrawn")
        log.info("Kubernetes hold withdrawn; released once no pod holds it", allocation_id=step.allocation_id, devices=rel.devices)
        await self.reaper.evict(step.allocation_id, list(rel.devices))

    async def _report_kube_release(self, step: ReportKubeRelease, state: ConvergerState) -> None:
        rel = step.release
        event = AllocationReleased(
            allocation_id=rel.allocation_id, reservation_id=rel.reservation_id, generation=rel.generation, devices=list(rel.devices)
        )
        report = await self.signer.sign(rel.event_id, event)
        await self.outbox.publish("released", rel.event_id, encode(report))
        self.crash("kube.published")
        self._update_releases(lambda rels: rels.pop(step.allocation_id, None))
        state.reported.pop(step.allocation_id, None)
        state.bound.pop(step.allocation_id, None)
        state.intents.pop(step.allocation_id, None)
        self.save_state(state)
        log.info("Kubernetes hold released: no pod holds its devices", allocation_id=step.allocation_id, event_id=rel.event_id)

    async def _set_condition(self, condition: Condition, state: ConvergerState) -> None:
        event_id = condition_id(self.node_id, condition)
        await self.outbox.publish("condition", event_id, encode(NodeCondition(condition=condition)))
        state.conditions[condition.type] = condition
        self.save_state(state)
        (log.warning if condition.status == "True" else log.info)(
            "node condition", type=condition.type, status=condition.status, reason=condition.reason, detail=condition.message
        )

    def _record(self, state: ConvergerState, intent: Intent) -> None:
        state.intents[intent.allocation_id] = intent
        self.save_state(state)

    async def _bind(self, step: BindHold, state: ConvergerState) -> None:
        content, event = step.content, step.event
        self._record(
            state,
            Intent(
                op="bind",
                allocation_id=step.allocation_id,
                reservation_id=event.reservation_id,
                generation=event.generation,
                devices=list(event.devices),
                event_id=step.event_id,
                boot_id=self.boot_id(),
                started_at=self.clock(),
                cgroup_parent=content.cgroup_parent,
                sliced=bool(content.cgroup_parent),
            ),
        )
        self.crash("bind.intent-recorded")
        if content.cgroup_parent and content.limits is not None:
            self.writer.apply_slice(step.allocation_id, content.limits)
            self.crash("bind.slice-applied")
        self.writer.write_cdi(content)
        self.crash("bind.cdi-written")
        try:
            self.writer.write_env(content)
        except HostWriteError:
            if step.report:
                # no CDI spec of a hold never reported without its env file: the next
                # pass binds it afresh (or undoes the journaled bind unreported)
                try:
                    self.writer.remove_cdi(step.allocation_id)
                except HostWriteError as exc:
                    log.warning("CDI spec of a bind whose env file failed not removed", allocation_id=step.allocation_id, error=str(exc))
            raise
        self.crash("bind.env-written")
        if not step.report:
            state.intents.pop(step.allocation_id, None)
            self.save_state(state)
            log.info("hold files re-created (already reported Bound)", allocation_id=step.allocation_id)
            return
        await self._report_bound(step.allocation_id, step.event_id, event, state)
        log.info("hold bound", allocation_id=step.allocation_id, devices=list(event.devices), cgroup_parent=event.cgroup_parent, event_id=step.event_id)

    async def _report_bound(self, alloc: str, event_id: str, event, state: ConvergerState) -> None:  # noqa: ANN001
        report = await self.signer.sign(event_id, event)
        self.crash("bind.signed")
        await self.outbox.publish("bound", event_id, encode(report))
        self.crash("bind.published")
        state.reported[alloc] = event_id
        state.bound[alloc] = Intent(
            op="bind",
            allocation_id=alloc,
            reservation_id=event.reservation_id,
            generation=event.generation,
            devices=list(event.devices),
            event_id=event_id,
            boot_id=self.boot_id(),
            started_at=self.clock(),
            cgroup_parent=event.cgroup_parent,
            sliced=bool(event.cgroup_parent),
        )
        state.intents.pop(alloc, None)
        self.save_state(state)
        self.crash("bind.completed")

    async def _release(self, step: ReleaseHold, state: ConvergerState) -> None:
        alloc, event = step.allocation_id, step.event
        existing = state.intents.get(alloc)
        if step.report and (existing is None or existing.op != "release"):
            self._record(
                state,
                Intent(
                    op="release",
                    allocation_id=alloc,
                    reservation_id=event.reservation_id,
                    generation=event.generation,
                    devices=list(event.devices),
                    event_id=step.event_id,
                    boot_id=self.boot_id(),
                    started_at=self.clock(),
                    sliced=step.sliced,
                ),
            )
            self.crash("release.intent-recorded")
        self.writer.remove_cdi(alloc)
        self.crash("release.cdi-removed")
        self.writer.remove_env(alloc)
        self.crash("release.env-removed")
        if step.sliced and not self.writer.stop_slice(alloc):
            log.info("slice kept: a workload still runs in it", allocation_id=alloc)
        self.crash("release.slice-stopped")
        if step.report:
            report = await self.signer.sign(step.event_id, event)
            self.crash("release.signed")
            await self.outbox.publish("released", step.event_id, encode(report))
            self.crash("release.published")
            log.info("hold released", allocation_id=alloc, event_id=step.event_id)
        else:
            log.info("unreported bind undone", allocation_id=alloc)
        state.reported.pop(alloc, None)
        state.bound.pop(alloc, None)
        state.intents.pop(alloc, None)
        self.save_state(state)
        if step.report:
            self.crash("release.completed")


def _alloc(step: Step) -> str:
    return getattr(step, "allocation_id", getattr(step, "path", "?"))


__all__ = ["Applier", "ApplyResult"]
