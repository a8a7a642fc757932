"""DRA claims that share a card or pass it through (issue 29): the converger's side.

The pure checks as a table (shares add up per card whatever the scheduler allowed, one time
slice per card, VFIO only for a whole card on bare metal with nothing running on it), the MPS
daemon a claim gets (its limits from the config, else from its share), and the ClaimKeeper on
real files with the inventory's sharing steps and vfio_switcher standing in: each step
journaled before it is asked, undone in reverse at unprepare, at a failure and after a crash at
each of the new crash points, and MPS daemons no claim owns stopped at start.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import pytest

from services.converger.claims import ClaimKeeper, check_claim, claim_timeslices, mps_daemon
from services.converger.crash import CLAIM_POINTS
from services.converger.model import ClaimDeviceRecord, ClaimRecord, ConvergerState
from shared.schemas import (
    ClaimDevice,
    ClaimPrepareRequest,
    ClaimSharing,
    Inventory,
    RunningProcess,
    SharingStepReply,
    SharingStepRequest,
    SwitchReply,
    SwitchRequest,
)

from tests.converger_kit import GPU
from tests.unit.converger.test_claims import INV as MIG_INV
from tests.unit.converger.test_claims import MigModel, Rig, card

UID = "0b6f4a39-1c1e-4d6b-9a53-0123456789ab"
UID2 = "1b6f4a39-1c1e-4d6b-9a53-0123456789ab"
UID3 = "2b6f4a39-1c1e-4d6b-9a53-0123456789ab"
SHARE1 = "3f2b6c1e-8a0d-4c57-9b1e-2d6f0a9c7e11"
SHARE2 = "4f2b6c1e-8a0d-4c57-9b1e-2d6f0a9c7e11"
SHARE3 = "5f2b6c1e-8a0d-4c57-9b1e-2d6f0a9c7e11"
MPS_ROOT = "/run/bcd/mps"

INV = msgspec.structs.replace(
    MIG_INV, mps_root=MPS_ROOT, gpus=[msgspec.structs.replace(g, iommu_group=40 + g.index) for g in MIG_INV.gpus]
)
PCI0 = card(INV, 0).pci_address
PCI1 = card(INV, 1).pci_address
PCI2 = card(INV, 2).pci_address  # no process runs on card 2 of the example host
MEM0 = card(INV, 0).memory_bytes
MPS = ClaimSharing(strategy="MPS")
TS_LONG = ClaimSharing(strategy="TimeSlicing", interval="Long")
VFIO = ClaimSharing(strategy="Vfio")


def dev(index: int = 0, *, sharing: ClaimSharing = ClaimSharing(), share: str = "", percent: int | None = None, memory: int | None = None) -> ClaimDevice:
    g = card(INV, index)
    return ClaimDevice(
        requests=["gpu"], pool="node-1", device=f"gpu-{index}", pci=g.pci_address, kind="gpu",
        sharing=sharing, share_id=share, share_percent=percent, memory_bytes=memory,
    )  # fmt: skip


def mig(profile: str = "1g.18gb", start: int = 0, *, sharing: ClaimSharing = ClaimSharing()) -> ClaimDevice:
    return ClaimDevice(requests=["gpu"], pool="node-1", device=f"gpu-6-mig-{profile.replace('.', '-')}-{start}", pci=card(INV, 6).pci_address, kind="mig", profile=profile, start=start, sharing=sharing)


def req(*devices: ClaimDevice, uid: str = UID, name: str = "c1") -> ClaimPrepareRequest:
    return ClaimPrepareRequest(uid=uid, namespace="ml", name=name, devices=list(devices))


def held(uid: str, *devices: ClaimDevice, name: str = "other") -> ClaimRecord:
    return ClaimRecord(
        uid=uid, namespace="ml", name=name, state="prepared", since=datetime(2026, 1, 1, tzinfo=timezone.utc),
        devices=[
            ClaimDeviceRecord(pool=d.pool, device=d.device, pci=d.pci, kind=d.kind, atom=GPU[0], sharing=d.sharing, share_id=d.share_id, share_percent=d.share_percent, memory_bytes=d.memory_bytes)
            for d in devices
        ],
    )  # fmt: skip


VIRTUAL = msgspec.structs.replace(INV, host=msgspec.structs.replace(INV.host, virtualized=True))
NO_GROUP = msgspec.structs.replace(INV, gpus=[msgspec.structs.replace(g, iommu_group=None) for g in INV.gpus])
BUSY = msgspec.structs.replace(INV, processes=[RunningProcess(pid=4242, gpu_uuid=card(INV, 2).uuid)])
HALF = held(UID2, dev(share=SHARE2, percent=50, memory=MEM0 // 2))
SIXTY_LONG = held(UID2, dev(share=SHARE2, percent=60, sharing=TS_LONG))
EXCLUSIVE = held(UID2, dev())

CHECKS = [
    # (id, request, inventory, records, expected reason or None, message part)
    ("a share beside another share: nothing to say", req(dev(share=SHARE1, percent=50)), INV, {UID2: HALF}, None, ""),
    ("a share beside nothing: nothing to say", req(dev(share=SHARE1, percent=100)), INV, {}, None, ""),
    ("shares past 100 percent", req(dev(share=SHARE1, percent=60)), INV, {UID2: HALF}, "resources-exhausted", "110%"),
    ("a share without a percent takes the card", req(dev(share=SHARE1)), INV, {UID2: HALF}, "resources-exhausted", "150%"),
    ("shares past the card's memory", req(dev(share=SHARE1, percent=10, memory=MEM0 // 2 + 1)), INV, {UID2: HALF}, "resources-exhausted", f"the card has {MEM0}"),
    ("a share beside an exclusive claim", req(dev(share=SHARE1, percent=10)), INV, {UID2: EXCLUSIVE}, "overlap", "held by DRA claim ml/other"),
    ("an exclusive claim beside a share", req(dev()), INV, {UID2: HALF}, "overlap", "(a share of it)"),
    ("another time slice on a time-sliced card", req(dev(share=SHARE1, percent=10, sharing=ClaimSharing(strategy="TimeSlicing", interval="Short"))), INV, {UID2: SIXTY_LONG}, "overlap", "time-sliced at Long"),
    ("the same time slice: nothing to say", req(dev(share=SHARE1, percent=10, sharing=TS_LONG)), INV, {UID2: SIXTY_LONG}, None, ""),
    ("MPS beside a time-sliced share: nothing to say", req(dev(share=SHARE1, percent=10, sharing=MPS)), INV, {UID2: SIXTY_LONG}, None, ""),
    ("a card passed through: nothing to say", req(dev(2, sharing=VFIO)), INV, {}, None, ""),
    ("passthrough on a virtualized node", req(dev(2, sharing=VFIO)), VIRTUAL, {}, "unsupported-device", "VFIORequiresBareMetal"),
    ("passthrough without an IOMMU group", req(dev(2, sharing=VFIO)), NO_GROUP, {}, "unsupported-device", "IOMMU group is not known"),
    ("passthrough with a process on the card", req(dev(2, sharing=VFIO)), BUSY, {}, "in-use", "pid 4242"),
    ("passthrough of a share", req(dev(sharing=VFIO, share=SHARE1, percent=50)), INV, {}, "invalid-config", "VFIO needs the card to itself"),
    ("passthrough of a MIG device", req(mig(sharing=VFIO)), INV, {}, "invalid-config", "for whole cards"),
    ("some devices passed through", req(dev(2, sharing=VFIO), dev(1)), INV, {}, "invalid-config", "all its cards through or none"),
    ("two MPS configs in one claim", req(dev(0, sharing=MPS), dev(1, sharing=ClaimSharing(strategy="MPS", active_thread_percentage=20))), INV, {}, "invalid-config", "one MPS daemon serves a claim"),
    ("a share of a MIG device", req(msgspec.structs.replace(mig(), share_id=SHARE1)), INV, {}, "invalid-config", "only whole cards are shared"),
    ("a time slice on a MIG device", req(mig(sharing=TS_LONG)), INV, {}, "invalid-config", "no time slice of its own"),
]


@pytest.mark.parametrize(("request_", "inv", "records", "reason", "part"), [c[1:] for c in CHECKS], ids=[c[0] for c in CHECKS])
def test_check_shares_and_passthrough(request_, inv, records, reason, part) -> None:
    got = check_claim(request_, inv, [], records, privileged=True)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.reason == reason and part in got.message, got


def record_of(r: ClaimPrepareRequest) -> ClaimRecord:
    rec = held(r.uid, *r.devices, name=r.name)
    for d, want in zip(rec.devices, r.devices):
        d.atom = card(INV, int(want.device.split("-")[1])).atom_id
    return rec


UUID0, UUID1 = card(INV, 0).uuid, card(INV, 1).uuid
MPS_ROWS = [
    # (id, sharing of both devices, shares (percent, memory) per device or None, active threads, pinned per uuid)
    ("no limits", MPS, None, None, {}),
    ("the config's limits", ClaimSharing(strategy="MPS", active_thread_percentage=30, pinned_memory_bytes=2 << 30), None, 30, {UUID0: 2 << 30, UUID1: 2 << 30}),
    ("per device by uuid and by index", ClaimSharing(strategy="MPS", pinned_memory_bytes=1 << 30, pinned_memory={UUID1: 3 << 30, "0": 4 << 30}), None, None, {UUID0: 4 << 30, UUID1: 3 << 30}),
    ("the share's own limits", MPS, [(40, 8 << 30), (25, 1 << 30)], 25, {UUID0: 8 << 30, UUID1: 1 << 30}),
    ("the config over the share", ClaimSharing(strategy="MPS", active_thread_percentage=90, pinned_memory_bytes=5 << 30), [(40, 8 << 30), (25, 1 << 30)], 90, {UUID0: 5 << 30, UUID1: 5 << 30}),
]


@pytest.mark.parametrize(("sharing", "shares", "active", "pinned"), [r[1:] for r in MPS_ROWS], ids=[r[0] for r in MPS_ROWS])
def test_the_mps_daemon_of_a_claim(sharing, shares, active, pinned) -> None:
    devices = [dev(0, sharing=sharing), dev(1, sharing=sharing)]
    if shares:
        devices = [msgspec.structs.replace(d, share_id=s, share_percent=p, memory_bytes=m) for d, s, (p, m) in zip(devices, (SHARE1, SHARE2), shares)]
    spec = mps_daemon(record_of(req(*devices)), INV)
    assert spec is not None and spec.uuids == [UUID0, UUID1]
    assert spec.active_thread_percentage == active and spec.pinned_memory == pinned
    assert spec.control.startswith(UID + "-") and len(spec.control) == len(UID) + 7
    # the same claim asks the same daemon again (a retry after a crash finds it running)
    assert mps_daemon(record_of(req(*devices)), INV) == spec


def test_a_per_device_limit_that_names_no_device_is_refused() -> None:
    bad = ClaimSharing(strategy="MPS", pinned_memory={"GPU-00000000-0000-4000-8000-00000000dead": 1 << 30, "7": 1 << 30})
    with pytest.raises(ValueError, match=r"names 7, GPU-00000000-0000-4000-8000-00000000dead: not a device uuid .* index 0..0"):
        mps_daemon(record_of(req(dev(0, sharing=bad))), INV)


def test_no_mps_and_no_time_slice_for_an_exclusive_claim() -> None:
    rec = record_of(req(dev(0), dev(1, sharing=ClaimSharing(strategy="TimeSlicing"))))
    assert mps_daemon(rec, INV) is None and claim_timeslices(rec, INV) == []
    rec = record_of(req(dev(1, sharing=TS_LONG)))
    assert [(t.pci, t.uuid, t.interval) for t in claim_timeslices(rec, INV)] == [(PCI1, UUID1, "Long")]


# ---------------------------------------------------------------------------- the keeper


class Host:
    """The inventory's sharing steps and vfio_switcher, in memory; faults are consumed when they fire."""

    def __init__(self) -> None:
        self.daemons: dict[str, SharingStepRequest] = {}
        self.timeslice: dict[str, str] = {}
        self.driver: dict[str, str] = {}
        self.faults: set[str] = set()
        self.steps: list[str] = []

    def _fault(self, name: str) -> bool:
        if name in self.faults:
            self.faults.discard(name)
            return True
        return False

    async def sharing(self, r: SharingStepRequest) -> SharingStepReply:
        self.steps.append(f"{r.step} {r.mps.control if r.mps else r.control or r.pci or ''} {r.interval if r.step == 'timeslice-set' else ''}".strip())
        answer = lambda outcome, message="", **kw: SharingStepReply(step=r.step, outcome=outcome, message=message, **kw)  # noqa: E731
        if r.step == "mps-start":
            assert r.mps is not None
            self.daemons[r.mps.control] = r
            if self._fault("lose-mps-reply"):
                raise TimeoutError("nats: timeout")
            if self._fault("mps-start-fail"):
                return answer("failed", "nvidia-cuda-mps-control -d failed")
            return answer("done")
        if r.step == "mps-stop":
            if self._fault("mps-stop-fail"):
                return answer("failed", "quit failed")
            return answer("done") if self.daemons.pop(r.control, None) is not None else answer("not-found")
        if r.step == "mps-list":
            return answer("done", controls=sorted(self.daemons))
        assert r.pci is not None
        if self._fault("timeslice-fail"):
            return answer("failed", "nvidia-smi compute-policy failed")
        self.timeslice[r.pci] = r.interval
        return answer("done")

    async def switch(self, r: SwitchRequest) -> SwitchReply:
        self.steps.append(f"switch {r.pci} {r.target}")
        at = datetime.now(timezone.utc)
        if self._fault("switch-held"):
            return SwitchReply(pci=r.pci, target=r.target, outcome="Refused", reason="Held", holder="pid 99", message="the card is in use", at=at)
        if self._fault("switch-disruption"):
            self.driver[r.pci] = ""
            return SwitchReply(pci=r.pci, target=r.target, outcome="DisruptionRequired", reason="RollbackFailed", message="no driver: reboot", at=at)
        was = self.driver.get(r.pci, "nvidia")
        want = "vfio-pci" if r.target == "vfio-pci" else "nvidia"
        self.driver[r.pci] = want
        return SwitchReply(pci=r.pci, target=r.target, outcome="Unchanged" if was == want else "Succeeded", reason="", at=at)


