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
            # said once: the verdict is the CLI's, the reason the converger's ("REFUSED: refused ..." before)
            assert out.returncode == 1 and f"{args[0]} {pci}: REFUSED: {why}\n" in out.stdout, (args, out.stdout, out.stderr)
            assert "refused" not in out.stdout.lower().replace("refused:", "", 1), out.stdout
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
    # an address the inventory does not list is an input error (README's exit codes), asked of no service
    for args in (("reset", "0000:99:00.0"), ("diag", "0000:99:00.0", "--level", "1"), ("mig-layout", "zz:zz", "all-disabled")):
        bad = gpu(node, *args)
        assert bad.returncode == 2 and "bcd: gpu " in bad.stderr and bad.stdout == "", (args, bad.stdout, bad.stderr)

    # kept per card: bcd gpu list, bcd status, the metrics
    listing = gpu(node, "list")
    assert "diag level 3: Failed" in listing.stdout and "reset: Succeeded" in listing.stdout, listing.stdout
    last = {(o["op"], o["pci"]): o for o in ops(node)}
    assert last[("diag", PCI[5])]["outcome"] == "Failed" and last[("reset", PCI[5])]["outcome"] == "Succeeded"
    assert last[("diag", PCI[0])]["outcome"] == "Passed" and last[("reset", PCI[7])]["outcome"] == "Refused"
    status = bcd("status", "--state-dir", str(node.state))
    assert "gpu maintenance:" in status.stdout and "diag level 3 0000:ab:00.0: Failed" in status.stdout
    m = converger_metrics(node)
    assert m[("bcd_gpu_diag_passed", (("level", "3"), ("pci_address", PCI[5])))] == 0
    assert m[("bcd_gpu_diag_passed", (("level", "1"), ("pci_address", PCI[0])))] == 1
    assert m[("bcd_gpu_operations_total", (("op", "reset"), ("outcome", "Succeeded")))] == 1
    assert m[("bcd_gpu_operations_total", (("op", "reset"), ("outcome", "Refused")))] == len(holders) + 1  # the holders, no reset (a card not listed never reaches the converger)
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


# --------------------------------------------------------------------------- MIG layouts

G7, G8 = GPU[6], GPU[7]  # the example host's two MIG cards: 0000:ba:00.0 and 0000:db:00.0


def mig_state(node: Node, pci: str) -> dict | None:
    conv = node.status().get("converger") or {}
    return next((m for m in conv.get("mig_layouts", []) if m["pci_address"] == pci), None)


def card(node: Node, pci: str) -> dict:
    return next(g for g in json.loads(node.host.read_text())["gpus"] if g["pci_address"] == pci)


@pytest.fixture
def mig_node(tmp_path):
    host = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())
    host["processes"] = []
    (tmp_path / "host.json").write_text(json.dumps(host))
    # the node's configuration asks card 7 for all-disabled
    node = Node(tmp_path, host=tmp_path / "host.json", env={"BCD_MIG_LAYOUTS": f"{PCI[6]}=all-disabled"}).start()
    try:
        yield node
    finally:
        node.stop()


