"""The node's own Kubernetes Node on the node bus (`kube_reaper.node`), and the MIG re-layout it drives.

The converger runs the seed's MIG re-layout flow (services/converger/relayout.py) but holds no
Kubernetes credentials: it reads its Node and changes it through kube_reaper, which does only
what `NodeChange` can say and checks each key against the short list the flow needs
(services/kube_reaper/nodeapi.py), so a converger identity cannot relabel a Node at large.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

import msgspec

from .common import Name, PciAddress, Text

#: a label or annotation key as Kubernetes bounds it (prefix 253 + "/" + name 63).
NodeKey = Annotated[str, msgspec.Meta(min_length=1, max_length=317)]
#: a label value (63) or one of the flow's annotation texts (bounded here, not by Kubernetes).
NodeValue = Annotated[str, msgspec.Meta(max_length=1024)]

#: the seed's names (DESIGN: seed 003, "Настройка выделения GPU по стратегии MIG").
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
MIG_STATE_LABEL = "nvidia.com/mig.config.state"
MIG_CAPABLE_LABEL = "nvidia.com/mig.capable"
GPU_DEPLOY_PREFIX = "nvidia.com/gpu.deploy."
PAUSED_VALUE = "paused-for-mig-change"
RELAYOUT_TAINT_KEY = "mig-reconfigure"
RELAYOUT_TAINT_VALUE = "true"
RELAYOUT_TAINT_EFFECT = "NoSchedule"
#: bcd's own: what the state label cannot say (a label value has no spaces): the job's step and why.
RELAYOUT_MESSAGE_ANNOTATION = "bcd.dev/mig.config.message"
#: the most the message annotation carries (kube_reaper refuses more: services/kube_reaper/nodeapi.py).
RELAYOUT_MESSAGE_MAX = 1024
#: the GPU clients the flow pauses: the GPU operator's operands whose DaemonSets select on
#: `nvidia.com/gpu.deploy.<operand>=true` and hold the card (NVIDIA mig-parted's reconfigure: device
#: plugin, GFD, DCGM exporter, DCGM, NVSM, and the `client` label newer operators set). The driver and
#: the container toolkit are no clients: pausing them would take the driver off the node.
GPU_CLIENT_OPERANDS = ("device-plugin", "gpu-feature-discovery", "dcgm-exporter", "dcgm", "nvsm", "client")
#: the states the seed names for `nvidia.com/mig.config.state`.
MIG_STATES = ("pending", "rebooting", "success", "failed")


class NodeTaint(msgspec.Struct, frozen=True, kw_only=True):
    key: NodeKey
    value: Annotated[str, msgspec.Meta(max_length=63)] = ""
    effect: Annotated[str, msgspec.Meta(max_length=32)]


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """What the flow reads of the Node: its labels, the flow's annotation, taints, cordon."""

    name: Name
    resource_version: Annotated[str, msgspec.Meta(max_length=128)]
    labels: Annotated[dict[NodeKey, NodeValue], msgspec.Meta(max_length=1024)] = {}
    #: only bcd's own annotations (RELAYOUT_MESSAGE_ANNOTATION): the rest is nobody's business here
    annotations: Annotated[dict[NodeKey, NodeValue], msgspec.Meta(max_length=16)] = {}
    taints: Annotated[list[NodeTaint], msgspec.Meta(max_length=256)] = []
    unschedulable: bool = False


class NodeRead(msgspec.Struct, frozen=True, kw_only=True, tag="read"):
    """Read the Node now."""


