"""DRA claims as holds of their own (services/converger/claims.py): the pure checks as a table,
and the ClaimKeeper's prepare / unprepare / restart on real files (a LocalHostWriter in tmp dirs)
with an in-memory MIG model standing in for the inventory's NVML steps."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import pytest

from services.converger.claims import ClaimKeeper, check_claim, hold_content, same_request, summary
from services.converger.plan import claim_holders
from services.converger.hostwriter import LocalHostWriter
from services.converger.model import ClaimDeviceRecord, ClaimMig, ClaimRecord, ConvergerState
from services.converger.observe import observe
from services.converger.plan import plan
from services.converger.model import PlanConfig
from services.converger.domains import NoDomains
from services.converger.vfio import card_claims
from shared.holdfiles import BINDING_CLAIM, consumer_spec, parse_hold
from shared.holddisk import read_disk
from shared.schemas import (
    ClaimDevice,
    ClaimSharing,
    ClaimPrepareRequest,
    DeviceAssignment,
    GpuClaim,
    GpuInstance,
    Inventory,
    MigInstance,
    MigInstanceReply,
    MigInstanceRequest,
    MigPlacement,
    MigProfile,
    NodeSpec,
)
from shared.slices import FakeSlices

from tests.converger_kit import GPU, host_inventory

UID = "0b6f4a39-1c1e-4d6b-9a53-0123456789ab"
UID2 = "1b6f4a39-1c1e-4d6b-9a53-0123456789ab"
MIG_PCI = "0000:ba:00.0"  # card 6 of the example host, emptied of its MIG instances


def _profiles() -> list[MigProfile]:
    def p(name: str, pid: int, slices: int, size: int, starts: list[int], mem_gib: int) -> MigProfile:
        return MigProfile(name=name, profile_id=pid, slices=slices, memory_bytes=mem_gib << 30, placements=[MigPlacement(start=s, size=size) for s in starts])

    return [
        p("1g.18gb", 19, 1, 1, list(range(7)), 18),
        p("2g.35gb", 14, 2, 2, [0, 2, 4], 35),
        p("3g.71gb", 9, 3, 4, [0, 4], 71),
        p("7g.141gb", 0, 7, 8, [0], 141),
    ]


def base_inventory() -> Inventory:
    inv = host_inventory()
    gpus = []
    for g in inv.gpus:
        if g.index == 6:
            g = msgspec.structs.replace(g, mig_mode=True, mig_profiles=_profiles(), mig_instances=[], gpu_instances=[], slots=[])
        gpus.append(g)
    return msgspec.structs.replace(inv, gpus=gpus)


def card(inv: Inventory, index: int):
    return next(g for g in inv.gpus if g.index == index)


def mig_dev(profile: str, start: int, name: str = "") -> ClaimDevice:
    return ClaimDevice(requests=["gpu"], pool="node-1", device=name or f"gpu-6-mig-{profile.replace('.', '-')}-{start}", pci=MIG_PCI, kind="mig", profile=profile, start=start)


def gpu_dev(inv: Inventory, index: int) -> ClaimDevice:
    g = card(inv, index)
    return ClaimDevice(requests=["gpu"], pool="node-1", device=f"gpu-{index}", pci=g.pci_address, kind="gpu")


def req(*devices: ClaimDevice, uid: str = UID, name: str = "c1") -> ClaimPrepareRequest:
    return ClaimPrepareRequest(uid=uid, namespace="ml", name=name, devices=list(devices))


def record(uid: str, *devices: ClaimDeviceRecord, name: str = "other") -> ClaimRecord:
    return ClaimRecord(uid=uid, namespace="ml", name=name, state="prepared", devices=list(devices), since=datetime(2026, 1, 1, tzinfo=timezone.utc))


INV = base_inventory()
PCI0 = card(INV, 0).pci_address
OTHER_MIG = record(UID2, ClaimDeviceRecord(pool="node-1", device="gpu-6-mig-3g-71gb-0", pci=MIG_PCI, kind="mig", mig=ClaimMig(profile="3g.71gb", start=0, step="ci-made", gi=2, ci=0, uuid="MIG-x")))
OTHER_WHOLE = record(UID2, ClaimDeviceRecord(pool="node-1", device="gpu-0", pci=PCI0, kind="gpu", atom=GPU[0]))
WITH_FOREIGN_GI = msgspec.structs.replace(
    INV,
    gpus=[
        msgspec.structs.replace(g, gpu_instances=[GpuInstance(gi=5, profile="1g.18gb", placement=MigPlacement(start=6, size=1))]) if g.index == 6 else g
        for g in INV.gpus
    ],
)
NOT_READY = msgspec.structs.replace(
    INV, gpus=[msgspec.structs.replace(g, status=msgspec.structs.replace(g.status, phase="Failed")) if g.index == 0 else g for g in INV.gpus]
)

CHECKS = [
    # (id, request, inventory, card claims, records, privileged, vfio, expected reason or None, message part)
    ("whole card: nothing to say", req(gpu_dev(INV, 0)), INV, [], {}, True, {}, None, ""),
    ("a MIG placement: nothing to say", req(mig_dev("1g.18gb", 3)), INV, [], {}, True, {}, None, ""),
    ("unprivileged", req(gpu_dev(INV, 0)), INV, [], {}, False, {}, "node-unprivileged", "unprivileged"),
    ("no such card", req(msgspec.structs.replace(gpu_dev(INV, 0), pci="0000:ff:00.0")), INV, [], {}, True, {}, "device-missing", "no GPU at 0000:ff:00.0"),
    ("card not Ready", req(gpu_dev(NOT_READY, 0)), NOT_READY, [], {}, True, {}, "device-missing", "Failed, not Ready"),
    ("MIG on a card not in MIG mode", req(msgspec.structs.replace(mig_dev("1g.18gb", 0), pci=PCI0)), INV, [], {}, True, {}, "unsupported-device", "not in MIG mode"),
    ("unknown placement", req(mig_dev("3g.71gb", 2)), INV, [], {}, True, {}, "device-missing", "no MIG profile 3g.71gb at placement 2"),
    ("held by a hold", req(gpu_dev(INV, 0)), INV, [GpuClaim(pci_address=PCI0, kind="allocation", holder="a1")], {}, True, {}, "overlap", "held by allocation a1"),
    ("held by an instance", req(gpu_dev(INV, 0)), INV, [GpuClaim(pci_address=PCI0, kind="instance", holder="vm1")], {}, True, {}, "overlap", "instance vm1"),
    ("in the VFIO record", req(gpu_dev(INV, 0)), INV, [], {}, True, {PCI0: "instance vm1"}, "overlap", "vm1 (VFIO)"),
    ("another claim has the whole card", req(gpu_dev(INV, 0)), INV, [], {UID2: OTHER_WHOLE}, True, {}, "overlap", "held by DRA claim ml/other"),
    ("a placement overlapping another claim's", req(mig_dev("1g.18gb", 2)), INV, [], {UID2: OTHER_MIG}, True, {}, "overlap", "held by DRA claim ml/other"),
    ("a placement beside another claim's", req(mig_dev("1g.18gb", 4)), INV, [], {UID2: OTHER_MIG}, True, {}, None, ""),
    ("the whole card under another claim's placement", req(msgspec.structs.replace(gpu_dev(INV, 6))), INV, [], {UID2: OTHER_MIG}, True, {}, "overlap", "DRA claim ml/other"),
    ("a GPU instance no claim owns", req(mig_dev("1g.18gb", 6)), WITH_FOREIGN_GI, [], {}, True, {}, "overlap", "GPU instance 5 (1g.18gb) at memory slices 6-6"),
    ("beside a GPU instance no claim owns", req(mig_dev("1g.18gb", 5)), WITH_FOREIGN_GI, [], {}, True, {}, None, ""),
    ("two overlapping placements in one claim", req(mig_dev("2g.35gb", 0), mig_dev("1g.18gb", 1)), INV, [], {}, True, {}, "overlap", "of this claim overlap"),
    ("whole card and a placement of it in one claim", req(gpu_dev(INV, 6), mig_dev("1g.18gb", 1)), INV, [], {}, True, {}, "overlap", "of this claim overlap"),
]


@pytest.mark.parametrize(("request_", "inv", "claims", "records", "privileged", "vfio", "reason", "part"), [c[1:] for c in CHECKS], ids=[c[0] for c in CHECKS])
def test_check_claim(request_, inv, claims, records, privileged, vfio, reason, part) -> None:
    got = check_claim(request_, inv, claims, records, privileged=privileged, vfio=vfio)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.reason == reason and part in got.message, got


def test_same_request_compares_devices_not_their_order() -> None:
    r = req(mig_dev("1g.18gb", 0), gpu_dev(INV, 0))
    rec = record(UID, ClaimDeviceRecord(pool="node-1", device="gpu-0", pci=PCI0, kind="gpu"), ClaimDeviceRecord(pool="node-1", device="gpu-6-mig-1g-18gb-0", pci=MIG_PCI, kind="mig", mig=ClaimMig(profile="1g.18gb", start=0)))
    assert same_request(rec, r)
    assert not same_request(rec, req(mig_dev("1g.18gb", 1), gpu_dev(INV, 0)))


# ---------------------------------------------------------------------------- the keeper on real files


class MigModel:
    """The inventory's NVML steps on card 6, in memory; faults are consumed when they fire."""

    def __init__(self) -> None:
        self.gis: dict[int, tuple[str, int, int]] = {}  # gi -> (profile, start, size)
        self.cis: dict[int, tuple[int, str]] = {}  # gi -> (ci, uuid)
        self.faults: set[str] = set()
        self.steps: list[str] = []

    def inventory(self) -> Inventory:
        gpus = []
        for g in INV.gpus:
            if g.pci_address == MIG_PCI:
                g = msgspec.structs.replace(
                    g,
                    gpu_instances=[GpuInstance(gi=gi, profile=p, placement=MigPlacement(start=s, size=z), compute_instances=1 if gi in self.cis else 0) for gi, (p, s, z) in sorted(self.gis.items())],
                    mig_instances=[MigInstance(atom_id=f"{g.atom_id}/gi{gi}/ci{ci}", uuid=u, gi=gi, ci=ci, profile=self.gis[gi][0]) for gi, (ci, u) in sorted(self.cis.items())],
                )
            gpus.append(g)
        return msgspec.structs.replace(INV, gpus=gpus)

    async def step(self, r: MigInstanceRequest) -> MigInstanceReply:
        self.steps.append(f"{r.step} {r.gi if r.gi is not None else (r.profile, r.start)}")
        done = lambda **kw: MigInstanceReply(pci=r.pci, step=r.step, outcome="done", **kw)  # noqa: E731
        if r.step == "create-gi":
            size = next(pl.size for p in _profiles() if p.name == r.profile for pl in p.placements if pl.start == r.start)
            gi = max(self.gis, default=0) + 1
            self.gis[gi] = (r.profile, r.start, size)
            if "lose-gi-reply" in self.faults:
                self.faults.discard("lose-gi-reply")
                raise TimeoutError("nats: timeout")
            return done(gi=gi)
        if r.step == "create-ci":
            if "ci-fail" in self.faults:
                self.faults.discard("ci-fail")
                return MigInstanceReply(pci=r.pci, step=r.step, outcome="failed", message="Insufficient Resources")
            self.cis[r.gi] = (0, f"MIG-{r.gi:08d}-aaaa-bbbb-cccc-000000000000")
            return done(gi=r.gi, ci=0, uuid=self.cis[r.gi][1])
        if r.step == "destroy-ci":
            if "in-use" in self.faults:
                self.faults.discard("in-use")
                return MigInstanceReply(pci=r.pci, step=r.step, outcome="in-use", message="a process uses it")
            if self.cis.pop(r.gi, None) is None:
                return MigInstanceReply(pci=r.pci, step=r.step, outcome="not-found")
            return done()
        if self.gis.pop(r.gi, None) is None:
            return MigInstanceReply(pci=r.pci, step=r.step, outcome="not-found")
        return done()


