"""A Kubernetes release on a host with no kubelet is shown and has a way out (issue 28.6).

Before, on such a host the release stayed pending for ever (an unreachable
kubelet counts as holding the devices) and was hidden: the card showed
`Managed -`, `bcd apply --wait` printed nothing for the released hold, and a
new hold on the card failed `overlap ... (pending Kubernetes release)`. Now
`bcd status` shows the card held by the pending release, with how long and
the way out; `bcd apply --wait` says it; and `bcd releases --free` (the
operator's word that no pod holds the devices) gets its Released reported and
the card free again.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _kube(alloc: str, gpu: str) -> dict:
    return {**assignment(alloc, gpu), "binding": "BINDING_KUBERNETES"}


def test_a_release_with_no_kubelet_is_shown_and_freed_by_the_operator(node: Node, tmp_path) -> None:
    gen = node.apply({"node_id": "node-1", "devices": [_kube("k1", GPU[2])]})
    node.wait_generation(gen)
    copy = node.state / "run" / "cdi" / "bcd-k1.json"
    withdrawn = copy.read_bytes()  # an old-CDI runtime resolves k1's device through it

    spec = tmp_path / "drop.json"
    spec.write_text(json.dumps({"node_id": "node-1", "devices": [assignment("other", GPU[0])]}))
    out = bcd("apply", str(spec), "--state-dir", str(node.state), "--wait", "--wait-timeout", "60", timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    said = out.stdout + out.stderr
    assert "releasing k1 (rsv-k1)" in said and "released once no pod holds its devices" in said, said

    status = bcd("status", "--state-dir", str(node.state))
    row = next(line for line in status.stdout.splitlines() if line.startswith("2    "))
    assert "k1 (pending Kubernetes release)" in row, status.stdout
    assert "  releasing k1 (rsv-k1) gen" in status.stdout and "`bcd releases --free k1`" in status.stdout, status.stdout
    assert applied(node, "released") == []

    # issue 41.3: the copy went with the withdrawal; put back from outside while the release is
    # pending (a downgrade and back left one), it goes again within seconds, not at a restart
    assert not copy.exists()
    copy.write_bytes(withdrawn)
    wait_for(lambda: not copy.exists(), 20, "the withdrawn hold's consumer copy removed again")

    # a new hold on that card still waits for it: the card is claimed, and says by whom
    spec.write_text(json.dumps({"node_id": "node-1", "devices": [assignment("other", GPU[0]), assignment("new", GPU[2])]}))
    out = bcd("apply", str(spec), "--state-dir", str(node.state), "--wait", "--wait-timeout", "60", timeout=90)
    assert out.returncode == 1 and "k1 (pending Kubernetes release)" in out.stdout + out.stderr, out.stdout + out.stderr

    # the way out on a host with no kubelet
    freed = bcd("releases", "--state-dir", str(node.state), "--free", "k1")
    assert freed.returncode == 0, freed.stdout + freed.stderr
    assert "k1: you assert no pod holds" in freed.stdout
    wait_for(lambda: [e.event_id for e in applied(node, "released")] == [f"node-1.k1.released.g{gen + 1}"], 30, "k1's Released")
    assert not (node.state / "data" / "releases-freed" / "k1").exists()
    copy.write_bytes(withdrawn)  # ... and after the release was reported
    wait_for(lambda: not copy.exists(), 20, "the released hold's consumer copy removed again")
    again = bcd("status", "--state-dir", str(node.state))
    assert "releasing k1" not in again.stdout and "pending Kubernetes release" not in again.stdout, again.stdout
    # an allocation that is not a pending release is refused, naming what is
    wrong = bcd("releases", "--state-dir", str(node.state), "--free", "nope")
    assert wrong.returncode == 2 and "no pending Kubernetes release of nope" in wrong.stderr


def _gpu_states(node: Node, pci: str) -> list[str]:
    """The managementState upstream heard for the card, in order."""
    return [(e.event or {}).get("management_state", "") for e in applied(node, "gpu") if (e.event or {}).get("pci_address") == pci]


def _drift_counts(node: Node) -> dict[str, float]:
    metrics = json.loads((node.state / "node.json").read_text())["metrics"]["converger"]
    with urllib.request.urlopen(metrics, timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return {
        line.split('file="', 1)[1].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("bcd_hold_drift_total{")
    }


@pytest.mark.parametrize("binding", ["BINDING_KUBERNETES", "BINDING_HOLD"])
def test_a_released_holds_files_put_back_are_a_stale_copy(node: Node, binding: str) -> None:
    """D3: the tester's steps. A hold's spec, consumer copy and env file saved, the hold released
    (a Kubernetes one freed with `bcd releases --free`), then the files put back: they go within
    seconds, counted as drift, and nothing else happens: no pending release, no second Released,
    the card never Managed again upstream, the section converged."""
    pci = "0000:5d:00.0"
    hold = {**assignment("k8s-a", GPU[3]), "binding": binding}
    gen = node.apply({"node_id": "node-1", "devices": [hold]})
    node.wait_generation(gen)
    files = [
        node.state / "cdi" / "bcd-k8s-a.json",
        node.state / "run" / "cdi" / "bcd-k8s-a.json",
        node.state / "run" / "allocations" / "k8s-a.env",
    ]
    saved = {f: f.read_bytes() for f in files}
    released = node.apply({"node_id": "node-1", "devices": []})
    node.wait_generation(released)
    if binding == "BINDING_KUBERNETES":
        freed = bcd("releases", "--state-dir", str(node.state), "--free", "k8s-a")
        assert freed.returncode == 0, freed.stdout + freed.stderr
    event = f"node-1.k8s-a.released.g{released}"
    wait_for(lambda: [e.event_id for e in applied(node, "released")] == [event], 30, "k8s-a's Released")
    wait_for(lambda: _gpu_states(node, pci)[-1:] == ["Unclaimed"], 30, "the card free upstream")
    heard = len(_gpu_states(node, pci))
    counts = _drift_counts(node)

    for f, data in saved.items():
        f.write_bytes(data)
    wait_for(lambda: not any(f.exists() for f in files), 20, "the released hold's files removed again")
    time.sleep(4)  # a pass or two more: nothing else may follow
    assert not any(f.exists() for f in files)
    assert _gpu_states(node, pci)[heard:] == [], _gpu_states(node, pci)
    assert [e.event_id for e in applied(node, "released")] == [event]
    status = bcd("status", "--state-dir", str(node.state))
    assert "k8s-a" not in status.stdout, status.stdout
    assert status.returncode == 0, status.stdout + status.stderr
    releases = bcd("releases", "--state-dir", str(node.state))
    assert "k8s-a" not in releases.stdout, releases.stdout
    after = _drift_counts(node)
    assert {k: after[k] - counts.get(k, 0) for k in ("cdi", "cdi-consumer", "allocation-env")} == {"cdi": 1, "cdi-consumer": 1, "allocation-env": 1}
    assert (node.section() or {}).get("state") == "CONVERGED"
