"""The bus runtime every bcd service runs on.

A service is a `ServiceApp`: it declares its options, registers `nats.micro`
endpoints in `setup`, and may run background loops in `run`. The runtime owns
the rest, identically for every process: options from flags or env vars
(`--nats-url` / `BCD_NATS_URL`), structured logs, the NATS connection with the
service's own user and inbox prefix, a micro service (so `$SRV.PING/INFO/STATS`
find it), a Prometheus endpoint on a loopback port of its own, and a clean stop
on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import nats
from nats.micro.service import Service, ServiceConfig
from nats.aio.client import Client
from nats.micro.request import Request, ServiceError

from shared import logs
from shared.schemas import BadMessage, Codec, encode
from shared.schemas.codec import SchemaViolation
from shared.stopping import cancel_surely, unless_stopped
from shared.subjects import SERVICE_ERROR_CODE_HEADER, SERVICE_ERROR_HEADER, NodeSubjects, inbox_prefix, node_account

if TYPE_CHECKING:
    # imported where a service starts (`serve`): the CLI and the supervisor, which
    # import this module for METRICS_PORTS, `call` and the options, expose no metrics
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

VERSION = "0.1.0"

#: default loopback metrics port of each process (0 picks a free one).
METRICS_PORTS: dict[str, int] = {
    "inventory": 9461,
    "signer": 9462,
    "converger": 9463,
    "gateway_bridge": 9464,
    "kube_reaper": 9465,
    "vfio_switcher": 9466,
    "helper": 9467,
    "device_plugin": 9468,
    "dra_plugin": 9469,
}

T = TypeVar("T")

#: how long a stopping service waits for its bus to drain.
STOP_GRACE_S = 3.0


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Option:
    """One option, taken as `--flag` or from the env var `BCD_FLAG` (flag wins).

    A `switch` takes no value: `--flag` turns it on, and so does `BCD_FLAG=1`
    (`true`, `yes`, `on`; `0`, `false`, `no`, `off` or empty leave it off, any
    other value is refused rather than guessed).
    """

    flag: str
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    required: bool = False
    choices: Sequence[str] | None = None
    switch: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "BCD_" + self.dest.upper()


def common_options(service: str) -> list[Option]:
    return [
        Option("--node-id", "node id (subject token, KV key)", required=True),
        Option("--nats-url", "node-bus NATS URL", default="nats://127.0.0.1:4222"),
        Option("--nats-user", "NATS user of this service", default=service),
        Option("--nats-password-file", "file holding this service's NATS password", type=Path),
        Option("--metrics-addr", "address of the Prometheus endpoint", default="127.0.0.1"),
        Option("--metrics-port", "port of the Prometheus endpoint (0: any free port)", default=METRICS_PORTS.get(service, 0), type=int),
        Option("--log-level", "DEBUG, INFO, WARNING or ERROR", default="INFO"),
        Option("--log-format", "json or text", default="json", choices=("json", "text")),
    ]


def parse_options(service: str, options: Sequence[Option], argv: Sequence[str] | None, env: dict[str, str] | None = None) -> argparse.Namespace:
    env = dict(os.environ) if env is None else env
    parser = argparse.ArgumentParser(prog=f"bcd-{service.replace('_', '-')}", description=f"bcd {service} service")
    for opt in options:
        if opt.switch:
            on = _switch_value(parser, opt.env, env.get(opt.env) or "")
            parser.add_argument(opt.flag, dest=opt.dest, action="store_true", default=on, help=f"{opt.help} [env {opt.env}=1]")
            continue
        default = opt.default
        from_env = env.get(opt.env)
        if from_env is not None and from_env != "":
            default = opt.type(from_env)
        parser.add_argument(
            opt.flag,
            dest=opt.dest,
            default=default,
            type=opt.type,
            required=opt.required and default is None,
            choices=opt.choices,
            help=f"{opt.help} [env {opt.env}]" + (f" (default {opt.default})" if opt.default is not None else ""),
        )
    ns = parser.parse_args(list(argv) if argv is not None else None)
    # choices are only checked by argparse for flags; check env values too.
    for opt in options:
        if opt.choices and getattr(ns, opt.dest) not in opt.choices:
            parser.error(f"{opt.env}: {getattr(ns, opt.dest)!r} is not one of {', '.join(opt.choices)}")
    return ns


_SWITCH_ON = ("1", "true", "yes", "on")
_SWITCH_OFF = ("", "0", "false", "no", "off")


def _switch_value(parser: argparse.ArgumentParser, name: str, value: str) -> bool:
    # a typo in a switch that weakens a check must not read as either answer: refused
    text = value.strip().lower()
    if text in _SWITCH_ON:
        return True
    if text not in _SWITCH_OFF:
        parser.error(f"{name}: {value!r} is neither 1 nor 0 (true/false, yes/no, on/off)")
    return False


# --------------------------------------------------------------------------- bus calls


class ServiceCallError(Exception):
    """A node-bus request answered with a micro error (Nats-Service-Error headers)."""

    def __init__(self, code: str, description: str) -> None:
        super().__init__(f"{code}: {description}")
        self.code = code
        self.description = description


async def call(nc: Client, subject: str, payload: object, reply: Codec[T], *, timeout: float = 5.0) -> T:
    """Request/reply with typed payloads; micro errors become ServiceCallError."""
    data = payload if isinstance(payload, bytes) else encode(payload)
    msg = await nc.request(subject, data, timeout=timeout)
    headers = msg.headers or {}
    if SERVICE_ERROR_HEADER in headers:
        raise ServiceCallError(headers.get(SERVICE_ERROR_CODE_HEADER, "500"), headers[SERVICE_ERROR_HEADER])
    return reply.decode(msg.data)


class Refused(ServiceError):
    """A well-formed request the service will not do; the reason goes to the caller."""

    def __init__(self, description: str, code: str = "403") -> None:
        super().__init__(code, description)


# --------------------------------------------------------------------------- the app


class ServiceApp:
    """Subclass per service. `setup` registers endpoints; `run` does the work until stopped."""

    name: str = "service"
    description: str = ""

    def options(self) -> list[Option]:
        return []

    async def setup(self, ctx: "ServiceContext") -> None:
        """Register endpoints; called once connected."""

    async def run(self, ctx: "ServiceContext") -> None:
        """Background work; return or wait on `ctx.stopping`. Cancelled at stop."""
        await ctx.stopping.wait()

    async def close(self, ctx: "ServiceContext") -> None:
        """Release what `setup` acquired (called after endpoints stop)."""


@dataclass
class ServiceContext(Generic[T]):
    app: ServiceApp
    opts: argparse.Namespace
    nc: Client
    service: Service
    subjects: NodeSubjects
    registry: CollectorRegistry
    log: logs.StructLogger
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    metrics_port: int = 0
    #: facts shown in $SRV.PING/INFO (add in setup, before the service starts answering).
    metadata: dict[str, str] = field(default_factory=dict)
    _requests: Counter | None = None
    _latency: Histogram | None = None

    async def endpoint(
        self,
        name: str,
        subject: str,
        handler: Callable[..., Awaitable[object]],
        request: Codec[Any] | None,
        *,
        allow_empty: bool = False,
        reply: Codec[Any] | None = None,
        with_body: bool = False,
    ) -> None:
        """Add a micro endpoint whose body is decoded with `request` at the boundary.

        With `with_body`, the handler gets `(decoded, body)`: the request bytes
        too, for what the typed value does not keep (fields its schema does not know).

        A body that does not decode, whatever the reason, is answered 400 with
        the field named; a `Refused` keeps its code; anything else is logged
        and answered 500. With `reply`, the handler's result is encoded through
        `reply.encode_valid`: a result its own schema refuses is logged and
        answered 500 "reply violates <Type> schema", never sent as a message
        the caller cannot decode. The service itself never dies of a bad message.
        """
        assert self._requests is not None and self._latency is not None
        requests, latency, log = self._requests, self._latency, self.log
        callers = self.subjects.callers(subject)
        allowed = {node_account(c) for c in callers} if callers is not None else set()

        def refuse_body(exc: Exception) -> ServiceError:
            text = str(exc) if isinstance(exc, BadMessage) else f"message: not readable ({type(exc).__name__})"
            log.warning("bad request", endpoint=name, error=text)
            return ServiceError("400", text)

        def encode_reply(result: object) -> bytes:
            if reply is None:
                return result if isinstance(result, bytes) else encode(result)
            if isinstance(result, bytes):
                try:
                    reply.decode(result)
                except BadMessage as exc:
                    raise SchemaViolation(f"{reply.type_name} schema violated: {exc}") from None
                return result
            return reply.encode_valid(result)

        async def handle(req: Request) -> None:
            started = time.perf_counter()
            outcome = "ok"
            try:
                # each hop checks who asks: the server names the caller's account on a request
                # that came through an import (a client cannot set it there), and nothing else
                # reaches an endpoint (docs/security.md)
                who = caller_account(req.headers)
                if who not in allowed:
                    outcome = "forbidden"
                    raise forbidden(name, subject, who, callers)
                if request is None:
                    arg: Any = req.data
                else:
                    try:
                        arg = request.decode(b"{}" if allow_empty and not req.data.strip() else req.data)
                    except Exception as exc:  # noqa: BLE001 - any decode failure is the sender's: 400
                        outcome = "bad_request"
                        raise refuse_body(exc) from None
                try:
                    result = await (handler(arg, req.data) if with_body else handler(arg))
                except ServiceError as exc:
                    outcome = "refused" if outcome == "ok" else outcome
                    log.info("request refused", endpoint=name, code=exc.code, reason=exc.description)
                    raise
                except Exception as exc:  # noqa: BLE001 - a service never dies of one request
                    outcome = "error"
                    log.exception("request failed", endpoint=name)
                    raise ServiceError("500", f"internal error: {type(exc).__name__}") from None
                try:
                    data = encode_reply(result)
                except SchemaViolation as exc:
                    outcome = "error"
                    log.error("reply violates its schema; answered 500", endpoint=name, error=str(exc))
                    raise ServiceError("500", f"internal error: reply violates {reply.type_name if reply else 'its'} schema") from None
                except Exception as exc:  # noqa: BLE001 - an unencodable reply is this service's bug
                    outcome = "error"
                    log.exception("reply not encodable; answered 500", endpoint=name)
                    raise ServiceError("500", f"internal error: reply not encodable ({type(exc).__name__})") from None
                try:
                    await req.respond(data)
                except Exception as exc:  # noqa: BLE001 - e.g. larger than max_payload: the caller gets a 500
                    outcome = "error"
                    log.error("reply not sent", endpoint=name, error=f"{type(exc).__name__}: {exc}", bytes=len(data))
                    raise ServiceError("500", f"internal error: reply not sent ({type(exc).__name__})") from None
            finally:
                requests.labels(endpoint=name, outcome=outcome).inc()
                latency.labels(endpoint=name).observe(time.perf_counter() - started)

        await self.service.add_endpoint(name=name, subject=subject, handler=handle)
        # the subscription is only sent, not yet known to the server: a caller on another connection
        # asking right after this returns got "no responders" now and then (test_bridge_bounds, once
        # in CI). Flushed, the endpoint answers from the moment it is added.
        await self.nc.flush(timeout=ENDPOINT_FLUSH_TIMEOUT_S)


#: how long adding an endpoint waits for the server to have its subscription
ENDPOINT_FLUSH_TIMEOUT_S = 5.0

#: the header nats-server puts on a request that crossed from another account (ClientInfoHdr)
REQUEST_INFO_HEADER = "Nats-Request-Info"


def caller_account(headers: Mapping[str, str] | None) -> str:
    """The account a request came from, as the server wrote it when the request crossed an
    import ("" when it did not: then it came from inside the endpoint's own account)."""
    raw = (headers or {}).get(REQUEST_INFO_HEADER, "")
    if not raw or len(raw) > 4096:
        return ""
    try:
        info = json.loads(raw)
    except ValueError:
        return ""
    acc = info.get("acc") if isinstance(info, dict) else None
    return acc if isinstance(acc, str) else ""


def forbidden(name: str, subject: str, who: str, callers: tuple[str, ...] | None) -> ServiceError:
    """403 for a request from an account the endpoint's route does not name."""
    logs.get_logger("bcd.runtime").warning("request from a caller the route does not name refused", endpoint=name, caller_account=who or "(own account)")
    whom = ", ".join(callers) if callers else "nobody (no route names it)"
    return ServiceError("403", f"{subject}: refused: the caller ({who or 'not through an import'}) may not ask this; only {whom} may")


# --------------------------------------------------------------------------- surviving one bad message


def describe(exc: BaseException) -> str:
    """`Type: text` of an exception, for a log line (the type alone when it has no text)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def guarded(log: logs.StructLogger, what: str) -> Callable[[Callable[[Any], Awaitable[None]]], Callable[[Any], Awaitable[None]]]:
    """Decorate a NATS subscription callback: an exception from one message is logged, never raised.

        @guarded(ctx.log, "inventory notice")
        async def on_inventory(msg): ...

    A message that does not decode (BadMessage) is a WARNING; anything else
    is an ERROR with its traceback. Either way the callback stays subscribed
    and the next message is handled.
    """

    def wrap(cb: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        async def run(msg: Any) -> None:
            try:
                await cb(msg)
            except BadMessage as exc:
                log.warning(f"{what}: message ignored", subject=getattr(msg, "subject", ""), error=str(exc))
            except Exception as exc:  # noqa: BLE001 - one message never stops a subscription
                log.exception(f"{what}: handling a message failed", subject=getattr(msg, "subject", ""), error=describe(exc))

        run.__name__ = getattr(cb, "__name__", "callback")
        run.__qualname__ = getattr(cb, "__qualname__", run.__name__)
        return run

    return wrap


class LoopGuard:
    """One iteration of a background loop: an exception is logged and backed off, never fatal.

        guard = LoopGuard(ctx.log, "specs loop")
        while not ctx.stopping.is_set():
            async with guard:
                ...one iteration...

    An iteration that raises (anything but cancellation) is logged with the
    error, then the guard sleeps `initial` seconds, doubling on each
    consecutive failure up to `maximum`; a clean iteration resets it. The
    loop goes on either way.
    """

    def __init__(self, log: logs.StructLogger, what: str, *, initial: float = 0.5, maximum: float = 10.0) -> None:
        self.log = log
        self.what = what
        self.initial = initial
        self.maximum = maximum
        self.failures = 0

    def delay(self) -> float:
        return min(self.maximum, self.initial * (2 ** max(0, self.failures - 1)))

    async def __aenter__(self) -> "LoopGuard":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.failures = 0
            return False
        if not isinstance(exc, Exception):
            return False  # CancelledError, KeyboardInterrupt, SystemExit: stop as asked
        self.failures += 1
        delay = self.delay()
        fields: dict[str, Any] = {"error": describe(exc), "retry_in_s": delay, "failures": self.failures}
        if isinstance(exc, BadMessage):
            # a peer's (or a bucket's) message that does not decode: its text says why
            self.log.warning(f"{self.what}: a message did not decode; retrying", **fields)
        else:
            self.log.exception(f"{self.what}: iteration failed; retrying", **fields)
        await asyncio.sleep(delay)
        return True


def _metrics(service: str, node_id: str, registry: CollectorRegistry) -> tuple[Counter, Histogram, Gauge]:
    from prometheus_client import Counter, Gauge, Histogram, PlatformCollector, ProcessCollector

    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    info = Gauge("bcd_service_info", "Static facts of this service", ["service", "version", "node_id"], registry=registry)
    info.labels(service=service, version=VERSION, node_id=node_id).set(1)
    requests = Counter(
        "bcd_requests", "Node-bus requests handled, by endpoint and outcome", ["endpoint", "outcome"], registry=registry
    )
    latency = Histogram("bcd_request_duration_seconds", "Node-bus request handling time", ["endpoint"], registry=registry)
    connected = Gauge("bcd_nats_connected", "1 while connected to the node bus", registry=registry)
    return requests, latency, connected


async def connect(opts: argparse.Namespace, name: str, log: logs.StructLogger, connected: Gauge | None = None) -> Client:
    password = None
    if opts.nats_password_file:
        password = Path(opts.nats_password_file).read_text().strip()

    # while the bus does not answer, each reason is said once (not once a second)
    said: set[str] = set()

    async def on_error(exc: Exception) -> None:
        reason = str(exc) or type(exc).__name__
        if nc.is_connected:
            log.warning("nats error", error=reason)
        elif reason not in said:
            said.add(reason)
            log.warning("node bus not reachable; retrying", url=opts.nats_url, error=reason)

    async def on_disconnect() -> None:
        if connected is not None:
            connected.set(0)
        log.warning("disconnected from the node bus")

    async def on_reconnect() -> None:
        said.clear()
        if connected is not None:
            connected.set(1)
        log.info("reconnected to the node bus")

    nc = Client()
    await nc.connect(
        opts.nats_url,
        name=f"bcd-{name}",
        user=opts.nats_user if password is not None else None,
        password=password,
        inbox_prefix=inbox_prefix(opts.nats_user).encode(),
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        max_reconnect_attempts=-1,
        reconnect_time_wait=1,
        connect_timeout=5,
    )
    said.clear()
    if connected is not None:
        connected.set(1)
    return nc


async def serve(app: ServiceApp, opts: argparse.Namespace) -> int:
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import start_http_server

    log = logs.get_logger(f"bcd.{app.name}")
    registry = CollectorRegistry()
    requests, latency, connected = _metrics(app.name, opts.node_id, registry)
    httpd, thread = start_http_server(opts.metrics_port, addr=opts.metrics_addr, registry=registry)
    metrics_port = httpd.server_port
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    nc: Client | None = None
    ctx: ServiceContext[Any] | None = None
    try:
        # the connect retries for ever: a stop meanwhile ends it (shared/stopping.py)
        nc = await unless_stopped(connect(opts, app.name, log, connected), stopping)
        if nc is None or stopping.is_set():
            log.info("stopped before the service started")
            return 0
        # The $SRV handlers start only after setup, so a PING answer means "ready".
        # `metadata` is shared with the service: setup may add facts for operators.
        metadata = {"node_id": opts.node_id, "metrics": f"{opts.metrics_addr}:{metrics_port}", "pid": str(os.getpid())}
        service = Service(
            nc,
            ServiceConfig(
                name=app.name,
                version=VERSION,
                description=app.description or f"bcd {app.name}",
                metadata=metadata,
            ),
        )
        ctx = ServiceContext(
            app=app,
            opts=opts,
            nc=nc,
            service=service,
            subjects=NodeSubjects(opts.node_id),
            registry=registry,
            log=log,
            stopping=stopping,
            metrics_port=metrics_port,
            metadata=metadata,
            _requests=requests,
            _latency=latency,
        )
        await app.setup(ctx)
        await service.start()
        log.info(
            "started",
            node_id=opts.node_id,
            nats_url=opts.nats_url,
            user=opts.nats_user,
            metrics=f"http://{opts.metrics_addr}:{metrics_port}/metrics",
            pid=os.getpid(),
        )
        runner = asyncio.create_task(app.run(ctx), name=f"{app.name}.run")
        stop_wait = asyncio.create_task(stopping.wait(), name=f"{app.name}.stop")
        done, _ = await asyncio.wait({runner, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if runner in done and runner.exception() is not None:
            log.error("service loop failed", error=repr(runner.exception()))
            code = 1
        for task in (runner, stop_wait):
            if not await cancel_surely(task):
                log.error("the service loop did not end when cancelled; stopping without it", task=task.get_name())
                code = 1
        log.info("stopping")
        # Bounded: when the bus is already gone (it may get the same SIGTERM),
        # draining would wait for a reconnect that never comes.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(service.stop(), STOP_GRACE_S)
        await app.close(ctx)
        return code
    finally:
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.drain(), STOP_GRACE_S)
            if not nc.is_closed:
                with contextlib.suppress(Exception):
                    await nc.close()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


#: see run_service.
SWITCH_INTERVAL_S = 0.0005


def run_service(app: ServiceApp, argv: Sequence[str] | None = None) -> int:
    opts = parse_options(app.name, [*common_options(app.name), *app.options()], argv)
    logs.configure(app.name, opts.log_level, opts.log_format)
    log = logs.get_logger(f"bcd.{app.name}")
    # A worker thread back from an fsync waits for the GIL until the running thread
    # yields it, up to the switch interval (5 ms by default): longer than the fsync
    # itself. Services run short blocking calls in threads beside CPU work on the loop.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        if getattr(opts, "data_dir", None) is not None:
            stamp_state(Path(opts.data_dir) / app.name, log)
        return asyncio.run(serve(app, opts))
    except StartupError as exc:
        log.error("cannot start", reason=str(exc))
        return 2
    except (OSError, nats.errors.Error) as exc:
        log.error("cannot start", reason=f"{type(exc).__name__}: {exc}")
        return 2


class StartupError(Exception):
    """A service cannot start; the text tells the operator why (no traceback)."""


def stamp_state(service_dir: Path, log: logs.StructLogger) -> None:
    """Refuse a state a newer bcd wrote (StartupError), else stamp it as ours (statestamp.py)."""
    from .statestamp import StateTooNew, check_and_stamp

    try:
        check_and_stamp(service_dir, version=VERSION)
    except StateTooNew as exc:
        raise StartupError(str(exc)) from None
    except OSError as exc:
        log.warning("state dir not stamped with this bcd's state format", dir=str(service_dir), error=exc.strerror or str(exc))


def main_for(app_factory: Callable[[], ServiceApp]) -> Callable[[], None]:
    def main() -> None:
        sys.exit(run_service(app_factory()))

    return main


__all__ = [
    "VERSION",
    "METRICS_PORTS",
    "Option",
    "common_options",
    "parse_options",
    "ServiceCallError",
    "call",
    "Refused",
    "ServiceApp",
    "ServiceContext",
    "StartupError",
    "describe",
    "guarded",
    "LoopGuard",
    "connect",
    "serve",
    "run_service",
    "main_for",
]
