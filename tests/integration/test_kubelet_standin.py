"""The kubelet stand-in (kubelet_standin.py) against a tiny device plugin written here with grpc.aio:
registration, ListAndWatch, rejected registrations, the admission calls, a re-registration, a
kubelet restart; and the pod stand-in resolving CDI names against spec files."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest

from services.device_plugin.proto import HEALTHY, UNHEALTHY, VERSION
from services.device_plugin.proto import deviceplugin_v1beta1_pb2 as pb
from services.device_plugin.proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

from .kubelet_standin import (
    CdiError,
    KubeletError,
    KubeletStandIn,
    check_socket_path,
    extended_resource_name_error,
    run_pod,
)

RESOURCE = "bcd.dev/gpu"
ENDPOINT = "bcd-test.sock"


class TinyPlugin(pb_grpc.DevicePluginServicer):
    """One resource, two devices; a second ListAndWatch list (GPU-1 unhealthy) once `second` is set.

    The method names are the proto's."""

    def __init__(self, plugin_dir: Path) -> None:
        self.socket = plugin_dir / ENDPOINT
        self.second = asyncio.Event()
        self.streams = 0  # ListAndWatch streams open now
        self.prestarted: list[list[str]] = []
        self.server: grpc.aio.Server | None = None

    async def serve(self) -> None:
        server = grpc.aio.server()
        pb_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self.server = server

    async def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.stop(None)

    async def register(self, kubelet_socket: Path, *, version: str = VERSION, resource: str = RESOURCE, endpoint: str = ENDPOINT) -> None:
        async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
            request = pb.RegisterRequest(version=version, endpoint=endpoint, resource_name=resource)
            await pb_grpc.RegistrationStub(channel).Register(request, timeout=5)

    async def GetDevicePluginOptions(self, request, context):
        return pb.DevicePluginOptions(get_preferred_allocation_available=True, pre_start_required=True)

    async def ListAndWatch(self, request, context):
        self.streams += 1
        try:
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID="GPU-0", health=HEALTHY), pb.Device(ID="GPU-1", health=HEALTHY)])
            await self.second.wait()
            yield pb.ListAndWatchResponse(devices=[pb.Device(ID="GPU-0", health=HEALTHY), pb.Device(ID="GPU-1", health=UNHEALTHY)])
            await asyncio.Event().wait()  # a plugin keeps the stream open
        finally:
            self.streams -= 1

    async def Allocate(self, request, context):
        responses = []
        for container in request.container_requests:
            unknown = [i for i in container.devices_ids if i not in ("GPU-0", "GPU-1")]
            if unknown:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices {unknown}")
            responses.append(
                pb.ContainerAllocateResponse(
                    envs={"BCD_DEVICES": ",".join(container.devices_ids)},
                    cdi_devices=[pb.CDIDevice(name=f"{RESOURCE}={i.lower()}") for i in container.devices_ids],
                )
            )
        return pb.AllocateResponse(container_responses=responses)

    async def GetPreferredAllocation(self, request, context):
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(
                    deviceIDs=(list(r.must_include_deviceIDs) + [i for i in r.available_deviceIDs if i not in r.must_include_deviceIDs])[: r.allocation_size]
                )
                for r in request.container_requests
            ]
        )

    async def PreStartContainer(self, request, context):
        self.prestarted.append(list(request.devices_ids))
        return pb.PreStartContainerResponse()


@pytest.fixture
async def plugin(kubelet: KubeletStandIn) -> AsyncIterator[TinyPlugin]:
    p = TinyPlugin(kubelet.plugin_dir)
    await p.serve()
    try:
        yield p
    finally:
        await p.close()


