"""The control plane's pure parts: generations, the reservation state machine, state.json, the log line."""

from __future__ import annotations

import stat
from datetime import datetime, timezone

import msgspec
import pytest

from controlplane.keys import KeyFileError, load_or_create_cp_key
from controlplane.ledger import EventRecord, format_line, short_atom
from controlplane.state import (
    MAX_ISSUED_RUNS,
    ControlPlaneState,
    StateError,
    StateStore,
    apply_event,
    apply_spec,
    generation_issued,
    next_generation,
    remember_boot,
    remember_processed,
    reserve_generation,
)
from shared.schemas import (
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    Condition,
    Hello,
    NodeCondition,
    NodeSpec,
    SectionStatus,
)
from shared.signing import key_id, load_public_key_file, raw_public_key

T0 = datetime(2025, 3, 1, 8, 21, 3, tzinfo=timezone.utc)
GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"


def _spec(gen: int, *allocs: tuple[str, str], node: str = "node-1") -> NodeSpec:
    return msgspec.convert(
        {
            "node_id": node,
            "generation": gen,
            "devices": [{"allocation_id": a, "reservation_id": r, "binding": "BINDING_HOLD", "devices": [GPU0]} for a, r in allocs],
        },
        NodeSpec,
    )


# ----------------------------------------------------------------------------- generations


@pytest.mark.parametrize(
    ("last", "published", "requested", "expected", "bumped"),
    [
        (0, 0, None, 1, False),  # first spec of a node
        (4, 0, None, 5, False),  # last + 1
        (4, 0, 9, 9, False),  # a jump forward is kept
        (4, 0, 4, 5, True),  # equal: bumped
        (4, 0, 2, 5, True),  # lower: bumped
        (4, 7, None, 8, False),  # the bucket is ahead of state.json (state lost)
        (4, 7, 6, 8, True),
        (0, 0, 0, 1, True),  # generation 0 is never above "nothing put yet"
    ],
)
def test_next_generation(last, published, requested, expected, bumped):
    st = ControlPlaneState()
    st.node("node-1").last_generation = last
    gen, note = next_generation(st, "node-1", requested, published)
    assert gen == expected
    assert bool(note) is bumped
    if bumped:
        assert f"generation {requested} is not above" in note and f"put as {expected}" in note


# ----------------------------------------------------------------------------- generations issued (issue 40)


@pytest.mark.parametrize(
    ("puts", "legacy_last", "asked", "issued"),
    [
        ((), 0, 1, False),  # nothing put for the node: nothing believed
        ((1, 2, 3), 0, 2, True),
        ((1, 2, 3), 0, 4, False),  # the next one, not put yet
        ((1, 2, 3), 0, 0, False),  # 0 is never put (next_generation starts at 1)
        ((1, 2, 1000), 0, 999, False),  # a requested jump: the gap was never put
        ((1, 2, 1000), 0, 1000, True),
        ((7,), 0, 5, False),  # state lost, the bucket was ahead: what a predecessor put is not ours
        ((), 5, 3, True),  # a record of a release that did not keep runs: 1..last_generation
        ((), 5, 6, False),
        ((6,), 5, 6, True),  # ... and a put on it continues the run
        ((6,), 5, 2, True),
    ],
)
def test_an_event_s_generation_must_be_one_put_for_its_node(puts, legacy_last, asked, issued):
    st = ControlPlaneState()
    st.node("node-1").last_generation = legacy_last
    for g in puts:
        reserve_generation(st, "node-1", g)
    assert generation_issued(st, "node-1", asked) is issued
    assert not generation_issued(st, "node-2", asked)  # another node's puts say nothing of this one's


def test_issued_generations_are_runs_and_bounded():
    st = ControlPlaneState()
    for g in range(1, 10_001):  # ten thousand ordinary puts: one run
        reserve_generation(st, "node-1", g)
    assert st.nodes["node-1"].issued == [(1, 10_000)] and st.nodes["node-1"].last_generation == 10_000
    for i in range(MAX_ISSUED_RUNS + 10):  # jumps: a run each, the oldest forgotten first
        reserve_generation(st, "node-1", 20_000 + 2 * i)
    runs = st.nodes["node-1"].issued
    assert len(runs) == MAX_ISSUED_RUNS and runs[-1] == (20_000 + 2 * (MAX_ISSUED_RUNS + 9),) * 2
    assert not generation_issued(st, "node-1", 5)  # forgotten: refused, never guessed
    apply_spec(st, _spec(runs[-1][1] + 1), T0)  # a put through apply_spec counts too
    assert generation_issued(st, "node-1", runs[-1][1] + 1)
    # kept across a save and a load
    again = msgspec.json.decode(msgspec.json.encode(st), type=ControlPlaneState)
    assert again.nodes["node-1"].issued == st.nodes["node-1"].issued


