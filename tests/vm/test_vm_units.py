"""bcd deployed as systemd units on a real systemd (issue 18, points 1, 3, 4 and 5).

The session's system guest (tests/vm/conftest.py; test_vm_smoke.py looked at it as booted), bcd
installed into it by tests/vm/guestkit.py as docs/install.md tells an operator: sections 2-5, 7
and 9, with an upstream and the reference control plane in the guest (`GuestControlPlane`), a
host description for the inventory only (three fake GPUs and the guest's real PCI display), and
the helper left out as section 8 leaves it until the operator enables it. Everything is asserted
on the live system, never on the file alone, and in this order (each step builds on the last):

- point 1: every unit bcd.target wants reaches active, users made by systemd-sysusers, the bus on
  loopback only;
- point 3, without the helper: the converger is an ordinary user on a real host, so the node is
  unprivileged exactly as the seed says: its Hello (as the control plane reads it) claims none of
  cdi / devices.limits / binding.kubernetes, a hold fails at once with node-unprivileged and
  writes nothing, `bcd doctor` warns gpu-binding;
- point 3 with `bcd-helper.service` enabled (section 8): the converger finds it, the Hello claims
  the capabilities, and a hold with cpus, memory and huge-page limits binds through it with a
  real slice (point 2 through the helper): the cgroup
  `bcd.slice/bcd-alloc.slice/bcd-alloc-<id>.slice` with `cpuset.cpus`, `memory.max` and
  `hugetlb.2MB.max`, the hold files root's; a release stops the empty slice, a process in the
  slice keeps it past the release and the next pass after it ends stops it;
- point 1 for every unit, the helper included: each runs as the user its unit names (the
  Uid/Gid lines of /proc/<MainPID>/status against `getent passwd`) with no capability at all,
  and the hardening `systemctl show` reads back is what the unit file declares;
- point 4: the display, described to the inventory as a GPU, is switched to vfio-pci by
  `bcd-vfio-switcher.service` through real sysfs writes when an instance names it, shows up as
  Passthrough, is switched back when the spec drops the instance; with vfio-pci unloaded and
  blocked the switch fails and rolls back to its native driver;
- point 5: with two holds bound (one sliced), `systemctl restart` of each unit, one at a time,
  keeps every unit active, the node healthy and both holds bound with their files, and no second
  Bound reaches the control plane; no unit is restarted by Restart=on-failure on the way; a
  reboot brings every unit back, /run/bcd (tmpfs) made again by tmpfiles.d, the env files
  rewritten, the slice and its limits made again, still no second Bound; `systemd-analyze
  security` of each running unit gives the figure `--offline=yes` gives for its file;
- point 3 again: the helper stopped, the node is unprivileged once --helper-lost-after (30 s)
  has passed: the Hello drops the capabilities, a new hold fails with node-unprivileged, the
  kept holds stay, doctor warns; started again, it is privileged again.

Skips, with the reason, as every VM suite does (no qemu/debootstrap, or the image cannot be
built here). The times are printed at the session's end (`-s`); see the module's note in
README "VM suites".
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

from tests.unit.test_systemd_units import ROOT_MAX_EXPOSURE, ROOT_UNITS, UNPRIVILEGED_MAX_EXPOSURE
from tests.vm import guestkit
from tests.vm.guestkit import (
    BOOT_TIMEOUT_S,
    BUILD_TIMEOUT_S,
    DISPLAY_DRIVER,
    FIGURES,
    HUGEPAGES_2M,
    LIMITS,
    NODE_ID,
    TIMES,
    GuestControlPlane,
    card_driver,
    cgroup_file,
    cgroup_of,
    display_address,
    host_description,
    journal,
    node_status,
    slice_active,
    slice_of,
    wait_for,
)
from tests.vm.qemu import Guest

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + BOOT_TIMEOUT_S + 900)

UNITS = guestkit.target_units()
HELPER = "bcd-helper.service"
#: every unit once the operator has enabled the helper (section 8)
ALL_UNITS = [*UNITS, HELPER]
GPUS = [
    ("GPU-00000000-0000-4000-8000-0000000000f1", "0000:ff:00.0"),
    ("GPU-00000000-0000-4000-8000-0000000000f2", "0000:fe:00.0"),
    # free for the hold the helper-less node refuses at the end (no overlap to hide behind)
    ("GPU-00000000-0000-4000-8000-0000000000f3", "0000:fd:00.0"),
]
#: what an unprivileged node's Hello must not claim (seed: "Hello claims nothing")
HOST_CAPABILITIES = {"cdi", "devices.limits", "binding.kubernetes"}

#: hardening settings read back with `systemctl show`, and the value systemd shows when the
#: unit file does not set them
HARDENING_DEFAULTS = {
    "NoNewPrivileges": "no",
    "ProtectSystem": "no",
    "ProtectHome": "no",
    "PrivateTmp": "no",
    "PrivateDevices": "no",
    "DevicePolicy": "auto",
    "PrivateUsers": "no",
    "PrivateIPC": "no",
    "PrivateMounts": "no",
    "ProtectKernelTunables": "no",
    "ProtectKernelModules": "no",
    "ProtectKernelLogs": "no",
    "ProtectControlGroups": "no",
    "ProtectClock": "no",
    "ProtectHostname": "no",
    "ProtectProc": "default",
    "ProcSubset": "all",
    "RestrictRealtime": "no",
    "RestrictSUIDSGID": "no",
    "RemoveIPC": "no",
    "LockPersonality": "no",
    "MemoryDenyWriteExecute": "no",
    "UMask": "0022",
}

def unit_file(name: str) -> dict[str, list[str]]:
    """The repo's unit file: every key's values in order (comments and sections dropped)."""
    out: dict[str, list[str]] = {}
    for line in (guestkit.UNIT_DIR / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")) or "=" not in line:
            continue
        k, v = line.split("=", 1)
        out.setdefault(k.strip(), []).append(v.strip())
    return out


def hold(alloc: str, gpu: int, limits: dict[str, Any] | None = None) -> dict[str, Any]:
    h: dict[str, Any] = {
        "allocation_id": alloc,
        "reservation_id": f"rsv-{alloc}",
        "binding": "BINDING_HOLD",
        "devices": [GPUS[gpu][0]],
        "env": [f"VM_TEST={alloc}"],
    }
    if limits:
        h["limits"] = limits
    return h


class Node:
    """The installed node, its control plane in the guest, and what the tests put."""

    def __init__(self, vm: Guest, cp: GuestControlPlane, display: str) -> None:
        self.vm, self.cp, self.display = vm, cp, display
        self.generation = 0

    def diagnostics(self) -> str:
        return "\n".join(
            [
                "--- converger:\n" + journal(self.vm, "bcd-converger.service", 25),
                "--- helper:\n" + journal(self.vm, HELPER, 15),
                "--- bridge:\n" + journal(self.vm, "bcd-gateway-bridge.service", 10),
            ]
        )

    def put(self, devices: list[dict[str, Any]], instances: list[dict[str, Any]] | None = None) -> int:
        spec: dict[str, Any] = {"node_id": NODE_ID, "devices": devices}
        if instances:
            spec["instances"] = instances
        self.generation = self.cp.put(spec, name=f"spec-{self.generation + 1}")
        return self.generation

    def section(self, *states: str, timeout: float = 120.0) -> dict[str, Any]:
        """The converger's status once its devices section reached this generation in one of ``states``."""
        gen = self.generation

        def reached() -> dict[str, Any] | None:
            conv = node_status(self.vm)["converger"] or {}
            sec = conv.get("section") or {}
            return conv if sec.get("observed_generation") == gen and sec.get("state") in states else None

        return wait_for(f"the devices section at generation {gen} {'/'.join(states)}", reached, timeout, self.diagnostics)

    def bound(self) -> dict[str, int]:
        """allocation -> how many distinct Bound events (by event id) the control plane took."""
        ids: dict[str, set[str]] = {}
        for r in self.cp.events("bound"):
            assert r["outcome"] != "rejected", r
            ids.setdefault(r["allocation_id"], set()).add(r["event_id"])
        return {a: len(s) for a, s in ids.items()}

    def wait_events(self, kind: str, alloc: str, timeout: float = 90.0) -> list[dict[str, Any]]:
        return wait_for(
            f"a {kind} event of {alloc} at the control plane",
            lambda: [r for r in self.cp.events(kind) if r.get("allocation_id") == alloc],
            timeout,
            self.diagnostics,
        )

    def capabilities(self) -> set[str]:
        hello = self.cp.hello(NODE_ID)
        assert hello is not None, "no Hello at the control plane"
        return set(hello["capabilities"])

    def slice_active(self, alloc: str) -> bool:
        return slice_active(self.vm, alloc)

    def cgroup_file(self, alloc: str, name: str) -> str:
        return cgroup_file(self.vm, alloc, name, self.diagnostics)

    def hold_files(self) -> list[str]:
        # the hold specs, their env files and their consumer copies (tmpfs /run/cdi, docs/cdi-runtimes.md)
        out = self.vm.sh("find /etc/cdi /run/bcd/allocations /run/cdi -type f ! -name nvidia.json | sort", check=False)
        return out.split()


