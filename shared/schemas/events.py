"""Events a node reports, the signed report envelope, and the node record.

Bound and Released are signed: they travel as an AttestedReport whose body
(ReportBody, stamped by the signer with node id, boot id and time) carries the
tagged event. Failed, section, condition and gpu events travel plain. The tag
field is `event`, and each tag is the `<type>` of the upstream subject
`bcd.events.<node_id>.<type>`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from .common import (
    AtomId,
    Condition,
    EventId,
    Generation,
    Id,
    KeyId,
    Name,
    PciAddress,
    Text,
)
from .inventory import ManagementState, Phase, PhysicalGPUStatus

SectionState = Literal["PROGRESSING", "CONVERGED", "FAILED"]

#: failure reasons of the converger's checks (seed: Failure reasons).
FailureReason = Literal[
    "unsupported-binding",
    "node-unprivileged",
    "unsupported-device",
    "device-missing",
    #: the card is unhealthy (its Healthy condition is False: a fatal XID, an uncorrectable ECC
    #: error, lost); the message names the condition (issue 30)
    "device-unhealthy",
    "overlap",
    "resources-exhausted",
]

CAPABILITIES: tuple[str, ...] = ("cdi", "devices.limits", "binding.kubernetes", "nvml")

_Devices = Annotated[list[AtomId], msgspec.Meta(max_length=64)]


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    """Base of the tagged events."""


class AllocationBound(_Event, tag="bound", kw_only=True):
    allocation_id: Id
    reservation_id: Id
    generation: Generation
    devices: _Devices
    #: the hold's slice ("" for an unsliced or Kubernetes hold).
    cgroup_parent: Name = ""
    #: qualified CDI names, e.g. bcd.dev/gpu=GPU-...
    cdi_devices: list[Name] = []


class AllocationReleased(_Event, tag="released", kw_only=True):
    allocation_id: Id
    reservation_id: Id
    generation: Generation
    devices: _Devices


class AllocationFailed(_Event, tag="failed", kw_only=True):
    allocation_id: Id
    reservation_id: Id
    generation: Generation
    reason: FailureReason
    message: Text = ""


class SectionStatus(_Event, tag="section", kw_only=True):
    section: Name
    state: SectionState
    observed_generation: Generation
    message: Text = ""


class NodeCondition(_Event, tag="condition", kw_only=True):
    """A node condition changed (KubernetesReleaseStuck, NodeSpecRejected, ...)."""

    condition: Condition


class GpuChanged(_Event, tag="gpu", kw_only=True):
    """A card's PhysicalGPU status changed, or a driver switch happened on it."""

    pci_address: PciAddress
    uuid: Name = ""
    phase: Phase
    management_state: ManagementState
    status: PhysicalGPUStatus
    #: the switch event behind this report (VFIOPrepareSucceeded, VFIOPrepareFailed,
    #: VFIOUnprepareFailed), or "" for a change the inventory derived by itself.
    reason: Name = ""
    message: Text = ""


class HoldCondition(_Event, tag="hold", kw_only=True):
    """A live hold's condition changed (issue 30): a card under it turned unhealthy, or is well again.

    The hold is kept (the seed releases only what the control plane no longer wants); this says
    so the control plane can move the work. `condition.type` is DevicesHealthy: False with the
    worst card's Healthy reason (XidCritical, GpuLost, ...) naming each sick card, True once
    every card of the hold is healthy again.
    """

    allocation_id: Id
    reservation_id: Id
    generation: Generation
    #: the hold's atoms on the cards the condition is about (every atom of the hold when True)
    devices: _Devices
    condition: Condition


#: the events a node signs.
AttestedEvent = AllocationBound | AllocationReleased
#: every event a node reports.
NodeEvent = AllocationBound | AllocationReleased | AllocationFailed | SectionStatus | NodeCondition | GpuChanged | HoldCondition

EVENT_TYPES: tuple[str, ...] = ("bound", "released", "failed", "section", "condition", "gpu", "hold")

REPORT_PURPOSE = "attested-report"
NODE_SPEC_PURPOSE = "node-spec"


class ReportBody(msgspec.Struct, frozen=True, kw_only=True):
    node_id: Id
    boot_id: Name
    event_id: EventId
    time: datetime
    event: AttestedEvent


class AttestedReport(msgspec.Struct, frozen=True, kw_only=True):
    """`signature` covers `b"attested-report\\0" + body` (body is ReportBody JSON)."""

    purpose: Literal["attested-report"] = "attested-report"
    key_id: KeyId
    body: bytes
    signature: bytes


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    """Node record in KV `bcd_nodes/<node_id>`."""

    node_id: Id
    boot_id: Name
    public_key: bytes  # raw Ed25519, base64 on the wire
    key_id: KeyId
    capabilities: list[Name] = []
    agent_version: Name = ""
    started_at: datetime


__all__ = [
    "SectionState",
    "FailureReason",
    "CAPABILITIES",
    "AllocationBound",
    "AllocationReleased",
    "AllocationFailed",
    "SectionStatus",
    "NodeCondition",
    "GpuChanged",
    "HoldCondition",
    "AttestedEvent",
    "NodeEvent",
    "EVENT_TYPES",
    "REPORT_PURPOSE",
    "NODE_SPEC_PURPOSE",
    "ReportBody",
    "AttestedReport",
    "Hello",
]
