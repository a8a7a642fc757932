"""The reference control plane: signs and pushes NodeSpecs, verifies and applies node events.

It speaks the upstream contract of DESIGN section 3 exactly, and nothing
more: it owns the KV buckets `bcd_nodespecs`, `bcd_nodes`, `bcd_inventory`
and the stream `BCD_EVENTS`; it puts each node's spec as a `SignedNodeSpec`
signed with its own Ed25519 key; and it reads `bcd.events.<node>.<type>`
through a durable pull consumer, checks every AttestedReport against the key
the node announced in its Hello (signature, node, boot id, `Nats-Msg-Id`),
rejects what does not check out, and runs a small reservation state machine:

    binding  -> active    on a verified Bound
    *        -> failed    on AllocationFailed (reason and message kept)
    *        -> released  on a verified Released
    active   -> releasing when a newer spec no longer names the reservation
    binding  -> withdrawn when a newer spec no longer names it before it bound

Everything it decides survives a restart: processed event ids, reservations,
the boot ids each node announced and the last generation per node live in
`<state_dir>/state.json` (atomic writes under a file lock, so `bcd apply` in
another process and the running consumer never lose each other's updates).
Events are taken a batch at a time (whatever the consumer has, up to
EVENT_BATCH; never waited for to fill), judged and applied in stream order,
saved with one state.json write, logged, and only then acked; nothing after a
batch is delivered before it is acked. A control plane killed with a batch
unacked resets the consumer to its ack floor at the next start, so those events
come back at once, first and in order; what was saved already is a duplicate by
its event id.
Each event is also printed as one readable line on stdout and appended, with
all fields, to `<state_dir>/events.jsonl`. A `gpu` event (GpuChanged) moves
nothing in state.json, so it costs no state write: its events.jsonl line is
what remembers it (read back at start), and a redelivery after that line is a
duplicate, before it is applied (the line written), as for every event.

`bcd up` runs it embedded; `bcd-controlplane serve|put` (the console script;
`python -m bcd.controlplane` is the same) runs it alone, as a fleet does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import itertools
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal, TextIO

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue

from shared import logs
from shared.keyfile import KeyFileError as SharedKeyFileError
from shared.keyfile import load_or_create_key
from shared.fsutil import atomic_write, read_regular
from shared.schemas import (
    ATTESTED_REPORT_CODEC,
    HELLO_CODEC,
    INVENTORY_CODEC,
    NODE_EVENT_CODEC,
    NODE_SPEC_CODEC,
    REPORT_BODY_CODEC,
    SIGNED_NODE_SPEC_CODEC,
    AllocationBound,
    AllocationFailed,
    AllocationReleased,
    BadMessage,
    Condition,
    GpuChanged,
    Hello,
    HoldCondition,
    Inventory,
    NodeCondition,
    NodeSpec,
    ReportBody,
    SectionStatus,
    encode,
)
from shared.schemas.codec import DEFAULT_MAX_BYTES, BoundedDecoder, bounded_json_loads
from shared.schemas.common import INT64_MAX
from shared.schemas.events import EVENT_TYPES
from shared.schemas.strict import UnknownField, UnknownFieldsError, unknown_fields
from shared.ed25519der import public_key_pem as spki_pem
from shared.signing import Ed25519PrivateKey, VerificationError, key_id, raw_public_key, sign_node_spec, verify_report
from shared.tlsconfig import TlsConfigError, TlsFiles, UpstreamTls, client_context, connect_options, explain, new_client, upstream_tls
from shared.subjects import (
    CONTROLPLANE_USER,
    MSG_ID_HEADER,
    UPSTREAM_EVENTS_STREAM,
    UPSTREAM_INVENTORY_BUCKET,
    UPSTREAM_NODES_BUCKET,
    UPSTREAM_NODESPECS_BUCKET,
    inbox_prefix,
    server_list,
    upstream_events_filter,
    upstream_spec_key_subject,
)

log = logs.get_logger("bcd.controlplane")

CONSUMER_NAME = "controlplane"
#: the stream's dedupe window: a node replaying its outbox within it is dropped by JetStream itself.
DUPLICATE_WINDOW = timedelta(hours=24)
#: spec history kept per node (nodes read only the last; the rest is for operators).
NODESPECS_HISTORY = 5
BUCKET_HISTORY: dict[str, int] = {
    UPSTREAM_NODESPECS_BUCKET: NODESPECS_HISTORY,
    UPSTREAM_NODES_BUCKET: 1,
    UPSTREAM_INVENTORY_BUCKET: 1,
}
#: how many processed event ids state.json remembers (oldest forgotten first).
MAX_PROCESSED_IDS = 20_000
#: the most events taken in one fetch, and the consumer's max_ack_pending: a batch (whatever
#: is there now, never waited for) is applied in memory, saved with one state.json write and
#: only then acked, before the next fetch (a generation of 64 releases + 64 binds is one batch).
EVENT_BATCH = 128
#: the consumer's ack_wait (s): the stall if acks are lost on a connection that stays up.
ACK_WAIT_S = 10.0

STATE_FILE = "state.json"
#: the largest state file read back (nodes, bookings, up to MAX_PROCESSED_IDS event ids).
STATE_MAX_BYTES = 256 * 1024 * 1024
EVENTS_FILE = "events.jsonl"
LOCK_FILE = "state.lock"
KEY_FILE = "cp.key"
PUB_FILE = "cp.pub"

ReservationState = Literal["binding", "active", "failed", "releasing", "released", "withdrawn"]
Outcome = Literal["applied", "duplicate", "rejected"]
ATTESTED_TYPES = frozenset({"bound", "released"})
KV_OPERATION_HEADER = "KV-Operation"


# ----------------------------------------------------------------------------- state


class Reservation(msgspec.Struct, frozen=True, kw_only=True):
    """What the control plane knows of one reservation."""

    reservation_id: str
    node_id: str
    allocation_id: str
    state: ReservationState
    #: the spec generation that last named it, or the event's generation after an event.
    generation: int
    reason: str = ""
    message: str = ""
    #: atom ids a Bound/Released reported.
    devices: list[str] = []
    #: the event that last moved it ("" after a spec put).
    event_id: str = ""
    updated_at: datetime
    #: the node's word on its hold's cards (HoldCondition: DevicesHealthy=False when a card under
    #: it turned unhealthy); None when the node never said anything
    condition: Condition | None = None


class NodeRecord(msgspec.Struct, kw_only=True):
    """Per-node memory: generations, announced boot ids, the last key, conditions, sections."""

    last_generation: int = 0
    #: every boot id the node announced in a Hello, oldest first.
    boot_ids: list[str] = []
    key_id: str = ""
    conditions: dict[str, Condition] = {}
    sections: dict[str, SectionStatus] = {}


class ControlPlaneState(msgspec.Struct, kw_only=True):
    """`<state_dir>/state.json`."""

    version: int = 1
    #: event id -> when it was applied (insertion order: oldest first).
    processed: dict[str, datetime] = {}
    reservations: dict[str, Reservation] = {}
    nodes: dict[str, NodeRecord] = {}
    rejected_count: int = 0
    duplicate_count: int = 0

    def node(self, node_id: str) -> NodeRecord:
        rec = self.nodes.get(node_id)
        if rec is None:
            rec = self.nodes[node_id] = NodeRecord()
        return rec


class EventRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One processed event: a line on stdout and a JSON line in events.jsonl."""

    received_at: datetime
    #: the event's own time (report body, condition since), when it has one.
    time: datetime | None = None
    node_id: str
    type: str
    event_id: str = ""
    outcome: Outcome
    #: True: signature checked against the node's Hello key; False: a signed event
    #: that did not verify; None: a plain event (the contract does not sign it).
    verified: bool | None = None
    #: why it was rejected ("" otherwise).
    reason: str = ""
    allocation_id: str = ""
    reservation_id: str = ""
    generation: int | None = None
    #: the reservation's state after this event ("" when none moved).
    state: str = ""
    boot_id: str = ""
    key_id: str = ""
    subject: str = ""
    stream_seq: int = 0
    detail: str = ""
    #: the decoded event (for a rejected report: what its body claimed, unverified).
    event: dict[str, Any] | None = None


