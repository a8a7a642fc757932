"""Hold slices: the `Slices` port and its two backends, shared by the converger
(which observes slices and, as root or on a fake host, applies them) and the
root helper (which applies them for an unprivileged converger).

A hold whose assignment carries limits runs in its own cgroup-v2 slice,
`bcd-alloc-<allocation>.slice` (DESIGN 5 "Slices", seed "Hold slices"). bcd
never moves a process into it: it creates the slice with the booked limits,
names it to the workload manager, and stops it only once no process is left.

This module owns that one thing:

- the name (`slice_name`, `allocation_of`; `legacy_slice_name` for holds
  bound before a `-` of the id was spelled `.`), built only from a validated
  allocation id, so nothing from the wire reaches systemd or a path unchecked;
- the systemd properties a slice gets (`slice_properties`, pure, shared by both
  backends so the fake records exactly what systemd would be sent);
- the port (`Slices`) and its backends: `SystemdSlices` (transient slice units
  over D-Bus with pystemd, an optional dependency) and `FakeSlices` (one JSON
  record per slice under `<run_dir>/slices`, what a fakehw host keeps);
- what a slice must read back as (`slice_differences`, pure: the properties
  `Slices.properties` reads against those `slice_properties` makes), so a
  slice changed from outside is drift by content, not only a missing one.

Every backend failure the converger can outlive is a `SliceError` (retried in
30 s); a malformed id or limits is a `ValueError` (a bug or a refusal, never
worth a retry).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from shared.logs import get_logger
from shared.fsutil import atomic_write, fsync_dir, read_regular
from shared.schemas.codec import bounded_json_loads
from shared.schemas.common import CPULIST_PATTERN, ID_RE
from shared.schemas.nodespec import HugePages, Limits

log = get_logger(__name__)

#: where the services find cgroup v2 (SystemdSlices' cgroup_root: huge page limits, emptiness)
CGROUP_ROOT = Path("/sys/fs/cgroup")
SLICE_PREFIX = "bcd-alloc-"
#: where FakeSlices keeps its records under the run dir (the converger's hold-dir watch looks there too)
FAKE_SLICES_SUBDIR = "slices"
SLICE_SUFFIX = ".slice"
#: a fake slice record read back (a few properties and pids).
SLICE_RECORD_MAX_BYTES = 1024 * 1024
_SLICE_RE = re.compile(r"^bcd-alloc-(.+)\.slice\Z")
#: what a `-` of the allocation id becomes in a slice name (`slice_name`).
_SEP = "."
#: ... and what it became before (`legacy_slice_name`).
_LEGACY_DASH = "\\x2d"
_CPULIST_RE = re.compile(CPULIST_PATTERN)

#: D-Bus signature of every property `slice_properties` may return, in the
#: order it returns them (org.freedesktop.systemd1.Unit / .Slice).
PROPERTY_SIGNATURES: dict[str, str] = {
    "Description": "s",
    "AllowedCPUs": "ay",
    "CPUQuotaPerSecUSec": "t",
    "MemoryMax": "t",
    "AllowedMemoryNodes": "ay",
}

#: systemd's "no limit" for a `t` property (UINT64_MAX: infinity / USEC_INFINITY).
UINT64_MAX = 2**64 - 1

#: what each resource property is reset to when an update drops its limit.
_RESETS: dict[str, object] = {
    "AllowedCPUs": b"",
    "CPUQuotaPerSecUSec": UINT64_MAX,
    "MemoryMax": UINT64_MAX,
    "AllowedMemoryNodes": b"",
}


class SliceError(Exception):
    """A slice operation failed in a way worth retrying (the converger retries in 30 s).

    The text is for an operator: it names the slice and what went wrong.
    """


# ---------------------------------------------------------------- names


def _checked(allocation_id: str) -> str:
    if not isinstance(allocation_id, str) or not ID_RE.match(allocation_id):
        raise ValueError(f"not an allocation id: {allocation_id!r}")
    return allocation_id


def slice_name(allocation_id: str) -> str:
    """`bcd-alloc-<allocation_id>.slice` with each `-` of the id as `.`; ValueError unless the id is valid.

    systemd reads every `-` of a slice name as a level of the hierarchy, so
    `bcd-alloc-a-1.slice` would sit inside `bcd-alloc-a.slice` (a's limits
    bounding a-1, stopping a stopping a-1). A `-` inside the allocation id
    therefore becomes `.`, which no allocation id holds (so the name is
    collision-free and reversible), which systemd allows in a unit name and
    gives no meaning before the suffix, and which no consumer of the name
    treats specially: `BCD_CGROUP_PARENT=bcd-alloc-train.01.slice` reads the
    same to a shell sourcing the env file, `docker run --env-file` and
    systemd's `EnvironmentFile=`, and the fake host's record file name needs
    no quoting in a shell loop or `xargs`. (bcd before this spelled the `-`
    as systemd-escape does, `\\x2d`: right for systemd, but a shell reads
    `bcd-alloc-train\\x2d01.slice` as `bcd-alloc-trainx2d01.slice`; see
    `legacy_slice_name`.) Ids without a `-` keep the seed's plain name.
    """
    return f"{SLICE_PREFIX}{_checked(allocation_id).replace('-', _SEP)}{SLICE_SUFFIX}"


def legacy_slice_name(allocation_id: str) -> str:
    """The name bcd gave the slice before `slice_name` used `.`: each `-` as systemd-escape's `\\x2d`.

    Holds bound then still name it (their CDI annotation, env file and
    AllocationBound); such a slice is recognised, kept while its workload
    runs and stopped at release, and the converger rewrites such a hold under
    `slice_name` as soon as nothing runs in its slice (or a file of it must
    be written again). Equal to `slice_name` for an id without a `-`.
    """
    return f"{SLICE_PREFIX}{_checked(allocation_id).replace('-', _LEGACY_DASH)}{SLICE_SUFFIX}"


def slice_names(allocation_id: str) -> tuple[str, ...]:
    """The names an allocation's slice may have: `slice_name`, then `legacy_slice_name` when it differs."""
    current, legacy = slice_name(allocation_id), legacy_slice_name(allocation_id)
    return (current,) if current == legacy else (current, legacy)


