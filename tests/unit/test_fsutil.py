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
