"""A stand-in for the kubelet's side of the device plugin API v1beta1, and for a pod's runtime.

`KubeletStandIn` owns a plugin directory (the kubelet's
/var/lib/kubelet/device-plugins): it serves `Registration` on
`<plugin_dir>/kubelet.sock` with grpc.aio and does what the kubelet's device
manager does with a plugin (pkg/kubelet/cm/devicemanager: plugin/v1beta1/server.go,
handler.go, endpoint.go, manager.go):

- `Register` checks the version is v1beta1, the resource name is an extended
  resource name (as `v1helper.IsExtendedResourceName`) and the endpoint is a
  socket file name in the plugin directory; a bad request is answered with an
  error (status UNKNOWN, as a Go error from the kubelet reads) and recorded in
  `rejections`.
- After an accepted `Register` it dials `unix://<plugin_dir>/<endpoint>` in the
  background, calls `GetDevicePluginOptions`, then reads `ListAndWatch` for as
  long as the stream lasts: each response replaces the resource's devices. A
  second `Register` of the same resource replaces the endpoint (the old stream is
  cancelled, its channel closed) and keeps the devices until the new stream
  sends its list. When a stream ends or fails the devices are kept and the
  resource is marked `gone`, as the kubelet keeps them for a grace period.
- `restart()` is a kubelet restart as a plugin sees it: the Registration server
  goes, every endpoint is forgotten, every unix socket in the plugin directory is
  deleted (the kubelet empties device-plugins/ of sockets on start) and a new
  kubelet.sock (a new inode) is served. A plugin has to notice and register again.
- `allocate`, `preferred` and `prestart` are the calls the kubelet makes when a
  pod is admitted; `run_pod` is what a CDI-aware container runtime then does
  with the `cdi_devices` of a `ContainerAllocateResponse`.

Every wait is bounded and says, when it gives up, what it waited for and what it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import grpc

from services.device_plugin.proto import HEALTHY, KUBELET_SOCKET, VERSION
from services.device_plugin.proto import deviceplugin_v1beta1_pb2 as pb
from services.device_plugin.proto import deviceplugin_v1beta1_pb2_grpc as pb_grpc

#: sun_path is 108 bytes with its terminating NUL.
UNIX_PATH_MAX = 108
#: the annotation of a CDI device that names the device plugin device ID behind it.
DEVICE_ID_ANNOTATION = "bcd.dev/device-id"

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


class KubeletError(RuntimeError):
    """What the kubelet itself refuses or finds wrong (not an error the plugin answered)."""


class CdiError(LookupError):
    """A CDI device name a container runtime could not resolve, or a spec it could not read."""


def check_socket_path(path: Path) -> Path:
    """`path` if it fits a unix socket address, else ValueError."""
    size = len(os.fsencode(path))
    if size >= UNIX_PATH_MAX:
        raise ValueError(f"unix socket path is {size} bytes, the limit is {UNIX_PATH_MAX - 1}: {path}")
    return path


def extended_resource_name_error(name: str) -> str | None:
    """Why `name` is not an extended resource name (the kubelet's IsExtendedResourceName), or None."""
    # IsNativeResource: no domain, or a kubernetes.io one (a substring test, as the kubelet does)
    if "/" not in name:
        return f"the ResourceName {name!r} has no domain (domain/name)"
    if "kubernetes.io/" in name:
        return f"the ResourceName {name!r} is in the kubernetes.io domain"
    if name.startswith("requests."):
        return f"the ResourceName {name!r} starts with requests."
    # IsQualifiedName("requests." + name)
    parts = ("requests." + name).split("/")
    if len(parts) != 2:
        return f"the ResourceName {name!r} has more than one '/'"
    prefix, short = parts
    if len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix):
        return f"the ResourceName {name!r} has a domain that is not a DNS-1123 subdomain"
    if len(short) > 63 or not _QUALIFIED_NAME.match(short):
        return f"the ResourceName {name!r} has a name part that is not a qualified name (at most 63 of [-A-Za-z0-9_.], alphanumeric at both ends)"
    return None


