"""vfio_switcher: the DriverPort contract on both backends, and `switch` with every failure injected.

The contract suite runs the same table on `FakeDriver` and on `SysfsDriver`
over a fake sysfs tree built in tmp_path (device directories reached through
bus/pci/devices symlinks, driver symlinks, bind/unbind files). The tree does
not react to writes by itself; `KernelSysfs` lets the real driver write the
real files and then applies what the kernel would do, so every path the
backend builds is exercised. A hung unbind blocks the worker thread for real
(on an Event, released at teardown); one test hangs on a FIFO with no
emulation at all.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import pytest

from services.vfio_switcher.driver import (
    VFIO_DRIVER,
    DeviceVanished,
    DriverBusy,
    DriverError,
    DriverPort,
    DriverTimeout,
    FakeDriver,
    SysfsDriver,
    is_canonical_pci,
)
from services.vfio_switcher.switch import (
    DISRUPTION_REQUIRED,
    EVENT_PREPARE_FAILED,
    EVENT_PREPARE_SUCCEEDED,
    EVENT_UNPREPARE_FAILED,
    Outcome,
    switch,
)

GPU = "0000:3b:00.0"
GPU2 = "0000:86:00.0"
NIC = "0000:18:00.0"
BASE = "nvidia"
T = 0.05  # every write timeout; a hang costs this much, no more
WRITES = {"unbind", "set_driver_override", "bind", "drivers_probe"}


# --------------------------------------------------------------------------- the fake sysfs tree


class FakeTree:
    """A sysfs tree under `root` laid out as the kernel lays it out, plus the faults to inject."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pci_bus = root / "bus" / "pci"
        (self.pci_bus / "devices").mkdir(parents=True)
        (self.pci_bus / "drivers_probe").write_text("")
        for driver in (BASE, VFIO_DRIVER):
            self.load(driver)
        self.native: dict[str, str] = {}
        self.fail_bind: set[tuple[str, str]] = set()
        self.hang_unbind: dict[str, str] = {}
        self.vanish_at: dict[str, str] = {}
        self.fail_reset: set[str] = set()
        #: pci -> function resets the kernel did
        self.resets: dict[str, int] = {}
        self.gate = threading.Event()

    def load(self, driver: str) -> None:
        d = self.pci_bus / "drivers" / driver
        d.mkdir(parents=True)
        for name in ("bind", "unbind", "new_id"):
            (d / name).write_text("")

    def unload(self, driver: str) -> None:
        d = self.pci_bus / "drivers" / driver
        for f in d.iterdir():
            f.unlink()
        d.rmdir()

    def real_dir(self, pci: str) -> Path:
        return self.root / "devices" / "pci0000:00" / pci

    def add(self, pci: str, *, cls: str = "0x030200", driver: str | None = None, override: str = "", native: str = BASE) -> None:
        d = self.real_dir(pci)
        d.mkdir(parents=True)
        (d / "class").write_text(cls + "\n")
        (d / "vendor").write_text("0x10de\n")
        (d / "driver_override").write_text((override or "(null)") + "\n")
        (d / "reset").write_text("")  # the kernel makes it where a reset method works
        os.symlink(os.path.relpath(d, self.pci_bus / "devices"), self.pci_bus / "devices" / pci)
        self.native[pci] = native
        self.set_driver(pci, driver)

    def remove(self, pci: str) -> None:
        (self.pci_bus / "devices" / pci).unlink()
        d = self.real_dir(pci)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()

    def driver(self, pci: str) -> str | None:
        link = self.real_dir(pci) / "driver"
        return os.path.basename(os.readlink(link)) if link.is_symlink() else None

    def override(self, pci: str) -> str:
        value = (self.real_dir(pci) / "driver_override").read_text().strip()
        return "" if value == "(null)" else value

    def set_driver(self, pci: str, driver: str | None) -> None:
        link = self.real_dir(pci) / "driver"
        if link.is_symlink():
            link.unlink()
        if driver is not None:
            os.symlink(os.path.relpath(self.pci_bus / "drivers" / driver, self.real_dir(pci)), link)

    def present(self, pci: str) -> bool:
        return self.real_dir(pci).is_dir()

    # ----------------------------------------------------------------- the kernel's side of a write

    def classify(self, path: Path, data: str) -> tuple[str, str, str | None]:
        """(operation, pci, driver) for a write to `path`, from the path as the backend built it."""
        parts = path.relative_to(self.pci_bus).parts
        if parts[0] == "devices" and parts[2:] == ("driver", "unbind"):
            return "unbind", parts[1], None
        if parts[0] == "devices" and parts[2:] == ("driver_override",):
            return "set_driver_override", parts[1], None
        if parts[0] == "drivers" and parts[2:] == ("bind",):
            return "bind", data.strip(), parts[1]
        if parts == ("drivers_probe",):
            return "drivers_probe", data.strip(), None
        if parts[0] == "devices" and parts[2:] == ("reset",):
            assert data == "1", data
            return "reset", parts[1], None
        raise AssertionError(f"the backend wrote an unexpected path: {path}")

    def before(self, op: str, pci: str) -> None:
        if self.vanish_at.get(pci) == op:
            del self.vanish_at[pci]
            self.remove(pci)
        if op == "unbind" and pci in self.hang_unbind:
            if self.hang_unbind.pop(pci) == "unbound":
                self.set_driver(pci, None)
            self.gate.wait(10)  # blocks the worker thread as a stuck remove() would

    def after(self, op: str, pci: str, driver: str | None, data: str) -> None:
        if op in ("bind", "drivers_probe") and not self.present(pci):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        if op == "reset":
            if pci in self.fail_reset:
                self.fail_reset.discard(pci)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            self.resets[pci] = self.resets.get(pci, 0) + 1
        elif op == "unbind":
            self.set_driver(pci, None)
        elif op == "set_driver_override":
            (self.real_dir(pci) / "driver_override").write_text((data.strip() or "(null)") + "\n")
        elif op == "bind":
            assert driver is not None
            if self.driver(pci) is not None:
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
            if driver != (self.override(pci) or self.native[pci]):
                raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
            if (pci, driver) in self.fail_bind:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            self.set_driver(pci, driver)
        elif op == "drivers_probe" and self.driver(pci) is None:
            candidate = self.override(pci) or self.native[pci]
            if (self.pci_bus / "drivers" / candidate).is_dir() and (pci, candidate) not in self.fail_bind:
                self.set_driver(pci, candidate)