_STATE_DECODER = BoundedDecoder(ControlPlaneState, max_bytes=256 * 1024 * 1024, what="control-plane state")
_RECORD_DECODER = BoundedDecoder(EventRecord, max_bytes=4 * 1024 * 1024, what="event record")


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def next_generation(state: ControlPlaneState, node_id: str, requested: int | None, published: int = 0) -> tuple[int, str]:
    """The generation to put: `requested` when above everything put so far, else last + 1.

    `published` is the generation found in the bucket now (it may be ahead of
    state.json when the state dir was lost or another control plane put).
    Returns (generation, note); the note says why a requested one was bumped.
    """
    last = max(state.node(node_id).last_generation, published)
    if requested is not None and requested > last:
        return requested, ""
    if last + 1 > INT64_MAX:
        # a spec's generation is an int64 (docs/upstream.md): there is no next one to put
        raise BadMessage(
            f"node {node_id}'s last put generation is {last}: the next, {last + 1}, is above the largest a spec may "
            f"carry ({INT64_MAX}); a node that took a spec at {last} needs its control plane's record and its "
            "state reset (docs/upstream.md, generations)"
        )
    if requested is None:
        return last + 1, ""
    return last + 1, f"generation {requested} is not above the last put generation {last}; put as {last + 1}"


def apply_spec(state: ControlPlaneState, spec: NodeSpec, at: datetime) -> None:
    """A spec was put: its reservations are binding unless already active for the same allocation."""
    rec = state.node(spec.node_id)
    rec.last_generation = max(rec.last_generation, spec.generation)
    named: set[str] = set()
    for a in spec.devices:
        named.add(a.reservation_id)
        cur = state.reservations.get(a.reservation_id)
        if cur is not None and cur.state == "active" and cur.allocation_id == a.allocation_id and cur.node_id == spec.node_id:
            state.reservations[a.reservation_id] = msgspec.structs.replace(cur, generation=spec.generation, updated_at=at)
            continue
        state.reservations[a.reservation_id] = Reservation(
            reservation_id=a.reservation_id,
            node_id=spec.node_id,
            allocation_id=a.allocation_id,
            state="binding",
            generation=spec.generation,
            devices=list(a.devices),
            updated_at=at,
        )
    for rid, cur in list(state.reservations.items()):
        if cur.node_id != spec.node_id or rid in named:
            continue
        if cur.state == "active":
            state.reservations[rid] = msgspec.structs.replace(cur, state="releasing", generation=spec.generation, updated_at=at)
        elif cur.state == "binding":
            state.reservations[rid] = msgspec.structs.replace(cur, state="withdrawn", generation=spec.generation, updated_at=at)


def apply_event(state: ControlPlaneState, node_id: str, event: object, event_id: str, at: datetime) -> Reservation | None:
    """Apply one accepted (verified or plain) event; return the reservation it moved, if any.

    The caller has already checked signatures and duplicates: this is only
    the state machine.
    """
    if isinstance(event, (AllocationBound, AllocationReleased, AllocationFailed)):
        cur = state.reservations.get(event.reservation_id)
        new_state: ReservationState
        reason = message = ""
        if isinstance(event, AllocationBound):
            new_state = "active"
        elif isinstance(event, AllocationReleased):
            new_state = "released"
        else:
            new_state, reason, message = "failed", event.reason, event.message
        devices = list(getattr(event, "devices", [])) or (list(cur.devices) if cur is not None else [])
        rsv = Reservation(
            reservation_id=event.reservation_id,
            node_id=node_id,
            allocation_id=event.allocation_id,
            state=new_state,
            generation=event.generation,
            reason=reason,
            message=message,
            devices=devices,
            event_id=event_id,
            updated_at=at,
        )
        state.reservations[event.reservation_id] = rsv
        return rsv
    if isinstance(event, HoldCondition):
        cur = state.reservations.get(event.reservation_id)
        if cur is not None and cur.node_id == node_id and cur.allocation_id == event.allocation_id:
            moved = msgspec.structs.replace(cur, condition=event.condition, event_id=event_id, updated_at=at)
            state.reservations[event.reservation_id] = moved
            return moved
        return None
    if isinstance(event, NodeCondition):
        state.node(node_id).conditions[event.condition.type] = event.condition
    elif isinstance(event, SectionStatus):
        state.node(node_id).sections[event.section] = event
    return None


def remember_processed(state: ControlPlaneState, event_id: str, at: datetime, limit: int = MAX_PROCESSED_IDS) -> None:
    state.processed[event_id] = at
    excess = len(state.processed) - limit
    if excess > 0:
        # only the oldest `excess` keys (one, once full), not a copy of all of them per event
        for old in list(itertools.islice(state.processed, excess)):
            del state.processed[old]


def remember_boot(state: ControlPlaneState, hello: Hello) -> bool:
    """Record the Hello's boot id and key; True when the boot id is new."""
    rec = state.node(hello.node_id)
    if rec.key_id and rec.key_id != hello.key_id:
        log.warning("node key changed", node_id=hello.node_id, old_key_id=rec.key_id, new_key_id=hello.key_id)
    rec.key_id = hello.key_id
    if hello.boot_id in rec.boot_ids:
        return False
    rec.boot_ids.append(hello.boot_id)
    return True


