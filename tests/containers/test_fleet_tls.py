"""The upstream's TLS refusals, as containers on a private network: one bcd node
(`bcd up --upstream tls://upstream:4222 --upstream-ca/-cert/-key`), the upstream
nats-server (mutual TLS, JetStream) and the reference control plane. The node dials
the network alias `upstream`; the control plane dials the same server by another
alias (`nats-good`), so whatever takes `upstream` meets the node only.

The node takes its holds from a first spec; then, one test each, the upstream is
stopped and something else answers where the node dials:

- a server whose certificate has expired, one not valid yet, one for another name
  (all three signed by the fleet's CA);
- a nats-server in plain text;
- a man in the middle: a nats-server with a certificate for `upstream` from its own
  CA, which lets any client in (as an impostor collecting credentials would);
- and the wrong CA: the node's CA bundle swapped on disk for another fleet's CA
  (picked up at the next reconnect), the right upstream back.

Each is refused within REFUSAL_S, in one line in `bcd status` and as a FAIL of
`bcd doctor`'s `upstream` check inside the node's container; the node keeps its holds;
a card that falls sick meanwhile is an event that waits in the outbox and reaches the
control plane once the right upstream (or CA) is back; the bridge's log says the
refusal once, not at each try. Each impostor's log (trace on)
shows the node came and never sent CONNECT: no credentials left the node.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

from bcd.nodebus import ensure_passwords, upstream_accounts, upstream_password_users
from controlplane.keys import load_or_create_cp_key
from controlplane.put import put_spec_file
from shared.pki import Issued, make_ca
from shared.subjects import CONTROLPLANE_USER, upstream_node_user
from shared.tlsconfig import UpstreamTls, upstream_tls

from .conftest import (
    BCD_GID, NATS_UID, ROOT, TLS_MOUNT, controlplane_container, docker, free_port, nats_tls_block, node_container, read_events, says_info,
    stop_containers, tls_dir, wait_jetstream,
)  # fmt: skip

pytestmark = [pytest.mark.containers, pytest.mark.timeout(300)]

NODE = "tls-1"
#: where the node dials, and the other name the control plane (and the test) reach the right server by
DIAL, GOOD = "upstream", "nats-good"
HOST = json.loads((ROOT / "examples/hosts/h200x8.json").read_text())
GPU = [g["uuid"] for g in HOST["gpus"]]
PCI = {g["uuid"]: g["pci_address"] for g in HOST["gpus"]}
#: a refusal shows in status and doctor within this long of the impostor taking the name
REFUSAL_S = 30.0
#: the right upstream back: the node reconnects and the event kept meanwhile reaches the control plane
BACK_S = 60.0

#: the servers that answer where the node dials instead of the right one: (their CA, certificate, line)
IMPOSTORS = {
    "expired": "has expired",
    "not-yet-valid": "not valid yet",
    "other-name": "does not name the host dialled",
    "plain-text": "offers no TLS (plain text)",
    "mitm": "not signed by the configured CA",
}
#: the free card each test makes sick while refused (GPU 0 and 1 are held)
SICK = {"expired": GPU[2], "not-yet-valid": GPU[3], "other-name": GPU[4], "plain-text": GPU[5], "mitm": GPU[6], "wrong-ca": GPU[7]}


def accounts(passwords: dict[str, str], *, jetstream: bool = True) -> dict:
    """The fleet's layout (bcd fleet): the control plane's account, the node's own account."""
    out = {a.name: a.render() for a in upstream_accounts([NODE], upstream_password_users([NODE], passwords))}
    if not jetstream:
        for a in out.values():
            a.pop("jetstream", None)
    return out


def good_config(passwords: dict[str, str]) -> dict:
    return {
        "server_name": GOOD,
        "host": "0.0.0.0",
        "port": 4222,
        "max_payload": 1024 * 1024,
        "jetstream": {"store_dir": "/data", "sync_interval": "always"},
        "tls": nats_tls_block(verify=True),
        "accounts": accounts(passwords),
    }


def impostor_config(kind: str, passwords: dict[str, str]) -> dict:
    """The node's own user and password are there: only the node's checks keep it out.
    Trace on: a CONNECT would be in the log (with the password redacted)."""
    conf: dict[str, Any] = {
        "server_name": kind,
        "host": "0.0.0.0",
        "port": 4222,
        "debug": True,
        "trace": True,
        "accounts": accounts(passwords, jetstream=False),
    }
    if kind != "plain-text":
        # the man in the middle takes any client; the others verify as the right server does
        conf["tls"] = nats_tls_block(verify=kind != "mitm")
    return conf


