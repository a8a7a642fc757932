"""facts.py: one MIG lock per card for every room, the cards the last inventory lists, and whether health is watched."""

from __future__ import annotations

from pathlib import Path

from services.inventory.health import HealthPolicy

from .rig import MIG_CARD, NOT_LISTED, WHOLE, facts, host, scan


def test_each_card_has_one_mig_lock_for_all_rooms(tmp_path: Path) -> None:
    f = facts(tmp_path, None)
    assert f.mig_lock(WHOLE) is f.mig_lock(WHOLE)
    assert f.mig_lock(WHOLE) is not f.mig_lock(MIG_CARD)


def test_a_card_is_listed_only_by_the_last_inventory(tmp_path: Path) -> None:
    adapter = host(tmp_path)
    f = facts(tmp_path, adapter)
    assert not f.listed(WHOLE) and f.card(WHOLE) is None  # nothing published yet
    f.current = scan(adapter)
    assert f.listed(WHOLE) and f.card(WHOLE).pci_address == WHOLE  # type: ignore[union-attr]
    assert not f.listed(NOT_LISTED) and f.card(NOT_LISTED) is None and f.card(None) is None


def test_health_is_watched_only_when_on_and_the_adapter_can(tmp_path: Path) -> None:
    adapter = host(tmp_path)
    assert facts(tmp_path, adapter).watching()
    assert not facts(tmp_path, adapter, policy=HealthPolicy(enabled=False)).watching()
    assert not facts(tmp_path, object()).watching()
