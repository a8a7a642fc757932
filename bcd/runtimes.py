"""The container runtimes on this host, and whether each can use bcd's holds.

bcd writes each hold twice (shared.holdfiles, docs/cdi-runtimes.md): the hold
spec `<cdi_dir>/bcd-<allocation>.json` (cdiVersion >= 0.6.0: it carries
annotations) and its consumer copy `<cdi_consumer_dir>/bcd-<allocation>.json`
(no annotations, the lowest cdiVersion: usually 0.3.0). Whether a runtime
finds a hold's devices depends on the CDI library it vendors (a library v0.X
decodes strictly and reads cdiVersion <= 0.X.0, and skips a file it cannot
parse), on whether CDI is on in it, and on the spec dirs it reads (each later
dir ranks higher: the same device name in a higher dir wins). This module owns
that knowledge, so that `bcd doctor` and `bcd cdi list` say the same thing:

* `CDI_LIBRARIES` and friends: per runtime, the CDI library of each release
  (read off its go.mod/vendor.mod at every release tag), when CDI is on by
  default, from which release its spec dirs can be set;
* `cdi_reader(runtime, version)`: what that release reads (pure);
* `RuntimeProbe`, with `HostRuntimes` (podman, docker, containerd, crio on
  PATH, each asked its version with a 5 s timeout, their config files read)
  and `FakeRuntimes` for tests: the facts, `RuntimeFacts`;
* `hold_use(runtime, hold)`: whether the runtime resolves the hold's devices,
  from which file, and when not, one line of what the operator should do (pure).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shared.holdfiles import DEFAULT_CONSUMER_DIR

#: the runtimes looked for, in the order they are shown.
RUNTIME_NAMES: tuple[str, ...] = ("podman", "docker", "containerd", "crio")
#: every CDI runtime's spec dirs unless configured: the later ranks higher.
DEFAULT_SPEC_DIRS: tuple[str, ...] = ("/etc/cdi", "/var/run/cdi")
#: the CDI library of podman 3.2 - 4.0: from before the first tag (v0.3.0); reads 0.1.0 and 0.2.0 only.
PRE_RELEASE = "pre-release"

#: per runtime: (first release, the CDI library it vendors), from that release on until the next
#: row; before the first row the runtime has no CDI. Read off go.mod/vendor.mod at each release tag.
CDI_LIBRARIES: dict[str, tuple[tuple[str, str], ...]] = {
    "podman": (
        ("3.2.0", PRE_RELEASE), ("4.1.0", "v0.4"), ("4.3.0", "v0.5"), ("4.7.0", "v0.6"),
        ("5.1.0", "v0.7"), ("5.2.0", "v0.8"), ("5.5.0", "v1.0"),
    ),
    # the daemon's version; 25.0.17 took v0.8 on the 25.0 line, 26.0.0 went back to v0.6
    "docker": (
        ("25.0.0", "v0.6"), ("25.0.17", "v0.8"), ("26.0.0", "v0.6"), ("26.1.0", "v0.7"),
        ("27.4.0", "v0.8"), ("28.1.0", "v1.0"),
    ),
    "containerd": (
        ("1.7.0", "v0.5"), ("1.7.12", "v0.6"), ("1.7.16", "v0.7"), ("1.7.27", "v0.8"),
        ("2.0.0", "v0.8"), ("2.0.5", "v1.0"), ("2.2.1", "v1.1"),
    ),
    "crio": (
        ("1.24.0", "v0.3"), ("1.25.0", "v0.5"), ("1.28.0", "v0.6"), ("1.30.0", "v0.7"),
        ("1.31.0", "v0.8"), ("1.33.0", "v1.0"), ("1.35.0", "v1.1"),
    ),
}  # fmt: skip
#: from which release CDI is on without being asked (before it, from the first CDI release, it
#: must be turned on: docker's daemon.json `"features": {"cdi": true}`, containerd's `enable_cdi`).
CDI_ON_BY_DEFAULT_FROM: dict[str, str] = {"podman": "0.0.0", "docker": "28.2.0", "containerd": "2.0.0", "crio": "0.0.0"}
#: from which release the spec dirs can be configured (podman: containers.conf `[engine] cdi_spec_dirs`).
SPEC_DIRS_CONFIGURABLE_FROM: dict[str, str] = {"podman": "5.3.0", "docker": "25.0.0", "containerd": "1.7.0", "crio": "1.24.0"}
#: how each runtime is asked its version (docker: the daemon's, not the client's).
VERSION_COMMANDS: dict[str, tuple[str, ...]] = {
    "podman": ("--version",),
    "docker": ("version", "--format", "{{.Server.Version}}"),
    "containerd": ("--version",),
    "crio": ("--version",),
}
#: podman's cgroup manager (a sliced hold's --cgroup-parent needs systemd's)
CGROUP_MANAGER_COMMAND: tuple[str, ...] = ("info", "--format", "{{.Host.CgroupManager}}")
#: what restarts each runtime after a config change ("" for podman: it has no daemon).
RESTART: dict[str, str] = {"podman": "", "docker": "restart dockerd", "containerd": "restart containerd", "crio": "restart crio"}
#: the seconds a version command may take before it is killed and reported.
VERSION_TIMEOUT_S = 5.0

_VERSION_RE = re.compile(r"(?<![\w.])v?(\d+)\.(\d+)(?:\.(\d+))?")

Version = tuple[int, int, int]


def parse_version(text: str) -> Version | None:
    """The first `X.Y[.Z]` in a runtime's version text ("podman version 4.3.1", "20.10.24+dfsg1",
    "containerd github.com/containerd/containerd/v2 v2.0.0 207ad71"); None when there is none."""
    m = _VERSION_RE.search(text)
    if m is None:
        return None
    return int(m[1]), int(m[2]), int(m[3] or 0)


def version_text(v: Version) -> str:
    return ".".join(str(p) for p in v)


def _key(version: str) -> Version:
    v = parse_version(version)
    if v is None:
        raise ValueError(f"{version!r} is not a version")
    return v


def _cdi_key(cdi_version: str | None) -> Version | None:
    """A cdiVersion as a tuple, only when it is exactly X.Y.Z (a runtime refuses anything else)."""
    if cdi_version is None or not re.fullmatch(r"\d+\.\d+\.\d+", cdi_version):
        return None
    return _key(cdi_version)


# ---------------------------------------------------------------------------- what a release reads


@dataclass(frozen=True)
class CdiReader:
    """What one runtime release does with a CDI spec file."""

    #: "v0.5", PRE_RELEASE, or "" (no CDI in this release).
    library: str
    #: the highest cdiVersion it parses ("" when it has no CDI).
    highest: str

    @property
    def has_cdi(self) -> bool:
        return bool(self.library)

    def reads(self, cdi_version: str | None) -> bool:
        v = _cdi_key(cdi_version)
        return bool(self.highest) and v is not None and v <= _key(self.highest)

    @property
    def text(self) -> str:
        if not self.library:
            return "no CDI"
        if self.library == PRE_RELEASE:
            return "a pre-release CDI library: reads cdiVersion 0.1.0 and 0.2.0 only"
        return f"CDI library {self.library}: reads cdiVersion <= {self.highest}"


NO_CDI = CdiReader(library="", highest="")


def _library_reader(library: str) -> CdiReader:
    if library == PRE_RELEASE:
        return CdiReader(library=PRE_RELEASE, highest="0.2.0")
    major, minor = library.removeprefix("v").split(".")
    return CdiReader(library=library, highest=f"{int(major)}.{int(minor)}.0")


def cdi_reader(runtime: str, version: str) -> CdiReader:
    """What `runtime` at `version` reads: its CDI library and the highest cdiVersion, or NO_CDI.

    ValueError for a runtime this module does not know or a version with no X.Y in it."""
    try:
        table = CDI_LIBRARIES[runtime]
    except KeyError:
        raise ValueError(f"unknown runtime {runtime!r} (known: {', '.join(RUNTIME_NAMES)})") from None
    v = _key(version)
    library = ""
    for first, lib in table:
        if v >= _key(first):
            library = lib
    return _library_reader(library) if library else NO_CDI


def cdi_on_by_default(runtime: str, version: str) -> bool:
    return _key(version) >= _key(CDI_ON_BY_DEFAULT_FROM[runtime])


def spec_dirs_configurable(runtime: str, version: str) -> bool:
    return _key(version) >= _key(SPEC_DIRS_CONFIGURABLE_FROM[runtime])


def upgrade_text(runtime: str, current: str, cdi_version: str) -> str:
    """What to upgrade `runtime` (now at `current`) to, to read files of `cdi_version`."""
    table = CDI_LIBRARIES[runtime]
    readers = [(first, _library_reader(lib).reads(cdi_version)) for first, lib in table]
    steady = len(readers)
    while steady > 0 and readers[steady - 1][1]:
        steady -= 1
    if steady == len(readers):
        newest = _library_reader(table[-1][1])
        return f"no {runtime} release reads cdiVersion {cdi_version} (from {table[-1][0]} on it reads <= {newest.highest})"
    or_later = readers[steady][0]
    now = _key(current)
    first = next((f for f, reads in readers if reads and _key(f) > now), or_later)
    text = f"upgrade {runtime} to {or_later} or later" if first == or_later else f"upgrade {runtime} to {first} (or {or_later} or later)"
    return text


# ---------------------------------------------------------------------------- the facts


@dataclass(frozen=True)
class RuntimeFacts:
    """One runtime found on this host, as a probe saw it."""

    #: one of RUNTIME_NAMES.
    name: str
    #: where it was found ("" for a fake).
    path: str = ""
    #: "4.3.1"; "" when its version command failed (`error` says why).
    version: str = ""
    error: str = ""
    #: whether CDI is on (always for podman and CRI-O; a setting for docker and containerd).
    cdi_enabled: bool = True
    #: the spec dirs it reads, lowest priority first.
    spec_dirs: tuple[str, ...] = DEFAULT_SPEC_DIRS
    #: where its spec dirs are set, as the operator edits it (`cdi_spec_dirs in /etc/crio/crio.conf`);
    #: "" when this release reads only the default dirs (podman before 5.3).
    spec_dirs_setting: str = ""
    #: how CDI is turned on in it, as the operator does it ("" when it is always on).
    cdi_switch: str = ""
    #: a config file that could not be read (the defaults were assumed).
    config_error: str = ""
    #: podman's cgroup manager ("systemd" or "cgroupfs"; "" unknown): with cgroupfs podman refuses
    #: a systemd slice as --cgroup-parent ("systemd slice received as cgroup parent when using cgroupfs")
    cgroup_manager: str = ""

    @property
    def slice_parent_refused(self) -> bool:
        """It refuses `--cgroup-parent bcd-alloc-<id>.slice` (podman under cgroupfs, a host whose init is no systemd)."""
        return self.name == "podman" and self.cgroup_manager == "cgroupfs"

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}" if self.version else self.name

    @property
    def reader(self) -> CdiReader:
        return cdi_reader(self.name, self.version) if self.version else NO_CDI

    def describe(self) -> str:
        """`podman 4.3.1 (CDI library v0.5: reads cdiVersion <= 0.5.0; dirs /etc/cdi, /var/run/cdi)`."""
        if not self.version:
            return f"{self.name} (version unknown: {self.error})"
        first = CDI_LIBRARIES[self.name][0][0]
        parts = [self.reader.text if self.reader.has_cdi else f"no CDI: it came in {self.name} {first}"]
        if self.reader.has_cdi:
            if not self.cdi_enabled:
                parts.append("CDI is off")
            parts.append("dirs " + (", ".join(self.spec_dirs) or "(none)"))
            if self.cgroup_manager:
                parts.append(f"cgroup manager {self.cgroup_manager}")
        if self.config_error:
            parts.append(f"config: {self.config_error}")
        return f"{self.label} ({'; '.join(parts)})"


class RuntimeProbe(Protocol):
    """Finds the container runtimes on this host."""

    def find(self) -> list[RuntimeFacts]:
        """Every runtime found, in RUNTIME_NAMES order; [] when there is none."""
        ...


@dataclass
class FakeRuntimes:
    """A probe that finds what it was given (tests)."""

    runtimes: list[RuntimeFacts] = field(default_factory=list)

    def find(self) -> list[RuntimeFacts]:
        return list(self.runtimes)


# ---------------------------------------------------------------------------- config files (pure)


@dataclass(frozen=True)
class RuntimeConfig:
    cdi_enabled: bool
    spec_dirs: tuple[str, ...]
    spec_dirs_setting: str
    cdi_switch: str
    error: str = ""


def _dirs(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, list) and all(isinstance(d, str) for d in value):
        return tuple(value)
    return None


def docker_config(daemon_json: bytes | None, version: str, path: str = "/etc/docker/daemon.json") -> RuntimeConfig:
    """CDI on/off and the spec dirs from docker's daemon.json (None: no such file)."""
    error = ""
    doc: Any = {}
    if daemon_json is not None:
        try:
            doc = json.loads(daemon_json)
        except ValueError as exc:
            error = f"{path}: not JSON ({exc})"
    if not isinstance(doc, dict):
        error, doc = error or f"{path}: not a JSON object", {}
    features = doc.get("features")
    cdi = features.get("cdi") if isinstance(features, dict) else None
    enabled = cdi is not False if cdi_on_by_default("docker", version) else cdi is True
    return RuntimeConfig(
        cdi_enabled=enabled,
        spec_dirs=_dirs(doc.get("cdi-spec-dirs")) or DEFAULT_SPEC_DIRS,
        spec_dirs_setting=f'"cdi-spec-dirs" in {path}',
        cdi_switch=f'set "features": {{"cdi": true}} in {path}',
        error=error,
    )


