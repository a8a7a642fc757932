"""GPU sharing on an NVIDIA host, with NVIDIA's tools: MPS control daemons and time slices.

MPS: one control daemon per claim config (`nvidia-cuda-mps-control -d`), serving the devices
of CUDA_VISIBLE_DEVICES, with its own CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY
(`<mps root>/<control>/pipe` and `.../log`, made by the inventory). It is told its limits one
control command per line on the stdin of `nvidia-cuda-mps-control` (same environment), and it
answers when `get_server_list` exits 0. The spec it was started with is kept beside its
directories (`<mps root>/<control>/spec.json`, written before it starts), so a start asked again
after a crash knows the same daemon from another one. Stopped with `quit`, then its
`<mps root>/<control>` goes.

Time slices: `nvidia-smi -i <uuid> -c DEFAULT` (a time-sliced card is in the default compute
mode), then `nvidia-smi compute-policy -i <uuid> --set-timeslice <0..3>`.

Where systemd runs the host, neither runs in the inventory: both are root's (nvidia-smi sets a
compute policy for root only; an MPS daemon must serve clients of every uid and outlive a
restart of the inventory), and the inventory is an ordinary user. It asks systemd for an
instance of a root template unit instead (deploy/systemd): `bcd-mps@<control>.service` (the
daemon, started and stopped by `services.inventory.sharing_unit`, which reads the spec the
inventory wrote and does what is written here as root) and `bcd-timeslice@<uuid>:<interval>
.service` (a one-shot). A polkit rule lets the inventory's user start and stop exactly those
names (deploy/systemd/polkit/50-bcd-sharing.rules). The units run the same code as the direct
path below (`NvidiaSharing(units=False)`), so what is tested there is what runs as root.

Every command goes through a `CommandRunner` (tests give a recording one); the default runs it
with a timeout, its output to temporary files read back bounded (a daemon forked by `-d` keeps
what it inherited open: a pipe would never end). The binaries are looked up on PATH; one that is
not there makes the step not-supported, a command that fails makes it failed with the first
line it wrote on stderr.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

import msgspec

from shared.fsutil import atomic_write, read_regular
from shared.schemas import MpsDaemonSpec

from .base import SharingStepError, make_mps_dirs, mps_control_dir, mps_dirs_under, remove_mps_dir

MPS_CONTROL = "nvidia-cuda-mps-control"
NVIDIA_SMI = "nvidia-smi"
SYSTEMCTL = "systemctl"
#: the root template units (deploy/systemd) a systemd host runs the steps in
MPS_UNIT = "bcd-mps@{control}.service"
TIMESLICE_UNIT = "bcd-timeslice@{uuid}:{interval}.service"
#: where systemd keeps its runtime state: it is PID 1 when this directory exists (sd_booted)
SYSTEMD_RUNTIME_DIR = Path("/run/systemd/system")
#: what is kept of a command's stdout and of its stderr
OUTPUT_MAX = 64 * 1024
#: the spec a daemon was started with, beside its pipe and log directories
SPEC_FILE = "spec.json"
SPEC_FILE_MAX = 16 * 1024
MIB = 1024 * 1024
#: nvidia-smi compute-policy --set-timeslice: 0 default, 1 short, 2 medium, 3 long
TIMESLICE_CODES = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}

_SPEC_DECODER = msgspec.json.Decoder(MpsDaemonSpec)


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
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        euid: Callable[[], int] = os.geteuid,
        units: bool | None = None,
    ) -> None:
        self.runner: CommandRunner = runner if runner is not None else SubprocessRunner()
        self.which = which
        self.systemd_booted = systemd_booted
        self.ready_wait = ready_wait
        self.quit_wait = quit_wait
        self.poll_interval = poll_interval
        self.command_timeout = command_timeout
        self.sleep = sleep
        self.clock = clock
        self.euid = euid
        #: run the root steps in systemd's template units (None: where systemd runs the host)
        self.units = units

    # ----------------------------------------------------------------- MPS

    def _in_units(self) -> bool:
        return self.systemd_booted() if self.units is None else self.units

    def mps_start(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        control_dir = mps_control_dir(spec.control, pipe_dir, log_dir)
        recorded = read_daemon_spec(control_dir)
        if recorded is not None and recorded != spec:
            raise SharingStepError("refused", f"MPS daemon {spec.control} was started with another spec (uuids {', '.join(recorded.uuids)})")
        if self._in_units():
            self._mps_start_unit(spec, control_dir, pipe_dir, log_dir, recorded)
            return
        mps = self._binary(MPS_CONTROL)
        env = self._mps_env(pipe_dir, log_dir, spec.uuids)
        if self._answers(mps, env):
            if recorded is None:
                raise SharingStepError("refused", f"an MPS daemon answers in {pipe_dir}, but bcd did not start it (no {SPEC_FILE})")
            self._set_limits(mps, env, spec)  # idempotent: a start that crashed before them is finished
            return
        self._prepare(control_dir, pipe_dir, log_dir, spec)
        self.run_daemon(spec, pipe_dir, log_dir)

    def run_daemon(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        """Start the daemon in directories that are there, wait for it, set its limits; on a
        failure quit it and remove its directories. What `bcd-mps@.service` runs as root."""
        control_dir = mps_control_dir(spec.control, pipe_dir, log_dir)
        mps = self._binary(MPS_CONTROL)
        env = self._mps_env(pipe_dir, log_dir, spec.uuids)
        try:
            self._command([mps, "-d"], env, "", f"starting MPS daemon {spec.control}")
            self._wait_ready(mps, env, spec.control)
            self._set_limits(mps, env, spec)
        except SharingStepError:
            self._quit_quietly(mps, env, control_dir)  # no daemon (nor its directories) left behind
            raise

    def mps_stop(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        control_dir = mps_control_dir(control, pipe_dir, log_dir)
        if not os.path.lexists(control_dir):
            raise SharingStepError("not-found", f"no MPS daemon {control}: {control_dir} does not exist")
        if self._in_units():
            self._unit("stop", MPS_UNIT.format(control=control), f"stopping MPS daemon {control}")
        else:
            self.quit_daemon(control, pipe_dir, log_dir)
        remove_mps_dir(control_dir)  # a dead daemon's directories go the same way

    def quit_daemon(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        """Quit the daemon of these directories if one answers, and wait until it is gone."""
        mps = self._binary(MPS_CONTROL)
        env = self._mps_env(pipe_dir, log_dir)
        if self._answers(mps, env):
            self._command([mps], env, "quit\n", f"quit of MPS daemon {control}")
            self._wait_gone(mps, env, control)

    def _mps_start_unit(self, spec: MpsDaemonSpec, control_dir: Path, pipe_dir: Path, log_dir: Path, recorded: MpsDaemonSpec | None) -> None:
        """The daemon as `bcd-mps@<control>.service`: its directories and spec made here, the
        daemon started, waited for and given its limits by the unit (as root)."""
        unit = MPS_UNIT.format(control=spec.control)
        if self._active(unit):
            if recorded is None:
                raise SharingStepError("refused", f"{unit} runs, but bcd did not start it (no {SPEC_FILE})")
            return  # its start set the limits before it became active
        self._prepare(control_dir, pipe_dir, log_dir, spec)
        try:
            self._unit("start", unit, f"starting MPS daemon {spec.control}")
        except SharingStepError:
            try:
                remove_mps_dir(control_dir)  # the unit quit what it started; what is left here goes
            except SharingStepError:
                pass  # listed (mps-list), and a stop cleans it
            raise

    def _active(self, unit: str) -> bool:
        systemctl = self._binary(SYSTEMCTL)
        return self._run([systemctl, "is-active", "--quiet", unit], _base_env(), "", f"systemctl is-active {unit}")[0] == 0

    def _unit(self, verb: str, unit: str, what: str) -> None:
        """`systemctl <verb> <unit>`, which waits for the unit's job; a failure names the unit
        whose journal says why (systemctl itself says only that the job failed)."""
        systemctl = self._binary(SYSTEMCTL)
        with self._privilege_hint("systemd lets it manage these units only through the polkit rule bcd ships"):
            try:
                self._command([systemctl, "--no-ask-password", verb, unit], _base_env(), "", what)
            except SharingStepError as exc:
                raise SharingStepError(exc.outcome, f"{exc} (journalctl -u {unit})") from None

    def mps_list(self, root: Path) -> list[str]:
        # a directory whose daemon is gone counts as well (it is to be cleaned by a stop), so no
        # daemon needs asking here
        return mps_dirs_under(root)

    def _prepare(self, control_dir: Path, pipe_dir: Path, log_dir: Path, spec: MpsDaemonSpec) -> None:
        """The daemon's directories (0755), and its spec beside them, before it starts."""
        try:
            make_mps_dirs(pipe_dir, log_dir)
            atomic_write(control_dir / SPEC_FILE, msgspec.json.encode(spec), 0o644)
        except OSError as exc:
            raise SharingStepError("failed", f"the directories of MPS daemon {spec.control} could not be made: {exc.strerror or exc}") from None

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

    def _quit_quietly(self, mps: str, env: Mapping[str, str], control_dir: Path) -> None:
        """After a failed start: quit the daemon, and remove its directories once it is gone."""
        try:
            if self._answers(mps, env):
                self._command([mps], env, "quit\n", "quit")
                self._wait_gone(mps, env, control_dir.name)
            remove_mps_dir(control_dir)
        except SharingStepError:
            pass  # what is left is listed (mps-list), and a stop cleans it

    # ----------------------------------------------------------------- time slices

    def set_timeslice(self, pci_address: str, gpu_uuid: str, interval: str) -> None:
        code = TIMESLICE_CODES.get(interval)
        if code is None:
            raise SharingStepError("refused", f"{interval!r} is not a time slice (Default, Short, Medium or Long)")
        if self._in_units():
            unit = TIMESLICE_UNIT.format(uuid=gpu_uuid, interval=interval)
            self._unit("start", unit, f"setting the time slice {interval} on {pci_address or gpu_uuid}")
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


def read_daemon_spec(control_dir: Path) -> MpsDaemonSpec | None:
    """The spec a daemon was started with; None when none was written. An unreadable one is refused."""
    try:
        data = read_regular(control_dir / SPEC_FILE, max_bytes=SPEC_FILE_MAX)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SharingStepError("refused", f"{control_dir / SPEC_FILE} cannot be read: {exc.strerror or exc}") from None
    try:
        return _SPEC_DECODER.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise SharingStepError("refused", f"{control_dir / SPEC_FILE} is not a daemon spec: {exc}") from None


__all__ = [
    "MPS_CONTROL",
    "NVIDIA_SMI",
    "SYSTEMCTL",
    "MPS_UNIT",
    "TIMESLICE_UNIT",
    "SYSTEMD_RUNTIME_DIR",
    "TIMESLICE_CODES",
    "SPEC_FILE",
    "read_daemon_spec",
    "CommandRunner",
    "SubprocessRunner",
    "NvidiaSharing",
]
