"""Facts about the host that more than one service needs (today: the boot id).

The boot id stamps signed reports and recorded intent, so a reboot is
visible. On a fake host it comes from the host description file, so a test
can "reboot" a node by editing one field.
"""

from __future__ import annotations

import json
from pathlib import Path

BOOT_ID_PATH = "sys/kernel/random/boot_id"


class HostFactError(Exception):
    """A host fact could not be read; the text names the file."""


def read_boot_id(proc_root: Path = Path("/proc"), fake_host: Path | None = None) -> str:
    if fake_host is not None:
        try:
            value = json.loads(Path(fake_host).read_bytes()).get("boot_id", "")
        except (OSError, ValueError, AttributeError) as exc:
            raise HostFactError(f"{fake_host}: cannot read boot_id ({exc})") from None
        if not isinstance(value, str) or not value:
            raise HostFactError(f"{fake_host}: boot_id is missing or not a string")
        return value
    path = Path(proc_root) / BOOT_ID_PATH
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise HostFactError(f"{path}: {exc.strerror}") from None


__all__ = ["HostFactError", "read_boot_id", "BOOT_ID_PATH"]
