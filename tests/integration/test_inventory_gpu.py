"""PhysicalGPU status end to end: the real inventory process on a copy of a fake host, a real node bus.

The converger's side is played by the test, under the converger's own NATS
user: it answers `converger.claims` and publishes `converger.claims_changed`;
the node outbox stream is the bus setup's (made again by it where a test
removed it). The vfio_switcher's result notices are published
under the vfio_switcher's user, after the test edits the host file the way
the switcher's fake backend would. Operators' requests go through
`inventory.gpu` as the CLI user. GPU events are read back from the outbox
stream. The rules' timers run short here (--orphan-grace, --gpu-tick); the
tables keep the seed's 2 minutes by default.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
import time
import urllib.request
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from shared.runtime import ServiceCallError, call
from shared.schemas import (
    GPU_CHANGED_CODEC,
    GPU_REPLY_CODEC,
    INVENTORY_CODEC,
    Claims,
    Empty,
    Gpu,
    GpuChanged,
    GpuClaim,
    GpuReply,
    GpuRequest,
    Inventory,
    SwitchReply,
    encode,
)
from shared.schemas.common import EVENT_ID_PATTERN
from shared.subjects import MSG_ID_HEADER, NodeSubjects

from .harness import EXAMPLE_HOSTS, NodeBus

pytestmark = pytest.mark.integration

T = TypeVar("T")

# cards of examples/hosts/h200x8.json
CARD0, CARD1, CARD2, CARD3 = "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"


def cond(gpu: Gpu, type_: str) -> tuple[str, str] | None:
    c = next((c for c in gpu.status.conditions if c.type == type_), None)
    return None if c is None else (c.status, c.reason)


def mstate(gpu: Gpu) -> tuple[str, str | None]:
    """(managementState, Managed reason)."""
    managed = cond(gpu, "Managed")
    return gpu.status.driver_binding.management_state, managed[1] if managed else None


async def until(probe: Callable[[], Awaitable[T | None]], what: str, timeout: float = 20.0) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


class Node:
    """The inventory under test and the peers the test plays."""

    def __init__(self, bus: NodeBus, host_file: Path) -> None:
        self.bus = bus
        self.host_file = host_file
        self.subjects = NodeSubjects(bus.node_id)
        self.claims: list[GpuClaim] = []
        self.claims_asked = 0
        #: the converger stand-in takes the claims requests but answers none (kill -STOP)
        self.claims_paused = False
        self.claims_sub: Any = None
        self.converger: Client | None = None
        self.cli: Client | None = None
        self.admin: Client | None = None
        self.switcher: Client | None = None

    # ------------------------------------------------------------------ the host file

    def host(self) -> dict[str, Any]:
        return json.loads(self.host_file.read_text())

    def edit_host(self, **cards: dict[str, Any]) -> None:
        """Rewrite the host file atomically; keys are PCI addresses (`_` for top-level fields)."""
        host = self.host()
        host.update(cards.pop("_", {}))
        for g in host["gpus"]:
            g.update(cards.get(g["pci_address"], {}))
        tmp = self.host_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(host))
        os.replace(tmp, self.host_file)

    # ------------------------------------------------------------------ processes

    def start_inventory(self, **env: str):
        defaults = {
            "BCD_ADAPTER": "fakehw",
            "BCD_FAKE_HOST": str(self.host_file),
            "BCD_GPU_TICK": "0.1",
            "BCD_ORPHAN_GRACE": "2",
            "BCD_RECLAIM_TIMEOUT": "60",
        }
        return self.bus.start_service("inventory", **{**defaults, **env})

    async def start(self, *, answer_claims: bool = True, outbox: bool = True, **env: str) -> None:
        self.cli = await self.bus.connect("cli")
        self.admin = await self.bus.connect("admin")
        self.converger = await self.bus.connect("converger")
        if answer_claims:
            await self.answer_claims()
        if not outbox:
            # a bus whose setup has not made the outbox yet
            await self.admin.jetstream().delete_stream(self.subjects.outbox_stream)
        self.start_inventory(**env)
        await self.bus.wait_service("inventory")

    async def answer_claims(self) -> None:
        assert self.converger is not None

        async def respond(msg: Msg) -> None:
            self.claims_asked += 1
            if not self.claims_paused:
                await msg.respond(encode(self.current_claims()))

        self.claims_sub = await self.converger.subscribe(self.subjects.converger_claims, cb=respond)
        await self.converger.flush()

    async def stop_answering_claims(self) -> None:
        """The converger gone (a crash, or it refuses to start): nobody takes the claims requests."""
        assert self.converger is not None and self.claims_sub is not None
        await self.claims_sub.unsubscribe()
        self.claims_sub = None
        await self.converger.flush()

    async def create_outbox(self) -> None:
        """What the bus setup does (as bus_admin): no service may make a stream."""
        self.bus.setup_streams()

    def current_claims(self) -> Claims:
        return Claims(claims=list(self.claims), at=datetime.now(timezone.utc))

    async def set_claims(self, *claims: tuple[str, str, str]) -> None:
        """Change the claims (pci, kind, holder) and publish the notice, as the converger does after a pass."""
        assert self.converger is not None
        self.claims = [GpuClaim(pci_address=p, kind=k, holder=h) for p, k, h in claims]  # type: ignore[arg-type]
        await self.converger.publish(self.subjects.converger_claims_changed, encode(self.current_claims()))
        await self.converger.flush()

    async def switch_result(self, **fields: Any) -> SwitchReply:
        """Publish a SwitchReply on vfio_switcher.result under the switcher's user."""
        if self.switcher is None:
            self.switcher = await self.bus.connect("vfio_switcher")
        reply = SwitchReply(at=datetime.now(timezone.utc), **fields)
        await self.switcher.publish(self.subjects.vfio_result, encode(reply))
        await self.switcher.flush()
        return reply

    # ------------------------------------------------------------------ reading

    async def inventory(self) -> Inventory:
        assert self.cli is not None
        return await call(self.cli, self.subjects.inventory_get, Empty(), INVENTORY_CODEC)

    async def card(self, pci: str) -> Gpu:
        return next(g for g in (await self.inventory()).gpus if g.pci_address == pci)

    async def wait_card(self, pci: str, check: Callable[[Gpu], bool], what: str, timeout: float = 20.0) -> Gpu:
        last: list[Gpu] = []

        async def probe() -> Gpu | None:
            g = await self.card(pci)
            last[:] = [g]
            return g if check(g) else None

        try:
            return await until(probe, what, timeout)
        except AssertionError:
            g = last[0] if last else None
            detail = (g.status.phase, mstate(g), [(c.type, c.status, c.reason) for c in g.status.conditions]) if g else None
            raise AssertionError(f"{pci}: timed out waiting for {what}; last {detail}\n{self.log()[-3000:]}") from None

    async def rescan(self) -> Inventory:
        """Scan now (`inventory.rescan`, as the cli), rather than wait for the periodic scan."""
        assert self.cli is not None
        return await call(self.cli, self.subjects.inventory_rescan, Empty(), INVENTORY_CODEC)

    async def gpu(self, action: str, pci: str) -> GpuReply:
        assert self.cli is not None
        return await call(self.cli, self.subjects.inventory_gpu, GpuRequest(action=action, pci=pci), GPU_REPLY_CODEC)  # type: ignore[arg-type]

    async def outbox(self) -> list[tuple[str, str, GpuChanged]]:
        """(subject type, Nats-Msg-Id, event) of every GPU event in the outbox stream, in order."""
        assert self.admin is not None
        js = self.admin.jetstream()
        info = await js.stream_info(self.subjects.outbox_stream)
        out: list[tuple[str, str, GpuChanged]] = []
        if not info.state.messages:
            return out
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(self.subjects.outbox_stream, seq)
            assert msg.headers is not None and msg.subject is not None and msg.data is not None
            out.append((msg.subject.rsplit(".", 1)[1], msg.headers[MSG_ID_HEADER], GPU_CHANGED_CODEC.decode(msg.data)))
        return out

    async def events_of(self, pci: str) -> list[GpuChanged]:
        return [e for _, _, e in await self.outbox() if e.pci_address == pci]

    async def metrics(self) -> str:
        assert self.cli is not None
        info = json.loads((await self.cli.request("$SRV.INFO.inventory", b"", timeout=2)).data)
        url = f"http://{info['metadata']['metrics']}/metrics"
        return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())  # noqa: S310

    def log(self) -> str:
        sp = next(s for s in reversed(self.bus.services) if s.name == "inventory")
        return sp.log()

    def assert_clean_log(self) -> None:
        log = self.log()
        assert "Traceback" not in log, log[-3000:]


