"""Kubernetes holds end to end: a real kubelet peer (pod-resources v1 gRPC on a
unix socket), a real Eviction API peer (HTTP), and the whole node.

Through the upstream contract: a Kubernetes hold is bound; released while a
pod holds its GPU (pending, devices claimed, a new hold on them refused with
overlap); the pod is evicted; the release is reported once. And kill -9 of
the converger in the middle of a split release loses no release.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.converger.crash import KUBE_POINTS
from shared.runtime import call
from shared.schemas import ATTESTED_REPORT_CODEC, SIGNER_KEY_CODEC, SPEC_ACK_CODEC, DeviceAssignment, Empty, NodeSpec
from shared.signing import verify_report
from shared.subjects import MSG_ID_HEADER, NodeSubjects

from .harness import EXAMPLE_HOSTS
from .kube_peers import ApiServer, FakeCluster, KubeletServer
from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture
def peers(tmp_path):
    cluster = FakeCluster()
    kubelet = KubeletServer(cluster, tmp_path / "kubelet.sock").start()
    api = ApiServer(cluster).start()
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    try:
        yield cluster, tmp_path / "kubelet.sock", kubeconfig
    finally:
        api.stop()
        kubelet.stop()


def kube(alloc: str, *devices: str) -> dict:
    return {**assignment(alloc, *devices), "binding": "BINDING_KUBERNETES"}


def test_a_kubernetes_release_waits_for_the_pod_then_is_reported_once(tmp_path, peers):
    cluster, socket, kubeconfig = peers
    host = tmp_path / "host.json"
    data = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
    data["processes"] = []  # the example's kubepods process would hold card 0 for good
    host.write_text(json.dumps(data))
    node = Node(tmp_path, "--pod-resources-socket", str(socket), "--kubeconfig", str(kubeconfig), host=host).start()
    try:
        gen1 = node.apply({"node_id": "node-1", "devices": [kube("k1", GPU[0])]})
        node.wait_generation(gen1)
        cdi = json.loads((node.state / "cdi" / "bcd-k1.json").read_text())
        assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in cdi["containerEdits"]["env"])
        assert f"NVIDIA_VISIBLE_DEVICES={GPU[0]}" in (node.state / "run" / "allocations" / "k1.env").read_text()
        assert [e.allocation_id for e in applied(node, "bound")] == ["k1"]
        hello = node.cp_state().nodes["node-1"]
        assert hello.boot_ids

        # a pod holds the GPU; the eviction API throttles twice before it evicts
        cluster.add("team-a", "trainer-0", "nvidia.com/gpu", GPU[0])
        cluster.script = [429, 429]

        gen2 = node.apply({"node_id": "node-1", "devices": [assignment("plain", GPU[0])]})
        # withdrawn at once, recorded, and the GPU still claimed by the pending release
        wait_for(lambda: not (node.state / "cdi" / "bcd-k1.json").exists(), 30, "k1 withdrawn")
        failed = wait_for(lambda: [e for e in applied(node, "failed") if e.allocation_id == "plain"], 30, "plain refused")
        assert failed[0].event["reason"] == "overlap" and "pending Kubernetes release" in failed[0].event["message"]
        # ...until the pod is evicted; then Released, exactly once
        wait_for(lambda: [e for e in applied(node, "released") if e.allocation_id == "k1"], 60, "k1 released")
        assert cluster.evictions_of("team-a", "trainer-0")
        released = [e for e in node.events() if e.type == "released"]
        assert len([e for e in released if e.outcome == "applied"]) == 1 and released[0].verified
        assert json.loads((node.state / "data" / "releasing.json").read_text())["releases"] == {}
        assert node.cp_state().reservations["rsv-k1"].state == "released"

        # the GPU is free now: the next generation binds it
        gen3 = node.apply({"node_id": "node-1", "devices": [assignment("plain", GPU[0])]})
        node.wait_generation(gen3)
        assert node.holds() == {"plain"}
        assert gen2 < gen3

        # an unreadable releases file while a pod holds a GPU of no allocation this node
        # knows: every GPU stays claimed until an operator clears the marker
        cluster.add("team-b", "stray-0", "nvidia.com/gpu", GPU[5])
        (node.state / "data" / "releasing.json").write_text("{garbage")
        gen4 = node.apply({"node_id": "node-1", "devices": [assignment("plain", GPU[0]), assignment("more", GPU[1])]})
        node.wait_generation(gen4)
        assert node.holds() == {"plain"}
        more = [e for e in applied(node, "failed") if e.allocation_id == "more"]
        assert more and "could not be read" in more[-1].event["message"]
        assert (node.state / "data" / "releasing.unreadable").exists()
        assert list((node.state / "data").glob("releasing.json.unreadable-*"))
        wait_for(lambda: (node.cp_state().nodes["node-1"].conditions.get("KubernetesReleasesUnreadable") or None), 30, "condition raised")
        listed = bcd("releases", "--state-dir", str(node.state))
        assert listed.returncode == 1 and "UNREADABLE" in listed.stdout
        cleared = bcd("releases", "--state-dir", str(node.state), "--clear-unreadable")
        assert cleared.returncode == 0, cleared.stderr
        gen5 = node.apply({"node_id": "node-1", "devices": [assignment("plain", GPU[0]), assignment("more2", GPU[1])]})
        node.wait_generation(gen5)
        assert node.holds() == {"plain", "more2"}
        wait_for(lambda: node.cp_state().nodes["node-1"].conditions["KubernetesReleasesUnreadable"].status == "False", 30, "condition cleared")
    finally:
        node.stop()


@pytest.mark.parametrize("point", KUBE_POINTS)
async def test_kill_9_of_the_converger_during_a_split_release_loses_nothing(node_bus, tmp_path, point, peers):
    """Killed between record and withdraw, between withdraw and report, or right after the report."""
    cluster, socket, _ = peers
    host = tmp_path / "host.json"
    data = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
    data["processes"] = []
    host.write_text(json.dumps(data))
    common = {"BCD_FAKE_HOST": str(host), "BCD_ADAPTER": "fakehw"}
    node_bus.start_service("signer", **common)
    node_bus.start_service("inventory", **common)
    node_bus.start_service(
        "kube_reaper", **common, BCD_POD_RESOURCES_SOCKET=str(socket), BCD_EVICTOR="none", BCD_PROCESSES="fake", BCD_RECHECK_INTERVAL="0.3"
    )
    for name in ("signer", "inventory", "kube_reaper"):
        await node_bus.wait_service(name)
    fast = {**common, "BCD_RETRY_INTERVAL": "0.5"}
    conv = node_bus.start_service("converger", **fast)
    await node_bus.wait_service("converger")
    subjects = NodeSubjects(node_bus.node_id)
    bridge = await node_bus.connect("gateway_bridge")
    admin = await node_bus.connect("admin")  # the store account: the outbox as it is
    cli = await node_bus.connect("cli")
    gen1 = NodeSpec(node_id="node-1", generation=1, devices=[DeviceAssignment(allocation_id="k1", reservation_id="rsv-k1", binding="BINDING_KUBERNETES", devices=[GPU[0]])])
    await call(bridge, subjects.converger_spec, node_bus.signed_spec(gen1), SPEC_ACK_CODEC)
    cdi = node_bus.root / "cdi" / "bcd-k1.json"
    for _ in range(100):
        if cdi.exists():
            break
        await asyncio.sleep(0.1)
    assert conv.stop() == 0

    # a pod holds the GPU while the release starts; it goes away later
    cluster.add("team-a", "trainer-0", "nvidia.com/gpu", GPU[0])
    conv = node_bus.start_service("converger", **fast, BCD_CONVERGER_CRASH_AT=point)
    await node_bus.wait_service("converger")
    await call(bridge, subjects.converger_spec, node_bus.signed_spec(NodeSpec(node_id="node-1", generation=2)), SPEC_ACK_CODEC)
    if point == "kube.published":
        await asyncio.sleep(1.0)
        cluster.remove("team-a", "trainer-0")
    code = await asyncio.to_thread(conv.wait, 60)
    assert code == -9, conv.log()[-2000:]

    cluster.remove("team-a", "trainer-0")
    node_bus.start_service("converger", **fast)
    await node_bus.wait_service("converger")

    key = (await call(cli, subjects.signer_key, Empty(), SIGNER_KEY_CODEC)).public_key
    js = admin.jetstream()

    async def released() -> list:
        info = await js.stream_info(subjects.outbox_stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg(subjects.outbox_stream, seq)
            except Exception:  # noqa: BLE001 - deleted
                continue
            if msg.subject.endswith(".released"):
                out.append((msg.headers[MSG_ID_HEADER], verify_report(ATTESTED_REPORT_CODEC.decode(msg.data), key)))
        return out

    deadline = time.monotonic() + 30
    got: list = []
    while time.monotonic() < deadline:
        got = await released()
        if got:
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)  # any duplicate would land by now
    got = await released()
    assert [(i, b.event.allocation_id) for i, b in got] == [("node-1.k1.released.g2", "k1")]
    assert not cdi.exists() and not (node_bus.root / "run" / "allocations" / "k1.env").exists()
    assert json.loads((node_bus.root / "data" / "releasing.json").read_text())["releases"] == {}

