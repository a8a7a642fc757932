"""`bcd status` and `bcd doctor` verdicts, as tables over a gathered report."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from bcd.client import NodeInfo
from bcd.runtimes import FakeRuntimes, HoldFiles, RuntimeFacts
from bcd.status import NodeReport, doctor_checks, look_at_runtimes, problems, render_status
from shared.jsutil import StreamDepth
from shared.schemas import ConvergerStatus, HoldSummary, SectionStatus
from tests.converger_kit import Node, fast_dir, hold, host_inventory, spec

NOW = datetime(2026, 11, 30, 9, 0, tzinfo=timezone.utc)
SERVICES = ["signer", "inventory", "converger", "gateway_bridge", "kube_reaper"]
GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"


def ping(name: str, **md: str) -> dict:
    return {"name": name, "id": "x", "version": "0.1.0", "metadata": {"node_id": "node-1", **md}}


def report(**kw) -> NodeReport:
    base = dict(
        node_id="node-1",
        reachable=True,
        expected=SERVICES,
        services={n: ping(n, **({"cp_keys": "1"} if n in ("gateway_bridge", "converger") else {})) for n in SERVICES},
        inventory=host_inventory(),
        converger=ConvergerStatus(
            generation=3,
            section=SectionStatus(section="devices", state="CONVERGED", observed_generation=3),
            holds=[HoldSummary(allocation_id="a1", reservation_id="r1", generation=3, binding="BINDING_HOLD", devices=[GPU0])],
            vendor_cdi_spec="/etc/cdi/nvidia.json",
        ),
        outbox=StreamDepth(messages=0, bytes=0, oldest=None),
        now=NOW,
    )
    base.update(kw)
    return NodeReport(**base)


def conv(**kw) -> ConvergerStatus:
    c = report().converger
    assert c is not None
    import msgspec

    return msgspec.structs.replace(c, **kw)


@pytest.mark.parametrize(
    ("name", "changes", "unhealthy"),
    [
        ("healthy", {}, []),
        ("bus-down", {"reachable": False, "error": "node bus nats://x unreachable"}, ["node bus nats://x unreachable"]),
        ("service-down", {"services": {n: ping(n) for n in SERVICES if n != "signer"}}, ["service signer does not answer $SRV.PING"]),
        (
            "retrying",
            {"converger": conv(section=SectionStatus(section="devices", state="PROGRESSING", observed_generation=3, message="a1: cannot write"), next_retry_in_s=12.0)},
            ["devices section PROGRESSING (retrying): a1: cannot write"],
        ),
        ("failed-is-a-refusal-not-ill-health", {"converger": conv(section=SectionStatus(section="devices", state="FAILED", observed_generation=3, message="a9: overlap"))}, []),
        ("outbox-stale", {"outbox": StreamDepth(messages=4, bytes=100, oldest=NOW - timedelta(minutes=5))}, ["outbox not draining: 4 events, oldest 300 s"]),
        ("outbox-fresh", {"outbox": StreamDepth(messages=4, bytes=100, oldest=NOW - timedelta(seconds=5))}, []),
    ],
)
def test_problems(name, changes, unhealthy):
    assert problems(report(**changes)) == unhealthy


def levels(r: NodeReport) -> dict[str, str]:
    return {name: level for level, name, _ in doctor_checks(r)}


@pytest.mark.parametrize(
    ("name", "changes", "expect"),
    [
        ("all-good", {}, {"bus": "ok", "service.signer": "ok", "signed-specs": "ok", "vendor-cdi-spec": "ok"}),
        ("bus-down", {"reachable": False, "error": "down"}, {"bus": "fail"}),
        ("service-down", {"services": {n: ping(n, **({"cp_keys": "1"} if n == "gateway_bridge" else {})) for n in SERVICES if n != "converger"}}, {"service.converger": "fail"}),
        ("unsigned-bridge-of-an-earlier-release", {"services": {n: ping(n, **({"cp_keys": "0"} if n == "gateway_bridge" else {})) for n in SERVICES}}, {"unsigned-specs": "warn"}),
        ("unprivileged-gpu-host", {"converger": conv(privileged=False)}, {"gpu-binding": "warn"}),
        ("no-vendor-spec", {"converger": conv(vendor_cdi_spec="")}, {"vendor-cdi-spec": "warn"}),
        ("section-failed", {"converger": conv(section=SectionStatus(section="devices", state="FAILED", observed_generation=3, message="a9: overlap"))}, {"section": "warn"}),
    ],
)
def test_doctor_checks(name, changes, expect):
    got = levels(report(**changes))
    for check, level in expect.items():
        assert got.get(check) == level, (check, got)
    if name == "all-good":
        assert got["gpu-binding"] == "ok" and "unsigned-specs" not in got  # issue 41.14d: a row, ok or not


def test_render_status_shows_who_holds_each_gpu():
    text = render_status(report())
    lines = text.splitlines()
    assert any(line.startswith("0    0000:18:00.0") and line.endswith("a1") for line in lines)
    assert any("slots slot0:- slot1:- slot2:- slot3:-" in line for line in lines)
    assert any("MIG gi1/ci0:-" in line for line in lines)
    assert "section devices: CONVERGED  observed_generation 3" in text
    assert text.endswith("health: ok")


# ---------------------------------------------------------------------------- GPUs (issue 6)


def _with_status(inv, pci_index: int, **status_kw):
    import msgspec

    from shared.schemas import DriverBinding, PhysicalGPUStatus

    gpus = list(inv.gpus)
    g = gpus[pci_index]
    st = PhysicalGPUStatus(**status_kw)
    gpus[pci_index] = msgspec.structs.replace(g, status=st)
    return msgspec.structs.replace(inv, gpus=gpus), g.pci_address, DriverBinding


def _cond(type_: str, status: str, reason: str, message: str = "m"):
    from shared.schemas import Condition

    return Condition(type=type_, status=status, reason=reason, message=message, since=NOW)


def _binding(mode: str = "Compute", state: str = "Unclaimed", driver: str = "nvidia"):
    from shared.schemas import DriverBinding

    return DriverBinding(driver=driver, mode=mode, management_state=state)


VFIO_ORPHAN = dict(mode="Passthrough", state="Orphaned", driver="vfio-pci")
ORPHANED = _cond("Managed", "False", "Orphaned", "bound to vfio-pci with no claim for 2m0s or more without a break")

XID_79 = "XidCritical: XID 79 (GPU has fallen off the bus) at 2026-12-03T10:00:00Z"

#: (name, phase, driverBinding, conditions, ATTENTION_ROWS row or None, line words, action words, action is a command)
ATTENTION_CASES = [
    # nothing to do: it resolves by itself, or it is what the operator chose
    ("nothing-to-do", "Ready", _binding(), [_cond("AdapterReady", "True", "DriverReady")], None, "", "", False),
    ("completing-is-fine", "Reconfiguring", _binding(), [_cond("Reconfiguring", "True", "Completing")], None, "", "", False),
    ("reclaim-refused-is-an-answer", "Ready", _binding(), [_cond("Reclaim", "False", "Refused")], None, "", "", False),
    ("reclaim-succeeded", "Ready", _binding(), [_cond("Reclaim", "True", "Succeeded")], None, "", "", False),
    ("orphan-pending-waits", "Passthrough", _binding("Passthrough", "Unknown", "vfio-pci"), [_cond("Managed", "Unknown", "OrphanPending")], None, "", "", False),
    ("orphaned-reclaim-in-progress", "Passthrough", _binding(**VFIO_ORPHAN), [ORPHANED, _cond("Reclaim", "Unknown", "InProgress")], None, "", "", False),
    ("excluded-is-a-choice", "Ready", _binding(state="Excluded"), [_cond("Managed", "False", "Excluded")], None, "", "", False),
    ("excluded-release-pending", "Passthrough", _binding("Passthrough", "Managed", "vfio-pci"), [_cond("Managed", "True", "ExcludedReleasePending")], None, "", "", False),
    ("vm-on-vfio", "Passthrough", _binding("Passthrough", "Managed", "vfio-pci"), [_cond("Managed", "True", "BackingAllocation")], None, "", "", False),
    # a person is needed
    (
        "orphaned",
        "Passthrough",
        _binding(**VFIO_ORPHAN),
        [ORPHANED],
        "orphaned",
        "Orphaned: bound to vfio-pci with no claim for 2m0s or more without a break (Managed=False/Orphaned)",
        "bcd gpu reclaim {pci}",
        True,
    ),
    (
        "orphaned-after-a-refusal",
        "Passthrough",
        _binding(**VFIO_ORPHAN),
        [ORPHANED, _cond("Reclaim", "False", "OccupancyUnknown")],
        "orphaned",
        "Orphaned:",
        "bcd gpu reclaim {pci}",
        True,
    ),
    ("disruption-required", "Reconfiguring", _binding("None", "Unknown", ""), [_cond("Reconfiguring", "True", "DisruptionRequired", "reboot needed")], "reboot-wait", "DisruptionRequired: reboot needed (Reconfiguring=True/DisruptionRequired)", "reboot the node", False),
    ("disruption-pending", "Reconfiguring", _binding("None", "Unknown", ""), [_cond("Reconfiguring", "True", "DisruptionPending")], "reboot-wait", "DisruptionPending", "reboot the node", False),
    ("reboot-requested", "Reconfiguring", _binding("None", "Unknown", ""), [_cond("Reconfiguring", "True", "RebootRequested", "node reboot requested")], "reboot-wait", "RebootRequested: node reboot requested", "reboot the node", False),
    (
        "reboot-requested-beats-orphaned",
        "Passthrough",
        _binding(**VFIO_ORPHAN),
        [ORPHANED, _cond("Reconfiguring", "True", "RebootRequested")],
        "reboot-wait",
        "RebootRequested",
        "reboot the node",
        False,
    ),
    ("reclaim-failed", "Passthrough", _binding(**VFIO_ORPHAN), [ORPHANED, _cond("Reclaim", "False", "Failed", "still Passthrough")], "reclaim-failed", "reclaim failed: still Passthrough (Reclaim=False/Failed)", "reboot the node, or try again: `bcd gpu reclaim {pci}`", False),
    (
        "failed-phase",
        "Failed",
        _binding(state="Managed"),
        [_cond("AdapterReady", "False", "VFIORequiresBareMetal", "virtualized")],
        "phase-failed",
        "phase Failed: virtualized (AdapterReady=False/VFIORequiresBareMetal)",
        "take the VM instance off this card",
        False,
    ),
    ("failed-phase-without-a-condition", "Failed", _binding(), [], "phase-failed", "phase Failed: phase Failed, managementState Unclaimed", "AdapterReady", False),
    # GPU health (issue 30): Healthy=False needs a person, what to do by its reason; Unknown does not
    ("healthy-needs-nobody", "Ready", _binding(), [_cond("Healthy", "True", "Checked", "no fatal XID")], None, "", "", False),
    ("unmonitored-needs-nobody", "Ready", _binding(), [_cond("Healthy", "Unknown", "Unmonitored", "health checks are off (--health-checks off)")], None, "", "", False),
    (
        "not-checked-on-vfio-needs-nobody",
        "Passthrough",
        _binding("Passthrough", "Managed", "vfio-pci"),
        [_cond("Managed", "True", "BackingAllocation"), _cond("Healthy", "Unknown", "NotChecked", "not checked yet")],
        None,
        "",
        "",
        False,
    ),
    (
        "xid-critical",
        "Failed",
        _binding(state="Managed"),
        [_cond("AdapterReady", "True", "AdapterReady"), _cond("Healthy", "False", "XidCritical", XID_79)],
        "unhealthy",
        f"unhealthy: {XID_79} (Healthy=False/XidCritical)",
        "reset the card (`bcd gpu reset {pci}`) or reboot the node, then `bcd gpu recheck {pci}`",
        False,
    ),
    (
        "xid-critical-on-a-held-card",  # issue 41.8: a held card is neither reset nor cleared by a recheck
        "Failed",
        _binding(state="Managed"),
        [
            _cond("Managed", "True", "BackingAllocation", "claim allocation train-01 backs the binding"),
            _cond("Healthy", "False", "XidCritical", XID_79),
        ],
        "unhealthy",
        f"unhealthy: {XID_79} (Healthy=False/XidCritical)",
        "move its work: a held card is not reset and a recheck keeps its faults (claim allocation train-01 backs the binding); "
        "once the hold is released, reset it (`bcd gpu reset {pci}`)",
        False,
    ),
    (
        "xid-critical-while-the-claims-do-not-answer",  # outside review of issue 41: it said "reset" for held cards
        "Failed",
        _binding(state="Unknown"),
        [_cond("Managed", "Unknown", "Indeterminate", "the converger's claims did not answer"), _cond("Healthy", "False", "XidCritical", XID_79)],
        "unhealthy",
        f"unhealthy: {XID_79} (Healthy=False/XidCritical)",
        "whether a hold is on it is not known now (the converger's claims do not answer): move any work on it, then reset it",
        False,
    ),
    (
        "gpu-lost",
        "Failed",
        _binding(),
        [_cond("Healthy", "False", "GpuLost", "GpuLost: the card stopped answering at 2026-12-03T10:00:00Z")],
        "unhealthy",
        "unhealthy: GpuLost: the card stopped answering",
        "`bcd gpu reset {pci}`) or reboot the node, then `bcd gpu recheck {pci}`",
        False,
    ),
    (
        "gpu-lost-off-the-bus",  # issue 41: a card missing from the scan stays listed, lost
        "Failed",
        _binding("None", "Managed", ""),
        [
            _cond("AdapterReady", "False", "NotOnBus", "the card is not on the bus any more"),
            _cond("Healthy", "False", "GpuLost", "the card is not on the bus any more: missing from the scan since 2026-12-03T10:00:00Z"),
        ],
        "unhealthy",
        "unhealthy: the card is not on the bus any more",
        "the card is off the bus: move its work and reboot the node",
        False,
    ),
    (
        "ecc-uncorrectable",
        "Failed",
        _binding(),
        [_cond("Healthy", "False", "EccUncorrectable", "EccUncorrectable: 2 uncorrectable ECC errors since the last reset (limit 0)")],
        "unhealthy",
        "(Healthy=False/EccUncorrectable)",
        "then `bcd gpu recheck {pci}`",
        False,
    ),
    (
        "row-remap-pending-wants-a-reset",
        "Failed",
        _binding(),
        [_cond("Healthy", "False", "RowRemapPending", "RowRemapPending: remapped rows are pending: reset the card (bcd gpu reset) or reboot")],
        "unhealthy",
        "RowRemapPending: remapped rows are pending",
        "reset the card (`bcd gpu reset {pci}`) or reboot the node: the pending rows are remapped then",
        False,
    ),
    (
        "row-remap-failed-needs-service",
        "Failed",
        _binding(),
        [_cond("Healthy", "False", "RowRemapFailed", "RowRemapFailed: a row could not be remapped: the card needs service")],
        "unhealthy",
        "(Healthy=False/RowRemapFailed)",
        "the card needs service",
        False,
    ),
    (
        "ecc-correctable-over-its-limit",
        "Failed",
        _binding(),
        [_cond("Healthy", "False", "EccCorrectable", "EccCorrectable: 120 correctable ECC errors since the last reset (limit 100)")],
        "unhealthy",
        "EccCorrectable: 120 correctable",
        "--ecc-correctable-max",
        False,
    ),
    (
        "unhealthy-beats-a-failed-reclaim",
        "Failed",
        _binding(**VFIO_ORPHAN),
        [ORPHANED, _cond("Reclaim", "False", "Failed", "still Passthrough"), _cond("Healthy", "False", "GpuLost", "GpuLost: the card stopped answering")],
        "unhealthy",
        "GpuLost",
        "bcd gpu recheck {pci}",
        False,
    ),
    (
        "a-reboot-it-waits-for-beats-unhealthy",
        "Failed",
        _binding("None", "Unknown", ""),
        [_cond("Reconfiguring", "True", "RebootRequested", "node reboot requested"), _cond("Healthy", "False", "XidCritical", XID_79)],
        "reboot-wait",
        "RebootRequested",
        "reboot the node",
        False,
    ),
]


@pytest.mark.parametrize(
    ("phase", "binding", "conditions", "row", "words", "action", "command"),
    [c[1:] for c in ATTENTION_CASES],
    ids=[c[0] for c in ATTENTION_CASES],
)
def test_cards_that_need_a_person_make_the_node_unhealthy_and_say_what_to_run(phase, binding, conditions, row, words, action, command):
    from bcd.status import gpu_attention

    inv, pci, _ = _with_status(host_inventory(), 0, phase=phase, driver_binding=binding, conditions=conditions)
    r = report(inventory=inv)
    found = [a for a in gpu_attention(inv) if a.pci == pci]
    mine = [p for p in problems(r) if p.startswith(f"GPU {pci} ")]
    fails = [m for level, check, m in doctor_checks(r) if level == "fail" and check == "gpu"]
    text = render_status(r)
    if row is None:
        assert found == [] and mine == [] and fails == []
        assert text.endswith("health: ok") and "needs a person" not in text
        return
    (a,) = found
    assert (a.row, a.command) == (row, command)
    assert action.format(pci=pci) in a.action
    # status: the problem line (exit 1), and the block that says what to run
    assert mine == [a.text()] and words in a.text() and a.action in a.text()
    assert "health: UNHEALTHY" in text
    lines = text.splitlines()
    i = lines.index("needs a person:")
    assert lines[i + 1].startswith(f"  GPU {pci} ") and words in lines[i + 1]
    assert lines[i + 2] == f"    {'run: ' if command else 'to do: '}{a.action}"
    # doctor: a FAIL row (exit 1) with the same line
    assert fails == [a.text()]


def test_every_attention_row_is_tested():
    from bcd.status import ATTENTION_ROWS

    assert {c[4] for c in ATTENTION_CASES} - {None} == {row.name for row in ATTENTION_ROWS}


def test_the_orphaned_line_names_the_command():
    inv, pci, _ = _with_status(host_inventory(), 2, phase="Passthrough", driver_binding=_binding(**VFIO_ORPHAN), conditions=[ORPHANED])
    assert f"GPU {pci} Orphaned: bound to vfio-pci with no claim for 2m0s or more without a break (Managed=False/Orphaned) -> run `bcd gpu reclaim {pci}`" in problems(report(inventory=inv))


def test_render_gpus_shows_binding_phase_management_and_why():
    from bcd.status import render_gpus

    from shared.schemas import DriverBinding

    inv, pci, _ = _with_status(
        host_inventory(),
        1,
        phase="Passthrough",
        driver_binding=DriverBinding(driver="vfio-pci", mode="Passthrough", management_state="Orphaned"),
        conditions=[_cond("Managed", "False", "Orphaned"), _cond("Reclaim", "Unknown", "Held", "held: waiting")],
    )
    out = render_gpus(inv)
    line = next(l for l in out.splitlines() if l.startswith(pci))
    assert "vfio-pci" in line and "Passthrough" in line and "Orphaned" in line and "Reclaim=Unknown/Held" in line
    assert "Reclaim: held: waiting" in out


def test_status_shows_vm_claims_beside_holds():
    from shared.schemas import Claims, GpuClaim

    inv = host_inventory()
    pci = inv.gpus[1].pci_address
    claims = Claims(claims=[GpuClaim(pci_address=pci, kind="instance", holder="vm-7")], at=NOW)
    out = render_status(report(claims=claims))
    line = next(l for l in out.splitlines() if pci in l)
    assert line.rstrip().endswith("instance vm-7")


# ---------------------------------------------------------------------------- issue 11: vendor spec, outbox, hold dirs


def test_doctor_fails_on_an_unreadable_vendor_spec():
    """`ok vendor-cdi-spec` was printed for a garbage nvidia.json while no new hold could bind."""
    bad = conv(vendor_cdi_error="/etc/cdi/nvidia.json: not valid JSON (malformed data at 0)")
    rows = [(level, msg) for level, name, msg in doctor_checks(report(converger=bad)) if name == "vendor-cdi-spec"]
    assert rows == [("fail", "/etc/cdi/nvidia.json unreadable: not valid JSON (malformed data at 0); no new hold is bound until it reads (retried)")]
    assert any("vendor CDI spec unreadable" in p and "not valid JSON" in p for p in problems(report(converger=bad)))
    assert "health: UNHEALTHY" in render_status(report(converger=bad))
    # a readable one is still ok, a missing one still a warning
    assert levels(report())["vendor-cdi-spec"] == "ok"
    assert levels(report(converger=conv(vendor_cdi_spec="")))["vendor-cdi-spec"] == "warn"


def test_doctor_and_status_show_a_reduced_or_refused_outbox():
    reduced = "outbox reduced to 200 MiB of the 256 MiB asked: ... set --outbox-max-bytes (BCD_OUTBOX_MAX_BYTES)"
    r = report(converger=conv(outbox_warning=reduced, problems=[reduced]))
    assert [(lv, m) for lv, n, m in doctor_checks(r) if n == "outbox-size"] == [("warn", reduced)]
    assert not any(n == "hold-files" and m == reduced for _, n, m in doctor_checks(r))  # not listed twice
    assert f"  problem: {reduced}" in render_status(r).splitlines()
    assert problems(r) == []  # smaller, but working

    refused = "outbox refused: the node-bus JetStream has no room for even a 16 MiB outbox ..."
    r = report(converger=conv(outbox_error=refused, problems=[refused]))
    assert [(lv, m) for lv, n, m in doctor_checks(r) if n == "outbox-size"] == [("fail", refused)]
    assert refused in problems(r)


def test_doctor_and_status_list_skipped_entries_of_the_hold_dirs():
    skipped = "/etc/cdi/bcd-x.json: a FIFO, not a regular file: skipped, not a hold"
    r = report(converger=conv(problems=[skipped]))
    assert ("warn", "hold-files", skipped) in doctor_checks(r)
    assert f"  problem: {skipped}" in render_status(r).splitlines()


def test_gpu_list_says_what_a_card_needs():
    from bcd.status import render_gpus

    inv, pci, _ = _with_status(host_inventory(), 2, phase="Passthrough", driver_binding=_binding(**VFIO_ORPHAN), conditions=[ORPHANED])
    out = render_gpus(inv).splitlines()
    i = next(k for k, line in enumerate(out) if line.startswith(pci))
    assert out[i + 1].strip() == f"needs a person: run bcd gpu reclaim {pci}"
    assert sum("needs a person" in line for line in out) == 1  # the other cards need nothing


# --------------------------------------------------------------------------- GPU health (issue 30)


def _with_health(inv, healthy: dict[int, tuple[str, str, str]]):
    """The inventory with a Healthy condition (status, reason, message) on the cards given by index;
    Healthy=False makes the phase Failed, as the inventory does."""
    import msgspec

    gpus = list(inv.gpus)
    for i, (status, reason, message) in healthy.items():
        st = gpus[i].status
        phase = "Failed" if status == "False" else st.phase
        gpus[i] = msgspec.structs.replace(gpus[i], status=msgspec.structs.replace(st, phase=phase, conditions=[*st.conditions, _cond("Healthy", status, reason, message)]))
    return msgspec.structs.replace(inv, gpus=gpus)


OK = ("True", "Checked", "no fatal XID, ECC within limits, the vendor library answers")
NOT_CHECKED = ("Unknown", "NotChecked", "not checked yet: the vendor library has not seen the card (on vfio-pci, or not read yet)")
OFF = ("Unknown", "Unmonitored", "health checks are off (--health-checks off)")
CANNOT = ("Unknown", "Unmonitored", "events cannot be registered for this card")
XID = ("False", "XidCritical", XID_79)
PENDING = ("False", "RowRemapPending", "RowRemapPending: remapped rows are pending: reset the card (bcd gpu reset) or reboot")
EVERY = range(8)


@pytest.mark.parametrize(
    ("cards", "rows"),
    [
        # issue 41.14d: a row still, saying why health is not judged
        pytest.param({}, [("warn", "the inventory does not say the cards' health (an inventory of an older release)")], id="an-inventory-that-does-not-say"),
        pytest.param({i: OK for i in EVERY}, [("ok", "8 card(s) healthy")], id="all-healthy"),
        pytest.param(
            {**{i: OK for i in EVERY}, 6: NOT_CHECKED, 7: NOT_CHECKED},
            [("ok", "6 card(s) healthy, 2 not checked yet (NotChecked: the vendor library has not seen them, e.g. on vfio-pci)")],
            id="not-checked-on-vfio-is-fine",
        ),
        pytest.param(
            {**{i: OK for i in EVERY}, 0: XID},
            [("fail", f"0000:18:00.0 is unhealthy (Healthy=False/XidCritical), nothing new is given it: {XID_79}")],
            id="one-fatal-xid",
        ),
        pytest.param(
            {**{i: OK for i in EVERY}, 0: XID, 1: PENDING},
            [
                ("fail", f"0000:18:00.0 is unhealthy (Healthy=False/XidCritical), nothing new is given it: {XID_79}"),
                ("fail", f"0000:2a:00.0 is unhealthy (Healthy=False/RowRemapPending), nothing new is given it: {PENDING[2]}"),
            ],
            id="two-sick-cards-one-row-each",
        ),
        pytest.param(
            {i: OFF for i in EVERY},
            [("warn", "every card (8): health not watched (Healthy=Unknown): health checks are off (--health-checks off)")],
            id="checks-off",
        ),
        pytest.param(
            {**{i: OK for i in EVERY}, 2: CANNOT, 3: CANNOT},
            [("warn", "0000:3a:00.0, 0000:5d:00.0: health not watched (Healthy=Unknown): events cannot be registered for this card")],
            id="unmonitored-cards",
        ),
        pytest.param(
            {**{i: OK for i in EVERY}, 0: ("False", "GpuLost", "the card stopped answering"), 5: CANNOT},
            [
                ("fail", "0000:18:00.0 is unhealthy (Healthy=False/GpuLost), nothing new is given it: GpuLost: the card stopped answering"),
                ("warn", "0000:ab:00.0: health not watched (Healthy=Unknown): events cannot be registered for this card"),
            ],
            id="a-message-without-its-reason-gets-it",
        ),
    ],
)
def test_doctor_gpu_health_fails_per_unhealthy_card_and_warns_where_health_is_not_watched(cards, rows):
    r = report(inventory=_with_health(host_inventory(), cards))
    got = [(level, message) for level, name, message in doctor_checks(r) if name == "gpu-health"]
    assert got == rows
    # a FAIL row is a failed check: `bcd doctor` exits 1, and `bcd status` too (the card needs a person)
    sick = any(level == "fail" for level, _ in rows)
    assert any(level == "fail" for level, _, _ in doctor_checks(r)) is sick
    assert bool(problems(r)) is sick
    assert render_status(r).endswith("health: ok") is not sick


@pytest.mark.parametrize(
    ("health", "cell"),
    [
        pytest.param(None, "-", id="not-said"),
        pytest.param(OK, "ok", id="healthy"),
        pytest.param(NOT_CHECKED, "Unknown/NotChecked", id="not-checked"),
        pytest.param(OFF, "Unknown/Unmonitored", id="unmonitored"),
        pytest.param(XID, "XidCritical", id="xid"),
        pytest.param(PENDING, "RowRemapPending", id="remap-pending"),
    ],
)
def test_gpu_list_has_a_health_column(health, cell):
    from bcd.status import health_cell, render_gpus

    inv = _with_health(host_inventory(), {} if health is None else {0: health})
    g = inv.gpus[0]
    assert health_cell(g) == cell
    out = render_gpus(inv).splitlines()
    assert out[0].split() == ["PCI", "DRIVER", "MODE", "PHASE", "MANAGEMENT", "HEALTH", "CONDITIONS"]
    line = next(l for l in out if l.startswith(g.pci_address))
    assert line.split()[5] == cell
    # the columns before it and the conditions after it are where they were
    assert line.split()[:5] == [g.pci_address, "nvidia", "Compute", g.status.phase, g.status.driver_binding.management_state]
    assert "AdapterReady=True/AdapterReady" in line


def test_gpu_list_shows_why_a_card_is_unhealthy_and_which_cards_are_not_watched():
    from bcd.status import render_gpus

    inv = _with_health(host_inventory(), {0: XID, 1: OK, 2: CANNOT, 3: CANNOT, 6: NOT_CHECKED})
    out = render_gpus(inv).splitlines()
    i = next(k for k, line in enumerate(out) if line.startswith("0000:18:00.0"))
    assert out[i + 1].strip() == f"Healthy: {XID_79}"
    # (host_inventory: an inventory whose claims never answered, Managed=Unknown/Indeterminate)
    assert out[i + 2].strip() == "needs a person: whether a hold is on it is not known now (the converger's claims do not answer): move any work on it, then reset it (`bcd gpu reset 0000:18:00.0`) or reboot the node (a clean check after either clears it)"
    assert sum(line.strip().startswith("Healthy:") for line in out) == 1  # healthy, unwatched and unchecked cards get no line
    assert "health not watched on 0000:3a:00.0, 0000:5d:00.0: events cannot be registered for this card" in out
    every = render_gpus(_with_health(host_inventory(), {i: OFF for i in EVERY})).splitlines()
    assert [l for l in every if l.startswith("health not watched")] == ["health not watched on every card (8): health checks are off (--health-checks off)"]


def test_status_says_why_a_card_is_unhealthy_and_what_to_do():
    inv = _with_health(host_inventory(), {0: XID, 1: OK})
    r = report(inventory=inv)
    lines = render_status(r).splitlines()
    i = lines.index("needs a person:")
    assert lines[i + 1] == f"  GPU 0000:18:00.0 unhealthy: {XID_79} (Healthy=False/XidCritical)"
    # (host_inventory: the claims never answered, so whether a hold is on the card is not known)
    assert lines[i + 2] == "    to do: whether a hold is on it is not known now (the converger's claims do not answer): move any work on it, then reset it (`bcd gpu reset 0000:18:00.0`) or reboot the node (a clean check after either clears it)"
    assert problems(r) == [f"GPU 0000:18:00.0 unhealthy: {XID_79} (Healthy=False/XidCritical) -> whether a hold is on it is not known now (the converger's claims do not answer): move any work on it, then reset it (`bcd gpu reset 0000:18:00.0`) or reboot the node (a clean check after either clears it)"]
    # only the unhealthy row: phase Failed is the condition's doing, not a second item
    assert sum(line.startswith("  GPU ") for line in lines[i:]) == 1


def test_status_names_the_health_of_a_card_whose_reboot_comes_first():
    inv, pci, _ = _with_status(
        host_inventory(),
        0,
        phase="Failed",
        driver_binding=_binding("None", "Unknown", ""),
        conditions=[_cond("Reconfiguring", "True", "RebootRequested", "node reboot requested"), _cond("Healthy", "False", "XidCritical", XID_79)],
    )
    lines = render_status(report(inventory=inv)).splitlines()
    i = lines.index("needs a person:")
    assert "RebootRequested" in lines[i + 1]
    assert lines[i + 3] == f"    also unhealthy: {XID_79}"


def test_an_attention_json_of_an_unhealthy_card_names_its_row_and_condition():
    from bcd.status import gpu_attention

    (a,) = gpu_attention(_with_health(host_inventory(), {4: PENDING}))
    assert a.to_builtins() == {
        "pci_address": "0000:9a:00.0",
        "row": "unhealthy",
        "what": "unhealthy",
        "condition": "Healthy=False/RowRemapPending",
        "message": PENDING[2],
        "action": "reset the card (`bcd gpu reset 0000:9a:00.0`) or reboot the node: the pending rows are remapped then, and the next check clears it",
        "command": False,
    }


# --------------------------------------------------------------------------- the device plugin

KUBE = HoldSummary(allocation_id="k1", reservation_id="rk", generation=3, binding="BINDING_KUBERNETES", devices=[GPU0])
WITH_PLUGIN = [*SERVICES, "device_plugin"]


def plugin_status(*, present: bool = True, registered: bool = True, advertised: bool = True, reason: str = "", error: str = ""):
    from shared.schemas import AdvertisedHold, DevicePluginStatus, PluginResource

    return DevicePluginStatus(
        kubelet_socket="/var/lib/kubelet/device-plugins/kubelet.sock",
        kubelet_present=present,
        registered=registered,
        resources=[PluginResource(name="bcd.dev/gpu", endpoint="bcd-gpu.sock", registered=registered, devices=1, healthy=1, error=error)],
        holds=[AdvertisedHold(allocation_id="k1", advertised=advertised, devices=[GPU0], resources=["bcd.dev/gpu"], reason=reason)],
        allocations=4,
    )


def kube_report(dp, *, expected=WITH_PLUGIN):
    return report(
        expected=expected,
        services={n: ping(n, **({"cp_keys": "1"} if n == "gateway_bridge" else {})) for n in expected if dp is not None or n != "device_plugin"},
        converger=conv(holds=[KUBE]),
        device_plugin=dp,
    )


@pytest.mark.parametrize(
    ("name", "dp", "hold_line", "plugin_line", "doctor"),
    [
        ("advertised", plugin_status(), "kubelet: advertised as bcd.dev/gpu (1 device(s))", "device plugin: registered with the kubelet; bcd.dev/gpu 1/1 healthy; 4 allocation(s)", "ok"),
        ("no-plugin", None, "kubelet: NOT advertised: no device plugin answers", "device plugin: not answering", "warn"),
        (
            "no-kubelet",
            plugin_status(present=False, registered=False, advertised=False, reason="no kubelet"),
            "kubelet: NOT advertised: no kubelet",
            "device plugin: waiting for a kubelet at /var/lib/kubelet/device-plugins/kubelet.sock",
            "warn",
        ),
        (
            "register-refused",
            plugin_status(registered=False, advertised=False, error="Register refused or failed: UNKNOWN: bad"),
            "kubelet: NOT advertised: not registered with the kubelet (Register refused or failed: UNKNOWN: bad)",
            "device plugin: NOT registered with the kubelet; bcd.dev/gpu 1/1 healthy (not registered: Register refused or failed: UNKNOWN: bad); 4 allocation(s)",
            "warn",
        ),
        ("withdrawn", plugin_status(advertised=False, reason="withdrawn: a Kubernetes release started"), "kubelet: NOT advertised: withdrawn: a Kubernetes release started", None, "ok"),
    ],
)
def test_status_says_whether_each_kubernetes_hold_is_advertised(name, dp, hold_line, plugin_line, doctor):
    r = kube_report(dp)
    lines = [line.strip() for line in render_status(r).splitlines()]
    assert hold_line in lines, lines
    if plugin_line is not None:
        assert plugin_line in lines, lines
    assert levels(r)["device-plugin"] == doctor


def test_no_device_plugin_line_where_the_node_runs_none_and_no_check_without_kubernetes_holds():
    r = kube_report(None, expected=SERVICES)
    assert not any(line.startswith("device plugin") for line in render_status(r).splitlines())
    assert "device-plugin" not in levels(r)
    assert "device-plugin" not in levels(report(expected=WITH_PLUGIN, device_plugin=plugin_status(registered=False)))


# --------------------------------------------------------------------------- DRA

WITH_DRA = [*SERVICES, "dra_plugin"]
CLAIM_UID = "0b6f4a39-1c1e-4d6b-9a53-0123456789ab"


def dra_status(*, registered: bool = True, api_error: str = "", error: str = ""):
    from shared.schemas import DraClaimStatus, DraPluginStatus, PreparedDevice

    return DraPluginStatus(
        driver="gpu.bcd.dev",
        node_name="node-1",
        registered=registered,
        registration_error=error,
        api_error=api_error,
        pool_generation=4,
        slices=2,
        devices=9,
        cards=["0000:18:00.0", "0000:ba:00.0"],
        claims=[DraClaimStatus(uid=CLAIM_UID, namespace="ml", name="half", state="PrepareCompleted", devices=[PreparedDevice(pool="node-1", device="gpu-0", atom=GPU0)], since=NOW)],
    )


def dra_report(dra):
    from shared.schemas import ClaimSummary, PreparedDevice

    claim_hold = HoldSummary(allocation_id=f"claim-{CLAIM_UID}", reservation_id=f"claim-{CLAIM_UID}", generation=0, binding="BINDING_CLAIM", devices=[GPU0])
    summary = ClaimSummary(uid=CLAIM_UID, namespace="ml", name="half", state="prepared", devices=[PreparedDevice(pool="node-1", device="gpu-0", atom=GPU0)], since=NOW)
    return report(
        expected=WITH_DRA,
        services={n: ping(n, **({"cp_keys": "1"} if n == "gateway_bridge" else {})) for n in WITH_DRA if dra is not None or n != "dra_plugin"},
        converger=conv(holds=[claim_hold], claims=[summary]),
        dra_plugin=dra,
    )


@pytest.mark.parametrize(
    ("name", "dra", "line", "doctor"),
    [
        ("registered", dra_status(), "DRA plugin gpu.bcd.dev: registered with the kubelet; pool node-1 generation 4, 2 slice(s), 9 device(s) on 2 card(s); 1 claim(s) prepared", "ok"),
        ("no API server", dra_status(api_error="reading ResourceClaim ml/half failed: 503"), "DRA plugin gpu.bcd.dev: registered with the kubelet; API: reading ResourceClaim ml/half failed: 503; 1 claim(s) prepared", "warn"),
        ("refused", dra_status(registered=False, error="unsupported version"), "DRA plugin gpu.bcd.dev: NOT registered with the kubelet (unsupported version); pool node-1 generation 4, 2 slice(s), 9 device(s) on 2 card(s); 1 claim(s) prepared", "warn"),
        ("not answering", None, "DRA plugin: not answering", "warn"),
    ],
)
def test_status_shows_dra_claims_and_the_plugin(name, dra, line, doctor):
    r = dra_report(dra)
    text = render_status(r)
    lines = [x.strip() for x in text.splitlines()]
    assert line in lines, lines
    assert f"DRA claim ml/half ({CLAIM_UID}): prepared: gpu-0 -> {GPU0}" in lines
    # the claim's hold is listed with its claim, and the card says who holds it
    assert not any(x.startswith(f"hold claim-{CLAIM_UID}") for x in lines)
    assert any(x.endswith("DRA claim ml/half") for x in lines if x.startswith("0 ")), lines
    assert levels(r)["dra-plugin"] == doctor


def test_no_dra_check_on_a_node_without_a_kubelet_and_without_claims():
    assert "dra-plugin" not in levels(report(expected=WITH_DRA, dra_plugin=dra_status(registered=False, api_error="no Kubernetes API configured")))


# --------------------------------------------------------------------------- maintenance


def test_status_and_gpu_list_show_running_and_finished_maintenance():
    from bcd.status import op_line, render_gpus
    from services.converger import gpuops
    from shared.schemas import GpuOpRequest

    inv = host_inventory()
    pci = inv.gpus[0].pci_address
    running = gpuops.new_op(GpuOpRequest(op="reset", pci=pci), now=NOW, boot_id="b")
    done = gpuops.finished(gpuops.new_op(GpuOpRequest(op="diag", pci=pci, level=3), now=NOW, boot_id="b"), "Failed", "Memory: ECC", now=NOW)
    assert op_line(running) == f"reset {pci}: running since 2026-11-30 09:00:00 ({running.id})"
    assert op_line(done) == f"diag level 3 {pci}: Failed at 2026-11-30 09:00:00 ({done.id}): Memory: ECC"
    level1 = gpuops.new_op(GpuOpRequest(op="diag", pci=pci, level=1), now=NOW, boot_id="b")
    assert op_line(level1).endswith("; the card stays usable")
    text = render_status(report(converger=conv(gpu_ops=[running, done])))
    assert "gpu maintenance:" in text and op_line(done) in text
    listing = render_gpus(inv, [done])
    assert f"diag level 3: Failed at 2026-11-30 09:00:00 ({done.id}): Memory: ECC" in listing
    assert "maintenance unknown" in render_gpus(inv, None)


# ---------------------------------------------------------------------------- cdi-runtime: what the host's runtimes can use

HOLDS = [
    HoldFiles("a1", "/etc/cdi/bcd-a1.json", "0.6.0", "/var/run/cdi/bcd-a1.json", "0.3.0"),
    HoldFiles("a2", "/etc/cdi/bcd-a2.json", "0.6.0", "/var/run/cdi/bcd-a2.json", None),
]
PODMAN_43 = RuntimeFacts("podman", "/usr/bin/podman", "4.3.1")
PODMAN_55 = RuntimeFacts("podman", "/usr/bin/podman", "5.5.0")
DOCKER_20 = RuntimeFacts("docker", "/usr/bin/docker", "20.10.24", cdi_enabled=False, cdi_switch='set "features": {"cdi": true} in /etc/docker/daemon.json')
NO_DAEMON = RuntimeFacts("docker", "/usr/bin/docker", error="`docker version --format '{{.Server.Version}}'` failed (exit 1): Cannot connect")


def runtime_rows(**kw) -> list[tuple[str, str, str]]:
    return [row for row in doctor_checks(report(**kw)) if row[1] == "cdi-runtime"]


@pytest.mark.parametrize(
    ("name", "runtimes", "holds", "rows"),
    [
        ("not-looked-for", None, HOLDS, []),
        # VM tests and fake hosts have none: never a warning
        ("none-found", [], HOLDS, [("ok", "no container runtime found on this host (podman, docker, containerd, crio): nothing to check")]),
        (
            "nothing-to-do",
            [PODMAN_55],
            HOLDS,
            [("ok", "podman 5.5.0 (CDI library v1.0: reads cdiVersion <= 1.0.0; dirs /etc/cdi, /var/run/cdi): can use every hold (2)")],
        ),
        ("no-holds", [DOCKER_20], [], [("ok", "docker 20.10.24 (no CDI: it came in docker 25.0.0): no holds to use")]),
        (
            "one-hold-without-its-copy",
            [PODMAN_43],
            HOLDS,
            [
                (
                    "warn",
                    "podman 4.3.1 cannot use 1 of 2 hold(s): a2: its consumer copy /var/run/cdi/bcd-a2.json is missing "
                    "(the converger writes it beside the hold spec: is it running this bcd?); or upgrade podman to 4.7.0 or later",
                )
            ],
        ),
        (
            "one-row-per-runtime-holds-grouped-by-what-to-do",
            [PODMAN_55, DOCKER_20],
            HOLDS,
            [
                ("ok", "podman 5.5.0 (CDI library v1.0: reads cdiVersion <= 1.0.0; dirs /etc/cdi, /var/run/cdi): can use every hold (2)"),
                (
                    "warn",
                    'docker 20.10.24 cannot use 2 of 2 hold(s): a1, a2: docker 20.10.24 has no CDI: upgrade docker to 25.0.0 or later '
                    'and set "features": {"cdi": true} in /etc/docker/daemon.json',
                ),
            ],
        ),
        (
            "version-unknown",
            [NO_DAEMON],
            HOLDS,
            [("warn", "docker: version unknown (`docker version --format '{{.Server.Version}}'` failed (exit 1): Cannot connect): cannot tell which of the 2 hold(s) it can use")],
        ),
    ],
)
def test_doctor_says_which_holds_each_runtime_can_use(name, runtimes, holds, rows):
    got = runtime_rows(runtimes=runtimes, hold_files=holds)
    assert [(level, message) for level, _, message in got] == rows
    # never a failure, and the node's health does not depend on it
    assert problems(report(runtimes=runtimes, hold_files=holds)) == []


def test_doctor_names_at_most_five_holds_per_line():
    holds = [HoldFiles(f"a{i}", f"/etc/cdi/bcd-a{i}.json", "0.6.0") for i in range(8)]
    ((level, _, message),) = runtime_rows(runtimes=[DOCKER_20], hold_files=holds)
    assert level == "warn" and "cannot use 8 of 8 hold(s): a0, a1, a2, a3, a4 and 3 more: " in message


def test_doctor_matches_two_names_of_one_dir():
    rt = RuntimeFacts("podman", "/usr/bin/podman", "4.3.1", spec_dirs=("/etc/cdi", "/run/cdi"))
    holds = HOLDS[:1]
    assert runtime_rows(runtimes=[rt], hold_files=holds)[0][0] == "warn"
    same = {"/etc/cdi": "/etc/cdi", "/run/cdi": "/run/cdi", "/var/run/cdi": "/run/cdi"}
    assert runtime_rows(runtimes=[rt], hold_files=holds, same_dirs=same)[0][0] == "ok"


async def test_doctor_looks_at_the_holds_on_disk_and_the_runtimes_found():
    with fast_dir() as root:
        node = Node(root / "node")
        await node.converge(spec(2, hold("a1", GPU0)))
        info = NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir="", cdi_dir=str(node.cdi_dir), cdi_consumer_dir=str(root / "copies"))
        r = report()
        rt = RuntimeFacts("podman", "/usr/bin/podman", "4.3.1", spec_dirs=(str(node.cdi_dir), str(root / "copies")))
        look_at_runtimes(r, info, FakeRuntimes([rt]))
        assert r.runtimes == [rt]
        assert r.hold_files == [HoldFiles("a1", str(node.cdi_dir / "bcd-a1.json"), "0.6.0", str(root / "copies" / "bcd-a1.json"), None)]
        assert set(r.same_dirs) == {str(node.cdi_dir), str(root / "copies")}
        ((level, _, message),) = runtime_rows(**{k: getattr(r, k) for k in ("runtimes", "hold_files", "same_dirs")})
        assert level == "warn" and message.startswith("podman 4.3.1 cannot use 1 of 1 hold(s): a1: its consumer copy")
        # a node.json from before consumer copies, and one with no CDI dir
        look_at_runtimes(r, msgspec_replace(info, cdi_consumer_dir=""), FakeRuntimes([]))
        assert r.hold_files[0].copy_file == "" and runtime_rows(runtimes=r.runtimes)[0][0] == "ok"
        look_at_runtimes(r, msgspec_replace(info, cdi_dir=""), FakeRuntimes([rt]))
        assert r.hold_files == []


def msgspec_replace(info: NodeInfo, **kw) -> NodeInfo:
    import msgspec

    return msgspec.structs.replace(info, **kw)


def test_render_status_shows_a_hold_on_a_sick_card_and_a_vm_left_without_one():
    """Issue 30: a kept hold's DevicesHealthy=False and the VFIO side's note are shown."""
    import msgspec

    from shared.schemas import Condition

    c = report().converger
    assert c is not None and c.holds
    sick = Condition(type="DevicesHealthy", status="False", reason="XidCritical", message="GPU-x on 0000:18:00.0: Healthy=False XidCritical: XID 79", since=NOW)
    holds = [msgspec.structs.replace(c.holds[0], condition=sick), *c.holds[1:]]
    note = "instance vm-1: 0000:2a:00.0 is unhealthy (Healthy=False XidCritical: XID 48); not switched to vfio-pci"
    text = render_status(report(converger=conv(holds=holds, vfio_notes=[note])))
    assert "    DevicesHealthy=False XidCritical: GPU-x on 0000:18:00.0: Healthy=False XidCritical: XID 79" in text
    assert f"  vfio: {note}" in text
    # a hold whose cards are well (or never were sick) shows no such line
    assert "DevicesHealthy" not in render_status(report())


def test_the_dra_plugin_s_tainted_and_withdrawn_unhealthy_cards_are_shown():
    import msgspec

    dra = msgspec.structs.replace(
        dra_status(),
        device_taints=True,
        tainted=["0000:3a:00.0 gpu-2: published tainted gpu.bcd.dev/xid=79:NoExecute (Healthy=False XidCritical: XID 79)"],
        left_out=[
            "0000:5d:00.0 gpu-3: phase Failed, not Ready: Healthy=False GpuLost: gone; withdrawn, not tainted: device taints are off",
            "0000:db:00.0 gpu-7: excluded from management",
        ],
    )
    text = render_status(dra_report(dra))
    assert "  tainted: 0000:3a:00.0 gpu-2: published tainted gpu.bcd.dev/xid=79:NoExecute" in text
    assert "  left out: 0000:5d:00.0 gpu-3: phase Failed, not Ready: Healthy=False GpuLost" in text
    assert "gpu-7: excluded" not in text  # not a health line


def trust_rows(bridge: dict, converger: dict) -> list[tuple[str, str, str]]:
    services = {n: ping(n) for n in SERVICES} | {"gateway_bridge": ping("gateway_bridge", **bridge), "converger": ping("converger", **converger)}
    return [row for row in doctor_checks(report(services=services)) if row[1] in ("signed-specs", "unsigned-specs")]


@pytest.mark.parametrize(
    ("bridge", "converger", "level", "words"),
    [
        ({"cp_keys": "1"}, {"cp_keys": "2"}, "ok", "(gateway_bridge 1, converger 2)"),
        # the lab opt-out is said by whichever service has it on, never hidden behind the other's keys
        ({"cp_keys": "0", "unsigned_specs": "accepted"}, {"cp_keys": "1"}, "warn", "gateway_bridge accepts UNSIGNED node specs"),
        ({"cp_keys": "1"}, {"cp_keys": "0", "unsigned_specs": "accepted"}, "warn", "converger accepts UNSIGNED node specs"),
        ({"cp_keys": "0", "unsigned_specs": "accepted"}, {"cp_keys": "0", "unsigned_specs": "accepted"}, "warn", "gateway_bridge and converger accept UNSIGNED"),
        # a converger of a release that left the check to the bridge says nothing of it: the bridge's row stands
        ({"cp_keys": "1"}, {}, "ok", "(gateway_bridge 1)"),
    ],
)
def test_doctor_says_which_service_takes_unsigned_specs(bridge, converger, level, words):
    (row,) = trust_rows(bridge, converger)
    assert row[0] == level and words in row[2], row


def test_doctor_prints_a_row_for_every_check_readme_lists_and_names_fit_their_column() -> None:
    """Issue 41.14d: README's doctor line lists bus, services, signed specs, gpu-binding, vendor CDI
    spec, outbox size, odd files in the hold dirs, cdi-runtime, gpu-health: each prints a row when
    fine too; a long name (service.gateway_bridge) does not run into its message."""
    from bcd.status import render_doctor

    r = report()
    r.runtimes = []
    names = {name for _, name, _ in doctor_checks(r)}
    for listed in ("bus", "signed-specs", "gpu-binding", "vendor-cdi-spec", "outbox-size", "hold-files", "cdi-runtime", "gpu-health"):
        assert listed in names, (listed, sorted(names))
    assert any(n.startswith("service.") for n in names)
    rows = render_doctor([("ok", "bus", "a"), ("warn", "service.gateway_bridge", "b")]).splitlines()
    assert rows == ["ok    bus                     a", "WARN  service.gateway_bridge  b"]


def test_every_doctor_row_the_docs_name_is_one_doctor_prints() -> None:
    """README said odd files were "a `hold-dirs` warning in `bcd doctor`"; doctor printed them as
    `hold-files` (and non-regular entries as `hold-dirs`): one family, one name now, and every row
    name README and docs/ give (`warns X`, `fails X`, `WARN X`, `` `X` warning in `bcd doctor` ``)
    is one the doctor's code makes."""
    import pathlib
    import re

    repo = pathlib.Path(__file__).resolve().parents[2]
    code = "".join(p.read_text() for p in (repo / "bcd").glob("*.py"))
    made = set(re.findall(r'\(\s*"(?:ok|warn|fail)",\s*"([a-z][a-z.-]*)"', code))
    docs = "\n".join(p.read_text() for p in [repo / "README.md", *(repo / "docs").glob("*.md")])
    named: set[str] = set()
    for pattern in (
        r"(?:warns|fails) `([a-z][a-z.-]*)`",
        r"`(?:WARN|FAIL|warn|fail) +([a-z][a-z.-]*)`",
        r"`([a-z][a-z.-]*)` (?:warning|row) in `bcd doctor`",
        r"(?:WARN|FAIL)  +([a-z][a-z.-]*)",
    ):
        named |= set(re.findall(pattern, docs))
    assert {"gpu-health", "hold-files", "outbox-size"} <= named
    assert named <= made, sorted(named - made)
    assert "hold-dirs" not in made