@pytest.fixture
def host_file(tmp_path: Path) -> Path:
    path = tmp_path / "host.json"
    path.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
    return path


@pytest.fixture
def node(node_bus: NodeBus, host_file: Path) -> Node:
    return Node(node_bus, host_file)


# --------------------------------------------------------------------------- managementState from the claims


async def test_free_cards_read_unclaimed_and_an_allocation_reads_managed(node: Node) -> None:
    node.claims = [GpuClaim(pci_address=CARD1, kind="allocation", holder="a-1")]
    await node.start()
    free = await node.wait_card(CARD0, lambda g: mstate(g) == ("Unclaimed", "NoBackingAllocation"), "Unclaimed")
    assert free.status.phase == "Ready" and cond(free, "Managed") == ("True", "NoBackingAllocation")
    held = await node.card(CARD1)
    assert mstate(held) == ("Managed", "BackingAllocation")
    assert held.status.driver_binding.driver == "nvidia" and held.status.driver_binding.mode == "Compute"

    # the inventory's bucket (in the store account) carries the same status
    assert node.admin is not None
    kv = await node.admin.jetstream().key_value(node.subjects.inventory_bucket)
    published = INVENTORY_CODEC.decode((await kv.get(node.bus.node_id)).value or b"")
    assert mstate(next(g for g in published.gpus if g.pci_address == CARD1)) == ("Managed", "BackingAllocation")

    # the converger's notice is taken as it is: the allocation moves to card 0
    await node.set_claims((CARD0, "allocation", "a-2"))
    await node.wait_card(CARD0, lambda g: mstate(g) == ("Managed", "BackingAllocation"), "Managed after the notice")
    assert mstate(await node.card(CARD1)) == ("Unclaimed", "NoBackingAllocation")

    # one event per change, each with a valid deterministic id, on the gpu subject
    events = await until(node.outbox, "gpu events")
    assert {t for t, _, _ in events} == {"gpu"}
    assert all(re.match(EVENT_ID_PATTERN, i) for _, i, _ in events)
    assert len({i for _, i, _ in events}) == len(events)
    card1 = [(e.phase, e.management_state) for e in await node.events_of(CARD1)]
    assert card1 == [("Ready", "Managed"), ("Ready", "Unclaimed")]

    text = await node.metrics()
    assert f'bcd_gpu_management_state{{pci_address="{CARD0}",state="Managed"}} 1.0' in text
    assert f'bcd_gpu_phase{{pci_address="{CARD0}",phase="Ready"}} 1.0' in text
    node.assert_clean_log()