class StateStore:
    """state.json under an exclusive flock, reloaded when another process changed it."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.dir / STATE_FILE
        self.lock_path = self.dir / LOCK_FILE
        self.state = ControlPlaneState()
        self._stamp: tuple[int, int, int] | None = None
        with self._locked():
            self._reload(force=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _reload(self, *, force: bool = False) -> None:
        stamp = self._file_stamp()
        if not force and stamp == self._stamp:
            return
        if stamp is None:
            self.state = ControlPlaneState()
        else:
            try:
                self.state = _STATE_DECODER.decode(read_regular(self.path, max_bytes=STATE_MAX_BYTES))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise StateError(f"{self.path}: does not decode ({exc}); move it away to start afresh") from None
            except OSError as exc:
                raise StateError(f"{self.path}: cannot read ({exc}); move it away to start afresh") from None
        self._stamp = stamp

    def refresh(self) -> ControlPlaneState:
        """The current state, reloaded if another process wrote it."""
        if self._file_stamp() != self._stamp:
            with self._locked():
                self._reload()
        return self.state

    @contextlib.contextmanager
    def transaction(self) -> Iterator[ControlPlaneState]:
        """Lock, reload if changed, let the caller mutate, write atomically.

        Synchronous on purpose: no await can run inside, so two coroutines of
        one process never interleave a transaction (and never deadlock on the flock).
        """
        with self._locked():
            self._reload()
            try:
                yield self.state
            except BaseException:
                self._reload(force=True)  # drop the half-applied change
                raise
            try:
                atomic_write(self.path, encode(self.state), 0o600)
            except BaseException:
                # not saved (a full disk): nor kept in memory, where a retry would take it for saved
                self._reload(force=True)
                raise
            self._stamp = self._file_stamp()


class StateError(Exception):
    """state.json is unusable; the text says what to do."""

    #: a situation an operator can be in (bcd.exits prints it as one line, not an internal error)
    operator_error = True


# ----------------------------------------------------------------------------- keys


class KeyFileError(Exception):
    """The control-plane key file is unsafe or unreadable; the text says what to do."""

    #: a situation an operator can be in (bcd.exits prints it as one line, not an internal error)
    operator_error = True


def public_key_pem(key: Ed25519PrivateKey) -> bytes:
    return spki_pem(raw_public_key(key))


def load_or_create_cp_key(state_dir: Path) -> tuple[Ed25519PrivateKey, Path]:
    """`<state_dir>/cp.key` (PKCS#8 PEM, 0600, created once) and `<state_dir>/cp.pub`.

    cp.pub is the PEM SubjectPublicKeyInfo nodes get as `--cp-key`; it is
    rewritten whenever it does not match the private key. A key file that
    group or others can read is refused: it may already have leaked.
    (Same rules as the node key, services/signer/keys.py.)
    """
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = _load_or_create_private(state_dir / KEY_FILE)
    pub_path = state_dir / PUB_FILE
    pem = public_key_pem(key)
    try:
        current = pub_path.read_bytes()
    except FileNotFoundError:
        current = b""
    if current != pem:
        atomic_write(pub_path, pem, 0o644)
    return key, pub_path


def _load_or_create_private(path: Path) -> Ed25519PrivateKey:
    try:
        key, _ = load_or_create_key(path, owner="this control plane")
    except SharedKeyFileError as exc:
        raise KeyFileError(str(exc)) from None
    return key


# ----------------------------------------------------------------------------- the event log


_GPU_UUID_RE = re.compile(r"GPU-([0-9A-Za-z]{4})[0-9A-Za-z-]{4,}([0-9A-Za-z]{4})")


def short_atom(atom: str) -> str:
    """`GPU-5f1c2a90-...-000000000001/gi1/ci0` -> `GPU-5f1c…0001/gi1/ci0`."""
    return _GPU_UUID_RE.sub(lambda m: f"GPU-{m.group(1)}…{m.group(2)}", atom, count=1)


def _devices_text(devices: list[str], limit: int = 3) -> str:
    shown = ",".join(short_atom(d) for d in devices[:limit])
    return shown + (f" +{len(devices) - limit}" if len(devices) > limit else "")


def describe(event: object) -> tuple[str, str, str, int | None, str]:
    """(allocation_id, reservation_id, what, generation, detail) of an event, for the log."""
    if isinstance(event, (AllocationBound, AllocationReleased)):
        return event.allocation_id, event.reservation_id, "", event.generation, _devices_text(list(event.devices))
    if isinstance(event, AllocationFailed):
        detail = event.reason + (f": {event.message}" if event.message else "")
        return event.allocation_id, event.reservation_id, "", event.generation, detail
    if isinstance(event, SectionStatus):
        detail = event.state + (f": {event.message}" if event.message else "")
        return "", "", event.section, event.observed_generation, detail
    if isinstance(event, NodeCondition):
        c = event.condition
        detail = f"{c.type}={c.status}" + (f" {c.reason}" if c.reason else "") + (f": {c.message}" if c.message else "")
        return "", "", c.type, None, detail
    if isinstance(event, HoldCondition):
        c = event.condition
        detail = f"{c.type}={c.status}" + (f" {c.reason}" if c.reason else "") + (f": {c.message}" if c.message else "")
        return event.allocation_id, event.reservation_id, "", event.generation, detail
    if isinstance(event, GpuChanged):
        detail = f"{event.phase}/{event.management_state}" + (f" {short_atom('GPU-' + event.uuid.removeprefix('GPU-'))}" if event.uuid else "")
        if event.reason:
            detail += f" {event.reason}" + (f": {event.message}" if event.message else "")
        reconf = next((c for c in event.status.conditions if c.type == "Reconfiguring" and c.status == "True"), None)
        if reconf is not None:
            detail += f" Reconfiguring={reconf.reason}"
        return "", "", event.pci_address, None, detail
    return "", "", "", None, ""


def format_line(rec: EventRecord) -> str:
    """One readable line: `08:21:03 node-1  bound     whole (rsv-whole) gen 1  GPU-5f1c…0001  verified`."""
    when = (rec.time or rec.received_at).astimezone().strftime("%H:%M:%S")
    subject_of = ""
    if rec.allocation_id:
        subject_of = f"{rec.allocation_id} ({rec.reservation_id})"
    elif rec.event and isinstance(rec.event, dict):
        subject_of = str(rec.event.get("section") or rec.event.get("pci_address") or "")
    parts = [f"{when} {rec.node_id:<7} {rec.type:<9}"]
    what = subject_of
    if rec.generation is not None:
        what = f"{what} gen {rec.generation}".strip()
    if what:
        parts.append(" " + what)
    if rec.detail:
        # one line per event: a section's message lists one failure a line (issue 28.8)
        parts.append("  " + "; ".join(line for line in rec.detail.splitlines() if line.strip()))
    if rec.outcome == "rejected":
        status = f"REJECTED: {rec.reason}"
    elif rec.outcome == "duplicate":
        status = f"duplicate {rec.event_id} (ignored)"
    else:
        status = "verified" if rec.verified else "plain"
        if rec.state and rec.reservation_id:
            status += f" -> {rec.state}"
    parts.append("  " + status)
    return "".join(parts)


# ----------------------------------------------------------------------------- put results


@dataclass(frozen=True)
class PutResult:
    """What `put_spec` put: the signed spec, its KV revision, and whether the generation was bumped."""

    spec: NodeSpec
    revision: int
    #: the generation the caller gave (None: none given, so last + 1 was used).
    requested_generation: int | None
    #: non-empty when the requested generation was not above the last one and was bumped.
    note: str = ""
    #: fields NodeSpec does not declare, put as given (only with allow_unknown_fields).
    unknown_fields: tuple[UnknownField, ...] = ()
    #: `time.perf_counter()` just before the KV put was sent (signed already): where a
    #: latency measurement of the node's answer starts (bench/e2e.py).
    put_at: float = 0.0

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def generation(self) -> int:
        return self.spec.generation

    @property
    def bumped(self) -> bool:
        return bool(self.note)


def _spec_fields(spec: NodeSpec | dict[str, Any] | str | bytes) -> dict[str, Any]:
    if isinstance(spec, NodeSpec):
        return msgspec.to_builtins(spec)
    if isinstance(spec, (str, bytes, bytearray)):
        if not spec.strip():
            raise BadMessage("spec: empty (a NodeSpec is a JSON object)")
        # bounded_json_loads says "spec: not valid JSON (...)" itself (it was said twice, issue 28.8)
        data = bounded_json_loads(spec, 4 * DEFAULT_MAX_BYTES, "spec")
    else:
        data = spec
    if not isinstance(data, dict):
        raise BadMessage("spec: expected a JSON object")
    return dict(data)


@dataclass(frozen=True)
class CheckedSpec:
    """A spec as `check_spec` read it: valid, with any generation it asked for."""

    #: the spec decoded (generation: the requested one, or 0 when none was given).
    draft: NodeSpec
    requested: int | None
    #: the JSON object as given.
    fields: dict[str, Any]
    #: fields NodeSpec does not declare (empty unless allowed).
    unknown: list[UnknownField]


def check_spec(spec: NodeSpec | dict[str, Any] | str | bytes, *, allow_unknown_fields: bool = False) -> CheckedSpec:
    """What a put checks before anything is reserved or signed (also `bcd apply --dry-run`).

    Unknown fields first (UnknownFieldsError names every one, unless allowed),
    then the schema (BadMessage naming the field), then the node id.
    """
    fields = _spec_fields(spec)
    unknown = unknown_fields(NodeSpec, fields)
    if unknown and not allow_unknown_fields:
        raise UnknownFieldsError(unknown)
    requested = fields.get("generation")
    # Validate first (with any generation), so a bad spec never consumes one.
    draft = NODE_SPEC_CODEC.decode(encode({**fields, "generation": requested if isinstance(requested, int) and requested >= 0 else 0}))
    if requested is not None:
        NODE_SPEC_CODEC.decode(encode(fields))  # a malformed generation fails here, named
    try:
        upstream_spec_key_subject(draft.node_id)  # refuses a reserved node id
    except ValueError as exc:
        raise BadMessage(f"spec: {exc}") from None
    return CheckedSpec(draft=draft, requested=requested, fields=fields, unknown=unknown)


class UnknownNode(ValueError):
    """A spec for a node that never put a Hello (a typo, or a node not yet joined)."""

    def __init__(self, node_id: str) -> None:
        super().__init__(f"node {node_id} has never announced itself (no Hello in {UPSTREAM_NODES_BUCKET})")
        self.node_id = node_id


# ----------------------------------------------------------------------------- the control plane


class _Rejected(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Transient(Exception):
    """Upstream did not answer (a Hello lookup); the message is retried, not judged."""


_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (nats.errors.Error, asyncio.TimeoutError, TimeoutError)


@dataclass
class _Verdict:
    """One message judged, nothing applied yet: its record's fields (all but the
    outcome), and the event to apply, or `rejected` (the reason is in the fields)."""

    msg: Msg
    fields: dict[str, Any]
    event_id: str
    event: Any = None
    rejected: bool = False


class ControlPlane:
    """The reference control plane over one connected upstream client.

    `nc` must be connected as `controlplane` with `inbox_prefix("controlplane")`
    (its permissions allow nothing else).
    """

    def __init__(
        self,
        nc: Client,
        key: Ed25519PrivateKey,
        state_dir: Path,
        *,
        out: TextIO | None = sys.stdout,
        fetch_batch: int = EVENT_BATCH,
        fetch_timeout: float = 0.5,
        js_timeout: float = 5.0,
        replicas: int = 1,
    ) -> None:
        self.nc = nc
        #: JetStream replicas of the stream and buckets it creates (3 on a 3-server cluster).
        self.replicas = replicas
        self.key = key
        self.key_id = key_id(key)
        self.state_dir = Path(state_dir)
        self.store = StateStore(self.state_dir)
        self.events_path = self.state_dir / EVENTS_FILE
        self.js = nc.jetstream(timeout=js_timeout)
        self._out = out
        self._fetch_batch = fetch_batch
        self._fetch_timeout = fetch_timeout
        self._kv: dict[str, KeyValue] = {}
        self._hellos: dict[str, Hello] = {}
        self._events: list[EventRecord] = []
        #: event ids that have an "applied" line in events.jsonl
        self._logged_applied: set[str] = set()
        self._rejected: list[EventRecord] = []
        self._duplicates: list[EventRecord] = []
        #: set while `run` consumes (its subscriptions are in place on the server).
        self.consuming = asyncio.Event()
        self._load_event_log()

    # ------------------------------------------------------------------ upstream objects

    async def ensure_upstream(self) -> None:
        """Create the buckets and the stream when missing (idempotent); fix allow_direct if off."""
        for bucket, history in BUCKET_HISTORY.items():
            stream = f"KV_{bucket}"
            try:
                info = await self.js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                await self.js.create_key_value(
                    KeyValueConfig(
                        bucket=bucket,
                        description=f"bcd upstream {bucket}",
                        history=history,
                        storage=StorageType.FILE,
                        direct=True,
                        replicas=self.replicas,
                    )
                )
                log.info("created bucket", bucket=bucket, history=history)
            else:
                if not info.config.allow_direct:
                    info.config.allow_direct = True
                    await self.js.update_stream(info.config)
                    log.warning("bucket did not allow direct gets; turned them on", bucket=bucket)
            self._kv[bucket] = await self.js.key_value(bucket)
        want = StreamConfig(
            name=UPSTREAM_EVENTS_STREAM,
            description="bcd node events (one per message, Nats-Msg-Id = event id)",
            subjects=[upstream_events_filter()],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW.total_seconds(),
            num_replicas=self.replicas,
        )
        try:
            info = await self.js.stream_info(UPSTREAM_EVENTS_STREAM)
        except nats.js.errors.NotFoundError:
            await self.js.add_stream(want)
            log.info("created stream", stream=UPSTREAM_EVENTS_STREAM)
        else:
            cfg = info.config
            if list(cfg.subjects or []) != want.subjects or (cfg.duplicate_window or 0) != want.duplicate_window:
                cfg.subjects = want.subjects
                cfg.duplicate_window = want.duplicate_window
                await self.js.update_stream(cfg)
                log.warning("stream config differed; updated", stream=UPSTREAM_EVENTS_STREAM)
            if cfg.storage != StorageType.FILE:
                log.warning("stream is not file-backed; events are lost with the server", stream=UPSTREAM_EVENTS_STREAM)

    async def _bucket(self, bucket: str) -> KeyValue:
        kv = self._kv.get(bucket)
        if kv is None:
            kv = self._kv[bucket] = await self.js.key_value(bucket)
        return kv

    # ------------------------------------------------------------------ specs

    async def put_spec(
        self,
        spec: NodeSpec | dict[str, Any] | str | bytes,
        *,
        allow_unknown_fields: bool = False,
        require_known_node: bool = False,
        hello_wait: float = 0.0,
    ) -> PutResult:
        """Sign and put one node's spec at `bcd_nodespecs/<node_id>`.

        A dict or JSON without `generation` gets the last put generation + 1;
        a given generation not above the last is bumped the same way, and the
        result's `note` says so. Raises BadMessage when the spec does not decode,
        UnknownFieldsError (a BadMessage) naming every field NodeSpec does not
        declare unless `allow_unknown_fields` (then they are put as given, for a
        newer node), and UnknownNode with `require_known_node` when the node has
        never put a Hello (waiting up to `hello_wait` seconds for one).
        """
        checked = check_spec(spec, allow_unknown_fields=allow_unknown_fields)
        draft, requested, node_id = checked.draft, checked.requested, checked.draft.node_id
        if require_known_node and not await self.node_known(node_id, wait=hello_wait):
            raise UnknownNode(node_id)
        published = await self._published_generation(node_id)
        with self.store.transaction() as st:
            gen, note = next_generation(st, node_id, requested, published)
            # reserve it now: a concurrent put (another process) gets the next one.
            st.node(node_id).last_generation = gen
        final = msgspec.structs.replace(draft, generation=gen)
        # fields this schema does not know (allowed) travel as given: they are for a newer node
        signed = sign_node_spec(self.key, encode({**checked.fields, "generation": gen}) if checked.unknown else final)
        kv = await self._bucket(UPSTREAM_NODESPECS_BUCKET)
        payload = encode(signed)
        put_at = time.perf_counter()
        revision = await kv.put(node_id, payload)
        with self.store.transaction() as st:
            apply_spec(st, final, now_utc())
        if note:
            log.warning("generation bumped", node_id=node_id, note=note)
        log.info(
            "spec put",
            node_id=node_id,
            generation=gen,
            revision=revision,
            assignments=len(final.devices),
            key_id=self.key_id,
            # allowed fields this control plane does not know: put as given, for a newer node
            **({"unknown_fields": [str(f) for f in checked.unknown][:20]} if checked.unknown else {}),
        )
        return PutResult(
            spec=final, revision=revision, requested_generation=requested, note=note, unknown_fields=tuple(checked.unknown), put_at=put_at
        )

    async def node_known(self, node_id: str, *, wait: float = 0.0) -> bool:
        """Has `node_id` ever put a Hello (a boot id on record, or a Hello in `bcd_nodes` now)?

        Waits up to `wait` seconds for a Hello to appear (a node that is starting).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while True:
            if self.boot_ids(node_id) or await self.node_hello(node_id) is not None:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(0.25, max(0.0, deadline - loop.time())))

    async def _published_generation(self, node_id: str) -> int:
        kv = await self._bucket(UPSTREAM_NODESPECS_BUCKET)
        try:
            entry = await kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            return 0
        try:
            signed = SIGNED_NODE_SPEC_CODEC.decode(entry.value or b"")
            return NODE_SPEC_CODEC.decode(signed.spec).generation
        except BadMessage as exc:
            log.warning("spec in bucket does not decode; ignoring its generation", node_id=node_id, error=str(exc))
            return 0

    # ------------------------------------------------------------------ nodes

    async def node_hello(self, node_id: str) -> Hello | None:
        """The node's current Hello from `bcd_nodes` (fetched now; None when absent or invalid)."""
        hello, _ = await self._fetch_hello(node_id)
        return hello

    async def node_inventory(self, node_id: str) -> Inventory | None:
        kv = await self._bucket(UPSTREAM_INVENTORY_BUCKET)
        try:
            entry = await kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            return None
        try:
            return INVENTORY_CODEC.decode(entry.value or b"")
        except BadMessage as exc:
            log.warning("inventory does not decode", node_id=node_id, error=str(exc))
            return None

    async def node_conditions(self, node_id: str) -> dict[str, Condition]:
        """The latest condition per type that the node reported (from the processed events)."""
        rec = self.store.refresh().nodes.get(node_id)
        return dict(rec.conditions) if rec else {}

    async def node_sections(self, node_id: str) -> dict[str, SectionStatus]:
        """The latest SectionStatus per section that the node reported."""
        rec = self.store.refresh().nodes.get(node_id)
        return dict(rec.sections) if rec else {}

    def boot_ids(self, node_id: str) -> list[str]:
        rec = self.store.refresh().nodes.get(node_id)
        return list(rec.boot_ids) if rec else []

    async def _fetch_hello(self, node_id: str) -> tuple[Hello | None, str]:
        """(Hello, "") or (None, why). Network trouble raises (transient)."""
        kv = await self._bucket(UPSTREAM_NODES_BUCKET)
        try:
            entry = await kv.get(node_id)
        except nats.js.errors.KeyNotFoundError:
            self._hellos.pop(node_id, None)
            return None, f"{node_id} has no Hello in {UPSTREAM_NODES_BUCKET}"
        hello, problem = self._check_hello(node_id, entry.value or b"")
        if hello is not None:
            self._learn_hello(hello)
        return hello, problem

    @staticmethod
    def _check_hello(node_id: str, data: bytes) -> tuple[Hello | None, str]:
        try:
            hello = HELLO_CODEC.decode(data)
        except BadMessage as exc:
            return None, f"{node_id}'s Hello does not decode ({exc})"
        if hello.node_id != node_id:
            return None, f"Hello under key {node_id} names node {hello.node_id}"
        if len(hello.public_key) != 32:
            return None, f"{node_id}'s Hello public key is {len(hello.public_key)} bytes, not 32"
        if key_id(hello.public_key) != hello.key_id:
            return None, f"{node_id}'s Hello key_id {hello.key_id} does not match its public key"
        return hello, ""

    def _learn_hello(self, hello: Hello) -> None:
        self._hellos[hello.node_id] = hello
        rec = self.store.refresh().nodes.get(hello.node_id)
        if rec is None or hello.boot_id not in rec.boot_ids or rec.key_id != hello.key_id:
            with self.store.transaction() as st:
                if remember_boot(st, hello):
                    log.info("node boot announced", node_id=hello.node_id, boot_id=hello.boot_id, key_id=hello.key_id)

    async def _on_hello_msg(self, msg: Msg) -> None:
        """A Hello put seen live (`$KV.bcd_nodes.<node>`): remember its boot id at once."""
        node_id = msg.subject.rsplit(".", 1)[-1]
        if (msg.headers or {}).get(KV_OPERATION_HEADER) in ("DEL", "PURGE"):
            self._hellos.pop(node_id, None)
            return
        hello, problem = self._check_hello(node_id, msg.data)
        if hello is None:
            log.warning("ignoring a bad Hello", node_id=node_id, reason=problem)
            return
        try:
            self._learn_hello(hello)
        except Exception:  # noqa: BLE001 - a subscription callback must not die
            log.exception("could not record a Hello", node_id=node_id)

    # ------------------------------------------------------------------ events

    def _consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=CONSUMER_NAME,
            description="bcd reference control plane",
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            filter_subject=upstream_events_filter(),
            # One batch in flight: `run` fetches again only once the batch before is
            # saved and acked. The short ack_wait bounds a stall if acks are lost on a
            # live connection; a slow judgement sends in_progress.
            ack_wait=ACK_WAIT_S,
            max_ack_pending=self._fetch_batch,
            max_deliver=-1,
        )

    async def _ensure_consumer(self) -> None:
        """Create the durable consumer, or bring an older one's settings up to date; then, when
        events are still unacked from a control plane that died, restart delivery at the ack floor.

        Those events would come back only after ack_wait, and the ones after them (up to
        max_ack_pending) would be delivered first: a node's Released applied before its
        Bound. A consumer reset (nats-server 2.14+) drops the dead instance's deliveries
        and delivers everything above the ack floor again, in stream order, at once;
        what was applied already is then a duplicate by its event id.
        """
        info = await self.js.add_consumer(UPSTREAM_EVENTS_STREAM, config=self._consumer_config())
        if info.num_ack_pending:
            reset = await self.js.reset_consumer(UPSTREAM_EVENTS_STREAM, CONSUMER_NAME)
            log.warning(
                "events left unacked by an earlier run; delivering again from the ack floor, in order",
                unacked=info.num_ack_pending,
                from_stream_seq=reset.reset_seq,
            )

    async def run(self, stopping: asyncio.Event) -> None:
        """Consume BCD_EVENTS until `stopping` is set, a batch at a time.

        A batch is whatever the consumer has now, up to `fetch_batch` (never waited
        for to fill): judged message by message in stream order, applied in memory,
        saved with one state.json write, its events.jsonl lines written, and only
        then acked. Nothing after a batch is delivered before it is acked.
        """
        await self._ensure_consumer()
        psub = await self.js.pull_subscribe_bind(CONSUMER_NAME, stream=UPSTREAM_EVENTS_STREAM)
        hello_sub = await self.nc.subscribe(f"$KV.{UPSTREAM_NODES_BUCKET}.>", cb=self._on_hello_msg)
        await self.nc.flush()
        self.consuming.set()
        log.info("consuming events", stream=UPSTREAM_EVENTS_STREAM, consumer=CONSUMER_NAME, state_dir=str(self.state_dir))
        try:
            while not stopping.is_set():
                try:
                    msgs = await self._fetch(psub)
                except asyncio.TimeoutError:  # nats' own TimeoutError too; fetch raises both
                    continue
                except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                    raise
                except nats.errors.Error as exc:
                    log.warning("fetch failed; retrying", error=str(exc) or type(exc).__name__)
                    await _sleep_unless(stopping, 1.0)
                    continue
                await self._consume(msgs, stopping)
        finally:
            self.consuming.clear()
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)  # the last batch's acks reach the server before we say we stopped
            for sub in (hello_sub, psub):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            task = getattr(hello_sub, "_wait_for_msgs_task", None)
            if isinstance(task, asyncio.Task):
                await asyncio.wait({task}, timeout=1.0)

    async def _fetch(self, psub: Any) -> list[Msg]:
        """The next batch: one message waited for (up to fetch_timeout), then, without
        waiting, the ones the consumer already holds after it (its num_pending), up to
        fetch_batch. (A lone event reaches us as fast as with one message in flight; one
        fetch of fetch_batch handed it over ~0.2 ms later, measured with nats-py 2.16.)"""
        msgs = await psub.fetch(1, timeout=self._fetch_timeout)
        more = 0
        with contextlib.suppress(Exception):
            more = min(msgs[-1].metadata.num_pending, self._fetch_batch - len(msgs))
        if more > 0:
            try:
                msgs += await psub.fetch(more, timeout=self._fetch_timeout)
            except (asyncio.TimeoutError, nats.errors.Error) as exc:  # the ones in hand are judged all the same
                if not isinstance(exc, asyncio.TimeoutError):
                    log.warning("fetch failed; going on with the events in hand", error=str(exc) or type(exc).__name__)
        return msgs

    async def _consume(self, msgs: list[Msg], stopping: asyncio.Event) -> list[EventRecord]:
        """Judge, apply, save, log, then ack one fetched batch, in stream order.

        A step that fails is retried in place, the batch kept (in_progress), so no
        later event is ever applied before an earlier one: upstream trouble while
        judging every second, anything else (a full disk) every 5 s. When stopping
        meanwhile, what is left unacked is delivered again, in order, at the next start.
        """
        verdicts: list[_Verdict] = []
        for msg in msgs:
            verdict = await self._in_place(lambda msg=msg: self._judge(msg), msgs, stopping, msg.subject)
            if verdict is None:
                break  # stopping; the judged ones are still applied and acked
            verdicts.append(verdict)
        if not verdicts:
            return []

        async def commit() -> list[EventRecord]:
            return self._commit(verdicts)

        records = await self._in_place(commit, msgs, stopping, "state.json")
        if records is None:
            return []

        async def write() -> bool:
            self._write_records(records)
            return True

        if await self._in_place(write, msgs, stopping, str(self.events_path)) is None:
            return []  # saved, not logged: the redelivery writes the lines (and applies nothing again)
        for verdict in verdicts:
            try:
                await verdict.msg.ack()
            except Exception as exc:  # noqa: BLE001 - applied and saved: a redelivery is only a duplicate
                log.warning("ack failed; the event will be redelivered as a duplicate", subject=verdict.msg.subject, error=str(exc))
                break
        return records

    async def _in_place(self, step: Callable[[], Any], batch: list[Msg], stopping: asyncio.Event, what: str) -> Any:
        """`await step()` until it succeeds (its result) or `stopping` is set (None)."""
        while True:
            try:
                return await step()
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the consumer
                transient = isinstance(exc, _Transient)
                if transient:
                    log.warning("upstream lookup failed; retrying the event", subject=what, error=str(exc))
                else:
                    log.exception("event handling failed; retrying it in place", what=what)
                if stopping.is_set():
                    return None
                for msg in batch:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
                await _sleep_unless(stopping, 1.0 if transient else 5.0)

    async def handle(self, msg: Msg) -> EventRecord:
        """Judge, apply, persist, log, then ack one message of BCD_EVENTS (a batch of one; errors raise)."""
        [rec] = self._commit([await self._judge(msg)])
        self._write_records([rec])
        await msg.ack()
        return rec

    async def _judge(self, msg: Msg) -> _Verdict:
        received = now_utc()
        seq = 0
        with contextlib.suppress(Exception):
            seq = msg.metadata.sequence.stream
        tokens = msg.subject.split(".")
        node_id = tokens[2] if len(tokens) > 2 else ""
        etype = tokens[-1]
        base: dict[str, Any] = dict(received_at=received, node_id=node_id, type=etype, subject=msg.subject, stream_seq=seq)
        header_id = (msg.headers or {}).get(MSG_ID_HEADER)
        if len(tokens) != 4 or tokens[:2] != ["bcd", "events"] or etype not in EVENT_TYPES:
            return self._reject(msg, base, f"subject {msg.subject} is not bcd.events.<node>.<{'|'.join(EVENT_TYPES)}>", header_id)
        if etype in ATTESTED_TYPES:
            return await self._judge_attested(msg, base, node_id, etype, header_id)
        return self._judge_plain(msg, base, node_id, etype, header_id)

    async def _judge_attested(self, msg: Msg, base: dict[str, Any], node_id: str, etype: str, header_id: str | None) -> _Verdict:
        try:
            report = ATTESTED_REPORT_CODEC.decode(msg.data)
        except BadMessage as exc:
            return self._reject(msg, base, f"not an AttestedReport ({exc})", header_id, verified=False)
        claimed = _unverified_body(report.body)
        base.update(key_id=report.key_id)
        if claimed is not None:
            base.update(_claimed_fields(claimed))
        try:
            body = await self._verify(node_id, etype, report, header_id)
        except _Rejected as rej:
            return self._reject(msg, base, rej.reason, header_id or (claimed.event_id if claimed else ""), verified=False)
        return self._accept(msg, base, body.event, body.event_id, verified=True, time=body.time, boot_id=body.boot_id)

    async def _verify(self, node_id: str, etype: str, report: Any, header_id: str | None) -> ReportBody:
        try:
            hello = self._hellos.get(node_id)
            if hello is None or hello.key_id != report.key_id:
                hello, problem = await self._fetch_hello(node_id)
                if hello is None:
                    raise _Rejected(problem)
            try:
                body = verify_report(report, hello.public_key)
            except VerificationError as exc:
                raise _Rejected(str(exc)) from None
            if body.node_id != node_id:
                raise _Rejected(f"body names node {body.node_id} on {node_id}'s subject")
            if body.event.__struct_config__.tag != etype:
                raise _Rejected(f"body carries a {body.event.__struct_config__.tag} event on a {etype} subject")
            if body.boot_id not in self.boot_ids(node_id):
                # The node may have rebooted since we last looked.
                fresh, _ = await self._fetch_hello(node_id)
                if fresh is None or body.boot_id not in self.boot_ids(node_id):
                    raise _Rejected(f"boot id {body.boot_id} was never announced by {node_id}")
            if header_id is not None and header_id != body.event_id:
                raise _Rejected(f"{MSG_ID_HEADER} {header_id} is not the body's event_id {body.event_id}")
            return body
        except _TRANSIENT_ERRORS as exc:
            raise _Transient(f"{type(exc).__name__}: {exc}") from None

    def _judge_plain(self, msg: Msg, base: dict[str, Any], node_id: str, etype: str, header_id: str | None) -> _Verdict:
        try:
            event = NODE_EVENT_CODEC.decode(msg.data)
        except BadMessage as exc:
            return self._reject(msg, base, f"not a node event ({exc})", header_id)
        tag = event.__struct_config__.tag
        if tag != etype:
            return self._reject(msg, base, f"a {tag} event on a {etype} subject (bound and released travel signed)", header_id, event=event)
        event_id = header_id or f"{node_id}.{etype}.sha256-{hashlib.sha256(msg.data).hexdigest()[:32]}"
        when = event.condition.since if isinstance(event, (NodeCondition, HoldCondition)) else None
        return self._accept(msg, base, event, event_id, verified=None, time=when)

    def _accept(
        self, msg: Msg, base: dict[str, Any], event: Any, event_id: str, *, verified: bool | None, time: datetime | None, boot_id: str = ""
    ) -> _Verdict:
        alloc, rsv, _what, gen, detail = describe(event)
        fields = dict(
            base,
            time=time,
            event_id=event_id,
            verified=verified,
            allocation_id=alloc,
            reservation_id=rsv,
            generation=gen,
            boot_id=boot_id,
            detail=detail,
            event=msgspec.to_builtins(event),
        )
        return _Verdict(msg=msg, fields=fields, event_id=event_id, event=event)

    def _reject(
        self, msg: Msg, base: dict[str, Any], reason: str, event_id: str | None, *, verified: bool | None = None, event: Any = None
    ) -> _Verdict:
        fields = dict(base)
        if event is not None:
            alloc, rsv, _what, gen, detail = describe(event)
            fields.update(allocation_id=alloc, reservation_id=rsv, generation=gen, detail=detail, event=msgspec.to_builtins(event))
        log.warning("event rejected", node_id=base["node_id"], type=base["type"], subject=base["subject"], reason=reason, event_id=event_id or "")
        fields.update(event_id=event_id or "", verified=verified, reason=reason)
        return _Verdict(msg=msg, fields=fields, event_id=event_id or "", rejected=True)

    def _commit(self, verdicts: list[_Verdict]) -> list[EventRecord]:
        """Apply judged events in stream order: one state.json write for them all (none when
        nothing in it moves: only new gpu events); the records to log, in the same order."""
        applied: set[str] = set()  # applied in this batch: a second copy in it is a duplicate
        if not self._moves_state(verdicts):
            return [self._settle(None, v, applied) for v in verdicts]
        with self.store.transaction() as st:
            records = [self._settle(st, v, applied) for v in verdicts]
        return records

    def _moves_state(self, verdicts: list[_Verdict]) -> bool:
        """Does settling these touch state.json? Only a new GpuChanged (applied, its log
        line its only record) does not; a duplicate of one counts in duplicate_count."""
        gpu: set[str] = set()
        for v in verdicts:
            if v.rejected or not isinstance(v.event, GpuChanged) or v.event_id in self._logged_applied or v.event_id in gpu:
                return True
            gpu.add(v.event_id)
        return False

    def _settle(self, st: ControlPlaneState | None, v: _Verdict, applied: set[str]) -> EventRecord:
        """One judged event against the state (None: `_moves_state` said it moves nothing)."""
        if v.rejected:
            assert st is not None
            st.rejected_count += 1
            return EventRecord(**v.fields, outcome="rejected")
        event_id = v.event_id
        logged = event_id in self._logged_applied or event_id in applied
        if isinstance(v.event, GpuChanged):
            # nothing in state.json moves for it (apply_event): no fsync'd state write per
            # card change; its applied line in events.jsonl remembers it across a restart
            if not logged:
                applied.add(event_id)
                return EventRecord(**v.fields, outcome="applied")
            assert st is not None
            st.duplicate_count += 1
            return EventRecord(**v.fields, outcome="duplicate")
        assert st is not None
        if event_id in st.processed:
            if not logged:
                # applied and saved, then killed before its log line: the
                # redelivery writes the line it lost (the state is not applied again)
                applied.add(event_id)
                rsv = v.fields.get("reservation_id") or ""
                res = st.reservations.get(rsv) if rsv else None
                return EventRecord(**v.fields, outcome="applied", state=res.state if res else "")
            st.duplicate_count += 1
            return EventRecord(**v.fields, outcome="duplicate")
        now = v.fields["received_at"]
        moved = apply_event(st, v.fields["node_id"], v.event, event_id, now)
        remember_processed(st, event_id, now)
        applied.add(event_id)
        return EventRecord(**v.fields, outcome="applied", state=moved.state if moved else "")

    def _write_records(self, records: list[EventRecord]) -> None:
        """Append the batch's lines to events.jsonl (one write), then remember them; print them."""
        with open(self.events_path, "ab") as f:
            f.write(b"".join(encode(rec) + b"\n" for rec in records))
        lines = []
        for rec in records:
            {"applied": self._events, "duplicate": self._duplicates, "rejected": self._rejected}[rec.outcome].append(rec)
            if rec.outcome == "applied" and rec.event_id:
                self._logged_applied.add(rec.event_id)
            if rec.outcome == "duplicate":
                log.info("duplicate event ignored", node_id=rec.node_id, type=rec.type, event_id=rec.event_id)
            lines.append(format_line(rec) + "\n")
        if self._out is not None:
            with contextlib.suppress(OSError, ValueError):
                self._out.write("".join(lines))
                self._out.flush()

    def _load_event_log(self) -> None:
        try:
            lines = self.events_path.read_bytes().splitlines()
        except FileNotFoundError:
            return
        for raw in lines:
            if not raw.strip():
                continue
            try:
                rec = _RECORD_DECODER.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # a torn last line after a crash
            {"applied": self._events, "duplicate": self._duplicates, "rejected": self._rejected}[rec.outcome].append(rec)
            if rec.outcome == "applied" and rec.event_id:
                self._logged_applied.add(rec.event_id)

    # ------------------------------------------------------------------ accessors

    def reservations(self) -> dict[str, Reservation]:
        return dict(self.store.refresh().reservations)

    def events(self) -> list[EventRecord]:
        """Events applied (this state dir's whole log, oldest first)."""
        return list(self._events)

    def rejected(self) -> list[EventRecord]:
        return list(self._rejected)

    def duplicates(self) -> list[EventRecord]:
        return list(self._duplicates)

    def rejected_count(self) -> int:
        return self.store.refresh().rejected_count

    def last_generation(self, node_id: str) -> int:
        rec = self.store.refresh().nodes.get(node_id)
        return rec.last_generation if rec else 0


