"""The DRA health service (KEP 4680): the health of every device of this node, streamed to the kubelet.

It owns what the kubelet reads into a pod's `status.containerStatuses[].allocatedResourcesStatus`:
`DRAResourceHealth/NodeWatchResources` in both versions the kubelets of 1.34-1.37 ask for
(`v1alpha1` and `v1`, k8s.io/kubelet pkg/apis/dra-health; same messages, other package), served on
the plugin's own socket beside DRAPlugin (the kubelet dials the endpoint it registered) and listed
at registration (`HEALTH_SERVICES`; a kubelet from 1.37 opens the stream only for a plugin that
advertises it and picks v1 when both are, an older one asks for v1alpha1 whatever is advertised;
a name it does not know in the list is skipped, so advertising both costs nothing).

What is reported (`plan_health`, pure): each device of the pool the plugin last planned (whole
cards, MIG placements; a shared card is one device, so every share of it is covered) and each
device of a claim prepared here (so a card withdrawn from the slices still reports to the pods
that hold it), with the `Healthy` condition of its card from the inventory (the signal the device
taints come from): True -> HEALTHY, False -> UNHEALTHY, Unknown or none -> UNKNOWN; the message is
the condition as `health_text` writes it, cut to 1024 as the API asks (`clip_message`).

How (`HealthFeed`): the plugin sets the list at every refresh of its pool (each inventory or
claims notice, and every resync); each stream sends the full list when the kubelet connects, again
as soon as it changes, and again every `RESEND_S` whatever happens: the kubelet stamps a device's
health when it receives it and reads it Unknown 30 s later (pkg/kubelet/cm/dra/healthinfo.go,
healthTimeout), so a quiet stream must not let a sick card turn Unknown. A kubelet that
reconnects (a restart, a socket served again) is a new stream: it gets the full list at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from shared import logs
from shared.schemas import Gpu, Inventory, PreparedDevice
from shared.schemas.inventory import health_text

from .proto import dra_health_v1_pb2 as v1_pb
from .proto import dra_health_v1_pb2_grpc as v1_grpc
from .proto import dra_health_v1alpha1_pb2 as v1alpha1_pb
from .proto import dra_health_v1alpha1_pb2_grpc as v1alpha1_grpc

log = logs.get_logger("bcd.dra_plugin.health")

#: what a DRA plugin lists in PluginInfo.supported_versions for each health service it serves
#: (k8s.io/kubelet pkg/apis/dra-health/{v1alpha1,v1}/types.go DRAResourceHealthService: exactly
#: the gRPC service's full name), oldest first
HEALTH_SERVICE_V1ALPHA1 = "v1alpha1.DRAResourceHealth"
HEALTH_SERVICE_V1 = "v1.DRAResourceHealth"
HEALTH_SERVICES = (HEALTH_SERVICE_V1ALPHA1, HEALTH_SERVICE_V1)
#: DeviceHealth.message: "Maximum length is 1024 characters. Messages longer than 1024 characters
#: will be truncated to 1021 characters with "..." appended" (the proto); held to 1024 UTF-8 bytes,
#: which is 1024 characters or fewer whichever way the kubelet counts
MESSAGE_MAX = 1024
#: the full list again at least this often: the kubelet reads a device Unknown 30 s after it last heard of it
RESEND_S = 10.0

HealthStatus = Literal["HEALTHY", "UNHEALTHY", "UNKNOWN"]


@dataclass(frozen=True)
class DeviceHealth:
    """One device's health as the kubelet is told it."""

    pool: str
    device: str
    health: HealthStatus
    message: str = ""


def clip_message(text: str) -> str:
    """At most MESSAGE_MAX bytes of UTF-8, cut as the API says ("..." after the first 1021), never mid-character."""
    raw = text.encode()
    if len(raw) <= MESSAGE_MAX:
        return text
    return raw[: MESSAGE_MAX - 3].decode(errors="ignore") + "..."


def card_health(gpu: Gpu | None, what: str) -> tuple[HealthStatus, str]:
    """A card's Healthy condition as a health status and its message."""
    if gpu is None:
        return "UNKNOWN", clip_message(f"{what}: the card is not in the node's inventory")
    c = gpu.status.health()
    if c is None:
        return "UNKNOWN", clip_message(f"gpu-{gpu.index} ({gpu.pci_address}): the inventory does not watch this card's health")
    status: HealthStatus = "HEALTHY" if c.status == "True" else "UNHEALTHY" if c.status == "False" else "UNKNOWN"
    return status, clip_message(f"gpu-{gpu.index} ({gpu.pci_address}) {health_text(c)}")


