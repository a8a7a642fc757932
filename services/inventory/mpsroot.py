"""The directories of bcd's MPS daemons as root lays them out: what a claim's containers mount.

`bcd-mps@<control>.service` runs these steps as root (services.inventory.sharing_unit); the
inventory owns nothing here. Under the MPS root (`/run/bcd/mps`, root's, 0755: no service may
write it) each daemon has

    <root>/<control>/        0755 root
                    pipe/    0755 root   CUDA_MPS_PIPE_DIRECTORY, mounted into the claim's containers
                    log/     0755 root   CUDA_MPS_LOG_DIRECTORY, mounted too (the claim's to read)
                    shm/     a tmpfs of its own (mode 1777, nosuid, nodev, noexec, size= the unit's):
                             the unit binds it over the daemon's /dev/shm, the claim's CDI spec
                             mounts it at the containers' /dev/shm (NVIDIA's DRA driver does the same)

Every path is walked from `/` one component at a time with O_NOFOLLOW | O_DIRECTORY, and each
component must be a directory owned by root (or by the euid, which is root in the units) that
neither its group nor others may write. A sticky directory of root's (/tmp) passes: there only
an entry's owner may rename or remove it, and that entry must pass the same check. A symlink
anywhere is refused, never followed. Directories are made with mkdirat on the fd of their
checked parent and opened again without following; the tmpfs is mounted, in the host's mount
namespace, on `/proc/self/fd/<n>` of a directory so opened, never on a path looked up again.

The daemon's spec comes from the inventory, in a directory of its own beside the MPS root
(`<root>-specs/<control>.json`, adapters.base.mps_spec_file): read as a bounded regular file, every
component of the way opened without following, decoded strictly.

`adopt` is for a node upgraded while claims ran: their directories were the inventory's (made by
it, in a root that was writable by its group); they are given to root as they are, so a running
daemon keeps its pipes, and a symlink in their place is removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from shared.schemas import MpsDaemonSpec
from shared.schemas.bus import MPS_CONTROL_PATTERN

from .adapters.base import SharingStepError, mps_spec_file

DIR_MODE = 0o755
#: the mode of the tmpfs's root, as the host's /dev/shm (sticky: a tenant removes only its own)
SHM_MODE = 0o1777
#: a daemon's directories, in the order they are made
DAEMON_DIRS = ("pipe", "log", "shm")
#: tmpfs size= as the unit may set it: a number with k, m, g or %, or bare bytes
SHM_SIZE_RE = re.compile(r"^[1-9][0-9]{0,15}[kmgKMG%]?\Z")
#: the shm size when the unit names none: NVIDIA's DRA driver gives each daemon half of the memory
DEFAULT_SHM_SIZE = "50%"
SPEC_MAX = 16 * 1024

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CONTROL = re.compile(MPS_CONTROL_PATTERN)
_SPEC = msgspec.json.Decoder(MpsDaemonSpec)

MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MNT_DETACH = 0x2
CLONE_NEWNS = 0x00020000


def _refused(message: str) -> SharingStepError:
    return SharingStepError("refused", message)


# --------------------------------------------------------------------------- the walk


def _check(fd: int, path: Path, owner: int) -> os.stat_result:
    st = os.fstat(fd)
    if st.st_uid not in (0, owner):
        raise _refused(f"{path} belongs to uid {st.st_uid}, not root: nothing a service owns is mounted into a container")
    if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        raise _refused(f"{path} may be written by its group or others (mode {stat.S_IMODE(st.st_mode):o})")
    return st


def _step(fd: int, name: str, where: Path) -> int:
    """The directory `name` in `fd`, opened without following."""
    if name in ("", ".", "..") or "/" in name:
        raise _refused(f"{where / name} is not a plain path")
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except FileNotFoundError:
        raise SharingStepError("failed", f"{where / name} does not exist") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(f"{where / name} is a symlink or not a directory: never followed") from None
        raise SharingStepError("failed", f"{where / name} cannot be opened: {exc.strerror or exc}") from None


def open_checked(path: Path, owner: int, *, last_any_owner: bool = False) -> int:
    """An fd of the directory `path`, every component checked (module docstring). With
    `last_any_owner`, the last component is only opened without following (the inventory's
    spec directory), the ones above it are checked."""
    if not path.is_absolute():
        raise _refused(f"{path} is not an absolute path")
    parts = path.parts[1:]
    fd = os.open("/", _DIR)
    try:
        _check(fd, Path("/"), owner)
        walked = Path("/")
        for i, part in enumerate(parts):
            nxt = _step(fd, part, walked)
            os.close(fd)
            fd = nxt
            walked = walked / part
            if not (last_any_owner and i == len(parts) - 1):
                _check(fd, walked, owner)
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def opened(path: Path, owner: int, **kw: bool) -> Iterator[int]:
    fd = open_checked(path, owner, **kw)
    try:
        yield fd
    finally:
        os.close(fd)


def same_directory(a: str | Path, fd: int) -> bool:
    """`a` (looked up as it is) is the directory open at `fd`."""
    st, fst = os.stat(a), os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


# --------------------------------------------------------------------------- mounts


class Mounts:
    """mount(2) and umount2(2) of a tmpfs on a directory open at an fd, in the host's mount
    namespace (libc, through ctypes)."""

    def __init__(self, host_ns: str = "/proc/1/ns/mnt") -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.host_ns = host_ns

    def enter_host_namespace(self) -> None:
        """Join PID 1's mount namespace. systemd gives even a "+" command a mount namespace of
        the unit's (seen with systemd 252 in the VM suite), where a tmpfs would be the step's
        alone: the host's is where the unit's BindPaths= and the claim's runtime bind it from.
        Nothing to do where this process is in it already."""
        if os.readlink("/proc/self/ns/mnt") == os.readlink(self.host_ns):
            return
        fd = os.open(self.host_ns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if self._libc.setns(fd, CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), f"entering the host's mount namespace: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)

    def mount_tmpfs(self, fd: int, options: str) -> None:
        target = f"/proc/self/fd/{fd}".encode()
        if self._libc.mount(b"bcd-mps-shm", target, b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options.encode()) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

    def unmount(self, fd: int) -> None:
        # the fd is the tmpfs's root: its magic link names the mount itself
        if self._libc.umount2(f"/proc/self/fd/{fd}".encode(), MNT_DETACH) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _is_mount_point(parent_fd: int, fd: int) -> bool:
    return os.fstat(parent_fd).st_dev != os.fstat(fd).st_dev


# --------------------------------------------------------------------------- the steps


def _remove(root_fd: int, name: str, root: Path, mounts: Mounts) -> bool:
    """Remove `<root>/<name>` whatever it is, never following: a symlink or file is unlinked, a
    directory goes with all in it once its shm is unmounted. False when nothing was there."""
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=root_fd)
        return True
    cfd = os.open(name, _DIR, dir_fd=root_fd)
    try:
        with contextlib.suppress(OSError):
            sfd = os.open("shm", _DIR, dir_fd=cfd)
            try:
                if _is_mount_point(cfd, sfd):
                    mounts.unmount(sfd)
            finally:
                os.close(sfd)
    finally:
        os.close(cfd)
    try:
        shutil.rmtree(name, dir_fd=root_fd)
    except OSError as exc:
        raise SharingStepError("failed", f"{root / name} could not be removed: {exc.strerror or exc}") from None
    return True


def prepare(root: Path, control: str, shm_size: str, *, owner: int, mounts: Mounts) -> None:
    """The daemon's directories made new, root's, and its shm a tmpfs of its own (ExecStartPre=+).
    Whatever a crash or an older bcd left at `<root>/<control>` goes first."""
    if not _CONTROL.match(control):
        raise _refused(f"{control!r} is not an MPS control id (<claim uid>-<6 hex digits>)")
    if not SHM_SIZE_RE.match(shm_size):
        raise _refused(f"{shm_size!r} is not a tmpfs size (a number with k, m, g or %)")
    mounts.enter_host_namespace()
    with opened(root, owner) as rfd:
        _remove(rfd, control, root, mounts)
        try:
            os.mkdir(control, DIR_MODE, dir_fd=rfd)
            cfd = _made(rfd, control, DIR_MODE, root / control, owner)
            try:
                for name in DAEMON_DIRS:
                    os.mkdir(name, DIR_MODE, dir_fd=cfd)
                    fd = _made(cfd, name, DIR_MODE, root / control / name, owner)
                    try:
                        if name == "shm":
                            mounts.mount_tmpfs(fd, f"size={shm_size},mode={SHM_MODE:o}")
                    finally:
                        os.close(fd)
            finally:
                os.close(cfd)
        except OSError as exc:
            raise SharingStepError("failed", f"the directories of MPS daemon {control} could not be made: {exc.strerror or exc}") from None


def _made(parent: int, name: str, mode: int, path: Path, owner: int) -> int:
    fd = os.open(name, _DIR, dir_fd=parent)
    try:
        os.fchmod(fd, mode)  # umask does not decide it
        _check(fd, path, owner)
        return fd
    except BaseException:
        os.close(fd)
        raise


def cleanup(root: Path, control: str, *, owner: int, mounts: Mounts) -> bool:
    """`<root>/<control>` unmounted and removed (ExecStopPost=+); False when nothing was there."""
    if not _CONTROL.match(control):
        raise _refused(f"{control!r} is not an MPS control id (<claim uid>-<6 hex digits>)")
    mounts.enter_host_namespace()
    with opened(root, owner) as rfd:
        return _remove(rfd, control, root, mounts)


def daemon_dirs(root: Path, control: str, owner: int) -> tuple[Path, Path, int]:
    """(pipe, log, fd of shm) of a prepared daemon, each checked (the daemon, as root, writes
    there by path: only root can have put anything on the way)."""
    if not _CONTROL.match(control):
        raise _refused(f"{control!r} is not an MPS control id (<claim uid>-<6 hex digits>)")
    pipe, log, shm = (root / control / name for name in DAEMON_DIRS)
    for d in (pipe, log):
        os.close(open_checked(d, owner))
    return pipe, log, open_checked(shm, owner)


def read_spec(root: Path, control: str, owner: int) -> MpsDaemonSpec:
    """The spec the inventory handed for `control` (module docstring); refused unless it is a
    regular file of at most SPEC_MAX bytes that decodes and names `control`."""
    try:
        path = mps_spec_file(root, control)
    except ValueError as exc:
        raise _refused(str(exc)) from None
    with opened(path.parent, owner, last_any_owner=True) as dfd:
        try:
            # what it is before it is opened: a device's open may do something, a FIFO's wait
            if not stat.S_ISREG(os.stat(path.name, dir_fd=dfd, follow_symlinks=False).st_mode):
                raise _refused(f"{path} is not a regular file")
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            raise _refused(f"no {path}: the inventory writes it before it asks for the unit") from None
        except OSError as exc:
            raise _refused(f"{path} cannot be read without following: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > SPEC_MAX:
                raise _refused(f"{path} is not a regular file of at most {SPEC_MAX} bytes")
            data = os.read(fd, SPEC_MAX + 1)
        finally:
            os.close(fd)
    if len(data) > SPEC_MAX:
        raise _refused(f"{path} is longer than {SPEC_MAX} bytes")
    try:
        spec = _SPEC.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _refused(f"{path} is not a daemon spec: {exc}") from None
    if spec.control != control:
        raise _refused(f"{path} is for MPS daemon {spec.control}, not {control}")
    return spec


def adopt(root: Path, *, owner: int, log: Callable[[str], None]) -> int:
    """Give every daemon's directories under `root` to root, as they are (an upgrade from the
    layout where the inventory made them); the number of daemons whose directories changed.
    The root itself becomes root's, 0755. A symlink or file where a directory belongs is
    removed (a container would have been given what it points at); what cannot be taken over
    is said through `log` and left for the daemon's stop."""
    with opened(root.parent, owner) as pfd:
        try:
            rfd = os.open(root.name, _DIR, dir_fd=pfd)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise _refused(f"{root} is a symlink or not a directory: never followed ({exc.strerror})") from None
    try:
        changed = _take(rfd, root, DIR_MODE)
        _check(rfd, root, owner)
        count = 0
        for name in sorted(os.listdir(rfd)):
            if not _CONTROL.match(name):
                continue
            try:
                count += _adopt_daemon(rfd, name, root, owner)
            except (OSError, SharingStepError) as exc:
                log(f"MPS daemon {name}: its directories were not taken over: {exc}")
        if changed:
            log(f"{root} is root's again, mode {DIR_MODE:o}")
        return count
    finally:
        os.close(rfd)


