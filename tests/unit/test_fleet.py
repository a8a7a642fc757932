"""`bcd fleet init|add-node|renew|events`: the files they write (the quick start itself runs in
tests/integration/test_fleet_quickstart.py against a real upstream)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import nkeys
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared import pki
from shared.subjects import upstream_controlplane_permissions, upstream_node_account, upstream_node_permissions

REPO = Path(__file__).resolve().parents[2]


def bcd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bcd.cli", *args], capture_output=True, text=True, timeout=60, cwd=cwd, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


def mode(p: Path) -> str:
    return oct(p.stat().st_mode & 0o777)


def test_init_writes_the_upstream_config_nkey_and_key(tmp_path: Path) -> None:
    out = bcd("fleet", "init", "fl", "--port", "4555", "--no-tls", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    fl = tmp_path / "fl"
    assert json.loads((fl / "fleet.json").read_text())["url"] == "nats://127.0.0.1:4555"
    conf = json.loads((fl / "upstream" / "nats.conf").read_text())
    assert conf["port"] == 4555 and conf["jetstream"]["sync_interval"] == "always"
    assert conf["pid_file"] == str((fl / "upstream" / "nats.pid").resolve())
    assert "tls" not in conf and not (fl / "pki").exists()
    (cp,) = conf["accounts"]["UPSTREAM"]["users"]
    # the control plane is an nkey user: no password in the config (nats-server warns on plain ones)
    seed = (fl / "upstream" / "controlplane.nk").read_bytes().strip()
    assert cp["nkey"] == nkeys.from_seed(bytearray(seed)).public_key.decode() and "password" not in cp and "user" not in cp
    assert not (fl / "upstream" / "controlplane.password").exists()
    assert cp["permissions"]["publish"]["allow"] == list(upstream_controlplane_permissions().publish)
    assert mode(fl / "upstream" / "controlplane.nk") == "0o600"
    assert (fl / "controlplane" / "cp.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert "BCD_CP_NATS_URL=nats://127.0.0.1:4555 BCD_CP_NKEY_FILE=fl/upstream/controlplane.nk" in out.stdout
    assert "BCD_CP_CA_FILE" not in out.stdout
    # again: the same nkey and key
    before = (fl / "upstream" / "controlplane.nk").read_text(), (fl / "controlplane" / "cp.pub").read_text()
    assert bcd("fleet", "init", "fl", "--port", "4555", "--no-tls", cwd=tmp_path).returncode == 0
    assert before == ((fl / "upstream" / "controlplane.nk").read_text(), (fl / "controlplane" / "cp.pub").read_text())


def san(path: Path) -> list[str]:
    cert = pki.load_certificate(path)
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in ext.get_values_for_type(x509.DNSName)] + [str(v) for v in ext.get_values_for_type(x509.IPAddress)]


def test_init_makes_a_ca_the_upstream_certificate_and_mutual_tls(tmp_path: Path) -> None:
    out = bcd("fleet", "init", "fl", "--host", "0.0.0.0", "--port", "4556", "--tls-name", "cp.example.net", "--tls-name", "10.1.2.3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    fl = tmp_path / "fl"
    settings = json.loads((fl / "fleet.json").read_text())
    assert settings["url"] == "tls://127.0.0.1:4556" and settings["tls"] is True
    for key in ("ca.key", "upstream.key", "controlplane.key"):
        assert mode(fl / "pki" / key) == "0o600", key
    for cert in ("ca.crt", "upstream.crt", "controlplane.crt"):
        assert mode(fl / "pki" / cert) == "0o644", cert
    # 0.0.0.0 is no name; loopback, localhost and each --tls-name are
    assert sorted(san(fl / "pki" / "upstream.crt")) == sorted(["127.0.0.1", "localhost", "cp.example.net", "10.1.2.3"])
    ca = pki.load_certificate(fl / "pki" / "ca.crt")
    for leaf in ("upstream.crt", "controlplane.crt"):
        pki.load_certificate(fl / "pki" / leaf).verify_directly_issued_by(ca)
    conf = json.loads((fl / "upstream" / "nats.conf").read_text())
    assert conf["tls"] == {
        "cert_file": str((fl / "pki" / "upstream.crt").resolve()),
        "key_file": str((fl / "pki" / "upstream.key").resolve()),
        "ca_file": str((fl / "pki" / "ca.crt").resolve()),
        "verify": True,
        "timeout": 2,
    }
    assert conf["host"] == "0.0.0.0"
    assert (
        "BCD_CP_NATS_URL=tls://127.0.0.1:4556 BCD_CP_NKEY_FILE=fl/upstream/controlplane.nk BCD_CP_CA_FILE=fl/pki/ca.crt "
        "BCD_CP_CERT_FILE=fl/pki/controlplane.crt BCD_CP_KEY_FILE=fl/pki/controlplane.key BCD_CP_STATE_DIR=fl/controlplane"
    ) in out.stdout
    # again: the same CA and certificates; another name re-issues the server's only
    before = {p.name: p.read_bytes() for p in (fl / "pki").iterdir() if p.is_file()}
    again = ("fleet", "init", "fl", "--host", "0.0.0.0", "--port", "4556", "--tls-name", "cp.example.net", "--tls-name", "10.1.2.3")
    assert bcd(*again, cwd=tmp_path).returncode == 0
    assert before == {p.name: p.read_bytes() for p in (fl / "pki").iterdir() if p.is_file()}
    assert bcd(*again, "--tls-name", "cp2.example.net", cwd=tmp_path).returncode == 0
    after = {p.name: p.read_bytes() for p in (fl / "pki").iterdir() if p.is_file()}
    assert {n for n in before if before[n] != after[n]} == {"upstream.crt", "upstream.key"}
    assert "cp2.example.net" in san(fl / "pki" / "upstream.crt")
    bad = bcd("fleet", "init", "fl2", "--tls-name", "a b", cwd=tmp_path)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


def test_add_node_makes_its_client_certificate_and_prints_the_tls_flags(tmp_path: Path) -> None:
    assert bcd("fleet", "init", "fl", cwd=tmp_path).returncode == 0
    fl = tmp_path / "fl"
    out = bcd("fleet", "add-node", "fl", "node-a", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (
        "--upstream tls://127.0.0.1:4222 --cp-key fl/controlplane/cp.pub --upstream-nkey-file fl/nodes/node-a.nk "
        "--upstream-ca fl/pki/ca.crt --upstream-cert fl/pki/nodes/node-a.crt --upstream-key fl/pki/nodes/node-a.key"
    ) in out.stdout
    assert mode(fl / "pki" / "nodes" / "node-a.key") == "0o600"
    cert = pki.load_certificate(fl / "pki" / "nodes" / "node-a.crt")
    cert.verify_directly_issued_by(pki.load_certificate(fl / "pki" / "ca.crt"))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "node-a"
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    first = (fl / "pki" / "nodes" / "node-a.crt").read_bytes()
    assert bcd("fleet", "add-node", "fl", "node-a", cwd=tmp_path).returncode == 0  # again: the same certificate
    assert (fl / "pki" / "nodes" / "node-a.crt").read_bytes() == first


def test_renew_reissues_leaf_certificates_in_place(tmp_path: Path) -> None:
    assert bcd("fleet", "init", "fl", "--tls-name", "cp.example.net", cwd=tmp_path).returncode == 0
    assert bcd("fleet", "add-node", "fl", "node-a", cwd=tmp_path).returncode == 0
    fl = tmp_path / "fl"
    pk = fl / "pki"
    files = ["ca.crt", "ca.key", "upstream.crt", "upstream.key", "controlplane.crt", "controlplane.key", "nodes/node-a.crt", "nodes/node-a.key"]
    before = {n: (pk / n).read_bytes() for n in files}
    out = bcd("fleet", "renew", "fl", "node-a", "--days", "30", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "renewed node-a: fl/pki/nodes/node-a.crt (valid until" in out.stdout and "next reconnect" in out.stdout
    changed = {n for n in files if (pk / n).read_bytes() != before[n]}
    assert changed == {"nodes/node-a.crt", "nodes/node-a.key"}
    assert mode(pk / "nodes" / "node-a.key") == "0o600"
    left = pki.expires(pk / "nodes" / "node-a.crt") - datetime.now(timezone.utc)  # type: ignore[operator]
    assert timedelta(days=29) < left < timedelta(days=31)
    out = bcd("fleet", "renew", "fl", "upstream", cwd=tmp_path)
    assert out.returncode == 0 and "renewed upstream" in out.stdout
    assert sorted(san(pk / "upstream.crt")) == sorted(["127.0.0.1", "localhost", "cp.example.net"])
    before = {n: (pk / n).read_bytes() for n in files}
    assert bcd("fleet", "renew", "fl", cwd=tmp_path).returncode == 0  # every leaf, never the CA
    assert {n for n in files if (pk / n).read_bytes() != before[n]} == set(files) - {"ca.crt", "ca.key"}
    bad = bcd("fleet", "renew", "fl", "node-z", cwd=tmp_path)
    assert bad.returncode != 0 and "node-a" in bad.stderr and "Traceback" not in bad.stderr
    assert bcd("fleet", "init", "plain", "--no-tls", cwd=tmp_path).returncode == 0
    plain = bcd("fleet", "renew", "plain", cwd=tmp_path)
    assert plain.returncode != 0 and "no TLS" in plain.stderr


def test_a_fleet_with_a_password_is_migrated_to_an_nkey(tmp_path: Path) -> None:
    """A fleet dir of an older bcd: fleet.json without "tls", controlplane.password, no .nk."""
    fl = tmp_path / "fl"
    (fl / "upstream").mkdir(parents=True)
    (fl / "fleet.json").write_text(json.dumps({"url": "nats://127.0.0.1:4557", "host": "127.0.0.1", "port": 4557, "http_port": 0}))
    (fl / "upstream" / "controlplane.password").write_text("old-secret\n")
    (fl / "upstream" / "nodes.json").write_text("{}\n")
    out = bcd("fleet", "add-node", "fl", "node-a", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "now an nkey user" in out.stderr and "BCD_CP_NKEY_FILE=fl/upstream/controlplane.nk" in out.stderr
    assert not (fl / "upstream" / "controlplane.password").exists()
    conf_text = (fl / "upstream" / "nats.conf").read_text()
    conf = json.loads(conf_text)
    assert "old-secret" not in conf_text and "tls" not in conf
    assert all("password" not in u for a in conf["accounts"].values() for u in a["users"])
    assert mode(fl / "upstream" / "controlplane.nk") == "0o600"
    assert "--upstream nats://127.0.0.1:4557" in out.stdout and "--upstream-ca" not in out.stdout
    again = bcd("fleet", "add-node", "fl", "node-b", cwd=tmp_path)
    assert again.returncode == 0 and "nkey user" not in again.stderr  # said once


def test_add_node_gives_each_node_its_own_nkey_limited_to_its_subjects(tmp_path: Path) -> None:
    assert bcd("fleet", "init", "fl", "--no-tls", cwd=tmp_path).returncode == 0
    fl = tmp_path / "fl"
    out = bcd("fleet", "add-node", "fl", "node-a", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--upstream-ca" not in out.stdout and not (fl / "pki").exists()
    assert "--upstream-nkey-file fl/nodes/node-a.nk" in out.stdout and "--cp-key fl/controlplane/cp.pub" in out.stdout
    assert "picks it up when it starts" in out.stdout  # no upstream running
    seed = (fl / "nodes" / "node-a.nk").read_bytes().strip()
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    assert bcd("fleet", "add-node", "fl", "node-a", cwd=tmp_path).returncode == 0  # again: the same key
    assert bcd("fleet", "add-node", "fl", "node-b", cwd=tmp_path).returncode == 0
    assert (fl / "nodes" / "node-a.nk").read_bytes().strip() == seed
    nodes = json.loads((fl / "upstream" / "nodes.json").read_text())
    assert set(nodes) == {"node-a", "node-b"} and nodes["node-a"] == public
    accounts = json.loads((fl / "upstream" / "nats.conf").read_text())["accounts"]
    # each node alone in its own account, importing only its own subjects from the control plane's
    (cp,) = accounts["UPSTREAM"]["users"]
    assert cp["nkey"] not in nodes.values() and accounts["UPSTREAM"]["jetstream"] == "enabled"
    (entry,) = accounts[upstream_node_account("node-a")]["users"]
    assert entry.get("nkey") == public and "password" not in entry
    refs = [next(iter(i.values())) for i in accounts[upstream_node_account("node-a")]["imports"]]
    assert {r["account"] for r in refs} == {"UPSTREAM"} and not any("node-b" in r["subject"] for r in refs)
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
