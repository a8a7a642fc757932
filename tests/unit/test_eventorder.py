"""shared.eventorder: which Bound must wait for which Released (by the cards they name)."""

from __future__ import annotations

import pytest

from shared.eventorder import GPUS_HEADER, GPUS_HEADER_MAX, cards_from_header, gpus_header, gpus_of, shares_gpu

A = "GPU-5f1c2a90-0000-4000-8000-000000000001"
B = "GPU-5f1c2a90-0000-4000-8000-000000000002"


@pytest.mark.parametrize(
    ("devices", "cards"),
    [
        ([], frozenset()),
        ([A], frozenset({A})),
        ([f"{A}/gi1/ci0", f"{A}/slot3"], frozenset({A})),  # MIG and slot atoms name their card
        ([A, f"{B}/slot0"], frozenset({A, B})),
        ([A.upper().replace("GPU-", "GPU-")], frozenset({A})),  # the uuid's case does not matter
        ([A, "nic.vf/0000:01:00.1"], None),  # names no card: every card
        (["GPU-not-a-uuid"], None),
        ([f"GPU-{k:08x}-0000-4000-8000-000000000000" for k in range(GPUS_HEADER_MAX + 1)], None),
    ],
)
def test_the_cards_of_some_devices(devices, cards) -> None:
    assert gpus_of(devices) == cards


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [
        (frozenset({A}), frozenset({B}), False),  # nothing to order
        (frozenset({A}), frozenset({A, B}), True),
        (frozenset(), frozenset({A}), False),
        (None, frozenset({A}), True),  # unknown is every card
        (frozenset({A}), None, True),
        (None, None, True),
    ],
)
def test_shares_gpu(a, b, shared) -> None:
    assert shares_gpu(a, b) is shared


def test_the_header_round_trips_and_a_bad_or_missing_one_is_every_card() -> None:
    cards = frozenset({A, B})
    assert cards_from_header(gpus_header(cards)) == cards
    assert gpus_header(None) == {} and gpus_header(frozenset()) == {}
    assert cards_from_header({}) is None and cards_from_header(None) is None
    assert cards_from_header({GPUS_HEADER: f"{A} bogus"}) is None
    assert cards_from_header({GPUS_HEADER: " ".join([A] * (GPUS_HEADER_MAX + 1))}) is None
