"""The converger micro service: takes NodeSpecs, runs passes, answers status, holder and claims.

Endpoints: `spec` (the bridge hands over a verified NodeSpec; kept on disk so
a restart converges without it), `status`, `holder` (which allocation,
instance or domain holds a GPU - asked before a VFIO switch, reset or MIG
change), `claims` (every card's claims, and the cards the converger put on
vfio-pci: what the inventory derives managementState from), `pass` (run one
now). It follows the inventory through the node-bus `inventory.changed`
messages and never plans without an inventory. After a pass whose claims
changed (and after the first one) it publishes them on `claims_changed`.

The VFIO side: GPUs named by spec.instances are switched to vfio-pci through
vfio_switcher (and back when no instance or running domain has them); see
vfio.py for the rules and apply.py for the record and the retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from datetime import datetime, timezone
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from prometheus_client import Counter, Gauge, Histogram

from shared.holdfiles import BINDING_CLAIM, ENV_SUBDIR, HoldOnDisk, VendorCache, checked_consumer_dir, default_consumer_dir
from shared.host import HostFactError, read_boot_id
from shared.runtime import LoopGuard, Option, Refused, ServiceApp, ServiceCallError, ServiceContext, StartupError, call, guarded, main_for
from shared.schemas import (
    CLAIM_PREPARE_REPLY_CODEC,
    CLAIM_PREPARE_REQUEST_CODEC,
    CLAIM_UNPREPARE_REPLY_CODEC,
    CLAIM_UNPREPARE_REQUEST_CODEC,
    CLAIMS_CODEC,
    CONVERGER_STATUS_CODEC,
    MIG_INSTANCE_REPLY_CODEC,
    SHARING_STEP_REPLY_CODEC,
    SharingStepReply,
    SharingStepRequest,
    SwitchReply,
    DIAG_REPLY_CODEC,
    EMPTY_CODEC,
    MIG_LAYOUT_REPLY_CODEC,
    FREED_CODEC,
    GPU_OP_REPLY_CODEC,
    GPU_OP_REQUEST_CODEC,
    HOLDER_QUERY_CODEC,
    HOLDER_REPLY_CODEC,
    INVENTORY_CODEC,
    NODE_SPEC_CODEC,
    SPEC_ACK_CODEC,
    SWITCH_REPLY_CODEC,
    BadMessage,
    ClaimPrepareReply,
    ClaimPrepareRequest,
    ClaimUnprepareReply,
    ClaimUnprepareRequest,
    Claims,
    ConvergerStatus,
    DiagRequest,
    Empty,
    GpuClaim,
    GpuOp,
    GpuOpReply,
    GpuOpRequest,
    HolderQuery,
    HolderReply,
    HoldSummary,
    PendingReleaseSummary,
    Inventory,
    MigInstanceReply,
    MigInstanceRequest,
    MigLayoutRequest,
    MigLayoutState,
    NodeSpec,
    SpecAck,
    SwitchRequest,
)
from shared.schemas.bus import PASSTHROUGH_CLAIM, PROBLEMS_MAX
from shared.schemas.common import clip
from shared.schemas.strict import unknown_fields_of_json
from shared.slices import CGROUP_ROOT, FakeSlices, Slices, SystemdSlices
from shared.vendorcdi import VENDOR_CDI_FILE, VendorSpecError

from . import gpuops
from .apply import Applier
from .claims import ClaimKeeper
from .crash import CrashPoints
from .domains import Domains, FakeDomains, NoDomains
from .hostwriter import (
    BusHelperTransport,
    HelperHostWriter,
    HostWriter,
    LocalHostWriter,
    find_helper,
    helper_connector,
    HelperWatch,
    helper_mismatch,
    watch_helper,
    writer_kind,
)
from .loop import PassLoop
from .model import ConvergerState, MigLayoutRecord, PlanConfig
from .drift import dirs_signature, journal_disagreements
from .observe import DiskView, observe, read_disk, release_facts
from .outbox import BusSigner, JetStreamOutbox
from .plan import UNREADABLE, claim_holders, plan
from .consumers import BusKubeConsumers
from .reaper import BusReaper
from .releases import PendingRelease, ReleasesStore
from .state import StateStore
from .switcher import BusSwitcher
from .vfio import card_claims, planner_view


#: an MPS daemon starts, sets its limits and answers its pipe within this (the inventory bounds each command)
SHARING_STEP_TIMEOUT_S = 90.0


class ConvergerApp(ServiceApp):
    name = "converger"
    description = "turns the devices section of the NodeSpec into holds"

    def __init__(self) -> None:
        self.spec: NodeSpec | None = None
        #: fields of `spec` as received that NodeSpec does not declare (ignored; reported
        #: as condition NodeSpecUnknownFields at its generation).
        self.spec_unknown: tuple[str, ...] = ()
        self.inventory: Inventory | None = None
        self.state = ConvergerState()
        self.failures: dict[str, str] = {}
        self.last_pass_at: datetime | None = None
        self.warned: set[str] = set()
        self.lock = asyncio.Lock()
        #: maintenance operations in flight (their results come back through the journal)
        self.op_tasks: set[asyncio.Task[None]] = set()
        #: the content (claims, vfio, generation) of the last Claims published.
        self.claims_sent: tuple | None = None
        #: the VFIO notes of the last pass (logged again only at DEBUG).
        self.vfio_noted: set[str] = set()
        #: the holds on disk as read right after the last pass (None: not read by it).
        self.holds_after_pass: dict[str, HoldOnDisk] | None = None
        #: the DRA claims cut short by the last stop were looked at (once the inventory is known)
        self.claims_reconciled = False
        #: what the hold directories held when the last pass ended (None: no pass yet)
        self.dirs_seen: tuple | None = None

    def options(self) -> list[Option]:
        return [
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
            Option("--outbox-max-msgs", "events the outbox keeps while upstream is away; full: new binds wait", default=100_000, type=int),
            Option("--outbox-max-bytes", "bytes the outbox keeps while upstream is away", default=256 * 1024 * 1024, type=int),
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
        ]

    # ------------------------------------------------------------------ setup

    def boot_id(self) -> str:
        return read_boot_id(self.opts.proc_root, self.opts.fake_host)

    async def setup(self, ctx: ServiceContext) -> None:
        o = self.opts = ctx.opts
        self.ctx = ctx
        fake = o.fake_host is not None
        backend = o.slices if o.slices != "auto" else ("fake" if fake else "systemd")
        self.slices: Slices = FakeSlices(o.run_dir) if backend == "fake" else SystemdSlices(cgroup_root=CGROUP_ROOT)
        self.domains: Domains = FakeDomains(o.fake_host) if fake else NoDomains()
        crash = CrashPoints()
        try:
            consumer_dir = self.consumer_dir = checked_consumer_dir(
                o.cdi_dir, o.cdi_consumer_dir if o.cdi_consumer_dir is not None else default_consumer_dir(o.run_dir, fake_host=fake)
            )
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        writer: HostWriter
        self.helper_writer: HelperHostWriter | None = None
        self.helper_note = ""
        #: monotonic time the helper first missed a look while holds bind through it (None: answering)
        self.helper_gone_since: float | None = None
        if writer_kind(o.writer, fake_host=fake, euid=os.geteuid()) == "local":
            writer = LocalHostWriter(o.cdi_dir, o.run_dir, self.slices, crash, consumer_dir=consumer_dir)
            self.privileged = True
        else:
            transport = BusHelperTransport(helper_connector(o))
            writer = self.helper_writer = HelperHostWriter(
                transport, ctx.subjects, o.cdi_dir, o.run_dir, slices_backend=backend, consumer_dir=consumer_dir
            )
            # --writer helper: the helper is required (a missing one fails writes, retried)
            self.privileged = o.writer == "helper" or await self._look_for_helper()
        self.config = PlanConfig(node_id=o.node_id, privileged=self.privileged, system_reserve_bytes=o.system_reserve_bytes)
        self.store = StateStore(Path(o.data_dir) / "converger")
        self.state = self.store.load()
        try:
            boot = self.boot_id()
        except HostFactError as exc:
            raise StartupError(str(exc)) from None
        if self.state.boot_id and self.state.boot_id != boot:
            ctx.log.info("new boot: slices and env files will be recreated for kept holds", previous_boot=self.state.boot_id, boot_id=boot)
            # Domains that ran before the reboot do not run now.
            self.state.domain_gpus = {}
        # a card stuck in an earlier boot may be switched again in this one
        self.state.vfio_stuck = {pci: b for pci, b in self.state.vfio_stuck.items() if b == boot}
        self.state.boot_id = boot
        # an operation still running in the journal: whoever waited for it died with us
        now = datetime.now(timezone.utc)
        interrupted: list[GpuOp] = []
        for pci, op in sorted(self.state.gpu_ops.items()):
            done = gpuops.interrupted(op, now=now)
            interrupted.append(done)
            self.state.gpu_op_results[gpuops.result_key(done)] = done
            ctx.log.warning("maintenance operation interrupted by a restart", op=op.op, id=op.id, pci=pci, detail=done.message)
        self.state.gpu_ops = {}
        try:
            configured = parse_layout_config(o.mig_layouts)
        except ValueError as exc:
            raise StartupError(f"--mig-layouts: {exc}") from None
        for pci, layout in configured.items():
            rec = self.state.mig_layouts.get(pci)
            if rec is None or (rec.source == "config" and rec.layout != layout):
                self.state.mig_layouts[pci] = MigLayoutRecord(layout=layout, source="config", since=now)
        self.store.save(self.state)
        self.spec, unknown = self.store.load_spec_with_unknown()
        self.spec_unknown = tuple(unknown)
        if not self.privileged:
            ctx.log.warning(
                "running unprivileged (not root, no helper): every plain hold will fail with node-unprivileged",
                why=self.helper_note,
                recheck_in_s=o.helper_recheck_interval,
            )
        elif self.helper_writer is not None:
            ctx.log.info("writing through the root helper", writer=o.writer)
        self.releases = ReleasesStore(Path(o.data_dir))
        self.reaper = BusReaper(ctx.nc, ctx.subjects)
        self.consumers = BusKubeConsumers(ctx.nc, ctx.subjects)
        #: the Kubernetes holds after the last pass (allocation -> generation, devices).
        self.kube_holds_seen: dict[str, tuple[int, tuple[str, ...]]] | None = None
        self.pending: dict[str, PendingRelease] = {}
        self.outbox = JetStreamOutbox(
            ctx.nc, ctx.subjects, max_msgs=o.outbox_max_msgs, max_bytes=o.outbox_max_bytes, state_dir=o.data_dir
        )
        # a server that refuses the reservation for storage gives a smaller outbox (or,
        # below the floor, none yet: tried again before each pass), never a crash loop
        await self.outbox.ensure()
        #: the vendor CDI spec as the status reads it (decoded again only when it changes).
        self.vendor = VendorCache(o.cdi_dir)
        self.applier = Applier(
            node_id=o.node_id,
            writer=writer,
            signer=BusSigner(ctx.nc, ctx.subjects),
            outbox=self.outbox,
            save_state=self.store.save,
            boot_id=self.boot_id,
            crash=crash,
            releases=self.releases,
            reaper=self.reaper,
            consumers=self.consumers,
            switcher=(switcher := BusSwitcher(ctx.nc, ctx.subjects, timeout=o.switch_reply_timeout)),
            count_switch=lambda target, outcome: self.m_switches.labels(target=target, outcome=outcome).inc(),
        )
        self.loop = PassLoop(self.run_pass, retry_s=o.retry_interval, drift_s=o.drift_interval)
        self.keeper = ClaimKeeper(
            state=lambda: self.state,
            save=lambda: asyncio.to_thread(self.store.save, self.state),
            writer=lambda: writer,
            mig=self._mig_step_call,
            inventory=self._inventory_now,
            card_claims=lambda inv: asyncio.to_thread(self._card_claims, inv),
            claim_holds=self._claim_holds_now,
            privileged=lambda: self.privileged,
            boot_id=lambda: self.state.boot_id,
            vfio=lambda: dict(self.state.vfio),
            maintenance=lambda: gpuops.maintenance_claims(self.state.gpu_ops),
            crash=crash,
            sharing=self._sharing_step_call,
            switch=self._claim_switch(switcher),
        )
        self._metrics(ctx)
        self._count_interrupted(interrupted)

        @guarded(ctx.log, "inventory notice")
        async def on_inventory(msg: Any) -> None:
            try:
                inv = INVENTORY_CODEC.decode(msg.data)
            except BadMessage as exc:
                ctx.log.warning("ignoring a bad inventory message", error=str(exc))
                return
            if self.inventory is None or inv.revision != self.inventory.revision:
                self._take_inventory(inv, wake=True)

        @guarded(ctx.log, "freed notice")
        async def on_freed(msg: Any) -> None:
            try:
                freed = FREED_CODEC.decode(msg.data)
            except BadMessage:
                return
            self.loop.trigger(f"devices of {freed.allocation_id} freed")

        await ctx.nc.subscribe(ctx.subjects.inventory_changed, cb=on_inventory)
        await ctx.nc.subscribe(ctx.subjects.reaper_freed, cb=on_freed)
        await ctx.endpoint("spec", ctx.subjects.converger_spec, self.take_spec, NODE_SPEC_CODEC, reply=SPEC_ACK_CODEC, with_body=True)
        await ctx.endpoint("status", ctx.subjects.converger_status, self.status, EMPTY_CODEC, allow_empty=True, reply=CONVERGER_STATUS_CODEC)
        await ctx.endpoint("holder", ctx.subjects.converger_holder, self.holder, HOLDER_QUERY_CODEC, reply=HOLDER_REPLY_CODEC)
        await ctx.endpoint("claims", ctx.subjects.converger_claims, self.claims, EMPTY_CODEC, allow_empty=True, reply=CLAIMS_CODEC)
        await ctx.endpoint("pass", ctx.subjects.converger_pass, self.request_pass, EMPTY_CODEC, allow_empty=True, reply=SPEC_ACK_CODEC)
        await ctx.endpoint("gpu_op", ctx.subjects.converger_gpu_op, self.gpu_op, GPU_OP_REQUEST_CODEC, reply=GPU_OP_REPLY_CODEC)
        await ctx.endpoint("claim_prepare", ctx.subjects.converger_claim_prepare, self.claim_prepare, CLAIM_PREPARE_REQUEST_CODEC, reply=CLAIM_PREPARE_REPLY_CODEC)
        await ctx.endpoint(
            "claim_unprepare", ctx.subjects.converger_claim_unprepare, self.claim_unprepare, CLAIM_UNPREPARE_REQUEST_CODEC, reply=CLAIM_UNPREPARE_REPLY_CODEC
        )

    def _metrics(self, ctx: ServiceContext) -> None:
        reg = ctx.registry
        self.m_holds = Gauge("bcd_holds", "Holds on disk by binding", ["binding"], registry=reg)
        self.m_pass = Histogram("bcd_converger_pass_duration_seconds", "Duration of one pass", registry=reg)
        self.m_passes = Counter("bcd_converger_passes", "Passes by outcome", ["outcome"], registry=reg)
        self.m_failures = Counter("bcd_hold_failures", "Holds refused, by reason", ["reason"], registry=reg)
        self.m_generation = Gauge("bcd_converger_observed_generation", "Generation of the last pass", registry=reg)
        self.m_section = Gauge("bcd_section_state", "1 for the devices section's current state", ["state"], registry=reg)
        self.m_pending = Gauge("bcd_kubernetes_releases_pending", "Kubernetes releases waiting for pods to let go", registry=reg)
        self.m_pending_age = Gauge("bcd_kubernetes_release_oldest_age_seconds", "Age of the oldest pending Kubernetes release", registry=reg)
        self.m_unreadable = Gauge(
            "bcd_kubernetes_releases_unreadable",
            "1 while condition KubernetesReleasesUnreadable is True (releasing.json was unreadable: every GPU counts as claimed)",
            registry=reg,
        )
        self.m_switches = Counter(
            "bcd_vfio_switch_requests", "Driver switches asked of vfio_switcher, by target and outcome", ["target", "outcome"], registry=reg
        )
        self.m_vfio = Gauge("bcd_vfio_recorded_gpus", "GPUs in the converger's VFIO record", registry=reg)
        self.m_gpu_ops = Counter("bcd_gpu_operations", "Maintenance operations (reset, diag) by outcome", ["op", "outcome"], registry=reg)
        self.m_gpu_ops_running = Gauge("bcd_gpu_operations_running", "Maintenance operations running now", ["op"], registry=reg)
        self.m_diag = Gauge("bcd_gpu_diag_passed", "1 when the card's last diagnostic at that level passed, 0 when it did not", ["pci_address", "level"], registry=reg)
        for op in gpuops.OPS:
            self.m_gpu_ops_running.labels(op=op).set(0)
        # the journal's last results, so the gauge is right after a restart (the counter starts afresh)
        for r in self.state.gpu_op_results.values():
            self._diag_gauge(r)

        self.m_claims = Gauge("bcd_dra_claims", "DRA claims held as holds, by state", ["state"], registry=reg)
        self.m_claim_ops = Counter("bcd_dra_claim_operations", "DRA claim prepares and unprepares, by outcome", ["op", "outcome"], registry=reg)
        self.m_claim_sharing = Gauge(
            "bcd_dra_claim_devices", "Devices of prepared DRA claims, by how they are shared (Exclusive, TimeSlicing, MPS, Vfio) and whether a share", ["strategy", "share"], registry=reg
        )
        self._share_cards: set[str] = set()
        self.m_mps_daemons = Gauge("bcd_dra_mps_daemons", "MPS control daemons of DRA claims, running or being started or stopped", registry=reg)
        self.m_share_percent = Gauge("bcd_gpu_share_percent", "What DRA claims' shares take of a card, in percent (at most 100)", ["pci_address"], registry=reg)
        self._claims_gauge()

    def _claims_gauge(self) -> None:
        claims = list(self.state.claims.values())
        for st in ("preparing", "prepared", "unpreparing"):
            self.m_claims.labels(state=st).set(sum(1 for r in claims if r.state == st))
        prepared = [d for r in claims if r.state == "prepared" for d in r.devices]
        for strategy in ("Exclusive", "TimeSlicing", "MPS", "Vfio"):
            for share in ("true", "false"):
                n = sum(1 for d in prepared if d.sharing.strategy == strategy and (share == "true") == d.shared)
                self.m_claim_sharing.labels(strategy=strategy, share=share).set(n)
        self.m_mps_daemons.set(sum(1 for r in claims if r.mps is not None))
        shares: dict[str, int] = {}
        for d in (d for r in claims for d in r.devices if d.shared):
            shares[d.pci] = shares.get(d.pci, 0) + d.percent
        for pci in set(self._share_cards) - set(shares):
            self.m_share_percent.remove(pci)
        for pci, percent in shares.items():
            self.m_share_percent.labels(pci_address=pci).set(percent)
        self._share_cards = set(shares)

    def _count_interrupted(self, ops: list[GpuOp]) -> None:
        for op in ops:
            self.m_gpu_ops.labels(op=op.op, outcome=op.outcome).inc()

    # ------------------------------------------------------------------ endpoints

    async def take_spec(self, spec: NodeSpec, body: bytes = b"") -> SpecAck:
        if spec.node_id != self.opts.node_id:
            raise Refused(f"spec is for node {spec.node_id}, this is {self.opts.node_id}", code="400")
        current = self.spec.generation if self.spec is not None else -1
        if spec.generation < current:
            raise Refused(f"generation {spec.generation} is lower than the applied {current}", code="409")
        if self.spec is not None and spec == self.spec:
            return SpecAck(generation=spec.generation, changed=False)
        if spec.generation == current:
            raise Refused(f"generation {spec.generation} is already applied with different content", code="409")
        # decoded already (within its bounds): what the typed spec dropped is named here
        unknown = tuple(str(f) for f in unknown_fields_of_json(NodeSpec, body)) if body else ()
        await asyncio.to_thread(self.store.save_spec, spec, bytes(body) if unknown else None)
        self.spec, self.spec_unknown = spec, unknown
        self.ctx.log.info("spec accepted", generation=spec.generation, assignments=len(spec.devices), instances=len(spec.instances))
        if unknown:
            self.ctx.log.warning("the spec carries fields this node does not know; ignored", generation=spec.generation, fields=list(unknown[:20]), count=len(unknown))
        self.loop.trigger(f"spec generation {spec.generation}")
        return SpecAck(generation=spec.generation)

    async def request_pass(self, _: Empty) -> SpecAck:
        self.loop.trigger("requested")
        return SpecAck(generation=self.spec.generation if self.spec else -1, changed=False)

    # ------------------------------------------------------------------ DRA claims

    async def claim_prepare(self, req: ClaimPrepareRequest) -> ClaimPrepareReply:
        async with self.lock:
            await self._reconcile_claims()
            reply = await self.keeper.prepare(req)
        self.m_claim_ops.labels(op="prepare", outcome="ok" if reply.ok else reply.reason or "refused").inc()
        self._claims_gauge()
        await self._publish_claims()
        return reply

    async def claim_unprepare(self, req: ClaimUnprepareRequest) -> ClaimUnprepareReply:
        async with self.lock:
            await self._reconcile_claims()
            reply = await self.keeper.unprepare(req.uid)
        self.m_claim_ops.labels(op="unprepare", outcome="ok" if reply.ok else "failed").inc()
        self._claims_gauge()
        await self._publish_claims()
        # a hold or switch that waited for the card goes now
        self.loop.trigger(f"claim {req.uid} unprepared")
        return reply

    async def _reconcile_claims(self) -> None:
        """Once per start, with the inventory known (under the lock): claims cut short by the last stop."""
        if self.claims_reconciled:
            return
        inv = await self._inventory_now()
        if inv is None:
            return
        self.claims_reconciled = True
        # always: with no claim on record an MPS daemon may still be left to stop
        await self.keeper.reconcile(inv)
        self._claims_gauge()

    async def _inventory_now(self) -> Inventory | None:
        """The inventory as the inventory service has it now (after a MIG step it rescanned)."""
        await self._fetch_inventory(wake=False)
        return self.inventory

    async def _mig_step_call(self, req: MigInstanceRequest) -> MigInstanceReply:
        return await call(self.ctx.nc, self.ctx.subjects.inventory_mig_instance, req, MIG_INSTANCE_REPLY_CODEC, timeout=gpuops.MIG_STEP_TIMEOUT_S)

    async def _sharing_step_call(self, req: SharingStepRequest) -> SharingStepReply:
        return await call(self.ctx.nc, self.ctx.subjects.inventory_sharing, req, SHARING_STEP_REPLY_CODEC, timeout=SHARING_STEP_TIMEOUT_S)

    def _claim_switch(self, switcher: BusSwitcher) -> Callable[[SwitchRequest], Awaitable[SwitchReply]]:
        """A DRA claim's switch: counted like the pass's, and the inventory rescans on the switcher's notice."""

        async def switch(req: SwitchRequest) -> SwitchReply:
            reply = await switcher.switch(req)
            self.m_switches.labels(target=req.target, outcome=reply.outcome).inc()
            return reply

        return switch

    async def _claim_holds_now(self) -> dict[str, HoldOnDisk]:
        holds = await asyncio.to_thread(self._holds)
        return {a: h for a, h in holds.items() if h.binding == BINDING_CLAIM}

    def _holds(self) -> dict[str, HoldOnDisk]:
        return read_disk(self.opts.cdi_dir, self.opts.run_dir, warned=self.warned).holds

    def _disk_now(self) -> tuple[DiskView, str]:
        """The hold directories as read now, and why the vendor CDI spec does not read ("" when it does)."""
        disk = read_disk(self.opts.cdi_dir, self.opts.run_dir, warned=self.warned, consumer_dir=self.consumer_dir)
        try:
            self.vendor.get()
        except VendorSpecError as exc:
            return disk, str(exc)
        return disk, ""

    async def status(self, _: Empty) -> ConvergerStatus:
        disk, vendor_error = await asyncio.to_thread(self._disk_now)
        holds = disk.holds
        vendor = Path(self.opts.cdi_dir) / VENDOR_CDI_FILE
        problems = [*disk.problems, *(p for p in (self.outbox.warning, self.outbox.error) if p)]
        pending, _ = await asyncio.to_thread(self.releases.peek)
        freed = await asyncio.to_thread(self.releases.freed) if pending else set()
        drift = journal_disagreements(self.state, disk, pending)
        return ConvergerStatus(
            drift=bounded_problems(drift),
            pending_releases=[
                PendingReleaseSummary(
                    allocation_id=r.allocation_id,
                    reservation_id=r.reservation_id,
                    generation=r.generation,
                    devices=list(r.devices),
                    since=r.since,
                    freed=r.allocation_id in freed,
                )
                for r in sorted(pending.values(), key=lambda r: (r.since, r.allocation_id))
            ],
            generation=self.spec.generation if self.spec else None,
            section=self.state.last_section,
            holds=[
                HoldSummary(
                    allocation_id=h.allocation_id,
                    reservation_id=h.reservation_id,
                    generation=h.generation,
                    binding=h.binding,
                    devices=list(h.devices),
                    cgroup_parent=h.cgroup_parent,
                    reported=h.allocation_id in self.state.reported,
                    condition=self.state.hold_conditions.get(h.allocation_id),
                )
                for h in sorted(holds.values(), key=lambda h: h.allocation_id)
            ],
            failures=dict(self.failures),
            vfio_notes=bounded_problems(sorted(self.vfio_noted)),
            last_pass_at=self.last_pass_at,
            next_retry_in_s=self.loop.next_retry_in(),
            privileged=self.privileged,
            bindings=sorted(self.config.supported_bindings),
            # lexists: a symlink or FIFO there is a vendor spec that does not read, not a missing one
            vendor_cdi_spec=str(vendor) if os.path.lexists(vendor) else "",
            vendor_cdi_error=clip(vendor_error),
            problems=bounded_problems(problems),
            outbox_warning=clip(self.outbox.warning),
            outbox_error=clip(self.outbox.error),
            conditions=sorted(self.state.conditions.values(), key=lambda c: c.type)[:PROBLEMS_MAX],
            system_reserve_bytes=self.opts.system_reserve_bytes,
            gpu_ops=[*sorted(self.state.gpu_ops.values(), key=lambda o: o.pci), *sorted(self.state.gpu_op_results.values(), key=lambda o: (o.pci, o.op))],
            mig_layouts=self._mig_states(),
            claims=self.keeper.summaries(),
        )

    def _card_claims(self, inv: Inventory, holds: dict[str, HoldOnDisk] | None = None) -> list[GpuClaim]:
        """Every card's claims, read now: holds on disk (or as just read), intents, releasing.json, spec, domains."""
        if holds is None:
            holds = self._holds()
        pending, unreadable = self.releases.peek()
        dra = claim_holders({a: h for a, h in holds.items() if h.binding == BINDING_CLAIM}, self.state.claims)
        return card_claims(
            inventory=inv,
            holds={a: h.devices for a, h in holds.items() if h.binding != BINDING_CLAIM},
            dra_claims={holder: atoms for holder, atoms in dra.values()},
            intents={a: i.devices for a, i in self.state.intents.items()},
            pending={a: r.devices for a, r in pending.items()},
            releases_unreadable=unreadable,
            spec=self.spec,
            domain_gpus=dict(self.state.domain_gpus),
        )

    async def holder(self, q: HolderQuery) -> HolderReply:
        inv = self.inventory
        gpu = None
        if inv is not None:
            gpu = next((g for g in inv.gpus if q.gpu in (g.pci_address, g.atom_id)), None)
        if gpu is None or inv is None:
            raise Refused(f"{q.gpu} is not a GPU of this node", code="404")
        claims = await asyncio.to_thread(self._card_claims, inv)
        first = next((c for c in claims if c.pci_address == gpu.pci_address), None)
        if first is None:
            return HolderReply(held=False, gpu=gpu.pci_address)
        kind = first.kind
        if kind == "claim" and self._passes_through(first.holder, gpu.pci_address):
            # a DRA claim that passes the card through (VfioDeviceConfig): the converger asks for
            # its switches itself, as for an instance; the switcher lets those through, not a reset
            kind = PASSTHROUGH_CLAIM
        return HolderReply(held=True, kind=kind, holder=first.holder, gpu=gpu.pci_address)

    def _passes_through(self, holder: str, pci: str) -> bool:
        return any(rec.holder == holder and any(d.pci == pci and d.sharing.strategy == "Vfio" for d in rec.devices) for rec in self.state.claims.values())

    async def _claims_now(self, holds: dict[str, HoldOnDisk] | None = None) -> Claims | None:
        inv = self.inventory
        if inv is None:
            await self._fetch_inventory()
            inv = self.inventory
        if inv is None:
            return None
        claims = await asyncio.to_thread(self._card_claims, inv, holds)
        return Claims(
            claims=claims,
            vfio=sorted(self.state.vfio),
            generation=self.spec.generation if self.spec is not None else None,
            at=datetime.now(timezone.utc),
            mig_layouts=self._mig_states(),
        )

    def _mig_states(self) -> list[MigLayoutState]:
        return [
            MigLayoutState(pci_address=pci, layout=r.layout, state=r.state, message=clip(r.message), since=r.since)
            for pci, r in sorted(self.state.mig_layouts.items())
        ]

    async def claims(self, _: Empty) -> Claims:
        c = await self._claims_now()
        if c is None:
            raise Refused("no inventory yet: claims cannot be matched to cards", code="503")
        return c

    async def _publish_claims(self, holds: dict[str, HoldOnDisk] | None = None) -> None:
        """Publish the claims when they changed since the last publication (and the first time)."""
        c = await self._claims_now(holds)
        if c is None:
            return
        # a new generation with the same claims is nothing new for the inventory
        key = (c.claims, c.vfio, [(m.pci_address, m.layout, m.state, m.message) for m in c.mig_layouts])
        if key == self.claims_sent:
            return
        try:
            await self.ctx.nc.publish(self.ctx.subjects.converger_claims_changed, CLAIMS_CODEC.encode_valid(c))
        except Exception as exc:  # noqa: BLE001 - published again after the next pass
            self.ctx.log.warning("claims not published; next pass tries again", error=str(exc) or type(exc).__name__)
            return
        self.claims_sent = key
        self.ctx.log.info("claims published", cards=len({x.pci_address for x in c.claims}), vfio=c.vfio, generation=c.generation)

    # ------------------------------------------------------------------ the pass

    def _take_inventory(self, inv: Inventory, *, wake: bool) -> None:
        """Keep `inv` as the inventory; with `wake`, run a pass when it plans differently.

        Every way an inventory arrives goes through here, so a pass that waited for
        one (no inventory yet) is woken by whichever comes first: the notice, or the
        read the claims endpoint makes when the inventory asks for claims before its
        own first notice reached us. Without that, the pass waited for the retry
        interval (30 s), as a node's first spec did when it came before the inventory.
        """
        before, self.inventory = self.inventory, inv
        # a claims change (our own pass's) rewrites only what the planner does not
        # read: the next pass sees the new inventory, but none runs for it alone
        if wake and (before is None or planner_view(before) != planner_view(inv)):
            self.loop.trigger("inventory changed")

    async def _fetch_inventory(self, *, wake: bool = True) -> None:
        """Read the inventory now. `wake=False` inside a pass, which uses what it read."""
        try:
            inv = await call(self.ctx.nc, self.ctx.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=3)
        except (ServiceCallError, BadMessage, Exception) as exc:  # noqa: BLE001 - logged, retried
            self.ctx.log.warning("inventory not available yet; waiting for it", error=str(exc) or type(exc).__name__)
            return
        if self.inventory is None or inv.revision >= self.inventory.revision:
            self._take_inventory(inv, wake=wake)

    # ------------------------------------------------------------------ maintenance (gpuops.py)

    async def gpu_op(self, req: GpuOpRequest) -> GpuOpReply:
        """Start a reset or a diagnostic on one card: checked and journaled under the pass lock, run after."""
        problem = gpuops.check_request(req)
        if problem:
            return GpuOpReply(accepted=False, message=problem)
        async with self.lock:
            inv = self.inventory
            if inv is None:
                await self._fetch_inventory(wake=False)
                inv = self.inventory
            if inv is None:
                return GpuOpReply(accepted=False, message=f"refused {req.pci}: no inventory yet, so whether anything holds it is not known")
            if req.op == "mig-layout":
                return await self._set_mig_layout(req, inv)
            claims = await asyncio.to_thread(self._card_claims, inv)
            problem = gpuops.refusal(req, (g.pci_address for g in inv.gpus), claims, self.state.gpu_ops)
            if problem:
                self.ctx.log.info("maintenance operation refused", op=req.op, pci=req.pci, level=req.level, reason=problem)
                self.m_gpu_ops.labels(op=req.op, outcome="Refused").inc()
                return GpuOpReply(accepted=False, message=problem)
            op = gpuops.new_op(req, now=datetime.now(timezone.utc), boot_id=self.state.boot_id)
            # recorded first: from here the card is claimed, and a crash finishes it as Interrupted
            self.state.gpu_ops[req.pci] = op
            await asyncio.to_thread(self.store.save, self.state)
        self._start_op(op)
        return GpuOpReply(accepted=True, message=f"{op.op} of {op.pci} started ({op.id})", op=op)

    async def _set_mig_layout(self, req: GpuOpRequest, inv: Inventory) -> GpuOpReply:
        """`bcd gpu mig-layout`: the card's desired layout, journaled; a pass applies it once nothing holds the card."""
        gpu = next((g for g in inv.gpus if g.pci_address == req.pci), None)
        if gpu is None:
            return GpuOpReply(accepted=False, message=f"refused {req.pci}: the inventory lists no GPU at that address")
        profiles, disable = gpuops.parse_layout(req.layout)
        problem = gpuops.layout_problem(gpu, profiles, disable)
        if problem:
            return GpuOpReply(accepted=False, message=f"refused {req.pci}: {problem}")
        layout = gpuops.layout_text(profiles, disable)
        self.state.mig_layouts[req.pci] = MigLayoutRecord(layout=layout, source="operator", since=datetime.now(timezone.utc))
        await asyncio.to_thread(self.store.save, self.state)
        self.ctx.log.info("MIG layout set", pci=req.pci, layout=layout)
        self.loop.trigger(f"MIG layout of {req.pci} set")
        return GpuOpReply(accepted=True, message=f"MIG layout of {req.pci} set to {layout}: applied once nothing holds the card")

    async def _mig_step(self) -> None:
        """After a pass: where every desired MIG layout stands; a free card's layout is started."""
        if not self.state.mig_layouts or self.inventory is None:
            return
        async with self.lock:
            inv = self.inventory
            claims = await asyncio.to_thread(self._card_claims, inv)
            plan = gpuops.plan_mig_layouts(
                self.state.mig_layouts, {g.pci_address: g for g in inv.gpus}, claims, self.state.gpu_ops, boot_id=self.state.boot_id
            )
            now = datetime.now(timezone.utc)
            changed, started = False, []
            for pci, (state, message) in plan.items():
                rec = self.state.mig_layouts[pci]
                if state == "start":
                    op = gpuops.new_op(GpuOpRequest(op="mig-layout", pci=pci, layout=rec.layout), now=now, boot_id=self.state.boot_id)
                    self.state.gpu_ops[pci] = op
                    state, message = "Applying", f"{op.id} runs"
                    started.append(op)
                if (state, message) != (rec.state, rec.message):
                    if state != rec.state:
                        rec.since = now
                        self.ctx.log.info("MIG layout", pci=pci, layout=rec.layout, state=state, detail=message)
                    rec.state, rec.message = state, message
                    changed = True
            if changed or started:
                await asyncio.to_thread(self.store.save, self.state)
        for op in started:
            self._start_op(op)

    def _start_op(self, op: GpuOp) -> None:
        """Run a journaled operation in the background (its result comes back through the journal)."""
        self.m_gpu_ops_running.labels(op=op.op).inc()
        self.ctx.log.info("maintenance operation started", op=op.op, id=op.id, pci=op.pci, level=op.level, layout=op.layout, claims_card=op.claims_card)
        task = asyncio.create_task(self._run_gpu_op(op), name=f"gpu op {op.id}")
        self.op_tasks.add(task)
        task.add_done_callback(self.op_tasks.discard)

    async def _run_gpu_op(self, op: GpuOp) -> None:
        ctx = self.ctx
        try:
            if op.op == "reset":
                reply = await call(
                    ctx.nc, ctx.subjects.vfio_switch, SwitchRequest(pci=op.pci, target="reset", why=f"bcd gpu reset ({op.id})"),
                    SWITCH_REPLY_CODEC, timeout=gpuops.RESET_TIMEOUT_S,
                )
                outcome, message = reply.outcome, reply.message
            elif op.op == "mig-layout":
                mig = await self._mig(op)
                outcome = mig.outcome
                message = mig.message + (f"; the card was left {mig.left}" if mig.left and outcome != "Applied" else "")
            else:
                answer = await self._diag(op)
                outcome = answer.outcome
                message = answer.message + (f" (failed: {', '.join(answer.failures)})" if answer.failures else "")
        except asyncio.CancelledError:
            raise  # stopping: the journal still says running; the next start finishes it as Interrupted
        except Exception as exc:  # noqa: BLE001 - the answer did not come: that is the outcome
            who = "vfio_switcher" if op.op == "reset" else "the inventory"
            outcome = "Failed" if op.op == "reset" else "Error"
            message = str(exc) if isinstance(exc, JobTimeout) else f"{who} did not answer: {type(exc).__name__}: {exc}".rstrip(": ")
        done = gpuops.finished(op, outcome, clip(message), now=datetime.now(timezone.utc))
        async with self.lock:
            if self.state.gpu_ops.get(op.pci) == op:
                del self.state.gpu_ops[op.pci]
            self.state.gpu_op_results[gpuops.result_key(done)] = done
            rec = self.state.mig_layouts.get(op.pci) if op.op == "mig-layout" else None
            if rec is not None and rec.layout == op.layout:
                rec.since = done.finished_at or rec.since
                if outcome == "Applied":
                    rec.state, rec.message = "Applied", message
                elif outcome == "DisruptionRequired":
                    # the existing disruption path says what to do (Reconfiguring on the card); not again in this boot
                    rec.state, rec.blocked_boot = "Pending", self.state.boot_id
                    rec.message = f"{message}: waits for a GPU reset or a node reboot (Reconfiguring=DisruptionRequired)"
                else:
                    rec.state, rec.message = "Failed", message
            await asyncio.to_thread(self.store.save, self.state)
        self.m_gpu_ops_running.labels(op=op.op).dec()
        self._count_op(done)
        (ctx.log.info if outcome in gpuops.OK_OUTCOMES else ctx.log.warning)(
            "maintenance operation done", op=op.op, id=op.id, pci=op.pci, level=op.level, outcome=outcome, detail=message
        )
        # the card is free again: holds and switches that waited for it go now
        self.loop.trigger(f"{op.op} of {op.pci} done")

    async def _job(self, subject: str, req: Any, codec: Any, timeout: float, what: str) -> Any:
        """Start an inventory job (a diagnostic, a MIG layout change), then poll it until it ends: an
        inventory that restarts meanwhile answers that it knows no such job. Unanswered polls are
        retried until `timeout`; then JobTimeout, whose text is the operation's message."""
        ctx = self.ctx
        deadline = time.monotonic() + timeout
        answer = await call(ctx.nc, subject, req, codec, timeout=gpuops.POLL_TIMEOUT_S)
        poll = msgspec.structs.replace(req, poll=True)
        unanswered = ""
        while answer.outcome == "Running":
            if time.monotonic() > deadline:
                raise JobTimeout(f"the {what} did not end in {timeout:.0f} s" + unanswered)
            await asyncio.sleep(gpuops.POLL_INTERVAL_S)
            try:
                answer = await call(ctx.nc, subject, poll, codec, timeout=gpuops.POLL_TIMEOUT_S)
                unanswered = ""
            except (nats.errors.Error, TimeoutError, ServiceCallError) as exc:
                unanswered = f"; the inventory did not answer the last poll ({type(exc).__name__})"
        return answer

    async def _mig(self, op: GpuOp) -> Any:
        profiles, disable = gpuops.parse_layout(op.layout)
        req = MigLayoutRequest(pci=op.pci, profiles=list(profiles), disable=disable, op_id=op.id)
        return await self._job(self.ctx.subjects.inventory_mig_layout, req, MIG_LAYOUT_REPLY_CODEC, gpuops.MIG_TIMEOUT_S, "MIG layout change")

    async def _diag(self, op: GpuOp) -> Any:
        req = DiagRequest(pci=op.pci, level=op.level, op_id=op.id)
        timeout = gpuops.DIAG_TIMEOUT_S.get(op.level, 3600.0)
        return await self._job(self.ctx.subjects.inventory_diag, req, DIAG_REPLY_CODEC, timeout, f"level {op.level} diagnostic")

    def _count_op(self, op: GpuOp) -> None:
        if op.state != "done":
            return
        self.m_gpu_ops.labels(op=op.op, outcome=op.outcome).inc()
        self._diag_gauge(op)

    def _diag_gauge(self, op: GpuOp) -> None:
        if op.op == "diag" and op.outcome in ("Passed", "Failed"):
            self.m_diag.labels(pci_address=op.pci, level=str(op.level)).set(1 if op.outcome == "Passed" else 0)

    async def run_pass(self, reason: str) -> bool:
        """One pass, then the claims if they changed; returns True when something is left to retry."""
        if self.helper_writer is not None and not self.privileged:
            await self._helper_look()
        self.holds_after_pass = None
        if not self.claims_reconciled:
            async with self.lock:
                await self._reconcile_claims()
        retry = await self._pass(reason)
        try:
            await self._mig_step()
        except Exception:  # noqa: BLE001 - the next pass looks again
            self.ctx.log.exception("MIG layout step failed")
        # the hold directories as the pass left them, read once for the metric and the claims
        await self._publish_claims(self.holds_after_pass)
        return retry

    def _watched_dirs(self) -> list[Path | None]:
        return [Path(self.opts.cdi_dir), Path(self.opts.run_dir) / ENV_SUBDIR, self.consumer_dir]

    async def _pass(self, reason: str) -> bool:
        async with self.lock:
            try:
                return await self._pass_locked(reason)
            finally:
                # what the pass left: a later change is someone else's (the watch wakes a pass)
                self.dirs_seen = await asyncio.to_thread(dirs_signature, self._watched_dirs())

    async def _watch_hold_dirs(self, stopping: asyncio.Event) -> None:
        """Every --watch-interval: the hold directories changed since the last pass (a spec, env
        file or consumer copy removed or edited from outside): wake a pass, which puts them back."""
        guard = LoopGuard(self.ctx.log, "hold directory watch")
        while not stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.opts.watch_interval)
            async with guard:
                if stopping.is_set() or self.lock.locked() or self.dirs_seen is None:
                    continue
                now = await asyncio.to_thread(dirs_signature, self._watched_dirs())
                if now != self.dirs_seen and not self.lock.locked():
                    self.dirs_seen = now
                    self.ctx.log.info("hold directories changed outside a pass: a pass puts them right")
                    self.loop.trigger("hold files changed")

    async def _pass_locked(self, reason: str) -> bool:
        if self.spec is None:
            return False
        if self.inventory is None:
            await self._fetch_inventory(wake=False)
            if self.inventory is None:
                return True
        spec, log = self.spec, self.ctx.log
        with self.m_pass.time():
            await self.outbox.recheck()
            facts = await release_facts(self.releases, self.reaper, self.opts.cdi_dir, self.opts.run_dir)
            observed = await asyncio.to_thread(
                observe,
                releases=facts,
                spec=spec,
                cdi_dir=self.opts.cdi_dir,
                run_dir=self.opts.run_dir,
                slices=self.slices,
                inventory=self.inventory,
                domains=self.domains,
                state=self.state,
                warned=self.warned,
                switched=self.applier.switched,
                spec_unknown_fields=self.spec_unknown,
                consumer_dir=self.consumer_dir,
            )
            observed = dataclasses.replace(observed, maintenance=gpuops.maintenance_claims(self.state.gpu_ops))
            # a success the inventory already shows no longer needs remembering
            for pci in [pci for pci in self.applier.switched if pci not in observed.switched]:
                del self.applier.switched[pci]
            p = plan(spec, observed, self.config)
            for note in p.notes:
                log.warning(note)
            # a card that waits is noted at every retry: WARN once, then DEBUG while it lasts
            for note in p.vfio_notes:
                (log.debug if note in self.vfio_noted else log.warning)(note)
            self.vfio_noted = set(p.vfio_notes)
            new_failures = [f for f in p.failures if self.state.reported_failures.get(f.allocation_id) != spec.generation]
            result = await self.applier.apply(p, self.state)
        if result.switch_requests:
            # the inventory rescans on the switcher's notice (inventory.changed
            # follows); read it now too, in case that came before our reply
            await self._fetch_inventory()
        self.m_vfio.set(len(self.state.vfio))
        self.last_pass_at = datetime.now(timezone.utc)
        self.pending = {a: r for a, r in facts.pending.items() if a in p.pending}
        self.m_pending.set(len(p.pending))
        oldest = min((r.since for r in facts.pending.values() if r.allocation_id in p.pending), default=None)
        self.m_pending_age.set((self.last_pass_at - oldest).total_seconds() if oldest else 0)
        unreadable = self.state.conditions.get(UNREADABLE)
        self.m_unreadable.set(1 if unreadable is not None and unreadable.status == "True" else 0)
        self.failures = {f.allocation_id: f.reason for f in p.failures}
        for f in new_failures:
            self.m_failures.labels(reason=f.reason).inc()
        section = result.section
        outcome = "retry" if result.retry else ("failed" if p.failures else "converged")
        self.m_passes.labels(outcome=outcome).inc()
        self.m_generation.set(spec.generation)
        if section is not None:
            self.m_section.clear()
            self.m_section.labels(state=section.state).set(1)
        holds_now = self.holds_after_pass = await asyncio.to_thread(self._holds)
        self.m_holds.clear()
        for binding in ("BINDING_HOLD", "BINDING_KUBERNETES"):
            self.m_holds.labels(binding=binding).set(sum(1 for h in holds_now.values() if h.binding == binding))
        # the device plugin advertises the Kubernetes holds: a hint when they changed
        kube_now = {a: (h.generation, h.devices) for a, h in holds_now.items() if h.binding == "BINDING_KUBERNETES"}
        if kube_now != self.kube_holds_seen:
            self.kube_holds_seen = kube_now
            await self.consumers.holds_changed()
        fields = dict(reason=reason, generation=spec.generation, steps=len(p.steps), done=result.done)
        if result.vfio_retry or p.vfio_waiting:
            fields.update(vfio_retry_in_s=self.opts.retry_interval, vfio_waiting=list(p.vfio_waiting))
        if result.retry:
            # seed: section failures are logged WARN while retrying, ERROR when failed
            log.warning("pass incomplete; retrying", errors=result.errors, retry_in_s=self.opts.retry_interval, **fields)
        elif p.failures:
            log.error("section failed", failures={f.allocation_id: f"{f.reason}: {f.message}" for f in p.failures}, **fields)
        elif p.steps:
            log.info("pass converged", **fields)
        else:
            log.debug("nothing to do", **fields)
        # the reaper keeps its watches in memory: ask again for every pending
        # release (idempotent there), so a restarted reaper resumes evicting
        for alloc in p.pending:
            rel = self.pending.get(alloc) or facts.pending.get(alloc)
            if rel is not None:
                await self.reaper.evict(alloc, list(rel.devices))
        # a pending Kubernetes release is rechecked every retry interval (the
        # reaper's "freed" message usually comes first)
        # a driver switch refused, failed or unanswered, or waiting for a hold
        # to go, is asked for again at the next retry interval
        return result.retry or bool(p.pending) or result.vfio_retry or bool(p.vfio_waiting)

    # ------------------------------------------------------------------ the root helper

    async def _look_for_helper(self) -> bool:
        """Does a root helper answer that writes where this converger reads?"""
        info, why = await find_helper(self.ctx.nc, self.ctx.subjects)
        if info is not None:
            why = helper_mismatch(
                info, self.opts.cdi_dir, self.opts.run_dir, self.helper_writer.slices_backend if self.helper_writer else "", self.consumer_dir
            )
            if not why and self.helper_writer is not None:
                self.helper_writer.info = info
                return True
            if why != self.helper_note:
                self.ctx.log.error("a root helper answers but cannot serve this converger", why=why)
        self.helper_note = why
        return False

    async def _helper_look(self) -> None:
        """One look at the root helper (--writer auto): promote or demote the node as watch_helper says."""
        answered = await self._look_for_helper()
        watch = HelperWatch(privileged=self.privileged, gone_since=self.helper_gone_since)
        # --writer helper: the helper is required, never given up on (its writes fail, retried)
        lost_after = self.opts.helper_lost_after if self.opts.writer == "auto" else 0.0
        watch, action = watch_helper(watch, answered=answered, now=time.monotonic(), lost_after=lost_after)
        if watch.gone_since is not None and self.helper_gone_since is None:
            self.ctx.log.warning(
                "the root helper does not answer",
                why=self.helper_note,
                unprivileged_in_s=lost_after if lost_after > 0 else None,
            )
        elif answered and self.helper_gone_since is not None:
            self.ctx.log.info("the root helper answers again")
        self.helper_gone_since = watch.gone_since
        if action == "promote":
            await self._set_privileged(True, "root helper found: holds bind through it from now on")
        elif action == "demote":
            await self._set_privileged(
                False,
                "root helper gone: the node is unprivileged until it answers again "
                "(new plain holds fail with node-unprivileged; kept holds stay)",
            )

    async def _set_privileged(self, privileged: bool, why: str) -> None:
        if self.privileged == privileged:
            return
        self.privileged = privileged
        self.config = dataclasses.replace(self.config, privileged=privileged)
        if privileged:
            self.ctx.log.info(why)
        else:
            self.ctx.log.warning(why, why_not=self.helper_note)
        # the bridge reads the status again and sends a Hello with the capabilities as they are now
        with contextlib.suppress(Exception):
            await self.ctx.nc.publish(self.ctx.subjects.converger_status_changed, b"")
        self.loop.trigger("root helper found" if privileged else "root helper gone")

    async def _watch_helper(self, stopping: asyncio.Event) -> None:
        """--writer auto: look for the root helper while unprivileged (every --helper-recheck-interval;
        every second in the first half minute: a helper started at the same time connects late),
        and make sure it still answers while privileged through it (every 5 s at most, every second
        once it has missed one; --helper-lost-after of silence makes the node unprivileged again)."""
        started = asyncio.get_running_loop().time()
        guard = LoopGuard(self.ctx.log, "helper watch")
        while not stopping.is_set():
            interval = self.opts.helper_recheck_interval
            if self.privileged:
                interval = min(interval, 5.0)
            if self.helper_gone_since is not None or asyncio.get_running_loop().time() - started < 30:
                interval = min(interval, 1.0)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), interval)
            async with guard:
                if not stopping.is_set():
                    await self._helper_look()

    async def run(self, ctx: ServiceContext) -> None:
        # the endpoints answer now: a bridge holding a spec for us hands it over at once
        # instead of at its next retry
        with contextlib.suppress(Exception):
            await ctx.nc.publish(ctx.subjects.converger_status_changed, b"")
        async with asyncio.TaskGroup() as tasks:
            if self.helper_writer is not None and (self.opts.writer == "auto" or not self.privileged):
                tasks.create_task(self._watch_helper(ctx.stopping), name="converger.helper-watch")
            if self.opts.watch_interval > 0:
                tasks.create_task(self._watch_hold_dirs(ctx.stopping), name="converger.hold-dir-watch")
            await self.loop.run(ctx.stopping)

    async def close(self, ctx: ServiceContext) -> None:
        # an operation cut short stays "running" in the journal: the next start says Interrupted
        for task in list(self.op_tasks):
            task.cancel()
        for task in list(self.op_tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.helper_writer is not None:
            await asyncio.to_thread(self.helper_writer.close)


class JobTimeout(Exception):
    """An inventory job (diagnostic, MIG layout change) did not end in time; the text says which."""


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
            raise ValueError(problem.removeprefix("refused: ").removeprefix(f"refused {pci}: "))
        profiles, disable = gpuops.parse_layout(layout)
        out[pci] = gpuops.layout_text(profiles, disable)
    return out


def bounded_problems(problems: list[str]) -> list[str]:
    """At most PROBLEMS_MAX, each clipped to its bound; the last says how many more there are."""
    out = [clip(p) for p in dict.fromkeys(problems)]
    if len(out) > PROBLEMS_MAX:
        out = [*out[: PROBLEMS_MAX - 1], f"... and {len(out) - PROBLEMS_MAX + 1} more"]
    return out


main = main_for(ConvergerApp)

__all__ = ["ConvergerApp", "main"]
