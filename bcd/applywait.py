"""`bcd apply --wait`: follow one generation through the control plane's verified events to its outcome.

`Follower` is pure: it is fed the EventRecords the control plane appended to
`events.jsonl` after the put, and says what to print and when the generation
has its outcome (the `section` event whose `observed_generation` is the
applied one, CONVERGED or FAILED; DESIGN 5 puts every `bound`/`released`/
`failed` of a generation before it). `follow` tails the file until then or a
deadline. A spec with more than `PER_HOLD_LINES` assignments gets progress
lines (`bound 120/1024, ...`) instead of a line per hold, and its failures up
to that many.

Only what the node said about THIS generation decides a result (issue 41.7: with
the converger stopped, `kept ... (bound at an earlier generation)` lines were
printed from the control plane's record before the node had seen the spec).
Results per allocation: `bound` (a Bound at the generation for the same
reservation), `failed` (an AllocationFailed at the generation), `kept` (the
node's section reported the generation CONVERGED or FAILED and the hold had
no event of its own: held unchanged, said then and not before), `pending`
(nothing yet; on a timeout, what the node never reported stays pending).
Holds no longer named come back as `released` at the generation. Events of an
earlier generation print nothing; a Bound among them only lends its cgroup
parent to the line said when the section comes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from controlplane.ledger import EventRecord, short_atom
from controlplane.state import Reservation
from shared.schemas import NodeSpec
from shared.schemas.codec import BoundedDecoder
from shared.schemas.strict import UNKNOWN_FIELDS_CONDITION


#: a spec with more assignments than this gets progress lines instead of one line per hold.
PER_HOLD_LINES = 20
#: at most one progress line this often (seconds), while something changed.
PROGRESS_EVERY_S = 1.0
POLL_S = 0.2

#: exit codes of `bcd apply --wait`.
EXIT_CONVERGED = 0
EXIT_FAILED = 1
EXIT_TIMEOUT = 3

Outcome = Literal["CONVERGED", "FAILED", "REFUSED", "SUPERSEDED", "TIMEOUT"]
HoldResult = Literal["pending", "bound", "kept", "failed"]

_RECORD = BoundedDecoder(EventRecord, max_bytes=4 * 1024 * 1024, what="event record")


def _devices(devices: Iterable[str], limit: int = 3) -> str:
    devs = list(devices)
    shown = ", ".join(short_atom(d) for d in devs[:limit])
    return shown + (f" +{len(devs) - limit} more" if len(devs) > limit else "")


@dataclass
class HoldOutcome:
    allocation_id: str
    reservation_id: str
    result: HoldResult = "pending"
    devices: list[str] = field(default_factory=list)
    cgroup_parent: str = ""
    cdi_devices: list[str] = field(default_factory=list)
    reason: str = ""
    message: str = ""
    #: the generation of the event that decided it (a kept hold: the control plane's record).
    generation: int | None = None

    def line(self) -> str:
        who = f"{self.allocation_id} ({self.reservation_id})"
        if self.result == "failed":
            return f"failed   {who}  {self.reason}" + (f": {self.message}" if self.message else "")
        if self.result in ("bound", "kept"):
            text = f"{self.result:<8} {who}  {_devices(self.devices) or '(no devices)'}"
            if self.cgroup_parent:
                text += f"  cgroup parent {self.cgroup_parent}"
            return text + ("  (held from an earlier generation)" if self.result == "kept" else "")
        return f"pending  {who}"

    def to_json(self) -> dict[str, Any]:
        return {
            "allocation_id": self.allocation_id,
            "reservation_id": self.reservation_id,
            "result": self.result,
            "devices": list(self.devices),
            "cgroup_parent": self.cgroup_parent,
            "cdi_devices": list(self.cdi_devices),
            "reason": self.reason,
            "message": self.message,
            "generation": self.generation,
        }


@dataclass
class Follower:
    """What one generation has come to, from the verified events fed to it in log order."""

    node_id: str
    generation: int
    #: allocation id -> outcome, in spec order.
    holds: dict[str, HoldOutcome]
    per_hold_lines: int = PER_HOLD_LINES
    released: list[dict[str, Any]] = field(default_factory=list)
    conditions: list[dict[str, Any]] = field(default_factory=list)
    section: dict[str, Any] | None = None
    outcome: Outcome | None = None
    #: the newer generation whose section came first (outcome SUPERSEDED).
    superseded_by: int | None = None
    refusal: str = ""
    #: holds the control plane had active on this node that the spec no longer names: released at
    #: this generation, or (a Kubernetes hold) pending until no pod holds its devices
    releasing: dict[str, Reservation] = field(default_factory=dict)
    _failures_shown: int = 0
    _last_progressing: str = ""
    _progress_said: tuple[int, ...] = ()

    @classmethod
    def for_spec(
        cls, spec: NodeSpec, generation: int, reservations: Mapping[str, Reservation] | None = None, *, per_hold_lines: int = PER_HOLD_LINES
    ) -> "Follower":
        """`reservations`: the control plane's record right after the put. It decides no hold's result
        (only the node's events at the generation do); it names the holds the spec dropped, which
        the outcome lists as still releasing when the node reported no Released for them."""
        holds = {
            a.allocation_id: HoldOutcome(allocation_id=a.allocation_id, reservation_id=a.reservation_id, devices=list(a.devices))
            for a in spec.devices
        }
        releasing = {
            r.allocation_id: r
            for r in (reservations or {}).values()
            if r.state in ("active", "releasing") and r.node_id == spec.node_id and r.allocation_id not in holds
        }
        return cls(node_id=spec.node_id, generation=generation, holds=holds, per_hold_lines=per_hold_lines, releasing=releasing)

    # ------------------------------------------------------------------ state

    @property
    def quiet(self) -> bool:
        """Too many holds for a line each: progress lines instead."""
        return len(self.holds) > self.per_hold_lines

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def counts(self) -> dict[str, int]:
        out = {"bound": 0, "kept": 0, "failed": 0, "pending": 0}
        for h in self.holds.values():
            out[h.result] += 1
        out["released"] = len(self.released)
        return out

    def exit_code(self) -> int:
        if self.outcome == "CONVERGED":
            return EXIT_CONVERGED
        if self.outcome is None or self.outcome == "TIMEOUT":
            return EXIT_TIMEOUT
        return EXIT_FAILED

    # ------------------------------------------------------------------ feeding

    def feed(self, rec: EventRecord) -> list[str]:
        """One verified (or plain, accepted) event; returns the lines to print."""
        if self.done or rec.node_id != self.node_id or rec.outcome != "applied":
            return []
        ev = rec.event if isinstance(rec.event, dict) else {}
        handler = {
            "bound": self._bound,
            "failed": self._failed,
            "released": self._released,
            "section": self._section,
            "condition": self._condition,
        }.get(rec.type)
        return handler(rec, ev) if handler is not None else []

    def _hold(self, rec: EventRecord) -> HoldOutcome | None:
        h = self.holds.get(rec.allocation_id)
        return h if h is not None and h.reservation_id == rec.reservation_id else None

    def _bound(self, rec: EventRecord, ev: dict[str, Any]) -> list[str]:
        h = self._hold(rec)
        # another generation's bind is not this generation's outcome: a later one's never, an
        # earlier one's (drained from the outbox after the put) says only where the hold was
        # bound, kept for the line the section may bring
        if h is None or rec.generation is None or rec.generation > self.generation:
            return []
        if h.result == "failed" or (rec.generation < self.generation and h.result == "bound"):
            return []
        h.devices = [str(d) for d in ev.get("devices") or h.devices]
        h.cgroup_parent = str(ev.get("cgroup_parent") or "")
        h.cdi_devices = [str(d) for d in ev.get("cdi_devices") or []]
        if rec.generation < self.generation:
            return []
        h.result = "bound"
        h.generation = rec.generation
        h.reason = h.message = ""
        return [] if self.quiet else [h.line()]

    def _failed(self, rec: EventRecord, ev: dict[str, Any]) -> list[str]:
        h = self._hold(rec)
        if h is None or rec.generation != self.generation:
            return []
        h.result = "failed"
        h.generation = rec.generation
        h.reason = str(ev.get("reason") or "")
        h.message = str(ev.get("message") or "")
        if self.quiet:
            self._failures_shown += 1
            if self._failures_shown > self.per_hold_lines:
                return []
        return [h.line()]

    def _released(self, rec: EventRecord, ev: dict[str, Any]) -> list[str]:
        if rec.generation != self.generation:
            return []
        entry = {
            "allocation_id": rec.allocation_id,
            "reservation_id": rec.reservation_id,
            "devices": [str(d) for d in ev.get("devices") or []],
            "generation": rec.generation,
        }
        self.released.append(entry)
        h = self.holds.get(rec.allocation_id)
        # the spec still names it: its assignment changed, the Bound that binds it again follows
        again = "  (its assignment changed: bound again)" if h is not None else ""
        if self.quiet:
            return []
        return [f"released {rec.allocation_id} ({rec.reservation_id})  {_devices(entry['devices']) or '(no devices)'}{again}"]

    def _section(self, rec: EventRecord, ev: dict[str, Any]) -> list[str]:
        observed = ev.get("observed_generation", rec.generation)
        state = str(ev.get("state") or "")
        message = str(ev.get("message") or "")
        if not isinstance(observed, int) or observed < self.generation:
            return []
        if observed > self.generation:
            self.section = dict(ev)
            self.superseded_by = observed
            self.outcome = "SUPERSEDED"
            return [f"generation {self.generation} was superseded by generation {observed} before the node reported it ({state})"]
        if state == "PROGRESSING":
            last = message.splitlines()[-1] if message else ""
            if last == self._last_progressing:
                return []
            self._last_progressing = last
            return [f"progressing: {last}" if last else "progressing"]
        if state not in ("CONVERGED", "FAILED"):
            return []
        self.section = dict(ev)
        self.outcome = state  # type: ignore[assignment]
        kept: list[str] = []
        for h in self.holds.values():
            # the section comes after every event of its generation (DESIGN 5): what is still
            # pending is held without a new report (bound before, or re-created unreported),
            # which the node says by reporting the generation, and only then is it said here
            if h.result == "pending":
                h.result = "kept"
                kept.append(h.line())
        if self.quiet:
            kept = [f"{len(kept)} held from earlier generations"] if kept else []
        # a hold the spec dropped with no Released by now is a Kubernetes release still pending:
        # said, not left out (its devices stay claimed until it is reported)
        done = {r["allocation_id"] for r in self.released}
        return kept + [
            f"releasing {alloc} ({r.reservation_id})  {_devices(r.devices) or '(no devices)'}  "
            "(a Kubernetes hold: released once no pod holds its devices; `bcd status` shows it, `bcd releases` lists it)"
            for alloc, r in sorted(self.releasing.items())
            if alloc not in done
        ]

    def _condition(self, rec: EventRecord, ev: dict[str, Any]) -> list[str]:
        c = ev.get("condition") if isinstance(ev.get("condition"), dict) else {}
        ctype, status = str(c.get("type") or ""), str(c.get("status") or "")
        reason, message = str(c.get("reason") or ""), str(c.get("message") or "")
        self.conditions.append(dict(c))
        if ctype == "NodeSpecRejected" and status == "True":
            self.outcome = "REFUSED"
            self.refusal = message
            return [f"the node refused the spec: {message}"]
        if ctype == UNKNOWN_FIELDS_CONDITION and status == "True":
            return [f"warning: {message}"]
        if status != "True":
            return []  # a condition cleared (NodeSpecRejected after an accepted spec): in --json only
        return [f"condition {ctype}" + (f" {reason}" if reason else "") + (f": {message}" if message else "")]

    # ------------------------------------------------------------------ reporting

    def progress(self) -> str | None:
        """A progress line for a large spec, when the counts moved since the last one."""
        c = self.counts()
        key = (c["bound"], c["kept"], c["failed"], c["released"])
        if not self.quiet or key == self._progress_said:
            return None
        self._progress_said = key
        total = len(self.holds)
        return f"bound {c['bound'] + c['kept']}/{total}, failed {c['failed']}, released {c['released']} (generation {self.generation})"

    def summary(self, timeout_s: float | None = None) -> list[str]:
        c = self.counts()
        lines: list[str] = []
        if self.quiet and self._failures_shown > self.per_hold_lines:
            lines.append(f"... and {self._failures_shown - self.per_hold_lines} more failed (`bcd events` lists them)")
        tally = f"{c['bound']} bound, {c['kept']} kept, {c['failed']} failed, {c['released']} released"
        if self.outcome in ("CONVERGED", "FAILED"):
            lines.append(f"generation {self.generation}: {self.outcome} ({tally})")
        elif self.outcome == "REFUSED":
            lines.append(f"generation {self.generation}: REFUSED by the node; the last good spec stays applied")
        elif self.outcome == "SUPERSEDED":
            lines.append(f"generation {self.generation}: SUPERSEDED by generation {self.superseded_by} ({tally})")
        else:
            waited = f" within {timeout_s:g} s" if timeout_s is not None else ""
            lines.append(
                f"generation {self.generation}: no outcome{waited}, TIMEOUT ({tally}, {c['pending']} pending: the node "
                "reported nothing for them at this generation); the node may be down or its converger stopped "
                "(`bcd status`), the spec stays put"
            )
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "generation": self.generation,
            "outcome": self.outcome or "TIMEOUT",
            "exit_code": self.exit_code(),
            "section": self.section,
            "superseded_by": self.superseded_by,
            "counts": self.counts(),
            "allocations": [h.to_json() for h in self.holds.values()],
            "released": list(self.released),
            "conditions": list(self.conditions),
        }


def events_offset(path: Path) -> int:
    """Where the log ends now: events after the put are appended past it."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def follow(
    path: Path,
    offset: int,
    follower: Follower,
    *,
    timeout: float,
    emit: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Follower:
    """Tail `path` from `offset`, feeding each record, until the outcome or `timeout` seconds.

    A torn or foreign line is skipped. Returns the follower (its outcome None on timeout).
    """
    deadline = clock() + timeout
    next_progress = clock() + PROGRESS_EVERY_S
    pending = b""
    while True:
        chunk = b""
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read(4 * 1024 * 1024)
        except FileNotFoundError:
            pass
        offset += len(chunk)
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            if not raw.strip():
                continue
            try:
                rec = _RECORD.decode(raw)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            for text in follower.feed(rec):
                emit(text)
            if follower.done:
                return follower
        now = clock()
        if now >= next_progress:
            next_progress = now + PROGRESS_EVERY_S
            line = follower.progress()
            if line:
                emit(line)
        if now >= deadline:
            return follower
        if not chunk:
            sleep(min(POLL_S, max(0.0, deadline - now)))


__all__ = [
    "PER_HOLD_LINES",
    "PROGRESS_EVERY_S",
    "EXIT_CONVERGED",
    "EXIT_FAILED",
    "EXIT_TIMEOUT",
    "HoldOutcome",
    "Follower",
    "events_offset",
    "follow",
]
