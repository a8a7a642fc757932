"""The vendor's own CDI spec (`<cdi_dir>/nvidia.json`), read into the edits bcd copies.

Two services read it: the inventory (to report it) and the converger (to copy
a held device's edits into the hold's CDI spec). Services may import only
`shared` and themselves, so the reader lives here. Nothing here writes the
file; the vendor's toolkit (or the fakehw adapter, or `bcd compose init` for a
compose node's fake host) does, a fake host's with `vendor_spec_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from shared.fsutil import read_regular
from shared.schemas.codec import BoundedDecoder

#: the file name of the vendor's own CDI spec inside cdi_dir.
VENDOR_CDI_FILE = "nvidia.json"
#: the largest vendor spec read (NVIDIA's, with every library mount, is tens of KiB).
VENDOR_CDI_MAX_BYTES = 16 * 1024 * 1024


def vendor_spec_bytes(spec: Mapping[str, Any]) -> bytes:
    """The bytes of `<cdi_dir>/nvidia.json` for a vendor spec a fake host file gives (`vendor_cdi_spec`):
    one rendering for every writer, so a spec already there with these bytes is never rewritten."""
    return msgspec.json.format(msgspec.json.encode(spec), indent=2) + b"\n"


class VendorSpecError(Exception):
    """The vendor CDI spec exists but cannot be read or decoded; the text names file and field."""


@dataclass(frozen=True)
class VendorCdi:
    """The vendor's CDI edits, from its JSON spec in cdi_dir (never from the wire).

    `devices` is keyed by the names the vendor spec uses: the GPU index ("0"),
    the UUID ("GPU-..."), a MIG device ("0:1" or "MIG-..."), "all". The edit
    objects are the spec's JSON as decoded; treat them as read-only and copy
    before changing.
    """

    path: str
    cdi_version: str
    kind: str
    container_edits: Mapping[str, Any] = field(default_factory=dict)
    devices: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def edits_for(self, *names: str) -> Mapping[str, Any] | None:
        """The edits of the first of `names` the vendor spec has (e.g. UUID, then index)."""
        for name in names:
            if name in self.devices:
                return self.devices[name]
        return None


class _CdiDevice(msgspec.Struct):
    name: str
    containerEdits: dict[str, Any] = {}


class _CdiSpecFile(msgspec.Struct):
    """Only the parts of a CDI spec bcd reads; the rest is left alone."""

    cdiVersion: str
    kind: str
    devices: list[_CdiDevice] = []
    containerEdits: dict[str, Any] = {}


_CDI_DECODER = BoundedDecoder(_CdiSpecFile, max_bytes=16 * 1024 * 1024, what="vendor CDI spec")


def vendor_cdi_from_json(data: bytes, path: str) -> VendorCdi:
    """Decode a vendor CDI spec; VendorSpecError names the file and the field."""
    try:
        spec = _CDI_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise VendorSpecError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise VendorSpecError(f"{path}: not valid JSON ({exc})") from None
    devices: dict[str, Mapping[str, Any]] = {}
    for i, dev in enumerate(spec.devices):
        if dev.name in devices:
            # a CDI runtime drops a name that appears twice; so do we, loudly.
            raise VendorSpecError(f"{path}: device name {dev.name!r} appears twice - at `$.devices[{i}].name`")
        devices[dev.name] = dev.containerEdits
    return VendorCdi(
        path=path,
        cdi_version=spec.cdiVersion,
        kind=spec.kind,
        container_edits=spec.containerEdits,
        devices=devices,
    )


def read_vendor_cdi_bytes(cdi_dir: Path | str, filename: str = VENDOR_CDI_FILE) -> bytes | None:
    """The bytes of the vendor spec `<cdi_dir>/<filename>`, not decoded; None when there is none."""
    path = Path(cdi_dir) / filename
    try:
        # never a FIFO, a device or a symlink, never more than the cap (read_regular)
        return read_regular(path, max_bytes=VENDOR_CDI_MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise VendorSpecError(f"{path}: cannot read ({exc.strerror})") from None


def read_vendor_cdi(cdi_dir: Path | str, filename: str = VENDOR_CDI_FILE) -> VendorCdi | None:
    """The vendor spec `<cdi_dir>/<filename>`; None when there is none."""
    data = read_vendor_cdi_bytes(cdi_dir, filename)
    return None if data is None else vendor_cdi_from_json(data, str(Path(cdi_dir) / filename))


__all__ = [
    "VENDOR_CDI_FILE",
    "VENDOR_CDI_MAX_BYTES",
    "VendorSpecError",
    "VendorCdi",
    "vendor_cdi_from_json",
    "read_vendor_cdi_bytes",
    "read_vendor_cdi",
    "vendor_spec_bytes",
]
