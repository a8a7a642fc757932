"""observe(): everything one pass reads, and nothing it writes.

Holds come back from `<cdi_dir>/bcd-*.json` (a hold IS its CDI spec; real
atom ids from each device's `bcd.dev/device-id`). A file there that is not
one of our holds - foreign, unparsable, another kind - is logged and left
alone, never deleted. Env files and slices are listed, and the leftovers of
interrupted atomic writes found, so the planner can repair drift.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from shared import logs
from shared.fsutil import is_temp_name
from shared.holdfiles import HoldOnDisk, NotAHold, parse_hold
from shared.schemas import Inventory, NodeSpec
from shared.slices import SliceError, Slices
from shared.vendorcdi import VendorCdi, VendorSpecError, read_vendor_cdi

from .domains import Domains, DomainsError
from .model import ConvergerState, Observed
from .reaper import Reaper
from .releases import PendingRelease, ReleasesStore
from .vfio import switched_targets

log = logs.get_logger("bcd.converger.observe")


@dataclass
class DiskView:
    holds: dict[str, HoldOnDisk] = field(default_factory=dict)
    env_files: dict[str, bytes] = field(default_factory=dict)
    temp_files: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


def read_disk(cdi_dir: Path, run_dir: Path, *, warned: set[str] | None = None) -> DiskView:
    view = DiskView()
    cdi_dir, env_dir = Path(cdi_dir), Path(run_dir) / "allocations"
    if cdi_dir.is_dir():
        for path in sorted(cdi_dir.iterdir()):
            name = path.name
            if is_temp_name(name) and name.startswith(".bcd-"):
                view.temp_files.append(str(path))
                continue
            if not (name.startswith("bcd-") and name.endswith(".json")):
                continue
            try:
                hold = parse_hold(name, path.read_bytes())
            except (NotAHold, OSError) as exc:
                view.foreign.append(name)
                if warned is None or name not in warned:
                    log.warning("not a bcd hold; leaving it alone", file=str(path), reason=str(exc))
                    if warned is not None:
                        warned.add(name)
                continue
            view.holds[hold.allocation_id] = hold
    if env_dir.is_dir():
        for path in sorted(env_dir.iterdir()):
            if is_temp_name(path.name):
                view.temp_files.append(str(path))
            elif path.name.endswith(".env"):
                try:
                    view.env_files[path.name[: -len(".env")]] = path.read_bytes()
                except OSError as exc:
                    log.warning("env file unreadable", file=str(path), error=str(exc))
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
) -> Observed:
    """`switched`: where the Applier's switches left each card (PCI address -> (target, reply time))."""
    disk = read_disk(cdi_dir, run_dir, warned=warned)
    releases = releases or ReleaseFacts()
    vendor: VendorCdi | None
    try:
        vendor = read_vendor_cdi(cdi_dir)
    except VendorSpecError as exc:
        log.warning("vendor CDI spec unreadable; holds carry only env", error=str(exc))
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
