"""observe(): everything one pass reads, and nothing it writes.

Holds come back from `<cdi_dir>/bcd-*.json` (a hold IS its CDI spec; real
atom ids from each device's `bcd.dev/device-id`). A file there that is not
one of our holds - foreign, unparsable, another kind - is logged and left
alone, never deleted. Env files and slices are listed, the properties of each
hold's slice read back (`Observed.slice_props`: the plan compares them with what
the hold's limits make), and the leftovers of interrupted atomic writes found,
so the planner can repair drift. One slice that does not read is that slice's
problem (kept, not taken as empty, its properties None), never the pass's.

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
The reading of the hold directories (`read_disk`, `DiskView`) lives in
`shared.holddisk`: the device plugin reads the same holds the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from shared import logs
from shared.holddisk import DiskView, read_disk, warn_once
from shared.holdfiles import BINDING_CLAIM, VendorCache
from shared.schemas import Inventory, NodeSpec
from shared.slices import SliceError, Slices, read_properties
from shared.vendorcdi import VendorCdi, VendorSpecError

from .domains import Domains, DomainsError
from .model import ConvergerState, Observed
from .reaper import Reaper
from .releases import PendingRelease, ReleasesStore
from .vfio import switched_targets

log = logs.get_logger("bcd.converger.observe")

#: CDI directory -> the cache its vendor spec is read through.
_VENDOR: dict[str, VendorCache] = {}


def vendor_cache(cdi_dir: Path) -> VendorCache:
    key = str(cdi_dir)
    cache = _VENDOR.get(key)
    if cache is None:
        cache = _VENDOR.setdefault(key, VendorCache(Path(cdi_dir)))
    return cache


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
    consumer_dir: Path | None = None,
) -> Observed:
    """`switched`: where the Applier's switches left each card (PCI address -> (target, reply time));
    `spec_unknown_fields`: the fields of the spec as received that NodeSpec does not declare;
    `consumer_dir`: where the hold specs' consumer copies are (None: none are kept)."""
    disk = read_disk(cdi_dir, run_dir, warned=warned, consumer_dir=consumer_dir)
    releases = releases or ReleaseFacts()
    vendor: VendorCdi | None
    try:
        vendor = vendor_cache(cdi_dir).get()
    except VendorSpecError as exc:
        # the CDI write refuses it too (retryable): no new hold is bound until it reads
        warn_once(warned, f"vendor:{exc}", "vendor CDI spec unreadable; new holds are not bound until it reads (retried)", error=str(exc))
        vendor = None
    try:
        present = frozenset(slices.list())
    except (SliceError, OSError) as exc:
        log.warning("slices unreadable", error=str(exc))
        present = frozenset()
    empty = frozenset(a for a in present if _is_empty(slices, a))
    # the slices of holds on disk, read back for the plan's comparison (drift by content)
    sliced = sorted(a for a in present if a in disk.holds and disk.holds[a].cgroup_parent)
    slice_props = read_properties(slices, sliced) if sliced else {}
    return Observed(
        # a DRA claim's hold is the kubelet plugin's to remove, never the spec's
        holds={a: h for a, h in disk.holds.items() if h.binding != BINDING_CLAIM},
        claim_holds={a: h for a, h in disk.holds.items() if h.binding == BINDING_CLAIM},
        env_files=disk.env_files,
        slices=present,
        empty_slices=empty,
        slice_props=slice_props,
        slice_hugepages=slices.reads_hugepages if sliced else True,
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
        consumer_copies=disk.consumer_copies,
    )


def _is_empty(slices: Slices, allocation_id: str) -> bool:
    """A slice that cannot be shown empty is kept (never stopped on a guess)."""
    try:
        return slices.is_empty(allocation_id)
    except (SliceError, OSError) as exc:
        log.warning("slice unreadable; kept", allocation_id=allocation_id, error=str(exc))
        return False


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
    freed = await asyncio.to_thread(store.freed) if pending else set()
    held: dict[str, bool] = {}
    for alloc, rel in pending.items():
        if alloc in freed:
            # the operator's word (`bcd releases --free`): a host with no kubelet to ask
            log.info("pending Kubernetes release taken as free: the operator said no pod holds it", allocation_id=alloc)
            held[alloc] = False
            continue
        held[alloc] = await reaper.held(alloc, list(rel.devices))
    no_orphans = False
    if unreadable:
        disk = await asyncio.to_thread(read_disk, cdi_dir, run_dir)
        known = sorted({d for h in disk.holds.values() for d in h.devices} | {d for r in pending.values() for d in r.devices})
        no_orphans = await reaper.no_orphans(known)
    return ReleaseFacts(pending=pending, unreadable=unreadable, held=held, no_orphans=no_orphans)


__all__ = ["DiskView", "read_disk", "vfio_claims", "observe", "ReleaseFacts", "release_facts"]
