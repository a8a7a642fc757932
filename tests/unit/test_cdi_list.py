"""`bcd cdi list` (issue 12): the CDI devices bcd created, read back from the hold files of a
kit-built node (real converger plan/apply on real files), their consumer copies, the command
lines of the runtimes found (a fake probe), and the command itself with no bus."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import bcd.runtimes
from bcd.cdi import annotation_key, hold_files, listing_json, read_cdi_dir, render_listing, runtime_args
from bcd.client import NodeInfo, write_node_info
from bcd.runtimes import FakeRuntimes, RuntimeFacts
from shared.holdfiles import consumer_file_bytes, device_name
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


def found(node: Node, copies: Path | None = None) -> list[RuntimeFacts]:
    """Runtimes that read the kit node's dirs and can use every hold there."""
    dirs = (str(node.cdi_dir), *((str(copies),) if copies else ()))
    return [
        RuntimeFacts("podman", "/usr/bin/podman", "5.5.0", spec_dirs=dirs),
        RuntimeFacts("docker", "/usr/bin/docker", "28.2.0", spec_dirs=dirs),
        RuntimeFacts("containerd", "/usr/bin/containerd", "2.0.0", spec_dirs=dirs),
    ]


def write_copies(node: Node, *allocations: str) -> Path:
    """The consumer copies of these holds, as the converger writes them, in a dir of their own."""
    copies = node.root / "copies"
    copies.mkdir(exist_ok=True)
    for a in allocations:
        (copies / f"bcd-{a}.json").write_bytes(consumer_file_bytes(a, (node.cdi_dir / f"bcd-{a}.json").read_bytes()))
    return copies


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

    text = render_listing(read_cdi_dir(node.cdi_dir), found(node))
    assert f"  docker 28.2.0:    docker run --device {names[0]} --device {names[1]} IMAGE ..." in text
    assert f"  podman 5.5.0:     podman run --device {names[0]} --device {names[1]} IMAGE ..." in text
    assert f"  containerd 2.0.0: ctr run --device {names[0]} --device {names[1]} IMAGE ..." in text
    assert f"  CRI:              CDIDevices {names[0]}, {names[1]}" in text
    # a slice name is quoted for the shell whatever characters it has
    assert f"--cgroup-parent {shlex.quote(parent)} IMAGE ..." in text
    assert f"  bcd.dev/gpu={G[6]}_gi1_ci0" in text and f"{G[6]}/gi1/ci0" in text
    assert "a Kubernetes hold" in text
    assert text.splitlines()[0] == f"CDI dir {node.cdi_dir}: 5 hold(s), 8 device(s) of kind bcd.dev/gpu"


#: the keys of the first `--json` shape: kept, whatever is added
V1_TOP = {"cdi_dir", "kind", "holds", "problems"}
V1_HOLD = {"allocation_id", "reservation_id", "generation", "binding", "cgroup_parent", "file", "devices", "runtime"}


def test_the_json_shape_is_stable(node: Node) -> None:
    copies = write_copies(node, *(a.allocation_id for a in SPEC.devices))
    doc = listing_json(read_cdi_dir(node.cdi_dir, copies), found(node, copies))
    assert set(doc) == V1_TOP | {"cdi_consumer_dir", "runtimes"}
    assert doc["kind"] == "bcd.dev/gpu" and doc["problems"] == [] and doc["cdi_consumer_dir"] == str(copies)
    first = doc["holds"][0]
    assert set(first) == V1_HOLD | {"cdi_version", "consumer_copy"}
    assert set(first["devices"][0]) == {"name", "qualified_name", "atom_id"}
    assert set(first["runtime"]) == {"docker", "podman", "ctr", "cri_cdi_devices", "cri_annotations"}
    assert first["cdi_version"] == "0.6.0"
    assert first["consumer_copy"] == {"file": str(copies / f"bcd-{first['allocation_id']}.json"), "cdi_version": "0.3.0", "state": "ok", "problem": ""}
    assert [r["name"] for r in doc["runtimes"]] == ["podman", "docker", "containerd"]
    pm = doc["runtimes"][0]
    assert set(pm) == {"name", "path", "version", "error", "cdi_library", "highest_cdi_version", "cdi_enabled", "spec_dirs", "config_error", "cgroup_manager", "holds"}
    assert (pm["version"], pm["cdi_library"], pm["highest_cdi_version"], pm["cdi_enabled"]) == ("5.5.0", "v1.0", "1.0.0", True)
    uses = {u["allocation_id"]: u for u in pm["holds"]}
    assert set(uses) == {a.allocation_id for a in SPEC.devices}
    # both files parse: the copy's dir ranks higher, its devices win
    assert uses["mig"] == {"allocation_id": "mig", "usable": True, "file": str(copies / "bcd-mig.json"), "todo": "", "argv": first_argv(doc, "mig", "podman"), "note": ""}
    assert json.loads(json.dumps(doc)) == doc


