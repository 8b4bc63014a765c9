"""The model shapes the benchmarks run and the order of the layers their phases train.

``switch.py``, ``peer.py`` and ``_space.py`` share these, so that a run, its disk plan and its
results name the same shape.
"""

from __future__ import annotations

import random

LAYERS_PER_PHASE = 2

LLAMA = {"model_type": "llama", "max_position_embeddings": 2048}
SHAPES = {
    # All three ways of switch.py take ~85 s of CPU time, nearly all of it imports in 10 fresh processes.
    "tiny": {
        "model": {**LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                  "max_position_embeddings": 64},
        "seq_len": 32, "batch_size": 8, "micro_batch_size": 4, "phases": 4, "steps": 3,
    },
    # TinyLlama-1.1B's shape: the one the +1.35 GB-per-switch leak was measured on (~0.09 s a step on an H200).
    "1.1b": {
        "model": {**LLAMA, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000},
        "seq_len": 512, "batch_size": 4, "micro_batch_size": 4, "phases": 8, "steps": 20,
    },
    # Llama-2-7B (~0.17 s a step on an H200; 13.5 GB of bf16 weights).
    "7b": {
        "model": {**LLAMA, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
        "seq_len": 512, "batch_size": 4, "micro_batch_size": 4, "phases": 8, "steps": 20,
    },
    # Llama-2-13B (13.0B parameters, 26 GB of bf16 weights). On one H200 the handover's planned
    # overlap fits with micro batches of 1 (the batch stays 4: 4 accumulation steps), not of 4.
    "13b": {
        "model": {**LLAMA, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000},
        "seq_len": 512, "batch_size": 4, "micro_batch_size": 4, "phases": 8, "steps": 20,
    },
    # LLaMA-30B/33B (32.5B parameters, 65 GB of bf16 weights): ZeRO-3 on 2 GPUs, or one H200
    # through the checkpoint (two phases do not fit it at once).
    "30b": {
        "model": {**LLAMA, "hidden_size": 6656, "intermediate_size": 17920, "num_hidden_layers": 60,
                  "num_attention_heads": 52, "num_key_value_heads": 52, "vocab_size": 32000},
        "seq_len": 512, "batch_size": 4, "micro_batch_size": 4, "phases": 4, "steps": 5,
    },
}
SHAPES["h200"] = SHAPES["1.1b"]  # the name results before 2026-12-01 used


def layer_walk(order: str, n_phases: int, n_layers: int, seed: int) -> list[list[int]]:
    """Each phase's body layers: ``lisa`` samples them as LISA does (seeded; a layer may come back
    within a few phases), ``walk`` takes them in turn (every layer once before any comes back)."""
    if order == "lisa":
        rng = random.Random(seed)
        return [sorted(rng.sample(range(n_layers), LAYERS_PER_PHASE)) for _ in range(n_phases)]
    return [sorted({(LAYERS_PER_PHASE * k + j) % n_layers for j in range(LAYERS_PER_PHASE)})
            for k in range(n_phases)]
