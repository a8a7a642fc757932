"""Subjects, upstream names and node-bus permissions (DESIGN 2 and 3).

Node-bus subjects are `bcd.<node_id>.<service>.<verb>`; each NATS user may
touch exactly its own subjects. Permissions are checked with NATS' own wildcard
rules (`*` one token, `>` one or more trailing tokens), so a pattern that would
let one service reach another's endpoints fails here, not in production.
"""

from __future__ import annotations

import re

import pytest

from shared.schemas.events import EVENT_TYPES
from shared.subjects import (
    MSG_ID_HEADER,
    NODE_BUS_USERS,
    OPERATOR_USER,
    RESERVED_NODE_IDS,
    SERVICES,
    UPSTREAM_EVENTS_STREAM,
    UPSTREAM_INVENTORY_BUCKET,
    UPSTREAM_NODES_BUCKET,
    UPSTREAM_NODESPECS_BUCKET,
    NodeSubjects,
    Permissions,
    inbox_prefix,
    server_list,
    upstream_event,
    upstream_events_filter,
)

from tests.blocking import subject_matches

NODE = "n1"
S = NodeSubjects(NODE)


def overlaps(a: str, b: str) -> bool:
    """Is there a subject both patterns cover?"""
    x, y = a.split("."), b.split(".")
    for i in range(min(len(x), len(y))):
        if x[i] == ">" or y[i] == ">":
            return True
        if x[i] != y[i] and "*" not in (x[i], y[i]):
            return False
    return len(x) == len(y)


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("bcd.n1.signer.>", "bcd.n1.signer.sign", True),
        ("bcd.n1.signer.>", "bcd.n1.signer", False),
        ("bcd.n1.*.sign", "bcd.n1.signer.sign", True),
        ("bcd.n1.signer.sign", "bcd.n1.signer.sign.x", False),
        ("$SRV.>", "$SRV.PING.signer", True),
        (">", "a", True),
    ],
)
def test_matcher(pattern: str, subject: str, expected: bool) -> None:
    assert subject_matches(pattern, subject) is expected
    assert overlaps(pattern, subject) is expected


# --- node subjects --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("prefix", "bcd.n1"),
        ("inventory_get", "bcd.n1.inventory.get"),
        ("inventory_rescan", "bcd.n1.inventory.rescan"),
        ("inventory_changed", "bcd.n1.inventory.changed"),
        ("inventory_bucket", "bcd_node_n1_inventory"),
        ("signer_sign", "bcd.n1.signer.sign"),
        ("signer_key", "bcd.n1.signer.key"),
        ("helper_file_write", "bcd.n1.helper.file.write"),
        ("helper_file_remove", "bcd.n1.helper.file.remove"),
        ("helper_slice_apply", "bcd.n1.helper.slice.apply"),
        ("helper_slice_remove", "bcd.n1.helper.slice.remove"),
        ("helper_info", "bcd.n1.helper.info"),
        ("converger_status_changed", "bcd.n1.converger.status_changed"),
    ],
)
def test_named_subjects(name: str, expected: str) -> None:
    assert getattr(S, name) == expected


@pytest.mark.parametrize("service", SERVICES)
def test_subject_shape_for_every_service(service: str) -> None:
    subject = S.subject(service, "verb")
    assert subject == f"bcd.{NODE}.{service}.verb"
    assert subject.split(".") == ["bcd", NODE, service, "verb"]
    assert S.service_wildcard(service) == f"bcd.{NODE}.{service}.>"
    assert subject_matches(S.service_wildcard(service), subject)


@pytest.mark.parametrize("service", ["nope", "", "Signer", "signer.x", "*", ">"])
def test_unknown_service_refused(service: str) -> None:
    with pytest.raises(ValueError, match="unknown service"):
        S.subject(service, "get")


BAD_NODE_IDS = [
    pytest.param("", id="empty"),
    pytest.param("Node", id="uppercase"),
    pytest.param("a.b", id="dot-splits-token"),
    pytest.param("*", id="star"),
    pytest.param(">", id="gt"),
    pytest.param("a b", id="space"),
    pytest.param("a\n", id="trailing-newline"),
    pytest.param("-a", id="leading-dash"),
    pytest.param("a" * 64, id="64-chars"),
    pytest.param("a/b", id="slash"),
    pytest.param("$SRV", id="dollar"),
]


