"""`bcd bus`: the node bus as an operator sees it.

`gather_bus` asks, as the `cli` user: every micro service for `$SRV.STATS`
(per endpoint: requests, errors, processing time), JetStream for the outbox
stream and the inventory KV bucket, and the node bus's nats-server monitoring
endpoint on loopback (`varz` for the version, `connz?auth=true` for who is
connected as which user, `subsz` for the subscription count, `jsz` for
JetStream totals, every stream and its consumers). Everything else here is a
pure function of that report (`merge_stats`, `parse_stream`,
`parse_monitor`, `bus_problems`, `render_bus`, `bus_json`), unit-tested as
tables.

Times keep `$SRV.STATS`' unit: `processing_time` and
`average_processing_time` are nanoseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import nats.errors

from shared.schemas.codec import bounded_json_loads
from shared.subjects import NODE_BUS_USERS, NODE_STORE_ACCOUNT, NodeSubjects, node_account

from .client import NodeInfo, NodeUnreachable, connect
from .status import OUTBOX_STALE_S

#: the node bus's JetStream account (the outbox, the inventory's bucket)
NODE_ACCOUNT = NODE_STORE_ACCOUNT
MONITOR_PATHS: dict[str, str] = {
    "varz": "varz",
    "connz": "connz?auth=true&limit=4096",
    "subsz": "subsz",
    "jsz": "jsz?accounts=true&streams=true&consumers=true",
}


# ------------------------------------------------------------------------ the report


@dataclass(frozen=True)
class EndpointStats:
    name: str
    subject: str
    num_requests: int = 0
    num_errors: int = 0
    #: nanoseconds, summed over every request (and every instance).
    processing_time: int = 0
    average_processing_time: int = 0
    last_error: str = ""


@dataclass(frozen=True)
class ServiceStats:
    name: str
    #: micro instance ids that answered (more than one while a restarted process overlaps its successor).
    ids: tuple[str, ...] = ()
    version: str = ""
    started: str = ""
    endpoints: tuple[EndpointStats, ...] = ()

    def endpoint(self, name: str) -> EndpointStats | None:
        return next((e for e in self.endpoints if e.name == name), None)


@dataclass(frozen=True)
class ConsumerStats:
    name: str
    num_pending: int = 0
    num_ack_pending: int = 0
    num_redelivered: int = 0
    num_waiting: int = 0
    delivered_stream_seq: int = 0
    ack_floor_stream_seq: int = 0
    last_active: datetime | None = None


@dataclass(frozen=True)
class StreamStats:
    name: str
    account: str = ""
    messages: int = 0
    bytes: int = 0
    first_seq: int = 0
    last_seq: int = 0
    #: when the oldest message still stored was written (None when empty).
    first_ts: datetime | None = None
    last_ts: datetime | None = None
    num_subjects: int = 0
    consumer_count: int = 0
    consumers: tuple[ConsumerStats, ...] = ()

    @property
    def is_kv(self) -> bool:
        return self.name.startswith("KV_")

    @property
    def bucket(self) -> str:
        return self.name[3:] if self.is_kv else ""


@dataclass(frozen=True)
class UserConnections:
    """Every connection of one NATS user (connz?auth=true), summed."""

    account: str
    user: str
    connections: int = 0
    subscriptions: int = 0
    in_msgs: int = 0
    out_msgs: int = 0
    pending_bytes: int = 0
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class JetStreamTotals:
    streams: int = 0
    consumers: int = 0
    messages: int = 0
    bytes: int = 0
    memory: int = 0
    storage: int = 0
    api_total: int = 0
    api_errors: int = 0


@dataclass(frozen=True)
class MonitorStats:
    url: str
    error: str = ""
    server_name: str = ""
    version: str = ""
    uptime: str = ""
    connections: int = 0
    subscriptions: int | None = None
    #: per (account, user); None when connz could not be read.
    users: tuple[UserConnections, ...] | None = None
    jetstream: JetStreamTotals | None = None
    streams: tuple[StreamStats, ...] = ()

    def user(self, user: str, account: str | None = None) -> UserConnections | None:
        """One user's connections; a node-bus identity is looked for in its own account."""
        if account is None:
            account = node_account(user) if user in NODE_BUS_USERS else NODE_ACCOUNT
        return next((u for u in self.users or () if u.user == user and u.account == account), None)

    def stream(self, name: str, account: str = NODE_ACCOUNT) -> StreamStats | None:
        return next((s for s in self.streams if s.name == name and s.account == account), None)


