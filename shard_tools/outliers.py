"""OwLore's layer weights: each body layer's outlier ratio, for ``schedule.layer_weights``.

    shard-tools outliers MODEL_DIR DATA.jsonl [--rows 32] [--seq-len 512] [--threshold 5]

OwLore (Li et al. 2024, "OwLore: Outlier-weighted Layerwise Sampled Low-Rank Projection for
Memory-Efficient LLM Fine-tuning") samples the layers it trains in proportion to their outlier ratio,
the layerwise outlier distribution of OWL (Yin et al. 2023, "Outlier Weighed Layerwise Sparsity"):
for every weight of a layer's linear maps, its score is |W_ij| x ||X_j||, the norm of its input
feature j over calibration tokens; the layer's ratio is the share of its weights whose score is
above ``threshold`` times the mean score of the layer (OWL's M, 5 by default here). The calibration
tokens are the first ``rows`` rows of a JSONL file (``input_ids``, or ``text`` tokenized with the
model directory's tokenizer), each cut to ``seq_len``. The command prints the line to put into the
schedule; relayer draws the layers from it as from any weights (``orchestrator.choose``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from shard_tools.errors import InputError
from shard_tools.model import detect_parts

THRESHOLD = 5.0
"""OWL's M: a weight is an outlier where its score is above this many times its layer's mean."""


def calibration_rows(data: Path, model_dir: Path, rows: int, seq_len: int) -> list[list[int]]:
    """The first ``rows`` rows of ``data`` as token ids, each at most ``seq_len``; InputError naming
    the file (and line) where it cannot be read."""
    if not data.is_file():
        raise InputError(f"{data}: no such file (expected JSONL rows with input_ids or text)")
    tokenizer, out = None, []
    with open(data, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if len(out) == rows:
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{data}:{number}: not JSON ({e.msg})") from None
            ids = row.get("input_ids") if isinstance(row, dict) else None
            if ids is None and isinstance(row, dict) and isinstance(row.get("text"), str):
                if tokenizer is None:
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(model_dir)
                ids = tokenizer(row["text"])["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise InputError(f"{data}:{number}: expected input_ids (token ids) or text")
            out.append(ids[:seq_len])
    if not out:
        raise InputError(f"{data}: no rows")
    return out


def load_model(model_dir: Path) -> nn.Module:
    """The model of ``model_dir`` as a run reads it (``shard_tools.model.build_base_model``:
    safetensors only, every weight accounted for), in the dtype its config.json names (float32 where
    it names none relayer trains in); InputError naming the folder where it cannot be read so."""
    from shard_tools.model import DTYPES, ModelSpec, build_base_model

    try:
        named = json.loads((model_dir / "config.json").read_text())
        dtype = next((d for d in (named.get("dtype"), named.get("torch_dtype")) if d in DTYPES), "float32")
        return build_base_model(ModelSpec(path=str(model_dir), config=None, dtype=dtype, seed=0)).eval()
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        raise InputError(f"{model_dir}: {e}") from None


def _linears(layer: nn.Module) -> list[tuple[nn.Module, bool]]:
    """The layer's linear maps, and for each whether its weight is (in, out) (GPT-2's Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    return [(m, isinstance(m, Conv1D)) for m in layer.modules() if isinstance(m, (nn.Linear, Conv1D))]


def outlier_ratios(model: nn.Module, rows: list[list[int]], threshold: float = THRESHOLD) -> list[float]:
    """Per body layer, the share of its linear maps' weights whose score |W_ij| x ||X_j|| is above
    ``threshold`` times the layer's mean score, over the calibration ``rows``."""
    _, layers_attr = detect_parts(model, None, None)
    layers = list(model.get_submodule(layers_attr))
    squares: dict[nn.Module, torch.Tensor] = {}

    def hook(module: nn.Module, args: tuple) -> None:
        x = args[0].detach().float()
        squares[module] = squares.get(module, 0) + x.reshape(-1, x.shape[-1]).pow(2).sum(0)

    handles = [m.register_forward_pre_hook(hook) for layer in layers for m, _ in _linears(layer)]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in rows:
                model(input_ids=torch.tensor([ids], device=device))
    finally:
        for h in handles:
            h.remove()
    out = []
    for layer in layers:
        scores = torch.cat([(m.weight.detach().float().abs() * (squares[m].sqrt()[:, None] if conv else
                                                                 squares[m].sqrt()[None, :])).flatten()
                            for m, conv in _linears(layer)])
        out.append(float((scores > threshold * scores.mean()).float().mean()))
    return out


def weights_line(ratios: list[float]) -> str:
    """The schedule's line for ``ratios``."""
    return "layer_weights = [" + ", ".join(f"{r:.6g}" for r in ratios) + "]"
