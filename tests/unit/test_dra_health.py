"""Unhealthy cards in the DRA plugin (issue 30), as tables: which taints a Healthy condition gives,
which cards are published tainted and which withdrawn, with device taints on and off (a healthy
card publishes exactly as before either way), the slices they make, binding conditions on a
tainted device, and the plugin's publish path against the API server stand-in with the
DRADeviceTaints gate on (taints kept) and off (dropped: the card is withdrawn at once)."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import msgspec
import pytest

from services.dra_plugin.binding import plan_binding
from services.dra_plugin.checkpoint import CheckpointStore
from services.dra_plugin.devices import (
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS,
    NO_EXECUTE,
    NO_SCHEDULE,
    TAINT_ECC,
    TAINT_GPU_LOST,
    TAINT_ROW_REMAP,
    TAINT_UNHEALTHY,
    TAINT_XID,
    DeviceTaint,
    health_taints,
    plan_pool,
    pool_content_key,
    ready_but_for_health,
    render_slices,
    taint_value,
)
from services.dra_plugin.kubeapi import ClusterApi
from services.dra_plugin.plugin import Calls, DraPlugin
from services.inventory import health as hl
from services.inventory.adapters.base import HealthCheck, HealthEvent
from shared.schemas import Claims, ClaimSummary, Condition, Gpu, Inventory, PhysicalGPUStatus
from tests.integration.kubeapi_standin import GATES_1_35_DEFAULT, KubeApiStandIn, validate_resource_slice

from .test_dra_devices import FREE, NODE, card, check_pool, claims, inventory, pci

SINCE = datetime(2026, 12, 3, 10, 0, 0, 250000, tzinfo=timezone.utc)
STAMP = "2026-12-03T10:00:00Z"
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def healthy(status: str, reason: str, message: str = "", since: datetime = SINCE) -> Condition:
    return Condition(type="Healthy", status=status, reason=reason, message=message, since=since)  # type: ignore[arg-type]


#: health.py's message: the worst fault's text, then "; also <Reason>: <text>" for each other one
XID79 = healthy("False", "XidCritical", "XID 79 (GPU has fallen off the bus) at 2026-12-03T10:00:00Z")
ADAPTER_READY = Condition(type="AdapterReady", status="True", reason="DriverLoaded", since=SINCE)
RECONFIGURING = Condition(type="Reconfiguring", status="True", reason="InProgress", since=SINCE)


def with_health(gpu: Gpu, cond: Condition | None, *, phase: str | None = None, extra: tuple[Condition, ...] = (ADAPTER_READY,), mode: str | None = None) -> Gpu:
    """The card with AdapterReady=True (as the inventory has it) and `cond` as its Healthy condition;
    the phase as the inventory derives it (Failed when Healthy=False) unless given."""
    st = gpu.status
    conds = [*extra, *([cond] if cond is not None else [])]
    sick = cond is not None and cond.status == "False"
    binding = st.driver_binding if mode is None else msgspec.structs.replace(st.driver_binding, mode=mode)
    status = PhysicalGPUStatus(phase=phase or ("Failed" if sick else st.phase), driver_binding=binding, conditions=conds)  # type: ignore[arg-type]
    return msgspec.structs.replace(gpu, status=status)


def taints(*items: tuple[str, str, str]) -> tuple[DeviceTaint, ...]:
    return tuple(DeviceTaint(key=k, value=v, effect=e, time_added=SINCE) for k, v, e in items)


# --------------------------------------------------------------------------- a condition's taints


@pytest.mark.parametrize(
    "cond, want",
    [
        pytest.param(None, (), id="no Healthy condition (an older inventory): nothing"),
        pytest.param(healthy("True", "Checked", "no fatal XID"), (), id="True/Checked: nothing"),
        pytest.param(healthy("Unknown", "Unmonitored", "health checks are off"), (), id="Unknown/Unmonitored: nothing"),
        pytest.param(healthy("Unknown", "NotChecked", "not checked yet"), (), id="Unknown/NotChecked: nothing"),
        pytest.param(XID79, taints((TAINT_XID, "79", NO_EXECUTE)), id="XidCritical: the XID number, NoExecute"),
        pytest.param(
            healthy("False", "XidCritical", "XidCritical: XID 79 (GPU has fallen off the bus) at 2026-12-03T10:00:00Z"),
            taints((TAINT_XID, "79", NO_EXECUTE)),
            id="an earlier inventory's message (the reason repeated): the same",
        ),
        pytest.param(healthy("False", "GpuLost", "the card stopped answering"), taints((TAINT_GPU_LOST, "GpuLost", NO_EXECUTE)), id="GpuLost"),
        pytest.param(healthy("False", "EccUncorrectable", "3 uncorrectable ECC errors"), taints((TAINT_ECC, "EccUncorrectable", NO_EXECUTE)), id="EccUncorrectable"),
        pytest.param(healthy("False", "RowRemapFailed", "a row could not be remapped"), taints((TAINT_ROW_REMAP, "RowRemapFailed", NO_EXECUTE)), id="RowRemapFailed"),
        pytest.param(healthy("False", "RowRemapPending", "remapped rows are pending"), taints((TAINT_ROW_REMAP, "RowRemapPending", NO_SCHEDULE)), id="RowRemapPending: NoSchedule"),
        pytest.param(healthy("False", "EccCorrectable", "40 correctable ECC errors"), taints((TAINT_ECC, "EccCorrectable", NO_SCHEDULE)), id="EccCorrectable: NoSchedule"),
        pytest.param(
            healthy("False", "GpuLost", "gone; also XidCritical: XID 48 (double-bit ECC error) at x; also RowRemapPending: reset it"),
            taints((TAINT_GPU_LOST, "GpuLost", NO_EXECUTE), (TAINT_XID, "48", NO_EXECUTE), (TAINT_ROW_REMAP, "RowRemapPending", NO_SCHEDULE)),
            id="every fault the message names, worst first",
        ),
        pytest.param(
            healthy("False", "GpuLost", "GpuLost: gone; XidCritical: XID 48 at x; RowRemapPending: reset it"),
            taints((TAINT_GPU_LOST, "GpuLost", NO_EXECUTE), (TAINT_XID, "48", NO_EXECUTE), (TAINT_ROW_REMAP, "RowRemapPending", NO_SCHEDULE)),
            id="every fault an earlier inventory's message names",
        ),
        pytest.param(
            healthy("False", "EccUncorrectable", "2 errors; also EccCorrectable: 40 errors"),
            taints((TAINT_ECC, "EccUncorrectable", NO_EXECUTE)),
            id="one taint a key: the worst (NoExecute) kept",
        ),
        pytest.param(healthy("False", "XidCritical", "XID -1 at 2026-12-03T10:00:00Z"), taints((TAINT_XID, "XidCritical", NO_EXECUTE)), id="an XID without a number: the reason"),
        pytest.param(healthy("False", "FanStopped", "a newer inventory's reason"), taints((TAINT_UNHEALTHY, "FanStopped", NO_EXECUTE)), id="an unknown reason: unhealthy, NoExecute"),
        pytest.param(
            healthy("False", "XidCritical", "XID 79 at x: vendor text; Unknown: thing; also Foo: bar"),
            taints((TAINT_XID, "79", NO_EXECUTE)),
            id="other words in the message: no taint",
        ),
    ],
)
def test_the_taints_of_a_healthy_condition(cond, want):
    got = health_taints(cond)
    assert got == want
    for t in got:
        api = t.to_api()
        assert api["timeAdded"] == STAMP and api["effect"] in (NO_SCHEDULE, NO_EXECUTE)
        assert len(api["value"]) <= 63 and _LABEL_VALUE.match(api["value"])


def _condition_from(faults: list[tuple[str, HealthEvent | HealthCheck]]) -> Condition:
    health = hl.CardHealth()
    policy = hl.HealthPolicy(ecc_correctable_max=10)
    for _, what in faults:
        if isinstance(what, HealthEvent):
            hl.apply_event(health, what, policy, "boot-1")
        else:
            hl.apply_check(health, what, policy, boot_id="boot-1", now=SINCE)
    return hl.healthy_condition(health, policy, now=SINCE + timedelta(minutes=5))


def test_the_inventory_s_own_conditions_give_the_taints_of_their_faults():
    """Against health.py's real messages, so a change of their format shows here."""
    p = pci(0)
    cond = _condition_from(
        [
            ("xid", HealthEvent(pci_address=p, kind="xid", at=SINCE, xid=79)),
            ("check", HealthCheck(pci_address=p, row_remap_pending=True, ecc_correctable=40)),
        ]
    )
    assert (cond.status, cond.reason, cond.since) == ("False", "XidCritical", SINCE)
    assert health_taints(cond) == taints((TAINT_XID, "79", NO_EXECUTE), (TAINT_ROW_REMAP, "RowRemapPending", NO_SCHEDULE), (TAINT_ECC, "EccCorrectable", NO_SCHEDULE))
    lost = _condition_from([("gone", HealthEvent(pci_address=p, kind="gone", at=SINCE))])
    assert health_taints(lost) == taints((TAINT_GPU_LOST, "GpuLost", NO_EXECUTE))
    clean = _condition_from([("check", HealthCheck(pci_address=p))])
    assert clean.status == "True" and health_taints(clean) == ()
    ignored = _condition_from([("app xid", HealthEvent(pci_address=p, kind="xid", at=SINCE, xid=43)), ("check", HealthCheck(pci_address=p))])
    assert health_taints(ignored) == ()


