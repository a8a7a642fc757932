"""The converger's Slices port: one contract suite run on both backends, plus the pure parts as tables.

FakeSlices runs on a tmp run_dir. SystemdSlices runs through pystemd against
a REAL private dbus-daemon (one per module, its own config and socket), where
a fake `org.freedesktop.systemd1` written with dbus-fast (its own event loop
in a background thread) serves the Manager and the unit objects and records
every call, so the tests check what goes over the wire, down to the D-Bus
signature of each property. What is missing (pystemd, dbus-daemon, dbus-fast)
skips the systemd half with a reason naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import logging
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.slices import (
    UINT64_MAX,
    FakeSlices,
    SliceError,
    Slices,
    SystemdSlices,
    allocation_of,
    bitmask_to_cpulist,
    cpulist_to_bitmask,
    hugetlb_size_name,
    parse_cpulist,
    slice_differences,
    slice_name,
    slice_properties,
)
from shared.schemas.nodespec import HugePages, Limits

REPO = Path(__file__).resolve().parents[2]
GiB = 1 << 30
LIMITS = Limits(cpus="0-3,8", cpu_millis=1500, memory_bytes=4 * GiB, mems="0")


# ================================================================ pure parts as tables


@pytest.mark.parametrize(
    "cpulist, mask",
    [
        ("0", b"\x01"),
        ("7", b"\x80"),
        ("8", b"\x00\x01"),
        ("0-3,8", b"\x0f\x01"),
        ("0-15", b"\xff\xff"),
        ("1,3,5,7", b"\xaa"),
        ("3,1", b"\x0a"),
        ("0-3,2-5", b"\x3f"),
        ("63", b"\x00" * 7 + b"\x80"),
        ("0,64", b"\x01" + b"\x00" * 7 + b"\x01"),
    ],
)
def test_cpulist_to_bitmask(cpulist, mask):
    assert cpulist_to_bitmask(cpulist) == mask


@pytest.mark.parametrize("bad", ["", "a", "3-1", "0-3,", ",1", " 1", "1\n", "-1", "1-", "0-3;8", "12345"])
def test_cpulist_refuses_malformed(bad):
    with pytest.raises(ValueError):
        cpulist_to_bitmask(bad)


@pytest.mark.parametrize(
    "mask, cpulist",
    [(b"", ""), (b"\x00", ""), (b"\x0f\x01", "0-3,8"), (b"\xaa", "1,3,5,7"), (b"\xff\xff", "0-15"), (b"\x81", "0,7")],
)
def test_bitmask_to_cpulist(mask, cpulist):
    assert bitmask_to_cpulist(mask) == cpulist


@pytest.mark.parametrize("cpulist", ["0", "0-3,8", "5-9,11,13-14", "0,2,4-6,100"])
def test_cpulist_round_trip(cpulist):
    assert bitmask_to_cpulist(cpulist_to_bitmask(cpulist)) == cpulist
    assert parse_cpulist(bitmask_to_cpulist(cpulist_to_bitmask(cpulist))) == parse_cpulist(cpulist)


@pytest.mark.parametrize(
    "limits, expected",
    [
        (Limits(), [("Description", "bcd hold a1")]),
        (Limits(cpus="0-3,8"), [("Description", "bcd hold a1"), ("AllowedCPUs", b"\x0f\x01")]),
        (Limits(cpu_millis=1500), [("Description", "bcd hold a1"), ("CPUQuotaPerSecUSec", 1_500_000)]),
        (Limits(cpu_millis=1), [("Description", "bcd hold a1"), ("CPUQuotaPerSecUSec", 1000)]),
        (Limits(memory_bytes=4 * GiB), [("Description", "bcd hold a1"), ("MemoryMax", 4 * GiB)]),
        (Limits(memory_bytes=0), [("Description", "bcd hold a1"), ("MemoryMax", 0)]),
        (Limits(mems="0-1"), [("Description", "bcd hold a1"), ("AllowedMemoryNodes", b"\x03")]),
        (
            Limits(hugepages=[HugePages(page_size_kib=2048, count=8)]),
            [("Description", "bcd hold a1")],
        ),
        (
            LIMITS,
            [
                ("Description", "bcd hold a1"),
                ("AllowedCPUs", b"\x0f\x01"),
                ("CPUQuotaPerSecUSec", 1_500_000),
                ("MemoryMax", 4 * GiB),
                ("AllowedMemoryNodes", b"\x01"),
            ],
        ),
    ],
)
def test_slice_properties(limits, expected):
    assert slice_properties("a1", limits) == expected


def test_slice_properties_refuses_a_zero_cpu_quota():
    with pytest.raises(ValueError, match="cpu_millis 0"):
        slice_properties("a1", Limits(cpu_millis=0))


def test_slice_properties_refuses_a_bad_id():
    with pytest.raises(ValueError):
        slice_properties("../etc", LIMITS)


@pytest.mark.parametrize(
    "allocation_id, name",
    [
        ("a1", "bcd-alloc-a1.slice"),
        ("alloc_01jz8k2v", "bcd-alloc-alloc_01jz8k2v.slice"),
        ("0", "bcd-alloc-0.slice"),
        ("x" * 63, f"bcd-alloc-{'x' * 63}.slice"),
    ],
)
def test_slice_name_and_its_inverse(allocation_id, name):
    assert slice_name(allocation_id) == name
    assert allocation_of(name) == allocation_id


BAD_IDS = ["", "A1", "a/b", "../x", "a b", "-a", "_a", "a\n", "a.slice", "x" * 64, "é", None, 7]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_slice_name_refuses_what_is_not_an_id(bad):
    with pytest.raises(ValueError):
        slice_name(bad)


@pytest.mark.parametrize(
    "name",
    [
        "bcd-alloc-.slice",
        "bcd-alloc-A1.slice",
        "bcd-alloc-a1.slice\n",
        "bcd-alloc-a1.service",
        "bcd-alloc-a1.slice.json",
        "xbcd-alloc-a1.slice",
        "bcd-alloc-a/b.slice",
        "system.slice",
        "bcd-alloc.slice",
        None,
    ],
    ids=repr,
)
def test_allocation_of_is_none_for_names_not_ours(name):
    assert allocation_of(name) is None


@pytest.mark.parametrize(
    "kib, name", [(64, "64KB"), (2048, "2MB"), (32768, "32MB"), (524288, "512MB"), (1048576, "1GB"), (16 << 20, "16GB")]
)
def test_hugetlb_size_name(kib, name):
    assert hugetlb_size_name(kib) == name


def test_both_backends_implement_the_port(tmp_path):
    assert isinstance(FakeSlices(tmp_path), Slices)
    assert isinstance(SystemdSlices(), Slices)


# ================================================================ a real bus with a fake systemd

DBUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


@contextlib.contextmanager
def private_bus(base: Path):
    """A dbus-daemon of our own (config and socket under `base`); yields its address."""
    daemon = shutil.which("dbus-daemon")
    if daemon is None:
        pytest.skip("dbus-daemon not found (apt-get install dbus)")
    socket = base / "bus"
    if len(str(socket)) > 100:
        pytest.skip(f"tmp path too long for a unix socket: {socket}")
    config = base / "bus.conf"
    config.write_text(DBUS_CONFIG.format(socket=socket))
    proc = subprocess.Popen(
        [daemon, f"--config-file={config}", "--nofork", "--nopidfile", "--print-address"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 10)
        address = proc.stdout.readline().decode().strip() if ready else ""
        if not address:
            proc.kill()
            pytest.fail(f"dbus-daemon did not start: {proc.stderr.read().decode(errors='replace')}")
        yield address
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()
        proc.stderr.close()


@pytest.fixture(scope="module")
def dbus_address(tmp_path_factory):
    """One private dbus-daemon for this module."""
    with private_bus(tmp_path_factory.mktemp("dbus")) as address:
        yield address


def _path_encode(name: str) -> str:
    """systemd's bus_path_encode: every byte not [A-Za-z0-9] becomes _xx."""
    return "/org/freedesktop/systemd1/unit/" + "".join(
        c if c.isascii() and c.isalnum() else "".join(f"_{b:02x}" for b in c.encode()) for c in name
    )


