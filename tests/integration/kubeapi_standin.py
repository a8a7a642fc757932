"""A Kubernetes API server stand-in for the DRA plugin's tests (no kube-apiserver runs here).

`KubeApiStandIn` is an HTTP server (http.server, in a thread, like
`kube_peers.ApiServer`) answering exactly the paths the kubernetes client
uses for what the plugin does:

- Nodes, the pods bound to them, their Evictions and PodDisruptionBudgets (`GET /api/v1/nodes`,
  `GET|PUT|PATCH /api/v1/nodes/{name}`, `GET /api/v1/pods`, `GET|DELETE` a namespace's pods,
  `POST .../pods/{name}/eviction`, `GET /apis/policy/v1/.../poddisruptionbudgets`), with the
  kubelet's pod-resources view of a node: their rules and test helpers live in
  kubeapi_nodes_pods.py (`NodesAndPods`); the stand-in's `add_node`, `node`, `label_node`,
  `annotate_node`, `add_pod`, `pod`, `pods`, `set_pod_phase`, `add_controller`, `add_pdb`, `pdb`,
  `evictions`, `eviction_grace_s`, `pod_resources` and `kubelet_pods` hand over to it
- `GET /apis/resource.k8s.io/v1/resourceclaims` (all namespaces),
  `GET .../namespaces/{ns}/resourceclaims`, `GET .../namespaces/{ns}/resourceclaims/{name}`,
  `PUT .../namespaces/{ns}/resourceclaims/{name}/status`
- ResourceSlices (cluster-scoped): `GET/POST /apis/resource.k8s.io/v1/resourceslices`
  (the list honours `fieldSelector` on spec.driver, spec.nodeName, metadata.name and
  `labelSelector`), `GET/PUT/DELETE /apis/resource.k8s.io/v1/resourceslices/{name}`

Objects live in memory with uid, resourceVersion (one counter for all, as
etcd's revision), creationTimestamp and, for slices, metadata.generation. A PUT
with a stale resourceVersion answers 409 Conflict, a POST of a taken name 409
AlreadyExists, an unknown path 404, each with a proper `Status` object. A
bearer token is required (`write_kubeconfig` writes it).

ResourceSlices go through what the API server does for resource.k8s.io/v1 as of
Kubernetes 1.37, in its order: decoding (a wrong JSON type or a malformed
quantity is 400 BadRequest, an unknown field is dropped with a `Warning`
header), the strategy's PrepareForCreate/PrepareForUpdate (generation; fields
of disabled feature gates dropped silently), then validation (422 Invalid,
with a cause per field path). The rules are ported from the upstream sources,
read for this file (paths in kubernetes/kubernetes):

- pkg/apis/resource/validation/validation.go, the 1.37 code: ValidateResourceSlice,
  validateResourceSliceSpec, validateResourcePool, validateDevice (with 1.36's
  numEntriesDeviceAttribute: at most 48 attribute values), validateDeviceAttribute
  (1.36's list values bools/ints/strings/versions), validateQualifiedName (1.37
  refuses more than one slash), validateCIdentifier, validateCounterSet,
  validateDeviceCounterConsumption, validateDeviceTaint, validateDeviceBindingParameters,
  validatePartitionTypeAttribute and validateSkipNodeOperations (1.37),
  haveDeviceTaints/haveConsumesCounters/haveListAttributes (64 devices),
  validateSet/validateSlice/validateMap. Not ported: validateNodeAllocatableResources
  (1.37, alpha; the field is decoded and dropped with its gate off).
- staging/src/k8s.io/api/resource/v1/types.go (kubernetes/api): the limits (128/64
  devices, 32 attributes+capacities, 48 attribute values, 8 counter sets, 32 counters
  per set, 2 consumptions per device of 32 counters each, 4+4 binding conditions,
  64-byte strings, 63/32 domain/identifier lengths, 16 taints, 253-byte pool names)
  and the SkipNodeOperation values.
- pkg/registry/resource/resourceslice/strategy.go: dropDisabledFields (taints,
  partitionable devices, binding conditions, consumable capacity, node allocatable
  resources, list-type attributes, partitionTypeAttribute) and the selectable fields
  (spec.nodeName, spec.driver, metadata.name).
- pkg/features (the versioned specs of kube_features.go): `release_gates(release)` /
  `GATES_BY_RELEASE` give a stock 1.34, 1.35, 1.36 or 1.37 API server's defaults.
  DRAPartitionableDevices, DRADeviceTaints, DRADeviceBindingConditions and
  DRAConsumableCapacity are alpha and off in 1.34 and 1.35 (counter sets,
  consumesCounters, taints and binding conditions dropped without an error), beta
  and on from 1.36 (taints GA in 1.37). `GATES_1_35_DEFAULT` is the 1.35 cluster.
  The stand-in's default is `GATES_ENABLED`: every gate on.

DeviceClass, ResourceClaim and ResourceClaimTemplate rules live beside this file in
kubeapi_claims_validation.py (`validate_manifest`).

The generic parts were re-read too (kubernetes/kubernetes, through the code index; the commits
are those the index held): validation.go at 009801d930e2; staging/.../apimachinery/pkg/api/
validation/objectmeta.go (ValidateObjectMeta*) at 008b3652959c; staging/.../meta/v1/time.go and
time_proto.go (metav1.Time) at 07e7e2611b40 / 0e746bde3e9f; pkg/registry/resource/resourceclaim/
strategy.go (status strategy, dropDeallocatedStatusDevices) at 0021a864a65a. The index holds
pkg/apis/core/validation/validation.go only at an old commit (a7264f95ffc8, before
allowInvalidLabelValueInRequiredNodeAffinity), so ValidateNodeSelector and its requirement
checks follow that file's operator and key messages and, for the label-value and node-name
checks on values, a verbatim copy of the current functions held in the index under the same
path in another repository (which repository the index did not say). The store's refusal of a
create carrying a resourceVersion is staging/.../apiserver/pkg/storage etcd3 store.go Create
(storage.ErrResourceVersionSetOnCreate); which HTTP status the handler gives that error was not
read: 400 here is an assumption. The decode error texts are not re-read.

Device taints (DRADeviceTaints, KEP 5055): with the gate on a device's
`taints` are kept and validated (validateDeviceTaint: key a label name, value
a label value, effect None|NoSchedule|NoExecute, at most 16; a slice with a
tainted device holds 64 devices); with it off they are dropped silently,
unless the stored slice already had taints (dropDisabledDRADeviceTaintsFields).

`check_pool(driver, pool)` is the scheduler's view of a whole pool, which the
API server never checks across slices (staging/.../structured/internal/
incubating/pools_incubating.go and allocator_incubating.go): it lists what
would make a pool incomplete or invalid, or make a device's counter
consumption point at nothing, as messages the tests assert on.

For error tests: `fail_next(n, status)` answers the next n requests with that
status; `hang_next(n, seconds)` holds them that long (or until `stop`) before
answering. `requests` logs every request (with its Content-Type).
"""

from __future__ import annotations

import copy
import json
import random
import re
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

TOKEN = "dra-test-token"
GROUP = "resource.k8s.io"
RESOURCE_V1 = f"{GROUP}/v1"
#: the namespace label admin access needs (KEP-5018; pkg/registry/resource/utils.go)
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"

#: Each release's defaults of the DRA feature gates the resource.k8s.io strategies and validation
#: read: pkg/features (defaultVersionedKubernetesFeatureGates, the versioned specs of
#: kube_features.go as of the 1.37 code): per gate, (first release, default) in order; a release
#: gets the default of the last entry not newer than it. Gates added after 1.37 in the index
#: (DRAResourcePoolStatus, DRAPartitionableDevicesType: alpha, off) are listed off throughout.
_GATE_SPECS: dict[str, tuple[tuple[str, bool], ...]] = {
    "DRAAdminAccess": (("1.32", False), ("1.34", True)),  # GA 1.36
    "DRAConsumableCapacity": (("1.34", False), ("1.36", True)),
    "DRADeviceBindingConditions": (("1.34", False), ("1.36", True)),
    "DRADeviceTaints": (("1.33", False), ("1.36", True)),  # GA 1.37
    "DRADeviceTaintRules": (("1.35", False), ("1.37", True)),
    "DRAExtendedResource": (("1.34", False), ("1.36", True)),  # GA 1.37
    "DRAFractionalCapacityRange": (("1.37", True),),
    "DRAListTypeAttributes": (("1.36", False),),
    "DRANodeAllocatableResources": (("1.36", False),),
    "DRAOptionalNodeOperations": (("1.37", False),),
    "DRAPartitionableDevices": (("1.33", False), ("1.36", True)),
    "DRAPartitionableDevicesType": (("1.37", False),),
    "DRAPrioritizedList": (("1.33", False), ("1.34", True)),
    "DRAResourceClaimDeviceStatus": (("1.32", False), ("1.33", True)),  # GA 1.37
    "DRAResourcePoolStatus": (("1.37", False),),
}
#: the releases whose defaults `release_gates` knows
RELEASES = ("1.34", "1.35", "1.36", "1.37")


def _minor(release: str) -> tuple[int, int]:
    major, minor = release.split(".")[:2]
    return int(major), int(minor)


def release_gates(release: str) -> dict[str, bool]:
    """The DRA gate defaults of a stock API server of `release` ("1.34" .. "1.37")."""
    if release not in RELEASES:
        raise ValueError(f"release {release!r}: one of {', '.join(RELEASES)}")
    out = {}
    for gate, specs in _GATE_SPECS.items():
        out[gate] = False
        for since, default in specs:
            if _minor(since) <= _minor(release):
                out[gate] = default
    return out


#: a stock cluster of each release (pkg/features: see `_GATE_SPECS`)
GATES_BY_RELEASE = {r: release_gates(r) for r in RELEASES}
#: a cluster with every DRA gate this API knows switched on (bcd's MIG counter sets need
#: DRAPartitionableDevices, off by default before 1.36).
GATES_ENABLED = {k: True for k in _GATE_SPECS}
#: a stock 1.35 cluster (partitionable devices, taints, binding conditions, consumable capacity:
#: alpha, off; DRAResourceClaimDeviceStatus beta, on).
GATES_1_35_DEFAULT = GATES_BY_RELEASE["1.35"]

# --- limits: staging/src/k8s.io/api/resource/v1/types.go (1.37) ------------------------------------
RESOURCE_SLICE_MAX_DEVICES = 128
RESOURCE_SLICE_MAX_DEVICES_WITH_TAINTS_OR_CONSUMES_COUNTERS = 64
POOL_NAME_MAX_LENGTH = 253  # validation.DNS1123SubdomainMaxLength
BINDING_CONDITIONS_MAX_SIZE = 4
BINDING_FAILURE_CONDITIONS_MAX_SIZE = 4
RESOURCE_SLICE_MAX_COUNTER_SETS = 8
RESOURCE_SLICE_MAX_COUNTERS_PER_COUNTER_SET = 32
RESOURCE_SLICE_MAX_DEVICE_COUNTER_CONSUMPTIONS_PER_DEVICE = 2
RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_COUNTER_CONSUMPTION = 32
RESOURCE_SLICE_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE = 32
DEVICE_MAX_DOMAIN_LENGTH = 63
DEVICE_MAX_ID_LENGTH = 32
DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH = 64
DEVICE_TAINTS_MAX_LENGTH = 16
#: types.go (1.36+, DRAListTypeAttributes): every scalar and every list item of a device's attributes
RESOURCE_SLICE_MAX_ATTRIBUTE_VALUES_PER_DEVICE = 48
#: types.go SkipNodeOperation values (1.37, DRAOptionalNodeOperations)
SKIP_NODE_OPERATIONS = ("NodePrepareResources", "NodeUnprepareResources", "*")
DRIVER_NAME_MAX_LENGTH = 63  # same as CSI driver names (corevalidation.ValidateCSIDriverName)
#: validation.go: attributeAndCapacityMaxKeyLength (map keys longer than this are truncated in field paths)
ATTRIBUTE_AND_CAPACITY_MAX_KEY_LENGTH = DEVICE_MAX_DOMAIN_LENGTH + 1 + DEVICE_MAX_ID_LENGTH
DNS1123_LABEL_MAX_LENGTH = 63
DNS1123_SUBDOMAIN_MAX_LENGTH = 253
CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS = 10
#: validation.go: validDeviceTaintEffects (1.35 has None next to NoSchedule and NoExecute)
DEVICE_TAINT_EFFECTS = ("NoExecute", "NoSchedule", "None")

