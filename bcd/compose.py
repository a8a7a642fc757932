"""`bcd compose init DIR`: everything deploy/compose/compose.yaml mounts, for one node.

The compose node runs the node bus and one container per service from the image
`make images` builds, each as its own Unix user (the image's fixed ids, below)
with its own NATS user. This writes, under DIR:

- `bus/nats.conf` (the node bus: listens on the compose network, JetStream store
  in the container's `/data`) and one password per NATS user in `bus/creds/`,
  each file owned by the one container user that reads it, mode 0400;
- `data/<service>/`, the state each service keeps, owned by that service alone;
- `cdi/` and `run/`, the hold directories, root's and writable by root alone: the
  root helper writes the holds for the converger (which only reads them), and this
  writes the fake host's vendor spec, `cdi/nvidia.json`, from `host/host.json` with
  the bytes the inventory's fakehw adapter would write (so it finds it in place and
  writes nothing: its container mounts `cdi/` read-only);
- `host/host.json`, the fake host, in `host/`, both vfio_switcher's and writable by
  it alone: its fake kernel edits the file (atomically: a new file in that
  directory, and a lock file beside it); every other container reads it;
- with the `upstream` profile's parts: `upstream/nats.conf` (a separate upstream
  nats-server with the control plane's user and this node's, each limited to its
  subjects), `controlplane/` (its signing key, owned by its user) and `bus/cp.pub`
  (0644: its public half, which the bridge and the converger both verify specs with);
- `pki/`, the upstream's mutual TLS: a private CA (`pki/ca/`, root's alone) and one
  directory per reader, `pki/<reader>/` holding `ca.crt`, `tls.crt` and `tls.key` (the
  key 0400, its reader's): the upstream server's certificate (for `upstream`, the name
  the containers dial, and 127.0.0.1, its published port) and a client certificate for
  this node's bridge and for the control plane. Each container mounts its directory,
  not the files, so a renewed certificate written beside them (atomically, a new
  inode) is what it sees; the bridge and the control plane take it at their next
  reconnect;
- `.env`, the variables compose.yaml reads, and `node.json`, so `bcd status
  --state-dir DIR` on the host finds the bus on its published loopback port.

Kept across runs: passwords, keys and state are reused when present, so `init`
again (a new image, `make compose-up`) changes no credential; a certificate is
issued again only when it is missing, unusable, within RENEW_BEFORE of its end, or
its CA was made anew.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import stat
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import msgspec

from shared.fsutil import atomic_write, read_regular
from shared.host import HOST_FILE_MAX_BYTES
from shared.subjects import BUS_ADMIN_USER, CONTROLPLANE_USER, OPERATOR_USER, NodeSubjects, upstream_node_user
from shared.vendorcdi import VENDOR_CDI_FILE, vendor_spec_bytes

from .client import NodeInfo, write_node_info
from .nodebus import BusConfig, ensure_passwords, node_bus_accounts, server_tls_block, upstream_accounts, upstream_password_users, write_private
from .roster import HELPER, NODE_SERVICES

#: the image's users (deploy/compose/Dockerfile), all in group bcd.
GROUP_ID = 10000
UIDS: dict[str, int] = {
    "nats": 10001,
    "signer": 10002,
    "inventory": 10003,
    "converger": 10004,
    "gateway_bridge": 10005,
    "kube_reaper": 10006,
    "vfio_switcher": 10007,
    "controlplane": 10008,
    "device_plugin": 10009,
    "dra_plugin": 10010,
}
#: a container each (the root helper, roster.HELPER, is the one container that runs as
#: uid 0, with no capability: it writes the hold files the converger asks for over the bus)
SERVICES = NODE_SERVICES
#: the services that keep state under /var/lib/bcd/<name>.
STATEFUL = ("signer", "inventory", "converger", "dra_plugin")
EXAMPLE_HOST = Path(__file__).resolve().parent.parent / "examples" / "hosts" / "h200x8.json"
#: where the containers see what this writes (compose.yaml mounts DIR's parts there).
IN_CONTAINER_STORE = "/data"
#: where a container sees its pki/<reader>/ directory (compose.yaml)
IN_CONTAINER_TLS = "/etc/bcd/tls"
#: the name the containers dial the upstream by (its compose service), on its certificate
UPSTREAM_HOST = "upstream"
#: a certificate this close to its end is issued again by `init`
RENEW_BEFORE = timedelta(days=30)


#: a value every Compose reads the same from an env file when written bare
_ENV_PLAIN = re.compile(r"[A-Za-z0-9_./:@+,-]*")
#: the variables holding host paths compose.yaml mounts with the short syntax (SRC:DST:MODE)
_ENV_PATHS = ("BCD_DIR", "BCD_KUBELET_DIR")


def env_line(key: str, value: str) -> str:
    r"""One `KEY=VALUE` line of `.env` that Compose v1 (docker-compose 1.29, python-dotenv)
    and v2 (compose-go's dotenv) both read back as exactly VALUE; ValueError for a value
    no line can carry to both.

    A bare value is read differently as soon as it holds a `$`: v2 expands `$VAR` in a
    bare or double-quoted value, v1 leaves it (a DIR under `/tmp/a$HOME` was mounted
    from `/tmp/a/root` by v2); and both end a bare value at ` #`. So anything but plain
    characters is single-quoted, which v2 never expands; a `'` inside is written `\'`,
    which both read as `'`. What is still read two ways is refused: `${` (v1 expands it
    even single-quoted), `\\` and `\'` (v1 unescapes them, v2 keeps `\\`), a trailing
    backslash (it would escape the closing quote), and line breaks.
    """
    if _ENV_PLAIN.fullmatch(value):
        return f"{key}={value}\n"
    bad = [why for why, hit in (
        ("a line break", "\n" in value or "\r" in value or "\0" in value),
        ("'${'", "${" in value),
        ("a backslash before a backslash or a quote", "\\\\" in value or "\\'" in value),
        ("a trailing backslash", value.endswith("\\")),
    ) if hit]
    if bad:
        raise ValueError(f"{key}={value!r}: Compose v1 and v2 would read it differently from .env ({', '.join(bad)})")
    quoted = value.replace("'", "\\'")
    return f"{key}='{quoted}'\n"


def env_file_text(env: dict[str, str]) -> str:
    """`.env` for compose.yaml: one env_line per variable; ValueError names what cannot be written."""
    for key in _ENV_PATHS:
        # the short volume syntax splits at ':' in both versions: such a path is never mountable
        if key in env and ":" in env[key]:
            raise ValueError(f"{key}={env[key]!r}: compose.yaml mounts it as SRC:DST, so it cannot contain ':'")
    return "".join(env_line(k, v) for k, v in env.items())


def _own(path: Path, uid: int, mode: int, gid: int = GROUP_ID) -> None:
    os.chown(path, uid, gid)
    os.chmod(path, mode)


def _own_regular(path: Path, uid: int, mode: int, gid: int = GROUP_ID) -> None:
    """`_own` of a regular file in a directory another user writes: through an fd opened without
    following a link (a link or anything but a regular file there is refused, never followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror} (a link there is not followed: remove it and run init again)") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file: remove it and run init again")
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _dir(path: Path, uid: int, mode: int, gid: int = GROUP_ID) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _own(path, uid, mode, gid)
    return path


