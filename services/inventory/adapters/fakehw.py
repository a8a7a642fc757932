"""The `fakehw` adapter: a host described by a JSON file instead of NVML and sysfs.

It lets `bcd up` start a working node on a laptop and lets tests describe any
host (eight H200s with MIG, a VM guest, a one-GPU box) in one file. The file is
decoded with msgspec Structs that refuse unknown fields, so a typo in a host
file is an error that names the field (`$.gpus[3].pci_address`), not a silently
missing GPU. The file is re-read on every `read_capabilities`, so a test (or
the fake VFIO switcher) can change the host by rewriting it.

The adapter implements every capability interface, and writes the vendor CDI
spec the file declares into cdi_dir, as the NVIDIA toolkit would on a real host.
What NVML would change (MIG layouts, MIG instances made one step at a time at a
placement) is written back into the file, under the same lock as the fake
vfio_switcher's writes, atomically; faults declared in the file play back once.

MIG in the file: a card's GPU instances are those its `mig_instances` (MIG
devices) name plus its `gpu_instances` (where one with no compute instance
lives); a placement is a start in memory slices, its size the profile's.

Sharing in the file (`GpuSharer`): the MPS control daemons running are the
top-level `mps_daemons` (each with its spec and directories), and a card's time
slice is its `timeslice`. Starting a daemon makes its pipe, log and shm
directories for real (as the user running the fake host: on a real host they
are root's, services/inventory/mpsroot.py), with a FIFO `<pipe>/control`
standing in for the daemon's control pipe, so a container runtime can
bind-mount them as on a real host.
"""

from __future__ import annotations

import json
import os
import time
import uuid as uuid_mod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from shared.fsutil import atomic_write as shared_atomic_write
from shared.fsutil import exclusive
from shared.fsutil import read_regular
from shared.host import HOST_FILE_MAX_BYTES
from shared.vendorcdi import vendor_spec_bytes
from shared.schemas import HostResources, HugePagePool, MigPlacement, MigProfile, MpsDaemonSpec, NumaNode, RunningProcess

from .. import hostfs
from .base import (
    VENDOR_CDI_FILE,
    AdapterError,
    DiagResult,
    GpuFacts,
    GpuInstanceFacts,
    HealthCheck,
    HealthEvent,
    MigLayoutResult,
    HostScan,
    MigInstanceFacts,
    MigStepError,
    RunningDomain,
    SharingStepError,
    VendorCdi,
    make_mps_dirs,
    mps_control_dir,
    mps_dirs_under,
    read_vendor_cdi,
    remove_mps_dir,
)
from .fakehost import (
    HOST_DECODER,
    NVML_GONE,
    FakeHost,
    HostGpu,
    HostMigProfile,
    HostMpsDaemon,
    card_index_of,
    device_cards,
    gpu_instances_of,
    host_problem,
    load_host_file,
    overlaps,
)

T = TypeVar("T")




def _refuse_in_use(host: FakeHost, card: HostGpu, gi: int, ci: int | None) -> None:
    """in-use while a process of the host file runs on that GPU instance (or compute instance)."""
    what = f"GPU instance {gi}" if ci is None else f"compute instance {ci} of GPU instance {gi}"
    for p in host.processes:
        if p.gpu_uuid == card.uuid and p.gi == gi and (ci is None or p.ci is None or p.ci == ci):
            raise MigStepError("in-use", f"process {p.pid} runs on {what} on {card.pci_address}")
    devices = {m.uuid for m in card.mig_instances if m.gi == gi and (ci is None or m.ci == ci)}
    for daemon in host.mps_daemons:
        if devices & set(daemon.uuids):
            raise MigStepError("in-use", f"MPS daemon {daemon.control} serves {what} on {card.pci_address}")


def _mps_daemon_on(host: FakeHost, card: HostGpu) -> str:
    """The control id of an MPS daemon that serves one of the card's MIG devices ("" for none)."""
    devices = {m.uuid for m in card.mig_instances}
    return next((d.control for d in host.mps_daemons if devices & set(d.uuids)), "")


def _mig_uuid(gpu_uuid: str, gi: int, profile: str) -> str:
    """A MIG device's uuid: the same card, GPU instance and profile always give the same one."""
    return f"MIG-{uuid_mod.uuid5(uuid_mod.NAMESPACE_URL, f'{gpu_uuid}/gi{gi}/{profile}')}"


