"""``deepspeed.config`` naming a DeepSpeed JSON file, as LMFlow, axolotl and LLaMA-Factory users hold
theirs: merged as the table is, with the same clash checks; "auto" leaves a key to relayer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import phasespec
from orchestrator.cli import main
from orchestrator.groups import Work
from orchestrator.plan import plan_phases
from orchestrator.validate import load_schedule
from tests.conftest import schedule_dict, write_schedule

# LMFlow's configs/ds_config_zero2.json, as it ships.
LMFLOW_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                          "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": "auto",
                          "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def sched_with(tmp_path: Path, model: Path, data_path: Path, config, **sections) -> Path:
    return write_schedule(tmp_path / "s.toml", schedule_dict(model, data_path, deepspeed={"config": config}, **sections))


def test_a_json_file_relative_to_the_schedule_is_merged_with_auto_left_to_relayer(tmp_path, tiny_model, tiny_data):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "zero2.json").write_text(json.dumps(LMFLOW_ZERO2))
    loaded = load_schedule(sched_with(tmp_path, tiny_model, tiny_data, "ds/zero2.json"))
    assert loaded.deepspeed_config == {
        "fp16": {"loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2,
                 "min_loss_scale": 1},
        "bf16": {},
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": True, "contiguous_gradients": True},
        "steps_per_print": 2000, "wall_clock_breakdown": False}
    phases = plan_phases(loaded)
    spec = phasespec.phase_spec(loaded, phases, Work(phases[0], 0, None), tmp_path / "pd", None)
    assert spec.deepspeed_config == loaded.deepspeed_config  # what the worker merges into its own


def test_a_trainer_style_files_auto_optimizer_and_scheduler_are_relayers(tmp_path, tiny_model, tiny_data):
    """Seen: axolotl's zero2.json was refused for its optimizer and scheduler blocks, whose values
    are "auto" (the Hugging Face integration fills them from the trainer's arguments); relayer's
    own AdamW and lr schedule are those, so the blocks are accepted and dropped, as are values that
    agree with the schedule."""
    axolotl = {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
               "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
               "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                         "weight_decay": "auto"}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto"}},
               "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
               "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}
    (tmp_path / "zero2.json").write_text(json.dumps(axolotl))
    loaded = load_schedule(sched_with(tmp_path, tiny_model, tiny_data, "zero2.json"))
    assert loaded.deepspeed_config == {"zero_optimization": {"stage": 2, "overlap_comm": True}, "bf16": {},
                                       "fp16": {}, "wall_clock_breakdown": False}
    agreeing = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                         "weight_decay": 0.0}},
                "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 30, "warmup_num_steps": 0}}}
    (tmp_path / "agreeing.json").write_text(json.dumps(agreeing))
    loaded = load_schedule(sched_with(tmp_path, tiny_model, tiny_data, "agreeing.json",
                                      lr_schedule={"kind": "cosine"}))
    assert loaded.deepspeed_config == {}


def test_what_relayer_derives_may_stay_where_it_agrees(tmp_path, tiny_model, tiny_data):
    agreeing = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}, "bf16": {"enabled": False}}
    (tmp_path / "ds.json").write_text(json.dumps(agreeing))
    loaded = load_schedule(sched_with(tmp_path, tiny_model, tiny_data, "ds.json",
                                      data={"path": str(tiny_data), "batch_size": 8, "micro_batch_size": 4}))
    assert loaded.deepspeed_config == agreeing


@pytest.mark.parametrize("name, text, message", [
    ("batch", json.dumps({"train_batch_size": 64}), "{file}: train_batch_size: set by data.batch_size; set it there"),
    ("stage", json.dumps({"zero_optimization": {"stage": 3}}),
     "{file}: zero_optimization.stage: set by deepspeed.zero_stage; set it there"),
    ("optimizer", json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "eps": "auto"}}}),
     "{file}: optimizer.params.lr: 3e-05, but relayer sets 0.001 from optimizer.lr; set it there, or say \"auto\""),
    ("optimizer-type", json.dumps({"optimizer": {"type": "Lamb", "params": {}}}),
     "{file}: optimizer.type: 'Lamb': relayer trains with its own AdamW ([optimizer])"),
    ("scheduler-type", json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}}}),
     "{file}: scheduler.type: 'WarmupDecayLR' is lr_schedule.kind = \"linear\"; the schedule has "
     "lr_schedule.kind = \"constant\": set it there"),
    ("scheduler-steps", json.dumps({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}}),
     "{file}: scheduler.params.warmup_num_steps: 100, but relayer sets 0 from lr_schedule.warmup_steps"),
    ("not-a-table", json.dumps({"bf16": True}), "{file}: bf16: expected a table (merged into relayer's), got true"),
    ("list", "[1, 2]", "{file}: expected a JSON object (deepspeed.config), got list"),
    ("nan", '{"zero_optimization": {"reduce_bucket_size": NaN}}',
     "{file}: expected a DeepSpeed JSON config (deepspeed.config): expected a finite number, got NaN"),
    ("syntax", "{", "{file}: expected a DeepSpeed JSON config (deepspeed.config): Expecting property name"),
    ("dotted", '{"zero_optimization.stage": 2}', '{file}: "zero_optimization.stage": a quoted key with a dot'),
    ("missing", None, "{sched}: deepspeed.config: expected a table or a DeepSpeed JSON file, {file} does not exist"),
])
def test_a_bad_file_exits_2_naming_the_file_and_the_key(tmp_path, tiny_model, tiny_data, name, text, message):
    file = tmp_path / f"{name}.json"
    if text is not None:
        file.write_text(text)
    sched = sched_with(tmp_path, tiny_model, tiny_data, file.name)
    r = CliRunner().invoke(main, ["plan", str(sched)])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("orchestrator: " + message.format(file=file, sched=sched)), r.stderr
    assert not (tmp_path / "run").exists()


def test_a_null_is_refused_naming_its_key(tmp_path, tiny_model, tiny_data):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"offload_optimizer": None}}))
    r = CliRunner().invoke(main, ["plan", str(sched_with(tmp_path, tiny_model, tiny_data, "ds.json"))])
    assert r.exit_code == 2
    assert f"{tmp_path / 'ds.json'}: zero_optimization.offload_optimizer: expected a value, got null" in r.stderr


def test_a_resume_compares_what_the_file_merges_not_where_it_lies(tmp_path, tiny_model, tiny_data):
    """The run's copy holds the file's table: an edited file changes the schedule as an edited table
    does (refused without --force); the same file moved elsewhere changes nothing."""
    from orchestrator.changes import check_same_schedule
    from orchestrator.errors import ScheduleError
    from orchestrator.rundir import SCHEDULE_COPY, read_copy
    from orchestrator.runner import Runner

    (tmp_path / "ds.json").write_text(json.dumps(LMFLOW_ZERO2))
    sched = sched_with(tmp_path, tiny_model, tiny_data, "ds.json")
    Runner(load_schedule(sched))._prepare_run_dir()
    copy = read_copy(tmp_path / "run" / SCHEDULE_COPY)
    assert copy["deepspeed"]["config"] == load_schedule(sched).deepspeed_config

    def resume(*overrides: str, force: bool = False) -> None:
        loaded = load_schedule(sched, overrides=overrides)
        check_same_schedule(loaded, plan_phases(loaded), read_copy(loaded.output_dir / SCHEDULE_COPY), force)

    (tmp_path / "moved.json").write_text(json.dumps(LMFLOW_ZERO2))
    resume("deepspeed.config=moved.json")
    edited = {**LMFLOW_ZERO2, "zero_optimization": {**LMFLOW_ZERO2["zero_optimization"], "allgather_bucket_size": 5e5}}
    (tmp_path / "ds.json").write_text(json.dumps(edited))
    with pytest.raises(ScheduleError) as e:
        resume()
    assert "deepspeed.config.zero_optimization.allgather_bucket_size: 200000000.0 -> 500000.0" in str(e.value)
    resume(force=True)
