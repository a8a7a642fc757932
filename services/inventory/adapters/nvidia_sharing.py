"""GPU sharing on an NVIDIA host, with NVIDIA's tools: MPS control daemons and time slices.

MPS: one control daemon per claim config (`nvidia-cuda-mps-control -d`), serving the devices
of CUDA_VISIBLE_DEVICES, with its own CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY
(`<mps root>/<control>/pipe` and `.../log`) and its own /dev/shm (`.../shm`, a tmpfs), all made
and owned by root (services/inventory/mpsroot.py). It is told its limits one control command per
line on the stdin of `nvidia-cuda-mps-control` (same environment), and it answers when
`get_server_list` exits 0.

Both steps are root's (nvidia-smi sets a compute policy for root only; an MPS daemon must serve
clients of every uid, outlive a restart of the inventory and see a /dev/shm of its own), and
the inventory is an ordinary user. So it runs them in root template units (deploy/systemd):
`bcd-mps@<control>.service` (the daemon, started and stopped by
`services.inventory.sharing_unit`) and `bcd-timeslice@<uuid>:<interval>.service` (a
one-shot), and asks for them through `bcd-sharing.socket` (services/inventory/sharing_gate.py),
one request line per connection: the gate starts or stops exactly those units with a job mode
of its own choosing. The daemon's spec goes to root as a file in the inventory's own directory
beside the MPS root (`<mps root>-specs/<control>.json`, mpsroot.spec_file), written before the
start and kept until the stop, so a start asked again after a crash knows the same daemon from
another one. The units run the direct steps below (`NvidiaSharing(units=False)`: `run_daemon`,
`quit_daemon`, `set_timeslice`), so what is tested there is what runs as root. Without systemd
an MPS daemon is not started at all (nothing would give it a /dev/shm of its own); a time slice
is set in this process (root's, then).

Time slices: `nvidia-smi -i <uuid> -c DEFAULT` (a time-sliced card is in the default compute
mode), then `nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>`.

Every command goes through a `CommandRunner` (tests give a recording one); the default runs it
with a timeout, its output to temporary files read back bounded (a daemon forked by `-d` keeps
what it inherited open: a pipe would never end). The binaries are looked up on PATH; one that is
not there makes the step not-supported, a command that fails makes it failed with the first
line it wrote on stderr.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

import msgspec

from shared.fsutil import atomic_write, read_regular
from shared.schemas import MpsDaemonSpec

from .base import SharingStepError, is_mps_control, mps_control_dir, mps_dirs_under, mps_spec_dir, mps_spec_file

MPS_CONTROL = "nvidia-cuda-mps-control"
NVIDIA_SMI = "nvidia-smi"
SYSTEMCTL = "systemctl"
#: the root template units (deploy/systemd) a systemd host runs the steps in
MPS_UNIT = "bcd-mps@{control}.service"
TIMESLICE_UNIT = "bcd-timeslice@{uuid}:{interval}.service"
#: where the inventory asks root for those units (deploy/systemd/bcd-sharing.socket)
SHARING_SOCKET = Path("/run/bcd/sharing.sock")
#: where systemd keeps its runtime state: it is PID 1 when this directory exists (sd_booted)
SYSTEMD_RUNTIME_DIR = Path("/run/systemd/system")
#: what is kept of a command's stdout and of its stderr
OUTPUT_MAX = 64 * 1024
#: the spec a daemon of an older bcd was started with, beside its pipe and log directories
LEGACY_SPEC_FILE = "spec.json"
SPEC_FILE_MAX = 16 * 1024
#: the longest answer the gate gives (one line)
ANSWER_MAX = 4096
MIB = 1024 * 1024
#: nvidia-smi compute-policy --set-timeslice: 0 default, 1 short, 2 medium, 3 long
TIMESLICE_CODES = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
#: what the gate may answer besides "done" (SharingStepError's outcomes)
GATE_OUTCOMES = frozenset({"failed", "refused", "not-supported", "not-found"})

_SPEC_DECODER = msgspec.json.Decoder(MpsDaemonSpec)
#: a device's uuid in `nvidia-smi -L` ("GPU 0: NVIDIA H200 (UUID: GPU-...)", "  MIG 3g.71gb Device 0: (UUID: MIG-...)")
_LISTED_UUID = re.compile(r"\(UUID: ((?:GPU|MIG)-[A-Za-z0-9/-]{1,128})\)")


class CommandRunner(Protocol):
    """Runs one command to its end: (returncode, stdout, stderr). TimeoutError when it ran past
    `timeout` seconds (it is killed), OSError when it could not start."""

    def run(self, argv: Sequence[str], env: Mapping[str, str], stdin: str, timeout: float) -> tuple[int, str, str]: ...


def _read_bounded(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read(OUTPUT_MAX).decode(errors="replace")


class SubprocessRunner:
    """CommandRunner on subprocess: its own session, output to temporary files, read back bounded."""

    def run(self, argv: Sequence[str], env: Mapping[str, str], stdin: str, timeout: float) -> tuple[int, str, str]:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(  # noqa: S603 - argv is built from binaries found on PATH
                list(argv), env=dict(env), stdin=subprocess.PIPE, stdout=out, stderr=err, start_new_session=True, close_fds=True
            )
            try:
                proc.communicate(stdin.encode(), timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_session(proc)
                raise TimeoutError(f"{argv[0]} did not finish within {timeout:g} s") from None
            return proc.returncode, _read_bounded(out), _read_bounded(err)


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """Kill a command that ran too long, with what it started in its session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    proc.wait()


