"""NATS permissions as a tested property, against a real nats-server (DESIGN 2 and 3).

The server runs with the config `bcd.nodebus.prepare_node_bus` writes for the
embedded default (every node-bus identity alone in its own account, the store
account NODE with JetStream and the bus setup's user, the UPSTREAM account with
the control plane and one account for this node's bridge user). For every
node-bus user, one connection publishes to and subscribes to (plainly and in
a queue group) every subject of the probe universe: every subject and
pattern `NodeSubjects` names, every service's namespace and discovery
subjects, the outbox, the inventory KV bucket and the JetStream API of every
stream, every user's inbox, the upstream subjects, another node's subjects
and the catch-alls. The server's refusals (`-ERR 'Permissions Violation ...'`,
asynchronous, collected by the client's error callback) must be exactly what
`NodeSubjects.permissions(user)` predicts with NATS' own matching rules.

Then the security claims themselves, observed on the server, not in the
tables: no user reaches another service's endpoints, another user's replies
or an upstream subject; the store account cannot touch the UPSTREAM account's
stream and buckets even with an unrestricted user; and in a running `bcd up`
only the gateway_bridge process carries upstream credentials and is the only
node process connected to an upstream account. What JetStream could be made to
deliver on a user's behalf is tried in test_bus_attacks.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client

from bcd.nodebus import NatsServer, prepare_node_bus, setup_streams
from shared.schemas.events import EVENT_TYPES
from shared.subjects import (
    BUS_ADMIN_USER,
    CONTROLPLANE_USER,
    NODE_BUS_USERS,
    SERVICES,
    UPSTREAM_BUCKETS,
    UPSTREAM_EVENTS_STREAM,
    UPSTREAM_INVENTORY_BUCKET,
    UPSTREAM_NODES_BUCKET,
    NodeSubjects,
    Permissions,
    inbox_prefix,
    upstream_controlplane_permissions,
    upstream_event,
    upstream_events_filter,
    upstream_node_permissions,
    upstream_node_user,
    upstream_spec_get_subject,
)

from .wholenode import SERVICES as E2E_SERVICES
from .wholenode import Node, wait_for
from tests.blocking import subject_matches

pytestmark = pytest.mark.integration

NODE = "node-1"
S = NodeSubjects(NODE)
OTHER = NodeSubjects("node-2")
PERMS: dict[str, Permissions] = {u: S.permissions(u) for u in NODE_BUS_USERS}
QUEUE = "q"
#: a subject no table grants: its refusal, seen last, says every earlier refusal has arrived.
SENTINEL = "bcd-probe.sentinel"


# ------------------------------------------------------------------ NATS' matching rules


def allowed(patterns: tuple[str, ...], subject: str) -> bool:
    return any(subject_matches(p, subject) for p in patterns)


def literal(pattern: str) -> str:
    """A concrete subject inside a pattern (one you can publish to)."""
    return ".".join("probe" if t in ("*", ">") else t for t in pattern.split("."))


# ------------------------------------------------------------------ the probe universe


def js_api(stream: str) -> set[str]:
    """The JetStream API subjects that act on one stream."""
    return {
        *(f"$JS.API.STREAM.{verb}.{stream}" for verb in ("INFO", "CREATE", "UPDATE", "DELETE", "PURGE", "MSG.GET", "MSG.DELETE", "SNAPSHOT", "RESTORE")),
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.probe",
        f"$JS.API.CONSUMER.CREATE.{stream}.probe.x",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.probe",
        f"$JS.API.CONSUMER.DELETE.{stream}.probe",
        f"$JS.API.CONSUMER.INFO.{stream}.probe",
        f"$JS.API.CONSUMER.LIST.{stream}",
        f"$JS.API.CONSUMER.NAMES.{stream}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.probe",
        f"$JS.ACK.{stream}.>",
    }


def node_subjects(s: NodeSubjects) -> set[str]:
    """Every subject a `NodeSubjects` names: its properties, each service's namespace, the outbox."""
    out: set[str] = set()
    for name, attr in vars(NodeSubjects).items():
        if isinstance(attr, property):
            value = getattr(s, name)
            for v in value if isinstance(value, tuple) else (value,):
                if isinstance(v, str) and "." in v:
                    out.add(v)
    for svc in SERVICES:
        out |= {s.service_wildcard(svc), s.subject(svc, "probe"), s.subject(svc, "probe.deeper")}
    out |= {s.outbox_subject(t) for t in EVENT_TYPES} | {s.outbox_filter, f"$KV.{s.inventory_bucket}.gpus", f"$KV.{s.inventory_bucket}.>"}
    return out


