"""Ctrl-C, again and again: the first stops at a checkpoint, the second says what the stop waits
for, the third ends the run at once (exit 75, nothing left running), and running again resumes."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from tests.conftest import cli, faults_env, schedule_dict, write_schedule
from tests.orchestrator.test_preemption import alive, events, metrics_steps, rank_pids, start, wait_for

pytestmark = pytest.mark.multiprocess


def test_a_second_ctrl_c_says_what_it_waits_for_and_a_third_ends_at_once(tmp_path, tiny_model, tiny_data):
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, launch={"grace_seconds": 300}))
    run = tmp_path / "run"
    # The stop's checkpoint takes long: its head file's writer sleeps once it is written.
    orch = start(sched, faults_env(hold_at={"point": "checkpoint.file_written", "name": "head.safetensors",
                                            "seconds": 600}))
    try:
        wait_for(lambda: metrics_steps(run) >= 2 or orch.poll() is not None, timeout=600, what="phase 0's steps")
        orch.send_signal(signal.SIGINT)
        wait_for(lambda: any(e["event"] == "stop_requested" for e in events(run)), what="the stop")
        time.sleep(1)  # the ranks got it and write their checkpoint, which holds
        orch.send_signal(signal.SIGINT)
        wait_for(lambda: any(e["event"] == "stop_repeated" for e in events(run)), what="the second stop")
        assert orch.poll() is None, "a second Ctrl-C must not end the run"
        repeated, = [e for e in events(run) if e["event"] == "stop_repeated"]
        assert repeated["waiting_for"].startswith("phase 0 to finish its step and write its checkpoint (at most ")
        ranks = rank_pids(run)
        assert ranks and all(alive(r) for r in ranks)
        t0 = time.time()
        orch.send_signal(signal.SIGINT)
        _, err = orch.communicate(timeout=60)
    finally:
        if orch.poll() is None:
            orch.kill()
    assert orch.returncode == 75, err
    assert time.time() - t0 < 30, "the third Ctrl-C did not end the run at once"
    assert "still stopping: waiting for phase 0 to finish its step and write its checkpoint" in err
    assert "ended at once by a third stop signal; abandoned: phase 0 to finish its step" in err, err
    psutil.wait_procs([psutil.Process(r["pid"]) for r in rank_pids(run) if alive(r)], timeout=10)
    assert not [r for r in rank_pids(run) if alive(r)]
    last = [e for e in events(run) if e["event"] == "preempted"][-1]
    assert last["forced"] and last["signal"] == signal.SIGINT
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr
