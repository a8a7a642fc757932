"""JSON Schema of the upstream contract, generated from the msgspec types.

Every type of `UPSTREAM_TYPES` gets one file, `docs/schema/<Name>.json`
(JSON Schema 2020-12, as `msgspec.json.schema` writes it, plus `$schema`,
`$id` and `title`; sorted keys, indent 2, trailing newline). The files are
checked in so a control-plane author can read the contract without Python;
`tests/unit/test_jsonschema.py` fails when they drift from the code.

    python -m shared.schemas.jsonschema --write [DIR]   # regenerate (default docs/schema)
    python -m shared.schemas.jsonschema --check [DIR]   # exit 1 naming each drifted file
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from shared.schemas import UPSTREAM_TYPES

DIALECT = "https://json-schema.org/draft/2020-12/schema"
ID_BASE = "https://bcd.dev/schema/"
#: docs/schema of this checkout (shared/schemas/jsonschema.py -> repo root).
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "docs" / "schema"
SUFFIX = ".json"


def schema_id(name: str) -> str:
    return f"{ID_BASE}{name}{SUFFIX}"


def schema_of(name: str, type_: Any) -> dict[str, Any]:
    """The JSON Schema document of one upstream type."""
    doc: dict[str, Any] = dict(msgspec.json.schema(type_))
    doc["$schema"] = DIALECT
    doc["$id"] = schema_id(name)
    doc["title"] = name
    return doc


def render(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def generate(types: Mapping[str, Any] = UPSTREAM_TYPES) -> dict[str, str]:
    """File name -> file text, for every upstream type."""
    return {f"{name}{SUFFIX}": render(schema_of(name, type_)) for name, type_ in sorted(types.items())}


def _ours(path: Path) -> bool:
    """A file this generator wrote (so `--write` may remove it when stale)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(doc, dict) and str(doc.get("$id", "")).startswith(ID_BASE)


def check(directory: Path = DEFAULT_DIR, types: Mapping[str, Any] = UPSTREAM_TYPES) -> list[str]:
    """One line per drifted, missing or extra (stale) schema file; empty when in sync."""
    expected = generate(types)
    problems: list[str] = []
    for fname, text in expected.items():
        path = directory / fname
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{path}: drifted from the code")
    if directory.is_dir():
        for path in sorted(directory.glob(f"*{SUFFIX}")):
            if path.name not in expected:
                problems.append(f"{path}: extra (no upstream type {path.stem!r})")
    return problems


def write(directory: Path = DEFAULT_DIR, types: Mapping[str, Any] = UPSTREAM_TYPES) -> list[str]:
    """Write every schema file and remove stale ones this generator wrote; returns what changed."""
    expected = generate(types)
    directory.mkdir(parents=True, exist_ok=True)
    changed: list[str] = []
    for fname, text in expected.items():
        path = directory / fname
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(f"{path}: written")
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        if path.name not in expected and _ours(path):
            path.unlink()
            changed.append(f"{path}: removed (stale)")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shared.schemas.jsonschema",
        description="Generate or check the checked-in JSON Schema of bcd's upstream types.",
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the schema files")
    mode.add_argument("--check", action="store_true", help="exit 1 when a file is drifted, missing or extra")
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR, help=f"default: {DEFAULT_DIR}")
    args = parser.parse_args(argv)
    if args.write:
        for line in write(args.directory):
            print(line)
        return 0
    problems = check(args.directory)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} schema file(s) out of date; run: python -m shared.schemas.jsonschema --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