def _cgroup_of(name: str) -> str:
    """The cgroup systemd gives a slice: one level per '-'-prefix ("a-b.slice" -> /a.slice/a-b.slice)."""
    parts = name.removesuffix(".slice").split("-")
    return "/" + "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


CONTROL_PATH = "/dev/bcd/test"
CONTROL_IFACE = "dev.bcd.test.FakeSystemd"


async def _serve_fake_systemd(address: str) -> None:
    """The fake systemd: runs in its own process (`python -m tests.unit.test_slices ADDRESS`).

    Its own process because pystemd holds the GIL while it waits for a reply,
    so a service in the test's process could never answer. It owns
    org.freedesktop.systemd1 and serves the Manager methods slices use, the
    unit objects (Unit and Slice interfaces), and at /dev/bcd/test a control
    interface for the test: the calls recorded, busy units, reset, failures.
    """
    from dbus_fast import DBusError
    from dbus_fast.aio import MessageBus
    from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method

    def no_such_unit(name):
        return DBusError("org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not loaded.")

    class Unit:
        def __init__(self, name, props, cgroup_root, late=0):
            self.name = name
            self.props = dict(props)
            self.tasks = 0
            #: ActiveState reads that still say "inactive" (a start job systemd runs later)
            self.late = late
            self.cgroup = _cgroup_of(name)
            if cgroup_root:
                d = Path(cgroup_root) / self.cgroup.lstrip("/")
                d.mkdir(parents=True, exist_ok=True)
                (d / "cgroup.events").write_text("populated 0\nfrozen 0\n")
                for size in ("2MB", "1GB"):  # the hugetlb controller enabled for these sizes
                    (d / f"hugetlb.{size}.max").write_text("max\n")

        def get(self, prop, default):
            return self.props.get(prop, default)

    class UnitIface(ServiceInterface):
        def __init__(self, unit):
            super().__init__("org.freedesktop.systemd1.Unit")
            self.unit = unit

        @dbus_property(access=PropertyAccess.READ)
        def Id(self) -> "s":
            return self.unit.name

        @dbus_property(access=PropertyAccess.READ)
        def Description(self) -> "s":
            return self.unit.get("Description", self.unit.name)

        @dbus_property(access=PropertyAccess.READ)
        def LoadState(self) -> "s":
            return "loaded"

        @dbus_property(access=PropertyAccess.READ)
        def ActiveState(self) -> "s":
            if self.unit.late > 0:
                self.unit.late -= 1
                return "inactive"
            return "active"

    class SliceIface(ServiceInterface):
        def __init__(self, unit):
            super().__init__("org.freedesktop.systemd1.Slice")
            self.unit = unit

        @dbus_property(access=PropertyAccess.READ)
        def ControlGroup(self) -> "s":
            return self.unit.cgroup

        @dbus_property(access=PropertyAccess.READ)
        def TasksCurrent(self) -> "t":
            return self.unit.tasks

        @dbus_property(access=PropertyAccess.READ)
        def AllowedCPUs(self) -> "ay":
            return self.unit.get("AllowedCPUs", b"")

        @dbus_property(access=PropertyAccess.READ)
        def AllowedMemoryNodes(self) -> "ay":
            return self.unit.get("AllowedMemoryNodes", b"")

        @dbus_property(access=PropertyAccess.READ)
        def CPUQuotaPerSecUSec(self) -> "t":
            return self.unit.get("CPUQuotaPerSecUSec", UINT64_MAX)

        @dbus_property(access=PropertyAccess.READ)
        def MemoryMax(self) -> "t":
            return self.unit.get("MemoryMax", UINT64_MAX)

    class Manager(ServiceInterface):
        """org.freedesktop.systemd1.Manager: the methods slices use, each call recorded."""

        def __init__(self, bus):
            super().__init__("org.freedesktop.systemd1.Manager")
            self.bus = bus
            self.calls: list[list] = []
            self.units: dict[str, Unit] = {}
            self.failure: tuple[str, str] | None = None
            self.cgroup_root = ""
            self.jobs = 0
            self.start_late = 0

        def _record(self, *call):
            self.calls.append(list(call))
            if self.failure is not None:
                raise DBusError(*self.failure)

        def _job(self):
            self.jobs += 1
            return f"/org/freedesktop/systemd1/job/{self.jobs}"

        @staticmethod
        def _props(properties):
            # JSON-able: byte arrays as lists of ints
            return [[n, v.signature, list(v.value) if v.signature == "ay" else v.value] for n, v in properties]

        def create(self, name, props, late=0):
            unit = Unit(name, props, self.cgroup_root, late)
            self.units[name] = unit
            self.bus.export(_path_encode(name), UnitIface(unit))
            self.bus.export(_path_encode(name), SliceIface(unit))

        def remove(self, name):
            del self.units[name]
            self.bus.unexport(_path_encode(name))

        @method()
        def StartTransientUnit(self, name: "s", mode: "s", properties: "a(sv)", aux: "a(sa(sv))") -> "o":
            self._record("StartTransientUnit", name, mode, self._props(properties))
            if name in self.units:
                raise DBusError("org.freedesktop.systemd1.UnitExists", f"Unit {name} already exists.")
            self.create(name, {n: v.value for n, v in properties}, self.start_late)
            return self._job()

        @method()
        def SetUnitProperties(self, name: "s", runtime: "b", properties: "a(sv)"):
            self._record("SetUnitProperties", name, runtime, self._props(properties))
            if name not in self.units:
                raise no_such_unit(name)
            self.units[name].props.update((n, v.value) for n, v in properties)

        @method()
        def GetUnit(self, name: "s") -> "o":
            self._record("GetUnit", name)
            if name not in self.units:
                raise no_such_unit(name)
            return _path_encode(name)

        @method()
        def StopUnit(self, name: "s", mode: "s") -> "o":
            self._record("StopUnit", name, mode)
            if name not in self.units:
                raise no_such_unit(name)
            self.remove(name)
            return self._job()

        @method()
        def ListUnitsByPatterns(self, states: "as", patterns: "as") -> "a(ssssssouso)":
            self._record("ListUnitsByPatterns", states, patterns)
            return [
                [u.name, u.get("Description", u.name), "loaded", "active", "active", "", _path_encode(u.name),
                 0, "", "/"]
                for u in self.units.values()
                if any(fnmatch.fnmatchcase(u.name, p) for p in patterns)
            ]

    class Control(ServiceInterface):
        def __init__(self, manager):
            super().__init__(CONTROL_IFACE)
            self.m = manager

        @method()
        def Calls(self) -> "s":
            return json.dumps(self.m.calls)

        @method()
        def Reset(self, cgroup_root: "s"):
            for name in list(self.m.units):
                self.m.remove(name)
            self.m.calls.clear()
            self.m.failure = None
            self.m.cgroup_root = cgroup_root
            self.m.start_late = 0

        @method()
        def SetTasks(self, name: "s", tasks: "t"):
            self.m.units[name].tasks = tasks

        @method()
        def AddUnit(self, name: "s", description: "s"):
            self.m.create(name, {"Description": description})

        @method()
        def StartLate(self, reads: "t"):
            self.m.start_late = reads

        @method()
        def FailWith(self, error: "s", message: "s"):
            self.m.failure = (error, message) if error else None

    bus = await MessageBus(bus_address=address).connect()
    manager = Manager(bus)
    bus.export("/org/freedesktop/systemd1", manager)
    bus.export(CONTROL_PATH, Control(manager))
    await bus.request_name("org.freedesktop.systemd1")
    print("ready", flush=True)
    await bus.wait_for_disconnect()


