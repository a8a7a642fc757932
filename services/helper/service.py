"""The root helper as a micro service: five operations for an unprivileged converger, and `info`.

- `bcd.<n>.helper.file.write`    HelperFileWrite  -> HelperReply
- `bcd.<n>.helper.file.copy`     HelperFileCopy   -> HelperReply (a hold spec's consumer copy)
- `bcd.<n>.helper.file.remove`   HelperFileRemove -> HelperReply
- `bcd.<n>.helper.slice.apply`   HelperSliceApply -> HelperReply
- `bcd.<n>.helper.slice.remove`  HelperSliceRemove -> HelperReply
- `bcd.<n>.helper.info`          Empty -> HelperInfo (where it writes; the converger's probe)

Only the converger's NATS user may publish to these subjects
(shared/subjects.py). Every request is answered with a HelperReply, as
vfio_switcher answers: `done`, or `refused` with the reason (a body that does
not decode, an unknown field, a bad id, a foreign slice name, limits out of
bounds, an env key no spec may set (bcd's own, `LD_*`, `PATH`, `NVIDIA_*`, ...:
shared.schemas.common.env_key_problem), a passthrough card whose IOMMU group is not
that listed GPU's - nothing is written), or `failed` with the
reason (the host failed it; the converger retries). Each done operation is
logged at INFO (an audit trail of what root wrote), each refusal at WARNING.

Options: `--cdi-dir`, `--cdi-consumer-dir` and `--run-dir` (the converger must be given the same:
it reads the holds back from there, and checks `info` before it relies on
the helper), `--slices fake|systemd` (auto: fake on a fake host, as the
converger chooses), `--mps-pipe-dir` (the MPS pipe directory put into a
slot hold's files; by default the fake host's, else NVIDIA's /tmp/nvidia-mps,
as the inventory reports it), `--sysfs-root` (where it reads IOMMU groups; on
a fake host it reads them from the host file instead).

The one request it makes: `bcd.<n>.inventory.get`, when a hold passes a card
through, to tie its IOMMU group to a GPU the inventory lists (iommu.py); no
answer within BUS_TIMEOUT_S refuses the write.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import Counter

from shared.fsutil import read_regular
from shared.holdfiles import checked_consumer_dir, default_consumer_dir, default_mps_root
from shared.host import HOST_FILE_MAX_BYTES
from shared.runtime import Option, ServiceApp, ServiceContext, StartupError, call, main_for
from shared.schemas import EMPTY_CODEC, HELPER_INFO_CODEC, HELPER_REPLY_CODEC, INVENTORY_CODEC, Empty, HelperInfo, HelperReply, Inventory
from shared.schemas.codec import bounded_json_loads
from shared.slices import CGROUP_ROOT, FakeSlices, Slices, SystemdSlices

from .iommu import FakeHostIommuGroups, IommuGroups, SysfsIommuGroups
from .ops import OPERATIONS, HelperOps

#: NVIDIA's default MPS pipe directory (the inventory's default too).
DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"
#: how long the inventory may take to answer (the node bus is local).
BUS_TIMEOUT_S = 3.0


def fake_host_mps_dir(fake_host: Path) -> str:
    """The MPS pipe directory a fakehw host file names (the inventory reports the same)."""
    try:
        host = bounded_json_loads(read_regular(fake_host, max_bytes=HOST_FILE_MAX_BYTES), HOST_FILE_MAX_BYTES, "host file")
    except (OSError, ValueError) as exc:
        raise StartupError(f"fake host file {fake_host} unreadable: {exc}") from None
    value = host.get("mps_pipe_dir", DEFAULT_MPS_PIPE_DIR) if isinstance(host, dict) else DEFAULT_MPS_PIPE_DIR
    return value if isinstance(value, str) else DEFAULT_MPS_PIPE_DIR


class HelperApp(ServiceApp):
    name = "helper"
    description = "the optional root helper: writes hold files and slices for an unprivileged converger"

    def options(self) -> list[Option]:
        return [
            Option("--cdi-dir", "CDI spec directory (the converger's)", default=Path("/etc/cdi"), type=Path),
            Option(
                "--cdi-consumer-dir",
                "where the hold specs' consumer copies go (the converger's; a spec dir runtimes rank above --cdi-dir; "
                "default /var/run/cdi, on a fake host <run-dir>/cdi)",
                default=None,
                type=Path,
            ),
            Option("--run-dir", "runtime directory (the converger's; env files and fake slices)", default=Path("/run/bcd"), type=Path),
            Option("--fake-host", "fake host description file (fake slices, its MPS pipe directory)", type=Path),
            Option("--slices", "slice backend: fake (JSON records) or systemd (D-Bus)", default="auto", choices=("auto", "fake", "systemd")),
            Option("--mps-pipe-dir", "MPS pipe directory of slot holds (default: the fake host's, else /tmp/nvidia-mps)", default=""),
            Option(
                "--mps-root",
                "where the inventory keeps DRA claims' MPS daemons (the inventory's --mps-root; default /run/bcd/mps, "
                "on a fake host <run-dir>/mps)",
                default="",
            ),
            Option("--sysfs-root", "root of sysfs, where IOMMU groups are read (not on a fake host: its file says)", default=Path("/sys"), type=Path),
        ]

    async def setup(self, ctx: ServiceContext) -> None:
        o = ctx.opts
        self.ctx = ctx
        fake = o.fake_host is not None
        backend = o.slices if o.slices != "auto" else ("fake" if fake else "systemd")
        slices: Slices = FakeSlices(Path(os.path.realpath(o.run_dir))) if backend == "fake" else SystemdSlices(cgroup_root=CGROUP_ROOT)
        mps = o.mps_pipe_dir or (fake_host_mps_dir(o.fake_host) if fake else DEFAULT_MPS_PIPE_DIR)
        try:
            consumer = checked_consumer_dir(
                o.cdi_dir, o.cdi_consumer_dir if o.cdi_consumer_dir is not None else default_consumer_dir(o.run_dir, fake_host=fake)
            )
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        mps_root = o.mps_root or default_mps_root(o.run_dir, fake_host=fake)
        if not os.path.isabs(mps_root):
            raise StartupError(f"--mps-root {mps_root!r}: an absolute path")
        self.loop = asyncio.get_running_loop()
        iommu: IommuGroups = FakeHostIommuGroups(o.fake_host) if fake else SysfsIommuGroups(o.sysfs_root)
        self.ops = HelperOps(
            o.cdi_dir, o.run_dir, slices, slices_backend=backend, mps_pipe_dir=mps, consumer_dir=consumer, mps_root=mps_root,
            iommu=iommu, inventory=self.inventory_now,
        )
        self.m_ops = Counter("bcd_helper_operations", "Helper operations by operation and outcome", ["operation", "outcome"], registry=ctx.registry)
        for op in OPERATIONS:
            for outcome in ("done", "refused", "failed"):
                self.m_ops.labels(operation=op, outcome=outcome)
        info = self.ops.info()
        ctx.metadata.update(cdi_dir=info.cdi_dir, cdi_consumer_dir=info.cdi_consumer_dir, run_dir=info.run_dir, slices=info.slices)
        if os.geteuid() != 0 and not fake:
            ctx.log.warning("the helper does not run as root: writes to root's directories and systemd will fail", euid=os.geteuid())
        ctx.log.info("helper ready", cdi_dir=info.cdi_dir, cdi_consumer_dir=info.cdi_consumer_dir, run_dir=info.run_dir, slices=info.slices, mps_pipe_dir=info.mps_pipe_dir)

        s = ctx.subjects
        for op, subject in (
            ("file.write", s.helper_file_write),
            ("file.copy", s.helper_file_copy),
            ("file.remove", s.helper_file_remove),
            ("slice.apply", s.helper_slice_apply),
            ("slice.remove", s.helper_slice_remove),
        ):
            await ctx.endpoint(op.replace(".", "-"), subject, self._handler(op), None, reply=HELPER_REPLY_CODEC)
        await ctx.endpoint("info", s.helper_info, self.info, EMPTY_CODEC, allow_empty=True, reply=HELPER_INFO_CODEC)

    async def info(self, _: Empty) -> HelperInfo:
        return self.ops.info()

    def inventory_now(self) -> Inventory:
        """The inventory as the inventory service answers now; called from an operation's worker thread."""
        ask = call(self.ctx.nc, self.ctx.subjects.inventory_get, Empty(), INVENTORY_CODEC, timeout=BUS_TIMEOUT_S)
        return asyncio.run_coroutine_threadsafe(ask, self.loop).result(BUS_TIMEOUT_S + 1.0)

    def _handler(self, op: str) -> Callable[[bytes], Awaitable[HelperReply]]:
        async def handle(data: bytes) -> HelperReply:
            return await self.handle(op, data)

        return handle

    async def handle(self, op: str, data: bytes) -> HelperReply:
        """Run one request off the event loop; count it and log it (refusals at WARNING)."""
        reply, alloc = await asyncio.to_thread(self.ops.answer, op, data)
        self.m_ops.labels(operation=op, outcome=reply.outcome).inc()
        log = self.ctx.log
        if reply.outcome == "refused":
            log.warning("request refused", operation=op, allocation_id=alloc, reason=reply.reason)
        elif reply.outcome == "failed":
            log.warning("operation failed", operation=op, allocation_id=alloc, reason=reply.reason)
        else:
            fields: dict[str, Any] = {"path": reply.path} if reply.path else {}
            if op == "slice.remove":
                fields["gone"] = reply.gone
            log.info("operation done", operation=op, allocation_id=alloc, changed=reply.changed, **fields)
        return reply


main = main_for(HelperApp)

__all__ = ["HelperApp", "main", "fake_host_mps_dir", "DEFAULT_MPS_PIPE_DIR"]