def _relayout(**kw):
    from shared.schemas import RelayoutCardState, RelayoutState, RelayoutStatus

    job = RelayoutState(
        config="all-1g.18gb",
        step=kw.pop("step", "draining"),
        outcome=kw.pop("outcome", ""),
        message=kw.pop("message", "re-layout to all-1g.18gb: draining the pods that use 0000:1a:00.0"),
        started_at=NOW - timedelta(minutes=5),
        step_since=kw.pop("since", NOW - timedelta(seconds=40)),
        cards=[RelayoutCardState(pci_address="0000:1a:00.0", target="1g.18gb", before="all-disabled", step="draining")],
    )
    running = kw.pop("running", True)
    return RelayoutStatus(
        desired=kw.pop("desired", "all-1g.18gb"),
        state_label=kw.pop("state_label", "pending"),
        running=job if running else None,
        last=None if running else job,
        **kw,
    )


@pytest.mark.parametrize(
    ("name", "relayout", "unhealthy"),
    [
        ("nothing to do: none", None, []),
        ("a job running is no problem", _relayout(), []),
        ("a step stuck over 30 minutes", _relayout(since=NOW - timedelta(minutes=31)), ["stuck at draining"]),
        ("failed while the label still asks", _relayout(running=False, step="done", outcome="failed", message="0000:1a:00.0 is held by train-01", state_label="failed"), ["failed: 0000:1a:00.0 is held by train-01"]),
        ("failed, then the label changed: no longer a problem", _relayout(running=False, step="done", outcome="failed", desired="all-disabled", state_label="failed"), []),
        ("success", _relayout(running=False, step="done", outcome="success", state_label="success"), []),
    ],
)
def test_mig_relayout_problems_and_lines(name, relayout, unhealthy):
    r = report(converger=conv(relayout=relayout))
    got = problems(r)
    assert len(got) == len(unhealthy), (name, got)
    for line, words in zip(got, unhealthy):
        assert words in line, (name, line)
    text = render_status(r)
    if relayout is not None:
        assert "MIG re-layout: nvidia.com/mig.config=" + relayout.desired in text
        assert "0000:1a:00.0 1g.18gb: draining" in text
    if relayout is not None and relayout.running is not None:
        assert "draining for " in text


def test_doctor_has_a_mig_relayout_row_only_where_a_node_label_is_read():
    assert not [c for c in doctor_checks(report()) if c[1] == "mig-relayout"]
    ok = [c for c in doctor_checks(report(converger=conv(relayout=_relayout()))) if c[1] == "mig-relayout"]
    assert ok == [("ok", "mig-relayout", "all-1g.18gb: draining")]
    stuck = [c for c in doctor_checks(report(converger=conv(relayout=_relayout(since=NOW - timedelta(hours=1))))) if c[1] == "mig-relayout"]
    assert [c[0] for c in stuck] == ["fail"] and "stuck at draining" in stuck[0][2]
