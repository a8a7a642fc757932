"""The root helper names `/dev/vfio/<N>` only for an IOMMU group of a GPU the inventory lists (issue 40).

What an attacker on the bus would send the helper, each refused with the reason and nothing
written: a group of no listed card, a listed card with another card's group, a group whose
member root reads as no display controller, a group directory that is a link to a real GPU's
group, a member whose own iommu_group link names another group, and any of it while the
inventory does not answer. The good write still goes through, with sysfs read from a fake tree
(services/helper/iommu.py SysfsIommuGroups) and from the fake host file (FakeHostIommuGroups).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from services.helper.iommu import MAX_GROUP_MEMBERS, FakeHostIommuGroups, GroupRefused, Member, SysfsIommuGroups, check_group
from services.helper.ops import HelperOps
from shared.holdfiles import HoldContent, HoldDevice, hold_to_wire
from shared.schemas import HELPER_REPLY_CODEC, HelperFileWrite, HelperReply, Inventory, encode
from shared.schemas.inventory import Gpu
from shared.slices import FakeSlices

REPO = Path(__file__).resolve().parents[2]
HOST_FILE = REPO / "examples" / "hosts" / "h200x8.json"
H200 = json.loads(HOST_FILE.read_text())
CARD = H200["gpus"][0]  # 0000:18:00.0, IOMMU group 20
OTHER = H200["gpus"][1]  # 0000:2a:00.0, IOMMU group 21
CLAIM = "claim-0d0e4c1a-1111-4222-8333-444455556666"


def inventory(*cards: dict, group: dict[str, int | None] | None = None) -> Inventory:
    """The inventory listing `cards` (as the host file has them; `group` overrides a card's group by pci)."""
    gpus = [
        Gpu(
            atom_id=c["uuid"], uuid=c["uuid"], index=c["index"], pci_address=c["pci_address"],
            iommu_group=(group or {}).get(c["pci_address"], c["iommu_group"]), driver="vfio-pci", base_driver="nvidia",
        )
        for c in cards
    ]  # fmt: skip
    return Inventory(node_id="node-1", observed_at=datetime.now(UTC), gpus=gpus)


def passthrough(card: dict, group: int) -> HoldContent:
    return HoldContent(
        allocation_id=CLAIM, reservation_id=CLAIM, generation=0, binding="BINDING_CLAIM", devices=(HoldDevice.for_vfio(card["uuid"], card["index"], group),)
    )


class FakeSysfs:
    """A sysfs tree as the kernel lays out IOMMU groups: kernel/iommu_groups/<N>/devices/<pci> links
    into bus/pci/devices/<pci>, whose `iommu_group` links back to its group."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "kernel" / "iommu_groups").mkdir(parents=True)
        (root / "bus" / "pci" / "devices").mkdir(parents=True)

    def function(self, pci: str, pci_class: str, group: int) -> None:
        dev = self.root / "bus" / "pci" / "devices" / pci
        dev.mkdir()
        (dev / "class").write_text(pci_class + "\n")
        devices = self.root / "kernel" / "iommu_groups" / str(group) / "devices"
        devices.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../../../bus/pci/devices/{pci}", devices / pci)
        os.symlink(f"../../../../kernel/iommu_groups/{group}", dev / "iommu_group")


@pytest.fixture
def sysfs(tmp_path: Path) -> FakeSysfs:
    s = FakeSysfs(tmp_path / "sys")
    s.function(CARD["pci_address"], "0x030200", 20)
    s.function("0000:18:00.1", "0x040300", 20)  # the card's audio function shares its group
    s.function(OTHER["pci_address"], "0x030200", 21)
    s.function("0000:c1:00.0", "0x020000", 42)  # a NIC, alone in its group
    return s


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def make_ops(root: Path, groups: SysfsIommuGroups | FakeHostIommuGroups | None, inv: Inventory | Exception | None) -> HelperOps:
    (root / "cdi").mkdir(parents=True)
    (root / "run").mkdir(parents=True)

    def ask() -> Inventory:
        if isinstance(inv, Exception):
            raise inv
        assert inv is not None
        return inv

    return HelperOps(
        root / "cdi", root / "run", FakeSlices(root / "run"), slices_backend="fake", mps_pipe_dir="/tmp/nvidia-mps",
        iommu=groups, inventory=ask if inv is not None else None,
    )  # fmt: skip


def write(ops: HelperOps, content: HoldContent) -> HelperReply:
    reply, _ = ops.answer("file.write", encode(HelperFileWrite(kind="cdi", hold=hold_to_wire(content))))
    return HELPER_REPLY_CODEC.decode(encode(reply))


# --------------------------------------------------------------------------- the good write


def test_a_listed_gpus_own_group_is_written(tmp_path: Path, sysfs: FakeSysfs) -> None:
    ops = make_ops(tmp_path / "h", SysfsIommuGroups(sysfs.root), inventory(CARD, OTHER))
    r = write(ops, passthrough(CARD, 20))
    assert r.ok and r.outcome == "done", r
    spec = json.loads((tmp_path / "h" / "cdi" / f"bcd-{CLAIM}.json").read_text())
    assert spec["devices"][0]["containerEdits"] == {"deviceNodes": [{"path": "/dev/vfio/20"}]}


def test_the_fake_host_file_gives_the_helper_the_inventorys_view(tmp_path: Path) -> None:
    """On a fake host the helper reads groups from the file the fakehw inventory reads: they agree."""
    groups = FakeHostIommuGroups(HOST_FILE)
    assert groups.members(20) == [Member(CARD["pci_address"], "0x030200", 20)]
    assert groups.members(99) == []
    ops = make_ops(tmp_path / "h", groups, inventory(*H200["gpus"]))
    assert write(ops, passthrough(CARD, 20)).ok
    r = write(ops, passthrough(CARD, 21))
    assert r.outcome == "refused" and "in IOMMU group 20, not 21" in r.reason, r


# --------------------------------------------------------------------------- what an attacker sends

REFUSALS = [
    # a group no listed card is in (the NIC's), named for a listed card
    pytest.param(lambda s: None, CARD, 42, {}, "lists GPU-5f1c2a90-0000-4000-8000-000000000001 (0000:18:00.0) in IOMMU group 20, not 42", id="group-of-no-listed-card"),
    # the same, with the inventory made to say it: root's own read of group 42 finds only the NIC
    pytest.param(lambda s: None, CARD, 42, {CARD["pci_address"]: 42}, "IOMMU group 42 has no 0000:18:00.0 (it has 0000:c1:00.0)", id="nic-group-inventory-lies"),
    # another listed card's group
    pytest.param(lambda s: None, CARD, 21, {}, "in IOMMU group 20, not 21", id="another-cards-group"),
    # a group no device on this host has (the inventory was made to say so)
    pytest.param(lambda s: None, CARD, 77, {CARD["pci_address"]: 77}, "no IOMMU group 77 on this host", id="group-not-on-host"),
    # a listed card whose group root reads with no display controller at its address
    pytest.param(
        lambda s: (s.root / "bus/pci/devices/0000:18:00.0/class").write_text("0x020000\n"), CARD, 20, {}, "is not a display controller (class 0x020000)", id="listed-non-gpu"
    ),
    # the group directory is a link to the real GPU's group: never followed
    pytest.param(
        lambda s: os.symlink("20", s.root / "kernel/iommu_groups/43"), CARD, 43, {CARD["pci_address"]: 43}, "not reached through plain directories", id="symlinked-group"
    ),
    # its devices/ directory is a link to the GPU's group's
    pytest.param(
        lambda s: (s.root / "kernel/iommu_groups/44").mkdir() or os.symlink("../20/devices", s.root / "kernel/iommu_groups/44/devices"),
        CARD, 44, {CARD["pci_address"]: 44}, "not reached through plain directories", id="symlinked-devices-dir",
    ),  # fmt: skip
    # the card is listed in the group directory, but its own iommu_group link says another group
    pytest.param(
        lambda s: os.symlink("../../../../bus/pci/devices/0000:18:00.0", s.root / "kernel/iommu_groups/42/devices/0000:18:00.0"),
        CARD, 42, {CARD["pci_address"]: 42}, "own iommu_group link names 20, not 42", id="member-of-another-group",
    ),  # fmt: skip
    # the card's group has no such member (the inventory lists a card at an address sysfs does not put there)
    pytest.param(lambda s: None, OTHER, 20, {OTHER["pci_address"]: 20}, "IOMMU group 20 has no 0000:2a:00.0 (it has 0000:18:00.0, 0000:18:00.1)", id="group-without-the-card"),
]


@pytest.mark.parametrize(("plant", "card", "group", "inventory_says", "reason"), REFUSALS)
def test_a_group_that_is_not_the_listed_gpus_is_refused_and_nothing_is_written(
    tmp_path: Path, sysfs: FakeSysfs, plant, card: dict, group: int, inventory_says: dict, reason: str
) -> None:
    plant(sysfs)
    ops = make_ops(tmp_path / "h", SysfsIommuGroups(sysfs.root), inventory(CARD, OTHER, group=inventory_says))
    r = write(ops, passthrough(card, group))
    assert (r.ok, r.outcome) == (False, "refused") and reason in r.reason and f"/dev/vfio/{group} is not written" in r.reason, r
    assert tree(tmp_path / "h") == {}


def test_an_unlisted_gpu_is_refused(tmp_path: Path, sysfs: FakeSysfs) -> None:
    ops = make_ops(tmp_path / "h", SysfsIommuGroups(sysfs.root), inventory(OTHER))
    r = write(ops, passthrough(CARD, 20))
    assert r.outcome == "refused" and f"{CARD['uuid']} is not a GPU the inventory lists" in r.reason, r
    assert tree(tmp_path / "h") == {}


@pytest.mark.parametrize(
    ("inv", "reason"),
    [
        pytest.param(TimeoutError(), "did not say which GPU IOMMU group 20 is (TimeoutError)", id="inventory-timeout"),
        pytest.param(ConnectionError("no responders"), "(ConnectionError: no responders)", id="inventory-unreachable"),
        pytest.param(None, "no view of IOMMU groups and the inventory", id="no-inventory-configured"),
    ],
)
def test_without_the_inventorys_word_a_card_is_not_passed_through(tmp_path: Path, sysfs: FakeSysfs, inv: Exception | None, reason: str) -> None:
    """Fail closed: the inventory unreachable (or no way to ask it) refuses the write, with the reason."""
    ops = make_ops(tmp_path / "h", SysfsIommuGroups(sysfs.root), inv)
    r = write(ops, passthrough(CARD, 20))
    assert r.outcome == "refused" and reason in r.reason, r
    assert tree(tmp_path / "h") == {}


def test_a_hold_without_a_card_passed_through_never_asks(tmp_path: Path) -> None:
    """The check costs a bus call only when a hold names /dev/vfio: other holds are as before."""
    ops = make_ops(tmp_path / "h", None, AssertionError("asked"))
    plain = HoldContent(allocation_id="a1", reservation_id="a1", generation=1, binding="BINDING_HOLD", devices=(HoldDevice.for_gpu(CARD["uuid"], 0),))
    assert write(ops, plain).ok


def test_a_group_with_more_members_than_any_real_one_is_refused(tmp_path: Path, sysfs: FakeSysfs) -> None:
    devices = sysfs.root / "kernel/iommu_groups/20/devices"
    for i in range(MAX_GROUP_MEMBERS):
        (devices / f"x{i}").touch()
    with pytest.raises(GroupRefused, match=f"more than {MAX_GROUP_MEMBERS} entries"):
        check_group(CARD["uuid"], 20, inventory(CARD), SysfsIommuGroups(sysfs.root))


def test_a_symlinked_sysfs_root_is_the_operators_and_is_followed(tmp_path: Path, sysfs: FakeSysfs) -> None:
    """The configured root may be a link (resolved once at start, like the helper's other dirs); below it nothing is."""
    link = tmp_path / "sys-link"
    link.symlink_to(sysfs.root)
    assert check_group(CARD["uuid"], 20, inventory(CARD), SysfsIommuGroups(link)) == CARD["pci_address"]
