"""`bcd status` and `bcd doctor`: gather what the node says about itself, then judge it.

`gather` asks the node bus (as the `cli` user) for every service's PING, the
inventory, the converger's status and the outbox depth; `render_status`,
`problems` and `doctor_checks` are pure functions of that report, so their
verdicts are unit-tested as tables.

`bcd doctor` also looks at this host's container runtimes (bcd.runtimes: podman,
docker, containerd, crio on PATH) and the node's hold files: `gather` carries what
it found in the report (`runtimes`, `hold_files`), and `doctor_checks` gives one
`cdi-runtime` row per runtime (ok when it can use every hold, a warning naming the
holds it cannot use and what to do), or one ok row when there is none. Never a
failure: a node is healthy whether or not anything on the host can start containers.

A card that only a person can move on (`ATTENTION_ROWS`: a disruption waiting
for a reboot, an unhealthy card, a failed reclaim, phase Failed, an Orphaned
card nobody is reclaiming) makes the node unhealthy (`bcd status` and `bcd
doctor` exit 1) and is listed with the condition behind it and what to run.

A card's health is its Healthy condition (issue 30, services/inventory/health.py):
False (a fatal XID, an uncorrectable ECC error, the card lost, remapped rows) is
ill health a person has to act on, so it is an ATTENTION_ROWS row and a `gpu-health`
FAIL in `bcd doctor`; Unknown/Unmonitored (health cannot be watched, or
`--health-checks off`) is a `gpu-health` warning only; Unknown/NotChecked (a card
the vendor library has not seen, e.g. on vfio-pci) and True are fine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import nats.errors

from shared.jsutil import StreamDepth, StreamMissing, stream_depth
from shared.runtime import ServiceCallError, call
from shared.schemas import (
    RelayoutStatus,
    CLAIMS_CODEC,
    CONVERGER_STATUS_CODEC,
    DEVICE_PLUGIN_STATUS_CODEC,
    DRA_PLUGIN_STATUS_CODEC,
    INVENTORY_CODEC,
    BadMessage,
    Claims,
    Condition,
    ConvergerStatus,
    DevicePluginStatus,
    DraPluginStatus,
    Empty,
    Gpu,
    GpuOp,
    Inventory,
)
from shared.schemas.nodespec import GENERATION_SAFE_MAX
from shared.schemas.inventory import HEALTHY_CONDITION, REBOOT_WAIT_REASONS
from shared.schemas.strict import UNKNOWN_FIELDS_CONDITION
from shared.subjects import NodeSubjects

from .client import NodeInfo, NodeUnreachable, connect, ping_all
from .runtimes import RUNTIME_NAMES, HoldFiles, HoldUse, RuntimeFacts, RuntimeProbe, hold_use, same_dirs_of

#: how long `bcd status` waits for each service's answer (all asked at once): 3 s was not enough
#: for a converger on a VM just rebooted, and its status then went missing without a word.
ANSWER_WAIT_S = 10.0
#: ... and a service that did not answer its PING (stopped, or gone): its problem is said already
UNPINGED_WAIT_S = 3.0
#: an outbox whose oldest event is older than this is not draining.
OUTBOX_STALE_S = 120.0
#: Healthy=Unknown before the vendor library saw the card (on vfio-pci): nothing to watch, no warning
#: (services/inventory/health.py NOT_CHECKED; the other Unknown reason is Unmonitored).
NOT_CHECKED = "NotChecked"


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
    #: None when no device plugin answered (not running, or not in this node's services).
    device_plugin: DevicePluginStatus | None = None
    #: None when no DRA plugin answered.
    dra_plugin: DraPluginStatus | None = None
    #: what -> why, for each status a service that answers $SRV.PING did not give (a problem:
    #: a report silent on it read as healthy while the converger said nothing).
    unanswered: dict[str, str] = field(default_factory=dict)
    now: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    #: the container runtimes found on this host; None: not looked for (`bcd status`).
    runtimes: list[RuntimeFacts] | None = None
    #: each hold's spec file and consumer copy, as the node's CDI dirs hold them.
    hold_files: list[HoldFiles] = field(default_factory=list)
    #: each dir the runtimes and holds name -> the dir it really is (bcd.runtimes.same_dirs_of).
    same_dirs: dict[str, str] = field(default_factory=dict)


def look_at_runtimes(report: NodeReport, info: NodeInfo, probe: RuntimeProbe) -> None:
    """Fill the report's runtimes, hold files and dir names: the probe's runtimes and the holds on disk."""
    from .cdi import hold_files, read_cdi_dir

    report.runtimes = probe.find()
    report.hold_files = hold_files(read_cdi_dir(info.cdi_dir, info.cdi_consumer_dir)) if info.cdi_dir else []
    report.same_dirs = same_dirs_of(report.runtimes, report.hold_files)


async def gather(info: NodeInfo, runtimes: RuntimeProbe | None = None) -> NodeReport:
    """What the node bus says; with `runtimes`, also this host's container runtimes and the holds on disk."""
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

        async def ask(service: str, what: str, subject: str, codec: Any) -> Any:
            """The answer; None with the reason kept, for a service that answered its PING."""
            # one that missed its PING is asked too (it may answer late), for less long
            wait = ANSWER_WAIT_S if service in report.services else UNPINGED_WAIT_S
            try:
                return await call(nc, subject, Empty(), codec, timeout=wait)
            except asyncio.TimeoutError:
                why = f"no answer within {wait:g} s"
            except (ServiceCallError, nats.errors.Error, BadMessage) as exc:
                why = str(exc) or type(exc).__name__
            if service in report.services:
                report.unanswered[what] = f"service {service} answers $SRV.PING but not its {what} ({why})"
            return None

        asks = {
            "inventory": ask("inventory", "inventory", subjects.inventory_get, INVENTORY_CODEC),
            "converger": ask("converger", "status", subjects.converger_status, CONVERGER_STATUS_CODEC),
            "claims": ask("converger", "claims", subjects.converger_claims, CLAIMS_CODEC),
        }
        # the plugins only where they run (a node without Kubernetes has none)
        if "device_plugin" in report.services:
            asks["device_plugin"] = ask("device_plugin", "device plugin status", subjects.device_plugin_status, DEVICE_PLUGIN_STATUS_CODEC)
        if "dra_plugin" in report.services:
            asks["dra_plugin"] = ask("dra_plugin", "DRA plugin status", subjects.dra_plugin_status, DRA_PLUGIN_STATUS_CODEC)
        # at once: a busy node costs the slowest answer, not their sum
        answers = dict(zip(asks, await asyncio.gather(*asks.values())))
        report.inventory, report.converger, report.claims = answers["inventory"], answers["converger"], answers["claims"]
        report.device_plugin, report.dra_plugin = answers.get("device_plugin"), answers.get("dra_plugin")
        with contextlib.suppress(StreamMissing, nats.errors.Error, asyncio.TimeoutError):
            report.outbox = await stream_depth(nc, subjects.outbox_stream)
    finally:
        await nc.close()
    if runtimes is not None:
        await asyncio.to_thread(look_at_runtimes, report, info, runtimes)
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
    out.extend(report.unanswered.values())
    conv = report.converger
    if conv is not None and conv.section is not None and conv.section.state == "PROGRESSING" and conv.next_retry_in_s is not None:
        out.append(f"devices section PROGRESSING (retrying): {conv.section.message.splitlines()[-1] if conv.section.message else ''}")
    if conv is not None and conv.generation is not None and conv.generation > GENERATION_SAFE_MAX:
        out.append(generation_problem(conv.generation))
    if conv is not None:
        # the journal and the disk disagree: not healthy until the next pass put it right
        out.extend(f"hold files drifted: {line}" for line in conv.drift)
        # files in the hold dirs that are none of bcd's: an operator's to look at (README: odd files)
        out.extend(f"odd file in the hold dirs: {line}" for line in conv.odd_files)
        if conv.vendor_cdi_error:
            out.append(f"vendor CDI spec unreadable, no new hold is bound: {conv.vendor_cdi_error}")
        if conv.outbox_error:
            out.append(conv.outbox_error)
        if conv.relayout is not None:
            out.extend(relayout_problems(conv.relayout, report.now))
    out.extend(gpu_problems(report.inventory))
    age = _age(report)
    if age is not None and age > OUTBOX_STALE_S:
        out.append(f"outbox not draining: {report.outbox.messages if report.outbox else 0} events, oldest {age:.0f} s")
    return out


