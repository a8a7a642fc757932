"""The systemd units in deploy/systemd: what `systemd-analyze` says about them,
and that they fit the services they start.

- `systemd-analyze verify` finds nothing to say about any unit. The checked-in
  units name the real install paths (/opt/bcd/venv/bin/...), which do not
  exist here, so verify runs on copies whose ExecStart points at stub
  executables in a temporary venv; nothing else is changed.
- `systemd-analyze security --offline=true` holds every unprivileged unit to
  an overall exposure of at most UNPRIVILEGED_MAX_EXPOSURE and the two root
  units (vfio_switcher, helper) to ROOT_MAX_EXPOSURE. With systemd 252 they
  reach: bcd-bus 0.9, bcd-signer 0.9, bcd-converger 0.9 (SAFE),
  bcd-gateway-bridge 1.1, bcd-kube-reaper 1.4, bcd-inventory 1.5 (OK);
  bcd-helper 1.6, bcd-vfio-switcher 1.5 (OK).
- Without systemd-analyze: the units are still parsed and checked against the
  services' own option definitions, the bus config `prepare_node_bus` writes,
  the sysusers.d and tmpfiles.d files: every service its own user, an empty
  capability bounding set everywhere, writable paths only where a service
  writes, each relaxation of the common hardening declared here with its reason.

systemd itself, systemd-tmpfiles and systemd-sysusers are never started.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bcd.nodebus import BusConfig, prepare_node_bus
from shared.runtime import ServiceApp, common_options, parse_options
from shared.subjects import SERVICES

REPO = Path(__file__).resolve().parents[2]
UNIT_DIR = REPO / "deploy" / "systemd"
SYSUSERS = UNIT_DIR / "sysusers.d" / "bcd.conf"
TMPFILES = UNIT_DIR / "tmpfiles.d" / "bcd.conf"

VENV_BIN = "/opt/bcd/venv/bin/"
DATA_DIR = Path("/var/lib/bcd")
CREDS_DIR = Path("/etc/bcd/bus/creds")
BUS_CONF = Path("/etc/bcd/bus/nats.conf")

#: the highest overall exposure `systemd-analyze security` may give each kind of unit.
UNPRIVILEGED_MAX_EXPOSURE = 1.5
ROOT_MAX_EXPOSURE = 2.0

#: service (shared.subjects.SERVICES) -> unit file.
SERVICE_UNITS = {name: f"bcd-{name.replace('_', '-')}.service" for name in SERVICES}
BUS_UNIT = "bcd-bus.service"
#: makes the node bus's streams as bus_admin (no service may: docs/security.md)
BUS_SETUP_UNIT = "bcd-bus-setup.service"
TARGET = "bcd.target"
ALL_SERVICE_UNITS = [BUS_UNIT, BUS_SETUP_UNIT, *SERVICE_UNITS.values()]

#: the units that run as root, and why (DESIGN 2); every other unit has its own user.
ROOT_UNITS = {
    "bcd-vfio-switcher.service": "writes the root-owned sysfs driver files (driver_override, unbind, bind)",
    "bcd-helper.service": "writes /etc/cdi and /run/bcd and asks systemd for slices",
}
USERS = {
    "bcd-bus.service": "bcd-bus",
    # a user that exists only while it runs (DynamicUser=): it makes the streams and exits
    "bcd-bus-setup.service": "bcd-bus-setup",
    "bcd-inventory.service": "bcd-inventory",
    "bcd-converger.service": "bcd-converger",
    "bcd-signer.service": "bcd-signer",
    "bcd-gateway-bridge.service": "bcd-bridge",
    "bcd-kube-reaper.service": "bcd-kube-reaper",
    "bcd-device-plugin.service": "bcd-device-plugin",
    "bcd-dra-plugin.service": "bcd-dra-plugin",
    "bcd-vfio-switcher.service": "root",
    "bcd-helper.service": "root",
}

#: users systemd makes for a unit's run (DynamicUser=), not sysusers.d
DYNAMIC_USERS = {"bcd-bus-setup"}
#: what a unit may write besides its StateDirectory=, by unit (nothing when absent).
READ_WRITE_PATHS = {
    # the spec of each MPS daemon it asks root for (the daemons' directories are root's)
    "bcd-inventory.service": {"/run/bcd/mps-specs"},
    "bcd-vfio-switcher.service": {"/sys/bus/pci/drivers", "/sys/bus/pci/drivers_probe", "/sys/devices"},
    "bcd-helper.service": {"/etc/cdi", "/run/cdi", "/run/bcd"},
    # its sockets beside the kubelet's ("-": a host without a kubelet starts it all the same)
    "bcd-device-plugin.service": {"-/var/lib/kubelet/device-plugins"},
    # the registration socket where the kubelet's plugin watcher looks, and its own socket's directory
    "bcd-dra-plugin.service": {"-/var/lib/kubelet/plugins_registry", "-/var/lib/kubelet/plugins/gpu.bcd.dev"},
}
#: writable paths another program makes (none of bcd's tmpfiles.d makes them).
FOREIGN_PATHS = {
    "-/var/lib/kubelet/device-plugins": "the kubelet's",
    "-/var/lib/kubelet/plugins_registry": "the kubelet's",
    "-/var/lib/kubelet/plugins/gpu.bcd.dev": "the operator's (docs/install.md), under the kubelet's plugins/",
}
#: StateDirectory= and its mode, by unit.
STATE_DIRS = {
    "bcd-bus.service": ("bcd/nats", "0700"),
    "bcd-inventory.service": ("bcd/inventory", "0700"),
    "bcd-converger.service": ("bcd/converger", "0700"),
    "bcd-signer.service": ("bcd/signer", "0700"),
    "bcd-dra-plugin.service": ("bcd/dra_plugin", "0700"),
}

#: every service unit has these, except where RELAXED says otherwise.
HARDENING = {
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "DevicePolicy": "closed",
    "PrivateUsers": "yes",
    "PrivateIPC": "yes",
    "PrivateMounts": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "ProtectProc": "invisible",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "SystemCallArchitectures": "native",
    "SystemCallErrorNumber": "EPERM",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "IPAddressAllow": "localhost",
    "IPAddressDeny": "any",
    "UMask": "0077",
}
NVML = "NVML opens the NVIDIA device nodes"
OTHER_PROCS = "reads /proc/<pid>/cgroup of GPU processes of other users"
#: (unit, setting) -> why that unit does without it (or sets it otherwise).
RELAXED = {
    ("bcd-inventory.service", "PrivateDevices"): NVML,
    ("bcd-inventory.service", "ProtectProc"): OTHER_PROCS,
    ("bcd-inventory.service", "PrivateTmp"): "sees the MPS control daemon's pipe in /tmp/nvidia-mps (read-only)",
    ("bcd-kube-reaper.service", "PrivateDevices"): NVML,
    ("bcd-kube-reaper.service", "ProtectProc"): OTHER_PROCS,
    ("bcd-kube-reaper.service", "IPAddressAllow"): "the Kubernetes API server is usually remote",
    ("bcd-kube-reaper.service", "IPAddressDeny"): "the Kubernetes API server is usually remote",
    ("bcd-dra-plugin.service", "IPAddressAllow"): "the Kubernetes API server is usually remote",
    ("bcd-dra-plugin.service", "IPAddressDeny"): "the Kubernetes API server is usually remote",
    ("bcd-gateway-bridge.service", "IPAddressAllow"): "upstream is the control plane's NATS",
    ("bcd-gateway-bridge.service", "IPAddressDeny"): "upstream is the control plane's NATS",
    ("bcd-vfio-switcher.service", "PrivateUsers"): "root: the sysfs files belong to the host's root",
    ("bcd-helper.service", "PrivateUsers"): "root: systemd grants unit changes to its own uid",
    ("bcd-helper.service", "UMask"): "holds are read by container runtimes and the converger",
    ("bcd-helper.service", "ProtectControlGroups"): "writes hugetlb.<size>.max and enables the hugetlb controller for hold slices",
}


# --------------------------------------------------------------------------- unit files


@dataclass
class Unit:
    path: Path
    #: section -> key -> every assignment in order (an empty one resets a list).
    sections: dict[str, dict[str, list[str]]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.path.name

    def values(self, key: str, section: str = "Service") -> list[str]:
        return self.sections.get(section, {}).get(key, [])

    def get(self, key: str, section: str = "Service") -> str | None:
        values = self.values(key, section)
        return values[-1] if values else None

    def items(self, key: str, section: str = "Service") -> list[str]:
        """A list setting's effective entries: space-separated words, an empty assignment resets."""
        out: list[str] = []
        for value in self.values(key, section):
            out = [] if value == "" else [*out, *value.split()]
        return out

    def environment(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for value in self.values("Environment"):
            for word in value.split():
                k, _, v = word.partition("=")
                env[k] = v
        return env

    def credentials(self) -> dict[str, str]:
        return dict(v.split(":", 1) for v in self.values("LoadCredential"))


def parse_unit(path: Path) -> Unit:
    """systemd.syntax(7), the part these files use: sections, Key=Value, comments, continuations."""
    unit = Unit(path)
    section = ""
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"{path}: bad section line {line!r}"
            section = line[1:-1]
            unit.sections.setdefault(section, {})
            continue
        key, sep, value = line.partition("=")
        assert sep and section, f"{path}: not a Key=Value line in a section: {line!r}"
        unit.sections[section].setdefault(key.strip(), []).append(value.strip())
    return unit


UNITS = {p.name: parse_unit(p) for p in sorted(UNIT_DIR.glob("*.service")) if "@" not in p.name}
#: root template units the inventory starts instances of (DRA sharing); not services, not in bcd.target
TEMPLATES = {p.name: parse_unit(p) for p in sorted(UNIT_DIR.glob("*@.service"))}


def unit(name: str) -> Unit:
    return UNITS[name]


def service_app(service: str) -> ServiceApp:
    """The service's ServiceApp (services/<name>/service.py)."""
    try:
        module = importlib.import_module(f"services.{service}.service")
    except ModuleNotFoundError as exc:
        if exc.name != f"services.{service}.service":
            raise
        pytest.skip(f"services.{service}.service does not exist yet")
    apps = [
        obj
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, ServiceApp) and obj is not ServiceApp and getattr(obj, "name", None) == service
    ]
    assert len(apps) == 1, f"services.{service}.service: {len(apps)} ServiceApp classes named {service!r}"
    return apps[0]()


