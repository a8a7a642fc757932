"""Whether an IOMMU group is a listed GPU's: the root helper's check before a hold names `/dev/vfio/<N>`.

A DRA claim that passes a card through gets `/dev/vfio/<N>` in its CDI spec, and a container
given that node owns every device of group N. The request names the card (its GPU uuid) and N;
neither is taken on the word of the bus. `check_group` accepts N only when both witnesses agree:

- the inventory (asked over the bus by the caller, `bcd.<n>.inventory.get`) lists a GPU with
  that uuid, at a PCI address P, in IOMMU group N;
- what root reads itself (`IommuGroups`): group N has P as a member, P is a display
  controller (PCI class 0x0300 VGA or 0x0302 3D, as vfio_switcher reads it), and P's own
  `iommu_group` names N.

Anything else is refused with the reason (`GroupRefused`): an unlisted uuid, a group the
inventory puts the card in that is not N, a group without P, a member that is not a display
controller, a group directory reached through a link, more members than any real group has.

`SysfsIommuGroups` reads `<sysfs>/kernel/iommu_groups/<N>/devices/`: the sysfs root is resolved
once (the operator's), and from it `kernel`, `iommu_groups`, `<N>` and `devices` are opened one at
a time with O_NOFOLLOW, so a link there (`iommu_groups/42 -> 20`) is refused, never followed. The
members' entries are links the kernel makes; only their names are used. Each member's class and
`iommu_group` link are read under `<sysfs>/bus/pci/devices/<P>/` (the kernel's own links, as
vfio_switcher reads them), bounded. `FakeHostIommuGroups` gives the same facts from the fake host
file the fakehw inventory reads (`gpus[].iommu_group`, class 0x030200, as vfio_switcher's fake
kernel has it), so a fake host's helper and inventory agree.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.fsutil import read_regular
from shared.host import HOST_FILE_MAX_BYTES
from shared.schemas import Inventory
from shared.schemas.codec import bounded_json_loads

from .safefs import SafeDir

#: display controller classes a GPU reports: VGA (0x0300) and 3D (0x0302).
GPU_PCI_CLASS_PREFIXES = ("0x0300", "0x0302")
#: the class the fake host's GPUs have (vfio_switcher's fake kernel says the same).
FAKE_GPU_PCI_CLASS = "0x030200"
#: no real IOMMU group has this many functions (a GPU's is 1-4; a whole switch's, tens).
MAX_GROUP_MEMBERS = 256
#: a sysfs attribute read here (`class`: "0x030200\n") is far shorter.
_ATTR_MAX = 64

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PCI_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


class GroupRefused(Exception):
    """The group is not shown to be the named listed GPU's; the text says why."""


@dataclass(frozen=True)
class Member:
    """One PCI function of an IOMMU group, as root reads it."""

    pci: str
    #: "0x030200"; "" when unreadable
    pci_class: str
    #: the group the function's own `iommu_group` link names; None when unreadable
    group: int | None


class IommuGroups(Protocol):
    def members(self, group: int) -> list[Member]:
        """The PCI functions of `group`; GroupRefused when it cannot be read safely."""
        ...