class FakeSystemd:
    """The test's hand on the fake systemd process, over its control interface (through pystemd)."""

    def __init__(self, address: str, log: Path):
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.unit.test_slices", address],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 20)
        if not ready or self.proc.stdout.readline().strip() != b"ready":
            self.close()
            pytest.fail(f"fake systemd did not start: {log.read_text(errors='replace')}")
        from pystemd.dbuslib import DBusAddress

        self.bus = DBusAddress(address.encode())
        self.bus.open()

    def _control(self, method: str, signature: str = "", *args):
        from pystemd.dbuslib import apply_signature

        call_args = apply_signature(signature.encode(), list(args)) if signature else []
        return self.bus.call_method(
            b"org.freedesktop.systemd1", CONTROL_PATH.encode(), CONTROL_IFACE.encode(), method.encode(), call_args
        ).body

    def reset(self, cgroup_root: Path | None = None) -> None:
        self._control("Reset", "s", str(cgroup_root or "").encode())

    def set_tasks(self, name: str, tasks: int) -> None:
        self._control("SetTasks", "st", name.encode(), tasks)

    def add_unit(self, name: str, description: str = "not ours") -> None:
        self._control("AddUnit", "ss", name.encode(), description.encode())

    def start_late(self, reads: int) -> None:
        """Slices started from now on look inactive for their first ``reads`` ActiveState reads."""
        self._control("StartLate", "t", reads)

    def fail_with(self, error: str, message: str) -> None:
        self._control("FailWith", "ss", error.encode(), message.encode())

    @property
    def calls(self) -> list[tuple]:
        body = self._control("Calls")
        calls = json.loads(body.decode() if isinstance(body, bytes) else body)
        out = []
        for call in calls:
            if call[0] in ("StartTransientUnit", "SetUnitProperties"):
                call[3] = [(n, sig, bytes(v) if sig == "ay" else v) for n, sig, v in call[3]]
            out.append(tuple(call))
        return out

    def calls_of(self, *methods: str) -> list[tuple]:
        return [c for c in self.calls if c[0] in methods]

    def close(self) -> None:
        bus = getattr(self, "bus", None)
        if bus is not None:
            bus.close()
            self.bus = None
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stdout.close()
        self._log.close()