class CrashAt(Exception):
    pass


class SharedRig(Rig):
    def __init__(self, tmp: Path, state: ConvergerState | None = None, host: Host | None = None, crash_at: str = "") -> None:
        super().__init__(tmp, state, MigModel())
        self.host = host or Host()

        def crash(point: str) -> None:
            if point == crash_at:
                raise CrashAt(point)

        keeper = self.keeper
        self.keeper = ClaimKeeper(
            state=lambda: self.state, save=self._save, writer=lambda: self.writer, mig=self.mig.step,
            inventory=self._inventory, card_claims=self._card_claims, claim_holds=self._claim_holds,
            privileged=lambda: True, boot_id=lambda: self.state.boot_id, vfio=lambda: {}, maintenance=lambda: {},
            crash=crash, sharing=self.host.sharing, switch=self.host.switch,
        )  # fmt: skip
        del keeper

    async def _inventory(self) -> Inventory:
        inv = self.mig.inventory()
        gpus = [msgspec.structs.replace(g, iommu_group=40 + g.index, driver=self.host.driver.get(g.pci_address, g.driver) or g.driver) for g in inv.gpus]
        return msgspec.structs.replace(inv, gpus=gpus, mps_root=MPS_ROOT)

    def spec(self, uid: str = UID) -> dict:
        return json.loads((self.cdi / f"bcd-claim-{uid}.json").read_text())

    def journal(self, uid: str = UID) -> list[dict]:
        return [json.loads(s)["claims"].get(uid) for s in self.saves]