def init(directory: Path, node_id: str, fake_host: Path, *, bus_port: int, http_port: int, upstream_port: int) -> Path:
    """Write DIR (see the module docstring); returns the node.json path."""
    NodeSubjects(node_id)  # a node id the bus subjects accept, or ValueError
    d = directory.resolve()
    node_user = upstream_node_user(node_id)
    env = {
        "BCD_NODE_ID": node_id,
        "BCD_DIR": str(d),
        # the device plugin's kubelet dir: this stand-in, or a worker's /var/lib/kubelet
        "BCD_KUBELET_DIR": os.environ.get("BCD_KUBELET_DIR") or str(d / "kubelet"),
        "BCD_BUS_PORT": str(bus_port),
        "BCD_BUS_HTTP_PORT": str(http_port),
        "BCD_UPSTREAM_PORT": str(upstream_port),
        "BCD_NODE_UPSTREAM_USER": node_user,
        "BCD_IMAGE": os.environ.get("BCD_IMAGE", "bcd:latest"),
    }
    # before anything is written: a DIR (or image, kubelet dir) .env cannot carry is refused
    env_text = env_file_text(env)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    bus = _dir(d / "bus", 0, 0o755, 0)
    creds_dir = _dir(bus / "creds", 0, 0o755, 0)
    users = [*SERVICES, HELPER, OPERATOR_USER, BUS_ADMIN_USER, CONTROLPLANE_USER, node_user]
    creds = ensure_passwords(creds_dir, users)
    passwords = {u: p.read_text().strip() for u, p in creds.items()}
    # the bus setup (its `bus-setup` container) runs as the bus's own uid: no service's
    readers = {**{s: UIDS[s] for s in SERVICES}, CONTROLPLANE_USER: UIDS["controlplane"], node_user: UIDS["gateway_bridge"], BUS_ADMIN_USER: UIDS["nats"]}
    for user, path in creds.items():
        _own(path, readers.get(user, 0), 0o400, GROUP_ID if user in readers else 0)

    node_cfg = BusConfig(
        store_dir=Path(IN_CONTAINER_STORE),
        host="0.0.0.0",  # noqa: S104 - the compose network; the host publishes it on loopback only
        port=4222,
        http_port=8222,
        accounts=node_bus_accounts(node_id, {u: passwords[u] for u in (*SERVICES, HELPER, OPERATOR_USER, BUS_ADMIN_USER)}),
    )
    conf = bus / "nats.conf"
    write_private(conf, node_cfg.render())
    _own(conf, UIDS["nats"], 0o400)

    _ensure_tls(d, node_id, node_user)
    up = _dir(d / "upstream", 0, 0o755, 0)
    up_cfg = BusConfig(
        store_dir=Path(IN_CONTAINER_STORE),
        host="0.0.0.0",  # noqa: S104 - the compose network
        port=4222,
        server_name="bcd-upstream",
        accounts=upstream_accounts([node_id], upstream_password_users([node_id], passwords)),
        tls=server_tls_block(f"{IN_CONTAINER_TLS}/tls.crt", f"{IN_CONTAINER_TLS}/tls.key", f"{IN_CONTAINER_TLS}/ca.crt"),
    )
    up_conf = up / "nats.conf"
    write_private(up_conf, up_cfg.render())
    _own(up_conf, UIDS["nats"], 0o400)

    data = _dir(d / "data", 0, 0o755, 0)
    _dir(data / "nats", UIDS["nats"], 0o700)
    _dir(data / "upstream", UIDS["nats"], 0o700)
    for svc in STATEFUL:
        # what an earlier run left in it is the service's too
        for p in [_dir(data / svc, UIDS[svc], 0o700), *(data / svc).rglob("*")]:
            os.chown(p, UIDS[svc], GROUP_ID, follow_symlinks=False)
    _dir(d / "spec", 0, 0o755, 0)  # specs to apply, read by the control plane's container
    # the hold directories are root's and no one else writes them: the helper writes the
    # holds, the converger and the device plugin only read them (issue 40: no group write)
    cdi = _dir(d / "cdi", 0, 0o2755)
    run = _dir(d / "run", 0, 0o2755)
    # the MPS control daemons' directories (DRA claims shared through MPS): the inventory's
    _dir(run / "mps", UIDS["inventory"], 0o755)
    # a stand-in kubelet dir: the device plugin makes its sockets in device-plugins/
    # (a worker mounts the kubelet's own /var/lib/kubelet instead: docs/install.md)
    kubelet = _dir(d / "kubelet", 0, 0o755, 0)
    _dir(kubelet / "device-plugins", UIDS["device_plugin"], 0o750)
    # the DRA plugin's registration socket and its own socket directory
    _dir(kubelet / "plugins_registry", UIDS["dra_plugin"], 0o750)
    _dir(_dir(kubelet / "plugins", 0, 0o755, 0) / "gpu.bcd.dev", UIDS["dra_plugin"], 0o750)
    # the fake host is the fake kernel's, vfio_switcher's (it rewrites host.json when it switches
    # a card): its directory and file are that one user's to write, everyone else's to read
    host_dir = _dir(d / "host", UIDS["vfio_switcher"], 0o755)
    host_file = host_dir / "host.json"
    # that user may have put anything at the name: nothing there is followed or written through
    if not os.path.lexists(host_file):
        atomic_write(host_file, fake_host.read_bytes(), 0o644)
    _own_regular(host_file, UIDS["vfio_switcher"], 0o644)
    _write_vendor_spec(host_file, cdi)

    from controlplane.keys import load_or_create_cp_key

    cp = d / "controlplane"
    pub = cp / "cp.pub"
    # made once, then the control plane's own: it refuses a key another uid owns, so
    # an init again leaves it (and what the control plane keeps beside it) alone
    if not (cp / "cp.key").exists() or not pub.exists():
        load_or_create_cp_key(cp)
        for p in [cp, *cp.iterdir()]:
            os.chown(p, UIDS["controlplane"], GROUP_ID, follow_symlinks=False)
    shutil.copyfile(pub, bus / "cp.pub")
    os.chmod(bus / "cp.pub", 0o644)

    (d / ".env").write_text(env_text)
    info = NodeInfo(
        node_id=node_id,
        nats_url=f"nats://127.0.0.1:{bus_port}",
        creds_dir=str(creds_dir),
        monitor_url=f"http://127.0.0.1:{http_port}",
        services=[*SERVICES, HELPER],
        cdi_dir=str(cdi),
        # the containers' BCD_CDI_CONSUMER_DIR, /run/bcd/cdi, is this on the host
        cdi_consumer_dir=str(run / "cdi"),
        run_dir=str(run),
        data_dir=str(data),
        controlplane_dir=str(cp),
        # its key is the control plane container's (uid 10008): the container signs and puts
        put_command=f"deploy/compose/node.sh apply {d} SPEC",
        upstream_url=f"tls://127.0.0.1:{upstream_port}",
    )
    write_node_info(d, info)
    return d / "node.json"