def _need_pystemd():
    try:
        import pystemd.systemd1  # noqa: F401
    except ImportError:
        pytest.skip("pystemd not installed (pip install -e '.[systemd]'; needs libsystemd-dev and pkg-config)")


@pytest.fixture(scope="module")
def fake_systemd(dbus_address, tmp_path_factory):
    _need_pystemd()
    try:
        import dbus_fast  # noqa: F401
    except ImportError:
        pytest.skip("dbus-fast not installed (pip install -e '.[test]')")
    server = FakeSystemd(dbus_address, tmp_path_factory.mktemp("fake-systemd") / "stderr.log")
    yield server
    server.close()


@pytest.fixture
def systemd(fake_systemd, dbus_address):
    """A fresh fake systemd state and a SystemdSlices talking to it."""
    fake_systemd.reset()
    slices = SystemdSlices(bus=dbus_address)
    yield slices
    slices.close()


# ================================================================ the contract, on both backends


class Backend:
    """A backend under test plus the test's hand on its workload."""

    def __init__(self, slices: Slices, make_busy, make_idle, fake_systemd=None):
        self.slices = slices
        self.make_busy = make_busy
        self.make_idle = make_idle
        self.fake_systemd = fake_systemd


@pytest.fixture(params=["fake", "systemd"])
def backend(request, tmp_path):
    if request.param == "fake":
        fake = FakeSlices(tmp_path)
        yield Backend(fake, lambda a: fake.set_pids(a, [4242]), lambda a: fake.set_pids(a, []))
        return
    fs = request.getfixturevalue("fake_systemd")
    slices = request.getfixturevalue("systemd")
    b = Backend(
        slices,
        lambda a: fs.set_tasks(slice_name(a), 3),
        lambda a: fs.set_tasks(slice_name(a), 0),
        fs,
    )
    b.fake_systemd_address = request.getfixturevalue("dbus_address")
    yield b


def test_apply_creates_the_slice(backend):
    s = backend.slices
    assert not s.exists("a1")
    assert s.list() == []
    s.apply("a1", LIMITS)
    assert s.exists("a1")
    assert s.list() == ["a1"]
    assert s.is_empty("a1")
    assert s.properties("a1") == dict(slice_properties("a1", LIMITS))


def test_apply_again_is_idempotent_and_updates(backend):
    s = backend.slices
    s.apply("a1", LIMITS)
    s.apply("a1", LIMITS)
    assert s.list() == ["a1"]
    assert s.properties("a1") == dict(slice_properties("a1", LIMITS))
    smaller = Limits(cpus="1", cpu_millis=500)
    s.apply("a1", smaller)
    assert s.list() == ["a1"]
    # the memory limits dropped are gone, not left behind
    assert s.properties("a1") == {
        "Description": "bcd hold a1",
        "AllowedCPUs": b"\x02",
        "CPUQuotaPerSecUSec": 500_000,
    }


def test_list_names_every_slice(backend):
    s = backend.slices
    for a in ("b_2", "a1", "c3"):
        s.apply(a, Limits(cpus="0"))
    assert s.list() == ["a1", "b_2", "c3"]
    assert s.stop("b_2")
    assert s.list() == ["a1", "c3"]


def test_stop_of_an_empty_slice_removes_it(backend):
    s = backend.slices
    s.apply("a1", LIMITS)
    assert s.stop("a1") is True
    assert not s.exists("a1")
    assert s.list() == []
    assert s.properties("a1") == {}
    assert s.stop("a1") is True  # again: idempotent


def test_stop_of_a_slice_with_a_workload_keeps_it(backend):
    s = backend.slices
    s.apply("a1", LIMITS)
    backend.make_busy("a1")
    assert not s.is_empty("a1")
    assert s.stop("a1") is False
    assert s.exists("a1")
    assert s.list() == ["a1"]
    assert s.properties("a1") == dict(slice_properties("a1", LIMITS))
    # the workload exits: the next stop takes it
    backend.make_idle("a1")
    assert s.is_empty("a1")
    assert s.stop("a1") is True
    assert not s.exists("a1")


def test_stop_of_a_missing_slice_is_true(backend):
    s = backend.slices
    assert s.stop("never") is True
    assert not s.exists("never")
    assert s.is_empty("never")
    assert s.properties("never") == {}


@pytest.mark.parametrize("bad", ["", "A1", "../x", "a/b", "a\n", "x" * 64, None], ids=repr)
def test_invalid_ids_are_refused(backend, bad):
    s = backend.slices
    for call in (
        lambda: s.apply(bad, LIMITS),
        lambda: s.stop(bad),
        lambda: s.exists(bad),
        lambda: s.is_empty(bad),
        lambda: s.properties(bad),
    ):
        with pytest.raises(ValueError):
            call()
    assert s.list() == []
    if backend.fake_systemd is not None:
        # refused before anything reached the bus
        assert backend.fake_systemd.calls_of("StartTransientUnit", "SetUnitProperties", "StopUnit", "GetUnit") == []


