"""The control plane's persisted state and its pure transitions: `<state_dir>/state.json`.

This module owns what the control plane decides and must remember across a restart:
reservations, processed event ids, the boot ids each node announced, its key and
the generations put per node (the last, and which were issued at all: an event
naming a generation this control plane never put is refused, commit.py). It also owns the one way that file is read and
written, StateStore: atomic writes under a file lock, so `bcd apply` in another
process and the running consumer never lose each other's updates. The transitions
(next_generation, reserve_generation, apply_spec, apply_event, remember_*,
generation_issued) are pure functions of the
state. The serve loop and a put call them inside one transaction, and
`bcd apply` and `bcd up` read it as it stands with peek_state.

The reservation state machine:

    binding  -> active    on a verified Bound
    *        -> failed    on AllocationFailed (reason and message kept)
    *        -> released  on a verified Released
    active   -> releasing when a newer spec no longer names the reservation
    binding  -> withdrawn when a newer spec no longer names it before it bound
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import msgspec

from shared import logs
from shared.fsutil import atomic_write, read_regular
from shared.schemas import (
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    Condition,
    Hello,
    HoldCondition,
    NodeCondition,
    NodeSpec,
    SectionStatus,
    encode,
)
from shared.schemas.codec import BoundedDecoder
from shared.schemas.common import INT64_MAX
from shared.schemas.nodespec import GENERATION_SAFE_MAX

log = logs.get_logger("controlplane")

#: how many processed event ids state.json remembers (oldest forgotten first).
MAX_PROCESSED_IDS = 20_000
#: how many runs of issued generations a node's record keeps (oldest forgotten first). A put at
#: last + 1 widens the last run; only a jump (a requested generation, a bucket found ahead)
#: starts one, so this bounds the record, not the number of puts.
MAX_ISSUED_RUNS = 256

STATE_FILE = "state.json"
#: the largest state file read back (nodes, bookings, up to MAX_PROCESSED_IDS event ids).
STATE_MAX_BYTES = 256 * 1024 * 1024
LOCK_FILE = "state.lock"

ReservationState = Literal["binding", "active", "failed", "releasing", "released", "withdrawn"]


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """What the control plane knows of one reservation."""

    reservation_id: str
    node_id: str
    allocation_id: str
    state: ReservationState
    #: the spec generation that last named it, or the event's generation after an event.
    generation: int
    reason: str = ""
    message: str = ""
    #: atom ids a Bound/Released reported.
    devices: list[str] = []
    #: the event that last moved it ("" after a spec put).
    event_id: str = ""
    updated_at: datetime
    #: the node's word on its hold's cards (HoldCondition: DevicesHealthy=False when a card under
    #: it turned unhealthy); None when the node never said anything
    condition: Condition | None = None


class NodeRecord(msgspec.Struct, kw_only=True):
    """Per-node memory: generations, announced boot ids, the last key, conditions, sections."""

    last_generation: int = 0
    #: the generations this control plane reserved for the node (each signed and put at most
    #: once), as [first, last] runs of consecutive generations, oldest first; at most
    #: MAX_ISSUED_RUNS. Empty with a last_generation above 0: a record from a release that did
    #: not keep them, read as 1..last_generation (issued_runs).
    issued: list[tuple[int, int]] = []
    #: every boot id the node announced in a Hello, oldest first.
    boot_ids: list[str] = []
    key_id: str = ""
    conditions: dict[str, Condition] = {}
    sections: dict[str, SectionStatus] = {}


class ControlPlaneState(msgspec.Struct, kw_only=True):
    """`<state_dir>/state.json`."""

    version: int = 1
    #: event id -> when it was applied (insertion order: oldest first).
    processed: dict[str, datetime] = {}
    reservations: dict[str, Reservation] = {}
    nodes: dict[str, NodeRecord] = {}
    rejected_count: int = 0
    duplicate_count: int = 0

    def node(self, node_id: str) -> NodeRecord:
        rec = self.nodes.get(node_id)
        if rec is None:
            rec = self.nodes[node_id] = NodeRecord()
        return rec


#: state.json's decoder (also `bcd apply`'s, which reads the file without the lock).
STATE_DECODER = BoundedDecoder(ControlPlaneState, max_bytes=256 * 1024 * 1024, what="control-plane state")


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def next_generation(state: ControlPlaneState, node_id: str, requested: int | None, published: int = 0) -> tuple[int, str]:
    """The generation to put: `requested` when above everything put so far, else last + 1.

    `published` is the generation found in the bucket now (it may be ahead of
    state.json when the state dir was lost or another control plane put).
    Returns (generation, note); the note says why a requested one was bumped.
    """
    last = max(state.node(node_id).last_generation, published)
    if last == GENERATION_SAFE_MAX:
        # the count never crosses the bound: above it a node's only way back is a rebase, and a
        # rebase goes above the highest issued generation at or below it, which would be none
        raise GenerationExhausted(node_id, last, bound=GENERATION_SAFE_MAX)
    if requested is not None and requested > last:
        return requested, ""
    if last + 1 > INT64_MAX:
        # a spec's generation is an int64 (docs/upstream.md): there is no next one to put. Not the
        # caller's input (the spec is fine): the node's situation, said with what to do
        raise GenerationExhausted(node_id, last)
    if requested is None:
        return last + 1, ""
    return last + 1, f"generation {requested} is not above the last put generation {last}; put as {last + 1}"


def rebase_target(state: ControlPlaneState, node_id: str, stuck: int) -> int:
    """The generation a rebase of a node at `stuck` puts it at: one above the highest this control
    plane issued at or below GENERATION_SAFE_MAX (1 with none). Never issued before, so no event
    id of an earlier spec (they carry the generation) comes back, and at or below the bound, so
    the control plane's count goes on from there."""
    rec = state.nodes.get(node_id)
    below = [min(last, GENERATION_SAFE_MAX) for first, last in (issued_runs(rec) if rec is not None else []) if first <= GENERATION_SAFE_MAX]
    target = max(below, default=0) + 1
    if target > GENERATION_SAFE_MAX or target >= stuck:
        raise ValueError(f"node {node_id}: no generation at or below {GENERATION_SAFE_MAX} is left to rebase to")
    return target


