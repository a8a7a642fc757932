"""Bounds at every edge (DESIGN 12): no decoder recurses past 64 levels, and what a producer emits fits its schema.

Issue 11, point 1: a 20,000-deep JSON value in the spec bucket raised
RecursionError inside `SIGNED_NODE_SPEC_CODEC.decode` and crash-looped the
bridge; endpoints answered 500 RecursionError instead of 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from shared.signing import sign as sign_with_purpose
from shared.signing import Ed25519PrivateKey

from shared import logs
from shared.runtime import LoopGuard, guarded
from shared.schemas import (
    CONVERGER_STATUS_CODEC,
    HELLO_CODEC,
    NODE_EVENT_CODEC,
    NODE_SPEC_CODEC,
    SIGNED_NODE_SPEC_CODEC,
    BadMessage,
    Codec,
    ConvergerStatus,
    NodeSpec,
    SectionStatus,
    SignedNodeSpec,
    encode,
)
from shared.schemas.codec import (
    MAX_DEPTH,
    BoundedDecoder,
    BoundsError,
    SchemaViolation,
    bounded_json_loads,
    nesting_exceeds,
)
from shared.signing import VerificationError, key_id, verify_node_spec
from shared.schemas import NODE_SPEC_PURPOSE

ISSUE_VALUE = b'{"x":' + b'{"a":' * 20_000 + b"1" + b"}" * 20_000 + b',"spec":"","key_id":"","signature":""}'
ANY: Codec[Any] = Codec(Any)  # type: ignore[arg-type]


def arrays(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


def objects(depth: int) -> bytes:
    return b'{"k":' * depth + b"1" + b"}" * depth


def mixed(depth: int) -> bytes:
    opens = "".join('{"k":' if i % 2 else "[" for i in range(depth))
    closes = "".join("}" if i % 2 else "]" for i in reversed(range(depth)))
    return (opens + "1" + closes).encode()


# ------------------------------------------------------------------ depth


def test_the_issue_value_is_a_bad_message_not_a_recursion_error() -> None:
    started = time.perf_counter()
    with pytest.raises(BadMessage, match=r"^message: nested deeper than 64 levels$"):
        SIGNED_NODE_SPEC_CODEC.decode(ISSUE_VALUE)
    assert time.perf_counter() - started < 0.5


@pytest.mark.parametrize("shape", [arrays, objects, mixed], ids=["arrays", "objects", "mixed"])
def test_64_levels_decode_and_65_are_refused(shape) -> None:
    assert ANY.decode(shape(MAX_DEPTH)) is not None
    with pytest.raises(BadMessage, match="nested deeper than 64 levels"):
        ANY.decode(shape(MAX_DEPTH + 1))


@pytest.mark.parametrize("depth", [1, 2, 10, 63, 64, 65, 66, 100, 1000, 20_000])
def test_nesting_is_measured_exactly(depth: int) -> None:
    for shape in (arrays, objects, mixed):
        assert nesting_exceeds(shape(depth)) is (depth > MAX_DEPTH)
        # the same value one level down, beside shallow siblings
        wrapped = b'{"a":[1,2,{"b":[]}],"deep":' + shape(depth) + b',"z":[[[]]]}'
        assert nesting_exceeds(wrapped) is (depth + 1 > MAX_DEPTH)


def test_a_deep_unknown_field_of_a_known_type_is_refused() -> None:
    ok = b'{"node_id":"node-1","generation":3,"x":' + objects(MAX_DEPTH - 1) + b"}"
    assert NODE_SPEC_CODEC.decode(ok) == NodeSpec(node_id="node-1", generation=3)
    deep = b'{"node_id":"node-1","generation":3,"x":' + objects(MAX_DEPTH) + b"}"
    with pytest.raises(BadMessage, match="nested deeper than 64 levels"):
        NODE_SPEC_CODEC.decode(deep)


@pytest.mark.parametrize(
    "text",
    [
        '{"a": "' + "[" * 1000 + '"}',
        '{"a": "' + "{" * 1000 + "]" * 3 + '"}',
        '["\\"' + "[" * 500 + '", "\\\\", "' + "{" * 500 + '"]',
        '{"' + "[" * 200 + '": 1}',
    ],
    ids=["brackets", "unbalanced-in-string", "escaped-quotes", "in-a-key"],
)
def test_brackets_inside_strings_do_not_count(text: str) -> None:
    assert not nesting_exceeds(text.encode())
    assert ANY.decode(text) == json.loads(text)


def test_wide_but_shallow_megabyte_is_read_quickly() -> None:
    item = b'{"id":"a-[x]","v":[1,2,[3,{"w":"{"}]],"o":{"p":{}}}'
    count = (1024 * 1024 - 2) // (len(item) + 1)
    data = b"[" + b",".join([item] * count) + b"]"
    assert 1000_000 <= len(data) <= ANY.max_bytes
    started = time.perf_counter()
    assert not nesting_exceeds(data)
    value = ANY.decode(data)
    # a guard against a check that grows faster than the input (a quadratic scan of
    # 1 MiB takes minutes), not a speed figure (bench/codec.py): ~0.03 s idle, up to
    # 0.6 s seen on a loaded 2-core machine
    assert time.perf_counter() - started < 5.0
    assert len(value) == count


def test_worst_case_within_the_largest_codec_limit_is_bounded_in_time() -> None:
    """Many 64-deep nests side by side: the rounds of pair removal cannot empty it, the running count does."""
    nest = arrays(MAX_DEPTH - 1)
    data = b"[" + b",".join([nest] * (CONVERGER_STATUS_CODEC.max_bytes // (len(nest) + 1) - 1)) + b"]"
    assert len(data) <= CONVERGER_STATUS_CODEC.max_bytes
    started = time.perf_counter()
    assert not nesting_exceeds(data)
    assert nesting_exceeds(b"[" + data + b"]")
    assert time.perf_counter() - started < 15.0  # as above: bounded, not fast (~0.4 s idle)


@pytest.mark.parametrize(
    "data",
    [b"{not json", b"[[[}", b"]]]" + b"[" * 10, b"{" * 10, b'"unterminated [[[['],
)
def test_shallow_garbage_is_still_not_valid_json(data: bytes) -> None:
    with pytest.raises(BadMessage, match=r"^message: not valid JSON"):
        ANY.decode(data)


@pytest.mark.parametrize("data", [b"[" * 65, b"{" * 20_000, b"]" * 5 + b"[" * 100, b'"x' + b"[" * 100], ids=["65-open", "20000-open", "closes-then-opens", "unterminated-string"])
def test_unbalanced_deep_input_is_refused_as_too_deep(data: bytes) -> None:
    with pytest.raises(BadMessage, match="nested deeper than 64 levels"):
        ANY.decode(data)


def test_size_is_checked_before_depth() -> None:
    codec: Codec[Any] = Codec(Any, max_bytes=100)  # type: ignore[arg-type]
    with pytest.raises(BadMessage, match=r"^message: 1001 bytes is larger than the 100-byte limit"):
        codec.decode(b"[" * 1001)


def test_any_parser_failure_is_a_bad_message(monkeypatch) -> None:
    codec: Codec[Any] = Codec(Any)  # type: ignore[arg-type]

    class Exploding:
        def decode(self, data: bytes) -> Any:
            raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(codec, "_decoder", Exploding())
    with pytest.raises(BadMessage, match="nested too deeply"):
        codec.decode(b"[1]")


def test_a_str_that_is_not_utf8_is_a_bad_message() -> None:
    with pytest.raises(BadMessage, match="not valid UTF-8"):
        ANY.decode('{"a": "\udcff"}')


# ------------------------------------------------------------------ the helpers for the other decoders


def test_bounded_json_loads() -> None:
    assert bounded_json_loads(b'{"a": [1, {"b": "[["}]}', 1024, "host file") == {"a": [1, {"b": "[["}]}
    with pytest.raises(BadMessage, match=r"^host file: nested deeper than 64 levels$"):
        bounded_json_loads(arrays(20_000), 1024 * 1024, "host file")
    with pytest.raises(BadMessage, match=r"^host file: 11 bytes is larger than the 10-byte limit$"):
        bounded_json_loads(b'"aaaaaaaaa"', 10, "host file")
    with pytest.raises(ValueError, match=r"^host file: not valid JSON"):
        bounded_json_loads(b"{nope", 1024, "host file")


def test_bounded_decoder_keeps_msgspec_errors_and_adds_its_own() -> None:
    dec = BoundedDecoder(NodeSpec, max_bytes=1024 * 1024, what="spec.json")
    assert dec.decode(encode(NodeSpec(node_id="n", generation=1))) == NodeSpec(node_id="n", generation=1)
    with pytest.raises(msgspec.ValidationError):
        dec.decode(b'{"node_id": 1, "generation": 1}')
    # a reader written for a plain msgspec decoder refuses the deep value with its own except clause
    try:
        dec.decode(b'{"node_id":"n","generation":1,"x":' + objects(20_000) + b"}")
    except msgspec.DecodeError as exc:
        assert isinstance(exc, BadMessage) and isinstance(exc, BoundsError)
        assert str(exc) == "spec.json: nested deeper than 64 levels"
    else:
        raise AssertionError("not refused")


def test_a_validly_signed_spec_with_a_deep_unknown_field_is_refused_not_a_crash() -> None:
    key = Ed25519PrivateKey.generate()
    payload = b'{"node_id":"node-1","generation":5,"x":' + objects(20_000) + b"}"
    signed = SignedNodeSpec(spec=payload, key_id=key_id(key), signature=sign_with_purpose(key, NODE_SPEC_PURPOSE, payload))
    wire = encode(signed)
    assert len(wire) < SIGNED_NODE_SPEC_CODEC.max_bytes
    envelope = SIGNED_NODE_SPEC_CODEC.decode(wire)  # the envelope itself is shallow
    with pytest.raises(VerificationError, match="spec: message: nested deeper than 64 levels"):
        verify_node_spec(envelope, [key.verify_key])


def test_file_readers_refuse_a_deep_file_with_their_own_errors(tmp_path) -> None:
    from services.converger.state import StateStore
    from services.inventory.gpustate import decode_state
    from shared.holdfiles import NotAHold, parse_hold
    from shared.vendorcdi import VendorSpecError, vendor_cdi_from_json

    deep = b'{"kind":"bcd.dev/gpu","x":' + arrays(20_000) + b"}"
    with pytest.raises(NotAHold, match="nested deeper than 64 levels"):
        parse_hold("bcd-a.json", deep)
    with pytest.raises(VendorSpecError, match="nested deeper than 64 levels"):
        vendor_cdi_from_json(deep, "/etc/cdi/nvidia.json")
    with pytest.raises(msgspec.DecodeError, match="nested deeper than 64 levels"):
        decode_state(deep)
    store = StateStore(tmp_path / "converger")
    store.path.write_bytes(deep)
    assert store.load() == type(store.load())()  # set aside, started afresh
    assert list((tmp_path / "converger").glob("state.json.unreadable-*"))


# ------------------------------------------------------------------ encode_valid


def status_with_message(n: int) -> ConvergerStatus:
    return ConvergerStatus(
        generation=3,
        section=SectionStatus(section="devices", state="FAILED", observed_generation=3, message="m" * n),
    )


def test_encode_valid_is_encode_for_a_valid_message() -> None:
    status = status_with_message(4096)
    assert CONVERGER_STATUS_CODEC.encode_valid(status) == encode(status)


def test_encode_valid_names_the_field_a_producer_broke() -> None:
    # issue 11 point 2: the converger answered a status its own schema refuses
    with pytest.raises(SchemaViolation, match=r"^ConvergerStatus schema violated: Expected `str` of length <= 4096 - at `\$\.section\.message`$"):
        CONVERGER_STATUS_CODEC.encode_valid(status_with_message(4097))
    assert not issubclass(SchemaViolation, BadMessage)


def test_encode_valid_checks_the_size_limit_and_the_union() -> None:
    from shared.schemas import Hello

    hello = Hello(
        node_id="node-1",
        boot_id="b",
        public_key=b"k" * 32,
        key_id="0123456789abcdef",
        capabilities=["x" * 10] * 10_000,
        agent_version="0",
        started_at=datetime.now(UTC),
    )
    with pytest.raises(SchemaViolation, match=r"larger than the 65536-byte limit"):
        HELLO_CODEC.encode_valid(hello)
    event = SectionStatus(section="devices", state="FAILED", observed_generation=1, message="x" * 5000)
    with pytest.raises(SchemaViolation, match=r"at `\$\.message`"):
        NODE_EVENT_CODEC.encode_valid(event)


def test_encode_valid_of_something_not_encodable() -> None:
    with pytest.raises(SchemaViolation, match="not encodable"):
        CONVERGER_STATUS_CODEC.encode_valid(object())


# ------------------------------------------------------------------ surviving one bad message


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured():
    handler = Records()
    logger = logging.getLogger("test.bounds")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield logs.get_logger("test.bounds"), handler.records
    finally:
        logger.removeHandler(handler)


class Msg:
    subject = "bcd.node-1.inventory.changed"

    def __init__(self, data: bytes) -> None:
        self.data = data


def test_guarded_callback_logs_and_survives(captured) -> None:
    log, records = captured
    seen: list[Any] = []

    @guarded(log, "inventory notice")
    async def on_msg(msg: Msg) -> None:
        if msg.data == b"boom":
            raise RuntimeError("kaput")
        seen.append(ANY.decode(msg.data))

    async def main() -> None:
        await on_msg(Msg(ISSUE_VALUE))
        await on_msg(Msg(b"boom"))
        await on_msg(Msg(b"[1]"))

    asyncio.run(main())
    assert seen == [[1]]
    assert [r.levelname for r in records] == ["WARNING", "ERROR"]
    assert records[0].getMessage() == "inventory notice: message ignored"
    assert "nested deeper than 64 levels" in records[0].fields["error"]  # type: ignore[attr-defined]
    assert records[1].fields["error"] == "RuntimeError: kaput"  # type: ignore[attr-defined]
    assert records[1].exc_info is not None


def test_loop_guard_logs_backs_off_and_carries_on(captured, monkeypatch) -> None:
    log, records = captured
    sleeps: list[float] = []

    async def fake_sleep(delay: float) -> None:
        sleeps.append(delay)

    monkeypatch.setattr("shared.runtime.asyncio.sleep", fake_sleep)
    outcomes = [BadMessage("Expected `str` of length <= 4096 - at `$.section.message`"), RuntimeError("x"), None, KeyError("k"), None]
    done: list[int] = []

    async def main() -> None:
        guard = LoopGuard(log, "records loop", initial=0.5, maximum=10.0)
        for i, outcome in enumerate(outcomes):
            async with guard:
                if outcome is not None:
                    raise outcome
                done.append(i)

    asyncio.run(main())
    assert done == [2, 4]
    assert sleeps == [0.5, 1.0, 0.5]
    assert [r.levelname for r in records] == ["WARNING", "ERROR", "ERROR"]
    assert "$.section.message" in records[0].fields["error"]  # type: ignore[attr-defined]
    assert records[1].exc_info is not None and records[1].exc_info[0] is RuntimeError


def test_loop_guard_lets_cancellation_through(captured) -> None:
    log, _ = captured

    async def main() -> None:
        async with LoopGuard(log, "loop"):
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def test_the_converger_journals_only_events_upstream_can_decode() -> None:
    from services.converger.outbox import OutboxError, check_event
    from shared.schemas import AllocationFailed, ReportBody
    from shared.signing import sign_report

    ok = SectionStatus(section="devices", state="FAILED", observed_generation=2, message="x" * 4096)
    check_event("section", encode(ok))
    too_long = SectionStatus(section="devices", state="FAILED", observed_generation=2, message="x" * 4097)
    with pytest.raises(OutboxError, match=r"section event violates its schema .* at `\$\.message`"):
        check_event("section", encode(too_long))
    with pytest.raises(OutboxError, match="a section event journaled as failed"):
        check_event("failed", encode(ok))
    failed = AllocationFailed(allocation_id="a", reservation_id="rsv-a", generation=2, reason="overlap", message="m")
    check_event("failed", encode(failed))
    with pytest.raises(OutboxError, match="nested deeper than 64 levels"):
        check_event("condition", b'{"event":"condition","x":' + objects(100) + b"}")

    from shared.schemas import AllocationBound

    key = Ed25519PrivateKey.generate()
    body = ReportBody(
        node_id="node-1",
        boot_id="b",
        event_id="node-1.a.bound.g2",
        time=datetime.now(UTC),
        event=AllocationBound(allocation_id="a", reservation_id="rsv-a", generation=2, devices=["GPU-1"]),
    )
    check_event("bound", encode(sign_report(key, body)))
    with pytest.raises(OutboxError, match="bound event violates its schema"):
        check_event("bound", encode(failed))