def _systemd_booted() -> bool:
    return SYSTEMD_RUNTIME_DIR.is_dir()


def _first_line(*texts: str) -> str:
    """The first non-empty line of the first text that has one."""
    for text in texts:
        for line in text.splitlines():
            if line.strip():
                return line.strip()
    return ""


def ask_gate(line: str, path: Path, timeout: float) -> str:
    """One request line to the gate at `path` (bcd-sharing.socket), its one answer line. OSError
    when it cannot be reached or does not answer in time."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(f"{line}\n".encode())
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while b"\n" not in answer and len(answer) <= ANSWER_MAX:
            chunk = s.recv(ANSWER_MAX + 1 - len(answer))
            if not chunk:
                break
            answer += chunk
    return answer.split(b"\n", 1)[0][:ANSWER_MAX].decode(errors="replace")


class NvidiaSharing:
    """GpuSharer with nvidia-cuda-mps-control and nvidia-smi (NvidiaAdapter delegates to it)."""

    def __init__(
        self,
        *,
        runner: CommandRunner | None = None,
        which: Callable[[str], str | None] = shutil.which,
        systemd_booted: Callable[[], bool] = _systemd_booted,
        ready_wait: float = 10.0,
        quit_wait: float = 10.0,
        poll_interval: float = 0.1,
        command_timeout: float = 30.0,
        unit_timeout: float = 85.0,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        euid: Callable[[], int] = os.geteuid,
        units: bool | None = None,
        gate: Callable[[str], str] | None = None,
    ) -> None:
        self.runner: CommandRunner = runner if runner is not None else SubprocessRunner()
        self.which = which
        self.systemd_booted = systemd_booted
        self.ready_wait = ready_wait
        self.quit_wait = quit_wait
        self.poll_interval = poll_interval
        self.command_timeout = command_timeout
        #: how long a unit's start or stop may take, the gate's answer included (under the
        #: converger's wait for this step's answer, 90 s; over the gate's for systemctl, 80 s)
        self.unit_timeout = unit_timeout
        self.sleep = sleep
        self.clock = clock
        self.euid = euid
        #: run the root steps in systemd's template units (None: where systemd runs the host)
        self.units = units
        #: sends one request line to root's side, returns its answer line (default: bcd-sharing.socket)
        self.gate: Callable[[str], str] = gate if gate is not None else (lambda line: ask_gate(line, SHARING_SOCKET, self.unit_timeout))

    # ----------------------------------------------------------------- MPS

    def _in_units(self) -> bool:
        return self.systemd_booted() if self.units is None else self.units

    def mps_start(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        control_dir = mps_control_dir(spec.control, pipe_dir, log_dir)
        if not self._in_units():
            raise SharingStepError(
                "not-supported",
                f"MPS daemon {spec.control}: bcd runs an MPS daemon only as {MPS_UNIT.format(control=spec.control)} "
                "(systemd gives it a /dev/shm of its own), and systemd does not run this host",
            )
        spec_path = mps_spec_file(control_dir.parent, spec.control)
        recorded = recorded_spec(control_dir)
        if recorded is not None and recorded != spec:
            raise SharingStepError("refused", f"MPS daemon {spec.control} was started with another spec (uuids {', '.join(recorded.uuids)})")
        unit = MPS_UNIT.format(control=spec.control)
        if self._active(unit):
            if recorded is None:
                raise SharingStepError("refused", f"{unit} runs, but bcd did not start it (no {spec_path})")
            return  # its start set the limits before it became active
        try:
            spec_path.parent.mkdir(mode=0o755, exist_ok=True)
            atomic_write(spec_path, msgspec.json.encode(spec), 0o644)
        except OSError as exc:
            raise SharingStepError("failed", f"the spec of MPS daemon {spec.control} could not be written to {spec_path}: {exc.strerror or exc}") from None
        try:
            self._ask_root(f"mps-start {spec.control}", f"starting MPS daemon {spec.control}")
        except SharingStepError:
            # the unit removed what it made (ExecStopPost=); the spec is the inventory's to remove
            with contextlib.suppress(OSError):
                spec_path.unlink()
            raise

    def run_daemon(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        """Start the daemon in directories that are there, wait for it, set its limits; on a
        failure quit it (its unit's ExecStopPost= removes the directories). What
        `bcd-mps@.service` runs as root."""
        mps = self._binary(MPS_CONTROL)
        env = self._mps_env(pipe_dir, log_dir, spec.uuids)
        try:
            self._command([mps, "-d"], env, "", f"starting MPS daemon {spec.control}")
            self._wait_ready(mps, env, spec.control)
            self._set_limits(mps, env, spec)
        except SharingStepError:
            self._quit_quietly(mps, env, spec.control)  # no daemon left behind
            raise

    def mps_stop(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        control_dir = mps_control_dir(control, pipe_dir, log_dir)
        spec_path = mps_spec_file(control_dir.parent, control)
        if not os.path.lexists(control_dir) and not os.path.lexists(spec_path):
            raise SharingStepError("not-found", f"no MPS daemon {control}: neither {control_dir} nor {spec_path} exists")
        if not self._in_units():
            raise SharingStepError("not-supported", f"MPS daemon {control}: systemd does not run this host, and bcd runs MPS daemons only as units")
        unit = MPS_UNIT.format(control=control)
        self._ask_root(f"mps-stop {control}", f"stopping MPS daemon {control}")
        if os.path.lexists(control_dir):
            raise SharingStepError("failed", f"MPS daemon {control} stopped, but {control_dir} is left (its unit removes it: journalctl -u {unit})")
        with contextlib.suppress(FileNotFoundError):
            spec_path.unlink()

    def quit_daemon(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        """Quit the daemon of these directories if one answers, and wait until it is gone."""
        mps = self._binary(MPS_CONTROL)
        env = self._mps_env(pipe_dir, log_dir)
        if self._answers(mps, env):
            self._command([mps], env, "quit\n", f"quit of MPS daemon {control}")
            self._wait_gone(mps, env, control)

    def _active(self, unit: str) -> bool:
        systemctl = self._binary(SYSTEMCTL)
        return self._run([systemctl, "is-active", "--quiet", unit], _base_env(), "", f"systemctl is-active {unit}")[0] == 0

    def _ask_root(self, line: str, what: str) -> None:
        """One request to root's side (the gate, which starts or stops the unit and waits for
        its job); its refusal or failure is this step's, with its words."""
        try:
            answer = self.gate(line)
        except OSError as exc:
            why = exc.strerror or str(exc)
            if exc.errno in (errno.EACCES, errno.EPERM) and self.euid() != 0:
                why += f"; the inventory runs as uid {self.euid()}, and only group bcd-inventory may connect"
            raise SharingStepError(
                "failed", f"{what} failed: root's side of sharing ({SHARING_SOCKET}, bcd-sharing.socket) did not answer: {why} (docs/install.md, 'DRA sharing')"
            ) from None
        outcome, _, text = answer.partition(" ")
        if outcome == "done":
            return
        if outcome not in GATE_OUTCOMES:
            raise SharingStepError("failed", f"{what} failed: root's side of sharing answered {answer[:200]!r}")
        raise SharingStepError(outcome, f"{what} failed: {text}")  # type: ignore[arg-type]

    def mps_list(self, root: Path) -> list[str]:
        # a directory whose daemon is gone counts as well (it is to be cleaned by a stop), and a
        # spec handed over for a start that never ended: no daemon needs asking here
        found = set(mps_dirs_under(root))
        with contextlib.suppress(OSError):
            names = os.listdir(mps_spec_dir(root))
            found.update(n.removesuffix(".json") for n in names if n.endswith(".json") and is_mps_control(n.removesuffix(".json")))
        return sorted(found)

    def _set_limits(self, mps: str, env: Mapping[str, str], spec: MpsDaemonSpec) -> None:
        lines = _limit_commands(spec)
        if lines:
            self._command([mps], env, "".join(f"{line}\n" for line in lines), f"setting the limits of MPS daemon {spec.control}")

    def _answers(self, mps: str, env: Mapping[str, str]) -> bool:
        """The daemon of that pipe directory answers `get_server_list`."""
        return self._run([mps], env, "get_server_list\n", "get_server_list")[0] == 0

    def _wait_ready(self, mps: str, env: Mapping[str, str], control: str) -> None:
        if not self._wait_for(lambda: self._answers(mps, env), self.ready_wait):
            raise SharingStepError("failed", f"MPS daemon {control} did not answer get_server_list within {self.ready_wait:g} s")

    def _wait_gone(self, mps: str, env: Mapping[str, str], control: str) -> None:
        if not self._wait_for(lambda: not self._answers(mps, env), self.quit_wait):
            raise SharingStepError("failed", f"MPS daemon {control} still answers {self.quit_wait:g} s after quit")

    def _wait_for(self, predicate: Callable[[], bool], wait: float) -> bool:
        deadline = self.clock() + wait
        while not predicate():
            if self.clock() >= deadline:
                return False
            self.sleep(self.poll_interval)
        return True

    def _quit_quietly(self, mps: str, env: Mapping[str, str], control: str) -> None:
        """After a failed start: quit the daemon and wait until it is gone."""
        try:
            if self._answers(mps, env):
                self._command([mps], env, "quit\n", "quit")
                self._wait_gone(mps, env, control)
        except SharingStepError:
            pass  # the unit's stop kills what is left (KillMode=control-group)

    # ----------------------------------------------------------------- devices of this node

    def node_uuids(self) -> frozenset[str]:
        """Every GPU and MIG device uuid `nvidia-smi -L` lists on this node."""
        smi = self._binary(NVIDIA_SMI)
        out = self._command([smi, "-L"], _base_env(), "", "nvidia-smi -L")
        return frozenset(_LISTED_UUID.findall(out))

    # ----------------------------------------------------------------- time slices

    def set_timeslice(self, pci_address: str, gpu_uuid: str, interval: str) -> None:
        code = TIMESLICE_CODES.get(interval)
        if code is None:
            raise SharingStepError("refused", f"{interval!r} is not a time slice (Default, Short, Medium or Long)")
        if self._in_units():
            self._ask_root(f"timeslice {gpu_uuid}:{interval}", f"setting the time slice {interval} on {pci_address or gpu_uuid}")
            return
        smi = self._binary(NVIDIA_SMI)
        env = _base_env()
        with self._privilege_hint("nvidia-smi sets a compute mode and policy for root only"):
            self._command([smi, "-i", gpu_uuid, "-c", "DEFAULT"], env, "", f"nvidia-smi -c DEFAULT on {pci_address}")
            self._command(
                [smi, "compute-policy", "-i", gpu_uuid, "--set-timeslice", str(code)], env, "", f"nvidia-smi compute-policy --set-timeslice {code} on {pci_address}"
            )

    # ----------------------------------------------------------------- commands

    @contextlib.contextmanager
    def _privilege_hint(self, why: str) -> Iterator[None]:
        """A step that failed in an inventory that is not root says why it may have (the shipped
        unit runs it as bcd-inventory), and where the way out is written."""
        try:
            yield
        except SharingStepError as exc:
            if exc.outcome != "failed" or self.euid() == 0:
                raise
            raise SharingStepError(
                exc.outcome, f"{exc} (the inventory runs as uid {self.euid()}: {why}; docs/install.md, 'DRA sharing')"
            ) from None

    def _binary(self, name: str) -> str:
        path = self.which(name)
        if path is None:
            raise SharingStepError("not-supported", f"{name} is not on PATH: install the NVIDIA driver's utilities")
        return path

    @staticmethod
    def _mps_env(pipe_dir: Path, log_dir: Path, uuids: Sequence[str] = ()) -> dict[str, str]:
        env = _base_env()
        if uuids:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(uuids)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
        return env

    def _run(self, argv: Sequence[str], env: Mapping[str, str], stdin: str, what: str) -> tuple[int, str, str]:
        """One command; failed when it cannot start or runs too long."""
        try:
            return self.runner.run(argv, env, stdin, self.command_timeout)
        except TimeoutError:
            raise SharingStepError("failed", f"{what} failed: no answer within {self.command_timeout:g} s") from None
        except OSError as exc:
            raise SharingStepError("failed", f"{what} failed: {argv[0]} could not run ({exc.strerror or exc})") from None

    def _command(self, argv: Sequence[str], env: Mapping[str, str], stdin: str, what: str) -> str:
        """One command that must exit 0; its stdout."""
        code, out, err = self._run(argv, env, stdin, what)
        if code != 0:
            raise SharingStepError("failed", f"{what} failed: {_first_line(err, out) or f'exit status {code}'}")
        return out


