"""Holds bound by an earlier bcd under the legacy slice name (`bcd-alloc-train\\x2d01.slice`,
systemd-escape's spelling of a '-') survive the rename to `bcd-alloc-train.01.slice`.

Such a hold is recognised (parse_hold), kept untouched while a workload runs in its
slice and every file is there, rewritten under the new name (slice, CDI spec, env file,
no second Bound) once its slice is empty or missing or a file of it must be written
again, and released with its old slice stopped once empty.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.converger.model import BindHold, StopSlice
from shared.holdfiles import consumer_spec
from shared.slices import legacy_slice_name, slice_name

from tests.converger_kit import GPU, Node, check_hold_invariants, fast_dir, hold, spec

ALLOC = "train-01"
NEW, OLD = slice_name(ALLOC), legacy_slice_name(ALLOC)
GIB = 1 << 30


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


def wanted(gen: int = 1):
    return spec(gen, hold(ALLOC, GPU[0], cpus="0-3", memory_bytes=GIB))


async def legacy_node(root: Path, *, pids: list[int]) -> Node:
    """A node whose hold of train-01 looks exactly as the previous bcd left it."""
    node = Node(root)
    await node.converge(wanted())
    assert NEW in node.holds()[ALLOC]["annotations"].values()
    cdi = node.cdi_dir / f"bcd-{ALLOC}.json"
    cdi.write_text(cdi.read_text().replace(NEW, OLD.replace("\\", "\\\\")))
    env = node.run_dir / "allocations" / f"{ALLOC}.env"
    env.write_text(env.read_text().replace(NEW, OLD))
    record = json.loads(node.slices.path(ALLOC).read_text())
    node.slices.path(ALLOC).unlink()
    (node.slices.dir / f"{OLD}.json").write_text(json.dumps({**record, "name": OLD, "pids": pids}))
    # that bcd wrote no consumer copies either
    (node.consumer_dir / f"bcd-{ALLOC}.json").unlink()
    # nor a record of what it wrote (ConvergerState.written): its files are taken as found
    node.state.written.clear()
    node.store.save(node.state)
    node = node.restart()  # the new bcd starts
    assert node.holds()[ALLOC]["annotations"]["bcd.dev/cgroup-parent"] == OLD
    return node


def bound_ids(node: Node) -> list[str]:
    return node.outbox.ids("bound")


async def test_a_legacy_hold_with_a_busy_slice_is_kept_untouched(root: Path) -> None:
    node = await legacy_node(root, pids=[4242])
    p = node.plan(wanted())
    # only the consumer copy the older bcd never wrote is added, made from the hold spec as it is
    assert p.kinds() == ["WriteConsumer"]
    _, result = await node.converge(wanted())
    assert not result.errors
    assert node.consumer_copies()[ALLOC] == consumer_spec(node.holds()[ALLOC])
    assert f"BCD_CGROUP_PARENT={OLD}" in node.consumer_copies()[ALLOC]["containerEdits"]["env"]
    assert node.plan(wanted()).steps == ()
    assert node.slice_names() == [ALLOC]  # its old slice counts as its slice
    assert f"BCD_CGROUP_PARENT={OLD}\n" in node.env(ALLOC)


async def test_a_legacy_hold_is_renamed_once_its_slice_is_empty(root: Path) -> None:
    node = await legacy_node(root, pids=[4242])
    node.slices.set_pids(ALLOC, [])
    p, result = await node.converge(wanted())
    assert [type(s) for s in p.steps] == [StopSlice, BindHold] and not p.steps[1].report
    assert result.errors == []
    ann = node.holds()[ALLOC]["annotations"]
    assert ann["bcd.dev/cgroup-parent"] == NEW
    assert f"BCD_CGROUP_PARENT={NEW}\n" in node.env(ALLOC) and "\\" not in node.env(ALLOC)
    assert sorted(p.name for p in node.slices.dir.iterdir()) == [f"{NEW}.json"]
    assert node.slices.properties(ALLOC)["MemoryMax"] == GIB
    assert bound_ids(node) == [f"node-1.{ALLOC}.bound.g1"]  # not reported again
    assert node.plan(wanted()).steps == ()
    check_hold_invariants(node)


async def test_after_a_reboot_a_legacy_hold_comes_back_under_the_new_name(root: Path) -> None:
    node = await legacy_node(root, pids=[])
    # a reboot: /run is tmpfs (env files and fake slices gone), the CDI spec stays
    (node.run_dir / "allocations" / f"{ALLOC}.env").unlink()
    (node.slices.dir / f"{OLD}.json").unlink()
    node = node.restart(boot_id="boot-2")
    _, result = await node.converge(wanted())
    assert result.errors == []
    assert node.holds()[ALLOC]["annotations"]["bcd.dev/cgroup-parent"] == NEW
    assert f"BCD_CGROUP_PARENT={NEW}\n" in node.env(ALLOC)
    assert node.slices.exists(ALLOC) and node.slices.path(ALLOC).exists()
    assert bound_ids(node) == [f"node-1.{ALLOC}.bound.g1"]
    assert node.plan(wanted()).steps == ()


async def test_a_legacy_hold_is_released_and_its_busy_slice_stopped_once_empty(root: Path) -> None:
    node = await legacy_node(root, pids=[4242])
    _, result = await node.converge(spec(2))
    assert result.errors == []
    assert ALLOC not in node.holds() and node.env(ALLOC) is None
    assert node.outbox.ids("released") == [f"node-1.{ALLOC}.released.g2"]
    assert node.slice_names() == [ALLOC]  # a workload still runs in the old slice
    node.slices.set_pids(ALLOC, [])
    await node.converge(spec(2))
    assert node.slice_names() == [] and list(node.slices.dir.iterdir()) == []
