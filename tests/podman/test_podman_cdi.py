"""Debian 12's podman 4.3.1 (CDI library v0.5) uses every kind of hold a real node binds.

Before the consumer copies it refused them all (`unresolvable CDI devices`;
under --log-level debug: `unknown field "annotations"`): the hold spec needs
cdiVersion 0.6.0 and that library knows 0.5.0 at most. A whole node (`bcd up`
on the 8 x H200 fake host, MPS running with a pipe directory of this test's)
binds a whole GPU with limits, a MIG instance, two slots, and a Kubernetes
hold; a second node on a host with no vendor CDI spec binds an env-only hold.
For each, the podman command `bcd cdi list` prints runs a container that sees
the hold's env, its device nodes and mounts (and, for a slot, the MPS pipe
directory, and nothing of the host's /dev/shm). A released hold's name no longer resolves;
the hold spec alone (no copy) is refused as before; a spec of the same device
name in /etc/cdi loses to the copy in /var/run/cdi (what a runtime that reads
both does); NVIDIA's own spec beside bcd's keeps working.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import EXAMPLE_HOSTS
from tests.integration.wholenode import GPU, Node, assignment, bcd

from .podmankit import HostStubs, Podman, namespaced, read_specs, spec_paths

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

MIG = f"{GPU[6]}/gi1/ci0"
SLOTS = (f"{GPU[4]}/slot0", f"{GPU[4]}/slot1")


def _spec(*assignments: dict) -> dict:
    return {"node_id": "node-1", "devices": list(assignments)}


SPEC = _spec(
    assignment("train-01", GPU[0], cpus="0-3", memory_bytes=1 << 30),
    assignment("mig-a", MIG),
    assignment("slot-a", SLOTS[0]),
    assignment("slot-b", SLOTS[1]),
    {**assignment("kube-1", GPU[2]), "binding": "BINDING_KUBERNETES"},
)


class Holds:
    """A node's holds as `bcd cdi list --json` prints them where its CDI dir is /etc/cdi and its
    consumer dir /var/run/cdi (a host's layout: here bind mounts in a mount namespace)."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.cdi_dir = node.state / "cdi"
        self.consumer_dir = node.state / "run" / "cdi"
        cmd = [sys.executable, "-m", "bcd.cli", "cdi", "list", "--json", "--cdi-dir", "/etc/cdi", "--cdi-consumer-dir", "/var/run/cdi"]
        out = namespaced(cmd, self.cdi_dir, self.consumer_dir)
        assert out.returncode == 0, out.stdout + out.stderr
        self.listing = json.loads(out.stdout)
        self.by_alloc = {h["allocation_id"]: h for h in self.listing["holds"]}
        (podman,) = [r for r in self.listing["runtimes"] if r["name"] == "podman"]
        self.podman = {u["allocation_id"]: u for u in podman["holds"]}

    def podman_argv(self, alloc: str) -> list[str]:
        """The podman command `bcd cdi list` prints for the hold on this host."""
        use = self.podman[alloc]
        assert use["usable"] and use["argv"], use
        return use["argv"]

    def spec(self, alloc: str) -> dict[str, Any]:
        return json.loads((self.cdi_dir / f"bcd-{alloc}.json").read_text())

    def copy(self, alloc: str) -> dict[str, Any]:
        return json.loads((self.consumer_dir / f"bcd-{alloc}.json").read_text())


def _start(tmp: Path, host: dict, spec: dict) -> Node:
    (tmp / "host.json").write_text(json.dumps(host))
    node = Node(tmp, host=tmp / "host.json").start()
    try:
        generation = node.apply(spec)
        node.wait_generation(generation, timeout=120)
    except BaseException:
        node.stop()
        raise
    return node


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="bcd-podman-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def mps_dir(scratch: Path) -> Path:
    """The fake host's MPS pipe directory, with the control pipe a running daemon makes."""
    d = scratch / "nvidia-mps"
    d.mkdir()
    (d / "control").write_text("")
    return d


@pytest.fixture(scope="module")
def shm_marker() -> Iterator[Path]:
    """A file in the host's /dev/shm, as another tenant's (or root's MPS server's) shared memory would be."""
    path = Path(tempfile.mkstemp(prefix="bcd-podman-mps-", dir="/dev/shm")[1])
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def gpu_node(podman: Podman, scratch: Path, mps_dir: Path) -> Iterator[Node]:
    host = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
    host["mps_pipe_dir"], host["mps_running"] = str(mps_dir), True
    (scratch / "gpu").mkdir()
    node = _start(scratch / "gpu", host, SPEC)
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def plain_node(podman: Podman, scratch: Path) -> Iterator[Node]:
    """A host without a vendor CDI spec: each device of a hold carries only env."""
    host = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
    del host["vendor_cdi_spec"]
    (scratch / "plain").mkdir()
    node = _start(scratch / "plain", host, _spec(assignment("env-only", GPU[1])))
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="module")
def stubs(gpu_node: Node) -> Iterator[HostStubs]:
    made = HostStubs()
    made.cover(read_specs(gpu_node.state / "cdi", gpu_node.state / "run" / "cdi"))
    try:
        yield made
    finally:
        made.remove()


