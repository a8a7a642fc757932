"""Nodes, the pods bound to them, their Evictions and PodDisruptionBudgets, for the API server stand-in.

kubeapi_standin.py owns the HTTP server, the shared name formats, field errors and selectors;
this module owns the core/v1 Node and Pod objects and the policy/v1 side of evicting a pod, as
`NodesAndPods` (the stand-in holds one and routes these paths to it, under its lock and its one
resourceVersion counter):

- `GET /api/v1/nodes` (labelSelector; fieldSelector metadata.name, spec.unschedulable),
  `GET|PUT|PATCH /api/v1/nodes/{name}`
- `GET /api/v1/pods` (all namespaces), `GET /api/v1/namespaces/{ns}/pods` (labelSelector;
  fieldSelector metadata.name, metadata.namespace, spec.nodeName, spec.restartPolicy,
  status.phase), `GET|DELETE /api/v1/namespaces/{ns}/pods/{name}`
- `POST /api/v1/namespaces/{ns}/pods/{name}/eviction`
- `GET /apis/policy/v1/poddisruptionbudgets`, `.../namespaces/{ns}/poddisruptionbudgets[/{name}]`

The rules, ported from the upstream sources read for this file (kubernetes/kubernetes through the
code index, and the staging repositories kubernetes/apimachinery at eed236ceee2c and
kubernetes/apiserver at 24a394e516bf, both of 2026-07-23):

- Updating a Node (PUT and every PATCH), in the order of apiserver
  pkg/endpoints/handlers/update.go and patch.go, pkg/registry/rest/update.go BeforeUpdate and
  pkg/registry/generic/registry/store.go Update: decode (a wrong JSON type is 400 on a PUT, and
  on a PATCH 422 with the cause field `patch` as applyPatchToObject/jsonPatcher give it; an
  unknown field is dropped with a `Warning` header, the server's default fieldValidation=Warn);
  checkName (a body or patch naming another node: 400); the UID precondition of a PUT body
  (DefaultUpdatedObjectInfo.Preconditions: 409 with the StorageError text); the
  resourceVersion precondition (a stale one: 409 "the object has been modified; ...", none:
  the unconditional update nodes allow, nodeStrategy.AllowUnconditionalUpdate); BeforeUpdate
  (a namespace cleared for a cluster-scoped kind, EnsureObjectNamespaceMatchesRequestNamespace;
  an empty uid, creationTimestamp and deletionTimestamp taken from the stored node, so a
  changed creationTimestamp is silently ignored, not refused; the status kept,
  nodeStrategy.PrepareForUpdate); then validation, 422 with one cause per error, repeated as
  Kubernetes repeats them: rest.ValidateUpdate runs validateCommonFields
  (ValidateObjectMetaAccessor with validatePathSegment, ValidateObjectMetaAccessorUpdate) and
  nodeStrategy.ValidateUpdate (pkg/apis/core/validation/validation.go ValidateNode, then
  ValidateNodeUpdate), so a bad label is four identical causes and a bad taint two, while the
  message (field.ErrorList.ToAggregate) names each once. An update that changes nothing is not
  written and keeps its resourceVersion (the etcd3 store's GuaranteedUpdate).
- What validation checks here: apimachinery pkg/api/validation/objectmeta.go
  validateObjectMetaAccessorWithOptsCommon (namespace forbidden on a Node, generation >= 0,
  labels, annotations, owner references, finalizers) and ValidateObjectMetaAccessorUpdate
  (name, namespace, uid, creationTimestamp, deletionTimestamp and deletionGracePeriodSeconds
  immutable: "field is immutable"); metav1validation.ValidateLabels (each key
  ValidateLabelName, each value IsValidLabelValue, both at `metadata.labels`);
  ValidateAnnotations (keys lower-cased qualified names, 256 KiB in all); validateNodeTaints
  (key a label name, value a label value with the messages joined by ";", effect required and
  one of NoSchedule, PreferNoSchedule, NoExecute (validateTaintEffect), unique by key and
  effect: "Duplicate value: {internal core.Taint as Go's json.Marshal writes it}: taints must
  be unique by key and effect pair"), at `metadata.taints[i]`: ValidateNode and
  ValidateNodeUpdate pass fldPath "metadata" for the taints, so that is where Kubernetes
  reports them; ValidateNodeUpdate's podCIDRs and providerID (may only go from "" to a value)
  and externalID (may not be updated). Not ported: ValidateNodeSpecificAnnotations (the
  taints and preferAvoidPods annotations), podCIDR syntax and dual stack, node resources,
  status addresses and configSource, managedFields (the stand-in keeps none).
- Patches (handlers/patch.go PatchResource): a Content-Type other than
  application/json-patch+json, application/merge-patch+json or
  application/strategic-merge-patch+json is 415 (negotiation.NewUnsupportedMediaTypeError;
  the stand-in does not do server-side apply, so it leaves application/apply-patch+yaml out
  of the list). JSON merge patch is RFC 7386 as gopkg.in/evanphx/json-patch.v4 MergePatch
  applies it (null removes, objects merge, anything else replaces; a null or scalar patch is
  400 "Invalid JSON Patch"). JSON patch is RFC 6902 as that library's Patch.Apply runs it
  (add, remove, replace, move, copy, test; JSON pointers with ~0 and ~1); a body that is not a
  list of operations is 400, and any operation that does not apply, `test` included, is 422
  with the generic text NewGenericServerResponse(422) gives ("the server rejected our request
  due to an error in our request") and no causes. Strategic merge patch is
  apimachinery pkg/util/strategicpatch mergeMap as StrategicMergeMapPatch runs it
  (MergeParallelList, IgnoreUnmatchedNulls): maps merge (labels, annotations); `$patch:
  replace|delete` in a map; lists replace unless the Go type tags say `patchStrategy:merge`:
  for a Node (k8s.io/api core/v1 types.go) metadata.finalizers and spec.podCIDRs (merged
  scalars, `$deleteFromPrimitiveList/`), metadata.ownerReferences (by uid), status.conditions
  and status.addresses (by type; the status is dropped on update anyway). spec.taints has no
  patch strategy (`+listType=atomic`), so a strategic patch replaces the whole list.
  `$retainKeys` and `$setElementOrder/` are honoured; the final ordering of a merged list
  (normalizeElementOrder) is followed for patch items and server-only items, not bit for bit.
- The pods' delete (pkg/registry/core/pod/strategy.go CheckGracefulDelete and the generic
  store's BeforeDelete): the grace period is DeleteOptions.gracePeriodSeconds, else the pod's
  spec.terminationGracePeriodSeconds (30); 0 for a pod not bound to a node or already
  Succeeded/Failed; 0 deletes at once, anything else sets metadata.deletionTimestamp (now +
  the grace period) and deletionGracePeriodSeconds, and the pod stays until the kubelet has
  stopped it. The stand-in's kubelet takes `eviction_grace_s` (default 0: at once) or the
  grace period, whichever is shorter. Preconditions (uid, resourceVersion) are checked as
  storage.Preconditions.Check does: 409 with the StorageError text.
- Evictions: pkg/registry/core/pod/storage/eviction.go EvictionREST.Create, in its order:
  the create handler's decode (apiVersion policy/v1 or policy/v1beta1, kind Eviction; 400
  otherwise) and namespace check (400 "the namespace of the provided object does not match
  the namespace sent on the request"); "name in URL does not match name in Eviction object"
  (400); propagateDryRun (`?dryRun=All` and deleteOptions.dryRun; "Non-matching dry-run
  options" is 500); the pod (404 `pods "x" not found`); canIgnorePDB (a Succeeded, Failed or
  Pending pod, or one already being deleted, is deleted without a PDB check);
  getPodDisruptionBudgets (the namespace's PDBs whose selector matches the pod's labels; an
  empty selector matches nothing here); more than one: the handler *returns*
  `Status{status: Failure, code: 500, message: "This pod has more than one
  PodDisruptionBudget, which the eviction subresource does not support."}`, which the create
  handler sends with HTTP 201 (handlers/create.go keeps a non-zero Status code in the body and
  answers http.StatusCreated): client-go turns it into an error, kubernetes_asyncio does not;
  a pod that is not ready is deleted when currentHealthy >= desiredHealthy > 0;
  checkAndDecrement: disruptionsAllowed 0 is 429 TooManyRequests "Cannot evict pod as it would
  violate the pod's disruption budget." with the cause {reason: DisruptionBudget, message:
  "The disruption budget NAME needs D healthy pods and has C currently"} and no Retry-After
  (NewTooManyRequests(msg, 0): responsewriters only sends Retry-After for a positive
  RetryAfterSeconds); otherwise the pod is deleted (with the grace period the
  deleteOptions give) and the answer is 201 `Status{status: Success, code: 201}`.
- The budget's status, as the disruption controller (pkg/controller/disruption/disruption.go)
  would have written it before the eviction: getPodsForPdb (matchLabels), getExpectedPodCount
  (an integer minAvailable: desiredHealthy = it, expectedPods = the matching pods; a percentage
  or maxUnavailable: expectedPods = getExpectedScale, the summed scale of the pods'
  controllers, unmanaged pods counting nothing; intstr.GetScaledValueFromIntOrPercent rounding
  up; desiredHealthy = expected - maxUnavailable, at least 0), countHealthyPods (a pod with no
  deletionTimestamp whose Ready condition is True), updatePdbStatus (disruptionsAllowed =
  currentHealthy - desiredHealthy, 0 when that or expectedPods is not positive) and
  pdbhelper.UpdateDisruptionAllowedCondition. Bare pods under a maxUnavailable or percentage
  budget therefore allow no eviction, as in a cluster; `add_controller` gives pods an owner
  with a scale. The decrement the eviction handler writes into the PDB status
  (DisruptedPods) is not stored: the next eviction recomputes, and an evicted pod is gone or
  carries a deletionTimestamp, so it counts as the controller would count it.
- The kubelet's pod-resources view (`pod_resources`, `kubelet_pods`): the pods bound to the
  node that are active, i.e. not Succeeded or Failed (pkg/kubelet/apis/podresources
  server_v1.go List over the active pods since kubernetes PR #132028); a deleted pod stays
  while its containers stop (deletionTimestamp set) and leaves when the kubelet is done.

Test helpers (no HTTP, no request log): `add_node`, `node`, `label_node` and `annotate_node`
(what `kubectl label/annotate --overwrite` sends: a JSON merge patch, through the same update
rules, bumping the resourceVersion; a refusal is a ValueError with the API's message),
`add_pod`, `pod`, `pods`, `set_pod_phase`, `add_controller`, `add_pdb`, `pdb`, `evictions`.
"""