# --- name formats: k8s.io/apimachinery/pkg/util/validation ------------------------------------------
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# validation.go: semverRe
_NUM = r"(0|[1-9]\d*)"
_PRE = r"(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
_BUILD = r"[0-9a-zA-Z-]+"
_SEMVER = re.compile(rf"{_NUM}\.{_NUM}\.{_NUM}(-{_PRE}(\.{_PRE})*)?(\+{_BUILD}(\.{_BUILD})*)?")


def is_dns1123_label(value: str) -> list[str]:
    msgs = []
    if len(value) > DNS1123_LABEL_MAX_LENGTH:
        msgs.append(f"must be no more than {DNS1123_LABEL_MAX_LENGTH} characters")
    if not _DNS1123_LABEL.fullmatch(value):
        msgs.append(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start"
            " and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is"
            " '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
        )
    return msgs


def is_dns1123_subdomain(value: str) -> list[str]:
    msgs = []
    if len(value) > DNS1123_SUBDOMAIN_MAX_LENGTH:
        msgs.append(f"must be no more than {DNS1123_SUBDOMAIN_MAX_LENGTH} characters")
    if not _DNS1123_SUBDOMAIN.fullmatch(value):
        msgs.append(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must"
            " start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is"
            " '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )
    return msgs


def is_c_identifier(value: str) -> list[str]:
    if _C_IDENTIFIER.fullmatch(value):
        return []
    return ["a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric"
            " characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is"
            " '[A-Za-z_][A-Za-z0-9_]*')"]


def is_qualified_name(value: str) -> list[str]:
    """metav1validation.ValidateLabelName / validation.IsQualifiedName: [prefix/]name."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
        msgs: list[str] = []
    elif len(parts) == 2:
        prefix, name = parts
        msgs = [] if prefix else ["prefix part must be non-empty"]
        if prefix:
            msgs += [f"prefix part {m}" for m in is_dns1123_subdomain(prefix)]
    else:
        return ["a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end"
                " with an alphanumeric character, with an optional DNS subdomain prefix and '/'"]
    if not name:
        msgs.append("name part must be non-empty")
    elif len(name) > 63:
        msgs.append("name part must be no more than 63 characters")
    if name and not _QUALIFIED_NAME.fullmatch(name):
        msgs.append("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an"
                    " alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is"
                    " '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
    return msgs


def is_label_value(value: str) -> list[str]:
    msgs = []
    if len(value) > 63:
        msgs.append("must be no more than 63 characters")
    if not _LABEL_VALUE.fullmatch(value):
        msgs.append("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and"
                    " must start and end with an alphanumeric character")
    return msgs


# --- quantities: k8s.io/apimachinery/pkg/api/resource (ParseQuantity) -------------------------------
QUANTITY_RE_TEXT = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_QUANTITY = re.compile(r"([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)")
_SUFFIX = {
    "": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal(10) ** 3, "M": Decimal(10) ** 6, "G": Decimal(10) ** 9, "T": Decimal(10) ** 12,
    "P": Decimal(10) ** 15, "E": Decimal(10) ** 18,
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30, "Ti": Decimal(2) ** 40,
    "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
}


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("40Gi", "1.5", 7, "1e3") as a Decimal; ValueError if it is not one.

    Quantity.UnmarshalJSON takes a JSON string or the text of a JSON number; null is zero.
    """
    if value is None:
        return Decimal(0)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError("quantities must be a string or a number")
    text = value.strip() if isinstance(value, str) else json.dumps(value)
    m = _QUANTITY.fullmatch(text)
    if not m or not text:
        raise ValueError(f"quantities must match the regular expression '{QUANTITY_RE_TEXT}'")
    number, suffix = m.groups()
    if number.count(".") > 1 or not any(c.isdigit() for c in number):
        raise ValueError(f"quantities must match the regular expression '{QUANTITY_RE_TEXT}'")
    try:
        base = Decimal(number)
    except InvalidOperation:
        raise ValueError(f"quantities must match the regular expression '{QUANTITY_RE_TEXT}'") from None
    if suffix in _SUFFIX:
        return base * _SUFFIX[suffix]
    exp = re.fullmatch(r"[eE]([-+]?[0-9]+)", suffix)
    if exp:
        return base * (Decimal(10) ** int(exp.group(1)))
    raise ValueError("unable to parse quantity's suffix")


# --- field errors: k8s.io/apimachinery/pkg/util/validation/field -------------------------------------
@dataclass(frozen=True)
class FieldError:
    #: the Status cause reason (FieldValueInvalid, FieldValueRequired, ...)
    reason: str
    field: str
    #: the error body without the field ("Invalid value: ...", "Required value", ...)
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, sort_keys=True) if value is not None else "null"


class Errors(list):
    """A field.ErrorList."""

    def required(self, path: str, detail: str = "") -> None:
        self.append(FieldError("FieldValueRequired", path, "Required value" + (f": {detail}" if detail else "")))

    def invalid(self, path: str, value: Any, detail: str) -> None:
        self.append(FieldError("FieldValueInvalid", path, f"Invalid value: {_fmt(value)}: {detail}"))

    def too_long(self, path: str, limit: int) -> None:
        self.append(FieldError("FieldValueTooLong", path, f"Too long: may not be more than {limit} bytes"))

    def too_many(self, path: str, actual: int, limit: int) -> None:
        self.append(FieldError("FieldValueTooMany", path, f"Too many: {actual}: must have at most {limit} items"))

    def duplicate(self, path: str, value: Any) -> None:
        self.append(FieldError("FieldValueDuplicate", path, f"Duplicate value: {_fmt(value)}"))

    def forbidden(self, path: str, detail: str) -> None:
        self.append(FieldError("FieldValueForbidden", path, f"Forbidden: {detail}"))

    def not_supported(self, path: str, value: Any, supported: Sequence[str]) -> None:
        values = ", ".join(json.dumps(s) for s in supported)
        self.append(FieldError("FieldValueNotSupported", path, f"Unsupported value: {_fmt(value)}: supported values: {values}"))


def _truncate(key: str, max_len: int) -> str:
    # validation.go: truncateIfTooLong
    max_len = max(max_len, 16)
    if len(key) <= max_len:
        return key
    remaining = max_len - 3
    return key[: (remaining + 1) // 2] + "..." + key[len(key) - remaining // 2 :]


# --- decoding (400 BadRequest; unknown fields dropped with a warning) ---------------------------------
class DecodeError(Exception):
    pass


_STR, _INT, _BOOL, _QTY, _ANY, _TIME = "string", "int64", "bool", "quantity", "any", "time"
#: metav1.Time (staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/time.go UnmarshalJSON / MarshalJSON,
#: time_proto.go Unmarshal): UnmarshalJSON takes null or a JSON string time.Parse(time.RFC3339)
#: reads (Go accepts a fraction there); MarshalJSON writes t.UTC() in RFC 3339 (whole seconds), and
#: the protobuf storage drops nanos (ProtoTime leaves Nanos out), so what is read back is
#: `YYYY-MM-DDTHH:MM:SSZ` whatever offset or fraction was sent.
_RFC3339 = re.compile(r"(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(\.\d+)?(Z|[+-]\d{2}:\d{2})")
RFC3339_LAYOUT = "2006-01-02T15:04:05Z07:00"


def parse_time(value: Any) -> str:
    """A metav1.Time as the API server gives it back (UTC, whole seconds); ValueError if it is not one."""
    if not isinstance(value, str):
        raise ValueError(f"json: cannot unmarshal {_json_kind(value)} into Go value of type string")
    m = _RFC3339.fullmatch(value)
    try:
        if not m:
            raise ValueError
        zone = m.group(8)
        text = value[: m.start(7)] if m.group(7) else value[: m.start(8)]
        at = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").replace(
            tzinfo=timezone.utc if zone == "Z" else datetime.strptime(zone.replace(":", ""), "%z").tzinfo
        )
    except ValueError:
        raise ValueError(f'parsing time "{value}" as "{RFC3339_LAYOUT}": cannot parse "{value}" as "{RFC3339_LAYOUT}"') from None
    return at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _obj(**fields: Any) -> tuple:
    return ("obj", fields)


def _list(item: Any) -> tuple:
    return ("list", item)


def _map(item: Any) -> tuple:
    return ("map", item)


_REQ = _obj(key=_STR, operator=_STR, values=_list(_STR))
_NODE_SELECTOR = _obj(nodeSelectorTerms=_list(_obj(matchExpressions=_list(_REQ), matchFields=_list(_REQ))))
_COUNTER = _obj(value=_QTY)
_OWNER_REF = _obj(apiVersion=_STR, kind=_STR, name=_STR, uid=_STR, controller=_BOOL, blockOwnerDeletion=_BOOL)
_META = _obj(
    name=_STR, generateName=_STR, namespace=_STR, uid=_STR, resourceVersion=_STR, generation=_INT,
    creationTimestamp=_ANY, deletionTimestamp=_ANY, deletionGracePeriodSeconds=_INT, selfLink=_STR,
    labels=_map(_STR), annotations=_map(_STR), ownerReferences=_list(_OWNER_REF), finalizers=_list(_STR),
    managedFields=_ANY,
)
_DEVICE = _obj(
    name=_STR,
    attributes=_map(_obj(int=_INT, bool=_BOOL, string=_STR, version=_STR, ints=_list(_INT), bools=_list(_BOOL), strings=_list(_STR), versions=_list(_STR))),
    capacity=_map(_obj(value=_QTY, requestPolicy=_obj(default=_QTY, validValues=_list(_QTY), validRange=_obj(min=_QTY, max=_QTY, step=_QTY)))),
    consumesCounters=_list(_obj(counterSet=_STR, counters=_map(_COUNTER))),
    nodeName=_STR,
    nodeSelector=_NODE_SELECTOR,
    allNodes=_BOOL,
    taints=_list(_obj(key=_STR, value=_STR, effect=_STR, timeAdded=_TIME)),
    bindsToNode=_BOOL,
    bindingConditions=_list(_STR),
    bindingFailureConditions=_list(_STR),
    allowMultipleAllocations=_BOOL,
    # 1.37 (DRANodeAllocatableResources): resource name -> {mapping, overhead}; its rules are not ported
    nodeAllocatableResources=_map(_ANY),
)
_SLICE_SCHEMA = _obj(
    apiVersion=_STR,
    kind=_STR,
    metadata=_META,
    spec=_obj(
        driver=_STR,
        pool=_obj(name=_STR, generation=_INT, resourceSliceCount=_INT),
        nodeName=_STR,
        nodeSelector=_NODE_SELECTOR,
        allNodes=_BOOL,
        devices=_list(_DEVICE),
        perDeviceNodeSelection=_BOOL,
        sharedCounters=_list(_obj(name=_STR, counters=_map(_COUNTER))),
        partitionTypeAttribute=_STR,
        skipNodeOperations=_list(_STR),
    ),
)
_GO_TYPES = {_STR: "string", _INT: "int64", _BOOL: "bool"}


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _zero(schema: Any) -> Any:
    """Go's zero value of a schema (what a JSON null list element or map value decodes to)."""
    if isinstance(schema, tuple):
        return [] if schema[0] == "list" else {}
    return {_STR: "", _INT: 0, _BOOL: False}.get(schema)


