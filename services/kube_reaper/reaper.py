"""The reaper's logic, on its ports: held checks, evictions in the background, watching, orphans.

Nothing here knows NATS: the service hands in the inventory getter and the
`Freed` publisher. One `Snapshot` is one look at the node (pod-resources,
kubepods processes, the inventory's device map); a source that cannot answer
leaves the snapshot unreachable, and an unreachable answer counts as held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.runtime import Refused
from shared.schemas import DevicesQuery, EvictReply, Freed, HeldReply, Inventory, OrphanQuery, OrphanReply

from .devices import Atom, Device, DeviceMap, InvalidAtom, holds, is_kubepods_cgroup, pod_uid, within_any
from .evictor import next_delay
from .ports import Evictor, GpuProcess, HostProcesses, PodDevice, PodResources, SourceUnreachable

#: a pod whose eviction was accepted (or that was gone) is asked again only
#: after this long: it may take its grace period to stop and leave pod-resources.
REEVICT_AFTER_S = 60.0
#: how many holders a `detail` names before it says "and N more".
DETAIL_MAX = 12


@dataclass(frozen=True)
class Holder:
    #: "namespace/pod" or "pid N"
    name: str
    device_id: str
    #: the pod ("namespace", "name") to evict; None for a process
    pod: tuple[str, str] | None = None


@dataclass
class Snapshot:
    dmap: DeviceMap
    pods: list[PodDevice] | None = None
    processes: list[GpuProcess] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def reachable(self) -> bool:
        return not self.problems

    def held_devices(self) -> list[tuple[Holder, Device]]:
        """Every GPU device of this node a pod (or a kubepods process) holds, resolved."""
        out: list[tuple[Holder, Device]] = []
        for d in self.pods or ():
            dev = self.dmap.device(d.device_id)
            if dev is not None:
                out.append((Holder(d.pod_ref, d.device_id, (d.namespace, d.pod)), dev))
        for p in self.processes or ():
            if p.gpu_uuid in self.dmap.gpus and is_kubepods_cgroup(p.cgroup):
                uid = pod_uid(p.cgroup)
                name = f"pid {p.pid}" + (f" (pod uid {uid})" if uid else "")
                out.append((Holder(name, p.gpu_uuid), Device(p.gpu_uuid)))
        return out

    def holders(self, atoms: Sequence[Atom]) -> list[Holder]:
        seen: dict[tuple[str, str], Holder] = {}
        for h, dev in self.held_devices():
            if any(holds(dev, a) for a in atoms):
                seen.setdefault((h.name, h.device_id), h)
        return list(seen.values())


def holder_names(holders: Iterable[Holder]) -> list[str]:
    return sorted({h.name for h in holders})


def describe(holders: Sequence[Holder], problems: Sequence[str] = ()) -> str:
    parts = list(problems)
    items = sorted(f"{h.name} holds {h.device_id}" for h in holders)
    parts.extend(items[:DETAIL_MAX])
    if len(items) > DETAIL_MAX:
        parts.append(f"and {len(items) - DETAIL_MAX} more")
    return "; ".join(parts)


@dataclass
class Watch:
    """An allocation whose devices were withdrawn; freed when no pod holds them."""

    allocation_id: str
    devices: list[str]
    atoms: list[Atom]
    since: float = field(default_factory=time.monotonic)


@dataclass
class Metrics:
    """The reaper's Prometheus instruments (any object with .labels()/.set() works)."""

    evictions: Any = None  # Counter [outcome]
    held_checks: Any = None  # Counter [result]
    watched: Any = None  # Gauge
    kubelet_reachable: Any = None  # Gauge