# ================================================================ drift by content (issue 41.1)

HP = Limits(memory_bytes=GiB, hugepages=[HugePages(page_size_kib=2048, count=8)])
HP_READ = {"Description": "bcd hold a1", "MemoryMax": GiB, "hugepages": [{"page_size_kib": 2048, "count": 8}]}


@pytest.mark.parametrize(
    "limits, found, hugepages, differs",
    [
        pytest.param(LIMITS, dict(slice_properties("a1", LIMITS)), True, (), id="same"),
        pytest.param(LIMITS, {**dict(slice_properties("a1", LIMITS)), "MemoryMax": 8 * GiB}, True, ("MemoryMax",), id="memory-raised"),
        pytest.param(LIMITS, {k: v for k, v in slice_properties("a1", LIMITS) if k != "AllowedCPUs"}, True, ("AllowedCPUs",), id="cpus-dropped"),
        pytest.param(LIMITS, {**dict(slice_properties("a1", LIMITS)), "TasksMax": 1}, True, ("TasksMax",), id="other-added"),
        pytest.param(LIMITS, {**dict(slice_properties("a1", LIMITS)), "MemoryMax": "4G"}, True, ("MemoryMax",), id="wrong-type"),
        pytest.param(LIMITS, None, True, ("unreadable",), id="unreadable"),
        pytest.param(HP, HP_READ, True, (), id="hugepages-same"),
        pytest.param(HP, {**HP_READ, "hugepages": [{"page_size_kib": 2048, "count": 64}]}, True, ("hugepages",), id="hugepages-raised"),
        pytest.param(HP, {k: v for k, v in HP_READ.items() if k != "hugepages"}, True, ("hugepages",), id="hugepages-lifted"),
        # a backend that neither enforces nor reads them (systemd without a cgroup root): no difference
        pytest.param(HP, {k: v for k, v in HP_READ.items() if k != "hugepages"}, False, (), id="hugepages-not-read"),
    ],
)
def test_slice_differences(limits, found, hugepages, differs):
    assert slice_differences("a1", limits, found, hugepages=hugepages) == differs


def test_a_slice_changed_from_outside_reads_back_so_and_apply_puts_it_back(backend):
    """What the converger compares: the properties as applied now, not as bcd once asked."""
    s = backend.slices
    s.apply("a1", LIMITS)
    assert slice_differences("a1", LIMITS, s.properties("a1"), hugepages=s.reads_hugepages) == ()
    if backend.fake_systemd is None:
        record = json.loads(s.path("a1").read_text())
        record["properties"]["MemoryMax"] = 64 * GiB
        record["properties"].pop("AllowedCPUs")
        s.path("a1").write_text(json.dumps(record))
    else:  # `systemctl set-property`: another client of the Manager
        other = SystemdSlices(bus=backend.fake_systemd_address)
        try:
            other.apply("a1", Limits(cpu_millis=1500, memory_bytes=64 * GiB, mems="0"))
        finally:
            other.close()
    assert slice_differences("a1", LIMITS, s.properties("a1"), hugepages=s.reads_hugepages) == ("AllowedCPUs", "MemoryMax")
    s.apply("a1", LIMITS)  # the same idempotent apply the converger (or its root helper) runs
    assert slice_differences("a1", LIMITS, s.properties("a1"), hugepages=s.reads_hugepages) == ()
    assert s.list() == ["a1"]


def test_a_garbled_fake_record_is_a_slice_error_to_read_and_written_again_by_apply(tmp_path):
    s = FakeSlices(tmp_path)
    s.apply("a1", LIMITS)
    saved = s.path("a1").read_bytes()
    for garbled in ('{"properties": ', json.dumps({"name": "x", "properties": {"AllowedCPUs": [300]}, "pids": []})):
        s.path("a1").write_text(garbled)
        with pytest.raises(SliceError, match="a1"):
            s.properties("a1")
        s.apply("a1", LIMITS)
        assert s.path("a1").read_bytes() == saved


def test_which_backends_read_hugepages(tmp_path):
    assert FakeSlices(tmp_path).reads_hugepages is True
    assert SystemdSlices(cgroup_root=tmp_path).reads_hugepages is True
    assert SystemdSlices().reads_hugepages is False


# ================================================================ systemd: what goes over the wire


def test_systemd_sends_the_exact_properties(systemd, fake_systemd):
    systemd.apply("a1", LIMITS)
    starts = fake_systemd.calls_of("StartTransientUnit")
    assert starts == [
        (
            "StartTransientUnit",
            "bcd-alloc-a1.slice",
            "replace",
            [
                ("Description", "s", "bcd hold a1"),
                ("AllowedCPUs", "ay", b"\x0f\x01"),
                ("CPUQuotaPerSecUSec", "t", 1_500_000),
                ("MemoryMax", "t", 4 * GiB),
                ("AllowedMemoryNodes", "ay", b"\x01"),
            ],
        )
    ]


def test_systemd_updates_a_live_slice_in_place_and_resets_dropped_limits(systemd, fake_systemd):
    systemd.apply("a1", LIMITS)
    systemd.apply("a1", Limits(cpus="1"))
    assert len(fake_systemd.calls_of("StartTransientUnit")) == 1
    assert fake_systemd.calls_of("SetUnitProperties") == [
        (
            "SetUnitProperties",
            "bcd-alloc-a1.slice",
            True,
            [
                ("AllowedCPUs", "ay", b"\x02"),
                ("CPUQuotaPerSecUSec", "t", UINT64_MAX),
                ("MemoryMax", "t", UINT64_MAX),
                ("AllowedMemoryNodes", "ay", b""),
            ],
        )
    ]


