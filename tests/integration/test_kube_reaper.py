"""kube_reaper as a real process on a real node bus, against real protocol peers.

The kubelet is a gRPC server speaking pod-resources v1 (the generated
servicer) on a unix socket; the API server is an HTTP server answering the
Eviction subresource, scripted to throttle (429, Retry-After: 1) and fail
(500) before it evicts; an eviction that succeeds takes the pod off the
kubelet's list. The inventory runs on the fakehw adapter with the example
8 x H200 host; the reaper reads host processes from the same fake host file.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from shared.runtime import ServiceCallError, call
from shared.schemas import (
    EVICT_REPLY_CODEC,
    FREED_CODEC,
    HELD_REPLY_CODEC,
    ORPHAN_REPLY_CODEC,
    DevicesQuery,
    OrphanQuery,
)
from shared.subjects import NodeSubjects

from services.kube_reaper.podresources import FakePodResources, KubeletPodResources
from services.kube_reaper.ports import PodDevice, SourceUnreachable

from .harness import EXAMPLE_HOSTS
from .kube_peers import TOKEN, ApiServer, FakeCluster, KubeletServer

pytestmark = pytest.mark.integration

GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]
# card 6 (GPU[6]) is in MIG mode: gi1/ci0, gi1/ci1, gi5/ci0, gi13/ci0
MIG_1_0 = "MIG-7d3e61b0-0006-4001-8000-000000000001"
MIG_5_0 = "MIG-7d3e61b0-0006-4005-8000-000000000003"
NVIDIA_GPU = "nvidia.com/gpu"
NVIDIA_SHARED = "nvidia.com/gpu.shared"
NVIDIA_MIG = "nvidia.com/mig-3g.71gb"
KUBEPODS_V2 = (
    "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod3c1e7a52_9b0d_4f61_a8e2_5d7c4b1f0a93.slice/"
    "cri-containerd-8f2b6c1d9e3a4f5b.scope"
)
KUBEPODS_V1 = "/kubepods/besteffort/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c0e9d1b2f"


def set_processes(host_file: Path, processes: list[dict]) -> None:
    host = json.loads(host_file.read_text())
    host["processes"] = processes
    tmp = host_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(host))
    os.replace(tmp, host_file)


@pytest.fixture
def host_file(tmp_path):
    path = tmp_path / "host.json"
    path.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
    set_processes(path, [])  # the example's kubepods process would hold card 0
    return path


@pytest.fixture
def cluster():
    return FakeCluster()


@pytest.fixture
def kubelet(cluster, tmp_path):
    server = KubeletServer(cluster, tmp_path / "kubelet.sock").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def apiserver(cluster):
    server = ApiServer(cluster).start()
    try:
        yield server
    finally:
        server.stop()


async def start_reaper(node_bus, host_file, socket: Path, kubeconfig: Path, **env: str):
    node_bus.start_service(
        "inventory", BCD_ADAPTER="fakehw", BCD_FAKE_HOST=str(host_file), BCD_CDI_DIR=str(node_bus.root / "cdi")
    )
    await node_bus.wait_service("inventory")
    sp = node_bus.start_service(
        "kube_reaper",
        BCD_POD_RESOURCES_SOCKET=str(socket),
        BCD_KUBECONFIG=str(kubeconfig),
        BCD_PROCESSES="fake",
        BCD_FAKE_HOST=str(host_file),
        BCD_RECHECK_INTERVAL="0.3",
        BCD_KUBELET_TIMEOUT="2",
        BCD_LOG_FORMAT="text",
        NO_PROXY="127.0.0.1,localhost",
        **env,
    )
    ping = await node_bus.wait_service("kube_reaper")
    # the converger is the reaper's client: it may ask held/evict/orphans and hear freed
    nc = await node_bus.connect("converger")
    return sp, ping, nc


async def subscribe_freed(nc, subjects: NodeSubjects) -> asyncio.Queue:
    freed: asyncio.Queue = asyncio.Queue()

    async def on_freed(msg) -> None:
        freed.put_nowait(FREED_CODEC.decode(msg.data))

    await nc.subscribe(subjects.reaper_freed, cb=on_freed)
    await nc.flush()
    return freed


async def held(nc, node_bus, *devices: str, allocation_id: str = "alloc_q"):
    subjects = NodeSubjects(node_bus.node_id)
    return await call(nc, subjects.reaper_held, DevicesQuery(allocation_id=allocation_id, devices=list(devices)), HELD_REPLY_CODEC, timeout=10)


async def orphans(nc, node_bus, *known: str):
    subjects = NodeSubjects(node_bus.node_id)
    return await call(nc, subjects.reaper_orphans, OrphanQuery(known_devices=list(known)), ORPHAN_REPLY_CODEC, timeout=10)


async def test_held_follows_pods_mig_and_kubepods_processes(node_bus, host_file, cluster, kubelet, apiserver, tmp_path):
    cluster.add("ml", "trainer", NVIDIA_SHARED, f"{GPU[1]}::1")  # a time-sliced replica of card 1
    cluster.add("ml", "mig-job", NVIDIA_MIG, MIG_1_0)  # one MIG device of card 6
    cluster.add("web", "slots", NVIDIA_SHARED, f"{GPU[4]}::2")  # card 4 carries slots
    sp, _, nc = await start_reaper(node_bus, host_file, kubelet.socket, apiserver.write_kubeconfig(tmp_path / "kubeconfig"))

    r = await held(nc, node_bus, GPU[1])
    assert (r.held, r.reachable, r.holders) == (True, True, ["ml/trainer"])
    assert f"{GPU[1]}::1" in r.detail

    r = await held(nc, node_bus, GPU[2], f"{GPU[5]}/slot0")
    assert (r.held, r.reachable, r.holders) == (False, True, [])

    # MIG: the held instance, its sibling, and the whole card
    r = await held(nc, node_bus, f"{GPU[6]}/gi1/ci0")
    assert (r.held, r.holders) == (True, ["ml/mig-job"])
    r = await held(nc, node_bus, f"{GPU[6]}/gi5/ci0")
    assert (r.held, r.reachable, r.holders) == (False, True, [])
    r = await held(nc, node_bus, GPU[6])
    assert (r.held, r.holders) == (True, ["ml/mig-job"])

    # a slot is the whole card for the driver: a replica of the card holds every slot
    r = await held(nc, node_bus, f"{GPU[4]}/slot3")
    assert (r.held, r.holders) == (True, ["web/slots"])

    # host processes: a kubepods one holds its whole card (v2 and v1 paths); a user's does not
    set_processes(
        host_file,
        [
            {"pid": 4242, "gpu_uuid": GPU[3], "cgroup": KUBEPODS_V2},
            {"pid": 4343, "gpu_uuid": GPU[7], "cgroup": KUBEPODS_V1},
            {"pid": 5151, "gpu_uuid": GPU[2], "cgroup": "/user.slice/user-1000.slice/session-4.scope"},
        ],
    )
    r = await held(nc, node_bus, GPU[3])
    assert (r.held, r.reachable) == (True, True)
    assert r.holders == ["pid 4242 (pod uid 3c1e7a52-9b0d-4f61-a8e2-5d7c4b1f0a93)"]
    r = await held(nc, node_bus, f"{GPU[7]}/gi1/ci0")
    assert r.held and r.holders == ["pid 4343 (pod uid 0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f)"]
    r = await held(nc, node_bus, GPU[2])
    assert (r.held, r.holders) == (False, [])

    # orphans: every pod-held device of a node GPU outside the known atoms
    o = await orphans(nc, node_bus)
    assert o.reachable
    assert o.orphans == sorted(
        [
            f"ml/trainer: {GPU[1]}::1",
            f"ml/mig-job: {MIG_1_0}",
            f"web/slots: {GPU[4]}::2",
            f"pid 4242 (pod uid 3c1e7a52-9b0d-4f61-a8e2-5d7c4b1f0a93): {GPU[3]}",
            f"pid 4343 (pod uid 0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f): {GPU[7]}",
        ]
    )
    o = await orphans(nc, node_bus, GPU[1], f"{GPU[6]}/gi1/ci0", f"{GPU[4]}/slot0", GPU[3], GPU[7])
    assert (o.reachable, o.orphans) == (True, [])
    # a sibling MIG atom does not cover the held instance
    o = await orphans(nc, node_bus, GPU[1], f"{GPU[6]}/gi5/ci0", f"{GPU[4]}/slot0", GPU[3], GPU[7])
    assert o.orphans == [f"ml/mig-job: {MIG_1_0}"]

    # bad requests are answered 400 with the field named; the service lives on
    subjects = NodeSubjects(node_bus.node_id)
    with pytest.raises(ServiceCallError) as err:
        await held(nc, node_bus, GPU[1], "not-an-atom")
    assert err.value.code == "400" and "$.devices[1]" in err.value.description
    with pytest.raises(ServiceCallError) as err:
        await call(nc, subjects.reaper_held, b'{"allocation_id": "a", "devices": [1', HELD_REPLY_CODEC)
    assert err.value.code == "400"
    with pytest.raises(ServiceCallError) as err:
        await orphans(nc, node_bus, f"{GPU[6]}/gi1")
    assert err.value.code == "400" and "$.known_devices[0]" in err.value.description
    assert (await held(nc, node_bus, GPU[1])).held

    assert sp.stop() == 0
    log = sp.log()
    assert "Traceback" not in log


async def test_unreachable_kubelet_counts_as_held_and_recovers(node_bus, host_file, cluster, apiserver, tmp_path):
    socket = tmp_path / "kubelet.sock"  # no kubelet yet
    sp, _, nc = await start_reaper(node_bus, host_file, socket, apiserver.write_kubeconfig(tmp_path / "kubeconfig"))

    r = await held(nc, node_bus, GPU[2])
    assert (r.held, r.reachable) == (True, False)
    assert str(socket) in r.detail and "kubelet unreachable" in r.detail
    assert (await orphans(nc, node_bus)).reachable is False

    # a withdrawn allocation stays watched (never freed) while the kubelet is away
    subjects = NodeSubjects(node_bus.node_id)
    freed = await subscribe_freed(nc, subjects)
    reply = await call(nc, subjects.reaper_evict, DevicesQuery(allocation_id="alloc_away", devices=[GPU[2]]), EVICT_REPLY_CODEC, timeout=10)
    assert reply.evicting == [] and any("kubelet unreachable" in e for e in reply.errors)
    await asyncio.sleep(1.0)
    assert freed.empty()

    # the kubelet comes (back): answers are reachable at once, and the watch frees
    server = KubeletServer(cluster, socket).start()
    try:
        r = await held(nc, node_bus, GPU[2])
        assert (r.held, r.reachable) == (False, True)
        got = await asyncio.wait_for(freed.get(), 10)
        assert got.allocation_id == "alloc_away"
    finally:
        server.stop()

    # the socket gone again: held, unreachable
    r = await held(nc, node_bus, GPU[2])
    assert (r.held, r.reachable) == (True, False)

    assert sp.stop() == 0
    log = sp.log()
    assert "Traceback" not in log
    assert "WARNING" in log and "counting them as held" in log


async def test_evict_retries_through_429_and_500_then_frees_once(node_bus, host_file, cluster, kubelet, apiserver, tmp_path):
    cluster.add("ml", "trainer", NVIDIA_GPU, GPU[1])
    cluster.add("ml", "bystander", NVIDIA_GPU, GPU[2])
    cluster.script = [429, 429, 500]
    sp, ping, nc = await start_reaper(node_bus, host_file, kubelet.socket, apiserver.write_kubeconfig(tmp_path / "kubeconfig"))
    subjects = NodeSubjects(node_bus.node_id)
    freed = await subscribe_freed(nc, subjects)

    started = time.monotonic()
    reply = await call(nc, subjects.reaper_evict, DevicesQuery(allocation_id="alloc_k8s", devices=[GPU[1]]), EVICT_REPLY_CODEC, timeout=10)
    assert reply.evicting == ["ml/trainer"] and reply.errors == []

    got = await asyncio.wait_for(freed.get(), 20)
    assert got.allocation_id == "alloc_k8s" and got.devices == [GPU[1]]
    assert time.monotonic() - started >= 2.0  # two Retry-After: 1 were honoured

    attempts = cluster.evictions_of("ml", "trainer")
    assert [a.status for a in attempts] == [429, 429, 500, 201]
    gaps = [b.at - a.at for a, b in zip(attempts, attempts[1:])]
    assert gaps[0] >= 0.9 and gaps[1] >= 0.9  # Retry-After
    assert gaps[2] >= 0.2  # backoff after the 500
    for a in attempts:
        assert a.body["kind"] == "Eviction" and a.body["apiVersion"] == "policy/v1"
        assert a.body["metadata"] == {"name": "trainer", "namespace": "ml"}
        assert a.authorization == f"Bearer {TOKEN}"
    assert cluster.evictions_of("ml", "bystander") == []
    assert ("ml", "trainer") not in cluster.pods and ("ml", "bystander") in cluster.pods

    # exactly once: later rechecks publish nothing more
    await asyncio.sleep(1.2)
    assert freed.empty()
    assert (await held(nc, node_bus, GPU[1])).held is False

    # an allocation nothing holds is freed at the next look
    reply = await call(nc, subjects.reaper_evict, DevicesQuery(allocation_id="alloc_idle", devices=[f"{GPU[6]}/gi5/ci0"]), EVICT_REPLY_CODEC, timeout=10)
    assert reply.evicting == [] and reply.errors == []
    got = await asyncio.wait_for(freed.get(), 10)
    assert got.allocation_id == "alloc_idle"

    metrics = urllib.request.urlopen(f"http://{ping['metadata']['metrics']}/metrics", timeout=5).read().decode()  # noqa: S310
    assert 'bcd_reaper_evictions_total{outcome="throttled"} 2.0' in metrics
    assert 'bcd_reaper_evictions_total{outcome="server_error"} 1.0' in metrics
    assert 'bcd_reaper_evictions_total{outcome="evicted"} 1.0' in metrics
    assert "bcd_reaper_watched_allocations 0.0" in metrics
    assert "bcd_reaper_kubelet_reachable 1.0" in metrics

    sp.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(sp.wait, 15) == 0
    assert "Traceback" not in sp.log()


async def test_pod_resources_backends_pass_the_same_contract(cluster, tmp_path):
    """The gRPC backend against a real server and the fake: same devices, same failure."""
    cluster.add("ml", "trainer", NVIDIA_SHARED, f"{GPU[1]}::0", f"{GPU[1]}::1")
    cluster.add("ml", "trainer", NVIDIA_MIG, MIG_5_0, container="sidecar")
    expected = [
        PodDevice("ml", "trainer", "main", NVIDIA_SHARED, f"{GPU[1]}::0"),
        PodDevice("ml", "trainer", "main", NVIDIA_SHARED, f"{GPU[1]}::1"),
        PodDevice("ml", "trainer", "sidecar", NVIDIA_MIG, MIG_5_0),
    ]
    socket = tmp_path / "kubelet.sock"
    real = KubeletPodResources(socket, timeout=2)
    fake = FakePodResources(expected)

    server = KubeletServer(cluster, socket).start()
    try:
        assert await real.list_devices() == await fake.list_devices() == expected
    finally:
        server.stop()

    fake.unreachable = "kubelet gone"
    for backend in (real, fake):
        with pytest.raises(SourceUnreachable):
            await backend.list_devices()