def _decode(value: Any, schema: Any, path: str, warnings: list[str]) -> Any:
    """Type-check `value` against `schema` like encoding/json into the Go types; nulls are absent."""
    if schema == _ANY:
        return value
    if schema == _QTY:
        try:
            parse_quantity(value)
        except ValueError as exc:
            raise DecodeError(str(exc)) from None
        return value if isinstance(value, str) else json.dumps(value)  # a Quantity comes back as a string
    if schema == _TIME:
        try:
            return parse_time(value)
        except ValueError as exc:
            raise DecodeError(str(exc)) from None
    if isinstance(schema, str):
        ok = {
            _STR: isinstance(value, str),
            _BOOL: isinstance(value, bool),
            _INT: isinstance(value, int) and not isinstance(value, bool),
        }[schema]
        if not ok:
            raise DecodeError(f"json: cannot unmarshal {_json_kind(value)} into Go struct field {path} of type {_GO_TYPES[schema]}")
        return value
    kind, inner = schema
    if kind == "list":
        if not isinstance(value, list):
            raise DecodeError(f"json: cannot unmarshal {_json_kind(value)} into Go struct field {path} of type []")
        return [_zero(inner) if v is None else _decode(v, inner, path, warnings) for v in value]
    if not isinstance(value, dict):
        raise DecodeError(f"json: cannot unmarshal {_json_kind(value)} into Go struct field {path} of type object")
    if kind == "map":
        return {k: _zero(inner) if v is None else _decode(v, inner, path, warnings) for k, v in value.items()}
    out = {}
    for k, v in value.items():
        sub = f"{path}.{k}" if path else k
        if k not in inner:
            warnings.append(f'unknown field "{sub}"')
            continue
        if v is None:
            continue
        out[k] = _decode(v, inner[k], sub, warnings)
    return out


def decode_resource_slice(body: Any) -> tuple[dict, list[str]]:
    """The body as the API server would hold it after decoding, and the unknown-field warnings."""
    warnings: list[str] = []
    if not isinstance(body, dict):
        raise DecodeError("couldn't get version/kind; json parse error")
    api_version, kind = body.get("apiVersion"), body.get("kind")
    if api_version not in (None, RESOURCE_V1):
        raise DecodeError(f"the API version in the data ({api_version}) does not match the expected API version ({RESOURCE_V1})")
    if kind not in (None, "ResourceSlice"):
        raise DecodeError(f"the kind in the data ({kind}) does not match the expected kind (ResourceSlice)")
    obj = _decode(body, _SLICE_SCHEMA, "", warnings)
    obj["apiVersion"], obj["kind"] = RESOURCE_V1, "ResourceSlice"
    obj.setdefault("metadata", {})
    obj.setdefault("spec", {})
    return obj, warnings


# --- the strategy: pkg/registry/resource/resourceslice/strategy.go -----------------------------------
def _partitionable_in_use(spec: dict) -> bool:
    if spec.get("sharedCounters") or "perDeviceNodeSelection" in spec:
        return True
    return any(d.get("consumesCounters") or any(k in d for k in ("nodeName", "nodeSelector", "allNodes")) for d in spec.get("devices") or ())


_LIST_VALUES = ("bools", "ints", "strings", "versions")


def drop_disabled_fields(spec: dict, old_spec: dict | None, gates: dict[str, bool]) -> None:
    """dropDisabledFields: fields of a disabled gate go, unless the old object already used them."""
    devices = spec.get("devices") or []
    old_devices = (old_spec or {}).get("devices") or []
    if not gates.get("DRADeviceTaints") and not any(d.get("taints") for d in old_devices):
        for d in devices:
            d.pop("taints", None)
    if not gates.get("DRAPartitionableDevices") and not (old_spec is not None and _partitionable_in_use(old_spec)):
        spec.pop("sharedCounters", None)
        spec.pop("perDeviceNodeSelection", None)
        for d in devices:
            for k in ("consumesCounters", "nodeName", "nodeSelector", "allNodes"):
                d.pop(k, None)
    binding_keys = ("bindingConditions", "bindingFailureConditions", "bindsToNode")
    binding_on = gates.get("DRADeviceBindingConditions") and gates.get("DRAResourceClaimDeviceStatus")
    if not binding_on and not any(d.get("bindingConditions") or d.get("bindingFailureConditions") or "bindsToNode" in d for d in old_devices):
        for d in devices:
            for k in binding_keys:
                d.pop(k, None)
    # dropDisabledDRANodeAllocatableResourcesFields (1.36+)
    if not gates.get("DRANodeAllocatableResources") and not any(d.get("nodeAllocatableResources") for d in old_devices):
        for d in devices:
            d.pop("nodeAllocatableResources", None)
    # dropDisableDRAListTypeAttributesFields (1.36+): the list values go, the scalars stay
    if not gates.get("DRAListTypeAttributes") and not any(
        any(k in a for k in _LIST_VALUES) for d in old_devices for a in (d.get("attributes") or {}).values()
    ):
        for d in devices:
            for a in (d.get("attributes") or {}).values():
                for k in _LIST_VALUES:
                    a.pop(k, None)
    # partitionTypeAttribute (1.37 types.go: +k8s:ifEnabled(DRAPartitionableDevicesType); the
    # strategy in the index drops it by DRAResourcePoolStatus): dropped unless either gate is on
    if not (gates.get("DRAPartitionableDevicesType") or gates.get("DRAResourcePoolStatus")) and not (old_spec or {}).get("partitionTypeAttribute"):
        spec.pop("partitionTypeAttribute", None)
    # skipNodeOperations (1.37, DRAOptionalNodeOperations; the drop is assumed from the gate, the
    # strategy read for this file predates the field)
    if not gates.get("DRAOptionalNodeOperations") and not (old_spec or {}).get("skipNodeOperations"):
        spec.pop("skipNodeOperations", None)
    consumable_in_use = any("allowMultipleAllocations" in d or any("requestPolicy" in c for c in (d.get("capacity") or {}).values()) for d in old_devices)
    if not gates.get("DRAConsumableCapacity") and not consumable_in_use:
        for d in devices:
            d.pop("allowMultipleAllocations", None)
            for c in (d.get("capacity") or {}).values():
                c.pop("requestPolicy", None)


# --- validation: pkg/apis/resource/validation/validation.go (1.37) -----------------------------------
def _validate_driver_name(name: str, path: str, errs: Errors) -> None:
    # corevalidation.ValidateCSIDriverName: required, <= 63, a DNS subdomain once lowercased
    # (upper case is accepted with a warning: strategy.go WarningsOnCreate)
    if not name:
        errs.required(path)
    if len(name) > DRIVER_NAME_MAX_LENGTH:
        errs.too_long(path, DRIVER_NAME_MAX_LENGTH)
    for msg in is_dns1123_subdomain(name.lower()):
        errs.invalid(path, name, msg)


def _validate_pool_name(name: str, path: str, errs: Errors) -> None:
    # validatePoolName: required; <= 253; each "/"-separated part a DNS subdomain
    if not name:
        errs.required(path)
        return
    if len(name) > POOL_NAME_MAX_LENGTH:
        errs.too_long(path, POOL_NAME_MAX_LENGTH)
    for part in name.split("/"):
        for msg in is_dns1123_subdomain(part):
            errs.invalid(path, part, msg)


def _validate_dns_label(value: str, path: str, errs: Errors) -> None:
    # corevalidation.ValidateDNS1123Label (device names, counter set and counter names)
    for msg in is_dns1123_label(value):
        errs.invalid(path, value, msg)


def _validate_node_name(name: str, path: str, errs: Errors) -> None:
    # validateNodeName: corevalidation.ValidateNodeName = a DNS subdomain
    for msg in is_dns1123_subdomain(name):
        errs.invalid(path, name, msg)


def _validate_label_name(value: str, path: str, errs: Errors) -> None:
    # metav1validation.ValidateLabelName
    for msg in is_qualified_name(value):
        errs.invalid(path, value, msg)


def _validate_c_identifier(value: str, path: str, errs: Errors) -> None:
    # validateCIdentifier: <= DeviceMaxIDLength (32), content.IsCIdentifier
    if len(value) > DEVICE_MAX_ID_LENGTH:
        errs.too_long(path, DEVICE_MAX_ID_LENGTH)
    for msg in is_c_identifier(value):
        errs.invalid(path, value, msg)


def _validate_qualified_name(name: str, path: str, errs: Errors) -> None:
    # validateQualifiedName: a C identifier, or <domain>/<C identifier> with the domain a driver
    # name. 1.37 refuses three or more parts (1.35 let "a/b/c" pass unchecked).
    parts = name.split("/")
    if len(parts) > 2:
        errs.invalid(path, name, "must not contain more than one slash")
        return
    if len(parts) == 1:
        _validate_c_identifier(parts[0], path, errs)
    elif len(parts) == 2:
        if not parts[0]:
            errs.invalid(path, "", "the domain must not be empty")
        else:
            _validate_driver_name(parts[0], path, errs)
        if not parts[1]:
            errs.invalid(path, "", "the name must not be empty")
        else:
            _validate_c_identifier(parts[1], path, errs)


def _validate_node_selector(selector: dict, path: str, errs: Errors) -> None:
    # corevalidation.ValidateNodeSelector(sel, allowInvalidLabelValueInRequiredNodeAffinity=false):
    # no term is Required and ends there; each term's matchExpressions go through
    # ValidateNodeSelectorRequirement (an unknown operator is Invalid "not a valid selector
    # operator"; the key a label name; each value a label value), its matchFields through
    # ValidateNodeFieldSelectorRequirement (In/NotIn with exactly one value; the key metadata.name;
    # each value a node name, i.e. a DNS subdomain).
    terms_path = f"{path}.nodeSelectorTerms"
    terms = selector.get("nodeSelectorTerms") or []
    if not terms:
        errs.required(terms_path, "must have at least one node selector term")
        return
    for i, term in enumerate(terms):
        for j, req in enumerate(term.get("matchExpressions") or []):
            rp = f"{terms_path}[{i}].matchExpressions[{j}]"
            op, values = req.get("operator", ""), req.get("values") or []
            if op in ("In", "NotIn"):
                if not values:
                    errs.required(f"{rp}.values", "must be specified when `operator` is 'In' or 'NotIn'")
            elif op in ("Exists", "DoesNotExist"):
                if values:
                    errs.forbidden(f"{rp}.values", "may not be specified when `operator` is 'Exists' or 'DoesNotExist'")
            elif op in ("Gt", "Lt"):
                if len(values) != 1:
                    errs.required(f"{rp}.values", "must be specified single value when `operator` is 'Lt' or 'Gt'")
            else:
                errs.invalid(f"{rp}.operator", op, "not a valid selector operator")
            _validate_label_name(req.get("key", ""), f"{rp}.key", errs)
            for k, value in enumerate(values):
                for msg in is_label_value(value):
                    errs.invalid(f"{rp}.values[{k}]", value, msg)
        for j, req in enumerate(term.get("matchFields") or []):
            rp = f"{terms_path}[{i}].matchFields[{j}]"
            op, values = req.get("operator", ""), req.get("values") or []
            if op in ("In", "NotIn"):
                if len(values) != 1:
                    errs.required(f"{rp}.values", "must be only one value when `operator` is 'In' or 'NotIn' for node field selector")
            else:
                errs.invalid(f"{rp}.operator", op, "not a valid selector operator")
            if req.get("key") != "metadata.name":
                errs.invalid(f"{rp}.key", req.get("key", ""), "not a valid field selector key")
            else:
                for k, value in enumerate(values):
                    for msg in is_dns1123_subdomain(value):
                        errs.invalid(f"{rp}.values[{k}]", value, msg)


