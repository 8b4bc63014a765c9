"""A stalled phase is found, shown and ended (the watchdog, ``launch.stall_seconds``), and a stop
always stops, whatever the phase or the orchestrator's main thread is stuck in. Real runs of the
tiny 3-phase schedule (``reference`` is the uninterrupted one), a rank stalled through the fault
points (``stall_at``: it sleeps for good, catching SIGTERM as a rank does).

On the CPU a handover goes through a file (``launch.handover = "on"``); on CUDA (``-m cuda``) the
stall tests run again with CUDA IPC (``"auto"``, bfloat16)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest
import torch

from shard_tools.history import read_journal
from tests.conftest import alive, cli, faults_env, said, schedule_dict, write_schedule
from tests.reference import bitwise_equal, composed

pytestmark = pytest.mark.multiprocess
ORCH = str(Path(sys.executable).parent / "orchestrator")
GRACE = 2
STALL = 5  # 20 s before a first step (watchdog.QUIET_ALLOWANCE)
FIRST_STEP_1 = {"point": "phase.first_step", "phase": 1}
CUDA = torch.cuda.is_available()
HANDING_OVER = {"handover": "on", "prewarm_depth": 1}


@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")])])
def device(request) -> str:
    return request.param


def on(device: str, path: Path, model: Path, data: Path, **launch) -> tuple[Path, dict[str, str]]:
    """The tiny schedule at ``path`` for ``device`` (a handover "on" is CUDA's "auto" there, in
    bfloat16), and the environment its run needs."""
    if device == "cuda" and launch.get("handover") == "on":
        launch["handover"] = "auto"
    dtype = {"model": {"path": str(model), "dtype": "bfloat16"}} if device == "cuda" else {}
    return write_schedule(path, schedule_dict(model, data, launch=launch, **dtype)), {"DS_ACCELERATOR": device}


@pytest.fixture(scope="module")
def reference(device, tiny_run, tiny_model, tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted run on ``device``."""
    if device == "cpu":
        return tiny_run
    d = tmp_path_factory.mktemp("cuda-run")
    sched, env = on(device, d / "s.toml", tiny_model, tiny_data)
    r = cli("orchestrator", "run", str(sched), env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return d / "run"


def rerun_equal(sched: Path, env: dict, run: Path, model: Path, reference: Path) -> None:
    """The schedule run again completes, bitwise equal to the uninterrupted run."""
    r = cli("orchestrator", "run", str(sched), env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(model, run), composed(model, reference))


def start(sched: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([ORCH, "run", str(sched)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, start_new_session=True)


@contextmanager
def running(sched: Path, env: dict) -> Iterator[subprocess.Popen]:
    """``start``, and whatever the test ends in, the run's whole session gone after."""
    orch = start(sched, env)
    try:
        yield orch
    finally:
        if orch.poll() is None:
            os.killpg(orch.pid, signal.SIGKILL)
            orch.wait()


def wait_until(orch: subprocess.Popen, ready: Callable[[], bool], timeout: float = 240) -> None:
    end = time.time() + timeout
    while not ready():
        assert orch.poll() is None and time.time() < end, said(orch)
        time.sleep(0.1)


def stalled(run: Path, phase: int, point: str) -> Callable[[], bool]:
    """Whether a rank of ``phase`` has said it stalled at ``point``."""
    log = run / "phases" / f"phase-{phase:04d}" / "worker.log"
    return lambda: log.exists() and f"stalled at {point}" in log.read_text(errors="replace")


def ended(orch: subprocess.Popen, sig: int | None, timeout: float) -> tuple[str, float]:
    """Sends ``sig`` (None: nothing); the run's stderr once it has ended, and the seconds that took."""
    if sig is not None:
        orch.send_signal(sig)
    t0 = time.time()
    _, err = orch.communicate(timeout=timeout)
    return err, time.time() - t0


def left_running(run: Path) -> list[int]:
    """Every process a phase recorded that is still alive (a zombie is not: it has exited and holds
    no memory; its new parent reaps it when it gets to it)."""
    out = []
    for f in run.glob("phases/*/pids/*.json"):
        rec = json.loads(f.read_text())
        try:
            if alive(rec) and psutil.Process(rec["pid"]).status() != psutil.STATUS_ZOMBIE:
                out.append(rec["pid"])
        except psutil.NoSuchProcess:
            continue
    return out


def test_a_rank_stalled_at_its_first_step_is_found_shown_ended_and_a_rerun_resumes(tmp_path, tiny_model, tiny_data,
                                                                                 device, reference):
    sched, env = on(device, tmp_path / "s.toml", tiny_model, tiny_data, grace_seconds=GRACE, stall_seconds=STALL)
    run = tmp_path / "run"
    orch = start(sched, {**env, **faults_env(stall_at=FIRST_STEP_1)})
    try:
        out, err = orch.communicate(timeout=300)
    finally:
        orch.kill()
    assert orch.returncode == 1, err
    stacks = run / "phases" / "phase-0001" / "stacks"
    assert "phase 1 (steps 10-19, layers [1]) stalled: no progress for" in err and str(stacks) in err, err
    assert "in _stall" in err.split("rank 0 was in:")[1], err  # rank 0's innermost frames
    dump = (stacks / "rank-0.txt").read_text()
    assert "in _stall" in dump and "in train" in dump, dump  # all threads, the whole stack
    assert not left_running(run)
    events = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]
    stalled = [e for e in events if e["event"] == "phase_stalled"]
    assert len(stalled) == 1 and stalled[0]["phase"] == 1 and stalled[0]["seconds"] >= 4 * STALL, stalled
    status = cli("orchestrator", "status", str(run), env={**os.environ, "COLUMNS": "1000"})
    assert f"{run}: stalled (phase 1: no progress for" in status.stdout, status.stdout
    rerun_equal(sched, env, run, tiny_model, reference)


def journaled(run: Path, event: str, phase: int) -> Callable[[], bool]:
    return lambda: any(e["event"] == event and e.get("phase") == phase for e in read_journal(run))


def test_a_stop_ends_a_run_whose_orchestrator_is_stuck_in_a_journal_fsync(tmp_path, tiny_model, tiny_data, tiny_run):
    """The orchestrator's main thread never comes back from the fsync of phase 1's start, with the
    stop signals blocked there, as in an fsync on a full disk: its Python handler never runs, so only
    the backstop (``orchestrator/backstop.py``) can end the run: exit 75 within grace + 5 s (+ slack),
    nothing left running, and a rerun resumes bitwise."""
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, launch={"grace_seconds": GRACE}))
    run = tmp_path / "run"
    with running(sched, faults_env(block_at={"point": "journal.fsync", "event": "phase_started", "phase": 1})) as orch:
        wait_until(orch, journaled(run, "phase_started", 1))
        time.sleep(1)  # in the fsync's place for good
        assert orch.poll() is None
        err, took = ended(orch, signal.SIGTERM, timeout=GRACE + 60)
    assert orch.returncode == 75, err
    assert "blocked at journal.fsync" in err and "did not end within 7 s of the stop signal" in err, err
    assert took <= GRACE + 10, took
    assert not left_running(run)
    rerun = cli("orchestrator", "run", str(sched))
    assert rerun.returncode == 0, rerun.stderr
    assert bitwise_equal(composed(tiny_model, run), composed(tiny_model, tiny_run))


