"""`make test`'s two lanes (tests/lanes.py): which arguments keep one plain pytest run."""

from __future__ import annotations

import pytest

from tests.lanes import _names_tests


@pytest.mark.parametrize(
    ("args", "one_run"),
    [
        pytest.param([], False, id="the-whole-suite: lanes"),
        pytest.param(["-p", "no:cacheprovider"], False, id="ci-args: lanes"),
        pytest.param(["-q", "-x"], False, id="flags: lanes"),
        pytest.param(["tests/unit"], True, id="a-path"),
        pytest.param(["tests/unit/test_lanes.py::test_x"], True, id="a-node-id"),
        pytest.param(["-k", "health"], True, id="k"),
        pytest.param(["-kfoo"], True, id="k-joined"),
        pytest.param(["-m", "integration"], True, id="m"),
        pytest.param(["--lf"], True, id="last-failed"),
    ],
)
def test_which_arguments_run_one_pytest(args: list[str], one_run: bool) -> None:
    assert _names_tests(args) is one_run
