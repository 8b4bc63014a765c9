"""The phase spec the runner hands a phase: built typed from the schedule, so validated before any
of the phase's processes start (orchestrator.phasespec)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from launch.contract.spec import PhaseSpec
from orchestrator import phasespec
from orchestrator.groups import Work
from orchestrator.plan import plan_phases
from orchestrator.validate import load_schedule
from tests.conftest import schedule_dict, write_schedule

CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.fixture
def loaded(tmp_path, tiny_data):
    raw = schedule_dict(Path("unused"), tiny_data, optimizer={"betas": [0.8, 0.95]},
                        lr_schedule={"kind": "cosine", "warmup_steps": 2})
    raw["model"] = {"config": CONFIG, "dtype": "float32"}  # inline: no model folder, no torch
    return load_schedule(write_schedule(tmp_path / "s.toml", raw))


def test_the_spec_is_typed_and_what_the_worker_reads(tmp_path, loaded):
    phases = plan_phases(loaded)
    restore = loaded.output_dir / "checkpoints" / "step-00000013"
    spec = phasespec.phase_spec(loaded, phases, Work(phases[1], 13, restore), tmp_path / "pd",
                                phasespec.plan_estimate(loaded, phases))
    assert isinstance(spec, PhaseSpec)
    assert (spec.phase, spec.start_step, spec.phase_start_step, spec.end_step, spec.layers, spec.restore) == (
        1, 13, 10, 20, [1], str(restore))
    assert (spec.optimizer.betas, spec.optimizer.lr_kind, spec.optimizer.warmup_steps, spec.optimizer.total_steps) == (
        (0.8, 0.95), "cosine", 2, 30)
    assert (spec.model.path, spec.model.config, spec.data.sources[0].path) == (None, CONFIG, str(loaded.data_path))
    assert not spec.prewarm and spec.phase_dir == str(tmp_path / "pd")
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json(indent=1))
    assert PhaseSpec.read(path) == spec


def test_a_spec_the_worker_would_refuse_is_a_bug_here(tmp_path, loaded, monkeypatch):
    # Drift between the schedule's sections and the contract fails in the orchestrator, before a
    # process starts, as the bug it is (not as bad input, and not as a phase that failed).
    data_spec = phasespec.data_spec
    monkeypatch.setattr(phasespec, "data_spec", lambda loaded: {**data_spec(loaded), "packing": True})
    phases = plan_phases(loaded)
    with pytest.raises(ValidationError, match="packing"):
        phasespec.phase_spec(loaded, phases, Work(phases[0], 0, None), tmp_path / "pd", None)
