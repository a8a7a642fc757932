"""The inventory's Prometheus metrics of scans, the published inventory and the PhysicalGPU states (publishing.py sets them).

The health metrics are healthintake.py's (made after these, at setup).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.schemas import Inventory


class InventoryMetrics:
    def __init__(self, reg: CollectorRegistry) -> None:
        self.scans = Counter("bcd_inventory_scans", "Inventory scans by outcome", ["outcome"], registry=reg)
        self.scan_seconds = Histogram("bcd_inventory_scan_duration_seconds", "Time one scan takes", registry=reg)
        self.revision = Gauge("bcd_inventory_revision", "Revision of the published inventory", registry=reg)
        self.gpus = Gauge("bcd_inventory_gpus", "GPUs on this node", registry=reg)
        self.atoms = Gauge("bcd_inventory_atoms", "Atoms on this node by kind", ["kind"], registry=reg)
        self.phase = Gauge("bcd_gpu_phase", "1 for each GPU's current PhysicalGPU phase", ["pci_address", "phase"], registry=reg)
        self.mstate = Gauge("bcd_gpu_management_state", "1 for each GPU's current managementState", ["pci_address", "state"], registry=reg)
        # every condition of every card, e.g. Reconfiguring=True/DisruptionRequired (a reboot is needed)
        self.conditions = Gauge(
            "bcd_gpu_condition",
            "1 for each condition a GPU's PhysicalGPU status carries now",
            ["pci_address", "type", "status", "reason"],
            registry=reg,
        )
        self.reclaims = Counter(
            "bcd_gpu_reclaims", "Reclaim requests by outcome (held, admitted, refused, succeeded, failed)", ["outcome"], registry=reg
        )
        self.events = Counter("bcd_gpu_events", "GpuChanged events journaled for upstream", registry=reg)
        self.events_pending = Gauge("bcd_gpu_events_pending", "GpuChanged events waiting for the node outbox", registry=reg)
        self.claims_errors = Counter("bcd_gpu_claims_lookup_failures", "Failed converger.claims lookups", registry=reg)
        self.state_errors = Counter("bcd_gpu_state_write_failures", "Failed writes of gpus.json", registry=reg)
        for outcome in ("changed", "unchanged", "error"):
            self.scans.labels(outcome=outcome)

    def observe(self, inv: Inventory) -> None:
        """The gauges of one published inventory (the per-GPU ones start afresh)."""
        self.revision.set(inv.revision)
        self.gpus.set(len(inv.gpus))
        for kind in ("gpu", "mig", "slot"):
            self.atoms.labels(kind=kind).set(sum(1 for a in inv.atoms if a.kind == kind))
        self.phase.clear()
        self.mstate.clear()
        self.conditions.clear()
        for g in inv.gpus:
            self.phase.labels(pci_address=g.pci_address, phase=g.status.phase).set(1)
            self.mstate.labels(pci_address=g.pci_address, state=g.status.driver_binding.management_state).set(1)
            for c in g.status.conditions:
                self.conditions.labels(pci_address=g.pci_address, type=c.type, status=c.status, reason=c.reason).set(1)


__all__ = ["InventoryMetrics"]