@pytest.mark.parametrize(
    "text, value",
    [("GpuLost", "GpuLost"), ("79", "79"), ("XID 79", "XID-79"), ("-1", "1"), ("..", ""), ("x" * 70, "x" * 63), ("a b_c.d-", "a-b_c.d")],
)
def test_taint_values_are_label_values(text, value):
    assert taint_value(text) == value and _LABEL_VALUE.match(value)


# --------------------------------------------------------------------------- which cards, tainted or withdrawn


def _plain(index: int = 0, **kw) -> Gpu:
    return card(index, **kw)


@pytest.mark.parametrize(
    "gpu, device_taints, published, tainted, why",
    [
        # nothing to do: healthy cards publish exactly as a card without a Healthy condition
        pytest.param(with_health(_plain(), healthy("True", "Checked")), True, True, (), "", id="healthy, taints on: as before"),
        pytest.param(with_health(_plain(), healthy("True", "Checked")), False, True, (), "", id="healthy, taints off: as before"),
        pytest.param(with_health(_plain(), healthy("Unknown", "Unmonitored", "checks off")), True, True, (), "", id="Unmonitored: published untainted"),
        pytest.param(with_health(_plain(), healthy("Unknown", "NotChecked", "not yet")), False, True, (), "", id="NotChecked: published untainted"),
        # unhealthy, would be Ready but for it
        pytest.param(with_health(_plain(), XID79), True, True, taints((TAINT_XID, "79", NO_EXECUTE)), "", id="XID 79, taints on: tainted"),
        pytest.param(with_health(_plain(), XID79), False, False, (), "phase Failed, not Ready: Healthy=False XidCritical: XID 79", id="XID 79, taints off: withdrawn"),
        pytest.param(
            with_health(_plain(), healthy("False", "RowRemapPending", "RowRemapPending: reset")),
            True,
            True,
            taints((TAINT_ROW_REMAP, "RowRemapPending", NO_SCHEDULE)),
            "",
            id="rows pending: NoSchedule",
        ),
        pytest.param(with_health(_plain(), XID79, phase="Ready"), True, True, taints((TAINT_XID, "79", NO_EXECUTE)), "", id="unhealthy though the phase says Ready"),
        pytest.param(with_health(_plain(), XID79, phase="Ready"), False, False, (), "Healthy=False XidCritical", id="unhealthy, Ready phase, taints off"),
        # not Ready for another reason as well: withdrawn whatever the taints
        pytest.param(with_health(_plain(), XID79, extra=(ADAPTER_READY, RECONFIGURING)), True, False, (), "phase Failed, not Ready: Healthy=False", id="unhealthy and Reconfiguring"),
        pytest.param(with_health(_plain(), XID79, extra=()), True, False, (), "phase Failed, not Ready", id="unhealthy, no AdapterReady"),
        pytest.param(
            with_health(_plain(), XID79, extra=(Condition(type="AdapterReady", status="False", reason="NoDriver", since=SINCE),)),
            True,
            False,
            (),
            "phase Failed",
            id="unhealthy, AdapterReady=False",
        ),
        pytest.param(with_health(_plain(binding_driver="vfio-pci"), XID79, mode="Passthrough", phase="Passthrough"), True, False, (), "phase Passthrough", id="unhealthy on vfio-pci"),
        pytest.param(with_health(_plain(state="Excluded"), XID79), True, False, (), "excluded from management", id="unhealthy and Excluded"),
        pytest.param(with_health(_plain(), healthy("True", "Checked"), phase="Failed"), True, False, (), "phase Failed, not Ready", id="Failed for another reason"),
        pytest.param(with_health(_plain(), None, phase="Initializing"), True, False, (), "phase Initializing, not Ready", id="Initializing"),
        pytest.param(with_health(_plain(), None, phase="Reconfiguring"), True, False, (), "phase Reconfiguring", id="Reconfiguring"),
    ],
)
def test_which_unhealthy_cards_are_tainted_and_which_withdrawn(gpu, device_taints, published, tainted, why):
    pool = plan_pool(inventory(gpu), FREE, device_taints=device_taints)
    assert bool(pool.devices) is published
    assert all(d.taints == tainted for d in pool.devices)
    if published:
        assert not pool.notes
        assert len(pool.tainted) == (1 if tainted else 0)
        if tainted:
            line = pool.tainted[0]
            assert line.startswith(f"{gpu.pci_address} gpu-0: published tainted ") and tainted[0].text() in line and "Healthy=False" in line
    else:
        assert len(pool.notes) == 1 and why in pool.notes[0] and not pool.tainted, pool.notes


