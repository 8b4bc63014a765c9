"""The run directory and the journal as untrusted input: a lock-only folder, an unwritable output
folder, an edited schedule copy, journal lines that are not events. Nothing here starts a phase."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from launch.contract.pids import started
from orchestrator.cli import main
from orchestrator.errors import RunLocked
from orchestrator.journal import JsonlTail
from shard_tools.history import read_journal
from launch.contract.files import RunDir
from orchestrator.rundir import KEEP_PHASE_DIRS, LOCK, RunLock, prune_phase_dirs
from orchestrator.runner import Runner
from orchestrator.validate import load_schedule
from tests.conftest import cli, schedule_dict, write_schedule


def invoke(*args: str | Path):
    return CliRunner().invoke(main, [str(a) for a in args], env={"COLUMNS": "400"})


@pytest.fixture
def sched(tmp_path, tiny_model, tiny_data) -> Path:
    return write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data))


def test_lock_only_folder_becomes_the_run_directory(tmp_path, sched):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK).write_text("123\n")
    assert Runner(load_schedule(sched))._prepare_run_dir()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "phases", "schedule.toml"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


def test_lock_only_folder_held_by_an_orchestrator_is_left_alone(tmp_path, sched):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run), pytest.raises(RunLocked):
        Runner(load_schedule(sched))._prepare_run_dir()
    assert [p.name for p in run.iterdir()] == [LOCK]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


@pytest.fixture
def read_only(tmp_path) -> Path:
    """A folder nobody can create anything in, root included (immutable where chmod is not enough)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    immutable = os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        (folder / "probe").mkdir()
        pytest.skip("cannot make a folder unwritable here")
    except OSError:
        pass
    yield folder
    if immutable:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)


def test_unwritable_output_folder_is_bad_input(sched, read_only):
    out = read_only / "run"
    r = cli("orchestrator", "run", str(sched), "--output-dir", str(out), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"orchestrator: {out}: cannot create the run directory: ")
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("edit, expected", [
    (lambda t: t + "\n[[[\n", "TOML syntax error"),
    (lambda t: t.replace("[optimizer]\n", "[optimizer]\nlearning_rate = 1.0\n"), "optimizer.learning_rate"),
    (lambda t: t.replace("seed = 0", 'seed = "zero"'), "run.seed"),
    (lambda t: t.replace("[run]\n", "run = 5\n[xrun]\n"), ""),
    (lambda t: b"\xff\xfe".decode("latin-1") + t, "UTF-8"),
], ids=["toml", "unknown-key", "bad-value", "not-a-table", "not-utf8"])
def test_edited_schedule_copy_is_named(tmp_path, sched, edit, expected):
    Runner(load_schedule(sched))._prepare_run_dir()
    copy = tmp_path / "run" / "schedule.toml"
    copy.write_bytes(edit(copy.read_text()).encode("latin-1"))
    r = cli("orchestrator", "run", str(sched), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"orchestrator: {copy}: ") and expected in r.stderr
    assert "Traceback" not in r.stderr
    assert not list((tmp_path / "run" / "phases").iterdir())


