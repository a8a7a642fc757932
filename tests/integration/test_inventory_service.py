"""The inventory as a real process on a real node bus, on the example fake host."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from shared.runtime import ServiceCallError, call
from shared.schemas import INVENTORY_CODEC, Empty
from shared.subjects import NodeSubjects

from .harness import EXAMPLE_HOSTS

pytestmark = pytest.mark.integration


def expected_atoms(host: dict) -> set[str]:
    """Atom ids derived straight from the host file, independently of the service."""
    atoms = set()
    for g in host["gpus"]:
        atoms.add(g["uuid"])
        for m in g.get("mig_instances", []):
            atoms.add(f"{g['uuid']}/gi{m['gi']}/ci{m['ci']}")
        for k in range(g.get("slots", 0)):
            atoms.add(f"{g['uuid']}/slot{k}")
    return atoms


def write_host(path: Path, host: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(host))
    os.replace(tmp, path)


@pytest.fixture
def host_file(tmp_path):
    path = tmp_path / "host.json"
    path.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
    return path


async def start_inventory(node_bus, host_file, **env):
    node_bus.start_service(
        "inventory", BCD_ADAPTER="fakehw", BCD_FAKE_HOST=str(host_file), BCD_CDI_DIR=str(node_bus.root / "cdi"), **env
    )
    await node_bus.wait_service("inventory")


async def test_publishes_the_example_hosts_atoms_to_kv_and_answers_get(node_bus, host_file):
    host = json.loads(host_file.read_text())
    await start_inventory(node_bus, host_file)
    subjects = NodeSubjects(node_bus.node_id)

    nc = await node_bus.connect("cli")
    # the bucket as it is, in the store account (the bus setup made it; the inventory puts its key)
    admin = await node_bus.connect("admin")
    kv = await admin.jetstream().key_value(subjects.inventory_bucket)
    entry = await kv.get(node_bus.node_id)
    published = INVENTORY_CODEC.decode(entry.value)

    atoms = {a.id for a in published.atoms}
    assert atoms == expected_atoms(host)
    assert len(atoms) == 8 + 4 + 4 + 4 + 4  # 8 GPUs, 2 x 4 slots, MIG instances on cards 6 and 7
    assert {a.kind for a in published.atoms} == {"gpu", "mig", "slot"}
    assert published.node_id == "node-1" and published.boot_id == host["boot_id"]
    assert published.revision >= 1
    assert [n.node for n in published.host.numa_nodes] == [0, 1]
    assert all(p.page_size_kib in (2048, 1048576) for n in published.host.numa_nodes for p in n.hugepages)
    assert published.host.memory_bytes == host["memory"]["total_bytes"]
    mig_cards = [g for g in published.gpus if g.mig_mode]
    assert len(mig_cards) == 2 and all(g.mig_instances and not g.slots for g in mig_cards)
    assert all(g.status.phase == "Ready" for g in published.gpus)

    got = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC)
    assert got == published

    # the fake host's vendor CDI spec was "written by the toolkit" into the CDI dir
    vendor = json.loads((node_bus.root / "cdi" / "nvidia.json").read_text())
    assert vendor["kind"] == "nvidia.com/gpu"


async def test_republishes_on_change_only(node_bus, host_file):
    await start_inventory(node_bus, host_file)
    subjects = NodeSubjects(node_bus.node_id)
    nc = await node_bus.connect("converger")
    changes: asyncio.Queue = asyncio.Queue()

    async def on_changed(msg):
        await changes.put(INVENTORY_CODEC.decode(msg.data))

    await nc.subscribe(subjects.inventory_changed, cb=on_changed)
    await nc.flush()
    first = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC)
    # an operator asks for rescans; the converger only listens
    op = await node_bus.connect("cli")

    same = await call(op, subjects.inventory_rescan, Empty(), INVENTORY_CODEC, timeout=10)
    assert same.revision == first.revision
    assert changes.empty()

    host = json.loads(host_file.read_text())
    host["gpus"][7]["mig_instances"].append({"gi": 14, "ci": 0, "profile": "1g.18gb", "uuid": "MIG-00000000-0007-4014-8000-000000000099", "memory_bytes": 18790481920})
    host["gpus"][0]["driver"] = "vfio-pci"
    write_host(host_file, host)

    changed = await call(op, subjects.inventory_rescan, Empty(), INVENTORY_CODEC, timeout=10)
    assert changed.revision == first.revision + 1
    assert f"{host['gpus'][7]['uuid']}/gi14/ci0" in {a.id for a in changed.atoms}
    card0 = next(g for g in changed.gpus if g.index == 0)
    assert card0.driver == "vfio-pci" and card0.status.phase == "Passthrough"
    assert card0.status.driver_binding.mode == "Passthrough"
    pushed = await asyncio.wait_for(changes.get(), 5)
    assert pushed.revision == changed.revision


async def test_a_peer_that_hears_the_start_notice_can_read_the_inventory_at_once(node_bus, host_file):
    """A peer that waited for the inventory reads it when the notice comes: at start the
    scan's notice went out before `inventory.get` answered (and before the GPU events'
    1 s outbox probe), so the converger's pass read "no responders" and slept 30 s."""
    subjects = NodeSubjects(node_bus.node_id)
    nc = await node_bus.connect("converger")
    answered: asyncio.Queue = asyncio.Queue()

    async def on_changed(msg):
        notice = INVENTORY_CODEC.decode(msg.data)
        try:
            got = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=0.3)
        except ServiceCallError:
            return
        await answered.put((notice, got))

    await nc.subscribe(subjects.inventory_changed, cb=on_changed)
    await nc.flush()
    # the bridge listens on the outbox subjects for its wake-up: with no outbox stream
    # yet, a GPU event's publish then waits out its probe instead of failing at once
    bridge = await node_bus.connect("gateway_bridge")

    async def woken(_msg) -> None:
        pass

    await bridge.subscribe(subjects.outbox_filter, cb=woken)
    await bridge.flush()
    node_bus.start_service("inventory", BCD_ADAPTER="fakehw", BCD_FAKE_HOST=str(host_file), BCD_CDI_DIR=str(node_bus.root / "cdi"))
    notice, got = await asyncio.wait_for(answered.get(), 10)
    assert got.revision == notice.revision and got.gpus


