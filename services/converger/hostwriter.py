"""The HostWriter port: the only way the converger changes the host.

Every path is built here from a validated allocation id; every file's bytes
are built here from typed fields (HoldContent) plus the vendor CDI spec on
disk - nothing from the wire names a path, a device node or a hook. The
in-process `LocalHostWriter` serves a root or fake-host converger; the root
helper (a later issue) implements the same port for an unprivileged one.
Every failure is a `HostWriteError`: retryable, the pass tries again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from shared.fsutil import atomic_write, is_temp_name, remove_durably
from shared.schemas import ID_RE, Limits
from shared.vendorcdi import VENDOR_CDI_FILE, VendorCdi, VendorSpecError, read_vendor_cdi

from .holdfiles import HoldContent, build_cdi_spec, render_cdi_spec, render_env_file
from .slices import SliceError, Slices


class HostWriteError(Exception):
    """A write the pass must retry (read-only dir, full disk, helper refusal, D-Bus)."""


class HostWriter(Protocol):
    def write_cdi(self, content: HoldContent) -> None: ...
    def remove_cdi(self, allocation_id: str) -> None: ...
    def write_env(self, content: HoldContent) -> None: ...
    def remove_env(self, allocation_id: str) -> None: ...
    def apply_slice(self, allocation_id: str, limits: Limits) -> None: ...
    def stop_slice(self, allocation_id: str) -> bool: ...
    def remove_temp(self, path: str) -> None: ...


def _checked(allocation_id: str) -> str:
    if not ID_RE.match(allocation_id):
        raise HostWriteError(f"refusing allocation id {allocation_id!r}: not a valid id")
    return allocation_id


def cdi_path(cdi_dir: Path, allocation_id: str) -> Path:
    return Path(cdi_dir) / f"bcd-{_checked(allocation_id)}.json"


def env_path(run_dir: Path, allocation_id: str) -> Path:
    return Path(run_dir) / "allocations" / f"{_checked(allocation_id)}.env"


class LocalHostWriter:
    def __init__(self, cdi_dir: Path, run_dir: Path, slices: Slices, crash: Callable[[str], None] = lambda _: None) -> None:
        self.cdi_dir = Path(cdi_dir)
        self.run_dir = Path(run_dir)
        self.slices = slices
        self.crash = crash
        self._vendor_stamp: tuple[int, ...] | None = None
        self._vendor_cached: VendorCdi | None = None

    def _write(self, path: Path, data: bytes, point: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, data, 0o644, before_rename=lambda: self.crash(point))
        except OSError as exc:
            raise HostWriteError(f"cannot write {path}: {exc.strerror or exc}") from None

    def _remove(self, path: Path) -> None:
        try:
            remove_durably(path)
        except OSError as exc:
            raise HostWriteError(f"cannot remove {path}: {exc.strerror or exc}") from None

    def _vendor(self) -> VendorCdi | None:
        """The vendor spec, decoded again only when its file changed (it can be large)."""
        path = self.cdi_dir / VENDOR_CDI_FILE
        try:
            st = path.stat()
            stamp: tuple[int, ...] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        except OSError as exc:
            raise HostWriteError(f"vendor CDI spec unreadable: cannot read {path}: {exc.strerror or exc}") from None
        if stamp != self._vendor_stamp or stamp is None:
            self._vendor_cached = read_vendor_cdi(self.cdi_dir) if stamp is not None else None
            self._vendor_stamp = stamp
        return self._vendor_cached

    def write_cdi(self, content: HoldContent) -> None:
        try:
            vendor = self._vendor()
        except VendorSpecError as exc:
            raise HostWriteError(f"vendor CDI spec unreadable: {exc}") from None
        data = render_cdi_spec(build_cdi_spec(content, vendor))
        self._write(cdi_path(self.cdi_dir, content.allocation_id), data, "bind.cdi-temp-written")

    def remove_cdi(self, allocation_id: str) -> None:
        self._remove(cdi_path(self.cdi_dir, allocation_id))

    def write_env(self, content: HoldContent) -> None:
        self._write(env_path(self.run_dir, content.allocation_id), render_env_file(content), "bind.env-temp-written")

    def remove_env(self, allocation_id: str) -> None:
        self._remove(env_path(self.run_dir, allocation_id))

    def apply_slice(self, allocation_id: str, limits: Limits) -> None:
        try:
            self.slices.apply(_checked(allocation_id), limits)
        except (SliceError, OSError) as exc:
            raise HostWriteError(f"slice of {allocation_id}: {exc}") from None

    def stop_slice(self, allocation_id: str) -> bool:
        try:
            return self.slices.stop(_checked(allocation_id))
        except (SliceError, OSError) as exc:
            raise HostWriteError(f"slice of {allocation_id}: {exc}") from None

    def remove_temp(self, path: str) -> None:
        p = Path(path)
        # only our own leftovers, only in our own directories
        if not is_temp_name(p.name) or p.parent not in (self.cdi_dir, self.run_dir / "allocations"):
            raise HostWriteError(f"refusing to remove {path}: not a temp file of ours")
        self._remove(p)


__all__ = ["HostWriteError", "HostWriter", "LocalHostWriter", "cdi_path", "env_path"]
