"""vfio_switcher as a real process on a real node bus, switching cards of a fake host file.

The inventory runs for real on the same host file (fakehw adapter) and is the
switcher's source of "is this a GPU of this node". The converger's holder
endpoint is played by a small responder connected as the `converger` user
(it may answer its own subjects), which is also the only user allowed to ask
for a switch. Result notices are read as the `inventory` user, their
consumer.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import nats
import pytest

from shared.runtime import call
from shared.schemas import HOLDER_QUERY_CODEC, SWITCH_REPLY_CODEC, HolderReply, SwitchReply, SwitchRequest, encode
from shared.subjects import NodeSubjects

from .harness import EXAMPLE_HOSTS

pytestmark = pytest.mark.integration

SWITCH_TIMEOUT = 0.5
NIC = "0000:19:00.0"  # a non-GPU device the host file lists in pci_devices
NOWHERE = "0000:ee:00.0"  # no device at all


def read_host(path: Path) -> dict:
    return json.loads(path.read_text())


def edit_host(path: Path, fn) -> None:
    host = read_host(path)
    fn(host)
    tmp = path.with_name(path.name + ".test-tmp")
    tmp.write_text(json.dumps(host, indent=2))
    tmp.replace(path)


def card(host: dict, pci: str) -> dict:
    return next(g for g in host["gpus"] if g["pci_address"] == pci)


@pytest.fixture
def host_file(tmp_path):
    path = tmp_path / "host.json"
    path.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
    edit_host(path, lambda h: h.update(pci_devices=[{"pci_address": NIC, "pci_class": "0x020000", "driver": "mlx5_core"}]))
    return path


class Holder:
    """The converger's `holder` endpoint: answers from `answers` and records what was asked. By default
    every card is claimed by instance vm-1 (a switch to vfio-pci needs a passthrough claim: issue 40),
    which holds it against nothing else; `default=None` answers free."""

    def __init__(self) -> None:
        self.answers: dict[str, HolderReply] = {}
        self.asked: list[str] = []
        self.default: tuple[str, str] | None = ("instance", "vm-1")

    async def serve(self, nc, subjects: NodeSubjects) -> None:
        async def on_query(msg) -> None:
            q = HOLDER_QUERY_CODEC.decode(msg.data)
            self.asked.append(q.gpu)
            free = HolderReply(held=False, gpu=q.gpu)
            claimed = HolderReply(held=True, kind=self.default[0], holder=self.default[1], gpu=q.gpu) if self.default else free
            await msg.respond(encode(self.answers.get(q.gpu, claimed)))

        await nc.subscribe(subjects.converger_holder, cb=on_query)
        await nc.flush()


class Node:
    def __init__(self, bus, host_file: Path) -> None:
        self.bus = bus
        self.host_file = host_file
        self.subjects = NodeSubjects(bus.node_id)
        self.holder = Holder()
        self.notices: asyncio.Queue[SwitchReply] = asyncio.Queue()
        self.caller = None

    async def start(self, *, inventory: bool = True, holder: bool = True) -> "Node":
        if inventory:
            self.bus.start_service("inventory", BCD_ADAPTER="fakehw", BCD_FAKE_HOST=str(self.host_file))
        self.bus.start_service(
            "vfio_switcher", "--backend", "fake", "--fake-host", str(self.host_file), "--switch-timeout", str(SWITCH_TIMEOUT)
        )
        if inventory:
            await self.bus.wait_service("inventory")
        await self.bus.wait_service("vfio_switcher")
        if holder:
            await self.holder.serve(await self.bus.connect("converger"), self.subjects)
        watcher = await self.bus.connect("inventory")

        async def on_notice(msg) -> None:
            await self.notices.put(SWITCH_REPLY_CODEC.decode(msg.data))

        await watcher.subscribe(self.subjects.vfio_result, cb=on_notice)
        await watcher.flush()
        self.caller = await self.bus.connect("converger")
        return self

    async def switch(self, pci: str, target: str, why: str = "test") -> SwitchReply:
        reply = await call(self.caller, self.subjects.vfio_switch, SwitchRequest(pci=pci, target=target, why=why), SWITCH_REPLY_CODEC, timeout=10)
        notice = await asyncio.wait_for(self.notices.get(), 5)
        assert notice == reply  # every request, refused or not, is published as it was answered
        return reply

    async def raw(self, data: bytes) -> SwitchReply:
        msg = await self.caller.request(self.subjects.vfio_switch, data, timeout=10)
        reply = SWITCH_REPLY_CODEC.decode(msg.data)
        assert await asyncio.wait_for(self.notices.get(), 5) == reply
        return reply

    async def metrics(self) -> str:
        pong = await self.bus.wait_service("vfio_switcher")
        url = f"http://{pong['metadata']['metrics']}/metrics"
        return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())  # noqa: S310


@pytest.fixture
async def node(node_bus, host_file):
    node = await Node(node_bus, host_file).start()
    yield node
    log = next(s for s in node_bus.services if s.name == "vfio_switcher").log()
    assert "Traceback" not in log and "unexpected error" not in log


# --------------------------------------------------------------------------- switching


async def test_switches_a_card_to_vfio_and_back(node):
    host = read_host(node.host_file)
    pci, boot_id = host["gpus"][2]["pci_address"], host["boot_id"]

    there = await node.switch(pci, "vfio-pci", why="instance vm-1")
    assert (there.outcome, there.reason, there.event, there.driver) == ("Succeeded", "Switched", "VFIOPrepareSucceeded", "vfio-pci")
    assert there.pci == pci and there.target == "vfio-pci" and there.boot_id == boot_id and there.why == "instance vm-1"
    assert node.holder.asked == [pci]  # the holder was asked, by canonical address
    after = read_host(node.host_file)
    assert (card(after, pci)["driver"], card(after, pci)["driver_override"]) == ("vfio-pci", "vfio-pci")
    assert [g for g in after["gpus"] if g["pci_address"] != pci] == [g for g in host["gpus"] if g["pci_address"] != pci]

    again = await node.switch(pci, "vfio-pci", why="instance vm-1")
    assert (again.outcome, again.reason, again.event) == ("Unchanged", "AlreadyOnTarget", "")
    assert read_host(node.host_file) == after

    back = await node.switch(pci, "native", why="instance vm-1 gone")
    assert (back.outcome, back.reason, back.driver) == ("Succeeded", "Switched", "nvidia")
    final = read_host(node.host_file)
    assert (card(final, pci)["driver"], card(final, pci)["driver_override"]) == ("nvidia", "")

    metrics = await node.metrics()
    assert 'bcd_vfio_switches_total{outcome="Succeeded",target="vfio-pci"} 1.0' in metrics
    assert 'bcd_vfio_switches_total{outcome="Unchanged",target="vfio-pci"} 1.0' in metrics
    assert 'bcd_vfio_switches_total{outcome="Succeeded",target="native"} 1.0' in metrics
    assert 'bcd_vfio_switch_duration_seconds_count{target="vfio-pci"} 2.0' in metrics
    assert "bcd_vfio_disruptions_total 0.0" in metrics


async def test_has_exactly_one_endpoint(node):
    cli = await node.bus.connect("cli")
    info = json.loads((await cli.request("$SRV.INFO.vfio_switcher", b"", timeout=2)).data)
    assert [(e["name"], e["subject"]) for e in info["endpoints"]] == [("switch", node.subjects.vfio_switch)]
    assert info["metadata"]["backend"] == "fake"


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("bad", ["3b:00.0", "0000:3B:00.0", "0000:3b:00.0\n", "0000:18:00.0/../x"])
async def test_refuses_a_non_canonical_address(node, bad):
    before = node.host_file.read_bytes()
    reply = await node.switch(bad, "vfio-pci")
    assert (reply.outcome, reply.reason, reply.event) == ("Refused", "InvalidAddress", "")
    assert "canonical" in reply.message and repr(bad) in reply.message
    assert node.holder.asked == [] and node.host_file.read_bytes() == before


@pytest.mark.parametrize(("pci", "what"), [(NIC, "a NIC the host lists"), (NOWHERE, "no device")])
async def test_refuses_an_address_the_inventory_lists_no_gpu_at(node, pci, what):
    before = node.host_file.read_bytes()
    reply = await node.switch(pci, "vfio-pci")
    assert (reply.outcome, reply.reason) == ("Refused", "NotListed"), what
    assert pci in reply.message
    assert node.holder.asked == [] and node.host_file.read_bytes() == before


@pytest.mark.parametrize(
    ("kind", "holder", "target", "driver"),
    [
        ("allocation", "alloc_01", "vfio-pci", "nvidia"),
        ("allocation", "alloc_01", "native", "vfio-pci"),
        ("release", "(pending Kubernetes releases that could not be read)", "vfio-pci", "nvidia"),
        ("release", "alloc_02", "native", "vfio-pci"),
        ("domain", "vm-1", "native", "vfio-pci"),
    ],
)
async def test_refuses_a_held_gpu_naming_the_holder(node, kind, holder, target, driver):
    pci = read_host(node.host_file)["gpus"][4]["pci_address"]
    edit_host(node.host_file, lambda h: card(h, pci).update(driver=driver, driver_override="vfio-pci" if driver == "vfio-pci" else ""))
    before = node.host_file.read_bytes()
    node.holder.answers[pci] = HolderReply(held=True, kind=kind, holder=holder, gpu=pci)
    reply = await node.switch(pci, target)
    assert (reply.outcome, reply.reason, reply.holder) == ("Refused", "Held", f"{kind} {holder}")
    assert holder in reply.message and pci in reply.message
    assert node.host_file.read_bytes() == before


@pytest.mark.parametrize("kind", ["instance", "passthrough-claim"])
async def test_a_passthrough_claim_does_not_hold_and_lets_the_card_go_to_vfio(node, kind):
    """The converger asks for these switches itself: a VM instance of the spec, a DRA claim with VfioDeviceConfig."""
    pci = read_host(node.host_file)["gpus"][5]["pci_address"]
    node.holder.answers[pci] = HolderReply(held=True, kind=kind, holder="vm-1", gpu=pci)
    reply = await node.switch(pci, "vfio-pci")
    assert reply.outcome == "Succeeded", reply.message
    assert card(read_host(node.host_file), pci)["driver"] == "vfio-pci"


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (HolderReply(held=False), "nothing claims it"),
        # a VM running with the card but no instance of the spec naming it: not the converger's claim
        (HolderReply(held=True, kind="domain", holder="rogue-vm"), "domain rogue-vm"),
    ],
    ids=["unclaimed", "domain-only"],
)
async def test_a_listed_card_no_passthrough_claim_names_is_not_switched_to_vfio(node, answer, said):
    """What a caller that reaches the switch subject sends (issue 40): a listed, free card to vfio-pci."""
    pci = read_host(node.host_file)["gpus"][5]["pci_address"]
    before = node.host_file.read_bytes()
    node.holder.answers[pci] = HolderReply(held=answer.held, kind=answer.kind, holder=answer.holder, gpu=pci)
    reply = await node.switch(pci, "vfio-pci", why="sent by someone")
    assert (reply.outcome, reply.reason, reply.event) == ("Refused", "NotClaimed", ""), reply
    assert f"refused {pci}: no VM instance of the spec and no DRA claim passes it through ({said})" in reply.message
    assert node.holder.asked == [pci] and node.host_file.read_bytes() == before
    assert 'bcd_vfio_switches_total{outcome="Refused",target="vfio-pci"} 1.0' in await node.metrics()


async def test_a_card_nothing_claims_still_goes_back_to_its_native_driver(node):
    """The way back keeps its rules: a card on vfio-pci nothing claims returns to nvidia."""
    pci = read_host(node.host_file)["gpus"][6]["pci_address"]
    edit_host(node.host_file, lambda h: card(h, pci).update(driver="vfio-pci", driver_override="vfio-pci"))
    node.holder.default = None
    reply = await node.switch(pci, "native", why="reclaim")
    assert (reply.outcome, reply.driver) == ("Succeeded", "nvidia"), reply


async def test_refuses_when_the_holder_cannot_be_asked(node_bus, host_file):
    node = await Node(node_bus, host_file).start(holder=False)  # nobody answers converger.holder
    pci = read_host(host_file)["gpus"][0]["pci_address"]
    before = host_file.read_bytes()
    reply = await node.switch(pci, "vfio-pci")
    assert (reply.outcome, reply.reason) == ("Refused", "HolderUnknown")
    assert "holder check failed" in reply.message and "no responders" in reply.message
    assert host_file.read_bytes() == before


async def test_refuses_when_the_inventory_cannot_be_asked(node_bus, host_file):
    node = await Node(node_bus, host_file).start(inventory=False)
    pci = read_host(host_file)["gpus"][0]["pci_address"]
    before = host_file.read_bytes()
    reply = await node.switch(pci, "vfio-pci")
    assert (reply.outcome, reply.reason) == ("Refused", "InventoryUnknown")
    assert node.holder.asked == [] and host_file.read_bytes() == before


async def test_a_bad_request_still_gets_a_switch_reply(node):
    garbage = await node.raw(b"{not json")
    assert (garbage.outcome, garbage.reason, garbage.pci) == ("Refused", "InvalidRequest", "")
    target = await node.switch(read_host(node.host_file)["gpus"][0]["pci_address"], "passthrough")
    assert (target.outcome, target.reason) == ("Refused", "InvalidRequest")
    # 64 control characters: their repr is four times as long, and the reply must still decode
    noisy = await node.switch("\x01" * 64, "vfio-pci")
    assert (noisy.outcome, noisy.reason) == ("Refused", "InvalidAddress") and len(noisy.pci) <= 128
    assert node.holder.asked == []
    # still serving
    assert (await node.switch(NOWHERE, "native")).reason == "NotListed"


async def test_the_inventory_user_may_not_ask_for_a_switch(node):
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    pci = read_host(node.host_file)["gpus"][0]["pci_address"]
    before = node.host_file.read_bytes()
    nc = await node.bus.connect("inventory", error_cb=on_error)
    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
        await nc.request(node.subjects.vfio_switch, encode(SwitchRequest(pci=pci, target="vfio-pci")), timeout=1)
    await nc.flush()
    assert any("permissions violation" in str(e) and "vfio_switcher.switch" in str(e) for e in errors), errors
    assert node.notices.empty() and node.host_file.read_bytes() == before


# --------------------------------------------------------------------------- injected failures


async def test_a_hung_unbind_that_let_go_needs_a_reboot(node):
    pci = read_host(node.host_file)["gpus"][1]["pci_address"]
    edit_host(node.host_file, lambda h: card(h, pci).update(faults={"unbind": "hang-unbound"}))
    loop = asyncio.get_running_loop()
    started = loop.time()
    reply = await node.switch(pci, "vfio-pci", why="instance vm-2")
    assert loop.time() - started < 5 * SWITCH_TIMEOUT + 3  # timed out, did not hang with it
    assert (reply.outcome, reply.reason, reply.event) == ("DisruptionRequired", "UnbindTimedOut", "VFIOPrepareFailed")
    assert f"GPU {pci}" in reply.message and "reboot" in reply.message
    assert reply.boot_id == read_host(node.host_file)["boot_id"]
    g = card(read_host(node.host_file), pci)
    assert g["driver"] == "" and g["faults"]["unbind"] == ""  # no driver; the fault fired once

    # the device lock is still held: a retry fails fast, and says so
    retry = await node.switch(pci, "native")
    assert retry.outcome == "DisruptionRequired" and "has not returned" in retry.message
    metrics = await node.metrics()
    assert "bcd_vfio_disruptions_total 2.0" in metrics
    assert 'bcd_vfio_switches_total{outcome="DisruptionRequired",target="vfio-pci"} 1.0' in metrics

    # a reboot (new boot id, the card back on its driver) ends it; the card switches again
    edit_host(node.host_file, lambda h: (h.update(boot_id="7d1e0c2b-reboot"), card(h, pci).update(driver="nvidia", driver_override="")))
    again = await node.switch(pci, "vfio-pci")
    assert (again.outcome, again.boot_id) == ("Succeeded", "7d1e0c2b-reboot")


async def test_a_failed_bind_to_vfio_rolls_back_to_nvidia(node):
    pci = read_host(node.host_file)["gpus"][3]["pci_address"]
    edit_host(node.host_file, lambda h: card(h, pci).update(faults={"fail_bind": ["vfio-pci"]}))
    reply = await node.switch(pci, "vfio-pci")
    assert (reply.outcome, reply.reason, reply.event) == ("Failed", "BindFailed", "VFIOPrepareFailed")
    assert reply.rolled_back and reply.driver == "nvidia" and "rolled back to nvidia" in reply.message
    g = card(read_host(node.host_file), pci)
    assert (g["driver"], g["driver_override"], g["faults"]["fail_bind"]) == ("nvidia", "", [])
    # the fault was consumed: the next try goes through
    assert (await node.switch(pci, "vfio-pci")).outcome == "Succeeded"


async def test_an_unexpected_error_is_answered_and_the_service_lives(node_bus, host_file):
    node = await Node(node_bus, host_file).start()
    pci = read_host(host_file)["gpus"][6]["pci_address"]
    good = host_file.read_bytes()
    host_file.write_text("{ the fake kernel is broken")
    reply = await node.switch(pci, "vfio-pci")
    assert (reply.outcome, reply.reason) == ("Failed", "InternalError")
    assert pci in reply.message and "not valid JSON" in reply.message
    host_file.write_bytes(good)
    assert (await node.switch(pci, "vfio-pci")).outcome == "Succeeded"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--backend", "fake"), "--fake-host"),
        (("--backend", "fake", "--fake-host", "/nonexistent/host.json"), "cannot read"),
        (("--backend", "fake", "--fake-host", "HOST", "--switch-timeout", "0"), "--switch-timeout"),
    ],
)
async def test_refuses_to_start_misconfigured(node_bus, host_file, args, says):
    sp = node_bus.start_service("vfio_switcher", *(str(host_file) if a == "HOST" else a for a in args))
    assert await asyncio.to_thread(sp.wait, 20) == 2
    log = sp.log()
    assert says in log and "Traceback" not in log
