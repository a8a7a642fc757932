"""A fleet's private certificates: its CA, the upstream servers' and each node's client certificate.

`bcd fleet init` makes a CA and the upstream's server certificate, `bcd fleet
add-node` a client certificate per node (mutual TLS), and the tests make the
broken ones a fleet must refuse (expired, not yet valid, another CA, another
name). Keys are EC P-256 (what nats-server's Go TLS and OpenSSL both take
without tuning, and cheap to handshake with a thousand nodes) and are written
0600 and atomically; certificates 0644. Nothing here talks to the network: it
is the `cryptography` package and files.

`certificate_problem` says, in one line, why a certificate on disk cannot be
used now (missing, unreadable, expired, not yet valid): the bridge and
`bcd doctor` say that line before any handshake fails on it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .fsutil import atomic_write

#: a CA outlives the certificates it signs; a leaf is renewed well before (rotation: docs/install.md)
CA_DAYS = 3650
LEAF_DAYS = 397
#: a certificate is valid from a little before it was made: clocks of a fleet differ
CLOCK_SKEW = timedelta(minutes=5)
#: the largest PEM file read (a CA bundle of many CAs is still far below this)
MAX_PEM_BYTES = 1 << 20


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key on disk."""

    cert: Path
    key: Path


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    atomic_write(path, pem, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    atomic_write(path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _window(not_before: datetime | None, not_after: datetime | None, days: int) -> tuple[datetime, datetime]:
    start = not_before if not_before is not None else _now() - CLOCK_SKEW
    end = not_after if not_after is not None else start + timedelta(days=days)
    if end <= start:
        raise ValueError(f"certificate would end ({end:%Y-%m-%d %H:%M}) before it starts ({start:%Y-%m-%d %H:%M})")
    return start, end


def make_ca(
    cert: Path, key: Path, *, name: str = "bcd fleet CA", days: int = CA_DAYS, not_before: datetime | None = None, not_after: datetime | None = None
) -> Issued:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    private = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name), x509.NameAttribute(NameOID.ORGANIZATION_NAME, "bcd")])
    start, end = _window(not_before, not_after, days)
    ski = x509.SubjectKeyIdentifier.from_public_key(private.public_key())
    built = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(private, hashes.SHA256())
    )
    _write_key(key, private)
    _write_cert(cert, built)
    return Issued(cert, key)


def _sans(names: Iterable[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for n in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def issue(
    ca: Issued,
    cert: Path,
    key: Path,
    *,
    common_name: str,
    names: Sequence[str] = (),
    server: bool = False,
    client: bool = False,
    days: int = LEAF_DAYS,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
) -> Issued:
    """A leaf certificate signed by `ca`: `names` (DNS names and IP addresses) as its SANs,
    usable by a server, a client or both (a nats-server route is both)."""
    if not (server or client):
        raise ValueError("a certificate is for a server, a client or both")
    if server and not names:
        raise ValueError("a server certificate needs at least one name (DNS name or IP address)")
    ca_cert = load_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca.key}: not an EC private key")
    private = ec.generate_private_key(ec.SECP256R1())
    start, end = _window(not_before, not_after, days)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name), x509.NameAttribute(NameOID.ORGANIZATION_NAME, "bcd")]))
        .issuer_name(ca_cert.subject)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(private.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(_sans(names)), critical=False)
    built = builder.sign(ca_key, hashes.SHA256())
    _write_key(key, private)
    _write_cert(cert, built)
    return Issued(cert, key)


def load_certificates(path: Path) -> list[x509.Certificate]:
    """Every certificate of a PEM file (a CA bundle holds several); ValueError names the file."""
    data = Path(path).read_bytes()
    if len(data) > MAX_PEM_BYTES:
        raise ValueError(f"{path}: {len(data)} bytes, more than a PEM bundle should be ({MAX_PEM_BYTES})")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ValueError(f"{path}: no PEM certificate in it") from None
    return certs


def load_certificate(path: Path) -> x509.Certificate:
    return load_certificates(path)[0]


def _when(t: datetime) -> str:
    return t.strftime("%Y-%m-%d %H:%M UTC")


def certificate_problem(path: Path, what: str, *, now: datetime | None = None) -> str | None:
    """None when every certificate in `path` can be used now, else one line saying why not
    (`what` names the file's role: "the CA bundle", "this node's client certificate")."""
    t = now or _now()
    try:
        certs = load_certificates(path)
    except FileNotFoundError:
        return f"{what} {path} does not exist"
    except (OSError, ValueError) as exc:
        return f"{what} {path} cannot be read: {exc}"
    usable = []
    for c in certs:
        if c.not_valid_after_utc < t:
            why = f"{what} {path} expired at {_when(c.not_valid_after_utc)} ({c.subject.rfc4514_string()})"
        elif c.not_valid_before_utc > t:
            why = f"{what} {path} is not valid before {_when(c.not_valid_before_utc)} ({c.subject.rfc4514_string()})"
        else:
            usable.append(c)
            continue
        last = why
    # a bundle with one good CA in it still works: the expired one is only said when none is left
    return None if usable else last


def expires(path: Path) -> datetime | None:
    """When the first certificate of `path` expires (None: unreadable)."""
    try:
        return load_certificate(path).not_valid_after_utc
    except (OSError, ValueError):
        return None


__all__ = ["Issued", "make_ca", "issue", "load_certificate", "load_certificates", "certificate_problem", "expires", "CA_DAYS", "LEAF_DAYS"]
