"""The control plane's signing key: `<state_dir>/cp.key` and the `cp.pub` nodes are given.

This module owns the Ed25519 key every NodeSpec is signed with. It is made once,
is PKCS#8 PEM with mode 0600, and is refused when group or others can read it
(it may have leaked). Beside it is the public half that nodes get as `--cp-key`.
It is a module of its own because setting up a node (`bcd up`, `bcd compose init`,
`bcd fleet`) makes the key without running a control plane.
"""

from __future__ import annotations

from pathlib import Path

from shared.ed25519der import public_key_pem as spki_pem
from shared.fsutil import atomic_write
from shared.keyfile import KeyFileError as SharedKeyFileError
from shared.keyfile import load_or_create_key
from shared.signing import Ed25519PrivateKey, raw_public_key

KEY_FILE = "cp.key"
PUB_FILE = "cp.pub"


class KeyFileError(Exception):
    """The control-plane key file is unsafe or unreadable; the text says what to do."""

    #: a situation an operator can be in (bcd.exits prints it as one line, not an internal error)
    operator_error = True


def public_key_pem(key: Ed25519PrivateKey) -> bytes:
    return spki_pem(raw_public_key(key))


def load_or_create_cp_key(state_dir: Path) -> tuple[Ed25519PrivateKey, Path]:
    """`<state_dir>/cp.key` (PKCS#8 PEM, 0600, created once) and `<state_dir>/cp.pub`.

    cp.pub is the PEM SubjectPublicKeyInfo nodes get as `--cp-key`; it is
    rewritten whenever it does not match the private key. A key file that
    group or others can read is refused: it may already have leaked.
    (Same rules as the node key, services/signer/keys.py.)
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = _load_or_create_private(state_dir / KEY_FILE)
    pub_path = state_dir / PUB_FILE
    pem = public_key_pem(key)
    try:
        current = pub_path.read_bytes()
    except FileNotFoundError:
        current = b""
    if current != pem:
        atomic_write(pub_path, pem, 0o644)
    return key, pub_path


def _load_or_create_private(path: Path) -> Ed25519PrivateKey:
    try:
        key, _ = load_or_create_key(path, owner="this control plane")
    except SharedKeyFileError as exc:
        raise KeyFileError(str(exc)) from None
    return key


__all__ = ["KEY_FILE", "PUB_FILE", "KeyFileError", "public_key_pem", "load_or_create_cp_key"]
