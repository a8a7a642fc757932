"""Encoders and decoders, built once per type (msgspec's asyncio-kv pattern).

`decode` is the boundary: it refuses an oversized message and one nested
deeper than `MAX_DEPTH` levels before parsing (DESIGN 12: a parser would
recurse once per level), and turns every parser error into `BadMessage`,
whose text names the field (`$.devices[0].allocation_id`) so a sender can see
what to fix, and says what a constrained string must look like in words (the
field's `Meta(description=...)`, see `human_error`), never as the regex behind
it. `encode_valid` is the producer's side: a message is encoded and
decoded again with the same bounded decoder, so nothing a service emits is
refused by its own schema at the peer.

For the decoders that are not a `Codec` (files read back, untyped JSON from a
peer): `bounded_json_loads` is `json.loads` behind the same bounds, and
`BoundedDecoder` is a `msgspec.json.Decoder` behind them whose bound errors are
also `msgspec.DecodeError`s, so the `except` clauses of a file reader keep
working unchanged.
"""

from __future__ import annotations

import ast
import json
import re
import typing
from itertools import accumulate
from typing import Any, Generic, TypeVar

import msgspec
import msgspec.inspect as mi

from . import common

T = TypeVar("T")

#: default ceiling for one message; NATS' own default max_payload is 1 MiB.
DEFAULT_MAX_BYTES = 1024 * 1024
#: no decoder of bcd reads a value nested deeper than this (DESIGN 12).
MAX_DEPTH = 64

_encoder = msgspec.json.Encoder()

# A JSON string literal (escapes included), matched possessively: no backtracking,
# so an unterminated string costs one linear scan. Brackets inside strings do not nest.
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
# every byte but the four brackets is deleted; then opening ones become "(" and closing ")"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_TO_PARENS = bytes.maketrans(b"[{]}", b"(())")
_TO_SIGNS = bytes.maketrans(b"()", b"\x01\xff")
#: rounds of pair removal before the running count (each is one pass over what is left)
_PAIR_ROUNDS = 4


# ------------------------------------------------------------- human pattern errors

#: msgspec's text for a string that fails its pattern: "Expected `str` matching regex '<repr>'"
_REGEX_ERROR = re.compile(r"""Expected `str` matching regex (?P<repr>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""")


def _described(meta: object) -> tuple[str, str] | None:
    pattern, desc = getattr(meta, "pattern", None), getattr(meta, "description", None)
    return (pattern, desc) if isinstance(pattern, str) and isinstance(desc, str) and desc else None


def _module_patterns(module: Any) -> dict[str, str]:
    """pattern -> description of every constrained `Annotated[str, Meta(pattern=, description=)]` alias in `module`."""
    out: dict[str, str] = {}
    for value in vars(module).values():
        if typing.get_origin(value) is typing.Annotated:
            for meta in value.__metadata__:
                if (pd := _described(meta)) is not None:
                    out.setdefault(*pd)
    return out


#: built once from the shared constrained types (common.py): Id, PciAddress, AtomId, CpuList, EnvLine, ...
PATTERN_DESCRIPTIONS: dict[str, str] = _module_patterns(common)


def _type_patterns(type_: Any) -> dict[str, str]:
    """pattern -> description of every described pattern anywhere in `type_` (a field's own `Meta` too)."""
    out: dict[str, str] = {}
    seen: set[int] = set()

    def walk(t: Any) -> None:
        if isinstance(t, mi.Metadata):
            desc = (t.extra_json_schema or {}).get("description")
            pattern = getattr(t.type, "pattern", None)
            if isinstance(pattern, str) and isinstance(desc, str) and desc:
                out.setdefault(pattern, desc)
            walk(t.type)
            return
        fields = getattr(t, "fields", None)
        if fields is not None:
            if id(t) in seen:
                return
            seen.add(id(t))
            for f in fields:
                walk(f.type)
            return
        for attr in ("item_type", "key_type", "value_type"):
            if (sub := getattr(t, attr, None)) is not None:
                walk(sub)
        for attr in ("types", "item_types"):
            for sub in getattr(t, attr, None) or ():
                walk(sub)

    try:
        walk(mi.type_info(type_))
    except Exception:  # noqa: BLE001 - a type msgspec cannot describe only loses the nicer words
        pass
    return out


def _bare(pattern: str) -> str:
    """A pattern without the anchoring internals (`^...$(?!\\n)`), for a pattern no description names."""
    core = pattern.removeprefix("^")
    return core[: -len(common.END)] if core.endswith(common.END) else core.removesuffix("$")


