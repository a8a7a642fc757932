"""Group commit: a pass's releases, binds and Bound reports applied as one batch.

The promises of a single bind or release (apply.py) hold for every hold of
the batch; what changes is how many fsyncs and round trips they cost:

1. one journal write (one fsync) records the intent of every release and
   bind of the batch, before any side effect; the one `sign_batch` request
   for every report of the batch goes out just before it, so the signer
   works while the journal and the files are written (a signature is no side
   effect: only a published report is);
2. the releases' consumer copies go, then their CDI specs, then their env
   files (the unlinks), then their slices stop;
3. unless a release failed, the binds' slices are applied, then their CDI
   specs, their consumer copies and then their env files written as groups (all temps, one
   concurrent fsync, the renames: `shared.fsutil.atomic_write_many`); the
   directories the batch touched are synced once, together, at the end
   (files in a worker thread: the event loop stays free);
4. the signatures are collected (only those of what is now to be reported
   are used);
5. the Released events, and the Bound events on cards no Released of the
   batch names (shared.eventorder), are published as one pipelined wave and
   their acks awaited; only when every Released is in the outbox do the
   Bounds that take a released card follow (a control plane sees a GPU's
   Released before the Bound that takes it), then the AllocationFailed
   events;
6. one journal write records completion (with the section status, for the
   pass's last batch).

A crash anywhere replays to the same result with the same event ids: an
intent without its side effects is planned again (or undone), a hold whose
files are all there is reported with the event id its intent recorded (a
second copy is dropped by the outbox's duplicate window), a release whose
files are gone is reported again. A Bound of a hold that is also released in
this batch (a bind interrupted after its CDI spec, no longer wanted) goes out
first, in a wave of its own, before anything of the batch is touched.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from shared import logs
from shared.eventorder import gpus_of, shares_gpu
from shared.holdfiles import HoldContent
from shared.schemas import AllocationBound, AttestedEvent, encode

from .applyrun import ApplyResult, CommitTools, PassRun
from .hostwriter import HostWriteError
from .model import BindHold, ConvergerState, Intent, Refusal, ReleaseHold, ReportBound, ReportFailed
from .outbox import OutboxError

log = logs.get_logger("bcd.converger.apply")


@dataclass
class Batch:
    """Batchable steps collected in plan order until the next flush."""

    releases: list[ReleaseHold] = field(default_factory=list)
    binds: list[BindHold] = field(default_factory=list)
    reports: list[ReportBound] = field(default_factory=list)
    #: AllocationFailed events: published after the Bounds (upstream.md: releases, binds, failures).
    failures: list[ReportFailed] = field(default_factory=list)

    def add(self, step: ReleaseHold | BindHold | ReportBound | ReportFailed) -> None:
        if isinstance(step, ReleaseHold):
            self.releases.append(step)
        elif isinstance(step, BindHold):
            self.binds.append(step)
        elif isinstance(step, ReportFailed):
            self.failures.append(step)
        else:
            self.reports.append(step)

    def __bool__(self) -> bool:
        return bool(self.releases or self.binds or self.reports or self.failures)


class GroupCommit:
    """Runs a Batch with an Applier's tools (its writer, signer, outbox, journal and crash points)."""

    def __init__(self, applier: CommitTools) -> None:
        self.a = applier

    def _intent(self, op: str, alloc: str, event: AttestedEvent, event_id: str, *, cgroup_parent: str = "", sliced: bool = False) -> Intent:
        return Intent(
            op=op,  # type: ignore[arg-type]
            allocation_id=alloc,
            reservation_id=event.reservation_id,
            generation=event.generation,
            devices=list(event.devices),
            event_id=event_id,
            boot_id=self.a.boot_id(),
            started_at=self.a.clock(),
            cgroup_parent=cgroup_parent,
            sliced=sliced,
        )

    def _fail(self, result: ApplyResult, alloc: str, exc: Exception, step: str) -> None:
        result.errors.append(f"{alloc}: {exc}")
        log.warning("step failed; will retry", step=step, allocation_id=alloc, error=str(exc))

    async def _report(self, items: list[tuple[str, str, AttestedEvent]]) -> tuple[list[bytes] | None, str]:
        """Sign (type, event id, event) items in one go: their payloads, or None and why not."""
        if not items:
            return [], ""
        try:
            reports = await self.a.signer.sign_many([(event_id, event) for _, event_id, event in items])
        except OutboxError as exc:
            return None, str(exc)
        return [encode(r) for r in reports], ""

    async def _publish(self, items: list[tuple[tuple[str, str, AttestedEvent], bytes]]) -> list[OutboxError | None]:
        """One pipelined wave of signed reports ((type, event id, event), payload), each
        with the GPUs it names (GPUS_HEADER) so the bridge can keep the same rule."""
        if not items:
            return []
        points = {"released": "release.published", "bound": "bind.published"}
        return await self.a.outbox.publish_many(
            [(t, i, p) for (t, i, _), p in items],
            acked=lambda item: self.a.crash(points[item[0]]),
            gpus={i: gpus_of(e.devices) for (_, i, e), _ in items},
        )

    def _settle_bound(self, alloc: str, err: OutboxError | None, published: set[str], result: ApplyResult, run: PassRun) -> None:
        """A Bound's publish outcome: in `published`, or failed and unreported in this pass."""
        if err is None:
            published.add(alloc)
            return
        self._fail(result, alloc, err, "ReportBound")
        run.unreported.add(alloc)

    def _completed_bound(self, state: ConvergerState, alloc: str, event_id: str, event: AllocationBound) -> None:
        state.reported[alloc] = event_id
        state.released.pop(alloc, None)  # live again: a file of it is no stale copy
        state.bound[alloc] = self._intent("bind", alloc, event, event_id, cgroup_parent=event.cgroup_parent, sliced=bool(event.cgroup_parent))
        state.intents.pop(alloc, None)

    async def run(self, batch: Batch, state: ConvergerState, result: ApplyResult, run: PassRun, *, save: bool = True) -> list[str]:
        """Apply the batch; returns the completion crash points still to pass (when `save` is
        False the caller writes the completion record, with the section, and passes them)."""
        a = self.a
        released_allocs = {s.allocation_id for s in batch.releases}
        pre = [s for s in batch.reports if s.allocation_id in released_allocs]
        kept_reports = [s for s in batch.reports if s.allocation_id not in released_allocs]

        # 0. the Bound of an interrupted bind released in this batch goes out before its Released
        skip_release: set[str] = set()
        if pre:
            payloads, why = await self._report([("bound", s.event_id, s.event) for s in pre])
            outcome: list[OutboxError | None] = (
                await self._publish([(("bound", s.event_id, s.event), p) for s, p in zip(pre, payloads)])
                if payloads is not None
                else [OutboxError(why)] * len(pre)
            )
            for s, err in zip(pre, outcome):
                if err is None:
                    self._completed_bound(state, s.allocation_id, s.event_id, s.event)
                    continue
                self._fail(result, s.allocation_id, err, "ReportBound")
                run.unreported.add(s.allocation_id)
                # a Released now would follow no Bound
                result.errors.append(f"{s.allocation_id}: not released in this pass: its Bound could not be reported")
                skip_release.add(s.allocation_id)
                run.release_failed = run.switch_held = True

        releases = [s for s in batch.releases if s.allocation_id not in skip_release]
        binds: list[BindHold] = []
        for s in batch.binds:
            if run.release_failed:
                result.errors.append(f"{s.allocation_id}: not bound in this pass: a release before it failed")
            elif not run.room:
                why = getattr(a.outbox, "error", "") or "the outbox is full (upstream not draining)"
                result.errors.append(f"{s.allocation_id}: not bound in this pass: {why}")
            else:
                binds.append(s)
        kept_reports = [s for s in kept_reports if not _held_back(s, run, result)]

        # 1. one journal write: every intent of the batch before any side effect
        before = {s.allocation_id: state.intents.get(s.allocation_id) for s in binds}
        before_written = {s.allocation_id: state.written.get(s.allocation_id) for s in binds}
        recorded = False
        for s in releases:
            existing = state.intents.get(s.allocation_id)
            if s.report and (existing is None or existing.op != "release"):
                state.intents[s.allocation_id] = self._intent("release", s.allocation_id, s.event, s.event_id, sliced=s.sliced)
                recorded = True
        for s in binds:
            c = s.content
            state.intents[s.allocation_id] = self._intent("bind", s.allocation_id, s.event, s.event_id, cgroup_parent=c.cgroup_parent, sliced=bool(c.cgroup_parent))
            if s.written is not None:
                # what its files will say, before they are written: the truth drift is judged by
                state.written[s.allocation_id] = s.written
            recorded = True
        # the one sign request goes out now: the signer works while the journal and the
        # files are written (a signature is no side effect; only a published report is)
        candidates = [
            *(("released", s.event_id, s.event) for s in releases if s.report),
            *(("bound", s.event_id, s.event) for s in binds if s.report),
            *(("bound", s.event_id, s.event) for s in kept_reports),
        ]
        signing = asyncio.ensure_future(self._report(candidates))
        try:
            if recorded:
                await asyncio.to_thread(a.save_state, state)
            if any(s.report for s in releases):
                a.crash("release.intent-recorded")
            if binds:
                a.crash("bind.intent-recorded")

            # 2. the releases' files and slices; 3. the binds' files, unless a release failed
            gone, placed, not_run = await asyncio.to_thread(self._files, releases, binds, result, run)

            # 4. the signatures of what is to be reported
            signed, why = await signing
        finally:
            if not signing.done():
                signing.cancel()
                with contextlib.suppress(BaseException):
                    await signing
        rel_items = [("released", s.event_id, s.event) for s in gone if s.report]
        bind_items = [("bound", s.event_id, s.event) for s in placed if s.report]
        kept_items = [("bound", s.event_id, s.event) for s in kept_reports]
        payloads: list[bytes] | None = None
        if signed is not None:
            by_id = {event_id: p for (_, event_id, _), p in zip(candidates, signed)}
            payloads = [by_id[event_id] for _, event_id, _ in [*rel_items, *bind_items, *kept_items]]
        if rel_items:
            a.crash("release.signed")
        if bind_items or kept_items:
            a.crash("bind.signed")

        # 5. Released first; a Bound that takes a card a Released of this batch frees waits
        # until every Released is in the outbox, the others go in the same wave behind them
        published_rel: set[str] = set()
        published_bound: set[str] = set()
        if payloads is None:
            for _, event_id, event in [*rel_items, *bind_items, *kept_items]:
                self._fail(result, event.allocation_id, OutboxError(why), "report")
                run.unreported.add(event.allocation_id)
            if rel_items:
                run.release_failed = run.switch_held = True
        else:
            n_rel = len(rel_items)
            freed = gpus_of([d for _, _, e in rel_items for d in e.devices])
            bounds = [*zip(bind_items, payloads[n_rel : n_rel + len(bind_items)]), *zip(kept_items, payloads[n_rel + len(bind_items) :])]
            free = [b for b in bounds if not shares_gpu(gpus_of(b[0][2].devices), freed)]
            taking = [b for b in bounds if shares_gpu(gpus_of(b[0][2].devices), freed)]
            first = [*zip(rel_items, payloads[:n_rel]), *free]
            outcome = await self._publish(first)
            for ((event_type, event_id, event), _p), err in zip(first, outcome):
                if event_type == "released":
                    if err is None:
                        published_rel.add(event.allocation_id)
                        log.info("hold released", allocation_id=event.allocation_id, event_id=event_id)
                    else:
                        self._fail(result, event.allocation_id, err, "ReleaseHold")
                        run.release_failed = run.switch_held = True
                else:
                    self._settle_bound(event.allocation_id, err, published_bound, result, run)
            if run.release_failed:
                # such a Bound may take a GPU whose Released is not out: next pass
                for (_, event_id, event), _p in taking:
                    result.errors.append(f"{event.allocation_id}: Bound not reported in this pass: a release before it failed")
                    run.unreported.add(event.allocation_id)
                taking = []
            outcome = await self._publish(taking)
            for ((_, _, event), _p), err in zip(taking, outcome):
                self._settle_bound(event.allocation_id, err, published_bound, result, run)
        if batch.failures:
            # after the Bounds; plain events, not signed, not held back by a failed release
            outcome = await self.a.outbox.publish_many([("failed", s.event_id, encode(s.event)) for s in batch.failures])
            for s, err in zip(batch.failures, outcome):
                if err is not None:
                    self._fail(result, s.allocation_id, err, "ReportFailed")
                    continue
                e = s.event
                state.reported_failures[s.allocation_id] = e.generation
                state.refusals[s.allocation_id] = Refusal(generation=e.generation, reason=e.reason, message=e.message)
                result.done += 1
                log.warning("hold refused", allocation_id=s.allocation_id, reason=e.reason, detail=e.message, generation=e.generation)

        # 6. one completion record
        for s in gone:
            if s.report and s.allocation_id not in published_rel:
                continue  # stays journaled as a release: reported again next pass
            state.reported.pop(s.allocation_id, None)
            state.bound.pop(s.allocation_id, None)
            state.hold_conditions.pop(s.allocation_id, None)
            state.intents.pop(s.allocation_id, None)
            state.written.pop(s.allocation_id, None)
            if s.report:
                state.note_released(s.allocation_id, s.event.generation)
            result.done += 1
            if not s.report:
                log.info("unreported bind undone", allocation_id=s.allocation_id)
        for s in placed:
            if not s.report:
                state.intents.pop(s.allocation_id, None)
                result.done += 1
                log.info("hold files re-created (already reported Bound)", allocation_id=s.allocation_id)
            elif s.allocation_id in published_bound:
                self._completed_bound(state, s.allocation_id, s.event_id, s.event)
                result.done += 1
                log.info("hold bound", allocation_id=s.allocation_id, devices=list(s.event.devices), cgroup_parent=s.event.cgroup_parent, event_id=s.event_id)
        for s in kept_reports:
            if s.allocation_id in published_bound:
                self._completed_bound(state, s.allocation_id, s.event_id, s.event)
                result.done += 1
        for s in not_run:
            prev = before.get(s.allocation_id)
            if prev is None:
                state.intents.pop(s.allocation_id, None)
            else:
                state.intents[s.allocation_id] = prev
            prev_written = before_written.get(s.allocation_id)
            if prev_written is None:
                state.written.pop(s.allocation_id, None)
            else:
                state.written[s.allocation_id] = prev_written
        result.done += len(pre) - len(skip_release)
        points = [*(["release.completed"] if any(s.report for s in gone) else []), *(["bind.completed"] if placed or kept_reports or pre else [])]
        if save:
            a.save_state(state)
            for point in points:
                a.crash(point)
            return []
        return points

    def _files(
        self, releases: list[ReleaseHold], binds: list[BindHold], result: ApplyResult, run: PassRun
    ) -> tuple[list[ReleaseHold], list[BindHold], list[BindHold]]:
        """The releases' files, then the binds' unless a release failed (in a worker thread:
        blocking writes and fsyncs). Returns the releases gone, the binds placed, and the
        binds that never started (they keep the journal as it was; one that failed half-way
        keeps its intent: the next pass finishes or undoes it).

        The directories are synced once, together, at the end: nothing of the batch is
        reported before (a kill -9 loses no page cache; after a power cut the journaled
        intents replay whatever part of the group reached the disk)."""
        dirs: set[Path] = set()
        gone = self._release_files(releases, result, run, dirs)
        not_run: list[BindHold] = []
        placed: list[BindHold] = []
        if binds and run.release_failed:
            for s in binds:
                result.errors.append(f"{s.allocation_id}: not bound in this pass: a release before it failed")
            not_run = binds
        elif binds:
            placed = self._bind_files(binds, result, dirs)
        if dirs:
            try:
                self.a.writer.sync_dirs(dirs)
            except HostWriteError as exc:
                # nothing of the group is known to be on disk: none of it is reported
                for s in gone:
                    self._fail(result, s.allocation_id, exc, "ReleaseHold")
                    if s.report:
                        run.release_failed = True
                    run.switch_held = True
                for b in placed:
                    self._fail(result, b.allocation_id, exc, "BindHold")
                return [], [], not_run
        return gone, placed, not_run

    def _release_files(self, releases: list[ReleaseHold], result: ApplyResult, run: PassRun, dirs: set[Path]) -> list[ReleaseHold]:
        """Consumer copies, CDI specs, then env files, then slices; the releases whose files are all gone."""
        w, crash = self.a.writer, self.a.crash
        if not releases:
            return []

        def failed(s: ReleaseHold, exc: Exception) -> None:
            self._fail(result, s.allocation_id, exc, "ReleaseHold")
            if s.report:
                run.release_failed = True
            run.switch_held = True

        left = list(releases)
        # the consumer copy first: a runtime must never find a device whose hold spec is gone
        for kind, point in (
            ("cdi-consumer", "release.consumer-removed"),
            ("cdi", "release.cdi-removed"),
            ("allocation-env", "release.env-removed"),
        ):
            errors = w.remove_many(kind, [s.allocation_id for s in left], done=lambda _, p=point: crash(p), dirs=dirs)  # type: ignore[arg-type]
            for s in left:
                if s.allocation_id in errors:
                    failed(s, errors[s.allocation_id])
            left = [s for s in left if s.allocation_id not in errors]
        gone = []
        for s in left:
            try:
                if s.sliced and not w.stop_slice(s.allocation_id):
                    log.info("slice kept: a workload still runs in it", allocation_id=s.allocation_id)
            except HostWriteError as exc:
                failed(s, exc)
                continue
            crash("release.slice-stopped")
            gone.append(s)
        return gone

    def _bind_files(self, binds: list[BindHold], result: ApplyResult, dirs: set[Path]) -> list[BindHold]:
        """Slices, then CDI specs, their consumer copies, then env files; the binds whose files are all in place."""
        w, crash = self.a.writer, self.a.crash
        left: list[BindHold] = []
        for s in binds:
            c = s.content
            if c.cgroup_parent and c.limits is not None:
                try:
                    w.apply_slice(s.allocation_id, c.limits)
                except HostWriteError as exc:
                    self._fail(result, s.allocation_id, exc, "BindHold")
                    continue
                crash("bind.slice-applied")
            left.append(s)
        by_alloc: dict[str, HoldContent] = {s.allocation_id: s.content for s in left}
        errors = w.write_many("cdi", [by_alloc[s.allocation_id] for s in left], done=lambda _: crash("bind.cdi-written"), dirs=dirs)
        for s in left:
            if s.allocation_id in errors:
                self._fail(result, s.allocation_id, errors[s.allocation_id], "BindHold")
        left = [s for s in left if s.allocation_id not in errors]
        # the consumer copies are made from the hold specs just written (so they say the same)
        errors = w.write_many("cdi-consumer", [by_alloc[s.allocation_id] for s in left], done=lambda _: crash("bind.consumer-written"), dirs=dirs)
        left = self._undo_failed(left, errors, ("cdi",), result)
        errors = w.write_many("allocation-env", [by_alloc[s.allocation_id] for s in left], done=lambda _: crash("bind.env-written"), dirs=dirs)
        return self._undo_failed(left, errors, ("cdi-consumer", "cdi"), result)

    def _undo_failed(self, binds: list[BindHold], errors: dict[str, HostWriteError], written: tuple[str, ...], result: ApplyResult) -> list[BindHold]:
        """The binds that did not fail; of each that did, the files `written` before (in that
        order) go again: no CDI spec of a hold never reported stays without all its files, so
        the next pass binds it afresh (or undoes the journaled bind unreported)."""
        if not errors:
            return binds
        w = self.a.writer
        undo = [s.allocation_id for s in binds if s.allocation_id in errors and s.report]
        for kind in written:
            for alloc, exc in w.remove_many(kind, undo).items():  # type: ignore[arg-type]
                log.warning("file of a bind that failed half-way not removed", kind=kind, allocation_id=alloc, error=str(exc))
        for s in binds:
            if s.allocation_id in errors:
                self._fail(result, s.allocation_id, errors[s.allocation_id], "BindHold")
        return [s for s in binds if s.allocation_id not in errors]


def _held_back(step: ReportBound, run: PassRun, result: ApplyResult) -> bool:
    if step.allocation_id in run.incomplete:
        result.errors.append(f"{step.allocation_id}: Bound not reported in this pass: its files are not all in place")
        run.unreported.add(step.allocation_id)
        return True
    return False


__all__ = ["Batch", "GroupCommit"]
