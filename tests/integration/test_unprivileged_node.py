"""Unprivileged nodes (seed: "Unprivileged nodes"; DESIGN 2): a real node whose
converger is not on a fake host and not root, with and without the root helper.

The converger runs as a real OS process under an unprivileged uid, with its
own data directory and password file, and no fake host: it sees itself as an
ordinary user on a real host. As root the tests run it as `nobody`; where
`nobody` cannot reach the interpreter (a venv on a Python installed under
root's 0700 home, as on this project's machines) in a user namespace of its
own, where it sees itself as uid 65534 (see RunAs); not as root, as the test
user. The inventory stays on the fakehw host file (the GPUs
must come from somewhere) and the signer, bridge and helper run as the test
user. Upstream is the reference control plane's account on the same
nats-server, read and written through `controlplane.serve.ControlPlane`.

Without a helper the node claims none of cdi / devices.limits /
binding.kubernetes, a plain hold fails at once with node-unprivileged and
nothing is written, `bcd doctor` warns gpu-binding, and the section failure
is logged at ERROR. With a root helper started later the converger finds it
(it looks every --helper-recheck-interval, and before each pass), binds holds
through it, and a write the helper cannot do (helper gone) is logged WARN
and retried until it comes back. A helper gone for --helper-lost-after makes
the node unprivileged again, exactly as one that never had a helper: its Hello
drops the capabilities, a new plain hold fails with node-unprivileged, doctor
warns; the holds it bound stay; the helper back, it binds again.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from bcd.client import NodeInfo, write_node_info
from bcd.nodebus import NatsServer, prepare_node_bus
from controlplane.keys import load_or_create_cp_key
from controlplane.serve import ControlPlane
from controlplane.upstream import connect_upstream
from shared.runtime import call
from shared.schemas import CONVERGER_STATUS_CODEC, ConvergerStatus, DeviceAssignment, Empty, Hello, Limits, NodeSpec
from shared.subjects import CONTROLPLANE_USER, UPSTREAM_EVENTS_STREAM, NodeSubjects, upstream_node_user

from .harness import EXAMPLE_HOSTS, REPO, NodeBus, ServiceProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

NODE = "node-1"
GPU = [f"GPU-5f1c2a90-0000-4000-8000-00000000000{i}" for i in range(1, 9)]
#: what an unprivileged node must not claim (seed: Hello claims nothing)
HOST_CAPABILITIES = {"cdi", "devices.limits", "binding.kubernetes"}
T = TypeVar("T")


CLONE_NEWUSER = 0x10000000


def _enter_user_namespace() -> None:
    """preexec_fn: a new user namespace with no mapping: the process sees itself as uid 65534."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")


@dataclass(frozen=True)
class RunAs:
    """How the converger runs unprivileged.

    setuid:  as `nobody` (real uid 65534, no capabilities), its dirs chowned to it;
    userns:  in a user namespace of its own (it sees itself as uid 65534 and has no
             capability outside it), where nobody cannot reach the interpreter (a
             venv on a Python under root's 0700 home, as on this project's machines);
    self:    the tests do not run as root: the converger runs as the test user.
    """

    mode: str
    uid: int = -1
    gid: int = -1

    def popen_args(self) -> dict[str, Any]:
        if self.mode == "setuid":
            return {"user": self.uid, "group": self.gid, "extra_groups": []}
        if self.mode == "userns":
            return {"preexec_fn": _enter_user_namespace}
        return {}


def _probe(run_as: RunAs) -> str:
    try:
        probe = subprocess.run(  # noqa: S603
            [sys.executable, "-c", "import os, services.converger.service; print(os.geteuid())"],
            cwd=REPO, capture_output=True, text=True, timeout=60, **run_as.popen_args(),
        )  # fmt: skip
    except OSError as exc:
        return str(exc)
    if probe.returncode != 0:
        return probe.stderr[-300:]
    return "" if probe.stdout.strip() != "0" else "still uid 0"


