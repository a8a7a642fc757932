"""The seed's MIG re-layout driven by the node's Kubernetes Node label, as pure rules.

Seed 003 ("Настройка выделения GPU по стратегии MIG", steps 3-5, and "Откат MIG"): the
desired layout is the Node's `nvidia.com/mig.config` (`all-<profile>` or `all-disabled`); the
manager sets `nvidia.com/mig.config.state=pending`, pauses the GPU clients
(`nvidia.com/gpu.deploy.*=paused-for-mig-change`), taints `mig-reconfigure=true:NoSchedule`,
drains, applies the layout (`rebooting` while a card waits for a reboot), sets `success` or
`failed`, and takes the taint, the cordon and the pause back; after a successful `all-disabled`
both labels go. bcd keeps the seed's names, so a cluster that watches them works unchanged.

bcd's rules on top (docs/mig-relayout.md says why):
- A card a bcd hold, a bind intent, a pending Kubernetes release, a VM (instance or domain) or a
  DRA claim holds is never reconfigured: the job is refused before it touches anything (the state
  label says `failed`, the annotation `bcd.dev/mig.config.message` names each holder). It is tried
  again when the label's value changes or the state label is removed.
- A card without MIG (no profiles: `nvidia.com/mig.capable=false`) is never touched; a node with
  none does nothing at all, as the seed's manager does not run there.
- The drain evicts only the pods that use a card being changed (kube_reaper's Eviction API path,
  PodDisruptionBudgets respected), bounded by the drain timeout.
- A failed apply rolls the card back to the layout before; a failed `all-disabled` is tried once
  more (MIG off is what was asked: there is nothing to roll back to).
- Everything the job does to the Node is journaled before it is done (`RelayoutJob`), so a
  converger killed at any step resumes the job and always ends with `finishing`, which puts back
  what the job changed.

The journal's steps: pausing -> draining -> applying -> finishing -> (done: `relayout_last`).
A refused or already-applied config goes straight to finishing, with nothing to undo.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from shared.schemas import Gpu, GpuClaim, NodeChange, NodeView, RelayoutCardState, RelayoutState
from shared.schemas.bus import MIG_ALL_DISABLED
from shared.schemas.kubenode import (
    GPU_CLIENT_OPERANDS,
    GPU_DEPLOY_PREFIX,
    MIG_CONFIG_LABEL,
    MIG_STATE_LABEL,
    PAUSED_VALUE,
    RELAYOUT_MESSAGE_ANNOTATION,
    RELAYOUT_MESSAGE_MAX,
    RELAYOUT_TAINT_EFFECT,
    RELAYOUT_TAINT_KEY,
)
from shared.schemas.common import clip

from .gpuops import holder_text, layout_applied, parse_layout
from .model import MigLayoutRecord, RelayoutCard, RelayoutJob

#: how long the drain may take before the job fails (pods that will not go: a PodDisruptionBudget)
DRAIN_TIMEOUT_S = 600.0
#: how often the Node is read while nothing runs, and while a job runs
IDLE_INTERVAL_S = 5.0
BUSY_INTERVAL_S = 1.0
#: the bound `BcdMigRelayoutStuck` (deploy/prometheus/bcd-rules.yml) uses for one step
STUCK_AFTER_S = 1800.0
STEPS = ("pausing", "draining", "applying", "finishing")
CARD_STEPS = ("waiting", "draining", "applying", "rebooting", "rollback", "done")
_PROFILE = re.compile(r"^[0-9]+g\.[0-9]+gb(\+[a-z0-9]+)?$")


class ConfigError(ValueError):
    """The label's value is no layout bcd can make (the text says why)."""


def parse_config(value: str) -> str | None:
    """`all-disabled` -> None (MIG off); `all-<profile>` -> the profile. ConfigError otherwise."""
    if value == MIG_ALL_DISABLED:
        return None
    if value.startswith("all-") and _PROFILE.match(value[4:]):
        return value[4:]
    raise ConfigError(
        f"{MIG_CONFIG_LABEL}={value!r} is no layout bcd makes: it is all-disabled or all-<GPU instance profile> (like all-1g.18gb)"
    )


def mig_capable(gpu: Gpu) -> bool:
    return bool(gpu.mig_profiles)


