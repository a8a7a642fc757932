"""No command prints "internal error" for a situation an operator can be in (issue 28.5).

`bcd apply --state-dir state/compose` ended in `bcd: internal error: KeyFileError: ...cp.key: owned
by uid 10008, not by this control plane (uid 0)`. An exception below the CLI that describes an
operator's situation declares it (`operator_error = True`) and is said as its one line; a real bug
still says internal error. A node whose control plane signs in its own container (the compose
node) names the command that puts a spec there.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from bcd.applycmd import apply_command
from bcd.client import NodeInfo, write_node_info
from bcd.exits import run_command
from controlplane.keys import KeyFileError, load_or_create_cp_key
from controlplane.state import StateError


@pytest.mark.parametrize("exc", [KeyFileError("cp.key: owned by uid 10008, not by this control plane (uid 0)"), StateError("state.json: not JSON")])
def test_an_operator_situation_is_its_line_not_an_internal_error(exc: Exception, capsys: pytest.CaptureFixture[str]) -> None:
    def command(_: object) -> int:
        raise exc

    assert run_command(command, argparse.Namespace()) == 1
    assert capsys.readouterr().err == f"bcd: {exc}\n"


def test_a_bug_still_says_internal_error(capsys: pytest.CaptureFixture[str]) -> None:
    def command(_: object) -> int:
        raise KeyError("x")

    assert run_command(command, argparse.Namespace()) == 1
    assert "internal error: KeyError" in capsys.readouterr().err


def _args(state: Path, spec: Path, **kw: object) -> argparse.Namespace:
    defaults = dict(state_dir=state, spec=spec, allow_unknown_fields=False, dry_run=False, force=False, wait=False, json=False, wait_timeout=5.0, timeout=5.0)
    return argparse.Namespace(**{**defaults, **kw})


def test_apply_on_a_compose_node_names_the_command_that_puts_the_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "compose"
    state.mkdir()
    write_node_info(state, NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir=str(state), controlplane_dir=str(state / "cp"),
                                    put_command=f"deploy/compose/node.sh apply {state} SPEC"))  # fmt: skip
    spec = tmp_path / "s.json"
    spec.write_text('{"node_id": "node-1", "devices": []}')
    assert apply_command(_args(state, spec)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"`deploy/compose/node.sh apply {state} {spec}`" in err and "internal error" not in err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the key file another owner")
def test_a_key_file_of_another_user_is_a_clear_line(tmp_path: Path) -> None:
    load_or_create_cp_key(tmp_path)
    os.chown(tmp_path / "cp.key", 10008, 10008)
    with pytest.raises(KeyFileError) as caught:
        load_or_create_cp_key(tmp_path)
    assert getattr(caught.value, "operator_error", False) and "owned by uid 10008" in str(caught.value)
