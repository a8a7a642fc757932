"""The checked-in JSON Schema (docs/schema) matches the code and means something.

Fails when a wire type changes without `python -m shared.schemas.jsonschema
--write`, when a stale file lingers, when a real message would not validate
against its schema, and when a pattern is not one an ECMA engine (what JSON
Schema validators in other languages run) reads the same way Python does.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
from shared.signing import Ed25519PrivateKey

from shared.schemas import (
    UPSTREAM_TYPES,
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    Atom,
    Condition,
    DeviceAssignment,
    DriverBinding,
    Gpu,
    GpuChanged,
    HoldCondition,
    Hello,
    HostResources,
    HugePagePool,
    HugePages,
    InstanceGpus,
    Inventory,
    Limits,
    MigInstance,
    MigProfile,
    NodeCondition,
    NodeSpec,
    NumaNode,
    PhysicalGPUStatus,
    ReportBody,
    RunningProcess,
    SectionStatus,
    Slot,
    encode,
)
from shared.schemas import jsonschema as gen
from shared.signing import key_id, raw_public_key, sign_node_spec, sign_report

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "schema"
T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
UUID = "GPU-5f3c2b1a-0000-4000-8000-0123456789ab"


# --- drift ------------------------------------------------------------------


def test_default_dir_is_this_checkouts_docs_schema() -> None:
    assert gen.DEFAULT_DIR == DOCS


def test_checked_in_schemas_match_the_code() -> None:
    problems = gen.check(DOCS)
    assert problems == [], (
        "docs/schema drifted from shared/schemas; run `python -m shared.schemas.jsonschema --write`:\n"
        + "\n".join(problems)
    )


def test_checked_in_files_are_exactly_the_upstream_types() -> None:
    on_disk = sorted(p.name for p in DOCS.iterdir())
    assert on_disk == sorted(f"{name}.json" for name in UPSTREAM_TYPES)


@pytest.mark.parametrize("name", sorted(UPSTREAM_TYPES))
def test_each_file_is_canonical_and_identified(name: str) -> None:
    text = (DOCS / f"{name}.json").read_text(encoding="utf-8")
    doc = json.loads(text)
    assert doc["$id"] == f"https://bcd.dev/schema/{name}.json"
    assert doc["title"] == name
    assert doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert text == json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    jsonschema.Draft202012Validator.check_schema(doc)


def _drifted_copy(tmp_path: Path) -> Path:
    out = tmp_path / "schema"
    assert gen.main(["--write", str(out)]) == 0
    (out / "NodeSpec.json").write_text("{}\n", encoding="utf-8")  # drifted
    (out / "Hello.json").unlink()  # missing
    (out / "OldThing.json").write_text(json.dumps({"$id": gen.schema_id("OldThing")}), encoding="utf-8")  # stale
    (out / "notes.json").write_text("{}", encoding="utf-8")  # extra, not ours
    return out


def test_check_names_every_drifted_missing_and_extra_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _drifted_copy(tmp_path)
    assert gen.main(["--check", str(out)]) == 1
    err = capsys.readouterr().err
    for fname, what in [
        ("NodeSpec.json", "drifted"),
        ("Hello.json", "missing"),
        ("OldThing.json", "extra"),
        ("notes.json", "extra"),
    ]:
        assert re.search(rf"{re.escape(fname)}: {what}", err), err
    for fname in ("Inventory.json", "AttestedReport.json"):
        assert fname not in err
    assert "--write" in err


def test_write_repairs_and_removes_only_its_own_stale_files(tmp_path: Path) -> None:
    out = _drifted_copy(tmp_path)
    changed = "\n".join(gen.write(out))
    assert "NodeSpec.json: written" in changed
    assert "Hello.json: written" in changed
    assert "OldThing.json: removed" in changed
    assert (out / "notes.json").exists(), "a file the generator did not write is never deleted"
    assert gen.check(out) == [f"{out / 'notes.json'}: extra (no upstream type 'notes')"]
    (out / "notes.json").unlink()
    assert gen.main(["--check", str(out)]) == 0
    assert gen.write(out) == [], "a second write changes nothing"


def test_check_of_a_missing_directory_lists_every_file(tmp_path: Path) -> None:
    problems = gen.check(tmp_path / "nope")
    assert len(problems) == len(UPSTREAM_TYPES)
    assert all(p.endswith(": missing") for p in problems)


def test_cli_needs_a_mode(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gen.main([])
    assert exc.value.code == 2
    assert "--write" in capsys.readouterr().err


# --- real instances validate --------------------------------------------------


def _schema(name: str) -> dict[str, Any]:
    return json.loads((DOCS / f"{name}.json").read_text(encoding="utf-8"))


def _validator(name: str) -> jsonschema.Draft202012Validator:
    cls = jsonschema.Draft202012Validator
    return cls(_schema(name), format_checker=cls.FORMAT_CHECKER)


def _node_spec() -> NodeSpec:
    return NodeSpec(
        node_id="gpu-node-01",
        generation=7,
        devices=[
            DeviceAssignment(
                allocation_id="alloc-1",
                reservation_id="res_1",
                binding="BINDING_HOLD",
                devices=[UUID, f"{UUID}/gi1/ci0", f"{UUID}/slot3"],
                limits=Limits(
                    cpus="0-3,8",
                    cpu_millis=2500,
                    memory_bytes=8 << 30,
                    hugepages=[HugePages(page_size_kib=2048, count=16)],
                    mems="0",
                ),
                env=["FOO=bar", "EMPTY=", "WITH_EQ=a=b,c"],
            ),
            DeviceAssignment(allocation_id="k8s-2", reservation_id="r2", binding="BINDING_KUBERNETES"),
        ],
        instances=[InstanceGpus(instance_id="vm-1", gpus=["0000:3b:00.0", "0000:af:00.1"])],
    )


def _inventory() -> Inventory:
    status = PhysicalGPUStatus(
        phase="Ready",
        driver_binding=DriverBinding(driver="nvidia", mode="Compute", management_state="Managed"),
        conditions=[Condition(type="DriverReady", status="True", reason="Bound", since=T0)],
    )
    return Inventory(
        node_id="gpu-node-01",
        revision=3,
        observed_at=T0,
        vendor="nvidia",
        driver_version="550.54.15",
        boot_id="b0f1",
        gpus=[
            Gpu(
                atom_id=UUID,
                uuid=UUID,
                index=0,
                pci_address="0000:3b:00.0",
                name="NVIDIA H100",
                memory_bytes=80 << 30,
                numa_node=0,
                driver="nvidia",
                base_driver="nvidia",
                compute_capability="9.0",
                mig_mode=True,
                mig_profiles=[
                    MigProfile(name="1g.10gb", profile_id=19, slices=1, memory_bytes=10 << 30, instances_max=7)
                ],
                mig_instances=[MigInstance(atom_id=f"{UUID}/gi1/ci0", uuid="MIG-1", gi=1, ci=0, profile="1g.10gb")],
                slots=[Slot(atom_id=f"{UUID}/slot0", index=0)],
                mps_running=True,
                status=status,
            )
        ],
        atoms=[
            Atom(id=UUID, kind="gpu", gpu_uuid=UUID, pci_address="0000:3b:00.0"),
            Atom(id=f"{UUID}/gi1/ci0", kind="mig", gpu_uuid=UUID, pci_address="0000:3b:00.0"),
        ],
        host=HostResources(
            memory_bytes=256 << 30,
            memory_available_bytes=200 << 30,
            cpus="0-63",
            numa_nodes=[
                NumaNode(
                    node=0,
                    cpus="0-31",
                    memory_bytes=128 << 30,
                    hugepages=[HugePagePool(page_size_kib=2048, total=64, free=60)],
                )
            ],
            hugepages=[HugePagePool(page_size_kib=2048, total=64, free=60)],
        ),
        mps_pipe_dir="/run/nvidia-mps",
        processes=[RunningProcess(pid=42, gpu_uuid=UUID, cgroup="/kubepods.slice/x")],
    )


def _bound() -> AllocationBound:
    return AllocationBound(
        allocation_id="alloc-1",
        reservation_id="res_1",
        generation=7,
        devices=[UUID],
        cgroup_parent="bcd-alloc-alloc-1.slice",
        cdi_devices=[f"bcd.dev/gpu={UUID}"],
    )


def _report_body() -> ReportBody:
    return ReportBody(node_id="gpu-node-01", boot_id="b0f1", event_id="ev:0001", time=T0, event=_bound())


def _instances() -> Iterator[tuple[str, object]]:
    key = Ed25519PrivateKey.generate()
    yield "NodeSpec", _node_spec()
    yield "NodeSpec", NodeSpec(node_id="n", generation=0)
    yield "SignedNodeSpec", sign_node_spec(key, _node_spec())
    yield "Inventory", _inventory()
    yield "Inventory", Inventory(node_id="n", observed_at=T0)
    yield "ReportBody", _report_body()
    yield "AttestedReport", sign_report(key, _report_body())
    yield (
        "Hello",
        Hello(
            node_id="gpu-node-01",
            boot_id="b0f1",
            public_key=raw_public_key(key),
            key_id=key_id(key),
            capabilities=["cdi", "nvml"],
            agent_version="0.1.0",
            started_at=T0,
        ),
    )
    released = AllocationReleased(allocation_id="a", reservation_id="r", generation=1, devices=[UUID])
    failed = AllocationFailed(allocation_id="a", reservation_id="r", generation=1, reason="overlap", message="x")
    section = SectionStatus(section="devices", state="CONVERGED", observed_generation=7)
    condition = NodeCondition(condition=Condition(type="NodeSpecRejected", status="True", since=T0))
    gpu = GpuChanged(pci_address="0000:3b:00.0", phase="Ready", management_state="Managed", status=PhysicalGPUStatus())
    hold = HoldCondition(
        allocation_id="a",
        reservation_id="r",
        generation=1,
        devices=["GPU-5f1c0000-0000-0000-0000-000000000001"],
        condition=Condition(type="DevicesHealthy", status="False", reason="XidCritical", message="XID 79", since=T0),
    )
    for name, event in [
        ("AllocationBound", _bound()),
        ("AllocationReleased", released),
        ("AllocationFailed", failed),
        ("SectionStatus", section),
        ("NodeCondition", condition),
        ("GpuChanged", gpu),
        ("HoldCondition", hold),
    ]:
        yield name, event
        yield "NodeEvent", event


INSTANCES = list(_instances())


def test_every_upstream_type_has_an_instance() -> None:
    assert {name for name, _ in INSTANCES} == set(UPSTREAM_TYPES)


@pytest.mark.parametrize(("name", "value"), INSTANCES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(INSTANCES)])
def test_real_instances_validate(name: str, value: object) -> None:
    doc = json.loads(encode(value))
    errors = [e.message for e in _validator(name).iter_errors(doc)]
    assert errors == []


def _with(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return doc


_SPEC = json.loads(encode(_node_spec()))
_INV = json.loads(encode(_inventory()))
_REPORT = json.loads(encode(sign_report(Ed25519PrivateKey.generate(), _report_body())))

# Each row: the schema refuses it, and so does the decoder (the schema is not looser there).
SCHEMA_REFUSES = [
    ("alloc-trailing-newline", "NodeSpec", _with(_SPEC, ("devices", 0, "allocation_id"), "alloc\n")),
    ("alloc-slash", "NodeSpec", _with(_SPEC, ("devices", 0, "allocation_id"), "a/b")),
    ("alloc-64-chars", "NodeSpec", _with(_SPEC, ("devices", 0, "allocation_id"), "a" * 64)),
    ("node-upper", "NodeSpec", _with(_SPEC, ("node_id",), "Node")),
    ("generation-str", "NodeSpec", _with(_SPEC, ("generation",), "1")),
    ("generation-negative", "NodeSpec", _with(_SPEC, ("generation",), -1)),
    ("binding-unknown", "NodeSpec", _with(_SPEC, ("devices", 0, "binding"), "BINDING_VM")),
    ("env-newline", "NodeSpec", _with(_SPEC, ("devices", 0, "env"), ["A=x\ny"])),
    ("env-nul", "NodeSpec", _with(_SPEC, ("devices", 0, "env"), ["A=\x00"])),
    # issue 40: keys that steer the loader, the toolkit's root hook or a shell (the schema's `not`)
    ("env-ld-preload", "NodeSpec", _with(_SPEC, ("devices", 0, "env"), ["FOO=1", "LD_PRELOAD=/tmp/x.so"])),
    ("env-nvidia-prefix", "NodeSpec", _with(_SPEC, ("devices", 0, "env"), ["NVIDIA_DISABLE_REQUIRE=1"])),
    ("env-path", "NodeSpec", _with(_SPEC, ("devices", 0, "env"), ["PATH=/tmp"])),
    ("env-bcd-own", "NodeSpec", _with(_SPEC, ("devices", 0, "env"), ["BCD_ALLOCATION_ID=x"])),
    ("cpus-open-range", "NodeSpec", _with(_SPEC, ("devices", 0, "limits", "cpus"), "0-")),
    ("page-size-zero", "NodeSpec", _with(_SPEC, ("devices", 0, "limits", "hugepages", 0, "page_size_kib"), 0)),
    ("pci-upper", "NodeSpec", _with(_SPEC, ("instances", 0, "gpus", 0), "0000:3B:00.0")),
    ("devices-65", "NodeSpec", _with(_SPEC, ("devices", 0, "devices"), [UUID] * 65)),
    ("missing-generation", "NodeSpec", {"node_id": "n"}),
    ("inv-pci", "Inventory", _with(_INV, ("gpus", 0, "pci_address"), "3b:00.0")),
    ("inv-atom-kind", "Inventory", _with(_INV, ("atoms", 0, "kind"), "nic")),
    ("inv-phase", "Inventory", _with(_INV, ("gpus", 0, "status", "phase"), "Happy")),
    ("report-purpose", "AttestedReport", _with(_REPORT, ("purpose",), "node-spec")),
    ("report-key-id", "AttestedReport", _with(_REPORT, ("key_id",), "ABCDEF0123456789")),
    ("event-unknown-tag", "NodeEvent", {"event": "exploded"}),
]


@pytest.mark.parametrize(("name", "doc"), [r[1:] for r in SCHEMA_REFUSES], ids=[r[0] for r in SCHEMA_REFUSES])
def test_schema_and_decoder_both_refuse(name: str, doc: dict[str, Any]) -> None:
    assert list(_validator(name).iter_errors(doc)), "the schema accepted it"
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(json.dumps(doc).encode(), type=UPSTREAM_TYPES[name])


# --- patterns ------------------------------------------------------------------


def _patterns(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "pattern" and isinstance(v, str):
                yield v
            else:
                yield from _patterns(v)
    elif isinstance(node, list):
        for v in node:
            yield from _patterns(v)


PATTERNS = sorted({p for name in UPSTREAM_TYPES for p in _patterns(_schema(name))})
ID_SCHEMA_PATTERN = _schema("NodeSpec")["$defs"]["DeviceAssignment"]["properties"]["allocation_id"]["pattern"]

#: constructs Python's `re` reads but ECMA-262 does not (or reads differently).
PYTHON_ONLY = [
    r"\A",
    r"\Z",
    r"\z",
    "(?P<",
    "(?P=",
    "(?#",
    "(?i",
    "(?m",
    "(?s",
    "(?x",
    "(?a",
    "(?u",
    "(?L",
    "*+",
    "++",
    "?+",
    "(?>",
]

#: samples each pattern is run on in both engines; they must agree.
SAMPLES = [
    "alloc",
    "alloc\n",
    "alloc\r",
    "a",
    "",
    "a" * 63,
    "a" * 64,
    "Alloc",
    "-a",
    "a/b",
    "../x",
    "0000:3b:00.0",
    "0000:3b:00.0\n",
    "0000:3B:00.0",
    "0-3,8",
    "0-",
    "FOO=bar",
    "FOO=bar\n",
    "FOO=a\nb",
    "FOO=\x00",
    "LD_PRELOAD=/tmp/x.so",
    "LD_PRELOAD=x\n",
    "PATH=/x",
    "PATHS=/x",
    "NVIDIA_REQUIRE_CUDA=cuda>=12",
    "0123456789abcdef",
    "0123456789abcdef\n",
    "ev:0001",
    f"{UUID}/gi1/ci0",
    "GPU x",
]


def test_patterns_were_found() -> None:
    assert len(PATTERNS) >= 6
    assert ID_SCHEMA_PATTERN in PATTERNS


@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_is_portable_and_anchored(pattern: str) -> None:
    re.compile(pattern)
    for construct in PYTHON_ONLY:
        assert construct not in pattern, f"{pattern!r} uses Python-only {construct!r}"
    assert pattern.startswith("^")
    assert pattern.endswith("$(?!\\n)"), "a bare `$` lets Python's re.search accept a trailing newline"


@pytest.mark.parametrize("value", ["alloc\n", "alloc\r", "\nalloc", "al\nloc", "alloc\n\n", ""])
def test_id_pattern_rejects_newlines(value: str) -> None:
    assert re.search(ID_SCHEMA_PATTERN, value) is None
    assert list(_validator("NodeSpec").iter_errors(_with(_SPEC, ("devices", 0, "allocation_id"), value)))


def test_patterns_mean_the_same_in_an_ecma_engine() -> None:
    """Compile every pattern with JavaScript's RegExp and compare verdicts with Python's."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node (an ECMA-262 engine) is not installed")
    script = (
        "const {patterns, samples} = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        "const out = patterns.map(p => { const r = new RegExp(p, 'u'); return samples.map(s => r.test(s)); });"
        "process.stdout.write(JSON.stringify(out));"
    )
    proc = subprocess.run(
        [node, "-e", script],
        input=json.dumps({"patterns": PATTERNS, "samples": SAMPLES}),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    ecma = json.loads(proc.stdout)
    for pattern, verdicts in zip(PATTERNS, ecma, strict=True):
        python = [re.search(pattern, s) is not None for s in SAMPLES]
        diff = [s for s, a, b in zip(SAMPLES, python, verdicts, strict=True) if a != b]
        assert diff == [], f"{pattern!r}: Python and ECMA disagree on {diff!r}"
    id_verdicts = dict(zip(SAMPLES, ecma[PATTERNS.index(ID_SCHEMA_PATTERN)], strict=True))
    assert id_verdicts["alloc"] is True
    assert id_verdicts["alloc\n"] is False
