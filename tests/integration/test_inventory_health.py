"""GPU health end to end in the real inventory process (issue 30): the fake host's XIDs, ECC
counts, lost cards and a vanished NVML become each card's Healthy condition within seconds, a
`gpu` event in the node outbox, bcd_gpu_condition and the XID counter; an ignored XID changes
nothing; a kill -9 forgets nothing; a reboot with a clean check, or a recheck after a reset,
brings a card back. The converger is played by the test as in test_inventory_gpu.py."""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from typing import Any

import pytest

from shared.schemas import GpuClaim

from .harness import NodeBus
from .test_inventory_gpu import CARD0, CARD1, CARD2, CARD3, Node, cond, host_file, node, until  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

CARD4, CARD5, CARD6, CARD7 = "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"
FAST = {"BCD_HEALTH_INTERVAL": "0.3", "BCD_RESCAN_INTERVAL": "60"}


def health(g: Any) -> tuple[str, str] | None:
    return cond(g, "Healthy")


def xid(n: int, **kw: Any) -> dict[str, Any]:
    return {"xid": n, "at": datetime.now(timezone.utc).isoformat(), **kw}


def add_health(node: Node, pci: str, **fields: Any) -> None:
    card = next(g for g in node.host()["gpus"] if g["pci_address"] == pci)
    h = dict(card.get("health", {}))
    for k, v in fields.items():
        h[k] = [*h.get(k, []), *v] if k == "xids" else v
    node.edit_host(**{pci: {"health": h}})


async def test_each_kind_of_fault_makes_its_card_unhealthy_upstream_and_in_the_metrics(node: Node) -> None:
    host = node.host()
    assert [g["pci_address"] for g in host["gpus"]] == [CARD0, CARD1, CARD2, CARD3, CARD4, CARD5, CARD6, CARD7]
    await node.start(**FAST)
    for pci in (CARD0, CARD7):
        g = await node.card(pci)
        assert health(g) == ("True", "Checked") and g.status.phase == "Ready"
    events_before = len(await node.outbox())

    faults = {
        CARD0: ({"xids": [xid(79)]}, "XidCritical", "XID 79 (GPU has fallen off the bus)"),
        CARD1: ({"xids": [xid(94, gi=1, ci=0)]}, "XidCritical", "XID 94 (contained ECC error) on MIG gi1/ci0"),
        CARD2: ({"ecc_uncorrectable": 1}, "EccUncorrectable", "uncorrectable"),
        CARD3: ({"gone": True}, "GpuLost", "stopped answering"),
        CARD4: ({"row_remap_pending": True}, "RowRemapPending", "remapped rows are pending"),
        CARD5: ({"row_remap_failed": True}, "RowRemapFailed", "needs service"),
    }
    for pci, (fields, _, _) in faults.items():
        add_health(node, pci, **fields)
    add_health(node, CARD6, xids=[xid(43), xid(13)])  # application XIDs: ignored
    for pci, (_, reason, text) in faults.items():
        g = await node.wait_card(pci, lambda g, r=reason: health(g) == ("False", r), f"Healthy=False {reason}", timeout=15)
        assert g.status.phase == "Failed"
        c = next(c for c in g.status.conditions if c.type == "Healthy")
        assert text in c.message, c.message
    ignored = await node.card(CARD6)
    assert health(ignored) == ("True", "Checked") and ignored.status.phase == "Ready"

    # upstream: one gpu event per sick card, each carrying the condition; none for the ignored XIDs
    async def said() -> dict[str, Any] | None:
        got = {e.pci_address: e for _, _, e in (await node.outbox())[events_before:]}
        return got if set(faults) <= set(got) else None

    got = await until(said, "gpu events of the sick cards")
    assert CARD6 not in got and CARD7 not in got
    for pci, (_, reason, _) in faults.items():
        assert got[pci].phase == "Failed"
        assert ("Healthy", "False", reason) in [(c.type, c.status, c.reason) for c in got[pci].status.conditions]

    text = await node.metrics()
    for pci, (_, reason, _) in faults.items():
        assert f'bcd_gpu_condition{{pci_address="{pci}",reason="{reason}",status="False",type="Healthy"}} 1.0' in text
    assert f'bcd_gpu_xid_events_total{{pci_address="{CARD0}",severity="critical",xid="79"}} 1.0' in text
    assert f'bcd_gpu_xid_events_total{{pci_address="{CARD6}",severity="ignored",xid="43"}} 1.0' in text
    assert f'bcd_gpu_ecc_events_total{{kind="uncorrectable",pci_address="{CARD2}"}} 1.0' in text
    assert f'bcd_gpu_phase{{pci_address="{CARD0}",phase="Failed"}} 1.0' in text
    node.assert_clean_log()


