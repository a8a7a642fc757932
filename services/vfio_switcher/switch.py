"""One GPU between its native driver and vfio-pci: checked, switched, verified, rolled back.

`switch(port, pci, target, ...)` is the whole surface. In order:

1. the request itself: a canonical PCI address, a known target, a sane base
   driver and timeout -- refused before any path is touched;
2. the holder (`held_by`, the converger's answer): a GPU a live hold or a
   pending Kubernetes release names is refused with the holder named, and a
   holder that cannot be established refuses too (fail closed);
3. the device: present, and a GPU by PCI class;
4. the current driver: already on the target means nothing is done;
5. the switch: driver_override, unbind, bind, verify -- each write with the
   timeout;
6. on failure, back to the native driver. Where that is impossible (the card
   left with no driver after a failed or hung unbind, or stuck on vfio-pci or
   driverless at release) the result is DisruptionRequired, its message naming
   the PCI address and that a node reboot is needed.

The driver_override is written before the unbind (the order the kernel's
sysfs-bus-pci documentation gives): an unbound device the kernel re-probes
meanwhile (a rescan, a module load) then lands on vfio-pci, not back on the
native driver where a CUDA process could grab it.

A result carries the event the service publishes: VFIOPrepareSucceeded or
VFIOPrepareFailed for a switch to vfio-pci, VFIOUnprepareFailed for a failed
switch back. Refusals and no-ops carry none: nothing was attempted.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from .driver import VFIO_DRIVER, DeviceVanished, DriverError, DriverPort, DriverTimeout, NotResettable, is_canonical_pci, is_driver_name

Target = Literal["vfio-pci", "native"]
TARGETS: tuple[str, ...] = ("vfio-pci", "native")
#: the sibling operation on the same endpoint: a PCI function reset (`bcd gpu reset`).
RESET = "reset"

EVENT_PREPARE_SUCCEEDED = "VFIOPrepareSucceeded"
EVENT_PREPARE_FAILED = "VFIOPrepareFailed"
EVENT_UNPREPARE_FAILED = "VFIOUnprepareFailed"

#: the Reconfiguring condition reason a result with no way back raises.
DISRUPTION_REQUIRED = "DisruptionRequired"

HeldBy = Callable[[str], Awaitable[str | None]]


class Outcome(enum.StrEnum):
    SUCCEEDED = "Succeeded"
    #: already on the target; nothing was written
    UNCHANGED = "Unchanged"
    #: not attempted (bad request, held, not a GPU, absent); nothing was written
    REFUSED = "Refused"
    #: attempted and failed; the card is on a driver (rolled back, or never left it)
    FAILED = "Failed"
    #: attempted and failed with no way back: a node reboot is needed
    DISRUPTION_REQUIRED = DISRUPTION_REQUIRED


@dataclass(frozen=True)
class SwitchResult:
    pci: str
    target: str
    outcome: Outcome
    #: machine-readable cause: InvalidAddress, InvalidRequest, HolderUnknown, Held, NotClaimed (service.py:
    #: vfio-pci for a card no instance or passthrough claim names), NotListed, InventoryUnknown, NoSuchDevice,
    #: NotAGPU, AlreadyOnTarget, Switched, OverrideFailed, UnbindFailed, UnbindTimedOut, BindFailed,
    #: BindTimedOut, VerifyFailed, DeviceVanished
    reason: str
    message: str
    #: the event to publish, or None (refusals, no-ops, a successful release)
    event: str | None = None
    #: the driver seen last (None: none, or not read)
    driver: str | None = None
    #: a failed switch put the card back on the driver it had (or the native one)
    rolled_back: bool = False
    #: who holds the GPU, for reason Held
    holder: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome in (Outcome.SUCCEEDED, Outcome.UNCHANGED)

    @property
    def reconfiguring(self) -> str | None:
        """The Reconfiguring condition reason to raise on the PhysicalGPU, if any."""
        return DISRUPTION_REQUIRED if self.outcome is Outcome.DISRUPTION_REQUIRED else None


async def switch(
    port: DriverPort,
    pci: str,
    target: Target,
    *,
    base_driver: str,
    timeout: float,
    held_by: HeldBy,
) -> SwitchResult:
    """Switch GPU `pci` to vfio-pci or back to `base_driver` ("native"); see the module docstring."""
    # 1. the request, before anything is read or written
    if not is_canonical_pci(pci):
        # repr: the refused input goes into logs and events, newlines and all
        return SwitchResult(
            pci=repr(pci), target=str(target), outcome=Outcome.REFUSED, reason="InvalidAddress",
            message=f"refused: {pci!r} is not a canonical PCI address (like 0000:3b:00.0)",
        )
    if target not in TARGETS:
        return _refused(pci, str(target), "InvalidRequest", f"refused {pci}: target {target!r} is not one of {', '.join(TARGETS)}")
    if not is_driver_name(base_driver) or base_driver == VFIO_DRIVER:
        return _refused(pci, target, "InvalidRequest", f"refused {pci}: {base_driver!r} cannot be the native driver")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        return _refused(pci, target, "InvalidRequest", f"refused {pci}: timeout must be a positive number of seconds, not {timeout!r}")

    # 2. the holder; an answer we cannot get is a refusal, not a guess
    try:
        holder = await held_by(pci)
    except Exception as exc:
        return _refused(pci, target, "HolderUnknown", f"refused {pci}: whether anything holds it could not be established: {exc}")
    if holder:
        return SwitchResult(
            pci=pci, target=target, outcome=Outcome.REFUSED, reason="Held", holder=holder,
            message=f"refused {pci}: it is held by {holder}",
        )

    # 3. the device
    if not port.exists(pci):
        return _refused(pci, target, "NoSuchDevice", f"refused {pci}: no such PCI device")
    if not port.is_gpu(pci):
        return _refused(pci, target, "NotAGPU", f"refused {pci}: the device is not a GPU (PCI class is not 0x0300/0x0302)")

    # 4. the current state
    want = VFIO_DRIVER if target == "vfio-pci" else base_driver
    current = port.current_driver(pci)
    if current == want:
        return SwitchResult(
            pci=pci, target=target, outcome=Outcome.UNCHANGED, reason="AlreadyOnTarget", driver=current,
            message=f"{pci} is already on {want}; nothing to do",
        )

    # 5./6.
    if target == "vfio-pci":
        return await _Switch(port, pci, target, base_driver, timeout, current).prepare()
    return await _Switch(port, pci, target, base_driver, timeout, current).unprepare()


async def reset(port: DriverPort, pci: str, *, timeout: float, held_by: HeldBy) -> SwitchResult:
    """A PCI function reset of GPU `pci`: the same checks as a switch (address, holder, device), then
    the kernel's `reset`. Every holder holds against it: a reset under a workload kills it."""
    if not is_canonical_pci(pci):
        return SwitchResult(
            pci=repr(pci), target=RESET, outcome=Outcome.REFUSED, reason="InvalidAddress",
            message=f"refused: {pci!r} is not a canonical PCI address (like 0000:3b:00.0)",
        )
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        return _refused(pci, RESET, "InvalidRequest", f"refused {pci}: timeout must be a positive number of seconds, not {timeout!r}")
    try:
        holder = await held_by(pci)
    except Exception as exc:
        return _refused(pci, RESET, "HolderUnknown", f"refused {pci}: whether anything holds it could not be established: {exc}")
    if holder:
        return SwitchResult(
            pci=pci, target=RESET, outcome=Outcome.REFUSED, reason="Held", holder=holder,
            message=f"refused {pci}: it is held by {holder}",
        )
    if not port.exists(pci):
        return _refused(pci, RESET, "NoSuchDevice", f"refused {pci}: no such PCI device")
    if not port.is_gpu(pci):
        return _refused(pci, RESET, "NotAGPU", f"refused {pci}: the device is not a GPU (PCI class is not 0x0300/0x0302)")
    driver = port.current_driver(pci)
    try:
        await port.reset(pci, timeout)
    except NotResettable as exc:
        return _refused(pci, RESET, "NotResettable", f"refused {pci}: {exc}")
    except DriverTimeout as exc:
        return SwitchResult(pci=pci, target=RESET, outcome=Outcome.FAILED, reason="ResetTimedOut", driver=driver, message=f"reset of {pci} failed: {exc}")
    except DeviceVanished as exc:
        return SwitchResult(pci=pci, target=RESET, outcome=Outcome.FAILED, reason="DeviceVanished", message=f"reset of {pci} failed: {exc}")
    except DriverError as exc:
        return SwitchResult(pci=pci, target=RESET, outcome=Outcome.FAILED, reason="ResetFailed", driver=driver, message=f"reset of {pci} failed: {exc}")
    return SwitchResult(
        pci=pci, target=RESET, outcome=Outcome.SUCCEEDED, reason="Reset", driver=port.current_driver(pci),
        message=f"{pci} was reset (PCI function reset); driver {port.current_driver(pci) or '(none)'}",
    )