class KernelSysfs(SysfsDriver):
    """The real SysfsDriver; only its one write is followed by the kernel's reaction."""

    def __init__(self, tree: FakeTree) -> None:
        super().__init__(tree.root)
        self.tree = tree

    def _write_file(self, path: Path, data: str) -> None:
        op, pci, driver = self.tree.classify(path, data)
        self.tree.before(op, pci)
        super()._write_file(path, data)
        self.tree.after(op, pci, driver, data)


def join_writer_threads() -> None:
    for thread in threading.enumerate():
        if thread.name.startswith("bcd-sysfs-write"):
            thread.join(5)
            assert not thread.is_alive(), f"{thread.name} still blocked"


# --------------------------------------------------------------------------- one host, either backend


class FakeHost:
    """Setup and fault injection over FakeDriver, in the words SysfsHost uses too."""

    def __init__(self) -> None:
        self.port = FakeDriver()

    def add(self, pci: str, *, cls: str = "0x030200", driver: str | None = None, override: str = "") -> None:
        self.port.add(pci, pci_class=cls, driver=driver, driver_override=override)

    def fail_bind(self, pci: str, driver: str) -> None:
        self.port.fail_bind(pci, driver)

    def hang_unbind(self, pci: str, leave: str) -> None:
        self.port.hang_unbind(pci, leave=leave)  # type: ignore[arg-type]

    def vanish_at(self, pci: str, op: str) -> None:
        self.port.vanish_at(pci, op)  # type: ignore[arg-type]

    def unload(self, driver: str) -> None:
        self.port.loaded.discard(driver)

    def close(self) -> None:
        pass


