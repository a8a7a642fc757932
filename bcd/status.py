"""`bcd status` and `bcd doctor`: gather what the node says about itself, then judge it.

`gather` asks the node bus (as the `cli` user) for every service's PING, the
inventory, the converger's status and the outbox depth; `render_status`,
`problems` and `doctor_checks` are pure functions of that report, so their
verdicts are unit-tested as tables.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import nats.errors

from shared.jsutil import StreamDepth, StreamMissing, stream_depth
from shared.runtime import ServiceCallError, call
from shared.schemas import CLAIMS_CODEC, CONVERGER_STATUS_CODEC, INVENTORY_CODEC, BadMessage, Claims, ConvergerStatus, Empty, Inventory
from shared.schemas.inventory import REBOOT_WAIT_REASONS
from shared.subjects import NodeSubjects

from .client import NodeInfo, NodeUnreachable, connect, ping_all

#: an outbox whose oldest event is older than this is not draining.
OUTBOX_STALE_S = 120.0


@dataclass
class NodeReport:
    node_id: str
    reachable: bool = False
    error: str = ""
    expected: list[str] = field(default_factory=list)
    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    inventory: Inventory | None = None
    converger: ConvergerStatus | None = None
    outbox: StreamDepth | None = None
    claims: Claims | None = None
    now: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


async def gather(info: NodeInfo) -> NodeReport:
    report = NodeReport(node_id=info.node_id, expected=list(info.services))
    try:
        nc = await connect(info)
    except NodeUnreachable as exc:
        report.error = str(exc)
        return report
    report.reachable = True
    subjects = NodeSubjects(info.node_id)
    try:
        report.services = {r["name"]: r for r in await ping_all(nc, 0.5)}
        with contextlib.suppress(ServiceCallError, nats.errors.Error, asyncio.TimeoutError, BadMessage):
            report.inventory = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=3)
        with contextlib.suppress(ServiceCallError, nats.errors.Error, asyncio.TimeoutError, BadMessage):
            report.converger = await call(nc, subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=3)
        with contextlib.suppress(ServiceCallError, nats.errors.Error, asyncio.TimeoutError, BadMessage):
            report.claims = await call(nc, subjects.converger_claims, Empty(), CLAIMS_CODEC, timeout=3)
        with contextlib.suppress(StreamMissing, nats.errors.Error, asyncio.TimeoutError):
            report.outbox = await stream_depth(nc, subjects.outbox_stream)
    finally:
        await nc.close()
    return report


def _age(report: NodeReport) -> float | None:
    if report.outbox is None or report.outbox.oldest is None:
        return None
    return max(0.0, (report.now - report.outbox.oldest).total_seconds())


def problems(report: NodeReport) -> list[str]:
    """Why the node is unhealthy (empty: healthy). A FAILED section is a refusal, not ill health."""
    if not report.reachable:
        return [report.error or "node bus unreachable"]
    out = [f"service {name} does not answer $SRV.PING" for name in report.expected if name not in report.services]
    conv = report.converger
    if conv is not None and conv.section is not None and conv.section.state == "PROGRESSING" and conv.next_retry_in_s is not None:
        out.append(f"devices section PROGRESSING (retrying): {conv.section.message.splitlines()[-1] if conv.section.message else ''}")
    if conv is not None:
        if conv.vendor_cdi_error:
            out.append(f"vendor CDI spec unreadable, no new hold is bound: {conv.vendor_cdi_error}")
        if conv.outbox_error:
            out.append(conv.outbox_error)
    out.extend(gpu_problems(report.inventory))
    age = _age(report)
    if age is not None and age > OUTBOX_STALE_S:
        out.append(f"outbox not draining: {report.outbox.messages if report.outbox else 0} events, oldest {age:.0f} s")
    return out


def _holders(conv: ConvergerStatus | None) -> dict[str, str]:
    """atom id -> allocation id."""
    out: dict[str, str] = {}
    for h in conv.holds if conv else []:
        for d in h.devices:
            out[d] = h.allocation_id
    return out


def render_status(report: NodeReport) -> str:
    if not report.reachable:
        return f"node {report.node_id}: {report.error}"
    lines: list[str] = []
    conv, inv = report.converger, report.inventory
    held = _holders(conv)
    vm_claims: dict[str, str] = {}
    for c in report.claims.claims if report.claims else []:
        if c.kind in ("instance", "domain"):
            vm_claims.setdefault(c.pci_address, f"{c.kind} {c.holder}")
    gen = conv.generation if conv and conv.generation is not None else "-"
    age = _age(report)
    depth = report.outbox.messages if report.outbox else "?"
    lines.append(
        f"node {report.node_id}  spec generation {gen}  outbox {depth} event(s)"
        + (f", oldest {age:.0f} s" if age is not None else "")
    )
    lines.append(f"{'GPU':<4} {'PCI':<13} {'PHASE':<12} {'MANAGEMENT':<11} HELD BY")
    for g in inv.gpus if inv else []:
        if g.mig_mode:
            parts = [f"{m.atom_id.split('/', 1)[1]}:{held.get(m.atom_id, '-')}" for m in g.mig_instances]
            what = "MIG " + (" ".join(parts) if parts else "(no instances)")
        elif g.slots:
            what = "slots " + " ".join(f"{s.atom_id.split('/', 1)[1]}:{held.get(s.atom_id, '-')}" for s in g.slots)
        else:
            what = held.get(g.atom_id, "-")
        if g.atom_id in held and (g.mig_mode or g.slots):
            what = held[g.atom_id] + " (whole)"
        vm = vm_claims.get(g.pci_address)
        if vm:
            what = vm if what == "-" else f"{what}; {vm}"
        lines.append(f"{g.index:<4} {g.pci_address:<13} {g.status.phase:<12} {g.status.driver_binding.management_state:<11} {what}")
    if inv is None:
        lines.append("(inventory unavailable)")
    if conv is not None:
        sec = conv.section
        if sec is None:
            lines.append("section devices: no pass reported yet")
        else:
            lines.append(f"section {sec.section}: {sec.state}  observed_generation {sec.observed_generation}")
            lines.extend(f"  {m}" for m in sec.message.splitlines())
        for h in conv.holds:
            extra = f"  slice {h.cgroup_parent}" if h.cgroup_parent else ""
            flag = "" if h.reported else "  (Bound not yet reported)"
            lines.append(f"  hold {h.allocation_id} ({h.reservation_id}) gen {h.generation}: {', '.join(h.devices)}{extra}{flag}")
        # what the converger skipped or got less of (files that are not regular files, a reduced outbox)
        lines.extend(f"  problem: {p}" for p in conv.problems)
    else:
        lines.append("section devices: converger unavailable")
    svc = ", ".join(f"{n}{'' if n in report.services else ' (DOWN)'}" for n in (report.expected or sorted(report.services)))
    lines.append(f"services: {svc}")
    bad = problems(report)
    lines.append("health: " + ("ok" if not bad else "UNHEALTHY: " + "; ".join(bad)))
    return "\n".join(lines)


def render_gpus(inv: Inventory) -> str:
    """`bcd gpu list`: each card's driver binding, phase, management state and the conditions behind them."""
    lines = [f"{'PCI':<13} {'DRIVER':<9} {'MODE':<11} {'PHASE':<13} {'MANAGEMENT':<11} CONDITIONS"]
    for g in inv.gpus:
        st = g.status
        conds = ", ".join(f"{c.type}={c.status}/{c.reason}" for c in st.conditions)
        lines.append(
            f"{g.pci_address:<13} {st.driver_binding.driver or '-':<9} {st.driver_binding.mode:<11} "
            f"{st.phase:<13} {st.driver_binding.management_state:<11} {conds}"
        )
        for c in st.conditions:
            if c.type in ("Reclaim", "Reconfiguring") or (c.type == "AdapterReady" and c.status == "False"):
                lines.append(f"{'':<13} {c.type}: {c.message}")
    return "\n".join(lines)