@pytest.mark.parametrize("node_id", BAD_NODE_IDS)
def test_invalid_node_ids_refused(node_id: str) -> None:
    with pytest.raises(ValueError, match="node_id .* is not a valid subject token"):
        NodeSubjects(node_id)
    with pytest.raises(ValueError, match="node_id .* is not a valid subject token"):
        upstream_event(node_id, "bound")


@pytest.mark.parametrize("node_id", ["a", "0", "a" * 63, "gpu-node_01"])
def test_valid_node_ids(node_id: str) -> None:
    subjects = NodeSubjects(node_id)
    assert subjects.signer_sign == f"bcd.{node_id}.signer.sign"
    assert re.fullmatch(r"[a-zA-Z0-9_-]+", subjects.inventory_bucket), "a valid KV bucket name"


def test_node_subjects_are_frozen() -> None:
    with pytest.raises(AttributeError):
        S.node_id = "n2"  # type: ignore[misc]


# --- permissions ------------------------------------------------------------------------

PERMS: dict[str, Permissions] = {user: S.permissions(user) for user in NODE_BUS_USERS}
KV_PUT = f"$KV.{S.inventory_bucket}.gpus"
KV_STREAM = f"KV_{S.inventory_bucket}"
OUTBOX = S.outbox_stream


def test_users_are_the_services_and_the_operator() -> None:
    assert NODE_BUS_USERS == (*SERVICES, OPERATOR_USER)
    assert len(set(NODE_BUS_USERS)) == len(NODE_BUS_USERS)


@pytest.mark.parametrize("user", ["root", "", "INVENTORY", "admin", "inventory.x"])
def test_unknown_user_refused(user: str) -> None:
    with pytest.raises(ValueError, match="unknown node-bus user"):
        S.permissions(user)


def publishers(subject: str) -> set[str]:
    return {u for u, p in PERMS.items() if any(subject_matches(pat, subject) for pat in p.publish)}


def subscribers(subject: str) -> set[str]:
    return {u for u, p in PERMS.items() if any(subject_matches(pat, subject) for pat in p.subscribe)}


READERS = {"converger", "gateway_bridge", "cli"}

