"""`bcd cdi list`: the CDI devices bcd created, read from the hold files alone.

A hold IS its CDI spec (`<cdi_dir>/bcd-<allocation>.json`), so everything
here comes from those files, parsed with `shared.holdfiles.parse_hold` and
read with `shared.fsutil.read_regular` (never a symlink followed, never a
FIFO or a device opened, size-capped). No bus: a stopped node still has its
files, and a container can still be started on them.

For each hold: its allocation, reservation, generation, binding and slice,
its spec file and cdiVersion, its consumer copy (`<cdi_consumer_dir>/bcd-<allocation>.json`,
the same devices without annotations at the lowest cdiVersion, for runtimes whose CDI
library is older than v0.6; or that it is missing, or differs from the copy the hold spec
makes), every device's CDI name (`bcd.dev/gpu=<name>`) with the atom behind it (the
`bcd.dev/device-id` annotation), and how each runtime asks for them:

* docker (25+, with the `cdi` feature on) and podman take `--device <name>`
  once per device, and `--cgroup-parent <slice>` for a sliced hold;
* containerd: `ctr run --device <name>` (and nerdctl's `--device`), or, through
  the CRI, the container's CDI device list (`CDIDevices`: `{"name": ...}` per
  device) or the equivalent annotation `cdi.k8s.io/<key>: <name>,<name>`.

The text shows a command line only for a runtime found on this host (bcd.runtimes:
podman, docker, containerd, crio on PATH, with their versions) that can use the hold
(`podman 4.3.1: podman run --device ... IMAGE ...`); for one that cannot, the one line of
what to do instead; with no runtime found, it says so and shows none. The CRI line is
always shown (it is for the kubelet). A Kubernetes hold's names are for the kubelet
(device plugin or DRA); its runtime lines are shown for debugging only. A consumer copy
without a hold spec is a problem: a runtime still finds its devices.

`--json` prints `listing_json(...)`, whose shape is stable (keys are added, never removed):

    {"cdi_dir": str, "cdi_consumer_dir": str ("" when unknown), "kind": "bcd.dev/gpu",
     "holds": [{"allocation_id", "reservation_id", "generation": int, "binding",
                "cgroup_parent" ("" when not sliced), "file", "cdi_version",
                "consumer_copy": null (consumer dir unknown) or
                                 {"file", "cdi_version": str or null, "state": "ok", "stale",
                                  "missing" or "unreadable", "problem": str ("" when ok)},
                "devices": [{"name", "qualified_name", "atom_id"}],
                "runtime": {"docker": [argv], "podman": [argv], "ctr": [argv],
                            "cri_cdi_devices": [{"name"}], "cri_annotations": {key: value}}}],
     "runtimes": [{"name", "path", "version" ("" when unknown), "error", "cdi_library",
                   "highest_cdi_version", "cdi_enabled": bool, "spec_dirs": [str], "config_error",
                   "cgroup_manager" (podman: "systemd", "cgroupfs", "" unknown),
                   "holds": [{"allocation_id", "usable": bool or null (cannot tell), "file" (the
                              file it takes the devices from), "todo", "argv": [str] ([] when it
                              cannot, and for crio: only through the CRI; without --cgroup-parent
                              where the runtime refuses the slice), "note" (why, or "")}]}],
     "problems": [str]}

Holds are sorted by allocation id, devices in file order, runtimes in bcd.runtimes'
order, `argv` lists without the image (append your image and command). `runtime` lists
every runtime's argv whether or not it is on this host; `runtimes` only those found, each
with the command that works on this host.
"""

from __future__ import annotations

import hashlib
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.fsutil import RefusedFile, is_temp_name, read_regular
from shared.holdfiles import BINDING_KUBERNETES, HOLD_FILE_MAX_BYTES, KIND, NotAHold, consumer_file_bytes, parse_hold
from shared.schemas.codec import bounded_json_loads

from .runtimes import HoldFiles, HoldUse, RuntimeFacts, hold_uses

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
class ConsumerCopy:
    """A hold spec's consumer copy in the node's consumer dir."""

    file: str
    #: its cdiVersion; None when it is missing or could not be read.
    cdi_version: str | None
    #: "ok" (the copy the hold spec makes), "stale" (another), "missing" or "unreadable".
    state: str = "ok"
    #: "" when ok; else what is wrong, as a problem line.
    problem: str = ""


