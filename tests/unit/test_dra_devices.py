"""The DRA plugin's pure part as tables: which cards are published, the devices and counters of
a MIG card, the split into ResourceSlices within the 1.35 limits, the content key, and mapping a
device name back to a card. A small allocator stands in for the scheduler and shows that the
counters keep MIG placements exclusive."""

from __future__ import annotations

import random
import re
from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from services.dra_plugin.devices import (
    ATTRIBUTE_DOMAIN,
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS,
    NODE_LABEL,
    Pool,
    counter_set_name,
    is_dns_label,
    mig_device_name,
    plan_pool,
    pool_content_key,
    profile_label,
    quantity,
    render_slices,
    resolve,
    resolve_device,
)
from shared.schemas import (
    ClaimDevice,
    Claims,
    DriverBinding,
    Gpu,
    GpuClaim,
    GpuInstance,
    Inventory,
    MigInstance,
    MigPlacement,
    MigProfile,
    PhysicalGPUStatus,
)

GiB = 1 << 30
NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
NODE = "node-1"
DRIVER = "gpu.bcd.dev"


def prof(name, pid, slices, mem_gib, starts, size, sm, ce, dec, jpeg, ofa=0, enc=0) -> MigProfile:
    return MigProfile(
        name=name,
        profile_id=pid,
        slices=slices,
        memory_bytes=mem_gib * GiB,
        placements=[MigPlacement(start=s, size=size) for s in starts],
        multiprocessors=sm,
        copy_engines=ce,
        decoders=dec,
        encoders=enc,
        jpeg_engines=jpeg,
        ofa_engines=ofa,
    )


#: an H100 80GB's GPU instance profiles (NVML ids, placements in memory slices, engine counts)
H100 = [
    prof("1g.10gb", 19, 1, 10, range(7), 1, 16, 1, 1, 1),
    prof("1g.20gb", 15, 1, 20, (0, 2, 4, 6), 2, 26, 1, 1, 1),
    prof("2g.20gb", 14, 2, 20, (0, 2, 4), 2, 32, 2, 2, 2),
    prof("3g.40gb", 9, 3, 40, (0, 4), 4, 60, 3, 3, 3),
    prof("4g.40gb", 5, 4, 40, (0,), 4, 64, 4, 4, 4),
    prof("7g.80gb", 0, 7, 80, (0,), 8, 132, 8, 7, 7, ofa=1),
]
H100_PLACEMENTS = {p.name: [(pl.start, pl.size) for pl in p.placements] for p in H100}


def pci(index: int) -> str:
    return f"0000:{index // 32 + 0x10:02x}:{index % 32:02x}.0"


def card(
    index: int,
    *,
    phase: str = "Ready",
    mig: bool = False,
    profiles: list[MigProfile] | None = None,
    gis: tuple[int, ...] = (),
    migs: tuple[int, ...] = (),
    driver: str = "nvidia",
    binding_driver: str = "nvidia",
    mode: str = "Compute",
    state: str = "Managed",
    name: str = "NVIDIA H100 80GB HBM3",
    uuid: str | None = None,
) -> Gpu:
    uuid = uuid or f"GPU-{index:08x}-0000-4000-8000-000000000000"
    return Gpu(
        atom_id=uuid,
        uuid=uuid,
        index=index,
        pci_address=pci(index),
        name=name,
        memory_bytes=80 * GiB,
        driver=driver,
        base_driver="nvidia",
        mig_mode=mig,
        mig_profiles=list(H100 if profiles is None and mig else profiles or []),
        gpu_instances=[GpuInstance(gi=g, profile="1g.10gb", placement=MigPlacement(start=g, size=1), compute_instances=1) for g in gis],
        mig_instances=[MigInstance(atom_id=f"{uuid}/gi{g}/ci0", gi=g, ci=0, profile="1g.10gb") for g in migs],
        status=PhysicalGPUStatus(
            phase=phase,  # type: ignore[arg-type]
            driver_binding=DriverBinding(driver=binding_driver, mode=mode, management_state=state),  # type: ignore[arg-type]
        ),
    )


def inventory(*gpus: Gpu, revision: int = 1, at: datetime = NOW) -> Inventory:
    return Inventory(node_id="node-1", revision=revision, observed_at=at, gpus=list(gpus))


def claims(*held: tuple[int, str, str], vfio: tuple[int, ...] = ()) -> Claims:
    return Claims(
        claims=[GpuClaim(pci_address=pci(i), kind=kind, holder=holder) for i, kind, holder in held],  # type: ignore[arg-type]
        vfio=[pci(i) for i in vfio],
        at=NOW,
    )


FREE = claims()


def names(pool: Pool) -> list[str]:
    return [d.name for d in pool.devices]


# --------------------------------------------------------------------------- a checker of the 1.35 rules

_C_ID = re.compile(r"^[_a-zA-Z][_a-zA-Z0-9]*$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^(0|[1-9][0-9]*)([kMGTPE]?)$")