@pytest.fixture(scope="module")
def run_as() -> RunAs:
    if os.geteuid() != 0:
        return RunAs("self")
    tried = []
    try:
        pw = pwd.getpwnam("nobody")
        candidates = [RunAs("setuid", pw.pw_uid, pw.pw_gid)]
    except KeyError:
        candidates = []
        tried.append("no user 'nobody'")
    candidates.append(RunAs("userns"))
    for candidate in candidates:
        problem = _probe(candidate)
        if not problem:
            return candidate
        tried.append(f"{candidate.mode}: {problem}")
    pytest.skip("cannot run the converger unprivileged here: " + "; ".join(tried))


async def wait_for(what: str, probe: Callable[[], Awaitable[T | None]], timeout: float = 20.0) -> T:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = await probe()
        except Exception as exc:  # noqa: BLE001 - a service may not answer yet
            last = exc
        else:
            if last:
                return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")



def plain(alloc: str, gpu: str, **kw: Any) -> DeviceAssignment:
    return DeviceAssignment(allocation_id=alloc, reservation_id=f"rsv-{alloc}", binding="BINDING_HOLD", devices=[gpu], **kw)


class UnprivilegedNode:
    """A node on one nats-server (node bus and upstream accounts) with an unprivileged converger."""

    def __init__(self, root: Path, run_as: RunAs) -> None:
        self.root = root
        self.run_as = run_as
        self.bus = NodeBus(root, node_id=NODE)
        conf, self.bus.creds = prepare_node_bus(root / "bus", root / "js", NODE, admin=True, upstream_nodes=[NODE])
        self.bus.server = NatsServer(conf, root / "bus" / "nats-server.log").start()
        self.bus.setup_streams()
        self.subjects = NodeSubjects(NODE)
        self.host = root / "host.json"
        self.host.write_bytes((EXAMPLE_HOSTS / "h200x8.json").read_bytes())
        self.cdi, self.run = root / "cdi", root / "run"
        for d in (self.cdi, self.run):
            d.mkdir(mode=0o755)
        self.cp_key, self.cp_pub = load_or_create_cp_key(root / "cp")
        self.converger: ServiceProcess | None = None
        self.cp: ControlPlane | None = None
        #: more BCD_* settings of the converger
        self.converger_env: dict[str, str] = {}

    def fake(self) -> dict[str, str]:
        return {"BCD_FAKE_HOST": str(self.host), "BCD_ADAPTER": "fakehw"}

    async def start(self) -> None:
        bus = self.bus
        bus.start_service("signer", **self.fake())
        bus.start_service("inventory", **self.fake())
        bus.start_service(
            "gateway_bridge",
            BCD_UPSTREAM_URL=bus.url,
            BCD_UPSTREAM_PASSWORD_FILE=str(bus.creds[upstream_node_user(NODE)]),
            BCD_CP_KEY=str(self.cp_pub),
            BCD_RESYNC_INTERVAL="1",
        )
        self.converger = self.start_converger()
        nc = await connect_upstream(bus.url, CONTROLPLANE_USER, bus.creds[CONTROLPLANE_USER], reconnect=False)
        bus.clients.append(nc)
        self.cp = ControlPlane(nc, self.cp_key, self.root / "cp", out=None)
        await self.cp.ensure_upstream()
        for name in ("signer", "inventory", "converger", "gateway_bridge"):
            await bus.wait_service(name)
        self.cli = await bus.connect("cli")

    def start_converger(self) -> ServiceProcess:
        """The converger as an ordinary user on a real host: no fake host, its own data dir and password."""
        own = self.root / "converger"
        own.mkdir(mode=0o700)
        password = own / "nats.password"
        shutil.copyfile(self.bus.creds["converger"], password)
        password.chmod(0o600)
        # the control plane's public key where that user can read it (cp/ is the test's, 0700)
        cp_pub = own / "cp.pub"
        shutil.copyfile(self.cp_pub, cp_pub)
        if self.run_as.mode == "setuid":
            for p in (own, password, cp_pub):
                os.chown(p, self.run_as.uid, self.run_as.gid)
        env = self.bus.env(
            "converger",
            BCD_DATA_DIR=str(own / "data"),
            BCD_NATS_PASSWORD_FILE=str(password),
            BCD_CP_KEY=str(cp_pub),
            # not a fake host: the slice backend is named (fake JSON records; never systemd here)
            BCD_SLICES="fake",
            BCD_RETRY_INTERVAL="0.5",
            BCD_HELPER_RECHECK_INTERVAL="0.3",
            **self.converger_env,
        )
        assert "BCD_FAKE_HOST" not in env
        log_path = self.root / "logs" / "converger.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(  # noqa: S603
                [sys.executable, "-m", "services.converger"],
                env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO, **self.run_as.popen_args(),
            )  # fmt: skip
        sp = ServiceProcess("converger", proc, log_path)
        self.bus.services.append(sp)
        return sp

    def start_helper(self) -> ServiceProcess:
        """The root helper (the test user: root here), writing where the converger reads."""
        return self.bus.start_service("helper", BCD_SLICES="fake")

    async def status(self) -> ConvergerStatus:
        return await call(self.cli, self.subjects.converger_status, Empty(), CONVERGER_STATUS_CODEC)

    async def section(self, generation: int, *states: str) -> ConvergerStatus | None:
        st = await self.status()
        ok = st.section is not None and st.section.observed_generation == generation and st.section.state in states
        return st if ok else None

    async def events(self, kind: str) -> list[tuple[str, bytes]]:
        """(subject, data) of every upstream event of one type, in order."""
        assert self.cp is not None
        js = self.cp.js
        info = await js.stream_info(UPSTREAM_EVENTS_STREAM)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(UPSTREAM_EVENTS_STREAM, seq)
            if msg.subject == f"bcd.events.{NODE}.{kind}":
                out.append((msg.subject, msg.data))
        return out

    async def hello(self) -> Hello | None:
        assert self.cp is not None
        return await self.cp.node_hello(NODE)

    async def capabilities(self) -> list[str] | None:
        hello = await self.hello()
        return None if hello is None else list(hello.capabilities)

    def doctor(self) -> subprocess.CompletedProcess[str]:
        state = self.root / "state"
        state.mkdir(exist_ok=True)
        creds = self.bus.creds["cli"].parent
        write_node_info(
            state,
            NodeInfo(node_id=NODE, nats_url=self.bus.url, creds_dir=str(creds), services=["signer", "inventory", "converger", "gateway_bridge"]),
        )
        return subprocess.run(  # noqa: S603
            [sys.executable, "-m", "bcd.cli", "doctor", "--state-dir", str(state)], capture_output=True, text=True, timeout=30, cwd=REPO
        )

    def hold_files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for d in (self.cdi, self.run) for p in d.rglob("*") if p.is_file() and p.name != "nvidia.json")