def _validate_counters(counters: dict, limit: int, path: str, errs: Errors) -> None:
    # validateMap(counters, limit, DNS1123LabelMaxLength, validateCounterName, validateDeviceCounter):
    # too many short-circuits; each key a DNS label (at the key's path); any parsed quantity is valid.
    if len(counters) > limit:
        errs.too_many(path, len(counters), limit)
        return
    for key in sorted(counters):
        _validate_dns_label(key, f"{path}[{_truncate(key, DNS1123_LABEL_MAX_LENGTH)}]", errs)


def _validate_counter_set(counter_set: dict, path: str, errs: Errors) -> None:
    # validateCounterSet: name required, a DNS label; counters required, <= 32
    name = counter_set.get("name", "")
    if not name:
        errs.required(f"{path}.name")
    else:
        _validate_dns_label(name, f"{path}.name", errs)
    counters = counter_set.get("counters") or {}
    if not counters:
        errs.required(f"{path}.counters")
    else:
        _validate_counters(counters, RESOURCE_SLICE_MAX_COUNTERS_PER_COUNTER_SET, f"{path}.counters", errs)


def _validate_counter_consumption(consumption: dict, path: str, errs: Errors) -> None:
    # validateDeviceCounterConsumption: counterSet required, a DNS label; counters required, <= 32
    counter_set = consumption.get("counterSet", "")
    if not counter_set:
        errs.required(f"{path}.counterSet")
    else:
        _validate_dns_label(counter_set, f"{path}.counterSet", errs)
    counters = consumption.get("counters") or {}
    if not counters:
        errs.required(f"{path}.counters")
    else:
        _validate_counters(counters, RESOURCE_SLICE_MAX_COUNTERS_PER_DEVICE_COUNTER_CONSUMPTION, f"{path}.counters", errs)


def _validate_set(items: list, limit: int, key: Any, validate: Any, path: str, errs: Errors) -> None:
    # validateSet: too many short-circuits (DOS protection); each item; then duplicates by key
    if len(items) > limit:
        errs.too_many(path, len(items), limit)
        return
    for i, item in enumerate(items):
        validate(item, f"{path}[{i}]", errs)
    seen: set = set()
    for i, item in enumerate(items):
        k = key(item)
        if k in seen:
            errs.duplicate(f"{path}[{i}]", k)
        seen.add(k)


def _validate_attribute(attr: dict, path: str, errs: Errors) -> None:
    # validateDeviceAttribute: exactly one of int/bool/string/version; string and version <= 64;
    # version a semver 2.0.0 string
    n = 0
    for k in ("bool", "int"):
        n += k in attr
    if "string" in attr:
        n += 1
        if len(attr["string"].encode()) > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH:
            errs.too_long(f"{path}.string", DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH)
    if "version" in attr:
        n += 1
        if not _SEMVER.fullmatch(attr["version"]):
            errs.invalid(f"{path}.version", attr["version"], "must be a string compatible with semver.org spec 2.0.0")
        if len(attr["version"].encode()) > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH:
            errs.too_long(f"{path}.version", DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH)
    # 1.36+ list values (DRAListTypeAttributes): each present list non-empty; strings <= 64 bytes,
    # versions semver
    for k in _LIST_VALUES:
        if k not in attr:
            continue
        n += 1
        if not attr[k]:
            errs.invalid(f"{path}.{k}", attr[k], "must not be empty if specified")
        for i, item in enumerate(attr[k]):
            if k == "strings" and len(item.encode()) > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH:
                errs.too_long(f"{path}.strings[{i}]", DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH)
            if k == "versions":
                if not _SEMVER.fullmatch(item):
                    errs.invalid(f"{path}.versions[{i}]", item, "must be a string compatible with semver.org spec 2.0.0")
                if len(item.encode()) > DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH:
                    errs.too_long(f"{path}.versions[{i}]", DEVICE_ATTRIBUTE_MAX_VALUE_LENGTH)
    if n == 0:
        errs.invalid(path, "", "exactly one value must be specified")
    elif n > 1:
        errs.invalid(path, attr, "exactly one value must be specified")


def _validate_request_policy(capacity: dict, path: str, errs: Errors) -> None:
    # validateRequestPolicy / validateValidRequestValues / validateRequestPolicyRange, in part: the
    # exclusive choice, the required default, sorted options (<= 10) within the capacity, and the
    # range's bounds. bcd publishes no consumable capacity.
    policy = capacity["requestPolicy"]
    maximum = parse_quantity(capacity.get("value"))
    values, rng = policy.get("validValues") or [], policy.get("validRange")
    if values and rng is not None:
        errs.forbidden(path, 'exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time')
        return
    if values:
        if "default" not in policy:
            errs.required(f"{path}.default", "required when validValues is defined")
            return
        nums = [parse_quantity(v) for v in values]
        for i in range(len(nums) - 1):
            if nums[i] > nums[i + 1]:
                errs.invalid(f"{path}.validValues[{i + 1}]", values[i + 1], "values must be sorted in ascending order")
        if len(nums) > CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS:
            errs.too_many(f"{path}.validValues", len(nums), CAPACITY_REQUEST_POLICY_DISCRETE_MAX_OPTIONS)
        for i, v in enumerate(nums):
            if v > maximum:
                errs.invalid(f"{path}.validValues[{i}]", values[i], f"option is larger than capacity value: {capacity.get('value')}")
        if parse_quantity(policy["default"]) not in nums:
            errs.invalid(f"{path}.validValues", policy["default"], "default value is not valid according to the requestPolicy")
    elif rng is not None:
        if "default" not in policy:
            errs.required(f"{path}.default", "required when validRange is defined")
            return
        if "min" not in rng:
            errs.required(f"{path}.validRange.min", "required when validRange is defined")
            return
        lo, default = parse_quantity(rng["min"]), parse_quantity(policy["default"])
        if lo > maximum:
            errs.invalid(f"{path}.validRange.min", rng["min"], f"min is larger than capacity value: {capacity.get('value')}")
        if default < lo:
            errs.invalid(f"{path}.validRange.min", policy["default"], f"default is less than min: {rng['min']}")
        if "max" in rng:
            hi = parse_quantity(rng["max"])
            if lo > hi:
                errs.invalid(f"{path}.validRange.max", rng["min"], f"min is larger than max: {rng['max']}")
            if hi > maximum:
                errs.invalid(f"{path}.validRange.max", rng["max"], f"max is larger than capacity value: {capacity.get('value')}")


def _validate_binding(device: dict, path: str, errs: Errors) -> None:
    # validateDeviceBindingParameters: <= 4 each (too many short-circuits that list), each a label
    # name; no duplicates; no overlap; either both lists or neither. Upstream does NOT require
    # bindsToNode with binding conditions (the 1.35 source has no such rule), so neither does this.
    conditions = device.get("bindingConditions") or []
    failures = device.get("bindingFailureConditions") or []
    for key, items, limit in (
        ("bindingConditions", conditions, BINDING_CONDITIONS_MAX_SIZE),
        ("bindingFailureConditions", failures, BINDING_FAILURE_CONDITIONS_MAX_SIZE),
    ):
        if len(items) > limit:
            errs.too_many(f"{path}.{key}", len(items), limit)
        else:
            for i, c in enumerate(items):
                _validate_label_name(c, f"{path}.{key}[{i}]", errs)
    seen: set[str] = set()
    for i, c in enumerate(conditions):
        if c in seen:
            errs.duplicate(f"{path}.bindingConditions[{i}]", c)
        seen.add(c)
    seen_failures: set[str] = set()
    for i, c in enumerate(failures):
        if c in seen_failures:
            errs.duplicate(f"{path}.bindingFailureConditions[{i}]", c)
        seen_failures.add(c)
        if c in conditions:
            errs.invalid(f"{path}.bindingFailureConditions[{i}]", c, "bindingFailureConditions must not overlap with bindingConditions")
    if not conditions and failures:
        errs.invalid(f"{path}.bindingConditions", conditions, "bindingConditions are required to use bindingFailureConditions")
    if not failures and conditions:
        errs.invalid(f"{path}.bindingFailureConditions", failures, "bindingFailureConditions are required to use bindingConditions")


def _validate_taint(taint: dict, path: str, errs: Errors) -> None:
    # validateDeviceTaint: key a label name; value a label value; effect required and known
    _validate_label_name(taint.get("key", ""), f"{path}.key", errs)
    if taint.get("value"):
        for msg in is_label_value(taint["value"]):
            errs.invalid(f"{path}.value", taint["value"], msg)
    effect = taint.get("effect", "")
    if not effect:
        errs.required(f"{path}.effect")
    elif effect not in DEVICE_TAINT_EFFECTS:
        errs.not_supported(f"{path}.effect", effect, DEVICE_TAINT_EFFECTS)


def _validate_device(device: dict, old_device: dict | None, path: str, per_device_node_selection: bool | None, errs: Errors) -> None:
    # validateDevice
    _validate_dns_label(device.get("name", ""), f"{path}.name", errs)
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    n = len(attributes) + len(capacity)
    if n > RESOURCE_SLICE_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE:
        errs.invalid(path, n, f"the total number of attributes and capacities must not exceed {RESOURCE_SLICE_MAX_ATTRIBUTES_AND_CAPACITIES_PER_DEVICE}")
    # numEntriesDeviceAttribute (1.36+): a scalar counts 1, a list its items
    values = sum(max(1, sum(len(a.get(k) or ()) for k in _LIST_VALUES)) for a in attributes.values())
    if values > RESOURCE_SLICE_MAX_ATTRIBUTE_VALUES_PER_DEVICE:
        errs.invalid(path, values, f"the total number of attribute values must not exceed {RESOURCE_SLICE_MAX_ATTRIBUTE_VALUES_PER_DEVICE}")
    for key in sorted(attributes):
        kp = f"{path}.attributes[{_truncate(key, ATTRIBUTE_AND_CAPACITY_MAX_KEY_LENGTH)}]"
        _validate_qualified_name(key, kp, errs)
        _validate_attribute(attributes[key], kp, errs)
    multi = device.get("allowMultipleAllocations") is True
    for key in sorted(capacity):
        kp = f"{path}.capacity[{_truncate(key, ATTRIBUTE_AND_CAPACITY_MAX_KEY_LENGTH)}]"
        _validate_qualified_name(key, kp, errs)
        if "requestPolicy" in capacity[key]:
            if multi:
                _validate_request_policy(capacity[key], f"{kp}.requestPolicy", errs)
            else:
                errs.forbidden(f"{kp}.requestPolicy", "allowMultipleAllocations must be true")
    taints = device.get("taints") or []
    if old_device is None or old_device.get("taints") != device.get("taints"):
        if len(taints) > DEVICE_TAINTS_MAX_LENGTH:
            errs.too_many(f"{path}.taints", len(taints), DEVICE_TAINTS_MAX_LENGTH)
        else:
            for i, t in enumerate(taints):
                _validate_taint(t, f"{path}.taints[{i}]", errs)
    _validate_set(
        device.get("consumesCounters") or [],
        RESOURCE_SLICE_MAX_DEVICE_COUNTER_CONSUMPTIONS_PER_DEVICE,
        lambda c: c.get("counterSet", ""),
        _validate_counter_consumption,
        f"{path}.consumesCounters",
        errs,
    )
    if per_device_node_selection:
        set_fields = []
        if "nodeName" in device:
            if device["nodeName"]:
                set_fields.append("`nodeName`")
                _validate_node_name(device["nodeName"], f"{path}.nodeName", errs)
            else:
                errs.invalid(f"{path}.nodeName", "", "must not be empty")
        if "nodeSelector" in device:
            set_fields.append("`nodeSelector`")
            _validate_node_selector(device["nodeSelector"], f"{path}.nodeSelector", errs)
        if "allNodes" in device:
            if device["allNodes"]:
                set_fields.append("`allNodes`")
            else:
                errs.invalid(f"{path}.allNodes", False, "must be either unset or set to true")
        detail = ("exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection`"
                  " is set to true in the ResourceSlice spec")
        if not set_fields:
            errs.required(path, detail)
        elif len(set_fields) > 1:
            errs.invalid(path, "{" + ", ".join(set_fields) + "}", detail)
    elif any(k in device for k in ("nodeName", "nodeSelector", "allNodes")):
        errs.invalid(path, None, "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection`"
                                 " is set to true in the ResourceSlice spec")
    _validate_binding(device, path, errs)