async def test_without_the_claims_endpoint_every_card_is_indeterminate_until_it_answers(node: Node) -> None:
    await node.start(answer_claims=False)
    inv = await node.inventory()
    assert {mstate(g) for g in inv.gpus} == {("Unknown", "Indeterminate")}
    assert all(g.status.phase == "Ready" for g in inv.gpus)  # the phase does not depend on the claims
    # the converger comes up: the next tick asks again (no notice needed)
    await node.answer_claims()
    await node.wait_card(CARD0, lambda g: mstate(g) == ("Unclaimed", "NoBackingAllocation"), "Unclaimed once claims answer")
    assert "claims lookup failed" in node.log()


async def test_an_instance_claim_on_a_virtualized_node_fails(node_bus: NodeBus, tmp_path: Path) -> None:
    host_file = tmp_path / "guest.json"
    host_file.write_bytes((EXAMPLE_HOSTS / "virtualized.json").read_bytes())
    node = Node(node_bus, host_file)
    pci = node.host()["gpus"][0]["pci_address"]
    node.claims = [GpuClaim(pci_address=pci, kind="instance", holder="vm-1")]
    await node.start()
    g = await node.wait_card(pci, lambda g: g.status.phase == "Failed", "phase Failed")
    assert cond(g, "AdapterReady") == ("False", "VFIORequiresBareMetal")
    assert mstate(g) == ("Managed", "BackingAllocation")


# --------------------------------------------------------------------------- orphans and reclaim


