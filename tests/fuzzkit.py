"""What the fuzz suites throw at bcd's boundaries (issue 11: "Nothing from outside stops the node").

Shared by tests/unit/test_fuzz_decoders.py (every decoder, in process) and
tests/integration/test_fuzz_node.py (every endpoint and the spec bucket of a
running node):

- `CODECS`: every module-level `*_CODEC` of shared.schemas, found by name, so a
  codec added later is fuzzed without touching the suites;
- `SAMPLES`: one valid instance per codec (from the project's examples where
  there is one: examples/specs/demo.json is the NodeSpec), the seed of the
  mutations; a codec without a sample here falls back to decoding `{}`;
- hypothesis strategies for arbitrary JSON (unicode, control characters, lone
  surrogates, huge numbers), arbitrary bytes, objects shaped like a type (its
  field names, garbage values) and one-field mutations of a valid message;
- deep (thousands of levels) and oversized bodies, built as bytes directly:
  Python's own json module cannot even write a value 20,000 levels deep.
"""

from __future__ import annotations

import copy
import json
import typing
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from shared.signing import Ed25519PrivateKey
from hypothesis import strategies as st

import shared.schemas as schemas
from shared.holdfiles import HoldContent, HoldDevice, hold_to_wire, limits_to_wire
from shared.schemas import (
    AllocationBound,
    ClaimDevice,
    ClaimPrepareReply,
    ClaimPrepareRequest,
    ClaimUnprepareReply,
    ClaimUnprepareRequest,
    DraClaimStatus,
    DraPluginStatus,
    MigInstanceReply,
    MigInstanceRequest,
    PreparedDevice,
    Atom,
    Claims,
    Codec,
    Condition,
    ConvergerStatus,
    DevicesQuery,
    DriverBinding,
    Empty,
    AdvertisedHold,
    DevicePluginStatus,
    DiagReply,
    DiagRequest,
    MigLayoutReply,
    MigLayoutRequest,
    GpuOp,
    GpuOpReply,
    GpuOpRequest,
    EvictReply,
    PluginResource,
    WithdrawReply,
    Freed,
    Gpu,
    GpuChanged,
    GpuClaim,
    GpuReply,
    GpuRequest,
    HeldReply,
    Hello,
    HelperFileCopy,
    HelperFileRemove,
    HelperFileWrite,
    HelperInfo,
    HelperReply,
    HelperSliceApply,
    HelperSliceRemove,
    HolderQuery,
    HolderReply,
    HoldSummary,
    HostResources,
    HugePagePool,
    Inventory,
    Limits,
    MigInstance,
    MigProfile,
    NumaNode,
    OrphanQuery,
    OrphanReply,
    NodeChange,
    NodeReply,
    NodeTaint,
    NodeView,
    PhysicalGPUStatus,
    ReportBody,
    RunningProcess,
    SectionStatus,
    SignBatchReply,
    SignBatchRequest,
    SignerKey,
    SignItem,
    SignRequest,
    Slot,
    SpecAck,
    SwitchReply,
    SwitchRequest,
    encode,
)
from shared.schemas.bus import MpsDaemonSpec, SharingStepReply, SharingStepRequest
from shared.signing import key_id, sign_node_spec, sign_report
from shared.slices import slice_name

REPO = Path(__file__).resolve().parents[1]
DEMO_SPEC_FILE = REPO / "examples" / "specs" / "demo.json"
EXAMPLE_HOST_FILE = REPO / "examples" / "hosts" / "h200x8.json"

# --------------------------------------------------------------------------- the codecs


def module_codecs() -> dict[str, Codec[Any]]:
    """Every `<NAME>_CODEC` of shared.schemas (a new codec is fuzzed without editing the suites)."""
    return {name: value for name, value in sorted(vars(schemas).items()) if name.endswith("_CODEC") and isinstance(value, Codec)}


CODECS: dict[str, Codec[Any]] = module_codecs()


def codec_types(codec: Codec[Any]) -> tuple[type, ...]:
    """The classes a successful decode may return (the members of a union such as NodeEvent)."""
    args = typing.get_args(codec.type)
    return tuple(args) if args else (codec.type,)


