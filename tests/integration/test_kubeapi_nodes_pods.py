"""The API server stand-in's Nodes, pods, Evictions and PodDisruptionBudgets (kubeapi_nodes_pods.py),
over real HTTP with the client bcd's services use (kubernetes_asyncio through
shared.kubeclient.load_api_client and the stand-in's kubeconfig): each patch type on a Node's
labels, taints and spec.unschedulable, the validation and precondition answers, pods listed by
node, evictions against budgets, and the kubelet's pod-resources view of the same pods.

What the client sends (asserted in `test_patch_node_content_type_follows_the_body`):
`CoreV1Api.patch_node(name, body)` sends application/strategic-merge-patch+json for a dict (or
a model object), application/json-patch+json for a list; a JSON merge patch needs
`_content_type="application/merge-patch+json"`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from shared.kubeclient import load_api_client

from services.kube_reaper.podresources import KubeletPodResources
from services.kube_reaper.ports import PodDevice

from .kube_peers import KubeletServer
from .kubeapi_nodes_pods import (
    EVICTION_BLOCKED,
    EVICTION_MULTIPLE_PDBS,
    json_merge_patch,
    json_patch,
    strategic_merge_patch,
)
from .kubeapi_standin import KubeApiStandIn

NODE = "gpu-node-1"
GPU = "nvidia.com/gpu"
MERGE = "application/merge-patch+json"
LABEL_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start"
    " and end with an alphanumeric character"
)


@pytest.fixture
def standin() -> Iterator[KubeApiStandIn]:
    with KubeApiStandIn() as server:
        server.add_node(NODE, labels={"kubernetes.io/hostname": NODE})
        yield server


class Apis:
    def __init__(self, api_client: Any) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)

    async def evict(self, namespace: str, pod: str, **kwargs: Any) -> Any:
        body = client.V1Eviction(api_version="policy/v1", kind="Eviction", metadata=client.V1ObjectMeta(name=pod, namespace=namespace))
        return await self.core.create_namespaced_pod_eviction(pod, namespace, body, **kwargs)


@pytest.fixture
async def apis(standin: KubeApiStandIn, tmp_path: Path) -> AsyncIterator[Apis]:
    api_client, _ = await load_api_client(standin.write_kubeconfig(tmp_path / "kubeconfig"), "false")
    try:
        yield Apis(api_client)
    finally:
        await api_client.close()


async def refused(call: Any) -> tuple[int, dict, Any]:
    """(status, Status body, headers) of a call that must fail."""
    with pytest.raises(ApiException) as err:
        await call
    return err.value.status, json.loads(err.value.body), err.value.headers


def cause_fields(status: dict) -> set[str]:
    return {c["field"] for c in status["details"]["causes"]}


# --- Nodes ---------------------------------------------------------------------------------------------


async def test_patch_node_content_type_follows_the_body(standin: KubeApiStandIn, apis: Apis) -> None:
    await apis.core.patch_node(NODE, {"metadata": {"labels": {"a": "1"}}})
    await apis.core.patch_node(NODE, [{"op": "add", "path": "/metadata/labels/b", "value": "2"}])
    await apis.core.patch_node(NODE, {"metadata": {"labels": {"c": "3"}}}, _content_type=MERGE)
    await apis.core.patch_node(NODE, client.V1Node(metadata=client.V1ObjectMeta(labels={"d": "4"})))
    assert [r.content_type for r in standin.requests_to("PATCH", f"/api/v1/nodes/{NODE}")] == [
        "application/strategic-merge-patch+json",
        "application/json-patch+json",
        MERGE,
        "application/strategic-merge-patch+json",
    ]
    assert standin.node(NODE)["metadata"]["labels"] == {"kubernetes.io/hostname": NODE, "a": "1", "b": "2", "c": "3", "d": "4"}
    # server-side apply is not implemented: 415, as for any other type
    status, body, _ = await refused(apis.core.patch_node(NODE, {"metadata": {}}, _content_type="application/json"))
    assert (status, body["reason"]) == (415, "UnsupportedMediaType")
    assert "application/merge-patch+json" in body["message"]


async def test_labels_set_and_removed_by_each_patch_type(standin: KubeApiStandIn, apis: Apis) -> None:
    rvs = [int(standin.node(NODE)["metadata"]["resourceVersion"])]

    def labels() -> dict:
        node = standin.node(NODE)
        rvs.append(int(node["metadata"]["resourceVersion"]))
        return node["metadata"].get("labels", {})

    await apis.core.patch_node(NODE, {"metadata": {"labels": {"mig.bcd.dev/layout": "all-1g"}}}, _content_type=MERGE)
    assert labels()["mig.bcd.dev/layout"] == "all-1g"
    await apis.core.patch_node(NODE, {"metadata": {"labels": {"mig.bcd.dev/layout": None}}}, _content_type=MERGE)
    assert "mig.bcd.dev/layout" not in labels()

    await apis.core.patch_node(NODE, {"metadata": {"labels": {"mig.bcd.dev/state": "pending"}}})
    assert labels()["mig.bcd.dev/state"] == "pending"
    await apis.core.patch_node(NODE, {"metadata": {"labels": {"mig.bcd.dev/state": None}}})
    assert "mig.bcd.dev/state" not in labels()

    # JSON pointers escape "/" as ~1
    await apis.core.patch_node(NODE, [{"op": "add", "path": "/metadata/labels/mig.bcd.dev~1state", "value": "draining"}])
    assert labels()["mig.bcd.dev/state"] == "draining"
    await apis.core.patch_node(NODE, [{"op": "remove", "path": "/metadata/labels/mig.bcd.dev~1state"}])
    assert labels() == {"kubernetes.io/hostname": NODE}
    assert rvs == sorted(set(rvs)), rvs  # every change a new resourceVersion

    # nothing changed: nothing written, the same resourceVersion
    before = standin.node(NODE)["metadata"]["resourceVersion"]
    await apis.core.patch_node(NODE, {"metadata": {"labels": {"kubernetes.io/hostname": NODE}}})
    assert standin.node(NODE)["metadata"]["resourceVersion"] == before

    # JSON patch adds only under an existing parent: a node without labels has no /metadata/labels
    standin.add_node("bare-node")
    status, body, _ = await refused(apis.core.patch_node("bare-node", [{"op": "add", "path": "/metadata/labels/a", "value": "b"}]))
    assert (status, body["reason"], body["message"]) == (422, "Invalid", "the server rejected our request due to an error in our request")
    await apis.core.patch_node("bare-node", [{"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}])
    assert standin.node("bare-node")["metadata"]["labels"] == {"a": "b"}

    # the test helpers go through the same rules
    rv = standin.label_node(NODE, {"team": "ml", "kubernetes.io/hostname": None})
    assert standin.node(NODE)["metadata"]["labels"] == {"team": "ml"} and int(rv) > rvs[-1]
    with pytest.raises(ValueError, match="metadata.labels: Invalid value"):
        standin.label_node(NODE, {"team": "m l"})
    standin.annotate_node(NODE, {"bcd.dev/note": "x y z"})
    assert standin.node(NODE)["metadata"]["annotations"] == {"bcd.dev/note": "x y z"}


async def test_invalid_label_is_422_with_the_field_path(standin: KubeApiStandIn, apis: Apis) -> None:
    before = standin.node(NODE)
    status, body, _ = await refused(apis.core.patch_node(NODE, {"metadata": {"labels": {"mig.bcd.dev/layout": "all 1g"}}}))
    assert (status, body["reason"], body["details"]["kind"], body["details"]["name"]) == (422, "Invalid", "Node", NODE)
    assert body["message"] == f'Node "{NODE}" is invalid: metadata.labels: Invalid value: "all 1g": {LABEL_MSG}'
    # validateCommonFields and nodeStrategy.ValidateUpdate both check the labels, twice each
    assert [(c["reason"], c["field"]) for c in body["details"]["causes"]] == [("FieldValueInvalid", "metadata.labels")] * 4
    status, body, _ = await refused(apis.core.patch_node(NODE, {"metadata": {"labels": {"-bad": "x"}}}, _content_type=MERGE))
    assert status == 422 and cause_fields(body) == {"metadata.labels"} and '"-bad"' in body["message"]
    status, body, _ = await refused(apis.core.patch_node(NODE, {"metadata": {"annotations": {"x": "y" * (256 * 1024)}}}))
    assert status == 422 and body["details"]["causes"][0] == {
        "reason": "FieldValueTooLong", "message": "Too long: may not be more than 262144 bytes", "field": "metadata.annotations",
    }
    assert standin.node(NODE) == before  # nothing written


async def test_taints_replaced_whole_by_a_strategic_patch(standin: KubeApiStandIn, apis: Apis) -> None:
    standin.add_node(NODE, taints=[("nvidia.com/gpu", "present", "NoSchedule")])
    await apis.core.patch_node(NODE, {"spec": {"taints": [{"key": "mig.bcd.dev/relayout", "effect": "NoSchedule"}]}})
    # spec.taints has no patch strategy: the list is replaced, not merged
    assert standin.node(NODE)["spec"]["taints"] == [{"key": "mig.bcd.dev/relayout", "effect": "NoSchedule"}]
    # so adding a taint means sending the whole list, read first
    node = await apis.core.read_node(NODE)
    taints = [t.to_dict() for t in node.spec.taints] + [{"key": "mig.bcd.dev/drain", "value": "true", "effect": "NoExecute"}]
    await apis.core.patch_node(NODE, {"spec": {"taints": [{k: v for k, v in t.items() if v is not None} for t in taints]}})
    assert [t["key"] for t in standin.node(NODE)["spec"]["taints"]] == ["mig.bcd.dev/relayout", "mig.bcd.dev/drain"]
    await apis.core.patch_node(NODE, {"spec": {"taints": None}})
    assert "taints" not in standin.node(NODE)["spec"]

    # a merge patch replaces lists too; a JSON patch can append one
    await apis.core.patch_node(NODE, {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}]}}, _content_type=MERGE)
    await apis.core.patch_node(NODE, [{"op": "add", "path": "/spec/taints/-", "value": {"key": "b", "effect": "PreferNoSchedule"}}])
    assert standin.node(NODE)["spec"]["taints"] == [{"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "PreferNoSchedule"}]

    # validateNodeTaints reports under metadata.taints (ValidateNode passes fldPath "metadata")
    for taints, field, reason in (
        ([{"key": "a", "effect": "NoSchedule"}, {"key": "a", "value": "x", "effect": "NoSchedule"}], "metadata.taints[1]", "FieldValueDuplicate"),
        ([{"key": "a", "effect": "Sometimes"}], "metadata.taints[0].effect", "FieldValueNotSupported"),
        ([{"key": "a"}], "metadata.taints[0].effect", "FieldValueRequired"),
        ([{"key": "a b", "effect": "NoSchedule"}], "metadata.taints[0].key", "FieldValueInvalid"),
        ([{"key": "a", "value": "x y", "effect": "NoSchedule"}], "metadata.taints[0].value", "FieldValueInvalid"),
    ):
        status, body, _ = await refused(apis.core.patch_node(NODE, {"spec": {"taints": taints}}))
        assert status == 422 and cause_fields(body) == {field}, body
        assert {c["reason"] for c in body["details"]["causes"]} == {reason}
    status, body, _ = await refused(
        apis.core.patch_node(NODE, {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}, {"key": "a", "effect": "NoSchedule"}]}})
    )
    assert body["details"]["causes"][0]["message"] == (
        'Duplicate value: {"Key":"a","Value":"","Effect":"NoSchedule","TimeAdded":null}: taints must be unique by key and effect pair'
    )
    # the same key with another effect is another taint
    await apis.core.patch_node(NODE, {"spec": {"taints": [{"key": "a", "effect": "NoSchedule"}, {"key": "a", "effect": "NoExecute"}]}})
    with pytest.raises(ValueError, match=r"metadata.taints\[0\].effect: Unsupported value"):
        standin.add_node("node-9", taints=[("a", "", "Never")])


async def test_cordon_and_uncordon(standin: KubeApiStandIn, apis: Apis) -> None:
    standin.add_node("other-node")
    await apis.core.patch_node(NODE, {"spec": {"unschedulable": True}})  # what kubectl cordon sends
    assert standin.node(NODE)["spec"]["unschedulable"] is True
    cordoned = await apis.core.list_node(field_selector="spec.unschedulable=true")
    assert [n.metadata.name for n in cordoned.items] == [NODE]
    assert [n.metadata.name for n in (await apis.core.list_node(field_selector="spec.unschedulable=false")).items] == ["other-node"]
    await apis.core.patch_node(NODE, {"spec": {"unschedulable": None}})  # kubectl uncordon
    assert "unschedulable" not in standin.node(NODE)["spec"]
    status, body, _ = await refused(apis.core.patch_node(NODE, {"spec": {"unschedulable": "yes"}}))
    assert status == 422 and cause_fields(body) == {"patch"}  # the patched node does not decode


async def test_node_list_and_get(standin: KubeApiStandIn, apis: Apis) -> None:
    standin.add_node("cpu-node", labels={"bcd.dev/gpu": "false"})
    listed = await apis.core.list_node(label_selector="bcd.dev/gpu=false")
    assert [n.metadata.name for n in listed.items] == ["cpu-node"]
    assert len((await apis.core.list_node()).items) == 2
    node = await apis.core.read_node(NODE)
    assert node.metadata.labels == {"kubernetes.io/hostname": NODE} and node.metadata.uid == standin.node(NODE)["metadata"]["uid"]
    status, body, _ = await refused(apis.core.read_node("nowhere"))
    assert (status, body["message"]) == (404, 'nodes "nowhere" not found')
    status, body, _ = await refused(apis.core.patch_node("nowhere", {"spec": {"unschedulable": True}}))
    assert status == 404


async def test_resource_version_preconditions_and_fields_a_client_may_not_change(standin: KubeApiStandIn, apis: Apis) -> None:
    node = standin.node(NODE)
    rv = node["metadata"]["resourceVersion"]
    await apis.core.patch_node(NODE, {"metadata": {"labels": {"a": "1"}, "resourceVersion": rv}})  # current: fine
    status, body, _ = await refused(apis.core.patch_node(NODE, {"metadata": {"labels": {"a": "2"}, "resourceVersion": rv}}))
    assert (status, body["reason"]) == (409, "Conflict")
    assert body["message"] == (
        f'Operation cannot be fulfilled on nodes "{NODE}": the object has been modified; please apply your changes to the latest'
        " version and try again"
    )
    assert standin.node(NODE)["metadata"]["labels"]["a"] == "1"

    # PUT: a stale resourceVersion is 409, none is the unconditional update nodes allow
    stale = dict(node, metadata=dict(node["metadata"], labels={"b": "1"}))
    status, body, _ = await refused(apis.core.replace_node(NODE, stale))
    assert status == 409 and "the object has been modified" in body["message"]
    unconditional = dict(stale, metadata={k: v for k, v in stale["metadata"].items() if k != "resourceVersion"})
    replaced = await apis.core.replace_node(NODE, unconditional)
    assert replaced.metadata.labels == {"b": "1"} and int(replaced.metadata.resource_version) > int(rv)
    other_uid = dict(unconditional, metadata=dict(unconditional["metadata"], uid="1f0c1a2b-0000-4000-8000-000000000000"))
    status, body, _ = await refused(apis.core.replace_node(NODE, other_uid))
    assert status == 409 and "Precondition failed: UID in precondition: 1f0c1a2b-0000-4000-8000-000000000000" in body["message"]

    # name: 400 (checkName); uid through a patch: 422 immutable; creationTimestamp: silently kept (BeforeUpdate)
    status, body, _ = await refused(apis.core.patch_node(NODE, {"metadata": {"name": "renamed"}}))
    assert (status, body["message"]) == (400, f"the name of the object (renamed) does not match the name on the URL ({NODE})")
    status, body, _ = await refused(apis.core.patch_node(NODE, {"metadata": {"uid": "1f0c1a2b-0000-4000-8000-000000000000"}}))
    assert status == 422 and cause_fields(body) == {"metadata.uid"} and "field is immutable" in body["message"]
    created = standin.node(NODE)["metadata"]["creationTimestamp"]
    await apis.core.patch_node(NODE, {"metadata": {"creationTimestamp": "2001-01-01T00:00:00Z", "labels": {"c": "1"}}})
    assert standin.node(NODE)["metadata"]["creationTimestamp"] == created
    # status goes through the status subresource only: a PATCH of the node keeps the stored one
    await apis.core.patch_node(NODE, {"status": {"phase": "Terminated"}, "metadata": {"labels": {"d": "1"}}})
    assert standin.node(NODE)["status"] == {}


async def test_json_patch_test_operation(standin: KubeApiStandIn, apis: Apis) -> None:
    rv = standin.node(NODE)["metadata"]["resourceVersion"]
    guarded = [
        {"op": "test", "path": "/metadata/labels/kubernetes.io~1hostname", "value": "elsewhere"},
        {"op": "add", "path": "/metadata/labels/mig.bcd.dev~1layout", "value": "all-1g"},
    ]
    status, body, _ = await refused(apis.core.patch_node(NODE, guarded))
    assert (status, body["reason"], body["message"]) == (422, "Invalid", "the server rejected our request due to an error in our request")
    assert standin.node(NODE)["metadata"]["resourceVersion"] == rv  # no operation applied
    guarded[0]["value"] = NODE
    await apis.core.patch_node(NODE, guarded)
    assert standin.node(NODE)["metadata"]["labels"]["mig.bcd.dev/layout"] == "all-1g"
    # a test of the resourceVersion is a compare-and-swap
    status, _, _ = await refused(apis.core.patch_node(NODE, [{"op": "test", "path": "/metadata/resourceVersion", "value": rv}]))
    assert status == 422


def test_patch_algorithms() -> None:
    """The three patch types on plain documents (what the HTTP tests cannot isolate)."""
    doc = {"metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x"]}, "spec": {"taints": [{"key": "t", "effect": "NoSchedule"}], "podCIDRs": ["10.0.0.0/24"]}}
    assert json_merge_patch(doc, {"metadata": {"labels": {"a": None, "c": "3"}}})["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert json_merge_patch(doc, {"spec": {"x": {"y": None, "z": 1}}})["spec"]["x"] == {"z": 1}  # nulls pruned in a new value
    smp = strategic_merge_patch(doc, {"metadata": {"finalizers": ["y"], "$deleteFromPrimitiveList/finalizers": ["x"]}, "spec": {"podCIDRs": ["fd00::/64"]}})
    # merge lists; mergeSortedSlice puts an item only the patch has before the server's items
    assert smp["metadata"]["finalizers"] == ["y"] and smp["spec"]["podCIDRs"] == ["fd00::/64", "10.0.0.0/24"]
    assert strategic_merge_patch(doc, {"metadata": {"labels": {"$patch": "replace", "z": "9"}}})["metadata"]["labels"] == {"z": "9"}
    assert strategic_merge_patch(doc, {"metadata": {"labels": {"$patch": "delete"}}})["metadata"]["labels"] == {}
    assert strategic_merge_patch(doc, {"spec": {"$retainKeys": ["podCIDRs"]}})["spec"] == {"podCIDRs": ["10.0.0.0/24"]}
    owners = {"metadata": {"ownerReferences": [{"uid": "1", "name": "a"}, {"uid": "2", "name": "b"}]}}
    merged = strategic_merge_patch(owners, {"metadata": {"ownerReferences": [{"uid": "2", "name": "B"}, {"$patch": "delete", "uid": "1"}]}})
    assert merged["metadata"]["ownerReferences"] == [{"uid": "2", "name": "B"}]
    assert json_patch(doc, [{"op": "move", "from": "/metadata/labels/a", "path": "/metadata/labels/z"}])["metadata"]["labels"] == {"b": "2", "z": "1"}
    assert json_patch(doc, [{"op": "copy", "from": "/spec/taints/0", "path": "/spec/taints/0"}])["spec"]["taints"][1] == {"key": "t", "effect": "NoSchedule"}
    assert doc["metadata"]["labels"] == {"a": "1", "b": "2"}  # never modified in place


# --- pods ------------------------------------------------------------------------------------------------


async def test_pods_on_the_node(standin: KubeApiStandIn, apis: Apis) -> None:
    standin.add_pod("ml", "train-0", NODE, labels={"app": "train"}, devices={GPU: ["GPU-0", "GPU-1"]})
    standin.add_pod("ml", "notebook", "other-node", labels={"app": "nb"})
    standin.add_pod("web", "frontend", NODE, labels={"app": "web"})
    on_node = await apis.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={NODE}")
    assert [(p.metadata.namespace, p.metadata.name) for p in on_node.items] == [("ml", "train-0"), ("web", "frontend")]
    assert standin.requests_to("GET", "/api/v1/pods")[-1].query == {"fieldSelector": f"spec.nodeName={NODE}"}
    ml = await apis.core.list_namespaced_pod("ml", label_selector="app=train")
    assert [p.metadata.name for p in ml.items] == ["train-0"]
    pod = await apis.core.read_namespaced_pod("train-0", "ml")
    assert pod.spec.node_name == NODE and pod.status.phase == "Running"
    assert pod.spec.containers[0].resources.limits == {GPU: "2"}
    assert [p["metadata"]["name"] for p in standin.pods(NODE)] == ["train-0", "frontend"]
    status, body, _ = await refused(apis.core.list_pod_for_all_namespaces(field_selector="spec.nodeNam=x"))
    assert status == 400 and "field label not supported" in body["message"]
    await apis.core.delete_namespaced_pod("frontend", "web", grace_period_seconds=0)
    assert standin.pod("web", "frontend") is None
    status, body, _ = await refused(apis.core.read_namespaced_pod("frontend", "web"))
    assert (status, body["message"]) == (404, 'pods "frontend" not found')


# --- evictions -----------------------------------------------------------------------------------------


def train_pods(standin: KubeApiStandIn, n: int, *, owner: str | None = None) -> list[str]:
    names = [f"train-{i}" for i in range(n)]
    for i, name in enumerate(names):
        standin.add_pod("ml", name, NODE, labels={"app": "train"}, devices={GPU: [f"GPU-{i}"]}, owner=owner)
    return names


async def test_eviction_min_available_int(standin: KubeApiStandIn, apis: Apis) -> None:
    names = train_pods(standin, 3)
    standin.add_pdb("ml", "train", {"app": "train"}, min_available=2)
    assert (standin.pdb("ml", "train")["status"]["disruptionsAllowed"], standin.pdb("ml", "train")["status"]["expectedPods"]) == (1, 3)
    await apis.evict("ml", names[0])
    assert standin.pod("ml", names[0]) is None
    status, body, headers = await refused(apis.evict("ml", names[1]))
    assert (status, body["reason"], body["message"]) == (429, "TooManyRequests", EVICTION_BLOCKED)
    assert body["details"]["causes"] == [{"reason": "DisruptionBudget", "message": "The disruption budget train needs 2 healthy pods and has 2 currently"}]
    assert "Retry-After" not in headers  # NewTooManyRequests(msg, 0)
    assert standin.pod("ml", names[1]) is not None
    assert [(e.pod, e.code, e.status) for e in standin.evictions("ml")] == [(names[0], 201, "Success"), (names[1], 429, "Failure")]
    budgets = await apis.policy.list_namespaced_pod_disruption_budget("ml")
    assert [(b.metadata.name, b.status.disruptions_allowed, b.status.current_healthy) for b in budgets.items] == [("train", 0, 2)]


async def test_eviction_min_available_percent_counts_the_controller_scale(standin: KubeApiStandIn, apis: Apis) -> None:
    standin.add_controller("ml", "train-rs", replicas=4)
    names = train_pods(standin, 4, owner="train-rs")
    standin.add_pdb("ml", "train", {"app": "train"}, min_available="50%")  # ceil(50% of 4) = 2
    await apis.evict("ml", names[0])
    await apis.evict("ml", names[1])
    status, body, _ = await refused(apis.evict("ml", names[2]))
    assert status == 429 and "needs 2 healthy pods and has 2 currently" in body["details"]["causes"][0]["message"]


async def test_eviction_max_unavailable_int_and_percent(standin: KubeApiStandIn, apis: Apis) -> None:
    # the expected count is the controller's scale, which stays 3 while its pods go
    standin.add_controller("ml", "train-rs", replicas=3)
    names = train_pods(standin, 3, owner="train-rs")
    standin.add_pdb("ml", "train", {"app": "train"}, max_unavailable=1)
    await apis.evict("ml", names[0])
    status, body, _ = await refused(apis.evict("ml", names[1]))
    assert status == 429 and "needs 2 healthy pods and has 2 currently" in body["details"]["causes"][0]["message"]

    standin.add_controller("batch", "jobs", replicas=3)
    for i in range(3):
        standin.add_pod("batch", f"job-{i}", NODE, labels={"app": "job"}, owner="jobs")
    standin.add_pdb("batch", "jobs", {"app": "job"}, max_unavailable="34%")  # ceil(1.02) = 2 may go
    await apis.evict("batch", "job-0")
    await apis.evict("batch", "job-1")
    status, _, _ = await refused(apis.evict("batch", "job-2"))
    assert status == 429

    # bare pods have no scale: a maxUnavailable budget over them allows nothing (expectedPods 0)
    standin.add_pod("bare", "solo", NODE, labels={"app": "solo"})
    standin.add_pdb("bare", "solo", {"app": "solo"}, max_unavailable=1)
    assert standin.pdb("bare", "solo")["status"]["expectedPods"] == 0
    status, _, _ = await refused(apis.evict("bare", "solo"))
    assert status == 429


async def test_two_budgets_answer_201_with_a_failure_status(standin: KubeApiStandIn, apis: Apis) -> None:
    standin.add_pod("ml", "train-0", NODE, labels={"app": "train", "tier": "gpu"})
    standin.add_pdb("ml", "by-app", {"app": "train"}, min_available=0)
    standin.add_pdb("ml", "by-tier", {"tier": "gpu"}, min_available=0)
    # EvictionREST.Create returns the Status as an object, so the HTTP status is 201: client-go
    # makes it an error, kubernetes_asyncio returns it as if it were the Eviction
    answer = await apis.evict("ml", "train-0")
    assert answer.kind == "Status"
    assert standin.pod("ml", "train-0") is not None  # nothing evicted
    (record,) = standin.evictions("ml")
    assert (record.code, record.status, record.message, record.evicted) == (201, "Failure", EVICTION_MULTIPLE_PDBS, False)
    raw = await apis.evict("ml", "train-0", _preload_content=False)
    assert raw.status == 201 and json.loads(await raw.read())["code"] == 500


async def test_terminal_pending_and_unready_pods(standin: KubeApiStandIn, apis: Apis) -> None:
    standin.add_pod("ml", "done", NODE, labels={"app": "train"}, phase="Succeeded")
    standin.add_pod("ml", "waiting", NODE, labels={"app": "train"}, phase="Pending")
    standin.add_pod("ml", "up", NODE, labels={"app": "train"})
    standin.add_pdb("ml", "train", {"app": "train"}, min_available=1)
    assert standin.pdb("ml", "train")["status"]["disruptionsAllowed"] == 0
    await apis.evict("ml", "done")  # canIgnorePDB: terminal
    await apis.evict("ml", "waiting")  # and Pending
    assert standin.pod("ml", "done") is None and standin.pod("ml", "waiting") is None
    status, _, _ = await refused(apis.evict("ml", "up"))
    assert status == 429
    # a Running pod that is not ready goes when the budget is met without it
    standin.add_pod("ml", "warming", NODE, labels={"app": "train"}, ready=False)
    await apis.evict("ml", "warming")
    assert standin.pod("ml", "warming") is None


async def test_eviction_refusals(standin: KubeApiStandIn, apis: Apis) -> None:
    standin.add_pod("ml", "train-0", NODE, labels={"app": "train"})
    status, body, _ = await refused(apis.evict("ml", "nope"))
    assert (status, body["reason"], body["message"]) == (404, "NotFound", 'pods "nope" not found')
    wrong = client.V1Eviction(api_version="policy/v1", kind="Eviction", metadata=client.V1ObjectMeta(name="other"))
    status, body, _ = await refused(apis.core.create_namespaced_pod_eviction("train-0", "ml", wrong))
    assert (status, body["message"]) == (400, "name in URL does not match name in Eviction object")
    elsewhere = client.V1Eviction(api_version="policy/v1", kind="Eviction", metadata=client.V1ObjectMeta(name="train-0", namespace="web"))
    status, body, _ = await refused(apis.core.create_namespaced_pod_eviction("train-0", "ml", elsewhere))
    assert status == 400 and "namespace of the provided object does not match" in body["message"]
    # dry run: the answer without the deletion
    await apis.evict("ml", "train-0", dry_run="All")
    assert standin.pod("ml", "train-0") is not None and standin.evictions("ml")[-1].dry_run
    # fail_next and hang_next take eviction requests too
    standin.fail_next(1, 500)
    status, _, _ = await refused(apis.evict("ml", "train-0"))
    assert status == 500 and standin.pod("ml", "train-0") is not None
    await apis.evict("ml", "train-0")
    assert standin.pod("ml", "train-0") is None
    assert [r.status for r in standin.requests_to("POST", "/api/v1/namespaces/ml/pods/train-0/eviction")] == [400, 400, 201, 500, 201]


async def test_graceful_eviction_and_the_kubelet_view(standin: KubeApiStandIn, apis: Apis, short_dir: Path) -> None:
    """An evicted pod stays, with a deletionTimestamp, while the kubelet stops it; the
    pod-resources List shows it until then, and the budget no longer counts it healthy."""
    standin.add_pod("ml", "train-0", NODE, labels={"app": "train"}, devices={GPU: ["GPU-0"]})
    standin.add_pod("ml", "train-1", NODE, labels={"app": "train"}, devices=[("main", {GPU: ["GPU-1"]}), ("sidecar", {})])
    standin.add_pod("ml", "elsewhere", "other-node", labels={"app": "x"}, devices={GPU: ["GPU-9"]})
    standin.add_pod("ml", "finished", NODE, phase="Succeeded", devices={GPU: ["GPU-2"]})
    standin.add_pdb("ml", "train", {"app": "train"}, min_available=1)
    standin.eviction_grace_s = 0.6
    socket = short_dir / "kubelet.sock"
    kubelet = KubeletServer(standin.kubelet_pods(NODE), socket).start()
    reader = KubeletPodResources(socket, timeout=2)
    try:
        assert await reader.list_devices() == [  # active pods only: "finished" is not listed
            PodDevice("ml", "train-0", "main", GPU, "GPU-0"),
            PodDevice("ml", "train-1", "main", GPU, "GPU-1"),
        ]
        await apis.evict("ml", "train-0")
        going = standin.pod("ml", "train-0")
        assert going is not None and going["metadata"]["deletionTimestamp"] and going["metadata"]["deletionGracePeriodSeconds"] == 30
        assert [d.pod for d in await reader.list_devices()] == ["train-0", "train-1"]  # still stopping
        # a terminating pod is not healthy: the budget is spent until it is gone
        status, _, _ = await refused(apis.evict("ml", "train-1"))
        assert status == 429
        deadline = time.monotonic() + 5
        while await reader.list_devices() != [PodDevice("ml", "train-1", "main", GPU, "GPU-1")]:
            assert time.monotonic() < deadline, "the evicted pod never left the kubelet's list"
            await asyncio.sleep(0.05)
        assert standin.pod("ml", "train-0") is None
        assert [p.metadata.name for p in (await apis.core.list_namespaced_pod("ml")).items] == ["elsewhere", "finished", "train-1"]
    finally:
        await reader.close()
        kubelet.stop()
