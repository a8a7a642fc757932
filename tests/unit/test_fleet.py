"""`bcd fleet init|add-node|events`: the files they write (the quick start itself runs in
tests/integration/test_fleet_quickstart.py against a real upstream)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nkeys

from shared.subjects import CONTROLPLANE_USER, upstream_controlplane_permissions, upstream_node_permissions

REPO = Path(__file__).resolve().parents[2]


def bcd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bcd.cli", *args], capture_output=True, text=True, timeout=60, cwd=cwd, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


def test_init_writes_the_upstream_config_password_and_key(tmp_path: Path) -> None:
    out = bcd("fleet", "init", "fl", "--port", "4555", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    fl = tmp_path / "fl"
    assert json.loads((fl / "fleet.json").read_text())["url"] == "nats://127.0.0.1:4555"
    conf = json.loads((fl / "upstream" / "nats.conf").read_text())
    assert conf["port"] == 4555 and conf["jetstream"]["sync_interval"] == "always"
    assert conf["pid_file"] == str((fl / "upstream" / "nats.pid").resolve())
    (cp,) = conf["accounts"]["UPSTREAM"]["users"]
    assert cp["user"] == CONTROLPLANE_USER and cp["password"] == (fl / "upstream" / "controlplane.password").read_text().strip()
    assert cp["permissions"]["publish"]["allow"] == list(upstream_controlplane_permissions().publish)
    assert oct((fl / "upstream" / "controlplane.password").stat().st_mode & 0o777) == "0o600"
    assert (fl / "controlplane" / "cp.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert "BCD_CP_NATS_URL=nats://127.0.0.1:4555" in out.stdout
    # again: the same password and key
    before = (fl / "upstream" / "controlplane.password").read_text(), (fl / "controlplane" / "cp.pub").read_text()
    assert bcd("fleet", "init", "fl", "--port", "4555", cwd=tmp_path).returncode == 0
    assert before == ((fl / "upstream" / "controlplane.password").read_text(), (fl / "controlplane" / "cp.pub").read_text())


def test_add_node_gives_each_node_its_own_nkey_limited_to_its_subjects(tmp_path: Path) -> None:
    assert bcd("fleet", "init", "fl", cwd=tmp_path).returncode == 0
    fl = tmp_path / "fl"
    out = bcd("fleet", "add-node", "fl", "node-a", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--upstream-nkey-file fl/nodes/node-a.nk" in out.stdout and "--cp-key fl/controlplane/cp.pub" in out.stdout
    assert "picks it up when it starts" in out.stdout  # no upstream running
    seed = (fl / "nodes" / "node-a.nk").read_bytes().strip()
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    assert bcd("fleet", "add-node", "fl", "node-a", cwd=tmp_path).returncode == 0  # again: the same key
    assert bcd("fleet", "add-node", "fl", "node-b", cwd=tmp_path).returncode == 0
    assert (fl / "nodes" / "node-a.nk").read_bytes().strip() == seed
    nodes = json.loads((fl / "upstream" / "nodes.json").read_text())
    assert set(nodes) == {"node-a", "node-b"} and nodes["node-a"] == public
    users = json.loads((fl / "upstream" / "nats.conf").read_text())["accounts"]["UPSTREAM"]["users"]
    entry = next(u for u in users if u.get("nkey") == public)
    assert "password" not in entry
    assert entry["permissions"]["publish"]["allow"] == list(upstream_node_permissions("node-a").publish)
    assert entry["permissions"]["subscribe"]["allow"] == list(upstream_node_permissions("node-a").subscribe)
    bad = bcd("fleet", "add-node", "fl", "Bad.Id", cwd=tmp_path)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


def test_events_reads_a_fleet_or_a_control_plane_dir(tmp_path: Path) -> None:
    out = bcd("fleet", "events", "nowhere", "--no-follow", cwd=tmp_path)
    assert out.returncode == 0 and "no events yet" in out.stdout and "nowhere/events.jsonl" in out.stdout
    assert bcd("fleet", "init", "fl", cwd=tmp_path).returncode == 0
    out = bcd("fleet", "events", "fl", "--no-follow", cwd=tmp_path)
    assert out.returncode == 0 and "fl/controlplane/events.jsonl" in out.stdout


def test_upstream_without_init_says_what_to_run(tmp_path: Path) -> None:
    out = bcd("fleet", "upstream", "fl", cwd=tmp_path)
    assert out.returncode != 0 and "bcd fleet init fl" in out.stderr and "Traceback" not in out.stderr