def test_a_held_unhealthy_card_stays_withdrawn():
    pool = plan_pool(inventory(with_health(_plain(), XID79)), claims((0, "instance", "vm-1")), device_taints=True)
    assert not pool.devices and "held by instance vm-1" in pool.notes[0]


@pytest.mark.parametrize("device_taints", [True, False])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("binding", [True, False])
def test_a_healthy_card_publishes_exactly_as_before(device_taints, shared, binding):
    """The nothing-to-do row for every mode: the same devices, slices and content key as a card
    with no Healthy condition at all (before issue 30)."""
    kw = {"shared_cards": shared, "binding_conditions": binding}
    before = plan_pool(inventory(card(0), card(1, mig=True)), FREE, **kw)
    ok = healthy("True", "Checked", "no fatal XID")
    now = plan_pool(inventory(with_health(card(0), ok), with_health(card(1, mig=True), ok)), FREE, device_taints=device_taints, **kw)
    assert [d.to_api() for d in now.devices] == [d.to_api() for d in before.devices]
    assert pool_content_key(now) == pool_content_key(before) and now.notes == before.notes and now.tainted == ()
    assert render_slices(now, node_name=NODE, generation=3) == render_slices(before, node_name=NODE, generation=3)


def test_every_device_of_an_unhealthy_mig_card_is_tainted():
    pool = plan_pool(inventory(with_health(card(0, mig=True), XID79), card(1)), FREE, device_taints=True)
    mine = [d for d in pool.devices if d.pci == pci(0)]
    assert len(mine) == 19 and {d.kind for d in mine} == {"gpu", "mig"}
    assert all(d.taints == taints((TAINT_XID, "79", NO_EXECUTE)) for d in mine)
    assert [c.name for c in pool.counter_sets] == ["gpu-0-counters"], "its counters stay: its placements still consume them"
    assert pool.device("gpu-1").taints == ()
    assert [line.split(" ")[1] for line in pool.tainted] == ["gpu-0:"]
    slices = render_slices(pool, node_name=NODE, generation=2)
    check_pool(slices)
    for s in slices:
        for d in s["spec"].get("devices", []):
            want = [{"key": TAINT_XID, "value": "79", "effect": NO_EXECUTE, "timeAdded": STAMP}] if d["name"].startswith("gpu-0") else None
            assert d.get("taints") == want, d["name"]
        assert validate_resource_slice(s) == []


