"""A fleet on clustered NATS, as containers on a private network: three nats-servers
in one cluster with JetStream (BCD_EVENTS and the upstream buckets replicated 3
times), the reference control plane, and four bcd nodes (`bcd up --upstream`, one
container each, each with its own upstream user and password).

Everything upstream is TLS, verified both ways: a private CA (shared/pki.py) signs each
server's certificate (for its container name, and 127.0.0.1 for the test's published
ports), which the routes use too (`cluster { tls { verify } }`; routes are gossiped by
name, `advertise`), and a client certificate for each node and the control plane
(`tls { verify }`: mutual TLS on the client port). The nodes dial `tls://nats-1:4222,...`
with `--upstream-ca/-cert/-key`. The cluster does not advertise its servers' addresses to
clients (`no_advertise`): a discovered address is an IP no certificate names. The
refusals (a wrong CA, an impostor, expired and not yet valid certificates, a name
mismatch, plain text) are tests/containers/test_fleet_tls.py.

While specs change, the faults come one after another: kill -9 one NATS server;
cut one node off the network for 30 s; restart every node in turn; stop the
control plane for 30 s. After each, every node converges on its last spec and the
control plane holds exactly one verified Bound for each kept allocation, and a
Bound and a Released for each released one: nothing lost or doubled by event id.
Each recovery's time is printed.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

from bcd.nodebus import ensure_passwords, upstream_accounts, upstream_password_users
from controlplane.keys import load_or_create_cp_key
from controlplane.put import put_spec_file
from shared.pki import make_ca
from shared.subjects import CONTROLPLANE_USER, upstream_node_user
from shared.tlsconfig import UpstreamTls, upstream_tls

from .conftest import (
    BCD_GID, NATS_UID, ROOT, TLS_MOUNT, controlplane_container, docker, free_port, nats_tls_block, node_container, read_events, says_info,
    stop_containers, tls_dir, wait_jetstream,
)  # fmt: skip

pytestmark = [pytest.mark.containers, pytest.mark.timeout(1500)]

NODES = [f"fleet-{i}" for i in range(1, 5)]
SERVERS = ["nats-1", "nats-2", "nats-3"]
GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]
CONVERGE_S = 120.0
CUT_OFF_S = 30.0


def server_config(name: str, passwords: dict[str, str]) -> dict:
    # the fleet's layout (bcd fleet): the control plane's account, one account per node
    accounts = {a.name: a.render() for a in upstream_accounts(NODES, upstream_password_users(NODES, passwords))}
    return {
        "server_name": name,
        "host": "0.0.0.0",
        "port": 4222,
        "max_payload": 1024 * 1024,
        "jetstream": {"store_dir": "/data", "sync_interval": "always"},
        # mutual TLS on the client port: a client without a certificate of the fleet's CA is refused
        "tls": nats_tls_block(verify=True),
        "cluster": {
            "name": "bcd-fleet",
            "host": "0.0.0.0",
            "port": 6222,
            # a route dials nats-N and checks that name; each side shows its certificate. The
            # routes a server learns from its peers are dialled as gossiped: by name too
            # (`advertise`), not by an address no certificate names
            "routes": [f"nats://{s}:6222" for s in SERVERS if s != name],
            "advertise": f"{name}:6222",
            "tls": nats_tls_block(verify=True),
            # nor are clients told of the servers' addresses (they dial the names they were given)
            "no_advertise": True,
        },
        "accounts": accounts,
    }


def spec(node: str, gen: int, move: int) -> bytes:
    """A kept hold (the whole GPU 1) and one that moves at every spec (GPU 2 / GPU 3), named by `move`."""
    moving = GPU[1] if move % 2 else GPU[2]
    devices = [
        {"allocation_id": f"{node}-keep", "reservation_id": f"rsv-{node}-keep", "binding": "BINDING_HOLD", "devices": [GPU[0]]},
        {"allocation_id": f"{node}-m{move}", "reservation_id": f"rsv-{node}-m{move}", "binding": "BINDING_HOLD", "devices": [moving]},
    ]
    return json.dumps({"node_id": node, "generation": gen, "devices": devices}).encode()


class Fleet:
    def __init__(self, root: Path, image: str) -> None:
        self.root, self.image = root, image
        self.network = Network()
        self.servers: dict[str, DockerContainer] = {}
        self.ports: dict[str, int] = {}
        self.nodes: dict[str, DockerContainer] = {}
        self.cp: DockerContainer | None = None
        self.generation = dict.fromkeys(NODES, 0)
        #: how many specs each node was given: its moving hold is `<node>-m<moves>`
        self.moves: dict[str, int] = {}
        self.cp_dir = root / "controlplane"
        self.creds = root / "creds"
        #: each container's TLS directory (conftest.tls_dir), mounted at TLS_MOUNT
        self.tls_dirs: dict[str, Path] = {}

    # ---------------------------------------------------------------- set-up

    def write(self) -> None:
        users = [CONTROLPLANE_USER, *(upstream_node_user(n) for n in NODES)]
        creds = ensure_passwords(self.creds, users)
        self.passwords = {u: p.read_text().strip() for u, p in creds.items()}
        self.ca = make_ca(self.root / "pki" / "ca.pem", self.root / "pki" / "ca.key", name="bcd fleet test CA")
        for s in SERVERS:
            d = self.root / s
            (d / "data").mkdir(parents=True)
            (d / "nats.conf").write_text(json.dumps(server_config(s, self.passwords)))
            os.chown(d / "data", NATS_UID, BCD_GID)
            # a route is a client of the server it dials: the certificate serves both ways
            self.tls_dirs[s] = tls_dir(
                self.ca, d / "tls", common_name=s, names=[s, "localhost", "127.0.0.1"], server=True, client=True, owner=(NATS_UID, BCD_GID)
            )
        # the control plane's and each node's client certificates (those containers run as root)
        self.tls_dirs["controlplane"] = tls_dir(self.ca, self.root / "controlplane-tls", common_name=CONTROLPLANE_USER, client=True)
        for n in NODES:
            self.tls_dirs[n] = tls_dir(self.ca, self.root / n / "tls", common_name=upstream_node_user(n), client=True)
        #: the test's own puts dial the published ports as the control plane
        cp = self.tls_dirs["controlplane"]
        self.tls: UpstreamTls = upstream_tls(self.urls(), ca=cp / "ca.pem", cert=cp / "cert.pem", key=cp / "key.pem")
        load_or_create_cp_key(self.cp_dir)
        for n in NODES:
            (self.root / n / "state").mkdir(parents=True)
            # a directory, not the file: the fake kernel replaces the file in it
            (self.root / n / "host").mkdir()
            shutil.copyfile(ROOT / "examples/hosts/h200x8.json", self.root / n / "host" / "host.json")

    def start_server(self, name: str) -> None:
        c = (
            DockerContainer(self.image)
            .with_name(f"{self.network.name}-{name}")
            .with_network(self.network)
            .with_network_aliases(name)
            .with_bind_ports(4222, self.ports.setdefault(name, free_port()))
            .with_volume_mapping(str(self.root / name / "nats.conf"), "/etc/bcd/nats.conf", "ro")
            .with_volume_mapping(str(self.root / name / "data"), "/data", "rw")
            .with_volume_mapping(str(self.tls_dirs[name]), TLS_MOUNT, "ro")
            .with_kwargs(user=f"{NATS_UID}:{BCD_GID}", read_only=True, cap_drop=["ALL"], init=True)
            .with_command(["nats-server", "-c", "/etc/bcd/nats.conf"])
        )
        self.servers[name] = c.start()

    def start_cp(self) -> None:
        url = ",".join(f"tls://{s}:4222" for s in SERVERS)
        self.cp = controlplane_container(self.image, self.network, self.cp_dir, self.creds, self.tls_dirs["controlplane"], url, BCD_CP_REPLICAS="3").start()

    def start_node(self, node: str) -> None:
        url = ",".join(f"tls://{s}:4222" for s in SERVERS)
        self.nodes[node] = node_container(
            self.image, self.network, node, self.root / node / "state", self.root / node / "host", self.creds, self.cp_dir, self.tls_dirs[node], url
        ).start()

    def urls(self) -> str:
        """The published client ports, as the test dials them (the servers' certificates name 127.0.0.1)."""
        return ",".join(f"tls://127.0.0.1:{self.ports.setdefault(s, free_port())}" for s in SERVERS)

    async def put(self, node: str) -> int:
        """A new spec for `node` (its moving hold renamed), put as an operator would: again
        when upstream does not answer (a stream leader being elected after a server died)."""
        self.moves[node] = self.moves.get(node, 0) + 1
        n = self.moves[node]
        for attempt in range(10):
            try:
                result = await put_spec_file(
                    self.urls(), CONTROLPLANE_USER, self.creds / f"{CONTROLPLANE_USER}.password", self.cp_dir,
                    spec(node, self.generation[node] + 1, n), replicas=3, connect_timeout=10, tls=self.tls,
                )  # fmt: skip
                break
            except ConnectionError:
                if attempt == 9:
                    raise
                await asyncio.sleep(2)
        # a try that timed out may have been put after all: the next one is then bumped
        assert result.generation > self.generation[node], (node, result.generation, self.generation[node])
        self.generation[node] = result.generation
        return result.generation

    # ---------------------------------------------------------------- what upstream holds

    def events(self) -> list[dict]:
        return read_events(self.cp_dir / "events.jsonl")

    def converged(self, events: list[dict]) -> list[str]:
        """The nodes not yet converged on their last spec, by the control plane's log."""
        last: dict[str, tuple[int, str]] = {}
        for e in events:
            if e["type"] == "section" and e["outcome"] == "applied":
                ev = e["event"]
                last[e["node_id"]] = (ev["observed_generation"], ev["state"])
        return [n for n in NODES if last.get(n) != (self.generation[n], "CONVERGED")]

    def check_books(self, events: list[dict]) -> None:
        """One verified Bound per kept allocation; a Bound and a Released per released one."""
        applied = [e for e in events if e["outcome"] == "applied" and e["type"] in ("bound", "released")]
        assert all(e["verified"] is True for e in applied), [e for e in applied if e["verified"] is not True][:3]
        ids = Counter(e["event_id"] for e in applied)
        assert not [i for i, c in ids.items() if c > 1], [i for i, c in ids.items() if c > 1]
        bound = Counter((e["node_id"], e["allocation_id"]) for e in applied if e["type"] == "bound")
        released = Counter((e["node_id"], e["allocation_id"]) for e in applied if e["type"] == "released")
        for node in NODES:
            moves = self.moves[node]
            kept = {f"{node}-keep", f"{node}-m{moves}"}
            gone = {f"{node}-m{m}" for m in range(1, moves)}
            for alloc in kept:
                assert bound[(node, alloc)] == 1 and released[(node, alloc)] == 0, (node, alloc, bound[(node, alloc)], released[(node, alloc)])
            for alloc in gone:
                assert bound[(node, alloc)] == 1 and released[(node, alloc)] == 1, (node, alloc, bound[(node, alloc)], released[(node, alloc)])
        assert not [e for e in events if e["outcome"] == "rejected"], [e for e in events if e["outcome"] == "rejected"][:3]

    async def recover(self, what: str, since: float) -> float:
        deadline = time.monotonic() + CONVERGE_S
        while True:
            events = self.events()
            waiting = self.converged(events)
            if not waiting:
                try:
                    self.check_books(events)
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
                else:
                    took = time.monotonic() - since
                    print(f"fleet: {what}: every node converged and upstream's books balance {took:.1f} s after the fault")
                    return took
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not converged after {CONVERGE_S:.0f} s: {waiting}; generations {self.generation}")
            await asyncio.sleep(0.5)

    def report(self) -> None:
        """The last log lines of every part (printed at the end: a failure's evidence)."""
        for name, c in [*self.servers.items(), *([("controlplane", self.cp)] if self.cp else [])]:
            try:
                out, err = c.get_logs()
                print(f"--- {name}\n" + (out + err).decode(errors="replace")[-1500:])
            except Exception as exc:  # noqa: BLE001
                print(f"--- {name}: no logs ({exc})")
        for n in NODES:
            for log in sorted((self.root / n / "state" / "logs").glob("*.log")):
                print(f"--- {n} {log.name}\n" + log.read_text(errors="replace")[-1200:])

    def stop_all(self) -> None:
        stop_containers([*self.nodes.values(), *([self.cp] if self.cp else []), *self.servers.values()], self.network)

async def wait_cluster(fleet: Fleet, timeout: float = 60) -> None:
    """JetStream's meta leader is elected (an account info answers through the cluster)."""
    deadline = time.monotonic() + timeout
    while not all(says_info(fleet.ports[s]) for s in SERVERS):
        if time.monotonic() > deadline:
            raise AssertionError("the nats-servers never answered on their published ports")
        await asyncio.sleep(0.5)
    await wait_jetstream(fleet.urls().split(","), fleet.passwords[CONTROLPLANE_USER], fleet.tls, deadline, 1.0)


@pytest.fixture
def fleet(bcd_image, tmp_path):
    f = Fleet(tmp_path, bcd_image)
    f.write()
    f.network.create()
    try:
        yield f
    finally:
        f.report()
        f.stop_all()
        gc.collect()  # a client socket left open shows here, in this test, not in a later one


async def test_a_fleet_on_a_three_server_cluster_survives_each_fault_with_its_books_balanced(fleet):
    f = fleet
    t0 = time.monotonic()
    for s in SERVERS:
        f.start_server(s)
    await wait_cluster(f)
    f.start_cp()
    for n in NODES:
        f.start_node(n)
    for n in NODES:
        await f.put(n)
    await f.recover("start (4 nodes, first specs)", t0)

    # kill -9 one NATS server while specs change
    t = time.monotonic()
    docker("kill", "-s", "KILL", f.servers["nats-2"].get_wrapped_container().id)
    for n in NODES:
        await f.put(n)
    await f.recover("nats-2 killed (kill -9)", t)
    docker("start", f.servers["nats-2"].get_wrapped_container().id)

    # one node cut off the network for 30 s, its spec changed meanwhile
    cut = f.nodes["fleet-2"].get_wrapped_container().id
    t = time.monotonic()
    docker("network", "disconnect", f.network.name, cut)
    await f.put("fleet-2")
    await f.put("fleet-3")
    await asyncio.sleep(CUT_OFF_S)
    docker("network", "connect", f.network.name, cut)
    took = await f.recover("fleet-2 cut off for 30 s", t)
    # the bridge's pings found the stalled connection and dialled afresh once the path was
    # back; without them TCP's retransmission backoff held the spec 27 s more (57 s in all)
    assert took < CUT_OFF_S + 20, f"{took:.1f} s"

    # every node restarted, one after another, specs changing meanwhile
    t = time.monotonic()
    for n in NODES:
        docker("restart", "-t", "20", f.nodes[n].get_wrapped_container().id, timeout=90)
        await f.put(n)
    await f.recover("every node restarted in turn", t)

    # the control plane stopped for 30 s: the events wait in BCD_EVENTS
    assert f.cp is not None
    t = time.monotonic()
    docker("stop", "-t", "20", f.cp.get_wrapped_container().id, timeout=60)
    for n in NODES:
        await f.put(n)
    await asyncio.sleep(CUT_OFF_S)
    docker("start", f.cp.get_wrapped_container().id)
    await f.recover("control plane stopped for 30 s", t)