class Reaper:
    def __init__(
        self,
        *,
        pods: PodResources,
        processes: HostProcesses,
        evictor: Evictor,
        inventory: Callable[[], Awaitable[Inventory]],
        publish_freed: Callable[[Freed], Awaitable[None]],
        log: Any,
        metrics: Metrics | None = None,
        recheck_interval: float = 5.0,
        reevict_after: float = REEVICT_AFTER_S,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.pods = pods
        self.processes = processes
        self.evictor = evictor
        self._inventory = inventory
        self._publish_freed = publish_freed
        self.log = log
        self.m = metrics or Metrics()
        self.recheck_interval = max(0.05, float(recheck_interval))
        self.reevict_after = reevict_after
        self._sleep = sleep
        self.watched: dict[str, Watch] = {}
        self.evictions: dict[tuple[str, str], asyncio.Task[None]] = {}
        #: pod -> monotonic time its eviction last finished (accepted or gone)
        self.evicted_at: dict[tuple[str, str], float] = {}
        self.wake = asyncio.Event()
        self._last_inventory: Inventory | None = None
        self._last_problems: tuple[str, ...] = ()

    # ------------------------------------------------------------------ looking

    async def device_map(self, problems: list[str]) -> DeviceMap:
        try:
            inv = await self._inventory()
        except Exception as exc:  # noqa: BLE001 - any failure of the bus call is "unavailable"
            if self._last_inventory is None:
                problems.append(f"inventory unavailable: {type(exc).__name__}: {exc}".rstrip(": "))
                return DeviceMap()
            self.log.warning("inventory unavailable; using the last one", error=f"{type(exc).__name__}: {exc}")
            return DeviceMap(self._last_inventory)
        self._last_inventory = inv
        return DeviceMap(inv)

    async def snapshot(self) -> Snapshot:
        problems: list[str] = []

        async def pods() -> list[PodDevice] | None:
            try:
                found = await self.pods.list_devices()
            except SourceUnreachable as exc:
                problems.append(f"kubelet unreachable: {exc}")
                self._gauge(self.m.kubelet_reachable, 0)
                return None
            self._gauge(self.m.kubelet_reachable, 1)
            return found

        async def processes() -> list[GpuProcess] | None:
            try:
                return await self.processes.list_processes()
            except SourceUnreachable as exc:
                problems.append(f"host processes unreadable: {exc}")
                return None

        dmap, pod_list, proc_list = await asyncio.gather(self.device_map(problems), pods(), processes())
        snap = Snapshot(dmap, pod_list, proc_list, problems)
        self._note_reachability(snap)
        return snap

    def _note_reachability(self, snap: Snapshot) -> None:
        now = tuple(snap.problems)
        if now and now != self._last_problems:
            self.log.warning("cannot tell whether pods hold devices; counting them as held", reasons=list(now))
        elif not now and self._last_problems:
            self.log.info("pods and processes readable again")
        self._last_problems = now

    @staticmethod
    def _gauge(g: Any, value: float) -> None:
        if g is not None:
            g.set(value)

    @staticmethod
    def _count(c: Any, **labels: str) -> None:
        if c is not None:
            c.labels(**labels).inc()

    # ------------------------------------------------------------------ requests

    @staticmethod
    def parse_atoms(devices: Sequence[str], dmap: DeviceMap, field_name: str = "devices") -> list[Atom]:
        atoms = []
        for i, dev in enumerate(devices):
            try:
                atoms.append(dmap.atom(dev))
            except InvalidAtom as exc:
                raise Refused(f"$.{field_name}[{i}]: {exc}", code="400") from None
        return atoms

    async def held(self, q: DevicesQuery) -> HeldReply:
        self.parse_atoms(q.devices, DeviceMap())  # syntax first: a bad atom is a 400 whatever the sources say
        snap = await self.snapshot()
        atoms = self.parse_atoms(q.devices, snap.dmap)
        holders = snap.holders(atoms)
        if not snap.reachable:
            self._count(self.m.held_checks, result="unreachable")
            return HeldReply(held=True, reachable=False, holders=holder_names(holders), detail=describe(holders, snap.problems))
        self._count(self.m.held_checks, result="held" if holders else "free")
        return HeldReply(held=bool(holders), reachable=True, holders=holder_names(holders), detail=describe(holders))

    async def evict(self, q: DevicesQuery) -> EvictReply:
        self.parse_atoms(q.devices, DeviceMap())
        snap = await self.snapshot()
        atoms = self.parse_atoms(q.devices, snap.dmap)
        self.watched[q.allocation_id] = Watch(q.allocation_id, list(q.devices), atoms)
        self._gauge(self.m.watched, len(self.watched))
        self.log.info("watching withdrawn allocation", allocation_id=q.allocation_id, devices=list(q.devices))
        holders = snap.holders(atoms)
        errors = [f"{p}; evicting once it can be read" for p in snap.problems]
        evicting: set[str] = set()
        for h in holders:
            if h.pod is None:
                errors.append(f"{h.name} holds {h.device_id} but is not in pod-resources; it cannot be evicted by name")
                continue
            evicting.add(h.name)
            self._ensure_eviction(h.pod)
        if evicting and not self.evictor.enabled:
            errors.append("no evictor configured (--evictor none): the pods are not evicted")
        self.wake.set()
        return EvictReply(evicting=sorted(evicting), errors=errors)

    async def orphans(self, q: OrphanQuery) -> OrphanReply:
        self.parse_atoms(q.known_devices, DeviceMap(), "known_devices")
        snap = await self.snapshot()
        known = self.parse_atoms(q.known_devices, snap.dmap, "known_devices")
        found = sorted({f"{h.name}: {h.device_id}" for h, dev in snap.held_devices() if not within_any(dev, known)})
        return OrphanReply(reachable=snap.reachable, orphans=found)

    # ------------------------------------------------------------------ evictions

    def _ensure_eviction(self, pod: tuple[str, str]) -> None:
        if not self.evictor.enabled:
            return
        task = self.evictions.get(pod)
        if task is not None and not task.done():
            return
        finished = self.evicted_at.get(pod)
        if finished is not None and time.monotonic() - finished < self.reevict_after:
            return
        task = asyncio.create_task(self._evict(pod), name=f"evict {pod[0]}/{pod[1]}")
        self.evictions[pod] = task
        task.add_done_callback(lambda t, pod=pod: self._forget(pod, t))

    def _forget(self, pod: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self.evictions.get(pod) is task:
            del self.evictions[pod]

    async def _evict(self, pod: tuple[str, str]) -> None:
        ns, name = pod
        attempt = 0
        while True:
            result = await self.evictor.evict(ns, name)
            self._count(self.m.evictions, outcome=result.outcome)
            if result.final:
                self.evicted_at[pod] = time.monotonic()
                self.log.info("pod evicted" if result.outcome == "evicted" else "pod already gone", pod=f"{ns}/{name}", attempts=attempt + 1)
                return
            delay = next_delay(result, attempt)
            attempt += 1
            self.log.warning(
                "eviction not done; retrying",
                pod=f"{ns}/{name}",
                outcome=result.outcome,
                reason=result.detail,
                retry_in_s=round(delay, 2),
                attempt=attempt,
            )
            await self._sleep(delay)

    async def cancel_evictions(self) -> None:
        tasks = list(self.evictions.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    # ------------------------------------------------------------------ watching

    async def recheck(self) -> list[Freed]:
        """One look at every watched allocation: publish Freed for those no pod holds any more."""
        if not self.watched:
            return []
        before = dict(self.watched)
        snap = await self.snapshot()
        freed: list[Freed] = []
        wanted: set[tuple[str, str]] = set()
        for alloc, w in before.items():
            if self.watched.get(alloc) is not w:
                continue  # asked again meanwhile; the next look decides
            holders = snap.holders(w.atoms)
            wanted.update(h.pod for h in holders if h.pod is not None)
            if holders or not snap.reachable:
                continue
            msg = Freed(allocation_id=alloc, devices=list(w.devices))
            # the gauge says it before anyone hears Freed: a reader that got the notice and asks
            # the metrics at once must not see it still watched (the publish may yield first)
            self._gauge(self.m.watched, len(self.watched) - 1)
            try:
                await self._publish_freed(msg)
            except Exception as exc:  # noqa: BLE001 - the bus is away; the next look publishes again
                self._gauge(self.m.watched, len(self.watched))
                self.log.warning("could not publish freed; keeps watching", allocation_id=alloc, error=f"{type(exc).__name__}: {exc}")
                continue
            del self.watched[alloc]
            freed.append(msg)
            self.log.info("withdrawn devices free", allocation_id=alloc, devices=w.devices, watched_s=round(time.monotonic() - w.since, 1))
        self._gauge(self.m.watched, len(self.watched))
        for pod in wanted:
            self._ensure_eviction(pod)
        if snap.reachable:
            # a pod that no longer holds a watched device needs no more asking
            for pod, task in list(self.evictions.items()):
                if pod not in wanted:
                    task.cancel()
        return freed

    async def watch(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=self.recheck_interval)
            self.wake.clear()
            if stopping.is_set():
                return
            try:
                await self.recheck()
            except Exception:  # noqa: BLE001 - keep watching; the error is logged
                self.log.exception("recheck failed")


__all__ = ["Reaper", "Snapshot", "Holder", "Watch", "Metrics", "REEVICT_AFTER_S", "describe", "holder_names"]
