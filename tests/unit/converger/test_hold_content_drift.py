"""Drift by content (issue 41.1): a hold file edited from outside that still parses is put back.

Before, only a missing or garbled file was drift: `sed -i` of the env file's GPU
uuid, or the hold spec edited to NVIDIA_VISIBLE_DEVICES=all and another device
node, stayed edited (status clean, the consumer copy even rewritten from the
edited spec), so a container got every GPU. Now what bcd wrote is journaled
(ConvergerState.written, before the files) and each pass compares the disk with
it: an edit is a DRIFT line until the pass puts the file back byte for byte,
unreported, counted per file; a restart does not adopt the edit.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.converger.drift import journal_disagreements
from services.converger.holddirs import HoldDirs
from shared.holddisk import read_disk
from shared.schemas import Limits

from tests.converger_kit import GPU, Node, fast_dir, hold, spec

G = GPU
S = spec(1, hold("a1", G[0]), hold("a2", G[1], cpus="0-1", memory_bytes=1 << 30))


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


def _files(node: Node) -> dict[Path, bytes]:
    paths = [node.cdi_dir / "bcd-a1.json", node.consumer_dir / "bcd-a1.json", node.run_dir / "allocations" / "a2.env", node.run_dir / "allocations" / "a1.env"]
    return {p: p.read_bytes() for p in paths}


def _edit(node: Node) -> None:
    spec_file = node.cdi_dir / "bcd-a1.json"
    text = spec_file.read_text()
    assert f"NVIDIA_VISIBLE_DEVICES={G[0]}" in text
    spec_file.write_text(text.replace(f"NVIDIA_VISIBLE_DEVICES={G[0]}", "NVIDIA_VISIBLE_DEVICES=all").replace("/dev/nvidia0", "/dev/nvidia3"))
    env = node.run_dir / "allocations" / "a2.env"
    env.write_text(env.read_text().replace(G[1], G[3]))


def _drift(node: Node) -> list[str]:
    disk = read_disk(node.cdi_dir, node.run_dir, warned=set(), consumer_dir=node.consumer_dir)
    return journal_disagreements(node.state, disk)


@pytest.mark.parametrize("restart", [False, True], ids=["same-process", "after-a-restart"])
async def test_an_edit_that_still_parses_is_drift_and_put_back_byte_for_byte(root: Path, restart: bool) -> None:
    node = Node(root)
    _, r = await node.converge(S)
    assert not r.errors
    before = _files(node)
    bound = node.outbox.ids("bound")
    _edit(node)
    if restart:
        node = node.restart()  # what bcd wrote is in the journal: the edit is not adopted
    assert _drift(node) == [
        "a1: its CDI spec bcd-a1.json is not what bcd wrote (edited from outside): put back by the next pass",
        "a2: its env file is not what bcd wrote (edited from outside): put back by the next pass",
    ]
    counted: list[str] = []
    node.applier.count_drift = counted.append
    p, r = await node.converge(S)
    assert not r.errors, r.errors
    assert p.kinds() == ["RestoreHold", "RestoreHold"]
    assert sorted(counted) == ["allocation-env", "cdi"]
    assert _files(node) == before  # byte for byte, the consumer copy never made from the edit
    assert _drift(node) == []
    assert node.outbox.ids("bound") == bound and node.outbox.ids("released") == []
    assert node.plan(S).steps == ()


async def test_an_edited_device_annotation_is_not_taken_as_the_hold(root: Path) -> None:
    """The record, not the edited spec, decides: no release of the edited devices, no second Bound."""
    node = Node(root)
    await node.converge(S)
    before = _files(node)
    spec_file = node.cdi_dir / "bcd-a1.json"
    spec_file.write_text(spec_file.read_text().replace(f'"bcd.dev/device-id": "{G[0]}"', f'"bcd.dev/device-id": "{G[3]}"'))
    assert node.holds()["a1"]["devices"][0]["annotations"]["bcd.dev/device-id"] == G[3]
    p, r = await node.converge(S)
    assert not r.errors and p.kinds() == ["RestoreHold"]
    assert _files(node) == before
    assert node.outbox.ids("released") == [] and len(node.outbox.ids("bound")) == 2


async def test_an_edited_consumer_copy_is_counted_as_drift(root: Path) -> None:
    node = Node(root)
    await node.converge(S)
    copy = node.consumer_dir / "bcd-a1.json"
    saved = copy.read_bytes()
    copy.write_text(copy.read_text().replace("NVIDIA_VISIBLE_DEVICES=", "NVIDIA_VISIBLE_DEVICES=all,", 1))
    counted: list[str] = []
    node.applier.count_drift = counted.append
    p, r = await node.converge(S)
    assert not r.errors and p.kinds() == ["WriteConsumer"]
    assert counted == ["cdi-consumer"] and copy.read_bytes() == saved


async def test_a_released_hold_leaves_no_record(root: Path) -> None:
    node = Node(root)
    await node.converge(S)
    assert set(node.state.written) == {"a1", "a2"}
    await node.converge(spec(2, hold("a2", G[1], cpus="0-1", memory_bytes=1 << 30)))
    assert set(node.state.written) == {"a2"}


# ---------------------------------------------------------------- the hold's slice (issue 41.1, the part left)


def _slice_drift(node: Node) -> list[str]:
    """What `bcd status` says of the journal against the disk and the slices, as the endpoint reads them."""
    disk = read_disk(node.cdi_dir, node.run_dir, warned=set(), consumer_dir=node.consumer_dir)
    dirs = HoldDirs(node.cdi_dir, node.run_dir, node.consumer_dir, node.slices)
    return journal_disagreements(node.state, disk, {}, dirs.slices_now(sorted(node.state.written)))


@pytest.mark.parametrize("restart", [False, True], ids=["same-process", "after-a-restart"])
async def test_a_slice_changed_from_outside_is_drift_and_put_back(root: Path, restart: bool) -> None:
    """Before, a slice was only checked for existence: MemoryMax raised in its record stayed raised."""
    node = Node(root)
    await node.converge(S)
    record = node.slices.path("a2")
    saved = record.read_bytes()
    bound = node.outbox.ids("bound")
    doc = json.loads(saved)
    doc["properties"]["MemoryMax"] = 64 << 30
    doc["properties"].pop("AllowedCPUs")
    record.write_text(json.dumps(doc))
    if restart:
        node = node.restart()
    assert _slice_drift(node) == [
        "a2: its slice bcd-alloc-a2.slice is not what bcd made (AllowedCPUs, MemoryMax): put back by the next pass"
    ]
    counted: list[str] = []
    node.applier.count_drift = counted.append
    p, r = await node.converge(S)
    assert not r.errors, r.errors
    assert [(type(s).__name__, getattr(s, "drifted", None)) for s in p.steps] == [("EnsureSlice", ("AllowedCPUs", "MemoryMax"))]
    assert counted == ["slice"]
    assert record.read_bytes() == saved  # byte for byte: the same limits render the same record
    assert _slice_drift(node) == []
    assert node.outbox.ids("bound") == bound and node.outbox.ids("released") == []
    assert node.plan(S).steps == ()


async def test_a_garbled_slice_record_is_written_again_not_retried_forever(root: Path) -> None:
    """Before, a record that did not read made every pass see no slice at all and fail its EnsureSlice."""
    node = Node(root)
    await node.converge(S)
    record = node.slices.path("a2")
    saved = record.read_bytes()
    record.write_text('{"properties": ')
    assert _slice_drift(node) == ["a2: its slice bcd-alloc-a2.slice is not what bcd made (unreadable): put back by the next pass"]
    p, r = await node.converge(S)
    assert not r.errors, r.errors
    assert p.kinds() == ["EnsureSlice"]
    assert record.read_bytes() == saved
    assert node.plan(S).steps == ()


async def test_a_missing_slice_is_shown_until_made_again(root: Path) -> None:
    node = Node(root)
    await node.converge(S)
    node.slices.path("a2").unlink()
    assert _slice_drift(node) == ["a2: bound, but its slice bcd-alloc-a2.slice is not in place: put back by the next pass"]
    p, r = await node.converge(S)
    assert not r.errors and p.kinds() == ["EnsureSlice"]
    assert _slice_drift(node) == []


def test_the_hold_dir_watch_sees_a_fake_slice_record_edited(root: Path) -> None:
    """An edit of `<run_dir>/slices/bcd-alloc-<id>.slice.json` wakes a pass within seconds, not at the 10-minute pass."""
    node = Node(root)
    node.slices.apply("a2", Limits(memory_bytes=1 << 30))
    dirs = HoldDirs(node.cdi_dir, node.run_dir, node.consumer_dir)
    before = dirs.signature()
    record = node.slices.path("a2")
    record.write_text(record.read_text().replace(str(1 << 30), str(2 << 30)))
    assert dirs.signature() != before
