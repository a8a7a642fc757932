"""`bcd cdi list`: the CDI devices bcd created, read from the hold files alone.

A hold IS its CDI spec (`<cdi_dir>/bcd-<allocation>.json`), so everything
here comes from those files, parsed with `shared.holdfiles.parse_hold` and
read with `shared.fsutil.read_regular` (never a symlink followed, never a
FIFO or a device opened, size-capped). No bus: a stopped node still has its
files, and a container can still be started on them.

For each hold: its allocation, reservation, generation, binding and slice,
every device's CDI name (`bcd.dev/gpu=<name>`) with the atom behind it (the
`bcd.dev/device-id` annotation), and how each runtime asks for them:

* docker (25+, with the `cdi` feature on) and podman take `--device <name>`
  once per device, and `--cgroup-parent <slice>` for a sliced hold;
* containerd: `ctr run --device <name>` (and nerdctl's `--device`), or, through
  the CRI, the container's CDI device list (`CDIDevices`: `{"name": ...}` per
  device) or the equivalent annotation `cdi.k8s.io/<key>: <name>,<name>`.

A Kubernetes hold's names are for the kubelet (device plugin or DRA); its
runtime lines are shown for debugging only.

`--json` prints `listing_json(...)`, whose shape is stable:

    {"cdi_dir": str, "kind": "bcd.dev/gpu",
     "holds": [{"allocation_id", "reservation_id", "generation": int, "binding",
                "cgroup_parent" ("" when not sliced), "file",
                "devices": [{"name", "qualified_name", "atom_id"}],
                "runtime": {"docker": [argv], "podman": [argv], "ctr": [argv],
                            "cri_cdi_devices": [{"name"}], "cri_annotations": {key: value}}}],
     "problems": [str]}

Holds are sorted by allocation id, devices in file order, `argv` lists
without the image (append your image and command).
"""

from __future__ import annotations

import hashlib
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.fsutil import RefusedFile, is_temp_name, read_regular
from shared.holdfiles import BINDING_KUBERNETES, HOLD_FILE_MAX_BYTES, KIND, NotAHold, parse_hold

#: the CDI library's annotation prefix for device requests through the CRI.
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
#: the longest name after the prefix the CDI library accepts.
_CDI_ANNOTATION_NAME_MAX = 63


@dataclass(frozen=True)
class CdiDevice:
    #: the device name inside the kind ("GPU-<uuid>_gi1_ci0").
    name: str
    #: what a runtime takes: "bcd.dev/gpu=<name>".
    qualified_name: str
    #: the real atom id (the device's bcd.dev/device-id annotation).
    atom_id: str


@dataclass(frozen=True)
class CdiHold:
    allocation_id: str
    reservation_id: str
    generation: int
    binding: str
    cgroup_parent: str
    file: str
    devices: tuple[CdiDevice, ...]

    @property
    def names(self) -> list[str]:
        return [d.qualified_name for d in self.devices]


@dataclass
class CdiListing:
    cdi_dir: str
    holds: list[CdiHold] = field(default_factory=list)
    #: files named like holds that were not read or are not holds, device names used twice, a missing dir.
    problems: list[str] = field(default_factory=list)


def read_cdi_dir(cdi_dir: Path | str) -> CdiListing:
    """Every hold in `cdi_dir`, and what could not be read as one."""
    directory = Path(cdi_dir)
    listing = CdiListing(cdi_dir=str(directory))
    try:
        with os.scandir(directory) as it:
            names = sorted(e.name for e in it)
    except FileNotFoundError:
        listing.problems.append(f"{directory}: no such directory (no hold was ever written here?)")
        return listing
    except NotADirectoryError:
        listing.problems.append(f"{directory}: not a directory")
        return listing
    except OSError as exc:
        listing.problems.append(f"{directory}: cannot list it ({exc.strerror or exc})")
        return listing
    for name in names:
        if is_temp_name(name) or not (name.startswith("bcd-") and name.endswith(".json")):
            continue  # the vendor's spec, someone else's file, an interrupted write
        path = directory / name
        try:
            data = read_regular(path, max_bytes=HOLD_FILE_MAX_BYTES)
            hold = parse_hold(name, data)
        except FileNotFoundError:
            continue  # removed while we listed
        except RefusedFile as exc:
            listing.problems.append(f"{exc}: skipped, not read as a hold")
            continue
        except NotAHold as exc:
            listing.problems.append(f"{path}: not a bcd hold ({exc.reason})")
            continue
        except OSError as exc:
            listing.problems.append(f"{path}: unreadable ({exc.strerror or exc})")
            continue
        devices = tuple(
            CdiDevice(name=qualified.split("=", 1)[1], qualified_name=qualified, atom_id=atom)
            for qualified, atom in zip(hold.cdi_names, hold.devices, strict=True)
        )
        listing.holds.append(
            CdiHold(
                allocation_id=hold.allocation_id,
                reservation_id=hold.reservation_id,
                generation=hold.generation,
                binding=hold.binding,
                cgroup_parent=hold.cgroup_parent,
                file=str(path),
                devices=devices,
            )
        )
    listing.holds.sort(key=lambda h: h.allocation_id)
    seen: dict[str, str] = {}
    for h in listing.holds:
        for d in h.devices:
            other = seen.setdefault(d.qualified_name, h.allocation_id)
            if other != h.allocation_id:
                listing.problems.append(
                    f"{d.qualified_name} is in the holds of both {other} and {h.allocation_id}: a runtime drops both"
                )
    return listing


