"""apply(), through the in-process kit: retryable faults, release-before-bind,
crash points modelled in process, and a reboot.

Every fault here is retryable: no Bound/Released for the step that failed,
the section reads PROGRESSING, and once the fault clears the next pass
converges with exactly one Bound per bind (by event id). The real kill -9
tests are integration tests; here a crash hook raises at each named crash
point and a fresh Node (state from disk, the same durable outbox) carries on.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.converger.crash import BIND_POINTS, CRASH_POINTS, RELEASE_POINTS
from services.converger.hostwriter import HostWriteError, LocalHostWriter
from shared.schemas import NodeSpec

from tests.converger_kit import GPU, FaultyWriter, Node, check_hold_invariants, fast_dir, files_match, hold, spec

G = GPU
GIB = 1 << 30


@pytest.fixture
def root() -> Iterator[Path]:
    """A scratch directory, on tmpfs where there is one (every write is fsynced)."""
    with fast_dir() as d:
        yield d


def faulty(node: Node) -> FaultyWriter:
    w = FaultyWriter(node.writer)
    node.applier.writer = w  # type: ignore[assignment]
    return w


def section(node: Node) -> dict:
    return node.outbox.of_type("section")[-1]


S1 = spec(1, hold("a1", G[0], cpus="0-3", memory_bytes=4 * GIB), hold("a2", f"{G[6]}/gi1/ci0"), hold("a3", f"{G[4]}/slot0", f"{G[4]}/slot1"))
BOUND_S1 = ["node-1.a1.bound.g1", "node-1.a2.bound.g1", "node-1.a3.bound.g1"]


def assert_converged_s1(node: Node) -> None:
    assert set(node.holds()) == {"a1", "a2", "a3"}
    assert all(node.env(a) for a in ("a1", "a2", "a3"))
    assert node.slice_names() == ["a1"]
    assert sorted(node.outbox.ids("bound")) == BOUND_S1
    assert section(node)["state"] == "CONVERGED"
    assert node.plan(S1).steps == ()
    check_hold_invariants(node)


# ------------------------------------------------------------------------------ write failures


@pytest.mark.parametrize("method", ["apply_slice", "write_cdi", "write_env"])
async def test_a_failed_write_is_retryable(root: Path, method: str) -> None:
    node = Node(root)
    w = faulty(node)
    w.fail = {method}
    p, r = await node.converge(S1)
    assert r.retry
    assert any("injected failure" in e for e in r.errors)
    # no Bound for a bind whose files are not all in place
    failed_allocs = {"a1"} if method == "apply_slice" else {"a1", "a2", "a3"}
    bound = {i.split(".")[1] for i in node.outbox.ids("bound")}
    assert not bound & failed_allocs
    assert section(node)["state"] == "PROGRESSING"
    assert section(node)["observed_generation"] == 1

    w.fail = set()
    p, r = await node.converge(S1)
    assert not r.errors, r.errors
    assert_converged_s1(node)
    assert node.outbox.sends == len(node.outbox.events)  # nothing sent twice


async def test_a_write_failure_root_cannot_bypass(root: Path) -> None:
    """A CDI dir below a regular file: ENOTDIR/EEXIST even for root."""
    node = Node(root / "node")
    blocker = root / "blocker"
    blocker.write_text("a regular file")
    bad = LocalHostWriter(blocker / "cdi", node.run_dir, node.slices)
    node.applier.writer = bad
    p, r = await node.converge(S1)
    assert r.retry
    assert all("cannot write" in e or "vendor CDI spec" in e for e in r.errors), r.errors
    assert node.outbox.ids("bound") == []
    assert section(node)["state"] == "PROGRESSING"
    assert node.holds() == {}

    node.applier.writer = node.writer
    p, r = await node.converge(S1)
    assert not r.errors, r.errors
    assert_converged_s1(node)


@pytest.mark.parametrize("what", ["signer", "outbox-publish"])
async def test_unreachable_signer_or_outbox_after_the_files_is_retryable(root: Path, what: str, monkeypatch) -> None:
    """The files are in place and the Bound cannot be signed or published."""
    node = Node(root)
    if what == "signer":
        node.signer.fail = True
    else:
        # the outbox answered "room" and then dropped the publish
        async def room() -> bool:
            return True

        monkeypatch.setattr(node.outbox, "has_room", room)
        node.outbox.fail = True
    p, r = await node.converge(S1)
    assert r.retry and len(r.errors) >= 3
    assert node.outbox.ids("bound") == []
    assert set(node.holds()) == {"a1", "a2", "a3"}
    if what == "signer":
        assert section(node)["state"] == "PROGRESSING"
    else:
        assert node.outbox.ids("section") == []
    # still unreachable: still retrying, still nothing sent for the holds
    p, r = await node.converge(S1)
    assert p.kinds() == ["ReportBound"] * 3 and r.retry
    assert node.outbox.ids("bound") == []

    node.signer.fail = node.outbox.fail = False
    p, r = await node.converge(S1)
    assert p.kinds() == ["ReportBound"] * 3
    assert not r.errors, r.errors
    assert_converged_s1(node)


async def test_unreachable_outbox_holds_back_binds(root: Path) -> None:
    node = Node(root)
    node.outbox.fail = True
    p, r = await node.converge(S1)
    assert p.kinds() == ["BindHold"] * 3 and r.retry
    assert node.holds() == {} and node.outbox.ids("bound") == [] and node.outbox.ids("section") == []
    node.outbox.fail = False
    p, r = await node.converge(S1)
    assert not r.errors, r.errors
    assert_converged_s1(node)


async def test_outbox_unreachable_for_failures_and_releases(root: Path) -> None:
    node = Node(root)
    await node.converge(S1)
    node.outbox.fail = True  # no binds in s2: releases and failure reports still try
    s2 = spec(2, hold("a2", f"{G[6]}/gi1/ci0"), hold("x1", "disk/sda"))
    p, r = await node.converge(s2)
    assert r.retry
    assert node.outbox.ids("released") == [] and node.outbox.ids("failed") == []
    # the files are gone, the release stays journaled with its event id
    assert set(node.holds()) == {"a2"}
    assert set(node.state.intents) == {"a1", "a3"}
    node.outbox.fail = False
    p, r = await node.converge(s2)
    assert not r.errors, r.errors
    assert sorted(node.outbox.ids("released")) == ["node-1.a1.released.g2", "node-1.a3.released.g2"]
    assert node.outbox.ids("failed") == ["node-1.x1.failed.g2"]
    assert section(node)["state"] == "FAILED"
    assert node.plan(s2).steps == ()
    check_hold_invariants(node)


async def test_a_failed_release_blocks_the_binds_of_the_pass(root: Path) -> None:
    node = Node(root)
    await node.converge(spec(1, hold("a1", G[0])))
    w = faulty(node)
    w.fail = {"remove_cdi"}
    s2 = spec(2, hold("b1", G[0]), hold("c1", G[1]))
    p, r = await node.converge(s2)
    assert p.kinds() == ["ReleaseHold", "BindHold", "BindHold"]
    assert r.retry
    assert "b1: not bound in this pass: a release before it failed" in r.errors
    assert "c1: not bound in this pass: a release before it failed" in r.errors
    assert set(node.holds()) == {"a1"}
    assert node.outbox.ids("released") == [] and node.outbox.ids("bound") == ["node-1.a1.bound.g1"]
    assert section(node)["state"] == "PROGRESSING"
    assert "write_cdi" not in w.calls

    w.fail = set()
    p, r = await node.converge(s2)
    assert not r.errors, r.errors
    assert set(node.holds()) == {"b1", "c1"}
    assert node.outbox.ids("released") == ["node-1.a1.released.g2"]
    # c1 takes no card a1 frees: it goes in the Released's wave; b1 (a1's card) after it is acked
    assert node.outbox.ids("bound") == ["node-1.a1.bound.g1", "node-1.c1.bound.g2", "node-1.b1.bound.g2"]
    waves = node.outbox.wave_ids  # type: ignore[attr-defined]
    k = waves.index(["node-1.a1.released.g2", "node-1.c1.bound.g2"])
    assert waves[k + 1] == ["node-1.b1.bound.g2"]
    check_hold_invariants(node)


async def test_a_failed_slice_stop_on_release_is_retried(root: Path) -> None:
    node = Node(root)
    await node.converge(spec(1, hold("a1", G[0], cpus="0-3")))
    w = faulty(node)
    w.fail = {"stop_slice"}
    p, r = await node.converge(spec(2))
    assert r.retry and node.outbox.ids("released") == []
    w.fail = set()
    p, r = await node.converge(spec(2))
    assert not r.errors
    assert node.outbox.ids("released") == ["node-1.a1.released.g2"]
    assert node.slice_names() == [] and node.holds() == {}


# ------------------------------------------------------------------------------ crash points


class Crash(BaseException):
    """Stands for kill -9: nothing in the converger may catch it."""


def crash_at(point: str, nth: int = 1):  # noqa: ANN201
    left = [nth]
    hit: list[str] = []

    def hook(name: str) -> None:
        assert name in CRASH_POINTS, name
        hit.append(name)
        if name == point:
            left[0] -= 1
            if left[0] == 0:
                raise Crash(point)

    hook.hit = hit  # type: ignore[attr-defined]
    return hook


# gen 1: r1 (sliced, released in gen 2) and k1 (kept throughout)
GEN1 = spec(1, hold("r1", G[1], cpus="4-5", memory_bytes=GIB), hold("k1", G[2]))
# gen 2: r1 released; b1 takes its GPU (sliced: passes bind.slice-applied); b2 a slot
GEN2 = spec(2, hold("k1", G[2]), hold("b1", G[1], cpus="0-3", memory_bytes=2 * GIB), hold("b2", f"{G[4]}/slot0"))


async def test_every_crash_point_is_reached_by_the_scenario(root: Path) -> None:
    """Guard for the parametrization below: the scenario passes every crash point."""
    hook = crash_at("none")
    node = Node(root, crash=hook)
    await node.converge(GEN1)
    await node.converge(GEN2)
    assert set(hook.hit) == set(CRASH_POINTS)  # type: ignore[attr-defined]


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_crash_then_restart_converges_exactly_once(root: Path, point: str) -> None:
    node = Node(root)
    p, r = await node.converge(GEN1)
    assert not r.errors
    node = node.restart(crash=crash_at(point))
    with pytest.raises(Crash):
        await node.converge(GEN2)
    check_hold_invariants(node, reported=False, settled=False)

    node = node.restart()  # a fresh process: state from disk, same outbox and key
    p, r = await node.converge(GEN2)
    assert not r.errors, r.errors
    files_match(node, GEN2)
    assert node.plan(GEN2).steps == ()
    live = check_hold_invariants(node)
    assert live == {"k1": "node-1.k1.bound.g1", "b1": "node-1.b1.bound.g2", "b2": "node-1.b2.bound.g2"}
    assert node.outbox.ids("released") == ["node-1.r1.released.g2"]
    assert sorted(node.outbox.ids("bound")) == ["node-1.b1.bound.g2", "node-1.b2.bound.g2", "node-1.k1.bound.g1", "node-1.r1.bound.g1"]

    # and everything can still be released exactly once
    p, r = await node.converge(spec(3))
    assert not r.errors
    files_match(node, spec(3))
    assert check_hold_invariants(node) == {}
    assert sorted(node.outbox.ids("released")) == [
        "node-1.b1.released.g3", "node-1.b2.released.g3", "node-1.k1.released.g3", "node-1.r1.released.g2",
    ]  # fmt: skip


@pytest.mark.parametrize("point", BIND_POINTS)
async def test_crash_in_a_bind_then_the_spec_drops_it(root: Path, point: str) -> None:
    """The interrupted bind is no longer wanted after the restart: upstream ends
    with neither its Bound nor a Released, or with both - never one alone."""
    node = Node(root)
    await node.converge(GEN1)
    node = node.restart(crash=crash_at(point))
    with pytest.raises(Crash):
        await node.converge(GEN2)
    node = node.restart()
    gen3 = spec(3, hold("k1", G[2]))
    p, r = await node.converge(gen3)
    assert not r.errors, r.errors
    files_match(node, gen3)
    assert node.plan(gen3).steps == ()
    assert check_hold_invariants(node) == {"k1": "node-1.k1.bound.g1"}
    assert node.state.intents == {}


@pytest.mark.parametrize("point", RELEASE_POINTS)
async def test_crash_in_a_release_then_the_spec_wants_it_again(root: Path, point: str) -> None:
    node = Node(root)
    await node.converge(GEN1)
    node = node.restart(crash=crash_at(point))
    with pytest.raises(Crash):
        await node.converge(spec(2, hold("k1", G[2])))
    node = node.restart()
    gen3 = spec(3, hold("k1", G[2]), hold("r1", G[1], cpus="4-5", memory_bytes=GIB))
    p, r = await node.converge(gen3)
    assert not r.errors, r.errors
    files_match(node, gen3)
    assert node.plan(gen3).steps == ()
    live = check_hold_invariants(node)
    # the started release finishes under its own id, then r1 is bound anew
    assert node.outbox.ids("released") == ["node-1.r1.released.g2"]
    assert live == {"k1": "node-1.k1.bound.g1", "r1": "node-1.r1.bound.g3"}


@pytest.mark.parametrize("point", ["bind.intent-recorded", "bind.slice-applied", "bind.cdi-temp-written"])
async def test_crash_before_the_cdi_spec_then_the_bind_fails_its_checks(root: Path, point: str) -> None:
    """An interrupted bind whose retry is refused leaves no journal entry and no slice behind."""
    from shared.schemas import InstanceGpus

    node = Node(root, crash=crash_at(point))
    b1 = hold("b1", G[1], cpus="0-1", memory_bytes=GIB)
    with pytest.raises(Crash):
        await node.converge(spec(1, b1))
    node = node.restart()
    assert "b1" in node.state.intents
    # generation 2: a VM now claims b1's GPU, so the bind is refused
    gen2 = spec(2, b1, instances=[InstanceGpus(instance_id="vm-1", gpus=["0000:2a:00.0"])])
    p, r = await node.converge(gen2)
    assert not r.errors, r.errors
    temp = ["RemoveTemp"] if point == "bind.cdi-temp-written" else []
    # the undo frees the card in this pass, so the VM's switch follows it
    assert p.kinds() == [*temp, "ReleaseHold", "ReportFailed", "SwitchGpu"]
    assert node.switcher.asked == [("0000:2a:00.0", "vfio-pci")]
    assert [f.reason for f in p.failures] == ["overlap"]
    assert node.state.intents == {} and node.store.load().intents == {}
    assert node.slice_names() == [] and node.holds() == {}
    assert node.outbox.ids("bound") == [] and node.outbox.ids("released") == []
    assert node.plan(gen2).steps == ()
    check_hold_invariants(node)


async def test_crash_twice_at_the_same_point(root: Path) -> None:
    node = Node(root, crash=crash_at("bind.env-written"))
    with pytest.raises(Crash):
        await node.converge(GEN1)
    node = node.restart(crash=crash_at("bind.signed"))
    with pytest.raises(Crash):
        await node.converge(GEN1)
    node = node.restart()
    p, r = await node.converge(GEN1)
    assert not r.errors
    files_match(node, GEN1)
    assert sorted(node.outbox.ids("bound")) == ["node-1.k1.bound.g1", "node-1.r1.bound.g1"]
    check_hold_invariants(node)


async def test_abandoned_bind_is_not_released_while_its_bound_cannot_be_reported(root: Path) -> None:
    node = Node(root)
    await node.converge(GEN1)
    node = node.restart(crash=crash_at("bind.published"))
    with pytest.raises(Crash):
        await node.converge(GEN2)  # b1's Bound is in the outbox, the journal does not know
    node = node.restart()
    node.signer.fail = True
    gen3 = spec(3, hold("k1", G[2]))
    p, r = await node.converge(gen3)
    b1 = [type(s).__name__ for s in p.steps if getattr(s, "allocation_id", "") == "b1"]
    assert b1 == ["ReportBound", "ReleaseHold"]
    assert "b1: not released in this pass: its Bound could not be reported" in r.errors
    assert "b1" in node.holds()  # kept until its Bound is known upstream
    check_hold_invariants(node, reported=False, settled=False)
    node.signer.fail = False
    p, r = await node.converge(gen3)
    assert not r.errors, r.errors
    files_match(node, gen3)
    assert check_hold_invariants(node) == {"k1": "node-1.k1.bound.g1"}
    assert "node-1.b1.released.g3" in node.outbox.ids("released")


# ------------------------------------------------------------------------------ reboot


async def test_reboot_recreates_env_files_and_slices_without_new_events(root: Path) -> None:
    node = Node(root)
    _, r = await node.converge(S1)
    assert not r.errors
    envs = {a: node.env(a) for a in ("a1", "a2", "a3")}
    slice_props = node.slices.properties("a1")
    cdi = node.holds()
    sends = node.outbox.sends

    copies = node.consumer_copies()
    assert set(copies) == {"a1", "a2", "a3"}

    # reboot: /run is tmpfs (env files, the fake slices and the consumer copies in
    # /run/cdi live there); CDI specs survive
    shutil.rmtree(node.run_dir)
    node.run_dir.mkdir()
    node = node.restart(boot_id="boot-2")
    p, r = await node.converge(S1)
    assert not r.errors
    assert p.kinds() == ["EnsureSlice", "WriteEnv", "WriteConsumer", "WriteEnv", "WriteConsumer", "WriteEnv", "WriteConsumer"]
    assert {a: node.env(a) for a in envs} == envs
    assert node.consumer_copies() == copies
    assert node.slices.properties("a1") == slice_props
    assert node.holds() == cdi
    assert node.outbox.sends == sends  # no new Bound, not even a replayed one
    assert node.plan(S1).steps == ()
    check_hold_invariants(node)


async def test_bind_intent_is_stamped_with_the_boot_id(root: Path) -> None:
    seen: list[tuple[str, str]] = []
    node = Node(root, boot_id="boot-7")

    def hook(point: str) -> None:
        if point == "bind.intent-recorded":
            intent = node.store.load().intents["a1"]
            seen.append((intent.op, intent.boot_id))

    node.applier.crash = hook
    await node.converge(spec(1, hold("a1", G[0])))
    assert seen == [("bind", "boot-7")]
    assert node.store.load().intents == {}


async def test_a_reported_hold_whose_cdi_spec_vanished_is_recreated_without_a_second_bound(tmp_path):
    from tests.converger_kit import GPU, Node, hold, spec

    node = Node(tmp_path)
    s1 = spec(1, hold("keep", GPU[0], cpus="0-3"))
    await node.converge(s1)
    (node.cdi_dir / "bcd-keep.json").unlink()
    s2 = spec(2, hold("keep", GPU[0], cpus="0-3"))
    p, r = await node.converge(s2)
    assert not r.errors
    assert set(node.holds()) == {"keep"}
    assert node.holds()["keep"]["annotations"]["bcd.dev/generation"] == "1"
    assert len(node.outbox.of_type("bound")) == 1
    assert node.plan(s2).steps == ()


async def test_a_reported_hold_whose_cdi_spec_vanished_still_gets_its_released(tmp_path):
    from tests.converger_kit import GPU, Node, hold, spec

    node = Node(tmp_path)
    await node.converge(spec(1, hold("gone", GPU[0], cpus="0-3")))
    (node.cdi_dir / "bcd-gone.json").unlink()
    p, r = await node.converge(spec(2))
    assert not r.errors
    released = node.outbox.reports("released", node.signer)
    assert [b.event.allocation_id for b in released] == ["gone"]
    assert released[0].event.devices == [GPU[0]]
    assert node.env("gone") is None and node.slice_names() == []
    assert node.plan(spec(2)).steps == ()


async def test_a_full_outbox_holds_back_new_binds_but_not_releases_or_failures(tmp_path):
    from tests.converger_kit import GPU, Node, hold, spec

    node = Node(tmp_path)
    await node.converge(spec(1, hold("old", GPU[0])))
    node.outbox.full = True
    s2 = spec(2, hold("new", GPU[1]), hold("bad", "nic.vf/0000:3b:00.2"))
    p, r = await node.converge(s2)
    assert r.retry and any("outbox is full" in e for e in r.errors)
    assert set(node.holds()) == set()  # "old" released, "new" not bound
    assert [b.event.allocation_id for b in node.outbox.reports("released", node.signer)] == ["old"]
    assert [f["allocation_id"] for f in node.outbox.of_type("failed")] == ["bad"]
    assert r.section is not None and r.section.state == "PROGRESSING"
    node.outbox.full = False
    p, r = await node.converge(s2)
    assert not r.errors and set(node.holds()) == {"new"}
    assert [b.event.allocation_id for b in node.outbox.reports("bound", node.signer)] == ["old", "new"]
