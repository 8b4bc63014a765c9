"""A validation split and epochs give the documented counts, and keep them across a stop resumed on
another process count: the same held-out records, the same steps, the same evaluations as a run
that was never stopped (within the 1e-5 of another process count's summation order)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import cli, make_tokens, said, schedule_dict, write_schedule
from tests.reference import composed, max_abs_diff

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
ORCH = str(Path(sys.executable).parent / "orchestrator")
RECORDS, SPLIT, EPOCHS, BATCH = 64, 0.25, 2, 8


def schedule(tmp: Path, model: Path, name: str) -> Path:
    data = make_tokens(tmp / "train.jsonl", n=RECORDS)
    raw = schedule_dict(model, data, run={"output_dir": name},
                        data={"validation_split": SPLIT, "eval_every": 4, "batch_size": BATCH, "micro_batch_size": 2},
                        checkpoint={"every_steps": 2, "keep_last": 10})
    raw["schedule"] = {"strategy": "lisa", "epochs": EPOCHS, "interval": 4, "layers_per_phase": 1}
    return write_schedule(tmp / f"{name}.toml", raw)


def metrics(run: Path) -> tuple[dict[int, float], dict[int, float]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return ({m["step"]: m["loss"] for m in lines if "loss" in m},
            {m["step"]: m["eval_loss"] for m in lines if "eval_loss" in m})


def stop_after(schedule_path: Path, run: Path, lines: int) -> None:
    orch = subprocess.Popen([ORCH, "run", str(schedule_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        while not ((run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= lines):
            assert orch.poll() is None, said(orch)
            time.sleep(0.1)
        orch.send_signal(signal.SIGTERM)
        assert orch.wait(timeout=120) == 75, orch.communicate()[1]
    finally:
        if orch.poll() is None:
            os.killpg(orch.pid, signal.SIGKILL)


def test_a_split_and_epochs_resume_on_another_process_count(tmp_path, tiny_model):
    held = math.ceil(SPLIT * RECORDS)  # 16 held out, 48 to train on
    steps = math.ceil(EPOCHS * (RECORDS - held) / BATCH)  # 12
    whole = schedule(tmp_path, tiny_model, "whole")
    r = cli("orchestrator", "data", str(whole), "--json")
    assert r.returncode == 0, r.stderr
    counted = json.loads(r.stdout)
    assert (counted["sources"][0]["held_out"], counted["train"]["rows"], counted["validation"]["rows"]) == (
        held, RECORDS - held, held)
    r = cli("orchestrator", "run", str(whole))
    assert r.returncode == 0, r.stderr
    want_loss, want_eval = metrics(tmp_path / "whole")
    assert sorted(want_loss) == list(range(1, steps + 1)) and sorted(want_eval) == [4, 8, 12]

    stopped = schedule(tmp_path, tiny_model, "stopped")
    stop_after(stopped, tmp_path / "stopped", 5)
    r = cli("orchestrator", "run", str(stopped), "--nproc", "2")
    assert r.returncode == 0, r.stderr
    r = cli("orchestrator", "data", str(stopped), "--json")
    assert json.loads(r.stdout) == counted  # the run's own entry: one, whatever the process count
    assert len(list((tmp_path / "stopped" / "data-cache").iterdir())) == 1
    loss, evals = metrics(tmp_path / "stopped")
    assert sorted(loss) == sorted(want_loss) and sorted(evals) == sorted(want_eval)
    assert max(abs(evals[s] - want_eval[s]) for s in evals) < 1e-5
    assert max(abs(loss[s] - want_loss[s]) for s in loss) < 1e-5
    assert max_abs_diff(composed(tiny_model, tmp_path / "stopped"), composed(tiny_model, tmp_path / "whole")) < 1e-5
