"""Planner and pass benchmarks: prints figures, asserts nothing.

    .venv/bin/python bench/plan.py

- `plan()` for 10, 100, 1,000 and 10,000 new assignments on a synthetic fake
  host with 2,560 GPUs of 4 slots each (a vendor CDI spec naming every card),
  with the per-assignment time and the growth ratio t(10,000)/t(1,000): the
  planner must stay near-linear (a ratio of about 10; above 12 means something
  in it grew quadratic). One assignment in 10 books CPUs and memory, one in 20
  huge pages on a NUMA node, so host admission is on the path.
- `plan()` with the same holds already on disk (the steady state: nothing to do).
- a full pass (observe + plan + apply through tests/converger_kit.Node, real
  files, fsync and all) binding 10 and 100 new holds.
- what the hold specs' consumer copies cost (docs/cdi-runtimes.md): the full
  pass binding 100 holds, and the steady pass after it, with copies and on a
  node that keeps none, alternating in one run (best of 3 each), as a ratio.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.converger.model import Observed  # noqa: E402
from services.converger.plan import plan  # noqa: E402
from shared.schemas import DeviceAssignment, HugePages, Limits, NodeSpec  # noqa: E402
from tests.converger_kit import Node  # noqa: E402

GPUS = 2560
SLOTS = 4
SIZES = (10, 100, 1_000, 10_000)


def synthetic_host(path: Path, gpus: int = GPUS) -> Path:
    """A fake host description with `gpus` cards of SLOTS slots, 2 NUMA nodes, plenty of memory."""
    base = json.loads((ROOT / "examples" / "hosts" / "h200x8.json").read_text())
    cards, vendor_devices = [], []
    for i in range(gpus):
        uuid = f"GPU-5f1c2a90-0000-4000-8000-{i:012x}"
        cards.append(
            {
                "uuid": uuid,
                "index": i,
                "pci_address": f"{i // 256:04x}:{i % 256:02x}:00.0",
                "name": "NVIDIA H200",
                "memory_bytes": 150754820096,
                "numa_node": i % 2,
                "driver": "nvidia",
                "base_driver": "nvidia",
                "mig_mode": False,
                "slots": SLOTS,
            }
        )
        edits = {"deviceNodes": [{"path": f"/dev/nvidia{i}"}]}
        vendor_devices += [{"name": str(i), "containerEdits": edits}, {"name": uuid, "containerEdits": edits}]
    base["gpus"] = cards
    base["processes"] = []
    base["domains"] = []
    base["memory"] = {"total_bytes": 1 << 50, "available_bytes": 1 << 50}
    for node in base["numa_nodes"]:
        for pool in node["hugepages"]:
            pool["total"] = pool["free"] = 1 << 20
    base["vendor_cdi_spec"]["devices"] = vendor_devices
    path.write_text(json.dumps(base))
    return path


def assignment(i: int) -> DeviceAssignment:
    """Assignment i holds slot i % SLOTS of card i // SLOTS: all fit, none overlap."""
    atom = f"GPU-5f1c2a90-0000-4000-8000-{i // SLOTS:012x}/slot{i % SLOTS}"
    limits = None
    if i % 20 == 0:
        limits = Limits(cpus="0-1", hugepages=[HugePages(page_size_kib=2048, count=4)], mems=str(i % 2))
    elif i % 10 == 0:
        limits = Limits(cpus="0-3", memory_bytes=1 << 30)
    return DeviceAssignment(
        allocation_id=f"alloc-{i:05d}",
        reservation_id=f"rsv-{i:05d}",
        binding="BINDING_HOLD",
        devices=[atom],
        limits=limits,
        env=[f"JOB={i}"],
    )


def node_spec(n: int, generation: int = 1) -> NodeSpec:
    # built directly: NodeSpec's decoder caps a spec at 1,024 assignments; the
    # planner is measured beyond that on purpose
    return NodeSpec(node_id="node-1", generation=generation, devices=[assignment(i) for i in range(n)])


