"""The DeepSpeed config the plan holds a schedule to is the one each phase's engine is built with:
one derivation (``launch.contract.dsconfig``) for both sides, for every optimizer mode and process
count."""

from __future__ import annotations

import pytest

from launch.contract.dsconfig import by_dotted_key
from launch.engine import backend_for
from orchestrator import dsconfig, phasespec
from orchestrator.groups import Work
from orchestrator.plan import plan_phases
from orchestrator.validate import load_schedule
from tests.conftest import schedule_dict, write_schedule

TAKEN_OVER = {"gradient_clipping": 0.0, "bf16.enabled": False, "fp16.enabled": False}
"""At ``deepspeed.zero_stage = 0`` relayer's own optimizer keeps the fp32 masters and clips:
DeepSpeed does neither."""


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_planned_config_is_the_one_each_phase_builds(tmp_path, tiny_model, tiny_data, stage, nproc):
    table = {"gradient_accumulation_steps": "auto", "train_batch_size": 8, "steps_per_print": 2000}
    loaded = load_schedule(write_schedule(tmp_path / "s.toml", schedule_dict(
        tiny_model, tiny_data, model={"dtype": "bfloat16"}, deepspeed={"zero_stage": stage, "config": table},
        launch={"nproc": nproc})))
    phases = plan_phases(loaded)
    planned = dsconfig.planned(loaded.schedule, phases)
    assert (planned["gradient_accumulation_steps"], planned["zero_optimization.stage"]) == ({1: 2, 2: 1}[nproc], stage)
    expected = {**planned, "steps_per_print": 2000, **(TAKEN_OVER if stage == 0 else {})}
    for ph in phases:
        spec = phasespec.phase_spec(loaded, phases, Work(ph, ph.start_step, None), tmp_path / "pd", None)
        built = by_dotted_key(backend_for(spec).config(spec, spec.nproc * spec.nnodes, 10**6))
        assert {k: built.get(k) for k in expected} == expected
