"""The device plugin end to end: a whole node (`bcd up` on a fake host) and a kubelet stand-in
on the official device plugin protos (v1beta1), with the pod-resources and Eviction API peers.

Pods use Kubernetes holds: the plugin registers one resource per atom kind,
advertises exactly the atoms of live BINDING_KUBERNETES holds with NUMA
topology, answers Allocate with the CDI names bcd wrote (a pod stand-in
resolves them in the specs on disk) and the hold's env, refuses what is not
advertised; a withdrawn hold leaves ListAndWatch before the first eviction
request, and comes back when the spec takes it back. A kubelet restart, a
kill -9 of the plugin and a plugin that does not answer at all are survived.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.device_plugin.proto import HEALTHY
from shared.holdfiles import device_name

from .harness import EXAMPLE_HOSTS
from .kube_peers import ApiServer, FakeCluster, KubeletServer
from .kubelet_standin import run_pod
from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RES = "bcd.dev/gpu"
HOST = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
MIG = f"{GPU[7]}/gi9/ci0"  # a 1g.18gb instance of card 7 (NUMA node 1)


def kube(alloc: str, *devices: str) -> dict:
    return {**assignment(alloc, *devices), "binding": "BINDING_KUBERNETES", "env": ["TEAM=ml"]}


@pytest.fixture
def peers(short_dir: Path, tmp_path: Path) -> Iterator[tuple[FakeCluster, Path, Path]]:
    cluster = FakeCluster()
    socket = short_dir / "pod-resources.sock"
    server = KubeletServer(cluster, socket).start()
    api = ApiServer(cluster).start()
    try:
        yield cluster, socket, api.write_kubeconfig(tmp_path / "kubeconfig")
    finally:
        api.stop()
        server.stop()


async def start_node(tmp_path: Path, short_dir: Path, peers) -> Node:
    _, socket, kubeconfig = peers
    host = tmp_path / "host.json"
    host.write_text(json.dumps({**HOST, "processes": []}))  # the example's kubepods process would hold card 0
    node = Node(tmp_path, "--kubelet-dir", str(short_dir), "--pod-resources-socket", str(socket), "--kubeconfig", str(kubeconfig), host=host)
    return await asyncio.to_thread(node.start)


async def apply(node: Node, *devices: dict) -> None:
    gen = await asyncio.to_thread(node.apply, {"node_id": "node-1", "devices": list(devices)})
    await asyncio.to_thread(node.wait_generation, gen)


async def stop(node: Node) -> None:
    await asyncio.to_thread(node.stop)


def metrics(node: Node) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    addr = node.ping()["device_plugin"]["metadata"]["metrics"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def healthy(devices: dict) -> set[str]:
    return {i for i, d in devices.items() if d.health == HEALTHY}


async def test_pods_get_the_devices_of_kubernetes_holds_and_lose_them_before_any_eviction(tmp_path, short_dir, kubelet, peers):
    cluster, _, _ = peers
    node = await start_node(tmp_path, short_dir, peers)
    try:
        await apply(node, kube("k1", GPU[0]), kube("k2", GPU[4], GPU[5]), kube("km", MIG), assignment("plain", GPU[3]))

        # the PING metadata names the MIG resources as their pattern (issue 41: it said `bcd.dev/mig-.profile.`)
        assert node.ping()["device_plugin"]["metadata"]["resources"] == "bcd.dev/gpu,bcd.dev/mig-{profile},bcd.dev/gpu-slot"
        # one registration per atom kind; exactly the atoms of the Kubernetes holds, with NUMA nodes
        await kubelet.wait_registered(RES)
        devices = await kubelet.wait_devices(RES, lambda d: set(d) == {GPU[0], GPU[4], GPU[5]})
        assert healthy(devices) == {GPU[0], GPU[4], GPU[5]}
        assert {i: [n.ID for n in d.topology.nodes] for i, d in devices.items()} == {GPU[0]: [0], GPU[4]: [1], GPU[5]: [1]}
        mig = await kubelet.wait_devices("bcd.dev/mig-1g.18gb", lambda d: set(d) == {device_name(MIG)})
        assert healthy(mig) == {device_name(MIG)}
        await kubelet.wait_registered("bcd.dev/gpu-slot")
        assert kubelet.resource("bcd.dev/gpu-slot").devices == {}
        view = kubelet.resource(RES)
        assert view.options.get_preferred_allocation_available and not view.options.pre_start_required

        # the kubelet prefers the hold that fits; Allocate answers bcd's CDI names and the hold's env
        assert await kubelet.preferred(RES, [GPU[0], GPU[4], GPU[5]], [], 2) == [GPU[4], GPU[5]]
        response = await kubelet.allocate(RES, [[GPU[4], GPU[5]]])
        container = response.container_responses[0]
        assert [c.name for c in container.cdi_devices] == [f"bcd.dev/gpu={GPU[4]}", f"bcd.dev/gpu={GPU[5]}"]
        assert dict(container.envs) == {
            "BCD_ALLOCATION_ID": "k2",
            "BCD_RESERVATION_ID": "rsv-k2",
            "NVIDIA_VISIBLE_DEVICES": f"{GPU[4]},{GPU[5]}",
            "TEAM": "ml",
        }
        pod = run_pod(node.state / "cdi", container)
        assert pod.device_ids == [GPU[4], GPU[5]] and pod.spec_files == ["bcd-k2.json", "bcd-k2.json"]
        assert pod.env["BCD_ALLOCATION_ID"] == "k2" and pod.env["TEAM"] == "ml"
        one = (await kubelet.allocate(RES, [[GPU[5]]])).container_responses[0]
        assert one.envs["NVIDIA_VISIBLE_DEVICES"] == GPU[5]
        mig_pod = run_pod(node.state / "cdi", (await kubelet.allocate("bcd.dev/mig-1g.18gb", [[device_name(MIG)]])).container_responses[0])
        assert mig_pod.device_ids == [MIG]
        # what is not advertised is refused: a plain hold's card, a device of another resource
        for resource, ids in ((RES, [GPU[3]]), (RES, [device_name(MIG)]), ("bcd.dev/mig-1g.18gb", [GPU[0]])):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await kubelet.allocate(resource, [ids])
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not advertised" in refused.value.details()

        status = await asyncio.to_thread(bcd, "status", "--state-dir", str(node.state))
        assert "device plugin: registered with the kubelet" in status.stdout, status.stdout
        assert f"kubelet: advertised as {RES} (1 device(s))" in status.stdout, status.stdout
        as_json = await asyncio.to_thread(bcd, "status", "--state-dir", str(node.state), "--json")
        dp = json.loads(as_json.stdout)["device_plugin"]
        assert dp["registered"] and {h["allocation_id"]: h["advertised"] for h in dp["holds"]} == {"k1": True, "k2": True, "km": True}

        m = await asyncio.to_thread(metrics, node)
        assert m[("bcd_device_plugin_registered", (("resource", RES),))] == 1
        assert m[("bcd_device_plugin_advertised_devices", (("health", "healthy"), ("resource", RES)))] == 3
        assert m[("bcd_device_plugin_advertised_devices", (("health", "unhealthy"), ("resource", RES)))] == 0
        assert m[("bcd_device_plugin_allocations_total", (("outcome", "ok"), ("resource", RES)))] == 2
        assert m[("bcd_device_plugin_allocations_total", (("outcome", "refused"), ("resource", RES)))] == 2
        assert m[("bcd_device_plugin_registrations_total", (("outcome", "ok"), ("resource", RES)))] == 1
        assert m[("bcd_device_plugin_kubernetes_holds", ())] == 3

        # a pod holds k1's card and its eviction is throttled: the release stays pending
        cluster.add("team-a", "trainer-0", RES, GPU[0])
        cluster.script = [429] * 1000
        before = len(view.updates)
        await asyncio.to_thread(node.apply, {"node_id": "node-1", "devices": [kube("k2", GPU[4], GPU[5]), kube("km", MIG), assignment("plain", GPU[3])]})
        await asyncio.to_thread(wait_for, lambda: cluster.evictions_of("team-a", "trainer-0"), 60, "an eviction request")
        first_eviction = cluster.evictions_of("team-a", "trainer-0")[0].at
        gone_at = next(t for u, t in zip(view.updates[before:], view.update_times[before:]) if GPU[0] not in {d.ID for d in u})
        assert gone_at < first_eviction, "the kubelet still advertised the card when the pod was evicted"
        with pytest.raises(grpc.aio.AioRpcError):
            await kubelet.allocate(RES, [[GPU[0]]])
        assert set(kubelet.resource(RES).devices) == {GPU[4], GPU[5]}

        # the spec takes k1 back (its release dropped unreported): the card is advertised again
        await apply(node, kube("k1", GPU[0]), kube("k2", GPU[4], GPU[5]), kube("km", MIG), assignment("plain", GPU[3]))
        await kubelet.wait_devices(RES, lambda d: set(d) == {GPU[0], GPU[4], GPU[5]})
        assert not [e for e in applied(node, "released") if e.allocation_id == "k1"]
        again = (await kubelet.allocate(RES, [[GPU[0]]])).container_responses[0]
        assert run_pod(node.state / "cdi", again).device_ids == [GPU[0]]
    finally:
        await stop(node)


async def test_kubelet_restart_plugin_kill_and_a_plugin_that_does_not_answer(tmp_path, short_dir, kubelet, peers):
    node = await start_node(tmp_path, short_dir, peers)
    try:
        await apply(node, kube("k1", GPU[0]))
        await kubelet.wait_registered(RES)
        await kubelet.wait_devices(RES, lambda d: set(d) == {GPU[0]})

        # the kubelet restarts: every socket in device-plugins/ deleted, a new kubelet.sock
        await kubelet.restart()
        assert not (short_dir / "device-plugins" / "bcd-gpu.sock").exists()
        await kubelet.wait_registered(RES, count=2, timeout=20)
        await kubelet.wait_devices(RES, lambda d: set(d) == {GPU[0]})
        assert (short_dir / "device-plugins" / "bcd-gpu.sock").exists()

        # kill -9 of the plugin: the supervisor restarts it; it registers again from the holds on disk
        pid = (await asyncio.to_thread(node.pids))["device_plugin"]
        os.kill(pid, signal.SIGKILL)
        await kubelet.wait_registered(RES, count=3, timeout=30)
        await kubelet.wait_devices(RES, lambda d: set(d) == {GPU[0]} and healthy(d) == {GPU[0]}, timeout=20)
        assert (await asyncio.to_thread(node.pids))["device_plugin"] != pid

        # a plugin that answers nothing (stopped): the converger still releases and binds
        pid = (await asyncio.to_thread(node.pids))["device_plugin"]
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            await apply(node, kube("k2", GPU[1]))
            await asyncio.to_thread(wait_for, lambda: [e for e in applied(node, "released") if e.allocation_id == "k1"], 60, "k1 released")
            assert [e.allocation_id for e in applied(node, "bound")] == ["k1", "k2"]
            assert time.monotonic() - started < 45
        finally:
            os.kill(pid, signal.SIGCONT)
        await kubelet.wait_devices(RES, lambda d: set(d) == {GPU[1]}, timeout=20)
    finally:
        await stop(node)