async def wait_until(condition: Callable[[], bool], what: Callable[[], str], timeout: float = 5.0) -> None:
    """Poll `condition` (state of the plugin here, which has no event to wait on) for at most `timeout` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what()}") from None


def listed(devices: list[pb.Device]) -> list[tuple[str, str]]:
    return [(d.ID, d.health) for d in devices]


async def test_a_plugin_registers_and_its_list_and_watch_updates_arrive(kubelet: KubeletStandIn, plugin: TinyPlugin) -> None:
    await plugin.register(kubelet.socket)
    view = await kubelet.wait_registered(RESOURCE)
    assert [(r.version, r.resource_name, r.endpoint) for r in kubelet.registrations] == [(VERSION, RESOURCE, ENDPOINT)]
    assert view.endpoint == ENDPOINT and kubelet.rejections == []

    devices = await kubelet.wait_devices(RESOURCE, lambda d: set(d) == {"GPU-0", "GPU-1"})
    assert {i: d.health for i, d in devices.items()} == {"GPU-0": HEALTHY, "GPU-1": HEALTHY}
    assert view.options is not None and view.options.get_preferred_allocation_available and view.options.pre_start_required
    assert view.connected and not view.gone

    plugin.second.set()
    devices = await kubelet.wait_devices(RESOURCE, lambda d: d["GPU-1"].health == UNHEALTHY)
    assert [listed(u) for u in view.updates] == [
        [("GPU-0", HEALTHY), ("GPU-1", HEALTHY)],
        [("GPU-0", HEALTHY), ("GPU-1", UNHEALTHY)],
    ]
    assert view.healthy() == ["GPU-0"]


async def test_the_admission_calls_go_to_the_plugin(kubelet: KubeletStandIn, plugin: TinyPlugin) -> None:
    with pytest.raises(KubeletError, match="no device plugin is registered"):
        await kubelet.allocate(RESOURCE, [["GPU-0"]])
    await plugin.register(kubelet.socket)
    await kubelet.wait_registered(RESOURCE)

    response = await kubelet.allocate(RESOURCE, [["GPU-0"], ["GPU-1"]])
    assert [[c.name for c in r.cdi_devices] for r in response.container_responses] == [["bcd.dev/gpu=gpu-0"], ["bcd.dev/gpu=gpu-1"]]
    assert response.container_responses[0].envs["BCD_DEVICES"] == "GPU-0"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await kubelet.allocate(RESOURCE, [["GPU-9"]])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "GPU-9" in (refused.value.details() or "")

    assert await kubelet.preferred(RESOURCE, ["GPU-0", "GPU-1"], ["GPU-1"], 1) == ["GPU-1"]
    await kubelet.prestart(RESOURCE, ["GPU-0"])
    assert plugin.prestarted == [["GPU-0"]]


async def test_a_plugin_that_goes_away_leaves_its_devices_marked_gone(kubelet: KubeletStandIn, plugin: TinyPlugin) -> None:
    await plugin.register(kubelet.socket)
    await kubelet.wait_devices(RESOURCE, lambda d: len(d) == 2)
    await plugin.close()
    view = await kubelet.wait_view(RESOURCE, lambda v: v.gone, what="the endpoint gone")
    assert not view.connected and set(view.devices) == {"GPU-0", "GPU-1"}
    assert view.error is not None and view.error.startswith("UNAVAILABLE")
    with pytest.raises(KubeletError, match="is gone"):
        await kubelet.allocate(RESOURCE, [["GPU-0"]])


async def test_invalid_registrations_are_refused_and_recorded(kubelet: KubeletStandIn, plugin: TinyPlugin) -> None:
    bad = [
        {"version": "v1alpha"},
        {"resource": "kubernetes.io/gpu"},
        {"resource": "nvidia.kubernetes.io/gpu"},
        {"resource": "gpu"},
        {"endpoint": "sub/bcd-test.sock"},
        {"endpoint": "../bcd-test.sock"},
    ]
    for kwargs in bad:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await plugin.register(kubelet.socket, **kwargs)
        assert refused.value.code() == KubeletStandIn.REJECT_CODE, kwargs
    reasons = [why for _, why in kubelet.rejections]
    assert len(reasons) == len(bad)
    assert "v1alpha" in reasons[0] and "kubernetes.io domain" in reasons[1] and "kubernetes.io domain" in reasons[2]
    assert "no domain" in reasons[3] and "not a file name" in reasons[4] and "not a file name" in reasons[5]
    assert kubelet.registrations == [] and kubelet.resource(RESOURCE) is None and kubelet.resource("kubernetes.io/gpu") is None
    assert plugin.streams == 0


async def test_a_second_register_replaces_the_endpoint(kubelet: KubeletStandIn, plugin: TinyPlugin) -> None:
    await plugin.register(kubelet.socket)
    first = await kubelet.wait_view(RESOURCE, lambda v: len(v.updates) == 1, what="the first list")
    await plugin.register(kubelet.socket)
    second = await kubelet.wait_registered(RESOURCE, count=2)
    assert second is not first and not first.connected
    assert set(second.devices) == {"GPU-0", "GPU-1"}  # kept from the old endpoint until the new list
    await kubelet.wait_view(RESOURCE, lambda v: len(v.updates) == 1 and v.connected, what="the new endpoint's list")
    await wait_until(lambda: plugin.streams == 1, lambda: f"the old stream cancelled; streams open: {plugin.streams}")
    with pytest.raises(TimeoutError, match=r"3 accepted Register\(s\) of 'bcd.dev/gpu'; seen: endpoint 'bcd-test.sock'"):
        await kubelet.wait_registered(RESOURCE, count=3, timeout=0.2)


async def test_restart_deletes_the_plugin_sockets_and_serves_a_new_kubelet_socket(kubelet: KubeletStandIn, plugin: TinyPlugin, short_dir: Path) -> None:
    await plugin.register(kubelet.socket)
    old_view = await kubelet.wait_view(RESOURCE, lambda v: v.connected, what="the stream open")
    # a second name for the old kubelet.sock keeps its inode from being reused by the new one
    keep = short_dir / "old-kubelet.sock"
    os.link(kubelet.socket, keep)
    old_inode = os.stat(kubelet.socket).st_ino
    (kubelet.plugin_dir / "kubelet_internal_checkpoint").write_text("{}")

    await kubelet.restart()
    assert not plugin.socket.exists(), "the plugin's socket should be deleted by a kubelet restart"
    assert (kubelet.plugin_dir / "kubelet_internal_checkpoint").exists(), "only sockets are deleted"
    assert stat.S_ISSOCK(os.stat(kubelet.socket).st_mode) and os.stat(kubelet.socket).st_ino != old_inode
    assert kubelet.resource(RESOURCE) is None and not old_view.connected and kubelet.restarts == 1
    await wait_until(lambda: plugin.streams == 0, lambda: f"the stream cancelled; streams open: {plugin.streams}")

    # the plugin notices, serves its socket again and registers again
    await plugin.close()
    await plugin.serve()
    await plugin.register(kubelet.socket)
    view = await kubelet.wait_registered(RESOURCE, count=2)
    await kubelet.wait_devices(RESOURCE, lambda d: set(d) == {"GPU-0", "GPU-1"})
    assert view.updates and len(kubelet.registrations) == 2


def test_resource_names_are_checked_as_the_kubelet_does() -> None:
    for good in ("bcd.dev/gpu", "nvidia.com/gpu", "example.com/A.b-c_9", "a/b"):
        assert extended_resource_name_error(good) is None, good
    for bad in (
        "gpu",
        "kubernetes.io/gpu",
        "nvidia.kubernetes.io/gpu",
        "requests.bcd.dev/gpu",
        "bcd.dev/a/b",
        "Bcd.dev/gpu",
        "bcd.dev/",
        "bcd.dev/-gpu",
        "bcd.dev/" + "g" * 64,
        "bcd_dev/gpu",
    ):
        assert extended_resource_name_error(bad) is not None, bad


def test_a_socket_path_over_the_unix_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="unix socket path is"):
        KubeletStandIn(Path("/tmp") / ("x" * 100))
    assert check_socket_path(Path("/tmp/k.sock")) == Path("/tmp/k.sock")


def _spec(kind: str, devices: list[dict], env: list[str] | None = None) -> str:
    spec: dict = {"cdiVersion": "0.6.0", "kind": kind, "devices": devices}
    if env is not None:
        spec["containerEdits"] = {"env": env}
    return json.dumps(spec)


def _response(*names: str, envs: dict[str, str] | None = None) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(envs=envs or {}, cdi_devices=[pb.CDIDevice(name=n) for n in names])


def test_run_pod_resolves_cdi_names_against_the_spec_files(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(
        _spec(
            "bcd.dev/gpu",
            [
                {"name": "gpu0", "annotations": {"bcd.dev/device-id": "GPU-0"}, "containerEdits": {"env": ["DEV=0", "WHO=gpu0"]}},
                {"name": "gpu1", "containerEdits": {"deviceNodes": [{"path": "/dev/null"}]}},
                {"name": "twice", "annotations": {"bcd.dev/device-id": "GPU-T"}},
            ],
            env=["SPEC=a", "WHO=spec-a", "FROM_ALLOCATE=overridden"],
        )
    )
    (tmp_path / "b.json").write_text(
        _spec(
            "bcd.dev/gpu",
            [{"name": "gpu2", "annotations": {"bcd.dev/device-id": "GPU-2"}}, {"name": "twice"}],
            env=["SPEC=b"],
        )
    )
    (tmp_path / "other.json").write_text(_spec("other.dev/nic", [{"name": "nic0"}]))
    (tmp_path / "dir.json").mkdir()  # not a regular file: skipped
    (tmp_path / "notes.txt").write_text("not a spec")

    run = run_pod(tmp_path, _response("bcd.dev/gpu=gpu0", "bcd.dev/gpu=gpu1", "bcd.dev/gpu=gpu2", envs={"FROM_ALLOCATE": "yes", "X": "1"}))
    assert run.cdi_names == ["bcd.dev/gpu=gpu0", "bcd.dev/gpu=gpu1", "bcd.dev/gpu=gpu2"]
    assert run.device_ids == ["GPU-0", "", "GPU-2"]
    assert run.spec_files == ["a.json", "a.json", "b.json"]
    assert run.env == {"FROM_ALLOCATE": "overridden", "X": "1", "SPEC": "b", "WHO": "gpu0", "DEV": "0"}

    with pytest.raises(CdiError, match=r"unresolvable CDI device 'bcd.dev/gpu=gpu9'"):
        run_pod(tmp_path, _response("bcd.dev/gpu=gpu0", "bcd.dev/gpu=gpu9"))
    with pytest.raises(CdiError, match=r"unresolvable CDI device 'bcd.dev/gpu=nic0'"):
        run_pod(tmp_path, _response("bcd.dev/gpu=nic0"))  # that name is of another kind
    with pytest.raises(CdiError, match=r"'bcd.dev/gpu=twice': defined 2 times, in \['a.json', 'b.json'\]"):
        run_pod(tmp_path, _response("bcd.dev/gpu=twice"))
    with pytest.raises(CdiError, match="not a fully qualified CDI device name"):
        run_pod(tmp_path, _response("gpu0"))


def test_run_pod_refuses_a_spec_file_it_cannot_read(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(_spec("bcd.dev/gpu", [{"name": "gpu0"}]))
    (tmp_path / "half.json").write_text('{"kind": "bcd.dev/gpu", "dev')
    with pytest.raises(CdiError, match=r"half\.json cannot be read"):
        run_pod(tmp_path, _response("bcd.dev/gpu=gpu0"))