async def test_an_unclaimed_vfio_card_is_orphan_pending_then_orphaned(node: Node) -> None:
    node.edit_host(**{CARD2: {"driver": "vfio-pci", "driver_override": "vfio-pci"}})
    await node.start(BCD_ORPHAN_GRACE="3")
    pending = await node.card(CARD2)
    assert pending.status.phase == "Passthrough"
    assert mstate(pending) == ("Unknown", "OrphanPending")
    orphaned = await node.wait_card(CARD2, lambda g: mstate(g) == ("Orphaned", "Orphaned"), "Orphaned", timeout=15)
    assert cond(orphaned, "Managed") == ("False", "Orphaned")
    assert [e.management_state for e in await node.events_of(CARD2)] == ["Unknown", "Orphaned"]


async def test_reclaim_is_refused_unless_orphaned_and_bad_requests_are_answered(node: Node) -> None:
    node.claims = [GpuClaim(pci_address=CARD1, kind="allocation", holder="a-1")]
    await node.start()
    await node.wait_card(CARD0, lambda g: mstate(g)[0] == "Unclaimed", "Unclaimed")
    for pci, state in ((CARD0, "Unclaimed"), (CARD1, "Managed")):
        reply = await node.gpu("reclaim", pci)
        assert reply.accepted is False
        # the reason is the verdict: the message does not say "refused" again (issue 41)
        assert reply.message == f"managementState is {state}: the card is on its compute driver (nvidia), nothing to reclaim"
        assert reply.gpu is not None and reply.gpu.pci_address == pci
        # on its compute driver the refusal is the request's answer, not the card's condition (issue 41)
        assert cond(reply.gpu, "Reclaim") is None
    assert cond(await node.card(CARD0), "Reclaim") is None

    bad = await node.gpu("reclaim", "0000:3B:00.0")
    assert bad.accepted is False and "not a canonical PCI address" in bad.message and bad.gpu is None
    missing = await node.gpu("exclude", "0000:77:00.0")
    assert missing.accepted is False and missing.message == "no GPU at 0000:77:00.0 in this node's inventory"
    assert node.cli is not None
    for body in (b"{not json", b'{"action": "reboot", "pci": "0000:18:00.0"}', b'{"action": "reclaim"}'):
        with pytest.raises(ServiceCallError) as err:
            await call(node.cli, node.subjects.inventory_gpu, body, GPU_REPLY_CODEC)
        assert err.value.code == "400"
    # still serving
    assert (await node.gpu("include", CARD0)).accepted is True
    assert 'bcd_gpu_reclaims_total{outcome="refused"} 2.0' in await node.metrics()
    node.assert_clean_log()


async def test_a_held_reclaim_starts_once_orphaned_and_succeeds_on_the_native_driver(node: Node) -> None:
    # card 2 serves a VM; the test plays the switcher that put it on vfio-pci
    node.edit_host(**{CARD2: {"driver": "vfio-pci", "driver_override": "vfio-pci"}})
    node.claims = [GpuClaim(pci_address=CARD2, kind="instance", holder="vm-1")]
    await node.start(BCD_ORPHAN_GRACE="3")
    await node.wait_card(CARD2, lambda g: mstate(g) == ("Managed", "BackingAllocation"), "Managed by the instance")
    refused = await node.gpu("reclaim", CARD2)
    assert (refused.accepted, refused.message) == (False, "managementState is Managed")

    # the instance goes, but nobody switches the card back: it starts its grace period
    await node.set_claims()
    await node.wait_card(CARD2, lambda g: mstate(g) == ("Unknown", "OrphanPending"), "OrphanPending")
    held = await node.gpu("reclaim", CARD2)
    assert held.accepted is True, held.message
    assert held.gpu is not None and cond(held.gpu, "Reclaim") == ("Unknown", "Held")
    assert held.message.startswith("held: managementState is Unknown")

    admitted = await node.wait_card(CARD2, lambda g: cond(g, "Reclaim") == ("Unknown", "InProgress"), "admitted")
    assert mstate(admitted) == ("Orphaned", "Orphaned")
    again = await node.gpu("reclaim", CARD2)
    assert again.accepted is True and again.message.startswith("a reclaim of this card is already pending")

    # the converger would now switch it back to its native driver; the test does what the switcher would
    node.edit_host(**{CARD2: {"driver": "nvidia", "driver_override": ""}})
    done = await node.wait_card(CARD2, lambda g: cond(g, "Reclaim") == ("True", "Succeeded"), "Succeeded")
    assert done.status.phase == "Ready" and mstate(done) == ("Unclaimed", "NoBackingAllocation")
    reclaims = [cond_of(e, "Reclaim") for e in await node.events_of(CARD2)]
    walk = [r for k, r in enumerate(reclaims) if r and (k == 0 or reclaims[k - 1] != r)]
    assert walk == [("False", "Refused"), ("Unknown", "Held"), ("Unknown", "InProgress"), ("True", "Succeeded")]
    text = await node.metrics()
    for outcome in ("refused", "held", "admitted", "succeeded"):
        assert f'bcd_gpu_reclaims_total{{outcome="{outcome}"}} 1.0' in text, outcome
    node.assert_clean_log()


