"""``shard-tools outliers``: OwLore's layer weights (OWL's layerwise outlier ratios), checked against
a computation of their own from every linear map's captured inputs, for a Llama (nn.Linear) and a
GPT-2 (Conv1D, its weight stored the other way round); the printed line plans as layer_weights;
bad input is exit 2 naming the file and line."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config
from transformers.pytorch_utils import Conv1D

from shard_tools.outliers import outlier_ratios
from tests.conftest import cli, schedule_dict, write_schedule
from tests.orchestrator.test_cli_plan import invoke


def rows_of(data: Path, n: int) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in data.read_text().splitlines()[:n]]


def by_hand(model: torch.nn.Module, layers: list[torch.nn.Module], rows: list[list[int]], m: float) -> list[float]:
    """Every linear map's inputs captured whole, then each weight's |W_ij| x ||X_j|| in float64."""
    seen: dict[torch.nn.Module, list[torch.Tensor]] = {}
    maps = [[x for x in layer.modules() if isinstance(x, (torch.nn.Linear, Conv1D))] for layer in layers]
    hooks = [x.register_forward_hook(lambda mod, args, out: seen.setdefault(mod, []).append(args[0].detach()))
             for group in maps for x in group]
    with torch.no_grad():
        for ids in rows:
            model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    out = []
    for group in maps:
        scores = []
        for x in group:
            inputs = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen[x]]).double()
            norm = inputs.norm(dim=0)
            w = x.weight.detach().double().abs()
            scores.append((w * (norm[:, None] if isinstance(x, Conv1D) else norm[None, :])).flatten())
        s = torch.cat(scores)
        out.append(float((s > m * s.mean()).double().mean()))
    return out


@pytest.mark.parametrize("threshold", [5.0, 2.0])
def test_the_ratios_are_owls_of_a_llama(tiny_model, tiny_data, threshold):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    rows = rows_of(tiny_data, 6)
    got = outlier_ratios(model, rows, threshold)
    want = by_hand(model, list(model.model.layers), rows, threshold)
    size = sum(p.numel() for n, p in model.model.layers[0].named_parameters() if n.endswith("proj.weight"))
    assert len(got) == 4 and got == pytest.approx(want, abs=2 / size)
    assert all(0 < r < 0.5 for r in got), got


def test_the_ratios_of_a_gpt2_read_its_conv1d_weights_the_other_way_round():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=4,
                                                        n_positions=64)).eval()
    rows = [[(7 * i + j) % 96 for j in range(16)] for i in range(4)]
    got = outlier_ratios(model, rows, 3.0)
    assert got == pytest.approx(by_hand(model, list(model.transformer.h), rows, 3.0), abs=1e-3)
    assert len(got) == 3


def test_the_printed_line_plans_as_layer_weights(tmp_path, tiny_model, tiny_data):
    r = cli("shard-tools", "outliers", str(tiny_model), str(tiny_data), "--rows", "6")
    assert r.returncode == 0, r.stderr
    weights = tomllib.loads(r.stdout)["layer_weights"]
    assert len(weights) == 4 and all(w > 0 for w in weights)
    raw = schedule_dict(tiny_model, tiny_data)
    raw["schedule"] = {"strategy": "lisa", "total_steps": 20, "interval": 5, "layers_per_phase": 1,
                       "layer_weights": weights}
    sched = write_schedule(tmp_path / "s.toml", raw)
    planned = invoke("plan", str(sched))
    assert planned.exit_code == 0, planned.output


def test_bad_input_is_exit_2_naming_the_file_and_line(tmp_path, tiny_model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"labels": [1]}\n')
    r = cli("shard-tools", "outliers", str(tiny_model), str(bad))
    assert r.returncode == 2 and f"{bad}:2: expected input_ids (token ids) or text" in r.stderr, r.stderr
    r = cli("shard-tools", "outliers", str(tiny_model), str(tmp_path / "none.jsonl"))
    assert r.returncode == 2 and "none.jsonl: no such file" in r.stderr, r.stderr
    r = cli("shard-tools", "outliers", str(tmp_path), str(bad))
    assert r.returncode == 2 and "no config.json" in r.stderr, r.stderr


def test_a_model_of_pickled_weights_is_refused_not_unpickled(tmp_path, tiny_model, tiny_data):
    """Read as a run reads a model (safetensors only): a folder whose weights are a pickle is exit 2."""
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_model / "config.json", pickled)
    torch.save(AutoModelForCausalLM.from_pretrained(tiny_model).state_dict(), pickled / "pytorch_model.bin")
    r = cli("shard-tools", "outliers", str(pickled), str(tiny_data))
    assert r.returncode == 2 and str(pickled) in r.stderr and "layer_weights" not in r.stdout, r.stderr
