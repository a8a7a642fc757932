"""The inventory's health thread: it waits on the adapter's health events and runs its checks.

NVML's event wait blocks, so it runs in a thread of its own (a daemon: a stop never waits on
the driver longer than one wait, WAIT_SECONDS). What it learns goes to the event loop as
`HealthNews` through `loop.call_soon_threadsafe`; healthdesk.py turns that into the tracker's
faults and a publish (health.py has the rules). The thread never decides anything itself.

The loop: open the watch (register every card) -> every `interval` run a check -> in between,
wait for events. When the library stops answering (an AdapterError from any of these) the
news is `gone` and the watch is opened again after a pause (RETRY_SECONDS), so a driver
that comes back is watched again without a restart; so is a card the wait stopped watching
(an `unmonitored` event from a wait).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .adapters.base import AdapterError, HealthCheck, HealthEvent, HealthNotRead, HealthWatcher

#: the longest one wait for events blocks (and so the longest a stop waits for the thread)
WAIT_SECONDS = 0.5
#: the pause before the watch is opened again after the library stopped answering
RETRY_SECONDS = 2.0

NewsKind = Literal["opened", "events", "checks", "gone"]


@dataclass(frozen=True)
class HealthNews:
    kind: NewsKind
    events: list[HealthEvent] = field(default_factory=list)
    checks: list[HealthCheck] = field(default_factory=list)
    #: why the library does not answer (kind "gone")
    message: str = ""


class HealthThread:
    """Runs the watch of one adapter; `news` is called on the event loop for everything it learns."""

    def __init__(self, adapter: HealthWatcher, loop: asyncio.AbstractEventLoop, news: Callable[[HealthNews], None], *, interval: float, log: Any) -> None:
        self.adapter = adapter
        self.loop = loop
        self.news = news
        self.interval = max(0.05, interval)
        self.log = log
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bcd-health-watch", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = WAIT_SECONDS * 4) -> None:
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        try:
            self.adapter.close_health_watch()
        except Exception:  # noqa: BLE001 - closing a watch of a library that is gone
            pass

    def _post(self, item: HealthNews) -> None:
        if self.stopping.is_set():
            return
        try:
            self.loop.call_soon_threadsafe(self.news, item)
        except RuntimeError:
            self.stopping.set()  # the loop is closed: the service is gone

    def _run(self) -> None:
        opened = False
        next_check = time.monotonic() + self.interval  # the service ran the first check itself (healthdesk.py, with the start scan)
        gone = ""
        unread = ""
        while not self.stopping.is_set():
            try:
                if not opened:
                    unmonitored = self.adapter.open_health_watch()
                    opened = True
                    self._post(HealthNews("opened", events=unmonitored))
                    if gone:
                        gone = ""
                        next_check = 0.0  # back: check at once
                now = time.monotonic()
                if now >= next_check:
                    self._post(HealthNews("checks", checks=self.adapter.check_health()))
                    next_check = now + self.interval
                events = self.adapter.wait_health_events(max(0.0, min(WAIT_SECONDS, next_check - time.monotonic())))
                if events:
                    self._post(HealthNews("events", events=events))
                if any(e.kind == "unmonitored" for e in events):
                    # the wait gave up on some cards (their set failed): register again after a pause,
                    # so a passing fault of the library does not leave them unwatched until a restart
                    opened = False
                    self.stopping.wait(RETRY_SECONDS)
            except HealthNotRead as exc:
                # nothing to conclude (the fake host file being edited): logged once, tried again
                if str(exc) != unread:
                    self.log.warning("GPU health not read this time; trying again", error=str(exc))
                unread = str(exc)
                next_check = time.monotonic() + self.interval
                self.stopping.wait(RETRY_SECONDS)
                continue
            except AdapterError as exc:
                message = str(exc) or type(exc).__name__
                if message != gone:
                    self._post(HealthNews("gone", message=message))
                gone = message
                opened = False
                try:
                    self.adapter.close_health_watch()
                except Exception:  # noqa: BLE001
                    pass
                self.stopping.wait(RETRY_SECONDS)
            except Exception:  # noqa: BLE001 - the watch must outlive a bug in one read; logged, retried
                self.log.exception("health watch failed; retrying")
                opened = False
                self.stopping.wait(RETRY_SECONDS)


__all__ = ["WAIT_SECONDS", "RETRY_SECONDS", "HealthNews", "HealthThread"]
