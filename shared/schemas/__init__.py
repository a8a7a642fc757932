"""bcd's wire types: frozen msgspec Structs, JSON on the wire.

One package for every message that crosses a process boundary. Decoders are
built once here (`CODECS`); import the types from this package, never define a
wire type inside a service.
"""

from __future__ import annotations

from .bus import (
    Claims,
    ClaimKind,
    ClaimDevice,
    ClaimPrepareReply,
    ClaimPrepareRequest,
    ClaimSummary,
    ClaimUnprepareReply,
    ClaimUnprepareRequest,
    MigInstanceReply,
    MigInstanceRequest,
    ClaimSharing,
    MpsDaemonSpec,
    SharingStepReply,
    SharingStepRequest,
    PreparedDevice,
    DraClaimStatus,
    DraPluginStatus,
    ConvergerStatus,
    GpuAction,
    DiagReply,
    DiagRequest,
    MigLayoutReply,
    MigLayoutRequest,
    MigLayoutState,
    GpuOp,
    GpuOpReply,
    GpuOpRequest,
    GpuClaim,
    GpuReply,
    GpuRequest,
    SwitchReply,
    SwitchRequest,
    DevicesQuery,
    Empty,
    EvictReply,
    Freed,
    HeldReply,
    AdvertisedHold,
    DevicePluginStatus,
    PluginResource,
    WithdrawReply,
    HolderQuery,
    HolderReply,
    HoldSummary,
    PendingReleaseSummary,
    OrphanQuery,
    OrphanReply,
    SIGN_BATCH_MAX,
    SignBatchReply,
    SignBatchRequest,
    SignerKey,
    SignItem,
    SignRequest,
    SpecAck,
    HelperDevice,
    HelperFileCopy,
    HelperFileRemove,
    HelperFileWrite,
    HelperHold,
    HelperHugePages,
    HelperInfo,
    HelperLimits,
    HelperReply,
    HelperSliceApply,
    HelperSliceRemove,
)
from .codec import DEFAULT_MAX_BYTES, BadMessage, Codec, SchemaViolation, encode
from .common import *  # noqa: F403
from .common import __all__ as _common_all
from .events import *  # noqa: F403
from .events import __all__ as _events_all
from .inventory import *  # noqa: F403
from .inventory import __all__ as _inventory_all
from .nodespec import *  # noqa: F403
from .kubenode import *  # noqa: F403
from .kubenode import __all__ as _kubenode_all
from .nodespec import __all__ as _nodespec_all
from .events import AllocationBound, AllocationFailed, AllocationReleased, AttestedReport, GpuChanged, Hello, HoldCondition, NodeCondition, NodeEvent, ReportBody, SectionStatus
from .inventory import Inventory
from .nodespec import NodeSpec, SignedNodeSpec

