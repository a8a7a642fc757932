"""End-to-end benchmark: spec put -> every Bound verified upstream. Prints figures, asserts nothing.

    .venv/bin/python bench/e2e.py [--gens N] [--sizes 1,8,64] [--keep]

What one sample is: the time from the KV put of the signed spec into
`bcd_nodespecs` (made by a `controlplane.serve.ControlPlane` over one
control-plane connection kept open for the whole run, as a real control plane
keeps its connection; `PutResult.put_at`) until every AllocationBound of that
generation has been

- `stream`:   acknowledged by upstream JetStream (the bench watches `BCD_EVENTS`
              through its own ephemeral consumer as the control-plane user and
              checks each report's signature against the node's Hello key), and
- `verified`: applied by the running reference control plane (a line in
              `<state>/controlplane/events.jsonl` with outcome applied,
              verified true; the file is polled every 2 ms).

The old definition - from calling `controlplane.put.put_spec_file`, which
connects upstream, loads the control plane's state (since issue 32 no longer
its event log), ensures the buckets, signs and puts, every time - is measured too, in a second round of
generations per size after the first (sizes in `--old-sizes`, 1 and 8 by
default: it costs a second round), so figures before and after this change
compare.

Sizes 1 and 8 run on examples/hosts/h200x8.json (24 atoms). Size 64 runs on a
copy of it with 32 more cards of 4 slots each, written to the temp dir. Every
size first binds set A once (warm-up, not counted), then alternates between
two disjoint sets B, A, B, ... so each counted generation releases the
previous set and binds a new one. The node is `python -m bcd.cli up` as a
subprocess (SIGTERMed and waited for at the end).

The FLOOR, measured in the same run against a private nats-server (same
`sync_interval: always`) before any node starts, is what one hold cannot do
without: a cross-process request/reply (a tiny responder subprocess), one
JetStream publish with its ack, two `shared.fsutil.atomic_write`s and one
Ed25519 signature. FLOOR(n) = n x that; each p50 is printed beside it with
the ratio.

CHAIN(1), measured the same way right after the FLOOR, is the floor of one
single-hold generation as the contract orders it: the durable steps and
cross-process hops that must happen one after another between the KV put and
the control plane's log line, done back to back in one process with no
service code between them. The spec's KV put (a JetStream publish), the
hand-over to the converger (a request/reply), the spec and the intent written
(two atomic_writes; the intent must be on disk before any side effect), the
released hold's two files removed and the new hold's two written as one group
(`atomic_write_many` and `remove_many`, then one concurrent sync of both
directories), the Released and the Bound published to the outbox together
(two publishes, both acks awaited), the bridge's delivery and its publish
upstream (a request/reply, a JetStream publish), the control plane's delivery,
its state.json write and its log line (a request/reply, an atomic_write, an
append). The sign request is left out: it overlaps the writes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import nats  # noqa: E402
import nats.errors  # noqa: E402
import nats.js.errors  # noqa: E402
from shared.signing import Ed25519PrivateKey  # noqa: E402
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig  # noqa: E402

from bcd.client import NodeInfo  # noqa: E402
from bcd.nodebus import NatsServer  # noqa: E402
from bcd.supervisor import die_with_parent  # noqa: E402
from controlplane.keys import load_or_create_cp_key  # noqa: E402
from controlplane.ledger import EVENTS_FILE, EventRecord  # noqa: E402
from controlplane.put import put_spec_file  # noqa: E402
from controlplane.serve import ControlPlane  # noqa: E402
from controlplane.specs import PutResult  # noqa: E402
from shared.eventids import bound_id  # noqa: E402
from shared.fsutil import FileWrite, atomic_write, atomic_write_many, fsync_dirs, remove_many  # noqa: E402
from shared.schemas import (  # noqa: E402
    ATTESTED_REPORT_CODEC,
    HELLO_CODEC,
    INVENTORY_CODEC,
    NODE_EVENT_CODEC,
    AllocationBound,
    BadMessage,
    Hello,
    Inventory,
    SectionStatus,
)
from shared.signing import VerificationError, verify_report  # noqa: E402
from shared.subjects import (  # noqa: E402
    CONTROLPLANE_USER,
    MSG_ID_HEADER,
    UPSTREAM_EVENTS_STREAM,
    UPSTREAM_INVENTORY_BUCKET,
    UPSTREAM_NODES_BUCKET,
    inbox_prefix,
)

EXAMPLE_HOST = ROOT / "examples" / "hosts" / "h200x8.json"
NODE = "bench-e2e"
EXTRA_CARDS = 32
SLOTS = 4
DEFAULT_GENS = {1: 20, 8: 20, 64: 20}
POLL_S = 0.002
GEN_TIMEOUT_S = 60.0


# ----------------------------------------------------------------------------- helpers


def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p99 of 20 samples is the largest)."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, -(-len(s) * p // 100) - 1))
    return s[int(k)]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"


def big_host(path: Path) -> Path:
    """The example host plus EXTRA_CARDS H200s of SLOTS slots each (vendor CDI spec entries too)."""
    host = json.loads(EXAMPLE_HOST.read_text())
    vendor = host["vendor_cdi_spec"]["devices"]
    base = len(host["gpus"])
    for k in range(EXTRA_CARDS):
        i = base + k
        uuid = f"GPU-5f1c2a90-0000-4000-8000-{0x100 + k:012x}"
        host["gpus"].append(
            {
                "uuid": uuid,
                "index": i,
                "pci_address": f"0001:{k:02x}:00.0",
                "name": "NVIDIA H200",
                "memory_bytes": 150754820096,
                "numa_node": k % 2,
                "driver": "nvidia",
                "base_driver": "nvidia",
                "compute_capability": "9.0",
                "mig_mode": False,
                "slots": SLOTS,
            }
        )
        edits = {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}
        vendor += [{"name": str(i), "containerEdits": edits}, {"name": uuid, "containerEdits": edits}]
    path.write_text(json.dumps(host, indent=1))
    return path


def independent_atoms(inv: Inventory) -> list[str]:
    """Atoms that never conflict with each other: whole unpartitioned GPUs, then slots, then MIG instances."""
    partitioned = {a.gpu_uuid for a in inv.atoms if a.kind != "gpu"}
    whole = [a.id for a in inv.atoms if a.kind == "gpu" and a.gpu_uuid not in partitioned]
    slots = [a.id for a in inv.atoms if a.kind == "slot"]
    migs = [a.id for a in inv.atoms if a.kind == "mig"]
    return whole + slots + migs


def spec_json(size: int, label: str, atoms: list[str]) -> bytes:
    """A NodeSpec without generation: the control plane puts it as last + 1."""
    return json.dumps(
        {
            "node_id": NODE,
            "devices": [
                {
                    "allocation_id": f"s{size}-{label}-{k:02d}",
                    "reservation_id": f"rsv-s{size}-{label}-{k:02d}",
                    "binding": "BINDING_HOLD",
                    "devices": [atom],
                }
                for k, atom in enumerate(atoms)
            ],
        }
    ).encode()


# ----------------------------------------------------------------------------- the floor


RESPONDER = r"""
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(msg):
        await msg.respond(msg.data)
    await nc.subscribe("floor.echo", cb=echo)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await nc.close()