def test_systemd_never_stops_a_busy_slice(systemd, fake_systemd):
    systemd.apply("a1", LIMITS)
    fake_systemd.set_tasks("bcd-alloc-a1.slice", 1)
    assert systemd.stop("a1") is False
    assert fake_systemd.calls_of("StopUnit") == []
    fake_systemd.set_tasks("bcd-alloc-a1.slice", 0)
    assert systemd.stop("a1") is True
    assert fake_systemd.calls_of("StopUnit") == [("StopUnit", "bcd-alloc-a1.slice", "replace")]


def test_systemd_lists_only_our_names(systemd, fake_systemd):
    systemd.apply("a1", Limits(cpus="0"))
    # a unit that matches the glob but is not a valid allocation id is not ours
    fake_systemd.add_unit("bcd-alloc-Bad.slice")
    assert systemd.list() == ["a1"]
    assert fake_systemd.calls_of("ListUnitsByPatterns")[-1] == ("ListUnitsByPatterns", [], ["bcd-alloc-*.slice"])


def test_systemd_judges_emptiness_from_the_cgroup_without_task_accounting(
    fake_systemd, dbus_address, tmp_path
):
    fake_systemd.reset(cgroup_root=tmp_path)
    with_root = SystemdSlices(bus=dbus_address, cgroup_root=tmp_path)
    without_root = SystemdSlices(bus=dbus_address)
    try:
        with_root.apply("a1", LIMITS)
        fake_systemd.set_tasks("bcd-alloc-a1.slice", UINT64_MAX)  # TasksAccounting off
        events = tmp_path / "bcd.slice/bcd-alloc.slice/bcd-alloc-a1.slice/cgroup.events"
        assert events.exists()
        events.write_text("populated 1\nfrozen 0\n")
        assert not with_root.is_empty("a1")
        assert with_root.stop("a1") is False
        events.write_text("populated 0\nfrozen 0\n")
        # without a cgroup root the slice cannot be shown empty: kept
        assert without_root.is_empty("a1") is False
        assert without_root.stop("a1") is False
        assert with_root.is_empty("a1")
        assert with_root.stop("a1") is True
    finally:
        with_root.close()
        without_root.close()


def test_systemd_applies_hugepages_through_hugetlb_files(fake_systemd, dbus_address, tmp_path):
    fake_systemd.reset(cgroup_root=tmp_path)
    slices = SystemdSlices(bus=dbus_address, cgroup_root=tmp_path)
    limits = Limits(memory_bytes=GiB, hugepages=[HugePages(page_size_kib=2048, count=8)])
    try:
        slices.apply("a1", limits)
        cg = tmp_path / "bcd.slice/bcd-alloc.slice/bcd-alloc-a1.slice"
        assert (cg / "hugetlb.2MB.max").read_text() == f"{8 * 2 * 1024 * 1024}\n"
        assert (cg / "hugetlb.1GB.max").read_text() == "max\n"
        assert slices.properties("a1") == {
            "Description": "bcd hold a1",
            "MemoryMax": GiB,
            "hugepages": [{"page_size_kib": 2048, "count": 8}],
        }
        # a size whose controller file is missing is refused, retryably, naming the cgroup
        with pytest.raises(SliceError, match="hugetlb controller is not enabled"):
            slices.apply("a1", Limits(hugepages=[HugePages(page_size_kib=64, count=1)]))
    finally:
        slices.close()


def test_systemd_waits_for_a_slice_systemd_starts_late(fake_systemd, dbus_address, tmp_path):
    """StartTransientUnit only queues a job: at a guest's boot the slice came up after the huge
    page write had given up ("slice not running yet"), and the limit was never written."""
    fake_systemd.reset(cgroup_root=tmp_path)
    fake_systemd.start_late(5)
    slices = SystemdSlices(bus=dbus_address, cgroup_root=tmp_path)
    try:
        slices.apply("a1", Limits(hugepages=[HugePages(page_size_kib=2048, count=8)]))
        cg = tmp_path / "bcd.slice/bcd-alloc.slice/bcd-alloc-a1.slice"
        assert (cg / "hugetlb.2MB.max").read_text() == f"{8 * 2 * 1024 * 1024}\n"
    finally:
        slices.close()


def test_systemd_stops_a_slice_it_started_whose_limits_failed(fake_systemd, dbus_address, tmp_path):
    """A slice left running without its limits counts as made: a kept hold's slice is made again
    only when missing. One this apply started is stopped again; an existing one is left alone."""
    fake_systemd.reset(cgroup_root=tmp_path)
    slices = SystemdSlices(bus=dbus_address, cgroup_root=tmp_path)
    no_controller = Limits(hugepages=[HugePages(page_size_kib=64, count=1)])
    try:
        with pytest.raises(SliceError, match="hugetlb controller is not enabled"):
            slices.apply("a1", no_controller)
        assert not slices.exists("a1")
        assert [c[1] for c in fake_systemd.calls_of("StopUnit")] == ["bcd-alloc-a1.slice"]
        slices.apply("a2", Limits(memory_bytes=GiB))
        with pytest.raises(SliceError, match="hugetlb controller is not enabled"):
            slices.apply("a2", no_controller)
        assert slices.exists("a2")
        assert [c[1] for c in fake_systemd.calls_of("StopUnit")] == ["bcd-alloc-a1.slice"]
    finally:
        slices.close()


