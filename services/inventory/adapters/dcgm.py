"""NVIDIA's diagnostic: `dcgmi diag -r <level> -i <gpu index> -j`, run and judged.

DCGM's command-line client talks to its host engine (nv-hostengine); no root
is needed for the diagnostic. Its JSON report (`-j`) groups tests in
categories, each test with one result per GPU; a result whose status is
"Fail" fails the run, and the test's name and warning are reported. A host
without `dcgmi` gets NotInstalled, an answer that is not such a report gets
Error with what the tool printed; nothing here raises.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

from .base import DiagResult

#: what is kept of the tool's output in a message.
OUTPUT_MAX = 2000


def _results(report: Any) -> list[tuple[str, str, str]]:
    """(test name, status, warning) of every result in a dcgmi JSON report."""
    out: list[tuple[str, str, str]] = []
    if not isinstance(report, dict):
        return out
    body = report.get("DCGM GPU Diagnostic", report)
    categories = body.get("test_categories", []) if isinstance(body, dict) else []
    for cat in categories if isinstance(categories, list) else []:
        for test in cat.get("tests", []) if isinstance(cat, dict) else []:
            if not isinstance(test, dict):
                continue
            name = str(test.get("name", "?"))
            for r in test.get("results", []) if isinstance(test.get("results"), list) else []:
                if not isinstance(r, dict):
                    continue
                warnings = r.get("warnings") or []
                text = "; ".join(str(w.get("warning", w)) if isinstance(w, dict) else str(w) for w in warnings) if isinstance(warnings, list) else str(warnings)
                out.append((name, str(r.get("status", "")), text or str(r.get("info", "") or "")))
    return out


def judge(stdout: str, returncode: int, level: int) -> DiagResult:
    """The outcome of one run from what dcgmi printed."""
    try:
        report = json.loads(stdout)
    except ValueError:
        return DiagResult("Error", f"dcgmi diag -r {level} exited {returncode} without a JSON report: {stdout.strip()[:OUTPUT_MAX]}")
    results = _results(report)
    if not results:
        return DiagResult("Error", f"dcgmi diag -r {level} exited {returncode}; its report lists no test result")
    failed = [f"{name}: {warning}" if warning else name for name, status, warning in results if status.lower() == "fail"]
    if failed:
        return DiagResult("Failed", f"DCGM diagnostic level {level}: {len(failed)} test(s) failed", tuple(failed[:64]))
    ran = sum(1 for _, status, _ in results if status.lower() in ("pass", "warn"))
    return DiagResult("Passed", f"DCGM diagnostic level {level} passed ({ran} test result(s), none failed)")


def run_dcgmi(
    index: int,
    level: int,
    timeout: float,
    *,
    which: Callable[[str], str | None] = shutil.which,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
) -> DiagResult:
    tool = which("dcgmi")
    if tool is None:
        return DiagResult("NotInstalled", "DCGM is not installed (no dcgmi on PATH): install datacenter-gpu-manager and start nv-hostengine")
    argv = [tool, "diag", "-r", str(level), "-i", str(index), "-j"]
    try:
        done = run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return DiagResult("Error", f"{' '.join(argv[1:])} did not finish within {timeout:.0f} s")
    except OSError as exc:
        return DiagResult("Error", f"dcgmi could not run: {exc.strerror or exc}")
    result = judge(done.stdout, done.returncode, level)
    if result.outcome == "Error" and done.stderr.strip():
        return DiagResult("Error", f"{result.message}; stderr: {done.stderr.strip()[:OUTPUT_MAX]}")
    return result


__all__ = ["judge", "run_dcgmi"]
