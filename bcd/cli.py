"""The `bcd` command: `up` starts a whole node; the rest look at a running one.

`bcd up` keeps everything under one state directory (bus config and
credentials, data dir, run dir, CDI dir), so it runs as an ordinary user on a
fake host and never touches the real /etc, /run or /sys. It writes
`<state>/node.json` so the other commands find the bus without flags.
"""

from __future__ import annotations

import argparse
import base64
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import nats

from shared import logs
from shared.runtime import METRICS_PORTS, call
from shared.schemas import INVENTORY_CODEC, Empty, Inventory, SignerKey
from shared.subjects import OPERATOR_USER, NodeSubjects, inbox_prefix

from .nodebus import NatsServer, prepare_node_bus
from .supervisor import ProcessSpec, Supervisor, die_with_parent, service_argv

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FAKE_HOST = REPO_ROOT / "examples" / "hosts" / "h200x8.json"

#: the services `bcd up` runs today, in start order.
NODE_SERVICES: tuple[str, ...] = ("signer", "inventory", "converger")


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """`<state>/node.json`: where a running node's bus is."""

    node_id: str
    nats_url: str
    creds_dir: str
    monitor_url: str = ""
    metrics: dict[str, str] = {}
    supervisor_pid: int = 0


def _env_default(name: str, default: Any) -> Any:
    value = os.environ.get(name)
    return value if value else default


def _default_fake_host() -> Path | None:
    env = os.environ.get("BCD_FAKE_HOST")
    if env:
        return Path(env)
    return DEFAULT_FAKE_HOST if DEFAULT_FAKE_HOST.exists() else None


def _layout(state: Path) -> dict[str, Path]:
    return {
        "bus": state / "bus",
        "data": state / "data",
        "run": state / "run",
        "cdi": state / "cdi",
    }


# ------------------------------------------------------------------------------ up


def cmd_up(args: argparse.Namespace) -> int:
    logs.configure("supervisor", args.log_level, args.log_format)
    log = logs.get_logger("bcd.up")
    state: Path = args.state_dir.resolve()
    paths = _layout(state)
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
    fake_host: Path | None = args.fake_host.resolve() if args.fake_host else None
    if fake_host is not None and not fake_host.is_file():
        print(f"bcd up: fake host file {fake_host} does not exist", file=sys.stderr)
        return 2
    conf, creds = prepare_node_bus(
        paths["bus"],
        paths["data"] / "nats",
        args.node_id,
        port=-1 if args.any_ports else args.port,
        http_port=-1 if args.any_ports else args.http_port,
    )
    bus = NatsServer(conf, paths["bus"] / "nats-server.log")
    try:
        bus.start(preexec_fn=die_with_parent)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"bcd up: the node bus did not start: {exc}", file=sys.stderr)
        return 1
    common = {
        "BCD_NODE_ID": args.node_id,
        "BCD_NATS_URL": bus.url,
        "BCD_DATA_DIR": str(paths["data"]),
        "BCD_RUN_DIR": str(paths["run"]),
        "BCD_CDI_DIR": str(paths["cdi"]),
        "BCD_LOG_LEVEL": args.log_level,
        "BCD_LOG_FORMAT": args.log_format,
        "BCD_ADAPTER": "fakehw" if fake_host else "nvidia",
    }
    if fake_host is not None:
        common["BCD_FAKE_HOST"] = str(fake_host)
    specs = []
    metrics: dict[str, str] = {}
    for name in args.services:
        port = 0 if args.any_ports else METRICS_PORTS[name]
        env = {
            **common,
            "BCD_NATS_USER": name,
            "BCD_NATS_PASSWORD_FILE": str(creds[name]),
            "BCD_METRICS_PORT": str(port),
        }
        if port:
            metrics[name] = f"http://127.0.0.1:{port}/metrics"
        specs.append(ProcessSpec(name, service_argv(f"services.{name}"), env))
    info = NodeInfo(
        node_id=args.node_id,
        nats_url=bus.url,
        creds_dir=str(creds[OPERATOR_USER].parent),
        monitor_url=f"http://127.0.0.1:{bus.http_port}" if bus.http_port else "",
        metrics=metrics,
        supervisor_pid=os.getpid(),
    )
    (state / "node.json").write_bytes(msgspec.json.format(msgspec.json.encode(info)) + b"\n")

    def banner() -> None:
        s = f"--state-dir {args.state_dir}"
        lines = [
            "",
            f"bcd node {args.node_id!r} is starting on {'fake host ' + str(fake_host) if fake_host else 'this host (NVML)'}",
            f"  node bus     {bus.url}  (config {conf}, log {bus.log_path})",
            *([f"  monitoring   {info.monitor_url}/varz  /connz  /subsz  /jsz"] if info.monitor_url else []),
            *[f"  metrics      {n:<10} {u}" for n, u in metrics.items()],
            "Look at it from another terminal:",
            f"  .venv/bin/bcd ping {s}         # every service answering $SRV.PING",
            f"  .venv/bin/bcd inventory {s}    # GPUs, MIG instances, slots and host resources",
            f"  .venv/bin/bcd key {s}          # the node's public key (the signer owns the private one)",
            "Stop with Ctrl-C.",
            "",
        ]
        print("\n".join(lines), file=sys.stderr, flush=True)

    try:
        return asyncio.run(Supervisor(bus, specs, on_ready=banner).run())
    except KeyboardInterrupt:  # Ctrl-C before the handler was installed
        return 130
    finally:
        bus.stop()
        log.debug("node bus stopped")


