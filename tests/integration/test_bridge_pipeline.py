"""Issue 13: the bridge forwards the outbox with several events in flight, and still in order.

A real node bus (`NodeBus`, the production users and permissions) with the
outbox stream made as the converger makes it, the real signer, a stand-in
converger (the Hello needs its status) and the real gateway_bridge as an OS
process. Upstream is a separate nats-server with the upstream account (as in
test_e2e's outage test), so it can be stalled, killed and started again on
its store; the test plays the control plane and reads `BCD_EVENTS` itself.
For the in-flight count the stream is replaced by a test double: a plain
subscriber on the node's event subjects that answers the PubAcks itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from datetime import datetime, timezone
from pathlib import Path

import nats
import nats.errors
import pytest

from bcd.nodebus import NatsServer, prepare_node_bus
from controlplane.keys import load_or_create_cp_key
from controlplane.serve import ControlPlane
from shared.eventorder import gpus_header
from shared.schemas import NODE_SPEC_CODEC, SIGNED_NODE_SPEC_CODEC, ConvergerStatus, Inventory, NodeSpec, SpecAck, encode
from shared.signing import sign_node_spec
from shared.subjects import (
    CONTROLPLANE_USER,
    MSG_ID_HEADER,
    UPSTREAM_EVENTS_STREAM,
    UPSTREAM_INVENTORY_BUCKET,
    UPSTREAM_NODES_BUCKET,
    NodeSubjects,
    inbox_prefix,
    upstream_node_user,
)

from .harness import EXAMPLE_HOSTS, NodeBus, upstream_only, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NODE = "node-1"
TYPES = ("section", "condition", "gpu", "failed")
DOUBLE_USER, DOUBLE_PASSWORD = "double", "double-password"


def event_id(i: int) -> str:
    return f"{NODE}.pipeline.{i:04d}"


class Rig:
    """The node bus with its outbox, the signer, a stand-in converger, an upstream server and the bridge."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bus = NodeBus(root, node_id=NODE)
        self.subjects = NodeSubjects(NODE)
        self.host_file = root / "host.json"
        self.host_file.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
        self.upstream: NatsServer | None = None
        self.bridge = None
        self.put_count = 0
        #: converger.status requests the stand-in converger answered (the bridge asks one per Hello)
        self.status_requests = 0

    async def start(self, *, double: bool = False, max_payload: int | None = None, events_stream: bool = True) -> None:
        self.bus.start(streams=False)
        self.bus.setup_streams(outbox_max_bytes=64 * 1024 * 1024)
        up_dir = self.root / "upstream"
        conf, self.up_creds = prepare_node_bus(up_dir / "bus", up_dir / "js", NODE, upstream_nodes=[NODE])
        cfg = upstream_only(conf)  # this server plays upstream alone
        if double:
            cfg["accounts"]["UPSTREAM"]["users"].append({"user": DOUBLE_USER, "password": DOUBLE_PASSWORD})
        if max_payload is not None:
            cfg["max_payload"] = max_payload
        conf.write_text(json.dumps(cfg))
        self.upstream = NatsServer(conf, up_dir / "nats.log").start()
        # started again on the same port (and store) after a kill
        cfg["port"] = self.upstream.port
        conf.write_text(json.dumps(cfg))
        cp_key, _ = load_or_create_cp_key(self.root / "cp")
        cp = await self.cp_connect()
        try:
            await ControlPlane(cp, cp_key, self.root / "cpstate", out=None).ensure_upstream()
            if not events_stream:
                await cp.jetstream().delete_stream(UPSTREAM_EVENTS_STREAM)
        finally:
            await cp.close()

        # the store account's JetStream as it is; the converger and the inventory stood in for
        # by their own users (what they journal and announce goes where theirs does)
        await self.connect_bus()

        async def converger_status(msg) -> None:
            self.status_requests += 1
            await msg.respond(encode(ConvergerStatus(generation=None)))

        await self.conv.subscribe(self.subjects.converger_status, cb=converger_status)
        await self.conv.flush()
        self.bus.start_service("signer", BCD_FAKE_HOST=str(self.host_file), BCD_ADAPTER="fakehw")
        await self.bus.wait_service("signer", timeout=30)

    async def connect_bus(self) -> None:
        self.admin = await self.bus.connect("admin")
        self.js = self.admin.jetstream()
        self.conv = await self.bus.connect("converger")
        self.inv = await self.bus.connect("inventory")

    async def cp_connect(self):
        assert self.upstream is not None
        return await nats.connect(
            self.upstream.url,
            user=CONTROLPLANE_USER,
            password=self.up_creds[CONTROLPLANE_USER].read_text().strip(),
            inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode(),
            allow_reconnect=False,
        )

    async def start_bridge(self) -> None:
        assert self.upstream is not None
        self.bridge = self.bus.start_service(
            "gateway_bridge",
            BCD_UPSTREAM_URL=self.upstream.url,
            BCD_UPSTREAM_PASSWORD_FILE=str(self.up_creds[upstream_node_user(NODE)]),
            BCD_LOG_LEVEL="DEBUG",
        )
        await self.bus.wait_service("gateway_bridge", timeout=30)

    def bridge_log(self) -> str:
        return self.bridge.log() if self.bridge is not None else ""

    async def wait_hello(self) -> None:
        await wait_until(lambda: "hello published" in self.bridge_log(), 30, "the bridge's Hello upstream")

    async def put(self, n: int, size: int = 0) -> list[str]:
        """Journal `n` events into the outbox as the converger does; their ids, in outbox order."""
        ids = []
        for _ in range(n):
            i = self.put_count
            self.put_count += 1
            body = json.dumps({"i": i, "pad": "x" * size}).encode()
            eid = event_id(i)
            kind = TYPES[i % len(TYPES)]
            # each event type journaled by its writer's own identity (the inventory's gpu events)
            writer = self.inv if kind == "gpu" else self.conv
            await writer.jetstream().publish(self.subjects.outbox_subject(kind), body, headers={MSG_ID_HEADER: eid})
            ids.append(eid)
        await self.conv.publish(self.subjects.converger_journaled, b"")
        return ids

    async def outbox_depth(self) -> int:
        return (await self.js.stream_info(self.subjects.outbox_stream)).state.messages

    async def upstream_ids(self) -> list[str]:
        """Every Nats-Msg-Id in BCD_EVENTS, in stream order (empty while upstream is down)."""
        try:
            cp = await self.cp_connect()
        except (OSError, nats.errors.Error, asyncio.TimeoutError):
            return []
        try:
            js = cp.jetstream()
            state = (await js.stream_info(UPSTREAM_EVENTS_STREAM)).state
            out = []
            for seq in range(state.first_seq, state.last_seq + 1):
                msg = await js.get_msg(UPSTREAM_EVENTS_STREAM, seq)
                out.append((msg.headers or {}).get(MSG_ID_HEADER, ""))
            return out
        finally:
            await cp.close()

    async def wait_drained(self, expected: list[str], timeout: float = 60.0) -> list[str]:
        async def drained():
            if await self.outbox_depth():
                return None
            ids = await self.upstream_ids()
            return ids if set(expected) <= set(ids) else None

        return await wait_until(drained, timeout, f"{len(expected)} events upstream and the outbox empty", interval=0.3)

    async def aclose(self) -> None:
        try:
            await self.bus.aclose()
        finally:
            if self.upstream is not None:
                if self.upstream.proc is not None and self.upstream.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.upstream.proc.pid, signal.SIGCONT)
                self.upstream.stop()


