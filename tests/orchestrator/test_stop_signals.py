"""Ctrl-C twice: the first stops at a checkpoint; the second ends the run at once, as torchrun does
(issue #24), saying what the stop was waiting for and what is kept (exit 75, nothing left
running), and running again resumes. A scheduler's repeated SIGTERM only says what it waits for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from orchestrator import backstop
from orchestrator.errors import STOP_SIGNALS
from orchestrator.retention import named_at_stop
from orchestrator.runner import Runner
from orchestrator.validate import load_schedule
from shard_tools.store import Checkpoints
from tests.conftest import alive, cli, faults_env, schedule_dict, write_schedule
from tests.orchestrator.test_preemption import events, metrics_steps, rank_pids, start, wait_for


@pytest.mark.multiprocess
def test_a_second_ctrl_c_ends_the_run_at_once_saying_what_it_waited_for(tmp_path, tiny_model, tiny_data):
    """Seen: a second Ctrl-C was silently ignored while the checkpoint was written."""
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, launch={"grace_seconds": 300},
                                                              checkpoint={"every_steps": 2}))
    run = tmp_path / "run"
    # The checkpoint after steps 2 and 4 takes long (the stop's, or the one of step 6): its writer
    # sleeps once its head file is written.
    orch = start(sched, faults_env(hold_at={"point": "checkpoint.file_written", "name": "head.safetensors",
                                            "seconds": 600, "skip": 2}))
    try:
        wait_for(lambda: metrics_steps(run) >= 5 or orch.poll() is not None, timeout=600, what="phase 0's steps")
        orch.send_signal(signal.SIGINT)
        wait_for(lambda: any(e["event"] == "stop_requested" for e in events(run)), what="the stop")
        time.sleep(1)  # the ranks got it and write their checkpoint, which holds
        ranks = rank_pids(run)
        assert ranks and all(alive(r) for r in ranks) and orch.poll() is None
        t0 = time.time()
        orch.send_signal(signal.SIGINT)
        _, err = orch.communicate(timeout=60)
    finally:
        if orch.poll() is None:
            orch.kill()
    assert orch.returncode == 75, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert time.time() - t0 < 30, "the second Ctrl-C did not end the run at once"
    assert "a second Ctrl-C ends the run at once" in err  # said at the first
    assert ("ended at once by a second Ctrl-C (SIGINT), while waiting for phase 0 to finish its step and write its "
            "checkpoint (") in err, err
    assert "kept: the checkpoints up to step 4; run the same command again to resume" in err, err
    psutil.wait_procs([psutil.Process(r["pid"]) for r in rank_pids(run) if alive(r)], timeout=10)
    assert not [r for r in rank_pids(run) if alive(r)]
    last = [e for e in events(run) if e["event"] == "preempted"][-1]
    assert last["forced"] and last["signal"] == signal.SIGINT and last["step"] == 4
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr


def test_a_repeated_sigterm_or_sigusr1_waits_for_the_checkpoint_saying_what_it_waits_for(tmp_path, tiny_model,
                                                                                          tiny_data):
    """A scheduler repeats its SIGTERM (LSF sends SIGINT, then SIGTERM): the stop's checkpoint still
    comes; only a Ctrl-C after a stop ends the run without it."""
    runner = Runner(load_schedule(write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data))))
    said, ended = [], []
    runner._event = lambda event, **fields: said.append((event, fields))
    runner._end_now = ended.append
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        runner._on_signal(signum, None)
    assert runner.stop_signal == signal.SIGINT and not ended
    assert said == [("stop_repeated", {"signal": s, "waiting_for": "the orchestrator to journal what is done and exit"})
                    for s in (signal.SIGTERM, signal.SIGUSR1)]
    runner._on_signal(signal.SIGINT, None)
    assert ended == [signal.SIGINT]


def test_a_second_stop_signal_writes_no_broken_pipe_traceback(tmp_path, monkeypatch):
    """Seen: a second Ctrl-C printed "Exception ignored when trying to write to the signal wakeup
    fd ... BrokenPipeError" before its message: the backstop had closed the pipe after the first."""
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)
    got = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    disarm = backstop.arm(tmp_path, 1000, (signal.SIGUSR1,))
    try:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.3)  # the backstop's thread reads the first
    finally:
        disarm()
        signal.signal(signal.SIGUSR1, old)
    assert got == [signal.SIGUSR1] * 2 and not ignored, [u.exc_value for u in ignored]


