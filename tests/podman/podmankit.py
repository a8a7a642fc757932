"""Running a real podman against a node's CDI specs, on a host with no GPU and no registry.

- `Podman.image()`: a busybox image made here (`podman import` of a folder
  holding a static busybox and its applets); nothing can be pulled.
- `Podman.run(argv, script, etc_cdi, run_cdi)`: runs `argv` (as `bcd cdi
  list` prints it) plus the flags this machine needs (../shared/PODMAN.md:
  runc, no network, explicit ulimits) inside a private mount namespace in
  which the node's CDI dir is bind-mounted on /etc/cdi and its consumer dir on
  /var/run/cdi: the only spec dirs podman 4.3 reads, at their real priorities,
  without touching the host's own /etc/cdi or /var/run/cdi.
- `HostStubs`: the device nodes, mount sources and hook binaries the specs
  name exist on a GPU host and not here; each missing one is made (mknod,
  an empty file, a script that exits 0) and exactly those are removed again.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: what ../shared/PODMAN.md found podman here needs: runc (crun refuses hybrid cgroups), no
#: network, and explicit ulimits (runc cannot raise the defaults in this sandbox)
MACHINE_FLAGS = ["--runtime", "runc", "--network", "none", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
APPLETS = ("sh", "env", "ls", "cat", "test", "stat", "grep", "true")
RUN_TIMEOUT_S = 60

#: NVIDIA's device numbers, for the stand-ins of the nodes its spec names
_DEVICE_NUMBERS = {"nvidiactl": (195, 255), "nvidia-modeset": (195, 254), "nvidia-uvm": (511, 0), "nvidia-uvm-tools": (511, 1)}


def static_busybox() -> str:
    """A busybox that runs in an empty image (busybox-static); "" when none is installed."""
    for candidate in ("/bin/busybox", "/usr/bin/busybox", shutil.which("busybox") or ""):
        if candidate and os.path.isfile(candidate) and not _has_interpreter(Path(candidate)):
            return candidate
    return ""


def _has_interpreter(path: Path) -> bool:
    """A dynamically linked ELF names its loader (PT_INTERP, type 3) in a program header."""
    data = path.read_bytes()[:1 << 16]
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit only: this machine's
        return True
    phoff = int.from_bytes(data[32:40], "little")
    size, count = int.from_bytes(data[54:56], "little"), int.from_bytes(data[56:58], "little")
    return any(int.from_bytes(data[phoff + i * size : phoff + i * size + 4], "little") == 3 for i in range(count))


class Podman:
    def __init__(self, binary: str, image: str) -> None:
        self.binary = binary
        self.image_name = image

    def version(self) -> str:
        return subprocess.run([self.binary, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()

    def build_image(self, busybox: str) -> None:
        with tempfile.TemporaryDirectory(prefix="bcd-podman-image-") as d:
            root = Path(d) / "root"
            (root / "bin").mkdir(parents=True)
            shutil.copy2(busybox, root / "bin" / "busybox")
            for applet in APPLETS:
                (root / "bin" / applet).symlink_to("busybox")
            tar = subprocess.run(["tar", "-C", str(root), "-c", "."], capture_output=True, check=True, timeout=60).stdout
            r = subprocess.run([self.binary, "import", "-", self.image_name], input=tar, capture_output=True, timeout=120)
            assert r.returncode == 0, r.stderr.decode()

    def remove_image(self) -> None:
        subprocess.run([self.binary, "rmi", "-f", self.image_name], capture_output=True, timeout=120)

    def run(self, argv: list[str], script: str, etc_cdi: Path, run_cdi: Path) -> subprocess.CompletedProcess[str]:
        """`argv` (`podman run --device ...`, without the image) with this machine's flags, the
        image and `sh -c script`, where etc_cdi is /etc/cdi and run_cdi is /var/run/cdi."""
        assert argv[:2] == ["podman", "run"], argv
        return namespaced([self.binary, "run", "--rm", *MACHINE_FLAGS, *argv[2:], self.image_name, "sh", "-c", script], etc_cdi, run_cdi)


def namespaced(cmd: list[str], etc_cdi: Path, run_cdi: Path) -> subprocess.CompletedProcess[str]:
    """`cmd` in a private mount namespace with etc_cdi bind-mounted on /etc/cdi and run_cdi on
    /var/run/cdi (podman 4.3 reads no other spec dirs); the host's own are never touched."""
    inner = 'mount --bind "$1" /etc/cdi && mount --bind "$2" /var/run/cdi && shift 2 && exec "$@"'
    wrapped = ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner, "sh", str(etc_cdi), str(run_cdi), *cmd]
    return subprocess.run(wrapped, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


class MountPoints:
    """/etc/cdi and /var/run/cdi must exist to be mounted on; those made here are removed again."""

    def __init__(self) -> None:
        self.made: list[Path] = []

    def ensure(self) -> None:
        for path in (Path("/etc/cdi"), Path("/var/run/cdi")):
            real = Path(os.path.realpath(path))
            if not real.exists():
                real.mkdir(parents=True)
                self.made.append(real)

    def remove(self) -> None:
        for path in reversed(self.made):
            try:
                path.rmdir()  # only when still empty: never someone else's specs
            except OSError:
                pass
        self.made.clear()


def device_numbers(name: str) -> tuple[int, int]:
    """The (major, minor) of NVIDIA's device node `name` (nvidia<N>: 195/N, nvidia-cap<N>: 234/N)."""
    if name in _DEVICE_NUMBERS:
        return _DEVICE_NUMBERS[name]
    for prefix, major in (("nvidia-cap", 234), ("nvidia", 195)):
        rest = name.removeprefix(prefix)
        if rest != name and rest.isdigit():
            return major, int(rest)
    return 1, 3  # anything else: a node like /dev/null's


def spec_paths(specs: Iterable[dict[str, Any]]) -> tuple[set[str], set[str], set[str]]:
    """(device node host paths, mount sources, hook binaries) the specs name."""
    nodes: set[str] = set()
    mounts: set[str] = set()
    hooks: set[str] = set()
    for spec in specs:
        for edits in [spec.get("containerEdits") or {}, *((d.get("containerEdits") or {}) for d in spec.get("devices", []))]:
            nodes.update(n.get("hostPath") or n["path"] for n in edits.get("deviceNodes", []))
            mounts.update(m["hostPath"] for m in edits.get("mounts", []))
            hooks.update(h["path"] for h in edits.get("hooks", []))
    return nodes, mounts, hooks


class HostStubs:
    """Stand-ins for what the specs name and this host lacks; `remove` takes exactly those away."""

    def __init__(self) -> None:
        #: made, in order (directories before what is in them)
        self.made: list[Path] = []

    def _parent(self, path: Path) -> None:
        missing = []
        p = path.parent
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            d.mkdir()
            self.made.append(d)

    def cover(self, specs: Iterable[dict[str, Any]]) -> None:
        nodes, mounts, hooks = spec_paths(specs)
        for node in sorted(nodes):
            path = Path(node)
            if os.path.lexists(path):
                continue
            self._parent(path)
            major, minor = device_numbers(path.name)
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            self.made.append(path)
        for source in sorted(mounts):
            path = Path(source)
            if os.path.lexists(path):
                continue
            self._parent(path)
            path.write_bytes(b"")
            self.made.append(path)
        for hook in sorted(hooks):
            path = Path(hook)
            if os.path.lexists(path):
                continue
            self._parent(path)
            path.write_text("#!/bin/sh\n# a stand-in for a vendor CDI hook (tests/podman)\nexit 0\n")
            path.chmod(0o755)
            self.made.append(path)

    def remove(self) -> None:
        for path in reversed(self.made):
            try:
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
            except OSError:
                pass
        self.made.clear()


def read_specs(*dirs: Path) -> list[dict[str, Any]]:
    out = []
    for d in dirs:
        for p in sorted(Path(d).glob("*.json")):
            out.append(json.loads(p.read_text()))
    return out


__all__ = ["MACHINE_FLAGS", "Podman", "namespaced", "MountPoints", "HostStubs", "spec_paths", "read_specs", "static_busybox"]