def card_target(gpu: Gpu, profile: str | None) -> str:
    """The layout text the config asks of one MIG-capable card (every instance it fits); ConfigError if it has no such profile."""
    if profile is None:
        return MIG_ALL_DISABLED
    found = next((p for p in gpu.mig_profiles if p.name == profile), None)
    if found is None:
        names = ", ".join(sorted(p.name for p in gpu.mig_profiles))
        raise ConfigError(f"{gpu.pci_address} has no MIG profile {profile} (it has {names})")
    return ",".join([profile] * max(1, found.instances_max))


def current_layout(gpu: Gpu) -> str:
    """The card's layout now, as a layout text ("" for MIG on with no instance: not a layout to go back to)."""
    if not gpu.mig_mode:
        return MIG_ALL_DISABLED
    return ",".join(sorted(m.profile for m in gpu.mig_instances))


def is_applied(gpu: Gpu, layout: str) -> bool:
    profiles, disable = parse_layout(layout)
    return layout_applied(gpu, profiles, disable)


# ------------------------------------------------------------------------------------- starting


@dataclass(frozen=True)
class Idle:
    """Nothing to do; `note` says why when a label asks for something (shown by status)."""

    note: str = ""


@dataclass(frozen=True)
class Begin:
    """Journal this job, then run it (a refused or applied config is a job at `finishing`)."""

    job: RelayoutJob


def plan_start(
    node: NodeView,
    gpus: Iterable[Gpu],
    claims: Iterable[GpuClaim],
    last: RelayoutJob | None,
    *,
    now: datetime,
    busy: Mapping[str, str] | None = None,
) -> Idle | Begin:
    """What the Node's labels ask when no job runs. `busy`: PCI address -> the maintenance operation
    running on it (gpuops.maintenance_claims), a holder like the claims."""
    desired = node.labels.get(MIG_CONFIG_LABEL, "")
    state = node.labels.get(MIG_STATE_LABEL, "")
    if not desired:
        return Idle()
    if state in ("success", "failed") and (last is None or last.config == desired):
        return Idle()
    capable = [g for g in sorted(gpus, key=lambda g: g.pci_address) if mig_capable(g)]
    if not capable:
        return Idle(f"{MIG_CONFIG_LABEL}={desired} is not applied: this node has no MIG-capable card (nvidia.com/mig.capable=false)")

    def finish_now(outcome: str, message: str, cards: dict[str, RelayoutCard] | None = None) -> Begin:
        return Begin(RelayoutJob(config=desired, step="finishing", outcome=outcome, message=clip(message), started_at=now, step_since=now, cards=cards or {}))

    try:
        profile = parse_config(desired)
        targets = {g.pci_address: card_target(g, profile) for g in capable}
    except ConfigError as exc:
        return finish_now("failed", str(exc))
    change = {g.pci_address: targets[g.pci_address] for g in capable if not is_applied(g, targets[g.pci_address])}
    if not change:
        cards = {pci: RelayoutCard(target=t, before=t, step="done", outcome="success", message="already applied") for pci, t in targets.items()}
        return finish_now("success", f"{desired}: every MIG-capable card already has it", cards)
    holders: dict[str, list[str]] = {}
    for c in claims:
        if c.pci_address in change:
            holders.setdefault(c.pci_address, []).append(holder_text(c))
    for pci, what in (busy or {}).items():
        if pci in change:
            holders.setdefault(pci, []).append(what)
    if holders:
        named = "; ".join(f"{pci} is held by {', '.join(sorted(set(h)))}" for pci, h in sorted(holders.items()))
        return finish_now("failed", f"{desired} not applied: {named} (a held card is never reconfigured; set the label again once it is free)")
    by_pci = {g.pci_address: g for g in capable}
    cards = {pci: RelayoutCard(target=t, before=current_layout(by_pci[pci])) for pci, t in change.items()}
    clients = {GPU_DEPLOY_PREFIX + o for o in GPU_CLIENT_OPERANDS}
    # a label an operator set to "false" is theirs (mig-parted's maybeSetPaused leaves it too)
    paused = {k: v for k, v in sorted(node.labels.items()) if k in clients and v not in ("false", PAUSED_VALUE)}
    has_taint = any(t.key == RELAYOUT_TAINT_KEY and t.effect == RELAYOUT_TAINT_EFFECT for t in node.taints)
    # a job the state label says runs but no journal has (the journal lost, a manager killed before
    # it wrote one): what it left is the job's to take back, as the seed's restarted manager does
    # (cordon, taint, paused clients back to "true", mig-parted's maybeSetTrue)
    taken_over = state in ("pending", "rebooting")
    if taken_over:
        paused.update({k: "true" for k, v in node.labels.items() if k in clients and v == PAUSED_VALUE})
    return Begin(
        RelayoutJob(
            config=desired,
            step="pausing",
            started_at=now,
            step_since=now,
            cards=cards,
            paused=dict(sorted(paused.items())),
            tainted=taken_over or not has_taint,
            cordoned=taken_over or not node.unschedulable,
            message=f"re-layout to {desired}: pausing the GPU clients",
        )
    )


