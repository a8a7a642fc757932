"""A NodeSpec as a put takes it: checked before anything is reserved or signed, and what a put returns.

This module owns the rules a spec must pass before it costs a generation. Unknown
fields are refused unless allowed, and every one is named. Then the schema is
checked, naming the field, and then the node id, which may not be a reserved
subject token. It also owns the shape of a put's answer (PutResult) and the
refusal of a spec for a node that never said Hello (UnknownNode). `bcd apply`
(with `--dry-run` too) runs the same check on the node's side, so the rules
live apart from the code that talks to the upstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from shared.schemas import NODE_SPEC_CODEC, BadMessage, NodeSpec, encode
from shared.schemas.codec import DEFAULT_MAX_BYTES, bounded_json_loads
from shared.schemas.strict import UnknownField, UnknownFieldsError, unknown_fields
from shared.subjects import UPSTREAM_NODES_BUCKET, upstream_spec_key_subject


@dataclass(frozen=True)
class PutResult:
    """What `put_spec` put: the signed spec, its KV revision, and whether the generation was bumped."""

    spec: NodeSpec
    revision: int
    #: the generation the caller gave (None: none given, so last + 1 was used).
    requested_generation: int | None
    #: non-empty when the requested generation was not above the last one and was bumped.
    note: str = ""
    #: fields NodeSpec does not declare, put as given (only with allow_unknown_fields).
    unknown_fields: tuple[UnknownField, ...] = ()
    #: `time.perf_counter()` just before the KV put was sent (signed already): where a
    #: latency measurement of the node's answer starts (bench/e2e.py).
    put_at: float = 0.0

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def bumped(self) -> bool:
        return bool(self.note)


def _spec_fields(spec: NodeSpec | dict[str, Any] | str | bytes) -> dict[str, Any]:
    if isinstance(spec, NodeSpec):
        return msgspec.to_builtins(spec)
    if isinstance(spec, (str, bytes, bytearray)):
        if not spec.strip():
            raise BadMessage("spec: empty (a NodeSpec is a JSON object)")
        # bounded_json_loads says "spec: not valid JSON (...)" itself (it was said twice, issue 28.8)
        data = bounded_json_loads(spec, 4 * DEFAULT_MAX_BYTES, "spec")
    else:
        data = spec
    if not isinstance(data, dict):
        raise BadMessage("spec: expected a JSON object")
    return dict(data)


@dataclass(frozen=True)
class CheckedSpec:
    """A spec as `check_spec` read it: valid, with any generation it asked for."""

    #: the spec decoded (generation: the requested one, or 0 when none was given).
    draft: NodeSpec
    requested: int | None
    #: the JSON object as given.
    fields: dict[str, Any]
    #: fields NodeSpec does not declare (empty unless allowed).
    unknown: list[UnknownField]


def check_spec(spec: NodeSpec | dict[str, Any] | str | bytes, *, allow_unknown_fields: bool = False) -> CheckedSpec:
    """What a put checks before anything is reserved or signed (also `bcd apply --dry-run`).

    Unknown fields first (UnknownFieldsError names every one, unless allowed),
    then the schema (BadMessage naming the field), then the node id.
    """
    fields = _spec_fields(spec)
    unknown = unknown_fields(NodeSpec, fields)
    if unknown and not allow_unknown_fields:
        raise UnknownFieldsError(unknown)
    requested = fields.get("generation")
    # Validate first (with any generation), so a bad spec never consumes one.
    draft = NODE_SPEC_CODEC.decode(encode({**fields, "generation": requested if isinstance(requested, int) and requested >= 0 else 0}))
    if requested is not None:
        NODE_SPEC_CODEC.decode(encode(fields))  # a malformed generation fails here, named
    try:
        upstream_spec_key_subject(draft.node_id)  # refuses a reserved node id
    except ValueError as exc:
        raise BadMessage(f"spec: {exc}") from None
    return CheckedSpec(draft=draft, requested=requested, fields=fields, unknown=unknown)


class UnknownNode(ValueError):
    """A spec for a node that never put a Hello (a typo, or a node not yet joined)."""

    def __init__(self, node_id: str) -> None:
        super().__init__(f"node {node_id} has never announced itself (no Hello in {UPSTREAM_NODES_BUCKET})")
        self.node_id = node_id


__all__ = ["PutResult", "CheckedSpec", "check_spec", "UnknownNode"]
