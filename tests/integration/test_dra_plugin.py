"""DRA end to end: a whole node (`bcd up` on a fake host), a kubelet stand-in on the official
kubelet protos (plugin registration v1, DRAPlugin v1) and an API server stand-in serving the
ResourceClaim, ResourceSlice and Node paths the Kubernetes client uses (no real kube-apiserver
or kubelet can run on these machines).

The node publishes its Ready, unclaimed cards and every MIG placement of its MIG card as
ResourceSlices (1.35 rules, one counter set per card); a claim the scheduler allocated is
prepared as a hold of its own (`bcd-claim-<uid>.json`), its MIG instance made on prepare and
destroyed on unprepare; a placement that overlaps a hold is refused naming the hold; a compute
instance that fails leaves no GPU instance; a plugin killed with claims prepared reconciles its
checkpoint with the API server; a card handed to a VM leaves the slices; a card an XID made
unhealthy stays published with device taints on all its devices (DRADeviceTaints on) or leaves
the slices (an API server that drops the taints).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest

from services.dra_plugin.proto import DEFAULT_DRIVER

from .dra_kubelet_standin import DraKubelet
from .harness import EXAMPLE_HOSTS
from .kubeapi_standin import GATES_1_35_DEFAULT, KubeApiStandIn
from .wholenode import GPU, Node, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

DRIVER = DEFAULT_DRIVER
NODE = "node-1"
MIG_CARD = 6  # emptied of its MIG instances: DRA makes them
MIG_PCI = "0000:ba:00.0"
M7 = f"{GPU[7]}/gi9/ci0"  # a 1g.18gb instance of card 7, whose layout is static


def host(tmp: Path, **card_faults: dict) -> Path:
    h = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
    h["processes"] = []
    for g in h["gpus"]:
        if g["index"] == MIG_CARD:
            g["mig_instances"] = []
            g.pop("gpu_instances", None)
            if card_faults:
                g["faults"] = {**g.get("faults", {}), **card_faults}
    path = tmp / "host.json"
    path.write_text(json.dumps(h, indent=2))
    return path


def card(h: Path, index: int) -> dict:
    return next(g for g in json.loads(h.read_text())["gpus"] if g["index"] == index)


@pytest.fixture
def api(tmp_path: Path):
    with KubeApiStandIn() as server:
        server.add_node(NODE)
        yield server


async def start(tmp_path: Path, short_dir: Path, api: KubeApiStandIn, h: Path | None = None) -> Node:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    node = Node(tmp_path, "--kubelet-dir", str(short_dir), "--kubeconfig", str(kubeconfig), host=h or host(tmp_path))
    return await asyncio.to_thread(node.start)


async def stop(node: Node) -> None:
    await asyncio.to_thread(node.stop)


async def apply(node: Node, *devices: dict, instances: list[dict] | None = None) -> None:
    gen = await asyncio.to_thread(node.apply, {"node_id": NODE, "devices": list(devices), "instances": instances or []})
    await asyncio.to_thread(node.wait_generation, gen)


def devices_of(api: KubeApiStandIn) -> dict[str, dict]:
    return {d["name"]: d for s in api.slices(DRIVER) for d in s["spec"].get("devices") or []}


async def wait_devices(api: KubeApiStandIn, predicate, what: str, timeout: float = 60) -> dict[str, dict]:
    return await asyncio.to_thread(wait_for, lambda: (lambda d: d if predicate(d) else None)(devices_of(api)), timeout, what)


def dra_status(node: Node) -> dict:
    return node.status().get("dra_plugin") or {}


def claim(api: KubeApiStandIn, name: str, *devices: str, request: str = "gpu") -> tuple[str, str, str]:
    uid = str(uuid.uuid4())
    api.add_claim("ml", name, uid=uid, results=[(request, DRIVER, NODE, d) for d in devices])
    return ("ml", name, uid)


async def test_publish_prepare_unprepare_whole_cards_and_mig_placements(tmp_path, short_dir, api):
    h = host(tmp_path)
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await apply(node, assignment("plain", GPU[3]), assignment("m7", M7))
        info = await kubelet.register(DRIVER)
        assert info.endpoint == str(short_dir / "plugins" / DRIVER / "dra.sock")
        await asyncio.to_thread(wait_for, lambda: dra_status(node).get("registered"), 30, "the plugin to hear it is registered")

        # published: Ready cards not held (card 3 is), card 7's layout is not DRA's (its instances
        # belong to no claim), every placement of card 6 with counters
        devs = await wait_devices(api, lambda d: "gpu-0" in d and "gpu-6-mig-1g-18gb-0" in d, "the node's devices")
        assert {"gpu-0", "gpu-1", "gpu-2", "gpu-4", "gpu-5", "gpu-6"} <= set(devs)
        assert "gpu-3" not in devs and not any(n.startswith("gpu-7") for n in devs)
        mig = {n for n in devs if n.startswith("gpu-6-mig-")}
        assert {"gpu-6-mig-1g-18gb-0", "gpu-6-mig-1g-18gb-6", "gpu-6-mig-3g-71gb-0", "gpu-6-mig-3g-71gb-4", "gpu-6-mig-7g-141gb-0"} <= mig
        assert devs["gpu-6-mig-3g-71gb-4"]["attributes"]["gpu.bcd.dev/parentUUID"] == {"string": GPU[6]}
        assert devs["gpu-6-mig-3g-71gb-4"]["consumesCounters"][0]["counterSet"] == "gpu-6-counters"
        slices = api.slices(DRIVER)
        assert all(s["spec"]["nodeName"] == NODE and s["spec"]["pool"]["name"] == NODE for s in slices)
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}
        assert all(s["metadata"]["ownerReferences"][0]["kind"] == "Node" for s in slices)
        assert not any(s["spec"].get("devices") and s["spec"].get("sharedCounters") for s in slices)  # 1.35: never both
        assert api.check_pool(DRIVER, NODE) == []
        generation = slices[0]["spec"]["pool"]["generation"]

        # a whole card: a hold of its own, with the CDI ids the runtime resolves
        whole = claim(api, "whole", "gpu-0")
        reply = (await kubelet.prepare(whole))[whole[2]]
        assert reply.error == "" and [(d.device_name, d.pool_name, list(d.cdi_device_ids)) for d in reply.devices] == [("gpu-0", NODE, [f"bcd.dev/gpu={GPU[0]}"])]
        cdi = node.state / "cdi" / f"bcd-claim-{whole[2]}.json"
        spec = json.loads(cdi.read_text())
        assert f"NVIDIA_VISIBLE_DEVICES={GPU[0]}" in spec["containerEdits"]["env"] and [d["name"] for d in spec["devices"]] == [GPU[0]]
        # idempotent: the kubelet asks again and gets the same answer
        assert (await kubelet.prepare(whole))[whole[2]] == reply
        # a plain hold on the claimed card is refused naming the claim
        await apply(node, assignment("plain", GPU[3]), assignment("m7", M7), assignment("late", GPU[0]))
        failures = node.status()["converger"]["failures"]
        assert failures == {"late": "overlap"}

        # two MIG devices on one card: made on prepare, at the published placements
        m1 = claim(api, "small", "gpu-6-mig-1g-18gb-0")
        m2 = claim(api, "half", "gpu-6-mig-3g-71gb-4")
        got = await kubelet.prepare(m1, m2)
        assert got[m1[2]].error == "" and got[m2[2]].error == "", got
        made = card(h, MIG_CARD)["mig_instances"]
        assert sorted((m.get("placement_start"), m["profile"]) for m in made) == [(0, "1g.18gb"), (4, "3g.71gb")]
        uuids = {m["profile"]: m["uuid"] for m in made}
        half = json.loads((node.state / "cdi" / f"bcd-claim-{m2[2]}.json").read_text())
        assert f"NVIDIA_VISIBLE_DEVICES={uuids['3g.71gb']}" in half["containerEdits"]["env"]
        # the card stays published (its instances are the claims'), and nothing else changed
        await wait_devices(api, lambda d: "gpu-6-mig-1g-18gb-1" in d and "gpu-0" in d, "card 6 still published")

        # a placement overlapping a claim's is refused naming it (the scheduler would not allocate it;
        # the node does not trust that)
        bad = claim(api, "overlapping", "gpu-6-mig-2g-35gb-4")
        err = (await kubelet.prepare(bad))[bad[2]].error
        assert "overlap" in err and "DRA claim ml/half" in err
        # a device of a card a hold has: refused naming the hold
        held = claim(api, "onheld", "gpu-3")
        err = (await kubelet.prepare(held))[held[2]].error
        assert "overlap" in err and "allocation plain" in err
        # a MIG placement on a card where a hold has a MIG instance (memory slice 3 of card 7 is free,
        # but a hold has part of the card): refused naming the hold
        on_mig_hold = claim(api, "onmighold", "gpu-7-mig-1g-18gb-3")
        err = (await kubelet.prepare(on_mig_hold))[on_mig_hold[2]].error
        assert "overlap" in err and "allocation m7" in err, err

        # bcd status names the claims
        st = node.status()
        assert {c["name"]: c["state"] for c in st["converger"]["claims"]} == {"whole": "prepared", "small": "prepared", "half": "prepared"}
        assert st["dra_plugin"]["registered"] and {c["name"] for c in st["dra_plugin"]["claims"]} == {"whole", "small", "half"}
        text = (await asyncio.to_thread(bcd, "status", "--state-dir", str(node.state))).stdout
        assert "DRA claim ml/half" in text and f"DRA plugin {DRIVER}: registered" in text

        # unprepare: the file goes, then the compute and GPU instance
        for c in (m1, m2, whole):
            assert (await kubelet.unprepare(c))[c[2]].error == ""
        assert card(h, MIG_CARD)["mig_instances"] == [] and not list((node.state / "cdi").glob("bcd-claim-*.json"))
        assert (await kubelet.unprepare(whole))[whole[2]].error == ""  # again: nothing left, fine
        # the pool went up as it changed
        await asyncio.to_thread(wait_for, lambda: api.slices(DRIVER)[0]["spec"]["pool"]["generation"] >= generation, 10, "generation")
    finally:
        await kubelet.close()
        await stop(node)


async def test_a_compute_instance_that_fails_leaves_no_gpu_instance(tmp_path, short_dir, api):
    h = host(tmp_path, mig_instance="ci-fail")
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-6-mig-2g-35gb-2" in d, "card 6's placements")
        c = claim(api, "c", "gpu-6-mig-2g-35gb-2")
        err = (await kubelet.prepare(c))[c[2]].error
        assert "mig-failed" in err, err
        g = card(h, MIG_CARD)
        assert g["mig_instances"] == [] and not g.get("gpu_instances"), g
        assert not list((node.state / "cdi").glob("bcd-claim-*.json"))
        # the kubelet's retry (the fault fired once) prepares it
        assert (await kubelet.prepare(c))[c[2]].error == ""
        assert [m["profile"] for m in card(h, MIG_CARD)["mig_instances"]] == ["2g.35gb"]
    finally:
        await kubelet.close()
        await stop(node)


async def test_plugin_killed_with_claims_prepared_reconciles_with_the_api_server(tmp_path, short_dir, api):
    h = host(tmp_path)
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-1" in d, "the node's devices")
        keep = claim(api, "keep", "gpu-1")
        gone = claim(api, "gone", "gpu-6-mig-1g-18gb-3")
        got = await kubelet.prepare(keep, gone)
        assert all(r.error == "" for r in got.values()), got
        pid = node.pids()["dra_plugin"]
        os.kill(pid, signal.SIGKILL)
        # while it is down the pod of "gone" was deleted, and with it the claim
        api.remove_claim("ml", "gone")
        await asyncio.to_thread(wait_for, lambda: node.pids().get("dra_plugin") not in (None, pid), 60, "the plugin to be restarted")
        await kubelet.register(DRIVER)
        # reconciled: "gone" unprepared (its MIG instance destroyed), "keep" still prepared
        await asyncio.to_thread(wait_for, lambda: card(h, MIG_CARD)["mig_instances"] == [], 60, "gone's MIG instance destroyed")
        assert sorted(p.name for p in (node.state / "cdi").glob("bcd-claim-*.json")) == [f"bcd-claim-{keep[2]}.json"]
        st = dra_status(node)
        assert [(c["name"], c["state"]) for c in st["claims"]] == [("keep", "PrepareCompleted")]
        assert (await kubelet.prepare(keep))[keep[2]].error == ""
    finally:
        await kubelet.close()
        await stop(node)


async def test_a_card_going_to_a_vm_leaves_the_slices(tmp_path, short_dir, api):
    node = await start(tmp_path, short_dir, api)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-2" in d, "gpu-2 published")
        pci2 = json.loads(node.host.read_text())["gpus"][2]["pci_address"]
        await apply(node, instances=[{"instance_id": "vm1", "gpus": [pci2]}])
        await wait_devices(api, lambda d: "gpu-2" not in d and "gpu-1" in d, "gpu-2 gone from the slices")
        # and a claim naming it is refused
        c = claim(api, "late", "gpu-2")
        err = (await kubelet.prepare(c))[c[2]].error
        assert "overlap" in err and "instance vm1" in err, err
        await apply(node)
        await wait_devices(api, lambda d: "gpu-2" in d, "gpu-2 back once the VM let it go", timeout=90)
    finally:
        await kubelet.close()
        await stop(node)


async def test_an_api_server_that_drops_the_counters_gets_whole_cards_only(tmp_path, short_dir):
    """A stock 1.35 API server (DRAPartitionableDevices off) drops sharedCounters and consumesCounters
    without an error: MIG placements would not be exclusive, so the plugin publishes whole cards only."""
    with KubeApiStandIn(gates=GATES_1_35_DEFAULT) as server:
        server.add_node(NODE)
        node = await start(tmp_path, short_dir, server)
        try:
            devs = await wait_devices(server, lambda d: "gpu-6" in d and not any(n.startswith("gpu-6-mig") for n in d), "whole cards only")
            assert "gpu-0" in devs
            st = await asyncio.to_thread(wait_for, lambda: (lambda s: s if s.get("left_out") else None)(dra_status(node)), 30, "the note")
            assert "DRAPartitionableDevices" in st["left_out"][0]
            assert server.check_pool(DRIVER, NODE) == []
        finally:
            await stop(node)


@pytest.mark.parametrize("point", ["claim.gi-created", "claim.ci-created", "claim.cdi-written"])
async def test_a_converger_killed_between_the_mig_steps_leaves_no_instance_nobody_owns(node_bus, tmp_path, point):
    """kill -9 of the converger right after NVML made the GPU instance (its id not yet journaled: the
    journal says gi-asked), after the compute instance, or after the CDI spec: the restarted converger
    rolls the half-made claim back, finding what NVML made by its placement, and the kubelet's retry
    prepares it from the start."""
    from shared.runtime import call
    from shared.schemas import CLAIM_PREPARE_REPLY_CODEC, ClaimDevice, ClaimPrepareRequest
    from shared.subjects import NodeSubjects

    h = host(tmp_path)
    common = {"BCD_FAKE_HOST": str(h), "BCD_ADAPTER": "fakehw"}
    for name in ("signer", "inventory"):
        node_bus.start_service(name, **common)
    for name in ("signer", "inventory"):
        await node_bus.wait_service(name)
    conv = node_bus.start_service("converger", **common, BCD_CONVERGER_CRASH_AT=point)
    await node_bus.wait_service("converger")
    plugin = await node_bus.connect("dra_plugin")
    subjects = NodeSubjects(node_bus.node_id)
    uid = str(uuid.uuid4())
    req = ClaimPrepareRequest(
        uid=uid,
        namespace="ml",
        name="c",
        devices=[ClaimDevice(requests=["gpu"], pool=NODE, device="gpu-6-mig-2g-35gb-2", pci=MIG_PCI, kind="mig", profile="2g.35gb", start=2)],
    )
    with pytest.raises(Exception):  # noqa: B017, PT011 - the converger dies answering: no reply
        await call(plugin, subjects.converger_claim_prepare, req, CLAIM_PREPARE_REPLY_CODEC, timeout=20)
    assert await asyncio.to_thread(conv.wait, 30) == -9, conv.log()[-2000:]
    g = card(h, MIG_CARD)
    # NVML made it; the journal may not know its id
    assert {x["gi"] for x in [*g.get("gpu_instances", []), *g["mig_instances"]]} == {1}, g
    state = json.loads((node_bus.root / "data" / "converger" / "state.json").read_text())
    assert state["claims"][uid]["state"] == "preparing"

    node_bus.start_service("converger", **common)
    await node_bus.wait_service("converger")
    # the restart rolls it back once the inventory is known: no GPU instance nobody owns
    await asyncio.to_thread(wait_for, lambda: (lambda c: not c.get("gpu_instances") and not c["mig_instances"])(card(h, MIG_CARD)), 30, "the half-made instance destroyed")
    assert not list((node_bus.root / "cdi").glob("bcd-claim-*.json"))
    # the kubelet's retry
    reply = await call(plugin, subjects.converger_claim_prepare, req, CLAIM_PREPARE_REPLY_CODEC, timeout=60)
    assert reply.ok, reply
    assert [(m["profile"], m.get("placement_start")) for m in card(h, MIG_CARD)["mig_instances"]] == [("2g.35gb", 2)]


async def test_binding_conditions_say_ready_or_binding_failed_on_the_claim(tmp_path, short_dir, api):
    """--binding-conditions true (seed 003): every device declares bindsToNode with bindingConditions
    [Ready] and bindingFailureConditions [BindingFailed]; the plugin sets Ready on an allocated device
    it still publishes and BindingFailed, with the reason, on one it no longer does."""
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    node = Node(tmp_path, "--kubelet-dir", str(short_dir), "--kubeconfig", str(kubeconfig), host=host(tmp_path), env={"BCD_BINDING_CONDITIONS": "true"})
    await asyncio.to_thread(node.start)
    try:
        await apply(node, assignment("plain", GPU[3]))
        devs = await wait_devices(api, lambda d: "gpu-0" in d and "gpu-3" not in d, "the node's devices")
        assert {k: devs["gpu-0"].get(k) for k in ("bindsToNode", "bindingConditions", "bindingFailureConditions")} == {
            "bindsToNode": True,
            "bindingConditions": ["Ready"],
            "bindingFailureConditions": ["BindingFailed"],
        }
        claim(api, "ok", "gpu-0")
        claim(api, "stale", "gpu-3")  # allocated against an older pool: the card is held now

        def conditions(name: str) -> dict[str, str]:
            c = api.claim("ml", name) or {}
            return {x["type"]: x["status"] for d in (c.get("status") or {}).get("devices") or [] for x in d.get("conditions") or []}

        await asyncio.to_thread(wait_for, lambda: conditions("ok") == {"Ready": "True"}, 30, "Ready on the claim")
        await asyncio.to_thread(wait_for, lambda: conditions("stale") == {"BindingFailed": "True"}, 30, "BindingFailed on the claim")
        failed = api.claim("ml", "stale")["status"]["devices"][0]["conditions"][0]
        assert "gpu-3" in failed["message"] and failed["reason"] == "DeviceNotAvailable"
    finally:
        await stop(node)


def throw_xid(h: Path, index: int, number: int) -> str:
    """An XID on a card of the fake host (what NVML's event set would report); its time, as a taint has it."""
    at = datetime.now(timezone.utc)
    doc = json.loads(h.read_text())
    g = next(g for g in doc["gpus"] if g["index"] == index)
    g.setdefault("health", {}).setdefault("xids", []).append({"xid": number, "at": at.isoformat()})
    tmp = h.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, h)
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


