"""The converger's HelperHostWriter: the HostWriter port through the root helper.

A converger writing through the helper leaves exactly the files and slices a
converger writing in process leaves, pass after pass (two nodes, one spec
sequence, the trees compared byte for byte). A refusal, a failure or a
missing helper is a HostWriteError, retried by the next pass like a failed
write; a helper that writes elsewhere than the converger reads is not used.
The transport here calls the helper's operations in process; the
integration tests run it over the bus.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.converger.helperwatch import HelperWatch, watch_helper
from services.converger.hostwriter import HelperHostWriter, HostWriteError, helper_mismatch, writer_kind
from services.helper.ops import HelperOps
from shared.holdfiles import HoldContent, HoldDevice, hold_from_wire, hold_to_wire, limits_from_wire, limits_to_wire
from shared.schemas import HELPER_FILE_REMOVE_CODEC, HelperInfo, HelperReply, HugePages, Limits, encode
from shared.slices import FakeSlices
from shared.subjects import NodeSubjects
from tests.converger_kit import GPU, Node, fast_dir, hold, spec

from .test_helper_ops import CONTENTS, MPS, tree

G = GPU
GIB = 1 << 30
KUBE = frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"})
S = NodeSubjects("node-1")
OPS = {
    S.helper_file_write: "file.write",
    S.helper_file_copy: "file.copy",
    S.helper_file_remove: "file.remove",
    S.helper_slice_apply: "slice.apply",
    S.helper_slice_remove: "slice.remove",
}


class OpsTransport:
    """The helper in process: what BusHelperTransport does over the bus, minus the bus."""

    def __init__(self, ops: HelperOps) -> None:
        self.ops = ops
        self.sent: list[tuple[str, bytes]] = []
        #: return a reply instead of asking the helper (scripted failures); None: ask.
        self.script: Callable[[str, bytes], bytes | None] = lambda subject, payload: None

    def request(self, subject: str, payload: bytes, timeout: float) -> bytes:
        self.sent.append((subject, payload))
        scripted = self.script(subject, payload)
        if scripted is not None:
            return scripted
        if subject == S.helper_info:
            return encode(self.ops.info())
        reply, _ = self.ops.answer(OPS[subject], payload)
        return encode(reply)

    def close(self) -> None:
        pass

    def subjects(self) -> list[str]:
        return [s.rsplit(".", 2)[-2] + "." + s.rsplit(".", 1)[-1] for s, _ in self.sent]


def helper_node(root: Path) -> tuple[Node, OpsTransport, HelperHostWriter]:
    """A converger Node whose applier writes through the helper (same dirs, fake slices)."""
    node = Node(root, supported_bindings=KUBE)
    ops = HelperOps(node.cdi_dir, node.run_dir, FakeSlices(node.run_dir), slices_backend="fake", mps_pipe_dir=MPS, consumer_dir=node.consumer_dir)
    transport = OpsTransport(ops)
    writer = HelperHostWriter(transport, S, node.cdi_dir, node.run_dir, slices_backend="fake", consumer_dir=node.consumer_dir)
    node.applier.writer = writer
    return node, transport, writer


@pytest.fixture
def root() -> Iterator[Path]:
    with fast_dir() as d:
        yield d


def host_tree(node: Node) -> dict[str, bytes | str]:
    return {f"cdi/{k}": v for k, v in tree(node.cdi_dir).items()} | {f"run/{k}": v for k, v in tree(node.run_dir).items()}


SPECS = [
    spec(
        1,
        hold("whole", G[0], cpus="0-3", cpu_millis=4000, memory_bytes=8 * GIB, hugepages=[(2048, 512)], mems="0", env=("MY_VAR=1",)),
        hold("two-gpus", G[1], G[2]),
        hold("mig", f"{G[6]}/gi1/ci0", f"{G[6]}/gi5/ci0"),
        hold("slot-a", f"{G[4]}/slot0", f"{G[4]}/slot1"),
        hold("slot-b", f"{G[5]}/slot3", cpus="8"),
        hold("kube", G[3], binding="BINDING_KUBERNETES"),
    ),
    # releases (plain, sliced, Kubernetes), a moved GPU, a new MIG hold
    spec(
        2,
        hold("two-gpus", G[1], G[2]),
        hold("moved", G[0], memory_bytes=GIB),
        hold("mig2", f"{G[7]}/gi2/ci0", f"{G[7]}/gi9/ci0"),
        hold("slot-a", f"{G[4]}/slot0", f"{G[4]}/slot1"),
    ),
    spec(3),
]


async def test_a_converger_writing_through_the_helper_leaves_the_same_host(root: Path) -> None:
    local = Node(root / "local", supported_bindings=KUBE)
    through, transport, _ = helper_node(root / "helper")
    for s in SPECS:
        # a temp file a crashed write left behind: both remove it
        for n in (local, through):
            (n.cdi_dir / ".bcd-two-gpus.json.tmp-99999").write_text("{")
            (n.run_dir / "allocations").mkdir(exist_ok=True)
            (n.run_dir / "allocations" / ".slot-a.env.tmp-99999").write_text("X")
        for n in (local, through):
            p, r = await n.converge(s)
            assert not r.errors, r.errors
        assert host_tree(through) == host_tree(local), f"generation {s.generation}"
        assert sorted(local.holds()) == sorted(through.holds())
        assert local.outbox.ids("bound") == through.outbox.ids("bound")
        assert local.outbox.ids("released") == through.outbox.ids("released")
    used = set(transport.subjects())
    assert used == {"helper.info", "file.write", "file.copy", "file.remove", "slice.apply", "slice.remove"}, used
    assert local.holds() == {}


async def test_a_refused_write_is_retried_like_a_failed_one(root: Path) -> None:
    node, transport, _ = helper_node(root)
    refusals = 2

    def refuse_writes(subject: str, payload: bytes) -> bytes | None:
        nonlocal refusals
        if subject == S.helper_file_write and refusals:
            refusals -= 1
            return encode(HelperReply(ok=False, outcome="refused", reason="disk says no"))
        return None

    transport.script = refuse_writes
    s = spec(1, hold("a1", G[0]))
    _, r = await node.converge(s)
    assert r.errors and "root helper refused: disk says no" in r.errors[0]
    assert r.section is not None and r.section.state == "PROGRESSING"
    assert node.outbox.ids("bound") == []
    _, r = await node.converge(s)  # the second refusal
    assert r.errors
    _, r = await node.converge(s)
    assert not r.errors and r.section is not None and r.section.state == "CONVERGED"
    assert node.outbox.ids("bound") == ["node-1.a1.bound.g1"]
    assert (node.cdi_dir / "bcd-a1.json").exists() and (node.run_dir / "allocations" / "a1.env").exists()


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        pytest.param(encode(HelperReply(ok=False, outcome="failed", reason="No space left")), "root helper failed: No space left", id="failed"),
        pytest.param(b"garbage", "reply does not decode", id="garbage"),
    ],
)
def test_failures_are_host_write_errors(root: Path, reply: bytes, expected: str) -> None:
    node, transport, writer = helper_node(root)
    transport.script = lambda subject, payload: reply if subject != S.helper_info else None
    with pytest.raises(HostWriteError, match=expected):
        writer.write_cdi(CONTENTS["two-gpus"])
    # the helper's info is asked again after a failure (it may have been restarted)
    before = transport.subjects().count("helper.info")
    with pytest.raises(HostWriteError):
        writer.remove_cdi("two")
    assert transport.subjects().count("helper.info") == before + 1


def test_an_unreachable_helper_is_a_host_write_error(root: Path) -> None:
    node, transport, writer = helper_node(root)

    def gone(subject: str, payload: bytes) -> bytes:
        raise HostWriteError("root helper not running (no responders)")

    transport.script = gone
    with pytest.raises(HostWriteError, match="not running"):
        writer.apply_slice("a1", Limits(cpus="0"))


def info(root: Path, **changes: str) -> HelperInfo:
    base = dict(cdi_dir=str(Path(os.path.realpath(root)) / "cdi"), run_dir=str(Path(os.path.realpath(root)) / "run"), slices="fake", mps_pipe_dir=MPS)
    return HelperInfo(**{**base, **changes}, euid=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({}, ""),
        ({"cdi_dir": "/etc/cdi"}, "the helper's CDI dir is /etc/cdi"),
        ({"run_dir": "/run/bcd"}, "the helper's run dir is /run/bcd"),
        ({"slices": "systemd"}, "the helper's slices are systemd"),
    ],
)
def test_a_helper_must_write_where_the_converger_reads(root: Path, changes: dict, problem: str) -> None:
    got = helper_mismatch(info(root, **changes), root / "cdi", root / "run", "fake")
    assert (problem in got) if problem else got == ""


def test_a_misplaced_helper_is_not_written_through(root: Path) -> None:
    node, transport, writer = helper_node(root)
    transport.script = lambda subject, payload: encode(info(root, cdi_dir="/etc/cdi")) if subject == S.helper_info else None
    with pytest.raises(HostWriteError, match="cannot serve this converger: the helper's CDI dir is /etc/cdi"):
        writer.write_env(CONTENTS["two-gpus"])
    assert transport.subjects() == ["helper.info"]


def test_an_mps_pipe_directory_the_helper_does_not_use_is_not_written(root: Path) -> None:
    node, transport, writer = helper_node(root)
    content = dataclasses.replace(CONTENTS["slots-with-mps"], mps_pipe_dir="/var/run/other-mps")
    with pytest.raises(HostWriteError, match="--mps-pipe-dir /var/run/other-mps"):
        writer.write_cdi(content)
    assert "file.write" not in transport.subjects()


def test_temp_files_are_named_to_the_helper_by_kind_id_and_pid(root: Path) -> None:
    node, transport, writer = helper_node(root)
    writer.remove_temp(str(node.cdi_dir / ".bcd-a-1.json.tmp-77"))
    writer.remove_temp(str(node.run_dir / "allocations" / ".a-1.env.tmp-78"))
    removes = [HELPER_FILE_REMOVE_CODEC.decode(p) for s, p in transport.sent if s == S.helper_file_remove]
    assert [(r.kind, r.allocation_id, r.temp_pid) for r in removes] == [("cdi", "a-1", 77), ("allocation-env", "a-1", 78)]
    for path in (
        node.cdi_dir / ".nvidia.json.tmp-1",
        node.cdi_dir / ".bcd-../x.json.tmp-1",
        node.cdi_dir / ".bcd-a.json.tmp-0",
        node.run_dir / ".a.env.tmp-1",
        root / "elsewhere" / ".bcd-a.json.tmp-1",
    ):
        with pytest.raises(HostWriteError, match="not a temp file of ours"):
            writer.remove_temp(str(path))
    assert len([s for s, _ in transport.sent if s == S.helper_file_remove]) == 2


def test_a_device_the_helper_would_not_rebuild_exactly_is_not_sent(root: Path) -> None:
    node, transport, writer = helper_node(root)
    odd = HoldDevice(f"{CONTENTS['two-gpus'].devices[0].atom_id}", "gpu", CONTENTS["two-gpus"].devices[0].gpu_uuid, 0, "GPU-other", ())
    content = dataclasses.replace(CONTENTS["two-gpus"], devices=(odd,))
    with pytest.raises(HostWriteError, match="cannot be written through the root helper"):
        writer.write_cdi(content)
    assert transport.sent == []


# --------------------------------------------------------------------------- the wire mapping


@pytest.mark.parametrize("name", sorted(CONTENTS))
def test_hold_content_survives_the_wire(name: str) -> None:
    c = CONTENTS[name]
    assert hold_from_wire(hold_to_wire(c), c.mps_pipe_dir or MPS) == c


def test_a_bare_nvml_uuid_keeps_its_atom_id() -> None:
    bare = "5f1c2a90-0000-4000-8000-000000000001"
    d = HoldDevice(f"GPU-{bare}/slot2", "slot", bare, 0, bare, (bare, "0"))
    c = HoldContent(allocation_id="a", reservation_id="r", generation=0, binding="BINDING_HOLD", devices=(d,))
    assert hold_from_wire(hold_to_wire(c), MPS) == c


cpulists = st.lists(st.integers(0, 8191), min_size=1, max_size=20).map(lambda xs: ",".join(str(x) for x in sorted(set(xs))))


@settings(max_examples=200, deadline=None)
@given(
    cpus=st.none() | cpulists,
    millis=st.none() | st.integers(1, 8_192_000),
    memory=st.none() | st.integers(0, 2**50),
    pages=st.lists(st.tuples(st.sampled_from([4, 2048, 1048576]), st.integers(0, 2**32)), max_size=3, unique_by=lambda t: t[0]),
    mems=st.none() | st.integers(0, 1023).map(str),
)
def test_limits_within_bounds_survive_the_wire(cpus, millis, memory, pages, mems) -> None:  # noqa: ANN001
    limits = Limits(
        cpus=cpus, cpu_millis=millis, memory_bytes=memory, hugepages=[HugePages(page_size_kib=s, count=c) for s, c in pages], mems=mems
    )
    assert limits_from_wire(limits_to_wire(limits)) == limits


@pytest.mark.parametrize(
    ("mode", "fake_host", "euid", "kind"),
    [
        ("auto", True, 1000, "local"),  # a fake host writes in process, root or not
        ("auto", False, 0, "local"),  # root on a real host
        ("auto", False, 1000, "helper"),  # an ordinary user: the helper, if one answers (else unprivileged)
        ("local", False, 1000, "local"),  # the operator says this user may write (privileged)
        ("helper", False, 0, "helper"),  # the helper even as root (required: a missing one fails writes)
        ("helper", True, 1000, "helper"),
    ],
)
def test_writer_selection(mode: str, fake_host: bool, euid: int, kind: str) -> None:
    assert writer_kind(mode, fake_host=fake_host, euid=euid) == kind


# watch_helper: the converger's look at its root helper (--writer auto), one row a look
W = HelperWatch


@pytest.mark.parametrize(
    ("watch", "answered", "now", "lost_after", "after", "action"),
    [
        # nothing to do: privileged and the helper answers, or unprivileged and still none
        (W(True), True, 100.0, 30.0, W(True), ""),
        (W(False), False, 100.0, 30.0, W(False), ""),
        # a helper appears: privileged at once
        (W(False), True, 100.0, 30.0, W(True), "promote"),
        # it misses a look: still privileged, the silence timed from now
        (W(True), False, 100.0, 30.0, W(True, gone_since=100.0), ""),
        # still silent within the grace (a restart of the helper)
        (W(True, gone_since=100.0), False, 129.9, 30.0, W(True, gone_since=100.0), ""),
        # back within the grace: the silence is forgotten, nothing else changes
        (W(True, gone_since=100.0), True, 110.0, 30.0, W(True), ""),
        # silent for the whole grace: unprivileged again (seed: no helper, no holds)
        (W(True, gone_since=100.0), False, 130.0, 30.0, W(False), "demote"),
        # never demoted with the grace off
        (W(True, gone_since=100.0), False, 1e9, 0.0, W(True, gone_since=100.0), ""),
        # a grace of a moment demotes at the second missed look, not the first
        (W(True), False, 100.0, 0.001, W(True, gone_since=100.0), ""),
    ],
)
def test_watch_helper(watch: HelperWatch, answered: bool, now: float, lost_after: float, after: HelperWatch, action: str) -> None:
    assert watch_helper(watch, answered=answered, now=now, lost_after=lost_after) == (after, action)
