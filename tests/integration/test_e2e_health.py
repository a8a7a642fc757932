"""A sick GPU through every consumer of a whole node (issue 30): `bcd up` on a fake host with the
device plugin and a kubelet stand-in on the official protos. An XID written into the host file
(and each other kind of fault: a lost card, an uncorrectable ECC error, rows to remap) reaches,
within seconds: the inventory (Healthy=False, phase Failed), the kubelet (the card's
device Unhealthy in the next ListAndWatch), the control plane (a `gpu` event with the condition,
a `hold` event DevicesHealthy=False for each hold kept on the card, and `device-unhealthy` for a
new hold on it), and `bcd status`."""

from __future__ import annotations

import asyncio
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from services.device_plugin.proto import HEALTHY, UNHEALTHY

from .harness import EXAMPLE_HOSTS
from .test_device_plugin import peers  # noqa: F401 - the kubelet's pod-resources and API server peers
from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RES = "bcd.dev/gpu"
HOST = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
PCI = {g["uuid"]: g["pci_address"] for g in HOST["gpus"]}


def kube(alloc: str, *devices: str) -> dict:
    return {**assignment(alloc, *devices), "binding": "BINDING_KUBERNETES"}


def sicken(host: Path, uuid: str, **health: object) -> None:
    """What NVML would say of the card from now on (the fake host's `health`)."""
    doc = json.loads(host.read_text())
    card = next(g for g in doc["gpus"] if g["uuid"] == uuid)
    card.setdefault("health", {}).update(health)
    tmp = host.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, host)


def throw_xid(host: Path, uuid: str, number: int) -> None:
    doc = json.loads(host.read_text())
    xids = next(g for g in doc["gpus"] if g["uuid"] == uuid).get("health", {}).get("xids", [])
    sicken(host, uuid, xids=[*xids, {"xid": number, "at": datetime.now(timezone.utc).isoformat()}])


async def test_an_xid_reaches_the_kubelet_the_control_plane_and_new_holds(tmp_path, short_dir, kubelet, peers) -> None:
    _, socket, kubeconfig = peers
    host = tmp_path / "host.json"
    host.write_text(json.dumps({**HOST, "processes": []}))
    node = Node(tmp_path, "--kubelet-dir", str(short_dir), "--pod-resources-socket", str(socket), "--kubeconfig", str(kubeconfig), host=host)
    await asyncio.to_thread(node.start)
    try:
        gen = await asyncio.to_thread(node.apply, {"node_id": "node-1", "devices": [kube("k1", GPU[0]), assignment("plain", GPU[3])]})
        await asyncio.to_thread(node.wait_generation, gen)
        await kubelet.wait_registered(RES)
        devices = await kubelet.wait_devices(RES, lambda d: set(d) == {GPU[0]})
        assert devices[GPU[0]].health == HEALTHY

        # each kind of fault on its own card: the kube hold's card is lost, the plain hold's throws
        # XID 48, a free card counts an uncorrectable ECC error, another has rows waiting to be
        # remapped, and one throws only an application XID (ignored)
        sicken(host, GPU[0], gone=True)
        throw_xid(host, GPU[3], 48)
        sicken(host, GPU[6], ecc_uncorrectable=1)
        sicken(host, GPU[1], row_remap_pending=True)
        throw_xid(host, GPU[5], 43)
        await kubelet.wait_devices(RES, lambda d: d.get(GPU[0]) is not None and d[GPU[0]].health == UNHEALTHY, timeout=20)

        # the holds are kept, and each says so upstream
        def hold_events():
            got = {e.allocation_id: e for e in applied(node, "hold")}
            return got if {"k1", "plain"} <= set(got) else None

        said = await asyncio.to_thread(wait_for, hold_events, 30, "hold conditions at the control plane")
        assert "DevicesHealthy=False GpuLost" in said["k1"].detail and "stopped answering" in said["k1"].detail
        assert "DevicesHealthy=False XidCritical" in said["plain"].detail and "XID 48 (double-bit ECC error)" in said["plain"].detail
        assert node.holds() >= {"k1", "plain"}
        rsv = node.cp_state().reservations["rsv-plain"]
        assert rsv.state == "active" and rsv.condition is not None and rsv.condition.reason == "XidCritical"

        # the sick cards' gpu events reach the control plane (Failed); the ignored XID's card stays Ready
        def gpu_events():
            got = {(e.event or {}).get("pci_address", ""): e.detail for e in applied(node, "gpu")}
            return got if all(got.get(PCI[u], "").startswith("Failed/") for u in (GPU[0], GPU[3], GPU[6], GPU[1])) else None

        got = await asyncio.to_thread(wait_for, gpu_events, 30, "gpu events of the sick cards")
        assert got[PCI[GPU[5]]].startswith("Ready/"), got

        # a new hold on a sick card is refused naming the condition; one on the ignored XID's card binds
        devices = [kube("k1", GPU[0]), assignment("plain", GPU[3]), assignment("n1", GPU[6]), assignment("n2", GPU[1]), assignment("ok", GPU[5])]
        gen = await asyncio.to_thread(node.apply, {"node_id": "node-1", "devices": devices})
        await asyncio.to_thread(node.wait_generation, gen)
        failed = {e.allocation_id: e for e in applied(node, "failed")}
        assert set(failed) == {"n1", "n2"}
        assert failed["n1"].detail.startswith("device-unhealthy: ") and "Healthy=False EccUncorrectable" in failed["n1"].detail
        assert failed["n2"].detail.startswith("device-unhealthy: ") and "Healthy=False RowRemapPending" in failed["n2"].detail
        assert "ok" in node.holds() and not {"n1", "n2"} & node.holds()
        status = await asyncio.to_thread(bcd, "status", "--state-dir", str(node.state))
        assert "GpuLost" in status.stdout and "XidCritical" in status.stdout, status.stdout

        # an XID while a pass binds a hold on that card: whichever comes first, the node ends
        # consistent - the hold refused as device-unhealthy, or bound and then saying DevicesHealthy=False
        devices.append(assignment("racing", GPU[7]))
        gen = await asyncio.to_thread(node.apply, {"node_id": "node-1", "devices": devices})
        throw_xid(host, GPU[7], 119)
        await asyncio.to_thread(node.wait_generation, gen)

        def settled():
            if "racing" in {e.allocation_id for e in applied(node, "failed")}:
                return "refused"
            said = {e.allocation_id: e.detail for e in applied(node, "hold")}
            return "kept" if "XID 119" in said.get("racing", "") else None

        outcome = await asyncio.to_thread(wait_for, settled, 30, "the racing hold refused or saying it is on a sick card")
        assert ("racing" in node.holds()) == (outcome == "kept")
    finally:
        await asyncio.to_thread(node.stop)


