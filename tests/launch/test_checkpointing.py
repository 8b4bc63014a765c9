"""``model.gradient_checkpointing`` takes effect on the model a phase trains (launch/prepare.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from launch.prepare import setup_model


def test_a_model_read_from_a_path_recomputes_its_layers(tmp_path):
    """from_pretrained gives a model in eval mode, where transformers checkpoints no layer: each
    layer's forward must still run again in backward, and the modules inside keep their mode."""
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not model.training
    spec = SimpleNamespace(model=SimpleNamespace(gradient_checkpointing=True, dtype="float32"),
                           data=SimpleNamespace(layout="pad"))
    model = setup_model(model, spec)
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 2  # the forward, and again in backward
    assert not model.model.layers[0].self_attn.training and not model.model.layers[0].mlp.training
