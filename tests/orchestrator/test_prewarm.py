"""Pre-warmed successors: same results as cold starts, never overlapping the predecessor's training,
taken down with a failed predecessor, their go channel private and gone afterwards."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from orchestrator.procs import recorded
from tests.conftest import cli, faults_env, schedule_dict, write_schedule
from tests.reference import bitwise_equal, composed

pytestmark = pytest.mark.multiprocess
SIX = [{"steps": 4, "layers": [i % 4]} for i in range(6)]


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]


def six(tmp: Path, model: Path, data: Path, **launch) -> Path:
    return write_schedule(tmp / "s.toml", schedule_dict(model, data, schedule={"phases": SIX},
                                                        launch={"grace_seconds": 10, "prewarm_depth": 2, **launch}))


def run_six(tmp: Path, model: Path, data: Path, prewarm: bool, env: dict | None = None,
            **launch) -> subprocess.CompletedProcess:
    return cli("orchestrator", "run", str(six(tmp, model, data, prewarm=prewarm, **launch)),
               env={**os.environ, **(env or {})})


def finished_six(tmp: Path, model: Path, data: Path, prewarm: bool) -> Path:
    r = run_six(tmp, model, data, prewarm)
    assert r.returncode == 0, r.stderr
    return tmp / "run"


@pytest.fixture(scope="module")
def cold(tmp_path_factory, tiny_model, tiny_data) -> Path:
    return finished_six(tmp_path_factory.mktemp("cold"), tiny_model, tiny_data, prewarm=False)


@pytest.fixture(scope="module")
def warm(tmp_path_factory, tiny_model, tiny_data) -> Path:
    return finished_six(tmp_path_factory.mktemp("warm"), tiny_model, tiny_data, prewarm=True)


def test_prewarm_changes_nothing_in_the_result(cold, warm, tiny_model):
    assert bitwise_equal(composed(tiny_model, cold), composed(tiny_model, warm))
    assert [e["prewarmed"] for e in events(cold) if e["event"] == "phase_started"] == [False] * 6
    assert [e["prewarmed"] for e in events(warm) if e["event"] == "phase_started"] == [False] + [True] * 5


def test_without_room_for_its_warm_up_a_phase_warms_up_on_the_smallest_toy(cold, tmp_path, tiny_model, tiny_data):
    """Every pre-warmed phase's warm-up on one layer finds no room (an out-of-memory error, as at 7B
    under a budget of 24 GiB): it warms up on its family's model of the least widths instead, and
    the result is the cold run's, bitwise."""
    r = run_six(tmp_path, tiny_model, tiny_data, prewarm=True,
                env=faults_env(oom_at={"point": "warm_up.toy", "small": False}))
    assert r.returncode == 0, r.stderr
    assert bitwise_equal(composed(tiny_model, cold), composed(tiny_model, tmp_path / "run"))
    records = [json.loads((tmp_path / "run" / "phases" / f"phase-{i:04d}" / "records.json").read_text())
               for i in range(1, 6)]
    assert all(r["warm_up_small"] is True and "no room at warm_up.toy" in r["warm_up_skipped"] for r in records)
    assert all(r["t_warmed_up"] < r["t_go"] for r in records)


def test_no_garbage_collection_in_a_switch(warm):
    """From a phase's preparation to its first step's end, nothing is collected (``launch.phase``)."""
    records = [json.loads((warm / "phases" / f"phase-{i:04d}" / "records.json").read_text()) for i in range(6)]
    assert [r["gc_collections_in_switch"] for r in records] == [0] * 6
    assert all(r["gc_collections_before_switch"] > 0 for r in records)  # there were some before: it counts


def test_successor_trains_only_after_its_predecessor_is_gone(warm):
    done = [e["records"] for e in events(warm) if e["event"] == "phase_done"]
    for before, after in zip(done, done[1:]):
        # Started long before (prepared in parallel), told to go only once every process of the
        # predecessor was confirmed gone, trained only after that.
        assert after["t_process_start"] < before["t_last_step_end"]
        assert after["t_go"] >= before["t_gone"]
        assert after["t_first_step_end"] > before["t_gone"]
    assert not list(warm.glob("phases/*/go"))