asyncio.run(main())
"""


@dataclass
class Floor:
    rr: float
    js: float
    write: float
    sign: float
    samples: dict[str, int] = field(default_factory=dict)
    chain: float = 0.0  # CHAIN(1), see the module docstring

    @property
    def per_hold(self) -> float:
        return self.rr + self.js + 2 * self.write + self.sign


async def measure_floor(tmp: Path) -> Floor:
    d = tmp / "floor"
    d.mkdir()
    conf = d / "nats.conf"
    conf.write_text(
        json.dumps(
            {
                "server_name": "bench-floor",
                "host": "127.0.0.1",
                "port": -1,
                "jetstream": {"store_dir": str(d / "js"), "sync_interval": "always"},
            }
        )
    )
    server = NatsServer(conf, d / "nats-server.log").start(preexec_fn=die_with_parent)
    responder = subprocess.Popen(  # noqa: S603
        [sys.executable, "-c", RESPONDER, server.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=die_with_parent,  # noqa: PLW1509
    )
    try:
        assert responder.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, responder.stdout.readline)
        if line.strip() != b"ready":
            raise RuntimeError("floor responder did not start")
        nc = await nats.connect(server.url)
        try:
            payload = b"x" * 300
            for _ in range(30):
                await nc.request("floor.echo", payload, timeout=2)
            rr = []
            for _ in range(300):
                t = time.perf_counter()
                await nc.request("floor.echo", payload, timeout=2)
                rr.append(time.perf_counter() - t)

            js = nc.jetstream(timeout=5)
            await js.add_stream(
                StreamConfig(name="FLOOR", subjects=["floor.js"], storage=StorageType.FILE, duplicate_window=86400.0)
            )
            body = b"y" * 1024
            for i in range(20):
                await js.publish("floor.js", body, headers={MSG_ID_HEADER: f"warm-{i}"})
            pubs = []
            for i in range(300):
                t = time.perf_counter()
                await js.publish("floor.js", body, headers={MSG_ID_HEADER: f"floor-{i}"})
                pubs.append(time.perf_counter() - t)
            chain = await measure_chain(nc, js, d / "chain")
        finally:
            await nc.close()
    finally:
        with contextlib.suppress(Exception):
            assert responder.stdin is not None
            responder.stdin.close()
        try:
            responder.wait(5)
        except subprocess.TimeoutExpired:
            responder.kill()
            responder.wait()
        server.stop()

    files = d / "files"
    files.mkdir()
    data = b"z" * 1500  # about a CDI spec with vendor edits
    writes = []
    for i in range(300):
        t = time.perf_counter()
        atomic_write(files / f"bcd-floor-{i % 16}.json", data)
        writes.append(time.perf_counter() - t)

    key = Ed25519PrivateKey.generate()
    msg = b"attested-report\0" + b"b" * 600
    for _ in range(100):
        key.sign(msg)
    signs = []
    for _ in range(2000):
        t = time.perf_counter()
        key.sign(msg)
        signs.append(time.perf_counter() - t)
    shutil.rmtree(d, ignore_errors=True)
    return Floor(
        rr=statistics.median(rr),
        js=statistics.median(pubs),
        write=statistics.median(writes),
        sign=statistics.median(signs),
        samples={"rr": len(rr), "js": len(pubs), "write": len(writes), "sign": len(signs), "chain": CHAIN_SAMPLES},
        chain=chain,
    )


CHAIN_SAMPLES = 200


async def measure_chain(nc: nats.NATS, js: Any, d: Path) -> float:
    """CHAIN(1): one release + one bind's sequential steps, back to back (module docstring); the median."""
    cdi, env, state = d / "cdi", d / "allocations", d / "converger"
    for sub in (cdi, env, state):
        sub.mkdir(parents=True)
    spec, cdi_spec, env_file, report = b"s" * 800, b"z" * 1500, b"e" * 200, b"r" * 700
    loop = asyncio.get_running_loop()
    samples = []
    for i in range(CHAIN_SAMPLES + 10):
        old, new = f"h{i % 2}", f"h{(i + 1) % 2}"
        t = time.perf_counter()
        await js.publish("floor.js", spec, headers={MSG_ID_HEADER: f"chain-spec-{i}"})
        await nc.request("floor.echo", spec, timeout=2)

        def converge() -> None:
            atomic_write(state / "spec.json", spec, 0o600)
            atomic_write(state / "state.json", spec, 0o600)
            dirs: set[Path] = set()
            remove_many([("cdi", cdi / f"bcd-{old}.json"), ("env", env / f"{old}.env")], dirs=dirs)
            atomic_write_many([FileWrite("cdi", cdi / f"bcd-{new}.json", cdi_spec), FileWrite("env", env / f"{new}.env", env_file)], dirs=dirs)
            fsync_dirs(dirs)

        await loop.run_in_executor(None, converge)
        acks = [
            await js.publish_async("floor.js", report, headers={MSG_ID_HEADER: f"chain-{kind}-{i}"})
            for kind in ("released", "bound")
        ]
        await asyncio.gather(*acks)
        await nc.request("floor.echo", report, timeout=2)
        await js.publish("floor.js", report, headers={MSG_ID_HEADER: f"chain-up-{i}"})
        await nc.request("floor.echo", report, timeout=2)
        atomic_write(d / "cp-state.json", spec, 0o600)
        with open(d / "events.jsonl", "ab") as f:
            f.write(report + b"\n")
        if i >= 10:
            samples.append(time.perf_counter() - t)
    return statistics.median(samples)


