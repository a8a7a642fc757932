"""Driver binding of one PCI device: the port the VFIO switch drives, and its two backends.

`DriverPort` is everything the switch may do to a device: read its driver,
class and driver_override, and write unbind, driver_override, bind and
drivers_probe. `SysfsDriver` does it through the real files under a sysfs root
(a fake tree in tests); `FakeDriver` is an in-memory model of what the kernel
does with those writes, with each failure the switch must survive injectable:
an unbind that fails or hangs (leaving the device unbound or still bound), a
bind that fails, a device that vanishes. (`services/vfio_switcher/fakehost.py`
plays the same model and faults over the fake host description file.)

Reads are plain calls (sysfs reads of these attributes take no device lock);
every write is a coroutine with a timeout, because a write can block in the
kernel for ever (a driver's remove() hanging under the device lock) and the
service must time it out and report instead of hanging with it.

Errors: `DriverError` (the write failed), `DriverTimeout` (it did not return in
time; it may still complete later), `DriverBusy` (an earlier write to the same
device has not returned, so a new one would only queue behind the device lock)
and `DeviceVanished` (the device is no longer on the bus). A PCI address or
driver name that is not canonical is a ValueError before any path is built.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

DEFAULT_SYSFS_ROOT = Path("/sys")

#: the driver passthrough binds to.
VFIO_DRIVER = "vfio-pci"
#: display controller classes a GPU may report: VGA (0x0300) and 3D (0x0302).
GPU_PCI_CLASS_PREFIXES = ("0x0300", "0x0302")

# Exactly sysfs' own spelling. Matched with fullmatch: `$` would also accept a
# trailing newline, and "0000:3b:00.0\n" must not reach a path.
_PCI_RE = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
# A kernel driver name as it appears under bus/pci/drivers: no "/" and no
# leading dot, so it can never climb out of that directory.
_DRIVER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")

UnbindHang = Literal["unbound", "bound"]
WriteOp = Literal["unbind", "set_driver_override", "bind", "drivers_probe", "reset"]


def is_canonical_pci(pci: object) -> bool:
    """True for a PCI address spelled as sysfs does ("0000:3b:00.0"), nothing else."""
    return isinstance(pci, str) and _PCI_RE.fullmatch(pci) is not None


def is_driver_name(name: object) -> bool:
    return isinstance(name, str) and _DRIVER_RE.fullmatch(name) is not None


def _check_pci(pci: str) -> None:
    if not is_canonical_pci(pci):
        raise ValueError(f"not a canonical PCI address: {pci!r}")


def _check_driver(driver: str) -> None:
    if not is_driver_name(driver):
        raise ValueError(f"not a driver name: {driver!r}")


class DriverError(Exception):
    """A driver-binding write on `pci` failed; the message says which and why."""

    def __init__(self, pci: str, message: str) -> None:
        super().__init__(message)
        self.pci = pci


class DriverTimeout(DriverError):
    """The write did not return in time. It may still be running in the kernel."""


class DriverBusy(DriverError):
    """An earlier write to the device has not returned; a new one would queue behind it."""


class NotResettable(DriverError):
    """The kernel offers no function reset for the device (no `reset` attribute in sysfs)."""


class DeviceVanished(DriverError):
    """The device is no longer on the PCI bus."""


@runtime_checkable
class DriverPort(Protocol):
    """What the VFIO switch may read and write about one PCI device."""

    def exists(self, pci: str) -> bool: ...

    def is_gpu(self, pci: str) -> bool:
        """PCI class 0x0300xx (VGA) or 0x0302xx (3D)."""
        ...

    def current_driver(self, pci: str) -> str | None:
        """The driver bound now; None when none is (or the device is gone)."""
        ...

    def driver_override(self, pci: str) -> str:
        """The driver_override; "" when unset."""
        ...

    async def unbind(self, pci: str, timeout: float) -> None:
        """Unbind from whatever driver holds it; DriverError when none does."""
        ...

    async def set_driver_override(self, pci: str, driver: str, timeout: float) -> None:
        """Set driver_override to `driver`; "" clears it."""
        ...

    async def bind(self, pci: str, driver: str, timeout: float) -> None:
        """Bind to `driver` (which must match: driver_override, when set, is the only match)."""
        ...

    async def drivers_probe(self, pci: str, timeout: float) -> None:
        """Let the kernel pick (the override, else the native driver); silent when nothing binds."""
        ...

    async def reset(self, pci: str, timeout: float) -> None:
        """A PCI function reset (sysfs `reset`); NotResettable when the kernel offers none."""
        ...


# --------------------------------------------------------------------------- sysfs


class SysfsDriver:
    """DriverPort over the real sysfs files under `sysfs_root`.

    Each write runs in its own daemon thread: a write stuck in the kernel
    cannot be interrupted, so it must not occupy the loop's shared executor
    (nor keep the interpreter from exiting). The coroutine stops waiting at
    the timeout; the device stays marked as having a pending write until the
    thread returns, and writes to it are refused (DriverBusy) meanwhile.
    """

    def __init__(self, sysfs_root: Path | str = DEFAULT_SYSFS_ROOT) -> None:
        self.root = Path(sysfs_root)
        self._lock = threading.Lock()
        self._pending: dict[str, str] = {}

    # ----------------------------------------------------------------- paths

    def device_dir(self, pci: str) -> Path:
        _check_pci(pci)
        return self.root / "bus" / "pci" / "devices" / pci

    def driver_dir(self, driver: str) -> Path:
        _check_driver(driver)
        return self.root / "bus" / "pci" / "drivers" / driver

    # ----------------------------------------------------------------- reads

    def exists(self, pci: str) -> bool:
        return self.device_dir(pci).is_dir()

    def is_gpu(self, pci: str) -> bool:
        text = _read_text(self.device_dir(pci) / "class")
        return (text or "").strip().lower().startswith(GPU_PCI_CLASS_PREFIXES)

    def current_driver(self, pci: str) -> str | None:
        try:
            return os.path.basename(os.readlink(self.device_dir(pci) / "driver")) or None
        except OSError:
            return None

    def driver_override(self, pci: str) -> str:
        value = (_read_text(self.device_dir(pci) / "driver_override") or "").strip()
        # the kernel shows an unset override as "(null)"
        return "" if value == "(null)" else value

    def pending_writes(self) -> dict[str, str]:
        """Devices with a write that timed out and has not returned yet: pci -> operation."""
        with self._lock:
            return dict(self._pending)

    # ----------------------------------------------------------------- writes

    async def unbind(self, pci: str, timeout: float) -> None:
        # Through the device's own driver link: it names whatever driver holds
        # the device, and exists only while one does.
        path = self.device_dir(pci) / "driver" / "unbind"
        self._require_device(pci, "unbind")
        if self.current_driver(pci) is None:
            raise DriverError(pci, f"unbind of {pci}: it is not bound to any driver")
        await self._write(pci, path, pci, timeout, "unbind")

    async def set_driver_override(self, pci: str, driver: str, timeout: float) -> None:
        if driver:
            _check_driver(driver)
        path = self.device_dir(pci) / "driver_override"
        self._require_device(pci, "set_driver_override")
        # the kernel clears the override on a lone newline (an empty write never reaches it)
        await self._write(pci, path, driver or "\n", timeout, f"setting driver_override={driver!r}")

    async def bind(self, pci: str, driver: str, timeout: float) -> None:
        path = self.driver_dir(driver) / "bind"
        self._require_device(pci, "bind")
        if not path.parent.is_dir():
            raise DriverError(pci, f"bind of {pci} to {driver}: driver {driver} is not loaded (no {path.parent})")
        await self._write(pci, path, pci, timeout, f"bind to {driver}")

    async def drivers_probe(self, pci: str, timeout: float) -> None:
        _check_pci(pci)
        self._require_device(pci, "drivers_probe")
        await self._write(pci, self.root / "bus" / "pci" / "drivers_probe", pci, timeout, "drivers_probe")

    async def reset(self, pci: str, timeout: float) -> None:
        _check_pci(pci)
        self._require_device(pci, "reset")
        path = self.device_dir(pci) / "reset"
        # the kernel makes the attribute only where some reset method works (FLR, PM, bus)
        if not path.is_file():
            raise NotResettable(pci, f"reset of {pci}: the kernel offers no function reset for it (no {path})")
        await self._write(pci, path, "1", timeout, "reset")

    def _write_file(self, path: Path, data: str) -> None:
        """The one blocking write, run in the worker thread (tests subclass it to emulate the kernel)."""
        # No O_CREAT: a missing attribute is an error, never a new file.
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)

    def _require_device(self, pci: str, what: str) -> None:
        if not self.exists(pci):
            raise DeviceVanished(pci, f"{what} of {pci}: the device is not on the PCI bus")

    async def _write(self, pci: str, path: Path, data: str, timeout: float, what: str) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout!r}")
        with self._lock:
            earlier = self._pending.get(pci)
            if earlier is not None:
                raise DriverBusy(pci, f"{what} of {pci} refused: an earlier {earlier} has not returned (device lock held)")
            self._pending[pci] = what
        loop = asyncio.get_running_loop()
        done: asyncio.Future[BaseException | None] = loop.create_future()

        def settle(outcome: BaseException | None) -> None:
            if not done.done():  # cancelled when the waiter timed out
                done.set_result(outcome)

        def worker() -> None:
            outcome: BaseException | None = None
            try:
                self._write_file(path, data)
            except Exception as exc:  # delivered to the waiter, never lost in the thread
                outcome = exc
            finally:
                with self._lock:
                    self._pending.pop(pci, None)
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for this write any more

        try:
            threading.Thread(target=worker, name=f"bcd-sysfs-write {pci} {what}", daemon=True).start()
        except BaseException:
            with self._lock:
                self._pending.pop(pci, None)
            raise
        try:
            # The exception travels as the future's result, so a write that
            # itself fails with ETIMEDOUT is not mistaken for our timeout.
            outcome = await asyncio.wait_for(done, timeout)
        except TimeoutError:
            raise DriverTimeout(pci, f"{what} of {pci} did not return within {timeout:g}s (it may still complete)") from None
        if outcome is None:
            return
        if not self.exists(pci):
            raise DeviceVanished(pci, f"{what} of {pci}: the device disappeared from the PCI bus") from outcome
        reason = outcome.strerror if isinstance(outcome, OSError) and outcome.strerror else repr(outcome)
        raise DriverError(pci, f"{what} of {pci} failed: {reason}") from outcome


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- fake


@dataclass
class FakeDevice:
    """A device as the fake kernel sees it."""

    pci_class: str = "0x030200"
    #: the driver whose id table matches the device (what probing picks without an override)
    native_driver: str = "nvidia"
    driver: str | None = None
    driver_override: str = ""


class FakeDriver:
    """DriverPort over an in-memory model of the kernel's driver core, with failure injection.

    The model: unbind clears the driver; a driver matches a device when it is
    the driver_override, or, with no override, the device's native driver;
    bind fails on an unloaded driver, a bound device or no match; drivers_probe
    binds an unbound device to the override or the native driver and reports
    nothing when that does not work. Every call is recorded in `calls`.
    """

    def __init__(self, devices: dict[str, FakeDevice] | None = None, *, drivers: tuple[str, ...] = ("nvidia", VFIO_DRIVER)) -> None:
        self.devices: dict[str, FakeDevice] = dict(devices or {})
        self.loaded: set[str] = set(drivers)
        self.calls: list[tuple[str, ...]] = []
        self._fail_bind: set[tuple[str, str]] = set()
        self._fail_unbind: set[str] = set()
        self._hang_unbind: dict[str, UnbindHang] = {}
        self._vanish_at: dict[str, str] = {}
        self._pending: dict[str, str] = {}
        self._fail_reset: set[str] = set()
        self._no_reset: set[str] = set()
        #: pci -> function resets done
        self.resets: dict[str, int] = {}

    # ----------------------------------------------------------------- setup and faults

    def add(self, pci: str, **fields: object) -> FakeDevice:
        _check_pci(pci)
        device = FakeDevice(**fields)  # type: ignore[arg-type]
        self.devices[pci] = device
        return device

    def fail_bind(self, pci: str, driver: str) -> None:
        """Every bind (or probe) of `pci` to `driver` fails, as a failing probe() does."""
        self._fail_bind.add((pci, driver))

    def fail_unbind(self, pci: str) -> None:
        """The next unbind of `pci` fails (the write returns an error); the driver stays bound."""
        self._fail_unbind.add(pci)

    def hang_unbind(self, pci: str, *, leave: UnbindHang) -> None:
        """The next unbind of `pci` hangs past its timeout, leaving it `leave`; it never returns until `release`."""
        self._hang_unbind[pci] = leave

    def vanish_at(self, pci: str, op: WriteOp) -> None:
        """The device drops off the bus when `op` is next attempted on it."""
        self._vanish_at[pci] = op

    def fail_reset(self, pci: str) -> None:
        """The next reset of `pci` fails (the write returns an error)."""
        self._fail_reset.add(pci)

    def not_resettable(self, pci: str) -> None:
        """The kernel offers no reset for `pci`."""
        self._no_reset.add(pci)

    def release(self, pci: str) -> None:
        """The hung write on `pci` finally returns."""
        self._pending.pop(pci, None)

    def pending_writes(self) -> dict[str, str]:
        return dict(self._pending)

    # ----------------------------------------------------------------- reads

    def exists(self, pci: str) -> bool:
        return self._read("exists", pci) is not None

    def is_gpu(self, pci: str) -> bool:
        device = self._read("is_gpu", pci)
        return device is not None and device.pci_class.lower().startswith(GPU_PCI_CLASS_PREFIXES)

    def current_driver(self, pci: str) -> str | None:
        device = self._read("current_driver", pci)
        return device.driver if device is not None else None

    def driver_override(self, pci: str) -> str:
        device = self._read("driver_override", pci)
        return device.driver_override if device is not None else ""

    # ----------------------------------------------------------------- writes

    async def unbind(self, pci: str, timeout: float) -> None:
        device = await self._enter("unbind", pci, timeout)
        if device.driver is None:
            raise DriverError(pci, f"unbind of {pci}: it is not bound to any driver")
        if pci in self._fail_unbind:
            self._fail_unbind.discard(pci)
            raise DriverError(pci, f"unbind of {pci} from {device.driver} failed: the driver refused to let go")
        leave = self._hang_unbind.pop(pci, None)
        if leave is not None:
            if leave == "unbound":
                device.driver = None
            self._pending[pci] = "unbind"
            await asyncio.sleep(timeout)
            raise DriverTimeout(pci, f"unbind of {pci} did not return within {timeout:g}s (it may still complete)")
        device.driver = None

    async def set_driver_override(self, pci: str, driver: str, timeout: float) -> None:
        if driver:
            _check_driver(driver)
        device = await self._enter("set_driver_override", pci, timeout, driver)
        device.driver_override = driver

    async def bind(self, pci: str, driver: str, timeout: float) -> None:
        _check_driver(driver)
        device = await self._enter("bind", pci, timeout, driver)
        if driver not in self.loaded:
            raise DriverError(pci, f"bind of {pci} to {driver}: driver {driver} is not loaded")
        if device.driver is not None:
            raise DriverError(pci, f"bind of {pci} to {driver} failed: already bound to {device.driver}")
        if not self._matches(device, driver):
            raise DriverError(pci, f"bind of {pci} to {driver} failed: no match (driver_override={device.driver_override!r})")
        if (pci, driver) in self._fail_bind:
            raise DriverError(pci, f"bind of {pci} to {driver} failed: probe returned an error")
        device.driver = driver

    async def drivers_probe(self, pci: str, timeout: float) -> None:
        device = await self._enter("drivers_probe", pci, timeout)
        if device.driver is not None:
            return
        candidate = device.driver_override or device.native_driver
        if candidate in self.loaded and (pci, candidate) not in self._fail_bind:
            device.driver = candidate

    async def reset(self, pci: str, timeout: float) -> None:
        await self._enter("reset", pci, timeout)
        if pci in self._no_reset:
            raise NotResettable(pci, f"reset of {pci}: the kernel offers no function reset for it")
        if pci in self._fail_reset:
            self._fail_reset.discard(pci)
            raise DriverError(pci, f"reset of {pci} failed: the device did not come back from the reset")
        self.resets[pci] = self.resets.get(pci, 0) + 1

    # ----------------------------------------------------------------- model

    @staticmethod
    def _matches(device: FakeDevice, driver: str) -> bool:
        return driver == (device.driver_override or device.native_driver)

    def _read(self, op: str, pci: str) -> FakeDevice | None:
        _check_pci(pci)
        self.calls.append((op, pci))
        return self.devices.get(pci)

    async def _enter(self, op: str, pci: str, timeout: float, *args: str) -> FakeDevice:
        _check_pci(pci)
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout!r}")
        self.calls.append((op, pci, *args))
        await asyncio.sleep(0)  # a write is a suspension point, as in the sysfs backend
        if self._vanish_at.get(pci) == op:
            del self._vanish_at[pci]
            self.devices.pop(pci, None)
        device = self.devices.get(pci)
        if device is None:
            raise DeviceVanished(pci, f"{op} of {pci}: the device is not on the PCI bus")
        earlier = self._pending.get(pci)
        if earlier is not None:
            raise DriverBusy(pci, f"{op} of {pci} refused: an earlier {earlier} has not returned (device lock held)")
        return device


__all__ = [
    "DEFAULT_SYSFS_ROOT",
    "VFIO_DRIVER",
    "GPU_PCI_CLASS_PREFIXES",
    "is_canonical_pci",
    "is_driver_name",
    "DriverError",
    "DriverTimeout",
    "DriverBusy",
    "DeviceVanished",
    "NotResettable",
    "DriverPort",
    "SysfsDriver",
    "FakeDevice",
    "FakeDriver",
]