def upstream_subjects() -> set[str]:
    ups = {upstream_event(NODE, t) for t in EVENT_TYPES}
    ups |= {upstream_events_filter(), upstream_spec_get_subject(NODE), f"$JS.ACK.{UPSTREAM_EVENTS_STREAM}.>"}
    for bucket in UPSTREAM_BUCKETS:
        ups |= {f"$KV.{bucket}.{NODE}", f"$KV.{bucket}.>"}
    ups |= set(upstream_node_permissions(NODE).publish) | set(upstream_node_permissions(NODE).subscribe)
    cp = upstream_controlplane_permissions()
    return ups | set(cp.publish) | set(cp.subscribe)


def probe_universe() -> list[str]:
    subjects = node_subjects(S) | node_subjects(OTHER) | upstream_subjects()
    for perms in PERMS.values():  # what any user is granted, tried by every other user
        subjects |= set(perms.publish) | set(perms.subscribe)
    for svc in SERVICES:
        for verb in ("PING", "INFO", "STATS"):
            subjects |= {f"$SRV.{verb}", f"$SRV.{verb}.{svc}", f"$SRV.{verb}.{svc}.probeid", f"$SRV.{verb}.{svc}.>"}
    streams = {S.outbox_stream, f"KV_{S.inventory_bucket}", OTHER.outbox_stream, UPSTREAM_EVENTS_STREAM, *(f"KV_{b}" for b in UPSTREAM_BUCKETS)}
    for stream in streams:
        subjects |= js_api(stream)
    subjects |= {"$JS.API.INFO", "$JS.API.STREAM.LIST", "$JS.API.STREAM.NAMES", "$JS.API.>", "$JS.>", "$KV.>", "$SRV.>"}
    for user in (*NODE_BUS_USERS, CONTROLPLANE_USER, upstream_node_user(NODE), "admin", BUS_ADMIN_USER):
        subjects |= {f"{inbox_prefix(user)}.probe.1", f"{inbox_prefix(user)}.>"}
    subjects |= {"_INBOX.probe.1", "_INBOX.>", ">", "*", "bcd.>", f"{S.prefix}.>", "$SYS.>", "$SYS.REQ.SERVER.PING"}
    return sorted(subjects)


UNIVERSE = probe_universe()
PUBLISH_PROBES = sorted({literal(s) for s in UNIVERSE})
SUBSCRIBE_PROBES = sorted(set(UNIVERSE) | set(PUBLISH_PROBES))


def test_the_probe_universe_is_wide_and_unambiguous() -> None:
    """The client reports refusals lowercased: no two probes may differ only by case."""
    assert len({s.lower() for s in SUBSCRIBE_PROBES}) == len(SUBSCRIBE_PROBES)
    assert SENTINEL not in SUBSCRIBE_PROBES and not any(allowed(p.subscribe, SENTINEL) for p in PERMS.values())
    for svc in SERVICES:  # every service's endpoints are in it
        assert S.subject(svc, "probe") in PUBLISH_PROBES
    for must in (S.signer_sign, S.vfio_switch, S.converger_spec, f"$KV.{S.inventory_bucket}.gpus", upstream_event(NODE, "bound"), f"$KV.{UPSTREAM_NODES_BUCKET}.{NODE}"):
        assert must in PUBLISH_PROBES, must
    assert len(PUBLISH_PROBES) > 150 and len(SUBSCRIBE_PROBES) > 200


# ------------------------------------------------------------------ observing the server


@dataclass
class Observed:
    publish_denied: set[str]
    subscribe_denied: set[str]
    queue_denied: set[str]


