"""bcd's opaque device configs (resource.bcd.dev/v1beta1), and what a claim's allocation asks of each device.

A ResourceClaim (or its DeviceClass) may carry `config[].opaque` entries for this driver: JSON the
API server does not look into (it only bounds it at 10 KiB). This module is the one place that
reads them, so the plugin, the converger and the docs agree on one API. It owns:

- the config API: group `resource.bcd.dev`, version `v1beta1`, kinds `GpuConfig`,
  `MigDeviceConfig` and `VfioDeviceConfig`, with the field names of NVIDIA's
  k8s-dra-driver-gpu (resource.nvidia.com/v1beta1) and Deckhouse's gpu-control-plane, so a
  claim written for either needs only its apiVersion and driver changed;
- `decode_config(parameters)`: strict decoding (like apimachinery's strict serializer, which
  both peers use for claims: case-sensitive keys, unknown and duplicate fields refused,
  apiVersion and kind required), bounds, defaults and checks: (kind, `ClaimSharing`);
- `device_sharing(configs, driver=..., results=...)`: which config each allocated device gets,
  with the peers' precedence (class configs, then claim configs, later wins; see there);
- `consumed(result)`: the shareID and consumed capacity of a shared allocation result;
- `parse_quantity(value)`: Kubernetes quantities, exactly (no rounding up as the API does).

Everything is a pure function of its arguments (no I/O), and every refusal is one `ConfigError`
whose message is one line naming the config (`config[<index in the allocation's config list>]
(<source>, <kind>)`) and the JSON path of the bad field (`$.sharing.mpsConfig...`), because the
message goes back to the user in the claim's prepare error and is all they will see.

Duplicate keys: `json.loads` keeps the last of two equal keys, and so would anything that parses
the claim before this module sees it. `decode_config` finds them in raw parameters (str/bytes),
and in already parsed ones when they were parsed with `object_pairs_hook=strict_object_pairs`
(it marks the objects that had duplicates, so the path can be named here).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import msgspec

from shared.schemas import ClaimSharing
from shared.schemas.bus import CLAIM_MEMORY_MAX, MPS_DEVICES_MAX, MPS_PINNED_MEMORY_MAX

from .devices import ATTRIBUTE_DOMAIN

GROUP = "resource.bcd.dev"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"

#: resource.k8s.io/v1 OpaqueParametersMaxLength: the API server refuses more, so more is not
#: something the API server sent (a checkpoint or a test): refuse it the same way.
PARAMETERS_MAX_BYTES = 10 * 1024
#: the deepest valid config is 4 objects deep ($.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit);
#: a bound well above that keeps a hostile nesting from costing recursion, with a clear message.
PARAMETERS_MAX_DEPTH = 16
#: defaultPerDevicePinnedMemoryLimit entries: a claim has at most 32 devices (CLAIM_DEVICES_MAX),
#: so more keys cannot all name one of them
PER_DEVICE_MAX = MPS_DEVICES_MAX
#: one error message, at most (it ends up in a gRPC error and a Kubernetes event)
MESSAGE_MAX = 400
MIB = 1024 * 1024

SOURCES = ("FromClass", "FromClaim")
STRATEGIES = ("TimeSlicing", "MPS")
INTERVALS = ("Default", "Short", "Medium", "Long")

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
#: a per-device pinned memory key: the device's uuid (as bus.DeviceUuid takes it) or the index
#: of the device among those that share the config (canonical decimal, below PER_DEVICE_MAX)
_DEVICE_UUID = re.compile(r"^(GPU-[0-9a-fA-F-]{36}|MIG-[A-Za-z0-9][A-Za-z0-9/-]{0,127})\Z")
_INDEX = re.compile(r"^(0|[1-9][0-9]?)\Z")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


class ConfigError(Exception):
    """A config (or allocation result) this driver refuses; the message is one line, for the user."""

    def __init__(self, message: str) -> None:
        message = " ".join(message.split())
        if len(message) > MESSAGE_MAX:
            message = message[: MESSAGE_MAX - 3] + "..."
        super().__init__(message)
        self.message = message


# --------------------------------------------------------------------------- the config API
#
# msgspec Structs are the schema: forbid_unknown_fields gives the strict decoding, rename="camel"
# the peers' JSON names (default_active_thread_percentage <-> defaultActiveThreadPercentage).
# Enumerations are plain `str` here and checked after decoding, so the message can list the
# values and say why, rather than msgspec's "Invalid enum value".

#: a resource.Quantity in JSON: a string ("10Gi") or, as apimachinery also accepts, a number
Quantity = str | int


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, rename="camel", frozen=True):
    pass


class MpsConfig(_Strict):
    default_active_thread_percentage: int | None = None
    default_pinned_device_memory_limit: Quantity | None = None
    default_per_device_pinned_memory_limit: dict[str, Quantity] | None = None


class TimeSlicingConfig(_Strict):
    interval: str | None = None


class GpuSharing(_Strict):
    strategy: str
    time_slicing_config: TimeSlicingConfig | None = None
    mps_config: MpsConfig | None = None


class MigDeviceSharing(_Strict):
    # no time_slicing_config: MIG devices cannot be time-sliced (nvidia-smi compute-policy takes
    # whole cards only), so the field is unknown here, as it is in NVIDIA's MigDeviceSharing
    strategy: str
    mps_config: MpsConfig | None = None


# `kind` is the tag; `api_version` has a default only so a config can be built in code: in input
# it is required, and checked before msgspec sees the object (_check_head).
class GpuConfig(_Strict, tag_field="kind", tag="GpuConfig"):
    api_version: str = API_VERSION
    sharing: GpuSharing | None = None


class MigDeviceConfig(_Strict, tag_field="kind", tag="MigDeviceConfig"):
    api_version: str = API_VERSION
    sharing: MigDeviceSharing | None = None


class VfioDeviceConfig(_Strict, tag_field="kind", tag="VfioDeviceConfig"):
    # only apiVersion and kind: the card goes to vfio-pci whole, there is nothing to choose
    # (NVIDIA's iommu settings are not offered: bcd's vfio switcher decides the backend)
    api_version: str = API_VERSION


OpaqueConfig = GpuConfig | MigDeviceConfig | VfioDeviceConfig
KINDS: dict[str, type[GpuConfig] | type[MigDeviceConfig] | type[VfioDeviceConfig]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
    "VfioDeviceConfig": VfioDeviceConfig,
}
#: which config kinds fit which device kind (devices.DeviceKind)
FITS: dict[str, tuple[str, ...]] = {"gpu": ("GpuConfig", "VfioDeviceConfig"), "mig": ("MigDeviceConfig",)}
_DEVICE_WORDS = {"gpu": "whole GPU", "mig": "MIG device"}
#: unknown fields worth a word more than "did you mean"
_HINTS = {
    (MigDeviceSharing, "timeSlicingConfig"): "MIG devices cannot be time-sliced",
}


# --------------------------------------------------------------------------- quantities

_QUANTITY = re.compile(r"^([+-]?)([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?[0-9]+|m|k|M|G|T|P|E)?\Z")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
#: longer than any sensible quantity; with the exponent bound it keeps the arithmetic small
_QUANTITY_MAX_CHARS = 64
_EXPONENT_MAX = 64


def parse_quantity(value: str | int, *, maximum: int = MPS_PINNED_MEMORY_MAX) -> int:
    """A Kubernetes quantity ("10Gi", "512Mi", "1G", "1048576", "1.5Gi", "1e3", 1048576) as an
    exact non-negative integer at most `maximum`.

    The grammar is apimachinery's (binary Ki..Ei, decimal m..E, or an e/E exponent). Unlike
    the API server, which rounds a fraction up, a value that is not a whole number is refused:
    "0.1Ki" is 102.4 bytes, and guessing which byte the user meant would be wrong either way.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(f"a quantity is a string or an integer, not {_type_name(value)}")
    if isinstance(value, int):
        number: Fraction | int = value
    else:
        if len(value) > _QUANTITY_MAX_CHARS:
            raise ConfigError(f"{_clip(value)} is not a quantity (longer than {_QUANTITY_MAX_CHARS} characters)")
        m = _QUANTITY.match(value)
        if not m:
            raise ConfigError(f"{_clip(value)} is not a quantity (like 10Gi, 512Mi, 1G or 1048576)")
        sign, digits, suffix = m.group(1), m.group(2), m.group(3) or ""
        number = Fraction(digits)
        if suffix in _BINARY:
            number *= _BINARY[suffix]
        elif suffix in _DECIMAL:
            number *= _DECIMAL[suffix]
        elif suffix:
            exponent = int(suffix[1:])
            if abs(exponent) > _EXPONENT_MAX:
                raise ConfigError(f"{_clip(value)}: exponent out of range")
            number *= Fraction(10) ** exponent
        if sign == "-":
            number = -number
    if number < 0:
        raise ConfigError(f"{_clip(value)} is negative")
    if isinstance(number, Fraction):
        if number.denominator != 1:
            raise ConfigError(f"{_clip(value)} is not a whole number")
        number = number.numerator
    if number > maximum:
        raise ConfigError(f"{_clip(value)} is more than {maximum}")
    return number


