"""Issue 11 from outside: nothing a peer or the spec bucket sends stops a service, and the bridge never goes backwards.

A real node bus with the embedded upstream account (`prepare_node_bus(...,
upstream_nodes=[...])`), the real signer, inventory, converger and
gateway_bridge as OS processes, and the test as the control plane: it
creates the upstream objects (`ControlPlane.ensure_upstream`) and puts
specs, signed with the control-plane key, straight into `bcd_nodespecs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

from bcd.nodebus import NatsServer, prepare_node_bus
from controlplane.keys import load_or_create_cp_key
from controlplane.serve import ControlPlane
from shared.runtime import ServiceCallError, call
from shared.schemas import (
    CONVERGER_STATUS_CODEC,
    EMPTY_CODEC,
    NODE_SPEC_CODEC,
    NODE_SPEC_PURPOSE,
    SIGNED_NODE_SPEC_CODEC,
    SPEC_ACK_CODEC,
    ConvergerStatus,
    Empty,
    SectionStatus,
    SignedNodeSpec,
    SpecAck,
    encode,
)
from shared.signing import sign as sign_with_purpose
from shared.signing import key_id, sign_node_spec
from shared.subjects import CONTROLPLANE_USER, SERVICE_ERROR_CODE_HEADER, SERVICE_ERROR_HEADER, NodeSubjects, inbox_prefix, upstream_node_user

from .harness import EXAMPLE_HOSTS, NodeBus, standin, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NODE = "node-1"
#: the value of the issue: 20,000 levels under an unknown key, before any signature check.
DEEP_ENVELOPE = b'{"x":' + b'{"a":' * 20_000 + b"1" + b"}" * 20_000 + b',"spec":"","key_id":"","signature":""}'
DEEP_OBJECT = b'{"a":' * 20_000 + b"1" + b"}" * 20_000
GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"


class BridgedNode:
    """The node bus (with the upstream account) and the services a test starts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bus = NodeBus(root, node_id=NODE)
        self.subjects = NodeSubjects(NODE)
        self.host_file = root / "host.json"
        shutil.copyfile(EXAMPLE_HOSTS / "h200x8.json", self.host_file)
        self.cp_key, self.cp_pub = load_or_create_cp_key(root / "cp")
        self.procs: dict[str, Any] = {}

    async def start_bus(self) -> None:
        conf, self.bus.creds = prepare_node_bus(self.root / "bus", self.root / "js", NODE, admin=True, upstream_nodes=[NODE])
        self.bus.server = NatsServer(conf, self.root / "bus" / "nats-server.log").start()
        self.bus.setup_streams()
        self.cp = await nats.connect(
            self.bus.url,
            user=CONTROLPLANE_USER,
            password=self.bus.password(CONTROLPLANE_USER),
            inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode(),
        )
        self.bus.clients.append(self.cp)
        await ControlPlane(self.cp, self.cp_key, self.root / "cpstate", out=None).ensure_upstream()
        self.cli = await self.bus.connect("cli")

    def env(self, **extra: str) -> dict[str, str]:
        return {"BCD_FAKE_HOST": str(self.host_file), "BCD_ADAPTER": "fakehw", "BCD_LOG_LEVEL": "DEBUG", **extra}

    async def start(self, name: str, **extra: str):
        env = self.env(**extra)
        if name == "gateway_bridge":
            env.update(
                BCD_UPSTREAM_URL=self.bus.url,
                BCD_UPSTREAM_PASSWORD_FILE=str(self.bus.creds[upstream_node_user(NODE)]),
                BCD_CP_KEY=str(self.cp_pub),
            )
        if name == "kube_reaper":
            env.update(BCD_EVICTOR="none", BCD_PROCESSES="fake", BCD_POD_RESOURCES_SOCKET=str(self.root / "no-kubelet.sock"))
        sp = self.bus.start_service(name, **env)
        self.procs[name] = sp
        ping = await self.bus.wait_service(name, timeout=30)
        assert int(ping["metadata"]["pid"]) == sp.proc.pid
        return sp

    async def put_raw(self, payload: bytes) -> None:
        await self.cp.jetstream().publish(f"$KV.bcd_nodespecs.{NODE}", payload)

    async def put(self, generation: int, *devices: dict) -> None:
        doc = {"node_id": NODE, "generation": generation, "devices": list(devices)}
        await self.put_raw(encode(sign_node_spec(self.cp_key, NODE_SPEC_CODEC.decode(json.dumps(doc)))))

    async def converger_generation(self, timeout: float = 0.5) -> int | None:
        try:
            st = await call(self.cli, self.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC, timeout=timeout)
        except (nats.errors.Error, asyncio.TimeoutError, ServiceCallError):
            return None
        return st.generation if st.generation is not None else -1

    async def wait_generation(self, generation: int, timeout: float = 30.0) -> None:
        async def there():
            return await self.converger_generation() == generation

        await wait_until(there, timeout, f"the converger at generation {generation}")

    def log(self, name: str) -> str:
        return self.procs[name].log()


