"""Where this converger's hold directories are, and what they hold when read now.

The CDI spec dir (--cdi-dir: a hold IS its CDI spec), the env files under
<run-dir>/allocations, the consumer copies' dir, and the slices (a fake host's
records under <run-dir>/slices are watched like the files; `slices_now` reads
any backend's back for the status). The pass, the claims,
the status and the drift watch all read them through one `HoldDirs`, so each
reads the same places the same way (`shared.holddisk.read_disk`) and a
problem with a file is warned of once (`warned`, which observe() shares).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from shared.holddisk import DiskView, read_disk
from shared.holdfiles import BINDING_CLAIM, ENV_SUBDIR, HoldOnDisk
from shared.slices import FAKE_SLICES_SUBDIR, SliceError, Slices, read_properties

from .drift import SlicesNow, dirs_signature


class HoldDirs:
    def __init__(self, cdi_dir: Path, run_dir: Path, consumer_dir: Path | None, slices: Slices | None = None) -> None:
        self.cdi_dir = cdi_dir
        self.run_dir = run_dir
        self.consumer_dir = consumer_dir
        self.slices = slices
        #: what was warned of once already (a file that does not read, a vendor spec that does not)
        self.warned: set[str] = set()

    def holds(self) -> dict[str, HoldOnDisk]:
        return read_disk(self.cdi_dir, self.run_dir, warned=self.warned).holds

    async def claim_holds(self) -> dict[str, HoldOnDisk]:
        """The DRA claims' holds on disk, read now."""
        holds = await asyncio.to_thread(self.holds)
        return {a: h for a, h in holds.items() if h.binding == BINDING_CLAIM}

    def disk(self) -> DiskView:
        """Everything the directories hold now, the consumer copies and the problems too."""
        return read_disk(self.cdi_dir, self.run_dir, warned=self.warned, consumer_dir=self.consumer_dir)

    def slices_now(self, allocation_ids: list[str]) -> SlicesNow | None:
        """What the slices of `allocation_ids` read back now (for `drift.journal_disagreements`);
        None when there is no backend or its slices cannot be listed."""
        if self.slices is None:
            return None
        try:
            present = set(self.slices.list())
        except (SliceError, OSError):
            return None
        ids = [a for a in allocation_ids if a in present]
        return SlicesNow(read_properties(self.slices, ids) if ids else {}, self.slices.reads_hugepages)

    def watched(self) -> list[Path | None]:
        # the fake slice records too: a record edited from outside wakes a pass within seconds
        # (a missing dir has no entries; systemd slices have no files and wait for the pass)
        return [Path(self.cdi_dir), Path(self.run_dir) / ENV_SUBDIR, self.consumer_dir, Path(self.run_dir) / FAKE_SLICES_SUBDIR]

    def signature(self) -> tuple:
        """What the directories hold now, cheaply (drift.dirs_signature): the watch compares these."""
        return dirs_signature(self.watched())


__all__ = ["HoldDirs"]
