"""The two files of a hold: its CDI spec (`<cdi_dir>/bcd-<allocation>.json`) and its env file.

Pure builders, a parser and validators; no I/O except what a caller hands in
as bytes (and `VendorCache`, which reads the vendor spec). Shared by the converger (which plans, writes as root or on a fake
host, and reads holds back) and the root helper (which writes for an
unprivileged converger): both build a file's bytes with `hold_file_bytes`, so
the two writers cannot drift apart. `hold_to_wire`/`hold_from_wire` carry a
HoldContent to the helper as typed fields only (no path, device node, mount
or hook). The hold IS its CDI spec: every fact the converger needs to keep or
release it (allocation, reservation, generation, binding, slice, limits, the
real atom ids) is in the spec's annotations, so `parse_hold` reads a hold back
from disk without any other record.

Decisions (DESIGN 5, "CDI rules" and "Env file"; the seed's example is the
target shape):

* Device names. A CDI device name allows letters, digits and `_ . - :`,
  alphanumeric at both ends, and no `/`. An atom id made of those characters
  plus `/` (every GPU, MIG and slot atom) is named by turning each `/` into
  `_` ("GPU-<uuid>/gi1/ci0" -> "GPU-<uuid>_gi1_ci0"), which is reversible
  because such ids contain no `_`. Any other id gets a sanitised stem, `__`
  and 16 hex digits of its sha256; `__` never occurs in the first form, so
  names stay unique per atom. The real id is always in the device annotation
  `bcd.dev/device-id`.
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
* Vendor names of a MIG device. NVIDIA's `nvidia-ctk cdi generate` names a
  MIG device by its MIG uuid and/or `<gpu index>:<mig index>`, where the mig
  index is the position of the device in NVML's MIG device handle list, NOT
  the GPU instance id (on the example host gi5/ci0 is "6:2"). The inventory
  does not carry that index, so `HoldDevice.for_mig` names the MIG uuid and
  adds `<gpu index>:<mig index>` only when the caller knows the index.
* `cdiVersion` is the lowest version that expresses the content, following
  the CDI library's `MinimumRequiredVersion` (specs-go/version.go).
* Env file values. Every line of the env file is read to the same value by
  a shell sourcing it (`. file`), `docker run --env-file` and systemd's
  `EnvironmentFile=` (`shared.schemas.common.env_value_problem`): the three
  disagree on quotes, backslashes, `$` and whitespace and no quoting suits
  all of them (docker keeps quotes), so no value holds those. bcd's own
  values are ids, the slice name (a `-` of the id spelled `.`, see
  `shared.slices.slice_name`), uuids and the MPS pipe directory; a spec's
  env value with any of them is refused when the spec is decoded.
* The seed's example shows `"env": null` in the device edits; the official
  schema types `env` as an array, so bcd omits the key instead.
* MPS. A slot hold on a card with MPS running sets CUDA_MPS_PIPE_DIRECTORY
  and bind-mounts what an MPS client talks to the MPS server through: the
  pipe directory (the control daemon's named pipes and sockets) at the same
  path, and the host's /dev/shm (the server's shared memory), both rw,
  nosuid, nodev; NVIDIA's DRA driver mounts the same two. The log directory
  is the daemon's alone and is not mounted.
* The consumer copy (docs/cdi-runtimes.md). Annotations need cdiVersion
  0.6.0, and a CDI library older than v0.6 (podman before 4.7, containerd
  before 1.7.12, CRI-O before 1.28) refuses the whole hold spec. So beside
  each hold spec bcd writes `consumer_spec(hold spec)`: the same kind,
  device names and edits, no annotations, at the lowest cdiVersion its
  content needs (0.3.0 unless the vendor's edits need more), into a spec
  directory a runtime ranks above the hold's (`/var/run/cdi` above
  `/etc/cdi`): a runtime that reads both takes the copy's devices, one that
  cannot read the hold spec still finds them. The copy is a pure function of
  the hold spec's bytes (`consumer_file_bytes`), so both files always say
  the same to a container; the hold spec stays the record.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Literal

import msgspec

from shared.fsutil import SETTLED_S, Remembered, content_digest, file_identity, remembered_value
from shared.schemas import HugePages, Limits
from shared.schemas.bus import (
    GPU_UUID_PATTERN,
    HELPER_MAX_CPU,
    HELPER_MAX_NUMA_NODE,
    MIG_UUID_PATTERN,
    MPS_CONTROL_PATTERN,
    HelperDevice,
    HelperHold,
    HelperHugePages,
    HelperLimits,
)
from shared.schemas.codec import BoundedDecoder, bounded_json_loads
from shared.schemas.common import ATOM_PATTERN, ENV_LINE_PATTERN, ID_RE, INT64_MAX, env_value_problem, reserved_env_key
from shared.vendorcdi import VENDOR_CDI_FILE, VendorCdi, VendorSpecError, read_vendor_cdi_bytes, vendor_cdi_from_json

# the systemd slice of a sliced hold, also its bcd.dev/cgroup-parent
from shared.slices import parse_cpulist, slice_name, slice_names

#: the CDI kind of every hold; a container asks for `bcd.dev/gpu=<device name>`.
KIND = "bcd.dev/gpu"
#: a card passed through: its IOMMU group's node, and the VFIO container node every VFIO user opens
VFIO_DEV_DIR = "/dev/vfio"
VFIO_CONTAINER_NODE = "/dev/vfio/vfio"
#: NVIDIA_VISIBLE_DEVICES of a hold whose cards are on vfio-pci (the NVIDIA runtime adds nothing)
VFIO_VISIBLE = "void"
#: the largest IOMMU group number a hold names (the kernel's are small integers)
IOMMU_GROUP_MAX = 65535

ANN_ALLOCATION = "bcd.dev/allocation-id"
ANN_RESERVATION = "bcd.dev/reservation-id"
ANN_GENERATION = "bcd.dev/generation"
ANN_CGROUP_PARENT = "bcd.dev/cgroup-parent"
ANN_BINDING = "bcd.dev/binding"
ANN_LIMITS = "bcd.dev/limits"
ANN_DEVICE_ID = "bcd.dev/device-id"

BINDING_HOLD = "BINDING_HOLD"
BINDING_KUBERNETES = "BINDING_KUBERNETES"
#: the bindings that make a hold (BINDING_INSTANCE is the VFIO side's).
HOLD_BINDINGS: tuple[str, ...] = (BINDING_HOLD, BINDING_KUBERNETES)
#: a DRA claim's own hold (`bcd-claim-<uid>.json`): never in a NodeSpec (its binding is
#: no DeviceAssignment's), made and removed through the kubelet plugin, reported to nobody.
BINDING_CLAIM = "BINDING_CLAIM"
#: what a hold file on disk may say it is.
DISK_BINDINGS: tuple[str, ...] = (*HOLD_BINDINGS, BINDING_CLAIM)
#: the allocation id of a claim's hold: `claim-<uid>`.
CLAIM_HOLD_PREFIX = "claim-"


def claim_hold_id(uid: str) -> str:
    return f"{CLAIM_HOLD_PREFIX}{uid}"

#: the vendor edits a hold copies, at spec and at device level (never env).
COPIED_EDITS: tuple[str, ...] = ("deviceNodes", "mounts", "hooks", "additionalGids")
#: what a CDI runtime counts when it rejects a device with empty edits. Newer
#: runtimes also count additionalGids, intelRdt and netDevices; older ones
#: only these, so bcd requires one of these.
RUNTIME_COUNTED_EDITS: tuple[str, ...] = ("env", "deviceNodes", "hooks", "mounts")

#: released CDI spec versions, oldest first (SPEC.md's table).
CDI_VERSIONS: tuple[str, ...] = (
    "0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0",
)  # fmt: skip

# Patterns end in `\Z`, not `$`: `$` also matches before a trailing newline.
_HOLD_FILE_RE = re.compile(r"^bcd-(?P<allocation>.+)\.json\Z")
_ATOM_RE = re.compile(ATOM_PATTERN)
_ENV_LINE_RE = re.compile(ENV_LINE_PATTERN)
_VISIBLE_ID_RE = re.compile(r"^[!-+\--~]+\Z")  # printable ASCII without ',' (0x2c)
_SHARE_ID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_GENERATION_RE = re.compile(r"^(0|[1-9][0-9]{0,18})\Z")
#: CDI device names: letters, digits, `_ . - :`, alphanumeric at both ends.
_DEVICE_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?\Z")
#: atom ids named by plain `/` -> `_` (no `_`, alphanumeric at both ends).
_SIMPLE_ATOM_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.:/-]*[A-Za-z0-9])?\Z")
#: a vendor or class name of a kind: starts with a letter, ends alphanumeric.
_KIND_PART = r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
_KIND_RE = re.compile(rf"^{_KIND_PART}/{_KIND_PART}\Z")
#: an annotation key as Kubernetes (and so the CDI library) checks it: an
#: optional DNS-subdomain prefix and `/`, then a name of at most 63 characters.
_ANN_PREFIX_RE = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*\Z")
_ANN_NAME_RE = re.compile(r"^[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
_ANNOTATIONS_MAX_BYTES = 256 * 1024
#: parse_hold's bounds: a CDI spec read back is decoded at most this large and 64 levels deep.
HOLD_FILE_MAX_BYTES = 8 * 1024 * 1024
_LIMITS_DECODER = BoundedDecoder(Limits, max_bytes=_ANNOTATIONS_MAX_BYTES, what="limits annotation")


def hold_file_name(allocation_id: str) -> str:
    """The CDI spec's file name inside cdi_dir."""
    return f"bcd-{allocation_id}.json"


