"""The VFIO side of the converger: which cards to switch, and who claims each card.

Pure (no files, no bus, no clock): `plan_vfio` decides the driver switches of
one pass from the spec, what the pass observed and which cards holds and
pending releases name; `card_claims` lists every card's claims, the one
answer behind the `holder` and `claims` endpoints.

The switch rules, per card (first match decides):

| # | card                                                        | step                         |
|---|-------------------------------------------------------------|------------------------------|
| 1 | an instance names it, on vfio-pci                           | record the instance (if new) |
| 2 | an instance names it, the inventory does not list it        | note                         |
| 3 | an instance names it, DisruptionRequired in this boot       | note (no retry this boot)    |
| 4 | an instance names it, the host is virtualized               | note                         |
| 5 | an instance names it, it reads Excluded or ExcludedReleasePending | note                   |
| 5b| an instance names it, Healthy=False (a fatal XID, ECC, lost) | note, naming the condition  |
| 6 | an instance names it, Reconfiguring=True (disruption flow)  | note (the inventory's change retriggers) |
| 7 | an instance names it, a hold / bind intent / release names it | note, wait (retried)       |
| 8 | an instance names it                                        | switch to vfio-pci           |
| 9 | in the record, no instance names it, a running domain has it | nothing (returned once the domain stops) |
|10 | in the record, no instance, not listed by the inventory     | note                         |
|11 | in the record, no instance, on a driver other than vfio-pci | drop the record              |
|12 | in the record, no instance, DisruptionRequired in this boot | note                         |
|13 | in the record, no instance                                  | switch native                |
|14 | not in the record, on vfio-pci, Reclaim=Unknown/InProgress, no instance or running domain has it, a hold / release names it or DisruptionRequired in this boot | note |
|15 | not in the record, on vfio-pci, Reclaim=Unknown/InProgress, no claim of the converger at all | switch native ("reclaim") |

A card on vfio-pci the converger did not put there (not in the record) is
never switched back by it, except through a reclaim the inventory admitted
(rule 15). "On vfio-pci" reads the inventory, or where a switch since the
inventory was read left the card (Observed.switched), so the plan right after
a successful switch is empty. A switch records the card before it is asked
for (apply.py); a switch back keeps the record until it succeeded, a reclaim
is recorded as "reclaim".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import msgspec

from shared.schemas import Condition, GpuClaim, Inventory, NodeSpec
from shared.schemas.inventory import RECONFIGURING_REASONS, Gpu, PhysicalGPUStatus, health_text

from .model import Observed, RecordVfio, Step, SwitchGpu

VFIO_DRIVER = "vfio-pci"
NATIVE = "native"
#: the record's holder of a card being switched back for an admitted reclaim.
RECLAIM = "reclaim"
#: the holder named when a new hold asks for a card the operator excluded.
EXCLUDED_HOLDER = "(excluded by the operator)"
UNREADABLE_RELEASES_HOLDER = "(pending Kubernetes releases that could not be read)"

#: Managed condition reasons (and managementState) that keep a card from vfio-pci and from new holds.
EXCLUDED_REASONS = frozenset({"Excluded", "ExcludedReleasePending"})

#: kind order of a card's claims: the holder endpoint answers the first.
CLAIM_KINDS = ("allocation", "claim", "release", "instance", "domain")
#: GpuClaim.holder's maximum length (shared.schemas Name).
HOLDER_MAX = 256


def _condition(gpu: Gpu, type_: str) -> Condition | None:
    return next((c for c in gpu.status.conditions if c.type == type_), None)


def excluded(gpu: Gpu) -> bool:
    """The card reads Excluded or ExcludedReleasePending (managementState or Managed reason)."""
    if gpu.status.driver_binding.management_state == "Excluded":
        return True
    managed = _condition(gpu, "Managed")
    return managed is not None and managed.reason in EXCLUDED_REASONS


#: the card conditions a pass reads (besides Managed, read only for an exclusion); Healthy: a
#: card that turns unhealthy takes no new hold and its holds say so (a pass must run for it)
PASS_CONDITIONS = frozenset({"Reclaim", "Reconfiguring", "Healthy"})
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def planner_view(inventory: Inventory) -> Inventory:
    """The inventory as a pass reads it: without what a claims change alone rewrites.

    The inventory derives managementState, the Managed condition and the phase
    from the converger's claims, and stamps every change with a revision and a
    time; a pass reads a card's managementState and Managed reason only as
    "excluded or not" (`excluded`), its Reclaim, Reconfiguring and Healthy conditions,
    and everything else of the inventory but the running processes. Two
    inventories whose views are equal plan alike.
    """
    gpus = []
    for g in inventory.gpus:
        st = g.status
        binding = st.driver_binding
        state = binding.management_state if binding.management_state == "Excluded" else "Unknown"
        conditions = [
            c for c in st.conditions if c.type in PASS_CONDITIONS or (c.type == "Managed" and c.reason in EXCLUDED_REASONS)
        ]
        gpus.append(
            msgspec.structs.replace(
                g,
                status=PhysicalGPUStatus(
                    driver_binding=msgspec.structs.replace(binding, management_state=state), conditions=conditions
                ),
            )
        )
    return msgspec.structs.replace(inventory, revision=0, observed_at=_EPOCH, gpus=gpus, processes=[])


def reclaim_in_progress(gpu: Gpu) -> bool:
    """The inventory admitted a reclaim of the card: Reclaim=Unknown, reason InProgress."""
    c = _condition(gpu, "Reclaim")
    return c is not None and c.status == "Unknown" and c.reason == "InProgress"


def reconfiguring(gpu: Gpu) -> Condition | None:
    """Reconfiguring=True with a reason of the reconfiguration or disruption flow, or None."""
    c = _condition(gpu, "Reconfiguring")
    return c if c is not None and c.status == "True" and c.reason in RECONFIGURING_REASONS else None


def switched_targets(switched: Mapping[str, tuple[str, datetime]], inventory: Inventory | None) -> dict[str, str]:
    """PCI address -> where a switch left the card ("vfio-pci", "native", or the
    driver it was left on), for the switches the inventory was read before.

    `switched` holds each with the time its reply came; an inventory observed
    at or after that time shows the card as it is, so the entry no longer
    applies.
    """
    if inventory is None:
        return {pci: target for pci, (target, _) in switched.items()}
    return {pci: target for pci, (target, at) in switched.items() if inventory.observed_at < at}


@dataclass(frozen=True)
class VfioPlan:
    steps: tuple[Step, ...] = ()
    notes: tuple[str, ...] = ()
    #: cards waiting for a hold, bind intent or pending release to go (retried).
    waiting: tuple[str, ...] = ()


def instance_claims(spec: NodeSpec) -> dict[str, str]:
    """PCI address -> the first instance (spec order) that names it."""
    claimed: dict[str, str] = {}
    for inst in spec.instances:
        for pci in inst.gpus:
            claimed.setdefault(pci, inst.instance_id)
    return claimed


def plan_vfio(spec: NodeSpec, observed: Observed, held: Mapping[str, str]) -> VfioPlan:
    """The driver switches of one pass (the rules in the module docstring).

    `held`: PCI address -> holder, for every card a live hold, a bind intent or
    a pending Kubernetes release names after this pass's releases (every card
    while the releases file is unreadable).
    """
    state = observed.state
    inv = observed.inventory
    gpus = {g.pci_address: g for g in inv.gpus} if inv is not None else {}
    virtualized = inv.host.virtualized if inv is not None else False
    stuck = {pci for pci, boot in state.vfio_stuck.items() if boot and boot == state.boot_id}
    domains = state.domain_gpus
    steps: list[Step] = []
    notes: list[str] = []
    waiting: list[str] = []

    def driver(g: Gpu) -> str:
        """The driver bound now: the inventory's, or what a switch since then left."""
        if g.pci_address not in observed.switched:
            return g.driver
        now = observed.switched[g.pci_address]
        return (g.base_driver or NATIVE) if now == NATIVE else now

    if inv is None:
        return VfioPlan()
    claimed = instance_claims(spec)
    for pci, inst in claimed.items():
        who = f"instance {inst}"
        g = gpus.get(pci)
        if g is None:
            notes.append(f"{who}: {pci} is not a GPU this node lists; not switched to {VFIO_DRIVER}")
            continue
        bound = driver(g)
        if bound == VFIO_DRIVER:
            if state.vfio.get(pci) != inst:
                steps.append(RecordVfio(pci, inst))
            continue
        if pci in stuck:
            notes.append(f"{who}: {pci} needs a node reboot (a switch could not be rolled back in this boot); not switched again")
            continue
        if virtualized:
            notes.append(f"{who}: {pci} stays on {bound or 'no driver'}: VFIO passthrough needs a bare-metal host")
            continue
        if excluded(g):
            notes.append(f"{who}: {pci} is excluded by the operator; not switched to {VFIO_DRIVER}")
            continue
        if (sick := g.status.unhealthy()) is not None:
            # a VM must not get a card that threw a fatal XID; one it has already is kept (row 1)
            notes.append(f"{who}: {pci} is unhealthy ({health_text(sick)}); not switched to {VFIO_DRIVER}")
            continue
        if (reconf := reconfiguring(g)) is not None:
            notes.append(f"{who}: {pci} waits: Reconfiguring={reconf.reason}")
            continue
        if pci in held:
            notes.append(f"{who}: {pci} waits for {held[pci]} to let go before it goes to {VFIO_DRIVER}")
            waiting.append(pci)
            continue
        steps.append(SwitchGpu(pci, VFIO_DRIVER, who, inst))

    for pci, holder in sorted(state.vfio.items()):
        if pci in claimed or pci in domains:
            continue
        g = gpus.get(pci)
        if g is None:
            notes.append(f"{pci} ({holder}) is not a GPU this node lists; kept in the VFIO record")
            continue
        bound = driver(g)
        if bound and bound != VFIO_DRIVER:
            steps.append(RecordVfio(pci, None))
            continue
        if pci in stuck:
            notes.append(f"{pci} needs a node reboot (a switch could not be rolled back in this boot); not switched again")
            continue
        why = RECLAIM if holder == RECLAIM else f"instance {holder} no longer claims it"
        steps.append(SwitchGpu(pci, NATIVE, why, holder))

    for pci, g in sorted(gpus.items()):
        if pci in state.vfio or pci in claimed or pci in domains:
            continue
        if driver(g) != VFIO_DRIVER or not reclaim_in_progress(g):
            continue
        if pci in held:
            notes.append(f"reclaim of {pci} waits: {held[pci]} names it")
            continue
        if pci in stuck:
            notes.append(f"reclaim of {pci}: it needs a node reboot (a switch could not be rolled back in this boot)")
            continue
        steps.append(SwitchGpu(pci, NATIVE, RECLAIM, RECLAIM))
    return VfioPlan(steps=tuple(steps), notes=tuple(notes), waiting=tuple(waiting))