def run(coro):
    return asyncio.run(coro)


def test_two_mps_claims_share_a_card_with_limits_and_a_third_over_capacity_is_refused(tmp_path: Path) -> None:
    rig = SharedRig(tmp_path)
    a = run(rig.keeper.prepare(req(dev(share=SHARE1, percent=50, memory=40 << 30, sharing=MPS))))
    b = run(rig.keeper.prepare(req(dev(share=SHARE2, percent=30, memory=20 << 30, sharing=ClaimSharing(strategy="MPS", active_thread_percentage=25)), uid=UID2, name="c2")))
    assert a.ok and b.ok, (a, b)
    # each share its own CDI device name (one device name in two specs is a conflict for every runtime)
    assert a.devices[0].cdi_ids == [f"bcd.dev/gpu={GPU[0]}_{SHARE1}"] and b.devices[0].cdi_ids == [f"bcd.dev/gpu={GPU[0]}_{SHARE2}"]
    da, db = (rig.host.daemons[rig.state.claims[u].mps.control].mps for u in (UID, UID2))  # type: ignore[union-attr]
    # the share is held to what it was given: its percent as the active threads, its memory as the pinned limit
    assert (da.active_thread_percentage, da.pinned_memory) == (50, {UUID0: 40 << 30})
    assert (db.active_thread_percentage, db.pinned_memory) == (25, {UUID0: 20 << 30})
    spec = rig.spec()
    pipe = f"{MPS_ROOT}/{da.control}/pipe"
    assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in spec["containerEdits"]["env"]
    log = f"{MPS_ROOT}/{da.control}/log"
    assert [m["containerPath"] for m in spec["containerEdits"]["mounts"]] == [pipe, log, "/dev/shm"]
    # the daemon's own shm at /dev/shm, never the host's
    assert [m["hostPath"] for m in spec["containerEdits"]["mounts"]] == [pipe, log, f"{MPS_ROOT}/{da.control}/shm"]
    assert [d["name"] for d in spec["devices"]] == [f"{GPU[0]}_{SHARE1}"]
    # the journal had the daemon before it was asked
    starts = [j for j in rig.journal() if j and j.get("mps")]
    assert starts[0]["mps"]["step"] == "start-asked" and starts[-1]["mps"]["step"] == "started"
    c = run(rig.keeper.prepare(req(dev(share=SHARE3, percent=30, sharing=MPS), uid=UID3, name="c3")))
    assert not c.ok and c.reason == "resources-exhausted" and "110%" in c.message and "DRA claim ml/c1" in c.message
    assert len(rig.host.daemons) == 2 and UID3 not in rig.state.claims
    # unprepare: the CDI spec first (no new container gets it), then the daemon
    assert run(rig.keeper.unprepare(UID)).ok
    assert rig.host.steps[-1] == f"mps-stop {da.control}" and not (rig.cdi / f"bcd-claim-{UID}.json").exists()
    assert list(rig.host.daemons) == [db.control]
    # the freed share fits now
    assert run(rig.keeper.prepare(req(dev(share=SHARE3, percent=30, sharing=MPS), uid=UID3, name="c3"))).ok