def env_file_name(allocation_id: str) -> str:
    """The env file's name inside the allocations' env directory."""
    return f"{allocation_id}.env"




# ---------------------------------------------------------------------------- content


@dataclass(frozen=True)
class HoldDevice:
    """One atom of a hold, with what its two files need to know about it."""

    atom_id: str
    kind: Literal["gpu", "mig", "slot", "vfio"]
    gpu_uuid: str
    gpu_index: int
    #: what NVIDIA_VISIBLE_DEVICES takes: the GPU uuid (gpu, slot) or the MIG uuid; "void" for a
    #: card passed through (vfio): the NVIDIA runtime must not add the card's nvidia nodes.
    visible_id: str
    #: names to look up in the vendor spec, in preference order.
    vendor_names: tuple[str, ...] = ()
    #: vfio: the card's IOMMU group (`/dev/vfio/<group>` is its device node); None otherwise.
    iommu_group: int | None = None
    #: a share of a card a DRA claim holds beside other claims (consumable capacity): the
    #: allocation's shareID, which makes its CDI device name its own (two specs naming one device
    #: is a conflict every CDI registry refuses); "" otherwise.
    share_id: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("gpu", "mig", "slot", "vfio"):
            raise ValueError(f"{self.atom_id}: unknown device kind {self.kind!r}")
        if (self.kind == "vfio") != (self.iommu_group is not None):
            raise ValueError(f"{self.atom_id}: an IOMMU group is for a card passed through (vfio) only, and it needs one")
        if self.iommu_group is not None and not 0 <= self.iommu_group <= IOMMU_GROUP_MAX:
            raise ValueError(f"{self.atom_id}: IOMMU group {self.iommu_group} is not 0..{IOMMU_GROUP_MAX}")
        if self.share_id and (self.kind != "gpu" or not _SHARE_ID_RE.match(self.share_id)):
            raise ValueError(f"{self.atom_id}: a share id is a whole card's, a lowercase RFC 4122 uuid ({self.share_id!r})")
        if not _ATOM_RE.search(self.atom_id):
            raise ValueError(f"{self.atom_id!r} is not an atom id")
        # it lands in an env line and a comma-separated list.
        if not _VISIBLE_ID_RE.match(self.visible_id):
            raise ValueError(f"{self.atom_id}: visible id {self.visible_id!r} is empty or has a comma or space")

    @property
    def name(self) -> str:
        """Its CDI device name (`bcd.dev/gpu=<name>`): the atom's, and for a share its share id."""
        base = device_name(self.atom_id)
        return f"{base}_{self.share_id}" if self.share_id else base

    @classmethod
    def for_gpu(cls, gpu_uuid: str, gpu_index: int) -> HoldDevice:
        return cls(gpu_uuid, "gpu", gpu_uuid, gpu_index, gpu_uuid, (gpu_uuid, str(gpu_index)))

    @classmethod
    def for_mig(
        cls, gpu_uuid: str, gpu_index: int, gi: int, ci: int, mig_uuid: str, mig_index: int | None = None
    ) -> HoldDevice:
        """A MIG instance. `mig_index` is NVML's MIG device index (not `gi`); pass it only when known."""
        names: tuple[str, ...] = (mig_uuid,) if mig_uuid else ()
        index_name = f"{gpu_index}:{mig_index}" if mig_index is not None else ""
        if index_name:
            names += (index_name,)
        # never fall back to the GPU uuid: that would expose the whole card.
        visible = mig_uuid or index_name
        return cls(f"{gpu_uuid}/gi{gi}/ci{ci}", "mig", gpu_uuid, gpu_index, visible, names)

    @classmethod
    def for_slot(cls, gpu_uuid: str, gpu_index: int, slot: int) -> HoldDevice:
        return cls(f"{gpu_uuid}/slot{slot}", "slot", gpu_uuid, gpu_index, gpu_uuid, (gpu_uuid, str(gpu_index)))

    @classmethod
    def for_vfio(cls, gpu_uuid: str, gpu_index: int, iommu_group: int) -> HoldDevice:
        """A whole card on vfio-pci: the atom is the card's, the device node its IOMMU group's, and
        nothing of the vendor's spec (its nodes are the nvidia driver's, which no longer has the card)."""
        return cls(gpu_uuid, "vfio", gpu_uuid, gpu_index, VFIO_VISIBLE, (), iommu_group)


