"""The API server's validation of DeviceClass, ResourceClaim and ResourceClaimTemplate (resource.k8s.io/v1).

Owns the rules for those three kinds; kubeapi_standin.py owns ResourceSlices, the shared name
formats, field errors and the gate defaults (`GATES_BY_RELEASE`). Ported from kubernetes
pkg/apis/resource/validation/validation.go as of the 1.37 code (functions named at each rule):
ValidateDeviceClass / validateDeviceClassSpec, ValidateResourceClaim / validateDeviceClaim /
validateDeviceRequest / validateExactDeviceRequest / validateDeviceSubRequest /
validateDeviceAllocationMode / validateSelector / validateCELExpression (length only: CEL is not
compiled here) / validateDeviceConstraint / validateDeviceClaimConfiguration /
validateRequestNameRef / validateOpaqueConfiguration, ValidateResourceClaimTemplate; the limits
from staging/src/k8s.io/api/resource/v1/types.go (32 requests, constraints, configs and
selectors; 8 firstAvailable; 16 tolerations; 10 KiB CEL expressions and opaque parameters).

Also re-read (kubernetes/kubernetes through the code index, validation.go at 009801d930e2):
validateDeviceToleration; v1helper.IsExtendedResourceName (pkg/apis/core/v1/helper/helpers.go);
the v1 defaults (pkg/apis/resource/v1/defaults.go at 16913111deb1: allocationMode ExactCount,
count 1 when ExactCount and 0; DeviceToleration.Operator `+default="Equal"` in
staging/src/k8s.io/api/resource/v1/types.go); the strategies' drops: pkg/api/resourceclaimspec
DropDisabledFields (both claim and template strategies call it) and
pkg/registry/resource/deviceclass/strategy.go dropDisabledDRAExtendedResourceFields.

`validate_manifest(doc, gates)` takes any manifest: the three kinds get their rules, after the
drops a stock API server with `gates` would make; other kinds give [].
"""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

from .kubeapi_standin import (
    DEVICE_TAINT_EFFECTS,
    Errors,
    FieldError,
    _validate_driver_name,
    _validate_label_name,
    _validate_object_meta,
    _validate_qualified_name,
    is_dns1123_label,
    is_dns1123_subdomain,
    is_label_value,
    is_qualified_name,
)

DEVICE_REQUESTS_MAX_SIZE = 32  # = AllocationResultsMaxSize
DEVICE_CONSTRAINTS_MAX_SIZE = 32
DEVICE_CONFIG_MAX_SIZE = 32
DEVICE_SELECTORS_MAX_SIZE = 32
FIRST_AVAILABLE_DEVICE_REQUEST_MAX_SIZE = 8
DEVICE_TOLERATIONS_MAX_LENGTH = 16
CEL_SELECTOR_EXPRESSION_MAX_LENGTH = 10 * 1024
OPAQUE_PARAMETERS_MAX_LENGTH = 10 * 1024
ALLOCATION_MODES = ("All", "ExactCount")


def _each(items: list, limit: int, path: str, errs: Errors, check: Callable[[Any, str], None], key: Callable[[Any], Any] | None = None) -> None:
    # validateSlice / validateSet: too many short-circuits; then each item; then duplicates by key
    if limit >= 0 and len(items) > limit:
        errs.too_many(path, len(items), limit)
        return
    for i, item in enumerate(items):
        check(item, f"{path}[{i}]")
    if key is not None:
        seen: set = set()
        for i, item in enumerate(items):
            k = key(item)
            if k in seen:
                errs.duplicate(f"{path}[{i}]", k)
            seen.add(k)


def _dns_label(value: str, path: str, errs: Errors) -> None:
    for msg in is_dns1123_label(value):
        errs.invalid(path, value, msg)


def _selector(sel: dict, path: str, errs: Errors) -> None:
    # validateSelector / validateCELExpression (length only)
    cel = sel.get("cel")
    if cel is None:
        errs.required(f"{path}.cel")
        return
    expr = cel.get("expression", "")
    if len(expr) > CEL_SELECTOR_EXPRESSION_MAX_LENGTH:
        errs.too_long(f"{path}.cel.expression", CEL_SELECTOR_EXPRESSION_MAX_LENGTH)
    elif not expr.strip():
        errs.required(f"{path}.cel.expression", "expression is required")


