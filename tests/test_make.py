"""``make test`` and ``make venv`` as a new user meets them: progress from the first minute, every
failure reported (no stop at the first), the slowest tests at the end.

Seen on a fresh clone: ``make test`` printed its pytest line, then nothing for 177 s (``-q``, and a
multiprocess file first), then stopped at its first failure (``-x``); ``make demo`` spent 70 s in
a silent ``pip install -q``.
"""

from __future__ import annotations

import shlex
import subprocess
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT, pytest_collection_modifyitems


def dry_run(*args: str) -> list[list[str]]:
    """The commands ``make ARGS`` would run (``make -n``), split."""
    r = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                       check=True)
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def test_make_test_shows_progress_reports_every_failure_and_the_slowest():
    pytest_line, = [c for c in dry_run("-o", ".venv/.installed", "test") if "pytest" in c]
    assert "-x" not in pytest_line and "--exitfirst" not in pytest_line  # runs to the end
    assert "-q" not in pytest_line  # a line per test file with its progress, not dots alone
    assert any(a.startswith("--durations=") for a in pytest_line)


def test_the_venv_is_made_in_the_open():
    """pip says what it fetches, and make first says what is coming and how long it takes."""
    commands = dry_run("-B", ".venv/.installed")
    install, = [c for c in commands if c[0].endswith("/pip") and "install" in c]
    assert "-q" not in install and "--quiet" not in install
    assert commands[0][0] == "echo" and "minutes" in commands[0][-1]


def item(name: str, multiprocess: bool) -> SimpleNamespace:
    marker = object() if multiprocess else None
    return SimpleNamespace(name=name, get_closest_marker=lambda m: marker if m == "multiprocess" else None)


def test_the_fast_tests_run_first_each_kind_in_file_order():
    items = [item("a_mp", True), item("a_fast", False), item("b_mp", True), item("b_fast", False), item("c", False)]
    pytest_collection_modifyitems(items)
    assert [i.name for i in items] == ["a_fast", "b_fast", "c", "a_mp", "b_mp"]


@pytest.mark.parametrize("target", ["demo", "test"])
def test_make_needs_no_venv_on_path(target):
    """Every tool a target runs is .venv's, named by its path: nothing needs an activated shell."""
    for command in dry_run("-o", ".venv/.installed", target):
        if command[0] != "echo":
            assert command[0].startswith(".venv/bin/"), command