def sicken(host: Path, uuid: str) -> None:
    """XID 48 (a double-bit ECC error) on a card, as the fake host's NVML would say it."""
    doc = json.loads(host.read_text())
    card = next(g for g in doc["gpus"] if g["uuid"] == uuid)
    health = card.setdefault("health", {})
    health["xids"] = [*health.get("xids", []), {"xid": 48, "at": datetime.now(timezone.utc).isoformat()}]
    tmp = host.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, host)


def swap(path: Path, source: Path) -> None:
    """`path` becomes a copy of `source` by rename, as a renewal lands (the directory is mounted)."""
    tmp = path.with_name(path.name + ".new")
    shutil.copyfile(source, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def until(what: str, timeout: float, probe: Callable[[], Any]) -> tuple[Any, float]:
    """(the first truthy answer of `probe`, seconds it took); AssertionError with the last answer."""
    t0 = time.monotonic()
    last: Any = None
    while True:
        last = probe()
        if last and not isinstance(last, Exception):
            return last, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f} s; last: {last}")
        time.sleep(0.5)


class Rig:
    def __init__(self, root: Path, image: str) -> None:
        self.root, self.image = root, image
        self.network = Network()
        self.good: DockerContainer | None = None
        self.cp: DockerContainer | None = None
        self.node: DockerContainer | None = None
        self.impostors: list[DockerContainer] = []
        self.port = free_port()
        self.cp_dir = root / "controlplane"
        self.creds = root / "creds"
        self.host = root / "node" / "host" / "host.json"

    # ---------------------------------------------------------------- set-up

    def write(self) -> None:
        creds = ensure_passwords(self.creds, [CONTROLPLANE_USER, upstream_node_user(NODE)])
        self.passwords = {u: p.read_text().strip() for u, p in creds.items()}
        pki = self.root / "pki"
        self.ca = make_ca(pki / "ca.pem", pki / "ca.key", name="bcd fleet test CA")
        #: the impostor's own CA, and another fleet's (the node's wrong bundle)
        own = make_ca(pki / "mitm-ca.pem", pki / "mitm-ca.key", name="bcd fleet test CA")  # the same name, other keys
        self.wrong_ca: Issued = make_ca(pki / "other-ca.pem", pki / "other-ca.key", name="another fleet's CA")
        now = datetime.now(timezone.utc)
        nats = (NATS_UID, BCD_GID)
        server = dict(server=True, owner=nats)
        self.tls = {
            GOOD: tls_dir(self.ca, self.root / GOOD / "tls", common_name=DIAL, names=[DIAL, GOOD, "127.0.0.1"], **server),
            "expired": tls_dir(
                self.ca, self.root / "expired" / "tls", common_name=DIAL, names=[DIAL], not_before=now - timedelta(days=30), not_after=now - timedelta(days=1), **server
            ),
            "not-yet-valid": tls_dir(
                self.ca, self.root / "not-yet-valid" / "tls", common_name=DIAL, names=[DIAL], not_before=now + timedelta(days=1), not_after=now + timedelta(days=30), **server
            ),
            "other-name": tls_dir(self.ca, self.root / "other-name" / "tls", common_name="nats-elsewhere", names=["nats-elsewhere"], **server),
            "mitm": tls_dir(own, self.root / "mitm" / "tls", common_name=DIAL, names=[DIAL], **server),
            "controlplane": tls_dir(self.ca, self.root / "controlplane-tls", common_name=CONTROLPLANE_USER, client=True),
            "node": tls_dir(self.ca, self.root / "node" / "tls", common_name=upstream_node_user(NODE), client=True),
        }
        (self.root / "plain-text").mkdir()
        (self.root / GOOD / "data").mkdir()
        os.chown(self.root / GOOD / "data", *nats)
        (self.root / GOOD / "nats.conf").write_text(json.dumps(good_config(self.passwords)))
        for kind in IMPOSTORS:
            (self.root / kind / "nats.conf").write_text(json.dumps(impostor_config(kind, self.passwords)))
        cp = self.tls["controlplane"]
        self.cp_tls: UpstreamTls = upstream_tls(self.url(), ca=cp / "ca.pem", cert=cp / "cert.pem", key=cp / "key.pem")
        load_or_create_cp_key(self.cp_dir)
        (self.root / "node" / "state").mkdir(parents=True)
        self.host.parent.mkdir(parents=True)
        shutil.copyfile(ROOT / "examples/hosts/h200x8.json", self.host)

    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    def start_good(self) -> None:
        c = (
            DockerContainer(self.image)
            .with_name(f"{self.network.name}-{GOOD}")
            .with_network(self.network)
            .with_network_aliases(DIAL, GOOD)
            .with_bind_ports(4222, self.port)
            .with_volume_mapping(str(self.root / GOOD / "nats.conf"), "/etc/bcd/nats.conf", "ro")
            .with_volume_mapping(str(self.root / GOOD / "data"), "/data", "rw")
            .with_volume_mapping(str(self.tls[GOOD]), TLS_MOUNT, "ro")
            .with_kwargs(user=f"{NATS_UID}:{BCD_GID}", read_only=True, cap_drop=["ALL"], init=True)
            .with_command(["nats-server", "-c", "/etc/bcd/nats.conf"])
        )
        self.good = c.start()

    def start_impostor(self, kind: str) -> DockerContainer:
        c = (
            DockerContainer(self.image)
            .with_name(f"{self.network.name}-{kind}")
            .with_network(self.network)
            .with_network_aliases(DIAL)
            .with_volume_mapping(str(self.root / kind / "nats.conf"), "/etc/bcd/nats.conf", "ro")
            .with_kwargs(user=f"{NATS_UID}:{BCD_GID}", read_only=True, cap_drop=["ALL"], init=True)
            .with_command(["nats-server", "-c", "/etc/bcd/nats.conf"])
        )
        if kind in self.tls:
            c = c.with_volume_mapping(str(self.tls[kind]), TLS_MOUNT, "ro")
        started = c.start()
        self.impostors.append(started)
        return started

    def start_cp(self) -> None:
        self.cp = controlplane_container(self.image, self.network, self.cp_dir, self.creds, self.tls["controlplane"], f"tls://{GOOD}:4222").start()

    def start_node(self) -> None:
        c = node_container(self.image, self.network, NODE, self.root / "node" / "state", self.host.parent, self.creds, self.cp_dir, self.tls["node"], f"tls://{DIAL}:4222")
        # the bridge looks at its TLS files each second (default 10 s): the wrong-CA test waits less
        self.node = c.with_env("BCD_UPSTREAM_TLS_CHECK", "1").start()

    async def wait_good(self, timeout: float = 60) -> None:
        """The right server answers over TLS with JetStream (the test dials it as the control plane)."""
        deadline = time.monotonic() + timeout
        while not says_info(self.port):
            if time.monotonic() > deadline:
                raise AssertionError("the upstream never answered on its published port")
            await asyncio.sleep(0.3)
        await wait_jetstream([self.url()], self.passwords[CONTROLPLANE_USER], self.cp_tls, deadline, 0.5)

    async def put(self, devices: list[dict], generation: int) -> int:
        body = json.dumps({"node_id": NODE, "generation": generation, "devices": devices}).encode()
        result = await put_spec_file(self.url(), CONTROLPLANE_USER, self.creds / f"{CONTROLPLANE_USER}.password", self.cp_dir, body, connect_timeout=10, tls=self.cp_tls)
        return result.generation

    # ---------------------------------------------------------------- what the node and upstream say

    def node_exec(self, *args: str) -> subprocess.CompletedProcess:
        assert self.node is not None
        return subprocess.run(["docker", "exec", self.node.get_wrapped_container().id, *args], capture_output=True, text=True, timeout=60)

    def status(self) -> str:
        """`bcd status` in the node's container (exit 1 while something is unhealthy: the text is what counts)."""
        r = self.node_exec("bcd", "status", "--state-dir", "/state")
        return r.stdout + r.stderr

    def doctor(self) -> dict[str, tuple[str, str]]:
        """`bcd doctor --json`: check name -> (level, message)."""
        r = self.node_exec("bcd", "doctor", "--state-dir", "/state", "--json")
        try:
            checks = json.loads(r.stdout)["checks"]
        except (ValueError, KeyError):
            return {}
        return {c["check"]: (c["level"], c["message"]) for c in checks}

    def events(self) -> list[dict]:
        return read_events(self.cp_dir / "events.jsonl")

    def applied(self, kind: str) -> list[dict]:
        return [e for e in self.events() if e["type"] == kind and e["outcome"] == "applied" and e.get("node_id") == NODE]

    def sick_card_reported(self, uuid: str) -> bool:
        return any((e.get("event") or {}).get("pci_address") == PCI[uuid] and str(e.get("detail", "")).startswith("Failed/") for e in self.applied("gpu"))

    def report(self) -> None:
        for name, c in [("upstream", self.good), ("controlplane", self.cp), *((f"impostor {i}", c) for i, c in enumerate(self.impostors))]:
            if c is None:
                continue
            try:
                out, err = c.get_logs()
                print(f"--- {name}\n" + (out + err).decode(errors="replace")[-1500:])
            except Exception as exc:  # noqa: BLE001
                print(f"--- {name}: no logs ({exc})")
        for log in sorted((self.root / "node" / "state" / "logs").glob("*.log")):
            if log.name.startswith(("gateway_bridge", "inventory")):
                print(f"--- {NODE} {log.name}\n" + log.read_text(errors="replace")[-2000:])

    def stop_all(self) -> None:
        stop_containers([c for c in [*self.impostors, self.node, self.cp, self.good] if c is not None], self.network)

    # ---------------------------------------------------------------- the checks each test makes

    def bridge_log(self) -> str:
        path = self.root / "node" / "state" / "logs" / "gateway_bridge.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def upstream_line(self, status: str) -> str:
        return next((line for line in status.splitlines() if line.startswith("upstream ")), "")

    def refused(self, phrase: str) -> dict | None:
        """What status and doctor say while the node is refused (None until both say `phrase`)."""
        status = self.status()
        line = self.upstream_line(status)
        if phrase not in line or ": connected" in line:
            return None
        doctor = self.doctor().get("upstream")
        if doctor is None or doctor[0] != "fail" or phrase not in doctor[1]:
            return None
        outbox = re.search(r"outbox (\d+) event", status)
        return {"status": status, "line": line, "doctor": doctor[1], "outbox": int(outbox.group(1)) if outbox else -1}

    def connected(self) -> str:
        line = self.upstream_line(self.status())
        return line if ": connected" in line else ""

    def holds_kept(self, status: str) -> None:
        for alloc in (f"{NODE}-keep", f"{NODE}-m1"):
            assert f"hold {alloc} " in status, f"the hold {alloc} is gone from bcd status while refused:\n{status}"


