"""kube_reaper.node's own logic: what a NodeChange may touch, the one merge patch it becomes, the replies.

The API server side (GET, PATCH with a resourceVersion precondition, 409) is exercised against
the API server stand-in in tests/integration/test_kube_reaper_node.py; here a small HTTP peer
records what KubernetesNodeApi sends (the content type the stand-in does not keep).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from services.kube_reaper.nodeapi import (
    MERGE_PATCH,
    KubernetesNodeApi,
    NodeApiDisabled,
    NodeApiUnreachable,
    NodeConflict,
    NodeEndpoint,
    NodeRefused,
    NoNodeApi,
    bounded,
    build_patch,
    check_change,
    is_label_value,
    is_qualified_name,
    view_of,
)
from shared.schemas import NODE_REPLY_CODEC, NodeChange, NodeRead, NodeReply, NodeTaint, NodeView

OURS = {"key": "mig-reconfigure", "value": "true", "effect": "NoSchedule"}
GPU_ONLY = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
EXEC = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": "2025-01-02T03:04:05Z"}


def node(labels: dict | None = None, annotations: dict | None = None, taints: list | None = None, unschedulable: bool | None = None, rv: str = "7") -> dict:
    meta: dict = {"name": "gpu-1", "resourceVersion": rv, "uid": "u-1"}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    spec: dict = {"podCIDR": "10.0.0.0/24"}
    if taints is not None:
        spec["taints"] = taints
    if unschedulable is not None:
        spec["unschedulable"] = unschedulable
    return {"kind": "Node", "apiVersion": "v1", "metadata": meta, "spec": spec, "status": {}}


def change(**kw) -> NodeChange:
    return NodeChange(resource_version="7", **kw)


# --- what a change may touch --------------------------------------------------------------------

ALLOWED = [
    {"nvidia.com/mig.config": "all-1g.18gb"},
    {"nvidia.com/mig.config": None},
    {"nvidia.com/mig.config.state": "pending"},
    {"nvidia.com/mig.config.state": "rebooting"},
    {"nvidia.com/mig.config.state": "success"},
    {"nvidia.com/mig.config.state": "failed"},
    {"nvidia.com/mig.config.state": None},
    {"nvidia.com/gpu.deploy.device-plugin": "paused-for-mig-change"},
    {"nvidia.com/gpu.deploy.dcgm-exporter": "true", "nvidia.com/gpu.deploy.gpu-feature-discovery": None},
    {"nvidia.com/gpu.deploy.operands": ""},
    {},
]


@pytest.mark.parametrize("labels", ALLOWED, ids=[json.dumps(x) for x in ALLOWED])
def test_the_flows_labels_pass(labels):
    assert check_change(change(labels=labels)) == ""


REFUSED_LABELS = [
    # (labels, what the detail must name)
    ({"kubernetes.io/hostname": "evil"}, "'kubernetes.io/hostname'"),
    ({"node-role.kubernetes.io/control-plane": ""}, "'node-role.kubernetes.io/control-plane'"),
    ({"nvidia.com/gpu.deploy": "false"}, "'nvidia.com/gpu.deploy'"),
    ({"nvidia.com/gpu.deploy.": "false"}, "'nvidia.com/gpu.deploy.'"),
    ({"nvidia.com/gpu.deploy./kubernetes.io/hostname": "x"}, "'nvidia.com/gpu.deploy./kubernetes.io/hostname'"),
    ({"nvidia.com/gpu.deploy.a/b": "x"}, "'nvidia.com/gpu.deploy.a/b'"),
    ({"nvidia.com/gpu.deploy.../x": "x"}, "'nvidia.com/gpu.deploy.../x'"),
    ({"nvidia.com/gpu.deploy.x/": "x"}, "'nvidia.com/gpu.deploy.x/'"),
    ({"nvidia.com/gpu.deploy.-x": "x"}, "'nvidia.com/gpu.deploy.-x'"),
    ({"nvidia.com/gpu.deploy.x y": "x"}, "'nvidia.com/gpu.deploy.x y'"),
    ({"nvidia.com/gpu.deploy.x.y": "x"}, "'nvidia.com/gpu.deploy.x.y'"),  # a valid label key, but no operand
    ({"nvidia.com/gpu.deploy.Driver": "x"}, "'nvidia.com/gpu.deploy.Driver'"),
    ({"nvidia.com/gpu.deploy.ｘ": "x"}, "'nvidia.com/gpu.deploy.ｘ'"),  # a fullwidth x
    ({"nvidia.com/gpu.deploy." + "x" * 60: "x"}, "nvidia.com/gpu.deploy.xxx"),  # name part over 63
    ({"NVIDIA.com/mig.config": "all-disabled"}, "'NVIDIA.com/mig.config'"),
    ({"nvidia.com/mig.config ": "all-disabled"}, "'nvidia.com/mig.config '"),
    ({"nvidia.com/mig.capable": "false"}, "'nvidia.com/mig.capable'"),
    ({"bcd.dev/mig.config.message": "x"}, "'bcd.dev/mig.config.message'"),  # the annotation, as a label
    ({"nvidia.com/mig.config.state": "bogus"}, "'bogus' is none of pending"),
    ({"nvidia.com/mig.config.state": "Pending"}, "'Pending' is none of"),
    ({"nvidia.com/mig.config.state": ""}, "'' is none of"),
    ({"nvidia.com/mig.config": "all 1g"}, "no valid label value"),
    ({"nvidia.com/mig.config": "x" * 64}, "no valid label value"),
    ({"nvidia.com/gpu.deploy.dcgm": "-paused"}, "no valid label value"),
    ({"nvidia.com/gpu.deploy.dcgm": "true\n"}, "no valid label value"),
]


@pytest.mark.parametrize("labels,named", REFUSED_LABELS, ids=[json.dumps(x[0])[:60] for x in REFUSED_LABELS])
def test_every_other_label_or_bad_value_is_refused_by_name(labels, named):
    assert named in check_change(change(labels=labels))
    # one bad key among good ones still refuses the whole change
    assert named in check_change(change(labels={"nvidia.com/mig.config.state": "pending", **labels}))


ANNOTATIONS = [
    ({"bcd.dev/mig.config.message": "draining card 0000:3b:00.0: 2 pods left"}, ""),
    ({"bcd.dev/mig.config.message": "перестройка MIG: шаг 2"}, ""),
    ({"bcd.dev/mig.config.message": None}, ""),
    ({"bcd.dev/mig.config.message": "x" * 1024}, ""),
    ({"bcd.dev/mig.config.message": "x" * 1025}, "1025 characters, more than 1024"),
    ({"bcd.dev/mig.config.message": "line\nline"}, "not printable"),
    ({"bcd.dev/mig.config.message": "a\u202eb"}, "not printable"),  # right-to-left override
    ({"bcd.dev/mig.config.message": "a\x00b"}, "not printable"),
    ({"node.alpha.kubernetes.io/ttl": "0"}, "'node.alpha.kubernetes.io/ttl'"),
    ({"nvidia.com/mig.config": "all-disabled"}, "'nvidia.com/mig.config'"),  # a label, as an annotation
    ({"bcd.dev/other": "x"}, "'bcd.dev/other'"),
]


@pytest.mark.parametrize("annotations,named", ANNOTATIONS, ids=[str(i) for i in range(len(ANNOTATIONS))])
def test_only_bcds_message_annotation_printable_and_bounded(annotations, named):
    got = check_change(change(annotations=annotations))
    assert (named in got and got) if named else got == ""


def test_qualified_names_and_label_values_as_kubernetes_has_them():
    assert is_qualified_name("nvidia.com/gpu.deploy.x") and is_qualified_name("plain")
    assert not is_qualified_name("/x") and not is_qualified_name("a/b/c") and not is_qualified_name("Nvidia.com/x")
    assert not is_qualified_name("a" * 254 + "/x") and not is_qualified_name("x/" + "a" * 64)
    assert is_label_value("") and is_label_value("a.b-c_d") and is_label_value("x" * 63)
    assert not is_label_value("x" * 64) and not is_label_value("a b") and not is_label_value("a.")


# --- the one merge patch ------------------------------------------------------------------------

PATCHES = [
    # (name, the Node as read, the change, the patch or None)
    (
        "nothing to change: every label, annotation, taint and cordon already as asked",
        node(
            labels={"nvidia.com/mig.config.state": "pending", "nvidia.com/gpu.deploy.dcgm": "paused-for-mig-change"},
            annotations={"bcd.dev/mig.config.message": "hi"},
            taints=[GPU_ONLY, OURS],
            unschedulable=True,
        ),
        change(
            labels={"nvidia.com/mig.config.state": "pending", "nvidia.com/gpu.deploy.dcgm": "paused-for-mig-change", "nvidia.com/gpu.deploy.absent": None},
            annotations={"bcd.dev/mig.config.message": "hi"},
            relayout_taint=True,
            unschedulable=True,
        ),
        None,
    ),
    ("nothing asked", node(labels={"a": "b"}), change(), None),
    ("untaint and uncordon a Node with neither", node(), change(relayout_taint=False, unschedulable=False), None),
    (
        "set the state label",
        node(labels={"kubernetes.io/hostname": "gpu-1"}),
        change(labels={"nvidia.com/mig.config.state": "pending"}),
        {"metadata": {"resourceVersion": "7", "labels": {"nvidia.com/mig.config.state": "pending"}}},
    ),
    (
        "change and remove labels (null removes)",
        node(labels={"nvidia.com/mig.config.state": "pending", "nvidia.com/gpu.deploy.dcgm": "paused-for-mig-change"}),
        change(labels={"nvidia.com/mig.config.state": None, "nvidia.com/gpu.deploy.dcgm": "true"}),
        {"metadata": {"resourceVersion": "7", "labels": {"nvidia.com/gpu.deploy.dcgm": "true", "nvidia.com/mig.config.state": None}}},
    ),
    (
        "pause a gpu.deploy label and say why",
        node(labels={"nvidia.com/gpu.deploy.device-plugin": "true"}),
        change(labels={"nvidia.com/gpu.deploy.device-plugin": "paused-for-mig-change"}, annotations={"bcd.dev/mig.config.message": "draining"}),
        {
            "metadata": {
                "resourceVersion": "7",
                "labels": {"nvidia.com/gpu.deploy.device-plugin": "paused-for-mig-change"},
                "annotations": {"bcd.dev/mig.config.message": "draining"},
            }
        },
    ),
    (
        "add the taint: the whole list, the Node's own kept as they are (timeAdded too)",
        node(taints=[GPU_ONLY, EXEC]),
        change(relayout_taint=True),
        {"metadata": {"resourceVersion": "7"}, "spec": {"taints": [GPU_ONLY, EXEC, OURS]}},
    ),
    (
        "add the taint to a Node with no taints",
        node(),
        change(relayout_taint=True),
        {"metadata": {"resourceVersion": "7"}, "spec": {"taints": [OURS]}},
    ),
    (
        "the re-layout key with another value is replaced, not doubled (one taint per key and effect)",
        node(taints=[{"key": "mig-reconfigure", "value": "false", "effect": "NoSchedule"}, GPU_ONLY]),
        change(relayout_taint=True),
        {"metadata": {"resourceVersion": "7"}, "spec": {"taints": [GPU_ONLY, OURS]}},
    ),
    (
        "remove the taint: the others stay, in order",
        node(taints=[GPU_ONLY, OURS, EXEC]),
        change(relayout_taint=False),
        {"metadata": {"resourceVersion": "7"}, "spec": {"taints": [GPU_ONLY, EXEC]}},
    ),
    (
        "remove the last taint",
        node(taints=[OURS]),
        change(relayout_taint=False),
        {"metadata": {"resourceVersion": "7"}, "spec": {"taints": []}},
    ),
    (
        "the same key with another effect is not the re-layout taint",
        node(taints=[{"key": "mig-reconfigure", "value": "true", "effect": "NoExecute"}]),
        change(relayout_taint=False),
        None,
    ),
    ("cordon", node(), change(unschedulable=True), {"metadata": {"resourceVersion": "7"}, "spec": {"unschedulable": True}}),
    ("uncordon", node(unschedulable=True), change(unschedulable=False), {"metadata": {"resourceVersion": "7"}, "spec": {"unschedulable": False}}),
    (
        "everything at once is still one patch",
        node(labels={"nvidia.com/gpu.deploy.dcgm": "true"}, taints=[GPU_ONLY]),
        change(labels={"nvidia.com/mig.config.state": "pending", "nvidia.com/gpu.deploy.dcgm": "paused-for-mig-change"}, relayout_taint=True, unschedulable=True),
        {
            "metadata": {
                "resourceVersion": "7",
                "labels": {"nvidia.com/gpu.deploy.dcgm": "paused-for-mig-change", "nvidia.com/mig.config.state": "pending"},
            },
            "spec": {"taints": [GPU_ONLY, OURS], "unschedulable": True},
        },
    ),
]


@pytest.mark.parametrize("the_node,req,want", [p[1:] for p in PATCHES], ids=[p[0] for p in PATCHES])
def test_one_merge_patch_at_the_resource_version(the_node, req, want):
    before = json.dumps(the_node, sort_keys=True)
    assert build_patch(the_node, req) == want
    assert json.dumps(the_node, sort_keys=True) == before  # the Node as read is not touched


def test_the_view_carries_all_labels_bcds_annotation_taints_and_the_cordon():
    n = node(
        labels={"kubernetes.io/hostname": "gpu-1", "nvidia.com/mig.config": "all-1g.18gb"},
        annotations={"bcd.dev/mig.config.message": "m", "node.alpha.kubernetes.io/ttl": "0", "kubeadm.alpha.kubernetes.io/cri-socket": "x"},
        taints=[GPU_ONLY, EXEC],
        unschedulable=True,
    )
    assert view_of(n) == NodeView(
        name="gpu-1",
        resource_version="7",
        labels={"kubernetes.io/hostname": "gpu-1", "nvidia.com/mig.config": "all-1g.18gb"},
        annotations={"bcd.dev/mig.config.message": "m"},
        taints=[NodeTaint(key="nvidia.com/gpu", value="present", effect="NoSchedule"), NodeTaint(key="node.kubernetes.io/unreachable", effect="NoExecute")],
        unschedulable=True,
    )
    assert view_of(node()) == NodeView(name="gpu-1", resource_version="7")


def test_a_view_over_the_schemas_bounds_keeps_the_flows_keys_and_says_so():
    labels = {f"example.com/l{i:04d}": "v" for i in range(1100)}
    labels |= {"nvidia.com/mig.config": "all-disabled", "nvidia.com/mig.config.state": "pending", "nvidia.com/gpu.deploy.dcgm": "true", "zzz": "z"}
    taints = [NodeTaint(key=f"t{i:03d}", effect="NoSchedule") for i in range(300)] + [NodeTaint(key="mig-reconfigure", value="true", effect="NoSchedule")]
    view, note = bounded(NodeView(name="n", resource_version="1", labels=labels, taints=taints))
    assert len(view.labels) == 1024 and len(view.taints) == 256
    assert {"nvidia.com/mig.config", "nvidia.com/mig.config.state", "nvidia.com/gpu.deploy.dcgm"} <= set(view.labels)
    assert "zzz" not in view.labels
    assert any(t.key == "mig-reconfigure" for t in view.taints)
    assert "1104 labels; 80 left out" in note and "301 taints; 45 left out" in note
    NODE_REPLY_CODEC.encode_valid(NodeReply(ok=True, node=view, detail=note))
    small = NodeView(name="n", resource_version="1", labels={"a": "b"})
    assert bounded(small) == (small, "")


# --- the endpoint --------------------------------------------------------------------------------


class FakeNodeApi:
    """A NodeApi over one Node dict; records every call; `fail` raises instead."""

    def __init__(self, the_node: dict) -> None:
        self.node = the_node
        self.calls: list[object] = []
        self.fail: Exception | None = None

    async def read(self) -> NodeView:
        self.calls.append("read")
        if self.fail:
            raise self.fail
        return view_of(self.node)

    async def change(self, req: NodeChange) -> NodeView:
        self.calls.append(req)
        if self.fail:
            raise self.fail
        if req.resource_version != self.node["metadata"]["resourceVersion"]:
            raise NodeConflict("moved")
        patch = build_patch(self.node, req)
        if patch:
            self.node["metadata"].setdefault("labels", {}).update(patch["metadata"].get("labels", {}))
        return view_of(self.node)

    async def close(self) -> None:
        return None


def counted(registry: CollectorRegistry, verb: str, outcome: str) -> float | None:
    return registry.get_sample_value("bcd_reaper_node_requests_total", {"verb": verb, "outcome": outcome})


async def test_the_endpoint_answers_every_outcome_and_counts_it():
    registry = CollectorRegistry()
    counter = Counter("bcd_reaper_node_requests", "h", ["verb", "outcome"], registry=registry)
    api = FakeNodeApi(node(labels={"nvidia.com/mig.config": "all-1g.18gb"}))
    endpoint = NodeEndpoint(api, counter)
    # every series is there before the first request
    for verb in ("read", "change"):
        for outcome in ("ok", "invalid", "refused", "conflict", "unreachable", "disabled"):
            assert counted(registry, verb, outcome) == 0.0

    reply = await endpoint(NodeRead())
    assert reply.ok and reply.node is not None and reply.node.labels == {"nvidia.com/mig.config": "all-1g.18gb"}

    reply = await endpoint(change(labels={"nvidia.com/mig.config.state": "pending"}))
    assert reply.ok and reply.node is not None and reply.node.labels["nvidia.com/mig.config.state"] == "pending"

    # refused before the port is asked
    calls = len(api.calls)
    reply = await endpoint(change(labels={"kubernetes.io/hostname": "x"}, annotations={"a": "b"}))
    assert (reply.ok, reply.reachable, reply.conflict, reply.node) == (False, True, False, None)
    assert "'kubernetes.io/hostname'" in reply.detail and "'a'" in reply.detail and "nothing sent" in reply.detail
    assert len(api.calls) == calls

    reply = await endpoint(NodeChange(resource_version="6", labels={"nvidia.com/mig.config.state": "success"}))
    assert (reply.ok, reply.conflict) == (False, True)

    api.fail = NodeApiUnreachable("get node gpu-1: no answer within 10s")
    reply = await endpoint(NodeRead())
    assert (reply.ok, reply.reachable, reply.detail) == (False, False, "get node gpu-1: no answer within 10s")

    api.fail = NodeRefused("patch node gpu-1: HTTP 403: forbidden")
    reply = await endpoint(change(unschedulable=True))
    assert (reply.ok, reply.reachable, reply.conflict, reply.disabled) == (False, True, False, False) and "403" in reply.detail

    # every answer is one the converger can decode
    for reply in (await endpoint(NodeRead()), await endpoint(change(unschedulable=True))):
        assert NODE_REPLY_CODEC.decode(NODE_REPLY_CODEC.encode_valid(reply)) == reply

    assert {(v, o): counted(registry, v, o) for v in ("read", "change") for o in ("ok", "invalid", "refused", "conflict", "unreachable")} == {
        ("read", "ok"): 1.0,
        ("read", "invalid"): 0.0,
        ("read", "refused"): 1.0,
        ("read", "conflict"): 0.0,
        ("read", "unreachable"): 1.0,
        ("change", "ok"): 1.0,
        ("change", "invalid"): 1.0,
        ("change", "refused"): 2.0,
        ("change", "conflict"): 1.0,
        ("change", "unreachable"): 0.0,
    }


async def test_no_node_api_answers_disabled():
    registry = CollectorRegistry()
    counter = Counter("bcd_reaper_node_requests", "h", ["verb", "outcome"], registry=registry)
    endpoint = NodeEndpoint(NoNodeApi(), counter)
    for req in (NodeRead(), change(unschedulable=True)):
        reply = await endpoint(req)
        assert (reply.ok, reply.disabled, reply.node) == (False, True, None) and "--node-api none" in reply.detail
    assert counted(registry, "read", "disabled") == 1.0 and counted(registry, "change", "disabled") == 1.0
    with pytest.raises(NodeApiDisabled):
        await NoNodeApi().read()


# --- KubernetesNodeApi on the wire ----------------------------------------------------------------


class Peer:
    """An HTTP peer answering GET and PATCH /api/v1/nodes/gpu-1 from a script; records each request."""

    def __init__(self, the_node: dict, patch_status: int = 200) -> None:
        self.node = the_node
        self.patch_status = patch_status
        self.seen: list[tuple[str, str, str, object]] = []
        peer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                peer.seen.append(("GET", self.path, "", None))
                self._answer(200, peer.node)

            def do_PATCH(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                peer.seen.append(("PATCH", self.path, self.headers["Content-Type"], body))
                if peer.patch_status != 200:
                    self._answer(peer.patch_status, {"kind": "Status", "message": "the object has been modified", "reason": "Conflict"})
                    return
                self._answer(200, {**peer.node, "metadata": {**peer.node["metadata"], "resourceVersion": "8", "labels": body["metadata"].get("labels", {})}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "Peer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def kubeconfig(self, path: Path) -> Path:
        cluster = {"server": f"http://127.0.0.1:{self.httpd.server_port}"}
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": cluster}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        return path


async def test_kubernetes_node_api_sends_one_merge_patch_with_the_resource_version(tmp_path, monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with Peer(node(labels={"nvidia.com/mig.config": "all-1g.18gb"}, taints=[GPU_ONLY])) as peer:
        api = KubernetesNodeApi("gpu-1", peer.kubeconfig(tmp_path / "kubeconfig"), in_cluster="false")
        try:
            assert (await api.read()).labels == {"nvidia.com/mig.config": "all-1g.18gb"}
            view = await api.change(change(labels={"nvidia.com/mig.config.state": "pending"}, relayout_taint=True))
            assert view.resource_version == "8"
            assert [s[:3] for s in peer.seen] == [("GET", "/api/v1/nodes/gpu-1", ""), ("GET", "/api/v1/nodes/gpu-1", ""), ("PATCH", "/api/v1/nodes/gpu-1", MERGE_PATCH)]
            assert peer.seen[-1][3] == {
                "metadata": {"resourceVersion": "7", "labels": {"nvidia.com/mig.config.state": "pending"}},
                "spec": {"taints": [GPU_ONLY, OURS]},
            }
            # nothing to change: read, no PATCH
            peer.seen.clear()
            await api.change(change(labels={"nvidia.com/mig.config": "all-1g.18gb"}))
            assert [s[0] for s in peer.seen] == ["GET"]
            # already moved when read: a conflict, no PATCH
            with pytest.raises(NodeConflict, match="resourceVersion 7, not 6"):
                await api.change(NodeChange(resource_version="6", unschedulable=True))
            assert [s[0] for s in peer.seen] == ["GET", "GET"]
            # moved between the read and the PATCH: the API server's 409
            peer.patch_status = 409
            with pytest.raises(NodeConflict, match="HTTP 409"):
                await api.change(change(unschedulable=True))
            peer.patch_status = 403
            with pytest.raises(NodeRefused, match="HTTP 403"):
                await api.change(change(unschedulable=True))
            peer.patch_status = 503
            with pytest.raises(NodeApiUnreachable, match="HTTP 503"):
                await api.change(change(unschedulable=True))
        finally:
            await api.close()


async def test_kubernetes_node_api_without_credentials_is_unreachable_not_a_crash(tmp_path):
    api = KubernetesNodeApi("gpu-1", tmp_path / "no-such-kubeconfig", in_cluster="false")
    with pytest.raises(NodeApiUnreachable, match="Kubernetes credentials"):
        await api.read()
    reply = await NodeEndpoint(api)(NodeRead())
    assert (reply.ok, reply.reachable) == (False, False)
    await api.close()