def claimed_cards(job: RelayoutJob | None) -> dict[str, str]:
    """PCI address -> holder text of each card a running job claims (no hold binds there meanwhile)."""
    if job is None or job.step == "finishing":
        return {}
    return {pci: f"MIG re-layout to {job.config} (Node label {MIG_CONFIG_LABEL})" for pci, c in sorted(job.cards.items()) if c.step != "done"}


# ------------------------------------------------------------------------------------- the Node


def pause_change(job: RelayoutJob, node: NodeView) -> NodeChange:
    """The one change that starts the job on the Node: state pending, clients paused, taint, cordon."""
    labels: dict[str, str | None] = {MIG_STATE_LABEL: "pending"}
    labels.update({k: PAUSED_VALUE for k in job.paused})
    return NodeChange(
        resource_version=node.resource_version,
        labels=labels,
        annotations={RELAYOUT_MESSAGE_ANNOTATION: node_message(job.message)},
        relayout_taint=True if job.tainted else None,
        unschedulable=True if job.cordoned else None,
    )


def state_change(node: NodeView, state: str, message: str) -> NodeChange | None:
    """The state label and message as the job says now; None when the Node says it already."""
    message = node_message(message)
    if node.labels.get(MIG_STATE_LABEL) == state and node.annotations.get(RELAYOUT_MESSAGE_ANNOTATION) == message:
        return None
    return NodeChange(resource_version=node.resource_version, labels={MIG_STATE_LABEL: state}, annotations={RELAYOUT_MESSAGE_ANNOTATION: message})


def node_message(message: str) -> str:
    """The job's message as the Node's annotation carries it (kube_reaper takes at most RELAYOUT_MESSAGE_MAX)."""
    return clip(message, RELAYOUT_MESSAGE_MAX)


def finish_change(job: RelayoutJob, node: NodeView) -> NodeChange:
    """The one change that ends the job: the outcome, and everything the job changed put back.

    A paused label is restored only while it still says paused (an operator who changed it since
    keeps their value); the taint and the cordon go only when the job added them."""
    labels: dict[str, str | None] = {}
    asked = node.labels.get(MIG_CONFIG_LABEL, "")
    if asked != job.config:
        # the label changed while the job ran: its outcome is no answer to what is asked now. The
        # new value's job starts at the next read (state pending); a label removed asks nothing.
        labels[MIG_STATE_LABEL] = "pending" if asked else None
    elif job.outcome == "success" and parse_config_or_none(job.config) == "disabled":
        labels[MIG_CONFIG_LABEL] = None
        labels[MIG_STATE_LABEL] = None
    else:
        labels[MIG_STATE_LABEL] = job.outcome or "failed"
    for key, old in job.paused.items():
        if node.labels.get(key) == PAUSED_VALUE:
            labels[key] = old
    has_taint = any(t.key == RELAYOUT_TAINT_KEY and t.effect == RELAYOUT_TAINT_EFFECT for t in node.taints)
    return NodeChange(
        resource_version=node.resource_version,
        labels=labels,
        annotations={RELAYOUT_MESSAGE_ANNOTATION: node_message(job.message)},
        relayout_taint=False if job.tainted and has_taint else None,
        unschedulable=False if job.cordoned and node.unschedulable else None,
    )


def parse_config_or_none(value: str) -> str:
    """"disabled", "profile" or "bad" for a config text."""
    try:
        return "disabled" if parse_config(value) is None else "profile"
    except ConfigError:
        return "bad"


# ------------------------------------------------------------------------------------- applying


@dataclass
class CardMove:
    """What a pass of the applying step does for one card."""

    #: set the card's desired layout record to this ("" leaves it)
    set_layout: str = ""
    #: the card's new step/outcome/message (None leaves it)
    step: str | None = None
    outcome: str = ""
    message: str = ""
    #: the card goes back to its layout before (None leaves it)
    rolling_back: bool | None = None
    #: a failed all-disabled is tried once more (None leaves it)
    retried: bool | None = None


