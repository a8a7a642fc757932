"""The DRA kubelet plugin: registration, NodePrepareResources / NodeUnprepareResources, ResourceSlices.

`DraPlugin` serves gRPC services on two unix sockets:

* `pluginregistration.Registration` at `<kubelet dir>/plugins_registry/<driver>-reg.sock`:
  the kubelet's plugin watcher finds the socket, asks GetInfo (type DRAPlugin,
  our endpoint, supported versions `v1.DRAPlugin` then `v1beta1.DRAPlugin`:
  kubelet_api.py says why that order; then the health services, health.py:
  DRAResourceHealth v1alpha1 and v1, served on the plugin socket too) and tells
  the outcome through NotifyRegistrationStatus. A socket that vanished is served again.
* `v1.DRAPlugin` and `v1beta1.DRAPlugin` at `<kubelet dir>/plugins/<driver>/dra.sock`,
  thin adapters (kubelet_api.py) over one prepare and unprepare here. Prepare reads
  the ResourceClaim from the API server (refusing one whose uid differs or
  that is not allocated), takes the results of our driver, resolves each
  published device name to its card (devices.resolve_device), writes
  PrepareStarted to the checkpoint, asks the converger to make the claim's
  hold (it checks conflicts, journals, makes MIG instances, writes the CDI
  spec), then writes PrepareCompleted and answers pool, device and CDI ids.
  A result with `adminAccess: true` (KEP-5018) goes to the converger as such: prepared
  read-only, holding nothing (claims.py).
  Unprepare asks the converger to remove the hold, then drops the entry.
  Both are idempotent: the kubelet retries.

ResourceSlices (`SlicePublisher`): the pool `devices.plan_pool` derives from
the inventory and the converger's claims, rendered within the 1.35 limits and
made so on the API server (create, replace, delete); the pool generation goes
up whenever what is published changes. Publishing waits while a prepare or
unprepare is in flight, so a MIG instance being made never shows as someone
else's for a moment.

What the API server drops without an error (a feature gate off) is found by
comparing what was sent with what came back, and the plugin falls back for
good (until restarted): MIG counters dropped (DRAPartitionableDevices) ->
whole cards only; consumable capacity dropped (DRAConsumableCapacity) ->
exclusive cards; device taints dropped (DRADeviceTaints) -> an unhealthy
card is withdrawn from the slices instead of published tainted (at once: a
second publication follows in the same round). `status()` says which.

At start (`reconcile`) the checkpoint, the converger's claim holds and the API
server are brought together: a claim gone from the API server (or with another
uid, or no longer allocated) is unprepared; a claim hold the checkpoint does
not know is adopted while its ResourceClaim exists.

Nothing here knows NATS: the service hands in the converger and inventory calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import grpc
import msgspec

from shared import logs
from shared.schemas import (
    ClaimDevice,
    ClaimPrepareReply,
    ClaimPrepareRequest,
    Claims,
    ClaimSummary,
    ClaimUnprepareReply,
    DraClaimStatus,
    DraPluginStatus,
    Inventory,
    PreparedDevice,
)
from shared.schemas.bus import CLAIM_DEVICES_MAX, CLAIM_UID_PATTERN
from shared.schemas.common import clip

from . import configs as cfg
from . import devices as dev
from .binding import plan_binding
from .checkpoint import Checkpoint, CheckpointStore, ClaimEntry
from .health import HEALTH_SERVICES, HealthFeed, add_health_servicers, plan_health
from .kubeapi import Conflict, KubeApi, KubeApiError
from .kubelet_api import ClaimRef, PrepareResult, add_services, supported_versions
from .proto import DRA_PLUGIN_TYPE
from .proto import pluginregistration_v1_pb2 as reg_pb
from .proto import pluginregistration_v1_pb2_grpc as reg_grpc

log = logs.get_logger("bcd.dra_plugin")

#: a unix socket path must fit sockaddr_un.sun_path (108 bytes with its NUL).
SOCKET_PATH_MAX = 107
_UID_RE = re.compile(CLAIM_UID_PATTERN)
#: what one claim's prepare may take (the converger makes MIG instances one NVML step at a time).
PREPARE_TIMEOUT_S = 300.0
#: how often allocated claims are looked at for binding conditions (--binding-conditions true)
BINDING_POLL_S = 2.0


class PluginError(Exception):
    pass


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


class _Socket:
    """One grpc.aio server on one unix socket, served again when its file goes."""

    def __init__(self, path: Path, add: Callable[[grpc.aio.Server], None]) -> None:
        self.path, self.add = path, add
        self.server: grpc.aio.Server | None = None
        self.identity: tuple[int, int, int] | None = None

    async def start(self) -> None:
        if len(str(self.path)) > SOCKET_PATH_MAX:
            raise PluginError(f"{self.path}: longer than a unix socket path may be ({SOCKET_PATH_MAX} bytes)")
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise PluginError(f"{self.path} exists and is not a socket: left alone, not served")
            os.unlink(self.path)
        server = grpc.aio.server()
        self.add(server)
        if server.add_insecure_port(f"unix://{self.path}") == 0:
            raise PluginError(f"cannot listen on {self.path}")
        await server.start()
        self.server, self.identity = server, _identity(self.path)

    def gone(self) -> bool:
        return self.server is None or _identity(self.path) != self.identity

    async def stop(self, grace: float = 0.5) -> None:
        server, self.server = self.server, None
        if server is not None:
            await server.stop(grace)
        if self.identity is not None and _identity(self.path) == self.identity:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.identity = None


@dataclass
class Metrics:
    prepares: Any = None  # Counter [outcome]
    unprepares: Any = None  # Counter [outcome]
    registered: Any = None  # Gauge
    published_devices: Any = None  # Gauge [kind]
    pool_generation: Any = None  # Gauge
    publishes: Any = None  # Counter [outcome]
    prepared: Any = None  # Gauge


@dataclass
class Calls:
    """What the plugin asks of the rest of the node (the service binds these to the node bus)."""

    prepare: Callable[[ClaimPrepareRequest], Awaitable[ClaimPrepareReply]]
    unprepare: Callable[[str], Awaitable[ClaimUnprepareReply]]
    inventory: Callable[[], Awaitable[Inventory]]
    claims: Callable[[], Awaitable[Claims]]
    #: the converger's DRA claim holds (its status)
    claim_holds: Callable[[], Awaitable[list[ClaimSummary]]]


def claim_gis(holds: Sequence[ClaimSummary], inventory: Inventory) -> dict[str, set[int]]:
    """PCI address -> the GPU instances the claims' holds own (from their MIG atoms)."""
    by_uuid = {g.atom_id: g.pci_address for g in inventory.gpus}
    out: dict[str, set[int]] = {}
    for h in holds:
        for d in h.devices:
            m = re.fullmatch(r"(GPU-[^/]+)/gi(\d+)/ci\d+", d.atom)
            if m and m.group(1) in by_uuid:
                out.setdefault(by_uuid[m.group(1)], set()).add(int(m.group(2)))
    return out


