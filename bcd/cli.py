"""The `bcd` command: `up` starts a whole node; the rest look at or act on a running one.

Every command takes `--state-dir` (env BCD_STATE_DIR, default ./state) and
finds the node through `<state>/node.json`; none needs other flags. Every one
ends through `bcd.exits.run_command`: a node that is down is one line on stderr
and exit 3 within `--timeout` seconds, never a traceback (unless `--debug`);
the exit codes are `bcd.exits.EXIT_CODES`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import re
import sys
import time
from typing import Any, NoReturn
from pathlib import Path

import msgspec

from shared import logs
from shared.runtime import METRICS_PORTS, VERSION
from shared.schemas import (
    CONVERGER_STATUS_CODEC,
    GPU_OP_REPLY_CODEC,
    GPU_REPLY_CODEC,
    INVENTORY_CODEC,
    SIGNER_KEY_CODEC,
    Empty,
    GpuOp,
    GpuOpReply,
    GpuOpRequest,
    GpuReply,
    GpuRequest,
    Inventory,
    SignerKey,
)
from shared.busstreams import DEFAULT_OUTBOX_MAX_BYTES
from shared.schemas.codec import BoundedDecoder
from shared.subjects import NodeSubjects

from .client import DEFAULT_CONNECT_TIMEOUT, NodeInfo, NodeUnreachable, connect, node_info, ping_all, request, set_connect_timeout
from .exits import UsageError, exit_codes_text, run_command
from .roster import NODE_SERVICES
from .up import cmd_up

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FAKE_HOST = REPO_ROOT / "examples" / "hosts" / "h200x8.json"


def _env_default(name: str, default: str) -> str:
    value = os.environ.get(name)
    return value if value else default


def _default_fake_host() -> Path | None:
    env = os.environ.get("BCD_FAKE_HOST")
    if env:
        return Path(env)
    return DEFAULT_FAKE_HOST if DEFAULT_FAKE_HOST.exists() else None


def _run(coro):  # noqa: ANN001, ANN202
    """Run one command's coroutine; what it raises (node down, a refusal) is `run_command`'s to report."""
    return asyncio.run(coro)


# ----------------------------------------------------------------------- commands


def cmd_ping(args: argparse.Namespace) -> int:
    info = node_info(args.state_dir)

    async def run() -> list[dict]:
        nc = await connect(info)
        try:
            return await ping_all(nc, args.wait)
        finally:
            await nc.close()

    replies = _run(run())
    # a service the node runs (node.json) that did not answer fails the ping, not only "none did"
    missing = sorted(set(info.services) - {r.get("name") for r in replies})
    if args.json:
        print(json.dumps(replies, indent=2))
    else:
        print(f"{'SERVICE':<16} {'VERSION':<8} {'NODE':<12} {'METRICS':<34} ID")
        for r in replies:
            md = r.get("metadata") or {}
            print(f"{r['name']:<16} {r['version']:<8} {md.get('node_id', ''):<12} {_metrics_seen_from_here(info, r['name'], md):<34} {r['id']}")
    if missing:
        print(f"bcd ping: no answer within {args.wait:g}s from {', '.join(missing)} (node.json lists them)", file=sys.stderr)
    return 0 if replies and not missing else 1


def _metrics_seen_from_here(info: NodeInfo, service: str, metadata: dict) -> str:
    """The metrics endpoint as this host reaches it: node.json's, where it lists one; a compose
    node's services listen inside their containers (issue 28.8: ping listed those ports as if here)."""
    if service in info.metrics:
        return info.metrics[service]
    own = str(metadata.get("metrics", ""))
    if info.put_command and own:
        return f"(in its container: {own})"
    return own


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.0f} GiB"


def render_inventory(inv: Inventory) -> str:
    lines = [
        f"node {inv.node_id}  revision {inv.revision}  vendor {inv.vendor} ({inv.adapter})  driver {inv.driver_version}  boot {inv.boot_id}",
        f"host: memory {_gib(inv.host.memory_bytes)}  cpus {inv.host.cpus}  "
        f"{'virtualized' if inv.host.virtualized else 'bare metal'}  NUMA nodes {len(inv.host.numa_nodes)}",
    ]
    for n in inv.host.numa_nodes:
        pools = ", ".join(f"{p.page_size_kib} KiB x{p.total} ({p.free} free)" for p in n.hugepages) or "none"
        lines.append(f"  node{n.node}: cpus {n.cpus}  memory {_gib(n.memory_bytes)}  hugepages {pools}")
    lines.append(f"{'IDX':<4} {'PCI':<13} {'NAME':<16} {'DRIVER':<9} {'PHASE':<12} ATOMS")
    for g in inv.gpus:
        parts = [i.atom_id.split("/", 1)[1] + f" ({i.profile})" for i in g.mig_instances] + [
            s.atom_id.split("/", 1)[1] for s in g.slots
        ]
        detail = ("MIG: " if g.mig_mode else "") + ", ".join(parts) if parts else ("MIG, no instances" if g.mig_mode else "whole")
        lines.append(f"{g.index:<4} {g.pci_address:<13} {g.name[:16]:<16} {g.driver or '-':<9} {g.status.phase:<12} {g.atom_id}  {detail}")
    lines.append(f"{len(inv.atoms)} atoms")
    return "\n".join(lines)


