"""What a hold is: its devices (HoldDevice) and content (HoldContent), and the ids and names they go by.

Every file of a hold is written from one HoldContent, so the rules a hold
must meet are checked once, when a HoldContent is built: each is one that
`parse_hold` (ondisk) enforces on the way back, so a hold that builds also
reads back. Here too are what a hold's files and its CDI devices are called,
the CDI kind, the bindings that make a hold, the annotation keys its spec
records it in, and where a DRA claim's own MPS daemon lives.

Decisions (DESIGN 5, "CDI rules"; the seed's example is the target shape):

* Device names. A CDI device name allows letters, digits and `_ . - :`,
  alphanumeric at both ends, and no `/`. An atom id made of those characters
  plus `/` (every GPU, MIG and slot atom) is named by turning each `/` into
  `_` ("GPU-<uuid>/gi1/ci0" -> "GPU-<uuid>_gi1_ci0"), which is reversible
  because such ids contain no `_`. Any other id gets a sanitised stem, `__`
  and 16 hex digits of its sha256; `__` never occurs in the first form, so
  names stay unique per atom. The real id is always in the device annotation
  `bcd.dev/device-id`.
* Vendor names of a MIG device. NVIDIA's `nvidia-ctk cdi generate` names a
  MIG device by its MIG uuid and/or `<gpu index>:<mig index>`, where the mig
  index is the position of the device in NVML's MIG device handle list, NOT
  the GPU instance id (on the example host gi5/ci0 is "6:2"). The inventory
  does not carry that index, so `HoldDevice.for_mig` names the MIG uuid and
  adds `<gpu index>:<mig index>` only when the caller knows the index.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Literal

from shared.schemas import Limits
from shared.schemas.bus import MPS_CONTROL_PATTERN
from shared.schemas.common import ATOM_PATTERN, ENV_LINE_PATTERN, ID_RE, env_key_problem, env_value_problem

# the systemd slice of a sliced hold, also its bcd.dev/cgroup-parent
from shared.slices import slice_name

from .envfile import env_lines

#: the CDI kind of every hold; a container asks for `bcd.dev/gpu=<device name>`.
KIND = "bcd.dev/gpu"

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


#: the annotations a hold spec records the hold in (ANN_DEVICE_ID: each device's real atom id).
ANN_ALLOCATION = "bcd.dev/allocation-id"
ANN_RESERVATION = "bcd.dev/reservation-id"
ANN_GENERATION = "bcd.dev/generation"
ANN_CGROUP_PARENT = "bcd.dev/cgroup-parent"
ANN_BINDING = "bcd.dev/binding"
ANN_LIMITS = "bcd.dev/limits"
ANN_DEVICE_ID = "bcd.dev/device-id"
#: the most a spec's (or a device's) annotations may hold, keys and values together (the CDI library's bound).
ANNOTATIONS_MAX_BYTES = 256 * 1024

#: NVIDIA_VISIBLE_DEVICES of a hold whose cards are on vfio-pci (the NVIDIA runtime adds nothing)
VFIO_VISIBLE = "void"
#: the largest IOMMU group number a hold names (the kernel's are small integers)
IOMMU_GROUP_MAX = 65535

# Patterns end in `\Z`, not `$`: `$` also matches before a trailing newline.
ATOM_RE = re.compile(ATOM_PATTERN)
_ENV_LINE_RE = re.compile(ENV_LINE_PATTERN)
_VISIBLE_ID_RE = re.compile(r"^[!-+\--~]+\Z")  # printable ASCII without ',' (0x2c)
_SHARE_ID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
#: atom ids named by plain `/` -> `_` (no `_`, alphanumeric at both ends).
_SIMPLE_ATOM_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.:/-]*[A-Za-z0-9])?\Z")
_MPS_CONTROL_RE = re.compile(MPS_CONTROL_PATTERN)


def hold_file_name(allocation_id: str) -> str:
    """The CDI spec's file name inside cdi_dir."""
    return f"bcd-{allocation_id}.json"


def env_file_name(allocation_id: str) -> str:
    """The env file's name inside the allocations' env directory."""
    return f"{allocation_id}.env"


def checked_id(allocation_id: str) -> str:
    """The id itself; ValueError unless it is a valid allocation id (a file-name part)."""
    if not isinstance(allocation_id, str) or not ID_RE.match(allocation_id):
        raise ValueError(f"allocation id {allocation_id!r} is not a valid id")
    return allocation_id


def device_name(atom_id: str) -> str:
    """The CDI device name of an atom: valid, unique per atom id, readable (see the module docstring)."""
    if _SIMPLE_ATOM_RE.match(atom_id) and "//" not in atom_id:
        return atom_id.replace("/", "_")
    digest = hashlib.sha256(atom_id.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9.:-]+", "-", atom_id).strip(".:-")[:64].strip(".:-") or "atom"
    return f"{stem}__{digest}"


#: where DRA claims' MPS daemons live on a real host (`<root>/<control>/{pipe,log,shm}`, root's)
DEFAULT_MPS_ROOT = "/run/bcd/mps"


def default_mps_root(run_dir: Path | str, *, fake_host: bool) -> str:
    """The MPS root when `--mps-root` is not given: /run/bcd/mps; `<run_dir>/mps` on a fake host
    (which must never make directories in the real host's /run)."""
    return str(Path(os.path.realpath(run_dir)) / "mps") if fake_host else DEFAULT_MPS_ROOT


def claim_mps_pipe_dir(mps_root: str | PurePath, control: str) -> str:
    """`<mps root>/<control>/pipe`, the pipe directory of a DRA claim's MPS daemon (its root unit
    makes it; the hold spec mounts it): built only from a control id that is one."""
    if not _MPS_CONTROL_RE.match(control):
        raise ValueError(f"MPS control id {control!r} is not <claim uid>-<6 hex>")
    root = PurePath(mps_root)
    if not root.is_absolute():
        raise ValueError(f"MPS root {str(mps_root)!r} is not an absolute path")
    return str(root / control / "pipe")


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
        if not ATOM_RE.search(self.atom_id):
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
            if not _ENV_LINE_RE.search(line):
                raise ValueError(f"{self.allocation_id}: env line {line!r} is not allowed: not one KEY=VALUE line")
            # the spec's rule again, at every writer (the root helper's too): bcd's own keys, and
            # those the loader, libc, the runtime's hook or a shell reads (common.env_key_problem)
            problem = env_key_problem(line.split("=", 1)[0])
            if problem:
                raise ValueError(f"{self.allocation_id}: env line {line!r} is not allowed: {problem}")
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
    def mps_shm_dir(self) -> str:
        """A DRA claim's MPS daemon's shared memory (`<mps root>/<control>/shm`, a tmpfs of that
        daemon's own, mounted at the container's /dev/shm); "" for a hold without a daemon of its own."""
        return str(PurePath(self.mps_pipe_dir).parent / "shm") if self.mps_control else ""

    @property
    def visible_devices(self) -> str:
        """NVIDIA_VISIBLE_DEVICES: the unique visible ids, in device order."""
        return ",".join(dict.fromkeys(d.visible_id for d in self.devices))
