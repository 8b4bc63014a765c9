"""What a resume may change of a run under way (``orchestrator.changes``): a key that changes nothing
already trained goes through without ``--force``; one that would alter completed work is refused."""

from __future__ import annotations

import pytest

from orchestrator.changes import check_same_schedule
from orchestrator.errors import ScheduleError
from orchestrator.plan import plan_phases
from orchestrator.rundir import SCHEDULE_COPY, read_copy
from orchestrator.runner import Runner
from orchestrator.validate import load_schedule
from tests.conftest import schedule_dict, write_schedule


@pytest.fixture
def started(tmp_path, tiny_model, tiny_data):
    """A run directory made by the schedule (validation data, evaluation every 10 steps)."""
    sched = write_schedule(tmp_path / "s.toml", schedule_dict(tiny_model, tiny_data, data={
        "path": str(tiny_data), "validation_path": str(tiny_data), "eval_every": 10}))
    Runner(load_schedule(sched))._prepare_run_dir()
    return sched


def resume(sched, *overrides: str, force: bool = False) -> None:
    loaded = load_schedule(sched, overrides=overrides)
    check_same_schedule(loaded, plan_phases(loaded), read_copy(loaded.output_dir / SCHEDULE_COPY), force)


@pytest.mark.parametrize("item", [
    "data.eval_every=3", "data.eval_every=0", "data.validation_path='other.jsonl'", "run.report_to=['tensorboard']",
    "run.tensorboard=true", "checkpoint.keep_last=7", "checkpoint.every_steps=4", "run.group_readable=true",
])
def test_evaluation_logging_reporting_and_retention_change_nothing_trained(started, item, tiny_data):
    if "other.jsonl" in item:
        (started.parent / "other.jsonl").write_bytes(tiny_data.read_bytes())
    resume(started, item)


@pytest.mark.parametrize("item, named", [
    ("data.seq_len=8", "data.seq_len: 16 -> 8"), ("optimizer.weight_decay=0.1", "optimizer.weight_decay: 0.0 -> 0.1"),
    ("model.dtype=bfloat16", "model.dtype: 'float32' -> 'bfloat16'"), ("run.seed=3", "run.seed: 0 -> 3"),
])
def test_a_change_to_what_was_trained_is_refused_without_force(started, item, named):
    with pytest.raises(ScheduleError) as e:
        resume(started, item)
    assert named in str(e.value) and "--force" in str(e.value)
    resume(started, item, force=True)
