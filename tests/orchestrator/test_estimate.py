"""``orchestrator plan --device-memory``: parameter counts from config.json against real models,
the memory arithmetic per ZeRO stage, size strings, and the plan table with its warning.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import (
    AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
)

from orchestrator.cli import main
from orchestrator.errors import ScheduleError
from orchestrator.estimate import (
    ACTIVATION_VALUES, CHECKPOINTED_VALUES, CONTEXT_BYTES, LOGIT_BYTES, EstimateError, ParamCount, param_count,
    phase_memory, size_option,
)
from shard_tools.sizes import format_bytes
from tests.conftest import ROOT, SEQ, schedule_dict, write_schedule

_SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
CONFIGS = {
    "llama": lambda: LlamaConfig(**_SMALL, num_key_value_heads=2),
    "llama-biases-tied-head-dim": lambda: LlamaConfig(**_SMALL, attention_bias=True, mlp_bias=True,
                                                      tie_word_embeddings=True, head_dim=16),
    "mistral": lambda: MistralConfig(**_SMALL, num_key_value_heads=2),
    "qwen2-tied": lambda: Qwen2Config(**_SMALL, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**_SMALL, num_key_value_heads=2, head_dim=8),
    "gpt2": lambda: GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                               bos_token_id=None, eos_token_id=None),
    "gpt2-untied-n-inner": lambda: GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              n_inner=48, tie_word_embeddings=False,
                                              bos_token_id=None, eos_token_id=None),
}


def _numel(model: torch.nn.Module, prefix: str) -> int:
    # named_parameters lists a tied weight once, under the embedding: a tied lm_head owns none.
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix + "."))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_param_count_matches_the_real_model(name, tmp_path):
    model = AutoModelForCausalLM.from_config(CONFIGS[name]())
    model.save_pretrained(tmp_path)
    count = param_count(json.loads((tmp_path / "config.json").read_text()))
    assert count.total == sum(p.numel() for p in model.parameters())
    for prefix, n in count.head.items():
        assert n == _numel(model, prefix), prefix
    layers = "transformer.h" if model.config.model_type == "gpt2" else "model.layers"
    assert count.per_layer == _numel(model, f"{layers}.0")


@pytest.mark.parametrize("config", [
    # Keys left out take the family's defaults, as transformers fills them in.
    {"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
     "num_attention_heads": 8},
    {"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2},
    {"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
     "num_attention_heads": 4},
    {"model_type": "gpt2", "vocab_size": 100, "n_embd": 32, "n_layer": 2, "n_head": 4},
], ids=lambda c: c["model_type"])
def test_param_count_of_a_partial_inline_config(config):
    cfg = dict(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    assert param_count(config).total == sum(p.numel() for p in model.parameters())


def test_param_count_of_llama_3_1_8b():
    # The published size of Meta-Llama-3.1-8B, from its config.json values.
    config = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "tie_word_embeddings": False}
    assert param_count(config).total == 8_030_261_248


def test_unknown_family_is_named():
    with pytest.raises(EstimateError, match="model type 'phi3' has no parameter count formula"):
        param_count({"model_type": "phi3", "num_hidden_layers": 2})


COUNT = ParamCount(head={"embed": 1000, "lm_head": 1000, "norm": 10}, per_layer=500, num_layers=4, hidden=10)


@pytest.mark.parametrize("stage,weights,optimizer,gradients", [
    # 4010 parameters, 2510 trainable (head + 1 layer), bf16 (2 bytes), 4 processes.
    (0, 4010 * 2, 2510 * 12, 2510 * (2 + 4)),  # relayer's MasterAdamW: every rank all of it, an fp32 gradient buffer
    (1, 4010 * 2, 2510 * 12 / 4, 2510 * 2),
    (2, 4010 * 2, 2510 * 12 / 4, 2510 * 2 / 4),
    (3, 4010 * 2 / 4, 2510 * 12 / 4, 2510 * 2 / 4),
])
def test_phase_memory_partitions_by_zero_stage(stage, weights, optimizer, gradients):
    m = phase_memory(COUNT, 2510, dtype="bfloat16", zero_stage=stage, world=4, micro_batch=2, seq_len=8)
    assert (m.weights, m.optimizer, m.gradients) == (weights, optimizer, gradients)
    assert m.activations == 2 * 8 * 10 * 4 * ACTIVATION_VALUES * 2
    assert m.total == m.weights + m.optimizer + m.gradients + m.activations


def test_gradient_checkpointing_keeps_each_layers_input_and_one_layer_recomputed():
    # 4 layers of width 10, micro-batch 2 x 8 tokens, bf16: every layer's input (one value a token and
    # hidden unit) and one layer's whole activations while backward recomputes it.
    plain = phase_memory(COUNT, 2510, dtype="bfloat16", zero_stage=2, world=1, micro_batch=2, seq_len=8)
    ckpt = phase_memory(COUNT, 2510, dtype="bfloat16", zero_stage=2, world=1, micro_batch=2, seq_len=8,
                        checkpointing=True)
    assert CHECKPOINTED_VALUES == 1
    assert ckpt.activations == 2 * 8 * 10 * (4 * 1 + ACTIVATION_VALUES) * 2
    assert (ckpt.weights, ckpt.optimizer, ckpt.gradients) == (plain.weights, plain.optimizer, plain.gradients)


def test_gradient_checkpointing_at_7b_micro_batch_4():
    # Llama 2 7B, batch 4 x 512, bf16: 8.5 GiB of activations without, 0.77 GiB with (32 inputs + one
    # layer); the logits (4 x 512 x 32000, LOGIT_BYTES each) either way.
    count = param_count({"model_type": "llama", "num_hidden_layers": 32})
    kw = dict(dtype="bfloat16", zero_stage=0, world=1, micro_batch=4, seq_len=512)
    plain, ckpt = (phase_memory(count, 0, **kw, checkpointing=c).activations for c in (False, True))
    logits = 4 * 512 * 32000 * LOGIT_BYTES
    assert plain == 4 * 512 * 4096 * 32 * 17 * 2 + logits
    assert ckpt == 4 * 512 * 4096 * (32 + 17) * 2 + logits
    assert plain / ckpt > 5


@pytest.mark.parametrize("text,size", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("141e9", 141 * 10**9), ("1.5TiB", int(1.5 * 2**40)),
    ("512 MiB", 512 * 2**20), ("80gib", 80 * 2**30), ("4096", 4096), ("1KB", 1000),
])
def test_size_option(text, size):
    assert size_option(text, "--device-memory") == size


# 1e400GiB: a float overflows to infinity, which is no size (and no traceback).
@pytest.mark.parametrize("text", ["80G", "eighty", "", "-5GiB", "0", "80 GiB GiB", "GiB", "1e400GiB", "0.1"])
def test_size_option_refuses(text):
    with pytest.raises(ScheduleError) as e:
        size_option(text, "--device-memory")
    assert str(e.value) == f"--device-memory: expected a size such as 80GiB, 80GB or 141e9 (bytes), got {text!r}"


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def table_rows(stdout: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in stdout.splitlines()
            if line.startswith("│")]


@pytest.fixture
def schedule(tmp_path, tiny_model, tiny_data) -> Path:
    return write_schedule(tmp_path / "schedule.toml", schedule_dict(tiny_model, tiny_data))


def test_plan_prints_the_estimate(schedule, tiny_model, tmp_path):
    r = invoke("plan", str(schedule), "--device-memory", "80GiB")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    total = sum(p.numel() for p in model.parameters())
    head = _numel(model, "model.embed_tokens") + _numel(model, "lm_head") + _numel(model, "model.norm")
    trainable = head + _numel(model, "model.layers.0")
    # The tiny schedule: fp32, ZeRO-2, one process, micro-batch 4 of 16 tokens, 4 layers of width 32;
    # ZeRO's reduce bucket (relayer's least, 5e5 elements) and the logits counted too.
    gradients = trainable * 4 + 500_000 * 4
    activations = 4 * SEQ * 32 * 4 * ACTIVATION_VALUES * 4 + 4 * SEQ * model.config.vocab_size * LOGIT_BYTES
    # On a GPU the phases map the holder's copy of the model (launch.resident): a phase's own weights
    # are what it trains; the holder's line says what it keeps.
    expect = [format_bytes(b) for b in (trainable * 4, trainable * 12, gradients, activations)]
    expect.append(format_bytes(trainable * 4 + trainable * 12 + gradients + activations))
    assert f"the model's weights: {format_bytes(total * 4 + CONTEXT_BYTES)} per GPU with the holder's process" \
        in " ".join(r.stdout.split())
    rows = table_rows(r.stdout)
    assert [row[:5] for row in rows] == [["0", "10", "0-9", "0", "1"], ["1", "10", "10-19", "1", "1"],
                                         ["2", "10", "20-29", "0", "1"]]
    assert all(row[5:] == expect for row in rows)
    assert f"{total:,} parameters" in r.stdout
    assert not (tmp_path / "run").exists()


def test_plan_counts_gradient_checkpointing(tmp_path, tiny_model, tiny_data):
    rows = {}
    for on in (False, True):
        sched = schedule_dict(tiny_model, tiny_data)
        sched["model"]["gradient_checkpointing"] = on
        r = invoke("plan", str(write_schedule(tmp_path / f"s{on}.toml", sched)), "--device-memory", "80GiB")
        assert r.exit_code == 0, r.output
        rows[on] = table_rows(r.stdout)[0]
        assert f"activations {'with' if on else 'without'} gradient checkpointing" in r.stdout
    # The tiny model: 4 layers of width 32, micro-batch 4 x SEQ, fp32; its logits (vocab 96) either way.
    logits = 4 * SEQ * AutoModelForCausalLM.from_pretrained(tiny_model).config.vocab_size * LOGIT_BYTES
    assert rows[False][8] == format_bytes(4 * SEQ * 32 * 4 * ACTIVATION_VALUES * 4 + logits)
    assert rows[True][8] == format_bytes(4 * SEQ * 32 * (4 + ACTIVATION_VALUES) * 4 + logits)
    assert rows[False][5:8] == rows[True][5:8]


def test_plan_refuses_a_phase_that_will_not_fit_its_device_memory(tmp_path, tiny_model, tiny_data):
    phases = [{"steps": 10, "layers": [0]}, {"steps": 10, "layers": [0, 1, 2, 3]}, {"steps": 10, "layers": [1]}]
    path = write_schedule(tmp_path / "schedule.toml", schedule_dict(tiny_model, tiny_data, schedule={"phases": phases}))
    r = invoke("plan", str(path), "--device-memory", "1MiB")
    assert r.exit_code == 2, r.output
    # Each process holds a CUDA context and more (PROCESS_BYTES): no key makes a phase fit 1 MiB.
    assert r.stderr.startswith(f"orchestrator: {path.resolve()}: --device-memory: phase 0 needs ")
    assert "more than 1.0 MiB; nothing relayer offers fits: " in r.stderr
    assert r.stdout == "" and not (tmp_path / "run").exists()


def test_plan_refuses_a_bad_size(schedule, tmp_path):
    r = invoke("plan", str(schedule), "--device-memory", "lots")
    assert r.exit_code == 2
    assert r.stderr == "orchestrator: --device-memory: expected a size such as 80GiB, 80GB or 141e9 (bytes), got 'lots'\n"
    assert r.stdout == ""


def test_plan_of_an_unknown_family_warns_and_prints_the_table(tmp_path, tiny_data):
    sched = schedule_dict(Path("unused"), tiny_data)
    sched["model"] = {"config": {"model_type": "phi3", "num_hidden_layers": 4}, "dtype": "float32"}
    path = write_schedule(tmp_path / "schedule.toml", sched)
    r = invoke("plan", str(path), "--device-memory", "80GiB")
    assert r.exit_code == 0, r.output
    assert len(table_rows(r.stdout)) == 3
    assert r.stderr == ("orchestrator: warning: no memory estimate: model type 'phi3' has no parameter count formula "
                        "(known: llama, mistral, qwen2, qwen3, gpt2)\n")


def test_plan_with_an_estimate_imports_no_torch(schedule):
    code = ('import sys; from orchestrator.cli import main\n'
            'try:\n    main(["plan", sys.argv[1], "--device-memory", "80GiB"])\n'
            'except SystemExit as e:\n    assert not e.code, e.code\n'
            'heavy = {"torch", "deepspeed", "transformers"} & set(sys.modules); assert not heavy, heavy')
    r = subprocess.run([sys.executable, "-c", code, str(schedule)], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "optimizer" in r.stdout


def test_a_phase_of_module_units_counts_only_their_parameters(tmp_path, tiny_model, tiny_data):
    """Module units (MISA): a phase's trainable body is its units' tensors, not their layers whole
    (the rest of a layer waits on the host): the tiny model's MLP is 3 x 32 x 64 of a layer's 9,280."""
    from orchestrator.estimate import body_trained, estimate_plan, param_count, model_config
    from orchestrator.plan import plan_phases
    from orchestrator.validate import validate_schedule

    raw = schedule_dict(tiny_model, tiny_data, schedule={"phases": [
        {"steps": 5, "modules": ["0.mlp", "2.self_attn.k_proj"]}, {"steps": 5, "layers": [0]}]},
        deepspeed={"zero_stage": 0})
    loaded = validate_schedule(raw, write_schedule(tmp_path / "s.toml", raw))
    phases = plan_phases(loaded)
    count = param_count(model_config(loaded))
    assert [body_trained(loaded, p, count) for p in phases] == [3 * 32 * 64 + 32 * 16, 9_280]
    units, layer = estimate_plan(loaded, phases).phases
    assert layer.optimizer - units.optimizer == (9_280 - 3 * 32 * 64 - 32 * 16) * (layer.optimizer // (
        count.head["model.embed_tokens"] + count.head.get("lm_head", 0) + count.head["model.norm"] + 9_280))