def test_sighup_stops_as_sigterm_does_and_a_hung_up_terminal_is_dropped(tmp_path, tiny_model, tiny_data):
    """Closing the terminal (SIGHUP) killed the run without a checkpoint: it is a stop signal now,
    and the terminal it hung up is replaced by /dev/null (a write to it raises EIO), a pipe kept."""
    runner = Runner(load_schedule(write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data))))
    assert signal.SIGHUP in STOP_SIGNALS
    code = ("import os, sys\nfrom orchestrator import procs\nmaster, slave = os.openpty()\nos.dup2(slave, 1)\n"
            "os.close(slave)\nos.close(master)\n"  # hung up
            "procs.drop_terminal()\nprint('to the terminal, now /dev/null', flush=True)\n"
            "print('to the pipe', file=sys.stderr, flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "to the pipe\n", r.stderr
    runner._event = lambda event, **fields: None
    old = os.dup(1), os.dup(2)
    try:
        runner._on_signal(signal.SIGHUP, None)  # the test's own output is a pipe or a file: kept
    finally:
        os.dup2(old[0], 1)
        os.dup2(old[1], 2)
    assert runner.stop_signal == signal.SIGHUP


def test_the_checkpoint_a_stop_named_is_protected_until_a_later_stop_or_the_runs_end(tmp_path):
    store = Checkpoints(tmp_path)
    lines = [{"event": "preempted", "step": 25, "checkpoint": str(store.at(25))},
             {"event": "resumed", "step": 25}, {"event": "checkpoint_committed", "step": 30}]
    (tmp_path / "journal.jsonl").write_text("".join(json.dumps({"time": 0, **e}) + "\n" for e in lines))
    assert named_at_stop(store) == set()  # not there (set aside by --resume-from): nothing to keep
    store.at(25).mkdir(parents=True)
    assert named_at_stop(store) == {store.at(25)}
    more = [{"event": "preempted", "step": 30}, {"event": "resumed", "step": 30}]  # named none: 25 still
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write("".join(json.dumps({"time": 0, **e}) + "\n" for e in more))
    assert named_at_stop(store) == {store.at(25)}
    with open(tmp_path / "journal.jsonl", "a") as f:
        f.write(json.dumps({"time": 0, "event": "run_done", "step": 40}) + "\n")
    assert named_at_stop(store) == set()


@pytest.mark.multiprocess
def test_a_stop_between_two_phases_names_the_checkpoint_it_kept(tmp_path, tiny_model, tiny_data):
    """A stop that lands after a phase ended and before the next one started said "stopped by signal
    15 before phase 1; run again to resume" without naming a checkpoint, and its ``preempted`` event
    named none, so retention did not keep it for the user as it keeps a mid-phase stop's."""
    phases = [{"steps": 3, "layers": [0]}, {"steps": 3, "layers": [1]}]
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, launch={"prewarm": False},
                                                              schedule={"phases": phases}))
    run = tmp_path / "run"
    # Phase 0's rank holds 4 s once its end checkpoint's files are written: the stop lands there,
    # where the phase ends as it would have anyway, and the next one is not started.
    orch = start(sched, faults_env(hold_at={"point": "checkpoint.file_written", "name": "state.safetensors", "seconds": 4}))
    try:
        wait_for(lambda: metrics_steps(run) >= 3 or orch.poll() is not None, timeout=300, what="phase 0's last step")
        orch.send_signal(signal.SIGTERM)
        _, err = orch.communicate(timeout=120)
    finally:
        if orch.poll() is None:
            orch.kill()
    ckpt = Checkpoints(run).at(3)
    assert orch.returncode == 75, err
    assert f"stopped by signal 15 before phase 1; kept: the checkpoint at step 3 ({ckpt}); run again to resume" in err, err
    last = [e for e in events(run) if e["event"] == "preempted"][-1]
    assert last["step"] == 3 and last["checkpoint"] == str(ckpt)
    assert named_at_stop(Checkpoints(run)) == {ckpt}
