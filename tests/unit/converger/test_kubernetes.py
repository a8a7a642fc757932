"""Kubernetes holds and their split release (seed: "Kubernetes releases"), in process on real files."""

from __future__ import annotations

import json
import os
import stat
from datetime import datetime, timedelta, timezone

import pytest

from services.converger.crash import KUBE_POINTS
from services.converger.plan import UNREADABLE_RELEASES_HOLDER
from services.converger.releases import RELEASES_FILE, UNREADABLE_MARKER
from tests.converger_kit import GPU, FakeReaper, Node, hold, spec

KUBE = "BINDING_KUBERNETES"
T0 = datetime(2026, 11, 30, 8, 0, tzinfo=timezone.utc)


def kube(alloc: str, *devices: str):
    return hold(alloc, *devices, binding=KUBE)


def conditions(node: Node) -> list[dict]:
    return [e["condition"] for e in node.outbox.of_type("condition")]


async def test_a_kubernetes_hold_has_no_slice_and_cdi_without_visible_devices(tmp_path):
    node = Node(tmp_path)
    # limits on a Kubernetes hold are the kubelet's business: never a slice
    s = spec(1, hold("k1", GPU[0], binding=KUBE, cpus="0-3", memory_bytes=1 << 30))
    p, r = await node.converge(s)
    assert not r.errors and p.kinds() == ["BindHold"]
    cdi = node.holds()["k1"]
    assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in cdi["containerEdits"]["env"])
    assert "bcd.dev/cgroup-parent" not in cdi["annotations"]
    assert f"NVIDIA_VISIBLE_DEVICES={GPU[0]}" in node.env("k1").splitlines()
    assert node.slice_names() == []
    bound = node.outbox.reports("bound", node.signer)
    assert bound[0].event.cgroup_parent == ""


async def test_split_release_records_first_withdraws_claims_and_reports_once_free(tmp_path):
    reaper = FakeReaper(pod_atoms={GPU[0]})  # a pod still has the GPU
    node = Node(tmp_path, reaper=reaper)
    node.now = T0
    await node.converge(spec(1, kube("k1", GPU[0])))

    # generation 2 drops k1 and wants its GPU for another hold
    s2 = spec(2, hold("other", GPU[0]))
    p, r = await node.converge(s2)
    assert p.kinds()[:1] == ["WithdrawKubeHold"]
    record = json.loads((tmp_path / "data" / RELEASES_FILE).read_text())["releases"]["k1"]
    assert record["devices"] == [GPU[0]] and record["generation"] == 2 and record["since"].startswith("2026-11-30T08:00")
    assert stat.S_IMODE((tmp_path / "data" / RELEASES_FILE).stat().st_mode) == 0o600
    assert "k1" not in node.holds() and node.env("k1") is None
    assert reaper.evictions == [("k1", [GPU[0]])]
    # the device plugin was told after the files went and before any eviction was asked
    assert node.consumers.withdrawals == [("k1", 0, False)]
    # not reported while a pod holds it; its GPU stays claimed
    assert node.outbox.of_type("released") == []
    failed = node.outbox.of_type("failed")
    assert [(f["allocation_id"], f["reason"]) for f in failed] == [("other", "overlap")]
    assert "k1 (pending Kubernetes release)" in failed[0]["message"]
    assert p.pending == ("k1",)

    # still held on the next pass: nothing new
    p, r = await node.converge(s2)
    assert node.outbox.of_type("released") == [] and p.pending == ("k1",)

    # the pod is gone: Released once, the record dropped; a later generation binds the GPU
    reaper.pod_atoms.clear()
    p, r = await node.converge(s2)
    assert "ReportKubeRelease" in p.kinds()
    released = node.outbox.reports("released", node.signer)
    assert [(b.event.allocation_id, b.event.generation, b.event.devices) for b in released] == [("k1", 2, [GPU[0]])]
    assert json.loads((tmp_path / "data" / RELEASES_FILE).read_text())["releases"] == {}
    p, r = await node.converge(spec(3, hold("other", GPU[0])))
    assert set(node.holds()) == {"other"}
    assert node.plan(spec(3, hold("other", GPU[0]))).steps == ()


async def test_an_unreachable_kubelet_counts_as_held(tmp_path):
    reaper = FakeReaper(reachable=False)
    node = Node(tmp_path, reaper=reaper)
    await node.converge(spec(1, kube("k1", GPU[0])))
    await node.converge(spec(2))
    await node.converge(spec(2))
    assert node.outbox.of_type("released") == []
    reaper.reachable = True
    await node.converge(spec(2))
    assert [b.event.allocation_id for b in node.outbox.reports("released", node.signer)] == ["k1"]


async def test_a_spec_that_wants_it_again_takes_the_release_back_unreported(tmp_path):
    reaper = FakeReaper(pod_atoms={GPU[0]})
    node = Node(tmp_path, reaper=reaper)
    await node.converge(spec(1, kube("k1", GPU[0])))
    await node.converge(spec(2))
    assert "k1" not in node.holds()
    p, r = await node.converge(spec(3, kube("k1", GPU[0])))
    assert p.kinds()[0] == "DropPendingRelease"
    assert not r.errors
    # files back, as bound at generation 1, and no second Bound, no Released
    assert node.holds()["k1"]["annotations"]["bcd.dev/generation"] == "1"
    assert node.env("k1") is not None
    assert [b.event.generation for b in node.outbox.reports("bound", node.signer)] == [1]
    assert node.outbox.of_type("released") == []
    assert json.loads((tmp_path / "data" / RELEASES_FILE).read_text())["releases"] == {}
    assert node.plan(spec(3, kube("k1", GPU[0]))).steps == ()