@dataclass(frozen=True)
class CdiHold:
    allocation_id: str
    reservation_id: str
    generation: int
    binding: str
    cgroup_parent: str
    file: str
    devices: tuple[CdiDevice, ...]
    #: the hold spec's cdiVersion.
    cdi_version: str = ""
    #: None when the node's consumer dir is unknown (a node.json from before consumer copies).
    consumer: ConsumerCopy | None = None

    @property
    def names(self) -> list[str]:
        return [d.qualified_name for d in self.devices]


@dataclass
class CdiListing:
    cdi_dir: str
    #: where the consumer copies are ("" when unknown).
    consumer_dir: str = ""
    holds: list[CdiHold] = field(default_factory=list)
    #: files named like holds that were not read or are not holds, device names used twice, a missing dir.
    problems: list[str] = field(default_factory=list)


def read_consumer_copy(consumer_dir: Path, name: str, allocation_id: str, hold_spec: bytes) -> ConsumerCopy:
    """The consumer copy `consumer_dir/name` of the hold spec whose bytes are `hold_spec`."""
    path = consumer_dir / name
    try:
        data = read_regular(path, max_bytes=HOLD_FILE_MAX_BYTES)
    except FileNotFoundError:
        why = "a runtime whose CDI library is older than v0.6 does not find this hold's devices"
        return ConsumerCopy(str(path), None, "missing", f"{path}: consumer copy missing: {why}")
    except RefusedFile as exc:
        return ConsumerCopy(str(path), None, "unreadable", f"{exc}: not read as a consumer copy")
    except OSError as exc:
        return ConsumerCopy(str(path), None, "unreadable", f"{path}: unreadable ({exc.strerror or exc})")
    try:
        doc = bounded_json_loads(data, HOLD_FILE_MAX_BYTES, str(path))
    except ValueError as exc:
        return ConsumerCopy(str(path), None, "unreadable", f"{exc}: a runtime skips it")
    version = doc.get("cdiVersion") if isinstance(doc, dict) else None
    if not isinstance(version, str):
        return ConsumerCopy(str(path), None, "unreadable", f"{path}: no cdiVersion: a runtime skips it")
    try:
        same = consumer_file_bytes(allocation_id, hold_spec) == data
    except (NotAHold, ValueError):
        same = False
    if same:
        return ConsumerCopy(str(path), version)
    return ConsumerCopy(str(path), version, "stale", f"{path}: not the consumer copy its hold spec makes (stale or edited; the converger rewrites it)")


def read_cdi_dir(cdi_dir: Path | str, consumer_dir: Path | str = "") -> CdiListing:
    """Every hold in `cdi_dir` with its consumer copy in `consumer_dir` ("": unknown), and what
    could not be read as one (a copy without a hold among it)."""
    directory = Path(cdi_dir)
    copies = Path(consumer_dir) if str(consumer_dir) else None
    listing = CdiListing(cdi_dir=str(directory), consumer_dir=str(copies) if copies else "")
    if copies is not None and os.path.realpath(copies) == os.path.realpath(directory):
        listing.problems.append(f"{copies}: the consumer dir is the CDI dir itself: no consumer copy is read")
        copies = None
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
        version = bounded_json_loads(data, HOLD_FILE_MAX_BYTES, str(path)).get("cdiVersion")
        consumer = read_consumer_copy(copies, name, hold.allocation_id, data) if copies is not None else None
        if consumer is not None and consumer.problem:
            listing.problems.append(consumer.problem)
        listing.holds.append(
            CdiHold(
                allocation_id=hold.allocation_id,
                reservation_id=hold.reservation_id,
                generation=hold.generation,
                binding=hold.binding,
                cgroup_parent=hold.cgroup_parent,
                file=str(path),
                devices=devices,
                cdi_version=version if isinstance(version, str) else "",
                consumer=consumer,
            )
        )
    listing.holds.sort(key=lambda h: h.allocation_id)
    if copies is not None:
        listing.problems.extend(_copies_without_hold(copies, set(names), directory))
    seen: dict[str, str] = {}
    for h in listing.holds:
        for d in h.devices:
            other = seen.setdefault(d.qualified_name, h.allocation_id)
            if other != h.allocation_id:
                listing.problems.append(
                    f"{d.qualified_name} is in the holds of both {other} and {h.allocation_id}: a runtime drops both"
                )
    return listing


