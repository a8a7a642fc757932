"""The Kubernetes API side of the DRA kubelet plugin: claims, the Node, ResourceSlices.

`KubeApi` is the port the plugin is written against; `ClusterApi` is the real
one, over kubernetes_asyncio (`ResourceV1Api`, `CoreV1Api`) with credentials
from a kubeconfig (`--kubeconfig`, or the default one) or, in a pod, the
service account, loaded as `services.kube_reaper.evictor` loads them.
kubernetes_asyncio and aiohttp are imported on first use, so a node without
DRA never loads them.

Bodies are plain dicts in the API's JSON shape (camelCase, as
`kubectl get -o json` shows them), sent as they are and read back as they
came: every call asks for the raw response (`_preload_content=False`) and
decodes its JSON itself, so nothing goes through the generated models (which
would drop fields they do not know and rename the rest to snake_case).

Every call is bounded by `timeout` (aiohttp's total timeout and an asyncio
deadline around the whole exchange, body included). Failures reach callers
as `KubeApiError` (status 0 for transport errors, timeouts and missing
credentials); `Conflict` (409 on replace: a stale resourceVersion) and
`AlreadyExists` (409 on create) are its subclasses. A 404 is an answer where
the call defines one (`get_claim` -> None, `delete_slice` -> done).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from shared.kubeclient import KubeCredentialsError, load_api_client

from .configs import strict_object_pairs

#: one API request's deadline, connection to last byte.
REQUEST_TIMEOUT_S = 10.0


class KubeApiError(Exception):
    """The API server refused or could not be reached.

    `status` is the HTTP status (0: no answer: transport error, timeout, no
    credentials); `reason` the Status object's reason (`NotFound`, `Invalid`,
    `Conflict`, ...); `causes` the (field, message) pairs of a 422.
    """

    def __init__(self, status: int, message: str, reason: str = "", causes: tuple[tuple[str, str], ...] = ()) -> None:
        head = " ".join(x for x in (f"HTTP {status}" if status else "", reason) if x)
        super().__init__(f"{head}: {message}" if head else message)
        self.status = status
        self.message = message
        self.reason = reason
        self.causes = causes

    @property
    def fields(self) -> tuple[str, ...]:
        """The field paths a 422 names (`spec.devices[0].name`, ...)."""
        return tuple(f for f, _ in self.causes)


class Conflict(KubeApiError):
    """409 on a replace: the object changed since the resourceVersion sent."""


class AlreadyExists(KubeApiError):
    """409 on a create: an object of that name exists."""


@dataclass(frozen=True)
class AllocationResult:
    """One entry of a claim's `status.allocation.devices.results`."""

    request: str
    driver: str
    pool: str
    device: str
    #: the entry as the API server sent it (shareID, consumedCapacity: configs.consumed reads them)
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def admin_access(self) -> bool:
        """`adminAccess: true` (KEP-5018; v1 DeviceRequestAllocationResult.adminAccess, *bool):
        the scheduler allocated the device for administrative access, ignoring other claims."""
        return self.raw.get("adminAccess") is True


@dataclass(frozen=True)
class ClaimConsumer:
    """One entry of a claim's `status.reservedFor` (usually a pod)."""

    resource: str
    name: str
    uid: str


@dataclass(frozen=True)
class ClaimView:
    """What the plugin needs of a ResourceClaim."""

    uid: str
    namespace: str
    name: str
    allocated: bool
    results: tuple[AllocationResult, ...] = ()
    #: the allocation's device configs (`status.allocation.devices.config`: class configs, then
    #: the claim's), as the API server sent them; configs.device_sharing reads them
    configs: tuple[Any, ...] = field(default=(), compare=False, hash=False, repr=False)
    reserved_for: tuple[ClaimConsumer, ...] = ()
    resource_version: str = ""
    #: the object as the API server sent it (allocation config, status.devices, ...).
    raw: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def results_for(self, driver: str) -> tuple[AllocationResult, ...]:
        """The results of one driver (a claim may hold devices of several)."""
        return tuple(r for r in self.results if r.driver == driver)

    @classmethod
    def from_object(cls, obj: dict) -> "ClaimView":
        meta = obj.get("metadata") or {}
        status = obj.get("status") or {}
        allocation = status.get("allocation") or None
        results: list[AllocationResult] = []
        if allocation:
            for r in (allocation.get("devices") or {}).get("results") or ():
                if not isinstance(r, dict):
                    continue
                results.append(
                    AllocationResult(str(r.get("request", "")), str(r.get("driver", "")), str(r.get("pool", "")), str(r.get("device", "")), raw=r)
                )
        consumers = tuple(
            ClaimConsumer(str(c.get("resource", "")), str(c.get("name", "")), str(c.get("uid", "")))
            for c in status.get("reservedFor") or ()
        )
        return cls(
            uid=str(meta.get("uid", "")),
            namespace=str(meta.get("namespace", "")),
            name=str(meta.get("name", "")),
            allocated=bool(allocation),
            results=tuple(results),
            configs=tuple(((allocation or {}).get("devices") or {}).get("config") or ()) if isinstance(allocation, dict) else (),
            reserved_for=consumers,
            resource_version=str(meta.get("resourceVersion", "")),
            raw=obj,
        )