@pytest.fixture
async def node(tmp_path):
    n = BridgedNode(tmp_path)
    try:
        await n.start_bus()
        yield n
    finally:
        await n.bus.aclose()


def log_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def hold(alloc: str, gpu: str = GPU0) -> dict:
    return {"allocation_id": alloc, "reservation_id": f"rsv-{alloc}", "binding": "BINDING_HOLD", "devices": [gpu]}


# ------------------------------------------------------------------ point 1: a deep value in the spec bucket


async def test_a_deep_value_in_the_spec_bucket_is_refused_and_the_bridge_takes_the_next_spec(node):
    for name in ("signer", "inventory", "converger"):
        await node.start(name)
    bridge = await node.start("gateway_bridge")
    await node.put(1, hold("a"))
    await node.wait_generation(1)

    await node.put_raw(DEEP_ENVELOPE)

    def rejected():
        return [
            e for e in log_lines(node.log("gateway_bridge"))
            if e.get("msg", "").startswith("node spec rejected") and "nested deeper than 64 levels" in e.get("reason", "")
        ]

    await wait_until(rejected, 20, "the bridge to log the deep value's rejection")

    # a validly signed spec with a deep unknown field: refused after the signature check, not a crash
    payload = b'{"node_id":"node-1","generation":7,"x":' + DEEP_OBJECT + b"}"
    signed = SignedNodeSpec(spec=payload, key_id=key_id(node.cp_key), signature=sign_with_purpose(node.cp_key, NODE_SPEC_PURPOSE, payload))
    await node.put_raw(encode(signed))
    await wait_until(lambda: len(rejected()) >= 2 and "spec: message: nested" in rejected()[-1]["reason"], 20, "the signed deep spec's rejection")

    await asyncio.sleep(1.0)
    assert bridge.proc.poll() is None, f"the bridge exited:\n{node.log('gateway_bridge')[-3000:]}"
    ping = await node.bus.wait_service("gateway_bridge")
    assert int(ping["metadata"]["pid"]) == bridge.proc.pid
    assert await node.converger_generation() == 1  # the last good spec stays

    await node.put(2, hold("a"), hold("b", "GPU-5f1c2a90-0000-4000-8000-000000000002"))
    await node.wait_generation(2, timeout=20)
    assert bridge.proc.poll() is None
    assert "Traceback" not in node.log("gateway_bridge")


# ------------------------------------------------------------------ point 1: the deep object at the endpoints


async def test_the_deep_object_at_the_endpoints_is_a_400_and_nobody_dies(node):
    for name in ("signer", "inventory", "converger", "kube_reaper"):
        await node.start(name)
    pids = {n: sp.proc.pid for n, sp in node.procs.items()}
    subjects = node.subjects
    # each endpoint asked by an identity its route names (anyone else is refused 403 before the body is read)
    callers: dict[str, Any] = {}

    async def as_caller(subject: str) -> Any:
        user = (subjects.callers(subject) or ("cli",))[0]
        if user not in callers:
            callers[user] = await node.bus.connect(user)
        return callers[user]

    for subject in (subjects.signer_sign, subjects.converger_spec, subjects.reaper_orphans):
        msg = await (await as_caller(subject)).request(subject, DEEP_OBJECT, timeout=5)
        headers = msg.headers or {}
        assert headers.get(SERVICE_ERROR_CODE_HEADER) == "400", (subject, headers)
        assert headers.get(SERVICE_ERROR_HEADER) == "message: nested deeper than 64 levels", (subject, headers)

    # every endpoint of every running service: a reply or a 400-class refusal, never a 500
    for name in pids:
        info = json.loads((await node.cli.request(f"$SRV.INFO.{name}", b"", timeout=3)).data)
        for ep in info["endpoints"]:
            msg = await (await as_caller(ep["subject"])).request(ep["subject"], DEEP_OBJECT, timeout=5)
            code = (msg.headers or {}).get(SERVICE_ERROR_CODE_HEADER, "200")
            assert not code.startswith("5"), (name, ep["subject"], msg.headers)

    for name, sp in node.procs.items():
        assert sp.proc.poll() is None, f"{name} exited"
        ping = await node.bus.wait_service(name)
        assert int(ping["metadata"]["pid"]) == pids[name]


