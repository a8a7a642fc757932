"""The signer as a real process on a real node bus."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import nats
import pytest

from shared.runtime import ServiceCallError, call
from shared.schemas import (
    ATTESTED_REPORT_CODEC,
    SIGN_BATCH_MAX,
    SIGN_BATCH_REPLY_CODEC,
    SIGNER_KEY_CODEC,
    AllocationBound,
    AllocationReleased,
    Empty,
    SignBatchRequest,
    SignItem,
    SignRequest,
    encode,
)
from shared.signing import VerificationError, verify_report
from shared.subjects import NodeSubjects

pytestmark = pytest.mark.integration

BOOT_ID = "0f7e1c9a-9d5e-4d8b-8a3e-5f0b6f2c1d11"


@pytest.fixture
def fake_host(tmp_path):
    path = tmp_path / "host.json"
    path.write_text(json.dumps({"boot_id": BOOT_ID}))
    return path


@pytest.fixture
async def signer(node_bus, fake_host):
    node_bus.start_service("signer", BCD_FAKE_HOST=str(fake_host))
    await node_bus.wait_service("signer")
    return node_bus


def bound(alloc="alloc_01", gen=3):
    return AllocationBound(
        allocation_id=alloc,
        reservation_id="rsv_01",
        generation=gen,
        devices=["GPU-5f1c2a90-0000-4000-8000-000000000001"],
        cgroup_parent=f"bcd-alloc-{alloc}.slice",
        cdi_devices=["bcd.dev/gpu=GPU-5f1c2a90-0000-4000-8000-000000000001"],
    )


async def test_signs_and_report_verifies_with_published_key(signer):
    subjects = NodeSubjects(signer.node_id)
    # The converger is the signer's client on a real node.
    nc = await signer.connect("converger")
    key = await call(nc, subjects.signer_key, Empty(), SIGNER_KEY_CODEC)
    assert key.node_id == "node-1" and key.boot_id == BOOT_ID and len(key.public_key) == 32

    event = bound()
    report = await call(nc, subjects.signer_sign, SignRequest(purpose="attested-report", event_id="ev-1", event=event), ATTESTED_REPORT_CODEC)
    body = verify_report(report, key.public_key)
    assert body.node_id == "node-1"
    assert body.boot_id == BOOT_ID
    assert body.event_id == "ev-1"
    assert body.event == event
    assert report.key_id == key.key_id

    released = AllocationReleased(allocation_id="alloc_01", reservation_id="rsv_01", generation=4, devices=event.devices)
    report2 = await call(nc, subjects.signer_sign, SignRequest(purpose="attested-report", event_id="ev-2", event=released), ATTESTED_REPORT_CODEC)
    assert verify_report(report2, key.public_key).event == released

    # A tampered body no longer verifies.
    tampered = report.body.replace(b"alloc_01", b"alloc_02")
    with pytest.raises(VerificationError):
        verify_report(type(report)(key_id=report.key_id, body=tampered, signature=report.signature), key.public_key)


async def test_refuses_other_purposes_and_bad_messages_without_dying(signer):
    subjects = NodeSubjects(signer.node_id)
    nc = await signer.connect("converger")
    with pytest.raises(ServiceCallError) as refused:
        await call(nc, subjects.signer_sign, SignRequest(purpose="node-spec", event_id="ev-1", event=bound()), ATTESTED_REPORT_CODEC)
    assert refused.value.code == "403"
    assert "node-spec" in refused.value.description and "attested-report" in refused.value.description

    bad = json.loads(encode(SignRequest(purpose="attested-report", event_id="ev-1", event=bound())))
    bad["event"]["allocation_id"] = "../../etc/passwd"
    with pytest.raises(ServiceCallError) as rejected:
        await call(nc, subjects.signer_sign, json.dumps(bad).encode(), ATTESTED_REPORT_CODEC)
    assert rejected.value.code == "400"
    assert "$.event.allocation_id" in rejected.value.description

    with pytest.raises(ServiceCallError) as garbage:
        await call(nc, subjects.signer_sign, b"\xff not json", ATTESTED_REPORT_CODEC)
    assert garbage.value.code == "400"

    # still serving
    key = await call(nc, subjects.signer_key, Empty(), SIGNER_KEY_CODEC)
    assert key.node_id == "node-1"


async def test_key_file_is_0600_and_survives_restart(node_bus, fake_host):
    node_bus.start_service("signer", BCD_FAKE_HOST=str(fake_host))
    await node_bus.wait_service("signer")
    key_file = node_bus.root / "data" / "signer" / "node.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    nc = await node_bus.connect("cli")
    first = await call(nc, NodeSubjects("node-1").signer_key, Empty(), SIGNER_KEY_CODEC)

    assert node_bus.services[-1].stop() == 0
    node_bus.start_service("signer", BCD_FAKE_HOST=str(fake_host))
    await node_bus.wait_service("signer")
    second = await call(nc, NodeSubjects("node-1").signer_key, Empty(), SIGNER_KEY_CODEC)
    assert second.public_key == first.public_key


async def test_refuses_to_start_on_a_key_readable_by_others(node_bus, fake_host):
    node_bus.start_service("signer", BCD_FAKE_HOST=str(fake_host))
    await node_bus.wait_service("signer")
    assert node_bus.services[-1].stop() == 0
    key_file = node_bus.root / "data" / "signer" / "node.key"
    os.chmod(key_file, 0o644)

    sp = node_bus.start_service("signer", BCD_FAKE_HOST=str(fake_host))
    code = await asyncio.to_thread(sp.wait, 20)
    assert code == 2
    log = sp.log()
    assert "readable by others" in log and "Traceback" not in log


async def test_inventory_user_may_not_ask_for_signatures(signer):
    nc = await signer.connect("inventory")
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc2 = await signer.connect("inventory", error_cb=on_error)
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await nc2.request(NodeSubjects("node-1").signer_sign, encode(SignRequest(purpose="attested-report", event_id="ev-x", event=bound())), timeout=1)
    await nc.flush()
    assert any("permissions violation" in str(e) and "signer.sign" in str(e) for e in errors)


async def test_sigterm_stops_cleanly(signer):
    sp = signer.services[-1]
    assert sp.stop(timeout=10) == 0
    assert '"msg": "stopping"' in sp.log()


async def test_serves_metrics_on_loopback_and_logs_json_lines(signer):
    import urllib.request

    pong = await signer.wait_service("signer")
    addr = pong["metadata"]["metrics"]
    assert addr.startswith("127.0.0.1:")
    nc = await signer.connect("converger")
    await call(nc, NodeSubjects("node-1").signer_sign, SignRequest(purpose="attested-report", event_id="ev-m", event=bound()), ATTESTED_REPORT_CODEC)
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode())
    assert 'bcd_signatures_total{outcome="signed",purpose="attested-report"} 1.0' in text
    assert 'bcd_requests_total{endpoint="sign",outcome="ok"} 1.0' in text
    assert "process_cpu_seconds_total" in text

    lines = [json.loads(line) for line in signer.services[-1].log().splitlines() if line.strip()]
    assert {"ts", "level", "service", "msg"} <= set(lines[0])
    assert any(entry["msg"] == "signed" and entry["event_id"] == "ev-m" for entry in lines)


async def test_sign_batch_signs_each_body_in_order_stamped_by_the_signer(signer):
    subjects = NodeSubjects(signer.node_id)
    nc = await signer.connect("converger")
    key = await call(nc, subjects.signer_key, Empty(), SIGNER_KEY_CODEC)
    events = [bound(f"alloc_{i:02d}", gen=i) for i in range(1, 41)]
    events.append(AllocationReleased(allocation_id="alloc_01", reservation_id="rsv_01", generation=41, devices=events[0].devices))
    items = [SignItem(event_id=f"ev-{i}", event=e) for i, e in enumerate(events)]
    reply = await call(nc, subjects.signer_sign_batch, SignBatchRequest(purpose="attested-report", items=items), SIGN_BATCH_REPLY_CODEC)
    assert len(reply.reports) == len(items)
    for item, report in zip(items, reply.reports):
        body = verify_report(report, key.public_key)
        assert (body.event_id, body.event) == (item.event_id, item.event)
        assert body.node_id == "node-1" and body.boot_id == BOOT_ID and report.key_id == key.key_id
    empty = await call(nc, subjects.signer_sign_batch, SignBatchRequest(purpose="attested-report", items=[]), SIGN_BATCH_REPLY_CODEC)
    assert empty.reports == []


async def test_sign_batch_refuses_other_purposes_and_oversized_batches_whole(signer):
    subjects = NodeSubjects(signer.node_id)
    nc = await signer.connect("converger")
    items = [SignItem(event_id="ev-1", event=bound())]
    with pytest.raises(ServiceCallError) as refused:
        await call(nc, subjects.signer_sign_batch, SignBatchRequest(purpose="node-spec", items=items), SIGN_BATCH_REPLY_CODEC)
    assert refused.value.code == "403" and "node-spec" in refused.value.description
    too_many = {"purpose": "attested-report", "items": [json.loads(encode(items[0]))] * (SIGN_BATCH_MAX + 1)}
    with pytest.raises(ServiceCallError) as big:
        await call(nc, subjects.signer_sign_batch, json.dumps(too_many).encode(), SIGN_BATCH_REPLY_CODEC)
    assert big.value.code == "400" and "$.items" in big.value.description
    # a node id or boot id in the request is no field of it: the signer stamps its own
    key = await call(nc, subjects.signer_key, Empty(), SIGNER_KEY_CODEC)
    forged = {"purpose": "attested-report", "items": [{**json.loads(encode(items[0])), "node_id": "node-2", "boot_id": "other"}]}
    reply = await call(nc, subjects.signer_sign_batch, json.dumps(forged).encode(), SIGN_BATCH_REPLY_CODEC)
    body = verify_report(reply.reports[0], key.public_key)
    assert (body.node_id, body.boot_id) == ("node-1", BOOT_ID)
