"""Every decoder at a boundary, fuzzed (issue 11: "Nothing from outside stops the node").

For every `*_CODEC` of shared.schemas (found by name: a new codec is fuzzed
without editing this file) hypothesis throws arbitrary JSON (unicode,
control characters, lone surrogates, huge numbers), arbitrary bytes, objects
with the type's own field names and garbage values, and one-field mutations
of a valid message of the type; fixed lists add bodies thousands of levels
deep and bodies over the codec's size limit. The one acceptable outcome is an
instance of the type or `BadMessage`: no RecursionError, no msgspec error, no
other ValueError.

The same holds for the other decoders of what comes from outside: a hold
file read back from the CDI dir (`parse_hold`: a HoldOnDisk or NotAHold),
the vendor CDI spec (VendorCdi or VendorSpecError), the fakehw host file
(FakeHost or HostFileError), a signed NodeSpec whose inner spec is garbage
(`verify_node_spec`: NodeSpec or VerificationError), and the state files the
converger and the inventory read back from their data directories.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shared.schemas as schemas
from services.converger.model import ConvergerState
from services.converger.observe import DiskView, read_disk
from services.converger.releases import RELEASES_FILE, ReleasesStore
from services.converger.state import StateStore
from services.inventory.adapters.fakehost import FakeHost, HostFileError, load_host_file
from services.inventory.gpustate import GpuState, decode_state, encode_state
from shared.holdfiles import HoldOnDisk, NotAHold, hold_file_bytes, parse_hold
from shared.schemas import BadMessage, Codec, NodeSpec, SignedNodeSpec
from shared.schemas.events import NODE_SPEC_PURPOSE
from shared.signing import sign as sign_with_purpose
from shared.signing import VerificationError, sign_node_spec, verify_node_spec
from shared.slices import FakeSlices, SliceError
from shared.spectrust import SpecTrust
from shared.vendorcdi import VendorCdi, VendorSpecError, read_vendor_cdi, vendor_cdi_from_json
from tests.fuzzkit import (
    CODECS,
    CP_KEY,
    EXAMPLE_HOST_FILE,
    HOLD,
    SPEC,
    Body,
    bodies,
    codec_types,
    deep_bodies,
    deep_bodies_of,
    deep_object,
    describe,
    doc_mutations,
    json_bytes,
    mutations,
    oversized_bodies,
    sample_doc,
    sample_for,
    shaped_objects,
)

#: bounded, so the whole file runs in well under a minute on two shared cores.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much, HealthCheck.large_base_example],
)
FUZZ_MORE = settings(FUZZ, max_examples=100)
NAMES = sorted(CODECS)

# --------------------------------------------------------------------------- the codecs are all found


def test_every_codec_of_the_schemas_is_fuzzed() -> None:
    assert NAMES, "no *_CODEC found in shared.schemas"
    assert {"NODE_SPEC_CODEC", "SIGNED_NODE_SPEC_CODEC", "INVENTORY_CODEC", "SIGN_REQUEST_CODEC", "HELPER_FILE_WRITE_CODEC"} <= set(NAMES)
    exported = {n for n in schemas.__all__ if n.endswith("_CODEC")}
    assert exported <= set(NAMES)
    assert len(NAMES) >= 30


@pytest.mark.parametrize("name", NAMES)
def test_the_valid_sample_decodes_to_itself(name: str) -> None:
    """The mutations start from a valid message, or they would prove nothing."""
    codec = CODECS[name]
    sample = sample_for(name)
    assert codec.decode(schemas.encode(sample)) == sample
    assert isinstance(sample, codec_types(codec))


# --------------------------------------------------------------------------- the contract


def outcome(codec: Codec[Any], data: bytes) -> str | None:
    """None when the codec kept its contract (an instance of its type, or BadMessage); else what went wrong."""
    try:
        value = codec.decode(data)
    except BadMessage:
        return None
    except Exception as exc:  # noqa: BLE001 - this is what the test is looking for
        return f"raised {type(exc).__name__}: {str(exc)[:200]}"
    if not isinstance(value, codec_types(codec)):
        return f"returned a {type(value).__name__}, not a {codec_types(codec)}"
    return None


def check(name: str, data: bytes) -> None:
    problem = outcome(CODECS[name], data)
    assert problem is None, f"{name}.decode {problem} for {describe(data)}"


def check_all(data: bytes) -> None:
    """The same body against every codec (arbitrary input is no codec's in particular)."""
    problems = [f"{name}.decode {p}" for name in NAMES if (p := outcome(CODECS[name], data))]
    assert not problems, f"for {describe(data)}:\n  " + "\n  ".join(problems)


@settings(FUZZ, max_examples=400)
@given(body=bodies(json_bytes()))
def test_arbitrary_json_against_every_codec(body: Body) -> None:
    check_all(body.data)


@settings(FUZZ, max_examples=300)
@given(body=bodies(st.binary(max_size=400)))
def test_arbitrary_bytes_against_every_codec(body: Body) -> None:
    check_all(body.data)


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=30)
@given(data=st.data())
def test_objects_with_the_types_field_names(name: str, data: st.DataObject) -> None:
    check(name, data.draw(bodies(shaped_objects(CODECS[name].type))).data)


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=80)
@given(data=st.data())
def test_one_field_of_a_valid_message_mutated(name: str, data: st.DataObject) -> None:
    check(name, data.draw(bodies(mutations(name))).data)