def first_argv(doc: dict, alloc: str, key: str) -> list[str]:
    return next(h["runtime"][key] for h in doc["holds"] if h["allocation_id"] == alloc)


def test_each_hold_shows_its_spec_version_and_consumer_copy(node: Node) -> None:
    copies = write_copies(node, "mig", "slots", "kube", "train-01")
    (copies / "bcd-slots.json").write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "bcd.dev/gpu", "devices": []}))  # edited by hand
    (copies / "bcd-released.json").write_bytes((copies / "bcd-mig.json").read_bytes())  # its hold is gone
    os.mkfifo(copies / "bcd-train-01.json.fifo")  # not a bcd-*.json: not looked at
    (copies / "bcd-kube.json").unlink()
    os.mkfifo(copies / "bcd-kube.json")  # never opened
    listing = read_cdi_dir(node.cdi_dir, copies)
    by = {h.allocation_id: h for h in listing.holds}
    assert {a: (h.cdi_version, h.consumer.state if h.consumer else None) for a, h in by.items()} == {
        "kube": ("0.6.0", "unreadable"),
        "mig": ("0.6.0", "ok"),
        "slots": ("0.6.0", "stale"),
        "train-01": ("0.6.0", "ok"),
        "two-gpus": ("0.6.0", "missing"),
    }
    problems = "\n".join(listing.problems)
    assert f"{copies / 'bcd-two-gpus.json'}: consumer copy missing: a runtime whose CDI library is older than v0.6 does not find this hold's devices" in problems
    assert f"{copies / 'bcd-slots.json'}: not the consumer copy its hold spec makes" in problems
    assert f"{copies / 'bcd-released.json'}: a consumer copy without a hold spec in {node.cdi_dir}: a runtime still finds its devices" in problems
    assert f"{copies / 'bcd-kube.json'}: a FIFO" in problems
    assert len(listing.problems) == 4
    text = render_listing(listing, found(node, copies))
    assert f"hold mig (rsv-mig) gen 7 BINDING_HOLD  {node.cdi_dir / 'bcd-mig.json'} (cdiVersion 0.6.0)" in text
    assert f"  consumer copy {copies / 'bcd-mig.json'} (cdiVersion 0.3.0)\n" in text
    assert f"  consumer copy {copies / 'bcd-slots.json'} (cdiVersion 0.3.0)  STALE" in text
    assert f"  consumer copy {copies / 'bcd-two-gpus.json'}: MISSING" in text
    assert f"  consumer copy {copies / 'bcd-kube.json'}: UNREADABLE" in text
    assert f"consumer copies in {copies}" in text
    # without a consumer dir (a node.json from before them): unknown, not a problem
    old = read_cdi_dir(node.cdi_dir)
    assert old.problems == [] and all(h.consumer is None for h in old.holds)
    assert "consumer copy: unknown (node.json names no cdi_consumer_dir" in render_listing(old, [])
    assert "consumer copies: dir unknown (--cdi-consumer-dir)" in render_listing(old, [])
    # the consumer dir is the CDI dir itself: refused, no copy read
    same = read_cdi_dir(node.cdi_dir, node.cdi_dir)
    assert same.problems == [f"{node.cdi_dir}: the consumer dir is the CDI dir itself: no consumer copy is read"]