async def test_an_unhealthy_card_stays_so_through_a_kill_9_until_a_reboot_or_a_recheck(node: Node, node_bus: NodeBus) -> None:
    await node.start(**FAST)
    add_health(node, CARD0, xids=[xid(79)])
    add_health(node, CARD1, xids=[xid(48)])
    await node.wait_card(CARD0, lambda g: health(g) == ("False", "XidCritical"), "XID 79 noticed")
    await node.wait_card(CARD1, lambda g: health(g) == ("False", "XidCritical"), "XID 48 noticed")

    # kill -9: the XIDs are not in the host file's news any more (the watch reports only what comes
    # after it opened), so only gpus.json can remember them
    sp = node.bus.services[-1]
    sp.proc.send_signal(signal.SIGKILL)
    assert sp.wait() == -signal.SIGKILL
    node.start_inventory(**FAST)
    await node.bus.wait_service("inventory")
    for pci in (CARD0, CARD1):
        g = await node.card(pci)
        assert health(g) == ("False", "XidCritical") and g.status.phase == "Failed"

    # a clean check alone does not bring a card back after a fatal XID
    refused = await node.gpu("recheck", CARD2)  # a healthy card: nothing to clear
    assert refused.accepted is True and refused.message.startswith("nothing cleared; Healthy=True Checked")
    # the operator reset card 1 and asks for a check: it comes back
    back = await node.gpu("recheck", CARD1)
    assert back.accepted is True, back.message
    assert back.message.startswith("cleared XidCritical; Healthy=True Checked")
    assert health(await node.card(CARD1)) == ("True", "Checked")
    # a recheck with the rows still pending clears the XID but not the remap
    add_health(node, CARD0, row_remap_pending=True)
    still = await node.gpu("recheck", CARD0)
    assert still.accepted is False and "RowRemapPending" in still.message

    # a reboot (a new boot id) and a clean check clear the rest
    add_health(node, CARD0, row_remap_pending=False)
    node.edit_host(_={"boot_id": "11111111-2222-3333-4444-555555555555"})
    assert node.bus.services[-1].stop() == 0
    node.start_inventory(**FAST)
    await node.bus.wait_service("inventory")
    await node.wait_card(CARD0, lambda g: health(g) == ("True", "Checked") and g.status.phase == "Ready", "healthy after the reboot")
    assert "GPU healthy again" in node.log()
    bad = await node.gpu("recheck", "0000:3B:00.0")
    assert bad.accepted is False and "canonical PCI address" in bad.message


async def test_nvml_vanishing_loses_every_card_and_its_return_keeps_them_lost(node: Node) -> None:
    await node.start(**FAST)
    node.edit_host(_={"nvml_gone": True})
    for pci in (CARD0, CARD7):
        g = await node.wait_card(pci, lambda g: health(g) == ("False", "GpuLost"), "GpuLost", timeout=15)
        assert "Driver Not Loaded" in next(c.message for c in g.status.conditions if c.type == "Healthy")
    assert "the vendor library does not answer" in node.log()
    node.edit_host(_={"nvml_gone": False})
    await until(lambda: _logged(node, "answers again"), "the watch opened again", timeout=15)
    assert health(await node.card(CARD0)) == ("False", "GpuLost")  # lost until a reset or reboot says otherwise
    node.assert_clean_log()


async def test_health_checks_off_reads_unmonitored_and_keeps_cards_ready(node: Node) -> None:
    await node.start(BCD_HEALTH_CHECKS="off")
    add_health(node, CARD0, xids=[xid(79)])
    g = await node.card(CARD0)
    assert health(g) == ("Unknown", "Unmonitored") and g.status.phase == "Ready"
    reply = await node.gpu("recheck", CARD0)
    assert reply.accepted is False and "health checks are off" in reply.message


async def _logged(node: Node, text: str) -> bool:
    return text in node.log()