# ------------------------------------------------------------------------- clients


def _node_info(state: Path) -> NodeInfo:
    path = state / "node.json"
    try:
        return msgspec.json.decode(path.read_bytes(), type=NodeInfo)
    except FileNotFoundError:
        raise SystemExit(f"bcd: no node at {state} ({path} missing): start one with `bcd up --state-dir {state}`") from None


async def _connect(info: NodeInfo) -> nats.aio.client.Client:
    password = (Path(info.creds_dir) / f"{OPERATOR_USER}.password").read_text().strip()
    try:
        return await nats.connect(
            info.nats_url,
            user=OPERATOR_USER,
            password=password,
            inbox_prefix=inbox_prefix(OPERATOR_USER).encode(),
            allow_reconnect=False,
            connect_timeout=3,
            max_reconnect_attempts=0,
        )
    except Exception as exc:  # noqa: BLE001 - tell the operator, no traceback
        raise SystemExit(f"bcd: node bus {info.nats_url} unreachable: {exc}") from None


async def ping_all(nc: nats.aio.client.Client, wait: float = 0.5) -> list[dict[str, Any]]:
    """Every micro service that answers `$SRV.PING` within `wait` seconds."""
    inbox = nc.new_inbox()
    replies: list[dict[str, Any]] = []
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish("$SRV.PING", b"", reply=inbox)
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            replies.append(json.loads(msg.data))
    finally:
        await sub.unsubscribe()
    return sorted(replies, key=lambda r: r.get("name", ""))


def cmd_ping(args: argparse.Namespace) -> int:
    info = _node_info(args.state_dir)

    async def run() -> list[dict[str, Any]]:
        nc = await _connect(info)
        try:
            return await ping_all(nc, args.wait)
        finally:
            await nc.close()

    replies = asyncio.run(run())
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
        f"node {inv.node_id}  revision {inv.revision}  vendor {inv.vendor}  driver {inv.driver_version}  boot {inv.boot_id}",
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
    info = _node_info(args.state_dir)

    async def run() -> Inventory:
        nc = await _connect(info)
        try:
            return await call(nc, NodeSubjects(info.node_id).inventory_get, Empty(), INVENTORY_CODEC, timeout=5)
        finally:
            await nc.close()

    inv = asyncio.run(run())
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(inv)).decode())
    else:
        print(render_inventory(inv))
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    """The node's public key and key_id, as the signer reports them."""
    from shared.schemas import SIGNER_KEY_CODEC

    info = _node_info(args.state_dir)

    async def run() -> SignerKey:
        nc = await _connect(info)
        try:
            return await call(nc, NodeSubjects(info.node_id).signer_key, Empty(), SIGNER_KEY_CODEC)
        finally:
            await nc.close()

    key = asyncio.run(run())
    if args.json:
        print(msgspec.json.encode(key).decode())
    else:
        print(f"node {key.node_id}  key_id {key.key_id}  boot {key.boot_id}\npublic key (base64 raw Ed25519): {base64.b64encode(key.public_key).decode()}")
    return 0


# ---------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bcd", description="bcd: node agent for GPU hosts")
    sub = parser.add_subparsers(dest="command", required=True)
    state_default = Path(_env_default("BCD_STATE_DIR", "state"))

    up = sub.add_parser("up", help="start a whole node: embedded nats-server and every service")
    up.add_argument("--state-dir", type=Path, default=state_default, help="everything the node keeps [env BCD_STATE_DIR]")
    up.add_argument(
        "--fake-host",
        type=Path,
        default=_default_fake_host(),
        help="fake host description file [env BCD_FAKE_HOST]",
    )
    up.add_argument("--real-host", action="store_true", help="use NVML and the real sysfs instead of a fake host")
    up.add_argument("--node-id", default=_env_default("BCD_NODE_ID", "node-1"), help="[env BCD_NODE_ID]")
    up.add_argument("--port", type=int, default=int(_env_default("BCD_BUS_PORT", 4222)), help="node-bus client port")
    up.add_argument("--http-port", type=int, default=int(_env_default("BCD_BUS_HTTP_PORT", 8222)), help="node-bus monitoring port (0: off)")
    up.add_argument("--any-ports", action="store_true", help="pick free ports for the bus, monitoring and metrics")
    up.add_argument("--services", type=lambda s: [x for x in s.split(",") if x], default=list(NODE_SERVICES))
    up.add_argument("--log-level", default=_env_default("BCD_LOG_LEVEL", "INFO"))
    up.add_argument("--log-format", default=_env_default("BCD_LOG_FORMAT", "json"), choices=("json", "text"))
    up.set_defaults(func=cmd_up)

    for name, func, help_ in (
        ("ping", cmd_ping, "list every service answering $SRV.PING"),
        ("inventory", cmd_inventory, "show the node's inventory"),
        ("key", cmd_key, "show the node's public key and key_id"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--state-dir", type=Path, default=state_default)
        p.add_argument("--json", action="store_true")
        p.add_argument("--wait", type=float, default=0.5, help=argparse.SUPPRESS)
        p.set_defaults(func=func)
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
