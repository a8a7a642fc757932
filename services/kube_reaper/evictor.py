"""The `Evictor` port: the Kubernetes Eviction API, and a backend that evicts nothing.

`KubernetesEvictor` POSTs a policy/v1 Eviction to
`/api/v1/namespaces/{ns}/pods/{name}/eviction` through kubernetes_asyncio,
with credentials from `--kubeconfig` (or the default kubeconfig) or, in a pod,
the service account. One call is one attempt; the service retries:
`next_delay` says how long to wait (429: the server's Retry-After, capped;
5xx and transport errors: exponential backoff, capped). 404 means the pod is
already gone. kubernetes_asyncio is imported on first use, so a node with
`--evictor none` never loads it.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from shared.kubeclient import KubeCredentialsError, LazyCoreApi

from .ports import EvictionResult

#: first retry after a 5xx or a transport error; doubles per attempt up to BACKOFF_MAX_S.
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
#: the most a Retry-After is honoured for (a PodDisruptionBudget may block for long).
RETRY_AFTER_MAX_S = 60.0
#: one API request's deadline.
REQUEST_TIMEOUT_S = 10.0

#: every request `KubernetesEvictor` makes, as RBAC sees it: generated method -> (apiGroup,
#: resource, verb). deploy/kubernetes/rbac.yaml (ClusterRole bcd-kube-reaper) grants exactly these;
#: tests/unit/test_kubernetes_manifests.py holds them equal to each other and to the code.
API_REQUESTS: dict[str, tuple[str, str, str]] = {
    "create_namespaced_pod_eviction": ("", "pods/eviction", "create"),
}


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date; None when absent or odd."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - (now or datetime.now(timezone.utc))).total_seconds())


def next_delay(result: EvictionResult, attempt: int) -> float:
    """Seconds to wait before attempt `attempt + 1` after `result` (attempt counts from 0)."""
    if result.outcome == "throttled" and result.retry_after is not None:
        return min(max(result.retry_after, 0.0), RETRY_AFTER_MAX_S)
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * (2 ** min(attempt, 16)))


def status_body(data: Any) -> dict:
    """The JSON object of a 2xx answer's body ({} when it is none): what the API server said."""
    if isinstance(data, (bytes, bytearray)):
        data = bytes(data).decode("utf-8", "replace")
    if not isinstance(data, str) or len(data) > 1024 * 1024:
        return {}
    try:
        value = json.loads(data)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def result_of_created(answer: dict) -> EvictionResult:
    """A 201 is not always an eviction: the API server answers 201 with a Status whose `status` is
    Failure for what it will not evict (pkg/registry/core/pod/storage/eviction.go: a pod with more than
    one PodDisruptionBudget, code 500). client-go makes that an error; kubernetes_asyncio returns it."""
    if answer.get("kind") != "Status" or answer.get("status") in (None, "Success"):
        return EvictionResult("evicted")
    code = answer.get("code") if isinstance(answer.get("code"), int) else 0
    reason = f"HTTP 201 with a Failure Status (code {code} {answer.get('reason', '')}): {str(answer.get('message', ''))[:512]}".strip()
    if code == 429:
        return EvictionResult("throttled", reason)
    if code == 404:
        return EvictionResult("gone", reason)
    if code >= 500 or code == 0:
        return EvictionResult("server_error", reason)
    return EvictionResult("error", reason)


class EvictorUnavailable(Exception):
    """No Kubernetes credentials could be loaded; the text says why."""


class NoEvictor:
    """`--evictor none`: nodes without Kubernetes. Never evicts; says so."""

    enabled = False

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    async def evict(self, namespace: str, pod: str) -> EvictionResult:
        self.requests.append((namespace, pod))
        return EvictionResult("error", "no evictor configured (--evictor none)")

    async def close(self) -> None:
        return None


class KubernetesEvictor:
    """Evictions through the API server (kubernetes_asyncio)."""

    enabled = True

    def __init__(self, kubeconfig: Path | None = None, in_cluster: str = "auto", timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.api = LazyCoreApi(kubeconfig, in_cluster)
        self.timeout = timeout

    @property
    def source(self) -> str:
        """Where the credentials came from, once loaded (for logs)."""
        return self.api.source

    async def connect(self) -> str:
        """Load credentials (once); raises EvictorUnavailable with the reason."""
        try:
            await self.api.connect()
        except KubeCredentialsError as exc:
            raise EvictorUnavailable(str(exc)) from None
        return self.api.source

    async def evict(self, namespace: str, pod: str) -> EvictionResult:
        try:
            await self.connect()
        except EvictorUnavailable as exc:
            return EvictionResult("unavailable", str(exc))
        import aiohttp
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        body = client.V1Eviction(
            api_version="policy/v1",
            kind="Eviction",
            metadata=client.V1ObjectMeta(name=pod, namespace=namespace),
        )
        try:
            await self.api.core.create_namespaced_pod_eviction(pod, namespace, body, _request_timeout=self.timeout)
            # read before any await: the client keeps only its last response
            answer = status_body(getattr(getattr(self.api.api_client, "last_response", None), "data", None))
        except ApiException as exc:
            status = int(exc.status or 0)
            reason = f"HTTP {status} {exc.reason or ''}".strip()
            if status == 404:
                return EvictionResult("gone", reason)
            if status == 429:
                headers = exc.headers or {}
                return EvictionResult("throttled", reason, retry_after=parse_retry_after(headers.get("Retry-After")))
            if status >= 500:
                return EvictionResult("server_error", reason)
            return EvictionResult("error", reason)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return EvictionResult("unavailable", f"{type(exc).__name__}: {exc}")
        return result_of_created(answer)

    async def close(self) -> None:
        await self.api.close()


__all__ = [
    "API_REQUESTS",
    "BACKOFF_BASE_S",
    "BACKOFF_MAX_S",
    "RETRY_AFTER_MAX_S",
    "parse_retry_after",
    "result_of_created",
    "status_body",
    "next_delay",
    "EvictorUnavailable",
    "NoEvictor",
    "KubernetesEvictor",
]