from __future__ import annotations

import copy
import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from .kubeapi_standin import (
    _ANY,
    _BOOL,
    _INT,
    _META,
    _STR,
    _TIME,
    TOTAL_ANNOTATION_SIZE_LIMIT,
    ApiError,
    DecodeError,
    Errors,
    FieldError,
    _decode,
    _list,
    _now,
    _obj,
    is_dns1123_label,
    is_dns1123_subdomain,
    is_label_value,
    is_qualified_name,
    label_selector_matches,
    parse_field_selector,
)

if TYPE_CHECKING:
    from services.kube_reaper.proto import podresources_v1_pb2 as pb

    from .kubeapi_standin import KubeApiStandIn

#: validateTaintEffect: the node taint effects (NoScheduleNoAdmit is still commented out upstream)
NODE_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
#: the patch types a Node's PATCH takes here (types.PatchType; apply-patch is not implemented)
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH)
#: apiserver storage OptimisticLockErrorMsg
OPTIMISTIC_LOCK = "the object has been modified; please apply your changes to the latest version and try again"
#: eviction.go createTooManyRequestsError / checkAndDecrement
EVICTION_BLOCKED = "Cannot evict pod as it would violate the pod's disruption budget."
EVICTION_MULTIPLE_PDBS = "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
#: policy/v1 DisruptionBudgetCause
DISRUPTION_BUDGET_CAUSE = "DisruptionBudget"
#: the pod's spec.terminationGracePeriodSeconds default (pkg/apis/core/v1/defaults.go)
DEFAULT_TERMINATION_GRACE_S = 30
POD_PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")
TERMINAL_PHASES = ("Succeeded", "Failed")
_PAUSE_IMAGE = "registry.k8s.io/pause:3.10"

_TAINT = _obj(key=_STR, value=_STR, effect=_STR, timeAdded=_TIME)
_NODE_SCHEMA = _obj(
    apiVersion=_STR,
    kind=_STR,
    metadata=_META,
    spec=_obj(
        podCIDR=_STR, podCIDRs=_list(_STR), providerID=_STR, unschedulable=_BOOL, taints=_list(_TAINT),
        configSource=_ANY, externalID=_STR,
    ),
    status=_ANY,
)
_DELETE_OPTIONS = _obj(
    kind=_STR, apiVersion=_STR, gracePeriodSeconds=_INT, preconditions=_obj(uid=_STR, resourceVersion=_STR),
    orphanDependents=_BOOL, propagationPolicy=_STR, dryRun=_list(_STR), ignoreStoreReadErrorWithClusterBreakingPotential=_BOOL,
)
_EVICTION_SCHEMA = _obj(apiVersion=_STR, kind=_STR, metadata=_META, deleteOptions=_DELETE_OPTIONS)

_NODES = re.compile(r"^/api/v1/nodes$")
_NODE = re.compile(r"^/api/v1/nodes/([^/]+)$")
_PODS_ALL = re.compile(r"^/api/v1/pods$")
_PODS_NS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
_EVICTION = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction$")
_PDBS_ALL = re.compile(r"^/apis/policy/v1/poddisruptionbudgets$")
_PDBS_NS = re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets$")
_PDB = re.compile(r"^/apis/policy/v1/namespaces/([^/]+)/poddisruptionbudgets/([^/]+)$")


# --- Status objects of the core group (no "group" in details) ----------------------------------------
def _not_found(resource: str, name: str) -> ApiError:
    # errors.NewNotFound: the core group is "", so `nodes "x" not found`
    return ApiError(404, f'{resource} "{name}" not found', "NotFound", {"name": name, "kind": resource})


def _conflict(resource: str, name: str, why: str) -> ApiError:
    # errors.NewConflict
    return ApiError(409, f'Operation cannot be fulfilled on {resource} "{name}": {why}', "Conflict", {"name": name, "kind": resource})


def _storage_invalid_obj(key: str, why: str) -> str:
    # storage.NewInvalidObjError(key, msg).Error(); interpretStorageError turns it into a Conflict
    return f"StorageError: invalid object, Code: 4, Key: {key}, ResourceVersion: 0, AdditionalErrorMsg: {why}"


def _invalid(kind: str, name: str, errors: Sequence[FieldError]) -> ApiError:
    # errors.NewInvalid: every error a cause; the message through ToAggregate, which drops repeats
    unique: list[FieldError] = []
    for e in errors:
        if str(e) not in {str(u) for u in unique}:
            unique.append(e)
    text = str(unique[0]) if len(unique) == 1 else "[" + ", ".join(str(e) for e in unique) + "]"
    details: dict = {"name": name, "kind": kind, "causes": [{"reason": e.reason, "message": e.message, "field": e.field} for e in errors]}
    if not kind:
        details.pop("kind")
    if not name:
        details.pop("name")
    return ApiError(422, f'{kind} "{name}" is invalid: {text}', "Invalid", details)


def _patch_invalid(patched: Any, why: str) -> ApiError:
    # patch.go: the patched object does not decode: NewInvalid(schema.GroupKind{}, "", {Invalid("patch", ...)})
    text = json.dumps(patched, separators=(",", ":"))
    return _invalid("", "", [FieldError("FieldValueInvalid", "patch", f"Invalid value: {json.dumps(text)}: {why}")])


def _bad_request(message: str) -> ApiError:
    return ApiError(400, message, "BadRequest")


# --- validation: pkg/apis/core/validation/validation.go and apimachinery objectmeta.go ---------------
def _go_json(value: Any) -> str:
    """Go's json.Marshal: no spaces."""
    return json.dumps(value, separators=(",", ":"))


def _path_segment_msgs(name: str) -> list[str]:
    # apimachinery api/validation/path IsValidPathSegmentName (validateCommonFields' name check)
    if name in (".", ".."):
        return [f"may not be '{name}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in name]


def _validate_labels(labels: Mapping[str, str], path: str, errs: Errors) -> None:
    # metav1validation.ValidateLabels (Go ranges a map in no order: sorted here)
    for key in sorted(labels):
        for msg in is_qualified_name(key):
            errs.invalid(path, key, msg)
        for msg in is_label_value(labels[key]):
            errs.invalid(path, labels[key], msg)


def _validate_annotations(annotations: Mapping[str, str], path: str, errs: Errors) -> None:
    # objectmeta.go ValidateAnnotations / ValidateAnnotationsSize (len in bytes)
    for key in sorted(annotations):
        for msg in is_qualified_name(key.lower()):
            errs.invalid(path, key, msg)
    if sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items()) > TOTAL_ANNOTATION_SIZE_LIMIT:
        errs.too_long(path, TOTAL_ANNOTATION_SIZE_LIMIT)


def _validate_owner_references(refs: Sequence[dict], path: str, errs: Errors) -> None:
    # objectmeta.go ValidateOwnerReferences / validateOwnerReference (BannedOwners not ported)
    first_controller = ""
    for ref in refs:
        if not (ref.get("apiVersion") or "").rpartition("/")[2]:
            errs.invalid(f"{path}.apiVersion", ref.get("apiVersion", ""), "version must not be empty")
        for key in ("kind", "name", "uid"):
            if not ref.get(key):
                errs.invalid(f"{path}.{key}", ref.get(key, ""), "must not be empty")
        if ref.get("controller") is True:
            current = f"{ref.get('kind', '')}/{ref.get('name', '')}"
            if first_controller:
                errs.invalid(path, refs, f'Only one reference can have Controller set to true. Found "true" in references for {first_controller} and {current}')
            else:
                first_controller = current


