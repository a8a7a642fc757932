"""The converger's Prometheus metrics: every counter and gauge it exports, and how each is kept.

One object registers them all on the service's registry at setup (in the
order /metrics lists them) and is handed to the rooms that count: the pass
(passes.py), the claim desk, maintenance and the Applier's switch count. The
gauges that say what the journal holds (diagnostic results, DRA claims) are
set from it at start, so they are right after a restart while the counters
start afresh.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.schemas import GpuOp

from . import gpuops
from . import relayout as relayout_steps
from .model import ClaimRecord, ConvergerState, RelayoutJob


class ConvergerMetrics:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.holds = Gauge("bcd_holds", "Holds on disk by binding", ["binding"], registry=reg)
        self.pass_duration = Histogram("bcd_converger_pass_duration_seconds", "Duration of one pass", registry=reg)
        self.passes = Counter("bcd_converger_passes", "Passes by outcome", ["outcome"], registry=reg)
        self.failures = Counter("bcd_hold_failures", "Holds refused, by reason", ["reason"], registry=reg)
        self.drift = Counter(
            "bcd_hold_drift", "Hold files (and slices) found not as bcd wrote them (edited from outside) and put back, by file", ["file"], registry=reg
        )
        for file in ("cdi", "cdi-consumer", "allocation-env", "slice"):
            self.drift.labels(file=file)
        self.generation = Gauge("bcd_converger_observed_generation", "Generation of the last pass", registry=reg)
        self.section = Gauge("bcd_section_state", "1 for the devices section's current state", ["state"], registry=reg)
        self.pending = Gauge("bcd_kubernetes_releases_pending", "Kubernetes releases waiting for pods to let go", registry=reg)
        self.pending_age = Gauge("bcd_kubernetes_release_oldest_age_seconds", "Age of the oldest pending Kubernetes release", registry=reg)
        self.unreadable = Gauge(
            "bcd_kubernetes_releases_unreadable",
            "1 while condition KubernetesReleasesUnreadable is True (releasing.json was unreadable: every GPU counts as claimed)",
            registry=reg,
        )
        self.switches = Counter(
            "bcd_vfio_switch_requests", "Driver switches asked of vfio_switcher, by target and outcome", ["target", "outcome"], registry=reg
        )
        self.vfio = Gauge("bcd_vfio_recorded_gpus", "GPUs in the converger's VFIO record", registry=reg)
        self.gpu_ops = Counter("bcd_gpu_operations", "Maintenance operations (reset, diag) by outcome", ["op", "outcome"], registry=reg)
        self.gpu_ops_running = Gauge("bcd_gpu_operations_running", "Maintenance operations running now", ["op"], registry=reg)
        self.diag = Gauge("bcd_gpu_diag_passed", "1 when the card's last diagnostic at that level passed, 0 when it did not", ["pci_address", "level"], registry=reg)
        for op in gpuops.OPS:
            self.gpu_ops_running.labels(op=op).set(0)

        self.claims = Gauge("bcd_dra_claims", "DRA claims held as holds, by state", ["state"], registry=reg)
        self.claim_ops = Counter("bcd_dra_claim_operations", "DRA claim prepares and unprepares, by outcome", ["op", "outcome"], registry=reg)
        self.claim_sharing = Gauge(
            "bcd_dra_claim_devices", "Devices of prepared DRA claims, by how they are shared (Exclusive, TimeSlicing, MPS, Vfio) and whether a share", ["strategy", "share"], registry=reg
        )
        self._share_cards: set[str] = set()
        self.mps_daemons = Gauge("bcd_dra_mps_daemons", "MPS control daemons of DRA claims, running or being started or stopped", registry=reg)
        self.share_percent = Gauge("bcd_gpu_share_percent", "What DRA claims' shares take of a card, in percent (at most 100)", ["pci_address"], registry=reg)

        self.relayout_step = Gauge(
            "bcd_mig_relayout_step", "1 for the step the node's MIG re-layout (its Node's nvidia.com/mig.config) is at; all 0 while none runs", ["step"], registry=reg
        )
        self.relayout_step_started = Gauge(
            "bcd_mig_relayout_step_started_timestamp_seconds", "When the running MIG re-layout's step began (0 while none runs)", registry=reg
        )
        self.relayout_cards = Gauge("bcd_mig_relayout_cards", "Cards of the running MIG re-layout, by their step", ["step"], registry=reg)
        self.relayouts = Counter("bcd_mig_relayouts", "MIG re-layouts that ended, by outcome", ["outcome"], registry=reg)
        for outcome in ("success", "failed"):
            self.relayouts.labels(outcome=outcome)
        self.relayout_gauges(None)

    def relayout_gauges(self, job: RelayoutJob | None) -> None:
        for step in relayout_steps.STEPS:
            self.relayout_step.labels(step=step).set(1 if job is not None and job.step == step else 0)
        self.relayout_step_started.set(job.step_since.timestamp() if job is not None else 0)
        for step in relayout_steps.CARD_STEPS:
            self.relayout_cards.labels(step=step).set(sum(1 for c in job.cards.values() if c.step == step) if job is not None else 0)

    def from_journal(self, state: ConvergerState) -> None:
        """The gauges the journal answers, at start: the last diagnostic results and the DRA claims."""
        # the journal's last results, so the gauge is right after a restart (the counter starts afresh)
        for r in state.gpu_op_results.values():
            self.diag_gauge(r)
        self.claims_gauge(state.claims.values())

    def claims_gauge(self, records: Iterable[ClaimRecord]) -> None:
        claims = list(records)
        for st in ("preparing", "prepared", "unpreparing"):
            self.claims.labels(state=st).set(sum(1 for r in claims if r.state == st))
        prepared = [d for r in claims if r.state == "prepared" for d in r.devices]
        for strategy in ("Exclusive", "TimeSlicing", "MPS", "Vfio"):
            for share in ("true", "false"):
                n = sum(1 for d in prepared if d.sharing.strategy == strategy and (share == "true") == d.shared)
                self.claim_sharing.labels(strategy=strategy, share=share).set(n)
        self.mps_daemons.set(sum(1 for r in claims if r.mps is not None))
        shares: dict[str, int] = {}
        for d in (d for r in claims for d in r.devices if d.shared):
            shares[d.pci] = shares.get(d.pci, 0) + d.percent
        for pci in set(self._share_cards) - set(shares):
            self.share_percent.remove(pci)
        for pci, percent in shares.items():
            self.share_percent.labels(pci_address=pci).set(percent)
        self._share_cards = set(shares)

    def count_drift(self, file: str) -> None:
        self.drift.labels(file=file).inc()

    def count_switch(self, target: str, outcome: str) -> None:
        self.switches.labels(target=target, outcome=outcome).inc()

    def count_interrupted(self, ops: list[GpuOp]) -> None:
        for op in ops:
            self.gpu_ops.labels(op=op.op, outcome=op.outcome).inc()

    def count_op(self, op: GpuOp) -> None:
        if op.state != "done":
            return
        self.gpu_ops.labels(op=op.op, outcome=op.outcome).inc()
        self.diag_gauge(op)

    def diag_gauge(self, op: GpuOp) -> None:
        if op.op == "diag" and op.outcome in ("Passed", "Failed"):
            self.diag.labels(pci_address=op.pci, level=str(op.level)).set(1 if op.outcome == "Passed" else 0)


__all__ = ["ConvergerMetrics"]