def cmd_inventory(args: argparse.Namespace) -> int:
    info = node_info(args.state_dir)

    async def run() -> Inventory:
        nc = await connect(info)
        try:
            return await request(nc, NodeSubjects(info.node_id).inventory_get, Empty(), INVENTORY_CODEC, timeout=5)
        finally:
            await nc.close()

    inv = _run(run())
    print(msgspec.json.format(msgspec.json.encode(inv)).decode() if args.json else render_inventory(inv))
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    """The node's public key and key_id, as the signer reports them."""
    info = node_info(args.state_dir)

    async def run() -> SignerKey:
        nc = await connect(info)
        try:
            return await request(nc, NodeSubjects(info.node_id).signer_key, Empty(), SIGNER_KEY_CODEC)
        finally:
            await nc.close()

    key = _run(run())
    if args.json:
        print(msgspec.json.encode(key).decode())
    else:
        print(f"node {key.node_id}  key_id {key.key_id}  boot {key.boot_id}")
        print(f"public key (base64 raw Ed25519): {base64.b64encode(key.public_key).decode()}")
    return 0


def _canonical_pci(address: str) -> str:
    """`3B:00.0` -> `0000:3b:00.0`: the spelling the inventory lists (sysfs', lowercase, with the domain)."""
    a = address.strip().lower()
    return f"0000:{a}" if a.count(":") == 1 else a


#: a PCI function address as sysfs spells it: domain:bus:device.function
_PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]")


def _listed_card(args: argparse.Namespace, inv: Inventory) -> str:
    """The card `args.pci` names, canonical, when the inventory lists it; else UsageError (exit 2).

    Every `bcd gpu` subcommand that takes an address goes through here before it asks
    anything of a service, so a typo or a card this node does not have is an input error
    (README's exit-code table) for all of them alike, not a refusal (exit 1) from
    whichever service the action happens to go to.
    """
    pci = _canonical_pci(args.pci)
    if not _PCI_ADDRESS.fullmatch(pci):
        raise UsageError(f"gpu {args.action}: {args.pci!r} is not a PCI address (like 0000:3b:00.0)")
    if not any(g.pci_address == pci for g in inv.gpus):
        listed = ", ".join(g.pci_address for g in inv.gpus) or "none"
        raise UsageError(f"gpu {args.action}: no card {args.pci} on node {inv.node_id} (its cards: {listed})")
    return pci


def cmd_gpu(args: argparse.Namespace) -> int:
    """`bcd gpu list`, or exclude / include / reclaim / recheck one card by its PCI address (through the inventory).

    recheck: the inventory checks the card's health now; on a card nothing holds a clean check
    clears its sticky faults (a fatal XID, an uncorrectable ECC error, the card lost), as after a
    reset done another way; on a held card it keeps them (no reset can have happened while it is
    held). Accepted (exit 0) when the card reads healthy after it, refused (exit 1, the reply says
    what stands) otherwise."""
    from .status import render_gpus

    info = node_info(args.state_dir)
    subjects = NodeSubjects(info.node_id)

    async def listing() -> Inventory:
        nc = await connect(info)
        try:
            return await request(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=5)
        finally:
            await nc.close()

    if args.action == "list":

        async def maintenance() -> list[GpuOp] | None:
            nc = await connect(info)
            try:
                return (await request(nc, subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=5)).gpu_ops
            except Exception:  # noqa: BLE001 - the list says the converger did not answer
                return None
            finally:
                await nc.close()

        inv = _run(listing())
        if args.pci:
            pci = _listed_card(args, inv)
            inv = msgspec.structs.replace(inv, gpus=[g for g in inv.gpus if g.pci_address == pci])
        ops = _run(maintenance())
        if args.json:
            rows = [
                {"pci_address": g.pci_address, **msgspec.to_builtins(g.status), "maintenance": [msgspec.to_builtins(o) for o in ops or () if o.pci == g.pci_address]}
                for g in inv.gpus
            ]
            print(msgspec.json.format(msgspec.json.encode(rows)).decode())
        else:
            print(render_gpus(inv, ops))
        return 0

    if not args.pci:
        raise UsageError(f"gpu {args.action}: a PCI address is needed (like 0000:3b:00.0)")
    _check_op_flags(args)
    args.pci = _listed_card(args, _run(listing()))

    if args.action in ("reset", "diag", "mig-layout"):
        return _gpu_op(args, info, subjects)

    async def act() -> GpuReply:
        nc = await connect(info)
        try:
            return await request(nc, subjects.inventory_gpu, GpuRequest(action=args.action, pci=args.pci), GPU_REPLY_CODEC, timeout=10)
        finally:
            await nc.close()

    reply = _run(act())
    if args.json:
        print(msgspec.json.encode(reply).decode())
    else:
        verdict = "accepted" if reply.accepted else "REFUSED"
        print(f"{args.action} {reply.pci}: {verdict}: {reply.message}")
        if reply.gpu is not None:
            st = reply.gpu.status
            print(f"  phase {st.phase}  driver {st.driver_binding.driver or '(none)'}  mode {st.driver_binding.mode}  management {st.driver_binding.management_state}")
            for c in st.conditions:
                print(f"  {c.type}={c.status} {c.reason}: {c.message}")
    return 0 if reply.accepted else 1


