"""What a compromised identity could have the server do for it, tried on a real server (issue 40).

The publish allow-lists (test_permissions.py) are not enough on their own: JetStream and
every responder publish *for* a client, to a subject the client chose (a push consumer's
deliver subject, a republish, a source or mirror, a subject transform, a stream that
captures `$JS.ACK.>`, the reply subject of a pull, a direct get, a PubAck or any service's
answer). Here every identity on both buses, as its own NATS user on the config the node
runs with (the embedded default: node bus and upstream on one server), tries each of
those tricks against the subjects that matter (the converger's spec, the signer, the
root vfio_switcher and helper, the inventory's NVML steps, kube_reaper's evictions and
its Kubernetes Node, notices others trust, the
upstream keys and events of its own node and of another), and also asks every request
it may make with each of those subjects as its reply subject.

Every other identity listens meanwhile, as itself, on every subject it serves or listens
to (and answers each request, so a responder's reply can be redirected too). What must
hold, checked on the server and its streams, not in the tables:

- a message reaches an identity's endpoint only if the attacker is one of the callers
  the endpoint's route names (then it is the attacker acting as itself: the endpoints'
  own caller check is tried in test_endpoint_callers); no notice of another identity
  ever comes from the attacker; nothing of the node bus is reached from upstream, and
  no node's upstream keys or events from another node;
- no stream or consumer appears, changes or goes in the node bus's store account; a
  node's upstream user adds nothing to the upstream's streams but its own keys and events.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.aio.client import Client

from bcd.nodebus import NatsServer, prepare_node_bus, setup_streams
from controlplane.serve import ControlPlane
from shared.schemas import NodeSpec, encode
from shared.signing import Ed25519PrivateKey, sign_node_spec
from shared.subjects import (
    BUS_ADMIN_USER,
    CONTROLPLANE_USER,
    MSG_ID_HEADER,
    NODE_BUS_USERS,
    UPSTREAM_EVENTS_STREAM,
    NodeSubjects,
    inbox_prefix,
    upstream_node_account,
    upstream_node_permissions,
    upstream_node_user,
    upstream_spec_get_subject,
    upstream_spec_key_subject,
)

from tests.blocking import subject_matches

from .harness import standin

pytestmark = pytest.mark.integration

NODE, OTHER = "node-1", "node-2"
S = NodeSubjects(NODE)
NODE_UP, OTHER_UP = upstream_node_user(NODE), upstream_node_user(OTHER)
ATTACKERS = [*NODE_BUS_USERS, CONTROLPLANE_USER, NODE_UP]

#: what matters most on the node bus: whoever reaches these owns holds, keys, cards or root
NODE_TARGETS = [
    S.converger_spec,
    S.converger_claim_prepare,
    S.converger_gpu_op,
    S.signer_sign,
    S.signer_sign_batch,
    S.vfio_switch,
    S.helper_file_write,
    S.helper_slice_apply,
    S.inventory_sharing,
    S.inventory_mig_layout,
    S.inventory_gpu,
    S.reaper_evict,
    # the node's Kubernetes Node: labels, taints, cordon (the converger only)
    S.reaper_node,
    S.device_plugin_withdraw,
    # notices others act on
    S.inventory_changed,
    S.converger_claims_changed,
    S.reaper_freed,
    S.converger_journaled,
    # the outbox itself
    S.outbox_subject("bound"),
]
UPSTREAM_TARGETS = [
    upstream_spec_key_subject(NODE),
    upstream_spec_key_subject(OTHER),
    f"$KV.bcd_nodes.{OTHER}",
    f"$KV.bcd_inventory.{OTHER}",
    f"bcd.events.{OTHER}.bound",
    f"bcd.events.{NODE}.bound",
]
TARGETS = NODE_TARGETS + UPSTREAM_TARGETS
#: streams an attacker may point a trick at: the node's, the upstream's, and one it would make
STREAMS = [S.outbox_stream, f"KV_{S.inventory_bucket}", UPSTREAM_EVENTS_STREAM, "KV_bcd_nodespecs", "KV_bcd_nodes"]
EVIL = "EVIL"


def tricks(attacker_publish: tuple[str, ...], target: str, k: int) -> list[tuple[str, bytes, str | None]]:
    """(subject, body, reply) of every way to have the server (or a responder) publish `target`.

    Every stream config is one the server takes (a refusal must be the accounts' or the
    permissions', never a config error): the control plane, which may make streams
    upstream, does make each of them."""
    out: list[tuple[str, bytes, str | None]] = []
    evil = f"evil.{k}"

    def js(subject: str, body: dict[str, Any], reply: str | None = None) -> None:
        out.append((subject, json.dumps(body).encode(), reply))

    # a stream of one's own that captures, republishes, sources or mirrors, or transforms into the target
    for n, cfg in enumerate(
        (
            {"subjects": [target]},
            {"subjects": [evil], "republish": {"src": evil, "dest": target}},
            {"subjects": [f"{evil}.t"], "subject_transform": {"src": f"{evil}.t", "dest": target}},
            {"subjects": [f"$JS.ACK.{k}.>"]},
            *({"sources": [{"name": st}]} for st in STREAMS),
            *({"mirror": {"name": st}} for st in STREAMS),
        )
    ):
        name = f"{EVIL}_{k}_{n}"
        js(f"$JS.API.STREAM.CREATE.{name}", {"name": name, "storage": "memory", **cfg})
    out += [(evil, b"payload", None), (f"{evil}.t", b"payload", None)]
    for st in STREAMS:
        # another's stream changed to republish or capture
        js(f"$JS.API.STREAM.UPDATE.{st}", {"name": st, "subjects": [evil], "republish": {"src": evil, "dest": target}})
        js(f"$JS.API.STREAM.UPDATE.{st}", {"name": st, "subjects": [f"$JS.ACK.{st}.>"]})
        # a consumer that pushes there
        push = {"deliver_subject": target, "deliver_policy": "all", "ack_policy": "none"}
        js(f"$JS.API.CONSUMER.CREATE.{st}", {"stream_name": st, "config": push})
        js(f"$JS.API.CONSUMER.CREATE.{st}.evil", {"stream_name": st, "config": {**push, "name": "evil"}})
        js(f"$JS.API.CONSUMER.DURABLE.CREATE.{st}.evil", {"stream_name": st, "config": {**push, "durable_name": "evil"}})
        # reads whose answer goes where the reader says
        js(f"$JS.API.CONSUMER.MSG.NEXT.{st}.evil", {"batch": 10, "no_wait": True}, reply=target)
        js(f"$JS.API.DIRECT.GET.{st}", {"seq": 1, "batch": 10}, reply=target)
        js(f"$JS.API.STREAM.MSG.GET.{st}", {"seq": 1}, reply=target)
        js(f"$JS.API.STREAM.INFO.{st}", {}, reply=target)
        out.append((f"$JS.ACK.{st}.evil.1.1.1.1.0", b"+ACK", target))
        # and the verbs that change or take away what another relies on
        js(f"$JS.API.STREAM.MSG.DELETE.{st}", {"seq": 1}, reply=target)
        js(f"$JS.API.STREAM.SNAPSHOT.{st}", {"deliver_subject": target, "chunk_size": 1024})
        js(f"$JS.API.STREAM.RESTORE.{st}", {"config": {"name": st}})
        js(f"$JS.API.STREAM.DELETE.{st}", {}, reply=target)
        for verb in ("RESET", "PAUSE", "UNPIN", "DELETE", "LEADER.STEPDOWN"):
            js(f"$JS.API.CONSUMER.{verb}.{st}.evil", {}, reply=target)
    # the direct gets and puts the node's identities have, answered to the target
    for subject in (S.outbox_direct_get, S.inventory_key_get, upstream_spec_get_subject(NODE), upstream_spec_get_subject(OTHER)):
        out.append((subject, json.dumps({"seq": 1, "batch": 5}).encode() if "OUTBOX" in subject else b"", target))
    for key in (S.inventory_key, f"$KV.{S.inventory_bucket}.evil", f"$KV.bcd_nodes.{OTHER}", f"$KV.bcd_inventory.{OTHER}", upstream_spec_key_subject(OTHER)):
        out.append((key, b'{"forged": true}', target))
    # the target itself, plainly and as a request
    out.append((target, b'{"forged": true}', None))
    # every request this identity may make, its answer sent to the target
    for subject in attacker_publish:
        concrete = ".".join("probe" if t in ("*", ">") else t for t in subject.split("."))
        out.append((concrete, b"{}", target))
    return out


@dataclass
class Seen:
    """What one honeypot identity received: (subject, caller account from Nats-Request-Info)."""

    user: str
    got: list[tuple[str, str]] = field(default_factory=list)


def listened(user: str) -> list[str]:
    """What an identity serves or listens to (its inbox aside)."""
    if user == CONTROLPLANE_USER:
        return ["$KV.bcd_nodes.>", "$KV.bcd_inventory.>"]
    if user in (NODE_UP, OTHER_UP):
        node = NODE if user == NODE_UP else OTHER
        return [upstream_spec_key_subject(node)]
    return [p for p in S.permissions(user).subscribe if not p.startswith(inbox_prefix(user))]


def allowed(attacker: str, honeypot: str, subject: str) -> bool:
    """May `subject` reach `honeypot` when `attacker` is the only one acting?"""
    if honeypot in NODE_BUS_USERS:
        for r in S.routes():
            if subject_matches(r.subject, subject) and r.notice and honeypot in r.callers:
                return attacker == r.owner  # a notice: from its owner only
            if subject_matches(r.subject, subject) and not r.notice and r.owner == honeypot:
                return attacker in r.callers
        return False
    if honeypot == CONTROLPLANE_USER:
        # a node puts its own Hello and inventory
        return attacker == NODE_UP and subject.endswith(f".{NODE}")
    return attacker == CONTROLPLANE_USER  # a spec key: only the control plane puts there


async def connect(url: str, user: str, password: str, errors: list[str] | None = None) -> Client:
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))

    return await nats.connect(
        url, user=user, password=password, inbox_prefix=inbox_prefix(user).encode(), allow_reconnect=False, error_cb=on_error
    )


@pytest.fixture
async def bus(tmp_path: Path):
    """The embedded default's server with both nodes' upstream accounts, the node's streams
    made by the bus setup, the upstream's by the control plane, and something in each."""
    conf, creds = prepare_node_bus(tmp_path / "bus", tmp_path / "js", NODE, admin=True, upstream_nodes=[NODE, OTHER])
    server = NatsServer(conf, tmp_path / "bus" / "nats-server.log").start()
    passwords = {u: p.read_text().strip() for u, p in creds.items()}
    clients: list[Client] = []
    try:
        await setup_streams(server.url, passwords[BUS_ADMIN_USER], NODE, outbox_max_bytes=16 * 1024 * 1024)
        cp_nc = await connect(server.url, CONTROLPLANE_USER, passwords[CONTROLPLANE_USER])
        clients.append(cp_nc)
        key = Ed25519PrivateKey.generate()
        await ControlPlane(cp_nc, key, tmp_path / "cp", out=None).ensure_upstream()
        for node in (NODE, OTHER):
            signed = sign_node_spec(key, NodeSpec(node_id=node, generation=1))
            await cp_nc.jetstream().publish(upstream_spec_key_subject(node), encode(signed))
        conv = await connect(server.url, "converger", passwords["converger"])
        inv = await connect(server.url, "inventory", passwords["inventory"])
        up = await connect(server.url, NODE_UP, passwords[NODE_UP])
        clients += [conv, inv, up]
        await conv.jetstream().publish(S.outbox_subject("section"), b'{"attacker": "content"}', headers={MSG_ID_HEADER: "seed-1"})
        await inv.jetstream().publish(S.inventory_key, b'{"attacker": "content"}')
        await up.jetstream().publish(f"bcd.events.{NODE}.section", b'{"seed": 1}', headers={MSG_ID_HEADER: "seed-up"})
        yield server, passwords
    finally:
        for nc in clients:
            await nc.close()
        server.stop()


async def store_state(admin_js: Any) -> dict[str, Any]:
    """Every stream of the store account with its config and consumers."""
    state = {}
    for info in await admin_js.streams_info():
        cfg = info.config
        consumers = [c.name for c in await admin_js.consumers_info(cfg.name)]
        state[cfg.name] = (tuple(cfg.subjects or ()), cfg.republish, cfg.sources, cfg.mirror, cfg.subject_transform, consumers)
    return state


async def upstream_state(cp: Client) -> dict[str, Any]:
    """Every upstream stream with its config, its messages per subject and its consumers."""
    js = cp.jetstream()
    state = {}
    for info in await js.streams_info():
        cfg = info.config
        raw = await cp.request(f"$JS.API.STREAM.INFO.{cfg.name}", json.dumps({"subjects_filter": ">"}).encode(), timeout=5)
        subjects = dict(json.loads(raw.data).get("state", {}).get("subjects") or {})
        consumers = [c.name for c in await js.consumers_info(cfg.name)]
        state[cfg.name] = (tuple(cfg.subjects or ()), cfg.republish, cfg.sources, cfg.mirror, subjects, consumers)
    return state


@pytest.mark.parametrize("attacker", ATTACKERS)
async def test_no_identity_has_the_server_act_for_it(bus, attacker: str) -> None:
    server, passwords = bus
    honeypots: dict[str, Seen] = {}
    clients: list[Client] = []
    try:
        admin = await connect(server.url, "admin", passwords["admin"])
        cp = await connect(server.url, CONTROLPLANE_USER, passwords[CONTROLPLANE_USER])
        clients += [admin, cp]
        store_before = await store_state(admin.jetstream())
        upstream_before = await upstream_state(cp)

        for user in (*NODE_BUS_USERS, CONTROLPLANE_USER, NODE_UP, OTHER_UP):
            if user == attacker:
                continue
            seen = honeypots[user] = Seen(user)
            nc = await connect(server.url, user, passwords[user])
            clients.append(nc)

            def record(seen: Seen = seen, answers: bool = False) -> Any:
                async def cb(msg: Any) -> None:
                    raw = (msg.headers or {}).get("Nats-Request-Info", "")
                    seen.got.append((msg.subject, json.loads(raw).get("acc", "") if raw else ""))
                    if answers and msg.reply:  # an endpoint answers (a notice never does): its answer is redirected too
                        try:
                            await msg.respond(b'{"honeypot": true}')
                        except nats.errors.Error:
                            pass

                return cb

            endpoints = {r.subject for r in S.routes() if r.owner == user and not r.notice}
            for subject in listened(user):
                await nc.subscribe(subject, cb=record(answers=subject in endpoints))
            await nc.flush()

        errors: list[str] = []
        me = await connect(server.url, attacker, passwords[attacker], errors)
        clients.append(me)
        if attacker in NODE_BUS_USERS:
            publish = S.permissions(attacker).publish
        elif attacker == NODE_UP:
            publish = upstream_node_permissions(NODE).publish
        else:
            publish = ("$JS.API.INFO",)
        sent = 0
        for k, target in enumerate(TARGETS):
            for subject, body, reply in tricks(publish, target, k):
                await me.publish(subject, body, reply=reply or "")
                sent += 1
        await me.flush(timeout=10)
        await asyncio.sleep(1.5)  # deliveries, answers, republishes, sources all had their time

        bad = [
            (h.user, subject, acc)
            for h in honeypots.values()
            for subject, acc in h.got
            if not allowed(attacker, h.user, subject)
        ]
        assert not bad, f"{attacker} had these delivered ({sent} tries): {sorted(set(bad))[:20]}"
        assert me.is_connected, "a refused try must not cost the connection"

        assert await store_state(admin.jetstream()) == store_before, f"{attacker} changed the node bus's streams"
        if attacker != CONTROLPLANE_USER:  # the control plane owns the upstream's streams
            after = await upstream_state(cp)
            if attacker == NODE_UP:
                # its own keys and events may grow; nobody else's
                for name, (subjects, *rest, counts, consumers) in after.items():
                    b_subjects, *b_rest, b_counts, b_consumers = upstream_before[name]
                    assert (subjects, rest, consumers) == (b_subjects, b_rest, b_consumers), name
                    grown = {s for s, n in counts.items() if n != b_counts.get(s)}
                    assert all(s.endswith(f".{NODE}") or f".{NODE}." in s for s in grown), (name, grown)
            else:
                assert after == upstream_before, f"{attacker} changed the upstream"
    finally:
        for nc in clients:
            await nc.close()


async def test_what_the_control_plane_makes_upstream_reaches_no_node_bus_subject(bus) -> None:
    """The control plane's user must manage the upstream's streams, so it may make a push
    consumer or a republishing stream there; even then nothing reaches the node bus (on one
    server in the embedded default): the buses share no account."""
    server, passwords = bus
    cp = await connect(server.url, CONTROLPLANE_USER, passwords[CONTROLPLANE_USER])
    listeners = {u: await connect(server.url, u, passwords[u]) for u in ("converger", "vfio_switcher", "signer", "helper")}
    got: list[str] = []

    async def on_msg(msg: Any) -> None:
        got.append(msg.subject)

    try:
        for user, nc in listeners.items():
            for subject in listened(user):
                await nc.subscribe(subject, cb=on_msg)
            await nc.flush()
        js = cp.jetstream()
        for target in (S.converger_spec, S.vfio_switch, S.signer_sign, S.helper_file_write):
            name = "EVIL_" + target.split(".")[-1].upper().replace("_", "")
            made = await cp.request(
                f"$JS.API.STREAM.CREATE.{name}",
                json.dumps({"name": name, "subjects": [f"evil.{name}"], "storage": "memory", "republish": {"src": f"evil.{name}", "dest": target}}).encode(),
                timeout=5,
            )
            assert "error" not in json.loads(made.data), made.data
            await cp.publish(f"evil.{name}", b'{"node_id": "node-1", "generation": 1000}')
            pushed = await cp.request(
                "$JS.API.CONSUMER.CREATE.KV_bcd_nodespecs",
                json.dumps({"stream_name": "KV_bcd_nodespecs", "config": {"deliver_subject": target, "deliver_policy": "all", "ack_policy": "none"}}).encode(),
                timeout=5,
            )
            assert "error" not in json.loads(pushed.data), pushed.data
        await asyncio.sleep(1.0)
        assert got == [], got
        # it did make them: the refusal is the accounts', not a missing permission
        assert len(await js.consumers_info("KV_bcd_nodespecs")) == 4
    finally:
        for nc in (cp, *listeners.values()):
            await nc.close()


async def test_a_node_reaches_only_its_own_upstream_keys(bus) -> None:
    """A node's upstream user reads its own spec (direct get, live puts) and puts its own
    records and events; another node's spec is out of reach, and even its own direct get
    answered to another node's key goes nowhere but back into its own account."""
    server, passwords = bus
    up = await connect(server.url, NODE_UP, passwords[NODE_UP])
    cp = await connect(server.url, CONTROLPLANE_USER, passwords[CONTROLPLANE_USER])
    try:
        mine = await up.request(upstream_spec_get_subject(NODE), b"", timeout=3)
        assert json.loads(mine.data)["signature"]
        with pytest.raises(nats.errors.Error):
            await up.request(upstream_spec_get_subject(OTHER), b"", timeout=1)
        ack = await up.jetstream().publish(f"$KV.bcd_nodes.{NODE}", b'{"hello": 1}')
        assert ack.stream == "KV_bcd_nodes"
        other_before = (await cp.jetstream().get_last_msg("KV_bcd_nodespecs", upstream_spec_key_subject(OTHER))).data
        await up.publish(upstream_spec_get_subject(NODE), b"", reply=upstream_spec_key_subject(OTHER))
        await up.publish(f"$KV.bcd_nodes.{NODE}", b"x", reply=f"$KV.bcd_nodes.{OTHER}")
        await up.flush()
        await asyncio.sleep(0.5)
        assert (await cp.jetstream().get_last_msg("KV_bcd_nodespecs", upstream_spec_key_subject(OTHER))).data == other_before
        with pytest.raises(nats.js.errors.NotFoundError):
            await cp.jetstream().get_last_msg("KV_bcd_nodes", f"$KV.bcd_nodes.{OTHER}")
        assert upstream_node_account(NODE) != upstream_node_account(OTHER)
    finally:
        await up.close()
        await cp.close()


async def test_endpoint_callers_are_checked_by_the_service_itself(bus) -> None:
    """The one delivery the accounts let through is an identity's own redirect into a subject
    it may call (its PubAck sent to the vfio_switcher's endpoint): the server names the
    store account as the caller, and the endpoint refuses it 403. Asked properly, it answers."""
    server, passwords = bus
    switcher = await connect(server.url, "vfio_switcher", passwords["vfio_switcher"])
    converger = await connect(server.url, "converger", passwords["converger"])
    service, ctx, registry = standin(switcher, "vfio_switcher", S)
    handled: list[bytes] = []

    async def switch(body: bytes) -> bytes:
        handled.append(body)
        return b"{}"

    await ctx.endpoint("switch", S.vfio_switch, switch, None)
    await service.start()
    try:
        # asked by the converger: handled
        assert (await converger.request(S.vfio_switch, b"real", timeout=3)).data == b"{}"
        # the converger's own PubAck, redirected: the store account is no caller of the switch
        await converger.publish(S.outbox_subject("bound"), b"x", reply=S.vfio_switch)
        await converger.flush()
        await asyncio.sleep(0.5)
        assert handled == [b"real"], handled
        forbidden = registry.get_sample_value("bcd_requests_total", {"endpoint": "switch", "outcome": "forbidden"})
        assert forbidden == 1.0
    finally:
        await service.stop()
        for nc in (switcher, converger):
            await nc.close()