def unplug(host: Path, uuid: str, present: bool) -> None:
    """The card falls off the bus (`present: false`) or comes back."""
    doc = json.loads(host.read_text())
    next(g for g in doc["gpus"] if g["uuid"] == uuid)["present"] = present
    tmp = host.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, host)


async def test_a_held_card_off_the_bus_is_news_everywhere_and_never_unclaimed_on_its_return(tmp_path) -> None:
    """Issue 41 (2): `present: false` on a card held by train-01: it stayed Ready ~30 s, then dropped
    out of the GPU table while the hold stayed; no hold or gpu event, `bcd doctor` said every card
    healthy, `bcd gpu list <pci>` said "no card"; back on the bus, upstream first heard Ready/Unclaimed."""
    node = Node(tmp_path, env={"BCD_HEALTH_INTERVAL": "1"})
    await asyncio.to_thread(node.start)
    pci = PCI[GPU[2]]
    try:
        gen = await asyncio.to_thread(node.apply, {"node_id": "node-1", "devices": [assignment("train-01", GPU[2])]})
        await asyncio.to_thread(node.wait_generation, gen)

        def states() -> list[str]:
            return [(e.event or {}).get("management_state", "") for e in applied(node, "gpu") if (e.event or {}).get("pci_address") == pci]

        await asyncio.to_thread(wait_for, lambda: "Managed" in states(), 15, "the card said Managed by its hold")
        held_from = states().index("Managed")
        unplug(node.host, GPU[2], False)

        def hold_said():
            got = {e.allocation_id: e for e in applied(node, "hold")}
            return got.get("train-01")

        said = await asyncio.to_thread(wait_for, hold_said, 15, "the hold saying its card is lost")
        assert "DevicesHealthy=False GpuLost" in said.detail and "fell off the bus" in said.detail, said.detail
        assert "train-01" in node.holds()
        status = await asyncio.to_thread(bcd, "status", "--state-dir", str(node.state))
        assert status.returncode == 1 and "GpuLost" in status.stdout, status.stdout
        doctor = await asyncio.to_thread(bcd, "doctor", "--state-dir", str(node.state))
        assert f"{pci} is unhealthy (Healthy=False/GpuLost)" in doctor.stdout, doctor.stdout
        listed = await asyncio.to_thread(bcd, "gpu", "list", pci, "--state-dir", str(node.state))
        assert listed.returncode == 0 and "GpuLost" in listed.stdout, listed.stdout + listed.stderr

        lost_events = len(states())
        unplug(node.host, GPU[2], True)
        rescan = await asyncio.to_thread(bcd, "gpu", "recheck", pci, "--state-dir", str(node.state))  # scans the host now
        assert rescan.returncode == 1 and "kept GpuLost: the card is held" in rescan.stdout, rescan.stdout
        await asyncio.to_thread(wait_for, lambda: len(states()) > lost_events, 15, "the card's return said")
        await asyncio.sleep(1)
        assert "Unclaimed" not in states()[held_from:], states()
    finally:
        await asyncio.to_thread(node.stop)