def parse_quantity(q: str) -> int:
    m = _QUANTITY.match(q)
    assert m, f"{q!r} is not a quantity this module writes"
    return int(m.group(1)) * 1000 ** " kMGTPE".index(m.group(2) or " ")


def check_qualified(name: str) -> None:
    domain, _, ident = name.partition("/")
    assert domain == ATTRIBUTE_DOMAIN and len(domain) <= 63 and _SUBDOMAIN.match(domain), name
    assert len(ident) <= 32 and _C_ID.match(ident), name


def check_slice(s: dict, *, count: int) -> None:
    """What the API server would refuse in a ResourceSlice of this module (resource.k8s.io/v1, 1.35)."""
    assert s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice"
    meta, spec = s["metadata"], s["spec"]
    assert len(meta["name"]) <= 253 and _SUBDOMAIN.match(meta["name"]), meta["name"]
    for v in meta["labels"].values():
        assert len(v) <= 63 and _LABEL_VALUE.match(v), v
    assert spec["pool"]["resourceSliceCount"] == count and spec["pool"]["generation"] >= 0
    assert spec["pool"]["name"] == spec["nodeName"]
    assert ("devices" in spec) != ("sharedCounters" in spec), "devices or shared counters, never both"
    for cs in spec.get("sharedCounters", []):
        assert is_dns_label(cs["name"])
        assert 0 < len(cs["counters"]) <= 32
        for k, v in cs["counters"].items():
            assert is_dns_label(k)
            parse_quantity(v["value"])
    assert len(spec.get("sharedCounters", [])) <= MAX_COUNTER_SETS_PER_SLICE
    devices = spec.get("devices", [])
    limit = 64 if any(d.get("consumesCounters") for d in devices) else 128
    assert len(devices) <= limit
    for d in devices:
        assert is_dns_label(d["name"]), d["name"]
        assert len(d["attributes"]) + len(d.get("capacity", {})) <= 32
        for k, v in d["attributes"].items():
            check_qualified(k)
            assert len(v) == 1 and next(iter(v)) in ("string", "int", "bool"), (k, v)
            if "string" in v:
                assert isinstance(v["string"], str) and len(v["string"].encode()) <= 64
            if "int" in v:
                assert isinstance(v["int"], int) and not isinstance(v["int"], bool)
        for k, v in d.get("capacity", {}).items():
            check_qualified(k)
            parse_quantity(v["value"])
        consumes = d.get("consumesCounters", [])
        assert len(consumes) <= 2
        for c in consumes:
            assert is_dns_label(c["counterSet"]) and 0 < len(c["counters"]) <= 32
            for k, v in c["counters"].items():
                assert is_dns_label(k)
                parse_quantity(v["value"])
        for field in ("bindingConditions", "bindingFailureConditions"):
            assert len(d.get(field, [])) <= 4


def check_pool(slices: list[dict]) -> None:
    for s in slices:
        check_slice(s, count=len(slices))
    assert len({s["metadata"]["name"] for s in slices}) == len(slices)
    assert len({s["spec"]["pool"]["generation"] for s in slices}) == 1
    devices = [d["name"] for s in slices for d in s["spec"].get("devices", [])]
    assert len(set(devices)) == len(devices), "device names are unique in the pool"
    sets = {cs["name"]: cs for s in slices for cs in s["spec"].get("sharedCounters", [])}
    assert len(sets) == sum(len(s["spec"].get("sharedCounters", [])) for s in slices), "counter set names are unique"
    for s in slices:
        for d in s["spec"].get("devices", []):
            for c in d.get("consumesCounters", []):
                assert c["counterSet"] in sets, "every counter set consumed from is in the pool"
                for k, v in c["counters"].items():
                    assert k in sets[c["counterSet"]]["counters"]
                    assert parse_quantity(v["value"]) <= parse_quantity(sets[c["counterSet"]]["counters"][k]["value"])


# --------------------------------------------------------------------------- a scheduler stand-in


class Allocator:
    """Allocates devices of rendered slices while their counters last (what the scheduler does for
    partitionable devices): a device fits when every counter it consumes is still there."""

    def __init__(self, slices: list[dict]):
        self.left = {
            cs["name"]: {k: parse_quantity(v["value"]) for k, v in cs["counters"].items()}
            for s in slices
            for cs in s["spec"].get("sharedCounters", [])
        }
        self.devices = {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}
        self.taken: set[str] = set()

    def fits(self, name: str) -> bool:
        d = self.devices[name]
        if name in self.taken:
            return False
        return all(
            self.left[c["counterSet"]][k] >= parse_quantity(v["value"]) for c in d.get("consumesCounters", []) for k, v in c["counters"].items()
        )

    def allocate(self, name: str) -> bool:
        if not self.fits(name):
            return False
        for c in self.devices[name].get("consumesCounters", []):
            for k, v in c["counters"].items():
                self.left[c["counterSet"]][k] -= parse_quantity(v["value"])
        self.taken.add(name)
        return True

    def fitting(self) -> set[str]:
        return {n for n in self.devices if self.fits(n)}


def mig_names(index: int = 0) -> dict[str, tuple[str, int, int]]:
    return {mig_device_name(index, p, s): (p, s, z) for p, places in H100_PLACEMENTS.items() for s, z in places}