@runtime_checkable
class KubeApi(Protocol):
    """The API calls the DRA plugin makes."""

    async def get_claim(self, namespace: str, name: str) -> ClaimView | None: ...

    async def node_uid(self, name: str) -> str: ...

    async def list_slices(self, driver: str, node_name: str) -> list[dict]: ...

    async def create_slice(self, body: dict) -> dict: ...

    async def replace_slice(self, name: str, body: dict) -> dict: ...

    async def delete_slice(self, name: str) -> None: ...

    async def close(self) -> None: ...


RESOURCE_API_VERSION = "resource.k8s.io/v1"

#: every request `ClusterApi` makes, as RBAC sees it: generated method -> (apiGroup, resource,
#: verb, when). deploy/kubernetes/rbac.yaml grants exactly these ("always" to the ClusterRole
#: bcd-dra-plugin, "binding-conditions" to bcd-dra-plugin-binding-conditions), and
#: tests/unit/test_kubernetes_manifests.py holds the two (and this table and `_call`'s uses) equal.
API_REQUESTS: dict[str, tuple[str, str, str, str]] = {
    "read_namespaced_resource_claim": ("resource.k8s.io", "resourceclaims", "get", "always"),
    "read_node": ("", "nodes", "get", "always"),
    "list_resource_slice": ("resource.k8s.io", "resourceslices", "list", "always"),
    "create_resource_slice": ("resource.k8s.io", "resourceslices", "create", "always"),
    "replace_resource_slice": ("resource.k8s.io", "resourceslices", "update", "always"),
    "delete_resource_slice": ("resource.k8s.io", "resourceslices", "delete", "always"),
    "list_resource_claim_for_all_namespaces": ("resource.k8s.io", "resourceclaims", "list", "binding-conditions"),
    "replace_namespaced_resource_claim_status": ("resource.k8s.io", "resourceclaims/status", "update", "binding-conditions"),
}

#: what writing a claim's status.devices (binding conditions) needs besides, from 1.36
#: (DRAResourceClaimGranularStatusAuthorization): the synthetic resourceclaims/driver permission,
#: for the driver's name, on claims allocated on the caller's own node (its token bound to the Node).
DEVICE_STATUS_PERMISSION = ("resource.k8s.io", "resourceclaims/driver", "associated-node:update")


