"""bcd/ports.py: which fixed ports `bcd up` checks and the lines it prints when one is taken."""

from __future__ import annotations

import socket

from bcd.ports import fallback_line, fixed_ports, in_use, refusal, taken


def test_the_fixed_ports_are_the_bus_its_monitoring_and_each_services_metrics() -> None:
    ports = fixed_ports(4222, 8222, ["signer", "converger"])
    assert [(p.port, p.what, p.flag) for p in ports] == [
        (4222, "node bus", "--port"),
        (8222, "node-bus monitoring", "--http-port"),
        (9462, "signer metrics", "--any-ports"),
        (9463, "converger metrics", "--any-ports"),
    ]
    assert fixed_ports(-1, 0, []) == []


def test_a_listening_socket_is_seen_and_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert in_use(port)
        busy = taken(fixed_ports(port, 0, []))
        assert [p.port for p in busy] == [port]
        assert refusal(busy).startswith(f"bcd up: port {port} (node bus) is in use on 127.0.0.1: ")
        assert "--port" in refusal(busy) and "make run ARGS=--any-ports" in refusal(busy)
        assert fallback_line(busy) == f"bcd up: port {port} (node bus) is in use on 127.0.0.1; picking free ports instead (--any-ports-if-taken)"
    assert not in_use(port)


def test_a_taken_metrics_port_suggests_only_any_ports() -> None:
    busy = [p for p in fixed_ports(4222, 8222, ["converger"]) if p.what == "converger metrics"]
    line = refusal(busy)
    assert "9463 (converger metrics)" in line and "move it with" not in line and "--any-ports" in line
