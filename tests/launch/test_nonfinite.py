"""A non-finite loss or gradient norm stops the phase at that step: exit 1 naming the phase and the
step, as one line (no traceback), and nothing of that step or after it is saved. A huge learning
rate makes the second step's loss NaN (the first step's update puts the weights at about 1e30)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli, schedule_dict, write_schedule

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("nproc, stage", [(1, 2), (2, 3)])
def test_non_finite_loss_stops_the_phase_at_its_step(tmp_path, tiny_model, tiny_data, nproc, stage):
    phases = [{"steps": 3, "layers": [0]}, {"steps": 3, "layers": [1]}]
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(
        tiny_model, tiny_data, optimizer={"lr": 1e30}, deepspeed={"zero_stage": stage},
        checkpoint={"every_steps": 1}, schedule={"phases": phases}, launch={"nproc": nproc}))
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 1, r.stderr
    err = r.stderr[r.stderr.index("orchestrator: "):]
    assert err.startswith("orchestrator: phase 0 (steps 0-2, layers [0]) failed: its processes ended with exit code 1")
    # Step 0 trained (finite), step 1 (numbered as plan does) is the first non-finite one.
    assert "\n  NonFinite: phase 0, step 1: the loss is nan" in err
    assert "Traceback" not in err
    run = tmp_path / "run"
    assert [c.name for c in (run / "checkpoints").iterdir()] == ["step-00000001"]
    verify = cli("shard-tools", "verify", str(run / "checkpoints" / "step-00000001"))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    failed = [json.loads(x) for x in (run / "journal.jsonl").read_text().splitlines() if '"phase_failed"' in x]
    assert len(failed) == 1 and "phase 0, step 1" in failed[0]["reason"]
