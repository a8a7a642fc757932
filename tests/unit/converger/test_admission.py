"""Table tests of host admission (services/converger/admission.py), on its own.

Each row: a host, the promises already made (live holds, pending releases,
holds admitted earlier in the pass), the limits of a new hold, and what
admission says: None (fits) or the seed's ResourcesExhausted text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.converger.admission import HostLedger, compress_list, expand_list, needs_admission, topology_problem
from shared.schemas import HostResources, HugePagePool, HugePages, Limits, NumaNode

GIB = 1 << 30
P1G = 1048576
P2M = 2048


def host(memory: int | None = 64 * GIB, *, node_pages: tuple[tuple[int, int], ...] = ((64, 64), (64, 64)), host_pages: tuple[int, int] | None = None) -> HostResources:
    """Two NUMA nodes (cpus 0-7, 8-15) with (total, free) 1 GiB pages each, or host-wide pools only."""
    if host_pages is not None:
        return HostResources(memory_bytes=memory, cpus="0-15", hugepages=[HugePagePool(page_size_kib=P1G, total=host_pages[0], free=host_pages[1])])
    nodes = [
        NumaNode(node=i, cpus=("0-7", "8-15")[i], hugepages=[HugePagePool(page_size_kib=P1G, total=t, free=f)])
        for i, (t, f) in enumerate(node_pages)
    ]
    return HostResources(memory_bytes=memory, cpus="0-15", numa_nodes=nodes)


def lim(memory: int | None = None, pages: int = 0, mems: str | None = None, size: int = P1G, cpus: str | None = None) -> Limits:
    return Limits(memory_bytes=memory, hugepages=[HugePages(page_size_kib=size, count=pages)] if pages else [], mems=mems, cpus=cpus)


@dataclass
class Row:
    id: str
    host: HostResources
    limits: Limits
    expected: str | None
    promised: list[Limits] = field(default_factory=list)
    reserve: int = 0


ROWS = [
    Row("nothing-promised-fits", host(), lim(memory=8 * GIB, pages=8, mems="0"), None),
    Row("memory-exactly-fits", host(memory=8 * GIB), lim(memory=4 * GIB), None, reserve=4 * GIB),
    Row("memory-seed-message", host(memory=8 * GIB), lim(memory=4 * GIB), "ResourcesExhausted: 4096 MiB of memory needed, 1024 MiB left on this host",
        promised=[lim(memory=3 * GIB)], reserve=4 * GIB),
    Row("memory-promised-beyond-host-reads-zero-left", host(memory=8 * GIB), lim(memory=1), "ResourcesExhausted: 1 MiB of memory needed, 0 MiB left on this host",
        promised=[lim(memory=9 * GIB)]),
    Row("pages-seed-message", host(node_pages=((64, 2), (64, 64))), lim(pages=8, mems="0"), "ResourcesExhausted: 8 hugepages of 1048576 KiB needed, 2 free"),
    Row("pages-on-the-other-node-fit", host(node_pages=((64, 2), (64, 64))), lim(pages=8, mems="1"), None),
    Row("pages-across-both-nodes", host(node_pages=((64, 4), (64, 4))), lim(pages=8, mems="0-1"), None),
    Row("pages-host-wide-ask-sums-nodes", host(node_pages=((64, 4), (64, 3))), lim(pages=8), "ResourcesExhausted: 8 hugepages of 1048576 KiB needed, 7 free"),
    # issue 11: a promise comes off free, not only off total (60 free of 64; 60 promised; 0 left)
    Row("pages-promised-come-off-free", host(node_pages=((64, 60), (64, 64))), lim(pages=1, mems="0"),
        "ResourcesExhausted: 1 hugepages of 1048576 KiB needed, 0 free", promised=[lim(pages=60, mems="0")]),
    Row("pages-promised-on-other-node-do-not-count", host(node_pages=((64, 60), (64, 64))), lim(pages=60, mems="0"), None,
        promised=[lim(pages=64, mems="1")]),
    Row("pages-host-wide-promise-counts-on-a-node", host(node_pages=((8, 8), (8, 8))), lim(pages=1, mems="1"),
        "ResourcesExhausted: 1 hugepages of 1048576 KiB needed, 0 free", promised=[lim(pages=8)] * 1 + [lim(pages=8, mems="1")]),
    Row("pages-other-size-do-not-count", host(node_pages=((8, 8), (8, 8))), lim(pages=8, mems="0"), None,
        promised=[lim(pages=8, mems="0", size=P2M)]),
    Row("pages-of-a-size-the-host-lacks", host(), lim(pages=1, size=P2M), "ResourcesExhausted: 1 hugepages of 2048 KiB needed, 0 free"),
    Row("pages-host-wide-pools-without-numa", host(host_pages=(16, 10)), lim(pages=4), "ResourcesExhausted: 4 hugepages of 1048576 KiB needed, 2 free",
        promised=[lim(pages=8)]),
    Row("zero-count-never-refused", host(node_pages=((0, 0), (0, 0))), Limits(hugepages=[HugePages(page_size_kib=P1G, count=0)]), None),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_admit(row: Row) -> None:
    ledger = HostLedger(row.host, row.reserve)
    for p in row.promised:
        ledger.promise(p)
    assert ledger.admit(row.limits) == row.expected


def test_admitted_holds_count_against_the_next() -> None:
    """Within a pass: admit, promise, admit again (the way plan_new_holds uses it)."""
    ledger = HostLedger(host(node_pages=((64, 60), (64, 64))), 0)
    a = lim(pages=60, mems="0")
    assert ledger.admit(a) is None
    ledger.promise(a)
    assert ledger.admit(lim(pages=1, mems="0")) == "ResourcesExhausted: 1 hugepages of 1048576 KiB needed, 0 free"
    assert ledger.admit(lim(pages=1, mems="1")) is None


TOPOLOGY = [
    # (limits, host, problem)
    pytest.param(None, host(), None, id="no-limits"),
    pytest.param(lim(cpus="0-15"), host(), None, id="all-cpus"),
    pytest.param(lim(cpus="3,9-10"), host(), None, id="some-cpus"),
    pytest.param(lim(cpus="0-9999"), host(), "ResourcesExhausted: cpus 0-9999 names CPUs 16-9999 this host does not have (it has 0-15)", id="cpus-beyond"),
    pytest.param(lim(cpus="1,17,19-20"), host(), "ResourcesExhausted: cpus 1,17,19-20 names CPUs 17,19-20 this host does not have (it has 0-15)", id="cpus-some-beyond"),
    pytest.param(lim(mems="1"), host(), None, id="mems-present"),
    pytest.param(lim(mems="0-2"), host(), "ResourcesExhausted: mems 0-2 names NUMA nodes 2 this host does not have (it has 0-1)", id="mems-beyond"),
    pytest.param(lim(cpus="0-9999"), HostResources(memory_bytes=GIB), None, id="host-cpus-unknown"),
    pytest.param(lim(mems="5"), host(host_pages=(1, 1)), None, id="host-numa-unknown"),
    pytest.param(lim(cpus="0"), None, None, id="no-host"),
]


@pytest.mark.parametrize(("limits", "host_", "problem"), TOPOLOGY)
def test_topology(limits: Limits | None, host_: HostResources | None, problem: str | None) -> None:
    assert topology_problem(limits, host_) == problem


def test_needs_admission_table() -> None:
    rows = [
        (None, False),
        (Limits(cpus="0-3", cpu_millis=2000), False),  # seed: cpus alone are not admitted
        (lim(memory=1), True),
        (lim(pages=1), True),
        (Limits(hugepages=[HugePages(page_size_kib=P1G, count=0)]), False),
        (Limits(memory_bytes=0), False),
    ]
    for limits, expected in rows:
        assert needs_admission(limits) is expected, limits


@pytest.mark.parametrize("text", ["", "0", "0-3", "0-2,5", "1,3,5-9,11", "0-223"])
def test_cpulist_round_trip(text: str) -> None:
    assert compress_list(set(expand_list(text))) == text