def _write_vendor_spec(host_file: Path, cdi: Path) -> None:
    """`cdi/nvidia.json` (root's, 0644) from the fake host's `vendor_cdi_spec`, written only when it
    differs (runtimes watch the directory); none in the host file leaves the directory as it is."""
    try:
        host = msgspec.json.decode(read_regular(host_file, max_bytes=HOST_FILE_MAX_BYTES))
    except (OSError, msgspec.DecodeError) as exc:
        raise ValueError(f"fake host file {host_file}: {exc}") from None
    spec = host.get("vendor_cdi_spec") if isinstance(host, dict) else None
    if not isinstance(spec, dict):
        return
    path = cdi / VENDOR_CDI_FILE
    data = vendor_spec_bytes(spec)
    if not path.is_file() or path.is_symlink() or path.read_bytes() != data:
        atomic_write(path, data, 0o644)
    _own(path, 0, 0o644)


def _needs_issue(cert: Path, key: Path) -> bool:
    from shared import pki

    if not key.is_file() or pki.certificate_problem(cert, "certificate") is not None:
        return True
    end = pki.expires(cert)
    return end is None or end - datetime.now(timezone.utc) < RENEW_BEFORE


def _ensure_tls(d: Path, node_id: str, node_user: str) -> None:
    """pki/ (the module docstring): the CA, then each reader's directory; see RENEW_BEFORE."""
    from shared import pki

    root = _dir(d / "pki", 0, 0o755, 0)
    ca_dir = _dir(root / "ca", 0, 0o700, 0)
    ca = pki.Issued(ca_dir / "ca.crt", ca_dir / "ca.key")
    fresh_ca = _needs_issue(ca.cert, ca.key)
    if fresh_ca:
        pki.make_ca(ca.cert, ca.key, name=f"bcd compose CA ({node_id})")
    leaves = (
        # reader dir, its uid, common name, server names (a server certificate) or none (a client's)
        ("upstream", UIDS["nats"], UPSTREAM_HOST, [UPSTREAM_HOST, "127.0.0.1", "localhost"]),
        ("gateway_bridge", UIDS["gateway_bridge"], node_user, []),
        ("controlplane", UIDS["controlplane"], CONTROLPLANE_USER, []),
    )
    for reader, uid, common_name, names in leaves:
        where = _dir(root / reader, uid, 0o500)
        cert, key = where / "tls.crt", where / "tls.key"
        if fresh_ca or _needs_issue(cert, key):
            pki.issue(ca, cert, key, common_name=common_name, names=names, server=bool(names), client=not names)
        # written only when it differs, and atomically: a reader mid-read never sees half a bundle,
        # and an unchanged one keeps its identity (the bridge reloads on a change of it)
        bundle = ca.cert.read_bytes()
        if not (where / "ca.crt").is_file() or (where / "ca.crt").read_bytes() != bundle:
            atomic_write(where / "ca.crt", bundle, 0o444)
        _own(where / "ca.crt", uid, 0o444)
        _own(cert, uid, 0o444)
        _own(key, uid, 0o400)


