"""Every CDI spec the converger writes validates against the official CDI JSON
schema, and the whole CDI directory passes bcd's own CDI rule checks (unique
device names across files, non-empty edits, lowest cdiVersion). Files are 0644.

The schema is the team's copy in ../shared/reference/cdi-schema; without it
the schema test skips with a reason.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.holdfiles import check_cdi_rules, validate_against_schema

from tests.converger_kit import GPU, Node, fast_dir, hold, host_copy, spec

G = GPU
GIB = 1 << 30
SCHEMA_DIR = Path(__file__).resolve().parents[3].parent / "shared" / "reference" / "cdi-schema"
KUBE = frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"})

RICH = spec(
    42,
    hold("whole", G[0], cpus="0-3", cpu_millis=4000, memory_bytes=8 * GIB, hugepages=[(2048, 512), (1048576, 2)], mems="0",
         env=("MY_VAR=1", "OTHER=a,b=c")),
    hold("two-gpus", G[1], G[2]),
    hold("mig", f"{G[6]}/gi1/ci0", f"{G[6]}/gi5/ci0"),
    hold("mig2", f"{G[7]}/gi2/ci0", cpus="8"),
    hold("slot-a", f"{G[4]}/slot0", f"{G[4]}/slot1"),
    hold("slot-b", f"{G[4]}/slot2", rsv="rsv-shared"),
    hold("slot-c", f"{G[5]}/slot3", rsv="rsv-shared"),
    hold("kube", G[3], binding="BINDING_KUBERNETES"),
)


@pytest.fixture
def root() -> Iterator[Path]:
    """A scratch directory, on tmpfs where there is one (every write is fsynced)."""
    with fast_dir() as d:
        yield d


def no_vendor_spec(doc: dict) -> None:
    doc["vendor_cdi_spec"] = None


@pytest.fixture(params=["vendor-spec", "no-vendor-spec"])
async def written(request, root: Path) -> Node:  # noqa: ANN001
    host = host_copy(root / "host", no_vendor_spec) if request.param == "no-vendor-spec" else None
    node = Node(root / "node", host, supported_bindings=KUBE) if host else Node(root / "node", supported_bindings=KUBE)
    p, r = await node.converge(RICH)
    assert not r.errors, r.errors
    assert p.failures == ()
    assert set(node.holds()) == {a.allocation_id for a in RICH.devices}
    assert (node.cdi_dir / "nvidia.json").exists() == (request.param == "vendor-spec")
    return node


def cdi_files(node: Node) -> dict[str, object]:
    return {p.name: json.loads(p.read_text()) for p in sorted(node.cdi_dir.glob("*.json"))}


def test_written_specs_validate_against_the_official_schema(written: Node) -> None:
    if not (SCHEMA_DIR / "schema.json").is_file():
        pytest.skip(f"CDI schema not found at {SCHEMA_DIR}")
    # the validator is not vacuous: a broken spec fails
    assert validate_against_schema({"cdiVersion": "0.6.0", "kind": "bcd.dev/gpu", "devices": [{}]}, SCHEMA_DIR)
    for name, doc in cdi_files(written).items():
        assert validate_against_schema(doc, SCHEMA_DIR) == [], name  # type: ignore[arg-type]


def test_the_cdi_directory_passes_the_cdi_rules(written: Node) -> None:
    files = cdi_files(written)
    assert check_cdi_rules(files) == []
    # the checker is not vacuous: a name in two files is caught
    dup = dict(files)
    dup["bcd-copy.json"] = files["bcd-slot-a.json"]
    assert any("appears in" in p for p in check_cdi_rules(dup))


def test_device_names_are_unique_and_ids_kept(written: Node) -> None:
    names: dict[str, str] = {}
    for alloc, doc in written.holds().items():
        assert doc["kind"] == "bcd.dev/gpu"
        assert doc["annotations"]["bcd.dev/allocation-id"] == alloc
        assert doc["annotations"]["bcd.dev/generation"] == "42"
        for d in doc["devices"]:
            assert "/" not in d["name"]
            assert d["name"] not in names, (d["name"], names.get(d["name"]), alloc)
            names[d["name"]] = alloc
            assert d["containerEdits"], d
    # two slot holds on one GPU never both name the GPU
    assert G[4] not in names
    ids = {d["annotations"]["bcd.dev/device-id"] for doc in written.holds().values() for d in doc["devices"]}
    assert ids == {atom for a in RICH.devices for atom in a.devices}


def test_seed_shape_of_a_sliced_whole_gpu_hold(written: Node) -> None:
    doc = written.holds()["whole"]
    assert doc["annotations"]["bcd.dev/cgroup-parent"] == "bcd-alloc-whole.slice"
    env = doc["containerEdits"]["env"]
    assert env[:3] == ["BCD_ALLOCATION_ID=whole", "BCD_CGROUP_PARENT=bcd-alloc-whole.slice", f"NVIDIA_VISIBLE_DEVICES={G[0]}"]
    assert written.env("whole").splitlines() == [
        "BCD_ALLOCATION_ID=whole",
        "BCD_CGROUP_PARENT=bcd-alloc-whole.slice",
        "BCD_RESERVATION_ID=rsv-whole",
        f"NVIDIA_VISIBLE_DEVICES={G[0]}",
        "MY_VAR=1",
        "OTHER=a,b=c",
    ]
    # a Kubernetes hold: NVIDIA_VISIBLE_DEVICES in the env file, never in the CDI spec
    kube = written.holds()["kube"]
    assert not any(e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in kube["containerEdits"]["env"])
    assert f"NVIDIA_VISIBLE_DEVICES={G[3]}" in written.env("kube").splitlines()
    assert "bcd.dev/cgroup-parent" not in kube["annotations"]
    # slots with MPS running carry the pipe directory
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in written.env("slot-a").splitlines()


def test_files_are_mode_0644(written: Node) -> None:
    paths = list(written.cdi_dir.glob("bcd-*.json")) + list((written.run_dir / "allocations").glob("*.env"))
    assert len(paths) == 2 * len(RICH.devices)
    for p in paths:
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p


def test_schema_dir_path_is_the_team_folder() -> None:
    assert SCHEMA_DIR.parts[-3:] == ("shared", "reference", "cdi-schema")


def test_bound_events_name_the_devices_as_written(written: Node) -> None:
    bodies = written.outbox.reports("bound", written.signer)
    assert len(bodies) == len(RICH.devices)
    for body in bodies:
        doc = written.holds()[body.event.allocation_id]
        assert body.event.cdi_devices == [f"{doc['kind']}={d['name']}" for d in doc["devices"]]
        assert body.event.devices == [d["annotations"]["bcd.dev/device-id"] for d in doc["devices"]]
        assert body.event.cgroup_parent == doc["annotations"].get("bcd.dev/cgroup-parent", "")
