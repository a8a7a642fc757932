"""`bcd apply` at the edges a person types: an empty or broken spec file, one unknown field, a
node whose control plane signs in its own container. Each is one clear line and puts nothing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bcd.applycmd import apply_command
from bcd.client import NodeInfo, write_node_info

GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"
HOLD = {"allocation_id": "a1", "reservation_id": "rsv-a1", "binding": "BINDING_HOLD", "devices": [GPU0]}


def run(tmp_path: Path, body: str, capsys, **flags) -> tuple[int, list[str], str]:
    spec = tmp_path / "spec.json"
    spec.write_text(body)
    args = argparse.Namespace(
        spec=spec, state_dir=tmp_path / "state", json=flags.pop("json", False), dry_run=flags.pop("dry_run", False), wait=False,
        wait_timeout=5.0, allow_unknown_fields=False, force=False, timeout=1.0,
        generation_from_file=flags.pop("generation_from_file", False), **flags,
    )  # fmt: skip
    code = apply_command(args)
    out = capsys.readouterr()
    return code, [line for line in out.err.splitlines() if line.strip()], out.out


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        pytest.param("", "spec: empty (a NodeSpec is a JSON object)", id="empty-file"),
        pytest.param("  \n\t\n", "spec: empty (a NodeSpec is a JSON object)", id="only-whitespace"),
        pytest.param("node_id: node-1\n", "spec: not valid JSON", id="yaml-is-not-json"),
        pytest.param('{"node_id": "node-1",', "spec: not valid JSON", id="truncated"),
        pytest.param("[]", "spec:", id="not-an-object"),
    ],
)
def test_a_spec_that_is_not_a_node_spec_is_one_line(tmp_path: Path, capsys, body: str, expected: str) -> None:
    code, err, out = run(tmp_path, body, capsys)
    assert code == 2 and out == ""
    assert len(err) == 1, err
    assert err[0].startswith(f"bcd apply: {tmp_path / 'spec.json'}: {expected}"), err
    # said once (issue 28.8: "not valid JSON (spec: not valid JSON (...))")
    assert err[0].count("not valid JSON") <= 1, err


def test_one_unknown_field_is_one_line(tmp_path: Path, capsys) -> None:
    body = json.dumps({"node_id": "node-1", "devices": [{**HOLD, "limit": {"cpus": "0-3"}}]})
    code, err, _ = run(tmp_path, body, capsys)
    assert code == 2
    assert err == [
        f'bcd apply: {tmp_path / "spec.json"}: $.devices[0].limit: unknown field (did you mean "limits"?); '
        "nothing was put (--allow-unknown-fields puts it as given, for a newer node)"
    ]


def test_several_unknown_fields_are_listed_under_one_heading(tmp_path: Path, capsys) -> None:
    body = json.dumps({"node_id": "node-1", "devicez": [], "devices": [{**HOLD, "priority": 1}]})
    code, err, _ = run(tmp_path, body, capsys)
    assert code == 2
    assert "2 fields NodeSpec does not know; nothing was put" in err[0]
    assert sorted(err[1:]) == sorted(['  $.devicez: unknown field (did you mean "devices"?)', "  $.devices[0].priority: unknown field"])


def test_a_node_that_signs_in_its_container_names_the_command_that_puts(tmp_path: Path, capsys) -> None:
    state = tmp_path / "state"
    state.mkdir()
    write_node_info(
        state,
        NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir=str(state), put_command="deploy/compose/node.sh apply /srv/node SPEC"),
    )
    code, err, out = run(tmp_path, json.dumps({"node_id": "node-1", "devices": [HOLD]}), capsys, json=True)
    assert code == 2
    assert len(err) == 1 and f"put the spec with `deploy/compose/node.sh apply /srv/node {tmp_path / 'spec.json'}`" in err[0], err
    assert json.loads(out)["outcome"] == "REFUSED"


def test_a_dry_run_on_a_node_that_signs_in_its_container_advises_the_command_that_puts(tmp_path: Path, capsys, monkeypatch) -> None:
    """Issue 41.14: the dry run on a compose node ended with "`bcd apply` without --dry-run puts it",
    which `bcd apply` refuses there; its advice is now the refusal's (one function for both)."""
    from bcd import dryrun

    state = tmp_path / "state"
    state.mkdir()
    write_node_info(
        state,
        NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir=str(state), put_command="deploy/compose/node.sh apply /srv/node SPEC"),
    )
    planned = dryrun.DryRun(node_id="node-1", generation=1, state="CONVERGED", message="", holds=[], switches=[], notes=[])
    monkeypatch.setattr(dryrun, "dry_run", lambda _info, _spec, _checked=None: planned)
    code, _, out = run(tmp_path, json.dumps({"node_id": "node-1", "devices": [HOLD]}), capsys, dry_run=True)
    assert code == 0
    last = out.splitlines()[-1]
    assert last.endswith(f"put the spec with `deploy/compose/node.sh apply /srv/node {tmp_path / 'spec.json'}`"), last
    assert "bcd apply" not in last