def cond_of(e: GpuChanged, type_: str) -> tuple[str, str] | None:
    c = next((c for c in e.status.conditions if c.type == type_), None)
    return None if c is None else (c.status, c.reason)


async def test_a_reclaim_still_on_vfio_after_the_timeout_fails(node: Node) -> None:
    node.edit_host(**{CARD2: {"driver": "vfio-pci"}})
    await node.start(BCD_ORPHAN_GRACE="0.5", BCD_RECLAIM_TIMEOUT="1")
    await node.wait_card(CARD2, lambda g: mstate(g)[0] == "Orphaned", "Orphaned")
    reply = await node.gpu("reclaim", CARD2)
    assert reply.accepted is True and reply.gpu is not None and cond(reply.gpu, "Reclaim") == ("Unknown", "InProgress")
    failed = await node.wait_card(CARD2, lambda g: cond(g, "Reclaim") == ("False", "Failed"), "Failed")
    reclaim = next(c for c in failed.status.conditions if c.type == "Reclaim")
    assert "a node reboot may be needed" in reclaim.message


# --------------------------------------------------------------------------- exclusion


async def test_exclude_and_include_survive_a_restart(node: Node, node_bus: NodeBus) -> None:
    node.edit_host(**{CARD3: {"driver": ""}})
    await node.start()
    await node.wait_card(CARD0, lambda g: mstate(g)[0] == "Unclaimed", "Unclaimed")

    idle = await node.gpu("exclude", CARD3)  # no driver, no claim: Excluded at once
    assert idle.accepted is True and idle.gpu is not None
    assert mstate(idle.gpu) == ("Excluded", "Excluded") and cond(idle.gpu, "Managed") == ("False", "Excluded")
    free = await node.gpu("exclude", CARD1)  # on its compute driver, no claim: Excluded at once too
    assert free.accepted is True and free.gpu is not None and mstate(free.gpu) == ("Excluded", "Excluded")
    assert (await node.gpu("include", CARD1)).accepted is True
    await node.set_claims((CARD0, "allocation", "a-1"))
    await node.wait_card(CARD0, lambda g: mstate(g) == ("Managed", "BackingAllocation"), "Managed by a-1")
    busy = await node.gpu("exclude", CARD0)  # a hold still has it
    assert busy.accepted is True and busy.gpu is not None
    assert mstate(busy.gpu) == ("Managed", "ExcludedReleasePending")
    assert busy.message == "excluded; managementState is Managed"
    assert (await node.gpu("exclude", CARD0)).message.startswith("already excluded")
    # a reclaim of an excluded card is refused on its state
    assert (await node.gpu("reclaim", CARD3)).message.startswith("managementState is Excluded")

    # the state is on disk (0600) and a restarted inventory keeps it, without repeating events
    state_file = node_bus.root / "data" / "inventory" / "gpus.json"
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    saved = json.loads(state_file.read_text())
    assert saved["boot_id"] == node.host()["boot_id"]
    assert {pci for pci, c in saved["cards"].items() if c["excluded"]} == {CARD0, CARD3}
    before = await until(node.outbox, "events")
    assert node.bus.services[-1].stop() == 0
    node.start_inventory()
    await node.bus.wait_service("inventory")
    assert mstate(await node.card(CARD3)) == ("Excluded", "Excluded")
    assert mstate(await node.card(CARD0)) == ("Managed", "ExcludedReleasePending")
    assert len(await node.outbox()) == len(before)

    # the hold on card 0 goes: Excluded
    await node.set_claims()
    await node.wait_card(CARD0, lambda g: mstate(g) == ("Excluded", "Excluded"), "Excluded once released")

    back = await node.gpu("include", CARD3)
    assert back.accepted is True and back.gpu is not None and mstate(back.gpu) == ("Unknown", "NoLiveBinding")
    assert (await node.gpu("include", CARD3)).message.startswith("not excluded")
    node.assert_clean_log()


