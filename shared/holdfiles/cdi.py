"""A hold's CDI spec (`<cdi_dir>/bcd-<allocation>.json`): built from a HoldContent and the vendor spec, rendered, and its cdiVersion.

The hold IS its CDI spec: every fact the converger needs to keep or release
it (allocation, reservation, generation, binding, slice, limits, the real
atom ids) is in the spec's annotations, so `parse_hold` (ondisk) reads a hold
back from disk without any other record. Everything here is pure: the vendor
spec comes in decoded (files.VendorCache reads it).

Decisions (DESIGN 5, "CDI rules"; the seed's example is the target shape):

* Device edits. Each device copies `deviceNodes`, `mounts`, `hooks` and
  `additionalGids` of the vendor device found by `HoldDevice.vendor_names`
  (a slot copies its GPU's). Vendor `env` is never copied: NVIDIA's spec sets
  `NVIDIA_VISIBLE_DEVICES=void` and bcd sets that variable itself. When the
  copied edits hold none of env, deviceNodes, hooks or mounts (no vendor
  spec, a stale one, or a vendor device with nothing else) the device gets
  one env entry `BCD_DEVICE_<device name, non-alphanumerics as _>=<atom id>`:
  a CDI runtime rejects a device whose edits are empty (older runtimes count
  only those four fields), and a per-atom key, unlike a per-position one,
  cannot clash between two holds requested into one container.
* The seed's example shows `"env": null` in the device edits; the official
  schema types `env` as an array, so bcd omits the key instead.
* MPS. A hold whose devices an MPS daemon serves sets CUDA_MPS_PIPE_DIRECTORY
  and bind-mounts the pipe directory (the control daemon's named pipes and
  sockets) at the same path, rw, nosuid, nodev. A DRA claim's daemon is
  bcd's own, laid out by root (services/inventory/mpsroot.py): its log
  directory is mounted too (read-only: the claim's to read), and its shm directory, a
  tmpfs of that daemon's alone, at the container's /dev/shm (the server's
  shared memory; NVIDIA's DRA driver mounts the same). The host's /dev/shm
  is never mounted: it holds every tenant's shared memory and root's MPS
  servers'. A slot's daemon is the host's, which bcd neither runs nor lays
  out: a slot gets its pipe directory only (docs/cdi-runtimes.md, "Slots and
  MPS").
* `cdiVersion` is the lowest version that expresses the content, following
  the CDI library's `MinimumRequiredVersion` (specs-go/version.go).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from shared.vendorcdi import VendorCdi

from .content import (
    ANN_ALLOCATION,
    ANN_BINDING,
    ANN_CGROUP_PARENT,
    ANN_DEVICE_ID,
    ANN_GENERATION,
    ANN_LIMITS,
    ANN_RESERVATION,
    BINDING_KUBERNETES,
    KIND,
    HoldContent,
    HoldDevice,
)

#: a card passed through: its IOMMU group's node, and the VFIO container node every VFIO user opens
VFIO_DEV_DIR = "/dev/vfio"
VFIO_CONTAINER_NODE = "/dev/vfio/vfio"

#: the vendor edits a hold copies, at spec and at device level (never env).
COPIED_EDITS: tuple[str, ...] = ("deviceNodes", "mounts", "hooks", "additionalGids")
#: what a CDI runtime counts when it rejects a device with empty edits. Newer
#: runtimes also count additionalGids, intelRdt and netDevices; older ones
#: only these, so bcd requires one of these.
RUNTIME_COUNTED_EDITS: tuple[str, ...] = ("env", "deviceNodes", "hooks", "mounts")


def device_env_key(name: str) -> str:
    """The env key of the stand-in edit of a device without vendor edits."""
    return "BCD_DEVICE_" + re.sub(r"[^A-Za-z0-9]", "_", name)


def _copied(edits: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if edits:
        for key in COPIED_EDITS:
            value = edits.get(key)
            if value:
                # a copy, so the vendor spec's cache is never changed through a hold's spec:
                # JSON values, copied by a round trip (a tenth of copy.deepcopy's cost)
                out[key] = json_copy(value)
    return out


def json_copy(value: Any) -> Any:
    """A deep copy of a JSON value (msgspec's round trip)."""
    return msgspec.json.decode(msgspec.json.encode(value))


def runtime_counts(edits: Mapping[str, Any]) -> bool:
    """Whether a CDI runtime, old or new, counts `edits` as not empty (RUNTIME_COUNTED_EDITS)."""
    return any(edits.get(key) for key in RUNTIME_COUNTED_EDITS)


def _device_entry(device: HoldDevice, vendor: VendorCdi | None) -> dict[str, Any]:
    name = device.name
    if device.kind == "vfio":
        return {"name": name, "annotations": {ANN_DEVICE_ID: device.atom_id}, "containerEdits": {"deviceNodes": [{"path": f"{VFIO_DEV_DIR}/{device.iommu_group}"}]}}
    edits = _copied(vendor.edits_for(*device.vendor_names) if vendor is not None else None)
    if not runtime_counts(edits):
        edits = {"env": [f"{device_env_key(name)}={device.atom_id}"], **edits}
    return {"name": name, "annotations": {ANN_DEVICE_ID: device.atom_id}, "containerEdits": edits}


def _cdi_env(hold: HoldContent) -> list[str]:
    env = [f"BCD_ALLOCATION_ID={hold.allocation_id}"]
    if hold.cgroup_parent:
        env.append(f"BCD_CGROUP_PARENT={hold.cgroup_parent}")
    if hold.mps_pipe_dir:
        env.append(f"CUDA_MPS_PIPE_DIRECTORY={hold.mps_pipe_dir}")
    if hold.binding != BINDING_KUBERNETES:
        # for a Kubernetes hold the device plugin decides what a pod sees.
        env.append(f"NVIDIA_VISIBLE_DEVICES={hold.visible_devices}")
    env.extend(hold.env)
    return env


#: where a container sees its MPS daemon's shared memory (a claim's daemon's own shm directory).
MPS_SHM_DIR = "/dev/shm"
#: the options of the MPS bind mounts (NVIDIA's DRA driver uses the same).
MPS_MOUNT_OPTIONS: tuple[str, ...] = ("rw", "nosuid", "nodev", "bind")
#: a claim's daemon's log directory: the claim's to read, never to write (the root daemon
#: writes there; a file a container put in its place is not the daemon's business)
MPS_LOG_MOUNT_OPTIONS: tuple[str, ...] = ("ro", "nosuid", "nodev", "bind")


def mps_mounts(mps_pipe_dir: str, mps_log_dir: str = "", mps_shm_dir: str = "") -> list[dict[str, Any]]:
    """The mounts an MPS client in a container needs: the pipe directory, and where the daemon
    is bcd's own (a DRA claim's) its log directory (read-only: what the daemon and its server
    log is the claim's to read) and its shm directory at /dev/shm. Every host path is one root made."""
    if not mps_pipe_dir:
        return []
    mounts = [(mps_pipe_dir, mps_pipe_dir, MPS_MOUNT_OPTIONS)]
    if mps_log_dir:
        mounts.append((mps_log_dir, mps_log_dir, MPS_LOG_MOUNT_OPTIONS))
    if mps_shm_dir:
        mounts.append((mps_shm_dir, MPS_SHM_DIR, MPS_MOUNT_OPTIONS))
    return [{"hostPath": host, "containerPath": there, "options": list(options)} for host, there, options in mounts]


def build_cdi_spec(hold: HoldContent, vendor: VendorCdi | None) -> dict[str, Any]:
    """The hold's CDI spec as a JSON-ready dict, in the seed's shape and key order."""
    annotations = {
        ANN_ALLOCATION: hold.allocation_id,
        ANN_RESERVATION: hold.reservation_id,
        ANN_GENERATION: str(hold.generation),
    }
    if hold.cgroup_parent:
        annotations[ANN_CGROUP_PARENT] = hold.cgroup_parent
    annotations[ANN_BINDING] = hold.binding
    if hold.limits is not None:
        annotations[ANN_LIMITS] = msgspec.json.encode(hold.limits).decode()
    edits: dict[str, Any] = {"env": _cdi_env(hold)}
    if hold.devices[0].kind == "vfio":
        # no vendor edits: they are the nvidia driver's nodes and hooks, and the card is on vfio-pci
        edits["deviceNodes"] = [{"path": VFIO_CONTAINER_NODE}]
    else:
        edits.update(_copied(vendor.container_edits if vendor is not None else None))
    mounts = mps_mounts(hold.mps_pipe_dir, hold.mps_log_dir, hold.mps_shm_dir)
    if mounts:
        # a runtime replaces a mount at the same container path with the later one: a
        # vendor mount there would only be dropped in the container, so it is left out here
        ours = {m["containerPath"] for m in mounts}
        edits["mounts"] = [*(m for m in dicts(edits.get("mounts")) if m.get("containerPath") not in ours), *mounts]
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": KIND,
        "annotations": annotations,
        "devices": [_device_entry(d, vendor) for d in hold.devices],
        "containerEdits": edits,
    }
    spec["cdiVersion"] = min_cdi_version(spec)
    return spec


