"""An in-process converger on real files: tmp CDI/run/data dirs, fake slices,
a real Ed25519 signer and an outbox that keeps every event by id.

Used by the unit tests of plan/apply, the property tests and the benchmark.
The integration tests run the real processes instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.converger.apply import Applier, ApplyResult
from services.converger.domains import FakeDomains
from services.converger.hostwriter import LocalHostWriter
from services.converger.model import ConvergerState, Observed, Plan, PlanConfig
from services.converger.observe import observe
from services.converger.outbox import OutboxError
from services.converger.plan import plan
from services.converger.slices import FakeSlices
from services.converger.state import StateStore
from services.inventory.adapters import load_adapter
from services.inventory.build import build_inventory
from shared.schemas import (
    AttestedEvent,
    AttestedReport,
    DeviceAssignment,
    HugePages,
    Inventory,
    Limits,
    NodeSpec,
    ReportBody,
)
from shared.signing import sign_report, verify_report

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "examples" / "hosts" / "h200x8.json"
GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]


def host_inventory(host_file: Path = H200, node_id: str = "node-1", cdi_dir: Path | None = None) -> Inventory:
    adapter = load_adapter("fakehw", fake_host=host_file, cdi_dir=cdi_dir or host_file.parent)
    return build_inventory(adapter, node_id=node_id, revision=1, now=datetime(2026, 1, 1, tzinfo=timezone.utc))


def hold(alloc: str, *devices: str, binding: str = "BINDING_HOLD", rsv: str | None = None, env: tuple[str, ...] = (), **limits) -> DeviceAssignment:
    lim = None
    if limits:
        hp = limits.pop("hugepages", None)
        lim = Limits(**limits, hugepages=[HugePages(page_size_kib=s, count=c) for s, c in (hp or [])])
    return DeviceAssignment(
        allocation_id=alloc,
        reservation_id=rsv or f"rsv-{alloc}",
        binding=binding,  # type: ignore[arg-type]
        devices=list(devices),
        limits=lim,
        env=list(env),
    )


def spec(gen: int, *assignments: DeviceAssignment, instances=(), node_id: str = "node-1") -> NodeSpec:
    return NodeSpec(node_id=node_id, generation=gen, devices=list(assignments), instances=list(instances))


class MemorySigner:
    def __init__(self, node_id: str = "node-1", boot_id: str = "boot-1") -> None:
        self.key = Ed25519PrivateKey.generate()
        self.node_id = node_id
        self.boot_id = boot_id
        self.fail = False

    async def sign(self, event_id: str, event: AttestedEvent) -> AttestedReport:
        if self.fail:
            raise OutboxError("signer: unreachable (test)")
        body = ReportBody(node_id=self.node_id, boot_id=self.boot_id, event_id=event_id, time=datetime.now(timezone.utc), event=event)
        return sign_report(self.key, body)


@dataclass
class MemoryOutbox:
    """Keeps the first message per event id, like JetStream's duplicate window."""

    events: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    sends: int = 0
    fail: bool = False

    async def publish(self, event_type: str, event_id: str, payload: bytes) -> None:
        if self.fail:
            raise OutboxError("outbox: unreachable (test)")
        self.sends += 1
        if event_id not in self.events:
            self.events[event_id] = (event_type, payload)
            self.order.append(event_id)

    def of_type(self, event_type: str) -> list[dict]:
        return [json.loads(p) for i in self.order for t, p in [self.events[i]] if t == event_type]

    def reports(self, event_type: str, signer: MemorySigner) -> list[ReportBody]:
        out = []
        for i in self.order:
            t, p = self.events[i]
            if t == event_type:
                from shared.schemas import ATTESTED_REPORT_CODEC

                out.append(verify_report(ATTESTED_REPORT_CODEC.decode(p), signer.key.public_key()))
        return out


class Node:
    """One node's converger, in process, on real files under `root`."""

    def __init__(self, root: Path, host_file: Path = H200, *, privileged: bool = True, node_id: str = "node-1", reserve: int = 0) -> None:
        self.root = root
        self.node_id = node_id
        self.cdi_dir = root / "cdi"
        self.run_dir = root / "run"
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.host_file = host_file
        self.adapter = load_adapter("fakehw", fake_host=host_file, cdi_dir=self.cdi_dir)
        self.adapter.write_cdi_spec()
        self.inventory = build_inventory(self.adapter, node_id=node_id, revision=1, now=datetime.now(timezone.utc))
        self.slices = FakeSlices(self.run_dir)
        self.domains = FakeDomains(host_file)
        self.store = StateStore(root / "data" / "converger")
        self.state: ConvergerState = self.store.load()
        self.signer = MemorySigner(node_id)
        self.outbox = MemoryOutbox()
        self.writer = LocalHostWriter(self.cdi_dir, self.run_dir, self.slices)
        self.config = PlanConfig(node_id=node_id, privileged=privileged, system_reserve_bytes=reserve)
        self.applier = Applier(
            node_id=node_id,
            writer=self.writer,
            signer=self.signer,
            outbox=self.outbox,
            save_state=self.store.save,
            boot_id=lambda: "boot-1",
        )

    def rescan(self) -> None:
        self.inventory = build_inventory(self.adapter, node_id=self.node_id, revision=self.inventory.revision + 1, now=datetime.now(timezone.utc))

    def observe(self, s: NodeSpec) -> Observed:
        return observe(
            spec=s,
            cdi_dir=self.cdi_dir,
            run_dir=self.run_dir,
            slices=self.slices,
            inventory=self.inventory,
            domains=self.domains,
            state=self.state,
            warned=set(),
        )

    def plan(self, s: NodeSpec) -> Plan:
        return plan(s, self.observe(s), self.config)

    async def converge(self, s: NodeSpec) -> tuple[Plan, ApplyResult]:
        p = self.plan(s)
        return p, await self.applier.apply(p, self.state)

    # what is on disk
    def holds(self) -> dict[str, dict]:
        return {p.name[4:-5]: json.loads(p.read_text()) for p in sorted(self.cdi_dir.glob("bcd-*.json"))}

    def env(self, alloc: str) -> str | None:
        p = self.run_dir / "allocations" / f"{alloc}.env"
        return p.read_text() if p.exists() else None

    def slice_names(self) -> list[str]:
        return sorted(self.slices.list())


__all__ = ["H200", "GPU", "host_inventory", "hold", "spec", "MemorySigner", "MemoryOutbox", "Node"]
