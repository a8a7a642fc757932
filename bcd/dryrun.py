"""`bcd apply --dry-run`: the converger's plan for a spec against the node's holds now, nothing put.

The planner is pure (`services/converger/plan.py`); this reads what a pass
observes, read-only, from where the node keeps it (`<state>/node.json`
names the directories): the holds (`<cdi_dir>/bcd-*.json`), env files and
fake slice records (`<run_dir>`), the converger's journal and the pending
Kubernetes releases (`<data_dir>`), and over the node bus the inventory and
the converger's status (privilege, bindings, system reserve). The plan is
made at the generation the control plane would give the spec. Nothing is
written, nothing is asked to change: a pass may still differ (a card that
changes meanwhile, a Kubernetes pod that lets go of a released hold).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from controlplane.ledger import short_atom
from controlplane.specs import CheckedSpec, check_fits
from services.converger.domains import NoDomains
from services.converger.model import (
    BindHold,
    ConvergerState,
    DropPendingRelease,
    Plan,
    PlanConfig,
    ReleaseHold,
    SwitchGpu,
    WithdrawKubeHold,
)
from services.converger.observe import ReleaseFacts, observe
from services.converger.plan import plan
from services.converger.releases import ReleasesStore
from shared.fsutil import read_regular
from shared.runtime import call
from shared.schemas import CONVERGER_STATUS_CODEC, INVENTORY_CODEC, ConvergerStatus, Empty, Inventory, NodeSpec
from shared.schemas.codec import BoundedDecoder
from shared.slices import FakeSlices
from shared.subjects import NodeSubjects

from .client import NodeInfo, connect

_STATE = BoundedDecoder(ConvergerState, max_bytes=64 * 1024 * 1024, what="converger state")


class _NoSlices:
    """No slice backend to read (a real host's systemd is not asked): no slice is listed."""

    def list(self) -> list[str]:
        return []

    def is_empty(self, allocation_id: str) -> bool:  # noqa: ARG002
        return True


@dataclass
class PlannedHold:
    allocation_id: str
    reservation_id: str
    action: str  # bind | rebind | restore | keep | wait | release | refuse
    devices: list[str] = field(default_factory=list)
    cgroup_parent: str = ""
    reason: str = ""
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "allocation_id": self.allocation_id,
            "reservation_id": self.reservation_id,
            "action": self.action,
            "devices": list(self.devices),
            "cgroup_parent": self.cgroup_parent,
            "reason": self.reason,
            "message": self.message,
        }


@dataclass
class DryRun:
    node_id: str
    generation: int
    holds: list[PlannedHold]
    #: what the section would read ("CONVERGED" / "FAILED") and its message.
    state: str
    message: str = ""
    switches: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def would_fail(self) -> bool:
        return self.state == "FAILED"

    def by_action(self, action: str) -> list[PlannedHold]:
        return [h for h in self.holds if h.action == action]


def _devices(devices: list[str], limit: int = 3) -> str:
    shown = ", ".join(short_atom(d) for d in devices[:limit])
    return shown + (f" +{len(devices) - limit} more" if len(devices) > limit else "")


