"""kube_reaper's logic on its ports with fakes: held, evictions and their backoff, watching, orphans.

The protocols themselves (the kubelet's gRPC, the Eviction API over HTTP) are
exercised against real peers in tests/integration/test_kube_reaper.py; here
the backends are the fakes that implement the same ports.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone

import pytest
from nats.micro.request import ServiceError

from services.kube_reaper.evictor import (
    BACKOFF_MAX_S,
    RETRY_AFTER_MAX_S,
    KubernetesEvictor,
    NoEvictor,
    next_delay,
    parse_retry_after,
)
from services.kube_reaper.podresources import FakePodResources
from services.kube_reaper.ports import EvictionResult, GpuProcess, PodDevice, SourceUnreachable
from services.kube_reaper.processes import FakeHostProcesses, NoHostProcesses, NvmlHostProcesses, cgroup_of
from services.kube_reaper.reaper import Reaper
from shared.schemas import DevicesQuery, Freed, OrphanQuery

from .test_kube_reaper_mapping import A, B, C, MIG_B10, MIG_B20, inventory

KUBEPODS = "/kubepods/besteffort/pod0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f/4a7c"


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda msg, **fields: self.lines.append((level, msg, fields))


class ScriptedEvictor:
    """An Evictor answering from a script, then `default`; records every call."""

    enabled = True

    def __init__(self, *script: EvictionResult, default: EvictionResult = EvictionResult("evicted"), on_evicted=None) -> None:
        self.script = list(script)
        self.default = default
        self.calls: list[tuple[str, str]] = []
        self.on_evicted = on_evicted

    async def evict(self, namespace: str, pod: str) -> EvictionResult:
        self.calls.append((namespace, pod))
        result = self.script.pop(0) if self.script else self.default
        if result.outcome == "evicted" and self.on_evicted:
            self.on_evicted(namespace, pod)
        return result

    async def close(self) -> None:
        return None


class Processes:
    def __init__(self, *procs: GpuProcess) -> None:
        self.procs = list(procs)
        self.unreachable = ""

    async def list_processes(self) -> list[GpuProcess]:
        if self.unreachable:
            raise SourceUnreachable(self.unreachable)
        return list(self.procs)

    async def close(self) -> None:
        return None


def make(pods=(), processes=None, evictor=None, inv=True, **kw):
    freed: list[Freed] = []
    fake_pods = FakePodResources(pods)

    async def get_inventory():
        if inv is True:
            return inventory()
        raise TimeoutError("inventory did not answer")

    async def publish(msg: Freed) -> None:
        freed.append(msg)

    r = Reaper(
        pods=fake_pods,
        processes=processes or Processes(),
        evictor=evictor or ScriptedEvictor(),
        inventory=get_inventory,
        publish_freed=publish,
        log=Log(),
        **kw,
    )
    return r, fake_pods, freed


def pod(name: str, device_id: str, ns: str = "ml") -> PodDevice:
    return PodDevice(ns, name, "main", "nvidia.com/gpu", device_id)


def q(*devices: str, alloc: str = "alloc_1") -> DevicesQuery:
    return DevicesQuery(allocation_id=alloc, devices=list(devices))


# --------------------------------------------------------------------------- backoff


def test_retry_after_is_honoured_and_capped():
    assert next_delay(EvictionResult("throttled", retry_after=1.0), 5) == 1.0
    assert next_delay(EvictionResult("throttled", retry_after=3600.0), 0) == RETRY_AFTER_MAX_S
    # without Retry-After a 429 backs off like a 5xx
    assert next_delay(EvictionResult("throttled"), 0) == 0.5
    assert [next_delay(EvictionResult("server_error"), a) for a in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert next_delay(EvictionResult("server_error"), 60) == BACKOFF_MAX_S


def test_parse_retry_after():
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert parse_retry_after("1") == 1.0
    assert parse_retry_after(" 30 ") == 30.0
    assert parse_retry_after("Thu, 01 Jan 2026 12:00:10 GMT", now) == 10.0
    assert parse_retry_after("Thu, 01 Jan 2026 11:00:00 GMT", now) == 0.0
    assert parse_retry_after(None) is None and parse_retry_after("") is None and parse_retry_after("soon") is None


# --------------------------------------------------------------------------- held


async def test_held_by_pods_and_processes_and_free_otherwise():
    r, _, _ = make(
        pods=[pod("a", f"{A}::1"), pod("m", MIG_B10)],
        processes=Processes(GpuProcess(7, C, KUBEPODS), GpuProcess(8, B, "/user.slice/x.scope")),
    )
    got = await r.held(q(A))
    assert (got.held, got.reachable, got.holders) == (True, True, ["ml/a"])
    got = await r.held(q(f"{B}/gi2/ci0"))
    assert (got.held, got.reachable, got.holders) == (False, True, [])
    got = await r.held(q(f"{B}/gi1/ci0", f"{B}/gi2/ci0"))
    assert got.holders == ["ml/m"]
    got = await r.held(q(f"{C}/slot1"))
    assert got.held and got.holders == ["pid 7 (pod uid 0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f)"]


@pytest.mark.parametrize("broken", ["pods", "processes", "inventory"])
async def test_any_source_unreachable_counts_as_held(broken):
    procs = Processes()
    r, fake_pods, _ = make(processes=procs, inv=broken != "inventory")
    if broken == "pods":
        fake_pods.unreachable = "socket gone"
    if broken == "processes":
        procs.unreachable = "NVML is not available"
    got = await r.held(q(A))
    assert (got.held, got.reachable) == (True, False)
    assert {"pods": "kubelet unreachable: socket gone", "processes": "NVML is not available", "inventory": "inventory unavailable"}[broken] in got.detail
    assert (await r.orphans(OrphanQuery())).reachable is False


async def test_the_last_inventory_stands_in_while_the_inventory_is_away():
    calls = {"n": 0}
    r, _, _ = make(pods=[pod("m", MIG_B20)])

    async def flaky():
        calls["n"] += 1
        if calls["n"] > 1:
            raise TimeoutError("no answer")
        return inventory()

    r._inventory = flaky
    assert (await r.held(q(f"{B}/gi2/ci0"))).held
    got = await r.held(q(f"{B}/gi2/ci0"))
    assert (got.held, got.reachable, got.holders) == (True, True, ["ml/m"])


async def test_invalid_atoms_are_400_before_any_source_is_asked():
    r, fake_pods, _ = make()
    with pytest.raises(ServiceError) as err:
        await r.held(q(A, "GPU-x/gi1"))
    assert err.value.code == "400" and "$.devices[1]" in err.value.description
    with pytest.raises(ServiceError) as err:
        await r.orphans(OrphanQuery(known_devices=["nope"]))
    assert err.value.code == "400" and "$.known_devices[0]" in err.value.description
    assert fake_pods.calls == 0


async def test_orphans_are_pod_devices_outside_known_atoms():
    r, _, _ = make(
        pods=[pod("a", A), pod("m", MIG_B10), pod("other", "GPU-99999999-0000-4000-8000-000000000009"), pod("n", MIG_B20)],
        processes=Processes(GpuProcess(7, C, KUBEPODS)),
    )
    got = await r.orphans(OrphanQuery(known_devices=[A, f"{B}/gi2/ci0"]))
    assert got.reachable
    assert got.orphans == [f"ml/m: {MIG_B10}", f"pid 7 (pod uid 0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f): {C}"]
    got = await r.orphans(OrphanQuery(known_devices=[A, B, f"{C}/slot0"]))
    assert got.orphans == []


# --------------------------------------------------------------------------- evict and watch


async def test_evict_retries_until_evicted_then_frees_exactly_once():
    pods = [pod("a", A), pod("bystander", f"{C}::0")]
    sleeps: list[float] = []

    async def fast_sleep(delay: float) -> None:
        sleeps.append(delay)
        await asyncio.sleep(0)

    r, fake_pods, freed = make(pods=pods, sleep=fast_sleep)
    r.evictor = ScriptedEvictor(
        EvictionResult("throttled", retry_after=1.0),
        EvictionResult("server_error"),
        EvictionResult("unavailable", "connection refused"),
        on_evicted=lambda ns, name: fake_pods.devices.remove(pod(name, A)),
    )
    reply = await r.evict(q(A))
    assert (reply.evicting, reply.errors) == (["ml/a"], [])
    await asyncio.gather(*r.evictions.values())
    assert r.evictor.calls == [("ml", "a")] * 4
    assert sleeps == [1.0, 1.0, 2.0]  # Retry-After, then backoff by attempt
    assert await r.recheck() == [Freed(allocation_id="alloc_1", devices=[A])]
    assert freed == [Freed(allocation_id="alloc_1", devices=[A])]
    assert await r.recheck() == [] and len(freed) == 1
    assert r.watched == {}


async def test_a_pod_already_gone_is_not_asked_again_at_once():
    r, _, freed = make(pods=[pod("a", A)], evictor=ScriptedEvictor(default=EvictionResult("gone", "HTTP 404")), reevict_after=60)
    await r.evict(q(A))
    await asyncio.gather(*r.evictions.values())
    for _ in range(3):
        await r.recheck()
    assert r.evictor.calls == [("ml", "a")]
    assert freed == [] and "alloc_1" in r.watched  # still listed by the kubelet: still held
    await r.cancel_evictions()


async def test_unreachable_kubelet_never_frees_and_keeps_watching():
    r, fake_pods, freed = make()
    fake_pods.unreachable = "socket gone"
    reply = await r.evict(q(A))
    assert reply.evicting == [] and reply.errors and "socket gone" in reply.errors[0]
    assert await r.recheck() == [] and freed == []
    fake_pods.unreachable = ""
    assert [f.allocation_id for f in await r.recheck()] == ["alloc_1"]


async def test_evictions_stop_when_the_pod_no_longer_holds_watched_devices():
    never = asyncio.Event()

    class Blocking(ScriptedEvictor):
        async def evict(self, namespace, name):
            self.calls.append((namespace, name))
            await never.wait()
            return EvictionResult("evicted")

    r, fake_pods, freed = make(pods=[pod("a", A)], evictor=Blocking())
    await r.evict(q(A))
    await asyncio.sleep(0)
    task = r.evictions[("ml", "a")]
    fake_pods.devices = []  # the pod went away by itself
    assert [f.allocation_id for f in await r.recheck()] == ["alloc_1"]
    with pytest.raises(asyncio.CancelledError):
        await task
    assert r.evictions == {}


async def test_evictor_none_watches_but_evicts_nothing():
    evictor = NoEvictor()
    r, fake_pods, freed = make(pods=[pod("a", A)], evictor=evictor)
    reply = await r.evict(q(A))
    assert reply.evicting == ["ml/a"]
    assert any("--evictor none" in e for e in reply.errors)
    assert r.evictions == {} and evictor.requests == []
    fake_pods.devices = []
    assert len(await r.recheck()) == 1


async def test_a_kubepods_process_outside_pod_resources_is_reported_not_evicted():
    r, _, _ = make(processes=Processes(GpuProcess(7, A, KUBEPODS)))
    reply = await r.evict(q(A))
    assert reply.evicting == []
    assert reply.errors and reply.errors[0].startswith("pid 7 (pod uid 0f5e2b7c-1a2b-4c3d-8e9f-0a1b2c3d4e5f) holds")


async def test_the_watch_loop_rechecks_on_its_interval_and_stops():
    r, fake_pods, freed = make(pods=[pod("a", A)], evictor=NoEvictor(), recheck_interval=0.05)
    stopping = asyncio.Event()
    loop = asyncio.create_task(r.watch(stopping))
    await r.evict(q(A))
    await asyncio.sleep(0.2)
    assert freed == []
    fake_pods.devices = []
    for _ in range(50):
        if freed:
            break
        await asyncio.sleep(0.02)
    assert [f.allocation_id for f in freed] == ["alloc_1"]
    stopping.set()
    r.wake.set()
    await asyncio.wait_for(loop, 2)


# --------------------------------------------------------------------------- backends


async def test_fake_host_processes_are_read_again_on_every_query(tmp_path):
    host = tmp_path / "host.json"
    backend = FakeHostProcesses(host)
    with pytest.raises(SourceUnreachable):
        await backend.list_processes()
    host.write_text(json.dumps({"processes": [{"pid": 1, "gpu_uuid": A, "cgroup": KUBEPODS}]}))
    assert await backend.list_processes() == [GpuProcess(1, A, KUBEPODS)]
    host.write_text(json.dumps({"gpus": []}))
    assert await backend.list_processes() == []
    host.write_text(json.dumps({"processes": [{"gpu_uuid": A}]}))
    with pytest.raises(SourceUnreachable, match=r"processes\[0\]"):
        await backend.list_processes()
    assert await NoHostProcesses().list_processes() == []


async def test_nvml_backend_without_nvml_is_unreachable_not_a_crash(tmp_path):
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML is available on this host")
    backend = NvmlHostProcesses(tmp_path)
    with pytest.raises(SourceUnreachable, match="NVML is not available"):
        await backend.list_processes()
    with pytest.raises(SourceUnreachable, match="NVML is not available"):
        await backend.list_processes()  # and again, not stuck half-initialised
    await backend.close()


def test_cgroup_of_prefers_a_kubepods_hierarchy():
    v1 = "12:pids:/user.slice\n11:devices:/kubepods/besteffort/pod1/c\n0::/\n"
    assert cgroup_of(v1) == "/kubepods/besteffort/pod1/c"
    assert cgroup_of("0::/user.slice/user-1000.slice\n") == "/user.slice/user-1000.slice"
    assert cgroup_of("") == ""


async def test_kubernetes_evictor_without_credentials_is_unavailable_not_a_crash(tmp_path):
    evictor = KubernetesEvictor(tmp_path / "no-such-kubeconfig", in_cluster="false")
    result = await evictor.evict("ml", "a")
    assert result.outcome == "unavailable" and "Kubernetes credentials" in result.detail
    assert not result.final
    await evictor.close()
    in_cluster = KubernetesEvictor(None, in_cluster="true")
    result = await in_cluster.evict("ml", "a")
    assert result.outcome == "unavailable"
    await in_cluster.close()


def test_retry_after_dates_in_the_past_wait_nothing():
    past = (datetime.now(timezone.utc) - timedelta(minutes=5)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert parse_retry_after(past) == 0.0


async def test_a_failed_freed_publish_keeps_the_watch_and_publishes_later():
    r, _, freed = make()
    failures = {"left": 1}
    publish = r._publish_freed

    async def flaky(msg: Freed) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise ConnectionError("bus away")
        await publish(msg)

    r._publish_freed = flaky
    await r.evict(q(A))
    assert await r.recheck() == [] and "alloc_1" in r.watched
    assert [f.allocation_id for f in await r.recheck()] == ["alloc_1"]
    assert len(freed) == 1 and r.watched == {}
    assert any(level == "warning" and "could not publish freed" in msg for level, msg, _ in r.log.lines)


async def test_the_watched_gauge_says_freed_before_the_notice_goes_out():
    """Whoever hears Freed and reads the metrics at once sees the allocation no longer watched
    (a CI run under load caught the gauge a notice behind)."""
    from services.kube_reaper.reaper import Metrics

    class Gauge:
        value = None

        def set(self, v):
            self.value = v

    gauge = Gauge()
    r, _, freed = make(metrics=Metrics(watched=gauge))
    seen: list[float] = []
    publish = r._publish_freed

    async def looking(msg: Freed) -> None:
        seen.append(gauge.value)
        await publish(msg)

    r._publish_freed = looking
    await r.evict(q(A))
    await r.evict(q(B, alloc="alloc_2"))
    assert gauge.value == 2
    await r.recheck()
    assert seen == [1, 0] and gauge.value == 0 and len(freed) == 2
