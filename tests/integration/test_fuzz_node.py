"""Nothing from outside stops the node (issue 11), fuzzed against a whole running node.

`bcd up` (every service, the root helper included, and the reference control
plane) on the 8 x H200 fake host binds the demo spec. Then generated bodies
(hypothesis, seeded: arbitrary JSON, arbitrary bytes, objects with the
request type's field names, one-field mutations of a valid request) plus
fixed deep (up to 20,000 levels) and oversized (up to what the bus carries)
bodies go to every request endpoint of every service - found in the
services' `$SRV.INFO` replies, so a new endpoint is fuzzed too - each sent
as a NATS user that may call it. Garbage, deep and huge values, validly
signed or not, go into the upstream spec key `bcd_nodespecs/<node_id>`.

Every request must be answered within REPLY_WAIT_S with a reply that decodes
as the endpoint's reply type or a clear refusal (micro error 400, 403, 404
or 409; for the endpoints that answer refusals in their reply, a refusal
there) - never a 500, never a timeout. Every spec-bucket value must be
refused by the bridge (its `bcd_node_specs_total{outcome="rejected"}` goes
up) or be a no-op. Afterwards every process has the pid it had, the holds on
disk (cdi/ and run/ byte for byte) and the converger's holds are unchanged,
and a following valid spec is still taken.

Endpoints that change state on purpose (converger.spec, inventory.gpu,
vfio_switcher.switch, kube_reaper.evict, the helper's writes and removes)
get only bodies their request codec refuses in this process (the service
decodes with the same codec before its handler runs), plus a few well-formed
requests the handler refuses before it touches anything (an unsigned, forged
or tampered spec envelope, another node's spec, an older generation, a
non-canonical PCI address, an id that cannot be a file name). Findings are collected and reported together at the end.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from nats.aio.client import Client

from bcd.client import NodeInfo, node_info
from controlplane.keys import load_or_create_cp_key
from controlplane.upstream import connect_upstream
from shared.schemas import (
    ATTESTED_REPORT_CODEC,
    CLAIM_PREPARE_REPLY_CODEC,
    CLAIM_PREPARE_REQUEST_CODEC,
    CLAIM_UNPREPARE_REPLY_CODEC,
    CLAIM_UNPREPARE_REQUEST_CODEC,
    CLAIMS_CODEC,
    DRA_PLUGIN_STATUS_CODEC,
    MIG_INSTANCE_REPLY_CODEC,
    MIG_INSTANCE_REQUEST_CODEC,
    CONVERGER_STATUS_CODEC,
    DEVICES_QUERY_CODEC,
    EMPTY_CODEC,
    EVICT_REPLY_CODEC,
    GPU_REPLY_CODEC,
    GPU_REQUEST_CODEC,
    HELD_REPLY_CODEC,
    HELPER_FILE_REMOVE_CODEC,
    HELPER_FILE_WRITE_CODEC,
    HELPER_INFO_CODEC,
    HELPER_REPLY_CODEC,
    HELPER_SLICE_APPLY_CODEC,
    HELPER_SLICE_REMOVE_CODEC,
    HOLDER_QUERY_CODEC,
    HOLDER_REPLY_CODEC,
    INVENTORY_CODEC,
    NODE_SPEC_CODEC,
    ORPHAN_QUERY_CODEC,
    ORPHAN_REPLY_CODEC,
    SIGN_REQUEST_CODEC,
    SIGNED_NODE_SPEC_CODEC,
    SIGNER_KEY_CODEC,
    SPEC_ACK_CODEC,
    SWITCH_REPLY_CODEC,
    SWITCH_REQUEST_CODEC,
    Codec,
    NodeSpec,
    SignedNodeSpec,
    encode,
)
from shared.schemas.events import NODE_SPEC_PURPOSE
from shared.signing import sign as sign_with_purpose
from shared.signing import key_id, sign_node_spec, unsigned_node_spec, verify_node_spec
from shared.subjects import (
    CONTROLPLANE_USER,
    NODE_BUS_USERS,
    OPERATOR_USER,
    SERVICE_ERROR_CODE_HEADER,
    SERVICE_ERROR_HEADER,
    UPSTREAM_NODESPECS_BUCKET,
    NodeSubjects,
    inbox_prefix,
)
from tests.fuzzkit import (
    CODECS,
    SAMPLES,
    deep_array,
    deep_bodies,
    deep_object,
    describe,
    garbage,
    json_bytes,
    mutations,
    oversized_bodies,
)
from tests.fuzzkit import CP_KEY as OTHER_KEY

from .harness import REPO
from .wholenode import GPU, Node, assignment, bcd, wait_for
from tests.blocking import subject_matches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NODE_ID = "node-1"
S = NodeSubjects(NODE_ID)
ALL_SERVICES = ("signer", "inventory", "converger", "gateway_bridge", "kube_reaper", "vfio_switcher", "helper", "dra_plugin")
#: a reply (or a refusal) must come within this long.
REPLY_WAIT_S = 5.0
CLEAR_REFUSALS = frozenset({"400", "403", "404", "409"})
#: hypothesis bodies per endpoint (the deep and oversized ones come on top).
GENERATED_PER_ENDPOINT = 40
#: the node bus's max_payload is 1 MiB; leave room for the headers.
BUS_CAP = 1024 * 1024 - 4096
#: who asks, in order of preference (the first one the permission tables let publish there).
ASKERS = (OPERATOR_USER, "gateway_bridge", "converger", "inventory", "vfio_switcher", "kube_reaper", "signer", "helper", "dra_plugin")


# --------------------------------------------------------------------------- the endpoints


def _helper_refused(reply: Any) -> bool:
    return reply.outcome == "refused" and not reply.ok and not reply.changed


def _switch_refused(reply: Any) -> bool:
    return reply.outcome == "Refused"


def _gpu_refused(reply: Any) -> bool:
    return not reply.accepted


@dataclass(frozen=True)
class Endpoint:
    request: Codec[Any]
    reply: Codec[Any]
    #: changes the node when it takes a request: only bodies its codec refuses (and `refused_requests`) go there
    changes_state: bool = False
    #: the endpoint answers a refusal inside its reply (helper, vfio_switcher, inventory.gpu): how to tell one
    refusal_in_reply: Callable[[Any], bool] | None = None


def _spec(**changes: Any) -> NodeSpec:
    return msgspec.structs.replace(CURRENT.spec, **changes)


ENDPOINTS: dict[str, Endpoint] = {
    S.inventory_get: Endpoint(EMPTY_CODEC, INVENTORY_CODEC),
    S.inventory_rescan: Endpoint(EMPTY_CODEC, INVENTORY_CODEC),
    S.inventory_gpu: Endpoint(GPU_REQUEST_CODEC, GPU_REPLY_CODEC, True, _gpu_refused),
    S.signer_sign: Endpoint(SIGN_REQUEST_CODEC, ATTESTED_REPORT_CODEC),
    S.signer_key: Endpoint(EMPTY_CODEC, SIGNER_KEY_CODEC),
    # the control plane's SignedNodeSpec, as the bridge relays it (the converger verifies it itself)
    S.converger_spec: Endpoint(SIGNED_NODE_SPEC_CODEC, SPEC_ACK_CODEC, True),
    S.converger_status: Endpoint(EMPTY_CODEC, CONVERGER_STATUS_CODEC),
    S.converger_holder: Endpoint(HOLDER_QUERY_CODEC, HOLDER_REPLY_CODEC),
    S.converger_claims: Endpoint(EMPTY_CODEC, CLAIMS_CODEC),
    S.converger_pass: Endpoint(EMPTY_CODEC, SPEC_ACK_CODEC),
    S.vfio_switch: Endpoint(SWITCH_REQUEST_CODEC, SWITCH_REPLY_CODEC, True, _switch_refused),
    S.reaper_held: Endpoint(DEVICES_QUERY_CODEC, HELD_REPLY_CODEC),
    S.reaper_evict: Endpoint(DEVICES_QUERY_CODEC, EVICT_REPLY_CODEC, True),
    S.reaper_orphans: Endpoint(ORPHAN_QUERY_CODEC, ORPHAN_REPLY_CODEC),
    S.helper_file_write: Endpoint(HELPER_FILE_WRITE_CODEC, HELPER_REPLY_CODEC, True, _helper_refused),
    S.helper_file_remove: Endpoint(HELPER_FILE_REMOVE_CODEC, HELPER_REPLY_CODEC, True, _helper_refused),
    S.helper_slice_apply: Endpoint(HELPER_SLICE_APPLY_CODEC, HELPER_REPLY_CODEC, True, _helper_refused),
    S.helper_slice_remove: Endpoint(HELPER_SLICE_REMOVE_CODEC, HELPER_REPLY_CODEC, True, _helper_refused),
    S.helper_info: Endpoint(EMPTY_CODEC, HELPER_INFO_CODEC),
    # DRA: the kubelet plugin's claims (the converger answers a refusal inside the reply) and the MIG steps
    S.converger_claim_prepare: Endpoint(CLAIM_PREPARE_REQUEST_CODEC, CLAIM_PREPARE_REPLY_CODEC, True, lambda r: not r.ok),
    S.converger_claim_unprepare: Endpoint(CLAIM_UNPREPARE_REQUEST_CODEC, CLAIM_UNPREPARE_REPLY_CODEC, True, lambda r: not r.ok),
    S.inventory_mig_instance: Endpoint(MIG_INSTANCE_REQUEST_CODEC, MIG_INSTANCE_REPLY_CODEC, True, lambda r: r.outcome != "done"),
    S.dra_plugin_status: Endpoint(EMPTY_CODEC, DRA_PLUGIN_STATUS_CODEC),
}
CODEC_NAMES = {id(codec): name for name, codec in CODECS.items()}


def asker(subject: str) -> str | None:
    for user in ASKERS:
        if user in NODE_BUS_USERS and any(subject_matches(p, subject) for p in S.permissions(user).publish):
            return user
    return None


def refused_in_process(codec: Codec[Any], body: bytes) -> bool:
    """Does the request codec refuse `body`? (Anything it raises: the service answers before its handler.)"""
    try:
        codec.decode(body)
    except Exception:  # noqa: BLE001 - BadMessage, or a decoder bug: either way the handler is not reached
        return True
    return False


# --------------------------------------------------------------------------- the bodies


def generate(strategy: st.SearchStrategy[bytes], n: int, at: int) -> list[bytes]:
    """n bodies from a strategy, reproducibly (seeded, generate phase only)."""
    out: list[bytes] = []

    @seed(at)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(body: bytes) -> None:
        out.append(body)

    collect()
    return out


def fixed_bodies(codec: Codec[Any] | None, name: str | None) -> list[tuple[str, bytes]]:
    out = [("empty body", b""), ("null", b"null"), ("{}", b"{}"), ("[]", b"[]"), ("NUL byte", b"\x00"), ("not UTF-8", b"\xff\xfe{")]
    if name is not None:
        out += deep_bodies(name)
    else:
        out += [(f"array {d} deep", deep_array(d)) for d in (1000, 20_000)]
    if codec is not None:
        out += [(f"oversized: {what}", body) for what, body in oversized_bodies(codec, cap=BUS_CAP)]
    return out


def refused_requests(subject: str) -> list[tuple[str, bytes]]:
    """Well-formed requests a state-changing endpoint refuses before it touches anything."""
    pci = "0000:18:00.0"  # GPU 0, held by train-01
    hold = json.loads(encode(SAMPLES["HELPER_FILE_WRITE_CODEC"]))
    hold["hold"]["allocation_id"] = "../../etc/x"
    table: dict[str, list[tuple[str, bytes]]] = {
        S.converger_spec: converger_spec_refusals(),
        S.inventory_gpu: [
            ("exclude of a non-canonical address", encode({"action": "exclude", "pci": "0000:18:00.0 "})),
            ("exclude of a card that is not there", encode({"action": "exclude", "pci": "0000:ff:1f.7"})),
        ],
        S.vfio_switch: [
            ("switch of a non-canonical address", encode({"pci": "18:00.0", "target": "vfio-pci"})),
            ("switch to an unknown target", encode({"pci": pci, "target": "nouveau"})),
        ],
        S.helper_file_write: [("write for an id that is a path", json.dumps(hold).encode())],
        S.helper_file_remove: [("remove for an id that is a path", encode({"kind": "cdi", "allocation_id": "../bcd-train-01"}))],
        S.helper_slice_remove: [("slice remove for an id that is a path", encode({"allocation_id": "../../x"}))],
    }
    return table.get(subject, [])


def converger_spec_refusals() -> list[tuple[str, bytes]]:
    """Envelopes the converger refuses before it touches anything: not the control plane's (issue 40),
    and the control plane's own that break a rule (another node, backwards, the applied generation changed)."""
    newer = _spec(generation=CURRENT.spec.generation + 1, devices=[])
    forged = encode(sign_node_spec(OTHER_KEY, newer))
    signed_newer = SIGNED_NODE_SPEC_CODEC.decode(signed_by(CURRENT.cp_key, encode(newer)))
    tampered = encode(msgspec.structs.replace(signed_newer, spec=encode(_spec(generation=CURRENT.spec.generation + 2, devices=[]))))
    return [
        ("an unsigned spec of a newer generation", encode(unsigned_node_spec(newer))),
        ("a newer generation signed by another key", forged),
        ("a signed envelope whose spec was swapped for another", tampered),
        ("another node's spec, signed", signed_by(CURRENT.cp_key, encode(_spec(node_id="node-2")))),
        ("an older generation, signed", signed_by(CURRENT.cp_key, encode(_spec(generation=0)))),
        ("the applied generation with other content, signed", signed_by(CURRENT.cp_key, encode(_spec(devices=[])))),
    ]


