"""Maintenance operations (`bcd gpu reset|diag`) as tables: who holds a card against which
operation, the journal records, the plan's view of a card under maintenance, DCGM's reports."""

from __future__ import annotations

import subprocess
from datetime import datetime, timezone

import pytest

from services.converger import gpuops
from services.inventory.adapters.dcgm import judge, run_dcgmi
from shared.schemas import GpuClaim, GpuOpRequest

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
P0, P1 = "0000:18:00.0", "0000:2a:00.0"
LISTED = [P0, P1]


def claim(kind: str, holder: str, pci: str = P0) -> GpuClaim:
    return GpuClaim(pci_address=pci, kind=kind, holder=holder)  # type: ignore[arg-type]


RUNNING = {P0: gpuops.new_op(GpuOpRequest(op="diag", pci=P0, level=2), now=NOW, boot_id="b")}


@pytest.mark.parametrize(
    ("req", "claims", "running", "refused"),
    [
        pytest.param(GpuOpRequest(op="reset", pci=P0), [], {}, None, id="a free card: nothing holds it"),
        pytest.param(GpuOpRequest(op="reset", pci=P0), [claim("allocation", "a1")], {}, "it is held by a1", id="a live hold"),
        pytest.param(GpuOpRequest(op="reset", pci=P0), [claim("release", "k1")], {}, "it is held by k1 (pending Kubernetes release)", id="a pending release"),
        pytest.param(GpuOpRequest(op="reset", pci=P0), [claim("instance", "vm-1")], {}, "it is held by instance vm-1", id="an instance spec"),
        pytest.param(GpuOpRequest(op="reset", pci=P0), [claim("domain", "build")], {}, "it is held by running domain build", id="a running domain"),
        pytest.param(GpuOpRequest(op="reset", pci=P0), [claim("allocation", "a1", P1)], {}, None, id="another card's hold"),
        pytest.param(GpuOpRequest(op="diag", pci=P0, level=1), [claim("allocation", "a1")], {}, None, id="level 1 runs beside a hold"),
        pytest.param(GpuOpRequest(op="diag", pci=P0, level=2), [claim("allocation", "a1")], {}, "it is held by a1", id="level 2 does not"),
        pytest.param(
            GpuOpRequest(op="diag", pci=P0, level=1), [], RUNNING, f"it is held by maintenance (diagnostic level 2, {RUNNING[P0].id})", id="one operation at a time"
        ),
        pytest.param(GpuOpRequest(op="reset", pci="0000:99:00.0"), [], {}, "the inventory lists no GPU at that address", id="not listed"),
        pytest.param(GpuOpRequest(op="reset", pci="18:00.0"), [], {}, "is not a canonical PCI address", id="not canonical"),
        pytest.param(GpuOpRequest(op="flash", pci=P0), [], {}, "is not one of reset, diag", id="unknown op"),
        pytest.param(GpuOpRequest(op="diag", pci=P0, level=5), [], {}, "a diagnostic level is 1 to 4", id="bad level"),
        pytest.param(GpuOpRequest(op="reset", pci=P0, level=2), [], {}, "a reset has no level", id="reset with a level"),
        pytest.param(
            GpuOpRequest(op="reset", pci=P0), [claim("allocation", "a1"), claim("domain", "d")], {}, "it is held by a1 (and 1 more)", id="several holders"
        ),
    ],
)
def test_refusal(req, claims, running, refused):
    got = gpuops.refusal(req, LISTED, claims, running)
    if refused is None:
        assert got is None
    else:
        assert got is not None and refused in got, got


def test_records_claims_and_interruptions():
    reset = gpuops.new_op(GpuOpRequest(op="reset", pci=P1), now=NOW, boot_id="b")
    diag1 = gpuops.new_op(GpuOpRequest(op="diag", pci=P0, level=1), now=NOW, boot_id="b")
    assert reset.state == "running" and reset.claims_card and not diag1.claims_card
    assert gpuops.maintenance_claims({P1: reset, P0: diag1}) == {P1: f"maintenance (reset, {reset.id})"}
    done = gpuops.finished(reset, "Succeeded", "ok", now=NOW)
    assert (done.state, done.outcome, done.finished_at) == ("done", "Succeeded", NOW)
    cut = gpuops.interrupted(diag1, now=NOW)
    assert cut.outcome == "Interrupted" and "run it again" in cut.message
    assert "whether the card was reset is not known" in gpuops.interrupted(reset, now=NOW).message
    assert gpuops.result_key(done) == f"reset {P1}"


def test_the_plan_refuses_a_hold_on_a_card_under_maintenance():
    import dataclasses

    from services.converger.plan import plan
    from tests.converger_kit import GPU, Node, fast_dir, hold, spec

    with fast_dir() as root:
        node = Node(root)
        pci = next(g.pci_address for g in node.inventory.gpus if g.atom_id == GPU[0])
        wanted = spec(1, hold("a1", GPU[0]), hold("b1", GPU[1]))
        observed = dataclasses.replace(node.observe(wanted), maintenance={pci: "maintenance (reset, r-1)"})
        p = plan(wanted, observed, node.config)
        failures = {f.allocation_id: f for f in p.failures}
        assert failures["a1"].reason == "overlap" and "maintenance (reset, r-1)" in failures["a1"].message
        assert "b1" not in failures
        # nothing under maintenance: both bind
        assert not plan(wanted, node.observe(wanted), node.config).failures


@pytest.mark.parametrize(
    ("stdout", "outcome", "failures"),
    [
        (
            '{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Deployment", "tests": [{"name": "Denylist", "results": [{"status": "Pass"}]}]}]}}',
            "Passed",
            (),
        ),
        (
            '{"DCGM GPU Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [{"name": "Memory", "results": [{"gpu_id": "0", "status": "Fail", "warnings": [{"warning": "ECC"}]}]}, {"name": "PCIe", "results": [{"status": "Pass"}]}]}]}}',
            "Failed",
            ("Memory: ECC",),
        ),
        ('{"DCGM GPU Diagnostic": {"test_categories": []}}', "Error", ()),
        ("Error: unable to connect to host engine", "Error", ()),
    ],
)
def test_a_dcgm_report_is_judged(stdout, outcome, failures):
    result = judge(stdout, 0, 1)
    assert (result.outcome, result.failures) == (outcome, failures), result.message


def test_dcgmi_not_installed_timeouts_and_the_argv():
    assert run_dcgmi(0, 1, 10, which=lambda _: None).outcome == "NotInstalled"
    seen = []

    def fake_run(argv, **kw):
        seen.append((argv, kw["timeout"]))
        return subprocess.CompletedProcess(argv, 0, '{"DCGM GPU Diagnostic": {"test_categories": [{"tests": [{"name": "x", "results": [{"status": "Pass"}]}]}]}}', "")

    assert run_dcgmi(3, 2, 99, which=lambda _: "/usr/bin/dcgmi", run=fake_run).outcome == "Passed"
    assert seen == [(["/usr/bin/dcgmi", "diag", "-r", "2", "-i", "3", "-j"], 99)]

    def slow(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    assert "did not finish within 5 s" in run_dcgmi(0, 1, 5, which=lambda _: "dcgmi", run=slow).message
