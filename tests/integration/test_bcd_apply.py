"""`bcd apply` against a whole node: strict specs, unknown nodes, `--wait` to the outcome, `--dry-run`.

Every wait is bounded: `--wait-timeout` inside, the subprocess timeout outside.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from bcd.client import connect, node_info
from shared.subjects import NodeSubjects

from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "specs" / "demo.json"
WAIT = ("--wait", "--wait-timeout", "60")


def write(node: Node, doc: dict) -> Path:
    path = node.tmp / f"spec-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(doc))
    return path


def apply(node: Node, path: Path, *flags: str, timeout: float = 90):
    return bcd("apply", str(path), "--state-dir", str(node.state), *flags, timeout=timeout)


def last_generation(node: Node) -> int:
    rec = node.cp_state().nodes.get("node-1")
    return rec.last_generation if rec else 0


def conditions(node: Node, ctype: str) -> list:
    return [e for e in applied(node, "condition") if (e.event or {}).get("condition", {}).get("type") == ctype]


def test_wait_follows_each_hold_to_the_outcome_and_dry_run_puts_nothing(node: Node) -> None:
    # the demo: three holds bind, three are refused -> FAILED, exit 1
    out = apply(node, DEMO, *WAIT)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    gen = int(lines[0].split("generation")[1].split(";")[0])
    assert lines[0] == f"applied {DEMO} as generation {gen}; waiting for the node's outcome..."
    for alloc in ("train-01", "notebook-mig", "infer-slots"):
        assert any(line.startswith(f"bound    {alloc} (rsv-{alloc})") for line in lines), out.stdout
    assert any(line.startswith("bound    train-01") and "cgroup parent bcd-alloc-" in line for line in lines), out.stdout
    assert "failed   late-overlap (rsv-late-overlap)  overlap: GPU-5f1c2a90-0000-4000-8000-000000000001 is held by train-01" in lines
    assert any(line.startswith("failed   not-yet-created (rsv-not-yet-created)  device-missing: ") for line in lines)
    assert any(line.startswith("failed   too-big (rsv-too-big)  resources-exhausted: ResourcesExhausted: ") for line in lines)
    assert lines[-1] == f"generation {gen}: FAILED (3 bound, 0 kept, 3 failed, 0 released)"

    # a dry run of a change: the plan against the holds now, nothing put
    # train-01 exactly as the demo assigned it: kept (the same allocation with other limits or env is
    # another assignment, released and bound again: issue 28.1)
    train = next(a for a in json.loads(DEMO.read_text())["devices"] if a["allocation_id"] == "train-01")
    change = {"node_id": "node-1", "devices": [train, assignment("new-one", GPU[2]), assignment("clash", GPU[2])]}
    path = write(node, change)
    before = (last_generation(node), node.holds(), len(node.events()))
    dry = apply(node, path, "--dry-run", timeout=30)
    assert dry.returncode == 1, dry.stdout + dry.stderr  # its plan refuses one
    text = dry.stdout
    assert text.startswith("DRY RUN: nothing was put."), text
    assert f"as generation {gen + 1}" in text.splitlines()[0]
    assert "  keep     train-01 (rsv-train-01)" in text
    assert "  bind     new-one (rsv-new-one)  GPU-5f1c…0003" in text
    assert "  refuse   clash (rsv-clash)  overlap: GPU-5f1c2a90-0000-4000-8000-000000000003 is held by new-one" in text
    for alloc in ("notebook-mig", "infer-slots"):
        assert f"  release  {alloc} (rsv-{alloc})" in text
    assert "would be: FAILED (1 bind, 1 keep, 2 release, 1 refuse)" in text
    time.sleep(1.0)
    assert (last_generation(node), node.holds(), len(node.events())) == before
    assert node.section()["observed_generation"] == gen
    doc = json.loads(apply(node, path, "--dry-run", "--json", timeout=30).stdout)
    assert doc["dry_run"] is True and doc["state"] == "FAILED"
    assert {h["allocation_id"]: h["action"] for h in doc["holds"]} == {
        "train-01": "keep", "new-one": "bind", "clash": "refuse", "notebook-mig": "release", "infer-slots": "release"
    }  # fmt: skip

    # a converging spec: exit 0, the kept hold said as kept, the released ones as released
    rebind = write(node, {"node_id": "node-1", "devices": [assignment("train-01", GPU[0])]})
    dry = apply(node, rebind, "--dry-run", "--json", timeout=30)
    assert {h["allocation_id"]: h["action"] for h in json.loads(dry.stdout)["holds"]}["train-01"] == "rebind", dry.stdout

    ok = write(node, {"node_id": "node-1", "devices": [train, assignment("new-one", GPU[2])]})
    out = apply(node, ok, *WAIT, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["outcome"] == "CONVERGED" and doc["exit_code"] == 0 and doc["generation"] == gen + 1
    assert doc["section"]["state"] == "CONVERGED" and doc["section"]["observed_generation"] == gen + 1
    results = {a["allocation_id"]: a["result"] for a in doc["allocations"]}
    assert results == {"train-01": "kept", "new-one": "bound"}
    assert sorted(r["allocation_id"] for r in doc["released"]) == ["infer-slots", "notebook-mig"]
    assert "released notebook-mig (rsv-notebook-mig)" in out.stderr  # the lines go to stderr with --json
    assert node.holds() == {"train-01", "new-one"}


def test_strict_specs_unknown_nodes_and_the_unknown_fields_condition(node: Node) -> None:
    typo = {
        "node_id": "node-1",
        "devicez": [],
        "devices": [{**assignment("t1", GPU[3]), "limit": {"cpus": "0-3"}, "priority": 5}],
    }
    path = write(node, typo)
    gen_before = last_generation(node)

    # refused by default, each field named with its path, nothing put
    out = apply(node, path, timeout=30)
    assert out.returncode == 2, out.stdout + out.stderr
    assert '$.devices[0].limit: unknown field (did you mean "limits"?)' in out.stderr
    assert "$.devices[0].priority: unknown field" in out.stderr
    assert '$.devicez: unknown field (did you mean "devices"?)' in out.stderr
    assert "nothing was put" in out.stderr and out.stdout == ""
    assert last_generation(node) == gen_before and not node.holds()
    # the control plane's own put refuses it the same way
    cp = node.cp_dir
    info = node_info(node.state)
    put = subprocess.run(
        [
            sys.executable, "-m", "controlplane", "put", str(path), "--state-dir", str(cp),
            "--nats-url", info.upstream_url or info.nats_url, "--password-file", str(Path(info.creds_dir) / "controlplane.password"),
        ],
        capture_output=True, text=True, timeout=30, cwd=REPO,
    )  # fmt: skip
    assert put.returncode == 2, put.stdout + put.stderr
    assert "$.devices[0].limit: unknown field" in put.stderr
    assert last_generation(node) == gen_before

    # a node the control plane never heard from: refused in one line, unless --force
    other = write(node, {"node_id": "node-9", "devices": [assignment("x", GPU[0])]})
    out = apply(node, other, timeout=30)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().count("\n") == 0 and "node node-9 has never announced itself" in out.stderr and "--force" in out.stderr
    assert "node-9" not in node.cp_state().nodes or node.cp_state().nodes["node-9"].last_generation == 0
    # --force puts it; nobody answers, so --wait ends at its timeout with exit 3
    out = apply(node, other, "--force", "--wait", "--wait-timeout", "2", timeout=30)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "no outcome within 2 s" in out.stdout and "the node may be down" in out.stdout
    assert node.cp_state().nodes["node-9"].last_generation >= 1

    # --allow-unknown-fields: put as given; the node binds what it knows and raises the warning condition
    out = apply(node, path, "--allow-unknown-fields", *WAIT)
    assert out.returncode == 0, out.stdout + out.stderr
    gen = int(out.stdout.splitlines()[0].split("generation")[1].split()[0])
    assert "with 3 field(s) this control plane does not know, as given" in out.stdout.splitlines()[0]
    assert "bound    t1 (rsv-t1)" in out.stdout
    assert node.holds() == {"t1"}

    def raised():
        return [e for e in conditions(node, "NodeSpecUnknownFields") if e.event["condition"]["status"] == "True"]

    [event] = wait_for(raised, 30, "the NodeSpecUnknownFields condition in the control plane's events")
    c = event.event["condition"]
    assert c["reason"] == "UnknownFields" and c["message"].startswith(f"generation {gen}: 3 fields this node does not know, ignored: ")
    for text in ('$.devices[0].limit: unknown field (did you mean "limits"?)', "$.devices[0].priority: unknown field", "$.devicez: unknown field"):
        assert text in c["message"]
    assert event.verified is None and event.outcome == "applied"
    status = node.status()
    [shown] = [x for x in status["converger"]["conditions"] if x["type"] == "NodeSpecUnknownFields"]
    assert shown["status"] == "True" and shown["message"] == c["message"]
    doctor = bcd("doctor", "--state-dir", str(node.state))
    assert any(line.startswith("WARN  spec-fields") and "NodeSpecUnknownFields" in line for line in doctor.stdout.splitlines()), doctor.stdout

    # once per generation: more passes of the same generation raise nothing new
    async def passes() -> None:
        nc = await connect(info)
        try:
            for _ in range(3):
                await nc.request(NodeSubjects("node-1").converger_pass, b"", timeout=5)
                await asyncio.sleep(0.3)
        finally:
            await nc.close()

    asyncio.run(passes())
    node.wait_generation(gen, timeout=30)
    time.sleep(1.0)
    assert len(raised()) == 1

    # a later generation without unknown fields clears it (once)
    clean = write(node, {"node_id": "node-1", "devices": [assignment("t1", GPU[3])]})
    out = apply(node, clean, *WAIT)
    assert out.returncode == 0, out.stdout + out.stderr

    def cleared():
        return [e for e in conditions(node, "NodeSpecUnknownFields") if e.event["condition"]["status"] == "False"]

    [off] = wait_for(cleared, 30, "the condition cleared")
    assert off.event["condition"]["reason"] == "NoUnknownFields"
    assert [x["status"] for x in node.status()["converger"]["conditions"] if x["type"] == "NodeSpecUnknownFields"] == ["False"]


def _spec_of_signed_size(target: int) -> dict:
    """A spec whose NodeSpec JSON, as a put signs it (at the widest generation), is `target` bytes:
    device-less holds whose env lines pad it, the last hold's lines trimmed to the byte."""
    from controlplane.specs import check_spec, signed_bytes
    from shared.schemas.common import INT64_MAX

    full = 3990

    def doc(n: int, a: int, b: int) -> dict:
        holds = [{**assignment(f"pad-{i:03d}"), "env": [f"PAD_A=x{'y' * full}", f"PAD_B=x{'y' * full}"]} for i in range(n)]
        holds[-1]["env"] = [f"PAD_A=x{'y' * a}", f"PAD_B=x{'y' * b}"]
        return {"node_id": "node-1", "devices": holds}

    def size(d: dict) -> int:
        return len(signed_bytes(check_spec(json.dumps(d)), INT64_MAX))

    n = 1
    while size(doc(n, full, full)) < target:
        n += 1
    short = size(doc(n, full, full)) - target
    a = full - min(short, full)
    b = full - (short - (full - a))
    out = doc(n, a, b)
    assert 0 <= b <= full and size(out) == target, (n, a, b, size(out), target)
    return out


