"""``make test`` and ``make venv`` as a new user meets them: progress from the first minute, every
failure reported (no stop at the first), the slowest tests at the end.

Seen on a fresh clone: ``make test`` printed its pytest line, then nothing for 177 s (``-q``, and a
multiprocess file first), then stopped at its first failure (``-x``); ``make demo`` spent 70 s in
a silent ``pip install -q``.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _pytest.mark import MarkMatcher  # the matcher -m uses: the tier here is -m's own
from _pytest.mark.expression import Expression

from tests import run
from tests.conftest import COSTS, ROOT, order, shared


def dry_run(*args: str) -> list[list[str]]:
    """The commands ``make ARGS`` would run (``make -n``), split."""
    r = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                       check=True)
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


@pytest.mark.parametrize("target, fast", [("test", False), ("test-fast", True)])
def test_make_test_shows_progress_reports_every_failure_and_the_slowest(target, fast):
    runner, = dry_run("-o", ".venv/.installed", target)
    assert runner[1:] == ["tests/run.py", *(["--fast"] if fast else [])]
    for pytest_line in run.passes(fast, []):
        assert "-x" not in pytest_line and "--exitfirst" not in pytest_line  # runs to the end
        assert "-q" not in pytest_line  # progress as it goes, not silence
        assert any(a.startswith("--durations=") for a in pytest_line)


def test_the_suite_runs_on_every_core_then_what_must_run_alone(monkeypatch):
    monkeypatch.setenv("TEST_WORKERS", "2")
    spread, alone = run.passes(False, ["-k", "x"])
    assert spread[spread.index("-n") + 1] == "2" and spread[spread.index("--dist") + 1] == "loadscope"
    assert "--alone=skip" in spread and "--alone=only" in alone and "-n" not in alone
    mods = run.alone_modules()
    assert mods == ["tests/orchestrator/test_clock.py", "tests/test_first_run.py"]
    assert spread[-2:] == alone[-2 - len(mods):-len(mods)] == ["-k", "x"]  # the caller's arguments reach both passes
    assert alone[-len(mods):] == mods  # and the second collects only these
    assert run.passes(False, ["tests/shard_tools"])[1][-1] == "tests/shard_tools"  # unless the caller names a path
    fast = run.passes(True, [])
    assert all(any(p[i:i + 2] == ["-m", run.FAST] for i in range(3, len(p))) for p in fast)
    monkeypatch.setenv("TEST_WORKERS", "1")
    assert "-n" not in run.passes(False, [])[0]


def test_the_runner_fails_where_either_pass_fails_and_says_its_wall_time(monkeypatch, capsys):
    statuses = iter([0, 1])
    monkeypatch.setattr(run.subprocess, "call", lambda command: next(statuses))
    assert run.main([]) == 1
    assert "pass 2 exited 1" in capsys.readouterr().out
    statuses = iter([0, run.NO_TESTS])  # no test marked alone in the selection
    assert run.main(["--fast"]) == 0
    assert re.search(r"make test-fast: [0-9.]+ minutes wall \([0-9]+ s\), [0-9]+ workers; passed", capsys.readouterr().out)


def test_the_venv_is_made_in_the_open():
    """pip says what it fetches, and make first says what is coming and how long it takes."""
    commands = dry_run("-B", ".venv/.installed")
    install, = [c for c in commands if c[0].endswith("/pip") and "install" in c]
    assert "-q" not in install and "--quiet" not in install
    assert commands[0][0] == "echo" and "minutes" in commands[0][-1]


def item(name: str, multiprocess: bool, module: str = "tests/test_x.py") -> SimpleNamespace:
    marker = object() if multiprocess else None
    return SimpleNamespace(name=name, nodeid=f"{module}::{name}",
                           get_closest_marker=lambda m: marker if m == "multiprocess" else None)


def test_the_fast_tests_run_first_in_file_order_then_the_longest_modules():
    longest, shortest = max(COSTS, key=COSTS.get), min(COSTS, key=COSTS.get)
    items = [item("s1", True, shortest), item("a_fast", False), item("l1", True, longest), item("b_fast", False),
             item("s2", True, shortest), item("new", True, "tests/test_new.py"), item("l2", True, longest),
             item("c", False)]
    items.sort(key=order)
    assert [i.name for i in items] == ["a_fast", "b_fast", "c", "l1", "l2", "new", "s1", "s2"]


def test_every_module_of_multiprocess_tests_has_a_cost():
    """tests/costs.json orders the modules; one it lacks is guessed at a minute."""
    modules = run.multiprocess_modules()
    assert "tests/launch/test_equivalence.py" in modules and "tests/test_make.py" not in modules
    assert modules <= set(COSTS), sorted(modules - set(COSTS))
    assert 60.0 < max(COSTS.values()) and min(COSTS.values()) < 60.0


def test_a_shared_folder_is_made_once_and_again_after_a_failed_make(tmp_path_factory):
    made = []

    def failing(d: Path) -> None:
        (d / "half").touch()
        raise RuntimeError("make failed")

    with pytest.raises(RuntimeError):
        shared(tmp_path_factory, "test-make", failing)
    folder = shared(tmp_path_factory, "test-make", lambda d: made.append(d))
    assert shared(tmp_path_factory, "test-make", lambda d: made.append(d)) == folder
    assert made == [folder] and not (folder / "half").exists()


def fast_tier(session: pytest.Session) -> list[str]:
    """The node ids ``make test-fast`` runs. Where this session collected the whole suite unfiltered
    (``make test``, ``make test-fast``: every test module is imported already), from its own items
    by the same marker expression as ``-m``; else from a collection of its own (``--collect-only``:
    30 s on the 2-core machine under the suite, to import every test module again)."""
    config = session.config
    whole = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword \
        and config.option.markexpr in ("", run.FAST)
    if whole:
        expression = Expression.compile(run.FAST)
        return [i.nodeid for i in session.items if expression.evaluate(MarkMatcher.from_markers(i.iter_markers()))]
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-m", run.FAST],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    return [line for line in r.stdout.splitlines() if "::" in line]


def test_the_fast_tier_covers_every_package(request):
    tests = fast_tier(request.session)
    for package in ("tests/orchestrator/", "tests/launch/", "tests/shard_tools/", "tests/benchmarks/"):
        assert any(t.startswith(package) for t in tests), package
    # and a real run against the plain-PyTorch reference (a module all multiprocess: marked smoke)
    assert any(t.startswith("tests/launch/test_equivalence.py::") for t in tests)


@pytest.mark.parametrize("target", ["demo", "test"])
def test_make_needs_no_venv_on_path(target):
    """Every tool a target runs is .venv's, named by its path: nothing needs an activated shell."""
    for command in dry_run("-o", ".venv/.installed", target):
        if command[0] != "echo":
            assert command[0].startswith(".venv/bin/"), command