@pytest.fixture
async def rig(tmp_path):
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        await r.aclose()


def first_occurrences(ids: list[str]) -> list[str]:
    seen: set[str] = set()
    return [i for i in ids if not (i in seen or seen.add(i))]


# ------------------------------------------------------------------ (1) many events, each once, in order


async def test_200_events_are_forwarded_once_each_in_outbox_order_and_the_outbox_empties(rig):
    await rig.start()
    expected = await rig.put(200)
    assert await rig.outbox_depth() == 200
    await rig.start_bridge()
    await rig.wait_hello()
    started = time.monotonic()
    ids = await rig.wait_drained(expected)
    print(f"200 events forwarded in {time.monotonic() - started:.2f}s (including the test's polling)")
    assert ids == expected  # each exactly once (not merely de-duplicated), in outbox order

    # the payloads and subjects made it unchanged
    cp = await rig.cp_connect()
    try:
        js = cp.jetstream()
        first = (await js.stream_info(UPSTREAM_EVENTS_STREAM)).state.first_seq
        for k in (0, 1, 63, 64, 199):
            msg = await js.get_msg(UPSTREAM_EVENTS_STREAM, first + k)
            assert json.loads(msg.data)["i"] == k
            assert msg.subject == f"bcd.events.{NODE}.{TYPES[k % len(TYPES)]}"
    finally:
        await cp.close()

    # new events still go at once (the outbox wake-up), without waiting for the idle poll
    more = await rig.put(3)
    ids = await rig.wait_drained(expected + more, timeout=10)
    assert ids == expected + more
    assert rig.bridge.proc.poll() is None
    assert "Traceback" not in rig.bridge_log()


