"""A judged batch applied to the state in stream order: one state.json write, and the record of each event.

This module owns what each verdict becomes:
- rejected: counted;
- a duplicate: counted, whether it was applied before (state.json's processed
  ids, or an applied line in events.jsonl) or earlier in the same batch;
- refused after all when it carries a generation this control plane never put
  for its node (issue 40: a Bound at a made-up generation must not make a
  reservation active, however well signed): rejected, logged, counted;
- applied: through the state machine (state.apply_event).

It also covers an event that was saved but whose line was lost to a crash: it
gets that line now and is not applied again. A batch whose only news is new
GpuChanged events costs no state write, because their events.jsonl lines are
what remembers them. The serve loop writes the records and acks the batch only
after this returns.
"""

from __future__ import annotations

from shared.schemas import GpuChanged

from .judge import Verdict, refuse
from .ledger import EventRecord
from .state import ControlPlaneState, StateStore, apply_event, generation_issued, remember_processed


def commit_batch(store: StateStore, verdicts: list[Verdict], logged_applied: set[str]) -> list[EventRecord]:
    """Apply judged events in stream order: one state.json write for them all (none when
    nothing in it moves: only new gpu events); the records to log, in the same order.
    `logged_applied`: the event ids with an applied line in events.jsonl."""
    applied: set[str] = set()  # applied in this batch: a second copy in it is a duplicate
    if not moves_state(verdicts, logged_applied):
        return [settle(None, v, applied, logged_applied) for v in verdicts]
    with store.transaction() as st:
        records = [settle(st, v, applied, logged_applied) for v in verdicts]
    return records


def moves_state(verdicts: list[Verdict], logged_applied: set[str]) -> bool:
    """Does settling these touch state.json? Only a new GpuChanged (applied, its log
    line its only record) does not; a duplicate of one counts in duplicate_count."""
    gpu: set[str] = set()
    for v in verdicts:
        if v.rejected or not isinstance(v.event, GpuChanged) or v.event_id in logged_applied or v.event_id in gpu:
            return True
        gpu.add(v.event_id)
    return False


def settle(st: ControlPlaneState | None, v: Verdict, applied: set[str], logged_applied: set[str]) -> EventRecord:
    """One judged event against the state (None: `moves_state` said it moves nothing)."""
    if v.rejected:
        assert st is not None
        st.rejected_count += 1
        return EventRecord(**v.fields, outcome="rejected")
    event_id = v.event_id
    logged = event_id in logged_applied or event_id in applied
    if isinstance(v.event, GpuChanged):
        # nothing in state.json moves for it (apply_event): no fsync'd state write per
        # card change; its applied line in events.jsonl remembers it across a restart
        if not logged:
            applied.add(event_id)
            return EventRecord(**v.fields, outcome="applied")
        assert st is not None
        st.duplicate_count += 1
        return EventRecord(**v.fields, outcome="duplicate")
    assert st is not None
    if event_id in st.processed:
        if not logged:
            # applied and saved, then killed before its log line: the
            # redelivery writes the line it lost (the state is not applied again)
            applied.add(event_id)
            rsv = v.fields.get("reservation_id") or ""
            res = st.reservations.get(rsv) if rsv else None
            return EventRecord(**v.fields, outcome="applied", state=res.state if res else "")
        st.duplicate_count += 1
        return EventRecord(**v.fields, outcome="duplicate")
    node_id, generation = v.fields["node_id"], v.fields.get("generation")
    if generation is not None and not generation_issued(st, node_id, generation):
        # checked here, under the state's lock: a put in another process (bcd apply) is seen
        st.rejected_count += 1
        refused = refuse(v, f"generation {generation} was never put for {node_id} by this control plane")
        return EventRecord(**refused.fields, outcome="rejected")
    now = v.fields["received_at"]
    moved = apply_event(st, node_id, v.event, event_id, now)
    remember_processed(st, event_id, now)
    applied.add(event_id)
    return EventRecord(**v.fields, outcome="applied", state=moved.state if moved else "")


__all__ = ["commit_batch", "moves_state", "settle"]
