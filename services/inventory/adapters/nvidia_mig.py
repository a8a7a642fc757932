"""MIG on an NVIDIA card, through NVML: the scan's MIG facts (`MigCapable`), GPU instances made and
destroyed one step at a placement (`MigInstancer`, for DRA), and whole layouts (`MigPartitioner`).

All three name profiles the same way (`profile_name`: NVML's "MIG 1g.18gb" is "1g.18gb") and read
the same NVML lists, so they are one module. A card is found by the last scan (`NvidiaDiscovery`):
a card NVML does not see is refused.

Listing GPU instances may need privileges an unprivileged inventory lacks, while MIG device handles
do not; MIG devices are therefore read from their handles, and GPU instance profiles only name them
(`guess_profile`: by slice count and memory, when the GPU instance list is refused).

MIG instances for DRA are made one step at a time: a GPU instance at a placement NVML lists for its
profile (nvmlDeviceGetGpuInstancePossiblePlacements, then nvmlDeviceCreateGpuInstanceWithPlacement),
then one compute instance spanning it; destroyed in the reverse order. NVML's IN_USE and NOT_FOUND
answers are kept apart from other failures (`step_error`), so the converger knows a busy instance
from a gone one.

A layout (`apply_mig_layout`) destroys every compute and GPU instance, sets MIG mode, then makes one
GPU instance per profile with one full compute instance each; a failure is rolled back to the
layout before, or else to MIG off.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import pynvml

from shared.schemas import MigPlacement, MigProfile

from .base import GpuInstanceFacts, MigInstanceFacts, MigLayoutResult, MigStepError
from .nvidia_discovery import NvidiaDiscovery
from .nvidia_nvml import MIB, NVML_ERRORS, PLACEMENTS_MAX, NvmlGiProfile, NvmlMigDevice, NvmlPort, nvml_code, try_list


def profile_name(nvml_name: str) -> str:
    """A MIG profile's name without NVML's "MIG " prefix."""
    return nvml_name[4:] if nvml_name.startswith("MIG ") else nvml_name


def step_error(what: str, exc: BaseException) -> MigStepError:
    """An NVML failure of a MIG step: IN_USE and NOT_FOUND keep their meaning, the rest failed."""
    code = nvml_code(exc)
    if code == pynvml.NVML_ERROR_IN_USE:
        return MigStepError("in-use", f"{what}: in use ({exc})")
    if code == pynvml.NVML_ERROR_NOT_FOUND:
        return MigStepError("not-found", f"{what}: not found ({exc})")
    return MigStepError("failed", f"{what}: NVML failed ({exc})")


def guess_profile(profiles: Iterable[NvmlGiProfile], dev: NvmlMigDevice) -> NvmlGiProfile | None:
    """The GPU instance profile a MIG device most likely has, when NVML would not list GPU instances."""
    candidates = [p for p in profiles if p.slice_count == dev.gi_slice_count]
    if not candidates:
        return None
    mib = dev.memory_bytes / MIB
    # same slices, nearest memory; the lowest id breaks ties (the plain profile before "+me").
    return min(candidates, key=lambda p: (abs(p.memory_mib - mib), p.profile_id))


class NvidiaMig:
    """MigCapable + MigInstancer + MigPartitioner on NVML, for the cards of the last scan."""

    def __init__(self, nvml: NvmlPort, scan: NvidiaDiscovery) -> None:
        self.nvml = nvml
        self.scan = scan

    # ----------------------------------------------------------------- MigCapable: the scan's MIG facts

    def mig_profiles(self, gpu_uuid: str) -> list[MigProfile]:
        i = self.scan.nvml_index.get(gpu_uuid)
        if i is None:
            return []
        return [
            MigProfile(
                name=profile_name(p.name),
                profile_id=p.profile_id,
                slices=p.slice_count,
                memory_bytes=p.memory_mib * MIB,
                instances_max=p.instance_count,
                placements=self._placements(i, p.profile_id),
                multiprocessors=p.multiprocessors,
                copy_engines=p.copy_engines,
                decoders=p.decoders,
                encoders=p.encoders,
                jpeg_engines=p.jpeg_engines,
                ofa_engines=p.ofa_engines,
            )
            for p in try_list(lambda: self.nvml.gpu_instance_profiles(i))
        ]

    def _placements(self, index: int, profile_id: int) -> list[MigPlacement]:
        # a card not in MIG mode (or a driver that will not say) lists none: DRA then offers none
        found = try_list(lambda: self.nvml.gpu_instance_placements(index, profile_id))
        return [MigPlacement(start=start, size=size) for start, size in sorted(set(found))[:PLACEMENTS_MAX]]

    def mig_instances(self, gpu_uuid: str) -> list[MigInstanceFacts]:
        i = self.scan.nvml_index.get(gpu_uuid)
        if i is None or not self.scan.mig_mode.get(gpu_uuid, False):
            return []
        devices = try_list(lambda: self.nvml.mig_devices(i))
        if not devices:
            return []
        profiles = {p.profile_id: p for p in try_list(lambda: self.nvml.gpu_instance_profiles(i))}
        gis = {g.gi_id: g for g in try_list(lambda: self.nvml.gpu_instances(i))}
        out: list[MigInstanceFacts] = []
        for dev in devices:
            gi = gis.get(dev.gi_id)
            profile = profiles.get(gi.profile_id) if gi is not None else None
            if profile is None:
                profile = guess_profile(profiles.values(), dev)
            name = profile_name(profile.name) if profile is not None else ""
            if name and 0 < dev.ci_slice_count < dev.gi_slice_count:
                name = f"{dev.ci_slice_count}c.{name}"
            out.append(
                MigInstanceFacts(
                    gi=dev.gi_id, ci=dev.ci_id, profile=name, uuid=dev.uuid, memory_bytes=dev.memory_bytes,
                    start=gi.start if gi is not None else None, size=gi.size if gi is not None else None,
                )
            )
        return sorted(out, key=lambda m: (m.gi, m.ci))

    # ----------------------------------------------------------------- MigInstancer: one step at a placement

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceFacts]:
        i = self.scan.nvml_index.get(gpu_uuid)
        if i is None or not self.scan.mig_mode.get(gpu_uuid, False):
            return []
        profiles = {p.profile_id: p for p in try_list(lambda: self.nvml.gpu_instance_profiles(i))}
        devices = try_list(lambda: self.nvml.mig_devices(i))
        cis: dict[int, int] = {}
        for dev in devices:
            cis[dev.gi_id] = cis.get(dev.gi_id, 0) + 1
        try:
            gis = self.nvml.gpu_instances(i)
        except NVML_ERRORS:
            # no privilege to list GPU instances: those with a MIG device are still known, not where they sit
            out: list[GpuInstanceFacts] = []
            for gi_id in sorted(cis):
                dev = next(d for d in devices if d.gi_id == gi_id)
                guess = guess_profile(profiles.values(), dev)
                out.append(
                    GpuInstanceFacts(
                        gi=gi_id, profile=profile_name(guess.name) if guess else "", profile_id=guess.profile_id if guess else None,
                        compute_instances=cis[gi_id],
                    )
                )
            return out
        out = []
        for g in sorted(gis, key=lambda g: g.gi_id):
            profile = profiles.get(g.profile_id)
            out.append(
                GpuInstanceFacts(
                    gi=g.gi_id, profile=profile_name(profile.name) if profile is not None else "", profile_id=g.profile_id,
                    start=g.start, size=g.size, compute_instances=cis.get(g.gi_id, 0),
                )
            )
        return out

    def _step_index(self, pci_address: str) -> int:
        """The NVML index of a card the last scan saw; refused for one NVML does not see."""
        index = self.scan.index_at(pci_address)
        if index is None:
            raise MigStepError("refused", f"NVML does not see the card at {pci_address} (not on its native driver?)")
        return index

    def create_gpu_instance(self, pci_address: str, profile: str, start: int) -> int:
        index = self._step_index(pci_address)
        what = f"{pci_address}: a GPU instance of {profile} at {start}"
        try:
            if not self.nvml.device_mig_mode(index):
                raise MigStepError("refused", f"{pci_address} is not in MIG mode")
            known = {profile_name(p.name): p for p in self.nvml.gpu_instance_profiles(index)}
            wanted = known.get(profile)
            if wanted is None:
                raise MigStepError("refused", f"{pci_address} has no MIG profile {profile} (it has {', '.join(sorted(known)) or 'none'})")
            placements = dict(self.nvml.gpu_instance_placements(index, wanted.profile_id))
            if start not in placements:
                raise MigStepError("refused", f"{profile} on {pci_address} has no placement at {start} (its starts: {sorted(placements) or 'none'})")
            size = placements[start]
            there = self.nvml.gpu_instances(index)
            for g in there:
                if g.start is None or g.size is None:
                    raise MigStepError("refused", f"GPU instance {g.gi_id} on {pci_address} has no known placement; no instance is placed beside it")
                if g.start < start + size and start < g.start + g.size:
                    raise MigStepError("refused", f"{profile} at {start} on {pci_address} overlaps GPU instance {g.gi_id} (at {g.start}, {g.size} slice(s))")
            same = sum(1 for g in there if g.profile_id == wanted.profile_id)
            if wanted.instance_count and same >= wanted.instance_count:
                raise MigStepError("refused", f"{pci_address} has {same} GPU instance(s) of {profile} already, its most")
            return self.nvml.create_gpu_instance_with_placement(index, wanted.profile_id, start, size)
        except NVML_ERRORS as exc:
            raise step_error(what, exc) from None

    def create_compute_instance(self, pci_address: str, gi: int) -> MigInstanceFacts:
        index = self._step_index(pci_address)
        what = f"{pci_address}: the compute instance of GPU instance {gi}"
        try:
            if not self.nvml.device_mig_mode(index):
                raise MigStepError("refused", f"{pci_address} is not in MIG mode")
            there = next((g for g in self.nvml.gpu_instances(index) if g.gi_id == gi), None)
            if there is None:
                raise MigStepError("not-found", f"{pci_address} has no GPU instance {gi}")
            if any(d.gi_id == gi for d in self.nvml.mig_devices(index)):
                raise MigStepError("refused", f"GPU instance {gi} on {pci_address} has a compute instance already")
            ci = self.nvml.create_compute_instance(index, gi)
            # the MIG device's uuid is what the claim hands the container
            device = next((d for d in self.nvml.mig_devices(index) if (d.gi_id, d.ci_id) == (gi, ci)), None)
            profiles = {p.profile_id: p for p in self.nvml.gpu_instance_profiles(index)}
        except NVML_ERRORS as exc:
            raise step_error(what, exc) from None
        if device is None:
            raise MigStepError("failed", f"{what}: compute instance {ci} was made, but NVML lists no MIG device for it")
        profile = profiles.get(there.profile_id)
        return MigInstanceFacts(
            gi=gi, ci=ci, profile=profile_name(profile.name) if profile is not None else "", uuid=device.uuid,
            memory_bytes=device.memory_bytes, start=there.start, size=there.size,
        )

    def destroy_compute_instance(self, pci_address: str, gi: int, ci: int) -> None:
        index = self._step_index(pci_address)
        what = f"{pci_address}: compute instance {ci} of GPU instance {gi}"
        try:
            if not self.nvml.device_mig_mode(index) or not any((d.gi_id, d.ci_id) == (gi, ci) for d in self.nvml.mig_devices(index)):
                raise MigStepError("not-found", f"{pci_address} has no compute instance {ci} in GPU instance {gi}")
            self._refuse_in_use(index, what, gi, ci)
            self.nvml.destroy_compute_instance(index, gi, ci)
        except NVML_ERRORS as exc:
            raise step_error(what, exc) from None

    def destroy_gpu_instance(self, pci_address: str, gi: int) -> None:
        index = self._step_index(pci_address)
        what = f"{pci_address}: GPU instance {gi}"
        try:
            if not self.nvml.device_mig_mode(index) or not any(g.gi_id == gi for g in self.nvml.gpu_instances(index)):
                raise MigStepError("not-found", f"{pci_address} has no GPU instance {gi}")
            left = sum(1 for d in self.nvml.mig_devices(index) if d.gi_id == gi)
            if left:
                raise MigStepError("in-use", f"GPU instance {gi} on {pci_address} still has {left} compute instance(s)")
            self._refuse_in_use(index, what, gi, None)
            self.nvml.destroy_gpu_instance(index, gi)
        except NVML_ERRORS as exc:
            raise step_error(what, exc) from None

    def _refuse_in_use(self, index: int, what: str, gi: int, ci: int | None) -> None:
        """in-use while NVML lists a process on it; a list NVML refuses leaves it to the destroy's own IN_USE."""
        for p in try_list(lambda: self.nvml.compute_processes(index)):
            if p.gi_id == gi and (ci is None or p.ci_id is None or p.ci_id == ci):
                raise MigStepError("in-use", f"{what}: process {p.pid} runs on it")

    # ----------------------------------------------------------------- MigPartitioner: a whole layout

    def apply_mig_layout(self, pci_address: str, profiles: Sequence[str], *, disable: bool) -> MigLayoutResult:
        """Every compute and GPU instance destroyed, MIG mode set, then one GPU instance per profile with one
        full compute instance each; a failure is rolled back to what was there, or to MIG off."""
        index = self.scan.index_at(pci_address)
        if index is None:
            return MigLayoutResult("Failed", f"NVML does not see the card at {pci_address} (not on its native driver?)", "as before")
        try:
            known = {profile_name(p.name): p for p in self.nvml.gpu_instance_profiles(index)}
            before = [(d.gi_id, d.ci_id) for d in self.nvml.mig_devices(index)] if self.nvml.device_mig_mode(index) else []
            before_profiles = self._gi_profiles_now(index, known)
        except NVML_ERRORS as exc:
            return MigLayoutResult("Failed", f"{pci_address}: NVML could not read the card's MIG state: {exc}", "as before")
        if not disable:
            unknown = [p for p in profiles if p not in known]
            if unknown:
                return MigLayoutResult("Failed", f"{pci_address} has no MIG profile {', '.join(unknown)} (it has {', '.join(sorted(known))})", "as before")
        try:
            self._destroy_all(index, before)
            if self.nvml.set_mig_mode(index, not disable):
                return MigLayoutResult(
                    "DisruptionRequired", f"MIG mode {'on' if not disable else 'off'} on {pci_address} is pending until the GPU is reset", "unknown"
                )
            if disable:
                return MigLayoutResult("Applied", f"MIG mode off on {pci_address} (all-disabled)")
            self._make(index, [known[p].profile_id for p in profiles])
        except NVML_ERRORS as exc:
            return self._roll_back(index, pci_address, exc, before_profiles)
        return MigLayoutResult("Applied", f"{pci_address}: {len(profiles)} GPU instance(s): {', '.join(profiles)}")

    def _gi_profiles_now(self, index: int, known: Mapping[str, NvmlGiProfile]) -> list[int]:
        """The profile ids of the GPU instances there now, to restore them after a failure."""
        if not self.nvml.device_mig_mode(index):
            return []
        return [gi.profile_id for gi in sorted(self.nvml.gpu_instances(index), key=lambda g: g.gi_id)]

    def _destroy_all(self, index: int, devices: Sequence[tuple[int, int]]) -> None:
        for gi, ci in devices:
            self.nvml.destroy_compute_instance(index, gi, ci)
        # GPU instances with no compute instance too (a DRA step that failed half-way leaves one):
        # they hold their slices, so what is made next would not fit
        bare = {g.gi_id for g in try_list(lambda: self.nvml.gpu_instances(index))} if self.nvml.device_mig_mode(index) else set()
        for gi in sorted({gi for gi, _ in devices} | bare):
            self.nvml.destroy_gpu_instance(index, gi)

    def _make(self, index: int, profile_ids: Sequence[int]) -> None:
        for pid in profile_ids:
            gi = self.nvml.create_gpu_instance(index, pid)
            self.nvml.create_compute_instance(index, gi)

    def _roll_back(self, index: int, pci: str, exc: BaseException, before: Sequence[int]) -> MigLayoutResult:
        why = f"{pci}: NVML failed ({exc})"
        try:
            self._destroy_all(index, [(d.gi_id, d.ci_id) for d in self.nvml.mig_devices(index)])
            if before:
                self._make(index, before)
            return MigLayoutResult("Failed", f"{why}; the layout before was restored", "rolled back")
        except NVML_ERRORS as again:
            try:
                self._destroy_all(index, [(d.gi_id, d.ci_id) for d in self.nvml.mig_devices(index)])
                self.nvml.set_mig_mode(index, False)
            except NVML_ERRORS as last:
                return MigLayoutResult("Failed", f"{why}; restoring failed ({again}) and so did turning MIG off ({last})", "unknown")
            return MigLayoutResult("Failed", f"{why}; restoring the layout before failed ({again}): MIG is off", "all-disabled")


__all__ = ["NvidiaMig", "guess_profile", "profile_name", "step_error"]
