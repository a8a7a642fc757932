"""Odd entries in the hold directories, occupied hold paths, an unreadable vendor spec (issue 11, points 3, 11, 12).

A FIFO, a symlink (to /dev/zero, to a huge file, to a real hold), a directory
or a device named like a hold file (`bcd-x.json`) or an env file (`x.env`) is
never read: observe returns at once, skips it and reports it. A hold path
occupied by something that is not a regular file keeps its bind retryable,
with a message naming the path and what is there, and no Bound is sent until
every file is in place. Every read that could block runs in a daemon thread
with a deadline, so a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.converger.observe import read_disk
from services.converger.plan import plan
from tests.blocking import within_deadline
from tests.converger_kit import GPU, Node, check_hold_invariants, fast_dir, hold, spec

G = GPU


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


async def converge(node: Node, s, fifos: tuple[Path, ...] = ()):
    """observe + plan under the deadline (a blocking read fails the test), then apply."""
    p = within_deadline(lambda: plan(s, node.observe(s), node.config), fifos)
    return p, await node.applier.apply(p, node.state)


def section(node: Node) -> dict:
    return node.outbox.of_type("section")[-1]


def plant(node: Node, tmp: Path) -> dict[str, Path]:
    """Everything odd, in both directories; returns name -> path."""
    cdi, env = node.cdi_dir, node.run_dir / "allocations"
    env.mkdir(parents=True, exist_ok=True)
    big = tmp / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse
    real = tmp / "a-real-hold.json"
    real.write_bytes((cdi / "bcd-a1.json").read_bytes())
    out = {
        "cdi-fifo": cdi / "bcd-x.json",
        "cdi-zero": cdi / "bcd-y.json",
        "cdi-big": cdi / "bcd-z.json",
        "cdi-real": cdi / "bcd-w.json",
        "cdi-dir": cdi / "bcd-d.json",
        "env-fifo": env / "x.env",
        "env-zero": env / "y.env",
        "env-big": env / "z.env",
        "env-dir": env / "d.env",
    }
    os.mkfifo(out["cdi-fifo"])
    os.mkfifo(out["env-fifo"])
    for k in ("cdi-zero", "env-zero"):
        out[k].symlink_to("/dev/zero")
    for k in ("cdi-big", "env-big"):
        out[k].symlink_to(big)
    out["cdi-real"].symlink_to(real)
    out["cdi-dir"].mkdir()
    out["env-dir"].mkdir()
    # named like our temp files, but not regular files: not ours to remove
    (cdi / ".bcd-q.json.tmp-7").mkdir()
    os.mkfifo(env / ".q.env.tmp-7")
    return out


# ---------------------------------------------------------------------------- observe


async def test_observe_skips_and_reports_entries_that_are_not_regular_files(root: Path) -> None:
    node = Node(root / "node")
    s1 = spec(1, hold("a1", G[0]))
    await node.converge(s1)
    planted = plant(node, root)
    fifos = (planted["cdi-fifo"], planted["env-fifo"], node.run_dir / "allocations" / ".q.env.tmp-7")
    warned: set[str] = set()
    disk = within_deadline(lambda: read_disk(node.cdi_dir, node.run_dir, warned=warned), fifos)
    assert set(disk.holds) == {"a1"}  # bcd-w.json (a symlink to a real hold) is not followed
    assert set(disk.env_files) == {"a1"}
    assert disk.temp_files == []
    text = "\n".join(disk.problems)
    for name, path in planted.items():
        assert str(path) in text, (name, disk.problems)
    assert "a FIFO, not a regular file" in text and "a symlink (to /dev/zero), not followed" in text
    assert "a directory, not a regular file" in text
    assert f"{node.cdi_dir / '.bcd-q.json.tmp-7'}: a directory, named like a bcd temp file: left alone" in text
    # logged once: a second read adds no warning key, and reports the same problems again
    seen = set(warned)
    again = within_deadline(lambda: read_disk(node.cdi_dir, node.run_dir, warned=warned), fifos)
    assert warned == seen and again.problems == disk.problems

    # the pass neither blocks nor touches them; the held hold stays converged
    p, r = await converge(node, s1, fifos)
    assert p.steps == () and not r.errors
    for path in planted.values():
        assert os.path.lexists(path)


async def test_a_fifo_named_like_a_wanted_hold_keeps_the_bind_retryable(root: Path) -> None:
    node = Node(root / "node")
    fifo = node.cdi_dir / "bcd-x.json"
    os.mkfifo(fifo)
    s1 = spec(1, hold("x", G[0]), hold("b1", G[1]))
    p, r = await converge(node, s1, (fifo,))
    assert r.retry
    assert any(f"cannot write {fifo}: a FIFO is in the way" in e for e in r.errors), r.errors
    assert node.outbox.ids("bound") == ["node-1.b1.bound.g1"]  # the other hold is bound anyway
    assert section(node)["state"] == "PROGRESSING" and str(fifo) in section(node)["message"]
    assert fifo.exists() and not fifo.is_file()  # left alone

    fifo.unlink()
    p, r = await converge(node, s1)
    assert not r.errors, r.errors
    assert sorted(node.outbox.ids("bound")) == ["node-1.b1.bound.g1", "node-1.x.bound.g1"]
    assert section(node)["state"] == "CONVERGED"
    check_hold_invariants(node)


# ---------------------------------------------------------------------------- the env path occupied


def occupy(path: Path, what: str) -> str:
    """Put a directory (with a file of its owner inside) or a FIFO at `path`; returns what the message names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "directory":
        path.mkdir()
        (path / "theirs").write_text("keep me")
        return "a directory"
    os.mkfifo(path)
    return "a FIFO"


