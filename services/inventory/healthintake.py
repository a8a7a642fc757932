"""What the inventory does with health news: the policy from its options, the metrics, the log, the tracker.

The health thread (healthwatch.py) reports; the rules (health.py) judge; this module sits between:
it reads the operator's options into a HealthPolicy, counts every XID by card and number
(`bcd_gpu_xid_events`, ignored ones too, labelled so) and every ECC event, logs what a person
must see, and hands each piece of news to the GpuTracker. It answers whether a card's health
changed, so the health desk (healthdesk.py) knows to evaluate and publish.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter

from shared.schemas import Inventory

from .gpustate import GpuTracker
from .health import APPLICATION_XIDS, HealthPolicy, xid_text
from .healthwatch import HealthNews

#: the largest XID number NVML reports (a u32 in NVML; the catalogue ends well below this)
XID_MAX = 65535


def _xids(text: str, flag: str) -> frozenset[int]:
    out = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) > XID_MAX:
            raise ValueError(f"{flag} takes XID numbers separated by commas (0-{XID_MAX}), not {part!r}")
        out.add(int(part))
    return frozenset(out)


def policy_from(opts: Any) -> HealthPolicy:
    """The HealthPolicy of the service's options; ValueError names the option that is wrong."""
    if opts.health_checks not in ("on", "off"):
        raise ValueError(f"--health-checks is on or off, not {opts.health_checks!r}")
    if opts.ecc_uncorrectable_max < 0:
        raise ValueError(f"--ecc-uncorrectable-max must be 0 or more, not {opts.ecc_uncorrectable_max}")
    if opts.ecc_correctable_max < -1:
        raise ValueError(f"--ecc-correctable-max must be -1 (no limit) or more, not {opts.ecc_correctable_max}")
    if not opts.health_interval > 0:
        raise ValueError(f"--health-interval must be a positive number of seconds, not {opts.health_interval}")
    return HealthPolicy(
        enabled=opts.health_checks == "on",
        ignored_xids=APPLICATION_XIDS | _xids(opts.xid_ignore, "--xid-ignore"),
        fatal_xids=_xids(opts.xid_fatal, "--xid-fatal"),
        ecc_uncorrectable_max=opts.ecc_uncorrectable_max,
        ecc_correctable_max=None if opts.ecc_correctable_max < 0 else opts.ecc_correctable_max,
    )


def watched_cards(inv: Inventory | None) -> list[str]:
    """The cards the vendor library can see: those on their compute driver."""
    return [g.pci_address for g in inv.gpus if g.status.driver_binding.mode == "Compute"] if inv is not None else []


class HealthIntake:
    def __init__(self, registry: Any, log: Any) -> None:
        self.log = log
        self.m_xids = Counter(
            "bcd_gpu_xid_events",
            "XIDs the vendor library reported, by card, number and severity (critical: the card is unhealthy; ignored: an application XID or one the operator ignores)",
            ["pci_address", "xid", "severity"],
            registry=registry,
        )
        self.m_ecc = Counter("bcd_gpu_ecc_events", "ECC error events by card and kind (correctable, uncorrectable)", ["pci_address", "kind"], registry=registry)
        self.m_checks = Counter("bcd_gpu_health_checks", "Health checks by outcome (ok: the library answered; failed: it did not)", ["outcome"], registry=registry)
        for outcome in ("ok", "failed"):
            self.m_checks.labels(outcome=outcome)
        #: why the library does not answer now ("" while it does): logged once per outage
        self.gone = ""

    def note(self, tracker: GpuTracker, news: HealthNews, *, listed: Sequence[str], boot_id: str) -> bool:
        """Hand one piece of news to the tracker; True when a card's health changed."""
        changed = False
        if news.kind == "opened":
            if self.gone:
                self.log.info("the vendor library answers again; GPU health is watched", was=self.gone)
                self.gone = ""
            unmonitored = {e.pci_address for e in news.events}
            changed |= tracker.note_health_watched([p for p in listed if p not in unmonitored])
        if news.kind in ("opened", "events"):
            for event in news.events:
                changed |= self._event(tracker, event, boot_id)
        elif news.kind == "checks":
            self.m_checks.labels(outcome="ok").inc()
            c, cleared = tracker.note_health_checks(news.checks, boot_id=boot_id)
            changed |= c
            for pci, reasons in cleared.items():
                self.log.info("GPU healthy again after a reboot: a clean check cleared its faults", pci=pci, cleared=reasons, boot_id=boot_id)
        elif news.kind == "gone":
            self.m_checks.labels(outcome="failed").inc()
            if news.message != self.gone:
                self.log.error("the vendor library does not answer: every card it watched is GpuLost", error=news.message, cards=list(listed))
            self.gone = news.message
            changed |= tracker.note_library_gone(listed, news.message, boot_id=boot_id)
        return changed

    def _event(self, tracker: GpuTracker, event: Any, boot_id: str) -> bool:
        outcome, changed = tracker.note_health_event(event, boot_id=boot_id)
        if event.kind == "xid":
            xid = event.xid if event.xid is not None else -1
            severity = "critical" if outcome == "fatal" else "ignored"
            self.m_xids.labels(pci_address=event.pci_address, xid=str(xid), severity=severity).inc()
            (self.log.error if severity == "critical" else self.log.info)(
                "GPU XID", pci=event.pci_address, xid=xid, what=xid_text(xid), severity=severity, gi=event.gi, ci=event.ci, detail=event.message
            )
        elif event.kind in ("ecc-correctable", "ecc-uncorrectable"):
            kind = event.kind.removeprefix("ecc-")
            self.m_ecc.labels(pci_address=event.pci_address, kind=kind).inc()
            if kind == "uncorrectable":
                self.log.error("GPU uncorrectable ECC error", pci=event.pci_address, detail=event.message)
        elif event.kind == "gone":
            self.log.error("GPU lost: the vendor library no longer answers the card", pci=event.pci_address, detail=event.message)
        elif event.kind == "unmonitored":
            self.log.warning("GPU health cannot be watched", pci=event.pci_address, detail=event.message)
        return changed


__all__ = ["XID_MAX", "policy_from", "watched_cards", "HealthIntake"]