def test_an_unhealthy_shared_card_is_shared_and_tainted():
    pool = plan_pool(inventory(with_health(card(0), healthy("False", "EccCorrectable", "40 correctable ECC errors"))), FREE, shared_cards=True, device_taints=True)
    (d,) = pool.devices
    api = d.to_api()
    assert api["allowMultipleAllocations"] is True
    assert api["taints"] == [{"key": TAINT_ECC, "value": "EccCorrectable", "effect": NO_SCHEDULE, "timeAdded": STAMP}]


def test_a_naive_since_is_taken_as_utc():
    cond = healthy("False", "GpuLost", "the card stopped answering", since=datetime(2026, 12, 3, 10, 0, 0))
    assert health_taints(cond)[0].to_api()["timeAdded"] == STAMP


def test_ready_but_for_health_mirrors_the_phase_table():
    ok = with_health(card(0), XID79).status
    assert ready_but_for_health(ok)
    assert not ready_but_for_health(with_health(card(0), XID79, extra=()).status)
    assert not ready_but_for_health(with_health(card(0), XID79, extra=(ADAPTER_READY, RECONFIGURING)).status)
    assert not ready_but_for_health(with_health(card(0), XID79, mode="Passthrough").status)


# --------------------------------------------------------------------------- slices


def test_a_tainted_device_keeps_its_slice_to_64():
    """1.35: a slice with a tainted device holds 64 devices (ResourceSliceMaxDevicesWithTaintsOrConsumesCounters)."""
    gpus = [card(i) for i in range(200)]
    plain = render_slices(plan_pool(inventory(*gpus), FREE, device_taints=True), node_name=NODE, generation=1)
    assert [len(s["spec"]["devices"]) for s in plain] == [MAX_DEVICES_PER_SLICE, 200 - MAX_DEVICES_PER_SLICE]
    gpus[150] = with_health(gpus[150], XID79)
    pool = plan_pool(inventory(*gpus), FREE, device_taints=True)
    slices = render_slices(pool, node_name=NODE, generation=1)
    check_pool(slices)
    assert all(len(s["spec"]["devices"]) <= MAX_DEVICES_PER_SLICE_WITH_COUNTERS for s in slices)
    assert sum(len(s["spec"]["devices"]) for s in slices) == 200
    assert all(validate_resource_slice(s) == [] for s in slices)