def test_a_time_slice_is_set_and_goes_back_to_default_with_the_last_claim_on_the_card(tmp_path: Path) -> None:
    rig = SharedRig(tmp_path)
    assert run(rig.keeper.prepare(req(dev(1, share=SHARE1, percent=50, sharing=TS_LONG)))).ok
    assert rig.host.timeslice == {PCI1: "Long"}
    assert run(rig.keeper.prepare(req(dev(1, share=SHARE2, percent=50, sharing=TS_LONG), uid=UID2, name="c2"))).ok
    assert run(rig.keeper.unprepare(UID)).ok
    assert rig.host.timeslice == {PCI1: "Long"}  # the other claim still has it
    assert run(rig.keeper.unprepare(UID2)).ok
    assert rig.host.timeslice == {PCI1: "Default"} and rig.host.steps.count(f"timeslice-set {PCI1} Default") == 1


def test_a_card_is_passed_through_and_back(tmp_path: Path) -> None:
    rig = SharedRig(tmp_path)
    r = run(rig.keeper.prepare(req(dev(2, sharing=VFIO))))
    assert r.ok, r
    assert rig.host.driver[PCI2] == "vfio-pci" and rig.host.steps == [f"switch {PCI2} vfio-pci"]
    spec = rig.spec()
    assert spec["devices"][0]["containerEdits"] == {"deviceNodes": [{"path": "/dev/vfio/42"}]}
    assert spec["containerEdits"]["deviceNodes"] == [{"path": "/dev/vfio/vfio"}]
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
    assert r.devices[0].cdi_ids == [f"bcd.dev/gpu={GPU[2]}"]
    # the kubelet's retry answers the same, the card still on vfio-pci
    assert run(rig.keeper.prepare(req(dev(2, sharing=VFIO)))) == r
    assert run(rig.keeper.unprepare(UID)).ok
    assert rig.host.driver[PCI2] == "nvidia" and rig.host.steps[-1] == f"switch {PCI2} native" and rig.state.claims == {}


