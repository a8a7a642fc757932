"""A real node bus per test and bcd services as real OS processes.

`NodeBus` starts the wheel's nats-server on a free port with the config
`bcd.nodebus` writes (the same users and permissions as production), and
makes the node's streams as the bus setup does (BUS_ADMIN_USER), and starts
services with `python -m services.<name>` under their own NATS user, each in
its own account (`connect(user)` is a client of that identity; `admin` reaches
only the store account's JetStream, never a service).
Each bus has a control-plane key of its own (`<root>/cp`, as `bcd up` keeps
it): every service gets its public half as `BCD_CP_KEY`, so the bridge and the
converger start as in production (no key, no start), and a test that plays
the bridge hands the converger `signed_spec(...)`, the envelope the bridge
relays - one helper, so no test carries its own copy of the signing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client

from bcd.nodebus import NatsServer, prepare_node_bus, setup_streams
from controlplane.keys import load_or_create_cp_key
from shared.busstreams import OutboxResult
from shared.schemas import NodeSpec, encode
from shared.signing import Ed25519PrivateKey, sign_node_spec
from shared.subjects import BUS_ADMIN_USER, inbox_prefix

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_HOSTS = REPO / "examples" / "hosts"


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    #: the test looked at the exit code itself (an expected exit).
    observed: bool = False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_lines(self) -> list[dict]:
        """Its JSON log lines, decoded (a line that is not JSON is left out)."""
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait(self, timeout: float = 20.0) -> int:
        self.observed = True
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 10.0) -> int:
        self.observed = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"{self.name} did not stop on SIGTERM within {timeout}s:\n{self.log()[-3000:]}")
        return self.proc.returncode


@dataclass
class NodeBus:
    root: Path
    node_id: str = "node-1"
    server: NatsServer | None = None
    creds: dict[str, Path] = field(default_factory=dict)
    services: list[ServiceProcess] = field(default_factory=list)
    clients: list[Client] = field(default_factory=list)

    def start(self, *, streams: bool = True) -> "NodeBus":
        """The server, and (`streams`) the node's streams made as the bus setup makes them."""
        conf, self.creds = prepare_node_bus(self.root / "bus", self.root / "js", self.node_id, admin=True)
        self.server = NatsServer(conf, self.root / "bus" / "nats-server.log").start()
        if streams:
            self.setup_streams()
        return self

    def setup_streams(self, **kw: object) -> OutboxResult:
        """What `bcd up` does before any service starts: the streams, as BUS_ADMIN_USER (in a
        thread of its own: a test calls this from inside its event loop)."""
        coro = setup_streams(self.url, self.password(BUS_ADMIN_USER), self.node_id, store_dir=self.root / "js", **kw)  # type: ignore[arg-type]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, coro).result(60)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def password(self, user: str) -> str:
        return self.creds[user].read_text().strip()

    @property
    def cp_dir(self) -> Path:
        return self.root / "cp"

    @property
    def cp_key(self) -> Ed25519PrivateKey:
        """The control plane's signing key for this bus (made on first use, kept in `cp_dir`)."""
        return load_or_create_cp_key(self.cp_dir)[0]

    @property
    def cp_pub(self) -> Path:
        return load_or_create_cp_key(self.cp_dir)[1]

    def signed_spec(self, spec: NodeSpec | bytes, key: Ed25519PrivateKey | None = None) -> bytes:
        """The SignedNodeSpec JSON the bridge relays to `converger.spec`: `spec` (or its exact JSON
        bytes) signed by this bus's control-plane key, or by `key` (a forger's)."""
        return signed_spec(key or self.cp_key, spec)

    def env(self, user: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}
        env.update(
            BCD_NODE_ID=self.node_id,
            BCD_NATS_URL=self.url,
            BCD_NATS_USER=user,
            BCD_NATS_PASSWORD_FILE=str(self.creds[user]),
            BCD_METRICS_PORT="0",
            BCD_DATA_DIR=str(self.root / "data"),
            BCD_RUN_DIR=str(self.root / "run"),
            BCD_CDI_DIR=str(self.root / "cdi"),
            # never the host's /var/run/cdi, whatever a service's own default
            BCD_CDI_CONSUMER_DIR=str(self.root / "run" / "cdi"),
            # the inventory's NFD feature file: never the host's /etc/kubernetes
            BCD_FEATURE_DIR=str(self.root / "features.d"),
            # the bridge and the converger refuse to start without a key (issue 40)
            BCD_CP_KEY=str(self.cp_pub),
        )
        env.update(extra)
        return env

    def start_service(self, name: str, *args: str, user: str | None = None, **env: str) -> ServiceProcess:
        log_path = self.root / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(  # noqa: S603
                [sys.executable, "-m", f"services.{name}", *args],
                env=self.env(user or name, **env),
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
            )
        sp = ServiceProcess(name, proc, log_path)
        self.services.append(sp)
        return sp

    async def connect(self, user: str = "cli", **kw: object) -> Client:
        nc = await nats.connect(
            self.url,
            user=user,
            password=self.password(user),
            inbox_prefix=inbox_prefix(user).encode(),
            allow_reconnect=False,
            **kw,  # type: ignore[arg-type]
        )
        self.clients.append(nc)
        return nc

    async def wait_service(self, name: str, timeout: float = 20.0) -> dict:
        """Wait until `name` answers `$SRV.PING.<name>`; fail with its log if it died."""
        import json

        nc = await self.connect("cli")
        deadline = time.monotonic() + timeout
        sp = next((s for s in reversed(self.services) if s.name == name), None)
        while time.monotonic() < deadline:
            if sp is not None and sp.proc.poll() is not None:
                raise AssertionError(f"{name} exited with {sp.proc.returncode}:\n{sp.log()[-3000:]}")
            try:
                msg = await nc.request(f"$SRV.PING.{name}", b"", timeout=0.5)
                return json.loads(msg.data)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                await asyncio.sleep(0.1)
        raise AssertionError(f"{name} did not answer $SRV.PING in {timeout}s:\n{sp.log()[-3000:] if sp else ''}")

    async def aclose(self) -> None:
        for nc in self.clients:
            with contextlib.suppress(Exception):
                await nc.close()
        codes = {}
        for sp in self.services:
            if sp.observed and sp.proc.poll() is not None:
                continue
            codes[sp.name] = sp.stop()
        if self.server is not None:
            self.server.stop()
        bad = {n: c for n, c in codes.items() if c not in (0, None)}
        # A service that had to be killed or crashed is a failure of the test.
        assert not bad or all(c == -signal.SIGKILL for c in bad.values()), f"services exited badly: {bad}"


