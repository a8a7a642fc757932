"""The podman suite: a real container runtime reads the CDI specs a real node wrote.

It needs podman (Debian's 4.3.1: CDI library v0.5, the runtime that refused
every hold spec bcd wrote before the consumer copies), a static busybox for the
image, `unshare` and root (mknod for the stand-in device nodes, the private
mount namespace). Where one is missing the suite skips naming it; once
`.ci/run` installed podman (BCD_PODMAN_REQUIRED=1) a missing piece fails it
instead, so a green run cannot hide a suite that never ran.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import pytest

from .podmankit import MountPoints, Podman, static_busybox

REQUIRED = os.environ.get("BCD_PODMAN_REQUIRED") == "1"


def missing() -> str:
    """"" when podman can run here, else what is missing."""
    if os.geteuid() != 0:
        return "not root (the stand-in device nodes need mknod, the spec dirs a mount namespace)"
    for tool in ("podman", "unshare", "tar"):
        if shutil.which(tool) is None:
            return f"{tool} not found (Debian: apt-get install podman busybox-static)"
    if not static_busybox():
        return "no static busybox for the test image (Debian: busybox-static)"
    return ""


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    why = missing()
    if why:
        if REQUIRED:
            pytest.fail(f"BCD_PODMAN_REQUIRED=1 but {why}")
        pytest.skip(why)
    runtime = Podman(shutil.which("podman") or "podman", f"localhost/bcd-podman-test-{uuid.uuid4().hex[:8]}")
    runtime.build_image(static_busybox())
    points = MountPoints()
    points.ensure()
    try:
        yield runtime
    finally:
        points.remove()
        runtime.remove_image()