@dataclass
class ResourceView:
    """What the kubelet knows of one resource through its current endpoint."""

    resource: str
    endpoint: str
    #: GetDevicePluginOptions as the plugin answered it; None until it has.
    options: pb.DevicePluginOptions | None = None
    #: the latest ListAndWatch list, by ID
    devices: dict[str, pb.Device] = field(default_factory=dict)
    #: every ListAndWatch response this endpoint sent, in order
    updates: list[list[pb.Device]] = field(default_factory=list)
    #: time.monotonic() when each of `updates` came
    update_times: list[float] = field(default_factory=list)
    #: the ListAndWatch stream is open
    connected: bool = False
    #: the stream ended or failed, or the endpoint could not be reached: the devices are
    #: kept, as the kubelet keeps them until its grace period ends
    gone: bool = False
    #: why the endpoint is gone (the status the stream ended with), when it is
    error: str | None = None

    def healthy(self) -> list[str]:
        return sorted(i for i, d in self.devices.items() if d.health == HEALTHY)


@dataclass
class _Endpoint:
    view: ResourceView
    channel: grpc.aio.Channel
    stub: pb_grpc.DevicePluginStub
    task: asyncio.Task[None] | None = None


async def _grpc_calls_settled(timeout: float = 5.0) -> None:
    """Let grpc.aio finish the status tasks of the calls just cancelled: a closed channel leaves one per
    call (`_handle_status_once_received`, "cancelling") for a few loop ticks, more under load."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        # repr(task) names the coroutine; a Cython coroutine's own repr does not
        if not any(not t.done() and "_handle_status_once_received" in repr(t) for t in asyncio.all_tasks()):
            return
        await asyncio.sleep(0.01)


class KubeletStandIn(pb_grpc.RegistrationServicer):
    """The kubelet's device manager over a plugin directory (see the module docstring)."""

    #: the status a rejected Register gets: the kubelet returns a plain Go error, which gRPC sends as UNKNOWN
    REJECT_CODE = grpc.StatusCode.UNKNOWN

    def __init__(self, plugin_dir: Path, *, connect_timeout: float = 10.0) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.socket = check_socket_path(self.plugin_dir / KUBELET_SOCKET)
        self.connect_timeout = connect_timeout
        #: every accepted Register, in order (across restarts)
        self.registrations: list[pb.RegisterRequest] = []
        #: every rejected Register with the reason, in order (across restarts)
        self.rejections: list[tuple[pb.RegisterRequest, str]] = []
        #: how many times restart() ran
        self.restarts = 0
        self._server: grpc.aio.Server | None = None
        self._endpoints: dict[str, _Endpoint] = {}
        self._changed = asyncio.Event()

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> Self:
        if self._server is not None:
            raise KubeletError("the kubelet stand-in is already serving")
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)  # grpc binds over a stale socket, not over a plain file
        server = grpc.aio.server()
        pb_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        await server.start()
        self._server = server
        self._bump()
        return self

    async def stop(self) -> None:
        """Stop serving, drop every endpoint and remove kubelet.sock."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)
        for name in list(self._endpoints):
            await self._retire(self._endpoints.pop(name))
        self.socket.unlink(missing_ok=True)
        await _grpc_calls_settled()
        self._bump()

    async def restart(self) -> None:
        """A kubelet restart: forget every endpoint, delete every socket in the plugin dir, serve a new kubelet.sock."""
        await self.stop()
        for entry in self.plugin_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(entry.lstat().st_mode):
                    entry.unlink()
        self.restarts += 1
        await self.start()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- Registration ------------------------------------------------------------

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        """The kubelet's Registration.Register (the proto's name)."""
        reason = self._rejection(request)
        if reason is not None:
            self.rejections.append((request, reason))
            self._bump()
            await context.abort(self.REJECT_CODE, reason)
        old = self._endpoints.get(request.resource_name)
        view = ResourceView(request.resource_name, request.endpoint)
        if old is not None:  # the kubelet keeps the devices until the new endpoint's first list
            view.devices = dict(old.view.devices)
        channel = grpc.aio.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}")
        endpoint = _Endpoint(view, channel, pb_grpc.DevicePluginStub(channel))
        self._endpoints[request.resource_name] = endpoint
        self.registrations.append(request)
        # the dial happens in the background (the task is made before any await, so stop() always finds it)
        endpoint.task = asyncio.create_task(self._run(endpoint), name=f"kubelet-standin:{request.resource_name}")
        self._bump()
        if old is not None:
            await self._retire(old)
        return pb.Empty()

    def _rejection(self, request: pb.RegisterRequest) -> str | None:
        if request.version != VERSION:
            return f"requested API version {request.version!r} is not supported by kubelet. Supported versions are [{VERSION!r}]"
        reason = extended_resource_name_error(request.resource_name)
        if reason is not None:
            return reason
        endpoint = request.endpoint
        if not endpoint or endpoint in (".", "..") or "/" in endpoint or "\0" in endpoint:
            return f"the endpoint {endpoint!r} is not a file name in the plugin directory {self.plugin_dir}"
        try:
            check_socket_path(self.plugin_dir / endpoint)
        except ValueError as e:
            return str(e)
        return None

    async def _run(self, endpoint: _Endpoint) -> None:
        view = endpoint.view
        try:
            view.options = await endpoint.stub.GetDevicePluginOptions(pb.Empty(), wait_for_ready=True, timeout=self.connect_timeout)
            self._bump()
            call = endpoint.stub.ListAndWatch(pb.Empty(), wait_for_ready=True)
            await call.initial_metadata()
            view.connected = True
            self._bump()
            async for response in call:
                devices = list(response.devices)
                view.updates.append(devices)
                view.update_times.append(time.monotonic())
                view.devices = {d.ID: d for d in devices}
                self._bump()
            view.error = "ListAndWatch ended"
        except grpc.aio.AioRpcError as e:
            view.error = f"{e.code().name}: {e.details()}"
        # (a cancellation, by a new Register, restart() or stop(), goes straight out: that view is dropped)
        view.connected = False
        view.gone = True
        self._bump()

    async def _retire(self, endpoint: _Endpoint) -> None:
        if endpoint.task is not None:
            endpoint.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await endpoint.task
        endpoint.view.connected = False
        await endpoint.channel.close()

    # -- what the kubelet knows -----------------------------------------------------

    def resource(self, name: str) -> ResourceView | None:
        endpoint = self._endpoints.get(name)
        return endpoint.view if endpoint is not None else None

    def registrations_of(self, resource: str) -> list[pb.RegisterRequest]:
        return [r for r in self.registrations if r.resource_name == resource]

    async def wait_view(self, resource: str, predicate: Callable[[ResourceView], bool], *, what: str, timeout: float = 10.0) -> ResourceView:
        """The resource's view once `predicate` holds for it (`what` names the wait in the error)."""

        def ready() -> ResourceView | None:
            view = self.resource(resource)
            return view if view is not None and predicate(view) else None

        return await self._wait(ready, f"{what} of {resource!r}", lambda: self._describe(resource), timeout)

    async def wait_registered(self, resource: str, *, count: int = 1, timeout: float = 10.0) -> ResourceView:
        """The resource's view once `count` Registers of it have been accepted (since the stand-in was made)."""

        def ready() -> ResourceView | None:
            view = self.resource(resource)
            return view if view is not None and len(self.registrations_of(resource)) >= count else None

        return await self._wait(ready, f"{count} accepted Register(s) of {resource!r}", lambda: self._describe(resource), timeout)

    async def wait_devices(self, resource: str, predicate: Callable[[dict[str, pb.Device]], bool], *, timeout: float = 10.0) -> dict[str, pb.Device]:
        """The resource's devices once `predicate` holds for them."""
        view = await self.wait_view(resource, lambda v: predicate(v.devices), what="devices matching the predicate", timeout=timeout)
        return view.devices

    # -- the calls of a pod's admission --------------------------------------------------

    def _endpoint(self, resource: str) -> _Endpoint:
        endpoint = self._endpoints.get(resource)
        if endpoint is None:
            raise KubeletError(f"no device plugin is registered for {resource!r}: {self._describe(resource)}")
        if endpoint.view.gone:
            raise KubeletError(f"the endpoint of {resource!r} is gone ({endpoint.view.error})")
        return endpoint

    async def allocate(self, resource: str, containers: list[list[str]], *, timeout: float = 5.0) -> pb.AllocateResponse:
        """Allocate: one container request per list of device IDs. grpc.aio.AioRpcError as the plugin answered."""
        endpoint = self._endpoint(resource)
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        response: pb.AllocateResponse = await endpoint.stub.Allocate(request, timeout=timeout)
        if len(response.container_responses) != len(containers):
            raise KubeletError(f"Allocate of {resource!r} answered {len(response.container_responses)} container responses for {len(containers)} containers")
        return response

    async def preferred(self, resource: str, available: list[str], must_include: list[str], size: int, *, timeout: float = 5.0) -> list[str]:
        """GetPreferredAllocation for one container: the device IDs the plugin prefers."""
        endpoint = self._endpoint(resource)
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size)
            ]
        )
        response: pb.PreferredAllocationResponse = await endpoint.stub.GetPreferredAllocation(request, timeout=timeout)
        if len(response.container_responses) != 1:
            raise KubeletError(f"GetPreferredAllocation of {resource!r} answered {len(response.container_responses)} container responses for 1")
        return list(response.container_responses[0].deviceIDs)

    async def prestart(self, resource: str, ids: list[str], *, timeout: float = 5.0) -> pb.PreStartContainerResponse:
        endpoint = self._endpoint(resource)
        response: pb.PreStartContainerResponse = await endpoint.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=timeout)
        return response

    # -- internals --------------------------------------------------------------------

    def _bump(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, ready: Callable[[], Any], what: str, seen: Callable[[], str], timeout: float) -> Any:
        try:
            async with asyncio.timeout(timeout):
                while (result := ready()) is None:
                    await self._changed.wait()
                return result
        except TimeoutError:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}; seen: {seen()}") from None

    def _describe(self, resource: str) -> str:
        view = self.resource(resource)
        state = (
            "no endpoint"
            if view is None
            else (
                f"endpoint {view.endpoint!r} connected={view.connected} gone={view.gone} error={view.error!r} "
                f"options={'none' if view.options is None else 'got'} updates={len(view.updates)} "
                f"devices={ {i: d.health for i, d in view.devices.items()} }"
            )
        )
        accepted = [(r.resource_name, r.endpoint) for r in self.registrations]
        rejected = [(r.resource_name, r.endpoint, r.version, why) for r, why in self.rejections]
        return f"{state}; serving={self._server is not None} restarts={self.restarts} accepted={accepted} rejected={rejected}"


