"""The model shapes the benchmarks run, the options that pick one, and the order of the layers
their phases train.

``switch.py``, ``peer.py`` and ``_space.py`` share these, so that a run, its disk plan and its
results name the same shape, and ``--shape`` / ``--tiny`` mean the same in each.
"""

from __future__ import annotations

import argparse
import random

LAYERS_PER_PHASE = 2

LLAMA = {"model_type": "llama", "max_position_embeddings": 2048}


def llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int = 32000, *,
          seq_len: int = 512, batch_size: int = 4, micro_batch_size: int = 4, phases: int = 8, steps: int = 20,
          **model) -> dict:
    """One shape: a Llama of these sizes (``model``: its other config keys) and the rows, batches and
    phases a benchmark runs it with; the large shapes share all but their sizes."""
    return {"model": {**LLAMA, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
                      "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab, **model},
            "seq_len": seq_len, "batch_size": batch_size, "micro_batch_size": micro_batch_size, "phases": phases,
            "steps": steps}


SHAPES = {
    # All three ways of switch.py take ~85 s of CPU time, nearly all of it imports in 10 fresh processes.
    "tiny": llama(64, 128, 4, 4, 2, 256, max_position_embeddings=64, seq_len=32, batch_size=8, phases=4, steps=3),
    # TinyLlama-1.1B's shape: the one the +1.35 GB-per-switch leak was measured on (~0.09 s a step on an H200).
    "1.1b": llama(2048, 5632, 22, 32, 4),
    # Llama-2-7B (~0.17 s a step on an H200; 13.5 GB of bf16 weights).
    "7b": llama(4096, 11008, 32, 32, 32),
    # Llama-2-13B (13.0B parameters, 26 GB of bf16 weights). On one H200 the handover's planned
    # overlap fits with micro batches of 1 (the batch stays 4: 4 accumulation steps), not of 4 (of 2
    # since the estimate leaves the weights out of the allocator's reserve, not measured).
    "13b": llama(5120, 13824, 40, 40, 40),
    # LLaMA-30B/33B (32.5B parameters, 65 GB of bf16 weights): ZeRO-3 on 2 GPUs, or one H200
    # through the checkpoint (two phases do not fit it at once).
    "30b": llama(6656, 17920, 60, 52, 52, phases=4, steps=5),
}
SHAPES["h200"] = SHAPES["1.1b"]  # the name results before 2026-12-01 used


def shape_arguments(ap: argparse.ArgumentParser, on_cuda: str, tiny_also: str = "") -> None:
    """``--shape`` and ``--tiny`` (the same as --shape tiny, and ``tiny_also``); without either the
    shape is tiny without CUDA, ``on_cuda`` with it (``chosen_shape``)."""
    ap.add_argument("--shape", choices=sorted(SHAPES), help=f"model and batch (default: tiny without CUDA, else {on_cuda})")
    ap.add_argument("--tiny", action="store_true", help=f"the same as --shape tiny{tiny_also}")


def refuse_two_shapes(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--tiny with another --shape names two: the parser's error (exit 2)."""
    if args.tiny and args.shape not in (None, "tiny"):
        ap.error(f"--tiny and --shape {args.shape}: give one")


def chosen_shape(args: argparse.Namespace, cuda: bool, on_cuda: str) -> str:
    """The shape ``shape_arguments``' options name: --shape, tiny for --tiny or without CUDA, else ``on_cuda``."""
    return args.shape or ("tiny" if args.tiny or not cuda else on_cuda)


def layer_walk(order: str, n_phases: int, n_layers: int, seed: int) -> list[list[int]]:
    """Each phase's body layers: ``lisa`` samples them as LISA does (seeded; a layer may come back
    within a few phases), ``walk`` takes them in turn (every layer once before any comes back)."""
    if order == "lisa":
        rng = random.Random(seed)
        return [sorted(rng.sample(range(n_layers), LAYERS_PER_PHASE)) for _ in range(n_phases)]
    return [sorted({(LAYERS_PER_PHASE * k + j) % n_layers for j in range(LAYERS_PER_PHASE)})
            for k in range(n_phases)]


def module_walk(n_phases: int, config: dict, budget: float, seed: int) -> list[dict]:
    """Each phase's module units as MISA draws them uniformly (relayer's ``strategy = "misa"`` draws
    its own; here explicit, so the benchmark's phases are its setup's): a Llama layer's seven
    projections are units, shuffled and taken while they fit in ``budget`` of the body's parameters.
    Each a phase's ``{"layers": touched, "modules": units}``."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    sizes = {"self_attn.q_proj": h * h, "self_attn.k_proj": h * kv, "self_attn.v_proj": h * kv,
             "self_attn.o_proj": h * h, "mlp.gate_proj": h * i, "mlp.up_proj": h * i, "mlp.down_proj": h * i}
    units = [(f"{l}.{m}", n) for l in range(layers) for m, n in sizes.items()]
    left_of = int(budget * layers * (sum(sizes.values()) + 2 * h))
    rng, out = random.Random(seed), []
    for _ in range(n_phases):
        order, left, chosen = rng.sample(units, len(units)), left_of, []
        for name, n in order:
            if n <= left:
                chosen.append(name)
                left -= n
        out.append({"layers": sorted({int(u.split(".")[0]) for u in chosen}), "modules": sorted(chosen)})
    return out