NODE_SPEC_CODEC: Codec[NodeSpec] = Codec(NodeSpec)
SIGNED_NODE_SPEC_CODEC: Codec[SignedNodeSpec] = Codec(SignedNodeSpec, max_bytes=2 * DEFAULT_MAX_BYTES)
INVENTORY_CODEC: Codec[Inventory] = Codec(Inventory, max_bytes=4 * DEFAULT_MAX_BYTES)
HELLO_CODEC: Codec[Hello] = Codec(Hello, max_bytes=64 * 1024)
REPORT_BODY_CODEC: Codec[ReportBody] = Codec(ReportBody, max_bytes=256 * 1024)
ATTESTED_REPORT_CODEC: Codec[AttestedReport] = Codec(AttestedReport, max_bytes=512 * 1024)
NODE_EVENT_CODEC: Codec[NodeEvent] = Codec(NodeEvent, max_bytes=256 * 1024)  # type: ignore[arg-type]
SIGN_REQUEST_CODEC: Codec[SignRequest] = Codec(SignRequest, max_bytes=256 * 1024)
#: a batch is at most the node bus's max payload (1 MiB); the converger keeps requests far below it.
SIGN_BATCH_REQUEST_CODEC: Codec[SignBatchRequest] = Codec(SignBatchRequest, max_bytes=1024 * 1024)
SIGN_BATCH_REPLY_CODEC: Codec[SignBatchReply] = Codec(SignBatchReply, max_bytes=1024 * 1024)
SIGNER_KEY_CODEC: Codec[SignerKey] = Codec(SignerKey, max_bytes=4096)
EMPTY_CODEC: Codec[Empty] = Codec(Empty, max_bytes=4096)
SPEC_ACK_CODEC: Codec[SpecAck] = Codec(SpecAck, max_bytes=4096)
CONVERGER_STATUS_CODEC: Codec[ConvergerStatus] = Codec(ConvergerStatus, max_bytes=8 * DEFAULT_MAX_BYTES)
HOLDER_QUERY_CODEC: Codec[HolderQuery] = Codec(HolderQuery, max_bytes=4096)
HOLDER_REPLY_CODEC: Codec[HolderReply] = Codec(HolderReply, max_bytes=4096)
DEVICES_QUERY_CODEC: Codec[DevicesQuery] = Codec(DevicesQuery, max_bytes=64 * 1024)
HELD_REPLY_CODEC: Codec[HeldReply] = Codec(HeldReply, max_bytes=256 * 1024)
GPU_OP_REQUEST_CODEC: Codec[GpuOpRequest] = Codec(GpuOpRequest, max_bytes=4096)
GPU_OP_REPLY_CODEC: Codec[GpuOpReply] = Codec(GpuOpReply, max_bytes=64 * 1024)
DIAG_REQUEST_CODEC: Codec[DiagRequest] = Codec(DiagRequest, max_bytes=4096)
DIAG_REPLY_CODEC: Codec[DiagReply] = Codec(DiagReply, max_bytes=512 * 1024)
MIG_LAYOUT_REQUEST_CODEC: Codec[MigLayoutRequest] = Codec(MigLayoutRequest, max_bytes=64 * 1024)
MIG_LAYOUT_REPLY_CODEC: Codec[MigLayoutReply] = Codec(MigLayoutReply, max_bytes=64 * 1024)
DEVICE_PLUGIN_STATUS_CODEC: Codec[DevicePluginStatus] = Codec(DevicePluginStatus, max_bytes=4 * DEFAULT_MAX_BYTES)
WITHDRAW_REPLY_CODEC: Codec[WithdrawReply] = Codec(WithdrawReply, max_bytes=64 * 1024)
EVICT_REPLY_CODEC: Codec[EvictReply] = Codec(EvictReply, max_bytes=256 * 1024)
FREED_CODEC: Codec[Freed] = Codec(Freed, max_bytes=64 * 1024)
ORPHAN_QUERY_CODEC: Codec[OrphanQuery] = Codec(OrphanQuery, max_bytes=4 * DEFAULT_MAX_BYTES)
ORPHAN_REPLY_CODEC: Codec[OrphanReply] = Codec(OrphanReply, max_bytes=256 * 1024)
NODE_REQUEST_CODEC: Codec[NodeRequest] = Codec(NodeRequest, max_bytes=64 * 1024)  # type: ignore[arg-type]
NODE_REPLY_CODEC: Codec[NodeReply] = Codec(NodeReply, max_bytes=512 * 1024)
SWITCH_REQUEST_CODEC: Codec[SwitchRequest] = Codec(SwitchRequest, max_bytes=4096)
SWITCH_REPLY_CODEC: Codec[SwitchReply] = Codec(SwitchReply, max_bytes=64 * 1024)
CLAIMS_CODEC: Codec[Claims] = Codec(Claims, max_bytes=4 * DEFAULT_MAX_BYTES)
GPU_REQUEST_CODEC: Codec[GpuRequest] = Codec(GpuRequest, max_bytes=4096)
GPU_REPLY_CODEC: Codec[GpuReply] = Codec(GpuReply, max_bytes=DEFAULT_MAX_BYTES)
GPU_CHANGED_CODEC: Codec[GpuChanged] = Codec(GpuChanged, max_bytes=256 * 1024)
HELPER_FILE_WRITE_CODEC: Codec[HelperFileWrite] = Codec(HelperFileWrite, max_bytes=1024 * 1024)
HELPER_FILE_REMOVE_CODEC: Codec[HelperFileRemove] = Codec(HelperFileRemove, max_bytes=4096)
HELPER_FILE_COPY_CODEC: Codec[HelperFileCopy] = Codec(HelperFileCopy, max_bytes=4096)
HELPER_SLICE_APPLY_CODEC: Codec[HelperSliceApply] = Codec(HelperSliceApply, max_bytes=16 * 1024)
HELPER_SLICE_REMOVE_CODEC: Codec[HelperSliceRemove] = Codec(HelperSliceRemove, max_bytes=4096)
HELPER_REPLY_CODEC: Codec[HelperReply] = Codec(HelperReply, max_bytes=16 * 1024)
HELPER_INFO_CODEC: Codec[HelperInfo] = Codec(HelperInfo, max_bytes=64 * 1024)
DRA_PLUGIN_STATUS_CODEC: Codec[DraPluginStatus] = Codec(DraPluginStatus, max_bytes=4 * DEFAULT_MAX_BYTES)
MIG_INSTANCE_REQUEST_CODEC: Codec[MigInstanceRequest] = Codec(MigInstanceRequest, max_bytes=4096)
MIG_INSTANCE_REPLY_CODEC: Codec[MigInstanceReply] = Codec(MigInstanceReply, max_bytes=64 * 1024)
CLAIM_PREPARE_REQUEST_CODEC: Codec[ClaimPrepareRequest] = Codec(ClaimPrepareRequest, max_bytes=256 * 1024)
CLAIM_PREPARE_REPLY_CODEC: Codec[ClaimPrepareReply] = Codec(ClaimPrepareReply, max_bytes=256 * 1024)
CLAIM_UNPREPARE_REQUEST_CODEC: Codec[ClaimUnprepareRequest] = Codec(ClaimUnprepareRequest, max_bytes=4096)
CLAIM_UNPREPARE_REPLY_CODEC: Codec[ClaimUnprepareReply] = Codec(ClaimUnprepareReply, max_bytes=64 * 1024)
SHARING_STEP_REQUEST_CODEC: Codec[SharingStepRequest] = Codec(SharingStepRequest, max_bytes=16 * 1024)
SHARING_STEP_REPLY_CODEC: Codec[SharingStepReply] = Codec(SharingStepReply, max_bytes=256 * 1024)