def struct_fields(tp: Any) -> list[str]:
    """Field names (and the tag field) of a Struct or of every member of a union of Structs."""
    names: list[str] = []
    for member in typing.get_args(tp) or (tp,):
        if isinstance(member, type) and issubclass(member, msgspec.Struct):
            names.extend(f.encode_name for f in msgspec.structs.fields(member))
            cfg = member.__struct_config__
            if cfg.tag_field:
                names.append(cfg.tag_field)
    return sorted(set(names))


def tag_values(tp: Any) -> list[str]:
    out = []
    for member in typing.get_args(tp) or (tp,):
        if isinstance(member, type) and issubclass(member, msgspec.Struct) and member.__struct_config__.tag:
            out.append(member.__struct_config__.tag)
    return out


# --------------------------------------------------------------------------- valid samples

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
#: deterministic keys (the fuzz needs valid signatures, not secret ones)
NODE_KEY = Ed25519PrivateKey(bytes(range(32)))
CP_KEY = Ed25519PrivateKey(bytes(range(32, 64)))
UUID = "GPU-5f1c2a90-0000-4000-8000-000000000001"
PCI = "0000:18:00.0"
CLAIM_UID = "0b6f4a39-1c1e-4d6b-9a53-0123456789ab"
SLICE = slice_name("train-01")


def demo_spec_doc(generation: int = 7) -> dict[str, Any]:
    doc = json.loads(DEMO_SPEC_FILE.read_text())
    doc["generation"] = generation
    return doc


SPEC = schemas.NODE_SPEC_CODEC.decode(json.dumps(demo_spec_doc()).encode())
BOUND = AllocationBound(
    allocation_id="train-01",
    reservation_id="rsv-train-01",
    generation=7,
    devices=[UUID],
    cgroup_parent=SLICE,
    cdi_devices=[f"bcd.dev/gpu={UUID}"],
)
SECTION = SectionStatus(section="devices", state="FAILED", observed_generation=7, message="3 of 6 assignments failed")
BODY = ReportBody(node_id="node-1", boot_id="boot-1", event_id="ev:bound:1", time=T0, event=BOUND)
CONDITION = Condition(type="Ready", status="True", reason="Scanned", message="ok", since=T0)
GPU_STATUS = PhysicalGPUStatus(
    phase="Ready", driver_binding=DriverBinding(driver="nvidia", mode="Compute", management_state="Managed"), conditions=[CONDITION]
)
GPU = Gpu(
    atom_id=UUID,
    uuid=UUID,
    index=0,
    pci_address=PCI,
    name="NVIDIA H200",
    vendor="nvidia",
    memory_bytes=150754820096,
    numa_node=0,
    driver="nvidia",
    base_driver="nvidia",
    compute_capability="9.0",
    mig_mode=True,
    mig_profiles=[MigProfile(name="1g.18gb", profile_id=19, slices=1, memory_bytes=18 << 30, instances_max=7)],
    mig_instances=[MigInstance(atom_id=f"{UUID}/gi1/ci0", uuid="MIG-1", gi=1, ci=0, profile="1g.18gb")],
    slots=[Slot(atom_id=f"{UUID}/slot0", index=0)],
    status=GPU_STATUS,
)
INVENTORY = Inventory(
    node_id="node-1",
    revision=3,
    observed_at=T0,
    vendor="nvidia",
    adapter="fakehw",
    driver_version="570.86.15",
    boot_id="boot-1",
    gpus=[GPU],
    atoms=[Atom(id=UUID, kind="gpu", gpu_uuid=UUID, pci_address=PCI), Atom(id=f"{UUID}/gi1/ci0", kind="mig", gpu_uuid=UUID, pci_address=PCI)],
    host=HostResources(
        memory_bytes=1 << 41,
        memory_available_bytes=1 << 40,
        cpus="0-223",
        numa_nodes=[NumaNode(node=0, cpus="0-111", memory_bytes=1 << 40, hugepages=[HugePagePool(page_size_kib=2048, total=64, free=60)])],
        hugepages=[HugePagePool(page_size_kib=2048, total=64, free=60)],
    ),
    mps_pipe_dir="/tmp/nvidia-mps",
    processes=[RunningProcess(pid=4242, gpu_uuid=UUID, cgroup="/kubepods/burstable/pod1/c1")],
)
HOLD = HoldContent(
    allocation_id="train-01",
    reservation_id="rsv-train-01",
    generation=7,
    binding="BINDING_HOLD",
    devices=(HoldDevice.for_gpu(UUID, 0),),
    cgroup_parent=SLICE,
    env=("JOB_NAME=train-01",),
    limits=Limits(cpus="0-15", cpu_millis=16000, memory_bytes=1 << 37, mems="0"),
)
HOLD_LIMITS = HOLD.limits
assert HOLD_LIMITS is not None

