"""The DRA plugin's checkpoint: `<data_dir>/dra_plugin/checkpoint.json` (0600, written atomically).

One entry per claim the kubelet asked us to prepare: `PrepareStarted` is
written before the converger is asked (so a crash in between is known at the
next start), `PrepareCompleted` with the devices answered once the claim's hold
exists; the entry goes when Unprepare succeeded. Each entry carries the boot id
it was written in. A restart reconciles it with the converger's claims and the
API server (plugin.DraPlugin.reconcile). An unreadable file is set aside and
the plugin starts afresh: the converger's journal still knows every claim hold.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import Literal

import msgspec

from shared import logs
from shared.fsutil import RefusedFile, atomic_write, read_regular
from shared.schemas import PreparedDevice

log = logs.get_logger("bcd.dra_plugin.checkpoint")

CHECKPOINT_MAX_BYTES = 16 * 1024 * 1024


class ClaimEntry(msgspec.Struct, kw_only=True):
    uid: str
    namespace: str
    name: str
    state: Literal["PrepareStarted", "PrepareCompleted"] = "PrepareStarted"
    devices: list[PreparedDevice] = []
    boot_id: str = ""
    since: datetime


class Checkpoint(msgspec.Struct, kw_only=True):
    version: int = 1
    claims: dict[str, ClaimEntry] = {}


_DECODER = msgspec.json.Decoder(Checkpoint)


class CheckpointStore:
    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / "checkpoint.json"

    def load(self) -> Checkpoint:
        try:
            return _DECODER.decode(read_regular(self.path, max_bytes=CHECKPOINT_MAX_BYTES))
        except FileNotFoundError:
            return Checkpoint()
        except (RefusedFile, msgspec.ValidationError, msgspec.DecodeError) as exc:
            aside = self.path.with_name(f"checkpoint.json.unreadable-{int(time.time())}")
            os.replace(self.path, aside)
            log.error("DRA checkpoint unreadable; starting afresh (the converger's claims are reconciled)", file=str(self.path), kept_as=str(aside), error=str(exc))
            return Checkpoint()

    def save(self, cp: Checkpoint) -> None:
        atomic_write(self.path, msgspec.json.encode(cp), 0o600)


__all__ = ["ClaimEntry", "Checkpoint", "CheckpointStore"]
