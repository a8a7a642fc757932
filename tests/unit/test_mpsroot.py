"""services.inventory.mpsroot: what a claim's containers mount of its MPS daemon is root's to lay out.

What an attacker who owns the inventory (or any service) would try, each refused: a symlink in
place of the control, pipe, log or shm directory or of any directory above them, a directory
above them that a group may write or another uid owns, a spec that is a symlink, a FIFO or
too long, a spec directory that is a symlink. The tmpfs is mounted on the directory opened
without following (a recording Mounts here; for real where this process may mount). `adopt`
takes over the directories an older bcd's inventory made, as they are, and removes a symlink in
their place without touching what it points at.

The checks trust root and the euid, so the refusals of another owner need root to give a
directory away (they skip with that reason otherwise); every other case runs as anyone.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import msgspec
import pytest

from services.inventory import mpsroot
from services.inventory.adapters.base import SharingStepError, mps_spec_file
from shared.schemas import MpsDaemonSpec

CONTROL = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-a1b2c3"
OTHER = "0b6c8f2e-1d3a-4c5b-9e7f-2a4d6c8e0f13-ffffff"
GPU_A = "GPU-5f1c2a90-0000-4000-8000-000000000001"
ME = os.geteuid()
#: a uid no test runs as: the inventory's, say
STRANGER = 4242
needs_root = pytest.mark.skipif(ME != 0, reason="giving a directory to another uid needs root")


class RecordingMounts(mpsroot.Mounts):
    """Mounts that records what it was asked, by the directory's real path, and mounts nothing."""

    def __init__(self) -> None:
        self.mounted: list[tuple[str, str]] = []
        self.unmounted: list[str] = []
        self.entered = False

    def enter_host_namespace(self) -> None:
        self.entered = True

    def mount_tmpfs(self, fd: int, options: str) -> None:
        assert self.entered, "a mount outside the host's mount namespace is the step's alone"
        self.mounted.append((os.readlink(f"/proc/self/fd/{fd}"), options))

    def unmount(self, fd: int) -> None:
        assert self.entered, "an unmount outside the host's mount namespace leaves the host's"
        self.unmounted.append(os.readlink(f"/proc/self/fd/{fd}"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    # a parent of root's mode, as /run/bcd is (pytest's tmp dirs are 0700, which passes too)
    r = tmp_path / "run" / "mps"
    r.mkdir(parents=True)
    return r


def prepare(root: Path, mounts: RecordingMounts | None = None, control: str = CONTROL, size: str = "50%") -> RecordingMounts:
    m = mounts or RecordingMounts()
    mpsroot.prepare(root, control, size, owner=ME, mounts=m)
    return m


def refused(step) -> SharingStepError:  # type: ignore[no-untyped-def]
    with pytest.raises(SharingStepError) as caught:
        step()
    assert caught.value.outcome == "refused", caught.value
    return caught.value


# --------------------------------------------------------------------------- prepare, cleanup


def test_prepare_makes_the_daemons_directories_root_and_its_shm_a_tmpfs(root: Path) -> None:
    m = prepare(root)
    d = root / CONTROL
    for path in (d, d / "pipe", d / "log", d / "shm"):
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == ME and stat.S_IMODE(st.st_mode) == 0o755, path
    assert m.mounted == [(str(d / "shm"), "size=50%,mode=1777")]


def test_prepare_starts_afresh_over_what_an_earlier_start_or_an_attacker_left(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "etc"
    target.mkdir()
    (target / "shadow").write_text("secret")
    # a symlink where the daemon's directory goes: removed, what it points at untouched
    (root / CONTROL).symlink_to(target)
    prepare(root)
    assert not (root / CONTROL).is_symlink() and (root / CONTROL / "pipe").is_dir()
    assert (target / "shadow").read_text() == "secret" and sorted(os.listdir(target)) == ["shadow"]
    # a stale daemon's directory with a symlink inside: the whole goes, nothing followed
    (root / CONTROL / "pipe" / "control").write_text("")
    (root / CONTROL / "pipe" / "etc").symlink_to(target)
    prepare(root)
    assert os.listdir(root / CONTROL / "pipe") == [] and (target / "shadow").exists()


@pytest.mark.parametrize("size", ["", "50", "1g", "100%", "64k"])
def test_prepare_takes_a_tmpfs_size(root: Path, size: str) -> None:
    if not size:
        with pytest.raises(SharingStepError):
            prepare(root, size=size)
        assert not (root / CONTROL).exists()
        return
    assert prepare(root, size=size).mounted[0][1] == f"size={size},mode=1777"


@pytest.mark.parametrize("size", ["50%,uid=0", "1g,mode=777", "-1", "0", "1t", "1 g"])
def test_prepare_refuses_a_size_that_is_not_one(root: Path, size: str) -> None:
    refused(lambda: prepare(root, size=size))
    assert not (root / CONTROL).exists()


@pytest.mark.parametrize("control", ["../etc", CONTROL.upper(), CONTROL + "/x", "", CONTROL[:-1]])
def test_no_path_is_built_from_a_name_that_is_not_a_control_id(root: Path, control: str) -> None:
    m = RecordingMounts()
    for step in (
        lambda: mpsroot.prepare(root, control, "50%", owner=ME, mounts=m),
        lambda: mpsroot.cleanup(root, control, owner=ME, mounts=m),
        lambda: mpsroot.daemon_dirs(root, control, ME),
        lambda: mpsroot.read_spec(root, control, ME),
    ):
        refused(step)
    assert os.listdir(root) == [] and m.mounted == []


def test_cleanup_unmounts_the_shm_then_removes_everything_without_following(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare(root)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("")
    (root / CONTROL / "pipe" / "link").symlink_to(outside)
    (root / CONTROL / "log" / "control.log").write_text("")
    m = RecordingMounts()
    # the recording mounts make no tmpfs: say shm is one, as it is on a host
    monkeypatch.setattr(mpsroot, "_is_mount_point", lambda parent, fd: True)
    assert mpsroot.cleanup(root, CONTROL, owner=ME, mounts=m) is True
    assert m.unmounted == [str(root / CONTROL / "shm")]
    assert os.listdir(root) == [] and (outside / "keep").exists()
    assert mpsroot.cleanup(root, CONTROL, owner=ME, mounts=m) is False


# --------------------------------------------------------------------------- every component


@pytest.mark.parametrize("which", ["control", "pipe", "log", "shm"])
def test_a_symlinked_daemon_directory_is_refused_never_followed(root: Path, tmp_path: Path, which: str) -> None:
    prepare(root)
    target = tmp_path / "etc"
    target.mkdir()
    path = root / CONTROL if which == "control" else root / CONTROL / which
    os.rename(path, tmp_path / "moved")
    path.symlink_to(target)
    err = refused(lambda: mpsroot.daemon_dirs(root, CONTROL, ME))
    assert "symlink" in str(err) and os.listdir(target) == []


def test_a_symlink_anywhere_above_the_root_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "mps").mkdir(parents=True)
    (tmp_path / "run").symlink_to(real)
    m = RecordingMounts()
    err = refused(lambda: mpsroot.prepare(tmp_path / "run" / "mps", CONTROL, "50%", owner=ME, mounts=m))
    assert str(tmp_path / "run") in str(err)
    assert os.listdir(real / "mps") == [] and m.mounted == []


def test_a_directory_its_group_or_others_may_write_is_refused(root: Path) -> None:
    prepare(root)
    for mode in (0o775, 0o757, 0o777):
        os.chmod(root, mode)
        err = refused(lambda: mpsroot.daemon_dirs(root, CONTROL, ME))
        assert f"mode {mode:o}" in str(err)
    os.chmod(root, 0o1777)  # sticky, but not root's unless the test runs as root
    if ME == 0:
        os.close(mpsroot.daemon_dirs(root, CONTROL, ME)[2])
    else:
        refused(lambda: mpsroot.daemon_dirs(root, CONTROL, ME))


@needs_root
@pytest.mark.parametrize("which", ["root", "control", "pipe", "shm"])
def test_a_directory_another_uid_owns_is_refused(root: Path, which: str) -> None:
    prepare(root)
    path = {"root": root, "control": root / CONTROL, "pipe": root / CONTROL / "pipe", "shm": root / CONTROL / "shm"}[which]
    os.chown(path, STRANGER, STRANGER)
    err = refused(lambda: mpsroot.daemon_dirs(root, CONTROL, ME))
    assert f"belongs to uid {STRANGER}" in str(err)


@needs_root
def test_a_sticky_directory_of_roots_passes_and_what_a_stranger_made_in_it_does_not(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir(mode=0o1777)
    os.chmod(tmp, 0o1777)
    (tmp / "mps").mkdir()
    prepare(tmp / "mps")
    os.close(mpsroot.daemon_dirs(tmp / "mps", CONTROL, ME)[2])
    os.chown(tmp / "mps", STRANGER, STRANGER)
    refused(lambda: mpsroot.daemon_dirs(tmp / "mps", CONTROL, ME))


def test_the_shm_check_knows_the_daemons_shm_from_another_directory(root: Path, tmp_path: Path) -> None:
    prepare(root)
    _, _, fd = mpsroot.daemon_dirs(root, CONTROL, ME)
    try:
        assert mpsroot.same_directory(root / CONTROL / "shm", fd)
        assert not mpsroot.same_directory(tmp_path, fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the spec


def write_spec(root: Path, spec: MpsDaemonSpec, control: str = CONTROL) -> Path:
    path = mps_spec_file(root, control)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(msgspec.json.encode(spec))
    return path


def test_the_spec_is_read_from_the_inventorys_directory_beside_the_root(root: Path) -> None:
    spec = MpsDaemonSpec(control=CONTROL, uuids=[GPU_A], active_thread_percentage=30)
    assert write_spec(root, spec) == root.parent / "mps-specs" / f"{CONTROL}.json"
    assert mpsroot.read_spec(root, CONTROL, ME) == spec


@needs_root
def test_the_spec_directory_may_be_the_inventorys(root: Path) -> None:
    path = write_spec(root, MpsDaemonSpec(control=CONTROL, uuids=[GPU_A]))
    os.chown(path.parent, STRANGER, STRANGER)
    os.chown(path, STRANGER, STRANGER)
    assert mpsroot.read_spec(root, CONTROL, ME).uuids == [GPU_A]
    # but not the directory above it
    os.chown(root.parent, STRANGER, STRANGER)
    refused(lambda: mpsroot.read_spec(root, CONTROL, ME))


@pytest.mark.parametrize("case", ["none", "symlink", "symlinked dir", "fifo", "too long", "another control", "not a spec", "a directory"])
def test_a_spec_that_is_not_the_inventorys_regular_file_for_this_daemon_is_refused(root: Path, tmp_path: Path, case: str) -> None:
    good = msgspec.json.encode(MpsDaemonSpec(control=CONTROL, uuids=[GPU_A]))
    path = mps_spec_file(root, CONTROL)
    path.parent.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / path.name).write_bytes(good)
    if case == "symlink":
        path.symlink_to(elsewhere / path.name)
    elif case == "symlinked dir":
        path.parent.rmdir()
        path.parent.symlink_to(elsewhere)
    elif case == "fifo":
        os.mkfifo(path)  # a read would block: never opened for it
    elif case == "too long":
        path.write_bytes(good[:-1] + b" " * mpsroot.SPEC_MAX + b"}")
    elif case == "another control":
        path.write_bytes(msgspec.json.encode(MpsDaemonSpec(control=OTHER, uuids=[GPU_A])))
    elif case == "not a spec":
        path.write_text(json.dumps({"control": CONTROL, "uuids": [GPU_A], "LD_PRELOAD": "/x.so"}))
    elif case == "a directory":
        path.mkdir()
    err = refused(lambda: mpsroot.read_spec(root, CONTROL, ME))
    assert str(path.parent) in str(err), err


# --------------------------------------------------------------------------- adopt (an upgrade)


def _legacy(root: Path, control: str = CONTROL) -> Path:
    """The layout an older bcd's inventory made: its group's 0770 root, its own directories."""
    d = root / control
    (d / "pipe").mkdir(parents=True)
    (d / "log").mkdir()
    os.mkfifo(d / "pipe" / "control")
    (d / "spec.json").write_bytes(msgspec.json.encode(MpsDaemonSpec(control=control, uuids=[GPU_A])))
    for path in (d, d / "pipe", d / "log", d / "spec.json"):
        os.chown(path, STRANGER, STRANGER)
    os.chmod(root, 0o770)
    os.chown(root, 0, STRANGER)
    return d


@needs_root
def test_adopt_gives_an_older_bcds_directories_to_root_as_they_are(root: Path, tmp_path: Path) -> None:
    d = _legacy(root)
    said: list[str] = []
    assert mpsroot.adopt(root, owner=ME, log=said.append) == 1
    st = os.lstat(root)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o755)
    for path in (d, d / "pipe", d / "log", d / "shm"):
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o755), path
    # the running daemon's pipe is where it was; the directories pass root's checks now
    assert stat.S_ISFIFO(os.lstat(d / "pipe" / "control").st_mode)
    os.close(mpsroot.daemon_dirs(root, CONTROL, ME)[2])
    assert mpsroot.adopt(root, owner=ME, log=said.append) == 0  # nothing left to take


@needs_root
def test_adopt_removes_a_symlink_in_place_of_a_directory_and_leaves_its_target(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "etc"
    target.mkdir()
    (target / "shadow").write_text("secret")
    d = _legacy(root)
    os.rename(d / "pipe", tmp_path / "old-pipe")
    (d / "pipe").symlink_to(target)
    (root / OTHER).symlink_to(target)
    said: list[str] = []
    mpsroot.adopt(root, owner=ME, log=said.append)
    assert not (d / "pipe").exists() and not os.path.lexists(root / OTHER)
    assert (target / "shadow").read_text() == "secret" and os.lstat(target).st_uid == ME
    assert any(OTHER in line and "removed" in line for line in said), said


def test_adopt_with_no_root_does_nothing(tmp_path: Path) -> None:
    assert mpsroot.adopt(tmp_path / "mps", owner=ME, log=lambda _: None) == 0


# --------------------------------------------------------------------------- the real mount


def test_the_real_mounts_put_a_tmpfs_of_its_own_on_the_directory_and_take_it_off(root: Path) -> None:
    """mount(2) on /proc/self/fd/<n>, umount2(2) on the tmpfs's root: for real, where this
    process may mount (root with CAP_SYS_ADMIN in its mount namespace). Its own namespace is
    the host's here; joining PID 1's from a unit's is the VM suite's to show."""
    mounts = mpsroot.Mounts(host_ns="/proc/self/ns/mnt")
    try:
        prepare_real = lambda: mpsroot.prepare(root, CONTROL, "1m", owner=ME, mounts=mounts)  # noqa: E731
        prepare_real()
    except OSError as exc:
        pytest.skip(f"this process may not mount a tmpfs here: {exc.strerror}")
    except SharingStepError as exc:
        if "could not be made" in str(exc) and ("not permitted" in str(exc) or "Permission" in str(exc)):
            pytest.skip(f"this process may not mount a tmpfs here: {exc}")
        raise
    shm = root / CONTROL / "shm"
    try:
        st = os.lstat(shm)
        assert st.st_dev != os.lstat(root / CONTROL).st_dev, "no tmpfs on shm"
        assert stat.S_IMODE(st.st_mode) == 0o1777
        mount_line = next(line for line in Path("/proc/self/mounts").read_text().splitlines() if line.split()[1] == str(shm))
        assert mount_line.split()[2] == "tmpfs" and {"nosuid", "nodev", "noexec"} <= set(mount_line.split()[3].split(",")), mount_line
    finally:
        assert mpsroot.cleanup(root, CONTROL, owner=ME, mounts=mounts)
    assert not any(line.split()[1] == str(shm) for line in Path("/proc/self/mounts").read_text().splitlines())
    assert os.listdir(root) == []
