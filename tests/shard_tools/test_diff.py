"""``shard-tools diff``: per tensor and per layer, the change between two composed checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from shard_tools.state import run_weights
from shard_tools.diff import diff_paths
from tests.conftest import make_llama
from tests.shard_tools.conftest import ckpt, invoke, rewrite_manifests


def _composed(run, step, base_path) -> dict[str, torch.Tensor]:
    """Base model, then the run's weights at ``step``: what the checkpoint stands for, built by hand."""
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    weights.update(run_weights(run, ckpt(run, step)))
    return weights


def test_two_checkpoints_of_a_run(tiny_run, tiny_model):
    report = diff_paths(ckpt(tiny_run, 10), ckpt(tiny_run, 30))
    a, b = _composed(tiny_run, 10, tiny_model), _composed(tiny_run, 30, tiny_model)
    # Layer 1 is trained only after step 10, so A's layer 1 is the base's.
    touched = set(run_weights(tiny_run, ckpt(tiny_run, 10))) | set(run_weights(tiny_run, ckpt(tiny_run, 30)))
    assert {t["name"] for t in report["tensors"]} == touched
    for t in report["tensors"]:
        d = b[t["name"]] - a[t["name"]]
        assert t["changed"] == bool(d.any())
        assert t["max_abs"] == pytest.approx(d.abs().max().item())
        assert t["rel_change"] == pytest.approx((d.norm() / a[t["name"]].norm()).item())
    groups = {g["group"]: g for g in report["groups"]}
    assert list(groups) == ["head", "layer 0", "layer 1"]
    layer1 = [n for n in touched if n.startswith("model.layers.1.")]
    assert groups["layer 1"]["tensors"] == groups["layer 1"]["changed"] == len(layer1) == 9
    diff_sq = sum((b[n] - a[n]).norm().item() ** 2 for n in layer1)
    rel = math.sqrt(diff_sq / sum(a[n].norm().item() ** 2 for n in layer1))
    assert groups["layer 1"]["rel_change"] == pytest.approx(rel)
    assert groups["head"]["max_abs"] == pytest.approx(max((b[n] - a[n]).abs().max().item() for n in touched
                                                          if not n.startswith("model.layers.")))


def test_a_checkpoint_against_itself(tiny_run):
    result = invoke("diff", ckpt(tiny_run, 20), ckpt(tiny_run, 20), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tensors"] and not any(t["changed"] for t in report["tensors"])
    assert all(t["max_abs"] == 0 and t["rel_change"] == 0 for t in report["tensors"])

    table = invoke("diff", ckpt(tiny_run, 10), ckpt(tiny_run, 20))
    assert table.exit_code == 0, table.output
    assert "layer 1" in table.stdout and "model.layers.1.mlp.up_proj.weight" in table.stdout


def test_two_runs_from_different_bases(tiny_run, tiny_model, run_copy, tmp_path):
    other = make_llama(tmp_path / "other-base", seed=1)
    rewrite_manifests(run_copy, lambda m: m["extra"]["base_model"].update(path=str(other)))
    result = invoke("diff", tiny_run, run_copy, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert not report["same_base"]
    a, b = _composed(tiny_run, 30, tiny_model), _composed(run_copy, 30, other)
    assert {t["name"] for t in report["tensors"]} == set(a)
    trained = set(run_weights(tiny_run, ckpt(tiny_run, 30)))
    for t in report["tensors"]:
        assert t["changed"] == (not torch.equal(a[t["name"]], b[t["name"]])), t["name"]
        assert t["max_abs"] == pytest.approx((b[t["name"]] - a[t["name"]]).abs().max().item())
    # Both runs hold the same trained weights; only what neither trained shows the bases' difference
    # (norm weights start at one whatever the seed, so these are the random-init matrices).
    changed = {t["name"] for t in report["tensors"] if t["changed"]}
    assert changed and not changed & trained
    assert "model.layers.3.mlp.up_proj.weight" in changed
    assert [g["group"] for g in report["groups"]] == ["head", "layer 0", "layer 1", "layer 2", "layer 3"]
