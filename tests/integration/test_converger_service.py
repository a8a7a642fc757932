"""The converger as a real process beside the real inventory and signer, on a real bus.

Specs are handed over as the bridge does (its NATS user, `converger.spec`, the
control plane's SignedNodeSpec: `NodeBus.signed_spec`);
what comes out is read from the node-bus outbox stream and checked with the
signer's public key.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.converger.crash import BIND_POINTS, RELEASE_POINTS
from shared.runtime import ServiceCallError, call
from shared.schemas import (
    ATTESTED_REPORT_CODEC,
    CLAIMS_CODEC,
    CONVERGER_STATUS_CODEC,
    INVENTORY_CODEC,
    HOLDER_REPLY_CODEC,
    SIGNER_KEY_CODEC,
    SPEC_ACK_CODEC,
    DeviceAssignment,
    Empty,
    HolderQuery,
    HugePages,
    Limits,
    NodeSpec,
)
from shared.signing import verify_report
from shared.subjects import MSG_ID_HEADER, NodeSubjects

from .harness import EXAMPLE_HOSTS

pytestmark = pytest.mark.integration

GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]


def assignment(alloc: str, *devices: str, **limits) -> DeviceAssignment:
    lim = None
    if limits:
        hp = limits.pop("hugepages", None)
        lim = Limits(**limits, hugepages=[HugePages(page_size_kib=s, count=c) for s, c in (hp or [])])
    return DeviceAssignment(allocation_id=alloc, reservation_id=f"rsv-{alloc}", binding="BINDING_HOLD", devices=list(devices), limits=lim)


class Node:
    def __init__(self, bus, host_file: Path) -> None:
        self.bus = bus
        self.host_file = host_file
        self.subjects = NodeSubjects(bus.node_id)
        self.cdi = bus.root / "cdi"
        self.run = bus.root / "run"

    def env(self, **extra: str) -> dict[str, str]:
        return {"BCD_FAKE_HOST": str(self.host_file), "BCD_ADAPTER": "fakehw", **extra}

    async def start(self) -> None:
        self.bus.start_service("signer", **self.env())
        self.bus.start_service("inventory", **self.env())
        await self.bus.wait_service("signer")
        await self.bus.wait_service("inventory")
        self.bridge = await self.bus.connect("gateway_bridge")
        self.admin = await self.bus.connect("admin")  # the store account: the outbox as it is
        self.cli = await self.bus.connect("cli")
        self.key = (await call(self.cli, self.subjects.signer_key, Empty(), SIGNER_KEY_CODEC)).public_key

    def start_converger(self, **extra: str):
        return self.bus.start_service("converger", **self.env(**extra))

    async def push(self, spec: NodeSpec):
        return await call(self.bridge, self.subjects.converger_spec, self.bus.signed_spec(spec), SPEC_ACK_CODEC)

    async def status(self):
        return await call(self.cli, self.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC)

    async def wait_section(self, generation: int, state: str | None = None, timeout: float = 20.0):
        for _ in range(int(timeout * 10)):
            try:
                st = await self.status()
            except Exception:  # noqa: BLE001 - the converger may be restarting
                st = None
            if st and st.section and st.section.observed_generation == generation and st.section.state in ((state,) if state else ("CONVERGED", "FAILED")):
                return st
            await asyncio.sleep(0.1)
        raise AssertionError(f"section never reached generation {generation} {state or ''}: {st}")

    async def outbox(self) -> list[tuple[str, str, bytes]]:
        js = self.admin.jetstream()
        info = await js.stream_info(self.subjects.outbox_stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg(self.subjects.outbox_stream, seq)
            except Exception:  # noqa: BLE001 - deleted message
                continue
            out.append((msg.subject.rsplit(".", 1)[1], msg.headers[MSG_ID_HEADER], msg.data))
        return out

    async def reports(self, kind: str) -> list:
        return [verify_report(ATTESTED_REPORT_CODEC.decode(data), self.key) for t, _, data in await self.outbox() if t == kind]

    def holds(self) -> dict[str, dict]:
        return {p.name[4:-5]: json.loads(p.read_text()) for p in sorted(self.cdi.glob("bcd-*.json"))}


@pytest.fixture
def host_file(tmp_path):
    path = tmp_path / "host.json"
    path.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
    return path


@pytest.fixture
async def node(node_bus, host_file):
    n = Node(node_bus, host_file)
    await n.start()
    return n


async def test_binds_reports_signed_bound_and_refuses_with_reasons(node):
    node.start_converger()
    await node.bus.wait_service("converger")
    spec = NodeSpec(
        node_id="node-1",
        generation=1,
        devices=[
            assignment("whole", GPU[0], cpus="0-7", memory_bytes=64 << 30),
            assignment("mig", f"{GPU[6]}/gi1/ci0"),
            assignment("slots", f"{GPU[4]}/slot0", f"{GPU[4]}/slot1"),
            assignment("clash", GPU[0]),
            assignment("missing", f"{GPU[7]}/gi7/ci0"),
            assignment("toobig", GPU[1], memory_bytes=4 << 40),
        ],
    )
    ack = await node.push(spec)
    assert ack.generation == 1 and ack.changed
    st = await node.wait_section(1, "FAILED")
    assert st.section.message.splitlines() == ["clash: overlap", "missing: device-missing", "toobig: resources-exhausted"]
    assert set(node.holds()) == {"whole", "mig", "slots"}
    assert (node.run / "allocations" / "whole.env").read_text().startswith("BCD_ALLOCATION_ID=whole\nBCD_CGROUP_PARENT=bcd-alloc-whole.slice\n")
    assert (node.run / "slices" / "bcd-alloc-whole.slice.json").exists()

    bound = await node.reports("bound")
    assert {b.event.allocation_id for b in bound} == {"whole", "mig", "slots"}
    assert all(b.node_id == "node-1" and b.boot_id for b in bound)
    failed = [json.loads(d) for t, _, d in await node.outbox() if t == "failed"]
    assert {(f["allocation_id"], f["reason"]) for f in failed} == {("clash", "overlap"), ("missing", "device-missing"), ("toobig", "resources-exhausted")}
    missing = next(f for f in failed if f["allocation_id"] == "missing")
    assert missing["message"] == f"{GPU[7]} has no MIG instance gi7/ci0"

    holder = await call(node.cli, node.subjects.converger_holder, HolderQuery(gpu="0000:18:00.0"), HOLDER_REPLY_CODEC)
    assert holder.held and holder.holder == "whole"

    # same spec again: nothing new; an older generation is refused
    assert not (await node.push(spec)).changed
    with pytest.raises(ServiceCallError) as older:
        await node.push(NodeSpec(node_id="node-1", generation=0))
    assert older.value.code == "409"

    # generation 2 moves GPU 0 from "whole" to "next" in one pass
    spec2 = NodeSpec(node_id="node-1", generation=2, devices=[assignment("mig", f"{GPU[6]}/gi1/ci0"), assignment("next", GPU[0])])
    await node.push(spec2)
    await node.wait_section(2, "CONVERGED")
    assert set(node.holds()) == {"mig", "next"}
    released = await node.reports("released")
    assert {r.event.allocation_id for r in released} == {"whole", "slots"}
    assert not (node.run / "slices" / "bcd-alloc-whole.slice.json").exists()


async def test_a_spec_that_came_before_the_inventory_binds_once_an_inventory_is_read(node_bus, host_file):
    """The node's first spec can reach the converger before the inventory answers, and
    the inventory's first notice can go out before the converger listens. The inventory
    then asks for claims, which makes the converger read it: the waiting pass must run
    then, not at the retry interval (it took 30 s in bench/e2e.py, one start in three)."""
    node = Node(node_bus, host_file)
    await node.start()
    raw = await node.cli.request(node.subjects.inventory_get, b"{}", timeout=5)
    assert INVENTORY_CODEC.decode(raw.data).gpus
    next(s for s in reversed(node.bus.services) if s.name == "inventory").stop()  # its notice is gone; no one answers inventory.get
    node.start_converger(BCD_RETRY_INTERVAL="600")
    await node.bus.wait_service("converger")
    await node.push(NodeSpec(node_id="node-1", generation=1, devices=[assignment("early", GPU[0])]))
    await asyncio.sleep(0.5)
    assert (await node.status()).section is None  # waiting for an inventory

    standin = await node.bus.connect("inventory")

    async def answer(msg) -> None:  # noqa: ANN001
        await msg.respond(raw.data)

    await standin.subscribe(node.subjects.inventory_get, cb=answer)
    await standin.flush()
    await call(standin, node.subjects.converger_claims, Empty(), CLAIMS_CODEC)  # as the inventory does at start
    st = await node.wait_section(1, "CONVERGED", timeout=10)
    assert [h.allocation_id for h in st.holds] == ["early"]


async def test_a_pass_that_found_no_signer_runs_when_the_signer_answers(node_bus, host_file):
    """After a crash restart the first pass can come before the signer is back: it failed on
    `signer: nats: no responders` and waited for the 30-s retry (1 kill -9 run in 25). It must
    run when the signer answers; the retry interval here is 600 s, so only that can bind it."""
    node = Node(node_bus, host_file)
    await node.start()
    next(s for s in reversed(node.bus.services) if s.name == "signer").stop()
    node.start_converger(BCD_RETRY_INTERVAL="600")
    await node.bus.wait_service("converger")
    await node.push(NodeSpec(node_id="node-1", generation=1, devices=[assignment("early", GPU[0])]))
    st = await node.wait_section(1, "PROGRESSING", timeout=15)
    assert "signer" in st.section.message
    node.bus.start_service("signer", **node.env())
    st = await node.wait_section(1, "CONVERGED", timeout=10)
    assert [h.allocation_id for h in st.holds] == ["early"]
    assert {b.event.allocation_id for b in await node.reports("bound")} == {"early"}


async def test_a_bad_spec_is_refused_with_the_field_named(node):
    node.start_converger()
    await node.bus.wait_service("converger")
    bad = json.loads(json.dumps({"node_id": "node-1", "generation": 3, "devices": [{"allocation_id": "../etc", "reservation_id": "r", "binding": "BINDING_HOLD"}]}))
    with pytest.raises(ServiceCallError) as err:
        await call(node.bridge, node.subjects.converger_spec, node.bus.signed_spec(json.dumps(bad).encode()), SPEC_ACK_CODEC)
    assert err.value.code == "400" and "$.devices[0].allocation_id" in err.value.description
    with pytest.raises(ServiceCallError) as other:
        await node.push(NodeSpec(node_id="node-2", generation=1))
    assert other.value.code == "400"


def expected_files(node: Node, allocs: set[str]) -> None:
    assert set(node.holds()) == allocs
    envs = {p.name[:-4] for p in (node.run / "allocations").glob("*.env")} if (node.run / "allocations").exists() else set()
    assert envs == allocs
    leftovers = [p.name for d in (node.cdi, node.run / "allocations") if d.exists() for p in d.iterdir() if ".tmp-" in p.name]
    assert not leftovers, leftovers


async def killed_at(node: Node, point: str, before: NodeSpec | None, spec: NodeSpec) -> NodeSpec:
    """Converge `before` (if any) cleanly; push `spec` to a converger that SIGKILLs itself at
    `point`; start it again and wait until `spec` converged. Returns `spec`."""
    if before is not None:
        sp = node.start_converger()
        await node.bus.wait_service("converger")
        await node.push(before)
        await node.wait_section(before.generation, "CONVERGED")
        assert sp.stop() == 0
    sp = node.start_converger(BCD_CONVERGER_CRASH_AT=point)
    await node.bus.wait_service("converger")
    await node.push(spec)
    code = await asyncio.to_thread(sp.wait, 30)
    assert code == -9, f"converger did not die at {point}: exit {code}\n{sp.log()[-2000:]}"
    node.start_converger()
    await node.bus.wait_service("converger")
    await node.wait_section(spec.generation, "CONVERGED")
    return spec


@pytest.mark.parametrize("point", BIND_POINTS + RELEASE_POINTS)
async def test_kill_9_at_every_step_then_restart_loses_and_repeats_nothing(node, point):
    """Gen 1 binds `keep` and `gone`; gen 2 releases `gone` and binds `new`.
    The converger kills itself (SIGKILL) at `point` of gen 2's pass, or of gen 1's for bind points."""
    bind_point = point.startswith("bind.")
    gen1 = NodeSpec(node_id="node-1", generation=1, devices=[assignment("keep", GPU[0], cpus="0-3"), assignment("gone", GPU[1], memory_bytes=1 << 30)])
    gen2 = NodeSpec(node_id="node-1", generation=2, devices=[assignment("keep", GPU[0], cpus="0-3"), assignment("new", GPU[2], cpus="4-7")])
    final = await killed_at(node, point, None if bind_point else gen1, gen1 if bind_point else gen2)
    expected_files(node, {a.allocation_id for a in final.devices})

    events = await node.outbox()
    ids = [i for _, i, _ in events]
    assert len(ids) == len(set(ids)), "an event id appears twice in the outbox"
    bound = await node.reports("bound")
    released = await node.reports("released")
    assert sorted(b.event.allocation_id for b in bound) == (["gone", "keep"] if bind_point else ["gone", "keep", "new"])
    assert [r.event.allocation_id for r in released] == ([] if bind_point else ["gone"])


#: kill -9 inside a batch of three releases and three binds: between two files, after
#: the batch sign, after some acks of a pipelined wave (the rest still in flight).
MID_BATCH = [
    "release.intent-recorded",
    "release.cdi-removed:2",
    "release.env-removed:3",
    "release.slice-stopped:2",
    "release.signed",
    "release.published:2",
    "bind.cdi-temp-written:2",
    "bind.cdi-written:2",
    "bind.env-written:3",
    "bind.signed",
    "bind.published:1",
    "bind.published:2",
    "bind.completed",
]


@pytest.mark.parametrize("point", MID_BATCH)
async def test_kill_9_inside_a_batch_then_restart_sends_each_event_once(node, point):
    """Gen 1 binds r1..r3 (r1 sliced) and k1; gen 2 moves r1..r3's GPUs to b1..b3 in one batch."""
    gen1 = NodeSpec(
        node_id="node-1",
        generation=1,
        devices=[assignment("r1", GPU[0], cpus="0-1"), assignment("r2", GPU[1]), assignment("r3", GPU[2]), assignment("k1", GPU[3])],
    )
    gen2 = NodeSpec(
        node_id="node-1",
        generation=2,
        devices=[assignment("k1", GPU[3]), assignment("b1", GPU[0], cpus="2-3"), assignment("b2", GPU[1]), assignment("b3", GPU[2])],
    )
    await killed_at(node, point, gen1, gen2)
    expected_files(node, {"k1", "b1", "b2", "b3"})
    events = await node.outbox()
    ids = [i for _, i, _ in events]
    assert len(ids) == len(set(ids)), "an event id appears twice in the outbox"
    hold_events = [(t, i) for t, i, _ in events if t in ("bound", "released")]
    assert sorted(i for t, i in hold_events if t == "released") == [f"node-1.r{k}.released.g2" for k in (1, 2, 3)]
    assert sorted(i for t, i in hold_events if t == "bound") == sorted(
        [*(f"node-1.r{k}.bound.g1" for k in (1, 2, 3)), "node-1.k1.bound.g1", *(f"node-1.b{k}.bound.g2" for k in (1, 2, 3))]
    )
    # each GPU's Released is in the outbox before the Bound that takes it
    order = [i for _, i in hold_events]
    for k in (1, 2, 3):
        assert order.index(f"node-1.r{k}.released.g2") < order.index(f"node-1.b{k}.bound.g2")