def unit_options(service: str) -> tuple[argparse.Namespace, ServiceApp]:
    """The service's options as its unit sets them (plus a node.env and the bridge's upstream)."""
    u = unit(SERVICE_UNITS[service])
    app = service_app(service)
    env = {
        "BCD_NODE_ID": "gpu-node-17",
        "BCD_NATS_URL": "nats://127.0.0.1:4222",
        **({"BCD_UPSTREAM_URL": "tls://cp.example.net:4222"} if service == "gateway_bridge" else {}),
        **{k: v.replace("%d", f"/run/credentials/{u.name}") for k, v in u.environment().items()},
    }
    return parse_options(service, [*common_options(service), *app.options()], [], env), app


# --------------------------------------------------------------------------- the set of units


def test_every_service_and_the_bus_has_a_unit_and_the_target_wants_them():
    assert set(UNITS) == set(ALL_SERVICE_UNITS)
    target = parse_unit(UNIT_DIR / TARGET)
    # the helper is optional: enabled on its own, then WantedBy=bcd.target
    assert set(target.items("Wants", "Unit")) == set(ALL_SERVICE_UNITS) - {"bcd-helper.service"}
    for u in UNITS.values():
        assert u.items("WantedBy", "Install") == [TARGET], u.name
        assert u.items("PartOf", "Unit") == [TARGET], u.name


