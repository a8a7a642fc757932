"""inventory.sharing on a real node bus: the inventory as a real process on a copy of the example
fake host, asked as the converger (the only user allowed to) for MPS daemons and time slices."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import nats.errors
import pytest

from shared.runtime import call
from shared.schemas import INVENTORY_CODEC, SHARING_STEP_REPLY_CODEC, Empty, MpsDaemonSpec, SharingStepReply, SharingStepRequest
from shared.schemas.codec import encode
from shared.subjects import NodeSubjects

from .harness import EXAMPLE_HOSTS

pytestmark = pytest.mark.integration

S = NodeSubjects("node-1")
OWNER = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13"
CONTROL = f"{OWNER}-a1b2c3"
WHOLE = "0000:18:00.0"
WHOLE_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000001"
MIG_CARD = "0000:db:00.0"
MIG_UUID = "MIG-7d3e61b0-0007-4002-8000-000000000001"


@pytest.fixture
async def inventory(node_bus: Any, tmp_path: Path) -> tuple[Any, Path, Path]:
    host_file = tmp_path / "host.json"
    host_file.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
    mps_root = tmp_path / "mps"
    node_bus.start_service(
        "inventory", BCD_ADAPTER="fakehw", BCD_FAKE_HOST=str(host_file), BCD_CDI_DIR=str(node_bus.root / "cdi"), BCD_MPS_ROOT=str(mps_root)
    )
    await node_bus.wait_service("inventory")
    return node_bus, host_file, mps_root


async def ask(nc: Any, **kw: Any) -> SharingStepReply:
    return await call(nc, S.inventory_sharing, SharingStepRequest(owner=OWNER, **kw), SHARING_STEP_REPLY_CODEC, timeout=15)


async def test_the_converger_starts_lists_and_stops_an_mps_daemon_and_sets_a_time_slice(inventory: Any) -> None:
    bus, host_file, mps_root = inventory
    nc = await bus.connect("converger")
    # the converger's claim specs mount <mps root>/<control>/pipe: the inventory names its root
    assert (await call(nc, S.inventory_get, Empty(), INVENTORY_CODEC)).mps_root == str(mps_root)
    spec = MpsDaemonSpec(control=CONTROL, uuids=[WHOLE_UUID, MIG_UUID], active_thread_percentage=50, pinned_memory={MIG_UUID: 4 * 2**30})

    started = await ask(nc, step="mps-start", mps=spec)
    assert (started.step, started.outcome) == ("mps-start", "done"), started.message
    daemons = json.loads(host_file.read_text())["mps_daemons"]
    assert daemons == [
        {
            "control": CONTROL, "uuids": [WHOLE_UUID, MIG_UUID], "pipe_dir": str(mps_root / CONTROL / "pipe"), "log_dir": str(mps_root / CONTROL / "log"),
            "active_thread_percentage": 50, "pinned_memory": {MIG_UUID: 4 * 2**30},
        }
    ]
    assert stat.S_ISFIFO(os.lstat(mps_root / CONTROL / "pipe" / "control").st_mode)
    assert stat.S_IMODE(os.lstat(mps_root / CONTROL / "log").st_mode) == 0o755
    assert (await ask(nc, step="mps-start", mps=spec)).ok  # the converger's retry after a crash
    other = await ask(nc, step="mps-start", mps=MpsDaemonSpec(control=CONTROL, uuids=[WHOLE_UUID]))
    assert other.outcome == "refused" and "another spec" in other.message

    listed = await ask(nc, step="mps-list")
    assert (listed.outcome, listed.controls) == ("done", [CONTROL])

    sliced = await ask(nc, step="timeslice-set", pci=WHOLE, interval="Long")
    assert sliced.ok, sliced.message
    assert json.loads(host_file.read_text())["gpus"][0]["timeslice"] == "Long"

    stopped = await ask(nc, step="mps-stop", control=CONTROL)
    assert stopped.ok, stopped.message
    assert json.loads(host_file.read_text())["mps_daemons"] == [] and not (mps_root / CONTROL).exists()
    assert (await ask(nc, step="mps-stop", control=CONTROL)).outcome == "not-found"
    assert (await ask(nc, step="mps-list")).controls == []


async def test_wrong_requests_are_answered_not_errors(inventory: Any) -> None:
    bus, host_file, mps_root = inventory
    nc = await bus.connect("converger")
    before = host_file.read_bytes()
    for kw, why in (
        ({"step": "mps-start"}, "needs mps"),
        ({"step": "mps-stop"}, "needs control"),
        ({"step": "timeslice-set"}, "needs pci"),
        ({"step": "timeslice-set", "pci": "0000:99:00.0"}, "lists no GPU"),
        ({"step": "timeslice-set", "pci": MIG_CARD}, "whole cards"),
        ({"step": "mps-start", "mps": MpsDaemonSpec(control=CONTROL, uuids=["GPU-00000000-0000-4000-8000-00000000ffff"])}, "no GPU or MIG device"),
    ):
        reply = await ask(nc, **kw)
        assert reply.outcome == "refused" and why in reply.message, (kw, reply)
    # a control id that is not one never reaches the inventory's paths: the schema refuses it
    msg = await nc.request(S.inventory_sharing, b'{"step": "mps-stop", "control": "../../etc"}', timeout=5)
    assert msg.headers and "Nats-Service-Error-Code" in msg.headers
    assert host_file.read_bytes() == before and not mps_root.exists()


@pytest.mark.parametrize("user", ["dra_plugin", "inventory", "cli", "helper"])
async def test_no_other_user_may_ask_for_a_sharing_step(inventory: Any, user: str) -> None:
    bus, host_file, mps_root = inventory
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await bus.connect(user, error_cb=on_error)
    body = encode(SharingStepRequest(step="mps-start", mps=MpsDaemonSpec(control=CONTROL, uuids=[WHOLE_UUID])))
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await nc.request(S.inventory_sharing, body, timeout=0.5)
    for _ in range(40):
        if errors:
            break
        await asyncio.sleep(0.05)
    assert any("permissions violation" in e.lower() and "inventory.sharing" in e for e in errors), errors
    assert "mps_daemons" not in json.loads(host_file.read_text()) and not mps_root.exists()
