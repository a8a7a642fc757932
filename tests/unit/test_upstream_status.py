"""What `bcd status` and `bcd doctor` say of the upstream connection, from the bridge's PING metadata
(issue 31): connected or not, over TLS or plain text, and a refusal's one line."""

from __future__ import annotations

import pytest

from bcd.status import NodeReport, doctor_checks, render_status, upstream_checks, upstream_line

TLS_ON = "on (CA /etc/bcd/upstream/ca.crt, client certificate /etc/bcd/upstream/node.crt)"
REFUSED = "upstream 10.0.0.5:4222's certificate has expired: renew it"


def md(**kw: str) -> dict[str, str]:
    return {"node_id": "node-1", "cp_keys": "1", **kw}


@pytest.mark.parametrize(
    "name, metadata, rows",
    [
        ("a bridge older than these facts: nothing to say", md(upstream="tls://cp:4222"), []),
        (
            "connected over TLS",
            md(upstream="tls://cp:4222", upstream_state="connected", upstream_error="", upstream_tls=TLS_ON),
            [("ok", "upstream", f"connected to tls://cp:4222 (TLS {TLS_ON})")],
        ),
        (
            "a refusal fails, with its line",
            md(upstream="tls://10.0.0.5:4222", upstream_state="connecting", upstream_error=REFUSED, upstream_tls=TLS_ON),
            [("fail", "upstream", f"connecting to tls://10.0.0.5:4222: {REFUSED}; holds and the outbox are kept meanwhile")],
        ),
        (
            "a first connection still under way only warns",
            md(upstream="tls://cp:4222", upstream_state="connecting", upstream_error="", upstream_tls=TLS_ON),
            [("warn", "upstream", "connecting to tls://cp:4222: no answer yet; holds and the outbox are kept meanwhile")],
        ),
        (
            "connected, but a renewal that does not load",
            md(upstream="tls://cp:4222", upstream_state="connected", upstream_error="renewed TLS files not used: x", upstream_tls=TLS_ON),
            [("warn", "upstream", "connected to tls://cp:4222, but renewed TLS files not used: x")],
        ),
        (
            "plain text to another host warns",
            md(upstream="nats://cp.example.net:4222", upstream_state="connected", upstream_error="", upstream_tls="off"),
            [
                ("ok", "upstream", "connected to nats://cp.example.net:4222 (TLS off)"),
                ("warn", "upstream-tls", "nats://cp.example.net:4222 is dialled in plain text: specs, events and credentials cross the network in clear (--upstream-ca)"),
            ],
        ),
        (
            "plain text on loopback (the embedded control plane) is fine",
            md(upstream="nats://127.0.0.1:4222,nats://localhost:4223", upstream_state="connected", upstream_error="", upstream_tls="off"),
            [("ok", "upstream", "connected to nats://127.0.0.1:4222,nats://localhost:4223 (TLS off)")],
        ),
    ],
)
def test_upstream_checks(name, metadata, rows):
    assert upstream_checks(metadata) == rows, name


def report_with(metadata: dict[str, str]) -> NodeReport:
    return NodeReport(node_id="node-1", reachable=True, expected=["gateway_bridge"], services={"gateway_bridge": {"metadata": metadata}})


def test_status_has_one_upstream_line_with_the_reason():
    r = report_with(md(upstream="tls://10.0.0.5:4222", upstream_state="connecting", upstream_error=REFUSED, upstream_tls=TLS_ON))
    assert upstream_line(r) == f"upstream tls://10.0.0.5:4222 (TLS): connecting: {REFUSED}"
    text = render_status(r)
    assert text.splitlines()[1] == upstream_line(r)
    assert [c for c in doctor_checks(r) if c[1] == "upstream"] == [
        ("fail", "upstream", f"connecting to tls://10.0.0.5:4222: {REFUSED}; holds and the outbox are kept meanwhile")
    ]


def test_no_upstream_line_without_a_bridge():
    assert upstream_line(NodeReport(node_id="node-1", reachable=True)) == ""