@pytest.mark.parametrize(
    ("fault", "reason", "part"),
    [
        ("switch-held", "vfio-failed", "held by pid 99"),
        ("switch-disruption", "vfio-failed", "DisruptionRequired"),
        ("mps-start-fail", "sharing-failed", "nvidia-cuda-mps-control -d failed"),
        ("lose-mps-reply", "sharing-failed", "did not answer"),
        ("timeslice-fail", "sharing-failed", "compute-policy failed"),
    ],
)
def test_a_step_that_fails_is_refused_and_everything_before_it_undone(tmp_path: Path, fault: str, reason: str, part: str) -> None:
    rig = SharedRig(tmp_path)
    rig.host.faults.add(fault)
    sharing = VFIO if fault.startswith("switch") else (TS_LONG if fault.startswith("timeslice") else MPS)
    r = run(rig.keeper.prepare(req(dev(2, sharing=sharing))))
    assert not r.ok and r.reason == reason and part in r.message, r
    assert rig.state.claims == {} and rig.files() == [] and rig.host.daemons == {}
    assert rig.host.driver.get(PCI2, "nvidia") in ("nvidia", "")  # a disruption leaves no driver: a reboot
    assert rig.host.timeslice.get(PCI2, "Default") == "Default"
    assert run(rig.keeper.prepare(req(dev(2, sharing=sharing)))).ok or fault == "switch-disruption"


