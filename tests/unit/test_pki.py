"""shared/pki.py: the fleet's CA and its leaf certificates, as files (no network)."""

from __future__ import annotations

import ipaddress
import ssl
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared import pki


def mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


@pytest.fixture
def ca(tmp_path: Path) -> pki.Issued:
    return pki.make_ca(tmp_path / "pki" / "ca.crt", tmp_path / "pki" / "ca.key")


def test_keys_are_0600_and_certificates_0644(tmp_path: Path, ca: pki.Issued) -> None:
    leaf = pki.issue(ca, tmp_path / "pki" / "up.crt", tmp_path / "pki" / "up.key", common_name="up", names=["localhost"], server=True)
    assert mode(ca.key) == 0o600 and mode(leaf.key) == 0o600
    assert mode(ca.cert) == 0o644 and mode(leaf.cert) == 0o644
    assert leaf.key.read_text().startswith("-----BEGIN PRIVATE KEY-----")


def test_the_ca_signs_leaves_only_and_a_leaf_chains_to_it(tmp_path: Path, ca: pki.Issued) -> None:
    root = pki.load_certificate(ca.cert)
    bc = root.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca and bc.path_length == 0
    leaf = pki.issue(ca, tmp_path / "n.crt", tmp_path / "n.key", common_name="node-a", client=True)
    cert = pki.load_certificate(leaf.cert)
    cert.verify_directly_issued_by(root)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-a"
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    # a client certificate needs no names; OpenSSL loads the pair
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(str(leaf.cert), str(leaf.key))


def test_server_sans_are_dns_names_and_ip_addresses(tmp_path: Path, ca: pki.Issued) -> None:
    leaf = pki.issue(
        ca, tmp_path / "s.crt", tmp_path / "s.key", common_name="cp.example.net",
        names=["cp.example.net", "127.0.0.1", "::1", "localhost"], server=True, client=True,
    )
    cert = pki.load_certificate(leaf.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["cp.example.net", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    eku = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert eku == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # a route is both


def test_what_cannot_be_issued(tmp_path: Path, ca: pki.Issued) -> None:
    with pytest.raises(ValueError, match="server, a client or both"):
        pki.issue(ca, tmp_path / "x.crt", tmp_path / "x.key", common_name="x")
    with pytest.raises(ValueError, match="at least one name"):
        pki.issue(ca, tmp_path / "x.crt", tmp_path / "x.key", common_name="x", server=True)
    now = datetime.now(timezone.utc)
    with pytest.raises(ValueError, match="before it starts"):
        pki.issue(ca, tmp_path / "x.crt", tmp_path / "x.key", common_name="x", client=True, not_before=now, not_after=now - timedelta(days=1))
    assert not (tmp_path / "x.crt").exists() and not (tmp_path / "x.key").exists()


def test_certificate_problem_says_one_line_for_each_reason(tmp_path: Path, ca: pki.Issued) -> None:
    now = datetime.now(timezone.utc)
    good = pki.issue(ca, tmp_path / "good.crt", tmp_path / "good.key", common_name="good", client=True)
    old = pki.issue(
        ca, tmp_path / "old.crt", tmp_path / "old.key", common_name="old", client=True,
        not_before=now - timedelta(days=30), not_after=now - timedelta(days=1),
    )
    future = pki.issue(ca, tmp_path / "new.crt", tmp_path / "new.key", common_name="new", client=True, not_before=now + timedelta(days=2))
    assert pki.certificate_problem(good.cert, "the cert") is None
    expired = pki.certificate_problem(old.cert, "this node's client certificate")
    assert expired is not None and "\n" not in expired
    assert expired.startswith(f"this node's client certificate {old.cert} expired at ") and "CN=old" in expired
    early = pki.certificate_problem(future.cert, "the cert")
    assert early is not None and "\n" not in early and f"{future.cert} is not valid before " in early
    assert pki.certificate_problem(tmp_path / "none.crt", "the CA bundle") == f"the CA bundle {tmp_path / 'none.crt'} does not exist"
    (tmp_path / "junk.crt").write_text("not a certificate\n")
    junk = pki.certificate_problem(tmp_path / "junk.crt", "the CA bundle")
    assert junk is not None and "cannot be read" in junk and "no PEM certificate" in junk
    # the same certificate judged at another time
    assert pki.certificate_problem(good.cert, "c", now=now + timedelta(days=pki.LEAF_DAYS + 1)) is not None
    assert pki.certificate_problem(future.cert, "c", now=now + timedelta(days=3)) is None


def test_a_bundle_with_one_expired_and_one_good_ca_is_fine(tmp_path: Path, ca: pki.Issued) -> None:
    now = datetime.now(timezone.utc)
    old = pki.make_ca(tmp_path / "old-ca.crt", tmp_path / "old-ca.key", name="old CA", not_before=now - timedelta(days=400), not_after=now - timedelta(days=5))
    bundle = tmp_path / "bundle.crt"
    bundle.write_bytes(old.cert.read_bytes() + ca.cert.read_bytes())
    assert len(pki.load_certificates(bundle)) == 2
    assert pki.certificate_problem(bundle, "the CA bundle") is None
    # and it loads as OpenSSL's trust store
    ssl.create_default_context(cafile=str(bundle))
    # only expired ones: the line names the (last) expired one
    only_old = tmp_path / "only-old.crt"
    only_old.write_bytes(old.cert.read_bytes())
    line = pki.certificate_problem(only_old, "the CA bundle")
    assert line is not None and "expired at" in line and "old CA" in line


def test_expires(tmp_path: Path, ca: pki.Issued) -> None:
    end = datetime(2031, 1, 2, 3, 4, tzinfo=timezone.utc)
    leaf = pki.issue(ca, tmp_path / "l.crt", tmp_path / "l.key", common_name="l", client=True, not_after=end)
    assert pki.expires(leaf.cert) == end
    assert pki.expires(tmp_path / "missing.crt") is None


def test_reissue_replaces_key_and_certificate_in_place(tmp_path: Path, ca: pki.Issued) -> None:
    a = pki.issue(ca, tmp_path / "l.crt", tmp_path / "l.key", common_name="l", client=True)
    first = a.cert.read_bytes(), a.key.read_bytes()
    b = pki.issue(ca, tmp_path / "l.crt", tmp_path / "l.key", common_name="l", client=True)
    assert (b.cert.read_bytes(), b.key.read_bytes()) != first
    assert mode(b.key) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["l.crt", "l.key"]  # no temp file left
    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(str(b.cert), str(b.key))
