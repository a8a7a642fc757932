"""Boot the VM suites' Debian guest (deploy/vm/build-image.sh) with qemu and drive it.

    image = build_image()                       # cached by content: seconds when nothing changed
    with Guest(image, workdir) as vm:           # boots; every wait bounded
        r = vm.run(["readlink", "/proc/1/exe"]) # stdout, stderr, exit code back
        vm.sh("systemctl is-system-running --wait", timeout=120)
    # powered off (the guest's own poweroff, then QMP quit, then SIGKILL, each bounded)

The machine: q35 with an emulated IOMMU (``-device intel-iommu``, guest ``intel_iommu=on``),
the image's own kernel and initramfs (``-kernel``/``-initrd``), the disk read through
``snapshot=on`` (the base image stays clean: writes go to a temporary overlay that qemu drops
at exit, and survive a guest reboot), an emulated PCI display (qemu's standard ``VGA``: ids 1234:1111, PCI
class 0x0300 - a display controller, so a GPU to the vfio_switcher - which the stock Debian
kernel binds to its ``bochs-drm`` driver; ``bochs-display`` has the same ids but class 0x0380,
which the switcher rightly refuses), no network.

Commands go to the guest agent (deploy/vm/guest/bcd-vm-agent.py) over a virtio-serial port,
one JSON line a request and one a reply: no login, no prompt parsing, no kernel messages in the
way. The serial console (kernel and systemd) goes to ``console.log`` in the workdir; every
timeout error quotes its tail.

Software emulation (TCG) unless ``BCD_VM_ACCEL=kvm``: a boot takes about a minute under TCG
on two cores. KVM is opt-in, not picked because /dev/kvm opens: where it opens but cannot run a
guest (nested, no vmx: qemu asserts on an MSR, or the guest never prints), TCG still works.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "deploy" / "vm" / "build-image.sh"
AGENT_PORT = "org.bcd.agent"
#: build-image.sh's exit status when the image cannot be built on this machine
CANNOT_BUILD = 3


class VMError(RuntimeError):
    """The guest or qemu failed; the message carries the console's tail."""


class VMTimeout(VMError):
    """A bounded wait ran out."""


class ImageUnavailable(RuntimeError):
    """The image cannot be built here (no root, a tool missing, the mirror unreachable)."""


@dataclass(frozen=True)
class Image:
    dir: Path
    kernel: Path
    initrd: Path
    disk: Path
    manifest: dict[str, Any]

    @classmethod
    def load(cls, d: Path) -> Image:
        m = json.loads((d / "manifest.json").read_text())
        return cls(d, d / m["kernel_image"], d / m["initrd"], d / m["disk"], m)


