"""Apply a plan: idempotent steps, in order, intent journaled before side effects.

A bind records its intent (boot id stamped), then writes slice, CDI spec and
env file, has the signer sign AllocationBound, puts it in the outbox and only
then records completion. A release records intent (with everything its
Released event needs, since the CDI spec is about to go), removes CDI spec and
env file, stops the slice once empty, and reports; the journal keeps the
Released's generation (ConvergerState.released), so files of that hold put
back later are removed as a stale copy (RemoveStaleHold) and never adopted. A pass's binds and
releases do this as one group (batch.py: one intent record, the files as
groups, one sign request, pipelined publishing, one completion record).
Every step can be run again after a crash and does the same thing, and every
event keeps its id.

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
from datetime import datetime, timezone

import msgspec

from shared import logs
from shared.eventids import condition_id, hold_condition_id, section_id
from shared.schemas import AllocationReleased, Condition, HoldCondition, NodeCondition, SectionStatus, SwitchRequest, encode, summarise

from .hostwriter import HostWriteError, HostWriter
from .model import (
    BindHold,
    ClearUnreadableMarker,
    DropPendingRelease,
    ReportKubeRelease,
    SetCondition,
    SetHoldCondition,
    WithdrawKubeHold,
    ConvergerState,
    EnsureSlice,
    Plan,
    ReleaseHold,
    RemoveTemp,
    ReportBound,
    RecordVfio,
    ReportFailed,
    Step,
    StopSlice,
    SwitchGpu,
    RecordWritten,
    RemoveConsumer,
    RemoveStaleHold,
    RestoreHold,
    WriteConsumer,
    WriteEnv,
)
from .applyrun import ApplyResult, PassRun
from .batch import Batch, GroupCommit
from .outbox import Outbox, OutboxError, Signer
from .consumers import KubeConsumers, NoKubeConsumers
from .reaper import NoReaper, Reaper
from .releases import PendingRelease, ReleasesStore
from .switcher import NoSwitcher, Switcher, SwitchUnavailable
from .vfio import NATIVE, VFIO_DRIVER

log = logs.get_logger("bcd.converger.apply")


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
        consumers: KubeConsumers | None = None,
        switcher: Switcher | None = None,
        count_switch: Callable[[str, str], None] = lambda target, outcome: None,
        count_drift: Callable[[str], None] = lambda file: None,
    ) -> None:
        #: each hold file found not as bcd wrote it and put back (its kind), for the metric.
        self.count_drift = count_drift
        self.releases = releases
        self.reaper = reaper or NoReaper()
        self.consumers = consumers or NoKubeConsumers()
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
        """Run the steps; mutates and saves `state`. Publishes the section when it changes.

        Releases, binds and Bound reports are collected and run as one batch
        (batch.py) at the end, or before a driver switch, which must come
        after them; every other step runs where the plan puts it.
        """
        result = ApplyResult()
        run = PassRun()
        # A full outbox holds back new binds (their Bound could not be journaled);
        # releases and failure reports still go, into the headroom.
        if any(isinstance(s, BindHold) for s in plan.steps):
            run.room = await self.outbox.has_room()
        batch = Batch()
        group = GroupCommit(self)
        #: holds whose edited spec could not be put back in this pass
        unrestored: set[str] = set()
        for step in plan.steps:
            if isinstance(step, BindHold) and any(r.allocation_id == step.allocation_id for r in batch.releases):
                # the same allocation released and bound again (its assignment changed): the
                # release completes in a group commit of its own first, so the journal never
                # holds both intents of one allocation and the Released is out before the Bound
                await group.run(batch, state, result, run)
                batch = Batch()
            if isinstance(step, (ReleaseHold, BindHold, ReportBound, ReportFailed)):
                batch.add(step)
                continue
            if isinstance(step, (SwitchGpu, RecordVfio)) and batch:
                await group.run(batch, state, result, run)
                batch = Batch()
            if isinstance(step, SwitchGpu):
                if run.switch_held and step.target == VFIO_DRIVER:
                    log.warning("switch to vfio-pci held back: a release before it failed", pci=step.pci, why=step.why)
                    result.vfio_retry = True
                    continue
                await self._switch(step, state, result)
                continue
            if isinstance(step, WriteConsumer) and step.allocation_id in unrestored:
                # the copy is made from the hold spec on disk, which is still the edited one
                result.errors.append(f"{step.allocation_id}: consumer copy not rewritten: its hold spec is not put back yet")
                continue
            try:
                await self._run(step, state)
                result.done += 1
            except (HostWriteError, OutboxError) as exc:
                result.errors.append(f"{_alloc(step)}: {exc}")
                log.warning("step failed; will retry", step=type(step).__name__, allocation_id=_alloc(step), error=str(exc))
                if isinstance(step, (WriteEnv, WriteConsumer, EnsureSlice, RestoreHold)):
                    run.incomplete.add(step.allocation_id)
                if isinstance(step, RestoreHold) and "cdi" in step.files:
                    unrestored.add(step.allocation_id)
        # the last batch's completion record is written with the section status
        completed = await group.run(batch, state, result, run, save=False) if batch else []
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
            except OutboxError as exc:
                result.errors.append(f"section status: {exc}")
            self.save_state(state)
        elif completed:
            self.save_state(state)
        for point in completed:
            self.crash(point)
        return result

    async def _publish_section(self, section: SectionStatus) -> None:
        event_id = section_id(self.node_id, section.section, section.observed_generation, section.state, section.message)
        await self.outbox.publish("section", event_id, encode(section))

    # ------------------------------------------------------------------ steps

    async def _run(self, step: Step, state: ConvergerState) -> None:
        if isinstance(step, RemoveTemp):
            self.writer.remove_temp(step.path)
        elif isinstance(step, StopSlice):
            if self.writer.stop_slice(step.allocation_id):
                log.info("leftover slice stopped", allocation_id=step.allocation_id)
        elif isinstance(step, EnsureSlice):
            self.writer.apply_slice(step.allocation_id, step.limits)
            if step.drifted:
                self.count_drift("slice")
                log.warning("slice changed from outside put back to its limits", allocation_id=step.allocation_id, properties=list(step.drifted))
            else:
                log.info("slice recreated", allocation_id=step.allocation_id)
        elif isinstance(step, WriteEnv):
            self.writer.write_env(step.content)
            log.info("env file rewritten", allocation_id=step.allocation_id)
        elif isinstance(step, WriteConsumer):
            self.writer.write_consumer(step.allocation_id)
            if step.drifted:
                self.count_drift("cdi-consumer")
            log.info("consumer copy rewritten", allocation_id=step.allocation_id, edited_from_outside=step.drifted)
        elif isinstance(step, RestoreHold):
            # what the files must say is journaled before they are written again
            state.written[step.allocation_id] = step.written
            self.save_state(state)
            for kind in step.files:
                if kind == "cdi":
                    self.writer.write_cdi(step.written.content)
                else:
                    self.writer.write_env(step.written.content)
                self.count_drift(kind)
            log.warning("hold files edited from outside put back as bcd wrote them", allocation_id=step.allocation_id, files=list(step.files))
        elif isinstance(step, RecordWritten):
            state.written[step.allocation_id] = step.written
            self.save_state(state)
            log.info("hold files bound before this record taken as found", allocation_id=step.allocation_id)
        elif isinstance(step, RemoveConsumer):
            self.writer.remove_consumer(step.allocation_id)
            log.info("consumer copy without a hold spec removed", allocation_id=step.allocation_id)
        elif isinstance(step, RemoveStaleHold):
            # the consumer copy first (a runtime never finds a device whose spec is gone); nothing is
            # journaled or reported: the Released is out, and removing again is the same
            remove = {"cdi-consumer": self.writer.remove_consumer, "cdi": self.writer.remove_cdi, "allocation-env": self.writer.remove_env}
            for kind in step.files:
                remove[kind](step.allocation_id)
                self.count_drift(kind)
            log.warning(
                "stale copy of a released hold removed",
                allocation_id=step.allocation_id,
                released_generation=step.released_generation,
                files=list(step.files),
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
        elif isinstance(step, SetHoldCondition):
            await self._set_hold_condition(step, state)
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
        # the consumer copy first: a runtime must never find a device whose hold spec is gone
        self.writer.remove_consumer(step.allocation_id)
        self.writer.remove_cdi(step.allocation_id)
        self.writer.remove_env(step.allocation_id)
        self.crash("kube.withdrawn")
        log.info("Kubernetes hold withdrawn; released once no pod holds it", allocation_id=step.allocation_id, devices=rel.devices)
        # the kubelet stops admitting pods onto the devices before any pod is evicted
        await self.consumers.withdraw(step.allocation_id, list(rel.devices))
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
        assert self.releases is not None
        try:
            self.releases.clear_freed(step.allocation_id)  # the operator's word, if any, is spent
        except OSError as exc:
            log.warning("operator's freed marker not removed", allocation_id=step.allocation_id, error=str(exc))
        state.reported.pop(step.allocation_id, None)
        state.bound.pop(step.allocation_id, None)
        state.hold_conditions.pop(step.allocation_id, None)
        state.intents.pop(step.allocation_id, None)
        state.written.pop(step.allocation_id, None)
        state.note_released(step.allocation_id, rel.generation)
        self.save_state(state)
        log.info("Kubernetes hold released: no pod holds its devices", allocation_id=step.allocation_id, event_id=rel.event_id)

    async def _set_hold_condition(self, step: SetHoldCondition, state: ConvergerState) -> None:
        c = step.condition
        event_id = hold_condition_id(self.node_id, step.allocation_id, step.generation, c)
        event = HoldCondition(
            allocation_id=step.allocation_id, reservation_id=step.reservation_id, generation=step.generation, devices=list(step.devices), condition=c
        )
        await self.outbox.publish("hold", event_id, encode(event))
        state.hold_conditions[step.allocation_id] = c
        self.save_state(state)
        (log.warning if c.status == "False" else log.info)(
            "hold condition", allocation_id=step.allocation_id, type=c.type, status=c.status, reason=c.reason, detail=c.message
        )

    async def _set_condition(self, condition: Condition, state: ConvergerState) -> None:
        event_id = condition_id(self.node_id, condition)
        await self.outbox.publish("condition", event_id, encode(NodeCondition(condition=condition)))
        state.conditions[condition.type] = condition
        self.save_state(state)
        (log.warning if condition.status == "True" else log.info)(
            "node condition", type=condition.type, status=condition.status, reason=condition.reason, detail=condition.message
        )


def _alloc(step: Step) -> str:
    return getattr(step, "allocation_id", getattr(step, "path", "?"))


__all__ = ["Applier"]