# ----------------------------------------------------------------------------- the state machine


def test_spec_puts_reservations_binding():
    st = ControlPlaneState()
    apply_spec(st, _spec(1, ("a", "rsv-a"), ("b", "rsv-b")), T0)
    assert {r: v.state for r, v in st.reservations.items()} == {"rsv-a": "binding", "rsv-b": "binding"}
    assert st.nodes["node-1"].last_generation == 1


def test_active_stays_active_for_the_same_allocation_only():
    st = ControlPlaneState()
    apply_spec(st, _spec(1, ("a", "rsv-a"), ("b", "rsv-b")), T0)
    apply_event(st, "node-1", AllocationBound(allocation_id="a", reservation_id="rsv-a", generation=1, devices=[GPU0]), "e1", T0)
    apply_event(st, "node-1", AllocationBound(allocation_id="b", reservation_id="rsv-b", generation=1, devices=[GPU0]), "e2", T0)
    # gen 2: rsv-a unchanged, rsv-b moved to another allocation
    apply_spec(st, _spec(2, ("a", "rsv-a"), ("c", "rsv-b")), T0)
    assert st.reservations["rsv-a"].state == "active" and st.reservations["rsv-a"].generation == 2
    assert st.reservations["rsv-b"].state == "binding" and st.reservations["rsv-b"].allocation_id == "c"


@pytest.mark.parametrize(
    ("before", "after"),
    [("active", "releasing"), ("binding", "withdrawn"), ("failed", "failed"), ("released", "released")],
)
def test_reservation_dropped_from_the_spec(before, after):
    st = ControlPlaneState()
    apply_spec(st, _spec(1, ("a", "rsv-a")), T0)
    if before == "active":
        apply_event(st, "node-1", AllocationBound(allocation_id="a", reservation_id="rsv-a", generation=1, devices=[GPU0]), "e", T0)
    elif before == "failed":
        apply_event(st, "node-1", AllocationFailed(allocation_id="a", reservation_id="rsv-a", generation=1, reason="overlap"), "e", T0)
    elif before == "released":
        apply_event(st, "node-1", AllocationReleased(allocation_id="a", reservation_id="rsv-a", generation=1, devices=[GPU0]), "e", T0)
    apply_spec(st, _spec(2), T0)
    assert st.reservations["rsv-a"].state == after


def test_other_nodes_reservations_are_untouched_by_a_spec():
    st = ControlPlaneState()
    apply_spec(st, _spec(1, ("a", "rsv-a"), node="node-2"), T0)
    apply_spec(st, _spec(1, node="node-1"), T0)
    assert st.reservations["rsv-a"].state == "binding"


@pytest.mark.parametrize(
    ("event", "state", "reason"),
    [
        (AllocationBound(allocation_id="a", reservation_id="rsv-a", generation=1, devices=[GPU0]), "active", ""),
        (AllocationReleased(allocation_id="a", reservation_id="rsv-a", generation=1, devices=[GPU0]), "released", ""),
        (AllocationFailed(allocation_id="a", reservation_id="rsv-a", generation=1, reason="device-missing", message="gone"), "failed", "device-missing"),
    ],
)
def test_events_move_reservations(event, state, reason):
    st = ControlPlaneState()
    apply_spec(st, _spec(1, ("a", "rsv-a")), T0)
    moved = apply_event(st, "node-1", event, "e1", T0)
    assert moved is not None and moved.state == state and moved.reason == reason and moved.event_id == "e1"
    assert st.reservations["rsv-a"] == moved
    assert moved.devices == [GPU0]  # kept from the spec when the event names none


