"""Strict specs at the edges people type: every unknown field named with its path, a did-you-mean,
the same check in `bcd apply` and the control plane's put (`check_spec`), and the node's condition."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import msgspec
import pytest

from controlplane.specs import check_spec
from services.converger.model import ConvergerState, Observed, PlanConfig, SetCondition
from services.converger.plan import plan
from shared.schemas import BadMessage, NodeSpec
from shared.schemas.strict import UNKNOWN_FIELDS_CONDITION, UnknownField, UnknownFieldsError, check_known_fields, unknown_fields, unknown_fields_of_json

GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"


def hold(**extra) -> dict:
    return {"allocation_id": "a1", "reservation_id": "rsv-a1", "binding": "BINDING_HOLD", "devices": [GPU0], **extra}


def spec(*devices: dict, **extra) -> dict:
    return {"node_id": "node-1", "devices": list(devices), **extra}


CASES = [
    pytest.param(spec(hold()), [], id="valid-spec-passes"),
    pytest.param(spec(hold(limits={"cpus": "0-3", "memory_bytes": 1, "hugepages": [{"page_size_kib": 2048, "count": 1}]})), [], id="valid-nested-passes"),
    pytest.param(spec(hold(limit={"cpus": "0-3"})), [UnknownField("$.devices[0].limit", "limits")], id="typo-limit-for-limits"),
    pytest.param(spec(hold(priority=3)), [UnknownField("$.devices[0].priority")], id="unknown-no-suggestion"),
    pytest.param(spec(hold(), devicez=[]), [UnknownField("$.devicez", "devices")], id="top-level-unknown"),
    pytest.param(
        spec(hold(limits={"cpu": "0-3", "hugepages": [{"page_size_kib": 2048, "count": 1, "size": 1}]})),
        [UnknownField("$.devices[0].limits.cpu", "cpus"), UnknownField("$.devices[0].limits.hugepages[0].size")],
        id="nested-unknown",
    ),
    pytest.param(
        spec(hold(), hold(allocation_id="a2", reservation_id="rsv-a2", Env=["A=1"])),
        [UnknownField("$.devices[1].Env", "env")],
        id="case-differs",
    ),
    pytest.param(spec(instances=[{"instance_id": "vm1", "gpu": []}]), [UnknownField("$.instances[0].gpu", "gpus")], id="instances"),
    pytest.param({"node_id": "node-1", "a b": 1}, [UnknownField('$["a b"]')], id="odd-key-quoted"),
    # values are the decoder's to judge, not this check's
    pytest.param(spec(hold(limits=None), devices="not a list"), [], id="wrong-types-left-to-the-decoder"),
]


@pytest.mark.parametrize(("doc", "expected"), CASES)
def test_unknown_fields_table(doc: dict, expected: list[UnknownField]) -> None:
    assert unknown_fields(NodeSpec, doc) == expected


def test_the_message_names_the_path_and_the_suggestion() -> None:
    assert str(UnknownField("$.devices[0].limit", "limits")) == '$.devices[0].limit: unknown field (did you mean "limits"?)'
    assert str(UnknownField("$.devices[0].priority")) == "$.devices[0].priority: unknown field"
    with pytest.raises(UnknownFieldsError) as info:
        check_known_fields(NodeSpec, spec(hold(limit={}, priority=1), devicez=[]))
    err = info.value
    assert isinstance(err, BadMessage)  # every caller that refuses a bad spec refuses this one too
    assert [f.path for f in err.fields] == ["$.devices[0].limit", "$.devices[0].priority", "$.devicez"]
    assert str(err).startswith("spec: 3 unknown fields: ")
    assert '$.devices[0].limit: unknown field (did you mean "limits"?)' in str(err)


def test_the_check_follows_the_schema_by_itself() -> None:
    """No list of names to keep in sync: every field NodeSpec declares (nested too) is known."""
    full = msgspec.to_builtins(
        NodeSpec(node_id="n", generation=1),
    )
    assert unknown_fields(NodeSpec, full) == []
    encoded = json.loads(
        b'{"node_id":"n","generation":3,"devices":[{"allocation_id":"a","reservation_id":"r","binding":"BINDING_HOLD","instance_id":"",'
        b'"devices":[],"limits":{"cpus":"0","cpu_millis":null,"memory_bytes":1,"hugepages":[{"page_size_kib":4,"count":1}],"mems":"0"},'
        b'"env":[]}],"instances":[{"instance_id":"i","gpus":[]}]}'
    )
    assert unknown_fields(NodeSpec, encoded) == []


@pytest.mark.parametrize(
    ("doc", "allow", "refused"),
    [
        pytest.param(spec(hold(limit={})), False, True, id="refused-by-default"),
        pytest.param(spec(hold(limit={})), True, False, id="allowed-with-the-flag"),
        pytest.param(spec(hold()), False, False, id="valid-spec"),
    ],
)
def test_check_spec_is_the_put_edge(doc: dict, allow: bool, refused: bool) -> None:
    if refused:
        with pytest.raises(UnknownFieldsError, match=r'\$\.devices\[0\]\.limit: unknown field \(did you mean "limits"\?\)'):
            check_spec(json.dumps(doc).encode(), allow_unknown_fields=allow)
        return
    checked = check_spec(json.dumps(doc).encode(), allow_unknown_fields=allow)
    assert checked.draft.node_id == "node-1"
    assert [f.path for f in checked.unknown] == (["$.devices[0].limit"] if allow else [])


def test_unknown_fields_come_before_the_schema_and_a_bad_value_is_still_named() -> None:
    with pytest.raises(UnknownFieldsError):
        check_spec(spec(hold(allocation_id="Bad/Id", limit={})))
    with pytest.raises(BadMessage, match=r"\$\.devices\[0\]\.allocation_id"):
        check_spec(spec(hold(allocation_id="Bad/Id")))


def test_unknown_fields_of_json_reads_behind_the_bounds() -> None:
    assert [f.path for f in unknown_fields_of_json(NodeSpec, json.dumps(spec(hold(x=1))))] == ["$.devices[0].x"]
    assert unknown_fields_of_json(NodeSpec, b"\xff{") == []
    assert unknown_fields_of_json(NodeSpec, b"[" * 10_000) == []


# ------------------------------------------------------------------ the node's condition, once per generation

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)


def _conditions(generation: int, unknown: tuple[str, ...], state: ConvergerState, now: datetime = NOW) -> list:
    observed = Observed(state=state, spec_unknown_fields=unknown, now=now)
    p = plan(NodeSpec(node_id="node-1", generation=generation), observed, PlanConfig(node_id="node-1"))
    return [s.condition for s in p.steps if isinstance(s, SetCondition) and s.condition.type == UNKNOWN_FIELDS_CONDITION]


def test_the_condition_is_raised_once_per_generation_and_cleared() -> None:
    state = ConvergerState()
    fields = ('$.devices[0].limit: unknown field (did you mean "limits"?)', "$.devicez: unknown field")
    [raised] = _conditions(3, fields, state)
    assert (raised.status, raised.reason) == ("True", "UnknownFields")
    assert raised.message.startswith("generation 3: 2 fields this node does not know, ignored: ")
    assert fields[0] in raised.message and fields[1] in raised.message
    state.conditions[raised.type] = raised
    # the same generation again (a retry, the drift pass): nothing new
    assert _conditions(3, fields, state, NOW + timedelta(minutes=1)) == []
    # a later generation with the same fields is reported again, as a new event (a new `since`)
    [again] = _conditions(4, fields, state, NOW + timedelta(minutes=2))
    assert again.message.startswith("generation 4:") and again.since != raised.since
    state.conditions[again.type] = again
    # a generation without any clears it, once
    [cleared] = _conditions(5, (), state, NOW + timedelta(minutes=3))
    assert (cleared.status, cleared.reason) == ("False", "NoUnknownFields")
    state.conditions[cleared.type] = cleared
    assert _conditions(6, (), state, NOW + timedelta(minutes=4)) == []
    # a node that never saw one raises nothing
    assert _conditions(1, (), ConvergerState()) == []


def test_the_condition_message_stays_within_its_bound() -> None:
    fields = tuple(f"$.devices[{i}].priority: unknown field" for i in range(1024))
    [raised] = _conditions(7, fields, ConvergerState())
    assert len(raised.message) <= 4096
    assert raised.message.endswith("more")


def test_status_and_doctor_show_the_condition_while_it_holds() -> None:
    from bcd.status import NodeReport, doctor_checks, problems, render_status
    from shared.jsutil import StreamDepth
    from shared.schemas import Condition, ConvergerStatus, SectionStatus
    from tests.converger_kit import host_inventory

    def report(*conds: Condition) -> NodeReport:
        services = ["converger", "gateway_bridge"]
        return NodeReport(
            node_id="node-1",
            reachable=True,
            expected=services,
            services={n: {"name": n, "metadata": {"cp_keys": "1"}} for n in services},
            inventory=host_inventory(),
            converger=ConvergerStatus(
                generation=3,
                section=SectionStatus(section="devices", state="CONVERGED", observed_generation=3),
                vendor_cdi_spec="/etc/cdi/nvidia.json",
                conditions=list(conds),
            ),
            outbox=StreamDepth(messages=0, bytes=0, oldest=None),
            now=NOW,
        )

    message = "generation 3: 1 field this node does not know, ignored: $.devicez: unknown field"
    raised = Condition(type=UNKNOWN_FIELDS_CONDITION, status="True", reason="UnknownFields", message=message, since=NOW)
    r = report(raised)
    assert ("warn", "spec-fields", f"NodeSpecUnknownFields (UnknownFields): {message}") in doctor_checks(r)
    assert f"  condition NodeSpecUnknownFields: UnknownFields: {message}" in render_status(r).splitlines()
    assert problems(r) == []  # a warning, not ill health
    cleared = msgspec.structs.replace(raised, status="False", reason="NoUnknownFields", message="generation 4: every field of the spec is known")
    r = report(cleared)
    assert not [c for c in doctor_checks(r) if c[1] == "spec-fields"]
    assert "NodeSpecUnknownFields" not in render_status(r)