#: one valid value per codec name; the mutations start from these.
SAMPLES: dict[str, object] = {
    "NODE_SPEC_CODEC": SPEC,
    "SIGNED_NODE_SPEC_CODEC": sign_node_spec(CP_KEY, SPEC),
    "INVENTORY_CODEC": INVENTORY,
    "HELLO_CODEC": Hello(
        node_id="node-1", boot_id="boot-1", public_key=b"k" * 32, key_id=key_id(NODE_KEY), capabilities=["cdi", "devices.limits"], agent_version="0.1.0", started_at=T0
    ),
    "REPORT_BODY_CODEC": BODY,
    "ATTESTED_REPORT_CODEC": sign_report(NODE_KEY, BODY),
    "NODE_EVENT_CODEC": BOUND,
    "SIGN_REQUEST_CODEC": SignRequest(purpose="attested-report", event_id="ev:bound:1", event=BOUND),
    "SIGN_BATCH_REQUEST_CODEC": SignBatchRequest(purpose="attested-report", items=[SignItem(event_id="ev:bound:1", event=BOUND)]),
    "SIGN_BATCH_REPLY_CODEC": SignBatchReply(reports=[sign_report(NODE_KEY, BODY)]),
    "SIGNER_KEY_CODEC": SignerKey(node_id="node-1", public_key=b"k" * 32, key_id=key_id(NODE_KEY), boot_id="boot-1"),
    "EMPTY_CODEC": Empty(),
    "SPEC_ACK_CODEC": SpecAck(generation=7, changed=True),
    "CONVERGER_STATUS_CODEC": ConvergerStatus(
        generation=7,
        section=SECTION,
        holds=[HoldSummary(allocation_id="train-01", reservation_id="rsv-train-01", generation=7, binding="BINDING_HOLD", devices=[UUID], cgroup_parent=SLICE)],
        failures={"too-big": "resources-exhausted: memory"},
        last_pass_at=T0,
        next_retry_in_s=4.5,
        bindings=["BINDING_HOLD", "BINDING_KUBERNETES"],
        vendor_cdi_spec="/etc/cdi/nvidia.json",
    ),
    "HOLDER_QUERY_CODEC": HolderQuery(gpu=PCI),
    "HOLDER_REPLY_CODEC": HolderReply(held=True, kind="allocation", holder="train-01", gpu=PCI),
    "DEVICES_QUERY_CODEC": DevicesQuery(allocation_id="train-01", devices=[UUID, f"{UUID}/slot0"]),
    "HELD_REPLY_CODEC": HeldReply(held=True, reachable=True, holders=["default/pod-1"], detail="1 holder"),
    "EVICT_REPLY_CODEC": EvictReply(evicting=["default/pod-1"], errors=["no evictor configured"]),
    "DEVICE_PLUGIN_STATUS_CODEC": DevicePluginStatus(
        kubelet_socket="/var/lib/kubelet/device-plugins/kubelet.sock",
        kubelet_present=True,
        registered=True,
        resources=[PluginResource(name="bcd.dev/gpu", endpoint="bcd-gpu.sock", registered=True, devices=1, healthy=1, streams=1)],
        holds=[AdvertisedHold(allocation_id="k1", advertised=True, devices=["GPU-5f1c2a90-0000-4000-8000-000000000001"], resources=["bcd.dev/gpu"])],
        allocations=2,
    ),
    "WITHDRAW_REPLY_CODEC": WithdrawReply(withdrawn=["GPU-5f1c2a90-0000-4000-8000-000000000001"], streams=1),
    "FREED_CODEC": Freed(allocation_id="train-01", devices=[UUID]),
    "ORPHAN_QUERY_CODEC": OrphanQuery(known_devices=[UUID, f"{UUID}/gi1/ci0"]),
    "ORPHAN_REPLY_CODEC": OrphanReply(reachable=True, orphans=[f"default/pod-1: {UUID}"]),
    "NODE_REQUEST_CODEC": NodeChange(
        resource_version="4711",
        labels={"nvidia.com/mig.config.state": "pending", "nvidia.com/gpu.deploy.device-plugin": "paused-for-mig-change", "nvidia.com/mig.config": None},
        annotations={"bcd.dev/mig.config.message": "re-layout to all-1g.18gb: draining"},
        relayout_taint=True,
        unschedulable=True,
    ),
    "NODE_REPLY_CODEC": NodeReply(
        ok=True,
        node=NodeView(
            name="node-1",
            resource_version="4712",
            labels={"nvidia.com/mig.config": "all-1g.18gb", "nvidia.com/mig.config.state": "pending"},
            annotations={"bcd.dev/mig.config.message": "draining"},
            taints=[NodeTaint(key="mig-reconfigure", value="true", effect="NoSchedule")],
            unschedulable=True,
        ),
    ),
    "SWITCH_REQUEST_CODEC": SwitchRequest(pci=PCI, target="vfio-pci", why="fuzz"),
    "SWITCH_REPLY_CODEC": SwitchReply(pci=PCI, target="vfio-pci", outcome="Refused", reason="Held", message="held by train-01", holder="train-01", at=T0),
    "CLAIMS_CODEC": Claims(claims=[GpuClaim(pci_address=PCI, kind="allocation", holder="train-01")], vfio=["0000:3b:00.0"], generation=7, at=T0),
    "GPU_REQUEST_CODEC": GpuRequest(action="exclude", pci=PCI),
    "GPU_OP_REQUEST_CODEC": GpuOpRequest(op="diag", pci=PCI, level=2),
    "GPU_OP_REPLY_CODEC": GpuOpReply(
        accepted=True,
        message="diag of 0000:3b:00.0 started",
        op=GpuOp(id="diag-1", op="diag", pci=PCI, level=2, started_at=datetime(2026, 12, 1, tzinfo=UTC), boot_id="boot-1"),
    ),
    "DIAG_REQUEST_CODEC": DiagRequest(pci=PCI, level=3),
    "MIG_LAYOUT_REQUEST_CODEC": MigLayoutRequest(pci=PCI, profiles=["1g.18gb", "3g.71gb"], op_id="mig-layout-1"),
    "MIG_LAYOUT_REPLY_CODEC": MigLayoutReply(pci=PCI, outcome="Failed", message="NVML failed", left="rolled back"),
    "DIAG_REPLY_CODEC": DiagReply(pci=PCI, level=3, outcome="Failed", message="1 test failed", failures=["Memory: ECC"]),
    "GPU_REPLY_CODEC": GpuReply(pci=PCI, action="exclude", accepted=True, message="excluded", gpu=GPU),
    "GPU_CHANGED_CODEC": GpuChanged(pci_address=PCI, uuid=UUID, phase="Ready", management_state="Managed", status=GPU_STATUS, reason="", message=""),
    "HELPER_FILE_WRITE_CODEC": HelperFileWrite(kind="cdi", hold=hold_to_wire(HOLD)),
    "HELPER_FILE_REMOVE_CODEC": HelperFileRemove(kind="allocation-env", allocation_id="train-01", temp_pid=1234),
    "HELPER_FILE_COPY_CODEC": HelperFileCopy(allocation_id="train-01"),
    "HELPER_SLICE_APPLY_CODEC": HelperSliceApply(allocation_id="train-01", limits=limits_to_wire(HOLD_LIMITS)),
    "HELPER_SLICE_REMOVE_CODEC": HelperSliceRemove(allocation_id="train-01"),
    "HELPER_REPLY_CODEC": HelperReply(ok=True, outcome="done", changed=True, path="/etc/cdi/bcd-train-01.json"),
    "MIG_INSTANCE_REQUEST_CODEC": MigInstanceRequest(step="create-gi", pci=PCI, profile="3g.71gb", start=4, owner=CLAIM_UID),
    "MIG_INSTANCE_REPLY_CODEC": MigInstanceReply(pci=PCI, step="create-ci", outcome="done", gi=2, ci=0, uuid="MIG-8d8f1a44-0000-4000-8000-000000000002"),
    "CLAIM_PREPARE_REQUEST_CODEC": ClaimPrepareRequest(
        uid=CLAIM_UID,
        namespace="ml",
        name="train-gpu",
        devices=[ClaimDevice(requests=["gpu"], pool="node-1", device="gpu-6-mig-3g-71gb-4", pci=PCI, kind="mig", profile="3g.71gb", start=4)],
    ),
    "CLAIM_PREPARE_REPLY_CODEC": ClaimPrepareReply(
        uid=CLAIM_UID, ok=True, devices=[PreparedDevice(requests=["gpu"], pool="node-1", device="gpu-0", atom=UUID, cdi_ids=[f"bcd.dev/gpu={UUID}"])]
    ),
    "CLAIM_UNPREPARE_REQUEST_CODEC": ClaimUnprepareRequest(uid=CLAIM_UID),
    "CLAIM_UNPREPARE_REPLY_CODEC": ClaimUnprepareReply(uid=CLAIM_UID, ok=False, message="in-use: a process uses it"),
    "DRA_PLUGIN_STATUS_CODEC": DraPluginStatus(
        driver="gpu.bcd.dev",
        node_name="node-1",
        registered=True,
        pool_generation=3,
        slices=2,
        devices=9,
        cards=[PCI],
        left_out=["0000:db:00.0 gpu-7: a GPU instance no claim owns"],
        claims=[DraClaimStatus(uid=CLAIM_UID, namespace="ml", name="train-gpu", state="PrepareCompleted", since=T0)],
    ),
    "SHARING_STEP_REQUEST_CODEC": SharingStepRequest(
        step="mps-start",
        owner=CLAIM_UID,
        mps=MpsDaemonSpec(control=f"{CLAIM_UID}-0a1b2c", uuids=[UUID], active_thread_percentage=50, pinned_memory={UUID: 1 << 30}),
    ),
    "SHARING_STEP_REPLY_CODEC": SharingStepReply(step="mps-list", outcome="done", controls=[f"{CLAIM_UID}-0a1b2c"]),
    "HELPER_INFO_CODEC": HelperInfo(cdi_dir="/etc/cdi", run_dir="/run/bcd", slices="fake", mps_pipe_dir="/tmp/nvidia-mps", euid=0, version="0.1.0"),
}


