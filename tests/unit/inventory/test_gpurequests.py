"""gpurequests.py alone, with a fake publisher and fake health checks (no bus, no app): the `gpu`
request's refusals (not a PCI address, no such card, the host not scanned, the intent not recorded),
the intent recorded before the evaluation, and a recheck that keeps a held card's sticky faults
(claims not known count as held)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.inventory.gpurequests import GpuRequests
from services.inventory.gpustate import StateFileError
from services.inventory.health import HealthPolicy
from shared.runtime import Refused
from shared.schemas import Claims, GpuClaim, GpuRequest, Inventory

from .rig import NOT_LISTED, NOW, WHOLE, Log, facts, host, scan

FREE = Claims(at=NOW)
HELD = Claims(at=NOW, claims=[GpuClaim(pci_address=WHOLE, kind="allocation", holder="a1")])


class Publisher:
    """The parts of publishing.py's Publisher a request uses; the evaluation is the tracker's own."""

    def __init__(self, facts_: Any, base: Inventory | None, claims: Claims | None = FREE, *, unsaved: str = "") -> None:
        self.facts = facts_
        self.base = base
        self.claims = claims
        self.unsaved = unsaved
        self.calls: list[Any] = []

    async def fetch_claims(self) -> Claims | None:
        self.calls.append("claims")
        return self.claims

    async def scan(self, reason: str) -> Inventory | None:
        self.calls.append(("scan", reason))
        return self.base

    def save(self, *, strict: bool = False) -> None:
        self.calls.append(("save", strict))
        if self.unsaved and strict:
            raise StateFileError(self.unsaved)

    async def evaluate_and_publish(self, base: Inventory, claims: Claims | None, reason: str, **kw: Any) -> Inventory:
        self.calls.append(("publish", reason))
        inv = self.facts.tracker.evaluate(base, claims, known=self.facts.current).inventory
        self.facts.current = inv
        return inv


class Checks:
    def __init__(self, answer: tuple[bool, str, list[str]] = (True, "", [])) -> None:
        self.answer = answer
        self.asked: list[tuple[str, bool]] = []

    async def recheck(self, pci: str, *, clear: bool = True) -> tuple[bool, str, list[str]]:
        self.asked.append((pci, clear))
        return self.answer


def room(tmp_path: Path, *, adapter: Any = None, scanned: bool = True, claims: Claims | None = FREE, unsaved: str = "", policy: HealthPolicy | None = None, checks: Checks | None = None) -> tuple[GpuRequests, Publisher, Log]:
    adapter = adapter if adapter is not None else host(tmp_path)
    base = scan(adapter)
    f = facts(tmp_path, adapter, current=base, policy=policy)
    pub = Publisher(f, base if scanned else None, claims, unsaved=unsaved)
    log = Log()
    return GpuRequests(f, publisher=pub, checks=checks or Checks(), adapter_name="fakehw", log=log), pub, log  # type: ignore[arg-type]


async def test_an_address_that_is_not_canonical_is_refused_before_anything_is_asked(tmp_path: Path) -> None:
    requests, pub, log = room(tmp_path)
    reply = await requests.request(GpuRequest(action="exclude", pci="0000:18:00.0 "))
    assert not reply.accepted and "is not a canonical PCI address" in reply.message
    assert pub.calls == []
    assert [kw["reason"] for _, kw in log.said("gpu request refused")] == [reply.message]


async def test_a_host_that_cannot_be_scanned_is_refused_with_503(tmp_path: Path) -> None:
    requests, _, _ = room(tmp_path, scanned=False)
    with pytest.raises(Refused) as caught:
        await requests.request(GpuRequest(action="exclude", pci=WHOLE))
    assert caught.value.code == "503"


async def test_a_card_this_node_does_not_list_is_refused(tmp_path: Path) -> None:
    requests, pub, _ = room(tmp_path)
    reply = await requests.request(GpuRequest(action="reclaim", pci=NOT_LISTED))
    assert (reply.accepted, reply.message) == (False, f"no GPU at {NOT_LISTED} in this node's inventory")
    assert ("save", True) not in pub.calls and ("publish", "gpu reclaim") not in pub.calls


async def test_an_excluded_card_gone_from_the_host_may_still_be_included(tmp_path: Path) -> None:
    requests, pub, _ = room(tmp_path)
    requests.facts.tracker.exclude(NOT_LISTED)
    reply = await requests.request(GpuRequest(action="include", pci=NOT_LISTED))
    assert reply.accepted and reply.message.startswith("exclusion lifted; managementState is ")
    assert pub.calls == ["claims", ("scan", "gpu include"), ("save", True), ("publish", "gpu include")]


async def test_an_exclusion_is_recorded_before_it_is_evaluated_and_said_once(tmp_path: Path) -> None:
    requests, pub, log = room(tmp_path)
    reply = await requests.request(GpuRequest(action="exclude", pci=WHOLE))
    state = reply.gpu.status.driver_binding.management_state  # type: ignore[union-attr]
    assert (reply.accepted, reply.message) == (True, f"excluded; managementState is {state}")
    assert pub.calls.index(("save", True)) < pub.calls.index(("publish", "gpu exclude"))
    pub.calls.clear()
    again = await requests.request(GpuRequest(action="exclude", pci=WHOLE))
    assert again.accepted and again.message.startswith("already excluded; ")
    assert ("save", True) not in pub.calls  # nothing new to record
    assert [kw["accepted"] for _, kw in log.said("gpu request")] == [True, True]


async def test_a_request_that_cannot_be_recorded_is_refused_and_forgotten(tmp_path: Path) -> None:
    requests, pub, _ = room(tmp_path, unsaved="disk full")
    reply = await requests.request(GpuRequest(action="exclude", pci=WHOLE))
    assert (reply.accepted, reply.message) == (False, "cannot record the request: disk full")
    record = requests.facts.tracker.card(WHOLE)
    assert record is None or not record.excluded  # the tracker is as before the request
    assert ("publish", "gpu exclude") not in pub.calls


async def test_a_recheck_with_health_checks_off_or_an_adapter_that_cannot_watch_is_refused(tmp_path: Path) -> None:
    checks = Checks()
    off, _, _ = room(tmp_path, policy=HealthPolicy(enabled=False), checks=checks)
    reply = await off.request(GpuRequest(action="recheck", pci=WHOLE))
    assert (reply.accepted, reply.message) == (False, "not checked: health checks are off (--health-checks off)")

    class Blind:
        """An adapter that lists cards but cannot watch their health."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            if name in ("open_health_watch", "wait_health_events", "check_health", "close_health_watch"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    blind, _, _ = room(tmp_path, adapter=Blind(host(tmp_path)), checks=checks)
    reply = await blind.request(GpuRequest(action="recheck", pci=WHOLE))
    assert (reply.accepted, reply.message) == (False, "not checked: the fakehw adapter cannot watch GPU health")
    assert checks.asked == []


@pytest.mark.parametrize(("claims", "clear"), [(FREE, True), (HELD, False), (None, False)], ids=["free", "held", "claims-unknown"])
async def test_a_recheck_clears_sticky_faults_only_on_a_card_known_free(tmp_path: Path, claims: Claims | None, clear: bool) -> None:
    checks = Checks()
    requests, pub, _ = room(tmp_path, claims=claims, checks=checks)
    reply = await requests.request(GpuRequest(action="recheck", pci=WHOLE))
    assert checks.asked == [(WHOLE, clear)]
    assert reply.message.startswith("nothing cleared; ")  # no sticky fault to keep or clear
    assert pub.calls[-2:] == [("save", True), ("publish", "gpu recheck")]


async def test_a_recheck_the_library_cannot_make_is_refused(tmp_path: Path) -> None:
    requests, pub, _ = room(tmp_path, checks=Checks((False, "the vendor library does not answer: gone", [])))
    reply = await requests.request(GpuRequest(action="recheck", pci=WHOLE))
    assert (reply.accepted, reply.message) == (False, "not checked: the vendor library does not answer: gone")
    assert ("save", True) not in pub.calls
