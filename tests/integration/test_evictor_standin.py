"""kube_reaper's KubernetesEvictor against the API server stand-in's Eviction API (kubeapi_nodes_pods.py):
what each answer is taken for. A 201 carrying a Failure Status (a pod under two PodDisruptionBudgets)
used to count as evicted while the pod stayed."""

from __future__ import annotations

import pytest

from services.kube_reaper.evictor import KubernetesEvictor, result_of_created

from .kubeapi_standin import KubeApiStandIn

pytestmark = pytest.mark.integration

NODE = "node-1"


@pytest.fixture
def standin():
    server = KubeApiStandIn().start()
    try:
        server.add_node(NODE)
        yield server
    finally:
        server.stop()


async def test_each_eviction_answer_is_what_the_api_server_meant(standin: KubeApiStandIn, tmp_path) -> None:
    evictor = KubernetesEvictor(standin.write_kubeconfig(tmp_path / "kubeconfig"), "false")
    try:
        standin.add_pod("ml", "free", NODE, labels={"app": "free"})
        assert (await evictor.evict("ml", "free")).outcome == "evicted"
        assert standin.pod("ml", "free") is None or standin.pod("ml", "free")["metadata"].get("deletionTimestamp")

        standin.add_pod("ml", "guarded", NODE, labels={"app": "guarded"})
        standin.add_pdb("ml", "guarded", {"app": "guarded"}, min_available=1)
        blocked = await evictor.evict("ml", "guarded")
        assert blocked.outcome == "throttled" and blocked.retry_after is None, blocked

        standin.add_pod("ml", "twice", NODE, labels={"app": "twice", "tier": "gpu"})
        standin.add_pdb("ml", "by-app", {"app": "twice"}, min_available=0)
        standin.add_pdb("ml", "by-tier", {"tier": "gpu"}, min_available=0)
        two = await evictor.evict("ml", "twice")
        assert two.outcome == "server_error" and "more than one PodDisruptionBudget" in two.detail, two
        assert standin.pod("ml", "twice") is not None

        assert (await evictor.evict("ml", "nobody")).outcome == "gone"
    finally:
        await evictor.close()


@pytest.mark.parametrize(
    ("body", "outcome"),
    [
        ({"kind": "Status", "apiVersion": "v1", "status": "Success"}, "evicted"),
        ({}, "evicted"),
        ({"kind": "Status", "status": "Failure", "code": 500, "message": "This pod has more than one PodDisruptionBudget"}, "server_error"),
        ({"kind": "Status", "status": "Failure", "code": 429, "reason": "TooManyRequests"}, "throttled"),
        ({"kind": "Status", "status": "Failure"}, "server_error"),
    ],
)
def test_result_of_created(body: dict, outcome: str) -> None:
    assert result_of_created(body).outcome == outcome
