"""Env that steers the loader, libc, the runtime's root hook, the MPS client or a shell is refused
at every hop it could cross (issue 40; the list and its sources: shared/schemas/common.py).

Each hop is tried with what an attacker would send: a NodeSpec with each denied key (refused at
decode, naming `$.devices[i].env[j]`), the same spec signed with a good key (refused at verify,
where the bridge and the converger decode it), the control plane's put check, a HoldContent built
by a writer in the converger's process, and the root helper asked to write either file of a hold
(refused, nothing written). A stored spec from before the rule is not taken on restart (the holds
stay: no pass runs without a spec).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.specs import check_spec
from services.converger.state import StateStore
from services.helper.ops import HelperOps
from shared import signing
from shared.holdfiles import HoldContent, HoldDevice, hold_to_wire
from shared.schemas import HELPER_REPLY_CODEC, NODE_SPEC_CODEC, BadMessage, HelperFileWrite, NodeSpec, encode
from shared.schemas.common import DENIED_ENV_KEYS, DENIED_ENV_LINE_PATTERN, DENIED_ENV_PREFIXES, env_key_problem
from shared.slices import FakeSlices
from shared.spectrust import SpecTrust

GPU0 = "GPU-5f1c2a90-0000-4000-8000-000000000001"

#: what the issue found accepted, and every name the NVIDIA container toolkit reads from a
#: container's env (internal/config/image/envvars.go, internal/modifier/cdi.go, swarm-resource),
#: the MPS client's, and glibc's UNSECURE_ENVVARS (sysdeps/generic/unsecvars.h)
ATTACKS = sorted(
    {
        "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "LD_DEBUG_OUTPUT", "LD_ORIGIN_PATH", "LD_PROFILE", "LD_BIND_NOW", "PATH",
        "NVIDIA_DISABLE_REQUIRE", "NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES", "NVIDIA_IMEX_CHANNELS", "NVIDIA_NVSWITCH",
        "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA", "NVIDIA_REQUIRE_JETPACK", "NVIDIA_GDS", "NVIDIA_MOFED", "NVIDIA_GDRCOPY",
        "NVIDIA_CTK_DEBUG", "NVIDIA_CONTAINER_RUNTIME_MODE", "CUDA_VERSION", "DOCKER_RESOURCE_GPU", "DOCKER_RESOURCE_GPUS",
        "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
        "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "MALLOC_CHECK_",
        "MALLOC_ARENA_MAX", "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TMPDIR", "TZDIR",
        "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "IFS",
        *DENIED_ENV_KEYS, *(prefix + "X" for prefix, _ in DENIED_ENV_PREFIXES),
    }
)  # fmt: skip
#: bcd's own keys: refused as before, with the same words
OWN = ["BCD_ALLOCATION_ID", "BCD_ANYTHING", "NVIDIA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY"]
#: a workload's own variables, near the denied names: still set
ALLOWED = ["JAVA_OPTS", "PYTHONPATH", "HF_HOME", "CUDA_VISIBLE_DEVICES", "MY_LD_PRELOAD", "XNVIDIA_X", "PATHS", "ld_preload", "path", "OMP_NUM_THREADS"]


def assignment(i: int, env: list[str]) -> dict:
    return {"allocation_id": f"a{i}", "reservation_id": f"r{i}", "binding": "BINDING_HOLD", "devices": [GPU0], "env": env}


def spec_doc(key: str) -> dict:
    """The attack in the third assignment's second line, behind valid ones."""
    return {"node_id": "node-1", "generation": 7, "devices": [assignment(0, []), assignment(1, ["A=1"]), assignment(2, ["OK=1", f"{key}=x"])]}


@pytest.mark.parametrize("key", ATTACKS)
def test_every_denied_key_is_refused_at_decode_with_its_path(key: str) -> None:
    problem = env_key_problem(key)
    assert problem.startswith(f"{key} ") and "is set by bcd" not in problem
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(json.dumps(spec_doc(key)))
    assert str(exc.value) == f"{problem} and cannot come from the spec - at `$.devices[2].env[1]`"


def test_the_issues_example_reads_as_promised() -> None:
    with pytest.raises(BadMessage) as exc:
        NODE_SPEC_CODEC.decode(json.dumps(spec_doc("LD_PRELOAD")))
    assert str(exc.value) == "LD_PRELOAD steers the dynamic loader and cannot come from the spec - at `$.devices[2].env[1]`"


@pytest.mark.parametrize("key", OWN)
def test_bcds_own_keys_are_still_refused_as_bcds(key: str) -> None:
    with pytest.raises(BadMessage, match=rf"^{key} is set by bcd and cannot come from the spec - at `\$\.devices\[2\]\.env\[1\]`$"):
        NODE_SPEC_CODEC.decode(json.dumps(spec_doc(key)))


