"""Which specs a node believes (issue 40): the keys or the named lab opt-out, at start, on the bus and on disk.

shared/spectrust.py (both hops' options and their one check), the converger's
stored spec verified again when read back (services/converger/state.py), and
`bcd up`'s refusal of options that would leave a hop unchecked (bcd/up.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from bcd.up import spec_trust_problem
from controlplane.keys import public_key_pem
from services.converger.state import StateStore
from shared.runtime import StartupError, common_options, parse_options
from shared.schemas import NodeSpec, encode
from shared.signing import Ed25519PrivateKey, VerificationError, key_id, sign_node_spec, unsigned_node_spec
from shared.spectrust import BOTH, NO_KEY, SpecTrust, announce, load_trust, trust_options

CP = Ed25519PrivateKey.generate()
ROTATED_OUT = Ed25519PrivateKey.generate()
FORGER = Ed25519PrivateKey.generate()
SPEC = NodeSpec(node_id="node-1", generation=7)
TRUST = SpecTrust(keys=(CP.verify_key,))
LAB = SpecTrust(accept_unsigned=True)


def key_file(tmp_path: Path, key: Ed25519PrivateKey, name: str = "cp.pub") -> Path:
    path = tmp_path / name
    path.write_bytes(public_key_pem(key))
    return path


# ------------------------------------------------------------------ options and start


def test_no_key_and_no_opt_out_is_no_start() -> None:
    with pytest.raises(StartupError) as err:
        load_trust("", False)
    assert str(err.value) == NO_KEY and "\n" not in NO_KEY
    assert "--cp-key" in NO_KEY and "--accept-unsigned-specs" in NO_KEY and "BCD_ACCEPT_UNSIGNED_SPECS=1" in NO_KEY


def test_a_key_and_the_opt_out_together_is_no_start(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match="together"):
        load_trust(str(key_file(tmp_path, CP)), True)
    assert "\n" not in BOTH


@pytest.mark.parametrize("content", [b"", b"not a key", b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"])
def test_a_key_file_that_does_not_read_is_no_start_never_unsigned(tmp_path: Path, content: bytes) -> None:
    bad = tmp_path / "cp.pub"
    bad.write_bytes(content)
    with pytest.raises(StartupError, match=rf"^--cp-key {bad}: "):
        load_trust(str(bad), False)
    with pytest.raises(StartupError, match="No such file"):
        load_trust(str(tmp_path / "missing.pub"), False)


def test_keys_load_comma_separated(tmp_path: Path) -> None:
    trust = load_trust(f"{key_file(tmp_path, CP, 'a.pub')}, {key_file(tmp_path, ROTATED_OUT, 'b.pub')}", False)
    assert [key_id(k) for k in trust.keys] == [key_id(CP), key_id(ROTATED_OUT)] and not trust.accept_unsigned
    assert load_trust("", True) == LAB


def test_both_services_take_the_same_two_options() -> None:
    ns = parse_options("converger", [*common_options("converger"), *trust_options()], ["--node-id", "n"], {"BCD_CP_KEY": "/etc/bcd/cp.pub"})
    assert (ns.cp_key, ns.accept_unsigned_specs) == ("/etc/bcd/cp.pub", False)
    ns = parse_options("gateway_bridge", [*common_options("gateway_bridge"), *trust_options()], ["--node-id", "n"], {"BCD_ACCEPT_UNSIGNED_SPECS": "1"})
    assert (ns.cp_key, ns.accept_unsigned_specs) == ("", True)


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def info(self, msg: str, **kw: object) -> None:
        self.lines.append(("INFO", msg, kw))

    def warning(self, msg: str, **kw: object) -> None:
        self.lines.append(("WARNING", msg, kw))


def test_the_opt_out_is_loud_and_keys_are_said() -> None:
    meta: dict[str, str] = {}
    reg, log = CollectorRegistry(), Log()
    announce(LAB, metadata=meta, log=log, registry=reg)
    assert meta == {"cp_keys": "0", "unsigned_specs": "accepted"} and reg.get_sample_value("bcd_unsigned_specs_accepted") == 1
    assert [(lvl, "ACCEPTING UNSIGNED NODE SPECS" in msg) for lvl, msg, _ in log.lines] == [("WARNING", True)]
    meta, reg, log = {}, CollectorRegistry(), Log()
    announce(TRUST, metadata=meta, log=log, registry=reg)
    assert meta == {"cp_keys": "1"} and reg.get_sample_value("bcd_unsigned_specs_accepted") == 0
    assert log.lines == [("INFO", "verifying node specs", {"keys": 1, "key_ids": [key_id(CP)]})]


# ------------------------------------------------------------------ the one check


def forged_body() -> bytes:
    good = sign_node_spec(CP, SPEC)
    return encode(msgspec.structs.replace(good, spec=encode(NodeSpec(node_id="node-1", generation=1000))))


@pytest.mark.parametrize(
    ("what", "envelope", "reason"),
    [
        ("unsigned", encode(unsigned_node_spec(SPEC)), "key_id '' is not a configured control-plane key"),
        ("another key", encode(sign_node_spec(FORGER, SPEC)), f"key_id '{key_id(FORGER)}' is not a configured"),
        ("the right key id, another key's signature", encode(msgspec.structs.replace(sign_node_spec(FORGER, SPEC), key_id=key_id(CP))), "signature does not verify"),
        ("a tampered body", forged_body(), "signature does not verify"),
        ("another node", encode(sign_node_spec(CP, NodeSpec(node_id="node-2", generation=7))), "the spec names node node-2, this is node-1"),
        ("a bare NodeSpec (no envelope)", encode(SPEC), "missing required field `spec`"),
        ("not JSON", b"\xff", "not valid JSON"),
    ],
)
def test_open_refuses_what_the_control_plane_did_not_sign_for_this_node(what: str, envelope: bytes, reason: str) -> None:
    with pytest.raises(VerificationError) as err:
        TRUST.open(envelope, "node-1")
    assert reason in str(err.value), what


def test_open_gives_the_envelope_and_the_spec_as_signed() -> None:
    inner = json.dumps({"node_id": "node-1", "generation": 7, "future": 1}).encode()
    signed, spec = TRUST.open(encode(sign_node_spec(CP, inner)), "node-1")
    assert spec == SPEC and signed.spec == inner
    assert LAB.open(encode(unsigned_node_spec(SPEC)), "node-1")[1] == SPEC
    with pytest.raises(VerificationError, match="names node node-2"):
        LAB.open(encode(unsigned_node_spec(NodeSpec(node_id="node-2", generation=1))), "node-1")


# ------------------------------------------------------------------ the converger's stored spec, read back


def stored(tmp_path: Path, data: bytes) -> StateStore:
    store = StateStore(tmp_path / "converger")
    store.spec_path.write_bytes(data)
    return store


def test_a_stored_envelope_is_verified_again_and_its_unknown_fields_read_from_the_signed_bytes(tmp_path: Path) -> None:
    inner = json.dumps({"node_id": "node-1", "generation": 7, "future": {"x": 1}}).encode()
    store = stored(tmp_path, encode(sign_node_spec(CP, inner)))
    assert store.load_spec_with_unknown(TRUST, "node-1") == (SPEC, ["$.future: unknown field"])


@pytest.mark.parametrize(
    ("what", "data", "trust"),
    [
        # the operator took the key out of --cp-key: what it alone signed is not applied after a restart
        ("signed by a key no longer configured", encode(sign_node_spec(ROTATED_OUT, SPEC)), TRUST),
        ("kept while unsigned specs were accepted, keys configured now", encode(unsigned_node_spec(SPEC)), TRUST),
        ("an earlier release's bare spec, keys configured", encode(SPEC), TRUST),
        ("another node's", encode(sign_node_spec(CP, NodeSpec(node_id="node-2", generation=7))), TRUST),
        ("a tampered body", forged_body(), TRUST),
    ],
)
def test_a_stored_spec_that_does_not_verify_now_is_not_taken_and_is_left_in_place(tmp_path: Path, what: str, data: bytes, trust: SpecTrust) -> None:
    store = stored(tmp_path, data)
    assert store.load_spec_with_unknown(trust, "node-1") == (None, []), what
    assert store.spec_path.read_bytes() == data  # for an operator to look at; the next good spec replaces it


def test_under_the_opt_out_an_earlier_release_s_bare_spec_is_taken(tmp_path: Path) -> None:
    assert stored(tmp_path, encode(SPEC)).load_spec(LAB, "node-1") == SPEC
    assert stored(tmp_path, encode(unsigned_node_spec(SPEC))).load_spec(LAB, "node-1") == SPEC


def test_save_keeps_the_envelope_byte_for_byte(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "converger")
    envelope = encode(sign_node_spec(CP, SPEC)) + b"\n"
    store.save_spec(envelope)
    assert store.spec_path.read_bytes() == envelope
    assert store.load_spec(TRUST, "node-1") == SPEC


# ------------------------------------------------------------------ bcd up


@pytest.mark.parametrize(
    ("embedded", "cp_key", "accept", "problem"),
    [
        (True, "", False, ""),
        (True, "", True, "--accept-unsigned-specs goes with --upstream only"),
        (False, "cp.pub", False, ""),
        (False, "", True, ""),
        (False, "", False, "--upstream needs --cp-key FILE"),
        # an empty --cp-key is what an unset variable expands to: never "unsigned" by itself
        (False, " , ", False, "--upstream needs --cp-key FILE"),
        (False, "cp.pub", True, "--cp-key and --accept-unsigned-specs together"),
    ],
)
def test_bcd_up_starts_no_node_with_a_hop_unchecked(embedded: bool, cp_key: str, accept: bool, problem: str) -> None:
    got = spec_trust_problem(embedded, cp_key, accept)
    assert (got.startswith(problem) if problem else got == ""), got


@pytest.mark.parametrize(
    ("args", "line"),
    [
        ([], "bcd up: --upstream needs --cp-key FILE"),
        (["--cp-key", ""], "bcd up: --upstream needs --cp-key FILE"),
        (["--cp-key", "cp.pub", "--accept-unsigned-specs"], "bcd up: --cp-key and --accept-unsigned-specs together"),
    ],
    ids=["no-key", "empty-key", "both"],
)
def test_bcd_up_refuses_in_one_line_before_starting_anything(tmp_path: Path, args: list[str], line: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}
    out = subprocess.run(
        [sys.executable, "-m", "bcd.cli", "up", "--state-dir", str(tmp_path / "state"), "--any-ports", "--upstream", "nats://127.0.0.1:1", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr
    assert not (tmp_path / "state" / "bus" / "nats.conf").exists()  # no bus was started
