"""The DRA plugin's Kubernetes client (services/dra_plugin/kubeapi.py) against the API server
stand-in (kubeapi_standin.py): claims, the Node, the ResourceSlice life cycle, errors and
timeouts; then the stand-in's ResourceSlice validation as a table (one row per upstream rule,
each body sent through the client), its update rules, its feature-gate drops, and the
scheduler's pool check."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.dra_plugin.kubeapi import (
    AllocationResult,
    AlreadyExists,
    ClaimConsumer,
    ClusterApi,
    Conflict,
    KubeApi,
    KubeApiError,
)

from .kubeapi_standin import GATES_1_35_DEFAULT, GATES_ENABLED, KubeApiStandIn, parse_quantity, validate_claim_status_update

DRIVER = "gpu.bcd.dev"
NODE = "node-1"
GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"


@pytest.fixture
def standin() -> Iterator[KubeApiStandIn]:
    with KubeApiStandIn() as server:
        yield server


@pytest.fixture
async def api(standin: KubeApiStandIn, tmp_path: Path) -> AsyncIterator[ClusterApi]:
    client = ClusterApi(standin.write_kubeconfig(tmp_path / "kubeconfig"), timeout=5)
    try:
        yield client
    finally:
        await client.close()


def device_slice(name: str = "node-1-gpu.bcd.dev-devices", node_uid: str = "0d9c1f9e-0000-4000-8000-000000000001") -> dict:
    """A node-local slice as the plugin writes one: a whole card and a MIG placement consuming its counters."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": name,
            "labels": {"gpu.bcd.dev/node": NODE},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 2},
            "devices": [
                {
                    "name": "gpu-0",
                    "attributes": {
                        "gpu.bcd.dev/uuid": {"string": GPU0},
                        "index": {"int": 0},
                        "gpu.bcd.dev/mig": {"bool": False},
                        "driverVersion": {"version": "570.86.15"},
                    },
                    "capacity": {"gpu.bcd.dev/memory": {"value": "141Gi"}},
                    "consumesCounters": [{"counterSet": "gpu-0", "counters": {"memory-slices": {"value": "8"}, "compute-slices": {"value": "7"}}}],
                },
                {
                    "name": "gpu-0-mig-1g-18gb-0",
                    "attributes": {"gpu.bcd.dev/profile": {"string": "1g.18gb"}},
                    "consumesCounters": [{"counterSet": "gpu-0", "counters": {"memory-slices": {"value": "1"}, "compute-slices": {"value": "1"}}}],
                },
            ],
        },
    }


