"""publishing.py alone, over the fake host and a fake bus connection (no nats-server, no app): an
inventory is published (bucket and notice) only when its content changed, a restart continues the
revision from the bucket, the GPU events wait in the journal while the outbox is away and go in
order when it is back, and a claims lookup that fails reads Indeterminate, said once per outage."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import nats.errors
import pytest
from prometheus_client import CollectorRegistry

from services.inventory.gpustate import StateFileError
from services.inventory.metrics import InventoryMetrics
from services.inventory.publishing import Publisher
from shared.schemas import INVENTORY_CODEC, Claims, Inventory
from shared.subjects import MSG_ID_HEADER, NodeSubjects

from .rig import NOW, WHOLE, Log, facts, host

SUBJECTS = NodeSubjects("node-1")


class Bus:
    """The parts of a nats Client the publisher uses: publish, request, jetstream().publish."""

    def __init__(self, *, claims: Claims | None = None, last: bytes | None = None) -> None:
        self.claims = claims
        self.last = last
        self.bucket_up = True
        self.outbox_up = True
        self.notices: list[tuple[str, bytes]] = []
        self.stored: list[tuple[str, bytes, dict[str, str] | None, float]] = []
        self.asked: list[str] = []

    async def publish(self, subject: str, payload: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.notices.append((subject, payload))

    async def request(self, subject: str, data: bytes, timeout: float) -> Any:
        self.asked.append(subject)
        if subject == SUBJECTS.converger_claims:
            if self.claims is None:
                raise nats.errors.TimeoutError
            return SimpleNamespace(headers=None, data=msgspec.json.encode(self.claims))
        assert subject == SUBJECTS.inventory_key_get
        if self.last is None:
            return SimpleNamespace(headers={"Status": "404"}, data=b"")
        return SimpleNamespace(headers=None, data=self.last)

    def jetstream(self, timeout: float) -> Any:
        bus = self

        class JetStream:
            async def publish(self, subject: str, payload: bytes, headers: dict[str, str] | None = None) -> None:
                up = bus.outbox_up if subject == SUBJECTS.outbox_subject("gpu") else bus.bucket_up
                if not up:
                    raise nats.errors.TimeoutError
                bus.stored.append((subject, payload, headers, timeout))

        return JetStream()

    def puts(self) -> list[bytes]:
        return [p for s, p, _, _ in self.stored if s == SUBJECTS.inventory_key]

    def events(self) -> list[str]:
        return [h[MSG_ID_HEADER] for s, _, h, _ in self.stored if s == SUBJECTS.outbox_subject("gpu") and h]

    def said(self, subject: str) -> int:
        return sum(1 for s, _ in self.notices if s == subject)


class Room:
    def __init__(self, tmp_path: Path, bus: Bus, **kw: Any) -> None:
        self.bus, self.log, self.registry = bus, Log(), CollectorRegistry()
        self.facts = facts(tmp_path, host(tmp_path))
        self.publisher = Publisher(
            self.facts,
            metrics=InventoryMetrics(self.registry),
            nc=bus,  # type: ignore[arg-type]
            subjects=SUBJECTS,
            node_id="node-1",
            adapter_name="fakehw",
            mps_root="/run/bcd/mps",
            claims_timeout=1.0,
            log=self.log,
            **kw,
        )

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return value if value is not None else 0.0


FREE = Claims(at=NOW)


async def test_an_inventory_is_published_only_when_its_content_changed(tmp_path: Path) -> None:
    room = Room(tmp_path, Bus(claims=FREE))
    first = await room.publisher.scan_and_publish("start")
    assert first.revision == 1 and first.adapter == "fakehw" and first.mps_root == "/run/bcd/mps"
    assert [INVENTORY_CODEC.decode(p).revision for p in room.bus.puts()] == [1]
    assert room.bus.said(SUBJECTS.inventory_changed) == 1
    assert room.facts.current is first and room.facts.wake.is_set()
    room.facts.wake.clear()
    again = await room.publisher.scan_and_publish("periodic")
    assert again is first  # the same host: no new revision, nothing sent
    assert len(room.bus.puts()) == 1 and room.bus.said(SUBJECTS.inventory_changed) == 1
    assert room.facts.wake.is_set()  # the run loop re-reads its timers all the same
    assert (room.metric("bcd_inventory_scans_total", outcome="changed"), room.metric("bcd_inventory_scans_total", outcome="unchanged")) == (1, 1)
    assert room.metric("bcd_inventory_revision") == 1 and room.metric("bcd_inventory_gpus") == 8
    assert [kw["reason"] for _, kw in room.log.said("inventory published")] == ["start"]


async def test_an_evaluation_of_the_last_scan_asks_nothing_and_counts_no_scan(tmp_path: Path) -> None:
    room = Room(tmp_path, Bus(claims=FREE))
    await room.publisher.scan_and_publish("start")
    room.bus.asked.clear()
    await room.publisher.scan_and_publish("claims changed", claims=FREE, rescan=False)
    assert room.bus.asked == []  # the claims came with the notice
    assert room.metric("bcd_inventory_scans_total", outcome="unchanged") == 0


async def test_a_restart_continues_the_revision_from_the_bucket(tmp_path: Path) -> None:
    before = Room(tmp_path / "a", Bus(claims=FREE))
    await before.publisher.scan_and_publish("start")
    [payload] = before.bus.puts()
    after = Room(tmp_path / "b", Bus(claims=FREE, last=payload))
    await after.publisher.load_last()
    assert after.facts.current is not None and after.facts.current.revision == 1
    inv = await after.publisher.scan_and_publish("start")
    assert inv.revision == 1 and after.bus.puts() == []  # the same content: not published again
    assert after.metric("bcd_inventory_revision") == 1  # the gauges start from what the bucket had


async def test_an_unreadable_bucket_value_is_ignored(tmp_path: Path) -> None:
    room = Room(tmp_path, Bus(claims=FREE, last=b"{not json"))
    await room.publisher.load_last()
    assert room.facts.current is None
    assert [lvl for lvl, _ in room.log.said("ignoring unreadable inventory in KV")] == ["warning"]


async def test_gpu_events_wait_for_the_outbox_and_go_in_order_when_it_is_back(tmp_path: Path) -> None:
    bus = Bus(claims=FREE)
    bus.outbox_up = False
    room = Room(tmp_path, bus)
    await room.publisher.scan_and_publish("start")
    waiting = [pe.event_id for pe in room.facts.tracker.outbox]
    assert waiting and bus.events() == []
    assert room.metric("bcd_gpu_events_pending") == len(waiting)
    await room.publisher.flush_events()
    assert len(room.log.said("GPU events wait for the node outbox (the bus setup makes it); retrying")) == 1  # said once
    bus.outbox_up = True
    await room.publisher.flush_events()
    assert bus.events() == waiting and room.facts.tracker.outbox == []
    assert bus.said(SUBJECTS.inventory_journaled) == 1  # the bridge is told to read the outbox
    assert room.log.said("GPU events reach the node outbox again")
    assert room.metric("bcd_gpu_events_pending") == 0


async def test_the_outbox_is_probed_with_a_short_timeout_until_it_answered(tmp_path: Path) -> None:
    room = Room(tmp_path, Bus(claims=FREE))
    await room.publisher.scan_and_publish("start")
    timeouts = {t for s, _, _, t in room.bus.stored if s == SUBJECTS.outbox_subject("gpu")}
    assert timeouts == {1.0}
    room.facts.tracker.exclude(WHOLE)
    await room.publisher.scan_and_publish("gpu exclude")
    last = [t for s, _, _, t in room.bus.stored if s == SUBJECTS.outbox_subject("gpu")][-1]
    assert last == 5.0


async def test_a_claims_lookup_that_fails_reads_indeterminate_and_is_said_once(tmp_path: Path) -> None:
    bus = Bus(claims=None)
    room = Room(tmp_path, bus)
    assert await room.publisher.fetch_claims() is None
    assert await room.publisher.fetch_claims() is None
    assert room.metric("bcd_gpu_claims_lookup_failures_total") == 2
    assert len(room.log.said("claims lookup failed; every card reads managementState Unknown (Indeterminate) until it answers")) == 1
    bus.claims = FREE
    assert await room.publisher.fetch_claims() == FREE
    assert room.log.said("claims lookup answers again")


async def test_a_bucket_that_takes_no_put_is_said_once_and_the_notice_still_goes(tmp_path: Path) -> None:
    bus = Bus(claims=FREE)
    bus.bucket_up = False
    room = Room(tmp_path, bus)
    await room.publisher.scan_and_publish("start")
    room.facts.tracker.exclude(WHOLE)
    await room.publisher.scan_and_publish("gpu exclude")
    assert bus.said(SUBJECTS.inventory_changed) == 2 and bus.puts() == []
    assert len(room.log.said("the inventory's bucket took no put (the bus setup makes it)")) == 1
    bus.bucket_up = True
    room.facts.tracker.include(WHOLE)
    await room.publisher.scan_and_publish("gpu include")
    assert len(bus.puts()) == 1 and room.log.said("the inventory's bucket takes puts again")


async def test_the_first_scan_hook_runs_once_before_the_first_evaluation(tmp_path: Path) -> None:
    seen: list[tuple[Inventory, Inventory | None]] = []
    room: Room

    async def first(base: Inventory) -> None:
        seen.append((base, room.facts.current))

    room = Room(tmp_path, Bus(claims=FREE), first_scan=first)
    await room.publisher.scan_and_publish("start")
    await room.publisher.scan_and_publish("periodic")
    assert len(seen) == 1
    base, published = seen[0]
    assert published is None and base.revision == 0  # before anything was evaluated or published


async def test_a_state_file_that_cannot_be_written_is_said_once_and_raised_when_strict(tmp_path: Path) -> None:
    room = Room(tmp_path, Bus(claims=FREE))
    room.facts.store.disabled = "unreadable gpus.json kept aside"
    room.facts.tracker.exclude(WHOLE)
    room.publisher.save()
    with pytest.raises(StateFileError):
        room.publisher.save(strict=True)
    assert room.metric("bcd_gpu_state_write_failures_total") == 2
    assert len(room.log.said("cannot save the GPU state")) == 1
    room.facts.store.disabled = ""
    room.publisher.save()
    assert room.log.said("GPU state saved again")
