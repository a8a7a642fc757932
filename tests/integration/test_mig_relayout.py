"""The MIG re-layout its Kubernetes Node asks for, end to end: real processes (inventory on the fake
host, kube_reaper, converger, signer) on a real node bus, the API server stand-in with the Node, pods
on it, their evictions and PodDisruptionBudgets, and the kubelet's pod-resources API over the same pods.

Each step's effect on the Node (state label, paused gpu.deploy labels, taint, cordon) and on the pods
(only those using the card evicted), the card's layout in the host file, the holds' refusal, a kill -9
of the converger at each step, a rollback, `all-disabled`, a drain a budget blocks, and a node with no
MIG card. The same rules alone, on fakes: tests/unit/converger/test_relayout*.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from services.converger.crash import RELAYOUT_POINTS
from shared.runtime import call
from shared.schemas import CONVERGER_STATUS_CODEC, SPEC_ACK_CODEC, ConvergerStatus, DeviceAssignment, Empty, NodeSpec
from shared.subjects import NodeSubjects

from .harness import EXAMPLE_HOSTS
from .kube_peers import KubeletServer
from .kubeapi_standin import KubeApiStandIn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NODE = "node-1"
MIG_CARD = "0000:db:00.0"
MIG_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000008"
PLAIN_CARD = "0000:18:00.0"
PLAIN_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000001"
CFG, ST = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
DP = "nvidia.com/gpu.deploy.device-plugin"
MSG = "bcd.dev/mig.config.message"
ALL7 = ["1g.18gb"] * 7


def host_file(tmp: Path, *, mig_card: bool = True, mig_on: bool = False, fault: str = "") -> Path:
    """h200x8 with one MIG-capable card (db:00.0, MIG off unless `mig_on`) and none other: ba:00.0 loses
    its profiles. No GPU processes (the example's kubepods process would hold a card for good)."""
    data = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
    data["processes"] = []
    for g in data["gpus"]:
        if g["pci_address"] == "0000:ba:00.0" or (g["pci_address"] == MIG_CARD and not mig_card):
            g["mig_mode"], g["mig_profiles"], g["mig_instances"] = False, [], []
        elif g["pci_address"] == MIG_CARD:
            g["mig_mode"] = mig_on
            g["mig_instances"] = [
                {"gi": 1, "ci": 0, "profile": "3g.71gb", "uuid": "MIG-5f1c2a90-0000-4000-8000-0000000000d1", "placement_start": 0}
            ] if mig_on else []
            if fault:
                g["faults"] = {"mig": fault}
    path = tmp / "host.json"
    path.write_text(json.dumps(data))
    return path


def card_layout(host: Path) -> list[str] | str:
    g = next(g for g in json.loads(host.read_text())["gpus"] if g["pci_address"] == MIG_CARD)
    if not g.get("mig_mode"):
        return "all-disabled"
    return sorted(m["profile"] for m in g.get("mig_instances", []))


class Rig:
    def __init__(self, node_bus, tmp: Path, api: KubeApiStandIn, host: Path) -> None:
        self.bus, self.tmp, self.api, self.host = node_bus, tmp, api, host
        self.subjects = NodeSubjects(node_bus.node_id)
        self.common = {"BCD_FAKE_HOST": str(host), "BCD_ADAPTER": "fakehw"}
        self.converger = None
        self.cli = None

    async def start(self, *, converger_env: dict[str, str] | None = None) -> "Rig":
        sock = self.tmp / "kubelet.sock"
        self.kubelet = KubeletServer(self.api.kubelet_pods(NODE), sock).start()
        kubeconfig = self.api.write_kubeconfig(self.tmp / "kubeconfig")
        self.bus.start_service("signer", **self.common)
        self.bus.start_service("inventory", **self.common)
        self.bus.start_service(
            "kube_reaper",
            **self.common,
            BCD_POD_RESOURCES_SOCKET=str(sock),
            BCD_KUBECONFIG=str(kubeconfig),
            BCD_PROCESSES="none",
            BCD_RECHECK_INTERVAL="0.3",
            BCD_NODE_NAME=NODE,
            NO_PROXY="127.0.0.1,localhost",
        )
        for name in ("signer", "inventory", "kube_reaper"):
            await self.bus.wait_service(name)
        await self.start_converger(**(converger_env or {}))
        self.cli = await self.bus.connect("cli")
        return self

    async def start_converger(self, **env: str):
        self.converger = self.bus.start_service(
            "converger", **self.common, BCD_RETRY_INTERVAL="0.5", BCD_RELAYOUT_INTERVAL="0.2", **env
        )
        await self.bus.wait_service("converger")
        return self.converger

    def stop(self) -> None:
        self.kubelet.stop()

    async def status(self) -> ConvergerStatus:
        return await call(self.cli, self.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=10)

    async def status_until(self, ok, timeout: float = 20.0) -> ConvergerStatus:
        deadline = time.monotonic() + timeout
        while True:
            st = await self.status()
            if ok(st) or time.monotonic() > deadline:
                return st
            await asyncio.sleep(0.2)

    def labels(self) -> dict[str, str]:
        return self.api.node(NODE)["metadata"].get("labels", {})

    def node(self) -> dict:
        return self.api.node(NODE)

    async def until(self, what: str, check, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            await asyncio.sleep(0.2)
        raise AssertionError(f"{what}: not within {timeout:.0f} s; Node {json.dumps(self.node())}\nconverger log:\n{self.converger.log()[-3000:]}")

    def clean(self) -> None:
        node = self.node()
        taints = node.get("spec", {}).get("taints") or []
        assert not [t for t in taints if t["key"] == "mig-reconfigure"], taints
        assert not node.get("spec", {}).get("unschedulable"), node["spec"]
        assert "paused-for-mig-change" not in node["metadata"].get("labels", {}).values()


@pytest.fixture
def api():
    server = KubeApiStandIn().start()
    try:
        yield server
    finally:
        server.stop()


async def rig(node_bus, tmp_path, api, host, **kw) -> Rig:
    r = Rig(node_bus, tmp_path, api, host)
    await r.start(**kw)
    return r


def pods_on_the_node(api: KubeApiStandIn) -> None:
    api.add_pod("team-a", "trainer-0", NODE, labels={"app": "trainer"}, devices={"nvidia.com/gpu": [MIG_UUID]})
    api.add_pod("team-b", "other-0", NODE, labels={"app": "other"}, devices={"nvidia.com/gpu": [PLAIN_UUID]})
    api.add_pod("team-c", "cpu-only", NODE, labels={"app": "web"})


async def test_the_node_label_relays_the_card_out_and_back_in(node_bus, tmp_path, api):
    host = host_file(tmp_path)
    api.add_node(NODE, labels={DP: "true", "nvidia.com/gpu.deploy.dcgm-exporter": "true", "kubernetes.io/hostname": NODE}, taints=[{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}])
    pods_on_the_node(api)
    r = await rig(node_bus, tmp_path, api, host)
    try:
        api.label_node(NODE, {CFG: "all-1g.18gb"})
        # pending: the GPU clients paused, the taint and the cordon on, while the drain runs
        await r.until("pending with the clients paused", lambda: r.labels().get(ST) == "pending" and r.labels().get(DP) == "paused-for-mig-change")
        await r.until("success", lambda: r.labels().get(ST) == "success")
        assert card_layout(host) == ALL7
        labels = r.labels()
        assert labels[DP] == "true" and labels["nvidia.com/gpu.deploy.dcgm-exporter"] == "true" and labels[CFG] == "all-1g.18gb"
        r.clean()
        taints = r.node()["spec"].get("taints") or []
        assert taints == [{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}], "a taint the flow did not add stays"
        # only the pod using the card was evicted
        evicted = {(e.namespace, e.pod) for e in api.evictions() if e.status == "Success"}
        assert evicted == {("team-a", "trainer-0")}, evicted
        assert api.pod("team-b", "other-0") is not None and api.pod("team-c", "cpu-only") is not None
        # what the Node went through: pending with the taint and cordon in one change, the end in another
        sent = [q.body for q in api.requests_to("PATCH", f"/api/v1/nodes/{NODE}")]
        assert any(p.get("spec", {}).get("unschedulable") is True and (p.get("metadata", {}).get("labels") or {}).get(ST) == "pending" for p in sent), sent
        # the journal says done a moment after the Node does (the finish change goes first)
        st = await r.status_until(lambda s: s.relayout is not None and s.relayout.running is None and s.relayout.last is not None)
        assert st.relayout.last.outcome == "success"
        assert [c.pci_address for c in st.relayout.last.cards] == [MIG_CARD], "a card without MIG is never part of it"

        # the rollback: all-disabled turns MIG off the same way, then both labels go
        api.label_node(NODE, {CFG: "all-disabled"})
        await r.until("both labels removed", lambda: CFG not in r.labels() and ST not in r.labels())
        assert card_layout(host) == "all-disabled"
        r.clean()
        await r.status_until(lambda s: s.relayout is not None and s.relayout.running is None)
        await asyncio.sleep(1.0)
        assert (await r.status()).relayout.running is None, "nothing runs once the labels are gone"
    finally:
        r.stop()


@pytest.mark.parametrize("point", RELAYOUT_POINTS)
async def test_a_kill_9_of_the_converger_at_each_step_finishes_the_job_and_leaves_nothing_behind(node_bus, tmp_path, api, point):
    host = host_file(tmp_path)
    api.add_node(NODE, labels={DP: "true"})
    pods_on_the_node(api)
    r = await rig(node_bus, tmp_path, api, host, converger_env={"BCD_CONVERGER_CRASH_AT": point})
    try:
        api.label_node(NODE, {CFG: "all-1g.18gb"})
        code = await asyncio.to_thread(r.converger.wait, 60)
        assert code == -9, r.converger.log()[-2000:]
        await r.start_converger()
        await r.until("success after the restart", lambda: r.labels().get(ST) == "success")
        assert card_layout(host) == ALL7
        assert r.labels()[DP] == "true"
        r.clean()
    finally:
        r.stop()


async def test_a_held_card_is_never_reconfigured_and_the_node_is_not_touched(node_bus, tmp_path, api):
    host = host_file(tmp_path)
    api.add_node(NODE, labels={DP: "true"})
    r = await rig(node_bus, tmp_path, api, host)
    try:
        bridge = await node_bus.connect("gateway_bridge")
        spec = NodeSpec(node_id=NODE, generation=1, devices=[DeviceAssignment(allocation_id="train-01", reservation_id="rsv-1", binding="BINDING_HOLD", devices=[MIG_UUID])])
        await call(bridge, r.subjects.converger_spec, node_bus.signed_spec(spec), SPEC_ACK_CODEC)
        await r.until("the hold bound", lambda: (node_bus.root / "cdi" / "bcd-train-01.json").exists())
        api.label_node(NODE, {CFG: "all-1g.18gb"})
        await r.until("failed", lambda: r.labels().get(ST) == "failed")
        assert "train-01" in r.node()["metadata"]["annotations"][MSG]
        assert card_layout(host) == "all-disabled"
        sent = [q.body for q in api.requests_to("PATCH", f"/api/v1/nodes/{NODE}")]
        assert not any("mig-reconfigure" in json.dumps(b) or "unschedulable" in json.dumps(b) for b in sent), "no taint, no cordon for a refused job"
        assert r.labels()[DP] == "true"
        st = await r.status_until(lambda s: s.relayout is not None and s.relayout.last is not None)
        assert st.relayout.last.outcome == "failed"
    finally:
        r.stop()


async def test_a_failed_layout_rolls_back_to_the_one_before(node_bus, tmp_path, api):
    host = host_file(tmp_path, mig_on=True, fault="fail")
    api.add_node(NODE, labels={DP: "true"})
    r = await rig(node_bus, tmp_path, api, host)
    try:
        api.label_node(NODE, {CFG: "all-1g.18gb"})
        await r.until("failed", lambda: r.labels().get(ST) == "failed")
        assert card_layout(host) == ["3g.71gb"]
        assert "3g.71gb" in r.node()["metadata"]["annotations"][MSG]
        r.clean()
    finally:
        r.stop()


async def test_a_drain_a_budget_blocks_fails_without_touching_the_card(node_bus, tmp_path, api):
    host = host_file(tmp_path)
    api.add_node(NODE, labels={DP: "true"})
    api.add_pod("team-a", "guarded-0", NODE, labels={"app": "guarded"}, devices={"nvidia.com/gpu": [MIG_UUID]})
    api.add_pdb("team-a", "guarded", {"app": "guarded"}, min_available=1)
    r = await rig(node_bus, tmp_path, api, host, converger_env={"BCD_RELAYOUT_DRAIN_TIMEOUT": "3"})
    try:
        api.label_node(NODE, {CFG: "all-1g.18gb"})
        await r.until("failed", lambda: r.labels().get(ST) == "failed")
        assert "team-a/guarded-0" in r.node()["metadata"]["annotations"][MSG]
        assert card_layout(host) == "all-disabled"
        assert api.pod("team-a", "guarded-0") is not None, "a budget is respected, never forced"
        r.clean()
        # the job failed: once the budget would allow it, the pod is still not evicted
        tried = len(api.evictions("team-a"))
        api.add_pod("team-a", "guarded-1", NODE, labels={"app": "guarded"})
        await asyncio.sleep(3.0)
        assert len(api.evictions("team-a")) == tried and api.pod("team-a", "guarded-0") is not None, "no eviction after the job ended"
    finally:
        r.stop()


async def test_a_node_without_a_mig_card_is_never_touched(node_bus, tmp_path, api):
    host = host_file(tmp_path, mig_card=False)
    api.add_node(NODE, labels={DP: "true"})
    r = await rig(node_bus, tmp_path, api, host)
    try:
        api.label_node(NODE, {CFG: "all-1g.18gb"})
        deadline = time.monotonic() + 10
        note = ""
        while time.monotonic() < deadline and not note:
            s = await r.status()
            note = s.relayout.note if s.relayout else ""
            await asyncio.sleep(0.2)
        assert "no MIG-capable card" in note
        assert api.requests_to("PATCH", f"/api/v1/nodes/{NODE}") == []
        assert ST not in r.labels()
    finally:
        r.stop()