@pytest.fixture(scope="module")
def node(system_guest: Guest) -> Node:
    vm = system_guest
    t0 = time.monotonic()
    guestkit.reserve_hugepages(vm, HUGEPAGES_2M)
    pci = display_address(vm)
    cp = GuestControlPlane(vm).start()
    TIMES["units.controlplane"] = time.monotonic() - t0
    took = guestkit.install_bcd(vm, host_description(pci, GPUS, HUGEPAGES_2M), upstream=cp)
    TIMES.update({f"units.install.{k}": v for k, v in took.items()})
    return Node(vm, cp, pci)


def _healthy(node: Node, timeout: float = 150.0, services: list[str] | None = None):
    """`bcd status` until it exits 0 and `bcd ping` (exit 0: every service node.json lists
    answered) lists ``services`` (default: every unit's), bounded; the last `bcd status` result."""
    want = set(services or SERVICES)
    deadline = time.monotonic() + timeout
    while True:
        ping = guestkit.cli(node.vm, "ping", timeout=60)
        answered = {line.split()[0] for line in ping.stdout.splitlines()[1:] if line.strip()}
        r = guestkit.cli(node.vm, "status", timeout=60)
        missing = sorted(want - answered)
        if missing or ping.rc != 0:
            r.rc = r.rc or 1
            r.stderr += f"\nbcd ping (exit {ping.rc}) does not list {missing}:\n{ping.stdout}{ping.stderr}"
        if r.rc == 0 or time.monotonic() > deadline:
            return r
        time.sleep(3)


def service_of(unit: str) -> str:
    return unit.removeprefix("bcd-").removesuffix(".service").replace("-", "_")


#: the services `bcd ping` must list (every unit of the target but the bus and its setup)
SERVICES = sorted(service_of(u) for u in UNITS if u not in ("bcd-bus.service", "bcd-bus-setup.service"))


# ----------------------------------------------------------------------------- point 1: the target


def test_every_unit_of_the_target_is_active(node: Node) -> None:
    states = guestkit.wait_active(node.vm, UNITS, timeout=120, settle=10)
    assert set(states) == set(UNITS)
    assert node.vm.sh("systemctl is-enabled bcd.target").strip() == "enabled"
    assert node.vm.sh("systemctl is-active bcd.target", check=False).strip() == "active"
    # the helper is optional: not started by the target until the operator enables it
    assert node.vm.run(["systemctl", "is-active", "--quiet", HELPER]).rc != 0


def test_sysusers_made_every_unit_user(node: Node) -> None:
    for line in (guestkit.UNIT_DIR / "sysusers.d" / "bcd.conf").read_text().splitlines():
        cols = line.split()
        if cols and cols[0] == "u":
            entry = node.vm.sh(f"getent passwd {cols[1]}").strip().split(":")
            assert entry[0] == cols[1] and int(entry[2]) < 1000, entry
            assert entry[6] in ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false"), entry


def test_the_bus_listens_on_loopback_only(node: Node) -> None:
    out = node.vm.sh("ss -Htlnp")
    ours = [line for line in out.splitlines() if "nats-server" in line and ":4333 " not in line]
    assert any(":4222 " in line for line in ours) and any(":8222 " in line for line in ours), out
    assert all(line.split()[3].startswith(("127.0.0.1:", "[::1]:")) for line in ours), ours