# ------------------------------------------------------------------ generations (issue 41.5)

INT64_MAX = 2**63 - 1


def test_a_generation_in_the_file_is_ignored_with_a_word_unless_asked(tmp_path: Path, capsys, monkeypatch) -> None:
    """`"generation": 9223372036854775807` in a file put the node at the top for good: the CLI
    never takes a generation from the file unasked; what it puts has none (the control plane's next)."""
    from bcd import applycmd

    put: list[bytes] = []

    async def fake_put(_state, data, **_kw):
        from controlplane.specs import PutResult, check_spec

        put.append(data)
        return PutResult(spec=check_spec(data).draft, revision=1, requested_generation=check_spec(data).requested)

    state = tmp_path / "state"
    state.mkdir()
    write_node_info(state, NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir=str(state), controlplane_dir=str(tmp_path / "cp")))
    monkeypatch.setattr(applycmd, "put_through_node", fake_put)
    body = json.dumps({"node_id": "node-1", "generation": INT64_MAX, "devices": [HOLD]})
    code, err, _ = run(tmp_path, body, capsys, generation_from_file=False)
    assert code == 0, err
    assert err == [f"note: {tmp_path / 'spec.json'}: its generation {INT64_MAX} is ignored; the control plane puts the next one (--generation-from-file takes it)"]
    assert "generation" not in json.loads(put[-1])


@pytest.mark.parametrize("dry_run", [False, True], ids=["apply", "dry-run"])
@pytest.mark.parametrize("asked", [INT64_MAX, 2**53 - 1, 2**52 + 1], ids=["int64-top", "2^53-1", "2^52+1"])
def test_a_generation_asked_for_above_2_52_is_refused_as_input(tmp_path: Path, capsys, dry_run: bool, asked: int) -> None:
    """2^53 - 1 itself too: a put there left no generation for a rebase to go to (seen from outside)."""
    body = json.dumps({"node_id": "node-1", "generation": asked, "devices": [HOLD]})
    code, err, _ = run(tmp_path, body, capsys, generation_from_file=True, dry_run=dry_run)
    assert code == 2 and len(err) == 1, err
    assert f"generation {asked} is above the largest a put may ask for ({2**52}, 2^52)" in err[0]
    assert "internal error" not in err[0]


def test_a_node_at_the_top_is_said_by_the_dry_run_with_the_way_out_not_an_internal_error(tmp_path: Path, capsys, monkeypatch) -> None:
    """The dry run printed `internal error: BadMessage` for a node whose last generation is 2^63 - 1."""
    from controlplane.state import StateStore, reserve_generation

    cp = tmp_path / "cp"
    with StateStore(cp).transaction() as st:
        reserve_generation(st, "node-1", INT64_MAX)
    state = tmp_path / "state"
    state.mkdir()
    write_node_info(state, NodeInfo(node_id="node-1", nats_url="nats://127.0.0.1:1", creds_dir=str(state), controlplane_dir=str(cp)))
    code, err, _ = run(tmp_path, json.dumps({"node_id": "node-1", "devices": [HOLD]}), capsys, generation_from_file=False, dry_run=True)
    assert code == 1 and len(err) == 1, err
    assert f"node node-1 is at generation {INT64_MAX}, the largest a spec can carry" in err[0] and 'docs/upstream.md, "Generations"' in err[0]
