"""`bcd bus`: parsing `$SRV.STATS`, STREAM.INFO and the monitoring endpoint, the verdicts and the
table, as tables over recorded replies (shapes as nats.micro and nats-server 2.15 send them)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from bcd.busview import (
    BusReport,
    ConsumerStats,
    EndpointStats,
    ServiceStats,
    StreamStats,
    bus_json,
    bus_problems,
    fmt_age,
    fmt_bytes,
    fmt_ns,
    merge_stats,
    parse_monitor,
    parse_stream,
    parse_ts,
    render_bus,
    with_consumers,
)
from shared.subjects import node_account

NOW = datetime(2026, 11, 30, 9, 0, tzinfo=timezone.utc)
SERVICES = ["signer", "inventory", "converger", "gateway_bridge"]


def endpoint(name: str, service: str = "converger", requests: int = 0, errors: int = 0, time_ns: int = 0, last_error: str = "") -> dict:
    return {
        "name": name,
        "subject": f"bcd.node-1.{service}.{name}",
        "queue_group": "q",
        "num_requests": requests,
        "num_errors": errors,
        "last_error": last_error,
        "processing_time": time_ns,
        "average_processing_time": time_ns // requests if requests else 0,
        "data": None,
    }


def stats(name: str, *endpoints: dict, id_: str = "id1", started: str = "2026-11-30T08:00:00.000Z") -> dict:
    return {
        "type": "io.nats.micro.v1.stats_response",
        "name": name,
        "id": id_,
        "version": "0.1.0",
        "started": started,
        "endpoints": list(endpoints),
        "metadata": {"node_id": "node-1"},
    }


# ------------------------------------------------------------------ $SRV.STATS


def test_one_instance_is_taken_as_it_comes() -> None:
    merged = merge_stats([stats("converger", endpoint("spec", requests=2, time_ns=4_000_000), endpoint("status"))])
    conv = merged["converger"]
    assert conv.ids == ("id1",) and conv.version == "0.1.0"
    assert conv.endpoints == (
        EndpointStats("spec", "bcd.node-1.converger.spec", 2, 0, 4_000_000, 2_000_000, ""),
        EndpointStats("status", "bcd.node-1.converger.status", 0, 0, 0, 0, ""),
    )
    assert conv.endpoint("spec") is conv.endpoints[0] and conv.endpoint("nope") is None


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        pytest.param((3, 0, 3_000), (1, 1, 5_000), (4, 1, 8_000, 2_000), id="weighted-average"),
        pytest.param((0, 0, 0), (0, 0, 0), (0, 0, 0, 0), id="no-requests-no-average"),
        pytest.param((0, 0, 0), (2, 2, 10), (2, 2, 10, 5), id="only-the-new-instance-served"),
    ],
)
def test_two_instances_of_a_service_are_summed(a, b, expected) -> None:
    """A restarted process can overlap its successor: the service is shown as one."""
    merged = merge_stats(
        [
            stats("signer", endpoint("sign", "signer", *a), id_="old", started="2026-11-30T08:00:00.000Z"),
            stats("signer", endpoint("sign", "signer", *b, last_error="ServiceError('400')" if b[1] else ""), id_="new", started="2026-11-30T08:05:00.000Z"),
        ]
    )
    s = merged["signer"]
    e = s.endpoint("sign")
    assert e is not None
    assert (e.num_requests, e.num_errors, e.processing_time, e.average_processing_time) == expected
    assert s.ids == ("old", "new") and s.started == "2026-11-30T08:05:00.000Z"
    assert e.last_error == ("ServiceError('400')" if b[1] else "")


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param({}, id="empty"),
        pytest.param({"name": ""}, id="no-name"),
        pytest.param({"name": 7}, id="name-not-a-string"),
    ],
)
def test_replies_without_a_name_are_skipped(reply: dict) -> None:
    assert merge_stats([reply]) == {}


def test_missing_endpoint_fields_read_as_zero() -> None:
    merged = merge_stats([{"name": "inventory", "endpoints": [{"name": "get", "num_requests": "x"}]}])
    assert merged["inventory"].endpoints == (EndpointStats("get", "", 0, 0, 0, 0, ""),)


# ------------------------------------------------------------------ streams and KV

OUTBOX_INFO = {
    "type": "io.nats.jetstream.api.v1.stream_info_response",
    "config": {"name": "BCD_OUTBOX_node-1", "subjects": ["bcd.node-1.outbox.>"]},
    "state": {"messages": 3, "bytes": 2400, "first_seq": 9, "first_ts": "2026-11-30T08:58:00.123456789Z", "last_seq": 11, "last_ts": "2026-11-30T08:59:30Z", "consumer_count": 0},
}
EMPTY_OUTBOX = {"config": {"name": "BCD_OUTBOX_node-1"}, "state": {"messages": 0, "bytes": 0, "first_seq": 9, "first_ts": "0001-01-01T00:00:00Z", "last_seq": 8, "last_ts": "2026-11-30T08:00:00Z", "consumer_count": 0}}
KV_INFO = {"config": {"name": "KV_bcd_node_node-1_inventory"}, "state": {"messages": 1, "bytes": 15088, "first_seq": 4, "first_ts": "2026-11-30T08:59:50Z", "last_seq": 4, "last_ts": "2026-11-30T08:59:50Z", "num_subjects": 1, "consumer_count": 2}}
EVENTS_DETAIL = {
    "name": "BCD_EVENTS",
    "state": {"messages": 8, "bytes": 6376, "first_seq": 1, "first_ts": "2026-11-30T08:00:00Z", "last_seq": 8, "last_ts": "2026-11-30T08:59:00Z", "num_subjects": 1, "consumer_count": 1},
    "consumer_detail": [
        {
            "stream_name": "BCD_EVENTS",
            "name": "controlplane",
            "delivered": {"consumer_seq": 8, "stream_seq": 8, "last_active": "2026-11-30T08:59:00.5Z"},
            "ack_floor": {"consumer_seq": 7, "stream_seq": 7},
            "num_ack_pending": 1,
            "num_redelivered": 0,
            "num_waiting": 1,
            "num_pending": 0,
        }
    ],
}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2026-11-30T08:58:00.123456789Z", datetime(2026, 11, 30, 8, 58, 0, 123456, tzinfo=timezone.utc)),
        ("2026-11-30T08:58:00Z", datetime(2026, 11, 30, 8, 58, tzinfo=timezone.utc)),
        ("2026-11-30T08:58:00.5Z", datetime(2026, 11, 30, 8, 58, 0, 500000, tzinfo=timezone.utc)),
        ("2026-11-30T09:58:00.25+01:00", datetime(2026, 11, 30, 8, 58, 0, 250000, tzinfo=timezone.utc)),
        ("0001-01-01T00:00:00Z", None),
        ("", None),
        (None, None),
        ("yesterday", None),
    ],
)
def test_server_times(value, expected) -> None:
    assert parse_ts(value) == expected


def test_stream_info_reply() -> None:
    s = parse_stream(OUTBOX_INFO, "NODE")
    assert (s.name, s.account, s.messages, s.bytes, s.first_seq, s.last_seq, s.consumer_count) == ("BCD_OUTBOX_node-1", "NODE", 3, 2400, 9, 11, 0)
    assert s.first_ts == datetime(2026, 11, 30, 8, 58, 0, 123456, tzinfo=timezone.utc)
    assert not s.is_kv and s.bucket == ""


def test_an_empty_stream_has_no_oldest_message() -> None:
    s = parse_stream(EMPTY_OUTBOX)
    assert s.messages == 0 and s.first_ts is None and s.last_seq == 8


def test_kv_stream_is_a_bucket_with_keys_and_a_revision() -> None:
    s = parse_stream(KV_INFO)
    assert s.is_kv and s.bucket == "bcd_node_node-1_inventory"
    assert (s.num_subjects, s.last_seq, s.consumer_count) == (1, 4, 2)


def test_jsz_stream_detail_with_its_consumers() -> None:
    s = parse_stream(EVENTS_DETAIL, "UPSTREAM")
    assert s.consumers == (
        ConsumerStats("controlplane", 0, 1, 0, 1, 8, 7, datetime(2026, 11, 30, 8, 59, 0, 500000, tzinfo=timezone.utc)),
    )


# ------------------------------------------------------------------ the monitoring endpoint

VARZ = {"server_name": "bcd-node-bus", "version": "2.15.1", "uptime": "1m2s", "connections": 4}


def conn(user: str, account: str = "", name: str = "", subs: int = 10, in_msgs: int = 1, out_msgs: int = 2, pending: int = 0) -> dict:
    # a node-bus identity connects to its own account (shared.subjects.node_account)
    account = account or node_account(user)
    return {"cid": 1, "kind": "Client", "authorized_user": user, "account": account, "subscriptions": subs, "in_msgs": in_msgs, "out_msgs": out_msgs, "pending_bytes": pending, **({"name": name} if name else {})}


CONNZ = {
    "num_connections": 4,
    "connections": [
        conn("converger", name="bcd-converger", subs=17),
        conn("cli", subs=1),
        conn("cli", subs=2, in_msgs=5, out_msgs=5, pending=100),
        conn("node-node-1", "UPSTREAM", "bcd-bridge-node-1", subs=2),
    ],
}
SUBSZ = {"num_subscriptions": 173}
JSZ = {
    "streams": 3,
    "consumers": 1,
    "messages": 12,
    "bytes": 23864,
    "memory": 0,
    "storage": 23864,
    "api": {"total": 37, "errors": 2},
    "account_details": [
        {"name": "UPSTREAM", "stream_detail": [EVENTS_DETAIL]},
        {"name": "NODE", "stream_detail": [KV_INFO | {"name": "KV_bcd_node_node-1_inventory"}, {**OUTBOX_INFO, "name": "BCD_OUTBOX_node-1"}]},
    ],
}


def test_monitor_groups_connections_per_account_and_user() -> None:
    mon = parse_monitor("http://127.0.0.1:8222", VARZ, CONNZ, SUBSZ, JSZ)
    assert (mon.server_name, mon.version, mon.uptime, mon.connections, mon.subscriptions) == ("bcd-node-bus", "2.15.1", "1m2s", 4, 173)
    assert [(u.account, u.user, u.connections, u.subscriptions, u.in_msgs, u.out_msgs, u.pending_bytes, u.names) for u in mon.users or ()] == [
        ("NODE_cli", "cli", 2, 3, 6, 7, 100, ()),
        ("NODE_converger", "converger", 1, 17, 1, 2, 0, ("bcd-converger",)),
        ("UPSTREAM", "node-node-1", 1, 2, 1, 2, 0, ("bcd-bridge-node-1",)),
    ]
    assert mon.user("converger") is not None and mon.user("converger", "NODE") is None and mon.user("node-node-1") is None and mon.user("node-node-1", "UPSTREAM") is not None
    js = mon.jetstream
    assert js is not None and (js.streams, js.consumers, js.messages, js.bytes, js.api_total, js.api_errors) == (3, 1, 12, 23864, 37, 2)
    # the node's own streams first, then the other accounts'
    assert [(s.account, s.name) for s in mon.streams] == [("NODE", "BCD_OUTBOX_node-1"), ("NODE", "KV_bcd_node_node-1_inventory"), ("UPSTREAM", "BCD_EVENTS")]
    assert mon.stream("BCD_EVENTS", "UPSTREAM") is not None and mon.stream("BCD_EVENTS") is None


@pytest.mark.parametrize(
    ("parts", "users_known", "subscriptions", "js"),
    [
        pytest.param((None, None, None, None), False, None, False, id="nothing-read"),
        pytest.param((VARZ, None, SUBSZ, None), False, 173, False, id="no-connz-no-jsz"),
        pytest.param((None, CONNZ, None, JSZ), True, None, True, id="no-varz"),
    ],
)
def test_monitor_parts_that_could_not_be_read(parts, users_known, subscriptions, js) -> None:
    mon = parse_monitor("http://127.0.0.1:8222", *parts, error="varz: refused")
    assert (mon.users is not None) == users_known
    assert mon.subscriptions == subscriptions
    assert (mon.jetstream is not None) == js
    assert mon.error == "varz: refused"
    if parts[0] is None and parts[1] is not None:
        assert mon.connections == len(CONNZ["connections"])


def test_outbox_consumers_come_from_jsz() -> None:
    outbox = parse_stream(OUTBOX_INFO, "NODE")
    detail = {**OUTBOX_INFO, "name": "BCD_OUTBOX_node-1", "consumer_detail": EVENTS_DETAIL["consumer_detail"]}
    mon = parse_monitor("u", VARZ, CONNZ, SUBSZ, {**JSZ, "account_details": [{"name": "NODE", "stream_detail": [detail]}]})
    merged = with_consumers(outbox, mon)
    assert merged is not None and [c.name for c in merged.consumers] == ["controlplane"] and merged.messages == 3
    assert with_consumers(outbox, None) is outbox
    assert with_consumers(None, mon) is None
    assert with_consumers(outbox, parse_monitor("u", VARZ, CONNZ, SUBSZ, JSZ)) is outbox


# ------------------------------------------------------------------ verdicts


def full_connz(*users: str) -> dict:
    return {"connections": [conn(u, name=f"bcd-{u}") for u in users]}


def report(**kw) -> BusReport:
    base = dict(
        node_id="node-1",
        nats_url="nats://127.0.0.1:4222",
        reachable=True,
        expected=SERVICES,
        services=merge_stats([stats(n, endpoint("x", n)) for n in SERVICES]),
        outbox=parse_stream(EMPTY_OUTBOX, "NODE"),
        buckets=[parse_stream(KV_INFO, "NODE")],
        monitor=parse_monitor("http://127.0.0.1:8222", VARZ, full_connz(*SERVICES), SUBSZ, JSZ),
        now=NOW,
    )
    base.update(kw)
    return BusReport(**base)


STALE_OUTBOX = StreamStats("BCD_OUTBOX_node-1", "NODE", messages=2, bytes=10, first_ts=NOW - timedelta(seconds=300))
FRESH_OUTBOX = StreamStats("BCD_OUTBOX_node-1", "NODE", messages=2, bytes=10, first_ts=NOW - timedelta(seconds=30))


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param({}, [], id="healthy"),
        pytest.param({"reachable": False, "error": "node bus nats://x unreachable", "services": {}}, ["node bus nats://x unreachable"], id="bus-down"),
        pytest.param(
            {"services": merge_stats([stats(n) for n in SERVICES if n != "signer"])},
            ["service signer does not answer $SRV.STATS"],
            id="service-silent",
        ),
        pytest.param(
            {"monitor": parse_monitor("http://127.0.0.1:8222", VARZ, full_connz(*SERVICES[1:]), SUBSZ, JSZ)},
            ["no connection of user signer on the node bus (connz)"],
            id="user-not-connected",
        ),
        pytest.param(
            {"monitor": parse_monitor("http://127.0.0.1:8222", None, None, None, None, error="varz: Connection refused")},
            ["monitoring endpoint http://127.0.0.1:8222: varz: Connection refused"],
            id="monitor-down-says-nothing-about-connections",
        ),
        pytest.param({"monitor": None}, [], id="monitoring-off"),
        pytest.param({"outbox": STALE_OUTBOX}, ["outbox not draining: 2 events, oldest 300 s"], id="outbox-stale"),
        pytest.param({"outbox": FRESH_OUTBOX}, [], id="outbox-draining"),
        pytest.param({"outbox": None}, [], id="outbox-not-created-yet"),
    ],
)
def test_problems(changes: dict, expected: list[str]) -> None:
    assert bus_problems(report(**changes)) == expected


# ------------------------------------------------------------------ formatting and the table


@pytest.mark.parametrize(
    ("ns", "text"),
    [(0, "-"), (-5, "-"), (999, "999ns"), (1_000, "1µs"), (364_000, "364µs"), (999_499, "999µs"), (5_015_565, "5.0ms"), (999_000_000, "999.0ms"), (1_500_000_000, "1.50s")],
)
def test_durations(ns: int, text: str) -> None:
    assert fmt_ns(ns) == text


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (15088, "14.7 KiB"), (5 * 2**20, "5.0 MiB"), (3 * 2**40, "3072.0 GiB")])
def test_sizes(n: int, text: str) -> None:
    assert fmt_bytes(n) == text


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (0, "0 s ago"), (-3, "0 s ago"), (119, "119 s ago"), (600, "10 min ago"), (10800, "3.0 h ago")])
def test_ages(seconds, text: str) -> None:
    ts = None if seconds is None else NOW - timedelta(seconds=seconds)
    assert fmt_age(ts, NOW) == text


def test_the_table() -> None:
    services = merge_stats(
        [
            stats("converger", endpoint("spec", requests=2, time_ns=10_000_000), endpoint("holder", requests=4, errors=1, time_ns=400_000, last_error="ServiceError('400')")),
            stats("gateway_bridge"),
            stats("inventory", endpoint("get", "inventory", 1, 0, 364_000)),
            stats("signer", endpoint("sign", "signer")),
        ]
    )
    text = render_bus(report(services=services, expected=[*SERVICES, "vfio_switcher"], outbox=FRESH_OUTBOX))
    lines = text.splitlines()
    assert lines[0] == "node node-1  bus nats://127.0.0.1:4222  nats-server 2.15.1 (bcd-node-bus) up 1m2s  monitoring http://127.0.0.1:8222"
    assert lines[1].split() == ["SERVICE", "ENDPOINT", "SUBJECT", "REQUESTS", "ERRORS", "AVG", "TIME", "LAST", "ERROR"]
    rows = [line.split() for line in lines[2:8]]
    assert rows == [
        ["converger", "spec", "bcd.node-1.converger.spec", "2", "0", "5.0ms"],
        ["holder", "bcd.node-1.converger.holder", "4", "1", "100µs", "ServiceError('400')"],
        ["gateway_bridge", "-", "(no", "endpoints)"],
        ["inventory", "get", "bcd.node-1.inventory.get", "1", "0", "364µs"],
        ["signer", "sign", "bcd.node-1.signer.sign", "0", "0", "-"],
        ["vfio_switcher", "DOWN:", "no", "$SRV.STATS", "reply"],
    ]
    assert "outbox BCD_OUTBOX_node-1: 2 messages (10 B), oldest 30 s ago, last seq 0, no consumers (the bridge reads by sequence)" in lines
    assert "kv bcd_node_node-1_inventory: 1 key, revision 4, last update 2026-11-30T08:59:50+00:00 (10 s ago), 14.7 KiB" in lines
    assert "CONNECTIONS 4 (connz)  SUBSCRIPTIONS 173 (subsz)" in lines
    assert any(line.split() == ["NODE_converger", "converger", "1", "10", "1", "2", "0", "B", "bcd-converger"] for line in lines)
    assert any(line.startswith("JETSTREAM 3 streams, 1 consumer, 12 messages, 23.3 KiB") for line in lines)
    assert any(line.split()[:4] == ["UPSTREAM", "BCD_EVENTS", "8", "6.2"] for line in lines)
    assert "    consumer controlplane: pending 0, ack pending 1, redelivered 0, waiting 1, delivered seq 8, ack floor 7" in lines
    assert lines[-1] == "health: UNHEALTHY: service vfio_switcher does not answer $SRV.STATS; no connection of user vfio_switcher on the node bus (connz)"


def test_the_table_of_an_unreachable_node_without_monitoring() -> None:
    text = render_bus(report(reachable=False, error="node bus nats://127.0.0.1:4222 unreachable: refused", services={}, outbox=None, buckets=[], monitor=None))
    assert text.splitlines() == [
        "node node-1  bus nats://127.0.0.1:4222  monitoring off",
        "node bus: node bus nats://127.0.0.1:4222 unreachable: refused",
        "",
        "",
        "health: UNHEALTHY: node bus nats://127.0.0.1:4222 unreachable: refused",
    ]


def test_an_empty_outbox_and_a_missing_one() -> None:
    assert "outbox BCD_OUTBOX_node-1: 0 messages (0 B), empty, last seq 8, no consumers (the bridge reads by sequence)" in render_bus(report()).splitlines()
    assert "outbox: not created yet" in render_bus(report(outbox=None)).splitlines()


def test_json() -> None:
    services = merge_stats([stats("converger", endpoint("spec", requests=2, time_ns=10_000_000))])
    out = bus_json(report(services=services, expected=["converger", "signer"], outbox=FRESH_OUTBOX))
    json.dumps(out)  # every value is JSON
    assert out["services"]["converger"]["endpoints"]["spec"] == {
        "subject": "bcd.node-1.converger.spec",
        "num_requests": 2,
        "num_errors": 0,
        "processing_time": 10_000_000,
        "average_processing_time": 5_000_000,
        "last_error": "",
    }
    assert out["missing"] == ["signer"]
    assert out["outbox"]["messages"] == 2 and out["outbox"]["oldest_age_s"] == 30.0
    assert out["kv"] == {
        "bcd_node_node-1_inventory": {"keys": 1, "revision": 4, "last_update": "2026-11-30T08:59:50+00:00", "messages": 1, "bytes": 15088, "consumer_count": 2}
    }
    mon = out["monitor"]
    assert mon["version"] == "2.15.1" and mon["subscriptions"] == 173
    assert mon["users"]["NODE_converger"]["converger"] == {"connections": 1, "subscriptions": 10, "in_msgs": 1, "out_msgs": 2, "pending_bytes": 0, "names": ["bcd-converger"]}
    assert mon["jetstream"]["api_errors"] == 2
    assert [s["stream"] for s in mon["streams"]] == ["BCD_OUTBOX_node-1", "KV_bcd_node_node-1_inventory", "BCD_EVENTS"]
    assert mon["streams"][2]["consumers"][0]["name"] == "controlplane"
    assert out["problems"] == ["service signer does not answer $SRV.STATS"]
    assert bus_json(report(monitor=None))["monitor"] is None
    assert bus_json(report(monitor=parse_monitor("u", VARZ, None, SUBSZ, None)))["monitor"]["users"] is None


def test_service_stats_type_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ServiceStats("x").name = "y"  # type: ignore[misc]