# ----------------------------------------------------------------------------- a running node


@dataclass
class Watch:
    """What the bench saw upstream, by event id, with perf_counter() times."""

    stream_bound: dict[str, float] = field(default_factory=dict)
    sections: dict[int, tuple[str, float]] = field(default_factory=dict)
    cp_bound: dict[str, float] = field(default_factory=dict)
    rejected_by_bench: list[str] = field(default_factory=list)
    cp_other: dict[str, int] = field(default_factory=dict)
    stream_msgs: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class RunningNode:
    def __init__(self, tmp: Path, name: str, host: Path) -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        self.state = self.dir / "state"
        self.host = host
        self.log_path = self.dir / "up.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.nc: nats.NATS | None = None
        self.info: NodeInfo | None = None
        self.hello: Hello | None = None
        self.inventory: Inventory | None = None
        self.watch = Watch()
        #: the control plane the bench puts through, over `nc` (kept open for the run).
        self.cp: ControlPlane | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    async def start(self, timeout: float = 90.0) -> float:
        t0 = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(  # noqa: S603
                [
                    sys.executable, "-m", "bcd.cli", "up",
                    "--state-dir", str(self.state),
                    "--any-ports",
                    "--fake-host", str(self.host),
                    "--node-id", NODE,
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env={k: v for k, v in os.environ.items() if not k.startswith("BCD_")},
            )
        deadline = time.monotonic() + timeout
        node_json = self.state / "node.json"
        while not node_json.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("bcd up wrote no node.json")
            await asyncio.sleep(0.1)
        self.info = msgspec.json.decode(node_json.read_bytes(), type=NodeInfo)
        password = (Path(self.info.creds_dir) / f"{CONTROLPLANE_USER}.password").read_text().strip()
        self.nc = await nats.connect(
            self.info.upstream_url or self.info.nats_url,
            user=CONTROLPLANE_USER,
            password=password,
            inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode(),
            connect_timeout=5,
        )
        js = self.nc.jetstream(timeout=5)
        # ready: Hello and inventory upstream, and the control plane's durable consumer exists
        while True:
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"node not ready upstream after {timeout}s; see {self.log_path}")
            try:
                hello = HELLO_CODEC.decode((await (await js.key_value(UPSTREAM_NODES_BUCKET)).get(NODE)).value or b"")
                inv = INVENTORY_CODEC.decode((await (await js.key_value(UPSTREAM_INVENTORY_BUCKET)).get(NODE)).value or b"")
                await js.consumer_info(UPSTREAM_EVENTS_STREAM, "controlplane")
            except (nats.js.errors.NotFoundError, nats.js.errors.KeyNotFoundError, nats.errors.Error, BadMessage, asyncio.TimeoutError):
                await asyncio.sleep(0.2)
                continue
            self.hello, self.inventory = hello, inv
            break
        await js.subscribe(
            f"bcd.events.{NODE}.>",
            stream=UPSTREAM_EVENTS_STREAM,
            cb=self._on_event,
            manual_ack=True,
            deliver_policy=DeliverPolicy.NEW,
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, description="bench/e2e watcher"),
        )
        await self.nc.flush()
        key, _ = load_or_create_cp_key(Path(self.info.controlplane_dir))
        self.cp = ControlPlane(self.nc, key, Path(self.info.controlplane_dir), out=None)
        await self.cp.ensure_upstream()
        self._tasks.append(asyncio.create_task(self._tail_cp_log()))
        return time.perf_counter() - t0

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"bcd up exited with {self.proc.returncode}; see {self.log_path}")

    async def _on_event(self, msg: nats.aio.msg.Msg) -> None:
        now = time.perf_counter()
        w = self.watch
        w.stream_msgs += 1
        etype = msg.subject.rsplit(".", 1)[-1]
        header_id = (msg.headers or {}).get(MSG_ID_HEADER, "")
        if etype == "bound":
            assert self.hello is not None
            try:
                body = verify_report(ATTESTED_REPORT_CODEC.decode(msg.data), self.hello.public_key)
            except (BadMessage, VerificationError) as exc:
                w.rejected_by_bench.append(f"{header_id}: {exc}")
                return
            if body.node_id != NODE or body.boot_id != self.hello.boot_id or body.event_id != header_id:
                w.rejected_by_bench.append(f"{header_id}: node/boot/event id mismatch")
                return
            if isinstance(body.event, AllocationBound):
                w.stream_bound.setdefault(body.event_id, now)
        elif etype == "section":
            try:
                ev = NODE_EVENT_CODEC.decode(msg.data)
            except BadMessage:
                return
            if isinstance(ev, SectionStatus):
                w.sections[ev.observed_generation] = (ev.state, now)
        w.changed.set()

    async def _tail_cp_log(self) -> None:
        path = self.state / "controlplane" / EVENTS_FILE
        decoder = msgspec.json.Decoder(EventRecord)
        offset = 0
        partial = b""
        while not self._stopping.is_set():
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except FileNotFoundError:
                chunk = b""
            if chunk:
                now = time.perf_counter()
                offset += len(chunk)
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                for raw in lines:
                    if not raw.strip():
                        continue
                    try:
                        rec = decoder.decode(raw)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue
                    if rec.type == "bound" and rec.outcome == "applied" and rec.verified:
                        self.watch.cp_bound.setdefault(rec.event_id, now)
                    else:
                        k = f"{rec.type}/{rec.outcome}"
                        self.watch.cp_other[k] = self.watch.cp_other.get(k, 0) + 1
                self.watch.changed.set()
            await asyncio.sleep(POLL_S)

    async def put(self, spec: bytes) -> PutResult:
        """Sign and put over the kept connection (what a running control plane does)."""
        assert self.cp is not None
        return await self.cp.put_spec(spec)

    async def put_old(self, spec: bytes) -> PutResult:
        """The old definition's put: `put_spec_file` (connect, load state and event log, ensure, sign, put, close)."""
        assert self.info is not None
        return await put_spec_file(
            self.info.upstream_url or self.info.nats_url,
            CONTROLPLANE_USER,
            Path(self.info.creds_dir) / f"{CONTROLPLANE_USER}.password",
            Path(self.info.controlplane_dir),
            spec,
        )

    async def wait_for(self, predicate, timeout: float = GEN_TIMEOUT_S) -> bool:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.watch.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.watch.changed.wait(), min(left, 0.5))
        return True

    async def stop(self) -> int | None:
        self._stopping.set()
        for t in self._tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 3)
        rc = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = await asyncio.get_running_loop().run_in_executor(None, self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
        elif self.proc is not None:
            rc = self.proc.returncode
        return rc


# ----------------------------------------------------------------------------- one size


@dataclass
class SizeResult:
    size: int
    host: str
    #: the old definition: samples from calling put_spec_file (else from the KV put over the kept connection).
    old: bool = False
    #: how long the put call took (put_spec over the kept connection; put_spec_file when `old`).
    put: list[float] = field(default_factory=list)
    stream: list[float] = field(default_factory=list)
    verified: list[float] = field(default_factory=list)
    #: the converger's own pass (its log: "spec accepted" -> end of that pass), per counted generation.
    converger_pass: list[float] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)
    timeouts: int = 0
    not_converged: int = 0


