"""Event ids: a replay keeps its id, a different event gets another (upstream dedupes by id)."""

from __future__ import annotations

from datetime import datetime, timezone

from shared.eventids import condition_id
from shared.schemas import Condition
from shared.schemas.common import EVENT_ID_PATTERN

import re

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def cond(message: str, status: str = "True", reason: str = "PodsHoldDevices", since: datetime = T0) -> Condition:
    return Condition(type="KubernetesReleaseStuck", status=status, reason=reason, message=message, since=since)  # type: ignore[arg-type]


def test_condition_ids() -> None:
    a = cond("pods still hold the devices of k1")
    rows = [
        # (other, same id?)
        (cond("pods still hold the devices of k1"), True),  # the same condition, replayed
        (cond("pods still hold the devices of k1, k2"), False),  # same status and since, new message: a new event
        (cond("pods still hold the devices of k1", reason="Other"), False),
        (cond("pods still hold the devices of k1", status="False"), False),
        (cond("pods still hold the devices of k1", since=datetime(2026, 1, 2, tzinfo=timezone.utc)), False),
    ]
    for other, same in rows:
        assert (condition_id("node-1", other) == condition_id("node-1", a)) is same, other
    assert re.search(EVENT_ID_PATTERN, condition_id("node-1", a))
