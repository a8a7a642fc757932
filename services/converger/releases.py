"""Kubernetes releases in flight: `<data_dir>/releasing.json` and its unreadable marker.

A Kubernetes hold cannot be released in the pass that sees it gone: pods may
still have its devices. Its release is recorded here first (0600, atomic,
with device ids, generation and time) before anything is removed, so a crash
in between never loses it; it stays here, its devices claimed, until the
reaper says no pod holds them and AllocationReleased is in the outbox.

An unreadable file is renamed `releasing.json.unreadable-<unix time>` (kept,
never deleted) and the marker `releasing.unreadable` is written: while the
marker exists every GPU of the node counts as claimed.

On a host with no kubelet (or one whose pod-resources socket never answers)
a release would stay pending for ever: an unreachable kubelet counts as
holding the devices. The way out is the operator's word: `bcd releases --free
ALLOC` leaves an empty file `releases-freed/<allocation>` here, the pass takes
that release as free (reported at once), and reporting it removes the file.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path

import msgspec

from shared import logs
from shared.fsutil import atomic_write, read_regular, remove_durably
from shared.schemas import ID_RE, AtomId, Id, Limits
from shared.schemas.codec import BoundedDecoder

log = logs.get_logger("bcd.converger.releases")

RELEASES_FILE = "releasing.json"
UNREADABLE_MARKER = "releasing.unreadable"
#: one empty file per pending release the operator says no pod holds (`bcd releases --free`)
FREED_DIR = "releases-freed"
#: the largest releases file read back (a FIFO, a symlink or more is unreadable).
RELEASES_MAX_BYTES = 64 * 1024 * 1024


class PendingRelease(msgspec.Struct, frozen=True, kw_only=True):
    allocation_id: Id
    reservation_id: Id
    devices: list[AtomId]
    #: the generation that released it (its Released carries it).
    generation: int
    #: when the release was recorded (the stuck timer starts here).
    since: datetime
    event_id: str
    #: what the hold booked of the host: its pods may still use it, so it stays
    #: promised (host admission) until the release is reported.
    limits: Limits | None = None


class ReleasesFile(msgspec.Struct, kw_only=True):
    version: int = 1
    releases: dict[str, PendingRelease] = {}


_DECODER = BoundedDecoder(ReleasesFile, max_bytes=64 * 1024 * 1024, what=RELEASES_FILE)


class ReleasesStore:
    def __init__(self, data_dir: Path) -> None:
        self.dir = Path(data_dir)
        self.path = self.dir / RELEASES_FILE
        self.marker = self.dir / UNREADABLE_MARKER

    def load(self) -> tuple[dict[str, PendingRelease], bool]:
        """(pending releases, unreadable). An unreadable file is set aside and the marker written."""
        unreadable = self.marker.exists()
        try:
            data = read_regular(self.path, max_bytes=RELEASES_MAX_BYTES)
        except FileNotFoundError:
            return {}, unreadable
        except OSError as exc:
            return self._set_aside(f"cannot read ({exc.strerror})")
        try:
            return dict(_DECODER.decode(data).releases), unreadable
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return self._set_aside(str(exc))

    def peek(self) -> tuple[dict[str, PendingRelease], bool]:
        """(pending releases, unreadable) without side effects (for queries between passes).

        An unreadable file reads as unreadable here; the next pass sets it aside.
        """
        unreadable = self.marker.exists()
        try:
            data = read_regular(self.path, max_bytes=RELEASES_MAX_BYTES)
        except FileNotFoundError:
            return {}, unreadable
        except OSError:
            return {}, True
        try:
            return dict(_DECODER.decode(data).releases), unreadable
        except (msgspec.ValidationError, msgspec.DecodeError):
            return {}, True

    def _set_aside(self, why: str) -> tuple[dict[str, PendingRelease], bool]:
        aside = self.dir / f"{RELEASES_FILE}.unreadable-{int(time.time())}"
        try:
            os.replace(self.path, aside)
        except OSError as exc:
            log.error("releases file unreadable and cannot be set aside", file=str(self.path), error=str(exc))
        atomic_write(self.marker, f"{self.path} was unreadable ({why}); kept as {aside}\n".encode(), 0o600)
        log.error(
            "releases file unreadable: every GPU counts as claimed until no pod holds a GPU of an unknown allocation",
            file=str(self.path),
            kept_as=str(aside),
            reason=why,
        )
        return {}, True

    def save(self, releases: dict[str, PendingRelease]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, msgspec.json.encode(ReleasesFile(releases=dict(sorted(releases.items())))), 0o600)

    def clear_marker(self) -> bool:
        return remove_durably(self.marker)

    @property
    def freed_dir(self) -> Path:
        return self.dir / FREED_DIR

    def freed(self) -> set[str]:
        """The pending releases the operator said no pod holds (names that are ids; regular files only)."""
        try:
            with os.scandir(self.freed_dir) as it:
                return {e.name for e in it if ID_RE.match(e.name) and e.is_file(follow_symlinks=False)}
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def mark_freed(self, allocation_id: str) -> Path:
        """The operator's word that no pod holds the devices of this pending release."""
        if not ID_RE.match(allocation_id):
            raise ValueError(f"{allocation_id!r} is not an allocation id")
        self.freed_dir.mkdir(mode=0o700, exist_ok=True)
        path = self.freed_dir / allocation_id
        atomic_write(path, b"", 0o600)
        return path

    def clear_freed(self, allocation_id: str) -> None:
        if ID_RE.match(allocation_id):
            remove_durably(self.freed_dir / allocation_id)


__all__ = ["RELEASES_FILE", "UNREADABLE_MARKER", "FREED_DIR", "PendingRelease", "ReleasesFile", "ReleasesStore"]
