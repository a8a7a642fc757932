"""A hold's files removed or changed from outside are put back within seconds, with no second Bound (issue 28.3).

Before, a hold whose CDI spec was removed vanished from `bcd status` (card
Unclaimed, CONVERGED, doctor ok) until the next generation or the 10-minute
drift pass. Now the converger looks at the hold directories every
`--watch-interval` (2 s) and a change no pass made wakes a pass, which puts
back the hold as it was bound (unreported): a whole node (`bcd up` on the
fake host) gets its spec, env file and consumer copy back in seconds, says
so in its log, and the control plane still has one Bound per hold.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from .wholenode import GPU, Node, applied, assignment, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_files_removed_and_edited_from_outside_are_put_back_within_seconds_without_a_second_bound(node: Node) -> None:
    gen = node.apply({"node_id": "node-1", "devices": [assignment("job-a", GPU[2]), assignment("job-b", GPU[3], cpus="0-1", memory_bytes=1 << 30)]})
    node.wait_generation(gen)
    spec = node.state / "cdi" / "bcd-job-a.json"
    env = node.state / "run" / "allocations" / "job-b.env"
    copy = node.state / "run" / "cdi" / "bcd-job-b.json"
    before = {p: p.read_bytes() for p in (spec, env, copy)}
    bound_before = sorted(e.event_id for e in applied(node, "bound"))
    assert bound_before == [f"node-1.job-a.bound.g{gen}", f"node-1.job-b.bound.g{gen}"]

    removed_at = time.monotonic()
    spec.unlink()
    env.unlink()
    copy.write_text(copy.read_text().replace('"env": [', '"env": ["INJECTED=1", ', 1))
    wait_for(lambda: all(p.exists() and p.read_bytes() == before[p] for p in before), 20, "the three files put back as they were")
    took = time.monotonic() - removed_at
    assert took < 15, f"put back after {took:.1f} s"

    st = node.status()
    assert st["converger"]["drift"] == [], st["converger"]["drift"]
    assert {h["allocation_id"] for h in st["converger"]["holds"]} == {"job-a", "job-b"}
    time.sleep(1)  # what the control plane got: still one Bound per hold, no Released
    assert sorted(e.event_id for e in applied(node, "bound")) == bound_before
    assert applied(node, "released") == []
    log = [json.loads(line) for line in (node.state / "logs" / "converger.log").read_text().splitlines() if line.startswith("{")]
    assert any(r["msg"] == "hold directories changed outside a pass: a pass puts them right" for r in log)

    # edits that still parse (issue 41.1): the env file names another card, the spec hands out
    # every GPU; found by content within seconds, put back byte for byte, counted, no new Bound
    env_a = node.state / "run" / "allocations" / "job-a.env"
    copy_a = node.state / "run" / "cdi" / "bcd-job-a.json"
    before = {p: p.read_bytes() for p in (spec, env_a, copy_a)}
    text = spec.read_text()
    assert "NVIDIA_VISIBLE_DEVICES=" in text
    edited_spec = text.replace("NVIDIA_VISIBLE_DEVICES=", "NVIDIA_VISIBLE_DEVICES=all,", 1).replace("/dev/nvidia2", "/dev/nvidia3")
    uuid_a, other = GPU[2].removeprefix("GPU-"), GPU[5].removeprefix("GPU-")
    assert uuid_a in env_a.read_text()
    edited_at = time.monotonic()
    spec.write_text(edited_spec)
    env_a.write_text(env_a.read_text().replace(uuid_a, other))
    wait_for(lambda: all(p.read_bytes() == before[p] for p in before), 20, "the edited spec and env file put back byte for byte")
    took = time.monotonic() - edited_at
    assert took < 15, f"put back after {took:.1f} s"
    metrics = json.loads((node.state / "node.json").read_text())["metrics"]["converger"]
    with urllib.request.urlopen(metrics, timeout=5) as resp:
        counted = {
            line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in resp.read().decode().splitlines()
            if line.startswith("bcd_hold_drift_total{")
        }
    assert counted.get('file="cdi"', 0) >= 1 and counted.get('file="allocation-env"', 0) >= 1, counted
    time.sleep(1)
    assert sorted(e.event_id for e in applied(node, "bound")) == bound_before
    assert applied(node, "released") == []
    assert node.status()["converger"]["drift"] == []


def test_a_slice_record_edited_from_outside_is_put_back_within_seconds_counted_without_a_second_bound(node: Node) -> None:
    """Issue 41.1, the hold's slice: before, a slice was only checked for existence, so MemoryMax
    raised in a fake slice record stayed raised (and status said nothing)."""
    gen = node.apply({"node_id": "node-1", "devices": [assignment("job-b", GPU[3], cpus="0-1", memory_bytes=1 << 30)]})
    node.wait_generation(gen)
    record = node.state / "run" / "slices" / "bcd-alloc-job.b.slice.json"  # (a "-" of the id is a "." in a slice name)
    saved = record.read_bytes()
    bound_before = sorted(e.event_id for e in applied(node, "bound"))
    doc = json.loads(saved)
    assert doc["properties"]["MemoryMax"] == 1 << 30
    doc["properties"]["MemoryMax"] = 64 << 30
    edited_at = time.monotonic()
    record.write_text(json.dumps(doc))
    wait_for(lambda: record.read_bytes() == saved, 20, "the slice record put back byte for byte")
    took = time.monotonic() - edited_at
    assert took < 15, f"put back after {took:.1f} s"
    metrics = json.loads((node.state / "node.json").read_text())["metrics"]["converger"]
    with urllib.request.urlopen(metrics, timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    assert any(line.startswith('bcd_hold_drift_total{file="slice"}') and float(line.rsplit(" ", 1)[1]) >= 1 for line in lines), [
        line for line in lines if line.startswith("bcd_hold_drift_total")
    ]
    time.sleep(1)
    assert sorted(e.event_id for e in applied(node, "bound")) == bound_before
    assert applied(node, "released") == []
    assert node.status()["converger"]["drift"] == []