class SysfsHost:
    def __init__(self, root: Path) -> None:
        self.tree = FakeTree(root)
        self.port = KernelSysfs(self.tree)

    def add(self, pci: str, *, cls: str = "0x030200", driver: str | None = None, override: str = "") -> None:
        self.tree.add(pci, cls=cls, driver=driver, override=override)

    def fail_bind(self, pci: str, driver: str) -> None:
        self.tree.fail_bind.add((pci, driver))

    def hang_unbind(self, pci: str, leave: str) -> None:
        self.tree.hang_unbind[pci] = leave

    def vanish_at(self, pci: str, op: str) -> None:
        self.tree.vanish_at[pci] = op

    def unload(self, driver: str) -> None:
        self.tree.unload(driver)

    def close(self) -> None:
        self.tree.gate.set()
        join_writer_threads()


@pytest.fixture(params=["fake", "sysfs"])
def host(request, tmp_path):
    h = FakeHost() if request.param == "fake" else SysfsHost(tmp_path / "sys")
    yield h
    h.close()


class Recording:
    """A port wrapper that records every method used, to prove what a refusal did not touch."""

    def __init__(self, port: DriverPort) -> None:
        self._port = port
        self.used: list[str] = []

    def __getattr__(self, name: str):
        self.used.append(name)
        return getattr(self._port, name)

    @property
    def writes(self) -> list[str]:
        return [u for u in self.used if u in WRITES]


async def nobody(pci: str) -> str | None:
    return None


# --------------------------------------------------------------------------- the DriverPort contract


def test_both_backends_satisfy_the_protocol(tmp_path):
    assert isinstance(FakeDriver(), DriverPort)
    assert isinstance(SysfsDriver(tmp_path), DriverPort)


@pytest.mark.parametrize(
    ("cls", "gpu"),
    [("0x030000", True), ("0x030200", True), ("0x030201", True), ("0x020000", False), ("0x030100", False), ("0x040300", False)],
)
def test_is_gpu_by_pci_class(host, cls, gpu):
    host.add(GPU, cls=cls)
    assert host.port.is_gpu(GPU) is gpu


def test_reads(host):
    host.add(GPU, driver=BASE)
    host.add(GPU2, override=VFIO_DRIVER)
    assert host.port.exists(GPU) and host.port.exists(GPU2)
    assert not host.port.exists("0000:00:1f.0")
    assert host.port.current_driver(GPU) == BASE
    assert host.port.current_driver(GPU2) is None
    assert host.port.current_driver("0000:00:1f.0") is None
    assert host.port.driver_override(GPU) == ""
    assert host.port.driver_override(GPU2) == VFIO_DRIVER
    assert not host.port.is_gpu("0000:00:1f.0")


async def test_unbind_clears_the_driver_and_refuses_an_unbound_device(host):
    host.add(GPU, driver=BASE)
    await host.port.unbind(GPU, T)
    assert host.port.current_driver(GPU) is None
    with pytest.raises(DriverError, match="not bound"):
        await host.port.unbind(GPU, T)


async def test_bind_respects_driver_override(host):
    host.add(GPU, driver=BASE)
    await host.port.set_driver_override(GPU, VFIO_DRIVER, T)
    assert host.port.driver_override(GPU) == VFIO_DRIVER
    await host.port.unbind(GPU, T)
    with pytest.raises(DriverError):
        await host.port.bind(GPU, BASE, T)  # the override is the only match now
    await host.port.bind(GPU, VFIO_DRIVER, T)
    assert host.port.current_driver(GPU) == VFIO_DRIVER


async def test_vfio_does_not_match_without_override(host):
    host.add(GPU)
    with pytest.raises(DriverError):
        await host.port.bind(GPU, VFIO_DRIVER, T)
    assert host.port.current_driver(GPU) is None