# ------------------------------------------------------------------ point 3: replies valid by construction


async def test_an_endpoint_never_sends_a_reply_its_schema_refuses(node):
    """The runtime's endpoint in this process, on the real bus: reply codecs and decode failures.
    It stands in for the converger (its user, two of its endpoints), asked by the operator."""
    nc = await node.bus.connect("converger")
    cli = await node.bus.connect("cli")
    service, ctx, _ = standin(nc, "converger", node.subjects)
    message = {"text": "m" * 4097}

    async def status(_: Empty) -> ConvergerStatus:
        return ConvergerStatus(generation=1, section=SectionStatus(section="devices", state="FAILED", observed_generation=1, message=message["text"]))

    async def boom(_: Empty) -> SpecAck:
        raise RuntimeError("kaput")

    st, boom_at = node.subjects.converger_status, node.subjects.converger_pass
    await ctx.endpoint("status", st, status, EMPTY_CODEC, allow_empty=True, reply=CONVERGER_STATUS_CODEC)
    await ctx.endpoint("boom", boom_at, boom, EMPTY_CODEC, allow_empty=True, reply=SPEC_ACK_CODEC)
    await service.start()
    try:
        with pytest.raises(ServiceCallError) as err:
            await call(cli, st, Empty(), CONVERGER_STATUS_CODEC, timeout=3)
        assert (err.value.code, err.value.description) == ("500", "internal error: reply violates ConvergerStatus schema")
        message["text"] = "m" * 4096
        assert (await call(cli, st, Empty(), CONVERGER_STATUS_CODEC, timeout=3)).section.message == "m" * 4096
        with pytest.raises(ServiceCallError) as err:
            await call(cli, st, b'{"k":' * 65 + b"1" + b"}" * 65, CONVERGER_STATUS_CODEC, timeout=3)
        assert (err.value.code, err.value.description) == ("400", "message: nested deeper than 64 levels")
        with pytest.raises(ServiceCallError) as err:
            await call(cli, boom_at, Empty(), SPEC_ACK_CODEC, timeout=3)
        assert (err.value.code, err.value.description) == ("500", "internal error: RuntimeError")
    finally:
        await service.stop()


# ------------------------------------------------------------------ point 2: a converger.status its schema refuses


async def test_a_converger_status_the_schema_refuses_does_not_kill_the_bridge(node):
    """A stand-in converger (the converger's user) answers the Hello's status with a 4,097-character section message."""
    await node.start("signer")
    await node.start("inventory")
    good = {"on": False}

    async def on_status(msg) -> None:
        text = "m" * (4096 if good["on"] else 4097)
        body = ConvergerStatus(generation=1, section=SectionStatus(section="devices", state="FAILED", observed_generation=1, message=text))
        await msg.respond(encode(body))

    async def on_spec(msg) -> None:
        # the bridge relays the signed envelope; the spec is inside it
        await msg.respond(encode(SpecAck(generation=NODE_SPEC_CODEC.decode(SIGNED_NODE_SPEC_CODEC.decode(msg.data).spec).generation)))

    standin = await node.bus.connect("converger")
    await standin.subscribe(node.subjects.converger_status, cb=on_status)
    await standin.subscribe(node.subjects.converger_spec, cb=on_spec)
    await standin.flush()
    bridge = await node.start("gateway_bridge")

    def refusals():
        return [e for e in log_lines(node.log("gateway_bridge")) if "$.section.message" in str(e.get("error", ""))]

    await wait_until(lambda: len(refusals()) >= 2, 20, "the bridge to log the refused status twice (and retry)")
    assert bridge.proc.poll() is None, f"the bridge exited:\n{node.log('gateway_bridge')[-3000:]}"

    # the spec path is unaffected meanwhile
    await node.put(3, hold("a"))
    await wait_until(lambda: "node spec handed to the converger" in node.log("gateway_bridge"), 20, "the spec handed over")

    good["on"] = True
    await wait_until(lambda: "hello published" in node.log("gateway_bridge"), 20, "the Hello once the status decodes")
    kv = await node.cp.jetstream().key_value("bcd_nodes")
    assert (await kv.get(NODE)).value
    assert bridge.proc.poll() is None
    ping = await node.bus.wait_service("gateway_bridge")
    assert int(ping["metadata"]["pid"]) == bridge.proc.pid