#: who may publish to each subject: every row is a decision (DESIGN 2).
PUBLISH_MATRIX = [
    pytest.param(S.signer_sign, {"converger"}, id="signer.sign"),
    pytest.param(S.signer_sign_batch, {"converger"}, id="signer.sign_batch"),
    pytest.param(S.signer_key, {"converger", "gateway_bridge", "cli"}, id="signer.key"),
    pytest.param(S.subject("signer", "other"), set(), id="signer.other"),
    pytest.param(
        S.inventory_get, {"converger", "gateway_bridge", "kube_reaper", "device_plugin", "dra_plugin", "vfio_switcher", "helper", "cli"}, id="inventory.get"
    ),
    pytest.param(S.inventory_rescan, {"cli"}, id="inventory.rescan"),
    pytest.param(S.inventory_changed, {"inventory"}, id="inventory.changed"),
    # only the converger asks for switches: a compromised inventory or operator session cannot
    pytest.param(S.vfio_switch, {"converger"}, id="vfio_switcher.switch"),
    pytest.param(S.vfio_result, {"vfio_switcher"}, id="vfio_switcher.result"),
    pytest.param(S.inventory_gpu, {"cli"}, id="inventory.gpu"),
    pytest.param(S.converger_claims, {"inventory", "dra_plugin", "cli"}, id="converger.claims"),
    # DRA: only the DRA plugin prepares claims; only the converger makes MIG instances
    pytest.param(S.converger_claim_prepare, {"dra_plugin"}, id="converger.claim_prepare"),
    pytest.param(S.converger_claim_unprepare, {"dra_plugin"}, id="converger.claim_unprepare"),
    pytest.param(S.inventory_mig_instance, {"converger"}, id="inventory.mig_instance"),
    pytest.param(S.dra_plugin_status, {"cli"}, id="dra_plugin.status"),
    pytest.param(S.converger_claims_changed, {"converger"}, id="converger.claims_changed"),
    pytest.param(S.converger_holder, {"vfio_switcher", "cli"}, id="converger.holder"),
    pytest.param(S.outbox_subject("gpu"), {"inventory"}, id="outbox.gpu"),
    pytest.param(S.outbox_subject("condition"), {"converger", "gateway_bridge"}, id="outbox.condition"),
    pytest.param(S.outbox_subject("bound"), {"converger"}, id="outbox.bound"),
    # the root helper writes as root: only the converger may ask it anything
    pytest.param(S.helper_file_write, {"converger"}, id="helper.file.write"),
    pytest.param(S.helper_file_remove, {"converger"}, id="helper.file.remove"),
    pytest.param(S.helper_slice_apply, {"converger"}, id="helper.slice.apply"),
    pytest.param(S.helper_slice_remove, {"converger"}, id="helper.slice.remove"),
    pytest.param(S.helper_info, {"converger"}, id="helper.info"),
    pytest.param(S.subject("helper", "other"), set(), id="helper.other"),
    pytest.param("$SRV.PING.helper", {"cli"}, id="srv-ping-helper"),
    pytest.param(S.converger_status_changed, {"converger"}, id="converger.status_changed"),
    # the device plugin: only the converger withdraws a hold from the kubelet; the operator looks
    pytest.param(S.device_plugin_withdraw, {"converger"}, id="device_plugin.withdraw"),
    pytest.param(S.device_plugin_status, {"cli"}, id="device_plugin.status"),
    pytest.param(S.converger_holds_changed, {"converger"}, id="converger.holds_changed"),
    # maintenance: only an operator starts one; only the converger asks for a diagnostic
    pytest.param(S.converger_gpu_op, {"cli"}, id="converger.gpu_op"),
    pytest.param(S.inventory_diag, {"converger"}, id="inventory.diag"),
    pytest.param(S.inventory_mig_layout, {"converger"}, id="inventory.mig_layout"),
    # the inventory's bucket: its one key, put and read back by direct get; the bus setup made it
    pytest.param(S.inventory_key, {"inventory"}, id="inventory-kv-put"),
    pytest.param(f"$KV.{S.inventory_bucket}.other", set(), id="inventory-kv-put-other-key"),
    pytest.param(f"$JS.API.STREAM.CREATE.{KV_STREAM}", set(), id="inventory-kv-create"),
    pytest.param(f"$JS.API.STREAM.UPDATE.{KV_STREAM}", set(), id="inventory-kv-update"),
    pytest.param(f"$JS.API.STREAM.DELETE.{KV_STREAM}", set(), id="inventory-kv-delete"),
    pytest.param(f"$JS.API.STREAM.PURGE.{KV_STREAM}", set(), id="inventory-kv-purge"),
    pytest.param(f"$JS.API.STREAM.MSG.GET.{KV_STREAM}", set(), id="inventory-kv-get"),
    pytest.param(S.inventory_key_get, {"inventory"}, id="inventory-kv-direct-get"),
    pytest.param(f"$JS.API.DIRECT.GET.{KV_STREAM}.$KV.{S.inventory_bucket}.x", set(), id="inventory-kv-direct-get-other-key"),
    pytest.param(f"$JS.API.STREAM.INFO.{KV_STREAM}", {"cli"}, id="inventory-kv-info"),
    # the outbox: the bus setup makes it; the bridge alone reads it (direct gets by sequence:
    # no consumer exists) and purges what upstream acknowledged; the operator looks
    pytest.param(S.outbox_info, {"converger", "gateway_bridge", "cli"}, id="outbox-info"),
    pytest.param(S.outbox_direct_get, {"gateway_bridge"}, id="outbox-direct-get"),
    pytest.param(f"{S.outbox_direct_get}.{S.outbox_subject('bound')}", set(), id="outbox-direct-get-last-by-subject"),
    pytest.param(f"$JS.API.STREAM.CREATE.{OUTBOX}", set(), id="outbox-create"),
    pytest.param(f"$JS.API.STREAM.UPDATE.{OUTBOX}", set(), id="outbox-update"),
    pytest.param(f"$JS.API.STREAM.DELETE.{OUTBOX}", set(), id="outbox-delete"),
    pytest.param(S.outbox_purge, {"gateway_bridge"}, id="outbox-purge"),
    pytest.param(f"$JS.API.STREAM.MSG.GET.{OUTBOX}", set(), id="outbox-msg-get"),
    pytest.param(f"$JS.API.STREAM.MSG.DELETE.{OUTBOX}", set(), id="outbox-msg-delete"),
    pytest.param(f"$JS.API.CONSUMER.CREATE.{OUTBOX}", set(), id="outbox-consumer-create"),
    pytest.param(f"$JS.API.CONSUMER.CREATE.{OUTBOX}.named", set(), id="outbox-consumer-create-named"),
    pytest.param(f"$JS.API.CONSUMER.CREATE.{OUTBOX}.named.{S.outbox_subject('bound')}", set(), id="outbox-consumer-create-filtered"),
    pytest.param(f"$JS.API.CONSUMER.DURABLE.CREATE.{OUTBOX}.named", set(), id="outbox-consumer-durable-create"),
    pytest.param(f"$JS.API.CONSUMER.MSG.NEXT.{OUTBOX}.abc", set(), id="outbox-consumer-next"),
    pytest.param(f"$JS.API.CONSUMER.RESET.{OUTBOX}.abc", set(), id="outbox-consumer-reset"),
    pytest.param(f"$JS.API.CONSUMER.DELETE.{OUTBOX}.abc", set(), id="outbox-consumer-delete"),
    pytest.param(f"$JS.API.CONSUMER.INFO.{OUTBOX}.abc", set(), id="outbox-consumer-info"),
    pytest.param(f"$JS.ACK.{OUTBOX}.abc.1.1.1.1.0", set(), id="outbox-ack"),
    pytest.param("$JS.API.INFO", set(), id="js-account-info"),
    pytest.param(S.converger_journaled, {"converger"}, id="converger.journaled"),
    pytest.param(S.inventory_journaled, {"inventory"}, id="inventory.journaled"),
    pytest.param(f"$JS.API.CONSUMER.CREATE.{NodeSubjects('n2').outbox_stream}", set(), id="other-node-outbox-consumer-create"),
    pytest.param(f"$JS.API.STREAM.PURGE.{NodeSubjects('n2').outbox_stream}", set(), id="other-node-outbox-purge"),
    pytest.param("$SRV.PING", {"cli"}, id="srv-ping"),
    pytest.param("$SRV.PING.nope", set(), id="srv-ping-unknown-name"),
    pytest.param("$SRV.INFO.signer", {"cli"}, id="srv-info"),
    pytest.param("bcd.n2.signer.sign", set(), id="other-node-sign"),
    pytest.param("bcd.n2.inventory.get", set(), id="other-node-get"),
    pytest.param("bcd.events.n1.bound", set(), id="upstream-subject-not-on-node-bus"),
]


