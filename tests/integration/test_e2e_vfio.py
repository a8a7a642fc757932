"""VFIO passthrough end to end, through the upstream contract only (issue 6).

`bcd up` on a fake host: specs go in through `bcd apply`; what the control
plane received is read back from its event log. The vfio_switcher runs its
fake backend, which plays the kernel on the fake host file, so the inventory
sees every switch the way it would see sysfs change.
"""

from __future__ import annotations

import json
import uuid

import pytest

from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PCI = {1: "0000:2a:00.0", 2: "0000:3a:00.0"}


def host_gpu(node: Node, pci: str) -> dict:
    return next(g for g in json.loads(node.host.read_text())["gpus"] if g["pci_address"] == pci)


def edit_host(node: Node, pci: str, **fields) -> None:
    host = json.loads(node.host.read_text())
    for g in host["gpus"]:
        if g["pci_address"] == pci:
            g.update(fields)
    node.host.write_text(json.dumps(host, indent=1))


def gpu_events(node: Node, pci: str) -> list[dict]:
    return [e.event for e in node.events() if e.type == "gpu" and e.event and e.event.get("pci_address") == pci]


def gpu_list(node: Node) -> dict[str, dict]:
    out = bcd("gpu", "list", "--state-dir", str(node.state), "--json")
    return {g["pci_address"]: g for g in json.loads(out.stdout)} if out.returncode == 0 else {}


def condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def spec(*devices: dict, instances: list[dict] | None = None) -> dict:
    return {"node_id": "node-1", "devices": list(devices), "instances": instances or []}


def test_a_vm_claim_switches_a_card_a_hold_on_it_is_refused_and_the_card_returns(node):
    pci = PCI[1]
    vm = [{"instance_id": "vm-1", "gpus": [pci]}]

    # a VM claims GPU 1: the converger asks the switcher, the card goes to vfio-pci
    gen = node.apply(spec(assignment("train", GPU[0]), instances=vm))
    node.wait_generation(gen)
    wait_for(lambda: host_gpu(node, pci)["driver"] == "vfio-pci", 30, "GPU 1 on vfio-pci")
    wait_for(
        lambda: any(e["reason"] == "VFIOPrepareSucceeded" for e in gpu_events(node, pci)),
        30,
        "VFIOPrepareSucceeded reported upstream",
    )
    last = wait_for(
        lambda: (ev := gpu_events(node, pci)) and ev[-1]["phase"] == "Passthrough" and ev[-1]["management_state"] == "Managed" and ev[-1],
        30,
        "GPU 1 reported Passthrough and Managed upstream",
    )
    assert last["status"]["driver_binding"]["driver"] == "vfio-pci"
    assert condition(last["status"], "Managed")["reason"] == "BackingAllocation"
    assert gpu_list(node)[pci]["phase"] == "Passthrough"

    # a hold on the VM's card is refused with overlap, naming the instance
    gen = node.apply(spec(assignment("train", GPU[0]), assignment("grab", GPU[1]), instances=vm))
    node.wait_generation(gen)
    failed = [e for e in applied(node, "failed") if e.allocation_id == "grab"]
    assert failed and failed[-1].event["reason"] == "overlap", failed
    assert "vm-1" in failed[-1].event["message"]
    assert "grab" not in node.holds()

    # the claim goes: the card returns to its native driver and reads Unclaimed
    gen = node.apply(spec(assignment("train", GPU[0])))
    node.wait_generation(gen)
    wait_for(lambda: host_gpu(node, pci)["driver"] == "nvidia", 30, "GPU 1 back on nvidia")
    wait_for(
        lambda: (ev := gpu_events(node, pci)) and ev[-1]["phase"] == "Ready" and ev[-1]["management_state"] == "Unclaimed",
        30,
        "GPU 1 reported Ready and Unclaimed upstream",
    )
    # and a hold on it binds now
    gen = node.apply(spec(assignment("train", GPU[0]), assignment("grab", GPU[1])))
    node.wait_generation(gen)
    assert "grab" in node.holds()
    assert node.holds() == {"train", "grab"}


@pytest.fixture
def quick_node(tmp_path):
    """A node whose inventory re-evaluates twice a second while a GPU timer or disruption runs."""
    n = Node(tmp_path, env={"BCD_GPU_TICK": "0.5"}).start()
    try:
        yield n
    finally:
        n.stop()


