"""Request and reply bodies of node-bus endpoints (never seen upstream)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .common import EventId, Id, KeyId, Name
from .events import AttestedEvent


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


__all__ = ["SignRequest", "SignerKey", "Empty"]