def test_the_dry_run_and_the_apply_give_one_answer_at_the_size_limit(node: Node) -> None:
    """Issue 41.6: a 991 KB spec: `--dry-run` said it would converge, `bcd apply` exited 3 ("node not
    reachable", `nats: maximum payload exceeded`) and burned a generation each try. One function
    (controlplane.specs.spec_limit: the node bus's max_payload less the signed envelope) now decides
    for both: one byte over is exit 2 naming the limit from each, with no generation spent; at the
    limit, the dry run accepts it and the apply carries it to the node."""
    from controlplane.specs import spec_limit

    limit = spec_limit(1024 * 1024)  # the node bus's max_payload (bcd/nodebus.py)
    gen = node.apply(json.loads(DEMO.read_text()))
    over = write(node, _spec_of_signed_size(limit + 1))
    for flags in (("--dry-run",), ("--no-wait",), ("--no-wait",)):
        out = apply(node, over, *flags, timeout=60)
        assert out.returncode == 2, (flags, out.stdout, out.stderr)
        assert f"above the {limit} bytes a spec may be here" in out.stderr and "not reachable" not in out.stderr, out.stderr
        assert out.stderr.strip().count("\n") == 0, out.stderr
    assert last_generation(node) == gen  # two refused tries cost no generation

    fits = write(node, _spec_of_signed_size(limit))
    dry = apply(node, fits, "--dry-run", "--json", timeout=60)
    assert dry.returncode in (0, 1) and json.loads(dry.stdout)["generation"] == gen + 1, dry.stdout + dry.stderr
    out = apply(node, fits, "--no-wait", timeout=60)
    assert out.returncode == 0 and f"as generation {gen + 1}" in out.stdout, out.stdout + out.stderr
    # and the node takes it: the bridge relays the envelope and the converger reports the generation
    node.wait_generation(gen + 1, timeout=120)