@pytest.fixture(scope="module")
def rig(bcd_image, tmp_path_factory):
    r = Rig(tmp_path_factory.mktemp("fleet-tls"), bcd_image)
    r.write()
    r.network.create()
    try:
        t0 = time.monotonic()
        r.start_good()
        asyncio.run(r.wait_good())
        r.start_cp()
        r.start_node()
        devices = [
            {"allocation_id": f"{NODE}-keep", "reservation_id": f"rsv-{NODE}-keep", "binding": "BINDING_HOLD", "devices": [GPU[0]]},
            {"allocation_id": f"{NODE}-m1", "reservation_id": f"rsv-{NODE}-m1", "binding": "BINDING_HOLD", "devices": [GPU[1]]},
        ]
        gen = asyncio.run(r.put(devices, 1))

        def converged() -> bool:
            return any(
                e["event"]["observed_generation"] == gen and e["event"]["state"] == "CONVERGED"
                for e in r.events()
                if e["type"] == "section" and e["outcome"] == "applied" and e.get("node_id") == NODE
            ) and {e["allocation_id"] for e in r.applied("bound")} >= {f"{NODE}-keep", f"{NODE}-m1"}

        until("the node's first spec converged at the control plane", 120, converged)
        line, _ = until("the node says it is connected over TLS", 30, r.connected)
        assert "(TLS)" in line, line
        print(f"fleet-tls: up and converged over TLS in {time.monotonic() - t0:.1f} s: {line}")
        yield r
    finally:
        r.report()
        r.stop_all()
        gc.collect()