SHARING_POINTS = ("claim.vfio-switched", "claim.mps-started", "claim.timeslice-set", "claim.cdi-written", "claim.consumer-written")


@pytest.mark.parametrize("point", SHARING_POINTS)
@pytest.mark.parametrize("sharing", [VFIO, MPS, TS_LONG], ids=["vfio", "mps", "timeslice"])
def test_a_crash_at_each_step_is_undone_at_start(tmp_path: Path, point: str, sharing: ClaimSharing) -> None:
    """kill -9 between a step and its journal entry: the restart finds in the journal what may
    exist (asked, not answered) and undoes it: no daemon, no time slice, no card on vfio-pci."""
    assert point in CLAIM_POINTS
    rig = SharedRig(tmp_path, crash_at=point)
    try:
        done = run(rig.keeper.prepare(req(dev(2, sharing=sharing))))
    except CrashAt:
        done = None
    # what the journal had on disk at the crash: the last save
    state = msgspec.json.decode(rig.saves[-1], type=ConvergerState)
    if done is not None:
        # this point is not on this claim's way (an MPS claim sets no time slice): prepared
        assert done.ok and state.claims[UID].state == "prepared"
        return
    assert state.claims[UID].state == "preparing"
    again = SharedRig(tmp_path, state, rig.host)
    run(again.keeper.reconcile(run(again._inventory())))
    assert again.state.claims == {} and again.files() == [] and again.copies_on_disk() == []
    assert rig.host.daemons == {} and rig.host.driver.get(PCI2, "nvidia") == "nvidia" and rig.host.timeslice.get(PCI2, "Default") == "Default"


def test_an_mps_daemon_no_claim_owns_is_stopped_at_start(tmp_path: Path) -> None:
    rig = SharedRig(tmp_path)
    assert run(rig.keeper.prepare(req(dev(0, sharing=MPS)))).ok
    mine = rig.state.claims[UID].mps.control  # type: ignore[union-attr]
    stray = f"{UID3}-abcdef"
    rig.host.daemons[stray] = SharingStepRequest(step="mps-start")
    state = msgspec.json.decode(msgspec.json.encode(rig.state), type=ConvergerState)
    again = SharedRig(tmp_path, state, rig.host)
    run(again.keeper.reconcile(run(again._inventory())))
    assert list(rig.host.daemons) == [mine] and again.state.claims[UID].state == "prepared"
    # a new boot: the daemon died with it, the claim is dropped until the kubelet prepares it again
    state.boot_id = "boot-2"
    rig.host.daemons.clear()
    third = SharedRig(tmp_path, state, rig.host)
    run(third.keeper.reconcile(run(third._inventory())))
    assert third.state.claims == {} and third.files() == []


def test_a_claim_prepared_again_with_another_config_is_refused(tmp_path: Path) -> None:
    rig = SharedRig(tmp_path)
    assert run(rig.keeper.prepare(req(dev(0, sharing=MPS)))).ok
    r = run(rig.keeper.prepare(req(dev(0, sharing=TS_LONG))))
    assert not r.ok and r.reason == "overlap" and "prepared here with other devices" in r.message