def one_mig_card(**kw) -> tuple[Pool, list[dict]]:
    pool = plan_pool(inventory(card(0, mig=True, **kw)), FREE)
    slices = render_slices(pool, node_name=NODE, generation=1)
    check_pool(slices)
    return pool, slices


# --------------------------------------------------------------------------- which cards


@pytest.mark.parametrize(
    "gpu, held, published, why",
    [
        pytest.param(card(0), claims(), True, "", id="a Ready card"),
        pytest.param(card(0, phase="Initializing"), claims(), False, "phase Initializing", id="not Ready (AdapterReady=False)"),
        pytest.param(card(0, phase="Failed"), claims(), False, "phase Failed", id="Failed"),
        pytest.param(card(0, phase="Reconfiguring"), claims(), False, "phase Reconfiguring", id="Reconfiguring"),
        pytest.param(card(0, state="Excluded"), claims(), False, "excluded", id="Excluded"),
        pytest.param(card(0, driver="vfio-pci"), claims(), False, "vfio-pci", id="bound to vfio-pci"),
        pytest.param(card(0, binding_driver="vfio-pci", mode="Passthrough"), claims(), False, "vfio-pci", id="binding reads passthrough"),
        pytest.param(card(0), claims(vfio=(0,)), False, "vfio-pci", id="the converger put it on vfio-pci"),
        pytest.param(card(0), claims((0, "allocation", "alloc-1")), False, "held by allocation alloc-1", id="a hold"),
        pytest.param(card(0), claims((0, "instance", "vm-1")), False, "held by instance vm-1", id="a VM instance"),
        pytest.param(card(0), claims((0, "domain", "dom-1")), False, "held by domain dom-1", id="a running domain"),
        pytest.param(card(0), claims((0, "release", "k-1")), False, "held by release k-1", id="a pending release"),
        pytest.param(card(0), claims((0, "claim", "uid-1")), True, "", id="a DRA claim keeps it"),
        pytest.param(card(0), claims((0, "claim", "uid-1"), (0, "instance", "vm-1")), False, "held by instance vm-1", id="a claim and a VM"),
        pytest.param(card(0), claims((1, "allocation", "alloc-1")), True, "", id="a hold on another card"),
    ],
)
def test_which_cards_are_published(gpu, held, published, why):
    pool = plan_pool(inventory(gpu), held)
    assert pool.known
    assert bool(pool.devices) is published
    if published:
        assert pool.cards == (gpu.pci_address,) and not pool.notes
    else:
        assert len(pool.notes) == 1 and pool.notes[0].startswith(f"{gpu.pci_address} gpu-0: ") and why in pool.notes[0]


def test_claims_not_known_publish_nothing_fail_closed():
    pool = plan_pool(inventory(card(0), card(1, mig=True)), None)
    assert not pool.known and not pool.devices and not pool.counter_sets
    assert [n.split(" ")[0] for n in pool.notes] == [pci(0), pci(1)]
    assert all("claims not known" in n for n in pool.notes)
    slices = render_slices(pool, node_name=NODE, generation=3)
    check_pool(slices)
    assert [s["spec"]["devices"] for s in slices] == [[]]


def test_inventory_not_known_publishes_nothing():
    pool = plan_pool(None, FREE)
    assert not pool.known and not pool.devices and pool.notes == ("inventory not known yet: nothing published",)


def test_one_line_per_card_left_out():
    inv = inventory(card(0), card(1, phase="Initializing"), card(2, state="Excluded"), card(3, mig=True, gis=(2,)))
    pool = plan_pool(inv, claims((0, "instance", "vm")))
    assert not pool.devices
    assert [n.split(" ")[1] for n in pool.notes] == ["gpu-0:", "gpu-1:", "gpu-2:", "gpu-3:"]


def test_a_card_not_in_mig_mode_is_one_device_without_counters():
    pool = plan_pool(inventory(card(0)), FREE)
    assert pool.counter_sets == ()
    (d,) = pool.devices
    api = d.to_api()
    assert api == {
        "name": "gpu-0",
        "attributes": {
            "gpu.bcd.dev/type": {"string": "gpu"},
            "gpu.bcd.dev/uuid": {"string": "GPU-00000000-0000-4000-8000-000000000000"},
            "gpu.bcd.dev/index": {"int": 0},
            "gpu.bcd.dev/productName": {"string": "NVIDIA H100 80GB HBM3"},
            "gpu.bcd.dev/pciAddress": {"string": pci(0)},
        },
        "capacity": {"gpu.bcd.dev/memory": {"value": str(80 * GiB)}},
    }
    # profiles listed on a card not in MIG mode publish nothing more
    pool = plan_pool(inventory(card(0, profiles=H100)), FREE)
    assert names(pool) == ["gpu-0"] and pool.counter_sets == ()