def test_the_node_reaches_its_control_plane(node: Node) -> None:
    r = _healthy(node)
    assert r.rc == 0, f"bcd status: exit {r.rc}\n{r.stdout}\n{r.stderr}"
    hello = wait_for("the node's Hello at the control plane", lambda: node.cp.hello(NODE_ID), 120, node.diagnostics)
    assert hello["boot_id"] == node.vm.boot_id, (hello["boot_id"], node.vm.boot_id)


# ----------------------------------------------------------------------------- point 3: no helper


def test_without_the_helper_the_node_is_unprivileged(node: Node) -> None:
    conv = guestkit.converger_status(node.vm)
    assert conv["privileged"] is False, conv
    caps = node.capabilities()
    assert not HOST_CAPABILITIES & caps, caps
    assert "running unprivileged" in journal(node.vm, "bcd-converger.service", 200)

    node.put([hold("train-00", 0, LIMITS)])
    conv = node.section("FAILED")
    assert conv["failures"] == {"train-00": "node-unprivileged"}, conv
    (failed,) = node.wait_events("failed", "train-00")
    assert failed["event"]["reason"] == "node-unprivileged", failed
    # nothing written: no CDI spec, env file or slice
    assert node.hold_files() == []
    assert not node.slice_active("train-00")
    assert node.bound() == {}
    doctor = guestkit.cli(node.vm, "doctor")
    # those two (the section failed over that hold) and nothing else: a host with no kubelet
    # is not warned about its kubelet plugins
    warnings = [line.split()[1] for line in doctor.stdout.splitlines() if line.startswith(("WARN", "FAIL"))]
    assert warnings == ["gpu-binding", "section"], doctor.stdout + doctor.stderr
    # the name column is as wide as the longest name doctor prints (render_doctor)
    rows = [line.split(None, 2) for line in doctor.stdout.splitlines() if line.startswith("WARN")]
    assert ["WARN", "section", "devices section FAILED: train-00: node-unprivileged"] in rows, doctor.stdout


# ----------------------------------------------------------------------------- point 3: the helper


def test_the_helper_unit_makes_the_node_privileged(node: Node) -> None:
    vm = node.vm
    # docs/install.md section 8: write-config again with --with-helper (bcd status and ping
    # expect it from now on), then the unit
    vm.sh(
        f"{guestkit.VENV}/bin/python -m bcd.nodebus write-config --node-id {NODE_ID} --bus-dir /etc/bcd/bus "
        "--store-dir /var/lib/bcd/nats --port 4222 --http-port 8222 --state-dir /etc/bcd "
        "--data-dir /var/lib/bcd/converger --with-helper",
        timeout=120,
    )
    vm.sh(f"systemctl enable --now {HELPER}", timeout=120)
    guestkit.wait_active(vm, ALL_UNITS, timeout=120)
    # the converger looks every --helper-recheck-interval (30 s)
    wait_for("the converger to find the helper", lambda: guestkit.converger_status(vm)["privileged"], 90, node.diagnostics)
    assert "root helper found" in journal(vm, "bcd-converger.service", 200)
    caps = wait_for("a Hello with the host capabilities", lambda: HOST_CAPABILITIES <= node.capabilities(), 60, node.diagnostics)
    assert caps
    r = _healthy(node, services=[*SERVICES, "helper"])
    assert r.rc == 0, f"bcd status: exit {r.rc}\n{r.stdout}\n{r.stderr}"


def test_a_hold_binds_through_the_helper_with_a_real_slice(node: Node) -> None:
    vm = node.vm
    node.put([hold("train-01", 0, LIMITS), hold("infer-01", 1)])
    conv = node.section("CONVERGED")
    assert {h["allocation_id"] for h in conv["holds"]} == {"train-01", "infer-01"}, conv
    node.wait_events("bound", "train-01")
    node.wait_events("bound", "infer-01")
    assert node.slice_active("train-01")
    assert not node.slice_active("infer-01"), "a hold with no limits has no slice"
    # the unit systemd made, its cgroup where the seed says, and the kernel's limits in it
    assert vm.sh(f"systemctl show -P ControlGroup {slice_of('train-01')}").strip() == f"/bcd.slice/bcd-alloc.slice/{slice_of('train-01')}"
    assert node.cgroup_file("train-01", "cpuset.cpus") == LIMITS["cpus"]
    assert node.cgroup_file("train-01", "memory.max") == str(LIMITS["memory_bytes"])
    assert node.cgroup_file("train-01", "hugetlb.2MB.max") == str(4 * 2048 * 1024)
    # the files are the helper's (root, world-readable), the converger only reads them
    files = node.hold_files()
    assert files == [
        "/etc/cdi/bcd-infer-01.json",
        "/etc/cdi/bcd-train-01.json",
        "/run/bcd/allocations/infer-01.env",
        "/run/bcd/allocations/train-01.env",
        "/run/cdi/bcd-infer-01.json",
        "/run/cdi/bcd-train-01.json",
    ], files
    assert vm.sh("stat -c '%U %a' " + " ".join(files)).split() == ["root", "644"] * 6
    env = vm.sh("cat /run/bcd/allocations/train-01.env")
    assert f"BCD_CGROUP_PARENT={slice_of('train-01')}" in env and "VM_TEST=train-01" in env, env
    assert '"operation done"' in journal(vm, HELPER, 200)


def test_release_stops_the_empty_slice(node: Node) -> None:
    node.put([hold("infer-01", 1)])
    node.section("CONVERGED")
    node.wait_events("released", "train-01")
    wait_for("the empty slice stopped after the release", lambda: not node.slice_active("train-01"), 60, node.diagnostics)
    assert node.vm.run(["test", "-e", cgroup_of("train-01")]).rc != 0, f"{cgroup_of('train-01')} still there"
    assert node.hold_files() == ["/etc/cdi/bcd-infer-01.json", "/run/bcd/allocations/infer-01.env", "/run/cdi/bcd-infer-01.json"]