def _check_op_flags(args: argparse.Namespace) -> None:
    """The flags an action takes, checked before anything is asked of the node (UsageError, exit 2)."""
    if args.action == "diag" and args.level is None:
        raise UsageError("gpu diag: --level N is needed (1 quick, 2 medium, 3 long, 4 extended)")
    if args.action != "diag" and args.level is not None:
        raise UsageError(f"gpu {args.action}: --level is for diag")
    if args.action == "mig-layout" and not args.layout:
        raise UsageError("gpu mig-layout: a LAYOUT is needed: all-disabled, or GPU instance profiles comma-separated (like 1g.18gb,1g.18gb,3g.71gb)")
    if args.action != "mig-layout" and args.layout:
        raise UsageError(f"gpu {args.action}: only mig-layout takes a LAYOUT")


async def _follow(nc: Any, subjects: NodeSubjects, wait: float, pick: Any) -> tuple[Any, Any]:
    """Ask the converger's status every half second until `pick(status)` is something, or `wait` is over:
    (what pick gave or None, the last status)."""
    deadline, status = time.monotonic() + wait, None
    while time.monotonic() < deadline:
        status = await request(nc, subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=10)
        found = pick(status)
        if found is not None:
            return found, status
        await asyncio.sleep(0.5)
    return None, status


def _gpu_op(args: argparse.Namespace, info: Any, subjects: NodeSubjects) -> int:
    """`bcd gpu reset|diag <pci>`: asked of the converger, then followed in its status until done."""
    from .status import op_line

    level = args.level if args.action == "diag" else 0
    req = GpuOpRequest(op=args.action, pci=_canonical_pci(args.pci), level=level, layout=args.layout or "")
    if args.action == "mig-layout":
        return _mig_layout(args, info, subjects, req)

    async def run() -> tuple[GpuOpReply, GpuOp | None]:
        nc = await connect(info)
        try:
            reply = await request(nc, subjects.converger_gpu_op, req, GPU_OP_REPLY_CODEC, timeout=10)
            if not reply.accepted or reply.op is None or args.no_wait:
                return reply, None
            if not args.json:
                print(f"{args.action} {req.pci}: started {reply.op.id}; waiting (up to {args.wait:.0f} s; --no-wait returns at once)", flush=True)
            op_id = reply.op.id
            done, _ = await _follow(nc, subjects, args.wait, lambda st: next((o for o in st.gpu_ops if o.id == op_id and o.state == "done"), None))
            return reply, done
        finally:
            await nc.close()

    reply, done = _run(run())
    if args.json:
        print(msgspec.json.encode({"reply": reply, "result": done}).decode())
    elif not reply.accepted:
        print(f"{args.action} {req.pci}: REFUSED: {reply.message}")
    elif done is not None:
        print(op_line(done))
    elif args.no_wait:
        print(f"{args.action} {req.pci}: started {reply.op.id if reply.op else ''}; `bcd status` shows how it ends")
    else:
        print(f"{args.action} {req.pci}: still running after {args.wait:.0f} s ({reply.op.id if reply.op else ''}); `bcd status` shows how it ends")
    if not reply.accepted:
        return 1
    if done is None:
        return 0 if args.no_wait else 1
    return 0 if done.outcome in ("Succeeded", "Passed") else 1


def _mig_layout(args: argparse.Namespace, info: Any, subjects: NodeSubjects, req: GpuOpRequest) -> int:
    """`bcd gpu mig-layout <pci> <layout>`: the desired layout set, then followed until Applied or Failed."""

    async def run() -> tuple[GpuOpReply, Any]:
        nc = await connect(info)
        try:
            reply = await request(nc, subjects.converger_gpu_op, req, GPU_OP_REPLY_CODEC, timeout=10)
            if not reply.accepted or args.no_wait:
                return reply, None
            if not args.json:
                print(f"{reply.message}; waiting (up to {args.wait:.0f} s; --no-wait returns at once)", flush=True)
            def ended(st: Any) -> Any:
                m = next((m for m in st.mig_layouts if m.pci_address == req.pci), None)
                return m if m is not None and m.state in ("Applied", "Failed") else None

            done, status = await _follow(nc, subjects, args.wait, ended)
            if done is None and status is not None:  # still Pending or Applying: say where it stands
                done = next((m for m in status.mig_layouts if m.pci_address == req.pci), None)
            return reply, done
        finally:
            await nc.close()

    reply, state = _run(run())
    if args.json:
        print(msgspec.json.encode({"reply": reply, "layout": state}).decode())
    elif not reply.accepted:
        print(f"mig-layout {req.pci}: REFUSED: {reply.message}")
    elif state is not None:
        print(f"mig-layout {req.pci} {state.layout}: {state.state}" + (f": {state.message}" if state.message else ""))
    else:
        print(reply.message)
    if not reply.accepted:
        return 1
    return 0 if args.no_wait or (state is not None and state.state == "Applied") else 1