def test_systemd_without_cgroup_root_says_hugepages_are_not_enforced(systemd, fake_systemd, caplog):
    limits = Limits(cpus="0", hugepages=[HugePages(page_size_kib=2048, count=8)])
    with caplog.at_level(logging.WARNING, logger="shared.slices"):
        systemd.apply("a1", limits)
    assert "huge page limits not enforced" in caplog.text
    assert "hugepages" not in systemd.properties("a1")


def test_systemd_dbus_failures_are_slice_errors(systemd, fake_systemd):
    fake_systemd.fail_with("org.freedesktop.DBus.Error.AccessDenied", "Access denied")
    with pytest.raises(SliceError, match="apply bcd-alloc-a1.slice.*Access denied"):
        systemd.apply("a1", LIMITS)
    fake_systemd.fail_with("", "")
    # and the backend works again afterwards (it reconnects)
    systemd.apply("a1", LIMITS)
    assert systemd.exists("a1")


def test_systemd_unreachable_bus_is_a_slice_error(tmp_path):
    _need_pystemd()
    slices = SystemdSlices(bus=f"unix:path={tmp_path}/no-bus")
    with pytest.raises(SliceError, match="cannot reach systemd"):
        slices.exists("a1")
    with pytest.raises(SliceError, match="cannot reach systemd"):
        slices.apply("a1", LIMITS)


def test_no_systemd_on_the_bus_is_a_slice_error(tmp_path):
    """A bus where nobody owns org.freedesktop.systemd1."""
    _need_pystemd()
    with private_bus(tmp_path) as address:
        slices = SystemdSlices(bus=address)
        with pytest.raises(SliceError, match="cannot reach systemd"):
            slices.exists("a1")
        slices.close()


def test_without_pystemd_the_module_imports_and_systemd_slices_say_so(monkeypatch):
    for name in [m for m in sys.modules if m == "pystemd" or m.startswith("pystemd.")] + ["pystemd"]:
        monkeypatch.setitem(sys.modules, name, None)
    slices = SystemdSlices()
    with pytest.raises(SliceError, match="pystemd not installed"):
        slices.exists("a1")


# ================================================================ the fake's record


def test_fake_record_is_the_json_the_fakehw_host_keeps(tmp_path):
    slices = FakeSlices(tmp_path)
    limits = Limits(cpus="0-3,8", cpu_millis=1500, memory_bytes=4 * GiB, mems="0",
                    hugepages=[HugePages(page_size_kib=1048576, count=2), HugePages(page_size_kib=2048, count=8)])
    slices.apply("a1", limits)
    path = tmp_path / "slices" / "bcd-alloc-a1.slice.json"
    assert [p.name for p in (tmp_path / "slices").iterdir()] == [path.name]  # no temp file left
    assert path.stat().st_mode & 0o777 == 0o644
    assert json.loads(path.read_text()) == {
        "name": "bcd-alloc-a1.slice",
        "properties": {
            "Description": "bcd hold a1",
            "AllowedCPUs": [15, 1],
            "CPUQuotaPerSecUSec": 1_500_000,
            "MemoryMax": 4 * GiB,
            "AllowedMemoryNodes": [1],
        },
        "hugepages": [{"page_size_kib": 2048, "count": 8}, {"page_size_kib": 1048576, "count": 2}],
        "pids": [],
    }
    assert slices.properties("a1")["hugepages"] == [
        {"page_size_kib": 2048, "count": 8},
        {"page_size_kib": 1048576, "count": 2},
    ]


def test_fake_keeps_pids_across_an_update(tmp_path):
    slices = FakeSlices(tmp_path)
    slices.apply("a1", LIMITS)
    slices.set_pids("a1", [10, 11])
    slices.apply("a1", Limits(cpus="2"))
    assert not slices.is_empty("a1")
    assert slices.properties("a1") == {"Description": "bcd hold a1", "AllowedCPUs": b"\x04"}


def test_fake_lists_only_its_records(tmp_path):
    slices = FakeSlices(tmp_path)
    slices.apply("a1", LIMITS)
    d = tmp_path / "slices"
    for foreign in ("bcd-alloc-Bad.slice.json", "other.json", ".bcd-alloc-a2.slice.json.x.tmp", "bcd-alloc-a3.slice"):
        (d / foreign).write_text("{}")
    assert slices.list() == ["a1"]


def test_fake_unreadable_record_is_a_slice_error(tmp_path):
    slices = FakeSlices(tmp_path)
    slices.apply("a1", LIMITS)
    (tmp_path / "slices" / "bcd-alloc-a1.slice.json").write_text("{not json")
    with pytest.raises(SliceError, match="unreadable"):
        slices.stop("a1")
    (tmp_path / "slices" / "bcd-alloc-a1.slice.json").write_text('{"properties": {}, "pids": "x"}')
    with pytest.raises(SliceError, match="malformed"):
        slices.is_empty("a1")


def test_fake_set_pids_of_a_missing_slice_is_refused(tmp_path):
    with pytest.raises(SliceError, match="does not exist"):
        FakeSlices(tmp_path).set_pids("a1", [1])


if __name__ == "__main__":
    asyncio.run(_serve_fake_systemd(sys.argv[1]))


