"""The VM suites' groundwork (issue 18): the Debian guest boots under qemu and answers.

The session's system guest as booted (tests/vm/conftest.py; test_vm_units.py then installs
bcd into it): a real systemd as PID 1, cgroup v2, bcd's venv, an emulated PCI display bound to
its own kernel driver, an emulated IOMMU with groups. Skips, with the reason, where qemu or
debootstrap is missing or the image cannot be built here (deploy/vm/build-image.sh exits 3:
not root, the Debian mirror unreachable); a build that fails otherwise fails the module.

Times on two cores with no KVM (TCG): a cold image build about 3 minutes, a cached one about
10 s, a boot to the first command about 50 s.
"""

from __future__ import annotations

import pytest

from tests.vm.guestkit import BOOT_TIMEOUT_S, BUILD_TIMEOUT_S, DISPLAY_DRIVER, DISPLAY_ID
from tests.vm.qemu import Guest, Image

# pytest-timeout counts the session's fixtures (the image, the boot) into the first test
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + BOOT_TIMEOUT_S + 300)


@pytest.fixture
def guest(system_guest: Guest) -> Guest:
    """The system guest as booted: these run before test_vm_units.py installs bcd into it."""
    return system_guest


@pytest.fixture
def image(vm_image: Image) -> Image:
    return vm_image


def test_boots_to_running_with_systemd_as_pid1(guest: Guest) -> None:
    assert guest.boot_seconds is not None and guest.boot_seconds < BOOT_TIMEOUT_S
    assert guest.run(["readlink", "/proc/1/exe"], check=True).stdout.strip() == "/usr/lib/systemd/systemd"
    state = guest.run(["systemctl", "is-system-running", "--wait"], timeout=300)
    failed = guest.sh("systemctl --failed --no-legend --plain", check=False)
    assert state.stdout.strip() == "running", f"system {state.stdout.strip()!r}; failed units:\n{failed}"


def test_cgroup_v2_with_the_controllers_the_kernel_has(guest: Guest) -> None:
    assert guest.sh("stat -f -c %T /sys/fs/cgroup").strip() == "cgroup2fs"
    controllers = set(guest.sh("cat /sys/fs/cgroup/cgroup.controllers").split())
    # /proc/cgroups lists every controller the kernel was built with (name, hierarchy, count, enabled)
    built = {
        cols[0]
        for cols in (line.split() for line in guest.sh("cat /proc/cgroups").splitlines())
        if cols and not cols[0].startswith("#") and cols[-1] == "1"
    }
    wanted = {"cpuset", "memory", "hugetlb"} & built
    assert wanted, f"the kernel has none of cpuset, memory, hugetlb: {sorted(built)}"
    assert wanted <= controllers, f"cgroup.controllers {sorted(controllers)} lacks {sorted(wanted - controllers)}"


def test_bcd_venv_imports(guest: Guest, image: Image) -> None:
    guest.run(["/opt/bcd/venv/bin/python", "-c", "import services.converger"], check=True)
    if image.manifest.get("pystemd"):
        guest.run(["/opt/bcd/venv/bin/python", "-c", "import pystemd.systemd1"], check=True)
    assert guest.run(["test", "-f", "/opt/bcd/src/docs/install.md"]).rc == 0
    assert guest.run(["test", "-f", "/opt/bcd/src/deploy/systemd/bcd.target"]).rc == 0


def pci_devices(guest: Guest) -> list[list[str]]:
    """[address, vendor, device, driver...] of every PCI device in the guest."""
    out = guest.sh(
        "for d in /sys/bus/pci/devices/*; do "
        'printf "%s %s %s %s\\n" "${d##*/}" "$(cat $d/vendor)" "$(cat $d/device)" '
        '"$(basename "$(readlink $d/driver)" 2>/dev/null)"; done'
    )
    return [line.split() for line in out.splitlines()]


def test_display_bound_to_its_native_driver(guest: Guest) -> None:
    rows = pci_devices(guest)
    displays = [r for r in rows if tuple(r[1:3]) == DISPLAY_ID]
    assert len(displays) == 1, f"one {DISPLAY_ID} display expected: {rows}"
    assert displays[0][3:] == [DISPLAY_DRIVER], f"{displays[0][0]} is bound to {displays[0][3:]}, not {DISPLAY_DRIVER}"


def test_iommu_groups(guest: Guest) -> None:
    groups = guest.sh("ls /sys/kernel/iommu_groups").split()
    assert groups, f"no IOMMU groups: is intel-iommu on?\n{guest.sh('dmesg | grep -i -e dmar -e iommu | tail -20', check=False)}"
    # the display is in one of them (the VFIO switch needs that)
    (display,) = (r[0] for r in pci_devices(guest) if tuple(r[1:3]) == DISPLAY_ID)
    group = guest.run(["readlink", f"/sys/bus/pci/devices/{display}/iommu_group"])
    assert group.rc == 0 and group.stdout.strip().rsplit("/", 1)[-1] in groups, f"{display} has no IOMMU group"
