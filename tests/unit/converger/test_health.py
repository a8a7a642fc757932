"""An unhealthy card (issue 30) through the converger: new holds, VMs and DRA claims on it are
refused naming its Healthy condition; holds already on it are kept and say DevicesHealthy upstream."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import msgspec
import pytest

from services.converger.claims import check_claim
from services.converger.plan import DEVICES_HEALTHY, plan_hold_health
from services.converger.model import SetHoldCondition
from shared.schemas import ClaimDevice, ClaimPrepareRequest, Condition, InstanceGpus
from tests.converger_kit import GPU, Node, fast_dir, hold, host_inventory, spec, with_status

T0 = datetime(2026, 12, 3, 10, 0, tzinfo=timezone.utc)
XID79 = Condition(type="Healthy", status="False", reason="XidCritical", message="XID 79 (GPU has fallen off the bus) at 2026-12-03T10:00:00Z", since=T0)
LOST = Condition(type="Healthy", status="False", reason="GpuLost", message="the card stopped answering", since=T0)
WELL = Condition(type="Healthy", status="True", reason="Checked", message="ok", since=T0)
UNMONITORED = Condition(type="Healthy", status="Unknown", reason="Unmonitored", message="cannot register", since=T0)


def pci_of(node: Node, atom: str) -> str:
    return next(g.pci_address for g in node.inventory.gpus if g.atom_id == atom)


def test_a_new_hold_on_an_unhealthy_card_fails_naming_the_condition() -> None:
    with fast_dir() as root:
        node = Node(root)
        node.inventory = with_status(node.inventory, pci_of(node, GPU[0]), conditions=(XID79,))
        p = node.plan(spec(1, hold("a1", GPU[0]), hold("b1", GPU[1])))
        failures = {f.allocation_id: f for f in p.failures}
        assert set(failures) == {"a1"}
        assert failures["a1"].reason == "device-unhealthy"
        assert "Healthy=False XidCritical: XID 79 (GPU has fallen off the bus)" in failures["a1"].message
        assert p.section.state == "FAILED" and "a1: device-unhealthy" in p.section.message


@pytest.mark.parametrize(
    "condition",
    [pytest.param(WELL, id="healthy"), pytest.param(UNMONITORED, id="unmonitored-is-not-unhealthy")],
)
def test_a_card_that_is_not_unhealthy_takes_holds(condition: Condition) -> None:
    with fast_dir() as root:
        node = Node(root)
        node.inventory = with_status(node.inventory, pci_of(node, GPU[0]), conditions=(condition,))
        assert not node.plan(spec(1, hold("a1", GPU[0]))).failures


def test_a_hold_on_a_card_that_turns_unhealthy_is_kept_and_says_so() -> None:
    async def main() -> None:
        with fast_dir() as root:
            node = Node(root)
            wanted = spec(1, hold("a1", GPU[0]), hold("b1", GPU[1]))
            await node.converge(wanted)
            pci = pci_of(node, GPU[0])
            healthy = node.inventory
            node.inventory = with_status(healthy, pci, conditions=(XID79,))
            p, _ = await node.converge(wanted)
            assert [type(s).__name__ for s in p.steps] == ["SetHoldCondition"]
            assert set(node.holds()) == {"a1", "b1"}  # kept
            [event] = node.outbox.of_type("hold")
            assert event["allocation_id"] == "a1" and event["devices"] == [GPU[0]]
            c = event["condition"]
            assert (c["type"], c["status"], c["reason"]) == (DEVICES_HEALTHY, "False", "XidCritical")
            assert f"{GPU[0]} on {pci}: Healthy=False XidCritical" in c["message"]
            # nothing to do: the same sickness is not said twice
            assert not node.plan(wanted).steps
            # another reason on the card: said again, with the since of the first
            node.inventory = with_status(healthy, pci, conditions=(LOST,))
            p, _ = await node.converge(wanted)
            assert [type(s).__name__ for s in p.steps] == ["SetHoldCondition"]
            assert node.outbox.of_type("hold")[-1]["condition"]["since"] == c["since"]
            # well again
            node.inventory = with_status(healthy, pci, conditions=(WELL,))
            p, _ = await node.converge(wanted)
            last = node.outbox.of_type("hold")[-1]
            assert (last["condition"]["status"], last["condition"]["reason"]) == ("True", "Healthy")
            assert not node.plan(wanted).steps
            # a restart replays nothing: the state file remembers what was said
            again = node.restart()
            again.inventory = node.inventory
            assert not again.plan(wanted).steps
            # released: the record goes with the hold
            await again.converge(spec(2, hold("b1", GPU[1])))
            assert "a1" not in again.state.hold_conditions

    asyncio.run(main())


def test_hold_health_table() -> None:
    with fast_dir() as root:
        node = Node(root)
        wanted = spec(1, hold("a1", GPU[0]))
        asyncio.run(node.converge(wanted))
        observed = node.observe(wanted)
        kept = dict(observed.holds)
        from services.converger.atoms import AtomIndex

        def steps(inv, said):
            obs = msgspec.structs.replace(observed.state, hold_conditions=said)
            import dataclasses

            return plan_hold_health(dataclasses.replace(observed, state=obs, inventory=inv), AtomIndex(inv), kept)

        pci = pci_of(node, GPU[0])
        sick = with_status(node.inventory, pci, conditions=(XID79,))
        false = Condition(type=DEVICES_HEALTHY, status="False", reason="XidCritical", message=f"{GPU[0]} on {pci}: Healthy=False XidCritical: {XID79.message}", since=T0)
        true = Condition(type=DEVICES_HEALTHY, status="True", reason="Healthy", message="every card of the hold is healthy again", since=T0)
        assert steps(node.inventory, {}) == []  # quiet
        [s] = steps(sick, {})
        assert isinstance(s, SetHoldCondition) and s.condition.status == "False"  # sick
        assert steps(sick, {"a1": false}) == []  # still sick
        [s] = steps(node.inventory, {"a1": false})
        assert s.condition.status == "True"  # well again
        assert steps(node.inventory, {"a1": true}) == []  # quiet again


def test_a_vm_does_not_get_an_unhealthy_card() -> None:
    with fast_dir() as root:
        node = Node(root)
        pci = pci_of(node, GPU[2])
        node.inventory = with_status(node.inventory, pci, conditions=(XID79,))
        s = spec(1, instances=[InstanceGpus(instance_id="vm-1", gpus=[pci])])
        p = node.plan(s)
        assert not [st for st in p.steps if type(st).__name__ == "SwitchGpu"]
        assert any("vm-1" in n and "unhealthy (Healthy=False XidCritical" in n for n in p.vfio_notes), p.vfio_notes


def test_a_dra_claim_on_an_unhealthy_card_is_refused() -> None:
    inv = host_inventory()
    g = inv.gpus[0]
    sick = with_status(inv, g.pci_address, conditions=(XID79,))
    request = ClaimPrepareRequest(
        uid="0b6f4a39-1c1e-4d6b-9a53-0123456789ab",
        namespace="ml",
        name="c1",
        devices=[ClaimDevice(requests=["gpu"], pool="node-1", device="gpu-0", pci=g.pci_address, kind="gpu")],
    )
    assert check_claim(request, inv, [], {}, privileged=True) is None
    got = check_claim(request, sick, [], {}, privileged=True)
    assert got is not None and got.reason == "device-unhealthy"
    assert "the card is unhealthy: Healthy=False XidCritical" in got.message
    json.dumps(got.message)


def test_a_card_turning_unhealthy_plans_differently() -> None:
    """The converger runs a pass for an inventory whose planner view changed: health must be in it."""
    from services.converger.vfio import planner_view

    inv = host_inventory()
    sick = with_status(inv, inv.gpus[0].pci_address, conditions=(XID79,))
    assert planner_view(inv) != planner_view(sick)
    assert planner_view(sick).gpus[0].status.unhealthy() == XID79


def test_the_longest_hold_condition_id_fits_the_event_id_pattern() -> None:
    import re

    from shared.eventids import hold_condition_id
    from shared.schemas.common import EVENT_ID_PATTERN

    c = Condition(type=DEVICES_HEALTHY, status="Unknown", reason="XidCritical", message="m", since=T0)
    longest = hold_condition_id("n" * 63, "a" * 64, 2**63 - 1, c)
    assert re.match(EVENT_ID_PATTERN, longest), (len(longest), longest)