def test_exec_start_runs_the_venv_and_the_service_module():
    assert unit(BUS_UNIT).get("ExecStart") == f"{VENV_BIN}nats-server -c %d/nats.conf"
    assert unit(BUS_SETUP_UNIT).get("ExecStart") == f"{VENV_BIN}python -m bcd.nodebus setup-streams --store-dir /var/lib/bcd/nats"
    for service, name in SERVICE_UNITS.items():
        assert unit(name).get("ExecStart") == f"{VENV_BIN}python -m services.{service}", name


def _reads_the_boot_id(service: str) -> bool:
    """Does the service's code read /proc/sys/kernel/random/boot_id (shared.host or the inventory's hostfs)?"""
    return any("read_boot_id(" in f.read_text() for f in (REPO / "services" / service).rglob("*.py"))


@pytest.mark.parametrize("service", sorted(SERVICE_UNITS))
def test_a_service_that_reads_the_boot_id_sees_proc_sys(service):
    """ProcSubset=pid hides /proc/sys: a service that stamps state with the boot id cannot start
    under it on a real host (seen in the VM suite: bcd-dra-plugin.service exited "cannot start:
    /proc/sys/kernel/random/boot_id: No such file or directory", in a restart loop; on a fake
    host the boot id came from the host file, so nothing had shown it)."""
    u = unit(SERVICE_UNITS[service])
    if _reads_the_boot_id(service):
        assert u.get("ProcSubset") in (None, "all"), f"{u.name}: ProcSubset={u.get('ProcSubset')} hides the boot id {service} reads"
    assert _reads_the_boot_id("dra_plugin") and _reads_the_boot_id("signer")


