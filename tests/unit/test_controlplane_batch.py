"""The control plane's group commit, without a server: a batch of judged events is applied in
stream order, saved with one state.json write (none when nothing in it moves), logged, then acked."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from nats.aio.msg import Msg

import controlplane.serve as cpserve
import controlplane.state as cpmod
from controlplane.ledger import EVENTS_FILE
from controlplane.serve import ControlPlane
from controlplane.state import STATE_FILE, StateStore, reserve_generation
from shared.schemas import Condition, GpuChanged, NodeCondition, PhysicalGPUStatus, SectionStatus, encode
from shared.signing import Ed25519PrivateKey
from shared.subjects import MSG_ID_HEADER

T0 = datetime(2025, 3, 1, 8, 21, 3, tzinfo=timezone.utc)


class FakeMsg(Msg):
    """A delivered message that records its acks (and what events.jsonl held at each)."""

    def __init__(self, subject: str, data: bytes, msg_id: str | None, journal: list[tuple[str, str]], log: Path) -> None:
        super().__init__(_client=None, subject=subject, data=data, headers={MSG_ID_HEADER: msg_id} if msg_id else None)  # type: ignore[arg-type]
        self._journal = journal
        self._log = log

    async def ack(self) -> None:
        logged = self._log.read_text() if self._log.exists() else ""
        self._journal.append(("ack" if (self.headers or {}).get(MSG_ID_HEADER, "") in logged else "ack-before-line", self.subject))

    async def in_progress(self) -> None:
        self._journal.append(("in_progress", self.subject))


@pytest.fixture
def cp(tmp_path):
    nc = SimpleNamespace(jetstream=lambda timeout: None)
    plane = ControlPlane(nc, Ed25519PrivateKey.generate(), tmp_path, out=None)  # type: ignore[arg-type]
    # generations 1 and 2 were put for node-1: the events below name them
    with plane.store.transaction() as st:
        reserve_generation(st, "node-1", 1)
        reserve_generation(st, "node-1", 2)
    return plane


@pytest.fixture
def state_writes(monkeypatch):
    writes: list[bytes] = []
    real = cpmod.atomic_write

    def counting(path, data, *args, **kwargs):
        if Path(path).name == STATE_FILE:
            writes.append(data)
        real(path, data, *args, **kwargs)

    monkeypatch.setattr(cpmod, "atomic_write", counting)
    return writes


def section(gen: int = 1) -> bytes:
    return encode(SectionStatus(section="devices", state="CONVERGED", observed_generation=gen))


def condition() -> bytes:
    return encode(NodeCondition(condition=Condition(type="Ready", status="True", reason="Up", since=T0)))


def gpu(phase: str = "Ready") -> bytes:
    return encode(GpuChanged(pci_address="0000:18:00.0", phase=phase, management_state="Managed", status=PhysicalGPUStatus(phase=phase)))


def msgs(cp: ControlPlane, journal: list, *items: tuple[str, bytes, str | None]) -> list[FakeMsg]:
    return [FakeMsg(f"bcd.events.node-1.{etype}", data, mid, journal, cp.events_path) for etype, data, mid in items]


def judge_all(cp: ControlPlane, batch: list[FakeMsg]):
    async def go():
        return [await cp._judge(m) for m in batch]

    return asyncio.run(go())


def logged(cp: ControlPlane) -> list[tuple[str, str]]:
    return [(x["event_id"], x["outcome"]) for x in map(json.loads, cp.events_path.read_text().splitlines())]


def test_a_batch_is_applied_in_order_with_one_state_write(cp, state_writes):
    journal: list = []
    batch = msgs(cp, journal, ("section", section(1), "s1"), ("condition", condition(), "c1"), ("section", section(1), "s1"), ("section", section(2), "s2"))
    records = asyncio.run(cp._consume(batch, asyncio.Event()))
    assert [r.outcome for r in records] == ["applied", "applied", "duplicate", "applied"]
    assert len(state_writes) == 1
    assert logged(cp) == [("s1", "applied"), ("c1", "applied"), ("s1", "duplicate"), ("s2", "applied")]
    st = StateStore(cp.state_dir).state
    assert list(st.processed) == ["s1", "c1", "s2"] and st.duplicate_count == 1
    assert st.nodes["node-1"].sections["devices"].observed_generation == 2  # the later one last
    assert [what for what, _ in journal] == ["ack"] * 4  # every ack after its line


def test_new_gpu_events_write_no_state_and_a_copy_in_the_batch_is_a_duplicate(cp, state_writes):
    journal: list = []
    asyncio.run(cp._consume(msgs(cp, journal, ("gpu", gpu("Ready"), None), ("gpu", gpu("Passthrough"), None)), asyncio.Event()))
    assert state_writes == []
    assert [o for _, o in logged(cp)] == ["applied", "applied"]
    asyncio.run(cp._consume(msgs(cp, journal, ("gpu", gpu("Failed"), None), ("gpu", gpu("Failed"), None)), asyncio.Event()))
    assert len(state_writes) == 1  # the duplicate's count
    assert [o for _, o in logged(cp)][2:] == ["applied", "duplicate"]
    assert StateStore(cp.state_dir).state.duplicate_count == 1


def test_a_failed_state_write_keeps_nothing_and_is_retried_in_place(cp, monkeypatch):
    journal: list = []
    real = cpmod.atomic_write
    failures = [OSError(28, "No space left on device")]

    def flaky(path, data, *args, **kwargs):
        if failures:
            raise failures.pop()
        real(path, data, *args, **kwargs)

    async def no_sleep(stopping, seconds):
        return None

    monkeypatch.setattr(cpmod, "atomic_write", flaky)
    monkeypatch.setattr(cpserve, "sleep_unless", no_sleep)
    batch = msgs(cp, journal, ("section", section(1), "s1"), ("condition", condition(), "c1"))
    records = asyncio.run(cp._consume(batch, asyncio.Event()))
    # the batch held (in_progress) while retried, applied once, acked after its lines
    assert [what for what, _ in journal] == ["in_progress", "in_progress", "ack", "ack"]
    assert [r.outcome for r in records] == ["applied", "applied"]
    assert logged(cp) == [("s1", "applied"), ("c1", "applied")]
    assert StateStore(cp.state_dir).state.duplicate_count == 0


def test_a_stop_while_the_state_write_fails_leaves_the_batch_unacked(cp, monkeypatch):
    journal: list = []

    def failing(path, data, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cpmod, "atomic_write", failing)
    stopping = asyncio.Event()
    stopping.set()
    assert asyncio.run(cp._consume(msgs(cp, journal, ("section", section(1), "s1")), stopping)) == []
    assert journal == [] and not cp.events_path.exists()  # redelivered at the next start
    assert "s1" not in cp.store.refresh().processed


def test_saved_but_not_logged_events_get_their_line_once_in_a_batch(cp, state_writes):
    """Killed after the state write, before the lines: the redelivered batch logs each once, applies nothing again."""
    journal: list = []
    batch = msgs(cp, journal, ("section", section(1), "s1"), ("condition", condition(), "c1"))
    cp._commit(judge_all(cp, batch))  # saved ...
    assert not cp.events_path.exists()  # ... not logged (killed here)
    again = ControlPlane(cp.nc, cp.key, cp.state_dir, out=None)
    redelivered = msgs(again, journal, ("section", section(1), "s1"), ("condition", condition(), "c1"), ("section", section(1), "s1"))
    records = asyncio.run(again._consume(redelivered, asyncio.Event()))
    assert [r.outcome for r in records] == ["applied", "applied", "duplicate"]
    assert logged(again) == [("s1", "applied"), ("c1", "applied"), ("s1", "duplicate")]
    st = StateStore(cp.state_dir).state
    assert list(st.processed) == ["s1", "c1"] and st.duplicate_count == 1
    assert (cp.state_dir / EVENTS_FILE).read_text().count('"s1"') == 2


def test_an_event_at_a_generation_never_put_is_refused_in_its_batch(cp, state_writes, caplog):
    """Issue 40: a section (or Bound, Released, ...) at a generation this control plane never put
    moves nothing; the events around it in the batch are applied as usual."""
    journal: list = []
    batch = msgs(cp, journal, ("section", section(1), "s1"), ("section", section(1000), "s1000"), ("section", section(0), "s0"), ("condition", condition(), "c1"))
    records = asyncio.run(cp._consume(batch, asyncio.Event()))
    assert [r.outcome for r in records] == ["applied", "rejected", "rejected", "applied"]
    assert records[1].reason == "generation 1000 was never put for node-1 by this control plane"
    assert records[2].reason == "generation 0 was never put for node-1 by this control plane"
    assert len(state_writes) == 1
    st = StateStore(cp.state_dir).state
    assert st.nodes["node-1"].sections["devices"].observed_generation == 1
    assert "s1000" not in st.processed and st.rejected_count == 2
    assert logged(cp) == [("s1", "applied"), ("s1000", "rejected"), ("s0", "rejected"), ("c1", "applied")]
    assert [r.message for r in caplog.records if r.levelname == "WARNING"] == ["event rejected", "event rejected"]
    assert [what for what, _ in journal] == ["ack"] * 4  # a refusal is final: acked, not redelivered