@pytest.mark.parametrize(("subject", "allowed"), PUBLISH_MATRIX)
def test_who_may_publish(subject: str, allowed: set[str]) -> None:
    assert publishers(subject) == allowed


def test_inventory_may_not_publish_a_sign_request_or_a_vfio_switch() -> None:
    inv = PERMS["inventory"].publish
    for target in ("signer", "vfio_switcher", "helper", "kube_reaper", "gateway_bridge"):
        assert not any(overlaps(p, S.service_wildcard(target)) for p in inv), target
    # of the converger, it may only read the claims
    assert [p for p in inv if overlaps(p, S.service_wildcard("converger"))] == [S.converger_claims]
    assert not any(subject_matches(p, S.signer_sign) for p in inv)
    assert not any(subject_matches(p, S.vfio_switch) for p in inv)


#: what a service publishes inside its own namespace: notifications nobody answers.
NOTIFICATIONS = {
    S.inventory_changed,
    S.inventory_journaled,
    S.reaper_freed,
    S.converger_claims_changed,
    S.converger_status_changed,
    S.converger_holds_changed,
    S.converger_journaled,
    S.vfio_result,
}


@pytest.mark.parametrize("user", NODE_BUS_USERS)
def test_no_user_publishes_to_its_own_endpoints_or_another_node(user: str) -> None:
    for pattern in PERMS[user].publish:
        assert not overlaps(pattern, "bcd.n2.>"), pattern
        if user in SERVICES:
            assert not overlaps(pattern, S.service_wildcard(user)) or pattern in NOTIFICATIONS, pattern