def counter_slice(name: str = "node-1-gpu.bcd.dev-counters") -> dict:
    """The same pool's counter sets (1.35: a slice carries either devices or counter sets)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 2},
            "sharedCounters": [{"name": "gpu-0", "counters": {"memory-slices": {"value": "8"}, "compute-slices": {"value": "7"}}}],
        },
    }


def plain_device(name: str) -> dict:
    return {"name": name, "attributes": {"index": {"int": 0}}}


# --- the client against the stand-in ---------------------------------------------------------------


async def test_cluster_api_is_a_kube_api(api: ClusterApi) -> None:
    assert isinstance(api, KubeApi)


async def test_claims_found_missing_and_unallocated(standin: KubeApiStandIn, api: ClusterApi) -> None:
    uid = standin.add_claim(
        "ml",
        "train-gpu",
        results=[("gpus", DRIVER, NODE, "gpu-0"), ("gpus", DRIVER, NODE, "gpu-1"), ("nic", "nic.example.com", NODE, "eth1")],
        reserved_for=[("trainer", "3c1e7a52-9b0d-4f61-a8e2-5d7c4b1f0a93")],
        node=NODE,
    )
    standin.add_claim("ml", "pending", allocated=False)

    claim = await api.get_claim("ml", "train-gpu")
    assert claim is not None
    assert (claim.uid, claim.namespace, claim.name, claim.allocated) == (uid, "ml", "train-gpu", True)
    assert claim.results == (
        AllocationResult("gpus", DRIVER, NODE, "gpu-0"),
        AllocationResult("gpus", DRIVER, NODE, "gpu-1"),
        AllocationResult("nic", "nic.example.com", NODE, "eth1"),
    )
    assert claim.results_for(DRIVER) == claim.results[:2]
    assert claim.reserved_for == (ClaimConsumer("pods", "trainer", "3c1e7a52-9b0d-4f61-a8e2-5d7c4b1f0a93"),)
    assert claim.raw["status"]["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [NODE]

    assert await api.get_claim("ml", "nope") is None
    assert await api.get_claim("other", "train-gpu") is None

    pending = await api.get_claim("ml", "pending")
    assert pending is not None and not pending.allocated and pending.results == () and pending.reserved_for == ()

    # the scheduler allocates it later: same uid, a new resourceVersion
    standin.add_claim("ml", "pending", results=[("gpu", DRIVER, NODE, "gpu-2")])
    later = await api.get_claim("ml", "pending")
    assert later is not None and later.allocated and later.uid == pending.uid
    assert int(later.resource_version) > int(pending.resource_version)

    standin.remove_claim("ml", "pending")
    assert await api.get_claim("ml", "pending") is None
    assert [r.status for r in standin.requests_to("GET", "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/")] == [
        200, 404, 200, 200, 404,
    ]


async def test_claim_list_and_status(standin: KubeApiStandIn, api: ClusterApi) -> None:
    standin.add_claim("ml", "a", results=[("gpu", DRIVER, NODE, "gpu-0")])
    standin.add_claim("web", "b", allocated=False)
    assert sorted((c.namespace, c.name, c.allocated) for c in await api.list_claims()) == [("ml", "a", True), ("web", "b", False)]

    body = standin.claim("ml", "a")
    assert body is not None
    body["status"]["devices"] = [{"driver": DRIVER, "pool": NODE, "device": "gpu-0", "conditions": []}]
    written = await api.replace_claim_status("ml", "a", body)
    assert written["status"]["devices"][0]["device"] == "gpu-0"
    with pytest.raises(Conflict):  # the same stale resourceVersion again
        await api.replace_claim_status("ml", "a", body)
    fresh = copy.deepcopy(written)
    fresh["status"]["devices"][0]["device"] = "gpu-7"  # not allocated to this claim
    with pytest.raises(KubeApiError) as refused:
        await api.replace_claim_status("ml", "a", fresh)
    assert refused.value.status == 422 and refused.value.fields == ("status.devices[0]",)


async def test_node_uid(standin: KubeApiStandIn, api: ClusterApi) -> None:
    uid = standin.add_node(NODE)
    assert await api.node_uid(NODE) == uid
    with pytest.raises(KubeApiError) as missing:
        await api.node_uid("node-2")
    assert (missing.value.status, missing.value.reason) == (404, "NotFound")


async def test_slice_create_list_replace_conflict_delete(standin: KubeApiStandIn, api: ClusterApi) -> None:
    created = await api.create_slice(device_slice())
    assert created["metadata"]["uid"] and created["metadata"]["generation"] == 1 and created["metadata"]["creationTimestamp"]
    assert created["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 2}  # camelCase, as sent
    await api.create_slice(counter_slice())
    generated = device_slice(name="")
    generated["metadata"] = {"generateName": "node-1-gpu.bcd.dev-"}
    generated["spec"]["pool"]["name"] = "node-1-extra"
    named = await api.create_slice(generated)
    assert named["metadata"]["name"].startswith("node-1-gpu.bcd.dev-") and len(named["metadata"]["name"]) == len("node-1-gpu.bcd.dev-") + 5
    # another driver and another node: not listed
    other = counter_slice("nic-node-1")
    other["spec"]["driver"] = "nic.example.com"
    await api.create_slice(other)
    elsewhere = counter_slice("node-2-gpu.bcd.dev-counters")
    elsewhere["spec"]["nodeName"] = elsewhere["spec"]["pool"]["name"] = "node-2"
    await api.create_slice(elsewhere)

    listed = await api.list_slices(DRIVER, NODE)
    assert sorted(s["metadata"]["name"] for s in listed) == sorted(
        ["node-1-gpu.bcd.dev-devices", "node-1-gpu.bcd.dev-counters", named["metadata"]["name"]]
    )
    assert all(s["kind"] == "ResourceSlice" and s["apiVersion"] == "resource.k8s.io/v1" for s in listed)
    assert standin.requests_to("GET", "/apis/resource.k8s.io/v1/resourceslices")[-1].query == {
        "fieldSelector": f"spec.driver={DRIVER},spec.nodeName={NODE}"
    }
    assert [s["metadata"]["name"] for s in await api.list_slices(DRIVER, NODE, label_selector="gpu.bcd.dev/node=node-1")] == [
        "node-1-gpu.bcd.dev-devices"
    ]

    # replace: a listed item goes back as it is, with its resourceVersion
    current = next(s for s in listed if s["metadata"]["name"] == "node-1-gpu.bcd.dev-devices")
    current["spec"]["pool"]["generation"] = 2
    replaced = await api.replace_slice(current["metadata"]["name"], current)
    assert replaced["metadata"]["generation"] == 2 and replaced["metadata"]["uid"] == created["metadata"]["uid"]
    assert int(replaced["metadata"]["resourceVersion"]) > int(current["metadata"]["resourceVersion"])
    same = await api.replace_slice(replaced["metadata"]["name"], replaced)  # no change: same generation
    assert same["metadata"]["generation"] == 2

    with pytest.raises(Conflict) as stale:  # the resourceVersion of before the first replace
        await api.replace_slice(current["metadata"]["name"], current)
    assert stale.value.status == 409 and stale.value.reason == "Conflict"
    assert "the object has been modified" in str(stale.value)
    unconditional = copy.deepcopy(current)
    del unconditional["metadata"]["resourceVersion"]  # AllowUnconditionalUpdate
    assert (await api.replace_slice(current["metadata"]["name"], unconditional))["metadata"]["generation"] == 2

    with pytest.raises(AlreadyExists) as taken:
        await api.create_slice(device_slice())
    assert (taken.value.status, taken.value.reason) == (409, "AlreadyExists")
    with pytest.raises(KubeApiError) as nowhere:
        await api.replace_slice("no-such-slice", {**device_slice(), "metadata": {"name": "no-such-slice"}})
    assert nowhere.value.status == 404

    await api.delete_slice("node-1-gpu.bcd.dev-devices")
    await api.delete_slice("node-1-gpu.bcd.dev-devices")  # 404: already gone, not an error
    assert "node-1-gpu.bcd.dev-devices" not in [s["metadata"]["name"] for s in standin.slices(DRIVER)]
    assert [r.status for r in standin.requests_to("DELETE")] == [200, 404]


async def test_update_rules(standin: KubeApiStandIn, api: ClusterApi) -> None:
    """ValidateResourceSliceUpdate: driver, pool name and node name are immutable; the rest is validated again."""
    stored = await api.create_slice(counter_slice())
    for change, field in (
        (lambda s: s["spec"].update(driver="gpu2.bcd.dev"), "spec.driver"),
        (lambda s: s["spec"]["pool"].update(name="node-1-b"), "spec.pool.name"),
        (lambda s: s["spec"].update(nodeName="node-2"), "spec.nodeName"),
        (lambda s: s["spec"]["pool"].update(resourceSliceCount=0), "spec.pool.resourceSliceCount"),
    ):
        body = copy.deepcopy(stored)
        change(body)
        with pytest.raises(KubeApiError) as refused:
            await api.replace_slice(body["metadata"]["name"], body)
        assert (refused.value.status, refused.value.fields) == (422, (field,))
    wrong_name = copy.deepcopy(stored)
    with pytest.raises(KubeApiError) as mismatch:
        await api.replace_slice("another-name", wrong_name)
    assert mismatch.value.status == 400 and "does not match the name on the URL" in str(mismatch.value)


async def test_errors_become_kube_api_errors(standin: KubeApiStandIn, api: ClusterApi, tmp_path: Path) -> None:
    standin.add_node(NODE)
    standin.fail_next(1, 500)
    with pytest.raises(KubeApiError) as server_error:
        await api.node_uid(NODE)
    assert (server_error.value.status, server_error.value.reason) == (500, "InternalError")
    standin.fail_next(2, 503)
    for call in (api.list_slices(DRIVER, NODE), api.delete_slice("x")):
        with pytest.raises(KubeApiError) as unavailable:
            await call
        assert unavailable.value.status == 503
    assert await api.node_uid(NODE)  # and then it answers again

    kubeconfig = json.loads(standin.write_kubeconfig(tmp_path / "wrong-token").read_text())
    kubeconfig["users"][0]["user"]["token"] = "not-the-token"
    (tmp_path / "wrong-token").write_text(json.dumps(kubeconfig))
    unauthorized = ClusterApi(tmp_path / "wrong-token", timeout=5)
    try:
        with pytest.raises(KubeApiError) as refused:
            await unauthorized.get_claim("ml", "a")
        assert (refused.value.status, refused.value.reason) == (401, "Unauthorized")
    finally:
        await unauthorized.close()

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig["clusters"][0]["cluster"]["server"] = f"http://127.0.0.1:{port}"
    (tmp_path / "nowhere").write_text(json.dumps(kubeconfig))
    nowhere = ClusterApi(tmp_path / "nowhere", timeout=5)
    try:
        with pytest.raises(KubeApiError) as refused_connection:
            await nowhere.list_slices(DRIVER, NODE)
        assert refused_connection.value.status == 0 and "ClientConnectorError" in str(refused_connection.value)
    finally:
        await nowhere.close()

    no_credentials = ClusterApi(tmp_path / "missing-kubeconfig", timeout=5)
    try:
        with pytest.raises(KubeApiError) as no_config:
            await no_credentials.node_uid(NODE)
        assert no_config.value.status == 0 and "credentials" in str(no_config.value)
    finally:
        await no_credentials.close()


async def test_a_hanging_server_times_out(standin: KubeApiStandIn, tmp_path: Path) -> None:
    standin.add_node(NODE)
    client = ClusterApi(standin.write_kubeconfig(tmp_path / "kubeconfig"), timeout=0.5)
    try:
        standin.hang_next(1, 30)
        started = time.monotonic()
        with pytest.raises(KubeApiError) as hung:
            await client.node_uid(NODE)
        elapsed = time.monotonic() - started
        assert hung.value.status == 0 and "no answer within 0.5s" in str(hung.value)
        assert 0.4 < elapsed < 3, elapsed
        standin.release()
        assert await client.node_uid(NODE)  # a new connection; the server is not stuck
    finally:
        await client.close()


# --- ResourceSlice validation: one row per rule ----------------------------------------------------

Mutation = Callable[[dict], Any]


def _devices(n: int, consume: bool = False) -> Mutation:
    def mutate(s: dict) -> None:
        s["spec"]["devices"] = [plain_device(f"gpu-{i}") for i in range(n)]
        if consume:
            s["spec"]["devices"][0]["consumesCounters"] = [{"counterSet": "gpu-0", "counters": {"memory-slices": {"value": "1"}}}]

    return mutate


def _steps(path: str) -> list[str]:
    """`spec.devices.0.attributes[gpu.bcd.dev/uuid].string` -> the keys, a bracketed one whole."""
    steps: list[str] = []
    for i, part in enumerate(re.split(r"\[([^\]]*)\]", path)):
        steps.extend([part] if i % 2 else [k for k in part.split(".") if k])
    return steps


def _set(path: str, value: Any) -> Mutation:
    """Set a value at a dotted path (`spec.pool.name`, `spec.devices.0.name`, `...attributes[a.b/c]`)."""

    def mutate(s: dict) -> None:
        *parents, last = _steps(path)
        node: Any = s
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _delete(path: str) -> Mutation:
    def mutate(s: dict) -> None:
        *parents, last = _steps(path)
        node: Any = s
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        del node[last]

    return mutate


def _all(*mutations: Mutation) -> Mutation:
    def mutate(s: dict) -> None:
        for m in mutations:
            m(s)

    return mutate


def _attrs(n: int) -> dict:
    return {f"a{i}": {"int": i} for i in range(n)}


def _counters(n: int) -> dict:
    return {f"c{i}": {"value": "1"} for i in range(n)}


def _binding(conditions: list[str], failures: list[str]) -> Mutation:
    return _all(_set("spec.devices.0.bindingConditions", conditions), _set("spec.devices.0.bindingFailureConditions", failures))


D0 = "spec.devices[0]"
ATTR = "gpu.bcd.dev/uuid"
MEMORY = "gpu.bcd.dev/memory"
POLICY = {"default": "1Gi", "validValues": ["1Gi", "2Gi"]}
OK = "accepted"
TAINT = {"key": "gpu.bcd.dev/xid", "value": "79", "effect": "NoExecute", "timeAdded": "2026-12-03T10:00:00Z"}
#: (id, base, mutation, expected): expected is OK, a set of field paths (422 Invalid), or 400 (refused decoding)
ROWS: list[tuple[str, Callable[[], dict], Mutation, Any]] = [
    ("all fine: devices", device_slice, lambda s: None, OK),
    ("all fine: counter sets", counter_slice, lambda s: None, OK),
    # spec.driver: ValidateCSIDriverName (a DNS subdomain once lowercased, <= 63)
    ("driver not a DNS subdomain", device_slice, _set("spec.driver", "gpu_bcd.dev"), {"spec.driver"}),
    ("driver longer than 63", device_slice, _set("spec.driver", "g" * 60 + ".dev"), {"spec.driver"}),
    ("driver with upper case: a warning only", device_slice, _set("spec.driver", "GPU.bcd.dev"), OK),
    ("driver missing", device_slice, _delete("spec.driver"), {"spec.driver"}),
    # spec.pool
    ("pool name empty", device_slice, _set("spec.pool.name", ""), {"spec.pool.name"}),
    ("pool name longer than 253", device_slice, _set("spec.pool.name", ".".join(["p" * 63] * 4) + "p"), {"spec.pool.name"}),
    ("pool name of DNS subdomains and slashes", device_slice, _set("spec.pool.name", "node-1/gpu.bcd.dev"), OK),
    ("pool name part not a subdomain", device_slice, _set("spec.pool.name", "node-1/GPU"), {"spec.pool.name"}),
    ("resourceSliceCount zero", device_slice, _set("spec.pool.resourceSliceCount", 0), {"spec.pool.resourceSliceCount"}),
    ("generation negative", device_slice, _set("spec.pool.generation", -1), {"spec.pool.generation"}),
    ("generation zero", device_slice, _set("spec.pool.generation", 0), OK),
    # node selection: exactly one of nodeName / nodeSelector / allNodes / perDeviceNodeSelection
    ("no node selection", device_slice, _delete("spec.nodeName"), {"spec"}),
    ("nodeName and allNodes", device_slice, _set("spec.allNodes", True), {"spec"}),
    ("allNodes false next to nodeName", device_slice, _set("spec.allNodes", False), {"spec.allNodes"}),
    ("nodeName empty", device_slice, _set("spec.nodeName", ""), {"spec.nodeName", "spec"}),
    ("nodeName not a DNS subdomain", device_slice, _set("spec.nodeName", "Node_1"), {"spec.nodeName"}),
    (
        "nodeSelector with two terms",
        device_slice,
        _all(_delete("spec.nodeName"), _set("spec.nodeSelector", {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]},
            {"matchExpressions": [{"key": "tpu", "operator": "Exists"}]},
        ]})),
        {"spec.nodeSelector.nodeSelectorTerms"},
    ),
    (
        "nodeSelector with one term",
        counter_slice,
        _all(_delete("spec.nodeName"), _set("spec.nodeSelector", {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]})),
        OK,
    ),
    ("allNodes alone", counter_slice, _all(_delete("spec.nodeName"), _set("spec.allNodes", True)), OK),
    # devices and counter sets: one or the other (a present key counts, even empty)
    ("devices and sharedCounters", device_slice, _set("spec.sharedCounters", counter_slice()["spec"]["sharedCounters"]), {"spec"}),
    ("empty devices next to sharedCounters", counter_slice, _set("spec.devices", []), {"spec"}),
    ("null devices next to sharedCounters", counter_slice, _set("spec.devices", None), OK),
    # device count: 128, or 64 when a device consumes counters or has taints
    ("128 devices", device_slice, _devices(128), OK),
    ("129 devices", device_slice, _devices(129), {"spec.devices"}),
    ("64 devices, one consuming counters", device_slice, _devices(64, consume=True), OK),
    ("65 devices, one consuming counters", device_slice, _devices(65, consume=True), {"spec.devices"}),
    (
        "65 devices, one with a taint",
        device_slice,
        _all(_devices(65), _set("spec.devices.0.taints", [{"key": "gpu.bcd.dev/unhealthy", "effect": "NoSchedule"}])),
        {"spec.devices"},
    ),
    # device names: DNS labels, unique in the slice
    ("device name not a DNS label", device_slice, _set("spec.devices.0.name", "gpu.0"), {f"{D0}.name"}),
    ("device name longer than 63", device_slice, _set("spec.devices.0.name", "g" * 64), {f"{D0}.name"}),
    ("device name empty", device_slice, _set("spec.devices.0.name", ""), {f"{D0}.name"}),
    ("device names not unique", device_slice, _set("spec.devices.1.name", "gpu-0"), {"spec.devices[1]"}),
    # attribute and capacity names: a C identifier (<= 32) with an optional driver-name domain
    ("attribute domain not a DNS subdomain", device_slice, _set("spec.devices.0.attributes", {"GPU_bcd/uuid": {"string": "x"}}), {f"{D0}.attributes[GPU_bcd/uuid]"}),
    ("attribute domain empty", device_slice, _set("spec.devices.0.attributes", {"/uuid": {"string": "x"}}), {f"{D0}.attributes[/uuid]"}),
    ("attribute identifier not a C identifier", device_slice, _set("spec.devices.0.attributes", {"gpu.bcd.dev/mig-profile": {"string": "x"}}), {f"{D0}.attributes[gpu.bcd.dev/mig-profile]"}),
    ("attribute identifier longer than 32", device_slice, _set("spec.devices.0.attributes", {"gpu.bcd.dev/" + "a" * 33: {"int": 1}}), {f"{D0}.attributes[gpu.bcd.dev/{'a' * 33}]"}),
    ("attribute identifier of 32", device_slice, _set("spec.devices.0.attributes", {"gpu.bcd.dev/" + "a" * 32: {"int": 1}}), OK),
    ("attribute name with two slashes: refused from 1.37", device_slice, _set("spec.devices.0.attributes", {"a/b/c": {"int": 1}}), {f"{D0}.attributes[a/b/c]"}),
    # list-type attributes (1.36+, DRAListTypeAttributes): one kind of value, lists non-empty, 48 values a device
    ("string list attribute", device_slice, _set("spec.devices.0.attributes.links", {"strings": ["nvlink-0", "nvlink-1"]}), OK),
    ("empty list attribute", device_slice, _set("spec.devices.0.attributes.links", {"ints": []}), {f"{D0}.attributes[links].ints"}),
    ("list and scalar in one attribute", device_slice, _set("spec.devices.0.attributes.links", {"ints": [1], "int": 1}), {f"{D0}.attributes[links]"}),
    ("version list item not semver", device_slice, _set("spec.devices.0.attributes.links", {"versions": ["1.2.3", "1.2"]}), {f"{D0}.attributes[links].versions[1]"}),
    ("string list item of 65", device_slice, _set("spec.devices.0.attributes.links", {"strings": ["x" * 65]}), {f"{D0}.attributes[links].strings[0]"}),
    ("48 attribute values", device_slice, _set("spec.devices.0.attributes", {"links": {"ints": list(range(48))}}), OK),
    ("49 attribute values", device_slice, _set("spec.devices.0.attributes", {"links": {"ints": list(range(49))}}), {D0}),
    ("65 devices, one with a list attribute", device_slice, _all(_devices(65), _set("spec.devices.0.attributes", {"l": {"bools": [True]}})), {"spec.devices"}),
    # partitionTypeAttribute (1.37): devices consuming counters carry it as a string
    ("partitionTypeAttribute on the devices", device_slice, _all(_set("spec.partitionTypeAttribute", "gpu.bcd.dev/profile"), _set("spec.devices.0.attributes[gpu.bcd.dev/profile]", {"string": "whole"})), OK),
    ("partitionTypeAttribute bare on the device", device_slice, _all(_set("spec.partitionTypeAttribute", "gpu.bcd.dev/profile"), _set("spec.devices.0.attributes.profile", {"string": "whole"})), OK),
    ("partitionTypeAttribute missing on a device", device_slice, _set("spec.partitionTypeAttribute", "gpu.bcd.dev/profile"), {f"{D0}.attributes[gpu.bcd.dev/profile]"}),
    ("partitionTypeAttribute not a string", device_slice, _all(_set("spec.partitionTypeAttribute", "gpu.bcd.dev/mig"), _set("spec.devices.1.attributes[gpu.bcd.dev/mig]", {"string": "1g"})), {f"{D0}.attributes[gpu.bcd.dev/mig]"}),
    ("partitionTypeAttribute without a domain", device_slice, _set("spec.partitionTypeAttribute", "index"), {"spec.partitionTypeAttribute"}),
    ("partitionTypeAttribute without consumers", counter_slice, _set("spec.partitionTypeAttribute", "gpu.bcd.dev/profile"), {"spec.partitionTypeAttribute"}),
    # skipNodeOperations (1.37): known values, Prepare only with Unprepare
    ("skip both node operations", device_slice, _set("spec.skipNodeOperations", ["NodePrepareResources", "NodeUnprepareResources"]), OK),
    ("skip every node operation", device_slice, _set("spec.skipNodeOperations", ["*"]), OK),
    ("skip prepare alone", device_slice, _set("spec.skipNodeOperations", ["NodePrepareResources"]), {"spec.skipNodeOperations"}),
    ("skip an unknown operation", device_slice, _set("spec.skipNodeOperations", ["NodeReboot"]), {"spec.skipNodeOperations[0]"}),
    ("capacity name not a C identifier", device_slice, _set("spec.devices.0.capacity", {"gpu.bcd.dev/memory-gib": {"value": "141"}}), {f"{D0}.capacity[gpu.bcd.dev/memory-gib]"}),
    # attribute values: exactly one of int/bool/string/version; strings and versions <= 64
    ("attribute with two values", device_slice, _set(f"spec.devices.0.attributes[{ATTR}]", {"string": "x", "int": 1}), {f"{D0}.attributes[{ATTR}]"}),
    ("attribute with no value", device_slice, _set(f"spec.devices.0.attributes[{ATTR}]", {}), {f"{D0}.attributes[{ATTR}]"}),
    ("string attribute of 65", device_slice, _set(f"spec.devices.0.attributes[{ATTR}]", {"string": "x" * 65}), {f"{D0}.attributes[{ATTR}].string"}),
    ("string attribute of 64", device_slice, _set(f"spec.devices.0.attributes[{ATTR}]", {"string": "x" * 64}), OK),
    ("version attribute not semver", device_slice, _set("spec.devices.0.attributes.driverVersion", {"version": "570.86"}), {f"{D0}.attributes[driverVersion].version"}),
    ("int attribute as a string", device_slice, _set("spec.devices.0.attributes.index", {"int": "0"}), 400),
    # at most 32 attributes and capacities per device
    ("32 attributes and capacities", device_slice, _all(_set("spec.devices.0.attributes", _attrs(31))), OK),
    ("33 attributes and capacities", device_slice, _all(_set("spec.devices.0.attributes", _attrs(32))), {D0}),
    # counter sets: <= 8 per slice, names and counter names DNS labels, <= 32 counters, values quantities
    ("8 counter sets", counter_slice, _set("spec.sharedCounters", [{"name": f"gpu-{i}", "counters": _counters(1)} for i in range(8)]), OK),
    ("9 counter sets", counter_slice, _set("spec.sharedCounters", [{"name": f"gpu-{i}", "counters": _counters(1)} for i in range(9)]), {"spec.sharedCounters"}),
    ("counter set name not a DNS label", counter_slice, _set("spec.sharedCounters.0.name", "GPU-0"), {"spec.sharedCounters[0].name"}),
    ("counter set name empty", counter_slice, _set("spec.sharedCounters.0.name", ""), {"spec.sharedCounters[0].name"}),
    ("counter sets not unique", counter_slice, _set("spec.sharedCounters", [{"name": "gpu-0", "counters": _counters(1)}] * 2), {"spec.sharedCounters[1]"}),
    ("counter set without counters", counter_slice, _set("spec.sharedCounters.0.counters", {}), {"spec.sharedCounters[0].counters"}),
    ("32 counters in a set", counter_slice, _set("spec.sharedCounters.0.counters", _counters(32)), OK),
    ("33 counters in a set", counter_slice, _set("spec.sharedCounters.0.counters", _counters(33)), {"spec.sharedCounters[0].counters"}),
    ("counter name not a DNS label", counter_slice, _set("spec.sharedCounters.0.counters", {"memorySlices": {"value": "8"}}), {"spec.sharedCounters[0].counters[memorySlices]"}),
    ("counter value not a quantity", counter_slice, _set("spec.sharedCounters.0.counters", {"memory": {"value": "8 GiB"}}), 400),
    ("counter value a number", counter_slice, _set("spec.sharedCounters.0.counters", {"memory": {"value": 8}}), OK),
    # consumesCounters: <= 2 per device, unique sets, <= 32 counters each, the same name rules
    (
        "device consuming 3 counter sets",
        device_slice,
        _set("spec.devices.0.consumesCounters", [{"counterSet": f"gpu-{i}", "counters": _counters(1)} for i in range(3)]),
        {f"{D0}.consumesCounters"},
    ),
    (
        "device consuming one set twice",
        device_slice,
        _set("spec.devices.0.consumesCounters", [{"counterSet": "gpu-0", "counters": _counters(1)}] * 2),
        {f"{D0}.consumesCounters[1]"},
    ),
    ("device consuming 33 counters", device_slice, _set("spec.devices.0.consumesCounters.0.counters", _counters(33)), {f"{D0}.consumesCounters[0].counters"}),
    ("consumed counter set name not a DNS label", device_slice, _set("spec.devices.0.consumesCounters.0.counterSet", "gpu_0"), {f"{D0}.consumesCounters[0].counterSet"}),
    ("consumption without counters", device_slice, _set("spec.devices.0.consumesCounters.0.counters", {}), {f"{D0}.consumesCounters[0].counters"}),
    # binding conditions: <= 4 each, label names, both or neither, no overlap (bindsToNode not required upstream)
    ("binding conditions with bindsToNode", device_slice, _all(_binding(["ready"], ["failed"]), _set("spec.devices.0.bindsToNode", True)), OK),
    ("binding conditions without bindsToNode", device_slice, _binding(["ready"], ["failed"]), OK),
    ("5 binding conditions", device_slice, _binding([f"c{i}" for i in range(5)], ["failed"]), {f"{D0}.bindingConditions"}),
    ("5 binding failure conditions", device_slice, _binding(["ready"], [f"f{i}" for i in range(5)]), {f"{D0}.bindingFailureConditions"}),
    ("binding conditions alone", device_slice, _set("spec.devices.0.bindingConditions", ["ready"]), {f"{D0}.bindingFailureConditions"}),
    ("binding conditions overlapping", device_slice, _binding(["ready"], ["ready"]), {f"{D0}.bindingFailureConditions[0]"}),
    ("binding condition not a label name", device_slice, _binding(["not ready"], ["failed"]), {f"{D0}.bindingConditions[0]"}),
    # per-device node selection only with spec.perDeviceNodeSelection
    ("device nodeName without perDeviceNodeSelection", device_slice, _set("spec.devices.0.nodeName", NODE), {D0}),
    (
        "perDeviceNodeSelection, every device its node",
        device_slice,
        _all(_delete("spec.nodeName"), _set("spec.perDeviceNodeSelection", True), _set("spec.devices.0.nodeName", NODE), _set("spec.devices.1.allNodes", True)),
        OK,
    ),
    ("perDeviceNodeSelection, a device without", device_slice, _all(_delete("spec.nodeName"), _set("spec.perDeviceNodeSelection", True), _set("spec.devices.0.nodeName", NODE)), {"spec.devices[1]"}),
    # taints: <= 16, known effects
    ("17 taints", device_slice, _set("spec.devices.0.taints", [{"key": f"t{i}", "effect": "NoSchedule"} for i in range(17)]), {f"{D0}.taints"}),
    ("taint effect unknown", device_slice, _set("spec.devices.0.taints", [{"key": "t", "effect": "PreferNoSchedule"}]), {f"{D0}.taints[0].effect"}),
    # taints (issue 30): key a label name, value a label value, effect required, timeAdded a metav1.Time
    ("16 taints", device_slice, _set("spec.devices.0.taints", [{"key": f"t{i}", "effect": "NoSchedule"} for i in range(16)]), OK),
    ("a taint as the plugin writes one", device_slice, _set("spec.devices.0.taints", [TAINT]), OK),
    ("taint effect None", device_slice, _set("spec.devices.0.taints", [{**TAINT, "effect": "None"}]), OK),
    ("taint without a value", device_slice, _set("spec.devices.0.taints", [{"key": "gpu.bcd.dev/gpu-lost", "effect": "NoExecute"}]), OK),
    ("taint effect missing", device_slice, _set("spec.devices.0.taints", [{"key": "gpu.bcd.dev/xid", "value": "79"}]), {f"{D0}.taints[0].effect"}),
    ("taint key missing", device_slice, _set("spec.devices.0.taints", [{"value": "79", "effect": "NoExecute"}]), {f"{D0}.taints[0].key"}),
    ("taint key not a label name", device_slice, _set("spec.devices.0.taints", [{**TAINT, "key": "gpu.bcd.dev/xid error"}]), {f"{D0}.taints[0].key"}),
    ("taint key domain not a DNS subdomain", device_slice, _set("spec.devices.0.taints", [{**TAINT, "key": "GPU_bcd/xid"}]), {f"{D0}.taints[0].key"}),
    ("taint key name longer than 63", device_slice, _set("spec.devices.0.taints", [{**TAINT, "key": "gpu.bcd.dev/" + "x" * 64}]), {f"{D0}.taints[0].key"}),
    ("taint value of 63", device_slice, _set("spec.devices.0.taints", [{**TAINT, "value": "v" * 63}]), OK),
    ("taint value of 64", device_slice, _set("spec.devices.0.taints", [{**TAINT, "value": "v" * 64}]), {f"{D0}.taints[0].value"}),
    ("taint value not a label value", device_slice, _set("spec.devices.0.taints", [{**TAINT, "value": "XID 79"}]), {f"{D0}.taints[0].value"}),
    ("taint value starting with a dash", device_slice, _set("spec.devices.0.taints", [{**TAINT, "value": "-1"}]), {f"{D0}.taints[0].value"}),
    ("taint timeAdded with an offset and a fraction", device_slice, _set("spec.devices.0.taints", [{**TAINT, "timeAdded": "2026-12-03T11:00:00.25+01:00"}]), OK),
    ("taint timeAdded not RFC 3339", device_slice, _set("spec.devices.0.taints", [{**TAINT, "timeAdded": "2026-12-03 10:00:00"}]), 400),
    ("taint timeAdded without a zone", device_slice, _set("spec.devices.0.taints", [{**TAINT, "timeAdded": "2026-12-03T10:00:00"}]), 400),
    ("taint timeAdded a number", device_slice, _set("spec.devices.0.taints", [{**TAINT, "timeAdded": 1796292000}]), 400),
    ("two taints, the second bad", device_slice, _set("spec.devices.0.taints", [TAINT, {**TAINT, "effect": "Evict"}]), {f"{D0}.taints[1].effect"}),
    # consumable capacity: a request policy only on a device that allows multiple allocations
    ("requestPolicy without allowMultipleAllocations", device_slice, _set(f"spec.devices.0.capacity[{MEMORY}].requestPolicy", POLICY), {f"{D0}.capacity[{MEMORY}].requestPolicy"}),
    ("requestPolicy with allowMultipleAllocations", device_slice, _all(_set(f"spec.devices.0.capacity[{MEMORY}].requestPolicy", POLICY), _set("spec.devices.0.allowMultipleAllocations", True)), OK),
    # object meta
    ("name not a DNS subdomain", device_slice, _set("metadata.name", "Node-1"), {"metadata.name"}),
    ("two controller owners", device_slice, _set("metadata.ownerReferences", device_slice()["metadata"]["ownerReferences"] * 2), {"metadata.ownerReferences"}),
    # objectmeta.go ValidateOwnerReferences hands validateOwnerReference the list's path, not an index
    ("owner reference without uid", device_slice, _set("metadata.ownerReferences.0.uid", ""), {"metadata.ownerReferences.uid"}),
    ("namespace on a cluster-scoped slice", device_slice, _set("metadata.namespace", "ml"), {"metadata.namespace"}),
    ("finalizer not a qualified name", device_slice, _set("metadata.finalizers", ["gpu.bcd.dev/a b"]), {"metadata.finalizers"}),
    ("annotations over 256 KiB", device_slice, _set("metadata.annotations", {"a": "x" * (256 * 1024)}), {"metadata.annotations"}),
    # corevalidation.ValidateNodeSelector(sel, false, ...)
    ("nodeSelector value not a label value", device_slice, _all(_delete("spec.nodeName"), _set("spec.nodeSelector", {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu.bcd.dev/model", "operator": "In", "values": ["A100 80GB"]}]}]})), {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].values[0]"}),
    ("nodeSelector operator unknown", device_slice, _all(_delete("spec.nodeName"), _set("spec.nodeSelector", {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu.bcd.dev/model", "operator": "Like", "values": ["a"]}]}]})), {"spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].operator"}),
    ("nodeSelector field value not a node name", device_slice, _all(_delete("spec.nodeName"), _set("spec.nodeSelector", {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["Node_1"]}]}]})), {"spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].values[0]"}),
    ("nodeSelector field key not metadata.name", device_slice, _all(_delete("spec.nodeName"), _set("spec.nodeSelector", {"nodeSelectorTerms": [
        {"matchFields": [{"key": "spec.podCIDR", "operator": "In", "values": ["x"]}]}]})), {"spec.nodeSelector.nodeSelectorTerms[0].matchFields[0].key"}),
    ("nodeSelector field a node name", device_slice, _all(_delete("spec.nodeName"), _set("spec.nodeSelector", {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]})), OK),
    ("generation as a string", device_slice, _set("spec.pool.generation", "1"), 400),
    ("resourceVersion on create", device_slice, _set("metadata.resourceVersion", "7"), 400),
]



@pytest.mark.parametrize(("base", "mutate", "expected"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
async def test_resource_slice_validation(api: ClusterApi, base: Callable[[], dict], mutate: Mutation, expected: Any) -> None:
    body = base()
    mutate(body)
    if expected == OK:
        created = await api.create_slice(body)
        assert created["metadata"]["uid"]
        return
    with pytest.raises(KubeApiError) as refused:
        await api.create_slice(body)
    if expected == 400:
        assert (refused.value.status, refused.value.reason) == (400, "BadRequest"), refused.value
    else:
        assert (refused.value.status, refused.value.reason) == (422, "Invalid"), refused.value
        assert set(refused.value.fields) == expected, refused.value


def test_every_rule_row_has_a_distinct_name() -> None:
    names = [r[0] for r in ROWS]
    assert len(names) == len(set(names))


async def test_unknown_fields_are_dropped_with_a_warning(standin: KubeApiStandIn, api: ClusterApi) -> None:
    body = device_slice()
    body["spec"]["devices"][0]["atributes"] = {"typo": {"int": 1}}
    created = await api.create_slice(body)
    assert "atributes" not in created["spec"]["devices"][0]
    assert "atributes" not in standin.slice(body["metadata"]["name"])["spec"]["devices"][0]


async def test_a_stock_1_35_server_drops_counters_silently(tmp_path: Path) -> None:
    """With the 1.35 defaults (DRAPartitionableDevices off) counter sets and consumption vanish without an error."""
    # the dropped part is never validated: nine counter sets (one too many) pass as well
    too_many = counter_slice("node-1-gpu.bcd.dev-counters-9")
    too_many["spec"]["sharedCounters"] = [{"name": f"gpu-{i}", "counters": _counters(1)} for i in range(9)]
    with KubeApiStandIn(gates=GATES_1_35_DEFAULT) as server:
        client = ClusterApi(server.write_kubeconfig(tmp_path / "kubeconfig"), timeout=5)
        try:
            devices = await client.create_slice(device_slice())
            counters = await client.create_slice(counter_slice())
            nine = await client.create_slice(too_many)
        finally:
            await client.close()
    assert [sorted(d) for d in devices["spec"]["devices"]] == [["attributes", "capacity", "name"], ["attributes", "name"]]
    assert "sharedCounters" not in counters["spec"] and "sharedCounters" not in nine["spec"]


def tainted_slice(taints: list[dict] | None = None) -> dict:
    body = device_slice()
    body["spec"]["devices"][0]["taints"] = copy.deepcopy(taints if taints is not None else [TAINT])
    return body


async def test_taints_are_kept_and_their_time_reads_back_in_utc_seconds(standin: KubeApiStandIn, api: ClusterApi) -> None:
    """DRADeviceTaints on: a device's taints are stored as sent, but for timeAdded, which metav1.Time
    gives back in UTC with whole seconds (what a client compares must be written that way)."""
    sent = [{**TAINT, "timeAdded": "2026-12-03T11:00:00.75+01:00"}, {"key": "gpu.bcd.dev/ecc", "value": "EccCorrectable", "effect": "NoSchedule"}]
    created = await api.create_slice(tainted_slice(sent))
    assert created["spec"]["devices"][0]["taints"] == [TAINT, sent[1]]
    assert standin.slice("node-1-gpu.bcd.dev-devices")["spec"]["devices"][0]["taints"] == [TAINT, sent[1]]
    assert "taints" not in created["spec"]["devices"][1]
    # the same taints again change nothing (no new generation)
    again = await api.replace_slice(created["metadata"]["name"], created)
    assert again["metadata"]["generation"] == 1 and again["spec"]["devices"][0]["taints"] == [TAINT, sent[1]]
    # taints gone: a new generation
    del again["spec"]["devices"][0]["taints"]
    cleared = await api.replace_slice(again["metadata"]["name"], again)
    assert cleared["metadata"]["generation"] == 2 and "taints" not in cleared["spec"]["devices"][0]


async def test_a_stock_1_35_server_drops_taints_silently(tmp_path: Path) -> None:
    """DRADeviceTaints off (the 1.35 default): taints vanish without an error, and the dropped part
    is never validated (17 taints with an unknown effect pass as well)."""
    bad = [{"key": f"t{i}", "effect": "Evict"} for i in range(17)]
    with KubeApiStandIn(gates=GATES_1_35_DEFAULT) as server:
        client = ClusterApi(server.write_kubeconfig(tmp_path / "kubeconfig"), timeout=5)
        try:
            created = await client.create_slice(tainted_slice())
            other = tainted_slice(bad)
            other["metadata"]["name"] = "node-1-gpu.bcd.dev-devices-2"
            seventeen = await client.create_slice(other)
            # a replace that adds taints to a slice without any: dropped too
            body = copy.deepcopy(created)
            body["spec"]["devices"][1]["taints"] = [TAINT]
            replaced = await client.replace_slice(body["metadata"]["name"], body)
        finally:
            await client.close()
    for got in (created, seventeen, replaced):
        assert not any("taints" in d for d in got["spec"]["devices"]), got
    assert replaced["metadata"]["generation"] == 1  # nothing kept changed


async def test_taints_a_slice_already_has_are_kept_with_the_gate_turned_off(standin: KubeApiStandIn, api: ClusterApi) -> None:
    """dropDisabledDRADeviceTaintsFields ratchets: an update of a slice that has taints keeps them
    (and may change them) though the gate went off since; one without taints gets none."""
    created = await api.create_slice(tainted_slice())
    plain = await api.create_slice(counter_slice())
    standin.gates["DRADeviceTaints"] = False
    created["spec"]["devices"][0]["taints"] = [{**TAINT, "value": "48"}]
    kept = await api.replace_slice(created["metadata"]["name"], created)
    assert kept["spec"]["devices"][0]["taints"] == [{**TAINT, "value": "48"}]
    fresh = device_slice("node-1-gpu.bcd.dev-devices-2")
    fresh["spec"]["devices"][0]["taints"] = [TAINT]
    assert "taints" not in (await api.create_slice(fresh))["spec"]["devices"][0]
    assert "sharedCounters" in plain["spec"]


# --- the scheduler's view of a pool ------------------------------------------------------------------


async def test_check_pool(standin: KubeApiStandIn, api: ClusterApi) -> None:
    where = f"pool {DRIVER}/{NODE} generation 1"
    await api.create_slice(device_slice())
    assert standin.check_pool(DRIVER, NODE) == [  # the counter slice is not there yet
        f"{where}: incomplete, 1 of 2 ResourceSlices",
        f"{where}: device gpu-0 (slice node-1-gpu.bcd.dev-devices) consumes counter set gpu-0, which no slice of the pool defines",
        f"{where}: device gpu-0-mig-1g-18gb-0 (slice node-1-gpu.bcd.dev-devices) consumes counter set gpu-0, which no slice of the pool defines",
    ]
    counters = await api.create_slice(counter_slice())
    assert standin.check_pool(DRIVER, NODE) == []
    assert standin.check_pool(DRIVER, "node-9") == [f"pool {DRIVER}/node-9: no ResourceSlices"]

    # a device consuming a set the pool does not have, a counter the set does not have, and too much
    bad = device_slice()
    current = standin.slice("node-1-gpu.bcd.dev-devices")
    bad["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    bad["spec"]["devices"][0]["consumesCounters"] = [
        {"counterSet": "gpu-1", "counters": {"memory-slices": {"value": "1"}}},
        {"counterSet": "gpu-0", "counters": {"memory-slices": {"value": "9"}, "encoders": {"value": "1"}}},
    ]
    await api.replace_slice(bad["metadata"]["name"], bad)
    assert standin.check_pool(DRIVER, NODE) == [
        f"{where}: device gpu-0 (slice node-1-gpu.bcd.dev-devices) consumes counter set gpu-1, which no slice of the pool defines",
        f"{where}: device gpu-0 (slice node-1-gpu.bcd.dev-devices) consumes counter encoders, which counter set gpu-0 does not have",
        f"{where}: device gpu-0 (slice node-1-gpu.bcd.dev-devices) consumes 9 of gpu-0/memory-slices, more than the set's 8",
    ]

    # the devices move to generation 2 without the counters: the counter slice is out of date
    moved = device_slice()
    moved["spec"]["pool"]["generation"] = 2
    moved["spec"]["pool"]["resourceSliceCount"] = 1
    del moved["metadata"]["ownerReferences"]
    await api.replace_slice(moved["metadata"]["name"], moved)
    gen2 = f"pool {DRIVER}/{NODE} generation 2"
    assert standin.check_pool(DRIVER, NODE) == [
        f"{gen2}: device gpu-0 (slice node-1-gpu.bcd.dev-devices) consumes counter set gpu-0, which no slice of the pool defines",
        f"{gen2}: device gpu-0-mig-1g-18gb-0 (slice node-1-gpu.bcd.dev-devices) consumes counter set gpu-0, which no slice of the pool defines",
    ]

    # two slices of one generation naming the same device and the same counter set
    counters["spec"]["pool"]["generation"] = 2
    counters["spec"]["pool"]["resourceSliceCount"] = 3
    await api.replace_slice(counters["metadata"]["name"], counters)
    again = counter_slice("node-1-gpu.bcd.dev-counters-2")
    again["spec"]["pool"] = {"name": NODE, "generation": 2, "resourceSliceCount": 3}
    await api.create_slice(again)
    twin = device_slice("node-1-gpu.bcd.dev-devices-2")
    twin["spec"]["pool"] = {"name": NODE, "generation": 2, "resourceSliceCount": 3}
    twin["spec"]["devices"] = twin["spec"]["devices"][:1]
    await api.create_slice(twin)
    problems = standin.check_pool(DRIVER, NODE)
    assert f"{gen2}: slices disagree on resourceSliceCount (1, 3)" in problems
    assert f"{gen2}: duplicate device name gpu-0 (slices node-1-gpu.bcd.dev-devices and node-1-gpu.bcd.dev-devices-2)" in problems
    assert f"{gen2}: counter set gpu-0 defined twice (slices node-1-gpu.bcd.dev-counters and node-1-gpu.bcd.dev-counters-2)" in problems


def test_quantities() -> None:
    assert parse_quantity("141Gi") == 141 * 2**30
    assert parse_quantity("1.5k") == 1500
    assert parse_quantity("100m") * 10 == 1
    assert parse_quantity(8) == 8
    assert parse_quantity("1e3") == 1000
    for bad in ("8 GiB", "Gi", "", "1.2.3", True, "1Gb"):
        with pytest.raises(ValueError):
            parse_quantity(bad)


async def test_requests_are_logged_with_the_token(standin: KubeApiStandIn, api: ClusterApi) -> None:
    standin.add_node(NODE)
    await api.node_uid(NODE)
    await asyncio.sleep(0)
    (request,) = standin.requests
    assert (request.method, request.path, request.status) == ("GET", f"/api/v1/nodes/{NODE}", 200)
    assert request.authorization == "Bearer dra-test-token"


# --- ResourceClaim status updates (validate_claim_status_update) ---------------------------------
_SPEC = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.bcd.dev"}}]}}
_RESULT = {"request": "gpu", "driver": "gpu.bcd.dev", "pool": "node-1", "device": "gpu-0"}
_ALLOC = {"devices": {"results": [_RESULT]}}
_REF = {"resource": "pods", "name": "p", "uid": "u-1"}
_DEV = {"driver": "gpu.bcd.dev", "pool": "node-1", "device": "gpu-0"}
#: (id, new status, old status, claim being deleted, expected field paths)
STATUS_ROWS = [
    ("allocate and reserve", {"allocation": _ALLOC, "reservedFor": [_REF]}, {}, False, set()),
    ("reserve without an allocation", {"reservedFor": [_REF]}, {}, False, {"status.reservedFor"}),
    ("reservedFor without uid", {"allocation": _ALLOC, "reservedFor": [{"resource": "pods", "name": "p"}]}, {}, False, {"status.reservedFor[0].uid"}),
    ("reservedFor twice", {"allocation": _ALLOC, "reservedFor": [_REF, _REF]}, {}, False, {"status.reservedFor[1]"}),
    ("new reservation while deleted", {"allocation": _ALLOC, "reservedFor": [_REF]}, {"allocation": _ALLOC}, True, {"status.reservedFor"}),
    ("reservation kept while deleted", {"allocation": _ALLOC, "reservedFor": [_REF]}, {"allocation": _ALLOC, "reservedFor": [_REF]}, True, set()),
    ("allocation changed", {"allocation": {"devices": {"results": [{**_RESULT, "device": "gpu-1"}]}}}, {"allocation": _ALLOC}, False, {"status.allocation"}),
    ("allocation removed", {}, {"allocation": _ALLOC}, False, set()),
    ("new allocation for an unknown request", {"allocation": {"devices": {"results": [{**_RESULT, "request": "nic"}]}}}, {}, False, {"status.allocation.devices.results[0].request"}),
    ("new allocation with a bad device name", {"allocation": {"devices": {"results": [{**_RESULT, "device": "GPU_0"}]}}}, {}, False, {"status.allocation.devices.results[0].device"}),
    ("device status of an allocated device", {"allocation": _ALLOC, "devices": [_DEV]}, {"allocation": _ALLOC}, False, set()),
    ("device status of another device", {"allocation": _ALLOC, "devices": [{**_DEV, "device": "gpu-1"}]}, {"allocation": _ALLOC}, False, {"status.devices[0]"}),
    ("device status twice", {"allocation": _ALLOC, "devices": [_DEV, _DEV]}, {"allocation": _ALLOC}, False, {"status.devices[1]"}),
    # dropDeallocatedStatusDevices: deallocating drops the device's status entry before validation
    ("deallocation drops the device status", {"devices": [_DEV]}, {"allocation": _ALLOC, "devices": [_DEV]}, False, set()),
]


@pytest.mark.parametrize(("new", "old", "deleted", "expected"), [r[1:] for r in STATUS_ROWS], ids=[r[0] for r in STATUS_ROWS])
def test_resource_claim_status_update_rules(new: dict, old: dict, deleted: bool, expected: set[str]) -> None:
    status = copy.deepcopy(new)
    errors = validate_claim_status_update(status, old, _SPEC, deleted, GATES_ENABLED)
    assert {e.field for e in errors} == expected, errors