@pytest.fixture
async def node(run_as):
    root = Path(tempfile.mkdtemp(prefix="bcd-unpriv-", dir="/tmp"))
    root.chmod(0o755)  # the unprivileged converger reaches its own dirs and the CDI/run dirs
    n = UnprivilegedNode(root, run_as)
    try:
        yield n
    finally:
        try:
            await n.bus.aclose()
        finally:
            shutil.rmtree(root, ignore_errors=True)


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # effective
    raise AssertionError("no Uid line")


async def test_an_unprivileged_node_takes_no_holds(node: UnprivilegedNode) -> None:
    """The seed's TestAnUnprivilegedNodeTakesNoHolds: capabilities, the refusal, doctor, logs."""
    await node.start()
    assert node.converger is not None
    if node.run_as.mode == "setuid":
        assert uid_of(node.converger.proc.pid) == node.run_as.uid
    st = await node.status()
    assert st.privileged is False

    hello = await wait_for("the Hello", node.hello)
    assert not HOST_CAPABILITIES & set(hello.capabilities), hello.capabilities

    assert node.cp is not None
    spec = NodeSpec(
        node_id=NODE,
        generation=1,
        devices=[plain("a1", GPU[0]), plain("a2", GPU[1], limits=Limits(cpus="0-3", memory_bytes=1 << 30))],
    )
    await node.cp.put_spec(spec)
    failed = await wait_for("two AllocationFailed upstream", lambda: _at_least(node.events("failed"), 2))
    reasons = {json.loads(data)["allocation_id"]: json.loads(data)["reason"] for _, data in failed}
    assert reasons == {"a1": "node-unprivileged", "a2": "node-unprivileged"}
    st = await wait_for("the section FAILED at generation 1", lambda: node.section(1, "FAILED"))
    assert st.failures == {"a1": "node-unprivileged", "a2": "node-unprivileged"}
    assert st.holds == []
    # nothing written: no CDI spec, env file or slice
    assert node.hold_files() == []
    assert sorted(p.name for p in node.cdi.iterdir()) == ["nvidia.json"]
    assert await node.events("bound") == []

    doctor = node.doctor()
    assert "WARN  gpu-binding" in doctor.stdout, doctor.stdout + doctor.stderr
    assert "runs bcd unprivileged" in doctor.stdout

    lines = node.converger.log_lines()
    assert any(l["level"] == "WARNING" and l["msg"].startswith("running unprivileged") for l in lines)
    failed_lines = [l for l in lines if l["msg"] == "section failed"]
    assert failed_lines and all(l["level"] == "ERROR" for l in failed_lines)
    assert failed_lines[-1]["failures"]["a1"].startswith("node-unprivileged: ")


