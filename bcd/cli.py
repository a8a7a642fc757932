"""The `bcd` command: `up` starts a whole node; the rest look at or act on a running one.

Every command takes `--state-dir` (env BCD_STATE_DIR, default ./state) and
finds the node through `<state>/node.json`; none needs other flags.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
from pathlib import Path

import msgspec

from shared.runtime import METRICS_PORTS, ServiceCallError, call
from shared.schemas import (
    GPU_REPLY_CODEC,
    INVENTORY_CODEC,
    SIGNER_KEY_CODEC,
    Empty,
    GpuReply,
    GpuRequest,
    Inventory,
    SignerKey,
)
from shared.schemas.codec import BoundedDecoder
from shared.subjects import NodeSubjects

from .client import NodeUnreachable, connect, node_info, ping_all
from .up import NODE_SERVICES, cmd_up

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
    try:
        return asyncio.run(coro)
    except NodeUnreachable as exc:
        raise SystemExit(f"bcd: {exc}") from None
    except ServiceCallError as exc:
        raise SystemExit(f"bcd: the node refused: {exc}") from None


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
    if args.json:
        print(json.dumps(replies, indent=2))
        return 0 if replies else 1
    print(f"{'SERVICE':<16} {'VERSION':<8} {'NODE':<12} {'METRICS':<24} ID")
    for r in replies:
        md = r.get("metadata") or {}
        print(f"{r['name']:<16} {r['version']:<8} {md.get('node_id', ''):<12} {md.get('metrics', ''):<24} {r['id']}")
    return 0 if replies else 1


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
            return await call(nc, NodeSubjects(info.node_id).inventory_get, Empty(), INVENTORY_CODEC, timeout=5)
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
            return await call(nc, NodeSubjects(info.node_id).signer_key, Empty(), SIGNER_KEY_CODEC)
        finally:
            await nc.close()

    key = _run(run())
    if args.json:
        print(msgspec.json.encode(key).decode())
    else:
        print(f"node {key.node_id}  key_id {key.key_id}  boot {key.boot_id}")
        print(f"public key (base64 raw Ed25519): {base64.b64encode(key.public_key).decode()}")
    return 0


def cmd_gpu(args: argparse.Namespace) -> int:
    """`bcd gpu list`, or exclude / include / reclaim one card by its PCI address (through the inventory)."""
    from .status import render_gpus

    info = node_info(args.state_dir)
    subjects = NodeSubjects(info.node_id)

    if args.action == "list":

        async def listing() -> Inventory:
            nc = await connect(info)
            try:
                return await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=5)
            finally:
                await nc.close()

        inv = _run(listing())
        if args.json:
            print(msgspec.json.format(msgspec.json.encode([{"pci_address": g.pci_address, **msgspec.to_builtins(g.status)} for g in inv.gpus])).decode())
        else:
            print(render_gpus(inv))
        return 0

    if not args.pci:
        raise SystemExit(f"bcd gpu {args.action}: a PCI address is needed (like 0000:3b:00.0)")

    async def act() -> GpuReply:
        nc = await connect(info)
        try:
            return await call(nc, subjects.inventory_gpu, GpuRequest(action=args.action, pci=args.pci), GPU_REPLY_CODEC, timeout=10)
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


def cmd_status(args: argparse.Namespace) -> int:
    from .status import gather, problems, render_status

    info = node_info(args.state_dir)
    report = _run(gather(info))
    if args.json:
        print(
            json.dumps(
                {
                    "node_id": report.node_id,
                    "reachable": report.reachable,
                    "services": sorted(report.services),
                    "converger": msgspec.to_builtins(report.converger),
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
    print(json.dumps(bus_json(report), indent=2) if args.json else render_bus(report))
    return 1 if bus_problems(report) else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .status import doctor_checks, gather

    info = node_info(args.state_dir)
    report = _run(gather(info))
    worst = 0
    for level, name, message in doctor_checks(report):
        mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}[level]
        print(f"{mark}  {name:<16} {message}")
        worst = max(worst, {"ok": 0, "warn": 0, "fail": 1}[level])
    return worst


def cmd_apply(args: argparse.Namespace) -> int:
    from .controlplane import apply_spec_file

    try:
        generation = _run(apply_spec_file(args.state_dir.resolve(), args.spec))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bcd apply: {exc}") from None
    print(f"applied {args.spec} as generation {generation}")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from .events import follow_events

    info = node_info(args.state_dir)
    if not info.controlplane_dir:
        raise SystemExit("bcd events: this node joined an existing upstream; its control plane keeps the event log")
    try:
        asyncio.run(follow_events(Path(info.controlplane_dir) / "events.jsonl", follow=not args.no_follow, last=args.last))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_releases(args: argparse.Namespace) -> int:
    """Pending Kubernetes releases; `--clear-unreadable` removes the unreadable-releases marker."""
    from services.converger.releases import RELEASES_FILE, RELEASES_MAX_BYTES, UNREADABLE_MARKER, ReleasesFile
    from shared.fsutil import read_regular

    info = node_info(args.state_dir)
    data = Path(info.data_dir)
    marker = data / UNREADABLE_MARKER
    if args.clear_unreadable:
        if not marker.exists():
            print(f"no marker at {marker}: nothing to clear")
            return 0
        print(f"removing {marker}: you assert that no pod holds a GPU of an allocation this node does not know")
        marker.unlink()

        async def kick() -> None:
            nc = await connect(info)
            try:
                await nc.request(NodeSubjects(info.node_id).converger_pass, b"", timeout=3)
            finally:
                await nc.close()

        _run(kick())
        return 0
    try:
        pending = BoundedDecoder(ReleasesFile, max_bytes=RELEASES_MAX_BYTES, what=RELEASES_FILE).decode(read_regular(data / RELEASES_FILE, max_bytes=RELEASES_MAX_BYTES)).releases
    except FileNotFoundError:
        pending = {}
    except OSError as exc:
        print(f"{data / RELEASES_FILE} is unreadable ({exc.strerror or exc}); the converger sets it aside at its next pass")
        return 1
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        print(f"{data / RELEASES_FILE} is unreadable ({exc}); the converger sets it aside at its next pass")
        return 1
    if marker.exists():
        print(f"UNREADABLE releases marker present ({marker}): every GPU counts as claimed. `bcd releases --clear-unreadable` once you are sure.")
    if not pending:
        print("no pending Kubernetes releases")
    for rel in pending.values():
        print(f"{rel.allocation_id} ({rel.reservation_id}) gen {rel.generation} since {rel.since.isoformat(timespec='seconds')}: {', '.join(rel.devices)}")
    return 1 if marker.exists() else 0


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bcd", description="bcd: node agent for GPU hosts")
    sub = parser.add_subparsers(dest="command", required=True)
    state_default = Path(_env_default("BCD_STATE_DIR", "state"))

    up = sub.add_parser("up", help="start a whole node: embedded nats-server, every service, a reference control plane")
    up.add_argument("--state-dir", type=Path, default=state_default, help="everything the node keeps [env BCD_STATE_DIR]")
    up.add_argument("--fake-host", type=Path, default=_default_fake_host(), help="fake host description file [env BCD_FAKE_HOST]")
    up.add_argument("--real-host", action="store_true", help="use NVML and the real sysfs instead of a fake host")
    up.add_argument("--node-id", default=_env_default("BCD_NODE_ID", "node-1"), help="[env BCD_NODE_ID]")
    up.add_argument("--port", type=int, default=int(_env_default("BCD_BUS_PORT", "4222")), help="node-bus client port")
    up.add_argument("--http-port", type=int, default=int(_env_default("BCD_BUS_HTTP_PORT", "8222")), help="node-bus monitoring port (0: off)")
    up.add_argument("--any-ports", action="store_true", help="pick free ports for the bus, monitoring and metrics")
    up.add_argument("--services", type=lambda s: [x for x in s.split(",") if x], default=list(NODE_SERVICES))
    up.add_argument("--upstream", default=_env_default("BCD_UPSTREAM_URL", ""), help="join this upstream NATS instead of the embedded control plane")
    up.add_argument("--cp-key", default=_env_default("BCD_CP_KEY", ""), help="control-plane public key file(s), comma-separated (with --upstream)")
    up.add_argument("--upstream-user")
    up.add_argument("--upstream-password-file", type=Path)
    up.add_argument("--upstream-token-file", type=Path)
    up.add_argument("--upstream-nkey-file", type=Path)
    up.add_argument("--upstream-creds", type=Path)
    up.add_argument("--kubeconfig", type=Path, default=os.environ.get("BCD_KUBECONFIG") or None, help="kubeconfig for kube_reaper's evictions")
    up.add_argument("--pod-resources-socket", type=Path, default=os.environ.get("BCD_POD_RESOURCES_SOCKET") or None, help="the kubelet's pod-resources socket")
    up.add_argument("--apply", type=Path, help="apply this spec once the node is up, print status and events")
    up.add_argument("--verbose", action="store_true", help="service logs on this terminal instead of <state>/logs")
    up.add_argument("--log-level", default=_env_default("BCD_LOG_LEVEL", "INFO"))
    up.add_argument("--log-format", default=_env_default("BCD_LOG_FORMAT", "json"), choices=("json", "text"))
    up.set_defaults(func=cmd_up)

    def client(name: str, func, help_: str) -> argparse.ArgumentParser:  # noqa: ANN001
        p = sub.add_parser(name, help=help_)
        p.add_argument("--state-dir", type=Path, default=state_default)
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
        return p

    client("ping", cmd_ping, "list every service answering $SRV.PING").add_argument("--wait", type=float, default=0.5, help=argparse.SUPPRESS)
    client("inventory", cmd_inventory, "show the node's inventory")
    client("key", cmd_key, "show the node's public key and key_id")
    client("status", cmd_status, "GPUs and who holds them, the devices section, the outbox; exit 1 when unhealthy")
    client("doctor", cmd_doctor, "check the node and say what is wrong")
    client("bus", cmd_bus, "the node bus: endpoints' requests, errors and times ($SRV.STATS), outbox, KV, connections; exit 1 when unhealthy").add_argument(
        "--wait", type=float, default=1.0, help="seconds to wait for $SRV.STATS replies"
    )
    ap = client("apply", cmd_apply, "sign a NodeSpec JSON file and put it through the control plane")
    ap.add_argument("spec", type=Path)
    rel = client("releases", cmd_releases, "pending Kubernetes releases; --clear-unreadable removes the unreadable marker")
    rel.add_argument("--clear-unreadable", action="store_true")
    gpu = client("gpu", cmd_gpu, "PhysicalGPU status of every card; exclude, include or reclaim one card")
    gpu.add_argument("action", choices=("list", "exclude", "include", "reclaim"))
    gpu.add_argument("pci", nargs="?", help="canonical PCI address, like 0000:3b:00.0")
    ev = client("events", cmd_events, "follow the control plane's verified event log")
    ev.add_argument("--no-follow", action="store_true")
    ev.add_argument("--last", type=int, default=50, help="show this many past events first")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "real_host", False):
        args.fake_host = None
    for name in getattr(args, "services", []):
        if name not in METRICS_PORTS:
            raise SystemExit(f"bcd up: unknown service {name!r}")
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()
