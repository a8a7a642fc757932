"""The signer micro service: `sign` and `sign_batch` (attested-report only) and `key` on the node bus.

`sign_batch` signs a pass's reports in one request (one round trip instead of
one per report); each body is stamped like a single `sign`: node id and boot
id by the signer itself, never taken from the request.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from shared.host import HostFactError, read_boot_id
from shared.runtime import Option, Refused, ServiceApp, ServiceContext, StartupError, main_for
from shared.schemas import (
    ATTESTED_REPORT_CODEC,
    EMPTY_CODEC,
    REPORT_PURPOSE,
    SIGN_BATCH_REPLY_CODEC,
    SIGN_BATCH_REQUEST_CODEC,
    SIGN_REQUEST_CODEC,
    SIGNER_KEY_CODEC,
    AttestedEvent,
    AttestedReport,
    Empty,
    ReportBody,
    SignBatchReply,
    SignBatchRequest,
    SignerKey,
    SignRequest,
)
from shared.signing import Ed25519PrivateKey, key_id, raw_public_key, sign_report

from .keys import KeyFileError, load_or_create_key


class SignerApp(ServiceApp):
    name = "signer"
    description = "signs attested reports with the node key"

    def __init__(self) -> None:
        self.key: Ed25519PrivateKey | None = None
        self.signatures: Counter | None = None

    def options(self) -> list[Option]:
        return [
            Option("--data-dir", "state directory of this node", default=Path("/var/lib/bcd"), type=Path),
            Option("--key-file", "node key (default <data-dir>/signer/node.key)", type=Path),
            Option("--proc-root", "root of /proc (boot id)", default=Path("/proc"), type=Path),
            Option("--fake-host", "fake host description file (boot id comes from it)", type=Path),
        ]

    def key_path(self, opts: Any) -> Path:
        return opts.key_file or Path(opts.data_dir) / "signer" / "node.key"

    def boot_id(self, opts: Any) -> str:
        return read_boot_id(opts.proc_root, opts.fake_host)

    async def setup(self, ctx: ServiceContext) -> None:
        path = self.key_path(ctx.opts)
        try:
            self.key, created = load_or_create_key(path)
            boot_id = self.boot_id(ctx.opts)
        except (KeyFileError, HostFactError) as exc:
            raise StartupError(str(exc)) from None
        kid = key_id(self.key)
        ctx.log.info("node key " + ("created" if created else "loaded"), key_file=str(path), key_id=kid, boot_id=boot_id)
        self.signatures = Counter(
            "bcd_signatures", "Sign requests by purpose and outcome", ["purpose", "outcome"], registry=ctx.registry
        )
        # every series from the start, so rate() and increase() see the first request
        for purpose, outcome in ((REPORT_PURPOSE, "signed"), (REPORT_PURPOSE, "error"), ("other", "refused")):
            self.signatures.labels(purpose=purpose, outcome=outcome)
        await ctx.endpoint("sign", ctx.subjects.signer_sign, lambda req: self.sign(ctx, req), SIGN_REQUEST_CODEC, reply=ATTESTED_REPORT_CODEC)
        await ctx.endpoint(
            "sign_batch", ctx.subjects.signer_sign_batch, lambda req: self.sign_batch(ctx, req), SIGN_BATCH_REQUEST_CODEC, reply=SIGN_BATCH_REPLY_CODEC
        )
        await ctx.endpoint("key", ctx.subjects.signer_key, lambda req: self.public(ctx, req), EMPTY_CODEC, allow_empty=True, reply=SIGNER_KEY_CODEC)

    def _stamp(self, ctx: ServiceContext, purpose: str) -> str:
        """Refuse a purpose this node does not sign; the boot id to stamp the bodies with."""
        assert self.signatures is not None
        if purpose != REPORT_PURPOSE:
            self.signatures.labels(purpose="other", outcome="refused").inc()
            raise Refused(f"purpose {purpose!r} is not signed by this node; only {REPORT_PURPOSE!r} is")
        try:
            return self.boot_id(ctx.opts)
        except HostFactError as exc:
            self.signatures.labels(purpose=purpose, outcome="error").inc()
            raise Refused(f"boot id unreadable: {exc}", code="503") from None

    def _sign_one(self, ctx: ServiceContext, boot_id: str, event_id: str, event: AttestedEvent) -> AttestedReport:
        assert self.key is not None
        body = ReportBody(node_id=ctx.opts.node_id, boot_id=boot_id, event_id=event_id, time=datetime.now(timezone.utc), event=event)
        return sign_report(self.key, body)

    async def sign(self, ctx: ServiceContext, req: SignRequest) -> AttestedReport:
        assert self.signatures is not None
        boot_id = self._stamp(ctx, req.purpose)
        report = self._sign_one(ctx, boot_id, req.event_id, req.event)
        self.signatures.labels(purpose=req.purpose, outcome="signed").inc()
        ctx.log.info("signed", event_id=req.event_id, event=type(req.event).__name__, allocation_id=req.event.allocation_id)
        return report

    async def sign_batch(self, ctx: ServiceContext, req: SignBatchRequest) -> SignBatchReply:
        assert self.signatures is not None
        boot_id = self._stamp(ctx, req.purpose)
        reports = [self._sign_one(ctx, boot_id, item.event_id, item.event) for item in req.items]
        self.signatures.labels(purpose=req.purpose, outcome="signed").inc(len(reports))
        # one line per batch: the event ids say what was signed (a batch holds at most SIGN_BATCH_MAX)
        ctx.log.info("signed batch", count=len(reports), event_ids=[item.event_id for item in req.items])
        return SignBatchReply(reports=reports)

    async def public(self, ctx: ServiceContext, _: Empty) -> SignerKey:
        assert self.key is not None
        return SignerKey(
            node_id=ctx.opts.node_id,
            public_key=raw_public_key(self.key),
            key_id=key_id(self.key),
            boot_id=self.boot_id(ctx.opts),
        )


main = main_for(SignerApp)