def record_rebase(state: ControlPlaneState, node_id: str, stuck: int, target: int) -> None:
    """A rebase from `stuck` to `target` is being put: both issued (events of either are believed:
    holds bound at `stuck` report at it), and `target` the last, which the count goes on from."""
    rec = state.node(node_id)
    _record_issued(rec, stuck)
    _record_issued(rec, target)
    rec.last_generation = target


def issued_runs(rec: NodeRecord) -> list[tuple[int, int]]:
    """The node's issued generations as runs; a record written before they were kept: 1..last_generation."""
    if not rec.issued and rec.last_generation > 0:
        return [(1, rec.last_generation)]
    return list(rec.issued)


def generation_issued(state: ControlPlaneState, node_id: str, generation: int) -> bool:
    """Did this control plane ever put `generation` for `node_id` (or reserve it for a put)?"""
    rec = state.nodes.get(node_id)
    return rec is not None and any(first <= generation <= last for first, last in issued_runs(rec))


def _record_issued(rec: NodeRecord, generation: int) -> None:
    runs = issued_runs(rec)
    if any(first <= generation <= last for first, last in runs):
        return
    merged: list[tuple[int, int]] = []
    for first, last in sorted([*runs, (generation, generation)]):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(last, merged[-1][1]))
        else:
            merged.append((first, last))
    # bounded: the oldest runs go first, and their generations count as never issued from then on
    rec.issued = merged[-MAX_ISSUED_RUNS:]


def reserve_generation(state: ControlPlaneState, node_id: str, generation: int) -> None:
    """`generation` is taken for a put to `node_id`: the last put, and issued from now on.

    Recorded before the put itself (publish.py), so a crash between the two leaves
    it issued: a generation is signed at most once, and a node can only report one
    that was put.
    """
    rec = state.node(node_id)
    # runs first: a record with no runs and a last_generation reads as an earlier release's
    _record_issued(rec, generation)
    rec.last_generation = max(rec.last_generation, generation)


