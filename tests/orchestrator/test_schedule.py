"""The schedule as a library: load_schedule / validate_schedule / plan_phases, without the CLI.

Planning is checked as data: which layers each phase trains, for how many steps, on how many
processes. The CLI's messages are in test_cli_plan.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.errors import ScheduleError
from orchestrator.modelcheck import num_layers_of
from orchestrator.plan import check_batch, plan_phases
from orchestrator.validate import load_schedule, validate_schedule
from tests.conftest import ROOT, schedule_dict, write_schedule

LAYERS = 8


def strategy_raw(data: Path, strategy: str, seed: int = 0, **keys) -> dict:
    """A schedule with an inline 8-layer model config and a strategy instead of explicit phases."""
    raw = schedule_dict(Path("unused"), data, run={"seed": seed},
                        schedule={"strategy": strategy, "total_steps": 100, "interval": 20, "layers_per_phase": 2,
                                  **keys})
    raw["model"] = {"config": {"model_type": "llama", "num_hidden_layers": LAYERS}}
    del raw["schedule"]["phases"]
    return raw


def plan(raw: dict, tmp_path: Path, **kw) -> list:
    return plan_phases(validate_schedule(raw, tmp_path / "schedule.toml", **kw))


def layers(phases) -> list[tuple[int, ...]]:
    return [p.layers for p in phases]


def test_explicit_phases(tmp_path, tiny_model, tiny_data):
    phases = plan(schedule_dict(tiny_model, tiny_data), tmp_path)
    assert [(p.index, p.start_step, p.end_step, p.steps, p.layers, p.nproc) for p in phases] == [
        (0, 0, 10, 10, (0,), 1), (1, 10, 20, 10, (1,), 1), (2, 20, 30, 10, (0,), 1)]


def test_ascending_and_descending_walk_the_layers(tmp_path, tiny_data):
    assert layers(plan(strategy_raw(tiny_data, "ascending"), tmp_path)) == [(0, 1), (2, 3), (4, 5), (6, 7), (0, 1)]
    assert layers(plan(strategy_raw(tiny_data, "descending"), tmp_path)) == [(6, 7), (4, 5), (2, 3), (0, 1), (6, 7)]


def test_ascending_wraps_when_layers_per_phase_does_not_divide_the_layers(tmp_path, tiny_data):
    raw = strategy_raw(tiny_data, "ascending", layers_per_phase=3)
    assert layers(plan(raw, tmp_path)) == [(0, 1, 2), (3, 4, 5), (0, 6, 7), (1, 2, 3), (4, 5, 6)]


def test_ascending_ignores_the_seed(tmp_path, tiny_data):
    assert layers(plan(strategy_raw(tiny_data, "ascending", seed=0), tmp_path)) == \
        layers(plan(strategy_raw(tiny_data, "ascending", seed=7), tmp_path))


def test_lisa_samples_distinct_layers_in_range(tmp_path, tiny_data):
    phases = plan(strategy_raw(tiny_data, "lisa", total_steps=400, layers_per_phase=3), tmp_path)
    assert len(phases) == 20
    for p in phases:
        assert len(p.layers) == 3 and len(set(p.layers)) == 3
        assert list(p.layers) == sorted(p.layers) and all(0 <= i < LAYERS for i in p.layers)
    assert len(set(layers(phases))) > 1
    assert set().union(*layers(phases)) == set(range(LAYERS))


def test_lisa_same_seed_same_layers(tmp_path, tiny_data):
    assert layers(plan(strategy_raw(tiny_data, "lisa", seed=3), tmp_path)) == \
        layers(plan(strategy_raw(tiny_data, "lisa", seed=3), tmp_path))


def test_lisa_different_seed_different_layers(tmp_path, tiny_data):
    plans = {tuple(layers(plan(strategy_raw(tiny_data, "lisa", seed=s), tmp_path))) for s in range(5)}
    assert len(plans) == 5


def test_lisa_plan_is_fixed_across_processes_and_releases(tmp_path, tiny_data):
    # Resuming recomputes the plan in a new process, maybe after an upgrade; it must not move.
    expected = [(1, 6), (5, 7), (1, 6), (2, 4), (1, 4)]
    assert layers(plan(strategy_raw(tiny_data, "lisa", seed=0, total_steps=50, interval=10), tmp_path)) == expected
    path = write_schedule(tmp_path / "schedule.toml",
                          strategy_raw(tiny_data, "lisa", seed=0, total_steps=50, interval=10))
    code = ("import sys, json; from orchestrator.plan import plan_phases; from orchestrator.validate import load_schedule; "
            "print(json.dumps([p.layers for p in plan_phases(load_schedule(sys.argv[1]))]))")
    for hash_seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT,
                           timeout=60, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert r.returncode == 0, r.stderr
        assert [tuple(x) for x in json.loads(r.stdout)] == expected


def test_short_last_phase(tmp_path, tiny_data):
    phases = plan(strategy_raw(tiny_data, "lisa", total_steps=50, interval=20), tmp_path)
    assert [(p.start_step, p.end_step) for p in phases] == [(0, 20), (20, 40), (40, 50)]
    assert phases[-1].steps == 10


def test_interval_longer_than_the_run(tmp_path, tiny_data):
    phases = plan(strategy_raw(tiny_data, "ascending", total_steps=5, interval=20), tmp_path)
    assert [(p.start_step, p.end_step, p.layers) for p in phases] == [(0, 5, (0, 1))]


def test_layers_per_phase_more_than_the_layers(tmp_path, tiny_data):
    with pytest.raises(ScheduleError) as e:
        plan(strategy_raw(tiny_data, "lisa", layers_per_phase=LAYERS + 1), tmp_path)
    assert e.value.exit_code == 2
    assert str(e.value) == (f"{tmp_path / 'schedule.toml'}: schedule.layers_per_phase: expected at most the model's "
                            f"8 layers, got 9")


def test_layers_per_phase_equal_to_the_layers(tmp_path, tiny_data):
    assert set(layers(plan(strategy_raw(tiny_data, "lisa", layers_per_phase=LAYERS), tmp_path))) == \
        {tuple(range(LAYERS))}


def nproc_raw(model: Path, data: Path) -> dict:
    raw = schedule_dict(model, data, launch={"nproc": 2})
    raw["data"]["batch_size"] = 32
    raw["schedule"]["phases"][1]["nproc"] = 4
    return raw


def test_phase_nproc_over_launch_nproc(tmp_path, tiny_model, tiny_data):
    assert [p.nproc for p in plan(nproc_raw(tiny_model, tiny_data), tmp_path)] == [2, 4, 2]


def test_nproc_override_beats_phase_and_launch_nproc(tmp_path, tiny_model, tiny_data):
    assert [p.nproc for p in plan(nproc_raw(tiny_model, tiny_data), tmp_path, nproc=8)] == [8, 8, 8]


def test_strategy_phases_take_launch_nproc_or_the_override(tmp_path, tiny_data):
    raw = strategy_raw(tiny_data, "ascending")
    raw["launch"]["nproc"] = 2
    assert {p.nproc for p in plan(raw, tmp_path)} == {2}
    assert {p.nproc for p in plan(raw, tmp_path, nproc=1)} == {1}


def test_the_override_is_checked_against_the_batch(tmp_path, tiny_model, tiny_data):
    with pytest.raises(ScheduleError, match=r"data\.batch_size: .* = 4 x 3 = 12, got 32 \(phase 0\)"):
        plan(nproc_raw(tiny_model, tiny_data), tmp_path, nproc=3)


def test_check_batch_counts_every_node(tmp_path, tiny_model, tiny_data):
    data = validate_schedule(schedule_dict(tiny_model, tiny_data), tmp_path / "s.toml").schedule.data
    check_batch(data, 2, tmp_path / "s.toml", 0)
    with pytest.raises(ScheduleError, match=r"= 4 x 4 \(2 per node x 2 nodes\) = 16, got 8 \(phase 3\)$"):
        check_batch(data, 2, tmp_path / "s.toml", 3, nnodes=2)


def test_paths_are_relative_to_the_schedule_file(tmp_path, tiny_model, tiny_data):
    (tmp_path / "exp").mkdir()
    (tmp_path / "model").symlink_to(tiny_model)
    (tmp_path / "train.jsonl").symlink_to(tiny_data)
    raw = schedule_dict(Path("../model"), Path("../train.jsonl"), run={"output_dir": "runs/a"})
    path = write_schedule(tmp_path / "exp" / "schedule.toml", raw)
    loaded = load_schedule(path)
    assert loaded.model_path == tiny_model.resolve()
    assert loaded.data_path == tiny_data.resolve()
    assert loaded.output_dir == (tmp_path / "exp" / "runs" / "a").resolve()
    assert loaded.num_layers == 4
    assert load_schedule(path, output_dir=tmp_path / "elsewhere").output_dir == (tmp_path / "elsewhere").resolve()


def test_toml_integers_are_accepted_as_floats(tmp_path, tiny_model, tiny_data):
    raw = schedule_dict(tiny_model, tiny_data, optimizer={"lr": 1, "grad_clip": 0, "betas": [0, 0]},
                        launch={"grace_seconds": 5})
    s = validate_schedule(raw, tmp_path / "s.toml").schedule
    assert (s.optimizer.lr, s.optimizer.grad_clip, s.optimizer.betas, s.launch.grace_seconds) == \
        (1.0, 0.0, (0.0, 0.0), 5.0)
    assert isinstance(s.optimizer.lr, float)


def test_no_coercion_between_types(tmp_path, tiny_model, tiny_data):
    raw = schedule_dict(tiny_model, tiny_data)
    raw["data"]["batch_size"] = 8.0
    with pytest.raises(ScheduleError, match=r"data\.batch_size: expected an integer, got 8\.0$"):
        validate_schedule(raw, tmp_path / "s.toml")
    with pytest.raises(ScheduleError, match=r"run\.seed: expected an integer, got true$"):
        validate_schedule(schedule_dict(tiny_model, tiny_data, run={"seed": True}), tmp_path / "s.toml")


def test_every_fault_is_reported(tmp_path, tiny_model, tiny_data):
    raw = schedule_dict(tiny_model, tiny_data, deepspeed={"zero_stage": 5})
    raw["data"]["seq_len"] = "64"
    with pytest.raises(ScheduleError) as e:
        validate_schedule(raw, tmp_path / "s.toml")
    assert str(e.value).splitlines() == [
        f"{tmp_path / 's.toml'}: data.seq_len: expected an integer, got '64'",
        f"{tmp_path / 's.toml'}: deepspeed.zero_stage: expected 0, 1, 2 or 3, got 5",
    ]


def test_the_model_config_of_a_directory_must_be_an_object(tmp_path, tiny_data):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("[1, 2]")
    with pytest.raises(ScheduleError, match=r"model\.path: .*config\.json is not valid: expected a JSON object$"):
        validate_schedule(schedule_dict(Path("model"), tiny_data), tmp_path / "s.toml")


def test_the_deepspeed_config_may_add_what_relayer_does_not_derive(tmp_path, tiny_model, tiny_data):
    extra = {"zero_optimization": {"overlap_comm": False}, "fp16": {"initial_scale_power": 8}}
    loaded = validate_schedule(schedule_dict(tiny_model, tiny_data, deepspeed={"config": extra}), tmp_path / "s.toml")
    assert loaded.schedule.deepspeed.config == extra


@pytest.mark.parametrize("config,n", [
    ({"num_hidden_layers": 12}, 12),
    ({"n_layer": 6}, 6),
    ({"text_config": {"num_hidden_layers": 3}}, 3),
    ({"num_hidden_layers": 0}, None),
    ({"num_hidden_layers": True}, None),
    ({}, None),
])
def test_num_layers_of(config, n):
    assert num_layers_of(config) == n


@pytest.mark.parametrize("sections, stage", [
    ({}, 0),  # one process: relayer's AdamW, no ZeRO (the fastest step on one GPU)
    ({"launch": {"nproc": 2}}, 2),
    ({"model": {"dtype": "float16"}}, 2),  # DeepSpeed's loss scaler
    ({"deepspeed": {"config": {"zero_optimization": {"reduce_bucket_size": 1000}}}}, 2),
])
def test_an_unset_zero_stage_is_0_on_one_process(tmp_path, tiny_model, tiny_data, sections, stage):
    raw = schedule_dict(tiny_model, tiny_data, **sections)
    del raw["deepspeed"]["zero_stage"]
    assert validate_schedule(raw, tmp_path / "s.toml").schedule.deepspeed.zero_stage == stage
    assert validate_schedule(raw, tmp_path / "s.toml", nproc=2).schedule.deepspeed.zero_stage == 2
    given = schedule_dict(tiny_model, tiny_data, **sections)
    given["deepspeed"]["zero_stage"] = 1
    assert validate_schedule(given, tmp_path / "s.toml").schedule.deepspeed.zero_stage == 1