@dataclass
class SlicePublisher:
    """Keeps this node's ResourceSlices on the API server equal to the pool."""

    api: KubeApi
    driver: str
    node_name: str
    node_uid: str = ""
    generation: int = 0
    #: what was published last (the pool's content key), None before the first publication
    key: Any = None
    slices: int = 0
    published_at: datetime | None = None
    #: the API server gave back slices without the shared counters or counter consumptions sent
    #: (its DRAPartitionableDevices feature is off: it drops them): MIG placements are not exclusive
    counters_dropped: bool = False
    #: the API server gave back shared cards without allowMultipleAllocations or their request
    #: policies (its DRAConsumableCapacity feature is off): a "share" would be the whole card to
    #: the scheduler, and a default-100% capacity no longer keeps two claims apart
    capacity_dropped: bool = False
    #: the API server gave back tainted devices without their taints (its DRADeviceTaints feature
    #: is off): an unhealthy card would be offered as if it were well
    taints_dropped: bool = False

    async def publish(self, pool: Any) -> bool:
        """Make the API server's slices this pool's; True when anything was written."""
        key = dev.pool_content_key(pool)
        existing = {s["metadata"]["name"]: s for s in await self.api.list_slices(self.driver, self.node_name)}
        if not self.node_uid:
            self.node_uid = await self.api.node_uid(self.node_name)
        if self.key is None:
            # a restart: go on from the generation the API server has
            gens = [int(s["spec"]["pool"].get("generation", 0)) for s in existing.values() if s.get("spec", {}).get("pool")]
            self.generation = max(gens, default=0)
            same = self._rendered(pool, self.generation)
            if gens and _same_slices(same, existing):
                self.key, self.slices = key, len(same)
                return False
        if key != self.key or self.key is None:
            self.generation += 1
        want = self._rendered(pool, self.generation)
        wrote = False
        self.counters_dropped = self.capacity_dropped = self.taints_dropped = False
        for body in want:
            name = body["metadata"]["name"]
            have = existing.pop(name, None)
            if have is None:
                got = await self.api.create_slice(body)
                wrote = True
            elif not _same_slice(body, have):
                body = {**body, "metadata": {**body["metadata"], "resourceVersion": have["metadata"].get("resourceVersion", "")}}
                got = await self.api.replace_slice(name, body)
                wrote = True
            else:
                got = have
            self.counters_dropped = self.counters_dropped or _counters_dropped(body, got)
            self.capacity_dropped = self.capacity_dropped or _capacity_dropped(body, got)
            self.taints_dropped = self.taints_dropped or _taints_dropped(body, got)
        for name in existing:
            await self.api.delete_slice(name)
            wrote = True
        self.key, self.slices = key, len(want)
        if wrote:
            self.published_at = datetime.now(timezone.utc)
        return wrote

    def _rendered(self, pool: Any, generation: int) -> list[dict]:
        return dev.render_slices(pool, driver=self.driver, node_name=self.node_name, node_uid=self.node_uid, generation=generation)