def render_cdi_spec(spec: Mapping[str, Any]) -> bytes:
    """The file's bytes: JSON, indent 2, keys in the dict's order, trailing newline.

    What `json.dumps(spec, indent=2)` writes, byte for byte, at a fifteenth of
    the cost (msgspec); json escapes non-ASCII text, and DEL (0x7f), where msgspec
    writes them as they are, so a spec with any is written by json itself.
    """
    data = msgspec.json.format(msgspec.json.encode(spec), indent=2) + b"\n"
    if not data.isascii() or b"\x7f" in data:
        return (json.dumps(spec, indent=2) + "\n").encode()
    return data


def qualified_names(spec: Mapping[str, Any]) -> list[str]:
    """`<kind>=<name>` of each device, as a container asks for it."""
    kind = spec.get("kind", "")
    return [f"{kind}={d.get('name', '')}" for d in dicts(spec.get("devices"))]


# ---------------------------------------------------------------------------- cdiVersion

#: released CDI spec versions, oldest first (SPEC.md's table).
CDI_VERSIONS: tuple[str, ...] = (
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
)  # fmt: skip


def dicts(value: Any) -> list[Mapping[str, Any]]:
    """The objects of a JSON list; none of anything else."""
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _all_edits(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    edits = [spec.get("containerEdits")] + [d.get("containerEdits") for d in dicts(spec.get("devices"))]
    return [e for e in edits if isinstance(e, Mapping)]


def min_cdi_version(spec: Mapping[str, Any]) -> str:
    """The lowest CDI version that expresses `spec` (the CDI library's MinimumRequiredVersion).

    1.1.0: netDevices, or intelRdt with schemata or enableMonitoring.
    0.7.0: intelRdt, additionalGids (spec or device level).
    0.6.0: annotations (spec or device level), a `.` in the kind's class.
    0.5.0: a device name starting with a digit, a device node's hostPath.
    0.4.0: a mount's type.
    Otherwise 0.3.0, the earliest the library accepts. 0.8.0 and 1.0.0 changed
    only the Go API, and hook env/timeout exist since the first versions.
    """
    edits = _all_edits(spec)
    devices = dicts(spec.get("devices"))
    for e in edits:
        rdt = e.get("intelRdt")
        if e.get("netDevices") or (
            isinstance(rdt, Mapping) and (rdt.get("schemata") is not None or rdt.get("enableMonitoring") is True)
        ):
            return "1.1.0"
    if any(e.get("intelRdt") is not None or e.get("additionalGids") for e in edits):
        return "0.7.0"
    kind = spec.get("kind")
    if (
        spec.get("annotations")
        or any(d.get("annotations") for d in devices)
        or (isinstance(kind, str) and "." in kind.partition("/")[2])
    ):
        return "0.6.0"
    if any(isinstance(d.get("name"), str) and d["name"][:1].isdigit() for d in devices) or any(
        n.get("hostPath") for e in edits for n in dicts(e.get("deviceNodes"))
    ):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in dicts(e.get("mounts"))):
        return "0.4.0"
    return "0.3.0"