#: a re-layout step older than this is stuck (the alert BcdMigRelayoutStuck uses the same bound)
RELAYOUT_STUCK_S = 1800


def relayout_lines(r: RelayoutStatus, now: datetime) -> list[str]:
    """The MIG re-layout its Node's label drives: what the label asks, the job's step, each card's."""
    head = f"MIG re-layout: nvidia.com/mig.config={r.desired or '(none)'}" + (f", state {r.state_label}" if r.state_label else "")
    lines = [head]
    if r.read_error:
        lines.append(f"  the Node could not be read: {r.read_error}")
    if r.note:
        lines.append(f"  {r.note}")
    job = r.running or r.last
    if job is not None:
        age = max(0, int((now - job.step_since).total_seconds()))
        what = f"{job.step} for {age} s" if r.running is not None else f"last: {job.outcome or job.step}"
        lines.append(f"  {job.config}: {what}" + (f": {job.message}" if job.message else ""))
        lines.extend(
            f"    {c.pci_address} {c.target}: {c.step}" + (f" ({c.outcome})" if c.outcome else "") + (f": {c.message}" if c.message else "")
            for c in job.cards
        )
    return lines


def relayout_problems(r: RelayoutStatus, now: datetime) -> list[str]:
    """A re-layout that failed (while the label still asks for it) or a step stuck past RELAYOUT_STUCK_S."""
    out = []
    if r.running is not None and (now - r.running.step_since).total_seconds() > RELAYOUT_STUCK_S:
        out.append(f"MIG re-layout to {r.running.config} stuck at {r.running.step} for over {RELAYOUT_STUCK_S} s: {r.running.message}")
    last = r.last
    if r.running is None and last is not None and last.outcome == "failed" and r.desired == last.config and r.state_label == "failed":
        out.append(f"MIG re-layout to {last.config} failed: {last.message}")
    return out


def generation_problem(generation: int) -> str:
    """A node above 2^53 - 1 was put there by an earlier release or another control plane (this
    one's count and requests stay below): no count goes on from there for long, at 2^63 - 1 none
    at all, and every JSON reader does not take it exactly. A person rebases it (issue 41.5: such a
    node said `health: ok`)."""
    top = " and no spec can follow it" if generation >= 2**63 - 1 else ""
    return (
        f"spec generation {generation} is above 2^53 - 1 (put by an earlier release or another control plane){top}: "
        "`bcd rebase` (or `python -m controlplane rebase`) brings the node back to its control plane's count, "
        "its holds kept (docs/upstream.md, Generations)"
    )


