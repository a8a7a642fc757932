"""The VM suites' fixtures (issue 18): the image, built once, and the guests booted from it.

- ``vm_image`` (session): deploy/vm/build-image.sh's image, cached by content; the suites skip,
  with the reason, where qemu or debootstrap is missing or the image cannot be built here
  (the script exits 3: not root, the Debian mirror unreachable), and fail instead where
  BCD_VM_REQUIRED=1 (.ci/run, once it installed them); a build that fails otherwise fails them.
- ``system_guest`` (session): one guest for the smoke checks (run on it first, as booted) and
  then the systemd deployment (test_vm_units.py installs bcd into it as docs/install.md says);
  a boot costs about a minute under TCG, so the two share one.
- ``booted_guest(image, tmp_path_factory, name)``: a guest of a module's own (test_vm_holds.py:
  `bcd up` as root, which must not meet the installed units), powered off at the module's end.

Every guest's workdir (the snapshot overlay, console.log) goes once it is powered off. The
times (image, boots) are printed at the session's end with ``-s``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.vm.guestkit import BOOT_TIMEOUT_S, BUILD_TIMEOUT_S, FIGURES, TIMES
from tests.vm.qemu import Guest, Image, ImageUnavailable, build_image, missing_tools


def _cannot_run(why: str) -> None:
    """Skip with the reason; fail instead where the VM suites are required (BCD_VM_REQUIRED=1:
    .ci/run installed qemu and debootstrap, so a skip could only hide a fault)."""
    if os.environ.get("BCD_VM_REQUIRED") == "1":
        pytest.fail(f"BCD_VM_REQUIRED=1, but {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def vm_image() -> Image:
    why = missing_tools()
    if why:
        _cannot_run(why)
    try:
        img, took, _log = build_image(timeout=BUILD_TIMEOUT_S)
    except ImageUnavailable as e:
        _cannot_run(f"the VM image cannot be built here: {e}")
    TIMES["image"] = took
    return img


def booted_guest(image: Image, tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Guest]:
    """A fixture body: boots a guest, yields it, powers it off and drops its workdir."""
    workdir = tmp_path_factory.mktemp(f"vm-{name}")
    vm = Guest(image, workdir, boot_timeout=BOOT_TIMEOUT_S)
    try:
        vm.boot()
        TIMES[f"boot.{name}"] = vm.boot_seconds or 0.0
        yield vm
    finally:
        vm.poweroff()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def system_guest(vm_image: Image, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guest]:
    yield from booted_guest(vm_image, tmp_path_factory, "system")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001, ARG001
    if TIMES:
        terminalreporter.write_line("vm timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in TIMES.items()))
    if FIGURES:
        terminalreporter.write_line("vm figures: " + ", ".join(f"{k} {v:g}" for k, v in FIGURES.items()))