@dataclass(frozen=True)
class HoldContent:
    """Everything a hold's two files say, built by the converger from an assignment and the inventory."""

    allocation_id: str
    reservation_id: str
    generation: int
    binding: str
    #: in the assignment's order.
    devices: tuple[HoldDevice, ...]
    #: slice_name(allocation_id) for a sliced hold, else "".
    cgroup_parent: str = ""
    #: the assignment's KEY=VALUE lines.
    env: tuple[str, ...] = ()
    #: the MPS pipe directory; "" unless the hold has slots and MPS is running, or it is a DRA
    #: claim's with an MPS daemon of its own (then `<mps root>/<mps_control>/pipe`).
    mps_pipe_dir: str = ""
    limits: Limits | None = None
    #: a DRA claim's MPS daemon (its control id, shared.schemas MPS_CONTROL_PATTERN); "" for none.
    mps_control: str = ""

    def __post_init__(self) -> None:
        # Each rule here is one parse_hold enforces on the way back, so a
        # hold that builds also reads back.
        if not ID_RE.search(self.allocation_id):
            raise ValueError(f"allocation id {self.allocation_id!r} is not a valid id")
        if not ID_RE.search(self.reservation_id):
            raise ValueError(f"{self.allocation_id}: reservation id {self.reservation_id!r} is not a valid id")
        if self.generation < 0:
            raise ValueError(f"{self.allocation_id}: negative generation")
        if self.binding not in DISK_BINDINGS:
            raise ValueError(f"{self.allocation_id}: {self.binding} does not make a hold")
        if self.binding == BINDING_CLAIM and not self.allocation_id.startswith(CLAIM_HOLD_PREFIX):
            raise ValueError(f"{self.allocation_id}: a DRA claim's hold is named {CLAIM_HOLD_PREFIX}<uid>")
        if not self.devices:
            # a CDI spec without devices is rejected by the runtimes.
            raise ValueError(f"{self.allocation_id}: a hold needs at least one device")
        atoms = [d.atom_id for d in self.devices]
        if len(set(atoms)) != len(atoms):
            raise ValueError(f"{self.allocation_id}: an atom appears twice")
        if self.cgroup_parent not in ("", slice_name(self.allocation_id)):
            raise ValueError(f"{self.allocation_id}: cgroup parent must be {slice_name(self.allocation_id)}")
        if self.cgroup_parent and self.binding == BINDING_KUBERNETES:
            raise ValueError(f"{self.allocation_id}: a Kubernetes hold is never sliced")
        if self.mps_control:
            if self.binding != BINDING_CLAIM or not _MPS_CONTROL_RE.match(self.mps_control):
                raise ValueError(f"{self.allocation_id}: an MPS daemon of its own is a DRA claim's, named <claim uid>-<6 hex>")
            if PurePath(self.mps_pipe_dir).parts[-2:] != (self.mps_control, "pipe") or not PurePath(self.mps_pipe_dir).is_absolute():
                raise ValueError(f"{self.allocation_id}: MPS pipe directory {self.mps_pipe_dir!r} is not <mps root>/{self.mps_control}/pipe")
        elif self.mps_pipe_dir and not any(d.kind == "slot" for d in self.devices):
            raise ValueError(f"{self.allocation_id}: an MPS pipe directory without slots")
        vfio = [d.kind == "vfio" for d in self.devices]
        if any(vfio) and (self.binding != BINDING_CLAIM or not all(vfio) or self.mps_pipe_dir):
            raise ValueError(f"{self.allocation_id}: cards passed through (vfio) are a DRA claim's, all of its devices, without MPS")
        if not _ENV_LINE_RE.search(f"CUDA_MPS_PIPE_DIRECTORY={self.mps_pipe_dir}"):
            raise ValueError(f"{self.allocation_id}: MPS pipe directory {self.mps_pipe_dir!r} cannot be an env value")
        for line in self.env:
            if not _ENV_LINE_RE.search(line) or reserved_env_key(line.split("=", 1)[0]):
                raise ValueError(f"{self.allocation_id}: env line {line!r} is not allowed")
        # the lines bcd builds itself too (visible ids come from the inventory,
        # the MPS pipe directory from host config): no value may carry a line
        # break of any kind into the env file, nor anything a shell, docker
        # --env-file or systemd EnvironmentFile= would read differently
        for line in env_lines(self):
            problem = "" if _ENV_LINE_RE.search(line) else "not one KEY=VALUE line"
            problem = problem or env_value_problem(line.split("=", 1)[1])
            if problem:
                raise ValueError(f"{self.allocation_id}: env line {line!r} cannot be written to an env file: {problem}")

    @property
    def mps_log_dir(self) -> str:
        """A DRA claim's MPS daemon's log directory (`<mps root>/<control>/log`, beside its pipe
        directory); "" for a hold without a daemon of its own (a slot uses the host's MPS)."""
        return str(PurePath(self.mps_pipe_dir).parent / "log") if self.mps_control else ""

    @property
    def visible_devices(self) -> str:
        """NVIDIA_VISIBLE_DEVICES: the unique visible ids, in device order."""
        return ",".join(dict.fromkeys(d.visible_id for d in self.devices))