async def test_an_unhealthy_card_stays_published_with_taints_on_all_its_devices(tmp_path, short_dir, api):
    """Issue 30 with DRADeviceTaints on: an XID makes the card Healthy=False (phase Failed); rather
    than leaving the slices, the whole card and each of its MIG placements carry the taint (NoExecute
    for a fatal XID, its number as the value, timeAdded when it was seen); the other cards are
    untouched; a claim that names a tainted device is still refused by the node."""
    h = host(tmp_path)
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        before = await wait_devices(api, lambda d: "gpu-2" in d and "gpu-6-mig-1g-18gb-0" in d, "the node's devices")
        assert not any("taints" in d for d in before.values())
        at2 = throw_xid(h, 2, 79)
        at6 = throw_xid(h, MIG_CARD, 48)

        def tainted(d: dict) -> bool:
            return bool(d.get("gpu-2", {}).get("taints")) and all(v.get("taints") for n, v in d.items() if n.startswith("gpu-6"))

        devs = await wait_devices(api, tainted, "the sick cards' devices tainted", timeout=30)
        assert set(devs) == set(before), "nothing withdrawn"
        assert devs["gpu-2"]["taints"] == [{"key": "gpu.bcd.dev/xid", "value": "79", "effect": "NoExecute", "timeAdded": at2}]
        six = [n for n in devs if n.startswith("gpu-6")]
        assert len(six) > 1 and "gpu-6-mig-7g-141gb-0" in six
        for n in six:
            assert devs[n]["taints"] == [{"key": "gpu.bcd.dev/xid", "value": "48", "effect": "NoExecute", "timeAdded": at6}], n
        assert {n: d for n, d in devs.items() if not n.startswith(("gpu-2", "gpu-6"))} == {n: d for n, d in before.items() if not n.startswith(("gpu-2", "gpu-6"))}
        assert api.check_pool(DRIVER, NODE) == []

        st = dra_status(node)
        assert st["device_taints"] is True and not any("DRADeviceTaints" in n for n in st.get("left_out", []))
        lines = {line.split(" ")[1]: line for line in st["tainted"]}
        assert set(lines) == {"gpu-2:", "gpu-6:"}
        assert "gpu.bcd.dev/xid=79:NoExecute" in lines["gpu-2:"] and "Healthy=False XidCritical" in lines["gpu-2:"]

        # the scheduler would not allocate it to a claim without a toleration; one that names it anyway is refused
        c = claim(api, "onsick", "gpu-2")
        err = (await kubelet.prepare(c))[c[2]].error
        assert "unhealthy" in err, err
    finally:
        await kubelet.close()
        await stop(node)


