"""Atomic file writes: temp file in the same directory, fsync, rename, fsync the directory.

A reader (a CDI runtime, a workload manager, the converger after a crash)
sees the old content or the new, never half a file. Temp files start with a
dot and end in `.tmp-<pid>`, so CDI runtimes (which read *.json) ignore them
and the converger can find and remove the ones a crash left behind.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

TEMP_MARK = ".tmp-"


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
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if before_rename is not None:
        before_rename()
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_durably(path: Path) -> bool:
    """Remove a file and fsync its directory; False when it was not there."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


__all__ = ["TEMP_MARK", "temp_path", "is_temp_name", "fsync_dir", "atomic_write", "remove_durably"]