class Rig:
    def __init__(self, tmp: Path, state: ConvergerState | None = None, mig: MigModel | None = None) -> None:
        self.cdi, self.run = tmp / "cdi", tmp / "run"
        self.cdi.mkdir(exist_ok=True)
        self.run.mkdir(exist_ok=True)
        self.state = state or ConvergerState(boot_id="boot-1")
        self.saves: list[str] = []
        self.mig = mig or MigModel()
        self.copies = self.run / "cdi"
        self.writer = LocalHostWriter(self.cdi, self.run, FakeSlices(self.run), consumer_dir=self.copies)
        self.keeper = ClaimKeeper(
            state=lambda: self.state,
            save=self._save,
            writer=lambda: self.writer,
            mig=self.mig.step,
            inventory=self._inventory,
            card_claims=self._card_claims,
            claim_holds=self._claim_holds,
            privileged=lambda: True,
            boot_id=lambda: self.state.boot_id,
            vfio=lambda: {},
            maintenance=lambda: {},
        )

    async def _save(self) -> None:
        self.saves.append(msgspec.json.encode(self.state).decode())

    async def _inventory(self) -> Inventory:
        return self.mig.inventory()

    async def _claim_holds(self):
        return {a: h for a, h in read_disk(self.cdi, self.run).holds.items() if h.binding == BINDING_CLAIM}

    async def _card_claims(self, inv: Inventory) -> list[GpuClaim]:
        holds = read_disk(self.cdi, self.run).holds
        return card_claims(inventory=inv, holds={a: h.devices for a, h in holds.items() if h.binding != BINDING_CLAIM}, intents={}, pending={}, releases_unreadable=False, spec=None, domain_gpus={})

    def files(self) -> list[str]:
        return sorted(p.name for p in self.cdi.glob("bcd-*.json"))

    def copies_on_disk(self) -> list[str]:
        return sorted(p.name for p in self.copies.glob("bcd-*.json"))


