"""Maintenance that never takes a held card (issue 16): `bcd gpu reset` and `bcd gpu diag` on a whole
node (`bcd up` on a fake host), through the converger's journal, the switcher's reset and the
inventory's diagnostic.

Refused on a card that a live hold, a Kubernetes hold (the device plugin's), a pending Kubernetes
release, an instance spec or a running domain names, with the holder named as `overlap` names it;
a level-1 diagnostic runs beside them; each success and failure; a card under maintenance refuses
new holds; a kill -9 of the converger mid-diagnostic ends it as Interrupted and frees the card.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .harness import EXAMPLE_HOSTS
from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PCI = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]


def kube(alloc: str, *devices: str) -> dict:
    return {**assignment(alloc, *devices), "binding": "BINDING_KUBERNETES"}


def gpu(node: Node, *args: str, timeout: float = 60):
    return bcd("gpu", *args, "--state-dir", str(node.state), timeout=timeout)


def ops(node: Node) -> list[dict]:
    """The converger's maintenance records; none while it does not answer (a restart)."""
    conv = node.status().get("converger")
    return conv["gpu_ops"] if conv else []


def converger_metrics(node: Node) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    addr = node.ping()["converger"]["metadata"]["metrics"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def maint_node(tmp_path):
    host = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
    host["processes"] = []
    host["domains"] = [{"name": "build-vm-01", "gpus": [PCI[3]]}]
    cards = {g["pci_address"]: g for g in host["gpus"]}
    cards[PCI[5]]["diag"], cards[PCI[5]]["diag_message"] = "fail", "Memory test: 3 uncorrectable ECC errors"
    cards[PCI[6]]["faults"] = {"reset": "fail"}
    cards[PCI[7]]["faults"] = {"reset": "unsupported"}
    cards[PCI[4]]["diag_seconds"] = 6
    (tmp_path / "host.json").write_text(json.dumps(host))
    node = Node(tmp_path, host=tmp_path / "host.json").start()
    try:
        yield node
    finally:
        node.stop()


def test_reset_and_diag_refuse_every_kind_of_holder_and_say_how_they_end(maint_node):
    node = maint_node
    # a plain hold, a Kubernetes hold (what the device plugin advertises), one to be released
    gen = node.apply({"node_id": "node-1", "devices": [assignment("a1", GPU[0]), kube("k1", GPU[1]), kube("k2", GPU[2])]})
    node.wait_generation(gen)
    # k2 dropped: no kubelet answers, so its release stays pending (unreachable counts as held)
    gen = node.apply({"node_id": "node-1", "devices": [assignment("a1", GPU[0]), kube("k1", GPU[1])], "instances": [{"instance_id": "vm-7", "gpus": [PCI[6]]}]})
    node.wait_generation(gen)

    holders = {
        PCI[0]: "it is held by a1",
        PCI[1]: "it is held by k1",
        PCI[2]: "it is held by k2 (pending Kubernetes release)",
        PCI[3]: "it is held by running domain build-vm-01",
        PCI[6]: "it is held by instance vm-7",
    }
    for pci, why in holders.items():
        for args in (("reset", pci), ("diag", pci, "--level", "2")):
            out = gpu(node, *args)
            assert out.returncode == 1 and f"REFUSED: refused {pci}: {why}" in out.stdout, (args, out.stdout, out.stderr)
    # a level-1 diagnostic is not disruptive: it runs on a held card
    out = gpu(node, "diag", PCI[0], "--level", "1")
    assert out.returncode == 0 and "diag level 1 0000:18:00.0: Passed" in out.stdout, out.stdout + out.stderr

    # a free card is reset, once, by the switcher (the fake kernel counts it)
    out = gpu(node, "reset", PCI[5])
    assert out.returncode == 0 and "reset 0000:ab:00.0: Succeeded" in out.stdout, out.stdout + out.stderr
    resets = {g["pci_address"]: g.get("resets", 0) for g in json.loads(node.host.read_text())["gpus"]}
    assert resets[PCI[5]] == 1 and sum(resets.values()) == 1
    # a failed reset and a card with no reset say so; a failed diagnostic names what failed
    failed = gpu(node, "reset", PCI[7])
    assert failed.returncode == 1 and "reset 0000:db:00.0: Refused" in failed.stdout and "no function reset" in failed.stdout, failed.stdout
    diag = gpu(node, "diag", PCI[5], "--level", "3")
    assert diag.returncode == 1 and "diag level 3 0000:ab:00.0: Failed" in diag.stdout and "3 uncorrectable ECC errors" in diag.stdout, diag.stdout
    bad = gpu(node, "reset", "0000:99:00.0")
    assert bad.returncode == 1 and "the inventory lists no GPU at that address" in bad.stdout

    # kept per card: bcd gpu list, bcd status, the metrics
    listing = gpu(node, "list")
    assert "diag level 3: Failed" in listing.stdout and "reset: Succeeded" in listing.stdout, listing.stdout
    last = {(o["op"], o["pci"]): o for o in ops(node)}
    assert last[("diag", PCI[5])]["outcome"] == "Failed" and last[("reset", PCI[5])]["outcome"] == "Succeeded"
    assert last[("diag", PCI[0])]["outcome"] == "Passed" and last[("reset", PCI[7])]["outcome"] == "Refused"
    status = bcd("status", "--state-dir", str(node.state))
    assert "gpu maintenance:" in status.stdout and "diag level 3 0000:ab:00.0: Failed" in status.stdout
    m = converger_metrics(node)
    assert m[("bcd_gpu_diag_passed", (("level", "3"), ("pci", PCI[5])))] == 0
    assert m[("bcd_gpu_diag_passed", (("level", "1"), ("pci", PCI[0])))] == 1
    assert m[("bcd_gpu_operations_total", (("op", "reset"), ("outcome", "Succeeded")))] == 1
    assert m[("bcd_gpu_operations_total", (("op", "reset"), ("outcome", "Refused")))] == len(holders) + 2  # the holders, no reset, not listed
    assert m[("bcd_gpu_operations_running", (("op", "diag"),))] == 0


def test_a_card_under_maintenance_takes_no_hold_and_a_killed_converger_frees_it(maint_node):
    node = maint_node
    started = gpu(node, "diag", PCI[4], "--level", "2", "--no-wait")
    assert started.returncode == 0, started.stdout + started.stderr
    running = wait_for(lambda: [o for o in ops(node) if o["pci"] == PCI[4] and o["state"] == "running"], 10, "the diagnostic running")
    op_id = running[0]["id"]
    # another operation on it, and a hold on it, are refused naming the diagnostic
    again = gpu(node, "reset", PCI[4])
    assert again.returncode == 1 and f"it is held by maintenance (diagnostic level 2, {op_id})" in again.stdout, again.stdout
    gen = node.apply({"node_id": "node-1", "devices": [assignment("s1", f"{GPU[4]}/slot0")]})
    node.wait_generation(gen)
    failed = wait_for(lambda: [e for e in applied(node, "failed") if e.allocation_id == "s1"], 30, "s1 refused")
    assert failed[-1].event["reason"] == "overlap" and f"maintenance (diagnostic level 2, {op_id})" in failed[-1].event["message"]

    # kill -9 of the converger while it waits: the journal says running; the restart ends it
    os.kill(node.pids()["converger"], signal.SIGKILL)
    done = wait_for(lambda: [o for o in ops(node) if o["id"] == op_id and o["state"] == "done"], 60, "the diagnostic finished after the restart")
    assert done[0]["outcome"] == "Interrupted" and "run it again" in done[0]["message"]
    assert not [o for o in ops(node) if o["state"] == "running"]
    # the card is free again: a new generation binds the hold
    gen = node.apply({"node_id": "node-1", "devices": [assignment("s1", f"{GPU[4]}/slot0")]})
    node.wait_generation(gen)
    wait_for(lambda: "s1" in node.holds(), 30, "s1 bound")
    t0 = time.monotonic()
    out = gpu(node, "diag", PCI[4], "--level", "2")
    assert out.returncode == 1 and "it is held by s1" in out.stdout, out.stdout
    assert time.monotonic() - t0 < 20


def test_the_inventory_killed_mid_diagnostic_is_an_error_and_frees_the_card(maint_node):
    node = maint_node
    started = gpu(node, "diag", PCI[4], "--level", "2", "--no-wait")
    assert started.returncode == 0, started.stdout + started.stderr
    wait_for(lambda: [o for o in ops(node) if o["pci"] == PCI[4] and o["state"] == "running"], 10, "the diagnostic running")
    os.kill(node.pids()["inventory"], signal.SIGKILL)
    done = wait_for(lambda: [o for o in ops(node) if o["pci"] == PCI[4] and o["state"] == "done"], 60, "the diagnostic's end")
    assert done[0]["outcome"] == "Error" and "it restarted while it ran" in done[0]["message"], done
    # the supervisor restarted the inventory: the card is free and the next diagnostic runs
    out = wait_for(lambda: (r := gpu(node, "diag", PCI[5], "--level", "1")).returncode == 1 and "Failed" in r.stdout and r, 60, "a diagnostic after the restart")
    assert "3 uncorrectable ECC errors" in out.stdout
