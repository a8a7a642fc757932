"""Which hold events must keep their order on the way upstream, and why.

docs/upstream.md promises a control plane the Released of a card before the
Bound that takes it (seed: releases come before binds, so a spec that moves
a GPU from one allocation to another in one generation works). Events that
name different cards have nothing to order: the converger journals a Bound
on another card in the same pipelined wave as the pass's Released events,
and the bridge forwards it while a Released is still unacknowledged. Both
decide it with `shares_gpu` on the cards of the events (an atom's card is the
`GPU-<uuid>` its id starts with); the converger puts them in the outbox
message's GPUS_HEADER so the bridge need not decode the signed body. A device
id that names no card, or a message without the header, counts as naming
every card: it keeps the strict order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: outbox message header: the cards (space-separated `GPU-<uuid>`) a bound/released event names.
GPUS_HEADER = "Bcd-Gpus"
#: cards named in one header at most; more, and the event counts as naming every card.
GPUS_HEADER_MAX = 64

_CARD = re.compile(r"GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\Z")

#: the cards of some devices; None: not known (counts as every card).
Cards = frozenset[str] | None


def gpus_of(devices: Iterable[str]) -> Cards:
    """The cards whole-GPU, MIG and slot atom ids name; None when one names no card."""
    cards = set()
    for device in devices:
        card = device.split("/", 1)[0]
        if not _CARD.match(card):
            return None
        cards.add("GPU-" + card[4:].lower())
    return frozenset(cards) if len(cards) <= GPUS_HEADER_MAX else None


def shares_gpu(a: Cards, b: Cards) -> bool:
    """Could the two name the same card? (Unknown is every card.)"""
    if a is None or b is None:
        return True
    return not a.isdisjoint(b)


def gpus_header(cards: Cards) -> dict[str, str]:
    """The header for an event naming `cards` (none when unknown or empty: the strict order holds)."""
    return {GPUS_HEADER: " ".join(sorted(cards))} if cards else {}


def cards_from_header(headers: dict[str, str] | None) -> Cards:
    """The cards a message's header names; None when absent or not well-formed."""
    value = (headers or {}).get(GPUS_HEADER)
    if value is None:
        return None
    cards = value.split()
    if len(cards) > GPUS_HEADER_MAX or not all(_CARD.match(c) for c in cards):
        return None
    return frozenset("GPU-" + c[4:].lower() for c in cards)


__all__ = ["GPUS_HEADER", "GPUS_HEADER_MAX", "Cards", "gpus_of", "shares_gpu", "gpus_header", "cards_from_header"]