# ------------------------------------------------------------------ (2) upstream refusing and going away


async def test_upstream_refusing_stalling_and_dying_mid_way_loses_nothing_and_keeps_the_order(rig):
    await rig.start()
    await rig.start_bridge()
    await rig.wait_hello()
    expected = await rig.put(50)
    await rig.wait_drained(expected)

    # the stream stops taking this node's subjects: every publish gets "no responders"
    cp = await rig.cp_connect()
    try:
        js = cp.jetstream()
        cfg = (await js.stream_info(UPSTREAM_EVENTS_STREAM)).config
        subjects = list(cfg.subjects or [])
        cfg.subjects = ["bcd.events.somebody-else.>"]
        await js.update_stream(cfg)
        expected += await rig.put(40)
        await wait_until(lambda: "waiting for upstream stream BCD_EVENTS" in rig.bridge_log(), 20, "the bridge to wait for the stream")
        assert await rig.outbox_depth() == 40
        cfg.subjects = subjects
        await js.update_stream(cfg)
    finally:
        await cp.close()
    await rig.wait_drained(expected)

    # stalled with a window on the wire, then killed, more events journaled while it is down
    assert rig.upstream is not None and rig.upstream.proc is not None
    os.kill(rig.upstream.proc.pid, signal.SIGSTOP)
    expected += await rig.put(150)
    await asyncio.sleep(1.5)
    rig.upstream.kill()
    expected += await rig.put(100)
    await asyncio.sleep(1.0)
    assert await rig.outbox_depth() >= 250
    rig.upstream.start()

    ids = await rig.wait_drained(expected, timeout=90)
    assert set(ids) == set(expected)  # nothing lost
    assert first_occurrences(ids) == expected, "upstream's order (first occurrence of each event id) is not the outbox's"
    print(f"{len(expected)} events, {len(ids) - len(expected)} stored twice upstream")
    assert rig.bridge.proc.poll() is None
    assert "Traceback" not in rig.bridge_log()


# ------------------------------------------------------------------ (3) several in flight, seen by a test double


class Double:
    """Plays BCD_EVENTS: holds PubAcks until THRESHOLD publishes are outstanding (or a second passed).

    A bridge that waits for each PubAck before the next publish never has more
    than one outstanding: it is answered after the second only.
    """

    THRESHOLD = 32
    HOLD_S = 1.0

    def __init__(self, refuse_once: str) -> None:
        self.received: list[str] = []
        self.outstanding: list[tuple[float, str, str]] = []
        self.flushes: list[list[str]] = []
        self.max_outstanding = 0
        self.refuse_once = refuse_once
        self.refused = False
        self.seq = 0

    async def start(self, url: str) -> None:
        self.nc = await nats.connect(url, user=DOUBLE_USER, password=DOUBLE_PASSWORD)
        await self.nc.subscribe(f"bcd.events.{NODE}.>", cb=self.on_msg)
        await self.nc.flush()
        self.timer = asyncio.create_task(self.tick())

    async def on_msg(self, msg) -> None:
        eid = (msg.headers or {}).get(MSG_ID_HEADER, "")
        self.received.append(eid)
        self.outstanding.append((time.monotonic(), eid, msg.reply))
        self.max_outstanding = max(self.max_outstanding, len(self.outstanding))
        if len(self.outstanding) >= self.THRESHOLD:
            await self.flush()

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            if self.outstanding and time.monotonic() - self.outstanding[0][0] >= self.HOLD_S:
                await self.flush()

    async def flush(self) -> None:
        batch, self.outstanding = self.outstanding, []
        self.flushes.append([eid for _, eid, _ in batch])
        for _, eid, reply in batch:
            if eid == self.refuse_once and not self.refused:
                self.refused = True
                body = {"error": {"code": 503, "err_code": 10999, "description": "refused once by the test"}}
            else:
                self.seq += 1
                body = {"stream": UPSTREAM_EVENTS_STREAM, "seq": self.seq}
            await self.nc.publish(reply, json.dumps(body).encode())

    async def close(self) -> None:
        self.timer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.timer
        await self.nc.close()


async def test_the_forward_has_a_window_in_flight_and_a_refusal_is_retried_alone_then_in_order(rig):
    await rig.start(double=True, events_stream=False)
    expected = await rig.put(200)
    refused = 100
    double = Double(refuse_once=expected[refused])
    assert rig.upstream is not None
    await double.start(rig.upstream.url)
    try:
        await rig.start_bridge()
        await rig.wait_hello()
        # a pipelined bridge sends a whole window at once; one waiting for each PubAck gets one per HOLD_S
        await wait_until(lambda: len(double.received) >= Double.THRESHOLD, 10, "a window's worth of publishes")
        # several in flight: a one-at-a-time bridge never has more than one publish unanswered
        assert double.max_outstanding >= Double.THRESHOLD, f"at most {double.max_outstanding} publishes were in flight at once"

        async def done():
            return await rig.outbox_depth() == 0 and len(double.received) >= 200

        await wait_until(done, 60, "the outbox drained into the double", interval=0.2)
        await asyncio.sleep(0.5)  # nothing more follows
    finally:
        await double.close()

    # the events before the refused one went once; it and everything after it again, in order
    end = next(k for k in range(refused + 1, len(double.received) + 1) if double.received[k] == expected[refused])
    assert refused < end <= 200
    assert double.received == expected[:end] + expected[refused:], double.received
    # the refused one was sent again alone (one at a time after a failure), not as a window
    again = [f for f in double.flushes if expected[refused] in f][1]
    assert again == [expected[refused]], again
    assert "forwarding an event failed; it stays in the outbox" in rig.bridge_log()
    assert rig.bridge.proc.poll() is None


async def forward_through(rig, double: Double, want: set[str]) -> None:
    """Start the bridge against `double` and wait until the outbox is empty and `want` all went."""
    assert rig.upstream is not None
    await double.start(rig.upstream.url)
    try:
        await rig.start_bridge()
        await rig.wait_hello()

        async def done():
            return await rig.outbox_depth() == 0 and want <= set(double.received)

        await wait_until(done, 60, "the outbox drained into the double", interval=0.2)
    finally:
        await double.close()