def sample_for(name: str) -> object:
    """The valid sample of a codec; `{}` decoded when the table has none (a new codec whose fields all default)."""
    if name in SAMPLES:
        return SAMPLES[name]
    try:
        return CODECS[name].decode(b"{}")
    except schemas.BadMessage:
        raise AssertionError(f"{name} has no valid sample in tests/fuzzkit.py SAMPLES: add one so its mutations are fuzzed") from None


def sample_doc(name: str) -> Any:
    """The sample as plain JSON values (bytes as base64, datetimes as text)."""
    return json.loads(encode(sample_for(name)))


# --------------------------------------------------------------------------- raw JSON pieces


@dataclass(frozen=True)
class Raw:
    """JSON text put into a document as it is: a value Python's json cannot write (20,000 levels, 1e999999)."""

    text: bytes
    what: str

    def __repr__(self) -> str:
        return f"Raw({self.what}, {len(self.text)} bytes)"


def deep_array(depth: int, leaf: bytes = b"1") -> bytes:
    return b"[" * depth + leaf + b"]" * depth


def deep_object(depth: int, key: bytes = b"a", leaf: bytes = b"1") -> bytes:
    return b'{"' + key + b'":' + (b'{"' + key + b'":') * (depth - 1) + leaf + b"}" * depth