def plan_health(inventory: Inventory, pool: Any, prepared: Iterable[PreparedDevice], *, pool_name: str) -> tuple[DeviceHealth, ...]:
    """Every device of `pool` (devices.Pool; None: not planned) and every `prepared` device, with
    its card's health, sorted by pool and name; a device in both counts once."""
    by_pci = {g.pci_address: g for g in inventory.gpus}
    by_atom = {g.atom_id: g for g in inventory.gpus}
    out: dict[tuple[str, str], DeviceHealth] = {}
    for d in pool.devices if pool is not None else ():
        out[(pool_name, d.name)] = DeviceHealth(pool_name, d.name, *card_health(by_pci.get(d.pci), d.pci))
    for p in prepared:
        if (p.pool, p.device) in out:
            continue
        # the atom names the card the claim holds (GPU-<uuid>, or GPU-<uuid>/gi<g>/ci<c> for a MIG
        # instance): not the name, whose index may stand for another card by now
        card = p.atom.split("/", 1)[0]
        out[(p.pool, p.device)] = DeviceHealth(p.pool, p.device, *card_health(by_atom.get(card), card or p.device))
    return tuple(out[k] for k in sorted(out))


class HealthFeed:
    """The latest list, and a wake-up for every stream when it changes."""

    def __init__(self, resend_s: float = RESEND_S) -> None:
        self.resend_s = resend_s
        #: None until the plugin first planned its pool: nothing is sent before
        self.devices: tuple[DeviceHealth, ...] | None = None
        #: unix seconds of the last update (DeviceHealth.last_updated_time: when it was last determined)
        self.checked_at = 0
        self.streams = 0
        self._changed = asyncio.Event()

    def update(self, devices: tuple[DeviceHealth, ...]) -> bool:
        """The list as determined now; True (and every stream woken) when it differs from the last."""
        self.checked_at = int(time.time())
        if devices == self.devices:
            return False
        before = {(d.pool, d.device): d.health for d in self.devices or ()}
        moved = [f"{d.device}: {before.get((d.pool, d.device), 'new')} -> {d.health}" for d in devices if before.get((d.pool, d.device)) != d.health]
        self.devices = devices
        # a fresh event per change: each stream waits on the one it took before sending
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        if moved and self.streams:
            log.info("device health changed; sent to the kubelet", changes=moved[:64], streams=self.streams)
        return True

    async def watch(self) -> AsyncIterator[tuple[DeviceHealth, ...]]:
        """The full list now (once known), then at each change and at least every resend_s."""
        while True:
            changed = self._changed
            if self.devices is not None:
                yield self.devices
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), self.resend_s)


def response(pb: Any, devices: Iterable[DeviceHealth], checked_at: int) -> Any:
    """A NodeWatchResourcesResponse of the module `pb` (either version: the messages are the same)."""
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                health=pb.HealthStatus.Value(d.health),
                last_updated_time=checked_at,
                message=d.message,
            )
            for d in devices
        ]
    )


def _servicer(version: str, pb: Any, base: type, feed: HealthFeed) -> Any:
    class Health(base):  # type: ignore[misc, valid-type]
        async def NodeWatchResources(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:  # noqa: N802 - the proto's name
            feed.streams += 1
            log.info("the kubelet watches device health", service=version, streams=feed.streams)
            try:
                async for devices in feed.watch():
                    yield response(pb, devices, feed.checked_at)
            finally:
                feed.streams -= 1
                log.info("a device health stream ended", service=version, streams=feed.streams)

    return Health()


def add_health_servicers(server: grpc.aio.Server, feed: HealthFeed) -> None:
    """Both versions of DRAResourceHealth on `server` (the plugin socket's), fed by `feed`."""
    v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(_servicer(HEALTH_SERVICE_V1ALPHA1, v1alpha1_pb, v1alpha1_grpc.DRAResourceHealthServicer, feed), server)
    v1_grpc.add_DRAResourceHealthServicer_to_server(_servicer(HEALTH_SERVICE_V1, v1_pb, v1_grpc.DRAResourceHealthServicer, feed), server)


__all__ = [
    "HEALTH_SERVICES",
    "HEALTH_SERVICE_V1",
    "HEALTH_SERVICE_V1ALPHA1",
    "MESSAGE_MAX",
    "RESEND_S",
    "DeviceHealth",
    "HealthFeed",
    "add_health_servicers",
    "card_health",
    "clip_message",
    "plan_health",
    "response",
]
