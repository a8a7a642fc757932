"""An in-process converger on real files: tmp CDI/run/data dirs, fake slices,
a real Ed25519 signer, an outbox that keeps every event by id, and a fake
vfio_switcher that plays the kernel's driver bindings in memory.

Used by the unit tests of plan/apply, the property tests and the benchmark.
The integration tests run the real processes instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import msgspec
from shared.signing import Ed25519PrivateKey

from services.converger.apply import Applier
from services.converger.applyrun import ApplyResult
from services.converger.domains import FakeDomains
from services.converger.hostwriter import HostWriteError, LocalHostWriter
from services.converger.model import ConvergerState, Observed, Plan, PlanConfig
from services.converger.observe import ReleaseFacts, observe
from services.converger.releases import ReleasesStore
from services.converger.outbox import OutboxError, check_event
from services.converger.plan import plan
from shared.slices import FakeSlices
from services.converger.state import StateStore
from services.converger.switcher import SwitchUnavailable
from shared.holdfiles import consumer_spec
from services.inventory.build import driver_mode
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
    SwitchReply,
    SwitchRequest,
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

    async def sign_many(self, items: list[tuple[str, AttestedEvent]]) -> list[AttestedReport]:
        self.batches = getattr(self, "batches", 0) + 1
        return [await self.sign(event_id, event) for event_id, event in items]


@dataclass
class MemoryOutbox:
    """Keeps the first message per event id, like JetStream's duplicate window."""

    events: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    sends: int = 0
    fail: bool = False
    full: bool = False

    async def has_room(self) -> bool:
        return not self.full and not self.fail

    async def publish(self, event_type: str, event_id: str, payload: bytes) -> None:
        if self.fail:
            raise OutboxError("outbox: unreachable (test)")
        check_event(event_type, payload)
        self.sends += 1
        if event_id not in self.events:
            self.events[event_id] = (event_type, payload)
            self.order.append(event_id)

    async def publish_many(self, items: list[tuple[str, str, bytes]], acked=lambda _: None, gpus=None) -> list[OutboxError | None]:  # noqa: ANN001
        """Like JetStream async publish: all sent in order, then the acks in order."""
        self.waves = getattr(self, "waves", 0) + 1
        #: the event ids of each wave, in order (which events went out together)
        self.wave_ids = [*getattr(self, "wave_ids", []), [i for _, i, _ in items]]
        self.gpus = {**getattr(self, "gpus", {}), **(gpus or {})}
        results: list[OutboxError | None] = []
        for item in items:
            try:
                await self.publish(*item)
            except OutboxError as exc:
                results.append(exc)
                continue
            results.append(None)
        for item, err in zip(items, results):
            if err is None:
                acked(item)
        return results

    def ids(self, event_type: str) -> list[str]:
        """Event ids of one type, in first-publish order."""
        return [i for i in self.order if self.events[i][0] == event_type]

    def of_type(self, event_type: str) -> list[dict]:
        return [json.loads(p) for i in self.order for t, p in [self.events[i]] if t == event_type]

    def hold_events(self, signer: MemorySigner) -> list[tuple[str, str, str, int]]:
        """Bound and Released in outbox order, signatures verified: (type, event id, allocation, generation)."""
        from shared.schemas import ATTESTED_REPORT_CODEC

        out = []
        for i in self.order:
            t, p = self.events[i]
            if t in ("bound", "released"):
                body = verify_report(ATTESTED_REPORT_CODEC.decode(p), signer.key.verify_key)
                assert body.event_id == i, (body.event_id, i)
                out.append((t, i, body.event.allocation_id, body.event.generation))
        return out

    def reports(self, event_type: str, signer: MemorySigner) -> list[ReportBody]:
        out = []
        for i in self.order:
            t, p = self.events[i]
            if t == event_type:
                from shared.schemas import ATTESTED_REPORT_CODEC

                out.append(verify_report(ATTESTED_REPORT_CODEC.decode(p), signer.key.verify_key))
        return out


