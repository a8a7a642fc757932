"""A hold's files as a writer writes them: where each goes, its bytes, and the vendor spec they copy edits from.

Both writers, the converger in-process (as root or on a fake host) and the
root helper (for an unprivileged converger), build every file's bytes here
(`hold_file_bytes` for the hold spec and the env file, `consumer_file_bytes`
for the spec's consumer copy), so the two writers cannot drift apart.
`VendorCache` is the package's one reader of the disk.
"""

from __future__ import annotations

import stat
from pathlib import Path

from shared.fsutil import Remembered, remembered_value
from shared.schemas.codec import bounded_json_loads
from shared.vendorcdi import VENDOR_CDI_FILE, VendorCdi, VendorSpecError, read_vendor_cdi_bytes, vendor_cdi_from_json

from .cdi import build_cdi_spec, render_cdi_spec
from .consumer import consumer_spec
from .content import HoldContent, checked_id, env_file_name, hold_file_name
from .envfile import render_env_file
from .ondisk import HOLD_FILE_MAX_BYTES, parse_hold

#: the two files of a hold, as the helper's requests name them.
FILE_KINDS: tuple[str, ...] = ("cdi", "allocation-env")
#: where the env files live inside run_dir.
ENV_SUBDIR = "allocations"


def hold_file_path(kind: str, cdi_dir: Path, run_dir: Path, allocation_id: str) -> Path:
    """`<cdi_dir>/bcd-<id>.json` (kind cdi) or `<run_dir>/allocations/<id>.env` (kind allocation-env)."""
    name = checked_id(allocation_id)
    if kind == "cdi":
        return Path(cdi_dir) / hold_file_name(name)
    if kind == "allocation-env":
        return Path(run_dir) / ENV_SUBDIR / env_file_name(name)
    raise ValueError(f"unknown file kind {kind!r}")


# (the identity rule lives in shared.fsutil: the host file's readers use it too)
class VendorCache:
    """The vendor CDI spec of a CDI directory, decoded again only when its file changed (it can be large).

    The one reader of the disk in this module: both writers copy edits from
    the spec they find in their own CDI directory, and the converger's passes
    read it through one (observe). A file settled since its last read is not
    read again while its identity (`file_identity`) is unchanged; a younger
    one is read, and decoded again only when its bytes differ. `get` raises
    VendorSpecError when the file is there but cannot be read or decoded.
    """

    def __init__(self, cdi_dir: Path) -> None:
        self.cdi_dir = Path(cdi_dir)
        #: one attribute, replaced whole: threads that share the cache never see half an update.
        self._memo: Remembered[VendorCdi] | None = None

    def get(self) -> VendorCdi | None:
        path = self.cdi_dir / VENDOR_CDI_FILE
        try:
            # lstat: a symlink there is read (and refused) by read_vendor_cdi_bytes, never followed
            st = path.lstat()
        except FileNotFoundError:
            self._memo = None
            return None
        except OSError as exc:
            raise VendorSpecError(f"cannot read {path}: {exc.strerror or exc}") from None
        memo = self._memo
        if memo is not None and memo.vouches(st):
            return memo.value
        data = read_vendor_cdi_bytes(self.cdi_dir)
        if data is None:
            self._memo = None
            return None
        value = remembered_value(memo, data)
        if value is None:
            value = vendor_cdi_from_json(data, str(path))
        self._memo = Remembered.of(st, data, value) if stat.S_ISREG(st.st_mode) else None
        return value


def hold_file_bytes(kind: str, hold: HoldContent, vendor: VendorCdi | None) -> bytes:
    """The bytes of one file of a hold: what every writer (in-process or the helper) writes."""
    if kind == "cdi":
        return render_cdi_spec(build_cdi_spec(hold, vendor))
    if kind == "allocation-env":
        return render_env_file(hold)
    raise ValueError(f"unknown file kind {kind!r}")


def consumer_file_bytes(allocation_id: str, hold_spec: bytes) -> bytes:
    """The consumer copy's bytes, from the bytes of the hold spec `bcd-<allocation_id>.json`.

    NotAHold when those bytes are not that allocation's hold: a copy is only ever made of one."""
    parse_hold(hold_file_name(checked_id(allocation_id)), hold_spec)
    spec = bounded_json_loads(hold_spec, HOLD_FILE_MAX_BYTES, "CDI spec")
    return render_cdi_spec(consumer_spec(spec))