def _take(fd: int, path: Path, mode: int) -> bool:
    """Make the directory open at `fd` root's with `mode`; True when it was not."""
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, mode):
        return False
    os.fchown(fd, 0, 0)
    os.fchmod(fd, mode)
    return True


def _adopt_daemon(rfd: int, control: str, root: Path, owner: int) -> int:
    st = os.stat(control, dir_fd=rfd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(control, dir_fd=rfd)
        raise _refused(f"{root / control} was not a directory; removed")
    cfd = os.open(control, _DIR, dir_fd=rfd)
    try:
        changed = _take(cfd, root / control, DIR_MODE)
        for name in DAEMON_DIRS:
            try:
                est = os.stat(name, dir_fd=cfd, follow_symlinks=False)
            except FileNotFoundError:
                if name == "shm":
                    # the unit binds it over /dev/shm (a daemon of the old layout uses the host's)
                    os.mkdir(name, DIR_MODE, dir_fd=cfd)
                    changed = True
                continue
            if not stat.S_ISDIR(est.st_mode):
                os.unlink(name, dir_fd=cfd)
                changed = True
                continue
            fd = os.open(name, _DIR, dir_fd=cfd)
            try:
                if not _is_mount_point(cfd, fd):
                    changed |= _take(fd, root / control / name, DIR_MODE)
                _check(fd, root / control / name, owner)
            finally:
                os.close(fd)
        _check(cfd, root / control, owner)
        return int(changed)
    finally:
        os.close(cfd)


__all__ = [
    "DIR_MODE",
    "SHM_MODE",
    "DAEMON_DIRS",
    "DEFAULT_SHM_SIZE",
    "SPEC_MAX",
    "Mounts",
    "open_checked",
    "opened",
    "same_directory",
    "prepare",
    "cleanup",
    "daemon_dirs",
    "read_spec",
    "adopt",
]