# --------------------------------------------------------------------------- switch results


async def test_a_prepare_succeeded_notice_reports_passthrough_with_the_event(node: Node) -> None:
    node.claims = [GpuClaim(pci_address=CARD3, kind="instance", holder="vm-7")]
    await node.start()
    await node.wait_card(CARD3, lambda g: mstate(g) == ("Managed", "BackingAllocation"), "Managed")
    node.edit_host(**{CARD3: {"driver": "vfio-pci", "driver_override": "vfio-pci"}})
    await node.switch_result(
        pci=CARD3,
        target="vfio-pci",
        outcome="Succeeded",
        reason="Switched",
        message="0000:5d:00.0 is on vfio-pci",
        event="VFIOPrepareSucceeded",
        driver="vfio-pci",
        boot_id=node.host()["boot_id"],
        why="instance vm-7",
    )
    g = await node.wait_card(CARD3, lambda g: g.status.phase == "Passthrough", "Passthrough")
    assert g.status.driver_binding.driver == "vfio-pci" and g.status.driver_binding.mode == "Passthrough"
    assert mstate(g) == ("Managed", "BackingAllocation")

    async def reported() -> list[GpuChanged]:
        return [e for e in await node.events_of(CARD3) if e.reason == "VFIOPrepareSucceeded"]

    (event,) = await until(reported, "the VFIOPrepareSucceeded event")
    assert (event.phase, event.management_state, event.message) == ("Passthrough", "Managed", "0000:5d:00.0 is on vfio-pci")


async def test_disruption_required_walks_to_reboot_requested_and_clears_after_a_reboot(node: Node) -> None:
    await node.start()
    await node.wait_card(CARD1, lambda g: mstate(g)[0] == "Unclaimed", "Unclaimed")
    boot = node.host()["boot_id"]
    # the switcher's unbind hung with the driver already gone: no driver, no rollback
    node.edit_host(**{CARD1: {"driver": ""}})
    await node.switch_result(
        pci=CARD1,
        target="vfio-pci",
        outcome="DisruptionRequired",
        reason="RollbackImpossible",
        message="GPU 0000:2a:00.0 is left without a driver and cannot be rolled back; a node reboot is needed",
        event="VFIOPrepareFailed",
        boot_id=boot,
    )
    waiting = await node.wait_card(
        CARD1, lambda g: cond(g, "Reconfiguring") == ("True", "RebootRequested"), "RebootRequested"
    )
    assert waiting.status.phase == "Reconfiguring"

    def stages(events: list[GpuChanged]) -> list[str | None]:
        return [(cond_of(e, "Reconfiguring") or (None, None))[1] for e in events]

    events = await node.events_of(CARD1)
    assert stages(events)[-3:] == ["DisruptionRequired", "DisruptionPending", "RebootRequested"]
    raised = next(e for e in events if cond_of(e, "Reconfiguring") == ("True", "DisruptionRequired"))
    assert raised.reason == "VFIOPrepareFailed" and "reboot" in raised.message

    # the node reboots; the card comes back on its native driver
    node.edit_host(**{"_": {"boot_id": "b7d1c0de-0000-4000-8000-00000000reboot"}, CARD1: {"driver": "nvidia"}})
    cleared = await node.wait_card(CARD1, lambda g: cond(g, "Reconfiguring") is None, "cleared")
    assert cleared.status.phase == "Ready"
    assert stages(await node.events_of(CARD1))[-2:] == ["Completing", None]
    node.assert_clean_log()


async def test_gpu_events_wait_for_the_outbox_stream(node: Node) -> None:
    await node.start(outbox=False)
    await node.wait_card(CARD0, lambda g: mstate(g)[0] == "Unclaimed", "Unclaimed")
    assert node.admin is not None
    with pytest.raises(nats.errors.Error):
        await node.admin.jetstream().stream_info(node.subjects.outbox_stream)
    # the bus setup makes the stream; the journaled events follow on the next tick
    await node.create_outbox()

    async def all_cards() -> list[Any] | None:
        events = await node.outbox()
        return events if {e.pci_address for _, _, e in events} == {g["pci_address"] for g in node.host()["gpus"]} else None

    events = await until(all_cards, "the journaled events")
    assert all(e.management_state == "Unclaimed" for _, _, e in events)
    assert "GPU events wait for the node outbox" in node.log()