def test_the_content_key_changes_when_a_card_is_tainted_and_when_its_taints_change():
    base = plan_pool(inventory(card(0)), FREE, device_taints=True)
    xid = plan_pool(inventory(with_health(card(0), XID79)), FREE, device_taints=True)
    other = plan_pool(inventory(with_health(card(0), healthy("False", "XidCritical", "XID 48 at x"))), FREE, device_taints=True)
    later = plan_pool(inventory(with_health(card(0), healthy("False", "XidCritical", XID79.message, since=SINCE + timedelta(hours=1)))), FREE, device_taints=True)
    assert len({pool_content_key(p) for p in (base, xid, other, later)}) == 4
    # the same fault read again (a later inventory revision) changes nothing
    again = plan_pool(inventory(with_health(card(0), XID79), revision=9), FREE, device_taints=True)
    assert pool_content_key(again) == pool_content_key(xid)


# --------------------------------------------------------------------------- binding conditions


def test_binding_fails_on_a_tainted_device():
    pool = plan_pool(inventory(with_health(card(0), XID79), card(1)), FREE, device_taints=True, binding_conditions=True)
    objs = [
        {
            "metadata": {"namespace": "ml", "name": name, "generation": 1},
            "status": {"allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.bcd.dev", "pool": NODE, "device": device}]}}},
        }
        for name, device in (("sick", "gpu-0"), ("well", "gpu-1"))
    ]
    got = {u.name: u for u in plan_binding(objs, driver="gpu.bcd.dev", pool_name=NODE, pool=pool, now=SINCE)}
    assert got["well"].set == (("gpu-1", "Ready"),)
    assert got["sick"].set == (("gpu-0", "BindingFailed"),)
    cond = got["sick"].body["status"]["devices"][0]["conditions"][0]
    assert cond["reason"] == "DeviceTainted" and "gpu.bcd.dev/xid=79:NoExecute" in cond["message"]


