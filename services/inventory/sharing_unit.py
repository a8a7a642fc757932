"""What bcd's root template units run: an MPS control daemon, a time slice (deploy/systemd).

`bcd-mps@<control>.service` and `bcd-timeslice@<uuid>:<interval>.service` run as root because
NVIDIA's tools want root for these steps, and the inventory, which decides them, is an ordinary
user (services/inventory/adapters/nvidia_sharing.py); it reaches them only through
`bcd-sharing.socket` (services/inventory/sharing_gate.py). This is the whole of what runs as
root, so it trusts nothing it is given: the instance name is the only argument, checked against
the same patterns as the bus (a control id, a GPU uuid and an interval); every directory is
root's, laid out and checked by services.inventory.mpsroot; the spec is the inventory's bounded
regular file, decoded strictly, for the same control id; every device it names must be one
`nvidia-smi -L` lists on this node. The NVIDIA steps themselves are NvidiaSharing's direct ones.

    python -m services.inventory.sharing_unit mps-prepare <control>   ExecStartPre=+ (directories, the shm tmpfs)
    python -m services.inventory.sharing_unit mps-start <control>     ExecStart= (the daemon, in the unit's sandbox)
    python -m services.inventory.sharing_unit mps-stop <control>      ExecStop= (quit)
    python -m services.inventory.sharing_unit mps-cleanup <control>   ExecStopPost=+ (unmount, remove)
    python -m services.inventory.sharing_unit mps-adopt               bcd-sharing.socket's ExecStartPre= (an upgrade)
    python -m services.inventory.sharing_unit timeslice <GPU uuid>:<Default|Short|Medium|Long>

`mps-start` refuses to run a daemon whose /dev/shm is not `<root>/<control>/shm` (the unit's
BindPaths=): without it the daemon would share the host's /dev/shm with the claim.

Exit 0 when done, 1 with one line on stderr (systemd's journal keeps it) when not, 2 for a
usage error.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from shared.schemas.bus import MPS_CONTROL_PATTERN

from . import mpsroot
from .adapters.base import SharingStepError
from .adapters.nvidia_sharing import TIMESLICE_CODES, NvidiaSharing

#: where the units keep the daemons' directories (the inventory's --mps-root)
DEFAULT_MPS_ROOT = "/run/bcd/mps"
#: what the daemon sees as its shared memory (the unit binds its own shm directory there)
DAEMON_SHM = "/dev/shm"
_CONTROL = re.compile(MPS_CONTROL_PATTERN)
#: a whole card's uuid as NVML spells it (the inventory's Gpu.uuid)
_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\Z")


class UsageError(Exception):
    pass


def mps_root(environ: Mapping[str, str]) -> Path:
    root = environ.get("BCD_MPS_ROOT") or DEFAULT_MPS_ROOT
    if not os.path.isabs(root):
        raise UsageError(f"BCD_MPS_ROOT must be an absolute path, not {root!r}")
    return Path(root)


def checked_control(control: str) -> str:
    if not _CONTROL.match(control):
        raise UsageError(f"{control!r} is not an MPS control id (<claim uid>-<6 hex digits>)")
    return control


def checked_timeslice(instance: str) -> tuple[str, str]:
    uuid, sep, interval = instance.rpartition(":")
    if not sep or not _GPU_UUID.match(uuid) or interval not in TIMESLICE_CODES:
        raise UsageError(f"{instance!r} is not <GPU uuid>:<{'|'.join(TIMESLICE_CODES)}>")
    return uuid, interval


def _on_this_node(sharing: NvidiaSharing, uuids: Sequence[str]) -> None:
    listed = sharing.node_uuids()
    missing = [u for u in uuids if u not in listed]
    if missing:
        raise SharingStepError("refused", f"{', '.join(missing)}: not a device of this node (nvidia-smi -L)")


def mps_start(sharing: NvidiaSharing, root: Path, control: str, *, owner: int, daemon_shm: str = DAEMON_SHM) -> str:
    spec = mpsroot.read_spec(root, control, owner)
    pipe_dir, log_dir, shm_fd = mpsroot.daemon_dirs(root, control, owner)
    try:
        if not mpsroot.same_directory(daemon_shm, shm_fd):
            raise SharingStepError("refused", f"{daemon_shm} is not {root / control / 'shm'} (the unit's BindPaths=): the daemon would share the host's")
    finally:
        os.close(shm_fd)
    _on_this_node(sharing, spec.uuids)
    sharing.run_daemon(spec, pipe_dir, log_dir)
    return f"MPS daemon {control} runs for {', '.join(spec.uuids)}"


def mps_stop(sharing: NvidiaSharing, root: Path, control: str, *, owner: int) -> str:
    pipe_dir, log_dir, shm_fd = mpsroot.daemon_dirs(root, control, owner)
    os.close(shm_fd)
    sharing.quit_daemon(control, pipe_dir, log_dir)
    return f"MPS daemon {control} quit"


def timeslice(sharing: NvidiaSharing, instance: str) -> str:
    uuid, interval = checked_timeslice(instance)
    _on_this_node(sharing, [uuid])
    sharing.set_timeslice(uuid, uuid, interval)  # no PCI address here: the uuid names the card in messages
    return f"time slice {interval} set on {uuid}"


def main(
    argv: Sequence[str] | None = None,
    *,
    sharing: NvidiaSharing | None = None,
    environ: Mapping[str, str] | None = None,
    mounts: mpsroot.Mounts | None = None,
    daemon_shm: str = DAEMON_SHM,
    owner: int | None = None,
) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    # the steps as they run without systemd: in this process, which is the unit's
    sharing = sharing if sharing is not None else NvidiaSharing(units=False)
    uid = os.geteuid() if owner is None else owner
    said: Callable[[str], None] = lambda line: print(f"bcd sharing unit: {line}", file=sys.stderr)  # noqa: E731
    try:
        if args == ["mps-adopt"]:
            n = mpsroot.adopt(mps_root(env), owner=uid, log=said)
            print(f"{n} MPS daemon(s) taken over by root")
            return 0
        if len(args) != 2:
            raise UsageError("usage: sharing_unit mps-prepare|mps-start|mps-stop|mps-cleanup <control> | timeslice <GPU uuid>:<interval> | mps-adopt")
        step, name = args
        if step == "mps-prepare":
            control = checked_control(name)
            shm_size = env.get("BCD_MPS_SHM_SIZE") or mpsroot.DEFAULT_SHM_SIZE
            mpsroot.prepare(mps_root(env), control, shm_size, owner=uid, mounts=mounts or mpsroot.Mounts())
            out = f"directories of MPS daemon {control} made (shm: tmpfs size={shm_size})"
        elif step == "mps-start":
            out = mps_start(sharing, mps_root(env), checked_control(name), owner=uid, daemon_shm=daemon_shm)
        elif step == "mps-stop":
            out = mps_stop(sharing, mps_root(env), checked_control(name), owner=uid)
        elif step == "mps-cleanup":
            control = checked_control(name)
            gone = mpsroot.cleanup(mps_root(env), control, owner=uid, mounts=mounts or mpsroot.Mounts())
            out = f"directories of MPS daemon {control} removed" if gone else f"MPS daemon {control} left nothing"
        elif step == "timeslice":
            out = timeslice(sharing, name)
        else:
            raise UsageError(f"unknown step {step!r} (mps-prepare, mps-start, mps-stop, mps-cleanup, timeslice, mps-adopt)")
    except UsageError as exc:
        said(str(exc))
        return 2
    except SharingStepError as exc:
        said(f"{exc.outcome}: {exc}")
        return 1
    except OSError as exc:  # a step of root's own on the file system (a chown, a mount) that failed
        said(f"failed: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
