"""The inventory micro service: scan through the vendor adapter, publish on change.

The current Inventory lives in the node-bus KV bucket
`bcd_node_<node_id>_inventory` under the key `<node_id>`; every change also
goes out as a plain message on `bcd.<node>.inventory.changed` so the
converger can run a pass. `get` answers the last scan; `rescan` scans now.
A periodic rescan catches what changed behind our back (a MIG instance
created, a driver rebound); a health check that no longer names a card on its
compute driver scans at once (the card fell off the bus, or left its driver).
The revision only moves when the content does.

Every scan is followed by an evaluation of each card's PhysicalGPU status
(gpustate.GpuTracker over the physicalgpu tables): the converger's claims
(`converger.claims`, asked at every evaluation; no answer reads
Indeterminate), the operator's exclusions and reclaims (endpoint `gpu`), the
vfio_switcher's result notices (`vfio_switcher.result`) and the timers those
rules need. A claims notice (`converger.claims_changed`, sent whenever a pass
changed the claims) changes no hardware: it is evaluated against the last
scan, not a new one (a driver switch comes with its own notice, and rescan).
The tracker's state is kept in `<data_dir>/inventory/gpus.json`.
MIG changes are the converger's to ask for: a whole layout (`mig_layout`, a
job it polls) or one step on one MIG instance (`mig_instance`, for DRA: create
a GPU instance at a placement, its compute instance, destroy them), never two
at once on one card (a lock per card); the card is scanned and published again
before the answer goes out, so the next `get` lists what the step made.
GPU sharing for DRA is the converger's to ask too (`sharing`): an MPS control
daemon started, stopped or listed under `--mps-root` (its directories are
`<mps-root>/<control>/pipe`, `.../log` and `.../shm`, built only from a control id
and, on a real host, made by root: the inventory hands root the daemon's spec in
`<mps-root>-specs`), or a
whole card's time slice set (under the card's lock); no rescan follows, nothing
the inventory lists changes. Every Inventory names the MPS root (`mps_root`, ""
with an adapter that keeps no daemons): a claim's CDI spec mounts the pipe directory.
Every change of a card's phase, managementState or a condition's status or
reason goes upstream as a `gpu` event through the node-bus outbox
(`Nats-Msg-Id` = a deterministic event id); events the outbox did not take
yet (the bus setup makes its stream) stay journaled and are retried.
While a timer runs (orphan grace, a reclaim, a disruption) the inventory
re-evaluates every `--gpu-tick` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, Histogram

from shared.runtime import Option, Refused, ServiceApp, ServiceCallError, ServiceContext, StartupError, call, guarded, main_for
from shared.schemas import (
    CLAIMS_CODEC,
    DIAG_REPLY_CODEC,
    DIAG_REQUEST_CODEC,
    EMPTY_CODEC,
    MIG_INSTANCE_REPLY_CODEC,
    MIG_INSTANCE_REQUEST_CODEC,
    MIG_LAYOUT_REPLY_CODEC,
    MIG_LAYOUT_REQUEST_CODEC,
    SHARING_STEP_REPLY_CODEC,
    SHARING_STEP_REQUEST_CODEC,
    GPU_REPLY_CODEC,
    GPU_REQUEST_CODEC,
    INVENTORY_CODEC,
    NODE_EVENT_CODEC,
    SWITCH_REPLY_CODEC,
    BadMessage,
    Claims,
    DiagReply,
    DiagRequest,
    Empty,
    Gpu,
    GpuReply,
    MigInstanceReply,
    MigInstanceRequest,
    MigLayoutReply,
    MigLayoutRequest,
    GpuRequest,
    Inventory,
    SchemaViolation,
    SharingStepReply,
    SharingStepRequest,
    SwitchReply,
)
from shared.schemas.bus import DIAG_RUN_S, MPS_LIST_MAX
from shared.schemas.inventory import health_text
from shared.schemas.common import PCI_RE, clip
from shared.jsutil import StreamMissing, last_value
from shared.subjects import MSG_ID_HEADER

from .adapters import AdapterError, AdapterUnavailable, load_adapter
from .adapters.base import Diagnosable, GpuSharer, HealthNotRead, HealthWatcher, MigInstancer, MigPartitioner, MigStepError, SharingStepError, mps_dirs
from .build import build_inventory, inventory_content_key
from .features import MIG_STRATEGIES, NFD_FEATURES_DIR, FeatureKeeper
from .gpustate import (
    claim_text,
    claims_by_card,
    GpuState,
    GpuStateStore,
    GpuTracker,
    StateFileError,
    reclaim_accepted,
    state_dir_from,
)
from .health import HealthPolicy
from .healthintake import HealthIntake, policy_from, watched_cards
from .healthwatch import HealthNews, HealthThread


#: finished jobs (diagnostics, MIG layout changes) kept for the converger's polls.
JOBS_KEPT = 64
#: the longest --mps-root the inventory can name (Inventory.mps_root)
MPS_ROOT_MAX = 1024


@dataclasses.dataclass
class Job:
    """A diagnostic or a MIG layout change the converger polls by its op id."""

    pci: str
    #: what was asked (the level, or (profiles, disable)): a poll for other arguments is an error
    args: Any
    result: Any = None
    task: asyncio.Task[Any] | None = None


class InventoryApp(ServiceApp):
    name = "inventory"
    description = "discovers GPUs, MIG instances, slots and host resources"

    def __init__(self) -> None:
        self.adapter: Any = None
        #: the last put into the bucket failed (said once)
        self.record_failing = False
        self.current: Inventory | None = None
        #: op id -> a diagnostic or MIG layout change started or done (the converger polls it)
        self.jobs: dict[str, Job] = {}
        #: PCI address -> the lock every MIG change of that card runs under (a layout, an instance step)
        self.mig_locks: dict[str, asyncio.Lock] = {}
        #: every MPS daemon step runs under this one (a list sees no start half done)
        self.mps_lock = asyncio.Lock()
        self.content_key: bytes = b""
        self.lock = asyncio.Lock()
        #: set after every evaluation: the run loop re-reads whether a timer runs.
        self.wake = asyncio.Event()
        self.tracker: GpuTracker | None = None
        self.store: GpuStateStore | None = None
        self.last_scan = 0.0
        #: the last successful scan, before its evaluation (what a claims notice is evaluated against).
        self.last_base: Inventory | None = None
        #: the last claims lookup failed (logged once per outage).
        self.claims_failing = False
        #: the outbox did not take the last event (logged once per outage).
        self.outbox_waiting = False
        #: the outbox stream has acknowledged a publish since this process started
        self.outbox_answered = False
        #: the last error writing the state file (logged once until it changes).
        self.save_error = ""
        #: the revision the per-GPU gauges show (None: not set yet).
        self.observed_revision: int | None = None
        #: GPU health (issue 30): the policy, the intake of the health thread's news, the thread
        self.health_policy = HealthPolicy()
        self.health: HealthIntake | None = None
        self.health_thread: HealthThread | None = None
        self.health_news: asyncio.Queue[HealthNews] = asyncio.Queue()
        self.health_task: asyncio.Task[None] | None = None
        #: the first check runs with the start scan, before its evaluation
        self.health_first = True
        #: cards on their compute driver the last health check did not name (each scanned for once)
        self.unseen: set[str] = set()
        #: the NFD feature file (features.py); None when --feature-dir is empty
        self.features: FeatureKeeper | None = None

    def options(self) -> list[Option]:
        return [
            Option("--adapter", "vendor adapter", default="nvidia", choices=("nvidia", "fakehw")),
            Option("--fake-host", "fake host description file (fakehw adapter)", type=Path),
            Option("--cdi-dir", "CDI spec directory", default=Path("/etc/cdi"), type=Path),
            Option("--sysfs-root", "root of /sys", default=Path("/sys"), type=Path),
            Option("--proc-root", "root of /proc", default=Path("/proc"), type=Path),
            Option("--rescan-interval", "seconds between periodic rescans", default=30.0, type=float),
            Option("--slots-per-gpu", "slots configured on each GPU not in MIG mode (nvidia adapter)", default=0, type=int),
            Option("--mps-pipe-dir", "MPS pipe directory (nvidia adapter)", default="/tmp/nvidia-mps"),
            Option(
                "--mps-root",
                "directory of the MPS control daemons bcd starts for DRA claims: <mps-root>/<control>/pipe, .../log and .../shm "
                "(root's; the inventory hands each daemon's spec over in <mps-root>-specs)",
                default=Path("/run/bcd/mps"),
                type=Path,
            ),
            Option("--data-dir", "state directory of this node; the inventory keeps <data-dir>/inventory/gpus.json", default=Path("/var/lib/bcd"), type=Path),
            Option("--gpu-tick", "seconds between evaluations while a GPU timer runs (orphan grace, reclaim, disruption)", default=5.0, type=float),
            Option("--claims-timeout", "seconds to wait for the converger's claims (no answer reads Indeterminate)", default=1.0, type=float),
            Option("--health-checks", "watch GPU health: XIDs, ECC errors, the card lost (on | off)", default="on", choices=("on", "off")),
            Option("--health-interval", "seconds between health checks (the library answers the card, remapped rows, ECC counters)", default=10.0, type=float),
            Option("--xid-ignore", "XIDs (comma list) that never make a card unhealthy, besides the application XIDs 13,31,43,45,68,109", default=""),
            Option("--xid-fatal", "XIDs (comma list) that make a card unhealthy even when ignored (e.g. 43)", default=""),
            Option("--ecc-uncorrectable-max", "uncorrectable ECC errors since the last reset a card may have and stay healthy", default=0, type=int),
            Option("--ecc-correctable-max", "correctable ECC errors since the last reset a card may have and stay healthy (-1: no limit)", default=-1, type=int),
            Option("--orphan-grace", "seconds a passthrough binding with no claim must last to read Orphaned (tests only; the seed says 120)", default=120.0, type=float),
            Option("--feature-dir", "NFD feature file directory the GPU labels go to (bcd-gpu in it); empty: off", default=str(NFD_FEATURES_DIR)),
            Option("--feature-mig-strategy", "GFD's MIG strategy the feature labels follow", default="mixed", choices=MIG_STRATEGIES),
            Option("--reclaim-timeout", "seconds after which a reclaim still not on the compute driver is Failed (tests only; the seed says 120)", default=120.0, type=float),
        ]

    # ------------------------------------------------------------------ setup

    async def setup(self, ctx: ServiceContext) -> None:
        o = ctx.opts
        if o.adapter == "fakehw" and o.fake_host is None:
            raise StartupError("--adapter fakehw needs --fake-host FILE (or BCD_FAKE_HOST)")
        if not Path(o.mps_root).is_absolute() or len(str(o.mps_root)) > MPS_ROOT_MAX:
            raise StartupError(f"--mps-root must be an absolute path of at most {MPS_ROOT_MAX} characters, not {str(o.mps_root)!r}")
        for flag, value in (("--gpu-tick", o.gpu_tick), ("--claims-timeout", o.claims_timeout), ("--orphan-grace", o.orphan_grace), ("--reclaim-timeout", o.reclaim_timeout)):
            if not value > 0:
                raise StartupError(f"{flag} must be a positive number of seconds, not {value}")
        try:
            self.health_policy = policy_from(o)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if o.feature_dir and not Path(o.feature_dir).is_absolute():
            raise StartupError(f"--feature-dir must be an absolute path (or empty: off), not {o.feature_dir!r}")
        self.features = FeatureKeeper(o.feature_dir, mig_strategy=o.feature_mig_strategy, log=ctx.log) if o.feature_dir else None
        self.store = GpuStateStore(state_dir_from(o.data_dir), log=ctx.log)
        state = GpuState()
        try:
            self.store.ensure_dir()
            state = self.store.load()
        except StateFileError as exc:
            # the inventory itself must keep running; requests that need the file are refused.
            ctx.log.error("GPU state cannot be kept; exclusions, reclaims and disruptions will not survive a restart", error=str(exc))
            self.save_error = str(exc)
        self.tracker = GpuTracker(
            o.node_id,
            orphan_grace=timedelta(seconds=o.orphan_grace),
            reclaim_timeout=timedelta(seconds=o.reclaim_timeout),
            state=state,
            health=self.health_policy,
        )
        ctx.metadata["state_file"] = str(self.store.path)
        try:
            self.adapter = load_adapter(
                o.adapter,
                fake_host=o.fake_host,
                cdi_dir=o.cdi_dir,
                sysfs_root=o.sysfs_root,
                proc_root=o.proc_root,
                slots_per_gpu=o.slots_per_gpu,
                mps_pipe_dir=o.mps_pipe_dir,
                # cards the nvidia adapter can no longer ask NVML about (vfio-pci) keep their uuid
                known_uuids=self.tracker.known_uuids() or None,
            )
            wrote = self.adapter.write_cdi_spec()
        except AdapterUnavailable as exc:
            raise StartupError(str(exc)) from None
        except AdapterError as exc:
            raise StartupError(f"{o.adapter} adapter: {exc}") from None
        if wrote:
            ctx.log.info("vendor CDI spec written", cdi_dir=str(o.cdi_dir))
        self.tracker.health_watched = self._watching()

        reg = ctx.registry
        self.m_scans = Counter("bcd_inventory_scans", "Inventory scans by outcome", ["outcome"], registry=reg)
        self.m_scan_seconds = Histogram("bcd_inventory_scan_duration_seconds", "Time one scan takes", registry=reg)
        self.m_revision = Gauge("bcd_inventory_revision", "Revision of the published inventory", registry=reg)
        self.m_gpus = Gauge("bcd_inventory_gpus", "GPUs on this node", registry=reg)
        self.m_atoms = Gauge("bcd_inventory_atoms", "Atoms on this node by kind", ["kind"], registry=reg)
        self.m_phase = Gauge("bcd_gpu_phase", "1 for each GPU's current PhysicalGPU phase", ["pci_address", "phase"], registry=reg)
        self.m_mstate = Gauge(
            "bcd_gpu_management_state", "1 for each GPU's current managementState", ["pci_address", "state"], registry=reg
        )
        # every condition of every card, e.g. Reconfiguring=True/DisruptionRequired (a reboot is needed)
        self.m_conditions = Gauge(
            "bcd_gpu_condition",
            "1 for each condition a GPU's PhysicalGPU status carries now",
            ["pci_address", "type", "status", "reason"],
            registry=reg,
        )
        self.m_reclaims = Counter(
            "bcd_gpu_reclaims", "Reclaim requests by outcome (held, admitted, refused, succeeded, failed)", ["outcome"], registry=reg
        )
        self.m_events = Counter("bcd_gpu_events", "GpuChanged events journaled for upstream", registry=reg)
        self.m_events_pending = Gauge("bcd_gpu_events_pending", "GpuChanged events waiting for the node outbox", registry=reg)
        self.m_claims_errors = Counter("bcd_gpu_claims_lookup_failures", "Failed converger.claims lookups", registry=reg)
        self.m_state_errors = Counter("bcd_gpu_state_write_failures", "Failed writes of gpus.json", registry=reg)
        for outcome in ("changed", "unchanged", "error"):
            self.m_scans.labels(outcome=outcome)
        self.health = HealthIntake(reg, ctx.log)

        # the bucket is the bus setup's (no service makes a stream): the inventory only puts
        # its one key and reads it back by direct get
        await self._load_last(ctx)
        # the start scan's GPU events go to the outbox after the endpoints are up: until
        # the bus setup has made the outbox, that send waits out its probe (1 s)
        await self.scan_and_publish(ctx, reason="start", flush=False)
        await ctx.endpoint("get", ctx.subjects.inventory_get, lambda _: self.get(), EMPTY_CODEC, allow_empty=True, reply=INVENTORY_CODEC)
        await ctx.endpoint("rescan", ctx.subjects.inventory_rescan, lambda _: self.rescan(ctx), EMPTY_CODEC, allow_empty=True, reply=INVENTORY_CODEC)
        await ctx.endpoint("gpu", ctx.subjects.inventory_gpu, lambda req: self.gpu_request(ctx, req), GPU_REQUEST_CODEC, reply=GPU_REPLY_CODEC)
        await ctx.endpoint("diag", ctx.subjects.inventory_diag, lambda req: self.diag(ctx, req), DIAG_REQUEST_CODEC, reply=DIAG_REPLY_CODEC)
        await ctx.endpoint(
            "mig_layout", ctx.subjects.inventory_mig_layout, lambda req: self.mig_layout(ctx, req), MIG_LAYOUT_REQUEST_CODEC, reply=MIG_LAYOUT_REPLY_CODEC
        )
        await ctx.endpoint(
            "mig_instance", ctx.subjects.inventory_mig_instance, lambda req: self.mig_instance(ctx, req), MIG_INSTANCE_REQUEST_CODEC, reply=MIG_INSTANCE_REPLY_CODEC
        )
        await ctx.endpoint(
            "sharing", ctx.subjects.inventory_sharing, lambda req: self.sharing(ctx, req), SHARING_STEP_REQUEST_CODEC, reply=SHARING_STEP_REPLY_CODEC
        )

        @guarded(ctx.log, "claims notice")
        async def on_claims(msg: Msg) -> None:
            try:
                claims = CLAIMS_CODEC.decode(msg.data)
            except BadMessage as exc:
                ctx.log.warning("ignoring an undecodable claims notice", error=str(exc))
                return
            # the host did not change with the claims: no rescan (the last scan is at most
            # --rescan-interval old; a switch's notice rescans)
            await self._refresh_logged(ctx, "claims changed", claims=claims, rescan=False)

        @guarded(ctx.log, "switch result")
        async def on_switch(msg: Msg) -> None:
            try:
                reply = SWITCH_REPLY_CODEC.decode(msg.data)
            except BadMessage as exc:
                ctx.log.warning("ignoring an undecodable switch result", error=str(exc))
                return
            ctx.log.info(
                "switch result",
                pci=reply.pci,
                target=reply.target,
                outcome=reply.outcome,
                reason=reply.reason,
                switch_event=reply.event,
                boot_id=reply.boot_id,
            )
            await self._refresh_logged(ctx, "switch result", switch=reply)
            if reply.target == "reset" and reply.ok and self._watching():
                # a reset is what clears a fatal XID: check the card again, and let a clean check clear it
                await self._recheck_logged(ctx, reply.pci, "reset")

        await ctx.nc.subscribe(ctx.subjects.converger_claims_changed, cb=on_claims)
        await ctx.nc.subscribe(ctx.subjects.vfio_result, cb=on_switch)
        await self._announce(ctx)
        async with self.lock:
            await self._flush_events(ctx)
        if self._watching():
            self.health_task = asyncio.create_task(self._health_loop(ctx), name="health news")
            self.health_thread = HealthThread(
                self.adapter, asyncio.get_running_loop(), self.health_news.put_nowait, interval=float(o.health_interval), log=ctx.log
            )
            self.health_thread.start()

    async def _announce(self, ctx: ServiceContext) -> None:
        """Say the inventory again now that `inventory.get` answers.

        The start scan's notice can go out before a peer listens, and a peer that asked
        meanwhile got no answer (the endpoints come after the scan): the converger's
        pass for a spec that came first would wait for its retry interval. Peers take
        a notice of a revision they hold as nothing new.
        """
        if self.current is None:
            return
        try:
            await ctx.nc.publish(ctx.subjects.inventory_changed, INVENTORY_CODEC.encode_valid(self.current))
        except Exception as exc:  # noqa: BLE001 - the next change notifies again
            ctx.log.warning("inventory not announced", error=str(exc) or type(exc).__name__)

    async def _load_last(self, ctx: ServiceContext) -> None:
        """Continue the revision of what an earlier run published."""
        try:
            value = await last_value(ctx.nc, ctx.subjects.inventory_key_get)
        except (StreamMissing, nats.errors.Error, asyncio.TimeoutError) as exc:
            ctx.log.warning("the last inventory could not be read; revisions start again", error=str(exc) or type(exc).__name__)
            return
        if value:
            try:
                last = INVENTORY_CODEC.decode(value)
            except BadMessage as exc:
                ctx.log.warning("ignoring unreadable inventory in KV", error=str(exc))
                return
            self.current = last
            self.content_key = inventory_content_key(last)

    async def _record(self, ctx: ServiceContext, payload: bytes) -> None:
        """Put the inventory into its bucket, where the next start continues its revision; the
        peers have it from the notice and `get`, so a bucket away costs only that (said once)."""
        try:
            await ctx.nc.jetstream(timeout=5.0).publish(ctx.subjects.inventory_key, payload)
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            if not self.record_failing:
                ctx.log.warning("the inventory's bucket took no put (the bus setup makes it)", error=str(exc) or type(exc).__name__)
            self.record_failing = True
            return
        if self.record_failing:
            ctx.log.info("the inventory's bucket takes puts again")
        self.record_failing = False

    # ------------------------------------------------------------------ work

    async def scan_and_publish(
        self,
        ctx: ServiceContext,
        reason: str,
        *,
        claims: Claims | None = None,
        switch: SwitchReply | None = None,
        rescan: bool = True,
        flush: bool = True,
    ) -> Inventory:
        """Scan, evaluate every card's PhysicalGPU status, publish on change, send the GPU events
        (`flush=False`: journaled only, sent by the caller).

        `claims` given (a claims_changed notice) are used as they are;
        otherwise the converger is asked. `switch` is the switcher's notice
        that caused this scan. `rescan=False` evaluates the last scan again
        (a scan happens when there is none yet).
        """
        async with self.lock:
            if claims is None:
                claims = await self._fetch_claims(ctx)
            scanned = rescan or self.last_base is None
            base = await self._scan(ctx, reason) if scanned else self.last_base
            if base is None:
                assert self.current is not None
                return self.current
            if switch is not None:
                assert self.tracker is not None
                self.tracker.note_switch(switch)
            if self.health_first:
                self.health_first = False
                await self._first_health_check(ctx, base)
            return await self._evaluate_and_publish(ctx, base, claims, reason, switch=switch, scanned=scanned, flush=flush)

    # ------------------------------------------------------------------ health (issue 30)

    def _watching(self) -> bool:
        return self.health_policy.enabled and isinstance(self.adapter, HealthWatcher)

    async def _first_health_check(self, ctx: ServiceContext, base: Inventory) -> None:
        """The start scan's check, so the first inventory published already says each card's health."""
        if not self._watching():
            return
        assert self.tracker is not None and self.health is not None
        try:
            checks = await asyncio.to_thread(self.adapter.check_health)
        except HealthNotRead as exc:
            ctx.log.warning("GPU health not read at start; the health thread tries again", error=str(exc))
            return
        except AdapterError as exc:
            news = HealthNews("gone", message=str(exc))
        else:
            news = HealthNews("checks", checks=checks)
        self.health.note(self.tracker, news, listed=watched_cards(base), boot_id=base.boot_id)

    async def _health_loop(self, ctx: ServiceContext) -> None:
        """The health thread's news, one at a time, on the event loop."""
        while True:
            news = await self.health_news.get()
            try:
                await self._on_health(ctx, news)
            except Exception:  # noqa: BLE001 - one bad piece of news never stops the watch
                ctx.log.exception("health news not handled", kind=news.kind)

    async def _on_health(self, ctx: ServiceContext, news: HealthNews) -> None:
        assert self.tracker is not None and self.health is not None
        async with self.lock:
            base = self.last_base
            if base is None:
                return
            watched = watched_cards(self.current or base)
            # a card on its compute driver the check does not name: the library lost sight of it (off
            # the bus, or moved to vfio-pci meanwhile): the scan says which, now, not at the next rescan
            # (once per card: one the library never reads, a card it cannot name, costs no scan per check)
            missed = set(watched) - {c.pci_address for c in news.checks} if news.kind == "checks" else self.unseen
            unseen = bool(missed - self.unseen)
            self.unseen = missed
            if not self.health.note(self.tracker, news, listed=watched, boot_id=base.boot_id) and not unseen:
                return  # an ignored XID, a fault seen again: nothing to publish (a storm costs no scan)
            self._save(ctx)  # the fault is on disk before anyone hears of it
            if news.kind == "events" or unseen:
                # an XID can come with the card leaving NVML: read the host again (the last scan when that fails)
                base = await self._scan(ctx, "health event") or base
            claims = await self._fetch_claims(ctx)
            await self._evaluate_and_publish(ctx, base, claims, f"health {news.kind}", scanned=news.kind == "events" or unseen)

    async def _recheck(self, ctx: ServiceContext, pci: str, *, clear: bool = True) -> tuple[bool, str, list[str]]:
        """Check one card now, letting a clean check clear its sticky faults when `clear` (the card
        was reset: after a reset bcd made, or on a free card an operator says was); (done, why
        not, cleared). Runs under self.lock."""
        assert self.tracker is not None
        try:
            checks = await asyncio.to_thread(self.adapter.check_health)
        except HealthNotRead as exc:
            return False, f"the check could not be made now: {exc}", []
        except AdapterError as exc:
            return False, f"the vendor library does not answer: {exc}", []
        check = next((c for c in checks if c.pci_address == pci), None)
        if check is None:
            return False, f"the vendor library does not see {pci} (not on its compute driver, or off the bus): nothing to check", []
        boot_id = self.last_base.boot_id if self.last_base is not None else ""
        _, cleared = self.tracker.note_health_checks([check], recheck=pci if clear else "", boot_id=boot_id)
        return True, "", cleared.get(pci, [])

    async def _recheck_logged(self, ctx: ServiceContext, pci: str, why: str) -> None:
        try:
            async with self.lock:
                done, problem, cleared = await self._recheck(ctx, pci)
                if not done:
                    ctx.log.warning("GPU not checked again", pci=pci, after=why, reason=problem)
                    return
                if cleared:
                    ctx.log.info("GPU healthy again: a clean check cleared its faults", pci=pci, after=why, cleared=cleared)
                base = self.last_base
                if base is not None:
                    await self._evaluate_and_publish(ctx, base, await self._fetch_claims(ctx), f"recheck after {why}", scanned=False)
        except Exception:  # noqa: BLE001 - a notice never kills the service
            ctx.log.exception("recheck failed", pci=pci)

    async def _refresh_logged(self, ctx: ServiceContext, reason: str, **kw: Any) -> None:
        try:
            await self.scan_and_publish(ctx, reason, **kw)
        except Exception:  # noqa: BLE001 - a notice never kills the service; the error is logged
            ctx.log.exception("scan failed", reason=reason)

    async def _fetch_claims(self, ctx: ServiceContext) -> Claims | None:
        """The converger's claims; None (Indeterminate, fail-closed) when it does not answer in time."""
        try:
            claims = await call(
                ctx.nc, ctx.subjects.converger_claims, Empty(), CLAIMS_CODEC, timeout=float(ctx.opts.claims_timeout)
            )
        except (ServiceCallError, nats.errors.Error, asyncio.TimeoutError, BadMessage) as exc:
            self.m_claims_errors.inc()
            if not self.claims_failing:
                ctx.log.warning(
                    "claims lookup failed; every card reads managementState Unknown (Indeterminate) until it answers",
                    subject=ctx.subjects.converger_claims,
                    error=str(exc) or type(exc).__name__,
                )
            self.claims_failing = True
            return None
        if self.claims_failing:
            ctx.log.info("claims lookup answers again", claims=len(claims.claims))
        self.claims_failing = False
        return claims

    async def _scan(self, ctx: ServiceContext, reason: str) -> Inventory | None:
        """One read of the host (no PhysicalGPU evaluation yet); None when it failed and a last inventory exists."""
        started = time.perf_counter()
        revision = self.current.revision if self.current else 0
        try:
            inv = await asyncio.to_thread(
                build_inventory,
                self.adapter,
                node_id=ctx.opts.node_id,
                revision=revision,
                now=datetime.now(timezone.utc),
                previous=self.current,
            )
        except (AdapterError, OSError) as exc:
            self.m_scans.labels(outcome="error").inc()
            ctx.log.error("scan failed; keeping the last inventory", reason=reason, error=str(exc))
            if self.current is None:
                raise
            return None
        finally:
            self.m_scan_seconds.observe(time.perf_counter() - started)
            self.last_scan = time.monotonic()
        self.last_base = msgspec.structs.replace(inv, adapter=ctx.opts.adapter, mps_root=self._mps_root(ctx))
        return self.last_base

    def _mps_root(self, ctx: ServiceContext) -> str:
        """The MPS root the inventory names (the converger's claim specs mount `<root>/<control>/pipe`);
        "" with an adapter that keeps no MPS daemons."""
        return str(ctx.opts.mps_root) if isinstance(self.adapter, GpuSharer) else ""

    async def _evaluate_and_publish(
        self,
        ctx: ServiceContext,
        base: Inventory,
        claims: Claims | None,
        reason: str,
        *,
        switch: SwitchReply | None = None,
        scanned: bool = True,
        flush: bool = True,
    ) -> Inventory:
        """`scanned`: `base` is a scan made for this evaluation (counted in bcd_inventory_scans)."""
        tracker = self.tracker
        assert tracker is not None
        revision = self.current.revision if self.current else 0
        result = tracker.evaluate(base, claims, switch=switch, known=self.current)
        for outcome in result.reclaims:
            self.m_reclaims.labels(outcome=outcome).inc()
        if result.new_boot:
            ctx.log.info("new boot id; orphan timers restart", boot_id=base.boot_id)
        for pe in result.events:
            e = pe.event
            ctx.log.info(
                "gpu changed",
                pci=e.pci_address,
                phase=e.phase,
                management_state=e.management_state,
                conditions={c.type: f"{c.status}/{c.reason}" for c in e.status.conditions},
                switch_event=e.reason,
                event_id=pe.event_id,
            )
        self.m_events.inc(len(result.events))
        self._save(ctx)
        inv = result.inventory
        key = inventory_content_key(inv)
        if self.current is not None and key == self.content_key:
            self._count_scan(scanned, "unchanged")
            inv = self.current
            if self.observed_revision != inv.revision:
                # after a restart the last inventory comes from KV: the gauges start from it
                self._observe(inv)
        else:
            inv = _with_revision(inv, revision + 1)
            try:
                payload = INVENTORY_CODEC.encode_valid(inv)
            except SchemaViolation as exc:
                # what the host reported does not fit the schema: the peers keep the last
                # good inventory rather than get one they cannot decode
                self._count_scan(scanned, "invalid")
                ctx.log.error("inventory not published: it breaks its own schema", reason=reason, error=str(exc))
                if flush:
                    await self._flush_events(ctx)
                return self.current if self.current is not None else inv
            await self._record(ctx, payload)
            await ctx.nc.publish(ctx.subjects.inventory_changed, payload)
            self.current, self.content_key = inv, key
            self._count_scan(scanned, "changed")
            self._observe(inv)
            ctx.log.info(
                "inventory published",
                reason=reason,
                revision=inv.revision,
                gpus=len(inv.gpus),
                atoms=len(inv.atoms),
                bucket=ctx.subjects.inventory_bucket,
            )
        if flush:
            await self._flush_events(ctx)
        if self.features is not None:
            self.features.sync(inv)
        self.wake.set()
        return inv

    def _count_scan(self, scanned: bool, outcome: str) -> None:
        """bcd_inventory_scans counts scans: an evaluation of the last scan again (a claims notice) is not one."""
        if scanned:
            self.m_scans.labels(outcome=outcome).inc()

    def _save(self, ctx: ServiceContext, *, strict: bool = False) -> None:
        """Write gpus.json when the tracker's state changed; errors are logged (raised when strict)."""
        assert self.store is not None and self.tracker is not None
        try:
            self.store.save(self.tracker.state)
        except StateFileError as exc:
            self.m_state_errors.inc()
            if str(exc) != self.save_error:
                ctx.log.error("cannot save the GPU state", error=str(exc))
                self.save_error = str(exc)
            if strict:
                raise
            return
        if self.save_error:
            ctx.log.info("GPU state saved again", path=str(self.store.path))
            self.save_error = ""

    async def _flush_events(self, ctx: ServiceContext) -> None:
        """Hand the journaled GPU events to the node-bus outbox, in order; stop at the first refusal."""
        tracker = self.tracker
        assert tracker is not None
        if tracker.dropped_events:
            ctx.log.error("GPU events dropped: the journal was full", dropped=tracker.dropped_events)
            tracker.dropped_events = 0
        # Until the bus setup has made the outbox stream a publish gets no PubAck and
        # would wait out the whole timeout each time: probe with a short one, use the
        # long one once the stream answered.
        js = ctx.nc.jetstream(timeout=1.0 if self.outbox_waiting or not self.outbox_answered else 5.0)
        subject = ctx.subjects.outbox_subject("gpu")
        sent = 0
        for pe in list(tracker.outbox):
            try:
                payload = NODE_EVENT_CODEC.encode_valid(pe.event)
            except SchemaViolation as exc:
                # never sendable (upstream would refuse it), and it would block every
                # event after it: dropped, loudly
                ctx.log.error("GPU event dropped: it breaks its own schema", event_id=pe.event_id, error=str(exc))
                tracker.outbox.remove(pe)
                continue
            try:
                await js.publish(subject, payload, headers={MSG_ID_HEADER: pe.event_id})
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                if not self.outbox_waiting:
                    ctx.log.warning(
                        "GPU events wait for the node outbox (the bus setup makes it); retrying",
                        stream=ctx.subjects.outbox_stream,
                        queued=len(tracker.outbox) - sent,
                        error=str(exc) or type(exc).__name__,
                    )
                self.outbox_waiting = True
                break
            sent += 1
            self.outbox_answered = True
        if sent:
            tracker.sent(sent)
            self._save(ctx)
            # the bridge reads the outbox when told (it has no consumer to be woken by)
            with contextlib.suppress(nats.errors.Error):
                await ctx.nc.publish(ctx.subjects.inventory_journaled, b"")
            if self.outbox_waiting and not tracker.outbox:
                ctx.log.info("GPU events reach the node outbox again")
        if not tracker.outbox:
            self.outbox_waiting = False
        self.m_events_pending.set(len(tracker.outbox))

    def _observe(self, inv: Inventory) -> None:
        self.observed_revision = inv.revision
        self.m_revision.set(inv.revision)
        self.m_gpus.set(len(inv.gpus))
        for kind in ("gpu", "mig", "slot"):
            self.m_atoms.labels(kind=kind).set(sum(1 for a in inv.atoms if a.kind == kind))
        self.m_phase.clear()
        self.m_mstate.clear()
        self.m_conditions.clear()
        for g in inv.gpus:
            self.m_phase.labels(pci_address=g.pci_address, phase=g.status.phase).set(1)
            self.m_mstate.labels(pci_address=g.pci_address, state=g.status.driver_binding.management_state).set(1)
            for c in g.status.conditions:
                self.m_conditions.labels(pci_address=g.pci_address, type=c.type, status=c.status, reason=c.reason).set(1)

    # ------------------------------------------------------------------ endpoints

    async def diag(self, ctx: ServiceContext, req: DiagRequest) -> DiagReply:
        """The vendor's diagnostic on one listed card, as a job: started by the first request of its
        op id (answered Running at once), its result answered to a poll. A poll for an id this
        process does not know (it restarted meanwhile) is an Error, so the converger never waits
        for a run that died with an earlier inventory."""
        job = self.jobs.get(req.op_id) if req.op_id else None
        if job is not None:
            if job.pci != req.pci or job.args != req.level:
                return DiagReply(pci=req.pci, level=req.level, outcome="Error", message=f"diagnostic {req.op_id} is of another card or level")
            return job.result or DiagReply(pci=req.pci, level=req.level, outcome="Running", message=f"diagnostic {req.op_id} runs")
        if req.poll:
            return DiagReply(
                pci=req.pci, level=req.level, outcome="Error",
                message=f"the inventory knows no diagnostic {req.op_id or '(no id)'}: it restarted while it ran, so there is no result",
            )
        if not self._listed(req.pci):
            return DiagReply(pci=req.pci, level=req.level, outcome="Error", message=f"the inventory lists no GPU at {req.pci}")
        if not isinstance(self.adapter, Diagnosable):
            return DiagReply(pci=req.pci, level=req.level, outcome="NotInstalled", message=f"the {ctx.opts.adapter} adapter runs no diagnostics")
        job = Job(pci=req.pci, args=req.level)
        if not req.op_id:
            # no id to poll with: answered when done
            return await self._run_diag(ctx, job)
        self._keep(req.op_id, job)
        job.task = asyncio.create_task(self._run_diag(ctx, job), name=f"diag {req.op_id}")
        return DiagReply(pci=req.pci, level=req.level, outcome="Running", message=f"diagnostic {req.op_id} started")

    async def mig_layout(self, ctx: ServiceContext, req: MigLayoutRequest) -> MigLayoutReply:
        """Make one listed card's MIG layout this, as a job (like `diag`): started by the first request of
        its op id, polled after. The card is scanned again when it is done; a mode change that waits
        for a GPU reset goes the DisruptionRequired way (Reconfiguring on the card)."""
        layout = (tuple(req.profiles), req.disable)
        job = self.jobs.get(req.op_id) if req.op_id else None
        if job is not None:
            if job.pci != req.pci or job.args != layout:
                return MigLayoutReply(pci=req.pci, outcome="Error", message=f"MIG layout change {req.op_id} is of another card or layout")
            return job.result or MigLayoutReply(pci=req.pci, outcome="Running", message=f"MIG layout change {req.op_id} runs")
        if req.poll:
            return MigLayoutReply(
                pci=req.pci, outcome="Error", left="unknown",
                message=f"the inventory knows no MIG layout change {req.op_id or '(no id)'}: it restarted while it ran; the card is read again",
            )
        if not self._listed(req.pci):
            return MigLayoutReply(pci=req.pci, outcome="Error", message=f"the inventory lists no GPU at {req.pci}", left="as before")
        if not isinstance(self.adapter, MigPartitioner):
            return MigLayoutReply(pci=req.pci, outcome="NotSupported", message=f"the {ctx.opts.adapter} adapter changes no MIG layout", left="as before")
        job = Job(pci=req.pci, args=layout)
        if req.op_id:
            self._keep(req.op_id, job)
        job.task = asyncio.create_task(self._run_mig(ctx, job), name=f"mig layout {req.op_id}")
        if not req.op_id:
            return await job.task
        return MigLayoutReply(pci=req.pci, outcome="Running", message=f"MIG layout change {req.op_id} started")

    def _listed(self, pci: str) -> bool:
        return self.current is not None and any(g.pci_address == pci for g in self.current.gpus)

    def _keep(self, op_id: str, job: Job) -> None:
        """Keep a job for its polls; the oldest finished ones go beyond JOBS_KEPT."""
        self.jobs[op_id] = job
        while len(self.jobs) > JOBS_KEPT:
            oldest = next(iter(self.jobs))
            if self.jobs[oldest].result is None:
                break
            del self.jobs[oldest]

    def _mig_lock(self, pci: str) -> asyncio.Lock:
        return self.mig_locks.setdefault(pci, asyncio.Lock())

    async def _run_mig(self, ctx: ServiceContext, job: Job) -> MigLayoutReply:
        async with self._mig_lock(job.pci):
            return await self._run_mig_locked(ctx, job)

    async def _run_mig_locked(self, ctx: ServiceContext, job: Job) -> MigLayoutReply:
        profiles, disable = job.args
        ctx.log.info("MIG layout change started", pci=job.pci, profiles=list(profiles), disable=disable)
        result = await _in_daemon_thread(lambda: self.adapter.apply_mig_layout(job.pci, profiles, disable=disable))
        (ctx.log.info if result.outcome == "Applied" else ctx.log.warning)(
            "MIG layout change done", pci=job.pci, outcome=result.outcome, detail=result.message, left=result.left
        )
        reply = MigLayoutReply(pci=job.pci, outcome=result.outcome, message=clip(result.message), left=result.left)
        # the card as it is now (new MIG atoms, or what a failure left), before the converger hears the result
        disruption = None
        if result.outcome == "DisruptionRequired":
            disruption = SwitchReply(
                pci=job.pci, target="mig-layout", outcome="DisruptionRequired", reason="MigModePending",
                message=clip(result.message), boot_id=self.current.boot_id if self.current is not None else "", at=datetime.now(timezone.utc),
            )
        try:
            await self.scan_and_publish(ctx, "MIG layout changed", switch=disruption)
        except Exception:  # noqa: BLE001 - the periodic scan sees it; the result stands
            ctx.log.exception("scan after a MIG layout change failed")
        job.result = reply
        return reply

    async def mig_instance(self, ctx: ServiceContext, req: MigInstanceRequest) -> MigInstanceReply:
        """One MIG instance step on one listed card in MIG mode (DRA; the converger journaled it before asking).

        Answered when done, after the card was scanned and the inventory published again: the
        converger's next `get` lists what the step made (or what a failure left). Every refusal is
        an answer (outcome refused / not-supported), never an error.
        """

        def answer(outcome: str, message: str, *, gi: int | None = req.gi, ci: int | None = req.ci, uuid: str = "") -> MigInstanceReply:
            (ctx.log.info if outcome == "done" else ctx.log.warning)(
                "MIG instance step answered", step=req.step, pci=req.pci, owner=req.owner, outcome=outcome, gi=gi, ci=ci, uuid=uuid, detail=message
            )
            return MigInstanceReply(pci=req.pci, step=req.step, outcome=outcome, message=clip(message), gi=gi, ci=ci, uuid=uuid)

        if not isinstance(self.adapter, MigInstancer):
            return answer("not-supported", f"the {ctx.opts.adapter} adapter makes no MIG instances")
        card = next((g for g in self.current.gpus if g.pci_address == req.pci), None) if self.current is not None else None
        if card is None:
            return answer("refused", f"the inventory lists no GPU at {req.pci}")
        if not card.mig_mode:
            return answer("refused", f"{req.pci} is not in MIG mode")
        if card.status.driver_binding.mode != "Compute":
            return answer("refused", f"{req.pci} is not on its compute driver ({card.driver or 'no driver'})")
        missing = _mig_step_missing(req)
        if missing:
            return answer("refused", f"{req.step} needs {missing}")
        ctx.log.info("MIG instance step started", step=req.step, pci=req.pci, owner=req.owner, profile=req.profile, start=req.start, gi=req.gi, ci=req.ci)
        async with self._mig_lock(req.pci):
            reply = await self._mig_step(ctx, req, answer)
            # the card as the step left it, published before the converger hears the result
            try:
                await self.scan_and_publish(ctx, f"MIG {req.step}")
            except Exception:  # noqa: BLE001 - the periodic scan sees it; the result stands
                ctx.log.exception("scan after a MIG instance step failed", step=req.step, pci=req.pci)
        return reply

    async def _mig_step(self, ctx: ServiceContext, req: MigInstanceRequest, answer: Any) -> MigInstanceReply:
        adapter, pci = self.adapter, req.pci
        try:
            if req.step == "create-gi":
                start = req.start
                gi = await _in_daemon_thread(adapter.create_gpu_instance, pci, req.profile, start)
                return answer("done", f"GPU instance {gi} ({req.profile} at {start}) made on {pci}", gi=gi, ci=None)
            if req.step == "create-ci":
                made = await _in_daemon_thread(adapter.create_compute_instance, pci, req.gi)
                return answer("done", f"compute instance {made.ci} of GPU instance {made.gi} made on {pci}", gi=made.gi, ci=made.ci, uuid=made.uuid)
            if req.step == "destroy-ci":
                await _in_daemon_thread(adapter.destroy_compute_instance, pci, req.gi, req.ci)
                return answer("done", f"compute instance {req.ci} of GPU instance {req.gi} destroyed on {pci}")
            await _in_daemon_thread(adapter.destroy_gpu_instance, pci, req.gi)
            return answer("done", f"GPU instance {req.gi} destroyed on {pci}")
        except MigStepError as exc:
            return answer(exc.outcome, str(exc))
        except Exception as exc:  # noqa: BLE001 - an adapter bug answers failed; the service stays up
            ctx.log.exception("MIG instance step raised", step=req.step, pci=pci)
            return answer("failed", f"{req.step} on {pci} failed: {exc or type(exc).__name__}")

    async def sharing(self, ctx: ServiceContext, req: SharingStepRequest) -> SharingStepReply:
        """One sharing step (DRA; the converger journaled it before asking): an MPS daemon or a time slice.

        Every refusal is an answer (outcome refused / not-supported), never an error. MPS steps run
        one at a time; a time slice under its card's lock (the one MIG changes take).
        """

        def answer(outcome: str, message: str, controls: list[str] | None = None) -> SharingStepReply:
            (ctx.log.info if outcome == "done" else ctx.log.warning)(
                "sharing step answered", step=req.step, owner=req.owner, control=_control_of(req), pci=req.pci, outcome=outcome, detail=message
            )
            return SharingStepReply(step=req.step, outcome=outcome, message=clip(message), controls=controls or [])

        if not isinstance(self.adapter, GpuSharer):
            return answer("not-supported", f"the {ctx.opts.adapter} adapter shares no GPUs")
        refusal = _sharing_missing(req) or self._sharing_refusal(req)
        if refusal:
            return answer("refused", refusal)
        ctx.log.info(
            "sharing step started", step=req.step, owner=req.owner, control=_control_of(req), pci=req.pci,
            uuids=list(req.mps.uuids) if req.mps is not None else [], interval=req.interval if req.step == "timeslice-set" else None,
        )
        lock = self._mig_lock(req.pci) if req.step == "timeslice-set" and req.pci is not None else self.mps_lock
        async with lock:
            return await self._sharing_step(ctx, req, answer)

    def _sharing_refusal(self, req: SharingStepRequest) -> str:
        """Why the step is wrong for the cards the inventory lists ("" when it is not)."""
        cards = {g.pci_address: g for g in self.current.gpus} if self.current is not None else {}
        if req.step == "timeslice-set":
            card = cards.get(req.pci or "")
            if card is None:
                return f"the inventory lists no GPU at {req.pci}"
            if card.mig_mode:
                return f"{req.pci} is in MIG mode: time slices are for whole cards"
            if card.status.driver_binding.mode != "Compute" or not card.uuid:
                return f"{req.pci} is not on its compute driver ({card.driver or 'no driver'})"
            return ""
        if req.step == "mps-start" and req.mps is not None:
            return _mps_devices_refusal(req.mps.uuids, req.mps.pinned_memory, cards.values())
        return ""

    async def _sharing_step(self, ctx: ServiceContext, req: SharingStepRequest, answer: Any) -> SharingStepReply:
        adapter, root = self.adapter, Path(ctx.opts.mps_root)
        try:
            if req.step == "mps-list":
                controls = await _in_daemon_thread(adapter.mps_list, root)
                return answer("done", _listed_message(controls, root), controls[:MPS_LIST_MAX])
            if req.step == "timeslice-set":
                card = next(g for g in self.current.gpus if g.pci_address == req.pci)
                await _in_daemon_thread(adapter.set_timeslice, req.pci, card.uuid, req.interval)
                return answer("done", f"time slice of {req.pci} set to {req.interval}")
            control = _control_of(req)
            pipe_dir, log_dir = mps_dirs(root, control)
            if req.step == "mps-start":
                await _in_daemon_thread(adapter.mps_start, req.mps, pipe_dir, log_dir)
                return answer("done", f"MPS daemon {control} runs for {', '.join(req.mps.uuids)} (pipe directory {pipe_dir})")
            await _in_daemon_thread(adapter.mps_stop, control, pipe_dir, log_dir)
            return answer("done", f"MPS daemon {control} stopped, {root / control} removed")
        except SharingStepError as exc:
            return answer(exc.outcome, str(exc))
        except ValueError as exc:  # a control id mps_dirs would not build a path of
            return answer("refused", str(exc))
        except Exception as exc:  # noqa: BLE001 - an adapter bug answers failed; the service stays up
            ctx.log.exception("sharing step raised", step=req.step)
            return answer("failed", f"{req.step} failed: {exc or type(exc).__name__}")

    async def _run_diag(self, ctx: ServiceContext, job: Job) -> DiagReply:
        level = job.args
        ctx.log.info("diagnostic started", pci=job.pci, level=level)
        result = await _in_daemon_thread(self.adapter.run_diag, job.pci, level, DIAG_RUN_S.get(level, 3600.0))
        (ctx.log.info if result.outcome == "Passed" else ctx.log.warning)(
            "diagnostic done", pci=job.pci, level=level, outcome=result.outcome, detail=result.message, failures=list(result.failures)
        )
        job.result = DiagReply(
            pci=job.pci, level=level, outcome=result.outcome, message=clip(result.message), failures=[clip(f) for f in result.failures[:64]]
        )
        return job.result

    async def gpu_request(self, ctx: ServiceContext, req: GpuRequest) -> GpuReply:
        """`bcd gpu exclude|include|reclaim <pci>`: recorded in gpus.json first, then evaluated."""
        pci, action = req.pci, req.action

        def refuse(message: str, gpu: Gpu | None = None) -> GpuReply:
            ctx.log.info("gpu request refused", action=action, pci=pci, reason=message)
            return GpuReply(pci=pci, action=action, accepted=False, message=message, gpu=gpu)

        if not PCI_RE.match(pci):
            return refuse(
                f"{pci!r} is not a canonical PCI address (domain:bus:device.function in lowercase hex, e.g. 0000:3b:00.0)"
            )
        tracker = self.tracker
        assert tracker is not None
        async with self.lock:
            claims = await self._fetch_claims(ctx)
            base = await self._scan(ctx, f"gpu {action}")
            if base is None:
                raise Refused("the host cannot be scanned right now; try again", code="503")
            # a card off the bus is not in the scan but still listed (lost): it is asked about too
            listed = any(g.pci_address == pci for g in base.gpus) or self._listed(pci)
            record = tracker.card(pci)
            if not listed and not (action == "include" and record is not None and record.excluded):
                return refuse(f"no GPU at {pci} in this node's inventory")
            snapshot = tracker.snapshot()
            if action == "recheck":
                return await self._recheck_request(ctx, pci, base, claims, snapshot)
            if action == "exclude":
                changed = tracker.exclude(pci)
                note = "excluded" if changed else "already excluded"
            elif action == "include":
                changed = tracker.include(pci)
                note = "exclusion lifted" if changed else "not excluded"
            else:
                changed = tracker.request_reclaim(pci)
                note = "" if changed else "a reclaim of this card is already pending"
            if changed:
                # intent first: a request that cannot be recorded is not taken
                try:
                    self._save(ctx, strict=True)
                except StateFileError as exc:
                    tracker.restore(snapshot)
                    return refuse(f"cannot record the request: {exc}")
            inv = await self._evaluate_and_publish(ctx, base, claims, f"gpu {action}")
        card = next((g for g in inv.gpus if g.pci_address == pci), None)
        if action == "reclaim":
            condition = tracker.take_answer(pci, card.status if card is not None else None)
            text = condition.message if condition is not None else "no Reclaim condition"
            accepted = not changed or reclaim_accepted(condition)
            message = f"{note}: {text}" if note else text
            if not accepted:
                return refuse(message, card)
        else:
            accepted = True
            state = card.status.driver_binding.management_state if card is not None else "not listed"
            message = f"{note}; managementState is {state}"
        ctx.log.info("gpu request", action=action, pci=pci, accepted=accepted, message=message)
        return GpuReply(pci=pci, action=action, accepted=accepted, message=message, gpu=card)

    async def _recheck_request(self, ctx: ServiceContext, pci: str, base: Inventory, claims: Claims | None, snapshot: bytes) -> GpuReply:
        """`bcd gpu recheck <pci>` (under self.lock): accepted when the card reads healthy after the check."""
        tracker = self.tracker
        assert tracker is not None
        if not self._watching():
            why = "health checks are off (--health-checks off)" if not self.health_policy.enabled else f"the {ctx.opts.adapter} adapter cannot watch GPU health"
            return GpuReply(pci=pci, action="recheck", accepted=False, message=f"not checked: {why}")
        # a reset is what a sticky fault waits for, and no reset happens to a held card (bcd refuses
        # it, the driver refuses a reset of a card in use): a recheck of a held card checks and says,
        # but keeps its sticky faults. Claims not known count as held (fail-closed).
        holders = claims_by_card(claims).get(pci, []) if claims is not None else None
        held_by = claim_text(holders) if holders else ("someone (the converger's claims did not answer)" if holders is None else "")
        done, problem, cleared = await self._recheck(ctx, pci, clear=not held_by)
        if not done:
            return GpuReply(pci=pci, action="recheck", accepted=False, message=f"not checked: {problem}")
        try:
            self._save(ctx, strict=True)
        except StateFileError as exc:
            tracker.restore(snapshot)
            return GpuReply(pci=pci, action="recheck", accepted=False, message=f"cannot record the check: {exc}")
        inv = await self._evaluate_and_publish(ctx, base, claims, "gpu recheck")
        card = next((g for g in inv.gpus if g.pci_address == pci), None)
        health = card.status.health() if card is not None else None
        said = health_text(health) if health is not None else "no Healthy condition"
        accepted = health is not None and health.status != "False"
        kept = tracker.sticky_faults(pci)
        if held_by and kept:
            message = (
                f"kept {', '.join(kept)}: the card is held ({held_by}), so it cannot have been reset; "
                "sticky faults stay until the hold is released and the card is reset (bcd gpu reset) or the node rebooted; " + said
            )
        else:
            message = (f"cleared {', '.join(cleared)}; " if cleared else "nothing cleared; ") + said
            if not accepted:
                message += " (a reset that worked and a clean check clear a fatal fault; a pending row remap needs the reset)"
        ctx.log.info("gpu request", action="recheck", pci=pci, accepted=accepted, message=message)
        return GpuReply(pci=pci, action="recheck", accepted=accepted, message=message, gpu=card)

    async def get(self) -> Inventory:
        if self.current is None:
            raise Refused("no inventory yet", code="503")
        return self.current

    async def rescan(self, ctx: ServiceContext) -> Inventory:
        return await self.scan_and_publish(ctx, reason="request")

    async def run(self, ctx: ServiceContext) -> None:
        """Rescan every --rescan-interval, or every --gpu-tick while a GPU timer runs."""
        interval = max(0.1, float(ctx.opts.rescan_interval))
        tick = max(0.05, float(ctx.opts.gpu_tick))
        while not ctx.stopping.is_set():
            self.wake.clear()
            assert self.tracker is not None
            every = min(interval, tick) if self.tracker.timers_running() else interval
            delay = self.last_scan + every - time.monotonic()
            if delay > 0 and await self._sleep(ctx, delay):
                continue  # stopping, or an evaluation elsewhere may have started a timer
            if ctx.stopping.is_set():
                break
            reason = "gpu tick" if every < interval else "periodic"
            try:
                await self.scan_and_publish(ctx, reason=reason)
            except Exception:  # noqa: BLE001 - keep scanning; the error is logged
                ctx.log.exception("periodic scan failed")
                self.last_scan = time.monotonic()

    async def _sleep(self, ctx: ServiceContext, delay: float) -> bool:
        """Wait `delay` seconds; True when woken early (stopping, or an evaluation happened)."""
        waiters = [asyncio.ensure_future(ctx.stopping.wait()), asyncio.ensure_future(self.wake.wait())]
        try:
            done, _ = await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            for w in waiters:
                with contextlib.suppress(asyncio.CancelledError):
                    await w
        return bool(done)

    async def close(self, ctx: ServiceContext) -> None:
        if self.health_thread is not None:
            await asyncio.to_thread(self.health_thread.stop)
        if self.health_task is not None:
            self.health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.health_task
        # a diagnostic still running is not waited for (its thread is a daemon); the
        # converger's next poll finds no such job and ends the operation as an Error
        jobs = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for task in jobs:
            task.cancel()
        for task in jobs:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.adapter is not None:
            self.adapter.close()
        if self.features is not None:
            self.features.stop()  # bcd no longer speaks for the node's GPUs