def apply_spec(state: ControlPlaneState, spec: NodeSpec, at: datetime) -> None:
    """A spec was put: its reservations are binding unless already active for the same allocation."""
    reserve_generation(state, spec.node_id, spec.generation)
    rec = state.node(spec.node_id)
    named: set[str] = set()
    for a in spec.devices:
        named.add(a.reservation_id)
        cur = state.reservations.get(a.reservation_id)
        if cur is not None and cur.state == "active" and cur.allocation_id == a.allocation_id and cur.node_id == spec.node_id:
            state.reservations[a.reservation_id] = msgspec.structs.replace(cur, generation=spec.generation, updated_at=at)
            continue
        state.reservations[a.reservation_id] = Reservation(
            reservation_id=a.reservation_id,
            node_id=spec.node_id,
            allocation_id=a.allocation_id,
            state="binding",
            generation=spec.generation,
            devices=list(a.devices),
            updated_at=at,
        )
    for rid, cur in list(state.reservations.items()):
        if cur.node_id != spec.node_id or rid in named:
            continue
        if cur.state == "active":
            state.reservations[rid] = msgspec.structs.replace(cur, state="releasing", generation=spec.generation, updated_at=at)
        elif cur.state == "binding":
            state.reservations[rid] = msgspec.structs.replace(cur, state="withdrawn", generation=spec.generation, updated_at=at)


def apply_event(state: ControlPlaneState, node_id: str, event: object, event_id: str, at: datetime) -> Reservation | None:
    """Apply one accepted (verified or plain) event; return the reservation it moved, if any.

    The caller has already checked signatures and duplicates: this is only
    the state machine.
    """
    if isinstance(event, (AllocationBound, AllocationReleased, AllocationFailed)):
        cur = state.reservations.get(event.reservation_id)
        new_state: ReservationState
        reason = message = ""
        if isinstance(event, AllocationBound):
            new_state = "active"
        elif isinstance(event, AllocationReleased):
            new_state = "released"
        else:
            new_state, reason, message = "failed", event.reason, event.message
        devices = list(getattr(event, "devices", [])) or (list(cur.devices) if cur is not None else [])
        rsv = Reservation(
            reservation_id=event.reservation_id,
            node_id=node_id,
            allocation_id=event.allocation_id,
            state=new_state,
            generation=event.generation,
            reason=reason,
            message=message,
            devices=devices,
            event_id=event_id,
            updated_at=at,
        )
        state.reservations[event.reservation_id] = rsv
        return rsv
    if isinstance(event, HoldCondition):
        cur = state.reservations.get(event.reservation_id)
        if cur is not None and cur.node_id == node_id and cur.allocation_id == event.allocation_id:
            moved = msgspec.structs.replace(cur, condition=event.condition, event_id=event_id, updated_at=at)
            state.reservations[event.reservation_id] = moved
            return moved
        return None
    if isinstance(event, NodeCondition):
        state.node(node_id).conditions[event.condition.type] = event.condition
    elif isinstance(event, SectionStatus):
        state.node(node_id).sections[event.section] = event
    return None


def remember_processed(state: ControlPlaneState, event_id: str, at: datetime, limit: int = MAX_PROCESSED_IDS) -> None:
    state.processed[event_id] = at
    excess = len(state.processed) - limit
    if excess > 0:
        # only the oldest `excess` keys (one, once full), not a copy of all of them per event
        for old in list(itertools.islice(state.processed, excess)):
            del state.processed[old]


def remember_boot(state: ControlPlaneState, hello: Hello) -> bool:
    """Record the Hello's boot id and key; True when the boot id is new."""
    rec = state.node(hello.node_id)
    if rec.key_id and rec.key_id != hello.key_id:
        log.warning("node key changed", node_id=hello.node_id, old_key_id=rec.key_id, new_key_id=hello.key_id)
    rec.key_id = hello.key_id
    if hello.boot_id in rec.boot_ids:
        return False
    rec.boot_ids.append(hello.boot_id)
    return True