def _holders(conv: ConvergerStatus | None) -> dict[str, str]:
    """atom id -> allocation id (a DRA claim's hold: "DRA claim <namespace>/<name>")."""
    out: dict[str, str] = {}
    names = {f"claim-{c.uid}": f"DRA claim {c.namespace}/{c.name}" for c in conv.claims} if conv else {}
    for h in conv.holds if conv else []:
        for d in h.devices:
            out[d] = names.get(h.allocation_id, h.allocation_id)
    for r in conv.pending_releases if conv else []:
        # withdrawn, its devices still claimed until no pod holds them (issue 28.6: it showed "-")
        for d in r.devices:
            out.setdefault(d, f"{r.allocation_id} (pending Kubernetes release)")
    return out


def pending_release_lines(conv: ConvergerStatus, now: datetime) -> list[str]:
    """Each pending Kubernetes release, how long, and the way out on a host with no kubelet."""
    lines = []
    for r in conv.pending_releases:
        age = max(0, int((now - r.since).total_seconds()))
        what = (
            "freed by the operator: reported at the next pass"
            if r.freed
            else "reported once no pod holds its devices (a kubelet that does not answer counts as holding them; "
            f"a host with no kubelet: `bcd releases --free {r.allocation_id}`)"
        )
        lines.append(f"  releasing {r.allocation_id} ({r.reservation_id}) gen {r.generation} for {age} s: {', '.join(r.devices)}: {what}")
    return lines


def upstream_line(report: NodeReport) -> str:
    """One line: where the bridge dials, over what, and how it stands (its PING metadata)."""
    bridge = report.services.get("gateway_bridge")
    if bridge is None:
        return ""
    md = bridge.get("metadata") or {}
    url, state, error, tls = md.get("upstream", "?"), md.get("upstream_state", ""), md.get("upstream_error", ""), md.get("upstream_tls", "")
    if not state:
        return f"upstream {url}"  # a bridge older than these facts
    over = "TLS" if tls.startswith("on") else "plain text"
    line = f"upstream {url} ({over}): {state}"
    return f"{line}: {error}" if error else line


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
    up = upstream_line(report)
    if up:
        lines.append(up)
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
            if h.binding == "BINDING_CLAIM":
                continue  # listed with its claim below
            extra = f"  slice {h.cgroup_parent}" if h.cgroup_parent else ""
            flag = "" if h.reported else "  (Bound not yet reported)"
            lines.append(f"  hold {h.allocation_id} ({h.reservation_id}) gen {h.generation}: {', '.join(h.devices)}{extra}{flag}")
            if h.binding == "BINDING_KUBERNETES":
                lines.append(f"    kubelet: {advertised_text(report, h.allocation_id)}")
            if h.condition is not None and h.condition.status == "False":
                # kept on a sick card, and said upstream (HoldCondition): the work should move
                lines.append(f"    {h.condition.type}=False {h.condition.reason}: {h.condition.message}")
        # why an instance's card was not handed to its VM (unhealthy, excluded, waiting for a holder)
        lines.extend(f"  vfio: {n}" for n in conv.vfio_notes)
        # what the converger skipped or got less of (files that are not regular files, a reduced outbox)
        lines.extend(f"  problem: {p}" for p in conv.problems)
        # the journal against the disk: a hold whose files went from outside, before the pass puts them back
        lines.extend(f"  DRIFT {d}" for d in conv.drift)
        lines.extend(f"  ODD FILE {o}" for o in conv.odd_files)
        lines.extend(pending_release_lines(conv, report.now))
        # node conditions the converger raised and that hold now (NodeSpecUnknownFields, ...)
        lines.extend(f"  condition {c.type}: {c.reason}: {c.message}" for c in conv.conditions if c.status == "True")
    else:
        lines.append("section devices: converger unavailable")
    if conv is not None and conv.gpu_ops:
        lines.append("gpu maintenance:")
        lines.extend(f"  {op_line(op)}" for op in conv.gpu_ops)
    if conv is not None and conv.relayout is not None:
        lines.extend(relayout_lines(conv.relayout, report.now))
    if conv is not None and conv.mig_layouts:
        lines.append("MIG layouts:")
        lines.extend(f"  {m.pci_address} {m.layout}: {m.state}" + (f": {m.message}" if m.message else "") for m in conv.mig_layouts)
    if conv is not None:
        for c in conv.claims:
            devices = ", ".join(f"{d.device} -> {d.atom or '(not made)'}" for d in c.devices)
            lines.append(f"  DRA claim {c.namespace}/{c.name} ({c.uid}): {c.state}: {devices}" + (f": {c.message}" if c.message else ""))
            if c.sharing:
                lines.append(f"    {c.sharing}")
    plugin_line = device_plugin_line(report)
    if plugin_line:
        lines.append(plugin_line)
    dra_line = dra_plugin_line(report)
    if dra_line:
        lines.append(dra_line)
        # unhealthy cards the slices carry with a taint (the API server keeps device taints), and
        # those left out (withdrawn: it drops taints, or the card is not Ready for another reason)
        dra = report.dra_plugin
        if dra is not None:
            lines.extend(f"  tainted: {t}" for t in dra.tainted)
            lines.extend(f"  left out: {t}" for t in dra.left_out if "Healthy=False" in t or "device taints" in t)
    attention = gpu_attention(inv)
    if attention:
        lines.append("needs a person:")
        cards = {g.pci_address: g for g in inv.gpus} if inv else {}
        for a in attention:
            why = f"{a.message} ({a.condition})" if a.condition else a.message
            lines.append(f"  GPU {a.pci} {a.what}: {why}")
            lines.append(f"    {'run: ' if a.command else 'to do: '}{a.action}")
            sick = cards[a.pci].status.unhealthy() if a.pci in cards and a.row != "unhealthy" else None
            if sick is not None:  # another row comes first (a reboot it waits for), but say why it is sick too
                lines.append(f"    also unhealthy: {health_words(sick)}")
    svc = ", ".join(f"{n}{'' if n in report.services else ' (DOWN)'}" for n in (report.expected or sorted(report.services)))
    lines.append(f"services: {svc}")
    bad = problems(report)
    lines.append("health: " + ("ok" if not bad else "UNHEALTHY: " + "; ".join(bad)))
    return "\n".join(lines)


