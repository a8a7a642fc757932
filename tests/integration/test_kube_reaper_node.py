"""kube_reaper.node as a real process on a real node bus, against the API server stand-in.

The converger's MIG re-layout reads and changes its Kubernetes Node only through this endpoint:
read; set and remove the state label; pause a gpu.deploy label; add and remove the re-layout
taint beside an unrelated one; cordon and uncordon; a stale resourceVersion is a conflict; an
API server that is gone is `reachable: False`. And the boundary, tried the way an attacker
holding the converger's identity would: every key outside the flow's list is refused with
nothing sent to the API server; every other identity cannot reach the endpoint at all.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import nats.errors
import pytest

from shared.runtime import ServiceCallError, call
from shared.schemas import NODE_REPLY_CODEC, NodeChange, NodeRead, NodeReply, NodeTaint, encode
from shared.subjects import NodeSubjects

from tests.blocking import subject_matches

from .kubeapi_standin import KubeApiStandIn

pytestmark = pytest.mark.integration

NAME = "gpu-node-1"
NODE_PATH = f"/api/v1/nodes/{NAME}"
OTHER_TAINT = {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
RELAYOUT_TAINT = {"key": "mig-reconfigure", "value": "true", "effect": "NoSchedule"}
LABELS = {
    "kubernetes.io/hostname": NAME,
    "nvidia.com/mig.config": "all-1g.18gb",
    "nvidia.com/gpu.deploy.device-plugin": "true",
    "nvidia.com/gpu.deploy.dcgm-exporter": "true",
}


@pytest.fixture
def api():
    server = KubeApiStandIn().start()
    try:
        yield server
    finally:
        server.stop()


async def start_reaper(node_bus, api: KubeApiStandIn, tmp_path: Path, **env: str):
    sp = node_bus.start_service(
        "kube_reaper",
        BCD_POD_RESOURCES_SOCKET=str(tmp_path / "no-kubelet.sock"),
        BCD_KUBECONFIG=str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        BCD_PROCESSES="none",
        BCD_NODE_NAME=NAME,
        BCD_LOG_FORMAT="text",
        NO_PROXY="127.0.0.1,localhost",
        **env,
    )
    ping = await node_bus.wait_service("kube_reaper")
    # the converger is the only caller of kube_reaper.node
    nc = await node_bus.connect("converger")
    return sp, ping, nc


async def ask(nc, node_bus, req: NodeRead | NodeChange) -> NodeReply:
    return await call(nc, NodeSubjects(node_bus.node_id).reaper_node, req, NODE_REPLY_CODEC, timeout=15)


def patches(api: KubeApiStandIn) -> list:
    return api.requests_to("PATCH", NODE_PATH)


async def test_the_flow_reads_and_changes_its_node(node_bus, api, tmp_path):
    api.add_node(NAME, labels=LABELS, taints=[OTHER_TAINT])
    api.add_node("another-node", labels={"nvidia.com/mig.config": "all-1g.18gb"})
    sp, ping, nc = await start_reaper(node_bus, api, tmp_path)
    assert ping["metadata"]["node_api"] == "kubernetes" and ping["metadata"]["node_name"] == NAME

    r = await ask(nc, node_bus, NodeRead())
    assert (r.ok, r.reachable, r.conflict, r.disabled, r.detail) == (True, True, False, False, "")
    assert r.node is not None and r.node.name == NAME and r.node.labels == LABELS
    assert r.node.taints == [NodeTaint(key="dedicated", value="ml", effect="NoSchedule")] and not r.node.unschedulable
    assert r.node.resource_version == api.node(NAME)["metadata"]["resourceVersion"]
    rv = r.node.resource_version

    async def change(**kw) -> NodeReply:
        nonlocal rv
        before = len(patches(api))
        reply = await ask(nc, node_bus, NodeChange(resource_version=rv, **kw))
        assert reply.ok, reply.detail
        assert reply.node is not None and reply.node.resource_version == api.node(NAME)["metadata"]["resourceVersion"]
        sent = patches(api)[before:]
        # one PATCH per change, carrying the resourceVersion it was made at
        assert len(sent) == 1 and sent[0].body["metadata"]["resourceVersion"] == rv and sent[0].status == 200
        assert sent[0].content_type == "application/merge-patch+json"
        rv = reply.node.resource_version
        return reply

    # the state label, set and removed
    r = await change(labels={"nvidia.com/mig.config.state": "pending"}, annotations={"bcd.dev/mig.config.message": "pausing operands"})
    assert api.node(NAME)["metadata"]["labels"]["nvidia.com/mig.config.state"] == "pending"
    assert r.node.labels["nvidia.com/mig.config.state"] == "pending" and r.node.annotations == {"bcd.dev/mig.config.message": "pausing operands"}

    # a gpu.deploy label paused; the others untouched
    r = await change(labels={"nvidia.com/gpu.deploy.device-plugin": "paused-for-mig-change"})
    labels = api.node(NAME)["metadata"]["labels"]
    assert labels["nvidia.com/gpu.deploy.device-plugin"] == "paused-for-mig-change"
    assert labels["nvidia.com/gpu.deploy.dcgm-exporter"] == "true" and labels["kubernetes.io/hostname"] == NAME

    # the taint added beside the unrelated one, then taken away leaving it
    r = await change(relayout_taint=True)
    assert [{k: t[k] for k in ("key", "value", "effect")} for t in api.node(NAME)["spec"]["taints"]] == [OTHER_TAINT, RELAYOUT_TAINT]
    assert [t.key for t in r.node.taints] == ["dedicated", "mig-reconfigure"]

    # cordon, uncordon
    r = await change(unschedulable=True)
    assert api.node(NAME)["spec"].get("unschedulable") is True and r.node.unschedulable

    r = await change(
        labels={"nvidia.com/mig.config.state": None, "nvidia.com/gpu.deploy.device-plugin": "true"},
        annotations={"bcd.dev/mig.config.message": None},
        relayout_taint=False,
        unschedulable=False,
    )
    node = api.node(NAME)
    assert "nvidia.com/mig.config.state" not in node["metadata"]["labels"]
    assert node["metadata"]["labels"]["nvidia.com/gpu.deploy.device-plugin"] == "true"
    assert "bcd.dev/mig.config.message" not in (node["metadata"].get("annotations") or {})
    assert [{k: t[k] for k in ("key", "value", "effect")} for t in node["spec"]["taints"]] == [OTHER_TAINT]
    assert not node["spec"].get("unschedulable")
    assert (r.node.labels, r.node.annotations, r.node.unschedulable) == (LABELS, {}, False)

    # nothing to change: no PATCH
    before = len(patches(api))
    r = await ask(nc, node_bus, NodeChange(resource_version=rv, labels={"nvidia.com/mig.config.state": None}, relayout_taint=False))
    assert r.ok and len(patches(api)) == before

    # only this Node was ever asked for
    assert {q.path for q in api.requests_to(prefix="/api/v1/nodes")} == {NODE_PATH}
    assert api.node("another-node")["metadata"]["labels"] == {"nvidia.com/mig.config": "all-1g.18gb"}

    metrics = urllib.request.urlopen(f"http://{ping['metadata']['metrics']}/metrics", timeout=5).read().decode()  # noqa: S310
    assert 'bcd_reaper_node_requests_total{outcome="ok",verb="read"} 1.0' in metrics
    assert 'bcd_reaper_node_requests_total{outcome="ok",verb="change"} 6.0' in metrics
    assert 'bcd_reaper_node_requests_total{outcome="conflict",verb="change"} 0.0' in metrics

    assert sp.stop() == 0
    assert "Traceback" not in sp.log()


async def test_a_stale_resource_version_is_a_conflict_and_changes_nothing(node_bus, api, tmp_path):
    api.add_node(NAME, labels=LABELS)
    sp, _, nc = await start_reaper(node_bus, api, tmp_path)
    r = await ask(nc, node_bus, NodeRead())
    assert r.ok and r.node is not None
    stale = r.node.resource_version

    # someone else labels the Node meanwhile
    api.label_node(NAME, {"example.com/elsewhere": "yes"})
    r = await ask(nc, node_bus, NodeChange(resource_version=stale, labels={"nvidia.com/mig.config.state": "pending"}, unschedulable=True))
    assert (r.ok, r.conflict, r.reachable) == (False, True, True)
    assert stale in r.detail
    node = api.node(NAME)
    assert "nvidia.com/mig.config.state" not in node["metadata"]["labels"] and not node["spec"].get("unschedulable")
    assert patches(api) == []

    # read again, and it goes
    r = await ask(nc, node_bus, NodeRead())
    assert r.ok and r.node is not None and r.node.labels["example.com/elsewhere"] == "yes"
    r = await ask(nc, node_bus, NodeChange(resource_version=r.node.resource_version, labels={"nvidia.com/mig.config.state": "pending"}))
    assert r.ok and api.node(NAME)["metadata"]["labels"]["nvidia.com/mig.config.state"] == "pending"

    assert sp.stop() == 0
    assert "Traceback" not in sp.log()


async def test_an_api_server_that_is_gone_is_unreachable_and_the_service_lives(node_bus, tmp_path):
    # stopped before the reaper ever connects: the stand-in's stop() leaves an open keep-alive
    # connection served, so a server that went away later would still answer on it
    api = KubeApiStandIn().start()
    api.stop()
    sp, _, nc = await start_reaper(node_bus, api, tmp_path)

    r = await ask(nc, node_bus, NodeRead())
    assert (r.ok, r.reachable, r.conflict, r.disabled, r.node) == (False, False, False, False, None)
    assert "get node gpu-node-1" in r.detail
    r = await ask(nc, node_bus, NodeChange(resource_version="3", unschedulable=True))
    assert (r.ok, r.reachable, r.node) == (False, False, None)
    # refused keys are refused before anything is tried, reachable or not
    r = await ask(nc, node_bus, NodeChange(resource_version="3", labels={"kubernetes.io/hostname": "x"}))
    assert (r.ok, r.reachable) == (False, True) and "nothing sent" in r.detail

    assert sp.stop() == 0
    log = sp.log()
    assert "Traceback" not in log and "Kubernetes Node unreachable" in log


async def test_the_api_servers_refusals_and_failures_are_answers(node_bus, api, tmp_path):
    sp, _, nc = await start_reaper(node_bus, api, tmp_path)
    # no such Node: refused, reachable
    r = await ask(nc, node_bus, NodeRead())
    assert (r.ok, r.reachable, r.conflict) == (False, True, False) and "404" in r.detail
    api.add_node(NAME, labels=LABELS)
    api.fail_next(1, 500)
    r = await ask(nc, node_bus, NodeRead())
    assert (r.ok, r.reachable) == (False, False) and "500" in r.detail
    assert (await ask(nc, node_bus, NodeRead())).ok
    assert sp.stop() == 0
    assert "Traceback" not in sp.log()


#: what the converger's identity might try: (the change's labels, annotations, what the detail names)
ATTACKS = [
    ({"kubernetes.io/hostname": "evil"}, {}, "kubernetes.io/hostname"),
    ({"node-role.kubernetes.io/control-plane": ""}, {}, "node-role.kubernetes.io/control-plane"),
    ({"node.kubernetes.io/exclude-from-external-load-balancers": ""}, {}, "node.kubernetes.io/exclude-from-external-load-balancers"),
    ({"nvidia.com/gpu.deploy": "false"}, {}, "'nvidia.com/gpu.deploy'"),
    ({"nvidia.com/gpu.deploy.": "false"}, {}, "'nvidia.com/gpu.deploy.'"),
    ({"nvidia.com/gpu.deploy./kubernetes.io/hostname": "evil"}, {}, "nvidia.com/gpu.deploy./kubernetes.io/hostname"),
    ({"nvidia.com/gpu.deploy.x/../../kubernetes.io/hostname": "evil"}, {}, "nvidia.com/gpu.deploy.x/../../kubernetes.io/hostname"),
    ({"nvidia.com/gpu.deploy.x%2Fy": "evil"}, {}, "nvidia.com/gpu.deploy.x%2Fy"),
    ({"nvidia.com/mig.capable": "false"}, {}, "nvidia.com/mig.capable"),
    ({"nvidia.com/mig.config.state": "pending", "kubernetes.io/hostname": "evil"}, {}, "kubernetes.io/hostname"),
    ({"nvidia.com/mig.config.state": "owned"}, {}, "'owned' is none of"),
    ({}, {"node.alpha.kubernetes.io/ttl": "0"}, "node.alpha.kubernetes.io/ttl"),
    ({}, {"kubectl.kubernetes.io/last-applied-configuration": "{}"}, "kubectl.kubernetes.io/last-applied-configuration"),
    ({}, {"bcd.dev/mig.config.message": "two\nlines"}, "not printable"),
]


async def test_the_converger_cannot_touch_anything_else_and_nothing_is_sent(node_bus, api, tmp_path):
    api.add_node(NAME, labels=LABELS)
    sp, ping, nc = await start_reaper(node_bus, api, tmp_path)
    r = await ask(nc, node_bus, NodeRead())
    assert r.ok and r.node is not None
    rv = r.node.resource_version
    node_before = api.node(NAME)
    sent_before = len(api.requests_to())

    for labels, annotations, named in ATTACKS:
        r = await ask(nc, node_bus, NodeChange(resource_version=rv, labels=labels, annotations=annotations, relayout_taint=True, unschedulable=True))
        assert (r.ok, r.conflict, r.disabled, r.node) == (False, False, False, None), (labels, annotations)
        assert named in r.detail and "nothing sent" in r.detail, (named, r.detail)
    # nothing reached the API server, not even a read
    assert len(api.requests_to()) == sent_before
    assert api.node(NAME) == node_before

    # bodies the schema refuses (an oversized message among them): a 400, and the service lives on
    subjects = NodeSubjects(node_bus.node_id)
    for body in (
        encode(NodeChange(resource_version=rv, annotations={"bcd.dev/mig.config.message": "x" * 1025})),
        encode(NodeChange(resource_version=rv, labels={f"nvidia.com/gpu.deploy.o{i}": "true" for i in range(65)})),
        b'{"type": "change", "resource_version": "1", "labels": {"nvidia.com/mig.config": 5}}',
        b'{"type": "change", "resource_version": ""}',
        b'{"type": "delete"}',
        b"{}",
        b"not json",
        encode(NodeChange(resource_version="1", annotations={f"bcd.dev/a{i}": "x" for i in range(5)})),
    ):
        with pytest.raises(ServiceCallError) as err:
            await call(nc, subjects.reaper_node, body, NODE_REPLY_CODEC, timeout=10)
        assert err.value.code == "400", (body, err.value)
    assert len(api.requests_to()) == sent_before

    metrics = urllib.request.urlopen(f"http://{ping['metadata']['metrics']}/metrics", timeout=5).read().decode()  # noqa: S310
    assert f'bcd_reaper_node_requests_total{{outcome="invalid",verb="change"}} {float(len(ATTACKS))}' in metrics
    assert (await ask(nc, node_bus, NodeRead())).ok
    assert sp.stop() == 0
    assert "Traceback" not in sp.log()


@pytest.mark.parametrize("user", ["inventory", "device_plugin", "dra_plugin", "gateway_bridge", "vfio_switcher", "cli"])
async def test_no_other_identity_may_call_the_node_endpoint(node_bus, api, tmp_path, user):
    api.add_node(NAME, labels=LABELS)
    sp, _, converger = await start_reaper(node_bus, api, tmp_path)
    subjects = NodeSubjects(node_bus.node_id)
    assert not any(subject_matches(p, subjects.reaper_node) for p in subjects.permissions(user).publish)
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = await node_bus.connect(user, error_cb=on_error)
    sent_before = len(api.requests_to())
    evil = NodeChange(resource_version="1", labels={"nvidia.com/mig.config.state": "failed"}, unschedulable=True)
    for req in (NodeRead(), evil):
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(subjects.reaper_node, encode(req), timeout=1)
    await nc.flush()
    await asyncio.sleep(0.2)
    assert any("permissions violation" in str(e).lower() and "kube_reaper.node" in str(e) for e in errors), errors
    assert len(api.requests_to()) == sent_before
    # the converger still may
    assert (await ask(converger, node_bus, NodeRead())).ok
    assert sp.stop() == 0


async def test_without_a_node_api_every_request_is_disabled(node_bus, api, tmp_path):
    api.add_node(NAME, labels=LABELS)
    sp, ping, nc = await start_reaper(node_bus, api, tmp_path, BCD_EVICTOR="none")
    assert ping["metadata"]["node_api"] == "none"
    for req in (NodeRead(), NodeChange(resource_version="1", unschedulable=True)):
        r = await ask(nc, node_bus, req)
        assert (r.ok, r.disabled, r.node) == (False, True, None) and "--node-api none" in r.detail
    assert api.requests_to() == []
    assert sp.stop() == 0


async def test_a_node_name_kubernetes_cannot_have_stops_the_start(node_bus, api, tmp_path):
    sp = node_bus.start_service(
        "kube_reaper",
        BCD_POD_RESOURCES_SOCKET=str(tmp_path / "no-kubelet.sock"),
        BCD_KUBECONFIG=str(api.write_kubeconfig(tmp_path / "kubeconfig")),
        BCD_PROCESSES="none",
        BCD_NODE_NAME="Not_A/Node",
    )
    assert await asyncio.to_thread(sp.wait, 20) == 2
    assert "--node-name 'Not_A/Node' is no Kubernetes Node name" in sp.log()
