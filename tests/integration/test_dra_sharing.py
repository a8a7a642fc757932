"""DRA claims that share a card, time-slice it or pass it through (issue 29), end to end.

A whole node (`bcd up` on a fake host), the kubelet stand-in on the official protos and the API
server stand-in: whole cards are published shareable (consumable capacity) and exclusive again
when the API server drops the fields; a claim's opaque configs (resource.bcd.dev/v1beta1) are
read strictly; two MPS claims share a card, each with a daemon of its own and the limits of its
share, and a third that would take the card past 100% is refused by the node; a time-sliced card
goes back to Default; a card passed through goes to vfio-pci and back; a config this driver does
not know fails the prepare with its name; a converger killed between the daemon's start and the
CDI spec leaves no daemon; a plugin restarted with MPS claims prepared keeps them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import uuid
from pathlib import Path

import pytest

from services.dra_plugin.configs import API_VERSION

from .dra_kubelet_standin import DraKubelet
from .kubeapi_standin import GATES_1_35_DEFAULT, KubeApiStandIn
from .test_dra_plugin import DRIVER, NODE, card, devices_of, dra_status, host, start, stop, wait_devices
from .wholenode import GPU, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

GIB = 1 << 30


def opaque(kind: str, requests: list[str] | None = None, source: str = "FromClaim", **fields) -> dict:
    entry: dict = {"source": source, "opaque": {"driver": DRIVER, "parameters": {"apiVersion": API_VERSION, "kind": kind, **fields}}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def share(percent: int, memory: int = 0) -> dict:
    return {"shareID": str(uuid.uuid4()), "consumedCapacity": {"gpu.bcd.dev/sharePercent": str(percent), "gpu.bcd.dev/memory": str(memory)}}


def claim(api: KubeApiStandIn, name: str, device: str, *, config: list[dict] = (), shared: dict | None = None) -> tuple[str, str, str]:  # type: ignore[assignment]
    uid = str(uuid.uuid4())
    api.add_claim("ml", name, uid=uid, results=[("gpu", DRIVER, NODE, device)], config=config, shares=[shared])
    return ("ml", name, uid)


def host_doc(h: Path) -> dict:
    return json.loads(h.read_text())


@pytest.fixture
def api():
    with KubeApiStandIn() as server:
        server.add_node(NODE)
        yield server


async def test_two_mps_claims_share_a_card_with_limits_and_a_third_over_capacity_is_refused(tmp_path, short_dir, api):
    h = host(tmp_path)
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        devs = await wait_devices(api, lambda d: "gpu-0" in d, "the node's devices")
        # published shareable: a claim asks a sharePercent and memory of the card; asking nothing is the whole card
        gpu0 = devs["gpu-0"]
        assert gpu0["allowMultipleAllocations"] is True
        assert gpu0["capacity"]["gpu.bcd.dev/sharePercent"] == {"value": "100", "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}}}
        assert gpu0["capacity"]["gpu.bcd.dev/memory"]["requestPolicy"]["default"] == "0"
        assert api.check_pool(DRIVER, NODE) == []
        assert dra_status(node)["shared_cards"] is True

        mps = [opaque("GpuConfig", ["gpu"], sharing={"strategy": "MPS"})]
        a_share, b_share = share(50, 40 * GIB), share(30, 20 * GIB)
        a = claim(api, "a", "gpu-0", config=mps, shared=a_share)
        b = claim(api, "b", "gpu-0", config=[opaque("GpuConfig", ["gpu"], sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}})], shared=b_share)
        got = await kubelet.prepare(a, b)
        assert got[a[2]].error == "" and got[b[2]].error == "", got
        assert list(got[a[2]].devices[0].cdi_device_ids) == [f"bcd.dev/gpu={GPU[0]}_{a_share['shareID']}"]

        # each claim its daemon, held to its share: its percent as active threads, its memory pinned
        daemons = {d["control"].rsplit("-", 1)[0]: d for d in host_doc(h)["mps_daemons"]}
        assert set(daemons) == {a[2], b[2]}
        assert (daemons[a[2]]["active_thread_percentage"], daemons[a[2]]["pinned_memory"]) == (50, {GPU[0]: 40 * GIB})
        assert (daemons[b[2]]["active_thread_percentage"], daemons[b[2]]["pinned_memory"]) == (25, {GPU[0]: 20 * GIB})
        # the claim's spec mounts its daemon's pipe directory, a real one with the control pipe in it
        spec = json.loads((node.state / "cdi" / f"bcd-claim-{a[2]}.json").read_text())
        pipe = daemons[a[2]]["pipe_dir"]
        assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in spec["containerEdits"]["env"]
        log = daemons[a[2]]["log_dir"]
        shm = str(Path(pipe).parent / "shm")
        mps_mounts = {m["hostPath"]: m["containerPath"] for m in spec["containerEdits"]["mounts"] if m["hostPath"].startswith(str(Path(pipe).parent))}
        assert mps_mounts == {pipe: pipe, log: log, shm: "/dev/shm"}  # the daemon's own shm, never the host's
        assert not [m for m in spec["containerEdits"]["mounts"] if m["hostPath"] == "/dev/shm"]
        assert stat.S_ISFIFO(os.stat(Path(pipe) / "control").st_mode) and Path(shm).is_dir()

        # the scheduler's mistake is the node's refusal: 50 + 30 + 30 > 100
        c = claim(api, "c", "gpu-0", config=mps, shared=share(30))
        err = (await kubelet.prepare(c))[c[2]].error
        assert "resources-exhausted" in err and "110%" in err and "DRA claim ml/a" in err, err
        assert len(host_doc(h)["mps_daemons"]) == 2

        text = (await asyncio.to_thread(bcd, "status", "--state-dir", str(node.state))).stdout
        assert f"a 50% share of gpu-0" in text and f"MPS daemon {daemons[a[2]]['control']} (50% threads, 40 GiB pinned)" in text, text
        assert "(whole cards shareable)" in text

        # unprepare: the spec, then the daemon and its directories
        assert (await kubelet.unprepare(a))[a[2]].error == ""
        assert [d["control"] for d in host_doc(h)["mps_daemons"]] == [daemons[b[2]]["control"]]
        assert not Path(pipe).exists() and not (node.state / "cdi" / f"bcd-claim-{a[2]}.json").exists()
        # now c fits
        assert (await kubelet.prepare(c))[c[2]].error == ""
    finally:
        await kubelet.close()
        await stop(node)


async def test_a_time_sliced_card_goes_back_to_default(tmp_path, short_dir, api):
    h = host(tmp_path)
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-1" in d, "gpu-1 published")
        # a class-wide config (no requests) with the claim's own over it: the claim's wins
        config = [
            opaque("GpuConfig", source="FromClass", sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}),
            opaque("GpuConfig", ["gpu"], sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
        ]
        ts = claim(api, "ts", "gpu-1", config=config)
        assert (await kubelet.prepare(ts))[ts[2]].error == ""
        assert card(h, 1)["timeslice"] == "Long"
        st = node.status()["converger"]["claims"]
        assert [c["timeslices"] for c in st] == [{card(h, 1)["pci_address"]: "Long"}]
        assert (await kubelet.unprepare(ts))[ts[2]].error == ""
        assert card(h, 1)["timeslice"] == "Default"
    finally:
        await kubelet.close()
        await stop(node)


async def test_a_card_passed_through_goes_to_vfio_pci_and_back(tmp_path, short_dir, api):
    h = host(tmp_path)
    doc = host_doc(h)
    doc["processes"] = [{"pid": 777, "gpu_uuid": GPU[4]}]
    h.write_text(json.dumps(doc, indent=2))
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-2" in d, "gpu-2 published")
        vfio = [opaque("VfioDeviceConfig", ["gpu"])]
        v = claim(api, "vm", "gpu-2", config=vfio)
        reply = (await kubelet.prepare(v))[v[2]]
        assert reply.error == "", reply
        assert card(h, 2)["driver"] == "vfio-pci"
        spec = json.loads((node.state / "cdi" / f"bcd-claim-{v[2]}.json").read_text())
        assert spec["devices"][0]["containerEdits"] == {"deviceNodes": [{"path": f"/dev/vfio/{card(h, 2)['iommu_group']}"}]}
        assert spec["containerEdits"]["deviceNodes"] == [{"path": "/dev/vfio/vfio"}]
        assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
        # passed through, the card leaves the slices; the inventory says it is backed by the claim, not orphaned
        await wait_devices(api, lambda d: "gpu-2" not in d and "gpu-1" in d, "gpu-2 gone from the slices")
        def gpu2() -> dict:
            out = bcd("inventory", "--state-dir", str(node.state), "--json")
            return next(g for g in json.loads(out.stdout)["gpus"] if g["index"] == 2)

        passed = await asyncio.to_thread(wait_for, lambda: (lambda g: g if g["status"]["phase"] == "Passthrough" else None)(gpu2()), 30, "gpu-2 Passthrough")
        assert passed["status"]["driver_binding"]["management_state"] == "Managed", passed["status"]
        # the kubelet asks again: the same answer, the card still passed through
        assert (await kubelet.prepare(v))[v[2]] == reply
        # a card something runs on is not passed through
        busy = claim(api, "busy", "gpu-4", config=vfio)
        err = (await kubelet.prepare(busy))[busy[2]].error
        assert "in-use" in err and "pid 777" in err and card(h, 4)["driver"] == "nvidia", err
        assert (await kubelet.unprepare(v))[v[2]].error == ""
        assert card(h, 2)["driver"] == "nvidia"
        await wait_devices(api, lambda d: "gpu-2" in d, "gpu-2 back in the slices")
    finally:
        await kubelet.close()
        await stop(node)


async def test_a_config_this_driver_does_not_know_fails_the_prepare_with_its_name(tmp_path, short_dir, api):
    node = await start(tmp_path, short_dir, api)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-1" in d, "gpu-1 published")
        cases = {
            "kind": (opaque("TpuConfig", ["gpu"]), 'unknown kind "TpuConfig" (this driver knows GpuConfig, MigDeviceConfig, VfioDeviceConfig)'),
            "field": (opaque("GpuConfig", ["gpu"], sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercantage": 50}}), "defaultActiveThreadPercantage: unknown field"),
            "strategy": (opaque("GpuConfig", ["gpu"], sharing={"strategy": "Spatial"}), "$.sharing.strategy"),
        }
        for name, (config, part) in cases.items():
            c = claim(api, name, "gpu-1", config=[config])
            err = (await kubelet.prepare(c))[c[2]].error
            assert part in err and "config[0] (FromClaim" in err, (name, err)
        # another driver's config is not ours to read: skipped
        other = {"source": "FromClaim", "requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"anything": 1}}}
        c = claim(api, "theirs", "gpu-1", config=[other])
        assert (await kubelet.prepare(c))[c[2]].error == ""
        assert not list(host_doc(node.host).get("mps_daemons") or [])
    finally:
        await kubelet.close()
        await stop(node)


async def test_an_api_server_without_consumable_capacity_gets_exclusive_cards(tmp_path, short_dir):
    """A stock 1.35 API server drops allowMultipleAllocations and the request policies without an
    error: a "share" would be the whole card to the scheduler, so the plugin publishes exclusive cards."""
    with KubeApiStandIn(gates={**GATES_1_35_DEFAULT, "DRAPartitionableDevices": True}) as server:
        server.add_node(NODE)
        node = await start(tmp_path, short_dir, server)
        try:
            await asyncio.to_thread(wait_for, lambda: dra_status(node).get("shared_cards") is False, 60, "shares turned off")
            devs = await wait_devices(server, lambda d: "gpu-0" in d and "allowMultipleAllocations" not in d["gpu-0"], "exclusive cards")
            assert devs["gpu-0"]["capacity"] == {"gpu.bcd.dev/memory": {"value": str(card(node.host, 0)["memory_bytes"])}}, devs["gpu-0"]
            assert any("DRAConsumableCapacity" in n for n in dra_status(node)["left_out"])
            assert server.check_pool(DRIVER, NODE) == []
        finally:
            await stop(node)


async def test_a_converger_killed_between_the_daemon_and_the_cdi_spec_leaves_no_daemon(node_bus, tmp_path):
    """kill -9 right after the MPS daemon started (the journal says start-asked): the restarted
    converger stops it, and the kubelet's retry prepares the claim from the start."""
    from shared.runtime import call
    from shared.schemas import CLAIM_PREPARE_REPLY_CODEC, ClaimDevice, ClaimPrepareRequest, ClaimSharing
    from shared.subjects import NodeSubjects

    h = host(tmp_path)
    common = {"BCD_FAKE_HOST": str(h), "BCD_ADAPTER": "fakehw", "BCD_MPS_ROOT": str(tmp_path / "mps")}
    for name in ("signer", "inventory"):
        node_bus.start_service(name, **common)
    for name in ("signer", "inventory"):
        await node_bus.wait_service(name)
    conv = node_bus.start_service("converger", **common, BCD_CONVERGER_CRASH_AT="claim.mps-started")
    await node_bus.wait_service("converger")
    plugin = await node_bus.connect("dra_plugin")
    subjects = NodeSubjects(node_bus.node_id)
    uid = str(uuid.uuid4())
    pci = card(h, 0)["pci_address"]
    req = ClaimPrepareRequest(
        uid=uid, namespace="ml", name="c",
        devices=[ClaimDevice(requests=["gpu"], pool=NODE, device="gpu-0", pci=pci, kind="gpu", sharing=ClaimSharing(strategy="MPS", active_thread_percentage=40))],
    )  # fmt: skip
    with pytest.raises(Exception):  # noqa: B017, PT011 - the converger dies answering: no reply
        await call(plugin, subjects.converger_claim_prepare, req, CLAIM_PREPARE_REPLY_CODEC, timeout=20)
    assert await asyncio.to_thread(conv.wait, 30) == -9, conv.log()[-2000:]
    assert [d["control"].startswith(uid) for d in host_doc(h)["mps_daemons"]] == [True]  # started, never journaled as such
    assert not list((node_bus.root / "cdi").glob("bcd-claim-*.json"))

    node_bus.start_service("converger", **common)
    await node_bus.wait_service("converger")
    stopped = lambda: host_doc(h).get("mps_daemons") == [] and not list((tmp_path / "mps").iterdir())  # noqa: E731
    await asyncio.to_thread(wait_for, stopped, 30, "the daemon nobody owns stopped, its directories gone")
    reply = await call(plugin, subjects.converger_claim_prepare, req, CLAIM_PREPARE_REPLY_CODEC, timeout=60)
    assert reply.ok, reply
    assert [d["active_thread_percentage"] for d in host_doc(h)["mps_daemons"]] == [40]


