"""The fixed loopback ports `bcd up` uses, and what it does when one is taken.

Without `--any-ports`, `bcd up` listens on 127.0.0.1 at the node bus's client
port (`--port`, 4222), its monitoring port (`--http-port`, 8222) and each
service's metrics port (9461-9467). Before anything starts, each is tried:

* all free: the fixed ports are used;
* one is taken and `--any-ports-if-taken` is given (what `make run` passes):
  one line says which, and every port is picked free, as `--any-ports` does
  (the banner and `<state>/node.json` say where everything went);
* one is taken otherwise: `bcd up` stops with one line naming the port, what
  it is for and the flags that avoid it, before starting anything.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from shared.runtime import METRICS_PORTS

HOST = "127.0.0.1"


@dataclass(frozen=True)
class FixedPort:
    port: int
    what: str
    #: the flag that moves it
    flag: str


def fixed_ports(port: int, http_port: int, services: Iterable[str]) -> list[FixedPort]:
    """The fixed ports a `bcd up` without --any-ports would listen on (0 or -1: none)."""
    found = []
    if port > 0:
        found.append(FixedPort(port, "node bus", "--port"))
    if http_port > 0:
        found.append(FixedPort(http_port, "node-bus monitoring", "--http-port"))
    for name in services:
        if METRICS_PORTS.get(name):
            found.append(FixedPort(METRICS_PORTS[name], f"{name} metrics", "--any-ports"))
    return found


def in_use(port: int, host: str = HOST) -> bool:
    """Something listens on host:port (bound the way nats-server and the metrics servers bind: SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def taken(ports: Iterable[FixedPort]) -> list[FixedPort]:
    return [p for p in ports if in_use(p.port)]


def taken_line(busy: list[FixedPort]) -> str:
    """`port 4222 (node bus) is in use` / `ports 4222 (node bus), 9463 (converger metrics) are in use`."""
    names = ", ".join(f"{p.port} ({p.what})" for p in busy)
    return f"port {names} is in use" if len(busy) == 1 else f"ports {names} are in use"


def refusal(busy: list[FixedPort]) -> str:
    flags = sorted({p.flag for p in busy} - {"--any-ports"})
    moves = f"move it with {' / '.join(flags)}, or " if flags else ""
    return (
        f"bcd up: {taken_line(busy)} on {HOST}: stop what listens there, {moves}"
        "pass --any-ports (free ports for everything; `make run ARGS=--any-ports`) "
        "or --any-ports-if-taken (fixed ports when free)"
    )


def fallback_line(busy: list[FixedPort]) -> str:
    return f"bcd up: {taken_line(busy)} on {HOST}; picking free ports instead (--any-ports-if-taken)"


__all__ = ["HOST", "FixedPort", "fixed_ports", "in_use", "taken", "taken_line", "refusal", "fallback_line"]