def advertised_text(report: NodeReport, allocation_id: str) -> str:
    """Whether the device plugin advertises a Kubernetes hold to the kubelet, and if not why."""
    dp = report.device_plugin
    if dp is None:
        return "NOT advertised: no device plugin answers"
    h = next((h for h in dp.holds if h.allocation_id == allocation_id), None)
    if h is None:
        return "NOT advertised: the device plugin has not seen this hold yet"
    if h.advertised:
        return f"advertised as {', '.join(h.resources)} ({len(h.devices)} device(s))" + (f"; {h.reason}" if h.reason else "")
    if h.reason:
        return f"NOT advertised: {h.reason}"
    if not dp.kubelet_present:
        return f"NOT advertised: no kubelet socket at {dp.kubelet_socket}"
    return "NOT advertised: not registered with the kubelet (" + "; ".join(r.error for r in dp.resources if r.error) + ")"


def device_plugin_line(report: NodeReport) -> str:
    dp = report.device_plugin
    if dp is None:
        return "device plugin: not answering" if "device_plugin" in report.expected else ""
    if not dp.kubelet_present:
        return f"device plugin: waiting for a kubelet at {dp.kubelet_socket}"
    state = "registered" if dp.registered else "NOT registered"
    parts = [f"{r.name} {r.healthy}/{r.devices} healthy" + ("" if r.registered else " (not registered" + (f": {r.error}" if r.error else "") + ")") for r in dp.resources]
    return f"device plugin: {state} with the kubelet; {', '.join(parts)}; {dp.allocations} allocation(s)"


def dra_plugin_line(report: NodeReport) -> str:
    dra = report.dra_plugin
    if dra is None:
        return "DRA plugin: not answering" if "dra_plugin" in report.expected else ""
    if dra.registered:
        state = "registered with the kubelet"
    elif dra.registration_error:
        state = f"NOT registered with the kubelet ({dra.registration_error})"
    else:
        state = "not registered (no kubelet has asked)"
    prepared = sum(1 for c in dra.claims if c.state == "PrepareCompleted")
    line = f"DRA plugin {dra.driver}: {state}; "
    if dra.api_error:
        line += f"API: {dra.api_error}; "
    else:
        line += f"pool {dra.node_name} generation {dra.pool_generation}, {dra.slices} slice(s), {dra.devices} device(s) on {len(dra.cards)} card(s)"
        line += " (whole cards shareable); " if dra.shared_cards else "; "
    return line + f"{prepared} claim(s) prepared"


def _when(t: datetime | None) -> str:
    return t.strftime("%Y-%m-%d %H:%M:%S") if t is not None else "-"


def op_line(op: GpuOp) -> str:
    """One maintenance operation, as `bcd gpu` and `bcd status` print it."""
    what = f"diag level {op.level}" if op.op == "diag" else op.op
    if op.state == "running":
        return f"{what} {op.pci}: running since {_when(op.started_at)} ({op.id}){'' if op.claims_card else '; the card stays usable'}"
    return f"{what} {op.pci}: {op.outcome} at {_when(op.finished_at)} ({op.id}): {op.message}"


def health_cell(g: Gpu) -> str:
    """A card's health in a word (`bcd gpu list`'s HEALTH): ok, the False reason (XidCritical, ...),
    Unknown/<reason> (NotChecked, Unmonitored), or "-" from an inventory that does not say."""
    c = g.status.health()
    if c is None:
        return "-"
    if c.status == "True":
        return "ok"
    return c.reason if c.status == "False" else f"{c.status}/{c.reason}"


def health_words(c: Condition) -> str:
    """The Healthy condition's message naming its reason once (the inventory's message already
    starts "XidCritical: ..." and names every fault)."""
    if not c.message:
        return c.reason
    return c.message if c.message.startswith(f"{c.reason}:") else f"{c.reason}: {c.message}"


#: the most cards a line of `bcd gpu list` or `bcd doctor` names before "and N more".
_NAMED_CARDS = 5


def _cards(pcis: list[str], of: int) -> str:
    if len(pcis) == of and of > 1:
        return f"every card ({of})"
    more = f" and {len(pcis) - _NAMED_CARDS} more" if len(pcis) > _NAMED_CARDS else ""
    return ", ".join(pcis[:_NAMED_CARDS]) + more


def _unwatched(inv: Inventory) -> dict[str, list[str]]:
    """Healthy=Unknown for another reason than NotChecked (Unmonitored: it cannot be watched), by message."""
    out: dict[str, list[str]] = {}
    for g in inv.gpus:
        c = g.status.health()
        if c is not None and c.status == "Unknown" and c.reason != NOT_CHECKED:
            out.setdefault(c.message or c.reason, []).append(g.pci_address)
    return out


