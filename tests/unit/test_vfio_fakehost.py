"""vfio_switcher's fake-host backend: one behaviour suite on all three DriverPort backends, then the file itself.

The suite (reads, clean prepare and unprepare, every fault and its recovery
path, vanish) runs on `FakeDriver` (memory), `SysfsDriver` over the fake sysfs
tree of test_vfio_switch (with the kernel's reaction emulated) and
`FakeHostDriver` over a host description file, so the fake host the
integration tests and `bcd up` use behaves as the other two do. The switch
table of test_vfio_switch is replayed here on all three, plus the unbind
that fails. Then what only the file backend has: the file stays a valid
host file the inventory reads, every other key is kept, faults are consumed,
writes are atomic and serialised by the lock file, a hang ends at a reboot.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
from pathlib import Path

import pytest

from services.inventory.adapters.fakehost import load_host_file
from services.vfio_switcher.driver import VFIO_DRIVER, DeviceVanished, DriverBusy, DriverError, DriverPort, DriverTimeout, FakeDriver
from services.vfio_switcher.fakehost import GPU_PCI_CLASS, FakeHostDriver, FakeHostError
from services.vfio_switcher.service import holder_of, passthrough_claimed
from services.vfio_switcher.switch import (
    DISRUPTION_REQUIRED,
    EVENT_PREPARE_FAILED,
    EVENT_PREPARE_SUCCEEDED,
    EVENT_UNPREPARE_FAILED,
    Outcome,
    switch,
)

from .test_vfio_switch import BASE, CASES, GPU, GPU2, NIC, T, FakeTree, KernelSysfs, join_writer_threads, nobody

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hosts" / "h200x8.json"


# --------------------------------------------------------------------------- three hosts, one vocabulary


class MemHost:
    """FakeDriver."""

    def __init__(self, tmp_path: Path) -> None:
        self.port = FakeDriver()

    def add(self, pci: str, *, cls: str = GPU_PCI_CLASS, driver: str | None = None, override: str = "") -> None:
        self.port.add(pci, pci_class=cls, driver=driver, driver_override=override)

    def fail_bind(self, pci: str, driver: str) -> None:
        self.port.fail_bind(pci, driver)

    def fail_unbind(self, pci: str) -> None:
        self.port.fail_unbind(pci)

    def hang_unbind(self, pci: str, leave: str) -> None:
        self.port.hang_unbind(pci, leave=leave)  # type: ignore[arg-type]

    def vanish_at(self, pci: str, op: str) -> None:
        self.port.vanish_at(pci, op)  # type: ignore[arg-type]

    def unload(self, driver: str) -> None:
        self.port.loaded.discard(driver)

    def end_hang(self, pci: str) -> None:
        self.port.release(pci)

    def fail_reset(self, pci: str) -> None:
        self.port.fail_reset(pci)

    def no_reset(self, pci: str) -> None:
        self.port.not_resettable(pci)

    def resets(self, pci: str) -> int:
        return self.port.resets.get(pci, 0)

    def close(self) -> None:
        pass


class FaultTree(FakeTree):
    """test_vfio_switch's tree, plus an unbind the driver refuses."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail_unbind: set[str] = set()

    def before(self, op: str, pci: str) -> None:
        if op == "unbind" and pci in self.fail_unbind:
            self.fail_unbind.discard(pci)
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        super().before(op, pci)