def build_image(timeout: float = 1800.0, cache: str | None = None) -> tuple[Image, float, str]:
    """Runs deploy/vm/build-image.sh: (the image, seconds it took, its log on stderr).

    Raises ImageUnavailable when the script says it cannot build here (exit 3), RuntimeError
    with the log's tail when it fails otherwise."""
    env = dict(os.environ)
    if cache:
        env["BCD_VM_CACHE"] = cache
    t0 = time.monotonic()
    try:
        r = subprocess.run([str(BUILD_SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{BUILD_SCRIPT} ran past {timeout:.0f} s") from e
    took = time.monotonic() - t0
    if r.returncode == CANNOT_BUILD:
        raise ImageUnavailable(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "build-image.sh: exit 3")
    if r.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return Image.load(Path(r.stdout.strip().splitlines()[-1])), took, r.stderr


def missing_tools() -> str:
    """"" when qemu (and debootstrap, to build the image) are here, else what is missing."""
    missing = [t for t in ("qemu-system-x86_64", "debootstrap", "mkfs.ext4") if shutil.which(t) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install qemu-system-x86 debootstrap e2fsprogs)"
    return ""


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


@dataclass
class Result:
    argv: list[str]
    rc: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    seconds: float = 0.0

    def check(self) -> Result:
        if self.rc != 0:
            why = "timed out in the guest" if self.timed_out else f"exit {self.rc}"
            raise VMError(f"{shlex.join(self.argv)}: {why}\nstdout: {self.stdout[-2000:]}\nstderr: {self.stderr[-2000:]}")
        return self


@dataclass
class Guest:
    image: Image
    workdir: Path
    memory_mb: int = 2048
    cpus: int = 2
    accel: str | None = None  # "kvm" or "tcg"; None: BCD_VM_ACCEL, else tcg
    #: a host directory the guest may mount read-only: ``mount -t 9p -o trans=virtio host /mnt``
    share: Path | None = None
    append: tuple[str, ...] = ()
    boot_timeout: float = 600.0
    #: seconds from qemu's start to the agent's first answer, and to the first command
    boot_seconds: float | None = None
    boot_id: str | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _sock: socket.socket | None = field(default=None, repr=False)
    _buf: bytes = field(default=b"", repr=False)
    _next_id: int = field(default=1, repr=False)
    _replies: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    _events: list[dict[str, Any]] = field(default_factory=list, repr=False)
    _started: float = field(default=0.0, repr=False)
    _out: Any = field(default=None, repr=False)

    # ------------------------------------------------------------- the machine
    @property
    def console_log(self) -> Path:
        return self.workdir / "console.log"

    def console_tail(self, chars: int = 3000) -> str:
        try:
            data = self.console_log.read_bytes()
        except OSError:
            return "(no console log)"
        return data[-chars:].decode(errors="replace")

    def _accel(self) -> str:
        accel = self.accel or os.environ.get("BCD_VM_ACCEL") or "tcg"
        if accel not in ("kvm", "tcg"):
            raise ValueError(f"accel must be kvm or tcg, not {accel!r}")
        if accel == "kvm" and not kvm_usable():
            raise VMError("BCD_VM_ACCEL=kvm but /dev/kvm cannot be opened")
        self.accel = accel
        return accel

    def command(self) -> list[str]:
        accel = self._accel()
        cmdline = [
            f"root={self.image.manifest.get('root', '/dev/vda')}", "rw", "console=ttyS0,115200",
            "intel_iommu=on", "systemd.unit=multi-user.target", "fsck.mode=skip",
            "panic=-1", "mitigations=off", *self.append,
        ]
        machine = "q35,accel=kvm,kernel-irqchip=split" if accel == "kvm" else "q35,accel=tcg"
        cmd = [
            "qemu-system-x86_64", "-name", "bcd-vm", "-nodefaults", "-no-user-config",
            "-machine", machine, "-cpu", "host" if accel == "kvm" else "max",
            "-m", str(self.memory_mb), "-smp", str(self.cpus),
            # the vIOMMU before the PCI devices it translates for
            "-device", "intel-iommu,intremap=on" if accel == "kvm" else "intel-iommu",
            "-display", "none", "-vga", "none",
            "-kernel", str(self.image.kernel), "-initrd", str(self.image.initrd), "-append", " ".join(cmdline),
            "-drive", f"file={self.image.disk},format=raw,if=none,id=root,snapshot=on,cache=unsafe",
            "-device", "virtio-blk-pci,drive=root",
            # the PCI display the guest binds to its own driver (bochs-drm), for the VFIO switch
            "-device", "VGA,id=display",
            "-chardev", f"file,id=console,path={self.console_log}", "-serial", "chardev:console",
            "-device", "virtio-serial-pci,id=vser",
            "-chardev", f"socket,id=agent,path={self.workdir / 'agent.sock'},server=on,wait=off",
            "-device", f"virtserialport,bus=vser.0,chardev=agent,name={AGENT_PORT}",
            "-qmp", f"unix:{self.workdir / 'qmp.sock'},server=on,wait=off",
            "-device", "virtio-rng-pci",
            "-nic", "none",
        ]
        if self.share is not None:
            cmd += ["-virtfs", f"local,path={self.share},mount_tag=host,security_model=none,readonly=on"]
        return cmd

    def start(self) -> Guest:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in ("agent.sock", "qmp.sock", "console.log"):
            (self.workdir / name).unlink(missing_ok=True)
        cmd = self.command()
        (self.workdir / "qemu.cmd").write_text(shlex.join(cmd) + "\n")
        # qemu's snapshot overlay goes to TMPDIR: the workdir, gone with it
        env = dict(os.environ, TMPDIR=str(self.workdir))
        self._started = time.monotonic()
        self._out = open(self.workdir / "qemu.out", "wb")
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._connect(deadline=time.monotonic() + 30)
        return self

    def _connect(self, deadline: float) -> None:
        path = str(self.workdir / "agent.sock")
        while True:
            self._check_alive()
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                self._sock = s
                return
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.monotonic() > deadline:
                    raise VMTimeout(f"qemu made no agent socket at {path} in 30 s\n{self._qemu_out()}") from None
                time.sleep(0.1)

    def _qemu_out(self) -> str:
        try:
            return "qemu: " + (self.workdir / "qemu.out").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _check_alive(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            raise VMError(
                f"qemu exited ({self._proc.returncode})\n{self._qemu_out()}\n--- console tail:\n{self.console_tail()}"
            )

    def wait_ready(self, timeout: float | None = None, not_boot_id: str | None = None) -> float:
        """Waits for the agent to answer (a boot other than ``not_boot_id``); seconds since qemu's start."""
        timeout = self.boot_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        next_ping = 0.0
        while True:
            now = time.monotonic()
            if now > deadline:
                raise VMTimeout(
                    f"the guest agent did not answer in {timeout:.0f} s ({self.accel})\n--- console tail:\n{self.console_tail()}"
                )
            if now >= next_ping:
                pid = self._send({"op": "ping"})
                next_ping = now + 20.0
            self._pump(min(deadline, now + 1.0))
            for ev in self._events:
                if ev.get("event") == "ready" and ev.get("boot_id") != not_boot_id:
                    self.boot_id = ev["boot_id"]
            self._events.clear()
            reply = self._replies.pop(pid, None)
            if reply is not None and reply.get("boot_id") != not_boot_id:
                self.boot_id = reply["boot_id"]
            if self.boot_id is not None and self.boot_id != not_boot_id:
                # replies to the pings sent while the agent was not up arrive in a burst: drop them
                self._replies.clear()
                return time.monotonic() - self._started

    def boot(self) -> Guest:
        self.start()
        self.boot_seconds = self.wait_ready()
        return self

    # ------------------------------------------------------------- the channel
    def _send(self, req: dict[str, Any]) -> int:
        assert self._sock is not None, "the guest is not started"
        self._check_alive()
        rid = self._next_id
        self._next_id += 1
        try:
            self._sock.sendall((json.dumps({**req, "id": rid}) + "\n").encode())
        except OSError as e:
            raise VMError(f"cannot reach the guest agent: {e}\n{self._qemu_out()}\n--- console tail:\n{self.console_tail()}") from e
        return rid

    def _pump(self, until: float) -> None:
        """Reads what the agent sent until a full line arrives or ``until`` passes."""
        assert self._sock is not None
        while True:
            self._check_alive()
            left = until - time.monotonic()
            if left <= 0:
                return
            self._sock.settimeout(min(left, 1.0))
            try:
                chunk = self._sock.recv(1 << 20)
            except TimeoutError:
                continue
            if not chunk:
                raise VMError(f"the agent socket closed\n{self._qemu_out()}\n--- console tail:\n{self.console_tail()}")
            self._buf += chunk
            got = False
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue  # a torn line from before the agent (re)started
                got = True
                if "event" in msg:
                    self._events.append(msg)
                elif isinstance(msg.get("id"), int):
                    self._replies[msg["id"]] = msg
            if got:
                return

    def run(
        self,
        argv: list[str] | str,
        timeout: float = 60.0,
        input: bytes | str | None = None,
        env: dict[str, str] | None = None,
        check: bool = False,
    ) -> Result:
        """Runs ``argv`` (a string: through ``sh -c``) in the guest as root; bounded by ``timeout``."""
        if isinstance(argv, str):
            argv = ["sh", "-c", argv]
        if isinstance(input, str):
            input = input.encode()
        req: dict[str, Any] = {"op": "exec", "argv": argv, "timeout": timeout, "env": env}
        if input is not None:
            req["input"] = base64.b64encode(input).decode()
        rid = self._send(req)
        # the guest kills the command at `timeout`; the host allows it that much more for the answer
        deadline = time.monotonic() + timeout + 30.0
        while rid not in self._replies:
            if time.monotonic() > deadline:
                raise VMTimeout(
                    f"no answer from the guest to {shlex.join(argv)} in {timeout + 30:.0f} s\n--- console tail:\n{self.console_tail()}"
                )
            self._pump(deadline)
        reply = self._replies.pop(rid)
        if reply.get("error"):
            raise VMError(f"the agent could not run {shlex.join(argv)}: {reply['error']}")
        result = Result(
            argv=argv,
            rc=reply.get("rc"),
            stdout=base64.b64decode(reply.get("stdout", "")).decode(errors="replace"),
            stderr=base64.b64decode(reply.get("stderr", "")).decode(errors="replace"),
            timed_out=bool(reply.get("timed_out")),
            seconds=float(reply.get("seconds") or 0.0),
        )
        return result.check() if check else result

    def sh(self, script: str, timeout: float = 60.0, check: bool = True) -> str:
        """``sh -c script`` in the guest; its stdout (raises VMError on a non-zero exit unless check=False)."""
        return self.run(script, timeout=timeout, check=check).stdout

    def put_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self.run(["sh", "-c", 'umask 077; cat > "$1" && chmod "$2" "$1"', "put_file", path, f"{mode:o}"], input=data, check=True)

    # ------------------------------------------------------------- lifecycle
    def reboot(self, timeout: float | None = None) -> float:
        """Reboots the guest (same qemu, same disk overlay); seconds until the agent answers again."""
        old = self.boot_id
        t0 = time.monotonic()
        self._send({"op": "exec", "argv": ["systemctl", "reboot", "--no-block"], "timeout": 30})
        self.wait_ready(timeout, not_boot_id=old)
        return time.monotonic() - t0

    def qmp(self, command: str, timeout: float = 10.0) -> None:
        """One QMP command, best effort (the socket is gone once qemu exits)."""
        path = str(self.workdir / "qmp.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            f = s.makefile("rwb")
            f.readline()  # greeting
            for cmd in ("qmp_capabilities", command):
                f.write((json.dumps({"execute": cmd}) + "\n").encode())
                f.flush()
                while True:
                    line = f.readline()
                    if not line or b'"return"' in line or b'"error"' in line:
                        break

    def poweroff(self, timeout: float = 120.0) -> int | None:
        """The guest's own poweroff, bounded; then QMP quit; then SIGKILL. qemu's exit status."""
        proc = self._proc
        if proc is None:
            return None
        try:
            if proc.poll() is None and self._sock is not None:
                try:
                    self._send({"op": "exec", "argv": ["systemctl", "poweroff", "--no-block"], "timeout": 30})
                except VMError:
                    pass  # qemu gone or the channel broken: the QMP quit and the kill below
                try:
                    return proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                try:
                    self.qmp("quit")
                except OSError:
                    pass
                try:
                    return proc.wait(15)
                except subprocess.TimeoutExpired:
                    pass
            return self.kill()
        finally:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._out is not None:
                self._out.close()
                self._out = None

    def kill(self) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait(15)
        if self._out is not None:
            self._out.close()
            self._out = None
        return rc

    def __enter__(self) -> Guest:
        return self.boot()

    def __exit__(self, *exc: object) -> None:
        self.poweroff()