def test_command_lines_only_for_the_runtimes_found_that_can_use_the_hold(node: Node) -> None:
    copies = write_copies(node, *(a.allocation_id for a in SPEC.devices if a.allocation_id != "mig"))
    listing = read_cdi_dir(node.cdi_dir, copies)
    dirs = (str(node.cdi_dir), str(copies))
    runtimes = [
        RuntimeFacts("podman", "/usr/bin/podman", "4.3.1", spec_dirs=dirs),
        RuntimeFacts("docker", "/usr/bin/docker", "20.10.24", cdi_enabled=False, cdi_switch='set "features": {"cdi": true} in /etc/docker/daemon.json'),
        RuntimeFacts("crio", "/usr/bin/crio", "1.28.0", spec_dirs=dirs),
    ]
    text = render_listing(listing, runtimes)
    lines = text.splitlines()
    assert lines[:5] == [
        f"CDI dir {node.cdi_dir}: 5 hold(s), 8 device(s) of kind bcd.dev/gpu",
        f"consumer copies in {copies}",
        f"runtime podman 4.3.1 (CDI library v0.5: reads cdiVersion <= 0.5.0; dirs {node.cdi_dir}, {copies})",
        "runtime docker 20.10.24 (no CDI: it came in docker 25.0.0)",
        f"runtime crio 1.28.0 (CDI library v0.6: reads cdiVersion <= 0.6.0; dirs {node.cdi_dir}, {copies})",
    ]
    two = f"--device bcd.dev/gpu={G[1]} --device bcd.dev/gpu={G[2]}"
    # podman 4.3 (v0.5) reads the copy of two-gpus ...
    assert f"  podman 4.3.1:    podman run {two} IMAGE ..." in lines
    # ... but mig has no copy, and its hold spec (0.6.0) is too new for it
    mig_copy = copies / "bcd-mig.json"
    assert (
        f"  podman 4.3.1:    cannot use this hold: its consumer copy {mig_copy} is missing (the converger writes it beside the hold spec: "
        "is it running this bcd?); or upgrade podman to 4.7.0 or later"
    ) in lines
    docker_todo = '  docker 20.10.24: cannot use this hold: docker 20.10.24 has no CDI: upgrade docker to 25.0.0 or later and set "features": {"cdi": true} in /etc/docker/daemon.json'
    assert lines.count(docker_todo) == 5 and "docker run" not in text
    assert lines.count("  crio 1.28.0:     through the CRI (below)") == 5
    assert "ctr run" not in text  # no containerd on this host
    assert f"  CRI:             CDIDevices bcd.dev/gpu={G[1]}, bcd.dev/gpu={G[2]}  (or annotation cdi.k8s.io/bcd_two-gpus=" in text
    doc = listing_json(listing, runtimes)
    podman_mig = next(u for u in doc["runtimes"][0]["holds"] if u["allocation_id"] == "mig")
    assert (podman_mig["usable"], podman_mig["argv"], podman_mig["file"]) == (False, [], "")
    assert podman_mig["todo"].startswith(f"its consumer copy {mig_copy} is missing")
    assert all(u["argv"] == [] and u["usable"] for u in doc["runtimes"][2]["holds"])  # crio: only through the CRI


def test_no_runtime_found_no_command_lines(node: Node) -> None:
    text = render_listing(read_cdi_dir(node.cdi_dir), [])
    assert "no container runtime found on this host (podman, docker, containerd, crio on PATH): no command lines" in text
    assert not any(cmd in text for cmd in ("docker run", "podman run", "ctr run"))
    assert text.count("  CRI: CDIDevices ") == 5  # the kubelet's lines stay
    assert listing_json(read_cdi_dir(node.cdi_dir), [])["runtimes"] == []


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
    assert "no holds" in render_listing(listing, [])


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


def test_bcd_cdi_list_reads_the_files_of_a_stopped_node(node: Node, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bcd.runtimes, "default_probe", lambda: FakeRuntimes(found(node)))
    state = stopped_node_state(node)
    code, out = run_cli(capsys, "cdi", "list", "--state-dir", str(state))
    assert code == 0, out
    assert f"hold two-gpus (rsv-two-gpus) gen 7 BINDING_HOLD  {node.cdi_dir / 'bcd-two-gpus.json'}" in out
    assert f"docker 28.2.0:    docker run --device bcd.dev/gpu={G[1]} --device bcd.dev/gpu={G[2]} IMAGE ..." in out

    code, out = run_cli(capsys, "cdi", "list", "--state-dir", str(state), "--json")
    assert code == 0
    doc = json.loads(out)
    listing = read_cdi_dir(node.cdi_dir)
    assert doc == listing_json(listing, found(node), bcd.runtimes.same_dirs_of(found(node), hold_files(listing)))
    assert doc["cdi_dir"] == str(node.cdi_dir) and doc["cdi_consumer_dir"] == ""

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


