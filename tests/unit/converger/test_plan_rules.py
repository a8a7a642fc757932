"""Table tests of the pure planner: every rule of the pass and every failure reason.

Each row builds a node on real files (tests/converger_kit.py), optionally
converges a `before` spec, changes the host or drifts the disk, then plans
`spec` and checks the exact step kinds, which allocations are bound, the
failures (allocation, reason, message: the seed's texts are the contract),
the notes and the section the pass aims for.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from datetime import datetime, timezone

from services.converger.model import BindHold, PlanConfig, ReportFailed
from services.converger.plan import UNREADABLE_RELEASES_HOLDER, plan
from shared.schemas import Condition, Inventory, InstanceGpus, Limits, NodeSpec

from tests.converger_kit import GPU, Node, hold, host_copy, rewrite_host, spec, with_status

G = GPU
MISSING_GPU = "GPU-5f1c2a90-0000-4000-8000-000000000009"
GIB = 1 << 30
PAGE_1G = 1048576
UNPRIVILEGED = "this node runs unprivileged (not root, no helper): it cannot write CDI specs or create slices"
NO_ADMISSION = "host memory unreadable; binding without host-side admission"
PCI = {0: "0000:18:00.0", 1: "0000:2a:00.0", 6: "0000:ba:00.0"}


# ------------------------------------------------------------------------------ host changes


def memory_8gib(doc: dict) -> None:
    doc["memory"] = {"total_bytes": 8 * GIB, "available_bytes": 8 * GIB}


def memory_zero(doc: dict) -> None:
    doc["memory"] = {"total_bytes": 0, "available_bytes": 0}


def memory_unreadable(doc: dict) -> None:
    doc["memory"] = {"total_bytes": None, "available_bytes": None}


def pages_1g(free0: int, free1: int, total: int = 64) -> Callable[[dict], None]:
    def change(doc: dict) -> None:
        for node, free in zip(doc["numa_nodes"], (free0, free1)):
            for pool in node["hugepages"]:
                if pool["page_size_kib"] == PAGE_1G:
                    pool["total"], pool["free"] = total, free

    return change


def domain_on_gpu1(doc: dict) -> None:
    doc["domains"] = [{"name": "build-vm-01", "gpus": [PCI[1]]}]


def gpu3_on_vfio(doc: dict) -> None:
    doc["gpus"][3]["driver"] = "vfio-pci"


T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def excluded(pci: str, reason: str = "Excluded") -> Callable[[Inventory], Inventory]:
    """The card reads Excluded (or Managed/ExcludedReleasePending) in the inventory."""
    state = "Excluded" if reason == "Excluded" else "Managed"
    status = "False" if reason == "Excluded" else "True"
    cond = Condition(type="Managed", status=status, reason=reason, message="excluded (test)", since=T0)
    return lambda inv: with_status(inv, pci, management_state=state, conditions=(cond,))


def gpu4_to_mig(doc: dict) -> None:
    """Card index 4 (slots) goes into MIG mode with one instance gi1/ci0."""
    g = doc["gpus"][4]
    g["slots"] = 0
    g["mig_mode"] = True
    g["mig_profiles"] = doc["gpus"][6]["mig_profiles"]
    g["mig_instances"] = [
        {"gi": 1, "ci": 0, "profile": "1c.3g.71gb", "uuid": "MIG-7d3e61b0-0004-4001-8000-000000000001", "memory_bytes": 75430363136}
    ]


# ------------------------------------------------------------------------------ drift on disk


def remove_env(alloc: str) -> Callable[[Node], None]:
    return lambda node: (node.run_dir / "allocations" / f"{alloc}.env").unlink()


def remove_slice(alloc: str) -> Callable[[Node], None]:
    return lambda node: node.slices.path(alloc).unlink()


def edit_slice(alloc: str, change: Callable[[dict], None]) -> Callable[[Node], None]:
    """A fake slice record changed from outside (issue 41.1): `change` gets its JSON."""

    def run(node: Node) -> None:
        path = node.slices.path(alloc)
        record = json.loads(path.read_text())
        change(record)
        path.write_text(json.dumps(record))

    return run


def memory_max(value: object) -> Callable[[dict], None]:
    return lambda record: record["properties"].__setitem__("MemoryMax", value)


def both(*drifts: Callable[[Node], None]) -> Callable[[Node], None]:
    def run(node: Node) -> None:
        for d in drifts:
            d(node)

    return run


def leftover_slice(alloc: str, pids: tuple[int, ...] = ()) -> Callable[[Node], None]:
    def run(node: Node) -> None:
        node.slices.apply(alloc, Limits(cpus="0-1"))
        if pids:
            node.slices.set_pids(alloc, list(pids))

    return run


def foreign_files(node: Node) -> None:
    (node.cdi_dir / "bcd-foreign.json").write_text('{"cdiVersion": "0.6.0", "kind": "example.com/thing", "devices": []}')
    (node.cdi_dir / "bcd-broken.json").write_text("{not json")
    (node.cdi_dir / "other-vendor.json").write_text('{"cdiVersion": "0.5.0", "kind": "acme.com/gpu", "devices": []}')


def temp_files(node: Node) -> None:
    (node.cdi_dir / ".bcd-a1.json.tmp-4242").write_text("{")
    (node.run_dir / "allocations" / ".a1.env.tmp-4242").write_text("BCD_")


def remove_copy(alloc: str) -> Callable[[Node], None]:
    return lambda node: (node.consumer_dir / f"bcd-{alloc}.json").unlink()


def edit_copy(alloc: str) -> Callable[[Node], None]:
    """A consumer copy changed from outside (one env entry more): no longer what its hold spec makes."""

    def run(node: Node) -> None:
        path = node.consumer_dir / f"bcd-{alloc}.json"
        path.write_text(path.read_text().replace('"env": [', '"env": ["INJECTED=1", ', 1))

    return run


def orphan_copy(alloc: str) -> Callable[[Node], None]:
    """A consumer copy whose hold spec is gone (its hold spec removed from outside, or an old bcd's)."""

    def run(node: Node) -> None:
        node.consumer_dir.mkdir(parents=True, exist_ok=True)
        (node.consumer_dir / f"bcd-{alloc}.json").write_text('{"cdiVersion": "0.3.0", "kind": "bcd.dev/gpu", "devices": []}')

    return run


def foreign_copies(node: Node) -> None:
    """Another program's specs in the consumer dir (NVIDIA's generated one, a name that is no id)."""
    node.consumer_dir.mkdir(parents=True, exist_ok=True)
    (node.consumer_dir / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    (node.consumer_dir / "bcd-Not_An_Id.json").write_text("{}")


def copy_temp_file(node: Node) -> None:
    (node.consumer_dir / ".bcd-a1.json.tmp-4242").write_text("{")


# ------------------------------------------------------------------------------ the table


@dataclass
class Row:
    id: str
    spec: NodeSpec
    kinds: list[str]
    #: (allocation, reason, message) in spec order
    failures: list[tuple[str, str, str]] = field(default_factory=list)
    #: allocations of the BindHold steps, in order
    bound: list[str] = field(default_factory=list)
    before: NodeSpec | None = None
    host: Callable[[dict], None] | None = None
    host_after: Callable[[dict], None] | None = None
    drift: Callable[[Node], None] | None = None
    node: dict[str, Any] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    #: (spec, allocations): after `before`, these allocations' files are saved, `spec` converged
    #: until their releases are reported, and the files put back (a copy of a released hold)
    put_back: tuple[NodeSpec, tuple[str, ...]] | None = None
    notes: tuple[str, ...] = ()
    #: changes the inventory the pass plans against (a card's status)
    inventory: Callable[[Inventory], Inventory] | None = None


S1 = spec(1, hold("a1", G[0], cpus="0-3", memory_bytes=4 * GIB), hold("a2", f"{G[6]}/gi1/ci0"), hold("a3", f"{G[4]}/slot0", f"{G[4]}/slot1"))
INST = [InstanceGpus(instance_id="vm-a", gpus=[PCI[0], PCI[6]])]

ROWS = [
    # -------------------------------------------------------------- no-op and plain binds
    Row("nothing-to-do-converged", S1, [], before=S1),
    Row("nothing-to-do-empty", spec(1), []),
    Row("bind-whole-mig-slots", S1, ["BindHold"] * 3, bound=["a1", "a2", "a3"]),
    Row("kubernetes-when-supported", spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")), ["BindHold"], bound=["k1"],
        node={"supported_bindings": frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"})}),
    # -------------------------------------------------------------- unsupported-binding
    Row("binding-instance", spec(1, hold("v1", G[0], binding="BINDING_INSTANCE")), ["ReportFailed"],
        [("v1", "unsupported-binding", "BINDING_INSTANCE is not a hold: GPUs for VMs come in the instances section")]),
    Row("binding-unspecified", spec(1, hold("u1", G[0], binding="BINDING_UNSPECIFIED")), ["ReportFailed"],
        [("u1", "unsupported-binding", "BINDING_UNSPECIFIED is not supported by this node")]),
    Row("binding-kubernetes-where-unsupported", spec(1, hold("k1", G[0], binding="BINDING_KUBERNETES")), ["ReportFailed"],
        [("k1", "unsupported-binding", "BINDING_KUBERNETES is not supported by this node")],
        node={"supported_bindings": frozenset({"BINDING_HOLD"})}),
    # -------------------------------------------------------------- node-unprivileged
    Row("unprivileged-plain-hold", spec(1, hold("a1", G[0])), ["ReportFailed"],
        [("a1", "node-unprivileged", UNPRIVILEGED)], node={"privileged": False}),
    Row("unprivileged-sliced-hold", spec(1, hold("a1", G[0], cpus="0-3", memory_bytes=GIB)), ["ReportFailed"],
        [("a1", "node-unprivileged", UNPRIVILEGED)], node={"privileged": False}),
    # -------------------------------------------------------------- unsupported-device
    Row("device-nic-vf", spec(1, hold("n1", "nic.vf/0000:3b:00.2")), ["ReportFailed"],
        [("n1", "unsupported-device", "nic.vf/0000:3b:00.2: device class nic.vf is not supported by this node")]),
    Row("device-disk", spec(1, hold("d1", "disk/nvme0n1")), ["ReportFailed"],
        [("d1", "unsupported-device", "disk/nvme0n1: device class disk is not supported by this node")]),
    Row("device-malformed-mig", spec(1, hold("m1", f"{G[6]}/gi1")), ["ReportFailed"],
        [("m1", "unsupported-device", f"{G[6]}/gi1 is not a well-formed GPU, MIG instance or slot id")]),
    Row("device-malformed-slot", spec(1, hold("s1", f"{G[4]}/slotA")), ["ReportFailed"],
        [("s1", "unsupported-device", f"{G[4]}/slotA is not a well-formed GPU, MIG instance or slot id")]),
    # issue 28.8: a bare word said "device class gpu0 is not supported"
    Row("device-bare-word", spec(1, hold("g0", "gpu0")), ["ReportFailed"],
        [("g0", "unsupported-device", "gpu0 is not a well-formed GPU, MIG instance or slot id")]),
    Row("device-malformed-slot-leading-zero", spec(1, hold("s1", f"{G[4]}/slot01")), ["ReportFailed"],
        [("s1", "unsupported-device", f"{G[4]}/slot01 is not a well-formed GPU, MIG instance or slot id")]),
    Row("device-none", spec(1, hold("e1")), ["ReportFailed"],
        [("e1", "unsupported-device", "the assignment lists no devices")]),
    Row("device-second-unsupported", spec(1, hold("x1", G[0], "disk/sda")), ["ReportFailed"],
        [("x1", "unsupported-device", "disk/sda: device class disk is not supported by this node")]),
    # -------------------------------------------------------------- device-missing
    Row("missing-mig-instance-seed", spec(1, hold("m1", f"{G[7]}/gi1/ci0")), ["ReportFailed"],
        [("m1", "device-missing", f"{G[7]} has no MIG instance gi1/ci0")]),
    Row("missing-mig-on-non-mig-card", spec(1, hold("m1", f"{G[0]}/gi1/ci0")), ["ReportFailed"],
        [("m1", "device-missing", f"{G[0]} has no MIG instance gi1/ci0")]),
    Row("missing-gpu", spec(1, hold("g1", MISSING_GPU)), ["ReportFailed"],
        [("g1", "device-missing", f"{MISSING_GPU} is not on this node")]),
    Row("missing-mig-of-missing-gpu", spec(1, hold("g1", f"{MISSING_GPU}/gi1/ci0")), ["ReportFailed"],
        [("g1", "device-missing", f"{MISSING_GPU} is not on this node")]),
    Row("missing-slot", spec(1, hold("s1", f"{G[4]}/slot4")), ["ReportFailed"],
        [("s1", "device-missing", f"{G[4]} has no slot4")]),
    Row("missing-slot-on-unshared-card", spec(1, hold("s1", f"{G[0]}/slot0")), ["ReportFailed"],
        [("s1", "device-missing", f"{G[0]} has no slot0")]),
    # -------------------------------------------------------------- overlap
    Row("overlap-live-hold", spec(2, hold("a1", G[0]), hold("b1", G[0])), ["ReportFailed"],
        [("b1", "overlap", f"{G[0]} is held by a1")], before=spec(1, hold("a1", G[0]))),
    Row("overlap-earlier-in-pass", spec(1, hold("a1", G[0]), hold("b1", G[0])), ["BindHold", "ReportFailed"],
        [("b1", "overlap", f"{G[0]} is held by a1")], bound=["a1"]),
    Row("overlap-spec-order-decides", spec(1, hold("b1", G[0]), hold("a1", G[0])), ["BindHold", "ReportFailed"],
        [("a1", "overlap", f"{G[0]} is held by b1")], bound=["b1"]),
    Row("overlap-slot-earlier-in-pass", spec(1, hold("a1", f"{G[4]}/slot0"), hold("b1", f"{G[4]}/slot1", f"{G[4]}/slot0")),
        ["BindHold", "ReportFailed"], [("b1", "overlap", f"{G[4]}/slot0 is held by a1")], bound=["a1"]),
    Row("overlap-whole-gpu-while-slot-held", spec(2, hold("a1", f"{G[4]}/slot2"), hold("b1", G[4])), ["ReportFailed"],
        [("b1", "overlap", f"{G[4]}: its slot slot2 is held by a1")], before=spec(1, hold("a1", f"{G[4]}/slot2"))),
    Row("overlap-whole-gpu-while-mig-held", spec(2, hold("a1", f"{G[6]}/gi5/ci0"), hold("b1", G[6])), ["ReportFailed"],
        [("b1", "overlap", f"{G[6]}: its MIG instance gi5/ci0 is held by a1")], before=spec(1, hold("a1", f"{G[6]}/gi5/ci0"))),
    Row("overlap-slot-while-whole-gpu-held", spec(2, hold("a1", G[5]), hold("b1", f"{G[5]}/slot3")), ["ReportFailed"],
        [("b1", "overlap", f"{G[5]}/slot3: {G[5]} is held whole by a1")], before=spec(1, hold("a1", G[5]))),
    Row("overlap-mig-while-whole-gpu-held", spec(1, hold("a1", G[7]), hold("b1", f"{G[7]}/gi9/ci0")), ["BindHold", "ReportFailed"],
        [("b1", "overlap", f"{G[7]}/gi9/ci0: {G[7]} is held whole by a1")], bound=["a1"]),
    Row("overlap-mig-and-slots-mixed", spec(2, hold("a1", f"{G[4]}/slot0"), hold("b1", f"{G[4]}/gi1/ci0")), ["ReportFailed"],
        [("b1", "overlap", f"{G[4]}/gi1/ci0: {G[4]} is partitioned by slots (slot0 held by a1); MIG instances and slots do not mix on one GPU")],
        before=spec(1, hold("a1", f"{G[4]}/slot0")), host_after=gpu4_to_mig),
    # the VFIO side: a card an instance claims (switched to vfio-pci in the same pass)
    Row("overlap-instance-spec-gpu", spec(1, hold("b1", G[0]), instances=INST), ["ReportFailed", "SwitchGpu", "SwitchGpu"],
        [("b1", "overlap", f"{G[0]}: {G[0]} is claimed by instance vm-a")]),
    Row("overlap-instance-spec-mig", spec(1, hold("b1", f"{G[6]}/gi1/ci1"), instances=INST), ["ReportFailed", "SwitchGpu", "SwitchGpu"],
        [("b1", "overlap", f"{G[6]}/gi1/ci1: {G[6]} is claimed by instance vm-a")]),
    Row("overlap-instance-claim-of-an-earlier-generation", spec(2, hold("b1", G[0]), instances=INST), ["ReportFailed"],
        [("b1", "overlap", f"{G[0]}: {G[0]} is claimed by instance vm-a")], before=spec(1, instances=INST)),
    Row("overlap-instance-card-on-vfio-names-the-instance", spec(1, hold("b1", G[3]), instances=[InstanceGpus(instance_id="vm-c", gpus=["0000:5d:00.0"])]),
        ["ReportFailed", "RecordVfio"], [("b1", "overlap", f"{G[3]}: {G[3]} is claimed by instance vm-c")], host=gpu3_on_vfio),
    Row("overlap-instance-first-of-two", spec(1, hold("b1", G[1]), instances=[*INST, InstanceGpus(instance_id="vm-b", gpus=[PCI[1]])]),
        ["ReportFailed", "SwitchGpu", "SwitchGpu", "SwitchGpu"], [("b1", "overlap", f"{G[1]}: {G[1]} is claimed by instance vm-b")]),
    # a card the operator excluded takes no new hold; a hold kept on it stays
    Row("overlap-excluded-card", spec(1, hold("b1", G[0]), hold("c1", G[1])), ["BindHold", "ReportFailed"],
        [("b1", "overlap", f"{G[0]}: {G[0]} is excluded by the operator")], bound=["c1"], inventory=excluded(PCI[0])),
    Row("overlap-excluded-release-pending-mig", spec(1, hold("b1", f"{G[6]}/gi1/ci0")), ["ReportFailed"],
        [("b1", "overlap", f"{G[6]}/gi1/ci0: {G[6]} is excluded by the operator")],
        inventory=excluded(PCI[6], "ExcludedReleasePending")),
    Row("excluded-card-keeps-its-hold", spec(1, hold("a1", G[0])), [], before=spec(1, hold("a1", G[0])),
        inventory=excluded(PCI[0], "ExcludedReleasePending")),
    Row("excluded-card-new-hold-beside-kept-one", spec(2, hold("a1", f"{G[4]}/slot0"), hold("b1", f"{G[4]}/slot1")), ["ReportFailed"],
        [("b1", "overlap", f"{G[4]}/slot1: {G[4]} is excluded by the operator")], before=spec(1, hold("a1", f"{G[4]}/slot0")),
        inventory=excluded("0000:9a:00.0", "ExcludedReleasePending")),
    Row("overlap-running-domain", spec(1, hold("b1", G[1]), hold("c1", G[2])), ["BindHold", "ReportFailed"],
        [("b1", "overlap", f"{G[1]}: {G[1]} is claimed by running domain build-vm-01")], bound=["c1"], host=domain_on_gpu1),
    Row("overlap-gpu-on-vfio-pci", spec(1, hold("b1", G[3])), ["ReportFailed"],
        [("b1", "overlap", f"{G[3]}: {G[3]} is bound to vfio-pci (passthrough)")], host=gpu3_on_vfio),
    Row("overlap-atom-twice", spec(1, hold("a1", G[0], G[1], G[0])), ["ReportFailed"],
        [("a1", "overlap", f"{G[0]} is listed twice in this assignment")]),
    Row("overlap-whole-and-slot-in-one-assignment", spec(1, hold("a1", G[4], f"{G[4]}/slot0")), ["ReportFailed"],
        [("a1", "overlap", f"{G[4]}/slot0: {G[4]} is held whole by this assignment")]),
    Row("overlap-releases-unreadable", spec(1, hold("a1", G[0]), hold("a2", f"{G[4]}/slot1")), ["ReportFailed", "ReportFailed", "SetCondition"],
        [("a1", "overlap", f"{G[0]}: every GPU of this node is held by {UNREADABLE_RELEASES_HOLDER}"),
         ("a2", "overlap", f"{G[4]}/slot1: every GPU of this node is held by {UNREADABLE_RELEASES_HOLDER}")],
        observed={"releases_unreadable": True}),
    Row("overlap-pending-kubernetes-release", spec(1, hold("a1", G[2]), hold("a2", f"{G[2]}/slot0"), hold("a3", G[3])),
        ["BindHold", "ReportFailed", "ReportFailed"],
        [("a1", "overlap", f"{G[2]} is held by k9 (pending Kubernetes release)"),
         ("a2", "device-missing", f"{G[2]} has no slot0")],
        bound=["a3"], observed={"pending_release_atoms": {G[2]: "k9"}}),
    Row("overlap-pending-release-of-a-slot", spec(1, hold("a1", G[5])), ["ReportFailed"],
        [("a1", "overlap", f"{G[5]}: its slot slot1 is held by k9 (pending Kubernetes release)")],
        observed={"pending_release_atoms": {f"{G[5]}/slot1": "k9"}}),
    # -------------------------------------------------------------- resources-exhausted
    Row("exhausted-memory-seed", spec(2, hold("a1", G[0], memory_bytes=3 * GIB), hold("b1", G[1], memory_bytes=4 * GIB)), ["ReportFailed"],
        [("b1", "resources-exhausted", "ResourcesExhausted: 4096 MiB of memory needed, 1024 MiB left on this host")],
        before=spec(1, hold("a1", G[0], memory_bytes=3 * GIB)), host=memory_8gib, node={"reserve": 4 * GIB}),
    Row("exhausted-memory-same-pass", spec(1, hold("a1", G[0], memory_bytes=3 * GIB), hold("b1", G[1], memory_bytes=4 * GIB)),
        ["BindHold", "ReportFailed"],
        [("b1", "resources-exhausted", "ResourcesExhausted: 4096 MiB of memory needed, 1024 MiB left on this host")],
        bound=["a1"], host=memory_8gib, node={"reserve": 4 * GIB}),
    Row("memory-fits-exactly", spec(1, hold("a1", G[0], memory_bytes=4 * GIB)), ["BindHold"], bound=["a1"],
        host=memory_8gib, node={"reserve": 4 * GIB}),
    Row("exhausted-hugepages-on-mems-seed", spec(1, hold("a1", G[0], hugepages=[(PAGE_1G, 8)], mems="0")), ["ReportFailed"],
        [("a1", "resources-exhausted", "ResourcesExhausted: 8 hugepages of 1048576 KiB needed, 2 free")], host=pages_1g(2, 64)),
    Row("hugepages-fit-on-other-node", spec(1, hold("a1", G[0], hugepages=[(PAGE_1G, 8)], mems="1")), ["BindHold"], bound=["a1"],
        host=pages_1g(2, 64)),
    Row("exhausted-hugepages-whole-host", spec(1, hold("a1", G[0], hugepages=[(PAGE_1G, 8)])), ["ReportFailed"],
        [("a1", "resources-exhausted", "ResourcesExhausted: 8 hugepages of 1048576 KiB needed, 2 free")], host=pages_1g(1, 1)),
    Row("exhausted-hugepages-promised-to-live-hold",
        spec(2, hold("a1", G[0], hugepages=[(PAGE_1G, 62)], mems="0"), hold("b1", G[1], hugepages=[(PAGE_1G, 8)], mems="0")),
        ["ReportFailed"], [("b1", "resources-exhausted", "ResourcesExhausted: 8 hugepages of 1048576 KiB needed, 2 free")],
        before=spec(1, hold("a1", G[0], hugepages=[(PAGE_1G, 62)], mems="0")), host=pages_1g(64, 64)),
    # issue 11: pages promised earlier in the same pass come off `free` (60 free of 64: a1 takes 60, b1's 1 does not fit)
    Row("exhausted-hugepages-promised-earlier-in-pass",
        spec(1, hold("a1", G[0], hugepages=[(PAGE_1G, 60)], mems="0"), hold("b1", G[1], hugepages=[(PAGE_1G, 1)], mems="0")),
        ["BindHold", "ReportFailed"], [("b1", "resources-exhausted", "ResourcesExhausted: 1 hugepages of 1048576 KiB needed, 0 free")],
        bound=["a1"], host=pages_1g(60, 64)),
    # ... and pages promised to a live hold whose workload has not started (free 60 of 64 stays 60)
    Row("exhausted-hugepages-promised-to-live-hold-not-started",
        spec(2, hold("a1", G[0], hugepages=[(PAGE_1G, 60)], mems="0"), hold("b1", G[1], hugepages=[(PAGE_1G, 1)], mems="0")),
        ["ReportFailed"], [("b1", "resources-exhausted", "ResourcesExhausted: 1 hugepages of 1048576 KiB needed, 0 free")],
        before=spec(1, hold("a1", G[0], hugepages=[(PAGE_1G, 60)], mems="0")), host=pages_1g(60, 64)),
    Row("hugepages-host-wide-promise-counts-on-every-node",
        spec(1, hold("a1", G[0], hugepages=[(PAGE_1G, 8)]), hold("b1", G[1], hugepages=[(PAGE_1G, 1)], mems="1")),
        ["BindHold", "ReportFailed"], [("b1", "resources-exhausted", "ResourcesExhausted: 1 hugepages of 1048576 KiB needed, 0 free")],
        bound=["a1"], host=pages_1g(2, 6)),
    # issue 11: a Kubernetes hold is admitted like any other (the seed has no exemption)
    Row("kubernetes-hold-admitted-memory",
        spec(1, hold("k1", G[0], binding="BINDING_KUBERNETES", memory_bytes=9 * GIB)), ["ReportFailed"],
        [("k1", "resources-exhausted", "ResourcesExhausted: 9216 MiB of memory needed, 8192 MiB left on this host")], host=memory_8gib),
    Row("kubernetes-hold-admitted-hugepages",
        spec(1, hold("k1", G[0], binding="BINDING_KUBERNETES", hugepages=[(PAGE_1G, 8)], mems="0")), ["ReportFailed"],
        [("k1", "resources-exhausted", "ResourcesExhausted: 8 hugepages of 1048576 KiB needed, 2 free")], host=pages_1g(2, 64)),
    Row("kubernetes-hold-fits-and-counts-in-pass",
        spec(1, hold("k1", G[0], binding="BINDING_KUBERNETES", memory_bytes=6 * GIB), hold("b1", G[1], memory_bytes=4 * GIB)),
        ["BindHold", "ReportFailed"],
        [("b1", "resources-exhausted", "ResourcesExhausted: 4096 MiB of memory needed, 2048 MiB left on this host")],
        bound=["k1"], host=memory_8gib),
    Row("kubernetes-live-hold-promise-kept-across-passes",
        spec(2, hold("k1", G[0], binding="BINDING_KUBERNETES", memory_bytes=6 * GIB), hold("b1", G[1], memory_bytes=4 * GIB)),
        ["ReportFailed"],
        [("b1", "resources-exhausted", "ResourcesExhausted: 4096 MiB of memory needed, 2048 MiB left on this host")],
        before=spec(1, hold("k1", G[0], binding="BINDING_KUBERNETES", memory_bytes=6 * GIB)), host=memory_8gib),
    # issue 11: a cpuset or mems naming CPUs / NUMA nodes the host does not have
    Row("cpus-the-host-does-not-have", spec(1, hold("a1", G[0], cpus="0-9999"), hold("b1", G[1], cpus="0-3")), ["BindHold", "ReportFailed"],
        [("a1", "resources-exhausted", "ResourcesExhausted: cpus 0-9999 names CPUs 224-9999 this host does not have (it has 0-223)")],
        bound=["b1"]),
    Row("mems-the-host-does-not-have", spec(1, hold("a1", G[0], mems="0-3", memory_bytes=GIB)), ["ReportFailed"],
        [("a1", "resources-exhausted", "ResourcesExhausted: mems 0-3 names NUMA nodes 2-3 this host does not have (it has 0-1)")]),
    Row("cpus-checked-even-when-memory-unreadable", spec(1, hold("a1", G[0], cpus="300")), ["ReportFailed"],
        [("a1", "resources-exhausted", "ResourcesExhausted: cpus 300 names CPUs 300 this host does not have (it has 0-223)")],
        host=memory_unreadable),
    Row("cpus-only-never-admitted", spec(1, hold("a1", G[0], cpus="0-3", cpu_millis=2000), hold("b1", G[1], memory_bytes=1 << 20)),
        ["BindHold", "ReportFailed"],
        [("b1", "resources-exhausted", "ResourcesExhausted: 1 MiB of memory needed, 0 MiB left on this host")],
        bound=["a1"], host=memory_zero),
    Row("host-memory-unreadable-binds", spec(1, hold("a1", G[0], memory_bytes=4 * GIB), hold("b1", G[1], memory_bytes=8 * GIB)),
        ["BindHold", "BindHold"], bound=["a1", "b1"], host=memory_unreadable, notes=(NO_ADMISSION,)),
    Row("host-memory-unreadable-no-note-without-need", spec(1, hold("a1", G[0], cpus="0")), ["BindHold"], bound=["a1"],
        host=memory_unreadable),
    # -------------------------------------------------------------- the first failing check decides
    Row("first-binding-beats-unprivileged", spec(1, hold("v1", MISSING_GPU, binding="BINDING_INSTANCE")), ["ReportFailed"],
        [("v1", "unsupported-binding", "BINDING_INSTANCE is not a hold: GPUs for VMs come in the instances section")],
        node={"privileged": False}),
    Row("first-unprivileged-beats-device-missing", spec(1, hold("a1", MISSING_GPU)), ["ReportFailed"],
        [("a1", "node-unprivileged", UNPRIVILEGED)], node={"privileged": False}),
    Row("first-atom-in-order-decides", spec(1, hold("a1", MISSING_GPU, "nic.vf/1")), ["ReportFailed"],
        [("a1", "device-missing", f"{MISSING_GPU} is not on this node")]),
    Row("first-device-missing-beats-overlap", spec(2, hold("a1", G[0]), hold("b1", G[0], MISSING_GPU)), ["ReportFailed"],
        [("b1", "device-missing", f"{MISSING_GPU} is not on this node")], before=spec(1, hold("a1", G[0]))),
    Row("first-unsupported-device-beats-overlap", spec(1, hold("b1", G[0], G[0], "disk/sda")), ["ReportFailed"],
        [("b1", "unsupported-device", "disk/sda: device class disk is not supported by this node")]),
    Row("first-overlap-beats-exhausted", spec(2, hold("a1", G[0], memory_bytes=3 * GIB), hold("b1", G[0], memory_bytes=4 * GIB)),
        ["ReportFailed"], [("b1", "overlap", f"{G[0]} is held by a1")],
        before=spec(1, hold("a1", G[0], memory_bytes=3 * GIB)), host=memory_8gib, node={"reserve": 4 * GIB}),
    # -------------------------------------------------------------- releases come before binds
    Row("move-gpu-between-allocations", spec(2, hold("b1", G[0])), ["ReleaseHold", "BindHold"], bound=["b1"],
        before=spec(1, hold("a1", G[0]))),
    Row("move-slot-and-mig", spec(2, hold("b1", f"{G[4]}/slot0"), hold("b2", G[6])), ["ReleaseHold", "ReleaseHold", "BindHold", "BindHold"],
        bound=["b1", "b2"], before=spec(1, hold("a1", f"{G[4]}/slot0"), hold("a2", f"{G[6]}/gi1/ci0"))),
    Row("release-all", spec(2), ["ReleaseHold"] * 3, before=S1),
    # -------------------------------------------------------------- kept holds
    Row("kept-missing-env", S1, ["WriteEnv"], before=S1, drift=remove_env("a2")),
    Row("kept-missing-slice", S1, ["EnsureSlice"], before=S1, drift=remove_slice("a1")),
    Row("kept-missing-slice-and-env", S1, ["EnsureSlice", "WriteEnv"], before=S1, drift=both(remove_slice("a1"), remove_env("a1"))),
    # issue 41.1: a slice is compared by content, not only by existence
    Row("kept-slice-memory-edited", S1, ["EnsureSlice"], before=S1, drift=edit_slice("a1", memory_max(8 * GIB))),
    Row("kept-slice-limit-dropped", S1, ["EnsureSlice"], before=S1, drift=edit_slice("a1", lambda r: r["properties"].pop("AllowedCPUs"))),
    Row("kept-slice-property-added", S1, ["EnsureSlice"], before=S1, drift=edit_slice("a1", lambda r: r["properties"].update(TasksMax=1))),
    Row("kept-slice-garbled", S1, ["EnsureSlice"], before=S1, drift=lambda n: n.slices.path("a1").write_text("{")),
    Row("kept-slice-byte-array-garbled", S1, ["EnsureSlice"], before=S1, drift=edit_slice("a1", lambda r: r["properties"].update(AllowedCPUs=[300]))),
    # the same properties (pids and layout are not bcd's limits) are nothing to do
    Row("kept-slice-same-content", S1, [], before=S1, drift=edit_slice("a1", lambda r: r.update(pids=[4242]))),
    # a slice not read back (its backend did not answer) is not compared
    Row("kept-slice-not-read", S1, [], before=S1, drift=edit_slice("a1", memory_max(8 * GIB)), observed={"slice_props": {}}),
    # -------------------------------------------------------------- a held allocation's assignment changed (issue 28.1):
    # its hold is released and the assignment bound again, releases first (docs/upstream.md)
    Row("changed-devices-released-and-bound-again", spec(2, hold("a1", G[1])), ["ReleaseHold", "BindHold"], bound=["a1"],
        before=spec(1, hold("a1", G[0])), notes=(f"a1: its assignment changed (devices {G[0]} -> {G[1]}): released, then bound again",)),
    Row("changed-env-released-and-bound-again", spec(2, hold("a1", G[0], env=("A=2",))), ["ReleaseHold", "BindHold"], bound=["a1"],
        before=spec(1, hold("a1", G[0], env=("A=1",))), notes=("a1: its assignment changed (env -A +A): released, then bound again",)),
    Row("changed-limits-released-and-bound-again", spec(2, hold("a1", G[0], cpus="0-7")), ["ReleaseHold", "BindHold"], bound=["a1"],
        before=spec(1, hold("a1", G[0], cpus="0-3")),
        notes=('a1: its assignment changed (limits {"cpus":"0-3","cpu_millis":null,"memory_bytes":null,"hugepages":[],"mems":null} -> '
               '{"cpus":"0-7","cpu_millis":null,"memory_bytes":null,"hugepages":[],"mems":null}): released, then bound again',)),
    Row("changed-reservation-released-and-bound-again", spec(2, hold("a1", G[0], rsv="rsv-other")), ["ReleaseHold", "BindHold"],
        bound=["a1"], before=spec(1, hold("a1", G[0])), notes=("a1: its assignment changed (reservation rsv-a1 -> rsv-other): released, then bound again",)),
    Row("changed-binding-released-and-bound-again", spec(2, hold("a1", G[0], binding="BINDING_KUBERNETES")), ["ReleaseHold", "BindHold"],
        bound=["a1"], before=spec(1, hold("a1", G[0], cpus="0-3")), drift=remove_env("a1"),
        notes=("a1: its assignment changed (binding BINDING_HOLD -> BINDING_KUBERNETES; limits: no longer sliced): released, then bound again",)),
    Row("changed-to-what-cannot-bind-releases-and-refuses", spec(2, hold("a1", G[0], mems="0-3", memory_bytes=GIB)), ["ReleaseHold", "ReportFailed"],
        [("a1", "resources-exhausted", "ResourcesExhausted: mems 0-3 names NUMA nodes 2-3 this host does not have (it has 0-1)")],
        before=spec(1, hold("a1", G[0])), notes=(
            'a1: its assignment changed (limits: now sliced): released, then bound again',)),
    Row("same-devices-in-another-order-is-the-same-hold", spec(2, hold("a1", G[1], G[0])), [], before=spec(1, hold("a1", G[0], G[1]))),
    # -------------------------------------------------------------- consumer copies (docs/cdi-runtimes.md)
    Row("kept-missing-consumer-copy", S1, ["WriteConsumer"], before=S1, drift=remove_copy("a3")),
    Row("kept-stale-consumer-copy", S1, ["WriteConsumer"], before=S1, drift=edit_copy("a1")),
    Row("kept-missing-env-and-consumer-copy", S1, ["WriteEnv", "WriteConsumer"], before=S1, drift=both(remove_env("a2"), remove_copy("a2"))),
    Row("orphan-consumer-copy-removed", S1, ["RemoveConsumer"], before=S1, drift=orphan_copy("gone1")),
    Row("released-hold-takes-its-copy-no-extra-step", spec(2, S1.devices[0]), ["ReleaseHold", "ReleaseHold"], before=S1),
    # D3 (after issue 41.3): the files of a hold whose Released was reported, put back from outside,
    # are a stale copy: removed as drift, never a hold, a second Released or a pending release
    Row("released-hold-put-back-is-a-stale-copy", spec(2, *S1.devices[1:]), ["RemoveStaleHold"], before=S1,
        put_back=(spec(2, *S1.devices[1:]), ("a1",))),
    Row("released-kubernetes-hold-put-back-is-a-stale-copy", spec(3), ["RemoveStaleHold"],
        before=spec(1, hold("k1", G[2], binding="BINDING_KUBERNETES")), put_back=(spec(2), ("k1",))),
    Row("released-hold-env-file-put-back-is-a-stale-copy", spec(2, *S1.devices[1:]), ["RemoveStaleHold"], before=S1,
        put_back=(spec(2, *S1.devices[1:]), ("a1.env",))),
    # the id booked again: the stale copy goes first, then a new hold (a new Bound at the new generation)
    Row("released-hold-put-back-and-booked-again", spec(3, *S1.devices), ["RemoveStaleHold", "BindHold"], bound=["a1"], before=S1,
        put_back=(spec(2, *S1.devices[1:]), ("a1",))),
    Row("foreign-files-in-the-consumer-dir-left-alone", S1, [], before=S1, drift=foreign_copies),
    Row("consumer-copy-temp-file-removed", S1, ["RemoveTemp"], before=S1, drift=copy_temp_file),
    Row("consumer-copies-not-kept-nothing-planned", S1, [], before=S1, drift=both(remove_copy("a1"), orphan_copy("gone1")),
        observed={"consumer_copies": None}),
    # -------------------------------------------------------------- leftover slices
    Row("leftover-empty-slice-stopped", S1, ["StopSlice"], before=S1, drift=leftover_slice("old1")),
    Row("leftover-busy-slice-kept", S1, [], before=S1, drift=leftover_slice("old1", pids=(4242,))),
    Row("wanted-unbound-slice-not-stopped", spec(1, hold("a1", MISSING_GPU, cpus="0")), ["ReportFailed"],
        [("a1", "device-missing", f"{MISSING_GPU} is not on this node")], drift=leftover_slice("a1")),
    # -------------------------------------------------------------- foreign files and temp files
    Row("foreign-cdi-files-left-alone", S1, [], before=S1, drift=foreign_files),
    Row("foreign-cdi-files-do-not-break-binds", S1, ["BindHold"] * 3, bound=["a1", "a2", "a3"], drift=foreign_files),
    Row("leftover-temp-files-removed", S1, ["RemoveTemp", "RemoveTemp"], before=S1, drift=temp_files),
    # -------------------------------------------------------------- failures are reported once per generation
    Row("failure-not-reported-twice-in-a-generation", spec(1, hold("a1", G[0]), hold("b1", G[0])), [],
        [("b1", "overlap", f"{G[0]} is held by a1")], before=spec(1, hold("a1", G[0]), hold("b1", G[0]))),
    Row("failure-reported-again-next-generation", spec(2, hold("a1", G[0]), hold("b1", G[0])), ["ReportFailed"],
        [("b1", "overlap", f"{G[0]} is held by a1")], before=spec(1, hold("a1", G[0]), hold("b1", G[0]))),
]


def _node(row: Row, root: Path) -> Node:
    host = host_copy(root / "host", row.host) if (row.host or row.host_after) else None
    kw = dict(row.node)
    return Node(root / "node", host, **kw) if host is not None else Node(root / "node", **kw)


def hold_files(node: Node, alloc: str) -> list[Path]:
    """A hold's spec, consumer copy and env file ("<alloc>.env": the env file alone)."""
    if alloc.endswith(".env"):
        return [node.run_dir / "allocations" / alloc]
    return [node.cdi_dir / f"bcd-{alloc}.json", node.consumer_dir / f"bcd-{alloc}.json", node.run_dir / "allocations" / f"{alloc}.env"]


async def put_back_released(node: Node, release: NodeSpec, allocs: tuple[str, ...]) -> dict[Path, bytes]:
    """Save the allocations' files, converge `release` until no release is pending, put them back."""
    saved = {f: f.read_bytes() for a in allocs for f in hold_files(node, a)}
    for _ in range(3):
        _, result = await node.converge(release)
        assert not result.errors, result.errors
        if not node.releases.load()[0]:
            break
    assert not any(f.exists() for f in saved), "released"
    for f, data in saved.items():
        f.write_bytes(data)
    return saved


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
async def test_plan_rule(row: Row, tmp_path: Path) -> None:
    node = _node(row, tmp_path)
    if row.before is not None:
        _, result = await node.converge(row.before)
        assert not result.errors, result.errors
    if row.put_back is not None:
        await put_back_released(node, *row.put_back)
    if row.host_after is not None:
        rewrite_host(node.host_file, row.host_after)
        node.rescan()
    if row.drift is not None:
        row.drift(node)
    if row.inventory is not None:
        node.inventory = row.inventory(node.inventory)
    observed = node.observe(row.spec)
    if row.observed:
        observed = dataclasses.replace(observed, **row.observed)
    p = plan(row.spec, observed, node.config)

    assert p.kinds() == row.kinds
    assert [s.allocation_id for s in p.steps if isinstance(s, BindHold)] == row.bound
    assert [(f.allocation_id, f.reason, f.message) for f in p.failures] == row.failures
    reported = [(s.event.allocation_id, s.event.reason, s.event.message) for s in p.steps if isinstance(s, ReportFailed)]
    assert reported == (row.failures if "ReportFailed" in row.kinds else [])
    for s in p.steps:
        if isinstance(s, ReportFailed):
            assert s.event.generation == row.spec.generation
            assert s.event_id == f"node-1.{s.allocation_id}.failed.g{row.spec.generation}"
    assert p.notes == row.notes
    assert p.section is not None
    assert p.section.state == ("FAILED" if row.failures else "CONVERGED")
    assert p.section.observed_generation == row.spec.generation
    assert p.section.message == "\n".join(f"{a}: {r}" for a, r, _ in row.failures)
    # pure: the same inputs give the same plan
    assert plan(row.spec, observed, node.config) == p


# ------------------------------------------------------------------------------ rules that need apply


async def test_unprivileged_node_writes_nothing(tmp_path: Path) -> None:
    node = Node(tmp_path, privileged=False)
    s = spec(1, hold("a1", G[0]), hold("a2", G[1], cpus="0-3", memory_bytes=GIB), hold("a3", f"{G[4]}/slot0"))
    p, r = await node.converge(s)
    assert not r.errors
    assert p.kinds() == ["ReportFailed"] * 3
    assert {f.reason for f in p.failures} == {"node-unprivileged"}
    assert list(node.cdi_dir.glob("bcd-*")) == []
    assert not (node.run_dir / "allocations").exists() or list((node.run_dir / "allocations").iterdir()) == []
    assert node.slice_names() == []
    assert node.outbox.ids("bound") == []
    assert [e["reason"] for e in node.outbox.of_type("failed")] == ["node-unprivileged"] * 3
    assert node.outbox.of_type("section")[-1]["state"] == "FAILED"
    assert node.plan(s).steps == ()


async def test_failures_reported_once_per_generation_section_failed(tmp_path: Path) -> None:
    node = Node(tmp_path)
    s = spec(3, hold("a1", G[0]), hold("b1", G[0]), hold("c1", MISSING_GPU), hold("d1", G[1]))
    p, r = await node.converge(s)
    assert not r.errors
    assert p.kinds() == ["BindHold", "BindHold", "ReportFailed", "ReportFailed"]
    # the holds that passed are bound anyway
    assert set(node.holds()) == {"a1", "d1"}
    assert len(node.outbox.ids("bound")) == 2
    assert node.outbox.ids("failed") == ["node-1.b1.failed.g3", "node-1.c1.failed.g3"]
    section = node.outbox.of_type("section")[-1]
    assert section["state"] == "FAILED"
    assert section["observed_generation"] == 3
    assert section["message"] == "b1: overlap\nc1: device-missing"

    # the same generation again: nothing new is reported, the section is not re-sent
    sends = node.outbox.sends
    p, r = await node.converge(s)
    assert p.kinds() == [] and not r.errors
    assert node.outbox.sends == sends
    assert [f.allocation_id for f in p.failures] == ["b1", "c1"]

    # a later generation still carrying them reports them again, with new ids
    s4 = spec(4, *s.devices)
    p, r = await node.converge(s4)
    assert p.kinds() == ["ReportFailed", "ReportFailed"]
    assert node.outbox.ids("failed")[2:] == ["node-1.b1.failed.g4", "node-1.c1.failed.g4"]
    section = node.outbox.of_type("section")[-1]
    assert (section["state"], section["observed_generation"]) == ("FAILED", 4)

    # fixed in generation 5: the section converges
    p, r = await node.converge(spec(5, hold("a1", G[0]), hold("d1", G[1])))
    assert p.kinds() == [] and not r.errors
    section = node.outbox.of_type("section")[-1]
    assert (section["state"], section["observed_generation"], section["message"]) == ("CONVERGED", 5, "")


async def test_foreign_cdi_files_are_never_deleted(tmp_path: Path) -> None:
    node = Node(tmp_path)
    foreign_files(node)
    before = {p.name: p.read_bytes() for p in node.cdi_dir.iterdir()}
    _, r = await node.converge(S1)
    assert not r.errors
    _, r = await node.converge(spec(2))
    assert not r.errors
    after = {p.name: p.read_bytes() for p in node.cdi_dir.iterdir()}
    assert after == before
    assert node.plan(spec(2)).steps == ()


async def test_leftover_temp_files_are_removed(tmp_path: Path) -> None:
    node = Node(tmp_path)
    await node.converge(S1)
    temp_files(node)
    (node.cdi_dir / ".nvidia.json.tmp-77").write_text("vendor's own")
    _, r = await node.converge(S1)
    assert not r.errors
    assert not (node.cdi_dir / ".bcd-a1.json.tmp-4242").exists()
    assert not (node.run_dir / "allocations" / ".a1.env.tmp-4242").exists()
    # only our own leftovers
    assert (node.cdi_dir / ".nvidia.json.tmp-77").exists()


async def test_leftover_busy_slice_goes_once_its_workload_exits(tmp_path: Path) -> None:
    node = Node(tmp_path)
    await node.converge(spec(1, hold("a1", G[0], cpus="0-3")))
    node.slices.set_pids("a1", [777])
    p, r = await node.converge(spec(2))
    assert p.kinds() == ["ReleaseHold"] and not r.errors
    assert node.slice_names() == ["a1"]  # kept: a workload still runs in it
    assert node.plan(spec(2)).kinds() == []
    node.slices.set_pids("a1", [])
    p, r = await node.converge(spec(2))
    assert p.kinds() == ["StopSlice"] and not r.errors
    assert node.slice_names() == []


async def test_move_gpu_in_one_generation_binds_the_new_allocation(tmp_path: Path) -> None:
    node = Node(tmp_path)
    await node.converge(spec(1, hold("a1", G[0], cpus="0-1")))
    p, r = await node.converge(spec(2, hold("b1", G[0])))
    assert not r.errors and p.failures == ()
    assert set(node.holds()) == {"b1"}
    assert node.outbox.ids("released") == ["node-1.a1.released.g2"]
    assert node.outbox.ids("bound") == ["node-1.a1.bound.g1", "node-1.b1.bound.g2"]


def test_plan_config_defaults() -> None:
    c = PlanConfig(node_id="n")
    assert c.privileged and c.supported_bindings == frozenset({"BINDING_HOLD", "BINDING_KUBERNETES"}) and c.system_reserve_bytes == 0


async def test_mig_instance_without_uuid_is_not_bound_to_the_whole_card(tmp_path: Path) -> None:
    """A MIG instance listed without its MIG uuid must never expose the whole GPU."""
    import msgspec

    node = Node(tmp_path)
    inv = node.inventory
    gpus = []
    for g in inv.gpus:
        if g.uuid == G[6]:
            g = msgspec.structs.replace(
                g, mig_instances=[msgspec.structs.replace(m, uuid="") if (m.gi, m.ci) == (1, 0) else m for m in g.mig_instances]
            )
        gpus.append(g)
    node.inventory = msgspec.structs.replace(inv, gpus=gpus)
    s = spec(1, hold("m1", f"{G[6]}/gi1/ci0"), hold("m2", f"{G[6]}/gi1/ci1"))
    p = node.plan(s)
    assert p.kinds() == ["BindHold", "ReportFailed"]
    assert [(f.allocation_id, f.reason, f.message) for f in p.failures] == [
        ("m1", "device-missing", f"{G[6]} reports no MIG device uuid for gi1/ci0")
    ]
    bind = p.steps[0]
    assert isinstance(bind, BindHold)
    assert bind.content.visible_devices == "MIG-7d3e61b0-0006-4001-8001-000000000002"


@pytest.mark.parametrize("binding", ["BINDING_HOLD", "BINDING_KUBERNETES"])
async def test_put_back_copy_of_a_released_hold_goes_as_drift_unreported(binding: str, tmp_path: Path) -> None:
    """D3: a released hold's files put back are removed (each counted as drift); no event, no
    pending release, no claim, the journal as the release left it; the next pass has nothing."""
    from services.converger.drift import journal_disagreements
    from services.converger.plan import stale_hold_files
    from shared.holddisk import read_disk

    node = Node(tmp_path)
    counted: list[str] = []
    node.applier.count_drift = counted.append
    kept = hold("b1", G[1])
    await node.converge(spec(1, hold("k1", G[2], binding=binding), kept))
    saved = await put_back_released(node, spec(2, kept), ("k1",))
    assert node.state.released == {"k1": 2}
    events = list(node.outbox.ids("released"))
    assert events == ["node-1.k1.released.g2"]
    def journal() -> bytes:  # (the section's generation moves on)
        return msgspec.json.encode(msgspec.structs.replace(node.state, last_section=None))

    before = journal()

    disk = read_disk(node.cdi_dir, node.run_dir, consumer_dir=node.consumer_dir)
    assert stale_hold_files(node.state, disk.holds, disk.env_files) == {"k1": 2}
    assert journal_disagreements(node.state, disk) == [
        "k1: bcd-k1.json is a stale copy of a hold released at generation 2: removed by the next pass"
    ]
    p, result = await node.converge(spec(3, kept))
    assert not result.errors and p.kinds() == ["RemoveStaleHold"], (p.kinds(), result.errors)
    assert not any(f.exists() for f in saved)
    assert sorted(counted) == ["allocation-env", "cdi", "cdi-consumer"]
    assert node.outbox.ids("released") == events and node.releases.load()[0] == {}
    assert journal() == before  # nothing journaled: not a hold, not a release
    assert node.plan(spec(3, kept)).kinds() == []


def test_released_records_are_bounded() -> None:
    from services.converger.model import RELEASED_KEPT, ConvergerState

    state = ConvergerState()
    for i in range(RELEASED_KEPT + 5):
        state.note_released(f"a{i}", i)
    state.note_released("a7", 99)  # released again: the newest
    assert len(state.released) == RELEASED_KEPT
    assert "a0" not in state.released and list(state.released)[-1] == "a7" and state.released["a7"] == 99
