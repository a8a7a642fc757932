"""What the root helper does, without the bus: four operations and `info`.

Every request has been decoded with unknown fields refused. Here each is
checked again before anything touches the host, and every path, file name,
slice name and file content is built from the checked fields:

- `file_write`: the hold's typed fields become a HoldContent (ids, env lines,
  devices and limits validated there) and its bytes come from
  `shared.holdfiles.hold_file_bytes` with the vendor CDI spec read from this
  helper's own CDI directory - the same function the in-process writer uses.
  A card passed through (`/dev/vfio/<N>` in the spec) is written only when
  group N is that listed GPU's, by the inventory's word and what root reads
  itself (iommu.py `check_group`); the inventory unreachable refuses it.
- `file_copy`: a hold spec's consumer copy, made from the hold spec in this
  helper's own CDI directory (`shared.holdfiles.consumer_file_bytes`): only
  the allocation id crosses the wire.
- `file_remove`: a hold's file, or the temp file a write of a given pid left.
- `slice_apply` / `slice_remove`: `bcd-alloc-<id>.slice` only, limits within
  bounds (`shared.holdfiles.limits_from_wire`), through the same `Slices`
  port the converger uses.

A request that is not acceptable raises `HelperRefusal` (nothing written); an
operation the host failed raises `HelperFailure`; `answer` turns both, and a
body that does not decode, into a HelperReply. One operation runs at a time.

The hold files are written through `SafeDir` (no symlink followed, see
safefs.py). Fake slices (a fakehw host) are JSON records FakeSlices writes
with plain paths; systemd slices involve no path at all.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shared.fsutil import TEMP_MARK
from shared.holdfiles import (
    ENV_SUBDIR,
    HOLD_FILE_MAX_BYTES,
    NotAHold,
    VendorCache,
    checked_id,
    consumer_file_bytes,
    env_file_name,
    hold_file_bytes,
    hold_file_name,
    hold_from_wire,
    limits_from_wire,
)
from shared.runtime import VERSION
from shared.schemas import (
    HELPER_FILE_COPY_CODEC,
    HELPER_FILE_REMOVE_CODEC,
    HELPER_FILE_WRITE_CODEC,
    HELPER_SLICE_APPLY_CODEC,
    HELPER_SLICE_REMOVE_CODEC,
    BadMessage,
    Codec,
    HelperFileCopy,
    HelperFileRemove,
    HelperFileWrite,
    HelperInfo,
    HelperReply,
    HelperSliceApply,
    HelperSliceRemove,
    Inventory,
)
from shared.slices import SliceError, Slices, slice_properties
from shared.vendorcdi import VendorSpecError

from .iommu import GroupRefused, IommuGroups, check_group
from .safefs import SafeDir

#: the CDI spec of one hold is never near this; a bigger build is refused.
MAX_FILE_BYTES = 4 * 1024 * 1024
#: HelperReply.reason is bounded (Text): longer reasons are clipped.
REASON_MAX = 4000

#: operation -> (request codec, HelperOps method)
OPERATIONS: dict[str, tuple[Codec[Any], str]] = {
    "file.write": (HELPER_FILE_WRITE_CODEC, "file_write"),
    "file.copy": (HELPER_FILE_COPY_CODEC, "file_copy"),
    "file.remove": (HELPER_FILE_REMOVE_CODEC, "file_remove"),
    "slice.apply": (HELPER_SLICE_APPLY_CODEC, "slice_apply"),
    "slice.remove": (HELPER_SLICE_REMOVE_CODEC, "slice_remove"),
}


def _clip(text: str) -> str:
    return text if len(text) <= REASON_MAX else text[: REASON_MAX - 1] + "…"


def _allocation(req: Any) -> str:
    hold = getattr(req, "hold", None)
    return str(getattr(hold, "allocation_id", None) or getattr(req, "allocation_id", ""))


class HelperRefusal(Exception):
    """The request is not acceptable; nothing was written."""


class HelperFailure(Exception):
    """The host failed the operation (disk, permissions, systemd); worth a retry."""


class HelperOps:
    def __init__(
        self,
        cdi_dir: Path,
        run_dir: Path,
        slices: Slices,
        *,
        slices_backend: str,
        mps_pipe_dir: str,
        consumer_dir: Path | None = None,
        mps_root: str = "",
        iommu: IommuGroups | None = None,
        inventory: Callable[[], Inventory] | None = None,
    ) -> None:
        self.cdi = SafeDir(cdi_dir)
        #: where the hold specs' consumer copies go (None: this helper makes none)
        self.consumer = SafeDir(consumer_dir) if consumer_dir is not None else None
        self.run_dir = Path(os.path.realpath(run_dir))
        self.env = SafeDir(self.run_dir / ENV_SUBDIR)
        self.slices = slices
        self.slices_backend = slices_backend
        self.mps_pipe_dir = mps_pipe_dir
        #: where the inventory keeps DRA claims' MPS daemons (`<root>/<control>/pipe` is mounted)
        self.mps_root = mps_root
        self.vendor = VendorCache(self.cdi.path)
        #: what root reads of IOMMU groups, and the inventory now (a bus call, from the
        #: operation's thread); without both, a card passed through is refused
        self.iommu = iommu
        self.inventory = inventory
        self._lock = threading.Lock()

    def info(self) -> HelperInfo:
        return HelperInfo(
            cdi_dir=str(self.cdi.path),
            run_dir=str(self.run_dir),
            slices=self.slices_backend,
            mps_pipe_dir=self.mps_pipe_dir,
            mps_root=self.mps_root,
            euid=os.geteuid(),
            version=VERSION,
            cdi_consumer_dir=str(self.consumer.path) if self.consumer is not None else "",
        )

    def answer(self, op: str, data: bytes) -> tuple[HelperReply, str]:
        """Decode one request body and run it: (the reply, the allocation id it names).

        Never raises for a request it does not like: a body that does not
        decode (an unknown field included) or fails a check is a "refused"
        reply, a host failure a "failed" one.
        """
        codec, method = OPERATIONS[op]
        try:
            req = codec.decode(data)
        except BadMessage as exc:
            return HelperReply(ok=False, outcome="refused", reason=_clip(f"bad request: {exc}")), ""
        alloc = _allocation(req)
        try:
            return getattr(self, method)(req), alloc
        except HelperRefusal as exc:
            return HelperReply(ok=False, outcome="refused", reason=_clip(str(exc))), alloc
        except HelperFailure as exc:
            return HelperReply(ok=False, outcome="failed", reason=_clip(str(exc))), alloc

    def _where(self, kind: str, allocation_id: str) -> tuple[SafeDir, str]:
        try:
            alloc = checked_id(allocation_id)
        except ValueError as exc:
            raise HelperRefusal(str(exc)) from None
        if kind == "cdi":
            return self.cdi, hold_file_name(alloc)
        if kind == "cdi-consumer":
            if self.consumer is None:
                raise HelperRefusal("this helper writes no consumer copies (no --cdi-consumer-dir)")
            return self.consumer, hold_file_name(alloc)
        return self.env, env_file_name(alloc)

    def file_write(self, req: HelperFileWrite) -> HelperReply:
        if req.kind == "cdi-consumer":
            raise HelperRefusal(f"the consumer copy of {req.hold.allocation_id} is made from its hold spec on disk: ask file.copy")
        directory, name = self._where(req.kind, req.hold.allocation_id)
        try:
            hold = hold_from_wire(req.hold, self.mps_pipe_dir, mps_root=self.mps_root)
        except ValueError as exc:
            raise HelperRefusal(f"{req.kind} of {req.hold.allocation_id}: {exc}") from None
        self._check_passthrough(f"{req.kind} of {hold.allocation_id}", [(d.gpu_uuid, d.iommu_group) for d in hold.devices if d.iommu_group is not None])
        with self._lock:
            vendor = None
            if req.kind == "cdi":
                try:
                    vendor = self.vendor.get()
                except VendorSpecError as exc:
                    raise HelperFailure(f"vendor CDI spec unreadable: {exc}") from None
            data = hold_file_bytes(req.kind, hold, vendor)
            if len(data) > MAX_FILE_BYTES:
                raise HelperRefusal(f"{req.kind} of {hold.allocation_id}: {len(data)} bytes is more than {MAX_FILE_BYTES}")
            try:
                changed = directory.write(name, data)
            except OSError as exc:
                raise HelperFailure(f"cannot write {directory.path / name}: {exc.strerror or exc}") from None
        return HelperReply(ok=True, outcome="done", changed=changed, path=str(directory.path / name))

    def _check_passthrough(self, what: str, cards: list[tuple[str, int]]) -> None:
        """Each (GPU uuid, IOMMU group) must be a listed GPU's group (iommu.check_group); fail closed."""
        if not cards:
            return
        if self.iommu is None or self.inventory is None:
            raise HelperRefusal(f"{what}: this helper has no view of IOMMU groups and the inventory, so it passes no card through")
        try:
            inventory = self.inventory()
        except Exception as exc:  # noqa: BLE001 - whatever stopped the answer, nothing is written
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise HelperRefusal(f"{what}: the inventory did not say which GPU IOMMU group {cards[0][1]} is ({why}); not written") from None
        for gpu_uuid, group in cards:
            try:
                check_group(gpu_uuid, group, inventory, self.iommu)
            except GroupRefused as exc:
                raise HelperRefusal(f"{what}: /dev/vfio/{group} is not written: {exc}") from None

    def file_copy(self, req: HelperFileCopy) -> HelperReply:
        directory, name = self._where("cdi-consumer", req.allocation_id)
        with self._lock:
            try:
                spec = self.cdi.read(name, HOLD_FILE_MAX_BYTES + 1)
            except OSError as exc:
                raise HelperFailure(f"cannot read {self.cdi.path / name}: {exc.strerror or exc}") from None
            if spec is None:
                raise HelperFailure(f"no hold spec {self.cdi.path / name} (not a regular file, or not there) to copy")
            if len(spec) > HOLD_FILE_MAX_BYTES:
                raise HelperRefusal(f"{self.cdi.path / name} is larger than {HOLD_FILE_MAX_BYTES} bytes")
            try:
                data = consumer_file_bytes(req.allocation_id, spec)
            except (NotAHold, ValueError) as exc:
                raise HelperRefusal(f"{self.cdi.path / name} is not copied: {exc}") from None
            try:
                changed = directory.write(name, data)
            except OSError as exc:
                raise HelperFailure(f"cannot write {directory.path / name}: {exc.strerror or exc}") from None
        return HelperReply(ok=True, outcome="done", changed=changed, path=str(directory.path / name))

    def file_remove(self, req: HelperFileRemove) -> HelperReply:
        directory, name = self._where(req.kind, req.allocation_id)
        if req.temp_pid is not None:
            name = f".{name}{TEMP_MARK}{req.temp_pid}"
        with self._lock:
            try:
                changed = directory.remove(name)
            except OSError as exc:
                raise HelperFailure(f"cannot remove {directory.path / name}: {exc.strerror or exc}") from None
        return HelperReply(ok=True, outcome="done", changed=changed, path=str(directory.path / name))

    def slice_apply(self, req: HelperSliceApply) -> HelperReply:
        try:
            alloc = checked_id(req.allocation_id)
            limits = limits_from_wire(req.limits)
            slice_properties(alloc, limits)  # every check the backends make, before any of them runs
        except ValueError as exc:
            raise HelperRefusal(f"slice of {req.allocation_id}: {exc}") from None
        with self._lock:
            try:
                self.slices.apply(alloc, limits)
            except (SliceError, OSError) as exc:
                raise HelperFailure(f"slice of {alloc}: {exc}") from None
        return HelperReply(ok=True, outcome="done", changed=True)

    def slice_remove(self, req: HelperSliceRemove) -> HelperReply:
        try:
            alloc = checked_id(req.allocation_id)
        except ValueError as exc:
            raise HelperRefusal(f"slice of {req.allocation_id}: {exc}") from None
        with self._lock:
            try:
                gone = self.slices.stop(alloc)
            except (SliceError, OSError) as exc:
                raise HelperFailure(f"slice of {alloc}: {exc}") from None
        return HelperReply(ok=True, outcome="done", gone=gone)


__all__ = ["HelperOps", "HelperRefusal", "HelperFailure", "MAX_FILE_BYTES", "OPERATIONS"]