def _unverified_body(body: bytes) -> ReportBody | None:
    """What a report claims, for the log of a rejected one; never trusted."""
    try:
        return REPORT_BODY_CODEC.decode(body)
    except BadMessage:
        return None


def _claimed_fields(body: ReportBody) -> dict[str, Any]:
    alloc, rsv, _what, gen, detail = describe(body.event)
    return dict(
        allocation_id=alloc,
        reservation_id=rsv,
        generation=gen,
        detail=detail,
        boot_id=body.boot_id,
        time=body.time,
        event=msgspec.to_builtins(body.event),
    )


async def _sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stopping.wait(), seconds)


# ----------------------------------------------------------------------------- command line


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value else default


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--nats-url", default=_env("BCD_CP_NATS_URL", "nats://127.0.0.1:4222"), help="upstream NATS URL [env BCD_CP_NATS_URL]")
    common.add_argument("--user", default=_env("BCD_CP_USER", CONTROLPLANE_USER), help="upstream NATS user [env BCD_CP_USER]")
    common.add_argument("--password-file", type=Path, default=_env("BCD_CP_PASSWORD_FILE"), help="file holding the user's password [env BCD_CP_PASSWORD_FILE]")
    common.add_argument(
        "--nkey-file",
        type=Path,
        default=_env("BCD_CP_NKEY_FILE"),
        help="the user's nkey seed file (`bcd fleet init`: DIR/upstream/controlplane.nk); wins over --password-file [env BCD_CP_NKEY_FILE]",
    )
    common.add_argument(
        "--ca-file", type=Path, default=_env("BCD_CP_CA_FILE"), help="CA bundle the upstream's certificate must chain to (turns TLS on) [env BCD_CP_CA_FILE]"
    )
    common.add_argument("--cert-file", type=Path, default=_env("BCD_CP_CERT_FILE"), help="client certificate for mutual TLS (with --key-file) [env BCD_CP_CERT_FILE]")
    common.add_argument("--key-file", type=Path, default=_env("BCD_CP_KEY_FILE"), help="the client certificate's key [env BCD_CP_KEY_FILE]")
    common.add_argument(
        "--server-name", default=_env("BCD_CP_SERVER_NAME", ""), help="name the upstream's certificate must have (default: the URL's host) [env BCD_CP_SERVER_NAME]"
    )
    common.add_argument(
        "--tls-required",
        action="store_true",
        default=(_env("BCD_CP_TLS", "") or "").lower() == "required",
        help="TLS even with a nats:// URL and no CA file (the system's trust store); a plain-text server is refused [env BCD_CP_TLS=required]",
    )
    common.add_argument("--state-dir", type=Path, default=_env("BCD_CP_STATE_DIR"), help="key, state.json, events.jsonl [env BCD_CP_STATE_DIR]")
    common.add_argument(
        "--replicas",
        type=int,
        default=_env("BCD_CP_REPLICAS", "1"),
        help="JetStream replicas of the events stream and the buckets when it creates them (3 on a 3-server cluster) [env BCD_CP_REPLICAS]",
    )
    common.add_argument("--log-level", default=_env("BCD_CP_LOG_LEVEL", "INFO"), help="[env BCD_CP_LOG_LEVEL]")
    common.add_argument("--log-format", default=_env("BCD_CP_LOG_FORMAT", "json"), choices=("json", "text"), help="[env BCD_CP_LOG_FORMAT]")
    parser = argparse.ArgumentParser(prog="bcd-controlplane", description="bcd reference control plane")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", parents=[common], help="ensure the upstream buckets and stream, consume events until SIGTERM")
    put = sub.add_parser("put", parents=[common], help="sign and put one NodeSpec, print its generation")
    put.add_argument("spec", help="NodeSpec JSON file ('-' for stdin); generation optional")
    put.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="put fields NodeSpec does not declare as given (for a newer node) instead of refusing the spec (exit 2)",
    )
    put.add_argument(
        "--hello-wait",
        type=float,
        default=float(_env("BCD_CP_HELLO_WAIT", str(LOCAL_HELLO_WAIT_S))),
        help="seconds to wait for the node's Hello: a spec for a node that never said Hello is refused (exit 2) [env BCD_CP_HELLO_WAIT]",
    )
    put.add_argument("--force", action="store_true", help="put the spec even for a node that never said Hello")
    return parser