def test_a_predecessor_stalled_in_its_handed_over_write_is_found_and_its_successor_stopped(tmp_path, tiny_model,
                                                                                          tiny_data, device, reference):
    """Issue #24's 7B case: phase 0 hands its state over and, while its successor trains, hangs in
    writing its end checkpoint."""
    sched, env = on(device, tmp_path / "s.toml", tiny_model, tiny_data, grace_seconds=GRACE, stall_seconds=STALL,
                    **HANDING_OVER)
    run = tmp_path / "run"
    r = cli("orchestrator", "run", str(sched), timeout=300,
            env={**os.environ, **env, **faults_env(stall_at={"point": "checkpoint.file_written"})})
    assert r.returncode == 1, r.stderr
    stacks = run / "phases" / "phase-0000" / "stacks"
    assert "phase 0 (steps 0-9, layers [0]) stalled: no progress for" in r.stderr and str(stacks) in r.stderr, r.stderr
    assert "in _stall" in (stacks / "rank-0.txt").read_text()
    assert not left_running(run)
    events = [json.loads(x)["event"] for x in (run / "journal.jsonl").read_text().splitlines()]
    assert "phase_stalled" in events and "successor_stopped" in events, events
    rerun_equal(sched, env, run, tiny_model, reference)


@pytest.mark.parametrize("ended_by", ["watchdog", "SIGTERM"])
def test_a_successor_stalled_while_it_takes_over_is_ended(tmp_path, tiny_model, tiny_data, device, reference,
                                                          ended_by):
    """Phase 1 stalls after mapping its predecessor's offer, before it answers (``handover.copying``):
    the watchdog ends the run with exit 1 and a rerun resumes bitwise; or a SIGTERM during the stall
    ends it within grace + 10 s with exit 75. Nothing is left running either way."""
    sched, env = on(device, tmp_path / "s.toml", tiny_model, tiny_data, grace_seconds=GRACE, stall_seconds=STALL,
                    **HANDING_OVER)
    run = tmp_path / "run"
    with running(sched, {**env, **faults_env(stall_at={"point": "handover.copying", "rank": 0})}) as orch:
        wait_until(orch, stalled(run, 1, "handover.copying"))
        err, took = ended(orch, signal.SIGTERM if ended_by == "SIGTERM" else None, timeout=300)
    assert not left_running(run)
    if ended_by == "SIGTERM":
        assert orch.returncode == 75 and took <= GRACE + 10, (took, err)
        return
    assert orch.returncode == 1, err
    assert "phase 1 (steps 10-19, layers [1]) stalled: no progress for" in err, err
    assert "in _stall" in (run / "phases" / "phase-0001" / "stacks" / "rank-0.txt").read_text()
    rerun_equal(sched, env, run, tiny_model, reference)


@pytest.mark.parametrize("stall,phase,launch", [
    (FIRST_STEP_1, 1, {}),
    ({"point": "checkpoint.file_written"}, 0, HANDING_OVER),
], ids=["first-step", "predecessor-write"])
def test_a_sigterm_during_a_stall_ends_the_run_within_grace(tmp_path, tiny_model, tiny_data, device, stall, phase,
                                                            launch):
    """The other two stalls of the issue, a rank at its first step and a handed-over predecessor in
    its write: a SIGTERM while the phase hangs (the watchdog far off) ends the run with exit 75 within
    grace + 10 s, nothing left running."""
    sched, env = on(device, tmp_path / "s.toml", tiny_model, tiny_data, grace_seconds=GRACE, stall_seconds=600,
                    **launch)
    run = tmp_path / "run"
    with running(sched, {**env, **faults_env(stall_at=stall)}) as orch:
        wait_until(orch, stalled(run, phase, stall["point"]))
        err, took = ended(orch, signal.SIGTERM, timeout=120)
    assert orch.returncode == 75, err
    assert took <= GRACE + 10, (took, err)
    assert not left_running(run)