async def test_a_bound_waits_for_every_released_before_it_even_when_one_is_refused(rig):
    """Releases then binds in the outbox (a generation moving GPUs): the Bounds are a window of
    their own, sent once every Released before them is acked, so a Released refused mid-window
    never lets a Bound that may take its GPU reach upstream first."""
    await rig.start(double=True, events_stream=False)
    released, bound = [], []
    for k in range(30):
        eid = f"{NODE}.r{k}.released.g2"
        await rig.js.publish(rig.subjects.outbox_subject("released"), b"{}", headers={MSG_ID_HEADER: eid})
        released.append(eid)
    for k in range(30):
        eid = f"{NODE}.b{k}.bound.g2"
        await rig.js.publish(rig.subjects.outbox_subject("bound"), b"{}", headers={MSG_ID_HEADER: eid})
        bound.append(eid)
    double = Double(refuse_once=released[10])
    await forward_through(rig, double, set(bound))
    assert double.refused
    first_bound = min(double.received.index(b) for b in bound)
    # every Released was sent again after its refusal and acked before any Bound went
    assert max(len(double.received) - 1 - double.received[::-1].index(r) for r in released) < first_bound
    assert first_occurrences(double.received) == released + bound


def _card(k: int) -> str:
    return f"GPU-{k:08x}-0000-4000-8000-000000000000"


async def test_a_bound_on_another_card_goes_beside_an_unacked_released_and_one_on_its_card_waits(rig):
    """Cards in GPUS_HEADER (shared.eventorder): a Bound naming no card a Released in flight
    names is sent at once, in the same window; one that shares a card waits until every
    Released naming that card is acked, even when one of them is refused mid-window."""
    await rig.start(double=True, events_stream=False)
    released, free, taking = [], [], []
    for k in range(30):
        eid = f"{NODE}.r{k}.released.g2"
        await rig.js.publish(rig.subjects.outbox_subject("released"), b"{}", headers={MSG_ID_HEADER: eid, **gpus_header(frozenset({_card(k)}))})
        released.append(eid)
    for k in range(15):  # on cards nothing releases
        eid = f"{NODE}.f{k}.bound.g2"
        await rig.js.publish(rig.subjects.outbox_subject("bound"), b"{}", headers={MSG_ID_HEADER: eid, **gpus_header(frozenset({_card(100 + k)}))})
        free.append(eid)
    for k in range(15):  # each takes the card of r10 + k
        eid = f"{NODE}.t{k}.bound.g2"
        await rig.js.publish(rig.subjects.outbox_subject("bound"), b"{}", headers={MSG_ID_HEADER: eid, **gpus_header(frozenset({_card(10 + k)}))})
        taking.append(eid)
    double = Double(refuse_once=released[10])
    await forward_through(rig, double, set(free + taking))
    assert double.refused
    got = double.received

    def last(e: str) -> int:
        return len(got) - 1 - got[::-1].index(e)

    # the free Bounds went in the first window, before the refused Released went again
    assert max(got.index(b) for b in free) < last(released[10]), got
    # a Bound on a released card only after every Released of that card was acked (the refused one's retry included)
    for k, b in enumerate(taking):
        assert last(released[10 + k]) < got.index(b), (b, got)
    assert set(first_occurrences(got)) == set(released + free + taking)


# ------------------------------------------------------------------ a message over upstream's max_payload stops the window before it


async def test_a_message_over_upstream_max_payload_is_not_sent_and_nothing_after_it_goes_first(rig):
    limit = 16 * 1024
    await rig.start(max_payload=limit)
    before = await rig.put(10)
    # the payload alone fits (nats-py's own check passes it); with the Nats-Msg-Id header it does not,
    # and the server would close the connection on it
    big_seq = (await rig.js.publish(rig.subjects.outbox_subject("gpu"), b"x" * (limit - 8), headers={MSG_ID_HEADER: f"{NODE}.big"})).seq
    after = await rig.put(10)
    await rig.start_bridge()
    await rig.wait_hello()

    def refusals():
        return rig.bridge_log().count("exceed upstream's max_payload")

    await wait_until(lambda: refusals() >= 2, 30, "the big event refused (and retried)")
    assert await rig.upstream_ids() == before
    assert await rig.outbox_depth() == 11
    assert "upstream disconnected" not in rig.bridge_log()

    # an operator takes the big one out: the rest follows, in order
    await rig.js.delete_msg(rig.subjects.outbox_stream, big_seq)
    ids = await rig.wait_drained(before + after, timeout=30)
    assert ids == before + after
    assert rig.bridge.proc.poll() is None