def _validate_meta(meta: dict, errs: Errors, *, namespaced: bool, name_msgs: Any) -> None:
    # objectmeta.go ValidateObjectMetaAccessor + validateObjectMetaAccessorWithOptsCommon
    name = meta.get("name", "")
    if not name:
        errs.required("metadata.name", "name or generateName is required")
    else:
        for msg in name_msgs(name):
            errs.invalid("metadata.name", name, msg)
    namespace = meta.get("namespace", "")
    if namespaced:
        if not namespace:
            errs.required("metadata.namespace")
        for msg in is_dns1123_label(namespace) if namespace else ():
            errs.invalid("metadata.namespace", namespace, msg)
    elif namespace:
        errs.forbidden("metadata.namespace", "not allowed on this type")
    if meta.get("generation", 0) < 0:
        errs.invalid("metadata.generation", meta["generation"], "must be greater than or equal to 0")
    _validate_labels(meta.get("labels") or {}, "metadata.labels", errs)
    _validate_annotations(meta.get("annotations") or {}, "metadata.annotations", errs)
    _validate_owner_references(meta.get("ownerReferences") or [], "metadata.ownerReferences", errs)
    finalizers = meta.get("finalizers") or []
    for f in finalizers:
        for msg in is_qualified_name(f):
            errs.invalid("metadata.finalizers", f, msg)
    if "orphan" in finalizers and "foregroundDeletion" in finalizers:
        errs.invalid("metadata.finalizers", finalizers, "finalizer orphan and foregroundDeletion cannot be both set")


def _validate_meta_update(meta: dict, old: dict, errs: Errors) -> None:
    # objectmeta.go ValidateObjectMetaAccessorUpdate (the store has filled an empty resourceVersion
    # in by then, so "must be specified for an update" cannot happen for a Node)
    if meta.get("generation", 0) < 0:
        errs.invalid("metadata.generation", meta["generation"], "must be greater than or equal to 0")
    if meta.get("generation", 0) < old.get("generation", 0):
        errs.invalid("metadata.generation", meta.get("generation", 0), "must not be decremented")
    for key, zero in (("name", ""), ("namespace", ""), ("uid", ""), ("creationTimestamp", None), ("deletionTimestamp", None), ("deletionGracePeriodSeconds", None)):
        if meta.get(key, zero) != old.get(key, zero):
            errs.invalid(f"metadata.{key}", meta.get(key, zero), "field is immutable")
    _validate_labels(meta.get("labels") or {}, "metadata.labels", errs)
    _validate_annotations(meta.get("annotations") or {}, "metadata.annotations", errs)
    _validate_owner_references(meta.get("ownerReferences") or [], "metadata.ownerReferences", errs)


def _validate_node_taints(taints: Sequence[dict], path: str, errs: Errors) -> None:
    # validation.go validateNodeTaints + validateTaintEffect(allowEmpty=false)
    seen: dict[str, set[str]] = {}
    for i, taint in enumerate(taints):
        ip = f"{path}[{i}]"
        key, value, effect = taint.get("key", ""), taint.get("value", ""), taint.get("effect", "")
        for msg in is_qualified_name(key):
            errs.invalid(f"{ip}.key", key, msg)
        if msgs := is_label_value(value):
            errs.invalid(f"{ip}.value", value, ";".join(msgs))
        if not effect:
            errs.required(f"{ip}.effect")
        elif effect not in NODE_TAINT_EFFECTS:
            errs.not_supported(f"{ip}.effect", effect, NODE_TAINT_EFFECTS)
        if key in seen.get(effect, ()):
            # field.Duplicate(idxPath, currTaint): the internal core.Taint has no json tags
            internal = {"Key": key, "Value": value, "Effect": effect, "TimeAdded": taint.get("timeAdded")}
            errs.append(FieldError("FieldValueDuplicate", ip, f"Duplicate value: {_go_json(internal)}: taints must be unique by key and effect pair"))
            continue
        seen.setdefault(effect, set()).add(key)


def validate_node(node: dict) -> list[FieldError]:
    """ValidateNode (also what a create meets): metadata, then the taints at `metadata.taints`."""
    errs = Errors()
    _validate_meta(node.get("metadata") or {}, errs, namespaced=False, name_msgs=is_dns1123_subdomain)
    taints = (node.get("spec") or {}).get("taints") or []
    if taints:
        _validate_node_taints(taints, "metadata.taints", errs)
    return list(errs)


def validate_node_update(node: dict, old: dict) -> list[FieldError]:
    """rest.ValidateUpdate for a Node: validateCommonFields, then nodeStrategy.ValidateUpdate
    (ValidateNode + ValidateNodeUpdate), each error as often as those report it."""
    meta, old_meta = node.get("metadata") or {}, old.get("metadata") or {}
    spec, old_spec = node.get("spec") or {}, old.get("spec") or {}
    errs = Errors()
    _validate_meta(meta, errs, namespaced=False, name_msgs=_path_segment_msgs)
    _validate_meta_update(meta, old_meta, errs)
    errs.extend(validate_node(node))
    # ValidateNodeUpdate
    _validate_meta_update(meta, old_meta, errs)
    old_cidrs, cidrs = old_spec.get("podCIDRs") or [], spec.get("podCIDRs") or []
    cidr_msg = 'node updates may not change podCIDR except from "" to valid'
    if old_cidrs:
        if len(old_cidrs) != len(cidrs):
            errs.forbidden("spec.podCIDRs", cidr_msg)
        else:
            for a, b in zip(old_cidrs, cidrs):
                if a != b:
                    errs.forbidden("spec.podCIDRs", cidr_msg)
    if old_spec.get("providerID") and old_spec.get("providerID") != spec.get("providerID", ""):
        errs.forbidden("spec.providerID", 'node updates may not change providerID except from "" to valid')
    if spec.get("taints"):
        _validate_node_taints(spec["taints"], "metadata.taints", errs)
    if spec.get("externalID", "") != old_spec.get("externalID", ""):
        errs.forbidden("spec.externalID", "may not be updated")
    return list(errs)


# --- JSON merge patch: RFC 7386 as gopkg.in/evanphx/json-patch.v4 MergePatch applies it ---------------
def _prune_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _prune_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_prune_nulls(v) if isinstance(v, dict) else v for v in value]
    return value


def json_merge_patch(doc: Any, patch: Any) -> Any:
    """mergeDocs: null deletes, two objects merge, anything else replaces (with its nulls pruned)."""
    if not isinstance(patch, dict):
        return patch
    if not isinstance(doc, dict):
        return _prune_nulls(patch)
    out = dict(doc)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif k in out and out[k] is not None:
            out[k] = json_merge_patch(out[k], v)
        else:
            out[k] = _prune_nulls(v)
    return out


# --- JSON patch: RFC 6902 as gopkg.in/evanphx/json-patch.v4 Patch.Apply runs it -----------------------
class JsonPatchError(Exception):
    """An operation that does not apply (the API server answers 422 without saying which)."""


