"""`bcd apply --dry-run` says what the pass does (bcd/dryrun.py's summarize_plan, on the kit's real files).

Issue 28.1: a changed assignment of a held allocation was shown `keep` while the
hold stayed on its old devices; now the plan releases and binds it again and the
dry run says `rebind` with what changed; a hold that waits for its old hold's
pending Kubernetes release is shown `wait`, not `keep`.
"""

from __future__ import annotations

from pathlib import Path

from bcd.dryrun import render_dry_run, summarize_plan
from tests.converger_kit import GPU, FakeReaper, Node, hold, spec

G = GPU


def _summary(node: Node, s):  # noqa: ANN001, ANN202
    observed = node.observe(s)
    from services.converger.plan import plan

    return summarize_plan(s, plan(s, observed, node.config), dict(observed.holds), [])


async def test_a_changed_assignment_is_a_rebind_in_the_dry_run(tmp_path: Path) -> None:
    node = Node(tmp_path)
    await node.converge(spec(1, hold("job-a", G[2]), hold("same", G[0])))
    d = _summary(node, spec(2, hold("job-a", G[3]), hold("same", G[0])))
    by = {h.allocation_id: h for h in d.holds}
    assert [h.action for h in d.holds] == ["rebind", "keep"]
    assert by["job-a"].devices == [G[3]]
    assert f"devices {G[2]} -> {G[3]}" in by["job-a"].message
    text = render_dry_run(d)
    assert "  rebind   job-a (rsv-job-a)  GPU-5f1c…0004" in text
    assert "would be: CONVERGED (0 bind, 1 rebind, 1 keep, 0 release, 0 refuse)" in text
    # and the apply does what it said: the hold is on the new card afterwards
    _, r = await node.converge(spec(2, hold("job-a", G[3]), hold("same", G[0])))
    assert not r.errors and node.holds()["job-a"]["devices"][0]["annotations"]["bcd.dev/device-id"] == G[3]


async def test_a_hold_waiting_for_its_pending_release_is_a_wait_in_the_dry_run(tmp_path: Path) -> None:
    node = Node(tmp_path, reaper=FakeReaper(pod_atoms={G[2]}), supported_bindings=frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"}))
    await node.converge(spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")))
    await node.converge(spec(2, hold("k1", G[3], binding="BINDING_KUBERNETES")))
    d = _summary(node, spec(2, hold("k1", G[3], binding="BINDING_KUBERNETES")))
    assert [(h.allocation_id, h.action) for h in d.holds] == [("k1", "wait")]
    assert d.state == "PROGRESSING" and "k1: waits for its pending Kubernetes release" in d.message


async def test_a_hold_whose_spec_went_from_outside_is_a_restore_in_the_dry_run(tmp_path: Path) -> None:
    """Issue 28.3: the dry run said `bind job-a` for a hold the node puts back unreported (and apply said kept)."""
    node = Node(tmp_path)
    s = spec(1, hold("job-a", G[2]))
    await node.converge(s)
    (node.cdi_dir / "bcd-job-a.json").unlink()
    d = _summary(node, s)
    assert [(h.allocation_id, h.action) for h in d.holds] == [("job-a", "restore")]
    assert "put back as bound at generation 1, not reported again" in d.holds[0].message
    sends = node.outbox.sends
    _, r = await node.converge(s)
    assert not r.errors and "job-a" in node.holds() and node.outbox.sends == sends
