"""Every integer has the range the contract says, enforced at decode, and every reader takes what its writer writes (issue 28.2).

Before, `"generation": 10000000000000000000` decoded (msgspec makes a Python
int of any JSON number), the hold bound, and its spec's `bcd.dev/generation`
annotation was then refused by the hold reader (19 digits at most): the card
showed Unclaimed, doctor said ok, and every later put was bumped above it. Now:

- every integer field of every schema is an int64 at most (a Go control plane
  typing it int64 reads every value bcd sends or takes), a walk over every
  Struct proves it;
- a table holds each writer and its reader together at the largest value the
  writer can write (accepted all the way) and one above (refused at decode):
  the spec's generation and limits, the hold spec's annotations, the root
  helper's request, the events;
- the reference control plane refuses to put a generation past the largest.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest

import shared.schemas.bus
import shared.schemas.common
import shared.schemas.events
import shared.schemas.inventory
import shared.schemas.nodespec
from controlplane.state import ControlPlaneState, GenerationExhausted, next_generation
from shared.holdfiles import HoldContent, HoldDevice, NotAHold, build_cdi_spec, hold_from_wire, hold_to_wire, parse_hold, render_cdi_spec
from shared.schemas import (
    HELPER_FILE_WRITE_CODEC,
    NODE_EVENT_CODEC,
    NODE_SPEC_CODEC,
    AllocationBound,
    BadMessage,
    HelperFileWrite,
    HugePages,
    Limits,
    encode,
)
from shared.schemas.common import (
    HUGEPAGE_MAX_KIB,
    HUGEPAGES_MAX_COUNT,
    INT64_MAX,
    INT64_MIN,
    LIMITS_MAX_CPU_MILLIS,
    LIMITS_MAX_MEMORY_BYTES,
)

GPU = "GPU-5f1c2a90-0000-4000-8000-000000000001"
MODULES = (shared.schemas.bus, shared.schemas.common, shared.schemas.events, shared.schemas.inventory, shared.schemas.nodespec)


def _structs() -> list[type[msgspec.Struct]]:
    return sorted(
        {t for m in MODULES for t in vars(m).values() if isinstance(t, type) and issubclass(t, msgspec.Struct) and t.__module__ == m.__name__},
        key=lambda t: t.__qualname__,
    )


def _ints(t: Any, where: str, seen: frozenset[type] = frozenset()) -> list[tuple[str, mi.IntType]]:
    if isinstance(t, mi.IntType):
        return [(where, t)]
    if isinstance(t, mi.StructType):
        if t.cls in seen:
            return []
        return [x for f in t.fields for x in _ints(f.type, f"{t.cls.__qualname__}.{f.name}", seen | {t.cls})]
    out: list[tuple[str, mi.IntType]] = []
    for attr in ("item_type", "key_type", "value_type"):
        if hasattr(t, attr):
            out += _ints(getattr(t, attr), f"{where}[]", seen)
    for attr in ("types", "item_types"):
        for sub in getattr(t, attr, ()):
            out += _ints(sub, where, seen)
    return out


def test_every_integer_of_every_schema_is_an_int64() -> None:
    found = [x for s in _structs() for x in _ints(mi.type_info(s), s.__qualname__)]
    assert len(found) > 50  # the walk reaches them (generations, bytes, counts, indexes)
    unbounded = []
    for where, t in found:
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
        if lo is None or hi is None or lo < INT64_MIN or hi > INT64_MAX:
            unbounded.append((where, lo, hi))
    assert unbounded == []


# ---------------------------------------------------------------------------- writers and readers together


def _spec(generation: int = 1, **limits: Any) -> bytes:
    a: dict[str, Any] = {"allocation_id": "a1", "reservation_id": "rsv-a1", "binding": "BINDING_HOLD", "devices": [GPU]}
    if limits:
        a["limits"] = limits
    return json.dumps({"node_id": "node-1", "generation": generation, "devices": [a]}).encode()


def _hold(generation: int, limits: Limits | None = None) -> HoldContent:
    return HoldContent(
        allocation_id="a1",
        reservation_id="rsv-a1",
        generation=generation,
        binding="BINDING_HOLD",
        devices=(HoldDevice.for_gpu(GPU, 0),),
        cgroup_parent="bcd-alloc-a1.slice" if limits is not None else "",
        limits=limits,
    )


def _round_trip(hold: HoldContent) -> None:
    """From the spec's values to the hold spec on disk and back, and through the root helper."""
    back = parse_hold("bcd-a1.json", render_cdi_spec(build_cdi_spec(hold, None)))
    assert (back.generation, back.limits) == (hold.generation, hold.limits)
    wire = HELPER_FILE_WRITE_CODEC.decode(encode(HelperFileWrite(kind="cdi", hold=hold_to_wire(hold))))
    assert hold_from_wire(wire.hold, "") == hold


