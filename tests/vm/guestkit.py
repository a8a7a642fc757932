"""Shared steps of the VM suites (issue 18): bcd installed in a guest as docs/install.md says.

    install_bcd(guest)                  # docs/install.md sections 2-4 and 9, on a fake host
    wait_active(guest, units)           # bounded; raises with `systemctl status` and journal tails
    unit_diagnostics(guest, units)      # those tails, for an assertion message

What differs from an operator's host, and only that:

- section 1 (the venv) is the image's: deploy/vm/build-image.sh made /opt/bcd/venv with
  `python3 -m venv` and pip-installed bcd from wheels (no network in the guest);
- no GPU: the inventory's fakehw adapter reads a host description (BCD_ADAPTER=fakehw,
  BCD_FAKE_HOST in /etc/bcd/node.env; default examples/hosts/h200x8.json), the kube_reaper
  reads that file's processes (BCD_PROCESSES=fake, BCD_EVICTOR=none), the DRA plugin has no
  API server (BCD_KUBE_API=none);
- no control plane: the bridge's upstream (/etc/bcd/gateway-bridge.env, required by its unit)
  is a loopback port nothing listens on, so it stays up retrying, and BCD_CP_KEY is empty.

Nothing here runs on the build host: every command goes through ``guest.run``/``guest.sh``.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from tests.vm.qemu import Guest, VMTimeout

ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "deploy" / "systemd"
SRC = "/opt/bcd/src"
VENV = "/opt/bcd/venv"
BCD = f"{VENV}/bin/bcd"
NODE_ID = "vm-node-1"
FAKE_HOST = "/etc/bcd/fake-host.json"
#: a loopback port nothing listens on: the bridge's upstream (it retries, and stays active)
NO_UPSTREAM = "nats://127.0.0.1:4299"
#: the environment the `bcd` commands need (docs/install.md section 9), run as root
CLI_ENV = f"BCD_STATE_DIR=/etc/bcd {VENV}/bin/bcd"


def target_units() -> list[str]:
    """The units bcd.target wants, read from the repo's deploy/systemd/bcd.target."""
    for line in (UNIT_DIR / "bcd.target").read_text().splitlines():
        if line.startswith("Wants="):
            return line.split("=", 1)[1].split()
    raise AssertionError("bcd.target has no Wants=")


def install_bcd(
    guest: Guest,
    host_file: Path | None = None,
    node_id: str = NODE_ID,
    with_helper: bool = False,
    start: bool = True,
    timeout: float = 300.0,
) -> dict[str, float]:
    """docs/install.md sections 2, 3, 4 and 9 in the guest; seconds each step took.

    ``host_file`` (default examples/hosts/h200x8.json) is put at FAKE_HOST. ``with_helper`` passes
    ``--with-helper`` to write-config (the helper unit is not started: enable it yourself).
    ``start``: ``systemctl enable --now bcd.target`` and a bounded wait for every unit it wants
    to be active (raises VMTimeout with the units' status and journal tails)."""
    took: dict[str, float] = {}
    t0 = time.monotonic()
    # 2. users, directories, units
    guest.sh(
        f"set -e; cd {SRC}/deploy/systemd\n"
        "install -D -m 0644 sysusers.d/bcd.conf /etc/sysusers.d/bcd.conf\n"
        "install -D -m 0644 tmpfiles.d/bcd.conf /etc/tmpfiles.d/bcd.conf\n"
        "systemd-sysusers bcd.conf\n"
        "systemd-tmpfiles --create bcd.conf\n"
        "install -m 0644 *.service bcd.target /etc/systemd/system/\n"
        "systemctl daemon-reload\n",
        timeout=120,
    )
    took["users_dirs_units"] = time.monotonic() - t0
    # 3. the node's configuration, a fake host instead of a GPU
    t1 = time.monotonic()
    host = (host_file or ROOT / "examples" / "hosts" / "h200x8.json").read_bytes()
    guest.put_file(FAKE_HOST, host, mode=0o644)
    # the vendor's CDI spec, as `nvidia-ctk cdi generate` (root) writes it on a GPU host; the
    # fakehw adapter would write it itself at start, which the inventory's unit (ProtectSystem=
    # strict, /etc/cdi not among its ReadWritePaths=) rightly refuses: written here, byte for byte
    # what the adapter writes, it finds the spec unchanged and leaves it alone
    spec = vendor_cdi_spec(host)
    if spec is not None:
        guest.put_file("/etc/cdi/nvidia.json", spec, mode=0o644)
    guest.put_file(
        "/etc/bcd/node.env",
        f"BCD_NODE_ID={node_id}\nBCD_NATS_URL=nats://127.0.0.1:4222\nBCD_LOG_LEVEL=INFO\nBCD_LOG_FORMAT=json\n"
        f"# the VM has no GPU: the inventory reads a host description\nBCD_ADAPTER=fakehw\nBCD_FAKE_HOST={FAKE_HOST}\n",
    )
    guest.put_file("/etc/bcd/kube-reaper.env", "BCD_PROCESSES=fake\nBCD_EVICTOR=none\n")
    guest.put_file("/etc/bcd/dra-plugin.env", "BCD_KUBE_API=none\n")
    guest.put_file("/etc/bcd/gateway-bridge.env", f"BCD_UPSTREAM_URL={NO_UPSTREAM}\nBCD_CP_KEY=\n")
    # 4. the node bus configuration
    guest.sh(
        f"{VENV}/bin/python -m bcd.nodebus write-config --node-id {shlex.quote(node_id)} "
        "--bus-dir /etc/bcd/bus --store-dir /var/lib/bcd/nats --port 4222 --http-port 8222 "
        "--state-dir /etc/bcd --data-dir /var/lib/bcd/converger" + (" --with-helper" if with_helper else ""),
        timeout=120,
    )
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
        out.append(guest.sh(f"systemctl status --no-pager --lines=0 {u} 2>&1; journalctl --no-pager -o cat -n {lines} -u {u} 2>&1", check=False, timeout=60))
    return "\n".join(out)


def wait_active(guest: Guest, units: list[str], timeout: float = 300.0, settle: float = 0.0) -> dict[str, str]:
    """Waits (bounded) until every unit is active/running; raises VMTimeout with diagnostics."""
    deadline = time.monotonic() + timeout
    while True:
        states = unit_states(guest, units)
        bad = [u for u in units if states.get(u) != "active/running"]
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


def cli(guest: Guest, args: str, timeout: float = 120.0):
    """A `bcd` command as docs/install.md section 9 runs it (root, BCD_STATE_DIR=/etc/bcd)."""
    return guest.run(f"{CLI_ENV} {args}", timeout=timeout)