# --------------------------------------------------------------------------- the publish path against the stand-in


class Host:
    """What the plugin's calls read: an inventory that can change between refreshes."""

    def __init__(self, *gpus: Gpu) -> None:
        self.gpus = list(gpus)
        self.revision = 1

    async def inventory(self) -> Inventory:
        return Inventory(node_id=NODE, revision=self.revision, observed_at=SINCE, gpus=list(self.gpus))

    async def claims(self) -> Claims:
        return Claims(at=SINCE)

    async def holds(self) -> list[ClaimSummary]:
        return []

    def set(self, index: int, gpu: Gpu) -> None:
        self.gpus[index] = gpu
        self.revision += 1


async def _never(*_args):  # noqa: ANN002, ANN202
    raise AssertionError("not asked in this test")


def _healthy_host() -> Host:
    ok = healthy("True", "Checked", "no fatal XID")
    return Host(with_health(card(0), ok), with_health(card(1, mig=True), ok), with_health(card(2), ok))


async def _plugin(tmp_path: Path, server: KubeApiStandIn, host: Host) -> tuple[DraPlugin, ClusterApi]:
    server.add_node(NODE)
    api = ClusterApi(server.write_kubeconfig(tmp_path / "kubeconfig"), timeout=5)
    calls = Calls(prepare=_never, unprepare=_never, inventory=host.inventory, claims=host.claims, claim_holds=host.holds)
    return DraPlugin(tmp_path / "kubelet", "gpu.bcd.dev", NODE, calls, api, CheckpointStore(tmp_path / "state"), "boot-1"), api


def _devices(server: KubeApiStandIn) -> dict[str, dict]:
    return {d["name"]: d for s in server.slices("gpu.bcd.dev") for d in s["spec"].get("devices") or []}


def _gen(server: KubeApiStandIn) -> int:
    return server.slices("gpu.bcd.dev")[0]["spec"]["pool"]["generation"]