def plan_card(card: RelayoutCard, gpu: Gpu | None, record: MigLayoutRecord | None, *, boot_id: str, disable: bool) -> CardMove:
    """One card in the applying step: from its desired-layout record (gpuops.plan_mig_layouts runs it) to done.

    `record` is the card's MIG layout record as the converger keeps it (state Pending, Applying,
    Applied or Failed; Pending with the boot a mode change waits for a reboot in). A card rolling
    back stays so through a reboot it waits for: it never asks for the layout that failed again."""
    if card.step == "done":
        return CardMove()
    want = card.before if card.rolling_back else card.target
    going = "rollback" if card.rolling_back else "applying"
    if card.step in ("waiting", "draining") or record is None or record.layout != want:
        return CardMove(set_layout=want, step=going, message=card.message)
    if gpu is not None and record.state == "Applied" and is_applied(gpu, want):
        if card.rolling_back:
            return CardMove(step="done", outcome="failed", message=f"{card.message}; rolled back to {card.before}")
        return CardMove(step="done", outcome="success", message=f"{want} applied")
    if record.state == "Pending" and record.blocked_boot and record.blocked_boot == boot_id:
        return CardMove(step="rebooting", message=record.message) if card.step != "rebooting" else CardMove()
    if record.state == "Failed":
        if card.rolling_back:
            return CardMove(step="done", outcome="failed", message=f"{card.message}; the rollback to {card.before} failed too: {record.message}")
        if disable:
            if card.retried:
                return CardMove(step="done", outcome="failed", message=f"MIG off failed twice: {record.message}")
            # the record is asked again: a fresh one, so the maintenance room runs it once more
            return CardMove(set_layout=MIG_ALL_DISABLED, step="applying", retried=True, message=f"tried again after: {record.message}")
        if not card.before:
            return CardMove(step="done", outcome="failed", message=f"{card.target} failed: {record.message}; the card had MIG on with no instance before: left as it is")
        return CardMove(set_layout=card.before, step="rollback", rolling_back=True, message=f"{card.target} failed: {record.message}")
    if card.step == "rebooting" and record.blocked_boot != boot_id:
        return CardMove(step=going, message=f"{card.message} (after the reboot)" if card.rolling_back else "after the reboot")
    return CardMove()


def job_state(job: RelayoutJob) -> RelayoutState:
    return RelayoutState(
        config=job.config,
        step=job.step,
        outcome=job.outcome,
        message=clip(job.message),
        started_at=job.started_at,
        step_since=job.step_since,
        cards=[
            RelayoutCardState(pci_address=pci, target=c.target, before=c.before, step=c.step, outcome=c.outcome, message=clip(c.message))
            for pci, c in sorted(job.cards.items())
        ],
        paused_labels=sorted(job.paused),
        tainted=job.tainted,
        cordoned=job.cordoned,
    )


def card_atoms(gpus: Mapping[str, Gpu], pcis: Iterable[str]) -> list[str]:
    """The whole-card atoms of these cards (kube_reaper holds a card's atom held by any device of it)."""
    return sorted(gpus[p].atom_id for p in pcis if p in gpus)


@dataclass
class Outcome:
    outcome: str
    message: str


def overall(job: RelayoutJob) -> Outcome:
    """Every card done: success when each is; else failed, naming each card that failed."""
    failed = [f"{pci}: {c.message}" for pci, c in sorted(job.cards.items()) if c.outcome != "success"]
    if failed:
        return Outcome("failed", f"{job.config} failed on {len(failed)} card(s): " + "; ".join(failed))
    return Outcome("success", f"{job.config} applied on {len(job.cards)} card(s)")


__all__ = [
    "BUSY_INTERVAL_S",
    "CARD_STEPS",
    "Begin",
    "CardMove",
    "ConfigError",
    "DRAIN_TIMEOUT_S",
    "IDLE_INTERVAL_S",
    "Idle",
    "STEPS",
    "STUCK_AFTER_S",
    "card_atoms",
    "card_target",
    "claimed_cards",
    "current_layout",
    "finish_change",
    "is_applied",
    "job_state",
    "overall",
    "parse_config",
    "pause_change",
    "plan_card",
    "plan_start",
    "state_change",
]
