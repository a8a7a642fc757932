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
