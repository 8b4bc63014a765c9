"""Building the base model strictly: every weight the config implies comes from the safetensors files,
nothing else is in them, and no pickle is ever opened.

Real tiny Llamas saved with ``save_pretrained``, then edited as a user's folder might be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shard_tools.model import ModelSpec, build_base_model
from tests.conftest import make_llama


def build(path: Path):
    return build_base_model(ModelSpec(path=str(path), config=None, dtype="float32", seed=0))


def edit_config(model: Path, **values) -> None:
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, **values}))


def edit_weights(model: Path, edit) -> None:
    tensors = load_file(model / "model.safetensors")
    edit(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("tie", [False, True])
def test_a_whole_model_loads_with_its_own_weights(tmp_path, tie):
    model = make_llama(tmp_path / "m", layers=2, tie=tie)
    saved = load_file(model / "model.safetensors")
    loaded = build(model).state_dict()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    if tie:
        assert "lm_head.weight" not in saved  # tied: its weight is the embedding, and that is not missing


def test_config_naming_more_layers_than_the_weights_hold(tmp_path):
    model = make_llama(tmp_path / "m", layers=2)
    edit_config(model, num_hidden_layers=4)
    with pytest.raises(ValueError) as e:
        build(model)
    assert str(e.value).startswith(f"model.path: {model}: the weights do not match config.json: 18 weight(s) "
                                   "missing from the files: model.layers.2.input_layernorm.weight, ")


def test_a_dropped_and_an_extra_tensor(tmp_path):
    model = make_llama(tmp_path / "m", layers=2)

    def edit(t: dict) -> None:
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.1.mlp.extra.weight"] = t["model.norm.weight"].clone()

    edit_weights(model, edit)
    with pytest.raises(ValueError) as e:
        build(model)
    assert str(e.value) == (f"model.path: {model}: the weights do not match config.json: 1 weight(s) missing from "
                            "the files: model.layers.1.mlp.up_proj.weight; 1 weight(s) in the files but not in the "
                            "model: model.layers.1.mlp.extra.weight")


def test_pickle_weights_are_never_loaded(tmp_path):
    model = make_llama(tmp_path / "m", layers=2)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors"):
        build(model)


def test_an_unknown_model_type(tmp_path):
    model = make_llama(tmp_path / "m", layers=2)
    edit_config(model, model_type="llama-from-the-future")
    with pytest.raises(ValueError) as e:
        build(model)
    assert str(e.value) == (f"model.path: {model / 'config.json'}: model_type 'llama-from-the-future' is not a "
                            "model type this transformers knows")
    with pytest.raises(ValueError) as e:
        build_base_model(ModelSpec(path=None, config={"model_type": "nope", "num_hidden_layers": 2},
                                   dtype="float32", seed=0))
    assert str(e.value) == "model.config: model_type 'nope' is not a model type this transformers knows"