def vacate(path: Path, what: str) -> None:
    if what == "directory":
        assert (path / "theirs").read_text() == "keep me"  # never removed by bcd
        (path / "theirs").unlink()
        path.rmdir()
    else:
        assert path.is_fifo()
        path.unlink()


class CrashAt(Exception):
    pass


def crash_at(point: str) -> Callable[[str], None]:
    def hook(name: str) -> None:
        if name == point:
            raise CrashAt(point)

    return hook


@pytest.mark.parametrize("what", ["directory", "fifo"])
async def test_an_occupied_env_path_sends_no_bound_until_the_env_file_is_in_place(root: Path, what: str) -> None:
    node = Node(root / "node")
    env_dir = node.run_dir / "allocations"
    env = env_dir / "a1.env"
    kind = occupy(env, what)
    s1 = spec(1, hold("a1", G[0], cpus="0-1", memory_bytes=1 << 30))
    fifos = (env,) if what == "fifo" else ()

    # twice: the env file cannot be written; no Bound, retryable, said why; no temp
    # file left behind, and no CDI spec left without its env file
    for _ in range(2):
        p, r = await converge(node, s1, fifos)
        assert p.kinds() == ["BindHold"]
        assert r.retry
        assert any(f"cannot write {env}: {kind} is in the way" in e for e in r.errors), r.errors
        assert node.outbox.ids("bound") == []
        assert section(node)["state"] == "PROGRESSING"
        assert f"{env}: {kind} is in the way" in section(node)["message"]
        assert [x.name for x in env_dir.iterdir()] == ["a1.env"]
        assert node.holds() == {}
        assert "a1" in node.state.intents  # journaled: the next pass tries again

    # removed by its owner: the next pass binds, once
    vacate(env, what)
    p, r = await converge(node, s1)
    assert not r.errors, r.errors
    assert node.outbox.ids("bound") == ["node-1.a1.bound.g1"]
    assert "BCD_ALLOCATION_ID=a1" in (node.env("a1") or "")
    assert section(node)["state"] == "CONVERGED"
    assert node.plan(s1).steps == ()
    check_hold_invariants(node)


@pytest.mark.parametrize("what", ["directory", "fifo"])
async def test_a_kept_hold_whose_env_file_cannot_be_written_is_not_reported_bound(root: Path, what: str) -> None:
    """A crash right after the CDI spec landed: the next pass keeps the hold and plans
    WriteEnv then ReportBound; with the env path occupied, that Bound must not go."""
    node = Node(root / "node", crash=crash_at("bind.cdi-written"))
    s1 = spec(1, hold("a1", G[0]))
    with pytest.raises(CrashAt):
        await node.converge(s1)
    node = node.restart()
    env = node.run_dir / "allocations" / "a1.env"
    kind = occupy(env, what)
    fifos = (env,) if what == "fifo" else ()

    p, r = await converge(node, s1, fifos)
    assert p.kinds() == ["WriteEnv", "WriteConsumer", "ReportBound"]
    assert any(f"cannot write {env}: {kind} is in the way" in e for e in r.errors), r.errors
    assert any("a1: Bound not reported in this pass: its files are not all in place" in e for e in r.errors), r.errors
    assert node.outbox.ids("bound") == []
    assert section(node)["state"] == "PROGRESSING"
    assert set(node.holds()) == {"a1"}  # kept as it was

    vacate(env, what)
    p, r = await converge(node, s1)
    assert not r.errors, r.errors
    assert node.outbox.ids("bound") == ["node-1.a1.bound.g1"]
    assert section(node)["state"] == "CONVERGED"
    check_hold_invariants(node)