#: apimachinery api/validation/objectmeta.go: TotalAnnotationSizeLimitB
TOTAL_ANNOTATION_SIZE_LIMIT = 256 * (1 << 10)


def _validate_object_meta(meta: dict, errs: Errors, namespaced: bool = False) -> None:
    # apimachinery api/validation/objectmeta.go ValidateObjectMetaAccessor(WithOpts) and
    # validateObjectMetaAccessorWithOptsCommon, on a create (a generateName is already turned into
    # a name here, so only the name is checked, as a DNS subdomain): the namespace required on a
    # namespaced kind (the API server sets it from the URL when the body has none, so only a
    # present one is checked, as a DNS label) and forbidden on a cluster-scoped one; labels
    # (ValidateLabels); annotation keys lower-cased qualified names, 256 KiB in all
    # (ValidateAnnotations); owner references (validateOwnerReference, ValidateOwnerReferences);
    # finalizers qualified names (ValidateFinalizers). Not ported: BannedOwners, the
    # orphan/foregroundDeletion finalizer clash, generation >= 0, managedFields.
    name = meta.get("name", "")
    if not name:
        errs.required("metadata.name", "name or generateName is required")
    else:
        for msg in is_dns1123_subdomain(name):
            errs.invalid("metadata.name", name, msg)
    namespace = meta.get("namespace", "")
    if namespaced:
        for msg in is_dns1123_label(namespace) if namespace else ():
            errs.invalid("metadata.namespace", namespace, msg)
    elif namespace:
        errs.forbidden("metadata.namespace", "not allowed on this type")
    for key in sorted(meta.get("labels") or {}):
        _validate_label_name(key, "metadata.labels", errs)
        for msg in is_label_value(meta["labels"][key]):
            errs.invalid("metadata.labels", meta["labels"][key], msg)
    annotations = meta.get("annotations") or {}
    for key in sorted(annotations):
        for msg in is_qualified_name(key.lower()):
            errs.invalid("metadata.annotations", key, msg)
    if sum(len(k.encode()) + len(str(v).encode()) for k, v in annotations.items()) > TOTAL_ANNOTATION_SIZE_LIMIT:
        errs.too_long("metadata.annotations", TOTAL_ANNOTATION_SIZE_LIMIT)
    first_controller = ""
    refs = meta.get("ownerReferences") or []
    for ref in refs:
        rp = "metadata.ownerReferences"
        api_version = ref.get("apiVersion", "")
        # schema.FromAPIVersionAndKind: the version is what follows the last slash
        if not api_version.rpartition("/")[2]:
            errs.invalid(f"{rp}.apiVersion", api_version, "version must not be empty")
        for key in ("kind", "name", "uid"):
            if not ref.get(key):
                errs.invalid(f"{rp}.{key}", ref.get(key, ""), "must not be empty")
        if ref.get("controller") is True:
            current = f"{ref.get('kind', '')}/{ref.get('name', '')}"
            if first_controller:
                errs.invalid(rp, refs, f'Only one reference can have Controller set to true. Found "true" in references for {first_controller} and {current}')
            else:
                first_controller = current
    finalizers = meta.get("finalizers") or []
    for f in finalizers:
        for msg in is_qualified_name(f):
            errs.invalid("metadata.finalizers", f, msg)


def _device_key(d: dict) -> tuple:
    # structured.MakeSharedDeviceID(MakeDeviceID(driver, pool, device), shareID)
    return (d.get("driver", ""), d.get("pool", ""), d.get("device", ""), d.get("shareID"))


def _request_name_ok(name: str, spec: dict) -> bool:
    # requestNames.Has (gatherRequestNames over spec.devices.requests)
    parts = name.split("/")
    if len(parts) > 2:
        return False
    for r in (spec.get("devices") or {}).get("requests") or []:
        if r.get("name", "") == parts[0]:
            subs = {x.get("name", "") for x in r.get("firstAvailable") or []}
            return len(parts) == 1 or parts[1] in subs
    return False


def validate_claim_status_update(status: dict, old_status: dict, spec: dict, deleted: bool, gates: dict[str, bool]) -> list[FieldError]:
    """A ResourceClaim status update as the API server sees it (`status` is changed in place by the drop).

    pkg/registry/resource/resourceclaim/strategy.go dropDeallocatedStatusDevices (with
    DRAResourceClaimDeviceStatus on or status.devices already in use: entries whose
    driver/pool/device the old allocation had and the new one has not are dropped), then
    pkg/apis/resource/validation/validation.go validateResourceClaimStatusUpdate: reservedFor a
    set by uid of references with resource, name and uid; status.devices a set by shared device
    id, each entry's driver, pool and device names valid and an allocated device of the claim
    (validateDeviceStatus); reservedFor only with an allocation, and no new entries while the
    claim is being deleted; an allocation, once made, immutable (it may be removed); a new one
    checked by validateAllocationResult (here its results: request names of this claim, driver,
    pool and device names). Not ported: the size limit of reservedFor, the conditions, data and
    networkData of status.devices, and the allocation's config, node selector, binding
    conditions, tolerations, shareID and skipNodeOperations.
    """
    errs = Errors()
    old_alloc, new_alloc = old_status.get("allocation"), status.get("allocation")
    if status.get("devices") and (gates.get("DRAResourceClaimDeviceStatus") or old_status.get("devices")):
        gone = {_device_key(r)[:3] for r in ((old_alloc or {}).get("devices") or {}).get("results") or ()}
        gone -= {_device_key(r)[:3] for r in ((new_alloc or {}).get("devices") or {}).get("results") or ()}
        status["devices"] = [d for d in status["devices"] if _device_key(d)[:3] not in gone] or None
        if status["devices"] is None:
            del status["devices"]
    reserved = status.get("reservedFor") or []
    seen: set = set()
    for i, ref in enumerate(reserved):
        for key in ("resource", "name", "uid"):
            if not ref.get(key):
                errs.required(f"status.reservedFor[{i}].{key}")
    for i, ref in enumerate(reserved):
        if ref.get("uid", "") in seen:
            errs.duplicate(f"status.reservedFor[{i}]", ref.get("uid", ""))
        seen.add(ref.get("uid", ""))
    allocated = {_device_key(r) for r in ((new_alloc or {}).get("devices") or {}).get("results") or ()}
    seen = set()
    for i, d in enumerate(status.get("devices") or ()):
        dp = f"status.devices[{i}]"
        _validate_driver_name(d.get("driver", ""), f"{dp}.driver", errs)
        _validate_pool_name(d.get("pool", ""), f"{dp}.pool", errs)
        for msg in is_dns1123_label(d.get("device", "")):
            errs.invalid(f"{dp}.device", d.get("device", ""), msg)
        key = _device_key(d)
        if key not in allocated:
            shared = "/".join(key[:3]) + (f"/{key[3]}" if key[3] else "")
            errs.invalid(dp, shared, "must be an allocated device in the claim")
    for i, d in enumerate(status.get("devices") or ()):
        if _device_key(d) in seen:
            errs.duplicate(f"status.devices[{i}]", "/".join(_device_key(d)[:3]))
        seen.add(_device_key(d))
    if reserved:
        if not new_alloc:
            errs.forbidden("status.reservedFor", "may not be specified when `allocated` is not set")
        elif deleted:
            old_refs = [json.dumps(r, sort_keys=True) for r in old_status.get("reservedFor") or []]
            if any(json.dumps(r, sort_keys=True) not in old_refs for r in reserved):
                errs.forbidden("status.reservedFor", "new entries may not be added while `deallocationRequested` or `deletionTimestamp` are set")
    if old_alloc and new_alloc:
        if new_alloc != old_alloc:
            errs.invalid("status.allocation", "<value omitted>", "field is immutable")
    elif new_alloc:
        for i, r in enumerate((new_alloc.get("devices") or {}).get("results") or ()):
            rp = f"status.allocation.devices.results[{i}]"
            req = r.get("request", "")
            msg = "must be the name of a request in the claim or the name of a request and a subrequest separated by '/'"
            if len(req.split("/")) > 2:
                errs.invalid(f"{rp}.request", req, msg)
            else:
                for part in req.split("/"):
                    for m in is_dns1123_label(part):
                        errs.invalid(f"{rp}.request", part, m)
                if not _request_name_ok(req, spec):
                    errs.invalid(f"{rp}.request", req, msg)
            _validate_driver_name(r.get("driver", ""), f"{rp}.driver", errs)
            _validate_pool_name(r.get("pool", ""), f"{rp}.pool", errs)
            for m in is_dns1123_label(r.get("device", "")):
                errs.invalid(f"{rp}.device", r.get("device", ""), m)
    return list(errs)


def validate_resource_slice(obj: dict, old: dict | None = None) -> list[FieldError]:
    """ValidateResourceSlice (old None) or ValidateResourceSliceUpdate, on a decoded slice."""
    errs = Errors()
    _validate_object_meta(obj.get("metadata") or {}, errs)
    spec = obj.get("spec") or {}
    old_spec = (old or {}).get("spec") if old is not None else None
    pool = spec.get("pool") or {}
    _validate_driver_name(spec.get("driver", ""), "spec.driver", errs)
    _validate_pool_name(pool.get("name", ""), "spec.pool.name", errs)
    if pool.get("resourceSliceCount", 0) <= 0:
        errs.invalid("spec.pool.resourceSliceCount", pool.get("resourceSliceCount", 0), "must be greater than zero")
    if pool.get("generation", 0) < 0:
        errs.invalid("spec.pool.generation", pool["generation"], "must be greater than or equal to zero")
    if old_spec is not None:
        old_pool = old_spec.get("pool") or {}
        if pool.get("name", "") != old_pool.get("name", ""):
            errs.invalid("spec.pool.name", pool.get("name", ""), "field is immutable")
        if spec.get("driver", "") != old_spec.get("driver", ""):
            errs.invalid("spec.driver", spec.get("driver", ""), "field is immutable")
        if spec.get("nodeName") != old_spec.get("nodeName"):
            errs.invalid("spec.nodeName", spec.get("nodeName"), "field is immutable")

    set_fields = []
    if "nodeName" in spec:
        if spec["nodeName"]:
            set_fields.append("`nodeName`")
            _validate_node_name(spec["nodeName"], "spec.nodeName", errs)
        else:
            errs.invalid("spec.nodeName", "", "must be either unset or set to a non-empty string")
    if "nodeSelector" in spec:
        set_fields.append("`nodeSelector`")
        _validate_node_selector(spec["nodeSelector"], "spec.nodeSelector", errs)
        terms = spec["nodeSelector"].get("nodeSelectorTerms") or []
        if len(terms) != 1:
            # "simplifies merging of different selectors when devices are allocated from different slices"
            errs.invalid("spec.nodeSelector.nodeSelectorTerms", terms, "must have exactly one node selector term")
    for key in ("allNodes", "perDeviceNodeSelection"):
        if key in spec:
            if spec[key]:
                set_fields.append(f"`{key}`")
            else:
                errs.invalid(f"spec.{key}", False, "must be either unset or set to true")
    one_of = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required"
    if not set_fields:
        errs.required("spec", one_of)
    elif len(set_fields) > 1:
        errs.invalid("spec", "{" + ", ".join(set_fields) + "}", one_of + ", but multiple fields are set")

    # a present key is a non-nil Go slice, even when empty: `devices: []` next to counter sets is refused
    if "sharedCounters" in spec and "devices" in spec:
        errs.invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed")

    devices = spec.get("devices") or []
    limit = RESOURCE_SLICE_MAX_DEVICES
    # haveDeviceTaints || haveConsumesCounters || haveListAttributes (the last 1.36+):
    # ResourceSliceMaxDevicesWithAdvancedFeatures
    if (
        any(d.get("taints") for d in devices)
        or any(d.get("consumesCounters") for d in devices)
        or any(k in a for d in devices for a in (d.get("attributes") or {}).values() for k in _LIST_VALUES)
    ):
        limit = RESOURCE_SLICE_MAX_DEVICES_WITH_TAINTS_OR_CONSUMES_COUNTERS
    old_devices = {d.get("name"): d for d in (old_spec or {}).get("devices") or []}
    per_device = spec.get("perDeviceNodeSelection")
    _validate_set(
        devices,
        limit,
        lambda d: d.get("name", ""),
        lambda d, p, e: _validate_device(d, old_devices.get(d.get("name")) if old_spec is not None else None, p, per_device, e),
        "spec.devices",
        errs,
    )
    _validate_set(
        spec.get("sharedCounters") or [],
        RESOURCE_SLICE_MAX_COUNTER_SETS,
        lambda c: c.get("name", ""),
        _validate_counter_set,
        "spec.sharedCounters",
        errs,
    )
    if "partitionTypeAttribute" in spec:
        _validate_partition_type_attribute(spec, errs)
    _validate_skip_node_operations(spec.get("skipNodeOperations") or [], "spec.skipNodeOperations", errs)
    return list(errs)


