"""The node bus's streams, made at bus start by BUS_ADMIN_USER: the outbox and the inventory's bucket.

No service may make or change a stream or a consumer (docs/security.md): a user that may
does not need the publish permission of a subject to have the server deliver there (a
push consumer's deliver subject, a republish, a source). So the streams a node needs are
made here, once the server listens and before any service starts, by an identity no
service holds: `bcd up` runs `ensure_streams` itself, a host install runs
`python -m bcd.nodebus setup-streams` (bcd-bus-setup.service), compose its `bus-setup`
container. Running it again changes nothing but what it must (a stream made by an older
bcd gets direct gets, the outbox grows to the size asked).

The outbox (`BCD_OUTBOX_<node>`): file storage, limits retention, discard new (a full
outbox refuses new events instead of dropping old ones), a 24 h duplicate window,
`allow_direct` (the bridge reads it with batched direct gets: no consumer exists). A
node-bus JetStream with too little room for its reservation (`--outbox-max-bytes`,
256 MiB by default; JetStream's own limit is 75% of the free space of its store unless
`max_file_store` says otherwise) refuses it with err_code 10047: the outbox then steps down
to the largest size the server accepts, less a quarter of it left for the node's other
streams, never below MIN_OUTBOX_BYTES, and says so; below that floor there is no outbox
(the converger says so, every event waits) and the setup fails, so its unit tries again.
The size asked is kept in the stream's metadata (WANTED_BYTES_KEY), so the converger can
say the outbox is smaller than asked.

The inventory's bucket (`KV_bcd_node_<node>_inventory`): a KV bucket of history 1 with
direct gets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from nats.aio.client import Client
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from shared.subjects import NodeSubjects

#: long enough to cover any restart: a replayed event id inside it is dropped.
DUPLICATE_WINDOW = timedelta(hours=24)
#: JetStream's "insufficient storage resources available".
INSUFFICIENT_STORAGE = 10047
MIB = 1024 * 1024
DEFAULT_OUTBOX_MAX_BYTES = 256 * MIB
DEFAULT_OUTBOX_MAX_MSGS = 100_000
#: the smallest outbox worth having (thousands of events); below it the stream is not made.
MIN_OUTBOX_BYTES = 16 * MIB
#: how close the step-down gets to the largest size the server accepts.
_STEP = MIB
#: a reduced outbox leaves at least this (and a quarter of what the server would take) unreserved.
MIN_HEADROOM_BYTES = 8 * MIB
#: the outbox stream's metadata key holding the size asked for (`--outbox-max-bytes`)
WANTED_BYTES_KEY = "bcd.dev/outbox-wanted-bytes"


class StreamSetupError(Exception):
    """A stream could not be made; the message says why and what to do."""


@dataclass(frozen=True)
class OutboxResult:
    """What the setup got for the outbox: its size, and a warning when smaller than asked."""

    max_bytes: int
    warning: str = ""


def outbox_config(subjects: NodeSubjects, max_bytes: int, max_msgs: int, wanted_bytes: int) -> StreamConfig:
    return StreamConfig(
        name=subjects.outbox_stream,
        description="bcd events waiting for upstream acknowledgement",
        subjects=[subjects.outbox_filter],
        retention=RetentionPolicy.LIMITS,
        discard=DiscardPolicy.NEW,
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW.total_seconds(),
        max_msgs=max_msgs,
        max_bytes=max_bytes,
        allow_direct=True,
        metadata={WANTED_BYTES_KEY: str(wanted_bytes)},
    )


def free_space(store_dir: Path | None) -> str:
    if store_dir is None:
        return "free space unknown"
    try:
        st = os.statvfs(store_dir)
    except OSError:
        return f"free space of {store_dir} unknown"
    return f"{st.f_bavail * st.f_frsize // MIB} MiB free on the node bus's store ({store_dir})"


async def ensure_outbox(
    nc: Client,
    subjects: NodeSubjects,
    *,
    max_bytes: int = DEFAULT_OUTBOX_MAX_BYTES,
    max_msgs: int = DEFAULT_OUTBOX_MAX_MSGS,
    min_bytes: int = MIN_OUTBOX_BYTES,
    store_dir: Path | None = None,
) -> OutboxResult:
    """Make or update the outbox at `max_bytes`, or smaller when the server refuses it.

    Never shrinks an existing outbox (that would delete its oldest events). Raises
    StreamSetupError when even `min_bytes` is refused; other server errors are raised."""
    js = nc.jetstream(timeout=5)
    min_bytes = min(min_bytes, max_bytes)
    try:
        info = await js.stream_info(subjects.outbox_stream)
    except NotFoundError:
        info = None

    async def attempt(size: int, exists: bool) -> bool:
        cfg = outbox_config(subjects, size, max_msgs, max_bytes)
        try:
            if exists:
                await js.update_stream(cfg)
            else:
                await js.add_stream(cfg)
        except APIError as exc:
            if exc.err_code == INSUFFICIENT_STORAGE:
                return False
            raise
        return True

    exists = info is not None
    have = max(0, info.config.max_bytes or 0) if info is not None else 0
    if await attempt(max(max_bytes, have), exists):
        return OutboxResult(max(max_bytes, have))
    # the largest size the server takes, to within _STEP, only ever growing the stream: an
    # existing one starts from the size it has, a new one from the floor; what an existing
    # stream holds is never cut
    floor = min_bytes if info is None else max(min_bytes, -(-(info.state.bytes or 0) // _STEP) * _STEP)
    if 0 < have < max_bytes and await attempt(have, True):
        ok = have
    elif floor < max_bytes and await attempt(floor, exists):
        ok = floor
    else:
        raise StreamSetupError(
            f"outbox refused: the node-bus JetStream has no room for even a {min_bytes // MIB} MiB outbox "
            f"(asked {max_bytes // MIB} MiB; {free_space(store_dir)}); events wait until it has: "
            "free space on the node bus's store or lower --outbox-max-bytes (BCD_OUTBOX_MAX_BYTES)"
        )
    bad = max_bytes
    while bad - ok > _STEP:
        mid = (ok + bad) // 2 // _STEP * _STEP
        if mid <= ok:
            break
        if await attempt(mid, True):
            ok = mid
        else:
            bad = mid
    # a refused update leaves the stream as it was: at `ok`, the largest size taken. Leave
    # the rest of the node room: its other streams (the inventory's bucket, an embedded
    # upstream's) reserve nothing and are refused once the store is fully reserved.
    target = max((ok - max(ok // 4, MIN_HEADROOM_BYTES)) // _STEP * _STEP, have, floor)
    if target < ok and await attempt(target, True):
        ok = target
    return OutboxResult(ok, reduced_warning(ok, max_bytes, free_space(store_dir)))


def reduced_warning(granted: int, wanted: int, free: str = "") -> str:
    """What the operator reads when the outbox is smaller than asked ("" when it is not)."""
    if granted >= wanted:
        return ""
    return (
        f"outbox reduced to {granted // MIB} MiB of the {wanted // MIB} MiB asked: the node-bus "
        f"JetStream refused the reservation (insufficient storage{'; ' + free if free else ''}; a quarter "
        "of what it would take is left to the node's other streams); "
        "free space on the node bus's store or set --outbox-max-bytes (BCD_OUTBOX_MAX_BYTES)"
    )


async def ensure_inventory_bucket(nc: Client, subjects: NodeSubjects) -> None:
    """The inventory's KV bucket, with direct gets (a bucket an older inventory made gets them)."""
    js = nc.jetstream(timeout=5)
    stream = f"KV_{subjects.inventory_bucket}"
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        await js.create_key_value(KeyValueConfig(bucket=subjects.inventory_bucket, history=1, description="bcd node inventory", direct=True))
        return
    if not info.config.allow_direct:
        info.config.allow_direct = True
        await js.update_stream(info.config)


async def ensure_streams(
    nc: Client,
    subjects: NodeSubjects,
    *,
    outbox_max_bytes: int = DEFAULT_OUTBOX_MAX_BYTES,
    outbox_max_msgs: int = DEFAULT_OUTBOX_MAX_MSGS,
    store_dir: Path | None = None,
) -> OutboxResult:
    """Every stream the node needs, as BUS_ADMIN_USER (`nc`); the outbox first."""
    outbox = await ensure_outbox(nc, subjects, max_bytes=outbox_max_bytes, max_msgs=outbox_max_msgs, store_dir=store_dir)
    await ensure_inventory_bucket(nc, subjects)
    return outbox


__all__ = [
    "DUPLICATE_WINDOW",
    "DEFAULT_OUTBOX_MAX_BYTES",
    "DEFAULT_OUTBOX_MAX_MSGS",
    "MIN_OUTBOX_BYTES",
    "MIN_HEADROOM_BYTES",
    "WANTED_BYTES_KEY",
    "OutboxResult",
    "StreamSetupError",
    "outbox_config",
    "reduced_warning",
    "ensure_outbox",
    "ensure_inventory_bucket",
    "ensure_streams",
]