_CONTAINERD_CRI_TABLES = ("io.containerd.cri.v1.runtime", "io.containerd.grpc.v1.cri", "cri")


def containerd_config(config_toml: bytes | None, version: str, path: str = "/etc/containerd/config.toml") -> RuntimeConfig:
    """The CRI plugin's `enable_cdi` and `cdi_spec_dirs` from containerd's config.toml (None: no such file)."""
    error = ""
    doc: dict[str, Any] = {}
    if config_toml is not None:
        try:
            doc = tomllib.loads(config_toml.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            error = f"{path}: not TOML ({exc})"
    plugins = doc.get("plugins")
    plugins = plugins if isinstance(plugins, dict) else {}
    found = next((k for k in _CONTAINERD_CRI_TABLES if isinstance(plugins.get(k), dict)), "")
    table: dict[str, Any] = plugins.get(found, {}) if found else {}
    config_version = doc.get("version", 3 if _key(version) >= (2, 0, 0) else 2)
    section = found or ("io.containerd.cri.v1.runtime" if isinstance(config_version, int) and config_version >= 3 else "io.containerd.grpc.v1.cri")
    section_text = f'[plugins."{section}"]' if "." in section else f"[plugins.{section}]"
    enable = table.get("enable_cdi")
    enabled = enable is not False if cdi_on_by_default("containerd", version) else enable is True
    return RuntimeConfig(
        cdi_enabled=enabled,
        spec_dirs=_dirs(table.get("cdi_spec_dirs")) or DEFAULT_SPEC_DIRS,
        spec_dirs_setting=f"cdi_spec_dirs under {section_text} in {path}",
        cdi_switch=f"set enable_cdi = true under {section_text} in {path}",
        error=error,
    )


def _toml_layers(files: Sequence[tuple[str, bytes]], *keys: str) -> tuple[tuple[str, ...] | None, str, str]:
    """The last `keys` list of strings in the TOML files (later files override), the file that set
    it, and the first file that could not be read."""
    dirs: tuple[str, ...] | None = None
    where, error = "", ""
    for path, data in files:
        try:
            node: Any = tomllib.loads(data.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            error = error or f"{path}: not TOML ({exc})"
            continue
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        if _dirs(node) is not None:
            dirs, where = _dirs(node), path
    return dirs, where, error


def crio_config(files: Sequence[tuple[str, bytes]], path: str = "/etc/crio/crio.conf") -> RuntimeConfig:
    """`[crio.runtime] cdi_spec_dirs` from crio.conf and its crio.conf.d drop-ins, in the order read."""
    dirs, where, error = _toml_layers(files, "crio", "runtime", "cdi_spec_dirs")
    return RuntimeConfig(
        cdi_enabled=True,
        spec_dirs=dirs or DEFAULT_SPEC_DIRS,
        spec_dirs_setting=f"cdi_spec_dirs under [crio.runtime] in {where or path}",
        cdi_switch="",
        error=error,
    )


def podman_config(files: Sequence[tuple[str, bytes]], version: str, path: str = "/etc/containers/containers.conf") -> RuntimeConfig:
    """Podman's spec dirs: the defaults before 5.3, then containers.conf's `[engine] cdi_spec_dirs`."""
    if not spec_dirs_configurable("podman", version):
        return RuntimeConfig(cdi_enabled=True, spec_dirs=DEFAULT_SPEC_DIRS, spec_dirs_setting="", cdi_switch="")
    dirs, where, error = _toml_layers(files, "engine", "cdi_spec_dirs")
    return RuntimeConfig(
        cdi_enabled=True,
        spec_dirs=dirs or DEFAULT_SPEC_DIRS,
        spec_dirs_setting=f"cdi_spec_dirs under [engine] in {where or path}",
        cdi_switch="",
        error=error,
    )


# ---------------------------------------------------------------------------- the real probe


def run_version_command(argv: Sequence[str], timeout_s: float = VERSION_TIMEOUT_S) -> tuple[str, str]:
    """(stdout, "") of a version command, or ("", why it failed). Never waits past `timeout_s`:
    the command runs in its own process group, killed whole (children too) when it is late."""
    shown = shlex.join(argv)
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env={**os.environ, "LC_ALL": "C"},
        )
    except OSError as exc:
        return "", f"`{shown}` could not start ({exc.strerror or exc})"
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        proc.wait()
        return "", f"`{shown}` did not answer within {timeout_s:g} s"
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (err or out).decode(errors="replace").splitlines() if ln.strip()]
        why = lines[-1] if lines else "no output"
        return "", f"`{shown}` failed (exit {proc.returncode}): {why[:300]}"
    return out.decode(errors="replace"), ""