class NodeChange(msgspec.Struct, frozen=True, kw_only=True, tag="change"):
    """One atomic change of the Node, made only if it is still at `resource_version` (else conflict)."""

    resource_version: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    #: key -> new value, or None to remove it. Only the flow's keys: MIG_CONFIG_LABEL,
    #: MIG_STATE_LABEL, GPU_DEPLOY_PREFIX* (kube_reaper refuses the rest)
    labels: Annotated[dict[NodeKey, NodeValue | None], msgspec.Meta(max_length=64)] = {}
    #: only RELAYOUT_MESSAGE_ANNOTATION
    annotations: Annotated[dict[NodeKey, NodeValue | None], msgspec.Meta(max_length=4)] = {}
    #: add (True) or remove (False) the re-layout taint; None leaves it
    relayout_taint: bool | None = None
    #: cordon (True) or uncordon (False); None leaves it
    unschedulable: bool | None = None


NodeRequest = NodeRead | NodeChange


class NodeReply(msgspec.Struct, frozen=True, kw_only=True):
    """The Node as it is after the request; `ok` False says why in `detail`."""

    ok: bool
    #: False: the API server (or credentials) could not be reached; nothing was changed
    reachable: bool = True
    #: the change lost a race: the Node was at another resource version (read again)
    conflict: bool = False
    #: kube_reaper runs with no Node API (--node-api none): there is no Kubernetes Node to read
    disabled: bool = False
    node: NodeView | None = None
    detail: Text = ""


class RelayoutCardState(msgspec.Struct, frozen=True, kw_only=True):
    """One card's part of a re-layout (status and metrics)."""

    pci_address: PciAddress
    #: the layout asked ("all-disabled" or profiles, comma-separated) and the one before
    target: Annotated[str, msgspec.Meta(max_length=1024)]
    before: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    #: waiting | draining | applying | rebooting | rollback | done
    step: Name
    #: "" while it runs; success | failed
    outcome: Name = ""
    message: Text = ""


class RelayoutState(msgspec.Struct, frozen=True, kw_only=True):
    """The node's MIG re-layout (driven by its Node's `nvidia.com/mig.config`): the one running or the last."""

    #: the label value it applies ("all-1g.18gb", "all-disabled")
    config: Annotated[str, msgspec.Meta(max_length=1024)]
    #: pausing | draining | applying | finishing | done
    step: Name
    #: "" while it runs; success | failed
    outcome: Name = ""
    message: Text = ""
    started_at: datetime
    step_since: datetime
    cards: Annotated[list[RelayoutCardState], msgspec.Meta(max_length=64)] = []
    #: what the flow did to the Node and undoes at the end
    paused_labels: Annotated[list[NodeKey], msgspec.Meta(max_length=64)] = []
    tainted: bool = False
    cordoned: bool = False


class RelayoutStatus(msgspec.Struct, frozen=True, kw_only=True):
    """`converger.status`'s relayout part: the Node label seen, the job running (or the last), and a note."""

    #: the Node's `nvidia.com/mig.config` and `.state` as last read ("" when absent or not read)
    desired: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    state_label: Name = ""
    #: the last read of the Node: when, and why it failed ("" when it read)
    read_at: datetime | None = None
    read_error: Text = ""
    running: RelayoutState | None = None
    last: RelayoutState | None = None
    #: why the flow does nothing now although a label asks (no MIG-capable card, ...), or ""
    note: Text = ""


MigState = Literal["pending", "rebooting", "success", "failed"]

__all__ = [
    "GPU_CLIENT_OPERANDS",
    "GPU_DEPLOY_PREFIX",
    "MIG_CAPABLE_LABEL",
    "MIG_CONFIG_LABEL",
    "MIG_STATES",
    "MIG_STATE_LABEL",
    "MigState",
    "NodeChange",
    "NodeKey",
    "NodeRead",
    "NodeReply",
    "NodeRequest",
    "NodeTaint",
    "NodeValue",
    "NodeView",
    "PAUSED_VALUE",
    "RELAYOUT_MESSAGE_ANNOTATION",
    "RELAYOUT_MESSAGE_MAX",
    "RELAYOUT_TAINT_EFFECT",
    "RELAYOUT_TAINT_KEY",
    "RELAYOUT_TAINT_VALUE",
    "RelayoutCardState",
    "RelayoutState",
    "RelayoutStatus",
]