#: the upstream contract's types, whose JSON Schema is checked in (docs/schema/).
UPSTREAM_TYPES: dict[str, object] = {
    "NodeSpec": NodeSpec,
    "SignedNodeSpec": SignedNodeSpec,
    "Hello": Hello,
    "Inventory": Inventory,
    "ReportBody": ReportBody,
    "AttestedReport": AttestedReport,
    "AllocationBound": AllocationBound,
    "AllocationReleased": AllocationReleased,
    "AllocationFailed": AllocationFailed,
    "SectionStatus": SectionStatus,
    "NodeCondition": NodeCondition,
    "GpuChanged": GpuChanged,
    "HoldCondition": HoldCondition,
    "NodeEvent": NodeEvent,
}

__all__ = [  # noqa: PLE0604
    *_common_all,
    *_events_all,
    *_inventory_all,
    *_nodespec_all,
    *_kubenode_all,
    "NODE_REQUEST_CODEC",
    "NODE_REPLY_CODEC",
    "Empty",
    "SignerKey",
    "SpecAck",
    "HoldSummary",
    "PendingReleaseSummary",
    "ConvergerStatus",
    "HolderQuery",
    "HolderReply",
    "SPEC_ACK_CODEC",
    "CONVERGER_STATUS_CODEC",
    "HOLDER_QUERY_CODEC",
    "HOLDER_REPLY_CODEC",
    "DevicesQuery",
    "HeldReply",
    "EvictReply",
    "Freed",
    "OrphanQuery",
    "OrphanReply",
    "DEVICES_QUERY_CODEC",
    "HELD_REPLY_CODEC",
    "DEVICE_PLUGIN_STATUS_CODEC",
    "GPU_OP_REQUEST_CODEC",
    "GPU_OP_REPLY_CODEC",
    "DIAG_REQUEST_CODEC",
    "DIAG_REPLY_CODEC",
    "MIG_LAYOUT_REQUEST_CODEC",
    "MIG_LAYOUT_REPLY_CODEC",
    "MigLayoutRequest",
    "MigLayoutReply",
    "MigLayoutState",
    "GpuOp",
    "GpuOpReply",
    "GpuOpRequest",
    "DiagRequest",
    "DiagReply",
    "WITHDRAW_REPLY_CODEC",
    "AdvertisedHold",
    "DevicePluginStatus",
    "PluginResource",
    "WithdrawReply",
    "EVICT_REPLY_CODEC",
    "FREED_CODEC",
    "ORPHAN_QUERY_CODEC",
    "ORPHAN_REPLY_CODEC",
    "SignRequest",
    "SIGN_BATCH_MAX",
    "SignItem",
    "SignBatchRequest",
    "SignBatchReply",
    "SIGN_BATCH_REQUEST_CODEC",
    "SIGN_BATCH_REPLY_CODEC",
    "SwitchRequest",
    "SwitchReply",
    "ClaimKind",
    "GpuClaim",
    "Claims",
    "GpuAction",
    "GpuRequest",
    "GpuReply",
    "SWITCH_REQUEST_CODEC",
    "SWITCH_REPLY_CODEC",
    "CLAIMS_CODEC",
    "GPU_REQUEST_CODEC",
    "GPU_REPLY_CODEC",
    "GPU_CHANGED_CODEC",
    "BadMessage",
    "SchemaViolation",
    "Codec",
    "DEFAULT_MAX_BYTES",
    "encode",
    "NODE_SPEC_CODEC",
    "SIGNED_NODE_SPEC_CODEC",
    "INVENTORY_CODEC",
    "HELLO_CODEC",
    "REPORT_BODY_CODEC",
    "ATTESTED_REPORT_CODEC",
    "NODE_EVENT_CODEC",
    "SIGN_REQUEST_CODEC",
    "SIGNER_KEY_CODEC",
    "EMPTY_CODEC",
    "UPSTREAM_TYPES",
    "HelperDevice",
    "HelperFileCopy",
    "HelperFileRemove",
    "HelperFileWrite",
    "HelperHold",
    "HelperHugePages",
    "HelperInfo",
    "HelperLimits",
    "HelperReply",
    "HelperSliceApply",
    "HelperSliceRemove",
    "HELPER_FILE_WRITE_CODEC",
    "HELPER_FILE_REMOVE_CODEC",
    "HELPER_FILE_COPY_CODEC",
    "HELPER_SLICE_APPLY_CODEC",
    "HELPER_SLICE_REMOVE_CODEC",
    "HELPER_REPLY_CODEC",
    "HELPER_INFO_CODEC",
]
