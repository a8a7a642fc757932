"""shared.fsutil: read_regular for every kind of file, and atomic writes that clean up (issue 11, points 3 and 12).

Each read runs in a daemon thread with a deadline, so a read that blocks (a
FIFO opened without O_NONBLOCK) fails the test instead of hanging it; the
FIFO is then opened for writing once to release the stuck reader.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest

from tests.blocking import within_deadline

from shared.fsutil import (
    FileTooLarge,
    FileWrite,
    atomic_write_many,
    remove_many,
    NotRegularFile,
    RefusedFile,
    atomic_write,
    in_the_way,
    occupant,
    read_regular,
    temp_path,
)



def refused(path: Path, max_bytes: int = 1024, *, fifo: Path | None = None) -> RefusedFile:
    with pytest.raises(RefusedFile) as info:
        within_deadline(lambda: read_regular(path, max_bytes=max_bytes), [fifo] if fifo else [])
    assert isinstance(info.value, OSError)
    assert str(path) in str(info.value)
    return info.value


def test_a_regular_file_is_read(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    p.write_bytes(b'{"a": 1}')
    assert read_regular(p, max_bytes=8) == b'{"a": 1}'
    (tmp_path / "empty").write_bytes(b"")
    assert read_regular(tmp_path / "empty", max_bytes=0) == b""


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "nothing", max_bytes=10)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "bcd-x.json"
    os.mkfifo(fifo)
    exc = refused(fifo, fifo=fifo)
    assert isinstance(exc, NotRegularFile) and "a FIFO" in str(exc)


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    exc = refused(link)
    assert isinstance(exc, NotRegularFile) and exc.errno == errno.ELOOP
    assert f"a symlink (to {target})" in str(exc) and "not followed" in str(exc)


def test_a_symlink_to_dev_zero_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "zero.json"
    link.symlink_to("/dev/zero")
    exc = refused(link, max_bytes=1 << 30)
    assert "a symlink (to /dev/zero)" in str(exc)


def test_a_symlink_to_a_huge_file_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB that takes no space
    link = tmp_path / "big.json"
    link.symlink_to(big)
    assert "a symlink" in str(refused(link, max_bytes=1 << 20))


def test_a_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "x.env"
    d.mkdir()
    assert "a directory" in str(refused(d))


def test_a_device_is_refused_never_opened(tmp_path: Path) -> None:
    assert "a character device" in str(refused(Path("/dev/zero"), max_bytes=1 << 30))
    assert "a character device" in str(refused(Path("/dev/null")))


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.env"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        assert "a socket" in str(refused(path))
    finally:
        s.close()


def test_a_file_over_the_cap_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "big.json"
    p.write_bytes(b"x" * 101)
    exc = refused(p, max_bytes=100)
    assert isinstance(exc, FileTooLarge) and (exc.size, exc.max_bytes) == (101, 100)
    assert "101 bytes is larger than the 100-byte limit" in str(exc)
    assert read_regular(p, max_bytes=101) == b"x" * 101


def test_a_file_whose_size_lies_is_read_only_up_to_the_cap() -> None:
    """/proc files report size 0: the bounded read still stops at the cap."""
    status = Path("/proc/self/status")
    assert status.stat().st_size == 0
    assert isinstance(refused(status, max_bytes=16), FileTooLarge)
    assert read_regular(status, max_bytes=1 << 20).startswith(b"Name:")


def test_what_is_in_the_way_of_a_write(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "file")
    assert occupant(tmp_path / "file") is None and occupant(tmp_path / "none") is None
    assert occupant(tmp_path / "dir") == "a directory"
    assert occupant(tmp_path / "fifo") == "a FIFO"
    assert occupant(tmp_path / "link") == f"a symlink (to {tmp_path / 'file'})"
    kinds = {n: in_the_way(os.lstat(tmp_path / n).st_mode) for n in ("file", "dir", "fifo", "link")}
    assert kinds == {"file": False, "dir": True, "fifo": True, "link": False}


# ---------------------------------------------------------------------------- atomic_write


def test_atomic_write_onto_a_directory_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "a1.env"
    target.mkdir()
    (target / "inside").write_text("theirs")
    with pytest.raises(IsADirectoryError):
        atomic_write(target, b"BCD_ALLOCATION_ID=a1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a1.env"]
    assert not temp_path(target).exists()
    assert (target / "inside").read_text() == "theirs"


def test_atomic_write_never_waits_on_a_fifo_at_its_temp_name(tmp_path: Path) -> None:
    target = tmp_path / "a1.env"
    os.mkfifo(temp_path(target))
    within_deadline(lambda: atomic_write(target, b"x\n"), [temp_path(target)])
    assert target.read_bytes() == b"x\n" and not temp_path(target).exists()


def test_atomic_write_replaces_a_symlink_not_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    target = tmp_path / "a1.env"
    target.symlink_to(victim)
    atomic_write(target, b"new\n")
    assert not target.is_symlink() and target.read_bytes() == b"new\n"
    assert victim.read_text() == "keep me"


# ---------------------------------------------------------------------------- batches


def test_atomic_write_many_writes_every_file_with_its_mode(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "old").write_bytes(b"old")
    files = [FileWrite(f"k{i}", tmp_path / ("a" if i % 2 else "b") / f"f{i}", f"data {i}".encode() * 100, 0o640) for i in range(40)]
    files.append(FileWrite("old", tmp_path / "a" / "old", b"new", 0o600))
    renamed: list[str] = []
    assert atomic_write_many(files, after_rename=lambda f: renamed.append(f.key)) == {}
    assert renamed == [f.key for f in files]
    for f in files:
        assert f.path.read_bytes() == f.data
        assert f.path.stat().st_mode & 0o777 == f.mode
    assert not [p for p in tmp_path.rglob(".*") if ".tmp-" in p.name]


def test_atomic_write_many_one_failure_leaves_the_others_and_no_temp(tmp_path: Path) -> None:
    (tmp_path / "dir-in-the-way").mkdir()
    (tmp_path / "dir-in-the-way" / "x").write_text("x")
    files = [
        FileWrite("ok1", tmp_path / "ok1", b"1"),
        FileWrite("bad", tmp_path / "dir-in-the-way", b"2"),  # the rename onto a non-empty directory fails
        FileWrite("missing-dir", tmp_path / "nope" / "f", b"3"),  # the temp cannot be created
        FileWrite("ok2", tmp_path / "ok2", b"4"),
    ]
    errors = atomic_write_many(files)
    assert set(errors) == {"bad", "missing-dir"}
    assert isinstance(errors["bad"], OSError) and errors["missing-dir"].errno == errno.ENOENT
    assert (tmp_path / "ok1").read_bytes() == b"1" and (tmp_path / "ok2").read_bytes() == b"4"
    assert (tmp_path / "dir-in-the-way").is_dir()
    assert not [p for p in tmp_path.rglob(".*") if ".tmp-" in p.name]


class Killed(BaseException):
    pass


def test_atomic_write_many_killed_between_files_shows_old_or_whole_new(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"f{i}").write_bytes(b"old")
    files = [FileWrite(f"f{i}", tmp_path / f"f{i}", b"new" * 1000) for i in range(4)]
    seen: list[str] = []

    def kill_after_two(f: FileWrite) -> None:
        seen.append(f.key)
        if len(seen) == 2:
            raise Killed

    with pytest.raises(Killed):
        atomic_write_many(files, after_rename=kill_after_two)
    assert [(tmp_path / f"f{i}").read_bytes() for i in range(4)] == [b"new" * 1000] * 2 + [b"old"] * 2
    # the temps of the files not renamed yet are what a crash leaves behind, for the next pass to remove
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == [f".f2.tmp-{os.getpid()}", f".f3.tmp-{os.getpid()}"]


def test_remove_many_counts_missing_as_removed_and_reports_failures(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a")
    (tmp_path / "d").mkdir()
    gone: list[str] = []
    errors = remove_many([("a", tmp_path / "a"), ("missing", tmp_path / "missing"), ("d", tmp_path / "d")], after_remove=gone.append)
    assert set(errors) == {"d"} and isinstance(errors["d"], OSError)
    assert not (tmp_path / "a").exists() and (tmp_path / "d").is_dir()
    assert gone == ["a", "missing"]


def test_a_group_leaves_its_directory_syncs_to_the_caller_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`dirs`: a pass's removals and writes share one directory sync at its end (fsync_dirs)."""
    import shared.fsutil as fsutil

    synced: list[list[Path]] = []
    real = fsutil.fsync_dirs
    monkeypatch.setattr(fsutil, "fsync_dirs", lambda ds: (synced.append(sorted(ds)), real(ds))[1])
    cdi, env = tmp_path / "cdi", tmp_path / "env"
    cdi.mkdir()
    env.mkdir()
    (cdi / "old.json").write_text("{}")
    (env / "old.env").write_text("X=1\n")
    dirs: set[Path] = set()
    assert remove_many([("old", cdi / "old.json"), ("old-env", env / "old.env")], dirs=dirs) == {}
    assert atomic_write_many([FileWrite("new", cdi / "new.json", b"{}"), FileWrite("new-env", env / "new.env", b"X=2\n")], dirs=dirs) == {}
    assert synced == [] and dirs == {cdi, env}  # nothing synced yet: the caller does it once
    assert (cdi / "new.json").read_bytes() == b"{}" and not (cdi / "old.json").exists()
    fsutil.fsync_dirs(dirs)
    assert synced == [[cdi, env]]
    # without `dirs`, each call syncs what it touched before it returns
    synced.clear()
    atomic_write_many([FileWrite("n2", cdi / "n2.json", b"{}")])
    remove_many([("n2", cdi / "n2.json")])
    assert synced == [[cdi], [cdi]]


def test_fsync_dirs_raises_for_a_directory_that_is_not_there(tmp_path: Path) -> None:
    import shared.fsutil as fsutil

    with pytest.raises(FileNotFoundError):
        fsutil.fsync_dirs([tmp_path, tmp_path / "gone"])


def test_exclusive_serialises_writers_of_a_file_and_gives_up_after_the_wait(tmp_path):
    import threading

    from shared.fsutil import LockTimeout, exclusive, lock_file_of

    target = tmp_path / "host.json"
    target.write_text("{}")
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with exclusive(target, 5):
            held.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(5)
        with pytest.raises(LockTimeout):
            with exclusive(target, 0.05):
                pass
    finally:
        release.set()
        t.join()
    with exclusive(target, 1):  # free again
        pass
    assert lock_file_of(target) == tmp_path / ".host.json.lock"
    # a symlink where the lock file goes is never followed
    other = tmp_path / "other"
    lock_file_of(target).unlink()
    lock_file_of(target).symlink_to(other)
    with pytest.raises(OSError):
        with exclusive(target, 0.05):
            pass
    assert not other.exists()