def test_binding_conditions_only_when_asked():
    off = plan_pool(inventory(card(0), card(1, mig=True)), FREE)
    on = plan_pool(inventory(card(0), card(1, mig=True)), FREE, binding_conditions=True)
    for d in off.devices:
        assert not {"bindsToNode", "bindingConditions", "bindingFailureConditions"} & d.to_api().keys()
    for d in on.devices:
        api = d.to_api()
        assert api["bindsToNode"] is True
        assert api["bindingConditions"] == ["Ready"] and api["bindingFailureConditions"] == ["BindingFailed"]
    assert pool_content_key(on) != pool_content_key(off)


def test_long_product_names_are_clipped_to_64_bytes():
    pool = plan_pool(inventory(card(0, name="NVIDIA " + "é" * 60)), FREE)
    value = pool.devices[0].to_api()["attributes"]["gpu.bcd.dev/productName"]["string"]
    assert len(value.encode()) <= 64 and value.startswith("NVIDIA é")


# --------------------------------------------------------------------------- a MIG card


def test_an_h100_in_mig_mode_gets_its_whole_card_and_every_placement():
    pool, _ = one_mig_card()
    assert len(pool.devices) == 1 + 7 + 4 + 3 + 2 + 1 + 1
    assert names(pool)[0] == "gpu-0"
    assert set(names(pool)[1:]) == set(mig_names())
    for d in pool.devices[1:]:
        assert d.kind == "mig" and (d.profile, d.start, d.size) == mig_names()[d.name]
        assert d.counter_set == "gpu-0-counters"


def test_the_counter_set_is_what_the_largest_placement_covers():
    pool, _ = one_mig_card()
    (cs,) = pool.counter_sets
    assert cs.name == counter_set_name(0) == "gpu-0-counters" and cs.pci == pci(0)
    assert dict(cs.counters) == {
        "slices": 7,
        **{f"slice-{k}": 1 for k in range(8)},
        "multiprocessors": 132,
        "copy-engines": 8,
        "decoders": 7,
        "jpeg-engines": 7,
        "ofa-engines": 1,
        "memory": 80 * GiB,
    }, "no encoders on an H100: a zero count is neither offered nor consumed"
    assert cs.to_api()["counters"]["memory"] == {"value": "85899345920"}


def test_a_placement_consumes_its_profile_and_its_memory_slices():
    pool, _ = one_mig_card()
    d = pool.device("gpu-0-mig-3g-40gb-4")
    assert d is not None
    assert dict(d.consumes) == {
        "slices": 3,
        "slice-4": 1,
        "slice-5": 1,
        "slice-6": 1,
        "slice-7": 1,
        "multiprocessors": 60,
        "copy-engines": 3,
        "decoders": 3,
        "jpeg-engines": 3,
        "memory": 40 * GiB,
    }
    api = d.to_api()
    assert api["attributes"]["gpu.bcd.dev/type"] == {"string": "mig"}
    assert api["attributes"]["gpu.bcd.dev/parentUUID"] == {"string": "GPU-00000000-0000-4000-8000-000000000000"}
    assert "gpu.bcd.dev/uuid" not in api["attributes"], "a MIG uuid exists only once prepared"
    assert api["attributes"]["gpu.bcd.dev/migProfile"] == {"string": "3g.40gb"}
    assert api["attributes"]["gpu.bcd.dev/placementStart"] == {"int": 4}
    assert api["attributes"]["gpu.bcd.dev/placementSize"] == {"int": 4}
    assert api["capacity"] == {"gpu.bcd.dev/memory": {"value": str(40 * GiB)}, "gpu.bcd.dev/multiprocessors": {"value": "60"}}
    assert api["consumesCounters"][0]["counterSet"] == "gpu-0-counters"


def test_the_whole_card_consumes_every_counter():
    pool, _ = one_mig_card()
    whole = pool.device("gpu-0")
    assert whole is not None and whole.kind == "gpu"
    assert whole.consumes == pool.counter_sets[0].counters
    assert whole.to_api()["capacity"]["gpu.bcd.dev/memory"] == {"value": str(80 * GiB)}


def test_a_7g_placement_consumes_every_slice_counter():
    pool, _ = one_mig_card()
    seven = pool.device("gpu-0-mig-7g-80gb-0")
    assert seven is not None
    assert {k for k, _ in seven.consumes if k.startswith("slice-")} == {f"slice-{k}" for k in range(8)}


@pytest.mark.parametrize(
    "a, b, shared",
    [
        ("gpu-0-mig-1g-20gb-0", "gpu-0-mig-1g-10gb-1", {"slice-1"}),
        ("gpu-0-mig-2g-20gb-0", "gpu-0-mig-1g-10gb-0", {"slice-0"}),
        ("gpu-0-mig-4g-40gb-0", "gpu-0-mig-3g-40gb-0", {"slice-0", "slice-1", "slice-2", "slice-3"}),
        ("gpu-0-mig-3g-40gb-4", "gpu-0-mig-1g-20gb-6", {"slice-6", "slice-7"}),
        ("gpu-0-mig-4g-40gb-0", "gpu-0-mig-3g-40gb-4", set()),
    ],
)
def test_overlapping_placements_share_a_slice_counter(a, b, shared):
    pool, slices = one_mig_card()
    da, db = pool.device(a), pool.device(b)
    assert da is not None and db is not None
    slices_of = lambda d: {k for k, _ in d.consumes if k.startswith("slice-")}  # noqa: E731
    assert slices_of(da) & slices_of(db) == shared
    alloc = Allocator(slices)
    assert alloc.allocate(a)
    assert alloc.fits(b) is (not shared)


