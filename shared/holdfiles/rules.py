"""The CDI rules, checked over every file of a CDI directory: bcd's own checks, and the official JSON schema.

`check_cdi_rules` checks what the schema does not cover (bcd's files at
exactly their lowest cdiVersion, device names valid and unique per kind
across all files, annotation keys, no device a runtime rejects as empty);
`validate_against_schema` checks a spec against the schema itself. A spec bcd
builds meets both by construction (content, cdi): only the tests call them,
over the specs bcd writes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .cdi import CDI_VERSIONS, min_cdi_version, runtime_counts
from .content import ANNOTATIONS_MAX_BYTES

# Patterns end in `\Z`, not `$`: `$` also matches before a trailing newline.
_HOLD_FILE_RE = re.compile(r"^bcd-(?P<allocation>.+)\.json\Z")
#: CDI device names: letters, digits, `_ . - :`, alphanumeric at both ends.
_DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?\Z")
#: a vendor or class name of a kind: starts with a letter, ends alphanumeric.
_KIND_PART = r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
_KIND_RE = re.compile(rf"^{_KIND_PART}/{_KIND_PART}\Z")
#: an annotation key as Kubernetes (and so the CDI library) checks it: an
#: optional DNS-subdomain prefix and `/`, then a name of at most 63 characters.
_ANN_PREFIX_RE = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*\Z")
_ANN_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def _annotation_problems(where: str, annotations: Any) -> list[str]:
    if annotations is None:
        return []
    if not isinstance(annotations, Mapping):
        return [f"{where}: annotations are not an object"]
    problems: list[str] = []
    size = 0
    for key, value in annotations.items():
        if not isinstance(value, str):
            problems.append(f"{where}: annotation {key!r} is not a string")
            continue
        size += len(key) + len(value)
        prefix, slash, rest = key.rpartition("/")
        if (slash and (len(prefix) > 253 or not _ANN_PREFIX_RE.match(prefix))) or len(rest) > 63 or not (
            _ANN_NAME_RE.match(rest)
        ):
            problems.append(f"{where}: annotation key {key!r} is not a qualified name")
    if size > ANNOTATIONS_MAX_BYTES:
        problems.append(f"{where}: annotations exceed {ANNOTATIONS_MAX_BYTES} bytes")
    return problems


def _env_problems(where: str, edits: Mapping[str, Any]) -> list[str]:
    env = edits.get("env")
    if env is None:
        return []
    if not isinstance(env, list):
        return [f"{where}: env is not a list"]
    # the CDI library: a '=' after at least one character.
    return [f"{where}: env entry {e!r} is not KEY=VALUE" for e in env if not isinstance(e, str) or e.find("=") <= 0]


def check_cdi_rules(files: Mapping[str, Any]) -> list[str]:
    """bcd's own checks of the CDI rules the schema does not cover, over every file of a CDI directory.

    `files` maps a file name to its parsed JSON. Files named `bcd-*.json` are
    ours and must declare exactly min_cdi_version; any other file only at
    least that (what a runtime requires). A device name must be unique per
    kind across ALL files: a runtime drops a name it finds twice. Returns
    readable problems, [] when all is well.
    """
    problems: list[str] = []
    owners: dict[tuple[str, str], list[str]] = {}
    for fname in sorted(files):
        spec = files[fname]
        if not isinstance(spec, Mapping):
            problems.append(f"{fname}: not a JSON object")
            continue
        kind = spec.get("kind")
        if not isinstance(kind, str) or not _KIND_RE.match(kind):
            problems.append(f"{fname}: kind {kind!r} is not of the form vendor.com/class")
        version = spec.get("cdiVersion")
        wanted = min_cdi_version(spec)
        ours = bool(_HOLD_FILE_RE.match(fname))
        if not isinstance(version, str) or (version if ours else version.removeprefix("v")) not in CDI_VERSIONS:
            problems.append(f"{fname}: cdiVersion {version!r} is not a released CDI version")
        elif ours and version != wanted:
            problems.append(f"{fname}: cdiVersion is {version}, the lowest that expresses the content is {wanted}")
        elif _version_key(version.removeprefix("v")) < _version_key(wanted):
            problems.append(f"{fname}: cdiVersion is {version}, the content needs at least {wanted}")
        problems += _annotation_problems(fname, spec.get("annotations"))
        edits = spec.get("containerEdits")
        if edits is not None:
            if isinstance(edits, Mapping):
                problems += _env_problems(f"{fname}: containerEdits", edits)
            else:
                problems.append(f"{fname}: containerEdits is not an object")
        devices = spec.get("devices")
        if not isinstance(devices, list) or not devices:
            problems.append(f"{fname}: no devices (a runtime rejects the spec)")
            continue
        seen: set[str] = set()
        for i, device in enumerate(devices):
            where = f"{fname}: devices[{i}]"
            if not isinstance(device, Mapping):
                problems.append(f"{where}: not an object")
                continue
            name = device.get("name")
            if not isinstance(name, str) or not _DEVICE_NAME_RE.match(name):
                problems.append(
                    f"{where}: name {name!r} is not a valid CDI device name "
                    "(letters, digits, '_', '.', '-', ':', alphanumeric at both ends)"
                )
            elif name in seen:
                problems.append(f"{where}: name {name!r} appears twice in the file")
            else:
                seen.add(name)
                if isinstance(kind, str):
                    owners.setdefault((kind, name), []).append(fname)
            problems += _annotation_problems(where, device.get("annotations"))
            dev_edits = device.get("containerEdits")
            if not isinstance(dev_edits, Mapping) or not runtime_counts(dev_edits):
                problems.append(f"{where}: containerEdits are empty (a runtime rejects the device)")
            else:
                problems += _env_problems(f"{where}: containerEdits", dev_edits)
    for (kind, name), where_found in owners.items():
        if len(where_found) > 1:
            problems.append(
                f"device {kind}={name} appears in {', '.join(where_found)}: a runtime drops it from every file"
            )
    return problems


def _json_path(path: Iterable[Any]) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def validate_against_schema(spec: Mapping[str, Any], schema_dir: Path) -> list[str]:
    """Problems of `spec` against the official CDI JSON schema (draft-07) in `schema_dir`; [] when valid.

    `schema.json` refers to `defs.json` by a relative `$ref`; both are
    registered under their file URIs so the reference resolves. jsonschema is
    imported here: it is a test dependency, and the service never calls this.
    Raises OSError when the schema files cannot be read.
    """
    import jsonschema
    from referencing import Registry
    from referencing.jsonschema import DRAFT7

    schema_dir = Path(schema_dir).resolve()
    schema = json.loads((schema_dir / "schema.json").read_text())
    defs = json.loads((schema_dir / "defs.json").read_text())
    base = schema_dir.as_uri() + "/"
    schema = {"$id": base + "schema.json", **schema}
    registry: Registry[Any] = Registry().with_resources(
        [(base + "schema.json", DRAFT7.create_resource(schema)), (base + "defs.json", DRAFT7.create_resource(defs))]
    )
    validator = jsonschema.Draft7Validator(schema, registry=registry)
    errors = sorted(validator.iter_errors(spec), key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{_json_path(e.absolute_path)}: {e.message}" for e in errors]