@dataclass
class HostRuntimes:
    """The runtimes on this host: found on PATH (shutil.which), each asked its version (at most
    VERSION_TIMEOUT_S each, all at once), their config files read under `root`."""

    #: the PATH to search (None: the process's).
    path: str | None = None
    #: where /etc and /usr/share are (tests: a temp dir).
    root: Path = Path("/")
    timeout_s: float = VERSION_TIMEOUT_S

    def find(self) -> list[RuntimeFacts]:
        found = [(name, exe) for name in RUNTIME_NAMES if (exe := shutil.which(name, path=self.path))]
        if not found:
            return []
        with ThreadPoolExecutor(max_workers=len(found)) as pool:
            answers = list(pool.map(lambda f: run_version_command([f[1], *VERSION_COMMANDS[f[0]]], self.timeout_s), found))
        return [self._facts(name, exe, out, err) for (name, exe), (out, err) in zip(found, answers, strict=True)]

    def _read(self, path: str) -> bytes | None:
        try:
            return (self.root / path.lstrip("/")).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigUnreadable(f"{path}: {exc.strerror or exc}") from None

    def _layers(self, main: Iterable[str], dropin_dir: str) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for path in main:
            data = self._read(path)
            if data is not None:
                out.append((path, data))
        try:
            names = sorted(p.name for p in (self.root / dropin_dir.lstrip("/")).glob("*.conf"))
        except OSError:
            names = []
        for name in names:
            data = self._read(f"{dropin_dir}/{name}")
            if data is not None:
                out.append((f"{dropin_dir}/{name}", data))
        return out

    def _config(self, name: str, version: str) -> RuntimeConfig:
        if name == "docker":
            return docker_config(self._read("/etc/docker/daemon.json"), version)
        if name == "containerd":
            return containerd_config(self._read("/etc/containerd/config.toml"), version)
        if name == "crio":
            return crio_config(self._layers(["/etc/crio/crio.conf"], "/etc/crio/crio.conf.d"))
        override = os.environ.get("CONTAINERS_CONF", "")
        mains = [override] if override else ["/usr/share/containers/containers.conf", "/etc/containers/containers.conf"]
        return podman_config(self._layers(mains, "/etc/containers/containers.conf.d"), version, override or "/etc/containers/containers.conf")

    def _facts(self, name: str, exe: str, out: str, err: str) -> RuntimeFacts:
        parsed = parse_version(out) if not err else None
        if not err and parsed is None:
            err = f"`{exe} {' '.join(VERSION_COMMANDS[name])}` said {out.strip()[:100]!r}: no version in it"
        version = version_text(parsed) if parsed else ""
        try:
            config = self._config(name, version or "0.0.0")
        except ConfigUnreadable as exc:
            config = RuntimeConfig(cdi_enabled=True, spec_dirs=DEFAULT_SPEC_DIRS, spec_dirs_setting="", cdi_switch="", error=str(exc))
        manager = ""
        if name == "podman" and version:
            answer, failed = run_version_command([exe, *CGROUP_MANAGER_COMMAND], self.timeout_s)
            manager = answer.strip() if not failed and answer.strip() in ("systemd", "cgroupfs") else ""
        return RuntimeFacts(
            name=name,
            path=exe,
            version=version,
            error=err,
            cdi_enabled=config.cdi_enabled,
            spec_dirs=config.spec_dirs,
            spec_dirs_setting=config.spec_dirs_setting,
            cdi_switch=config.cdi_switch,
            config_error=config.error,
            cgroup_manager=manager,
        )


