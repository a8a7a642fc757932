"""Admin access (KEP-5018) end to end: the stand-in kubelet prepares a claim whose allocation
results say `adminAccess: true`, through the DRA plugin and the converger, on a whole node.

A monitoring claim gets a card another claim holds and the MIG instance another claim made,
makes no MIG instance, and is no holder: a plain hold still binds the card it looks at, and
unpreparing it leaves the other claim's instance alone.
"""

from __future__ import annotations

import json

import pytest

from .dra_kubelet_standin import DraKubelet
from .test_dra_plugin import DRIVER, MIG_CARD, NODE, api, apply, card, claim, host, start, stop, wait_devices  # noqa: F401 - api is a fixture
from .wholenode import GPU, assignment

__all__ = ["api"]


def admin_claim(api, name: str, *devices: str) -> tuple[str, str, str]:
    """A claim that asks for admin access, allocated with it (v1 adminAccess on its requests and
    results), in a namespace labelled for it: the API server refuses it elsewhere."""
    api.admit_admin_access("monitoring")
    uid = api.add_claim("monitoring", name, results=[("gpu", DRIVER, NODE, d) for d in devices], admin_access=True)
    return ("monitoring", name, uid)


def test_the_api_server_refuses_admin_access_outside_a_labelled_namespace(api):
    """KEP-5018: only a namespace labelled resource.kubernetes.io/admin-access=true may hold such a
    claim (pkg/registry/resource/utils.go AuthorizedForAdmin); bcd never sees one from elsewhere."""
    with pytest.raises(ValueError, match="requires the `resource.kubernetes.io/admin-access: true` label"):
        api.add_claim("ml", "peek", results=[("gpu", DRIVER, NODE, "gpu-0")], admin_access=True)
    assert api.claim("ml", "peek") is None
    api.admit_admin_access("ml")
    api.add_claim("ml", "peek", results=[("gpu", DRIVER, NODE, "gpu-0")], admin_access=True)
    stored = api.claim("ml", "peek")
    assert stored["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] is True
    assert [r["adminAccess"] for r in stored["status"]["allocation"]["devices"]["results"]] == [True]


async def test_an_admin_access_claim_is_prepared_read_only_and_holds_nothing(tmp_path, short_dir, api):
    h = host(tmp_path)
    node = await start(tmp_path, short_dir, api, h)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-0" in d and "gpu-1" in d and "gpu-6-mig-3g-71gb-4" in d, "the node's devices")
        whole = claim(api, "whole", "gpu-0")
        half = claim(api, "half", "gpu-6-mig-3g-71gb-4")
        got = await kubelet.prepare(whole, half)
        assert got[whole[2]].error == "" and got[half[2]].error == "", got
        made = card(h, MIG_CARD)["mig_instances"]
        assert len(made) == 1

        # the monitor: a card another claim holds, that claim's MIG instance, and a free card
        mon = admin_claim(api, "monitor", "gpu-0", "gpu-6-mig-3g-71gb-4", "gpu-1")
        reply = (await kubelet.prepare(mon))[mon[2]]
        assert reply.error == "", reply.error
        ids = {d.device_name: list(d.cdi_device_ids) for d in reply.devices}
        assert ids["gpu-0"] == [f"bcd.dev/gpu={GPU[0]}"] and ids["gpu-1"] == [f"bcd.dev/gpu={GPU[1]}"]
        # the MIG device is the instance the other claim made (the same CDI device as its own)
        assert ids["gpu-6-mig-3g-71gb-4"] == list(got[half[2]].devices[0].cdi_device_ids)
        spec = json.loads((node.state / "cdi" / f"bcd-claim-{mon[2]}.json").read_text())
        visible = next(e for e in spec["containerEdits"]["env"] if e.startswith("NVIDIA_VISIBLE_DEVICES="))
        assert made[0]["uuid"] in visible and GPU[0] in visible and GPU[1] in visible
        assert card(h, MIG_CARD)["mig_instances"] == made  # no MIG instance made
        st = node.status()["converger"]
        mine = next(c for c in st["claims"] if c["name"] == "monitor")
        assert mine["state"] == "prepared" and "admin access (read-only) to gpu-1" in mine["sharing"]

        # no holder: a plain hold binds the card it looks at (gpu-1), and another claim is refused
        # only by the ordinary claim on gpu-0, never by the monitor
        await apply(node, assignment("plain", GPU[1]))
        assert node.status()["converger"]["failures"] == {}
        other = claim(api, "other", "gpu-0")
        err = (await kubelet.prepare(other))[other[2]].error
        assert "DRA claim ml/whole" in err and "monitor" not in err, err

        # unprepared: its file goes, the other claim's instance stays
        assert (await kubelet.unprepare(mon))[mon[2]].error == ""
        assert card(h, MIG_CARD)["mig_instances"] == made
        assert not (node.state / "cdi" / f"bcd-claim-{mon[2]}.json").exists()
    finally:
        await kubelet.close()
        await stop(node)


async def test_an_admin_access_claim_makes_no_mig_instance(tmp_path, short_dir, api):
    node = await start(tmp_path, short_dir, api)
    kubelet = DraKubelet(short_dir)
    try:
        await kubelet.register(DRIVER)
        await wait_devices(api, lambda d: "gpu-6-mig-1g-18gb-0" in d, "card 6's placements")
        mon = admin_claim(api, "monitor", "gpu-6-mig-1g-18gb-0")
        err = (await kubelet.prepare(mon))[mon[2]].error
        assert "device-missing" in err and "admin access makes none" in err, err
        assert not list((node.state / "cdi").glob("bcd-claim-*.json"))
    finally:
        await kubelet.close()
        await stop(node)