def test_the_costs_are_each_multiprocess_modules_seconds_from_a_junit_report(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text("""<testsuites><testsuite>
      <testcase classname="tests.orchestrator.test_a" name="t1" time="10.5"/>
      <testcase classname="tests.orchestrator.test_a.TestGroup" name="t2" time="2"/>
      <testcase classname="tests.launch.test_b" name="t3" time="4"/>
      <testcase classname="tests.test_fast" name="t4" time="1"/>
    </testsuite></testsuites>""")
    multiprocess = {"tests/orchestrator/test_a.py", "tests/launch/test_b.py"}
    assert run.costs(report, multiprocess) == {"tests/launch/test_b.py": 4.0, "tests/orchestrator/test_a.py": 12.5}


def test_the_cpu_costs_add_up_by_module_and_rank_the_tests(tmp_path):
    from tests import cpu_costs

    lines = [{"id": "tests/a.py::t1", "wall": 9.0, "self": 0.5, "children": 1.5},
             {"id": "tests/a.py::t2", "wall": 1.0, "self": 0.0, "children": 0.5},
             {"id": "tests/b.py::t3", "wall": 3.0, "self": 0.2, "children": 2.8}]
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:2]))
    (tmp_path / "gw1.jsonl").write_text(json.dumps(lines[2]) + "\n")
    text = cpu_costs.summary(tmp_path).splitlines()
    assert text[0] == "3 tests: 6 s of CPU, 13 s of wall time summed"
    modules = text[text.index("CPU s   wall s  module") + 1:][:2]
    assert [m.split() for m in modules] == [["3", "3", "tests/b.py"], ["2", "10", "tests/a.py"]]
    assert text[-3:] == ["   3.0     3.0  tests/b.py::t3", "   2.0     9.0  tests/a.py::t1", "   0.5     1.0  tests/a.py::t2"]
