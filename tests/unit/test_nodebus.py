"""The embedded bus: binary lookup and the config bcd writes for nats-server."""

from __future__ import annotations

import json
import stat

import pytest

from bcd.nodebus import BusConfig, NatsServerNotFound, ensure_passwords, find_nats_server, node_bus_users, prepare_node_bus
from shared.subjects import NODE_BUS_USERS, NodeSubjects


def test_finds_the_wheels_binary():
    path = find_nats_server()
    assert path.name == "nats-server" and path.stat().st_mode & stat.S_IXUSR


def test_override_must_be_executable(monkeypatch, tmp_path):
    monkeypatch.setenv("BCD_NATS_SERVER", str(tmp_path / "missing"))
    with pytest.raises(NatsServerNotFound, match="BCD_NATS_SERVER"):
        find_nats_server()


def test_config_has_jetstream_sync_always_and_one_user_per_service(tmp_path):
    conf_path, creds = prepare_node_bus(tmp_path / "bus", tmp_path / "js", "node-7")
    conf = json.loads(conf_path.read_text())
    assert conf["jetstream"] == {"store_dir": str(tmp_path / "js"), "sync_interval": "always"}
    assert conf["host"] == "127.0.0.1"
    users = {u["user"]: u for u in conf["accounts"]["NODE"]["users"]}
    assert set(users) == set(NODE_BUS_USERS)
    subjects = NodeSubjects("node-7")
    for name, entry in users.items():
        perms = subjects.permissions(name)
        assert entry["permissions"]["subscribe"]["allow"] == list(perms.subscribe)
        assert entry["password"] == creds[name].read_text().strip()
    # the inventory may not publish to the signer
    assert subjects.signer_sign not in users["inventory"]["permissions"]["publish"]["allow"]


def test_secrets_are_0600_and_stable(tmp_path):
    first = ensure_passwords(tmp_path / "creds", ["signer", "inventory"])
    again = ensure_passwords(tmp_path / "creds", ["signer", "inventory"])
    for user, path in first.items():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert again[user].read_text() == path.read_text()
    assert first["signer"].read_text() != first["inventory"].read_text()
    conf_path, _ = prepare_node_bus(tmp_path / "bus", tmp_path / "js", "n")
    assert stat.S_IMODE(conf_path.stat().st_mode) == 0o600


def test_user_without_publish_rights_gets_a_deny_all_placeholder(tmp_path):
    cfg = BusConfig(store_dir=tmp_path, users=node_bus_users("n", {"signer": "pw"}))
    signer = json.loads(cfg.render())["accounts"]["NODE"]["users"][0]
    # an empty allow list would mean "everything" to nats-server
    assert signer["permissions"]["publish"]["allow"] == ["_bcd_nothing_"]


def test_embedded_upstream_is_a_separate_account_with_per_node_users(tmp_path):
    conf_path, creds = prepare_node_bus(tmp_path / "bus", tmp_path / "js", "n1", upstream_nodes=["n1", "n2"])
    conf = json.loads(conf_path.read_text())
    up = {u["user"]: u for u in conf["accounts"]["UPSTREAM"]["users"]}
    assert set(up) == {"controlplane", "node-n1", "node-n2"}
    assert not {"controlplane", "node-n1"} & {u["user"] for u in conf["accounts"]["NODE"]["users"]}
    n1 = up["node-n1"]["permissions"]
    assert "bcd.events.n1.>" in n1["publish"]["allow"]
    assert not any("n2" in s for s in n1["publish"]["allow"] + n1["subscribe"]["allow"])
    assert conf["accounts"]["UPSTREAM"]["jetstream"] == "enabled"


# ---------------------------------------------------------------------------- write-config (host installs)


def _write_config(tmp_path, *extra: str) -> int:
    from bcd.nodebus import write_config_main

    return write_config_main(
        ["write-config", "--bus-dir", str(tmp_path / "bus"), "--store-dir", str(tmp_path / "nats"), "--state-dir", str(tmp_path / "etc"), *extra]
    )


def test_write_config_writes_the_bus_the_passwords_node_json_and_node_env(tmp_path, capsys):
    import socket

    from bcd.client import node_info
    from bcd.nodebus import NatsServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _write_config(tmp_path, "--node-id", "gpu-7", "--port", str(port), "--http-port", "0", "--with-helper") == 0
    info = node_info(tmp_path / "etc")
    assert info.node_id == "gpu-7" and info.nats_url == f"nats://127.0.0.1:{port}" and info.monitor_url == ""
    assert info.services[-1] == "helper" and set(info.metrics) == set(info.services)
    env = (tmp_path / "etc" / "node.env").read_text()
    assert env == f"BCD_NODE_ID=gpu-7\nBCD_NATS_URL=nats://127.0.0.1:{port}\n"
    creds = tmp_path / "bus" / "creds"
    assert {p.stem for p in creds.glob("*.password")} == set(NODE_BUS_USERS)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in creds.iterdir())
    before = (creds / "converger.password").read_text()
    # run again: passwords are kept, node.env untouched
    assert _write_config(tmp_path, "--node-id", "gpu-7", "--port", str(port), "--http-port", "0") == 0
    assert (creds / "converger.password").read_text() == before
    # the config it wrote starts a real nats-server on that port
    server = NatsServer(tmp_path / "bus" / "nats.conf", tmp_path / "nats.log")
    server.start()
    try:
        assert server.port == port
    finally:
        server.stop()
    capsys.readouterr()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--node-id", "Bad_Id"], "not a valid subject token"),
        (["--node-id", "events"], "reserved"),
        (["--node-id", "n1", "--port", "-1"], "fixed ports"),
    ],
)
def test_write_config_refuses(tmp_path, capsys, args, words):
    assert _write_config(tmp_path, *args) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "bus" / "nats.conf").exists()


def test_write_config_refuses_to_change_the_node_id_of_an_installed_node(tmp_path, capsys):
    assert _write_config(tmp_path, "--node-id", "n1") == 0
    assert _write_config(tmp_path, "--node-id", "n2") == 2
    assert "names node 'n1'" in capsys.readouterr().err
    assert "BCD_NODE_ID=n1" in (tmp_path / "etc" / "node.env").read_text()
