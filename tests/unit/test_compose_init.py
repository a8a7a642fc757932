"""`bcd compose init DIR`: the files deploy/compose/compose.yaml mounts, owned by the one
container user that reads each (bcd/compose.py)."""

from __future__ import annotations

import argparse
import json
import os
import ssl
import stat
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509

import pytest

from bcd.compose import GROUP_ID, UIDS, cmd_init, init
from shared import pki
from shared.subjects import BUS_ADMIN_USER, NODE_STORE_ACCOUNT, NodeSubjects, node_account, upstream_node_account

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bcd compose init chowns files to the image's users: it runs as root")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hosts" / "h200x8.json"


def owner_mode(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)


def test_each_secret_belongs_to_the_one_user_that_reads_it(tmp_path: Path) -> None:
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    creds = d / "bus" / "creds"
    for svc in ("signer", "inventory", "converger", "gateway_bridge", "kube_reaper", "device_plugin", "vfio_switcher"):
        assert owner_mode(creds / f"{svc}.password") == (UIDS[svc], GROUP_ID, 0o400), svc
    assert owner_mode(creds / "controlplane.password") == (UIDS["controlplane"], GROUP_ID, 0o400)
    assert owner_mode(creds / "node-node-7.password") == (UIDS["gateway_bridge"], GROUP_ID, 0o400)  # the bridge's upstream user
    assert owner_mode(creds / "helper.password")[0::2] == (0, 0o400)
    assert owner_mode(creds / "cli.password")[0::2] == (0, 0o400)  # the host's operator
    assert owner_mode(d / "bus" / "nats.conf") == (UIDS["nats"], GROUP_ID, 0o400)
    for svc in ("signer", "inventory", "converger"):
        assert owner_mode(d / "data" / svc) == (UIDS[svc], GROUP_ID, 0o700), svc
    # the hold directories are root's alone (the helper writes them; init the fake vendor spec)
    assert owner_mode(d / "cdi") == (0, GROUP_ID, 0o2755)
    assert owner_mode(d / "run") == (0, GROUP_ID, 0o2755)
    # the device plugin's stand-in kubelet dir: it makes its sockets in device-plugins/
    assert owner_mode(d / "kubelet" / "device-plugins") == (UIDS["device_plugin"], GROUP_ID, 0o750)
    assert owner_mode(d / "kubelet" / "plugins_registry") == (UIDS["dra_plugin"], GROUP_ID, 0o750)
    assert owner_mode(d / "kubelet" / "plugins" / "gpu.bcd.dev") == (UIDS["dra_plugin"], GROUP_ID, 0o750)
    assert f"BCD_KUBELET_DIR={d / 'kubelet'}\n" in (d / ".env").read_text()
    assert owner_mode(d / "controlplane" / "cp.key")[0::2] == (UIDS["controlplane"], 0o600)


def test_the_bus_config_gives_each_user_exactly_its_permissions(tmp_path: Path) -> None:
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    conf = json.loads((d / "bus" / "nats.conf").read_text())
    # each identity alone in its own account; the store account holds JetStream and the bus setup
    users = {u["user"]: (name, u) for name, a in conf["accounts"].items() for u in a["users"]}
    subjects = NodeSubjects("node-7")
    services = {"signer", "inventory", "converger", "gateway_bridge", "kube_reaper", "device_plugin", "dra_plugin", "vfio_switcher", "helper", "cli"}
    assert set(users) == services | {BUS_ADMIN_USER}
    for name, (account, user) in users.items():
        assert user["password"] == (d / "bus" / "creds" / f"{name}.password").read_text().strip()
        if name == BUS_ADMIN_USER:
            assert account == NODE_STORE_ACCOUNT and conf["accounts"][account]["jetstream"] == "enabled"
            continue
        assert account == node_account(name) and "jetstream" not in conf["accounts"][account]
        assert user["permissions"]["publish"]["allow"] == list(subjects.permissions(name).publish) or ["_bcd_nothing_"]
    assert conf["host"] == "0.0.0.0" and conf["port"] == 4222 and conf["jetstream"]["store_dir"] == "/data"
    # the bus setup's password is the bus's own uid's, no service's
    assert owner_mode(d / "bus" / "creds" / f"{BUS_ADMIN_USER}.password")[0::2] == (UIDS["nats"], 0o400)
    up = json.loads((d / "upstream" / "nats.conf").read_text())
    assert {u["user"] for a in up["accounts"].values() for u in a["users"]} == {"controlplane", "node-node-7"}
    assert [u["user"] for u in up["accounts"][upstream_node_account("node-7")]["users"]] == ["node-node-7"]