async def test_a_reset_that_worked_brings_a_card_back_after_a_clean_check(node: Node) -> None:
    await node.start(**FAST)
    add_health(node, CARD2, xids=[xid(79)])
    await node.wait_card(CARD2, lambda g: health(g) == ("False", "XidCritical"), "XID 79 noticed")
    # a reset that failed clears nothing
    await node.switch_result(pci=CARD2, target="reset", outcome="Failed", reason="WriteFailed")
    await node.switch_result(pci=CARD3, target="reset", outcome="Succeeded", reason="Reset")
    await until(lambda: _logged(node, "switch result"), "the notices taken")
    assert health(await node.card(CARD2)) == ("False", "XidCritical")
    # `bcd gpu reset` did it (the switcher's notice): the inventory checks the card again
    await node.switch_result(pci=CARD2, target="reset", outcome="Succeeded", reason="Reset")
    g = await node.wait_card(CARD2, lambda g: health(g) == ("True", "Checked"), "healthy after the reset")
    assert g.status.phase == "Ready"
    assert "GPU healthy again: a clean check cleared its faults" in node.log()
    node.assert_clean_log()


async def test_a_broken_host_file_loses_no_card(node: Node) -> None:
    """The fake host file half written is no reason to call every card lost (it is not NVML gone)."""
    await node.start(**FAST)
    good = node.host_file.read_bytes()
    node.host_file.write_text('{"gpus": [')
    await until(lambda: _logged(node, "GPU health not read this time"), "the health thread noticing the bad file", timeout=10)
    assert health(await node.card(CARD0)) == ("True", "Checked")
    node.host_file.write_bytes(good)
    add_health(node, CARD1, xids=[xid(79)])
    await node.wait_card(CARD1, lambda g: health(g) == ("False", "XidCritical"), "XID 79 noticed after the file reads again")
    assert health(await node.card(CARD0)) == ("True", "Checked")


async def test_a_recheck_of_a_held_card_checks_but_keeps_its_sticky_faults(node: Node) -> None:
    """Issue 41 (8): XID 79 on a held card; `bcd gpu reset` is refused (held), yet `bcd gpu recheck`
    answered `cleared XidCritical; Healthy=True`. No reset happens to a held card, so a recheck of one
    checks and says, keeping its sticky faults; on a free card a clean check clears them."""
    node.claims = [GpuClaim(pci_address=CARD2, kind="allocation", holder="train-01")]
    await node.start(**FAST)
    add_health(node, CARD2, xids=[xid(79)])
    await node.wait_card(CARD2, lambda g: health(g) == ("False", "XidCritical"), "XID 79 noticed")

    held = await node.gpu("recheck", CARD2)
    assert held.accepted is False, held.message
    assert held.message.startswith("kept XidCritical: the card is held (allocation train-01)"), held.message
    assert "until the hold is released and the card is reset (bcd gpu reset) or the node rebooted" in held.message
    assert held.gpu is not None and health(held.gpu) == ("False", "XidCritical")
    assert health(await node.card(CARD2)) == ("False", "XidCritical")

    # the hold goes; the operator reset the card another way and asks: a clean check clears it
    await node.set_claims()
    await node.wait_card(CARD2, lambda g: g.status.driver_binding.management_state == "Unclaimed", "free")
    free = await node.gpu("recheck", CARD2)
    assert free.accepted is True and free.message.startswith("cleared XidCritical; Healthy=True Checked"), free.message
    node.assert_clean_log()


async def test_a_held_card_that_falls_off_the_bus_is_lost_at_once_and_never_said_unclaimed(node: Node) -> None:
    """Issue 41 (2): `present: false` on a held card: it stayed Ready until the 30-s scan, then dropped
    out of the inventory silently while the hold stayed; back on the bus it was first said
    Ready/Unclaimed. Now it is GpuLost as promptly as an XID (the scan interval here is 60 s), stays
    listed, is said upstream, and its return never reads Unclaimed while held."""
    node.claims = [GpuClaim(pci_address=CARD2, kind="allocation", holder="train-01")]
    await node.start(**{**FAST, "BCD_HEALTH_INTERVAL": "30"})  # neither the scan nor a check finds it
    await node.wait_card(CARD2, lambda g: g.status.driver_binding.management_state == "Managed", "held")
    before = len(await node.events_of(CARD2))

    node.edit_host(**{CARD2: {"present": False}})
    lost = await node.wait_card(CARD2, lambda g: health(g) == ("False", "GpuLost"), "GpuLost", timeout=3)
    assert lost.status.phase == "Failed" and cond(lost, "AdapterReady") == ("False", "NotOnBus")
    assert lost.status.driver_binding.management_state == "Managed"  # its hold is still accounted for
    said = (await node.events_of(CARD2))[before:]
    assert said and said[-1].phase == "Failed"
    assert ("Healthy", "False", "GpuLost") in [(c.type, c.status, c.reason) for c in said[-1].status.conditions]

    node.edit_host(**{CARD2: {"present": True}})
    await node.rescan()
    back = await node.card(CARD2)
    assert back.status.driver_binding.management_state == "Managed" and health(back) == ("False", "GpuLost")
    assert all(e.management_state != "Unclaimed" for e in (await node.events_of(CARD2))[before:])
    node.assert_clean_log()


