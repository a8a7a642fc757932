"""The bridge against upstreams that authenticate it by nkey or by token, and
an upstream shared by two nodes where each node's user touches only its own
keys and subjects."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import nats.js.errors
import nkeys
import pytest

from bcd.nodebus import BusConfig, BusUser, NatsServer, ensure_passwords, prepare_node_bus, upstream_accounts, write_private
from controlplane.keys import load_or_create_cp_key
from controlplane.serve import ControlPlane
from shared.schemas import AllocationBound, ReportBody, encode
from shared.subjects import (
    CONTROLPLANE_USER,
    inbox_prefix,
    upstream_controlplane_permissions,
    upstream_node_permissions,
    upstream_node_user,
    upstream_spec_get_subject,
)

from .harness import EXAMPLE_HOSTS, REPO, upstream_only

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def start_node(tmp: Path, upstream_url: str, cp_pub: Path, *cred_args: str) -> subprocess.Popen[bytes]:
    log = open(tmp / "up.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "bcd.cli", "up", "--state-dir", str(tmp / "state"), "--fake-host", str(EXAMPLE_HOSTS / "h200x8.json"),
         "--any-ports", "--upstream", upstream_url, "--cp-key", str(cp_pub), *cred_args],
        stdout=log, stderr=log, cwd=REPO, env={k: v for k, v in os.environ.items() if not k.startswith("BCD_")},
    )
    log.close()
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def bound_through(cp_nc, tmp: Path, node_id: str, proc: subprocess.Popen[bytes]) -> None:
    """The upstream starts empty: the bridge waits for the buckets (and says so), never creates them."""
    bridge_log = tmp / "state" / "logs" / "gateway_bridge.log"
    for _ in range(300):
        if bridge_log.exists() and "waiting for upstream KV bucket bcd_nodespecs" in bridge_log.read_text():
            break
        if proc.poll() is not None:
            raise AssertionError(f"bcd up exited with {proc.returncode}")
        await asyncio.sleep(0.2)
    else:
        raise AssertionError("the bridge never said it waits for the upstream bucket")
    js = cp_nc.jetstream()
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.stream_info("KV_bcd_nodespecs")
    key, _ = load_or_create_cp_key(tmp / "cp")
    cp = ControlPlane(cp_nc, key, tmp / "cp", out=None)
    await cp.ensure_upstream()
    stopping = asyncio.Event()
    runner = asyncio.create_task(cp.run(stopping))
    try:
        await cp.put_spec({"node_id": node_id, "devices": [{"allocation_id": "a1", "reservation_id": "rsv-a1", "binding": "BINDING_HOLD", "devices": [GPU0]}]})
        for _ in range(300):
            if proc.poll() is not None:
                raise AssertionError(f"bcd up exited with {proc.returncode}: {(tmp / 'up.log').read_text()[-2000:]}")
            res = cp.reservations().get("rsv-a1")
            if res is not None and res.state == "active":
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"never bound; bridge log: {(tmp / 'state' / 'logs' / 'gateway_bridge.log').read_text()[-2000:]}")
        assert cp.rejected_count() == 0
        hello = await cp.node_hello(node_id)
        assert hello is not None and hello.node_id == node_id
    finally:
        stopping.set()
        await runner


async def test_bridge_authenticates_upstream_with_an_nkey(tmp_path):
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(seed).public_key.decode()
    seed_file = tmp_path / "node.nk"
    write_private(seed_file, seed + b"\n")
    creds = ensure_passwords(tmp_path / "creds", [CONTROLPLANE_USER])
    users = {
        CONTROLPLANE_USER: BusUser(CONTROLPLANE_USER, creds[CONTROLPLANE_USER].read_text().strip(), upstream_controlplane_permissions()),
        upstream_node_user("node-1"): BusUser(upstream_node_user("node-1"), "", upstream_node_permissions("node-1"), nkey=public),
    }
    cfg = BusConfig(store_dir=tmp_path / "js", accounts=upstream_accounts(["node-1"], users))
    write_private(tmp_path / "up.conf", cfg.render())
    upstream = NatsServer(tmp_path / "up.conf", tmp_path / "up.log").start()
    proc = start_node(tmp_path, upstream.url, load_or_create_cp_key(tmp_path / "cp")[1], "--upstream-nkey-file", str(seed_file))
    cp_nc = await nats.connect(upstream.url, user=CONTROLPLANE_USER, password=creds[CONTROLPLANE_USER].read_text().strip(), inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode())
    try:
        await bound_through(cp_nc, tmp_path, "node-1", proc)
    finally:
        await cp_nc.close()
        stop(proc)
        upstream.stop()


async def test_bridge_authenticates_upstream_with_a_token(tmp_path):
    token = "tok-" + os.urandom(12).hex()
    write_private(tmp_path / "token", token + "\n")
    conf = {
        "host": "127.0.0.1",
        "port": -1,
        "jetstream": {"store_dir": str(tmp_path / "js"), "sync_interval": "always"},
        "authorization": {"token": token},
    }
    write_private(tmp_path / "up.conf", json.dumps(conf))
    upstream = NatsServer(tmp_path / "up.conf", tmp_path / "up.log").start()
    proc = start_node(tmp_path, upstream.url, load_or_create_cp_key(tmp_path / "cp")[1], "--upstream-token-file", str(tmp_path / "token"))
    cp_nc = await nats.connect(upstream.url, token=token, inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode())
    try:
        await bound_through(cp_nc, tmp_path, "node-1", proc)
    finally:
        await cp_nc.close()
        stop(proc)
        upstream.stop()


async def test_one_node_cannot_write_anothers_events_or_read_its_spec(tmp_path):
    """Two nodes share an upstream; node-1 runs for real, node-2's keys exist too."""
    conf, creds = prepare_node_bus(tmp_path / "bus", tmp_path / "js", "node-1", upstream_nodes=["node-1", "node-2"])
    upstream_only(conf)  # this server plays upstream alone
    upstream = NatsServer(conf, tmp_path / "up.log").start()
    cp_pub = load_or_create_cp_key(tmp_path / "cp")[1]
    proc = start_node(
        tmp_path, upstream.url, cp_pub,
        "--upstream-user", upstream_node_user("node-1"),
        "--upstream-password-file", str(creds[upstream_node_user("node-1")]),
    )
    cp_nc = await nats.connect(upstream.url, user=CONTROLPLANE_USER, password=creds[CONTROLPLANE_USER].read_text().strip(), inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode())
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    user = upstream_node_user("node-1")
    n1 = await nats.connect(upstream.url, user=user, password=creds[user].read_text().strip(), inbox_prefix=inbox_prefix(user).encode(), error_cb=on_error)
    try:
        await bound_through(cp_nc, tmp_path, "node-1", proc)
        key, _ = load_or_create_cp_key(tmp_path / "cp")
        cp = ControlPlane(cp_nc, key, tmp_path / "cp", out=None)
        await cp.put_spec({"node_id": "node-2", "devices": []})

        # node-1's credentials read node-1's spec...
        own = await n1.request(upstream_spec_get_subject("node-1"), b"", timeout=3)
        assert own.data
        # ...but not node-2's, and cannot publish node-2's events or records
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await n1.request(upstream_spec_get_subject("node-2"), b"", timeout=1)
        body = ReportBody(node_id="node-2", boot_id="b", event_id="node-2.x.bound.g1", time=__import__("datetime").datetime.now(__import__("datetime").timezone.utc),
                          event=AllocationBound(allocation_id="x", reservation_id="rsv-x", generation=1, devices=[]))
        await n1.publish("bcd.events.node-2.bound", encode(body))
        await n1.publish("$KV.bcd_nodes.node-2", b"{}")
        await n1.subscribe("$KV.bcd_nodespecs.node-2")
        await n1.flush()
        await asyncio.sleep(0.5)
        # nats-py lowercases the subject in its violation messages
        text = " | ".join(str(e) for e in errors).lower()
        assert 'publish to "bcd.events.node-2.bound"' in text and 'publish to "$kv.bcd_nodes.node-2"' in text
        assert 'subscription to "$kv.bcd_nodespecs.node-2"' in text
        assert 'publish to "$js.api.direct.get.kv_bcd_nodespecs.$kv.bcd_nodespecs.node-2"' in text
    finally:
        await n1.close()
        await cp_nc.close()
        stop(proc)
        upstream.stop()