class ConfigUnreadable(Exception):
    """A runtime's config file is there but cannot be read (the text says which and why)."""


def default_probe() -> RuntimeProbe:
    """The probe the commands use (tests replace it)."""
    return HostRuntimes()


# ---------------------------------------------------------------------------- which holds each can use (pure)


@dataclass(frozen=True)
class HoldFiles:
    """The two files of one hold as the node's CDI dirs hold them."""

    allocation_id: str
    spec_file: str
    #: the hold spec's cdiVersion.
    spec_version: str
    #: the consumer copy's path; "" when the node's consumer dir is unknown (a node.json from before them).
    copy_file: str = ""
    #: the copy's cdiVersion; None when it is missing (or could not be read).
    copy_version: str | None = None


@dataclass(frozen=True)
class HoldUse:
    """Whether one runtime resolves one hold's devices."""

    runtime: str
    allocation_id: str
    #: True: it does; False: it does not (`todo` says what to do); None: cannot tell (its version is unknown).
    usable: bool | None
    #: the file whose devices it takes: of the files it can parse, the one in its highest-ranked dir.
    file: str = ""
    todo: str = ""


def _canon(path: str, same_dirs: Mapping[str, str]) -> str:
    norm = os.path.normpath(path)
    return same_dirs.get(path, same_dirs.get(norm, norm))