def refused_then_back(rig: Rig, name: str, phrase: str, swap_in: Callable[[], Any], swap_out: Callable[[], None]) -> Any:
    """The right upstream stopped, `swap_in` makes what the node meets instead, a card falls sick:
    the refusal shows (one line, in status and doctor) with the holds kept and the event in the
    outbox; `swap_out` and the right upstream back: the node reconnects, the event arrives."""
    assert rig.good is not None
    good = rig.good.get_wrapped_container().id
    # one that an earlier test left stopped
    docker("start", good)
    until("the node connected before the test", BACK_S, rig.connected)
    t = time.monotonic()
    log_from = len(rig.bridge_log())
    docker("stop", "-t", "5", good)
    what = swap_in()
    sicken(rig.host, SICK[name])
    seen, took = until(f"{name}: the refusal in bcd status and bcd doctor", REFUSAL_S, lambda: rig.refused(phrase))
    print(f"fleet-tls: {name}: refused {took:.1f} s after the swap: {seen['line']!r}; doctor: {seen['doctor']!r}")
    assert len([line for line in seen["status"].splitlines() if line.startswith("upstream ")]) == 1, seen["status"]
    assert "\n" not in seen["doctor"]
    # and the bridge's log says it, once per distinct reason (not at every try, each second)
    said = [line for line in rig.bridge_log()[log_from:].splitlines() if phrase in line]
    assert 1 <= len(said) <= 2, said
    rig.holds_kept(seen["status"])
    # the sick card's event waits for the upstream (a pass reports it within seconds)
    if seen["outbox"] < 1:
        seen, _ = until(f"{name}: the sick card's event counted in the outbox", 20, lambda: rig.refused(phrase))
        assert seen["outbox"] >= 1, seen["status"]
    assert not rig.sick_card_reported(SICK[name])
    t = time.monotonic()
    swap_out()
    docker("start", good)
    line, took = until(f"{name}: the node back on the right upstream", BACK_S, rig.connected)
    until(f"{name}: the event kept meanwhile reached the control plane", BACK_S, lambda: rig.sick_card_reported(SICK[name]))
    print(f"fleet-tls: {name}: connected again and the kept event delivered {time.monotonic() - t:.1f} s after the right upstream was back: {line!r}")
    rig.holds_kept(rig.status())
    return what