def _copies_without_hold(copies: Path, in_cdi_dir: set[str], cdi_dir: Path) -> list[str]:
    """The consumer copies with no file of their name in `cdi_dir` (`in_cdi_dir`: the names there)."""
    try:
        with os.scandir(copies) as it:
            names = sorted(e.name for e in it)
    except OSError:
        return []  # each hold's copy says it is missing
    return [
        f"{copies / n}: a consumer copy without a hold spec in {cdi_dir}: a runtime still finds its devices"
        for n in names
        if n.startswith("bcd-") and n.endswith(".json") and not is_temp_name(n) and n not in in_cdi_dir
    ]


def hold_files(listing: CdiListing) -> list[HoldFiles]:
    """Each hold's two files, as bcd.runtimes.hold_use takes them."""
    return [
        HoldFiles(
            allocation_id=h.allocation_id,
            spec_file=h.file,
            spec_version=h.cdi_version,
            copy_file=h.consumer.file if h.consumer is not None else "",
            copy_version=h.consumer.cdi_version if h.consumer is not None else None,
        )
        for h in listing.holds
    ]


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


#: the key of runtime_args whose argv each runtime runs (crio has none: only through the CRI).
RUNTIME_ARGV_KEY: dict[str, str] = {"podman": "podman", "docker": "docker", "containerd": "ctr"}


def runtime_argv(use: HoldUse, hold: CdiHold, rt: RuntimeFacts | None = None) -> list[str]:
    """The command line `use.runtime` asks for the hold with ([] when it cannot, or has none): a
    command that works on this host, so without `--cgroup-parent` where `rt` refuses the slice."""
    key = RUNTIME_ARGV_KEY.get(use.runtime)
    if not (use.usable and key):
        return []
    argv = list(runtime_args(hold)[key])
    if rt is not None and rt.slice_parent_refused and hold.cgroup_parent:
        argv = argv[: argv.index("--cgroup-parent")]
    return argv


def slice_note(rt: RuntimeFacts, hold: CdiHold) -> str:
    """Why the command leaves out the hold's slice ("" when it does not)."""
    if not (rt.slice_parent_refused and hold.cgroup_parent):
        return ""
    return (
        f"not in the hold's slice {hold.cgroup_parent}, so without its limits: {rt.label} runs with the cgroupfs "
        "manager, which refuses a systemd slice as --cgroup-parent; on a host whose init is systemd use "
        f"--cgroup-manager systemd --cgroup-parent {hold.cgroup_parent}"
    )


def _uses(listing: CdiListing, runtimes: list[RuntimeFacts], same_dirs: Mapping[str, str] | None) -> dict[tuple[str, str], HoldUse]:
    return {(u.runtime, u.allocation_id): u for u in hold_uses(runtimes, hold_files(listing), same_dirs)}


def _consumer_json(c: ConsumerCopy | None) -> dict[str, Any] | None:
    return None if c is None else {"file": c.file, "cdi_version": c.cdi_version, "state": c.state, "problem": c.problem}


