"""A string that fails its pattern is refused in words (the field's description), never as
the regex behind it, and still names the field path (shared/schemas/codec.py `human_error`)."""

from __future__ import annotations

import json
import typing
from typing import Annotated

import msgspec
import msgspec.inspect as mi
import pytest

import shared.schemas as schemas
from shared.schemas import NODE_SPEC_CODEC, BadMessage, common
from shared.schemas.codec import PATTERN_DESCRIPTIONS, BoundedDecoder, Codec, human_error


def _spec(**assignment: object) -> str:
    a = {"allocation_id": "a1", "reservation_id": "r1", "binding": "BINDING_HOLD", "devices": ["GPU-x"], **assignment}
    return json.dumps({"node_id": "node-1", "generation": 1, "devices": [a]})


def test_an_allocation_id_error_says_what_an_id_is_and_where() -> None:
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(_spec(allocation_id="Train_01!"))
    assert str(exc.value) == (
        "Expected `str` (lowercase letters, digits, '_' and '-', starting alphanumeric, 1-63 characters) - at `$.devices[0].allocation_id`"
    )


@pytest.mark.parametrize(
    ("assignment", "words", "path"),
    [
        ({"env": ["1BAD=x"]}, "KEY=VALUE: KEY of letters", "$.devices[0].env[0]"),
        ({"limits": {"cpus": "0-3;8"}}, "Linux cpulist syntax, e.g. 0-3,8", "$.devices[0].limits.cpus"),
        ({"devices": ["has space"]}, "atom id, e.g. GPU-<uuid>/gi1/ci0", "$.devices[0].devices[0]"),
    ],
)
def test_node_spec_pattern_errors_are_words(assignment: dict, words: str, path: str) -> None:
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(_spec(**assignment))
    text = str(exc.value)
    assert words in text and text.endswith(f"- at `{path}`"), text
    assert "regex" not in text and "(?!" not in text


def _aliases() -> list[tuple[str, object]]:
    return [
        (name, value)
        for name, value in vars(common).items()
        if typing.get_origin(value) is typing.Annotated and any(getattr(m, "pattern", None) for m in value.__metadata__)
    ]


def test_the_map_covers_every_constrained_string_of_common() -> None:
    """Every pattern type in common.py has a description, so none is shown as a regex."""
    undescribed = [name for name, value in _aliases() if not any(getattr(m, "description", None) for m in value.__metadata__)]
    assert not undescribed, f"constrained types without Meta(description=...): {undescribed}"
    assert {m.pattern for _, v in _aliases() for m in v.__metadata__ if getattr(m, "pattern", None)} <= set(PATTERN_DESCRIPTIONS)


@pytest.mark.parametrize(("name", "alias"), _aliases(), ids=[n for n, _ in _aliases()])
def test_each_constrained_type_is_refused_in_its_own_words(name: str, alias: object) -> None:
    holder = msgspec.defstruct("Holder", [("value", alias)])
    description = next(m.description for m in alias.__metadata__ if getattr(m, "description", None))
    with pytest.raises(BadMessage) as exc:
        Codec(holder).decode(json.dumps({"value": "\n\x00 not valid anywhere \u2028" * 3}))
    assert str(exc.value) == f"Expected `str` ({description}) - at `$.value`"


def _patterns(t: object, seen: set[int], out: list[tuple[str, str | None]]) -> None:
    if isinstance(t, mi.Metadata):
        if getattr(t.type, "pattern", None):
            out.append((t.type.pattern, (t.extra_json_schema or {}).get("description")))
        else:
            _patterns(t.type, seen, out)
        return
    if isinstance(t, mi.StrType) and t.pattern:
        out.append((t.pattern, None))
    fields = getattr(t, "fields", None)
    if fields is not None:
        if id(t) not in seen:
            seen.add(id(t))
            for f in fields:
                _patterns(f.type, seen, out)
        return
    for attr in ("item_type", "key_type", "value_type"):
        if getattr(t, attr, None) is not None:
            _patterns(getattr(t, attr), seen, out)
    for attr in ("types", "item_types"):
        for sub in getattr(t, attr, None) or ():
            _patterns(sub, seen, out)


def test_no_codec_of_the_bus_has_a_pattern_without_words() -> None:
    """Every pattern any bus codec checks is described, by its field or by common.py's map."""
    bare = set()
    for name in dir(schemas):
        codec = getattr(schemas, name)
        if isinstance(codec, Codec):
            found: list[tuple[str, str | None]] = []
            _patterns(mi.type_info(codec.type), set(), found)
            bare |= {(name, p) for p, d in found if not d and p not in PATTERN_DESCRIPTIONS}
    assert not bare, f"patterns a sender would see as a regex: {sorted(bare)}"


def test_a_field_description_found_in_the_type_is_used() -> None:
    holder = msgspec.defstruct("Holder", [("colour", Annotated[str, msgspec.Meta(pattern=r"^(red|blue)" + common.END, description="red or blue")])])
    with pytest.raises(BadMessage, match=r"^Expected `str` \(red or blue\) - at `\$\.colour`$"):
        Codec(holder).decode(b'{"colour": "green"}')


def test_a_pattern_nobody_described_is_shown_without_its_anchors() -> None:
    holder = msgspec.defstruct("Holder", [("hex", Annotated[str, msgspec.Meta(pattern=r"^0x[0-9a-f]{2}" + common.END)])])
    with pytest.raises(BadMessage) as exc:
        Codec(holder).decode(b'{"hex": "zz"}')
    assert str(exc.value) == "Expected `str` matching 0x[0-9a-f]{2} - at `$.hex`"


def test_file_readers_get_the_words_and_keep_their_except_clauses() -> None:
    """BoundedDecoder still raises msgspec.ValidationError (what file readers catch), now in words."""
    with pytest.raises(msgspec.ValidationError) as exc:
        BoundedDecoder(schemas.NodeSpec).decode(_spec(reservation_id="R!"))
    assert str(exc.value).startswith("Expected `str` (lowercase letters") and "$.devices[0].reservation_id" in str(exc.value)


def test_other_errors_are_left_as_msgspec_wrote_them() -> None:
    text = "Expected `str` of length <= 4096 - at `$.section.message`"
    assert human_error(text) is text
    with pytest.raises(BadMessage, match=r"^Expected `int`, got `str` - at `\$\.generation`$"):
        NODE_SPEC_CODEC.decode(b'{"node_id": "n", "generation": "1"}')