def cmd_init(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        print("bcd compose init: run as root (it gives each container user its own files)", file=sys.stderr)
        return 2
    if not args.fake_host.is_file():
        print(f"bcd compose init: fake host file {args.fake_host} does not exist", file=sys.stderr)
        return 2
    from controlplane.keys import KeyFileError

    try:
        path = init(args.dir, args.node_id, args.fake_host, bus_port=args.bus_port, http_port=args.http_port, upstream_port=args.upstream_port)
    except ValueError as exc:
        print(f"bcd compose init: {exc}", file=sys.stderr)
        return 2
    except (KeyFileError, OSError) as exc:
        print(f"bcd compose init: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    comp = sub.add_parser(
        "compose",
        help="the files deploy/compose/compose.yaml mounts: a node as containers",
        description="A node as containers (deploy/compose/compose.yaml): `init DIR` writes its bus config, "
        "credentials, state and hold directories, .env and node.json.",
        parents=parents,
    )
    csub = comp.add_subparsers(dest="compose_command", required=True, metavar="ACTION", help="what to do (`bcd compose ACTION --help`)")
    p = csub.add_parser("init", help="write DIR for compose.yaml (run as root)", description=__doc__, parents=parents,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path, help="the node's directory (compose.yaml's BCD_DIR)")
    p.add_argument("--node-id", default="node-1", help="this node's id (default node-1)")
    p.add_argument(
        "--fake-host", type=Path, default=EXAMPLE_HOST, help="fake host description copied to DIR/host/host.json when missing (default the example H200 x8)"
    )
    p.add_argument("--bus-port", type=int, default=14222, help="loopback port the node bus is published on (default 14222)")
    p.add_argument("--http-port", type=int, default=18222, help="loopback port of the bus's monitoring (default 18222)")
    p.add_argument("--upstream-port", type=int, default=14223, help="loopback port of the upstream nats-server (default 14223)")
    p.set_defaults(func=cmd_init)
    return comp


__all__ = ["GROUP_ID", "UIDS", "init", "cmd_init", "add_parser"]