def test_env_and_node_json_point_the_host_at_the_published_ports(tmp_path: Path) -> None:
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=14000, http_port=18000, upstream_port=14001)
    env = dict(line.split("=", 1) for line in (d / ".env").read_text().splitlines())
    assert env["BCD_DIR"] == str(d.resolve()) and env["BCD_NODE_ID"] == "node-7" and env["BCD_NODE_UPSTREAM_USER"] == "node-node-7"
    assert (env["BCD_BUS_PORT"], env["BCD_BUS_HTTP_PORT"], env["BCD_UPSTREAM_PORT"]) == ("14000", "18000", "14001")
    info = json.loads((d / "node.json").read_text())
    assert info["nats_url"] == "nats://127.0.0.1:14000" and info["upstream_url"] == "tls://127.0.0.1:14001"
    assert info["controlplane_dir"] == str(d.resolve() / "controlplane")
    assert json.loads((d / "host" / "host.json").read_text()) == json.loads(EXAMPLE.read_text())


def test_init_again_keeps_every_password_key_and_host_file(tmp_path: Path) -> None:
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    host = d / "host" / "host.json"
    host.write_text(host.read_text().replace('"vfio-pci"', '"vfio-pci" '))  # the fake kernel edited it
    before = {p.name: p.read_bytes() for p in [*(d / "bus" / "creds").iterdir(), d / "controlplane" / "cp.key", host]}
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert {p.name: p.read_bytes() for p in [*(d / "bus" / "creds").iterdir(), d / "controlplane" / "cp.key", host]} == before