async def test_a_signed_spec_the_node_bus_cannot_carry_is_refused_and_the_next_is_handed_over(rig):
    """The bridge relays the envelope as it came (the converger verifies it itself): one that fits
    upstream's max_payload but not the node bus's is refused with that reason, never retried forever."""
    await rig.start(max_payload=4 * 1024 * 1024)
    handed: list[bytes] = []

    async def converger_spec(msg) -> None:  # a stand-in converger: what reaches it, as it came
        handed.append(msg.data)
        signed = SIGNED_NODE_SPEC_CODEC.decode(msg.data)
        await msg.respond(encode(SpecAck(generation=NODE_SPEC_CODEC.decode(signed.spec).generation)))

    await rig.conv.subscribe(rig.subjects.converger_spec, cb=converger_spec)
    await rig.conv.flush()
    await rig.start_bridge()
    cp_key, _ = load_or_create_cp_key(rig.root / "cp")
    # a spec the node takes (its unknown field is ignored), whose envelope is above the node bus's 1 MiB
    big = sign_node_spec(cp_key, json.dumps({"node_id": NODE, "generation": 5, "pad": "x" * 900_000}).encode())
    small = encode(sign_node_spec(cp_key, NodeSpec(node_id=NODE, generation=6)))
    cp = await rig.cp_connect()
    try:
        await cp.jetstream().publish(f"$KV.bcd_nodespecs.{NODE}", encode(big))
        await wait_until(lambda: "above the node bus's max_payload of 1048576" in rig.bridge_log(), 30, "the big spec refused")
        assert handed == []
        await cp.jetstream().publish(f"$KV.bcd_nodespecs.{NODE}", small)
        await wait_until(lambda: handed, 30, "the next spec handed over")
    finally:
        await cp.close()
    assert handed == [small]  # byte for byte as upstream has it
    assert rig.bridge_log().count("above the node bus's max_payload") == 1  # said once, not retried
    assert rig.bridge.proc.poll() is None


# ------------------------------------------------------------------ the outbox consumer: lost, restarted, resumed


async def test_the_bridge_reads_the_outbox_without_a_consumer(rig):
    """No service may make a consumer (a deliver subject would let it have the server publish
    for it): the bridge reads by direct get and forwards everything, in order, once."""
    await rig.start()
    await rig.start_bridge()
    await rig.wait_hello()
    expected = await rig.put(30)
    await rig.wait_drained(expected)
    stream = rig.subjects.outbox_stream
    assert await rig.js.consumers_info(stream) == []
    expected += await rig.put(30)
    ids = await rig.wait_drained(expected, timeout=30)
    assert ids == expected  # none twice, none missing
    assert await rig.js.consumers_info(stream) == []
    assert "Traceback" not in rig.bridge_log()


async def test_after_a_node_bus_restart_the_bridge_reads_on_after_the_last_message_it_had(rig):
    await rig.start()
    await rig.start_bridge()
    await rig.wait_hello()
    expected = await rig.put(20)
    await rig.wait_drained(expected)
    # the same port and store: the stream survives
    server = rig.bus.server
    assert server is not None
    cfg = json.loads(server.config_path.read_text())
    cfg["port"] = server.port
    server.config_path.write_text(json.dumps(cfg))
    server.stop()
    await asyncio.sleep(0.5)
    server.start()
    await rig.connect_bus()
    expected += await rig.put(20)
    ids = await rig.wait_drained(expected, timeout=60)
    assert ids == expected
    assert "the outbox stream was made again" not in rig.bridge_log()
    assert rig.bridge.proc.poll() is None