def _refused(pci: str, target: str, reason: str, message: str) -> SwitchResult:
    return SwitchResult(pci=pci, target=target, outcome=Outcome.REFUSED, reason=reason, message=message)


def _kind(exc: DriverError, step: str) -> str:
    """The result reason for a failed step ("Unbind", "Bind", "Override")."""
    return f"{step}TimedOut" if isinstance(exc, DriverTimeout) else f"{step}Failed"


class _Switch:
    """One attempt; holds what the steps share so each failure path reads as one call."""

    def __init__(self, port: DriverPort, pci: str, target: str, base: str, timeout: float, original: str | None) -> None:
        self.port = port
        self.pci = pci
        self.target = target
        self.base = base
        self.timeout = timeout
        self.original = original
        self.event = EVENT_PREPARE_FAILED if target == "vfio-pci" else EVENT_UNPREPARE_FAILED

    # ----------------------------------------------------------------- to vfio-pci

    async def prepare(self) -> SwitchResult:
        port, pci, t = self.port, self.pci, self.timeout
        try:
            await port.set_driver_override(pci, VFIO_DRIVER, t)
        except DeviceVanished as exc:
            return self._vanished("setting driver_override", exc)
        except DriverError as exc:
            return await self._roll_back(_kind(exc, "Override"), f"setting driver_override on {pci} failed: {exc}")

        if self.original is not None:
            try:
                await port.unbind(pci, t)
            except DeviceVanished as exc:
                return self._vanished(f"unbind from {self.original}", exc)
            except DriverError as exc:
                reason = _kind(exc, "Unbind")
                how = "hung" if isinstance(exc, DriverTimeout) else "failed"
                if port.exists(pci) and port.current_driver(pci) is None:
                    # The driver let go but the unbind did not finish cleanly:
                    # the card's state is unknown, and any rebind would queue
                    # behind the same device lock. Only a reboot is safe.
                    return self._disruption(
                        reason, f"unbind of {pci} from {self.original} {how} ({exc}) and left it with no driver"
                    )
                return await self._roll_back(reason, f"unbind of {pci} from {self.original} {how}: {exc}")

        try:
            await port.bind(pci, VFIO_DRIVER, t)
        except DeviceVanished as exc:
            return self._vanished(f"bind to {VFIO_DRIVER}", exc)
        except DriverError as exc:
            return await self._roll_back(_kind(exc, "Bind"), f"bind of {pci} to {VFIO_DRIVER} failed: {exc}")

        now = port.current_driver(pci)
        if now == VFIO_DRIVER:
            return SwitchResult(
                pci=pci, target=self.target, outcome=Outcome.SUCCEEDED, reason="Switched", event=EVENT_PREPARE_SUCCEEDED,
                driver=now, message=f"{pci} switched from {self.original or 'no driver'} to {VFIO_DRIVER}",
            )
        if not port.exists(pci):
            return self._vanished("verification", None)
        return await self._roll_back("VerifyFailed", f"after binding, {pci} is on {now or 'no driver'}, not {VFIO_DRIVER}")

    async def _roll_back(self, reason: str, cause: str) -> SwitchResult:
        """Back to the driver the card had (or the native one); DisruptionRequired where it cannot."""
        port, pci, t = self.port, self.pci, self.timeout
        notes: list[str] = []
        try:
            await port.set_driver_override(pci, "", t)
        except DeviceVanished as exc:
            return self._vanished("rollback", exc, cause)
        except DriverError as exc:
            # A stale override matters at the next probe, and blocks a rebind
            # to the native driver below; say so either way.
            notes.append(f"driver_override could not be cleared ({exc})")
        if not port.exists(pci):
            return self._vanished("rollback", None, cause)
        now = port.current_driver(pci)
        rebound = False
        if now is None:
            try:
                await port.bind(pci, self.base, t)
            except DeviceVanished as exc:
                return self._vanished("rollback", exc, cause)
            except DriverError as exc:
                notes.append(f"rebinding {self.base} failed ({exc})")
            if not port.exists(pci):
                return self._vanished("rollback", None, cause)
            now = port.current_driver(pci)
            rebound = now is not None
        tail = "; ".join(notes)
        if now is not None and now != VFIO_DRIVER:
            # "still on": the driver never let go; "rolled back to": rebound after it had
            back = "rolled back to" if rebound and now == self.base else "still on" if now == self.original else "left on"
            return SwitchResult(
                pci=pci, target=self.target, outcome=Outcome.FAILED, reason=reason, event=self.event, driver=now,
                rolled_back=now in (self.base, self.original),
                message=f"{cause}; {back} {now}" + (f"; {tail}" if tail else ""),
            )
        return self._disruption(reason, f"{cause}; rollback to {self.base} failed" + (f": {tail}" if tail else ""), now)

    # ----------------------------------------------------------------- back to native

    async def unprepare(self) -> SwitchResult:
        """Back to the base driver. There is nothing to roll back to: a failure that leaves the card
        on vfio-pci or driverless needs a reboot."""
        port, pci, t = self.port, self.pci, self.timeout
        try:
            await port.set_driver_override(pci, "", t)
        except DeviceVanished as exc:
            return self._vanished("clearing driver_override", exc)
        except DriverError as exc:
            return self._stuck(_kind(exc, "Override"), f"clearing driver_override on {pci} failed: {exc}")
        if self.original is not None:
            try:
                await port.unbind(pci, t)
            except DeviceVanished as exc:
                return self._vanished(f"unbind from {self.original}", exc)
            except DriverError as exc:
                how = "hung" if isinstance(exc, DriverTimeout) else "failed"
                return self._stuck(_kind(exc, "Unbind"), f"unbind of {pci} from {self.original} {how}: {exc}")
        try:
            await port.bind(pci, self.base, t)
        except DeviceVanished as exc:
            return self._vanished(f"bind to {self.base}", exc)
        except DriverError as exc:
            return self._stuck(_kind(exc, "Bind"), f"bind of {pci} to {self.base} failed: {exc}")
        return self._stuck("VerifyFailed", f"after binding, {pci} is not on {self.base}")

    def _stuck(self, reason: str, cause: str) -> SwitchResult:
        """The end of a release: done if the card is on its base driver after all, else no way back."""
        if not self.port.exists(self.pci):
            return self._vanished("release", None, cause)
        now = self.port.current_driver(self.pci)
        if now == self.base:
            # verification is what counts, not what a write reported
            return SwitchResult(
                pci=self.pci, target=self.target, outcome=Outcome.SUCCEEDED, reason="Switched", driver=now,
                message=f"{self.pci} switched from {self.original or 'no driver'} to {now}",
            )
        if now is not None and now != VFIO_DRIVER:
            # on some third driver: not passthrough, not ours either; the card works, report it
            return SwitchResult(
                pci=self.pci, target=self.target, outcome=Outcome.FAILED, reason=reason, event=self.event, driver=now,
                message=f"{cause}; {self.pci} is on {now}, not {self.base}",
            )
        return self._disruption(reason, f"{cause}; {self.pci} is stuck on {now or 'no driver'} and cannot be returned to {self.base}", now)

    # ----------------------------------------------------------------- endings

    def _disruption(self, reason: str, cause: str, driver: str | None = None) -> SwitchResult:
        return SwitchResult(
            pci=self.pci, target=self.target, outcome=Outcome.DISRUPTION_REQUIRED, reason=reason, event=self.event,
            driver=driver,
            message=f"GPU {self.pci}: {cause}. Rollback is impossible: a node reboot is required to recover GPU {self.pci}.",
        )

    def _vanished(self, during: str, exc: DriverError | None, cause: str | None = None) -> SwitchResult:
        detail = f" ({exc})" if exc is not None else ""
        after = f" after: {cause}" if cause else ""
        return SwitchResult(
            pci=self.pci, target=self.target, outcome=Outcome.FAILED, reason="DeviceVanished", event=self.event,
            message=(
                f"GPU {self.pci} disappeared from the PCI bus during {during}{detail}{after}; "
                "nothing more was done, and it cannot be switched until it is back on the bus"
            ),
        )


__all__ = [
    "Target",
    "TARGETS",
    "EVENT_PREPARE_SUCCEEDED",
    "EVENT_PREPARE_FAILED",
    "EVENT_UNPREPARE_FAILED",
    "DISRUPTION_REQUIRED",
    "HeldBy",
    "RESET",
    "reset",
    "Outcome",
    "SwitchResult",
    "switch",
]
