"""The node's own Kubernetes Node for the converger's MIG re-layout: the `NodeApi` port, its backends, the endpoint.

The converger holds no Kubernetes credentials; it reads and changes its Node through
`kube_reaper.node` (shared/schemas/kubenode.py). This module owns what that may do:

- `check_change` refuses, before any request, every key outside the flow's short list
  (`nvidia.com/mig.config`, `nvidia.com/mig.config.state`, `nvidia.com/gpu.deploy.*`, the
  annotation `bcd.dev/mig.config.message`) and every value Kubernetes would not take, so a
  converger identity cannot relabel its Node at large; the Node is always `--node-name`.
- `build_patch` makes ONE JSON merge patch of a change, computed from the Node as read at the
  request's resourceVersion and carrying it as a precondition (`metadata.resourceVersion`): the
  API server answers 409 if the Node moved since, and the caller reads again. The taints go as
  the whole list (a merge patch replaces lists), the Node's own plus or minus the re-layout taint.
- `KubernetesNodeApi` talks to the API server through kubernetes_asyncio as `evictor.py` does
  (credentials through `shared.kubeclient`, imported on first use, REQUEST_TIMEOUT_S a request),
  reading raw JSON so nothing goes through the generated models; `NoNodeApi` is `--node-api none`.
- `NodeEndpoint` is the bus handler: checks, asks the port, bounds the view to the schema and
  answers a `NodeReply` for every outcome (nothing raises to the bus but a bug).
"""

from __future__ import annotations

import asyncio
import copy
import re
from pathlib import Path
from typing import Any, Protocol

from shared.kubeclient import KubeCredentialsError, LazyCoreApi
from shared.schemas import (
    GPU_DEPLOY_PREFIX,
    MIG_CONFIG_LABEL,
    MIG_STATE_LABEL,
    MIG_STATES,
    RELAYOUT_MESSAGE_ANNOTATION,
    RELAYOUT_MESSAGE_MAX,
    RELAYOUT_TAINT_EFFECT,
    RELAYOUT_TAINT_KEY,
    RELAYOUT_TAINT_VALUE,
    NodeChange,
    NodeRead,
    NodeReply,
    NodeRequest,
    NodeTaint,
    NodeView,
    clip,
)
from shared.schemas.codec import bounded_json_loads

from .evictor import REQUEST_TIMEOUT_S

#: every request `KubernetesNodeApi` makes, as RBAC sees it: generated method -> (apiGroup,
#: resource, verb). With evictor.API_REQUESTS, exactly what deploy/kubernetes/rbac.yaml's
#: ClusterRole bcd-kube-reaper grants (tests/unit/test_kubernetes_manifests.py holds them equal).
API_REQUESTS: dict[str, tuple[str, str, str]] = {
    "read_node": ("", "nodes", "get"),
    "patch_node": ("", "nodes", "patch"),
}

MERGE_PATCH = "application/merge-patch+json"
#: the longest bcd message annotation kube_reaper writes (characters).
MESSAGE_MAX = RELAYOUT_MESSAGE_MAX
#: what a NodeView carries at most (shared/schemas/kubenode.py's bounds).
VIEW_LABELS_MAX = 1024
VIEW_TAINTS_MAX = 256
#: the most of an API answer read (a Node is stored in etcd, whose objects stay under 1.5 MiB)
ANSWER_MAX_BYTES = 4 * 1024 * 1024

_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


class NodeApiError(Exception):
    """The Node could not be read or changed; the text says why."""


class NodeApiUnreachable(NodeApiError):
    """No answer: credentials, transport, timeout, or the API server's own trouble (429, 5xx)."""


class NodeConflict(NodeApiError):
    """The Node is not at the request's resourceVersion (409, or already moved when read)."""


class NodeRefused(NodeApiError):
    """The API server said no (403, 404, 422, ...): asking again will not help."""


class NodeApiDisabled(NodeApiError):
    """`--node-api none`: there is no Kubernetes Node to read."""


class NodeApi(Protocol):
    """The node's own Kubernetes Node: read it, change it atomically at a resourceVersion."""

    async def read(self) -> NodeView: ...

    async def change(self, req: NodeChange) -> NodeView: ...

    async def close(self) -> None: ...


# --- checks -----------------------------------------------------------------------------------


def is_dns1123_subdomain(name: str) -> bool:
    """A Kubernetes object name such as a Node's: <= 253 of lowercase DNS labels joined by dots."""
    return 0 < len(name) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(name) is not None