def gpu_problems(inv: Inventory | None) -> list[str]:
    """Cards that need an operator: a disruption waiting for a reboot, a failed reclaim, a Failed phase."""
    out: list[str] = []
    for g in inv.gpus if inv else []:
        for c in g.status.conditions:
            if c.type == "Reconfiguring" and c.status == "True" and c.reason in REBOOT_WAIT_REASONS:
                out.append(f"GPU {g.pci_address} {c.reason}: {c.message}")
            if c.type == "Reclaim" and c.status == "False" and c.reason == "Failed":
                out.append(f"GPU {g.pci_address} reclaim failed: {c.message}")
        if g.status.phase == "Failed":
            ready = next((c for c in g.status.conditions if c.type == "AdapterReady"), None)
            out.append(f"GPU {g.pci_address} phase Failed" + (f" ({ready.reason}: {ready.message})" if ready else ""))
    return out


def doctor_checks(report: NodeReport) -> list[tuple[str, str, str]]:
    """(level ok|warn|fail, check name, message) per check."""
    out: list[tuple[str, str, str]] = []
    if not report.reachable:
        return [("fail", "bus", report.error or "node bus unreachable")]
    out.append(("ok", "bus", "node bus reachable"))
    for name in report.expected or sorted(report.services):
        if name in report.services:
            out.append(("ok", f"service.{name}", "answers $SRV.PING"))
        else:
            out.append(("fail", f"service.{name}", "does not answer $SRV.PING"))
    bridge = report.services.get("gateway_bridge")
    if bridge is not None:
        keys = (bridge.get("metadata") or {}).get("cp_keys", "0")
        if keys == "0":
            out.append(("warn", "unsigned-specs", "no control-plane key configured: the node accepts UNSIGNED specs (--cp-key)"))
        else:
            out.append(("ok", "signed-specs", f"node specs verified against {keys} control-plane key(s)"))
    conv, inv = report.converger, report.inventory
    if conv is not None:
        if not conv.privileged and inv is not None and inv.gpus:
            out.append(
                (
                    "warn",
                    "gpu-binding",
                    "this GPU host runs bcd unprivileged (not root, no helper): it takes no holds; "
                    "run it as root or beside the root helper",
                )
            )
        if not conv.vendor_cdi_spec:
            out.append(("warn", "vendor-cdi-spec", "no vendor CDI spec (nvidia.json) in the CDI dir: holds carry only env"))
        elif conv.vendor_cdi_error:
            why = conv.vendor_cdi_error.removeprefix(f"{conv.vendor_cdi_spec}: ")
            out.append(
                (
                    "fail",
                    "vendor-cdi-spec",
                    f"{conv.vendor_cdi_spec} unreadable: {why}; no new hold is bound until it reads (retried)",
                )
            )
        else:
            out.append(("ok", "vendor-cdi-spec", conv.vendor_cdi_spec))
        if conv.outbox_error:
            out.append(("fail", "outbox-size", conv.outbox_error))
        elif conv.outbox_warning:
            out.append(("warn", "outbox-size", conv.outbox_warning))
        for p in conv.problems:
            if p not in (conv.outbox_error, conv.outbox_warning):
                out.append(("warn", "hold-dirs", p))
        if conv.section is not None and conv.section.state == "FAILED":
            out.append(("warn", "section", "devices section FAILED: " + "; ".join(conv.section.message.splitlines())))
    out.extend(("fail", "gpu", p) for p in gpu_problems(inv))
    age = _age(report)
    if age is not None and age > OUTBOX_STALE_S:
        out.append(("fail", "outbox", f"not draining: oldest event {age:.0f} s old"))
    return out


__all__ = ["NodeReport", "gather", "problems", "render_status", "render_gpus", "gpu_problems", "doctor_checks", "OUTBOX_STALE_S"]