def deep_mixed(depth: int) -> bytes:
    """Alternating objects and arrays: {"a":[{"a":[ ... 1 ... ]}]}."""
    half = depth // 2
    return b'{"a":[' * half + b"1" + b"]}" * half


DEEP_DEPTHS = (1_000, 20_000)
#: what a field may be replaced with that Python's json cannot write.
RAW_VALUES: tuple[Raw, ...] = (
    Raw(deep_array(5_000), "array 5,000 deep"),
    Raw(deep_object(5_000), "object 5,000 deep"),
    Raw(deep_mixed(5_000), "objects and arrays 5,000 deep"),
    Raw(b"1" + b"0" * 5000, "integer of 5,001 digits"),
    Raw(b"1e999999", "1e999999"),
    Raw(b"-1e-999999", "-1e-999999"),
    Raw(b"NaN", "NaN"),
    Raw(b"-Infinity", "-Infinity"),
    Raw(b'"\\ud800"', "lone surrogate escape"),
    Raw(b'"\\u0000\\u001f\\u2028\\u0085\\u000b"', "control and separator escapes"),
    Raw(b'"\xff\xfe"', "invalid UTF-8 in a string"),
    Raw(b"18446744073709551616", "2**64"),
    Raw(b"-9223372036854775809", "-2**63 - 1"),
)
MARKER = "\x00__bcd_fuzz_raw__"