@pytest.mark.parametrize("name", NAMES)
def test_deeply_nested_bodies(name: str) -> None:
    """Built directly (hypothesis does not nest 20,000 levels); every failing input class is listed."""
    failures = [f"{what}: {p}" for what, body in deep_bodies(name) if (p := outcome(CODECS[name], body))]
    assert not failures, f"{name}.decode broke its contract on deep bodies:\n  " + "\n  ".join(failures)


@pytest.mark.parametrize("name", NAMES)
def test_oversized_bodies(name: str) -> None:
    codec = CODECS[name]
    failures = [f"{what}: {p}" for what, body in oversized_bodies(codec) if (p := outcome(codec, body))]
    assert not failures, f"{name}.decode broke its contract on oversized bodies:\n  " + "\n  ".join(failures)
    over = b" " * codec.max_bytes + b"{}"
    with pytest.raises(BadMessage, match="larger than"):
        codec.decode(over)


# --------------------------------------------------------------------------- the other boundary decoders


def _contract(call: Callable[[], object], ok: tuple[type, ...], refusals: tuple[type[BaseException], ...], what: str, data: bytes) -> None:
    try:
        value = call()
    except refusals:
        return
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"{what} raised {type(exc).__name__}: {str(exc)[:200]} for {describe(data)}")
    assert isinstance(value, ok), f"{what} returned {type(value).__name__} for {describe(data)}"


