"""The inventory micro service: the wiring of its rooms, each a module of its own.

The current Inventory lives in the node-bus KV bucket
`bcd_node_<node_id>_inventory` under the key `<node_id>`; every change also
goes out as a plain message on `bcd.<node>.inventory.changed` so the
converger can run a pass. `get` answers the last scan; `rescan` scans now.
A periodic rescan catches what changed behind our back (a MIG instance
created, a driver rebound); while a timer runs (orphan grace, a reclaim, a
disruption) the inventory re-evaluates every `--gpu-tick` seconds. The
revision only moves when the content does.

`InventoryApp` owns the options, the setup (the GPU state file and its
tracker, the adapter, each room built with what it needs, the endpoints and
subscriptions), the run loop of periodic rescans and the stop. The work is
done in the rooms:

- facts.py: what the rooms share (the adapter, the tracker, the last scan and inventory, the locks);
- publishing.py: scan, evaluate every card's PhysicalGPU status (gpustate.GpuTracker over the
  physicalgpu tables: the converger's claims, asked at every evaluation, no answer reads
  Indeterminate; the operator's exclusions and reclaims; the switcher's results; the timers those
  rules need), save gpus.json, publish on change, send every change of a card's phase,
  managementState or condition upstream as a `gpu` event through the node-bus outbox
  (`Nats-Msg-Id` = a deterministic event id; what the outbox did not take stays journaled and is
  retried); metrics.py: its Prometheus metrics;
- healthdesk.py: GPU health the inventory checks itself (the start scan's check, a recheck) and
  the health thread's news (healthwatch.py) through healthintake.py, evaluated and published; a
  check that no longer names a card on its compute driver scans at once;
- gpurequests.py: the operator's `gpu` requests (exclude, include, reclaim, recheck);
- migjobs.py: MIG changes the converger asks for: a whole layout (`mig_layout`, a job it polls)
  or one step on one MIG instance (`mig_instance`, for DRA), under a lock per card, the card
  scanned and published again before the answer goes out;
- diagjobs.py: the vendor's diagnostic (`diag`, a job like `mig_layout`);
- jobs.py: the op table those jobs are polled in, and the daemon threads their vendor calls run in;
- sharingsteps.py: GPU sharing for DRA (`sharing`): an MPS control daemon started, stopped or
  listed under `--mps-root` (its directories `<mps-root>/<control>/pipe`, `.../log` and `.../shm`;
  on a real host root makes them from the spec the inventory hands over in `<mps-root>-specs`), or
  a whole card's time slice set; no rescan follows. Every Inventory names the MPS root (`mps_root`,
  "" with an adapter that keeps no daemons): a claim's CDI spec mounts the pipe directory.

A claims notice (`converger.claims_changed`, sent whenever a pass changed the
claims) changes no hardware: it is evaluated against the last scan, not a new
one. A switch result (`vfio_switcher.result`) rescans, and a reset that worked
has the card checked again. The tracker's state is kept in
`<data_dir>/inventory/gpus.json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from shared.runtime import Option, Refused, ServiceApp, ServiceContext, StartupError, guarded, main_for
from shared.schemas import (
    CLAIMS_CODEC,
    DIAG_REPLY_CODEC,
    DIAG_REQUEST_CODEC,
    EMPTY_CODEC,
    GPU_REPLY_CODEC,
    GPU_REQUEST_CODEC,
    INVENTORY_CODEC,
    MIG_INSTANCE_REPLY_CODEC,
    MIG_INSTANCE_REQUEST_CODEC,
    MIG_LAYOUT_REPLY_CODEC,
    MIG_LAYOUT_REQUEST_CODEC,
    SHARING_STEP_REPLY_CODEC,
    SHARING_STEP_REQUEST_CODEC,
    SWITCH_REPLY_CODEC,
    BadMessage,
    Inventory,
    SwitchReply,
)

from .adapters import AdapterError, AdapterUnavailable, load_adapter
from .diagjobs import DiagJobs
from .facts import InventoryFacts
from .features import MIG_STRATEGIES, NFD_FEATURES_DIR, FeatureKeeper
from .gpurequests import GpuRequests
from .gpustate import GpuState, GpuStateStore, GpuTracker, StateFileError, state_dir_from
from .healthdesk import HealthChecks, HealthDesk
from .healthintake import HealthIntake, policy_from
from .healthwatch import HealthNews, HealthThread
from .jobs import JobTable
from .metrics import InventoryMetrics
from .migjobs import MigJobs
from .publishing import Publisher
from .sharingsteps import SharingSteps

#: the longest --mps-root the inventory can name (Inventory.mps_root)
MPS_ROOT_MAX = 1024


class InventoryApp(ServiceApp):
    name = "inventory"
    description = "discovers GPUs, MIG instances, slots and host resources"

    def __init__(self) -> None:
        #: made at setup (facts.py, publishing.py): what the endpoints and the run loop use
        self.facts: InventoryFacts | None = None
        self.publisher: Publisher | None = None
        #: diagnostics and MIG layout changes the converger polls (cancelled at stop)
        self.jobs = JobTable()
        #: GPU health (issue 30): the health thread, its news and the task that handles them
        self.health_thread: HealthThread | None = None
        self.health_news: asyncio.Queue[HealthNews] = asyncio.Queue()
        self.health_task: asyncio.Task[None] | None = None
        self.adapter: Any = None
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
            health_policy = policy_from(o)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if o.feature_dir and not Path(o.feature_dir).is_absolute():
            raise StartupError(f"--feature-dir must be an absolute path (or empty: off), not {o.feature_dir!r}")
        log = ctx.log
        self.features = FeatureKeeper(o.feature_dir, mig_strategy=o.feature_mig_strategy, log=log) if o.feature_dir else None
        store = GpuStateStore(state_dir_from(o.data_dir), log=log)
        state, save_error = GpuState(), ""
        try:
            store.ensure_dir()
            state = store.load()
        except StateFileError as exc:
            # the inventory itself must keep running; requests that need the file are refused.
            log.error("GPU state cannot be kept; exclusions, reclaims and disruptions will not survive a restart", error=str(exc))
            save_error = str(exc)
        tracker = GpuTracker(
            o.node_id,
            orphan_grace=timedelta(seconds=o.orphan_grace),
            reclaim_timeout=timedelta(seconds=o.reclaim_timeout),
            state=state,
            health=health_policy,
        )
        ctx.metadata["state_file"] = str(store.path)
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
                known_uuids=tracker.known_uuids() or None,
            )
            wrote = self.adapter.write_cdi_spec()
        except AdapterUnavailable as exc:
            raise StartupError(str(exc)) from None
        except AdapterError as exc:
            raise StartupError(f"{o.adapter} adapter: {exc}") from None
        if wrote:
            log.info("vendor CDI spec written", cdi_dir=str(o.cdi_dir))
        facts = self.facts = InventoryFacts(adapter=self.adapter, tracker=tracker, store=store, health_policy=health_policy)
        tracker.health_watched = facts.watching()

        # the rooms, each with what it needs (the health metrics are registered after the inventory's)
        metrics = InventoryMetrics(ctx.registry)
        checks = HealthChecks(facts, intake=HealthIntake(ctx.registry, log), log=log)
        publisher = self.publisher = Publisher(
            facts,
            metrics=metrics,
            nc=ctx.nc,
            subjects=ctx.subjects,
            node_id=o.node_id,
            adapter_name=o.adapter,
            mps_root=o.mps_root,
            claims_timeout=o.claims_timeout,
            log=log,
            features=self.features,
            save_error=save_error,
            first_scan=checks.first,
        )
        health = HealthDesk(facts, checks=checks, publisher=publisher, log=log)
        requests = GpuRequests(facts, publisher=publisher, checks=checks, adapter_name=o.adapter, log=log)
        diags = DiagJobs(facts, jobs=self.jobs, adapter_name=o.adapter, log=log)

        async def publish(reason: str, switch: SwitchReply | None) -> Inventory:
            return await publisher.scan_and_publish(reason, switch=switch)

        mig = MigJobs(facts, jobs=self.jobs, publish=publish, adapter_name=o.adapter, log=log)
        sharing = SharingSteps(facts, mps_root=Path(o.mps_root), adapter_name=o.adapter, log=log)

        # the bucket is the bus setup's (no service makes a stream): the inventory only puts
        # its one key and reads it back by direct get
        await publisher.load_last()
        # the start scan's GPU events go to the outbox after the endpoints are up: until
        # the bus setup has made the outbox, that send waits out its probe (1 s)
        await publisher.scan_and_publish("start", flush=False)
        await ctx.endpoint("get", ctx.subjects.inventory_get, lambda _: self.get(), EMPTY_CODEC, allow_empty=True, reply=INVENTORY_CODEC)
        await ctx.endpoint("rescan", ctx.subjects.inventory_rescan, lambda _: self.rescan(ctx), EMPTY_CODEC, allow_empty=True, reply=INVENTORY_CODEC)
        await ctx.endpoint("gpu", ctx.subjects.inventory_gpu, requests.request, GPU_REQUEST_CODEC, reply=GPU_REPLY_CODEC)
        await ctx.endpoint("diag", ctx.subjects.inventory_diag, diags.diag, DIAG_REQUEST_CODEC, reply=DIAG_REPLY_CODEC)
        await ctx.endpoint("mig_layout", ctx.subjects.inventory_mig_layout, mig.layout, MIG_LAYOUT_REQUEST_CODEC, reply=MIG_LAYOUT_REPLY_CODEC)
        await ctx.endpoint("mig_instance", ctx.subjects.inventory_mig_instance, mig.instance, MIG_INSTANCE_REQUEST_CODEC, reply=MIG_INSTANCE_REPLY_CODEC)
        await ctx.endpoint("sharing", ctx.subjects.inventory_sharing, sharing.step, SHARING_STEP_REQUEST_CODEC, reply=SHARING_STEP_REPLY_CODEC)

        @guarded(log, "claims notice")
        async def on_claims(msg: Msg) -> None:
            try:
                claims = CLAIMS_CODEC.decode(msg.data)
            except BadMessage as exc:
                log.warning("ignoring an undecodable claims notice", error=str(exc))
                return
            # the host did not change with the claims: no rescan (the last scan is at most
            # --rescan-interval old; a switch's notice rescans)
            await publisher.refresh_logged("claims changed", claims=claims, rescan=False)

        @guarded(log, "switch result")
        async def on_switch(msg: Msg) -> None:
            try:
                reply = SWITCH_REPLY_CODEC.decode(msg.data)
            except BadMessage as exc:
                log.warning("ignoring an undecodable switch result", error=str(exc))
                return
            log.info(
                "switch result",
                pci=reply.pci,
                target=reply.target,
                outcome=reply.outcome,
                reason=reply.reason,
                switch_event=reply.event,
                boot_id=reply.boot_id,
            )
            await publisher.refresh_logged("switch result", switch=reply)
            if reply.target == "reset" and reply.ok and facts.watching():
                # a reset is what clears a fatal XID: check the card again, and let a clean check clear it
                await health.recheck_logged(reply.pci, "reset")

        await ctx.nc.subscribe(ctx.subjects.converger_claims_changed, cb=on_claims)
        await ctx.nc.subscribe(ctx.subjects.vfio_result, cb=on_switch)
        await publisher.announce()
        async with facts.lock:
            await publisher.flush_events()
        if facts.watching():
            self.health_task = asyncio.create_task(health.run(self.health_news), name="health news")
            self.health_thread = HealthThread(
                self.adapter, asyncio.get_running_loop(), self.health_news.put_nowait, interval=float(o.health_interval), log=log
            )
            self.health_thread.start()

    # ------------------------------------------------------------------ running

    async def get(self) -> Inventory:
        if self.facts is None or self.facts.current is None:
            raise Refused("no inventory yet", code="503")
        return self.facts.current

    async def rescan(self, ctx: ServiceContext) -> Inventory:
        assert self.publisher is not None
        return await self.publisher.scan_and_publish("request")

    async def run(self, ctx: ServiceContext) -> None:
        """Rescan every --rescan-interval, or every --gpu-tick while a GPU timer runs."""
        facts, publisher = self.facts, self.publisher
        assert facts is not None and publisher is not None
        interval = max(0.1, float(ctx.opts.rescan_interval))
        tick = max(0.05, float(ctx.opts.gpu_tick))
        while not ctx.stopping.is_set():
            facts.wake.clear()
            every = min(interval, tick) if facts.tracker.timers_running() else interval
            delay = facts.last_scan + every - time.monotonic()
            if delay > 0 and await self._sleep(ctx, delay):
                continue  # stopping, or an evaluation elsewhere may have started a timer
            if ctx.stopping.is_set():
                break
            reason = "gpu tick" if every < interval else "periodic"
            try:
                await publisher.scan_and_publish(reason)
            except Exception:  # noqa: BLE001 - keep scanning; the error is logged
                ctx.log.exception("periodic scan failed")
                facts.last_scan = time.monotonic()

    async def _sleep(self, ctx: ServiceContext, delay: float) -> bool:
        """Wait `delay` seconds; True when woken early (stopping, or an evaluation happened)."""
        assert self.facts is not None
        waiters = [asyncio.ensure_future(ctx.stopping.wait()), asyncio.ensure_future(self.facts.wake.wait())]
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
        await self.jobs.close()
        if self.adapter is not None:
            self.adapter.close()
        if self.features is not None:
            self.features.stop()  # bcd no longer speaks for the node's GPUs


main = main_for(InventoryApp)

__all__ = ["InventoryApp", "main"]