def _place(profiles: Sequence[HostMigProfile]) -> list[int | None] | None:
    """Starts for a layout's GPU instances, as NVML places them: the largest first, each at its
    highest free placement (small ones then pack low). None when they do not fit together; a
    profile with no placements gets None (the file does not say where it sits)."""
    starts: list[int | None] = [None] * len(profiles)
    taken: list[tuple[int, int]] = []
    for k in sorted(range(len(profiles)), key=lambda k: -profiles[k].size):
        p = profiles[k]
        if not p.placements:
            continue
        free = [s for s in p.placements if all(s + p.size <= a or b <= s for a, b in taken)]
        if not free:
            return None
        starts[k] = max(free)
        taken.append((starts[k], starts[k] + p.size))
    return starts


def _daemon_record(spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> dict[str, Any]:
    """A daemon as `mps_daemons` holds it."""
    record: dict[str, Any] = {"control": spec.control, "uuids": list(spec.uuids), "pipe_dir": str(pipe_dir), "log_dir": str(log_dir)}
    if spec.active_thread_percentage is not None:
        record["active_thread_percentage"] = spec.active_thread_percentage
    if spec.pinned_memory:
        record["pinned_memory"] = dict(spec.pinned_memory)
    return record


#: the stand-in for the MPS daemon's control pipe in its pipe directory
MPS_CONTROL_FIFO = "control"


#: a daemon's shared memory directory, beside its pipe and log directories (the claim's /dev/shm)
MPS_SHM_DIR = "shm"


def _make_daemon_dirs(pipe_dir: Path, log_dir: Path) -> None:
    """The daemon's directories (0755; its shm 1777, as a /dev/shm) and the FIFO
    `<pipe>/control` its clients would open."""
    shm = pipe_dir.parent / MPS_SHM_DIR
    make_mps_dirs(pipe_dir, log_dir, shm)
    os.chmod(shm, 0o1777)
    fifo = pipe_dir / MPS_CONTROL_FIFO
    if not os.path.lexists(fifo):
        os.mkfifo(fifo, 0o600)




def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory (DESIGN 5, CDI rules)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shared_atomic_write(path, data, mode)


#: where a `real_sysfs` card's driver is read
SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")


def _sysfs_driver(pci_address: str) -> str:
    """The driver the kernel has bound to a real PCI device now; "" for none (or no such device)."""
    try:
        return Path(os.readlink(SYSFS_PCI_DEVICES / pci_address / "driver")).name
    except OSError:
        return ""


class FakeHwAdapter:
    """VendorAdapter + MigCapable + MigPartitioner + MigInstancer + VfioCapable + SharingCapable + GpuSharer
    + DomainLister + Diagnosable + HealthWatcher over a host file."""

    def __init__(self, host_file: Path | str, *, cdi_dir: Path | str) -> None:
        self.host_file = Path(host_file)
        self.cdi_dir = Path(cdi_dir)
        # fail at start, not at the first scan, when the file is wrong.
        self._host = load_host_file(self.host_file)
        self._health_watch: Any = None

    @property
    def host(self) -> FakeHost:
        """The host as of the last read."""
        return self._host

    def reload(self) -> FakeHost:
        self._host = load_host_file(self.host_file)
        return self._host

    # ----------------------------------------------------------------- required

    def vendor(self) -> str:
        return self._host.vendor

    # ----------------------------------------------------------------- MIG layouts

    def apply_mig_layout(self, pci_address: str, profiles: Sequence[str], *, disable: bool) -> MigLayoutResult:
        """NVML as the host file models it: the card's mig_mode and mig_instances are rewritten."""
        try:
            # the switcher's fake backend writes the same file under the same lock
            with exclusive(self.host_file, 10.0):
                return self._apply_mig_layout(pci_address, list(profiles), disable)
        except (OSError, ValueError, AdapterError) as exc:
            return MigLayoutResult("Failed", f"the fake host file could not be changed: {exc}", "unknown")

    def _apply_mig_layout(self, pci: str, profiles: list[str], disable: bool) -> MigLayoutResult:
        host = load_host_file(self.host_file)
        doc = json.loads(read_regular(self.host_file, max_bytes=HOST_FILE_MAX_BYTES))
        index = next((i for i, g in enumerate(host.gpus) if g.pci_address == pci and g.present), None)
        if index is None:
            return MigLayoutResult("Failed", f"no card at {pci} on the fake host", "as before")
        card, entry = host.gpus[index], doc["gpus"][index]
        if not card.mig_profiles:
            return MigLayoutResult("NotSupported", f"{pci} supports no MIG profiles", "as before")
        serving = _mps_daemon_on(host, card)
        if serving:
            # its MIG devices would go with the layout; the daemon's record would name what is gone
            return MigLayoutResult("Failed", f"MPS daemon {serving} serves a MIG device of {pci}; stop it first", "as before")
        known = {p.name: p for p in card.mig_profiles}
        unknown = [p for p in profiles if p not in known]
        if unknown:
            return MigLayoutResult("Failed", f"{pci} has no MIG profile {', '.join(unknown)} (it has {', '.join(sorted(known))})", "as before")
        for name in set(profiles):
            most = known[name].instances_max
            if most and profiles.count(name) > most:
                return MigLayoutResult("Failed", f"{pci} fits at most {most} GPU instance(s) of {name}", "as before")
        slices = sum(known[p].slices for p in profiles)
        if slices > 7:
            return MigLayoutResult("Failed", f"{pci}: the layout needs {slices} slices, the card has 7", "as before")
        starts = _place([known[p] for p in profiles])
        if starts is None:
            return MigLayoutResult("Failed", f"{pci}: no placement of the card fits {', '.join(profiles)} together", "as before")
        faults = entry.get("faults")
        if not isinstance(faults, dict):
            faults = entry["faults"] = {}
        fault = card.faults.mig
        if fault:
            faults["mig"] = ""  # consumed when it fires
        want_mode = not disable
        if fault == "needs-reset" and want_mode != card.mig_mode:
            self._save(doc)
            return MigLayoutResult(
                "DisruptionRequired", f"MIG mode {'on' if want_mode else 'off'} on {pci} is pending until the GPU is reset", "as before"
            )
        before = (entry.get("mig_mode", False), list(entry.get("mig_instances", [])), list(entry.get("gpu_instances", [])))
        # every instance there now is destroyed first, those with no compute instance too
        entry["gpu_instances"] = []
        if disable:
            entry["mig_mode"], entry["mig_instances"] = False, []
            self._save(doc)
            return MigLayoutResult("Applied", f"MIG mode off on {pci} (all-disabled)")
        made = []
        for gi, (name, start) in enumerate(zip(profiles, starts), start=1):
            made.append(
                {"gi": gi, "ci": 0, "profile": name, "uuid": _mig_uuid(card.uuid, gi, name), "memory_bytes": known[name].memory_bytes, "placement_start": start}
            )
        if fault in ("fail", "fail-rollback"):
            failed_at = made[-1]["gi"] if made else 0
            if fault == "fail":
                entry["mig_mode"], entry["mig_instances"], entry["gpu_instances"] = before
                self._save(doc)
                return MigLayoutResult("Failed", f"creating the compute instance of GPU instance {failed_at} on {pci} failed; the layout before was restored", "rolled back")
            entry["mig_mode"], entry["mig_instances"] = False, []
            self._save(doc)
            return MigLayoutResult(
                "Failed", f"creating the compute instance of GPU instance {failed_at} on {pci} failed, and so did restoring the layout before: MIG is off", "all-disabled"
            )
        entry["mig_mode"], entry["mig_instances"], entry["slots"] = True, made, 0
        self._save(doc)
        return MigLayoutResult("Applied", f"{pci}: {len(made)} GPU instance(s): {', '.join(profiles) or '(none)'}")

    def _save(self, doc: dict[str, Any]) -> None:
        mode = self.host_file.stat().st_mode & 0o777
        shared_atomic_write(self.host_file, (json.dumps(doc, indent=2) + "\n").encode(), mode)

    # ----------------------------------------------------------------- MIG instances (MigInstancer)

    def gpu_instances(self, gpu_uuid: str) -> list[GpuInstanceFacts]:
        g = self._gpu(gpu_uuid)
        if g is None or not g.mig_mode:
            return []
        return list(gpu_instances_of(g).values())

    def create_gpu_instance(self, pci_address: str, profile: str, start: int) -> int:
        def step(host: FakeHost, card: HostGpu, entry: dict[str, Any], doc: dict[str, Any]) -> int:
            pci = card.pci_address
            if not card.mig_mode:
                raise MigStepError("refused", f"{pci} is not in MIG mode")
            known = {p.name: p for p in card.mig_profiles}
            wanted = known.get(profile)
            if wanted is None:
                raise MigStepError("refused", f"{pci} has no MIG profile {profile} (it has {', '.join(sorted(known)) or 'none'})")
            if start not in wanted.placements:
                raise MigStepError("refused", f"{profile} on {pci} has no placement at {start} (its starts: {wanted.placements or 'none'})")
            gis = gpu_instances_of(card)
            for g in gis.values():
                if g.start is None or g.size is None:
                    # fail closed: where it sits is not known, so neither is what it overlaps
                    raise MigStepError("refused", f"GPU instance {g.gi} on {pci} has no known placement; no instance is placed beside it")
                if overlaps(g, start, wanted.size):
                    raise MigStepError(
                        "refused", f"{profile} at {start} on {pci} overlaps GPU instance {g.gi} ({g.profile} at {g.start}, {g.size} slice(s))"
                    )
            same = sum(1 for g in gis.values() if g.profile == profile)
            if wanted.instances_max and same >= wanted.instances_max:
                raise MigStepError("refused", f"{pci} has {same} GPU instance(s) of {profile} already, its most")
            if self._fire(card, entry, doc, "gi-fail"):
                raise MigStepError("failed", f"creating a GPU instance of {profile} at {start} on {pci} failed (fake host fault gi-fail)")
            gi = next(k for k in range(1, len(gis) + 2) if k not in gis)
            entry.setdefault("gpu_instances", []).append({"gi": gi, "profile": profile, "placement_start": start})
            self._save_checked(doc)
            return gi

        return self._mig_step(pci_address, step)

    def create_compute_instance(self, pci_address: str, gi: int) -> MigInstanceFacts:
        def step(host: FakeHost, card: HostGpu, entry: dict[str, Any], doc: dict[str, Any]) -> MigInstanceFacts:
            pci = card.pci_address
            if not card.mig_mode:
                raise MigStepError("refused", f"{pci} is not in MIG mode")
            g = gpu_instances_of(card).get(gi)
            if g is None:
                raise MigStepError("not-found", f"{pci} has no GPU instance {gi}")
            if g.compute_instances:
                raise MigStepError("refused", f"GPU instance {gi} on {pci} has a compute instance already")
            if self._fire(card, entry, doc, "ci-fail"):
                raise MigStepError("failed", f"creating the compute instance of GPU instance {gi} on {pci} failed (fake host fault ci-fail); the GPU instance is left")
            profile = next((p for p in card.mig_profiles if p.name == g.profile), None)
            made = MigInstanceFacts(
                gi=gi, ci=0, profile=g.profile, uuid=_mig_uuid(card.uuid, gi, g.profile),
                memory_bytes=profile.memory_bytes if profile is not None else 0, start=g.start, size=g.size,
            )
            device: dict[str, Any] = {"gi": gi, "ci": made.ci, "profile": made.profile, "uuid": made.uuid, "memory_bytes": made.memory_bytes}
            if g.start is not None:
                device["placement_start"] = g.start
            entry.setdefault("mig_instances", []).append(device)
            self._save_checked(doc)
            return made

        return self._mig_step(pci_address, step)

    def destroy_compute_instance(self, pci_address: str, gi: int, ci: int) -> None:
        def step(host: FakeHost, card: HostGpu, entry: dict[str, Any], doc: dict[str, Any]) -> None:
            pci = card.pci_address
            if not card.mig_mode or not any(m.gi == gi and m.ci == ci for m in card.mig_instances):
                raise MigStepError("not-found", f"{pci} has no compute instance {ci} in GPU instance {gi}")
            if self._fire(card, entry, doc, "destroy-in-use"):
                raise MigStepError("in-use", f"compute instance {ci} of GPU instance {gi} on {pci} is in use (fake host fault destroy-in-use)")
            _refuse_in_use(host, card, gi, ci)
            g = gpu_instances_of(card)[gi]
            entry["mig_instances"] = [m for m in entry.get("mig_instances", []) if (m.get("gi"), m.get("ci")) != (gi, ci)]
            if not any(n.gi == gi for n in card.gpu_instances):
                # the GPU instance outlives its last compute instance, as in NVML
                named: dict[str, Any] = {"gi": gi, "profile": g.profile}
                if g.start is not None:
                    named["placement_start"] = g.start
                entry.setdefault("gpu_instances", []).append(named)
            self._save_checked(doc)

        self._mig_step(pci_address, step)

    def destroy_gpu_instance(self, pci_address: str, gi: int) -> None:
        def step(host: FakeHost, card: HostGpu, entry: dict[str, Any], doc: dict[str, Any]) -> None:
            pci = card.pci_address
            g = gpu_instances_of(card).get(gi) if card.mig_mode else None
            if g is None:
                raise MigStepError("not-found", f"{pci} has no GPU instance {gi}")
            if self._fire(card, entry, doc, "destroy-in-use"):
                raise MigStepError("in-use", f"GPU instance {gi} on {pci} is in use (fake host fault destroy-in-use)")
            if g.compute_instances:
                raise MigStepError("in-use", f"GPU instance {gi} on {pci} still has {g.compute_instances} compute instance(s)")
            _refuse_in_use(host, card, gi, None)
            entry["gpu_instances"] = [n for n in entry.get("gpu_instances", []) if n.get("gi") != gi]
            self._save_checked(doc)

        self._mig_step(pci_address, step)

    def _mig_step(self, pci_address: str, step: Callable[[FakeHost, HostGpu, dict[str, Any], dict[str, Any]], T]) -> T:
        """One MIG instance step on the host file, under the file's lock (the switcher's fake backend
        writes the same file); MigStepError when it did not happen."""
        try:
            with exclusive(self.host_file, 10.0):
                # read here, not into self.host: a scan in another thread keeps the host it read
                host = load_host_file(self.host_file)
                doc = json.loads(read_regular(self.host_file, max_bytes=HOST_FILE_MAX_BYTES))
                index = next((i for i, g in enumerate(host.gpus) if g.pci_address == pci_address and g.present), None)
                if index is None:
                    raise MigStepError("refused", f"no card at {pci_address} on the fake host")
                return step(host, host.gpus[index], doc["gpus"][index], doc)
        except MigStepError:
            raise
        except (OSError, ValueError, AdapterError) as exc:
            raise MigStepError("failed", f"the fake host file could not be changed: {exc}") from None

    def _fire(self, card: HostGpu, entry: dict[str, Any], doc: dict[str, Any], fault: str) -> bool:
        """True when the card's mig_instance fault is `fault`; it is consumed (written) as it fires."""
        if card.faults.mig_instance != fault:
            return False
        self._consume_fault(entry, doc, "mig_instance")
        return True

    def _consume_fault(self, entry: dict[str, Any], doc: dict[str, Any], name: str) -> None:
        """A one-shot fault of a card's entry cleared and the host file written (it fired)."""
        faults = entry.get("faults")
        if not isinstance(faults, dict):
            faults = entry["faults"] = {}
        faults[name] = ""
        self._save(doc)

    def _save_checked(self, doc: dict[str, Any], error: Callable[[Any, str], AdapterError] = MigStepError) -> None:
        """Save a change only when the file stays valid: a step never leaves a host file the inventory cannot read."""
        data = json.dumps(doc).encode()
        try:
            problem = host_problem(HOST_DECODER.decode(data))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            problem = str(exc)
        if problem:
            raise error("failed", f"the change would break the fake host file ({problem}); nothing changed")
        self._save(doc)

    # ----------------------------------------------------------------- sharing (GpuSharer)

    def mps_start(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        """Record the daemon in `mps_daemons` and make its directories and control FIFO."""
        control_dir = mps_control_dir(spec.control, pipe_dir, log_dir)

        def step(host: FakeHost, doc: dict[str, Any]) -> None:
            running = next((d for d in host.mps_daemons if d.control == spec.control), None)
            if running is not None:
                self._same_daemon(running, spec, pipe_dir, log_dir)
                _make_daemon_dirs(pipe_dir, log_dir)  # what a crash or a cleaner took is made again
                return
            index = self._mps_card_index(host, spec)
            if self._fire_sharing(host, doc, index, "mps-start-fail"):
                raise SharingStepError("failed", f"starting MPS daemon {spec.control} failed (fake host fault mps-start-fail)")
            made = not os.path.lexists(control_dir)
            _make_daemon_dirs(pipe_dir, log_dir)
            doc.setdefault("mps_daemons", []).append(_daemon_record(spec, pipe_dir, log_dir))
            try:
                self._save_checked(doc, SharingStepError)
            except SharingStepError:
                if made:
                    remove_mps_dir(control_dir)
                raise

        self._sharing_step(step)

    def mps_stop(self, control: str, pipe_dir: Path, log_dir: Path) -> None:
        """Remove the daemon's record and its `<mps root>/<control>` directory."""
        control_dir = mps_control_dir(control, pipe_dir, log_dir)

        def step(host: FakeHost, doc: dict[str, Any]) -> None:
            running = next((d for d in host.mps_daemons if d.control == control), None)
            if running is None:
                if not remove_mps_dir(control_dir):
                    raise SharingStepError("not-found", f"no MPS daemon {control} runs on the fake host, and nothing of one is left")
                return  # what a dead daemon left is gone now
            index = card_index_of(host, running.uuids[0])
            if index is not None and self._fire_sharing(host, doc, index, "mps-stop-fail"):
                raise SharingStepError("failed", f"stopping MPS daemon {control} failed (fake host fault mps-stop-fail); it still runs")
            doc["mps_daemons"] = [d for d in doc.get("mps_daemons", []) if d.get("control") != control]
            self._save_checked(doc, SharingStepError)
            remove_mps_dir(control_dir)

        self._sharing_step(step)

    def mps_list(self, root: Path) -> list[str]:
        """The daemons the file records under `root`, and the directories left there."""
        host = self._sharing_step(lambda host, doc: host)
        recorded = {d.control for d in host.mps_daemons if Path(d.pipe_dir).parent.parent == root}
        return sorted(recorded | set(mps_dirs_under(root)))

    def set_timeslice(self, pci_address: str, gpu_uuid: str, interval: str) -> None:
        """The card's `timeslice` in the file."""
        if interval not in ("Default", "Short", "Medium", "Long"):
            raise SharingStepError("refused", f"{interval!r} is not a time slice (Default, Short, Medium or Long)")

        def step(host: FakeHost, doc: dict[str, Any]) -> None:
            index = next((i for i, g in enumerate(host.gpus) if g.pci_address == pci_address and g.present), None)
            if index is None:
                raise SharingStepError("refused", f"no card at {pci_address} on the fake host")
            card = host.gpus[index]
            if card.uuid != gpu_uuid:
                raise SharingStepError("refused", f"the card at {pci_address} is {card.uuid}, not {gpu_uuid}")
            if card.mig_mode:
                raise SharingStepError("refused", f"{pci_address} is in MIG mode: time slices are for whole cards")
            if self._fire_sharing(host, doc, index, "timeslice-fail"):
                raise SharingStepError("failed", f"setting the time slice of {pci_address} failed (fake host fault timeslice-fail)")
            doc["gpus"][index]["timeslice"] = interval
            self._save_checked(doc, SharingStepError)

        self._sharing_step(step)

    @staticmethod
    def _same_daemon(running: HostMpsDaemon, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path) -> None:
        """A daemon that runs for the control id already: done when it has this spec, refused otherwise."""
        if running.spec() != spec or (running.pipe_dir, running.log_dir) != (str(pipe_dir), str(log_dir)):
            raise SharingStepError("refused", f"MPS daemon {spec.control} runs already with another spec (uuids {', '.join(running.uuids)})")

    @staticmethod
    def _mps_card_index(host: FakeHost, spec: MpsDaemonSpec) -> int:
        """The index (in gpus) of the card a daemon's first device is on; refused for a device the host lacks."""
        devices = device_cards(host)
        for uuid in spec.uuids:
            card = devices.get(uuid)
            if card is None or not card.present:
                raise SharingStepError("refused", f"the fake host has no GPU or MIG device {uuid}")
        index = card_index_of(host, spec.uuids[0])
        assert index is not None
        return index

    def _sharing_step(self, step: Callable[[FakeHost, dict[str, Any]], T]) -> T:
        """One sharing step on the host file, under the file's lock (as the MIG steps); SharingStepError
        when it did not happen."""
        try:
            with exclusive(self.host_file, 10.0):
                host = load_host_file(self.host_file)
                doc = json.loads(read_regular(self.host_file, max_bytes=HOST_FILE_MAX_BYTES))
                return step(host, doc)
        except SharingStepError:
            raise
        except (OSError, ValueError, AdapterError) as exc:
            raise SharingStepError("failed", f"the fake host file could not be changed: {exc}") from None

    def _fire_sharing(self, host: FakeHost, doc: dict[str, Any], index: int, fault: str) -> bool:
        """True when the card's sharing fault is `fault`; it is consumed (written) as it fires."""
        if host.gpus[index].faults.sharing != fault:
            return False
        self._consume_fault(doc["gpus"][index], doc, "sharing")
        return True

    # ----------------------------------------------------------------- diagnostics

    def run_diag(self, pci_address: str, level: int, timeout: float) -> DiagResult:
        """DCGM as the host file says: each card's `diag` (pass or fail), after `diag_seconds`."""
        try:
            host = load_host_file(self.host_file)
        except AdapterError as exc:
            return DiagResult("Error", f"the fake host file could not be read: {exc}")
        card = next((g for g in host.gpus if g.pci_address == pci_address and g.present), None)
        if card is None:
            return DiagResult("Error", f"no card at {pci_address} on the fake host")
        if card.diag_seconds:
            if card.diag_seconds > timeout:
                time.sleep(timeout)
                return DiagResult("Error", f"dcgmi diag -r {level} did not finish within {timeout:.0f} s")
            time.sleep(card.diag_seconds)
        if card.diag == "fail":
            why = card.diag_message or "the fake host says this card fails its diagnostic"
            return DiagResult("Failed", f"DCGM diagnostic level {level}: 1 test(s) failed (fake host)", (f"fake: {why}",))
        return DiagResult("Passed", f"DCGM diagnostic level {level} passed (fake host)")

    def read_capabilities(self) -> HostScan:
        host = self.reload()
        if host.nvml_gone:
            raise AdapterError(NVML_GONE)
        nodes = [
            NumaNode(
                node=n.node,
                cpus=n.cpus,
                memory_bytes=n.memory_bytes,
                hugepages=sorted(
                    (HugePagePool(page_size_kib=p.page_size_kib, total=p.total, free=p.free) for p in n.hugepages),
                    key=lambda p: p.page_size_kib,
                ),
            )
            for n in sorted(host.numa_nodes, key=lambda n: n.node)
        ]
        resources = HostResources(
            memory_bytes=host.memory.total_bytes,
            memory_available_bytes=host.memory.available_bytes,
            cpus=host.cpus,
            numa_nodes=nodes,
            hugepages=hostfs.sum_pools(nodes),
            virtualized=host.virtualized,
        )
        gpus = tuple(
            GpuFacts(
                uuid=g.uuid,
                index=g.index,
                pci_address=g.pci_address,
                name=g.name,
                memory_bytes=g.memory_bytes,
                numa_node=g.numa_node,
                compute_capability=g.compute_capability,
                mig_mode=g.mig_mode,
                iommu_group=g.iommu_group,
                # NVML's GPU_IS_LOST: seen on the bus, not read (it must not look Ready)
                readable=not g.health.gone,
            )
            for g in sorted(host.gpus, key=lambda g: g.index)
            # a card that dropped off the bus is not there to list (nor its processes)
            if g.present
        )
        present = {g.uuid for g in host.gpus if g.present}
        processes = tuple(
            sorted(
                (
                    RunningProcess(pid=p.pid, gpu_uuid=p.gpu_uuid, cgroup=p.cgroup)
                    for p in host.processes
                    if p.gpu_uuid in present
                ),
                key=lambda p: (p.pid, p.gpu_uuid),
            )
        )
        return HostScan(
            driver_version=host.driver_version,
            cuda_driver_version=host.cuda_version,
            gpus=gpus,
            host=resources,
            boot_id=host.boot_id or hostfs.read_boot_id("/proc"),
            processes=processes,
        )

    def cdi_edits(self) -> VendorCdi | None:
        return read_vendor_cdi(self.cdi_dir, VENDOR_CDI_FILE)

    def write_cdi_spec(self) -> bool:
        spec = self._host.vendor_cdi_spec
        if spec is None:
            return False
        data = vendor_spec_bytes(spec)
        path = self.cdi_dir / VENDOR_CDI_FILE
        try:
            if read_regular(path, max_bytes=len(data)) == data:
                # runtimes watch cdi_dir; an unchanged spec is not rewritten.
                return True
        except OSError:
            pass
        try:
            atomic_write(path, data)
        except OSError as exc:
            # a compose node's cdi/ is root's, read-only here: `bcd compose init` writes the spec
            raise AdapterError(f"cannot write the vendor CDI spec {path}: {exc.strerror or exc} (a compose node: run `bcd compose init` again)") from None
        return True

    def close(self) -> None:
        self.close_health_watch()

    # ----------------------------------------------------------------- health (HealthWatcher)

    def open_health_watch(self) -> list[HealthEvent]:
        if self._health_watch is None:
            from .fakehw_health import FakeHealthWatch

            self._health_watch = FakeHealthWatch(self.host_file)
        return self._health_watch.open()

    def wait_health_events(self, timeout: float) -> list[HealthEvent]:
        if self._health_watch is None:
            raise AdapterError("the health watch is not open")
        return self._health_watch.wait(timeout)

    def check_health(self) -> list[HealthCheck]:
        from .fakehw_health import check_host, read_host

        return check_host(read_host(self.host_file))

    def close_health_watch(self) -> None:
        self._health_watch = None

    # ----------------------------------------------------------------- optional

    def _gpu(self, gpu_uuid: str) -> HostGpu | None:
        for g in self._host.gpus:
            if g.uuid == gpu_uuid:
                return g
        return None

    def mig_profiles(self, gpu_uuid: str) -> list[MigProfile]:
        g = self._gpu(gpu_uuid)
        if g is None:
            return []
        return [
            MigProfile(
                name=p.name,
                profile_id=p.profile_id,
                slices=p.slices,
                memory_bytes=p.memory_bytes,
                instances_max=p.instances_max,
                placements=[MigPlacement(start=s, size=p.size) for s in sorted(p.placements)],
                multiprocessors=p.multiprocessors,
                copy_engines=p.copy_engines,
                decoders=p.decoders,
                encoders=p.encoders,
                jpeg_engines=p.jpeg_engines,
                ofa_engines=p.ofa_engines,
            )
            for p in g.mig_profiles
        ]

    def mig_instances(self, gpu_uuid: str) -> list[MigInstanceFacts]:
        g = self._gpu(gpu_uuid)
        if g is None or not g.mig_mode:
            return []
        gis = gpu_instances_of(g)
        return [
            MigInstanceFacts(
                gi=m.gi, ci=m.ci, profile=m.profile, uuid=m.uuid, memory_bytes=m.memory_bytes, start=gis[m.gi].start, size=gis[m.gi].size
            )
            for m in sorted(g.mig_instances, key=lambda m: (m.gi, m.ci))
        ]

    def driver_binding(self, pci_address: str) -> tuple[str, str]:
        """(driver bound now, native driver); ("", "") for a card not on the bus."""
        for g in self._host.gpus:
            if g.pci_address == pci_address and g.present:
                if g.real_sysfs:
                    return _sysfs_driver(pci_address), g.base_driver
                return g.driver, g.base_driver
        return "", ""

    def slots_per_gpu(self, gpu_uuid: str) -> int:
        g = self._gpu(gpu_uuid)
        return 0 if g is None or g.mig_mode else g.slots

    def mps_running(self) -> bool:
        return self._host.mps_running

    def mps_pipe_dir(self) -> str:
        return self._host.mps_pipe_dir

    def domains(self) -> list[RunningDomain]:
        return [RunningDomain(name=d.name, gpus=tuple(d.gpus)) for d in self._host.domains]


__all__ = ["MPS_CONTROL_FIFO", "atomic_write", "FakeHwAdapter"]
