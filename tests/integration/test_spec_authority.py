"""Issue 40, from outside: the converger believes only the control plane's signature, and no hop runs unchecked.

A real node bus, the real signer, inventory and converger on the 8 x H200
fake host. What an attacker who reaches `converger.spec` tries - an unsigned
envelope, one signed by another key, the control plane's signature over one
spec carried with another, the control plane's spec for another node - is sent
straight to the converger as the bridge's NATS user (the one user the bus lets
publish there): each is refused 400 with its reason and logged, no hold file
appears, the applied generation does not move. A restart verifies the kept
spec again (a key taken out of the configuration takes its specs with it).
Without a key the bridge and the converger do not start; the lab opt-out
starts them and says so.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import msgspec
import pytest

from shared.runtime import ServiceCallError, call
from shared.schemas import CONVERGER_STATUS_CODEC, SPEC_ACK_CODEC, DeviceAssignment, Empty, NodeSpec, encode
from shared.signing import Ed25519PrivateKey, sign_node_spec, unsigned_node_spec
from shared.spectrust import NO_KEY
from shared.subjects import NodeSubjects

from .harness import EXAMPLE_HOSTS, NodeBus, ServiceProcess, signed_spec, wait_until

pytestmark = pytest.mark.integration

GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]
FORGER = Ed25519PrivateKey.generate()


def hold(alloc: str, gpu: str) -> DeviceAssignment:
    return DeviceAssignment(allocation_id=alloc, reservation_id=f"rsv-{alloc}", binding="BINDING_HOLD", devices=[gpu])


GOOD = NodeSpec(node_id="node-1", generation=1, devices=[hold("good", GPU[0])])
#: what the attacker wants applied: a far generation (locking the control plane out) and a hold of its own
EVIL = NodeSpec(node_id="node-1", generation=1000, devices=[hold("good", GPU[0]), hold("evil", GPU[1])])



def metric(ping: dict, name: str) -> float:
    text = urllib.request.urlopen(f"http://{ping['metadata']['metrics']}/metrics", timeout=5).read().decode()  # noqa: S310
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


class Node:
    def __init__(self, bus: NodeBus, root: Path) -> None:
        self.bus = bus
        self.subjects = NodeSubjects(bus.node_id)
        self.host = root / "host.json"
        self.host.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
        self.cdi = root / "cdi"

    def fake(self, **extra: str) -> dict[str, str]:
        return {"BCD_FAKE_HOST": str(self.host), "BCD_ADAPTER": "fakehw", **extra}

    async def start(self) -> None:
        self.bus.start_service("signer", **self.fake())
        self.bus.start_service("inventory", **self.fake())
        await self.bus.wait_service("signer")
        await self.bus.wait_service("inventory")
        # the one NATS user that may publish on converger.spec: what a compromised bridge, or
        # anything that makes the server deliver there (the JetStream tricks of the issue), reaches
        self.bridge = await self.bus.connect("gateway_bridge")
        self.cli = await self.bus.connect("cli")

    async def start_converger(self, **extra: str) -> ServiceProcess:
        sp = self.bus.start_service("converger", **self.fake(**extra))
        await self.bus.wait_service("converger")
        return sp

    async def send(self, envelope: bytes):
        return await call(self.bridge, self.subjects.converger_spec, envelope, SPEC_ACK_CODEC, timeout=5)

    async def status(self):
        return await call(self.cli, self.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=5)

    def holds(self) -> set[str]:
        return {p.name[4:-5] for p in self.cdi.glob("bcd-*.json")}

    async def converged(self, generation: int) -> None:
        async def there():
            st = await self.status()
            return st.section is not None and st.section.observed_generation == generation and st.section.state == "CONVERGED"

        await wait_until(there, 30, f"generation {generation} converged")


@pytest.fixture
async def node(node_bus, tmp_path):
    n = Node(node_bus, tmp_path)
    await n.start()
    return n


def attacks(bus: NodeBus) -> list[tuple[str, bytes, str]]:
    """(what, envelope, the reason the refusal must name)."""
    signed_evil = sign_node_spec(bus.cp_key, EVIL)
    swapped = msgspec.structs.replace(sign_node_spec(bus.cp_key, NodeSpec(node_id="node-1", generation=2)), spec=signed_evil.spec)
    return [
        ("an unsigned envelope (the issue's spec, as inventory put it)", encode(unsigned_node_spec(EVIL)), "key_id '' is not a configured control-plane key"),
        ("signed by another key", bus.signed_spec(EVIL, key=FORGER), "is not a configured control-plane key"),
        ("another key's signature under the control plane's key id", encode(msgspec.structs.replace(sign_node_spec(FORGER, EVIL), key_id=signed_evil.key_id)), "signature does not verify"),
        ("the control plane's signature over generation 2, carrying generation 1000", encode(swapped), "signature does not verify"),
        ("the control plane's own spec for another node", bus.signed_spec(msgspec.structs.replace(EVIL, node_id="node-2")), "names node node-2, this is node-1"),
        ("a bare NodeSpec, as the converger took them before", encode(EVIL), "missing required field `spec`"),
    ]


async def test_forged_specs_sent_straight_to_the_converger_are_refused_and_change_nothing(node):
    conv = await node.start_converger()
    assert (await node.send(node.bus.signed_spec(GOOD))).generation == 1
    await node.converged(1)
    assert node.holds() == {"good"}
    spec_file = node.bus.root / "data" / "converger" / "spec.json"
    kept = spec_file.read_bytes()

    for what, envelope, reason in attacks(node.bus):
        with pytest.raises(ServiceCallError) as err:
            await node.send(envelope)
        assert err.value.code == "400" and reason in err.value.description, (what, err.value)
        st = await node.status()
        assert st.generation == 1, what
        assert node.holds() == {"good"}, what
        assert spec_file.read_bytes() == kept, what
    # each said in the converger's log: refused by the signature check, or (no envelope at all) at the boundary
    lines = conv.log_lines()
    refusals = [e for e in lines if e.get("msg") == "node spec refused; nothing applied"]
    assert len(refusals) == len(attacks(node.bus)) - 1 and all(e["level"] == "WARNING" and e["applied_generation"] == 1 for e in refusals)
    assert [e["level"] for e in lines if e.get("msg") == "bad request" and "missing required field `spec`" in e.get("error", "")] == ["WARNING"]

    # and nothing the attacker sent moved the floor: the control plane's next generation is taken at once
    assert (await node.send(node.bus.signed_spec(NodeSpec(node_id="node-1", generation=2, devices=[hold("good", GPU[0])])))).generation == 2
    await node.converged(2)
    assert node.holds() == {"good"}


async def test_a_restart_verifies_the_kept_spec_again(node, tmp_path):
    conv = await node.start_converger()
    await node.send(node.bus.signed_spec(GOOD))
    await node.converged(1)
    assert conv.stop() == 0

    # the same key: the kept envelope verifies, the node converges without the control plane
    conv = await node.start_converger()
    assert (await node.status()).generation == 1
    assert conv.stop() == 0

    # the operator took that key out (rotated it): what only it signed is not applied any more;
    # the holds stay exactly as they are until the control plane's spec comes again
    new = Ed25519PrivateKey.generate()
    from controlplane.keys import public_key_pem

    (tmp_path / "new.pub").write_bytes(public_key_pem(new))
    conv = await node.start_converger(BCD_CP_KEY=str(tmp_path / "new.pub"))
    assert (await node.status()).generation is None
    assert node.holds() == {"good"}
    assert any(e.get("msg", "").startswith("stored spec not taken") for e in conv.log_lines())
    assert (await node.send(signed_spec(new, NodeSpec(node_id="node-1", generation=2, devices=[hold("good", GPU[0])])))).generation == 2
    await node.converged(2)
    assert node.holds() == {"good"}


@pytest.mark.parametrize("service", ["converger", "gateway_bridge"])
@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"BCD_CP_KEY": ""}, NO_KEY),
        ({"BCD_CP_KEY": "/nonexistent/cp.pub"}, "--cp-key /nonexistent/cp.pub: "),
        ({"BCD_ACCEPT_UNSIGNED_SPECS": "1"}, "--cp-key and --accept-unsigned-specs (env BCD_ACCEPT_UNSIGNED_SPECS) together"),
    ],
    ids=["no-key", "key-file-missing", "key-and-opt-out"],
)
async def test_no_hop_starts_unchecked(node_bus, tmp_path, service, env, reason):
    # the bridge's upstream is never dialled: it stops before (setup), with the one-line reason
    extra = {"BCD_UPSTREAM_URL": "nats://127.0.0.1:1"} if service == "gateway_bridge" else {"BCD_FAKE_HOST": str(EXAMPLE_HOSTS / "h200x8.json")}
    sp = node_bus.start_service(service, **extra, **env)
    assert sp.wait(30) == 2
    (line,) = [e for e in sp.log_lines() if e.get("msg") == "cannot start"]
    assert line["level"] == "ERROR" and line["reason"].startswith(reason), line


async def test_the_lab_opt_out_takes_unsigned_specs_and_says_so(node, tmp_path):
    lab = {"BCD_CP_KEY": "", "BCD_ACCEPT_UNSIGNED_SPECS": "1"}
    conv = await node.start_converger(**lab)
    bridge = node.bus.start_service("gateway_bridge", BCD_UPSTREAM_URL="nats://127.0.0.1:1", **lab)
    for sp, name in ((conv, "converger"), (bridge, "gateway_bridge")):
        ping = await node.bus.wait_service(name)
        assert ping["metadata"]["unsigned_specs"] == "accepted" and ping["metadata"]["cp_keys"] == "0"
        assert metric(ping, "bcd_unsigned_specs_accepted") == 1
        warned = [e for e in sp.log_lines() if "ACCEPTING UNSIGNED NODE SPECS" in e.get("msg", "")]
        assert warned and warned[0]["level"] == "WARNING", name
    assert (await node.send(encode(unsigned_node_spec(GOOD)))).generation == 1
    await node.converged(1)
    assert node.holds() == {"good"}
    (accepted,) = [e for e in conv.log_lines() if e.get("msg") == "spec accepted"]
    assert accepted["signed"] is False
    # still for this node only
    with pytest.raises(ServiceCallError) as err:
        await node.send(encode(unsigned_node_spec(msgspec.structs.replace(EVIL, node_id="node-2"))))
    assert err.value.code == "400" and "names node node-2" in err.value.description
    # with a key the same node reports 0 and verifies
    assert bridge.stop() == 0 and conv.stop() == 0
    await node.start_converger()
    ping = await node.bus.wait_service("converger")
    assert ping["metadata"]["cp_keys"] == "1" and "unsigned_specs" not in ping["metadata"]
    assert metric(ping, "bcd_unsigned_specs_accepted") == 0
