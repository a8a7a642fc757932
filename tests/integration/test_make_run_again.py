"""A second `make run` on the same state dir keeps what the user made (issue 28.4), and says
nothing upstream of its cards that did not happen (issue 28.7).

Before, `bcd up --apply examples/specs/demo.json` put the demo again at a new
generation on every start, and every hold the user bound since was released
with signed Released events, without a word. Now the demo is put only on a
state dir whose node never got a spec; a later start says it is not applied
again and how to put it.
"""

from __future__ import annotations

import time

import pytest

from .harness import REPO
from .wholenode import GPU, Node, applied, assignment, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

DEMO = REPO / "examples" / "specs" / "demo.json"


def _converged(node: Node, generation: int) -> None:
    node.wait_generation(generation, timeout=90)


def test_a_second_make_run_keeps_the_users_holds(tmp_path) -> None:
    node = Node(tmp_path, "--apply", str(DEMO)).start()
    try:
        wait_for(lambda: node.cp_state().nodes.get("node-1") and node.cp_state().nodes["node-1"].last_generation >= 1, 60, "the demo put")
        _converged(node, 1)
        gen = node.apply({"node_id": "node-1", "devices": [assignment("mine", GPU[2])]})
        _converged(node, gen)
        released = {e.event_id for e in applied(node, "released")}  # the demo's holds the user's spec dropped
        gpu_events = [e.event_id for e in node.events() if e.type == "gpu"]
    finally:
        node.stop()

    again = Node(tmp_path, "--apply", str(DEMO)).start()
    try:
        wait_for(lambda: "is not applied again" in again.log_path.read_text(), 60, "the second start to say it keeps the holds")
        time.sleep(2)  # what a put would have done by now
        assert again.cp_state().nodes["node-1"].last_generation == gen
        assert {h["allocation_id"] for h in again.status()["converger"]["holds"]} == {"mine"}
        assert {e.event_id for e in applied(again, "released")} == released  # nothing released since
        # issue 28.7: a restart said every card Unknown, then its real state: nothing happened to them
        assert [e.event_id for e in again.events() if e.type == "gpu"] == gpu_events
        text = again.log_path.read_text()
        assert f"node-1 already has generation {gen}" in text and f"bcd apply {DEMO}" in text
    finally:
        again.stop()


def test_make_run_is_never_silent_after_a_failed_apply(tmp_path) -> None:
    """Issue 41.5: `make run` said `could not apply examples/specs/demo.json` and then nothing. Now it
    says how to go on and shows the node (the status table, then the verified events)."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"node_id": "node-1", "devices": [')
    node = Node(tmp_path, "--apply", str(bad)).start()
    try:
        wait_for(lambda: "verified events" in node.log_path.read_text(), 60, "the status and the events after the failed apply")
        text = node.log_path.read_text()
        assert f"bcd up: could not apply {bad}: spec: not valid JSON" in text, text
        assert f"bcd up: the node runs on without it: `bcd status --state-dir {node.state}`" in text
        assert f"`bcd apply {bad} --state-dir {node.state}` tries again" in text
        assert node.proc is not None and node.proc.poll() is None  # the node keeps running
    finally:
        node.stop()
