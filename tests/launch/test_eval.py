"""Validation loss during a run (metrics.jsonl and TensorBoard), and gradient checkpointing (which
must not change the result)."""

import json
import os

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


def test_eval_loss_per_source_generations_and_the_chat_template_kept(tmp_path):
    """One small real run, several checks (seen missing by a LISA user): the evaluation loss of
    each source besides the overall one, greedy generations from eval.prompts at each evaluation
    (metrics.jsonl, TensorBoard, W&B offline), and RUN_DIR/final keeping the named chat template
    the run trained with (over the tokenizer's own)."""
    import importlib.util

    from transformers import AutoTokenizer

    from launch.data.templates import TEMPLATES
    from tests.conftest import ROOT
    from tests.orchestrator.test_data_cli import CHATS, INSTRUCTIONS, jsonl

    spec = importlib.util.spec_from_file_location("alpaca_model", ROOT / "examples" / "alpaca" / "make_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    model = maker.make(tmp_path / "model")
    alpaca, chats = jsonl(tmp_path / "alpaca.jsonl", INSTRUCTIONS), jsonl(tmp_path / "chats.jsonl", CHATS)
    s = schedule_dict(model, alpaca, run={"output_dir": "run", "tensorboard": True, "report_to": ["wandb"],
                                         "final_model": True},
                      schedule={"phases": [{"steps": 4, "layers": [0]}]})
    s["data"] = {"sources": [{"path": str(alpaca), "format": "instruction"}, {"path": str(chats), "format": "chat"}],
                 "chat_template": "phi3", "seq_len": 64, "batch_size": 4, "micro_batch_size": 2,
                 "validation_split": 0.25, "eval_every": 2}
    s["eval"] = {"prompts": ["Name colour number 1.", "Which animal comes 2?"], "max_new_tokens": 4}
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    r = cli("orchestrator", "run", str(write_schedule(tmp_path / "s.toml", s)), env=env)
    assert r.returncode == 0, r.stderr
    run = tmp_path / "run"
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
    assert [m["step"] for m in evals] == [2, 4]
    for m in evals:
        per_source = [m["eval_loss/alpaca"], m["eval_loss/chats"]]
        assert min(per_source) <= m["eval_loss"] <= max(per_source), m
        assert [g["prompt"] for g in m["generations"]] == s["eval"]["prompts"]
        assert all(isinstance(g["text"], str) for g in m["generations"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    assert [e.step for e in tb.Scalars("eval_loss/chats")] == [2, 4]
    assert "generations/1/text_summary" in tb.Tags()["tensors"], tb.Tags()
    assert list((run / "wandb").glob("offline-run-*"))
    assert (run / "final" / "chat_template.jinja").read_text() == TEMPLATES["phi3"]
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False).startswith("<|user|>")