def summarize_plan(spec: NodeSpec, p: Plan, observed_holds: dict[str, Any], notes: list[str]) -> DryRun:
    """The plan as an operator reads it: each allocation bound, bound again (its assignment changed),
    kept, waiting or refused, each hold released."""
    binds = {s.allocation_id: s for s in p.steps if isinstance(s, BindHold)}
    refusals = {f.allocation_id: f for f in p.failures}
    released: dict[str, PlannedHold] = {}
    for s in p.steps:
        if isinstance(s, ReleaseHold) and s.report:
            released[s.allocation_id] = PlannedHold(s.allocation_id, s.event.reservation_id, "release", list(s.event.devices))
        elif isinstance(s, WithdrawKubeHold):
            rel = s.release
            released[s.allocation_id] = PlannedHold(
                s.allocation_id, rel.reservation_id, "release", list(rel.devices), message="Kubernetes hold: reported once no pod holds its devices"
            )
    dropped = {s.allocation_id for s in p.steps if isinstance(s, DropPendingRelease)}
    changed = dict(p.changed)
    waiting = {a: "its old hold is a pending Kubernetes release; bound once that is reported" for a in p.waiting}
    holds: list[PlannedHold] = []
    for a in spec.devices:
        alloc = a.allocation_id
        if alloc in refusals:
            f = refusals[alloc]
            holds.append(PlannedHold(alloc, a.reservation_id, "refuse", list(a.devices), reason=f.reason, message=f.message))
        elif alloc in binds and alloc in released:
            # a held allocation whose assignment changed: released, then bound again
            b = binds[alloc]
            old = released.pop(alloc)
            holds.append(PlannedHold(alloc, a.reservation_id, "rebind", list(b.event.devices), cgroup_parent=b.event.cgroup_parent,
                                     message=f"its assignment changed ({'; '.join(changed.get(alloc, ()))}); released from {_devices(old.devices)} first"))
        elif alloc in binds and not binds[alloc].report:
            # reported bound before, its files went from outside: put back as bound, not reported again
            b = binds[alloc]
            holds.append(PlannedHold(alloc, a.reservation_id, "restore", list(b.event.devices), cgroup_parent=b.event.cgroup_parent,
                                     message=f"its files went from outside: put back as bound at generation {b.event.generation}, not reported again"))
        elif alloc in binds:
            b = binds[alloc]
            holds.append(PlannedHold(alloc, a.reservation_id, "bind", list(b.event.devices), cgroup_parent=b.event.cgroup_parent))
        elif alloc in waiting:
            # its old hold (a Kubernetes one) is withdrawn in this pass, or was earlier: one line, not two
            old = released.pop(alloc, None)
            why = f"its assignment changed ({'; '.join(changed[alloc])}); " if alloc in changed else ""
            withdrawn = f"its old hold on {_devices(old.devices)} is withdrawn now; " if old is not None else ""
            holds.append(PlannedHold(alloc, a.reservation_id, "wait", list(a.devices), message=why + withdrawn + waiting[alloc]))
        elif alloc in observed_holds:
            h = observed_holds[alloc]
            holds.append(PlannedHold(alloc, a.reservation_id, "keep", list(h.devices), cgroup_parent=h.cgroup_parent))
        elif alloc in dropped:
            holds.append(PlannedHold(alloc, a.reservation_id, "keep", list(a.devices), message="its pending Kubernetes release is dropped"))
        else:
            # not a hold (an instance binding refused above), or nothing to do
            holds.append(PlannedHold(alloc, a.reservation_id, "keep", list(a.devices)))
    holds.extend(released.values())
    switches = [f"{s.pci} -> {s.target} ({s.why})" for s in p.steps if isinstance(s, SwitchGpu)]
    section = p.section
    return DryRun(
        node_id=spec.node_id,
        generation=spec.generation,
        holds=holds,
        state=section.state if section is not None else "CONVERGED",
        message=section.message if section is not None else "",
        switches=switches,
        notes=[*notes, *p.notes, *p.vfio_notes],
    )


def read_state(info: NodeInfo) -> tuple[ConvergerState, list[str]]:
    """The converger's journal, read-only; a fresh one (and a note) when it cannot be read."""
    path = Path(info.data_dir) / "converger" / "state.json"
    try:
        return _STATE.decode(read_regular(path, max_bytes=64 * 1024 * 1024)), []
    except FileNotFoundError:
        return ConvergerState(), []
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        return ConvergerState(), [f"converger state {path} not read ({exc}): planned as if it were empty"]