def test_a_workload_keeps_the_slice_past_the_release(node: Node) -> None:
    vm = node.vm
    node.put([hold("train-02", 0, LIMITS), hold("infer-01", 1)])
    node.section("CONVERGED")
    assert node.slice_active("train-02")
    vm.run(["systemd-run", "--unit=bcd-vm-workload", f"--slice={slice_of('train-02')}", "sleep", "3600"], check=True)
    pid = vm.sh("systemctl show -P MainPID bcd-vm-workload").strip()
    assert pid in vm.sh(f"cat {cgroup_of('train-02')}/bcd-vm-workload.service/cgroup.procs"), "the workload is not in the slice"
    node.put([hold("infer-01", 1)])
    node.section("CONVERGED")
    node.wait_events("released", "train-02")
    time.sleep(3)
    assert node.slice_active("train-02"), f"the slice went while its workload runs\n{node.diagnostics()}"
    assert "slice kept" in journal(vm, "bcd-converger.service", 300), node.diagnostics()
    vm.run(["systemctl", "stop", "bcd-vm-workload"], check=True)
    # the next pass (a new generation of the same spec) stops the leftover slice
    node.put([hold("infer-01", 1)])
    node.section("CONVERGED")
    wait_for("the leftover slice stopped once its workload ended", lambda: not node.slice_active("train-02"), 60, node.diagnostics)
    assert "leftover slice stopped" in journal(vm, "bcd-converger.service", 300), node.diagnostics()


# ----------------------------------------------------------------------------- point 1: every unit


def test_the_bus_setup_made_the_streams_as_a_user_of_its_own_and_exited(node: Node) -> None:
    """bcd-bus-setup.service: a one-shot whose user exists only while it runs (DynamicUser=): it
    made the node's streams (bus_admin, no service may) and exited 0, and the bus has them."""
    vm = node.vm
    unit = "bcd-bus-setup.service"
    live = dict(line.split("=", 1) for line in vm.sh(f"systemctl show -p Result,ExecMainStatus,DynamicUser,User {unit}").splitlines() if "=" in line)
    assert live == {"Result": "success", "ExecMainStatus": "0", "DynamicUser": "yes", "User": "bcd-bus-setup"}, live
    journal = vm.sh(f"journalctl --no-pager -o cat -u {unit}", check=False)
    assert "streams of node" in journal and "ready (outbox 256 MiB)" in journal, journal[-2000:]
    assert vm.run(["getent", "passwd", "bcd-bus-setup"]).rc != 0, "its user outlived its run"
    # the outbox is there, read with no consumer at all (the bridge reads it by direct get)
    bus = json.loads(vm.sh("/opt/bcd/venv/bin/bcd bus --state-dir /etc/bcd --json", check=False))
    assert bus["outbox"]["stream"] == "BCD_OUTBOX_vm-node-1" and bus["outbox"]["consumer_count"] == 0, bus.get("outbox")


@pytest.mark.parametrize("unit", [u for u in ALL_UNITS if u not in guestkit.ONESHOT_UNITS])
def test_runs_as_its_own_user_with_no_capabilities(node: Node, unit: str) -> None:
    vm = node.vm
    declared = unit_file(unit)
    user = declared["User"][-1]
    group = declared.get("Group", [user])[-1]
    uid = int(vm.sh(f"getent passwd {user}").split(":")[2])
    gid = int(vm.sh(f"getent group {group}").split(":")[2])
    pid = guestkit.main_pid(vm, unit)
    assert pid > 0, guestkit.unit_diagnostics(vm, [unit])
    st = guestkit.proc_status(vm, pid)
    assert st["Uid"].split() == [str(uid)] * 4, f"{unit} ({pid}): Uid {st['Uid']}, {user} is {uid}"
    assert st["Gid"].split() == [str(gid)] * 4, f"{unit} ({pid}): Gid {st['Gid']}, {group} is {gid}"
    # a supplementary group would be a way round the per-service users
    assert st["Groups"].split() in ([], [str(gid)]), f"{unit}: Groups {st['Groups']}"
    assert declared["CapabilityBoundingSet"] == [""], f"{unit} declares capabilities: the check below assumes none"
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(st[cap], 16) == 0, f"{unit} ({user}): {cap} {st[cap]}"
    assert st["NoNewPrivs"] == ("1" if declared.get("NoNewPrivileges") == ["yes"] else "0"), st["NoNewPrivs"]
    assert st["Seccomp"] == "2", f"{unit}: no seccomp filter ({st['Seccomp']})"
    # the other processes of the unit (none expected, but whatever runs there runs the same way)
    for other in vm.sh(f"cat /sys/fs/cgroup/system.slice/{unit}/cgroup.procs").split():
        o = guestkit.proc_status(vm, int(other))
        assert o["Uid"].split() == [str(uid)] * 4 and int(o["CapBnd"], 16) == 0, (unit, other, o)


@pytest.mark.parametrize("unit", ALL_UNITS)
def test_hardening_is_what_the_file_declares(node: Node, unit: str) -> None:
    vm = node.vm
    declared = unit_file(unit)
    props = list(HARDENING_DEFAULTS) + ["CapabilityBoundingSet", "AmbientCapabilities", "User", "Group", "SystemCallArchitectures"]
    out = vm.sh(f"systemctl show -p {','.join(props)} {unit}")
    live = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for prop, default in HARDENING_DEFAULTS.items():
        want = declared.get(prop, [default])[-1]
        assert live.get(prop) == want, f"{unit}: {prop}={live.get(prop)!r} live, the file says {want!r}"
    assert live["CapabilityBoundingSet"] == "", f"{unit}: CapabilityBoundingSet={live['CapabilityBoundingSet']}"
    assert live["AmbientCapabilities"] == ""
    assert live["User"] == declared["User"][-1] and live["Group"] == declared["Group"][-1]
    assert live["SystemCallArchitectures"] == "native"
    # the IP allow list: systemd shows it as address/prefix, in its own order
    ip = dict(line.split("=", 1) for line in vm.sh(f"systemctl show -p IPAddressAllow,IPAddressDeny {unit}").splitlines())
    if declared.get("IPAddressDeny") == ["any"]:
        assert set(ip["IPAddressDeny"].split()) == {"0.0.0.0/0", "::/0"}, ip
        assert declared["IPAddressAllow"] == ["localhost"] and set(ip["IPAddressAllow"].split()) == {"127.0.0.0/8", "::1/128"}, ip
    else:
        assert ip["IPAddressDeny"] == "" and ip["IPAddressAllow"] == "", ip


# ----------------------------------------------------------------------------- point 4: the switcher unit


INSTANCE = "vm-1"


