"""The compose node (deploy/compose/compose.yaml, brought up by deploy/compose/node.sh as
`make compose-up` does) on the example fake host, from the image `make images` builds:
it binds the demo and the control plane verifies every event; each service runs as
its own non-root Unix user; a service's NATS user cannot publish another's subjects.

Every test runs twice, on a node brought up by Compose v1 (docker-compose 1.29) and by
Compose v2 (the `compose` fixture of conftest.py, given to node.sh as COMPOSE)."""

from __future__ import annotations

import json
import os
import asyncio
import subprocess
import time
from pathlib import Path

import pytest
from testcontainers.core.container import DockerContainer

from shared.holdfiles import consumer_spec
from shared.subjects import NodeSubjects
from tests.integration.kubelet_standin import KubeletStandIn, run_pod

from .conftest import ROOT, compose_version, free_port

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

NODE_ID = "node-1"
#: the demo's holds and refusals (examples/specs/demo.json)
DEMO_BOUND = {"train-01", "infer-slots", "notebook-mig"}
DEMO_FAILED = {"late-overlap", "not-yet-created", "too-big"}
SERVICE_UIDS = {
    "bus": 10001,
    "signer": 10002,
    "inventory": 10003,
    "converger": 10004,
    "gateway_bridge": 10005,
    "kube_reaper": 10006,
    "vfio_switcher": 10007,
    "device_plugin": 10009,
    "dra_plugin": 10010,
    "helper": 0,  # the root helper: uid 0, no capability (compose.yaml says why)
    "upstream": 10001,
    "controlplane": 10008,
}