def render_gpus(inv: Inventory, ops: list[GpuOp] | None = None) -> str:
    """`bcd gpu list`: each card's driver binding, phase, management state, health and the conditions
    behind them, and its maintenance: what runs on it, the last reset and the last diagnostic (from
    the converger). An unhealthy card gets a `Healthy:` line with the message (what the inventory
    saw, and when); cards whose health cannot be watched are named once at the end, by why."""
    lines = [f"{'PCI':<13} {'DRIVER':<9} {'MODE':<11} {'PHASE':<13} {'MANAGEMENT':<11} {'HEALTH':<19} CONDITIONS"]
    for g in inv.gpus:
        st = g.status
        conds = ", ".join(f"{c.type}={c.status}/{c.reason}" for c in st.conditions)
        lines.append(
            f"{g.pci_address:<13} {st.driver_binding.driver or '-':<9} {st.driver_binding.mode:<11} "
            f"{st.phase:<13} {st.driver_binding.management_state:<11} {health_cell(g):<19} {conds}"
        )
        for c in st.conditions:
            if c.type in ("Reclaim", "Reconfiguring", "MigLayout") or (c.type == "AdapterReady" and c.status == "False"):
                lines.append(f"{'':<13} {c.type}: {c.message}")
            elif c.type == HEALTHY_CONDITION and c.status == "False":
                lines.append(f"{'':<13} {c.type}: {c.message or c.reason}")
        a = card_attention(g)
        if a is not None:
            lines.append(f"{'':<13} needs a person: {'run ' if a.command else ''}{a.action}")
        for op in ops or ():
            if op.pci == g.pci_address:
                lines.append(f"{'':<13} {op_line(op).replace(f' {g.pci_address}:', ':', 1)}")
    for why, pcis in _unwatched(inv).items():
        lines.append(f"health not watched on {_cards(pcis, len(inv.gpus))}: {why}")
    if ops is None:
        lines.append("(maintenance unknown: the converger did not answer)")
    return "\n".join(lines)


def _condition(g: Gpu, type_: str) -> Condition | None:
    return next((c for c in g.status.conditions if c.type == type_), None)


@dataclass(frozen=True)
class Attention:
    """A card that needs a person: the condition that says so and what to do about it."""

    pci: str
    #: the ATTENTION_ROWS row that matched.
    row: str
    #: in a word or two: "Orphaned", "RebootRequested", "reclaim failed", "phase Failed".
    what: str
    #: "<type>=<status>/<reason>" of the condition behind it ("" when there is none).
    condition: str
    message: str
    #: a command line to run (`command` True) or what to do, in words.
    action: str
    command: bool = False

    def text(self) -> str:
        todo = f"run `{self.action}`" if self.command else self.action
        why = f"{self.message} ({self.condition})" if self.condition else self.message
        return f"GPU {self.pci} {self.what}: {why} -> {todo}"

    def to_builtins(self) -> dict[str, Any]:
        return {
            "pci_address": self.pci,
            "row": self.row,
            "what": self.what,
            "condition": self.condition,
            "message": self.message,
            "action": self.action,
            "command": self.command,
        }


@dataclass(frozen=True)
class AttentionRow:
    name: str
    when: Callable[[Gpu], bool]
    #: the condition behind it, as the operator reads it (None: the row has none to show).
    why: Callable[[Gpu], Condition | None]
    what: Callable[[Gpu], str]
    #: (action, is a command line)
    action: Callable[[Gpu], tuple[str, bool]]


def _reboot_wait(g: Gpu) -> Condition | None:
    c = _condition(g, "Reconfiguring")
    return c if c is not None and c.status == "True" and c.reason in REBOOT_WAIT_REASONS else None


def _reclaim_failed(g: Gpu) -> Condition | None:
    c = _condition(g, "Reclaim")
    return c if c is not None and c.status == "False" and c.reason == "Failed" else None


def _unhealthy(g: Gpu) -> Condition | None:
    return g.status.unhealthy()


def _unhealthy_action(g: Gpu) -> tuple[str, bool]:
    """What brings an unhealthy card back, by its Healthy reason (the worst fault it has)."""
    c, pci = g.status.unhealthy(), g.pci_address
    reason = c.reason if c is not None else ""
    if reason == "RowRemapFailed":
        return "the card needs service: a row of its memory could not be remapped (no reset or reboot fixes that); have it repaired or replaced", False
    if reason == "RowRemapPending":
        return f"reset the card (`bcd gpu reset {pci}`) or reboot the node: the pending rows are remapped then, and the next check clears it", False
    if reason == "EccCorrectable":
        return (
            f"reset the card (`bcd gpu reset {pci}`) or reboot the node to zero its ECC counters (the next check clears it), "
            "or raise the inventory's --ecc-correctable-max",
            False,
        )
    ready = _adapter_not_ready(g)
    if reason == "GpuLost" and ready is not None and ready.reason == "NotOnBus":
        # off the bus: no reset reaches it; a hold on it stays listed and says DevicesHealthy=False
        return (
            "the card is off the bus: move its work and reboot the node (reseat or replace the card if it stays missing); "
            "it stays lost until a reboot's clean check, or, once nothing holds it, a reset and `bcd gpu recheck "
            f"{pci}`",
            False,
        )
    # GpuLost, XidCritical, EccUncorrectable: sticky until a person acted
    managed = _condition(g, "Managed")
    if managed is not None and managed.status == "Unknown" and managed.reason == "Indeterminate":
        # the converger's claims do not answer: whether a hold is on it is not known now, and the
        # advice must hold either way (a reset of a held card is refused)
        return (
            f"whether a hold is on it is not known now (the converger's claims do not answer): move any work on it, "
            f"then reset it (`bcd gpu reset {pci}`) or reboot the node (a clean check after either clears it)",
            False,
        )
    if managed is not None and managed.reason == "BackingAllocation":
        # a held card is neither reset (bcd refuses) nor cleared by a recheck: the holds go first
        return (
            f"move its work: a held card is not reset and a recheck keeps its faults ({managed.message}); once the hold "
            f"is released, reset it (`bcd gpu reset {pci}`) or reboot the node (a clean check after either clears it)",
            False,
        )
    return (
        f"reset the card (`bcd gpu reset {pci}`) or reboot the node, then `bcd gpu recheck {pci}` if it still reads unhealthy "
        "(a clean check after the reset or the reboot clears it)",
        False,
    )


