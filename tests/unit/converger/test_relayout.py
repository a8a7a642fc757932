"""The MIG re-layout's pure rules (services/converger/relayout.py), as tables: when a Node label starts a
job and what job, what each step changes on the Node, and how one card goes from its target to done."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from services.converger import relayout
from services.converger.model import MigLayoutRecord, RelayoutCard, RelayoutJob
from shared.schemas import Gpu, GpuClaim, MigInstance, MigProfile, NodeTaint, NodeView

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)
A, B, C = "0000:1a:00.0", "0000:1b:00.0", "0000:1c:00.0"
BOOT = "boot-1"
TAINT = NodeTaint(key="mig-reconfigure", value="true", effect="NoSchedule")


def profile(name: str, n: int) -> MigProfile:
    return MigProfile(name=name, profile_id=19, slices=1, instances_max=n)


def gpu(pci: str, *, mig: bool = True, mode: bool = False, instances: tuple[str, ...] = ()) -> Gpu:
    uuid = "GPU-" + pci.replace(":", "").replace(".", "")
    return Gpu(
        atom_id=uuid,
        uuid=uuid,
        index=0,
        pci_address=pci,
        mig_mode=mode,
        mig_profiles=[profile("1g.18gb", 7), profile("3g.71gb", 2)] if mig else [],
        mig_instances=[MigInstance(atom_id=f"{uuid}/gi{i}/ci0", gi=i, ci=0, profile=p) for i, p in enumerate(instances, 1)],
    )


def node(labels: dict[str, str] | None = None, *, taints: tuple[NodeTaint, ...] = (), unschedulable: bool = False, rv: str = "7") -> NodeView:
    return NodeView(name="n1", resource_version=rv, labels=labels or {}, taints=list(taints), unschedulable=unschedulable)


def last(config: str, outcome: str) -> RelayoutJob:
    return RelayoutJob(config=config, step="done", outcome=outcome, started_at=NOW, step_since=NOW)


ALL7 = ",".join(["1g.18gb"] * 7)
CFG = "nvidia.com/mig.config"
ST = "nvidia.com/mig.config.state"


@pytest.mark.parametrize(
    ("name", "labels", "gpus", "claims", "prior", "expect"),
    [
        ("nothing to do: no label", {}, [gpu(A)], [], None, ("idle", "")),
        ("nothing to do: success already said for this config", {CFG: "all-1g.18gb", ST: "success"}, [gpu(A)], [], last("all-1g.18gb", "success"), ("idle", "")),
        ("nothing to do: failed stays until the label changes", {CFG: "all-1g.18gb", ST: "failed"}, [gpu(A)], [], last("all-1g.18gb", "failed"), ("idle", "")),
        ("no MIG-capable card: never touched", {CFG: "all-1g.18gb"}, [gpu(A, mig=False)], [], None, ("idle", "no MIG-capable card")),
        ("a new value after success starts", {CFG: "all-3g.71gb", ST: "success"}, [gpu(A)], [], last("all-1g.18gb", "success"), ("pausing", "")),
        ("state label removed: tried again", {CFG: "all-1g.18gb"}, [gpu(A)], [], last("all-1g.18gb", "failed"), ("pausing", "")),
        ("pending without a job (a killed manager): taken over", {CFG: "all-1g.18gb", ST: "pending"}, [gpu(A)], [], None, ("pausing", "")),
        ("unknown config: failed, nothing touched", {CFG: "balanced"}, [gpu(A)], [], None, ("finishing", "no layout bcd makes")),
        ("a profile the card lacks: failed", {CFG: "all-2g.35gb"}, [gpu(A)], [], None, ("finishing", "has no MIG profile 2g.35gb")),
        ("already applied: success at once", {CFG: "all-1g.18gb"}, [gpu(A, mode=True, instances=("1g.18gb",) * 7)], [], None, ("finishing", "already has it")),
        ("all-disabled on MIG-off cards: success at once", {CFG: "all-disabled"}, [gpu(A)], [], None, ("finishing", "already has it")),
        (
            "a held card: failed, naming the holder",
            {CFG: "all-1g.18gb"},
            [gpu(A), gpu(B)],
            [GpuClaim(pci_address=B, kind="allocation", holder="train-01")],
            None,
            ("finishing", "is held by"),
        ),
        (
            "a hold on a card that needs no change does not block",
            {CFG: "all-1g.18gb"},
            [gpu(A), gpu(B, mode=True, instances=("1g.18gb",) * 7)],
            [GpuClaim(pci_address=B, kind="allocation", holder="train-01")],
            None,
            ("pausing", ""),
        ),
    ],
)
def test_plan_start(name: str, labels: dict, gpus: list[Gpu], claims: list[GpuClaim], prior: RelayoutJob | None, expect: tuple[str, str]) -> None:
    got = relayout.plan_start(node(labels), gpus, claims, prior, now=NOW)
    step, text = expect
    if step == "idle":
        assert isinstance(got, relayout.Idle), name
        assert text in got.note
        return
    assert isinstance(got, relayout.Begin), name
    assert got.job.step == step, name
    assert text in got.job.message, (name, got.job.message)
    if step == "finishing":
        assert not got.job.paused and not got.job.tainted and not got.job.cordoned, "a refused job undoes nothing it did not do"


def test_the_job_names_each_holder_and_the_outcome_is_failed() -> None:
    got = relayout.plan_start(
        node({CFG: "all-1g.18gb"}),
        [gpu(A), gpu(B)],
        [GpuClaim(pci_address=A, kind="release", holder="kube-7"), GpuClaim(pci_address=B, kind="domain", holder="vm-3")],
        None,
        now=NOW,
    )
    assert isinstance(got, relayout.Begin)
    assert got.job.outcome == "failed"
    assert "kube-7" in got.job.message and "vm-3" in got.job.message and A in got.job.message and B in got.job.message


def test_the_job_records_what_it_will_change_on_the_node() -> None:
    n = node(
        {CFG: "all-1g.18gb", "nvidia.com/gpu.deploy.device-plugin": "true", "nvidia.com/gpu.deploy.dcgm-exporter": "false", "other": "x"},
        taints=(NodeTaint(key="dedicated", value="gpu", effect="NoSchedule"),),
    )
    got = relayout.plan_start(n, [gpu(A), gpu(B, mig=False), gpu(C, mode=True, instances=("3g.71gb",))], [], None, now=NOW)
    assert isinstance(got, relayout.Begin)
    job = got.job
    assert sorted(job.cards) == [A, C], "a card without MIG is never part of it"
    assert job.cards[A].target == ALL7 and job.cards[A].before == "all-disabled"
    assert job.cards[C].before == "3g.71gb"
    assert job.paused == {"nvidia.com/gpu.deploy.device-plugin": "true"}, "a client set to false is the operator's (mig-parted leaves it too)"
    assert job.tainted and job.cordoned
    assert relayout.claimed_cards(job) == {A: relayout.claimed_cards(job)[A], C: relayout.claimed_cards(job)[C]}

    change = relayout.pause_change(job, n)
    assert change.resource_version == "7"
    assert change.labels == {ST: "pending", "nvidia.com/gpu.deploy.device-plugin": "paused-for-mig-change"}
    assert change.relayout_taint is True and change.unschedulable is True


def test_a_taint_or_cordon_already_there_is_not_the_jobs_to_take_back() -> None:
    n = node({CFG: "all-1g.18gb"}, taints=(TAINT,), unschedulable=True)
    got = relayout.plan_start(n, [gpu(A)], [], None, now=NOW)
    assert isinstance(got, relayout.Begin)
    assert not got.job.tainted and not got.job.cordoned
    change = relayout.pause_change(got.job, n)
    assert change.relayout_taint is None and change.unschedulable is None
    got.job.outcome = "success"
    end = relayout.finish_change(got.job, n)
    assert end.relayout_taint is None and end.unschedulable is None


@pytest.mark.parametrize(
    ("name", "config", "outcome", "labels_now", "expect_labels"),
    [
        ("success keeps the config", "all-1g.18gb", "success", {CFG: "all-1g.18gb", ST: "pending"}, {ST: "success"}),
        ("failed says failed", "all-1g.18gb", "failed", {CFG: "all-1g.18gb", ST: "pending"}, {ST: "failed"}),
        ("all-disabled success removes both labels", "all-disabled", "success", {CFG: "all-disabled", ST: "pending"}, {CFG: None, ST: None}),
        ("all-disabled failed keeps them", "all-disabled", "failed", {CFG: "all-disabled", ST: "pending"}, {ST: "failed"}),
        ("all-disabled done, but a new config was set meanwhile: it stays, its job next", "all-disabled", "success", {CFG: "all-1g.18gb", ST: "pending"}, {ST: "pending"}),
        ("a job whose label was removed meanwhile says nothing", "all-1g.18gb", "success", {ST: "pending"}, {ST: None}),
        (
            "a paused label is restored",
            "all-1g.18gb",
            "success",
            {CFG: "all-1g.18gb", "nvidia.com/gpu.deploy.device-plugin": "paused-for-mig-change"},
            {ST: "success", "nvidia.com/gpu.deploy.device-plugin": "true"},
        ),
        ("a label an operator changed meanwhile keeps their value", "all-1g.18gb", "success", {CFG: "all-1g.18gb", "nvidia.com/gpu.deploy.device-plugin": "false"}, {ST: "success"}),
    ],
)
def test_finish_change(name: str, config: str, outcome: str, labels_now: dict, expect_labels: dict) -> None:
    job = RelayoutJob(
        config=config, step="finishing", outcome=outcome, started_at=NOW, step_since=NOW, paused={"nvidia.com/gpu.deploy.device-plugin": "true"}, tainted=True, cordoned=True
    )
    n = node(labels_now, taints=(TAINT, NodeTaint(key="dedicated", value="gpu", effect="NoSchedule")), unschedulable=True)
    change = relayout.finish_change(job, n)
    assert change.labels == expect_labels, name
    assert change.relayout_taint is False and change.unschedulable is False


def test_finish_after_a_crash_past_the_change_touches_nothing_twice() -> None:
    """Resumed at finishing after the change went through: the taint and cordon are gone, nothing to take back."""
    job = RelayoutJob(config="all-1g.18gb", step="finishing", outcome="success", started_at=NOW, step_since=NOW, tainted=True, cordoned=True)
    change = relayout.finish_change(job, node({CFG: "all-1g.18gb", ST: "success"}))
    assert change.relayout_taint is None and change.unschedulable is None


def rec(layout: str, state: str, *, blocked: str = "", message: str = "") -> MigLayoutRecord:
    return MigLayoutRecord(layout=layout, source="node-label", state=state, since=NOW, blocked_boot=blocked, message=message)


@pytest.mark.parametrize(
    ("name", "card", "g", "record", "disable", "expect"),
    [
        ("nothing to do: done", RelayoutCard(target=ALL7, before="all-disabled", step="done", outcome="success"), gpu(A), None, False, (None, "", "")),
        ("drained: its layout is asked", RelayoutCard(target=ALL7, before="all-disabled", step="draining"), gpu(A), None, False, ("applying", ALL7, "")),
        ("running: wait", RelayoutCard(target=ALL7, before="all-disabled", step="applying"), gpu(A), rec(ALL7, "Applying"), False, (None, "", "")),
        (
            "applied: success",
            RelayoutCard(target=ALL7, before="all-disabled", step="applying"),
            gpu(A, mode=True, instances=("1g.18gb",) * 7),
            rec(ALL7, "Applied"),
            False,
            ("done", "", "success"),
        ),
        ("failed: rolled back to the layout before", RelayoutCard(target=ALL7, before="3g.71gb", step="applying"), gpu(A), rec(ALL7, "Failed", message="NVML"), False, ("rollback", "3g.71gb", "")),
        (
            "rolled back: failed, saying so",
            RelayoutCard(target=ALL7, before="3g.71gb", step="rollback", rolling_back=True, message="x failed"),
            gpu(A, mode=True, instances=("3g.71gb",)),
            rec("3g.71gb", "Applied"),
            False,
            ("done", "", "failed"),
        ),
        ("rollback failed too", RelayoutCard(target=ALL7, before="3g.71gb", step="rollback", rolling_back=True), gpu(A), rec("3g.71gb", "Failed"), False, ("done", "", "failed")),
        (
            "a rollback that waited for a reboot goes on rolling back after it",
            RelayoutCard(target=ALL7, before="all-disabled", step="rebooting", rolling_back=True, message="x failed"),
            gpu(A, mode=True),
            rec("all-disabled", "Applying", blocked="boot-0"),
            False,
            ("rollback", "", ""),
        ),
        ("all-disabled failed: tried once more", RelayoutCard(target="all-disabled", before="3g.71gb", step="applying"), gpu(A, mode=True), rec("all-disabled", "Failed"), True, ("applying", "all-disabled", "")),
        (
            "all-disabled failed twice: failed",
            RelayoutCard(target="all-disabled", before="3g.71gb", step="applying", retried=True, message="tried again after: x"),
            gpu(A, mode=True),
            rec("all-disabled", "Failed"),
            True,
            ("done", "", "failed"),
        ),
        ("a mode change waits for a reboot", RelayoutCard(target=ALL7, before="all-disabled", step="applying"), gpu(A), rec(ALL7, "Pending", blocked=BOOT), False, ("rebooting", "", "")),
        ("after the reboot it applies again", RelayoutCard(target=ALL7, before="all-disabled", step="rebooting"), gpu(A), rec(ALL7, "Applying", blocked="boot-0"), False, ("applying", "", "")),
        ("MIG on with no instance before: nothing to roll back to", RelayoutCard(target=ALL7, before="", step="applying"), gpu(A), rec(ALL7, "Failed"), False, ("done", "", "failed")),
    ],
)
def test_plan_card(name: str, card: RelayoutCard, g: Gpu, record: MigLayoutRecord | None, disable: bool, expect: tuple) -> None:
    move = relayout.plan_card(card, g, record, boot_id=BOOT, disable=disable)
    step, layout, outcome = expect
    assert (move.step, move.set_layout, move.outcome) == (step, layout, outcome), (name, move)


def test_parse_config() -> None:
    assert relayout.parse_config("all-disabled") is None
    assert relayout.parse_config("all-1g.18gb") == "1g.18gb"
    assert relayout.parse_config("all-1g.18gb+me") == "1g.18gb+me"
    for bad in ("", "all-", "1g.18gb", "all-balanced", "all-1g.18gb,3g.71gb", "all-1G.18GB"):
        with pytest.raises(relayout.ConfigError):
            relayout.parse_config(bad)


def test_overall_and_status() -> None:
    job = RelayoutJob(
        config="all-1g.18gb",
        step="applying",
        started_at=NOW,
        step_since=NOW + timedelta(seconds=5),
        cards={A: RelayoutCard(target=ALL7, before="x", step="done", outcome="success"), B: RelayoutCard(target=ALL7, before="x", step="done", outcome="failed", message="NVML said no")},
    )
    out = relayout.overall(job)
    assert out.outcome == "failed" and B in out.message and "NVML said no" in out.message and A not in out.message
    st = relayout.job_state(job)
    assert [c.pci_address for c in st.cards] == [A, B] and st.step == "applying"
    assert relayout.claimed_cards(job) == {}, "done cards are free again"
