"""The .env `bcd compose init` writes for deploy/compose/compose.yaml (bcd/compose.py
env_line): a line Compose v1 (docker-compose 1.29) and v2 both read back as the value,
or a refusal naming why none can be written. tests/containers/test_compose_config.py
checks the same values against both Compose binaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from bcd.compose import env_file_text, env_line, init

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hosts" / "h200x8.json"


@pytest.mark.parametrize("value", ["node-1", "bcd:latest", "/var/lib/bcd/state-1.2", "node-node-1", "14222", ""])
def test_a_plain_value_is_written_bare(value: str) -> None:
    assert env_line("K", value) == f"K={value}\n"


@pytest.mark.parametrize(
    ("value", "line"),
    [
        # v2 expands $HOME in a bare value, v1 does not: single quotes, which v2 never expands
        ("/srv/a$HOME", "K='/srv/a$HOME'\n"),
        # both end a bare value at ' #'
        ("/srv/a #1", "K='/srv/a #1'\n"),
        ("/srv/a b", "K='/srv/a b'\n"),
        # a quote inside: \' , which both read as '
        ("/srv/it's", "K='/srv/it\\'s'\n"),
        ('/srv/a"b', "K='/srv/a\"b'\n"),
        ("/srv/a\\b", "K='/srv/a\\b'\n"),
    ],
)
def test_anything_else_is_single_quoted(value: str, line: str) -> None:
    assert env_line("K", value) == line


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("/srv/${X}", "'${'"),  # v1 expands ${X} even single-quoted
        ("/srv/a\\\\b", "a backslash before a backslash or a quote"),  # v1 reads \\ as \, v2 keeps it
        ("/srv/a\\'b", "a backslash before a backslash or a quote"),
        ("/srv/a\\", "a trailing backslash"),
        ("/srv/a\nb", "a line break"),
    ],
)
def test_a_value_the_two_would_read_differently_is_refused(value: str, why: str) -> None:
    with pytest.raises(ValueError, match="Compose v1 and v2 would read it differently") as exc:
        env_line("BCD_DIR", value)
    assert why in str(exc.value) and "BCD_DIR=" in str(exc.value)


def test_a_path_with_a_colon_is_refused_it_cannot_be_mounted() -> None:
    with pytest.raises(ValueError, match="cannot contain ':'"):
        env_file_text({"BCD_DIR": "/srv/a:b"})
    # the image may hold one (a tag)
    assert env_file_text({"BCD_IMAGE": "bcd:latest"}) == "BCD_IMAGE=bcd:latest\n"


def test_init_refuses_such_a_dir_before_writing_anything(tmp_path: Path) -> None:
    d = tmp_path / "a${X}" / "node"
    with pytest.raises(ValueError, match="BCD_DIR="):
        init(d, "node-1", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert not d.exists()