class ClusterApi:
    """`KubeApi` through the API server (kubernetes_asyncio, raw JSON in and out)."""

    def __init__(self, kubeconfig: Path | str | None = None, in_cluster: str = "auto", timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.kubeconfig = Path(kubeconfig) if kubeconfig else None
        self.in_cluster = in_cluster
        self.timeout = float(timeout)
        self._api_client: Any = None
        self._resource: Any = None
        self._core: Any = None
        self._lock = asyncio.Lock()
        #: where the credentials came from, once loaded (for logs).
        self.source = ""

    async def connect(self) -> str:
        """Load credentials (once); raises KubeApiError (status 0) with the reason."""
        async with self._lock:
            if self._resource is not None:
                return self.source
            from kubernetes_asyncio import client

            try:
                api_client, self.source = await load_api_client(self.kubeconfig, self.in_cluster)
            except KubeCredentialsError as exc:
                raise KubeApiError(0, str(exc)) from None
            self._api_client = api_client
            self._resource = client.ResourceV1Api(api_client)
            self._core = client.CoreV1Api(api_client)
            return self.source

    async def _call(self, what: str, method: str, *args: Any, core: bool = False, **kwargs: Any) -> tuple[int, Any]:
        """One request through ResourceV1Api (CoreV1Api with `core`): (HTTP status, decoded JSON or None).

        Transport trouble and timeouts -> KubeApiError(0)."""
        await self.connect()
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException, OpenApiException

        api = self._core if core else self._resource
        try:
            async with asyncio.timeout(self.timeout):
                resp = await getattr(api, method)(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
                try:
                    raw = await resp.read()
                    status = int(resp.status)
                finally:
                    resp.release()
        except TimeoutError:
            raise KubeApiError(0, f"{what}: no answer within {self.timeout:g}s") from None
        except ApiException as exc:  # raised before sending (a body it cannot encode) or by a future client
            raise KubeApiError(int(exc.status or 0), f"{what}: {exc.reason or exc}") from None
        except OpenApiException as exc:  # a parameter the generated method refuses
            raise KubeApiError(0, f"{what}: {type(exc).__name__}: {exc}") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise KubeApiError(0, f"{what}: {type(exc).__name__}: {exc}") from None
        body: Any = None
        if raw:
            try:
                # duplicate keys stay visible (a claim's opaque parameters are decoded strictly,
                # and a plain loads would keep the last of two equal keys without a word)
                body = json.loads(raw, object_pairs_hook=strict_object_pairs)
            except ValueError:
                body = raw.decode("utf-8", "replace")
        return status, body

    @staticmethod
    def _error(what: str, status: int, body: Any, cls: type[KubeApiError] = KubeApiError) -> KubeApiError:
        if isinstance(body, dict) and body.get("kind") == "Status":
            details = body.get("details") or {}
            causes = tuple((str(c.get("field", "")), str(c.get("message", ""))) for c in details.get("causes") or ())
            return cls(status, f"{what}: {body.get('message', '')}", str(body.get("reason", "")), causes)
        text = body if isinstance(body, str) else json.dumps(body) if body is not None else ""
        return cls(status, f"{what}: {text[:500]}".rstrip(": "))

    @staticmethod
    def _object(what: str, status: int, body: Any) -> dict:
        if not isinstance(body, dict):
            raise KubeApiError(status, f"{what}: the answer is not a JSON object")
        return body

    async def get_claim(self, namespace: str, name: str) -> ClaimView | None:
        what = f"get resourceclaim {namespace}/{name}"
        status, body = await self._call(what, "read_namespaced_resource_claim", name, namespace)
        if status == 404:
            return None
        if not 200 <= status < 300:
            raise self._error(what, status, body)
        return ClaimView.from_object(self._object(what, status, body))

    async def list_claims(self) -> list[ClaimView]:
        """Every ResourceClaim of the cluster (all namespaces); not part of `KubeApi`."""
        what = "list resourceclaims"
        status, body = await self._call(what, "list_resource_claim_for_all_namespaces")
        if not 200 <= status < 300:
            raise self._error(what, status, body)
        return [ClaimView.from_object(item) for item in self._object(what, status, body).get("items") or ()]

    async def replace_claim_status(self, namespace: str, name: str, body: dict) -> dict:
        """PUT .../resourceclaims/{name}/status (a stale resourceVersion -> Conflict); not part of `KubeApi`."""
        what = f"replace resourceclaim {namespace}/{name} status"
        status, answer = await self._call(what, "replace_namespaced_resource_claim_status", name, namespace, body)
        if status == 409:
            raise self._error(what, status, answer, Conflict)
        if not 200 <= status < 300:
            raise self._error(what, status, answer)
        return self._object(what, status, answer)

    async def node_uid(self, name: str) -> str:
        what = f"get node {name}"
        status, body = await self._call(what, "read_node", name, core=True)
        if not 200 <= status < 300:
            raise self._error(what, status, body)
        uid = (self._object(what, status, body).get("metadata") or {}).get("uid")
        if not uid:
            raise KubeApiError(status, f"{what}: the Node has no metadata.uid")
        return str(uid)

    async def list_slices(self, driver: str, node_name: str, *, label_selector: str | None = None) -> list[dict]:
        """The ResourceSlices of one driver on one node (`fieldSelector=spec.driver=..,spec.nodeName=..`)."""
        what = f"list resourceslices of {driver} on {node_name}"
        kwargs: dict[str, Any] = {"field_selector": f"spec.driver={driver},spec.nodeName={node_name}"}
        if label_selector:
            kwargs["label_selector"] = label_selector
        status, body = await self._call(what, "list_resource_slice", **kwargs)
        if not 200 <= status < 300:
            raise self._error(what, status, body)
        items = []
        for item in self._object(what, status, body).get("items") or ():
            # the API server leaves kind and apiVersion out of list items; put them back, so an
            # item can be sent back as it is (kubectl does the same).
            items.append({"apiVersion": RESOURCE_API_VERSION, "kind": "ResourceSlice", **item})
        return items

    async def create_slice(self, body: dict) -> dict:
        name = (body.get("metadata") or {}).get("name") or (body.get("metadata") or {}).get("generateName", "") + "*"
        what = f"create resourceslice {name}"
        status, answer = await self._call(what, "create_resource_slice", body)
        if status == 409:
            raise self._error(what, status, answer, AlreadyExists)
        if not 200 <= status < 300:
            raise self._error(what, status, answer)
        return self._object(what, status, answer)

    async def replace_slice(self, name: str, body: dict) -> dict:
        what = f"replace resourceslice {name}"
        status, answer = await self._call(what, "replace_resource_slice", name, body)
        if status == 409:
            raise self._error(what, status, answer, Conflict)
        if not 200 <= status < 300:
            raise self._error(what, status, answer)
        return self._object(what, status, answer)

    async def delete_slice(self, name: str) -> None:
        what = f"delete resourceslice {name}"
        status, body = await self._call(what, "delete_resource_slice", name)
        if status == 404 or 200 <= status < 300:
            return None
        raise self._error(what, status, body)

    async def close(self) -> None:
        if self._api_client is not None:
            api_client, self._api_client, self._resource, self._core = self._api_client, None, None, None
            await api_client.close()


__all__ = [
    "REQUEST_TIMEOUT_S",
    "RESOURCE_API_VERSION",
    "API_REQUESTS",
    "DEVICE_STATUS_PERMISSION",
    "KubeApiError",
    "Conflict",
    "AlreadyExists",
    "AllocationResult",
    "ClaimConsumer",
    "ClaimView",
    "KubeApi",
    "ClusterApi",
]