def peek_state(state_dir: Path) -> ControlPlaneState:
    """The state as it is on disk now, read-only and without the lock (what `bcd apply` and
    `bcd up` look at beside a running control plane); a fresh one when there is none or it
    does not read."""
    try:
        return STATE_DECODER.decode(read_regular(Path(state_dir) / STATE_FILE, max_bytes=STATE_MAX_BYTES))
    except (OSError, ValueError):
        return ControlPlaneState()


class GenerationExhausted(Exception):
    """The node's last generation is the largest a spec can carry: no put can follow it."""

    #: a situation an operator can be in (bcd.exits prints it as one line, not an internal error)
    operator_error = True

    def __init__(self, node_id: str, last: int, *, bound: int = INT64_MAX) -> None:
        if bound == INT64_MAX:
            text = (
                f"node {node_id} is at generation {last}, the largest a spec can carry ({INT64_MAX}): no spec can follow it; "
                "`bcd rebase` (this node's control plane) or `python -m controlplane rebase` brings it back with its holds "
                "(docs/upstream.md, \"Generations\")"
            )
        else:
            text = (
                f"node {node_id} is at generation {last}, the last a control plane counts to ({bound}, 2^53 - 1): its "
                "count cannot go on and no rebase can go below it; move the node to a new control-plane record "
                "(docs/upstream.md, \"Generations\")"
            )
        super().__init__(text)
        self.node_id = node_id
        self.last = last


class StateError(Exception):
    """state.json is unusable; the text says what to do."""

    #: a situation an operator can be in (bcd.exits prints it as one line, not an internal error)
    operator_error = True


class StateStore:
    """state.json under an exclusive flock, reloaded when another process changed it."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / STATE_FILE
        self.lock_path = self.dir / LOCK_FILE
        self.state = ControlPlaneState()
        self._stamp: tuple[int, int, int] | None = None
        with self._locked():
            self._reload(force=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _reload(self, *, force: bool = False) -> None:
        stamp = self._file_stamp()
        if not force and stamp == self._stamp:
            return
        if stamp is None:
            self.state = ControlPlaneState()
        else:
            try:
                self.state = STATE_DECODER.decode(read_regular(self.path, max_bytes=STATE_MAX_BYTES))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise StateError(f"{self.path}: does not decode ({exc}); move it away to start afresh") from None
            except OSError as exc:
                raise StateError(f"{self.path}: cannot read ({exc}); move it away to start afresh") from None
        self._stamp = stamp

    def refresh(self) -> ControlPlaneState:
        """The current state, reloaded if another process wrote it."""
        if self._file_stamp() != self._stamp:
            with self._locked():
                self._reload()
        return self.state

    @contextlib.contextmanager
    def transaction(self) -> Iterator[ControlPlaneState]:
        """Lock, reload if changed, let the caller mutate, write atomically.

        Synchronous on purpose: no await can run inside, so two coroutines of
        one process never interleave a transaction (and never deadlock on the flock).
        """
        with self._locked():
            self._reload()
            try:
                yield self.state
            except BaseException:
                self._reload(force=True)  # drop the half-applied change
                raise
            try:
                atomic_write(self.path, encode(self.state), 0o600)
            except BaseException:
                # not saved (a full disk): nor kept in memory, where a retry would take it for saved
                self._reload(force=True)
                raise
            self._stamp = self._file_stamp()


__all__ = [
    "MAX_PROCESSED_IDS",
    "STATE_FILE",
    "STATE_MAX_BYTES",
    "LOCK_FILE",
    "STATE_DECODER",
    "ReservationState",
    "Reservation",
    "NodeRecord",
    "ControlPlaneState",
    "now_utc",
    "next_generation",
    "MAX_ISSUED_RUNS",
    "issued_runs",
    "rebase_target",
    "record_rebase",
    "generation_issued",
    "reserve_generation",
    "apply_spec",
    "apply_event",
    "remember_processed",
    "remember_boot",
    "GenerationExhausted",
    "StateError",
    "StateStore",
]
