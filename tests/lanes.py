"""`make test`: the whole suite in two lanes at once, so CI takes the time of the longer one.

The VM suites (tests/vm) spend most of their time in a software-emulated guest: one core of
qemu, waiting on a kernel that boots slowly. The rest of the suite (unit, integration,
containers, podman) runs beside it in a second pytest process. Each lane is a plain pytest
run with the same arguments; the VM lane's output goes to a log that is printed whole when
both have ended (interleaved lines would be unreadable), and the exit status is the first
lane's failure, if any.

Arguments that name tests (a path, `-k`, `::`) run one plain pytest with them instead: the
lanes are for the whole suite only. BCD_TEST_LANES=1 runs the whole suite as one pytest too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VM_SUITE = "tests/vm"


def _names_tests(args: list[str]) -> bool:
    """The arguments pick tests (then the caller wants exactly those, in one run)."""
    for a in args:
        if a in ("-k", "-m", "--lf", "--last-failed", "--deselect") or a.startswith(("-k", "--deselect=")):
            return True
        if not a.startswith("-") and (os.path.exists(a.split("::", 1)[0]) or "::" in a):
            return True
    return False


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", *args]


def main(argv: list[str]) -> int:
    if _names_tests(argv) or os.environ.get("BCD_TEST_LANES") == "1" or not (REPO / VM_SUITE).is_dir():
        return subprocess.call(_pytest(*argv), cwd=REPO)
    log_dir = REPO / ".scratch"
    log_dir.mkdir(exist_ok=True)
    fd, log_name = tempfile.mkstemp(prefix="vm-lane-", suffix=".log", dir=log_dir)
    vm_log = Path(log_name)
    started = time.monotonic()
    with os.fdopen(fd, "wb") as out:
        vm = subprocess.Popen(_pytest(VM_SUITE, *argv), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    print(f"lanes: the VM suites run beside the rest (pid {vm.pid}); their output: {vm_log}, printed at the end", flush=True)
    try:
        rest = subprocess.call(_pytest("--ignore", VM_SUITE, *argv), cwd=REPO)
        rest_took = time.monotonic() - started
        vm_rc = vm.wait()
    except KeyboardInterrupt:
        vm.send_signal(signal.SIGINT)
        vm.wait()
        raise
    print(f"\n===== the VM lane ({VM_SUITE}), exit {vm_rc}, {time.monotonic() - started:.0f} s (the rest: {rest_took:.0f} s) =====", flush=True)
    sys.stdout.write(vm_log.read_text(errors="replace"))
    sys.stdout.flush()
    return rest or vm_rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