def _counters_dropped(sent: dict, got: dict) -> bool:
    spec, back = sent.get("spec") or {}, (got or {}).get("spec") or {}
    if spec.get("sharedCounters") and not back.get("sharedCounters"):
        return True
    consumed = sum(1 for d in spec.get("devices") or [] if d.get("consumesCounters"))
    return consumed > sum(1 for d in back.get("devices") or [] if d.get("consumesCounters"))


def _capacity_dropped(sent: dict, got: dict) -> bool:
    """A shared card came back without allowMultipleAllocations or a capacity's request policy."""
    back = {d.get("name"): d for d in ((got or {}).get("spec") or {}).get("devices") or [] if isinstance(d, dict)}
    for d in (sent.get("spec") or {}).get("devices") or []:
        if not d.get("allowMultipleAllocations"):
            continue
        b = back.get(d.get("name")) or {}
        if b.get("allowMultipleAllocations") is not True:
            return True
        policies = {k for k, c in (d.get("capacity") or {}).items() if "requestPolicy" in c}
        if any("requestPolicy" not in ((b.get("capacity") or {}).get(k) or {}) for k in policies):
            return True
    return False


def _taints_dropped(sent: dict, got: dict) -> bool:
    """A device sent with taints came back with fewer (none, where DRADeviceTaints is off)."""
    back = {d.get("name"): d for d in ((got or {}).get("spec") or {}).get("devices") or [] if isinstance(d, dict)}
    for d in (sent.get("spec") or {}).get("devices") or []:
        if d.get("taints") and len((back.get(d.get("name")) or {}).get("taints") or []) < len(d["taints"]):
            return True
    return False


def _same_slice(want: dict, have: dict) -> bool:
    def core(s: dict) -> Any:
        meta = s.get("metadata", {})
        return (meta.get("labels") or {}, meta.get("ownerReferences") or [], s.get("spec"))

    return _normal(core(want)) == _normal(core(have))


def _same_slices(want: list[dict], have: dict[str, dict]) -> bool:
    return len(want) == len(have) and all(w["metadata"]["name"] in have and _same_slice(w, have[w["metadata"]["name"]]) for w in want)


def _normal(value: Any) -> Any:
    """JSON as the API server gives it back: omitted empties, so equal content compares equal."""
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in sorted(value.items()) if v not in (None, [], {}, "")}
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    return value


