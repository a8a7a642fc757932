"""Reading holds back from disk: every `bcd-*.json` hold in the CDI directory, the env files, and
the hold specs' consumer copies (`shared.holdfiles.consumer_spec`) in the consumer directory.

Shared by the converger (its observe step) and the device plugin (which
advertises the atoms of the Kubernetes holds it finds): both see the same
holds with the same refusals (a file that is not regular, too large, not a
hold), and neither trusts anything but what `parse_hold` accepts. A hold
file unchanged since the last listing (same identity, settled) is not read
again; so is a consumer copy (only its digest is kept: the planner compares
it with the one its hold spec makes, `HoldOnDisk.consumer_digest`).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from shared import logs
from shared.fsutil import RefusedFile, content_digest, is_temp_name, occupant, read_regular
from shared.schemas.common import ID_RE
from shared.holdfiles import HOLD_FILE_MAX_BYTES, HoldOnDisk, NotAHold, Remembered, parse_hold, remembered_value

log = logs.get_logger("bcd.holds")
T = TypeVar("T")

#: an env file read back (bcd's lines plus the assignment's env).
ENV_FILE_MAX_BYTES = 1024 * 1024


@dataclass
class DiskView:
    holds: dict[str, HoldOnDisk] = field(default_factory=dict)
    env_files: dict[str, bytes] = field(default_factory=dict)
    temp_files: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    #: allocation -> content digest of its consumer copy in the consumer dir; None: not read
    #: (no consumer dir). A copy whose hold is not in `holds` is a leftover.
    consumer_copies: dict[str, bytes] | None = None
    #: entries not read: not regular files (FIFO, symlink, directory, device) or too large.
    problems: list[str] = field(default_factory=list)
    #: regular files named like bcd's in the hold dirs that are none of bcd's (a `bcd-*.json` that is
    #: not a hold or not a copy's name, an env dir entry that is not `<id>.env`): reported, left alone.
    odd: list[str] = field(default_factory=list)


def _names(directory: Path) -> list[str]:
    """The entries of `directory`, sorted; [] when it is missing or not a directory."""
    try:
        with os.scandir(directory) as it:
            return sorted(e.name for e in it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def warn_once(warned: set[str] | None, key: str, message: str, **fields: object) -> None:
    if warned is None or key not in warned:
        log.warning(message, **fields)
        if warned is not None:
            warned.add(key)


def _read(path: Path, max_bytes: int, what: str, view: DiskView, warned: set[str] | None) -> bytes | None:
    """The file's bytes; None when it is gone, or refused (reported once, and in view.problems)."""
    try:
        return read_regular(path, max_bytes=max_bytes)
    except FileNotFoundError:
        return None
    except RefusedFile as exc:
        view.problems.append(f"{exc}: skipped, not read as {what}")
        warn_once(warned, f"refused:{path}", f"not read as {what}: skipped", file=str(path), what=exc.strerror)
        return None


def _temp_file(path: Path, view: DiskView, warned: set[str] | None) -> None:
    """A leftover of an interrupted atomic write is removed by the pass; only a regular file is ours."""
    what = occupant(path)
    if what is None:
        if os.path.lexists(path):
            view.temp_files.append(str(path))
        return
    view.problems.append(f"{path}: {what}, named like a bcd temp file: left alone")
    warn_once(warned, f"refused:{path}", "named like a bcd temp file but not a regular file: left alone", file=str(path), what=what)


#: CDI directory -> hold file name -> its last read (parsed); what the last listing showed only.
_HOLDS_READ: dict[str, dict[str, Remembered[HoldOnDisk]]] = {}
def _read_again(
    path: Path,
    prior: Remembered[T] | None,
    seen: dict[str, Remembered[T]],
    view: DiskView,
    warned: set[str] | None,
    what: str,
    decode: Callable[[bytes], T],
) -> T | None:
    """What `path` decodes to (None: gone or refused); read only when it may have changed,
    decoded only when its bytes did. Its last read goes into `seen` under the file's name."""
    try:
        st: os.stat_result | None = os.lstat(path)
    except OSError:
        st = None  # read_regular says what it is
    if prior is not None and prior.vouches(st):
        seen[path.name] = prior
        return prior.value
    data = _read(path, HOLD_FILE_MAX_BYTES, what, view, warned)
    if data is None:
        return None
    value = remembered_value(prior, data)
    if value is None:
        value = decode(data)
    if st is not None and stat.S_ISREG(st.st_mode):
        seen[path.name] = Remembered.of(st, data, value, now=time.time())
    return value


