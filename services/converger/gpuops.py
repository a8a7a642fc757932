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

maintenance.py runs the operations by these rules.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from datetime import datetime

import msgspec

from shared.schemas import Gpu, GpuClaim, GpuOp, GpuOpRequest
from shared.schemas.bus import DIAG_LEVEL_MAX, DIAG_RUN_S, MIG_ALL_DISABLED
from shared.schemas.common import PCI_RE

from .model import MigLayoutRecord

OPS = ("reset", "diag", "mig-layout")
#: the lowest diagnostic level that is disruptive (DCGM: from level 2 the tests load the card).
DISRUPTIVE_DIAG_LEVEL = 2
#: how long the converger waits for the switcher's reset.
RESET_TIMEOUT_S = 60.0
#: how long it waits for the inventory's diagnostic, by level: the inventory's bound plus a minute.
DIAG_TIMEOUT_S = {level: run + 60.0 for level, run in DIAG_RUN_S.items()}
#: how long the converger waits for a MIG layout change (NVML's are seconds; a GPU reset is not part of it).
MIG_TIMEOUT_S = 600.0
#: one NVML step on a MIG instance (inventory.mig_instance: the step, then a rescan) for a DRA claim
MIG_STEP_TIMEOUT_S = 60.0
#: how often a running diagnostic is asked about, and how long one answer may take.
POLL_INTERVAL_S = 1.0
POLL_TIMEOUT_S = 10.0
#: outcomes that are a success (`bcd gpu` exits 0).
OK_OUTCOMES = frozenset({"Succeeded", "Passed"})


# ---------------------------------------------------------------------------- MIG layouts
#
# A card's desired layout (`bcd gpu mig-layout`, or the node's --mig-layouts) is a
# record in the journal; each pass's `plan_mig_layouts` says where each stands:
# Applied (the inventory shows it), Applying (its operation runs), Pending (something
# holds the card, named; or a mode change waits for a GPU reset in this boot),
# Failed (the last attempt failed; tried again only when the layout is set again),
# or "start" (the card is free: the converger journals a mig-layout operation, which
# claims the card, and asks the inventory's adapter to make it).



def parse_layout(text: str) -> tuple[tuple[str, ...], bool]:
    """("all-disabled" -> ((), True)), ("1g.18gb,3g.71gb" -> (("1g.18gb", "3g.71gb"), False)); ValueError says why not."""
    text = text.strip()
    if text == MIG_ALL_DISABLED:
        return (), True
    profiles = tuple(p.strip() for p in text.split(","))
    if not text or any(not p for p in profiles):
        raise ValueError(f"a MIG layout is {MIG_ALL_DISABLED!r} or GPU instance profiles, comma-separated (like 1g.18gb,1g.18gb,3g.71gb); not {text!r}")
    bad = [p for p in profiles if not re.match(r"^[0-9]+g\.[0-9]+gb(\+[a-z0-9]+)?$", p)]
    if bad:
        raise ValueError(f"{', '.join(repr(b) for b in bad)} is not a GPU instance profile (like 1g.18gb or 1g.18gb+me)")
    if len(profiles) > 7:
        raise ValueError(f"a card has at most 7 GPU instances; the layout has {len(profiles)}")
    return profiles, False


def layout_text(profiles: Iterable[str], disable: bool) -> str:
    return MIG_ALL_DISABLED if disable else ",".join(profiles)


def layout_problem(gpu: Gpu, profiles: tuple[str, ...], disable: bool) -> str | None:
    """What the card itself rules out (a profile it does not have, no MIG at all); None: nothing."""
    if disable:
        return None
    if not gpu.mig_profiles:
        return f"{gpu.pci_address} supports no MIG profiles"
    known = {p.name for p in gpu.mig_profiles}
    unknown = sorted(set(profiles) - known)
    if unknown:
        return f"{gpu.pci_address} has no MIG profile {', '.join(unknown)} (it has {', '.join(sorted(known))})"
    return None


def layout_applied(gpu: Gpu, profiles: tuple[str, ...], disable: bool) -> bool:
    """The inventory shows the layout: MIG off, or exactly these GPU instances (one full compute instance each)."""
    if disable:
        return not gpu.mig_mode
    return gpu.mig_mode and sorted(m.profile for m in gpu.mig_instances) == sorted(profiles)


