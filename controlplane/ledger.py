"""The events ledger: one EventRecord per processed event, `<state_dir>/events.jsonl`, and its readable line.

This module owns what is remembered of each event the control plane took off
BCD_EVENTS: the record's fields and its outcome (applied, duplicate, rejected);
the file, which is appended a batch at a time and read back at start (a torn
last line after a crash is skipped); and how a record reads as one line on
stdout. That line format lives here rather than in the serve loop because the
node-side commands (`bcd events`, `bcd apply --wait`) print the same lines from
the same file without loading anything of the serve loop. A `gpu` event
(GpuChanged) moves nothing in state.json, so its applied line here is the only
thing that remembers it across a restart.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import msgspec

from shared.schemas import (
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    GpuChanged,
    HoldCondition,
    NodeCondition,
    SectionStatus,
    encode,
)
from shared.schemas.codec import BoundedDecoder

EVENTS_FILE = "events.jsonl"

Outcome = Literal["applied", "duplicate", "rejected"]


class EventRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One processed event: a line on stdout and a JSON line in events.jsonl."""

    received_at: datetime
    #: the event's own time (report body, condition since), when it has one.
    time: datetime | None = None
    node_id: str
    type: str
    event_id: str = ""
    outcome: Outcome
    #: True: signature checked against the node's Hello key; False: a signed event
    #: that did not verify; None: a plain event (the contract does not sign it).
    verified: bool | None = None
    #: why it was rejected ("" otherwise).
    reason: str = ""
    allocation_id: str = ""
    reservation_id: str = ""
    generation: int | None = None
    #: the reservation's state after this event ("" when none moved).
    state: str = ""
    boot_id: str = ""
    key_id: str = ""
    subject: str = ""
    stream_seq: int = 0
    detail: str = ""
    #: the decoded event (for a rejected report: what its body claimed, unverified).
    event: dict[str, Any] | None = None


RECORD_DECODER = BoundedDecoder(EventRecord, max_bytes=4 * 1024 * 1024, what="event record")


class EventLedger:
    """events.jsonl and the records it holds, by outcome (the whole log, oldest first)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.applied: list[EventRecord] = []
        self.duplicates: list[EventRecord] = []
        self.rejected: list[EventRecord] = []
        #: event ids that have an "applied" line in events.jsonl
        self.logged_applied: set[str] = set()

    def _remember(self, rec: EventRecord) -> None:
        {"applied": self.applied, "duplicate": self.duplicates, "rejected": self.rejected}[rec.outcome].append(rec)
        if rec.outcome == "applied" and rec.event_id:
            self.logged_applied.add(rec.event_id)

    def append(self, records: list[EventRecord]) -> None:
        """Append a batch's lines to events.jsonl (one write), then remember them."""
        with open(self.path, "ab") as f:
            f.write(b"".join(encode(rec) + b"\n" for rec in records))
        for rec in records:
            self._remember(rec)

    def load(self) -> None:
        """Remember what events.jsonl holds already (none when it is missing)."""
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return
        for raw in lines:
            if not raw.strip():
                continue
            try:
                rec = RECORD_DECODER.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # a torn last line after a crash
            self._remember(rec)


# ----------------------------------------------------------------------------- the readable line


_GPU_UUID_RE = re.compile(r"GPU-([0-9A-Za-z]{4})[0-9A-Za-z-]{4,}([0-9A-Za-z]{4})")


def short_atom(atom: str) -> str:
    """`GPU-5f1c2a90-...-000000000001/gi1/ci0` -> `GPU-5f1c…0001/gi1/ci0`."""
    return _GPU_UUID_RE.sub(lambda m: f"GPU-{m.group(1)}…{m.group(2)}", atom, count=1)


def _devices_text(devices: list[str], limit: int = 3) -> str:
    shown = ",".join(short_atom(d) for d in devices[:limit])
    return shown + (f" +{len(devices) - limit}" if len(devices) > limit else "")


def describe(event: object) -> tuple[str, str, str, int | None, str]:
    """(allocation_id, reservation_id, what, generation, detail) of an event, for the log."""
    if isinstance(event, (AllocationBound, AllocationReleased)):
        return event.allocation_id, event.reservation_id, "", event.generation, _devices_text(list(event.devices))
    if isinstance(event, AllocationFailed):
        detail = event.reason + (f": {event.message}" if event.message else "")
        return event.allocation_id, event.reservation_id, "", event.generation, detail
    if isinstance(event, SectionStatus):
        detail = event.state + (f": {event.message}" if event.message else "")
        return "", "", event.section, event.observed_generation, detail
    if isinstance(event, NodeCondition):
        c = event.condition
        detail = f"{c.type}={c.status}" + (f" {c.reason}" if c.reason else "") + (f": {c.message}" if c.message else "")
        return "", "", c.type, None, detail
    if isinstance(event, HoldCondition):
        c = event.condition
        detail = f"{c.type}={c.status}" + (f" {c.reason}" if c.reason else "") + (f": {c.message}" if c.message else "")
        return event.allocation_id, event.reservation_id, "", event.generation, detail
    if isinstance(event, GpuChanged):
        detail = f"{event.phase}/{event.management_state}" + (f" {short_atom('GPU-' + event.uuid.removeprefix('GPU-'))}" if event.uuid else "")
        if event.reason:
            detail += f" {event.reason}" + (f": {event.message}" if event.message else "")
        reconf = next((c for c in event.status.conditions if c.type == "Reconfiguring" and c.status == "True"), None)
        if reconf is not None:
            detail += f" Reconfiguring={reconf.reason}"
        return "", "", event.pci_address, None, detail
    return "", "", "", None, ""


def format_line(rec: EventRecord) -> str:
    """One readable line: `08:21:03 node-1  bound     whole (rsv-whole) gen 1  GPU-5f1c…0001  verified`."""
    when = (rec.time or rec.received_at).astimezone().strftime("%H:%M:%S")
    subject_of = ""
    if rec.allocation_id:
        subject_of = f"{rec.allocation_id} ({rec.reservation_id})"
    elif rec.event and isinstance(rec.event, dict):
        subject_of = str(rec.event.get("section") or rec.event.get("pci_address") or "")
    parts = [f"{when} {rec.node_id:<7} {rec.type:<9}"]
    what = subject_of
    if rec.generation is not None:
        what = f"{what} gen {rec.generation}".strip()
    if what:
        parts.append(" " + what)
    if rec.detail:
        # one line per event: a section's message lists one failure a line (issue 28.8)
        parts.append("  " + "; ".join(line for line in rec.detail.splitlines() if line.strip()))
    if rec.outcome == "rejected":
        status = f"REJECTED: {rec.reason}"
    elif rec.outcome == "duplicate":
        status = f"duplicate {rec.event_id} (ignored)"
    else:
        status = "verified" if rec.verified else "plain"
        if rec.state and rec.reservation_id:
            status += f" -> {rec.state}"
    parts.append("  " + status)
    return "".join(parts)


__all__ = [
    "EVENTS_FILE",
    "Outcome",
    "EventRecord",
    "RECORD_DECODER",
    "EventLedger",
    "short_atom",
    "describe",
    "format_line",
]