def is_qualified_name(key: str) -> bool:
    """Kubernetes' IsQualifiedName: [DNS-1123 subdomain (<= 253) "/"] name (<= 63)."""
    prefix, slash, name = key.rpartition("/")
    if slash and not is_dns1123_subdomain(prefix):
        return False
    return 0 < len(name) <= 63 and _NAME_PART.fullmatch(name) is not None


def is_label_value(value: str) -> bool:
    """Kubernetes' IsValidLabelValue: empty, or <= 63 of [A-Za-z0-9_.-] starting and ending alphanumeric."""
    return len(value) <= 63 and _LABEL_VALUE.fullmatch(value) is not None


def flow_label(key: str) -> bool:
    """One of the keys the re-layout flow may set: the MIG config and state, a gpu.deploy.<operand>
    label (the GPU operator's operands are DNS labels: device-plugin, dcgm-exporter, ...)."""
    if key in (MIG_CONFIG_LABEL, MIG_STATE_LABEL):
        return True
    operand = key[len(GPU_DEPLOY_PREFIX) :] if key.startswith(GPU_DEPLOY_PREFIX) else ""
    return _DNS1123_LABEL.fullmatch(operand) is not None and is_qualified_name(key)


def check_change(req: NodeChange) -> str:
    """Why `req` must not be sent ("" when it may): each key outside the flow's list, each bad value."""
    problems: list[str] = []
    for key, value in req.labels.items():
        if not flow_label(key):
            problems.append(f"label {key!r} is not one kube_reaper sets ({MIG_CONFIG_LABEL}, {MIG_STATE_LABEL}, {GPU_DEPLOY_PREFIX}*)")
        elif value is None:
            continue
        elif not is_label_value(value):
            problems.append(f"label {key!r}: {value!r} is no valid label value")
        elif key == MIG_STATE_LABEL and value not in MIG_STATES:
            problems.append(f"label {key!r}: {value!r} is none of {', '.join(MIG_STATES)}")
    for key, value in req.annotations.items():
        if key != RELAYOUT_MESSAGE_ANNOTATION:
            problems.append(f"annotation {key!r} is not one kube_reaper sets ({RELAYOUT_MESSAGE_ANNOTATION})")
        elif value is None:
            continue
        elif len(value) > MESSAGE_MAX:
            problems.append(f"annotation {key!r}: {len(value)} characters, more than {MESSAGE_MAX}")
        elif not value.isprintable():
            problems.append(f"annotation {key!r}: not printable text (control or format characters)")
    return "; ".join(problems)


# --- the Node as JSON -------------------------------------------------------------------------


def _meta(node: dict) -> dict:
    meta = node.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _spec(node: dict) -> dict:
    spec = node.get("spec")
    return spec if isinstance(spec, dict) else {}


