"""The converger as a real process against odd files and a nearly full node-bus store (issue 11, points 3, 10, 11).

- A JetStream whose `max_file_store` is below the outbox's 256 MiB reservation
  refused the stream (`insufficient storage resources available`, err_code
  10047) and the converger crash-looped on it. Now the bus setup gives the
  outbox the largest size the server accepts (a warning, in status and doctor),
  the node binds; below the floor there is no outbox, the setup fails saying
  why, the converger still answers and says so.
- A FIFO named `bcd-x.json` in the CDI dir (and `x.env` in the allocations
  dir) hung the converger for good; now it is reported and skipped.
- A garbage `nvidia.json` is a doctor failure, and new holds wait for it.

Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from bcd.nodebus import NatsServer, prepare_node_bus
from bcd.status import NodeReport, doctor_checks
from services.converger.outbox import JetStreamOutbox, OutboxError
from shared.busstreams import MIN_OUTBOX_BYTES, StreamSetupError
from shared.runtime import call
from shared.schemas import CONVERGER_STATUS_CODEC, SPEC_ACK_CODEC, ConvergerStatus, DeviceAssignment, Empty, NodeSpec, SectionStatus, encode
from shared.subjects import NodeSubjects

from .harness import EXAMPLE_HOSTS, NodeBus

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]


async def small_bus(root: Path, max_file_store: int) -> NodeBus:
    """A node bus whose JetStream may store at most `max_file_store` bytes (no stream made yet)."""
    bus = NodeBus(root)
    conf, bus.creds = prepare_node_bus(root / "bus", root / "js", bus.node_id, admin=True)
    doc = json.loads(conf.read_text())
    doc["jetstream"]["max_file_store"] = max_file_store
    conf.write_text(json.dumps(doc))
    bus.server = NatsServer(conf, root / "bus" / "nats-server.log").start()
    return bus


def hold(alloc: str, *devices: str) -> DeviceAssignment:
    return DeviceAssignment(allocation_id=alloc, reservation_id=f"rsv-{alloc}", binding="BINDING_HOLD", devices=list(devices))


class Node:
    def __init__(self, bus: NodeBus, root: Path) -> None:
        self.bus = bus
        self.subjects = NodeSubjects(bus.node_id)
        self.cdi = bus.root / "cdi"
        self.run = bus.root / "run"
        self.host_file = root / "host.json"
        self.host_file.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())

    def env(self) -> dict[str, str]:
        return {"BCD_FAKE_HOST": str(self.host_file), "BCD_ADAPTER": "fakehw"}

    async def start(self, *, converger: bool = True) -> None:
        self.bus.start_service("signer", **self.env())
        self.bus.start_service("inventory", **self.env())
        await self.bus.wait_service("signer")
        await self.bus.wait_service("inventory")
        self.bridge = await self.bus.connect("gateway_bridge")
        self.cli = await self.bus.connect("cli")
        if converger:
            await self.start_converger()

    async def start_converger(self) -> None:
        self.converger = self.bus.start_service("converger", **self.env())
        await self.bus.wait_service("converger")

    async def status(self) -> ConvergerStatus:
        return await call(self.cli, self.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=3)

    async def push(self, spec: NodeSpec) -> None:
        await call(self.bridge, self.subjects.converger_spec, self.bus.signed_spec(spec), SPEC_ACK_CODEC, timeout=3)

    async def wait_status(self, ok, what: str, timeout: float = 20.0) -> ConvergerStatus:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            st = await self.status()
            if ok(st):
                return st
            await asyncio.sleep(0.1)
        raise AssertionError(f"{what} not reached in {timeout}s: {st}\n{self.converger.log()[-3000:]}")

    def doctor(self, st: ConvergerStatus) -> dict[str, tuple[str, str]]:
        rows = doctor_checks(NodeReport(node_id=self.bus.node_id, reachable=True, services={}, converger=st))
        return {name: (level, msg) for level, name, msg in rows}


def converged(gen: int):  # noqa: ANN201
    return lambda st: st.section is not None and st.section.observed_generation == gen and st.section.state == "CONVERGED"


# ---------------------------------------------------------------------------- the outbox on a small store


async def test_the_outbox_takes_the_largest_size_a_small_jetstream_accepts(tmp_path: Path) -> None:
    bus = await small_bus(tmp_path, 200 * MIB)
    try:
        # the bus setup, against the real server
        made = bus.setup_streams()
        assert MIN_OUTBOX_BYTES <= made.max_bytes < 256 * MIB
        # about three quarters of the largest the server takes: the rest is left to the
        # node's other streams (the inventory's KV bucket is refused on a fully reserved store)
        assert 140 * MIB <= made.max_bytes <= 160 * MIB, made.max_bytes
        assert f"outbox reduced to {made.max_bytes // MIB} MiB of the 256 MiB asked" in made.warning
        assert "MiB free on the node bus's store" in made.warning and "--outbox-max-bytes" in made.warning
        nc = await bus.connect("converger")
        info = await nc.jetstream().stream_info(NodeSubjects(bus.node_id).outbox_stream)
        assert info.config.max_bytes == made.max_bytes
        # the setup again (a restart) finds the reduced stream and keeps it (never shrinks it)
        again = bus.setup_streams()
        assert again.max_bytes == made.max_bytes and again.warning
        # the converger's port reads what the setup made, and says it is smaller
        outbox = JetStreamOutbox(nc, NodeSubjects(bus.node_id))
        await outbox.recheck()
        assert outbox.ready and not outbox.error and outbox.max_bytes == made.max_bytes
        assert f"outbox reduced to {made.max_bytes // MIB} MiB of the 256 MiB asked" in outbox.warning

        # the real converger: starts, binds, and says the outbox is smaller
        node = Node(bus, tmp_path)
        await node.start()
        await node.push(NodeSpec(node_id=bus.node_id, generation=1, devices=[hold("a1", GPU[0])]))
        st = await node.wait_status(converged(1), "generation 1 CONVERGED")
        assert [h.allocation_id for h in st.holds] == ["a1"] and st.holds[0].reported
        assert st.outbox_warning and not st.outbox_error
        assert st.outbox_warning in st.problems
        assert node.doctor(st)["outbox-size"] == ("warn", st.outbox_warning)
        assert node.converger.proc.poll() is None
        assert "insufficient storage" not in node.converger.log()
    finally:
        await bus.aclose()


async def test_below_the_floor_the_converger_stays_up_and_says_why(tmp_path: Path) -> None:
    bus = await small_bus(tmp_path, 8 * MIB)
    try:
        with pytest.raises(StreamSetupError, match="outbox refused") as refused:
            bus.setup_streams()
        assert "--outbox-max-bytes" in str(refused.value) and "MiB free on the node bus's store" in str(refused.value)
        nc = await bus.connect("converger")
        outbox = JetStreamOutbox(nc, NodeSubjects(bus.node_id))
        await outbox.recheck()
        assert not outbox.ready and "outbox missing" in outbox.error and "--outbox-max-bytes" in outbox.error
        with pytest.raises(OutboxError, match="outbox missing"):
            await outbox.publish("section", "e1", encode(SectionStatus(section="devices", state="CONVERGED", observed_generation=1)))
        assert not await outbox.has_room()

        node = Node(bus, tmp_path)
        await node.start()
        await node.push(NodeSpec(node_id=bus.node_id, generation=1, devices=[hold("a1", GPU[0])]))
        st = await node.wait_status(lambda s: s.last_pass_at is not None, "a pass")
        assert "outbox missing" in st.outbox_error and st.outbox_error in st.problems
        assert node.doctor(st)["outbox-size"][0] == "fail"
        await asyncio.sleep(1.0)
        assert node.converger.proc.poll() is None  # no crash loop
        assert not (node.cdi / "bcd-a1.json").exists()  # no hold whose Bound could not be journaled
    finally:
        await bus.aclose()


# ---------------------------------------------------------------------------- odd files, a garbage vendor spec


async def test_fifos_in_the_hold_dirs_do_not_hang_the_converger(node_bus: NodeBus, tmp_path: Path) -> None:
    node = Node(node_bus, tmp_path)
    (node.run / "allocations").mkdir(parents=True)
    node.cdi.mkdir(parents=True, exist_ok=True)
    fifos = [node.cdi / "bcd-x.json", node.run / "allocations" / "x.env"]
    for f in fifos:
        os.mkfifo(f)
    try:
        await node.start()
        await node.push(NodeSpec(node_id=node_bus.node_id, generation=1, devices=[hold("a1", GPU[0])]))
        st = await node.wait_status(converged(1), "generation 1 CONVERGED")
        assert [h.allocation_id for h in st.holds] == ["a1"]
        for f in fifos:
            assert any(str(f) in p and "a FIFO" in p for p in st.problems), st.problems
        assert node.doctor(st)["hold-files"][0] == "warn"
        # removing them changes nothing (nothing was stuck on them)
        for f in fifos:
            f.unlink()
        await node.push(NodeSpec(node_id=node_bus.node_id, generation=2, devices=[hold("a1", GPU[0]), hold("b1", GPU[1])]))
        st = await node.wait_status(converged(2), "generation 2 CONVERGED")
        assert [h.allocation_id for h in st.holds] == ["a1", "b1"] and st.problems == []
    finally:
        for f in fifos:
            # release a converger stuck on one, so the test ends
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


async def test_a_garbage_vendor_spec_is_a_doctor_failure_and_new_holds_wait(node_bus: NodeBus, tmp_path: Path) -> None:
    node = Node(node_bus, tmp_path)
    await node.start()  # the inventory writes nvidia.json at its start
    vendor = node.cdi / "nvidia.json"
    good = vendor.read_bytes()
    await node.push(NodeSpec(node_id=node_bus.node_id, generation=1, devices=[hold("a1", GPU[0])]))
    st = await node.wait_status(converged(1), "generation 1 CONVERGED")
    assert node.doctor(st)["vendor-cdi-spec"] == ("ok", str(vendor))

    vendor.write_text("{this is not json")
    await node.push(NodeSpec(node_id=node_bus.node_id, generation=2, devices=[hold("a1", GPU[0]), hold("b1", GPU[1])]))
    st = await node.wait_status(
        lambda s: s.section is not None and s.section.observed_generation == 2 and s.section.state == "PROGRESSING", "generation 2 PROGRESSING"
    )
    assert "not valid JSON" in st.vendor_cdi_error
    level, msg = node.doctor(st)["vendor-cdi-spec"]
    assert level == "fail" and msg.startswith(f"{vendor} unreadable: not valid JSON"), msg
    assert "b1: " in st.section.message and "vendor CDI spec unreadable" in st.section.message
    assert [h.allocation_id for h in st.holds] == ["a1"]  # the kept hold stays, b1 waits

    vendor.write_bytes(good)
    await call(node.cli, node.subjects.converger_pass, Empty(), SPEC_ACK_CODEC, timeout=3)
    st = await node.wait_status(converged(2), "generation 2 CONVERGED")
    assert [h.allocation_id for h in st.holds] == ["a1", "b1"] and not st.vendor_cdi_error