#: consumer dir -> copy file name -> its last read (the digest of its bytes).
_COPIES_READ: dict[str, dict[str, Remembered[bytes]]] = {}


def read_consumer_copies(consumer_dir: Path, view: DiskView, warned: set[str] | None = None) -> dict[str, bytes]:
    """Allocation -> digest of every `bcd-<id>.json` in the consumer dir (other files are someone else's);
    temp files of interrupted writes go to view.temp_files, refused entries to view.problems."""
    consumer_dir = Path(consumer_dir)
    known = _COPIES_READ.get(str(consumer_dir), {})
    seen: dict[str, Remembered[bytes]] = {}
    copies: dict[str, bytes] = {}
    for name in _names(consumer_dir):
        path = consumer_dir / name
        if is_temp_name(name) and name.startswith(".bcd-"):
            _temp_file(path, view, warned)
            continue
        if not (name.startswith("bcd-") and name.endswith(".json")):
            continue  # the vendor's own generated spec (nvidia.yaml), another program's
        alloc = name[len("bcd-") : -len(".json")]
        if not ID_RE.match(alloc):
            if occupant(path) is None and os.path.isfile(path):
                view.odd.append(f"{path}: named like a consumer copy, but {alloc!r} is not an allocation id")
            continue
        try:
            digest = _read_again(path, known.get(name), seen, view, warned, "a consumer copy", content_digest)
        except OSError as exc:
            warn_once(warned, f"copy:{path}", "consumer copy unreadable", file=str(path), error=str(exc))
            continue
        if digest is not None:
            copies[alloc] = digest
    _COPIES_READ[str(consumer_dir)] = seen
    return copies


def read_disk(cdi_dir: Path, run_dir: Path, *, warned: set[str] | None = None, consumer_dir: Path | None = None) -> DiskView:
    view = DiskView()
    cdi_dir, env_dir = Path(cdi_dir), Path(run_dir) / "allocations"
    known = _HOLDS_READ.get(str(cdi_dir), {})
    seen: dict[str, Remembered[HoldOnDisk]] = {}
    for name in _names(cdi_dir):
        path = cdi_dir / name
        if is_temp_name(name) and name.startswith(".bcd-"):
            _temp_file(path, view, warned)
            continue
        if not (name.startswith("bcd-") and name.endswith(".json")):
            continue
        try:
            hold = _read_again(path, known.get(name), seen, view, warned, "a hold", lambda data, name=name: parse_hold(name, data))
            if hold is None:
                view.foreign.append(name)
                continue
        except (NotAHold, OSError) as exc:
            view.foreign.append(name)
            view.odd.append(f"{path}: not a bcd hold ({exc.reason if isinstance(exc, NotAHold) else exc}): left alone")
            warn_once(warned, name, "not a bcd hold; leaving it alone", file=str(path), reason=str(exc))
            continue
        view.holds[hold.allocation_id] = hold
    # replaced whole (threads read the disk at once: the last listing wins, entries stay consistent)
    _HOLDS_READ[str(cdi_dir)] = seen
    for name in _names(env_dir):
        path = env_dir / name
        if is_temp_name(name):
            _temp_file(path, view, warned)
        elif not name.endswith(".env") or not ID_RE.match(name[: -len(".env")]):
            if occupant(path) is None and os.path.isfile(path):
                view.odd.append(f"{path}: not an env file of bcd's (<allocation id>.env): left alone")
        else:
            try:
                data = _read(path, ENV_FILE_MAX_BYTES, "an env file", view, warned)
            except OSError as exc:
                log.warning("env file unreadable", file=str(path), error=str(exc))
                continue
            if data is not None:
                view.env_files[name[: -len(".env")]] = data
    if consumer_dir is not None:
        view.consumer_copies = read_consumer_copies(consumer_dir, view, warned)
    return view


__all__ = ["DiskView", "read_disk", "read_consumer_copies", "warn_once", "ENV_FILE_MAX_BYTES"]
