from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from .harness import NodeBus
from .kubelet_standin import KubeletStandIn


@pytest.fixture
async def node_bus(tmp_path):
    bus = NodeBus(tmp_path).start()
    try:
        yield bus
    finally:
        await bus.aclose()


@pytest.fixture
def node(tmp_path):
    """A whole node (`bcd up`) on a copy of the 8 x H200 fake host; suites with their own `node` override it."""
    from .wholenode import Node

    n = Node(tmp_path).start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory under /tmp: pytest's tmp_path can be too long for a unix socket path (108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="bcd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(short_dir: Path) -> AsyncIterator[KubeletStandIn]:
    """A kubelet stand-in serving <short_dir>/device-plugins/kubelet.sock (the kubelet dir is short_dir)."""
    async with KubeletStandIn(short_dir / "device-plugins") as k:
        yield k
