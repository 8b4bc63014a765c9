"""Model families other than the tiny Llama: each trains a 3-phase schedule through the real CLI,
is preempted once and resumed, then exports to a directory that transformers loads.

The models are tiny random ones built from each family's own config class; what is checked is
that relayer finds the right head and layers in each, keeps a tied embedding tied, and that a
preemption in the middle of a phase resumes to the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config,
)

from shard_tools.manifest import HEAD, LAYERS, read_manifest
from shard_tools.model import detect_parts, head_param_names
from shard_tools.state import run_weights
from shard_tools.store import Checkpoints
from tests.conftest import SEQ, VOCAB, cli, schedule_dict, write_schedule

pytestmark = pytest.mark.multiprocess
ORCH = str(Path(sys.executable).parent / "orchestrator")
LAYERS_N = 4
PHASES = [{"steps": 3, "layers": [0]}, {"steps": 3, "layers": [1, 2]}, {"steps": 3, "layers": [0]}]
TOTAL = 9
# Layer 3 is in no phase: its weights must come out of the export exactly as they went in.
UNTRAINED = 3

_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS_N,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _config(family: str) -> PretrainedConfig:
    if family == "llama":
        return LlamaConfig(**_LLAMA_LIKE)
    if family == "mistral":
        return MistralConfig(**_LLAMA_LIKE, sliding_window=None)
    if family == "qwen2":
        # Tied like the small Qwen2.5 models: a llama-style layout with one shared embedding.
        return Qwen2Config(**_LLAMA_LIKE, tie_word_embeddings=True)
    assert family == "gpt2"
    return GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS_N, n_head=4, n_positions=64,
                      bos_token_id=None, eos_token_id=None)


# family -> (head module prefixes, layer list, head parameters as named_parameters lists them)
EXPECTED = {
    "llama": (["model.embed_tokens", "lm_head", "model.norm"], "model.layers",
              ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]),
    "mistral": (["model.embed_tokens", "lm_head", "model.norm"], "model.layers",
                ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]),
    "qwen2": (["model.embed_tokens", "lm_head", "model.norm"], "model.layers",
              ["model.embed_tokens.weight", "model.norm.weight"]),
    "gpt2": (["transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"], "transformer.h",
             ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]),
}
TIED = {"qwen2": ("model.embed_tokens.weight", "lm_head.weight"), "gpt2": ("transformer.wte.weight", "lm_head.weight")}
FAMILIES = list(EXPECTED)


def make_model(family: str, out: Path) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(family)).save_pretrained(out)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_head_and_layers_are_detected(family):
    model = AutoModelForCausalLM.from_config(_config(family))
    persistent, layers = detect_parts(model, None, None)
    head, layer_list, head_params = EXPECTED[family]
    assert (persistent, layers) == (head, layer_list)
    assert head_param_names(model, persistent) == head_params


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3"])
def test_the_smallest_warm_up_toy_of_each_family_trains_a_step(family):
    """A waiting phase without room for its warm-up on one layer (7B under a budget of 24 GiB) warms up
    on its family's model at the least widths (``launch.prepare._smallest``): it builds, and a step of
    the phase's rows (any token id of the vocabulary) runs forward and backward."""
    import copy

    from transformers import Qwen3Config

    from launch.prepare import _smallest

    config = Qwen3Config(**_LLAMA_LIKE, head_dim=64) if family == "qwen3" else _config(family)
    config = _smallest(copy.deepcopy(config))
    config.num_hidden_layers = 1
    toy = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in toy.parameters()) < 3 * VOCAB * 16 + 2_000
    ids = torch.tensor([[VOCAB - 1, 0, 5, 7]])
    toy(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_warm_up_toys_vocabulary_is_cut_and_takes_any_token(family):
    """Every warm-up toy's vocabulary at most ``TOY_VOCAB`` rows (``launch.prepare._cut_vocabulary``; at
    7B the whole one was 3.7 GB of the toy's ~10 beside a switch), its padding row within it; the
    phase's rows, any token id and the ignored labels, go through it (``_in_vocabulary``)."""
    import copy

    from launch.prepare import TOY_VOCAB, _cut_vocabulary, _in_vocabulary

    vocab = TOY_VOCAB * 3 + 7
    config = copy.deepcopy(_config(family))
    config.vocab_size, config.pad_token_id, config.num_hidden_layers = vocab, vocab - 1, 1
    _cut_vocabulary(config)
    assert config.vocab_size == TOY_VOCAB and 0 <= config.pad_token_id < TOY_VOCAB
    toy = AutoModelForCausalLM.from_config(config)
    assert toy.get_input_embeddings().weight.shape[0] == TOY_VOCAB
    ids = torch.tensor([[vocab - 1, 0, TOY_VOCAB, 7]])
    batch = _in_vocabulary({"input_ids": ids, "labels": torch.tensor([[-100, 0, vocab - 2, 7]])}, TOY_VOCAB)
    assert batch["input_ids"].tolist() == [[(vocab - 1) % TOY_VOCAB, 0, 0, 7]]
    assert batch["labels"].tolist() == [[-100, 0, (vocab - 2) % TOY_VOCAB, 7]]
    toy(**batch).loss.backward()
    small = copy.deepcopy(_config(family))  # a vocabulary within it is kept
    _cut_vocabulary(small)
    assert small.vocab_size == VOCAB


def _metrics_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _events(run: Path) -> list[str]:
    return [json.loads(line)["event"] for line in (run / "journal.jsonl").read_text().splitlines()]


def _preempt_then_finish(sched: Path, run: Path) -> None:
    """SIGTERM to the orchestrator once phase 1 has stepped (exit 75), then a second run to the end.

    The stop lands inside phase 1 or, if its last steps win the race, between phases 1 and 2.
    """
    orch = subprocess.Popen([ORCH, "run", str(sched)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.time() + 300
        while _metrics_steps(run) < 4 and orch.poll() is None:
            assert time.time() < deadline, "timed out waiting for step 4"
            time.sleep(0.05)
        orch.terminate()
        _, err = orch.communicate(timeout=120)
    finally:
        if orch.poll() is None:
            orch.kill()
    assert orch.returncode == 75, err
    r = cli("orchestrator", "run", str(sched))
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):
    """family -> (base model dir, run dir, export dir); each family is trained once, on first use."""
    done: dict[str, tuple[Path, Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path, Path]:
        if family not in done:
            d = tmp_path_factory.mktemp(family)
            model = make_model(family, d / "model")
            sched = write_schedule(d / "schedule.toml", schedule_dict(
                model, tiny_data, schedule={"phases": PHASES}, checkpoint={"every_steps": 2, "keep_last": 10}))
            run = d / "run"
            _preempt_then_finish(sched, run)
            r = cli("shard-tools", "export", str(run), "--out", str(d / "export"))
            assert r.returncode == 0, r.stderr
            done[family] = model, run, d / "export"
        return done[family]

    return get


def _tensor_names(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return sorted(f.keys())


@pytest.mark.parametrize("family", FAMILIES)
def test_preempted_run_resumes_and_exports(trained, family):
    base_dir, run, out = trained(family)
    head, layer_list, head_params = EXPECTED[family]
    events = _events(run)
    assert {"preempted", "resumed", "run_done"} <= set(events), events
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(1, TOTAL + 1))

    ckpts = {read_manifest(c).global_step: c for c in Checkpoints(run).all()}
    last = read_manifest(ckpts[TOTAL])
    assert last.phase_complete and last.head_step == TOTAL
    assert last.extra["persistent"] == head and last.extra["layers_attr"] == layer_list
    assert _tensor_names(ckpts[TOTAL] / HEAD) == sorted(f"{kind}/{n}" for kind in ("exp_avg", "exp_avg_sq", "master")
                                                        for n in head_params)
    # Phase 1 trained layers 1 and 2: its layer file holds those and nothing of the head.
    phase1 = _tensor_names(ckpts[6] / LAYERS)
    assert phase1 and {n.split(".")[len(layer_list.split("."))] for n in phase1} == {"1", "2"}
    assert all(n.startswith(layer_list + ".") for n in phase1)

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    assert exported.config.model_type == family
    weights = run_weights(run, ckpts[TOTAL])
    got, before = dict(exported.named_parameters()), dict(base.named_parameters())
    assert set(got) == set(before)
    for name, t in got.items():
        expect = weights.get(name, before[name])
        assert torch.equal(t, expect), name
    for name in head_params:
        assert not torch.equal(got[name], before[name]), f"{name} did not train"
    untrained = f"{layer_list}.{UNTRAINED}."
    assert not any(n.startswith(untrained) for n in weights)
    ids = torch.tensor([[(5 * i + 1) % VOCAB for i in range(SEQ)]])
    with torch.no_grad():
        assert torch.isfinite(exported.eval()(ids).logits).all()


@pytest.mark.parametrize("family", list(TIED))
def test_export_keeps_the_embedding_tie(trained, family):
    _, run, out = trained(family)
    embed, lm_head = TIED[family]
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    params = dict(exported.named_parameters(remove_duplicate=False))
    assert params[lm_head] is params[embed]
    trained_embed = run_weights(run, Checkpoints(run).all()[-1])[embed]
    assert torch.equal(params[embed], trained_embed)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert lm_head not in f.keys()