def allocation_of(name: str) -> str | None:
    """The allocation id of one of our slice names (current or legacy spelling); None for any other name."""
    if not isinstance(name, str):
        return None
    m = _SLICE_RE.match(name)
    if m is None or "-" in m.group(1):
        return None
    body = m.group(1)
    if "\\" in body:
        alloc = body.replace(_LEGACY_DASH, "-") if _SEP not in body else ""
    else:
        alloc = body.replace(_SEP, "-")
    if not ID_RE.match(alloc) or name not in slice_names(alloc):
        return None
    return alloc


# ---------------------------------------------------------------- cpulists


def parse_cpulist(text: str) -> list[int]:
    """Linux cpulist/nodelist ("0-3,8") -> sorted distinct numbers; ValueError if malformed."""
    if not isinstance(text, str) or not _CPULIST_RE.match(text):
        raise ValueError(f"not a cpulist: {text!r}")
    found: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if last < first:
            raise ValueError(f"cpulist {text!r}: range {part!r} runs backwards")
        found.update(range(first, last + 1))
    return sorted(found)


def cpulist_to_bitmask(text: str) -> bytes:
    """The byte array systemd takes for AllowedCPUs/AllowedMemoryNodes.

    Little-endian bit array: CPU N is bit N % 8 of byte N // 8, as systemd's
    cpu_set_to_dbus() writes it. No trailing zero bytes. "0-3,8" -> b"\\x0f\\x01".
    """
    numbers = parse_cpulist(text)
    mask = bytearray(numbers[-1] // 8 + 1)
    for n in numbers:
        mask[n // 8] |= 1 << (n % 8)
    return bytes(mask)


def bitmask_to_cpulist(mask: bytes) -> str:
    """Inverse of `cpulist_to_bitmask`, in canonical form ("0-3,8"); "" for no bits."""
    numbers = [i * 8 + b for i, byte in enumerate(mask) for b in range(8) if byte >> b & 1]
    parts: list[str] = []
    start = prev = None
    for n in numbers + [None]:
        if start is not None and (n is None or n != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if n is not None and start is None:
            start = n
        prev = n
    return ",".join(parts)


# ---------------------------------------------------------------- properties


def slice_properties(allocation_id: str, limits: Limits) -> list[tuple[str, object]]:
    """The systemd properties of the hold's slice, as (name, value), in a fixed order.

    Description always; AllowedCPUs (bitmask bytes) for `cpus`;
    CPUQuotaPerSecUSec (= cpu_millis * 1000 µs of CPU time per second) for
    `cpu_millis`; MemoryMax (bytes) for `memory_bytes`; AllowedMemoryNodes
    (bitmask bytes) for `mems`. Huge pages have no systemd property (see
    `SystemdSlices`). ValueError for a bad id, a malformed list, or
    cpu_millis 0 (systemd refuses a zero quota and "no CPU at all" cannot be
    honoured).
    """
    slice_name(allocation_id)
    props: list[tuple[str, object]] = [("Description", f"bcd hold {allocation_id}")]
    if limits.cpus is not None:
        props.append(("AllowedCPUs", cpulist_to_bitmask(limits.cpus)))
    if limits.cpu_millis is not None:
        if limits.cpu_millis <= 0:
            raise ValueError(f"cpu_millis {limits.cpu_millis}: a CPU quota must be positive")
        props.append(("CPUQuotaPerSecUSec", limits.cpu_millis * 1000))
    if limits.memory_bytes is not None:
        props.append(("MemoryMax", limits.memory_bytes))
    if limits.mems is not None:
        props.append(("AllowedMemoryNodes", cpulist_to_bitmask(limits.mems)))
    return props


def _hugepages_record(hugepages: list[HugePages]) -> list[dict[str, int]]:
    return [
        {"page_size_kib": h.page_size_kib, "count": h.count}
        for h in sorted(hugepages, key=lambda h: h.page_size_kib)
    ]


def hugetlb_size_name(page_size_kib: int) -> str:
    """The kernel's name of a huge page size in hugetlb files: 2048 -> "2MB", 1048576 -> "1GB"."""
    if page_size_kib >= 1 << 20:
        return f"{page_size_kib >> 20}GB"
    if page_size_kib >= 1 << 10:
        return f"{page_size_kib >> 10}MB"
    return f"{page_size_kib}KB"


_HUGETLB_FILE_RE = re.compile(r"^hugetlb\.([0-9]+)(KB|MB|GB)\.max\Z")
_HUGETLB_SHIFT = {"KB": 0, "MB": 10, "GB": 20}


# ---------------------------------------------------------------- the port


@runtime_checkable
class Slices(Protocol):
    """Where hold slices live. Every method is idempotent; failures are SliceError."""

    def apply(self, allocation_id: str, limits: Limits) -> None:
        """Create the slice with its properties, or update a live one to them."""
        ...

    def stop(self, allocation_id: str) -> bool:
        """Stop the slice if it has no process. True: gone (or never there); False: kept, a workload runs."""
        ...

    def exists(self, allocation_id: str) -> bool: ...

    def is_empty(self, allocation_id: str) -> bool:
        """No process in the slice (a missing slice is empty)."""
        ...

    def list(self) -> list[str]:
        """Allocation ids of every bcd-alloc-*.slice present, sorted."""
        ...

    def properties(self, allocation_id: str) -> dict[str, Any]:
        """What is applied: {systemd property: value} as `slice_properties` spells it,
        plus "hugepages" ([{page_size_kib, count}]) when huge page limits are in force;
        {} for a missing slice."""
        ...

    @property
    def reads_hugepages(self) -> bool:
        """Whether `properties` can say "hugepages" (False: huge page limits are neither
        enforced nor read, so their absence is no difference)."""
        ...


def wanted_properties(allocation_id: str, limits: Limits, *, hugepages: bool = True) -> dict[str, Any]:
    """What `Slices.properties` reads back for a slice applied with `limits` (and nothing
    else since): `slice_properties`, plus "hugepages" when there are some and `hugepages`
    (the backend reads them). ValueError as `slice_properties`."""
    wanted: dict[str, Any] = dict(slice_properties(allocation_id, limits))
    if hugepages and limits.hugepages:
        wanted["hugepages"] = _hugepages_record(limits.hugepages)
    return wanted


def slice_differences(allocation_id: str, limits: Limits, found: Mapping[str, Any] | None, *, hugepages: bool = True) -> tuple[str, ...]:
    """The names of the properties a live slice reads back (`Slices.properties`: `found`)
    with values other than `limits` make, in `PROPERTY_SIGNATURES` order, then any other
    name; () when they agree. Pure.

    `found` None: the slice is there but does not read (a fake record garbled from
    outside): ("unreadable",). `hugepages` False: the backend does not read huge page
    limits, so "hugepages" is not compared. ValueError as `slice_properties`."""
    if found is None:
        return ("unreadable",)
    wanted = wanted_properties(allocation_id, limits, hugepages=hugepages)
    names = [*PROPERTY_SIGNATURES, *sorted(n for n in {*wanted, *found} if n not in PROPERTY_SIGNATURES)]
    if not hugepages:
        names = [n for n in names if n != "hugepages"]
    return tuple(n for n in names if (n in wanted or n in found) and wanted.get(n) != found.get(n))


def read_properties(slices: Slices, allocation_ids: list[str]) -> dict[str, dict[str, Any] | None]:
    """`Slices.properties` of each of `allocation_ids` ({} for a missing slice), None for
    one that does not read (a SliceError, logged): the caller compares them
    (`slice_differences`) and never stops for one slice."""
    found: dict[str, dict[str, Any] | None] = {}
    for alloc in allocation_ids:
        try:
            found[alloc] = slices.properties(alloc)
        except SliceError as exc:
            log.warning("slice properties unreadable", allocation_id=alloc, error=str(exc))
            found[alloc] = None
    return found


# ---------------------------------------------------------------- fake backend


def _to_json(name: str, value: object) -> object:
    return list(value) if PROPERTY_SIGNATURES.get(name) == "ay" else value


def _from_json(name: str, value: object) -> object:
    return bytes(value) if PROPERTY_SIGNATURES.get(name) == "ay" else value  # type: ignore[arg-type]


class FakeSlices:
    """Slices as JSON records, `<run_dir>/slices/bcd-alloc-<id>.slice.json` (a fakehw host).

    A record holds the slice name, the systemd properties it would have
    (`slice_properties`; byte arrays as lists of ints), its huge page limits,
    and `pids`: the processes "in" the slice. Nothing runs in a fake slice, so
    tests (or a fake workload) put pids there to make it busy; [] is empty.

    A record under the legacy name (`legacy_slice_name`, written before bcd
    spelled a `-` of the id as `.`) is the allocation's slice too: seen by
    `exists`, `is_empty`, `list` and `properties`, removed by `stop` once
    empty; `apply` only ever writes the current name.

    A record edited from outside is what `properties` reads (so the converger
    sees the drift); one that no longer reads is written again whole by
    `apply`, with no pids (what it said of them does not read either).
    """

    #: a record says its huge page limits
    reads_hugepages = True

    def __init__(self, run_dir: Path | str) -> None:
        self.dir = Path(run_dir) / FAKE_SLICES_SUBDIR
        self._lock = threading.Lock()

    def path(self, allocation_id: str) -> Path:
        return self.dir / f"{slice_name(allocation_id)}.json"

    def _paths(self, allocation_id: str) -> list[Path]:
        return [self.dir / f"{name}.json" for name in slice_names(allocation_id)]

    def _read_path(self, path: Path) -> dict[str, Any] | None:
        try:
            record = bounded_json_loads(read_regular(path, max_bytes=SLICE_RECORD_MAX_BYTES), SLICE_RECORD_MAX_BYTES, "slice record")
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise SliceError(f"fake slice record {path} unreadable: {exc}") from None
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("properties"), dict)
            or not isinstance(record.get("pids"), list)
            or not all(isinstance(p, int) for p in record["pids"])
        ):
            raise SliceError(f"fake slice record {path} is malformed (want name, properties, hugepages, pids)")
        return record

    def _records(self, allocation_id: str) -> list[tuple[Path, dict[str, Any]]]:
        """(path, record) of each record the allocation has, the current name first."""
        found = []
        for path in self._paths(allocation_id):
            record = self._read_path(path)
            if record is not None:
                found.append((path, record))
        return found

    def _write_path(self, path: Path, record: dict[str, Any]) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(record, indent=2, sort_keys=True).encode() + b"\n", 0o644)
        except OSError as exc:
            raise SliceError(f"cannot write fake slice record {path}: {exc}") from None

    def apply(self, allocation_id: str, limits: Limits) -> None:
        props = slice_properties(allocation_id, limits)
        with self._lock:
            path = self.path(allocation_id)
            try:
                old = self._read_path(path)
            except SliceError as exc:
                # garbled from outside: the record is ours, made whole again (never a retry forever)
                log.warning("fake slice record unreadable; written again", path=str(path), error=str(exc))
                old = None
            record = {
                "name": slice_name(allocation_id),
                "properties": {k: _to_json(k, v) for k, v in props},
                "hugepages": _hugepages_record(limits.hugepages),
                "pids": old["pids"] if old else [],
            }
            if record != old:
                self._write_path(path, record)

    def set_pids(self, allocation_id: str, pids: list[int]) -> None:
        """Simulate a workload (or its exit) in an existing fake slice (the current name's, else the legacy one's)."""
        with self._lock:
            records = self._records(allocation_id)
            if not records:
                raise SliceError(f"fake slice {slice_name(allocation_id)} does not exist")
            path, record = records[0]
            record["pids"] = [int(p) for p in pids]
            self._write_path(path, record)

    def stop(self, allocation_id: str) -> bool:
        with self._lock:
            kept = False
            for path, record in self._records(allocation_id):
                if record["pids"]:
                    kept = True
                    continue
                try:
                    path.unlink(missing_ok=True)
                    fsync_dir(self.dir)
                except OSError as exc:
                    raise SliceError(f"cannot remove fake slice record {path}: {exc}") from None
            return not kept

    def exists(self, allocation_id: str) -> bool:
        return bool(self._records(allocation_id))

    def is_empty(self, allocation_id: str) -> bool:
        return not any(record["pids"] for _, record in self._records(allocation_id))

    def list(self) -> list[str]:
        try:
            names = [p.name for p in self.dir.glob(f"{SLICE_PREFIX}*{SLICE_SUFFIX}.json")]
        except OSError as exc:
            raise SliceError(f"cannot list fake slices in {self.dir}: {exc}") from None
        ids = {allocation_of(n.removesuffix(".json")) for n in names}
        return sorted(i for i in ids if i is not None)

    def properties(self, allocation_id: str) -> dict[str, Any]:
        records = self._records(allocation_id)
        if not records:
            return {}
        path, record = records[0]
        try:
            out: dict[str, Any] = {k: _from_json(k, v) for k, v in record["properties"].items()}
        except (TypeError, ValueError) as exc:
            # a byte array edited into something else (300, "0-3")
            raise SliceError(f"fake slice record {path} is malformed: {exc}") from None
        if record.get("hugepages"):
            out["hugepages"] = record["hugepages"]
        return out


