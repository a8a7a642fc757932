"""The converger's outbox ports on a real node bus: pipelined publishing and batched signing.

`JetStreamOutbox.publish_many` sends a wave without waiting for each PubAck:
the stream must still hold the events in the order sent, drop a replayed
event id, refuse an event its schema refuses (only that one) and say so per
event. `BusSigner.sign_many` cuts a big batch into requests that fit the bus.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from services.converger.outbox import SIGN_BATCH_BYTES, BusSigner, JetStreamOutbox, OutboxError, sign_chunks
from shared.schemas import SIGN_BATCH_MAX, AllocationBound, SectionStatus, encode
from shared.signing import verify_report
from shared.subjects import MSG_ID_HEADER, NodeSubjects

pytestmark = pytest.mark.integration

GPU = "GPU-5f1c2a90-0000-4000-8000-000000000001"


def section(gen: int) -> bytes:
    return encode(SectionStatus(section="devices", state="CONVERGED", observed_generation=gen))


async def stream_ids(nc, subjects: NodeSubjects) -> list[str]:  # noqa: ANN001
    js = nc.jetstream()
    info = await js.stream_info(subjects.outbox_stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(subjects.outbox_stream, seq)
        out.append(msg.headers[MSG_ID_HEADER])
    return out


async def test_a_wave_lands_in_order_replays_are_dropped_and_a_bad_event_fails_alone(node_bus) -> None:
    subjects = NodeSubjects(node_bus.node_id)
    nc = await node_bus.connect("converger")
    admin = await node_bus.connect("admin")
    outbox = JetStreamOutbox(nc, subjects)
    await outbox.recheck()  # the stream the bus setup made
    assert outbox.ready
    told: list[str] = []

    async def on_journaled(msg) -> None:  # noqa: ANN001
        told.append(msg.subject)

    bridge = await node_bus.connect("gateway_bridge")
    await bridge.subscribe(subjects.converger_journaled, cb=on_journaled)
    await bridge.flush()
    acked: list[str] = []
    items = [("section", f"e{k}", section(k)) for k in range(300)]
    results = await outbox.publish_many(items, acked=lambda item: acked.append(item[1]))
    assert results == [None] * 300
    assert acked == [f"e{k}" for k in range(300)]
    assert await stream_ids(admin, subjects) == [f"e{k}" for k in range(300)]
    # the bridge is told once a wave is journaled (it reads the outbox with no consumer to wake it)
    await nc.flush()
    for _ in range(50):
        if told:
            break
        await asyncio.sleep(0.02)
    assert told == [subjects.converger_journaled]

    # a replay of the first 100 with 10 new ones among them, and one the schema refuses
    again = [*items[:50], ("section", "new1", section(1)), ("bound", "bad", b'{"not": "a report"}'), *items[50:100], ("section", "new2", section(2))]
    results = await outbox.publish_many(again)
    bad = [k for k, r in enumerate(results) if r is not None]
    assert bad == [51] and isinstance(results[51], OutboxError) and "violates its schema" in str(results[51])
    assert await stream_ids(admin, subjects) == [*(f"e{k}" for k in range(300)), "new1", "new2"]


async def test_sign_many_cuts_a_big_batch_and_keeps_the_order(node_bus, tmp_path) -> None:
    host = tmp_path / "host.json"
    host.write_text(json.dumps({"boot_id": "0f7e1c9a-9d5e-4d8b-8a3e-5f0b6f2c1d11"}))
    node_bus.start_service("signer", BCD_FAKE_HOST=str(host))
    await node_bus.wait_service("signer")
    nc = await node_bus.connect("converger")
    signer = BusSigner(nc, NodeSubjects(node_bus.node_id))
    # long cdi device names make each event big: the batch needs several requests
    events = [
        (
            f"node-1.a{k}.bound.g1",
            AllocationBound(
                allocation_id=f"a{k}", reservation_id="r", generation=1, devices=[GPU], cdi_devices=[f"bcd.dev/gpu=a{k}-{j}-" + "x" * 200 for j in range(8)]
            ),
        )
        for k in range(SIGN_BATCH_MAX + 50)
    ]
    chunks = sign_chunks(events)
    assert len(chunks) > 2 and all(len(c) <= SIGN_BATCH_MAX for c in chunks)
    assert all(sum(len(encode(e)) for _, e in c) <= SIGN_BATCH_BYTES for c in chunks)
    reports = await signer.sign_many(events)
    from shared.runtime import call
    from shared.schemas import SIGNER_KEY_CODEC, Empty

    key = (await call(nc, NodeSubjects(node_bus.node_id).signer_key, Empty(), SIGNER_KEY_CODEC)).public_key
    assert [verify_report(r, key).event_id for r in reports] == [i for i, _ in events]
