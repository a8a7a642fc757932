"""Test helpers for code that must never block or wildcard-match wrongly.

`within_deadline` runs a call in a thread and fails the test when it blocks
(a reader stuck opening a FIFO is released afterwards, so the thread ends);
`subject_matches` is the NATS subject rule the permission tests hold the
server to.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

DEADLINE_S = 5.0


def release_fifo(path: Path) -> None:
    """Unblock a reader stuck opening a FIFO (opening the write end lets its open return)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def within_deadline(fn: Callable[[], Any], fifos: Iterable[Path] = (), deadline_s: float = DEADLINE_S) -> Any:
    """fn()'s result (or its exception, raised); AssertionError when it blocked past `deadline_s`."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        for _ in range(3):
            for f in fifos:
                release_fifo(f)
            t.join(0.5)
        raise AssertionError(f"did not return within {deadline_s}s (blocked)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def subject_matches(pattern: str, subject: str) -> bool:
    """Does an allow pattern admit `subject`, the way nats-server's sublist decides?

    Tokens of `subject` are taken literally: a `*` in the pattern admits any one
    token (even a `*` or `>` of a wildcard subscription), a trailing `>` admits
    one or more tokens.
    """
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)