def plan_mig_layouts(
    layouts: Mapping[str, MigLayoutRecord],
    gpus: Mapping[str, Gpu],
    claims: Iterable[GpuClaim],
    running: Mapping[str, GpuOp],
    *,
    boot_id: str,
) -> dict[str, tuple[str, str]]:
    """PCI address -> (state, message) for every desired layout; state "start" means: start it now."""
    held: dict[str, list[str]] = {}
    for c in claims:
        held.setdefault(c.pci_address, []).append(holder_text(c))
    out: dict[str, tuple[str, str]] = {}
    for pci, rec in sorted(layouts.items()):
        try:
            profiles, disable = parse_layout(rec.layout)
        except ValueError as exc:
            out[pci] = ("Failed", str(exc))
            continue
        gpu = gpus.get(pci)
        op = running.get(pci)
        if gpu is None:
            out[pci] = ("Pending", f"the inventory does not list {pci} now")
        elif op is not None and op.op == "mig-layout":
            out[pci] = ("Applying", f"{op.id} runs")
        elif layout_applied(gpu, profiles, disable):
            out[pci] = ("Applied", rec.message if rec.state == "Applied" else "")
        elif rec.state == "Failed":
            out[pci] = ("Failed", rec.message)
        elif rec.blocked_boot and rec.blocked_boot == boot_id:
            out[pci] = ("Pending", rec.message)
        elif op is not None:
            out[pci] = ("Pending", f"waits for {op_holder(op)}")
        elif pci in held:
            more = f" (and {len(held[pci]) - 1} more)" if len(held[pci]) > 1 else ""
            out[pci] = ("Pending", f"waits: {pci} is held by {held[pci][0]}{more}")
        else:
            problem = layout_problem(gpu, profiles, disable)
            out[pci] = ("Failed", problem) if problem else ("start", "")
    return out


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
    what = f"diagnostic level {op.level}" if op.op == "diag" else ("MIG layout " + op.layout if op.op == "mig-layout" else op.op)
    return f"maintenance ({what}, {op.id})"


def claims_card(op: str, level: int) -> bool:
    return op in ("reset", "mig-layout") or (op == "diag" and level >= DISRUPTIVE_DIAG_LEVEL)


def check_request(req: GpuOpRequest) -> str | None:
    """What is wrong with the request itself, before any card is looked at (None: nothing)."""
    if req.op not in OPS:
        return f"{req.op!r} is not one of {', '.join(OPS)}"
    if not PCI_RE.match(req.pci):
        return f"{req.pci!r} is not a canonical PCI address (like 0000:3b:00.0)"
    if req.op == "diag" and not 1 <= req.level <= DIAG_LEVEL_MAX:
        return f"a diagnostic level is 1 to {DIAG_LEVEL_MAX}, not {req.level}"
    if req.op != "diag" and req.level:
        return f"a {req.op} has no level"
    if req.op == "mig-layout":
        try:
            parse_layout(req.layout)
        except ValueError as exc:
            return f"{exc}"
    elif req.layout:
        return f"a {req.op} has no layout"
    return None


def refusal(req: GpuOpRequest, listed: Iterable[str], claims: Iterable[GpuClaim], running: Mapping[str, GpuOp]) -> str | None:
    """Why the operation may not start on its card now (None: it may), naming the holder as `overlap` does."""
    problem = check_request(req)
    if problem:
        return problem
    if req.pci not in set(listed):
        return f"the inventory lists no GPU at that address"
    other = running.get(req.pci)
    if other is not None:
        return f"it is held by {op_holder(other)}"
    if not claims_card(req.op, req.level):
        return None
    holders = [holder_text(c) for c in claims if c.pci_address == req.pci]
    if holders:
        return f"it is held by {holders[0]}" + (f" (and {len(holders) - 1} more)" if len(holders) > 1 else "")
    return None


def new_op(req: GpuOpRequest, *, now: datetime, boot_id: str) -> GpuOp:
    return GpuOp(
        id=f"{req.op}-{now.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}",
        op=req.op,
        pci=req.pci,
        level=req.level,
        layout=req.layout,
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
    elif op.op == "mig-layout":
        why = "the converger stopped while the MIG layout was made: the inventory reads the card again, and the layout is tried again"
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
    "parse_layout",
    "layout_text",
    "layout_problem",
    "layout_applied",
    "plan_mig_layouts",
    "result_key",
]