def listing_json(listing: CdiListing, runtimes: list[RuntimeFacts], same_dirs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The stable `--json` shape (module docstring); `runtimes`: those found on this host."""
    uses = _uses(listing, runtimes, same_dirs)
    return {
        "cdi_dir": listing.cdi_dir,
        "cdi_consumer_dir": listing.consumer_dir,
        "kind": KIND,
        "holds": [
            {
                "allocation_id": h.allocation_id,
                "reservation_id": h.reservation_id,
                "generation": h.generation,
                "binding": h.binding,
                "cgroup_parent": h.cgroup_parent,
                "file": h.file,
                "cdi_version": h.cdi_version,
                "consumer_copy": _consumer_json(h.consumer),
                "devices": [{"name": d.name, "qualified_name": d.qualified_name, "atom_id": d.atom_id} for d in h.devices],
                "runtime": runtime_args(h),
            }
            for h in listing.holds
        ],
        "runtimes": [
            {
                "name": rt.name,
                "path": rt.path,
                "version": rt.version,
                "error": rt.error,
                "cdi_library": rt.reader.library,
                "highest_cdi_version": rt.reader.highest,
                "cdi_enabled": rt.cdi_enabled,
                "spec_dirs": list(rt.spec_dirs),
                "config_error": rt.config_error,
                "cgroup_manager": rt.cgroup_manager,
                "holds": [
                    {
                        "allocation_id": h.allocation_id,
                        "usable": (u := uses[(rt.name, h.allocation_id)]).usable,
                        "file": u.file,
                        "todo": u.todo,
                        "argv": runtime_argv(u, h, rt),
                        "note": slice_note(rt, h) if u.usable else "",
                    }
                    for h in listing.holds
                ],
            }
            for rt in runtimes
        ],
        "problems": list(listing.problems),
    }


def _line(argv: list[str]) -> str:
    return shlex.join(argv) + " IMAGE ..."


def _consumer_line(h: CdiHold) -> str:
    c = h.consumer
    if c is None:
        return "  consumer copy: unknown (node.json names no cdi_consumer_dir: a node from before consumer copies; --cdi-consumer-dir)"
    if c.cdi_version is None:
        return f"  consumer copy {c.file}: {c.state.upper()}"
    return f"  consumer copy {c.file} (cdiVersion {c.cdi_version})" + ("  STALE" if c.state == "stale" else "")


def _runtime_line(use: HoldUse, rt: RuntimeFacts, hold: CdiHold) -> str:
    if not use.usable:
        return ("cannot use this hold: " if use.usable is False else "") + use.todo
    argv = runtime_argv(use, hold, rt)
    note = slice_note(rt, hold)
    return (_line(argv) + (f"  ({note})" if note else "")) if argv else "through the CRI (below)"


def render_listing(listing: CdiListing, runtimes: list[RuntimeFacts], same_dirs: Mapping[str, str] | None = None) -> str:
    """The text of `bcd cdi list`; `runtimes`: those found on this host (command lines only for them)."""
    count = sum(len(h.devices) for h in listing.holds)
    lines = [f"CDI dir {listing.cdi_dir}: {len(listing.holds)} hold(s), {count} device(s) of kind {KIND}"]
    lines.append(f"consumer copies in {listing.consumer_dir}" if listing.consumer_dir else "consumer copies: dir unknown (--cdi-consumer-dir)")
    if runtimes:
        lines.extend(f"runtime {rt.describe()}" for rt in runtimes)
    else:
        lines.append("no container runtime found on this host (podman, docker, containerd, crio on PATH): no command lines")
    if not listing.holds:
        lines.append("no holds")
    uses = _uses(listing, runtimes, same_dirs)
    width = max((len(rt.label) for rt in runtimes), default=0)
    width = max(width, len("CRI")) + 1
    for h in listing.holds:
        slice_ = f"  slice {h.cgroup_parent}" if h.cgroup_parent else ""
        lines.append(f"hold {h.allocation_id} ({h.reservation_id}) gen {h.generation} {h.binding}{slice_}  {h.file} (cdiVersion {h.cdi_version})")
        lines.append(_consumer_line(h))
        name_width = max(len(d.qualified_name) for d in h.devices)
        for d in h.devices:
            lines.append(f"  {d.qualified_name:<{name_width}}  {d.atom_id}")
        if h.binding == BINDING_KUBERNETES:
            lines.append("  (a Kubernetes hold: the kubelet asks for these through the device plugin or DRA; by hand only to debug)")
        for rt in runtimes:
            label = f"{rt.label}:"
            lines.append(f"  {label:<{width}} {_runtime_line(uses[(rt.name, h.allocation_id)], rt, h)}")
        ((key, value),) = runtime_args(h)["cri_annotations"].items()
        lines.append(f"  {'CRI:':<{width}} CDIDevices {', '.join(h.names)}  (or annotation {key}={value})")
    lines.extend(f"problem: {p}" for p in listing.problems)
    return "\n".join(lines)


__all__ = [
    "CDI_ANNOTATION_PREFIX",
    "CdiDevice",
    "ConsumerCopy",
    "CdiHold",
    "CdiListing",
    "read_consumer_copy",
    "read_cdi_dir",
    "hold_files",
    "RUNTIME_ARGV_KEY",
    "runtime_argv",
    "slice_note",
    "annotation_key",
    "runtime_args",
    "listing_json",
    "render_listing",
]
