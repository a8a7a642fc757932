"""The converger micro service: the wiring of its rooms, each a module of its own.

`ConvergerApp` owns the options, the setup (the host writer, the journal as
a restart finds it, each room built with what it needs), the background
tasks it starts and the stop. The work is done in the rooms:

- endpoints.py: the NATS endpoints and subscriptions, and the answers that are reads;
- loop.py: when passes run; passes.py: what one pass does;
- intake.py: the inventory, and how a new one arrives;
- cardclaims.py: who claims each card, and its publication on `claims_changed`;
- claimdesk.py: the DRA claim endpoints' work around claims.py's ClaimKeeper;
- maintenance.py: resets, diagnostics and MIG layouts (rules: gpuops.py);
- helperwatch.py: the root helper, and the node's privilege through it;
- holddirs.py / holdwatch.py: the hold directories, and the watch on them;
- comeback.py: a pass that could not reach the signer, helper or inventory runs when it answers;
- metrics.py: the Prometheus metrics; facts.py: what the rooms share.

Specs: every one it takes must carry the control plane's signature
(`--cp-key`, shared/spectrust.py), checked here and not only at the bridge; a
converger with no key refuses to start unless told, lab only, to accept
unsigned specs (`--accept-unsigned-specs`), and then says so.

The VFIO side: GPUs named by spec.instances are switched to vfio-pci through
vfio_switcher (and back when no instance or running domain has them); see
vfio.py for the rules and apply.py for the record and the retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from datetime import datetime, timezone
from pathlib import Path

from shared import logs
from shared.holdfiles import VendorCache, checked_consumer_dir, default_consumer_dir
from shared.host import HostFactError, read_boot_id
from shared.runtime import Option, ServiceApp, ServiceContext, StartupError, main_for
from shared.schemas import GpuOp, GpuOpRequest
from shared.slices import CGROUP_ROOT, FakeSlices, Slices, SystemdSlices
from shared.spectrust import announce, load_trust, trust_options

from . import gpuops, relayout
from .apply import Applier
from .cardclaims import CardClaims
from .claimdesk import ClaimDesk, bus_mig_step, bus_sharing_step, counted_switch
from .comeback import ComebackWatch
from .claims import ClaimKeeper
from .consumers import BusKubeConsumers
from .crash import CrashPoints
from .domains import Domains, FakeDomains, NoDomains
from .endpoints import Endpoints, serve
from .facts import NodeFacts
from .helperwatch import HelperFinder, RootHelperWatch
from .holddirs import HoldDirs
from .holdwatch import HoldDirWatch
from .hostwriter import BusHelperTransport, HelperHostWriter, HostWriter, LocalHostWriter, helper_connector, writer_kind
from .intake import InventoryIntake
from .loop import PassLoop
from .maintenance import Maintenance
from .metrics import ConvergerMetrics
from .model import ConvergerState, MigLayoutRecord, PlanConfig
from .relayoutrun import BusNode, RelayoutRunner
from .outbox import BusSigner, JetStreamOutbox
from .passes import PassRunner
from .reaper import BusReaper
from .releases import ReleasesStore
from .state import StateStore
from .switcher import BusSwitcher


class ConvergerApp(ServiceApp):
    name = "converger"
    description = "turns the devices section of the NodeSpec into holds"

    def options(self) -> list[Option]:
        return [
            *trust_options(),
            Option("--cdi-dir", "CDI spec directory", default=Path("/etc/cdi"), type=Path),
            Option(
                "--cdi-consumer-dir",
                "where each hold spec's consumer copy goes (no annotations, the lowest cdiVersion: for runtimes "
                "whose CDI library is older than v0.6); a spec dir runtimes rank above --cdi-dir "
                "(default /var/run/cdi; on a fake host <run-dir>/cdi)",
                default=None,
                type=Path,
            ),
            Option(
                "--mig-layouts",
                "desired MIG layouts of this node's cards: PCI=LAYOUT;PCI=LAYOUT (LAYOUT: all-disabled, or GPU instance "
                "profiles comma-separated); `bcd gpu mig-layout` overrides a card's",
                default="",
            ),
            Option("--run-dir", "runtime directory (env files; tmpfs)", default=Path("/run/bcd"), type=Path),
            Option("--data-dir", "state directory", default=Path("/var/lib/bcd"), type=Path),
            Option("--proc-root", "root of /proc (boot id)", default=Path("/proc"), type=Path),
            Option("--fake-host", "fake host description file (boot id, domains; fake slices)", type=Path),
            Option("--slices", "slice backend: fake (JSON records) or systemd (D-Bus)", default="auto", choices=("auto", "fake", "systemd")),
            Option("--retry-interval", "seconds before a retryable pass runs again", default=30.0, type=float),
            Option("--drift-interval", "seconds between drift passes", default=600.0, type=float),
            Option(
                "--watch-interval",
                "seconds between looks at the hold directories: a change there that no pass made wakes a pass (0: off)",
                default=2.0,
                type=float,
            ),
            Option("--system-reserve-bytes", "host memory never promised to holds", default=0, type=int),
            # not --switch-timeout: that is the switcher's per-write timeout, and in `bcd up`
            # one BCD_SWITCH_TIMEOUT would set both; the wait must outlast a switch's writes.
            Option("--switch-reply-timeout", "seconds to wait for vfio_switcher's answer to one switch (over twice its --switch-timeout)", default=60.0, type=float),
            Option(
                "--writer",
                "who writes CDI specs, env files and slices: local (this process), helper (the root helper), "
                "auto (local as root or on a fake host, else the helper when one answers, else none: unprivileged)",
                default="auto",
                choices=("auto", "local", "helper"),
            ),
            Option("--helper-recheck-interval", "seconds between looks for the root helper while unprivileged", default=30.0, type=float),
            Option(
                "--helper-lost-after",
                "seconds the root helper may go unanswered before the node counts as unprivileged again "
                "(--writer auto; 0: never)",
                default=30.0,
                type=float,
            ),
            Option(
                "--relayout-drain-timeout",
                "seconds a MIG re-layout (its Node's nvidia.com/mig.config) waits for the pods using its cards to go before it fails",
                default=relayout.DRAIN_TIMEOUT_S,
                type=float,
            ),
            Option("--relayout-interval", "seconds between reads of the node's Kubernetes Node while no MIG re-layout runs", default=relayout.IDLE_INTERVAL_S, type=float),
        ]

    # ------------------------------------------------------------------ setup

    def boot_id(self) -> str:
        return read_boot_id(self.opts.proc_root, self.opts.fake_host)

    async def setup(self, ctx: ServiceContext) -> None:
        o = self.opts = ctx.opts
        self.ctx = ctx
        log = ctx.log
        # first: a converger that cannot tell the control plane's specs from anyone else's does not start
        trust = load_trust(o.cp_key, o.accept_unsigned_specs)
        fake = o.fake_host is not None
        backend = o.slices if o.slices != "auto" else ("fake" if fake else "systemd")
        slices: Slices = FakeSlices(o.run_dir) if backend == "fake" else SystemdSlices(cgroup_root=CGROUP_ROOT)
        domains: Domains = FakeDomains(o.fake_host) if fake else NoDomains()
        crash = CrashPoints()
        try:
            consumer_dir = checked_consumer_dir(
                o.cdi_dir, o.cdi_consumer_dir if o.cdi_consumer_dir is not None else default_consumer_dir(o.run_dir, fake_host=fake)
            )
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        # every room wakes a pass through the loop; the loop runs the pass room (made below)
        self.loop = PassLoop(self._run_pass, retry_s=o.retry_interval, drift_s=o.drift_interval)
        # a pass that could not reach the signer, the helper or the inventory runs when it answers
        self.comeback = ComebackWatch(ctx.nc, ctx.subjects, trigger=self.loop.trigger, log=log)

        writer: HostWriter
        self.helper_writer: HelperHostWriter | None = None
        finder: HelperFinder | None = None
        if writer_kind(o.writer, fake_host=fake, euid=os.geteuid()) == "local":
            writer = LocalHostWriter(o.cdi_dir, o.run_dir, slices, crash, consumer_dir=consumer_dir)
            privileged = True
        else:
            transport = BusHelperTransport(helper_connector(o), unreached=self.comeback.unreached)
            writer = self.helper_writer = HelperHostWriter(
                transport, ctx.subjects, o.cdi_dir, o.run_dir, slices_backend=backend, consumer_dir=consumer_dir
            )
            finder = HelperFinder(ctx.nc, ctx.subjects, self.helper_writer, cdi_dir=o.cdi_dir, run_dir=o.run_dir, consumer_dir=consumer_dir, log=log)
            # --writer helper: the helper is required (a missing one fails writes, retried)
            privileged = o.writer == "helper" or await finder.look()
        config = PlanConfig(node_id=o.node_id, privileged=privileged, system_reserve_bytes=o.system_reserve_bytes)
        store = StateStore(Path(o.data_dir) / "converger")
        state = store.load()
        try:
            boot = self.boot_id()
        except HostFactError as exc:
            raise StartupError(str(exc)) from None
        interrupted = start_journal(state, boot=boot, mig_layouts=o.mig_layouts, log=log)
        store.save(state)
        facts = self.facts = NodeFacts(state=state, store=store, config=config)
        spec, unknown = store.load_spec_with_unknown(trust, o.node_id)
        facts.spec, facts.spec_unknown = spec, tuple(unknown)
        if not privileged:
            log.warning(
                "running unprivileged (not root, no helper): every plain hold will fail with node-unprivileged",
                why=finder.note if finder is not None else "",
                recheck_in_s=o.helper_recheck_interval,
            )
        elif self.helper_writer is not None:
            log.info("writing through the root helper", writer=o.writer)
        releases = ReleasesStore(Path(o.data_dir))
        reaper = BusReaper(ctx.nc, ctx.subjects)
        consumers = BusKubeConsumers(ctx.nc, ctx.subjects)
        # the bus setup made the stream (the converger may not): read what it has, and
        # again before each pass while there is none yet
        outbox = JetStreamOutbox(ctx.nc, ctx.subjects)
        await outbox.recheck()

        metrics = ConvergerMetrics(ctx.registry)
        announce(trust, metadata=ctx.metadata, log=log, registry=ctx.registry)
        switcher = BusSwitcher(ctx.nc, ctx.subjects, timeout=o.switch_reply_timeout)
        applier = Applier(
            node_id=o.node_id,
            writer=writer,
            signer=BusSigner(ctx.nc, ctx.subjects, unreached=self.comeback.unreached),
            outbox=outbox,
            save_state=store.save,
            boot_id=self.boot_id,
            crash=crash,
            releases=releases,
            reaper=reaper,
            consumers=consumers,
            switcher=switcher,
            count_switch=metrics.count_switch,
            count_drift=metrics.count_drift,
        )
        dirs = HoldDirs(o.cdi_dir, o.run_dir, consumer_dir, slices)
        intake = InventoryIntake(ctx.nc, ctx.subjects, trigger=self.loop.trigger, log=log, unreached=self.comeback.unreached)
        card_claims = CardClaims(facts, dirs=dirs, releases=releases, intake=intake, nc=ctx.nc, subjects=ctx.subjects, log=log)
        keeper = ClaimKeeper(
            state=lambda: state,
            save=lambda: asyncio.to_thread(store.save, state),
            writer=lambda: writer,
            mig=bus_mig_step(ctx.nc, ctx.subjects),
            inventory=intake.now,
            card_claims=lambda inv: asyncio.to_thread(card_claims.read, inv),
            claim_holds=dirs.claim_holds,
            privileged=lambda: facts.privileged,
            boot_id=lambda: state.boot_id,
            vfio=lambda: dict(state.vfio),
            maintenance=lambda: maintenance_claims(state),
            crash=crash,
            sharing=bus_sharing_step(ctx.nc, ctx.subjects),
            switch=counted_switch(switcher, metrics.count_switch),
        )
        claim_desk = ClaimDesk(
            keeper, state=state, lock=facts.lock, inventory=intake.now, publish=card_claims.publish, trigger=self.loop.trigger, metrics=metrics
        )
        self.maintenance = Maintenance(
            facts, intake=intake, claims=card_claims, metrics=metrics, trigger=self.loop.trigger, nc=ctx.nc, subjects=ctx.subjects, log=log
        )
        if o.relayout_drain_timeout <= 0 or o.relayout_interval <= 0:
            raise StartupError("--relayout-drain-timeout and --relayout-interval must be positive")
        self.relayout = RelayoutRunner(
            facts,
            intake=intake,
            claims=card_claims,
            node=BusNode(ctx.nc, ctx.subjects),
            metrics=metrics,
            trigger=self.loop.trigger,
            log=log,
            drain_timeout=o.relayout_drain_timeout,
            idle_interval=o.relayout_interval,
            crash=crash,
        )
        self.helper_watch = (
            RootHelperWatch(
                finder,
                facts,
                mode=o.writer,
                recheck_interval=o.helper_recheck_interval,
                lost_after=o.helper_lost_after,
                trigger=self.loop.trigger,
                log=log,
            )
            if finder is not None
            else None
        )
        self.dir_watch = HoldDirWatch(dirs, lock=facts.lock, trigger=self.loop.trigger, log=log, interval=o.watch_interval)
        self.passes = PassRunner(
            facts,
            intake=intake,
            applier=applier,
            outbox=outbox,
            releases=releases,
            reaper=reaper,
            consumers=consumers,
            slices=slices,
            domains=domains,
            dirs=dirs,
            dir_watch=self.dir_watch,
            claims=card_claims,
            claim_desk=claim_desk,
            maintenance=self.maintenance,
            helper=self.helper_watch,
            metrics=metrics,
            retry_interval=o.retry_interval,
            log=log,
        )
        endpoints = Endpoints(
            facts,
            node_id=o.node_id,
            trust=trust,
            loop=self.loop,
            last_pass=self.passes,
            intake=intake,
            claims=card_claims,
            keeper=keeper,
            dirs=dirs,
            vendor=VendorCache(o.cdi_dir),
            outbox=outbox,
            releases=releases,
            system_reserve_bytes=o.system_reserve_bytes,
            relayout=self.relayout.status,
            log=log,
        )
        metrics.from_journal(state)
        metrics.count_interrupted(interrupted)
        await serve(ctx, endpoints, intake=intake, claim_desk=claim_desk, maintenance=self.maintenance)

    async def _run_pass(self, reason: str) -> bool:
        retry = True  # a pass that raised is retried (loop.py)
        try:
            retry = await self.passes.run(reason)
            return retry
        finally:
            self.comeback.pass_ended(retry=retry)

    # ------------------------------------------------------------------ running

    async def run(self, ctx: ServiceContext) -> None:
        # the endpoints answer now: a bridge holding a spec for us hands it over at once
        # instead of at its next retry
        with contextlib.suppress(Exception):
            await ctx.nc.publish(ctx.subjects.converger_status_changed, b"")
        async with asyncio.TaskGroup() as tasks:
            if self.helper_watch is not None and (self.opts.writer == "auto" or not self.facts.privileged):
                tasks.create_task(self.helper_watch.run(ctx.stopping), name="converger.helper-watch")
            if self.opts.watch_interval > 0:
                tasks.create_task(self.dir_watch.run(ctx.stopping), name="converger.hold-dir-watch")
            tasks.create_task(self.comeback.run(ctx.stopping), name="converger.comeback-watch")
            tasks.create_task(self.relayout.run(ctx.stopping), name="converger.mig-relayout")
            await self.loop.run(ctx.stopping)

    async def close(self, ctx: ServiceContext) -> None:
        # an operation cut short stays "running" in the journal: the next start says Interrupted
        await self.maintenance.close()
        if self.helper_writer is not None:
            await asyncio.to_thread(self.helper_writer.close)


def maintenance_claims(state: ConvergerState) -> dict[str, str]:
    """PCI address -> holder of each card a maintenance operation or the MIG re-layout claims."""
    return {**relayout.claimed_cards(state.relayout), **gpuops.maintenance_claims(state.gpu_ops)}


def start_journal(state: ConvergerState, *, boot: str, mig_layouts: str, log: logs.StructLogger) -> list[GpuOp]:
    """The journal as this start finds it, made true for this boot (the caller saves it): domains and
    stuck cards of an earlier boot forgotten, operations cut short finished as Interrupted (returned,
    to be counted), the --mig-layouts config taken in. StartupError when --mig-layouts does not read."""
    if state.boot_id and state.boot_id != boot:
        log.info("new boot: slices and env files will be recreated for kept holds", previous_boot=state.boot_id, boot_id=boot)
        # Domains that ran before the reboot do not run now.
        state.domain_gpus = {}
    # a card stuck in an earlier boot may be switched again in this one
    state.vfio_stuck = {pci: b for pci, b in state.vfio_stuck.items() if b == boot}
    state.boot_id = boot
    # an operation still running in the journal: whoever waited for it died with us
    now = datetime.now(timezone.utc)
    interrupted: list[GpuOp] = []
    for pci, op in sorted(state.gpu_ops.items()):
        done = gpuops.interrupted(op, now=now)
        interrupted.append(done)
        state.gpu_op_results[gpuops.result_key(done)] = done
        log.warning("maintenance operation interrupted by a restart", op=op.op, id=op.id, pci=pci, detail=done.message)
    state.gpu_ops = {}
    try:
        configured = parse_layout_config(mig_layouts)
    except ValueError as exc:
        raise StartupError(f"--mig-layouts: {exc}") from None
    for pci, layout in configured.items():
        rec = state.mig_layouts.get(pci)
        if rec is None or (rec.source == "config" and rec.layout != layout):
            state.mig_layouts[pci] = MigLayoutRecord(layout=layout, source="config", since=now)
    return interrupted


def parse_layout_config(text: str) -> dict[str, str]:
    """--mig-layouts "PCI=LAYOUT;PCI=LAYOUT" -> {pci: layout text}; ValueError names what is wrong."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        pci, sep, layout = part.partition("=")
        pci = pci.strip().lower()
        problem = gpuops.check_request(GpuOpRequest(op="mig-layout", pci=pci, layout=layout)) if sep else f"{part!r} is not PCI=LAYOUT"
        if problem:
            raise ValueError(problem)
        profiles, disable = gpuops.parse_layout(layout)
        out[pci] = gpuops.layout_text(profiles, disable)
    return out


main = main_for(ConvergerApp)

__all__ = ["ConvergerApp", "main"]