def test_after_a_4g_at_0_only_placements_clear_of_slices_0_to_3_fit():
    _, slices = one_mig_card()
    alloc = Allocator(slices)
    assert alloc.allocate("gpu-0-mig-4g-40gb-0")
    clear = {n for n, (_, s, z) in mig_names().items() if s >= 4}
    assert alloc.fitting() == clear
    assert clear == {
        "gpu-0-mig-1g-10gb-4",
        "gpu-0-mig-1g-10gb-5",
        "gpu-0-mig-1g-10gb-6",
        "gpu-0-mig-1g-20gb-4",
        "gpu-0-mig-1g-20gb-6",
        "gpu-0-mig-2g-20gb-4",
        "gpu-0-mig-3g-40gb-4",
    }
    assert alloc.allocate("gpu-0-mig-3g-40gb-4")
    assert alloc.fitting() == set(), "4g + 3g fill the card"


def test_after_the_whole_card_nothing_fits():
    _, slices = one_mig_card()
    alloc = Allocator(slices)
    assert alloc.allocate("gpu-0")
    assert alloc.fitting() == set()


def test_the_whole_card_does_not_fit_beside_any_placement():
    _, slices = one_mig_card()
    for name in mig_names():
        alloc = Allocator(slices)
        assert alloc.allocate(name)
        assert not alloc.fits("gpu-0"), name


def test_seven_1g_fill_the_compute_slices_though_slice_7_is_free():
    _, slices = one_mig_card()
    alloc = Allocator(slices)
    for s in range(7):
        assert alloc.allocate(f"gpu-0-mig-1g-10gb-{s}")
    assert alloc.left["gpu-0-counters"]["slice-7"] == 1
    assert alloc.fitting() == set()


def test_a_mixed_layout_fits_as_nvml_would_make_it():
    _, slices = one_mig_card()
    alloc = Allocator(slices)
    for name in ("gpu-0-mig-3g-40gb-4", "gpu-0-mig-2g-20gb-0", "gpu-0-mig-1g-10gb-2", "gpu-0-mig-1g-10gb-3"):
        assert alloc.allocate(name), name
    assert alloc.fitting() == set()


def test_whatever_the_order_allocated_placements_never_overlap():
    _, slices = one_mig_card()
    rng = random.Random(17)
    order = list(mig_names()) + ["gpu-0"]
    for _ in range(300):
        rng.shuffle(order)
        alloc = Allocator(slices)
        got = [n for n in order if alloc.allocate(n)]
        if "gpu-0" in got:
            assert got == ["gpu-0"]
            continue
        covered = [k for n in got for k in range(mig_names()[n][1], mig_names()[n][1] + mig_names()[n][2])]
        assert len(covered) == len(set(covered)), got
        assert sum(int(mig_names()[n][0][0]) for n in got) <= 7
        assert alloc.fitting() == set(), "greedy allocation stops only when nothing more fits"


def test_a_foreign_gpu_instance_hides_the_card():
    for kw in ({"gis": (3,)}, {"migs": (3,)}):
        pool = plan_pool(inventory(card(0, mig=True, **kw), card(1)), FREE)
        assert pool.cards == (pci(1),) and "gpu-0-counters" not in {c.name for c in pool.counter_sets}
        assert len(pool.notes) == 1 and "gi3" in pool.notes[0] and pool.notes[0].startswith(pci(0))


def test_a_dra_claims_gpu_instance_does_not():
    inv = inventory(card(0, mig=True, gis=(3, 5)))
    held = claims((0, "claim", "uid-1"))
    assert plan_pool(inv, held, claim_gis={pci(0): {3}}).devices == (), "gi5 is still foreign"
    pool = plan_pool(inv, held, claim_gis={pci(0): {3, 5}})
    assert len(pool.devices) == 19 and not pool.notes
    assert plan_pool(inv, held, claim_gis={pci(1): {3, 5}}).devices == (), "the GI ids are per card"


def test_profile_labels():
    assert profile_label("1g.10gb") == "1g-10gb"
    assert profile_label("1g.10gb+me") == "1g-10gb-me"
    assert profile_label("1g.12gb+me.all") == "1g-12gb-me-all"
    assert profile_label("+++") == ""
    assert mig_device_name(3, "1g.10gb+me", 6) == "gpu-3-mig-1g-10gb-me-6"