def test_an_instance_switches_the_display_to_vfio_pci(node: Node) -> None:
    vm, pci = node.vm, node.display
    assert card_driver(vm, pci) == DISPLAY_DRIVER
    node.put([hold("infer-01", 1)], instances=[{"instance_id": INSTANCE, "gpus": [pci]}])
    node.section("CONVERGED")
    wait_for(f"{pci} on vfio-pci", lambda: card_driver(vm, pci) == "vfio-pci", 90, lambda: journal(vm, "bcd-vfio-switcher.service"))
    assert vm.sh(f"cat /sys/bus/pci/devices/{pci}/driver_override").strip() == "vfio-pci"
    assert "Switched" in journal(vm, "bcd-vfio-switcher.service", 100)
    group = vm.sh(f"readlink /sys/bus/pci/devices/{pci}/iommu_group").strip().rsplit("/", 1)[-1]
    assert vm.run(["test", "-c", f"/dev/vfio/{group}"]).rc == 0, f"/dev/vfio/{group} missing"


def test_the_inventory_shows_the_switched_display_as_passthrough(node: Node) -> None:
    import json

    def card() -> dict[str, Any] | None:
        r = guestkit.cli(node.vm, f"gpu list {node.display} --json", timeout=60)
        c = json.loads(r.stdout)[0] if r.stdout.strip() else {}
        return c if c.get("driver_binding", {}).get("mode") == "Passthrough" else None

    c = wait_for("the display Passthrough in bcd gpu list", card, 60, node.diagnostics)
    assert c["phase"] == "Passthrough" and c["driver_binding"]["driver"] == "vfio-pci", c


def test_dropping_the_instance_switches_the_display_back(node: Node) -> None:
    vm, pci = node.vm, node.display
    node.put([hold("infer-01", 1)])
    node.section("CONVERGED")
    wait_for(f"{pci} back on {DISPLAY_DRIVER}", lambda: card_driver(vm, pci) == DISPLAY_DRIVER, 120, lambda: journal(vm, "bcd-vfio-switcher.service"))
    assert vm.sh(f"cat /sys/bus/pci/devices/{pci}/driver_override").strip() in ("", "(null)")


def test_a_failed_switch_rolls_back_to_the_native_driver(node: Node) -> None:
    vm, pci = node.vm, node.display
    assert card_driver(vm, pci) == DISPLAY_DRIVER
    # vfio-pci cannot bind: unloaded, and any load of it fails (the switcher loads none anyway)
    vm.sh("echo 'install vfio-pci /bin/false' > /etc/modprobe.d/bcd-vm-no-vfio.conf; modprobe -r vfio-pci")
    try:
        assert vm.run(["test", "-e", "/sys/bus/pci/drivers/vfio-pci"]).rc != 0, "vfio-pci still loaded"
        node.put([hold("infer-01", 1)], instances=[{"instance_id": INSTANCE, "gpus": [pci]}])
        wait_for(
            "a switch that failed and rolled back",
            lambda: '"rolled_back": true' in journal(vm, "bcd-vfio-switcher.service", 100),
            120,
            lambda: journal(vm, "bcd-vfio-switcher.service"),
        )
        assert card_driver(vm, pci) == DISPLAY_DRIVER, f"{pci} left on {card_driver(vm, pci)!r}\n{journal(vm, 'bcd-vfio-switcher.service')}"
        conv = journal(vm, "bcd-converger.service", 300)
        assert "GPU switch not done" in conv and '"rolled_back": true' in conv, node.diagnostics()
    finally:
        vm.sh("rm -f /etc/modprobe.d/bcd-vm-no-vfio.conf; modprobe vfio-pci", check=False)
    node.put([hold("infer-01", 1)])
    node.section("CONVERGED")
    # (a retry of the failed switch may have run once vfio-pci was back: the spec without the
    # instance switches it back)
    wait_for(f"{pci} on {DISPLAY_DRIVER}", lambda: card_driver(vm, pci) == DISPLAY_DRIVER, 120, lambda: journal(vm, "bcd-vfio-switcher.service"))


# ----------------------------------------------------------------------------- DRA sharing: root template units

MPS_CONTROL = "0b6f4a39-1c1e-4d6b-9a53-0123456789ab-0a1b2c"
LEGACY_CONTROL = "1b6f4a39-1c1e-4d6b-9a53-0123456789ab-0a1b2c"
SHARED_GPU = "GPU-5f1c2a90-0000-4000-8000-000000000001"
#: a card this node does not have
FOREIGN_GPU = "GPU-5f1c2a90-0000-4000-8000-0000000000ff"
#: nvidia-cuda-mps-control as the units see it: -d leaves a daemon process behind (what systemd's
#: Type=forking watches) and puts a file in its /dev/shm, the control commands are kept beside
#: it, quit ends it
FAKE_MPS_CONTROL = r"""#!/bin/sh
d="$CUDA_MPS_PIPE_DIRECTORY"
if [ "$1" = "-d" ]; then
  printf 'serves %s uid %s log %s\n' "$CUDA_VISIBLE_DEVICES" "$(id -u)" "$CUDA_MPS_LOG_DIRECTORY" > "$d/fake-daemon"
  echo "the daemon's shared memory" > /dev/shm/bcd-vm-mps-server
  setsid sleep 100000 </dev/null >/dev/null 2>&1 &
  echo $! > "$d/fake-daemon.pid"
  exit 0
fi
while IFS= read -r line; do
  [ -e "$d/fake-daemon" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
  case "$line" in
    quit) kill "$(cat "$d/fake-daemon.pid")"; rm -f "$d/fake-daemon" ;;
    get_server_list) ;;
    *) echo "$line" >> "$d/fake-daemon" ;;
  esac
done
"""
FAKE_NVIDIA_SMI = f"""#!/bin/sh
# (/dev/shm: the one place the timeslice unit, under ProtectSystem=strict and PrivateTmp=, can write)
[ "$1" = "-L" ] && {{ echo "GPU 0: NVIDIA H200 (UUID: {SHARED_GPU})"; exit 0; }}
echo "$(id -u) $*" >> /dev/shm/bcd-vm-nvidia-smi.log
"""
SOCKET = "/run/bcd/sharing.sock"
#: the inventory's own client (services.inventory.adapters.nvidia_sharing.ask_gate), one line
ASK = "/opt/bcd/venv/bin/python -c 'import sys; from pathlib import Path; from services.inventory.adapters.nvidia_sharing import ask_gate; print(ask_gate(sys.argv[1], Path(sys.argv[2]), 90))'"


