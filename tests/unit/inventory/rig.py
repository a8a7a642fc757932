"""What the inventory room tests share: the example host (8 x H200) read into an Inventory, the
facts the rooms are built on, a log that keeps what it was told, and a wait."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from services.inventory.adapters.fakehw import FakeHwAdapter
from services.inventory.build import build_inventory
from services.inventory.facts import InventoryFacts
from services.inventory.gpustate import GpuStateStore, GpuTracker
from services.inventory.health import HealthPolicy
from shared.schemas import Inventory

REPO = Path(__file__).resolve().parents[3]
H200 = REPO / "examples" / "hosts" / "h200x8.json"
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
#: card 0 is a whole card; card 7 is in MIG mode (four MIG devices)
WHOLE = "0000:18:00.0"
MIG_CARD = "0000:db:00.0"
NOT_LISTED = "0000:99:00.0"


def host(tmp_path: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> FakeHwAdapter:
    """The fakehw adapter over a copy of the example host, edited first when asked."""
    data = json.loads(H200.read_text())
    if edit is not None:
        edit(data)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "host.json"
    path.write_text(json.dumps(data))
    return FakeHwAdapter(path, cdi_dir=tmp_path / "cdi")


def scan(adapter: FakeHwAdapter, revision: int = 1) -> Inventory:
    return build_inventory(adapter, node_id="node-1", revision=revision, now=NOW)


def facts(tmp_path: Path, adapter: Any, *, current: Inventory | None = None, policy: HealthPolicy | None = None) -> InventoryFacts:
    policy = policy if policy is not None else HealthPolicy()
    return InventoryFacts(
        adapter=adapter,
        tracker=GpuTracker("node-1", health=policy),
        store=GpuStateStore(tmp_path / "state"),
        health_policy=policy,
        current=current,
    )


def _level(level: str) -> Any:
    def say(self: Log, msg: str, **kw: Any) -> None:
        self.lines.append((level, msg, kw))

    return say


class Log:
    """A StructLogger stand-in that keeps (level, message, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    debug = _level("debug")
    info = _level("info")
    warning = _level("warning")
    error = _level("error")
    exception = _level("exception")

    def said(self, msg: str) -> list[tuple[str, dict[str, Any]]]:
        """(level, fields) of every line with this message."""
        return [(level, kw) for level, m, kw in self.lines if m == msg]


async def until(what: str, probe: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
