"""Host admission: does a new hold fit what the host has left? (the seed's admission.go)

The seed: "a new hold whose limits carry a memory limit or huge pages is
admitted against the host first ..., so VMs and holds never take what the
other was promised. A hold with only cpus or cpu_millis is not admitted. The
host is read once per pass, when the first such hold needs it." It has no
exemption for Kubernetes holds, so they are admitted too (their pods run in
kubepods.slice, but the memory they booked is promised all the same).

`HostLedger` is that once-per-pass view: the host's resources, minus the
system reserve, minus what live holds, pending Kubernetes releases and the
holds admitted earlier in the pass were promised. Promised pages come off
`free` as well as `total`: the ledger cannot see whether a hold's workload
has already taken its pages, so it assumes it has not (fail-closed: a page
is never promised twice).

Before that, and for every hold whose limits name CPUs or NUMA nodes, the
cpuset and mems must name CPUs and nodes the host has: systemd would take
`AllowedCPUs=0-9999` and the hold would run on no CPU it was booked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schemas import HostResources, Limits

MIB = 1024 * 1024

#: (page_size_kib, NUMA nodes or None for host-wide)
PoolKey = tuple[int, frozenset[int] | None]


def expand_list(text: str | None) -> list[int]:
    """cpulist / nodelist syntax to numbers ("0-2,5" -> [0, 1, 2, 5])."""
    out: list[int] = []
    for part in (text or "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def compress_list(numbers: set[int] | frozenset[int]) -> str:
    """Numbers to cpulist syntax ({0, 1, 2, 5} -> "0-2,5")."""
    out: list[str] = []
    run: list[int] = []
    for n in sorted(numbers):
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [n]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def needs_admission(limits: Limits | None) -> bool:
    """Only a memory limit or huge pages are admitted (seed: not cpus or cpu_millis alone)."""
    return limits is not None and bool(limits.memory_bytes or any(h.count for h in limits.hugepages))


def topology_problem(limits: Limits | None, host: HostResources | None) -> str | None:
    """A cpuset or mems naming CPUs or NUMA nodes this host does not have; None when fine or unknown."""
    if limits is None or host is None:
        return None
    if limits.cpus and host.cpus:
        have = frozenset(expand_list(host.cpus))
        missing = frozenset(expand_list(limits.cpus)) - have
        if missing:
            return f"ResourcesExhausted: cpus {limits.cpus} names CPUs {compress_list(missing)} this host does not have (it has {host.cpus})"
    if limits.mems and host.numa_nodes:
        have = frozenset(n.node for n in host.numa_nodes)
        missing = frozenset(expand_list(limits.mems)) - have
        if missing:
            return (
                f"ResourcesExhausted: mems {limits.mems} names NUMA nodes {compress_list(missing)} "
                f"this host does not have (it has {compress_list(have)})"
            )
    return None


@dataclass
class HostLedger:
    """Host memory and huge pages left for holds in one pass."""

    host: HostResources | None
    reserve: int
    promised_memory: int = 0
    #: pages promised per pool key, summed (not a list of every promise: O(holds) per pass).
    promised_pages: dict[PoolKey, int] = field(default_factory=dict)

    def promise(self, limits: Limits | None) -> None:
        """Count a live hold's, a pending release's or a just-admitted hold's booking."""
        if limits is None:
            return
        self.promised_memory += limits.memory_bytes or 0
        nodes = frozenset(expand_list(limits.mems)) if limits.mems else None
        for hp in limits.hugepages:
            key = (hp.page_size_kib, nodes)
            self.promised_pages[key] = self.promised_pages.get(key, 0) + hp.count

    def readable(self) -> bool:
        return self.host is not None and self.host.memory_bytes is not None

    def admit(self, limits: Limits) -> str | None:
        """None when the hold fits; else the seed's ResourcesExhausted message."""
        assert self.host is not None and self.host.memory_bytes is not None
        if limits.memory_bytes:
            left = self.memory_left()
            if limits.memory_bytes > left:
                need = -(-limits.memory_bytes // MIB)
                return f"ResourcesExhausted: {need} MiB of memory needed, {left // MIB} MiB left on this host"
        nodes = frozenset(expand_list(limits.mems)) if limits.mems else None
        for hp in limits.hugepages:
            if hp.count == 0:
                continue
            free = self.pages_left(hp.page_size_kib, nodes)
            if hp.count > free:
                return f"ResourcesExhausted: {hp.count} hugepages of {hp.page_size_kib} KiB needed, {free} free"
        return None

    def memory_left(self) -> int:
        assert self.host is not None and self.host.memory_bytes is not None
        return max(0, self.host.memory_bytes - self.promised_memory - self.reserve)

    def pages_left(self, size: int, nodes: frozenset[int] | None) -> int:
        """Free pages of `size` on `nodes` (host-wide for None), less every page promised there.

        A promise on other nodes only does not count; a host-wide promise
        (no mems) counts everywhere, and a host-wide ask sees every promise.
        """
        assert self.host is not None
        if self.host.numa_nodes:
            pools = [
                p
                for n in self.host.numa_nodes
                if nodes is None or n.node in nodes
                for p in n.hugepages
                if p.page_size_kib == size
            ]
        else:
            pools = [p for p in self.host.hugepages if p.page_size_kib == size]
        free = sum(p.free for p in pools)
        promised = sum(
            count
            for (s, held_nodes), count in self.promised_pages.items()
            if s == size and (nodes is None or held_nodes is None or held_nodes & nodes)
        )
        return max(0, free - promised)


__all__ = ["HostLedger", "expand_list", "compress_list", "needs_admission", "topology_problem", "MIB"]