# ---------------------------------------------------------------------------- the CDI spec


def device_name(atom_id: str) -> str:
    """The CDI device name of an atom: valid, unique per atom id, readable (see the module docstring)."""
    if _SIMPLE_ATOM_RE.match(atom_id) and "//" not in atom_id:
        return atom_id.replace("/", "_")
    digest = hashlib.sha256(atom_id.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9.:-]+", "-", atom_id).strip(".:-")[:64].strip(".:-") or "atom"
    return f"{stem}__{digest}"


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
                out[key] = _json_copy(value)
    return out


def _json_copy(value: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


def _runtime_counts(edits: Mapping[str, Any]) -> bool:
    return any(edits.get(key) for key in RUNTIME_COUNTED_EDITS)


def _device_entry(device: HoldDevice, vendor: VendorCdi | None) -> dict[str, Any]:
    name = device.name
    if device.kind == "vfio":
        return {"name": name, "annotations": {ANN_DEVICE_ID: device.atom_id}, "containerEdits": {"deviceNodes": [{"path": f"{VFIO_DEV_DIR}/{device.iommu_group}"}]}}
    edits = _copied(vendor.edits_for(*device.vendor_names) if vendor is not None else None)
    if not _runtime_counts(edits):
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


#: the host's shared memory an MPS client shares with the MPS server (bind-mounted at the same path).
MPS_SHM_DIR = "/dev/shm"
#: the options of the MPS bind mounts (NVIDIA's DRA driver uses the same).
MPS_MOUNT_OPTIONS: tuple[str, ...] = ("rw", "nosuid", "nodev", "bind")


def mps_mounts(mps_pipe_dir: str, mps_log_dir: str = "") -> list[dict[str, Any]]:
    """The mounts an MPS client in a container needs: the pipe directory, the daemon's log
    directory where it has one of its own (a DRA claim's: what the daemon and its server log
    is the claim's to read), and the host's /dev/shm."""
    if not mps_pipe_dir:
        return []
    paths = (mps_pipe_dir, mps_log_dir, MPS_SHM_DIR) if mps_log_dir else (mps_pipe_dir, MPS_SHM_DIR)
    return [{"hostPath": path, "containerPath": path, "options": list(MPS_MOUNT_OPTIONS)} for path in dict.fromkeys(paths)]


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
    mounts = mps_mounts(hold.mps_pipe_dir, hold.mps_log_dir)
    if mounts:
        # a runtime replaces a mount at the same container path with the later one: a
        # vendor mount there would only be dropped in the container, so it is left out here
        ours = {m["containerPath"] for m in mounts}
        edits["mounts"] = [*(m for m in _dicts(edits.get("mounts")) if m.get("containerPath") not in ours), *mounts]
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


# ---------------------------------------------------------------------------- the consumer copy

#: where a runtime looks for generated CDI specs, ranked above /etc/cdi (the CDI library's
#: DefaultDynamicDir; every runtime's default spec dirs are /etc/cdi, then /var/run/cdi).
DEFAULT_CONSUMER_DIR = "/var/run/cdi"


def default_consumer_dir(run_dir: Path | str, *, fake_host: bool) -> Path:
    """Where consumer copies go when `--cdi-consumer-dir` is not given: /var/run/cdi on a real
    host; `<run_dir>/cdi` on a fake host, which must never write the real host's spec dirs."""
    return Path(run_dir) / "cdi" if fake_host else Path(DEFAULT_CONSUMER_DIR)


#: where the inventory keeps DRA claims' MPS daemons on a real host (`<root>/<control>/{pipe,log}`)
DEFAULT_MPS_ROOT = "/run/bcd/mps"


def default_mps_root(run_dir: Path | str, *, fake_host: bool) -> str:
    """The MPS root when `--mps-root` is not given: /run/bcd/mps; `<run_dir>/mps` on a fake host
    (which must never make directories in the real host's /run)."""
    return str(Path(os.path.realpath(run_dir)) / "mps") if fake_host else DEFAULT_MPS_ROOT


def checked_consumer_dir(cdi_dir: Path | str, consumer_dir: Path | str) -> Path:
    """`consumer_dir` when it can hold consumer copies beside `cdi_dir`'s holds; ValueError says why not.

    It must be absolute and another directory than the CDI dir: in one directory (one
    priority level) a runtime finds each device name twice and drops both."""
    path = Path(consumer_dir)
    if not str(consumer_dir) or not path.is_absolute():
        raise ValueError(f"--cdi-consumer-dir {str(consumer_dir)!r} is not an absolute path")
    if os.path.realpath(path) == os.path.realpath(cdi_dir):
        raise ValueError(
            f"--cdi-consumer-dir {consumer_dir} is the CDI dir itself: a runtime would find every device twice "
            "in one directory and drop both; give a spec dir it ranks above it (/var/run/cdi above /etc/cdi)"
        )
    return path


def consumer_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The consumer copy of a hold spec: the same kind, devices and edits, without the
    spec's and the devices' annotations, at the lowest cdiVersion of what is left."""
    devices = [{k: _json_copy(v) for k, v in d.items() if k != "annotations"} for d in _dicts(spec.get("devices"))]
    out: dict[str, Any] = {"cdiVersion": "", "kind": spec.get("kind", KIND), "devices": devices}
    if "containerEdits" in spec:
        out["containerEdits"] = _json_copy(spec["containerEdits"])
    out["cdiVersion"] = min_cdi_version(out)
    return out


def consumer_file_bytes(allocation_id: str, hold_spec: bytes) -> bytes:
    """The consumer copy's bytes, from the bytes of the hold spec `bcd-<allocation_id>.json`.

    NotAHold when those bytes are not that allocation's hold: a copy is only ever made of one."""
    parse_hold(hold_file_name(checked_id(allocation_id)), hold_spec)
    spec = bounded_json_loads(hold_spec, HOLD_FILE_MAX_BYTES, "CDI spec")
    return render_cdi_spec(consumer_spec(spec))


def qualified_names(spec: Mapping[str, Any]) -> list[str]:
    """`<kind>=<name>` of each device, as a container asks for it."""
    kind = spec.get("kind", "")
    return [f"{kind}={d.get('name', '')}" for d in _dicts(spec.get("devices"))]


# ---------------------------------------------------------------------------- cdiVersion


def _dicts(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _all_edits(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    edits = [spec.get("containerEdits")] + [d.get("containerEdits") for d in _dicts(spec.get("devices"))]
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
    devices = _dicts(spec.get("devices"))
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
        n.get("hostPath") for e in edits for n in _dicts(e.get("deviceNodes"))
    ):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in _dicts(e.get("mounts"))):
        return "0.4.0"
    return "0.3.0"


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


# ---------------------------------------------------------------------------- the env file


def env_lines(hold: HoldContent) -> list[str]:
    """The env file's lines in the seed's order (NVIDIA_VISIBLE_DEVICES for every binding)."""
    lines = [f"BCD_ALLOCATION_ID={hold.allocation_id}"]
    if hold.cgroup_parent:
        lines.append(f"BCD_CGROUP_PARENT={hold.cgroup_parent}")
    if hold.mps_pipe_dir:
        lines.append(f"CUDA_MPS_PIPE_DIRECTORY={hold.mps_pipe_dir}")
    lines.append(f"BCD_RESERVATION_ID={hold.reservation_id}")
    lines.append(f"NVIDIA_VISIBLE_DEVICES={hold.visible_devices}")
    lines.extend(hold.env)
    return lines


def render_env_file(hold: HoldContent) -> bytes:
    """One KEY=VALUE per line, trailing newline."""
    return ("\n".join(env_lines(hold)) + "\n").encode()


# ---------------------------------------------------------------------------- reading a hold back


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
        if not isinstance(atom, str) or not _ATOM_RE.search(atom):
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


# ---------------------------------------------------------------------------- validation


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
    if size > _ANNOTATIONS_MAX_BYTES:
        problems.append(f"{where}: annotations exceed {_ANNOTATIONS_MAX_BYTES} bytes")
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
            if not isinstance(dev_edits, Mapping) or not _runtime_counts(dev_edits):
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



# ---------------------------------------------------------------------------- paths and bytes

#: the two files of a hold, as the helper's requests name them.
FILE_KINDS: tuple[str, ...] = ("cdi", "allocation-env")
#: where the env files live inside run_dir.
ENV_SUBDIR = "allocations"


def checked_id(allocation_id: str) -> str:
    """The id itself; ValueError unless it is a valid allocation id (a file-name part)."""
    if not isinstance(allocation_id, str) or not ID_RE.match(allocation_id):
        raise ValueError(f"allocation id {allocation_id!r} is not a valid id")
    return allocation_id


def hold_file_path(kind: str, cdi_dir: Path, run_dir: Path, allocation_id: str) -> Path:
    """`<cdi_dir>/bcd-<id>.json` (kind cdi) or `<run_dir>/allocations/<id>.env` (kind allocation-env)."""
    name = checked_id(allocation_id)
    if kind == "cdi":
        return Path(cdi_dir) / hold_file_name(name)
    if kind == "allocation-env":
        return Path(run_dir) / ENV_SUBDIR / env_file_name(name)
    raise ValueError(f"unknown file kind {kind!r}")


# ---------------------------------------------------------------------------- files read again
# (the identity rule lives in shared.fsutil: the host file's readers use it too)


class VendorCache:
    """The vendor CDI spec of a CDI directory, decoded again only when its file changed (it can be large).

    The one reader of the disk in this module: both writers copy edits from
    the spec they find in their own CDI directory, and the converger's passes
    read it through one (observe). A file settled since its last read is not
    read again while its identity (`file_identity`) is unchanged; a younger
    one is read, and decoded again only when its bytes differ. `get` raises
    VendorSpecError when the file is there but cannot be read or decoded.
    """

    def __init__(self, cdi_dir: Path) -> None:
        self.cdi_dir = Path(cdi_dir)
        #: one attribute, replaced whole: threads that share the cache never see half an update.
        self._memo: Remembered[VendorCdi] | None = None

    def get(self) -> VendorCdi | None:
        path = self.cdi_dir / VENDOR_CDI_FILE
        try:
            # lstat: a symlink there is read (and refused) by read_vendor_cdi_bytes, never followed
            st = path.lstat()
        except FileNotFoundError:
            self._memo = None
            return None
        except OSError as exc:
            raise VendorSpecError(f"cannot read {path}: {exc.strerror or exc}") from None
        memo = self._memo
        if memo is not None and memo.vouches(st):
            return memo.value
        data = read_vendor_cdi_bytes(self.cdi_dir)
        if data is None:
            self._memo = None
            return None
        value = remembered_value(memo, data)
        if value is None:
            value = vendor_cdi_from_json(data, str(path))
        self._memo = Remembered.of(st, data, value) if stat.S_ISREG(st.st_mode) else None
        return value


def hold_file_bytes(kind: str, hold: HoldContent, vendor: VendorCdi | None) -> bytes:
    """The bytes of one file of a hold: what every writer (in-process or the helper) writes."""
    if kind == "cdi":
        return render_cdi_spec(build_cdi_spec(hold, vendor))
    if kind == "allocation-env":
        return render_env_file(hold)
    raise ValueError(f"unknown file kind {kind!r}")


# ---------------------------------------------------------------------------- to and from the helper

_GPU_UUID_RE = re.compile(GPU_UUID_PATTERN)
_MPS_CONTROL_RE = re.compile(MPS_CONTROL_PATTERN)
_MIG_UUID_RE = re.compile(MIG_UUID_PATTERN)


def gpu_atom_of(gpu_uuid: str) -> str:
    """The atom id of a whole GPU from NVML's uuid ("GPU-..." as is; a bare uuid gets the prefix)."""
    return gpu_uuid if gpu_uuid.startswith("GPU-") else f"GPU-{gpu_uuid}"


def device_from_wire(w: HelperDevice) -> HoldDevice:
    """A HoldDevice from typed parts: atom id, visible id and vendor names are derived here,
    exactly as the converger's planner derives them from the inventory."""
    if not _GPU_UUID_RE.search(w.gpu_uuid):
        raise ValueError(f"gpu uuid {w.gpu_uuid!r} is not an NVML GPU uuid")
    gpu = gpu_atom_of(w.gpu_uuid)
    if w.kind == "mig":
        if w.gi is None or w.ci is None or w.slot is not None:
            raise ValueError(f"{gpu}: a MIG device needs gi and ci and no slot")
        if not _MIG_UUID_RE.search(w.mig_uuid):
            raise ValueError(f"{gpu}/gi{w.gi}/ci{w.ci}: MIG uuid {w.mig_uuid!r} is not of the form MIG-...")
        return HoldDevice(f"{gpu}/gi{w.gi}/ci{w.ci}", "mig", w.gpu_uuid, w.gpu_index, w.mig_uuid, (w.mig_uuid,))
    if w.gi is not None or w.ci is not None or w.mig_uuid:
        raise ValueError(f"{gpu}: gi, ci and mig_uuid are for MIG devices only")
    if w.share_id and w.kind != "gpu":
        raise ValueError(f"{gpu}: a share id is a whole card's")
    if w.kind == "vfio":
        if w.iommu_group is None or w.slot is not None:
            raise ValueError(f"{gpu}: a card passed through needs its IOMMU group and no slot")
        return HoldDevice.for_vfio(w.gpu_uuid, w.gpu_index, w.iommu_group)
    if w.iommu_group is not None:
        raise ValueError(f"{gpu}: an IOMMU group is for a card passed through (vfio) only")
    names = (w.gpu_uuid, str(w.gpu_index))
    if w.kind == "slot":
        if w.slot is None:
            raise ValueError(f"{gpu}: a slot needs its number")
        return HoldDevice(f"{gpu}/slot{w.slot}", "slot", w.gpu_uuid, w.gpu_index, w.gpu_uuid, names)
    if w.slot is not None:
        raise ValueError(f"{gpu}: slot is for slots only")
    return HoldDevice(gpu, "gpu", w.gpu_uuid, w.gpu_index, w.gpu_uuid, names, share_id=w.share_id)


_MIG_SUFFIX_RE = re.compile(r"^/gi(0|[1-9][0-9]{0,3})/ci(0|[1-9][0-9]{0,3})\Z")
_SLOT_SUFFIX_RE = re.compile(r"^/slot(0|[1-9][0-9]{0,3})\Z")


def device_to_wire(d: HoldDevice) -> HelperDevice:
    """The typed parts of a HoldDevice; ValueError when the helper would not rebuild it exactly."""
    gpu = gpu_atom_of(d.gpu_uuid)
    suffix = d.atom_id[len(gpu):] if d.atom_id.startswith(gpu) else None
    gi = ci = slot = None
    if d.kind == "mig" and suffix is not None and (m := _MIG_SUFFIX_RE.match(suffix)):
        gi, ci = int(m[1]), int(m[2])
    elif d.kind == "slot" and suffix is not None and (m := _SLOT_SUFFIX_RE.match(suffix)):
        slot = int(m[1])
    elif not (d.kind in ("gpu", "vfio") and suffix == ""):
        raise ValueError(f"{d.atom_id}: atom id does not follow from GPU uuid {d.gpu_uuid!r} and kind {d.kind}")
    try:
        w = HelperDevice(
            kind=d.kind,
            gpu_uuid=d.gpu_uuid,
            gpu_index=d.gpu_index,
            gi=gi,
            ci=ci,
            slot=slot,
            mig_uuid=d.visible_id if d.kind == "mig" else "",
            iommu_group=d.iommu_group,
            share_id=d.share_id,
        )
        again = device_from_wire(w)
    except ValueError as exc:
        raise ValueError(f"{d.atom_id} cannot be written through the root helper: {exc}") from None
    if again != d:
        raise ValueError(f"{d.atom_id} cannot be written through the root helper: its visible id or vendor names are not the derived ones")
    return w


def _bounded_list(text: str, what: str, highest: int) -> str:
    try:
        numbers = parse_cpulist(text)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if numbers[-1] > highest:
        raise ValueError(f"{what} {text!r}: {numbers[-1]} is above the highest allowed, {highest}")
    return text


def limits_from_wire(w: HelperLimits) -> Limits:
    """Limits from a helper request, within the helper's bounds; ValueError names what is out of bounds."""
    if w.cpus is not None:
        _bounded_list(w.cpus, "cpus", HELPER_MAX_CPU)
    if w.mems is not None:
        _bounded_list(w.mems, "mems", HELPER_MAX_NUMA_NODE)
    if w.cpu_millis is not None and w.cpu_millis <= 0:
        raise ValueError(f"cpu_millis {w.cpu_millis}: a CPU quota must be positive")
    for h in w.hugepages:
        if h.page_size_kib & (h.page_size_kib - 1):
            raise ValueError(f"hugepages: page size {h.page_size_kib} KiB is not a power of two")
    try:
        return Limits(
            cpus=w.cpus,
            cpu_millis=w.cpu_millis,
            memory_bytes=w.memory_bytes,
            hugepages=[HugePages(page_size_kib=h.page_size_kib, count=h.count) for h in w.hugepages],
            mems=w.mems,
        )
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise ValueError(f"limits: {exc}") from None


def limits_to_wire(limits: Limits) -> HelperLimits:
    return HelperLimits(
        cpus=limits.cpus,
        cpu_millis=limits.cpu_millis,
        memory_bytes=limits.memory_bytes,
        hugepages=[HelperHugePages(page_size_kib=h.page_size_kib, count=h.count) for h in limits.hugepages],
        mems=limits.mems,
    )


def claim_mps_pipe_dir(mps_root: str | PurePath, control: str) -> str:
    """`<mps root>/<control>/pipe`, the pipe directory of a DRA claim's MPS daemon (the inventory
    makes it; the hold spec mounts it): built only from a control id that is one."""
    if not _MPS_CONTROL_RE.match(control):
        raise ValueError(f"MPS control id {control!r} is not <claim uid>-<6 hex>")
    root = PurePath(mps_root)
    if not root.is_absolute():
        raise ValueError(f"MPS root {str(mps_root)!r} is not an absolute path")
    return str(root / control / "pipe")


def hold_from_wire(w: HelperHold, mps_pipe_dir: str, *, mps_root: str = "") -> HoldContent:
    """The HoldContent a helper request describes; `mps_pipe_dir` is the helper's own (slots), and
    a claim's MPS pipe directory is `<mps_root>/<control>/pipe` (the helper's root, never the wire's).

    ValueError (the text says what) for anything HoldContent refuses: a bad id,
    a reserved or malformed env line, an atom twice, a sliced Kubernetes hold.
    """
    checked_id(w.allocation_id)
    if not ID_RE.match(w.reservation_id):
        raise ValueError(f"reservation id {w.reservation_id!r} is not a valid id")
    return HoldContent(
        allocation_id=w.allocation_id,
        reservation_id=w.reservation_id,
        generation=w.generation,
        binding=w.binding,
        devices=tuple(device_from_wire(d) for d in w.devices),
        cgroup_parent=slice_name(w.allocation_id) if w.sliced else "",
        env=tuple(w.env),
        mps_pipe_dir=claim_mps_pipe_dir(mps_root, w.mps_control) if w.mps_control else (mps_pipe_dir if w.mps else ""),
        limits=limits_from_wire(w.limits) if w.limits is not None else None,
        mps_control=w.mps_control,
    )


def hold_to_wire(c: HoldContent) -> HelperHold:
    """The typed fields of a HoldContent; ValueError when the helper would not rebuild it exactly."""
    w = HelperHold(
        allocation_id=c.allocation_id,
        reservation_id=c.reservation_id,
        generation=c.generation,
        binding=c.binding,  # type: ignore[arg-type]
        devices=[device_to_wire(d) for d in c.devices],
        sliced=bool(c.cgroup_parent),
        env=list(c.env),
        mps=bool(c.mps_pipe_dir) and not c.mps_control,
        limits=limits_to_wire(c.limits) if c.limits is not None else None,
        mps_control=c.mps_control,
    )
    # a claim's pipe directory is <root>/<control>/pipe: the root it was built from
    root = str(PurePath(c.mps_pipe_dir).parent.parent) if c.mps_control else ""
    if hold_from_wire(w, c.mps_pipe_dir, mps_root=root) != c:
        raise ValueError(f"{c.allocation_id}: the hold cannot be written through the root helper unchanged")
    return w

__all__ = [
    "KIND",
    "ANN_ALLOCATION",
    "ANN_RESERVATION",
    "ANN_GENERATION",
    "ANN_CGROUP_PARENT",
    "ANN_BINDING",
    "ANN_LIMITS",
    "ANN_DEVICE_ID",
    "BINDING_HOLD",
    "BINDING_KUBERNETES",
    "HOLD_BINDINGS",
    "BINDING_CLAIM",
    "DISK_BINDINGS",
    "CLAIM_HOLD_PREFIX",
    "claim_hold_id",
    "COPIED_EDITS",
    "CDI_VERSIONS",
    "hold_file_name",
    "env_file_name",
    "slice_name",
    "HoldDevice",
    "HoldContent",
    "device_name",
    "device_env_key",
    "build_cdi_spec",
    "render_cdi_spec",
    "MPS_SHM_DIR",
    "MPS_MOUNT_OPTIONS",
    "mps_mounts",
    "DEFAULT_CONSUMER_DIR",
    "checked_consumer_dir",
    "default_consumer_dir",
    "default_mps_root",
    "DEFAULT_MPS_ROOT",
    "claim_mps_pipe_dir",
    "VFIO_CONTAINER_NODE",
    "consumer_spec",
    "consumer_file_bytes",
    "qualified_names",
    "min_cdi_version",
    "env_lines",
    "render_env_file",
    "HoldOnDisk",
    "NotAHold",
    "parse_hold",
    "check_cdi_rules",
    "validate_against_schema",
    "FILE_KINDS",
    "ENV_SUBDIR",
    "checked_id",
    "hold_file_path",
    "SETTLED_S",
    "file_identity",
    "content_digest",
    "Remembered",
    "remembered_value",
    "VendorCache",
    "hold_file_bytes",
    "gpu_atom_of",
    "device_from_wire",
    "device_to_wire",
    "limits_from_wire",
    "limits_to_wire",
    "hold_from_wire",
    "hold_to_wire",
]
