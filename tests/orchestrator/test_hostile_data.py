"""Data and templates as hostile input through ``plan``, ``data`` and ``run``: a template that loops,
fails or renders no assistant turn, data with no target token, ids past 32 bits, a float id, JSON
nested deep enough to crash a C parser, and stops while a large file is tokenized. Each is exit 2
naming the key or file (75 for a stop), one line, nothing left running or on disk. No phase starts:
every case ends before the run directory is made."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from orchestrator import runner
from orchestrator.cli import main
from orchestrator.datastep import scratch_root, stage_data
from orchestrator.errors import RunLocked
from orchestrator.rundir import RunLock, create_run_dir
from orchestrator.validate import load_schedule
from tests.conftest import faults_env, said
from tests.orchestrator.test_data_cli import (  # noqa: F401 - model: a fixture
    CHATS, INSTRUCTIONS, model, sched, stop_while_preparing,
)

ORCH = str(Path(sys.executable).parent / "orchestrator")
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def refused(schedule: Path, *fragments: str, commands=("plan", "data")) -> None:
    """Exit 2 from each command, one ``orchestrator:`` line holding every fragment, nothing written."""
    before = sorted(schedule.parent.iterdir())
    for command in commands:
        r = CliRunner().invoke(main, [command, str(schedule)])
        assert r.exit_code == 2, (command, r.output, r.exception)
        assert r.output.startswith("orchestrator: ") and r.output.count("\n") == 1, r.output
        assert "Traceback" not in r.output
        for fragment in fragments:
            assert fragment in r.output, (fragment, r.output)
        assert sorted(schedule.parent.iterdir()) == before


def test_a_template_that_loops_is_stopped_by_its_budget(tmp_path, model):
    t0 = time.monotonic()
    refused(sched(tmp_path, model, CHATS, "chat", chat_template=LOOP + "{{ messages[0].content }}"),
            "data.chat_template: rendering one conversation took more than", commands=("plan",))
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("source,cause", [
    ("{% for m in messages %}", "TemplateSyntaxError"),
    ("{{ raise_exception('only one user turn') }}", "only one user turn"),
    ("{{ messages[0].nope.deeper }}", "UndefinedError"),
    ("{{ cycler.__init__.__globals__ }}", "SecurityError"),
])
def test_a_failing_template_is_exit_2_naming_data_chat_template(tmp_path, model, source, cause):
    refused(sched(tmp_path, model, CHATS, "chat", chat_template=source), "data.chat_template: ", cause)


def test_a_template_rendering_no_assistant_turn_trains_on_nothing(tmp_path, model):
    refused(sched(tmp_path, model, CHATS, "chat", chat_template="{% for m in messages %}{% if m.role != 'assistant' %}"
                  "{{ m.content }}{% endif %}{% endfor %}"), "data.path: no target tokens")


def test_a_file_that_is_no_template_trains_on_nothing(tmp_path, model):
    (tmp_path / "README.md").write_text("# Notes\n\nnot a template at all\n")
    refused(sched(tmp_path, model, CHATS, "chat", chat_template="README.md"), "data.path: no target tokens")


def test_labels_that_are_all_ignored_train_on_nothing(tmp_path, model):
    records = [{"input_ids": [5, 6, 7, 8], "labels": [-100] * 4}] * 8
    refused(sched(tmp_path, model, records, "tokens"), "data.path: no target tokens", "every label is -100")


def test_prompts_all_longer_than_seq_len_train_on_nothing(tmp_path, model):
    refused(sched(tmp_path, model, INSTRUCTIONS, "instruction", seq_len=12), "data.path: no target tokens",
            "8 of 8 examples cut")


@pytest.mark.parametrize("field,value", [("input_ids", 4294967301), ("input_ids", 2**31), ("labels", 4294967196)])
def test_ids_past_32_bits_are_refused_not_wrapped(tmp_path, model, field, value):
    bad = {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}
    bad[field] = [1, value, 3]
    schedule = sched(tmp_path, model, [{"input_ids": [1, 2, 3]}] * 3 + [bad], "tokens", pack=True)
    refused(schedule, f"s.toml.jsonl:4: {field}: token id {value} is not below the model's vocab_size")


def test_a_float_id_names_its_own_line(tmp_path, model):
    records = [{"input_ids": [1, 2, 3]}] * 5 + [{"input_ids": [1, 2.5, 3]}] + [{"input_ids": [4, 5]}] * 3
    refused(sched(tmp_path, model, records, "tokens"), "s.toml.jsonl:6: expected input_ids")


def test_json_nested_deep_enough_to_crash_the_reader_is_refused(tmp_path, model):
    deep = '{"input_ids": [1, 2], "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    refused(sched(tmp_path, model, [{"input_ids": [1, 2, 3]}, deep], "tokens"),
            "s.toml.jsonl:2: a record nested more than 100 deep")
    array = tmp_path / "a.json"
    array.write_text("[" + json.dumps({"input_ids": [1, 2, 3]}) + ", " + deep + "]")
    refused(sched(tmp_path, model, [], "tokens", name="b.toml", path=str(array)), "nested more than 100 deep")


def test_output_dir_at_the_root_is_refused(tmp_path, model):
    r = CliRunner().invoke(main, ["run", str(sched(tmp_path, model, INSTRUCTIONS, "instruction")), "--output-dir", "/"])
    assert r.exit_code == 2 and "--output-dir: expected a folder of its own for the run" in r.output, r.output


def big_schedule(tmp: Path, model: Path) -> Path:
    """25,000 token records (datasets.map in worker processes) that each wait in every batch."""
    records = [{"input_ids": [(i + j) % 500 for j in range(16)]} for i in range(25_000)]
    return sched(tmp, model, records, "tokens", seq_len=16)


def preparing(orch: subprocess.Popen, workers: int = 2) -> list[int]:
    """The pids of the data tool and its workers, once they are there."""
    me = psutil.Process(orch.pid)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        kids = [k for k in me.children(recursive=True) if _alive(k)]
        if len(kids) > workers:
            return [k.pid for k in kids]
        assert orch.poll() is None, said(orch)
        time.sleep(0.1)
    raise AssertionError("the data tool's workers never started")


def _alive(proc: psutil.Process) -> bool:
    """Not a zombie, nor gone since it was listed (a short-lived helper of the data tool)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pids: list[int]) -> bool:
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


