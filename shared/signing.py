"""Ed25519 signatures of bcd: node reports and control-plane NodeSpecs.

Each signature covers `purpose + b"\\0" + payload`, so a signature made for one
purpose can never be replayed as another. `verify_report` is what a control
plane runs on every AttestedReport; `verify_node_spec` is what the bridge and
the converger run on every SignedNodeSpec. The node's private key never leaves the signer; this
module only holds the arithmetic.

Ed25519 is PyNaCl's (libsodium; already here for nats-py's nkeys): a process
that signs or verifies maps ~1 MiB for it, where `cryptography` mapped ~7.5
MiB in each of the four processes that sign or verify (issue 13). Key files
stay the standard encodings - PEM SubjectPublicKeyInfo and PKCS#8 - read and
written by `shared.ed25519der` for this one algorithm.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from pathlib import Path

from nacl.exceptions import BadSignatureError, CryptoError
from nacl.signing import SigningKey, VerifyKey

from shared.ed25519der import DerError, public_key_from_pem

from shared.schemas import (
    NODE_SPEC_CODEC,
    NODE_SPEC_PURPOSE,
    REPORT_BODY_CODEC,
    REPORT_PURPOSE,
    AttestedReport,
    BadMessage,
    NodeSpec,
    ReportBody,
    SignedNodeSpec,
    encode,
)


class VerificationError(Exception):
    """A signature, purpose, key or body did not check out; the text says which."""


#: the key types of this module (PyNaCl's): a private key signs, a public key verifies.
Ed25519PrivateKey = SigningKey
Ed25519PublicKey = VerifyKey


def raw_public_key(key: VerifyKey | SigningKey) -> bytes:
    if isinstance(key, SigningKey):
        key = key.verify_key
    return bytes(key.encode())


def key_id(public_key: bytes | VerifyKey | SigningKey) -> str:
    """First 16 hex digits of sha256 of the raw 32-byte public key."""
    raw = public_key if isinstance(public_key, bytes) else raw_public_key(public_key)
    return hashlib.sha256(raw).hexdigest()[:16]


def signed_message(purpose: str, payload: bytes) -> bytes:
    return purpose.encode() + b"\0" + payload


def sign(private_key: SigningKey, purpose: str, payload: bytes) -> bytes:
    """The 64-byte signature over `purpose + NUL + payload`."""
    return bytes(private_key.sign(signed_message(purpose, payload)).signature)


def _verifies(key: VerifyKey, signature: bytes, message: bytes) -> bool:
    if len(signature) != 64:
        return False
    try:
        key.verify(message, signature)
    except (BadSignatureError, CryptoError, ValueError):
        return False
    return True


def _public(key: bytes | VerifyKey) -> VerifyKey:
    if isinstance(key, VerifyKey):
        return key
    if len(key) != 32:
        raise VerificationError(f"public key: expected 32 raw bytes, got {len(key)}")
    return VerifyKey(key)


def load_public_key(data: bytes) -> VerifyKey:
    """A control-plane key file: PEM SubjectPublicKeyInfo, or 32 raw bytes in base64."""
    text = data.strip()
    if text.startswith(b"-----BEGIN"):
        try:
            return VerifyKey(public_key_from_pem(text))
        except DerError as exc:
            raise ValueError(f"public key: {exc}") from None
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"public key: neither PEM nor base64 ({exc})") from None
    if len(raw) != 32:
        raise ValueError(f"public key: base64 holds {len(raw)} bytes, Ed25519 needs 32")
    return VerifyKey(raw)


def load_public_key_file(path: Path) -> VerifyKey:
    try:
        return load_public_key(path.read_bytes())
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def sign_report(private_key: SigningKey, body: ReportBody) -> AttestedReport:
    payload = encode(body)
    return AttestedReport(
        purpose="attested-report",
        key_id=key_id(private_key),
        body=payload,
        signature=sign(private_key, REPORT_PURPOSE, payload),
    )


def verify_report(report: AttestedReport, public_key: bytes | VerifyKey) -> ReportBody:
    """Check an AttestedReport against the node's public key; return its body.

    Raises VerificationError on a wrong purpose, another key, a bad signature
    or a body that does not decode.
    """
    pub = _public(public_key)
    if report.purpose != REPORT_PURPOSE:
        raise VerificationError(f"purpose {report.purpose!r} is not {REPORT_PURPOSE!r}")
    expected = key_id(pub)
    if report.key_id != expected:
        raise VerificationError(f"key_id {report.key_id} is not the node's key {expected}")
    if not _verifies(pub, report.signature, signed_message(REPORT_PURPOSE, report.body)):
        raise VerificationError("signature does not verify over the report body")
    try:
        return REPORT_BODY_CODEC.decode(report.body)
    except BadMessage as exc:
        raise VerificationError(f"body: {exc}") from None


def sign_node_spec(private_key: SigningKey, spec: NodeSpec | bytes) -> SignedNodeSpec:
    """Sign a NodeSpec, or the exact NodeSpec JSON bytes (fields a newer node knows kept as given)."""
    payload = spec if isinstance(spec, bytes) else encode(spec)
    return SignedNodeSpec(
        spec=payload,
        key_id=key_id(private_key),
        signature=sign(private_key, NODE_SPEC_PURPOSE, payload),
    )


def unsigned_node_spec(spec: NodeSpec) -> SignedNodeSpec:
    return SignedNodeSpec(spec=encode(spec))


def verify_node_spec(signed: SignedNodeSpec, keys: list[VerifyKey], *, accept_unsigned: bool = False) -> NodeSpec:
    """Verify against any of the configured control-plane keys.

    With no key the spec is refused, unless `accept_unsigned` (the lab-only
    opt-out, shared/spectrust.py): then it is decoded unchecked. Fail closed:
    an empty key list never means "anything goes" by itself.
    """
    if not keys and not accept_unsigned:
        raise VerificationError("no control-plane key is configured to verify the node spec against")
    if keys:
        by_id = {key_id(k): k for k in keys}
        key = by_id.get(signed.key_id)
        if key is None:
            raise VerificationError(f"key_id {signed.key_id!r} is not a configured control-plane key")
        if not _verifies(key, signed.signature, signed_message(NODE_SPEC_PURPOSE, signed.spec)):
            raise VerificationError("signature does not verify over the node spec")
    try:
        return NODE_SPEC_CODEC.decode(signed.spec)
    except BadMessage as exc:
        raise VerificationError(f"spec: {exc}") from None


__all__ = [
    "VerificationError",
    "Ed25519PrivateKey",
    "Ed25519PublicKey",
    "sign",
    "raw_public_key",
    "key_id",
    "signed_message",
    "load_public_key",
    "load_public_key_file",
    "sign_report",
    "verify_report",
    "sign_node_spec",
    "unsigned_node_spec",
    "verify_node_spec",
]