def _base_env() -> dict[str, str]:
    """What every command gets of the inventory's environment: PATH only."""
    return {"PATH": os.environ.get("PATH", os.defpath)}


def _limit_commands(spec: MpsDaemonSpec) -> list[str]:
    """The control commands that set a daemon's limits, in the order of its devices."""
    lines = []
    if spec.active_thread_percentage is not None:
        lines.append(f"set_default_active_thread_percentage {spec.active_thread_percentage}")
    for uuid in spec.uuids:
        limit = spec.pinned_memory.get(uuid)
        if limit is not None:
            lines.append(f"set_default_device_pinned_mem_limit {uuid} {limit // MIB}M")
    return lines


def recorded_spec(control_dir: Path) -> MpsDaemonSpec | None:
    """The spec the daemon of `<mps root>/<control>` was started with: the one the inventory
    handed over (`<mps root>-specs/<control>.json`), or for a daemon an older bcd started, the
    `spec.json` it kept beside the daemon's directories. None when neither was written; an
    unreadable one is refused."""
    handed = mps_spec_file(control_dir.parent, control_dir.name)
    for path in (handed, control_dir / LEGACY_SPEC_FILE):
        try:
            data = read_regular(path, max_bytes=SPEC_FILE_MAX)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise SharingStepError("refused", f"{path} cannot be read: {exc.strerror or exc}") from None
        try:
            return _SPEC_DECODER.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise SharingStepError("refused", f"{path} is not a daemon spec: {exc}") from None
    return None


__all__ = [
    "MPS_CONTROL",
    "NVIDIA_SMI",
    "SYSTEMCTL",
    "MPS_UNIT",
    "TIMESLICE_UNIT",
    "SHARING_SOCKET",
    "SYSTEMD_RUNTIME_DIR",
    "TIMESLICE_CODES",
    "GATE_OUTCOMES",
    "LEGACY_SPEC_FILE",
    "recorded_spec",
    "ask_gate",
    "CommandRunner",
    "SubprocessRunner",
    "NvidiaSharing",
]