def handler_requests(subject: str) -> list[tuple[str, bytes]]:
    """Well-formed requests to the read-only endpoints, so their handlers (not only their decoders) are reached."""
    table: dict[str, list[tuple[str, bytes]]] = {
        S.signer_sign: [
            ("a valid sign request", encode(SAMPLES["SIGN_REQUEST_CODEC"])),
            ("a purpose the signer does not sign", json.dumps({**json.loads(encode(SAMPLES["SIGN_REQUEST_CODEC"])), "purpose": "node-spec"}).encode()),
        ],
        S.converger_holder: [("a held card", encode({"gpu": "0000:18:00.0"})), ("a card that is not there", encode({"gpu": "GPU-nope"}))],
        S.reaper_held: [
            ("valid devices", encode(SAMPLES["DEVICES_QUERY_CODEC"])),
            ("an atom that is no atom", encode({"allocation_id": "train-01", "devices": ["GPU-x/gi/ci/slot9/.."]})),
        ],
        S.reaper_orphans: [("known devices", encode(SAMPLES["ORPHAN_QUERY_CODEC"]))],
    }
    return table.get(subject, [])


def corpus(subject: str, at: int) -> list[tuple[str, bytes]]:
    ep = ENDPOINTS.get(subject)
    if ep is None:
        # an endpoint this file does not know: only bodies no typed request decodes (not objects, not empty)
        bodies = [("generated", b) for b in generate(json_bytes(), GENERATED_PER_ENDPOINT, at)]
        bodies += fixed_bodies(None, None)
        return [(w, b) for w, b in bodies if b.strip() and not b.lstrip().startswith(b"{")]
    name = CODEC_NAMES[id(ep.request)]
    bodies = [("generated", b) for b in generate(garbage(name), GENERATED_PER_ENDPOINT, at)]
    bodies += fixed_bodies(ep.request, name)
    if ep.changes_state:
        bodies = [(w, b) for w, b in bodies if refused_in_process(ep.request, b)]
        bodies += refused_requests(subject)
    else:
        bodies += handler_requests(subject)
    return bodies


