"""The control plane's one door into ``launch/``: the ``launch.contract`` package, which imports no
torch and nothing else of ``launch/``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = sorted((ROOT / "launch" / "contract").glob("*.py"))


def is_contract(module: str) -> bool:
    return module == "launch.contract" or module.startswith("launch.contract.")


def launch_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of ``launch`` or a module under it, at any depth of the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # ``from launch import contract`` imports launch.contract; ``from launch import procs`` does not.
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "launch" else [node.module]
        else:
            continue
        out += [(node.lineno, n) for n in names if n == "launch" or n.startswith("launch.")]
    return sorted(out)


@pytest.mark.parametrize("path", sorted((ROOT / "orchestrator").glob("*.py")), ids=lambda p: p.name)
def test_the_orchestrator_imports_nothing_of_launch_but_the_contract(path):
    assert [(line, m) for line, m in launch_imports(path) if not is_contract(m)] == []


@pytest.mark.parametrize("path", CONTRACT, ids=lambda p: p.name)
def test_the_contract_imports_nothing_else_of_launch(path):
    assert [(line, m) for line, m in launch_imports(path) if not is_contract(m)] == []


def test_the_check_sees_every_form_of_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import launch.procs\nfrom launch import contract, zygote\ndef f():\n    from launch.phase import x\n"
                 "from launch.contract.files import PhaseDir\nimport launchpad\nimport launch.contractor\n")
    found = launch_imports(f)
    assert found == [(1, "launch.procs"), (2, "launch.contract"), (2, "launch.zygote"), (4, "launch.phase"),
                     (5, "launch.contract.files"), (7, "launch.contractor")]
    assert [m for _, m in found if is_contract(m)] == ["launch.contract", "launch.contract.files"]


def test_the_contract_imports_no_torch():
    modules = ", ".join(["launch.contract", *(f"launch.contract.{p.stem}" for p in CONTRACT if p.stem != "__init__")])
    code = (f'import sys, {modules}; heavy = {{"torch", "deepspeed", "transformers", "datasets"}} & set(sys.modules); '
            'assert not heavy, heavy')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