@pytest.mark.parametrize("service", SERVICES)
def test_only_the_owning_service_subscribes_to_its_endpoints(service: str) -> None:
    """A service takes requests on exactly the endpoints its routes name; anyone else inside
    its namespace listens to one of its notices, never to an endpoint."""
    wildcard = S.service_wildcard(service)
    endpoints = {r.subject for r in S.routes() if r.owner == service and not r.notice and r.subject.startswith(f"{S.prefix}.")}
    assert {p for p in PERMS[service].subscribe if overlaps(p, wildcard)} == endpoints
    for user, perms in PERMS.items():
        if user == service:
            continue
        for pattern in perms.subscribe:
            if overlaps(pattern, wildcard):
                assert pattern in NOTIFICATIONS, f"{user} subscribes {pattern} inside {wildcard}"


@pytest.mark.parametrize(
    ("subject", "allowed"),
    [
        pytest.param(S.signer_sign, {"signer"}, id="signer.sign"),
        pytest.param(S.signer_sign_batch, {"signer"}, id="signer.sign_batch"),
        pytest.param(S.inventory_get, {"inventory"}, id="inventory.get"),
        pytest.param(S.inventory_changed, {"converger", "gateway_bridge", "device_plugin", "dra_plugin", "cli"}, id="inventory.changed"),
        pytest.param(S.device_plugin_withdraw, {"device_plugin"}, id="device_plugin.withdraw"),
        pytest.param(S.converger_holds_changed, {"device_plugin"}, id="converger.holds_changed"),
        pytest.param(S.subject("vfio_switcher", "switch"), {"vfio_switcher"}, id="vfio_switcher.switch"),
        pytest.param(S.helper_file_write, {"helper"}, id="helper.file.write"),
        pytest.param(S.helper_slice_apply, {"helper"}, id="helper.slice.apply"),
        pytest.param(S.helper_info, {"helper"}, id="helper.info"),
        pytest.param(S.converger_status_changed, {"gateway_bridge"}, id="converger.status_changed"),
        pytest.param(S.converger_journaled, {"gateway_bridge"}, id="converger.journaled"),
        pytest.param(S.inventory_journaled, {"gateway_bridge"}, id="inventory.journaled"),
        pytest.param(S.outbox_filter, set(), id="outbox-subjects"),
        pytest.param("bcd.n2.signer.sign", set(), id="other-node"),
    ],
)
def test_who_may_subscribe(subject: str, allowed: set[str]) -> None:
    assert subscribers(subject) == allowed


@pytest.mark.parametrize("user", NODE_BUS_USERS)
def test_no_catch_all_patterns(user: str) -> None:
    perms = PERMS[user]
    for pattern in (*perms.publish, *perms.subscribe):
        first = pattern.split(".")[0]
        assert first not in {">", "*"}, pattern
        assert not overlaps(pattern, "bcd.*.>") or pattern.startswith(f"bcd.{NODE}."), pattern
    for pattern in perms.subscribe:
        assert pattern not in {"$SRV.>", "$JS.>", "$KV.>", "_INBOX.>", "bcd.>"}, pattern
    if user != OPERATOR_USER:
        assert "$SRV.>" not in perms.publish


@pytest.mark.parametrize("user", NODE_BUS_USERS)
def test_each_user_has_its_own_inbox(user: str) -> None:
    prefix = inbox_prefix(user)
    assert prefix == f"_INBOX_{user}"
    assert "." not in prefix and "*" not in prefix and ">" not in prefix
    assert f"{prefix}.>" in PERMS[user].subscribe
    for other in NODE_BUS_USERS:
        if other == user:
            continue
        reply = f"{inbox_prefix(other)}.abc123.1"
        assert not any(subject_matches(p, reply) for p in PERMS[user].subscribe), f"{user} can read {other}'s replies"
        assert not any(subject_matches(p, reply) for p in PERMS[user].publish), f"{user} can forge {other}'s replies"
    assert not any(subject_matches(p, "_INBOX.abc.1") for p in PERMS[user].subscribe), "the shared default inbox"


def test_inbox_prefixes_are_distinct() -> None:
    prefixes = [inbox_prefix(u) for u in NODE_BUS_USERS]
    assert len(set(prefixes)) == len(prefixes)
    for a in prefixes:
        for b in prefixes:
            if a != b:
                assert not overlaps(f"{a}.>", f"{b}.>")


