"""Wire types: every type round-trips, events decode by their tag, and every bad input
is refused at decode with `BadMessage` whose text names the field path.

The bad-input tables are the contract of DESIGN 4: whatever later lands in a
file name, a subject, a KV key or an env file is refused here, before any
service sees it.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.schemas import (
    ATTESTED_REPORT_CODEC,
    DEFAULT_MAX_BYTES,
    EMPTY_CODEC,
    HELLO_CODEC,
    INVENTORY_CODEC,
    NODE_EVENT_CODEC,
    NODE_SPEC_CODEC,
    REPORT_BODY_CODEC,
    SIGN_BATCH_REPLY_CODEC,
    SIGN_BATCH_REQUEST_CODEC,
    SIGN_REQUEST_CODEC,
    SIGNED_NODE_SPEC_CODEC,
    SIGNER_KEY_CODEC,
    UPSTREAM_TYPES,
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    Atom,
    AttestedReport,
    BadMessage,
    Codec,
    Condition,
    DeviceAssignment,
    Empty,
    Gpu,
    GpuChanged,
    HoldCondition,
    Hello,
    HostResources,
    HugePages,
    Id,
    InstanceGpus,
    Inventory,
    Limits,
    MigInstance,
    NodeCondition,
    NodeSpec,
    PhysicalGPUStatus,
    ReportBody,
    SectionStatus,
    SignedNodeSpec,
    SignerKey,
    SignBatchReply,
    SignBatchRequest,
    SignItem,
    SignRequest,
    encode,
)
from shared.schemas.common import ID_RE, LIMITS_MAX_CPU_MILLIS, LIMITS_MAX_MEMORY_BYTES, env_key_problem, env_value_problem
from shared.schemas.events import EVENT_TYPES
from shared.schemas.nodespec import MAX_ASSIGNMENTS, MAX_DEVICES_PER_ASSIGNMENT, MAX_ENV_LINES

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
UUID = "GPU-5f3c2b1a-0000-4000-8000-0123456789ab"
KEY_ID = "0123456789abcdef"

# --- samples ---------------------------------------------------------------------

BOUND = AllocationBound(
    allocation_id="a1",
    reservation_id="r1",
    generation=3,
    devices=[UUID, f"{UUID}/gi1/ci0"],
    cgroup_parent="bcd-alloc-a1.slice",
    cdi_devices=[f"bcd.dev/gpu={UUID}"],
)
RELEASED = AllocationReleased(allocation_id="a1", reservation_id="r1", generation=4, devices=[UUID])
FAILED = AllocationFailed(
    allocation_id="a2", reservation_id="r2", generation=4, reason="device-missing", message="gone"
)
SECTION = SectionStatus(section="devices", state="FAILED", observed_generation=4, message="1 failed")
CONDITION = NodeCondition(
    condition=Condition(type="NodeSpecRejected", status="True", reason="BadSignature", message="m", since=T0)
)
GPU_CHANGED = GpuChanged(
    pci_address="0000:3b:00.0", uuid=UUID, phase="Passthrough", management_state="Managed", status=PhysicalGPUStatus()
)
HOLD_CONDITION = HoldCondition(
    allocation_id="a1",
    reservation_id="r1",
    generation=4,
    devices=[UUID],
    condition=Condition(type="DevicesHealthy", status="False", reason="XidCritical", message="m", since=T0),
)
EVENTS: dict[str, object] = {
    "bound": BOUND,
    "released": RELEASED,
    "failed": FAILED,
    "section": SECTION,
    "condition": CONDITION,
    "gpu": GPU_CHANGED,
    "hold": HOLD_CONDITION,
}

SPEC = NodeSpec(
    node_id="node-1",
    generation=5,
    devices=[
        DeviceAssignment(
            allocation_id="a1",
            reservation_id="r1",
            binding="BINDING_HOLD",
            instance_id="ignored",
            devices=[UUID, f"{UUID}/slot2"],
            limits=Limits(
                cpus="0-3,8",
                cpu_millis=1500,
                memory_bytes=1 << 30,
                hugepages=[HugePages(page_size_kib=2048, count=4)],
                mems="0-1",
            ),
            env=["FOO=bar", "EMPTY=", "X=a=b"],
        ),
        DeviceAssignment(allocation_id="a2", reservation_id="r2", binding="BINDING_KUBERNETES"),
    ],
    instances=[InstanceGpus(instance_id="vm-1", gpus=["0000:3b:00.0"])],
)
BODY = ReportBody(node_id="node-1", boot_id="boot", event_id="ev:1", time=T0, event=BOUND)
INVENTORY = Inventory(
    node_id="node-1",
    revision=2,
    observed_at=T0,
    gpus=[
        Gpu(
            atom_id=UUID,
            uuid=UUID,
            index=0,
            pci_address="0000:3b:00.0",
            mig_mode=True,
            mig_instances=[MigInstance(atom_id=f"{UUID}/gi1/ci0", gi=1, ci=0)],
        )
    ],
    atoms=[Atom(id=UUID, kind="gpu", gpu_uuid=UUID, pci_address="0000:3b:00.0")],
    host=HostResources(memory_bytes=1 << 34, cpus="0-15"),
)

#: one or more values per upstream type (by UPSTREAM_TYPES name), and the bus types.
SAMPLES: list[tuple[str, object, object]] = [
    ("NodeSpec", NodeSpec, SPEC),
    ("NodeSpec", NodeSpec, NodeSpec(node_id="n", generation=0)),
    ("SignedNodeSpec", SignedNodeSpec, SignedNodeSpec(spec=encode(SPEC), key_id=KEY_ID, signature=b"\x00\xff" * 32)),
    ("SignedNodeSpec", SignedNodeSpec, SignedNodeSpec(spec=encode(SPEC))),
    (
        "Hello",
        Hello,
        Hello(node_id="node-1", boot_id="b", public_key=b"k" * 32, key_id=KEY_ID, capabilities=["cdi"], started_at=T0),
    ),
    ("Inventory", Inventory, INVENTORY),
    ("Inventory", Inventory, Inventory(node_id="n", observed_at=T0)),
    ("ReportBody", ReportBody, BODY),
    ("ReportBody", ReportBody, ReportBody(node_id="n", boot_id="b", event_id="e", time=T0, event=RELEASED)),
    ("AttestedReport", AttestedReport, AttestedReport(key_id=KEY_ID, body=encode(BODY), signature=b"s" * 64)),
    ("AllocationBound", AllocationBound, BOUND),
    ("AllocationReleased", AllocationReleased, RELEASED),
    ("AllocationFailed", AllocationFailed, FAILED),
    ("SectionStatus", SectionStatus, SECTION),
    ("NodeCondition", NodeCondition, CONDITION),
    ("GpuChanged", GpuChanged, GPU_CHANGED),
    ("HoldCondition", HoldCondition, HOLD_CONDITION),
    *[("NodeEvent", UPSTREAM_TYPES["NodeEvent"], e) for e in EVENTS.values()],
    ("SignRequest", SignRequest, SignRequest(purpose="attested-report", event_id="ev:1", event=BOUND)),
    (
        "SignBatchRequest",
        SignBatchRequest,
        SignBatchRequest(purpose="attested-report", items=[SignItem(event_id="ev:1", event=BOUND), SignItem(event_id="ev:2", event=RELEASED)]),
    ),
    ("SignBatchReply", SignBatchReply, SignBatchReply(reports=[AttestedReport(key_id=KEY_ID, body=encode(BODY), signature=b"s" * 64)])),
    ("SignerKey", SignerKey, SignerKey(node_id="node-1", public_key=b"k" * 32, key_id=KEY_ID, boot_id="b")),
    ("Empty", Empty, Empty()),
]
BUS_TYPES = {"SignRequest", "SignBatchRequest", "SignBatchReply", "SignerKey", "Empty"}


def test_samples_cover_every_upstream_and_bus_type() -> None:
    assert {name for name, _, _ in SAMPLES} == set(UPSTREAM_TYPES) | BUS_TYPES
    for name, type_, _ in SAMPLES:
        if name in UPSTREAM_TYPES:
            assert type_ is UPSTREAM_TYPES[name]


@pytest.mark.parametrize(
    ("type_", "value"), [s[1:] for s in SAMPLES], ids=[f"{s[0]}-{i}" for i, s in enumerate(SAMPLES)]
)
def test_round_trip(type_: Any, value: object) -> None:
    data = encode(value)
    back = Codec(type_).decode(data)
    assert back == value
    assert type(back) is type(value)
    assert encode(back) == data


def _codec_name(codec: Codec[Any]) -> str:
    return getattr(codec.type, "__name__", "NodeEvent")


@pytest.mark.parametrize(
    ("codec", "value"),
    [
        (NODE_SPEC_CODEC, SPEC),
        (SIGNED_NODE_SPEC_CODEC, SignedNodeSpec(spec=encode(SPEC))),
        (INVENTORY_CODEC, INVENTORY),
        (HELLO_CODEC, SAMPLES[4][2]),
        (REPORT_BODY_CODEC, BODY),
        (ATTESTED_REPORT_CODEC, AttestedReport(key_id=KEY_ID, body=encode(BODY), signature=b"s" * 64)),
        (NODE_EVENT_CODEC, FAILED),
        (SIGN_REQUEST_CODEC, SignRequest(purpose="x", event_id="e", event=RELEASED)),
        (SIGNER_KEY_CODEC, SignerKey(node_id="n", public_key=b"k", key_id=KEY_ID, boot_id="b")),
        (EMPTY_CODEC, Empty()),
    ],
    ids=lambda v: _codec_name(v) if isinstance(v, Codec) else type(v).__name__,
)
def test_module_codecs_round_trip(codec: Codec[Any], value: object) -> None:
    assert codec.decode(codec.encode(value)) == value
    assert codec.decode(codec.encode(value).decode()) == value, "str input decodes too"


def test_types_are_frozen_and_keyword_only() -> None:
    with pytest.raises(AttributeError):
        SPEC.generation = 6  # type: ignore[misc]
    with pytest.raises(TypeError):
        NodeSpec("n", 1)  # type: ignore[misc]


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    doc = json.loads(encode(SPEC))
    doc["future"] = {"x": 1}
    doc["devices"][0]["future"] = [1]
    assert NODE_SPEC_CODEC.decode(json.dumps(doc)) == SPEC


def test_empty_body_is_not_empty() -> None:
    assert EMPTY_CODEC.decode(b"{}") == Empty()


# --- tagged events ---------------------------------------------------------------


def test_event_types_are_the_union_tags() -> None:
    tags = {json.loads(encode(e))["event"] for e in EVENTS.values()}
    assert tags == set(EVENTS) == set(EVENT_TYPES)


@pytest.mark.parametrize("tag", sorted(EVENTS))
def test_node_event_decodes_by_tag(tag: str) -> None:
    event = EVENTS[tag]
    doc = json.loads(encode(event))
    assert doc["event"] == tag
    # tag position does not matter
    reordered = {k: doc[k] for k in reversed(list(doc))}
    for raw in (json.dumps(doc), json.dumps(reordered)):
        got = NODE_EVENT_CODEC.decode(raw)
        assert type(got) is type(event)
        assert got == event


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        pytest.param({"event": "exploded"}, "$.event", id="unknown-tag"),
        pytest.param({"allocation_id": "a"}, "event", id="missing-tag"),
        pytest.param({"event": 1}, "$.event", id="tag-not-str"),
        pytest.param({"event": "bound", "allocation_id": "a"}, "reservation_id", id="tag-with-missing-fields"),
        pytest.param({**json.loads(encode(FAILED)), "event": "released"}, "devices", id="fields-of-another-tag"),
    ],
)
def test_node_event_bad_tags(raw: dict[str, Any], path: str) -> None:
    with pytest.raises(BadMessage, match=re.escape(path)):
        NODE_EVENT_CODEC.decode(json.dumps(raw))


@pytest.mark.parametrize("tag", ["failed", "section", "condition", "gpu"])
def test_only_bound_and_released_can_be_attested(tag: str) -> None:
    doc = json.loads(encode(BODY))
    doc["event"] = json.loads(encode(EVENTS[tag]))
    with pytest.raises(BadMessage, match=re.escape("$.event.event")):
        REPORT_BODY_CODEC.decode(json.dumps(doc))
    with pytest.raises(BadMessage, match=re.escape("$.event.event")):
        SIGN_REQUEST_CODEC.decode(json.dumps({"purpose": "attested-report", "event_id": "e", "event": doc["event"]}))


def test_sign_request_carries_any_purpose() -> None:
    """The signer refuses an unknown purpose with a reason; it is not a decode error."""
    req = SIGN_REQUEST_CODEC.decode(
        json.dumps({"purpose": "bogus", "event_id": "e", "event": json.loads(encode(BOUND))})
    )
    assert req.purpose == "bogus"


# --- bad NodeSpecs ----------------------------------------------------------------

SPEC_DOC: dict[str, Any] = json.loads(encode(SPEC))


def spec_with(*edits: tuple[tuple[str | int, ...], Any]) -> dict[str, Any]:
    """SPEC as JSON with each (path, value) set; a value of DELETE removes the key."""
    doc = copy.deepcopy(SPEC_DOC)
    for path, value in edits:
        node: Any = doc
        for part in path[:-1]:
            node = node[part]
        if value is DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return doc


DELETE = object()
A0 = ("devices", 0)
LIM = (*A0, "limits")


def _a0(field: str, value: Any) -> tuple[tuple[str | int, ...], Any]:
    return ((*A0, field), value)


BAD_IDS = [
    pytest.param("Alloc", id="uppercase"),
    pytest.param("-a", id="leading-dash"),
    pytest.param("_a", id="leading-underscore"),
    pytest.param("a" * 64, id="64-chars"),
    pytest.param("a/b", id="slash"),
    pytest.param("../x", id="dot-dot"),
    pytest.param("a\n", id="trailing-newline"),
    pytest.param("\na", id="leading-newline"),
    pytest.param("", id="empty"),
    pytest.param("a.b", id="dot"),
    pytest.param("a b", id="space"),
    pytest.param("a*", id="star"),
    pytest.param("é", id="non-ascii"),
    pytest.param("a\x00", id="nul"),
]


@pytest.mark.parametrize("field", ["allocation_id", "reservation_id"])
@pytest.mark.parametrize("value", BAD_IDS)
def test_bad_assignment_ids(field: str, value: str) -> None:
    with pytest.raises(BadMessage, match=re.escape(f"`$.devices[0].{field}`")):
        NODE_SPEC_CODEC.decode(json.dumps(spec_with(_a0(field, value))))


@pytest.mark.parametrize("value", BAD_IDS)
def test_bad_node_and_instance_ids(value: str) -> None:
    with pytest.raises(BadMessage, match=re.escape("`$.node_id`")):
        NODE_SPEC_CODEC.decode(json.dumps(spec_with((("node_id",), value))))
    with pytest.raises(BadMessage, match=re.escape("`$.instances[0].instance_id`")):
        NODE_SPEC_CODEC.decode(json.dumps(spec_with((("instances", 0, "instance_id"), value))))


@pytest.mark.parametrize("value", ["a", "0", "a" * 63, "0-a_b", "a--", "9_"], ids=str)
def test_good_ids_at_the_edges(value: str) -> None:
    got = NODE_SPEC_CODEC.decode(json.dumps(spec_with(_a0("allocation_id", value), _a0("reservation_id", value))))
    assert got.devices[0].allocation_id == value


ENV_BAD = [
    pytest.param(["NOEQUALS"], "$.devices[0].env[0]", id="no-equals"),
    pytest.param(["1A=x"], "$.devices[0].env[0]", id="key-starts-with-digit"),
    pytest.param(["A B=x"], "$.devices[0].env[0]", id="space-in-key"),
    pytest.param(["A-B=x"], "$.devices[0].env[0]", id="dash-in-key"),
    pytest.param(["=x"], "$.devices[0].env[0]", id="empty-key"),
    pytest.param(["A=x\ny"], "$.devices[0].env[0]", id="newline-in-value"),
    pytest.param(["A=x\n"], "$.devices[0].env[0]", id="trailing-newline"),
    pytest.param(["A=\x00"], "$.devices[0].env[0]", id="nul-in-value"),
    pytest.param(["A=x\ry"], "$.devices[0].env[0]", id="cr-in-value"),
    pytest.param(["OK=1", "A=x\r"], "$.devices[0].env[1]", id="cr-second-line"),
    # issue 11: every separator Python's splitlines() (or a shell) splits on, and every control character
    pytest.param(["A=x\u2028CUDA_MPS_PIPE_DIRECTORY=/tmp/evil"], "$.devices[0].env[0]", id="line-separator-u2028"),
    pytest.param(["A=x\u2029y"], "$.devices[0].env[0]", id="paragraph-separator-u2029"),
    pytest.param(["A=x\x0bNVIDIA_VISIBLE_DEVICES=all"], "$.devices[0].env[0]", id="vertical-tab"),
    pytest.param(["A=x\x0cy"], "$.devices[0].env[0]", id="form-feed"),
    pytest.param(["A=x\x85BCD_ALLOCATION_ID=evil"], "$.devices[0].env[0]", id="nel-x85"),
    pytest.param(["A=x\x1cy"], "$.devices[0].env[0]", id="file-separator-x1c"),
    pytest.param(["A=x\x1ey"], "$.devices[0].env[0]", id="record-separator-x1e"),
    pytest.param(["A=x\ty"], "$.devices[0].env[0]", id="tab"),
    pytest.param(["A=x\x7fy"], "$.devices[0].env[0]", id="del"),
    pytest.param(["A=x\x9by"], "$.devices[0].env[0]", id="c1-csi"),
    pytest.param(["A=x\x1b[2Jy"], "$.devices[0].env[0]", id="escape"),
    pytest.param(["K" * 129 + "=x"], "$.devices[0].env[0]", id="key-too-long"),
    pytest.param(["A=" + "x" * 4097], "$.devices[0].env[0]", id="value-too-long"),
    pytest.param(["BCD_ALLOCATION_ID=x"], "BCD_ALLOCATION_ID is set by bcd", id="reserved-bcd-allocation-id"),
    pytest.param(["BCD_ANYTHING=x"], "BCD_ANYTHING is set by bcd", id="reserved-bcd-prefix"),
    pytest.param(["NVIDIA_VISIBLE_DEVICES=all"], "NVIDIA_VISIBLE_DEVICES is set by bcd", id="reserved-nvidia-visible"),
    pytest.param(["CUDA_MPS_PIPE_DIRECTORY=/tmp"], "CUDA_MPS_PIPE_DIRECTORY is set by bcd", id="reserved-mps-pipe"),
    pytest.param(["A=1", "B=2", "A=3"], "A is set twice", id="duplicate-key"),
    pytest.param(["A=1", "A=1"], "A is set twice", id="duplicate-line"),
    pytest.param("A=1", "$.devices[0].env", id="not-a-list"),
    pytest.param([1], "$.devices[0].env[0]", id="not-a-string"),
    pytest.param([f"K{i}=v" for i in range(MAX_ENV_LINES + 1)], "$.devices[0].env", id="too-many-lines"),
]


@pytest.mark.parametrize(("env", "text"), ENV_BAD)
def test_bad_env(env: Any, text: str) -> None:
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(json.dumps(spec_with(_a0("env", env))))
    message = str(exc.value)
    assert text in message
    if "set" in text:  # a __post_init__ rule: names the line's own path
        assert message.endswith(f"- at `$.devices[0].env[{len(env) - 1}]`"), message


def test_env_that_looks_reserved_but_is_not() -> None:
    # keys are case-sensitive (`ld_preload` steers nothing); CUDA_VISIBLE_DEVICES narrows what the container has
    env = ["bcd_lower=1", "XBCD_=1", "ld_preload=x", "XLD_PRELOAD=1", "MY_PATH=/x", "CUDA_VISIBLE_DEVICES=0", "A=commas,ünïcode,#hash,a~b,and=signs"]
    assert NODE_SPEC_CODEC.decode(json.dumps(spec_with(_a0("env", env)))).devices[0].env == env


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_an_accepted_env_value_is_one_line_for_every_reader(value: str) -> None:
    """Whatever value decodes, the env line stays one line for splitlines() and for a line reader."""
    try:
        decoded = NODE_SPEC_CODEC.decode(json.dumps(spec_with(_a0("env", [f"A={value}"]))))
    except BadMessage:
        return
    line = decoded.devices[0].env[0]
    assert line.splitlines() == [line]
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in line)


LIMITS_BAD = [
    pytest.param("memory_bytes", -1, "$.devices[0].limits.memory_bytes", id="memory-negative"),
    pytest.param("memory_bytes", "1G", "$.devices[0].limits.memory_bytes", id="memory-string"),
    pytest.param("memory_bytes", 1.5, "$.devices[0].limits.memory_bytes", id="memory-float"),
    pytest.param("cpu_millis", -1, "$.devices[0].limits.cpu_millis", id="cpu-millis-negative"),
    pytest.param(
        "hugepages",
        [{"page_size_kib": 2048, "count": -1}],
        "$.devices[0].limits.hugepages[0].count",
        id="hugepages-count-negative",
    ),
    pytest.param(
        "hugepages",
        [{"page_size_kib": 0, "count": 1}],
        "$.devices[0].limits.hugepages[0].page_size_kib",
        id="page-size-zero",
    ),
    pytest.param(
        "hugepages",
        [{"page_size_kib": -2048, "count": 1}],
        "$.devices[0].limits.hugepages[0].page_size_kib",
        id="page-size-negative",
    ),
    pytest.param("hugepages", [{"count": 1}], "page_size_kib", id="page-size-missing"),
    pytest.param(
        "hugepages",
        [{"page_size_kib": 2048, "count": 1}, {"page_size_kib": 2048, "count": 2}],
        "page_size_kib listed twice",
        id="page-size-twice",
    ),
    pytest.param(
        "hugepages", [{"page_size_kib": 4, "count": 1}] * 9, "$.devices[0].limits.hugepages", id="hugepages-too-many"
    ),
    pytest.param("cpus", "0-", "$.devices[0].limits.cpus", id="cpus-open-range"),
    pytest.param("cpus", "a", "$.devices[0].limits.cpus", id="cpus-letter"),
    pytest.param("cpus", "3-1", "cpus: range '3-1' runs backwards", id="cpus-backwards"),
    pytest.param("cpus", "0,5-2", "cpus: range '5-2' runs backwards", id="cpus-backwards-second"),
    pytest.param("cpus", "", "$.devices[0].limits.cpus", id="cpus-empty"),
    pytest.param("cpus", "0,,1", "$.devices[0].limits.cpus", id="cpus-double-comma"),
    pytest.param("cpus", "-1", "$.devices[0].limits.cpus", id="cpus-negative"),
    pytest.param("cpus", "0-3\n", "$.devices[0].limits.cpus", id="cpus-trailing-newline"),
    pytest.param("cpus", "0 -3", "$.devices[0].limits.cpus", id="cpus-space"),
    pytest.param("cpus", 3, "$.devices[0].limits.cpus", id="cpus-int"),
    pytest.param("mems", "1-0", "mems: range '1-0' runs backwards", id="mems-backwards"),
    pytest.param("mems", "x", "$.devices[0].limits.mems", id="mems-letter"),
]


@pytest.mark.parametrize(("field", "value", "text"), LIMITS_BAD)
def test_bad_limits(field: str, value: Any, text: str) -> None:
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(json.dumps(spec_with(((*LIM, field), value))))
    message = str(exc.value)
    assert text in message
    assert "$.devices[0].limits" in message


@pytest.mark.parametrize("cpus", ["0", "0-0", "0-3,8,10-11", "9999", "0,1,2"])
def test_good_cpulists(cpus: str) -> None:
    limits = NODE_SPEC_CODEC.decode(json.dumps(spec_with(((*LIM, "cpus"), cpus)))).devices[0].limits
    assert limits is not None and limits.cpus == cpus


BAD_PCI = [
    pytest.param("0000:3B:00.0", id="uppercase"),
    pytest.param("3b:00.0", id="no-domain"),
    pytest.param("0000:3b:00.8", id="function-8"),
    pytest.param("0000:3b:00", id="no-function"),
    pytest.param("0000:3b:00.0\n", id="trailing-newline"),
    pytest.param("0000:3b:00.0 ", id="trailing-space"),
    pytest.param("../../0000:3b:00.0", id="path"),
    pytest.param("", id="empty"),
    pytest.param("0000:3g:00.0", id="not-hex"),
]


@pytest.mark.parametrize("value", BAD_PCI)
def test_bad_pci_addresses(value: str) -> None:
    with pytest.raises(BadMessage, match=re.escape("`$.instances[0].gpus[0]`")):
        NODE_SPEC_CODEC.decode(json.dumps(spec_with((("instances", 0, "gpus"), [value]))))
    inv = json.loads(encode(INVENTORY))
    inv["gpus"][0]["pci_address"] = value
    with pytest.raises(BadMessage, match=re.escape("`$.gpus[0].pci_address`")):
        INVENTORY_CODEC.decode(json.dumps(inv))


_ASSIGNMENT = SPEC_DOC["devices"][1]

SPEC_BAD = [
    pytest.param(spec_with((("generation",), "1")), "`$.generation`", id="generation-string"),
    pytest.param(spec_with((("generation",), -1)), "`$.generation`", id="generation-negative"),
    pytest.param(spec_with((("generation",), 1.0)), "`$.generation`", id="generation-float"),
    pytest.param(spec_with((("generation",), None)), "`$.generation`", id="generation-null"),
    pytest.param(spec_with((("generation",), DELETE)), "required field `generation`", id="generation-missing"),
    pytest.param(spec_with((("node_id",), DELETE)), "required field `node_id`", id="node-id-missing"),
    pytest.param(spec_with((("node_id",), 7)), "`$.node_id`", id="node-id-int"),
    pytest.param(spec_with((("devices",), {})), "`$.devices`", id="devices-object"),
    pytest.param(spec_with((("devices",), "a1")), "`$.devices`", id="devices-string"),
    pytest.param(spec_with((("devices",), None)), "`$.devices`", id="devices-null"),
    pytest.param(spec_with((("devices", 1), "a2")), "`$.devices[1]`", id="assignment-not-object"),
    pytest.param(spec_with(_a0("binding", "BINDING_VM")), "`$.devices[0].binding`", id="binding-unknown"),
    pytest.param(spec_with(_a0("binding", "binding_hold")), "`$.devices[0].binding`", id="binding-lowercase"),
    pytest.param(spec_with(_a0("binding", 1)), "`$.devices[0].binding`", id="binding-int"),
    pytest.param(
        spec_with(_a0("binding", DELETE)), "required field `binding` - at `$.devices[0]`", id="binding-missing"
    ),
    pytest.param(spec_with(_a0("devices", "GPU-x")), "`$.devices[0].devices`", id="atoms-not-list"),
    pytest.param(spec_with(_a0("devices", ["GPU x"])), "`$.devices[0].devices[0]`", id="atom-space"),
    pytest.param(spec_with(_a0("devices", [""])), "`$.devices[0].devices[0]`", id="atom-empty"),
    pytest.param(spec_with(_a0("devices", ["GPU-\n"])), "`$.devices[0].devices[0]`", id="atom-newline"),
    pytest.param(spec_with(_a0("devices", ["G" * 201])), "`$.devices[0].devices[0]`", id="atom-too-long"),
    pytest.param(
        spec_with(_a0("devices", [UUID] * (MAX_DEVICES_PER_ASSIGNMENT + 1))),
        "`$.devices[0].devices`",
        id="atoms-too-many",
    ),
    pytest.param(spec_with(_a0("limits", [])), "`$.devices[0].limits`", id="limits-list"),
    pytest.param(spec_with(_a0("instance_id", "i" * 129)), "`$.devices[0].instance_id`", id="instance-id-too-long"),
    pytest.param(
        spec_with((("devices",), [_ASSIGNMENT] * (MAX_ASSIGNMENTS + 1))), "`$.devices`", id="assignments-too-many"
    ),
    pytest.param(
        spec_with((("devices", 1, "allocation_id"), "a1")),
        "devices: allocation_id a1 appears twice",
        id="duplicate-allocation",
    ),
    pytest.param(
        spec_with((("instances",), [{"instance_id": "vm", "gpus": []}, {"instance_id": "vm"}])),
        "instances: instance_id vm appears twice",
        id="duplicate-instance",
    ),
    pytest.param(spec_with((("instances",), "vm")), "`$.instances`", id="instances-string"),
    pytest.param(
        spec_with((("instances", 0, "gpus"), ["0000:3b:00.0"] * 65)), "`$.instances[0].gpus`", id="gpus-too-many"
    ),
    pytest.param([], "Expected `object`, got `array`", id="top-level-array"),
    pytest.param(None, "Expected `object`, got `null`", id="top-level-null"),
]


@pytest.mark.parametrize(("doc", "text"), SPEC_BAD)
def test_bad_node_specs(doc: Any, text: str) -> None:
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(json.dumps(doc))
    assert text in str(exc.value)


NOT_JSON = [
    pytest.param(b"{not json", id="garbage"),
    pytest.param(b"", id="empty"),
    pytest.param(b"\xff\xfe", id="not-utf8"),
    pytest.param(b'{"node_id": "n", "generation": 1', id="truncated"),
    pytest.param(b'{"node_id": "n", "generation": 1} {}', id="trailing-data"),
    pytest.param(b"'single'", id="single-quotes"),
]


@pytest.mark.parametrize("data", NOT_JSON)
def test_not_json(data: bytes) -> None:
    with pytest.raises(BadMessage, match=r"^message: not valid JSON"):
        NODE_SPEC_CODEC.decode(data)


def test_oversized_message_is_refused_before_parsing() -> None:
    codec = NODE_SPEC_CODEC
    assert codec.max_bytes == DEFAULT_MAX_BYTES
    # Not JSON at all: a parser would say "not valid JSON"; the size check comes first.
    with pytest.raises(BadMessage, match=r"^message: 1048577 bytes is larger than the 1048576-byte limit for NodeSpec"):
        codec.decode(b"{" * (codec.max_bytes + 1))


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview, str])
def test_size_limit_is_exact_for_every_input_kind(kind: Any) -> None:
    good = encode(NodeSpec(node_id="n", generation=1))
    codec: Codec[NodeSpec] = Codec(NodeSpec, max_bytes=len(good) + 10)
    padded = good + b" " * 10  # trailing whitespace is valid JSON
    as_kind = (lambda b: b.decode()) if kind is str else kind
    assert codec.decode(as_kind(padded)) == NodeSpec(node_id="n", generation=1)
    with pytest.raises(BadMessage, match=r"^message: .* larger than"):
        codec.decode(as_kind(padded + b" "))


def test_size_limit_counts_encoded_bytes_not_characters() -> None:
    text = '{"éé":1}'
    codec: Codec[Empty] = Codec(Empty, max_bytes=len(text))
    assert len(text.encode()) == len(text) + 2
    with pytest.raises(BadMessage, match=rf"^message: {len(text) + 2} bytes"):
        codec.decode(text)


@pytest.mark.parametrize(
    ("codec", "limit"),
    [
        (NODE_SPEC_CODEC, DEFAULT_MAX_BYTES),
        (SIGNED_NODE_SPEC_CODEC, 2 * DEFAULT_MAX_BYTES),
        (INVENTORY_CODEC, 4 * DEFAULT_MAX_BYTES),
        (HELLO_CODEC, 64 * 1024),
        (REPORT_BODY_CODEC, 256 * 1024),
        (ATTESTED_REPORT_CODEC, 512 * 1024),
        (NODE_EVENT_CODEC, 256 * 1024),
        (SIGN_REQUEST_CODEC, 256 * 1024),
        (SIGN_BATCH_REQUEST_CODEC, 1024 * 1024),
        (SIGN_BATCH_REPLY_CODEC, 1024 * 1024),
        (SIGNER_KEY_CODEC, 4096),
        (EMPTY_CODEC, 4096),
    ],
    ids=lambda v: _codec_name(v) if isinstance(v, Codec) else str(v),
)
def test_every_codec_refuses_oversize(codec: Codec[Any], limit: int) -> None:
    assert codec.max_bytes == limit
    with pytest.raises(BadMessage, match=r"^message: "):
        codec.decode(b" " * (limit + 1))


def test_signed_spec_envelope_holds_a_full_size_spec() -> None:
    """base64 grows a spec by 4/3, so the envelope's limit must exceed the spec's."""
    assert SIGNED_NODE_SPEC_CODEC.max_bytes >= NODE_SPEC_CODEC.max_bytes * 4 // 3 + 1024


OTHER_BAD = [
    pytest.param(SIGNED_NODE_SPEC_CODEC, {"spec": "!!!not base64"}, "`$.spec`", id="signed-spec-not-base64"),
    pytest.param(SIGNED_NODE_SPEC_CODEC, {"spec": "", "key_id": "k" * 65}, "`$.key_id`", id="signed-spec-key-id-long"),
    pytest.param(SIGNED_NODE_SPEC_CODEC, {"key_id": ""}, "required field `spec`", id="signed-spec-missing-spec"),
    pytest.param(
        ATTESTED_REPORT_CODEC,
        {"purpose": "node-spec", "key_id": KEY_ID, "body": "", "signature": ""},
        "`$.purpose`",
        id="report-wrong-purpose",
    ),
    pytest.param(
        ATTESTED_REPORT_CODEC,
        {"key_id": "0123456789ABCDEF", "body": "", "signature": ""},
        "`$.key_id`",
        id="report-key-id-upper",
    ),
    pytest.param(
        ATTESTED_REPORT_CODEC,
        {"key_id": KEY_ID + "\n", "body": "", "signature": ""},
        "`$.key_id`",
        id="report-key-id-newline",
    ),
    pytest.param(
        ATTESTED_REPORT_CODEC, {"key_id": KEY_ID, "body": 5, "signature": ""}, "`$.body`", id="report-body-int"
    ),
    pytest.param(REPORT_BODY_CODEC, {**json.loads(encode(BODY)), "node_id": "a/b"}, "`$.node_id`", id="body-node-id"),
    pytest.param(
        REPORT_BODY_CODEC, {**json.loads(encode(BODY)), "event_id": "E\n"}, "`$.event_id`", id="body-event-id"
    ),
    pytest.param(REPORT_BODY_CODEC, {**json.loads(encode(BODY)), "time": "yesterday"}, "`$.time`", id="body-time"),
    pytest.param(NODE_EVENT_CODEC, {**json.loads(encode(FAILED)), "reason": "bored"}, "`$.reason`", id="failed-reason"),
    pytest.param(NODE_EVENT_CODEC, {**json.loads(encode(SECTION)), "state": "DONE"}, "`$.state`", id="section-state"),
    pytest.param(
        NODE_EVENT_CODEC,
        {**json.loads(encode(BOUND)), "devices": [UUID] * 65},
        "`$.devices`",
        id="bound-devices-too-many",
    ),
    pytest.param(
        NODE_EVENT_CODEC,
        {**json.loads(encode(BOUND)), "allocation_id": "../x"},
        "`$.allocation_id`",
        id="bound-allocation-id",
    ),
    pytest.param(
        HELLO_CODEC,
        {**json.loads(encode(SAMPLES[4][2])), "public_key": "%%"},
        "`$.public_key`",
        id="hello-key-not-base64",
    ),
    pytest.param(HELLO_CODEC, {**json.loads(encode(SAMPLES[4][2])), "node_id": "N"}, "`$.node_id`", id="hello-node-id"),
    pytest.param(
        INVENTORY_CODEC, {**json.loads(encode(INVENTORY)), "revision": -1}, "`$.revision`", id="inventory-revision"
    ),
    pytest.param(
        INVENTORY_CODEC,
        {
            **json.loads(encode(INVENTORY)),
            "atoms": [{"id": "x", "kind": "nic", "gpu_uuid": "u", "pci_address": "0000:3b:00.0"}],
        },
        "`$.atoms[0].kind`",
        id="inventory-atom-kind",
    ),
    pytest.param(
        INVENTORY_CODEC,
        {**json.loads(encode(INVENTORY)), "host": {"cpus": "0-"}},
        "`$.host.cpus`",
        id="inventory-host-cpus",
    ),
    pytest.param(
        SIGN_REQUEST_CODEC,
        {"purpose": "p" * 65, "event_id": "e", "event": json.loads(encode(BOUND))},
        "`$.purpose`",
        id="sign-request-purpose-long",
    ),
    pytest.param(
        SIGN_BATCH_REQUEST_CODEC,
        {"purpose": "attested-report", "items": [{"event_id": "e", "event": json.loads(encode(BOUND))}] * 257},
        "`$.items`",
        id="sign-batch-too-many",
    ),
]


@pytest.mark.parametrize(("codec", "doc", "text"), OTHER_BAD)
def test_bad_other_messages(codec: Codec[Any], doc: dict[str, Any], text: str) -> None:
    with pytest.raises(BadMessage) as exc:
        codec.decode(json.dumps(doc))
    assert text in str(exc.value)


def test_bad_message_is_a_value_error_without_a_chained_traceback() -> None:
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(b"[]")
    assert isinstance(exc.value, ValueError)
    assert exc.value.__suppress_context__


# --- properties ----------------------------------------------------------------

_ids = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,62}", fullmatch=True)
_atoms = st.one_of(
    st.uuids().map(lambda u: f"GPU-{u}"),
    st.tuples(st.uuids(), st.integers(0, 15), st.integers(0, 15)).map(lambda t: f"GPU-{t[0]}/gi{t[1]}/ci{t[2]}"),
    st.tuples(st.uuids(), st.integers(0, 63)).map(lambda t: f"GPU-{t[0]}/slot{t[1]}"),
    st.from_regex(r"[!-~]{1,200}", fullmatch=True),
)


@st.composite
def _cpulists(draw: st.DrawFn) -> str:
    parts = []
    for lo, span in draw(
        st.lists(st.tuples(st.integers(0, 9999), st.none() | st.integers(0, 50)), min_size=1, max_size=8)
    ):
        parts.append(str(lo) if span is None else f"{lo}-{min(lo + span, 9999)}")
    return ",".join(parts)


_env_keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True).filter(lambda k: not env_key_problem(k))
_env_values = st.text(
    st.characters(codec="utf-8", exclude_categories=("Cc", "Zl", "Zp")),  # no control character, no line/paragraph separator
    max_size=40,
).filter(lambda v: not env_value_problem(v))  # what every reader of the env file reads alike
_envs = st.lists(st.tuples(_env_keys, _env_values), max_size=6, unique_by=lambda kv: kv[0]).map(
    lambda kvs: [f"{k}={v}" for k, v in kvs]
)
_limits = st.builds(
    Limits,
    cpus=st.none() | _cpulists(),
    # the contract's ranges (shared.schemas.common): the largest values a spec may carry included
    cpu_millis=st.none() | st.integers(0, LIMITS_MAX_CPU_MILLIS),
    memory_bytes=st.none() | st.integers(0, LIMITS_MAX_MEMORY_BYTES),
    hugepages=st.lists(
        st.builds(HugePages, page_size_kib=st.sampled_from([4, 2048, 1 << 20]), count=st.integers(0, 1 << 20)),
        max_size=3,
        unique_by=lambda h: h.page_size_kib,
    ),
    mems=st.none() | _cpulists(),
)
_assignments = st.builds(
    DeviceAssignment,
    allocation_id=_ids,
    reservation_id=_ids,
    binding=st.sampled_from(["BINDING_UNSPECIFIED", "BINDING_HOLD", "BINDING_KUBERNETES", "BINDING_INSTANCE"]),
    instance_id=st.text(max_size=20),
    devices=st.lists(_atoms, max_size=5),
    limits=st.none() | _limits,
    env=_envs,
)
_pci = st.from_regex(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", fullmatch=True)
node_specs = st.builds(
    NodeSpec,
    node_id=_ids,
    generation=st.integers(0, 2**63 - 1),
    devices=st.lists(_assignments, max_size=4, unique_by=lambda a: a.allocation_id),
    instances=st.lists(
        st.builds(InstanceGpus, instance_id=_ids, gpus=st.lists(_pci, max_size=3)),
        max_size=3,
        unique_by=lambda i: i.instance_id,
    ),
)


@settings(max_examples=60, deadline=None)
@given(node_specs)
def test_any_valid_node_spec_round_trips(spec: NodeSpec) -> None:
    data = encode(spec)
    assert NODE_SPEC_CODEC.decode(data) == spec
    # the same spec, re-validated by a decoder, is what a signer would sign: bytes are stable
    assert encode(NODE_SPEC_CODEC.decode(data)) == data


def _accepted_as_id(value: str) -> bool:
    try:
        msgspec.convert(value, Id)
    except msgspec.ValidationError:
        return False
    return True


_id_candidates = st.one_of(
    st.from_regex(ID_RE),  # what the pattern accepts, as hypothesis reads it
    st.from_regex(r"[a-zA-Z0-9_./\n-]{0,70}\n?", fullmatch=True),  # near misses
    st.text(max_size=80),
)


@settings(max_examples=300, deadline=None)
@given(_id_candidates)
def test_id_pattern_accepts_only_safe_tokens(value: str) -> None:
    accepted = _accepted_as_id(value)
    assert accepted == (ID_RE.search(value) is not None)
    assert accepted == (re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", value) is not None)
    if accepted:
        assert "/" not in value
        assert "\n" not in value
        assert 1 <= len(value) <= 63
        assert value not in {".", ".."}