def with_raw(doc: Any, raws: list[Raw]) -> bytes:
    """Encode `doc`, whose `MARKER<i>` strings stand for raws[i]."""
    data = json.dumps(doc, ensure_ascii=True).encode()
    for i, raw in enumerate(raws):
        data = data.replace(json.dumps(f"{MARKER}{i}").encode(), raw.text, 1)
    return data


def deep_bodies(name: str) -> list[tuple[str, bytes]]:
    """Deep bodies for one codec: bare, and at each top-level field and as an unknown field of its valid sample."""
    return deep_bodies_of(sample_doc(name))


def deep_bodies_of(doc: Any) -> list[tuple[str, bytes]]:
    """Deep bodies: bare, and at each top-level field and as an unknown field of a valid document."""
    out: list[tuple[str, bytes]] = []
    for depth in DEEP_DEPTHS:
        out += [
            (f"array {depth} deep", deep_array(depth)),
            (f"object {depth} deep", deep_object(depth)),
            (f"mixed {depth} deep", deep_mixed(depth)),
            (f"unclosed array {depth} deep", b"[" * depth),
            (f"unclosed object {depth} deep", b'{"a":' * depth),
        ]
    deep = Raw(deep_object(20_000, key=b"x"), "object 20,000 deep")
    if isinstance(doc, dict):
        for field_name in list(doc) + ["zz_unknown_field"]:
            mutated = dict(doc)
            mutated[field_name] = f"{MARKER}0"
            out.append((f"valid sample, {field_name} 20,000 deep", with_raw(mutated, [deep])))
        out.append(("issue 11 envelope: x 20,000 deep", b'{"x":' + deep_object(20_000) + b',"spec":"","key_id":"","signature":""}'))
    return out


