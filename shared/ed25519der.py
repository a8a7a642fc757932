"""Ed25519 keys in their standard files: PEM SubjectPublicKeyInfo and PKCS#8 (RFC 8410).

bcd signs with PyNaCl (raw 32-byte keys); operators and other tools keep
keys as PEM. This reads and writes exactly those two encodings for this one
algorithm (OID 1.3.101.112) and refuses anything else with a reason: another
algorithm, an encrypted or malformed key, trailing bytes.
"""

from __future__ import annotations

import base64
import binascii
import re

#: id-Ed25519 (1.3.101.112), DER-encoded.
ED25519_OID = bytes([0x06, 0x03, 0x2B, 0x65, 0x70])
_NAMES = {
    "1.3.101.110": "X25519",
    "1.3.101.111": "X448",
    "1.3.101.113": "Ed448",
    "1.2.840.10045.2.1": "EC",
    "1.2.840.113549.1.1.1": "RSA",
}
_PEM_RE = re.compile(rb"\A-----BEGIN ([A-Z0-9 ]{1,40})-----\r?\n(?P<body>[A-Za-z0-9+/=\r\n]*?)\r?\n?-----END \1-----\s*\Z")


class DerError(ValueError):
    """Not the key file asked for; the text says what is wrong."""


def _tlv(der: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(tag, start of value, end of value) of the DER element at `pos`."""
    if pos + 2 > end:
        raise DerError("truncated")
    tag, length = der[pos], der[pos + 1]
    pos += 2
    if length & 0x80:
        n = length & 0x7F
        if n == 0 or n > 2 or pos + n > end:
            raise DerError("bad length")
        length = int.from_bytes(der[pos : pos + n], "big")
        pos += n
    if pos + length > end:
        raise DerError("truncated")
    return tag, pos, pos + length


def _oid_text(value: bytes) -> str:
    if not value:
        return "?"
    parts = [value[0] // 40, value[0] % 40]
    n = 0
    for b in value[1:]:
        n = (n << 7) | (b & 0x7F)
        if not b & 0x80:
            parts.append(n)
            n = 0
    return ".".join(map(str, parts))


def _algorithm(der: bytes, pos: int, end: int) -> int:
    """Check the AlgorithmIdentifier at `pos` is Ed25519 (no parameters); the position after it."""
    tag, start, stop = _tlv(der, pos, end)
    if tag != 0x30:
        raise DerError("no algorithm identifier")
    tag, ostart, ostop = _tlv(der, start, stop)
    if tag != 0x06:
        raise DerError("no algorithm identifier")
    if der[ostart - 2 : ostop] != ED25519_OID or ostop != stop:
        oid = _oid_text(der[ostart:ostop])
        raise DerError(f"key is not Ed25519 (algorithm {_NAMES.get(oid, oid)})")
    return stop


def _pem(text: bytes, label: str) -> bytes:
    m = _PEM_RE.match(text.strip() + b"\n")
    if m is None:
        raise DerError(f"not a PEM {label.lower()}")
    if m.group(1).decode() != label:
        raise DerError(f"not a PEM {label.lower()} (it is a {m.group(1).decode().lower()})")
    try:
        return base64.b64decode(re.sub(rb"\s+", b"", m["body"]), validate=True)
    except binascii.Error as exc:
        raise DerError(f"not a PEM {label.lower()} ({exc})") from None


def public_key_from_der(der: bytes) -> bytes:
    """The raw 32-byte key of an Ed25519 SubjectPublicKeyInfo."""
    tag, start, end = _tlv(der, 0, len(der))
    if tag != 0x30 or end != len(der):
        raise DerError("not a SubjectPublicKeyInfo")
    pos = _algorithm(der, start, end)
    tag, bstart, bend = _tlv(der, pos, end)
    if tag != 0x03 or bend != end or bend - bstart != 33 or der[bstart] != 0:
        raise DerError("not a 32-byte Ed25519 public key")
    return der[bstart + 1 : bend]


def public_key_from_pem(text: bytes) -> bytes:
    """`-----BEGIN PUBLIC KEY-----` (SubjectPublicKeyInfo) -> the raw 32-byte key."""
    try:
        der = _pem(text, "PUBLIC KEY")
        return public_key_from_der(der)
    except DerError as exc:
        message = str(exc)
        if message.startswith("key is not Ed25519"):
            raise DerError(f"PEM {message}") from None
        raise DerError(message if message.startswith("not a PEM") else f"not a PEM public key ({message})") from None


def private_key_from_pem(text: bytes) -> bytes:
    """`-----BEGIN PRIVATE KEY-----` (unencrypted PKCS#8, RFC 8410) -> the 32-byte seed."""
    try:
        der = _pem(text, "PRIVATE KEY")
        tag, start, end = _tlv(der, 0, len(der))
        if tag != 0x30 or end != len(der):
            raise DerError("not a PKCS#8 key")
        tag, vstart, vend = _tlv(der, start, end)
        if tag != 0x02 or der[vstart:vend] not in (b"\x00", b"\x01"):
            raise DerError("not a PKCS#8 key (version)")
        pos = _algorithm(der, vend, end)
        tag, ostart, oend = _tlv(der, pos, end)
        if tag != 0x04:
            raise DerError("no private key")
        tag, sstart, send = _tlv(der, ostart, oend)
        if tag != 0x04 or send != oend or send - sstart != 32:
            raise DerError("not a 32-byte Ed25519 private key")
        # what may follow (attributes [0], public key [1]) is optional and not needed
        return der[sstart:send]
    except DerError as exc:
        message = str(exc)
        raise DerError(message if message.startswith(("not a PEM", "key is not")) else f"not a PEM private key ({message})") from None


def _armor(label: str, der: bytes) -> bytes:
    b64 = base64.b64encode(der).decode()
    lines = [b64[i : i + 64] for i in range(0, len(b64), 64)]
    return ("\n".join([f"-----BEGIN {label}-----", *lines, f"-----END {label}-----"]) + "\n").encode()


def private_key_pem(seed: bytes) -> bytes:
    """The PKCS#8 PEM of an Ed25519 seed (what `openssl genpkey -algorithm ed25519` writes)."""
    if len(seed) != 32:
        raise ValueError("an Ed25519 seed is 32 bytes")
    return _armor("PRIVATE KEY", bytes.fromhex("302e020100300506032b657004220420") + seed)


def public_key_pem(raw: bytes) -> bytes:
    """The SubjectPublicKeyInfo PEM of a raw Ed25519 public key."""
    if len(raw) != 32:
        raise ValueError("an Ed25519 public key is 32 bytes")
    return _armor("PUBLIC KEY", bytes.fromhex("302a300506032b6570032100") + raw)


__all__ = [
    "DerError",
    "ED25519_OID",
    "public_key_from_der",
    "public_key_from_pem",
    "private_key_from_pem",
    "private_key_pem",
    "public_key_pem",
]
