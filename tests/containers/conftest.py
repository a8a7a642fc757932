"""Container suites: bcd's images (`make images`, deploy/images/build.sh) run as real
containers on the Docker engine. Ryuk (testcontainers' reaper) is off: its image
cannot be pulled here; every fixture removes what it started.

They skip, with the reason, only where no Docker engine answers. Where one does,
the images are built (cached by content: seconds when nothing changed) and a
build failure fails the suites.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

ROOT = Path(__file__).resolve().parents[2]
#: a cold build (debootstrap, wheels, image) took about 2 minutes here
BUILD_TIMEOUT_S = 1200


def docker_answers() -> str:
    """"" when a Docker engine answers, else why not."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "docker info did not answer in 20 s"
    if r.returncode != 0 or not r.stdout.strip():
        return f"no Docker engine answers (docker info: {(r.stderr or r.stdout).strip()[:200]})"
    return ""


@pytest.fixture(scope="session")
def bcd_image() -> str:
    """The image tag deploy/images/build.sh built (or found cached)."""
    why = docker_answers()
    if why:
        pytest.skip(why)
    r = subprocess.run([str(ROOT / "deploy/images/build.sh")], cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert r.returncode == 0, f"deploy/images/build.sh failed:\n{r.stderr[-4000:]}"
    return r.stdout.strip().splitlines()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

