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

from tests.conftest import cli, schedule_dict, write_schedule
from tests.reference import bitwise_equal, composed

pytestmark = pytest.mark.multiprocess
SIX = [{"steps": 4, "layers": [i % 4]} for i in range(6)]


def events(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines()]


def run_six(tmp: Path, model: Path, data: Path, prewarm: bool, env: dict | None = None) -> subprocess.CompletedProcess:
    sched = write_schedule(tmp / "s.toml", schedule_dict(model, data, schedule={"phases": SIX},
                                                          launch={"prewarm": prewarm}))
    return cli("orchestrator", "run", str(sched), env={**os.environ, **(env or {})})


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


def test_successor_trains_only_after_its_predecessor_is_gone(warm):
    done = [e["records"] for e in events(warm) if e["event"] == "phase_done"]
    for before, after in zip(done, done[1:]):
        # Started long before (prepared in parallel), told to go only once every process of the
        # predecessor was confirmed gone, trained only after that.
        assert after["t_process_start"] < before["t_last_step_end"]
        assert after["t_go"] >= before["t_gone"]
        assert after["t_first_step_end"] > before["t_gone"]
    assert not list(warm.glob("phases/*/go"))


def test_go_channel_is_a_private_fifo(tmp_path, tiny_model, tiny_data):
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, schedule={"phases": SIX}))
    orch = subprocess.Popen([str(Path(sys.executable).parent / "orchestrator"), "run", str(sched)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
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
    pids = [json.loads(f.read_text()) for f in (tmp_path / "run" / "phases").glob("*/pids/*.json")]
    gone, alive = psutil.wait_procs([psutil.Process(p["pid"]) for p in pids if psutil.pid_exists(p["pid"])], timeout=10)
    assert not alive


def test_failed_phase_takes_its_successor_down(tmp_path, tiny_model, tiny_data):
    r = run_six(tmp_path, tiny_model, tiny_data, prewarm=True, env={"RELAYER_TEST_KILL_AFTER": "head.safetensors"})
    assert r.returncode == 1 and "phase 0" in r.stderr
    run = tmp_path / "run"
    ev = events(run)
    assert any(e["event"] == "successor_stopped" and e["phase"] == 1 for e in ev)
    for f in (run / "phases").glob("*/pids/*.json"):
        rec = json.loads(f.read_text())
        assert not psutil.pid_exists(rec["pid"]) or psutil.Process(rec["pid"]).create_time() != rec["create_time"]
    assert not list(run.glob("phases/*/go"))
    # The killed writer's checkpoint folder and the successors' prepared files went with them.
    assert not list((run / "checkpoints").glob(".tmp-*"))