def _pinned_limit(value: Any) -> int:
    """A pinned device memory limit in bytes: MPS takes whole MiB (set_default_device_pinned_mem_limit
    <dev> <N>M), so the quantity is rounded down to whole MiB, as NVIDIA's Value()/1024/1024 does;
    what rounds to 0 is refused (MPS would read 0M as no memory at all)."""
    n = parse_quantity(value, maximum=MPS_PINNED_MEMORY_MAX)
    if n < MIB:
        raise ConfigError(f"{_clip(value)} is less than 1Mi (MPS takes whole MiB)")
    return n // MIB * MIB


# --------------------------------------------------------------------------- decoding one config


class _DuplicateKeys(dict):
    """A JSON object that had a key twice (what strict_object_pairs returns for it)."""

    duplicates: tuple[str, ...] = ()


def strict_object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A `json.loads` object_pairs_hook that keeps the duplicate keys of each object in sight:
    an object without duplicates is a plain dict; one with them is a dict (the last value wins,
    as without the hook) that `decode_config` refuses, naming the key and its path."""
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    dupes = []
    for key, _ in pairs:
        if key in seen and key not in dupes:
            dupes.append(key)
        seen.add(key)
    marked = _DuplicateKeys(obj)
    marked.duplicates = tuple(dupes)
    return marked


def decode_config(parameters: Any) -> tuple[str, ClaimSharing]:
    """One config's `opaque.parameters` -> (its kind, what it asks of a device of that kind).

    `parameters` is the parsed JSON (a dict, as the API server's answer decodes to) or the raw
    JSON text (str or bytes). Raises ConfigError with the JSON path of the first problem (the
    caller, `device_sharing`, puts the config's index and source in front).
    """
    if isinstance(parameters, (str, bytes, bytearray)):
        parameters = _loads(parameters)
    else:
        _check_tree(parameters)
        size = len(json.dumps(parameters, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass"))
        if size > PARAMETERS_MAX_BYTES:
            raise ConfigError(f"parameters are {size} bytes, more than {PARAMETERS_MAX_BYTES} (OpaqueParametersMaxLength)")
    cls = _check_head(parameters)
    try:
        config = msgspec.convert(parameters, type=cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(cls, str(exc))) from None
    return parameters["kind"], _sharing(config)


def _loads(raw: str | bytes | bytearray) -> Any:
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    if len(data) > PARAMETERS_MAX_BYTES:
        raise ConfigError(f"parameters are {len(data)} bytes, more than {PARAMETERS_MAX_BYTES} (OpaqueParametersMaxLength)")
    # before json.loads: its recursion would fail (RecursionError) on deep input, not refuse it
    depth = _max_depth(data)
    if depth > PARAMETERS_MAX_DEPTH:
        raise ConfigError(f"parameters are nested {depth} levels deep, more than {PARAMETERS_MAX_DEPTH}")
    try:
        obj = json.loads(data, object_pairs_hook=strict_object_pairs)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"parameters are not JSON: {exc}") from None
    _check_tree(obj)
    return obj


def _max_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings not counted)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _check_tree(obj: Any) -> None:
    """Parsed parameters are JSON values only, bounded (depth, nodes) and without duplicate keys.

    Iterative, so a deep object is refused rather than overflowing; each node is at least one
    byte of JSON, so more nodes than the byte bound are over it without encoding them."""
    stack: list[tuple[Any, str, int]] = [(obj, "$", 1)]
    nodes = 0
    while stack:
        value, path, depth = stack.pop()
        nodes += 1
        if nodes > PARAMETERS_MAX_BYTES:
            raise ConfigError(f"parameters are more than {PARAMETERS_MAX_BYTES} bytes (OpaqueParametersMaxLength)")
        if isinstance(value, dict):
            if depth > PARAMETERS_MAX_DEPTH:
                raise ConfigError(f"{_cut(path)}: nested deeper than {PARAMETERS_MAX_DEPTH} levels")
            for key in getattr(value, "duplicates", ()):
                raise ConfigError(f"{_join(path, key)}: duplicate key")
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{_cut(path)}: a key is {_type_name(key)}, not a string")
                stack.append((item, _join(path, key), depth + 1))
        elif isinstance(value, list):
            if depth > PARAMETERS_MAX_DEPTH:
                raise ConfigError(f"{_cut(path)}: nested deeper than {PARAMETERS_MAX_DEPTH} levels")
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif not (value is None or isinstance(value, (str, int, float))):  # bool is an int
            raise ConfigError(f"{_cut(path)}: {_type_name(value)} is not a JSON value")


def _check_head(parameters: Any) -> type[GpuConfig] | type[MigDeviceConfig] | type[VfioDeviceConfig]:
    """apiVersion and kind, before the rest: a config of another API (NVIDIA's, say) or kind is
    told so, rather than about the fields it has that ours lacks."""
    if not isinstance(parameters, dict):
        raise ConfigError(f"$: parameters are a JSON object, not {_type_name(parameters)}")
    if "apiVersion" not in parameters:
        raise ConfigError(f"$.apiVersion: required ({API_VERSION})")
    api_version = parameters["apiVersion"]
    if api_version != API_VERSION:
        raise ConfigError(f"$.apiVersion: {_clip(api_version)} is not {API_VERSION}")
    if "kind" not in parameters:
        raise ConfigError(f"$.kind: required (this driver knows {', '.join(KINDS)})")
    kind = parameters["kind"]
    if not isinstance(kind, str) or kind not in KINDS:
        raise ConfigError(f"$.kind: unknown kind {_clip(kind)} (this driver knows {', '.join(KINDS)})")
    return KINDS[kind]


_MSGSPEC_ERROR = re.compile(r"^(?P<what>.*?)(?: - at `(?P<path>\$[^`]*)`)?\Z", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`\Z", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`\Z", re.S)


def _explain(cls: type, message: str) -> str:
    """msgspec's ValidationError, as '<path>: <what>' with a suggestion for a misspelt field."""
    m = _MSGSPEC_ERROR.match(message)
    what, path = (m.group("what"), m.group("path") or "$") if m else (message, "$")
    if u := _UNKNOWN.match(what):
        name = u.group("name")
        return f"{_join(path, name)}: unknown field{_suggest(cls, path, name)}"
    if u := _MISSING.match(what):
        return f"{_join(path, u.group('name'))}: required"
    what = what.replace("`", "").replace(" | null", "")
    return f"{path}: {what[:1].lower()}{what[1:]}"


def _suggest(root: type, path: str, name: str) -> str:
    """' (did you mean X?)' for an unknown field close to a known one at `path` ('' if none)."""
    cls: Any = root
    for part in path[2:].split(".") if path != "$" else ():
        fields = {f.encode_name: f.type for f in msgspec.structs.fields(cls)}
        cls = _struct_of(fields.get(part))
        if cls is None:
            return ""
    known = [f.encode_name for f in msgspec.structs.fields(cls)] + (["kind"] if cls is root else [])
    match = next((k for k in known if k.lower() == name.lower()), None)
    if match is None:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        match = close[0] if close else None
    notes = [f"did you mean {match}?"] if match else []
    if hint := _HINTS.get((cls, name)):
        notes.append(hint)
    if not notes and cls is VfioDeviceConfig:
        notes.append("VfioDeviceConfig has only apiVersion and kind")
    return f" ({'; '.join(notes)})" if notes else ""


def _struct_of(tp: Any) -> Any:
    """The Struct class in a field type (`X | None` -> X), or None."""
    for t in getattr(tp, "__args__", (tp,)):
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            return t
    return None


def _sharing(config: OpaqueConfig) -> ClaimSharing:
    """Defaults and checks of a decoded config -> ClaimSharing (paths as in the JSON)."""
    if isinstance(config, VfioDeviceConfig):
        return ClaimSharing(strategy="Vfio")
    sharing = config.sharing
    if sharing is None:  # no sharing: the device is the claim's alone
        return ClaimSharing()
    if sharing.strategy not in STRATEGIES:
        raise ConfigError(
            f"$.sharing.strategy: {_clip(sharing.strategy)} is not a sharing strategy"
            f" ({' or '.join(STRATEGIES)}; leave sharing out for a device of the claim's own)"
        )
    time_slicing = getattr(sharing, "time_slicing_config", None)
    if sharing.strategy == "TimeSlicing":
        if sharing.mps_config is not None:
            raise ConfigError("$.sharing.mpsConfig: cannot be used with strategy TimeSlicing")
        if isinstance(config, MigDeviceConfig):
            # MIG devices cannot be time-sliced: their compute is their own slice of the card
            # already. The peers accept the strategy here (NVIDIA's default MIG config even sets
            # it), so it is accepted and changes nothing: the device is as an exclusive one.
            return ClaimSharing()
        interval = time_slicing.interval if time_slicing is not None else None
        if interval is None:  # no timeSlicingConfig, or no interval in it: the card's default slice
            interval = "Default"
        elif interval not in INTERVALS:
            raise ConfigError(
                f"$.sharing.timeSlicingConfig.interval: {_clip(interval)} is not a time-slice interval ({', '.join(INTERVALS)})"
            )
        return ClaimSharing(strategy="TimeSlicing", interval=interval)  # type: ignore[arg-type]
    # MPS
    if time_slicing is not None:
        raise ConfigError("$.sharing.timeSlicingConfig: cannot be used with strategy MPS")
    mps = sharing.mps_config or MpsConfig()
    path = "$.sharing.mpsConfig"
    percent = mps.default_active_thread_percentage
    if percent is not None and not 1 <= percent <= 100:
        # the share of the device's threads each client may use: MPS takes 1..100, and 0 would
        # leave a client nothing to run on (leave it out for MPS's own default, 100)
        raise ConfigError(
            f"{path}.defaultActiveThreadPercentage: {_clip(percent)} is not 1..100"
            " (the percentage of the device's threads each client may use; 0 would leave it none)"
        )
    pinned = None
    if mps.default_pinned_device_memory_limit is not None:
        pinned = _at(f"{path}.defaultPinnedDeviceMemoryLimit", _pinned_limit, mps.default_pinned_device_memory_limit)
    per_device: dict[str, int] = {}
    limits = mps.default_per_device_pinned_memory_limit or {}
    per_path = f"{path}.defaultPerDevicePinnedMemoryLimit"
    if len(limits) > PER_DEVICE_MAX:
        raise ConfigError(f"{per_path}: {len(limits)} entries, more than {PER_DEVICE_MAX} (a claim's devices at most)")
    for key, value in limits.items():
        if not (_DEVICE_UUID.match(key) or _INDEX.match(key) and int(key) < PER_DEVICE_MAX):
            raise ConfigError(
                f"{_join(per_path, key)}: the key is a device uuid (GPU-... or MIG-...)"
                f" or the index of a device of the claim (0..{PER_DEVICE_MAX - 1})"
            )
        per_device[key] = _at(_join(per_path, key), _pinned_limit, value)
    return ClaimSharing(strategy="MPS", active_thread_percentage=percent, pinned_memory_bytes=pinned, pinned_memory=per_device)


def _at(path: str, parse: Any, value: Any) -> Any:
    try:
        return parse(value)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.message}") from None


# --------------------------------------------------------------------------- picking each device's config


def device_sharing(configs: Sequence[Any] | None, *, driver: str, results: Sequence[tuple[str, str]]) -> list[ClaimSharing]:
    """What the allocation asks of each of this driver's results, in order.

    `configs` is `status.allocation.devices.config` as the API server sends it (None: none);
    `results` the (request, device kind "gpu"|"mig") of each of this driver's results.

    The peers' precedence (NVIDIA's GetOpaqueDeviceConfigs and prepareDevices): class configs,
    then claim configs, each in list order, lowest to highest; for each result the highest one
    that applies wins. A config applies when its `requests` name the result's request (exactly,
    or "main" for "main/sub": a subrequest of firstAvailable, as the Kubernetes docs say, and
    as Deckhouse does), or when it names none (then it applies to all). A named config whose
    kind does not fit the device is an error (the user asked for something impossible); an
    unnamed one that does not fit is passed over (NVIDIA's rule), so a class-wide GpuConfig does
    not break a claim's MIG device. No config: Exclusive.

    Every config of this driver is decoded (once) and checked even if no result takes it, as
    NVIDIA does: a broken config is reported, not silently unused. Other drivers' configs are
    theirs. Raises ConfigError: the first problem, naming the config.
    """
    if configs is None:
        configs = ()
    if not isinstance(configs, (list, tuple)):
        raise ConfigError(f"allocation config: a list, not {_type_name(configs)}")
    by_source: dict[str, list[tuple[str, tuple[str, ...], str, ClaimSharing]]] = {s: [] for s in SOURCES}
    for index, entry in enumerate(configs):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"config[{index}]: an object, not {_type_name(entry)}")
        source = entry.get("source")
        if source not in SOURCES:
            raise ConfigError(f"config[{index}]: invalid source {_clip(source)} ({' or '.join(SOURCES)})")
        opaque = entry.get("opaque")
        if opaque is None:
            # the API has only opaque configs today; anything else is of a newer API than ours
            raise ConfigError(f"{_label(index, source)}: only opaque parameters are supported by this driver")
        if not isinstance(opaque, Mapping):
            raise ConfigError(f"{_label(index, source)}: opaque is an object, not {_type_name(opaque)}")
        if opaque.get("driver") != driver:
            continue
        requests = entry.get("requests") or ()
        if not isinstance(requests, (list, tuple)) or not all(isinstance(r, str) for r in requests):
            raise ConfigError(f"{_label(index, source)}: requests are a list of request names")
        if "parameters" not in opaque:
            raise ConfigError(f"{_label(index, source)}: opaque.parameters: required")
        parameters = opaque["parameters"]
        try:
            kind, sharing = decode_config(parameters)
        except ConfigError as exc:
            # name the kind too when it is one of ours (the error is then about its fields)
            ours = isinstance(parameters, dict) and parameters.get("apiVersion") == API_VERSION and parameters.get("kind") in KINDS
            raise ConfigError(f"{_label(index, source, parameters['kind'] if ours else '')}: {exc.message}") from None
        by_source[source].append((_label(index, source, kind), tuple(requests), kind, sharing))
    ordered = by_source["FromClass"] + by_source["FromClaim"]

    out: list[ClaimSharing] = []
    for request, device_kind in results:
        if device_kind not in FITS:
            raise ValueError(f"device kind {device_kind!r} is not one of {sorted(FITS)}")
        chosen = ClaimSharing()
        for label, requests, kind, sharing in reversed(ordered):
            fits = kind in FITS[device_kind]
            if requests:
                if not any(request == name or request.startswith(name + "/") for name in requests):
                    continue
                if not fits:
                    raise ConfigError(
                        f"{label}: a {kind} cannot apply to the {_DEVICE_WORDS[device_kind]} of request {_clip(request)}"
                        f" (a {_DEVICE_WORDS[device_kind]} takes {' or '.join(FITS[device_kind])})"
                    )
            elif not fits:
                continue
            chosen = sharing
            break
        out.append(chosen)
    return out


# --------------------------------------------------------------------------- consumed capacity

SHARE_PERCENT = "sharePercent"
MEMORY = "memory"


def consumed(result: Mapping[str, Any]) -> tuple[str, int | None, int | None]:
    """(shareID or "", sharePercent or None, memory bytes or None) of one allocation result.

    A card published with allowMultipleAllocations gets a shareID per allocation and the
    capacity each consumed (all of the device's capacities, zero ones included: the others,
    multiprocessors say, are not this function's). A capacity name without a domain is the
    driver's own (`memory` = `gpu.bcd.dev/memory`); both spellings at once are refused, as it
    is not clear which one the scheduler counted.
    """
    if not isinstance(result, Mapping):
        raise ConfigError(f"allocation result: an object, not {_type_name(result)}")
    share_id = result.get("shareID")
    if share_id is None:
        share_id = ""
    elif not isinstance(share_id, str) or not _UUID.match(share_id):
        raise ConfigError(f"shareID: {_clip(share_id)} is not a lowercase RFC 4122 uuid")
    capacity = result.get("consumedCapacity")
    if capacity is None:
        capacity = {}
    if not isinstance(capacity, Mapping):
        raise ConfigError(f"consumedCapacity: an object, not {_type_name(capacity)}")

    def one(name: str, maximum: int) -> int | None:
        qualified = f"{ATTRIBUTE_DOMAIN}/{name}"
        if qualified in capacity and name in capacity:
            raise ConfigError(f"consumedCapacity: both {qualified} and {name}")
        key = qualified if qualified in capacity else name if name in capacity else None
        if key is None:
            return None
        return _at(f"consumedCapacity[{key}]", lambda v: parse_quantity(v, maximum=maximum), capacity[key])

    percent = one(SHARE_PERCENT, 100)
    if percent is not None and percent < 1:
        raise ConfigError(f"consumedCapacity[{SHARE_PERCENT}]: 0 is not 1..100")
    memory = one(MEMORY, CLAIM_MEMORY_MAX)
    return share_id, percent, memory


# --------------------------------------------------------------------------- small helpers


def _label(index: int, source: str, kind: Any = "") -> str:
    """How a message names a config: its place in the allocation's config list, its source, its kind."""
    return f"config[{index}] ({source}, {kind})" if kind else f"config[{index}] ({source})"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if _IDENT.match(key) else f"{path}[{_clip(key, 60)}]"


def _cut(path: str, limit: int = 120) -> str:
    return path if len(path) <= limit else path[: limit - 3] + "..."


def _clip(value: Any, limit: int = 60) -> str:
    """A value for a message: its JSON form (so '' and "10" read as strings), cut to `limit`."""
    try:
        text = json.dumps(value, ensure_ascii=True) if isinstance(value, str) else repr(value)
    except Exception:  # pragma: no cover - repr of JSON values does not fail
        text = f"<{_type_name(value)}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__
    )


__all__ = [
    "GROUP",
    "VERSION",
    "API_VERSION",
    "PARAMETERS_MAX_BYTES",
    "PARAMETERS_MAX_DEPTH",
    "PER_DEVICE_MAX",
    "KINDS",
    "FITS",
    "ConfigError",
    "GpuConfig",
    "MigDeviceConfig",
    "VfioDeviceConfig",
    "GpuSharing",
    "MigDeviceSharing",
    "TimeSlicingConfig",
    "MpsConfig",
    "OpaqueConfig",
    "parse_quantity",
    "strict_object_pairs",
    "decode_config",
    "device_sharing",
    "consumed",
]