def _opaque(config: dict, path: str, errs: Errors) -> None:
    # validateDeviceConfiguration / validateOpaqueConfiguration: opaque required, a driver name,
    # parameters present and at most 10 KiB of JSON
    opaque = config.get("opaque")
    if opaque is None:
        errs.required(f"{path}.opaque")
        return
    _validate_driver_name(opaque.get("driver", ""), f"{path}.opaque.driver", errs)
    if "parameters" not in opaque:
        errs.required(f"{path}.opaque.parameters")
    elif len(json.dumps(opaque["parameters"], separators=(",", ":"))) > OPAQUE_PARAMETERS_MAX_LENGTH:
        errs.too_long(f"{path}.opaque.parameters", OPAQUE_PARAMETERS_MAX_LENGTH)


def _toleration(t: dict, path: str, errs: Errors) -> None:
    # validateDeviceToleration: key a label name when set; operator Exists (no value) or Equal (a
    # label value); effect empty or a device taint effect. The operator is never empty here: v1's
    # DeviceToleration.Operator carries `+default="Equal"` (staging/src/k8s.io/api/resource/v1/
    # types.go), so an omitted or "" operator is Equal before validation.
    if t.get("key"):
        _validate_label_name(t["key"], f"{path}.key", errs)
    op = t.get("operator") or "Equal"
    if op == "Exists":
        if t.get("value"):
            errs.invalid(f"{path}.value", t["value"], "must be empty for operator `Exists`")
    elif op == "Equal":
        for msg in is_label_value(t.get("value", "")):
            errs.invalid(f"{path}.value", t.get("value", ""), msg)
    else:
        errs.not_supported(f"{path}.operator", op, ("Equal", "Exists"))
    if t.get("effect") and t["effect"] not in DEVICE_TAINT_EFFECTS:
        errs.not_supported(f"{path}.effect", t["effect"], DEVICE_TAINT_EFFECTS)


def _class_name(name: str, path: str, errs: Errors) -> None:
    # validateDeviceClass: required, a DNS subdomain
    if not name:
        errs.required(path)
    for msg in is_dns1123_subdomain(name) if name else ():
        errs.invalid(path, name, msg)


def _mode(req: dict, path: str, errs: Errors) -> None:
    # validateDeviceAllocationMode, after pkg/apis/resource/v1/defaults.go
    # SetDefaults_ExactDeviceRequest / SetDefaults_DeviceSubRequest: an empty allocationMode is
    # ExactCount, and ExactCount with count 0 (omitted or sent as 0) gets count 1.
    mode = req.get("allocationMode") or "ExactCount"
    count = req.get("count") or 0
    if mode == "ExactCount" and count == 0:
        count = 1
    if mode == "All":
        if count != 0:
            errs.invalid(f"{path}.count", count, "must not be specified when allocationMode is 'All'")
    elif mode == "ExactCount":
        if count <= 0:
            errs.invalid(f"{path}.count", count, "must be greater than zero")
    else:
        errs.not_supported(f"{path}.allocationMode", mode, ALLOCATION_MODES)


def _exact(req: dict, path: str, errs: Errors) -> None:
    # validateExactDeviceRequest / validateDeviceSubRequest (less the name)
    _class_name(req.get("deviceClassName", ""), f"{path}.deviceClassName", errs)
    _each(req.get("selectors") or [], DEVICE_SELECTORS_MAX_SIZE, f"{path}.selectors", errs, lambda s, p: _selector(s, p, errs))
    _mode(req, path, errs)
    _each(req.get("tolerations") or [], DEVICE_TOLERATIONS_MAX_LENGTH, f"{path}.tolerations", errs, lambda t, p: _toleration(t, p, errs))


