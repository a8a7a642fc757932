"""Holds with real slices and the real sysfs driver switch, in the Debian guest (issue 18, points 2 and 4).

One guest for the module (tests/vm/qemu.py). In it a node runs as `bcd up` on a fake host
description (the inventory's `fakehw` adapter: the guest has no NVIDIA card), but with the
converger's slice backend forced to systemd (`BCD_SLICES=systemd`): the converger runs as
root, so it writes the holds itself (`--writer auto` is local as root) and its slices are real
transient units started through the guest's systemd over D-Bus (pystemd), with real cgroup v2
limits. `bcd up` runs under `systemd-run` so it outlives the agent's command.

- point 4: qemu's standard VGA (1234:1111, PCI class 0x0300; qemu.py uses it because bochs-display is
  class 0x0380, which the switcher rightly refuses as NotAGPU), bound by the guest to
  `bochs-drm`, is described to the inventory as a GPU at its real PCI address; the
  vfio_switcher runs beside the node with its `sysfs` backend (`bcd up` gives a fake host the
  fake backend, so it is started on its own with the node's bus credentials). An instance that
  names the card switches it to vfio-pci through real sysfs writes, and the inventory (the host
  file marks the card `real_sysfs`: its driver is read from the guest's sysfs) shows it
  Passthrough; an empty spec switches it back; with vfio-pci unloaded and blocked the switch
  fails and rolls back to bochs-drm (the switcher's reply and the converger's log say so).
- point 2: a hold with cpus, memory and huge pages makes
  `bcd.slice/bcd-alloc.slice/bcd-alloc-<id>.slice` with the right `cpuset.cpus`, `memory.max`
  and `hugetlb.2MB.max`; its release stops the slice once empty; a process placed in the slice
  keeps it past the release (seed: a slice still running a workload is kept), and the first
  pass after the process ends stops it.

Skips, with the reason, exactly as test_vm_smoke.py does (no qemu/debootstrap, or the image
cannot be built here).

Times on two cores with no KVM (TCG), another guest running beside it: the module about 4 min
(the image rebuilt for changed bcd code, the boot and `bcd up` to an answering node about 2 min;
each `bcd apply --wait` 5-15 s).
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from tests.vm.qemu import Guest, Image, ImageUnavailable, build_image, missing_tools

BUILD_TIMEOUT_S = 1800
BOOT_TIMEOUT_S = 600
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + BOOT_TIMEOUT_S + 1200)

BCD = "/opt/bcd/venv/bin/bcd"
WORK = "/root/holds"
STATE = f"{WORK}/state"
NODE_ID = "vm-node"
HUGEPAGES_2M = 16
GPU_UUID = "GPU-00000000-0000-4000-8000-0000000000f1"
ALLOC = "hold-01"
SLICE = "bcd-alloc-hold.01.slice"
CGROUP = f"/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/{SLICE}"
LIMITS = {"cpus": "1", "memory_bytes": 256 * 1024 * 1024, "hugepages": [{"page_size_kib": 2048, "count": 4}]}


@pytest.fixture(scope="module")
def image() -> Image:
    why = missing_tools()
    if why:
        pytest.skip(why)
    try:
        img, _took, _log = build_image(timeout=BUILD_TIMEOUT_S)
    except ImageUnavailable as e:
        pytest.skip(f"the VM image cannot be built here: {e}")
    return img


@pytest.fixture(scope="module")
def guest(image: Image, tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("vm")
    vm = Guest(image, workdir, boot_timeout=BOOT_TIMEOUT_S)
    try:
        vm.boot()
        yield vm
    finally:
        vm.poweroff()
    shutil.rmtree(workdir, ignore_errors=True)


DISPLAY_ID = ("0x1234", "0x1111")
DISPLAY_DRIVER = "bochs-drm"
DISPLAY_UUID = "GPU-00000000-0000-4000-8000-0000000000b0"


def display_address(vm: Guest) -> str:
    out = vm.sh(
        'for d in /sys/bus/pci/devices/*; do echo "${d##*/} $(cat $d/vendor) $(cat $d/device) $(cat $d/class)"; done'
    )
    rows = [line.split() for line in out.splitlines()]
    found = [r[0] for r in rows if tuple(r[1:3]) == DISPLAY_ID]
    assert len(found) == 1, f"one {DISPLAY_ID} display expected: {rows}"
    return found[0]


def card_driver(vm: Guest, pci: str) -> str:
    r = vm.run(["readlink", f"/sys/bus/pci/devices/{pci}/driver"])
    return r.stdout.strip().rsplit("/", 1)[-1] if r.rc == 0 else ""


def host_description(boot_id: str, display_pci: str) -> dict:
    """The fake host: the guest's 2 CPUs, one NUMA node with the huge pages reserved in the
    guest, a fake GPU for the holds, the guest's display at its real address; the guest's own
    boot id (the sysfs switcher stamps its replies with /proc's)."""
    return {
        "boot_id": boot_id,
        "memory": {"total_bytes": 2_000_000_000, "available_bytes": 1_800_000_000},
        "cpus": "0-1",
        "numa_nodes": [
            {
                "node": 0,
                "cpus": "0-1",
                "memory_bytes": 2_000_000_000,
                "hugepages": [{"page_size_kib": 2048, "total": HUGEPAGES_2M, "free": HUGEPAGES_2M}],
            }
        ],
        "gpus": [
            {
                "uuid": GPU_UUID,
                "index": 0,
                "pci_address": "0000:ff:00.0",
                "name": "NVIDIA Fake",
                "memory_bytes": 1 << 30,
                "numa_node": 0,
            },
            {
                "uuid": DISPLAY_UUID,
                "index": 1,
                "pci_address": display_pci,
                "name": "QEMU standard VGA",
                "memory_bytes": 16 << 20,
                "numa_node": 0,
                "driver": DISPLAY_DRIVER,
                "base_driver": DISPLAY_DRIVER,
                # the inventory reads its driver from the guest's sysfs, where the switcher writes
                "real_sysfs": True,
            },
        ],
        "processes": [],
        "domains": [],
    }


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
    return vm.run(["systemctl", "is-active", "--quiet", SLICE]).rc == 0


def wait_for(what: str, cond, timeout: float, vm: Guest) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s\n{converger_log(vm)}")
        time.sleep(2)


@pytest.fixture(scope="module")
def node(guest: Guest) -> Guest:
    """`bcd up` in the guest on the fake host, the converger on the real systemd slices."""
    guest.sh(f"mkdir -p {WORK} && echo {HUGEPAGES_2M} > /proc/sys/vm/nr_hugepages")
    assert guest.sh("cat /proc/sys/vm/nr_hugepages").strip() == str(HUGEPAGES_2M), "the guest kernel reserved fewer huge pages"
    boot_id = guest.sh("cat /proc/sys/kernel/random/boot_id").strip()
    guest.put_file(f"{WORK}/host.json", json.dumps(host_description(boot_id, display_address(guest))))
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
    r = vm.run(["cat", f"{CGROUP}/{name}"])
    assert r.rc == 0, f"{CGROUP}/{name}: {r.stderr.strip()}\n{vm.sh(f'ls {CGROUP}', check=False)}\n{converger_log(vm)}"
    return r.stdout.strip()


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


# ------------------------------------------------------------------ point 4: the display as a GPU


def switcher_journal(vm: Guest) -> str:
    return vm.sh("journalctl -u bcd-vm-switcher --no-pager -o cat | tail -n 40 | cut -c1-600", check=False)


@pytest.fixture(scope="module")
def switcher(node: Guest) -> str:
    """vfio_switcher with its sysfs backend on the node's bus; the display's PCI address."""
    pci = display_address(node)
    assert card_driver(node, pci) == DISPLAY_DRIVER, f"{pci} starts on {card_driver(node, pci)!r}"
    node.sh("modprobe vfio-pci")
    info = json.loads(node.sh(f"cat {STATE}/node.json"))
    env = {
        "BCD_NODE_ID": NODE_ID,
        "BCD_NATS_URL": info["nats_url"],
        "BCD_NATS_USER": "vfio_switcher",
        "BCD_NATS_PASSWORD_FILE": f"{info['creds_dir']}/vfio_switcher.password",
        "BCD_BACKEND": "sysfs",
        "BCD_DATA_DIR": f"{STATE}/data",
        "BCD_LOG_FORMAT": "json",
        "BCD_METRICS_PORT": "0",
    }
    argv = ["systemd-run", "--unit=bcd-vm-switcher"]
    for k, v in env.items():
        argv += ["-E", f"{k}={v}"]
    node.run([*argv, "/opt/bcd/venv/bin/python", "-m", "services.vfio_switcher"], check=True)
    wait_for("the switcher started", lambda: '"started"' in switcher_journal(node), 90, node)
    return pci


INSTANCE = {"instance_id": "vm-1"}


def test_instance_switches_the_display_to_vfio_pci(node: Guest, switcher: str) -> None:
    pci = switcher
    out = apply(node, {"node_id": NODE_ID, "instances": [{**INSTANCE, "gpus": [pci]}]}, "instance")
    assert out["outcome"] == "CONVERGED", out
    wait_for(f"{pci} on vfio-pci", lambda: card_driver(node, pci) == "vfio-pci", 90, node)
    assert node.sh(f"cat /sys/bus/pci/devices/{pci}/driver_override").strip() == "vfio-pci"
    assert '"Switched"' in switcher_journal(node) or "Switched" in switcher_journal(node), switcher_journal(node)
    # the group's VFIO device node exists
    group = node.sh(f"readlink /sys/bus/pci/devices/{pci}/iommu_group").strip().rsplit("/", 1)[-1]
    assert node.run(["test", "-c", f"/dev/vfio/{group}"]).rc == 0, f"/dev/vfio/{group} missing"


def test_inventory_shows_the_switched_display_as_passthrough(node: Guest, switcher: str) -> None:
    pci = switcher
    if card_driver(node, pci) != "vfio-pci":
        pytest.skip("the display is not on vfio-pci")
    deadline = time.monotonic() + 60
    while True:
        r = bcd(node, f"gpu list {pci} --json", timeout=20)
        card = json.loads(r.stdout)[0] if r.rc in (0, 1) and r.stdout.strip() else {}
        mode = card.get("driver_binding", {}).get("mode")
        if mode == "Passthrough" or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert (mode, card.get("phase")) == ("Passthrough", "Passthrough"), card
    assert card["driver_binding"]["driver"] == "vfio-pci", card


def test_empty_spec_switches_the_display_back(node: Guest, switcher: str) -> None:
    pci = switcher
    if card_driver(node, pci) != "vfio-pci":
        apply(node, {"node_id": NODE_ID, "instances": [{**INSTANCE, "gpus": [pci]}]}, "instance")
        wait_for(f"{pci} on vfio-pci", lambda: card_driver(node, pci) == "vfio-pci", 90, node)
    apply(node, {"node_id": NODE_ID}, "no-instance")
    wait_for(f"{pci} back on {DISPLAY_DRIVER}", lambda: card_driver(node, pci) == DISPLAY_DRIVER, 120, node)
    assert node.sh(f"cat /sys/bus/pci/devices/{pci}/driver_override").strip() in ("", "(null)")


def test_a_failed_switch_rolls_back_to_the_native_driver(node: Guest, switcher: str) -> None:
    pci = switcher
    if card_driver(node, pci) != DISPLAY_DRIVER:
        pytest.skip(f"{pci} is not on {DISPLAY_DRIVER}")
    # vfio-pci cannot bind: unloaded, and any load of it fails
    node.sh("echo 'install vfio-pci /bin/false' > /etc/modprobe.d/bcd-vm-no-vfio.conf; modprobe -r vfio-pci")
    try:
        assert node.run(["test", "-e", "/sys/bus/pci/drivers/vfio-pci"]).rc != 0, "vfio-pci still loaded"
        apply(node, {"node_id": NODE_ID, "instances": [{**INSTANCE, "gpus": [pci]}]}, "instance-fails")

        def rolled_back() -> bool:
            return '"rolled_back": true' in switcher_journal(node)

        wait_for("a switch that failed and rolled back", rolled_back, 90, node)
        assert card_driver(node, pci) == DISPLAY_DRIVER, f"{pci} left on {card_driver(node, pci)!r}\n{switcher_journal(node)}"
        log = node.sh(f"cat {STATE}/logs/converger.log")
        assert "GPU switch not done" in log and '"rolled_back": true' in log, converger_log(node)
    finally:
        node.sh("rm -f /etc/modprobe.d/bcd-vm-no-vfio.conf; modprobe vfio-pci", check=False)
        apply(node, {"node_id": NODE_ID}, "no-instance-again")