async def test_with_device_taints_kept_an_unhealthy_card_is_published_tainted(tmp_path):
    host = _healthy_host()
    with KubeApiStandIn() as server:
        plugin, api = await _plugin(tmp_path, server, host)
        try:
            await plugin.refresh()
            before = _devices(server)
            assert not any("taints" in d for d in before.values()) and plugin.device_taints
            generation = _gen(server)

            host.set(1, with_health(card(1, mig=True), XID79))
            await plugin.refresh()
            after = _devices(server)
            assert set(after) == set(before), "nothing withdrawn"
            want = [{"key": TAINT_XID, "value": "79", "effect": NO_EXECUTE, "timeAdded": STAMP}]
            assert {n for n, d in after.items() if d.get("taints") == want} == {n for n in after if n.startswith("gpu-1")}
            assert {n: d for n, d in after.items() if not n.startswith("gpu-1")} == {n: d for n, d in before.items() if not n.startswith("gpu-1")}
            assert _gen(server) == generation + 1 and server.check_pool("gpu.bcd.dev", NODE) == []
            st = plugin.status()
            assert st.device_taints is True and st.left_out == [] and pci(1) in st.cards
            assert [line.split(" ")[:4] for line in st.tainted] == [[pci(1), "gpu-1:", "published", "tainted"]]
            assert "gpu.bcd.dev/xid=79:NoExecute" in st.tainted[0] and "XID 79 (GPU has fallen off the bus)" in st.tainted[0]

            # read again, nothing changed: nothing written (timeAdded reads back as sent)
            writes = len(server.requests_to("PUT")) + len(server.requests_to("POST"))
            await plugin.refresh()
            assert len(server.requests_to("PUT")) + len(server.requests_to("POST")) == writes and _gen(server) == generation + 1

            # a reset and a clean recheck: the taints go
            host.set(1, with_health(card(1, mig=True), healthy("True", "Checked")))
            await plugin.refresh()
            assert _devices(server) == before and _gen(server) == generation + 2 and plugin.status().tainted == []
        finally:
            await api.close()


async def test_with_device_taints_dropped_an_unhealthy_card_is_withdrawn_at_once(tmp_path):
    """DRADeviceTaints off: the API server drops the taints without an error; the plugin sees it in
    what came back, withdraws the card in the same round, and says so in its status."""
    host = _healthy_host()
    with KubeApiStandIn(gates=GATES_1_35_DEFAULT) as server:
        plugin, api = await _plugin(tmp_path, server, host)
        plugin.mig_devices = plugin.shared_cards = False  # dropped too with these gates; not this test's point
        try:
            await plugin.refresh()
            before = _devices(server)
            assert plugin.device_taints is True, "no taint sent yet: nothing to see dropped"
            assert not any("DRADeviceTaints" in n for n in plugin.status().left_out)

            host.set(0, with_health(card(0), healthy("False", "EccUncorrectable", "3 uncorrectable ECC errors since the last reset")))
            await plugin.refresh()
            after = _devices(server)
            assert "gpu-0" not in after and {n: d for n, d in after.items()} == {n: d for n, d in before.items() if n != "gpu-0"}
            assert not any("taints" in d for d in after.values())
            assert plugin.device_taints is False and plugin.publisher.taints_dropped is False  # the second round sent none
            st = plugin.status()
            assert st.device_taints is False and st.tainted == [] and pci(0) not in st.cards
            assert "DRADeviceTaints" in st.left_out[0]
            (note,) = [n for n in st.left_out if n.startswith(pci(0))]
            assert "Healthy=False EccUncorrectable" in note and "device taints are off" in note
            assert server.check_pool("gpu.bcd.dev", NODE) == []

            # well again: published again, still without taints
            host.set(0, with_health(card(0), healthy("True", "Checked")))
            await plugin.refresh()
            assert _devices(server) == before
        finally:
            await api.close()


async def test_a_healthy_node_writes_the_same_slices_whether_taints_are_kept_or_dropped(tmp_path):
    got = []
    for gates in (None, GATES_1_35_DEFAULT):
        where = tmp_path / str(len(got))
        where.mkdir()
        with KubeApiStandIn(gates=gates) as server:
            plugin, api = await _plugin(where, server, _healthy_host())
            plugin.mig_devices = plugin.shared_cards = False
            try:
                await plugin.refresh()
                got.append([s["spec"] for s in server.slices("gpu.bcd.dev")])
                assert plugin.device_taints is True and not any("DRADeviceTaints" in n for n in plugin.status().left_out)
            finally:
                await api.close()
    assert got[0] == got[1]
