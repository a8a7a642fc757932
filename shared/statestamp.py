"""Which bcd wrote a state directory, and the refusal of a bcd too old to read it.

Each service keeps its state under `<data-dir>/<service>/` (a directory of its own,
its systemd StateDirectory); there it keeps `bcd-state.json`: `format` is the state
format of the newest bcd that ran on it, `written_by` that bcd's version. Before a
service touches its state it reads the stamp: a bcd whose own `STATE_FORMAT` is
lower stops with one line naming both (exit 2), and `bcd up` does the same for every
service directory of its state dir before it starts anything. (An older bcd on a
newer state once ran without a word and left a released MIG device's consumer copy
resolvable: what it did not know how to read, it took as absent.) An equal or newer
bcd stamps the directory with its own format, so an upgrade is recorded at its first
start; one that cannot write there (a read-only state) says so and goes on.

Formats (bump when a bcd that does not know the new one would misread the state):
1. every bcd before the stamp (none of them reads it: a downgrade to one is not refused;
   docs/install.md, "Downgrades");
2. the stamp itself, the converger's record of the bytes of each hold file it wrote.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import msgspec

from .fsutil import atomic_write

STATE_FORMAT = 2
STAMP_NAME = "bcd-state.json"
#: a stamp is a few dozen bytes; anything bigger is not one
MAX_STAMP_BYTES = 4096


class Stamp(msgspec.Struct, frozen=True, kw_only=True):
    format: int
    written_by: str = ""
    #: when this format was first written here (RFC 3339)
    since: str = ""


class StateTooNew(Exception):
    """The state dir was written by a newer bcd (or its stamp cannot be read): the one line says which."""


def read_stamp(data_dir: Path) -> Stamp | None:
    """The stamp, None when there is none (a new dir, or one from before the stamp)."""
    path = data_dir / STAMP_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateTooNew(f"state dir {data_dir}: {STAMP_NAME} cannot be opened ({exc.strerror}); it says which bcd wrote the state") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateTooNew(f"state dir {data_dir}: {STAMP_NAME} is not a regular file; it says which bcd wrote the state")
        data = os.read(fd, MAX_STAMP_BYTES + 1)
    finally:
        os.close(fd)
    try:
        if len(data) > MAX_STAMP_BYTES:
            raise msgspec.ValidationError(f"over {MAX_STAMP_BYTES} bytes")
        stamp = msgspec.json.decode(data, type=Stamp)
    except msgspec.MsgspecError as exc:
        raise StateTooNew(f"state dir {data_dir}: {STAMP_NAME} does not read ({exc}); it says which bcd wrote the state") from None
    if stamp.format < 1:
        raise StateTooNew(f"state dir {data_dir}: {STAMP_NAME} says format {stamp.format}, which no bcd writes")
    return stamp


def too_new(stamp: Stamp | None, data_dir: Path, *, version: str, ours: int = STATE_FORMAT) -> str:
    """Why a bcd of format `ours` must not run on this state ("" when it may)."""
    if stamp is None or stamp.format <= ours:
        return ""
    by = stamp.written_by or "a newer bcd"
    return (
        f"state dir {data_dir} was written by {by} (state format {stamp.format}); this bcd {version} reads format {ours} "
        f"at most: run {by} or newer on it (docs/install.md, Downgrades)"
    )


def check_and_stamp(data_dir: Path, *, version: str, ours: int = STATE_FORMAT) -> None:
    """Refuse a newer state (StateTooNew); otherwise record that this format now writes it."""
    stamp = read_stamp(data_dir)
    why = too_new(stamp, data_dir, version=version, ours=ours)
    if why:
        raise StateTooNew(why)
    if stamp is not None and stamp.format == ours and stamp.written_by == f"bcd {version}":
        return
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    since = stamp.since if stamp is not None and stamp.format == ours else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    # readable by all: it says only which bcd ran here, and a peer's check must read it
    atomic_write(data_dir / STAMP_NAME, msgspec.json.encode(Stamp(format=ours, written_by=f"bcd {version}", since=since)) + b"\n", mode=0o644)


def check_tree(data_dir: Path, *, version: str, ours: int = STATE_FORMAT) -> str:
    """`bcd up`: why this bcd must not run on `data_dir` ("" when it may), reading every
    service directory's stamp there (nothing is written: each service stamps its own)."""
    try:
        dirs = sorted(p for p in data_dir.iterdir() if p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return ""
    for d in dirs:
        try:
            why = too_new(read_stamp(d), d, version=version, ours=ours)
        except StateTooNew as exc:
            why = str(exc)
        if why:
            return why
    return ""


__all__ = ["STATE_FORMAT", "STAMP_NAME", "Stamp", "StateTooNew", "read_stamp", "too_new", "check_and_stamp", "check_tree"]