async def _at_least(events: Awaitable[list[T]], n: int) -> list[T] | None:
    got = await events
    return got if len(got) >= n else None


async def test_a_root_helper_binds_holds_for_an_unprivileged_converger(node: UnprivilegedNode) -> None:
    await node.start()
    assert node.converger is not None and node.cp is not None
    assert (await node.status()).privileged is False
    # started later: the converger finds it on its own
    helper = node.start_helper()
    await node.bus.wait_service("helper")
    await wait_for("the converger to find the helper", lambda: _true(node.status(), lambda s: s.privileged))
    assert any(l["msg"].startswith("root helper found") for l in node.converger.log_lines())
    caps = await wait_for("a Hello with the host capabilities", lambda: _true(node.capabilities(), lambda c: HOST_CAPABILITIES <= set(c)))
    assert HOST_CAPABILITIES <= set(caps)

    spec = NodeSpec(
        node_id=NODE,
        generation=1,
        devices=[plain("a1", GPU[0], env=["MY_VAR=1"]), plain("a2", GPU[1], limits=Limits(cpus="0-3", memory_bytes=1 << 30))],
    )
    await node.cp.put_spec(spec)
    await wait_for("the section CONVERGED at generation 1", lambda: node.section(1, "CONVERGED"))
    await wait_for("two AllocationBound upstream", lambda: _at_least(node.events("bound"), 2))
    assert node.hold_files() == [
        "cdi/bcd-a1.json",
        "cdi/bcd-a2.json",
        "run/allocations/a1.env",
        "run/allocations/a2.env",
        # the consumer copies, made by the helper from the specs on its disk
        "run/cdi/bcd-a1.json",
        "run/cdi/bcd-a2.json",
        "run/slices/bcd-alloc-a2.slice.json",
    ]
    assert "MY_VAR=1" in (node.run / "allocations" / "a1.env").read_text().splitlines()
    assert json.loads((node.cdi / "bcd-a2.json").read_text())["annotations"]["bcd.dev/cgroup-parent"] == "bcd-alloc-a2.slice"
    # written by the helper process (root here), not by the converger
    if node.run_as.mode == "setuid":
        assert {(node.root / f).stat().st_uid for f in node.hold_files()} == {os.geteuid()}
    done = {l.get("path", "") for l in helper.log_lines() if l["msg"] == "operation done"}
    assert str(node.cdi.resolve() / "bcd-a1.json") in done and str(node.run.resolve() / "allocations" / "a2.env") in done

    # the helper goes away: a release cannot be written, is logged WARN and retried
    assert helper.stop() == 0
    await node.cp.put_spec(msgspec.structs.replace(spec, generation=2, devices=spec.devices[1:]))
    await wait_for("the section PROGRESSING at generation 2", lambda: node.section(2, "PROGRESSING"))
    retrying = [l for l in node.converger.log_lines() if l["msg"] == "pass incomplete; retrying"]
    assert retrying and all(l["level"] == "WARNING" for l in retrying)
    assert any("root helper not running" in e for e in retrying[-1]["errors"])
    assert (node.cdi / "bcd-a1.json").exists()
    # back again: the release completes
    node.start_helper()
    await wait_for("the section CONVERGED at generation 2", lambda: node.section(2, "CONVERGED"))
    released = await wait_for("AllocationReleased of a1 upstream", lambda: _at_least(node.events("released"), 1))
    assert len(released) == 1
    assert node.hold_files() == ["cdi/bcd-a2.json", "run/allocations/a2.env", "run/cdi/bcd-a2.json", "run/slices/bcd-alloc-a2.slice.json"]