def _as_inventory(vm: Guest, script: str, check: bool = True) -> Any:
    """`script` as bcd-inventory (its uid, gid and groups), the way its unit runs."""
    argv = ["setpriv", "--reuid=bcd-inventory", "--regid=bcd-inventory", "--init-groups", "sh", "-c", script]
    return vm.run(argv, timeout=120, check=check)


def _ask(vm: Guest, line: str, who: tuple[str, ...] = ("--reuid=bcd-inventory", "--regid=bcd-inventory", "--init-groups")) -> Any:
    """One request line to the gate, as `who` (setpriv's options); the run (stdout: the answer)."""
    return vm.run(["setpriv", *who, "sh", "-c", f'{ASK} "$1" {SOCKET}', "ask", line], timeout=150)


def test_the_inventory_starts_exactly_its_sharing_units_through_the_socket(node: Node) -> None:
    """bcd-sharing.socket and the root template units under a real systemd: the inventory's user
    asks the gate for bcd-mps@<control> (the unit makes its directories root's and a tmpfs of its
    own for the daemon's /dev/shm, runs the daemon from the spec the inventory handed over, as
    root with three capabilities, in its own unit) and a time slice, stops the daemon, and may
    do nothing else: not another unit, not a job mode of its own (a job queued meanwhile stays
    queued), not a bad name, not a card of another node, not as another user, not systemd
    directly, not write the MPS root. Last, an upgrade: the directories an older inventory made
    become root's when the socket starts, a symlink among them is removed."""
    vm = node.vm
    vm.put_file("/usr/local/bin/nvidia-cuda-mps-control", FAKE_MPS_CONTROL, 0o755)
    vm.put_file("/usr/local/bin/nvidia-smi", FAKE_NVIDIA_SMI, 0o755)
    unit = f"bcd-mps@{MPS_CONTROL}.service"
    control_dir = f"/run/bcd/mps/{MPS_CONTROL}"
    spec = '{"control":"%s","uuids":["%s"],"active_thread_percentage":40}' % (MPS_CONTROL, SHARED_GPU)
    t0 = time.monotonic()
    try:
        # docs/install.md, "DRA sharing" (the units are in /etc/systemd/system since section 2)
        vm.sh("systemctl enable --now bcd-sharing.socket", timeout=90)
        assert vm.sh("stat -c '%U %G %a' /run/bcd/mps /run/bcd/mps-specs").split("\n")[:2] == ["root root 755", "bcd-inventory bcd-inventory 755"]
        assert vm.sh(f"stat -c '%U %G %a %F' {SOCKET}").strip() == "root bcd-inventory 660 socket"
        # the inventory cannot write the MPS root (a symlink planted there would reach a container)
        assert _as_inventory(vm, f"ln -s /etc /run/bcd/mps/{MPS_CONTROL}", check=False).rc != 0
        # nor ask systemd for anything itself: there is no polkit rule any more
        r = _as_inventory(vm, f"systemctl --no-ask-password start {unit}", check=False)
        assert r.rc != 0 and ("authentication required" in r.stderr or "Access denied" in r.stderr), (r.rc, r.stderr)

        # a job queued meanwhile (a start that takes a minute): a flush would cancel it
        vm.sh("systemd-run --unit=bcd-vm-queued --no-block -p Type=oneshot /bin/sleep 120", timeout=60)
        _as_inventory(vm, f"printf '%s' '{spec}' > /run/bcd/mps-specs/{MPS_CONTROL}.json")
        r = _ask(vm, f"mps-start {MPS_CONTROL}")
        assert r.stdout.strip() == f"done start {unit}", f"{r.stdout}{r.stderr}\n{journal(vm, unit)}\n{journal(vm, 'bcd-sharing@*')}"
        assert vm.sh(f"systemctl is-active {unit}").strip() == "active"
        assert "bcd-vm-queued.service" in vm.sh("systemctl list-jobs --no-legend"), "a job queued before the request is gone"

        # the daemon is root's, in its own unit's cgroup, with the claim's environment and limits,
        # and the three capabilities its unit keeps (CAP_KILL, CAP_SETGID, CAP_SETUID: bits 5-7)
        daemon = vm.sh(f"cat {control_dir}/pipe/fake-daemon").splitlines()
        assert daemon == [f"serves {SHARED_GPU} uid 0 log {control_dir}/log", "set_default_active_thread_percentage 40"], daemon
        pid = vm.sh(f"cat {control_dir}/pipe/fake-daemon.pid").strip()
        assert unit in vm.sh(f"cat /proc/{pid}/cgroup"), "the daemon is not in its unit"
        caps = dict(line.split(":\t") for line in vm.sh(f"grep ^Cap /proc/{pid}/status").splitlines())
        assert caps["CapBnd"] == caps["CapEff"] == "00000000000000e0", caps
        # what a container mounts is root's; the daemon's /dev/shm a tmpfs of its own, not the host's
        assert vm.sh(f"stat -c '%n %U %a' {control_dir} {control_dir}/pipe {control_dir}/log").split("\n")[:3] == [
            f"{control_dir} root 755", f"{control_dir}/pipe root 755", f"{control_dir}/log root 755",
        ]
        mount = vm.sh(f"findmnt -n -o FSTYPE,OPTIONS {control_dir}/shm").split()
        assert mount[0] == "tmpfs" and {"nosuid", "nodev", "noexec"} <= set(mount[1].split(",")), mount
        assert vm.sh(f"stat -c '%U %a' {control_dir}/shm").strip() == "root 1777"
        assert vm.sh(f"cat {control_dir}/shm/bcd-vm-mps-server").strip() == "the daemon's shared memory"
        assert vm.run(["test", "-e", "/dev/shm/bcd-vm-mps-server"]).rc != 0, "the daemon wrote the host's /dev/shm"

        # what must be refused, each before systemctl runs
        for line in (
            "start bcd-helper.service",
            f"mps-start {MPS_CONTROL} --job-mode=flush",
            f"mps-stop {MPS_CONTROL} flush",
            "mps-start ../../etc",
            "mps-stop bcd-converger",
            f"timeslice {SHARED_GPU}:Forever",
        ):
            r = _ask(vm, line)
            assert r.stdout.startswith("refused "), (line, r.stdout, r.stderr)
        # a peer outside the group cannot connect; one in the group that is not the inventory's uid is refused
        r = _ask(vm, f"mps-stop {MPS_CONTROL}", ("--reuid=nobody", "--regid=nogroup", "--clear-groups"))
        assert r.rc != 0 and "Permission denied" in r.stderr, (r.rc, r.stdout, r.stderr)
        r = _ask(vm, f"mps-stop {MPS_CONTROL}", ("--reuid=nobody", "--regid=bcd-inventory", "--clear-groups"))
        assert r.stdout.startswith("refused uid 65534 is not the inventory's"), (r.stdout, r.stderr)
        assert vm.sh(f"systemctl is-active {unit}").strip() == "active"

        # a time slice on a card of this node; none on a card of another
        assert _ask(vm, f"timeslice {SHARED_GPU}:Long").stdout.strip() == f"done start bcd-timeslice@{SHARED_GPU}:Long.service"
        assert vm.sh("cat /dev/shm/bcd-vm-nvidia-smi.log").splitlines() == [f"0 -i {SHARED_GPU} -c DEFAULT", f"0 compute-policy -i {SHARED_GPU} --set-timeslice 3"]
        r = _ask(vm, f"timeslice {FOREIGN_GPU}:Long")
        assert r.stdout.startswith("failed ") and f"journalctl -u bcd-timeslice@{FOREIGN_GPU}:Long.service" in r.stdout, r.stdout
        assert "not a device of this node" in journal(vm, f"bcd-timeslice@{FOREIGN_GPU}:Long.service")
        assert len(vm.sh("cat /dev/shm/bcd-vm-nvidia-smi.log").splitlines()) == 2

        # the stop quits the daemon and takes its directories and tmpfs away
        assert _ask(vm, f"mps-stop {MPS_CONTROL}").stdout.strip() == f"done stop {unit}"
        assert vm.run(["kill", "-0", pid]).rc != 0, "the daemon process is still there"
        assert vm.run(["test", "-e", control_dir]).rc != 0, vm.sh(f"ls -la {control_dir}", check=False)
        assert vm.sh(f"findmnt -n {control_dir}/shm", check=False).strip() == ""
        TIMES["units.sharing.socket_and_units"] = time.monotonic() - t0

        # an upgrade: the layout an older inventory made (its group's 0770 root, its directories,
        # a symlink of its own among them); the socket's start takes it over for root
        t1 = time.monotonic()
        legacy = f"/run/bcd/mps/{LEGACY_CONTROL}"
        vm.sh(
            "set -e; chmod 0770 /run/bcd/mps; chgrp bcd-inventory /run/bcd/mps\n"
            f"mkdir -p {legacy}/pipe {legacy}/log; mkfifo {legacy}/pipe/control\n"
            f"chown -R bcd-inventory:bcd-inventory {legacy}\n"
            f"ln -s /etc /run/bcd/mps/{MPS_CONTROL}; chown -h bcd-inventory /run/bcd/mps/{MPS_CONTROL}"
        )
        vm.sh("systemctl restart bcd-sharing.socket", timeout=90)
        assert vm.sh(f"stat -c '%U %G %a' /run/bcd/mps {legacy} {legacy}/pipe {legacy}/log {legacy}/shm").splitlines() == ["root root 755"] * 5
        assert vm.sh(f"stat -c %F {legacy}/pipe/control").strip() == "fifo", "the running daemon's pipe went"
        assert vm.run(["test", "-L", f"/run/bcd/mps/{MPS_CONTROL}"]).rc != 0, "the symlink was left"
        assert vm.run(["test", "-e", "/etc/passwd"]).rc == 0
        TIMES["units.sharing.upgrade"] = time.monotonic() - t1
    finally:
        vm.sh(
            f"systemctl stop {unit} bcd-vm-queued.service; systemctl disable --now bcd-sharing.socket; systemctl reset-failed;"
            f" rm -rf /run/bcd/mps/{LEGACY_CONTROL} /run/bcd/mps-specs/{MPS_CONTROL}.json; rm -f /run/bcd/mps/{MPS_CONTROL}"
            " /usr/local/bin/nvidia-cuda-mps-control /usr/local/bin/nvidia-smi /dev/shm/bcd-vm-nvidia-smi.log",
            check=False,
        )


