"""Crash points: named instants of a bind or release where a test kills the converger.

`BCD_CONVERGER_CRASH_AT=bind.cdi-written` (optionally `:N` for the Nth time
that point is reached) makes the process SIGKILL itself there, exactly like
`kill -9` from outside, so the crash tests can hit every step, not a few.
Unset, a crash point costs one comparison.

A pass's binds and releases run as one batch (batch.py), so the points are
the batch's boundaries: `*.intent-recorded`, `*.signed` and `*.completed`
are passed once per batch (after its one journal write, its one sign
request, its one completion record); the file points are passed once per
file (`bind.cdi-written:2` is between the second and the third CDI spec of
the batch), `*.published` once per acked event of a pipelined wave (the
events after it may still be in flight).
"""

from __future__ import annotations

import os
import signal

#: every crash point, in the order a bind and a release pass them.
BIND_POINTS: tuple[str, ...] = (
    "bind.intent-recorded",
    "bind.slice-applied",
    "bind.cdi-temp-written",
    "bind.cdi-written",
    "bind.consumer-temp-written",
    "bind.consumer-written",
    "bind.env-temp-written",
    "bind.env-written",
    "bind.signed",
    "bind.published",
    "bind.completed",
)
RELEASE_POINTS: tuple[str, ...] = (
    "release.intent-recorded",
    "release.consumer-removed",
    "release.cdi-removed",
    "release.env-removed",
    "release.slice-stopped",
    "release.signed",
    "release.published",
    "release.completed",
)
#: the split release of a Kubernetes hold.
KUBE_POINTS: tuple[str, ...] = ("kube.recorded", "kube.withdrawn", "kube.published")
#: a driver switch: the card is in the VFIO record, the switch not yet asked for.
VFIO_POINTS: tuple[str, ...] = ("vfio.recorded",)
#: a DRA claim's prepare: the GPU instance made but its id not yet journaled (the journal says
#: gi-asked), the compute instance made but not journaled, the card switched to vfio-pci, the MPS
#: daemon started, the time slice set (each before the journal says so), the CDI spec (then its
#: consumer copy) written before "prepared".
CLAIM_POINTS: tuple[str, ...] = (
    "claim.gi-created",
    "claim.ci-created",
    "claim.vfio-switched",
    "claim.mps-started",
    "claim.timeslice-set",
    "claim.cdi-written",
    "claim.consumer-written",
)
#: the MIG re-layout its Node label drives (relayoutrun.py): the job journaled (the Node not yet
#: touched), the Node paused and tainted (the journal not yet at draining), the drain seen done (the
#: journal not yet at applying), the cards' layouts asked, and the finishing Node change made (the
#: journal not yet at done).
RELAYOUT_POINTS: tuple[str, ...] = ("relayout.journaled", "relayout.paused", "relayout.drained", "relayout.applying", "relayout.finished")
CRASH_POINTS = BIND_POINTS + RELEASE_POINTS
ALL_POINTS = CRASH_POINTS + KUBE_POINTS + VFIO_POINTS + CLAIM_POINTS + RELAYOUT_POINTS
ENV = "BCD_CONVERGER_CRASH_AT"


class CrashPoints:
    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get(ENV, "") if spec is None else spec
        name, _, nth = spec.partition(":")
        if name and name not in ALL_POINTS:
            raise ValueError(f"{ENV}={spec}: unknown crash point (known: {', '.join(ALL_POINTS)})")
        self.name = name
        self.left = int(nth or 1)

    def __call__(self, point: str) -> None:
        if point == self.name:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["BIND_POINTS", "RELEASE_POINTS", "KUBE_POINTS", "VFIO_POINTS", "CLAIM_POINTS", "RELAYOUT_POINTS", "CRASH_POINTS", "ALL_POINTS", "ENV", "CrashPoints"]