def test_conditions_and_sections_keep_the_latest_per_key():
    st = ControlPlaneState()
    c1 = NodeCondition(condition=Condition(type="X", status="True", since=T0))
    c2 = NodeCondition(condition=Condition(type="X", status="False", since=T0))
    c3 = NodeCondition(condition=Condition(type="Y", status="True", since=T0))
    for i, c in enumerate((c1, c2, c3)):
        assert apply_event(st, "node-1", c, f"c{i}", T0) is None
    apply_event(st, "node-1", SectionStatus(section="devices", state="CONVERGED", observed_generation=3), "s", T0)
    rec = st.nodes["node-1"]
    assert {k: v.status for k, v in rec.conditions.items()} == {"X": "False", "Y": "True"}
    assert rec.sections["devices"].observed_generation == 3


def test_processed_ids_are_capped_oldest_first():
    st = ControlPlaneState()
    for i in range(5):
        remember_processed(st, f"e{i}", T0, limit=3)
    assert list(st.processed) == ["e2", "e3", "e4"]


def test_boot_ids_accumulate():
    from shared.signing import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()

    def hello(boot: str) -> Hello:
        return Hello(node_id="node-1", boot_id=boot, public_key=raw_public_key(k), key_id=key_id(k), started_at=T0)

    st = ControlPlaneState()
    assert remember_boot(st, hello("a"))
    assert remember_boot(st, hello("b"))
    assert not remember_boot(st, hello("a"))
    assert st.nodes["node-1"].boot_ids == ["a", "b"]
    assert st.nodes["node-1"].key_id == key_id(k)


# ----------------------------------------------------------------------------- state.json


def test_store_round_trips_and_sees_another_writer(tmp_path):
    one, two = StateStore(tmp_path), StateStore(tmp_path)
    with one.transaction() as st:
        apply_spec(st, _spec(3, ("a", "rsv-a")), T0)
    # the other process's store reloads before it changes anything
    with two.transaction() as st:
        assert st.nodes["node-1"].last_generation == 3
        st.node("node-2").last_generation = 1
    assert one.refresh().nodes["node-2"].last_generation == 1
    assert StateStore(tmp_path).state.reservations["rsv-a"].state == "binding"
    assert stat.S_IMODE((tmp_path / "state.json").stat().st_mode) == 0o600


def test_store_drops_a_failed_transaction(tmp_path):
    store = StateStore(tmp_path)
    with store.transaction() as st:
        st.node("node-1").last_generation = 1
    with pytest.raises(RuntimeError):
        with store.transaction() as st:
            st.node("node-1").last_generation = 99
            raise RuntimeError("boom")
    assert store.state.nodes["node-1"].last_generation == 1
    assert StateStore(tmp_path).state.nodes["node-1"].last_generation == 1


def test_store_drops_a_change_it_could_not_write(tmp_path, monkeypatch):
    """A full disk at the write: the change is not kept in memory either (a retry must not take it for saved)."""
    import controlplane.state as cpmod

    store = StateStore(tmp_path)
    with store.transaction() as st:
        st.node("node-1").last_generation = 1

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cpmod, "atomic_write", full)
    with pytest.raises(OSError):
        with store.transaction() as st:
            remember_processed(st, "e1", T0)
    assert "e1" not in store.refresh().processed
    assert store.state.nodes["node-1"].last_generation == 1


def test_store_refuses_a_corrupt_file(tmp_path):
    (tmp_path / "state.json").write_text("{not json")
    with pytest.raises(StateError, match="move it away"):
        StateStore(tmp_path)


# ----------------------------------------------------------------------------- keys


def test_cp_key_is_private_and_pub_matches(tmp_path):
    key, pub = load_or_create_cp_key(tmp_path)
    assert stat.S_IMODE((tmp_path / "cp.key").stat().st_mode) == 0o600
    assert pub == tmp_path / "cp.pub"
    assert key_id(load_public_key_file(pub)) == key_id(key)
    pub.write_text("stale")
    again, _ = load_or_create_cp_key(tmp_path)
    assert key_id(again) == key_id(key)
    assert key_id(load_public_key_file(pub)) == key_id(key)  # rewritten


def test_cp_key_readable_by_others_is_refused(tmp_path):
    load_or_create_cp_key(tmp_path)
    (tmp_path / "cp.key").chmod(0o644)
    with pytest.raises(KeyFileError, match="readable by others"):
        load_or_create_cp_key(tmp_path)