# ---------------------------------------------------------------- systemd backend

_SYSTEMD = b"org.freedesktop.systemd1"
_UNIT_IFACE = b"org.freedesktop.systemd1.Unit"
_SLICE_IFACE = b"org.freedesktop.systemd1.Slice"
#: ActiveState values of a slice that is there; "inactive"/"failed" ones are
#: about to be garbage-collected (transient units) and count as gone.
_LIVE = frozenset({"active", "activating", "reloading", "deactivating", "refreshing"})


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SystemdSlices:
    """Transient slice units through systemd's D-Bus API, with pystemd.

    - `apply`: `StartTransientUnit(name, "replace", properties)` for a slice
      that is not there; `SetUnitProperties(name, runtime=True, ...)` for a
      live one (systemd refuses to start a transient unit that already
      exists), sending every resource property so a dropped limit is reset
      (AllowedCPUs/AllowedMemoryNodes empty, MemoryMax/CPUQuotaPerSecUSec
      infinity).
    - emptiness: the slice unit's `TasksCurrent` (tasks in the slice and
      below); where accounting is off (UINT64_MAX) and `cgroup_root` is given,
      `populated` in `<cgroup_root><ControlGroup>/cgroup.events`; otherwise the
      slice cannot be shown empty and is kept.
    - a started slice is waited for (up to `start_wait_s`: StartTransientUnit
      only queues a job, and at boot systemd may run it seconds later); one
      this call started whose limits it then cannot all apply is stopped
      again, so the slice does not count as made and the next pass makes it
      whole (a kept hold's slice is only made again when it is missing).
    - `stop`: `StopUnit(name, "replace")` only after the emptiness check, then
      waits up to `stop_wait_s` for the unit to go. Stopping a slice stops
      everything in it, and a workload placed between the check and the stop
      would be stopped with it: the window is one D-Bus round trip.
    - huge pages: systemd has no hugetlb property. With `cgroup_root` (e.g.
      /sys/fs/cgroup) `apply` writes `hugetlb.<size>.max` (bytes) in the
      slice's cgroup; that needs the hugetlb controller enabled in the
      `cgroup.subtree_control` of the slice's parents, which systemd does not
      do: `apply` enables it there where the kernel offers it, and a limit
      file still missing is a SliceError naming the cgroup. Without
      `cgroup_root` huge page limits are NOT enforced: `apply` logs a warning
      and `properties` does not list them.

    `bus`: None for the system bus (a connection per call, as pystemd does),
    a D-Bus address (str/bytes, e.g. "unix:path=/run/dbus/system_bus_socket"),
    or an opened pystemd bus object. pystemd is imported and the Manager built
    on first use, so this module imports without pystemd; a missing pystemd or
    any D-Bus failure is a SliceError. Calls are serialised (an sd-bus
    connection is not thread-safe). pystemd waits for each reply holding the
    GIL, so every thread of the process (an asyncio loop included, even when
    the call runs in `asyncio.to_thread`) stalls for the call: a millisecond
    normally, up to sd-bus's 25 s timeout when systemd does not answer.

    Slice names nest on '-', so `slice_name` spells a '-' of the id as '.'
    (every hold's slice sits directly in `bcd-alloc.slice`). A live unit
    under the legacy name (`legacy_slice_name`, '\\x2d') is the
    allocation's slice too: `exists`, `is_empty`, `list` and `properties`
    see it, `stop` stops it once empty; `apply` only ever starts or updates
    the current name.
    """

    def __init__(
        self,
        bus: object = None,
        *,
        cgroup_root: Path | str | None = None,
        stop_wait_s: float = 2.0,
        start_wait_s: float = 10.0,
    ) -> None:
        self._bus_arg = bus
        self._bus: Any = None
        self._own_bus = False
        self._manager: Any = None
        self._dbus_errors: tuple[type[BaseException], ...] = ()
        self.cgroup_root = Path(cgroup_root) if cgroup_root is not None else None
        self.stop_wait_s = stop_wait_s
        self.start_wait_s = start_wait_s
        self._lock = threading.RLock()
        self._warned_hugepages: set[str] = set()

    @property
    def reads_hugepages(self) -> bool:
        """Huge page limits are enforced and read only through `cgroup_root`."""
        return self.cgroup_root is not None

    # -- connection

    def _connect(self) -> Any:
        if self._manager is not None:
            return self._manager
        try:
            from pystemd.dbusexc import DBusBaseError
            from pystemd.systemd1 import Manager
            from pystemd.systemd1 import unit_signatures
        except ImportError as exc:
            raise SliceError(
                f"pystemd not installed ({exc}); install bcd[systemd] to create hold slices through systemd"
            ) from None
        self._dbus_errors = (DBusBaseError,)
        # pystemd marshals properties by name through this table; it lacks
        # the cpuset ones. setdefault: never override what pystemd knows.
        for name, sig in PROPERTY_SIGNATURES.items():
            unit_signatures.KNOWN_UNIT_SIGNATURES.setdefault(name.encode(), sig.encode())
        bus = self._bus_arg
        try:
            if isinstance(bus, (str, bytes)):
                from pystemd.dbuslib import DBusAddress

                bus = DBusAddress(bus.encode() if isinstance(bus, str) else bus)
                bus.open()
                self._own_bus = True
            manager = Manager(bus=bus)
            manager.load()
        except (DBusBaseError, OSError) as exc:
            if self._own_bus:
                bus.close()
                self._own_bus = False
            raise SliceError(f"cannot reach systemd over D-Bus: {exc}") from None
        self._bus, self._manager = bus, manager
        return manager

    def close(self) -> None:
        """Close a bus this object opened itself (one given as an address)."""
        with self._lock:
            if self._own_bus and self._bus is not None:
                self._bus.close()
            self._bus = self._manager = None
            self._own_bus = False

    @contextmanager
    def _call(self, what: str) -> Iterator[Any]:
        """The Manager, with D-Bus failures turned into SliceError naming `what`."""
        with self._lock:
            manager = self._connect()
            try:
                yield manager
            except self._dbus_errors + (OSError,) as exc:
                if self._own_bus:
                    # the connection may be dead (systemd or the bus restarted):
                    # the next call connects afresh.
                    self.close()
                raise SliceError(f"systemd: {what}: {exc}") from None

    def _get(self, manager: Any, path: bytes, iface: bytes, prop: str, sig: str) -> Any:
        with manager.bus_context() as bus:
            return bus.get_property(_SYSTEMD, path, iface, prop.encode(), sig.encode())

    def _unit(self, manager: Any, name: str) -> tuple[bytes, str] | None:
        """(object path, ActiveState) of a loaded unit; None when systemd does not know it."""
        from pystemd.dbusexc import DBusNoSuchUnitError, DBusUnknownObjectError

        try:
            path = manager.Manager.GetUnit(name.encode())
            state = _text(self._get(manager, path, _UNIT_IFACE, "ActiveState", "s"))
        except (DBusNoSuchUnitError, DBusUnknownObjectError):
            return None
        return path, state

    def _live(self, manager: Any, name: str) -> bytes | None:
        unit = self._unit(manager, name)
        return unit[0] if unit is not None and unit[1] in _LIVE else None

    # -- the port

    def apply(self, allocation_id: str, limits: Limits) -> None:
        props = slice_properties(allocation_id, limits)
        name = slice_name(allocation_id)
        with self._call(f"apply {name}") as manager:
            started = self._live(manager, name) is None
            if started:
                manager.Manager.StartTransientUnit(
                    name.encode(), b"replace", {k.encode(): v for k, v in props}
                )
                self._wait_live(manager, name)
            else:
                update = dict(_RESETS)
                update.update((k, v) for k, v in props if k != "Description")
                manager.Manager.SetUnitProperties(
                    name.encode(), True, {k.encode(): v for k, v in update.items()}
                )
            if limits.hugepages:
                try:
                    self._apply_hugepages(manager, name, limits.hugepages)
                except SliceError:
                    if started:
                        # (the VM suite's reboot: the slice came up after the limit write
                        # gave up, the next pass found it there and never wrote the limit)
                        self._undo_start(manager, name)
                    raise

    def _wait_live(self, manager: Any, name: str) -> None:
        deadline = time.monotonic() + self.start_wait_s
        while self._live(manager, name) is None and time.monotonic() < deadline:
            time.sleep(0.05)

    def _undo_start(self, manager: Any, name: str) -> None:
        """Stops a slice `apply` just started (nothing runs in it yet), best effort; "replace"
        also cancels a start job systemd has not run yet."""
        try:
            manager.Manager.StopUnit(name.encode(), b"replace")
        except self._dbus_errors as exc:
            log.warning("cannot stop a slice whose limits failed", slice=name, error=str(exc))

    def _cgroup_dir(self, manager: Any, name: str) -> Path | None:
        assert self.cgroup_root is not None
        path = self._live(manager, name)
        if path is None:
            return None
        cgroup = _text(self._get(manager, path, _SLICE_IFACE, "ControlGroup", "s"))
        rel = Path(cgroup.lstrip("/"))
        if not cgroup.startswith("/") or ".." in rel.parts:
            raise SliceError(f"{name}: systemd reports an odd ControlGroup {cgroup!r}")
        return self.cgroup_root / rel

    def _apply_hugepages(self, manager: Any, name: str, hugepages: list[HugePages]) -> None:
        if self.cgroup_root is None:
            if name not in self._warned_hugepages:
                self._warned_hugepages.add(name)
                log.warning(
                    "huge page limits not enforced: no cgroup root given for the hugetlb controller",
                    slice=name,
                    hugepages=_hugepages_record(hugepages),
                )
            return
        cgdir = self._cgroup_dir(manager, name)
        if cgdir is None:
            raise SliceError(f"{name}: slice not running yet; huge page limits not applied")
        if any(not (cgdir / f"hugetlb.{hugetlb_size_name(h.page_size_kib)}.max").exists() for h in hugepages):
            self._enable_hugetlb(cgdir)
        for h in hugepages:
            f = cgdir / f"hugetlb.{hugetlb_size_name(h.page_size_kib)}.max"
            if not f.exists():
                raise SliceError(
                    f"{name}: {f} missing: the hugetlb controller is not enabled for this cgroup "
                    "(enable it in cgroup.subtree_control of its parents); huge page limits not applied"
                )
            try:
                f.write_text(f"{h.count * h.page_size_kib * 1024}\n")
            except OSError as exc:
                raise SliceError(f"{name}: cannot write {f}: {exc}") from None

    def _enable_hugetlb(self, cgdir: Path) -> None:
        """Enables the hugetlb controller in `cgroup.subtree_control` of each parent of `cgdir`
        (the root's, bcd.slice's, bcd-alloc.slice's) that offers it and has not enabled it.

        systemd (252 at least) knows no hugetlb controller: it never enables it, and leaves
        it alone where someone else did. The slices' parents hold no processes of their own,
        so the kernel allows the write. A write that fails is left to the caller's check of
        the limit file (a SliceError naming the cgroup)."""
        assert self.cgroup_root is not None
        root = self.cgroup_root
        try:
            rel = cgdir.relative_to(root)
        except ValueError:
            return
        parents = [root] + [root.joinpath(*rel.parts[:i]) for i in range(1, len(rel.parts))]
        for parent in parents:
            try:
                offered = (parent / "cgroup.controllers").read_text().split()
                enabled = (parent / "cgroup.subtree_control").read_text().split()
            except OSError:
                return
            if "hugetlb" not in offered:
                return
            if "hugetlb" in enabled:
                continue
            try:
                (parent / "cgroup.subtree_control").write_text("+hugetlb\n")
            except OSError as exc:
                log.warning("cannot enable the hugetlb controller", cgroup=str(parent), error=str(exc))
                return

    def exists(self, allocation_id: str) -> bool:
        names = slice_names(allocation_id)
        with self._call(f"look up {names[0]}") as manager:
            return any(self._live(manager, name) is not None for name in names)

    def is_empty(self, allocation_id: str) -> bool:
        names = slice_names(allocation_id)
        with self._call(f"count the tasks of {names[0]}") as manager:
            return all(self._is_empty(manager, name) for name in names)

    def _is_empty(self, manager: Any, name: str) -> bool:
        path = self._live(manager, name)
        if path is None:
            return True
        tasks = int(self._get(manager, path, _SLICE_IFACE, "TasksCurrent", "t"))
        if tasks != UINT64_MAX:
            return tasks == 0
        if self.cgroup_root is not None:
            cgdir = self._cgroup_dir(manager, name)
            if cgdir is None:
                return True
            try:
                events = (cgdir / "cgroup.events").read_text()
            except FileNotFoundError:
                return True
            for line in events.splitlines():
                key, _, value = line.partition(" ")
                if key == "populated":
                    return value.strip() == "0"
        log.warning("cannot tell whether a slice is empty (no TasksCurrent, no cgroup root); keeping it", slice=name)
        return False

    def stop(self, allocation_id: str) -> bool:
        names = slice_names(allocation_id)
        with self._call(f"stop {names[0]}") as manager:
            return all([self._stop(manager, name) for name in names])

    def _stop(self, manager: Any, name: str) -> bool:
        if self._live(manager, name) is None:
            self._warned_hugepages.discard(name)
            return True
        if not self._is_empty(manager, name):
            return False
        manager.Manager.StopUnit(name.encode(), b"replace")
        deadline = time.monotonic() + self.stop_wait_s
        while self._live(manager, name) is not None:
            if time.monotonic() >= deadline:
                log.warning("slice still stopping; will look again", slice=name)
                return False
            time.sleep(0.05)
        self._warned_hugepages.discard(name)
        return True

    def list(self) -> list[str]:
        with self._call("list bcd-alloc-*.slice units") as manager:
            units = manager.Manager.ListUnitsByPatterns([], [f"{SLICE_PREFIX}*{SLICE_SUFFIX}".encode()])
        ids = {allocation_of(_text(u[0])) for u in units if _text(u[3]) in _LIVE}
        return sorted(i for i in ids if i is not None)

    def properties(self, allocation_id: str) -> dict[str, Any]:
        names = slice_names(allocation_id)
        with self._call(f"read the properties of {names[0]}") as manager:
            live = [(name, path) for name in names if (path := self._live(manager, name)) is not None]
            if not live:
                return {}
            name, path = live[0]
            out: dict[str, Any] = {}
            for prop, sig in PROPERTY_SIGNATURES.items():
                iface = _UNIT_IFACE if prop == "Description" else _SLICE_IFACE
                value = self._get(manager, path, iface, prop, sig)
                if sig == "s":
                    out[prop] = _text(value)
                elif sig == "ay":
                    mask = bytes(value).rstrip(b"\x00")
                    if mask:
                        out[prop] = mask
                elif int(value) != UINT64_MAX:
                    out[prop] = int(value)
            if self.cgroup_root is not None:
                hugepages = self._read_hugepages(manager, name)
                if hugepages:
                    out["hugepages"] = hugepages
            return out

    def _read_hugepages(self, manager: Any, name: str) -> list[dict[str, int]]:
        cgdir = self._cgroup_dir(manager, name)
        if cgdir is None or not cgdir.is_dir():
            return []
        found = []
        for f in cgdir.iterdir():
            m = _HUGETLB_FILE_RE.match(f.name)
            if m is None:
                continue
            value = f.read_text().strip()
            if value == "max":
                continue
            kib = int(m.group(1)) << _HUGETLB_SHIFT[m.group(2)]
            found.append({"page_size_kib": kib, "count": int(value) // (kib * 1024)})
        return sorted(found, key=lambda h: h["page_size_kib"])


__all__ = [
    "SliceError",
    "Slices",
    "FakeSlices",
    "SystemdSlices",
    "slice_name",
    "legacy_slice_name",
    "slice_names",
    "allocation_of",
    "slice_properties",
    "wanted_properties",
    "slice_differences",
    "read_properties",
    "FAKE_SLICES_SUBDIR",
    "parse_cpulist",
    "cpulist_to_bitmask",
    "bitmask_to_cpulist",
    "hugetlb_size_name",
    "PROPERTY_SIGNATURES",
]