def _adapter_not_ready(g: Gpu) -> Condition | None:
    c = _condition(g, "AdapterReady")
    return c if c is not None and c.status == "False" else None


def _orphaned(g: Gpu) -> bool:
    if g.status.driver_binding.management_state != "Orphaned":
        return False
    reclaim = _condition(g, "Reclaim")
    # a reclaim on its way: nothing to do but wait
    return reclaim is None or reclaim.reason not in ("Held", "InProgress")


def _failed_action(g: Gpu) -> tuple[str, bool]:
    ready = _adapter_not_ready(g)
    if ready is not None and ready.reason == "VFIORequiresBareMetal":
        return (
            "take the VM instance off this card: `bcd apply` a spec without it "
            "(VFIO passthrough needs a bare-metal node)",
            False,
        )
    return "see its AdapterReady condition (`bcd gpu list`); the card is unusable until that is fixed", False


def _base(g: Gpu) -> str:
    return g.base_driver or "its compute driver"


#: what makes a card need a person, first matching row wins per card; anything
#: else (Ready, Completing, a refused reclaim, OrphanPending, Excluded, a
#: reclaim in progress, health Unknown) resolves by itself or is the operator's
#: own choice.
ATTENTION_ROWS: tuple[AttentionRow, ...] = (
    # the switcher could not roll a driver switch back: only a reboot returns the card
    AttentionRow(
        "reboot-wait",
        lambda g: _reboot_wait(g) is not None,
        _reboot_wait,
        lambda g: getattr(_reboot_wait(g), "reason", "Reconfiguring"),
        lambda g: (f"reboot the node (the card is back on {_base(g)} after it; the condition clears by itself)", False),
    ),
    # Healthy=False (issue 30): a fatal XID, an uncorrectable ECC error, the card lost, remapped rows;
    # nothing new is given the card, and only a reset, a reboot or service brings it back. Before
    # phase-failed (Healthy=False makes the phase Failed) and a failed reclaim (a sick card is why).
    AttentionRow(
        "unhealthy",
        lambda g: _unhealthy(g) is not None,
        _unhealthy,
        lambda g: "unhealthy",
        _unhealthy_action,
    ),
    # a reclaim that did not get the card off vfio-pci in time (seed: "a node reboot may be needed")
    AttentionRow(
        "reclaim-failed",
        lambda g: _reclaim_failed(g) is not None,
        _reclaim_failed,
        lambda g: "reclaim failed",
        lambda g: (f"reboot the node, or try again: `bcd gpu reclaim {g.pci_address}`", False),
    ),
    # e.g. a VM asked for the card on a virtualized node
    AttentionRow("phase-failed", lambda g: g.status.phase == "Failed", _adapter_not_ready, lambda g: "phase Failed", _failed_action),
    # on vfio-pci with no claim past the grace period: nothing returns it unless someone asks
    AttentionRow(
        "orphaned",
        _orphaned,
        lambda g: _condition(g, "Managed"),
        lambda g: "Orphaned",
        lambda g: (f"bcd gpu reclaim {g.pci_address}", True),
    ),
)


def attention_row(g: Gpu) -> AttentionRow | None:
    """The first row of ATTENTION_ROWS that matches the card; None: nothing to do."""
    return next((row for row in ATTENTION_ROWS if row.when(g)), None)


def card_attention(g: Gpu) -> Attention | None:
    """What the card needs from a person (the first matching ATTENTION_ROWS row); None: nothing."""
    row = attention_row(g)
    if row is None:
        return None
    c = row.why(g)
    action, command = row.action(g)
    st = g.status
    return Attention(
        pci=g.pci_address,
        row=row.name,
        what=row.what(g),
        condition=f"{c.type}={c.status}/{c.reason}" if c is not None else "",
        message=c.message if c is not None else f"phase {st.phase}, managementState {st.driver_binding.management_state}",
        action=action,
        command=command,
    )


def gpu_attention(inv: Inventory | None) -> list[Attention]:
    """Every card that needs a person, in inventory order, each with what to do."""
    return [a for g in (inv.gpus if inv else []) if (a := card_attention(g)) is not None]


def gpu_problems(inv: Inventory | None) -> list[str]:
    """Cards that need an operator, one line each: what, the condition's message, what to run."""
    return [a.text() for a in gpu_attention(inv)]


#: the most hold ids a cdi-runtime row names per what-to-do.
_NAMED_HOLDS = 5


def _hold_ids(uses: list[HoldUse]) -> str:
    ids = [u.allocation_id for u in uses]
    more = f" and {len(ids) - _NAMED_HOLDS} more" if len(ids) > _NAMED_HOLDS else ""
    return ", ".join(ids[:_NAMED_HOLDS]) + more