def tls_from_args(args: argparse.Namespace) -> UpstreamTls:
    """The TLS the command line and BCD_CP_* ask for (TlsConfigError: a certificate without its key)."""
    return upstream_tls(
        args.nats_url, ca=args.ca_file, cert=args.cert_file, key=args.key_file, server_name=args.server_name, required=args.tls_required
    )


class _Reasons:
    """What went wrong connecting, each distinct reason said once until a connection is up again
    (nats-py retries every second and calls back each time)."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def first(self, reason: str) -> bool:
        if reason in self.said:
            return False
        self.said.add(reason)
        return True

    def clear(self) -> None:
        self.said.clear()


async def connect_upstream(
    url: str,
    user: str,
    password_file: Path | None,
    *,
    nkey_file: Path | None = None,
    tls: UpstreamTls | None = None,
    reconnect: bool = True,
    timeout: float = 5.0,
) -> Client:
    """Connect as the control plane: with `nkey_file` as that nkey user (else with the password
    of `password_file`, else without credentials), and with `tls` (UpstreamTls) over verified TLS.

    `reconnect=True` (serve): tries until connected, each distinct failure logged once, as one
    line (`explain`: another CA, an expired certificate, a name mismatch, a plain-text server,
    a client certificate refused). `reconnect=False` (one put): one try within `timeout`
    seconds, then ConnectionError naming the cause in that one line (nats-py alone would retry
    a refused server forever and log each failure). TlsConfigError when the TLS files do not
    load (reconnect=True); a ConnectionError saying so with reconnect=False."""
    tls = tls or UpstreamTls()
    try:
        ctx = client_context(tls) if tls.enabled else None
    except TlsConfigError as exc:
        if reconnect:
            raise
        raise ConnectionError(f"upstream {url}: {exc}") from None
    password = Path(password_file).read_text().strip() if password_file and nkey_file is None else None
    errors: list[Exception] = []
    reasons = _Reasons()

    async def on_error(exc: Exception) -> None:
        if not reconnect:
            errors.append(exc)  # said once, in the ConnectionError
            return
        reason = explain(exc)
        if nc.is_connected:
            log.warning("nats error", error=reason)
        elif reasons.first(reason):
            log.warning("upstream connection failed; retrying", reason=reason, tls=tls.describe())

    nc = new_client(tls)

    async def on_disconnect() -> None:
        # a close we asked for is not news
        if not (nc.is_closed or nc.is_draining):
            log.warning("disconnected from upstream")

    async def on_reconnect() -> None:
        reasons.clear()
        log.info("reconnected to upstream")

    options: dict[str, Any] = dict(
        name="bcd-controlplane",
        user=user if password is not None else None,
        password=password,
        inbox_prefix=inbox_prefix(user).encode(),
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        allow_reconnect=reconnect,
        **connect_options(tls, ctx),
    )
    if nkey_file is not None:
        options["nkeys_seed"] = str(nkey_file)
    if reconnect:
        await nc.connect(server_list(url), max_reconnect_attempts=-1, reconnect_time_wait=1, connect_timeout=5, **options)
        reasons.clear()
        return nc
    try:
        await asyncio.wait_for(
            nc.connect(server_list(url), max_reconnect_attempts=1, reconnect_time_wait=min(0.25, timeout / 4), connect_timeout=max(0.1, timeout), **options),
            timeout=max(0.1, timeout),
        )
    except Exception as exc:  # noqa: BLE001 - whatever the client raises, upstream is not there for us
        with contextlib.suppress(Exception):
            await nc.close()
        cause: BaseException = errors[-1] if errors and isinstance(exc, (nats.errors.NoServersError, asyncio.TimeoutError)) else exc
        why = "connection refused" if isinstance(cause, ConnectionRefusedError) else (
            f"no answer within {timeout:g} s" if isinstance(cause, asyncio.TimeoutError) else explain(cause)
        )
        raise ConnectionError(f"upstream {url} not reachable ({why})") from None
    return nc


#: how often `serve` looks at its TLS files for a renewal (seconds; it is used at the next reconnect)
TLS_CHECK_S = 10.0


async def _watch_tls(files: TlsFiles, nc: Client, stopping: asyncio.Event, every: float) -> None:
    """A renewed certificate, key or CA bundle on disk becomes the context of the next reconnect;
    one that does not load is said once and the files in use are kept."""
    said: str | None = None
    while not stopping.is_set():
        await _sleep_unless(stopping, every)
        if files.refresh():
            files.install(nc)
            said = None
            log.info("upstream TLS files renewed: used at the next reconnect", tls=files.tls.describe(), generation=files.generation)
        elif files.error and files.error != said:
            said = files.error
            log.warning("upstream TLS renewal does not load; keeping the files in use", reason=files.error)


async def _close(nc: Client) -> None:
    if nc.is_closed:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.drain(), 3.0)
    if not nc.is_closed:
        with contextlib.suppress(Exception):
            await nc.close()


async def _connect_serving(args: argparse.Namespace, tls: UpstreamTls, stopping: asyncio.Event) -> tuple[Client, TlsFiles] | None:
    """Connected (None: stopped first). TLS files that do not load (yet) are said once per
    reason and tried again, alive (a supervisor would only loop on an exit); the connection's
    own failures likewise, in connect_upstream."""
    said: set[str] = set()
    while True:
        try:
            files = TlsFiles(tls)
            break
        except TlsConfigError as exc:
            if str(exc) not in said:
                said.add(str(exc))
                log.warning("upstream TLS files do not load; retrying", reason=str(exc))
            await _sleep_unless(stopping, 5.0)
            if stopping.is_set():
                return None
    connecting = asyncio.ensure_future(connect_upstream(args.nats_url, args.user, args.password_file, nkey_file=args.nkey_file, tls=tls))
    stop_wait = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({connecting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    stop_wait.cancel()
    if not connecting.done():
        connecting.cancel()
        with contextlib.suppress(BaseException):
            await connecting
        return None
    return connecting.result(), files


async def _serve(args: argparse.Namespace) -> int:
    key, pub = load_or_create_cp_key(args.state_dir)
    tls = tls_from_args(args)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        connected = await _connect_serving(args, tls, stopping)
        if connected is None:
            return 0
        nc, files = connected
        every = float(_env("BCD_CP_TLS_CHECK", str(TLS_CHECK_S)) or TLS_CHECK_S)
        watcher = asyncio.ensure_future(_watch_tls(files, nc, stopping, every)) if tls.enabled else None
        try:
            cp = ControlPlane(nc, key, args.state_dir, replicas=args.replicas)
            # a cluster still electing, or short of peers for the replicas, refuses the
            # stream for now: retried rather than exiting (which a supervisor would loop on)
            while True:
                try:
                    await cp.ensure_upstream()
                    break
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    log.warning("upstream objects not ready; retrying", error=str(exc) or type(exc).__name__, replicas=args.replicas)
                    await _sleep_unless(stopping, 2.0)
                    if stopping.is_set():
                        return 0
            log.info(
                "started", nats_url=args.nats_url, user=args.user, key_id=cp.key_id, public_key=str(pub), pid=os.getpid(),
                auth="nkey" if args.nkey_file else ("password" if args.password_file else "none"), tls=tls.describe(),
            )
            await cp.run(stopping)
            log.info("stopping")
            return 0
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await _close(nc)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def put_spec_file(
    nats_url: str,
    user: str,
    password_file: Path | None,
    state_dir: Path,
    spec: Path | str | bytes,
    *,
    allow_unknown_fields: bool = False,
    require_known_node: bool = False,
    hello_wait: float | Callable[[str], float] = 0.0,
    connect_timeout: float = 5.0,
    replicas: int = 1,
    nkey_file: Path | None = None,
    tls: UpstreamTls | None = None,
) -> PutResult:
    """Connect, ensure the upstream objects, sign and put one spec (a file path, or the JSON bytes).

    Raises BadMessage (a ValueError) for a spec that does not decode,
    UnknownFieldsError (a BadMessage) for fields NodeSpec does not declare
    (unless allowed), UnknownNode (a ValueError, with `require_known_node`),
    OSError for an unreadable file, ConnectionError when upstream cannot be
    reached (with TLS: the one line `shared.tlsconfig.explain` gives, or the TLS
    files that do not load). `hello_wait` may depend on the spec's node id;
    `nkey_file` and `tls` as for `connect_upstream`.
    """
    data = spec if isinstance(spec, bytes) else Path(spec).read_bytes()
    # everything that can be judged offline is judged before connecting
    checked = check_spec(data, allow_unknown_fields=allow_unknown_fields)
    wait = hello_wait(checked.draft.node_id) if callable(hello_wait) else hello_wait
    key, _ = load_or_create_cp_key(state_dir)
    nc = await connect_upstream(nats_url, user, password_file, nkey_file=nkey_file, tls=tls, reconnect=False, timeout=connect_timeout)
    try:
        cp = ControlPlane(nc, key, state_dir, out=None, replicas=replicas)
        try:
            await cp.ensure_upstream()
            return await cp.put_spec(data, allow_unknown_fields=allow_unknown_fields, require_known_node=require_known_node, hello_wait=wait)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            raise ConnectionError(f"upstream {nats_url}: {exc or type(exc).__name__}") from None
    finally:
        await _close(nc)


#: how long `bcd apply` waits for the Hello of the node it runs beside (a node still starting).
LOCAL_HELLO_WAIT_S = 15.0


async def put_through_node(
    state: Path, spec: Path | bytes, *, allow_unknown_fields: bool = False, force: bool = False, connect_timeout: float = 5.0
) -> PutResult:
    """`bcd apply`: put one spec through the embedded control plane of the node at `state`.

    Finds the upstream URL, the control plane's password and its state dir in
    `<state>/node.json` (written by `bcd up`). Unless `force`, a spec for a
    node that never put a Hello is refused (UnknownNode); for the node of this
    state dir, a Hello is waited for a little (it may be starting).
    """
    from .client import node_info

    info = node_info(Path(state))
    if not info.controlplane_dir:
        raise ValueError("this node joined an existing upstream: apply specs through that control plane")
    return await put_spec_file(
        info.upstream_url or info.nats_url,
        CONTROLPLANE_USER,
        Path(info.creds_dir) / f"{CONTROLPLANE_USER}.password",
        Path(info.controlplane_dir),
        spec,
        allow_unknown_fields=allow_unknown_fields,
        require_known_node=not force,
        hello_wait=lambda node_id: LOCAL_HELLO_WAIT_S if node_id == info.node_id else 0.0,
        connect_timeout=connect_timeout,
    )


async def apply_spec_file(state: Path, spec_file: Path | str) -> int:
    """Put one spec file through the node's embedded control plane (strictly); return its generation."""
    result = await put_through_node(Path(state), Path(spec_file))
    if result.note:
        print(f"note: {result.note}", file=sys.stderr)
    return result.generation


