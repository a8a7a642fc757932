from __future__ import annotations

import pytest

from .harness import NodeBus


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