def observe_node(info: NodeInfo, spec: NodeSpec, inventory: Inventory) -> tuple[Any, list[str]]:
    """What a pass would observe on this node now (read-only): Observed, and notes on what was not read."""
    state, notes = read_state(info)
    pending, unreadable = ReleasesStore(Path(info.data_dir)).peek() if info.data_dir else ({}, False)
    run_dir = Path(info.run_dir)
    slices: Any = FakeSlices(run_dir) if (run_dir / "slices").is_dir() else _NoSlices()
    observed = observe(
        spec=spec,
        cdi_dir=Path(info.cdi_dir),
        run_dir=run_dir,
        slices=slices,
        inventory=inventory,
        domains=NoDomains(),  # the domains of the last pass are in the journal
        state=state,
        warned=set(),
        # a pending release counts as held: only the reaper can say otherwise
        releases=ReleaseFacts(pending=pending, unreadable=unreadable),
    )
    return observed, notes


async def ask_node(info: NodeInfo) -> tuple[Inventory, ConvergerStatus, int]:
    """The node's inventory, its converger's status, and its bus's max_payload (the server's INFO)."""
    nc = await connect(info)
    subjects = NodeSubjects(info.node_id)
    try:
        inventory = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=5)
        status = await call(nc, subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=5)
        max_payload = nc.max_payload
    finally:
        await nc.close()
    return inventory, status, max_payload


def dry_run(info: NodeInfo, spec: NodeSpec, checked: CheckedSpec | None = None) -> DryRun:
    """Plan `spec` (its generation already the one a put would give it) against the node now.

    With `checked` (the spec as the put would take it), first the put's own size check
    against the node bus's max_payload (controlplane.specs.check_fits: SpecTooLarge, exit 2):
    what the dry run accepts, the apply can carry.
    """
    inventory, status, max_payload = asyncio.run(ask_node(info))
    if checked is not None:
        check_fits(checked, max_payload)
    observed, notes = observe_node(info, spec, inventory)
    config = PlanConfig(
        node_id=info.node_id,
        privileged=status.privileged,
        supported_bindings=frozenset(status.bindings) or PlanConfig(node_id=info.node_id).supported_bindings,
        system_reserve_bytes=status.system_reserve_bytes,
    )
    return summarize_plan(spec, plan(spec, observed, config), dict(observed.holds), notes)


#: what the dry run's last line advises on a node where `bcd apply` puts the spec itself
APPLY_ADVICE = "`bcd apply` without --dry-run puts it"


def render_dry_run(d: DryRun, source: str = "", advice: str = APPLY_ADVICE) -> str:
    """The plan as lines; `advice` ends the last one: how a spec is put on this node (bcd.applycmd.put_advice)."""
    what = f"{source} " if source else ""
    lines = [f"DRY RUN: nothing was put. The plan for {what}on node {d.node_id} as generation {d.generation}, against its holds now:"]
    for h in d.holds:
        who = f"{h.allocation_id} ({h.reservation_id})"
        if h.action == "refuse":
            lines.append(f"  refuse   {who}  {h.reason}: {h.message}")
            continue
        text = f"  {h.action:<8} {who}  {_devices(h.devices) or '(no devices)'}"
        if h.cgroup_parent:
            text += f"  cgroup parent {h.cgroup_parent}"
        if h.message:
            text += f"  ({h.message})"
        lines.append(text)
    lines.extend(f"  switch   {s}" for s in d.switches)
    lines.extend(f"  note: {n}" for n in d.notes)
    counts = {a: len(d.by_action(a)) for a in ("bind", "rebind", "restore", "keep", "wait", "release", "refuse")}
    # rebind, restore and wait only when there are any (the four others always)
    tally = ", ".join(f"{n} {a}" for a, n in counts.items() if n or a not in ("rebind", "restore", "wait"))
    lines.append(f"would be: {d.state} ({tally}); {advice}")
    return "\n".join(lines)


def dry_run_json(d: DryRun) -> dict[str, Any]:
    return {
        "dry_run": True,
        "node_id": d.node_id,
        "generation": d.generation,
        "state": d.state,
        "message": d.message,
        "holds": [h.to_json() for h in d.holds],
        "switches": list(d.switches),
        "notes": list(d.notes),
    }


__all__ = ["APPLY_ADVICE", "PlannedHold", "DryRun", "summarize_plan", "read_state", "observe_node", "ask_node", "dry_run", "render_dry_run", "dry_run_json"]