def test_two_profiles_never_give_one_name():
    plus = prof("1g.10gb+me", 20, 1, 10, range(7), 1, 16, 1, 1, 1, ofa=1)
    dash = prof("1g.10gb-me", 21, 1, 10, range(7), 1, 16, 1, 1, 1)
    pool = plan_pool(inventory(card(0, mig=True, profiles=[*H100, plus])), FREE)
    assert "gpu-0-mig-1g-10gb-me-0" in names(pool) and len(pool.devices) == 19 + 7 and not pool.notes
    pool = plan_pool(inventory(card(0, mig=True, profiles=[*H100, plus, dash])), FREE)
    assert not any("-me-" in n for n in names(pool)), "both colliding profiles are left out"
    assert len(pool.devices) == 19
    (note,) = pool.notes
    assert "1g.10gb+me" in note and "1g.10gb-me" in note and note.startswith(pci(0))
    assert resolve_device(inventory(card(0, mig=True, profiles=[*H100, plus, dash])), "gpu-0-mig-1g-10gb-me-0", pool=NODE) is None


def test_a_profile_whose_names_would_be_too_long_is_left_out():
    long = prof("1g." + "x" * 60, 30, 1, 10, (0,), 1, 16, 1, 1, 1)
    pool = plan_pool(inventory(card(0, mig=True, profiles=[*H100, long])), FREE)
    assert len(pool.devices) == 19 and "not a DNS label" in pool.notes[0]


def test_a_mig_card_without_placements_is_its_whole_card_only():
    pool = plan_pool(inventory(card(0, mig=True, profiles=[prof("1g.10gb", 19, 1, 10, (), 1, 16, 1, 1, 1)])), FREE)
    assert names(pool) == ["gpu-0"] and pool.counter_sets == () and "no profile with placements" in pool.notes[0]


def test_gpu_instances_with_no_placements_to_count_them_against_hide_the_card():
    no_places = [prof("1g.10gb", 19, 1, 10, (), 1, 16, 1, 1, 1)]
    pool = plan_pool(inventory(card(0, mig=True, profiles=no_places, gis=(1,))), FREE, claim_gis={pci(0): {1}})
    assert pool.devices == () and "no profile with placements" in pool.notes[0]


def test_without_mig_devices_a_mig_card_is_its_whole_card_only():
    pool = plan_pool(inventory(card(0, mig=True), card(1)), FREE, mig_devices=False)
    assert names(pool) == ["gpu-0", "gpu-1"] and pool.counter_sets == ()
    assert all("consumesCounters" not in d.to_api() for d in pool.devices)
    assert "MIG devices off" in pool.notes[0]
    held = plan_pool(inventory(card(0, mig=True, gis=(1,))), FREE, claim_gis={pci(0): {1}}, mig_devices=False)
    assert held.devices == () and "GPU instances" in held.notes[0]


def test_a_card_needing_more_than_32_counters_is_refused():
    # slices + 27 memory slices + 4 engine counts + memory = 33 (no OFA, no encoders)
    wide = [prof("1g.1gb", 1, 1, 1, range(27), 1, 1, 1, 1, 1), prof("27g.27gb", 2, 27, 27, (0,), 27, 27, 1, 1, 1)]
    pool = plan_pool(inventory(card(0, mig=True, profiles=wide), card(1)), FREE)
    assert pool.cards == (pci(1),) and "over 32" in pool.notes[0]


def test_duplicate_indexes_publish_neither_card():
    a, b = card(0), card(1)
    b = msgspec.structs.replace(b, index=0)
    pool = plan_pool(inventory(a, b, card(2)), FREE)
    assert names(pool) == ["gpu-2"] and len(pool.notes) == 2


# --------------------------------------------------------------------------- slices


def test_an_empty_pool_is_one_slice_with_no_devices():
    slices = render_slices(Pool(), node_name=NODE, generation=7)
    check_pool(slices)
    assert slices == [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "node-1-gpu-bcd-dev-0", "labels": {"app.kubernetes.io/managed-by": "bcd", NODE_LABEL: NODE}},
            "spec": {
                "driver": DRIVER,
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": 7, "resourceSliceCount": 1},
                "devices": [],
            },
        }
    ]


def test_the_node_owns_its_slices_when_its_uid_is_known():
    uid = "6b1f3c2e-0000-4000-8000-000000000001"
    slices = render_slices(plan_pool(inventory(card(0, mig=True)), FREE), node_name=NODE, generation=1, node_uid=uid)
    for s in slices:
        assert s["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": uid, "controller": True}]


def test_eight_mig_cards_split_within_the_limits():
    pool = plan_pool(inventory(*(card(i, mig=True) for i in range(8))), FREE)
    assert len(pool.devices) == 8 * 19 and len(pool.counter_sets) == 8
    slices = render_slices(pool, node_name=NODE, generation=4)
    check_pool(slices)
    kinds = ["sharedCounters" if "sharedCounters" in s["spec"] else "devices" for s in slices]
    assert kinds == ["sharedCounters", "devices", "devices", "devices"], "counter sets first, then devices"
    assert len(slices[0]["spec"]["sharedCounters"]) == 8
    assert [len(s["spec"]["devices"]) for s in slices[1:]] == [57, 57, 38], "a card's 19 devices stay together"
    assert all(s["spec"]["pool"]["resourceSliceCount"] == 4 and s["spec"]["pool"]["generation"] == 4 for s in slices)
    assert [s["metadata"]["name"] for s in slices] == [f"node-1-gpu-bcd-dev-{n}" for n in range(4)]
    published = [d["name"] for s in slices for d in s["spec"].get("devices", [])]
    assert published == names(pool)


