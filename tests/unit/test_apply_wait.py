"""`bcd apply --wait`: the outcome of one generation from the control plane's verified events (pure parts)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import msgspec
import pytest

from bcd.applywait import EXIT_CONVERGED, EXIT_FAILED, EXIT_TIMEOUT, Follower, follow
from controlplane.ledger import EventRecord
from controlplane.state import Reservation
from shared.schemas import AllocationBound, AllocationFailed, AllocationReleased, Condition, DeviceAssignment, NodeCondition, NodeSpec, SectionStatus, encode

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]


def assignment(alloc: str, *devices: str) -> DeviceAssignment:
    return DeviceAssignment(allocation_id=alloc, reservation_id=f"rsv-{alloc}", binding="BINDING_HOLD", devices=list(devices))


def spec(*assignments: DeviceAssignment, generation: int = 5) -> NodeSpec:
    return NodeSpec(node_id="node-1", generation=generation, devices=list(assignments))


def record(event: object, *, node: str = "node-1", outcome: str = "applied") -> EventRecord:
    from controlplane.ledger import describe

    alloc, rsv, _what, gen, detail = describe(event)
    etype = event.__struct_config__.tag  # type: ignore[attr-defined]
    return EventRecord(
        received_at=NOW,
        node_id=node,
        type=etype,
        event_id=f"{node}.{alloc or etype}.{gen}",
        outcome=outcome,  # type: ignore[arg-type]
        verified=True if etype in ("bound", "released") else None,
        allocation_id=alloc,
        reservation_id=rsv,
        generation=gen,
        detail=detail,
        event=msgspec.to_builtins(event),
    )


def bound(alloc: str, gen: int, *devices: str, cgroup: str = "") -> EventRecord:
    return record(AllocationBound(allocation_id=alloc, reservation_id=f"rsv-{alloc}", generation=gen, devices=list(devices), cgroup_parent=cgroup))


def failed(alloc: str, gen: int, reason: str = "overlap", message: str = "held by x") -> EventRecord:
    return record(AllocationFailed(allocation_id=alloc, reservation_id=f"rsv-{alloc}", generation=gen, reason=reason, message=message))  # type: ignore[arg-type]


def released(alloc: str, gen: int, *devices: str) -> EventRecord:
    return record(AllocationReleased(allocation_id=alloc, reservation_id=f"rsv-{alloc}", generation=gen, devices=list(devices)))


def section(gen: int, state: str, message: str = "") -> EventRecord:
    return record(SectionStatus(section="devices", state=state, observed_generation=gen, message=message))  # type: ignore[arg-type]


def condition(ctype: str, status: str, message: str) -> EventRecord:
    return record(NodeCondition(condition=Condition(type=ctype, status=status, reason="R", message=message, since=NOW)))  # type: ignore[arg-type]


def run(f: Follower, records: list[EventRecord]) -> list[str]:
    out: list[str] = []
    for r in records:
        out += f.feed(r)
    return out


def test_converged_prints_each_bound_hold_and_exits_0() -> None:
    f = Follower.for_spec(spec(assignment("a", GPU[0]), assignment("b", GPU[1])), 5)
    lines = run(f, [bound("a", 5, GPU[0], cgroup="bcd-alloc-a.slice"), bound("b", 5, GPU[1]), section(5, "CONVERGED")])
    assert lines[0].startswith("bound    a (rsv-a)  GPU-5f1c…0001") and "cgroup parent bcd-alloc-a.slice" in lines[0]
    assert lines[1].startswith("bound    b (rsv-b)")
    assert f.outcome == "CONVERGED" and f.exit_code() == EXIT_CONVERGED
    assert f.summary() == ["generation 5: CONVERGED (2 bound, 0 kept, 0 failed, 0 released)"]


def test_failed_names_the_reason_and_exits_1_the_others_bound_anyway() -> None:
    f = Follower.for_spec(spec(assignment("a", GPU[0]), assignment("late", GPU[0])), 5)
    lines = run(f, [bound("a", 5, GPU[0]), failed("late", 5, "overlap", f"{GPU[0]} is held by a"), section(5, "FAILED", "late: overlap")])
    assert lines[1] == f"failed   late (rsv-late)  overlap: {GPU[0]} is held by a"
    assert f.outcome == "FAILED" and f.exit_code() == EXIT_FAILED
    doc = f.to_json()
    assert doc["outcome"] == "FAILED" and doc["exit_code"] == 1 and doc["section"]["message"] == "late: overlap"
    assert [(a["allocation_id"], a["result"], a["reason"]) for a in doc["allocations"]] == [("a", "bound", ""), ("late", "failed", "overlap")]


@pytest.mark.parametrize(
    ("records", "why"),
    [
        pytest.param([section(4, "CONVERGED"), failed("a", 4)], "an older generation's section and failure", id="older-generation"),
        pytest.param([bound("a", 6, GPU[0]), section(5, "PROGRESSING", "a: write failed")], "a later generation's bind", id="later-bind"),
        pytest.param([section(5, "CONVERGED", "")], "another node's", id="other-node"),
        pytest.param([section(5, "CONVERGED", "")], "a rejected event", id="rejected"),
        pytest.param([bound("a", 5, GPU[0])], "another reservation of the allocation", id="other-reservation"),
    ],
)
def test_what_is_not_this_generations_outcome_is_ignored(records: list[EventRecord], why: str) -> None:
    f = Follower.for_spec(spec(assignment("a", GPU[0])), 5)
    if why == "another node's":
        records = [msgspec.structs.replace(r, node_id="node-2") for r in records]
    if why == "a rejected event":
        records = [msgspec.structs.replace(r, outcome="rejected") for r in records]
    if why == "another reservation of the allocation":
        records = [msgspec.structs.replace(r, reservation_id="rsv-other") for r in records]
    run(f, records)
    assert f.outcome is None, why
    assert f.holds["a"].result == "pending", why
    assert f.exit_code() == EXIT_TIMEOUT


def test_a_bind_of_an_earlier_generation_counts_kept_holds_and_releases() -> None:
    reservations = {
        "rsv-keep": Reservation(reservation_id="rsv-keep", node_id="node-1", allocation_id="keep", state="active", generation=5, devices=[GPU[2]], updated_at=NOW)
    }
    f = Follower.for_spec(spec(assignment("keep", GPU[2]), assignment("late", GPU[3])), 5, reservations)
    assert f.counts()["kept"] == 0  # nothing is said kept before the node reports the generation
    lines = run(f, [released("gone", 5, GPU[4]), bound("late", 4, GPU[3], cgroup="bcd-alloc-late.slice")])
    assert lines == ["released gone (rsv-gone)  GPU-5f1c…0005"]
    assert f.holds["late"].result == "pending"  # bound by generation 4's pass: not this generation's word
    lines = run(f, [section(5, "CONVERGED")])
    assert lines == [
        "kept     keep (rsv-keep)  GPU-5f1c…0003  (held from an earlier generation)",
        "kept     late (rsv-late)  GPU-5f1c…0004  cgroup parent bcd-alloc-late.slice  (held from an earlier generation)",
    ]
    assert f.counts() == {"bound": 0, "kept": 2, "failed": 0, "pending": 0, "released": 1}


def test_with_the_converger_stopped_nothing_is_said_but_no_outcome() -> None:
    """Issue 41.7: with the converger stopped (kill -STOP), `apply --wait` printed five
    `kept ... (bound at an earlier generation)` lines for a generation the converger never saw,
    inferred from the control plane's record; now only the node's events at the generation say
    anything, and none came: TIMEOUT, exit 3, every hold pending."""
    names = [f"h{i}" for i in range(5)]
    reservations = {
        f"rsv-{n}": Reservation(reservation_id=f"rsv-{n}", node_id="node-1", allocation_id=n, state="active", generation=4, devices=[GPU[i]], updated_at=NOW)
        for i, n in enumerate(names)
    }
    f = Follower.for_spec(spec(*(assignment(n, GPU[i]) for i, n in enumerate(names))), 5, reservations)
    # what the outbox may still drain: generation 4's own reports
    lines = run(f, [bound(n, 4, GPU[i]) for i, n in enumerate(names)] + [section(4, "CONVERGED")])
    assert lines == []
    assert f.outcome is None and f.exit_code() == EXIT_TIMEOUT
    assert f.counts() == {"bound": 0, "kept": 0, "failed": 0, "pending": 5, "released": 0}
    (summary,) = f.summary(2.0)
    assert summary.startswith("generation 5: no outcome within 2 s, TIMEOUT (0 bound, 0 kept, 0 failed, 0 released, 5 pending")
    assert "kept" not in " ".join(lines) and f.to_json()["outcome"] == "TIMEOUT"
    assert [a["result"] for a in f.to_json()["allocations"]] == ["pending"] * 5


def test_progressing_is_said_once_per_message_and_is_no_outcome() -> None:
    f = Follower.for_spec(spec(assignment("a", GPU[0])), 5)
    lines = run(f, [section(5, "PROGRESSING", "a: cannot write"), section(5, "PROGRESSING", "a: cannot write")])
    assert lines == ["progressing: a: cannot write"]
    assert not f.done


def test_a_refused_spec_and_a_superseded_generation_end_the_wait_with_1() -> None:
    f = Follower.for_spec(spec(assignment("a", GPU[0])), 5)
    assert run(f, [condition("NodeSpecRejected", "True", "refused: signature does not verify")]) == [
        "the node refused the spec: refused: signature does not verify"
    ]
    assert f.outcome == "REFUSED" and f.exit_code() == 1
    g = Follower.for_spec(spec(assignment("a", GPU[0])), 5)
    run(g, [section(6, "CONVERGED")])
    assert g.outcome == "SUPERSEDED" and g.superseded_by == 6 and g.exit_code() == 1


def test_the_unknown_fields_warning_is_printed_and_is_no_outcome() -> None:
    f = Follower.for_spec(spec(assignment("a", GPU[0])), 5)
    lines = run(f, [condition("NodeSpecUnknownFields", "True", "generation 5: 1 field this node does not know, ignored: $.x: unknown field")])
    assert lines == ["warning: generation 5: 1 field this node does not know, ignored: $.x: unknown field"]
    assert not f.done and f.to_json()["conditions"][0]["type"] == "NodeSpecUnknownFields"


def test_a_large_spec_gets_progress_lines_not_a_line_per_hold() -> None:
    n = 100
    s = spec(*[assignment(f"a{i}", f"{GPU[i % 8]}/slot{i}") for i in range(n)])
    f = Follower.for_spec(s, 5, per_hold_lines=10)
    records = [bound(f"a{i}", 5, f"{GPU[i % 8]}/slot{i}") for i in range(60)]
    records += [failed(f"a{i}", 5) for i in range(60, n)]
    lines = run(f, records[:30])
    assert lines == []
    assert f.progress() == "bound 30/100, failed 0, released 0 (generation 5)"
    assert f.progress() is None  # nothing moved
    lines = run(f, [*records[30:], section(5, "FAILED")])
    assert len(lines) == 10 and all(line.startswith("failed") for line in lines)  # failures up to the limit
    assert f.summary() == [
        "... and 30 more failed (`bcd events` lists them)",
        "generation 5: FAILED (60 bound, 0 kept, 40 failed, 0 released)",
    ]


def test_follow_tails_the_log_from_the_offset_and_gives_up_at_the_deadline(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    old = encode(section(5, "CONVERGED")) + b"\n"  # before the put: not ours even if it looked so
    log.write_bytes(old)
    f = Follower.for_spec(spec(assignment("a", GPU[0])), 5)
    clock = [0.0]
    appended = [encode(bound("a", 5, GPU[0])) + b"\n" + b'{"torn', b'line\n' + encode(section(5, "CONVERGED")) + b"\n"]

    def sleep(s: float) -> None:
        clock[0] += s
        if appended:
            with open(log, "ab") as fh:
                fh.write(appended.pop(0))

    out: list[str] = []
    follow(log, len(old), f, timeout=10, emit=out.append, clock=lambda: clock[0], sleep=sleep)
    assert f.outcome == "CONVERGED" and out[0].startswith("bound    a")

    g = Follower.for_spec(spec(assignment("a", GPU[0])), 6)
    clock[0] = 0.0
    follow(log, log.stat().st_size, g, timeout=1.0, emit=out.append, clock=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    assert g.outcome is None and clock[0] >= 1.0
    assert g.summary(1.0)[0].startswith("generation 6: no outcome within 1 s")


def test_a_held_allocation_on_other_devices_is_not_said_kept_but_released_and_bound_again() -> None:
    """Issue 28.1: `kept job-a ... GPU-…0003 (bound at an earlier generation)` was printed for job-a
    moved to GPU-…0004, which the node then kept on 0003; now the node releases and binds it again."""
    reservations = {
        "rsv-job-a": Reservation(reservation_id="rsv-job-a", node_id="node-1", allocation_id="job-a", state="active", generation=4, devices=[GPU[2]], updated_at=NOW)
    }
    f = Follower.for_spec(spec(assignment("job-a", GPU[3])), 5, reservations)
    lines = run(f, [released("job-a", 5, GPU[2]), bound("job-a", 5, GPU[3]), section(5, "CONVERGED")])
    assert lines[0] == "released job-a (rsv-job-a)  GPU-5f1c…0003  (its assignment changed: bound again)"
    assert f.holds["job-a"].result == "bound" and f.holds["job-a"].devices == [GPU[3]]
    assert f.counts() == {"bound": 1, "kept": 0, "failed": 0, "pending": 0, "released": 1}


def test_a_kept_hold_released_at_the_generation_is_bound_again_not_kept() -> None:
    """Same devices, other env or limits: its Released and Bound come; never said kept."""
    reservations = {
        "rsv-job-a": Reservation(reservation_id="rsv-job-a", node_id="node-1", allocation_id="job-a", state="active", generation=4, devices=[GPU[2]], updated_at=NOW)
    }
    f = Follower.for_spec(spec(assignment("job-a", GPU[2])), 5, reservations)
    run(f, [released("job-a", 5, GPU[2])])
    assert f.holds["job-a"].result == "pending"
    run(f, [bound("job-a", 5, GPU[2]), section(5, "CONVERGED")])
    assert f.holds["job-a"].result == "bound" and f.counts()["kept"] == 0


def test_a_dropped_hold_without_a_released_is_said_pending_not_left_out() -> None:
    """Issue 28.6: `apply --wait` printed nothing for a released Kubernetes hold whose pods (or no
    kubelet) kept it pending; a plain hold dropped is said by its Released."""
    reservations = {
        r: Reservation(reservation_id=f"rsv-{a}", node_id="node-1", allocation_id=a, state="releasing", generation=5, devices=[d], updated_at=NOW)
        for r, a, d in (("rsv-k1", "k1", GPU[2]), ("rsv-plain", "plain", GPU[3]))
    }
    f = Follower.for_spec(spec(assignment("new", GPU[0])), 5, reservations)
    lines = run(f, [bound("new", 5, GPU[0]), released("plain", 5, GPU[3]), section(5, "CONVERGED")])
    assert lines[-1] == (
        "releasing k1 (rsv-k1)  GPU-5f1c…0003  (a Kubernetes hold: released once no pod holds its devices; "
        "`bcd status` shows it, `bcd releases` lists it)"
    )
    assert not any("releasing plain" in line for line in lines)
