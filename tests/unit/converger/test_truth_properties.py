"""Status, dry run and apply say the same thing, for generated specs and disk states (issue 28, the class behind 1-3).

What a hold is (its assignment, changed or not), what a number may be (a
generation up to the largest a spec may carry) and what the disk holds (files
removed or changed from outside between passes) each made the node say
something untrue: the dry run said keep and the apply kept a hold on devices
the spec no longer named; a hold bound at a huge generation was invisible; a
hold whose spec was removed was missing from the status while the journal
said bound. Here, for any first spec, any drift of the disk, and any second
spec (the same allocations with other devices, env or reservation among
them), the dry run's word for each allocation is what the apply then does:

- `bind` / `rebind`: a Bound at the new generation, the hold on disk on the
  assignment's devices (`rebind`: a Released first);
- `restore` and `keep`: no new event, the hold on disk on the assignment's devices;
- `refuse`: an AllocationFailed at the generation, nothing on disk;
- `release`: a Released at the generation (a Kubernetes hold: withdrawn);
- `wait`: nothing on disk yet, its old hold's release pending;

and after the pass the status has nothing to say against the disk, every
hold the status lists is what its assignment says, and the disk reads back
exactly what was written (the hold reader takes every generation written).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bcd.dryrun import summarize_plan
from services.converger.drift import journal_disagreements
from services.converger.plan import assignment_changes, plan
from shared.holddisk import read_disk
from shared.schemas import DeviceAssignment, NodeSpec
from shared.schemas.common import INT64_MAX

from tests.converger_kit import FakeReaper, Node, check_hold_invariants, fast_dir
from tests.unit.converger.test_properties import ASSIGNMENTS, PROFILE, run

KUBE = frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"})

DRIFT = st.lists(st.tuples(st.sampled_from(["spec", "env", "copy"]), st.integers(0, 6)), max_size=3)
#: a second spec: the first's allocations again (some changed), or others
CHANGE = st.sampled_from(["same", "devices", "env", "reservation", "fresh"])
GENERATIONS = st.sampled_from([2, 3, 1000, INT64_MAX])


def _second(first: list[DeviceAssignment], fresh: list[DeviceAssignment], how: list[str]) -> list[DeviceAssignment]:
    out: list[DeviceAssignment] = []
    for a, change in zip(first, how):
        if change == "same":
            out.append(a)
        elif change == "devices":
            out.append(DeviceAssignment(allocation_id=a.allocation_id, reservation_id=a.reservation_id, binding=a.binding, devices=list(reversed(a.devices))[:1] or a.devices, limits=a.limits, env=a.env))
        elif change == "env":
            out.append(DeviceAssignment(allocation_id=a.allocation_id, reservation_id=a.reservation_id, binding=a.binding, devices=a.devices, limits=a.limits, env=["CHANGED=1"]))
        elif change == "reservation":
            out.append(DeviceAssignment(allocation_id=a.allocation_id, reservation_id=a.reservation_id + "-x", binding=a.binding, devices=a.devices, limits=a.limits, env=a.env))
    names = {a.allocation_id for a in out}
    return out + [a for a in fresh if a.allocation_id not in names]


def _drift(node: Node, drifts: list[tuple[str, int]]) -> None:
    holds = sorted(node.holds())
    for what, i in drifts:
        if not holds:
            return
        alloc = holds[i % len(holds)]
        path = {
            "spec": node.cdi_dir / f"bcd-{alloc}.json",
            "env": node.run_dir / "allocations" / f"{alloc}.env",
            "copy": node.consumer_dir / f"bcd-{alloc}.json",
        }[what]
        path.unlink(missing_ok=True)


@PROFILE
@given(first=ASSIGNMENTS, fresh=ASSIGNMENTS, how=st.lists(CHANGE, min_size=5, max_size=5), drifts=DRIFT, generation=GENERATIONS)
def test_status_dry_run_and_apply_say_the_same(first, fresh, how, drifts, generation) -> None:  # noqa: ANN001
    async def scenario(root) -> None:  # noqa: ANN001
        node = Node(root, supported_bindings=KUBE, reaper=FakeReaper())
        s1 = NodeSpec(node_id="node-1", generation=1, devices=first)
        p, r = await node.converge(s1)
        if p.pending and not r.errors:
            await node.converge(s1)
        _drift(node, drifts)
        s2 = NodeSpec(node_id="node-1", generation=generation, devices=_second(first, fresh, how))

        observed = node.observe(s2)
        planned = plan(s2, observed, node.config)
        said = summarize_plan(s2, planned, dict(observed.holds), []).holds
        sends = len(node.outbox.order)
        r = await node.applier.apply(planned, node.state)
        assert not r.errors, r.errors
        ids = {(node.outbox.events[i][0], i) for i in node.outbox.order[sends:]}

        disk = read_disk(node.cdi_dir, node.run_dir, warned=set(), consumer_dir=node.consumer_dir)
        wanted = {a.allocation_id: a for a in s2.devices}
        for h in said:
            alloc = h.allocation_id
            also = {x.action for x in said if x.allocation_id == alloc} - {h.action}
            bound = ("bound", f"node-1.{alloc}.bound.g{generation}") in ids
            released = ("released", f"node-1.{alloc}.released.g{generation}") in ids
            failed = ("failed", f"node-1.{alloc}.failed.g{generation}") in ids
            if h.action in ("bind", "rebind"):
                assert bound and alloc in disk.holds, (alloc, h)
                assert released is (h.action == "rebind"), (alloc, h)
            elif h.action in ("restore", "keep"):
                assert not bound and not released, (alloc, h)
                if alloc in wanted and wanted[alloc].binding in KUBE:
                    assert alloc in disk.holds, (alloc, h)
            elif h.action == "refuse":
                assert failed and alloc not in disk.holds, (alloc, h)
            elif h.action == "release":
                # an allocation the spec dropped, or (refused beside it) whose changed assignment failed
                assert alloc not in disk.holds and (alloc not in wanted or also == {"refuse"}), (alloc, h)
            elif h.action == "wait":
                assert alloc not in disk.holds and alloc in node.releases.load()[0], (alloc, h)
        # what is on disk is what its assignment says (the truth the dry run and apply agreed on)
        for alloc, hold in disk.holds.items():
            assert alloc in wanted, alloc
            assert assignment_changes(wanted[alloc], hold) == (), (alloc, assignment_changes(wanted[alloc], hold))
        # the status has nothing to say against the disk, and the control plane's view holds
        pending, _ = node.releases.load()
        assert journal_disagreements(node.state, disk, pending) == []
        check_hold_invariants(node, settled=False)

    with fast_dir("bcd-truth-") as root:
        run(scenario(root))