def test_nine_mig_cards_need_two_counter_set_slices():
    pool = plan_pool(inventory(*(card(i, mig=True) for i in range(9))), FREE)
    slices = render_slices(pool, node_name=NODE, generation=0)
    check_pool(slices)
    assert [len(s["spec"].get("sharedCounters", [])) for s in slices[:2]] == [8, 1]
    assert all(len(s["spec"].get("devices", [])) <= MAX_DEVICES_PER_SLICE_WITH_COUNTERS for s in slices)


def test_many_plain_cards_take_128_a_slice():
    pool = plan_pool(inventory(*(card(i) for i in range(200))), FREE)
    slices = render_slices(pool, node_name=NODE, generation=1)
    check_pool(slices)
    assert [len(s["spec"]["devices"]) for s in slices] == [MAX_DEVICES_PER_SLICE, 200 - MAX_DEVICES_PER_SLICE]


def test_a_card_with_more_devices_than_a_slice_takes_is_split():
    many = [prof("1g.1gb", 1, 1, 1, range(24), 1, 1, 1, 1, 1), prof("3g.3gb", 2, 3, 3, range(0, 24, 3), 3, 3, 1, 1, 1)]
    many += [prof(f"2g.{k}gb", 3 + k, 2, 2, range(0, 24, 2), 2, 2, 1, 1, 1) for k in range(4)]
    pool = plan_pool(inventory(card(0, mig=True, profiles=many)), FREE)
    assert len(pool.devices) == 1 + 24 + 8 + 4 * 12
    slices = render_slices(pool, node_name=NODE, generation=1)
    check_pool(slices)
    assert [len(s["spec"].get("devices", [])) for s in slices] == [0, 64, 17]


def test_mixed_cards_keep_the_64_limit_for_every_device_slice():
    pool = plan_pool(inventory(card(0, mig=True), *(card(i) for i in range(1, 100))), FREE)
    slices = render_slices(pool, node_name=NODE, generation=1)
    check_pool(slices)
    assert all(len(s["spec"].get("devices", [])) <= 64 for s in slices)


def test_names_fit_a_long_node_name():
    node = ".".join(["a" * 63] * 3) + "." + "b" * 61
    assert len(node) == 253
    slices = render_slices(plan_pool(inventory(card(0), card(1, mig=True)), FREE), node_name=node, generation=1)
    check_pool(slices)
    assert slices[0]["metadata"]["labels"][NODE_LABEL] != node
    assert len({s["metadata"]["name"] for s in slices}) == len(slices)


@pytest.mark.parametrize("driver", ["", "Gpu.bcd.dev", "gpu_bcd.dev", "-gpu.bcd.dev", "x" * 64])
def test_a_bad_driver_name_is_refused(driver):
    with pytest.raises(ValueError):
        render_slices(Pool(), node_name=NODE, generation=1, driver=driver)


@pytest.mark.parametrize("node", ["", "Node-1", "node_1", "n" * 254])
def test_a_bad_node_name_is_refused(node):
    with pytest.raises(ValueError):
        render_slices(Pool(), node_name=node, generation=1)


def test_a_configured_driver_names_the_slices():
    slices = render_slices(plan_pool(inventory(card(0)), FREE), node_name=NODE, generation=2, driver="gpu.example.com")
    assert slices[0]["metadata"]["name"] == "node-1-gpu-example-com-0" and slices[0]["spec"]["driver"] == "gpu.example.com"


def test_every_name_is_a_dns_label():
    inv = inventory(*(card(i, mig=True) for i in (0, 7, 15, 123)), card(9))
    pool = plan_pool(inv, FREE)
    for d in pool.devices:
        assert is_dns_label(d.name), d.name
    for c in pool.counter_sets:
        assert is_dns_label(c.name) and all(is_dns_label(k) for k, _ in c.counters)
    check_pool(render_slices(pool, node_name=NODE, generation=1))


@pytest.mark.parametrize(
    "n, q", [(0, "0"), (7, "7"), (132, "132"), (1000, "1k"), (80_000_000_000, "80G"), (10 * GiB, "10737418240"), (10**21, "1000E")]
)
def test_quantities_are_canonical(n, q):
    assert quantity(n) == q and parse_quantity(q) == n


# --------------------------------------------------------------------------- back from a name

MIXED = inventory(card(0), card(1, mig=True), card(2, phase="Initializing"), card(3, mig=True, gis=(2,)))


def test_every_published_device_resolves_back():
    pool = plan_pool(MIXED, FREE)
    assert len(pool.devices) == 1 + 19
    for d in pool.devices:
        got = resolve(MIXED, NODE, d.name, node_name=NODE, published=pool)
        assert got == d.claim_device(NODE) == resolve_device(MIXED, d.name, pool=NODE)
        assert got is not None and got.pci == d.pci and got.kind == d.kind
        assert (got.profile, got.start) == ((d.profile, d.start) if d.kind == "mig" else ("", None))
        assert msgspec.json.decode(msgspec.json.encode(got), type=ClaimDevice) == got, "it passes the bus schema"