def _request(req: dict, path: str, errs: Errors) -> None:
    # validateDeviceRequest: a DNS label name; exactly one of exactly / firstAvailable
    _dns_label(req.get("name", ""), f"{path}.name", errs)
    has_first, has_exact = bool(req.get("firstAvailable")), "exactly" in req
    if not has_first and not has_exact:
        errs.required(path, "exactly one of `exactly` or `firstAvailable` is required")
    elif has_first and has_exact:
        errs.invalid(path, None, "exactly one of `exactly` or `firstAvailable` is required, but multiple fields are set")
    elif has_first:
        def sub(s: dict, p: str) -> None:
            _dns_label(s.get("name", ""), f"{p}.name", errs)
            _exact(s, p, errs)

        _each(req["firstAvailable"], FIRST_AVAILABLE_DEVICE_REQUEST_MAX_SIZE, f"{path}.firstAvailable", errs, sub, lambda s: s.get("name", ""))
    else:
        _exact(req["exactly"], f"{path}.exactly", errs)


def _request_names(devices: dict) -> dict[str, set[str] | None]:
    # gatherRequestNames
    out: dict[str, set[str] | None] = {}
    for r in devices.get("requests") or []:
        subs = r.get("firstAvailable") or []
        out[r.get("name", "")] = {s.get("name", "") for s in subs} if subs else None
    return out


def _request_ref(name: str, path: str, names: dict[str, set[str] | None], errs: Errors) -> None:
    # validateRequestNameRef: "<request>" or "<request>/<subrequest>" of this claim
    msg = "must be the name of a request in the claim or the name of a request and a subrequest separated by '/'"
    parts = name.split("/")
    if len(parts) > 2:
        errs.invalid(path, name, msg)
        return
    for part in parts:
        _dns_label(part, path, errs)
    known = parts[0] in names and (len(parts) == 1 or parts[1] in (names[parts[0]] or ()))
    if not known:
        errs.invalid(path, name, msg)


def _constraint(c: dict, path: str, names: dict, errs: Errors, gates: dict[str, bool]) -> None:
    # validateDeviceConstraint: request refs; matchAttribute or distinctAttribute a fully qualified
    # name; with neither, the error depends on DRAConsumableCapacity (which added distinctAttribute)
    _each(c.get("requests") or [], DEVICE_REQUESTS_MAX_SIZE, f"{path}.requests", errs, lambda n, p: _request_ref(n, p, names, errs), lambda n: n)
    for key in ("matchAttribute", "distinctAttribute"):
        if key in c:
            _validate_qualified_name(c[key], f"{path}.{key}", errs)
            if "/" not in c[key]:
                errs.invalid(f"{path}.{key}", c[key], "a fully qualified name must be a domain and a name separated by a slash")
            return
    if gates.get("DRAConsumableCapacity", True):
        errs.required(path, 'exactly one of "matchAttribute" or "distinctAttribute" is required, but multiple fields are set')
    else:
        errs.required(f"{path}.matchAttribute")


def validate_claim_spec(spec: dict, path: str = "spec", gates: dict[str, bool] | None = None) -> list[FieldError]:
    """validateResourceClaimSpec / validateDeviceClaim on a claim's (or a template's) spec."""
    errs = Errors()
    devices = spec.get("devices") or {}
    dp = f"{path}.devices"
    names = _request_names(devices)
    _each(devices.get("requests") or [], DEVICE_REQUESTS_MAX_SIZE, f"{dp}.requests", errs, lambda r, p: _request(r, p, errs), lambda r: r.get("name", ""))
    _each(devices.get("constraints") or [], DEVICE_CONSTRAINTS_MAX_SIZE, f"{dp}.constraints", errs, lambda c, p: _constraint(c, p, names, errs, gates or {}))

    def config(c: dict, p: str) -> None:
        _each(c.get("requests") or [], DEVICE_REQUESTS_MAX_SIZE, f"{p}.requests", errs, lambda n, q: _request_ref(n, q, names, errs), lambda n: n)
        _opaque(c, p, errs)

    _each(devices.get("config") or [], DEVICE_CONFIG_MAX_SIZE, f"{dp}.config", errs, config)
    return list(errs)


def _is_extended_resource_name(name: str) -> bool:
    # pkg/apis/core/v1/helper/helpers.go IsExtendedResourceName: not native (IsNativeResource: no
    # slash, or containing "kubernetes.io/"), no "requests." prefix, and "requests."+name a
    # qualified name
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    return not is_qualified_name("requests." + name)


