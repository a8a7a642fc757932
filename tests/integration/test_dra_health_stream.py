"""Device health to the kubelet end to end (KEP 4680): a whole node (`bcd up` on a fake host), the
API server stand-in and the kubelet stand-in's health client on the official dra-health protos.

An XID injected into the fake host (what NVML's event set would report) makes the card
Healthy=False in the inventory; within seconds both the v1 stream (a 1.37 kubelet, which opens it
because the plugin advertised it) and the v1alpha1 stream (an older kubelet) say UNHEALTHY for
every device of that card, the whole card and each MIG placement, with the XID in a message of at
most 1024 characters, and HEALTHY for the rest; a kubelet that reconnects gets that list at once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .dra_kubelet_standin import HEALTH_V1, HEALTH_V1ALPHA1, DraKubelet
from .kubeapi_standin import KubeApiStandIn
from .test_dra_plugin import DRIVER, MIG_CARD, NODE, devices_of, host, start, stop, throw_xid, wait_devices

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _health(update: dict) -> dict[str, str]:
    return {dev: h for (_, dev), (h, _, _) in update.items()}


async def test_an_injected_xid_reaches_both_health_streams_within_seconds(tmp_path: Path, short_dir: Path) -> None:
    with KubeApiStandIn() as api:
        api.add_node(NODE)
        h = host(tmp_path)
        node = await start(tmp_path, short_dir, api, h)
        kubelet = DraKubelet(short_dir)
        watches = []
        try:
            info = await kubelet.register(DRIVER)
            assert HEALTH_V1 in info.supported_versions and HEALTH_V1ALPHA1 in info.supported_versions
            published = await wait_devices(api, lambda d: "gpu-2" in d and "gpu-6-mig-1g-18gb-0" in d, "the node's devices")
            watches = [kubelet.watch_health("1.37"), kubelet.watch_health("1.35")]
            assert [w.service for w in watches] == [HEALTH_V1, HEALTH_V1ALPHA1]
            for w in watches:
                # the full list: every published device, each with its card's health (checked by now)
                first = await w.wait(lambda u: set(_health(u)) == set(devices_of(api)) and set(_health(u).values()) == {"HEALTHY"}, "every device healthy", timeout=60)
                assert set(_health(first)) >= set(published) and {p for p, _ in first} == {NODE}

            at = time.monotonic()
            throw_xid(h, 2, 79)
            throw_xid(h, MIG_CARD, 48)

            def sick(u: dict) -> bool:
                got = _health(u)
                return got.get("gpu-2") == "UNHEALTHY" and all(v == "UNHEALTHY" for n, v in got.items() if n.startswith("gpu-6"))

            for w in watches:
                got = await w.wait(sick, "gpu-2 and every device of gpu-6 unhealthy", timeout=30)
                took = w.received_at[w.updates.index(got)] - at
                assert took < 10, f"{w.service}: {took:.1f} s after the XID"
                six = [n for n in _health(got) if n.startswith("gpu-6")]
                assert len(six) > 1 and "gpu-6-mig-7g-141gb-0" in six
                assert {n: v for n, v in _health(got).items() if not n.startswith(("gpu-2", "gpu-6"))} == {
                    n: "HEALTHY" for n in _health(got) if not n.startswith(("gpu-2", "gpu-6"))
                }
                assert "XID 79" in got[(NODE, "gpu-2")][1] and "XID 48" in got[(NODE, "gpu-6")][1]
                assert all(len(m.encode()) <= 1024 for _, m, _ in got.values())

            # the kubelet restarts: the stream it opens again starts with the sick cards
            await watches[0].close()
            watches[0] = kubelet.watch_health("1.37")
            again = await watches[0].wait(lambda u: True, "the first message after a reconnect", timeout=15)
            assert sick(again)
        finally:
            for w in watches:
                await w.close()
            await kubelet.close()
            await stop(node)