class ComposeNode:
    def __init__(self, directory: Path, project: str, env: dict[str, str]) -> None:
        self.dir, self.project, self.env = directory, project, env
        #: the Compose that runs it (node.sh's COMPOSE): "1.29.2", "2.40.3"
        self.compose_version = compose_version(tuple(env["COMPOSE"].split()))
        #: images a test made, removed once the node's containers are gone
        self.images_to_remove: list[str] = []

    def node_sh(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(ROOT / "deploy/compose/node.sh"), *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def compose(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return self.node_sh("compose", str(self.dir), *args, timeout=timeout)

    def containers(self) -> dict[str, tuple[str, bool, int]]:
        """Every service's container, running or not (the bus setup runs once and exits), from one
        `compose ps -aq` (each v1 call costs a second of Python start): (id, running, exit code),
        by the service label v1 and v2 both set; names differ (v1 `project_service_1`, v2
        `project-service-1`), so none is built from them."""
        r = self.compose("ps", "-a", "-q")
        assert r.returncode == 0 and r.stdout.split(), r.stderr
        fmt = '{{index .Config.Labels "com.docker.compose.service"}} {{.Id}} {{.State.Running}} {{.State.ExitCode}}'
        out = subprocess.run(["docker", "inspect", "-f", fmt, *r.stdout.split()], capture_output=True, text=True, check=True).stdout
        rows = [line.split() for line in out.splitlines() if line.strip()]
        found = {name: (cid, running == "true", int(code)) for name, cid, running, code in rows}
        assert len(found) == len(rows), out  # one container per service
        return found

    def container_ids(self) -> dict[str, str]:
        """The running services' containers (every one but the bus setup, which has exited)."""
        return {name: cid for name, (cid, running, _) in self.containers().items() if running}

    def events(self) -> list[dict]:
        path = self.dir / "controlplane" / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def bcd(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(ROOT / ".venv/bin/bcd"), *args, "--state-dir", str(self.dir)], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def compose_node(compose, bcd_image, tmp_path_factory):
    directory = tmp_path_factory.mktemp("compose") / "node"
    # one project per Compose version: a node the other left behind is never taken over
    project = f"bcdtest{os.getpid()}v{compose_version(tuple(compose.split()))[:1]}"
    env = {
        **os.environ,
        "COMPOSE": compose,
        "BCD_COMPOSE_PROJECT": project,
        "BCD_IMAGE": bcd_image,
        "BCD_NODE_ID": NODE_ID,
        "BCD_BUS_PORT": str(free_port()),
        "BCD_BUS_HTTP_PORT": str(free_port()),
        "BCD_UPSTREAM_PORT": str(free_port()),
    }
    node = ComposeNode(directory, project, env)
    up = node.node_sh("up", str(directory))
    try:
        assert up.returncode == 0, f"node.sh up (Compose {node.compose_version}) failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        yield node
    finally:
        logs = node.compose("logs", "--no-color", "--tail", "40")
        down = node.node_sh("down", str(directory), timeout=180)
        if down.returncode != 0:  # never leave containers behind
            subprocess.run(["docker", "rm", "-f", *subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"], capture_output=True, text=True).stdout.split()], capture_output=True)
        if node.images_to_remove:
            subprocess.run(["docker", "rmi", "-f", *node.images_to_remove], capture_output=True)
        print(logs.stdout[-6000:])


def wait_for(what: str, predicate, timeout: float = 60.0, every: float = 0.5):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def test_the_compose_node_binds_the_demo_and_every_event_is_verified_upstream(compose_node):
    node = compose_node

    def settled():
        ev = node.events()
        bound = {e["allocation_id"] for e in ev if e["type"] == "bound" and e["outcome"] == "applied"}
        failed = {e["allocation_id"] for e in ev if e["type"] == "failed" and e["outcome"] == "applied"}
        return ev if bound == DEMO_BOUND and failed == DEMO_FAILED else None

    events = wait_for("the demo's Bound and Failed events verified by the control plane", settled, timeout=90)
    # Bound and Released are node-signed (the control plane checked each against the
    # node's Hello key); Failed is a plain event in the contract
    signed = [e for e in events if e["type"] in ("bound", "released")]
    assert signed and all(e["verified"] is True for e in signed), [e for e in signed if e["verified"] is not True]
    assert not [e for e in events if e["outcome"] == "rejected"]
    bound_ids = [e["event_id"] for e in events if e["type"] == "bound"]
    assert len(bound_ids) == len(set(bound_ids)) == len(DEMO_BOUND)

    # the hold files are on the host, written by the root helper for the converger
    for alloc in DEMO_BOUND:
        spec = node.dir / "cdi" / f"bcd-{alloc}.json"
        assert spec.is_file() and spec.stat().st_uid == SERVICE_UIDS["helper"], spec
        assert (node.dir / "run" / "allocations" / f"{alloc}.env").is_file()
        # and its consumer copy, made by the helper from the spec on its disk
        copy = node.dir / "run" / "cdi" / f"bcd-{alloc}.json"
        assert copy.is_file() and copy.stat().st_uid == SERVICE_UIDS["helper"], copy
        assert json.loads(copy.read_text()) == consumer_spec(json.loads(spec.read_text()))
    assert sorted(p.name for p in (node.dir / "run" / "cdi").glob("bcd-*.json")) == sorted(f"bcd-{a}.json" for a in DEMO_BOUND)

    # `bcd status` from the host tells what the containers did
    st = node.bcd("status", "--json")
    assert st.returncode == 0, st.stderr  # healthy: a FAILED section of refusals is not a sick node
    status = json.loads(st.stdout)
    text = json.dumps(status)
    assert all(alloc in text for alloc in DEMO_BOUND | DEMO_FAILED)
    plain = node.bcd("status")
    assert "section devices: FAILED" in plain.stdout and "hold train-01" in plain.stdout, plain.stdout


def test_each_service_runs_as_its_own_user_non_root_but_the_helper_with_no_capabilities(compose_node):
    node = compose_node
    seen: dict[str, set[int]] = {}
    ids = node.container_ids()
    assert set(ids) == set(SERVICE_UIDS), ids
    # the bus setup made the streams as bus_admin (the bus's uid) and exited: no service may
    setup_id, running, code = node.containers()["bus-setup"]
    assert not running and code == 0, (running, code)
    setup = json.loads(subprocess.run(["docker", "inspect", setup_id], capture_output=True, text=True, check=True).stdout)[0]
    assert setup["Config"]["User"] == f"{SERVICE_UIDS['bus']}:10000" and setup["HostConfig"]["CapDrop"] == ["ALL"]
    logs = subprocess.run(["docker", "logs", setup_id], capture_output=True, text=True, check=True)
    assert "streams of node" in logs.stdout and "ready" in logs.stdout, logs.stdout + logs.stderr
    for service, uid in SERVICE_UIDS.items():
        cid = ids[service]
        inspect = json.loads(subprocess.run(["docker", "inspect", cid], capture_output=True, text=True, check=True).stdout)[0]
        host = inspect["HostConfig"]
        assert host["ReadonlyRootfs"] is True, service
        assert host["CapDrop"] == ["ALL"] and not host["CapAdd"], (service, host["CapDrop"], host["CapAdd"])
        assert "no-new-privileges:true" in (host["SecurityOpt"] or []), service
        pid = inspect["State"]["Pid"]
        # every process of the container, read from the host's /proc: real, effective uid
        procs = subprocess.run(["docker", "top", cid, "-eo", "pid"], capture_output=True, text=True, check=True).stdout.split()[1:]
        uids = set()
        for p in procs:
            status = Path(f"/proc/{p}/status").read_text()
            real, effective = (int(x) for x in next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:3])
            caps = next(line for line in status.splitlines() if line.startswith("CapEff:")).split()[1]
            assert int(caps, 16) == 0, (service, p, caps)
            uids |= {real, effective}
        assert pid and uids == {uid}, (service, uids)
        seen[service] = uids
    node_services = [s for s in SERVICE_UIDS if s not in ("bus", "upstream")]
    assert len({SERVICE_UIDS[s] for s in node_services}) == len(node_services)
    assert [s for s, uid in SERVICE_UIDS.items() if uid == 0] == ["helper"]
    # the converger is an ordinary user that cannot write a hold itself: it reads the
    # hold directories, the helper writes them
    inspect = json.loads(subprocess.run(["docker", "inspect", ids["converger"]], capture_output=True, text=True, check=True).stdout)[0]
    mounts = {m["Destination"]: m["RW"] for m in inspect["Mounts"]}
    assert mounts["/etc/cdi"] is False and mounts["/run/bcd"] is False, mounts


PROBE = r"""
import asyncio, json, sys
import nats
async def main():
    url, user, password_file, *subjects = sys.argv[1:]
    errors = []
    async def on_error(exc):
        errors.append(str(exc))
    nc = await nats.connect(url, user=user, password=open(password_file).read().strip(),
                            error_cb=on_error, allow_reconnect=False, connect_timeout=5)
    out = {}
    for subject in subjects:
        before = len(errors)
        await nc.publish(subject, b"{}")
        await nc.flush()
        await asyncio.sleep(0.3)
        out[subject] = errors[before:]
    await nc.close()
    print(json.dumps(out))
asyncio.run(main())
"""


def test_a_service_container_cannot_publish_another_services_subjects(compose_node, bcd_image):
    """A container holding the inventory's credentials, on the node's network, as the
    inventory's Unix user: the bus refuses it the converger's, signer's and outbox's
    subjects (no forged spec, signature request or Bound)."""
    node = compose_node
    s = NodeSubjects(NODE_ID)
    forbidden = [s.converger_spec, s.signer_sign, s.outbox_subject("bound"), s.vfio_switch]
    allowed = s.inventory_changed  # its own: the probe is heard there (the peers drop the bad body)
    probe = (
        DockerContainer(bcd_image)
        # networks are `project_network` in v1 and v2 alike (only container names changed)
        .with_kwargs(network=f"{node.project}_node", user=f"{SERVICE_UIDS['inventory']}:10000", read_only=True, cap_drop=["ALL"])
        .with_volume_mapping(str(node.dir / "bus" / "creds" / "inventory.password"), "/run/secrets/inventory.password", "ro")
        .with_command(["python3", "-c", PROBE, "nats://bus:4222", "inventory", "/run/secrets/inventory.password", allowed, *forbidden])
    )
    probe.start()
    try:
        wrapped = probe.get_wrapped_container()
        result = wrapped.wait(timeout=60)
        out, err = probe.get_logs()
        assert result["StatusCode"] == 0, err.decode()[-2000:]
    finally:
        probe.stop()
    refused = json.loads(out.decode().strip().splitlines()[-1])
    assert refused[allowed] == [], refused[allowed]
    for subject in forbidden:
        assert any("permissions violation" in e.lower() for e in refused[subject]), (subject, refused[subject])


def _status(node: ComposeNode) -> dict | None:
    st = node.bcd("status", "--json")
    if st.returncode != 0:
        return None
    try:
        return json.loads(st.stdout)
    except ValueError:
        return None


def test_containers_recreated_from_a_new_image_keep_their_holds_without_a_second_bound(compose_node, bcd_image):
    """The upgrade: every container recreated from a new image (it replaces the node the
    others used; only the device plugin's test, which changes the spec, comes after it). The holds stay as they were and no event
    for them goes upstream again: a kept hold is not bound twice."""
    node = compose_node
    wait_for("the demo bound", lambda: {e["allocation_id"] for e in node.events() if e["type"] == "bound"} == DEMO_BOUND, timeout=90)
    before_events = node.events()
    holds = {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted((node.dir / "cdi").glob("bcd-*.json"))}
    assert {n[4:-5] for n in holds} == DEMO_BOUND
    old_ids = node.container_ids()
    assert set(old_ids) == set(SERVICE_UIDS), old_ids

    new_tag = f"bcd:upgrade-{os.getpid()}"
    built = subprocess.run(
        ["docker", "build", "-q", "-t", new_tag, "-"],
        input=f"FROM {bcd_image}\nLABEL dev.bcd.test-upgrade={os.getpid()}\n",
        capture_output=True, text=True, timeout=120, env={**os.environ, "DOCKER_BUILDKIT": "0"},
    )
    assert built.returncode == 0, built.stderr
    new_image = built.stdout.strip().splitlines()[-1]
    try:
        t0 = time.monotonic()
        node.env["BCD_IMAGE"] = new_tag
        up = node.compose("up", "-d", timeout=300)
        assert up.returncode == 0, up.stderr[-3000:]
        new_ids = node.container_ids()
        for svc, old in old_ids.items():
            cid = new_ids[svc]
            assert cid != old, f"{svc} was not recreated"
            image = subprocess.run(["docker", "inspect", "-f", "{{.Image}}", cid], capture_output=True, text=True, check=True).stdout.strip()
            assert image == new_image, (svc, image, new_image)

        def passed_again():
            st = _status(node)
            conv = (st or {}).get("converger") or {}
            return conv if conv.get("last_pass_at") and conv.get("generation") == 1 and len(conv.get("holds", [])) == len(DEMO_BOUND) else None

        conv = wait_for("a pass of the new converger", passed_again, timeout=120)
        print(f"upgrade: containers recreated and the new converger's pass done in {time.monotonic() - t0:.1f} s")
        assert {h["allocation_id"] for h in conv["holds"]} == DEMO_BOUND
        # the bridge is back upstream (its Hello for the new start) before the events are judged
        time.sleep(3)
        after = node.events()
        new = after[len(before_events):]
        assert not [e for e in new if e["type"] in ("bound", "released")], new
        bound_ids = [e["event_id"] for e in after if e["type"] == "bound" and e["outcome"] == "applied"]
        assert len(bound_ids) == len(set(bound_ids)) == len(DEMO_BOUND)
        assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in sorted((node.dir / "cdi").glob("bcd-*.json"))} == holds
    finally:
        node.env["BCD_IMAGE"] = bcd_image
        # the containers still use it: untagged now, removed with them at the module's end
        subprocess.run(["docker", "rmi", "-f", new_tag], capture_output=True)
        node.images_to_remove.append(new_image)


async def test_the_device_plugin_container_registers_with_a_kubelet_on_the_host(compose_node):
    """The device_plugin container (uid 10009, read-only CDI and run dirs) and a kubelet
    stand-in on the host sharing the bind-mounted device-plugins directory: a Kubernetes
    hold put through the control plane is advertised and allocated with bcd's CDI names."""
    node = compose_node
    plugin_dir = node.dir / "kubelet" / "device-plugins"
    gpu = "GPU-5f1c2a90-0000-4000-8000-000000000003"
    async with KubeletStandIn(plugin_dir) as kubelet:
        # what setfacl does on a worker: the plugin's user may connect to kubelet.sock
        os.chmod(kubelet.socket, 0o666)
        await kubelet.wait_registered("bcd.dev/gpu", timeout=60)
        spec = json.loads((ROOT / "examples" / "specs" / "demo.json").read_text())
        spec["devices"].append({"allocation_id": "pods-01", "reservation_id": "rsv-pods-01", "binding": "BINDING_KUBERNETES", "devices": [gpu]})
        (node.dir / "spec" / "kube.json").write_text(json.dumps(spec))
        put = await asyncio.to_thread(node.compose, "exec", "-T", "controlplane", "python3", "-m", "controlplane", "put", "/spec/kube.json")
        assert put.returncode == 0, put.stderr[-2000:]
        await kubelet.wait_devices("bcd.dev/gpu", lambda d: set(d) == {gpu}, timeout=90)
        response = await kubelet.allocate("bcd.dev/gpu", [[gpu]])
        pod = run_pod(node.dir / "cdi", response.container_responses[0])
        assert pod.device_ids == [gpu] and pod.spec_files == ["bcd-pods-01.json"]
        assert pod.env["BCD_ALLOCATION_ID"] == "pods-01" and pod.env["NVIDIA_VISIBLE_DEVICES"] == gpu
        st = await asyncio.to_thread(node.bcd, "status")
        assert "kubelet: advertised as bcd.dev/gpu (1 device(s))" in st.stdout, st.stdout


async def test_the_dra_plugin_container_registers_with_a_kubelet_on_the_host(compose_node):
    """The dra_plugin container (uid 10010, read-only root) serves its registration socket in the
    bind-mounted plugins_registry/ and its plugin socket in plugins/gpu.bcd.dev/; a kubelet stand-in on
    the host registers it and calls it. With no API server in the compose node every prepare is
    refused with the reason, and bcd status says so."""
    from tests.integration.dra_kubelet_standin import DraKubelet

    node = compose_node
    kubelet = DraKubelet(node.dir / "kubelet", plugin_root="/var/lib/kubelet")
    try:
        info = await kubelet.register("gpu.bcd.dev", timeout=90)
        assert info.endpoint == "/var/lib/kubelet/plugins/gpu.bcd.dev/dra.sock"
        assert os.stat(node.dir / "kubelet" / "plugins_registry" / "gpu.bcd.dev-reg.sock").st_uid == 10010
        uid = "0b6f4a39-1c1e-4d6b-9a53-0123456789ab"
        reply = (await kubelet.prepare(("ml", "c", uid)))[uid]
        assert "no Kubernetes API configured" in reply.error
        st = await asyncio.to_thread(node.bcd, "status")
        assert "DRA plugin gpu.bcd.dev: registered with the kubelet" in st.stdout, st.stdout
    finally:
        await kubelet.close()


def test_a_spec_is_applied_through_node_sh_and_a_second_up_keeps_it(compose_node, tmp_path):
    """Issue 28.4/28.5: `bcd apply --state-dir <compose dir>` ended in `internal error: KeyFileError`
    (the key is the control plane container's), the README said no other way, and a second
    `node.sh up` put the demo again, releasing what the user had bound. Now `bcd apply` says in
    one line to use `node.sh apply`, which puts the spec through the control plane's container,
    and a second `up` keeps the user's holds."""
    node = compose_node
    demo = json.loads((ROOT / "examples" / "specs" / "demo.json").read_text())
    # GPU 4: no other test of this module touches it (GPU 3 is pods-01's, held while its release waits)
    spec = {**demo, "devices": [*demo["devices"], {"allocation_id": "mine", "reservation_id": "rsv-mine", "binding": "BINDING_HOLD", "devices": ["GPU-5f1c2a90-0000-4000-8000-000000000004"]}]}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(spec))

    refused = node.bcd("apply", str(path))
    assert refused.returncode == 2 and "internal error" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and f"deploy/compose/node.sh apply {node.dir} {path}" in refused.stderr, refused.stderr

    put = node.node_sh("apply", str(node.dir), str(path))
    assert put.returncode == 0, put.stdout + put.stderr
    gen = int(put.stdout.strip().rsplit("generation ", 1)[1])
    wait_for("mine bound", lambda: any(e["type"] == "bound" and e["allocation_id"] == "mine" and e["outcome"] == "applied" for e in node.events()), 90)

    again = node.node_sh("up", str(node.dir))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"already has generation {gen}: its holds stay as they are" in again.stdout, again.stdout
    time.sleep(2)
    st = json.loads(node.bcd("status", "--json").stdout)
    assert "mine" in {h["allocation_id"] for h in st["converger"]["holds"]}
    assert not [e for e in node.events() if e["type"] == "released" and e["allocation_id"] == "mine"]


async def _try_upstream(node: ComposeNode, *, cert: bool) -> str:
    """Connect from the host to the upstream's published port as this node's upstream user,
    verifying the server against the compose CA; with or without the bridge's client
    certificate. "" when connected, else shared.tlsconfig's one line."""
    from shared.tlsconfig import client_context, connect_options, explain, new_client, upstream_tls

    url = f"tls://127.0.0.1:{node.env['BCD_UPSTREAM_PORT']}"
    bridge = node.dir / "pki" / "gateway_bridge"
    tls = upstream_tls(url, ca=bridge / "ca.crt", cert=bridge / "tls.crt" if cert else None, key=bridge / "tls.key" if cert else None)
    nc = new_client(tls)
    user = f"node-{NODE_ID}"
    password = (node.dir / "bus" / "creds" / f"{user}.password").read_text().strip()
    try:
        await nc.connect(url, user=user, password=password, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0, **connect_options(tls, client_context(tls)))
    except Exception as exc:  # noqa: BLE001 - what the handshake raised is the answer
        return explain(exc, server=url) or repr(exc)
    await nc.close()
    return ""


async def test_the_bridge_and_the_control_plane_reach_the_upstream_over_verified_mutual_tls(compose_node):
    """Issue 31: compose.yaml's bridge and control plane dial `tls://upstream:4222` with the CA and
    the client certificates `bcd compose init` made (pki/); the upstream verifies clients, so the
    certificate is needed besides the password, and a client without one is refused."""
    node = compose_node
    st = await asyncio.to_thread(node.bcd, "status")
    line = next((ln for ln in st.stdout.splitlines() if ln.startswith("upstream ")), "")
    assert line == "upstream tls://upstream:4222 (TLS): connected", st.stdout
    # the control plane verified the demo's events (the first test): it is connected over TLS too
    assert node.events()
    assert await _try_upstream(node, cert=True) == ""
    refused = await _try_upstream(node, cert=False)
    assert "client certificate" in refused, refused
    conf = json.loads((node.dir / "upstream" / "nats.conf").read_text())
    assert conf["tls"]["verify"] is True
