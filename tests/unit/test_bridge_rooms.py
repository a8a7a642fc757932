"""Issue 32: the bridge's upstream room (services/gateway_bridge/upstream.py) built alone: what
`bcd status` reads of the upstream (its PING metadata) and the log, each reason said once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Gauge

from services.gateway_bridge.upstream import Upstream
from shared.tlsconfig import upstream_tls


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def warning(self, msg: str, **kw: object) -> None:
        self.lines.append(("warning", msg, kw))

    def info(self, msg: str, **kw: object) -> None:
        self.lines.append(("info", msg, kw))

    def error(self, msg: str, **kw: object) -> None:
        self.lines.append(("error", msg, kw))


def make(url: str = "nats://cp.example:4222") -> tuple[Upstream, dict[str, str], Log]:
    metadata: dict[str, str] = {}
    log = Log()
    gauge = Gauge("bcd_upstream_connected_test", "test", registry=CollectorRegistry())
    up = Upstream(SimpleNamespace(node_id="n1", upstream_url=url), upstream_tls(url), metadata, log, asyncio.Event(), gauge, lambda: None)
    return up, metadata, log


def test_a_failure_is_in_the_metadata_each_time_and_in_the_log_once_per_reason() -> None:
    up, md, log = make()
    assert (md["upstream_state"], md["upstream_error"], md["upstream_tls"]) == ("connecting", "", "off")
    for _ in range(3):
        up.failed("connection refused")
    assert (md["upstream_state"], md["upstream_error"]) == ("connecting", "connection refused")
    assert [line[1] for line in log.lines] == ["upstream refused or unreachable; retrying (holds and outbox kept)"]
    up.failed("certificate expired")
    assert md["upstream_error"] == "certificate expired" and len(log.lines) == 2
    up.ok()
    assert (md["upstream_state"], md["upstream_error"]) == ("connected", "")
    up.failed("connection refused")  # after a success the same reason is news again
    assert len(log.lines) == 3


def test_a_missing_bucket_is_said_once_and_its_arrival_once() -> None:
    up, _, log = make()
    up.waiting_for("bucket bcd_nodespecs")
    up.waiting_for("bucket bcd_nodespecs")
    up.found("bucket bcd_nodespecs")
    up.found("bucket bcd_nodespecs")
    assert [line[1] for line in log.lines] == [
        "waiting for upstream bucket bcd_nodespecs (the control plane creates it)",
        "upstream bucket bcd_nodespecs is there",
    ]


def test_tls_is_described_where_status_reads_it() -> None:
    _, md, _ = make("tls://cp.example:4222")
    assert md["upstream_tls"].startswith("on (CA: system trust store")