def test_a_workloads_own_variables_are_still_taken() -> None:
    env = [f"{k}=1" for k in ALLOWED]
    assert NODE_SPEC_CODEC.decode(json.dumps({"node_id": "n", "generation": 1, "devices": [assignment(0, env)]})).devices[0].env == env


@pytest.mark.parametrize("key", [*ATTACKS, *OWN, *ALLOWED])
def test_the_json_schema_says_the_same_as_the_decoder(key: str) -> None:
    """docs/schema/NodeSpec.json refuses a line by DENIED_ENV_LINE_PATTERN (`not`): a control plane
    validating against it refuses exactly what the node does."""
    assert bool(re.search(DENIED_ENV_LINE_PATTERN, f"{key}=x")) == bool(env_key_problem(key))


@given(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,24}", fullmatch=True))
def test_the_schema_pattern_and_the_check_agree_on_any_key(key: str) -> None:
    assert bool(re.search(DENIED_ENV_LINE_PATTERN, f"{key}=v")) == bool(env_key_problem(key))


@pytest.mark.parametrize("key", ["LD_PRELOAD", "NVIDIA_DRIVER_CAPABILITIES", "PATH"])
def test_a_signed_spec_carrying_one_is_refused_at_verify(key: str) -> None:
    """A good signature does not carry it past the bridge or the converger (both decode here)."""
    private = signing.Ed25519PrivateKey.generate()
    signed = signing.sign_node_spec(private, json.dumps(spec_doc(key)).encode())
    with pytest.raises(signing.VerificationError, match=rf"spec: {key} .* and cannot come from the spec - at `\$\.devices\[2\]\.env\[1\]`"):
        signing.verify_node_spec(signed, [private.verify_key])


def test_the_control_plane_refuses_to_put_one() -> None:
    with pytest.raises(BadMessage, match=r"^NVIDIA_IMEX_CHANNELS is read by the NVIDIA container toolkit's root hook"):
        check_spec(spec_doc("NVIDIA_IMEX_CHANNELS"))


@pytest.mark.parametrize("key", ["LD_PRELOAD", "NVIDIA_NVSWITCH", "CUDA_MPS_LOG_DIRECTORY", "BASH_ENV"])
def test_no_writer_builds_a_hold_carrying_one(key: str) -> None:
    """HoldContent is what every writer (in-process or the root helper) writes from."""
    with pytest.raises(ValueError, match=rf"a1: env line '{key}=x' is not allowed: {key} "):
        HoldContent(allocation_id="a1", reservation_id="r1", generation=1, binding="BINDING_HOLD", devices=(HoldDevice.for_gpu(GPU0, 0),), env=("OK=1", f"{key}=x"))


@pytest.mark.parametrize("kind", ["cdi", "allocation-env"])
@pytest.mark.parametrize("key", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "NVIDIA_DISABLE_REQUIRE", "NVIDIA_MIG_CONFIG_DEVICES", "GCONV_PATH", "MALLOC_CHECK_"])
def test_the_root_helper_rechecks_and_writes_nothing(tmp_path: Path, key: str, kind: str) -> None:
    """What a compromised converger would send the helper: its typed hold with the line in it."""
    good = HoldContent(allocation_id="a1", reservation_id="r1", generation=1, binding="BINDING_HOLD", devices=(HoldDevice.for_gpu(GPU0, 0),), env=("OK=1",))
    wire = hold_to_wire(good)
    body = json.loads(encode(HelperFileWrite(kind=kind, hold=wire)))  # type: ignore[arg-type]
    body["hold"]["env"] = ["OK=1", f"{key}=x"]
    (tmp_path / "cdi").mkdir()
    (tmp_path / "run").mkdir()
    ops = HelperOps(tmp_path / "cdi", tmp_path / "run", FakeSlices(tmp_path / "run"), slices_backend="fake", mps_pipe_dir="/tmp/nvidia-mps")
    reply, alloc = ops.answer("file.write", json.dumps(body).encode())
    r = HELPER_REPLY_CODEC.decode(encode(reply))
    assert (r.ok, r.outcome, alloc) == (False, "refused", "a1") and f"{key}=x' is not allowed: {env_key_problem(key)}" in r.reason, r
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_a_spec_stored_before_the_rule_is_not_taken_on_restart(tmp_path: Path) -> None:
    """Upgrade: the converger's stored spec with a now-denied key does not decode, though its
    signature does verify; the converger waits for the next spec (no pass runs without one, so
    every hold on disk stays)."""
    key = signing.Ed25519PrivateKey.generate()
    trust = SpecTrust(keys=(key.verify_key,))
    store = StateStore(tmp_path)
    store.spec_path.write_bytes(encode(signing.sign_node_spec(key, json.dumps(spec_doc("LD_PRELOAD")).encode())))
    assert store.load_spec_with_unknown(trust, "node-1") == (None, [])
    store.save_spec(encode(signing.sign_node_spec(key, NodeSpec(node_id="node-1", generation=8))))
    assert store.load_spec(trust, "node-1") == NodeSpec(node_id="node-1", generation=8)