# ----------------------------------------------------------------------------- point 5: holds kept

KEPT = ["keep-01", "keep-02"]


def _kept_holds_intact(node: Node, what: str) -> None:
    """Both kept holds bound with their files and the slice with its limits, one Bound each."""
    conv = guestkit.converger_status(node.vm)
    assert {h["allocation_id"] for h in conv["holds"]} == set(KEPT), f"{what}: holds {conv['holds']}"
    files = node.hold_files()
    assert files == [
        "/etc/cdi/bcd-keep-01.json",
        "/etc/cdi/bcd-keep-02.json",
        "/run/bcd/allocations/keep-01.env",
        "/run/bcd/allocations/keep-02.env",
        "/run/cdi/bcd-keep-01.json",
        "/run/cdi/bcd-keep-02.json",
    ], f"{what}: {files}"
    assert node.slice_active("keep-01"), f"{what}: the slice is not active\n{node.diagnostics()}"
    assert node.cgroup_file("keep-01", "memory.max") == str(LIMITS["memory_bytes"])
    assert node.cgroup_file("keep-01", "hugetlb.2MB.max") == str(4 * 2048 * 1024)
    bound = node.bound()
    assert all(bound.get(a) == 1 for a in KEPT), f"{what}: Bound events per allocation {bound}"


def test_holds_to_keep(node: Node) -> None:
    node.put([hold("keep-01", 0, LIMITS), hold("keep-02", 1)])
    node.section("CONVERGED")
    for a in KEPT:
        node.wait_events("bound", a)
    node.wait_events("released", "infer-01")
    _kept_holds_intact(node, "bound")


