"""Reading a hold back: `parse_hold` makes a HoldOnDisk of a `bcd-*.json` file's bytes, or says why it is NotAHold.

The hold IS its CDI spec (see cdi), so the file is the whole record: the
converger keeps and releases holds by what this reads, and nothing else. A
file on disk may be anyone's, so it is decoded within bounds and every fact
is checked again as HoldContent (content) checks it on the way in.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import msgspec

from shared.fsutil import content_digest
from shared.schemas import Limits
from shared.schemas.codec import BoundedDecoder, bounded_json_loads
from shared.schemas.common import ID_RE, INT64_MAX, reserved_env_key
from shared.slices import slice_name, slice_names

from .cdi import qualified_names, render_cdi_spec
from .consumer import consumer_spec
from .content import (
    ANN_ALLOCATION,
    ANN_BINDING,
    ANN_CGROUP_PARENT,
    ANN_DEVICE_ID,
    ANN_GENERATION,
    ANN_LIMITS,
    ANN_RESERVATION,
    ANNOTATIONS_MAX_BYTES,
    ATOM_RE,
    BINDING_HOLD,
    BINDING_KUBERNETES,
    DISK_BINDINGS,
    KIND,
    hold_file_name,
)

#: parse_hold's bounds: a CDI spec read back is decoded at most this large and 64 levels deep.
HOLD_FILE_MAX_BYTES = 8 * 1024 * 1024
_LIMITS_DECODER = BoundedDecoder(Limits, max_bytes=ANNOTATIONS_MAX_BYTES, what="limits annotation")

# Patterns end in `\Z`, not `$`: `$` also matches before a trailing newline.
_GENERATION_RE = re.compile(r"^(0|[1-9][0-9]{0,18})\Z")


@dataclass(frozen=True)
class HoldOnDisk:
    """A hold as its CDI spec on disk says it is."""

    allocation_id: str
    reservation_id: str
    generation: int
    binding: str
    #: the real atom ids, from each device's bcd.dev/device-id, in file order.
    devices: tuple[str, ...]
    cgroup_parent: str = ""
    limits: Limits | None = None
    #: "bcd.dev/gpu=<name>" of each device.
    cdi_names: tuple[str, ...] = ()
    #: content_digest of the consumer copy this hold spec makes (consumer_file_bytes); b"" when
    #: the reader did not compute it. Not part of the hold's identity.
    consumer_digest: bytes = field(default=b"", compare=False)
    #: the assignment's KEY=VALUE lines, as its spec carries them (after the lines bcd sets itself).
    env: tuple[str, ...] = field(default=(), compare=False)
    #: content_digest of the spec file's own bytes, as read: the converger compares it with the
    #: digest of what it wrote (ConvergerState.written), so an edit that still parses is seen.
    digest: bytes = field(default=b"", compare=False)

    @property
    def sliced(self) -> bool:
        return bool(self.cgroup_parent)

    @property
    def legacy_slice(self) -> bool:
        """Bound before a `-` of the id was spelled `.`: it names `legacy_slice_name` (with `\\x2d`)."""
        return bool(self.cgroup_parent) and self.cgroup_parent != slice_name(self.allocation_id)


class NotAHold(Exception):
    """A `bcd-*.json` file that is not a bcd hold; the converger logs it and leaves it alone."""

    def __init__(self, filename: str, reason: str) -> None:
        super().__init__(f"{filename}: {reason}")
        self.filename = filename
        self.reason = reason


def parse_hold(filename: str, data: bytes) -> HoldOnDisk:
    """Read a hold back from its CDI spec; NotAHold says why a file is not one.

    `filename` is the file's name (a path is reduced to its name), which must
    be `bcd-<allocation>.json` for the allocation its annotation names.
    """
    name = PurePath(filename).name

    def refuse(reason: str) -> NotAHold:
        return NotAHold(name, reason)

    try:
        spec = bounded_json_loads(data, HOLD_FILE_MAX_BYTES, "CDI spec")
    except (ValueError, UnicodeDecodeError) as exc:
        raise refuse(f"not valid JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise refuse("not a JSON object")
    if spec.get("kind") != KIND:
        raise refuse(f"kind is {spec.get('kind')!r}, not {KIND!r}")
    annotations = spec.get("annotations")
    if not isinstance(annotations, dict):
        raise refuse("no annotations")
    allocation = annotations.get(ANN_ALLOCATION)
    if not isinstance(allocation, str):
        raise refuse(f"no {ANN_ALLOCATION} annotation")
    if not ID_RE.search(allocation):
        raise refuse(f"{ANN_ALLOCATION} {allocation!r} is not a valid id")
    if name != hold_file_name(allocation):
        raise refuse(f"{ANN_ALLOCATION} {allocation!r} does not match the file name")
    reservation = annotations.get(ANN_RESERVATION)
    if not isinstance(reservation, str) or not ID_RE.search(reservation):
        raise refuse(f"{ANN_RESERVATION} missing or not a valid id")
    generation = annotations.get(ANN_GENERATION)
    if not isinstance(generation, str) or not _GENERATION_RE.match(generation) or int(generation) > INT64_MAX:
        # exactly what a writer writes: a spec's generation, a non-negative int64
        raise refuse(f"{ANN_GENERATION} missing or not a non-negative int64")
    cgroup_parent = annotations.get(ANN_CGROUP_PARENT, "")
    # the converger stops this unit by name: only our own slice name is trusted
    # (or the one bcd gave it before a '-' of the id was spelled '.': that hold
    # is kept, released, and rewritten under the current name once it can be)
    if cgroup_parent not in ("", *slice_names(allocation)):
        raise refuse(f"{ANN_CGROUP_PARENT} {cgroup_parent!r} is not {slice_name(allocation)}")
    binding = annotations.get(ANN_BINDING)
    if binding is None:
        binding = _binding_without_annotation(spec)
    elif binding not in DISK_BINDINGS:
        raise refuse(f"{ANN_BINDING} {binding!r} is not one of {', '.join(DISK_BINDINGS)}")
    limits: Limits | None = None
    if ANN_LIMITS in annotations:
        raw = annotations[ANN_LIMITS]
        try:
            limits = _LIMITS_DECODER.decode(raw if isinstance(raw, str) else b"")
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise refuse(f"{ANN_LIMITS} is not valid limits ({exc})") from None
    devices = spec.get("devices")
    if not isinstance(devices, list) or not devices:
        raise refuse("no devices")
    atoms: list[str] = []
    for i, device in enumerate(devices):
        dev_annotations = device.get("annotations") if isinstance(device, dict) else None
        atom = dev_annotations.get(ANN_DEVICE_ID) if isinstance(dev_annotations, dict) else None
        if not isinstance(atom, str) or not ATOM_RE.search(atom):
            raise refuse(f"devices[{i}] has no valid {ANN_DEVICE_ID} annotation")
        if not isinstance(device.get("name"), str):
            raise refuse(f"devices[{i}] has no name")
        atoms.append(atom)
    return HoldOnDisk(
        allocation_id=allocation,
        reservation_id=reservation,
        generation=int(generation),
        binding=binding,
        devices=tuple(atoms),
        cgroup_parent=cgroup_parent,
        limits=limits,
        cdi_names=tuple(qualified_names(spec)),
        consumer_digest=content_digest(render_cdi_spec(consumer_spec(spec))),
        env=_assignment_env(spec),
        digest=content_digest(data),
    )


def _assignment_env(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """The assignment's env lines of a hold spec: its spec-level env without the keys bcd sets
    itself (a spec can never set those, so what is left is exactly what it asked for)."""
    edits = spec.get("containerEdits")
    env = edits.get("env") if isinstance(edits, Mapping) else None
    if not isinstance(env, list):
        return ()
    return tuple(e for e in env if isinstance(e, str) and "=" in e and not reserved_env_key(e.split("=", 1)[0]))


def _binding_without_annotation(spec: Mapping[str, Any]) -> str:
    """The binding of a spec written without bcd.dev/binding (the seed's writer).

    That writer put NVIDIA_VISIBLE_DEVICES into the CDI spec for every hold
    except a Kubernetes one. In doubt the answer is Kubernetes, whose release
    waits for pods to let go of the devices.
    """
    edits = spec.get("containerEdits")
    env = edits.get("env") if isinstance(edits, Mapping) else None
    if isinstance(env, list) and any(isinstance(e, str) and e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in env):
        return BINDING_HOLD
    return BINDING_KUBERNETES
