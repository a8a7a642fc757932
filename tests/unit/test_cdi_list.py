"""`bcd cdi list` (issue 12): the CDI devices bcd created, read back from the hold files of a
kit-built node (real converger plan/apply on real files), and the command itself with no bus."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bcd.cdi import annotation_key, listing_json, read_cdi_dir, render_listing, runtime_args
from bcd.client import NodeInfo, write_node_info
from shared.holdfiles import device_name
from tests.converger_kit import GPU, Node, fast_dir, hold, spec

G = GPU
GIB = 1 << 30
KUBE = frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"})

SPEC = spec(
    7,
    hold("train-01", G[0], cpus="0-3", memory_bytes=8 * GIB),
    hold("two-gpus", G[1], G[2]),
    hold("mig", f"{G[6]}/gi1/ci0", f"{G[6]}/gi5/ci0"),
    hold("slots", f"{G[4]}/slot0", f"{G[4]}/slot1"),
    hold("kube", G[3], binding="BINDING_KUBERNETES"),
)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    with fast_dir() as root:
        n = Node(root / "node", supported_bindings=KUBE)
        p, r = await n.converge(SPEC)
        assert not r.errors and p.failures == ()
        yield n


def test_every_hold_is_listed_with_its_device_names_and_atoms(node: Node) -> None:
    listing = read_cdi_dir(node.cdi_dir)
    assert listing.problems == []
    assert [h.allocation_id for h in listing.holds] == sorted(a.allocation_id for a in SPEC.devices)
    by_alloc = {h.allocation_id: h for h in listing.holds}
    for a in SPEC.devices:
        h = by_alloc[a.allocation_id]
        assert (h.reservation_id, h.generation, h.binding) == (a.reservation_id, 7, a.binding)
        assert h.file == str(node.cdi_dir / f"bcd-{a.allocation_id}.json")
        # each device: the name a runtime takes and the real atom id (bcd.dev/device-id), in the assignment's order
        assert [d.atom_id for d in h.devices] == a.devices
        assert [d.name for d in h.devices] == [device_name(atom) for atom in a.devices]
        assert [d.qualified_name for d in h.devices] == [f"bcd.dev/gpu={device_name(atom)}" for atom in a.devices]
    # the names are the ones in the files
    on_disk = json.loads((node.cdi_dir / "bcd-mig.json").read_text())
    assert [d.name for d in by_alloc["mig"].devices] == [d["name"] for d in on_disk["devices"]]
    assert by_alloc["mig"].devices[0].name == f"{G[6]}_gi1_ci0"
    # only the sliced hold names its slice
    assert by_alloc["train-01"].cgroup_parent == on_disk_parent(node, "train-01") != ""
    assert {a for a, h in by_alloc.items() if h.cgroup_parent} == {"train-01"}
    # the vendor's spec (nvidia.json) is not a bcd hold and not listed
    assert (node.cdi_dir / "nvidia.json").exists()


def on_disk_parent(node: Node, alloc: str) -> str:
    return json.loads((node.cdi_dir / f"bcd-{alloc}.json").read_text())["annotations"]["bcd.dev/cgroup-parent"]


def test_the_runtime_command_lines(node: Node) -> None:
    by_alloc = {h.allocation_id: h for h in read_cdi_dir(node.cdi_dir).holds}
    two = runtime_args(by_alloc["two-gpus"])
    names = [f"bcd.dev/gpu={G[1]}", f"bcd.dev/gpu={G[2]}"]
    assert two["docker"] == ["docker", "run", "--device", names[0], "--device", names[1]]
    assert two["podman"] == ["podman", "run", "--device", names[0], "--device", names[1]]
    assert two["ctr"] == ["ctr", "run", "--device", names[0], "--device", names[1]]
    assert two["cri_cdi_devices"] == [{"name": n} for n in names]
    assert two["cri_annotations"] == {"cdi.k8s.io/bcd_two-gpus": ",".join(names)}
    sliced = runtime_args(by_alloc["train-01"])
    parent = by_alloc["train-01"].cgroup_parent
    assert sliced["docker"][-2:] == ["--cgroup-parent", parent] and sliced["podman"][-2:] == ["--cgroup-parent", parent]

    text = render_listing(read_cdi_dir(node.cdi_dir))
    assert f"  docker:     docker run --device {names[0]} --device {names[1]} IMAGE ..." in text
    assert f"  podman:     podman run --device {names[0]} --device {names[1]} IMAGE ..." in text
    assert f"  containerd: ctr run --device {names[0]} --device {names[1]} IMAGE ..." in text
    assert f"CDIDevices {names[0]}, {names[1]}" in text
    # a slice name is quoted for the shell whatever characters it has
    assert f"--cgroup-parent {shlex.quote(parent)} IMAGE ..." in text
    assert f"  bcd.dev/gpu={G[6]}_gi1_ci0" in text and f"{G[6]}/gi1/ci0" in text
    assert "a Kubernetes hold" in text
    assert text.splitlines()[0] == f"CDI dir {node.cdi_dir}: 5 hold(s), 8 device(s) of kind bcd.dev/gpu"


def test_the_json_shape_is_stable(node: Node) -> None:
    doc = listing_json(read_cdi_dir(node.cdi_dir))
    assert set(doc) == {"cdi_dir", "kind", "holds", "problems"}
    assert doc["kind"] == "bcd.dev/gpu" and doc["problems"] == []
    first = doc["holds"][0]
    assert set(first) == {"allocation_id", "reservation_id", "generation", "binding", "cgroup_parent", "file", "devices", "runtime"}
    assert set(first["devices"][0]) == {"name", "qualified_name", "atom_id"}
    assert set(first["runtime"]) == {"docker", "podman", "ctr", "cri_cdi_devices", "cri_annotations"}
    assert json.loads(json.dumps(doc)) == doc


def test_files_that_are_not_holds_are_problems_and_never_block(node: Node) -> None:
    cdi = node.cdi_dir
    os.mkfifo(cdi / "bcd-fifo.json")  # read_regular never opens it: no hang
    (cdi / "bcd-link.json").symlink_to(cdi / "bcd-mig.json")  # never followed
    (cdi / "bcd-garbage.json").write_text("{not json")
    (cdi / "bcd-other.json").write_text(json.dumps({"cdiVersion": "0.6.0", "kind": "acme.com/gpu", "devices": []}))
    (cdi / ".bcd-x.json.tmp-123").write_text("half written")  # an interrupted write: not a hold, not a problem
    listing = read_cdi_dir(cdi)
    assert len(listing.holds) == 5
    problems = "\n".join(listing.problems)
    assert "bcd-fifo.json: a FIFO, not a regular file: skipped" in problems
    assert "bcd-link.json: a symlink" in problems and "not followed" in problems
    assert "bcd-garbage.json: not a bcd hold (not valid JSON" in problems
    assert "bcd-other.json: not a bcd hold (kind is 'acme.com/gpu'" in problems
    assert len(listing.problems) == 4


def test_a_name_in_two_holds_is_a_problem(node: Node) -> None:
    doc = json.loads((node.cdi_dir / "bcd-two-gpus.json").read_text())
    doc["annotations"]["bcd.dev/allocation-id"] = "copy"
    (node.cdi_dir / "bcd-copy.json").write_text(json.dumps(doc))
    problems = read_cdi_dir(node.cdi_dir).problems
    assert f"bcd.dev/gpu={G[1]} is in the holds of both copy and two-gpus: a runtime drops both" in problems


def test_a_missing_dir_is_a_problem(tmp_path: Path) -> None:
    listing = read_cdi_dir(tmp_path / "nowhere")
    assert listing.holds == [] and "no such directory" in listing.problems[0]
    assert "no holds" in render_listing(listing)


def test_the_annotation_key_fits_the_cdi_library_limit() -> None:
    assert annotation_key("a1") == "cdi.k8s.io/bcd_a1"
    long_id = "a" + "b" * 62
    key = annotation_key(long_id)
    name = key.removeprefix("cdi.k8s.io/")
    assert len(name) <= 63 and name[0].isalnum() and name[-1].isalnum()
    assert key != annotation_key("a" + "b" * 61 + "c")


# ---------------------------------------------------------------------------- the command


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from bcd.cli import main

    with pytest.raises(SystemExit) as done:
        main(list(argv))
    return int(done.value.code or 0), capsys.readouterr().out


def stopped_node_state(node: Node) -> Path:
    """A state dir whose node.json names the kit node's CDI dir and a node bus nobody listens on."""
    state = node.root / "state"
    state.mkdir()
    write_node_info(
        state,
        NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir=str(state / "creds"), cdi_dir=str(node.cdi_dir)),
    )
    return state