def _go_json_sorted(value: Any) -> str:
    # equality of JSON values: true is not 1, 1 is not 1.0
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str):
        raise JsonPatchError("operation missing path field")
    if path == "":
        return []
    if not path.startswith("/"):
        raise JsonPatchError(f"JSON pointer must be empty or start with a \"/\": {path}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _container(doc: Any, tokens: list[str], path: str) -> tuple[Any, str]:
    cur = doc
    for t in tokens[:-1]:
        if isinstance(cur, dict) and t in cur:
            cur = cur[t]
        elif isinstance(cur, list) and t.isdigit() and int(t) < len(cur):
            cur = cur[int(t)]
        else:
            raise JsonPatchError(f"doc is missing path: {path}")
    if not isinstance(cur, (dict, list)):
        raise JsonPatchError(f"doc is missing path: {path}")
    return cur, tokens[-1]


def _index(con: list, key: str, path: str, *, allow_end: bool) -> int:
    if key == "-" and allow_end:
        return len(con)
    if not key.isdigit() or int(key) > len(con) - (0 if allow_end else 1):
        raise JsonPatchError(f"Unable to access invalid index: {key} in {path}")
    return int(key)


def _jp_get(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return doc
    con, key = _container(doc, tokens, path)
    if isinstance(con, dict):
        if key not in con:
            raise JsonPatchError(f"doc is missing key: {path}")
        return con[key]
    return con[_index(con, key, path, allow_end=False)]


def _jp_add(doc: Any, path: str, value: Any) -> Any:
    tokens = _pointer(path)
    if not tokens:
        return value
    con, key = _container(doc, tokens, path)
    if isinstance(con, dict):
        con[key] = value
    else:
        con.insert(_index(con, key, path, allow_end=True), value)
    return doc


def _jp_remove(doc: Any, path: str) -> Any:
    tokens = _pointer(path)
    con, key = _container(doc, tokens, path) if tokens else (None, "")
    if con is None:
        raise JsonPatchError("unable to remove the whole document")
    if isinstance(con, dict):
        if key not in con:
            raise JsonPatchError(f"Unable to remove nonexistent key: {key}: missing value")
        del con[key]
    else:
        del con[_index(con, key, path, allow_end=False)]
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """Apply a decoded RFC 6902 patch to a copy of `doc`; JsonPatchError when an operation does not apply."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind = op.get("op")
        path = op.get("path")
        if kind == "add":
            doc = _jp_add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc = _jp_remove(doc, path)
        elif kind == "replace":
            _jp_get(doc, path)  # replace needs the target to exist
            doc = _jp_add(_jp_remove(doc, path) if _pointer(path) else doc, path, copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise JsonPatchError(f"{kind} operation missing from field")
            value = copy.deepcopy(_jp_get(doc, source))
            if kind == "move":
                doc = _jp_remove(doc, source)
            doc = _jp_add(doc, path, value)
        elif kind == "test":
            try:
                current = _jp_get(doc, path)
            except JsonPatchError:
                current = None  # a missing value tests equal to null only
            if _go_json_sorted(current) != _go_json_sorted(op.get("value")):
                raise JsonPatchError(f"testing value {path} failed: test failed")
        else:
            raise JsonPatchError(f"Unexpected kind: {kind}")
    return doc


# --- strategic merge patch: apimachinery pkg/util/strategicpatch (mergeMap) for a Node --------------
class SmpError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


#: the lists of a Node with `patchStrategy:"merge"` (k8s.io/api core/v1 and meta/v1 types.go): path ->
#: patchMergeKey ("" for a list of scalars). Every other list is replaced whole.
NODE_MERGE_LISTS: dict[tuple[str, ...], str] = {
    ("metadata", "finalizers"): "",
    ("metadata", "ownerReferences"): "uid",
    ("spec", "podCIDRs"): "",
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
}
_DIRECTIVE = "$patch"
_RETAIN_KEYS = "$retainKeys"
_DELETE_FROM = "$deleteFromPrimitiveList"
_SET_ORDER = "$setElementOrder"


def _remove_directives(value: Any) -> tuple[Any, bool]:
    # removeDirectives: a map carrying $patch is dropped, recursively
    if isinstance(value, dict):
        if _DIRECTIVE in value:
            return None, False
        out = {}
        for k, v in value.items():
            nv, keep = _remove_directives(v)
            if keep:
                out[k] = nv
        return out, True
    if isinstance(value, list):
        return [nv for nv, keep in (_remove_directives(v) for v in value) if keep], True
    return value, True


def _discard_nulls(value: Any) -> Any:
    # discardNullValuesFromPatch
    if isinstance(value, dict):
        return {k: _discard_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_discard_nulls(v) for v in value]
    return value


def _key_of(item: Any, merge_key: str) -> Any:
    if not merge_key:
        return json.dumps(item, sort_keys=True)
    if not isinstance(item, dict) or merge_key not in item:
        raise SmpError(500, f"map: {item} does not contain declared merge key: {merge_key}")
    return json.dumps(item[merge_key], sort_keys=True)


def _ordered(patch_items: list, server_only: list, patch_order: list, server_order: list, merge_key: str) -> list:
    # normalizeElementOrder: each part sorted by its own order, then merged by the server's order
    def sort_by(items: list, order: list) -> list:
        keys = [_key_of(o, merge_key) for o in order if not (isinstance(o, dict) and _DIRECTIVE in o)]
        return sorted(items, key=lambda i: keys.index(_key_of(i, merge_key)) if _key_of(i, merge_key) in keys else len(keys))

    left, right = sort_by(server_only, server_order), sort_by(patch_items, patch_order)
    server_keys = [_key_of(o, merge_key) for o in server_order]
    out, i, j = [], 0, 0
    while i < len(left) or j < len(right):
        if i >= len(left):
            out.append(right[j])
            j += 1
        elif j >= len(right):
            out.append(left[i])
            i += 1
        else:
            lk, rk = _key_of(left[i], merge_key), _key_of(right[j], merge_key)
            if lk in server_keys and rk in server_keys and server_keys.index(lk) < server_keys.index(rk):
                out.append(left[i])
                i += 1
            else:
                out.append(right[j])
                j += 1
    return out


def _smp_list(original: list, patch: list, path: tuple[str, ...], merge_key: str, delete_list: bool) -> list:
    # mergeSlice
    if not original and not patch:
        return original
    if any(isinstance(v, list) for v in original + patch):
        raise SmpError(422, "lists of lists are not supported")
    if not merge_key:
        if any(isinstance(v, dict) for v in original + patch):
            raise SmpError(500, f"cannot merge lists without merge key for {'.'.join(path)}")
        if delete_list:  # deleteFromSlice
            return [v for v in original if v not in patch]
        merged: list = []
        for v in original + patch:
            if v not in merged:
                merged.append(v)
        in_patch = [v for v in merged if v in patch]
        return _ordered(in_patch, [v for v in merged if v not in patch], patch, original, "")
    # mergeSliceWithSpecialElements
    plain = []
    for item in patch:
        if not isinstance(item, dict):
            raise SmpError(500, f"expected a map[string]interface {{}}, but received a {type(item).__name__}")
        directive = item.get(_DIRECTIVE)
        if directive is None:
            plain.append(item)
        elif directive == "delete":
            if merge_key not in item:
                raise SmpError(500, f"map: {item} does not contain declared merge key: {merge_key}")
            original = [o for o in original if not (isinstance(o, dict) and o.get(merge_key) == item[merge_key])]
        elif directive == "replace":
            return [p for p in patch if not (isinstance(p, dict) and _DIRECTIVE in p)]
        elif directive == "merge":
            raise SmpError(500, "merging lists cannot yet be specified in the patch")
        else:
            raise SmpError(500, f"unknown patch type: {directive} in map: {item}")
    # mergeSliceWithoutSpecialElements
    merged = list(original)
    for item in plain:
        key = _key_of(item, merge_key)
        at = next((i for i, o in enumerate(merged) if _key_of(o, merge_key) == key), None)
        if at is None:
            merged.append(item)
        else:
            merged[at] = _smp_map(merged[at], item, path)
    patch_keys = {_key_of(p, merge_key) for p in plain}
    in_patch = [m for m in merged if _key_of(m, merge_key) in patch_keys]
    return _ordered(in_patch, [m for m in merged if _key_of(m, merge_key) not in patch_keys], plain, original, merge_key)


def _smp_map(original: Any, patch: dict, path: tuple[str, ...]) -> dict:
    # mergeMap with MergeParallelList and IgnoreUnmatchedNulls (StrategicMergeMapPatch)
    if _DIRECTIVE in patch:  # handleDirectiveInMergeMap
        directive = patch[_DIRECTIVE]
        if directive == "replace":
            return {k: v for k, v in patch.items() if k != _DIRECTIVE}
        if directive == "delete":
            return {}
        raise SmpError(500, f"unknown patch type: {directive} in map: {patch}")
    out = dict(original) if isinstance(original, dict) else {}
    patch = dict(patch)
    if _RETAIN_KEYS in patch:  # applyRetainKeysDirective
        retain = patch.pop(_RETAIN_KEYS)
        if not isinstance(retain, list):
            raise SmpError(400, "invalid patch format of retainKeys")
        for k, v in patch.items():
            if v is not None and not k.startswith((_DELETE_FROM, _SET_ORDER)) and k not in retain:
                raise SmpError(400, "invalid patch format of retainKeys")
        out = {k: v for k, v in out.items() if k in retain}
    for key in [k for k in patch if k.startswith(_SET_ORDER)]:  # mergePatchIntoOriginal
        order = patch.pop(key)
        name = key.partition("/")[2]
        if not key.startswith(_SET_ORDER + "/") or not isinstance(order, list):
            raise SmpError(400, "invalid patch format of setElementOrder list")
        merge_key = NODE_MERGE_LISTS.get(path + (name,), "")
        if name in patch:
            listed = _smp_list(out.get(name) or [], patch.pop(name), path + (name,), merge_key, False) if name in out else _remove_directives(patch.pop(name))[0]
        elif name in out:
            listed = out[name]
        else:
            continue
        order_keys = {_key_of(o, merge_key) for o in order}
        out[name] = _ordered(
            [m for m in listed if _key_of(m, merge_key) in order_keys],
            [m for m in listed if _key_of(m, merge_key) not in order_keys],
            order, out.get(name) or [], merge_key,
        )
    for key, value in patch.items():
        delete_list = key.startswith(_DELETE_FROM)
        if delete_list:  # preprocessDeletionListForMerging / extractKey
            if not key.startswith(_DELETE_FROM + "/"):
                raise SmpError(400, "invalid patch format of primitive list")
            key = key.partition("/")[2]
        if value is None:
            out.pop(key, None)
            continue
        if key not in out or type(out[key]) is not type(value):  # reflect.TypeOf differs: the patch value replaces
            if not delete_list:
                kept, keep = _remove_directives(_discard_nulls(value))
                if keep:
                    out[key] = kept
                else:
                    out.pop(key, None)
            continue
        sub = path + (key,)
        if isinstance(value, dict):
            out[key] = _smp_map(out[key], value, sub)
        elif isinstance(value, list):
            if sub in NODE_MERGE_LISTS or delete_list:
                out[key] = _smp_list(list(out[key]), value, sub, NODE_MERGE_LISTS.get(sub, ""), delete_list)
            else:
                out[key] = value  # no patch strategy: the patch's list as it is (spec.taints)
        else:
            out[key] = value
    return out


def strategic_merge_patch(doc: dict, patch: dict) -> dict:
    """A Node's strategic merge patch applied to a copy of `doc`; SmpError(code, text) when it cannot be."""
    return _smp_map(copy.deepcopy(doc), copy.deepcopy(patch), ())


# --- the objects ------------------------------------------------------------------------------------
def _omit_empty(d: dict, keys: Iterable[str]) -> None:
    for k in keys:
        if k in d and d[k] in ("", [], {}, None, False, 0):
            del d[k]


def _encode_node(obj: dict) -> dict:
    """The Node as v1's JSON encoding writes it (omitempty), kind and apiVersion first."""
    meta = copy.deepcopy(obj.get("metadata") or {})
    _omit_empty(meta, ("generateName", "namespace", "selfLink", "labels", "annotations", "ownerReferences", "finalizers", "managedFields", "generation"))
    spec = copy.deepcopy(obj.get("spec") or {})
    _omit_empty(spec, ("podCIDR", "podCIDRs", "providerID", "unschedulable", "taints", "configSource", "externalID"))
    for taint in spec.get("taints") or []:
        taint.setdefault("key", "")
        taint.setdefault("effect", "")
        _omit_empty(taint, ("value", "timeAdded"))
    return {"kind": "Node", "apiVersion": "v1", "metadata": meta, "spec": spec, "status": copy.deepcopy(obj.get("status") or {})}


def _taint(t: Any) -> dict:
    if isinstance(t, dict):
        return {k: v for k, v in t.items() if k in ("key", "value", "effect", "timeAdded")}
    key, value, effect = t
    return {"key": key, "value": value, "effect": effect}


def _selector_fields(selector: str, values: Mapping[str, str]) -> bool:
    return all((values[f] == v) == (op == "=") for f, op, v in parse_field_selector(selector, tuple(values)))


def scaled_value(value: int | str, total: int) -> int:
    """intstr.GetScaledValueFromIntOrPercent(value, total, roundUp=true)."""
    if isinstance(value, int):
        return value
    if not re.fullmatch(r"\d+%", value):
        raise ValueError(f"invalid value for IntOrString: invalid type: string is not a percentage: {value!r}")
    return math.ceil(int(value[:-1]) * total / 100)


def _validate_int_or_percent(value: Any, path: str, errs: Errors) -> None:
    # pkg/apis/policy/validation ValidatePodDisruptionBudgetSpec: ValidateNonnegativeIntOrPercent,
    # IsNotMoreThan100Percent
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        errs.invalid(path, value, "must be an integer or percentage (e.g '5%')")
    elif isinstance(value, int):
        if value < 0:
            errs.invalid(path, value, "must be greater than or equal to 0")
    elif not re.fullmatch(r"[0-9]+%", value):
        errs.invalid(path, value, "a valid percent string must be a numeric string followed by an ending '%' (e.g. '1%',  or '93%', regex used for validation is '[0-9]+%')")
    elif int(value[:-1]) > 100:
        errs.invalid(path, value, "must not be greater than 100%")


@dataclass(frozen=True)
class Eviction:
    """One eviction request as the stand-in answered it."""

    namespace: str
    pod: str
    #: the HTTP status sent (201 also for the more-than-one-budget Failure: see `status`)
    code: int
    #: the Status object's status: "Success" or "Failure"
    status: str
    reason: str
    message: str
    dry_run: bool
    body: Any
    at: float = field(default_factory=time.monotonic)

    @property
    def evicted(self) -> bool:
        return self.code == 201 and self.status == "Success" and not self.dry_run


class NodePodResources:
    """The kubelet's pod-resources view of one node of a stand-in: what `kube_peers.KubeletServer` serves."""

    def __init__(self, owner: "NodesAndPods", node_name: str) -> None:
        self.owner, self.node_name = owner, node_name

    def list_response(self) -> "pb.ListPodResourcesResponse":
        return self.owner.pod_resources(self.node_name)


class NodesAndPods:
    """Nodes, pods, their controllers' scales, PodDisruptionBudgets and evictions of one stand-in."""

    def __init__(self, server: "KubeApiStandIn") -> None:
        self.server = server
        self.lock = server._lock
        self.nodes: dict[str, dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        #: (namespace, name) -> {"kind", "uid", "replicas"}: the scale getExpectedScale finds
        self.controllers: dict[tuple[str, str], dict] = {}
        self.pdbs: dict[tuple[str, str], dict] = {}
        #: pods being deleted: (namespace, name) -> time.monotonic() when the kubelet is done
        self._going: dict[tuple[str, str], float] = {}
        self.eviction_log: list[Eviction] = []
        #: how long the kubelet takes to stop a deleted pod (capped by its grace period)
        self.eviction_grace_s = 0.0

    def _next_rv(self) -> str:
        self.server._rv += 1
        return str(self.server._rv)

    def _meta(self, name: str, namespace: str | None = None) -> dict:
        meta: dict = {"name": name}
        if namespace is not None:
            meta["namespace"] = namespace
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=_now())
        return meta

    # --- nodes -------------------------------------------------------------------------------------
    def add_node(self, name: str, *, labels: Mapping[str, str] | None = None, taints: Sequence[Any] | None = None,
                 unschedulable: bool = False, annotations: Mapping[str, str] | None = None) -> str:
        """A Node (replacing one of that name); what a create would refuse is a ValueError. Its uid."""
        with self.lock:
            node = {
                "metadata": {"name": name, "labels": dict(labels or {}), "annotations": dict(annotations or {})},
                "spec": {"taints": [_taint(t) for t in taints or ()], "unschedulable": unschedulable},
                "status": {},
            }
            errors = validate_node(node)
            if errors:
                raise ValueError(f"the API server refuses Node {name}: " + "; ".join(map(str, errors)))
            node["metadata"] = {**self._meta(name), **{k: v for k, v in node["metadata"].items() if k != "name"}}
            self.nodes[name] = _encode_node(node)
            return self.nodes[name]["metadata"]["uid"]

    def node(self, name: str) -> dict | None:
        with self.lock:
            n = self.nodes.get(name)
            return copy.deepcopy(n) if n else None

    def _kubectl_merge(self, name: str, key: str, values: Mapping[str, str | None]) -> str:
        with self.lock:
            try:
                _, node, _ = self._patch_node(name, MERGE_PATCH, {"metadata": {key: dict(values)}}, None, dry_run=False)
            except ApiError as exc:
                raise ValueError(exc.body["message"]) from None
            return node["metadata"]["resourceVersion"]

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> str:
        """`kubectl label node NAME k=v k2-` (with --overwrite): None removes a label. The new resourceVersion."""
        return self._kubectl_merge(name, "labels", labels)

    def annotate_node(self, name: str, annotations: Mapping[str, str | None]) -> str:
        """`kubectl annotate node NAME k=v k2-` (with --overwrite). The new resourceVersion."""
        return self._kubectl_merge(name, "annotations", annotations)

    def _list_nodes(self, query: Mapping[str, str]) -> dict:
        items = []
        for name, node in sorted(self.nodes.items()):
            # node strategy NodeToSelectableFields: metadata.name and spec.unschedulable (fmt.Sprint(bool))
            values = {"metadata.name": name, "spec.unschedulable": "true" if node["spec"].get("unschedulable") else "false"}
            if query.get("fieldSelector") and not _selector_fields(query["fieldSelector"], values):
                continue
            if query.get("labelSelector") and not label_selector_matches(query["labelSelector"], node["metadata"].get("labels") or {}):
                continue
            items.append({k: v for k, v in copy.deepcopy(node).items() if k not in ("kind", "apiVersion")})
        return {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.server._rv)}, "items": items}

    @staticmethod
    def _decode_node(body: Any) -> tuple[dict, list[str]]:
        if not isinstance(body, dict):
            raise DecodeError(f"json: cannot unmarshal {type(body).__name__} into Go value of type v1.Node")
        warnings: list[str] = []
        return _decode(body, _NODE_SCHEMA, "", warnings), warnings

    def _update_node(self, name: str, obj: dict, warnings: list[str], *, dry_run: bool) -> tuple[int, dict, list[tuple[str, str]]]:
        """store.Update for a Node: resourceVersion precondition, BeforeUpdate, validation, write."""
        old = self.nodes[name]
        old_meta = old["metadata"]
        meta = obj.setdefault("metadata", {})
        rv = meta.get("resourceVersion", "")
        if rv and rv != old_meta["resourceVersion"]:
            raise _conflict("nodes", name, OPTIMISTIC_LOCK)
        meta["resourceVersion"] = old_meta["resourceVersion"]  # unconditional update: the current one
        # BeforeUpdate: a cluster-scoped object's namespace is cleared; generation kept; status kept
        # (nodeStrategy.PrepareForUpdate); uid, creationTimestamp, deletion fields from the stored node
        meta.pop("namespace", None)
        meta.pop("generation", None)
        obj["status"] = copy.deepcopy(old.get("status") or {})
        if not meta.get("uid"):
            meta["uid"] = old_meta["uid"]
        meta["creationTimestamp"] = old_meta["creationTimestamp"]
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            if key in old_meta:
                meta[key] = old_meta[key]
        meta.pop("selfLink", None)
        meta.pop("managedFields", None)
        errors = validate_node_update(obj, old)
        if errors:
            raise _invalid("Node", meta.get("name", ""), errors)
        new = _encode_node(obj)
        # the apiserver's warning recorder: `299 - "<text>"`, the text quoted as Go quotes it
        headers = [("Warning", f"299 - {json.dumps(w)}") for w in warnings]
        if new == old or dry_run:  # GuaranteedUpdate writes nothing for an unchanged object
            return 200, copy.deepcopy(new), headers
        new["metadata"]["resourceVersion"] = self._next_rv()
        self.nodes[name] = new
        return 200, copy.deepcopy(new), headers

    def _put_node(self, name: str, body: Any, *, dry_run: bool) -> tuple[int, dict, list[tuple[str, str]]]:
        if not isinstance(body, dict):
            raise _bad_request("the body of the request was in an unknown format")
        if body.get("apiVersion") not in (None, "v1"):
            raise _bad_request(f"the API version in the data ({body['apiVersion']}) does not match the expected API version (v1)")
        if body.get("kind") not in (None, "Node"):
            raise _bad_request(f"the kind in the data ({body['kind']}) does not match the expected kind (Node)")
        try:
            obj, warnings = self._decode_node(body)
        except DecodeError as exc:
            raise _bad_request(f'Node in version "v1" cannot be handled as a Node: {exc}') from None
        body_name = (obj.get("metadata") or {}).get("name", "")
        if body_name != name:  # handlers/rest.go checkName
            raise _bad_request(f"the name of the object ({body_name}) does not match the name on the URL ({name})")
        old = self.nodes.get(name)
        if old is None:  # AllowCreateOnUpdate: false
            raise _not_found("nodes", name)
        uid = obj["metadata"].get("uid", "")
        if uid and uid != old["metadata"]["uid"]:  # DefaultUpdatedObjectInfo.Preconditions
            why = f"Precondition failed: UID in precondition: {uid}, UID in object meta: {old['metadata']['uid']}"
            raise _conflict("nodes", name, _storage_invalid_obj(f"/registry/minions/{name}", why))
        return self._update_node(name, obj, warnings, dry_run=dry_run)

    def _patch_node(self, name: str, content_type: str, patch: Any, body_error: str | None, *, dry_run: bool) -> tuple[int, dict, list[tuple[str, str]]]:
        media = content_type.split(";")[0].strip().lower()
        if media not in PATCH_TYPES:
            raise ApiError(415, "the body of the request was in an unknown format - accepted media types include: " + ", ".join(PATCH_TYPES), "UnsupportedMediaType")
        if body_error is not None:
            raise _bad_request(body_error)
        if media == JSON_PATCH and not (isinstance(patch, list) and all(isinstance(op, dict) for op in patch)):
            raise _bad_request(f"json: cannot unmarshal {type(patch).__name__} into Go value of type jsonpatch.Patch")
        if media == MERGE_PATCH and not isinstance(patch, (dict, list)):
            raise _bad_request("Invalid JSON Patch")
        if media == STRATEGIC_MERGE_PATCH and not isinstance(patch, (dict, type(None))):
            raise _bad_request(f"json: cannot unmarshal {type(patch).__name__} into Go value of type map[string]interface {{}}")
        old = self.nodes.get(name)
        if old is None:  # the patcher's createNewObject
            raise _not_found("nodes", name)
        current = copy.deepcopy(old)
        try:
            if media == JSON_PATCH:
                patched = json_patch(current, patch)
            elif media == MERGE_PATCH:
                patched = json_merge_patch(current, patch)
            else:
                patched = strategic_merge_patch(current, patch or {})
        except JsonPatchError:
            raise ApiError(422, "the server rejected our request due to an error in our request", "Invalid", {}) from None
        except SmpError as exc:
            raise ApiError(exc.code, str(exc)) from None
        try:
            obj, warnings = self._decode_node(patched)
        except DecodeError as exc:
            raise _patch_invalid(patched, str(exc)) from None
        patched_name = (obj.get("metadata") or {}).get("name", "")
        if patched_name != name:  # the patcher's applyPatch: checkName
            raise _bad_request(f"the name of the object ({patched_name}) does not match the name on the URL ({name})")
        return self._update_node(name, obj, warnings, dry_run=dry_run)

    # --- pods --------------------------------------------------------------------------------------
    def add_controller(self, namespace: str, name: str, replicas: int, *, kind: str = "ReplicaSet") -> str:
        """A controller whose pods (`add_pod(owner=name)`) the disruption controller scales by `replicas`. Its uid."""
        with self.lock:
            old = self.controllers.get((namespace, name))
            uid = old["uid"] if old else str(uuid.uuid4())
            self.controllers[(namespace, name)] = {"kind": kind, "uid": uid, "replicas": int(replicas)}
            return uid

    def add_pod(
        self,
        namespace: str,
        name: str,
        node_name: str,
        *,
        labels: Mapping[str, str] | None = None,
        devices: Mapping[str, Sequence[str]] | Sequence[tuple[str, Mapping[str, Sequence[str]]]] | None = None,
        phase: str = "Running",
        ready: bool | None = None,
        owner: str | None = None,
    ) -> str:
        """A pod bound to `node_name` ("" for an unscheduled one). Its uid.

        `devices`: {resource name: [device ids]} for one container "main", or [(container,
        {resource: [ids]}), ...] for several; each resource is also the container's limit (the
        count of its ids), as a device plugin's pods ask. `ready` (the Ready condition) defaults
        to phase == "Running". `owner`: a controller of `add_controller` in the namespace.
        """
        if phase not in POD_PHASES:
            raise ValueError(f"phase {phase!r}: one of {', '.join(POD_PHASES)}")
        with self.lock:
            errs = Errors()
            _validate_meta({"name": name, "namespace": namespace, "labels": dict(labels or {})}, errs, namespaced=True, name_msgs=is_dns1123_subdomain)
            if errs:
                raise ValueError(f"the API server refuses Pod {namespace}/{name}: " + "; ".join(map(str, errs)))
            if isinstance(devices, Mapping) or devices is None:
                containers = [("main", dict(devices or {}))]
            else:
                containers = [(c, dict(d)) for c, d in devices]
            meta = self._meta(name, namespace)
            if labels:
                meta["labels"] = dict(labels)
            if owner is not None:
                ctrl = self.controllers.get((namespace, owner))
                if ctrl is None:
                    raise ValueError(f"no controller {namespace}/{owner}: add_controller first")
                meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": ctrl["kind"], "name": owner, "uid": ctrl["uid"], "controller": True, "blockOwnerDeletion": True}]
            is_ready = (phase == "Running") if ready is None else bool(ready)
            self.pods[(namespace, name)] = {
                "kind": "Pod",
                "apiVersion": "v1",
                "metadata": meta,
                "spec": {
                    **({"nodeName": node_name} if node_name else {}),
                    "containers": [
                        {
                            "name": c,
                            "image": _PAUSE_IMAGE,
                            **({"resources": {"limits": {r: str(len(ids)) for r, ids in d.items()}, "requests": {r: str(len(ids)) for r, ids in d.items()}}} if d else {}),
                        }
                        for c, d in containers
                    ],
                    "restartPolicy": "Always",
                    "terminationGracePeriodSeconds": DEFAULT_TERMINATION_GRACE_S,
                },
                "status": {
                    "phase": phase,
                    "conditions": [
                        {"type": "PodScheduled", "status": "True" if node_name else "False"},
                        {"type": "Ready", "status": "True" if is_ready else "False"},
                    ],
                },
                # the kubelet's device assignment (pod-resources), not part of the API object
                "_devices": [(c, {r: list(ids) for r, ids in d.items()}) for c, d in containers],
            }
            self._going.pop((namespace, name), None)
            return meta["uid"]

    def set_pod_phase(self, namespace: str, name: str, phase: str, *, ready: bool | None = None) -> None:
        """What the kubelet reports: the pod's phase (and Ready condition, default phase == "Running")."""
        if phase not in POD_PHASES:
            raise ValueError(f"phase {phase!r}: one of {', '.join(POD_PHASES)}")
        with self.lock:
            pod = self.pods[(namespace, name)]
            pod["status"]["phase"] = phase
            for c in pod["status"]["conditions"]:
                if c["type"] == "Ready":
                    c["status"] = "True" if ((phase == "Running") if ready is None else ready) else "False"
            pod["metadata"]["resourceVersion"] = self._next_rv()

    def _reap(self) -> None:
        """The kubelet finishing deleted pods whose time is up."""
        now = time.monotonic()
        for key, when in list(self._going.items()):
            if when <= now:
                del self._going[key]
                if self.pods.pop(key, None) is not None:
                    self._next_rv()

    @staticmethod
    def _served(pod: dict) -> dict:
        return {k: copy.deepcopy(v) for k, v in pod.items() if not k.startswith("_")}

    def pod(self, namespace: str, name: str) -> dict | None:
        with self.lock:
            self._reap()
            p = self.pods.get((namespace, name))
            return self._served(p) if p else None

    def pods_on(self, node_name: str | None = None) -> list[dict]:
        with self.lock:
            self._reap()
            return [self._served(p) for _, p in sorted(self.pods.items()) if node_name is None or p["spec"].get("nodeName") == node_name]

    def _list_pods(self, namespace: str | None, query: Mapping[str, str]) -> dict:
        items = []
        for (ns, name), pod in sorted(self.pods.items()):
            if namespace is not None and ns != namespace:
                continue
            # pod strategy ToSelectableFields (the fields bcd and kubectl drain select on)
            values = {
                "metadata.name": name, "metadata.namespace": ns, "spec.nodeName": pod["spec"].get("nodeName", ""),
                "spec.restartPolicy": pod["spec"]["restartPolicy"], "status.phase": pod["status"]["phase"],
            }
            if query.get("fieldSelector") and not _selector_fields(query["fieldSelector"], values):
                continue
            if query.get("labelSelector") and not label_selector_matches(query["labelSelector"], pod["metadata"].get("labels") or {}):
                continue
            items.append({k: v for k, v in self._served(pod).items() if k not in ("kind", "apiVersion")})
        return {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.server._rv)}, "items": items}

    def _get_pod(self, namespace: str, name: str) -> dict:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise _not_found("pods", name)
        return pod

    def _check_preconditions(self, pod: dict, preconditions: Mapping[str, str] | None) -> None:
        # storage.Preconditions.Check
        meta = pod["metadata"]
        pre = preconditions or {}
        key = f"/registry/pods/{meta['namespace']}/{meta['name']}"
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            why = f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {meta['uid']}"
            raise _conflict("pods", meta["name"], _storage_invalid_obj(key, why))
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            why = f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, ResourceVersion in object meta: {meta['resourceVersion']}"
            raise _conflict("pods", meta["name"], _storage_invalid_obj(key, why))

    def _delete_pod(self, pod: dict, options: Mapping[str, Any], *, dry_run: bool) -> dict:
        """The store's Delete of a pod with its graceful deletion; the object as the answer gives it."""
        self._check_preconditions(pod, options.get("preconditions"))
        meta, spec, status = pod["metadata"], pod["spec"], pod["status"]
        key = (meta["namespace"], meta["name"])
        # pod strategy CheckGracefulDelete
        grace = options["gracePeriodSeconds"] if options.get("gracePeriodSeconds") is not None else spec.get("terminationGracePeriodSeconds", DEFAULT_TERMINATION_GRACE_S)
        if not spec.get("nodeName") or status["phase"] in TERMINAL_PHASES:
            grace = 0
        grace = max(grace, 1) if grace < 0 else grace
        if dry_run:
            return self._served(pod)
        if grace == 0:
            del self.pods[key]
            self._going.pop(key, None)
            self._next_rv()
            return self._served(pod)
        if "deletionTimestamp" not in meta:  # a second delete does not shorten the grace period here
            meta["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + grace))
            meta["deletionGracePeriodSeconds"] = grace
            meta["resourceVersion"] = self._next_rv()
        done = time.monotonic() + min(float(grace), float(self.eviction_grace_s))
        self._going[key] = min(self._going.get(key, done), done)
        if self.eviction_grace_s <= 0:
            self._reap()
        return self._served(pod)

    @staticmethod
    def _delete_options(body: Any, query: Mapping[str, str]) -> dict:
        options: dict = {}
        if isinstance(body, dict):
            try:
                options = _decode(body, _DELETE_OPTIONS, "", [])
            except DecodeError as exc:
                raise _bad_request(str(exc)) from None
        if "gracePeriodSeconds" in query:
            options["gracePeriodSeconds"] = int(query["gracePeriodSeconds"])
        return options

    # --- pod-resources -----------------------------------------------------------------------------
    def pod_resources(self, node_name: str) -> "pb.ListPodResourcesResponse":
        """The kubelet's pod-resources v1 List on `node_name`: its active pods and their devices."""
        from services.kube_reaper.proto import podresources_v1_pb2 as pb

        with self.lock:
            self._reap()
            return pb.ListPodResourcesResponse(
                pod_resources=[
                    pb.PodResources(
                        name=name,
                        namespace=ns,
                        containers=[
                            pb.ContainerResources(
                                name=c,
                                devices=[pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in d.items()],
                            )
                            for c, d in pod["_devices"]
                        ],
                    )
                    for (ns, name), pod in sorted(self.pods.items())
                    if pod["spec"].get("nodeName") == node_name and pod["status"]["phase"] not in TERMINAL_PHASES
                ]
            )

    def kubelet_pods(self, node_name: str) -> NodePodResources:
        return NodePodResources(self, node_name)

    # --- PodDisruptionBudgets ----------------------------------------------------------------------
    def add_pdb(self, namespace: str, name: str, match_labels: Mapping[str, str], *,
                min_available: int | str | None = None, max_unavailable: int | str | None = None) -> str:
        """A policy/v1 PodDisruptionBudget selecting `match_labels`. Its uid."""
        with self.lock:
            errs = Errors()
            if min_available is not None and max_unavailable is not None:
                errs.invalid("spec", {"minAvailable": min_available, "maxUnavailable": max_unavailable}, "minAvailable and maxUnavailable cannot be both set")
            if min_available is not None:
                _validate_int_or_percent(min_available, "spec.minAvailable", errs)
            if max_unavailable is not None:
                _validate_int_or_percent(max_unavailable, "spec.maxUnavailable", errs)
            _validate_labels(match_labels, "spec.selector.matchLabels", errs)
            if errs:
                raise ValueError(f"the API server refuses PodDisruptionBudget {namespace}/{name}: " + "; ".join(map(str, errs)))
            meta = self._meta(name, namespace)
            meta["generation"] = 1
            spec: dict = {"selector": {"matchLabels": dict(match_labels)}}
            if min_available is not None:
                spec["minAvailable"] = min_available
            if max_unavailable is not None:
                spec["maxUnavailable"] = max_unavailable
            self.pdbs[(namespace, name)] = {"kind": "PodDisruptionBudget", "apiVersion": "policy/v1", "metadata": meta, "spec": spec}
            return meta["uid"]

    @staticmethod
    def _ready(pod: dict) -> bool:
        # podutil.IsPodReady
        return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or ())

    def _pdb_status(self, pdb: dict) -> dict:
        """The status the disruption controller would have written (trySync / updatePdbStatus)."""
        ns = pdb["metadata"]["namespace"]
        selector = pdb["spec"]["selector"].get("matchLabels") or {}
        pods = [p for (pns, _), p in sorted(self.pods.items()) if pns == ns and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())]
        spec = pdb["spec"]
        expected = desired = 0
        if "maxUnavailable" in spec or isinstance(spec.get("minAvailable"), str):
            scales: dict[str, int] = {}  # getExpectedScale: unmanaged pods count nothing
            for p in pods:
                for ref in p["metadata"].get("ownerReferences") or ():
                    if ref.get("controller"):
                        ctrl = self.controllers[(ns, ref["name"])]
                        scales[ctrl["uid"]] = ctrl["replicas"]
            expected = sum(scales.values())
            if "maxUnavailable" in spec:
                desired = max(0, expected - scaled_value(spec["maxUnavailable"], expected))
            else:
                desired = scaled_value(spec["minAvailable"], expected)
        elif "minAvailable" in spec:
            desired, expected = spec["minAvailable"], len(pods)
        healthy = sum(1 for p in pods if not p["metadata"].get("deletionTimestamp") and self._ready(p))
        allowed = healthy - desired
        if expected <= 0 or allowed <= 0:
            allowed = 0
        generation = pdb["metadata"]["generation"]
        return {
            "observedGeneration": generation,
            "disruptionsAllowed": allowed,
            "currentHealthy": healthy,
            "desiredHealthy": desired,
            "expectedPods": expected,
            "conditions": [
                {
                    "type": "DisruptionAllowed",
                    "status": "True" if allowed > 0 else "False",
                    "reason": "SufficientPods" if allowed > 0 else "InsufficientPods",
                    "message": "",
                    "observedGeneration": generation,
                    "lastTransitionTime": pdb["metadata"]["creationTimestamp"],
                }
            ],
        }

    def _served_pdb(self, pdb: dict) -> dict:
        return {**copy.deepcopy(pdb), "status": self._pdb_status(pdb)}

    def pdb(self, namespace: str, name: str) -> dict | None:
        """The budget with the status the disruption controller would show now."""
        with self.lock:
            self._reap()
            p = self.pdbs.get((namespace, name))
            return self._served_pdb(p) if p else None

    def _list_pdbs(self, namespace: str | None, query: Mapping[str, str]) -> dict:
        items = []
        for (ns, _), pdb in sorted(self.pdbs.items()):
            if namespace is not None and ns != namespace:
                continue
            if query.get("labelSelector") and not label_selector_matches(query["labelSelector"], pdb["metadata"].get("labels") or {}):
                continue
            items.append({k: v for k, v in self._served_pdb(pdb).items() if k not in ("kind", "apiVersion")})
        return {"kind": "PodDisruptionBudgetList", "apiVersion": "policy/v1", "metadata": {"resourceVersion": str(self.server._rv)}, "items": items}

    # --- evictions ---------------------------------------------------------------------------------
    def evictions(self, namespace: str | None = None) -> list[Eviction]:
        """Every eviction request the stand-in answered (not those `fail_next`/`hang_next` took)."""
        with self.lock:
            return [e for e in self.eviction_log if namespace is None or e.namespace == namespace]

    def _evict(self, namespace: str, name: str, body: Any, query: Mapping[str, str]) -> tuple[int, dict, list[tuple[str, str]]]:
        dry_query = [query["dryRun"]] if query.get("dryRun") else []
        try:
            code, answer, dry_run = self._eviction(namespace, name, body, dry_query)
        except ApiError as exc:
            self.eviction_log.append(Eviction(namespace, name, exc.code, "Failure", exc.body.get("reason", ""), exc.body.get("message", ""), "All" in dry_query, body))
            raise
        self.eviction_log.append(Eviction(namespace, name, code, answer["status"], answer.get("reason", ""), answer.get("message", ""), dry_run, body))
        return code, answer, []

    def _eviction(self, namespace: str, name: str, body: Any, dry_query: list[str]) -> tuple[int, dict, bool]:
        # handlers/create.go: decode into the kind the endpoint takes (Eviction, policy/v1 or v1beta1)
        if not isinstance(body, dict):
            raise _bad_request("the body of the request was in an unknown format")
        api_version = body.get("apiVersion")
        if api_version not in (None, "policy/v1", "policy/v1beta1"):
            raise _bad_request(f"the API version in the data ({api_version}) does not match the expected API version (policy/v1)")
        if body.get("kind") not in (None, "Eviction"):
            raise _bad_request(f'no kind "{body["kind"]}" is registered for version "{api_version or "policy/v1"}"')
        try:
            eviction = _decode(body, _EVICTION_SCHEMA, "", [])
        except DecodeError as exc:
            raise _bad_request(f'Eviction in version "v1" cannot be handled as a Eviction: {exc}') from None
        meta = eviction.get("metadata") or {}
        if meta.get("namespace") and meta["namespace"] != namespace:  # EnsureObjectNamespaceMatchesRequestNamespace
            raise _bad_request("the namespace of the provided object does not match the namespace sent on the request")
        if meta.get("name", "") != name:
            raise _bad_request("name in URL does not match name in Eviction object")
        # propagateDryRun
        options = dict(eviction.get("deleteOptions") or {})
        body_dry = options.get("dryRun") or []
        if body_dry and dry_query and body_dry != dry_query:
            raise ApiError(500, f"Non-matching dry-run options in request and content: {dry_query} and {body_dry}", "InternalError")
        dry_run = "All" in (body_dry or dry_query)
        pod = self._get_pod(namespace, name)
        success = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
        # canIgnorePDB: terminal, Pending or already being deleted
        if pod["status"]["phase"] in ("Succeeded", "Failed", "Pending") or pod["metadata"].get("deletionTimestamp"):
            self._delete_pod(pod, options, dry_run=dry_run)
            return 201, success, dry_run
        # getPodDisruptionBudgets: an empty selector matches no pod here
        labels = pod["metadata"].get("labels") or {}
        pdbs = [
            p for (ns, _), p in sorted(self.pdbs.items())
            if ns == namespace and (sel := p["spec"]["selector"].get("matchLabels") or {}) and all(labels.get(k) == v for k, v in sel.items())
        ]
        if len(pdbs) > 1:
            # returned as an object, not an error: the create handler answers 201 with it
            return 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": EVICTION_MULTIPLE_PDBS, "code": 500}, dry_run
        if pdbs:
            status = self._pdb_status(pdbs[0])
            unready_ok = not self._ready(pod) and status["currentHealthy"] >= status["desiredHealthy"] and status["desiredHealthy"] > 0
            if not unready_ok and status["disruptionsAllowed"] == 0:  # checkAndDecrement
                raise ApiError(
                    429,
                    EVICTION_BLOCKED,
                    "TooManyRequests",
                    {"causes": [{"reason": DISRUPTION_BUDGET_CAUSE, "message": f"The disruption budget {pdbs[0]['metadata']['name']} needs {status['desiredHealthy']} healthy pods and has {status['currentHealthy']} currently"}]},
                )
        self._delete_pod(pod, options, dry_run=dry_run)
        return 201, success, dry_run

    # --- routing -----------------------------------------------------------------------------------
    def route(self, method: str, path: str, query: Mapping[str, str], body: Any, body_error: str | None,
              content_type: str) -> tuple[int, dict, list[tuple[str, str]]] | None:
        """Answer a request for a path this module owns (None for any other path); the caller holds the lock."""
        self._reap()
        dry_run = query.get("dryRun") == "All"

        def needs_body() -> None:
            if body_error is not None:
                raise _bad_request(body_error)

        if _NODES.match(path):
            _only(method, "GET")
            return 200, self._list_nodes(query), []
        if m := _NODE.match(path):
            _only(method, "GET", "PUT", "PATCH")
            name = m.group(1)
            if method == "PATCH":
                return self._patch_node(name, content_type, body, body_error, dry_run=dry_run)
            if method == "PUT":
                needs_body()
                return self._put_node(name, body, dry_run=dry_run)
            if name not in self.nodes:
                raise _not_found("nodes", name)
            return 200, copy.deepcopy(self.nodes[name]), []
        if _PODS_ALL.match(path):
            _only(method, "GET")
            return 200, self._list_pods(None, query), []
        if m := _PODS_NS.match(path):
            _only(method, "GET")
            return 200, self._list_pods(m.group(1), query), []
        if m := _EVICTION.match(path):
            _only(method, "POST")
            needs_body()
            return self._evict(m.group(1), m.group(2), body, query)
        if m := _POD.match(path):
            _only(method, "GET", "DELETE")
            pod = self._get_pod(m.group(1), m.group(2))
            if method == "GET":
                return 200, self._served(pod), []
            needs_body()
            return 200, self._delete_pod(pod, self._delete_options(body, query), dry_run=dry_run), []
        if _PDBS_ALL.match(path):
            _only(method, "GET")
            return 200, self._list_pdbs(None, query), []
        if m := _PDBS_NS.match(path):
            _only(method, "GET")
            return 200, self._list_pdbs(m.group(1), query), []
        if m := _PDB.match(path):
            _only(method, "GET")
            pdb = self.pdbs.get((m.group(1), m.group(2)))
            if pdb is None:
                raise ApiError(404, f'poddisruptionbudgets.policy "{m.group(2)}" not found', "NotFound", {"name": m.group(2), "group": "policy", "kind": "poddisruptionbudgets"})
            return 200, self._served_pdb(pdb), []
        return None


def _only(method: str, *allowed: str) -> None:
    if method not in allowed:
        raise ApiError(405, "the server does not allow this method on the requested resource", "MethodNotAllowed")


__all__ = [
    "DISRUPTION_BUDGET_CAUSE",
    "EVICTION_BLOCKED",
    "EVICTION_MULTIPLE_PDBS",
    "JSON_PATCH",
    "MERGE_PATCH",
    "NODE_TAINT_EFFECTS",
    "OPTIMISTIC_LOCK",
    "PATCH_TYPES",
    "STRATEGIC_MERGE_PATCH",
    "Eviction",
    "JsonPatchError",
    "NodePodResources",
    "NodesAndPods",
    "SmpError",
    "json_merge_patch",
    "json_patch",
    "scaled_value",
    "strategic_merge_patch",
    "validate_node",
    "validate_node_update",
]
