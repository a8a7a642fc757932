"""The VFIO side of the converger as real processes: converger, inventory and
signer on a real node bus, on a copy of the example fake host.

vfio_switcher is played by a stand-in connected as the `vfio_switcher` NATS
user: it asks the converger who holds the card (as the real one does),
edits the host file's driver the way the kernel would, publishes the
SwitchReply on `vfio_switcher.result`, has the inventory rescan (as the `cli`
user) and answers. Specs go in as the bridge hands them over; failures are
read from the outbox, the record from the converger's state file.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from services.vfio_switcher.service import passthrough_claimed
from shared.runtime import call
from shared.schemas import (
    CLAIMS_CODEC,
    HOLDER_REPLY_CODEC,
    INVENTORY_CODEC,
    SWITCH_REPLY_CODEC,
    SWITCH_REQUEST_CODEC,
    Claims,
    DeviceAssignment,
    Empty,
    HolderQuery,
    InstanceGpus,
    NodeSpec,
    SwitchReply,
    SwitchRequest,
    encode,
)

from .harness import EXAMPLE_HOSTS
from .test_converger_service import GPU, Node, assignment

pytestmark = pytest.mark.integration

PCI = ["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0"]
BOOT_ID = "3f0c9a52-6e1d-4b8a-9c47-1d2e5f6a7b80"  # the example host's
RETRY_S = 0.3


async def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll an (async or plain) check until it returns something truthy."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


class StandInSwitcher:
    """vfio_switcher's contract, played on the fake host file.

    `script[pci]`: outcomes to answer for that card, in order (then Succeeded).
    DisruptionRequired leaves the card with no driver, as a hung unbind would.
    """

    def __init__(self, node: Node) -> None:
        self.node = node
        self.requests: list[SwitchRequest] = []
        self.script: dict[str, list[str]] = {}
        self.results: list[SwitchReply] = []

    async def start(self) -> None:
        self.nc = await self.node.bus.connect("vfio_switcher")
        self.cli = await self.node.bus.connect("cli")
        await self.nc.subscribe(self.node.subjects.vfio_switch, cb=self.on_request)

    def asked(self, pci: str | None = None) -> list[tuple[str, str]]:
        return [(r.pci, r.target) for r in self.requests if pci is None or r.pci == pci]

    def driver(self, pci: str) -> str:
        return next(g for g in json.loads(self.node.host_file.read_text())["gpus"] if g["pci_address"] == pci)["driver"]

    def set_driver(self, pci: str, driver: str, override: str) -> None:
        doc = json.loads(self.node.host_file.read_text())
        for g in doc["gpus"]:
            if g["pci_address"] == pci:
                g["driver"], g["driver_override"] = driver, override
        write_json(self.node.host_file, doc)

    async def on_request(self, msg: Any) -> None:
        req = SWITCH_REQUEST_CODEC.decode(msg.data)
        self.requests.append(req)
        want = "vfio-pci" if req.target == "vfio-pci" else "nvidia"
        # the real switcher refuses a card a live hold or pending release names
        holder = await call(self.nc, self.node.subjects.converger_holder, HolderQuery(gpu=req.pci), HOLDER_REPLY_CODEC)
        queued = self.script.get(req.pci)
        outcome = queued.pop(0) if queued else "Succeeded"
        reason = ""
        if holder.held and holder.kind in ("allocation", "release"):
            outcome, reason = "Refused", "Held"
        elif req.target == "vfio-pci" and not passthrough_claimed(holder.held, holder.kind):
            # the real switcher takes a card to vfio-pci only for the converger's passthrough claim
            outcome, reason = "Refused", "NotClaimed"
        event = ""
        if outcome == "Succeeded":
            if self.driver(req.pci) == want:
                outcome = "Unchanged"
            else:
                self.set_driver(req.pci, want, "vfio-pci" if want == "vfio-pci" else "")
                event = "VFIOPrepareSucceeded" if want == "vfio-pci" else ""
        elif outcome == "DisruptionRequired":
            self.set_driver(req.pci, "", "vfio-pci")
            event = "VFIOPrepareFailed"
        reply = SwitchReply(
            pci=req.pci,
            target=req.target,
            outcome=outcome,
            reason=reason or {"Succeeded": "Switched", "Unchanged": "AlreadyOnTarget", "Failed": "BindFailed"}.get(outcome, "UnbindTimedOut"),
            message=f"{outcome} (stand-in)",
            event=event,
            driver=self.driver(req.pci),
            holder=holder.holder if reason == "Held" else "",
            boot_id=BOOT_ID,
            why=req.why,
            at=datetime.now(timezone.utc),
        )
        self.results.append(reply)
        await self.nc.publish(self.node.subjects.vfio_result, SWITCH_REPLY_CODEC.encode(reply))
        # the inventory rescans on the notice; make sure it has, whatever it does with it
        await call(self.cli, self.node.subjects.inventory_rescan, Empty(), INVENTORY_CODEC)
        await msg.respond(encode(reply))


class VfioNode(Node):
    async def start_all(self, **converger_env: str) -> StandInSwitcher:
        await self.start()
        self.switcher = StandInSwitcher(self)
        await self.switcher.start()
        self.cli = await self.bus.connect("cli")
        self.notices: list[Claims] = []

        async def on_claims(msg: Any) -> None:
            self.notices.append(CLAIMS_CODEC.decode(msg.data))

        # heard where the inventory hears it (its own account imports the notice)
        listener = await self.bus.connect("inventory")
        await listener.subscribe(self.subjects.converger_claims_changed, cb=on_claims)
        await listener.flush()
        self.converger = self.start_converger(BCD_RETRY_INTERVAL=str(RETRY_S), **converger_env)
        self.ping = await self.bus.wait_service("converger")
        return self.switcher

    def state(self) -> dict:
        return json.loads((self.bus.root / "data" / "converger" / "state.json").read_text())

    async def claims(self) -> Claims:
        return await call(self.cli, self.subjects.converger_claims, Empty(), CLAIMS_CODEC)

    async def holder(self, pci: str):  # noqa: ANN201
        return await call(self.cli, self.subjects.converger_holder, HolderQuery(gpu=pci), HOLDER_REPLY_CODEC)

    async def failed(self, alloc: str) -> list[dict]:
        return [json.loads(d) for t, _, d in await self.outbox() if t == "failed" and json.loads(d)["allocation_id"] == alloc]

    async def passes_after(self, n: int = 4) -> None:
        """Let at least `n` retry passes run (the converger retries while anything waits)."""
        await asyncio.sleep(n * RETRY_S + 0.5)

    def metric(self, name: str) -> dict[tuple[str, ...], float]:
        text = urllib.request.urlopen(f"http://{self.ping['metadata']['metrics']}/metrics", timeout=5).read().decode()  # noqa: S310
        out = {}
        for line in text.splitlines():
            if line.startswith(name + "{"):
                labels, value = line[len(name) + 1 :].rsplit("} ", 1)
                out[tuple(sorted(labels.split(",")))] = float(value)
        return out


def spec(gen: int, *devices: DeviceAssignment, instances: dict[str, list[str]] | None = None) -> NodeSpec:
    return NodeSpec(
        node_id="node-1",
        generation=gen,
        devices=list(devices),
        instances=[InstanceGpus(instance_id=i, gpus=g) for i, g in (instances or {}).items()],
    )


def kube(alloc: str, *devices: str) -> DeviceAssignment:
    return DeviceAssignment(allocation_id=alloc, reservation_id=f"rsv-{alloc}", binding="BINDING_KUBERNETES", devices=list(devices))


def claims_of(c: Claims) -> set[tuple[str, str, str]]:
    return {(x.pci_address, x.kind, x.holder) for x in c.claims}


@pytest.fixture
def host_file(tmp_path):
    path = tmp_path / "host.json"
    path.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
    return path


@pytest.fixture
async def node(node_bus, host_file):
    return VfioNode(node_bus, host_file)


async def test_instances_switch_cards_holds_overlap_claims_and_disruption(node):
    sw = await node.start_all()

    # -- gen 1: a VM claims GPU 1; a hold on it in the same generation overlaps
    await node.push(spec(1, assignment("train", GPU[0]), assignment("early", GPU[1]), instances={"vm-1": [PCI[1]]}))
    st = await node.wait_section(1, "FAILED")
    assert st.section.message == "early: overlap"
    await wait_for("GPU 1 on vfio-pci", lambda: sw.driver(PCI[1]) == "vfio-pci")
    assert sw.requests[0] == SwitchRequest(pci=PCI[1], target="vfio-pci", why="instance vm-1")
    await wait_for("the record", lambda: node.state()["vfio"] == {PCI[1]: "vm-1"})
    failed = await node.failed("early")
    assert [f["reason"] for f in failed] == ["overlap"] and "vm-1" in failed[0]["message"]
    # the inventory shows it; claims list the hold and the instance, and the record
    await wait_for("the inventory to show vfio-pci", lambda: _gpu_driver(node, PCI[1], "vfio-pci"))
    c = await node.claims()
    assert claims_of(c) == {(PCI[0], "allocation", "train"), (PCI[1], "instance", "vm-1")}
    assert c.vfio == [PCI[1]] and c.generation == 1
    await wait_for("a claims notice with the record", lambda: any(n.vfio == [PCI[1]] for n in node.notices))
    await node.passes_after()
    assert sw.asked(PCI[1]) == [(PCI[1], "vfio-pci")], "asked once: a done switch is not asked for again"

    # -- gen 2: a hold on the VM's card in the next generation overlaps too
    await node.push(spec(2, assignment("train", GPU[0]), assignment("grab", GPU[1]), instances={"vm-1": [PCI[1]]}))
    st = await node.wait_section(2, "FAILED")
    assert st.section.message == "grab: overlap"
    failed = await node.failed("grab")
    assert failed and failed[-1]["message"] == f"{GPU[1]}: {GPU[1]} is claimed by instance vm-1"
    assert "grab" not in node.holds()
    h = await node.holder(PCI[1])
    assert (h.held, h.kind, h.holder) == (True, "instance", "vm-1")

    # -- gen 3: the claim goes: back to native, the record dropped
    await node.push(spec(3, assignment("train", GPU[0])))
    await node.wait_section(3, "CONVERGED")
    await wait_for("GPU 1 back on nvidia", lambda: sw.driver(PCI[1]) == "nvidia")
    await wait_for("the record dropped", lambda: node.state()["vfio"] == {})
    assert sw.asked(PCI[1]) == [(PCI[1], "vfio-pci"), (PCI[1], "native")]
    assert sw.requests[-1].why == "instance vm-1 no longer claims it"
    await wait_for("claims without the record", lambda: _claims_match(node, {(PCI[0], "allocation", "train")}, []))

    # -- gen 4: an instance on a held card waits; gen 5 drops the hold and the card goes in the same pass
    await node.push(spec(4, assignment("train", GPU[0]), instances={"vm-2": [PCI[0]]}))
    await node.wait_section(4, "CONVERGED")
    await node.passes_after()
    assert sw.asked(PCI[0]) == [], "no switch while a hold names the card"
    assert node.state()["vfio"] == {}
    c = await node.claims()
    assert claims_of(c) == {(PCI[0], "allocation", "train"), (PCI[0], "instance", "vm-2")}
    assert c.claims[0].kind == "allocation"
    assert (await node.holder(PCI[0])).holder == "train"
    await node.push(spec(5, kube("k1", GPU[2]), instances={"vm-2": [PCI[0]]}))
    await node.wait_section(5, "CONVERGED")
    await wait_for("GPU 0 on vfio-pci", lambda: sw.driver(PCI[0]) == "vfio-pci")
    assert sw.asked(PCI[0]) == [(PCI[0], "vfio-pci")]
    await wait_for("the record", lambda: node.state()["vfio"] == {PCI[0]: "vm-2"})

    # -- gen 6: the Kubernetes hold goes; no kube_reaper here, so its release stays pending
    #    and its card claimed; an instance on that card waits for it
    await node.push(spec(6, instances={"vm-2": [PCI[0]], "vm-3": [PCI[2]]}))
    await node.wait_section(6, "CONVERGED")
    await wait_for(
        "claims: instance, pending release, record",
        lambda: _claims_match(node, {(PCI[0], "instance", "vm-2"), (PCI[2], "release", "k1"), (PCI[2], "instance", "vm-3")}, [PCI[0]]),
    )
    await node.passes_after()
    assert sw.asked(PCI[2]) == [], "no switch while a pending release names the card"
    assert (await node.holder(PCI[2])).kind == "release"

    # -- gen 7: the switcher cannot roll GPU 3 back (DisruptionRequired): not asked again in this
    #    boot; GPU 4 fails once and is retried
    sw.script = {PCI[3]: ["DisruptionRequired"], PCI[4]: ["Failed"]}
    await node.push(spec(7, instances={"vm-2": [PCI[0]], "vm-3": [PCI[2]], "vm-4": [PCI[3], PCI[4]]}))
    await node.wait_section(7, "CONVERGED")
    await wait_for("GPU 4 on vfio-pci after a retry", lambda: sw.driver(PCI[4]) == "vfio-pci")
    assert sw.asked(PCI[4]) == [(PCI[4], "vfio-pci")] * 2
    await wait_for("GPU 3 stuck", lambda: node.state()["vfio_stuck"] == {PCI[3]: BOOT_ID})
    await node.passes_after(6)  # the pending release keeps the converger retrying
    assert sw.asked(PCI[3]) == [(PCI[3], "vfio-pci")], "DisruptionRequired is not retried in this boot"
    assert node.state()["vfio"] == {PCI[0]: "vm-2", PCI[3]: "vm-4", PCI[4]: "vm-4"}
    # the section never read anything but converged for the VFIO side
    assert (await node.status()).section.state == "CONVERGED"
    assert "DisruptionRequired" not in (await node.status()).section.message

    counts = node.metric("bcd_vfio_switch_requests_total")
    assert counts == {
        ('outcome="Succeeded"', 'target="vfio-pci"'): 3.0,
        ('outcome="Succeeded"', 'target="native"'): 1.0,
        ('outcome="Failed"', 'target="vfio-pci"'): 1.0,
        ('outcome="DisruptionRequired"', 'target="vfio-pci"'): 1.0,
    }


async def _gpu_driver(node: VfioNode, pci: str, driver: str) -> bool:
    inv = await call(node.cli, node.subjects.inventory_get, Empty(), INVENTORY_CODEC)
    return next(g for g in inv.gpus if g.pci_address == pci).driver == driver


async def _claims_match(node: VfioNode, claims: set[tuple[str, str, str]], vfio: list[str]) -> bool:
    c = await node.claims()
    return claims_of(c) == claims and c.vfio == vfio


async def test_killed_between_the_record_and_the_switch_converges_on_restart(node):
    sw = await node.start_all(BCD_CONVERGER_CRASH_AT="vfio.recorded")
    await node.push(spec(1, instances={"vm-1": [PCI[1]]}))
    code = await asyncio.to_thread(node.converger.wait, 30)
    assert code == -9, node.converger.log()[-2000:]
    assert node.state()["vfio"] == {PCI[1]: "vm-1"}
    assert sw.requests == []

    node.start_converger(BCD_RETRY_INTERVAL=str(RETRY_S))
    await node.bus.wait_service("converger")
    await wait_for("GPU 1 on vfio-pci", lambda: sw.driver(PCI[1]) == "vfio-pci")
    await node.wait_section(1, "CONVERGED")
    assert sw.asked() == [(PCI[1], "vfio-pci")]
    assert node.state()["vfio"] == {PCI[1]: "vm-1"}
    # a claims notice went out at start
    await wait_for("claims notice", lambda: any(n.vfio == [PCI[1]] for n in node.notices))
