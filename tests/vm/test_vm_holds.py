"""Holds with real slices, the converger as root, in the Debian guest (issue 18, point 2).

A guest of the module's own (tests/vm/conftest.py). In it a node runs as `bcd up` on a fake
host description (the inventory's `fakehw` adapter: the guest has no NVIDIA card), but with the
converger's slice backend forced to systemd (`BCD_SLICES=systemd`): the converger runs as
root, so it writes the holds itself (`--writer auto` is local as root) and its slices are real
transient units started through the guest's systemd over D-Bus (pystemd), with real cgroup v2
limits. `bcd up` runs under `systemd-run` so it outlives the agent's command. (The same holds
through the root helper, for an unprivileged converger under the units, are test_vm_units.py's.)

A hold with cpus, memory and huge pages makes `bcd.slice/bcd-alloc.slice/bcd-alloc-<id>.slice`
with the right `cpuset.cpus`, `memory.max` and `hugetlb.2MB.max`; its release stops the slice
once empty; a process placed in the slice keeps it past the release (seed: a slice still running
a workload is kept), and the first pass after the process ends stops it.

Skips, with the reason, as every VM suite does (no qemu/debootstrap, or the image cannot be
built here). Times on two cores with no KVM (TCG): the boot and `bcd up` to an answering node
about 2 min; each `bcd apply --wait` 5-15 s.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.vm.conftest import booted_guest
from tests.vm import guestkit
from tests.vm.guestkit import BOOT_TIMEOUT_S, BUILD_TIMEOUT_S, HUGEPAGES_2M, LIMITS, cgroup_of, host_description, reserve_hugepages, slice_of
from tests.vm.qemu import Guest, Image

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + BOOT_TIMEOUT_S + 900)

BCD = "/opt/bcd/venv/bin/bcd"
WORK = "/root/holds"
STATE = f"{WORK}/state"
NODE_ID = "vm-node"
GPU_UUID = "GPU-00000000-0000-4000-8000-0000000000f1"
ALLOC = "hold-01"
SLICE = slice_of(ALLOC)
CGROUP = cgroup_of(ALLOC)


@pytest.fixture(scope="module")
def guest(vm_image: Image, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guest]:
    yield from booted_guest(vm_image, tmp_path_factory, "holds")


def spec(*holds: dict) -> dict:
    return {"node_id": NODE_ID, "devices": list(holds)}


HOLD = {
    "allocation_id": ALLOC,
    "reservation_id": "rsv-hold-01",
    "binding": "BINDING_HOLD",
    "devices": [GPU_UUID],
    "limits": LIMITS,
}


def bcd(vm: Guest, args: str, timeout: float = 120.0):
    return vm.run(f"BCD_STATE_DIR={STATE} timeout {int(timeout)} {BCD} {args}", timeout=timeout + 10)


def apply(vm: Guest, doc: dict, name: str) -> dict:
    """`bcd apply --wait --json` of `doc`; its JSON document."""
    vm.put_file(f"{WORK}/{name}.json", json.dumps(doc))
    r = bcd(vm, f"apply --wait --wait-timeout 100 --json {WORK}/{name}.json", timeout=120)
    assert r.rc == 0, f"bcd apply {name}: exit {r.rc}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{converger_log(vm)}"
    return json.loads(r.stdout)


def converger_log(vm: Guest, lines: int = 30) -> str:
    return "--- converger.log:\n" + vm.sh(f"tail -n {lines} {STATE}/logs/converger.log 2>&1 | cut -c1-400", check=False)


def slice_active(vm: Guest) -> bool:
    return guestkit.slice_active(vm, ALLOC)


def wait_for(what: str, cond, timeout: float, vm: Guest) -> None:  # noqa: ANN001
    guestkit.wait_for(what, cond, timeout, lambda: converger_log(vm))


@pytest.fixture(scope="module")
def node(guest: Guest) -> Guest:
    """`bcd up` in the guest on the fake host, the converger on the real systemd slices."""
    guest.sh(f"mkdir -p {WORK}")
    reserve_hugepages(guest, HUGEPAGES_2M)
    # no boot id: every service reads the guest's own
    guest.put_file(f"{WORK}/host.json", json.dumps(host_description(None, [(GPU_UUID, "0000:ff:00.0")], HUGEPAGES_2M)))
    up = [
        "systemd-run", "--unit=bcd-node", "-E", "BCD_SLICES=systemd", "-E", "HOME=/root", f"--working-directory={WORK}",
        BCD, "up", "--node-id", NODE_ID, "--state-dir", STATE, "--fake-host", f"{WORK}/host.json", "--any-ports",
        "--services", "signer,inventory,converger,gateway_bridge",
    ]
    guest.run(up, check=True)
    deadline = time.monotonic() + 240
    while True:
        r = bcd(guest, "status", timeout=15)
        if r.rc in (0, 1):
            break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the node did not answer in 240 s: {r.stderr[-1000:]}\n"
                + guest.sh("systemctl status bcd-node --no-pager -n 30", check=False)
            )
        time.sleep(3)
    return guest


def cgroup_file(vm: Guest, name: str) -> str:
    return guestkit.cgroup_file(vm, ALLOC, name, lambda: converger_log(vm))


def test_hold_binds_with_a_real_slice_and_its_limits(node: Guest) -> None:
    out = apply(node, spec(HOLD), "bind")
    assert out["outcome"] == "CONVERGED", out
    (a,) = out["allocations"]
    assert (a["result"], a["cgroup_parent"]) == ("bound", SLICE), a
    assert slice_active(node)
    # the unit systemd made, its cgroup where the seed says, and the kernel's limits in it
    assert node.sh(f"systemctl show -P ControlGroup {SLICE}").strip() == f"/bcd.slice/bcd-alloc.slice/{SLICE}"
    assert cgroup_file(node, "cpuset.cpus") == LIMITS["cpus"]
    assert cgroup_file(node, "memory.max") == str(LIMITS["memory_bytes"])
    assert cgroup_file(node, "hugetlb.2MB.max") == str(4 * 2048 * 1024)


def test_release_stops_the_empty_slice(node: Guest) -> None:
    if not slice_active(node):
        apply(node, spec(HOLD), "bind")
    out = apply(node, spec(), "release")
    assert out["counts"]["released"] == 1, out
    wait_for("the empty slice stopped after the release", lambda: not slice_active(node), 60, node)
    assert node.run(["test", "-e", CGROUP]).rc != 0, f"{CGROUP} still there"


def test_a_workload_keeps_the_slice_past_the_release(node: Guest) -> None:
    out = apply(node, spec(HOLD), "rebind")
    assert out["allocations"][0]["result"] == "bound", out
    node.run(["systemd-run", "--unit=bcd-vm-workload", f"--slice={SLICE}", "sleep", "3600"], check=True)
    pid = node.sh("systemctl show -P MainPID bcd-vm-workload").strip()
    assert pid in cgroup_file(node, "cgroup.procs").split() or pid in node.sh(
        f"cat {CGROUP}/bcd-vm-workload.service/cgroup.procs", check=False
    ).split(), "the workload is not in the slice"
    out = apply(node, spec(), "release-busy")
    assert out["outcome"] == "CONVERGED", out
    time.sleep(3)
    assert slice_active(node), f"the slice went while its workload runs\n{converger_log(node)}"
    assert "slice kept" in node.sh(f"cat {STATE}/logs/converger.log"), converger_log(node)
    node.run(["systemctl", "stop", "bcd-vm-workload"], check=True)
    # the next pass (a new generation of the same empty spec) stops the leftover slice
    apply(node, spec(), "release-again")
    wait_for("the leftover slice stopped once its workload ended", lambda: not slice_active(node), 60, node)
    assert "leftover slice stopped" in node.sh(f"cat {STATE}/logs/converger.log"), converger_log(node)