async def test_a_corrupt_state_file_is_set_aside_and_the_inventory_starts_fresh(node: Node, node_bus: NodeBus) -> None:
    state_dir = node_bus.root / "data" / "inventory"
    state_dir.mkdir(parents=True)
    (state_dir / "gpus.json").write_text('{"version": 1, "cards": {"0000:18:00.0": {"excluded": "maybe"}}}')
    await node.start()
    await node.wait_card(CARD0, lambda g: mstate(g) == ("Unclaimed", "NoBackingAllocation"), "Unclaimed")
    aside = list(state_dir.glob("gpus.json.unreadable-*"))
    assert len(aside) == 1 and "maybe" in aside[0].read_text()
    assert json.loads((state_dir / "gpus.json").read_text())["version"] == 1
    assert "GPU state file unreadable; renamed aside" in node.log()


async def test_a_converger_that_stops_answering_is_no_change_of_the_cards_upstream(node: Node) -> None:
    """D4 (after issue 41): with the converger stopped (kill -STOP) for about 12 s, or not running, long
    after the inventory started, every card was said upstream as Unknown (Managed=Unknown/
    Indeterminate), held ones too, then Managed again. While the claims are unknown the cards read
    Indeterminate here (fail-closed) but a gpu event says the claimed parts as last said: only the
    card's own news (an XID) is said, and the claims answering again changes nothing upstream."""
    node.claims = [GpuClaim(pci_address=CARD2, kind="allocation", holder="train-01")]
    started = time.monotonic()
    await node.start(BCD_HEALTH_INTERVAL="0.3", BCD_CLAIMS_TIMEOUT="0.3")
    await node.wait_card(CARD2, lambda g: mstate(g) == ("Managed", "BackingAllocation"), "held")
    # past the start (the inventory once held back only its first 15 s): the outage comes later
    await asyncio.sleep(max(0.0, 16 - (time.monotonic() - started)))
    before = len(await node.outbox())
    assert before >= 8

    def told(e: GpuChanged) -> tuple[str, str | None, str | None]:
        return (e.management_state, *(cond_of(e, "Managed") or (None, None)))

    for outage in ("stopped", "absent"):
        if outage == "stopped":
            node.claims_paused = True  # kill -STOP: the requests are taken, nothing answers
        else:
            await node.stop_answering_claims()  # not running: no responder at all
        await node.rescan()  # an evaluation asks for the claims
        await node.wait_card(CARD2, lambda g: mstate(g) == ("Unknown", "Indeterminate"), f"fail-closed while the converger is {outage}")
        if outage == "stopped":
            # the card's own news while the claims are unknown: XID 79
            node.edit_host(**{CARD2: {"health": {"xids": [{"xid": 79, "at": datetime.now(timezone.utc).isoformat()}]}}})
            await node.wait_card(CARD2, lambda g: cond(g, "Healthy") == ("False", "XidCritical"), "XID 79 noticed")
        await asyncio.sleep(2)  # the claims retried on every 0.1-s tick meanwhile
        assert mstate(await node.card(CARD0)) == ("Unknown", "Indeterminate")
        if outage == "stopped":
            node.claims_paused = False
        else:
            await node.answer_claims()
        await node.wait_card(CARD2, lambda g: mstate(g) == ("Managed", "BackingAllocation"), f"held again once the {outage} converger answers")
        await node.wait_card(CARD0, lambda g: mstate(g) == ("Unclaimed", "NoBackingAllocation"), "free again")

    said = [e for _, _, e in (await node.outbox())[before:]]
    assert [e for e in said if e.management_state == "Unknown" or (cond_of(e, "Managed") or ("",))[0] == "Unknown"] == []
    # the one change said is the card's own: XID 79, with its hold as last said
    assert [(e.pci_address, told(e), cond_of(e, "Healthy"), e.phase) for e in said] == [
        (CARD2, ("Managed", "True", "BackingAllocation"), ("False", "XidCritical"), "Failed")
    ]
    assert "claims lookup failed" in node.log()
    node.assert_clean_log()
