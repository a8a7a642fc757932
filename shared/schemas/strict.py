"""Strict reading at the edges people type: every field a schema does not know, named with its path.

The wire stays lenient (common.Struct ignores unknown fields, DESIGN 4), but a
spec a person wrote should not lose a typo silently: `"limit"` for `"limits"`
would bind the hold with no limits. `unknown_fields(NodeSpec, data)` walks
decoded JSON against the type's own field list (msgspec.inspect, so it follows
the schema as it changes, with nothing to keep in sync by hand) and returns
every object key the type does not declare, as `$.devices[0].limit` with the
closest declared name as a suggestion. Values are not judged here: the
decoder does that, and names the field too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec.inspect as mi

from .codec import DEFAULT_MAX_BYTES, BadMessage, bounded_json_loads
from .common import summarise

_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

#: the node condition a node raises when a spec it accepted carries fields it does not know
#: (it ignores them: schema evolution), once per generation; cleared by a spec without any.
UNKNOWN_FIELDS_CONDITION = "NodeSpecUnknownFields"


@dataclass(frozen=True)
class UnknownField:
    """One key the schema does not declare: where it is, and the declared name it is closest to."""

    path: str
    suggestion: str = ""

    def __str__(self) -> str:
        hint = f' (did you mean "{self.suggestion}"?)' if self.suggestion else ""
        return f"{self.path}: unknown field{hint}"


class UnknownFieldsError(BadMessage):
    """A document with keys its type does not declare; `fields` lists every one."""

    def __init__(self, fields: list[UnknownField], what: str = "spec") -> None:
        self.fields = list(fields)
        lines = [str(f) for f in self.fields]
        super().__init__(f"{what}: {len(lines)} unknown field{'s' if len(lines) != 1 else ''}: " + summarise(lines, sep="; "))


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if _PLAIN_KEY.match(key) else f"{path}[{json.dumps(key)}]"


def _suggest(key: str, known: list[str]) -> str:
    import difflib  # only when a spec has an unknown field

    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not close:
        # a different case or separators ("Limits", "allocation-id") is still the same word
        norm = {k.lower().replace("-", "_"): k for k in known}
        return norm.get(key.lower().replace("-", "_"), "")
    return close[0]


def _walk(t: mi.Type, data: Any, path: str, out: list[UnknownField]) -> None:
    while isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.StructType):
        if not isinstance(data, dict):
            return
        fields = {f.encode_name: f for f in t.fields}
        known = list(fields) + ([t.tag_field] if t.tag_field else [])
        for key, value in data.items():
            if not isinstance(key, str):
                continue
            field = fields.get(key)
            if field is None:
                if key != t.tag_field:
                    out.append(UnknownField(_key_path(path, key), _suggest(key, known)))
                continue
            _walk(field.type, value, _key_path(path, key), out)
    elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        if isinstance(data, list):
            for i, item in enumerate(data):
                _walk(t.item_type, item, f"{path}[{i}]", out)
    elif isinstance(t, mi.TupleType):
        if isinstance(data, list):
            for i, (item_type, item) in enumerate(zip(t.item_types, data)):
                _walk(item_type, item, f"{path}[{i}]", out)
    elif isinstance(t, mi.DictType):
        if isinstance(data, dict):
            for key, value in data.items():
                if isinstance(key, str):
                    _walk(t.value_type, value, _key_path(path, key), out)
    elif isinstance(t, mi.UnionType):
        if not isinstance(data, dict):
            for member in t.types:
                if not isinstance(member, (mi.StructType, mi.DictType)):
                    _walk(member, data, path, out)
            return
        structs = [m for m in t.types if isinstance(m, mi.StructType)]
        tagged = [m for m in structs if m.tag_field and data.get(m.tag_field) == m.tag]
        chosen = tagged[0] if tagged else (structs[0] if len(structs) == 1 else None)
        if chosen is not None:
            _walk(chosen, data, path, out)
        # an untagged union of several structs (or an unknown tag) is the decoder's to refuse


#: msgspec.inspect.type_info of each type asked about: building it costs ~0.65 ms for a
#: NodeSpec, walking a spec with it ~17 us (and it is asked at every spec hand-over).
_TYPE_INFO: dict[Any, Any] = {}


def unknown_fields(type_: Any, data: Any) -> list[UnknownField]:
    """Every object key in `data` (decoded JSON) that `type_` does not declare, in document order."""
    out: list[UnknownField] = []
    info = _TYPE_INFO.get(type_)
    if info is None:
        info = _TYPE_INFO[type_] = mi.type_info(type_)
    _walk(info, data, "$", out)
    return out


def check_known_fields(type_: Any, data: Any, what: str = "spec") -> None:
    """Raise UnknownFieldsError (a BadMessage) naming every unknown field of `data`."""
    found = unknown_fields(type_, data)
    if found:
        raise UnknownFieldsError(found, what)


def unknown_fields_of_json(type_: Any, raw: bytes | bytearray | str, max_bytes: int = 4 * DEFAULT_MAX_BYTES) -> list[UnknownField]:
    """unknown_fields of a JSON document, read behind the usual bounds ([] when it does not read:
    the typed decoder refuses it and says why)."""
    try:
        data = bounded_json_loads(raw, max_bytes, "document")
    except BadMessage:
        return []
    return unknown_fields(type_, data)


__all__ = ["UNKNOWN_FIELDS_CONDITION", "UnknownField", "UnknownFieldsError", "unknown_fields", "check_known_fields", "unknown_fields_of_json"]