async def _put(args: argparse.Namespace) -> int:
    spec: Path | bytes = sys.stdin.buffer.read() if args.spec == "-" else Path(args.spec)
    result = await put_spec_file(
        args.nats_url,
        args.user,
        args.password_file,
        args.state_dir,
        spec,
        allow_unknown_fields=args.allow_unknown_fields,
        replicas=args.replicas,
        require_known_node=not args.force,
        hello_wait=args.hello_wait,
        nkey_file=args.nkey_file,
        tls=tls_from_args(args),
    )
    if result.note:
        print(f"note: {result.note}", file=sys.stderr)
    print(result.generation)
    return 0


def _put_main(args: argparse.Namespace) -> int:
    """`put` as a command: its generation on stdout, a refusal or failure as one line on stderr
    (`bcd-controlplane put: ...`), as `bcd apply` says it; `serve` logs structured lines."""

    def say(text: str, code: int) -> int:
        print(f"bcd-controlplane put: {text}", file=sys.stderr)
        return code

    if args.state_dir is None:
        return say("--state-dir (or BCD_CP_STATE_DIR) is required", 2)
    try:
        tls_from_args(args)
    except TlsConfigError as exc:
        return say(str(exc), 2)
    try:
        return asyncio.run(_put(args))
    except (KeyFileError, StateError) as exc:
        return say(str(exc), 2)
    except UnknownNode as exc:
        return say(f"{exc}: is the node id right? Nothing was put (--force puts it anyway)", 2)
    except UnknownFieldsError as exc:
        return say(str(exc).replace("\n", "; "), 2)
    except BadMessage as exc:
        return say(f"spec refused: {exc}", 1)
    except (OSError, nats.errors.Error) as exc:
        return say(f"put failed: {type(exc).__name__}: {exc}", 2)
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "put":
        # a command, not a server: warnings and errors only, the outcome as one line
        logs.configure("controlplane", "ERROR", args.log_format)
        return _put_main(args)
    logs.configure("controlplane", args.log_level, args.log_format)
    if args.state_dir is None:
        log.error("cannot start", reason="--state-dir (or BCD_CP_STATE_DIR) is required")
        return 2
    try:
        tls_from_args(args)
    except TlsConfigError as exc:
        log.error("cannot start", reason=str(exc))
        return 2
    try:
        return asyncio.run(_serve(args))
    except (KeyFileError, StateError) as exc:
        log.error("cannot start", reason=str(exc))
        return 2
    except UnknownFieldsError as exc:
        log.error("spec refused", reason=str(exc), unknown_fields=[str(f) for f in exc.fields][:100])
        return 2
    except BadMessage as exc:
        log.error("spec refused", reason=str(exc))
        return 1
    except (OSError, nats.errors.Error) as exc:
        log.error("stopped on an error" if args.command == "serve" else "put failed", reason=f"{type(exc).__name__}: {exc}")
        return 2
    except KeyboardInterrupt:
        return 0


__all__ = [
    "CONSUMER_NAME",
    "DUPLICATE_WINDOW",
    "EVENT_BATCH",
    "STATE_FILE",
    "EVENTS_FILE",
    "KEY_FILE",
    "PUB_FILE",
    "ReservationState",
    "Reservation",
    "NodeRecord",
    "ControlPlaneState",
    "EventRecord",
    "StateStore",
    "StateError",
    "KeyFileError",
    "PutResult",
    "ControlPlane",
    "next_generation",
    "apply_spec",
    "apply_event",
    "remember_processed",
    "remember_boot",
    "short_atom",
    "describe",
    "format_line",
    "public_key_pem",
    "load_or_create_cp_key",
    "connect_upstream",
    "tls_from_args",
    "put_spec_file",
    "put_through_node",
    "apply_spec_file",
    "check_spec",
    "CheckedSpec",
    "UnknownNode",
    "LOCAL_HELLO_WAIT_S",
    "main",
]


if __name__ == "__main__":
    sys.exit(main())