def _validate_partition_type_attribute(spec: dict, errs: Errors) -> None:
    # validatePartitionTypeAttribute (1.37): only next to devices that consume counters; a fully
    # qualified name (declarative format=k8s-resource-fully-qualified-name, validateFullyQualifiedName);
    # every device that consumes counters carries it as a string (a name in the driver's domain
    # may be given bare on the device: lookupQualifiedAttribute)
    name = spec["partitionTypeAttribute"]
    path = "spec.partitionTypeAttribute"
    devices = spec.get("devices") or []
    if not any(d.get("consumesCounters") for d in devices):
        errs.invalid(path, name, "may only be set on a slice which declares devices that consume counters")
        return
    bad = Errors()
    _validate_qualified_name(name, path, bad)
    if "/" not in name:
        bad.invalid(path, name, "a fully qualified name must be a domain and a name separated by a slash")
    if bad:
        errs.extend(bad)
        return
    prefix = spec.get("driver", "") + "/"
    bare = name[len(prefix):] if name.startswith(prefix) else ""
    for i, d in enumerate(devices):
        if not d.get("consumesCounters"):
            continue
        attrs = d.get("attributes") or {}
        attr = attrs.get(name, attrs.get(bare) if bare else None)
        ap = f"spec.devices[{i}].attributes[{name}]"
        if attr is None:
            errs.required(ap, "device consumes counters and `partitionTypeAttribute` names this attribute, so it must be set")
        elif "string" not in attr:
            errs.invalid(ap, attr, "must be a string value because `partitionTypeAttribute` names this attribute")


def _validate_skip_node_operations(ops: list, path: str, errs: Errors) -> None:
    # the declarative enum and set rules of types.go SkipNodeOperations (1.37), then
    # validateSkipNodeOperations: NodePrepareResources only with NodeUnprepareResources (or "*")
    seen: set[str] = set()
    for i, op in enumerate(ops):
        if op not in SKIP_NODE_OPERATIONS:
            errs.not_supported(f"{path}[{i}]", op, SKIP_NODE_OPERATIONS)
        elif op in seen:
            errs.duplicate(f"{path}[{i}]", op)
        seen.add(op)
    if "NodePrepareResources" in seen and not {"NodeUnprepareResources", "*"} & seen:
        errs.invalid(path, ops, "NodePrepareResources cannot be skipped unless NodeUnprepareResources is also skipped")


# --- the scheduler's view of a pool (not the API server's) -------------------------------------------
def check_pool(slices: Iterable[dict], driver: str, pool: str) -> list[str]:
    """What the scheduler would find wrong with pool (driver, pool), as messages; [] when fine.

    Only the slices of the highest generation count (pools_incubating.go: older ones are ignored).
    Checked: the pool is complete (as many slices as resourceSliceCount says, and all agree on it);
    device names are unique in the pool (poolIsInvalid); counter set names are unique in the pool
    (types.go: "The names of the counter sets must be unique in the ResourcePool"); every
    consumesCounters entry names a counter set of the pool and only counters in it (the allocator
    silently skips a counter it cannot find: allocator_incubating.go checkAvailableCounters); no
    device consumes more of a counter than its set holds (it could never be allocated).
    """
    mine = [s for s in slices if (s.get("spec") or {}).get("driver") == driver and ((s.get("spec") or {}).get("pool") or {}).get("name") == pool]
    if not mine:
        return [f"pool {driver}/{pool}: no ResourceSlices"]
    generation = max(s["spec"]["pool"].get("generation", 0) for s in mine)
    current = sorted((s for s in mine if s["spec"]["pool"].get("generation", 0) == generation), key=lambda s: s["metadata"]["name"])
    problems: list[str] = []
    where = f"pool {driver}/{pool} generation {generation}"
    counts = sorted({s["spec"]["pool"].get("resourceSliceCount", 0) for s in current})
    if len(counts) > 1:
        problems.append(f"{where}: slices disagree on resourceSliceCount ({', '.join(map(str, counts))})")
    elif counts[0] != len(current):
        problems.append(f"{where}: incomplete, {len(current)} of {counts[0]} ResourceSlices")
    devices: dict[str, str] = {}
    counter_sets: dict[str, tuple[str, dict]] = {}
    for s in current:
        name = s["metadata"]["name"]
        for d in s["spec"].get("devices") or []:
            if d.get("name") in devices:
                problems.append(f"{where}: duplicate device name {d.get('name')} (slices {devices[d['name']]} and {name})")
            devices.setdefault(d.get("name"), name)
        for cs in s["spec"].get("sharedCounters") or []:
            if cs.get("name") in counter_sets:
                problems.append(f"{where}: counter set {cs.get('name')} defined twice (slices {counter_sets[cs['name']][0]} and {name})")
            counter_sets.setdefault(cs.get("name"), (name, cs.get("counters") or {}))
    for s in current:
        name = s["metadata"]["name"]
        for d in s["spec"].get("devices") or []:
            for c in d.get("consumesCounters") or []:
                set_name = c.get("counterSet")
                if set_name not in counter_sets:
                    problems.append(f"{where}: device {d.get('name')} (slice {name}) consumes counter set {set_name}, which no slice of the pool defines")
                    continue
                available = counter_sets[set_name][1]
                for counter, value in sorted((c.get("counters") or {}).items()):
                    if counter not in available:
                        problems.append(f"{where}: device {d.get('name')} (slice {name}) consumes counter {counter}, which counter set {set_name} does not have")
                    elif parse_quantity(value.get("value")) > parse_quantity(available[counter].get("value")):
                        problems.append(
                            f"{where}: device {d.get('name')} (slice {name}) consumes {value.get('value')} of {set_name}/{counter},"
                            f" more than the set's {available[counter].get('value')}"
                        )
    return problems


# --- selectors --------------------------------------------------------------------------------------
class BadRequest(Exception):
    pass


def _split_terms(selector: str) -> list[str]:
    terms, depth, cur = [], 0, ""
    for ch in selector:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            terms.append(cur)
            cur = ""
        else:
            cur += ch
    terms.append(cur)
    return [t.strip() for t in terms if t.strip()]


def parse_field_selector(selector: str, supported: Sequence[str]) -> list[tuple[str, str, str]]:
    """`a=b,c!=d` -> [(field, op, value)]; an unsupported field is 400 as the API server answers."""
    out = []
    for term in _split_terms(selector):
        m = re.fullmatch(r"([^=!]+?)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise BadRequest(f"invalid selector: '{selector}'; can't understand '{term}'")
        key, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        if key not in supported:
            raise BadRequest(f'field label not supported: {key}')
        out.append((key, "!=" if op == "!=" else "=", value))
    return out


def label_selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in _split_terms(selector):
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s+\((.*)\)", term)
        if m:
            values = {v.strip() for v in m.group(3).split(",") if v.strip()}
            has = m.group(1) in labels and labels[m.group(1)] in values
            if has != (m.group(2) == "in"):
                return False
            continue
        m = re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(\S*)", term)
        if m:
            key, op, value = m.groups()
            if (labels.get(key) == value) != (op != "!="):
                return False
            continue
        if term.startswith("!"):
            if term[1:].strip() in labels:
                return False
            continue
        if re.fullmatch(r"[^=!\s()]+", term):
            if term not in labels:
                return False
            continue
        raise BadRequest(f"unable to parse requirement: {term!r}")
    return True


# --- Status objects ----------------------------------------------------------------------------------
_REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
    409: "Conflict", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
    504: "Timeout",
}


def status_object(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}
    if details is not None:
        body["details"] = details
    return body


class ApiError(Exception):
    def __init__(self, code: int, message: str, reason: str | None = None, details: dict | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.body = status_object(code, reason or _REASONS.get(code, "Unknown"), message, details)


def _not_found(resource: str, name: str, kind: str) -> ApiError:
    group = "" if resource in ("nodes",) else GROUP
    qualified = f"{resource}.{group}" if group else resource
    return ApiError(404, f'{qualified} "{name}" not found', "NotFound", {"name": name, "group": group, "kind": resource})


def _invalid(kind: str, name: str, errors: list[FieldError]) -> ApiError:
    # Go's aggregate: "[a, b]" for several errors, the one error alone
    text = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(str(e) for e in errors) + "]"
    return ApiError(
        422,
        f'{kind}.{GROUP} "{name}" is invalid: {text}',
        "Invalid",
        {"name": name, "group": GROUP, "kind": kind, "causes": [{"reason": e.reason, "message": e.message, "field": e.field} for e in errors]},
    )


def _conflict_modified(resource: str, name: str) -> ApiError:
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {resource}.{GROUP} "{name}": the object has been modified; please apply your'
        " changes to the latest version and try again",
        "Conflict",
        {"name": name, "group": GROUP, "kind": resource},
    )


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _drop_empty(d: dict) -> None:
    # the v1 types' collections are omitempty: an empty one does not come back
    for k in list(d):
        v = d[k]
        if isinstance(v, dict):
            _drop_empty(v)
        elif isinstance(v, list):
            for item in v:
                if isinstance(item, dict):
                    _drop_empty(item)
        if isinstance(v, (list, dict)) and not v and k not in ("metadata", "spec", "pool"):
            del d[k]


@dataclass
class ApiRequest:
    method: str
    path: str
    query: dict[str, str]
    #: the decoded JSON body (its text when it is not JSON; None when empty)
    body: Any
    status: int
    authorization: str
    content_type: str = ""


_CLAIMS_ALL = re.compile(r"^/apis/resource\.k8s\.io/v1/resourceclaims$")
_CLAIMS_NS = re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims$")
_CLAIM = re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)$")
_CLAIM_STATUS = re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)/status$")
_SLICES_PATH = re.compile(r"^/apis/resource\.k8s\.io/v1/resourceslices$")
_SLICE_PATH = re.compile(r"^/apis/resource\.k8s\.io/v1/resourceslices/([^/]+)$")
_GENERATE_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:  # a client that went away: not news
        pass