# -- a pod --------------------------------------------------------------------------------


@dataclass
class PodRun:
    """What a container got from a CDI-aware runtime for one ContainerAllocateResponse."""

    #: the CDI device names, as allocated
    cdi_names: list[str]
    #: the bcd.dev/device-id annotation of each resolved device ("" where it has none), in order
    device_ids: list[str]
    #: the Allocate envs, with each spec's and then each device's containerEdits env on top
    env: dict[str, str]
    #: the name of the spec file that defined each device, in order
    spec_files: list[str]


def _edits_env(edits: Any, where: str) -> dict[str, str]:
    if edits is None:
        return {}
    if not isinstance(edits, dict):
        raise CdiError(f"{where}: containerEdits is not an object")
    env: dict[str, str] = {}
    for entry in edits.get("env") or []:
        if not isinstance(entry, str) or "=" not in entry:
            raise CdiError(f"{where}: containerEdits env entry {entry!r} is not KEY=VALUE")
        key, value = entry.split("=", 1)
        env[key] = value
    return env


def _read_specs(cdi_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for path in sorted(cdi_dir.glob("*.json")):
        if not path.is_file():
            continue
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CdiError(f"CDI spec {path.name} cannot be read: {e}") from e
        if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str) or not isinstance(spec.get("devices"), list):
            raise CdiError(f"CDI spec {path.name} has no kind and devices")
        specs.append((path.name, spec))
    return specs


