"""A phase that fails shows its cause where the user looks: the orchestrator's message (exit 1)
names the process that failed, its reason and its log's last lines; the journal has phase_failed
with the reason; ``status`` says failed, with the reason. Real runs on the tiny model.

The model is damaged after ``plan``'s checks passed: once the run has made its journal, before it
has told its first process (the fork server with prewarm on, started early to import meanwhile;
the phase's worker with it off) which model to read.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import cli, schedule_dict, write_schedule

pytestmark = pytest.mark.multiprocess


def events(run: Path) -> list[dict]:
    path = run / "journal.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def truncate(model: Path) -> str:
    st = model / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    return "SafetensorError"


def unknown_type(model: Path) -> str:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "nosuchmodel"}))
    return "nosuchmodel"


@pytest.mark.parametrize("prewarm, damage", [(True, truncate), (False, unknown_type), (True, unknown_type)],
                         ids=["prewarm-truncated", "cold-unknown-type", "prewarm-unknown-type"])
def test_model_damaged_after_plan_fails_with_its_cause(tmp_path, tiny_model, tiny_data, prewarm, damage):
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    phases = [{"steps": 2, "layers": [0]}, {"steps": 2, "layers": [1]}]
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(model, tiny_data, schedule={"phases": phases},
                                                              launch={"prewarm": prewarm}))
    plan = cli("orchestrator", "plan", str(sched))
    assert plan.returncode == 0, plan.stderr
    orch = subprocess.Popen([str(Path(sys.executable).parent / "orchestrator"), "run", str(sched)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = tmp_path / "run"
    try:
        deadline = time.time() + 60
        while not (run / "journal.jsonl").exists():
            assert time.time() < deadline and orch.poll() is None, "the run did not start"
            time.sleep(0.005)
        cause = damage(model)
        _, err = orch.communicate(timeout=300)
    finally:
        if orch.poll() is None:
            os.killpg(orch.pid, signal.SIGKILL)
            orch.wait()
    log = run / "zygote.log" if prewarm else run / "phases" / "phase-0000" / "worker.log"
    who = "the fork server (launch.zygote, pid " if prewarm else "its processes ended with exit code 1"
    assert orch.returncode == 1, err
    err = err[err.index("orchestrator: "):]  # after the progress lines
    # Steps as plan numbers them (0-1 for two steps), the process, the reason, the log's tail.
    assert err.startswith(f"orchestrator: phase 0 (steps 0-1, layers [0]) failed: {who}"), err
    assert "0-1" in plan.stdout
    reason = err.split("\n")[1]
    assert cause in reason, err
    assert f"last lines of {log}:\n" in err and cause in err.split(f"last lines of {log}:\n")[1]
    failed = [e for e in events(run) if e["event"] == "phase_failed"]
    assert len(failed) == 1 and failed[0]["phase"] == 0 and cause in failed[0]["reason"]
    status = cli("orchestrator", "status", str(run), env={**os.environ, "COLUMNS": "1000"})
    assert status.returncode == 0, status.stderr
    assert f"{run}: failed (phase 0: " in status.stdout and cause in status.stdout.splitlines()[0]