class FaultyWriter:
    """A HostWriter that raises HostWriteError from the methods named in `fail`."""

    def __init__(self, inner: LocalHostWriter, fail: set[str] | None = None) -> None:
        self.inner = inner
        self.fail: set[str] = fail if fail is not None else set()
        self.calls: list[str] = []

    def __getattr__(self, name: str):  # noqa: ANN204
        attr = getattr(self.inner, name)

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.calls.append(name)
            if name in self.fail:
                raise HostWriteError(f"{name}: injected failure")
            return attr(*args, **kwargs)

        return call

    def _single(self, verb: str, kind: str) -> str:
        return f"{verb}_{ {'cdi': 'cdi', 'cdi-consumer': 'consumer'}.get(kind, 'env') }"

    def write_many(self, kind, contents, done=lambda _: None, *, dirs=None):  # noqa: ANN001, ANN201
        """A batch fails for every hold when its single-file method is in `fail`."""
        name = self._single("write", kind)
        self.calls.append(name)
        if name in self.fail:
            return {c.allocation_id: HostWriteError(f"{name}: injected failure") for c in contents}
        return self.inner.write_many(kind, contents, done, dirs=dirs)

    def remove_many(self, kind, allocation_ids, done=lambda _: None, *, dirs=None):  # noqa: ANN001, ANN201
        name = self._single("remove", kind)
        self.calls.append(name)
        if name in self.fail:
            return {a: HostWriteError(f"{name}: injected failure") for a in allocation_ids}
        return self.inner.remove_many(kind, allocation_ids, done, dirs=dirs)


@dataclass
class FakeReaper:
    """The kube side, as the converger sees it: which atoms pods hold, and the evictions asked for."""

    pod_atoms: set[str] = field(default_factory=set)
    reachable: bool = True
    orphans_clear: bool = False
    evictions: list[tuple[str, list[str]]] = field(default_factory=list)

    def is_held(self, devices: list[str]) -> bool:
        return not self.reachable or bool(self.pod_atoms & set(devices))

    async def held(self, allocation_id: str, devices: list[str]) -> bool:
        return self.is_held(devices)

    async def evict(self, allocation_id: str, devices: list[str]) -> None:
        self.evictions.append((allocation_id, list(devices)))

    async def no_orphans(self, known_devices: list[str]) -> bool:
        return self.reachable and self.orphans_clear


@dataclass
class FakeConsumers:
    """The device plugin as the converger sees it: each withdrawal, with what was true when it came."""

    reaper: FakeReaper
    cdi_dir: Path
    #: (allocation, evictions asked for before it, its CDI spec still on disk)
    withdrawals: list[tuple[str, int, bool]] = field(default_factory=list)
    changed: int = 0

    async def withdraw(self, allocation_id: str, devices: list[str]) -> None:
        on_disk = (self.cdi_dir / f"bcd-{allocation_id}.json").exists()
        self.withdrawals.append((allocation_id, len(self.reaper.evictions), on_disk))

    async def holds_changed(self) -> None:
        self.changed += 1


@dataclass
class FakeSwitcher:
    """vfio_switcher as the converger sees it, and the kernel's driver bindings it changes.

    `drivers` (PCI address -> driver, "" for none) overrides the host file's
    drivers in every inventory the Node builds, as sysfs would after a real
    switch; a reboot (a Node restarted with another boot id) starts a new one.
    `script[pci]`: outcomes to answer for that card, consumed in order; then
    every switch succeeds. `reachable=False`: no reply at all.
    """

    boot_id: str = "boot-1"
    base_driver: str = "nvidia"
    drivers: dict[str, str] = field(default_factory=dict)
    script: dict[str, list[str]] = field(default_factory=dict)
    requests: list[SwitchRequest] = field(default_factory=list)
    reachable: bool = True
    #: (pci, target) of each request; a short view of `requests`
    @property
    def asked(self) -> list[tuple[str, str]]:
        return [(r.pci, r.target) for r in self.requests]

    async def switch(self, request: SwitchRequest) -> SwitchReply:
        self.requests.append(request)
        if not self.reachable:
            raise SwitchUnavailable("vfio_switcher unreachable (test)")
        pci, target = request.pci, request.target
        want = "vfio-pci" if target == "vfio-pci" else self.base_driver
        queued = self.script.get(pci)
        outcome = queued.pop(0) if queued else ("Unchanged" if self.drivers.get(pci) == want else "Succeeded")
        driver = self.drivers.get(pci, self.base_driver)
        if outcome in ("Succeeded", "Unchanged"):
            driver = self.drivers[pci] = want
        elif outcome == "DisruptionRequired":
            driver = self.drivers[pci] = ""
        reasons = {"Succeeded": "Switched", "Unchanged": "AlreadyOnTarget", "Refused": "Held", "Failed": "BindFailed", "DisruptionRequired": "UnbindTimedOut"}
        return SwitchReply(
            pci=pci,
            target=target,
            outcome=outcome,
            reason=reasons.get(outcome, outcome),
            message=f"{outcome} (test)",
            driver=driver,
            boot_id=self.boot_id,
            why=request.why,
            at=datetime.now(timezone.utc),
        )


