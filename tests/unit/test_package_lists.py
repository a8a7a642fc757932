"""The project's top-level packages are listed in a few places that must agree: the wheel's
(pyproject.toml), the import-linter's root packages, `make bytecode`, and the VM image's copy
of the sources (deploy/vm/build-image.sh reads pyproject's). The VM image once lacked
controlplane/ after the package was added: only the VM suite noticed, after 30 minutes."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def top_level_packages() -> set[str]:
    return {p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name not in ("tests", "bench", "examples")}


def test_every_list_of_the_packages_names_the_packages_there_are() -> None:
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())
    wheel = {p.rstrip("*") for p in conf["tool"]["setuptools"]["packages"]["find"]["include"]}
    linted = set(conf["tool"]["importlinter"]["root_packages"])
    bytecode = re.search(r"compileall -q -j 0 ([^>]+)>", (REPO / "Makefile").read_text())
    assert bytecode is not None
    assert top_level_packages() == wheel == linted == set(bytecode.group(1).split())


def test_the_vm_image_copies_the_packages_pyproject_lists() -> None:
    script = (REPO / "deploy" / "vm" / "build-image.sh").read_text()
    copy = next(line for line in script.splitlines() if line.startswith("tar -C \"$ROOT\"") and "$SRC" in line)
    assert '"${PACKAGES[@]}"' in copy and 'packages"]["find"]["include"]' in script