def oversized_bodies(codec: Codec[Any], cap: int | None = None) -> list[tuple[str, bytes]]:
    """Bodies just over the codec's limit (or `cap`, what the bus carries), and huge within it."""
    limit = codec.max_bytes if cap is None else min(codec.max_bytes, cap)
    out = [
        (f"{limit + 1} bytes of whitespace around {{}}", b"{" + b" " * (limit - 1) + b"}"),
        (f"string of {limit} bytes", b'"' + b"A" * (limit - 2) + b'"'),
        ("many keys", b"{" + b",".join(b'"k%d":%d' % (i, i) for i in range(min(limit // 16, 50_000))) + b"}"),
        ("long array", b"[" + b"0," * (min(limit, 400_000) // 2 - 2) + b"0]"),
    ]
    if cap is None:
        out.append((f"{limit + 1} bytes (one over the limit)", b" " * (limit - 1) + b"{}"))
    return [(what, body) for what, body in out if cap is None or len(body) <= cap]


# --------------------------------------------------------------------------- strategies

#: every code point, control characters and lone surrogates included.
ANY_CHAR = st.characters(codec=None, exclude_categories=()) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
TEXT = st.one_of(
    st.text(ANY_CHAR, max_size=40),
    st.sampled_from(["", "\x00", "\n", "\r\n", "\u2028", "\u2029", "\x85", "\x0b", "../../etc/passwd", "bcd-x.json", "$(id)", "GPU-", "node-1", "BINDING_HOLD", "attested-report"]),
    st.text(st.sampled_from("0123456789abcdefGPU-/:.,=_"), max_size=70),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    TEXT,
)


def json_values(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    return st.recursive(SCALARS, lambda children: st.lists(children, max_size=6) | st.dictionaries(TEXT, children, max_size=6), max_leaves=max_leaves)


@st.composite
def json_bytes(draw: st.DrawFn, values: st.SearchStrategy[Any] | None = None) -> bytes:
    """A value as JSON text: ASCII-escaped, or raw UTF-8 (lone surrogates written as their raw bytes)."""
    value = draw(values if values is not None else json_values())
    if draw(st.booleans()):
        return json.dumps(value, ensure_ascii=True).encode()
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def shaped_objects(tp: Any) -> st.SearchStrategy[bytes]:
    """Objects with the type's own field names (and tag values) and garbage values: they get past "expected an object"."""
    names = struct_fields(tp)
    tags = tag_values(tp)
    keys = st.sampled_from(names) | TEXT if names else TEXT
    values = json_values(6) | (st.sampled_from(tags) if tags else st.nothing())
    # pairs, not st.dictionaries: a few field names drawn as unique keys means many rejected draws
    pairs = st.lists(st.tuples(keys, values), max_size=max(4, len(names) + 2))
    return json_bytes(pairs.map(dict))


WRONG_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1.5, -0.0, 1e308, 2**63, -(2**63), 2**64 + 1,
    "", "x", "\x00", "\u2028", "a\nb", [], [None], [[]], {}, {"a": 1}, {"": None},
)  # fmt: skip


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def mutations(name: str) -> st.SearchStrategy[bytes]:
    """The codec's valid sample with one change (see `doc_mutations`)."""
    return doc_mutations(sample_doc(name))


@st.composite
def doc_mutations(draw: st.DrawFn, valid: Any) -> bytes:
    """A valid JSON document with one change: a value of the wrong type, a huge or hostile
    string, a deep or unwritable value, a key deleted, a duplicate or unknown key added."""
    doc = copy.deepcopy(valid)
    path = draw(st.sampled_from(_paths(doc)))
    raws: list[Raw] = []
    kind = draw(st.sampled_from(["wrong", "json", "huge", "raw", "delete", "unknown", "duplicate"]))

    def replacement() -> Any:
        if kind == "wrong":
            return draw(st.sampled_from(WRONG_VALUES))
        if kind == "json":
            return draw(json_values(10))
        if kind == "huge":
            size = draw(st.sampled_from([257, 4097, 70_000]))
            return draw(st.sampled_from(["A", "\x00", "\u2028", "é"])) * size
        raw = draw(st.sampled_from(RAW_VALUES))
        raws.append(raw)
        return f"{MARKER}{len(raws) - 1}"

    if kind in ("delete", "unknown", "duplicate"):
        target = _get(doc, path)
        if kind == "delete" and path:
            parent = _get(doc, path[:-1])
            del parent[path[-1]]
        elif isinstance(target, dict) and kind == "unknown":
            raws.append(draw(st.sampled_from(RAW_VALUES)))
            target[draw(TEXT)] = f"{MARKER}0"
        elif isinstance(target, dict) and target and kind == "duplicate":
            # the same key twice: the later (garbage) value must be refused or win cleanly
            key = draw(st.sampled_from(sorted(target)))
            target["\x00dup"] = draw(st.sampled_from(WRONG_VALUES))
            data = json.dumps(doc, ensure_ascii=True).encode()
            return data.replace(b'"\\u0000dup"', json.dumps(key).encode(), 1)
        else:
            kind = "wrong"
            doc = _replace(doc, path, replacement())
    else:
        doc = _replace(doc, path, replacement())
    return with_raw(doc, raws)


def _replace(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def garbage(name: str) -> st.SearchStrategy[bytes]:
    """Everything but the deep and oversized bodies (those are fixed lists, built directly)."""
    codec = CODECS[name]
    return st.one_of(json_bytes(), st.binary(max_size=300), shaped_objects(codec.type), mutations(name))


class Body:
    """A generated body whose repr stays short (hypothesis prints the falsifying example;
    a plain class, not a dataclass, which hypothesis would print field by field)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"Body({describe(self.data)})"


@st.composite
def bodies(draw: st.DrawFn, strategy: st.SearchStrategy[bytes]) -> Body:
    # drawn, not `.map(Body)`: hypothesis prints a mapped value as the call with its whole argument
    return Body(draw(strategy))


def describe(data: bytes, limit: int = 160) -> str:
    """A short, printable description of a body for a failure message."""
    head = data[:limit]
    return f"{len(data)} bytes: {head!r}{'...' if len(data) > limit else ''}"


__all__ = [
    "CODECS",
    "SAMPLES",
    "SPEC",
    "CP_KEY",
    "NODE_KEY",
    "Raw",
    "RAW_VALUES",
    "codec_types",
    "struct_fields",
    "sample_for",
    "sample_doc",
    "deep_array",
    "deep_object",
    "deep_mixed",
    "deep_bodies",
    "deep_bodies_of",
    "oversized_bodies",
    "json_values",
    "json_bytes",
    "shaped_objects",
    "mutations",
    "doc_mutations",
    "garbage",
    "with_raw",
    "describe",
    "Body",
    "bodies",
    "demo_spec_doc",
]