@pytest.mark.parametrize("unit", ALL_UNITS)
def test_restart_keeps_the_node_and_its_holds(node: Node, unit: str) -> None:
    vm = node.vm
    started = f"systemctl show -p ExecMainStartTimestampMonotonic --value {unit}"
    before = guestkit.main_pid(vm, unit) if unit not in guestkit.ONESHOT_UNITS else int(vm.sh(started))
    t0 = time.monotonic()
    vm.sh(f"systemctl restart {unit}", timeout=120)
    guestkit.wait_active(vm, ALL_UNITS, timeout=120)
    # a one-shot ran again (and has no main process now); a service has a new main process
    after = guestkit.main_pid(vm, unit) if unit not in guestkit.ONESHOT_UNITS else int(vm.sh(started))
    assert after not in (0, before), f"{unit}: {before} -> {after}"
    r = _healthy(node, services=[*SERVICES, "helper"])
    TIMES[f"restart.{unit}"] = time.monotonic() - t0
    assert r.rc == 0, f"after restarting {unit}, bcd status: exit {r.rc}\n{r.stdout}\n{r.stderr}\n{guestkit.unit_diagnostics(vm, ALL_UNITS, 10)}"
    _kept_holds_intact(node, f"after restarting {unit}")


def test_no_unit_restarted_on_its_own(node: Node) -> None:
    out = node.vm.sh(f"systemctl show -p Id,NRestarts {' '.join(ALL_UNITS)}")
    restarts = re.findall(r"NRestarts=(\d+)\nId=(\S+)|Id=(\S+)\nNRestarts=(\d+)", out)
    counts = {m[1] or m[2]: int(m[0] or m[3]) for m in restarts}
    assert set(counts) == set(ALL_UNITS), out
    assert all(n == 0 for n in counts.values()), f"restarted by Restart=on-failure: {counts}\n{guestkit.unit_diagnostics(node.vm, [u for u, n in counts.items() if n], 20)}"


def test_reboot_keeps_every_unit_and_hold(node: Node) -> None:
    vm = node.vm
    old_boot = vm.boot_id
    TIMES["reboot"] = vm.reboot()
    assert vm.boot_id != old_boot
    t0 = time.monotonic()
    states = guestkit.wait_active(vm, ALL_UNITS, timeout=300, settle=5)
    assert set(states) == set(ALL_UNITS)
    # /run is a tmpfs: tmpfiles.d/bcd.conf made /run/bcd again at boot
    assert vm.sh("stat -c '%U %a' /run/bcd /run/bcd/allocations").split() == ["root", "755", "root", "755"]
    r = _healthy(node, timeout=300, services=[*SERVICES, "helper"])
    assert r.rc == 0, f"after the reboot, bcd status: exit {r.rc}\n{r.stdout}\n{r.stderr}"
    # the env files (tmpfs) written again in this boot, and the slice made again
    # (the slice is live a moment before its huge page limit is written: wait for all of it)
    wait_for("the kept holds' env files, slice and limits back", lambda: _kept_holds_intact(node, "after the reboot") or True, 120, node.diagnostics)
    TIMES["reboot.holds_back"] = time.monotonic() - t0
    assert "VM_TEST=keep-01" in vm.sh("cat /run/bcd/allocations/keep-01.env")
    hello = wait_for("a Hello of the new boot", lambda: (h := node.cp.hello(NODE_ID)) and h["boot_id"] == vm.boot_id and h, 120, node.diagnostics)
    assert HOST_CAPABILITIES <= set(hello["capabilities"]), hello["capabilities"]


# ----------------------------------------------------------------------------- point 5: security


def _exposure(text: str, name: str) -> float:
    m = re.search(rf"Overall exposure level for {re.escape(name)}: (\d+\.\d+) (\w+)", text)
    assert m, text[-2000:]
    return float(m.group(1))


@pytest.mark.parametrize("unit", ALL_UNITS)
def test_live_exposure_matches_the_offline_figure(node: Node, unit: str) -> None:
    vm = node.vm
    live = vm.run(["systemd-analyze", "security", "--no-pager", unit], timeout=120)
    offline = vm.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", f"{guestkit.SRC}/deploy/systemd/{unit}"], timeout=120)
    assert live.rc == 0 and offline.rc == 0, (live.stderr, offline.stderr)
    a, b = _exposure(live.stdout, unit), _exposure(offline.stdout, unit)
    FIGURES[f"exposure.{unit}"] = a
    limit = ROOT_MAX_EXPOSURE if unit in ROOT_UNITS else UNPRIVILEGED_MAX_EXPOSURE
    assert a <= limit, f"{unit}: live exposure {a}, the limit is {limit}"
    if a != b:
        diff = sorted(set(live.stdout.splitlines()) ^ set(offline.stdout.splitlines()))
        pytest.fail(f"{unit}: live exposure {a}, offline {b}; the lines that differ:\n" + "\n".join(diff))


# ----------------------------------------------------------------------------- point 3: the helper gone


def test_a_stopped_helper_makes_the_node_unprivileged_again(node: Node) -> None:
    vm = node.vm
    vm.sh(f"systemctl stop {HELPER}", timeout=60)
    t0 = time.monotonic()
    wait_for("the node unprivileged again", lambda: not guestkit.converger_status(vm)["privileged"], 120, node.diagnostics)
    TIMES["helper_gone.unprivileged"] = time.monotonic() - t0
    wait_for("a Hello with no host capability", lambda: not HOST_CAPABILITIES & node.capabilities(), 60, node.diagnostics)
    assert "root helper gone" in journal(vm, "bcd-converger.service", 100)
    # a new hold fails at once, the kept ones stay as they are
    node.put([hold("keep-01", 0, LIMITS), hold("keep-02", 1), hold("late-01", 2)])
    conv = node.section("FAILED")
    assert conv["failures"] == {"late-01": "node-unprivileged"}, conv
    (failed,) = node.wait_events("failed", "late-01")
    assert failed["event"]["reason"] == "node-unprivileged", failed
    _kept_holds_intact(node, "with the helper stopped")
    assert not [r for r in node.cp.events("released") if r["allocation_id"] in KEPT]
    doctor = guestkit.cli(vm, "doctor")
    assert "WARN  gpu-binding" in doctor.stdout, doctor.stdout + doctor.stderr
    # started again: privileged again
    vm.sh(f"systemctl start {HELPER}", timeout=60)
    wait_for("the converger to find the helper again", lambda: guestkit.converger_status(vm)["privileged"], 90, node.diagnostics)
    wait_for("a Hello with the host capabilities again", lambda: HOST_CAPABILITIES <= node.capabilities(), 60, node.diagnostics)
