"""The whole node end to end, through the upstream contract only.

`bcd up` runs as a user runs it (a supervisor process, nats-server, every
service and the reference control plane as processes); specs go in through
`bcd apply` (signed, into `bcd_nodespecs`), and what the control plane
verified is read back from its event log and state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import msgspec
import nats
import pytest
from shared.signing import Ed25519PrivateKey

from bcd.nodebus import NatsServer, prepare_node_bus
from controlplane.ledger import EventRecord
from shared.schemas import AllocationBound, ReportBody, encode
from shared.signing import sign_node_spec, sign_report
from shared.subjects import CONTROLPLANE_USER, inbox_prefix, upstream_node_user

from .harness import REPO, upstream_only
from .wholenode import GPU, Node, applied, assignment, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

def test_the_demo_spec_and_a_gpu_moving_between_allocations(node):
    demo = json.loads((REPO / "examples" / "specs" / "demo.json").read_text())
    gen = node.apply(demo)
    st = node.wait_generation(gen)
    assert st["converger"]["section"]["state"] == "FAILED"
    assert node.holds() == {"train-01", "notebook-mig", "infer-slots"}
    bound = applied(node, "bound")
    assert {e.allocation_id for e in bound} == {"train-01", "notebook-mig", "infer-slots"}
    assert all(e.verified for e in bound)
    failed = {e.allocation_id: e for e in applied(node, "failed")}
    assert {a: e.event["reason"] for a, e in failed.items()} == {
        "late-overlap": "overlap",
        "not-yet-created": "device-missing",
        "too-big": "resources-exhausted",
    }
    res = node.cp_state().reservations
    assert res["rsv-train-01"].state == "active" and res["rsv-too-big"].state == "failed"
    assert res["rsv-too-big"].reason == "resources-exhausted"
    assert node.cp_state().nodes["node-1"].boot_ids == [json.loads(node.host.read_text())["boot_id"]]

    # generation 2: GPU 0 moves from train-01 to train-02 in one pass
    gen2 = node.apply({"node_id": "node-1", "devices": [d for d in demo["devices"] if d["allocation_id"] in ("notebook-mig", "infer-slots")] + [assignment("train-02", GPU[0], cpus="0-7")]})
    node.wait_generation(gen2)
    assert node.holds() == {"notebook-mig", "infer-slots", "train-02"}
    released = applied(node, "released")
    assert [e.allocation_id for e in released] == ["train-01"] and released[0].verified
    assert node.cp_state().reservations["rsv-train-02"].state == "active"
    assert node.cp_state().reservations["rsv-train-01"].state == "released"


def test_kill_9_of_every_process_during_spec_changes_loses_and_repeats_nothing(node):
    """Each step applies a new generation and kills one process (every service, the
    control plane and nats-server in turn); at the end the node holds exactly the
    last spec and the control plane saw one verified Bound per bind and one
    verified Released per release."""
    victims = ["converger", "gateway_bridge", "signer", "inventory", "kube_reaper", "nats-server", "controlplane", "converger"]
    sequence: list[list[dict]] = []
    gpus = list(range(8))
    for step, _ in enumerate(victims):
        # two whole GPUs per generation, rotating, so every step releases and binds
        a, b = gpus[(2 * step) % 6], gpus[(2 * step + 1) % 6]
        sequence.append([assignment(f"s{step}-a", GPU[a], cpus=f"{a}"), assignment(f"s{step}-b", GPU[b])])
    last_gen = 0
    for step, victim in enumerate(victims):
        last_gen = apply_with_retry(node, {"node_id": "node-1", "devices": sequence[step]})
        time.sleep(0.15 * (step % 3))  # hit different phases of the pass
        kill(node, victim)
    node.wait_generation(last_gen, timeout=120)
    final = {a["allocation_id"] for a in sequence[-1]}
    assert node.holds() == final

    # the outbox is drained once upstream has the events; the control plane may still be
    # judging the last ones (a killed control plane sees its unacked message again first)
    def settled():
        b = {e.allocation_id for e in applied(node, "bound")}
        r = {e.allocation_id for e in applied(node, "released")}
        return b - r == final and r <= b

    with contextlib.suppress(AssertionError):
        wait_for(settled, 60, "the control plane to apply every event")
    bound = applied(node, "bound")
    released = applied(node, "released")
    assert all(e.verified for e in bound + released)
    bound_ids = Counter(e.event_id for e in bound)
    assert all(c == 1 for c in bound_ids.values())
    b = Counter(e.allocation_id for e in bound)
    r = Counter(e.allocation_id for e in released)
    # a generation may be superseded before its pass: its holds were then never bound nor released
    assert all(c == 1 for c in b.values()) and all(c == 1 for c in r.values())
    assert set(r) <= set(b)
    assert set(b) - set(r) == final
    assert not [e for e in node.events() if e.outcome == "rejected"]


def apply_with_retry(node: Node, spec: dict) -> int:
    def attempt():
        path = node.tmp / f"spec-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(spec))
        out = bcd("apply", str(path), "--state-dir", str(node.state))
        return int(out.stdout.split("generation")[1].split()[0]) if out.returncode == 0 else None

    return wait_for(attempt, 60, "the control plane to take the spec (the bus may be restarting)", interval=0.5)


def kill(node: Node, victim: str) -> None:
    if victim == "nats-server":
        pid = int(subprocess.run(["pgrep", "-f", str(node.state / "bus" / "nats.conf")], capture_output=True, text=True).stdout.split()[0])
    elif victim == "controlplane":
        assert node.proc is not None
        pid = int(subprocess.run(["pgrep", "-P", str(node.proc.pid), "-f", "controlplane serve"], capture_output=True, text=True).stdout.split()[0])
    else:
        pids = wait_for(lambda: node.pids().get(victim), 60, f"{victim} to answer")
        pid = pids
    os.kill(pid, signal.SIGKILL)


def test_forged_older_and_foreign_specs_are_refused_and_the_last_good_stays(node):
    gen = node.apply({"node_id": "node-1", "devices": [assignment("keep", GPU[0])]})
    node.wait_generation(gen)

    async def put_raw(payload: bytes) -> None:
        creds = node.state / "bus" / "creds"
        nc = await nats.connect(
            json.loads((node.state / "node.json").read_text())["upstream_url"],
            user=CONTROLPLANE_USER,
            password=(creds / f"{CONTROLPLANE_USER}.password").read_text().strip(),
            inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode(),
        )
        try:
            await nc.jetstream().publish("$KV.bcd_nodespecs.node-1", payload)
        finally:
            await nc.close()

    from shared.schemas import NodeSpec

    forged = sign_node_spec(Ed25519PrivateKey.generate(), NodeSpec(node_id="node-1", generation=gen + 5))
    asyncio.run(put_raw(encode(forged)))
    def raised():
        cond = node.cp_state().nodes["node-1"].conditions.get("NodeSpecRejected")
        return cond if cond is not None and cond.status == "True" else None

    cond = wait_for(raised, 30, "NodeSpecRejected raised")
    assert "configured control-plane key" in cond.message

    from controlplane.keys import load_or_create_cp_key

    key, _ = load_or_create_cp_key(node.cp_dir)
    older = sign_node_spec(key, NodeSpec(node_id="node-1", generation=gen - 1))
    asyncio.run(put_raw(encode(older)))
    wait_for(lambda: "lower than the applied" in node.cp_state().nodes["node-1"].conditions["NodeSpecRejected"].message, 30, "older spec refused")

    foreign = sign_node_spec(key, NodeSpec(node_id="node-2", generation=gen + 9))
    asyncio.run(put_raw(encode(foreign)))
    wait_for(lambda: "names node node-2" in node.cp_state().nodes["node-1"].conditions["NodeSpecRejected"].message, 30, "foreign spec refused")

    # the last good spec is still what the node holds
    assert node.holds() == {"keep"}
    assert node.status()["converger"]["generation"] == gen
    doctor = bcd("doctor", "--state-dir", str(node.state))
    assert "signed-specs" in doctor.stdout

    # a good spec clears the condition
    gen2 = node.apply({"node_id": "node-1", "devices": [assignment("keep", GPU[0]), assignment("more", GPU[1])]})
    node.wait_generation(gen2)
    wait_for(lambda: node.cp_state().nodes["node-1"].conditions["NodeSpecRejected"].status == "False", 30, "condition cleared")


def test_a_report_signed_with_another_key_is_rejected_by_the_control_plane(node):
    gen = node.apply({"node_id": "node-1", "devices": [assignment("real", GPU[0])]})
    node.wait_generation(gen)
    hello_boot = node.cp_state().nodes["node-1"].boot_ids[-1]

    async def forge() -> None:
        creds = node.state / "bus" / "creds"
        user = upstream_node_user("node-1")
        nc = await nats.connect(
            json.loads((node.state / "node.json").read_text())["upstream_url"],
            user=user,
            password=(creds / f"{user}.password").read_text().strip(),
            inbox_prefix=inbox_prefix(user).encode(),
        )
        try:
            body = ReportBody(
                node_id="node-1",
                boot_id=hello_boot,
                event_id="node-1.stolen.bound.g1",
                time=__import__("datetime").datetime.now(__import__("datetime").timezone.utc),
                event=AllocationBound(allocation_id="stolen", reservation_id="rsv-stolen", generation=1, devices=[GPU[3]]),
            )
            report = sign_report(Ed25519PrivateKey.generate(), body)
            await nc.jetstream().publish("bcd.events.node-1.bound", encode(report), headers={"Nats-Msg-Id": "node-1.stolen.bound.g1"})
        finally:
            await nc.close()

    asyncio.run(forge())
    rejected = wait_for(lambda: [e for e in node.events() if e.outcome == "rejected"], 30, "the forged report to be rejected")
    assert rejected[0].allocation_id == "stolen" and rejected[0].verified is False
    assert "rsv-stolen" not in node.cp_state().reservations or node.cp_state().reservations["rsv-stolen"].state != "active"


def test_upstream_outage_grows_the_outbox_and_loses_nothing(tmp_path):
    """A separate upstream server: stalled (SIGSTOP), then killed and restarted on its store."""
    up_dir = tmp_path / "upstream"
    conf, creds = prepare_node_bus(up_dir / "bus", up_dir / "js", "node-1", upstream_nodes=["node-1"])
    cfg = upstream_only(conf)  # this server plays upstream alone
    upstream = NatsServer(conf, up_dir / "nats.log").start()
    cfg["port"] = upstream.port
    conf.write_text(json.dumps(cfg))
    cp_state = tmp_path / "cp"
    cp_log = open(tmp_path / "cp.log", "ab")  # noqa: SIM115
    cp = subprocess.Popen(
        [sys.executable, "-m", "controlplane", "serve", "--nats-url", upstream.url, "--user", CONTROLPLANE_USER,
         "--password-file", str(creds[CONTROLPLANE_USER]), "--state-dir", str(cp_state)],
        stdout=cp_log, stderr=cp_log, cwd=REPO,
    )
    wait_for(lambda: (cp_state / "cp.pub").exists(), 30, "the control plane key")
    node = Node(
        tmp_path,
        "--upstream", upstream.url,
        "--cp-key", str(cp_state / "cp.pub"),
        "--upstream-user", upstream_node_user("node-1"),
        "--upstream-password-file", str(creds[upstream_node_user("node-1")]),
    )
    try:
        node.start()

        def put(devices: list[dict]) -> int:
            path = tmp_path / f"spec-{time.monotonic_ns()}.json"
            path.write_text(json.dumps({"node_id": "node-1", "devices": devices}))
            out = subprocess.run(
                [sys.executable, "-m", "controlplane", "put", str(path), "--nats-url", upstream.url, "--user", CONTROLPLANE_USER,
                 "--password-file", str(creds[CONTROLPLANE_USER]), "--state-dir", str(cp_state)],
                capture_output=True, text=True, cwd=REPO, timeout=30,
            )
            assert out.returncode == 0, out.stderr
            return int(out.stdout.strip().splitlines()[-1])

        def cp_events() -> list[EventRecord]:
            dec = msgspec.json.Decoder(EventRecord)
            path = cp_state / "events.jsonl"
            return [dec.decode(x) for x in path.read_bytes().splitlines() if x.strip()] if path.exists() else []

        gen1 = put([assignment("a", GPU[0]), assignment("b", GPU[1])])
        wait_for(lambda: len([e for e in cp_events() if e.type == "bound"]) == 2, 60, "gen 1 bound upstream")

        async def put_then_stall(devices: list[dict]) -> int:
            """Put the spec, then stall upstream at once (SIGSTOP): the bridge has the
            spec's KV message, but nothing it forwards can be acknowledged."""
            from controlplane.keys import load_or_create_cp_key
            from controlplane.serve import ControlPlane

            key, _ = load_or_create_cp_key(cp_state)
            nc = await nats.connect(upstream.url, user=CONTROLPLANE_USER, password=creds[CONTROLPLANE_USER].read_text().strip(),
                                    inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode(), allow_reconnect=False)
            try:
                result = await ControlPlane(nc, key, cp_state, out=None).put_spec({"node_id": "node-1", "devices": devices})
                os.kill(upstream.proc.pid, signal.SIGSTOP)
                return result.generation
            finally:
                with contextlib.suppress(Exception):
                    nc._transport.close()  # the server is stalled: no graceful close

        gen2 = asyncio.run(put_then_stall([assignment("b", GPU[1]), assignment("c", GPU[2]), assignment("d", GPU[3])]))
        try:
            local = wait_for(
                lambda: (lambda s: s if ((s.get("converger") or {}).get("section") or {}).get("observed_generation") == gen2 and (s.get("outbox") or {}).get("messages", 0) > 0 else None)(node.status()),
                60,
                "gen 2 applied locally with events waiting in the outbox",
            )
            # released a, bound c, bound d and the section all wait for upstream
            assert local["outbox"]["messages"] >= 3
            time.sleep(2.5)
            bridge_metrics = node.ping()["gateway_bridge"]["metadata"]["metrics"]
            text = urllib.request.urlopen(f"http://{bridge_metrics}/metrics", timeout=5).read().decode()
            depth = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("bcd_outbox_depth ")))
            age = float(next(line.split()[-1] for line in text.splitlines() if line.startswith("bcd_outbox_oldest_age_seconds ")))
            assert depth >= 3 and age > 1.0
            assert not {"c", "d"} & {e.allocation_id for e in cp_events() if e.type == "bound"}
        finally:
            os.kill(upstream.proc.pid, signal.SIGCONT)
        # then a real outage: killed, and back on the same port and store
        upstream.kill()
        time.sleep(2)
        upstream.start()
        wait_for(lambda: {e.allocation_id for e in cp_events() if e.type == "bound"} >= {"a", "b", "c", "d"}, 90, "gen 2 reported after the outage")
        wait_for(lambda: {e.allocation_id for e in cp_events() if e.type == "released"} == {"a"}, 60, "release of a reported")
        evs = [e for e in cp_events() if e.type in ("bound", "released") and e.outcome == "applied"]
        assert all(e.verified for e in evs)
        assert Counter(e.event_id for e in evs).most_common(1)[0][1] == 1
        assert node.holds() == {"b", "c", "d"}
        assert gen2 > gen1
    finally:
        node.stop()
        cp.send_signal(signal.SIGTERM)
        try:
            cp.wait(20)
        except subprocess.TimeoutExpired:
            cp.kill()
        cp_log.close()
        upstream.stop()