async def _true(value: Awaitable[T], predicate: Callable[[T], bool]) -> T | None:
    got = await value
    return got if predicate(got) else None


async def test_a_helper_gone_for_good_makes_the_node_unprivileged_again(node: UnprivilegedNode) -> None:
    node.converger_env = {"BCD_HELPER_LOST_AFTER": "2"}
    await node.start()
    assert node.converger is not None and node.cp is not None
    helper = node.start_helper()
    await wait_for("the converger to find the helper", lambda: _true(node.status(), lambda s: s.privileged))
    await wait_for("a Hello with the host capabilities", lambda: _true(node.capabilities(), lambda c: HOST_CAPABILITIES <= set(c)))
    spec = NodeSpec(node_id=NODE, generation=1, devices=[plain("a1", GPU[0])])
    await node.cp.put_spec(spec)
    await wait_for("the section CONVERGED at generation 1", lambda: node.section(1, "CONVERGED"))

    assert helper.stop() == 0
    t0 = time.monotonic()
    await wait_for("the node unprivileged again", lambda: _true(node.status(), lambda s: not s.privileged))
    gone_after = time.monotonic() - t0
    assert gone_after >= 1.5, f"demoted {gone_after:.1f} s after the helper stopped: the grace is 2 s"
    # (the Hello, not its capabilities: an empty list would read as "not yet")
    await wait_for("a Hello with no host capability", lambda: _true(node.hello(), lambda h: h is not None and not HOST_CAPABILITIES & set(h.capabilities)))
    lines = node.converger.log_lines()
    assert any(l["level"] == "WARNING" and l["msg"] == "the root helper does not answer" for l in lines)
    assert any(l["level"] == "WARNING" and l["msg"].startswith("root helper gone: the node is unprivileged") for l in lines)
    # (the demotion once said "the root helper answers again" in the same breath)
    assert not any(l["msg"] == "the root helper answers again" for l in lines)

    # a new plain hold fails at once and writes nothing; the kept one stays, unreported twice
    await node.cp.put_spec(msgspec.structs.replace(spec, generation=2, devices=[*spec.devices, plain("a2", GPU[1])]))
    st = await wait_for("the section FAILED at generation 2", lambda: node.section(2, "FAILED"))
    assert st.failures == {"a2": "node-unprivileged"}
    assert [h.allocation_id for h in st.holds] == ["a1"]
    failed = await wait_for("AllocationFailed of a2 upstream", lambda: _at_least(node.events("failed"), 1))
    assert [json.loads(d)["reason"] for _, d in failed] == ["node-unprivileged"]
    assert node.hold_files() == ["cdi/bcd-a1.json", "run/allocations/a1.env", "run/cdi/bcd-a1.json"]
    assert len(await node.events("bound")) == 1 and await node.events("released") == []
    doctor = node.doctor()
    assert "WARN  gpu-binding" in doctor.stdout, doctor.stdout + doctor.stderr

    # the helper back: privileged again, and the next spec binds
    node.start_helper()
    await wait_for("the converger to find the helper again", lambda: _true(node.status(), lambda s: s.privileged))
    await wait_for("a Hello with the host capabilities again", lambda: _true(node.capabilities(), lambda c: HOST_CAPABILITIES <= set(c)))
    await node.cp.put_spec(msgspec.structs.replace(spec, generation=3, devices=[*spec.devices, plain("a2", GPU[1])]))
    await wait_for("the section CONVERGED at generation 3", lambda: node.section(3, "CONVERGED"))
    assert len(await node.events("bound")) == 2