#: a struct's own check that names an element of one of its lists (`env[3]: LD_PRELOAD ...`), as
#: msgspec reports it: the struct's path after the message (`- at `$.devices[2]``)
_ELEMENT_AT = re.compile(r"^(?P<rel>[A-Za-z_][A-Za-z0-9_]*(?:\[[0-9]+\])+): (?P<msg>.*) - at `(?P<at>\$[^`]*)`$", re.DOTALL)


def human_error(text: str, type_: Any = None, _cache: dict[Any, dict[str, str]] = {}) -> str:  # noqa: B006 - a cache
    """msgspec's error text with "Expected `str` matching regex '<pattern>'" said in words.

    The words are the pattern's description: from common.py's constrained
    types, else from the `Meta(description=...)` found in `type_`; a pattern
    with none is shown without its anchors. The field path (`- at `$.x``)
    stays as msgspec wrote it, except that a struct's own check naming one
    element of its lists (`env[3]: ...`, see nodespec.DeviceAssignment) gets
    that element's whole path (`... - at `$.devices[2].env[3]``).
    """
    e = _ELEMENT_AT.match(text)
    if e is not None:
        return f"{e['msg']} - at `{e['at']}.{e['rel']}`"
    m = _REGEX_ERROR.search(text)
    if m is None:
        return text
    try:
        pattern = ast.literal_eval(m.group("repr"))
    except (ValueError, SyntaxError):
        return text
    desc = PATTERN_DESCRIPTIONS.get(pattern)
    if desc is None and type_ is not None:
        if type_ not in _cache:
            _cache[type_] = _type_patterns(type_)
        desc = _cache[type_].get(pattern)
    words = f"Expected `str` ({desc})" if desc else f"Expected `str` matching {_bare(pattern)}"
    return text[: m.start()] + words + text[m.end() :]


class BadMessage(ValueError):
    """A message that does not decode into its type; the text names the field."""


class BoundsError(BadMessage, msgspec.DecodeError):
    """Larger than its limit or nested deeper than MAX_DEPTH: refused before any parsing.

    Both a BadMessage and a msgspec.DecodeError, so a reader that catches
    either (a file reader written for a plain msgspec decoder) refuses it too.
    """


class SchemaViolation(ValueError):
    """A producer built a message its own schema refuses (`encode_valid`); the text names the field.

    Not a BadMessage: this is the sender's bug, never the peer's input.
    """


def nesting_exceeds(data: bytes | bytearray, max_depth: int = MAX_DEPTH) -> bool:
    """True when `data`, read as JSON, nests deeper than `max_depth` levels.

    C speed only, never recursive: string literals are cut out (brackets in
    strings do not nest), everything but brackets is deleted, a few rounds
    of innermost `()` pairs are removed (typical wide-but-shallow messages
    vanish here), and the deepest running count of what is left, plus the
    rounds, is the depth. Unbalanced input counts as deep as its opens go (a
    parser descends that far before it fails); unbalanced but shallow input
    is left to the parser, which says "not valid JSON".
    """
    # fewer opening brackets than the limit cannot nest deeper than it
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return False
    s = _STRING.sub(b"", data).translate(_TO_PARENS, _NOT_BRACKETS)
    if s.count(b"(") <= max_depth:
        return False
    rounds = 0
    while rounds < _PAIR_ROUNDS:
        t = s.replace(b"()", b"")
        if not t:
            return False
        if len(t) == len(s):
            break
        s, rounds = t, rounds + 1
    # each round took at most one level off; "(" counts +1 and ")" -1
    return max(accumulate(memoryview(s.translate(_TO_SIGNS)).cast("b"))) + rounds > max_depth


def _as_bytes(data: bytes | bytearray | memoryview | str, what: str) -> bytes | bytearray:
    if isinstance(data, str):
        try:
            return data.encode()
        except UnicodeEncodeError as exc:
            raise BoundsError(f"{what}: not valid UTF-8 ({exc.reason})") from None
    if isinstance(data, memoryview):
        return data.tobytes()
    return data