def standin(nc: Client, name: str, subjects: object) -> tuple[Any, Any, Any]:
    """A micro service named `name` on `nc` with the runtime's own endpoints (ServiceContext), for
    a test that stands in for that service: (service, context, its metrics registry)."""
    from nats.micro.service import Service, ServiceConfig
    from prometheus_client import CollectorRegistry

    from shared import logs
    from shared.runtime import ServiceContext, _metrics

    service = Service(nc, ServiceConfig(name=name, version="0.0.1", description="stand-in"))
    registry = CollectorRegistry()
    requests, latency, _ = _metrics(name, "stand-in", registry)
    ctx = ServiceContext(
        app=None,  # type: ignore[arg-type]
        opts=None,  # type: ignore[arg-type]
        nc=nc,
        service=service,
        subjects=subjects,  # type: ignore[arg-type]
        registry=registry,
        log=logs.get_logger(f"test.{name}"),
        _requests=requests,
        _latency=latency,
    )
    return service, ctx, registry


def upstream_only(conf: Path) -> dict:
    """A config `prepare_node_bus(..., upstream_nodes=...)` wrote, cut to its upstream accounts
    (a server that plays upstream alone); written back, and returned for further edits."""
    cfg = json.loads(conf.read_text())
    cfg["accounts"] = {name: a for name, a in cfg["accounts"].items() if name.startswith("UPSTREAM")}
    conf.write_text(json.dumps(cfg))
    return cfg


def signed_spec(key: Ed25519PrivateKey, spec: NodeSpec | bytes) -> bytes:
    """`spec` (or its exact JSON bytes) as a SignedNodeSpec by `key`, encoded as the bus carries it."""
    return encode(sign_node_spec(key, spec))


async def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):  # noqa: ANN001, ANN201
    """Poll `predicate` (sync or async) until it returns something true; that value, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await predicate() if asyncio.iscoroutinefunction(predicate) else predicate()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
