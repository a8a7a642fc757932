"""Deterministic event ids, so a replayed event keeps its id and upstream dedupes it.

An id names the node, the allocation, what happened and the generation it
happened at: the same bind or release, retried after a crash, gets the same
id; a later generation's failure report gets a new one. Ids are readable on
purpose - they appear in logs, the outbox and the control plane's event log.
"""

from __future__ import annotations

import hashlib

from datetime import datetime, timezone

from shared.schemas import Condition


def _id(*parts: str) -> str:
    return ".".join(parts)


def bound_id(node_id: str, allocation_id: str, generation: int) -> str:
    return _id(node_id, allocation_id, "bound", f"g{generation}")


def released_id(node_id: str, allocation_id: str, generation: int) -> str:
    return _id(node_id, allocation_id, "released", f"g{generation}")


def failed_id(node_id: str, allocation_id: str, generation: int) -> str:
    return _id(node_id, allocation_id, "failed", f"g{generation}")


def hold_condition_id(node_id: str, allocation_id: str, generation: int, condition: Condition) -> str:
    """A hold's condition change (HoldCondition): like condition_id, under the allocation and its generation."""
    stamp = condition.since.strftime("%Y%m%dt%H%M%S%f")
    digest = hashlib.sha256(f"{condition.reason}\0{condition.message}".encode()).hexdigest()[:12]
    # the type is always DevicesHealthy: left out, so the longest node and allocation ids still fit 200 characters
    return _id(node_id, allocation_id, "hold", f"g{generation}", condition.status.lower(), stamp, digest)


def section_id(node_id: str, section: str, generation: int, state: str, message: str) -> str:
    digest = hashlib.sha256(message.encode()).hexdigest()[:12]
    return _id(node_id, section, "section", f"g{generation}", state.lower(), digest)


def condition_id(node_id: str, condition: Condition) -> str:
    """A condition change: its type, status, the instant it took that status, and what it says.

    A condition keeps its `since` while its status holds, so a new reason or
    message under the same status (another release stuck, other unknown
    fields) needs the digest to be a new event; the same condition, replayed,
    keeps its id.
    """
    stamp = condition.since.strftime("%Y%m%dt%H%M%S%f")
    digest = hashlib.sha256(f"{condition.reason}\0{condition.message}".encode()).hexdigest()[:12]
    return _id(node_id, "condition", condition.type.lower(), condition.status.lower(), stamp, digest)


def gpu_id(node_id: str, pci_address: str, at: datetime, change: str) -> str:
    """A PhysicalGPU change of one card (a `gpu` event): the card, the instant, and what changed.

    `change` names the change (the new phase, managementState and condition
    reasons, or the switch event behind it); only its digest goes into the
    id, so two different changes of one card at one instant get two ids and
    the same change, journaled and replayed, keeps its id. The PCI address
    is lowercase hex with `:` and `.`, all allowed in an event id.
    """
    digest = hashlib.sha256(change.encode()).hexdigest()[:12]
    if at.tzinfo is not None:
        at = at.astimezone(timezone.utc)
    stamp = at.strftime("%Y%m%dt%H%M%S%f")
    return _id(node_id, "gpu", pci_address, stamp, digest)


__all__ = ["bound_id", "released_id", "failed_id", "section_id", "condition_id", "hold_condition_id", "gpu_id"]
