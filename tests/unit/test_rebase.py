"""A node above generation 2^53 - 1 brought back by its control plane (issue 41.5): the rules the
bridge, the converger and the control plane share (shared.schemas.takes_rebase, NodeSpec's
`rebase_from`, controlplane.state.rebase_target), pure. End to end: tests/integration/test_bcd_apply.py."""

from __future__ import annotations

import json

import pytest

from controlplane.specs import check_spec, signed_bytes, spec_json
from controlplane.state import ControlPlaneState, next_generation, rebase_target, record_rebase, reserve_generation
from shared.schemas import GENERATION_SAFE_MAX, NODE_SPEC_CODEC, BadMessage, NodeSpec, encode, takes_rebase

TOP = 2**63 - 1


def spec(generation: int, rebase_from: int | None = None) -> NodeSpec:
    return NodeSpec(node_id="node-1", generation=generation, rebase_from=rebase_from)


@pytest.mark.parametrize(
    ("generation", "rebase_from", "applied", "taken"),
    [
        pytest.param(6, TOP, TOP, True, id="the-rebase-of-the-applied-generation"),
        pytest.param(6, TOP, TOP - 1, False, id="a-rebase-of-another-generation-replayed"),
        pytest.param(6, None, TOP, False, id="a-lower-spec-without-rebase"),
        pytest.param(6, TOP, 7, False, id="a-rebase-naming-what-the-node-is-not-at"),
    ],
)
def test_a_node_takes_a_lower_generation_only_as_the_rebase_of_its_own(generation: int, rebase_from: int | None, applied: int, taken: bool) -> None:
    assert takes_rebase(spec(generation, rebase_from), applied) is taken


@pytest.mark.parametrize(
    ("generation", "rebase_from"),
    [pytest.param(GENERATION_SAFE_MAX + 1, TOP, id="to-above-the-bound"), pytest.param(3, GENERATION_SAFE_MAX, id="from-a-countable-generation")],
)
def test_a_rebase_goes_from_above_the_bound_to_at_or_below_it_or_does_not_decode(generation: int, rebase_from: int) -> None:
    with pytest.raises(BadMessage, match="rebase_from: a rebase goes from a generation above"):
        NODE_SPEC_CODEC.decode(encode({"node_id": "node-1", "generation": generation, "rebase_from": rebase_from}))


def test_a_put_never_carries_rebase_from_and_an_ordinary_spec_never_says_it() -> None:
    with pytest.raises(BadMessage, match="rebase_from is set by a rebase only"):
        check_spec(json.dumps({"node_id": "node-1", "rebase_from": TOP}))
    # a node of an earlier release does not know the field: an ordinary spec's JSON has none
    assert b"rebase_from" not in signed_bytes(check_spec(json.dumps({"node_id": "node-1"})), 5)
    assert b'"rebase_from":' + str(TOP).encode() in spec_json(spec(6, TOP))


def test_the_rebase_target_is_one_above_what_the_count_issued_and_the_count_goes_on_from_it() -> None:
    st = ControlPlaneState()
    assert rebase_target(st, "node-1", TOP) == 1  # a control plane that lost its state
    for g in (1, 2, 3, 5):
        reserve_generation(st, "node-1", g)
    reserve_generation(st, "node-1", TOP)
    target = rebase_target(st, "node-1", TOP)
    assert target == 6  # never issued: no earlier event id comes back
    record_rebase(st, "node-1", TOP, target)
    assert next_generation(st, "node-1", None, published=target) == (7, "")
    # both stay issued: holds bound at the top still report at it
    from controlplane.state import generation_issued

    assert generation_issued(st, "node-1", TOP) and generation_issued(st, "node-1", 6)


def test_the_count_never_crosses_2_53_minus_1_so_a_rebase_always_has_a_generation_left() -> None:
    """Seen from outside after the first fix: a put asked at 2^53 - 1, then the count went to 2^53,
    and `bcd rebase` said no generation was left. Requests stop at 2^52 (controlplane.specs), and the
    count stops at 2^53 - 1 (refused, saying so), so the highest issued generation at or below the
    bound is always below it while a node is above it."""
    from controlplane.specs import GENERATION_REQUEST_MAX
    from controlplane.state import GenerationExhausted

    assert GENERATION_REQUEST_MAX == 2**52 < GENERATION_SAFE_MAX
    with pytest.raises(BadMessage, match="above the largest a put may ask for"):
        check_spec({"node_id": "node-1", "generation": GENERATION_SAFE_MAX})
    st = ControlPlaneState()
    reserve_generation(st, "node-1", GENERATION_REQUEST_MAX)
    assert next_generation(st, "node-1", None) == (GENERATION_REQUEST_MAX + 1, "")
    reserve_generation(st, "node-1", GENERATION_SAFE_MAX)  # 2^52 puts later
    with pytest.raises(GenerationExhausted, match="the last a control plane counts to"):
        next_generation(st, "node-1", None)
    # a node put above the bound elsewhere still has somewhere to go back to
    st = ControlPlaneState()
    reserve_generation(st, "node-1", GENERATION_REQUEST_MAX)
    reserve_generation(st, "node-1", TOP)
    assert rebase_target(st, "node-1", TOP) == GENERATION_REQUEST_MAX + 1
