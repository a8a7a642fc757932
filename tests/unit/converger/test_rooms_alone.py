"""Issue 32: the converger's rooms, each built alone with fakes (no ConvergerApp, no bus):
the hold directory watch wakes a pass on a change no pass made, the claim desk reconciles
once before its first prepare and publishes after each, the root helper watch promotes the
node when a helper answers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from services.converger.claimdesk import ClaimDesk
from services.converger.facts import NodeFacts
from services.converger.helperwatch import RootHelperWatch
from services.converger.holddirs import HoldDirs
from services.converger.holdwatch import HoldDirWatch
from services.converger.metrics import ConvergerMetrics
from services.converger.model import ConvergerState, PlanConfig
from services.converger.state import StateStore
from shared import logs

log = logs.get_logger("test.rooms")


async def until(what: str, probe, timeout: float = 5.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_the_hold_dir_watch_wakes_a_pass_on_a_change_no_pass_made(tmp_path: Path) -> None:
    (tmp_path / "cdi").mkdir()
    woke: list[str] = []
    watch = HoldDirWatch(HoldDirs(tmp_path / "cdi", tmp_path / "run", None), lock=asyncio.Lock(), trigger=woke.append, log=log, interval=0.05)
    await watch.pass_ended()  # what the last pass left is the baseline
    stop = asyncio.Event()
    task = asyncio.create_task(watch.run(stop))
    try:
        await asyncio.sleep(0.2)
        assert woke == []  # nothing changed: nothing to do
        (tmp_path / "cdi" / "bcd-x.json").write_text("{}")
        await until("a wake-up", lambda: woke)
        assert woke == ["hold files changed"]
    finally:
        stop.set()
        await task


class Keeper:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    async def reconcile(self, inventory: object) -> None:
        self.calls.append(("reconcile", inventory))

    async def prepare(self, request: object) -> SimpleNamespace:
        self.calls.append(("prepare", request))
        return SimpleNamespace(ok=True, reason="")

    async def unprepare(self, uid: str) -> SimpleNamespace:
        self.calls.append(("unprepare", uid))
        return SimpleNamespace(ok=False, reason="not prepared here")


async def test_the_claim_desk_reconciles_once_then_publishes_and_wakes_a_pass_after_each_claim() -> None:
    keeper, published, woke = Keeper(), [], []

    async def inventory() -> str:
        return "INV"

    async def publish() -> None:
        published.append(1)

    desk = ClaimDesk(
        keeper, state=ConvergerState(), lock=asyncio.Lock(), inventory=inventory, publish=publish, trigger=woke.append,
        metrics=ConvergerMetrics(CollectorRegistry()),
    )
    await desk.prepare("REQ")
    await desk.unprepare(SimpleNamespace(uid="u1"))
    assert keeper.calls == [("reconcile", "INV"), ("prepare", "REQ"), ("unprepare", "u1")]
    assert published == [1, 1] and woke[-1] == "claim u1 unprepared"


async def test_the_root_helper_watch_promotes_the_node_when_a_helper_answers(tmp_path: Path) -> None:
    facts = NodeFacts(state=ConvergerState(), store=StateStore(tmp_path / "state"), config=PlanConfig(node_id="n", privileged=False, system_reserve_bytes=0))
    said: list[tuple] = []

    async def publish(*args: object) -> None:
        said.append(args)

    class Finder:
        note = "gone"
        nc = SimpleNamespace(publish=publish)
        subjects = SimpleNamespace(converger_status_changed="status.changed")

        async def look(self) -> bool:
            return True

    woke: list[str] = []
    watch = RootHelperWatch(Finder(), facts, mode="auto", recheck_interval=30, lost_after=30, trigger=woke.append, log=log)
    assert not facts.privileged
    await watch.look()
    assert facts.privileged and woke[-1] == "root helper found"
