"""Request and reply bodies of node-bus endpoints (never seen upstream)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from .common import AtomId, EventId, Id, KeyId, Name, PciAddress, Text
from .events import AttestedEvent, SectionStatus
from .inventory import Gpu


class SignRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the signer for an AttestedReport.

    `purpose` is a plain string so an unknown purpose reaches the signer and is
    refused with a reason instead of failing as a decode error.
    """

    purpose: Annotated[str, msgspec.Meta(max_length=64)]
    event_id: EventId
    event: AttestedEvent


class SignerKey(msgspec.Struct, frozen=True, kw_only=True):
    node_id: Id
    public_key: bytes
    key_id: KeyId
    boot_id: Name


class Empty(msgspec.Struct, frozen=True, kw_only=True):
    """A request with no arguments (an empty body also decodes as this)."""




class SpecAck(msgspec.Struct, frozen=True, kw_only=True):
    """The converger's answer to a handed-over NodeSpec."""

    generation: int
    #: False when the spec was the one already applied (nothing new to do).
    changed: bool = True


class HoldSummary(msgspec.Struct, frozen=True, kw_only=True):
    allocation_id: str
    reservation_id: str
    generation: int
    binding: str
    devices: list[str]
    cgroup_parent: str = ""
    reported: bool = True


class ConvergerStatus(msgspec.Struct, frozen=True, kw_only=True):
    generation: int | None = None
    section: SectionStatus | None = None
    holds: list[HoldSummary] = []
    #: allocation id -> reason, for the failures of the current generation.
    failures: dict[str, str] = {}
    last_pass_at: datetime | None = None
    next_retry_in_s: float | None = None
    #: the converger can write CDI specs and slices (root, fake host or helper).
    privileged: bool = True
    #: bindings it binds as holds.
    bindings: list[str] = []
    #: the vendor's CDI spec the holds copy edits from ("" when there is none).
    vendor_cdi_spec: str = ""


class HolderQuery(msgspec.Struct, frozen=True, kw_only=True):
    """A GPU by canonical PCI address or GPU atom id."""

    gpu: Annotated[str, msgspec.Meta(max_length=128)]


class HolderReply(msgspec.Struct, frozen=True, kw_only=True):
    held: bool
    #: "allocation", "instance", "domain", "release" or "" when free.
    kind: str = ""
    holder: str = ""
    gpu: str = ""




# --------------------------------------------------------------------------- kube_reaper


class DevicesQuery(msgspec.Struct, frozen=True, kw_only=True):
    """Devices (atom ids) of one allocation, asked about or to be freed."""

    allocation_id: Id
    devices: Annotated[list[AtomId], msgspec.Meta(max_length=64)]


class HeldReply(msgspec.Struct, frozen=True, kw_only=True):
    #: True when a pod (or a kubepods process) holds any of the devices, or when
    #: that could not be established (unreachable kubelet counts as held).
    held: bool
    reachable: bool = True
    #: "namespace/pod" (or "pid N") per holder.
    holders: list[str] = []
    detail: str = ""


class EvictReply(msgspec.Struct, frozen=True, kw_only=True):
    #: pods an eviction was requested for (asynchronously, with backoff on 429).
    evicting: list[str] = []
    errors: list[str] = []


class Freed(msgspec.Struct, frozen=True, kw_only=True):
    """Published by kube_reaper when no pod holds the devices of a withdrawn allocation any more."""

    allocation_id: Id
    devices: list[AtomId] = []


class OrphanQuery(msgspec.Struct, frozen=True, kw_only=True):
    """Atoms of every allocation the node knows; anything else a pod holds is an orphan."""

    known_devices: Annotated[list[AtomId], msgspec.Meta(max_length=65536)] = []


class OrphanReply(msgspec.Struct, frozen=True, kw_only=True):
    reachable: bool
    #: "namespace/pod: device" for each bcd GPU held by a pod outside known allocations.
    orphans: list[str] = []

