"""The upstream objects the control plane owns: the KV buckets and the BCD_EVENTS stream.

This module owns their configuration (history per bucket, direct gets, the
stream's subjects and dedupe window, replicas) and brings them into being at
start. They are created when missing, and an older setting (allow_direct off,
other subjects, another dedupe window) is fixed, so every later step (a put, the
consumer, a Hello lookup) can take them as given. It also keeps one KeyValue
handle per bucket.
"""

from __future__ import annotations

from datetime import timedelta

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.kv import KeyValue

from shared import logs
from shared.subjects import (
    UPSTREAM_EVENTS_STREAM,
    UPSTREAM_INVENTORY_BUCKET,
    UPSTREAM_NODES_BUCKET,
    UPSTREAM_NODESPECS_BUCKET,
    upstream_events_filter,
)

log = logs.get_logger("controlplane")

#: the stream's dedupe window: a node replaying its outbox within it is dropped by JetStream itself.
DUPLICATE_WINDOW = timedelta(hours=24)
#: spec history kept per node (nodes read only the last; the rest is for operators).
NODESPECS_HISTORY = 5
BUCKET_HISTORY: dict[str, int] = {
    UPSTREAM_NODESPECS_BUCKET: NODESPECS_HISTORY,
    UPSTREAM_NODES_BUCKET: 1,
    UPSTREAM_INVENTORY_BUCKET: 1,
}


class UpstreamObjects:
    """The buckets and the stream over one JetStream context, `replicas` copies of each it creates."""

    def __init__(self, js: JetStreamContext, replicas: int = 1) -> None:
        self.js = js
        #: JetStream replicas of the stream and buckets it creates (3 on a 3-server cluster).
        self.replicas = replicas
        self._kv: dict[str, KeyValue] = {}

    async def ensure(self) -> None:
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

    async def bucket(self, bucket: str) -> KeyValue:
        """The bucket's KeyValue handle (looked up once)."""
        kv = self._kv.get(bucket)
        if kv is None:
            kv = self._kv[bucket] = await self.js.key_value(bucket)
        return kv


__all__ = ["DUPLICATE_WINDOW", "NODESPECS_HISTORY", "BUCKET_HISTORY", "UpstreamObjects"]