def cdi_runtime_checks(report: NodeReport) -> list[tuple[str, str, str]]:
    """One `cdi-runtime` row per runtime found (ok, or warn: the holds it cannot use and what to do);
    one ok row when none was found; nothing when the runtimes were not looked for."""
    if report.runtimes is None:
        return []
    if not report.runtimes:
        return [("ok", "cdi-runtime", f"no container runtime found on this host ({', '.join(RUNTIME_NAMES)}): nothing to check")]
    out: list[tuple[str, str, str]] = []
    for rt in report.runtimes:
        uses = [hold_use(rt, h, report.same_dirs) for h in report.hold_files]
        bad = [u for u in uses if not u.usable]
        if not uses:
            out.append(("ok", "cdi-runtime", f"{rt.describe()}: no holds to use"))
            continue
        if not bad:
            out.append(("ok", "cdi-runtime", f"{rt.describe()}: can use every hold ({len(uses)})"))
            continue
        if not rt.version:
            out.append(("warn", "cdi-runtime", f"{rt.name}: version unknown ({rt.error}): cannot tell which of the {len(uses)} hold(s) it can use"))
            continue
        groups: dict[str, list[HoldUse]] = {}
        for u in bad:
            groups.setdefault(u.todo, []).append(u)
        why = "; ".join(f"{_hold_ids(us)}: {todo}" for todo, us in groups.items())
        out.append(("warn", "cdi-runtime", f"{rt.label} cannot use {len(bad)} of {len(uses)} hold(s): {why}"))
    return out


def health_checks(inv: Inventory | None) -> list[tuple[str, str, str]]:
    """`gpu-health` rows: a FAIL per unhealthy card (its Healthy condition; the `gpu` row says what to
    do), a warning per reason health cannot be watched (Unmonitored), naming the cards; else one ok
    row. Nothing from an inventory that does not say (no card has a Healthy condition)."""
    if inv is None:
        return [("warn", "gpu-health", "no inventory: the cards' health is unknown")]
    if not inv.gpus:
        return [("ok", "gpu-health", "no GPU on this node")]
    if not any(g.status.health() is not None for g in inv.gpus):
        return [("warn", "gpu-health", "the inventory does not say the cards' health (an inventory of an older release)")]
    out: list[tuple[str, str, str]] = []
    for g in inv.gpus:
        c = g.status.unhealthy()
        if c is not None:
            out.append(("fail", "gpu-health", f"{g.pci_address} is unhealthy (Healthy=False/{c.reason}), nothing new is given it: {health_words(c)}"))
    for why, pcis in _unwatched(inv).items():
        out.append(("warn", "gpu-health", f"{_cards(pcis, len(inv.gpus))}: health not watched (Healthy=Unknown): {why}"))
    if not out:
        healthy = sum(1 for g in inv.gpus if (c := g.status.health()) is not None and c.status == "True")
        waiting = len(inv.gpus) - healthy
        text = f"{healthy} card(s) healthy"
        if waiting:
            text += f", {waiting} not checked yet (NotChecked: the vendor library has not seen them, e.g. on vfio-pci)"
        out.append(("ok", "gpu-health", text))
    return out


def upstream_checks(md: dict[str, str]) -> list[tuple[str, str, str]]:
    """The `upstream` row (connected, or why not, in the bridge's one line) and a `upstream-tls`
    warning for plain text to a host that is not this one."""
    state, error, url, tls = md.get("upstream_state", ""), md.get("upstream_error", ""), md.get("upstream", ""), md.get("upstream_tls", "")
    if not state:
        return []
    out: list[tuple[str, str, str]] = []
    if state == "connected":
        out.append(("warn", "upstream", f"connected to {url}, but {error}") if error else ("ok", "upstream", f"connected to {url} (TLS {tls})"))
    else:
        # a refusal needs someone; a first connection still under way does not (yet)
        level = "fail" if error else "warn"
        out.append((level, "upstream", f"{state} to {url}: {error or 'no answer yet'}; holds and the outbox are kept meanwhile"))
    if tls == "off" and not _loopback_only(url):
        out.append(("warn", "upstream-tls", f"{url} is dialled in plain text: specs, events and credentials cross the network in clear (--upstream-ca)"))
    return out


def _loopback_only(url: str) -> bool:
    from urllib.parse import urlparse

    hosts = [urlparse(u.strip() if "://" in u else f"nats://{u.strip()}").hostname or "" for u in url.split(",") if u.strip()]
    return all(h in ("localhost", "::1") or h.startswith("127.") for h in hosts)


#: the services that take a node spec and check its signature (shared/spectrust.py)
SPEC_CHECKERS = ("gateway_bridge", "converger")


def spec_trust_checks(report: NodeReport) -> list[tuple[str, str, str]]:
    """One row: every service that takes specs verifies them (ok), or which take them UNSIGNED (warn)."""
    unsigned: list[str] = []
    keys: dict[str, str] = {}
    for name in SPEC_CHECKERS:
        meta = (report.services.get(name) or {}).get("metadata") or {}
        if "cp_keys" not in meta:
            continue  # not running, or a converger of a release that left the check to the bridge
        # cp_keys "0" without the flag: a bridge of an earlier release, which took unsigned specs silently
        if meta.get("unsigned_specs") == "accepted" or meta["cp_keys"] == "0":
            unsigned.append(name)
        else:
            keys[name] = meta["cp_keys"]
    if unsigned:
        return [
            (
                "warn",
                "unsigned-specs",
                f"{' and '.join(unsigned)} accept{'s' if len(unsigned) == 1 else ''} UNSIGNED node specs "
                "(--accept-unsigned-specs, lab only): whoever can put this node's spec owns its holds; give them --cp-key",
            )
        ]
    if keys:
        said = ", ".join(f"{n} {k}" for n, k in keys.items())
        return [("ok", "signed-specs", f"node specs verified against the control-plane key(s) ({said})")]
    return [("warn", "signed-specs", "no running service says whether it verifies node specs (bridge and converger down, or of an older release)")]


