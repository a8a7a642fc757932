"""`bcd up`'s process supervisor: the node bus and every service as separate OS processes.

It starts nats-server first, then each service with its own NATS user and
password file; restarts a service that exits with exponential backoff (reset
once it has run for a while); and on SIGTERM or Ctrl-C stops the services,
then the server, leaving no process behind. Every child also gets
PR_SET_PDEATHSIG, so even a `kill -9` of the supervisor takes them down.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared import logs

from .nodebus import NatsServer

_PR_SET_PDEATHSIG = 1
log = logs.get_logger("bcd.supervisor")


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to the child when the supervisor dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: best effort only
        pass


@dataclass
class Backoff:
    initial: float = 0.5
    maximum: float = 30.0
    #: a process that ran this long is healthy again: next crash restarts fast.
    healthy_after: float = 30.0

    def delay(self, attempt: int) -> float:
        return min(self.maximum, self.initial * (2 ** max(0, attempt - 1)))


@dataclass
class ProcessSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=dict)
    #: stdout and stderr go here (appended) instead of the supervisor's terminal.
    log_path: Path | None = None


@dataclass
class _Child:
    spec: ProcessSpec
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    attempts: int = 0
    restarts: int = 0


class Supervisor:
    def __init__(
        self,
        bus: NatsServer | None,
        services: Sequence[ProcessSpec],
        *,
        backoff: Backoff | None = None,
        stop_timeout: float = 10.0,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.bus = bus
        self.children = [_Child(spec) for spec in services]
        self.backoff = backoff or Backoff()
        self.stop_timeout = stop_timeout
        self.stopping = asyncio.Event()
        self.on_ready = on_ready

    async def _spawn(self, child: _Child) -> None:
        env = {**os.environ, **child.spec.env}
        out = None
        if child.spec.log_path is not None:
            child.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(child.spec.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *child.spec.argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                preexec_fn=die_with_parent,
            )
        finally:
            if out is not None:
                out.close()
        child.started_at = time.monotonic()
        log.info("service started", service=child.spec.name, pid=child.proc.pid)

    async def _watch(self, child: _Child) -> None:
        while not self.stopping.is_set():
            await self._spawn(child)
            assert child.proc is not None
            waiter = asyncio.create_task(child.proc.wait())
            stopper = asyncio.create_task(self.stopping.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if self.stopping.is_set():
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
                return
            code = waiter.result()
            ran = time.monotonic() - child.started_at
            child.attempts = 1 if ran >= self.backoff.healthy_after else child.attempts + 1
            delay = self.backoff.delay(child.attempts)
            child.restarts += 1
            log.warning("service exited; restarting", service=child.spec.name, code=code, ran_s=round(ran, 1), restart_in_s=delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), timeout=delay)

    async def _terminate(self) -> None:
        procs = [c.proc for c in self.children if c.proc is not None and c.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), timeout=max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                log.warning("service did not stop in time; killing", pid=p.pid)
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()

    async def _watch_bus(self) -> None:
        """The node bus is a child too: restart it on the same ports and store if it dies."""
        assert self.bus is not None
        attempt = 0
        while not self.stopping.is_set():
            proc = self.bus.proc
            if proc is not None and proc.poll() is not None and not self.stopping.is_set():
                attempt += 1
                delay = self.backoff.delay(attempt)
                log.warning("node bus exited; restarting", code=proc.returncode, restart_in_s=delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), timeout=delay)
                if self.stopping.is_set():
                    return
                try:
                    await asyncio.to_thread(self.bus.start, 15.0, die_with_parent)
                    log.info("node bus restarted", url=self.bus.url)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    log.error("node bus did not restart", error=str(exc))
                    continue
            elif proc is not None and proc.poll() is None:
                attempt = 0
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), timeout=0.5)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        watchers = [asyncio.create_task(self._watch(c), name=f"watch.{c.spec.name}") for c in self.children]
        if self.bus is not None:
            watchers.append(asyncio.create_task(self._watch_bus(), name="watch.bus"))
        try:
            if self.on_ready is not None:
                self.on_ready()
            await self.stopping.wait()
            log.info("stopping services")
        finally:
            self.stopping.set()
            await asyncio.gather(*watchers, return_exceptions=True)
            await self._terminate()
            if self.bus is not None:
                await asyncio.to_thread(self.bus.stop)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        log.info("stopped")
        return 0


def service_argv(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def pidfile_write(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")


__all__ = ["Backoff", "ProcessSpec", "Supervisor", "die_with_parent", "service_argv", "pidfile_write"]