async def _in_daemon_thread(fn: Any, *args: Any) -> Any:
    """fn(*args) in a daemon thread: a stop of the service never waits for it (a diagnostic can take an hour)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def worker() -> None:
        try:
            value, ok = fn(*args), True
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            value, ok = exc, False
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=worker, name="bcd-diagnostic", daemon=True).start()
    return await done


def _mig_step_missing(req: MigInstanceRequest) -> str:
    """What a MIG instance step needs and the request lacks ("" when nothing)."""
    needs = {"create-gi": ("profile", "start"), "create-ci": ("gi",), "destroy-ci": ("gi", "ci"), "destroy-gi": ("gi",)}[req.step]
    return " and ".join(name for name in needs if getattr(req, name) in (None, ""))


def _control_of(req: SharingStepRequest) -> str:
    """The MPS control id a step is about ("" for none)."""
    return req.mps.control if req.step == "mps-start" and req.mps is not None else req.control


def _sharing_missing(req: SharingStepRequest) -> str:
    """A sharing step that lacks what it needs, named ("" when nothing)."""
    needs = {"mps-start": ("mps", req.mps is not None), "mps-stop": ("control", bool(req.control)), "timeslice-set": ("pci", req.pci is not None)}
    field, given = needs.get(req.step, ("", True))
    return "" if given else f"{req.step} needs {field}"


def _mps_devices_refusal(uuids: list[str], pinned: dict[str, int], cards: Any) -> str:
    """Why an MPS daemon may not serve these devices ("" when it may): each must be a listed card's
    uuid (a card not in MIG mode) or one of its MIG devices', on its compute driver, named once."""
    devices: dict[str, Gpu] = {}
    whole: dict[str, Gpu] = {}
    for card in cards:
        whole[card.uuid] = card
        devices.update({m.uuid: card for m in card.mig_instances if m.uuid})
    for uuid in uuids:
        card = devices.get(uuid) or whole.get(uuid)
        if not uuid or card is None:
            return f"the inventory lists no GPU or MIG device {uuid}"
        if uuid in whole and card.mig_mode:
            return f"{uuid} ({card.pci_address}) is in MIG mode: an MPS daemon serves its MIG devices, not the card"
        if card.status.driver_binding.mode != "Compute":
            return f"{card.pci_address} is not on its compute driver ({card.driver or 'no driver'})"
    if len(set(uuids)) != len(uuids):
        return "an MPS daemon serves each device once: a uuid is named twice"
    strays = sorted(set(pinned) - set(uuids))
    if strays:
        return f"a pinned memory limit is for a device the daemon does not serve: {', '.join(strays)}"
    return ""


def _listed_message(controls: list[str], root: Path) -> str:
    if len(controls) > MPS_LIST_MAX:
        return f"{len(controls)} MPS daemon(s) under {root}; the first {MPS_LIST_MAX} are listed"
    return f"{len(controls)} MPS daemon(s) under {root}"


def _with_revision(inv: Inventory, revision: int) -> Inventory:
    return msgspec.structs.replace(inv, revision=revision)


main = main_for(InventoryApp)

__all__ = ["InventoryApp", "main"]