def test_a_bad_node_id_or_a_missing_host_file_is_refused_with_a_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError):
        init(tmp_path / "x", "../etc", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert not (tmp_path / "x").exists()
    args = argparse.Namespace(dir=tmp_path / "y", node_id="node-1", fake_host=tmp_path / "nope.json", bus_port=1, http_port=2, upstream_port=3)
    assert cmd_init(args) == 2
    assert "nope.json does not exist" in capsys.readouterr().err
    args.fake_host, args.node_id = EXAMPLE, "a b"
    assert cmd_init(args) == 2
    assert "bcd compose init:" in capsys.readouterr().err


def _names(cert: Path) -> list[str]:
    san = pki.load_certificate(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [*san.get_values_for_type(x509.DNSName), *(str(a) for a in san.get_values_for_type(x509.IPAddress))]


def test_the_upstream_speaks_mutual_tls_with_one_directory_per_reader(tmp_path: Path) -> None:
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    pkidir = d / "pki"
    assert owner_mode(pkidir / "ca")[0::2] == (0, 0o700) and owner_mode(pkidir / "ca" / "ca.key")[0::2] == (0, 0o600)
    ca = pki.load_certificate(pkidir / "ca" / "ca.crt")
    for reader, uid in (("upstream", UIDS["nats"]), ("gateway_bridge", UIDS["gateway_bridge"]), ("controlplane", UIDS["controlplane"])):
        where = pkidir / reader
        assert owner_mode(where) == (uid, GROUP_ID, 0o500), reader
        assert owner_mode(where / "tls.key") == (uid, GROUP_ID, 0o400), reader
        assert owner_mode(where / "tls.crt")[0::2] == (uid, 0o444) and owner_mode(where / "ca.crt")[0::2] == (uid, 0o444)
        assert (where / "ca.crt").read_bytes() == (pkidir / "ca" / "ca.crt").read_bytes()
        pki.load_certificate(where / "tls.crt").verify_directly_issued_by(ca)
        # OpenSSL takes each pair: the key is the certificate's
        ssl.create_default_context().load_cert_chain(where / "tls.crt", where / "tls.key")
    assert {"upstream", "127.0.0.1"} <= set(_names(pkidir / "upstream" / "tls.crt"))
    cn = pki.load_certificate(pkidir / "gateway_bridge" / "tls.crt").subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
    assert cn == "node-node-7"
    up = json.loads((d / "upstream" / "nats.conf").read_text())
    assert up["tls"] == {"cert_file": "/etc/bcd/tls/tls.crt", "key_file": "/etc/bcd/tls/tls.key", "ca_file": "/etc/bcd/tls/ca.crt", "verify": True, "timeout": 2}
    assert "tls" not in json.loads((d / "bus" / "nats.conf").read_text())  # the node bus stays on its private network


def test_init_again_keeps_the_certificates_and_renews_one_near_its_end(tmp_path: Path) -> None:
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    files = sorted(p for p in (d / "pki").rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert {p: p.read_bytes() for p in files} == before
    # the bridge's certificate ends in a week: issued again, the others kept
    bridge = d / "pki" / "gateway_bridge"
    soon = datetime.now(timezone.utc) + timedelta(days=7)
    pki.issue(pki.Issued(d / "pki" / "ca" / "ca.crt", d / "pki" / "ca" / "ca.key"), bridge / "tls.crt", bridge / "tls.key", common_name="node-node-7", client=True, not_after=soon)
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert pki.expires(bridge / "tls.crt") > soon + timedelta(days=300)  # type: ignore[operator]
    assert owner_mode(bridge / "tls.key") == (UIDS["gateway_bridge"], GROUP_ID, 0o400)
    assert (d / "pki" / "upstream" / "tls.crt").read_bytes() == before[d / "pki" / "upstream" / "tls.crt"]
    # a CA made anew (its key lost) re-issues every certificate under it
    (d / "pki" / "ca" / "ca.key").unlink()
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    ca = pki.load_certificate(d / "pki" / "ca" / "ca.crt")
    for reader in ("upstream", "gateway_bridge", "controlplane"):
        pki.load_certificate(d / "pki" / reader / "tls.crt").verify_directly_issued_by(ca)
        assert (d / "pki" / reader / "ca.crt").read_bytes() == (d / "pki" / "ca" / "ca.crt").read_bytes()


# --------------------------------------------------------------------------- issue 40: no group write


def _writable_by_others(root: Path) -> list[str]:
    """Every directory and file under root that a group or other user may write."""
    out = []
    for p in [root, *root.rglob("*")]:
        st = p.lstat()
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            out.append(f"{p.relative_to(root)} {oct(stat.S_IMODE(st.st_mode))}")
    return out


def test_each_directory_is_writable_only_by_its_owner(tmp_path: Path) -> None:
    """cdi/ and host/ were writable by group bcd, which every service shares (issue 40)."""
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert _writable_by_others(d) == []
    # the fake vendor spec is root's, written by init, not by the inventory
    assert owner_mode(d / "cdi" / "nvidia.json") == (0, GROUP_ID, 0o644)
    # the fake host is the fake kernel's (vfio_switcher rewrites host.json in host/), read by all
    assert owner_mode(d / "host") == (UIDS["vfio_switcher"], GROUP_ID, 0o755)
    assert owner_mode(d / "host" / "host.json") == (UIDS["vfio_switcher"], GROUP_ID, 0o644)


def test_an_earlier_layout_is_tightened_by_init_again(tmp_path: Path) -> None:
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    # what init made before issue 40
    os.chmod(d / "cdi", 0o2775)
    os.chown(d / "host", 0, GROUP_ID)
    os.chmod(d / "host", 0o2775)
    os.chown(d / "host" / "host.json", 0, GROUP_ID)
    os.chmod(d / "host" / "host.json", 0o664)
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert _writable_by_others(d) == []
    assert owner_mode(d / "host" / "host.json")[0] == UIDS["vfio_switcher"]


def test_the_inventory_finds_the_vendor_spec_in_place_and_writes_nothing(tmp_path: Path) -> None:
    """Its container mounts cdi/ read-only: init's bytes must be the ones the fakehw adapter writes."""
    from services.inventory.adapters.fakehw import FakeHwAdapter

    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    spec = d / "cdi" / "nvidia.json"
    before = spec.stat()
    assert FakeHwAdapter(d / "host" / "host.json", cdi_dir=d / "cdi").write_cdi_spec() is True
    # the same file, untouched (root here could write anyway: the inode says it did not)
    assert (spec.stat().st_ino, spec.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert json.loads(spec.read_text()) == json.loads(EXAMPLE.read_text())["vendor_cdi_spec"]


def test_the_vendor_spec_follows_the_host_file_and_is_rewritten_only_when_it_differs(tmp_path: Path) -> None:
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    spec = d / "cdi" / "nvidia.json"
    ino = spec.stat().st_ino
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert spec.stat().st_ino == ino  # unchanged: not rewritten (runtimes watch the directory)
    host = json.loads((d / "host" / "host.json").read_text())
    host["vendor_cdi_spec"]["devices"] = host["vendor_cdi_spec"]["devices"][:1]
    (d / "host" / "host.json").write_text(json.dumps(host))
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert json.loads(spec.read_text())["devices"] == host["vendor_cdi_spec"]["devices"]


@pytest.mark.parametrize("planted", ["symlink", "dangling-symlink", "fifo"])
def test_what_vfio_switcher_plants_at_host_json_is_never_followed(tmp_path: Path, planted: str) -> None:
    """host/ is that user's now: init running as root must not chown, chmod or write through a link there."""
    d = tmp_path / "node"
    init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    victim = tmp_path / "root-only"
    victim.write_text("secret")
    os.chmod(victim, 0o600)
    host = d / "host" / "host.json"
    host.unlink()
    if planted == "symlink":
        host.symlink_to(victim)
    elif planted == "dangling-symlink":
        host.symlink_to(tmp_path / "made-by-root")
    else:
        os.mkfifo(host)
    with pytest.raises(ValueError, match="host.json"):
        init(d, "node-7", EXAMPLE, bus_port=1, http_port=2, upstream_port=3)
    assert owner_mode(victim) == (0, 0, 0o600) and victim.read_text() == "secret"
    assert not (tmp_path / "made-by-root").exists()
