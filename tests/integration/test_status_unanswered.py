"""`bcd status` on a service that answers its PING but not its status: a problem named, not a gap.

Seen in CI (the VM lane, right after a reboot): the converger answered $SRV.PING but not its
status within the 3 s `bcd status` gave it; the report carried `"converger": null` and no
problem, so the node read as healthy while nothing was known of its holds."""

from __future__ import annotations

import asyncio
import time

from nats.micro import add_service
from nats.micro.request import Request

from bcd import status
from bcd.client import NodeInfo
from shared.subjects import NodeSubjects

from .harness import EXAMPLE_HOSTS


async def test_a_status_that_does_not_come_is_a_problem_that_says_which(node_bus, monkeypatch):
    monkeypatch.setattr(status, "ANSWER_WAIT_S", 0.5)
    monkeypatch.setattr(status, "UNPINGED_WAIT_S", 1.5)
    subjects = NodeSubjects(node_bus.node_id)
    nc = await node_bus.connect("converger")
    asked = asyncio.Event()
    # an inventory that takes its request but never answers PING (a stopped one, say): asked
    # for UNPINGED_WAIT_S, its PING problem only
    inv = await node_bus.connect("inventory")
    inventory_asked = asyncio.Event()

    async def taken(_msg) -> None:  # noqa: ANN001
        inventory_asked.set()

    await inv.subscribe(subjects.inventory_get, cb=taken)
    await inv.flush()

    async def never(_: Request) -> None:
        asked.set()  # and no reply: a converger too busy to answer in time

    svc = await add_service(nc, name="converger", version="0.0.0")
    await svc.add_endpoint(name="status", subject=subjects.converger_status, handler=never)
    try:
        info = NodeInfo(node_id=node_bus.node_id, nats_url=node_bus.url, creds_dir=str(node_bus.creds["cli"].parent), services=["converger", "inventory"])
        t0 = time.monotonic()
        report = await asyncio.wait_for(status.gather(info), 10)
        took = time.monotonic() - t0
        assert asked.is_set() and inventory_asked.is_set()
        # all asked at once: the longest wait, not the sum
        assert 1.5 <= took < 3.5, took
        assert report.converger is None and "converger" in report.services
        found = status.problems(report)
        assert "service converger answers $SRV.PING but not its status (no answer within 0.5 s)" in found, found
        # its claims endpoint is not served at all: said as well, with the bus's reason
        assert any(p.startswith("service converger answers $SRV.PING but not its claims (") for p in found), found
        assert "service inventory does not answer $SRV.PING" in found, found
        assert not any("not its inventory" in p for p in found), found
    finally:
        await svc.stop()


async def test_a_healthy_answer_leaves_nothing_unanswered(node_bus):
    for name in ("signer", "inventory", "converger"):
        node_bus.start_service(name, BCD_ADAPTER="fakehw", BCD_FAKE_HOST=str(EXAMPLE_HOSTS / "h200x8.json"))
    for name in ("signer", "inventory", "converger"):
        await node_bus.wait_service(name)
    info = NodeInfo(node_id=node_bus.node_id, nats_url=node_bus.url, creds_dir=str(node_bus.creds["cli"].parent), services=["signer", "inventory", "converger"])
    report = await status.gather(info)
    assert report.unanswered == {}
    assert report.converger is not None and report.inventory is not None and report.claims is not None