@dataclass
class DraPlugin:
    kubelet_dir: Path
    driver: str
    node_name: str
    calls: Calls
    api: KubeApi | None
    store: CheckpointStore
    boot_id: str
    metrics: Metrics = field(default_factory=Metrics)
    binding_conditions: bool = False
    #: False: whole cards only (a cluster without the DRAPartitionableDevices feature drops the
    #: counters, and nothing would keep MIG placements exclusive)
    mig_devices: bool = True
    #: whole cards published as shareable (consumable capacity); turned off for good when the API
    #: server drops the fields (its DRAConsumableCapacity feature is off)
    shared_cards: bool = True
    #: an unhealthy card (Healthy=False) stays published with device taints (DRADeviceTaints);
    #: turned off for good when the API server drops them: such cards are withdrawn instead
    device_taints: bool = True
    watch_interval: float = 1.0
    resync_interval: float = 30.0

    def __post_init__(self) -> None:
        self.reg_path = self.kubelet_dir / "plugins_registry" / f"{self.driver}-reg.sock"
        self.dra_path = self.kubelet_dir / "plugins" / self.driver / "dra.sock"
        self.checkpoint: Checkpoint = self.store.load()
        self.registered = False
        self.registration_error = ""
        self.api_error = "" if self.api is not None else "no Kubernetes API configured (--kubeconfig or in-cluster): claims cannot be read, no ResourceSlice is published"
        self.publisher = SlicePublisher(self.api, self.driver, self.node_name) if self.api is not None else None
        self.pool: Any = None
        self.inventory: Inventory | None = None
        self.in_flight = 0
        self.reconciled = False
        self.counters_note = ""
        self.capacity_note = ""
        self.taints_note = ""
        #: why a socket is not served ("" while both are)
        self.serve_error = ""
        #: the kubelet directory does not exist: no kubelet on this host (yet)
        self.no_kubelet = False
        self._wake = asyncio.Event()
        self._reg = _Socket(self.reg_path, lambda s: reg_grpc.add_RegistrationServicer_to_server(_Registration(self), s))
        #: what the health streams send (health.py): set at every refresh of the pool
        self.health = HealthFeed()
        self._dra = _Socket(self.dra_path, self._add_plugin_services)

    # -------------------------------------------------------------- serving

    def _add_plugin_services(self, server: grpc.aio.Server) -> None:
        # the kubelet dials the one endpoint it registered for DRAPlugin (each version) and for the health service
        add_services(server, self)
        add_health_servicers(server, self.health)

    async def start(self) -> None:
        """Serve both sockets; one that cannot be served (a path too long for a unix socket, a
        directory we may not write) is said once and tried again every tick: never a crash loop.
        With no kubelet directory at all there is no kubelet to serve: it waits for one, quietly."""
        await self._serve_sockets()
        if not self.serve_error and not self.no_kubelet:
            log.info("serving the kubelet", registration=str(self.reg_path), plugin=str(self.dra_path), driver=self.driver)

    async def _serve_sockets(self) -> None:
        if not self.kubelet_dir.is_dir():
            # no kubelet on this host (yet): nothing to serve, and nothing wrong - the kubelet
            # makes its directory; creating it would fail under the unit's read-only /var, and
            # did, reported as an error (the VM suite's guest)
            if not self.no_kubelet:
                log.info("no kubelet on this host: waiting for its directory", kubelet_dir=str(self.kubelet_dir))
            self.no_kubelet, self.serve_error, self.registration_error, self.registered = True, "", "", False
            return
        if self.no_kubelet:
            log.info("a kubelet directory appeared", kubelet_dir=str(self.kubelet_dir))
            self.no_kubelet = False
        errors: list[str] = []
        # the plugin socket first: the kubelet dials it as soon as it registered us
        for sock in (self._dra, self._reg):
            if not sock.gone():
                continue
            if sock.server is not None:
                log.warning("socket gone; serving it again", socket=str(sock.path))
            if sock is self._reg:
                self.registered = False
            with contextlib.suppress(PluginError, OSError, RuntimeError):
                await sock.stop(0)
            try:
                await sock.start()
            except (PluginError, OSError, RuntimeError) as exc:
                errors.append(str(exc))
        error = "; ".join(errors)
        if error and error != self.serve_error:
            log.error("cannot serve the kubelet; tried again every tick", error=error)
        elif self.serve_error and not error:
            log.info("serving the kubelet", registration=str(self.reg_path), plugin=str(self.dra_path), driver=self.driver)
        self.serve_error = error

    async def close(self) -> None:
        await self._reg.stop()
        await self._dra.stop()

    def wake(self) -> None:
        self._wake.set()

    async def run(self, stopping: asyncio.Event) -> None:
        """Keep the sockets served, reconcile once, publish on every wake and every resync interval."""
        last_publish = last_binding = -1e9
        loop = asyncio.get_running_loop()
        while not stopping.is_set():
            await self._serve_sockets()
            if not self.reconciled:
                await self.reconcile()
            due = self._wake.is_set() or loop.time() - last_publish >= self.resync_interval
            if due and self.in_flight == 0:
                self._wake.clear()
                last_publish = last_binding = loop.time()
                await self.refresh()
            elif self.binding_conditions and self.pool is not None and self.publisher is not None and loop.time() - last_binding >= BINDING_POLL_S:
                # the scheduler waits in PreBind for Ready: allocations are looked for often, not only at a resync
                last_binding = loop.time()
                await self.set_binding_conditions(self.pool)
            with contextlib.suppress(asyncio.TimeoutError):
                waiter = asyncio.ensure_future(self._wake.wait())
                stop = asyncio.ensure_future(stopping.wait())
                try:
                    await asyncio.wait({waiter, stop}, timeout=self.watch_interval, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in (waiter, stop):
                        t.cancel()
                    await asyncio.gather(waiter, stop, return_exceptions=True)
            if self._wake.is_set():
                # a burst of notices (a MIG step rescans, then the converger publishes claims): one publication
                await asyncio.sleep(0.2)

    # -------------------------------------------------------------- the pool

    async def refresh(self) -> None:
        """Read inventory and claims, plan the pool, publish it (when an API server is configured)."""
        try:
            inv = await self.calls.inventory()
            claims = await self.calls.claims()
            holds = await self.calls.claim_holds()
        except Exception as exc:  # noqa: BLE001 - the node bus is local; tried again at the next wake
            log.warning("inventory or claims unavailable; the pool is not planned now", error=str(exc) or type(exc).__name__)
            return
        self.inventory = inv
        pool = dev.plan_pool(
            inv,
            claims,
            claim_gis=claim_gis(holds, inv),
            binding_conditions=self.binding_conditions,
            mig_devices=self.mig_devices,
            shared_cards=self.shared_cards,
            device_taints=self.device_taints,
        )
        self.pool = pool
        self._gauge_pool(pool)
        if pool.known:
            # before publishing: the kubelet hears of a sick card whether or not the API server answers
            prepared = [d for e in self.checkpoint.claims.values() for d in e.devices]
            self.health.update(plan_health(inv, pool, prepared, pool_name=self.node_name))
        if self.publisher is None or not pool.known:
            return
        try:
            wrote = await self.publisher.publish(pool)
        except (KubeApiError, Conflict) as exc:
            self.api_error = clip(f"publishing ResourceSlices failed: {exc}")
            log.warning("ResourceSlices not published; tried again", error=str(exc))
            self._count(self.metrics.publishes, outcome="failed")
            self._wake.set()
            return
        self.api_error = ""
        if self.publisher.counters_dropped and self.mig_devices:
            # fail safe: without counters the scheduler could give one placement to two claims, or a
            # placement and its whole card; whole cards only until this plugin is started again
            log.error(
                "the API server dropped the MIG counters (its DRAPartitionableDevices feature is off): "
                "publishing whole cards only; enable the feature, or start with --mig-devices false to say so",
            )
            self.mig_devices = False
            self.counters_note = "the API server dropped the MIG counters (DRAPartitionableDevices off): whole cards only"
            self._wake.set()
        if self.publisher.capacity_dropped and self.shared_cards:
            # fail safe as for the counters: without allowMultipleAllocations a card is one
            # claim's, and the slices say so again; shares need the feature on and a restart
            log.error(
                "the API server dropped consumable capacity (its DRAConsumableCapacity feature is off): "
                "publishing exclusive cards; enable the feature, or start with --shared-cards false to say so",
            )
            self.shared_cards = False
            self.capacity_note = "the API server dropped consumable capacity (DRAConsumableCapacity off): cards are exclusive, not shared"
            self._wake.set()
        if self.publisher.taints_dropped and self.device_taints:
            # fail safe: an untainted unhealthy card is one the scheduler would give out; withdrawn
            # (as before device taints) until this plugin is started again
            log.error(
                "the API server dropped the device taints (its DRADeviceTaints feature is off): "
                "unhealthy cards are withdrawn from the slices; enable the feature, or start with --device-taints false to say so",
                tainted=list(pool.tainted),
            )
            self.device_taints = False
            self.taints_note = "the API server dropped device taints (DRADeviceTaints off): unhealthy cards are withdrawn, not tainted"
            if pool.tainted:
                # the slices offer the unhealthy cards untainted right now: withdrawn at once, not at the next wake
                if wrote:
                    self._count(self.metrics.publishes, outcome="ok")
                await self.refresh()
                return
            self._wake.set()
        if wrote:
            self._count(self.metrics.publishes, outcome="ok")
            log.info("ResourceSlices published", generation=self.publisher.generation, slices=self.publisher.slices, devices=len(pool.devices))
        if self.metrics.pool_generation is not None:
            self.metrics.pool_generation.set(self.publisher.generation)
        if self.binding_conditions:
            await self.set_binding_conditions(pool)

    async def set_binding_conditions(self, pool: Any) -> None:
        """Ready (or BindingFailed) on every allocated device of ours the scheduler waits for (binding.py)."""
        lister = getattr(self.api, "list_claims", None)
        writer = getattr(self.api, "replace_claim_status", None)
        if lister is None or writer is None:
            return
        try:
            claims = await lister()
        except KubeApiError as exc:
            log.warning("ResourceClaims not listed; binding conditions set at the next round", error=str(exc))
            return
        for u in plan_binding([c.raw for c in claims], driver=self.driver, pool_name=self.node_name, pool=pool, now=datetime.now(timezone.utc)):
            try:
                await writer(u.namespace, u.name, u.body)
            except (Conflict, KubeApiError) as exc:
                log.info("binding condition not written; tried again", claim=f"{u.namespace}/{u.name}", error=str(exc))
                self._wake.set()
                continue
            log.info("binding conditions set", claim=f"{u.namespace}/{u.name}", devices=dict(u.set))

    def _gauge_pool(self, pool: Any) -> None:
        g = self.metrics.published_devices
        if g is None:
            return
        for kind in ("gpu", "mig"):
            g.labels(kind=kind).set(sum(1 for d in pool.devices if d.kind == kind))

    # -------------------------------------------------------------- prepare / unprepare

    async def prepare_claim(self, claim: ClaimRef) -> PrepareResult:
        """One claim prepared, whichever DRAPlugin version the kubelet asked in (kubelet_api.py)."""
        self.in_flight += 1
        shares: dict[str, str] = {}
        try:
            devices, error = await asyncio.wait_for(self._prepare(claim, shares), PREPARE_TIMEOUT_S)
        except asyncio.TimeoutError:
            devices, error = [], f"preparing claim {claim.namespace}/{claim.name} took longer than {PREPARE_TIMEOUT_S:.0f} s"
        finally:
            self.in_flight -= 1
            self._wake.set()
        self._count(self.metrics.prepares, outcome="failed" if error else "ok")
        if error:
            log.warning("claim not prepared", claim=f"{claim.namespace}/{claim.name}", uid=claim.uid, error=error)
            return PrepareResult(error=error)
        return PrepareResult(devices=devices, share_ids=shares)

    async def _prepare(self, c: ClaimRef, share_ids: dict[str, str]) -> tuple[list[PreparedDevice], str]:
        """`share_ids` gets the shareID of each device of a shared card (device name -> id)."""
        if not _UID_RE.match(c.uid) or not c.namespace or not c.name or len(c.namespace) > 253 or len(c.name) > 253:
            return [], f"claim {c.namespace!r}/{c.name!r} uid {c.uid!r}: not a valid claim reference"
        if self.api is None:
            return [], self.api_error
        try:
            found = await self.api.get_claim(c.namespace, c.name)
        except KubeApiError as exc:
            return [], f"reading ResourceClaim {c.namespace}/{c.name} failed: {exc}"
        if found is None:
            return [], f"ResourceClaim {c.namespace}/{c.name} does not exist"
        if found.uid != c.uid:
            return [], f"ResourceClaim {c.namespace}/{c.name} has uid {found.uid}, the kubelet asked for {c.uid}"
        if not found.allocated:
            return [], f"ResourceClaim {c.namespace}/{c.name} is not allocated"
        ours = [r for r in found.results if r.driver == self.driver]
        if not ours:
            return [], ""  # nothing of ours in it: nothing to prepare
        inv = self.inventory or await self.calls.inventory()
        wanted: dict[str, ClaimDevice] = {}
        requests: dict[str, list[str]] = {}
        resolved: list[ClaimDevice] = []
        for r in ours:
            if r.pool != self.node_name:
                return [], f"device {r.device} is in pool {r.pool}, this node's pool is {self.node_name}"
            # against the pool last published too: a name that meant another card there is refused
            d = dev.resolve(inv, r.pool, r.device, node_name=self.node_name, published=self.pool)
            if d is None:
                return [], f"device {r.device} of pool {r.pool} is not one this node publishes"
            resolved.append(d)
        try:
            # the claim's opaque configs (class configs, then the claim's) and its shares: strict,
            # a config this driver cannot read fails the prepare with its name (never ignored)
            sharing = cfg.device_sharing(found.configs, driver=self.driver, results=[(r.request, d.kind) for r, d in zip(ours, resolved)])
            shares = [cfg.consumed(r.raw) for r in ours]
        except cfg.ConfigError as exc:
            return [], f"ResourceClaim {c.namespace}/{c.name}: {exc}"
        for r, d, how, (share_id, percent, memory) in zip(ours, resolved, sharing, shares):
            # adminAccess (KEP-5018) sits on the allocation result: true only, never a truthy string
            d = msgspec.structs.replace(d, sharing=how, share_id=share_id, share_percent=percent, memory_bytes=memory, admin_access=r.admin_access)
            have = wanted.setdefault(r.device, d)
            if have != d:
                return [], f"device {r.device} is allocated to two requests of the claim with other configs or shares: {', '.join(requests[r.device] + [r.request])}"
            requests.setdefault(r.device, []).append(r.request)
            if share_id:
                share_ids[r.device] = share_id
        if len(wanted) > CLAIM_DEVICES_MAX:
            return [], f"the claim has {len(wanted)} devices of {self.driver}; at most {CLAIM_DEVICES_MAX} are prepared per claim"
        req = ClaimPrepareRequest(
            uid=c.uid,
            namespace=c.namespace,
            name=c.name,
            devices=[msgspec.structs.replace(d, requests=requests[name][:32]) for name, d in wanted.items()],
        )
        entry = self.checkpoint.claims.get(c.uid)
        if entry is None or entry.state != "PrepareCompleted":
            self.checkpoint.claims[c.uid] = ClaimEntry(uid=c.uid, namespace=c.namespace, name=c.name, boot_id=self.boot_id, since=datetime.now(timezone.utc))
            await asyncio.to_thread(self.store.save, self.checkpoint)
        try:
            reply = await self.calls.prepare(req)
        except Exception as exc:  # noqa: BLE001 - the kubelet retries
            return [], f"the converger did not answer: {type(exc).__name__}: {exc}".rstrip(": ")
        if not reply.ok:
            if reply.reason != "busy" and (entry is None or entry.state != "PrepareCompleted"):
                # refused, and undone by the converger: nothing of it is left to unprepare
                self.checkpoint.claims.pop(c.uid, None)
                await asyncio.to_thread(self.store.save, self.checkpoint)
            return [], f"{reply.reason}: {reply.message}"
        self.checkpoint.claims[c.uid] = ClaimEntry(
            uid=c.uid, namespace=c.namespace, name=c.name, state="PrepareCompleted", devices=list(reply.devices), boot_id=self.boot_id, since=datetime.now(timezone.utc)
        )
        await asyncio.to_thread(self.store.save, self.checkpoint)
        self._gauge_prepared()
        log.info("claim prepared", claim=f"{c.namespace}/{c.name}", uid=c.uid, devices=[d.device for d in reply.devices])
        return list(reply.devices), ""

    async def unprepare_claim(self, claim: ClaimRef) -> str:
        """One claim unprepared ("" when done), whichever DRAPlugin version the kubelet asked in."""
        self.in_flight += 1
        try:
            error = await self._unprepare(claim.uid, f"{claim.namespace}/{claim.name}")
        finally:
            self.in_flight -= 1
            self._wake.set()
        self._count(self.metrics.unprepares, outcome="failed" if error else "ok")
        return error

    async def _unprepare(self, uid: str, what: str) -> str:
        if not _UID_RE.match(uid):
            return f"claim {what}: uid {uid!r} is not a Kubernetes uid"
        try:
            reply = await self.calls.unprepare(uid)
        except Exception as exc:  # noqa: BLE001 - the kubelet retries
            return f"the converger did not answer: {type(exc).__name__}: {exc}".rstrip(": ")
        if not reply.ok:
            log.warning("claim not unprepared; the kubelet retries", claim=what, uid=uid, error=reply.message)
            return reply.message or "not unprepared"
        if self.checkpoint.claims.pop(uid, None) is not None:
            await asyncio.to_thread(self.store.save, self.checkpoint)
        self._gauge_prepared()
        log.info("claim unprepared", claim=what, uid=uid)
        return ""

    # -------------------------------------------------------------- restart

    async def reconcile(self) -> None:
        """Checkpoint, the converger's claim holds and the API server, brought together (once, retried until done)."""
        if self.api is None:
            self.reconciled = True
            return
        try:
            holds = await self.calls.claim_holds()
        except Exception as exc:  # noqa: BLE001 - retried at the next tick
            log.debug("converger not answering yet; reconcile later", error=str(exc) or type(exc).__name__)
            return
        known = {h.uid: h for h in holds}
        refs = {uid: (e.namespace, e.name) for uid, e in self.checkpoint.claims.items()}
        refs.update({uid: (h.namespace, h.name) for uid, h in known.items() if uid not in refs})
        for uid, (ns, name) in sorted(refs.items()):
            try:
                found = await self.api.get_claim(ns, name)
            except KubeApiError as exc:
                self.api_error = clip(f"reading ResourceClaim {ns}/{name} failed: {exc}")
                log.warning("API server not answering; reconcile later", error=str(exc))
                return
            if found is None or found.uid != uid or not found.allocated:
                why = "gone" if found is None else ("has another uid" if found.uid != uid else "no longer allocated")
                log.info("claim prepared here is %s in the API server; unpreparing" % why, claim=f"{ns}/{name}", uid=uid)
                err = await self._unprepare(uid, f"{ns}/{name}")
                if err:
                    log.warning("unprepare at start failed; tried again", uid=uid, error=err)
                    return
                continue
            h = known.get(uid)
            if uid not in self.checkpoint.claims and h is not None and h.state == "prepared":
                self.checkpoint.claims[uid] = ClaimEntry(
                    uid=uid, namespace=ns, name=name, state="PrepareCompleted", devices=list(h.devices), boot_id=self.boot_id, since=h.since
                )
                await asyncio.to_thread(self.store.save, self.checkpoint)
                log.info("claim hold adopted into the checkpoint", claim=f"{ns}/{name}", uid=uid)
        self.reconciled = True
        self._gauge_prepared()

    # -------------------------------------------------------------- status

    def status(self) -> DraPluginStatus:
        pool = self.pool
        return DraPluginStatus(
            driver=self.driver,
            node_name=self.node_name,
            registered=self.registered,
            registration_error=clip(self.serve_error or self.registration_error),
            registration_socket=str(self.reg_path),
            plugin_socket=str(self.dra_path),
            api_error=clip(self.api_error),
            pool_generation=self.publisher.generation if self.publisher else 0,
            slices=self.publisher.slices if self.publisher else 0,
            devices=len(pool.devices) if pool is not None else 0,
            cards=sorted({d.pci for d in pool.devices})[:1024] if pool is not None else [],
            left_out=[clip(n) for n in (self.counters_note, self.capacity_note, self.taints_note) if n] + ([clip(n) for n in pool.notes][:1021] if pool is not None else []),
            published_at=self.publisher.published_at if self.publisher else None,
            claims=[
                DraClaimStatus(uid=e.uid, namespace=e.namespace, name=e.name, state=e.state, devices=list(e.devices), since=e.since)
                for _, e in sorted(self.checkpoint.claims.items())
            ][:4096],
            shared_cards=self.shared_cards,
            device_taints=self.device_taints,
            tainted=[clip(n) for n in pool.tainted][:1024] if pool is not None else [],
        )

    def _gauge_prepared(self) -> None:
        if self.metrics.prepared is not None:
            self.metrics.prepared.set(sum(1 for e in self.checkpoint.claims.values() if e.state == "PrepareCompleted"))

    @staticmethod
    def _count(c: Any, **labels: str) -> None:
        if c is not None:
            c.labels(**labels).inc()


class _Registration(reg_grpc.RegistrationServicer):
    def __init__(self, plugin: DraPlugin) -> None:
        self.plugin = plugin

    async def GetInfo(self, request: reg_pb.InfoRequest, context: Any) -> reg_pb.PluginInfo:  # noqa: N802 - the proto's name
        p = self.plugin
        # the DRAPlugin versions first, in the order kubelet_api.py says; the health services after
        # (a 1.34+ kubelet skips names it does not know as DRAPlugin services, 1.32/1.33 ignore them)
        return reg_pb.PluginInfo(
            type=DRA_PLUGIN_TYPE, name=p.driver, endpoint=str(p.dra_path), supported_versions=[*supported_versions(), *HEALTH_SERVICES]
        )

    async def NotifyRegistrationStatus(self, request: reg_pb.RegistrationStatus, context: Any) -> reg_pb.RegistrationStatusResponse:  # noqa: N802
        p = self.plugin
        p.registered, p.registration_error = bool(request.plugin_registered), request.error
        if p.metrics.registered is not None:
            p.metrics.registered.set(1 if p.registered else 0)
        (log.info if p.registered else log.error)("kubelet registration", registered=p.registered, error=request.error)
        return reg_pb.RegistrationStatusResponse()


__all__ = ["DraPlugin", "SlicePublisher", "Calls", "Metrics", "PluginError", "claim_gis"]
