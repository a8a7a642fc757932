"""Pure derivation of a card's PhysicalGPU status (seed 003, issue 6).

Everything here is a function of its arguments: no clock, no files, no bus.
The caller passes `now`, remembers the few timestamps the rules need (when a
passthrough binding lost its claim, when a reclaim started, the boot id at a
disruption) and hands them back on the next evaluation. That keeps the
2-minute rules testable on fake time and lets the service, the converger and
the CLI agree because they call the same tables.

Four tables, first matching row wins in each:

- `PHASE_ROWS` / `derive_phase`: the phase, read from driverBinding.mode first,
  then from the conditions; never set directly.
- `MANAGEMENT_ROWS` / `management_state`: the five managementState answers and
  the Managed condition that explains them.
- `reclaim_gate` / `reclaim_progress` / `reclaim_answer_applies`: whether a
  reclaim request may start, how a started one ends (the Reclaim condition),
  and how long the answer stays once the request is over.
- `disruption_flow`: the Reconfiguring condition when a driver switch could
  not be rolled back (DisruptionRequired -> DisruptionPending ->
  RebootRequested -> Completing -> cleared).

Constants are defined here, not imported from `build.py`, so `build.py` can
later import this module without a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from shared.schemas import Condition
from shared.schemas.common import PCI_RE
from shared.schemas.inventory import DISRUPTION_REASONS, HEALTHY_CONDITION, RECONFIGURING_REASONS, DriverMode, ManagementState, Phase

VFIO_DRIVER = "vfio-pci"

ADAPTER_READY = "AdapterReady"
MANAGED = "Managed"
RECONFIGURING = "Reconfiguring"
RECLAIM = "Reclaim"

#: a passthrough binding with no claim must last this long, without a break, to read Orphaned.
ORPHAN_GRACE = timedelta(minutes=2)
#: a reclaim not off vfio-pci this long after it started has failed.
RECLAIM_TIMEOUT = timedelta(minutes=2)

#: AdapterReady=False: the card is missing from the scans (fell off the bus); it stays listed while away
NOT_ON_BUS = "NotOnBus"

#: AdapterReady=False reasons after which the card is unusable until someone acts (phase Failed).
FAILED_REASONS = frozenset({"VFIORequiresBareMetal", NOT_ON_BUS})

#: Reconfiguring reasons of the disruption flow (DISRUPTION_REASONS, from shared.schemas.inventory).
DISRUPTION_REQUIRED = "DisruptionRequired"
DISRUPTION_PENDING = "DisruptionPending"
REBOOT_REQUESTED = "RebootRequested"
COMPLETING = "Completing"

#: the reasons of the Managed condition. The seed names six (three for True,
#: three for Unknown); Excluded and Orphaned read Managed=False and carry
#: their answer as the reason (the seed's table of False reasons was not kept).
BACKING_ALLOCATION = "BackingAllocation"
NO_BACKING_ALLOCATION = "NoBackingAllocation"
EXCLUDED_RELEASE_PENDING = "ExcludedReleasePending"
NO_LIVE_BINDING = "NoLiveBinding"
ORPHAN_PENDING = "OrphanPending"
INDETERMINATE = "Indeterminate"
MANAGED_REASONS = frozenset(
    {BACKING_ALLOCATION, NO_BACKING_ALLOCATION, EXCLUDED_RELEASE_PENDING, NO_LIVE_BINDING, ORPHAN_PENDING, INDETERMINATE}
)
EXCLUDED = "Excluded"
ORPHANED = "Orphaned"

#: the reasons of the Reclaim condition (status in brackets):
#: Held [Unknown]          the card reads Unknown/OrphanPending; the request waits and starts by itself at Orphaned.
#: Refused [False]         the managementState gate: the card does not read Orphaned (message names the value).
#: Occupied [False]        the card reads Orphaned, but the re-check found a claim on it.
#: OccupancyUnknown [False] the card reads Orphaned, but occupancy could not be established (fail-closed).
#: InProgress [Unknown]    admitted and started; the card is not on its compute driver yet.
#: Succeeded [True]        the card is back on a compute driver.
#: Failed [False]          still not off vfio-pci (or left without a driver) RECLAIM_TIMEOUT after it started.
RECLAIM_HELD = "Held"
RECLAIM_REFUSED = "Refused"
RECLAIM_OCCUPIED = "Occupied"
RECLAIM_OCCUPANCY_UNKNOWN = "OccupancyUnknown"
RECLAIM_IN_PROGRESS = "InProgress"
RECLAIM_SUCCEEDED = "Succeeded"
RECLAIM_FAILED = "Failed"

ConditionStatus = Literal["True", "False", "Unknown"]


def condition_of(conditions: Sequence[Condition], type_: str) -> Condition | None:
    """The condition of `type_` in `conditions`, or None."""
    for c in conditions:
        if c.type == type_:
            return c
    return None


def _minutes(d: timedelta) -> str:
    total = int(d.total_seconds())
    return f"{total // 60}m{total % 60}s"


# --------------------------------------------------------------------------- 1. phase


@dataclass(frozen=True)
class PhaseRow:
    name: str
    when: Callable[[DriverMode, Condition | None, Condition | None, Condition | None], bool]
    phase: Phase
    why: str


#: (mode, AdapterReady, Reconfiguring, Healthy) -> phase; first match wins.
PHASE_ROWS: tuple[PhaseRow, ...] = (
    PhaseRow(
        "passthrough",
        lambda mode, ready, reconf, healthy: mode == "Passthrough",
        "Passthrough",
        # a card on vfio-pci legitimately has no adapter readiness; read by the
        # conditions alone it would wrongly be Initializing.
        "driverBinding.mode is Passthrough, whatever the conditions say",
    ),
    PhaseRow(
        "unhealthy",
        lambda mode, ready, reconf, healthy: healthy is not None and healthy.status == "False",
        "Failed",
        # a fatal XID, an uncorrectable ECC error, the card lost (health.py): given to nobody new
        "Healthy=False (GpuLost, XidCritical, EccUncorrectable, RowRemapFailed, RowRemapPending, EccCorrectable)",
    ),
    PhaseRow(
        "failed",
        lambda mode, ready, reconf, healthy: ready is not None and ready.status == "False" and ready.reason in FAILED_REASONS,
        "Failed",
        # e.g. a VFIO request on a virtualized node: it never reaches Passthrough.
        "AdapterReady=False with a reason in FAILED_REASONS (VFIORequiresBareMetal, NotOnBus)",
    ),
    PhaseRow(
        "reconfiguring",
        lambda mode, ready, reconf, healthy: reconf is not None
        and reconf.status == "True"
        and reconf.reason in RECONFIGURING_REASONS,
        "Reconfiguring",
        "Reconfiguring=True with a reason of the reconfiguration or disruption flow",
    ),
    PhaseRow(
        "reconfiguring-unknown-reason",
        lambda mode, ready, reconf, healthy: reconf is not None and reconf.status == "True",
        "Initializing",
        # fail-closed: a reconfiguration we cannot place (e.g. a newer peer's
        # reason) must not let the card read Ready and be published.
        "Reconfiguring=True with a reason outside both flows",
    ),
    PhaseRow(
        "ready",
        lambda mode, ready, reconf, healthy: ready is not None and ready.status == "True",
        "Ready",
        "AdapterReady=True",
    ),
    PhaseRow(
        "initializing",
        lambda mode, ready, reconf, healthy: True,
        "Initializing",
        "anything else: no driver, adapter not ready yet, AdapterReady missing or Unknown",
    ),
)


def phase_row(mode: DriverMode, conditions: Sequence[Condition]) -> PhaseRow:
    """The first row of PHASE_ROWS that matches."""
    ready = condition_of(conditions, ADAPTER_READY)
    reconf = condition_of(conditions, RECONFIGURING)
    healthy = condition_of(conditions, HEALTHY_CONDITION)
    for row in PHASE_ROWS:
        if row.when(mode, ready, reconf, healthy):
            return row
    raise AssertionError("PHASE_ROWS ends in a row that always matches")  # pragma: no cover


def derive_phase(mode: DriverMode, conditions: Sequence[Condition]) -> Phase:
    """The phase table (seed 003), first matching row wins.

    | row                          | when                                                   | phase         |
    |------------------------------|--------------------------------------------------------|---------------|
    | passthrough                  | driverBinding.mode is Passthrough (conditions ignored) | Passthrough   |
    | unhealthy                    | Healthy=False (a fatal XID, ECC, the card lost, ...)   | Failed        |
    | failed                       | AdapterReady=False, reason VFIORequiresBareMetal       | Failed        |
    | reconfiguring                | Reconfiguring=True, reason in RECONFIGURING_REASONS    | Reconfiguring |
    | reconfiguring-unknown-reason | Reconfiguring=True, any other reason (fail-closed)     | Initializing  |
    | ready                        | AdapterReady=True                                      | Ready         |
    | initializing                 | anything else                                          | Initializing  |

    A card back on its compute driver leaves Passthrough by itself: the first
    row stops matching and the conditions decide.
    """
    return phase_row(mode, conditions).phase


# --------------------------------------------------------------------------- 2. management state


@dataclass(frozen=True, kw_only=True)
class CardFacts:
    """What management_state reads about one card, gathered by the caller.

    Defaults are the fail-closed reading: an unfilled CardFacts is Indeterminate.
    """

    now: datetime
    #: canonical PCI address; empty or malformed means the card's identity is unknown.
    pci_address: str = ""
    #: kernel driver bound now ("" when none).
    driver: str = ""
    #: the card's native compute driver.
    base_driver: str = ""
    mode: DriverMode = "None"
    #: the claim (allocation / instance) that backs the card, None when none.
    claim: str | None = None
    #: False when the claim lookup failed: `claim` None then proves nothing.
    claim_known: bool = False
    #: the operator excluded the card (`bcd gpu exclude`).
    excluded: bool = False
    #: since when the card has been on a passthrough binding with no claim, without a break (track_orphan).
    passthrough_unclaimed_since: datetime | None = None
    #: how long that must last to read Orphaned (the seed's 2 minutes; shorter only in tests).
    orphan_grace: timedelta = ORPHAN_GRACE


def identity_known(facts: CardFacts) -> bool:
    return bool(PCI_RE.match(facts.pci_address))


def live_binding(facts: CardFacts) -> bool:
    """Load may remain on the card: a claim names it, or it is on a passthrough binding.

    A free card on its compute driver is not a live binding (seed 003: the
    exclusion of such a card reads Excluded at once); a card on vfio-pci is,
    claimed or not, since a VM may still have it -- that is the case where
    "excluded, so it reads Excluded" is false.
    """
    return facts.mode == "Passthrough" or facts.claim is not None


def _orphan_candidate(facts: CardFacts) -> bool:
    """A passthrough binding nobody claims, on a card we can identify and may classify."""
    return (
        identity_known(facts)
        and facts.claim_known
        and facts.claim is None
        and not facts.excluded
        and facts.mode == "Passthrough"
    )


def _orphan_grace_over(facts: CardFacts) -> bool:
    since = facts.passthrough_unclaimed_since
    return since is not None and facts.now - since >= facts.orphan_grace


@dataclass(frozen=True)
class ManagementRow:
    name: str
    when: Callable[[CardFacts], bool]
    state: ManagementState
    status: ConditionStatus
    reason: str
    message: Callable[[CardFacts], str]


#: CardFacts -> (managementState, Managed condition); first match wins.
MANAGEMENT_ROWS: tuple[ManagementRow, ...] = (
    # Indeterminate is the only Unknown where there was nothing to read; it
    # comes first because every later row trusts the identity and the claim.
    ManagementRow(
        "no-identity",
        lambda f: not identity_known(f),
        "Unknown",
        "Unknown",
        INDETERMINATE,
        lambda f: f"the card has no canonical PCI address ({f.pci_address!r}); its identity cannot be established",
    ),
    ManagementRow(
        "claim-lookup-failed",
        lambda f: not f.claim_known,
        "Unknown",
        "Unknown",
        INDETERMINATE,
        lambda f: f"the claim lookup for {f.pci_address} failed; whether anything backs the binding is not known",
    ),
    # exclusion takes effect only once nothing can still run on the card, so
    # an excluded card is never reclaimable while load may remain (a card on
    # vfio-pci has a live binding: it does NOT read Excluded yet).
    ManagementRow(
        "excluded-release-pending",
        lambda f: f.excluded and live_binding(f),
        "Managed",
        "True",
        EXCLUDED_RELEASE_PENDING,
        lambda f: f"excluded, but a live binding remains ({_binding_text(f)}); Excluded once it is released",
    ),
    ManagementRow(
        "excluded",
        lambda f: f.excluded,
        "Excluded",
        "False",
        EXCLUDED,
        lambda f: "excluded by the operator; no live binding remains",
    ),
    ManagementRow(
        "backing-allocation",
        lambda f: f.claim is not None,
        "Managed",
        "True",
        BACKING_ALLOCATION,
        lambda f: f"claim {f.claim} backs the binding ({_binding_text(f)})",
    ),
    # True does not mean taken: a free card on its compute driver is still the
    # module's; it never enters the orphan grace period.
    ManagementRow(
        "unclaimed",
        lambda f: f.mode == "Compute",
        "Unclaimed",
        "True",
        NO_BACKING_ALLOCATION,
        lambda f: f"free: bound to {f.driver or 'its compute driver'}, no claim",
    ),
    ManagementRow(
        "orphaned",
        lambda f: f.mode == "Passthrough" and _orphan_grace_over(f),
        "Orphaned",
        "False",
        ORPHANED,
        lambda f: f"bound to {VFIO_DRIVER} with no claim for {_minutes(f.orphan_grace)} or more without a break",
    ),
    # a short race (claim released, instance about to start) must not read as
    # an orphan, so the binding has to outlast the grace period first.
    ManagementRow(
        "orphan-pending",
        lambda f: f.mode == "Passthrough",
        "Unknown",
        "Unknown",
        ORPHAN_PENDING,
        lambda f: f"bound to {VFIO_DRIVER} with no claim; Orphaned after {_minutes(f.orphan_grace)} without a break",
    ),
    ManagementRow(
        "no-live-binding",
        lambda f: f.mode == "None",
        "Unknown",
        "Unknown",
        NO_LIVE_BINDING,
        lambda f: "no driver is bound and no claim names the card",
    ),
    # unreachable with a valid DriverMode; kept so a bad mode reads fail-closed, not as a row above.
    ManagementRow(
        "bad-mode",
        lambda f: True,
        "Unknown",
        "Unknown",
        INDETERMINATE,
        lambda f: f"driverBinding.mode {f.mode!r} is not one this table knows",
    ),
)


def _binding_text(f: CardFacts) -> str:
    if f.mode == "None":
        return f"claim {f.claim}, no driver"
    return f"bound to {f.driver or f.mode}"


def management_row(facts: CardFacts) -> ManagementRow:
    """The first row of MANAGEMENT_ROWS that matches."""
    for row in MANAGEMENT_ROWS:
        if row.when(facts):
            return row
    raise AssertionError("MANAGEMENT_ROWS ends in a row that always matches")  # pragma: no cover


def management_state(facts: CardFacts) -> tuple[ManagementState, Condition]:
    """managementState and the Managed condition (seed 003), first matching row wins.

    | row                      | when                                             | state     | Managed                     |
    |--------------------------|--------------------------------------------------|-----------|-----------------------------|
    | no-identity              | no canonical PCI address                         | Unknown   | Unknown/Indeterminate       |
    | claim-lookup-failed      | the claim lookup failed                          | Unknown   | Unknown/Indeterminate       |
    | excluded-release-pending | excluded, on vfio-pci or a claim remains         | Managed   | True/ExcludedReleasePending |
    | excluded                 | excluded, no live binding                        | Excluded  | False/Excluded              |
    | backing-allocation       | a claim backs the card                           | Managed   | True/BackingAllocation      |
    | unclaimed                | Compute, no claim                                | Unclaimed | True/NoBackingAllocation    |
    | orphaned                 | Passthrough, no claim, for >= 2 min unbroken     | Orphaned  | False/Orphaned              |
    | orphan-pending           | Passthrough, no claim, less than that            | Unknown   | Unknown/OrphanPending       |
    | no-live-binding          | no driver, no claim                              | Unknown   | Unknown/NoLiveBinding       |
    | bad-mode                 | a mode outside Compute/Passthrough/None          | Unknown   | Unknown/Indeterminate       |

    `facts.passthrough_unclaimed_since` must come from `track_orphan` on every
    observation; the condition's `since` is `facts.now` (the caller keeps the
    old one when status and reason did not change).
    """
    row = management_row(facts)
    return row.state, Condition(
        type=MANAGED, status=row.status, reason=row.reason, message=row.message(facts), since=facts.now
    )


def track_orphan(previous_since: datetime | None, facts: CardFacts, now: datetime) -> datetime | None:
    """The orphan timer: since when the card has been an unclaimed passthrough binding, without a break.

    Starts at `now` when the card first reads as a passthrough binding with no
    claim, keeps `previous_since` while it still does, and resets to None on
    any break: a claim, another driver, no driver, an exclusion, or facts that
    could not be read (a failed claim lookup cannot prove the binding stayed
    unclaimed, so it counts as a break, which only ever delays Orphaned).
    """
    if not _orphan_candidate(facts):
        return None
    return previous_since if previous_since is not None else now


# --------------------------------------------------------------------------- 3. reclaim


Verdict = Literal["admit", "hold", "refuse"]


@dataclass(frozen=True)
class ReclaimDecision:
    """What the gate says to one reclaim request."""

    verdict: Verdict
    #: the Reclaim condition's reason (RECLAIM_* above).
    reason: str
    message: str

    @property
    def keeps_request(self) -> bool:
        """A held request stays and is re-gated on every evaluation; it starts by itself at Orphaned."""
        return self.verdict == "hold"

    def condition(self, now: datetime) -> Condition:
        status: ConditionStatus = "False" if self.verdict == "refuse" else "Unknown"
        return Condition(type=RECLAIM, status=status, reason=self.reason, message=self.message, since=now)


def establish_occupancy(node_name: str, pci_address: str, claim_known: bool, claim: str | None) -> tuple[bool, bool]:
    """(occupancy_known, occupied) for the gate's re-check.

    Without a node name or a PCI address there is nothing to match a claim
    against, and either one missing is enough to make occupancy unknown; so is
    a failed claim lookup.
    """
    if not node_name or not PCI_RE.match(pci_address) or not claim_known:
        return False, False
    return True, claim is not None


def reclaim_gate(state: ManagementState, reason: str, occupancy_known: bool, occupied: bool) -> ReclaimDecision:
    """The reclaim gate (seed 003): managementState first, then a fail-closed occupancy re-check.

    | row               | when                                       | verdict | Reclaim reason   |
    |-------------------|--------------------------------------------|---------|------------------|
    | orphan-pending    | Unknown with Managed reason OrphanPending  | hold    | Held             |
    | not-orphaned      | any state but Orphaned                     | refuse  | Refused          |
    | occupancy-unknown | Orphaned, occupancy not established        | refuse  | OccupancyUnknown |
    | occupied          | Orphaned, a claim found                    | refuse  | Occupied         |
    | admit             | Orphaned, established free                 | admit   | InProgress       |

    A refusal on the state names the managementState value only, never the
    reason behind it: the column tells the operator what to do (wait, free the
    claim, restore the card's identity). A message never repeats the verdict
    (the reason says Refused, and every reader prints it next to the message).
    """
    if state == "Unknown" and reason == ORPHAN_PENDING:
        return ReclaimDecision(
            "hold",
            RECLAIM_HELD,
            "held: managementState is Unknown while the orphan grace period runs; "
            "the reclaim starts by itself once it reads Orphaned",
        )
    if state != "Orphaned":
        return ReclaimDecision("refuse", RECLAIM_REFUSED, f"managementState is {state}")
    if not occupancy_known:
        return ReclaimDecision(
            "refuse", RECLAIM_OCCUPANCY_UNKNOWN, "occupancy of the card could not be established"
        )
    if occupied:
        return ReclaimDecision("refuse", RECLAIM_OCCUPIED, "a claim was found on the card")
    return ReclaimDecision("admit", RECLAIM_IN_PROGRESS, "admitted: returning the card to its compute driver")


def reclaim_progress(
    started_at: datetime, now: datetime, mode: DriverMode, *, timeout: timedelta = RECLAIM_TIMEOUT
) -> Condition:
    """The Reclaim condition of a started reclaim.

    | row       | when                                              | status  | reason     |
    |-----------|---------------------------------------------------|---------|------------|
    | succeeded | mode Compute                                      | True    | Succeeded  |
    | waiting   | not Compute, less than RECLAIM_TIMEOUT elapsed    | Unknown | InProgress |
    | failed    | not Compute, RECLAIM_TIMEOUT or more elapsed      | False   | Failed     |

    Failed is terminal: the module cannot resolve it by itself, so the caller
    stops re-evaluating and an operator follows up (a reboot may be needed).
    `timeout` is RECLAIM_TIMEOUT (the seed's 2 minutes) except in tests.
    """
    elapsed = now - started_at
    if mode == "Compute":
        return Condition(
            type=RECLAIM,
            status="True",
            reason=RECLAIM_SUCCEEDED,
            message="the card is back on its compute driver",
            since=now,
        )
    if elapsed < timeout:
        return Condition(
            type=RECLAIM,
            status="Unknown",
            reason=RECLAIM_IN_PROGRESS,
            message=f"reclaim started {_minutes(max(elapsed, timedelta(0)))} ago; driverBinding.mode is {mode}",
            since=now,
        )
    still = "still Passthrough" if mode == "Passthrough" else mode
    return Condition(
        type=RECLAIM,
        status="False",
        reason=RECLAIM_FAILED,
        message=(
            f"driverBinding.mode is {still} {_minutes(elapsed)} after the reclaim started; "
            "a node reboot may be needed"
        ),
        since=now,
    )


#: Reclaim reasons answered on the management state at the time: they stand while it does.
_STATE_ANSWERS = frozenset({RECLAIM_REFUSED, RECLAIM_OCCUPIED, RECLAIM_OCCUPANCY_UNKNOWN})


def refusal_stays(mode: DriverMode) -> bool:
    """A refused reclaim is set on the card only while a reclaim may still be wanted: the card is off
    its compute driver (on vfio-pci, or none). On its compute driver the refusal is the answer to the
    request alone (the reply says it), and the card keeps no Reclaim condition."""
    return mode != "Compute"


def reclaim_answer_applies(
    answer: Condition, previous_state: ManagementState | None, state: ManagementState, mode: DriverMode
) -> bool:
    """Whether the Reclaim condition of a request that has ended still describes the card.

    A Reclaim condition is born of a request, so nothing re-derives it on the
    next evaluation; without this rule it stayed on the card for good (a
    `Refused ... managementState is Excluded` on a card included since and
    reading Managed). The caller carries the condition from one evaluation to
    the next only while this says True, with `previous_state` the
    managementState of the evaluation that carried it (so, inductively, the
    state it was answered in):

    | reason                              | kept while                                           |
    |-------------------------------------|------------------------------------------------------|
    | Refused, Occupied, OccupancyUnknown | managementState is the one it was answered in, and   |
    |                                     | the card is off its compute driver (mode not Compute)|
    | Succeeded                           | the card is on a compute driver (mode Compute)       |
    | Failed                              | the card is not on a compute driver (still stuck)    |
    | Held, InProgress, anything else     | never: without a request they describe nothing       |

    A refusal on a card on its compute driver describes nothing about the card (there is
    nothing to reclaim): it is the request's answer only, never the card's condition
    (`refusal_stays`), so a healthy free card never reads Reclaim=False.
    """
    if answer.type != RECLAIM:
        return False
    if answer.reason in _STATE_ANSWERS:
        return refusal_stays(mode) and previous_state is not None and previous_state == state
    if answer.reason == RECLAIM_SUCCEEDED:
        return mode == "Compute"
    if answer.reason == RECLAIM_FAILED:
        return mode != "Compute"
    return False


# --------------------------------------------------------------------------- 4. disruption flow


@dataclass(frozen=True, kw_only=True)
class DisruptionFacts:
    now: datetime
    pci_address: str
    driver: str = ""
    base_driver: str = ""
    boot_id_now: str = ""
    #: boot id recorded when DisruptionRequired was raised ("" when unknown).
    boot_id_at_disruption: str = ""
    #: the switcher just failed and could not roll back (no driver left, or stuck on vfio-pci at release).
    rollback_impossible: bool = False


def recovered(facts: DisruptionFacts) -> bool:
    """The card is on its base driver after a new boot: the only proof a reboot really happened.

    An unknown boot id (either one) never proves a new boot: fail-closed.
    """
    return (
        bool(facts.base_driver)
        and facts.driver == facts.base_driver
        and bool(facts.boot_id_now)
        and bool(facts.boot_id_at_disruption)
        and facts.boot_id_now != facts.boot_id_at_disruption
    )


def _stage(previous: Condition | None) -> str | None:
    if previous is None or previous.type != RECONFIGURING or previous.status != "True":
        return None
    return previous.reason if previous.reason in DISRUPTION_REASONS else None


def _reconf(reason: str, message: str, previous: Condition | None, now: datetime) -> Condition:
    # an unchanged stage keeps its transition time
    same = previous is not None and previous.status == "True" and previous.reason == reason
    return Condition(
        type=RECONFIGURING,
        status="True",
        reason=reason,
        message=message,
        since=previous.since if same and previous is not None else now,
    )


def _disruption_message(reason: str, f: DisruptionFacts) -> str:
    base = f.base_driver or "its base driver"
    bound = f.driver or "no driver"
    if reason == DISRUPTION_REQUIRED:
        return (
            f"GPU {f.pci_address} is left on {bound} and cannot be rolled back to {base}; "
            "a node reboot is needed"
        )
    if reason == DISRUPTION_PENDING:
        return f"GPU {f.pci_address} is on {bound}, not {base}: disruption pending; a node reboot is needed"
    if reason == REBOOT_REQUESTED:
        rebooted = bool(f.boot_id_now) and bool(f.boot_id_at_disruption) and f.boot_id_now != f.boot_id_at_disruption
        seen = f" (the node rebooted, but the card is on {bound})" if rebooted else ""
        return f"GPU {f.pci_address}: node reboot requested{seen}; a node reboot is needed to return it to {base}"
    return f"GPU {f.pci_address} is back on {base} after a node reboot; completing"


def disruption_flow(previous: Condition | None, facts: DisruptionFacts) -> Condition | None:
    """The next Reconfiguring condition of the disruption flow; None means cleared (or none).

    One step per evaluation, first matching row wins:

    | row                | previous stage                    | when                    | next               |
    |--------------------|-----------------------------------|-------------------------|--------------------|
    | raise              | none, or not a disruption stage   | rollback impossible     | DisruptionRequired |
    | untouched          | none, or not a disruption stage   | otherwise               | previous as is     |
    | re-raise           | Completing                        | rollback impossible     | DisruptionRequired |
    | pending            | DisruptionRequired                | -                       | DisruptionPending  |
    | reboot             | DisruptionPending                 | -                       | RebootRequested    |
    | completing         | RebootRequested                   | recovered (new boot id) | Completing         |
    | wait-reboot        | RebootRequested                   | otherwise               | RebootRequested    |
    | clear              | Completing                        | recovered               | None (cleared)     |
    | relapse            | Completing                        | otherwise               | RebootRequested    |

    A repeated failure while DisruptionRequired/Pending/RebootRequested is the
    same disruption still waiting for a reboot, so it does not restart the
    flow. Whenever the result is DisruptionRequired the caller records
    `boot_id_now` as the boot id at disruption. "Completing" is read as a
    disruption stage: in bcd only this flow writes Reconfiguring.
    """
    stage = _stage(previous)
    now = facts.now

    def to(reason: str) -> Condition:
        return _reconf(reason, _disruption_message(reason, facts), previous, now)

    if stage is None:
        return to(DISRUPTION_REQUIRED) if facts.rollback_impossible else previous
    if stage == COMPLETING and facts.rollback_impossible:
        return to(DISRUPTION_REQUIRED)
    if stage == DISRUPTION_REQUIRED:
        return to(DISRUPTION_PENDING)
    if stage == DISRUPTION_PENDING:
        return to(REBOOT_REQUESTED)
    if stage == REBOOT_REQUESTED:
        return to(COMPLETING) if recovered(facts) else to(REBOOT_REQUESTED)
    # Completing
    return None if recovered(facts) else to(REBOOT_REQUESTED)


__all__ = [
    "VFIO_DRIVER",
    "ADAPTER_READY",
    "MANAGED",
    "RECONFIGURING",
    "RECLAIM",
    "ORPHAN_GRACE",
    "RECLAIM_TIMEOUT",
    "FAILED_REASONS",
    "NOT_ON_BUS",
    "DISRUPTION_REQUIRED",
    "DISRUPTION_PENDING",
    "REBOOT_REQUESTED",
    "COMPLETING",
    "DISRUPTION_REASONS",
    "RECONFIGURING_REASONS",
    "BACKING_ALLOCATION",
    "NO_BACKING_ALLOCATION",
    "EXCLUDED_RELEASE_PENDING",
    "NO_LIVE_BINDING",
    "ORPHAN_PENDING",
    "INDETERMINATE",
    "MANAGED_REASONS",
    "EXCLUDED",
    "ORPHANED",
    "RECLAIM_HELD",
    "RECLAIM_REFUSED",
    "RECLAIM_OCCUPIED",
    "RECLAIM_OCCUPANCY_UNKNOWN",
    "RECLAIM_IN_PROGRESS",
    "RECLAIM_SUCCEEDED",
    "RECLAIM_FAILED",
    "condition_of",
    "PhaseRow",
    "PHASE_ROWS",
    "phase_row",
    "derive_phase",
    "CardFacts",
    "identity_known",
    "live_binding",
    "ManagementRow",
    "MANAGEMENT_ROWS",
    "management_row",
    "management_state",
    "track_orphan",
    "ReclaimDecision",
    "establish_occupancy",
    "reclaim_gate",
    "reclaim_progress",
    "reclaim_answer_applies",
    "DisruptionFacts",
    "recovered",
    "disruption_flow",
]
