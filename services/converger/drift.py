"""Drift of bcd's own files: noticed within seconds, and said where the journal and the disk disagree.

A hold is its files (the CDI spec, its consumer copy, its env file), and a
pass makes them whole again (a reported hold whose spec went is put back as it
was bound, unreported). Before, a spec removed from outside waited for the next
generation or the 10-minute drift pass, and meanwhile `bcd status` showed the
card Unclaimed with the section CONVERGED. So:

- `dirs_signature` is what the hold directories hold now (each entry's name,
  inode, size and mtime), cheap enough to take every `--watch-interval` (2 s):
  the converger takes it after each pass and wakes a pass when it changes
  (polling, not inotify: the same on every file system and in every
  container, with nothing to lose when events overflow);
- `journal_disagreements` is pure: the journal (what was reported bound, and
  what bcd wrote: `ConvergerState.written`, digests of each hold's spec and env
  file) against the disk as read now, one line per hold whose files are missing
  or not what bcd wrote (an edit that still parses is drift by content), and
  whose slice is missing or reads back other than its recorded limits make
  (`SlicesNow`; a fake host's slice records are in the watched dirs too); the
  status carries them (`ConvergerStatus.drift`), `bcd status` shows them and
  `bcd doctor` warns `hold-drift`. A hold spec or env file of an allocation
  whose Released the node already reported, at that generation or older
  (`plan.stale_hold_files`), is said as a stale copy, removed by the next pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.fsutil import content_digest
from shared.holddisk import DiskView
from shared.holdfiles import BINDING_CLAIM, hold_file_name
from shared.slices import slice_differences, slice_name

from .model import ConvergerState
from .plan import stale_hold_files

@dataclass(frozen=True)
class SlicesNow:
    """What the listed slices read back now (`Slices.properties`; None: does not read); a slice
    absent here is not listed (missing)."""

    props: Mapping[str, Mapping[str, Any] | None]
    #: the backend reads huge page limits (False: they are not compared)
    hugepages: bool = True


#: one entry of a directory as the signature sees it: (name, inode, size, mtime in ns)
Entry = tuple[str, int, int, int]


def dirs_signature(dirs: Iterable[Path | None]) -> tuple[tuple[str, tuple[Entry, ...]], ...]:
    """What each directory holds now ((dir, entries) per dir; a missing dir has none). Symlinks,
    FIFOs and the rest are listed by their own lstat: nothing is followed or opened."""
    out = []
    for d in dirs:
        if d is None:
            continue
        entries: list[Entry] = []
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    entries.append((e.name, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            pass
        out.append((str(d), tuple(sorted(entries))))
    return tuple(out)


def journal_disagreements(
    state: ConvergerState,
    disk: DiskView,
    pending_releases: Mapping[str, object] = {},  # noqa: B006 - read-only
    slices: SlicesNow | None = None,
) -> list[str]:
    """Where the journal and the hold files disagree, one line each, sorted; [] when they agree.

    The journal is what was reported: a hold reported bound (and not being released) must
    have its CDI spec, its env file, (consumer copies kept) its consumer copy and (`slices`
    given: the backend listed its slices) its slice as its recorded limits make it."""
    lines: list[str] = []
    for alloc in sorted(state.reported):
        facts = state.bound.get(alloc)
        intent = state.intents.get(alloc)
        if facts is None or alloc in pending_releases or (intent is not None and intent.op == "release"):
            continue
        hold = disk.holds.get(alloc)
        if hold is None:
            lines.append(
                f"{alloc}: reported bound (generation {facts.generation}, {', '.join(facts.devices) or 'no devices'}) "
                f"but its CDI spec {hold_file_name(alloc)} is not on disk: put back by the next pass"
            )
            continue
        rec = state.written.get(alloc)
        spec_edited = rec is not None and bool(hold.digest) and hold.digest != rec.cdi
        if spec_edited:
            lines.append(f"{alloc}: its CDI spec {hold_file_name(alloc)} is not what bcd wrote (edited from outside): put back by the next pass")
        env = disk.env_files.get(alloc)
        if rec is not None and env is not None and content_digest(env) != rec.env:
            lines.append(f"{alloc}: its env file is not what bcd wrote (edited from outside): put back by the next pass")
        missing = []
        if alloc not in disk.env_files:
            missing.append("its env file")
        limits = rec.content.limits if rec is not None and rec.content.cgroup_parent else None
        if slices is not None and limits is not None and not hold.legacy_slice:
            if alloc not in slices.props:
                missing.append(f"its slice {slice_name(alloc)}")
            else:
                try:
                    differs = slice_differences(alloc, limits, slices.props[alloc], hugepages=slices.hugepages)
                except ValueError:
                    differs = ()
                if differs:
                    lines.append(f"{alloc}: its slice {slice_name(alloc)} is not what bcd made ({', '.join(differs)}): put back by the next pass")
        copies = disk.consumer_copies
        # (the copy of an edited spec is judged once the spec is put back: it is what bcd wrote)
        if copies is not None and not spec_edited and copies.get(alloc) != hold.consumer_digest:
            missing.append("its consumer copy" if alloc not in copies else "a consumer copy that is not what its spec makes")
        if missing:
            lines.append(f"{alloc}: bound, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in place: put back by the next pass")
    holds = {a: h for a, h in disk.holds.items() if h.binding != BINDING_CLAIM}
    stale = stale_hold_files(state, holds, disk.env_files, pending_releases)
    for alloc, gen in sorted(stale.items()):
        what = hold_file_name(alloc) if alloc in holds else "its env file"
        lines.append(f"{alloc}: {what} is a stale copy of a hold released at generation {gen}: removed by the next pass")
    for alloc, hold in sorted(holds.items()):
        if alloc in stale or alloc in state.reported or alloc in state.intents or alloc in pending_releases:
            continue
        lines.append(f"{alloc}: {hold_file_name(alloc)} is on disk but the journal has no bind of it: the next pass reports it, or releases it if the spec does not want it")
    return lines


__all__ = ["Entry", "SlicesNow", "dirs_signature", "journal_disagreements"]