def cmd_status(args: argparse.Namespace) -> int:
    from .status import gather, problems, render_status

    info = node_info(args.state_dir)
    report = _run(gather(info))
    if not report.reachable:
        error = report.error or f"node bus at {info.nats_url} not reachable"
        if args.json:
            # the documented shape, saying so (issue 28.8: nothing came on stdout), then exit 3
            keys = ("services", "converger", "device_plugin", "dra_plugin", "outbox")
            print(json.dumps({"node_id": report.node_id, "reachable": False, "error": error, **{k: None for k in keys}, "problems": [error]}, indent=2))
        raise NodeUnreachable(error)
    if args.json:
        print(
            json.dumps(
                {
                    "node_id": report.node_id,
                    "reachable": report.reachable,
                    "error": "",
                    "services": sorted(report.services),
                    "converger": msgspec.to_builtins(report.converger),
                    "device_plugin": msgspec.to_builtins(report.device_plugin),
                    "dra_plugin": msgspec.to_builtins(report.dra_plugin),
                    "outbox": {"messages": report.outbox.messages, "oldest": str(report.outbox.oldest)} if report.outbox else None,
                    "problems": problems(report),
                },
                indent=2,
            )
        )
    else:
        print(render_status(report))
    return 1 if problems(report) else 0


def cmd_bus(args: argparse.Namespace) -> int:
    """The node bus: each service's endpoints ($SRV.STATS), the outbox and KV state, and the
    monitoring endpoint's view (version, connections per user, subscriptions, JetStream)."""
    from .busview import bus_json, bus_problems, gather_bus, render_bus

    info = node_info(args.state_dir)
    report = _run(gather_bus(info, args.wait))
    if not report.reachable:
        raise NodeUnreachable(report.error or f"node bus at {info.nats_url} not reachable")
    print(json.dumps(bus_json(report), indent=2) if args.json else render_bus(report))
    return 1 if bus_problems(report) else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .runtimes import default_probe
    from .status import doctor_checks, gather, render_doctor

    info = node_info(args.state_dir)
    report = _run(gather(info, runtimes=default_probe()))
    if not report.reachable:
        raise NodeUnreachable(report.error or f"node bus at {info.nats_url} not reachable")
    checks = doctor_checks(report)
    worst = max((1 if level == "fail" else 0 for level, _, _ in checks), default=0)
    if args.json:
        print(
            json.dumps(
                {
                    "node_id": report.node_id,
                    "healthy": worst == 0,
                    "checks": [{"level": level, "check": name, "message": message} for level, name, message in checks],
                },
                indent=2,
            )
        )
        return worst
    print(render_doctor(checks))
    return worst


def cmd_apply(args: argparse.Namespace) -> int:
    """Check the spec strictly, then put it (`--wait`: follow it to its outcome) or plan it (`--dry-run`); see bcd/applycmd.py."""
    from .applycmd import apply_command

    return apply_command(args)


def cmd_rebase(args: argparse.Namespace) -> int:
    """Bring a node put above generation 2^53 - 1 back to its control plane's count, holds kept; see bcd/applycmd.py."""
    from .applycmd import rebase_command

    return rebase_command(args)


def cmd_events(args: argparse.Namespace) -> int:
    from .events import follow_events

    info = node_info(args.state_dir)
    if not info.controlplane_dir:
        raise UsageError(f"events: node {info.node_id} joined an existing upstream ({info.upstream_url}); its control plane keeps the event log")
    last = None if args.all else args.last
    asyncio.run(follow_events(Path(info.controlplane_dir) / "events.jsonl", follow=not args.no_follow, last=last, as_json=args.json))
    return 0


def _free_releases(args: argparse.Namespace, info: NodeInfo, data: Path, kick: Any) -> int:
    """`bcd releases --free ALLOC...`: the operator's word that no pod holds those pending releases'
    devices (a host with no kubelet: an unreachable kubelet counts as holding them for ever)."""
    from services.converger.releases import ReleasesStore

    store = ReleasesStore(data)
    pending, _ = store.peek()
    unknown = [a for a in args.free if a not in pending]
    if unknown:
        raise UsageError(f"no pending Kubernetes release of {', '.join(unknown)} (pending: {', '.join(sorted(pending)) or 'none'}); nothing was marked")
    for alloc in args.free:
        path = store.mark_freed(alloc)
        if not args.json:
            print(f"{alloc}: you assert no pod holds {', '.join(pending[alloc].devices)}: its Released is reported at the next pass ({path})")
    _run(kick())
    if args.json:
        print(json.dumps({"node_id": info.node_id, "freed": list(args.free)}, indent=2))
    return 0


