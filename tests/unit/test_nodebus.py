"""The embedded bus: binary lookup and the config bcd writes for nats-server."""

from __future__ import annotations

import json
import stat

import pytest

from bcd.nodebus import BusConfig, NatsServerNotFound, ensure_passwords, find_nats_server, node_bus_accounts, prepare_node_bus
from shared.subjects import (
    BUS_ADMIN_USER,
    BUS_STORE,
    NODE_BUS_USERS,
    NODE_STORE_ACCOUNT,
    UPSTREAM_ACCOUNT,
    NodeSubjects,
    node_account,
    upstream_node_account,
)


def test_finds_the_wheels_binary():
    path = find_nats_server()
    assert path.name == "nats-server" and path.stat().st_mode & stat.S_IXUSR


def test_override_must_be_executable(monkeypatch, tmp_path):
    monkeypatch.setenv("BCD_NATS_SERVER", str(tmp_path / "missing"))
    with pytest.raises(NatsServerNotFound, match="BCD_NATS_SERVER"):
        find_nats_server()


def test_config_has_jetstream_sync_always_and_each_identity_alone_in_its_account(tmp_path):
    conf_path, creds = prepare_node_bus(tmp_path / "bus", tmp_path / "js", "node-7")
    conf = json.loads(conf_path.read_text())
    assert conf["jetstream"] == {"store_dir": str(tmp_path / "js"), "sync_interval": "always"}
    assert conf["host"] == "127.0.0.1"
    accounts = conf["accounts"]
    subjects = NodeSubjects("node-7")
    for name in NODE_BUS_USERS:
        account = accounts[node_account(name)]
        assert [u["user"] for u in account["users"]] == [name], "alone in its account"
        assert "jetstream" not in account, f"{name}'s account has JetStream: it could make a stream there"
        entry = account["users"][0]
        perms = subjects.permissions(name)
        assert entry["permissions"]["subscribe"]["allow"] == list(perms.subscribe)
        assert entry["password"] == creds[name].read_text().strip()
    # JetStream is in the store account only, whose one user is the bus setup's
    store = accounts[NODE_STORE_ACCOUNT]
    assert store["jetstream"] == "enabled"
    assert [u["user"] for u in store["users"]] == [BUS_ADMIN_USER]
    assert "imports" not in store, "the store imports nothing: nothing it delivers reaches a service"
    # the inventory may not publish to the signer
    inv = accounts[node_account("inventory")]["users"][0]["permissions"]["publish"]["allow"]
    assert subjects.signer_sign not in inv


def test_every_import_and_export_is_a_route_and_names_exactly_its_callers(tmp_path):
    conf_path, _ = prepare_node_bus(tmp_path / "bus", tmp_path / "js", "node-7")
    accounts = json.loads(conf_path.read_text())["accounts"]
    subjects = NodeSubjects("node-7")
    routes = subjects.routes()
    # what each account exports is exactly the routes it owns, to exactly their callers' accounts
    for r in routes:
        owner = accounts[node_account(r.owner)]
        kind = "stream" if r.notice else "service"
        exports = [e for e in owner.get("exports", []) if e.get(kind) == r.subject]
        assert len(exports) == 1, r
        assert sorted(exports[0]["accounts"]) == sorted(node_account(c) for c in r.callers), r
        for c in r.callers:
            imports = accounts[node_account(c)]["imports"]
            assert {kind: {"account": node_account(r.owner), "subject": r.subject}} in imports, (c, r)
    # and nothing else crosses, but the store's $JS.API.INFO (shadowing the server's own JS API import)
    declared = {(node_account(c), r.subject) for r in routes for c in r.callers}
    js_users = {node_account(c) for r in routes if r.owner == BUS_STORE for c in r.callers}
    for name, account in accounts.items():
        for imp in account.get("imports", []):
            ((kind, ref),) = imp.items()
            if ref["subject"] == "$JS.API.INFO":
                assert ref["account"] == NODE_STORE_ACCOUNT and name in js_users
                continue
            assert (name, ref["subject"]) in declared, (name, imp)
    for name in {node_account(u) for u in NODE_BUS_USERS} - js_users:
        assert not any(i.get("service", {}).get("subject") == "$JS.API.INFO" for i in accounts[name].get("imports", []))


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
    cfg = BusConfig(store_dir=tmp_path, accounts=node_bus_accounts("n", {"signer": "pw"}))
    signer = json.loads(cfg.render())["accounts"][node_account("signer")]["users"][0]
    # an empty allow list would mean "everything" to nats-server
    assert signer["permissions"]["publish"]["allow"] == ["_bcd_nothing_"]


def test_embedded_upstream_is_an_account_per_node_beside_the_control_planes(tmp_path):
    conf_path, creds = prepare_node_bus(tmp_path / "bus", tmp_path / "js", "n1", upstream_nodes=["n1", "n2"])
    accounts = json.loads(conf_path.read_text())["accounts"]
    up = accounts[UPSTREAM_ACCOUNT]
    assert [u["user"] for u in up["users"]] == ["controlplane"] and up["jetstream"] == "enabled"
    for node in ("n1", "n2"):
        account = accounts[upstream_node_account(node)]
        assert [u["user"] for u in account["users"]] == [f"node-{node}"] and "jetstream" not in account
        perms = account["users"][0]["permissions"]
        assert f"bcd.events.{node}.>" in perms["publish"]["allow"]
        other = "n2" if node == "n1" else "n1"
        refs = [next(iter(i.values())) for i in account["imports"]]
        assert {r["account"] for r in refs} == {UPSTREAM_ACCOUNT}
        assert not any(other in r["subject"] for r in refs) and not any(other in s for s in perms["publish"]["allow"])
        # the control plane's account exports each node's subjects to that node's account alone
        for r in refs:
            if r["subject"] == "$JS.API.INFO":
                continue
            (export,) = [e for e in up["exports"] if r["subject"] in (e.get("service"), e.get("stream"))]
            assert export["accounts"] == [upstream_node_account(node)]
    # the buses share no account, and no import crosses between them
    node_bus = {node_account(u) for u in NODE_BUS_USERS} | {NODE_STORE_ACCOUNT}
    upstream = {UPSTREAM_ACCOUNT, upstream_node_account("n1"), upstream_node_account("n2")}
    assert set(accounts) == node_bus | upstream
    for name, account in accounts.items():
        for imp in account.get("imports", []):
            source = next(iter(imp.values()))["account"]
            assert (name in node_bus) == (source in node_bus), (name, imp)


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
    assert {p.stem for p in creds.glob("*.password")} == {*NODE_BUS_USERS, BUS_ADMIN_USER}
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
