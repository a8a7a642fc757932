"""`bcd bus` against a running node (`bcd up` on a copy of the 8 x H200 fake host).

After a spec went through (so the converger's `spec` endpoint served a
request) and one malformed request (so an endpoint counted an error),
`bcd bus --json` must show the endpoints' `$SRV.STATS`, the drained outbox,
the inventory KV bucket, and the monitoring endpoint's view: every service's
NATS user connected (connz), the bridge's upstream user in the UPSTREAM
account, subscriptions, JetStream. The monitoring port (and the client port)
listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from pathlib import Path
from urllib.parse import urlparse

import pytest

from bcd.client import connect, node_info
from shared.subjects import CONTROLPLANE_USER, SERVICE_ERROR_CODE_HEADER, NodeSubjects, node_account, upstream_node_account, upstream_node_user

from .wholenode import GPU, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NODE = "node-1"


def listening_addresses(port: int) -> list[str]:
    """Local addresses of every TCP socket listening on `port` (from /proc/net/tcp and tcp6)."""
    out: list[str] = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr_hex)
            # the kernel prints each 32-bit word in host (little-endian) order
            fixed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            out.append(str(ipaddress.IPv6Address(fixed) if v6 else ipaddress.IPv4Address(fixed)))
    return out


async def malformed_holder_query(state: Path) -> str:
    nc = await connect(node_info(state))
    try:
        msg = await nc.request(NodeSubjects(NODE).converger_holder, b"{not json", timeout=5)
        return (msg.headers or {}).get(SERVICE_ERROR_CODE_HEADER, "")
    finally:
        await nc.close()


def test_bcd_bus_shows_the_endpoints_the_outbox_kv_and_the_monitoring_view(node) -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("/proc/net/tcp missing: cannot see which addresses the node bus listens on")
    info = json.loads((node.state / "node.json").read_text())
    wait_for(lambda: set(info["services"]) <= set(node.ping()), 60, "every service to answer $SRV.PING")
    gen = node.apply({"node_id": NODE, "devices": [assignment("bus-a", GPU[0])]})
    node.wait_generation(gen)
    assert asyncio.run(malformed_holder_query(node.state)) == "400"

    out = bcd("bus", "--state-dir", str(node.state), "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    bus = json.loads(out.stdout)
    assert bus["reachable"] and bus["missing"] == [] and bus["problems"] == []

    # $SRV.STATS per service and endpoint
    s = NodeSubjects(NODE)
    spec = bus["services"]["converger"]["endpoints"]["spec"]
    assert spec["subject"] == s.converger_spec
    assert spec["num_requests"] >= 1 and spec["average_processing_time"] > 0 and spec["num_errors"] == 0
    holder = bus["services"]["converger"]["endpoints"]["holder"]
    assert holder["subject"] == s.converger_holder and holder["num_errors"] >= 1 and holder["last_error"]
    assert bus["services"]["signer"]["endpoints"]["sign_batch"]["num_requests"] >= 1  # the Bound was signed (with the pass's other reports)
    assert set(info["services"]) <= set(bus["services"])

    # the outbox drained; the inventory bucket holds the inventory
    assert bus["outbox"]["stream"] == s.outbox_stream and bus["outbox"]["messages"] == 0 and bus["outbox"]["last_seq"] >= 1
    kv = bus["kv"][s.inventory_bucket]
    assert kv["keys"] >= 1 and kv["revision"] >= 1 and kv["last_update"]

    # the monitoring endpoint: version, every service's user connected in its own account, JetStream
    mon = bus["monitor"]
    assert mon["url"] == info["monitor_url"] and not mon["error"]
    assert mon["version"] and mon["subscriptions"] > 0
    for name in info["services"]:
        assert set(mon["users"][node_account(name)]) == {name}, name
        assert mon["users"][node_account(name)][name]["connections"] >= 1, name
        assert f"bcd-{name}" in mon["users"][node_account(name)][name]["names"]
    assert set(mon["users"]["UPSTREAM"]) == {CONTROLPLANE_USER}
    assert set(mon["users"][upstream_node_account(NODE)]) == {upstream_node_user(NODE)}
    assert mon["users"][upstream_node_account(NODE)][upstream_node_user(NODE)]["names"] == [f"bcd-bridge-{NODE}"]
    assert mon["jetstream"]["streams"] >= 2
    streams = {(x["account"], x["stream"]) for x in mon["streams"]}
    assert {("NODE", s.outbox_stream), ("NODE", f"KV_{s.inventory_bucket}"), ("UPSTREAM", "BCD_EVENTS")} <= streams

    # the monitoring port and the client port listen on loopback only
    monitor_port = urlparse(info["monitor_url"]).port
    client_port = urlparse(info["nats_url"]).port
    assert monitor_port and client_port
    assert listening_addresses(monitor_port) == ["127.0.0.1"]
    assert listening_addresses(client_port) == ["127.0.0.1"]

    # and the table an operator reads
    text = bcd("bus", "--state-dir", str(node.state))
    assert text.returncode == 0, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith(f"node {NODE}  bus {info['nats_url']}  nats-server ")
    row = next(line.split() for line in lines if line.split()[:2] == ["converger", "spec"])
    assert row[2] == s.converger_spec and int(row[3]) >= 1
    assert any(line.split()[:2] == ["NODE_gateway_bridge", "gateway_bridge"] for line in lines)
    assert lines[-1] == "health: ok"