async def test_an_api_server_that_drops_device_taints_gets_the_unhealthy_card_withdrawn(tmp_path, short_dir):
    """A stock 1.35 API server (DRADeviceTaints off) drops the taints without an error: the plugin
    sees them missing in what came back and withdraws the unhealthy card (as before device
    taints), saying why in its status."""
    with KubeApiStandIn(gates=GATES_1_35_DEFAULT) as server:
        server.add_node(NODE)
        h = host(tmp_path)
        node = await start(tmp_path, short_dir, server, h)
        try:
            await wait_devices(server, lambda d: "gpu-2" in d and "gpu-1" in d, "the node's devices")
            assert dra_status(node)["device_taints"] is True, "no taint sent yet: nothing seen dropped"
            throw_xid(h, 2, 79)
            devs = await wait_devices(server, lambda d: "gpu-2" not in d and "gpu-1" in d, "gpu-2 withdrawn", timeout=30)
            assert not any("taints" in d for d in devs.values())
            st = await asyncio.to_thread(wait_for, lambda: (lambda s: s if not s.get("device_taints") else None)(dra_status(node)), 30, "taints off")
            assert any("DRADeviceTaints" in n for n in st["left_out"]) and st.get("tainted", []) == []
            (note,) = [n for n in st["left_out"] if " gpu-2: " in n]
            assert "Healthy=False XidCritical" in note and "device taints are off" in note
            assert server.check_pool(DRIVER, NODE) == []
        finally:
            await stop(node)