def cmd_releases(args: argparse.Namespace) -> int:
    """Pending Kubernetes releases; `--clear-unreadable` removes the unreadable-releases marker.

    Reads the converger's files, so it works with the node stopped too. `--json`:
    `{node_id, releases: [...], unreadable_marker, error}`, or `{node_id, cleared, marker}`
    with `--clear-unreadable`.
    """
    from services.converger.releases import RELEASES_FILE, RELEASES_MAX_BYTES, UNREADABLE_MARKER, ReleasesFile
    from shared.fsutil import read_regular

    info = node_info(args.state_dir)
    data = Path(info.data_dir)
    marker = data / UNREADABLE_MARKER

    async def kick() -> None:
        nc = await connect(info)
        try:
            await nc.request(NodeSubjects(info.node_id).converger_pass, b"", timeout=3)
        finally:
            await nc.close()

    if args.free:
        return _free_releases(args, info, data, kick)
    if args.clear_unreadable:
        if not marker.exists():
            if args.json:
                print(json.dumps({"node_id": info.node_id, "cleared": False, "marker": str(marker)}, indent=2))
            else:
                print(f"no marker at {marker}: nothing to clear")
            return 0
        if not args.json:
            print(f"removing {marker}: you assert that no pod holds a GPU of an allocation this node does not know")
        marker.unlink()
        _run(kick())
        if args.json:
            print(json.dumps({"node_id": info.node_id, "cleared": True, "marker": str(marker)}, indent=2))
        return 0
    error = ""
    pending: dict = {}
    try:
        pending = BoundedDecoder(ReleasesFile, max_bytes=RELEASES_MAX_BYTES, what=RELEASES_FILE).decode(read_regular(data / RELEASES_FILE, max_bytes=RELEASES_MAX_BYTES)).releases
    except FileNotFoundError:
        pending = {}
    except OSError as exc:
        error = f"{data / RELEASES_FILE} is unreadable ({exc.strerror or exc}); the converger sets it aside at its next pass"
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        error = f"{data / RELEASES_FILE} is unreadable ({exc}); the converger sets it aside at its next pass"
    if args.json:
        print(
            json.dumps(
                {
                    "node_id": info.node_id,
                    "releases": [msgspec.to_builtins(rel) for rel in pending.values()],
                    "unreadable_marker": str(marker) if marker.exists() else None,
                    "error": error or None,
                },
                indent=2,
            )
        )
        return 1 if error or marker.exists() else 0
    if error:
        print(error)
        return 1
    if marker.exists():
        print(f"UNREADABLE releases marker present ({marker}): every GPU counts as claimed. `bcd releases --clear-unreadable` once you are sure.")
    if not pending:
        print("no pending Kubernetes releases")
    for rel in pending.values():
        print(f"{rel.allocation_id} ({rel.reservation_id}) gen {rel.generation} since {rel.since.isoformat(timespec='seconds')}: {', '.join(rel.devices)}")
    return 1 if marker.exists() else 0


def cmd_cdi(args: argparse.Namespace) -> int:
    """`bcd cdi list`: the CDI device names bcd created, the hold and atoms behind each, and how a runtime asks for them.

    Reads the hold files in the node's CDI dir (`--cdi-dir`, else node.json's) and their consumer copies
    (`--cdi-consumer-dir`, else node.json's), never the bus: it works with the node stopped. Looks for
    podman, docker, containerd and crio on PATH and shows command lines only for those that can use a hold.
    Exit 1 when a file there could not be read as a hold, a name is used twice, or a consumer copy is
    missing, stale or without its hold.
    """
    from . import runtimes
    from .cdi import hold_files, listing_json, read_cdi_dir, render_listing
    from .client import NodeInfo, NodeNotFound

    info: NodeInfo | None = None
    if args.cdi_dir is None or args.cdi_consumer_dir is None:
        try:
            info = node_info(args.state_dir)
        except NodeNotFound:
            if args.cdi_dir is None:
                raise
    if args.cdi_dir is not None:
        cdi_dir = args.cdi_dir
    else:
        assert info is not None
        cdi_dir = Path(info.cdi_dir) if info.cdi_dir else args.state_dir / "cdi"
    if args.cdi_consumer_dir is not None:
        consumer_dir: Path | str = args.cdi_consumer_dir
    else:
        consumer_dir = info.cdi_consumer_dir if info is not None else ""
    listing = read_cdi_dir(cdi_dir, consumer_dir)
    if args.allocations:
        wanted = set(args.allocations)
        missing = sorted(wanted - {h.allocation_id for h in listing.holds})
        listing.holds = [h for h in listing.holds if h.allocation_id in wanted]
        listing.problems.extend(f"no hold of allocation {a} in {cdi_dir}" for a in missing)
    found = runtimes.default_probe().find()
    same_dirs = runtimes.same_dirs_of(found, hold_files(listing))
    print(json.dumps(listing_json(listing, found, same_dirs), indent=2) if args.json else render_listing(listing, found, same_dirs))
    return 1 if listing.problems else 0


def cmd_completion(args: argparse.Namespace) -> int:
    """`bcd completion bash|zsh|tcsh`: the shell's completion script, generated from this parser by shtab."""
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell), end="")
    return 0


def manpage(parser: argparse.ArgumentParser | None = None) -> str:
    """bcd(1) in roff, generated from the parser by argparse-manpage (every subcommand, flag and help text)."""
    from argparse_manpage.manpage import Manpage

    parser = parser or build_parser()
    page = Manpage(
        parser,
        _data={
            "project_name": "bcd",
            "version": VERSION,
            "manual_title": "bcd manual",
            "description": "a node agent for GPU hosts",
            "date": "",
        },
    )
    # argparse-manpage leaves help text as it wraps: a line that starts with a quote would be
    # read as a roff control line (it makes no request of its own that starts so)
    return "\n".join("\\&" + line if line.startswith("'") else line for line in str(page).split("\n"))


