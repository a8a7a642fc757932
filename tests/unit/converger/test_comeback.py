"""comeback.py: what a pass waits for, and the pass that runs when it answers again."""

from __future__ import annotations

import nats.errors
import pytest

from services.converger.comeback import ComebackWatch, waiting_after
from services.converger.hostwriter import BusHelperTransport, HostWriteError
from services.converger.intake import InventoryIntake
from services.converger.outbox import BusSigner, OutboxError
from shared import logs
from shared.schemas import AllocationReleased
from shared.subjects import NodeSubjects

SUBJECTS = NodeSubjects("node-1")


@pytest.mark.parametrize(
    ("waiting", "noted", "retry", "after"),
    [
        (set(), set(), False, set()),  # nothing to do
        (set(), set(), True, set()),  # a retry for something else (a pending release): nothing to ask
        (set(), {"signer"}, True, {"signer"}),
        ({"signer"}, {"helper"}, True, {"signer", "helper"}),
        ({"signer"}, set(), False, set()),  # the pass converged: it waits for nothing
        (set(), {"signer"}, False, set()),  # noted, but the pass needed nothing more
    ],
)
def test_waiting_after(waiting, noted, retry, after):
    assert waiting_after(frozenset(waiting), frozenset(noted), retry=retry) == frozenset(after)


class FakeBus:
    """Answers only the subjects in `up`; counts what it was asked."""

    def __init__(self) -> None:
        self.up: set[str] = set()
        self.asked: list[str] = []

    async def request(self, subject: str, payload: bytes, timeout: float) -> object:
        self.asked.append(subject)
        if subject not in self.up:
            raise nats.errors.NoRespondersError
        return object()


def watch(bus: FakeBus, woken: list[str]) -> ComebackWatch:
    return ComebackWatch(bus, SUBJECTS, trigger=woken.append, log=logs.get_logger("test"))  # type: ignore[arg-type]


async def test_a_pass_that_missed_the_signer_runs_when_the_signer_answers():
    bus, woken = FakeBus(), []
    w = watch(bus, woken)
    w.unreached("signer")
    w.pass_ended(retry=True)
    await w.look()
    assert woken == [] and bus.asked == [SUBJECTS.signer_key]
    bus.up.add(SUBJECTS.signer_key)
    await w.look()
    assert woken == ["signer answers again"]
    # woken once: the pass it runs says again what it still waits for
    await w.look()
    assert woken == ["signer answers again"] and w.waiting == frozenset()


async def test_nothing_is_asked_while_no_pass_waits_for_a_service():
    bus, woken = FakeBus(), []
    w = watch(bus, woken)
    w.pass_ended(retry=True)  # retrying for a pending release, say
    await w.look()
    w.unreached("signer")
    w.pass_ended(retry=False)  # ... but that pass converged after all
    await w.look()
    assert bus.asked == [] and woken == []


async def test_each_port_names_its_own_service():
    bus, woken = FakeBus(), []
    w = watch(bus, woken)
    for service in ("helper", "inventory", "not-a-service"):
        w.unreached(service)
    w.pass_ended(retry=True)
    assert w.waiting == frozenset({"helper", "inventory"})
    bus.up.add(SUBJECTS.inventory_get)
    await w.look()
    assert woken == ["inventory answers again"]
    assert set(bus.asked) <= {SUBJECTS.helper_info, SUBJECTS.inventory_get}


async def test_the_ports_note_what_did_not_answer():
    """The signer port and the inventory intake tell the watch when nobody answered."""
    bus, noted = FakeBus(), []
    signer = BusSigner(bus, SUBJECTS, unreached=noted.append)  # type: ignore[arg-type]
    assert await signer.sign_many([]) == [] and noted == []  # nothing to sign: nothing asked
    event = AllocationReleased(allocation_id="a", reservation_id="r", generation=1, devices=["GPU-5f1c2a90-0000-4000-8000-000000000001"])
    with pytest.raises(OutboxError, match="signer"):
        await signer.sign("ev-1", event)
    assert noted == ["signer"]
    intake = InventoryIntake(bus, SUBJECTS, trigger=lambda _: None, log=logs.get_logger("test"), unreached=noted.append)  # type: ignore[arg-type]
    await intake.fetch()
    assert noted == ["signer", "inventory"] and intake.inventory is None


def test_the_root_helper_transport_notes_a_helper_that_does_not_answer():
    class NoHelper:
        is_closed = False

        async def request(self, subject: str, payload: bytes, timeout: float) -> object:
            raise nats.errors.NoRespondersError

    async def connect() -> NoHelper:
        return NoHelper()

    noted: list[str] = []
    transport = BusHelperTransport(connect, unreached=noted.append)  # type: ignore[arg-type]
    try:
        with pytest.raises(HostWriteError, match="not running"):
            transport.request(SUBJECTS.helper_info, b"{}", 1.0)
    finally:
        transport.close()
    assert noted == ["helper"]