def test_cp_key_symlink_is_refused(tmp_path):
    load_or_create_cp_key(tmp_path / "real")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "cp.key").symlink_to(tmp_path / "real" / "cp.key")
    with pytest.raises(KeyFileError, match="symlink"):
        load_or_create_cp_key(tmp_path / "other")


def test_a_fifo_at_the_key_path_is_refused_at_once(tmp_path):
    """A FIFO named like the key used to block the process on open() for good."""
    import os
    import threading

    os.mkfifo(tmp_path / "cp.key", 0o600)
    outcome: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(outcome, lambda: load_or_create_cp_key(tmp_path)), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "loading the key blocked on a FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], KeyFileError) and "not a regular file" in str(outcome[0])


def _catch(out: list[BaseException], fn) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        out.append(exc)


# ----------------------------------------------------------------------------- the log line


@pytest.mark.parametrize(
    ("atom", "short"),
    [
        (GPU0, "GPU-5f1c…0001"),
        (GPU0 + "/gi1/ci0", "GPU-5f1c…0001/gi1/ci0"),
        (GPU0 + "/slot3", "GPU-5f1c…0001/slot3"),
        ("nic.vf/0000:3b:00.1", "nic.vf/0000:3b:00.1"),
    ],
)
def test_short_atom(atom, short):
    assert short_atom(atom) == short


def _rec(**kw) -> EventRecord:
    base = dict(received_at=T0, time=T0, node_id="node-1", type="bound", event_id="e1", outcome="applied")
    base.update(kw)
    return EventRecord(**base)


def test_format_line_verified_bound():
    line = format_line(
        _rec(verified=True, allocation_id="whole", reservation_id="rsv-whole", generation=1, detail="GPU-5f1c…0001", state="active")
    )
    # the clock part is local time; the rest is fixed
    assert line[8:] == " node-1  bound     whole (rsv-whole) gen 1  GPU-5f1c…0001  verified -> active"


def test_format_line_rejected_and_duplicate_and_plain():
    rej = format_line(_rec(outcome="rejected", verified=False, reason="boot id x was never announced by node-1", allocation_id="a", reservation_id="r", generation=2))
    assert rej.endswith("a (r) gen 2  REJECTED: boot id x was never announced by node-1")
    dup = format_line(_rec(outcome="duplicate", verified=True, allocation_id="a", reservation_id="r", generation=2))
    assert dup.endswith("duplicate e1 (ignored)")
    sec = format_line(
        _rec(type="section", verified=None, generation=3, detail="CONVERGED", event={"event": "section", "section": "devices"})
    )
    assert sec.endswith("section   devices gen 3  CONVERGED  plain")


def test_format_line_keeps_a_multi_line_section_message_on_one_line():
    """Issue 28.8: a FAILED section's message (one failure a line) came out raw in `bcd events`."""
    sec = format_line(
        _rec(type="section", verified=None, generation=4, detail="FAILED: a: overlap\nb: device-missing\n", event={"event": "section", "section": "devices"})
    )
    assert "\n" not in sec and sec.endswith("section   devices gen 4  FAILED: a: overlap; b: device-missing  plain")


def test_a_hold_condition_marks_its_reservation_and_a_foreign_one_is_ignored():
    from shared.schemas import HoldCondition

    st = ControlPlaneState()
    apply_spec(st, _spec(1, ("a", "rsv-a")), T0)
    apply_event(st, "node-1", AllocationBound(allocation_id="a", reservation_id="rsv-a", generation=1, devices=[GPU0]), "e1", T0)
    sick = Condition(type="DevicesHealthy", status="False", reason="XidCritical", message="GPU0: XID 79", since=T0)
    event = HoldCondition(allocation_id="a", reservation_id="rsv-a", generation=1, devices=[GPU0], condition=sick)
    moved = apply_event(st, "node-1", event, "h1", T0)
    assert moved is not None and moved.state == "active" and moved.condition == sick
    assert st.reservations["rsv-a"].condition == sick
    # another node's word on it, or one for another allocation, changes nothing
    assert apply_event(st, "node-2", event, "h2", T0) is None
    assert apply_event(st, "node-1", msgspec.structs.replace(event, allocation_id="b"), "h3", T0) is None
    # a release clears it with the hold
    apply_event(st, "node-1", AllocationReleased(allocation_id="a", reservation_id="rsv-a", generation=2, devices=[GPU0]), "r1", T0)
    assert st.reservations["rsv-a"].condition is None