async def test_bind_of_a_bound_device_fails(host):
    host.add(GPU, driver=BASE)
    with pytest.raises(DriverError):
        await host.port.bind(GPU, BASE, T)
    assert host.port.current_driver(GPU) == BASE


async def test_bind_to_a_driver_not_loaded(host):
    host.add(GPU, override=VFIO_DRIVER)
    host.unload(VFIO_DRIVER)
    with pytest.raises(DriverError, match="not loaded"):
        await host.port.bind(GPU, VFIO_DRIVER, T)


async def test_clearing_the_override(host):
    host.add(GPU, override=VFIO_DRIVER)
    await host.port.set_driver_override(GPU, "", T)
    assert host.port.driver_override(GPU) == ""
    await host.port.bind(GPU, BASE, T)
    assert host.port.current_driver(GPU) == BASE


@pytest.mark.parametrize(("override", "expect"), [("", BASE), (VFIO_DRIVER, VFIO_DRIVER)])
async def test_drivers_probe_binds_to_the_override_or_the_native_driver(host, override, expect):
    host.add(GPU, override=override)
    await host.port.drivers_probe(GPU, T)
    assert host.port.current_driver(GPU) == expect
    await host.port.drivers_probe(GPU, T)  # bound already: left alone
    assert host.port.current_driver(GPU) == expect


async def test_drivers_probe_is_silent_when_nothing_binds(host):
    host.add(GPU)
    host.fail_bind(GPU, BASE)
    await host.port.drivers_probe(GPU, T)
    assert host.port.current_driver(GPU) is None


async def test_injected_bind_failure(host):
    host.add(GPU, override=VFIO_DRIVER)
    host.fail_bind(GPU, VFIO_DRIVER)
    with pytest.raises(DriverError) as info:
        await host.port.bind(GPU, VFIO_DRIVER, T)
    assert not isinstance(info.value, (DriverTimeout, DeviceVanished))
    assert host.port.current_driver(GPU) is None


@pytest.mark.parametrize(("leave", "driver_after"), [("unbound", None), ("bound", BASE)])
async def test_hung_unbind_times_out_and_blocks_later_writes(host, leave, driver_after):
    host.add(GPU, driver=BASE)
    host.hang_unbind(GPU, leave)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DriverTimeout, match=GPU):
        await host.port.unbind(GPU, T)
    assert loop.time() - started < 2  # timed out, not waited out
    assert host.port.current_driver(GPU) == driver_after
    assert host.port.pending_writes() == {GPU: "unbind"}
    with pytest.raises(DriverBusy):
        await host.port.set_driver_override(GPU, "", T)


@pytest.mark.parametrize("op", sorted(WRITES))
async def test_device_vanishes(host, op):
    host.add(GPU, driver=BASE if op == "unbind" else None)
    host.vanish_at(GPU, op)
    call = {
        "unbind": lambda: host.port.unbind(GPU, T),
        "set_driver_override": lambda: host.port.set_driver_override(GPU, VFIO_DRIVER, T),
        "bind": lambda: host.port.bind(GPU, BASE, T),
        "drivers_probe": lambda: host.port.drivers_probe(GPU, T),
    }[op]
    with pytest.raises(DeviceVanished, match=GPU):
        await call()
    assert not host.port.exists(GPU)


@pytest.mark.parametrize("bad", ["0000:3B:00.0", "3b:00.0", "../0000:3b:00.0", "0000:3b:00.0\n", "", "0000:3b:00.0/.."])
async def test_ports_refuse_a_non_canonical_address_themselves(host, bad):
    with pytest.raises(ValueError):
        host.port.exists(bad)
    with pytest.raises(ValueError):
        await host.port.unbind(bad, T)
    with pytest.raises(ValueError):
        await host.port.bind(bad, BASE, T)


@pytest.mark.parametrize("bad", ["../nvidia", "nvidia/bind", "..", ".hidden", "a b"])
async def test_ports_refuse_a_driver_name_that_is_a_path(host, bad):
    host.add(GPU)
    with pytest.raises(ValueError):
        await host.port.bind(GPU, bad, T)
    with pytest.raises(ValueError):
        await host.port.set_driver_override(GPU, bad, T)


