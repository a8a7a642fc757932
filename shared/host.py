"""Facts about the host that more than one service needs (today: the boot id).

The boot id stamps signed reports and recorded intent, so a reboot is
visible. On a fake host it comes from the host description file, so a test
can "reboot" a node by editing one field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shared.fsutil import Remembered, read_regular
from shared.schemas.codec import bounded_json_loads

BOOT_ID_PATH = "sys/kernel/random/boot_id"
#: the largest fake host description file read (every reader of it uses this cap).
HOST_FILE_MAX_BYTES = 16 * 1024 * 1024
#: a boot id file is one UUID line.
BOOT_ID_MAX_BYTES = 4096


class HostFactError(Exception):
    """A host fact could not be read; the text names the file."""


#: path -> what the fake host file read to, and the file then (shared.holdfiles.Remembered):
#: the boot id is asked for every intent and every signature, the file rarely changes.
_HOST_FILES: dict[str, Any] = {}


def read_host_file(fake_host: Path) -> Any:
    """The fake host description file, decoded (JSON); read again only when the file changed.

    Raises OSError or ValueError like reading it does.
    """
    key = os.fspath(fake_host)
    try:
        st: os.stat_result | None = os.lstat(key)
    except OSError:
        st = None
    memo = _HOST_FILES.get(key)
    if memo is not None and memo.vouches(st):
        return memo.value
    data = read_regular(fake_host, max_bytes=HOST_FILE_MAX_BYTES)
    value = bounded_json_loads(data, HOST_FILE_MAX_BYTES, str(fake_host))
    if st is not None:
        _HOST_FILES[key] = Remembered.of(st, data, value)
    return value


def read_boot_id(proc_root: Path = Path("/proc"), fake_host: Path | None = None) -> str:
    if fake_host is not None:
        try:
            value = read_host_file(fake_host).get("boot_id", "")
        except (OSError, ValueError, AttributeError) as exc:
            raise HostFactError(f"{fake_host}: cannot read boot_id ({exc})") from None
        if not isinstance(value, str):
            raise HostFactError(f"{fake_host}: boot_id is not a string")
        if value:
            return value
        # none given: GPUs described on a real host, which boots as itself
    path = Path(proc_root) / BOOT_ID_PATH
    try:
        return read_regular(path, max_bytes=BOOT_ID_MAX_BYTES).decode("utf-8", "replace").strip()
    except OSError as exc:
        raise HostFactError(f"{path}: {exc.strerror}") from None


__all__ = ["HostFactError", "read_boot_id", "read_host_file", "BOOT_ID_PATH", "HOST_FILE_MAX_BYTES"]