@pytest.mark.parametrize("name", ALL_SERVICE_UNITS)
def test_each_unit_runs_as_its_own_user(name):
    u = unit(name)
    assert u.get("User") == USERS[name]
    assert u.get("Group") == USERS[name]
    if USERS[name] == "root":
        assert name in ROOT_UNITS
    else:
        assert [n for n, user in USERS.items() if user == USERS[name]] == [name], "two units share a user"


def test_sysusers_defines_exactly_the_unit_users():
    users = {}
    for line in SYSUSERS.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        kind, name, *_ = line.split()
        assert kind == "u", line
        users[name] = line
    assert set(users) == {u for u in USERS.values() if u != "root"} - DYNAMIC_USERS
    for name, u in UNITS.items():
        assert (u.get("DynamicUser") == "yes") == (USERS.get(name) in DYNAMIC_USERS), name


def _tmpfiles() -> dict[str, tuple[str, str, str, str]]:
    entries = {}
    for line in TMPFILES.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        kind, path, mode, user, group, _age = line.split()
        entries[path] = (kind, mode, user, group)
    return entries


def test_tmpfiles_directories_belong_to_root():
    """No service owns a directory another service's directory sits in."""
    entries = _tmpfiles()
    assert entries["/var/lib/bcd"] == ("d", "0755", "root", "root")
    # one exception: the inventory's own directory of MPS daemon specs, which root reads
    # without following and mounts nowhere; the daemons' directories (mounted into claims'
    # containers) are under the MPS root, which no service may write
    assert entries.pop("/run/bcd/mps-specs") == ("d", "0755", "bcd-inventory", "bcd-inventory")
    assert entries["/run/bcd/mps"] == ("d", "0755", "root", "root")
    assert all(user == group == "root" for _, _, user, group in entries.values())
    # the bus config and the NATS passwords: root only (each unit gets its own via LoadCredential=)
    assert entries["/etc/bcd/bus"] == ("d", "0700", "root", "root")
    assert entries["/etc/bcd/bus/creds"] == ("d", "0700", "root", "root")
    for path in ("/etc/cdi", "/run/bcd", "/run/bcd/allocations"):
        assert entries[path] == ("d", "0755", "root", "root"), path


# --------------------------------------------------------------------------- hardening


@pytest.mark.parametrize("name", ALL_SERVICE_UNITS)
def test_common_hardening_with_every_relaxation_declared(name):
    u = unit(name)
    for key, want in HARDENING.items():
        got = u.get(key)
        if (name, key) in RELAXED:
            assert got != want, f"{name}: {key} is no longer relaxed; drop it from RELAXED"
        else:
            assert got == want, f"{name}: {key}={got!r}, want {want!r}"
    # the syscall filter: the service set, minus privileged and resource calls
    assert u.values("SystemCallFilter") == ["@system-service", "~@privileged @resources"], name
    if USERS[name] != "root":
        assert u.get("RemoveIPC") == "yes", name


@pytest.mark.parametrize("name", ALL_SERVICE_UNITS)
def test_no_capabilities_anywhere_not_even_for_root(name):
    u = unit(name)
    assert u.values("CapabilityBoundingSet") == [""], name
    assert u.values("AmbientCapabilities") == [""], name


@pytest.mark.parametrize("name", ALL_SERVICE_UNITS)
def test_devices_closed_and_only_nvidia_where_nvml_runs(name):
    u = unit(name)
    assert u.get("DevicePolicy") == "closed"
    if u.get("PrivateDevices") == "no":
        assert u.values("DeviceAllow") == ["char-nvidia* rw"], name
    else:
        assert u.values("DeviceAllow") == [], name