def test_a_mig_layout_waits_for_the_card_to_be_free_then_a_device_missing_mig_hold_binds(mig_node):
    node = mig_node
    # from the configuration: card 7 is free, so MIG goes off at once
    wait_for(lambda: (m := mig_state(node, PCI[6])) and m["state"] == "Applied" and m, 30, "card 7 all-disabled")
    assert card(node, PCI[6])["mig_mode"] is False and card(node, PCI[6])["mig_instances"] == []

    # card 8: one of its MIG instances is held; m1 wants an instance the layout makes
    gen = node.apply({"node_id": "node-1", "devices": [assignment("m9", f"{G8}/gi9/ci0"), assignment("m1", f"{G8}/gi1/ci0")]})
    node.wait_generation(gen)
    missing = [e for e in applied(node, "failed") if e.allocation_id == "m1"]
    assert missing and missing[-1].event["reason"] == "device-missing"
    out = gpu(node, "mig-layout", PCI[7], "1g.18gb,1g.18gb", "--wait", "3")
    assert out.returncode == 1 and "Pending: waits: 0000:db:00.0 is held by m9" in out.stdout, out.stdout + out.stderr
    assert len(card(node, PCI[7])["mig_instances"]) == 4  # nothing touched while held
    listing = gpu(node, "list", PCI[7])
    assert "MigLayout=False/Pending" in listing.stdout, listing.stdout

    # m9 released: the layout is made; the inventory lists the new instances; m1 binds at the next generation
    gen = node.apply({"node_id": "node-1", "devices": [assignment("m1", f"{G8}/gi1/ci0")]})
    node.wait_generation(gen)
    wait_for(lambda: (m := mig_state(node, PCI[7])) and m["state"] == "Applied" and m, 30, "card 8 applied")
    assert [(m["gi"], m["profile"]) for m in card(node, PCI[7])["mig_instances"]] == [(1, "1g.18gb"), (2, "1g.18gb")]
    gen = node.apply({"node_id": "node-1", "devices": [assignment("m1", f"{G8}/gi1/ci0")]})
    node.wait_generation(gen)
    wait_for(lambda: "m1" in node.holds(), 30, "m1 bound")
    # a PhysicalGPU condition, a gpu event upstream, a metric
    listing = gpu(node, "list", PCI[7])
    assert "MigLayout=True/Applied" in listing.stdout, listing.stdout
    events = wait_for(
        lambda: [e for e in node.events() if e.type == "gpu" and any(c["type"] == "MigLayout" and c["reason"] == "Applied" for c in (e.event or {}).get("status", {}).get("conditions", []))],
        30,
        "a gpu event with MigLayout=Applied",
    )
    assert events[-1].event["pci_address"] in (PCI[6], PCI[7])
    addr = node.ping()["inventory"]["metadata"]["metrics"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'bcd_gpu_condition{pci_address="0000:db:00.0",reason="Applied",status="True",type="MigLayout"} 1.0' in text


def test_mig_layout_refusals_failures_and_a_mode_change_that_needs_a_reset(mig_node):
    node = mig_node
    for args, why in (
        (("mig-layout", PCI[0], "1g.18gb"), "supports no MIG profiles"),
        (("mig-layout", PCI[7], "5g.99gb"), "has no MIG profile 5g.99gb"),
        (("mig-layout", PCI[7], "one,two"), "is not a GPU instance profile"),
    ):
        out = gpu(node, *args)
        assert out.returncode == 1 and "REFUSED" in out.stdout and why in out.stdout, (args, out.stdout, out.stderr)
    # an address the inventory does not list is an input error (README's exit codes), asked of no service
    unlisted = gpu(node, "mig-layout", "0000:99:00.0", "1g.18gb")
    assert unlisted.returncode == 2 and "no card 0000:99:00.0 on node node-1" in unlisted.stderr, (unlisted.stdout, unlisted.stderr)
    usage = gpu(node, "mig-layout", PCI[7])
    assert usage.returncode == 2 and "a LAYOUT is needed" in usage.stderr

    before = card(node, PCI[7])["mig_instances"]

    def fault(kind: str) -> None:
        doc = json.loads(node.host.read_text())
        next(g for g in doc["gpus"] if g["pci_address"] == PCI[7]).setdefault("faults", {})["mig"] = kind
        node.host.write_text(json.dumps(doc))

    # a failure rolls back to what was there, and says so
    fault("fail")
    out = gpu(node, "mig-layout", PCI[7], "3g.71gb,3g.71gb")
    assert out.returncode == 1 and "Failed" in out.stdout and "the card was left rolled back" in out.stdout, out.stdout
    assert card(node, PCI[7])["mig_instances"] == before
    # a rollback that fails too leaves MIG off, and says so
    fault("fail-rollback")
    out = gpu(node, "mig-layout", PCI[7], "7g.141gb")
    assert out.returncode == 1 and "the card was left all-disabled" in out.stdout, out.stdout
    assert card(node, PCI[7])["mig_mode"] is False
    # turning MIG on again waits for a GPU reset: the DisruptionRequired way
    fault("needs-reset")
    out = gpu(node, "mig-layout", PCI[7], "7g.141gb", "--wait", "10")
    assert out.returncode == 1 and "Pending" in out.stdout and "DisruptionRequired" in out.stdout, out.stdout
    # the disruption flow of a driver switch that could not be rolled back: DisruptionRequired, then on
    waiting = ("Reconfiguring=True/DisruptionRequired", "Reconfiguring=True/DisruptionPending", "Reconfiguring=True/RebootRequested")
    listing = wait_for(lambda: (r := gpu(node, "list", PCI[7])) and any(w in r.stdout for w in waiting) and r, 30, "the disruption on the card")
    assert "MigLayout=False/Pending" in listing.stdout
