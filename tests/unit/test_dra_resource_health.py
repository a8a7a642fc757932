"""Device health to the kubelet (KEP 4680, services/dra_plugin/health.py): the generated code of both
official dra-health protos; which devices are reported with which health (every device of a sick
card, MIG placements and a shared card included, and a prepared device of a card no longer
published); messages held to 1024; both services over a real unix socket with the stand-in
kubelet's client (the full list at connect, a change at once, the list again before the kubelet's
30-s timeout, a reconnect served again); the plugin advertising both at registration and feeding
the streams from its refresh."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from services.dra_plugin import health as hl
from services.dra_plugin.checkpoint import CheckpointStore, ClaimEntry
from services.dra_plugin.devices import plan_pool
from services.dra_plugin.plugin import Calls, DraPlugin
from services.dra_plugin.proto import dra_health_v1_pb2 as v1
from services.dra_plugin.proto import dra_health_v1alpha1_pb2 as v1alpha1
from shared.schemas import PreparedDevice
from tests.integration.dra_kubelet_standin import HEALTH_V1, HEALTH_V1ALPHA1, DraKubelet, HealthWatch

from .test_dra_devices import FREE, NODE, card, inventory, pci
from .test_dra_health import SINCE, XID79, Host, _never, healthy, with_health

OK = healthy("True", "Checked", "no fatal XID")
UNMONITORED = healthy("Unknown", "Unmonitored", "events cannot be registered")


def test_the_generated_code_speaks_both_health_apis() -> None:
    for pb, package in ((v1alpha1, "v1alpha1"), (v1, "v1")):
        assert pb.DESCRIPTOR.package == package
        svc = pb.DESCRIPTOR.services_by_name["DRAResourceHealth"]
        (method,) = svc.methods
        assert (method.name, method.server_streaming, method.client_streaming) == ("NodeWatchResources", True, False)
        assert {v.name: v.number for v in pb.HealthStatus.DESCRIPTOR.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
        assert {f.name: f.number for f in pb.DeviceHealth.DESCRIPTOR.fields} == {
            "device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4, "message": 5,
        }
        assert {f.name: f.number for f in pb.DeviceIdentifier.DESCRIPTOR.fields} == {"pool_name": 1, "device_name": 2}
    # what the plugin advertises is exactly each service's full name (the kubelet's TestServiceNameConstants)
    assert hl.HEALTH_SERVICES == (
        v1alpha1.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name,
        v1.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name,
    ) == (HEALTH_V1ALPHA1, HEALTH_V1)


def test_every_device_of_a_sick_card_is_unhealthy_and_the_rest_say_their_card_s_health() -> None:
    inv = inventory(
        with_health(card(0, mig=True), OK),
        with_health(card(1), XID79),
        with_health(card(2), UNMONITORED),
        card(3),  # an inventory that does not watch health: no condition
    )
    pool = plan_pool(inv, FREE, shared_cards=True, device_taints=True)
    got = {d.device: d for d in hl.plan_health(inv, pool, [], pool_name=NODE)}
    assert set(got) == {d.name for d in pool.devices} and all(d.pool == NODE for d in got.values())
    mig0 = [n for n in got if n.startswith("gpu-0-mig-")]
    assert len(mig0) > 1 and all(got[n].health == "HEALTHY" for n in ["gpu-0", *mig0])
    # gpu-1 is published shared (every share of it is this device) and tainted: unhealthy, the XID said
    assert pool.device("gpu-1").shared and got["gpu-1"].health == "UNHEALTHY"
    assert got["gpu-1"].message == f"gpu-1 ({pci(1)}) Healthy=False XidCritical: {XID79.message}"
    assert got["gpu-2"].health == "UNKNOWN" and "Unmonitored" in got["gpu-2"].message
    assert got["gpu-3"].health == "UNKNOWN" and "does not watch" in got["gpu-3"].message

    # a sick MIG card: the whole card and every placement
    inv = inventory(with_health(card(0, mig=True), XID79))
    pool = plan_pool(inv, FREE, device_taints=True)
    got = hl.plan_health(inv, pool, [], pool_name=NODE)
    assert len(got) == len(pool.devices) > 1 and {d.health for d in got} == {"UNHEALTHY"}


def test_a_prepared_device_of_a_card_no_longer_published_is_reported_by_its_atom() -> None:
    sick = with_health(card(1), XID79)
    inv = inventory(with_health(card(0), OK), sick)
    pool = plan_pool(inv, FREE, device_taints=False)  # taints off: the sick card is withdrawn
    assert pool.device("gpu-1") is None
    prepared = [
        PreparedDevice(pool=NODE, device="gpu-1", atom=sick.atom_id),
        PreparedDevice(pool=NODE, device="gpu-1-mig-1g-18gb-3", atom=f"{sick.atom_id}/gi3/ci0"),
        PreparedDevice(pool=NODE, device="gpu-0", atom=inv.gpus[0].atom_id),  # also in the pool: once
        PreparedDevice(pool=NODE, device="gpu-9", atom="GPU-gone"),
    ]
    got = {d.device: d for d in hl.plan_health(inv, pool, prepared, pool_name=NODE)}
    assert set(got) == {"gpu-0", "gpu-1", "gpu-1-mig-1g-18gb-3", "gpu-9"}
    assert got["gpu-0"].health == "HEALTHY"
    assert got["gpu-1"].health == got["gpu-1-mig-1g-18gb-3"].health == "UNHEALTHY"
    assert got["gpu-9"].health == "UNKNOWN" and "not in the node's inventory" in got["gpu-9"].message


def test_messages_are_held_to_1024_as_the_api_says() -> None:
    assert hl.clip_message("x" * 1024) == "x" * 1024
    assert hl.clip_message("x" * 1025) == "x" * 1021 + "..."
    two_bytes = hl.clip_message("é" * 600)  # 1200 bytes of UTF-8
    assert len(two_bytes.encode()) <= 1024 and two_bytes.endswith("...") and set(two_bytes[:-3]) == {"é"}
    long = with_health(card(0), healthy("False", "XidCritical", "XID 79 " + "y" * 5000))
    status, message = hl.card_health(long, "gpu-0")
    assert status == "UNHEALTHY" and len(message.encode()) <= 1024 and message.endswith("...")


async def _serve(sock: Path, feed: hl.HealthFeed) -> grpc.aio.Server:
    server = grpc.aio.server()
    hl.add_health_servicers(server, feed)
    assert server.add_insecure_port(f"unix://{sock}") != 0
    await server.start()
    return server


def _health(update: dict) -> dict[str, str]:
    return {dev: h for (_, dev), (h, _, _) in update.items()}


async def test_both_services_stream_the_list_at_connect_each_change_and_again_before_the_kubelet_s_timeout(tmp_path: Path) -> None:
    feed = hl.HealthFeed(resend_s=0.5)
    inv = inventory(with_health(card(0), OK), with_health(card(1), OK))
    feed.update(hl.plan_health(inv, plan_pool(inv, FREE), [], pool_name=NODE))
    server = await _serve(tmp_path / "dra.sock", feed)
    watches = [HealthWatch(str(tmp_path / "dra.sock"), s) for s in (HEALTH_V1ALPHA1, HEALTH_V1)]
    try:
        for w in watches:
            first = await w.wait(lambda u: True, "the first message", timeout=5)
            assert _health(first) == {"gpu-0": "HEALTHY", "gpu-1": "HEALTHY"}
            assert {pool for pool, _ in first} == {NODE} and all(t > 0 for _, _, t in first.values())
        assert feed.streams == 2

        sick = inventory(with_health(card(0), OK), with_health(card(1), XID79))
        loop = asyncio.get_running_loop()
        at = loop.time()
        assert feed.update(hl.plan_health(sick, plan_pool(sick, FREE, device_taints=True), [], pool_name=NODE))
        for w in watches:
            got = await w.wait(lambda u: _health(u).get("gpu-1") == "UNHEALTHY", "gpu-1 unhealthy", timeout=5)
            assert _health(got) == {"gpu-0": "HEALTHY", "gpu-1": "UNHEALTHY"} and "XID 79" in got[(NODE, "gpu-1")][1]
        assert loop.time() - at < 0.4, "sent at the change, not at the next resend"

        # nothing changes: the full list comes again anyway (the kubelet reads Unknown after 30 s of silence)
        for w in watches:
            n = len(w.updates)
            again = await w.wait(lambda u, n=n, w=w: len(w.updates) > n, "a resend", timeout=5)
            assert _health(again) == {"gpu-0": "HEALTHY", "gpu-1": "UNHEALTHY"}

        # a kubelet that reconnects (restarted) gets the full list at once
        await watches[1].close()
        watches[1] = HealthWatch(str(tmp_path / "dra.sock"), HEALTH_V1)
        back = await watches[1].wait(lambda u: True, "the first message after a reconnect", timeout=5)
        assert _health(back) == {"gpu-0": "HEALTHY", "gpu-1": "UNHEALTHY"}
    finally:
        for w in watches:
            await w.close()
        await server.stop(0)
    await asyncio.sleep(0.1)
    assert feed.streams == 0


async def test_nothing_is_sent_before_the_pool_is_known(tmp_path: Path) -> None:
    feed = hl.HealthFeed(resend_s=0.2)
    server = await _serve(tmp_path / "dra.sock", feed)
    w = HealthWatch(str(tmp_path / "dra.sock"), HEALTH_V1)
    try:
        await asyncio.sleep(0.5)
        assert w.updates == [] and not w.ended
        inv = inventory(with_health(card(0), OK))
        feed.update(hl.plan_health(inv, plan_pool(inv, FREE), [], pool_name=NODE))
        assert _health(await w.wait(lambda u: True, "the list", timeout=5)) == {"gpu-0": "HEALTHY"}
    finally:
        await w.close()
        await server.stop(0)


async def test_the_plugin_advertises_both_services_and_feeds_them_from_its_refresh(tmp_path: Path) -> None:
    host = Host(with_health(card(0), OK), with_health(card(1), OK))
    (tmp_path / "k").mkdir()
    store = CheckpointStore(tmp_path / "state")
    calls = Calls(prepare=_never, unprepare=_never, inventory=host.inventory, claims=host.claims, claim_holds=host.holds)
    plugin = DraPlugin(tmp_path / "k", "gpu.bcd.dev", NODE, calls, None, store, "boot-1", device_taints=False)
    # a claim prepared on gpu-1: reported even once the sick card leaves the pool (taints off)
    plugin.checkpoint.claims["u1"] = ClaimEntry(
        uid="u1", namespace="ml", name="c", state="PrepareCompleted", devices=[PreparedDevice(pool=NODE, device="gpu-1", atom=host.gpus[1].atom_id)], boot_id="boot-1", since=SINCE
    )
    await plugin.start()
    kubelet = DraKubelet(tmp_path / "k")
    watches: list[HealthWatch] = []
    try:
        info = await kubelet.register("gpu.bcd.dev", timeout=10)
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin", HEALTH_V1ALPHA1, HEALTH_V1]
        assert kubelet.health_service("1.37") == HEALTH_V1 and kubelet.health_service("1.35") == HEALTH_V1ALPHA1
        watches = [kubelet.watch_health("1.37"), kubelet.watch_health("1.34")]
        await plugin.refresh()
        for w in watches:
            assert _health(await w.wait(lambda u: True, "the list", timeout=5)) == {"gpu-0": "HEALTHY", "gpu-1": "HEALTHY"}
        host.set(1, with_health(card(1), XID79))
        await plugin.refresh()
        assert plugin.pool.device("gpu-1") is None, "withdrawn: taints are off"
        for w in watches:
            await w.wait(lambda u: _health(u) == {"gpu-0": "HEALTHY", "gpu-1": "UNHEALTHY"}, "gpu-1 unhealthy", timeout=5)
    finally:
        for w in watches:
            await w.close()
        await kubelet.close()
        await plugin.close()