def test_schedule_copy_that_is_not_a_file_is_named(tmp_path, sched):
    Runner(load_schedule(sched))._prepare_run_dir()
    copy = tmp_path / "run" / "schedule.toml"
    copy.unlink()
    os.mkfifo(copy)
    r = cli("orchestrator", "run", str(sched), timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"orchestrator: {copy}: a FIFO, where the run keeps a file: move it away and run again\n"


NOT_EVENTS = [
    "not json", "[1, 2]", '"text"', "42", "null", "{}", '{"time": 1.0}', '{"event": "run_done"}',
    '{"event": 7, "time": 1.0}', '{"event": "x", "time": "noon"}', '{"event": "x", "time": true}',
    '{"event": "phase_started", "time": 1.0, "phase": "0", "start_step": 0, "end_step": 2, "layers": [0]}',
    '{"event": "phase_started", "time": 1.0, "phase": 0, "start_step": 0, "end_step": 2}',
    '{"event": "phase_started", "time": 1.0, "phase": 0, "start_step": 0, "end_step": 2, "layers": ["a"]}',
    '{"event": "phase_done", "time": 1.0, "phase": 0, "step": 2, "layers": [0], "records": [1]}',
    '{"event": "phase_failed", "time": 1.0, "phase": 0, "reason": 5}',
]


@pytest.fixture
def junk_run(tiny_run, tmp_path) -> Path:
    """A copy of a real finished run whose journal has lines that are not events among its own."""
    run = Path(shutil.copytree(tiny_run, tmp_path / "run"))
    lines = (run / "journal.jsonl").read_text().splitlines()
    mixed = [x for pair in zip(lines, NOT_EVENTS * len(lines)) for x in pair]
    (run / "journal.jsonl").write_bytes("\n".join(mixed).encode() + b"\n\xff\xfe\n" + b'{"event": "run_done", "time": 2e9, "st')
    return run


def test_journal_lines_that_are_not_events_are_skipped(junk_run, tiny_run):
    assert read_journal(junk_run) == read_journal(tiny_run)
    r = invoke("status", junk_run)
    assert r.exit_code == 0, r.output
    assert ": done" in r.output
    r = invoke("report", junk_run, "--out", junk_run / "r.png")
    assert r.exit_code == 0, r.output


def test_metrics_lines_that_are_not_objects_are_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    path.write_text('[1]\n"x"\n3\n{"step": 1, "loss": 2.0}\n' + json.dumps({"step": 2})[:5])
    assert tail.new() == [{"step": 1, "loss": 2.0}]


def test_failed_status_names_the_reason(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    events = [{"event": "run_started", "time": 1.0, "phases": 1, "total_steps": 2},
              {"event": "phase_started", "time": 2.0, "phase": 0, "start_step": 0, "end_step": 2, "layers": [0]},
              {"event": "phase_failed", "time": 3.0, "phase": 0, "rc": 1, "reason": "[why] it broke"}]
    (run / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    r = invoke("status", run)
    assert r.exit_code == 0, r.output
    assert f"{run}: failed (phase 0: [why] it broke)" in r.output
    assert '"reason": "[why] it broke"' in r.output  # the table shows the reason as written, not as markup


def test_phases_keeps_the_last_phases_folders_and_those_with_a_process_left(tmp_path):
    """``prune_phase_dirs``: the folders of phases ``KEEP_PHASE_DIRS`` or more before the one done
    go, but one whose recorded process is alive stays (a leftover the next run reaps), and a
    hidden one that a kill mid-removal left goes."""
    run = RunDir(tmp_path)
    for i in range(12):
        (run.phase(i).path / "exit").mkdir(parents=True)
    me = psutil.Process()
    alive = run.phase(1).pids
    alive.mkdir()
    (alive / "rank-0.json").write_text(json.dumps({"pid": me.pid, "started": started(me.pid)}))
    half = tmp_path / "phases" / ".phase-0000.gone"
    (half / "exit").mkdir(parents=True)
    removed = prune_phase_dirs(tmp_path, 11)
    assert sorted(p.name for p in removed) == ["phase-0000", "phase-0002", "phase-0003"]
    assert sorted(p.name for p in (tmp_path / "phases").iterdir()) == [
        "phase-0001", *(f"phase-{i:04d}" for i in range(11 - KEEP_PHASE_DIRS + 1, 12))]


def test_a_copy_of_a_run_directory_holds_no_process_of_its_own(tmp_path):
    """``cp -a RUN RUN2``, then a run in RUN2: the copied records are the original's live processes,
    which the copy's run reaped as leftovers (killing the original's ranks). Records written before
    they named their run directory are read as before."""
    from orchestrator.procs import recorded

    me = psutil.Process()
    phase = RunDir(tmp_path / "run").phase(0)
    phase.record_pid("rank-0", me.pid, started(me.pid))
    phase.pids.joinpath("rank-1.json").write_text(json.dumps({"pid": me.pid, "started": started(me.pid)}))
    assert [p.pid for p in recorded(phase.path)] == [me.pid, me.pid]
    shutil.copytree(tmp_path / "run", tmp_path / "copy", symlinks=True)
    copied = RunDir(tmp_path / "copy").phase(0)
    assert [r.pid for r in copied.pid_records()] == [me.pid]  # the record of before
    assert [p.pid for p in recorded(copied.path, "rank-0")] == []
