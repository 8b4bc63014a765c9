"""The fork server started early (``launch.zygote --early``): it imports while the orchestrator
checks the schedule and prepares the data, serves the run once told where, and never outlives a
run that ends before its first phase; one that died is replaced by a fork server started as before."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from orchestrator.errors import RelayerError
from orchestrator.groups import PhaseProcesses
from orchestrator.runner import Runner
from orchestrator.validate import load_schedule
from orchestrator.schedule import LaunchSection
from tests.conftest import schedule_dict, write_schedule

pytestmark = pytest.mark.multiprocess


def test_a_run_is_served_by_the_fork_server_it_started_early(tiny_run):
    started = [json.loads(x) for x in (tiny_run / "journal.jsonl").read_text().splitlines()
               if '"zygote_started"' in x]
    assert len(started) == 1 and started[0]["early"] is True
    assert (tiny_run / "zygote.log").exists()


def test_a_run_refused_for_its_data_ends_its_early_fork_server(tmp_path, tiny_model):
    """In process, so that no parent-death signal (the fork server's backstop) ends it instead."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": "not tokens"}\n')
    runner = Runner(load_schedule(write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, data))))
    started = []
    start = runner.groups.start_early
    runner.groups.start_early = lambda: (start(), started.append(runner.groups.early))
    with pytest.raises(RelayerError, match="bad.jsonl"):
        runner.run()
    assert len(started) == 1 and started[0] is not None
    assert started[0].poll() is not None and runner.groups.early is None
    assert not (tmp_path / "run").exists()


def test_an_early_fork_server_that_died_is_replaced(tmp_path):
    events = []
    procs = PhaseProcesses(tmp_path, LaunchSection(), lambda e, **f: events.append({"event": e, **f}), None)
    procs.start_early()
    early = procs.early
    assert early is not None and early.poll() is None
    early.kill()
    early.wait()
    spec = tmp_path / "spec.json"  # no spec: the new one fails at once, what counts is that it is new
    spec.write_text("{}")
    server = procs.fork_server(spec)
    try:
        assert server is not early and events == [
            {"event": "zygote_early_died", "pid": early.pid, "how": "by signal SIGKILL", "output": ""},
            {"event": "zygote_started", "pid": server.pid, "early": False}]
    finally:
        procs.stop_fork_server()
    assert server.poll() is not None and procs.early is None and procs.early_out is None


def test_an_early_fork_server_that_died_leaves_its_reason_in_the_journal(tmp_path, monkeypatch):
    """Its output goes nowhere until it is told its log; where it dies first (a broken install, an
    import that fails), the journal keeps how it ended and the last of what it printed."""
    import orchestrator.groups as groups

    failing = [sys.executable, "-c", "import sys; print('ImportError: no module named deepspeed', file=sys.stderr); sys.exit(3)"]
    real = groups.python_m
    monkeypatch.setattr(groups, "python_m", lambda *args: failing if args[-1] == groups.EARLY else real(*args))
    events = []
    procs = PhaseProcesses(tmp_path, LaunchSection(), lambda e, **f: events.append({"event": e, **f}), None)
    procs.start_early()
    procs.early.wait()
    monkeypatch.undo()
    (tmp_path / "spec.json").write_text("{}")
    server = procs.fork_server(tmp_path / "spec.json")
    procs.stop_fork_server()
    died, started = events
    assert died["event"] == "zygote_early_died" and died["how"] == "with exit code 3"
    assert died["output"] == "ImportError: no module named deepspeed\n" and started["pid"] == server.pid
