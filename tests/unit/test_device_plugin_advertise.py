"""The device plugin's pure parts as tables: what is advertised (and what is not), resource
names, preferred allocations, and the env an Allocate answers."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from services.device_plugin.advertise import (
    AdvertisedDevice,
    AllocateRefused,
    BadResourceName,
    ResourceNames,
    allocation_env,
    check_resource_name,
    plan_advertisement,
    preferred_allocation,
    profile_token,
    socket_name,
)
from shared.holdfiles import BINDING_HOLD, BINDING_KUBERNETES, HoldOnDisk, device_name
from shared.schemas import Gpu, Inventory, MigInstance, PhysicalGPUStatus, Slot

U0, U1 = "GPU-00000000-0000-4000-8000-000000000000", "GPU-11111111-1111-4111-8111-111111111111"
MIG = f"{U1}/gi1/ci0"
NAMES = ResourceNames()


def card(uuid: str, index: int, *, phase: str = "Ready", numa: int | None = 0, migs: tuple[MigInstance, ...] = (), slots: int = 0) -> Gpu:
    return Gpu(
        atom_id=uuid,
        uuid=uuid,
        index=index,
        pci_address=f"0000:0{index}:00.0",
        numa_node=numa,
        mig_mode=bool(migs),
        mig_instances=list(migs),
        slots=[Slot(atom_id=f"{uuid}/slot{i}", index=i) for i in range(slots)],
        status=PhysicalGPUStatus(phase=phase),  # type: ignore[arg-type]
    )


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory(node_id="node-1", observed_at=datetime.now(timezone.utc), gpus=list(gpus))


def hold(alloc: str, *atoms: str, binding: str = BINDING_KUBERNETES) -> HoldOnDisk:
    return HoldOnDisk(
        allocation_id=alloc,
        reservation_id=f"rsv-{alloc}",
        generation=1,
        binding=binding,
        devices=atoms,
        cdi_names=tuple(f"bcd.dev/gpu={device_name(a)}" for a in atoms),
    )


MIG_INV = MigInstance(atom_id=MIG, uuid="MIG-aaaaaaaa-0000-4000-8000-000000000000", gi=1, ci=0, profile="1g.18gb")
HOST = inventory(card(U0, 0, slots=2), card(U1, 1, numa=1, migs=(MIG_INV,)))


def ids(advert, resource):
    return [(d.id, d.healthy) for d in advert.devices_of(resource)]


@pytest.mark.parametrize(
    "holds, inv, withdrawn, expect, views",
    [
        pytest.param({}, HOST, (), {}, {}, id="nothing to advertise"),
        pytest.param({"p": hold("p", U0, binding=BINDING_HOLD)}, HOST, (), {}, {}, id="a plain hold is not advertised"),
        pytest.param({"k": hold("k", U0)}, HOST, (), {"bcd.dev/gpu": [(U0, True)]}, {"k": True}, id="a whole card"),
        pytest.param(
            {"k": hold("k", MIG)}, HOST, (), {"bcd.dev/mig-1g.18gb": [(device_name(MIG), True)]}, {"k": True}, id="a MIG instance by its profile"
        ),
        pytest.param(
            {"k": hold("k", f"{U0}/slot0", f"{U0}/slot1")},
            HOST,
            (),
            {"bcd.dev/gpu-slot": [(f"{U0}_slot0", True), (f"{U0}_slot1", True)]},
            {"k": True},
            id="slots",
        ),
        pytest.param({"k": hold("k", U0)}, HOST, ("k",), {}, {"k": False}, id="a withdrawn hold leaves"),
        pytest.param(
            {"k": hold("k", U0)}, inventory(card(U0, 0, phase="Passthrough")), (), {"bcd.dev/gpu": [(U0, False)]}, {"k": True}, id="a card not Ready is Unhealthy"
        ),
        pytest.param({"k": hold("k", U0)}, None, (), {"bcd.dev/gpu": [(U0, False)]}, {"k": True}, id="no inventory yet: Unhealthy"),
        pytest.param({"k": hold("k", U0)}, inventory(card(U1, 1)), (), {"bcd.dev/gpu": [(U0, False)]}, {"k": True}, id="a card the inventory lacks"),
        pytest.param({"k": hold("k", f"{U0}/gi9/ci0")}, HOST, (), {}, {"k": False}, id="a MIG atom the inventory lacks has no resource"),
    ],
)
def test_what_is_advertised(holds, inv, withdrawn, expect, views):
    advert = plan_advertisement(holds, inv, NAMES, withdrawn)
    for resource in {*expect, "bcd.dev/gpu", "bcd.dev/gpu-slot"}:
        assert ids(advert, resource) == expect.get(resource, []), resource
    assert {a: v.advertised for a, v in advert.holds.items()} == views
    # every resource the node can have is served, empty or not
    assert {"bcd.dev/gpu", "bcd.dev/gpu-slot"} <= set(advert.resources)
    if inv is HOST:
        assert "bcd.dev/mig-1g.18gb" in advert.resources


def test_devices_carry_numa_topology_cdi_names_and_visible_ids():
    advert = plan_advertisement({"a": hold("a", U0), "b": hold("b", MIG)}, HOST, NAMES)
    gpu, mig = advert.by_id[U0], advert.by_id[device_name(MIG)]
    assert (gpu.numa_node, gpu.cdi_name, gpu.visible_id, gpu.allocation_id) == (0, f"bcd.dev/gpu={U0}", U0, "a")
    assert (mig.numa_node, mig.cdi_name, mig.visible_id) == (1, f"bcd.dev/gpu={device_name(MIG)}", MIG_INV.uuid)
    unknown_numa = plan_advertisement({"a": hold("a", U0)}, inventory(card(U0, 0, numa=None)), NAMES)
    assert unknown_numa.by_id[U0].numa_node is None


def test_served_resources_stay_in_the_plan_when_their_last_device_goes():
    advert = plan_advertisement({}, inventory(card(U0, 0)), NAMES, served=["bcd.dev/mig-1g.18gb"])
    assert advert.resources["bcd.dev/mig-1g.18gb"] == ()


@pytest.mark.parametrize(
    "names, expect",
    [
        (ResourceNames(), ("bcd.dev/gpu", "bcd.dev/gpu-slot", "bcd.dev/mig-1g.10gb.me")),
        (ResourceNames(domain="example.com", gpu="accel", mig="accel-mig-{profile}", slot="accel-share"), ("example.com/accel", "example.com/accel-share", "example.com/accel-mig-1g.10gb.me")),
    ],
)
def test_resource_names_are_configurable(names, expect):
    names.check()
    assert (names.gpu_name, names.slot_name, names.mig_name("1g.10gb+me")) == expect


@pytest.mark.parametrize(
    "names",
    [
        ResourceNames(domain="kubernetes.io"),
        ResourceNames(domain="node.kubernetes.io"),
        ResourceNames(domain="Bad_Domain"),
        ResourceNames(gpu="-gpu"),
        ResourceNames(gpu="g" * 64),
        ResourceNames(mig="mig"),
        ResourceNames(gpu="same", slot="same"),
    ],
)
def test_bad_resource_names_are_refused(names):
    with pytest.raises(BadResourceName):
        names.check()


def test_names_sockets_and_profiles():
    assert check_resource_name("bcd.dev/gpu") == "bcd.dev/gpu"
    assert profile_token("1g.10gb") == "1g.10gb" and profile_token("1g.10gb+me") == "1g.10gb.me"
    assert socket_name("bcd.dev/mig-1g.10gb") == "bcd-mig-1g.10gb.sock"


@pytest.mark.parametrize("profile", ["", "<profile>", "+", "-1g", "1g.10gb-"])
def test_a_profile_that_makes_no_name_part_builds_no_resource_name(profile):
    """Issue 41 (14c): `mig_name('<profile>')` was `bcd.dev/mig-.profile.` (in the PING metadata): a name
    is never built of an empty or placeholder part."""
    with pytest.raises(BadResourceName):
        NAMES.mig_name(profile)


def test_the_mig_resources_are_named_as_a_pattern_for_people():
    assert NAMES.mig_pattern == "bcd.dev/mig-{profile}"
    assert ResourceNames(domain="example.com", mig="accel-mig-{profile}").mig_pattern == "example.com/accel-mig-{profile}"


def test_a_mig_instance_whose_profile_makes_no_name_is_not_advertised_and_the_hold_says_why():
    odd = MigInstance(atom_id=MIG, uuid="MIG-aaaaaaaa-0000-4000-8000-000000000000", gi=1, ci=0, profile="<?>")
    advert = plan_advertisement({"km": hold("km", MIG)}, inventory(card(U1, 1, migs=(odd,))), NAMES)
    assert not any(r.startswith("bcd.dev/mig-") for r in advert.resources)
    view = advert.holds["km"]
    assert not view.advertised and "makes no resource name part" in view.reason


def dev(i: str, alloc: str, numa: int | None = 0) -> AdvertisedDevice:
    return AdvertisedDevice(i, "bcd.dev/gpu", alloc, i, f"bcd.dev/gpu={i}", True, numa, i)


POOL = {d.id: d for d in (dev("a1", "a"), dev("a2", "a"), dev("b1", "b", 1), dev("c1", "c", 1), dev("c2", "c", 1), dev("c3", "c", 1))}


@pytest.mark.parametrize(
    "available, must, size, expect",
    [
        (["a1", "a2", "b1", "c1", "c2", "c3"], [], 2, ["a1", "a2"]),  # the hold that fits exactly
        (["a1", "a2", "b1", "c1", "c2", "c3"], [], 1, ["b1"]),
        (["a1", "a2", "b1", "c1", "c2", "c3"], ["c1"], 2, ["c1", "c2"]),  # the must-include's hold first
        (["a1", "a2", "b1", "c1", "c2", "c3"], [], 3, ["c1", "c2", "c3"]),
        (["a1", "b1", "c1"], ["b1"], 2, ["b1", "c1"]),  # then the same NUMA node
        (["a1", "a2"], [], 3, ["a1", "a2"]),  # fewer than asked: all there is
        (["a1"], ["zz"], 1, ["a1"]),  # a must-include that is not available is not invented
    ],
)
def test_preferred_allocation(available, must, size, expect):
    assert preferred_allocation(POOL, available, must, size) == expect


ENV_A = b"BCD_ALLOCATION_ID=a\nBCD_RESERVATION_ID=rsv-a\nNVIDIA_VISIBLE_DEVICES=a1,a2\nTEAM=ml\n"
ENV_B = b"BCD_ALLOCATION_ID=b\nBCD_RESERVATION_ID=rsv-b\nNVIDIA_VISIBLE_DEVICES=b1\nTEAM=ml\n"


def test_allocate_env_is_the_hold_s_narrowed_to_the_devices_given():
    env = allocation_env([POOL["a2"]], {"a": ENV_A})
    assert env == {"BCD_ALLOCATION_ID": "a", "BCD_RESERVATION_ID": "rsv-a", "TEAM": "ml", "NVIDIA_VISIBLE_DEVICES": "a2"}
    both = allocation_env([POOL["a1"], POOL["b1"]], {"a": ENV_A, "b": ENV_B})
    assert both["BCD_ALLOCATION_ID"] == "a,b" and both["NVIDIA_VISIBLE_DEVICES"] == "a1,b1" and both["TEAM"] == "ml"


def test_allocate_env_refusals():
    with pytest.raises(AllocateRefused, match="env file of allocation a"):
        allocation_env([POOL["a1"]], {})
    with pytest.raises(AllocateRefused, match="set TEAM differently"):
        allocation_env([POOL["a1"], POOL["b1"]], {"a": ENV_A, "b": ENV_B.replace(b"TEAM=ml", b"TEAM=web")})


def test_an_unhealthy_card_is_unhealthy_naming_its_condition():
    """Issue 30: a card with a fatal XID is Unhealthy in the next ListAndWatch, and says why."""
    from shared.schemas import Condition

    xid = Condition(type="Healthy", status="False", reason="XidCritical", message="XID 79 (GPU has fallen off the bus)", since=datetime(2026, 12, 3, tzinfo=timezone.utc))
    sick = card(U0, 0, phase="Failed")
    sick = Gpu(**{**{f: getattr(sick, f) for f in sick.__struct_fields__}, "status": PhysicalGPUStatus(phase="Failed", conditions=[xid])})
    advert = plan_advertisement({"k": hold("k", U0)}, inventory(sick), NAMES, ())
    [d] = advert.devices_of("bcd.dev/gpu")
    assert not d.healthy
    assert d.why == "card 0000:00:00.0 is unhealthy: Healthy=False XidCritical: XID 79 (GPU has fallen off the bus)"
    # the same card well again is Healthy
    well = card(U0, 0)
    assert [x.healthy for x in plan_advertisement({"k": hold("k", U0)}, inventory(well), NAMES, ()).devices_of("bcd.dev/gpu")] == [True]
