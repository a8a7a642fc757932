"""Memory of a whole demo node: resident set of every process. Prints figures, asserts nothing.

    .venv/bin/python bench/memory.py [--settle S] [--no-compile] [--json] [--keep]

What one sample is: the node `make run` starts (the Makefile's `run` recipe,
`bcd up --any-ports-if-taken --log-format text --apply examples/specs/demo.json`,
run as `python -m bcd.cli up` plus `--any-ports` and a temp `--state-dir`), read
once after the demo has bound - the supervisor printed "verified events" (the
spec applied, the status table shown) - and `--settle` more seconds have passed.
For every process of the node's tree (the supervisor, the nats-server node bus,
each service, the reference control plane) it reads VmRSS from
/proc/<pid>/status and, where /proc/<pid>/smaps_rollup is readable, Pss (shared
pages split between the processes mapping them, so the Pss total is what the
node really costs; the RSS total counts shared libraries once per process).
Each figure is printed beside its target (RSS <= 35 MiB per process, the whole
node <= 280 MiB: the RSS sum of the supervisor, the node bus and the services;
the reference control plane the demo runs as upstream is listed and added to a
demo total, not to the node) with PASS or OVER. The node is SIGTERMed and waited for at
the end. Exit status 0 whatever the figures (1 only when the node did not come up).

Bytecode: `make run` compiles bcd's own modules first (`python -m compileall`
on shared, services and bcd, writing their __pycache__, ignored by git), and so
does this bench: where PYTHONDONTWRITEBYTECODE is set and nothing compiled them,
every process compiles them from source at each start and keeps some of the
compiler's memory (about 1 MiB per process); `--no-compile` measures that.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO_SPEC = ROOT / "examples" / "specs" / "demo.json"

#: targets of issue 13, MiB.
TARGET_PROCESS_RSS = 35.0
TARGET_NODE = 280.0

MIB = 1024 * 1024


def make_run_argv(state: Path) -> list[str]:
    """The Makefile's `run` recipe as argv (`$(BIN)/bcd` -> this python -m bcd.cli), on free ports and `state`."""
    recipe = re.search(r"^run:.*\n(?:\t.*\n)*?\t(\$\(BIN\)/bcd up.*)$", (ROOT / "Makefile").read_text(), flags=re.M)
    words = shlex.split(recipe.group(1)) if recipe else []
    if not words or words[0] != "$(BIN)/bcd":
        words = ["$(BIN)/bcd", "up", "--any-ports-if-taken", "--log-format", "text", "--apply", str(DEMO_SPEC), "$(ARGS)"]
    words = [w for w in words[1:] if w != "$(ARGS)"]
    return [sys.executable, "-m", "bcd.cli", *words, "--any-ports", "--state-dir", str(state)]


# ----------------------------------------------------------------------------- /proc