# --------------------------------------------------------------------------- SysfsDriver's own paths


def plain_tree(tmp_path: Path) -> FakeTree:
    tree = FakeTree(tmp_path / "sys")
    tree.add(GPU, driver=BASE)
    return tree


async def test_sysfs_writes_the_kernel_files(tmp_path):
    """No emulation: what lands in which file is exactly what the kernel would be sent."""
    tree = plain_tree(tmp_path)
    port = SysfsDriver(tree.root)
    drivers = tree.pci_bus / "drivers"
    await port.set_driver_override(GPU, VFIO_DRIVER, T)
    assert (tree.real_dir(GPU) / "driver_override").read_text() == VFIO_DRIVER
    await port.unbind(GPU, T)
    assert (drivers / BASE / "unbind").read_text() == GPU  # through the device's driver link
    await port.bind(GPU, VFIO_DRIVER, T)
    assert (drivers / VFIO_DRIVER / "bind").read_text() == GPU
    await port.drivers_probe(GPU, T)
    assert (tree.pci_bus / "drivers_probe").read_text() == GPU
    await port.set_driver_override(GPU, "", T)
    assert (tree.real_dir(GPU) / "driver_override").read_text() == "\n"  # what clears it


async def test_sysfs_never_creates_a_missing_attribute(tmp_path):
    tree = plain_tree(tmp_path)
    (tree.real_dir(GPU) / "driver_override").unlink()  # a kernel without driver_override
    port = SysfsDriver(tree.root)
    with pytest.raises(DriverError, match="No such file"):
        await port.set_driver_override(GPU, VFIO_DRIVER, T)
    assert not (tree.real_dir(GPU) / "driver_override").exists()
    assert port.pending_writes() == {}


async def test_sysfs_reads_null_override_and_no_driver(tmp_path):
    tree = plain_tree(tmp_path)
    tree.add(GPU2)
    port = SysfsDriver(tree.root)
    assert port.driver_override(GPU) == ""  # "(null)"
    assert port.current_driver(GPU2) is None
    with pytest.raises(DriverError, match="not bound"):
        await port.unbind(GPU2, T)


async def test_sysfs_a_write_blocked_in_the_kernel_times_out(tmp_path):
    """A FIFO stands in for an unbind that never returns: the open itself blocks, for real."""
    tree = plain_tree(tmp_path)
    unbind = tree.pci_bus / "drivers" / BASE / "unbind"
    unbind.unlink()
    os.mkfifo(unbind)
    port = SysfsDriver(tree.root)
    with pytest.raises(DriverTimeout, match="did not return"):
        await port.unbind(GPU, T)
    assert port.pending_writes() == {GPU: "unbind"}
    with pytest.raises(DriverBusy, match="earlier unbind"):
        await port.bind(GPU, VFIO_DRIVER, T)
    # The kernel finally lets go: the write lands and the device is free again.
    reader = os.open(unbind, os.O_RDONLY | os.O_NONBLOCK)
    try:
        join_writer_threads()
        assert os.read(reader, 100) == GPU.encode()
    finally:
        os.close(reader)
    assert port.pending_writes() == {}


async def test_sysfs_timeout_must_be_positive(tmp_path):
    port = SysfsDriver(plain_tree(tmp_path).root)
    with pytest.raises(ValueError):
        await port.unbind(GPU, 0)


# --------------------------------------------------------------------------- switch: refusals


@pytest.mark.parametrize("bad", ["0000:3B:00.0", "3b:00.0", "../0000:3b:00.0", "0000:3b:00.0\n", " 0000:3b:00.0", "00000000:3b:00.0", ""])
@pytest.mark.parametrize("target", ["vfio-pci", "native"])
async def test_switch_refuses_a_non_canonical_address_before_touching_anything(host, bad, target):
    host.add(GPU, driver=BASE)
    port = Recording(host.port)
    asked: list[str] = []

    async def held_by(pci: str) -> str | None:
        asked.append(pci)
        return None

    result = await switch(port, bad, target, base_driver=BASE, timeout=T, held_by=held_by)
    assert result.outcome is Outcome.REFUSED and result.reason == "InvalidAddress"
    assert "canonical" in result.message and result.event is None
    assert port.used == [] and asked == []
    assert host.port.current_driver(GPU) == BASE