def with_drivers(inventory: Inventory, drivers: dict[str, str]) -> Inventory:
    """The inventory as it reads with the given drivers bound (driverBinding and mode follow)."""
    if not drivers:
        return inventory
    gpus = []
    for g in inventory.gpus:
        if g.pci_address in drivers:
            d = drivers[g.pci_address]
            binding = msgspec.structs.replace(g.status.driver_binding, driver=d, mode=driver_mode(d))
            g = msgspec.structs.replace(g, driver=d, status=msgspec.structs.replace(g.status, driver_binding=binding))
        gpus.append(g)
    return msgspec.structs.replace(inventory, gpus=gpus)


def with_status(inventory: Inventory, pci: str, *, management_state: str | None = None, conditions: tuple = ()) -> Inventory:
    """The inventory with one card's PhysicalGPU status changed (conditions replace those of their type)."""
    gpus = []
    for g in inventory.gpus:
        if g.pci_address == pci:
            st = g.status
            if management_state is not None:
                st = msgspec.structs.replace(st, driver_binding=msgspec.structs.replace(st.driver_binding, management_state=management_state))
            types = {c.type for c in conditions}
            st = msgspec.structs.replace(st, conditions=[c for c in st.conditions if c.type not in types] + list(conditions))
            g = msgspec.structs.replace(g, status=st)
        gpus.append(g)
    return msgspec.structs.replace(inventory, gpus=gpus)