async def test_a_plugin_restarted_with_mps_claims_prepared_keeps_them(tmp_path, short_dir, api):
    h = host(tmp_path)
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-5" in d, "gpu-5 published")
        mps = [opaque("GpuConfig", ["gpu"], sharing={"strategy": "MPS"})]
        a, b = claim(api, "a", "gpu-5", config=mps, shared=share(60)), claim(api, "b", "gpu-5", config=mps, shared=share(40))
        first = await kubelet.prepare(a, b)
        assert all(r.error == "" for r in first.values()), first
        controls = sorted(d["control"] for d in host_doc(h)["mps_daemons"])
        pid = node.pids()["dra_plugin"]
        os.kill(pid, signal.SIGKILL)
        await asyncio.to_thread(wait_for, lambda: node.pids().get("dra_plugin") not in (None, pid), 60, "the plugin to be restarted")
        await kubelet.register(DRIVER)
        # still prepared, the daemons untouched; the kubelet's retry answers what it answered
        await asyncio.to_thread(wait_for, lambda: len(dra_status(node).get("claims") or []) == 2, 30, "the checkpoint read back")
        assert sorted(d["control"] for d in host_doc(h)["mps_daemons"]) == controls
        again = await kubelet.prepare(a, b)
        assert again == first
        assert "gpu-5" in devices_of(api)
    finally:
        await kubelet.close()
        await stop(node)