_VIOLATION = re.compile(r'permissions violation for (publish|subscription) to "(.+?)"(?: using queue "(.+?)")?\s*$')


async def observe(url: str, user: str, password: str) -> Observed:
    """One connection: every probe published, subscribed and queue-subscribed; the server's refusals back."""
    by_lower = {s.lower(): s for s in (*PUBLISH_PROBES, *SUBSCRIBE_PROBES, SENTINEL)}
    refusals: Counter[tuple[str, str, str]] = Counter()
    other_errors: list[str] = []
    sentinel = asyncio.Event()

    async def on_error(exc: Exception) -> None:
        m = _VIOLATION.search(str(exc))
        if m is None:
            other_errors.append(str(exc))
            return
        kind, subject, queue = m.group(1), by_lower.get(m.group(2), m.group(2)), m.group(3) or ""
        refusals[(kind, subject, queue)] += 1
        if subject == SENTINEL:
            sentinel.set()

    nc = await nats.connect(url, user=user, password=password, inbox_prefix=inbox_prefix(user).encode(), error_cb=on_error, allow_reconnect=False)
    try:
        for subject in PUBLISH_PROBES:
            await nc.publish(subject, b"")
        for subject in SUBSCRIBE_PROBES:
            await nc.subscribe(subject)
            await nc.subscribe(subject, queue=QUEUE)
        await nc.subscribe(SENTINEL)
        await nc.flush(timeout=10)
        await asyncio.wait_for(sentinel.wait(), 10)
        assert nc.is_connected, "a permissions violation must not cost the connection"
    finally:
        await nc.close()
    assert not other_errors, other_errors
    assert all(n == 1 for n in refusals.values()), [k for k, n in refusals.items() if n != 1]
    return Observed(
        publish_denied={s for (k, s, q) in refusals if k == "publish"},
        subscribe_denied={s for (k, s, q) in refusals if k == "subscription" and not q and s != SENTINEL},
        queue_denied={s for (k, s, q) in refusals if k == "subscription" and q == QUEUE},
    )


@pytest.fixture
def embedded_bus(tmp_path):
    """The embedded default's server (with an unrestricted admin in the store account) and
    the node's streams, made as the bus setup makes them."""
    conf, creds = prepare_node_bus(tmp_path / "bus", tmp_path / "js", NODE, admin=True, upstream_nodes=[NODE])
    server = NatsServer(conf, tmp_path / "bus" / "nats-server.log").start()
    try:
        passwords = {u: p.read_text().strip() for u, p in creds.items()}
        asyncio.run(setup_streams(server.url, passwords[BUS_ADMIN_USER], NODE, outbox_max_bytes=16 * 1024 * 1024))
        yield server, passwords
    finally:
        server.stop()


def _diff(what: str, user: str, observed: set[str], expected: set[str]) -> str:
    return (
        f"{user}: the server's {what} refusals differ from the permission tables\n"
        f"  refused but the tables allow: {sorted(observed - expected)}\n"
        f"  allowed but the tables refuse: {sorted(expected - observed)}"
    )


