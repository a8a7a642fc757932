"""What bcd's root template units run: an MPS control daemon, a time slice (deploy/systemd).

`bcd-mps@<control>.service` and `bcd-timeslice@<uuid>:<interval>.service` run as root because
NVIDIA's tools want root for these steps, and the inventory, which decides them, is an ordinary
user (services/inventory/adapters/nvidia_sharing.py). This is the whole of what runs as root, so
it trusts nothing it is given: the instance name is the only argument, checked against the same
patterns as the bus (a control id, a GPU uuid and an interval); the daemon's directories are
built from the control id under a root fixed by the unit (`BCD_MPS_ROOT`), the spec beside them
is read as a bounded regular file and decoded strictly, and must name the same control id. The
steps themselves are NvidiaSharing's direct ones, the code the unit tests drive.

    python -m services.inventory.sharing_unit mps-start <control>
    python -m services.inventory.sharing_unit mps-stop <control>
    python -m services.inventory.sharing_unit timeslice <GPU uuid>:<Default|Short|Medium|Long>

Exit 0 when done, 1 with one line on stderr (systemd's journal keeps it) when not, 2 for a
usage error.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from shared.schemas.bus import MPS_CONTROL_PATTERN

from .adapters.base import SharingStepError, mps_control_dir, mps_dirs
from .adapters.nvidia_sharing import SPEC_FILE, TIMESLICE_CODES, NvidiaSharing, read_daemon_spec

#: where the units keep the daemons' directories (the inventory's --mps-root)
DEFAULT_MPS_ROOT = "/run/bcd/mps"
_CONTROL = re.compile(MPS_CONTROL_PATTERN)
#: a whole card's uuid as NVML spells it (the inventory's Gpu.uuid)
_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\Z")


class UsageError(Exception):
    pass


def mps_root(environ: dict[str, str] | os._Environ[str]) -> Path:
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


def mps_start(sharing: NvidiaSharing, root: Path, control: str) -> str:
    pipe_dir, log_dir = mps_dirs(root, control)
    spec = read_daemon_spec(mps_control_dir(control, pipe_dir, log_dir))
    if spec is None:
        raise SharingStepError("refused", f"no {SPEC_FILE} in {pipe_dir.parent}: the inventory writes it before it starts the unit")
    if spec.control != control:
        raise SharingStepError("refused", f"{pipe_dir.parent / SPEC_FILE} is for MPS daemon {spec.control}, not {control}")
    sharing.run_daemon(spec, pipe_dir, log_dir)
    return f"MPS daemon {control} runs for {', '.join(spec.uuids)}"


def mps_stop(sharing: NvidiaSharing, root: Path, control: str) -> str:
    pipe_dir, log_dir = mps_dirs(root, control)
    sharing.quit_daemon(control, pipe_dir, log_dir)
    return f"MPS daemon {control} quit"


def timeslice(sharing: NvidiaSharing, instance: str) -> str:
    uuid, interval = checked_timeslice(instance)
    sharing.set_timeslice(uuid, uuid, interval)  # no PCI address here: the uuid names the card in messages
    return f"time slice {interval} set on {uuid}"


def main(argv: Sequence[str] | None = None, *, sharing: NvidiaSharing | None = None, environ: dict[str, str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    # the steps as they run without systemd: in this process, which is the unit's
    sharing = sharing if sharing is not None else NvidiaSharing(units=False)
    try:
        if len(args) != 2:
            raise UsageError("usage: sharing_unit mps-start|mps-stop <control> | timeslice <GPU uuid>:<interval>")
        step, name = args
        if step == "mps-start":
            said = mps_start(sharing, mps_root(env), checked_control(name))
        elif step == "mps-stop":
            said = mps_stop(sharing, mps_root(env), checked_control(name))
        elif step == "timeslice":
            said = timeslice(sharing, name)
        else:
            raise UsageError(f"unknown step {step!r} (mps-start, mps-stop, timeslice)")
    except UsageError as exc:
        print(f"bcd sharing unit: {exc}", file=sys.stderr)
        return 2
    except SharingStepError as exc:
        print(f"bcd sharing unit: {exc.outcome}: {exc}", file=sys.stderr)
        return 1
    print(said)
    return 0


if __name__ == "__main__":
    sys.exit(main())
