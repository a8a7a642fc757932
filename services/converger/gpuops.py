"""Maintenance operations on one card (`bcd gpu reset`, `bcd gpu diag`), as pure rules.

The converger runs them because it is the one that knows every claim on a
card and serialises everything that takes one: the check that nothing holds
the card and the journal record of the operation (`ConvergerState.gpu_ops`,
written before anything is asked of anyone) happen under the pass lock, so
no pass binds a hold on the card in between; while the record says
"running", the card is claimed by it (`maintenance_claims`): a new hold on
it is refused with `overlap` naming the operation, and no driver switch is
planned for it. The work itself is asked of the process that can do it (the
switcher's `reset`, the inventory's `diag`); its answer is the one outcome.
A record still "running" when the converger starts again is finished as
Interrupted: what happened to the card is not known, and the card is free.

Who holds a card against an operation: every claim (a live hold or a bind
intent, a pending Kubernetes release, an instance spec, a running domain)
for a reset and for a diagnostic from level 2; a level-1 diagnostic is
non-disruptive and runs beside them. An operation already running on the
card holds it against any other.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from datetime import datetime

import msgspec

from shared.schemas import GpuClaim, GpuOp, GpuOpRequest
from shared.schemas.bus import DIAG_LEVEL_MAX, DIAG_RUN_S

OPS = ("reset", "diag")
#: the lowest diagnostic level that is disruptive (DCGM: from level 2 the tests load the card).
DISRUPTIVE_DIAG_LEVEL = 2
#: how long the converger waits for the switcher's reset.
RESET_TIMEOUT_S = 60.0
#: how long it waits for the inventory's diagnostic, by level: the inventory's bound plus a minute.
DIAG_TIMEOUT_S = {level: run + 60.0 for level, run in DIAG_RUN_S.items()}
#: how often a running diagnostic is asked about, and how long one answer may take.
POLL_INTERVAL_S = 1.0
POLL_TIMEOUT_S = 10.0
#: outcomes that are a success (`bcd gpu` exits 0).
OK_OUTCOMES = frozenset({"Succeeded", "Passed"})
_PCI = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def holder_text(claim: GpuClaim) -> str:
    """A claim as `overlap` names its holder."""
    if claim.kind == "release":
        return f"{claim.holder} (pending Kubernetes release)" if not claim.holder.startswith("(") else claim.holder
    if claim.kind == "instance":
        return f"instance {claim.holder}"
    if claim.kind == "domain":
        return f"running domain {claim.holder}"
    return claim.holder


def op_holder(op: GpuOp) -> str:
    what = f"diagnostic level {op.level}" if op.op == "diag" else op.op
    return f"maintenance ({what}, {op.id})"


def claims_card(op: str, level: int) -> bool:
    return op == "reset" or (op == "diag" and level >= DISRUPTIVE_DIAG_LEVEL)


def check_request(req: GpuOpRequest) -> str | None:
    """What is wrong with the request itself, before any card is looked at (None: nothing)."""
    if req.op not in OPS:
        return f"refused: {req.op!r} is not one of {', '.join(OPS)}"
    if not _PCI.match(req.pci):
        return f"refused: {req.pci!r} is not a canonical PCI address (like 0000:3b:00.0)"
    if req.op == "diag" and not 1 <= req.level <= DIAG_LEVEL_MAX:
        return f"refused {req.pci}: a diagnostic level is 1 to {DIAG_LEVEL_MAX}, not {req.level}"
    if req.op == "reset" and req.level:
        return f"refused {req.pci}: a reset has no level"
    return None


def refusal(req: GpuOpRequest, listed: Iterable[str], claims: Iterable[GpuClaim], running: Mapping[str, GpuOp]) -> str | None:
    """Why the operation may not start on its card now (None: it may), naming the holder as `overlap` does."""
    problem = check_request(req)
    if problem:
        return problem
    if req.pci not in set(listed):
        return f"refused {req.pci}: the inventory lists no GPU at that address"
    other = running.get(req.pci)
    if other is not None:
        return f"refused {req.pci}: it is held by {op_holder(other)}"
    if not claims_card(req.op, req.level):
        return None
    holders = [holder_text(c) for c in claims if c.pci_address == req.pci]
    if holders:
        return f"refused {req.pci}: it is held by {holders[0]}" + (f" (and {len(holders) - 1} more)" if len(holders) > 1 else "")
    return None


def new_op(req: GpuOpRequest, *, now: datetime, boot_id: str) -> GpuOp:
    return GpuOp(
        id=f"{req.op}-{now.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}",
        op=req.op,
        pci=req.pci,
        level=req.level,
        claims_card=claims_card(req.op, req.level),
        started_at=now,
        boot_id=boot_id,
    )


def finished(op: GpuOp, outcome: str, message: str, *, now: datetime) -> GpuOp:
    return msgspec.structs.replace(op, state="done", outcome=outcome, message=message, finished_at=now)


def interrupted(op: GpuOp, *, now: datetime) -> GpuOp:
    """A record still running when the converger starts: the process that waited for it died."""
    if op.op == "reset":
        why = "the converger stopped while the reset ran: whether the card was reset is not known; the inventory reads it again"
    else:
        why = f"the converger stopped while the level {op.level} diagnostic ran: no result; run it again"
    return finished(op, "Interrupted", why, now=now)


def maintenance_claims(running: Mapping[str, GpuOp]) -> dict[str, str]:
    """PCI address -> holder text of each card a running operation claims."""
    return {pci: op_holder(op) for pci, op in sorted(running.items()) if op.claims_card}


def result_key(op: GpuOp) -> str:
    return f"{op.op} {op.pci}"


__all__ = [
    "OPS",
    "DISRUPTIVE_DIAG_LEVEL",
    "RESET_TIMEOUT_S",
    "DIAG_TIMEOUT_S",
    "OK_OUTCOMES",
    "holder_text",
    "op_holder",
    "claims_card",
    "check_request",
    "refusal",
    "new_op",
    "finished",
    "interrupted",
    "maintenance_claims",
    "result_key",
]