def _strings(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else {}


def _taints(node: dict) -> list[dict]:
    taints = _spec(node).get("taints")
    return [t for t in taints if isinstance(t, dict)] if isinstance(taints, list) else []


def _is_relayout_taint(taint: dict) -> bool:
    # a taint is its key and effect (the API server refuses two of the same): any value is the flow's
    return taint.get("key") == RELAYOUT_TAINT_KEY and taint.get("effect") == RELAYOUT_TAINT_EFFECT


def relayout_taint() -> dict:
    return {"key": RELAYOUT_TAINT_KEY, "value": RELAYOUT_TAINT_VALUE, "effect": RELAYOUT_TAINT_EFFECT}


def view_of(node: dict) -> NodeView:
    """The Node as the flow reads it: every label, bcd's own annotation, the taints, the cordon.

    Unbounded here: `bounded` fits it to the schema at the bus."""
    meta = _meta(node)
    annotations = _strings(meta.get("annotations"))
    return NodeView(
        name=str(meta.get("name", "")),
        resource_version=str(meta.get("resourceVersion", "")),
        labels=_strings(meta.get("labels")),
        annotations={k: v for k, v in annotations.items() if k == RELAYOUT_MESSAGE_ANNOTATION},
        taints=[NodeTaint(key=str(t.get("key", "")), value=str(t.get("value") or ""), effect=str(t.get("effect", ""))) for t in _taints(node)],
        unschedulable=_spec(node).get("unschedulable") is True,
    )


def bounded(view: NodeView) -> tuple[NodeView, str]:
    """`view` within NodeView's bounds, and what was left out ("" when nothing): the flow's labels
    and the re-layout taint are always kept, the rest by name until the bound."""
    notes: list[str] = []
    labels = view.labels
    if len(labels) > VIEW_LABELS_MAX:
        keys = sorted(labels, key=lambda k: (not (flow_label(k) or k.startswith("nvidia.com/mig.")), k))[:VIEW_LABELS_MAX]
        labels = {k: labels[k] for k in sorted(keys)}
        notes.append(f"the Node has {len(view.labels)} labels; {len(view.labels) - len(labels)} left out (the flow's are kept)")
    taints = view.taints
    if len(taints) > VIEW_TAINTS_MAX:
        ours = [t for t in taints if t.key == RELAYOUT_TAINT_KEY]
        taints = ours + [t for t in taints if t.key != RELAYOUT_TAINT_KEY][: VIEW_TAINTS_MAX - len(ours)]
        notes.append(f"the Node has {len(view.taints)} taints; {len(view.taints) - len(taints)} left out (the re-layout taint is kept)")
    if not notes:
        return view, ""
    return NodeView(
        name=view.name,
        resource_version=view.resource_version,
        labels=labels,
        annotations=view.annotations,
        taints=taints,
        unschedulable=view.unschedulable,
    ), "; ".join(notes)


def build_patch(node: dict, req: NodeChange) -> dict | None:
    """The one JSON merge patch that makes `req` of `node` (read at req.resource_version), or None
    when it would change nothing. It carries the resourceVersion: a Node changed since is a 409."""
    meta, spec = _meta(node), _spec(node)
    patch_meta: dict[str, Any] = {}
    for field, wanted, current in (
        ("labels", req.labels, _strings(meta.get("labels"))),
        ("annotations", req.annotations, _strings(meta.get("annotations"))),
    ):
        diff: dict[str, str | None] = {}
        for key, value in sorted(wanted.items()):
            # null removes a key in a merge patch; a key already as asked is left out
            if value is None:
                if key in current:
                    diff[key] = None
            elif current.get(key) != value:
                diff[key] = value
        if diff:
            patch_meta[field] = diff
    patch_spec: dict[str, Any] = {}
    if req.relayout_taint is not None:
        taints = _taints(node)
        others = [copy.deepcopy(t) for t in taints if not _is_relayout_taint(t)]
        present = [t for t in taints if _is_relayout_taint(t)]
        if req.relayout_taint and [t.get("value") for t in present] != [RELAYOUT_TAINT_VALUE]:
            patch_spec["taints"] = [*others, relayout_taint()]
        elif not req.relayout_taint and present:
            patch_spec["taints"] = others
    if req.unschedulable is not None and (spec.get("unschedulable") is True) != req.unschedulable:
        patch_spec["unschedulable"] = req.unschedulable
    if not patch_meta and not patch_spec:
        return None
    patch: dict[str, Any] = {"metadata": {"resourceVersion": req.resource_version, **patch_meta}}
    if patch_spec:
        patch["spec"] = patch_spec
    return patch


# --- backends ---------------------------------------------------------------------------------


class NoNodeApi:
    """`--node-api none`: no Kubernetes Node. Every request is answered `disabled`."""

    async def read(self) -> NodeView:
        raise NodeApiDisabled("no Node API configured (--node-api none)")

    async def change(self, req: NodeChange) -> NodeView:
        raise NodeApiDisabled("no Node API configured (--node-api none)")

    async def close(self) -> None:
        return None


class KubernetesNodeApi:
    """The Node `name` through the API server (kubernetes_asyncio, raw JSON in and out)."""

    def __init__(self, name: str, kubeconfig: Path | None = None, in_cluster: str = "auto", timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.name = name
        self.api = LazyCoreApi(kubeconfig, in_cluster)
        self.timeout = float(timeout)

    @property
    def source(self) -> str:
        """Where the credentials came from, once loaded (for logs)."""
        return self.api.source

    async def connect(self) -> str:
        """Load credentials (once); raises NodeApiUnreachable with the reason."""
        try:
            await self.api.connect()
        except KubeCredentialsError as exc:
            raise NodeApiUnreachable(str(exc)) from None
        return self.api.source

    async def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> dict:
        """One CoreV1Api request: the answer's JSON object, or the NodeApiError its status means."""
        await self.connect()
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException, OpenApiException

        try:
            async with asyncio.timeout(self.timeout):
                resp = await getattr(self.api.core, method)(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
                try:
                    raw = await resp.read()
                    status = int(resp.status)
                finally:
                    resp.release()
        except TimeoutError:
            raise NodeApiUnreachable(f"{what}: no answer within {self.timeout:g}s") from None
        except (ApiException, OpenApiException) as exc:  # raised before sending
            raise NodeApiUnreachable(f"{what}: {type(exc).__name__}: {exc}") from None
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise NodeApiUnreachable(f"{what}: {type(exc).__name__}: {exc}") from None
        try:
            body = bounded_json_loads(raw, ANSWER_MAX_BYTES, what) if raw else None
        except ValueError:
            body = None
        if 200 <= status < 300:
            if not isinstance(body, dict):
                raise NodeRefused(f"{what}: HTTP {status}: the answer is not a JSON object")
            return body
        message = str(body.get("message", "")) if isinstance(body, dict) else raw[:300].decode("utf-8", "replace")
        text = clip(f"{what}: HTTP {status}: {message}".rstrip(": "), 1000)
        if status == 409:
            raise NodeConflict(text)
        if status == 429 or status >= 500:
            raise NodeApiUnreachable(text)
        raise NodeRefused(text)

    async def _get(self) -> dict:
        what = f"get node {self.name}"
        return await self._call(what, "read_node", self.name)

    async def read(self) -> NodeView:
        return view_of(await self._get())

    async def change(self, req: NodeChange) -> NodeView:
        node = await self._get()
        current = str(_meta(node).get("resourceVersion", ""))
        if current != req.resource_version:
            raise NodeConflict(f"node {self.name} is at resourceVersion {current}, not {req.resource_version}: read it again")
        patch = build_patch(node, req)
        if patch is None:
            return view_of(node)
        what = f"patch node {self.name}"
        return view_of(await self._call(what, "patch_node", self.name, patch, _content_type=MERGE_PATCH))

    async def close(self) -> None:
        await self.api.close()


# --- the endpoint -----------------------------------------------------------------------------

VERBS = ("read", "change")
OUTCOMES = ("ok", "invalid", "refused", "conflict", "unreachable", "disabled")


class NodeEndpoint:
    """`kube_reaper.node`: NodeRead | NodeChange -> NodeReply, every outcome an answer.

    `requests` is the counter `bcd_reaper_node_requests{verb,outcome}` (or None)."""

    def __init__(self, api: NodeApi, requests: Any = None, log: Any = None) -> None:
        self.api = api
        self.requests = requests
        self.log = log
        if requests is not None:  # every series from the start
            for verb in VERBS:
                for outcome in OUTCOMES:
                    requests.labels(verb=verb, outcome=outcome)

    def _count(self, verb: str, outcome: str) -> None:
        if self.requests is not None:
            self.requests.labels(verb=verb, outcome=outcome).inc()

    def _warn(self, text: str, **kw: Any) -> None:
        if self.log is not None:
            self.log.warning(text, **kw)

    async def __call__(self, req: NodeRequest) -> NodeReply:
        verb = "read" if isinstance(req, NodeRead) else "change"
        if isinstance(req, NodeChange):
            problem = check_change(req)
            if problem:
                self._count(verb, "invalid")
                self._warn("node change refused", reason=problem)
                return NodeReply(ok=False, detail=clip(f"refused, nothing sent: {problem}"))
        try:
            view = await (self.api.read() if isinstance(req, NodeRead) else self.api.change(req))
        except NodeApiDisabled as exc:
            self._count(verb, "disabled")
            return NodeReply(ok=False, disabled=True, detail=clip(str(exc)))
        except NodeConflict as exc:
            self._count(verb, "conflict")
            return NodeReply(ok=False, conflict=True, detail=clip(str(exc)))
        except NodeApiUnreachable as exc:
            self._count(verb, "unreachable")
            self._warn("Kubernetes Node unreachable", verb=verb, reason=str(exc))
            return NodeReply(ok=False, reachable=False, detail=clip(str(exc)))
        except NodeRefused as exc:
            self._count(verb, "refused")
            self._warn("Kubernetes refused the Node request", verb=verb, reason=str(exc))
            return NodeReply(ok=False, detail=clip(str(exc)))
        view, note = bounded(view)
        self._count(verb, "ok")
        return NodeReply(ok=True, node=view, detail=clip(note))


__all__ = [
    "API_REQUESTS",
    "MERGE_PATCH",
    "MESSAGE_MAX",
    "NodeApi",
    "NodeApiDisabled",
    "NodeApiError",
    "NodeApiUnreachable",
    "NodeConflict",
    "NodeEndpoint",
    "NodeRefused",
    "KubernetesNodeApi",
    "NoNodeApi",
    "bounded",
    "build_patch",
    "check_change",
    "flow_label",
    "is_dns1123_subdomain",
    "is_label_value",
    "is_qualified_name",
    "relayout_taint",
    "view_of",
]
