"""The root helper as a real process on a real node bus.

It answers the converger's user only (every other user's request is a
permissions violation on the bus), writes what the converger's
HelperHostWriter asks over a connection of its own (BusHelperTransport),
refuses malicious requests with a reason and writes nothing for them, and
stops cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import msgspec
import nats.errors
import pytest

from services.converger.hostwriter import BusHelperTransport, HelperHostWriter, HostWriteError, helper_connector
from shared.holdfiles import VendorCache, hold_file_bytes, hold_to_wire
from shared.runtime import call
from shared.schemas import HELPER_INFO_CODEC, HELPER_REPLY_CODEC, INVENTORY_CODEC, Empty, HelperFileWrite, Limits, encode
from shared.subjects import NodeSubjects

from .harness import EXAMPLE_HOSTS

pytestmark = pytest.mark.integration

S = NodeSubjects("node-1")


def contents():
    from tests.unit.test_helper_ops import CONTENTS

    return CONTENTS


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
async def helper(node_bus):
    cdi = node_bus.root / "cdi"
    cdi.mkdir()
    vendor = json.loads((EXAMPLE_HOSTS / "h200x8.json").read_text())["vendor_cdi_spec"]
    (cdi / "nvidia.json").write_text(json.dumps(vendor))
    (node_bus.root / "run").mkdir()
    # not a fake host: the slice backend is named (fake JSON records; never systemd here)
    sp = node_bus.start_service("helper", BCD_SLICES="fake", BCD_MPS_PIPE_DIR="/tmp/nvidia-mps")
    await node_bus.wait_service("helper")
    return sp


def converger_opts(bus) -> argparse.Namespace:
    return argparse.Namespace(nats_url=bus.url, nats_user="converger", nats_password_file=bus.creds["converger"])


async def test_the_converger_writes_through_the_helper_over_the_bus(node_bus, helper) -> None:
    root = node_bus.root
    nc = await node_bus.connect("converger")
    info = await call(nc, S.helper_info, Empty(), HELPER_INFO_CODEC)
    assert (info.cdi_dir, info.run_dir, info.slices) == (os.path.realpath(root / "cdi"), os.path.realpath(root / "run"), "fake")
    assert info.euid == os.geteuid()

    writer = HelperHostWriter(BusHelperTransport(helper_connector(converger_opts(node_bus))), S, root / "cdi", root / "run", slices_backend="fake")
    try:
        c = contents()["sliced-whole-gpu"]
        await asyncio.to_thread(writer.apply_slice, c.allocation_id, c.limits)
        await asyncio.to_thread(writer.write_cdi, c)
        await asyncio.to_thread(writer.write_env, c)
        vendor = VendorCache(root / "cdi").get()
        assert (root / "cdi" / "bcd-whole.json").read_bytes() == hold_file_bytes("cdi", c, vendor)
        assert (root / "run" / "allocations" / "whole.env").read_bytes() == hold_file_bytes("allocation-env", c, None)
        record = json.loads((root / "run" / "slices" / "bcd-alloc-whole.slice.json").read_text())
        assert record["name"] == "bcd-alloc-whole.slice" and record["properties"]["MemoryMax"] == c.limits.memory_bytes
        # a refusal comes back as a HostWriteError with the helper's reason
        with pytest.raises(HostWriteError, match="root helper refused: .*above the highest"):
            await asyncio.to_thread(writer.apply_slice, "big", Limits(cpus="0-9000"))
        assert await asyncio.to_thread(writer.stop_slice, c.allocation_id)
        await asyncio.to_thread(writer.remove_cdi, c.allocation_id)
        await asyncio.to_thread(writer.remove_env, c.allocation_id)
        assert sorted(tree(root / "cdi")) == ["nvidia.json"] and tree(root / "run") == {}
    finally:
        await asyncio.to_thread(writer.close)
    log = helper.log()
    assert '"operation done"' in log and f"{os.path.realpath(root / 'cdi')}/bcd-whole.json" in log
    assert '"request refused"' in log and "above the highest" in log


async def test_malicious_requests_are_refused_over_the_bus_and_write_nothing(node_bus, helper) -> None:
    root = node_bus.root
    nc = await node_bus.connect("converger")
    good = msgspec.to_builtins(hold_to_wire(contents()["two-gpus"]))
    before = tree(root / "cdi") | tree(root / "run")
    for subject, body, reason in [
        (S.helper_file_write, {"kind": "cdi", "hold": {**good, "allocation_id": "../x"}}, "not a valid id"),
        (S.helper_file_write, {"kind": "cdi", "hold": {**good, "hooks": [{"hookName": "createRuntime", "path": "/bin/sh"}]}}, "unknown field `hooks`"),
        (S.helper_file_write, {"kind": "allocation-env", "hold": {**good, "env": ["NVIDIA_VISIBLE_DEVICES=all"]}}, "not allowed"),
        # env that steers the loader or the runtime's root hook, each hop (issue 40): the helper too
        (S.helper_file_write, {"kind": "allocation-env", "hold": {**good, "env": ["A=1", "LD_PRELOAD=/tmp/x.so"]}}, "LD_PRELOAD steers the dynamic loader"),
        (S.helper_file_write, {"kind": "cdi", "hold": {**good, "env": ["NVIDIA_DRIVER_CAPABILITIES=all"]}}, "NVIDIA container toolkit's root hook"),
        (S.helper_file_write, {"kind": "cdi", "hold": {**good, "env": ["PATH=/tmp"]}}, "PATH decides which program"),
        (S.helper_file_remove, {"kind": "cdi", "allocation_id": "a/b"}, "not a valid id"),
        (S.helper_slice_apply, {"allocation_id": "system.slice", "limits": {"cpus": "0"}}, "not a valid id"),
        (S.helper_slice_apply, {"allocation_id": "x", "limits": {"cpus": "0-9999"}}, "above the highest"),
        (S.helper_slice_remove, {"allocation_id": "-"}, "not a valid id"),
    ]:
        msg = await nc.request(subject, json.dumps(body).encode(), timeout=5)
        reply = HELPER_REPLY_CODEC.decode(msg.data)
        assert (reply.ok, reply.outcome) == (False, "refused") and reason in reply.reason, (subject, reply)
    msg = await nc.request(S.helper_file_write, b"\x00not json", timeout=5)
    assert HELPER_REPLY_CODEC.decode(msg.data).outcome == "refused"
    assert tree(root / "cdi") | tree(root / "run") == before
    assert helper.proc.poll() is None


async def test_no_other_user_reaches_the_helper(node_bus, helper) -> None:
    body = encode(HelperFileWrite(kind="cdi", hold=hold_to_wire(contents()["two-gpus"])))
    users = ("inventory", "gateway_bridge", "kube_reaper", "vfio_switcher", "signer", "cli")
    errors: dict[str, list[str]] = {u: [] for u in users}

    async def attempt(user: str) -> None:
        async def on_error(exc: Exception) -> None:
            errors[user].append(str(exc))

        nc = await node_bus.connect(user, error_cb=on_error)
        for subject in (S.helper_file_write, S.helper_slice_apply, S.helper_info):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                await nc.request(subject, body, timeout=0.3)
        for _ in range(40):
            if errors[user]:
                break
            await asyncio.sleep(0.05)
        await nc.close()

    await asyncio.gather(*(attempt(u) for u in users))
    for user in users:
        assert any("permissions violation" in e.lower() for e in errors[user]), (user, errors[user])
    assert not (node_bus.root / "cdi" / "bcd-two.json").exists()
    assert '"operation done"' not in helper.log()


async def test_a_missing_helper_is_a_host_write_error(node_bus) -> None:
    root = node_bus.root
    writer = HelperHostWriter(BusHelperTransport(helper_connector(converger_opts(node_bus))), S, root / "cdi", root / "run")
    try:
        with pytest.raises(HostWriteError, match="root helper not running"):
            await asyncio.to_thread(writer.remove_cdi, "a1")
    finally:
        await asyncio.to_thread(writer.close)


async def test_a_card_passed_through_is_written_only_for_its_listed_group(node_bus, tmp_path) -> None:
    """The helper asks the inventory over the bus (its one publish permission) and reads the
    group itself before it names /dev/vfio/<N>; no inventory answering refuses (issue 40)."""
    from tests.unit.test_helper_iommu import CARD, CLAIM, OTHER, FakeSysfs, inventory, passthrough

    sysfs = FakeSysfs(tmp_path / "sys")
    sysfs.function(CARD["pci_address"], "0x030200", 20)
    sysfs.function("0000:c1:00.0", "0x020000", 42)
    (node_bus.root / "cdi").mkdir()
    (node_bus.root / "run").mkdir()
    helper = node_bus.start_service("helper", BCD_SLICES="fake", BCD_MPS_PIPE_DIR="/tmp/nvidia-mps", BCD_SYSFS_ROOT=str(sysfs.root))
    await node_bus.wait_service("helper")
    nc = await node_bus.connect("converger")

    async def write(group: int) -> object:
        body = encode(HelperFileWrite(kind="cdi", hold=hold_to_wire(passthrough(CARD, group))))
        return HELPER_REPLY_CODEC.decode((await nc.request(S.helper_file_write, body, timeout=15)).data)

    # nobody answers inventory.get: refused, fail closed
    r = await write(20)
    assert r.outcome == "refused" and "the inventory did not say which GPU IOMMU group 20 is" in r.reason, r
    # the inventory answers (as its own NATS user)
    inv = await node_bus.connect("inventory")

    async def answer(msg) -> None:
        await msg.respond(INVENTORY_CODEC.encode(inventory(CARD, OTHER)))

    await inv.subscribe(S.inventory_get, cb=answer)
    await inv.flush()
    r = await write(42)
    assert r.outcome == "refused" and "in IOMMU group 20, not 42" in r.reason, r
    assert tree(node_bus.root / "cdi") == {}
    r = await write(20)
    assert r.ok, r
    spec = json.loads((node_bus.root / "cdi" / f"bcd-{CLAIM}.json").read_text())
    assert spec["devices"][0]["containerEdits"] == {"deviceNodes": [{"path": "/dev/vfio/20"}]}
    assert helper.proc.poll() is None
