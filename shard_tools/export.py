"""``shard-tools export``: a run's weights as a Hugging Face model directory.

    shard-tools export runs/tiny --out exported/tiny                # the run's newest whole checkpoint
    shard-tools export runs/tiny/checkpoints/step-00000020 --out exported/s20 --dtype bfloat16

The directory is written under a temporary sibling name and renamed into place at the end, so
``--out`` holds either a whole export or what was there before.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from shard_tools.checkpoint import run_weights
from shard_tools.manifest import MANIFEST, TMP_PREFIX, CheckpointError, InputError, Manifest
from shard_tools.model import DTYPES, ModelSpec, build_base_model
from shard_tools.verify import trusted_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "generation_config.json")
# Shards of a few GB download and load piece by piece; one file per model would be up to 50 GB.
MAX_SHARD_SIZE = "5GB"


def base_spec(ckpt: Path, manifest: Manifest) -> ModelSpec:
    try:
        base = manifest.extra["base_model"]
        return ModelSpec(path=base["path"], config=base["config"], dtype=base["dtype"], seed=base["seed"])
    except (KeyError, TypeError):
        raise CheckpointError(f"{ckpt / MANIFEST}: extra.base_model {{path, config, dtype, seed}} is missing or "
                              f"incomplete, so the base model cannot be rebuilt") from None


def base_model(ckpt: Path, manifest: Manifest) -> nn.Module:
    """The base model the checkpoint's run started from, in fp32."""
    spec = base_spec(ckpt, manifest)
    if spec.dtype not in DTYPES:
        raise CheckpointError(f"{ckpt / MANIFEST}: extra.base_model.dtype {spec.dtype!r} is not one of "
                              f"{', '.join(DTYPES)}")
    try:
        return build_base_model(spec).float()
    except (OSError, ValueError, KeyError) as e:
        where = spec.path or "the config in the manifest"
        raise CheckpointError(f"{where}: cannot build the base model that {ckpt / MANIFEST} names ({e})") from None


def compose(run_dir: Path, ckpt: Path, manifest: Manifest) -> nn.Module:
    """The base model with the checkpoint's run weights loaded over it, in fp32."""
    model = base_model(ckpt, manifest)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in run_weights(run_dir, ckpt).items():
            if name not in params:
                raise CheckpointError(f"{ckpt}: tensor {name!r} is not a parameter of the base model")
            if params[name].shape != t.shape:
                raise CheckpointError(f"{ckpt}: tensor {name!r} has shape {list(t.shape)}, "
                                      f"the base model's has {list(params[name].shape)}")
            params[name].copy_(t)
    return model


def export(source: Path, out: Path, dtype: str | None = None, force: bool = False,
           max_shard_size: str | int | None = None) -> Path:
    """Writes the composed model of ``source`` (run or checkpoint) to ``out``; returns the checkpoint used."""
    out = Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise InputError(f"{out}: exists and is not empty; use --force to replace it")
    run_dir, ckpt, manifest = trusted_checkpoint(source)
    dtype = dtype or manifest.dtype
    if dtype not in DTYPES:
        raise CheckpointError(f"{ckpt / MANIFEST}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    model = compose(run_dir, ckpt, manifest).to(DTYPES[dtype])
    _check_tied(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{TMP_PREFIX}{out.name}.{os.getpid()}"
    try:
        model.save_pretrained(tmp, max_shard_size=max_shard_size or MAX_SHARD_SIZE)
        base_path = base_spec(ckpt, manifest).path
        for name in TOKENIZER_FILES if base_path else ():
            if (Path(base_path) / name).is_file():
                shutil.copy2(Path(base_path) / name, tmp / name)
        (tmp / "relayer.json").write_text(json.dumps({
            "checkpoint": str(ckpt.resolve()), "global_step": manifest.global_step, "phase": manifest.phase,
            "dtype": dtype, "versions": manifest.versions}, indent=2) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt


def _check_tied(model: nn.Module) -> None:
    if getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight, "lost the embedding tie"


def _replace_dir(new: Path, dest: Path) -> None:
    """Moves ``new`` to ``dest``; an existing ``dest`` goes aside first and is removed only afterwards."""
    old = dest.with_name(f"{TMP_PREFIX}{dest.name}.old.{os.getpid()}")
    if dest.exists():
        os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)
