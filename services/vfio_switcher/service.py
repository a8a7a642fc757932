"""The vfio_switcher micro service: one endpoint, `switch`, and a notice after every request.

- `bcd.<n>.vfio_switcher.switch`  SwitchRequest -> SwitchReply, always: a
  refusal is a normal reply with outcome "Refused" and its reason, so the
  caller (the converger, the only user allowed to publish here) reads why.
  A body that does not decode is refused with reason InvalidRequest.
- `bcd.<n>.vfio_switcher.result`  the same SwitchReply, published for every
  request (attempted or refused), for the inventory.

Flow: the address must be canonical and the target known (before any bus
call); the inventory must list a GPU at that address (NotListed; an
inventory that does not answer refuses with InventoryUnknown -- fail closed)
and gives its base driver; then `switch()` asks the converger's holder
endpoint (allocations and pending releases hold a card for any target, a
running domain holds it against a return to the native driver; instance
claims do not hold: the converger asks for those switches itself; no answer
refuses with HolderUnknown), checks the device, switches, verifies and rolls
back. Switches of one card are serialised.

A switch TO vfio-pci needs more than a card nothing holds: the converger's
claims must say the card is claimed for passthrough (the holder endpoint
answers kind `instance`, a VM instance of the spec, or `passthrough-claim`, a
DRA claim with VfioDeviceConfig); a listed card nobody claims so is refused
with NotClaimed (issue 40: whoever reaches this subject cannot hand a card to
vfio-pci on its own word). A switch back to the native driver and `reset`
keep their rules.

Target `reset` is the sibling operation (`bcd gpu reset`, asked by the
converger once it has claimed the card for it): the same checks, every claim
kind holds against it (a VM's too), then the kernel's PCI function reset
(`<device>/reset`); NotResettable when the kernel offers none.

Backends: `sysfs` (real files under --sysfs-root) or `fake` (the fake host
file, services/vfio_switcher/fakehost.py). The boot id stamped on each reply
comes from --proc-root, or from the fake host file with the fake backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import Counter, Histogram

from shared.host import HostFactError, read_boot_id
from shared.runtime import Option, ServiceApp, ServiceContext, StartupError, call, main_for
from shared.schemas import (
    HOLDER_REPLY_CODEC,
    INVENTORY_CODEC,
    SWITCH_REPLY_CODEC,
    SWITCH_REQUEST_CODEC,
    BadMessage,
    Empty,
    HolderQuery,
    HolderReply,
    SwitchReply,
    SwitchRequest,
)
from shared.schemas.bus import PASSTHROUGH_CLAIM

from .driver import DEFAULT_SYSFS_ROOT, VFIO_DRIVER, DriverPort, SysfsDriver, is_canonical_pci
from .fakehost import FakeHostDriver, FakeHostError
from .switch import RESET, TARGETS, Outcome, SwitchResult, reset, switch

#: how long one inventory or holder request may take (the node bus is local).
BUS_TIMEOUT_S = 3.0
#: claim kinds that hold a card whatever the target; "domain" holds it only against "native".
HOLDING_KINDS = ("allocation", "release")
DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# SwitchReply's field bounds (shared/schemas/bus.py): a reply must decode at the caller.
_PCI_MAX, _TARGET_MAX, _NAME_MAX, _TEXT_MAX = 128, 32, 256, 4096


def _clip(value: str | None, limit: int) -> str:
    value = value or ""
    return value if len(value) <= limit else value[: limit - 1] + "…"


def to_reply(result: SwitchResult, *, why: str, boot_id: str, at: datetime) -> SwitchReply:
    return SwitchReply(
        pci=_clip(result.pci, _PCI_MAX),
        target=_clip(result.target, _TARGET_MAX),
        outcome=str(result.outcome),
        reason=_clip(result.reason, _NAME_MAX),
        message=_clip(result.message, _TEXT_MAX),
        event=result.event or "",
        driver=_clip(result.driver, _NAME_MAX),
        rolled_back=result.rolled_back,
        holder=_clip(result.holder, _NAME_MAX),
        boot_id=_clip(boot_id, _NAME_MAX),
        why=_clip(why, _NAME_MAX),
        at=at,
    )


def refused(pci: str, target: str, reason: str, message: str) -> SwitchResult:
    return SwitchResult(pci=pci, target=target, outcome=Outcome.REFUSED, reason=reason, message=message)


class VfioSwitcherApp(ServiceApp):
    name = "vfio_switcher"
    description = "switches one listed GPU between its native driver and vfio-pci"

    def __init__(self) -> None:
        self.port: DriverPort | None = None
        self.ctx: ServiceContext | None = None
        self._locks: dict[str, list] = {}  # pci -> [lock, users]
        self._switches: Counter | None = None
        self._duration: Histogram | None = None
        self._disruptions: Counter | None = None

    def options(self) -> list[Option]:
        return [
            Option("--backend", "driver binding backend: sysfs (the real files) or fake (the fake host file)", default="sysfs", choices=("sysfs", "fake")),
            Option("--sysfs-root", "root of sysfs (sysfs backend)", default=DEFAULT_SYSFS_ROOT, type=Path),
            Option("--fake-host", "fake host description file (fake backend; its boot id too)", type=Path),
            Option("--switch-timeout", "timeout of each unbind, driver_override, bind write, seconds", default=30.0, type=float),
            Option("--proc-root", "root of /proc (boot id)", default=Path("/proc"), type=Path),
        ]

    async def setup(self, ctx: ServiceContext) -> None:
        o = ctx.opts
        if not o.switch_timeout > 0:
            raise StartupError("--switch-timeout must be a positive number of seconds")
        if o.backend == "fake":
            if o.fake_host is None:
                raise StartupError("--backend fake needs --fake-host FILE (or BCD_FAKE_HOST)")
            try:
                self.port = FakeHostDriver(o.fake_host)
            except FakeHostError as exc:
                raise StartupError(str(exc)) from None
        else:
            self.port = SysfsDriver(o.sysfs_root)
            if not (Path(o.sysfs_root) / "bus" / "pci" / "devices").is_dir():
                ctx.log.warning("no PCI bus under the sysfs root; every switch will be refused", sysfs_root=str(o.sysfs_root))
        self.ctx = ctx
        reg = ctx.registry
        self._switches = Counter("bcd_vfio_switches", "Switch requests by target and outcome", ["target", "outcome"], registry=reg)
        self._duration = Histogram(
            "bcd_vfio_switch_duration_seconds", "Time to answer a switch request", ["target"], registry=reg, buckets=DURATION_BUCKETS
        )
        self._disruptions = Counter("bcd_vfio_disruptions", "Switches that left a card needing a node reboot", registry=reg)
        # every series from the start, so rate() and increase() see the first switch
        for target in (*TARGETS, RESET):
            self._duration.labels(target=target)
            for outcome in Outcome:
                self._switches.labels(target=target, outcome=outcome.value)
        ctx.metadata.update(
            {
                "backend": o.backend,
                "root": str(o.fake_host if o.backend == "fake" else o.sysfs_root),
                "switch_timeout_s": f"{o.switch_timeout:g}",
            }
        )
        # raw bytes in: even a body that does not decode gets a SwitchReply
        await ctx.endpoint("switch", ctx.subjects.vfio_switch, self.handle, None, reply=SWITCH_REPLY_CODEC)

    # ------------------------------------------------------------------ the endpoint

    async def handle(self, data: bytes) -> SwitchReply:
        ctx = self.ctx
        assert ctx is not None
        started = time.perf_counter()
        req: SwitchRequest | None = None
        try:
            try:
                req = SWITCH_REQUEST_CODEC.decode(data)
            except BadMessage as exc:
                result = refused("", "", "InvalidRequest", f"refused: the request does not decode: {exc}")
            else:
                result = await self.switch(req)
        except Exception as exc:  # noqa: BLE001 - the caller always gets a reply
            ctx.log.exception("switch stopped on an unexpected error")
            pci, target = (req.pci, req.target) if req is not None else ("", "")
            result = SwitchResult(
                pci=pci, target=target, outcome=Outcome.FAILED, reason="InternalError",
                message=f"switch of {pci!r} to {target!r} stopped on an unexpected error ({type(exc).__name__}: {exc}); "
                "the card's driver was not verified",
            )
        why = req.why if req is not None else ""
        reply = to_reply(result, why=why, boot_id=self.boot_id(), at=datetime.now(UTC))
        await self.report(reply, time.perf_counter() - started)
        return reply

    async def switch(self, req: SwitchRequest) -> SwitchResult:
        ctx, port = self.ctx, self.port
        assert ctx is not None and port is not None
        timeout = ctx.opts.switch_timeout
        pci, target = req.pci, req.target
        if target == RESET and not is_canonical_pci(pci):
            return await reset(port, pci, timeout=timeout, held_by=_never_asked)
        if target != RESET and (not is_canonical_pci(pci) or target not in TARGETS):
            # switch() refuses these itself before it asks or touches anything
            return await switch(port, pci, target, base_driver="nvidia", timeout=timeout, held_by=_never_asked)  # type: ignore[arg-type]

        async with self._card(pci):
            try:
                inv = await call(ctx.nc, ctx.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=BUS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - fail closed, say why
                return refused(pci, target, "InventoryUnknown", f"refused {pci}: the inventory could not tell whether it is a GPU of this node: {_why(exc)}")
            gpu = next((g for g in inv.gpus if g.pci_address == pci), None)
            if gpu is None:
                return refused(pci, target, "NotListed", f"refused {pci}: the inventory lists no GPU at that address")

            async def ask(card: str) -> HolderReply:
                try:
                    return await call(ctx.nc, ctx.subjects.converger_holder, HolderQuery(gpu=card), HOLDER_REPLY_CODEC, timeout=BUS_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - switch() refuses with HolderUnknown
                    raise RuntimeError(f"the converger's holder check failed ({_why(exc)})") from None

            async def held_by(card: str) -> str | None:
                answer = await ask(card)
                return holder_of(answer.held, answer.kind, answer.holder, target)

            if target == RESET:
                return await reset(port, pci, timeout=timeout, held_by=held_by)
            if target == VFIO_DRIVER:
                # the claim first: one answer says both whether the card is held and what claims it
                try:
                    answer = await ask(pci)
                except RuntimeError as exc:
                    return refused(pci, target, "HolderUnknown", f"refused {pci}: whether anything holds it could not be established: {exc}")
                if holder_of(answer.held, answer.kind, answer.holder, target) is None and not passthrough_claimed(answer.held, answer.kind):
                    said = f"{answer.kind} {answer.holder}".strip() if answer.held else "nothing claims it"
                    return refused(
                        pci, target, "NotClaimed",
                        f"refused {pci}: no VM instance of the spec and no DRA claim passes it through ({said}); "
                        "a card goes to vfio-pci only for one",
                    )  # fmt: skip

                # switch() checks the holder from the answer just read: one question, one answer
                return await switch(port, pci, target, base_driver=gpu.base_driver, timeout=timeout, held_by=_answered(answer, target))  # type: ignore[arg-type]
            return await switch(port, pci, target, base_driver=gpu.base_driver, timeout=timeout, held_by=held_by)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the rest

    @contextlib.asynccontextmanager
    async def _card(self, pci: str) -> AsyncIterator[None]:
        """One switch of a card at a time; the lock is dropped when nobody waits for it."""
        entry = self._locks.setdefault(pci, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[pci]

    def boot_id(self) -> str:
        ctx = self.ctx
        assert ctx is not None
        o = ctx.opts
        try:
            return read_boot_id(o.proc_root, o.fake_host if o.backend == "fake" else None)
        except HostFactError as exc:
            ctx.log.warning("boot id unreadable; the reply carries none", error=str(exc))
            return ""

    async def report(self, reply: SwitchReply, elapsed: float) -> None:
        ctx = self.ctx
        assert ctx is not None and self._switches is not None and self._duration is not None and self._disruptions is not None
        target = reply.target if reply.target in TARGETS else "invalid"
        self._switches.labels(target=target, outcome=reply.outcome).inc()
        self._duration.labels(target=target).observe(elapsed)
        fields = {
            "pci": reply.pci, "target": reply.target, "outcome": reply.outcome, "reason": reply.reason,
            "message": reply.message, "event": reply.event, "driver": reply.driver, "rolled_back": reply.rolled_back,
            "holder": reply.holder, "why": reply.why, "boot_id": reply.boot_id, "seconds": round(elapsed, 3),
        }
        if reply.outcome == Outcome.DISRUPTION_REQUIRED:
            self._disruptions.inc()
            ctx.log.error("switch failed; the node needs a reboot", **fields)
        elif reply.outcome == Outcome.FAILED:
            ctx.log.warning("switch failed", **fields)
        elif reply.outcome == Outcome.REFUSED:
            ctx.log.info("switch refused", **fields)
        else:
            ctx.log.info("switched" if reply.outcome == Outcome.SUCCEEDED else "already on the target", **fields)
        try:
            await ctx.nc.publish(ctx.subjects.vfio_result, SWITCH_REPLY_CODEC.encode_valid(reply))
        except Exception as exc:  # noqa: BLE001 - the reply still goes out
            ctx.log.warning("result notice not published", pci=reply.pci, error=_why(exc))


def passthrough_claimed(held: bool, kind: str) -> bool:
    """Whether the converger's HolderReply says the card is claimed for passthrough: a VM
    instance of the spec names it, or a DRA claim passes it through (VfioDeviceConfig)."""
    return held and kind in ("instance", PASSTHROUGH_CLAIM)


def holder_of(held: bool, kind: str, holder: str, target: str) -> str | None:
    """Who holds the card against this switch, from the converger's HolderReply; None: nothing does.

    Allocations (live holds, bind intents) and pending Kubernetes releases hold
    it for any target; a running domain holds it against a return to the
    native driver; an instance claim, and a DRA claim that passes the card
    through, do not hold (the converger asks for those switches itself). A
    held answer of an unknown kind holds (fail closed).
    """
    if not held:
        return None
    if target == RESET:
        # a reset under anything that uses the card (a VM's too) is never safe
        return f"{kind or 'unknown'} {holder}".strip()
    if kind in ("instance", PASSTHROUGH_CLAIM) or (kind == "domain" and target != "native"):
        return None
    return f"{kind or 'unknown'} {holder}".strip()


def _answered(answer: HolderReply, target: str) -> Callable[[str], Awaitable[str | None]]:
    async def held_by(card: str) -> str | None:
        return holder_of(answer.held, answer.kind, answer.holder, target)

    return held_by


async def _never_asked(pci: str) -> str | None:
    raise AssertionError("switch() asks for the holder only of a canonical address and a known target")


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


main = main_for(VfioSwitcherApp)

__all__ = ["VfioSwitcherApp", "holder_of", "passthrough_claimed", "to_reply", "main"]