@pytest.mark.parametrize(
    ("alloc", "name", "legacy"),
    [
        ("alloc_01jz8k2v", "bcd-alloc-alloc_01jz8k2v.slice", "bcd-alloc-alloc_01jz8k2v.slice"),  # the seed's example: unchanged
        ("a-1", "bcd-alloc-a.1.slice", "bcd-alloc-a\\x2d1.slice"),  # not nested under bcd-alloc-a.slice
        ("x-y-z", "bcd-alloc-x.y.z.slice", "bcd-alloc-x\\x2dy\\x2dz.slice"),
        ("a--b-", "bcd-alloc-a..b..slice", "bcd-alloc-a\\x2d\\x2db\\x2d.slice"),
    ],
)
def test_a_dash_in_the_allocation_id_is_spelled_dot_so_slices_do_not_nest(alloc, name, legacy):
    """A '-' of the id becomes '.' (no id holds one, systemd gives it no meaning before
    the suffix, and no shell, docker or systemd env-file reader treats it specially);
    the '\\x2d' spelling of earlier versions is still recognised as the same allocation's."""
    from shared.slices import allocation_of, legacy_slice_name, slice_name, slice_names

    assert slice_name(alloc) == name and "\\" not in name
    assert legacy_slice_name(alloc) == legacy
    assert slice_names(alloc) == ((name,) if name == legacy else (name, legacy))
    assert allocation_of(name) == alloc
    assert allocation_of(legacy) == alloc
    # the unescaped form is not one of ours: it would be a child of another hold's slice
    assert allocation_of(f"bcd-alloc-{alloc}.slice") == (None if "-" in alloc else alloc)


@pytest.mark.parametrize(
    "name",
    ["bcd-alloc-a.1\\x2d2.slice", "bcd-alloc-a\\x2e1.slice", "bcd-alloc-A.slice", "bcd-alloc-.slice", "bcd-alloc-a.b\\.slice"],
)
def test_mixed_or_foreign_spellings_are_not_ours(name):
    from shared.slices import allocation_of

    assert allocation_of(name) is None


def test_fake_slices_record_names_need_no_quoting(tmp_path):
    """`ls <run_dir>/slices | xargs ...` and a shell loop see the names as they are."""
    slices = FakeSlices(tmp_path)
    slices.apply("train-01", Limits(cpus="0-1"))
    names = [p.name for p in (tmp_path / "slices").iterdir()]
    assert names == ["bcd-alloc-train.01.slice.json"]
    out = subprocess.run(["sh", "-c", f"cd {tmp_path}/slices && ls | xargs -n1 echo"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == names


def test_a_legacy_fake_slice_is_the_allocations_slice_until_stopped(tmp_path):
    """A record bcd wrote before (\\x2d in its name) is seen, kept while busy and stopped once empty."""
    from shared.slices import legacy_slice_name

    slices = FakeSlices(tmp_path)
    legacy = tmp_path / "slices" / f"{legacy_slice_name('train-01')}.json"
    legacy.parent.mkdir(parents=True)
    legacy.write_text(json.dumps({"name": legacy_slice_name("train-01"), "properties": {"MemoryMax": 1024}, "hugepages": [], "pids": [42]}))
    assert slices.list() == ["train-01"] and slices.exists("train-01") and not slices.is_empty("train-01")
    assert slices.properties("train-01") == {"MemoryMax": 1024}
    slices.apply("train-01", Limits(memory_bytes=2048))  # only ever the current name
    assert slices.properties("train-01")["MemoryMax"] == 2048 and legacy.exists()
    assert slices.list() == ["train-01"]
    assert slices.stop("train-01") is False  # the legacy one still runs a workload
    assert legacy.exists() and not slices.path("train-01").exists()
    assert slices.exists("train-01")
    slices.set_pids("train-01", [])
    assert slices.is_empty("train-01") and slices.stop("train-01") is True
    assert not slices.exists("train-01") and slices.list() == []


def test_a_legacy_named_slice_is_the_allocations_slice_on_both_backends(backend, tmp_path):
    """A slice an earlier bcd started as `bcd-alloc-a\\x2d1.slice` is listed as a-1's, kept
    while a workload runs in it and stopped once empty; `apply` only ever starts the new name."""
    from shared.slices import legacy_slice_name

    s, legacy = backend.slices, legacy_slice_name("a-1")
    if backend.fake_systemd is None:
        (tmp_path / "slices").mkdir(exist_ok=True)
        (tmp_path / "slices" / f"{legacy}.json").write_text(json.dumps({"name": legacy, "properties": {}, "hugepages": [], "pids": [7]}))
        idle = lambda: s.set_pids("a-1", [])  # noqa: E731 - the only record: the legacy one
    else:
        backend.fake_systemd.add_unit(legacy, "bcd hold a-1")
        backend.fake_systemd.set_tasks(legacy, 2)
        idle = lambda: backend.fake_systemd.set_tasks(legacy, 0)  # noqa: E731
    assert s.list() == ["a-1"] and s.exists("a-1") and not s.is_empty("a-1")
    assert s.stop("a-1") is False and s.exists("a-1")
    idle()
    assert s.is_empty("a-1")
    s.apply("a-1", LIMITS)
    assert s.list() == ["a-1"] and s.properties("a-1") == dict(slice_properties("a-1", LIMITS))
    if backend.fake_systemd is not None:
        assert [c[1] for c in backend.fake_systemd.calls_of("StartTransientUnit")] == ["bcd-alloc-a.1.slice"]
    assert s.stop("a-1") is True
    assert not s.exists("a-1") and s.list() == []


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("alloc", ["train-01", "a--b-", "alloc_01jz8k2v", "x" * 63])
def test_systemd_takes_the_slice_name_as_a_valid_unit_name(tmp_path, alloc):
    """`systemd-analyze verify` (offline: nothing is started) loads a slice unit by that name;
    a name systemd refuses ('%', say) fails it, so the check has teeth."""
    for name, ok in ((slice_name(alloc), True), ("bcd-alloc-a%b.slice", False)):
        unit = tmp_path / name
        unit.write_text("[Unit]\nDescription=bcd hold\n")
        out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
        assert (out.returncode == 0) is ok, out.stderr
        unit.unlink()