def _rank(rt: RuntimeFacts, path: str, same_dirs: Mapping[str, str]) -> int | None:
    """The priority of the dir of `path` among the runtime's spec dirs (higher wins); None: not read."""
    want = _canon(os.path.dirname(path), same_dirs)
    ranks = [i for i, d in enumerate(rt.spec_dirs) if _canon(d, same_dirs) == want]
    return ranks[-1] if ranks else None


def _node_dirs_text(hold: HoldFiles) -> str:
    dirs = [os.path.dirname(hold.spec_file)] + ([os.path.dirname(hold.copy_file)] if hold.copy_file else [])
    return ", ".join(dict.fromkeys(dirs))


def _dir_todo(rt: RuntimeFacts, hold: HoldFiles, directory: str, same_dirs: Mapping[str, str]) -> str:
    """What makes `rt` read `directory` (one of the hold's dirs)."""
    restart = f" and {RESTART[rt.name]}" if RESTART[rt.name] else ""
    add = f"add {directory} to {rt.spec_dirs_setting}{restart}" if rt.spec_dirs_setting else ""
    defaults = {_canon(d, same_dirs) for d in DEFAULT_SPEC_DIRS}
    node_dirs = {_canon(os.path.dirname(f), same_dirs) for f in (hold.spec_file, hold.copy_file) if f}
    if node_dirs & defaults:
        return add or f"{rt.label} reads only {', '.join(rt.spec_dirs)}: put the node's CDI dirs there"
    reads = ", ".join(rt.spec_dirs) or "none"
    only = "" if rt.spec_dirs_setting else f"; before {SPEC_DIRS_CONFIGURABLE_FROM[rt.name]} {rt.name} reads no others"
    text = (
        f"the node's CDI dirs ({_node_dirs_text(hold)}) are not dirs {rt.label} reads ({reads}{only}); "
        f"`make run` keeps them under state/: run the converger with --cdi-dir {DEFAULT_SPEC_DIRS[0]} "
        f"--cdi-consumer-dir {DEFAULT_CONSUMER_DIR}"
    )
    return f"{text}, or {add}" if add else text


