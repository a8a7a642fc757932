"""The device plugin's gRPC side in-process (`DevicePlugin`), against the kubelet stand-in on the
official protos: waiting for a kubelet, a card that is not Ready, a withdrawal answered only after
the stream took it, Allocate on a missing env file, and files in the way of its sockets."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timezone
from pathlib import Path

import grpc
import pytest

from services.device_plugin.advertise import ResourceNames
from services.device_plugin.plugin import DevicePlugin, PluginError, ResourceServer
from services.device_plugin.proto import HEALTHY, UNHEALTHY
from shared import logs
from shared.holdfiles import BINDING_KUBERNETES, HoldContent, HoldDevice, hold_file_bytes
from shared.schemas import Gpu, Inventory, PhysicalGPUStatus

from .kubelet_standin import KubeletStandIn, run_pod

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

U0, U1 = "GPU-00000000-0000-4000-8000-000000000000", "GPU-11111111-1111-4111-8111-111111111111"
RES = "bcd.dev/gpu"


def inventory(phase: str = "Ready") -> Inventory:
    gpus = [
        Gpu(atom_id=u, uuid=u, index=i, pci_address=f"0000:0{i}:00.0", numa_node=i, status=PhysicalGPUStatus(phase=phase))  # type: ignore[arg-type]
        for i, u in enumerate((U0, U1))
    ]
    return Inventory(node_id="node-1", observed_at=datetime.now(timezone.utc), gpus=gpus)


def write_hold(root: Path, alloc: str, *uuids: str, env: bool = True) -> None:
    content = HoldContent(alloc, f"rsv-{alloc}", 1, BINDING_KUBERNETES, tuple(HoldDevice.for_gpu(u, i) for i, u in enumerate(uuids)), env=("TEAM=ml",))
    (root / "cdi" / f"bcd-{alloc}.json").write_bytes(hold_file_bytes("cdi", content, None))
    if env:
        (root / "run" / "allocations" / f"{alloc}.env").write_bytes(hold_file_bytes("allocation-env", content, None))


def remove_hold(root: Path, alloc: str) -> None:
    (root / "cdi" / f"bcd-{alloc}.json").unlink()
    (root / "run" / "allocations" / f"{alloc}.env").unlink(missing_ok=True)


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bdps-", dir="/tmp"))
    for d in ("cdi", "run/allocations", "kubelet/device-plugins"):
        (path / d).mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Inv:
    def __init__(self) -> None:
        self.value: Inventory | None = inventory()

    async def __call__(self) -> Inventory:
        if self.value is None:
            raise TimeoutError("inventory away")
        return self.value


@pytest.fixture
async def plugin(root: Path) -> AsyncIterator[DevicePlugin]:
    inv = Inv()
    p = DevicePlugin(
        plugin_dir=root / "kubelet" / "device-plugins",
        cdi_dir=root / "cdi",
        run_dir=root / "run",
        names=ResourceNames(),
        inventory=inv,
        log=logs.get_logger("test.device_plugin"),
        watch_interval=0.05,
        rescan_interval=0.1,
    )
    p.test_inventory = inv  # type: ignore[attr-defined]
    stopping = asyncio.Event()
    await p.fetch_inventory()
    task = asyncio.create_task(p.watch(stopping))
    try:
        yield p
    finally:
        stopping.set()
        await task
        await p.close()


async def test_it_waits_for_a_kubelet_then_registers_and_advertises(root, plugin):
    write_hold(root, "k1", U0)
    await asyncio.sleep(0.3)
    st = plugin.status()
    assert not st.kubelet_present and not st.registered
    assert [(h.allocation_id, h.advertised) for h in st.holds] == [("k1", False)]
    async with KubeletStandIn(root / "kubelet" / "device-plugins") as kubelet:
        await kubelet.wait_registered(RES)
        devices = await kubelet.wait_devices(RES, lambda d: set(d) == {U0})
        assert devices[U0].health == HEALTHY and [n.ID for n in devices[U0].topology.nodes] == [0]
        st = plugin.status()
        assert st.kubelet_present and st.registered and [(h.allocation_id, h.advertised) for h in st.holds] == [("k1", True)]
        assert {r.name: (r.registered, r.devices, r.healthy, r.streams) for r in st.resources}[RES] == (True, 1, 1, 1)


async def test_a_card_that_is_not_ready_is_unhealthy_and_refused(root, plugin):
    write_hold(root, "k1", U0)
    async with KubeletStandIn(root / "kubelet" / "device-plugins") as kubelet:
        await kubelet.wait_devices(RES, lambda d: d.get(U0) is not None and d[U0].health == HEALTHY)
        await plugin.refresh(inventory("Passthrough"))
        await kubelet.wait_devices(RES, lambda d: d[U0].health == UNHEALTHY)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await kubelet.allocate(RES, [[U0]])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Passthrough, not Ready" in refused.value.details()
        # the inventory goes away: the last one stands
        plugin.test_inventory.value = None  # type: ignore[attr-defined]
        await plugin.fetch_inventory()
        await plugin.refresh(inventory())
        await kubelet.wait_devices(RES, lambda d: d[U0].health == HEALTHY)


async def test_a_withdrawal_is_answered_after_the_kubelet_s_stream_took_it(root, plugin):
    write_hold(root, "k1", U0)
    write_hold(root, "k2", U1)
    async with KubeletStandIn(root / "kubelet" / "device-plugins") as kubelet:
        view = await kubelet.wait_registered(RES)
        await kubelet.wait_devices(RES, lambda d: set(d) == {U0, U1})
        remove_hold(root, "k1")  # the converger removes the files, then asks
        reply = await plugin.withdraw("k1")
        assert reply.withdrawn == [U0] and reply.streams == 1 and reply.detail == ""
        # it was written to the stream before the reply; the stand-in reads it a moment later
        await kubelet.wait_devices(RES, lambda d: set(d) == {U1}, timeout=2)
        with pytest.raises(grpc.aio.AioRpcError):
            await kubelet.allocate(RES, [[U0]])
        # withdrawn while its file is still there (a removal not yet seen): not advertised either
        reply = await plugin.withdraw("k2")
        assert reply.withdrawn == [U1] and reply.streams == 1
        await kubelet.wait_devices(RES, lambda d: not d, timeout=2)
        assert [(h.allocation_id, h.advertised, h.reason) for h in plugin.status().holds] == [("k2", False, "withdrawn: a Kubernetes release started")]
        # once the file is gone and written again (taken back), it is advertised again
        remove_hold(root, "k2")
        await plugin.refresh()
        write_hold(root, "k2", U1)
        await kubelet.wait_devices(RES, lambda d: set(d) == {U1})


async def test_allocate_answers_cdi_names_and_env_and_waits_for_a_missing_env_file(root, plugin):
    write_hold(root, "k1", U0, U1, env=False)
    async with KubeletStandIn(root / "kubelet" / "device-plugins") as kubelet:
        await kubelet.wait_devices(RES, lambda d: set(d) == {U0, U1})
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await kubelet.allocate(RES, [[U1]])
        assert "env file of allocation k1 is not written yet" in refused.value.details()
        write_hold(root, "k1", U0, U1)
        response = await kubelet.allocate(RES, [[U1], [U0]])
        first, second = response.container_responses
        assert [c.name for c in first.cdi_devices] == [f"bcd.dev/gpu={U1}"] and first.envs["NVIDIA_VISIBLE_DEVICES"] == U1
        assert second.envs["NVIDIA_VISIBLE_DEVICES"] == U0 and second.envs["TEAM"] == "ml"
        assert run_pod(root / "cdi", first).device_ids == [U1]
        assert await kubelet.preferred(RES, [U0, U1], [], 1) in ([U0], [U1])
        assert (await kubelet.prestart(RES, [U0])) is not None
        assert plugin.status().allocations == 1


async def test_a_file_in_the_way_of_a_socket_is_left_alone(root):
    path = root / "kubelet" / "device-plugins" / "bcd-gpu.sock"
    path.write_text("not a socket")
    server = ResourceServer(None, RES, path)  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="not a socket"):
        await server.start()
    assert path.read_text() == "not a socket"
    # a socket a killed plugin left behind is replaced
    path.unlink()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    await server.start()
    try:
        assert server.socket_ok()
    finally:
        await server.stop(0)
    assert not path.exists()
    too_long = ResourceServer(None, RES, root / ("x" * 120) / "bcd-gpu.sock")  # type: ignore[arg-type]
    with pytest.raises(PluginError, match="longer than a unix socket path"):
        await too_long.start()
    assert os.listdir(root / "kubelet" / "device-plugins") == []


# --------------------------------------------------------------------------- the converger's side


async def test_the_converger_waits_for_a_plugin_only_while_it_answers(node_bus):
    """No plugin: nothing to wait for. A plugin that hangs: one timeout, then not waited for."""
    import time as _time

    from services.converger.consumers import UNANSWERED_BACKOFF_S, BusKubeConsumers
    from shared.subjects import NodeSubjects

    subjects = NodeSubjects(node_bus.node_id)
    nc = await node_bus.connect("converger")
    hung = await node_bus.connect("device_plugin")
    try:
        now = [1000.0]
        consumers = BusKubeConsumers(nc, subjects, timeout=0.3, clock=lambda: now[0])
        t0 = _time.monotonic()
        await consumers.withdraw("k1", [U0])
        assert _time.monotonic() - t0 < 0.25 and consumers.quiet_until == 0.0  # no responders: at once
        async def never_answers(msg):  # noqa: ANN001
            return None

        await hung.subscribe(subjects.device_plugin_withdraw, cb=never_answers)
        await hung.flush()
        t0 = _time.monotonic()
        await consumers.withdraw("k1", [U0])
        assert _time.monotonic() - t0 >= 0.3 and consumers.quiet_until == 1000.0 + UNANSWERED_BACKOFF_S
        t0 = _time.monotonic()
        await consumers.withdraw("k2", [U1])
        assert _time.monotonic() - t0 < 0.25  # not waited for meanwhile
        now[0] += UNANSWERED_BACKOFF_S + 1
        t0 = _time.monotonic()
        await consumers.withdraw("k3", [U1])
        assert _time.monotonic() - t0 >= 0.3  # asked again once the backoff is over
    finally:
        await hung.close()
        await nc.close()


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--resource-domain", "kubernetes.io", "reserved"),
        # the DRA DeviceClasses' extendedResourceName domain: a node offers a name one way only (KEP-5004)
        ("--resource-domain", "gpu.bcd.dev", "never both"),
        ("--gpu-resource", "-gpu", "alphanumeric at both ends"),
        ("--mig-resource", "mig", "must contain {profile}"),
        ("--rescan-interval", "0", "must be positive"),
    ],
)
async def test_a_resource_name_the_kubelet_would_refuse_stops_the_service_at_start(node_bus, flag, value, why):
    proc = node_bus.start_service("device_plugin", f"{flag}={value}", BCD_KUBELET_DIR=str(node_bus.root / "kubelet"))
    assert await asyncio.to_thread(proc.wait, 20) == 2
    assert why in proc.log(), proc.log()