async def test_a_release_pending_over_5_minutes_raises_kubernetes_release_stuck_on_fake_time(tmp_path):
    reaper = FakeReaper(pod_atoms={GPU[0]})
    node = Node(tmp_path, reaper=reaper)
    node.now = T0
    await node.converge(spec(1, kube("k1", GPU[0])))
    await node.converge(spec(2))
    node.now = T0 + timedelta(minutes=4, seconds=59)
    await node.converge(spec(2))
    assert conditions(node) == []
    node.now = T0 + timedelta(minutes=5, seconds=1)
    await node.converge(spec(2))
    (raised,) = conditions(node)
    assert (raised["type"], raised["status"], raised["reason"]) == ("KubernetesReleaseStuck", "True", "PodsHoldDevices")
    assert "k1" in raised["message"]
    # raised once, not on every pass
    node.now = T0 + timedelta(minutes=7)
    await node.converge(spec(2))
    assert len(conditions(node)) == 1
    # resolved: released, and the condition cleared
    reaper.pod_atoms.clear()
    await node.converge(spec(2))
    cleared = conditions(node)[-1]
    assert (cleared["type"], cleared["status"]) == ("KubernetesReleaseStuck", "False")
    assert [b.event.allocation_id for b in node.outbox.reports("released", node.signer)] == ["k1"]


async def test_an_unreadable_releases_file_claims_every_gpu_until_no_orphans(tmp_path):
    reaper = FakeReaper()
    node = Node(tmp_path, reaper=reaper)
    (tmp_path / "data").mkdir(parents=True, exist_ok=True)
    (tmp_path / "data" / RELEASES_FILE).write_text("{not json")
    p, r = await node.converge(spec(1, hold("a1", GPU[0]), hold("a2", f"{GPU[4]}/slot0")))
    kept = [f for f in os.listdir(tmp_path / "data") if f.startswith(f"{RELEASES_FILE}.unreadable-")]
    assert len(kept) == 1 and (tmp_path / "data" / kept[0]).read_text() == "{not json"
    assert (tmp_path / "data" / UNREADABLE_MARKER).exists()
    failed = node.outbox.of_type("failed")
    assert {f["reason"] for f in failed} == {"overlap"}
    assert all(UNREADABLE_RELEASES_HOLDER in f["message"] for f in failed)
    (raised,) = conditions(node)
    assert (raised["type"], raised["status"], raised["reason"]) == ("KubernetesReleasesUnreadable", "True", "ReleasesFileUnreadable")

    # the marker stays (and every GPU stays claimed) while orphans cannot be ruled out
    p, r = await node.converge(spec(2, hold("a1", GPU[0])))
    assert node.holds() == {} and (tmp_path / "data" / UNREADABLE_MARKER).exists()

    # the reaper establishes that no pod holds a GPU of an unknown allocation
    reaper.orphans_clear = True
    p, r = await node.converge(spec(3, hold("a1", GPU[0])))
    assert not (tmp_path / "data" / UNREADABLE_MARKER).exists()
    assert set(node.holds()) == {"a1"}
    assert conditions(node)[-1]["status"] == "False"
    assert kept == [f for f in os.listdir(tmp_path / "data") if f.startswith(f"{RELEASES_FILE}.unreadable-")]


async def test_an_operator_removing_the_marker_frees_the_gpus(tmp_path):
    node = Node(tmp_path)
    (tmp_path / "data").mkdir(parents=True, exist_ok=True)
    (tmp_path / "data" / UNREADABLE_MARKER).write_text("set by a test\n")
    await node.converge(spec(1, hold("a1", GPU[0])))
    assert node.holds() == {}
    (tmp_path / "data" / UNREADABLE_MARKER).unlink()
    await node.converge(spec(2, hold("a1", GPU[0])))
    assert set(node.holds()) == {"a1"}


@pytest.mark.parametrize("point", KUBE_POINTS)
async def test_a_crash_during_the_split_release_loses_no_release(tmp_path, point):
    class Crash(Exception):
        pass

    def crash_at(name):
        def hook(p):
            if p == name:
                raise Crash(p)

        return hook

    reaper = FakeReaper(pod_atoms={GPU[0]})
    node = Node(tmp_path, reaper=reaper)
    await node.converge(spec(1, kube("k1", GPU[0])))
    if point == "kube.published":
        await node.converge(spec(2))  # withdrawn; then the pod goes and the report crashes
        reaper.pod_atoms.clear()
    node = node.restart(crash=crash_at(point))
    with pytest.raises(Crash):
        await node.converge(spec(2))
    node = node.restart()
    reaper.pod_atoms.clear()
    for _ in range(3):
        await node.converge(spec(2))
    assert node.holds() == {} and node.env("k1") is None
    assert node.outbox.ids("released") == ["node-1.k1.released.g2"]
    assert json.loads((tmp_path / "data" / RELEASES_FILE).read_text())["releases"] == {}