def test_a_switch_that_cannot_roll_back_needs_a_reboot_and_clears_after_one(quick_node):
    node = quick_node
    pci = PCI[2]
    # the kernel's unbind hangs and leaves the card with no driver: no way back
    edit_host(node, pci, faults={"unbind": "hang-unbound"})
    gen = node.apply(spec(instances=[{"instance_id": "vm-2", "gpus": [pci]}]))
    node.wait_generation(gen)
    wait_for(lambda: any(e["reason"] == "VFIOPrepareFailed" for e in gpu_events(node, pci)), 60, "VFIOPrepareFailed upstream")
    ev = wait_for(
        lambda: (ev := gpu_events(node, pci))
        and (c := condition(ev[-1]["status"], "Reconfiguring"))
        and c["reason"] == "RebootRequested"
        and ev,
        60,
        "Reconfiguring walked to RebootRequested",
    )
    reasons = [c["reason"] for e in ev if (c := condition(e["status"], "Reconfiguring"))]
    assert reasons.index("DisruptionRequired") < reasons.index("DisruptionPending") < reasons.index("RebootRequested")
    required = next(e for e in ev if (c := condition(e["status"], "Reconfiguring")) and c["reason"] == "DisruptionRequired")
    msg = condition(required["status"], "Reconfiguring")["message"]
    assert pci in msg and "reboot" in msg
    st = bcd("status", "--state-dir", str(node.state))
    assert st.returncode == 1 and pci in st.stdout and "reboot" in st.stdout, st.stdout
    assert host_gpu(node, pci)["driver"] == ""

    # a reboot: the node goes down, comes back with a new boot id and the card on its base driver
    node.stop()
    host = json.loads(node.host.read_text())
    host["boot_id"] = str(uuid.uuid4())
    node.host.write_text(json.dumps(host))
    edit_host(node, pci, driver="nvidia", driver_override="")
    node.start()
    # Completing, then cleared; the VM claim is still in the spec, so the card goes to vfio-pci again
    wait_for(
        lambda: any((c := condition(e["status"], "Reconfiguring")) and c["reason"] == "Completing" for e in gpu_events(node, pci)),
        60,
        "Reconfiguring Completing after the reboot",
    )
    wait_for(
        lambda: (ev := gpu_events(node, pci)) and condition(ev[-1]["status"], "Reconfiguring") is None and ev[-1]["phase"] == "Passthrough",
        60,
        "the disruption cleared and the card in Passthrough",
    )
    assert host_gpu(node, pci)["driver"] == "vfio-pci"
    assert bcd("status", "--state-dir", str(node.state)).returncode == 0


def gpu_cmd(node: Node, action: str, pci: str):
    return bcd("gpu", action, pci, "--state-dir", str(node.state))


def test_exclude_include_and_a_reclaim_of_an_orphaned_card_through_bcd_gpu(tmp_path):
    # short orphan grace so the 2-minute rule runs in seconds; the rule itself is table-tested on fake time
    node = Node(tmp_path, env={"BCD_ORPHAN_GRACE": "3", "BCD_GPU_TICK": "0.5", "BCD_RESCAN_INTERVAL": "1"}).start()
    try:
        free, orphan = PCI[1], PCI[2]

        # refusals name what is wrong
        # (a short address means the listed card: `3a:00.0` is 0000:3a:00.0; one not listed is exit 2)
        short = gpu_cmd(node, "reclaim", "3a:00.0")
        assert short.returncode == 1 and short.stdout.startswith("reclaim 0000:3a:00.0: REFUSED"), short.stdout
        bad = gpu_cmd(node, "reclaim", "3a:01.0")
        assert bad.returncode == 2 and "no card 3a:01.0 on node node-1" in bad.stderr, bad.stderr
        unclaimed = gpu_cmd(node, "reclaim", free)
        assert unclaimed.returncode == 1 and "managementState is Unclaimed" in unclaimed.stdout, unclaimed.stdout

        # exclude: a new hold on the card is refused, naming the operator; include: it binds
        out = gpu_cmd(node, "exclude", free)
        assert out.returncode == 0 and "Excluded" in out.stdout, out.stdout
        gen = node.apply(spec(assignment("want", GPU[1])))
        node.wait_generation(gen)
        failed = [e for e in applied(node, "failed") if e.allocation_id == "want"]
        assert failed and failed[-1].event["reason"] == "overlap" and "excluded by the operator" in failed[-1].event["message"]
        assert gpu_cmd(node, "include", free).returncode == 0
        gen = node.apply(spec(assignment("want", GPU[1])))
        node.wait_generation(gen)
        assert "want" in node.holds()

        # someone binds card 2 to vfio-pci behind bcd's back: OrphanPending, then Orphaned
        edit_host(node, orphan, driver="vfio-pci", driver_override="vfio-pci")
        wait_for(lambda: gpu_list(node).get(orphan, {}).get("phase") == "Passthrough", 30, "card 2 seen on vfio-pci")
        held = gpu_cmd(node, "reclaim", orphan)
        if "Held" in held.stdout or "held" in held.stdout:
            assert held.returncode == 0, held.stdout  # held while the grace period runs; it starts by itself
        else:
            assert held.returncode == 0 and "admitted" in held.stdout, held.stdout
        # the converger switches it back for the reclaim; the inventory reports Succeeded
        wait_for(lambda: host_gpu(node, orphan)["driver"] == "nvidia", 60, "card 2 returned to nvidia")
        wait_for(
            lambda: (c := condition(gpu_list(node).get(orphan, {}), "Reclaim")) and c["reason"] == "Succeeded",
            30,
            "Reclaim Succeeded",
        )
        ev = gpu_events(node, orphan)
        managed = [condition(e["status"], "Managed")["reason"] for e in ev if condition(e["status"], "Managed")]
        assert "OrphanPending" in managed and "Orphaned" in managed, managed
        reclaim = [condition(e["status"], "Reclaim")["reason"] for e in ev if condition(e["status"], "Reclaim")]
        assert reclaim[-1] == "Succeeded" and "InProgress" in reclaim, reclaim
        assert ev[-1]["management_state"] == "Unclaimed"
    finally:
        node.stop()


