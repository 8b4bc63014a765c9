"""The house rules of the code, checked: small modules and functions, arrows between the packages
that run one way and no circle inside them, and the checkpoint's files known to shard_tools alone
(docs/design.md, "Layout of the code"; the orchestrator's side of the arrows is
tests/orchestrator/test_boundaries.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "launch", "shard_tools")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
"""The hard cap, everywhere."""
FUNCTION_LINES = {"orchestrator": 40, "launch": 40}
"""Where a renovation brought functions under a lower cap, per package."""
CHECKPOINT_FILES = ("manifest.json", "head.safetensors", "layers.safetensors", "body_optim.safetensors",
                    "state.safetensors")
FORMAT_NAMES = {"MANIFEST", "HEAD", "LAYERS", "BODY_OPTIM", "STATE", "step_dir_name", "checkpoints_dir",
                "read_manifest"}
"""What names a checkpoint's files or folders, or reads a manifest, in shard_tools: its own business."""
OUTSIDE_THE_FORMAT = ("orchestrator", "launch", "benchmarks", "examples")


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


def _long_functions(path: Path, limit: int) -> dict[str, int]:
    long = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if (n := node.end_lineno - node.lineno + 1) > limit:
                long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    return long


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_over_the_limit(package):
    limit = FUNCTION_LINES.get(package, MAX_FUNCTION_LINES)
    long = {k: n for p in _modules(package) for k, n in _long_functions(p, limit).items()}
    assert not long, f"functions of {package}/ over {limit} lines: {long}"


@pytest.mark.parametrize("path", _modules("launch", "shard_tools"), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_lower_packages_never_import_the_control_plane(path):
    assert not {n for n in _imports(path) if n.split(".")[0] == "orchestrator"}


DATA_MAY_IMPORT = ("launch.data", "launch.contract", "launch.procs")
"""The data pipeline's own modules, the contract, and a process's own life (the data tool runs as one)."""


def test_the_data_pipeline_stands_apart_from_the_phase():
    """``launch/data/``, read by the orchestrator's data step and by every phase, imports nothing of
    the phase's engine, switch or handover."""
    modules = sorted((ROOT / "launch" / "data").glob("*.py"))
    assert len(modules) > 1
    stray = {f"{p.name}: {n}" for p in modules for n in _imports(p)
             if n.split(".")[0] == "launch" and not n.startswith(DATA_MAY_IMPORT)}
    assert not stray


def module_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports, at any depth of the file: inside functions
    and under ``if TYPE_CHECKING`` too (a circle of type-only imports is a circle to read)."""
    files = {".".join(p.relative_to(root).with_suffix("").parts): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        out = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.update({f"{node.module}.{a.name}" for a in node.names} & files.keys() or
                           ({node.module} & files.keys()))
        out.discard(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert circles(module_graph(ROOT, PACKAGES)) == []


def test_the_circle_check_sees_type_only_and_late_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg.a import x\n")
    assert circles(module_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"]]


def checkpoint_names(path: Path) -> list[tuple[int, str]]:
    """(line, what) wherever a module names a checkpoint's file or folder, or reads a manifest,
    itself: a file name as a string, shard_tools' names for them, a manifest parsed or made."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, f) for f in CHECKPOINT_FILES if f in node.value]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shard_tools"):
            found += [(node.lineno, a.name) for a in node.names if a.name in FORMAT_NAMES]
        elif isinstance(node, ast.Attribute) and node.attr in FORMAT_NAMES | {"from_json"}:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Manifest":
            found.append((node.lineno, "Manifest(...)"))
    return sorted(found)


@pytest.mark.parametrize("path", _modules(*OUTSIDE_THE_FORMAT), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_shard_tools_knows_the_checkpoint_files(path):
    assert checkpoint_names(path) == []


def test_the_checkpoint_check_sees_every_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from shard_tools.manifest import MANIFEST, Manifest\nimport shard_tools.manifest as m\n"
                 "p = ckpt / 'head.safetensors'\nq = f'{ckpt}/manifest.json'\nr = m.read_manifest(ckpt)\n"
                 "s = Manifest.from_json(text, ckpt)\nt = Manifest(global_step=1)\nu = m.step_dir_name(3)\n"
                 "def ok(store: Manifest):\n    return store.at(3)\n")
    assert checkpoint_names(f) == [(1, "MANIFEST"), (3, "head.safetensors"), (4, "manifest.json"),
                                   (5, "read_manifest"), (6, "from_json"), (7, "Manifest(...)"), (8, "step_dir_name")]
