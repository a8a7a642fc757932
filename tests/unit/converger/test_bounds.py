"""Issue 11, the converger's side: a refusal is final at its generation, and what
the converger emits always fits its own schema, whatever the spec made it say.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import msgspec

from services.converger.model import BindHold
from services.converger.plan import section_status
from shared.schemas import (
    CONVERGER_STATUS_CODEC,
    NODE_EVENT_CODEC,
    NODE_SPEC_CODEC,
    TEXT_MAX,
    Condition,
    ConvergerStatus,
    SectionStatus,
    summarise,
)
from shared.schemas.nodespec import MAX_ASSIGNMENTS

from tests.converger_kit import GPU, Node, hold, host_copy, spec, with_status

G = GPU
GIB = 1 << 30
PCI0 = "0000:18:00.0"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _excluded(node: Node) -> None:
    cond = Condition(type="Managed", status="False", reason="Excluded", message="excluded (test)", since=T0)
    node.inventory = with_status(node.inventory, PCI0, management_state="Excluded", conditions=(cond,))


async def test_a_refusal_is_final_at_its_generation(tmp_path: Path) -> None:
    """Refused with overlap (card excluded) at generation 17; `bcd gpu include`; still refused at 17, bound at 18."""
    node = Node(tmp_path)
    _excluded(node)
    s17 = spec(17, hold("b1", G[0]), hold("c1", G[1]))
    p, r = await node.converge(s17)
    assert not r.errors
    assert [s.allocation_id for s in p.steps if isinstance(s, BindHold)] == ["c1"]
    assert [(f.allocation_id, f.reason) for f in p.failures] == [("b1", "overlap")]
    message = p.failures[0].message

    node.rescan()  # the operator included the card again: the inventory shows it Managed
    p, r = await node.converge(s17)
    assert not r.errors
    assert p.kinds() == [], "nothing refused at 17 may be bound at 17"
    assert [(f.allocation_id, f.reason, f.message) for f in p.failures] == [("b1", "overlap", message)]
    assert p.section is not None and p.section.state == "FAILED"
    assert "b1" not in node.holds()
    assert len(node.outbox.of_type("failed")) == 1

    # a restart keeps it so (the refusal is in the journal)
    node = node.restart()
    p, _ = await node.converge(s17)
    assert p.kinds() == [] and [f.allocation_id for f in p.failures] == ["b1"]

    # generation 18 asks again: now it binds
    p, r = await node.converge(spec(18, hold("b1", G[0]), hold("c1", G[1])))
    assert not r.errors
    assert [s.allocation_id for s in p.steps if isinstance(s, BindHold)] == ["b1"]
    assert p.section is not None and p.section.state == "CONVERGED"
    assert node.outbox.of_type("section")[-1]["state"] == "CONVERGED"


def _largest_failing_spec() -> bytes:
    """MAX_ASSIGNMENTS assignments with 63-character ids for GPUs that are not there."""
    devices = [
        {
            "allocation_id": f"a{i:04d}" + "x" * 58,
            "reservation_id": f"r{i:04d}" + "y" * 58,
            "binding": "BINDING_HOLD",
            "devices": [f"GPU-0badcafe-0000-4000-8000-{i:012d}"],
        }
        for i in range(MAX_ASSIGNMENTS)
    ]
    return msgspec.json.encode({"node_id": "node-1", "generation": 1, "devices": devices})


async def test_largest_legal_spec_with_every_assignment_failing_emits_valid_messages(tmp_path: Path) -> None:
    """The section message and ConvergerStatus fit their schema (it was > 4096 characters and the bridge died)."""
    s = NODE_SPEC_CODEC.decode(_largest_failing_spec())
    node = Node(tmp_path)
    p, r = await node.converge(s)
    assert not r.errors
    assert len(p.failures) == MAX_ASSIGNMENTS
    assert {f.reason for f in p.failures} == {"device-missing"}
    section = p.section
    assert section is not None and section.state == "FAILED"
    assert len(section.message) <= TEXT_MAX
    assert section.message.endswith(" more")
    shown = section.message.splitlines()
    assert shown[0] == f"{s.devices[0].allocation_id}: device-missing"
    assert shown[-1] == f"... and {MAX_ASSIGNMENTS - (len(shown) - 1)} more"
    # every event it journaled decodes under the node's own schema
    for event_type in ("failed", "section"):
        for payload in node.outbox.of_type(event_type):
            NODE_EVENT_CODEC.decode(msgspec.json.encode(payload))
    status = ConvergerStatus(generation=1, section=section, failures={f.allocation_id: f.reason for f in p.failures})
    assert CONVERGER_STATUS_CODEC.decode(msgspec.json.encode(status)) == status


def test_section_status_table() -> None:
    from services.converger.model import Failure

    def f(i: int) -> Failure:
        return Failure(f"a{i}", f"r{i}", "overlap", "m")

    rows = [
        # (failures, state, message)
        ([], "CONVERGED", ""),
        ([f(1)], "FAILED", "a1: overlap"),
        ([f(1), f(2)], "FAILED", "a1: overlap\na2: overlap"),
    ]
    for failures, state, message in rows:
        s = section_status(3, failures)
        assert (s.state, s.message, s.observed_generation) == (state, message, 3)
    many = section_status(3, [f(i) for i in range(2000)])
    assert len(many.message) <= TEXT_MAX and many.message.endswith(" more")
    assert isinstance(many, SectionStatus)


def test_summarise_table() -> None:
    rows = [
        # (items, limit, expected)
        ([], 20, ""),
        (["abc"], 20, "abc"),
        (["abc", "def"], 20, "abc\ndef"),
        (["aaaa", "bbbb", "cccc", "dddd", "eeee"], 20, "aaaa\n... and 4 more"),
        (["a" * 30], 20, "a" * 17 + "..."),
    ]
    for items, limit, expected in rows:
        out = summarise(items, limit)
        assert out == expected, (items, out)
        assert len(out) <= limit
    for n in range(0, 200, 7):
        out = summarise([f"item-{i}" for i in range(n)], 64, sep=", ")
        assert len(out) <= 64


async def test_a_pending_kubernetes_release_keeps_its_memory_promised(tmp_path: Path) -> None:
    """Pods of a withdrawn Kubernetes hold may still run: its memory stays promised until it is reported."""
    host = host_copy(tmp_path / "host", lambda d: d.__setitem__("memory", {"total_bytes": 8 * GIB, "available_bytes": 8 * GIB}))
    node = Node(tmp_path / "node", host)
    p, r = await node.converge(spec(1, hold("k1", G[0], binding="BINDING_KUBERNETES", memory_bytes=6 * GIB)))
    assert not r.errors and [s.allocation_id for s in p.steps if isinstance(s, BindHold)] == ["k1"]
    assert node.holds()["k1"]["annotations"]["bcd.dev/limits"], "the booking is on record in the hold"
    assert "bcd.dev/cgroup-parent" not in node.holds()["k1"]["annotations"], "a Kubernetes hold is never sliced"

    node.reaper.pod_atoms = {G[0]}  # a pod still has the GPU
    p, r = await node.converge(spec(2, hold("b1", G[1], memory_bytes=4 * GIB)))
    assert not r.errors
    pending, _ = node.releases.load()
    assert pending["k1"].limits is not None and pending["k1"].limits.memory_bytes == 6 * GIB
    assert [(f.allocation_id, f.reason, f.message) for f in p.failures] == [
        ("b1", "resources-exhausted", "ResourcesExhausted: 4096 MiB of memory needed, 2048 MiB left on this host")
    ]

    node.reaper.pod_atoms = set()  # the pod went: the release is reported, the memory free again
    p, r = await node.converge(spec(3, hold("b1", G[1], memory_bytes=4 * GIB)))
    assert not r.errors
    assert [s.allocation_id for s in p.steps if isinstance(s, BindHold)] == ["b1"]
    assert node.releases.load()[0] == {}