def test_bcd_cdi_list_reads_the_consumer_copies_node_json_names(node: Node, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    copies = write_copies(node, *(a.allocation_id for a in SPEC.devices))
    old_podman = [RuntimeFacts("podman", "/usr/bin/podman", "4.3.1", spec_dirs=(str(node.cdi_dir), str(copies)))]
    monkeypatch.setattr(bcd.runtimes, "default_probe", lambda: FakeRuntimes(old_podman))
    state = node.root / "state"
    state.mkdir()
    write_node_info(
        state,
        NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir="", cdi_dir=str(node.cdi_dir), cdi_consumer_dir=str(copies)),
    )
    code, out = run_cli(capsys, "cdi", "list", "--state-dir", str(state))
    assert code == 0, out
    assert f"consumer copy {copies / 'bcd-two-gpus.json'} (cdiVersion 0.3.0)" in out
    assert f"podman 4.3.1: podman run --device bcd.dev/gpu={G[1]} --device bcd.dev/gpu={G[2]} IMAGE ..." in out

    # --cdi-consumer-dir overrides node.json's: here a dir without copies
    empty = node.root / "empty"
    empty.mkdir()
    code, out = run_cli(capsys, "cdi", "list", "two-gpus", "--state-dir", str(state), "--cdi-consumer-dir", str(empty), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["cdi_consumer_dir"] == str(empty)
    assert doc["holds"][0]["consumer_copy"]["state"] == "missing"
    (use,) = doc["runtimes"][0]["holds"]
    assert use["usable"] is False and use["todo"].endswith("or upgrade podman to 4.7.0 or later")

    # --cdi-dir with no node.json: the consumer dir is unknown unless given
    nowhere = str(node.root / "no-state")
    code, out = run_cli(capsys, "cdi", "list", "--cdi-dir", str(node.cdi_dir), "--state-dir", nowhere, "--json")
    assert code == 0 and json.loads(out)["cdi_consumer_dir"] == ""
    code, out = run_cli(capsys, "cdi", "list", "--cdi-dir", str(node.cdi_dir), "--cdi-consumer-dir", str(copies), "--state-dir", nowhere, "--json")
    assert code == 0 and all(h["consumer_copy"]["state"] == "ok" for h in json.loads(out)["holds"])


@pytest.mark.parametrize(("manager", "parent_kept"), [("systemd", True), ("", True), ("cgroupfs", False)])
def test_a_sliced_holds_command_leaves_out_the_slice_only_where_podman_refuses_it(node: Node, manager: str, parent_kept: bool) -> None:
    """podman under the cgroupfs manager (a host whose init is no systemd: this test machine) exits
    125 'systemd slice received as cgroup parent when using cgroupfs' for a sliced hold's
    --cgroup-parent: the line it is shown must be one that runs, and say what it leaves out."""
    copies = write_copies(node, *(a.allocation_id for a in SPEC.devices))
    listing = read_cdi_dir(node.cdi_dir, copies)
    podman = RuntimeFacts("podman", "/usr/bin/podman", "4.3.1", spec_dirs=(str(node.cdi_dir), str(copies)), cgroup_manager=manager)
    sliced = next(h for h in listing.holds if h.cgroup_parent)
    doc = listing_json(listing, [podman])
    use = next(u for u in doc["runtimes"][0]["holds"] if u["allocation_id"] == sliced.allocation_id)
    assert ("--cgroup-parent" in use["argv"]) is parent_kept
    assert use["argv"][:2] == ["podman", "run"] and all(n in use["argv"] for n in sliced.names)
    assert bool(use["note"]) is not parent_kept
    # the generic `runtime` argv (whatever host) still names the slice
    sliced_doc = next(h for h in doc["holds"] if h["allocation_id"] == sliced.allocation_id)
    assert sliced_doc["runtime"]["podman"][-2:] == ["--cgroup-parent", sliced.cgroup_parent]
    line = next(ln for ln in render_listing(listing, [podman]).splitlines() if ln.startswith("  podman 4.3.1:") and sliced.names[0] in ln)
    if parent_kept:
        assert line.endswith(f"--cgroup-parent {sliced.cgroup_parent} IMAGE ...")
    else:
        assert f"IMAGE ...  (not in the hold's slice {sliced.cgroup_parent}, so without its limits" in line
        assert "--cgroup-manager systemd" in line
    # holds without a slice are untouched
    plain = next(u for u in doc["runtimes"][0]["holds"] if u["allocation_id"] == "two-gpus")
    assert plain["note"] == "" and "--cgroup-parent" not in plain["argv"]