async def run_size(node: RunningNode, size: int, gens: int, host_name: str, *, old: bool = False) -> SizeResult:
    assert node.inventory is not None
    atoms = independent_atoms(node.inventory)
    if len(atoms) < 2 * size:
        raise RuntimeError(f"{host_name}: {len(atoms)} independent atoms, {2 * size} needed")
    # the old round's allocations are new ones too: its warm-up binds again what the round before left bound
    a, b = ("oa", "ob") if old else ("a", "b")
    sets = {a: atoms[:size], b: atoms[size : 2 * size]}
    res = SizeResult(size=size, host=host_name, old=old)
    w = node.watch
    for i in range(gens + 1):  # i == 0: warm-up (binds A), not counted
        label = a if i % 2 == 0 else b
        spec = spec_json(size, label, sets[label])
        t_call = time.perf_counter()
        result = await (node.put_old(spec) if old else node.put(spec))
        t_put = time.perf_counter()
        gen = result.generation
        # the sample starts at the call (old definition) or at the KV put itself
        t0 = t_call if old else result.put_at
        want = [bound_id(NODE, f"s{size}-{label}-{k:02d}", gen) for k in range(size)]
        ok = await node.wait_for(lambda: all(e in w.stream_bound for e in want) and all(e in w.cp_bound for e in want))
        # let the node settle (its section for this generation is upstream) before the next put
        settled = await node.wait_for(lambda: gen in w.sections, timeout=10.0)
        if i == 0:
            continue
        if not ok:
            res.timeouts += 1
            continue
        if not settled or w.sections[gen][0] != "CONVERGED":
            res.not_converged += 1
        res.generations.append(gen)
        res.put.append(t_put - t_call)
        res.stream.append(max(w.stream_bound[e] for e in want) - t0)
        res.verified.append(max(w.cp_bound[e] for e in want) - t0)
    res.converger_pass = converger_passes(node.state / "logs" / "converger.log", res.generations)
    return res