class SysfsIommuGroups:
    """IommuGroups over `<sysfs_root>/kernel/iommu_groups` (see the module docstring)."""

    def __init__(self, sysfs_root: Path | str) -> None:
        self.root = SafeDir(sysfs_root)

    def members(self, group: int) -> list[Member]:
        where = f"{self.root.path}/kernel/iommu_groups/{group}/devices"
        fd = self._open_devices(group, where)
        try:
            names: list[str] = []
            with os.scandir(fd) as it:
                for entry in it:
                    names.append(entry.name)
                    if len(names) > MAX_GROUP_MEMBERS:
                        raise GroupRefused(f"{where} has more than {MAX_GROUP_MEMBERS} entries")
        finally:
            os.close(fd)
        # other buses' devices (a platform device on some machines) are no PCI function bcd lists
        return [self._member(n) for n in sorted(names) if _PCI_RE.fullmatch(n)]

    def _open_devices(self, group: int, where: str) -> int:
        try:
            fd = self.root.open(create=False)
        except OSError as exc:
            raise GroupRefused(f"the sysfs root {self.root.path} cannot be opened: {exc.strerror or exc}") from None
        if fd is None:
            raise GroupRefused(f"no sysfs root {self.root.path}")
        try:
            for part in ("kernel", "iommu_groups", str(group), "devices"):
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except FileNotFoundError:
            os.close(fd)
            raise GroupRefused(f"no IOMMU group {group} on this host ({where} is not there)") from None
        except OSError as exc:
            os.close(fd)
            # ELOOP (a link) or ENOTDIR: never followed
            raise GroupRefused(f"{where} is not reached through plain directories ({exc.strerror}); not followed") from None
        return fd

    def _member(self, pci: str) -> Member:
        device = self.root.path / "bus" / "pci" / "devices" / pci
        try:
            fd = os.open(device / "class", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                pci_class = os.read(fd, _ATTR_MAX).decode("ascii", "replace").strip().lower()
            finally:
                os.close(fd)
        except OSError:
            pci_class = ""
        try:
            name = os.path.basename(os.readlink(device / "iommu_group"))
            group = int(name) if name.isdigit() else None
        except OSError:
            group = None
        return Member(pci, pci_class, group)


class FakeHostIommuGroups:
    """IommuGroups from the fake host file: each present GPU of `gpus[]` is the one member of its group."""

    def __init__(self, host_file: Path | str) -> None:
        self.host_file = Path(host_file)

    def members(self, group: int) -> list[Member]:
        try:
            host = bounded_json_loads(read_regular(self.host_file, max_bytes=HOST_FILE_MAX_BYTES), HOST_FILE_MAX_BYTES, "host file")
        except (OSError, ValueError) as exc:
            raise GroupRefused(f"the fake host file {self.host_file} is unreadable: {exc}") from None
        gpus = host.get("gpus") if isinstance(host, dict) else None
        out: list[Member] = []
        for g in gpus if isinstance(gpus, list) else []:
            if isinstance(g, dict) and g.get("iommu_group") == group and g.get("present", True) is True and isinstance(g.get("pci_address"), str):
                out.append(Member(g["pci_address"], FAKE_GPU_PCI_CLASS, group))
        return out


def check_group(gpu_uuid: str, group: int, inventory: Inventory, groups: IommuGroups) -> str:
    """The PCI address of the listed GPU `gpu_uuid` when IOMMU group `group` is its; GroupRefused otherwise."""
    atom = gpu_uuid if gpu_uuid.startswith("GPU-") else f"GPU-{gpu_uuid}"
    gpu = next((g for g in inventory.gpus if atom in (g.atom_id, g.uuid) or gpu_uuid == g.uuid), None)
    if gpu is None:
        raise GroupRefused(f"{atom} is not a GPU the inventory lists")
    if gpu.iommu_group != group:
        said = "no IOMMU group" if gpu.iommu_group is None else f"IOMMU group {gpu.iommu_group}"
        raise GroupRefused(f"the inventory lists {atom} ({gpu.pci_address}) in {said}, not {group}")
    members = groups.members(group)
    me = next((m for m in members if m.pci == gpu.pci_address), None)
    if me is None:
        raise GroupRefused(f"IOMMU group {group} has no {gpu.pci_address} (it has {', '.join(m.pci for m in members) or 'no PCI function'})")
    if not me.pci_class.startswith(GPU_PCI_CLASS_PREFIXES):
        raise GroupRefused(f"{gpu.pci_address} in IOMMU group {group} is not a display controller (class {me.pci_class or 'unreadable'})")
    if me.group != group:
        raise GroupRefused(f"{gpu.pci_address}'s own iommu_group link names {me.group if me.group is not None else 'nothing readable'}, not {group}")
    return gpu.pci_address


__all__ = ["FakeHostIommuGroups", "GroupRefused", "IommuGroups", "Member", "SysfsIommuGroups", "check_group", "MAX_GROUP_MEMBERS"]