# --------------------------------------------------------------------------- the node, observed


@dataclass
class Current:
    """What the node was given before the fuzz (the spec bucket fuzz must not change it)."""

    spec: NodeSpec = field(default_factory=lambda: NodeSpec(node_id=NODE_ID, generation=0))
    #: the node's control plane's signing key (the spec endpoint's well-formed refusals are signed by it)
    cp_key: Any = None


CURRENT = Current()


def snapshot_holds(state: Path) -> dict[str, bytes]:
    """Every file under cdi/ and run/ (CDI specs, env files, slice records), byte for byte."""
    out: dict[str, bytes] = {}
    for top in ("cdi", "run"):
        for p in sorted((state / top).rglob("*")):
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(state))] = p.read_bytes()
    return out


def child_pids(parent: int) -> dict[int, str]:
    """The supervisor's children (services, nats-server, control plane): pid -> command line."""
    out: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                out[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
    return out


async def discover(nc: Client, wait: float = 1.0) -> dict[str, dict[str, Any]]:
    """`$SRV.INFO` of every service: name -> info (with its endpoints)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    found: dict[str, dict[str, Any]] = {}
    try:
        await nc.publish("$SRV.INFO", b"", reply=inbox)
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                break
            if msg.data:
                info = json.loads(msg.data)
                found[info["name"]] = info
    finally:
        await sub.unsubscribe()
    return found


def bridge_rejections(metrics_addr: str) -> int:
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=3).read().decode()
    for line in text.splitlines():
        if line.startswith('bcd_node_specs_total{outcome="rejected"}'):
            return int(float(line.split()[-1]))
    return 0


@dataclass
class Findings:
    items: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        self.items.append(text)

    def report(self) -> str:
        return f"{len(self.items)} finding(s):\n  " + "\n  ".join(self.items)


# --------------------------------------------------------------------------- the fuzz


async def ask(nc: Client, subject: str, ep: Endpoint | None, what: str, body: bytes, findings: Findings) -> str:
    """One request; a finding unless it is answered in time with a valid reply or a clear refusal."""
    label = f"{subject.removeprefix(S.prefix + '.')} with {what} ({describe(body, 60)})"
    try:
        msg = await nc.request(subject, body, timeout=REPLY_WAIT_S)
    except nats.errors.TimeoutError:
        findings.add(f"{label}: no reply within {REPLY_WAIT_S:g} s")
        return "timeout"
    except nats.errors.NoRespondersError:
        findings.add(f"{label}: no responders (the service is gone)")
        return "gone"
    headers = msg.headers or {}
    if SERVICE_ERROR_HEADER in headers or SERVICE_ERROR_CODE_HEADER in headers:
        code = headers.get(SERVICE_ERROR_CODE_HEADER, "?")
        if code not in CLEAR_REFUSALS:
            findings.add(f"{label}: answered {code} {headers.get(SERVICE_ERROR_HEADER, '')[:160]!r}")
        return code
    if ep is None:
        return "reply"
    try:
        reply = ep.reply.decode(msg.data)
    except Exception as exc:  # noqa: BLE001
        findings.add(f"{label}: the reply does not decode as {ep.reply.type_name}: {str(exc)[:160]}")
        return "bad reply"
    if ep.changes_state and (ep.refusal_in_reply is None or not ep.refusal_in_reply(reply)):
        findings.add(f"{label}: a state-changing endpoint TOOK it: {msg.data[:200]!r}")
        return "taken"
    return "reply"


async def fuzz_endpoints(clients: dict[str, Client], endpoints: list[tuple[str, str]], findings: Findings) -> dict[str, Counter[str]]:
    sent: dict[str, Counter[str]] = {}
    for i, (service, subject) in enumerate(endpoints):
        user = asker(subject)
        if user is None:
            findings.add(f"{subject}: no NATS user may request it (not fuzzed)")
            continue
        nc = clients[user]
        ep = ENDPOINTS.get(subject)
        troubles = 0
        for what, body in corpus(subject, at=1000 + i):
            outcome = await ask(nc, subject, ep, what, body, findings)
            sent.setdefault(subject, Counter())[outcome] += 1
            if outcome in ("timeout", "gone"):
                troubles += 1
                # a dead or hung service answers nothing more: give the supervisor a moment, then move on
                await asyncio.sleep(2)
                if troubles >= 3:
                    findings.add(f"{subject}: stopped fuzzing it after {troubles} requests went unanswered")
                    break
    # the discovery subjects every service answers ($SRV.PING|INFO|STATS), with bodies they should ignore
    cli = clients[OPERATOR_USER]
    odd = [("garbage", b"\xff\x00{"), ("array 20000 deep", deep_array(20_000)), ("object 20000 deep", deep_object(20_000))]
    for service in sorted({svc for svc, _ in endpoints}):
        for verb in ("PING", "INFO", "STATS"):
            subject = f"$SRV.{verb}.{service}"
            for what, body in odd:
                sent.setdefault(f"$SRV.{verb}", Counter())[await ask(cli, subject, None, what, body, findings)] += 1
    return sent


def signed_by(key: Any, payload: bytes) -> bytes:
    return encode(SignedNodeSpec(spec=payload, key_id=key_id(key), signature=sign_with_purpose(key, NODE_SPEC_PURPOSE, payload)))


def spec_bucket_values(cp_key: Any) -> list[tuple[str, bytes]]:
    """Values for bcd_nodespecs/<node>: garbage, deep, huge; unsigned, wrongly and validly signed."""
    doc = json.loads(encode(CURRENT.spec))
    deep_unknown = json.dumps({**doc, "x": "\x00m"}).encode().replace(b'"\\u0000m"', deep_object(20_000))
    values: list[tuple[str, bytes]] = [
        ("issue 11: x 20,000 deep before spec/key_id/signature", b'{"x":' + deep_object(20_000) + b',"spec":"","key_id":"","signature":""}'),
        ("an array 20,000 deep", deep_array(20_000)),
        ("an object 100,000 deep", deep_object(100_000)),
        ("not JSON", b"\xff\x00not json"),
        ("an empty value", b""),
        ("JSON null", b"null"),
        ("900 KiB of whitespace around {}", b"{" + b" " * (900 * 1024) + b"}"),
        ("an unsigned spec", encode(unsigned_node_spec(CURRENT.spec))),
        ("a spec signed by another key", encode(sign_node_spec(OTHER_KEY, CURRENT.spec))),
        ("a bad signature", encode(SignedNodeSpec(spec=encode(CURRENT.spec), key_id=key_id(cp_key), signature=b"\x00" * 64))),
        ("validly signed: the spec with an unknown field 20,000 deep", signed_by(cp_key, deep_unknown)),
        ("validly signed: an array 20,000 deep", signed_by(cp_key, deep_array(20_000))),
        ("validly signed: not JSON", signed_by(cp_key, b"\xff\xfe")),
        ("validly signed: 900 KiB string", signed_by(cp_key, b'"' + b"A" * (900 * 1024) + b'"')),
        ("validly signed: another node's spec", signed_by(cp_key, encode(_spec(node_id="node-2")))),
        ("validly signed: an older generation", signed_by(cp_key, encode(_spec(generation=0)))),
    ]
    values += [("generated envelope", b) for b in generate(garbage("SIGNED_NODE_SPEC_CODEC"), 6, 7)]
    inner = [b for b in generate(mutations("NODE_SPEC_CODEC"), 30, 8) if refused_in_process(NODE_SPEC_CODEC, b)][:6]
    values += [("validly signed: a generated broken spec", signed_by(cp_key, b)) for b in inner]
    # last again: the next `bcd apply` reads the key's last value for its generation, and must read past this
    values.append(("issue 11 value again, left last in the key", values[0][1]))
    return [(w, v) for w, v in values if len(v) <= BUS_CAP]


def bridge_outcome(value: bytes, cp_key: Any) -> str:
    """What the bridge must do with a bucket value: "rejected", or "no-op" (the applied spec again)."""
    try:
        spec = verify_node_spec(SIGNED_NODE_SPEC_CODEC.decode(value), [cp_key.verify_key])
    except Exception:  # noqa: BLE001
        return "rejected"
    if spec.node_id != NODE_ID or spec.generation < CURRENT.spec.generation:
        return "rejected"
    assert spec == CURRENT.spec, "the spec fuzz would change the node"
    return "no-op"


async def bridge_meta(nc: Client) -> dict[str, str] | None:
    """The bridge's `$SRV.PING` metadata (its pid and metrics address), None when it does not answer."""
    try:
        msg = await nc.request("$SRV.PING.gateway_bridge", b"", timeout=1)
        return dict(json.loads(msg.data)["metadata"])
    except (nats.errors.Error, asyncio.TimeoutError, ValueError, KeyError):
        return None


async def rejections(meta: dict[str, str] | None) -> int | None:
    if meta is None:
        return None
    try:
        return await asyncio.to_thread(bridge_rejections, meta["metrics"])
    except (OSError, KeyError, ValueError):
        return None


async def fuzz_spec_bucket(info: NodeInfo, cli: Client, findings: Findings) -> int:
    """Each value put on bcd_nodespecs/<node>; the bridge must refuse it (its rejection counter goes up) or do nothing."""
    cp_key, _ = load_or_create_cp_key(Path(info.controlplane_dir))
    up = await connect_upstream(info.upstream_url or info.nats_url, CONTROLPLANE_USER, Path(info.creds_dir) / f"{CONTROLPLANE_USER}.password", reconnect=False)
    n = unrefused = 0
    try:
        kv = await up.jetstream().key_value(UPSTREAM_NODESPECS_BUCKET)
        for what, value in spec_bucket_values(cp_key):
            label = f"spec bucket with {what} ({describe(value, 60)})"
            expect = bridge_outcome(value, cp_key)
            meta = await bridge_meta(cli)
            before = await rejections(meta)
            await kv.put(NODE_ID, value)
            n += 1
            if expect == "no-op":
                await asyncio.sleep(0.5)
                continue
            deadline = time.monotonic() + REPLY_WAIT_S
            outcome = "not refused"
            while time.monotonic() < deadline:
                now = await bridge_meta(cli)
                if meta is not None and now is not None and now.get("pid") != meta.get("pid"):
                    outcome = f"the bridge restarted (pid {meta.get('pid')} -> {now.get('pid')})"
                    break
                seen = await rejections(now)
                if before is not None and seen is not None and seen > before:
                    outcome = "refused"
                    break
                await asyncio.sleep(0.1)
            if outcome == "refused":
                unrefused = 0
                continue
            if meta is None:
                outcome = "the bridge did not answer $SRV.PING before the put"
            findings.add(f"{label}: {outcome} within {REPLY_WAIT_S:g} s")
            unrefused += 1
            if unrefused >= 3:
                findings.add("spec bucket: stopped after 3 values in a row were not refused")
                break
    finally:
        await up.close()
    return n


def pids_of_all(node: Node, tries: int = 5) -> dict[str, int]:
    """Every service's pid from `bcd ping`; asked again when one is missing (a busy service may answer late)."""
    pids: dict[str, int] = {}
    for _ in range(tries):
        pids = node.pids()
        if set(ALL_SERVICES) <= set(pids):
            break
        time.sleep(0.5)
    return pids


async def test_nothing_from_outside_stops_the_node(tmp_path: Path) -> None:
    started = time.monotonic()
    node = Node(tmp_path, "--services", ",".join(ALL_SERVICES))
    findings = Findings()
    clients: dict[str, Client] = {}
    try:
        node.start()
        wait_for(lambda: set(ALL_SERVICES) <= set(node.ping()), 30, "every service, the helper too, to answer $SRV.PING")
        demo = json.loads((REPO / "examples" / "specs" / "demo.json").read_text())
        gen = node.apply(demo)
        node.wait_generation(gen)
        CURRENT.spec = NODE_SPEC_CODEC.decode(json.dumps({**demo, "generation": gen}).encode())
        info = node_info(node.state)
        CURRENT.cp_key, _ = load_or_create_cp_key(Path(info.controlplane_dir))
        for user in ASKERS:
            clients[user] = await nats.connect(
                info.nats_url,
                user=user,
                password=(Path(info.creds_dir) / f"{user}.password").read_text().strip(),
                inbox_prefix=inbox_prefix(user).encode(),
                allow_reconnect=False,
                max_reconnect_attempts=0,
            )
        services = await discover(clients[OPERATOR_USER])
        assert set(ALL_SERVICES) <= set(services), f"$SRV.INFO answered by {sorted(services)}"
        endpoints = sorted({(name, e["subject"]) for name, s in services.items() for e in s.get("endpoints") or []})
        assert {subj for _, subj in endpoints} >= set(ENDPOINTS), "an endpoint of the table is not served"
        pids = pids_of_all(node)
        assert set(ALL_SERVICES) <= set(pids)
        assert node.proc is not None
        children = child_pids(node.proc.pid)
        holds = snapshot_holds(node.state)
        assert any(k.startswith("cdi/bcd-") for k in holds) and any(k.startswith("run/allocations/") for k in holds)
        status_before = CONVERGER_STATUS_CODEC.decode((await clients[OPERATOR_USER].request(S.converger_status, b"", timeout=5)).data)
        ready_at = time.monotonic()

        sent = await fuzz_endpoints(clients, endpoints, findings)
        fuzzed_at = time.monotonic()
        puts = await fuzz_spec_bucket(info, clients[OPERATOR_USER], findings)
        bucket_at = time.monotonic()

        # --- afterwards: the same processes, the same holds, the node still answers
        await asyncio.sleep(1.0)  # a process that is about to die of what it was sent does so now
        after = pids_of_all(node)
        for name in ALL_SERVICES:
            if after.get(name) != pids.get(name):
                findings.add(f"{name}: pid {pids.get(name)} before the fuzz, {after.get(name)} after (it restarted or stopped answering)")
        gone = {pid: cmd for pid, cmd in children.items() if pid not in child_pids(node.proc.pid)}
        for pid, cmd in gone.items():
            findings.add(f"process {pid} ({cmd[:80]}) is gone after the fuzz")
        now = snapshot_holds(node.state)
        for path in sorted(set(holds) | set(now)):
            if holds.get(path) != now.get(path):
                findings.add(f"hold file {path} changed: {'added' if path not in holds else 'removed' if path not in now else 'rewritten'}")
        try:
            status_after = CONVERGER_STATUS_CODEC.decode((await clients[OPERATOR_USER].request(S.converger_status, b"", timeout=5)).data)
        except Exception as exc:  # noqa: BLE001
            findings.add(f"converger.status after the fuzz: {type(exc).__name__}: {exc}")
        else:
            if (status_after.generation, status_after.holds) != (status_before.generation, status_before.holds):
                findings.add(f"the converger's generation/holds changed: {status_before.generation} -> {status_after.generation}, "
                             f"{[h.allocation_id for h in status_before.holds]} -> {[h.allocation_id for h in status_after.holds]}")  # fmt: skip

        # --- and a following valid spec is still taken
        spec = {"node_id": NODE_ID, "devices": [*demo["devices"], assignment("after-fuzz", GPU[3])]}
        path = tmp_path / "after-fuzz.json"
        path.write_text(json.dumps(spec))
        out = bcd("apply", str(path), "--state-dir", str(node.state))
        if out.returncode != 0:
            findings.add(f"bcd apply after the fuzz failed: {out.stderr.strip()[-300:]}")
        else:
            gen2 = int(out.stdout.split("generation")[1].split()[0])
            try:
                node.wait_generation(gen2, timeout=30)
            except AssertionError as exc:
                findings.add(f"the valid spec after the fuzz (generation {gen2}) was not taken: {str(exc)[:300]}")
            else:
                if "after-fuzz" not in node.holds():
                    findings.add(f"the valid spec after the fuzz converged without its new hold: {sorted(node.holds())}")
        final = pids_of_all(node)
        for name in ALL_SERVICES:
            if final.get(name) != after.get(name):
                findings.add(f"{name}: pid {after.get(name)} after the fuzz, {final.get(name)} after the next spec")
        for subject, outcomes in sorted(sent.items()):
            print(f"{subject.removeprefix(S.prefix + '.'):<24} {dict(sorted(outcomes.items()))}")
        timing = (f"node ready {ready_at - started:.1f} s, {sum(sum(c.values()) for c in sent.values())} requests to {len(sent)} endpoints in {fuzzed_at - ready_at:.1f} s, "
                  f"{puts} spec-bucket values in {bucket_at - fuzzed_at:.1f} s, total {time.monotonic() - started:.1f} s")  # fmt: skip
        print(timing)
        assert len(sent) >= len(ENDPOINTS), f"fuzzed {sorted(sent)}"
        assert not findings.items, findings.report() + "\n" + timing
    finally:
        for nc in clients.values():
            try:
                await nc.close()
            except Exception:  # noqa: BLE001
                pass
        node.stop()