def check_bounds(
    data: bytes | bytearray | memoryview | str, max_bytes: int, what: str = "message", *, type_name: str = ""
) -> bytes | bytearray:
    """`data` as bytes when it is within `max_bytes` and `MAX_DEPTH`; BoundsError (a BadMessage) when not."""
    raw = _as_bytes(data, what)
    if len(raw) > max_bytes:
        raise BoundsError(f"{what}: {len(raw)} bytes is larger than the {max_bytes}-byte limit" + (f" for {type_name}" if type_name else ""))
    if nesting_exceeds(raw):
        raise BoundsError(f"{what}: nested deeper than {MAX_DEPTH} levels")
    return raw


def bounded_json_loads(data: bytes | bytearray | memoryview | str, max_bytes: int, what: str = "message") -> Any:
    """`json.loads` of untrusted data behind the size and nesting bounds.

    Anything it cannot read raises BadMessage (a ValueError, as json.loads'
    own errors are), whose text starts with `what`.
    """
    raw = check_bounds(data, max_bytes, what)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadMessage(f"{what}: not valid JSON ({exc})") from None
    # json.loads takes "\ud800" (a lone surrogate escape): a str no UTF-8 can carry, which every
    # later encode (a path, an env line, a msgspec decode) raises on. Only escapes can make one.
    if (b"\\u" if isinstance(raw, (bytes, bytearray, memoryview)) else "\\u") in (bytes(raw) if isinstance(raw, memoryview) else raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadMessage(f"{what}: not valid JSON (a \\u escape of a lone surrogate: text no UTF-8 can carry)") from None
        except (ValueError, RecursionError):
            pass
    return value


class BoundedDecoder(Generic[T]):
    """A `msgspec.json.Decoder(type_)` behind the bounds, for readers that catch msgspec errors.

    Schema errors stay `msgspec.ValidationError` and syntax errors
    `msgspec.DecodeError`; a bound refusal is a BoundsError, which is both a
    DecodeError and a BadMessage.
    """

    def __init__(self, type_: type[T], *, max_bytes: int = DEFAULT_MAX_BYTES, what: str = "") -> None:
        self.type = type_
        self.max_bytes = max_bytes
        self.what = what or getattr(type_, "__name__", str(type_))
        self._decoder = msgspec.json.Decoder(type_)

    def decode(self, data: bytes | bytearray | memoryview | str) -> T:
        raw = check_bounds(data, self.max_bytes, self.what)
        try:
            return self._decoder.decode(raw)
        except msgspec.ValidationError as exc:
            text = str(exc)
            human = human_error(text, self.type)
            if human is text:
                raise
            raise msgspec.ValidationError(human) from None
        except RecursionError:
            raise BoundsError(f"{self.what}: nested too deeply") from None


class Codec(Generic[T]):
    def __init__(self, type_: type[T], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.type = type_
        self.max_bytes = max_bytes
        self._decoder = msgspec.json.Decoder(type_)

    @property
    def type_name(self) -> str:
        return getattr(self.type, "__name__", str(self.type))

    def decode(self, data: bytes | bytearray | memoryview | str) -> T:
        raw = check_bounds(data, self.max_bytes, "message", type_name=self.type_name)
        try:
            return self._decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise BadMessage(human_error(str(exc), self.type)) from None
        except msgspec.DecodeError as exc:
            raise BadMessage(f"message: not valid JSON ({exc})") from None
        except RecursionError:
            raise BadMessage("message: nested too deeply") from None
        except Exception as exc:  # noqa: BLE001 - whatever the parser raises, the input is what is wrong
            raise BadMessage(f"message: not readable ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def encode(value: object) -> bytes:
        return _encoder.encode(value)

    def encode_valid(self, value: object) -> bytes:
        """Encode, then decode with this codec's bounded decoder: every constraint of the type is checked.

        Raises SchemaViolation naming the type and the field when the value
        breaks its own schema (a string over its bound, a list too long, a
        message over the size limit), so a producer never emits what a peer
        cannot decode. Costs one extra decode.
        """
        try:
            data = _encoder.encode(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise SchemaViolation(f"{self.type_name}: not encodable ({exc})") from None
        try:
            self.decode(data)
        except BadMessage as exc:
            raise SchemaViolation(f"{self.type_name} schema violated: {exc}") from None
        return data


def encode(value: object) -> bytes:
    return _encoder.encode(value)


__all__ = [
    "BadMessage",
    "BoundsError",
    "BoundedDecoder",
    "Codec",
    "DEFAULT_MAX_BYTES",
    "MAX_DEPTH",
    "SchemaViolation",
    "bounded_json_loads",
    "check_bounds",
    "encode",
    "human_error",
    "nesting_exceeds",
    "PATTERN_DESCRIPTIONS",
]