def test_bcd_cdi_list_reads_the_files_of_a_stopped_node(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    state = stopped_node_state(node)
    code, out = run_cli(capsys, "cdi", "list", "--state-dir", str(state))
    assert code == 0, out
    assert f"hold two-gpus (rsv-two-gpus) gen 7 BINDING_HOLD  {node.cdi_dir / 'bcd-two-gpus.json'}" in out
    assert f"docker run --device bcd.dev/gpu={G[1]} --device bcd.dev/gpu={G[2]} IMAGE ..." in out

    code, out = run_cli(capsys, "cdi", "list", "--state-dir", str(state), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc == listing_json(read_cdi_dir(node.cdi_dir))
    assert doc["cdi_dir"] == str(node.cdi_dir)

    # only some allocations; one that has no hold is named and makes it exit 1
    code, out = run_cli(capsys, "cdi", "list", "mig", "gone", "--state-dir", str(state), "--json")
    doc = json.loads(out)
    assert code == 1
    assert [h["allocation_id"] for h in doc["holds"]] == ["mig"]
    assert doc["problems"] == [f"no hold of allocation gone in {node.cdi_dir}"]

    # --cdi-dir needs no node.json at all; an odd file there makes it exit 1, naming it
    os.mkfifo(node.cdi_dir / "bcd-fifo.json")
    code, out = run_cli(capsys, "cdi", "list", "--cdi-dir", str(node.cdi_dir), "--state-dir", str(node.root / "no-state"))
    assert code == 1
    assert "problem: " in out and "bcd-fifo.json: a FIFO" in out
    assert "hold train-01" in out