def annotation_key(allocation_id: str) -> str:
    """The CRI annotation key of a hold's devices: `cdi.k8s.io/bcd_<allocation>`, shortened to the library's 63."""
    name = f"bcd_{allocation_id}"
    if len(name) > _CDI_ANNOTATION_NAME_MAX:
        digest = hashlib.sha256(allocation_id.encode()).hexdigest()[:12]
        name = f"{name[: _CDI_ANNOTATION_NAME_MAX - len(digest) - 1].rstrip('_-')}-{digest}"
    return CDI_ANNOTATION_PREFIX + name


def runtime_args(hold: CdiHold) -> dict[str, Any]:
    """How each runtime asks for the hold's devices (argv lists without the image)."""
    devices = [arg for n in hold.names for arg in ("--device", n)]
    parent = ["--cgroup-parent", hold.cgroup_parent] if hold.cgroup_parent else []
    return {
        "docker": ["docker", "run", *devices, *parent],
        "podman": ["podman", "run", *devices, *parent],
        "ctr": ["ctr", "run", *devices],
        "cri_cdi_devices": [{"name": n} for n in hold.names],
        "cri_annotations": {annotation_key(hold.allocation_id): ",".join(hold.names)},
    }


def listing_json(listing: CdiListing) -> dict[str, Any]:
    """The stable `--json` shape (module docstring)."""
    return {
        "cdi_dir": listing.cdi_dir,
        "kind": KIND,
        "holds": [
            {
                "allocation_id": h.allocation_id,
                "reservation_id": h.reservation_id,
                "generation": h.generation,
                "binding": h.binding,
                "cgroup_parent": h.cgroup_parent,
                "file": h.file,
                "devices": [{"name": d.name, "qualified_name": d.qualified_name, "atom_id": d.atom_id} for d in h.devices],
                "runtime": runtime_args(h),
            }
            for h in listing.holds
        ],
        "problems": list(listing.problems),
    }


def _line(argv: list[str]) -> str:
    return shlex.join(argv) + " IMAGE ..."


def render_listing(listing: CdiListing) -> str:
    count = sum(len(h.devices) for h in listing.holds)
    lines = [f"CDI dir {listing.cdi_dir}: {len(listing.holds)} hold(s), {count} device(s) of kind {KIND}"]
    if not listing.holds:
        lines.append("no holds")
    for h in listing.holds:
        slice_ = f"  slice {h.cgroup_parent}" if h.cgroup_parent else ""
        lines.append(f"hold {h.allocation_id} ({h.reservation_id}) gen {h.generation} {h.binding}{slice_}  {h.file}")
        width = max(len(d.qualified_name) for d in h.devices)
        for d in h.devices:
            lines.append(f"  {d.qualified_name:<{width}}  {d.atom_id}")
        rt = runtime_args(h)
        if h.binding == BINDING_KUBERNETES:
            lines.append("  (a Kubernetes hold: the kubelet asks for these through the device plugin or DRA; by hand only to debug)")
        lines.append(f"  docker:     {_line(rt['docker'])}")
        lines.append(f"  podman:     {_line(rt['podman'])}")
        lines.append(f"  containerd: {_line(rt['ctr'])}")
        ((key, value),) = rt["cri_annotations"].items()
        lines.append(f"  CRI:        CDIDevices {', '.join(h.names)}  (or annotation {key}={value})")
    lines.extend(f"problem: {p}" for p in listing.problems)
    return "\n".join(lines)


__all__ = [
    "CDI_ANNOTATION_PREFIX",
    "CdiDevice",
    "CdiHold",
    "CdiListing",
    "read_cdi_dir",
    "annotation_key",
    "runtime_args",
    "listing_json",
    "render_listing",
]
