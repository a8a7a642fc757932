"""observe reads again only what may have changed, and always sees what did (issue 13, fixed costs).

A hold file or the vendor spec settled since its last read (ctime a second
old, `shared.fsutil.SETTLED_S`) is not read again while its identity
(device, inode, size, mtime, ctime) is unchanged; a younger one is read and
parsed again only when its bytes differ. Each test changes a file from
outside the way that could fool a cache: in place with the same size and the
mtime put back, by rename, by a symlink or a FIFO put in its place.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import shared.holddisk as observe_mod
import shared.fsutil as fsutil
import shared.holdfiles as holdfiles
import shared.holdfiles.files as holdfiles_files
from services.converger.observe import read_disk, vendor_cache
from shared.holdfiles import VendorCache
from shared.vendorcdi import VENDOR_CDI_FILE
from tests.converger_kit import GPU, Node, fast_dir, hold, spec

G = GPU


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often observe read a hold file (env files not counted) and parsed one."""
    calls = {"read": 0, "parse": 0}
    read, parse = observe_mod._read, observe_mod.parse_hold

    def counting_read(path, max_bytes, what, *a, **kw):  # noqa: ANN001, ANN002, ANN003
        calls["read"] += what == "a hold"
        return read(path, max_bytes, what, *a, **kw)

    def counting_parse(*a, **kw):  # noqa: ANN002, ANN003
        calls["parse"] += 1
        return parse(*a, **kw)

    monkeypatch.setattr(observe_mod, "_read", counting_read)
    monkeypatch.setattr(observe_mod, "parse_hold", counting_parse)
    return calls


def rewrite_in_place(path: Path, old: bytes, new: bytes) -> None:
    """Same size, mtime put back: only the ctime (and the bytes) tell."""
    assert len(old) == len(new) and old != new
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


async def bound_node(root: Path) -> tuple[Node, Path]:
    node = Node(root / "node")
    await node.converge(spec(1, hold("a1", G[0]), hold("b1", G[1])))
    return node, node.cdi_dir / "bcd-a1.json"


async def test_a_young_hold_file_is_read_every_time_and_parsed_again_only_when_its_bytes_change(root: Path, counted) -> None:
    node, path = await bound_node(root)
    assert set(read_disk(node.cdi_dir, node.run_dir).holds) == {"a1", "b1"}
    counted.update(read=0, parse=0)
    again = read_disk(node.cdi_dir, node.run_dir)
    assert set(again.holds) == {"a1", "b1"}
    assert counted == {"read": 2, "parse": 0}  # just written: read again, not parsed again

    data = path.read_bytes()
    changed = data.replace(b'"rsv-a1"', b'"rsv-a9"')
    rewrite_in_place(path, data, changed)
    seen = read_disk(node.cdi_dir, node.run_dir).holds
    assert seen["a1"].reservation_id == "rsv-a9" and counted["parse"] == 1


async def test_a_settled_hold_file_is_not_read_again_until_it_changes(root: Path, counted, monkeypatch) -> None:
    monkeypatch.setattr(fsutil, "SETTLED_S", 0.0)  # every file counts as settled
    node, path = await bound_node(root)
    read_disk(node.cdi_dir, node.run_dir)
    counted.update(read=0, parse=0)
    assert set(read_disk(node.cdi_dir, node.run_dir).holds) == {"a1", "b1"}
    assert counted == {"read": 0, "parse": 0}

    # in place, same size, mtime put back: the ctime moved
    data = path.read_bytes()
    rewrite_in_place(path, data, data.replace(b'"rsv-a1"', b'"rsv-a8"'))
    assert read_disk(node.cdi_dir, node.run_dir).holds["a1"].reservation_id == "rsv-a8"
    assert counted == {"read": 1, "parse": 1}

    # replaced by rename (a new inode), same bytes as before
    tmp = path.with_name(".other")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    assert read_disk(node.cdi_dir, node.run_dir).holds["a1"].reservation_id == "rsv-a1"

    # removed: gone from the view (and from what is remembered)
    path.unlink()
    assert set(read_disk(node.cdi_dir, node.run_dir).holds) == {"b1"}
    assert "bcd-a1.json" not in observe_mod._HOLDS_READ[str(node.cdi_dir)]


async def test_a_remembered_hold_replaced_by_a_symlink_or_a_fifo_is_refused_not_served(root: Path, monkeypatch) -> None:
    monkeypatch.setattr(fsutil, "SETTLED_S", 0.0)
    node, path = await bound_node(root)
    real = root / "real.json"
    real.write_bytes(path.read_bytes())
    assert "a1" in read_disk(node.cdi_dir, node.run_dir).holds
    path.unlink()
    path.symlink_to(real)
    disk = read_disk(node.cdi_dir, node.run_dir)
    assert "a1" not in disk.holds and any(str(path) in p and "symlink" in p for p in disk.problems), disk.problems
    path.unlink()
    os.mkfifo(path)
    disk = read_disk(node.cdi_dir, node.run_dir)
    assert "a1" not in disk.holds and any(str(path) in p and "FIFO" in p for p in disk.problems), disk.problems


def test_the_vendor_spec_is_decoded_again_only_when_it_changed_and_always_seen(root: Path, monkeypatch) -> None:
    cdi = root / "cdi"
    cdi.mkdir()
    path = cdi / VENDOR_CDI_FILE
    one = b'{"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"name": "0", "containerEdits": {}}]}'
    two = one.replace(b'"0"', b'"1"')
    path.write_bytes(one)
    decoded = []
    real = holdfiles_files.vendor_cdi_from_json
    monkeypatch.setattr(holdfiles_files, "vendor_cdi_from_json", lambda data, p: decoded.append(p) or real(data, p))
    cache = VendorCache(cdi)
    assert set(cache.get().devices) == {"0"}
    assert set(cache.get().devices) == {"0"} and len(decoded) == 1  # young: read, not decoded again
    rewrite_in_place(path, one, two)
    assert set(cache.get().devices) == {"1"} and len(decoded) == 2

    monkeypatch.setattr(fsutil, "SETTLED_S", 0.0)
    cache.get()  # settled now
    reads = []
    real_read = holdfiles_files.read_vendor_cdi_bytes
    monkeypatch.setattr(holdfiles_files, "read_vendor_cdi_bytes", lambda d: reads.append(d) or real_read(d))
    assert set(cache.get().devices) == {"1"} and reads == []
    rewrite_in_place(path, two, one)
    assert set(cache.get().devices) == {"0"} and len(reads) == 1
    path.unlink()
    assert cache.get() is None
    path.symlink_to(root / "elsewhere.json")
    with pytest.raises(holdfiles.VendorSpecError):
        cache.get()


def test_observe_reads_the_vendor_spec_through_one_cache_per_cdi_dir(root: Path) -> None:
    assert vendor_cache(root) is vendor_cache(Path(str(root)))
    assert vendor_cache(root) is not vendor_cache(root / "other")