class KubeApiStandIn:
    """The API server's Node, Pod, Eviction, PodDisruptionBudget, ResourceClaim and ResourceSlice
    endpoints, in memory, over HTTP on loopback."""

    def __init__(self, *, token: str | None = TOKEN, gates: dict[str, bool] | None = None) -> None:
        self.token = token
        self.gates = dict(GATES_ENABLED if gates is None else gates)
        self.requests: list[ApiRequest] = []
        self._lock = threading.RLock()
        self._rv = 0
        self._claims: dict[tuple[str, str], dict] = {}
        #: namespace -> its labels (`admit_admin_access`); admin access needs ADMIN_ACCESS_LABEL there
        self._namespace_labels: dict[str, dict[str, str]] = {}
        self._slices: dict[str, dict] = {}
        self._faults: list[tuple[str, float]] = []
        self._release = threading.Event()
        self._stopping = False
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, method: str) -> None:
                standin._serve(self, method)

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                self._answer("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._answer("POST")

            def do_PUT(self) -> None:  # noqa: N802
                self._answer("PUT")

            def do_DELETE(self) -> None:  # noqa: N802
                self._answer("DELETE")

            def do_PATCH(self) -> None:  # noqa: N802
                self._answer("PATCH")

        from .kubeapi_nodes_pods import NodesAndPods  # it imports this module's rules

        #: the Node, Pod, Eviction and PodDisruptionBudget side (kubeapi_nodes_pods.py)
        self.core = NodesAndPods(self)
        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="kubeapi-standin", daemon=True)

    # --- lifecycle ---------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def start(self) -> "KubeApiStandIn":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)

    def __enter__(self) -> "KubeApiStandIn":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig (JSON is YAML) pointing at this server with the bearer token."""
        user: dict = {"token": self.token} if self.token else {}
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "test", "cluster": {"server": self.url}}],
                    "users": [{"name": "dra-plugin", "user": user}],
                    "contexts": [{"name": "test", "context": {"cluster": "test", "user": "dra-plugin"}}],
                    "current-context": "test",
                }
            )
        )
        return path

    # --- test helpers ------------------------------------------------------------------------------
    def _meta(self, name: str, namespace: str | None = None, uid: str | None = None) -> dict:
        self._rv += 1
        meta: dict = {"name": name}
        if namespace is not None:
            meta["namespace"] = namespace
        meta.update(uid=uid or str(uuid.uuid4()), resourceVersion=str(self._rv), creationTimestamp=_now())
        return meta

    # Nodes, pods, evictions and budgets: kubeapi_nodes_pods.NodesAndPods (`self.core`) holds them.
    def add_node(
        self,
        name: str,
        *,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[Any] | None = None,
        unschedulable: bool = False,
        annotations: Mapping[str, str] | None = None,
    ) -> str:
        """A Node (taints as {"key", "value", "effect"} or (key, value, effect)); its uid. What
        ValidateNode refuses is a ValueError."""
        return self.core.add_node(name, labels=labels, taints=taints, unschedulable=unschedulable, annotations=annotations)

    def remove_node(self, name: str) -> bool:
        with self._lock:
            return self.core.nodes.pop(name, None) is not None

    def node(self, name: str) -> dict | None:
        """The Node as GET answers it (a copy), or None."""
        return self.core.node(name)

    def label_node(self, name: str, labels: Mapping[str, str | None]) -> str:
        """`kubectl label --overwrite` (None removes): a merge patch through the update rules; the new resourceVersion."""
        return self.core.label_node(name, labels)

    def annotate_node(self, name: str, annotations: Mapping[str, str | None]) -> str:
        """`kubectl annotate --overwrite` (None removes); the new resourceVersion."""
        return self.core.annotate_node(name, annotations)

    def add_controller(self, namespace: str, name: str, replicas: int, *, kind: str = "ReplicaSet") -> str:
        """A pod controller whose scale PodDisruptionBudgets count (maxUnavailable, percentages); its uid."""
        return self.core.add_controller(namespace, name, replicas, kind=kind)

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
        """A pod bound to `node_name` with its devices per container; its uid (see NodesAndPods.add_pod)."""
        return self.core.add_pod(namespace, name, node_name, labels=labels, devices=devices, phase=phase, ready=ready, owner=owner)

    def set_pod_phase(self, namespace: str, name: str, phase: str, *, ready: bool | None = None) -> None:
        self.core.set_pod_phase(namespace, name, phase, ready=ready)

    def pod(self, namespace: str, name: str) -> dict | None:
        return self.core.pod(namespace, name)

    def pods(self, node_name: str | None = None) -> list[dict]:
        """The pods (copies, by namespace and name), those bound to `node_name` when given."""
        return self.core.pods_on(node_name)

    def add_pdb(
        self,
        namespace: str,
        name: str,
        match_labels: Mapping[str, str],
        *,
        min_available: int | str | None = None,
        max_unavailable: int | str | None = None,
    ) -> str:
        """A policy/v1 PodDisruptionBudget (int or "50%"); its uid."""
        return self.core.add_pdb(namespace, name, match_labels, min_available=min_available, max_unavailable=max_unavailable)

    def pdb(self, namespace: str, name: str) -> dict | None:
        """The budget with the status the disruption controller would give it now."""
        return self.core.pdb(namespace, name)

    def evictions(self, namespace: str | None = None) -> list[Any]:
        """Every eviction request answered (kubeapi_nodes_pods.Eviction: code, status, reason, message, dry_run)."""
        return self.core.evictions(namespace)

    @property
    def eviction_grace_s(self) -> float:
        """How long the kubelet takes to stop a deleted pod (default 0: it leaves at once)."""
        return self.core.eviction_grace_s

    @eviction_grace_s.setter
    def eviction_grace_s(self, seconds: float) -> None:
        self.core.eviction_grace_s = float(seconds)

    def pod_resources(self, node_name: str) -> Any:
        """The kubelet's pod-resources v1 ListPodResourcesResponse for `node_name`."""
        return self.core.pod_resources(node_name)

    def kubelet_pods(self, node_name: str) -> Any:
        """An object with `list_response()` for kube_peers.KubeletServer: this node's pod-resources."""
        return self.core.kubelet_pods(node_name)

    def add_claim(
        self,
        namespace: str,
        name: str,
        *,
        results: Sequence[tuple[str, str, str, str]] = (),
        allocated: bool = True,
        uid: str | None = None,
        reserved_for: Sequence[tuple[str, str]] = (),
        node: str | None = None,
        config: Sequence[dict] = (),
        shares: Sequence[dict | None] = (),
        admin_access: bool = False,
    ) -> str:
        """A ResourceClaim; `results` are (request, driver, pool, device); `reserved_for` (pod name, pod uid).

        `admin_access`: every request asks for admin access (v1 ExactDeviceRequest.adminAccess) and
        every result has it, as the scheduler allocates such a claim. With the DRAAdminAccess gate
        the API server refuses it unless the namespace carries ADMIN_ACCESS_LABEL "true"
        (pkg/registry/resource/utils.go AuthorizedForAdmin, run by the claim strategy's Validate);
        without the gate it drops the field (dropDisabledDRAAdminAccessFields).

        `config`: the allocation's device configs as the scheduler copies them in (entries with
        `source` FromClass/FromClaim, `requests` and `opaque`); `shares`: per result, a share of a
        device that allows multiple allocations ({"shareID": ..., "consumedCapacity": {...}}, or
        None). Without the DRAConsumableCapacity gate the API server drops shareID and
        consumedCapacity from the allocation (pkg/registry/resource/resourceclaim/strategy.go,
        dropDisabledDRAConsumableCapacityFields), as it drops the capacity requests.

        Adding a claim that exists replaces it (keeping its uid unless one is given), as the
        scheduler writing an allocation would.
        """
        with self._lock:
            old = self._claims.get((namespace, name))
            meta = self._meta(name, namespace, uid or (old["metadata"]["uid"] if old else None))
            if old:
                meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
            requests = sorted({r[0] for r in results}) or ["gpu"]
            claim: dict = {
                "kind": "ResourceClaim",
                "apiVersion": RESOURCE_V1,
                "metadata": meta,
                "spec": {
                    "devices": {
                        "requests": [
                            {"name": r, "exactly": {"deviceClassName": "gpu.bcd.dev", "allocationMode": "ExactCount",
                                                    "count": max(1, sum(1 for x in results if x[0] == r)),
                                                    **({"adminAccess": True} if admin_access else {})}}
                            for r in requests
                        ]
                    }
                },
                "status": {},
            }
            if allocated:
                entries = [{"request": r, "driver": d, "pool": p, "device": dev, **({"adminAccess": True} if admin_access else {})} for r, d, p, dev in results]
                for entry, share in zip(entries, shares):
                    if share and self.gates.get("DRAConsumableCapacity"):
                        entry.update(copy.deepcopy(share))
                allocation: dict = {"devices": {"results": entries}}
                if config:
                    allocation["devices"]["config"] = copy.deepcopy(list(config))
                if node:
                    allocation["nodeSelector"] = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}
                claim["status"]["allocation"] = allocation
                if reserved_for:
                    claim["status"]["reservedFor"] = [{"resource": "pods", "name": n, "uid": u} for n, u in reserved_for]
            # what a create would meet: the claim's own validation, with this server's gates
            # (kubeapi_claims_validation.py, ported from pkg/apis/resource/validation)
            from .kubeapi_claims_validation import validate_manifest  # it imports this module's rules

            errors = validate_manifest(claim, self.gates)
            if errors:
                raise ValueError(f"the API server refuses ResourceClaim {namespace}/{name}: " + "; ".join(map(str, errors)))
            if admin_access and self.gates.get("DRAAdminAccess"):
                if self._namespace_labels.get(namespace, {}).get(ADMIN_ACCESS_LABEL) != "true":
                    raise ValueError(
                        f"the API server refuses ResourceClaim {namespace}/{name}: admin access to devices requires the "
                        f"`{ADMIN_ACCESS_LABEL}: true` label on the containing namespace"
                    )
            elif admin_access:
                for req in claim["spec"]["devices"]["requests"]:
                    req["exactly"].pop("adminAccess", None)
                for entry in claim["status"].get("allocation", {}).get("devices", {}).get("results", []):
                    entry.pop("adminAccess", None)
            self._claims[(namespace, name)] = claim
            return meta["uid"]

    def admit_admin_access(self, namespace: str) -> None:
        """Label `namespace` so that claims there may ask for admin access (ADMIN_ACCESS_LABEL: "true")."""
        with self._lock:
            self._namespace_labels.setdefault(namespace, {})[ADMIN_ACCESS_LABEL] = "true"

    def remove_claim(self, namespace: str, name: str) -> bool:
        with self._lock:
            return self._claims.pop((namespace, name), None) is not None

    def claim(self, namespace: str, name: str) -> dict | None:
        with self._lock:
            c = self._claims.get((namespace, name))
            return copy.deepcopy(c) if c else None

    def slices(self, driver: str | None = None) -> list[dict]:
        """The stored ResourceSlices (copies), by name; of one driver when given."""
        with self._lock:
            return [copy.deepcopy(s) for n, s in sorted(self._slices.items()) if driver is None or s["spec"].get("driver") == driver]

    def slice(self, name: str) -> dict | None:
        with self._lock:
            s = self._slices.get(name)
            return copy.deepcopy(s) if s else None

    def check_pool(self, driver: str, pool: str) -> list[str]:
        """The scheduler's objections to one pool across all its slices ([] when none); see `check_pool`."""
        return check_pool(self.slices(driver), driver, pool)

    def fail_next(self, n: int = 1, status: int = 500) -> None:
        """Answer the next n requests (any path) with `status` and a Status object."""
        with self._lock:
            self._faults.extend([("fail", float(status))] * n)

    def hang_next(self, n: int = 1, seconds: float = 30.0) -> None:
        """Hold the next n requests `seconds` (or until `stop`/`release`) before serving them."""
        with self._lock:
            if not self._stopping:
                self._release.clear()
            self._faults.extend([("hang", float(seconds))] * n)

    def release(self) -> None:
        """Let held requests go now."""
        self._release.set()

    def requests_to(self, method: str | None = None, prefix: str = "") -> list[ApiRequest]:
        with self._lock:
            return [r for r in self.requests if (method is None or r.method == method) and r.path.startswith(prefix)]

    # --- serving -----------------------------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, method: str) -> None:
        parts = urlsplit(h.path)
        path = parts.path
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        content_type = h.headers.get("Content-Type", "")
        body: Any = None
        body_error: str | None = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError as exc:
                body, body_error = raw.decode(errors="replace"), f"the body of the request was in an unknown format: {exc}"
        code: int
        answer: dict
        headers: list[tuple[str, str]] = []
        with self._lock:
            fault = self._faults.pop(0) if self._faults else None
        if fault and fault[0] == "hang":
            self._release.wait(fault[1])
            if self._stopping:
                h.close_connection = True
                return
        try:
            if fault and fault[0] == "fail":
                status = int(fault[1])
                raise ApiError(status, "etcdserver: request timed out" if status >= 500 else "injected failure")
            if self.token and h.headers.get("Authorization", "") != f"Bearer {self.token}":
                raise ApiError(401, "Unauthorized")
            with self._lock:
                code, answer, headers = self._route(method, path, query, body, body_error, content_type)
        except ApiError as exc:
            code, answer = exc.code, exc.body
        except BadRequest as exc:
            code, answer = 400, status_object(400, "BadRequest", str(exc))
        except Exception as exc:  # a bug of the stand-in: an answer the test sees, not a dropped connection
            code, answer = 500, status_object(500, "InternalError", f"stand-in: {type(exc).__name__}: {exc}")
        with self._lock:
            self.requests.append(ApiRequest(method, path, query, body, code, h.headers.get("Authorization", ""), content_type))
        data = json.dumps(answer).encode()
        try:
            h.send_response(code)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            for k, v in headers:
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data)
        except OSError:
            h.close_connection = True

    def _route(
        self, method: str, path: str, query: dict[str, str], body: Any, body_error: str | None = None, content_type: str = ""
    ) -> tuple[int, dict, list[tuple[str, str]]]:
        path = unquote(path)
        answered = self.core.route(method, path, query, body, body_error, content_type)
        if answered is not None:
            return answered
        if body_error is not None:
            raise ApiError(400, body_error)
        if _CLAIMS_ALL.match(path):
            self._only(method, "GET")
            return 200, self._list_claims(None, query), []
        if m := _CLAIMS_NS.match(path):
            self._only(method, "GET")
            return 200, self._list_claims(m.group(1), query), []
        if m := _CLAIM_STATUS.match(path):
            self._only(method, "GET", "PUT")
            if method == "GET":
                return 200, self._get_claim(m.group(1), m.group(2)), []
            return 200, self._put_claim_status(m.group(1), m.group(2), body), []
        if m := _CLAIM.match(path):
            self._only(method, "GET")
            return 200, self._get_claim(m.group(1), m.group(2)), []
        if _SLICES_PATH.match(path):
            self._only(method, "GET", "POST")
            if method == "GET":
                return 200, self._list_slices(query), []
            return self._create_slice(body)
        if m := _SLICE_PATH.match(path):
            self._only(method, "GET", "PUT", "DELETE")
            name = m.group(1)
            if method == "GET":
                if name not in self._slices:
                    raise _not_found("resourceslices", name, "ResourceSlice")
                return 200, copy.deepcopy(self._slices[name]), []
            if method == "PUT":
                return self._replace_slice(name, body)
            return 200, self._delete_slice(name), []
        raise ApiError(404, "the server could not find the requested resource", "NotFound",
                       {"causes": [{"reason": "UnexpectedServerResponse", "message": "404 page not found"}]})

    @staticmethod
    def _only(method: str, *allowed: str) -> None:
        if method not in allowed:
            raise ApiError(405, "the server does not allow this method on the requested resource", "MethodNotAllowed")

    # --- claims ------------------------------------------------------------------------------------
    def _get_claim(self, namespace: str, name: str) -> dict:
        claim = self._claims.get((namespace, name))
        if claim is None:
            raise _not_found("resourceclaims", name, "ResourceClaim")
        return copy.deepcopy(claim)

    def _list_claims(self, namespace: str | None, query: dict[str, str]) -> dict:
        fields = parse_field_selector(query.get("fieldSelector", ""), ("metadata.name", "metadata.namespace")) if query.get("fieldSelector") else []
        items = []
        for (ns, name), claim in sorted(self._claims.items()):
            if namespace is not None and ns != namespace:
                continue
            values = {"metadata.name": name, "metadata.namespace": ns}
            if not all((values[f] == v) == (op == "=") for f, op, v in fields):
                continue
            if query.get("labelSelector") and not label_selector_matches(query["labelSelector"], claim["metadata"].get("labels") or {}):
                continue
            items.append({k: v for k, v in copy.deepcopy(claim).items() if k not in ("kind", "apiVersion")})
        return {"kind": "ResourceClaimList", "apiVersion": RESOURCE_V1, "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _put_claim_status(self, namespace: str, name: str, body: Any) -> dict:
        old = self._claims.get((namespace, name))
        if old is None:
            raise _not_found("resourceclaims", name, "ResourceClaim")
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request was in an unknown format")
        meta = body.get("metadata") or {}
        if meta.get("name", "") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name', '')}) does not match the name on the URL ({name})")
        rv = meta.get("resourceVersion", "")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise _conflict_modified("resourceclaims", name)
        status = body.get("status") or {}
        old_status = old.get("status") or {}
        # PrepareForUpdate of the status strategy (pkg/registry/resource/resourceclaim/strategy.go):
        # status.devices entries of devices the update deallocates are dropped first
        # (dropDeallocatedStatusDevices), then ValidateResourceClaimStatusUpdate /
        # validateResourceClaimStatusUpdate (pkg/apis/resource/validation/validation.go).
        status = copy.deepcopy(status)
        status_errors = validate_claim_status_update(status, old_status, old["spec"], bool(old["metadata"].get("deletionTimestamp")), self.gates)
        errs = Errors(status_errors)
        if errs:
            raise _invalid("ResourceClaim", name, list(errs))
        claim = copy.deepcopy(old)
        claim["status"] = copy.deepcopy(status)
        self._rv += 1
        claim["metadata"]["resourceVersion"] = str(self._rv)
        self._claims[(namespace, name)] = claim
        return copy.deepcopy(claim)

    # --- slices ------------------------------------------------------------------------------------
    def _list_slices(self, query: dict[str, str]) -> dict:
        selector = query.get("fieldSelector", "")
        fields = parse_field_selector(selector, ("spec.nodeName", "spec.driver", "metadata.name")) if selector else []
        items = []
        for name, s in sorted(self._slices.items()):
            # strategy.go toSelectableFields: a slice without nodeName has spec.nodeName ""
            values = {"spec.nodeName": s["spec"].get("nodeName", ""), "spec.driver": s["spec"].get("driver", ""), "metadata.name": name}
            if not all((values[f] == v) == (op == "=") for f, op, v in fields):
                continue
            if query.get("labelSelector") and not label_selector_matches(query["labelSelector"], s["metadata"].get("labels") or {}):
                continue
            items.append({k: v for k, v in copy.deepcopy(s).items() if k not in ("kind", "apiVersion")})
        return {"kind": "ResourceSliceList", "apiVersion": RESOURCE_V1, "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _decode_slice(self, body: Any) -> tuple[dict, list[str]]:
        try:
            return decode_resource_slice(body)
        except DecodeError as exc:
            raise ApiError(400, f'ResourceSlice in version "v1" cannot be handled as a ResourceSlice: {exc}') from None

    @staticmethod
    def _warning_headers(warnings: list[str]) -> list[tuple[str, str]]:
        # one `Warning: 299 - "..."` header per warning, as the API server sends them
        return [("Warning", f'299 - "{w}"') for w in warnings]

    def _create_slice(self, body: Any) -> tuple[int, dict, list[tuple[str, str]]]:
        obj, warnings = self._decode_slice(body)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            # etcd3 store.go Create: storage.ErrResourceVersionSetOnCreate (the status code is assumed)
            raise ApiError(400, "resourceVersion should not be set on objects to be created")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(random.choice(_GENERATE_CHARS) for _ in range(5))
        # PrepareForCreate: generation 1, disabled fields dropped; then Validate
        for k in ("uid", "creationTimestamp", "deletionTimestamp", "selfLink", "managedFields"):
            meta.pop(k, None)
        meta["generation"] = 1
        drop_disabled_fields(obj["spec"], None, self.gates)
        errors = validate_resource_slice(obj)
        if errors:
            raise _invalid("ResourceSlice", meta.get("name", ""), errors)
        name = meta["name"]
        if name in self._slices:
            raise ApiError(409, f'resourceslices.{GROUP} "{name}" already exists', "AlreadyExists",
                           {"name": name, "group": GROUP, "kind": "resourceslices"})
        self._rv += 1
        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(self._rv), creationTimestamp=_now())
        _drop_empty(obj["spec"])
        self._slices[name] = obj
        return 201, copy.deepcopy(obj), self._warning_headers(warnings)

    def _replace_slice(self, name: str, body: Any) -> tuple[int, dict, list[tuple[str, str]]]:
        obj, warnings = self._decode_slice(body)
        meta = obj["metadata"]
        if meta.get("name", "") != name:
            raise ApiError(400, f"the name of the object ({meta.get('name', '')}) does not match the name on the URL ({name})")
        old = self._slices.get(name)
        if old is None:  # AllowCreateOnUpdate: false
            raise _not_found("resourceslices", name, "ResourceSlice")
        old_meta = old["metadata"]
        if meta.get("uid") and meta["uid"] != old_meta["uid"]:
            raise ApiError(409, f"Precondition failed: UID in precondition: {meta['uid']}, UID in object meta: {old_meta['uid']}",
                           "Conflict", {"name": name, "group": GROUP, "kind": "resourceslices"})
        # AllowUnconditionalUpdate: true, so no resourceVersion means "whatever is there"
        if meta.get("resourceVersion") and meta["resourceVersion"] != old_meta["resourceVersion"]:
            raise _conflict_modified("resourceslices", name)
        meta["uid"], meta["creationTimestamp"] = old_meta["uid"], old_meta["creationTimestamp"]
        # PrepareForUpdate: disabled fields dropped, then ValidateUpdate
        drop_disabled_fields(obj["spec"], old["spec"], self.gates)
        errors = validate_resource_slice(obj, old)
        if errors:
            raise _invalid("ResourceSlice", name, errors)
        _drop_empty(obj["spec"])
        # PrepareForUpdate: any change of the spec increments metadata.generation
        meta["generation"] = old_meta.get("generation", 1) + (obj["spec"] != old["spec"])
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        for k in ("selfLink", "managedFields"):
            meta.pop(k, None)
        self._slices[name] = obj
        return 200, copy.deepcopy(obj), self._warning_headers(warnings)

    def _delete_slice(self, name: str) -> dict:
        old = self._slices.pop(name, None)
        if old is None:
            raise _not_found("resourceslices", name, "ResourceSlice")
        self._rv += 1
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": GROUP, "kind": "resourceslices", "uid": old["metadata"]["uid"]}}


__all__ = [
    "TOKEN",
    "GATES_ENABLED",
    "GATES_1_35_DEFAULT",
    "GATES_BY_RELEASE",
    "RELEASES",
    "release_gates",
    "ApiRequest",
    "FieldError",
    "KubeApiStandIn",
    "check_pool",
    "decode_resource_slice",
    "drop_disabled_fields",
    "parse_quantity",
    "parse_time",
    "validate_resource_slice",
]