# ------------------------------------------------------------------------------ claims


def _names(devices: Iterable[str], atom_id: str) -> bool:
    return any(d == atom_id or d.startswith(atom_id + "/") for d in devices)


def card_claims(
    *,
    inventory: Inventory,
    holds: Mapping[str, Sequence[str]],
    intents: Mapping[str, Sequence[str]],
    pending: Mapping[str, Sequence[str]],
    releases_unreadable: bool,
    spec: NodeSpec | None,
    domain_gpus: Mapping[str, str],
    dra_claims: Mapping[str, Sequence[str]] | None = None,
) -> list[GpuClaim]:
    """Every card's claims, by PCI address, each card's in kind order.

    allocation: live holds (their CDI spec on disk), then bind/release intents
    not finished; release: pending Kubernetes releases, and every card while
    the releases file is unreadable; instance: instance specs; domain: domains
    running at the last pass. `holds`, `intents`, `pending`: allocation ->
    devices (atom ids); claim: DRA claims' holds, `dra_claims` holder text -> atoms.
    """
    by_pci: dict[str, list[GpuClaim]] = {}

    def add(pci: str, kind: str, holder: str) -> None:
        holder = holder[:HOLDER_MAX]  # a domain name is the host's; the wire type caps it
        lst = by_pci.setdefault(pci, [])
        if not any(c.kind == kind and c.holder == holder for c in lst):
            lst.append(GpuClaim(pci_address=pci, kind=kind, holder=holder))  # type: ignore[arg-type]

    for g in inventory.gpus:
        if not g.atom_id:
            continue
        for alloc, devices in sorted(holds.items()):
            if _names(devices, g.atom_id):
                add(g.pci_address, "allocation", alloc)
        for alloc, devices in sorted(intents.items()):
            if _names(devices, g.atom_id):
                add(g.pci_address, "allocation", alloc)
        for holder, devices in sorted((dra_claims or {}).items()):
            if _names(devices, g.atom_id):
                add(g.pci_address, "claim", holder)
        for alloc, devices in sorted(pending.items()):
            if _names(devices, g.atom_id):
                add(g.pci_address, "release", alloc)
    if releases_unreadable:
        for g in inventory.gpus:
            add(g.pci_address, "release", UNREADABLE_RELEASES_HOLDER)
    if spec is not None:
        for inst in spec.instances:
            for pci in inst.gpus:
                add(pci, "instance", inst.instance_id)
    for pci, name in sorted(domain_gpus.items()):
        add(pci, "domain", name)
    out: list[GpuClaim] = []
    for pci in sorted(by_pci):
        out.extend(sorted(by_pci[pci], key=lambda c: CLAIM_KINDS.index(c.kind)))
    return out


__all__ = [
    "planner_view",
    "PASS_CONDITIONS",
    "VFIO_DRIVER",
    "NATIVE",
    "RECLAIM",
    "EXCLUDED_HOLDER",
    "EXCLUDED_REASONS",
    "CLAIM_KINDS",
    "excluded",
    "reclaim_in_progress",
    "reconfiguring",
    "switched_targets",
    "VfioPlan",
    "instance_claims",
    "plan_vfio",
    "card_claims",
]
