"""observe(): everything one pass reads, and nothing it writes.

Holds come back from `<cdi_dir>/bcd-*.json` (a hold IS its CDI spec; real
atom ids from each device's `bcd.dev/device-id`). A file there that is not
one of our holds - foreign, unparsable, another kind - is logged and left
alone, never deleted. Env files and slices are listed, and the leftovers of
interrupted atomic writes found, so the planner can repair drift.

Every file is read with `read_regular`: an entry named like a hold file or an
env file that is not a regular file (a FIFO, a symlink - never followed -, a
directory, a device) or is larger than its cap is not read; it is reported
once in the log and in `DiskView.problems` (the converger's status), and
skipped. Nothing here can block a pass.

Reading again what did not change is skipped, never what did: a hold file
is parsed again only when its bytes differ from the last read of that name,
and not even read while it is the same settled file (`shared.holdfiles`
`Remembered`: same device, inode, size, mtime and ctime, its ctime a second
old at that read); the vendor spec goes through one `VendorCache` per CDI
directory (the same rules). A file changed from outside is always seen.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from shared import logs
from shared.fsutil import RefusedFile, is_temp_name, occupant, read_regular
from shared.holdfiles import HOLD_FILE_MAX_BYTES, HoldOnDisk, NotAHold, Remembered, VendorCache, parse_hold, remembered_value
from shared.schemas import Inventory, NodeSpec
from shared.slices import SliceError, Slices
from shared.vendorcdi import VendorCdi, VendorSpecError

from .domains import Domains, DomainsError
from .model import ConvergerState, Observed
from .reaper import Reaper
from .releases import PendingRelease, ReleasesStore
from .vfio import switched_targets

log = logs.get_logger("bcd.converger.observe")

#: an env file read back (bcd's lines plus the assignment's env).
ENV_FILE_MAX_BYTES = 1024 * 1024


@dataclass
class DiskView:
    holds: dict[str, HoldOnDisk] = field(default_factory=dict)
    env_files: dict[str, bytes] = field(default_factory=dict)
    temp_files: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    #: entries not read: not regular files (FIFO, symlink, directory, device) or too large.
    problems: list[str] = field(default_factory=list)


def _names(directory: Path) -> list[str]:
    """The entries of `directory`, sorted; [] when it is missing or not a directory."""
    try:
        with os.scandir(directory) as it:
            return sorted(e.name for e in it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _once(warned: set[str] | None, key: str, message: str, **fields: object) -> None:
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
        _once(warned, f"refused:{path}", f"not read as {what}: skipped", file=str(path), what=exc.strerror)
        return None


def _temp_file(path: Path, view: DiskView, warned: set[str] | None) -> None:
    """A leftover of an interrupted atomic write is removed by the pass; only a regular file is ours."""
    what = occupant(path)
    if what is None:
        if os.path.lexists(path):
            view.temp_files.append(str(path))
        return
    view.problems.append(f"{path}: {what}, named like a bcd temp file: left alone")
    _once(warned, f"refused:{path}", "named like a bcd temp file but not a regular file: left alone", file=str(path), what=what)


#: CDI directory -> hold file name -> its last read (parsed); what the last listing showed only.
_HOLDS_READ: dict[str, dict[str, Remembered[HoldOnDisk]]] = {}
#: CDI directory -> the cache its vendor spec is read through.
_VENDOR: dict[str, VendorCache] = {}


def vendor_cache(cdi_dir: Path) -> VendorCache:
    key = str(cdi_dir)
    cache = _VENDOR.get(key)
    if cache is None:
        cache = _VENDOR.setdefault(key, VendorCache(Path(cdi_dir)))
    return cache


def _hold(path: Path, name: str, prior: Remembered[HoldOnDisk] | None, seen: dict[str, Remembered[HoldOnDisk]], view: DiskView, warned: set[str] | None) -> HoldOnDisk | None:
    """The hold in `path` (None: gone or refused); read only when it may have changed, parsed only when it did."""
    try:
        st: os.stat_result | None = os.lstat(path)
    except OSError:
        st = None  # read_regular says what it is
    if prior is not None and prior.vouches(st):
        seen[name] = prior
        return prior.value
    data = _read(path, HOLD_FILE_MAX_BYTES, "a hold", view, warned)
    if data is None:
        return None
    hold = remembered_value(prior, data)
    if hold is None:
        hold = parse_hold(name, data)
    if st is not None and stat.S_ISREG(st.st_mode):
        seen[name] = Remembered.of(st, data, hold, now=time.time())
    return hold


def read_disk(cdi_dir: Path, run_dir: Path, *, warned: set[str] | None = None) -> DiskView:
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
            hold = _hold(path, name, known.get(name), seen, view, warned)
            if hold is None:
                view.foreign.append(name)
                continue
        except (NotAHold, OSError) as exc:
            view.foreign.append(name)
            _once(warned, name, "not a bcd hold; leaving it alone", file=str(path), reason=str(exc))
            continue
        view.holds[hold.allocation_id] = hold
    # replaced whole (threads read the disk at once: the last listing wins, entries stay consistent)
    _HOLDS_READ[str(cdi_dir)] = seen
    for name in _names(env_dir):
        path = env_dir / name
        if is_temp_name(name):
            _temp_file(path, view, warned)
        elif name.endswith(".env"):
            try:
                data = _read(path, ENV_FILE_MAX_BYTES, "an env file", view, warned)
            except OSError as exc:
                log.warning("env file unreadable", file=str(path), error=str(exc))
                continue
            if data is not None:
                view.env_files[name[: -len(".env")]] = data
    return view


def vfio_claims(spec: NodeSpec, domains: Domains, state: ConvergerState) -> dict[str, str]:
    """PCI address -> holder: instance specs, and domains running at the last pass.

    Updates `state.domain_gpus` to what runs now, for the next pass.
    """
    claims: dict[str, str] = {}
    for inst in spec.instances:
        for pci in inst.gpus:
            claims.setdefault(pci, f"instance {inst.instance_id}")
    for pci, name in state.domain_gpus.items():
        claims.setdefault(pci, f"running domain {name}")
    try:
        running = domains.running()
    except DomainsError as exc:
        log.warning("domains unreadable; keeping the last pass's claims", error=str(exc))
        return claims
    now = {pci: d.name for d in running for pci in d.gpus}
    for pci, name in now.items():
        claims.setdefault(pci, f"running domain {name}")
    state.domain_gpus = now
    return claims


def observe(
    *,
    spec: NodeSpec,
    cdi_dir: Path,
    run_dir: Path,
    slices: Slices,
    inventory: Inventory | None,
    domains: Domains,
    state: ConvergerState,
    warned: set[str] | None = None,
    releases: ReleaseFacts | None = None,
    now: datetime | None = None,
    switched: Mapping[str, tuple[str, datetime]] | None = None,
    spec_unknown_fields: tuple[str, ...] = (),
) -> Observed:
    """`switched`: where the Applier's switches left each card (PCI address -> (target, reply time));
    `spec_unknown_fields`: the fields of the spec as received that NodeSpec does not declare."""
    disk = read_disk(cdi_dir, run_dir, warned=warned)
    releases = releases or ReleaseFacts()
    vendor: VendorCdi | None
    try:
        vendor = vendor_cache(cdi_dir).get()
    except VendorSpecError as exc:
        # the CDI write refuses it too (retryable): no new hold is bound until it reads
        _once(warned, f"vendor:{exc}", "vendor CDI spec unreadable; new holds are not bound until it reads (retried)", error=str(exc))
        vendor = None
    try:
        present = frozenset(slices.list())
        empty = frozenset(a for a in present if slices.is_empty(a))
    except (SliceError, OSError) as exc:
        log.warning("slices unreadable", error=str(exc))
        present, empty = frozenset(), frozenset()
    return Observed(
        holds=disk.holds,
        env_files=disk.env_files,
        slices=present,
        empty_slices=empty,
        inventory=inventory,
        vendor=vendor,
        vfio_claims=vfio_claims(spec, domains, state),
        switched=switched_targets(switched or {}, inventory),
        temp_files=tuple(disk.temp_files),
        state=state,
        pending_releases=releases.pending,
        releases_unreadable=releases.unreadable,
        release_held=releases.held,
        no_orphans=releases.no_orphans,
        now=now or datetime.now(timezone.utc),
        spec_unknown_fields=tuple(spec_unknown_fields),
    )


@dataclass
class ReleaseFacts:
    """What the pass knows of Kubernetes releases: the file, and the reaper's answers."""

    pending: dict[str, PendingRelease] = field(default_factory=dict)
    unreadable: bool = False
    #: allocation -> held (False only when established free).
    held: dict[str, bool] = field(default_factory=dict)
    no_orphans: bool = False


async def release_facts(store: ReleasesStore, reaper: Reaper, cdi_dir: Path, run_dir: Path) -> ReleaseFacts:
    """Load releasing.json (setting an unreadable one aside) and ask the reaper about each release."""
    pending, unreadable = await asyncio.to_thread(store.load)
    held: dict[str, bool] = {}
    for alloc, rel in pending.items():
        held[alloc] = await reaper.held(alloc, list(rel.devices))
    no_orphans = False
    if unreadable:
        disk = await asyncio.to_thread(read_disk, cdi_dir, run_dir)
        known = sorted({d for h in disk.holds.values() for d in h.devices} | {d for r in pending.values() for d in r.devices})
        no_orphans = await reaper.no_orphans(known)
    return ReleaseFacts(pending=pending, unreadable=unreadable, held=held, no_orphans=no_orphans)


__all__ = ["DiskView", "read_disk", "vfio_claims", "observe", "ReleaseFacts", "release_facts"]