@pytest.mark.parametrize("name", ALL_SERVICE_UNITS)
def test_writable_paths_only_where_the_service_writes(name):
    u = unit(name)
    assert set(u.items("ReadWritePaths")) == READ_WRITE_PATHS.get(name, set())
    if name in STATE_DIRS:
        assert (u.get("StateDirectory"), u.get("StateDirectoryMode")) == STATE_DIRS[name]
    else:
        assert u.get("StateDirectory") is None, name
    for key in ("RuntimeDirectory", "CacheDirectory", "LogsDirectory", "ConfigurationDirectory", "BindPaths"):
        assert u.get(key) is None, f"{name}: {key}"
    # a writable path that must exist is made by tmpfiles.d, or is the kernel's own
    for path in u.items("ReadWritePaths"):
        assert path in _tmpfiles() or path.startswith("/sys/") or path in FOREIGN_PATHS, f"{name}: nothing makes {path}"


# --------------------------------------------------------------------------- the services' own view


@pytest.mark.parametrize("service", SERVICES)
def test_unit_environment_is_the_services_options(service):
    """Every BCD_* the unit sets is an option of that service; the NATS login is its own."""
    u = unit(SERVICE_UNITS[service])
    opts, app = unit_options(service)
    known = {o.env for o in [*common_options(service), *app.options()]}
    assert set(u.environment()) <= known, f"{u.name} sets variables {service} does not read"
    assert opts.nats_user == service
    assert str(opts.nats_password_file) == f"/run/credentials/{u.name}/nats-password"
    assert u.credentials() == {"nats-password": str(CREDS_DIR / f"{service}.password")}
    # every service reads node.env (node id, bus url) and may have its own file
    files = u.values("EnvironmentFile")
    assert files[0] == "/etc/bcd/node.env"
    assert files[1].lstrip("-") == f"/etc/bcd/{u.name.removeprefix('bcd-').removesuffix('.service')}.env"
    # the metrics endpoint stays on loopback (IPAddressAllow=localhost)
    assert opts.metrics_addr == "127.0.0.1"


def test_credentials_are_where_prepare_node_bus_writes_them(tmp_path):
    conf, creds = prepare_node_bus(tmp_path / "bus", tmp_path / "nats", "gpu-node-17")
    assert conf.relative_to(tmp_path / "bus") == BUS_CONF.relative_to(BUS_CONF.parent)
    assert unit(BUS_UNIT).credentials() == {"nats.conf": str(BUS_CONF)}
    for service in SERVICES:
        assert creds[service].relative_to(tmp_path / "bus") == CREDS_DIR.relative_to(BUS_CONF.parent) / f"{service}.password"


def test_the_bus_listens_on_loopback_and_stores_in_its_state_dir():
    # the unit allows loopback only; the config's default host must be loopback too
    assert BusConfig(store_dir=DATA_DIR / "nats").host == "127.0.0.1"
    assert DATA_DIR / unit(BUS_UNIT).get("StateDirectory").removeprefix("bcd/") == DATA_DIR / "nats"


def test_the_signer_key_is_in_its_0700_state_dir():
    opts, app = unit_options("signer")
    key = app.key_path(opts)
    assert key == DATA_DIR / "signer" / "node.key"
    assert key.parent == Path("/var/lib") / unit("bcd-signer.service").get("StateDirectory")
    assert unit("bcd-signer.service").get("StateDirectoryMode") == "0700"


def test_the_inventory_keeps_gpus_json_in_its_state_dir():
    from services.inventory.gpustate import state_dir_from

    opts, _ = unit_options("inventory")
    assert state_dir_from(opts.data_dir) == Path("/var/lib") / unit("bcd-inventory.service").get("StateDirectory")
    assert opts.adapter == "nvidia"


def test_the_converger_data_dir_is_its_state_dir():
    """releasing.json at the top of the data dir (seed), the journal below: all the converger's own."""
    from services.converger.releases import RELEASES_FILE, UNREADABLE_MARKER

    opts, _ = unit_options("converger")
    u = unit("bcd-converger.service")
    state = Path("/var/lib") / u.get("StateDirectory")
    assert Path(opts.data_dir) == state == DATA_DIR / "converger"
    for path in (Path(opts.data_dir) / RELEASES_FILE, Path(opts.data_dir) / UNREADABLE_MARKER, Path(opts.data_dir) / "converger"):
        assert path.is_relative_to(state), path
    # it reads the holds the helper writes; it writes none itself
    assert (opts.cdi_dir, opts.run_dir) == (Path("/etc/cdi"), Path("/run/bcd"))
    assert {"/etc/cdi", "/run/bcd"} <= set(unit("bcd-helper.service").items("ReadWritePaths"))


