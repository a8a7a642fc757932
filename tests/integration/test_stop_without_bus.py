"""Every service stops on SIGTERM while its node bus does not answer, and says why once.

Before: the connect retried for ever and SIGTERM only set an event nobody waited on, so a
service whose nats-server was gone (it gets the same SIGTERM on a shutdown) stayed until
systemd's SIGKILL, logging "nats error" once a second meanwhile."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bcd.roster import HELPER, NODE_SERVICES
from controlplane.keys import load_or_create_cp_key

REPO = Path(__file__).resolve().parents[2]
#: what the runtime says, once per reason, while the bus does not answer
NOT_REACHABLE = "node bus not reachable; retrying"


def closed_port() -> int:
    """A port nothing listens on (bound and closed: connects are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_service_stops_on_sigterm_while_the_bus_is_unreachable(tmp_path):
    names = sorted({*NODE_SERVICES, HELPER})
    url = f"nats://127.0.0.1:{closed_port()}"
    pub = load_or_create_cp_key(tmp_path / "cp")[1]
    base = {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for name in names:
            log = tmp_path / f"{name}.log"
            env = {
                **base,
                "BCD_NODE_ID": "n1",
                "BCD_NATS_URL": url,
                "BCD_METRICS_PORT": "0",
                "BCD_DATA_DIR": str(tmp_path / "data"),
                "BCD_RUN_DIR": str(tmp_path / "run"),
                "BCD_CDI_DIR": str(tmp_path / "cdi"),
                "BCD_CDI_CONSUMER_DIR": str(tmp_path / "run" / "cdi"),
                "BCD_FEATURE_DIR": str(tmp_path / "features.d"),
                "BCD_CP_KEY": str(pub),
                # the bridge's upstream: never reached, its node bus comes first
                "BCD_UPSTREAM_URL": url,
            }
            with open(log, "wb") as out:
                procs[name] = (subprocess.Popen([sys.executable, "-m", f"services.{name}"], env=env, stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=REPO), log)  # noqa: S603
        # each in its connect loop: the reason said, then some more refused tries (one a second)
        deadline = time.monotonic() + 60
        while not all(NOT_REACHABLE in log.read_text() for _, log in procs.values()):
            gone = {n: p.returncode for n, (p, _) in procs.items() if p.poll() is not None}
            assert not gone, f"exited before the stop: {gone}\n" + "\n".join(f"{n}: {procs[n][1].read_text()[-1500:]}" for n in gone)
            assert time.monotonic() < deadline, {n: log.read_text()[-500:] for n, (_, log) in procs.items()}
            time.sleep(0.2)
        time.sleep(3)
        t0 = time.monotonic()
        for proc, _ in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {}
        for name, (proc, _) in procs.items():
            try:
                codes[name] = proc.wait(max(0.1, t0 + 15 - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = "still running 15 s after SIGTERM"
        assert codes == dict.fromkeys(names, 0), codes
        for name, (_, log) in procs.items():
            text = log.read_text()
            assert text.count(NOT_REACHABLE) == 1, f"{name}: the reason said more than once\n{text[-3000:]}"
            assert "Connect call failed" in text and "Traceback" not in text, f"{name}:\n{text[-3000:]}"
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