def run_pod(cdi_dir: Path, response: pb.ContainerAllocateResponse) -> PodRun:
    """Resolve the response's cdi_devices against the CDI specs in `cdi_dir`, as a container runtime does."""
    specs = _read_specs(Path(cdi_dir))
    names = [d.name for d in response.cdi_devices]
    env = dict(response.envs)
    device_ids: list[str] = []
    spec_files: list[str] = []
    applied_specs: set[str] = set()
    for qualified in names:
        kind, sep, name = qualified.partition("=")
        if not sep or not name or kind.count("/") != 1:
            raise CdiError(f"{qualified!r} is not a fully qualified CDI device name (vendor/class=name)")
        found = [
            (file, spec, device)
            for file, spec in specs
            if spec["kind"] == kind
            for device in spec["devices"]
            if isinstance(device, dict) and device.get("name") == name
        ]
        if not found:
            raise CdiError(f"unresolvable CDI device {qualified!r}: no spec in {cdi_dir} defines it")
        if len(found) > 1:
            raise CdiError(f"unresolvable CDI device {qualified!r}: defined {len(found)} times, in {sorted(f for f, _, _ in found)}")
        file, spec, device = found[0]
        if file not in applied_specs:  # a spec's own edits go in once, before its first device's
            applied_specs.add(file)
            env.update(_edits_env(spec.get("containerEdits"), file))
        env.update(_edits_env(device.get("containerEdits"), f"{file} device {name!r}"))
        annotations = device.get("annotations") or {}
        device_ids.append(str(annotations.get(DEVICE_ID_ANNOTATION, "")))
        spec_files.append(file)
    return PodRun(cdi_names=names, device_ids=device_ids, env=env, spec_files=spec_files)