def test_the_switcher_writes_real_sysfs():
    opts, _ = unit_options("vfio_switcher")
    assert (opts.backend, opts.sysfs_root) == ("sysfs", Path("/sys"))
    assert unit("bcd-vfio-switcher.service").get("ProtectKernelTunables") == "yes"


# --------------------------------------------------------------------------- systemd-analyze

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not found (Debian package systemd)")


def _analyze(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run(  # noqa: S603 - a fixed tool on our own files
        [SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=60, cwd=cwd
    )


def _systemd_version() -> int:
    out = _analyze("--version").stdout
    m = re.match(r"systemd (\d+)", out)
    return int(m.group(1)) if m else 0


def _verifiable_copies(tmp_path: Path, mutate: dict[str, tuple[str, str]] | None = None) -> list[Path]:
    """The units and the target, with ExecStart's venv pointed at stub executables; nothing else changed."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    for exe in ("python", "nats-server"):
        (venv / exe).write_text("#!/bin/sh\nexit 0\n")
        (venv / exe).chmod(0o755)
    out = tmp_path / "units"
    out.mkdir()
    copies = []
    for src in [*sorted(UNIT_DIR.glob("*.service")), *sorted(UNIT_DIR.glob("*.socket")), UNIT_DIR / TARGET]:
        lines = src.read_text().splitlines(keepends=True)
        execs = [i for i, line in enumerate(lines) if line.startswith("ExecStart=")]
        assert len(execs) == (1 if src.suffix == ".service" else 0), src.name
        for i, line in enumerate(lines):
            m = re.match(r"(Exec\w+=[-+!@:]*)" + re.escape(VENV_BIN), line)
            if m:
                lines[i] = line.replace(m.group(0), f"{m.group(1)}{venv}/", 1)
        text = "".join(lines)
        if mutate and src.name in mutate:
            old, new = mutate[src.name]
            assert old in text
            text = text.replace(old, new)
        (out / src.name).write_text(text)
        copies.append(out / src.name)
    return copies


def _verify(tmp_path: Path, mutate: dict[str, tuple[str, str]] | None = None) -> tuple[int, list[str]]:
    copies = _verifiable_copies(tmp_path, mutate)
    result = _analyze("verify", "--man=no", *map(str, copies), cwd=copies[0].parent)
    ours = [n.name for n in copies]
    lines = [
        line
        for line in (result.stdout + result.stderr).splitlines()
        if str(copies[0].parent) in line or any(n in line for n in ours)
    ]
    return result.returncode, lines


@needs_analyze
def test_systemd_analyze_verify_finds_nothing(tmp_path):
    rc, complaints = _verify(tmp_path)
    assert rc == 0 and complaints == [], "\n".join(complaints)


@needs_analyze
def test_verify_check_would_catch_a_typo(tmp_path):
    """The check above means something: a misspelt setting is reported (verify still exits 0 on it)."""
    _, complaints = _verify(tmp_path, {"bcd-signer.service": ("NoNewPrivileges=yes", "NoNewPrivilege=yes")})
    assert any("NoNewPrivilege" in line for line in complaints), complaints


def _exposure(path: Path) -> tuple[float, str]:
    if _systemd_version() < 250:
        pytest.skip("systemd-analyze security --offline needs systemd 250 or newer")
    result = _analyze("security", "--offline=true", "--no-pager", str(path))
    assert result.returncode == 0, result.stderr
    m = re.search(rf"Overall exposure level for {re.escape(path.name)}: (\d+\.\d+) (\w+)", result.stdout)
    assert m, result.stdout[-2000:]
    return float(m.group(1)), m.group(2)


@needs_analyze
@pytest.mark.parametrize("name", ALL_SERVICE_UNITS)
def test_security_exposure_within_the_stated_level(name):
    exposure, level = _exposure(UNIT_DIR / name)
    limit = ROOT_MAX_EXPOSURE if name in ROOT_UNITS else UNPRIVILEGED_MAX_EXPOSURE
    assert exposure <= limit, f"{name}: exposure {exposure} {level}, the limit is {limit}"
    assert level in ("PERFECT", "SAFE", "OK"), f"{name}: {level}"


# --------------------------------------------------------------------------- DRA sharing: root template units

#: template unit -> the highest overall exposure `systemd-analyze security` may give it, with
#: systemd 252: bcd-mps@ 1.7 (root, CAP_SETUID CAP_SETGID CAP_KILL, the NVIDIA devices, no
#: network; was 5.0 with root's capabilities), bcd-timeslice@ 1.7 (CAP_SYS_ADMIN only),
#: bcd-sharing@ 0.7 (root with no capability; the inventory's requests).
TEMPLATE_MAX_EXPOSURE = {"bcd-mps@.service": 2.0, "bcd-timeslice@.service": 2.0, "bcd-sharing@.service": 1.0}
SHARING_SOCKET_UNIT = "bcd-sharing.socket"
CONTROL = "0b6f4a39-1c1e-4d6b-9a53-0123456789ab-0a1b2c"
GPU_UUID = "GPU-5f1c2a90-0000-4000-8000-000000000001"


def test_the_sharing_templates_run_the_sharing_unit_as_root_outside_the_target():
    from services.inventory.adapters.nvidia_sharing import MPS_UNIT, TIMESLICE_UNIT

    assert set(TEMPLATES) == {MPS_UNIT.split("@")[0] + "@.service", TIMESLICE_UNIT.split("@")[0] + "@.service", "bcd-sharing@.service"}
    mps, timeslice = TEMPLATES["bcd-mps@.service"], TEMPLATES["bcd-timeslice@.service"]
    module = f"{VENV_BIN}python -m services.inventory.sharing_unit"
    # the steps in systemd's order; "+" (the host's mount namespace, full privileges) only for
    # the two that make and remove the directories and the tmpfs, which the containers bind from
    assert (mps.get("ExecStartPre"), mps.get("ExecStart"), mps.get("ExecStop"), mps.get("ExecStopPost")) == (
        f"+{module} mps-prepare %i", f"{module} mps-start %i", f"{module} mps-stop %i", f"+{module} mps-cleanup %i",
    )
    assert (timeslice.get("ExecStart"), timeslice.get("ExecStop")) == (f"{module} timeslice %i", None)
    assert (mps.get("Type"), timeslice.get("Type")) == ("forking", "oneshot")
    target = parse_unit(UNIT_DIR / TARGET)
    for u in (mps, timeslice):
        assert u.get("User") is None and u.get("DynamicUser") is None, u.name  # root
        assert u.items("WantedBy", "Install") == [] and u.name not in target.items("Wants", "Unit"), u.name
        assert (u.get("NoNewPrivileges"), u.get("ProtectSystem"), u.get("DevicePolicy")) == ("yes", "strict", "closed"), u.name
        assert u.values("DeviceAllow") == ["char-nvidia* rw"], u.name
        assert u.values("SystemCallFilter") == ["@system-service"], u.name
        assert (u.get("RestrictNamespaces"), u.get("PrivateNetwork"), u.get("RestrictAddressFamilies")) == ("yes", "yes", "AF_UNIX"), u.name
    # the daemon's /dev/shm is its own directory, and it writes its pipe and log directories only
    assert mps.values("BindPaths") == ["-/run/bcd/mps/%i/shm:/dev/shm"]
    assert set(mps.items("ReadWritePaths")) == {"-/run/bcd/mps/%i/pipe", "-/run/bcd/mps/%i/log"} and timeslice.items("ReadWritePaths") == []
    assert mps.environment()["BCD_MPS_ROOT"] == unit("bcd-inventory.service").environment()["BCD_MPS_ROOT"] == "/run/bcd/mps"
    assert mps.environment()["BCD_MPS_SHM_SIZE"] == "50%"
    # what NVIDIA's daemon needs to start each client's server as the client and end it, no more
    assert mps.items("CapabilityBoundingSet") == ["CAP_SETUID", "CAP_SETGID", "CAP_KILL"]
    assert (mps.get("PrivateIPC"), mps.get("PrivateMounts"), mps.get("PrivateUsers")) == ("yes", "yes", None)
    assert timeslice.values("CapabilityBoundingSet") == ["CAP_SYS_ADMIN"]


def test_the_mps_daemons_tree_is_the_one_mpsroot_lays_out_and_the_inventory_hands_specs_beside_it():
    from services.inventory import mpsroot
    from services.inventory.adapters.base import mps_spec_dir

    mps = TEMPLATES["bcd-mps@.service"]
    shm, _ = mps.get("BindPaths").lstrip("-").split(":")
    rw = {p.lstrip("-") for p in mps.items("ReadWritePaths")}
    root = Path(mps.environment()["BCD_MPS_ROOT"])
    assert {shm, *rw} == {str(root / "%i" / name) for name in mpsroot.DAEMON_DIRS}
    assert str(mps_spec_dir(root)) in _tmpfiles() and str(mps_spec_dir(root)) in READ_WRITE_PATHS["bcd-inventory.service"]
    assert mps.environment()["BCD_MPS_SHM_SIZE"] == mpsroot.DEFAULT_SHM_SIZE


@needs_analyze
@pytest.mark.parametrize("name", sorted(TEMPLATE_MAX_EXPOSURE))
def test_sharing_template_exposure_within_the_stated_level(name):
    if _systemd_version() < 250:
        pytest.skip("systemd-analyze security --offline needs systemd 250 or newer")
    result = _analyze("security", "--offline=true", "--no-pager", str(UNIT_DIR / name))
    assert result.returncode == 0, result.stderr
    # a template is rated as an instance of itself ("bcd-mps@i.service")
    m = re.search(rf"Overall exposure level for {re.escape(name.replace('@', '@i'))}: (\d+\.\d+) (\w+)", result.stdout)
    assert m, result.stdout[-2000:]
    assert float(m.group(1)) <= TEMPLATE_MAX_EXPOSURE[name], f"{name}: exposure {m.group(1)} {m.group(2)}"


def test_the_inventory_reaches_its_sharing_units_only_through_bcd_sharing_socket():
    """No polkit rule: the inventory connects to a socket only its group may open, and the
    gate behind it (root, no capability) starts the units with a job mode of its own."""
    from services.inventory import sharing_gate
    from services.inventory.adapters.nvidia_sharing import SHARING_SOCKET

    assert not (UNIT_DIR / "polkit").exists()
    sock = parse_unit(UNIT_DIR / SHARING_SOCKET_UNIT)
    assert sock.values("ListenStream", "Socket") == [str(SHARING_SOCKET)]
    assert (sock.get("SocketUser", "Socket"), sock.get("SocketGroup", "Socket"), sock.get("SocketMode", "Socket")) == ("root", USERS["bcd-inventory.service"], "0660")
    assert sock.get("Accept", "Socket") == "yes" and sock.items("WantedBy", "Install") == ["sockets.target"]
    # the upgrade step: the daemons' directories an older inventory made become root's first
    assert sock.values("ExecStartPre", "Socket") == [f"-{VENV_BIN}python -m services.inventory.sharing_unit mps-adopt"]
    assert sock.values("Environment", "Socket") == ["BCD_MPS_ROOT=/run/bcd/mps"]
    assert str(SHARING_SOCKET.parent) in _tmpfiles()
    gate = TEMPLATES["bcd-sharing@.service"]
    assert gate.get("ExecStart") == f"{VENV_BIN}python -m services.inventory.sharing_gate"
    assert (gate.get("StandardInput"), gate.get("StandardOutput")) == ("socket", "socket")
    assert gate.environment()["BCD_SHARING_CLIENT"] == USERS["bcd-inventory.service"] == sharing_gate.DEFAULT_CLIENT
    assert gate.get("User") is None and gate.values("CapabilityBoundingSet") == [""] and gate.values("AmbientCapabilities") == [""]
    for key, want in HARDENING.items():
        if key in ("PrivateUsers", "IPAddressAllow", "RestrictAddressFamilies"):
            continue  # systemd must see the host's uid 0; no IP at all; unix sockets only
        assert gate.get(key) == want, f"bcd-sharing@.service: {key}={gate.get(key)!r}, want {want!r}"
    assert (gate.get("PrivateUsers"), gate.get("IPAddressAllow"), gate.get("RestrictAddressFamilies")) == (None, None, "AF_UNIX")
    assert gate.values("SystemCallFilter") == ["@system-service", "~@privileged @resources"]
    # the inventory's unit lets it reach the socket (unix sockets; the path is not hidden)
    inv = unit("bcd-inventory.service")
    assert "AF_UNIX" in inv.get("RestrictAddressFamilies").split() and str(SHARING_SOCKET.parent) not in inv.items("InaccessiblePaths")
