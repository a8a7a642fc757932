#!/usr/bin/python3
"""The test VM's command agent (deploy/vm/build-image.sh installs it; tests/vm/qemu.py drives it).

Reads requests from a virtio-serial port, one JSON object a line, and answers each on the
same port, one JSON object a line. The serial console stays free for the kernel and systemd;
no login, no shell prompt, no escape codes in the way.

  {"id": 1, "op": "ping"}
      -> {"id": 1, "ok": true, "boot_id": ..., "uptime": ...}
  {"id": 2, "op": "exec", "argv": [...], "timeout": 60, "input": <base64>|null, "env": {...}|null, "cwd": ...}
      -> {"id": 2, "rc": 0, "stdout": <base64>, "stderr": <base64>, "timed_out": false, "error": null, "seconds": ...}

On start it says {"event": "ready", "boot_id": ...} so the host sees a boot (and a reboot).
Each request runs in a thread of its own; a command past its timeout has its whole process
group killed and answers rc null, timed_out true. Standard library only (Debian's python3).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
}


def read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


class Agent:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.lock = threading.Lock()
        self.boot_id = read_text("/proc/sys/kernel/random/boot_id")

    def send(self, obj: dict) -> None:
        data = memoryview((json.dumps(obj, separators=(",", ":")) + "\n").encode())
        with self.lock:
            while data:
                n = os.write(self.fd, data)
                data = data[n:]

    def uptime(self) -> float:
        return float((read_text("/proc/uptime") or "0").split()[0])

    def handle(self, req: dict) -> None:
        rid = req.get("id")
        try:
            op = req.get("op")
            if op == "ping":
                self.send({"id": rid, "ok": True, "boot_id": self.boot_id, "uptime": self.uptime()})
            elif op == "exec":
                self.send({"id": rid, **self.exec(req)})
            else:
                self.send({"id": rid, "rc": None, "error": f"unknown op {op!r}"})
        except Exception as e:  # answer, never die: the host waits for this id
            self.send({"id": rid, "rc": None, "error": f"{type(e).__name__}: {e}"})

    def exec(self, req: dict) -> dict:
        env = dict(BASE_ENV)
        env.update(req.get("env") or {})
        data = base64.b64decode(req["input"]) if req.get("input") is not None else None
        timeout = req.get("timeout")
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(
                req["argv"],
                stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                cwd=req.get("cwd") or "/",
                start_new_session=True,
            )
        except OSError as e:
            return {"rc": None, "stdout": "", "stderr": "", "timed_out": False, "error": f"{type(e).__name__}: {e}", "seconds": 0.0}
        timed_out = False
        try:
            out, err = proc.communicate(data, timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        return {
            "rc": None if timed_out else proc.returncode,
            "stdout": base64.b64encode(out).decode(),
            "stderr": base64.b64encode(err).decode(),
            "timed_out": timed_out,
            "error": None,
            "seconds": round(time.monotonic() - t0, 3),
        }

    def serve(self) -> None:
        self.send({"event": "ready", "boot_id": self.boot_id, "uptime": self.uptime()})
        buf = b""
        while True:
            chunk = os.read(self.fd, 65536)
            if not chunk:  # no host on the other end (yet, or any more): wait for one
                time.sleep(0.2)
                continue
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                try:
                    req = json.loads(line)
                except ValueError:
                    self.send({"id": None, "rc": None, "error": f"not JSON: {line[:200]!r}"})
                    continue
                threading.Thread(target=self.handle, args=(req,), daemon=True).start()


if __name__ == "__main__":
    Agent(sys.argv[1] if len(sys.argv) > 1 else "/dev/virtio-ports/org.bcd.agent").serve()