# ------------------------------------------------------------------ point 4: the hand-over never goes backwards, and is fast


def accepted_generations(converger_log: str) -> list[int]:
    return [int(e["generation"]) for e in log_lines(converger_log) if e.get("msg") == "spec accepted"]


async def _back_and_newest(node: BridgedNode, newest: int, timeout: float = 15.0) -> tuple[float, list[int]]:
    """Restart the converger; seconds from its first answer until it holds `newest`, and the generations seen."""
    sp = node.bus.start_service("converger", **node.env())
    node.procs["converger"] = sp
    seen: list[int] = []
    first_answer = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if sp.proc.poll() is not None:
            raise AssertionError(f"converger exited:\n{sp.log()[-3000:]}")
        gen = await node.converger_generation(timeout=0.3)
        if gen is not None:
            now = time.monotonic()
            first_answer = first_answer or now
            if not seen or seen[-1] != gen:
                seen.append(gen)
            if gen == newest:
                return now - first_answer, seen
            if now - first_answer > timeout:
                break
        await asyncio.sleep(0.05)
    raise AssertionError(f"the converger never reached generation {newest} (seen {seen}); bridge log:\n{node.log('gateway_bridge')[-3000:]}")


async def test_specs_put_while_the_converger_is_away_reach_it_newest_first_within_a_second_or_two(node):
    for name in ("signer", "inventory", "converger"):
        await node.start(name)
    bridge = await node.start("gateway_bridge")
    await node.put(1, hold("g1"))
    await node.wait_generation(1)

    # killed: every hand-over meanwhile gets "no responders" at once
    conv = node.procs["converger"]
    conv.proc.kill()
    conv.wait()
    for gen in (2, 3, 4):
        await node.put(gen, hold(f"g{gen}"))
        await asyncio.sleep(0.3)
    await asyncio.sleep(1.0)
    took, seen = await _back_and_newest(node, 4)
    print(f"after a kill: generation 4 reached the converger {took:.2f}s after it answered (seen {seen})")
    assert took < 2.0, f"generation 4 reached the converger {took:.1f}s after it answered (seen {seen})"
    assert seen in ([1, 4], [4]), seen

    # stalled (subscribed, not answering): the hand-over times out while newer specs arrive,
    # then the converger is killed and comes back
    conv = node.procs["converger"]
    conv.proc.send_signal(signal.SIGSTOP)
    try:
        await node.put(5, hold("g5"))
        await asyncio.sleep(0.3)
        await node.put(6, hold("g6"))
        await asyncio.sleep(0.3)
        await node.put(7, hold("g7"))
        await asyncio.sleep(2.5)  # past one hand-over timeout
    finally:
        conv.proc.kill()
        conv.wait()
    took, seen = await _back_and_newest(node, 7)
    print(f"after a stall and a kill: generation 7 reached the converger {took:.2f}s after it answered (seen {seen})")
    assert took < 2.0, f"generation 7 reached the converger {took:.1f}s after it answered (seen {seen})"
    assert seen in ([4, 7], [7]), seen

    # nothing older was ever applied after something newer, and the superseded ones never at all
    accepted = accepted_generations(node.log("converger"))  # every run appends to the same log
    assert accepted == sorted(set(accepted)), accepted
    assert not {2, 3, 5, 6} & set(accepted), accepted
    assert accepted[-1] == 7
    await asyncio.sleep(1.0)
    assert await node.converger_generation() == 7
    assert bridge.proc.poll() is None
    assert not re.search(r"lower than the applied", node.log("gateway_bridge"))