def _env(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _nodes_of(spec: dict[str, Any]) -> list[str]:
    """The container paths of every device node of a spec."""
    return sorted({n["path"] for edits in [spec["containerEdits"], *(d["containerEdits"] for d in spec["devices"])] for n in edits.get("deviceNodes", [])})


def _check_nodes_script(paths: list[str]) -> str:
    return "; ".join(f'test -c {p} || echo "MISSING {p}"' for p in paths)


def run_hold(podman: Podman, holds: Holds, alloc: str, extra: str = "") -> tuple[dict[str, str], str]:
    """Run the podman command `bcd cdi list` prints for the hold; (the container's env, its other output)."""
    spec = holds.spec(alloc)
    script = "; ".join(part for part in (_check_nodes_script(_nodes_of(spec)), extra.rstrip(";"), "echo ===ENV", "env") if part)
    r = podman.run(holds.podman_argv(alloc), script, holds.cdi_dir, holds.consumer_dir)
    assert r.returncode == 0, f"{alloc}: podman exited {r.returncode}\n{r.stderr}\n{r.stdout}"
    before, _, env = r.stdout.partition("===ENV\n")
    assert "MISSING" not in before, before
    return _env(env), before


def test_the_node_dirs_as_they_are_get_no_podman_command(gpu_node: Node, podman: Podman) -> None:
    """`bcd cdi list` prints only commands that work: podman 4.3 reads no dirs under state/."""
    out = bcd("cdi", "list", "--json", "--state-dir", str(gpu_node.state))
    doc = json.loads(out.stdout)
    (pm,) = [r for r in doc["runtimes"] if r["name"] == "podman"]
    assert pm["holds"] and all(not u["usable"] and u["argv"] == [] and "are not dirs" in u["todo"] for u in pm["holds"]), pm


def test_the_hold_specs_need_0_6_0_and_their_copies_are_what_podman_4_3_reads(gpu_node: Node, podman: Podman) -> None:
    holds = Holds(gpu_node)
    assert set(holds.by_alloc) == {"train-01", "mig-a", "slot-a", "slot-b", "kube-1"}
    for alloc in holds.by_alloc:
        assert holds.spec(alloc)["cdiVersion"] == "0.6.0"
        copy = holds.copy(alloc)
        assert copy["cdiVersion"] == "0.3.0" and "annotations" not in copy
        assert [d["name"] for d in copy["devices"]] == [d["name"] for d in holds.spec(alloc)["devices"]]
    assert podman.version().startswith("podman version ")


def test_a_whole_gpu_with_limits(gpu_node: Node, podman: Podman, stubs: HostStubs) -> None:
    holds = Holds(gpu_node)
    manager = subprocess.run(["podman", "info", "--format", "{{.Host.CgroupManager}}"], capture_output=True, text=True, timeout=60).stdout.strip()
    # the command is one that runs here: podman under cgroupfs refuses the slice as --cgroup-parent
    assert ("--cgroup-parent" in holds.podman_argv("train-01")) is (manager != "cgroupfs")
    assert bool(holds.podman["train-01"]["note"]) is (manager == "cgroupfs")
    env, out = run_hold(podman, holds, "train-01", extra="test -e /usr/bin/nvidia-smi || echo 'MISSING nvidia-smi';")
    assert env["BCD_ALLOCATION_ID"] == "train-01"
    assert env["BCD_CGROUP_PARENT"] == "bcd-alloc-train.01.slice"
    assert env["NVIDIA_VISIBLE_DEVICES"] == GPU[0]
    assert "/dev/nvidia0" in _nodes_of(holds.spec("train-01"))


def test_a_mig_instance(gpu_node: Node, podman: Podman, stubs: HostStubs) -> None:
    holds = Holds(gpu_node)
    env, _ = run_hold(podman, holds, "mig-a")
    assert env["BCD_ALLOCATION_ID"] == "mig-a"
    assert env["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-")
    # the instance's own capability nodes, from NVIDIA's spec, are in the container
    assert any(p.startswith("/dev/nvidia-caps/") for p in _nodes_of(holds.spec("mig-a")))


@pytest.mark.parametrize("alloc", ["slot-a", "slot-b"])
def test_a_slot_reaches_the_mps_daemons_pipe_and_not_the_hosts_shm(gpu_node: Node, podman: Podman, stubs: HostStubs, mps_dir: Path, shm_marker: Path, alloc: str) -> None:
    holds = Holds(gpu_node)
    checks = f'test -e "$CUDA_MPS_PIPE_DIRECTORY/control" || echo "MISSING pipe"; test -e /dev/shm/{shm_marker.name} && echo "MISSING: the host shm is in the container";'
    env, _ = run_hold(podman, holds, alloc, extra=checks)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(mps_dir)
    assert env["NVIDIA_VISIBLE_DEVICES"] == GPU[4]


def test_a_kubernetes_hold_leaves_the_visible_devices_to_the_kubelet(gpu_node: Node, podman: Podman, stubs: HostStubs) -> None:
    env, _ = run_hold(podman, Holds(gpu_node), "kube-1")
    assert env["BCD_ALLOCATION_ID"] == "kube-1"
    assert "NVIDIA_VISIBLE_DEVICES" not in env


def test_an_env_only_hold(plain_node: Node, podman: Podman) -> None:
    holds = Holds(plain_node)
    assert not any(spec_paths([holds.spec("env-only")]))  # nothing of a vendor's: nothing to stub
    env, _ = run_hold(podman, holds, "env-only")
    (name,) = [d["name"] for d in holds.spec("env-only")["devices"]]
    assert env[f"BCD_DEVICE_{name.replace('-', '_')}"] == GPU[1]
    assert env["NVIDIA_VISIBLE_DEVICES"] == GPU[1]


def test_nvidias_own_spec_beside_bcds_still_resolves(gpu_node: Node, podman: Podman, stubs: HostStubs) -> None:
    holds = Holds(gpu_node)
    r = podman.run(["podman", "run", "--device", "nvidia.com/gpu=0"], "test -c /dev/nvidia0 && echo OK", holds.cdi_dir, holds.consumer_dir)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


def test_the_hold_spec_alone_is_refused_as_before(gpu_node: Node, podman: Podman, stubs: HostStubs, scratch: Path) -> None:
    """The class of bug the copies fix: without them podman 4.3 cannot resolve any hold."""
    holds = Holds(gpu_node)
    empty = scratch / "no-copies"
    empty.mkdir(exist_ok=True)
    r = podman.run(holds.podman_argv("train-01"), "true", holds.cdi_dir, empty)
    assert r.returncode != 0 and "unresolvable CDI devices" in r.stderr, r.stderr


def test_a_spec_in_etc_cdi_loses_to_the_copy_in_var_run_cdi(gpu_node: Node, podman: Podman, stubs: HostStubs, scratch: Path) -> None:
    """What a runtime that reads both the hold spec and its copy does: the same device name in a
    spec dir of higher priority wins (here a spec podman 4.3 can read stands in for the hold spec)."""
    holds = Holds(gpu_node)
    static = scratch / "etc-cdi"
    static.mkdir(exist_ok=True)
    stand_in = holds.copy("train-01")
    stand_in["containerEdits"]["env"] = ["BCD_ALLOCATION_ID=from-etc-cdi"]
    (static / "bcd-train-01.json").write_text(json.dumps(stand_in))
    r = podman.run(holds.podman_argv("train-01"), "env", static, holds.consumer_dir)
    assert r.returncode == 0, r.stderr
    assert _env(r.stdout)["BCD_ALLOCATION_ID"] == "train-01"


def test_a_released_hold_no_longer_resolves(gpu_node: Node, podman: Podman, stubs: HostStubs) -> None:
    before = Holds(gpu_node)
    argv = before.podman_argv("slot-b")
    generation = gpu_node.apply(_spec(*[a for a in SPEC["devices"] if a["allocation_id"] != "slot-b"]))
    gpu_node.wait_generation(generation, timeout=120)
    after = Holds(gpu_node)
    assert "slot-b" not in after.by_alloc
    assert not (after.consumer_dir / "bcd-slot-b.json").exists()
    r = podman.run(argv, "true", after.cdi_dir, after.consumer_dir)
    assert r.returncode != 0 and "unresolvable CDI devices" in r.stderr, r.stderr
    # the other slot on the same card still does
    env, _ = run_hold(podman, after, "slot-a")
    assert env["BCD_ALLOCATION_ID"] == "slot-a"
