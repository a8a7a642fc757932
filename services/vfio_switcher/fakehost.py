"""`FakeHostDriver`: the DriverPort over the fake host description file.

The same file the inventory's `fakehw` adapter reads (examples/hosts/README.md;
the inventory owns its schema, this module reads only the fields it needs and
keeps every other key as it was). The kernel is modelled as `FakeDriver`
models it, but the state lives in the file, so the inventory's next scan sees
what a switch did:

- a device exists when it is one of `gpus` with `present` true, or one of
  `pci_devices`; GPUs have PCI class 0x030200, `pci_devices` the class they
  declare;
- `driver` ("" = none) and `driver_override` ("" = unset) are the sysfs files;
  a GPU's native driver is its `base_driver`;
- unbind clears the driver; a driver matches when it is the override, or with
  no override the native driver; bind fails on an unloaded driver, a bound
  device or no match; drivers_probe binds an unbound device to the override or
  the native driver and is silent when that does not work. Loaded drivers:
  vfio-pci, every `base_driver` and every driver bound in the file, less
  `unloaded`;
- only GPUs are written: a write to a `pci_devices` entry is a DriverError.

Faults (`gpus[i].faults`) play back and are consumed (cleared in the file)
when they fire: `unbind` "fail" (DriverError, the driver stays), "hang" (the
write never returns: DriverTimeout after the caller's timeout, the driver
stays), "hang-unbound" (the same, but the driver has already let go);
`fail_bind` (one listed driver's bind or probe fails, once); `vanish_at` (the
card drops off the bus when that write is attempted: `present` becomes false).

A hung write holds the device lock, as in the kernel: later writes to that
card fail at once with DriverBusy. For the fake the hang ends when the fake
host reboots (its `boot_id` changes) or `release()` is called; a new process
starts with no hang pending (the fake kernel's memory is this object).

Every write is one transaction under an fcntl lock on a sibling lock file
(`.<name>.lock`): read, apply, write atomically (`shared.fsutil.atomic_write`)
-- so two switches, in one process or two, never lose each other's changes.
The transaction runs in a worker thread; a hang's wait happens outside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec

from shared.fsutil import LockTimeout, atomic_write, exclusive, lock_file_of, read_regular
from shared.host import HOST_FILE_MAX_BYTES
from shared.schemas.codec import bounded_json_loads

from .driver import (
    GPU_PCI_CLASS_PREFIXES,
    VFIO_DRIVER,
    DeviceVanished,
    DriverBusy,
    DriverError,
    DriverTimeout,
    NotResettable,
    WriteOp,
    _check_driver,
    _check_pci,
)

#: the class every `gpus` entry of the host file has (3D controller).
GPU_PCI_CLASS = "0x030200"
#: how long a write waits for another writer's lock on the host file.
LOCK_WAIT_S = 10.0


class FakeHostError(Exception):
    """The fake host file cannot be read or does not decode."""


# --------------------------------------------------------------------------- the file, as far as it concerns us
# Defaults are the inventory's (services/inventory/adapters/fakehost.py HostGpu);
# unknown fields are ignored here, the inventory's own decoder judges them.


class _Faults(msgspec.Struct, kw_only=True):
    unbind: Literal["", "fail", "hang", "hang-unbound"] = ""
    reset: Literal["", "fail", "hang", "unsupported"] = ""
    fail_bind: list[str] = []
    vanish_at: Literal["", "unbind", "set_driver_override", "bind", "drivers_probe", "reset"] = ""


class _Gpu(msgspec.Struct, kw_only=True):
    pci_address: str
    driver: str = "nvidia"
    base_driver: str = "nvidia"
    driver_override: str = ""
    present: bool = True
    faults: _Faults = msgspec.field(default_factory=_Faults)


class _PciDevice(msgspec.Struct, kw_only=True):
    pci_address: str
    pci_class: str = "0x020000"
    driver: str = ""


class _Host(msgspec.Struct, kw_only=True):
    boot_id: str = ""
    gpus: list[_Gpu] = []
    pci_devices: list[_PciDevice] = []


def _decode(path: Path, data: bytes) -> tuple[dict[str, Any], _Host]:
    try:
        doc = bounded_json_loads(data, HOST_FILE_MAX_BYTES, "host file")
    except ValueError as exc:
        raise FakeHostError(f"fake host file {path}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise FakeHostError(f"fake host file {path}: not a JSON object")
    try:
        host = msgspec.convert(doc, _Host)
    except msgspec.ValidationError as exc:
        raise FakeHostError(f"fake host file {path}: {exc}") from None
    return doc, host


class _Device:
    """One device of the file, and where its entry is in the document."""

    def __init__(self, host: _Host, pci: str) -> None:
        self.gpu: _Gpu | None = None
        self.index = -1
        self.other: _PciDevice | None = None
        for i, g in enumerate(host.gpus):
            if g.pci_address == pci:
                self.gpu, self.index = g, i
                return
        for o in host.pci_devices:
            if o.pci_address == pci:
                self.other = o
                return

    @property
    def present(self) -> bool:
        return self.other is not None or (self.gpu is not None and self.gpu.present)

    @property
    def pci_class(self) -> str:
        return self.other.pci_class if self.other is not None else GPU_PCI_CLASS

    @property
    def driver(self) -> str | None:
        d = self.other.driver if self.other is not None else self.gpu.driver if self.gpu is not None else ""
        return d or None


class FakeHostDriver:
    """DriverPort over the fake host file; see the module docstring."""

    def __init__(self, host_file: Path | str, *, unloaded: Iterable[str] = ()) -> None:
        self.host_file = Path(host_file)
        self.lock_file = lock_file_of(self.host_file)
        #: drivers to treat as not loaded (tests: a missing vfio-pci module).
        self.unloaded: set[str] = set(unloaded)
        self._lock = threading.Lock()
        #: pci -> (the write that has not returned, the boot id it hung in)
        self._pending: dict[str, tuple[str, str]] = {}
        self._read()  # a missing or broken file fails here, at start

    # ----------------------------------------------------------------- hangs

    def pending_writes(self) -> dict[str, str]:
        """Cards with a hung write that still holds the device lock: pci -> operation."""
        try:
            boot = self._read()[1].boot_id
        except FakeHostError:
            boot = None
        with self._lock:
            return {pci: op for pci, (op, at) in self._pending.items() if boot is None or at == boot}

    def release(self, pci: str) -> None:
        """The hung write on `pci` finally returns."""
        with self._lock:
            self._pending.pop(pci, None)

    # ----------------------------------------------------------------- reads

    def _read(self) -> tuple[dict[str, Any], _Host]:
        try:
            data = read_regular(self.host_file, max_bytes=HOST_FILE_MAX_BYTES)
        except OSError as exc:
            raise FakeHostError(f"fake host file {self.host_file}: cannot read ({exc.strerror})") from None
        return _decode(self.host_file, data)

    def _device(self, pci: str) -> _Device:
        _check_pci(pci)
        return _Device(self._read()[1], pci)

    def exists(self, pci: str) -> bool:
        return self._device(pci).present

    def is_gpu(self, pci: str) -> bool:
        d = self._device(pci)
        return d.present and d.pci_class.lower().startswith(GPU_PCI_CLASS_PREFIXES)

    def current_driver(self, pci: str) -> str | None:
        d = self._device(pci)
        return d.driver if d.present else None

    def driver_override(self, pci: str) -> str:
        d = self._device(pci)
        return d.gpu.driver_override if d.present and d.gpu is not None else ""

    # ----------------------------------------------------------------- writes

    async def unbind(self, pci: str, timeout: float) -> None:
        await self._write("unbind", pci, timeout)

    async def set_driver_override(self, pci: str, driver: str, timeout: float) -> None:
        if driver:
            _check_driver(driver)
        await self._write("set_driver_override", pci, timeout, driver)

    async def bind(self, pci: str, driver: str, timeout: float) -> None:
        _check_driver(driver)
        await self._write("bind", pci, timeout, driver)

    async def drivers_probe(self, pci: str, timeout: float) -> None:
        await self._write("drivers_probe", pci, timeout)

    async def reset(self, pci: str, timeout: float) -> None:
        await self._write("reset", pci, timeout)

    async def _write(self, op: WriteOp, pci: str, timeout: float, driver: str = "") -> None:
        _check_pci(pci)
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout!r}")
        hung = await asyncio.to_thread(self._transact, op, pci, driver)
        if hung:
            # the write never returns: the caller stops waiting at its timeout
            await asyncio.sleep(timeout)
            raise DriverTimeout(pci, f"{op} of {pci} did not return within {timeout:g}s (it may still complete)")

    # ----------------------------------------------------------------- the fake kernel

    def _transact(self, op: WriteOp, pci: str, driver: str) -> bool:
        """One write, applied to the file under its lock; True when it hangs."""
        with self._file_lock(pci, op):
            try:
                doc, host = self._read()
            except FakeHostError as exc:
                raise DriverError(pci, f"{op} of {pci}: {exc}") from None
            before = json.dumps(doc)
            device = _Device(host, pci)
            gpu = device.gpu
            entry: dict[str, Any] | None = doc["gpus"][device.index] if gpu is not None else None
            try:
                if gpu is not None and entry is not None and gpu.present and gpu.faults.vanish_at == op:
                    _consume(entry, "vanish_at")
                    entry["present"] = False
                    raise DeviceVanished(pci, f"{op} of {pci}: the device is not on the PCI bus")
                if not device.present:
                    raise DeviceVanished(pci, f"{op} of {pci}: the device is not on the PCI bus")
                self._check_busy(op, pci, host.boot_id)
                if gpu is None or entry is None:
                    raise DriverError(pci, f"{op} of {pci}: the fake host models driver writes on its GPUs only")
                return self._apply(op, pci, driver, host, gpu, entry)
            finally:
                # what the write changed lands even when it fails (a consumed fault, a dropped card)
                if json.dumps(doc) != before:
                    self._save(doc, pci, op)

    def _check_busy(self, op: str, pci: str, boot_id: str) -> None:
        with self._lock:
            earlier = self._pending.get(pci)
            if earlier is None:
                return
            if earlier[1] != boot_id:
                del self._pending[pci]  # the host rebooted: the hang is over
                return
        raise DriverBusy(pci, f"{op} of {pci} refused: an earlier {earlier[0]} has not returned (device lock held)")

    def _apply(self, op: WriteOp, pci: str, driver: str, host: _Host, gpu: _Gpu, entry: dict[str, Any]) -> bool:
        current = gpu.driver or None
        if op == "unbind":
            if current is None:
                raise DriverError(pci, f"unbind of {pci}: it is not bound to any driver")
            fault = gpu.faults.unbind
            if fault:
                _consume(entry, "unbind")
            if fault == "fail":
                raise DriverError(pci, f"unbind of {pci} from {current} failed: the driver refused to let go")
            if fault in ("hang", "hang-unbound"):
                if fault == "hang-unbound":
                    entry["driver"] = ""
                with self._lock:
                    self._pending[pci] = ("unbind", host.boot_id)
                return True
            entry["driver"] = ""
        elif op == "set_driver_override":
            entry["driver_override"] = driver
        elif op == "bind":
            if not self._loaded(host, driver):
                raise DriverError(pci, f"bind of {pci} to {driver}: driver {driver} is not loaded")
            if current is not None:
                raise DriverError(pci, f"bind of {pci} to {driver} failed: already bound to {current}")
            if driver != (gpu.driver_override or gpu.base_driver):
                raise DriverError(pci, f"bind of {pci} to {driver} failed: no match (driver_override={gpu.driver_override!r})")
            if driver in gpu.faults.fail_bind:
                _consume(entry, "fail_bind", driver)
                raise DriverError(pci, f"bind of {pci} to {driver} failed: probe returned an error")
            entry["driver"] = driver
        elif op == "reset":
            fault = gpu.faults.reset
            if fault == "unsupported":  # a property of the card, not consumed
                raise NotResettable(pci, f"reset of {pci}: the kernel offers no function reset for it")
            if fault:
                _consume(entry, "reset")
            if fault == "fail":
                raise DriverError(pci, f"reset of {pci} failed: the device did not come back from the reset")
            if fault == "hang":
                with self._lock:
                    self._pending[pci] = ("reset", host.boot_id)
                return True
            entry["resets"] = int(entry.get("resets") or 0) + 1
        elif op == "drivers_probe":
            if current is None:
                candidate = gpu.driver_override or gpu.base_driver
                if candidate in gpu.faults.fail_bind:
                    _consume(entry, "fail_bind", candidate)
                elif candidate and self._loaded(host, candidate):
                    entry["driver"] = candidate
        return False

    def _loaded(self, host: _Host, driver: str) -> bool:
        known = {VFIO_DRIVER}
        known.update(g.base_driver for g in host.gpus)
        known.update(g.driver for g in host.gpus)
        known.update(o.driver for o in host.pci_devices)
        known.discard("")
        return driver in known and driver not in self.unloaded

    def _save(self, doc: dict[str, Any], pci: str, op: str) -> None:
        data = (json.dumps(doc, indent=2) + "\n").encode()
        mode = 0o644
        with contextlib.suppress(OSError):
            mode = os.stat(self.host_file).st_mode & 0o777
        try:
            atomic_write(self.host_file, data, mode)
        except OSError as exc:
            raise DriverError(pci, f"{op} of {pci}: the fake host file could not be written ({exc.strerror})") from None

    @contextlib.contextmanager
    def _file_lock(self, pci: str, op: str) -> Iterator[None]:
        try:
            with exclusive(self.host_file, LOCK_WAIT_S):
                yield
        except LockTimeout:
            raise DriverError(pci, f"{op} of {pci}: the fake host file stayed locked ({self.lock_file})") from None
        except OSError as exc:
            raise DriverError(pci, f"{op} of {pci}: cannot open {self.lock_file} ({exc.strerror})") from None


def _consume(entry: dict[str, Any], fault: str, driver: str = "") -> None:
    """A fault fired: clear it in the file (one driver of `fail_bind`)."""
    faults = entry.get("faults")
    if not isinstance(faults, dict):
        return
    if fault == "fail_bind":
        drivers = list(faults.get("fail_bind", []))
        if driver in drivers:
            drivers.remove(driver)
        faults["fail_bind"] = drivers
    else:
        faults[fault] = ""


__all__ = ["FakeHostDriver", "FakeHostError", "GPU_PCI_CLASS", "LOCK_WAIT_S"]