@pytest.mark.parametrize("service", SERVICES)
def test_services_answer_srv_discovery(service: str) -> None:
    sub = PERMS[service].subscribe
    for verb in ("PING", "INFO", "STATS"):
        for subject in (f"$SRV.{verb}", f"$SRV.{verb}.{service}", f"$SRV.{verb}.{service}.*"):
            assert subject in sub
        assert any(subject_matches(p, f"$SRV.{verb}.{service}.abcdef") for p in sub)
        for other in SERVICES:
            if other != service:
                assert not any(overlaps(p, f"$SRV.{verb}.{other}.>") for p in sub), other
                assert f"$SRV.{verb}.{other}" not in sub
    assert PERMS[service].allow_responses


def test_operator_discovers_but_does_not_answer_srv() -> None:
    cli = PERMS[OPERATOR_USER]
    for svc in SERVICES:
        for verb in ("PING", "INFO", "STATS"):
            assert {f"$SRV.{verb}", f"$SRV.{verb}.{svc}", f"$SRV.{verb}.{svc}.*"} <= set(cli.publish)
    assert not any(p.startswith("$SRV") for p in cli.subscribe)


#: JetStream API verbs that make, change or feed a stream or consumer: with any of them a user
#: could have the server deliver a message where its own allow-list does not reach
#: (a deliver subject, a republish, a source, a pull to any reply subject, an ack)
MAKERS = [
    "$JS.API.STREAM.CREATE.X",
    "$JS.API.STREAM.UPDATE.X",
    "$JS.API.STREAM.DELETE.X",
    "$JS.API.STREAM.RESTORE.X",
    "$JS.API.STREAM.SNAPSHOT.X",
    "$JS.API.STREAM.MSG.DELETE.X",
    "$JS.API.CONSUMER.CREATE.X",
    "$JS.API.CONSUMER.CREATE.X.c",
    "$JS.API.CONSUMER.CREATE.X.c.f",
    "$JS.API.CONSUMER.DURABLE.CREATE.X.c",
    "$JS.API.CONSUMER.DELETE.X.c",
    "$JS.API.CONSUMER.MSG.NEXT.X.c",
    "$JS.API.CONSUMER.RESET.X.c",
    "$JS.API.CONSUMER.PAUSE.X.c",
    "$JS.API.CONSUMER.UNPIN.X.c",
    "$JS.ACK.X.c.1.1.1.1.0",
    "$JS.API.ACCOUNT.PURGE.X",
]


@pytest.mark.parametrize("user", NODE_BUS_USERS)
def test_no_user_may_make_or_change_a_stream_or_consumer(user: str) -> None:
    for stream in (OUTBOX, KV_STREAM, "BCD_EVENTS", "ANY"):
        for verb in MAKERS:
            subject = verb.replace(".X", f".{stream}", 1)
            assert not any(subject_matches(p, subject) for p in PERMS[user].publish), (user, subject)
    # and none subscribes to what JetStream delivers or acks
    assert not any(overlaps(p, "$JS.>") for p in PERMS[user].subscribe)


def test_the_bus_admin_makes_this_nodes_streams_and_nothing_else() -> None:
    admin = S.bus_admin_permissions()
    for subject in (f"$JS.API.STREAM.CREATE.{OUTBOX}", f"$JS.API.STREAM.UPDATE.{OUTBOX}", f"$JS.API.STREAM.CREATE.{KV_STREAM}"):
        assert any(subject_matches(p, subject) for p in admin.publish), subject
    for subject in (
        *(v.replace(".X", f".{OUTBOX}", 1) for v in MAKERS if "STREAM.CREATE" not in v and "STREAM.UPDATE" not in v),
        f"$JS.API.STREAM.CREATE.{NodeSubjects('n2').outbox_stream}",
        S.signer_sign,
        S.vfio_switch,
        f"$KV.{S.inventory_bucket}.x",
        S.outbox_subject("bound"),
    ):
        assert not any(subject_matches(p, subject) for p in admin.publish), subject
    assert not admin.allow_responses


# --- upstream ----------------------------------------------------------------------------


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_upstream_event_subject(event_type: str) -> None:
    subject = upstream_event("gpu-node-01", event_type)
    assert subject == f"bcd.events.gpu-node-01.{event_type}"
    assert subject_matches(upstream_events_filter(), subject)


def test_event_types_are_the_design_list() -> None:
    assert set(EVENT_TYPES) == {"bound", "released", "failed", "section", "condition", "gpu", "hold"}