LARGEST = [
    pytest.param({"generation": INT64_MAX}, id="generation"),
    pytest.param({"memory_bytes": LIMITS_MAX_MEMORY_BYTES}, id="memory_bytes"),
    pytest.param({"cpu_millis": LIMITS_MAX_CPU_MILLIS}, id="cpu_millis"),
    pytest.param({"hugepages": [{"page_size_kib": HUGEPAGE_MAX_KIB, "count": HUGEPAGES_MAX_COUNT}]}, id="hugepages"),
]


@pytest.mark.parametrize("values", LARGEST)
def test_the_largest_value_a_spec_may_carry_is_taken_by_every_reader(values: dict[str, Any]) -> None:
    generation = values.pop("generation", 1)
    spec = NODE_SPEC_CODEC.decode(_spec(generation, **values))
    a = spec.devices[0]
    _round_trip(_hold(spec.generation, a.limits))
    bound = AllocationBound(allocation_id="a1", reservation_id="rsv-a1", generation=spec.generation, devices=[GPU])
    assert NODE_EVENT_CODEC.decode(encode(bound)) == bound


@pytest.mark.parametrize(
    ("values", "path"),
    [
        ({"generation": INT64_MAX + 1}, "$.generation"),
        ({"generation": 10**19}, "$.generation"),
        ({"generation": 2**64}, "$.generation"),
        ({"memory_bytes": LIMITS_MAX_MEMORY_BYTES + 1}, "$.devices[0].limits.memory_bytes"),
        ({"memory_bytes": 2**64}, "$.devices[0].limits.memory_bytes"),
        ({"cpu_millis": LIMITS_MAX_CPU_MILLIS + 1}, "$.devices[0].limits.cpu_millis"),
        ({"hugepages": [{"page_size_kib": HUGEPAGE_MAX_KIB + 1, "count": 1}]}, "$.devices[0].limits.hugepages[0].page_size_kib"),
        ({"hugepages": [{"page_size_kib": 2, "count": 1}]}, "$.devices[0].limits.hugepages[0].page_size_kib"),
        ({"hugepages": [{"page_size_kib": 2048, "count": HUGEPAGES_MAX_COUNT + 1}]}, "$.devices[0].limits.hugepages[0].count"),
    ],
    ids=["generation-2^63", "generation-10^19", "generation-2^64", "memory", "memory-2^64", "cpu_millis", "page-size", "page-size-small", "page-count"],
)
def test_one_above_is_refused_at_decode_naming_the_field(values: dict[str, Any], path: str) -> None:
    generation = values.pop("generation", 1)
    with pytest.raises(BadMessage, match="at `" + re.escape(path) + "`"):
        NODE_SPEC_CODEC.decode(_spec(generation, **values))


def test_the_hold_reader_takes_exactly_the_generations_a_writer_writes() -> None:
    data = json.loads(render_cdi_spec(build_cdi_spec(_hold(INT64_MAX), None)))
    assert parse_hold("bcd-a1.json", json.dumps(data).encode()).generation == INT64_MAX
    for text in (str(INT64_MAX + 1), "9999999999999999999", "10000000000000000000", "-1", "01"):
        data["annotations"]["bcd.dev/generation"] = text
        with pytest.raises(NotAHold, match="not a non-negative int64"):
            parse_hold("bcd-a1.json", json.dumps(data).encode())


def test_the_helper_takes_every_limit_a_spec_can_carry() -> None:
    """The spec's Limits and the helper's HelperLimits share their bounds (shared.schemas.common)."""
    spec_limits = mi.type_info(Limits)
    helper_limits = mi.type_info(shared.schemas.bus.HelperLimits)

    def bounds(info: mi.StructType) -> dict[str, tuple[Any, Any]]:
        out = {}
        for f in info.fields:
            ints = _ints(f.type, f.name)
            if ints:
                t = ints[0][1]
                out[f.name] = (t.ge, t.le)
        return out

    assert bounds(spec_limits) == bounds(helper_limits)
    pages = lambda i: {f.name: (t.ge, t.le) for f in i.fields for _, t in _ints(f.type, f.name)}  # noqa: E731
    assert pages(mi.type_info(HugePages)) == pages(mi.type_info(shared.schemas.bus.HelperHugePages))


def test_the_control_plane_puts_no_generation_past_the_largest() -> None:
    state = ControlPlaneState()
    state.node("node-1").last_generation = INT64_MAX - 1
    assert next_generation(state, "node-1", None) == (INT64_MAX, "")
    state.node("node-1").last_generation = INT64_MAX
    # the node's situation, not bad input: an operator's error naming the way back (issue 41.5)
    with pytest.raises(GenerationExhausted, match="the largest a spec can carry") as exc:
        next_generation(state, "node-1", None)
    assert exc.value.operator_error and "bcd rebase" in str(exc.value)
    with pytest.raises(GenerationExhausted):
        next_generation(state, "node-1", 5)
