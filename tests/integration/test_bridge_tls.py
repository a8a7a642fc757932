"""The bridge over TLS to a real nats-server (issue 31): mutual TLS, each refusal in one line, rotation.

One node (`bcd up --upstream tls://...` with a CA bundle, a client certificate and its
key) binds a hold through an upstream that verifies clients. Then the upstream's port
is taken in turn by servers the node must refuse: an expired certificate, one not
valid yet, one for another name, a plain-text server, a man in the middle with its own
CA's certificate for the right name, and a server that does not trust the node's
client certificate. Each gives one line in `bcd status`, `bcd doctor` (FAIL) and the
bridge's log (once, although nats-py tries every second); the plain-text server and the
man in the middle never see a CONNECT (no credentials sent). The hold stays, an event
made meanwhile waits in the outbox and reaches the control plane, verified, when the
real upstream is back.

Rotation: the CA, the server's and the node's certificates are all replaced while
specs keep coming; the bridge picks the node's renewed files up from disk (no restart)
and its next reconnect, to the upstream now on the new CA, uses them.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bcd.nodebus import UPSTREAM_ACCOUNT, BusUser, NatsServer, ensure_passwords, write_private
from controlplane.keys import load_or_create_cp_key
from controlplane.serve import ControlPlane
from shared import pki
from shared.subjects import CONTROLPLANE_USER, inbox_prefix, upstream_controlplane_permissions, upstream_node_permissions, upstream_node_user
from shared.tlsconfig import client_context, connect_options, new_client, upstream_tls

from .test_e2e_health import throw_xid
from .wholenode import GPU, Node, bcd, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

NODE = "node-1"
REFUSED_WITHIN_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pki:
    """A fleet CA and every certificate the tests serve or present."""

    def __init__(self, d: Path, ca_name: str = "fleet CA") -> None:
        self.dir = d
        self.ca = pki.make_ca(d / "ca.crt", d / "ca.key", name=ca_name)
        self.server = self.leaf("server", names=["127.0.0.1", "localhost"], server=True)
        self.node = self.leaf("node", names=[], client=True, common_name=NODE)
        self.cp = self.leaf("cp", names=[], client=True, common_name=CONTROLPLANE_USER)

    def leaf(self, name: str, *, names: list[str], server: bool = False, client: bool = False, common_name: str = "upstream", **window) -> pki.Issued:
        return pki.issue(self.ca, self.dir / f"{name}.crt", self.dir / f"{name}.key", common_name=common_name, names=names, server=server, client=client, **window)


def upstream_config(tmp: Path, port: int, passwords: dict[str, Path], *, cert: pki.Issued | None, client_ca: Path | None, trace: bool = False) -> Path:
    users = [
        BusUser(CONTROLPLANE_USER, passwords[CONTROLPLANE_USER].read_text().strip(), upstream_controlplane_permissions()).render(),
        BusUser(upstream_node_user(NODE), passwords[upstream_node_user(NODE)].read_text().strip(), upstream_node_permissions(NODE)).render(),
    ]
    conf: dict[str, object] = {
        "host": "127.0.0.1",
        "port": port,
        "jetstream": {"store_dir": str(tmp / "js"), "sync_interval": "always"},
        "accounts": {UPSTREAM_ACCOUNT: {"jetstream": "enabled", "users": users}},
    }
    if cert is not None:
        tls: dict[str, object] = {"cert_file": str(cert.cert), "key_file": str(cert.key), "timeout": 2}
        if client_ca is not None:
            tls.update(ca_file=str(client_ca), verify=True)
        conf["tls"] = tls
    if trace:
        conf.update(debug=True, trace=True)
    path = tmp / f"upstream-{port}-{os.urandom(3).hex()}.json"
    write_private(path, json.dumps(conf))
    return path


async def cp_connect(url: str, password_file: Path, ca: Path, cert: pki.Issued):
    tls = upstream_tls(url, ca=ca, cert=cert.cert, key=cert.key)
    nc = new_client(tls)
    await nc.connect(
        url,
        user=CONTROLPLANE_USER,
        password=password_file.read_text().strip(),
        inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode(),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        **connect_options(tls, client_context(tls)),
    )
    return nc


async def start_cp(url: str, password_file: Path, ca: Path, cert: pki.Issued, key, cp_dir: Path):
    """The control plane on the upstream: its client, its objects, its event loop running."""
    nc = await cp_connect(url, password_file, ca, cert)
    cp = ControlPlane(nc, key, cp_dir, out=None)
    await cp.ensure_upstream()
    stopping = asyncio.Event()
    return nc, cp, stopping, asyncio.create_task(cp.run(stopping))


def spec(generation_note: str, *allocs: tuple[str, str]) -> dict:
    return {
        "node_id": NODE,
        "devices": [{"allocation_id": a, "reservation_id": f"rsv-{a}", "binding": "BINDING_HOLD", "devices": [d]} for a, d in allocs],
    }


def bridge_log(node: Node) -> str:
    path = node.state / "logs" / "gateway_bridge.log"
    return path.read_text() if path.exists() else ""


def doctor_upstream(node: Node) -> dict:
    out = bcd("doctor", "--state-dir", str(node.state), "--json")
    try:
        checks = json.loads(out.stdout)["checks"]
    except (ValueError, KeyError):
        return {}
    return next((c for c in checks if c["check"] == "upstream"), {})


def status_text(node: Node) -> str:
    return bcd("status", "--state-dir", str(node.state)).stdout


def node_args(url: str, cp_pub: Path, passwords: dict[str, Path], ca: Path, cert: pki.Issued) -> tuple[str, ...]:
    return (
        "--node-id", NODE, "--upstream", url, "--cp-key", str(cp_pub),
        "--upstream-password-file", str(passwords[upstream_node_user(NODE)]),
        "--upstream-ca", str(ca), "--upstream-cert", str(cert.cert), "--upstream-key", str(cert.key),
    )


async def wait_active(cp: ControlPlane, reservation: str, node: Node, timeout: float = 90) -> None:
    for _ in range(int(timeout / 0.2)):
        res = cp.reservations().get(reservation)
        if res is not None and res.state == "active":
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{reservation} never active; bridge log: {bridge_log(node)[-3000:]}")


async def test_mutual_tls_and_each_refusal_is_one_line_while_holds_and_outbox_are_kept(tmp_path):
    good = Pki(tmp_path / "pki")
    evil = Pki(tmp_path / "evil", ca_name="impostor CA")
    now = datetime.now(timezone.utc)
    expired = good.leaf("expired", names=["127.0.0.1"], server=True, not_before=now - timedelta(days=30), not_after=now - timedelta(days=1))
    future = good.leaf("future", names=["127.0.0.1"], server=True, not_before=now + timedelta(days=2))
    other_name = good.leaf("othername", names=["elsewhere.example"], server=True)
    passwords = ensure_passwords(tmp_path / "creds", [CONTROLPLANE_USER, upstream_node_user(NODE)])
    port = free_port()
    url = f"tls://127.0.0.1:{port}"
    upstream = NatsServer(upstream_config(tmp_path, port, passwords, cert=good.server, client_ca=good.ca.cert), tmp_path / "up.log").start()
    key, cp_pub = load_or_create_cp_key(tmp_path / "cp")
    cp_nc, cp, stopping, runner = await start_cp(url, passwords[CONTROLPLANE_USER], good.ca.cert, good.cp, key, tmp_path / "cp")
    node = Node(tmp_path, *node_args(url, cp_pub, passwords, good.ca.cert, good.node))
    try:
        await asyncio.to_thread(node.start)
        await cp.put_spec(spec("one", ("a1", GPU[0])), hello_wait=30)
        await wait_active(cp, "rsv-a1", node)
        assert f"upstream {url} (TLS): connected" in status_text(node)
        ok = doctor_upstream(node)
        assert ok["level"] == "ok" and "TLS on" in ok["message"], ok

        # the control plane leaves with its upstream and comes back with it
        stopping.set()
        await runner
        await cp_nc.close()
        upstream.stop()
        cases = [
            ("expired", dict(cert=expired, client_ca=good.ca.cert), "certificate has expired"),
            ("not yet valid", dict(cert=future, client_ca=good.ca.cert), "certificate is not valid yet"),
            ("name mismatch", dict(cert=other_name, client_ca=good.ca.cert), "does not name the host dialled"),
            ("plain text", dict(cert=None, client_ca=None, trace=True), "offers no TLS (plain text)"),
            ("man in the middle", dict(cert=evil.server, client_ca=evil.ca.cert, trace=True), "not signed by the configured CA"),
            ("client certificate refused", dict(cert=good.server, client_ca=evil.ca.cert), "refused this node's client certificate"),
        ]
        for i, (name, kw, phrase) in enumerate(cases):
            log_before = bridge_log(node)
            log_path = tmp_path / f"bad-{i}.log"
            bad = NatsServer(upstream_config(tmp_path / f"bad-{i}", port, passwords, **kw), log_path).start()
            try:
                if i == 0:
                    # an event made while upstream refuses: it waits in the outbox
                    throw_xid(node.host, GPU[5], 48)
                check = await asyncio.to_thread(
                    wait_for, lambda: (c := doctor_upstream(node)) and phrase in c.get("message", "") and c, REFUSED_WITHIN_S, f"doctor's upstream row for {name}"
                )
                assert check["level"] == "fail", (name, check)
                assert phrase in status_text(node), (name, status_text(node))
                await asyncio.sleep(2.5)  # nats-py retries each second: each retry must not log again
                said = bridge_log(node)[len(log_before):].count(phrase)
                assert said == 1, f"{name}: said {said} times in the bridge log"
                assert "a1" in node.holds(), f"{name}: the hold was lost"
                if kw.get("trace"):
                    # refused before CONNECT: no credentials reached the impostor
                    assert "CONNECT" not in log_path.read_text(), f"{name}: the node sent CONNECT"
            finally:
                bad.stop()
            if i == 0:
                st = node.status()
                assert (st.get("outbox") or {}).get("messages", 0) >= 1, st.get("outbox")

        upstream = NatsServer(upstream_config(tmp_path, port, passwords, cert=good.server, client_ca=good.ca.cert), tmp_path / "up.log").start()
        cp_nc, cp, stopping, runner = await start_cp(url, passwords[CONTROLPLANE_USER], good.ca.cert, good.cp, key, tmp_path / "cp")
        await asyncio.to_thread(wait_for, lambda: doctor_upstream(node).get("level") == "ok", 60, "the bridge back on the real upstream")
        await asyncio.to_thread(wait_for, lambda: (node.status().get("outbox") or {}).get("messages") == 0, 60, "the outbox drained")
        await asyncio.to_thread(
            wait_for, lambda: any(r.type == "gpu" and r.outcome == "applied" for r in cp.events()), 60, "the event made while refused, verified by the control plane"
        )
        assert cp.rejected_count() == 0
        assert "a1" in node.holds()
    finally:
        # the node first: a failed step must not leave it running; the upstream last, so the
        # control plane's client closes without a reconnect under way
        node.stop()
        try:
            stopping.set()
            await runner
            await cp_nc.close()
        finally:
            upstream.stop()


async def test_renewed_ca_and_certificates_are_used_at_the_next_reconnect_while_specs_change(tmp_path):
    old = Pki(tmp_path / "old")
    new = Pki(tmp_path / "new", ca_name="renewed fleet CA")
    # what the node reads: copies it owns, renewed in place as an operator's tooling would
    live = tmp_path / "node-tls"
    live.mkdir()
    for name, src in (("ca.crt", old.ca.cert), ("node.crt", old.node.cert), ("node.key", old.node.key)):
        shutil.copyfile(src, live / name)
    (live / "node.key").chmod(0o600)
    passwords = ensure_passwords(tmp_path / "creds", [CONTROLPLANE_USER, upstream_node_user(NODE)])
    port = free_port()
    url = f"tls://127.0.0.1:{port}"
    upstream = NatsServer(upstream_config(tmp_path, port, passwords, cert=old.server, client_ca=old.ca.cert), tmp_path / "up.log").start()
    key, cp_pub = load_or_create_cp_key(tmp_path / "cp")
    cp_nc, cp, stopping, runner = await start_cp(url, passwords[CONTROLPLANE_USER], old.ca.cert, old.cp, key, tmp_path / "cp")
    live_cert = pki.Issued(live / "node.crt", live / "node.key")
    node = Node(tmp_path, *node_args(url, cp_pub, passwords, live / "ca.crt", live_cert), env={"BCD_UPSTREAM_TLS_CHECK": "0.5"})
    try:
        await asyncio.to_thread(node.start)
        await cp.put_spec(spec("one", ("a1", GPU[0])), hello_wait=30)
        await wait_active(cp, "rsv-a1", node)
        bridge_pid = node.pids()["gateway_bridge"]

        # specs change while the files are renewed: a2 comes, then a1 goes
        await cp.put_spec(spec("two", ("a1", GPU[0]), ("a2", GPU[1])))
        # the key first, then its certificate: a check in between sees a pair that does not
        # match, keeps the old one and says so; the next check loads the whole renewal
        shutil.copyfile(new.node.key, live / "node.key.tmp")
        os.replace(live / "node.key.tmp", live / "node.key")
        await asyncio.sleep(1.2)
        shutil.copyfile(new.node.cert, live / "node.crt.tmp")
        os.replace(live / "node.crt.tmp", live / "node.crt")
        shutil.copyfile(new.ca.cert, live / "ca.crt.tmp")
        os.replace(live / "ca.crt.tmp", live / "ca.crt")
        await wait_active(cp, "rsv-a2", node)
        await asyncio.to_thread(wait_for, lambda: "upstream TLS files renewed" in bridge_log(node), 20, "the bridge to load the renewed files")
        assert "upstream TLS files changed but do not load" in bridge_log(node), "the half-renewed pair was not said"

        # the upstream moves to the new CA; the control plane too
        stopping.set()
        await runner
        await cp_nc.close()
        upstream.stop()
        upstream = NatsServer(upstream_config(tmp_path, port, passwords, cert=new.server, client_ca=new.ca.cert), tmp_path / "up.log").start()
        cp_nc, cp, stopping, runner = await start_cp(url, passwords[CONTROLPLANE_USER], new.ca.cert, new.cp, key, tmp_path / "cp")
        await cp.put_spec(spec("three", ("a2", GPU[1])))
        await asyncio.to_thread(wait_for, lambda: doctor_upstream(node).get("level") == "ok", 60, "the bridge reconnected on the renewed files")
        await asyncio.to_thread(
            wait_for, lambda: cp.reservations().get("rsv-a1") is not None and cp.reservations()["rsv-a1"].state != "active", 60, "a1 released upstream"
        )
        assert node.pids()["gateway_bridge"] == bridge_pid, "the bridge was restarted"
        assert node.holds() == {"a2"}
        assert cp.rejected_count() == 0
    finally:
        # the node first: a failed step must not leave it running; the upstream last, so the
        # control plane's client closes without a reconnect under way
        node.stop()
        try:
            stopping.set()
            await runner
            await cp_nc.close()
        finally:
            upstream.stop()