@pytest.mark.parametrize("event_type", ["", "bogus", "bound.x", "*", ">", "Bound"])
def test_unknown_event_type_refused(event_type: str) -> None:
    with pytest.raises(ValueError, match="event type"):
        upstream_event("n1", event_type)


def test_upstream_names() -> None:
    assert upstream_events_filter() == "bcd.events.>"
    assert UPSTREAM_NODESPECS_BUCKET == "bcd_nodespecs"
    assert UPSTREAM_NODES_BUCKET == "bcd_nodes"
    assert UPSTREAM_INVENTORY_BUCKET == "bcd_inventory"
    assert UPSTREAM_EVENTS_STREAM == "BCD_EVENTS"
    assert MSG_ID_HEADER == "Nats-Msg-Id"


def test_node_id_events_is_reserved() -> None:
    """In the embedded default one nats-server carries both buses: the BCD_EVENTS stream
    (`bcd.events.>`) would capture every request of a node named "events"."""
    assert "events" in RESERVED_NODE_IDS
    with pytest.raises(ValueError, match="reserved"):
        NodeSubjects("events")
    with pytest.raises(ValueError, match="reserved"):
        upstream_event("events", "bound")


@pytest.mark.parametrize("service", SERVICES)
def test_node_subjects_never_fall_under_the_events_filter(service: str) -> None:
    for node_id in ("n1", "events1", "event", "a" * 63):
        assert not overlaps(upstream_events_filter(), NodeSubjects(node_id).service_wildcard(service))


def test_only_the_converger_reaches_the_root_helper() -> None:
    """The helper writes as root: no other user may publish anything under its subjects."""
    wildcard = S.service_wildcard("helper")
    for user, perms in PERMS.items():
        reach = [p for p in perms.publish if overlaps(p, wildcard)]
        if user == "converger":
            assert sorted(reach) == sorted(S.helper_endpoints), reach
        else:
            assert reach == [], f"{user} may publish {reach}"
    # the helper itself publishes nothing but its replies, and asks only the inventory (which
    # GPU an IOMMU group is, before it names /dev/vfio/<N>: services/helper/iommu.py)
    assert PERMS["helper"].publish == (S.inventory_get,)


@pytest.mark.parametrize(
    ("url", "servers"),
    [
        ("nats://127.0.0.1:4222", ["nats://127.0.0.1:4222"]),
        ("nats://a:4222,nats://b:4222,nats://c:4222", ["nats://a:4222", "nats://b:4222", "nats://c:4222"]),
        (" nats://a:4222 , nats://b:4222,", ["nats://a:4222", "nats://b:4222"]),
    ],
)
def test_a_url_with_commas_is_a_cluster_s_servers(url: str, servers: list[str]) -> None:
    assert server_list(url) == servers


@pytest.mark.parametrize("url", ["", " , ,"])
def test_a_url_with_no_server_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="no NATS server"):
        server_list(url)


def readme_subject_rows() -> dict[str, str]:
    """README's subject table: each subject (`bcd.<n>.x.y`, and `.z` after it on the same row
    meaning `bcd.<n>.x.z`) -> its "server" cell."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("| `bcd.<n>."):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        base = ""
        for name in re.findall(r"`([^`]+)`", cells[0]):
            if name.startswith("bcd.<n>."):
                base = name
                rows[name] = cells[1]
            elif name.startswith(".") and base:
                rows[".".join(base.split(".")[:3]) + name] = cells[1]
    return rows


def test_readme_subject_table_names_every_node_bus_endpoint_and_notice_with_its_server() -> None:
    """Every service's subject in the route table is in README's table, under the service that
    serves or publishes it (it lacked inventory.diag, .mig_layout, .sharing and converger.gpu_op)."""
    from shared.subjects import BUS_STORE

    rows = readme_subject_rows()
    missing, wrong = [], []
    for route in NodeSubjects("node-1").routes():
        if route.owner == BUS_STORE or route.subject.startswith("$"):
            continue  # the store's JetStream API and micro discovery: README's `bcd bus` section
        name = route.subject.replace("bcd.node-1.", "bcd.<n>.", 1)
        if name not in rows:
            missing.append(name)
        elif route.owner not in re.findall(r"[a-z_]+", rows[name].split("(")[0]):
            wrong.append(f"{name}: README says {rows[name]!r}, served by {route.owner}")
    assert not missing and not wrong, (missing, wrong)