# --------------------------------------------------------------------------- VFIO and PhysicalGPU


class SwitchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Ask vfio_switcher to move one GPU between its native driver and vfio-pci.

    Plain bounded strings, not patterns: a malformed address or an unknown
    target reaches the switcher and is refused with a reason (InvalidAddress,
    InvalidRequest) instead of failing as an anonymous decode error.
    """

    pci: Annotated[str, msgspec.Meta(max_length=64)]
    #: "vfio-pci" or "native"
    target: Annotated[str, msgspec.Meta(max_length=16)]
    #: who asks and why (logs and the result notice only)
    why: Annotated[str, msgspec.Meta(max_length=256)] = ""


class SwitchReply(msgspec.Struct, frozen=True, kw_only=True):
    """What a switch did; also published as a notice on `vfio_switcher.result`."""

    pci: Annotated[str, msgspec.Meta(max_length=128)]
    target: Annotated[str, msgspec.Meta(max_length=32)]
    #: Succeeded | Unchanged | Refused | Failed | DisruptionRequired
    outcome: Name
    #: machine-readable cause (see services/vfio_switcher/switch.py SwitchResult.reason)
    reason: Name
    message: Text = ""
    #: VFIOPrepareSucceeded | VFIOPrepareFailed | VFIOUnprepareFailed, or "" (refusals, no-ops)
    event: Name = ""
    #: the driver seen last ("" for none or not read)
    driver: Name = ""
    rolled_back: bool = False
    #: who holds the GPU, for reason Held
    holder: Name = ""
    #: the boot the switch ran in (a DisruptionRequired clears only after another one)
    boot_id: Name = ""
    why: Annotated[str, msgspec.Meta(max_length=256)] = ""
    at: datetime

    @property
    def ok(self) -> bool:
        return self.outcome in ("Succeeded", "Unchanged")


ClaimKind = Literal["allocation", "release", "instance", "domain"]


class GpuClaim(msgspec.Struct, frozen=True, kw_only=True):
    """One thing that claims a GPU: a hold, a pending Kubernetes release, an instance spec, a running domain."""

    pci_address: PciAddress
    kind: ClaimKind
    holder: Name


class Claims(msgspec.Struct, frozen=True, kw_only=True):
    """The converger's claims on every GPU (endpoint `converger.claims`, notice `converger.claims_changed`).

    A GPU absent from `claims` is claimed by nothing the converger knows.
    `vfio` lists the GPUs the converger itself put on vfio-pci (and will
    return); a card on vfio-pci that is not listed was bound by someone else.
    """

    claims: list[GpuClaim] = []
    vfio: list[PciAddress] = []
    generation: int | None = None
    at: datetime


GpuAction = Literal["exclude", "include", "reclaim"]


class GpuRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An operator's request on one card (`bcd gpu exclude|include|reclaim <pci>`), answered by the inventory."""

    action: GpuAction
    #: bounded plain string: a non-canonical address is refused with a reason.
    pci: Annotated[str, msgspec.Meta(max_length=64)]


class GpuReply(msgspec.Struct, frozen=True, kw_only=True):
    pci: Annotated[str, msgspec.Meta(max_length=128)]
    action: Name
    #: False: refused (the message says why; for reclaim, the Reclaim condition too)
    accepted: bool
    message: Text = ""
    #: the card after the request, with its PhysicalGPU status
    gpu: Gpu | None = None


__all__ = [
    "SwitchRequest",
    "SwitchReply",
    "ClaimKind",
    "GpuClaim",
    "Claims",
    "GpuAction",
    "GpuRequest",
    "GpuReply",
    "SignRequest",
    "SignerKey",
    "Empty",
    "SpecAck",
    "HoldSummary",
    "ConvergerStatus",
    "HolderQuery",
    "HolderReply",
    "DevicesQuery",
    "HeldReply",
    "EvictReply",
    "Freed",
    "OrphanQuery",
    "OrphanReply",
]
