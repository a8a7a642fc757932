"""The node key on disk: the signer's use of shared/keyfile.py (created once, 0600, refused if others can read it)."""

from __future__ import annotations

from pathlib import Path

from shared.keyfile import Ed25519PrivateKey, KeyFileError
from shared.keyfile import load_or_create_key as _load_or_create


def load_or_create_key(path: Path) -> tuple[Ed25519PrivateKey, bool]:
    """Return (key, created)."""
    return _load_or_create(path, owner="this signer")


__all__ = ["KeyFileError", "load_or_create_key"]