def impostor_log(c: DockerContainer) -> str:
    out, err = c.get_logs()
    return (out + err).decode(errors="replace")


def no_credentials_sent(c: DockerContainer, kind: str) -> str:
    """The impostor's log: the node came (a connection, or a handshake it broke off) and no
    CONNECT (the protocol line that carries user and password) ever reached it."""
    log = impostor_log(c)
    assert "Client connection created" in log, f"{kind}: the node never dialled the impostor:\n{log[-3000:]}"
    assert "CONNECT" not in log, f"{kind}: the node sent CONNECT (its credentials) to the impostor:\n{log[-3000:]}"
    return log


@pytest.mark.parametrize("kind", ["expired", "not-yet-valid", "other-name", "plain-text"])
def test_an_upstream_that_is_not_the_fleets_is_refused_in_one_line_and_the_node_keeps_its_holds_and_outbox(rig, kind):
    impostor: list[DockerContainer] = []

    def swap_in() -> None:
        impostor.append(rig.start_impostor(kind))

    def swap_out() -> None:
        no_credentials_sent(impostor[0], kind)
        if kind != "plain-text":
            assert "TLS handshake error" in impostor_log(impostor[0]), impostor_log(impostor[0])[-3000:]
        impostor[0].stop()

    refused_then_back(rig, kind, IMPOSTORS[kind], swap_in, swap_out)


def test_a_man_in_the_middle_with_its_own_ca_for_the_same_name_is_refused_before_any_credentials(rig):
    mitm: list[DockerContainer] = []

    def swap_in() -> None:
        mitm.append(rig.start_impostor("mitm"))

    def swap_out() -> None:
        c = mitm[0]
        log = no_credentials_sent(c, "mitm")
        assert "TLS handshake error" in log, log[-3000:]
        # the log would have shown one: a client that does not verify (in the impostor's own
        # container) goes through the handshake and sends its CONNECT
        probe = (
            "import asyncio, ssl, nats\n"
            "async def main():\n"
            "    ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE\n"
            "    try:\n"
            "        nc = await nats.connect('tls://127.0.0.1:4222', tls=ctx, name='probe', user='probe', password='probe',"
            " connect_timeout=3, allow_reconnect=False, max_reconnect_attempts=0)\n"
            "        await nc.close()\n"
            "    except Exception:\n"
            "        pass\n"
            "asyncio.run(main())\n"
        )
        subprocess.run(["docker", "exec", c.get_wrapped_container().id, "python3", "-c", probe], capture_output=True, text=True, timeout=30)
        log, _ = until("the probe's CONNECT in the impostor's log", 10, lambda: (lambda s: s if "CONNECT" in s else "")(impostor_log(c)))
        assert '"name":"probe"' in log.replace(" ", ""), log[-2000:]
        assert "bcd-bridge" not in log
        c.stop()

    refused_then_back(rig, "mitm", IMPOSTORS["mitm"], swap_in, swap_out)


def test_a_wrong_ca_bundle_on_the_node_refuses_the_right_upstream_until_the_right_bundle_is_back(rig):
    bundle = rig.tls["node"] / "ca.pem"

    def swap_in() -> None:
        swap(bundle, rig.wrong_ca.cert)
        time.sleep(2.5)  # the bridge looks at its files each second (BCD_UPSTREAM_TLS_CHECK)
        assert rig.good is not None
        docker("start", rig.good.get_wrapped_container().id)

    def swap_out() -> None:
        swap(bundle, rig.ca.cert)

    refused_then_back(rig, "wrong-ca", "not signed by the configured CA", swap_in, swap_out)