def test_status_and_doctor_name_the_command_for_an_orphaned_card_and_no_stale_refusal_stays(tmp_path):
    """Issue 12: `status`/`doctor` exited 0 with a card Passthrough/Orphaned, and after `bcd gpu include`
    a stale `Reclaim=False/Refused ... managementState is Excluded` stayed on the card."""
    node = Node(tmp_path, env={"BCD_ORPHAN_GRACE": "2", "BCD_GPU_TICK": "0.5", "BCD_RESCAN_INTERVAL": "1"}).start()
    try:
        free, orphan = PCI[1], PCI[2]
        state = ("--state-dir", str(node.state))
        # the converger runs its passes (and so a reclaim's switch back) once the node has a spec
        node.wait_generation(node.apply(spec()))
        wait_for(lambda: bcd("status", *state).returncode == 0, 30, "a healthy node")

        # exclude -> reclaim (refused: Excluded) -> include: the refusal goes with the state it named
        assert gpu_cmd(node, "exclude", free).returncode == 0
        refused = gpu_cmd(node, "reclaim", free)
        assert refused.returncode == 1 and "managementState is Excluded" in refused.stdout, refused.stdout
        # on its compute driver there is nothing to reclaim: the refusal goes to the reply only (issue 41.10)
        assert condition(gpu_list(node)[free], "Reclaim") is None
        assert gpu_cmd(node, "include", free).returncode == 0
        card = gpu_list(node)[free]
        assert card["driver_binding"]["management_state"] == "Unclaimed", card
        assert condition(card, "Reclaim") is None, card

        # a card put on vfio-pci behind bcd's back: Orphaned once the grace period is over
        edit_host(node, orphan, driver="vfio-pci", driver_override="vfio-pci")
        wait_for(lambda: gpu_list(node).get(orphan, {}).get("driver_binding", {}).get("management_state") == "Orphaned", 30, "card 2 Orphaned")
        command = f"bcd gpu reclaim {orphan}"
        st = bcd("status", *state)
        assert st.returncode == 1, st.stdout
        assert "needs a person:" in st.stdout and f"GPU {orphan} Orphaned" in st.stdout and f"run: {command}" in st.stdout, st.stdout
        doc = json.loads(bcd("status", *state, "--json").stdout)
        assert any(p.startswith(f"GPU {orphan} Orphaned") and f"run `{command}`" in p for p in doc["problems"]), doc["problems"]
        doctor = bcd("doctor", *state)
        assert doctor.returncode == 1, doctor.stdout
        assert any(line.startswith("FAIL") and f"GPU {orphan} Orphaned" in line and command in line for line in doctor.stdout.splitlines()), doctor.stdout
        listed = bcd("gpu", "list", *state)
        assert f"needs a person: run {command}" in listed.stdout, listed.stdout

        # the operator runs it: once the card is back on its driver, nothing needs a person
        reclaimed = gpu_cmd(node, "reclaim", orphan)
        assert reclaimed.returncode == 0, reclaimed.stdout
        wait_for(lambda: (c := condition(gpu_list(node).get(orphan, {}), "Reclaim")) and c["reason"] == "Succeeded", 60, "Reclaim Succeeded")
        wait_for(lambda: bcd("status", *state).returncode == 0, 30, "status healthy again")
        assert bcd("doctor", *state).returncode == 0
    finally:
        node.stop()
