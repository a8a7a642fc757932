"""Files written as root into a directory an unprivileged user may reach.

The helper writes `<cdi_dir>/bcd-<id>.json` and `<run_dir>/allocations/<id>.env`
as root, and the converger it serves may own `run_dir`. A plain `open(path)`
would follow a symlink that user planted (`allocations -> /etc`), so every
operation here starts from the directory's real path (resolved once, when the
helper starts) and walks it from `/` one component at a time with
`O_NOFOLLOW`: a symlink or non-directory anywhere on the way is an error, not
a detour. Inside the directory, the file is written as a temp file created
with `O_EXCL | O_NOFOLLOW` (a planted file or hard link of that name is
removed first, never written through), fsynced, renamed over the target
within the same directory fd, and the directory is fsynced: a reader sees the
old content or the new. Names are built by the caller from validated ids;
`write` and `remove` also refuse anything that is not one plain file name.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shared.fsutil import TEMP_MARK, NotRegularFile, file_kind, in_the_way

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A component of the directory is a symlink or not a directory."""


def _plain_name(name: str) -> str:
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"{name!r} is not a plain file name")
    return name


class SafeDir:
    """One directory, reached without following symlinks (see the module docstring)."""

    def __init__(self, path: Path | str, *, dir_mode: int = 0o755) -> None:
        #: resolved once: symlinks in the configured path are the operator's, trusted at start.
        self.path = Path(os.path.realpath(path))
        self.dir_mode = dir_mode

    def __str__(self) -> str:
        return str(self.path)

    def open(self, *, create: bool) -> int | None:
        """An fd of the directory, walked from `/` with O_NOFOLLOW; None when missing and not `create`."""
        fd = os.open("/", _DIR_FLAGS)
        try:
            for part in self.path.parts[1:]:
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        os.close(fd)
                        return None
                    try:
                        os.mkdir(part, self.dir_mode, dir_fd=fd)
                    except FileExistsError:
                        pass
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    # ELOOP (a symlink) or ENOTDIR (a file): never followed
                    raise UnsafePath(exc.errno, f"{self.path}: {part!r} is not a plain directory ({exc.strerror})") from None
                os.close(fd)
                fd = nxt
            return fd
        except BaseException:
            os.close(fd)
            raise

    def read(self, name: str, limit: int, *, mode: int | None = None) -> bytes | None:
        """The content of a regular file (at most `limit` bytes); None when missing, not a
        regular file, or (with `mode`) of other permissions."""
        fd = self.open(create=False)
        if fd is None:
            return None
        try:
            try:
                ffd = os.open(_plain_name(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except (FileNotFoundError, OSError):
                return None
            try:
                st = os.fstat(ffd)
                if not stat.S_ISREG(st.st_mode) or (mode is not None and stat.S_IMODE(st.st_mode) != mode):
                    return None
                chunks: list[bytes] = []
                left = limit
                while left > 0 and (chunk := os.read(ffd, min(left, 1 << 16))):
                    chunks.append(chunk)
                    left -= len(chunk)
                return b"".join(chunks)
            finally:
                os.close(ffd)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes, mode: int = 0o644) -> bool:
        """Write `name` atomically; False when it already held exactly `data` with `mode` (nothing written)."""
        name = _plain_name(name)
        if self.read(name, len(data) + 1, mode=mode) == data:
            return False
        fd = self.open(create=True)
        assert fd is not None
        try:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if in_the_way(st.st_mode):
                    # not ours to replace (a directory fails the rename, a FIFO or a
                    # device is someone else's): the write fails, retried by the converger
                    raise NotRegularFile(
                        self.path / name, f"{file_kind(st.st_mode)} is in the way (not removed; remove it to bind)"
                    )
            tmp = f".{name}{TEMP_MARK}{os.getpid()}"
            try:
                os.unlink(tmp, dir_fd=fd)
            except FileNotFoundError:
                pass
            tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
            try:
                os.fchmod(tfd, mode)
                view = memoryview(data)
                while view:
                    view = view[os.write(tfd, view):]
                os.fsync(tfd)
            except BaseException:
                os.close(tfd)
                tfd = -1
                try:
                    os.unlink(tmp, dir_fd=fd)
                except FileNotFoundError:
                    pass
                raise
            finally:
                if tfd >= 0:
                    os.close(tfd)
            try:
                os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                # never a temp file left behind by a rename that failed
                try:
                    os.unlink(tmp, dir_fd=fd)
                except FileNotFoundError:
                    pass
                raise
            os.fsync(fd)
            return True
        finally:
            os.close(fd)

    def remove(self, name: str) -> bool:
        """Remove `name` (a symlink itself, never its target); False when it was not there."""
        name = _plain_name(name)
        fd = self.open(create=False)
        if fd is None:
            return False
        try:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                return False
            os.fsync(fd)
            return True
        finally:
            os.close(fd)


__all__ = ["SafeDir", "UnsafePath"]