async def test_periodic_rescan_picks_up_changes_without_a_request(node_bus, host_file):
    await start_inventory(node_bus, host_file, BCD_RESCAN_INTERVAL="0.3")
    subjects = NodeSubjects(node_bus.node_id)
    nc = await node_bus.connect("cli")
    first = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC)
    host = json.loads(host_file.read_text())
    host["gpus"][4]["slots"] = 2
    write_host(host_file, host)
    for _ in range(50):
        now = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC)
        if now.revision > first.revision:
            break
        await asyncio.sleep(0.1)
    slots = [a.id for a in now.atoms if a.kind == "slot" and a.gpu_uuid == host["gpus"][4]["uuid"]]
    assert len(slots) == 2


async def test_revision_continues_across_restarts(node_bus, host_file):
    await start_inventory(node_bus, host_file)
    nc = await node_bus.connect("cli")
    subjects = NodeSubjects(node_bus.node_id)
    before = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC)
    assert node_bus.services[-1].stop() == 0
    await start_inventory(node_bus, host_file)
    after = await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC)
    assert after.revision == before.revision


async def test_bad_requests_are_answered_and_the_service_lives(node_bus, host_file):
    await start_inventory(node_bus, host_file)
    nc = await node_bus.connect("cli")
    subjects = NodeSubjects(node_bus.node_id)
    with pytest.raises(ServiceCallError) as err:
        await call(nc, subjects.inventory_get, b"[1, 2", INVENTORY_CODEC)
    assert err.value.code == "400"
    assert (await call(nc, subjects.inventory_get, Empty(), INVENTORY_CODEC)).gpus


async def test_nvidia_adapter_without_nvml_fails_with_a_clear_message(node_bus):
    sp = node_bus.start_service("inventory", BCD_ADAPTER="nvidia")
    code = await asyncio.to_thread(sp.wait, 30)
    log = sp.log()
    assert code == 2
    assert "NVML is not available on this host" in log
    assert "Traceback" not in log


async def test_srv_ping_finds_every_running_service(node_bus, host_file):
    node_bus.start_service("signer", BCD_FAKE_HOST=str(host_file))
    await start_inventory(node_bus, host_file)
    await node_bus.wait_service("signer")
    nc = await node_bus.connect("cli")
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.PING", b"", reply=inbox)
    names = set()
    try:
        while True:
            msg = await sub.next_msg(timeout=1.0)
            names.add(json.loads(msg.data)["name"])
    except Exception:  # noqa: BLE001 - timeout ends the collection
        pass
    await sub.unsubscribe()
    assert names == {"inventory", "signer"}
    info = json.loads((await nc.request("$SRV.INFO.inventory", b"", timeout=2)).data)
    assert {e["subject"] for e in info["endpoints"]} == {
        "bcd.node-1.inventory.get",
        "bcd.node-1.inventory.rescan",
        "bcd.node-1.inventory.gpu",
        "bcd.node-1.inventory.diag",
        "bcd.node-1.inventory.mig_layout",
        "bcd.node-1.inventory.mig_instance",
        "bcd.node-1.inventory.sharing",
    }
    stats = json.loads((await nc.request("$SRV.STATS.signer", b"", timeout=2)).data)
    assert {e["name"] for e in stats["endpoints"]} == {"sign", "sign_batch", "key"}