def test_prepare_whole_card_writes_a_claim_hold_and_is_idempotent(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    r = asyncio.run(rig.keeper.prepare(req(gpu_dev(INV, 0))))
    assert r.ok and [d.cdi_ids for d in r.devices] == [[f"bcd.dev/gpu={GPU[0]}"]] and r.devices[0].atom == GPU[0]
    assert rig.files() == [f"bcd-claim-{UID}.json"]
    hold = parse_hold(f"bcd-claim-{UID}.json", (rig.cdi / f"bcd-claim-{UID}.json").read_bytes())
    assert hold.binding == BINDING_CLAIM and hold.devices == (GPU[0],)
    spec = json.loads((rig.cdi / f"bcd-claim-{UID}.json").read_text())
    assert f"NVIDIA_VISIBLE_DEVICES={GPU[0]}" in spec["containerEdits"]["env"]
    # its consumer copy, for a containerd or CRI-O whose CDI library is older than v0.6
    assert rig.copies_on_disk() == [f"bcd-claim-{UID}.json"]
    assert json.loads((rig.copies / f"bcd-claim-{UID}.json").read_text()) == consumer_spec(spec)
    # the intent was journaled before the file, prepared after it
    assert json.loads(rig.saves[0])["claims"][UID]["state"] == "preparing" and rig.state.claims[UID].state == "prepared"
    again = asyncio.run(rig.keeper.prepare(req(gpu_dev(INV, 0))))
    assert again == r
    other = asyncio.run(rig.keeper.prepare(req(gpu_dev(INV, 0), uid=UID2, name="c2")))
    assert not other.ok and other.reason == "overlap" and "DRA claim ml/c1" in other.message
    u = asyncio.run(rig.keeper.unprepare(UID))
    assert u.ok and rig.files() == [] and UID not in rig.state.claims
    assert rig.copies_on_disk() == []
    assert asyncio.run(rig.keeper.unprepare(UID)).ok  # again: nothing left, still fine


def test_two_mig_claims_on_one_card_make_and_destroy_their_instances(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    a = asyncio.run(rig.keeper.prepare(req(mig_dev("3g.71gb", 0))))
    b = asyncio.run(rig.keeper.prepare(req(mig_dev("3g.71gb", 4), uid=UID2, name="c2")))
    assert a.ok and b.ok, (a, b)
    uuid6 = card(INV, 6).atom_id
    assert [d.atom for d in a.devices] == [f"{uuid6}/gi1/ci0"] and [d.atom for d in b.devices] == [f"{uuid6}/gi2/ci0"]
    assert rig.mig.steps == ["create-gi ('3g.71gb', 0)", "create-ci 1", "create-gi ('3g.71gb', 4)", "create-ci 2"]
    spec = json.loads((rig.cdi / f"bcd-claim-{UID}.json").read_text())
    assert "NVIDIA_VISIBLE_DEVICES=MIG-00000001-aaaa-bbbb-cccc-000000000000" in spec["containerEdits"]["env"]
    # each step journaled before it was asked: gi-asked, gi-made, ci-asked, ci-made, prepared
    steps = [json.loads(s)["claims"][UID]["devices"][0].get("mig") for s in rig.saves[:6] if UID in json.loads(s)["claims"]]
    assert [m["step"] if m else None for m in steps] == [None, "gi-asked", "gi-made", "ci-asked", "ci-made", "ci-made"]
    # a third overlapping both is refused naming a holder
    c = asyncio.run(rig.keeper.prepare(req(mig_dev("7g.141gb", 0), uid="2b6f4a39-1c1e-4d6b-9a53-0123456789ab", name="c3")))
    assert not c.ok and c.reason == "overlap" and "DRA claim ml/c" in c.message
    assert asyncio.run(rig.keeper.unprepare(UID)).ok
    assert rig.mig.steps[-2:] == ["destroy-ci 1", "destroy-gi 1"] and sorted(rig.mig.gis) == [2]
    assert rig.files() == [f"bcd-claim-{UID2}.json"]


def test_a_compute_instance_that_fails_leaves_no_gpu_instance(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.mig.faults.add("ci-fail")
    r = asyncio.run(rig.keeper.prepare(req(mig_dev("1g.18gb", 0))))
    assert not r.ok and r.reason == "mig-failed" and "Insufficient Resources" in r.message
    assert rig.mig.gis == {} and rig.files() == [] and rig.state.claims == {}
    assert asyncio.run(rig.keeper.prepare(req(mig_dev("1g.18gb", 0)))).ok  # the kubelet's retry


def test_destroy_in_use_keeps_the_claim_unpreparing_until_a_retry_succeeds(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    assert asyncio.run(rig.keeper.prepare(req(mig_dev("1g.18gb", 0)))).ok
    rig.mig.faults.add("in-use")
    u = asyncio.run(rig.keeper.unprepare(UID))
    assert not u.ok and "in-use" in u.message
    assert rig.state.claims[UID].state == "unpreparing" and rig.files() == []  # no new container gets it meanwhile
    assert not asyncio.run(rig.keeper.prepare(req(mig_dev("1g.18gb", 0)))).ok  # busy until unprepared
    assert asyncio.run(rig.keeper.unprepare(UID)).ok and rig.mig.gis == {} and rig.state.claims == {}


def test_a_crash_between_gpu_and_compute_instance_is_undone_at_start(tmp_path: Path) -> None:
    """The GPU instance was made but its answer lost (or the converger died before journaling it):
    the journal says gi-asked; the restart finds the instance by its placement and destroys it."""
    rig = Rig(tmp_path)
    rig.mig.faults.add("lose-gi-reply")
    r = asyncio.run(rig.keeper.prepare(req(mig_dev("2g.35gb", 2))))
    # undone at once: the lost answer's instance was found by placement
    assert not r.ok and rig.mig.gis == {} and rig.state.claims == {}
    # now the same as a kill -9 right after create-gi: a journal that stops at gi-asked
    mig = rig.mig
    mig.gis[7] = ("2g.35gb", 2, 2)
    crashed = ConvergerState(
        boot_id="boot-1",
        claims={UID: ClaimRecord(uid=UID, namespace="ml", name="c1", state="preparing", since=datetime.now(timezone.utc), devices=[
            ClaimDeviceRecord(pool="node-1", device="gpu-6-mig-2g-35gb-2", pci=MIG_PCI, kind="mig", mig=ClaimMig(profile="2g.35gb", start=2, step="gi-asked"))
        ])},
    )
    again = Rig(tmp_path, crashed, mig)
    asyncio.run(again.keeper.reconcile(mig.inventory()))
    assert mig.gis == {} and again.state.claims == {} and mig.steps[-1] == "destroy-gi 7"


def test_a_restart_keeps_prepared_claims_and_their_instances(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    assert asyncio.run(rig.keeper.prepare(req(mig_dev("1g.18gb", 0)))).ok
    state = msgspec.json.decode(msgspec.json.encode(rig.state), type=ConvergerState)
    state.boot_id = "boot-1"
    again = Rig(tmp_path, state, rig.mig)
    asyncio.run(again.keeper.reconcile(rig.mig.inventory()))
    assert again.state.claims[UID].state == "prepared" and list(rig.mig.gis) == [1] and again.files() == [f"bcd-claim-{UID}.json"]
    # a new boot whose MIG instances are gone: dropped (the kubelet prepares it again)
    state.boot_id = "boot-2"
    rig.mig.gis.clear(), rig.mig.cis.clear()
    asyncio.run(again.keeper.reconcile(rig.mig.inventory()))
    assert again.state.claims == {} and again.files() == []


def test_hold_content_of_a_claim() -> None:
    rec = record(UID, ClaimDeviceRecord(pool="node-1", device="gpu-0", pci=PCI0, kind="gpu", atom=GPU[0]))
    c = hold_content(rec, INV)
    assert c.allocation_id == f"claim-{UID}" and c.binding == BINDING_CLAIM and [d.atom_id for d in c.devices] == [GPU[0]]


def test_a_pass_never_releases_a_claim_hold_and_refuses_holds_on_its_atoms(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    assert asyncio.run(rig.keeper.prepare(req(gpu_dev(INV, 0)))).ok
    spec = NodeSpec(
        node_id="node-1",
        generation=3,
        devices=[
            DeviceAssignment(allocation_id="a1", reservation_id="r1", binding="BINDING_HOLD", devices=[GPU[0]]),
            DeviceAssignment(allocation_id=f"claim-{UID}", reservation_id="r2", binding="BINDING_HOLD", devices=[GPU[1]]),
        ],
    )
    obs = observe(spec=spec, cdi_dir=rig.cdi, run_dir=rig.run, slices=FakeSlices(rig.run), inventory=INV, domains=NoDomains(), state=rig.state)
    assert list(obs.holds) == [] and list(obs.claim_holds) == [f"claim-{UID}"]
    p = plan(spec, obs, PlanConfig(node_id="node-1"))
    assert not [s for s in p.steps if "Release" in type(s).__name__ or "Withdraw" in type(s).__name__]
    reasons = {f.allocation_id: (f.reason, f.message) for f in p.failures}
    assert reasons["a1"][0] == "overlap" and "DRA claim ml/c1" in reasons["a1"][1]
    assert reasons[f"claim-{UID}"][0] == "overlap" and "DRA claim ml/c1" in reasons[f"claim-{UID}"][1]
    # nothing to do once it is refused: the same plan again has the same failures and no bind
    assert not [s for s in plan(spec, obs, PlanConfig(node_id="node-1")).steps if type(s).__name__ == "BindHold"]
    # the card claims name it, kind claim: the inventory, the switcher and resets see it
    claims = card_claims(inventory=INV, holds={}, intents={}, pending={}, releases_unreadable=False, spec=None, domain_gpus={}, dra_claims={"DRA claim ml/c1": [GPU[0]]})
    assert claims == [GpuClaim(pci_address=PCI0, kind="claim", holder="DRA claim ml/c1")]


def test_a_vm_that_wants_a_claimed_card_waits_for_the_claim(tmp_path: Path) -> None:
    from shared.schemas import InstanceGpus

    rig = Rig(tmp_path)
    assert asyncio.run(rig.keeper.prepare(req(gpu_dev(INV, 0)))).ok
    spec = NodeSpec(node_id="node-1", generation=4, instances=[InstanceGpus(instance_id="vm1", gpus=[PCI0])])
    obs = observe(spec=spec, cdi_dir=rig.cdi, run_dir=rig.run, slices=FakeSlices(rig.run), inventory=INV, domains=NoDomains(), state=rig.state)
    p = plan(spec, obs, PlanConfig(node_id="node-1"))
    assert PCI0 in p.vfio_waiting and not [s for s in p.steps if "Switch" in type(s).__name__]
    assert any("DRA claim ml/c1" in n for n in p.vfio_notes), p.vfio_notes


# ---------------------------------------------------------------------------- admin access (KEP-5018)

UID3 = "2b6f4a39-1c1e-4d6b-9a53-0123456789ab"


def admin(d: ClaimDevice, **kw) -> ClaimDevice:
    return msgspec.structs.replace(d, admin_access=True, **kw)


ADMIN_WHOLE = record(UID2, ClaimDeviceRecord(pool="node-1", device="gpu-0", pci=PCI0, kind="gpu", atom=GPU[0], admin_access=True), name="monitor")
VFIO_CLAIM = record(UID2, ClaimDeviceRecord(pool="node-1", device="gpu-0", pci=PCI0, kind="gpu", atom=GPU[0], sharing=ClaimSharing(strategy="Vfio")), name="vm")

ADMIN_CHECKS = [
    ("admin access to a card another claim holds", req(admin(gpu_dev(INV, 0))), INV, [], {UID2: OTHER_WHOLE}, {}, None, ""),
    ("admin access to a card a hold has", req(admin(gpu_dev(INV, 0))), INV, [GpuClaim(pci_address=PCI0, kind="allocation", holder="a1")], {}, {}, None, ""),
    ("a claim beside an admin-access claim", req(gpu_dev(INV, 0)), INV, [], {UID2: ADMIN_WHOLE}, {}, None, ""),
    ("a share beside an admin-access claim", req(msgspec.structs.replace(gpu_dev(INV, 0), share_id="0b6f4a39-1c1e-4d6b-9a53-0123456789ab", share_percent=100)), INV, [], {UID2: ADMIN_WHOLE}, {}, None, ""),
    ("admin access to a card in a VM", req(admin(gpu_dev(INV, 0))), INV, [GpuClaim(pci_address=PCI0, kind="instance", holder="vm1")], {}, {}, "overlap", "passed through to instance vm1 (VFIO)"),
    ("admin access to a card in the VFIO record", req(admin(gpu_dev(INV, 0))), INV, [], {}, {PCI0: "instance vm1"}, "overlap", "passed through to instance vm1"),
    ("admin access to a card a VFIO claim has", req(admin(gpu_dev(INV, 0))), INV, [], {UID2: VFIO_CLAIM}, {}, "overlap", "passed through to DRA claim ml/vm"),
    ("admin access asking passthrough", req(admin(gpu_dev(INV, 0), sharing=ClaimSharing(strategy="Vfio"))), INV, [], {}, {}, "invalid-config", "adminAccess"),
    ("admin access asking an MPS daemon", req(admin(gpu_dev(INV, 0), sharing=ClaimSharing(strategy="MPS"))), INV, [], {}, {}, "invalid-config", "an MPS daemon"),
    ("admin access asking a time slice", req(admin(gpu_dev(INV, 0), sharing=ClaimSharing(strategy="TimeSlicing", interval="Long"))), INV, [], {}, {}, "invalid-config", "time slice Long"),
    ("admin access to a placement with no instance", req(admin(mig_dev("1g.18gb", 3))), INV, [], {}, {}, "device-missing", "admin access makes none"),
]


@pytest.mark.parametrize(("request_", "inv", "claims", "records", "vfio", "reason", "part"), [c[1:] for c in ADMIN_CHECKS], ids=[c[0] for c in ADMIN_CHECKS])
def test_check_claim_admin_access(request_, inv, claims, records, vfio, reason, part) -> None:
    got = check_claim(request_, inv, claims, records, privileged=True, vfio=vfio)
    if reason is None:
        assert got is None, got
    else:
        assert got is not None and got.reason == reason and part in got.message, got


def test_admin_access_to_a_held_mig_instance_is_read_only_and_holds_nothing(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    owner = asyncio.run(rig.keeper.prepare(req(mig_dev("3g.71gb", 0))))
    assert owner.ok
    steps = list(rig.mig.steps)
    # a monitoring claim on the same placement and on card 0 (nobody's): prepared, nothing made
    mon = asyncio.run(rig.keeper.prepare(req(admin(mig_dev("3g.71gb", 0)), admin(gpu_dev(INV, 0)), uid=UID2, name="monitor")))
    assert mon.ok, mon
    assert rig.mig.steps == steps  # no MIG step
    assert [d.atom for d in mon.devices] == [owner.devices[0].atom, GPU[0]]
    spec = json.loads((rig.cdi / f"bcd-claim-{UID2}.json").read_text())
    assert any(e.startswith("NVIDIA_VISIBLE_DEVICES=MIG-00000001-aaaa-bbbb-cccc-000000000000,") for e in spec["containerEdits"]["env"]), spec["containerEdits"]["env"]
    assert rig.state.claims[UID2].devices[0].mig is None and "admin access (read-only) to gpu-6-mig-3g-71gb-0" in summary(rig.state.claims[UID2]).sharing
    assert asyncio.run(rig.keeper.prepare(req(admin(mig_dev("3g.71gb", 0)), admin(gpu_dev(INV, 0)), uid=UID2, name="monitor"))) == mon  # the kubelet asks again
    # no holder: an ordinary claim still gets card 0, and the card claims do not name the monitor
    assert asyncio.run(rig.keeper.prepare(req(gpu_dev(INV, 0), uid=UID3, name="c3"))).ok
    holds = asyncio.run(rig._claim_holds())
    holders = {h for h, _ in claim_holders(holds, rig.state.claims).values()}
    assert holders == {"DRA claim ml/c1", "DRA claim ml/c3"}
    # unprepared: its file goes, the owner's instance stays
    assert asyncio.run(rig.keeper.unprepare(UID2)).ok
    assert rig.mig.steps == steps and sorted(rig.mig.gis) == [1] and f"bcd-claim-{UID2}.json" not in rig.files()