def converger_passes(log: Path, generations: list[int]) -> list[float]:
    """From the converger's JSON log: "spec accepted" of generation g -> the end of the pass it triggered."""
    accepted: dict[int, datetime] = {}
    ended: dict[int, datetime] = {}
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        gen, msg = rec.get("generation"), rec.get("msg", "")
        if not isinstance(gen, int) or "ts" not in rec:
            continue
        ts = datetime.fromisoformat(rec["ts"])
        if msg == "spec accepted":
            accepted.setdefault(gen, ts)
        elif msg in ("pass converged", "section failed", "pass incomplete; retrying") and gen in accepted:
            ended.setdefault(gen, ts)
    return [(ended[g] - accepted[g]).total_seconds() for g in generations if g in accepted and g in ended]


# ----------------------------------------------------------------------------- main


async def amain(args: argparse.Namespace) -> None:
    t_start = time.perf_counter()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    tmp = Path(tempfile.mkdtemp(prefix="bcd-bench-e2e-"))
    print("bcd end to end: spec put -> every Bound verified upstream")
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs, temp dir {tmp}")
    old_sizes = {int(s) for s in args.old_sizes.split(",") if s}
    results: list[SizeResult] = []
    old_results: list[SizeResult] = []
    startups: list[tuple[str, float]] = []
    integrity: list[str] = []
    nodes: list[RunningNode] = []
    try:
        floor = await measure_floor(tmp)
        print(
            f"\nFLOOR per hold (medians, this run, private nats-server with sync_interval always):\n"
            f"  request/reply to another process  {floor.rr * 1e3:7.3f} ms  (n={floor.samples['rr']})\n"
            f"  JetStream publish + PubAck        {floor.js * 1e3:7.3f} ms  (n={floor.samples['js']}, 1 KiB, file store)\n"
            f"  atomic_write x 2                  {2 * floor.write * 1e3:7.3f} ms  (n={floor.samples['write']}, 1.5 KB each)\n"
            f"  Ed25519 signature                 {floor.sign * 1e3:7.3f} ms  (n={floor.samples['sign']})\n"
            f"  = FLOOR(1)                        {floor.per_hold * 1e3:7.3f} ms;  FLOOR(n) = n x FLOOR(1)\n"
            f"CHAIN(1), one release + one bind's sequential steps back to back, no service code (module docstring):\n"
            f"  = CHAIN(1)                        {floor.chain * 1e3:7.3f} ms = {floor.chain / floor.per_hold:.1f}x FLOOR(1)"
            f" (n={floor.samples['chain']}); 3x FLOOR(1) leaves {(3 * floor.per_hold - floor.chain) * 1e3:.2f} ms"
            f" for the six processes' own work"
        )
        groups: list[tuple[str, Path, list[int]]] = []
        small = [s for s in sizes if 2 * s <= 20]
        large = [s for s in sizes if 2 * s > 20]
        if small:
            groups.append(("h200x8.json", EXAMPLE_HOST, small))
        if large:
            groups.append((f"h200x8 + {EXTRA_CARDS} cards x {SLOTS} slots", big_host(tmp / "big-host.json"), large))
        for gi, (host_name, host_path, group_sizes) in enumerate(groups):
            node = RunningNode(tmp, f"node{gi}", host_path)
            nodes.append(node)
            startups.append((host_name, await node.start()))
            for size in group_sizes:
                gens = args.gens or DEFAULT_GENS.get(size, 10)
                t = time.perf_counter()
                r = await run_size(node, size, gens, host_name)
                results.append(r)
                print(f"  ... size {size:>2}: {len(r.verified)} generations in {time.perf_counter() - t:.1f} s", flush=True)
            for size in group_sizes:
                if size not in old_sizes:
                    continue
                gens = args.gens or DEFAULT_GENS.get(size, 10)
                t = time.perf_counter()
                r = await run_size(node, size, gens, host_name, old=True)
                old_results.append(r)
                print(f"  ... size {size:>2}, old definition: {len(r.verified)} generations in {time.perf_counter() - t:.1f} s", flush=True)
            w = node.watch
            if w.rejected_by_bench:
                integrity.append(f"{host_name}: {len(w.rejected_by_bench)} Bound reports failed the bench's check: {w.rejected_by_bench[:3]}")
            other = ", ".join(f"{k} {v}" for k, v in sorted(w.cp_other.items()))
            integrity.append(
                f"{host_name}: {w.stream_msgs} events on BCD_EVENTS, {len(w.cp_bound)} Bound verified by the control plane; other log lines: {other}"
            )
            rc = await node.stop()
            integrity.append(f"{host_name}: bcd up exited {rc} after SIGTERM")
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.stop()
        if args.keep:
            print(f"(kept {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print("\nnode start (bcd up -> Hello, inventory and control-plane consumer upstream):")
    for name, t in startups:
        print(f"  {name}: {t:.1f} s")
    print(
        "\nlatency per generation, ms, from the KV put over the control plane's kept connection (each\n"
        "releases the previous set and binds `n` new holds; p99 is nearest-rank, i.e. the worst sample\n"
        "at these counts):"
    )
    latency_table(results, floor)
    print(
        "\n`put` ControlPlane.put_spec returned (reserve the generation in state.json, sign, KV put, record\n"
        "the spec; over the kept connection), from its call; `stream` the last Bound is in BCD_EVENTS\n"
        "(PubAck'd upstream, signature checked by the bench); `verified` the last Bound is applied and\n"
        "verified in the control plane's events.jsonl; both from the KV put (PutResult.put_at). `pass` is\n"
        "a duration, not from the put: the converger's pass for that generation (its log, \"spec accepted\"\n"
        "-> pass end, ms resolution).\n"
        "per hold at p50, verified / n:",
        ", ".join(f"n={r.size}: {pct(r.verified, 50) / r.size * 1e3:.1f} ms" for r in results if r.verified),
    )
    if old_results:
        print("\nthe old definition, in the same run (a second round of generations): from calling put_spec_file")
        latency_table(old_results, floor)
        print(
            "`put` put_spec_file returned (connect, load state and event log, ensure buckets, sign, KV put,\n"
            "close); `stream` and `verified` from its call.\n"
            "per hold at p50, (verified - put) / n:",
            ", ".join(f"n={r.size}: {(pct(r.verified, 50) - pct(r.put, 50)) / r.size * 1e3:.1f} ms" for r in old_results if r.verified),
        )
    print("\nintegrity (informational):")
    for line in integrity:
        print(f"  {line}")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")


def latency_table(results: list[SizeResult], floor: Floor) -> None:
    print(
        f"{'n':>3} {'gens':>4} {'put p50':>8} {'pass p50':>8} {'stream p50':>10} {'p99':>8} {'verified p50':>12} {'p99':>8}"
        f" {'FLOOR(n)':>9} {'stream/FLOOR':>12} {'verified/FLOOR':>14}  host"
    )
    for r in results:
        if not r.verified:
            print(f"{r.size:>3} {0:>4}  (no complete generation; {r.timeouts} timed out)")
            continue
        fl = floor.per_hold * r.size
        sp, vp = pct(r.stream, 50), pct(r.verified, 50)
        print(
            f"{r.size:>3} {len(r.verified):>4} {ms(pct(r.put, 50))} {ms(pct(r.converger_pass, 50)) if r.converger_pass else '       -'}"
            f" {ms(sp):>10} {ms(pct(r.stream, 99))}"
            f" {ms(vp):>12} {ms(pct(r.verified, 99))} {ms(fl):>9} {sp / fl:>11.1f}x {vp / fl:>13.1f}x  {r.host}"
        )
        if r.timeouts or r.not_converged:
            print(f"      ({r.timeouts} generations timed out, {r.not_converged} did not report CONVERGED)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gens", type=int, default=0, help="counted generations per size (default 20)")
    parser.add_argument("--sizes", default="1,8,64", help="assignments per generation, comma-separated")
    parser.add_argument(
        "--old-sizes",
        default="1,8",
        help="sizes also measured the old way, from calling put_spec_file (a second round each; '' for none)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (state, logs) for a look afterwards")
    args = parser.parse_args()
    # put_spec_file's connection logs its own close as "disconnected from upstream"
    logging.getLogger("controlplane").setLevel(logging.ERROR)
    try:
        asyncio.run(amain(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
