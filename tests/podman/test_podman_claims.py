"""Debian 12's podman 4.3.1 uses the CDI specs of DRA claims that share or pass through a card.

A claim's spec is written by the converger from `shared.holdfiles` (the same builder as every
hold; tests/integration/test_dra_sharing.py drives the node that writes them). Here those bytes,
and their consumer copy, are what podman reads: a claim with an MPS daemon of its own (a share
of a card: its CDI name carries the share id) runs a container that finds the daemon's control
pipe, its log directory and the daemon's own shm directory as its /dev/shm (and nothing of the
host's /dev/shm), with CUDA_MPS_PIPE_DIRECTORY set; a claim that
passes a card through gets its IOMMU group's node and /dev/vfio/vfio, and no nvidia device.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.holdfiles import (
    BINDING_CLAIM,
    HoldContent,
    HoldDevice,
    claim_hold_id,
    claim_mps_pipe_dir,
    consumer_file_bytes,
    hold_file_bytes,
)
from tests.integration.wholenode import GPU

from .podmankit import HostStubs, Podman

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

UID = "0b6f4a39-1c1e-4d6b-9a53-0123456789ab"
CONTROL = f"{UID}-0a1b2c"
SHARE_ID = "7d2e9c1a-5b3f-4e8d-9a61-0c4b2f7e8d19"
IOMMU_GROUP = 4093  # no host has this many: the node is this test's own stand-in


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path, Path]]:
    """(etc/cdi, var/run/cdi, the MPS root) of a scratch host."""
    d = Path(tempfile.mkdtemp(prefix="bcd-podman-claims-"))
    try:
        etc, run, mps = d / "etc-cdi", d / "run-cdi", d / "mps"
        for p in (etc, run, mps):
            p.mkdir()
        yield etc, run, mps
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _write(hold: HoldContent, etc: Path, run: Path) -> dict:
    data = hold_file_bytes("cdi", hold, None)
    name = f"bcd-{hold.allocation_id}.json"
    (etc / name).write_bytes(data)
    (run / name).write_bytes(consumer_file_bytes(hold.allocation_id, data))
    return json.loads(data)


def _env(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_a_claims_mps_daemon_reaches_its_container(podman: Podman, dirs: tuple[Path, Path, Path]) -> None:
    etc, run, mps = dirs
    pipe = Path(claim_mps_pipe_dir(mps, CONTROL))
    log = pipe.parent / "log"
    daemon_shm = pipe.parent / "shm"
    pipe.mkdir(parents=True)
    log.mkdir()
    daemon_shm.mkdir()
    os.mkfifo(pipe / "control")  # what nvidia-cuda-mps-control -d makes
    (log / "control.log").write_text("")
    (daemon_shm / "cuda.shm.0").write_text("")  # what the daemon's server puts in its /dev/shm
    # another tenant's shared memory in the host's /dev/shm: never the claim's to see
    shm = Path(tempfile.mkstemp(prefix="bcd-podman-claim-mps-", dir="/dev/shm")[1])
    device = HoldDevice(GPU[0], "gpu", GPU[0], 0, GPU[0], (GPU[0], "0"), share_id=SHARE_ID)
    alloc = claim_hold_id(UID)
    try:
        spec = _write(
            HoldContent(alloc, alloc, 0, BINDING_CLAIM, (device,), mps_pipe_dir=str(pipe), mps_control=CONTROL), etc, run
        )
        assert [d["name"] for d in spec["devices"]] == [f"{GPU[0]}_{SHARE_ID}"]
        script = (
            'test -p "$CUDA_MPS_PIPE_DIRECTORY/control" || echo "MISSING pipe"; '
            f'test -e {log}/control.log || echo "MISSING log"; touch {log}/planted 2>/dev/null && echo "HOST log writable"; '
            'test -e /dev/shm/cuda.shm.0 || echo "MISSING shm"; '
            f'test -e /dev/shm/{shm.name} && echo "HOST shm"; echo ===ENV; env'
        )
        r = podman.run(["podman", "run", "--device", f"bcd.dev/gpu={GPU[0]}_{SHARE_ID}"], script, etc, run)
        assert r.returncode == 0, f"podman exited {r.returncode}\n{r.stderr}\n{r.stdout}"
        before, _, env = r.stdout.partition("===ENV\n")
        assert "MISSING" not in before and "HOST" not in before, before
        assert not (log / "planted").exists()
        assert _env(env)["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
        assert _env(env)["NVIDIA_VISIBLE_DEVICES"] == GPU[0]
        # the card's own name (no share id) is no device of this spec
        r = podman.run(["podman", "run", "--device", f"bcd.dev/gpu={GPU[0]}"], "true", etc, run)
        assert r.returncode != 0 and "unresolvable CDI devices" in r.stderr, r.stderr
    finally:
        shm.unlink(missing_ok=True)


def test_a_passed_through_card_is_its_vfio_nodes_and_no_nvidia_device(podman: Podman, dirs: tuple[Path, Path, Path]) -> None:
    etc, run, _ = dirs
    alloc = claim_hold_id(UID)
    spec = _write(HoldContent(alloc, alloc, 0, BINDING_CLAIM, (HoldDevice.for_vfio(GPU[1], 1, IOMMU_GROUP),)), etc, run)
    stubs = HostStubs()
    stubs.cover([spec])
    try:
        script = f'test -c /dev/vfio/{IOMMU_GROUP} || echo "MISSING group"; test -c /dev/vfio/vfio || echo "MISSING vfio"; ls /dev; echo ===ENV; env'
        r = podman.run(["podman", "run", "--device", f"bcd.dev/gpu={GPU[1]}"], script, etc, run)
        assert r.returncode == 0, f"podman exited {r.returncode}\n{r.stderr}\n{r.stdout}"
        before, _, env = r.stdout.partition("===ENV\n")
        assert "MISSING" not in before, before
        assert not [n for n in before.split() if n.startswith("nvidia")], before
        assert _env(env)["NVIDIA_VISIBLE_DEVICES"] == "void"
    finally:
        stubs.remove()