def children(pid: int) -> list[int]:
    """Direct children of `pid` (scans /proc: no CONFIG_PROC_CHILDREN needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the comm field may hold spaces and parentheses: ppid is the 2nd field after the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return sorted(out)


def tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        pids.append(p)
        todo.extend(children(p))
    return pids


def process_name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    argv = [a for a in argv if a]
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1]
        if module == "bcd.cli":
            return "supervisor"
        return {"controlplane": "controlplane"}.get(module, module.removeprefix("services.").removesuffix(".service"))
    return Path(argv[0]).name if argv else "?"


def kib_field(text: str, key: str) -> float | None:
    m = re.search(rf"^{key}:\s+(\d+) kB", text, flags=re.M)
    return int(m.group(1)) * 1024 / MIB if m else None


@dataclass
class Sample:
    name: str
    pid: int
    rss_mib: float
    pss_mib: float | None
    rss_ok: bool


def sample(pid: int) -> Sample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = round(kib_field(status, "VmRSS") or 0.0, 2)
    try:
        pss = kib_field(Path(f"/proc/{pid}/smaps_rollup").read_text(), "Pss")
        pss = round(pss, 2) if pss is not None else None
    except OSError:
        pss = None
    return Sample(process_name(pid), pid, rss, pss, rss <= TARGET_PROCESS_RSS)


# ----------------------------------------------------------------------------- the node


def wait_bound(proc: subprocess.Popen[bytes], log_path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "verified events" in log_path.read_text(errors="replace"):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.2)
    return False


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def verdict(ok: bool) -> str:
    return "PASS" if ok else "OVER"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--settle", type=float, default=3.0, help="seconds to wait after the demo bound (default 3)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the demo to bind (default 120)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (state, logs) for a look afterwards")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="do not compile bcd's bytecode first, as `make run` does (see the docstring)")
    args = parser.parse_args()
    if args.compile:
        subprocess.run(  # noqa: S603
            [sys.executable, "-m", "compileall", "-q", "bcd", "shared", "services"],
            cwd=ROOT, check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        )
    bytecode = "compiled first (as make run does)" if args.compile else (
        "not compiled first" + (", PYTHONDONTWRITEBYTECODE set" if os.environ.get("PYTHONDONTWRITEBYTECODE") else ""))

    tmp = Path(tempfile.mkdtemp(prefix="bcd-bench-memory-"))
    log_path = tmp / "up.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BCD_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(  # noqa: S603
            make_run_argv(tmp / "state"), stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=ROOT, env=env
        )
    try:
        t0 = time.monotonic()
        if not wait_bound(proc, log_path, args.timeout):
            print(f"bench/memory: the demo did not bind within {args.timeout:.0f} s; see {log_path}", file=sys.stderr)
            print(log_path.read_text(errors="replace")[-3000:], file=sys.stderr)
            args.keep = True
            return 1
        bound_s = time.monotonic() - t0
        time.sleep(args.settle)
        samples = [s for s in (sample(p) for p in tree(proc.pid)) if s is not None]
    finally:
        rc = stop(proc)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    # the node is the supervisor, its node bus and its services; the reference control plane
    # the demo starts beside them plays upstream (a fleet runs one for many nodes)
    node = [s for s in samples if s.name != "controlplane"]
    rss_total = sum(s.rss_mib for s in node)
    demo_total = sum(s.rss_mib for s in samples)
    have_pss = all(s.pss_mib is not None for s in node)
    pss_total = sum(s.pss_mib or 0.0 for s in node) if have_pss else None
    # judged by the RSS sum (each process's shared libraries counted in full: the stricter figure)
    node_total = rss_total
    if args.json:
        print(
            json.dumps(
                {
                    "targets_mib": {"process_rss": TARGET_PROCESS_RSS, "node": TARGET_NODE},
                    "bytecode": bytecode,
                    "processes": [asdict(s) for s in samples],
                    "rss_total_mib": round(rss_total, 1),
                    "demo_rss_total_mib": round(demo_total, 1),
                    "pss_total_mib": round(pss_total, 1) if pss_total is not None else None,
                    "node_ok": node_total <= TARGET_NODE,
                    "bound_after_s": round(bound_s, 1),
                    "exit_code": rc,
                },
                indent=2,
            )
        )
        return 0
    print(f"bcd demo node memory (make run; sampled {args.settle:.0f} s after the demo bound at {bound_s:.1f} s)")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, bcd's bytecode {bytecode}{'' if not args.keep else f', kept {tmp}'}")
    print(f"\n{'PROCESS':<16} {'PID':>7} {'RSS MiB':>8} {'PSS MiB':>8}  RSS <= {TARGET_PROCESS_RSS:.0f}")
    for s in samples:
        pss = f"{s.pss_mib:8.1f}" if s.pss_mib is not None else f"{'-':>8}"
        print(f"{s.name:<16} {s.pid:>7} {s.rss_mib:8.1f} {pss}  {verdict(s.rss_ok)}")
    pss_text = f"{pss_total:8.1f}" if pss_total is not None else f"{'-':>8}"
    print(f"{'whole node':<16} {len(node):>7} {rss_total:8.1f} {pss_text}  RSS sum <= {TARGET_NODE:.0f}: {verdict(node_total <= TARGET_NODE)}"
          "  (supervisor, node bus, services)")
    print(f"{'demo total':<16} {len(samples):>7} {demo_total:8.1f} {'':>8}  (with the reference control plane the demo runs as upstream)")
    over = [s.name for s in samples if not s.rss_ok]
    print(f"\nprocesses over {TARGET_PROCESS_RSS:.0f} MiB RSS: {', '.join(over) if over else 'none'}; bcd up exited {rc} after SIGTERM")
    return 0


if __name__ == "__main__":
    sys.exit(main())
