"""What each process of a demo node imports: nothing heavy it does not use (issue 13, memory).

Each case runs in a fresh interpreter: it imports a service module (or the
CLI, or the control plane), builds its app and parses its options as the demo
node (`make run`: fake host, no kubelet, no kubeconfig) gives them, without
starting anything on the network, then reports `sys.modules`. A library loaded
for nothing costs every process its resident memory (aiohttp ~10 MiB, grpc
and protobuf ~10 MiB, cryptography ~7.5 MiB where PyNaCl takes ~1, NVML's bindings ~3.5 MiB); see
bench/memory.py for the figures of a whole node.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_HOST = REPO / "examples" / "hosts" / "h200x8.json"

#: never wanted at start in any process of a demo node: nats' websocket transport
#: (aiohttp), the kubelet and Kubernetes clients, NVML on a fake host, test-only libraries.
#: `cryptography` is the tests' independent Ed25519 checker only: bcd signs with PyNaCl.
NEVER = ("aiohttp", "grpc", "google.protobuf", "kubernetes_asyncio", "pynvml", "hypothesis", "jsonschema", "yaml", "cryptography")
#: the processes that neither sign nor verify anything load no Ed25519 at all.
NO_CRYPTO = ("nacl",)

#: in the subprocess: build the service's app and parse its options, as `bcd up` runs it.
SERVICE_CODE = """
import importlib, json, sys
from shared.runtime import ServiceApp, common_options, parse_options
mod = importlib.import_module(sys.argv[1])
apps = [v for v in vars(mod).values() if isinstance(v, type) and issubclass(v, ServiceApp) and v.__module__ == mod.__name__]
assert len(apps) == 1, apps
app = apps[0]()
env = json.loads(sys.argv[2])
opts = parse_options(app.name, [*common_options(app.name), *app.options()], [], env)
extra = sys.argv[3] if len(sys.argv) > 3 else ""
if extra:
    exec(extra, {"app": app, "opts": opts, "env": env})
print(json.dumps(sorted(sys.modules)))
"""

# kube_reaper without a kubelet: a List on the missing socket answers "unreachable" without gRPC
REAPER_LIST = """
import asyncio
from services.kube_reaper.podresources import KubeletPodResources
from services.kube_reaper.ports import SourceUnreachable
async def ask():
    try:
        await KubeletPodResources(opts.pod_resources_socket).list_devices()
    except SourceUnreachable:
        return
    raise AssertionError("a missing socket must be unreachable")
asyncio.run(ask())
"""

# inventory on a fake host: the fakehw adapter, built as setup builds it
INVENTORY_ADAPTER = """
from services.inventory.adapters import load_adapter
load_adapter("fakehw", fake_host=env["BCD_FAKE_HOST"], cdi_dir=env["BCD_CDI_DIR"])
"""


def demo_env(tmp: Path) -> dict[str, str]:
    """The env `bcd up` gives its services on the example fake host (bcd/up.py), less the bus."""
    return {
        "BCD_NODE_ID": "node-1",
        "BCD_DATA_DIR": str(tmp / "data"),
        "BCD_RUN_DIR": str(tmp / "run"),
        "BCD_CDI_DIR": str(tmp / "cdi"),
        "BCD_ADAPTER": "fakehw",
        "BCD_FAKE_HOST": str(FAKE_HOST),
        "BCD_PROCESSES": "fake",
        "BCD_EVICTOR": "none",
        "BCD_BACKEND": "fake",
        "BCD_UPSTREAM_URL": "nats://127.0.0.1:4222",
        "BCD_CP_KEY": str(tmp / "controlplane" / "cp.pub"),
        "BCD_METRICS_PORT": "0",
    }


def loaded(argv: list[str]) -> set[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}
    out = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def heavy(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(m == n or m.startswith(n + ".") for m in modules))


SERVICES = {
    # service module: (what it must not load, extra code run after parsing)
    "services.signer.service": (NEVER, ""),
    "services.inventory.service": (NEVER + NO_CRYPTO, INVENTORY_ADAPTER),
    # the converger verifies the control plane's signature on every spec itself (issue 40): PyNaCl
    "services.converger.service": (NEVER, ""),
    "services.gateway_bridge.service": (NEVER, ""),
    "services.kube_reaper.service": (NEVER + NO_CRYPTO, REAPER_LIST),
    "services.vfio_switcher.service": (NEVER + NO_CRYPTO, ""),
    "services.helper.service": (NEVER + NO_CRYPTO, ""),
}


@pytest.mark.parametrize("module", sorted(SERVICES), ids=lambda m: m.split(".")[1])
def test_a_service_loads_nothing_it_does_not_use(module: str, tmp_path: Path) -> None:
    forbidden, extra = SERVICES[module]
    modules = loaded(["-c", SERVICE_CODE, module, json.dumps(demo_env(tmp_path)), extra])
    assert module in modules
    assert not heavy(modules, forbidden), f"{module} loads {heavy(modules, forbidden)}"


def test_the_supervisor_loads_no_service_library(tmp_path: Path) -> None:
    """`bcd up --apply` as `make run` parses it: no metrics library (the supervisor serves none), no service code."""
    code = (
        "import json, sys\nimport bcd.cli\n"
        "bcd.cli.build_parser().parse_args(['up', '--any-ports-if-taken', '--log-format', 'text', '--apply', 'examples/specs/demo.json',"
        f" '--state-dir', {str(tmp_path / 'state')!r}])\n"
        "import bcd.up, bcd.status, bcd.events\n"  # what cmd_up and the demo import on their way
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    modules = loaded(["-c", code])
    bad = heavy(modules, NEVER + ("prometheus_client",))
    assert not bad, f"bcd up loads {bad}"
    services = sorted(m for m in modules if m.split(".")[0] == "services")
    assert not services, f"bcd up loads service code {services}"


def test_the_control_plane_loads_no_service_library() -> None:
    code = "import json, sys\nimport controlplane.cli as cp\ncp._parser().parse_args(['serve'])\nprint(json.dumps(sorted(sys.modules)))\n"
    modules = loaded(["-c", code])
    bad = heavy(modules, NEVER + ("prometheus_client",))
    assert not bad, f"controlplane loads {bad}"


def test_nats_websocket_transport_still_works_after_aiohttp_was_deferred() -> None:
    """shared/lazynats.py: nats is imported without aiohttp; a ws:// transport imports it when built."""
    code = """
import asyncio, sys
import shared  # installs the deferral, as every bcd process does
import nats
import nats.aio.transport as transport
assert "aiohttp" not in sys.modules and transport.aiohttp is None
async def build():
    ws = transport.WebSocketTransport()
    assert transport.aiohttp is sys.modules["aiohttp"] and transport.multidict is not None
    await ws._client.close()
asyncio.run(build())
import aiohttp  # importable as ever
print("ok")
"""
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