def validate_device_class(obj: dict) -> list[FieldError]:
    """ValidateDeviceClass: the name a DNS subdomain (validate.LongName); selectors, configs,
    extendedResourceName."""
    errs = Errors()
    _validate_object_meta(obj.get("metadata") or {}, errs)
    spec = obj.get("spec") or {}
    _each(spec.get("selectors") or [], DEVICE_SELECTORS_MAX_SIZE, "spec.selectors", errs, lambda s, p: _selector(s, p, errs))
    _each(spec.get("config") or [], DEVICE_CONFIG_MAX_SIZE, "spec.config", errs, lambda c, p: _opaque(c, p, errs))
    if "extendedResourceName" in spec and not _is_extended_resource_name(spec["extendedResourceName"]):
        errs.invalid("spec.extendedResourceName", spec["extendedResourceName"], "must be a valid extended resource name")
    return list(errs)


def validate_resource_claim(obj: dict, gates: dict[str, bool] | None = None) -> list[FieldError]:
    """ValidateResourceClaim (a create): object meta (namespaced), then the spec."""
    errs = Errors()
    _validate_object_meta(obj.get("metadata") or {}, errs, namespaced=True)
    return list(errs) + validate_claim_spec(obj.get("spec") or {}, gates=gates)


def validate_resource_claim_template(obj: dict, gates: dict[str, bool] | None = None) -> list[FieldError]:
    """ValidateResourceClaimTemplate: object meta (namespaced), then spec.spec."""
    errs = Errors()
    _validate_object_meta(obj.get("metadata") or {}, errs, namespaced=True)
    spec = obj.get("spec") or {}
    return list(errs) + validate_claim_spec(spec.get("spec") or {}, "spec.spec", gates)


def _drop_claim_fields(spec: dict, gates: dict[str, bool]) -> None:
    # pkg/api/resourceclaimspec DropDisabledFields (called by both strategies' PrepareForCreate),
    # on a create (no old spec, so nothing counts as in use), in its order: firstAvailable
    # (DRAPrioritizedList); tolerations of exactly and of each subrequest (DRADeviceTaints);
    # exactly.adminAccess only (DRAAdminAccess); constraints' distinctAttribute and the requests'
    # and subrequests' capacity (DRAConsumableCapacity).
    devices = spec.get("devices") or {}
    requests = devices.get("requests") or []
    for r in requests:
        if not gates.get("DRAPrioritizedList"):
            r.pop("firstAvailable", None)
    for r in requests:
        entries = [r["exactly"]] if isinstance(r.get("exactly"), dict) else []
        entries += [s for s in r.get("firstAvailable") or [] if isinstance(s, dict)]
        if not gates.get("DRADeviceTaints"):
            for e in entries:
                e.pop("tolerations", None)
        if not gates.get("DRAAdminAccess") and entries and entries[0] is r.get("exactly"):
            entries[0].pop("adminAccess", None)
        if not gates.get("DRAConsumableCapacity"):
            for e in entries:
                e.pop("capacity", None)
    if not gates.get("DRAConsumableCapacity"):
        for c in devices.get("constraints") or []:
            c.pop("distinctAttribute", None)


def validate_manifest(doc: dict, gates: dict[str, bool]) -> list[FieldError]:
    """The API server's verdict on a create of `doc` with `gates` ([] for kinds not ported here)."""
    if doc.get("apiVersion") != "resource.k8s.io/v1":
        return []
    doc = copy.deepcopy(doc)
    kind = doc.get("kind")
    if kind == "DeviceClass":
        # pkg/registry/resource/deviceclass/strategy.go dropDisabledDRAExtendedResourceFields
        if not gates.get("DRAExtendedResource"):
            (doc.get("spec") or {}).pop("extendedResourceName", None)
        return validate_device_class(doc)
    if kind == "ResourceClaim":
        _drop_claim_fields(doc.get("spec") or {}, gates)
        return validate_resource_claim(doc, gates)
    if kind == "ResourceClaimTemplate":
        _drop_claim_fields((doc.get("spec") or {}).get("spec") or {}, gates)
        return validate_resource_claim_template(doc, gates)
    return []


__all__ = [
    "validate_claim_spec",
    "validate_device_class",
    "validate_manifest",
    "validate_resource_claim",
    "validate_resource_claim_template",
]
