"""A step of the wall clock (NTP, a virtual machine restored from a snapshot, ``date -s``) changes
nothing: a process is known by its pid and its start counted from the machine's boot
(``launch.contract.pids``), never by psutil's create time, which a step moves.

Seen: a phase of a CI run on a freshly forked virtual machine died with nothing in its log; its
rank's watch on the orchestrator compared create times, took the orchestrator for gone after the
clock was stepped and SIGKILLed itself. These tests step the real clock (root, CAP_SYS_TIME), by a
few seconds and back, so they run alone.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launch.contract.files import RANK, PhaseDir
from launch.contract.pids import started
from orchestrator.procs import recorded
from shard_tools.history import read_journal
from tests.conftest import faults_env, said, schedule_dict, write_schedule

pytestmark = pytest.mark.alone  # the whole machine's clock moves

STEP = 60.0
"""Seconds: more than the run's launch.stall_seconds below, also with the allowance of a quiet phase
(``orchestrator.watchdog.QUIET_ALLOWANCE`` times it)."""


@contextlib.contextmanager
def clock_stepped(seconds: float):
    """The wall clock stepped by ``seconds`` inside the block, and back after it."""
    try:
        time.clock_settime(time.CLOCK_REALTIME, time.clock_gettime(time.CLOCK_REALTIME) + seconds)
    except PermissionError as e:
        pytest.skip(f"cannot step the clock (needs CAP_SYS_TIME): {e}")
    try:
        yield
    finally:
        time.clock_settime(time.CLOCK_REALTIME, time.clock_gettime(time.CLOCK_REALTIME) - seconds)


def test_a_process_start_is_read_whatever_its_name_and_is_not_moved_by_the_clock(tmp_path):
    # /proc/PID/stat's second field is the command name in parentheses, which may hold both.
    odd = tmp_path / "a) (b c"
    odd.symlink_to("/bin/sleep")
    proc = subprocess.Popen([str(odd), "60"])
    try:
        assert psutil.Process(proc.pid).name() == "a) (b c"
        before, created = started(proc.pid), psutil.Process(proc.pid).create_time()
        assert abs(before - (created - psutil.boot_time())) < 0.05
        files = PhaseDir(tmp_path / "run" / "phases" / "phase-0000")
        files.record_pid(f"{RANK}0", proc.pid, before)
        with clock_stepped(STEP):
            assert started(proc.pid) == before
            assert psutil.Process(proc.pid).create_time() != created  # what the old match compared
            assert [p.pid for p in recorded(files.path)] == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(psutil.NoSuchProcess):
        started(proc.pid)


@pytest.mark.multiprocess
def test_a_run_goes_on_through_steps_of_the_clock(tmp_path, tiny_model, tiny_data):
    """Stepped forward past ``launch.stall_seconds`` while a phase trains, and back: no rank takes
    its orchestrator for gone, no stall is seen (idle times are on the monotonic clock)."""
    sched = schedule_dict(tiny_model, tiny_data, run={"output_dir": str(tmp_path / "run")},
                          launch={"stall_seconds": 10})
    sched["schedule"] = {"phases": [{"steps": 4, "layers": [i]} for i in range(3)]}
    path = write_schedule(tmp_path / "s.toml", sched)
    # Steps of about a second (two held micro-batches): the clock moves while a phase trains.
    env = {**os.environ, **faults_env(hold_at={"point": "data.micro_batch", "seconds": 0.5})}
    orch = subprocess.Popen([str(Path(sys.executable).parent / "orchestrator"), "run", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert orch.poll() is None, said(orch)
            assert time.monotonic() < deadline, "no step in 300 s"
            time.sleep(0.05)
        for step in (STEP, -STEP):
            with clock_stepped(step):
                time.sleep(1.5)  # the watch looks every 0.5 s, the supervisor more often
        _, err = orch.communicate(timeout=300)
    finally:
        if orch.poll() is None:
            orch.kill()
    assert orch.returncode == 0, err
    assert [e for e in read_journal(tmp_path / "run") if e.get("event") in ("phase_failed", "phase_stalled")] == []
    assert (tmp_path / "run" / "checkpoints" / "step-00000012" / "manifest.json").is_file()