class Node:
    """One node's converger, in process, on real files under `root`.

    `outbox` and `signer` stand for the durable outbox and the node key: pass
    the previous Node's (or use `restart()`) to model a process restart on the
    same host. `crash` is the crash-point hook (services/converger/crash.py
    names), given to both the Applier and the LocalHostWriter.
    """

    def __init__(
        self,
        root: Path,
        host_file: Path = H200,
        *,
        privileged: bool = True,
        node_id: str = "node-1",
        reserve: int = 0,
        outbox: MemoryOutbox | None = None,
        signer: MemorySigner | None = None,
        crash: Callable[[str], None] | None = None,
        boot_id: str = "boot-1",
        supported_bindings: frozenset[str] | None = None,
        reaper: FakeReaper | None = None,
        switcher: FakeSwitcher | None = None,
        consumers: FakeConsumers | None = None,
    ) -> None:
        self.root = root
        self.node_id = node_id
        self.cdi_dir = root / "cdi"
        self.run_dir = root / "run"
        #: the hold specs' consumer copies (the service's --cdi-consumer-dir)
        self.consumer_dir = root / "run" / "cdi"
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.host_file = host_file
        self.adapter = load_adapter("fakehw", fake_host=host_file, cdi_dir=self.cdi_dir)
        self.adapter.write_cdi_spec()
        self.switcher = switcher if switcher is not None else FakeSwitcher(boot_id=boot_id)
        self.inventory = with_drivers(
            build_inventory(self.adapter, node_id=node_id, revision=1, now=datetime.now(timezone.utc)), self.switcher.drivers
        )
        self.slices = FakeSlices(self.run_dir)
        self.domains = FakeDomains(host_file)
        self.store = StateStore(root / "data" / "converger")
        self.state: ConvergerState = self.store.load()
        # what the service does at start: a new boot forgets running domains and
        # the cards stuck in another boot
        if self.state.boot_id and self.state.boot_id != boot_id:
            self.state.domain_gpus = {}
        self.state.vfio_stuck = {pci: b for pci, b in self.state.vfio_stuck.items() if b == boot_id}
        self.state.boot_id = boot_id
        self.signer = signer if signer is not None else MemorySigner(node_id)
        self.outbox = outbox if outbox is not None else MemoryOutbox()
        self.crash = crash if crash is not None else (lambda _: None)
        self.boot_id = boot_id
        self.writer = LocalHostWriter(self.cdi_dir, self.run_dir, self.slices, self.crash, consumer_dir=self.consumer_dir)
        self.config = PlanConfig(node_id=node_id, privileged=privileged, system_reserve_bytes=reserve)
        if supported_bindings is not None:
            self.config = dataclasses.replace(self.config, supported_bindings=supported_bindings)
        self.releases = ReleasesStore(root / "data")
        self.reaper = reaper if reaper is not None else FakeReaper()
        self.consumers = consumers if consumers is not None else FakeConsumers(self.reaper, self.cdi_dir)
        self.now: datetime | None = None
        self.applier = Applier(
            node_id=node_id,
            writer=self.writer,
            signer=self.signer,
            outbox=self.outbox,
            save_state=self.store.save,
            boot_id=lambda: self.boot_id,
            crash=self.crash,
            releases=self.releases,
            reaper=self.reaper,
            consumers=self.consumers,
            switcher=self.switcher,
            count_switch=lambda target, outcome: self.switch_counts.__setitem__((target, outcome), self.switch_counts.get((target, outcome), 0) + 1),
        )
        self.switch_counts: dict[tuple[str, str], int] = {}
        self._init_args = dict(host_file=host_file, privileged=privileged, node_id=node_id, reserve=reserve, supported_bindings=supported_bindings)

    def restart(self, **changes) -> Node:
        """A fresh process on the same host: same dirs, same durable outbox and key, state from disk.

        Another `boot_id` is a reboot: the cards are back on the host file's drivers.
        """
        args = {**self._init_args, "outbox": self.outbox, "signer": self.signer, "boot_id": self.boot_id, "reaper": self.reaper, "consumers": self.consumers, **changes}
        if "switcher" not in changes:
            rebooted = args["boot_id"] != self.boot_id
            args["switcher"] = FakeSwitcher(boot_id=args["boot_id"], script=self.switcher.script) if rebooted else self.switcher
        return Node(self.root, **args)

    def rescan(self) -> None:
        inv = build_inventory(self.adapter, node_id=self.node_id, revision=self.inventory.revision + 1, now=datetime.now(timezone.utc))
        self.inventory = with_drivers(inv, self.switcher.drivers)

    def release_facts(self) -> ReleaseFacts:
        pending, unreadable = self.releases.load()
        return ReleaseFacts(
            pending=pending,
            unreadable=unreadable,
            held={a: self.reaper.is_held(r.devices) for a, r in pending.items()},
            no_orphans=unreadable and self.reaper.orphans_clear,
        )

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
            releases=self.release_facts(),
            now=self.now,
            switched=self.applier.switched,
            consumer_dir=self.consumer_dir,
        )

    def plan(self, s: NodeSpec) -> Plan:
        return plan(s, self.observe(s), self.config)

    async def converge(self, s: NodeSpec) -> tuple[Plan, ApplyResult]:
        p = self.plan(s)
        return p, await self.applier.apply(p, self.state)

    # what is on disk
    def holds(self) -> dict[str, dict]:
        return {p.name[4:-5]: json.loads(p.read_text()) for p in sorted(self.cdi_dir.glob("bcd-*.json"))}

    def consumer_copies(self) -> dict[str, dict]:
        """allocation -> the consumer copy on disk."""
        return {p.name[4:-5]: json.loads(p.read_text()) for p in sorted(self.consumer_dir.glob("bcd-*.json"))}

    def env(self, alloc: str) -> str | None:
        p = self.run_dir / "allocations" / f"{alloc}.env"
        return p.read_text() if p.exists() else None

    def slice_names(self) -> list[str]:
        return sorted(self.slices.list())


def files_match(node: Node, s: NodeSpec) -> None:
    """The hold files on disk are exactly the spec's: CDI spec and env file each, slices, no temp left."""
    want = {a.allocation_id for a in s.devices}
    assert set(node.holds()) == want
    # every hold spec has its consumer copy, exactly what the spec makes, and no other copy is left
    copies = node.consumer_copies()
    assert set(copies) == want
    for alloc, spec in node.holds().items():
        assert copies[alloc] == consumer_spec(spec), alloc
    for a in s.devices:
        assert node.env(a.allocation_id), a.allocation_id
    assert node.slice_names() == sorted(a.allocation_id for a in s.devices if a.limits is not None)
    assert list(node.cdi_dir.glob(".*tmp-*")) == []
    assert list((node.run_dir / "allocations").glob(".*tmp-*")) == []


def check_hold_invariants(node: Node, *, reported: bool = True, settled: bool = True) -> dict[str, str]:
    """The control plane's view against the disk; returns allocation -> Bound event id of the live holds.

    Always: every Released follows a Bound of that allocation, no allocation
    is bound twice without a Released in between, no atom is in two holds on
    disk. `reported` (after a pass that ran to its end): every hold on disk
    has a Bound whose event id matches its generation and no later Released.
    `settled` (after a pass that converged): also nothing is bound upstream
    that is not on disk.
    """
    live: dict[str, str] = {}
    for kind, event_id, alloc, gen in node.outbox.hold_events(node.signer):
        if kind == "bound":
            assert alloc not in live, f"{alloc} bound twice ({live[alloc]}, {event_id}) without a Released between"
            assert event_id == f"{node.node_id}.{alloc}.bound.g{gen}", event_id
            live[alloc] = event_id
        else:
            assert alloc in live, f"Released {event_id} follows no Bound of {alloc}"
            del live[alloc]
    from services.converger.observe import read_disk

    holds = read_disk(node.cdi_dir, node.run_dir, warned=set()).holds  # foreign files skipped
    on_disk = {a: h.generation for a, h in holds.items()}
    for alloc, gen in on_disk.items() if reported else ():
        assert live.get(alloc) == f"{node.node_id}.{alloc}.bound.g{gen}", f"hold {alloc} (g{gen}) on disk, upstream has {live.get(alloc)}"
    # a Kubernetes hold withdrawn but not yet reported (pods may hold it) is still live upstream
    pending, _ = node.releases.load()
    if settled:
        assert set(live) == set(on_disk) | set(pending), f"bound upstream but not on disk: {sorted(set(live) - set(on_disk) - set(pending))}"
    for alloc, rel in pending.items():
        assert alloc in live, f"pending release {alloc} of no live Bound"
        assert not (set(rel.devices) & {d for h in holds.values() for d in h.devices}), f"pending release {alloc} shares atoms with a hold"
    # no atom in two holds on disk
    # no atom in two holds on disk; a GPU held whole has no MIG instance or
    # slot held, and MIG instances and slots do not mix on one GPU
    seen: dict[str, str] = {}
    kinds: dict[str, set[str]] = {}
    for alloc, h in sorted(holds.items()):
        for atom in h.devices:
            assert atom not in seen, f"{atom} held by {seen[atom]} and {alloc}"
            seen[atom] = alloc
            gpu, _, rest = atom.partition("/")
            kinds.setdefault(gpu, set()).add("gpu" if not rest else "slot" if rest.startswith("slot") else "mig")
    for gpu, k in kinds.items():
        assert len(k) == 1, f"{gpu} is held as {sorted(k)} at once"
    return live


@contextlib.contextmanager
def fast_dir(prefix: str = "bcd-test-") -> Iterator[Path]:
    """A scratch directory, on tmpfs (/dev/shm) where there is one - the converger
    fsyncs every write, which tmpfs makes free - removed afterwards."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    d = tempfile.mkdtemp(prefix=prefix, dir=base)
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def host_copy(directory: Path, change: Callable[[dict], object] | None = None, name: str = "host.json") -> Path:
    """A copy of the example host file under `directory`, changed in place by `change(doc)`."""
    doc = json.loads(H200.read_text())
    if change is not None:
        change(doc)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(doc, indent=2))
    return path


def rewrite_host(path: Path, change: Callable[[dict], object]) -> None:
    """Change a host file copy in place (a node then calls `rescan()`)."""
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2))


__all__ = ["H200", "GPU", "host_inventory", "hold", "spec", "MemorySigner", "MemoryOutbox", "FakeSwitcher", "with_drivers", "with_status", "Node", "host_copy", "rewrite_host", "check_hold_invariants", "fast_dir"]