class SysfsHost:
    """SysfsDriver on a fake sysfs tree whose kernel reacts to writes."""

    def __init__(self, tmp_path: Path) -> None:
        self.tree = FaultTree(tmp_path / "sys")
        self.port = KernelSysfs(self.tree)

    def add(self, pci: str, *, cls: str = GPU_PCI_CLASS, driver: str | None = None, override: str = "") -> None:
        self.tree.add(pci, cls=cls, driver=driver, override=override)

    def fail_bind(self, pci: str, driver: str) -> None:
        self.tree.fail_bind.add((pci, driver))

    def fail_unbind(self, pci: str) -> None:
        self.tree.fail_unbind.add(pci)

    def hang_unbind(self, pci: str, leave: str) -> None:
        self.tree.hang_unbind[pci] = leave

    def vanish_at(self, pci: str, op: str) -> None:
        self.tree.vanish_at[pci] = op

    def unload(self, driver: str) -> None:
        self.tree.unload(driver)

    def end_hang(self, pci: str) -> None:
        self.tree.gate.set()
        join_writer_threads()

    def fail_reset(self, pci: str) -> None:
        self.tree.fail_reset.add(pci)

    def no_reset(self, pci: str) -> None:
        (self.tree.real_dir(pci) / "reset").unlink()

    def resets(self, pci: str) -> int:
        return self.tree.resets.get(pci, 0)

    def close(self) -> None:
        self.tree.gate.set()
        join_writer_threads()


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".test-tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)


class FileHost:
    """FakeHostDriver over a host description file the inventory could read."""

    def __init__(self, tmp_path: Path) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.path = tmp_path / "host.json"
        write_json(self.path, {"boot_id": "boot-1", "gpus": [], "pci_devices": []})
        self.port = FakeHostDriver(self.path)

    def doc(self) -> dict:
        return json.loads(self.path.read_text())

    def edit(self, fn) -> None:
        doc = self.doc()
        fn(doc)
        write_json(self.path, doc)

    def gpu(self, doc: dict, pci: str) -> dict:
        return next(g for g in doc["gpus"] if g["pci_address"] == pci)

    def faults(self, doc: dict, pci: str) -> dict:
        return self.gpu(doc, pci).setdefault("faults", {})

    def add(self, pci: str, *, cls: str = GPU_PCI_CLASS, driver: str | None = None, override: str = "") -> None:
        def add(doc: dict) -> None:
            if cls == GPU_PCI_CLASS:
                n = len(doc["gpus"])
                doc["gpus"].append(
                    {"uuid": f"GPU-test-{n}", "index": n, "pci_address": pci, "driver": driver or "", "base_driver": BASE, "driver_override": override}
                )
            else:
                assert not override, "the host file keeps no driver_override for other devices"
                doc["pci_devices"].append({"pci_address": pci, "pci_class": cls, "driver": driver or ""})

        self.edit(add)

    def fail_bind(self, pci: str, driver: str) -> None:
        self.edit(lambda doc: self.faults(doc, pci).setdefault("fail_bind", []).append(driver))

    def fail_unbind(self, pci: str) -> None:
        self.edit(lambda doc: self.faults(doc, pci).update(unbind="fail"))

    def hang_unbind(self, pci: str, leave: str) -> None:
        self.edit(lambda doc: self.faults(doc, pci).update(unbind="hang-unbound" if leave == "unbound" else "hang"))

    def vanish_at(self, pci: str, op: str) -> None:
        self.edit(lambda doc: self.faults(doc, pci).update(vanish_at=op))

    def unload(self, driver: str) -> None:
        self.port.unloaded.add(driver)

    def end_hang(self, pci: str) -> None:
        # a hung write never returns; the fake host's hang ends when it reboots
        self.edit(lambda doc: doc.update(boot_id="boot-2"))

    def fail_reset(self, pci: str) -> None:
        self.edit(lambda doc: self.faults(doc, pci).update(reset="fail"))

    def no_reset(self, pci: str) -> None:
        self.edit(lambda doc: self.faults(doc, pci).update(reset="unsupported"))

    def resets(self, pci: str) -> int:
        return self.gpu(self.doc(), pci).get("resets", 0)

    def close(self) -> None:
        # whatever the test did, the inventory can still read the file
        load_host_file(self.path)


BACKENDS = {"memory": MemHost, "sysfs": SysfsHost, "hostfile": FileHost}


@pytest.fixture(params=sorted(BACKENDS))
def host(request, tmp_path):
    h = BACKENDS[request.param](tmp_path)
    yield h
    h.close()


# --------------------------------------------------------------------------- the suite


def test_every_backend_is_a_driver_port(tmp_path):
    for backend in BACKENDS.values():
        assert isinstance(backend(tmp_path / backend.__name__).port, DriverPort)