@pytest.mark.parametrize("command,sig", [("plan", signal.SIGTERM), ("data", signal.SIGINT), ("run", signal.SIGTERM),
                                         ("run", signal.SIGINT)])
def test_a_stop_while_a_large_file_is_tokenized_leaves_nothing(tmp_path, model, command, sig):
    schedule = big_schedule(tmp_path, model)
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {**os.environ, **faults_env(hold_data_batch=0.3), "TMPDIR": str(tmpdir)}
    orch, pids = stop_while_preparing([ORCH, command, str(schedule)], sig, preparing, env)
    deadline = time.monotonic() + 10
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pids)
    assert list(tmpdir.iterdir()) == [] and not (tmp_path / "run").exists()
    assert not list(tmp_path.glob(".relayer-data-*"))
    assert not list(scratch_root().glob(f"relayer-data-{orch.pid}.*"))  # its TMPDIR is too long for sockets


def test_a_temporary_folder_too_long_for_sockets_is_not_the_data_tools(tmp_path, monkeypatch):
    """datasets.map's manager listens at TMPDIR/pymp-*/listener-*: a TMPDIR past AF_UNIX's 107
    bytes ended the workers with EOFError; the data tool's scratch goes to a short folder then."""
    long = tmp_path / ("x" * 60)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    root = scratch_root()
    assert root != long and len(str(root)) + len("/relayer-data-4194304.abcdefgh/pymp-abcdefgh/listener-abcdefgh") <= 107
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert scratch_root() == (tmp_path if len(str(tmp_path)) <= 107 - 62 else root)


def test_a_killed_stagers_folder_goes_with_the_next_run(tmp_path, model):
    """A SIGKILLed orchestrator cannot clean up: its workers die with it, and its staging folder
    beside the run goes with the next run's staging; a live stager's stays."""
    schedule = big_schedule(tmp_path, model)
    orch = subprocess.Popen([ORCH, "run", str(schedule)], env={**os.environ, **faults_env(hold_data_batch=0.3)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    pids = preparing(orch)
    orch.kill()
    orch.communicate()
    deadline = time.monotonic() + 10
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(pids)
    assert len(list(tmp_path.glob(".relayer-data-*"))) == 1
    alive = tmp_path / f".relayer-data-run.{os.getppid()}.live"
    alive.mkdir()
    small = sched(tmp_path, model, INSTRUCTIONS, "instruction", name="small.toml")
    staged = stage_data(load_schedule(small))
    assert sorted(tmp_path.glob(".relayer-data-*")) == sorted([alive, staged])


def test_a_stager_that_loses_the_race_for_the_run_leaves_nothing(tmp_path, model, monkeypatch):
    """Two orchestrators start one new run: the one that finds the run made and held by the
    other after it staged its data removes what it staged."""
    schedule = sched(tmp_path, model, INSTRUCTIONS, "instruction")
    loaded = load_schedule(schedule)
    held = []

    def staged_then_beaten(*args):
        out = stage_data(*args)
        create_run_dir(loaded.output_dir, schedule.read_text())
        held.append(RunLock(loaded.output_dir).__enter__())
        return out

    monkeypatch.setattr(runner, "stage_data", staged_then_beaten)
    try:
        with pytest.raises(RunLocked):
            runner.Runner(loaded).run()
    finally:
        held[0].__exit__(None, None, None)
    assert not list(tmp_path.glob(".relayer-data-*"))


def test_a_killed_phases_wandb_temporaries_go_with_the_next_data_step(tmp_path, model, monkeypatch):
    """A phase that reports to W&B keeps W&B's temporaries in TMPDIR/relayer-wandb-<pid>.* and removes
    them at its end; one SIGKILLed cannot, and the next plan, data or run removes them (those of a
    live process stay)."""
    from launch.contract.files import WANDB_TMP

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left, live = tmp_path / f"{WANDB_TMP}{dead.pid}.abc", tmp_path / f"{WANDB_TMP}{os.getpid()}.def"
    for d in (left, live):
        (d / "tmpxyzwandb-media").mkdir(parents=True)
    r = CliRunner().invoke(main, ["plan", str(sched(tmp_path, model, INSTRUCTIONS, "instruction"))])
    assert r.exit_code == 0, r.output
    assert not left.exists() and live.is_dir()