def best(fn, repeat: int = 3) -> float:  # noqa: ANN001
    """Best of `repeat` runs, the garbage collector paused while timing (as timeit does)."""
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return min(times)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bcd-bench-") as d:
        root = Path(d)
        t0 = time.perf_counter()
        host = synthetic_host(root / "host.json")
        node = Node(root / "node", host)
        print(f"synthetic host: {GPUS} GPUs x {SLOTS} slots = {len(node.inventory.atoms)} atoms "
              f"(inventory and node set up in {time.perf_counter() - t0:.2f} s)")

        print("\nplan() of N new assignments (empty disk; best of 3, GC paused while timing):")
        print(f"{'N':>8} {'total ms':>10} {'us/assignment':>14} {'steps':>7}")
        empty: Observed = node.observe(node_spec(0))
        results: dict[int, float] = {}
        for n in SIZES:
            s = node_spec(n)
            p = plan(s, empty, node.config)
            assert len(p.steps) == n and not p.failures, (len(p.steps), p.failures[:1])
            t = best(lambda s=s: plan(s, empty, node.config))
            results[n] = t
            print(f"{n:>8} {t * 1e3:>10.2f} {t / n * 1e6:>14.1f} {len(p.steps):>7}")
        ratio = results[10_000] / results[1_000]
        print(f"growth t(10,000)/t(1,000) = {ratio:.2f}  (linear: 10; limit 12)")

        print("\nfull pass through the kit (observe + plan + apply, real files):")
        for n in (10, 100):
            sub = Node(root / f"pass-{n}", host)
            s = node_spec(n)
            t0 = time.perf_counter()
            observed = sub.observe(s)
            t1 = time.perf_counter()
            p = plan(s, observed, sub.config)
            t2 = time.perf_counter()
            r = asyncio.run(sub.applier.apply(p, sub.state))
            t3 = time.perf_counter()
            assert not r.errors and len(sub.outbox.ids("bound")) == n, r.errors[:1]
            steady = sub.plan(s)
            t4 = time.perf_counter()
            print(f"{n:>5} new holds: {(t3 - t0) * 1e3:8.1f} ms = observe {(t1 - t0) * 1e3:.1f} + plan {(t2 - t1) * 1e3:.1f} "
                  f"+ apply {(t3 - t2) * 1e3:.1f} ({(t3 - t2) / n * 1e3:.2f} ms/hold); "
                  f"next pass observe+plan: {(t4 - t3) * 1e3:.1f} ms, {len(steady.steps)} steps")

        print("\nconsumer copies: a pass binding 100 holds, and the steady pass after it (best of 3, alternating):")
        timings: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for round_ in range(3):
            for copies in (True, False):
                sub = Node(root / f"copies-{copies}-{round_}", host)
                if not copies:
                    sub.consumer_dir = sub.writer.consumer_dir = None  # a node that keeps none
                s = node_spec(100)
                t0 = time.perf_counter()
                _, r = asyncio.run(sub.converge(s))
                t1 = time.perf_counter()
                assert not r.errors and len(sub.outbox.ids("bound")) == 100, r.errors[:1]
                assert sub.plan(s).steps == ()
                t2 = time.perf_counter()
                timings[copies].append((t1 - t0, t2 - t1))
        for copies, label in ((True, "with copies"), (False, "without")):
            bind, steady = min(t for t, _ in timings[copies]), min(t for _, t in timings[copies])
            print(f"  {label:<12} bind pass {bind * 1e3:8.1f} ms   steady pass {steady * 1e3:7.1f} ms")
        ratio_bind = min(t for t, _ in timings[True]) / min(t for t, _ in timings[False])
        ratio_steady = min(t for _, t in timings[True]) / min(t for _, t in timings[False])
        print(f"  ratio with/without: bind pass {ratio_bind:.2f}, steady pass {ratio_steady:.2f}")

        # the same on the 8 x H200 example host, whose vendor spec is small: the
        # HostWriter reads and decodes the vendor spec for every CDI spec it writes
        small = Node(root / "example")
        uuids = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]
        atoms = uuids[:4] + [f"{uuids[4]}/slot{k}" for k in range(4)]
        s = NodeSpec(
            node_id="node-1",
            generation=1,
            devices=[DeviceAssignment(allocation_id=f"ex-{i}", reservation_id=f"rsv-{i}", binding="BINDING_HOLD", devices=[a])
                     for i, a in enumerate(atoms)],
        )
        t0 = time.perf_counter()
        p, r = asyncio.run(small.converge(s))
        t = time.perf_counter() - t0
        assert not r.errors and len(small.outbox.ids("bound")) == len(atoms)
        print(f"{len(atoms):>5} new holds on the 8 x H200 example host: {t * 1e3:.1f} ms ({t / len(atoms) * 1e3:.2f} ms/hold)")


if __name__ == "__main__":
    main()
