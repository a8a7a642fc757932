"""Ed25519 signing of attested reports and node specs (DESIGN 3).

Round trips, every way verification must fail, cross-purpose replay, key file
formats, and interoperability with `cryptography` (OpenSSL): bcd signs with
PyNaCl (libsodium), and a control plane that checks our signatures with an
Ed25519 library we did not wrap must agree; the PEM files below are written
by it too.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey as OpenSslPrivateKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey as OpenSslPublicKey

from shared.schemas import (
    ATTESTED_REPORT_CODEC,
    SIGNED_NODE_SPEC_CODEC,
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    AttestedReport,
    BadMessage,
    DeviceAssignment,
    NodeSpec,
    ReportBody,
    SignedNodeSpec,
    encode,
)
from shared.schemas.common import ID_RE
from shared.signing import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
    VerificationError,
    key_id,
    load_public_key,
    load_public_key_file,
    raw_public_key,
    sign_node_spec,
    sign_report,
    signed_message,
    unsigned_node_spec,
    verify_node_spec,
    verify_report,
)

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
UUID = "GPU-5f3c2b1a-0000-4000-8000-0123456789ab"
SEED = bytes(range(32))

NODE_KEY = Ed25519PrivateKey(SEED)
OTHER_KEY = Ed25519PrivateKey(bytes(range(1, 33)))
NODE_RAW = raw_public_key(NODE_KEY)

BODY = ReportBody(
    node_id="node-1",
    boot_id="boot-1",
    event_id="ev:1",
    time=T0,
    event=AllocationBound(allocation_id="a1", reservation_id="r1", generation=1, devices=[UUID]),
)
SPEC = NodeSpec(
    node_id="node-1",
    generation=3,
    devices=[DeviceAssignment(allocation_id="a1", reservation_id="r1", binding="BINDING_HOLD", devices=[UUID])],
)


def raw_sign(key: Ed25519PrivateKey, message: bytes) -> bytes:
    return bytes(key.sign(message).signature)


def flip(data: bytes, index: int, bit: int = 0x01) -> bytes:
    b = bytearray(data)
    b[index] ^= bit
    return bytes(b)


# --- attested reports -------------------------------------------------------------


def test_report_round_trip() -> None:
    report = sign_report(NODE_KEY, BODY)
    assert report.purpose == "attested-report"
    assert report.key_id == key_id(NODE_KEY)
    assert report.body == encode(BODY)
    assert len(report.signature) == 64
    assert verify_report(report, NODE_RAW) == BODY
    assert verify_report(report, NODE_KEY.verify_key) == BODY


def test_report_round_trip_over_the_wire() -> None:
    wire = encode(sign_report(NODE_KEY, BODY))
    doc = json.loads(wire)
    assert doc["purpose"] == "attested-report"
    assert base64.b64decode(doc["body"]) == encode(BODY)
    assert verify_report(ATTESTED_REPORT_CODEC.decode(wire), NODE_RAW) == BODY


def test_signing_is_deterministic() -> None:
    assert sign_report(NODE_KEY, BODY) == sign_report(NODE_KEY, BODY)


def _signed_by(key: Ed25519PrivateKey, purpose: str, body: bytes, kid: str | None = None) -> AttestedReport:
    return AttestedReport(key_id=kid or key_id(key), body=body, signature=raw_sign(key, signed_message(purpose, body)))


REPORT = sign_report(NODE_KEY, BODY)
_N = len(REPORT.body)

BAD_REPORTS: list[tuple[str, Callable[[], AttestedReport], bytes | None, str]] = [
    ("wrong-purpose", lambda: msgspec.structs.replace(REPORT, purpose="node-spec"), None, "purpose 'node-spec'"),
    (
        "body-first-byte",
        lambda: msgspec.structs.replace(REPORT, body=flip(REPORT.body, 0)),
        None,
        "signature does not verify",
    ),
    (
        "body-middle-byte",
        lambda: msgspec.structs.replace(REPORT, body=flip(REPORT.body, _N // 2)),
        None,
        "signature does not verify",
    ),
    (
        "body-last-byte",
        lambda: msgspec.structs.replace(REPORT, body=flip(REPORT.body, _N - 1, 0x80)),
        None,
        "signature does not verify",
    ),
    (
        "body-extended",
        lambda: msgspec.structs.replace(REPORT, body=REPORT.body + b" "),
        None,
        "signature does not verify",
    ),
    ("body-empty", lambda: msgspec.structs.replace(REPORT, body=b""), None, "signature does not verify"),
    (
        "signature-first-byte",
        lambda: msgspec.structs.replace(REPORT, signature=flip(REPORT.signature, 0)),
        None,
        "signature does not verify",
    ),
    (
        "signature-last-bit",
        lambda: msgspec.structs.replace(REPORT, signature=flip(REPORT.signature, 63, 0x40)),
        None,
        "signature does not verify",
    ),
    (
        "signature-truncated",
        lambda: msgspec.structs.replace(REPORT, signature=REPORT.signature[:63]),
        None,
        "signature does not verify",
    ),
    ("signature-empty", lambda: msgspec.structs.replace(REPORT, signature=b""), None, "signature does not verify"),
    ("another-key", lambda: REPORT, raw_public_key(OTHER_KEY), "is not the node's key"),
    (
        "key-id-mismatch",
        lambda: msgspec.structs.replace(REPORT, key_id=key_id(OTHER_KEY)),
        None,
        "is not the node's key",
    ),
    (
        "signed-by-another-key-claiming-ours",
        lambda: _signed_by(OTHER_KEY, "attested-report", REPORT.body, kid=key_id(NODE_KEY)),
        None,
        "signature does not verify",
    ),
    ("body-not-json", lambda: _signed_by(NODE_KEY, "attested-report", b"hello"), None, "body: message: not valid JSON"),
    ("body-other-type", lambda: _signed_by(NODE_KEY, "attested-report", encode(SPEC)), None, "body: "),
    (
        "body-unattested-event",
        lambda: _signed_by(
            NODE_KEY,
            "attested-report",
            json.dumps(
                {
                    **json.loads(encode(BODY)),
                    "event": json.loads(
                        encode(AllocationFailed(allocation_id="a", reservation_id="r", generation=1, reason="overlap"))
                    ),
                }
            ).encode(),
        ),
        None,
        "body: ",
    ),
    ("public-key-short", lambda: REPORT, NODE_RAW[:31], "public key: expected 32 raw bytes, got 31"),
    ("cross-purpose-replay", lambda: _signed_by(NODE_KEY, "node-spec", REPORT.body), None, "signature does not verify"),
    (
        "no-purpose-prefix",
        lambda: msgspec.structs.replace(REPORT, signature=raw_sign(NODE_KEY, REPORT.body)),
        None,
        "signature does not verify",
    ),
]


@pytest.mark.parametrize(("make", "pub", "text"), [r[1:] for r in BAD_REPORTS], ids=[r[0] for r in BAD_REPORTS])
def test_report_verification_fails(make: Callable[[], AttestedReport], pub: bytes | None, text: str) -> None:
    with pytest.raises(VerificationError) as exc:
        verify_report(make(), NODE_RAW if pub is None else pub)
    assert text in str(exc.value)


def test_body_tamper_is_caught_at_every_byte() -> None:
    for i in range(len(REPORT.body)):
        with pytest.raises(VerificationError, match="signature does not verify"):
            verify_report(msgspec.structs.replace(REPORT, body=flip(REPORT.body, i)), NODE_RAW)


@pytest.mark.parametrize("purpose", ["node-spec", "", "attested-report\x00", "Attested-Report"])
def test_decode_refuses_a_report_of_another_purpose(purpose: str) -> None:
    doc = json.loads(encode(REPORT))
    doc["purpose"] = purpose
    with pytest.raises(BadMessage, match=r"`\$\.purpose`"):
        ATTESTED_REPORT_CODEC.decode(json.dumps(doc))


def test_report_without_purpose_decodes_as_attested() -> None:
    doc = json.loads(encode(REPORT))
    del doc["purpose"]
    assert verify_report(ATTESTED_REPORT_CODEC.decode(json.dumps(doc)), NODE_RAW) == BODY


def test_released_event_signs_too() -> None:
    body = msgspec.structs.replace(
        BODY, event=AllocationReleased(allocation_id="a1", reservation_id="r1", generation=2, devices=[UUID])
    )
    assert verify_report(sign_report(NODE_KEY, body), NODE_RAW) == body


# --- an independent Ed25519: cryptography (OpenSSL) ---------------------------------

OPENSSL_PUB = OpenSslPublicKey.from_public_bytes(NODE_RAW)


def test_our_signature_verifies_with_openssl() -> None:
    report = sign_report(NODE_KEY, BODY)
    OPENSSL_PUB.verify(report.signature, b"attested-report\0" + report.body)
    for message in (b"attested-report\0" + flip(report.body, 0), b"node-spec\0" + report.body, report.body):
        with pytest.raises(InvalidSignature):
            OPENSSL_PUB.verify(report.signature, message)


def test_openssl_signature_verifies_with_ours() -> None:
    sk = OpenSslPrivateKey.generate()
    raw = sk.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    body = encode(BODY)
    report = AttestedReport(key_id=hashlib.sha256(raw).hexdigest()[:16], body=body, signature=sk.sign(b"attested-report\0" + body))
    assert verify_report(ATTESTED_REPORT_CODEC.decode(encode(report)), raw) == BODY
    forged = msgspec.structs.replace(report, signature=sk.sign(b"node-spec\0" + body))
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_report(forged, raw)


def test_same_seed_same_key_and_signature_in_both_libraries() -> None:
    sk = OpenSslPrivateKey.from_private_bytes(SEED)
    assert sk.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) == NODE_RAW
    message = signed_message("attested-report", encode(BODY))
    assert sk.sign(message) == raw_sign(NODE_KEY, message) == sign_report(NODE_KEY, BODY).signature


# --- key ids ------------------------------------------------------------------------


@pytest.mark.parametrize("key", [NODE_KEY, NODE_KEY.verify_key, NODE_RAW], ids=["private", "public", "raw"])
def test_key_id_is_sha256_of_raw_public_key(key: object) -> None:
    kid = key_id(key)  # type: ignore[arg-type]
    assert kid == hashlib.sha256(NODE_RAW).hexdigest()[:16]
    assert len(kid) == 16 and int(kid, 16) >= 0 and kid == kid.lower()


def test_key_ids_differ_between_keys() -> None:
    assert key_id(NODE_KEY) != key_id(OTHER_KEY)
    assert raw_public_key(NODE_KEY) == raw_public_key(NODE_KEY.verify_key) == NODE_RAW


def test_signed_message_layout() -> None:
    assert signed_message("attested-report", b"x") == b"attested-report\x00x"
    assert signed_message("node-spec", b"") == b"node-spec\x00"


# --- node specs -----------------------------------------------------------------------

CP_KEYS = [Ed25519PrivateKey(bytes([i]) * 32) for i in (7, 8, 9)]
CP_PUBS = [k.verify_key for k in CP_KEYS]


@pytest.mark.parametrize("index", range(len(CP_KEYS)))
def test_node_spec_verifies_with_any_configured_key(index: int) -> None:
    signed = sign_node_spec(CP_KEYS[index], SPEC)
    assert signed.key_id == key_id(CP_KEYS[index])
    assert verify_node_spec(signed, CP_PUBS) == SPEC
    wire = SIGNED_NODE_SPEC_CODEC.decode(encode(signed))
    assert verify_node_spec(wire, list(reversed(CP_PUBS))) == SPEC


def _spec_signed(key: Ed25519PrivateKey, purpose: str, payload: bytes) -> SignedNodeSpec:
    return SignedNodeSpec(spec=payload, key_id=key_id(key), signature=raw_sign(key, signed_message(purpose, payload)))


GOOD_SPEC = sign_node_spec(CP_KEYS[1], SPEC)

BAD_SPECS: list[tuple[str, Callable[[], SignedNodeSpec], str]] = [
    ("unknown-key-id", lambda: sign_node_spec(NODE_KEY, SPEC), "is not a configured control-plane key"),
    ("unsigned-while-keys-configured", lambda: unsigned_node_spec(SPEC), "key_id '' is not a configured"),
    ("key-id-garbage", lambda: msgspec.structs.replace(GOOD_SPEC, key_id="zz"), "key_id 'zz'"),
    (
        "bad-signature",
        lambda: msgspec.structs.replace(GOOD_SPEC, signature=flip(GOOD_SPEC.signature, 5)),
        "signature does not verify",
    ),
    ("empty-signature", lambda: msgspec.structs.replace(GOOD_SPEC, signature=b""), "signature does not verify"),
    (
        "tampered-spec",
        lambda: msgspec.structs.replace(GOOD_SPEC, spec=GOOD_SPEC.spec.replace(b'"generation":3', b'"generation":4')),
        "signature does not verify",
    ),
    (
        "signed-by-another-configured-key",
        lambda: msgspec.structs.replace(sign_node_spec(CP_KEYS[0], SPEC), key_id=key_id(CP_KEYS[2])),
        "signature does not verify",
    ),
    (
        "report-purpose-replayed-as-spec",
        lambda: _spec_signed(CP_KEYS[0], "attested-report", encode(SPEC)),
        "signature does not verify",
    ),
    ("signed-but-not-a-spec", lambda: _spec_signed(CP_KEYS[0], "node-spec", b'{"node_id": "N"}'), "spec: "),
    ("signed-but-not-json", lambda: _spec_signed(CP_KEYS[0], "node-spec", b"\x00"), "spec: message: not valid JSON"),
]


@pytest.mark.parametrize(("make", "text"), [r[1:] for r in BAD_SPECS], ids=[r[0] for r in BAD_SPECS])
def test_node_spec_verification_fails(make: Callable[[], SignedNodeSpec], text: str) -> None:
    with pytest.raises(VerificationError) as exc:
        verify_node_spec(make(), CP_PUBS)
    assert text in str(exc.value)


def test_no_keys_configured_refuses_every_spec_unless_told_to_accept_unsigned() -> None:
    # fail closed (issue 40): an empty key list is not "anything goes" by itself
    for envelope in (unsigned_node_spec(SPEC), GOOD_SPEC):
        with pytest.raises(VerificationError, match="no control-plane key is configured"):
            verify_node_spec(envelope, [])


def test_the_lab_opt_out_accepts_unsigned_specs() -> None:
    assert verify_node_spec(unsigned_node_spec(SPEC), [], accept_unsigned=True) == SPEC
    unsigned = unsigned_node_spec(SPEC)
    assert unsigned.key_id == "" and unsigned.signature == b""
    # and ignores whatever signature a spec carries
    assert verify_node_spec(msgspec.structs.replace(GOOD_SPEC, signature=b"junk"), [], accept_unsigned=True) == SPEC


def test_keys_win_over_the_opt_out() -> None:
    with pytest.raises(VerificationError, match="key_id '' is not a configured"):
        verify_node_spec(unsigned_node_spec(SPEC), CP_PUBS, accept_unsigned=True)


def test_the_opt_out_still_refuses_a_bad_spec() -> None:
    with pytest.raises(VerificationError, match=r"^spec: .*`\$\.devices\[0\]\.allocation_id`"):
        verify_node_spec(SignedNodeSpec(spec=encode(SPEC).replace(b'"a1"', b'"A/1"')), [], accept_unsigned=True)


# --- cross-purpose replay -------------------------------------------------------------


def test_node_spec_signature_does_not_verify_as_an_attested_report() -> None:
    """A control plane key that signed a spec cannot have that signature pass as a node report."""
    body = encode(BODY)
    as_spec = _spec_signed(NODE_KEY, "node-spec", body)
    report = AttestedReport(key_id=as_spec.key_id, body=as_spec.spec, signature=as_spec.signature)
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_report(report, NODE_RAW)


def test_report_signature_does_not_verify_as_a_node_spec() -> None:
    payload = encode(SPEC)
    report = _signed_by(NODE_KEY, "attested-report", payload)
    replay = SignedNodeSpec(spec=report.body, key_id=report.key_id, signature=report.signature)
    with pytest.raises(VerificationError, match="signature does not verify"):
        verify_node_spec(replay, [NODE_KEY.verify_key])


# --- public key files -------------------------------------------------------------------

_OPENSSL_KEY = OpenSslPrivateKey.from_private_bytes(SEED)
PEM = _OPENSSL_KEY.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
B64 = base64.b64encode(NODE_RAW)


def _pem_of(key: object) -> bytes:
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)  # type: ignore[attr-defined]


def _unknown_algorithm_pem() -> bytes:
    oid = bytes([0x06, 0x03, 0x2A, 0x03, 0x04])  # 1.2.3.4
    alg = bytes([0x30, len(oid)]) + oid
    bits = bytes([0x03, 33, 0]) + b"\x11" * 32
    spki = bytes([0x30, len(alg) + len(bits)]) + alg + bits
    return b"-----BEGIN PUBLIC KEY-----\n" + base64.encodebytes(spki) + b"-----END PUBLIC KEY-----\n"


GOOD_KEY_FILES = [
    pytest.param(PEM, id="pem-spki"),
    pytest.param(b"\n  " + PEM + b"\n\n", id="pem-with-whitespace"),
    pytest.param(PEM.replace(b"\n", b"\r\n"), id="pem-crlf"),
    pytest.param(B64, id="base64-raw"),
    pytest.param(B64 + b"\n", id="base64-raw-newline"),
    pytest.param(b"  " + B64 + b"\r\n", id="base64-raw-padded"),
]


@pytest.mark.parametrize("data", GOOD_KEY_FILES)
def test_load_public_key_accepts(data: bytes) -> None:
    key = load_public_key(data)
    assert isinstance(key, Ed25519PublicKey)
    assert raw_public_key(key) == NODE_RAW


BAD_KEY_FILES = [
    pytest.param(b"", "base64 holds 0 bytes, Ed25519 needs 32", id="empty"),
    pytest.param(b"not a key!", "neither PEM nor base64", id="garbage"),
    pytest.param(base64.b64encode(NODE_RAW[:31]), "base64 holds 31 bytes", id="base64-31-bytes"),
    pytest.param(base64.b64encode(SEED + NODE_RAW), "base64 holds 64 bytes", id="base64-64-bytes"),
    pytest.param(NODE_RAW.hex().encode(), "base64 holds 48 bytes", id="hex-not-base64"),
    pytest.param(_pem_of(ec.generate_private_key(ec.SECP256R1()).public_key()), "PEM key is not Ed25519", id="pem-ec"),
    pytest.param(_pem_of(x25519.X25519PrivateKey.generate().public_key()), "PEM key is not Ed25519", id="pem-x25519"),
    pytest.param(
        _OPENSSL_KEY.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        "public key: not a PEM public key",
        id="pem-private-key",
    ),
    pytest.param(PEM[:40] + PEM[60:], "public key: not a PEM public key", id="pem-corrupt"),
    pytest.param(b"-----BEGIN PUBLIC KEY-----\n", "public key: not a PEM public key", id="pem-truncated"),
    pytest.param(_unknown_algorithm_pem(), "PEM key is not Ed25519 (algorithm 1.2.3.4)", id="pem-unknown-algorithm"),
]


@pytest.mark.parametrize(("data", "text"), BAD_KEY_FILES)
def test_load_public_key_refuses(data: bytes, text: str) -> None:
    with pytest.raises(ValueError) as exc:
        load_public_key(data)
    assert text in str(exc.value)
    assert str(exc.value).startswith("public key: ")


def test_load_public_key_file_names_the_file(tmp_path: Path) -> None:
    good = tmp_path / "cp.pem"
    good.write_bytes(PEM)
    assert raw_public_key(load_public_key_file(good)) == NODE_RAW
    bad = tmp_path / "cp-bad.pem"
    bad.write_bytes(_unknown_algorithm_pem())
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: public key: "):
        load_public_key_file(bad)


def test_loaded_key_verifies_a_spec_signed_by_its_private_key() -> None:
    keys = [load_public_key(_pem_of(OpenSslPublicKey.from_public_bytes(raw_public_key(CP_PUBS[0])))), load_public_key(base64.b64encode(raw_public_key(CP_PUBS[1])))]
    for private in CP_KEYS[:2]:
        assert verify_node_spec(sign_node_spec(private, SPEC), keys) == SPEC


def test_key_ids_are_subject_safe() -> None:
    for key in (NODE_KEY, OTHER_KEY, *CP_KEYS):
        assert ID_RE.match(key_id(key))


# --- private key files (shared.ed25519der, shared.keyfile) -----------------------------


def test_private_key_pem_is_what_openssl_writes_and_reads() -> None:
    from shared.ed25519der import private_key_from_pem, private_key_pem

    ours = private_key_pem(SEED)
    theirs = _OPENSSL_KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    assert ours == theirs
    assert private_key_from_pem(theirs) == SEED
    loaded = serialization.load_pem_private_key(ours, password=None)
    assert isinstance(loaded, OpenSslPrivateKey) and loaded.private_bytes_raw() == SEED


@pytest.mark.parametrize(
    ("data", "text"),
    [
        pytest.param(lambda: ec.generate_private_key(ec.SECP256R1()).private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), "key is not Ed25519 (algorithm EC)", id="ec"),
        pytest.param(lambda: x25519.X25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), "key is not Ed25519 (algorithm X25519)", id="x25519"),
        pytest.param(lambda: _OPENSSL_KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"pw")), "not a PEM private key (it is a encrypted private key)", id="encrypted"),
        pytest.param(lambda: PEM, "not a PEM private key (it is a public key)", id="a-public-key"),
        pytest.param(lambda: b"-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIA==\n-----END PRIVATE KEY-----\n", "not a PEM private key (", id="truncated"),
        pytest.param(lambda: b"garbage", "not a PEM private key", id="garbage"),
    ],
)
def test_private_key_pem_refuses_what_is_not_an_ed25519_pkcs8_key(data: Callable[[], bytes], text: str) -> None:
    from shared.ed25519der import DerError, private_key_from_pem

    with pytest.raises(DerError) as exc:
        private_key_from_pem(data())
    assert text in str(exc.value)


def test_a_key_file_made_by_openssl_is_loaded_and_one_made_here_read_by_openssl(tmp_path: Path) -> None:
    import os

    from shared.keyfile import load_or_create_key

    theirs = tmp_path / "theirs.key"
    fd = os.open(theirs, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, _OPENSSL_KEY.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.close(fd)
    key, created = load_or_create_key(theirs)
    assert not created and raw_public_key(key) == NODE_RAW
    ours, created = load_or_create_key(tmp_path / "ours.key")
    assert created
    loaded = serialization.load_pem_private_key((tmp_path / "ours.key").read_bytes(), password=None)
    assert isinstance(loaded, OpenSslPrivateKey)
    assert loaded.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw) == raw_public_key(ours)
