"""Validation loss during a run (metrics.jsonl and TensorBoard), and gradient checkpointing (which
must not change the result)."""

import json

import pytest

from tests.conftest import cli, make_tokens, schedule_dict, write_schedule
from tests.reference import composed, max_abs_diff, reference_run

pytestmark = pytest.mark.multiprocess


def test_eval_loss_every_n_steps_and_checkpointing_changes_nothing(tmp_path, tiny_model, tiny_data):
    val = make_tokens(tmp_path / "val.jsonl", n=12, seed=7)
    s = schedule_dict(tiny_model, tiny_data, data={"validation_path": str(val), "eval_every": 5},
                      run={"output_dir": "run", "tensorboard": True})
    s["model"]["gradient_checkpointing"] = True
    r = cli("orchestrator", "run", str(write_schedule(tmp_path / "s.toml", s)))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {m["step"]: m["eval_loss"] for m in lines if "eval_loss" in m}
    assert sorted(evals) == [5, 10, 15, 20, 25, 30]
    assert evals[30] < evals[5]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [e.step for e in tb.Scalars("eval_loss")] == [5, 10, 15, 20, 25, 30]
    assert len(tb.Scalars("loss")) == 30
    reference = reference_run(tiny_model, tiny_data, [(10, [0]), (10, [1]), (10, [0])])
    assert max_abs_diff(reference, composed(tiny_model, tmp_path / "run")) <= 1e-5


def test_eval_every_needs_a_validation_file(tmp_path, tiny_model, tiny_data):
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, data={"eval_every": 5}))
    r = cli("orchestrator", "plan", str(sched))
    assert r.returncode == 2
    assert "data.eval_every: needs data.validation_path or data.validation_split, which are missing" in r.stderr
