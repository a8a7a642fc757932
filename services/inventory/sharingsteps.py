"""GPU sharing steps for DRA (`sharing`): an MPS control daemon started, stopped or listed under `--mps-root`, or a card's time slice set.

The converger journaled the step before asking. Every refusal is an answer
(outcome refused / not-supported), never an error: a step that lacks what
it needs, a time slice for a card the inventory does not list whole on its
compute driver, an MPS daemon for devices that are not a listed card's (or
its MIG devices') on their compute driver, named once, with pinned memory
only for the devices it serves. MPS steps run one at a time (a list sees no
start half done); a time slice under its card's lock (the one MIG changes
take). No rescan follows: nothing the inventory lists changes. The daemon's
directories are `<mps-root>/<control>/pipe`, `.../log` and `.../shm`
(adapters.base.mps_dirs, built only from a control id).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.schemas import Gpu, SharingStepReply, SharingStepRequest
from shared.schemas.bus import MPS_LIST_MAX
from shared.schemas.common import clip

from .adapters.base import GpuSharer, SharingStepError, mps_dirs
from .facts import InventoryFacts
from .jobs import in_daemon_thread


def control_of(req: SharingStepRequest) -> str:
    """The MPS control id a step is about ("" for none)."""
    return req.mps.control if req.step == "mps-start" and req.mps is not None else req.control


def sharing_missing(req: SharingStepRequest) -> str:
    """A sharing step that lacks what it needs, named ("" when nothing)."""
    needs = {"mps-start": ("mps", req.mps is not None), "mps-stop": ("control", bool(req.control)), "timeslice-set": ("pci", req.pci is not None)}
    field, given = needs.get(req.step, ("", True))
    return "" if given else f"{req.step} needs {field}"


def mps_devices_refusal(uuids: list[str], pinned: dict[str, int], cards: Iterable[Gpu]) -> str:
    """Why an MPS daemon may not serve these devices ("" when it may): each must be a listed card's
    uuid (a card not in MIG mode) or one of its MIG devices', on its compute driver, named once."""
    devices: dict[str, Gpu] = {}
    whole: dict[str, Gpu] = {}
    for card in cards:
        whole[card.uuid] = card
        devices.update({m.uuid: card for m in card.mig_instances if m.uuid})
    for uuid in uuids:
        card = devices.get(uuid) or whole.get(uuid)
        if not uuid or card is None:
            return f"the inventory lists no GPU or MIG device {uuid}"
        if uuid in whole and card.mig_mode:
            return f"{uuid} ({card.pci_address}) is in MIG mode: an MPS daemon serves its MIG devices, not the card"
        if card.status.driver_binding.mode != "Compute":
            return f"{card.pci_address} is not on its compute driver ({card.driver or 'no driver'})"
    if len(set(uuids)) != len(uuids):
        return "an MPS daemon serves each device once: a uuid is named twice"
    strays = sorted(set(pinned) - set(uuids))
    if strays:
        return f"a pinned memory limit is for a device the daemon does not serve: {', '.join(strays)}"
    return ""


def listed_message(controls: list[str], root: Path) -> str:
    if len(controls) > MPS_LIST_MAX:
        return f"{len(controls)} MPS daemon(s) under {root}; the first {MPS_LIST_MAX} are listed"
    return f"{len(controls)} MPS daemon(s) under {root}"


class SharingSteps:
    def __init__(self, facts: InventoryFacts, *, mps_root: Path, adapter_name: str, log: Any) -> None:
        self.facts = facts
        self.mps_root = mps_root
        self.adapter_name = adapter_name
        self.log = log
        #: every MPS daemon step runs under this one (a list sees no start half done)
        self.mps_lock = asyncio.Lock()

    async def step(self, req: SharingStepRequest) -> SharingStepReply:
        """One sharing step (DRA; the converger journaled it before asking): an MPS daemon or a time slice.

        Every refusal is an answer (outcome refused / not-supported), never an error. MPS steps run
        one at a time; a time slice under its card's lock (the one MIG changes take).
        """
        log = self.log

        def answer(outcome: str, message: str, controls: list[str] | None = None) -> SharingStepReply:
            (log.info if outcome == "done" else log.warning)(
                "sharing step answered", step=req.step, owner=req.owner, control=control_of(req), pci=req.pci, outcome=outcome, detail=message
            )
            return SharingStepReply(step=req.step, outcome=outcome, message=clip(message), controls=controls or [])

        if not isinstance(self.facts.adapter, GpuSharer):
            return answer("not-supported", f"the {self.adapter_name} adapter shares no GPUs")
        refusal = sharing_missing(req) or self.refusal(req)
        if refusal:
            return answer("refused", refusal)
        log.info(
            "sharing step started", step=req.step, owner=req.owner, control=control_of(req), pci=req.pci,
            uuids=list(req.mps.uuids) if req.mps is not None else [], interval=req.interval if req.step == "timeslice-set" else None,
        )
        lock = self.facts.mig_lock(req.pci) if req.step == "timeslice-set" and req.pci is not None else self.mps_lock
        async with lock:
            return await self._run(req, answer)

    def refusal(self, req: SharingStepRequest) -> str:
        """Why the step is wrong for the cards the inventory lists ("" when it is not)."""
        current = self.facts.current
        cards = {g.pci_address: g for g in current.gpus} if current is not None else {}
        if req.step == "timeslice-set":
            card = cards.get(req.pci or "")
            if card is None:
                return f"the inventory lists no GPU at {req.pci}"
            if card.mig_mode:
                return f"{req.pci} is in MIG mode: time slices are for whole cards"
            if card.status.driver_binding.mode != "Compute" or not card.uuid:
                return f"{req.pci} is not on its compute driver ({card.driver or 'no driver'})"
            return ""
        if req.step == "mps-start" and req.mps is not None:
            return mps_devices_refusal(req.mps.uuids, req.mps.pinned_memory, cards.values())
        return ""

    async def _run(self, req: SharingStepRequest, answer: Any) -> SharingStepReply:
        adapter, root = self.facts.adapter, Path(self.mps_root)
        try:
            if req.step == "mps-list":
                controls = await in_daemon_thread(adapter.mps_list, root)
                return answer("done", listed_message(controls, root), controls[:MPS_LIST_MAX])
            if req.step == "timeslice-set":
                card = next(g for g in self.facts.current.gpus if g.pci_address == req.pci)
                await in_daemon_thread(adapter.set_timeslice, req.pci, card.uuid, req.interval)
                return answer("done", f"time slice of {req.pci} set to {req.interval}")
            control = control_of(req)
            pipe_dir, log_dir = mps_dirs(root, control)
            if req.step == "mps-start":
                await in_daemon_thread(adapter.mps_start, req.mps, pipe_dir, log_dir)
                return answer("done", f"MPS daemon {control} runs for {', '.join(req.mps.uuids)} (pipe directory {pipe_dir})")
            await in_daemon_thread(adapter.mps_stop, control, pipe_dir, log_dir)
            return answer("done", f"MPS daemon {control} stopped, {root / control} removed")
        except SharingStepError as exc:
            return answer(exc.outcome, str(exc))
        except ValueError as exc:  # a control id mps_dirs would not build a path of
            return answer("refused", str(exc))
        except Exception as exc:  # noqa: BLE001 - an adapter bug answers failed; the service stays up
            self.log.exception("sharing step raised", step=req.step)
            return answer("failed", f"{req.step} failed: {exc or type(exc).__name__}")


__all__ = ["SharingSteps", "control_of", "listed_message", "mps_devices_refusal", "sharing_missing"]
