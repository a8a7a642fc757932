"""The bridge against an upstream in operator (decentralized JWT) mode,
authenticating by a `.creds` file (`--upstream-creds`)."""

from __future__ import annotations

import asyncio
import json
import stat
from datetime import datetime, timezone

import nats
import nkeys
import pytest

from bcd.nodebus import NatsServer, write_private
from controlplane.keys import load_or_create_cp_key
from shared.schemas import AllocationBound, ReportBody, encode
from shared.subjects import (
    CONTROLPLANE_USER,
    inbox_prefix,
    upstream_controlplane_permissions,
    upstream_node_permissions,
    upstream_node_user,
)

from . import natsjwt
from .test_bridge_credentials import bound_through, start_node, stop

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_bridge_authenticates_upstream_with_a_creds_file(tmp_path):
    op_seed = natsjwt.new_seed(nkeys.PREFIX_BYTE_OPERATOR)
    sys_seed = natsjwt.new_seed(nkeys.PREFIX_BYTE_ACCOUNT)
    acct_seed = natsjwt.new_seed(nkeys.PREFIX_BYTE_ACCOUNT)
    sys_pub, acct_pub = natsjwt.public_key(sys_seed), natsjwt.public_key(acct_seed)

    node_user = upstream_node_user("node-1")
    node_seed = natsjwt.new_seed(nkeys.PREFIX_BYTE_USER)
    node_jwt = natsjwt.user_jwt(acct_seed, natsjwt.public_key(node_seed), node_user, upstream_node_permissions("node-1"))
    cp_seed = natsjwt.new_seed(nkeys.PREFIX_BYTE_USER)
    cp_jwt = natsjwt.user_jwt(acct_seed, natsjwt.public_key(cp_seed), CONTROLPLANE_USER, upstream_controlplane_permissions())

    # the node user's JWT carries exactly the upstream permissions, no `resp`
    perms = upstream_node_permissions("node-1")
    assert not perms.allow_responses
    claims = natsjwt.decode_claims(node_jwt)["nats"]
    assert claims["pub"] == {"allow": list(perms.publish)} and claims["sub"] == {"allow": list(perms.subscribe)}
    assert "resp" not in claims

    node_creds = natsjwt.write_user_creds(tmp_path / "node-1.creds", node_jwt, node_seed)
    cp_creds = natsjwt.write_user_creds(tmp_path / "controlplane.creds", cp_jwt, cp_seed)
    assert stat.S_IMODE(node_creds.stat().st_mode) == 0o600

    conf = natsjwt.operator_server_config(
        store_dir=tmp_path / "js",
        operator=natsjwt.operator_jwt(op_seed, "bcd-test-operator", system_account=sys_pub),
        system_account=sys_pub,
        accounts={
            sys_pub: natsjwt.account_jwt(op_seed, sys_pub, "SYS", jetstream=False),
            acct_pub: natsjwt.account_jwt(op_seed, acct_pub, "UPSTREAM"),
        },
    )
    write_private(tmp_path / "up.conf", json.dumps(conf))
    upstream = NatsServer(tmp_path / "up.conf", tmp_path / "up.log").start()

    proc = start_node(tmp_path, upstream.url, load_or_create_cp_key(tmp_path / "cp")[1], "--upstream-creds", str(node_creds))
    cp_nc = n1 = None
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    try:
        cp_nc = await nats.connect(upstream.url, user_credentials=str(cp_creds), inbox_prefix=inbox_prefix(CONTROLPLANE_USER).encode())
        await bound_through(cp_nc, tmp_path, "node-1", proc)

        # the node's creds cannot write another node's events
        n1 = await nats.connect(upstream.url, user_credentials=str(node_creds), inbox_prefix=inbox_prefix(node_user).encode(), error_cb=on_error)
        body = ReportBody(node_id="node-2", boot_id="b", event_id="node-2.x.bound.g1", time=datetime.now(timezone.utc),
                          event=AllocationBound(allocation_id="x", reservation_id="rsv-x", generation=1, devices=[]))
        await n1.publish("bcd.events.node-2.bound", encode(body))
        await n1.flush()
        for _ in range(25):
            if errors:
                break
            await asyncio.sleep(0.1)
        # nats-py lowercases the subject in its violation messages
        text = " | ".join(str(e) for e in errors).lower()
        assert 'permissions violation for publish to "bcd.events.node-2.bound"' in text, text
    finally:
        if n1 is not None:
            await n1.close()
        if cp_nc is not None:
            await cp_nc.close()
        stop(proc)
        upstream.stop()
