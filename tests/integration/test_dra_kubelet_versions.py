"""DRA with the kubelet of every release a fleet mid-upgrade runs, 1.32 to 1.37, end to end: a whole
node (`bcd up` on a fake host), the API server stand-in, and the kubelet stand-in of each release
(dra_kubelet_standin.py: it picks the DRAPlugin version from the plugin's supported_versions as
that release's kubelet does).

The plugin advertises v1.DRAPlugin then v1beta1.DRAPlugin and serves both on its one socket: 1.32
and 1.33 pick v1beta1, 1.34 to 1.37 pick v1; every release registers, prepares a pod's claims (a
whole card and an MPS share of another card, in one call) and unprepares them, the card going back
to the pool each time. The share id of the shared device is in the answer where the version has
the field (v1) and nowhere else.
"""

from __future__ import annotations

import asyncio

import pytest

from services.dra_plugin.proto import DRA_PLUGIN_SERVICE, DRA_PLUGIN_SERVICE_V1BETA1

from .dra_kubelet_standin import KUBELET_SERVICES, V1ALPHA4_SERVICE, DraKubelet, RegistrationRefused, choose_service
from .kubeapi_standin import KubeApiStandIn
from .test_dra_plugin import DRIVER, NODE, claim, dra_status, host, start, stop, wait_devices
from .test_dra_sharing import opaque, share
from .test_dra_sharing import claim as shared_claim
from .wholenode import GPU, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

#: what each release's kubelet calls on a plugin that lists v1 then v1beta1
PICKED = {"1.32": DRA_PLUGIN_SERVICE_V1BETA1, "1.33": DRA_PLUGIN_SERVICE_V1BETA1, **{v: DRA_PLUGIN_SERVICE for v in ("1.34", "1.35", "1.36", "1.37")}}


@pytest.fixture
def api():
    with KubeApiStandIn() as server:
        server.add_node(NODE)
        yield server


def test_how_each_release_picks_from_what_a_plugin_lists() -> None:
    """The stand-in's choice is the kubelet's (pkg/kubelet/cm/dra/plugin, validateSupportedServices)."""
    assert set(KUBELET_SERVICES) == set(PICKED)
    both = [DRA_PLUGIN_SERVICE, DRA_PLUGIN_SERVICE_V1BETA1]
    assert {v: choose_service(v, both) for v in KUBELET_SERVICES} == {v: (s, "") for v, s in PICKED.items()}
    # 1.34+ go by the plugin's order: v1beta1 listed first would be v1beta1 (no share ids)
    assert choose_service("1.36", both[::-1]) == (DRA_PLUGIN_SERVICE_V1BETA1, "")
    # 1.32/1.33 go by their own order, and a plugin offering nothing they know gets v1alpha4
    assert choose_service("1.33", both[::-1]) == (DRA_PLUGIN_SERVICE_V1BETA1, "")
    assert choose_service("1.32", [DRA_PLUGIN_SERVICE]) == (V1ALPHA4_SERVICE, "")
    # 1.34+ refuse a plugin offering nothing they know
    service, why = choose_service("1.34", ["v1alpha3.NodeService"])
    assert service == "" and "none of services supported by the plugin" in why