async def test_a_free_card_that_falls_off_the_bus_is_lost_too(node: Node) -> None:
    await node.start(**FAST)
    node.edit_host(**{CARD5: {"present": False}})
    lost = await node.wait_card(CARD5, lambda g: health(g) == ("False", "GpuLost"), "GpuLost", timeout=3)
    assert lost.status.phase == "Failed"
    assert [g.pci_address for g in (await node.inventory()).gpus].count(CARD5) == 1
    # asked about, it is the listed card it is: nothing to check off the bus
    reply = await node.gpu("recheck", CARD5)
    assert reply.accepted is False and "off the bus" in reply.message, reply.message
    node.assert_clean_log()


async def test_a_card_the_check_no_longer_sees_is_scanned_at_once(node: Node) -> None:
    """The class of issue 41 (2) for any adapter: a card on its compute driver that a health check no
    longer names (NVML lost sight of it) makes the inventory scan now, not at the next rescan (60 s
    here): here the card went to vfio-pci behind bcd's back, which is no loss."""
    await node.start(**FAST)
    node.edit_host(**{CARD6: {"driver": "vfio-pci", "driver_override": "vfio-pci"}})
    moved = await node.wait_card(CARD6, lambda g: g.status.driver_binding.mode == "Passthrough", "scanned on vfio-pci", timeout=5)
    assert health(moved) != ("False", "GpuLost")
    node.assert_clean_log()


async def test_a_card_moved_to_vfio_reads_not_checked_and_back_again_until_checked(node: Node) -> None:
    """D2 (after issue 41): a card moved to vfio-pci kept `Healthy=True/Checked` ('the vendor library
    answers') from its last check on nvidia. The library cannot see it there: it reads
    Unknown/NotChecked, upstream too; back on nvidia it is Checked again only once a check saw it.
    (No periodic check in the test's time: the scans and the recheck are the test's.)"""
    await node.start(**{**FAST, "BCD_HEALTH_INTERVAL": "120"})
    assert health(await node.card(CARD2)) == ("True", "Checked")
    node.edit_host(**{CARD2: {"driver": "vfio-pci", "driver_override": "vfio-pci"}})
    moved = next(g for g in (await node.rescan()).gpus if g.pci_address == CARD2)
    assert moved.status.driver_binding.mode == "Passthrough"
    assert health(moved) == ("Unknown", "NotChecked")
    c = next(c for c in moved.status.conditions if c.type == "Healthy")
    assert "vfio-pci" in c.message and "answers" not in c.message, c.message
    said = await until(lambda: _said_on(node, CARD2, "Passthrough"), "the gpu event of the move")
    assert ("Healthy", "Unknown", "NotChecked") in [(c.type, c.status, c.reason) for c in said.status.conditions]
    assert (await node.gpu("recheck", CARD2)).accepted is False  # nothing can check it there

    # a sticky fault it had stays through the passthrough
    add_health(node, CARD3, xids=[xid(79)])
    await node.wait_card(CARD3, lambda g: health(g) == ("False", "XidCritical"), "XID 79 noticed")
    node.edit_host(**{CARD3: {"driver": "vfio-pci", "driver_override": "vfio-pci"}})
    gone = next(g for g in (await node.rescan()).gpus if g.pci_address == CARD3)
    assert gone.status.driver_binding.mode == "Passthrough" and health(gone) == ("False", "XidCritical")

    # back on nvidia: NotChecked at the scan, Checked once a check saw it there
    node.edit_host(**{CARD2: {"driver": "nvidia", "driver_override": ""}})
    back = next(g for g in (await node.rescan()).gpus if g.pci_address == CARD2)
    assert back.status.driver_binding.mode == "Compute" and health(back) == ("Unknown", "NotChecked")
    checked = await node.gpu("recheck", CARD2)
    assert checked.accepted is True and checked.gpu is not None and health(checked.gpu) == ("True", "Checked"), checked.message
    node.assert_clean_log()


async def _said_on(node: Node, pci: str, mode: str) -> Any:
    return next((e for e in reversed(await node.events_of(pci)) if e.status.driver_binding.mode == mode), None)
