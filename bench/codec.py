"""Codec and inventory benchmarks: prints figures, asserts nothing.

    .venv/bin/python bench/codec.py

Measures, in one run so the ratios are comparable on a noisy machine:
- decoding a 256-assignment NodeSpec with the validating msgspec codec vs
  `json.loads` alone (no validation at all): what validation at the boundary costs;
- building the 8 x H200 example host's inventory through the fakehw adapter.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

from services.inventory.adapters import load_adapter
from services.inventory.build import build_inventory
from shared.schemas import NODE_SPEC_CODEC, DeviceAssignment, Limits, NodeSpec, encode

ROOT = Path(__file__).resolve().parent.parent


def best_of(fn, repeat: int = 5, number: int = 200) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return min(times)


def main() -> None:
    spec = NodeSpec(
        node_id="node-1",
        generation=42,
        devices=[
            DeviceAssignment(
                allocation_id=f"alloc_{i:04d}",
                reservation_id=f"rsv_{i:04d}",
                binding="BINDING_HOLD",
                devices=[f"GPU-5f1c2a90-0000-4000-8000-{i:012d}"],
                limits=Limits(cpus="0-7", memory_bytes=64 << 30),
                env=[f"JOB_ID=job-{i}", "OMP_NUM_THREADS=8"],
            )
            for i in range(256)
        ],
    )
    data = encode(spec)
    t_codec = best_of(lambda: NODE_SPEC_CODEC.decode(data))
    t_json = best_of(lambda: json.loads(data))
    print(f"NodeSpec, 256 assignments, {len(data)} bytes")
    print(f"  msgspec validating decode  {t_codec * 1e6:9.1f} us")
    print(f"  json.loads (no validation) {t_json * 1e6:9.1f} us")
    print(f"  ratio json.loads / validating decode: {t_json / t_codec:.2f}")

    import tempfile

    with tempfile.TemporaryDirectory() as cdi:
        adapter = load_adapter("fakehw", fake_host=ROOT / "examples/hosts/h200x8.json", cdi_dir=cdi)
        now = datetime.now(timezone.utc)
        t_inv = best_of(lambda: build_inventory(adapter, node_id="node-1", revision=0, now=now), number=50)
        inv = build_inventory(adapter, node_id="node-1", revision=0, now=now)
        t_enc = best_of(lambda: encode(inv))
    print(f"Inventory of examples/hosts/h200x8.json ({len(inv.atoms)} atoms, {len(encode(inv))} bytes)")
    print(f"  scan + build  {t_inv * 1e3:8.2f} ms")
    print(f"  encode        {t_enc * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