@pytest.mark.parametrize("versions", [("1.32", "1.33"), ("1.34", "1.35", "1.36", "1.37")], ids=["v1beta1-kubelets", "v1-kubelets"])
async def test_every_kubelet_from_1_32_to_1_37_registers_prepares_and_unprepares(tmp_path, short_dir, api, versions):
    node = await start(tmp_path, short_dir, api, host(tmp_path))
    try:
        await wait_devices(api, lambda d: "gpu-0" in d and "gpu-1" in d, "the node's devices")
        mps = [opaque("GpuConfig", ["gpu"], sharing={"strategy": "MPS"})]
        for version in versions:
            picked = PICKED[version]
            kubelet = DraKubelet(short_dir, version=version)
            try:
                info = await kubelet.register(DRIVER)
                await asyncio.to_thread(wait_for, lambda: dra_status(node).get("registered"), 30, f"kubelet {version}: the plugin to hear it is registered")

                # one pod's claims in one call, as the kubelet batches them
                tag = version.replace(".", "-")
                whole = claim(api, f"whole-{tag}", "gpu-0")
                half_share = share(50)
                half = shared_claim(api, f"half-{tag}", "gpu-1", config=mps, shared=half_share)
                got = await kubelet.prepare(whole, half)
                assert got[whole[2]].error == "" and got[half[2]].error == "", (version, got)
                w, = got[whole[2]].devices
                h, = got[half[2]].devices
                assert (w.pool_name, w.device_name, list(w.cdi_device_ids)) == (NODE, "gpu-0", [f"bcd.dev/gpu={GPU[0]}"])
                assert (h.pool_name, h.device_name, list(h.cdi_device_ids)) == (NODE, "gpu-1", [f"bcd.dev/gpu={GPU[1]}_{half_share['shareID']}"])
                if picked == DRA_PLUGIN_SERVICE:
                    # v1: the share named for the shared device, no share for the whole card
                    assert (h.HasField("share_id"), h.share_id) == (True, half_share["shareID"])
                    assert not w.HasField("share_id")
                else:
                    assert "share_id" not in {f.name for f in h.DESCRIPTOR.fields}
                held = {c["uid"] for c in node.status()["converger"]["claims"]}
                assert {whole[2], half[2]} <= held, (version, held)
                # the kubelet retries: the same answer
                assert await kubelet.prepare(whole, half) == got
                # what the kubelet picked from: v1 first, so that 1.34+ take v1
                assert list(info.supported_versions)[:2] == [DRA_PLUGIN_SERVICE, DRA_PLUGIN_SERVICE_V1BETA1]
                assert kubelet.service == picked, version

                gone = await kubelet.unprepare(whole, half)
                assert gone[whole[2]].error == "" and gone[half[2]].error == "", (version, gone)
                held = {c["uid"] for c in node.status()["converger"]["claims"]}
                assert not {whole[2], half[2]} & held, (version, held)
            finally:
                await kubelet.close()
    finally:
        await stop(node)


async def test_a_1_34_kubelet_refuses_a_plugin_that_offers_nothing_it_speaks(tmp_path, short_dir):
    """What the stand-in's refusal looks like to the plugin: NotifyRegistrationStatus with the reason."""
    import grpc

    from services.dra_plugin.proto import pluginregistration_v1_pb2 as reg_pb
    from services.dra_plugin.proto import pluginregistration_v1_pb2_grpc as reg_grpc

    heard: list[reg_pb.RegistrationStatus] = []

    class Old(reg_grpc.RegistrationServicer):
        async def GetInfo(self, request, context):  # noqa: N802 - the proto's name
            return reg_pb.PluginInfo(type="DRAPlugin", name=DRIVER, endpoint=str(short_dir / "dra.sock"), supported_versions=[V1ALPHA4_SERVICE])

        async def NotifyRegistrationStatus(self, request, context):  # noqa: N802
            heard.append(request)
            return reg_pb.RegistrationStatusResponse()

    (short_dir / "plugins_registry").mkdir(parents=True, exist_ok=True)
    server = grpc.aio.server()
    reg_grpc.add_RegistrationServicer_to_server(Old(), server)
    server.add_insecure_port(f"unix://{short_dir / 'plugins_registry' / f'{DRIVER}-reg.sock'}")
    await server.start()
    try:
        with pytest.raises(RegistrationRefused, match="none of services supported by the plugin"):
            await DraKubelet(short_dir, version="1.34").register(DRIVER, timeout=10)
        assert [(h.plugin_registered, "none of services" in h.error) for h in heard] == [(False, True)]
    finally:
        await server.stop(None)
