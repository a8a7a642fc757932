"""Layering, enforced: shared knows no service; services know no other service and not the CLI;
the reference control plane (controlplane/) knows neither the CLI nor any service.

Each service is its own process and talks to the others only over the node
bus, so an import across services would be a hidden second channel.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def modules(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("path", modules("shared"), ids=lambda p: str(p.relative_to(REPO)))
def test_shared_imports_no_service_and_no_cli(path):
    bad = {m for m in imports_of(path) if m.split(".")[0] in {"services", "bcd"}}
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("path", modules("services"), ids=lambda p: str(p.relative_to(REPO)))
def test_services_import_only_themselves_and_shared(path):
    rel = path.relative_to(REPO / "services")
    own = rel.parts[0] if len(rel.parts) > 1 else None
    bad = set()
    for m in imports_of(path):
        parts = m.split(".")
        if parts[0] == "bcd":
            bad.add(m)
        if parts[0] == "services" and len(parts) > 1 and parts[1] != own:
            bad.add(m)
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("path", modules("controlplane"), ids=lambda p: str(p.relative_to(REPO)))
def test_the_control_plane_imports_only_itself_and_shared(path):
    """A program of its own (issue 32): what `bcd` needs of it, it imports from it, never the other way."""
    bad = {m for m in imports_of(path) if m.split(".")[0] in {"services", "bcd"}}
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def test_every_service_package_exists_with_a_docstring():
    for name in ("inventory", "converger", "signer", "kube_reaper", "device_plugin", "vfio_switcher", "gateway_bridge", "helper"):
        init = REPO / "services" / name / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"