def _fixed_failures(call: Callable[[bytes], object], ok: tuple[type, ...], refusals: tuple[type[BaseException], ...], cases: list[tuple[str, bytes]]) -> list[str]:
    failures = []
    for what, body in cases:
        try:
            value = call(body)
        except refusals:
            continue
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{what}: raised {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if not isinstance(value, ok):
            failures.append(f"{what}: returned {type(value).__name__}")
    return failures


HOST_DOC = json.loads(EXAMPLE_HOST_FILE.read_text())
VENDOR_DOC = HOST_DOC["vendor_cdi_spec"]
VENDOR = vendor_cdi_from_json(json.dumps(VENDOR_DOC).encode(), "/etc/cdi/nvidia.json")
HOLD_FILE = hold_file_bytes("cdi", HOLD, VENDOR)
HOLD_NAME = f"bcd-{HOLD.allocation_id}.json"
HOLD_DOC = json.loads(HOLD_FILE)
BIG = [("20 MiB of JSON whitespace", b" " * (20 << 20) + b"{}"), ("a 20 MiB string", b'"' + b"A" * (20 << 20) + b'"')]


def test_the_other_decoders_accept_their_valid_inputs(tmp_path: Path) -> None:
    assert isinstance(parse_hold(HOLD_NAME, HOLD_FILE), HoldOnDisk)
    assert isinstance(VENDOR, VendorCdi)
    (tmp_path / "host.json").write_text(json.dumps(HOST_DOC))
    assert isinstance(load_host_file(tmp_path / "host.json"), FakeHost)
    assert verify_node_spec(sign_node_spec(CP_KEY, SPEC), [CP_KEY.verify_key]) == SPEC


# parse_hold: what the converger reads back from the CDI dir (anyone who can write there can put it there)

HOLD_FILENAMES = st.sampled_from([HOLD_NAME, "bcd-x.json", "bcd-.json", "/etc/cdi/" + HOLD_NAME, "bcd-../x.json", "bcd-\x00.json"]) | st.text(max_size=40)


@FUZZ_MORE
@given(filename=HOLD_FILENAMES, body=bodies(st.one_of(json_bytes(), st.binary(max_size=400), doc_mutations(HOLD_DOC))))
def test_parse_hold_reads_a_hold_or_says_it_is_not_one(filename: str, body: Body) -> None:
    data = body.data
    _contract(lambda: parse_hold(filename, data), (HoldOnDisk,), (NotAHold,), f"parse_hold({filename!r})", data)


def test_parse_hold_on_deep_and_huge_files() -> None:
    cases = deep_bodies_of(HOLD_DOC) + BIG
    # the limits annotation is JSON inside JSON: decoded a second time
    doc = json.loads(HOLD_FILE)
    doc["annotations"]["bcd.dev/limits"] = deep_object(20_000).decode()
    cases.append(("limits annotation 20,000 deep", json.dumps(doc).encode()))
    failures = _fixed_failures(lambda b: parse_hold(HOLD_NAME, b), (HoldOnDisk,), (NotAHold,), cases)
    assert not failures, "parse_hold broke its contract (HoldOnDisk or NotAHold):\n  " + "\n  ".join(failures)


# the vendor's CDI spec (<cdi_dir>/nvidia.json: the toolkit writes it, the converger copies from it)


@FUZZ_MORE
@given(body=bodies(st.one_of(json_bytes(), st.binary(max_size=400), doc_mutations(VENDOR_DOC))))
def test_a_garbage_vendor_spec_is_refused_with_a_reason(body: Body) -> None:
    data = body.data
    _contract(lambda: vendor_cdi_from_json(data, "/etc/cdi/nvidia.json"), (VendorCdi,), (VendorSpecError,), "vendor_cdi_from_json", data)


def test_a_deep_or_huge_vendor_spec_is_refused_with_a_reason(tmp_path: Path) -> None:
    cases = deep_bodies_of(VENDOR_DOC) + BIG
    doc = json.loads(json.dumps(VENDOR_DOC))
    doc["containerEdits"] = {"x": "\x00marker"}
    cases.append(("containerEdits 20,000 deep", json.dumps(doc).encode().replace(b'"\\u0000marker"', deep_object(20_000))))
    failures = _fixed_failures(lambda b: vendor_cdi_from_json(b, "/etc/cdi/nvidia.json"), (VendorCdi,), (VendorSpecError,), cases)

    def from_file(body: bytes) -> object:
        (tmp_path / "nvidia.json").write_bytes(body)
        return read_vendor_cdi(tmp_path)

    failures += [f"read_vendor_cdi, {f}" for f in _fixed_failures(from_file, (VendorCdi,), (VendorSpecError,), cases[-3:])]
    assert not failures, "the vendor CDI spec reader broke its contract (VendorCdi or VendorSpecError):\n  " + "\n  ".join(failures)


# the fakehw host file (re-read on every scan; the fake switcher rewrites it)


@FUZZ
@given(body=bodies(st.one_of(json_bytes(), st.binary(max_size=400), doc_mutations(HOST_DOC))))
def test_a_garbage_host_file_is_refused_with_a_reason(tmp_path_factory: pytest.TempPathFactory, body: Body) -> None:
    data = body.data
    path = tmp_path_factory.mktemp("host") / "host.json"
    path.write_bytes(data)
    _contract(lambda: load_host_file(path), (FakeHost,), (HostFileError,), "load_host_file", data)


def test_a_deep_or_huge_host_file_is_refused_with_a_reason(tmp_path: Path) -> None:
    path = tmp_path / "host.json"

    def load(body: bytes) -> object:
        path.write_bytes(body)
        return load_host_file(path)

    doc = json.loads(json.dumps(HOST_DOC))
    doc["vendor_cdi_spec"]["containerEdits"] = "\x00marker"
    cases = deep_bodies_of(HOST_DOC) + BIG
    cases.append(("vendor_cdi_spec.containerEdits 20,000 deep", json.dumps(doc).encode().replace(b'"\\u0000marker"', deep_object(20_000))))
    failures = _fixed_failures(load, (FakeHost,), (HostFileError,), cases)
    assert not failures, "load_host_file broke its contract (FakeHost or HostFileError):\n  " + "\n  ".join(failures)


# a signed NodeSpec whose inner spec is garbage: the signature checks out, the spec must still be refused cleanly

KEYS = [CP_KEY.verify_key]


def signed(payload: bytes) -> SignedNodeSpec:
    return SignedNodeSpec(spec=payload, key_id=sign_node_spec(CP_KEY, SPEC).key_id, signature=sign_with_purpose(CP_KEY, NODE_SPEC_PURPOSE, payload))


@FUZZ_MORE
@given(body=bodies(st.one_of(json_bytes(), st.binary(max_size=400), shaped_objects(NodeSpec), mutations("NODE_SPEC_CODEC"))))
def test_a_validly_signed_garbage_spec_is_refused_with_a_reason(body: Body) -> None:
    inner = body.data
    _contract(lambda: verify_node_spec(signed(inner), KEYS), (NodeSpec,), (VerificationError,), "verify_node_spec", inner)


def test_a_validly_signed_deep_or_huge_spec_is_refused_with_a_reason() -> None:
    cases = deep_bodies("NODE_SPEC_CODEC") + [("a 1 MiB + 1 spec", b" " * (1 << 20) + b"{}")]
    failures = _fixed_failures(lambda b: verify_node_spec(signed(b), KEYS), (NodeSpec,), (VerificationError,), cases)
    assert not failures, "verify_node_spec broke its contract (NodeSpec or VerificationError):\n  " + "\n  ".join(failures)


def bridge_take(envelope: bytes) -> NodeSpec:
    """What gateway_bridge does with a value of bcd_nodespecs/<node>: decode the envelope, verify it."""
    return verify_node_spec(schemas.SIGNED_NODE_SPEC_CODEC.decode(envelope), KEYS)


@FUZZ_MORE
@given(body=bodies(st.one_of(json_bytes(), shaped_objects(SignedNodeSpec), mutations("SIGNED_NODE_SPEC_CODEC"))))
def test_a_garbage_spec_envelope_is_refused_with_a_reason(body: Body) -> None:
    envelope = body.data
    _contract(lambda: bridge_take(envelope), (NodeSpec,), (BadMessage, VerificationError), "the bridge's decode + verify", envelope)


def test_a_deep_spec_envelope_is_refused_with_a_reason() -> None:
    deep_inner = json.dumps({**sample_doc("NODE_SPEC_CODEC"), "x": "\x00m"}).encode().replace(b'"\\u0000m"', deep_object(20_000))
    cases = deep_bodies("SIGNED_NODE_SPEC_CODEC") + [
        ("validly signed spec with an unknown field 20,000 deep", schemas.encode(signed(deep_inner))),
        ("validly signed array 20,000 deep", schemas.encode(signed(b"[" * 20_000 + b"]" * 20_000))),
    ]
    failures = _fixed_failures(bridge_take, (NodeSpec,), (BadMessage, VerificationError), cases)
    assert not failures, "the bridge's decode + verify broke its contract (NodeSpec, BadMessage or VerificationError):\n  " + "\n  ".join(failures)


# state files read back from the data directories: a bad file is set aside or refused, never raised past the loader


def _readback_bodies(valid: bytes) -> list[tuple[str, bytes]]:
    doc = json.loads(valid)
    return deep_bodies_of(doc) + [("not JSON", b"\xff{"), ("empty", b""), ("a JSON array", b"[]"), *BIG[:1]]


def test_the_converger_state_and_stored_spec_read_back_or_start_afresh(tmp_path: Path) -> None:
    cases = _readback_bodies(schemas.encode(ConvergerState()))

    def load_state(body: bytes) -> object:
        store = StateStore(tmp_path / "state")
        store.path.write_bytes(body)
        return store.load()

    trust = SpecTrust(keys=tuple(KEYS))
    lab = SpecTrust(accept_unsigned=True)

    def load_spec(body: bytes, trust: SpecTrust = trust) -> object:
        store = StateStore(tmp_path / "spec")
        store.spec_path.write_bytes(body)
        spec = store.load_spec(trust, SPEC.node_id)
        return spec if spec is not None else SPEC

    # spec.json holds the signed envelope; a bare spec (an earlier release's) is read under the lab opt-out
    envelopes = deep_bodies("SIGNED_NODE_SPEC_CODEC") + [(f"validly signed: {w}", schemas.encode(signed(b))) for w, b in deep_bodies("NODE_SPEC_CODEC")]
    failures = [f"StateStore.load, {f}" for f in _fixed_failures(load_state, (ConvergerState,), (), cases)]
    failures += [f"StateStore.load_spec, {f}" for f in _fixed_failures(load_spec, (NodeSpec,), (), envelopes)]
    failures += [f"StateStore.load_spec, bare, {f}" for f in _fixed_failures(lambda b: load_spec(b, lab), (NodeSpec,), (), deep_bodies("NODE_SPEC_CODEC"))]
    assert not failures, "the converger's state readers raised:\n  " + "\n  ".join(failures)


def test_the_releases_file_reads_back_or_counts_as_unreadable(tmp_path: Path) -> None:
    cases = _readback_bodies(b'{"version": 1, "releases": {}}')

    def load(body: bytes) -> object:
        d = tmp_path / "data"
        d.mkdir(exist_ok=True)
        (d / RELEASES_FILE).write_bytes(body)
        store = ReleasesStore(d)
        peeked = store.peek()
        loaded = store.load()
        assert isinstance(peeked, tuple) and isinstance(loaded, tuple)
        return loaded

    failures = _fixed_failures(load, (tuple,), (), cases)
    assert not failures, "ReleasesStore.peek/load raised:\n  " + "\n  ".join(failures)


def test_the_inventorys_gpus_json_is_refused_with_a_reason() -> None:
    cases = _readback_bodies(encode_state(GpuState()))
    failures = _fixed_failures(decode_state, (GpuState,), (msgspec.DecodeError, msgspec.ValidationError, ValueError), cases)
    assert not failures, "gpustate.decode_state raised outside its contract:\n  " + "\n  ".join(failures)


# the hold directories as the converger reads them back: garbage is reported and skipped, never raised


def test_garbage_in_the_hold_directories_is_skipped_not_raised(tmp_path: Path) -> None:
    cdi, run = tmp_path / "cdi", tmp_path / "run"
    (run / "allocations").mkdir(parents=True)
    cdi.mkdir()
    (cdi / HOLD_NAME).write_bytes(HOLD_FILE)
    (run / "allocations" / f"{HOLD.allocation_id}.env").write_bytes(hold_file_bytes("allocation-env", HOLD, None))
    cases = [*deep_bodies_of(HOLD_DOC), ("not JSON", b"\xff{"), ("empty", b""), ("a JSON array", b"[]"), ("4 MiB", b" " * (4 << 20) + b"{}")]
    for i, (_, body) in enumerate(cases):
        (cdi / f"bcd-fuzz{i}.json").write_bytes(body)
        (run / "allocations" / f"fuzz{i}.env").write_bytes(body)
    try:
        view = read_disk(cdi, run)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"read_disk raised {type(exc).__name__}: {str(exc)[:300]} on garbage hold files")
    assert isinstance(view, DiskView)
    assert set(view.holds) == {HOLD.allocation_id}, "the real hold is still read, the garbage is not"