def start_six(tmp: Path, model: Path, data: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([str(Path(sys.executable).parent / "orchestrator"), "run", str(six(tmp, model, data))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, **(env or {})})


def all_gone(run: Path, timeout: float = 10) -> bool:
    """Every process the run's phases ever recorded is gone (or its pid reused) within ``timeout``."""
    live = [p for phase_dir in (run / "phases").glob("phase-*") for p in recorded(phase_dir)]
    _, alive = psutil.wait_procs(live, timeout=timeout)
    return not alive


def test_go_channel_is_a_private_fifo(tmp_path, tiny_model, tiny_data):
    orch = start_six(tmp_path, tiny_model, tiny_data)
    fifo = tmp_path / "run" / "phases" / "phase-0001" / "go"
    try:
        deadline = time.time() + 120
        while not fifo.exists():
            assert time.time() < deadline, "no go FIFO appeared"
            time.sleep(0.02)
        mode = fifo.stat().st_mode
        assert stat.S_ISFIFO(mode) and stat.S_IMODE(mode) == 0o600
        assert stat.S_IMODE(fifo.parent.stat().st_mode) == 0o700
    finally:
        orch.kill()
        orch.wait()
    # SIGKILLed orchestrator: its successors see EOF on the FIFO (or their watchdog fires) and go.
    assert all_gone(tmp_path / "run")


def test_failed_phase_takes_its_successor_down(tmp_path, tiny_model, tiny_data):
    r = run_six(tmp_path, tiny_model, tiny_data, prewarm=True, env=faults_env(kill_after="head.safetensors"))
    assert r.returncode == 1 and "phase 0" in r.stderr
    run = tmp_path / "run"
    ev = events(run)
    assert any(e["event"] == "successor_stopped" and e["phase"] == 1 for e in ev)
    # Phase 2 was paused for the switch (from phase 0's last step): taken down all the same.
    assert [e["phases"] for e in ev if e["event"] == "preparing_paused"] == [[2]]
    assert [(e["phases"], e["reason"]) for e in ev if e["event"] == "preparing_resumed"] == [([2], "aborted")]
    assert all_gone(run, timeout=0)
    assert not list(run.glob("phases/*/go"))
    # The killed writer's checkpoint folder and the successors' prepared files went with them.
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_switches_are_quiet(warm):
    """Phases further ahead than the next are paused from a phase's last step until the next phase
    has done its first step, and later phases start only then."""
    ev = events(warm)
    done = {e["phase"]: e["records"] for e in ev if e["event"] == "phase_done"}
    paused = [e for e in ev if e["event"] == "preparing_paused"]
    resumed = [e for e in ev if e["event"] == "preparing_resumed"]
    told = [(round(e["time"] - ev[0]["time"], 3), e["event"], e.get("phase", e.get("phases")), e.get("reason"))
            for e in ev]
    assert [e["phases"] for e in paused] == [[2], [3], [4], [5]], told  # the sixth has none beyond the next
    assert [(e["phases"], e["reason"]) for e in resumed] == [(p["phases"], "first_step") for p in paused]
    for k, (p, r) in enumerate(zip(paused, resumed)):
        assert done[k]["t_first_step_end"] < p["time"] < done[k]["t_gone"] < done[k + 1]["t_go"]
        assert r["time"] >= done[k + 1]["t_first_step_end"]
    for rec in done.values():  # the end of a phase, as benchmarks/breakdown.py splits it
        assert rec["t_last_step_end"] < rec["t_saved"] < rec["t_reaped"] <= rec["t_seen"] <= rec["t_gone"]
    for k in range(1, 6):  # a pre-warmed phase made its files in a thread during its warm-up
        assert done[k]["t_model_ready"] < done[k]["t_files_prepared"] <= done[k]["t_prepared"] < done[k]["t_go"]
    started = {e["phase"]: e["time"] for e in ev if e["event"] == "prewarm_started"}
    assert sorted(started) == [1, 2, 3, 4, 5]
    for j in range(3, 6):  # started once the switch into phase j - 2 was over
        assert started[j] > done[j - 2]["t_first_step_end"]


def test_paused_phases_are_stopped_and_die_with_the_orchestrator(tmp_path, tiny_model, tiny_data):
    # Each pre-warmed phase starts its first step 5 s late: a long switch, paused throughout.
    orch = start_six(tmp_path, tiny_model, tiny_data, env=faults_env(hold_first_step=5))
    run = tmp_path / "run"
    try:
        deadline = time.time() + 180
        while not (paused := [e for e in (events(run) if (run / "journal.jsonl").exists() else [])
                              if e["event"] == "preparing_paused"]):
            assert time.time() < deadline and orch.poll() is None, "nothing was paused"
            time.sleep(0.02)
        pids = paused[0]["pids"]
        assert pids and paused[0]["phases"] == [2]
        statuses = set()
        for _ in range(50):  # SIGSTOP takes effect asynchronously, within milliseconds
            statuses = {psutil.Process(p).status() for p in pids}
            if statuses == {psutil.STATUS_STOPPED}:
                break
            time.sleep(0.01)
        assert statuses == {psutil.STATUS_STOPPED}
    finally:
        orch.kill()
        orch.wait()
    # A stopped process notices nothing, so its parent's death signal (SIGKILL) ends it.
    assert all_gone(run)


def test_pause_has_a_time_limit(tmp_path, tiny_model, tiny_data, cold):
    r = run_six(tmp_path, tiny_model, tiny_data, prewarm=True, env=faults_env(hold_first_step=2),
                pause_preparing_seconds=0.5)
    assert r.returncode == 0, r.stderr
    resumed = [e for e in events(tmp_path / "run") if e["event"] == "preparing_resumed"]
    assert len(resumed) == 4 and {e["reason"] for e in resumed} == {"limit"}
    assert all(0.5 <= e["seconds"] < 2 for e in resumed)
    assert bitwise_equal(composed(tiny_model, cold), composed(tiny_model, tmp_path / "run"))