def cmd_man(args: argparse.Namespace) -> int:
    """`bcd man [-o FILE]`: the man page (roff) on stdout, or written to FILE (`man -l FILE` reads it)."""
    text = manpage()
    if args.output is None or str(args.output) == "-":
        print(text, end="")
        return 0
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    except OSError as exc:
        raise UsageError(f"man: cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------- main


def _service_list(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = [n for n in names if n not in METRICS_PORTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown service(s) {', '.join(unknown)} (known: {', '.join(METRICS_PORTS)})")
    return names


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"seconds must be > 0 and <= 3600, not {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a count is >= 0, not {value}")
    return value


try:  # shell-completion hints on path arguments; the completion command itself needs shtab
    import shtab as _shtab

    _FILE, _DIRECTORY = _shtab.FILE, _shtab.DIRECTORY
except ImportError:  # pragma: no cover - shtab is a dependency; without it only `bcd completion` fails
    _FILE = _DIRECTORY = None


def _path(action: argparse.Action, kind: dict | None) -> argparse.Action:
    if kind is not None:
        action.complete = kind  # type: ignore[attr-defined]
    return action


EPILOG = (
    "Every command but `up`, `completion` and `man` finds the node through <state-dir>/node.json.\n"
    "A node that is down ends in one line on stderr and exit 3 within --timeout seconds; --debug\n"
    "shows the traceback of any failure. --json shapes: README.md, section \"JSON output\".\n\n"
    + exit_codes_text()
)

#: the read commands: each prints JSON with --json (the shapes in README.md, "JSON output").
READ_COMMANDS = ("ping", "inventory", "key", "status", "doctor", "bus", "releases", "gpu", "events", "cdi")


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line like every other failure (README, "The `bcd` command"): what is
    wrong and where help is, exit 2; argparse printed its whole usage block first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="bcd",
        description="bcd: node agent for GPU hosts",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"bcd {VERSION}", help="print bcd's version and exit")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of a failure instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands", help="what to do (`bcd COMMAND --help`)")
    state_default = Path(_env_default("BCD_STATE_DIR", "state"))
    # --debug after the subcommand too (`bcd status --debug`); SUPPRESS keeps the global one's value otherwise
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the Python traceback of a failure instead of one line")

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, parents=[common])

    up = command("up", "start a whole node: embedded nats-server, every service, a reference control plane")
    _path(up.add_argument("--state-dir", type=Path, default=state_default, help="everything the node keeps (default ./state) [env BCD_STATE_DIR]"), _DIRECTORY)
    _path(up.add_argument("--fake-host", type=Path, default=_default_fake_host(), help="fake host description file [env BCD_FAKE_HOST]"), _FILE)
    up.add_argument("--real-host", action="store_true", help="use NVML and the real sysfs instead of a fake host")
    up.add_argument("--node-id", default=_env_default("BCD_NODE_ID", "node-1"), help="this node's id (default node-1) [env BCD_NODE_ID]")
    up.add_argument("--port", type=int, default=int(_env_default("BCD_BUS_PORT", "4222")), help="node-bus client port (default 4222) [env BCD_BUS_PORT]")
    up.add_argument(
        "--http-port", type=int, default=int(_env_default("BCD_BUS_HTTP_PORT", "8222")), help="node-bus monitoring port (default 8222; 0: off) [env BCD_BUS_HTTP_PORT]"
    )
    up.add_argument("--any-ports", action="store_true", help="pick free ports for the bus, monitoring and metrics")
    up.add_argument(
        "--any-ports-if-taken",
        action="store_true",
        help="use the fixed ports, but pick free ones as --any-ports does (and say so) when one is taken; `make run` passes it",
    )
    up.add_argument(
        "--services",
        type=_service_list,
        default=list(NODE_SERVICES),
        metavar="NAME[,NAME...]",
        help=f"the services to run, comma-separated (default all: {', '.join(NODE_SERVICES)})",
    )
    up.add_argument(
        "--outbox-max-bytes",
        type=int,
        default=int(_env_default("BCD_OUTBOX_MAX_BYTES", str(DEFAULT_OUTBOX_MAX_BYTES))),
        help="bytes the outbox keeps while upstream is away (default 256 MiB; smaller where the bus's store has no room) [env BCD_OUTBOX_MAX_BYTES]",
    )
    up.add_argument("--upstream", default=_env_default("BCD_UPSTREAM_URL", ""), help="join this upstream NATS instead of the embedded control plane [env BCD_UPSTREAM_URL]")
    _path(up.add_argument("--cp-key", default=_env_default("BCD_CP_KEY", ""), help="control-plane public key file(s), comma-separated (with --upstream) [env BCD_CP_KEY]"), _FILE)
    up.add_argument(
        "--accept-unsigned-specs",
        action="store_true",
        default=_env_default("BCD_ACCEPT_UNSIGNED_SPECS", "").strip().lower() in ("1", "true", "yes", "on"),
        help="LAB ONLY, with --upstream and no --cp-key: the node takes unsigned specs (said at start and by `bcd doctor`) [env BCD_ACCEPT_UNSIGNED_SPECS=1]",
    )
    up.add_argument("--upstream-user", help="upstream NATS user (with --upstream; default node-<node-id>)")
    _path(up.add_argument("--upstream-password-file", type=Path, help="file holding the upstream user's password (with --upstream)"), _FILE)
    _path(up.add_argument("--upstream-token-file", type=Path, help="file holding an upstream token (with --upstream)"), _FILE)
    _path(up.add_argument("--upstream-nkey-file", type=Path, help="upstream nkey seed file (with --upstream)"), _FILE)
    _path(up.add_argument("--upstream-creds", type=Path, help="upstream .creds file, JWT + nkey (with --upstream)"), _FILE)
    _path(up.add_argument("--upstream-ca", type=Path, help="CA bundle the upstream's certificate must chain to: TLS on, a plain-text upstream refused (with --upstream)"), _FILE)
    _path(up.add_argument("--upstream-cert", type=Path, help="this node's client certificate, for an upstream that verifies clients (mutual TLS; with --upstream-key)"), _FILE)
    _path(up.add_argument("--upstream-key", type=Path, help="the client certificate's private key (0600; with --upstream-cert)"), _FILE)
    up.add_argument("--upstream-server-name", help="the name the upstream's certificate must carry (default: the URL's host)")
    up.add_argument(
        "--upstream-tls",
        choices=("auto", "required"),
        help="'required': TLS even with no CA file (the system trust store); default auto: TLS for tls:// or with a CA or certificate",
    )
    _path(up.add_argument("--kubeconfig", type=Path, default=os.environ.get("BCD_KUBECONFIG") or None, help="kubeconfig for kube_reaper (evictions, the node's Node) and the DRA plugin [env BCD_KUBECONFIG]"), _FILE)
    _path(
        up.add_argument(
            "--pod-resources-socket",
            type=Path,
            default=os.environ.get("BCD_POD_RESOURCES_SOCKET") or None,
            help="the kubelet's pod-resources socket [env BCD_POD_RESOURCES_SOCKET]",
        ),
        _FILE,
    )
    up.add_argument(
        "--kubelet-dir",
        type=Path,
        default=os.environ.get("BCD_KUBELET_DIR") or None,
        help="the kubelet's root directory, whose device-plugins/ the device plugin registers in (default <state>/kubelet) [env BCD_KUBELET_DIR]",
    )
    _path(up.add_argument("--apply", type=Path, help="apply this spec once the node is up, print status and events"), _FILE)
    up.add_argument("--verbose", action="store_true", help="service logs on this terminal instead of <state>/logs")
    up.add_argument("--log-level", default=_env_default("BCD_LOG_LEVEL", "INFO"), help="services' log level (default INFO) [env BCD_LOG_LEVEL]")
    up.add_argument(
        "--log-format", default=_env_default("BCD_LOG_FORMAT", "json"), choices=("json", "text"), help="this terminal's log format (default json) [env BCD_LOG_FORMAT]"
    )
    up.set_defaults(func=cmd_up)

    timeout_default = float(_env_default("BCD_TIMEOUT", str(DEFAULT_CONNECT_TIMEOUT)))

    def client(name: str, func, help_: str) -> argparse.ArgumentParser:  # noqa: ANN001
        p = command(name, help_)
        _path(
            p.add_argument("--state-dir", type=Path, default=state_default, help="the node's state dir, where `bcd up` wrote node.json (default ./state) [env BCD_STATE_DIR]"),
            _DIRECTORY,
        )
        p.add_argument("--json", action="store_true", help="print JSON instead of text (shapes: README.md, \"JSON output\")")
        p.add_argument(
            "--timeout",
            type=_seconds,
            default=timeout_default,
            metavar="SECONDS",
            help=f"give up on an unreachable node bus after this long, exit 3 (default {timeout_default:g}) [env BCD_TIMEOUT]",
        )
        p.set_defaults(func=func)
        return p

    client("ping", cmd_ping, "list every service answering $SRV.PING (exit 1: one the node runs did not answer)").add_argument("--wait", type=float, default=0.5, help="seconds to wait for $SRV.PING replies (default 0.5)")
    client("inventory", cmd_inventory, "show the node's inventory")
    client("key", cmd_key, "show the node's public key and key_id")
    client("status", cmd_status, "GPUs and who holds them, the devices section, the outbox; exit 1 when unhealthy")
    client("doctor", cmd_doctor, "check the node and say what is wrong; exit 1 on a failed check")
    client("bus", cmd_bus, "the node bus: endpoints' requests, errors and times ($SRV.STATS), outbox, KV, connections; exit 1 when unhealthy").add_argument(
        "--wait", type=float, default=1.0, help="seconds to wait for $SRV.STATS replies (default 1)"
    )
    ap = client("apply", cmd_apply, "sign a NodeSpec JSON file and put it through the control plane")
    _path(ap.add_argument("spec", type=Path, help="the NodeSpec JSON file (generation filled in)"), _FILE)
    from .applycmd import add_arguments as apply_arguments

    apply_arguments(ap)
    from .applycmd import add_rebase_arguments

    add_rebase_arguments(
        client(
            "rebase",
            cmd_rebase,
            "the node's control plane puts its spec again at a generation it can count on from, for a node above 2^53 - 1; holds kept",
        )
    )
    rel = client("releases", cmd_releases, "pending Kubernetes releases; --clear-unreadable removes the unreadable marker")
    rel.add_argument(
        "--clear-unreadable", action="store_true", help="remove the unreadable-releases marker (you assert no pod holds a GPU of an allocation the node does not know)"
    )
    rel.add_argument(
        "--free",
        nargs="+",
        metavar="ALLOCATION",
        default=[],
        help="report these pending releases now: you assert no pod holds their devices (a host with no kubelet, whose releases never end)",
    )
    gpu = client("gpu", cmd_gpu, "PhysicalGPU status and health of every card (or one); exclude, include, reclaim, reset, diagnose or recheck one card")
    gpu.add_argument(
        "action",
        choices=("list", "exclude", "include", "reclaim", "reset", "diag", "mig-layout", "recheck"),
        metavar="ACTION",
        help="list, exclude, include, reclaim, reset, diag, mig-layout or recheck: list the cards (one with ADDRESS), or act on the card at ADDRESS; "
        "reset: a PCI function reset; diag: DCGM's diagnostic (--level); "
        "mig-layout: the card's desired MIG layout (LAYOUT), applied once nothing holds the card; "
        "recheck: check the card's health now; on a card nothing holds a clean check clears a fatal XID, ECC or lost-card fault, "
        "a held card keeps them until it is released and reset (exit 1 while it stays unhealthy)",
    )
    gpu.add_argument("pci", nargs="?", metavar="ADDRESS", help="the card's PCI address, like 0000:3b:00.0 (needed by every action but list)")
    gpu.add_argument("layout", nargs="?", metavar="LAYOUT", help="mig-layout: all-disabled, or GPU instance profiles comma-separated (like 1g.18gb,1g.18gb,3g.71gb)")
    gpu.add_argument("--level", type=int, default=None, choices=range(1, 5), metavar="N", help="diag: 1 quick, 2 medium, 3 long, 4 extended (from 2: refused on a held card)")
    gpu.add_argument("--wait", type=float, default=600.0, metavar="SECONDS", help="reset, diag, mig-layout: how long to follow it (default 600)")
    gpu.add_argument("--no-wait", action="store_true", help="reset, diag, mig-layout: return once it started (or was set)")
    ev = client("events", cmd_events, "the control plane's verified event log: the last events, then follow")
    ev.add_argument("--no-follow", action="store_true", help="print the past events and exit instead of following")
    which = ev.add_mutually_exclusive_group()
    which.add_argument("--last", type=_count, default=20, metavar="N", help="show the last N past events first (default 20)")
    which.add_argument("--all", action="store_true", help="show every past event first, not only the last --last")
    cdi = client("cdi", cmd_cdi, "the CDI devices bcd created (from the hold files; works with the node stopped) and the runtime flags that use them")
    cdi.add_argument("action", choices=("list",), help="list: every hold's CDI device names, the atoms behind them, docker/podman/containerd usage")
    cdi.add_argument("allocations", nargs="*", metavar="ALLOCATION", help="only these allocations' holds (default: all)")
    cdi.add_argument("--cdi-dir", type=Path, default=None, help="read this CDI dir instead of the one in <state-dir>/node.json")
    cdi.add_argument(
        "--cdi-consumer-dir", type=Path, default=None, help="read the hold specs' consumer copies in this dir instead of the one in <state-dir>/node.json"
    )
    from .fleet import add_parser as fleet_parser

    fleet_parser(sub, [common])
    from .compose import add_parser as compose_parser

    compose_parser(sub, [common])
    comp = command("completion", "print a shell completion script, e.g. `source <(bcd completion bash)`")
    comp.add_argument("shell", choices=("bash", "zsh", "tcsh"), help="the shell to complete for")
    comp.set_defaults(func=cmd_completion)
    man = command("man", "print the bcd(1) man page (roff; `bcd man | man -l -`), or write it with -o")
    _path(man.add_argument("-o", "--output", type=Path, metavar="FILE", help="write the page to FILE instead of stdout"), _FILE)
    man.set_defaults(func=cmd_man)
    return parser


def quiet_library_logs(debug: bool) -> None:
    """A command says what is wrong in its own words (one line, exits.py). The shared code it runs
    logs as a service would ("not a bcd hold; leaving it alone"), and Python's last-resort handler
    printed those lines bare, without the file they were about: they are for --debug only
    (`bcd up` configures the services' logging itself)."""
    if debug:
        logs.configure("bcd", "DEBUG", "text")
    else:
        logging.getLogger().addHandler(logging.NullHandler())


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    quiet_library_logs(bool(getattr(args, "debug", False)))
    if getattr(args, "real_host", False):
        args.fake_host = None
    if getattr(args, "timeout", None) is not None:
        set_connect_timeout(args.timeout)
    sys.exit(run_command(args.func, args, debug=args.debug))


if __name__ == "__main__":
    main()
