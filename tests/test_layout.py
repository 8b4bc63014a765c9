"""The house rules of the code, checked: small modules and functions, and the arrows between the
packages (docs/design.md, "Layout of the code"; the orchestrator's side of the arrows is
tests/orchestrator/test_boundaries.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "launch", "shard_tools")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60


def _modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_module_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in _modules(*PACKAGES)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_over_the_limit():
    long = {}
    for p in _modules(*PACKAGES):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("path", _modules("launch", "shard_tools"), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_lower_packages_never_import_the_control_plane(path):
    assert not {n for n in _imports(path) if n.split(".")[0] == "orchestrator"}