def test_reads(host):
    host.add(GPU, driver=BASE)
    host.add(GPU2, override=VFIO_DRIVER)
    host.add(NIC, cls="0x020000", driver="mlx5_core")
    port = host.port
    assert port.exists(GPU) and port.exists(GPU2) and port.exists(NIC)
    assert not port.exists("0000:00:1f.0")
    assert port.is_gpu(GPU) and port.is_gpu(GPU2)
    assert not port.is_gpu(NIC) and not port.is_gpu("0000:00:1f.0")
    assert port.current_driver(GPU) == BASE
    assert port.current_driver(GPU2) is None
    assert port.current_driver(NIC) == "mlx5_core"
    assert port.current_driver("0000:00:1f.0") is None
    assert port.driver_override(GPU) == "" and port.driver_override(GPU2) == VFIO_DRIVER


@pytest.mark.parametrize(("cls", "gpu"), [("0x030000", True), ("0x030200", True), ("0x020000", False), ("0x010802", False)])
def test_is_gpu_by_pci_class(host, cls, gpu):
    host.add(GPU, cls=cls)
    assert host.port.is_gpu(GPU) is gpu


@pytest.mark.parametrize("bad", ["3b:00.0", "0000:3B:00.0", "0000:3b:00.0\n", "../0000:3b:00.0"])
async def test_a_non_canonical_address_is_refused_by_the_port_and_by_switch(host, bad):
    host.add(GPU, driver=BASE)
    with pytest.raises(ValueError):
        host.port.exists(bad)
    with pytest.raises(ValueError):
        await host.port.unbind(bad, T)
    result = await switch(host.port, bad, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert result.outcome is Outcome.REFUSED and result.reason == "InvalidAddress"
    assert host.port.current_driver(GPU) == BASE


async def test_a_non_gpu_is_refused_and_left_alone(host):
    host.add(NIC, cls="0x020000", driver="mlx5_core")
    result = await switch(host.port, NIC, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert (result.outcome, result.reason) == (Outcome.REFUSED, "NotAGPU")
    assert host.port.current_driver(NIC) == "mlx5_core"


# the switch table of test_vfio_switch, plus what it has no fault for: an unbind the driver refuses
EXTRA = [
    # prepare: the driver refuses to let go -> failed, still on it, override cleared
    ("vfio-unbind-fails", BASE, "", "vfio-pci", [("fail_unbind", None)],
     Outcome.FAILED, "UnbindFailed", EVENT_PREPARE_FAILED, BASE, "", True),
    # release: vfio-pci refuses to let go -> stuck on vfio-pci, a reboot is needed
    ("native-unbind-fails", VFIO_DRIVER, VFIO_DRIVER, "native", [("fail_unbind", None)],
     Outcome.DISRUPTION_REQUIRED, "UnbindFailed", EVENT_UNPREPARE_FAILED, VFIO_DRIVER, "", False),
    # release with a native driver whose probe fails, from no driver at all
    ("native-from-no-driver-bind-fails", None, VFIO_DRIVER, "native", [("fail_bind", BASE)],
     Outcome.DISRUPTION_REQUIRED, "BindFailed", EVENT_UNPREPARE_FAILED, None, "", False),
]


@pytest.mark.parametrize(
    ("initial", "override", "target", "faults", "outcome", "reason", "event", "final", "final_override", "rolled_back"),
    [c[1:] for c in [*CASES, *EXTRA]],
    ids=[c[0] for c in [*CASES, *EXTRA]],
)
async def test_switch(host, initial, override, target, faults, outcome, reason, event, final, final_override, rolled_back):
    host.add(GPU, driver=initial, override=override)
    host.add(GPU2, driver=BASE)  # a neighbour the switch must never touch
    for fault, arg in faults:
        if fault == "fail_bind":
            host.fail_bind(GPU, arg)
        elif fault == "fail_unbind":
            host.fail_unbind(GPU)
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
    assert result.pci == GPU and result.target == target and result.rolled_back is rolled_back
    if final_override is None:  # vanished
        assert not host.port.exists(GPU) and host.port.current_driver(GPU) is None
        assert "disappeared" in result.message and GPU in result.message
    else:
        assert host.port.current_driver(GPU) == final == result.driver
        assert host.port.driver_override(GPU) == final_override
    if outcome is Outcome.DISRUPTION_REQUIRED:
        assert result.reconfiguring == DISRUPTION_REQUIRED
        assert f"GPU {GPU}" in result.message and "reboot" in result.message
    if outcome is Outcome.FAILED and reason != "DeviceVanished":
        assert result.rolled_back and host.port.current_driver(GPU) == BASE
    assert host.port.current_driver(GPU2) == BASE and host.port.driver_override(GPU2) == ""


async def test_clean_prepare_and_unprepare_round_trip(host):
    host.add(GPU, driver=BASE)
    there = await switch(host.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert (there.outcome, there.event, there.driver) == (Outcome.SUCCEEDED, EVENT_PREPARE_SUCCEEDED, VFIO_DRIVER)
    assert host.port.driver_override(GPU) == VFIO_DRIVER
    again = await switch(host.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert again.outcome is Outcome.UNCHANGED
    back = await switch(host.port, GPU, "native", base_driver=BASE, timeout=T, held_by=nobody)
    assert (back.outcome, back.event, back.driver) == (Outcome.SUCCEEDED, None, BASE)
    assert host.port.current_driver(GPU) == BASE and host.port.driver_override(GPU) == ""


async def test_a_failed_bind_rolls_back_and_a_later_switch_can_work(host):
    host.add(GPU, driver=BASE)
    host.fail_bind(GPU, VFIO_DRIVER)
    failed = await switch(host.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert (failed.outcome, failed.reason, failed.rolled_back) == (Outcome.FAILED, "BindFailed", True)
    assert "rolled back to nvidia" in failed.message
    assert host.port.current_driver(GPU) == BASE and host.port.driver_override(GPU) == ""
    # the card is usable: a switch back is a no-op
    assert (await switch(host.port, GPU, "native", base_driver=BASE, timeout=T, held_by=nobody)).outcome is Outcome.UNCHANGED


@pytest.mark.parametrize("leave", ["unbound", "bound"])
async def test_a_hung_unbind_times_out_and_holds_the_device_lock(host, leave):
    host.add(GPU, driver=BASE)
    host.hang_unbind(GPU, leave)
    with pytest.raises(DriverTimeout, match=GPU):
        await host.port.unbind(GPU, T)
    assert host.port.current_driver(GPU) == (None if leave == "unbound" else BASE)
    assert host.port.pending_writes() == {GPU: "unbind"}
    with pytest.raises(DriverBusy, match="has not returned"):
        await host.port.set_driver_override(GPU, "", T)


async def test_a_hung_card_needs_the_hang_to_end_then_returns_to_native(host):
    """hang-unbound: DisruptionRequired; a retry fails fast (device lock); once the hang is over
    (for the fake host: a reboot) the card goes back to its native driver."""
    host.add(GPU, driver=BASE)
    host.hang_unbind(GPU, "unbound")
    first = await switch(host.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert (first.outcome, first.reason) == (Outcome.DISRUPTION_REQUIRED, "UnbindTimedOut")
    assert f"GPU {GPU}" in first.message and "reboot" in first.message
    retry = await switch(host.port, GPU, "native", base_driver=BASE, timeout=T, held_by=nobody)
    assert retry.outcome is Outcome.DISRUPTION_REQUIRED and "has not returned" in retry.message
    host.end_hang(GPU)
    assert host.port.pending_writes() == {}
    back = await switch(host.port, GPU, "native", base_driver=BASE, timeout=T, held_by=nobody)
    assert (back.outcome, back.driver) == (Outcome.SUCCEEDED, BASE), back.message
    assert host.port.driver_override(GPU) == ""


@pytest.mark.parametrize("op", ["unbind", "set_driver_override", "bind", "drivers_probe"])
async def test_a_vanished_device_does_not_exist(host, op):
    host.add(GPU, driver=BASE if op == "unbind" else None)
    host.vanish_at(GPU, op)
    write = {
        "unbind": lambda: host.port.unbind(GPU, T),
        "set_driver_override": lambda: host.port.set_driver_override(GPU, VFIO_DRIVER, T),
        "bind": lambda: host.port.bind(GPU, BASE, T),
        "drivers_probe": lambda: host.port.drivers_probe(GPU, T),
    }[op]
    with pytest.raises(DeviceVanished, match=GPU):
        await write()
    assert not host.port.exists(GPU) and not host.port.is_gpu(GPU) and host.port.current_driver(GPU) is None
    with pytest.raises(DeviceVanished):
        await host.port.set_driver_override(GPU, "", T)
    result = await switch(host.port, GPU, "native", base_driver=BASE, timeout=T, held_by=nobody)
    assert (result.outcome, result.reason) == (Outcome.REFUSED, "NoSuchDevice")


@pytest.mark.parametrize(("override", "expect"), [("", BASE), (VFIO_DRIVER, VFIO_DRIVER)])
async def test_drivers_probe_binds_to_the_override_or_the_native_driver(host, override, expect):
    host.add(GPU, override=override)
    await host.port.drivers_probe(GPU, T)
    assert host.port.current_driver(GPU) == expect


# --------------------------------------------------------------------------- the host file itself


@pytest.fixture
def example(tmp_path):
    path = tmp_path / "host.json"
    path.write_bytes(EXAMPLE.read_bytes())
    return path


def without_gpu_binding(doc: dict) -> dict:
    doc = json.loads(json.dumps(doc))
    for g in doc["gpus"]:
        for key in ("driver", "driver_override", "present", "faults"):
            g.pop(key, None)
    return doc


async def test_a_switch_on_the_example_host_changes_only_that_cards_binding(example):
    before = json.loads(example.read_text())
    port = FakeHostDriver(example)
    card = before["gpus"][3]["pci_address"]
    result = await switch(port, card, "vfio-pci", base_driver="nvidia", timeout=T, held_by=nobody)
    assert result.outcome is Outcome.SUCCEEDED
    after = json.loads(example.read_text())
    assert without_gpu_binding(after) == without_gpu_binding(before)  # every other key, in order
    assert list(after) == list(before)
    changed = [g["pci_address"] for g, b in zip(after["gpus"], before["gpus"], strict=True) if g != b]
    assert changed == [card]
    assert after["gpus"][3]["driver"] == "vfio-pci" and after["gpus"][3]["driver_override"] == "vfio-pci"
    # the inventory's own decoder still reads it, and sees the card on vfio-pci
    host = load_host_file(example)
    assert next(g for g in host.gpus if g.pci_address == card).driver == "vfio-pci"
    # atomic: no temp file left behind; the lock file is a hidden sibling
    assert sorted(p.name for p in example.parent.iterdir()) == [".host.json.lock", "host.json"]

    back = await switch(port, card, "native", base_driver="nvidia", timeout=T, held_by=nobody)
    assert back.outcome is Outcome.SUCCEEDED
    final = load_host_file(example)
    g3 = next(g for g in final.gpus if g.pci_address == card)
    assert (g3.driver, g3.driver_override) == ("nvidia", "")


async def test_faults_are_consumed_when_they_fire(tmp_path):
    h = FileHost(tmp_path)
    h.add(GPU, driver=BASE)
    h.fail_bind(GPU, VFIO_DRIVER)
    h.fail_bind(GPU, "other")
    h.fail_unbind(GPU)
    failed = await switch(h.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert failed.reason == "UnbindFailed"
    faults = h.gpu(h.doc(), GPU)["faults"]
    assert faults["unbind"] == "" and faults["fail_bind"] == [VFIO_DRIVER, "other"]  # bind was never reached
    failed = await switch(h.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert failed.reason == "BindFailed"
    assert h.gpu(h.doc(), GPU)["faults"]["fail_bind"] == ["other"]
    ok = await switch(h.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert ok.outcome is Outcome.SUCCEEDED
    h.close()


async def test_vanish_marks_the_card_absent_in_the_file(tmp_path):
    h = FileHost(tmp_path)
    h.add(GPU, driver=BASE)
    h.vanish_at(GPU, "unbind")
    result = await switch(h.port, GPU, "vfio-pci", base_driver=BASE, timeout=T, held_by=nobody)
    assert result.reason == "DeviceVanished"
    g = h.gpu(h.doc(), GPU)
    assert g["present"] is False and g["faults"]["vanish_at"] == ""
    assert g["driver"] == BASE and g["driver_override"] == VFIO_DRIVER  # what it had when it dropped off
    assert load_host_file(h.path).gpus[0].present is False


async def test_only_gpus_are_written(tmp_path):
    h = FileHost(tmp_path)
    h.add(NIC, cls="0x020000", driver="mlx5_core")
    with pytest.raises(DriverError, match="GPUs only"):
        await h.port.unbind(NIC, T)
    assert h.port.current_driver(NIC) == "mlx5_core"


async def test_concurrent_writers_do_not_lose_each_others_changes(example):
    """Two drivers (as two processes would) switch all eight cards at once; every change lands."""
    ports = [FakeHostDriver(example), FakeHostDriver(example)]
    cards = [g["pci_address"] for g in json.loads(example.read_text())["gpus"]]
    results = await asyncio.gather(
        *(switch(ports[i % 2], card, "vfio-pci", base_driver="nvidia", timeout=5, held_by=nobody) for i, card in enumerate(cards))
    )
    assert [r.outcome for r in results] == [Outcome.SUCCEEDED] * len(cards), [r.message for r in results]
    host = load_host_file(example)
    assert {(g.driver, g.driver_override) for g in host.gpus} == {(VFIO_DRIVER, VFIO_DRIVER)}


async def test_a_write_waits_for_the_lock_file(example):
    port = FakeHostDriver(example)
    card = json.loads(example.read_text())["gpus"][0]["pci_address"]
    fd = os.open(port.lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        write = asyncio.ensure_future(port.set_driver_override(card, VFIO_DRIVER, 5))
        done, _ = await asyncio.wait({write}, timeout=0.3)
        assert not done, "the write went ahead while another writer held the lock"
        assert port.driver_override(card) == ""
        fcntl.flock(fd, fcntl.LOCK_UN)
        await asyncio.wait_for(write, 5)
    finally:
        os.close(fd)
    assert port.driver_override(card) == VFIO_DRIVER


async def test_a_broken_host_file(tmp_path):
    path = tmp_path / "host.json"
    with pytest.raises(FakeHostError, match="cannot read"):
        FakeHostDriver(path)
    path.write_text(json.dumps({"boot_id": "b", "gpus": [{"pci_address": GPU, "driver": "nvidia"}]}))
    port = FakeHostDriver(path)
    path.write_text("{not json")
    with pytest.raises(FakeHostError, match="not valid JSON"):
        port.exists(GPU)
    with pytest.raises(DriverError, match="not valid JSON"):
        await port.unbind(GPU, T)
    path.write_text(json.dumps({"boot_id": "b", "gpus": [{"pci_address": GPU, "faults": {"unbind": "explode"}}]}))
    with pytest.raises(FakeHostError, match="unbind"):
        port.exists(GPU)


async def test_a_hang_survives_until_the_boot_id_changes_not_a_timeout(tmp_path):
    h = FileHost(tmp_path)
    h.add(GPU, driver=BASE)
    h.hang_unbind(GPU, "bound")
    with pytest.raises(DriverTimeout):
        await h.port.unbind(GPU, T)
    assert h.gpu(h.doc(), GPU)["faults"]["unbind"] == ""  # consumed
    for _ in range(2):  # the timeout is long past: still busy
        with pytest.raises(DriverBusy):
            await h.port.unbind(GPU, T)
    h.port.release(GPU)
    await h.port.unbind(GPU, T)
    assert h.port.current_driver(GPU) is None


# --------------------------------------------------------------------------- the service's holder rule


@pytest.mark.parametrize(
    ("held", "kind", "target", "holds"),
    [
        (False, "", "vfio-pci", False),
        (False, "", "native", False),
        (True, "allocation", "vfio-pci", True),
        (True, "allocation", "native", True),
        (True, "release", "vfio-pci", True),
        (True, "release", "native", True),
        (True, "domain", "native", True),
        (True, "domain", "vfio-pci", False),
        (True, "instance", "vfio-pci", False),
        (True, "instance", "native", False),
        # a DRA claim: holds; one that passes the card through asks its own switches
        (True, "claim", "vfio-pci", True),
        (True, "passthrough-claim", "vfio-pci", False),
        (True, "passthrough-claim", "native", False),
        (True, "", "native", True),  # held, kind unknown: fail closed
        (True, "something-new", "vfio-pci", True),
    ],
)
def test_holder_rule(held, kind, target, holds):
    got = holder_of(held, kind, "who", target)
    assert (got is not None) is holds
    if holds:
        assert got.endswith("who")


@pytest.mark.parametrize(
    ("held", "kind", "claimed"),
    [
        (True, "instance", True),
        (True, "passthrough-claim", True),
        (False, "", False),
        (False, "instance", False),  # not held: no claim, whatever the kind says
        (True, "domain", False),  # a VM running with it is no claim of the spec's
        (True, "claim", False),
        (True, "allocation", False),
        (True, "release", False),
        (True, "something-new", False),
    ],
)
def test_only_a_passthrough_claim_lets_a_card_go_to_vfio(held, kind, claimed):
    """Issue 40: a switch to vfio-pci needs the converger to say an instance or a passthrough claim wants it."""
    assert passthrough_claimed(held, kind) is claimed


# --------------------------------------------------------------------------- the sibling operation: a reset


@pytest.mark.parametrize(
    ("setup", "holder", "outcome", "reason", "resets"),
    [
        ("free", None, "Succeeded", "Reset", 1),
        ("held", "allocation a1", "Refused", "Held", 0),
        ("fail", None, "Failed", "ResetFailed", 0),
        ("unsupported", None, "Refused", "NotResettable", 0),
        ("not-a-gpu", None, "Refused", "NotAGPU", 0),
        ("absent", None, "Refused", "NoSuchDevice", 0),
    ],
)
async def test_reset(host, setup, holder, outcome, reason, resets):
    from services.vfio_switcher.switch import reset

    pci = "0000:3b:00.0"
    if setup == "not-a-gpu":
        host.add(pci, cls="0x020000", driver="mlx5_core")
    elif setup != "absent":
        host.add(pci, driver=BASE)
    if setup == "fail":
        host.fail_reset(pci)
    if setup == "unsupported":
        host.no_reset(pci)

    async def held_by(card: str) -> str | None:
        return holder

    result = await reset(host.port, pci, timeout=5.0, held_by=held_by)
    assert (result.outcome, result.reason) == (outcome, reason), result.message
    if setup not in ("not-a-gpu", "absent"):
        assert host.resets(pci) == resets
        # a reset leaves the binding alone
        assert host.port.current_driver(pci) == BASE
    if holder:
        assert result.message == f"refused {pci}: it is held by {holder}"


async def test_reset_asks_the_holder_and_fails_closed_without_an_answer(host):
    from services.vfio_switcher.switch import reset

    pci = "0000:3b:00.0"
    host.add(pci, driver=BASE)

    async def unknown(card: str) -> str | None:
        raise RuntimeError("the converger did not answer")

    result = await reset(host.port, pci, timeout=5.0, held_by=unknown)
    assert (result.outcome, result.reason) == ("Refused", "HolderUnknown") and host.resets(pci) == 0
    bad = await reset(host.port, "0000:3B:00.0", timeout=5.0, held_by=unknown)
    assert bad.reason == "InvalidAddress"


@pytest.mark.parametrize(
    ("kind", "target", "holds"),
    [("allocation", "reset", True), ("release", "reset", True), ("instance", "reset", True), ("domain", "reset", True), ("passthrough-claim", "reset", True)],
)
def test_every_claim_holds_a_card_against_a_reset(kind, target, holds):
    from services.vfio_switcher.service import holder_of

    assert (holder_of(True, kind, "x", target) is not None) is holds
    assert holder_of(False, kind, "x", target) is None