def test_a_device_on_a_card_that_left_the_pool_still_resolves():
    """The claim being prepared made its GPU instance on card 3 (not yet among claim_gis): the card
    left the pool, yet the device the scheduler allocated maps back to it."""
    got = resolve(MIXED, NODE, "gpu-3-mig-1g-10gb-2", node_name=NODE, published=plan_pool(MIXED, FREE))
    assert got == ClaimDevice(pool=NODE, device="gpu-3-mig-1g-10gb-2", pci=pci(3), kind="mig", profile="1g.10gb", start=2)
    assert resolve_device(MIXED, "gpu-2", pool=NODE) == ClaimDevice(pool=NODE, device="gpu-2", pci=pci(2), kind="gpu")


@pytest.mark.parametrize(
    "name",
    [
        "",
        "gpu",
        "gpu-",
        "gpu-01",
        "gpu--1",
        "gpu-9",
        "GPU-0",
        "gpu-0-",
        "gpu-0-counters",
        "gpu-1-counters",
        "gpu-0-mig-1g-10gb-0",
        "gpu-1-mig-9g-99gb-0",
        "gpu-1-mig-1g-10gb-7",
        "gpu-1-mig-1g-10gb-07",
        "gpu-1-mig-1g.10gb-0",
        "gpu-1-mig-4g-40gb-4",
        "gpu-1-mig-1g-10gb",
        "gpu-1-mig--0",
        "gpu-1x",
        "x" * 70,
        "gpu-1-mig-1g-10gb-0" + "0" * 60,
        "node-1-gpu-1",
    ],
)
def test_foreign_and_garbage_names_resolve_to_nothing(name):
    assert resolve(MIXED, NODE, name, node_name=NODE) is None
    assert resolve_device(MIXED, name, pool=NODE) is None


def test_another_pool_or_no_inventory_resolves_to_nothing():
    assert resolve(MIXED, "node-2", "gpu-0", node_name=NODE) is None
    assert resolve(None, NODE, "gpu-0", node_name=NODE) is None
    assert resolve_device(MIXED, "gpu-0", pool="") is None


def test_a_name_that_meant_another_card_when_published_resolves_to_nothing():
    before = plan_pool(inventory(card(0, uuid="GPU-aaaaaaaa-0000-4000-8000-000000000000")), FREE)
    after = inventory(card(0, uuid="GPU-bbbbbbbb-0000-4000-8000-000000000000"))
    assert resolve(after, NODE, "gpu-0", node_name=NODE, published=before) is None
    assert resolve(after, NODE, "gpu-0", node_name=NODE) is not None
    moved = inventory(msgspec.structs.replace(card(1), index=0))
    assert resolve(moved, NODE, "gpu-0", node_name=NODE, published=plan_pool(inventory(card(0)), FREE)) is None


# --------------------------------------------------------------------------- the content key


def test_the_content_key_is_stable_across_equal_inputs():
    gpus = [card(0), card(1, mig=True), card(2, mig=True, gis=(1,)), card(3)]
    key = pool_content_key(plan_pool(inventory(*gpus), FREE, claim_gis={pci(2): {1}}))
    shuffled = gpus[:]
    random.Random(1).shuffle(shuffled)
    again = inventory(*shuffled, revision=9, at=NOW + timedelta(hours=1))
    assert pool_content_key(plan_pool(again, claims(), claim_gis={pci(2): [1]})) == key
    assert isinstance(key, str) and len(key) == 64


def test_the_content_key_changes_when_a_card_leaves():
    inv = inventory(card(0), card(1, mig=True))
    key = pool_content_key(plan_pool(inv, FREE))
    assert pool_content_key(plan_pool(inv, claims((0, "instance", "vm")))) != key
    assert pool_content_key(plan_pool(inv, claims((1, "allocation", "a")))) != key
    assert pool_content_key(plan_pool(inventory(card(0), card(1, mig=True, gis=(4,))), FREE)) != key
    assert pool_content_key(plan_pool(inv, claims((0, "claim", "uid")))) == key, "a DRA claim changes nothing published"


def test_the_content_key_ignores_why_cards_are_missing():
    a = plan_pool(inventory(card(0), card(1, phase="Initializing")), FREE)
    b = plan_pool(inventory(card(0), card(1, state="Excluded")), FREE)
    assert a.notes != b.notes and pool_content_key(a) == pool_content_key(b)


def test_the_content_key_sees_a_change_inside_a_device():
    base = pool_content_key(plan_pool(inventory(card(0, mig=True)), FREE))
    fewer = [p for p in H100 if p.name != "1g.20gb"]
    assert pool_content_key(plan_pool(inventory(card(0, mig=True, profiles=fewer)), FREE)) != base
    assert pool_content_key(plan_pool(inventory(card(0, mig=True, name="NVIDIA H100 PCIe")), FREE)) != base