@pytest.mark.parametrize("user", NODE_BUS_USERS)
async def test_the_server_refuses_exactly_what_the_tables_do_not_allow(embedded_bus, user: str) -> None:
    server, passwords = embedded_bus
    seen = await observe(server.url, user, passwords[user])
    perms = PERMS[user]
    expect_pub = {s for s in PUBLISH_PROBES if not allowed(perms.publish, s)}
    expect_sub = {s for s in SUBSCRIBE_PROBES if not allowed(perms.subscribe, s)}
    assert seen.publish_denied == expect_pub, _diff("publish", user, seen.publish_denied, expect_pub)
    assert seen.subscribe_denied == expect_sub, _diff("subscribe", user, seen.subscribe_denied, expect_sub)
    assert seen.queue_denied == expect_sub, _diff("queue-subscribe", user, seen.queue_denied, expect_sub)

    # --- the claims of DESIGN 2, as the server enforces them -------------------------------
    for other in SERVICES:
        if other == user:
            continue
        # a service's notices are what it publishes in its own namespace; everything else there is an endpoint
        own = S.service_wildcard(other)
        notices = {s for s in PUBLISH_PROBES if subject_matches(own, s) and allowed(PERMS[other].publish, s)}
        assert own in seen.subscribe_denied and own in seen.queue_denied, f"{user} may listen to all of {other}"
        for s in SUBSCRIBE_PROBES:
            if subject_matches(own, s) and s not in notices:
                assert s in seen.subscribe_denied and s in seen.queue_denied, f"{user} may take {other}'s requests on {s}"
        assert S.subject(other, "probe") in seen.publish_denied, f"{user} may publish to an undeclared {other} verb"
    if user != "converger":  # a compromised inventory (or operator session) cannot sign or switch (DESIGN 2)
        assert {S.signer_sign, S.vfio_switch} <= seen.publish_denied
    if user != "gateway_bridge":
        assert S.converger_spec in seen.publish_denied, "only the bridge hands the converger a spec"
    for other in (*NODE_BUS_USERS, CONTROLPLANE_USER, upstream_node_user(NODE)):  # nobody reads or forges another's replies
        if other != user:
            assert f"{inbox_prefix(other)}.probe.1" in seen.publish_denied
            assert f"{inbox_prefix(other)}.>" in seen.subscribe_denied
    assert "_INBOX.>" in seen.subscribe_denied
    for up in upstream_subjects():  # upstream is the bridge's upstream user's, never a node-bus user's
        assert literal(up) in seen.publish_denied and up in seen.subscribe_denied, up
    for s in node_subjects(OTHER):  # another node is out of reach
        assert literal(s) in seen.publish_denied and s in seen.subscribe_denied, s
    for catch_all in (">", "bcd.>", "$JS.>", "$KV.>", "$SYS.>"):
        assert catch_all in seen.subscribe_denied


# ------------------------------------------------------------------ the accounts and upstream credentials


async def _connect(url: str, user: str, password: str) -> Client:
    return await nats.connect(url, user=user, password=password, inbox_prefix=inbox_prefix(user).encode(), allow_reconnect=False)


async def test_the_node_account_cannot_reach_the_upstream_stream_or_buckets(embedded_bus, tmp_path) -> None:
    """Even an unrestricted user of the store account publishing `bcd.events.…` or
    `$KV.bcd_nodes.…` reaches nothing upstream: on one server the buses share no subject."""
    from shared.signing import Ed25519PrivateKey

    from controlplane.serve import ControlPlane

    server, passwords = embedded_bus
    cp_nc = await _connect(server.url, CONTROLPLANE_USER, passwords[CONTROLPLANE_USER])
    bridge_up = await _connect(server.url, upstream_node_user(NODE), passwords[upstream_node_user(NODE)])
    admin = await _connect(server.url, "admin", passwords["admin"])
    try:
        await ControlPlane(cp_nc, Ed25519PrivateKey.generate(), tmp_path / "cp", out=None).ensure_upstream()
        cp_js = cp_nc.jetstream()
        seen: list[tuple[str, bytes]] = []
        got_real = asyncio.Event()

        async def on_record(msg) -> None:  # noqa: ANN001
            seen.append((msg.subject, msg.data))
            if msg.data == b"real":
                got_real.set()

        sub = await cp_nc.subscribe(f"$KV.{UPSTREAM_NODES_BUCKET}.>", cb=on_record)
        await cp_nc.flush()

        # the store account has no such stream: a JetStream publish finds no one to store it
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await admin.jetstream().publish(upstream_event(NODE, "bound"), b"forged", timeout=2)
        for subject in (upstream_event(NODE, "bound"), f"$KV.{UPSTREAM_NODES_BUCKET}.{NODE}", f"$KV.{UPSTREAM_INVENTORY_BUCKET}.{NODE}"):
            await admin.publish(subject, b"forged")
        await admin.flush()

        # the bridge's upstream user, in its own upstream account, does reach them
        ack = await bridge_up.jetstream().publish(upstream_event(NODE, "bound"), b"real", headers={"Nats-Msg-Id": "probe-1"})
        assert ack.stream == UPSTREAM_EVENTS_STREAM
        await bridge_up.publish(f"$KV.{UPSTREAM_NODES_BUCKET}.{NODE}", b"real")
        await asyncio.wait_for(got_real.wait(), 10)
        assert seen == [(f"$KV.{UPSTREAM_NODES_BUCKET}.{NODE}", b"real")], "a NODE-account publish reached upstream"
        await sub.unsubscribe()
        events = await cp_js.stream_info(UPSTREAM_EVENTS_STREAM)
        assert events.state.messages == 1
        assert (await cp_js.get_msg(UPSTREAM_EVENTS_STREAM, seq=1)).data == b"real"
        for bucket in (UPSTREAM_NODES_BUCKET, UPSTREAM_INVENTORY_BUCKET):
            info = await cp_js.stream_info(f"KV_{bucket}")
            assert info.state.messages == (1 if bucket == UPSTREAM_NODES_BUCKET else 0), bucket
        # and the other way: the upstream stream is not visible from the store account at all
        with pytest.raises(nats.js.errors.NotFoundError):
            await admin.jetstream().stream_info(UPSTREAM_EVENTS_STREAM)
    finally:
        for nc in (cp_nc, bridge_up, admin):
            await nc.close()


