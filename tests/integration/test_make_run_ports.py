"""`make run` when a default port is taken: it picks free ones and says so in one line;
a plain `bcd up` stops before starting anything, naming the port and the flags.

The command line is the Makefile's own `run` recipe (`$(BIN)/bcd up ... $(ARGS)`), read
from the Makefile, with a private --state-dir; the default node-bus port 4222 is held
by a listening socket the test binds on 127.0.0.1 (or by whatever holds it already).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BUS_PORT = 4222


def make_run_argv(*args: str) -> list[str]:
    """The `run` recipe of the Makefile as argv, `$(ARGS)` replaced by `args`."""
    text = (REPO / "Makefile").read_text()
    recipe = re.search(r"^run:.*\n\t(.*)$", text, flags=re.M).group(1)
    words = shlex.split(recipe)
    assert words[0] == "$(BIN)/bcd" and words[-1] == "$(ARGS)", recipe
    return [sys.executable, "-m", "bcd.cli", *words[1:-1], *args]


@contextlib.contextmanager
def port_taken(port: int) -> Iterator[None]:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            # already taken by something else: just as good
        yield
    finally:
        s.close()


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}


def test_make_run_picks_free_ports_when_a_default_one_is_taken(tmp_path: Path) -> None:
    state = tmp_path / "state"
    log_path = tmp_path / "run.log"
    with port_taken(BUS_PORT), open(log_path, "wb") as log:
        proc = subprocess.Popen(make_run_argv("--state-dir", str(state)), stdout=log, stderr=log, cwd=REPO, env=clean_env())
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                text = log_path.read_text(errors="replace")
                if "verified events" in text or proc.poll() is not None:
                    break
                time.sleep(0.3)
            text = log_path.read_text(errors="replace")
            assert proc.poll() is None, f"make run exited with {proc.returncode}:\n{text[-3000:]}"
            lines = [line for line in text.splitlines() if "picking free ports" in line]
            assert len(lines) == 1, text[-3000:]
            assert f"{BUS_PORT} (node bus)" in lines[0] and "--any-ports-if-taken" in lines[0]
            assert "verified events" in text, text[-3000:]
            node = json.loads((state / "node.json").read_text())
            assert not node["nats_url"].endswith(f":{BUS_PORT}")
            # the banner says where everything went, the metrics ports the services took
            # included, in one piece: between its node-bus line and "Stop with Ctrl-C", one
            # line per service as node.json has it (they came later, apart from it, before)
            banner = text[text.index("  node bus "):text.index("Stop with Ctrl-C.")]
            shown = dict(re.findall(r"^  metrics +(\S+) +(\S+)$", banner, flags=re.M))
            assert shown and shown == node["metrics"], banner
            assert set(shown) == set(node["services"]), banner
            # the demo spec went through: the status table shows its holds
            assert "train-01" in text
            # a second `make run` on the same state finds the ports taken too, but must not
            # start a second node on the first one's files
            again = subprocess.run(make_run_argv("--state-dir", str(state)), capture_output=True, text=True, timeout=60, cwd=REPO, env=clean_env())
            assert again.returncode == 1 and f"a node already runs on {state}" in again.stderr, again.stderr
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_bcd_up_without_the_flag_names_the_port_and_the_flags(tmp_path: Path) -> None:
    state = tmp_path / "state"
    with port_taken(BUS_PORT):
        out = subprocess.run(
            [sys.executable, "-m", "bcd.cli", "up", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60, cwd=REPO, env=clean_env(),
        )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"{BUS_PORT} (node bus)" in lines[0] and "--port" in lines[0]
    assert "--any-ports" in lines[0] and "make run ARGS=--any-ports" in lines[0]
    assert "Traceback" not in out.stderr
    assert not (state / "bus" / "nats.conf").exists()  # nothing was started