def render_doctor(checks: list[tuple[str, str, str]]) -> str:
    """The doctor's table: level, check name, message; the name column as wide as its longest name
    (a fixed width let `service.gateway_bridge` run into its message)."""
    width = max((len(name) for _, name, _ in checks), default=0)
    mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
    return "\n".join(f"{mark[level]}  {name:<{width}}  {message}" for level, name, message in checks)


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
    out.extend(spec_trust_checks(report))
    bridge = report.services.get("gateway_bridge")
    if bridge is not None:
        out.extend(upstream_checks(bridge.get("metadata") or {}))
    conv, inv = report.converger, report.inventory
    if conv is None:
        # every check README lists prints a row: these need the converger's status
        out.extend(("warn", name, "converger unavailable: not checked") for name in ("gpu-binding", "vendor-cdi-spec", "outbox-size", "hold-files"))
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
        else:
            out.append(("ok", "gpu-binding", "can take holds (root, fake host or the root helper)" if conv.privileged else "unprivileged, and no GPU to bind"))
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
        if conv.generation is not None and conv.generation > GENERATION_SAFE_MAX:
            out.append(("fail", "generation", generation_problem(conv.generation)))
        if conv.outbox_error:
            out.append(("fail", "outbox-size", conv.outbox_error))
        elif conv.outbox_warning:
            out.append(("warn", "outbox-size", conv.outbox_warning))
        else:
            out.append(("ok", "outbox-size", "the outbox has the size asked for"))
        hold_dirs = [p for p in conv.problems if p not in (conv.outbox_error, conv.outbox_warning)]
        out.extend(("warn", "hold-files", p) for p in hold_dirs)
        out.extend(("warn", "hold-files", f"odd file: {o}") for o in conv.odd_files)
        if not hold_dirs and not conv.odd_files:
            out.append(("ok", "hold-files", "the hold dirs hold only bcd's files"))
        out.extend(("warn", "hold-drift", d) for d in conv.drift)
        if conv.relayout is not None:
            bad = relayout_problems(conv.relayout, report.now)
            out.extend(("fail", "mig-relayout", p) for p in bad)
            if not bad:
                running = conv.relayout.running
                out.append(("ok", "mig-relayout", f"{running.config}: {running.step}" if running else "no MIG re-layout runs; none failed"))
        if conv.section is not None and conv.section.state == "FAILED":
            out.append(("warn", "section", "devices section FAILED: " + "; ".join(conv.section.message.splitlines())))
        for c in conv.conditions:
            if c.status == "True":
                name = "spec-fields" if c.type == UNKNOWN_FIELDS_CONDITION else "node-condition"
                out.append(("warn", name, f"{c.type} ({c.reason}): {c.message}"))
    kube = [h.allocation_id for h in conv.holds if h.binding == "BINDING_KUBERNETES"] if conv is not None else []
    if kube and "device_plugin" in report.expected:
        dp = report.device_plugin
        if dp is None or not dp.registered:
            why = device_plugin_line(report).removeprefix("device plugin: ")
            out.append(("warn", "device-plugin", f"{len(kube)} Kubernetes hold(s) but the device plugin is not registered ({why}): no pod can get their devices"))
        else:
            out.append(("ok", "device-plugin", f"registered with the kubelet; {len(kube)} Kubernetes hold(s)"))
    if "dra_plugin" in report.expected:
        dra = report.dra_plugin
        prepared = [c for c in conv.claims if c.state == "prepared"] if conv is not None else []
        if dra is None:
            if prepared:
                out.append(("warn", "dra-plugin", f"{len(prepared)} DRA claim(s) prepared but the DRA plugin does not answer"))
        elif dra.registered and dra.api_error:
            # a kubelet uses it, but it cannot read claims or publish slices
            out.append(("warn", "dra-plugin", f"registered with the kubelet, but {dra.api_error}"))
        elif dra.registered:
            out.append(("ok", "dra-plugin", dra_plugin_line(report).removeprefix(f"DRA plugin {dra.driver}: ")))
        elif dra.registration_error:
            out.append(("warn", "dra-plugin", f"the kubelet refused its registration: {dra.registration_error}"))
    out.extend(cdi_runtime_checks(report))
    out.extend(health_checks(inv))
    out.extend(("fail", "gpu", p) for p in gpu_problems(inv))
    age = _age(report)
    if age is not None and age > OUTBOX_STALE_S:
        out.append(("fail", "outbox", f"not draining: oldest event {age:.0f} s old"))
    return out


__all__ = [
    "NodeReport",
    "gather",
    "problems",
    "render_status",
    "render_gpus",
    "health_cell",
    "health_words",
    "health_checks",
    "Attention",
    "AttentionRow",
    "ATTENTION_ROWS",
    "attention_row",
    "card_attention",
    "gpu_attention",
    "gpu_problems",
    "doctor_checks",
    "render_doctor",
    "cdi_runtime_checks",
    "look_at_runtimes",
    "OUTBOX_STALE_S",
]
