"""The DRA plugin's sockets against the kubelet directory: a host with no kubelet directory at
all has no kubelet to serve, so the plugin waits for one quietly (no error, no doctor warning);
once the directory appears it serves both sockets. (Under bcd-dra-plugin.service on a host
without a kubelet it used to try to create /var/lib/kubelet, fail on the read-only /var and
report "the kubelet refused its registration: Read-only file system".)"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from bcd.status import NodeReport, doctor_checks
from services.dra_plugin.checkpoint import CheckpointStore
from services.dra_plugin.plugin import Calls, DraPlugin


async def _never(*_args):  # noqa: ANN002, ANN202
    raise AssertionError("not asked in this test")


@pytest.fixture
def short_dir():
    d = Path(tempfile.mkdtemp(prefix="bcd-dra-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_no_kubelet_directory_is_waiting_not_an_error(short_dir: Path) -> None:
    kubelet = short_dir / "kubelet"
    calls = Calls(prepare=_never, unprepare=_never, inventory=_never, claims=_never, claim_holds=_never)
    plugin = DraPlugin(kubelet, "gpu.bcd.dev", "node-1", calls, None, CheckpointStore(short_dir / "state"), "boot-1")
    try:
        await plugin.start()
        st = plugin.status()
        assert (plugin.no_kubelet, st.registered, st.registration_error) == (True, False, "")
        assert not kubelet.exists(), "the plugin made the kubelet's directory"
        report = NodeReport(node_id="node-1", reachable=True, expected=["dra_plugin"], services={"dra_plugin": {}}, dra_plugin=st)
        assert not [c for c in doctor_checks(report) if c[1] == "dra-plugin"]
        # the kubelet comes: both sockets are served at the next tick
        kubelet.mkdir()
        await plugin._serve_sockets()
        assert plugin.serve_error == "" and not plugin.no_kubelet
        assert plugin.reg_path.is_socket() and plugin.dra_path.is_socket()
    finally:
        await plugin.close()
