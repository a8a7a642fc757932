"""Issue 11 end to end: what was seen when bcd was driven from outside, run again
against a whole node (`bcd up`): the node keeps its pids and keeps working.
"""

from __future__ import annotations

import json
import time

import pytest

from .wholenode import GPU, applied, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MISSING = "GPU-0badcafe-0000-4000-8000-{:012d}"


def test_a_spec_whose_refusals_make_a_long_section_message_is_reported_whole(node):
    """300 failing assignments with 63-character ids: the section message overran its 4,096-character
    bound, the bridge died decoding converger.status on every start and the control plane rejected the
    section event. Now: one bounded section event, accepted; every failure reported; the same pids."""
    pids = node.pids()
    devices = [
        {"allocation_id": f"a{i:03d}" + "x" * 59, "reservation_id": f"r{i:03d}" + "y" * 59, "binding": "BINDING_HOLD", "devices": [MISSING.format(i)]}
        for i in range(300)
    ]
    gen = node.apply({"node_id": "node-1", "devices": [assignment("ok-1", GPU[0]), *devices]})
    st = node.wait_generation(gen, timeout=120)
    section = st["converger"]["section"]
    assert section["state"] == "FAILED"
    assert len(section["message"]) <= 4096 and section["message"].endswith(" more")
    assert node.holds() == {"ok-1"}
    assert {e.allocation_id for e in applied(node, "failed")} == {d["allocation_id"] for d in devices}
    sections = [e for e in node.events() if e.type == "section" and e.event.get("observed_generation") == gen]
    assert sections and all(e.outcome == "applied" for e in sections), [e.reason for e in sections]
    assert not [e for e in node.events() if e.outcome == "rejected"]
    assert node.pids() == pids, "no service restarted"
    out = bcd("status", "--state-dir", str(node.state))
    assert out.returncode in (0, 1), out.stderr
    assert f"generation {gen}" in out.stdout or str(gen) in out.stdout

    # the node still takes the next spec
    gen2 = node.apply({"node_id": "node-1", "devices": [assignment("ok-2", GPU[1])]})
    st = node.wait_generation(gen2)
    assert st["converger"]["section"]["state"] == "CONVERGED"
    assert node.holds() == {"ok-2"}
    assert node.pids() == pids


def management_state(node, pci: str) -> str:
    out = bcd("gpu", "list", "--state-dir", str(node.state), "--json")
    try:
        cards = {c["pci_address"]: c for c in json.loads(out.stdout)}
    except (ValueError, KeyError, TypeError):
        return ""
    return cards.get(pci, {}).get("driver_binding", {}).get("management_state", "")


def test_a_refusal_stays_final_after_the_card_is_included_again(node):
    """Refused with overlap on an excluded card at generation G; `bcd gpu include`; still not bound at G."""
    pci = "0000:18:00.0"  # GPU[0] on the example host
    out = bcd("gpu", "exclude", pci, "--state-dir", str(node.state))
    assert out.returncode == 0, out.stderr + out.stdout
    wait_for(lambda: management_state(node, pci) == "Excluded", 30, "the card Excluded")

    gen = node.apply({"node_id": "node-1", "devices": [assignment("late-1", GPU[0]), assignment("ok-1", GPU[1])]})
    st = node.wait_generation(gen)
    assert st["converger"]["section"]["state"] == "FAILED"
    assert [e.event["reason"] for e in applied(node, "failed")] == ["overlap"]

    out = bcd("gpu", "include", pci, "--state-dir", str(node.state))
    assert out.returncode == 0, out.stderr + out.stdout
    # the inventory's change triggers a pass; wait until the card is out of Excluded and a pass ran
    wait_for(lambda: management_state(node, pci) not in ("", "Excluded"), 30, "the card out of Excluded")
    time.sleep(2)
    st = node.wait_generation(gen)
    assert st["converger"]["section"]["state"] == "FAILED"
    assert node.holds() == {"ok-1"}
    assert not [e for e in applied(node, "bound") if e.allocation_id == "late-1"]

    gen2 = node.apply({"node_id": "node-1", "devices": [assignment("late-1", GPU[0]), assignment("ok-1", GPU[1])]})
    st = node.wait_generation(gen2)
    assert st["converger"]["section"]["state"] == "CONVERGED"
    assert node.holds() == {"ok-1", "late-1"}