async def test_reboot_recreates_env_and_slices_without_new_bound(node, host_file):
    sp = node.start_converger()
    await node.bus.wait_service("converger")
    spec = NodeSpec(node_id="node-1", generation=1, devices=[assignment("keep", GPU[0], cpus="0-3", memory_bytes=2 << 30), assignment("mig", f"{GPU[6]}/gi1/ci0")])
    await node.push(spec)
    await node.wait_section(1, "CONVERGED")
    before = [i for t, i, _ in await node.outbox() if t == "bound"]
    assert sp.stop() == 0

    # reboot: new boot id, tmpfs run dir empty, CDI specs still on disk
    host = json.loads(host_file.read_text())
    host["boot_id"] = "9d9d9d9d-0000-4000-8000-000000000001"
    host_file.write_text(json.dumps(host))
    for p in sorted(node.run.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    node.start_converger()
    await node.bus.wait_service("converger")
    for _ in range(100):
        if (node.run / "allocations" / "keep.env").exists() and (node.run / "slices" / "bcd-alloc-keep.slice.json").exists() and (node.run / "allocations" / "mig.env").exists():
            break
        await asyncio.sleep(0.1)
    assert (node.run / "allocations" / "keep.env").read_text().startswith("BCD_ALLOCATION_ID=keep\n")
    assert json.loads((node.run / "slices" / "bcd-alloc-keep.slice.json").read_text())
    after = [i for t, i, _ in await node.outbox() if t == "bound"]
    assert after == before