async def test_the_bridge_drains_the_outbox_with_exactly_its_permissions(embedded_bus) -> None:
    """The bridge's outbox reader and purger, as the gateway_bridge user on the production
    permissions: batched direct gets read what the converger journaled (a writer's notice
    reads at once), the forwarded stretch is purged, without one permission violation; no
    consumer exists at any time, and the bridge may make none."""
    from services.converger.outbox import JetStreamOutbox
    from services.gateway_bridge.outbox import OutboxReader
    from services.gateway_bridge.purge import OutboxPurger
    from shared import logs
    from shared.subjects import MSG_ID_HEADER

    server, passwords = embedded_bus
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    bridge = await nats.connect(
        server.url,
        user="gateway_bridge",
        password=passwords["gateway_bridge"],
        inbox_prefix=inbox_prefix("gateway_bridge").encode(),
        error_cb=on_error,
        allow_reconnect=False,
    )
    converger = await _connect(server.url, "converger", passwords["converger"])
    admin = await _connect(server.url, "admin", passwords["admin"])
    stream = S.outbox_stream
    log = logs.get_logger("test.outbox")
    try:
        outbox = JetStreamOutbox(converger, S)
        await outbox.recheck()
        assert outbox.ready and outbox.max_bytes == 16 * 1024 * 1024
        for i in range(5):
            await converger.jetstream().publish(S.outbox_subject("section"), b"{}", headers={MSG_ID_HEADER: f"probe-{i}"})
        reader = OutboxReader(bridge, stream, S.outbox_direct_get, 64, log)
        await reader.open()
        got = []
        while len(got) < 5:
            await asyncio.wait_for(reader.arrival(), 5)
            got += await reader.take(64)
        assert [(m.seq, m.headers[MSG_ID_HEADER]) for m in got] == [(i + 1, f"probe-{i}") for i in range(5)]
        # a message journaled now is read when its writer says so (the converger's notice)
        woken = asyncio.Event()

        async def on_journaled(_msg) -> None:  # noqa: ANN001
            await reader.poke()
            woken.set()

        await bridge.subscribe(S.converger_journaled, cb=on_journaled)
        await bridge.flush()
        await converger.jetstream().publish(S.outbox_subject("bound"), b"{}", headers={MSG_ID_HEADER: "probe-live"})
        await converger.publish(S.converger_journaled, b"")
        await asyncio.wait_for(woken.wait(), 5)
        await asyncio.wait_for(reader.arrival(), 5)
        live = await reader.take(64)
        assert [(m.seq, m.subject) for m in live] == [(6, S.outbox_subject("bound"))]
        # read again from a sequence (what a failed forward does)
        reader.rewind(3)
        again = []
        while len(again) < 4:
            await asyncio.wait_for(reader.arrival(), 5)
            again += await reader.take(64)
        assert [m.seq for m in again] == [3, 4, 5, 6]

        purger = OutboxPurger(bridge, stream, reader, log)
        purger.add(got[2])
        await purger.flush(5)
        state = (await admin.jetstream().stream_info(stream)).state
        assert (state.first_seq, state.messages) == (4, 3)

        assert await admin.jetstream().consumers_info(stream) == [], "the reader made a consumer"
        await reader.close()
        await asyncio.gather(*reader._background)

        # and no consumer of any kind may be made by the bridge
        for subject, body in (
            (f"$JS.API.CONSUMER.CREATE.{stream}", {"stream_name": stream, "config": {"ack_policy": "none", "deliver_policy": "all"}}),
            (f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.bridge", {"stream_name": stream, "config": {"durable_name": "bridge", "ack_policy": "none"}}),
        ):
            with pytest.raises(nats.errors.Error):
                await bridge.request(subject, json.dumps(body).encode(), timeout=2)
        assert await admin.jetstream().consumers_info(stream) == []
        assert len(errors) == 2 and all("permissions violation" in e.lower() for e in errors), errors
    finally:
        for nc in (bridge, converger, admin):
            await nc.close()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


@pytest.mark.timeout(180)
def test_only_the_bridge_process_holds_upstream_credentials(tmp_path) -> None:
    """`bcd up`: of every node process, only gateway_bridge gets BCD_UPSTREAM_* (its own
    upstream user's password file), and it alone of them is connected to an upstream account
    (its own; the control plane is in UPSTREAM)."""
    if not Path("/proc/self/environ").exists():
        pytest.skip("/proc not mounted: cannot read the services' environments")
    node = Node(tmp_path).start()
    try:
        info = json.loads((node.state / "node.json").read_text())
        services = wait_for(lambda: (lambda p: p if set(info["services"]) <= set(p) else None)(node.ping()), 60, "every service")
        assert set(E2E_SERVICES) <= set(info["services"])
        creds = Path(info["creds_dir"])
        upstream_secrets = {str(creds / f"{u}.password") for u in (CONTROLPLANE_USER, upstream_node_user(NODE))}
        for name in info["services"]:
            env = _environ(int(services[name]["metadata"]["pid"]))
            # the bus setup's identity (it makes streams) is no service's
            assert str(creds / f"{BUS_ADMIN_USER}.password") not in env.values(), name
            assert env["BCD_NATS_USER"] == name
            assert env["BCD_NATS_PASSWORD_FILE"] == str(creds / f"{name}.password")
            upstream_env = {k: v for k, v in env.items() if k.startswith("BCD_UPSTREAM_")}
            if name == "gateway_bridge":
                assert upstream_env["BCD_UPSTREAM_PASSWORD_FILE"] == str(creds / f"{upstream_node_user(NODE)}.password")
                assert "BCD_UPSTREAM_URL" in upstream_env
            else:
                assert not upstream_env, f"{name} was given upstream settings: {sorted(upstream_env)}"
                assert not upstream_secrets & set(env.values()), f"{name} was given an upstream password file"
                cp_env = {k: v for k, v in env.items() if k.startswith("BCD_CP_")}
                # the converger verifies every spec itself (issue 40): the control plane's public key, nothing else of its
                allowed = {"BCD_CP_KEY": str(node.cp_dir / "cp.pub")} if name == "converger" else {}
                assert cp_env == allowed, f"{name} was given control-plane settings: {sorted(cp_env)}"

        def upstream_conns() -> list[tuple[str, str]] | None:
            connz = json.loads(urllib.request.urlopen(f"{info['monitor_url']}/connz?auth=true&limit=1024", timeout=5).read())
            rows = sorted((c.get("authorized_user", ""), c.get("name", "")) for c in connz["connections"] if c.get("account", "").startswith("UPSTREAM"))
            return rows if len(rows) >= 2 else None

        rows = wait_for(upstream_conns, 30, "the bridge and the control plane connected upstream")
        assert rows == [(CONTROLPLANE_USER, "bcd-controlplane"), (upstream_node_user(NODE), f"bcd-bridge-{NODE}")]
    finally:
        node.stop()