def test_wait_says_nothing_the_node_did_not_report_with_the_converger_stopped(node: Node) -> None:
    """Issue 41.7: with the converger stopped (SIGSTOP), `apply --wait` printed `kept ... (bound at an
    earlier generation)` for every hold of a generation the converger never saw. Now: no hold line,
    TIMEOUT (exit 3), every hold pending; once it runs again the node's own report decides."""
    demo = json.loads(DEMO.read_text())
    gen = node.apply(demo)
    node.wait_generation(gen)
    again = write(node, {**demo, "devices": [a for a in demo["devices"] if a["allocation_id"] != "too-big"]})
    pid = node.pids()["converger"]
    os.kill(pid, signal.SIGSTOP)
    try:
        out = apply(node, again, "--wait", "--wait-timeout", "3", "--json", timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert out.returncode == 3, out.stdout + out.stderr
    doc = json.loads(out.stdout)
    assert doc["outcome"] == "TIMEOUT" and doc["generation"] == gen + 1
    assert {a["result"] for a in doc["allocations"]} == {"pending"}
    assert not any(line.startswith(("kept", "bound")) for line in out.stderr.splitlines()), out.stderr
    assert f"generation {gen + 1}: no outcome within 3 s, TIMEOUT" in out.stderr
    # the converger runs again and reports the generation: the same holds, now said kept by the node
    node.wait_generation(gen + 1)


def test_a_generation_in_the_file_never_wedges_the_node(node: Node) -> None:
    """Issue 41.5: `bcd apply --wait gmax.json` with `"generation": 9223372036854775807` put the node
    there, and every later apply was refused. Now the file's generation is ignored, said; asked for
    (--generation-from-file) above 2^53 - 1 it is refused as input by the apply and the dry run alike,
    with no generation spent; the node goes on taking specs."""
    top = 2**63 - 1
    gmax = write(node, {**json.loads(DEMO.read_text()), "generation": top})
    out = apply(node, gmax, *WAIT)
    assert out.returncode == 1, out.stdout + out.stderr  # the demo: three holds refused
    gen = last_generation(node)
    assert 1 <= gen < 2**53 and f"applied {gmax} as generation {gen}" in out.stdout, out.stdout
    assert f"note: {gmax}: its generation {top} is ignored; the control plane puts the next one" in out.stderr
    for flags in (("--dry-run",), ("--no-wait",)):
        asked = apply(node, gmax, "--generation-from-file", *flags, timeout=60)
        assert asked.returncode == 2, (flags, asked.stdout, asked.stderr)
        assert f"generation {top} is above the largest a put may ask for (4503599627370496, 2^52)" in asked.stderr
        assert "internal error" not in asked.stderr and asked.stderr.strip().count("\n") == 0, asked.stderr
    assert last_generation(node) == gen
    # the next apply is taken, and the node follows it
    nxt = apply(node, write(node, {"node_id": "node-1", "devices": [assignment("after", GPU[5])]}), *WAIT)
    assert nxt.returncode == 0 and f"as generation {gen + 1}" in nxt.stdout, nxt.stdout + nxt.stderr
    # the largest a put may ask for, then the count: the node stays where the count and a rebase
    # can go on (asked at 2^53 - 1, the count then crossed it and no rebase had a generation left)
    most = write(node, {"node_id": "node-1", "generation": 2**52, "devices": [assignment("after", GPU[5])]})
    assert apply(node, most, "--generation-from-file", *WAIT).returncode == 0
    assert last_generation(node) == 2**52
    assert apply(node, write(node, {"node_id": "node-1", "devices": [assignment("after", GPU[5])]}), *WAIT).returncode == 0
    assert last_generation(node) == 2**52 + 1
    assert bcd("status", "--state-dir", str(node.state)).returncode == 0


async def _put_at_the_top(node: Node) -> None:
    """What an earlier release (or another control plane with the same key) did: the node's spec
    signed and put at 2^63 - 1, recorded as put; no bcd of this release gets a node there."""
    from controlplane.buckets import UpstreamObjects
    from controlplane.keys import load_or_create_cp_key
    from controlplane.state import StateStore, apply_spec, now_utc
    from controlplane.upstream import close, connect_upstream
    from shared.schemas import NODE_SPEC_CODEC, SIGNED_NODE_SPEC_CODEC, encode
    from shared.signing import sign_node_spec
    from shared.subjects import CONTROLPLANE_USER, UPSTREAM_NODESPECS_BUCKET

    info = node_info(node.state)
    key, _ = load_or_create_cp_key(node.cp_dir)
    nc = await connect_upstream(info.nats_url, CONTROLPLANE_USER, Path(info.creds_dir) / f"{CONTROLPLANE_USER}.password", reconnect=False)
    try:
        kv = await UpstreamObjects(nc.jetstream(timeout=5.0), 1).bucket(UPSTREAM_NODESPECS_BUCKET)
        spec = NODE_SPEC_CODEC.decode(SIGNED_NODE_SPEC_CODEC.decode((await kv.get("node-1")).value).spec)
        top = msgspec.structs.replace(spec, generation=2**63 - 1)
        with StateStore(node.cp_dir).transaction() as st:
            apply_spec(st, top, now_utc())
        await kv.put("node-1", encode(sign_node_spec(key, top)))
    finally:
        await close(nc)


def test_a_node_at_the_top_is_rebased_by_its_control_plane_with_its_holds_kept(node: Node) -> None:
    """Issue 41.5: a node at 2^63 - 1 refused every later apply and only `rm -rf state` (every hold
    lost) brought it back. Now apply and its dry run say so in one line (exit 1, naming the way
    back, no internal error), and `bcd rebase` - the control plane, with its key - puts the node's
    spec again at a generation its count goes on from; the node takes it though it is lower (the
    signed `rebase_from` names the generation it replaces), keeps every hold (no Released, no second
    Bound), and takes the next apply."""
    top = 2**63 - 1
    gen = node.apply({"node_id": "node-1", "devices": [assignment("a", GPU[0]), assignment("b", GPU[1])]})
    node.wait_generation(gen)
    asyncio.run(_put_at_the_top(node))
    node.wait_generation(top)
    before = (node.holds(), [e.event_id for e in applied(node, "bound")], applied(node, "released"))
    assert before[0] == {"a", "b"} and len(before[1]) == 2 and before[2] == []
    # status and doctor say so (they said `health: ok`): a person rebases it
    for cmd in ("status", "doctor"):
        said = bcd(cmd, "--state-dir", str(node.state))
        assert said.returncode == 1 and f"spec generation {top} is above 2^53 - 1" in said.stdout and "`bcd rebase`" in said.stdout, said.stdout

    another = write(node, {"node_id": "node-1", "devices": [assignment("c", GPU[2])]})
    for flags in ((), ("--dry-run",)):
        out = apply(node, another, *flags, timeout=60)
        assert out.returncode == 1, (flags, out.stdout, out.stderr)
        assert f"node node-1 is at generation {top}, the largest a spec can carry" in out.stderr and "`bcd rebase`" in out.stderr
        assert "internal error" not in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr

    out = bcd("rebase", "--state-dir", str(node.state), "--wait", "--wait-timeout", "60", timeout=90)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"rebased node node-1 from generation {top} to {gen + 1}: its spec as it was, its holds kept" in out.stdout
    assert f"generation {gen + 1}: CONVERGED (0 bound, 2 kept, 0 failed, 0 released)" in out.stdout, out.stdout
    assert node.section()["observed_generation"] == gen + 1
    # the holds as they were: no Released, no second Bound
    assert (node.holds(), [e.event_id for e in applied(node, "bound")], applied(node, "released")) == before
    assert "above 2^53 - 1" not in bcd("status", "--state-dir", str(node.state)).stdout
    # nothing left to rebase; the count goes on from the rebased generation
    again = bcd("rebase", "--state-dir", str(node.state), "--no-wait", timeout=60)
    assert again.returncode == 1 and "nothing to rebase" in again.stderr, again.stdout + again.stderr
    nxt = apply(node, write(node, {"node_id": "node-1", "devices": [assignment("a", GPU[0]), assignment("b", GPU[1]), assignment("c", GPU[2])]}), *WAIT)
    assert nxt.returncode == 0 and f"as generation {gen + 2}" in nxt.stdout, nxt.stdout + nxt.stderr
    assert node.holds() == {"a", "b", "c"} and applied(node, "released") == []