@dataclass
class BusReport:
    node_id: str
    nats_url: str = ""
    reachable: bool = False
    error: str = ""
    #: services that should be running (node.json).
    expected: list[str] = field(default_factory=list)
    services: dict[str, ServiceStats] = field(default_factory=dict)
    outbox: StreamStats | None = None
    #: the node bus's KV buckets (the inventory's), from STREAM.INFO over the bus.
    buckets: list[StreamStats] = field(default_factory=list)
    #: None when the node runs without a monitoring endpoint.
    monitor: MonitorStats | None = None
    now: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


# ------------------------------------------------------------------------ parsing (pure)


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def parse_ts(value: Any) -> datetime | None:
    """nats-server's RFC 3339 time (nanoseconds, `Z`); its zero time is None."""
    if not isinstance(value, str) or not value or value.startswith("0001-"):
        return None
    ts = value.replace("Z", "+00:00")
    head, dot, tail = ts.partition(".")
    if dot:
        digits = len(tail) - len(tail.lstrip("0123456789"))
        frac, zone = tail[:digits], tail[digits:]
        ts = f"{head}.{frac[:6].ljust(6, '0')}{zone}"
    try:
        parsed = datetime.fromisoformat(ts)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def merge_stats(replies: Iterable[Mapping[str, Any]]) -> dict[str, ServiceStats]:
    """`$SRV.STATS` replies by service name; several instances of one service are summed
    (the average is then the total time over the total requests)."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for r in replies:
        name = r.get("name")
        if isinstance(name, str) and name:
            grouped.setdefault(name, []).append(r)
    out: dict[str, ServiceStats] = {}
    for name, instances in sorted(grouped.items()):
        order: list[str] = []
        acc: dict[str, dict[str, Any]] = {}
        for inst in instances:
            for ep in inst.get("endpoints") or []:
                ename = str(ep.get("name", ""))
                if ename not in acc:
                    order.append(ename)
                    acc[ename] = {"subject": str(ep.get("subject", "")), "num_requests": 0, "num_errors": 0, "processing_time": 0, "last_error": ""}
                a = acc[ename]
                a["num_requests"] += _int(ep.get("num_requests"))
                a["num_errors"] += _int(ep.get("num_errors"))
                a["processing_time"] += _int(ep.get("processing_time"))
                a["last_error"] = a["last_error"] or str(ep.get("last_error") or "")
        endpoints = tuple(
            EndpointStats(
                name=e,
                subject=acc[e]["subject"],
                num_requests=acc[e]["num_requests"],
                num_errors=acc[e]["num_errors"],
                processing_time=acc[e]["processing_time"],
                average_processing_time=acc[e]["processing_time"] // acc[e]["num_requests"] if acc[e]["num_requests"] else 0,
                last_error=acc[e]["last_error"],
            )
            for e in order
        )
        out[name] = ServiceStats(
            name=name,
            ids=tuple(str(i.get("id", "")) for i in instances),
            version=", ".join(sorted({str(i.get("version", "")) for i in instances})),
            started=max(str(i.get("started", "")) for i in instances),
            endpoints=endpoints,
        )
    return out


def parse_consumer(d: Mapping[str, Any]) -> ConsumerStats:
    delivered, ack = d.get("delivered") or {}, d.get("ack_floor") or {}
    return ConsumerStats(
        name=str(d.get("name", "")),
        num_pending=_int(d.get("num_pending")),
        num_ack_pending=_int(d.get("num_ack_pending")),
        num_redelivered=_int(d.get("num_redelivered")),
        num_waiting=_int(d.get("num_waiting")),
        delivered_stream_seq=_int(delivered.get("stream_seq")),
        ack_floor_stream_seq=_int(ack.get("stream_seq")),
        last_active=parse_ts(delivered.get("last_active")),
    )


def parse_stream(d: Mapping[str, Any], account: str = "") -> StreamStats:
    """A `$JS.API.STREAM.INFO` reply or one `stream_detail` of jsz (same `state`)."""
    state = d.get("state") or {}
    name = d.get("name") or (d.get("config") or {}).get("name") or ""
    return StreamStats(
        name=str(name),
        account=account,
        messages=_int(state.get("messages")),
        bytes=_int(state.get("bytes")),
        first_seq=_int(state.get("first_seq")),
        last_seq=_int(state.get("last_seq")),
        first_ts=parse_ts(state.get("first_ts")) if _int(state.get("messages")) else None,
        last_ts=parse_ts(state.get("last_ts")),
        num_subjects=_int(state.get("num_subjects")),
        consumer_count=_int(state.get("consumer_count")),
        consumers=tuple(parse_consumer(c) for c in d.get("consumer_detail") or []),
    )


def parse_monitor(
    url: str,
    varz: Mapping[str, Any] | None,
    connz: Mapping[str, Any] | None,
    subsz: Mapping[str, Any] | None,
    jsz: Mapping[str, Any] | None,
    error: str = "",
) -> MonitorStats:
    """One view of the monitoring endpoint; a part that could not be read is None."""
    users: dict[tuple[str, str], dict[str, Any]] = {}
    for c in (connz or {}).get("connections") or []:
        key = (str(c.get("account", "")), str(c.get("authorized_user", "")))
        u = users.setdefault(key, {"connections": 0, "subscriptions": 0, "in_msgs": 0, "out_msgs": 0, "pending_bytes": 0, "names": []})
        u["connections"] += 1
        for k in ("subscriptions", "in_msgs", "out_msgs", "pending_bytes"):
            u[k] += _int(c.get(k))
        if c.get("name"):
            u["names"].append(str(c["name"]))
    js = None
    streams: list[StreamStats] = []
    if jsz is not None:
        api = jsz.get("api") or {}
        js = JetStreamTotals(
            streams=_int(jsz.get("streams")),
            consumers=_int(jsz.get("consumers")),
            messages=_int(jsz.get("messages")),
            bytes=_int(jsz.get("bytes")),
            memory=_int(jsz.get("memory")),
            storage=_int(jsz.get("storage")),
            api_total=_int(api.get("total")),
            api_errors=_int(api.get("errors")),
        )
        for acct in jsz.get("account_details") or []:
            streams.extend(parse_stream(s, str(acct.get("name", ""))) for s in acct.get("stream_detail") or [])
    v = varz or {}
    return MonitorStats(
        url=url,
        error=error,
        server_name=str(v.get("server_name", "")),
        version=str(v.get("version", "")),
        uptime=str(v.get("uptime", "")),
        connections=_int(v.get("connections")) if varz is not None else len((connz or {}).get("connections") or []),
        subscriptions=_int(subsz.get("num_subscriptions")) if subsz is not None else None,
        users=None
        if connz is None
        else tuple(UserConnections(account=a, user=u, names=tuple(sorted(set(d.pop("names")))), **d) for (a, u), d in sorted(users.items())),
        jetstream=js,
        streams=tuple(sorted(streams, key=lambda s: (s.account != NODE_ACCOUNT, s.account, s.name))),
    )


def with_consumers(stream: StreamStats | None, monitor: MonitorStats | None) -> StreamStats | None:
    """STREAM.INFO counts consumers; jsz describes them: take the description when there is one."""
    if stream is None or monitor is None:
        return stream
    detail = monitor.stream(stream.name, NODE_ACCOUNT)
    if detail is None or not detail.consumers:
        return stream
    return dataclasses.replace(stream, consumers=detail.consumers)


# ------------------------------------------------------------------------ verdicts and rendering (pure)


def _age_s(ts: datetime | None, now: datetime) -> float | None:
    return None if ts is None else max(0.0, (now - ts).total_seconds())


def bus_problems(report: BusReport) -> list[str]:
    """What an operator must look at (empty: the bus looks healthy)."""
    out: list[str] = []
    if not report.reachable:
        out.append(report.error or "node bus unreachable")
    else:
        out.extend(f"service {n} does not answer $SRV.STATS" for n in report.expected if n not in report.services)
    mon = report.monitor
    if mon is not None:
        if mon.error:
            out.append(f"monitoring endpoint {mon.url}: {mon.error}")
        if mon.users is not None:
            out.extend(f"no connection of user {n} on the node bus (connz)" for n in report.expected if mon.user(n) is None)
    age = _age_s(report.outbox.first_ts, report.now) if report.outbox else None
    if age is not None and age > OUTBOX_STALE_S:
        out.append(f"outbox not draining: {report.outbox.messages if report.outbox else 0} events, oldest {age:.0f} s")
    return out


def fmt_ns(ns: int) -> str:
    if ns <= 0:
        return "-"
    if ns < 1_000:
        return f"{ns}ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.0f}µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f}ms"
    return f"{ns / 1e9:.2f}s"


def fmt_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_age(ts: datetime | None, now: datetime) -> str:
    age = _age_s(ts, now)
    if age is None:
        return "-"
    if age < 120:
        return f"{age:.0f} s ago"
    if age < 7200:
        return f"{age / 60:.0f} min ago"
    return f"{age / 3600:.1f} h ago"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _consumer_lines(stream: StreamStats, indent: str = "  ") -> list[str]:
    return [
        f"{indent}consumer {c.name}: pending {c.num_pending}, ack pending {c.num_ack_pending}, "
        f"redelivered {c.num_redelivered}, waiting {c.num_waiting}, delivered seq {c.delivered_stream_seq}, ack floor {c.ack_floor_stream_seq}"
        for c in stream.consumers
    ]


def render_bus(report: BusReport) -> str:
    lines: list[str] = []
    mon = report.monitor
    head = f"node {report.node_id}  bus {report.nats_url or '?'}"
    if mon is not None and mon.version:
        head += f"  nats-server {mon.version} ({mon.server_name}) up {mon.uptime}"
    head += f"  monitoring {mon.url}" if mon is not None else "  monitoring off"
    lines.append(head)
    if not report.reachable:
        lines.append(f"node bus: {report.error or 'unreachable'}")
    else:
        lines.append(f"{'SERVICE':<15} {'ENDPOINT':<15} {'SUBJECT':<40} {'REQUESTS':>9} {'ERRORS':>7} {'AVG TIME':>9}  LAST ERROR")
        for name in sorted({*report.expected, *report.services}):
            svc = report.services.get(name)
            if svc is None:
                lines.append(f"{name:<15} DOWN: no $SRV.STATS reply")
                continue
            if not svc.endpoints:
                lines.append(f"{name:<15} {'-':<15} (no endpoints)")
            for i, e in enumerate(svc.endpoints):
                lines.append(
                    f"{name if i == 0 else '':<15} {e.name:<15} {e.subject:<40} {e.num_requests:>9} {e.num_errors:>7} "
                    f"{fmt_ns(e.average_processing_time):>9}  {e.last_error}".rstrip()
                )
    lines.append("")
    ob = report.outbox
    if ob is not None:
        oldest = f"oldest {fmt_age(ob.first_ts, report.now)}" if ob.messages else "empty"
        consumers = f"{_plural(ob.consumer_count, 'consumer')}" if ob.consumer_count else "no consumers (the bridge reads by sequence)"
        lines.append(f"outbox {ob.name}: {_plural(ob.messages, 'message')} ({fmt_bytes(ob.bytes)}), {oldest}, last seq {ob.last_seq}, {consumers}")
        lines.extend(_consumer_lines(ob))
    elif report.reachable:
        lines.append("outbox: not created yet")
    for b in report.buckets:
        lines.append(
            f"kv {b.bucket}: {_plural(b.num_subjects, 'key')}, revision {b.last_seq}, "
            f"last update {b.last_ts.isoformat(timespec='seconds') if b.last_ts else '-'} ({fmt_age(b.last_ts, report.now)}), {fmt_bytes(b.bytes)}"
        )
    if mon is not None:
        lines.append("")
        if mon.error:
            lines.append(f"monitoring: {mon.error}")
        lines.append(f"CONNECTIONS {mon.connections} (connz)  SUBSCRIPTIONS {mon.subscriptions if mon.subscriptions is not None else '?'} (subsz)")
        lines.append(f"{'ACCOUNT':<20} {'USER':<16} {'CONNS':>5} {'SUBS':>5} {'MSGS IN':>9} {'MSGS OUT':>9} {'PENDING':>9}  NAME")
        for u in mon.users or ():
            lines.append(
                f"{u.account:<20} {u.user or '(none)':<16} {u.connections:>5} {u.subscriptions:>5} {u.in_msgs:>9} {u.out_msgs:>9} "
                f"{fmt_bytes(u.pending_bytes):>9}  {', '.join(u.names)}".rstrip()
            )
        js = mon.jetstream
        if js is not None:
            lines.append("")
            lines.append(
                f"JETSTREAM {_plural(js.streams, 'stream')}, {_plural(js.consumers, 'consumer')}, {_plural(js.messages, 'message')}, "
                f"{fmt_bytes(js.bytes)} (file {fmt_bytes(js.storage)}, memory {fmt_bytes(js.memory)}); API {js.api_total} requests, {js.api_errors} errors (jsz)"
            )
            lines.append(f"{'ACCOUNT':<9} {'STREAM':<32} {'MESSAGES':>9} {'BYTES':>10} {'LAST SEQ':>9} {'CONSUMERS':>9}  LAST WRITE")
            for s in mon.streams:
                lines.append(
                    f"{s.account:<9} {s.name:<32} {s.messages:>9} {fmt_bytes(s.bytes):>10} {s.last_seq:>9} {s.consumer_count:>9}  {fmt_age(s.last_ts, report.now)}"
                )
                lines.extend(_consumer_lines(s, "    "))
    bad = bus_problems(report)
    lines.append("")
    lines.append("health: " + ("ok" if not bad else "UNHEALTHY: " + "; ".join(bad)))
    return "\n".join(lines)


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts else None


def _stream_json(s: StreamStats, now: datetime) -> dict[str, Any]:
    return {
        "stream": s.name,
        "account": s.account,
        "messages": s.messages,
        "bytes": s.bytes,
        "first_seq": s.first_seq,
        "last_seq": s.last_seq,
        "oldest": _iso(s.first_ts),
        "oldest_age_s": _age_s(s.first_ts, now),
        "last_write": _iso(s.last_ts),
        "subjects": s.num_subjects,
        "consumer_count": s.consumer_count,
        "consumers": [{**c.__dict__, "last_active": _iso(c.last_active)} for c in s.consumers],
    }


def bus_json(report: BusReport) -> dict[str, Any]:
    mon = report.monitor
    users: dict[str, dict[str, Any]] = {}
    for u in (mon.users or ()) if mon else ():
        users.setdefault(u.account, {})[u.user] = {k: v for k, v in u.__dict__.items() if k not in ("account", "user")} | {"names": list(u.names)}
    return {
        "node_id": report.node_id,
        "nats_url": report.nats_url,
        "reachable": report.reachable,
        "error": report.error,
        "now": report.now.isoformat(),
        "services": {
            name: {
                "ids": list(svc.ids),
                "version": svc.version,
                "started": svc.started,
                "endpoints": {e.name: {k: v for k, v in e.__dict__.items() if k != "name"} for e in svc.endpoints},
            }
            for name, svc in sorted(report.services.items())
        },
        "missing": [n for n in report.expected if n not in report.services] if report.reachable else list(report.expected),
        "outbox": _stream_json(report.outbox, report.now) if report.outbox else None,
        "kv": {
            b.bucket: {
                "keys": b.num_subjects,
                "revision": b.last_seq,
                "last_update": _iso(b.last_ts),
                "messages": b.messages,
                "bytes": b.bytes,
                "consumer_count": b.consumer_count,
            }
            for b in report.buckets
        },
        "monitor": None
        if mon is None
        else {
            "url": mon.url,
            "error": mon.error,
            "server_name": mon.server_name,
            "version": mon.version,
            "uptime": mon.uptime,
            "connections": mon.connections,
            "subscriptions": mon.subscriptions,
            "users": users if mon.users is not None else None,
            "jetstream": mon.jetstream.__dict__ if mon.jetstream else None,
            "streams": [_stream_json(s, report.now) for s in mon.streams],
        },
        "problems": bus_problems(report),
    }


# ------------------------------------------------------------------------ gathering


async def service_stats(nc: Any, expected: Iterable[str] = (), wait: float = 1.0) -> list[dict[str, Any]]:
    """Every `$SRV.STATS` reply within `wait` s (sooner once every expected service answered)."""
    want = set(expected)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    replies: list[dict[str, Any]] = []
    try:
        await nc.publish("$SRV.STATS", b"", reply=inbox)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (left := deadline - loop.time()) > 0:
            if want and want <= {r.get("name") for r in replies}:
                break
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            if not msg.data:  # a status message (no responders), not a reply
                continue
            with contextlib.suppress(ValueError):
                reply = bounded_json_loads(msg.data, 1024 * 1024, "ping reply")
                if isinstance(reply, dict):
                    replies.append(reply)
    finally:
        await sub.unsubscribe()
    return replies


async def _stream_info(nc: Any, stream: str) -> StreamStats | None:
    with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError, ValueError):
        msg = await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=3)
        info = bounded_json_loads(msg.data, 4 * 1024 * 1024, "stream info")
        if isinstance(info, dict) and "error" not in info:
            return parse_stream(info, NODE_ACCOUNT)
    return None


def fetch_monitor(url: str, timeout: float = 3.0) -> MonitorStats:
    """Read varz, connz, subsz and jsz; what fails is named in `error`, the rest still shows."""
    parts: dict[str, Any] = {}
    errors: list[str] = []
    for key, path in MONITOR_PATHS.items():
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/{path}", timeout=timeout) as resp:  # noqa: S310 - node.json's loopback URL
                parts[key] = bounded_json_loads(resp.read(64 * 1024 * 1024 + 1), 64 * 1024 * 1024, f"monitor {key}")
        except (OSError, ValueError, urllib.error.URLError) as exc:
            errors.append(f"{key}: {getattr(exc, 'reason', None) or exc}")
    return parse_monitor(url, parts.get("varz"), parts.get("connz"), parts.get("subsz"), parts.get("jsz"), "; ".join(errors))


async def gather_bus(info: NodeInfo, wait: float = 1.0) -> BusReport:
    report = BusReport(node_id=info.node_id, nats_url=info.nats_url, expected=list(info.services))
    try:
        nc = await connect(info)
    except NodeUnreachable as exc:
        report.error = str(exc)
    else:
        report.reachable = True
        subjects = NodeSubjects(info.node_id)
        try:
            report.services = merge_stats(await service_stats(nc, info.services, wait))
            report.outbox = await _stream_info(nc, subjects.outbox_stream)
            bucket = await _stream_info(nc, f"KV_{subjects.inventory_bucket}")
            report.buckets = [bucket] if bucket is not None else []
        finally:
            await nc.close()
    if info.monitor_url:
        report.monitor = await asyncio.to_thread(fetch_monitor, info.monitor_url)
        report.outbox = with_consumers(report.outbox, report.monitor)
    report.now = datetime.now(timezone.utc)
    return report


__all__ = [
    "EndpointStats",
    "ServiceStats",
    "ConsumerStats",
    "StreamStats",
    "UserConnections",
    "JetStreamTotals",
    "MonitorStats",
    "BusReport",
    "parse_ts",
    "merge_stats",
    "parse_consumer",
    "parse_stream",
    "parse_monitor",
    "with_consumers",
    "bus_problems",
    "fmt_ns",
    "fmt_bytes",
    "fmt_age",
    "render_bus",
    "bus_json",
    "service_stats",
    "fetch_monitor",
    "gather_bus",
    "MONITOR_PATHS",
]