def hold_use(rt: RuntimeFacts, hold: HoldFiles, same_dirs: Mapping[str, str] | None = None) -> HoldUse:
    """Whether `rt` resolves the devices of `hold`, and when not what to do (one line).

    It does when one of the hold's files is in a dir it reads and at a cdiVersion it parses
    (a file it cannot parse is skipped, the others still load); of two such files the one
    in its higher-ranked dir gives the devices. `same_dirs` maps a path to the name of the
    dir it is (realpath: /var/run/cdi is /run/cdi), so that two spellings of one dir match.
    """
    same = same_dirs or {}

    def no(todo: str) -> HoldUse:
        return HoldUse(rt.name, hold.allocation_id, False, todo=todo)

    if not rt.version:
        return HoldUse(rt.name, hold.allocation_id, None, todo=f"cannot tell whether {rt.name} can use it: {rt.error}")
    reader = rt.reader
    files = [(hold.spec_file, hold.spec_version)]
    copy_dir, spec_dir = os.path.dirname(hold.copy_file), os.path.dirname(hold.spec_file)
    if hold.copy_file and hold.copy_version is not None and _canon(copy_dir, same) != _canon(spec_dir, same):
        files.append((hold.copy_file, hold.copy_version))
    lowest = min((v for _, v in files if _cdi_key(v) is not None), key=_key, default=hold.spec_version)
    if not reader.has_cdi:
        later_on = rt.cdi_enabled or cdi_on_by_default(rt.name, _first_reading(rt.name, lowest))
        switch = "" if later_on else rt.cdi_switch
        return no(f"{rt.label} has no CDI: {upgrade_text(rt.name, rt.version, lowest)}" + (f" and {switch}" if switch else ""))
    if not rt.cdi_enabled:
        restart = f" and {RESTART[rt.name]}" if RESTART[rt.name] else ""
        return no(f"CDI is off in {rt.label}: {rt.cdi_switch}{restart}")
    ranked = [(rank, path, v) for path, v in files if (rank := _rank(rt, path, same)) is not None]
    parsed = [(rank, path) for rank, path, v in ranked if reader.reads(v)]
    if parsed:
        return HoldUse(rt.name, hold.allocation_id, True, file=max(parsed)[1])
    elsewhere = [path for path, v in files if _rank(rt, path, same) is None and reader.reads(v)]
    if not ranked:
        # none of its files is in a dir it reads: the dir of one it would parse (the copy first)
        target = (elsewhere[-1] if elsewhere else (hold.copy_file or hold.spec_file))
        todo = _dir_todo(rt, hold, os.path.dirname(target), same)
        return no(todo if elsewhere else f"{todo}; and {upgrade_text(rt.name, rt.version, lowest)}")
    # it reads a dir with one of the hold's files, but none at a cdiVersion it parses
    options: list[str] = []
    if not hold.copy_file:
        options.append(
            f"the node wrote no consumer copy of it (its node.json names no cdi_consumer_dir: a node from "
            f"before them; restart it with this bcd) so {rt.label} sees only {hold.spec_file} (cdiVersion {hold.spec_version})"
        )
    elif hold.copy_version is None:
        options.append(f"its consumer copy {hold.copy_file} is missing (the converger writes it beside the hold spec: is it running this bcd?)")
    elif elsewhere:
        options.append(_dir_todo(rt, hold, os.path.dirname(elsewhere[-1]), same))
    in_read_dirs = min((v for _, _, v in ranked if _cdi_key(v) is not None), key=_key, default=hold.spec_version)
    options.append(upgrade_text(rt.name, rt.version, in_read_dirs))
    return no("; or ".join(options))