def test_a_garbage_fake_slice_record_is_a_slice_error() -> None:
    cases = [*deep_bodies_of({"name": "x", "properties": {}, "hugepages": [], "pids": []}), ("not JSON", b"\xff{"), ("a JSON array", b"[]"), *BIG[:1]]
    failures = []
    with tempfile.TemporaryDirectory() as d:
        slices = FakeSlices(Path(d))
        slices.dir.mkdir(parents=True)
        for what, body in cases:
            slices.path(HOLD.allocation_id).write_bytes(body)
            for method in (slices.exists, slices.is_empty, slices.properties):
                try:
                    method(HOLD.allocation_id)
                except SliceError:
                    pass
                except Exception as exc:  # noqa: BLE001
                    failures.append(f"FakeSlices.{method.__name__}, {what}: raised {type(exc).__name__}: {str(exc)[:120]}")
    assert not failures, "a fake slice record broke its reader's contract (a value or SliceError):\n  " + "\n  ".join(failures)


def _string_paths(o: object, path: tuple = ()) -> list[tuple]:
    if isinstance(o, dict):
        return [p for k, v in o.items() for p in _string_paths(v, (*path, k))]
    if isinstance(o, list):
        return [p for i, v in enumerate(o) for p in _string_paths(v, (*path, i))]
    return [path] if isinstance(o, str) else []


@pytest.mark.parametrize("escape", ["\\ud800", "\\udc80x", "x\\udbff"])
def test_a_lone_surrogate_escape_anywhere_in_a_hold_file_is_not_a_hold(escape: str) -> None:
    """`"\\ud800"` is valid JSON but no UTF-8 text: every later encode of it raised (Hypothesis found
    one in a device name: parse_hold raised UnicodeEncodeError instead of NotAHold)."""
    marker = "\x00surrogate-marker"
    failures = []
    for path in _string_paths(HOLD_DOC):
        doc = json.loads(json.dumps(HOLD_DOC))
        parent = doc
        for p in path[:-1]:
            parent = parent[p]
        parent[path[-1]] = marker
        data = json.dumps(doc).encode().replace(b'"\\u0000surrogate-marker"', f'"{escape}"'.encode())
        try:
            parse_hold(HOLD_NAME, data)
            failures.append(f"{path}: taken as a hold")
        except NotAHold as exc:
            assert "lone surrogate" in exc.reason or "not valid" in exc.reason, exc.reason
        except Exception as exc:  # noqa: BLE001 - the contract is NotAHold
            failures.append(f"{path}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)
