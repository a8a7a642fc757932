"""Atomic file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader (a CDI runtime, a workload manager, the converger after a crash)
sees the old content or the new, never half a file. Temp files start with a
dot and end in `.tmp-<pid>`, so CDI runtimes (which read *.json) ignore them
and the converger can find and remove the ones a crash left behind.

Reading back: `read_regular` opens a file only as a regular file (no
symlink followed, never blocking on a FIFO, no device opened, size-capped and
fstat-checked), so a file planted in a shared directory (`bcd-x.json` as a
FIFO, a symlink to /dev/zero or to a huge file) is refused with a
`RefusedFile` that names the path and what is there, never read.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

TEMP_MARK = ".tmp-"
#: one read() call's size while reading a file back.
_CHUNK = 1 << 16


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and TEMP_MARK in name


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644, *, before_rename: Callable[[], None] | None = None) -> None:
    """Write `data` to `path` atomically with `mode` (umask does not apply)."""
    path = Path(path)
    tmp = temp_path(path)
    # a leftover of ours (same pid) goes first; O_EXCL | O_NOFOLLOW never writes through
    # anything planted at the name, and O_NONBLOCK never waits on a FIFO
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _discard(tmp)
        raise
    if before_rename is not None:
        # a crash point: it kills the process (tests raise to model that), and
        # a kill leaves the temp file behind for the next pass to remove
        before_rename()
    try:
        os.replace(tmp, path)
    except BaseException:
        # a rename onto a directory must not leave the temp file behind
        _discard(tmp)
        raise
    fsync_dir(path.parent)


def _discard(tmp: Path) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def remove_durably(path: Path) -> bool:
    """Remove a file and fsync its directory; False when it was not there."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


# ---------------------------------------------------------------------------- reading back


class RefusedFile(OSError):
    """A file read_regular will not read; `str()` names the path and what is there."""

    def __init__(self, path: Path | str, what: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, what, str(path))

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


class NotRegularFile(RefusedFile):
    """The path is a FIFO, a symlink, a directory, a device or a socket: not opened (or not read)."""


class FileTooLarge(RefusedFile):
    """The file is larger than the reader's cap."""

    def __init__(self, path: Path | str, size: int, max_bytes: int) -> None:
        super().__init__(path, f"{size} bytes is larger than the {max_bytes}-byte limit", errno.EFBIG)
        self.size = size
        self.max_bytes = max_bytes


def file_kind(mode: int) -> str:
    """What a stat mode is, in words: "a FIFO", "a directory", ..."""
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return f"not a regular file (mode {mode:o})"


def _describe(path: Path | str, st: os.stat_result) -> str:
    what = file_kind(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        what = f"a symlink (to {target[:256]})"
    return what


def _not_regular(path: Path | str, st: os.stat_result) -> NotRegularFile:
    if stat.S_ISLNK(st.st_mode):
        return NotRegularFile(path, f"{_describe(path, st)}, not followed, not a regular file", errno.ELOOP)
    return NotRegularFile(path, f"{_describe(path, st)}, not a regular file")


def occupant(path: Path | str) -> str | None:
    """What is at `path` when it is not a regular file ("a directory", "a symlink (to ...)"); None for a file or nothing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return None if stat.S_ISREG(st.st_mode) else _describe(path, st)


def in_the_way(mode: int) -> bool:
    """Is an entry of this mode one an atomic write must not replace?

    A regular file is the old content; a symlink is replaced as a name (its
    target is never touched). A directory (the rename fails), a FIFO, a
    socket or a device is someone else's: left alone, the write fails.
    """
    return not (stat.S_ISREG(mode) or stat.S_ISLNK(mode))


def read_regular(path: Path | str, *, max_bytes: int) -> bytes:
    """The content of the regular file `path`, at most `max_bytes` long.

    Never follows a symlink at `path`, never blocks (a FIFO is refused before
    anything waits on it), never opens a device: lstat first, then open with
    O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, then fstat (the same
    file, still regular) and a bounded read (a file that grows past the cap
    is refused too). Raises FileNotFoundError when nothing is there,
    NotRegularFile / FileTooLarge (both RefusedFile, an OSError) for what it
    will not read, and any other OSError of the read.
    """
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st)
    if st.st_size > max_bytes:
        raise FileTooLarge(path, st.st_size, max_bytes)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            # replaced by a symlink between the lstat and the open
            raise NotRegularFile(path, "a symlink, not followed, not a regular file", errno.ELOOP) from None
        raise
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            raise _not_regular(path, fst)
        if fst.st_size > max_bytes:
            raise FileTooLarge(path, fst.st_size, max_bytes)
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise FileTooLarge(path, size, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


__all__ = [
    "TEMP_MARK",
    "temp_path",
    "is_temp_name",
    "fsync_dir",
    "atomic_write",
    "remove_durably",
    "RefusedFile",
    "NotRegularFile",
    "FileTooLarge",
    "file_kind",
    "occupant",
    "in_the_way",
    "read_regular",
]