def test_canonical_address_rule():
    assert is_canonical_pci("0000:3b:00.0") and is_canonical_pci("ffff:ff:1f.7")
    for bad in ("0000:3b:00.8", "0000:3B:00.0", "0000:3b:00.0\n", "0000:3b:00", 1234, None):
        assert not is_canonical_pci(bad)


@pytest.mark.parametrize(
    ("target", "base", "timeout"),
    [("passthrough", BASE, T), ("vfio-pci", VFIO_DRIVER, T), ("vfio-pci", "../nvidia", T), ("native", BASE, 0), ("native", BASE, -1)],
)
async def test_switch_refuses_a_bad_request(host, target, base, timeout):
    host.add(GPU, driver=BASE)
    port = Recording(host.port)
    result = await switch(port, GPU, target, base_driver=base, timeout=timeout, held_by=nobody)  # type: ignore[arg-type]
    assert result.outcome is Outcome.REFUSED and result.reason == "InvalidRequest"
    assert port.used == []


async def test_switch_refuses_a_non_gpu(host):
    host.add(NIC, cls="0x020000", driver="mlx5_core")
    port = Recording(host.port)
    result = await switch(port, NIC, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert result.outcome is Outcome.REFUSED and result.reason == "NotAGPU"
    assert NIC in result.message and port.writes == []
    assert host.port.current_driver(NIC) == "mlx5_core"


async def test_switch_refuses_an_absent_device(host):
    port = Recording(host.port)
    result = await switch(port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert result.outcome is Outcome.REFUSED and result.reason == "NoSuchDevice" and port.writes == []


@pytest.mark.parametrize("target", ["vfio-pci", "native"])
async def test_switch_refuses_a_held_gpu_naming_the_holder(host, target):
    host.add(GPU, driver=BASE if target == "vfio-pci" else VFIO_DRIVER)
    port = Recording(host.port)

    async def held_by(pci: str) -> str | None:
        return "hold team-a/train-1" if pci == GPU else None

    result = await switch(port, GPU, target, base_driver=BASE, timeout=T, held_by=held_by)
    assert result.outcome is Outcome.REFUSED and result.reason == "Held"
    assert result.holder == "hold team-a/train-1" and "hold team-a/train-1" in result.message
    assert port.used == []  # the holder is asked first


async def test_switch_fails_closed_when_the_holder_is_unknown(host):
    host.add(GPU, driver=BASE)
    port = Recording(host.port)

    async def held_by(pci: str) -> str | None:
        raise ConnectionError("converger did not answer")

    result = await switch(port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=held_by)
    assert result.outcome is Outcome.REFUSED and result.reason == "HolderUnknown"
    assert "converger did not answer" in result.message and port.used == []


@pytest.mark.parametrize(("target", "driver"), [("vfio-pci", VFIO_DRIVER), ("native", BASE)])
async def test_switch_does_nothing_when_already_there(host, target, driver):
    host.add(GPU, driver=driver)
    port = Recording(host.port)
    result = await switch(port, GPU, target, base_driver=BASE, timeout=T, held_by=nobody)
    assert result.outcome is Outcome.UNCHANGED and result.ok and result.event is None
    assert port.writes == []
    assert host.port.current_driver(GPU) == driver


# --------------------------------------------------------------------------- switch: attempts, table-driven

# (id, initial driver, initial override, target, faults, outcome, reason, event, final driver, final override, rolled back)
# faults: ("fail_bind", driver) | ("hang_unbind", leave) | ("vanish_at", op) | ("unload", driver)
CASES = [
    ("to-vfio", BASE, "", "vfio-pci", [], Outcome.SUCCEEDED, "Switched", EVENT_PREPARE_SUCCEEDED, VFIO_DRIVER, VFIO_DRIVER, False),
    ("to-vfio-from-no-driver", None, "", "vfio-pci", [], Outcome.SUCCEEDED, "Switched", EVENT_PREPARE_SUCCEEDED, VFIO_DRIVER, VFIO_DRIVER, False),
    ("to-native", VFIO_DRIVER, VFIO_DRIVER, "native", [], Outcome.SUCCEEDED, "Switched", None, BASE, "", False),
    ("to-native-from-no-driver", None, VFIO_DRIVER, "native", [], Outcome.SUCCEEDED, "Switched", None, BASE, "", False),
    # bind to vfio-pci fails: rolled back to the native driver, override cleared
    ("vfio-bind-fails", BASE, "", "vfio-pci", [("fail_bind", VFIO_DRIVER)],
     Outcome.FAILED, "BindFailed", EVENT_PREPARE_FAILED, BASE, "", True),
    ("vfio-not-loaded", BASE, "", "vfio-pci", [("unload", VFIO_DRIVER)],
     Outcome.FAILED, "BindFailed", EVENT_PREPARE_FAILED, BASE, "", True),
    # ... and the way back fails too: no driver at all
    ("vfio-bind-fails-and-rollback-fails", BASE, "", "vfio-pci", [("fail_bind", VFIO_DRIVER), ("fail_bind", BASE)],
     Outcome.DISRUPTION_REQUIRED, "BindFailed", EVENT_PREPARE_FAILED, None, "", False),
    # unbind hangs and the card has no driver: nothing may be tried, a reboot is needed
    ("vfio-unbind-hangs-unbound", BASE, "", "vfio-pci", [("hang_unbind", "unbound")],
     Outcome.DISRUPTION_REQUIRED, "UnbindTimedOut", EVENT_PREPARE_FAILED, None, VFIO_DRIVER, False),
    # unbind hangs with the card still on its driver: failed, card still usable, the stale override said
    ("vfio-unbind-hangs-bound", BASE, "", "vfio-pci", [("hang_unbind", "bound")],
     Outcome.FAILED, "UnbindTimedOut", EVENT_PREPARE_FAILED, BASE, VFIO_DRIVER, True),
    # release: native bind fails -> driverless, no way back
    ("native-bind-fails", VFIO_DRIVER, VFIO_DRIVER, "native", [("fail_bind", BASE)],
     Outcome.DISRUPTION_REQUIRED, "BindFailed", EVENT_UNPREPARE_FAILED, None, "", False),
    # release: unbind from vfio-pci hangs -> stuck on vfio-pci (or driverless)
    ("native-unbind-hangs-bound", VFIO_DRIVER, VFIO_DRIVER, "native", [("hang_unbind", "bound")],
     Outcome.DISRUPTION_REQUIRED, "UnbindTimedOut", EVENT_UNPREPARE_FAILED, VFIO_DRIVER, "", False),
    ("native-unbind-hangs-unbound", VFIO_DRIVER, VFIO_DRIVER, "native", [("hang_unbind", "unbound")],
     Outcome.DISRUPTION_REQUIRED, "UnbindTimedOut", EVENT_UNPREPARE_FAILED, None, "", False),
    # the device vanishes: failed, said plainly, nothing more attempted
    ("vfio-vanishes-at-override", BASE, "", "vfio-pci", [("vanish_at", "set_driver_override")],
     Outcome.FAILED, "DeviceVanished", EVENT_PREPARE_FAILED, None, None, False),
    ("vfio-vanishes-at-unbind", BASE, "", "vfio-pci", [("vanish_at", "unbind")],
     Outcome.FAILED, "DeviceVanished", EVENT_PREPARE_FAILED, None, None, False),
    ("vfio-vanishes-at-bind", BASE, "", "vfio-pci", [("vanish_at", "bind")],
     Outcome.FAILED, "DeviceVanished", EVENT_PREPARE_FAILED, None, None, False),
    ("native-vanishes-at-unbind", VFIO_DRIVER, VFIO_DRIVER, "native", [("vanish_at", "unbind")],
     Outcome.FAILED, "DeviceVanished", EVENT_UNPREPARE_FAILED, None, None, False),
    ("native-vanishes-at-bind", VFIO_DRIVER, VFIO_DRIVER, "native", [("vanish_at", "bind")],
     Outcome.FAILED, "DeviceVanished", EVENT_UNPREPARE_FAILED, None, None, False),
]


@pytest.mark.parametrize(
    ("initial", "override", "target", "faults", "outcome", "reason", "event", "final", "final_override", "rolled_back"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
async def test_switch(host, initial, override, target, faults, outcome, reason, event, final, final_override, rolled_back):
    host.add(GPU, driver=initial, override=override)
    host.add(GPU2, driver=BASE)  # a neighbour the switch must never touch
    for fault, arg in faults:
        if fault == "fail_bind":
            host.fail_bind(GPU, arg)
        elif fault == "hang_unbind":
            host.hang_unbind(GPU, arg)
        elif fault == "vanish_at":
            host.vanish_at(GPU, arg)
        else:
            host.unload(arg)

    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await switch(host.port, GPU, target, base_driver=BASE, timeout=T, held_by=nobody)
    assert loop.time() - started < 2

    assert (result.outcome, result.reason, result.event) == (outcome, reason, event), result.message
    assert result.pci == GPU and result.target == target
    assert result.rolled_back is rolled_back
    assert result.ok is (outcome is Outcome.SUCCEEDED)
    if final_override is None:  # vanished
        assert not host.port.exists(GPU)
        assert "disappeared" in result.message and GPU in result.message
    else:
        assert host.port.current_driver(GPU) == final
        assert result.driver == final
        assert host.port.driver_override(GPU) == final_override
    if outcome is Outcome.DISRUPTION_REQUIRED:
        assert result.reconfiguring == DISRUPTION_REQUIRED
        assert GPU in result.message and "reboot" in result.message
    else:
        assert result.reconfiguring is None
    assert host.port.current_driver(GPU2) == BASE and host.port.driver_override(GPU2) == ""


async def test_hung_unbind_still_bound_says_the_override_is_stale(host):
    host.add(GPU, driver=BASE)
    host.hang_unbind(GPU, "bound")
    result = await switch(host.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert result.outcome is Outcome.FAILED
    assert "still on nvidia" in result.message and "driver_override could not be cleared" in result.message


async def test_release_stuck_on_vfio_names_it(host):
    host.add(GPU, driver=VFIO_DRIVER, override=VFIO_DRIVER)
    host.hang_unbind(GPU, "bound")
    result = await switch(host.port, GPU, "native", base_driver=BASE, timeout=T, held_by=nobody)
    assert result.event == EVENT_UNPREPARE_FAILED
    assert f"GPU {GPU}" in result.message and "stuck on vfio-pci" in result.message and "node reboot" in result.message


async def test_round_trip_then_again(host):
    host.add(GPU, driver=BASE)
    there = await switch(host.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    back = await switch(host.port, GPU, "native", base_driver=BASE, timeout=T, held_by=nobody)
    again = await switch(host.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert [r.outcome for r in (there, back, again)] == [Outcome.SUCCEEDED] * 3
    assert host.port.current_driver(GPU) == VFIO_DRIVER


async def test_a_disrupted_card_refuses_further_writes_until_the_write_returns(host):
    """After a hang the device lock is still held: a retry fails fast instead of hanging again."""
    host.add(GPU, driver=BASE)
    host.hang_unbind(GPU, "unbound")
    first = await switch(host.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert first.outcome is Outcome.DISRUPTION_REQUIRED
    retry = await switch(host.port, GPU, "native", base_driver=BASE, timeout=T, held_by=nobody)
    assert retry.outcome is Outcome.DISRUPTION_REQUIRED and retry.event == EVENT_UNPREPARE_FAILED
    assert "has not returned" in retry.message