def _first_reading(runtime: str, cdi_version: str) -> str:
    """The first release of `runtime` that reads `cdi_version` ("0.0.0" when none does)."""
    return next((f for f, lib in CDI_LIBRARIES[runtime] if _library_reader(lib).reads(cdi_version)), "0.0.0")


def hold_uses(runtimes: Iterable[RuntimeFacts], holds: Iterable[HoldFiles], same_dirs: Mapping[str, str] | None = None) -> list[HoldUse]:
    """hold_use of every runtime and hold, runtime by runtime."""
    holds = list(holds)
    return [hold_use(rt, h, same_dirs) for rt in runtimes for h in holds]


def same_dirs_of(runtimes: Iterable[RuntimeFacts], holds: Iterable[HoldFiles], resolve: Callable[[str], str] = os.path.realpath) -> dict[str, str]:
    """Each dir the runtimes and holds name, mapped to the dir it really is (reads the file system)."""
    dirs = {d for rt in runtimes for d in rt.spec_dirs}
    dirs.update(os.path.dirname(f) for h in holds for f in (h.spec_file, h.copy_file) if f)
    return {d: resolve(d) for d in dirs}


__all__ = [
    "RUNTIME_NAMES",
    "DEFAULT_SPEC_DIRS",
    "PRE_RELEASE",
    "CDI_LIBRARIES",
    "CDI_ON_BY_DEFAULT_FROM",
    "SPEC_DIRS_CONFIGURABLE_FROM",
    "VERSION_COMMANDS",
    "VERSION_TIMEOUT_S",
    "parse_version",
    "CdiReader",
    "NO_CDI",
    "cdi_reader",
    "cdi_on_by_default",
    "spec_dirs_configurable",
    "upgrade_text",
    "RuntimeFacts",
    "RuntimeProbe",
    "FakeRuntimes",
    "RuntimeConfig",
    "docker_config",
    "containerd_config",
    "crio_config",
    "podman_config",
    "run_version_command",
    "HostRuntimes",
    "ConfigUnreadable",
    "default_probe",
    "HoldFiles",
    "HoldUse",
    "hold_use",
    "hold_uses",
    "same_dirs_of",
]
