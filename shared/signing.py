"""Ed25519 signatures of bcd: node reports and control-plane NodeSpecs.

Each signature covers `purpose + b"\\0" + payload`, so a signature made for one
purpose can never be replayed as another. `verify_report` is what a control
plane runs on every AttestedReport; `verify_node_spec` is what the bridge runs
on every SignedNodeSpec. The node's private key never leaves the signer; this
module only holds the arithmetic.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

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


def raw_public_key(key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    if isinstance(key, Ed25519PrivateKey):
        key = key.public_key()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key: bytes | Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """First 16 hex digits of sha256 of the raw 32-byte public key."""
    raw = public_key if isinstance(public_key, bytes) else raw_public_key(public_key)
    return hashlib.sha256(raw).hexdigest()[:16]


def signed_message(purpose: str, payload: bytes) -> bytes:
    return purpose.encode() + b"\0" + payload


def _public(key: bytes | Ed25519PublicKey) -> Ed25519PublicKey:
    if isinstance(key, Ed25519PublicKey):
        return key
    if len(key) != 32:
        raise VerificationError(f"public key: expected 32 raw bytes, got {len(key)}")
    return Ed25519PublicKey.from_public_bytes(key)


def load_public_key(data: bytes) -> Ed25519PublicKey:
    """A control-plane key file: PEM SubjectPublicKeyInfo, or 32 raw bytes in base64."""
    text = data.strip()
    if text.startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(text)
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise ValueError(f"public key: not a PEM public key ({exc})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("public key: PEM key is not Ed25519")
        return key
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"public key: neither PEM nor base64 ({exc})") from None
    if len(raw) != 32:
        raise ValueError(f"public key: base64 holds {len(raw)} bytes, Ed25519 needs 32")
    return Ed25519PublicKey.from_public_bytes(raw)


def load_public_key_file(path: Path) -> Ed25519PublicKey:
    try:
        return load_public_key(path.read_bytes())
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def sign_report(private_key: Ed25519PrivateKey, body: ReportBody) -> AttestedReport:
    payload = encode(body)
    return AttestedReport(
        purpose="attested-report",
        key_id=key_id(private_key),
        body=payload,
        signature=private_key.sign(signed_message(REPORT_PURPOSE, payload)),
    )


def verify_report(report: AttestedReport, public_key: bytes | Ed25519PublicKey) -> ReportBody:
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
    try:
        pub.verify(report.signature, signed_message(REPORT_PURPOSE, report.body))
    except InvalidSignature:
        raise VerificationError("signature does not verify over the report body") from None
    try:
        return REPORT_BODY_CODEC.decode(report.body)
    except BadMessage as exc:
        raise VerificationError(f"body: {exc}") from None


def sign_node_spec(private_key: Ed25519PrivateKey, spec: NodeSpec | bytes) -> SignedNodeSpec:
    """Sign a NodeSpec, or the exact NodeSpec JSON bytes (fields a newer node knows kept as given)."""
    payload = spec if isinstance(spec, bytes) else encode(spec)
    return SignedNodeSpec(
        spec=payload,
        key_id=key_id(private_key),
        signature=private_key.sign(signed_message(NODE_SPEC_PURPOSE, payload)),
    )


def unsigned_node_spec(spec: NodeSpec) -> SignedNodeSpec:
    return SignedNodeSpec(spec=encode(spec))


def verify_node_spec(signed: SignedNodeSpec, keys: list[Ed25519PublicKey]) -> NodeSpec:
    """Verify against any of the configured control-plane keys (none: accept unsigned)."""
    if keys:
        by_id = {key_id(k): k for k in keys}
        key = by_id.get(signed.key_id)
        if key is None:
            raise VerificationError(f"key_id {signed.key_id!r} is not a configured control-plane key")
        try:
            key.verify(signed.signature, signed_message(NODE_SPEC_PURPOSE, signed.spec))
        except InvalidSignature:
            raise VerificationError("signature does not verify over the node spec") from None
    try:
        return NODE_SPEC_CODEC.decode(signed.spec)
    except BadMessage as exc:
        raise VerificationError(f"spec: {exc}") from None


__all__ = [
    "VerificationError",
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