async def test_an_outbox_made_again_is_read_from_its_start_and_nothing_of_it_is_purged_unforwarded(rig):
    """The stream deleted and created again under the bridge: its sequences start over, so
    what the bridge acknowledged of the old one must not purge the new one."""
    await rig.start()
    await rig.start_bridge()
    await rig.wait_hello()
    expected = await rig.put(40)
    await rig.wait_drained(expected)
    await rig.js.delete_stream(rig.subjects.outbox_stream)
    rig.bus.setup_streams(outbox_max_bytes=64 * 1024 * 1024)
    expected += await rig.put(10)
    ids = await rig.wait_drained(expected, timeout=30)
    assert ids == expected
    assert "the outbox stream was made again; reading it from its start" in rig.bridge_log()


async def test_a_restarted_bridge_forwards_from_the_first_message_left_in_the_outbox(rig):
    await rig.start()
    first = await rig.put(20)
    await rig.start_bridge()
    await rig.wait_hello()
    await rig.wait_drained(first)
    assert rig.bridge.stop() == 0  # its last purge goes before it exits
    more = await rig.put(30)
    assert await rig.outbox_depth() == 30
    await rig.start_bridge()
    ids = await rig.wait_drained(first + more)
    assert ids == first + more
    assert await rig.js.consumers_info(rig.subjects.outbox_stream) == []


# ------------------------------------------------------------------ Hello and inventory records


async def test_an_inventory_change_puts_the_inventory_only_and_a_converger_status_change_the_hello(rig):
    """An inventory change costs one KV put of the inventory: no signer.key, no converger.status,
    no Hello put, unless the adapter (all the Hello takes from the inventory) changed; the
    converger's status_changed notice puts the Hello again."""
    await rig.start()
    cp = await rig.cp_connect()
    puts = {UPSTREAM_NODES_BUCKET: 0, UPSTREAM_INVENTORY_BUCKET: 0}
    revisions: list[int] = []

    async def on_put(msg) -> None:
        bucket = msg.subject.split(".")[1]
        puts[bucket] += 1
        if bucket == UPSTREAM_INVENTORY_BUCKET:
            revisions.append(json.loads(msg.data)["revision"])

    try:
        await cp.subscribe(f"$KV.{UPSTREAM_NODES_BUCKET}.{NODE}", cb=on_put)
        await cp.subscribe(f"$KV.{UPSTREAM_INVENTORY_BUCKET}.{NODE}", cb=on_put)
        await cp.flush()
        await rig.start_bridge()
        await rig.wait_hello()
        await wait_until(lambda: puts[UPSTREAM_NODES_BUCKET] == 1, 10, "the first Hello put")

        async def inventory_changed(revision: int, adapter: str) -> None:
            inv = Inventory(node_id=NODE, revision=revision, observed_at=datetime.now(timezone.utc), adapter=adapter)
            await rig.inv.publish(rig.subjects.inventory_changed, encode(inv))

        # the first inventory the bridge sees names an adapter the Hello was made without
        await inventory_changed(1, "fakehw")
        await wait_until(lambda: puts == {UPSTREAM_NODES_BUCKET: 2, UPSTREAM_INVENTORY_BUCKET: 1}, 10, "the Hello and the inventory put")
        hellos, status_requests = puts[UPSTREAM_NODES_BUCKET], rig.status_requests

        for revision in (2, 3, 4):
            await inventory_changed(revision, "fakehw")
        # changes noticed during a put are put together after it: the last one is what counts
        await wait_until(lambda: revisions[-1] == 4, 10, "the changed inventory put")
        inventories = puts[UPSTREAM_INVENTORY_BUCKET]
        await asyncio.sleep(1.5)  # a Hello would have followed by now (records retry within a second)
        assert puts[UPSTREAM_NODES_BUCKET] == hellos, "an inventory change put the Hello again"
        assert rig.status_requests == status_requests, "an inventory change asked the converger for its status"

        await rig.conv.publish(rig.subjects.converger_status_changed, b"")
        await wait_until(lambda: puts[UPSTREAM_NODES_BUCKET] == hellos + 1, 10, "the Hello put again")
        assert rig.status_requests == status_requests + 1
        await asyncio.sleep(0.5)
        assert puts[UPSTREAM_INVENTORY_BUCKET] == inventories  # and the status change did not put the inventory
    finally:
        await cp.close()