# ---------------------------------------------------------------------------- the vendor spec


@pytest.mark.parametrize("what", ["garbage", "fifo", "symlink-to-dev-zero"])
async def test_an_unreadable_vendor_spec_keeps_new_holds_retryable_and_says_why(root: Path, what: str) -> None:
    """No Bound for a hold whose CDI spec could not copy the vendor's edits; bound once it reads."""
    node = Node(root / "node")
    vendor = node.cdi_dir / "nvidia.json"
    vendor.unlink()
    if what == "garbage":
        vendor.write_text("{not json")
        why = "not valid JSON"
    elif what == "fifo":
        os.mkfifo(vendor)
        why = "a FIFO"
    else:
        vendor.symlink_to("/dev/zero")
        why = "a symlink (to /dev/zero)"
    s1 = spec(1, hold("a1", G[0]))
    p, r = await converge(node, s1, (vendor,) if what == "fifo" else ())
    assert r.retry
    assert any("vendor CDI spec unreadable" in e and str(vendor) in e and why in e for e in r.errors), r.errors
    assert node.outbox.ids("bound") == [] and node.holds() == {}
    assert section(node)["state"] == "PROGRESSING"

    vendor.unlink()
    node.adapter.write_cdi_spec()
    p, r = await converge(node, s1)
    assert not r.errors, r.errors
    assert node.outbox.ids("bound") == ["node-1.a1.bound.g1"]
    # the vendor's edits are in the hold
    assert "deviceNodes" in str(node.holds()["a1"])


def test_status_problems_stay_within_their_bound() -> None:
    import msgspec

    from services.converger.endpoints import bounded_problems
    from shared.schemas import CONVERGER_STATUS_CODEC, BadMessage, ConvergerStatus
    from shared.schemas.bus import PROBLEMS_MAX
    from shared.schemas.common import TEXT_MAX

    many = [f"/etc/cdi/bcd-{i}.json: a FIFO, not a regular file: skipped, not a hold" + "x" * 5000 for i in range(100)]
    out = bounded_problems(many)
    assert len(out) == PROBLEMS_MAX and out[-1] == f"... and {100 - PROBLEMS_MAX + 1} more"
    assert all(len(p) <= TEXT_MAX for p in out)
    st = ConvergerStatus(problems=out)
    assert CONVERGER_STATUS_CODEC.decode(CONVERGER_STATUS_CODEC.encode(st)) == st
    with pytest.raises(BadMessage):
        CONVERGER_STATUS_CODEC.decode(msgspec.json.encode(ConvergerStatus(problems=["p"] * (PROBLEMS_MAX + 1))))


# ---------------------------------------------------------------------------- the consumer copy's path occupied


@pytest.mark.parametrize("what", ["directory", "fifo"])
async def test_an_occupied_consumer_copy_path_sends_no_bound_and_is_left_alone(root: Path, what: str) -> None:
    """A FIFO or a directory named like a hold's consumer copy (`<consumer_dir>/bcd-a1.json`): the
    pass never blocks on it, the bind stays retryable with the path named, no Bound goes, and the
    entry is never removed; once it is gone the hold binds with one Bound."""
    node = Node(root / "node")
    copy = node.consumer_dir / "bcd-a1.json"
    kind = occupy(copy, what)
    fifos = (copy,) if what == "fifo" else ()
    s1 = spec(1, hold("a1", G[0]), hold("b1", G[1]))
    disk = within_deadline(lambda: read_disk(node.cdi_dir, node.run_dir, consumer_dir=node.consumer_dir), fifos)
    assert any(str(copy) in p for p in disk.problems), disk.problems
    p, r = await converge(node, s1, fifos)
    assert r.retry
    assert any(f"cannot write {copy}: {kind} is in the way" in e for e in r.errors), r.errors
    assert node.outbox.ids("bound") == ["node-1.b1.bound.g1"]
    # the hold spec of the bind that failed half-way went with it: nothing a runtime could use
    assert "a1" not in node.holds()
    p, r = await converge(node, s1, fifos)  # the next pass neither blocks nor removes it
    assert r.retry and node.outbox.ids("bound") == ["node-1.b1.bound.g1"]
    vacate(copy, what)
    p, r = await converge(node, s1)
    assert not r.errors, r.errors
    assert sorted(node.outbox.ids("bound")) == ["node-1.a1.bound.g1", "node-1.b1.bound.g1"]
    check_hold_invariants(node)
