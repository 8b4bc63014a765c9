"""Training examples and their order: a pure function of (data, seed, global sample index).

The position of a run in its data is a count of samples, so any process count, any restart and
any phase boundary picks up exactly where the last optimizer step left off.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import torch

from launch.spec import DataPart


class DataError(ValueError):
    """The data file does not fit the schedule; the message names the file and line."""


def load_examples(data: DataPart, model_path: str | None, cache_dir: Path) -> torch.Tensor:
    """All examples as one int64 tensor [n, seq_len]."""
    path = Path(data.path)
    if data.format == "tokens":
        return _tokens(path, data.seq_len)
    return _text(path, data.seq_len, model_path, cache_dir)


def _tokens(path: Path, seq_len: int) -> torch.Tensor:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(f"{path}:{lineno}: expected a JSON object with input_ids") from None
            if len(ids) != seq_len:
                raise DataError(f"{path}:{lineno}: {len(ids)} tokens, data.seq_len is {seq_len}")
            rows.append(ids)
    if not rows:
        raise DataError(f"{path}: no examples")
    return torch.tensor(rows, dtype=torch.int64)


def _documents(path: Path) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        docs.append(json.loads(line)["text"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise DataError(f"{path}:{lineno}: expected a JSON object with text") from None
        return docs
    # A .txt file: documents are separated by blank lines.
    return [d.strip() for d in path.read_text().split("\n\n") if d.strip()]


def _text(path: Path, seq_len: int, model_path: str | None, cache_dir: Path) -> torch.Tensor:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    if model_path is None or not (Path(model_path) / "tokenizer_config.json").exists() and not (Path(model_path) / "tokenizer.json").exists():
        raise DataError(f"{path}: data.format = \"text\" needs a tokenizer in model.path")
    h = hashlib.sha256(path.read_bytes())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
        f = Path(model_path) / name
        if f.exists():
            h.update(f.read_bytes())
    h.update(str(seq_len).encode())
    cached = cache_dir / f"tokens-{h.hexdigest()[:16]}.safetensors"
    if cached.exists():
        return load_file(str(cached))["examples"].long()
    tok = AutoTokenizer.from_pretrained(model_path)
    docs = _documents(path)
    eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
    stream: list[int] = []
    # A fast tokenizer encodes a list of documents in parallel; one document a call is several times slower.
    for i in range(0, len(docs), 1024):
        for ids in tok(docs[i:i + 1024], add_special_tokens=False)["input_ids"]:
            stream.extend(ids + eos)
    n = len(stream) // seq_len
    if n == 0:
        raise DataError(f"{path}: {len(stream)} tokens, fewer than one example of data.seq_len = {seq_len}")
    examples = torch.tensor(stream[: n * seq_len], dtype=torch.int32).view(n, seq_len)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".tmp-{cached.name}.{os.getpid()}")
    save_file({"examples": examples}, str(tmp))
    os.replace(tmp, cached)
    return examples.long()


class SampleOrder:
    """Global sample index -> example index: epochs of a seeded permutation."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._epoch, self._perm = -1, list(range(n))

    def __getitem__(self, g: int) -> int:
        epoch, pos = divmod(g, self.n)
        if self.shuffle and epoch != self._epoch:
            self._perm = list(range(self.n))
            random.Random(f"relayer-data-{self.seed}-{epoch}").shuffle(self._perm)
            self._epoch = epoch
        return self._perm[pos]


def micro_batch(examples: torch.Tensor, order: SampleOrder, step: int, batch_size: int, micro: int,
                rank: int, world: int, mb: int) -> torch.Tensor:
    """The examples rank ``rank`` feeds in micro-step ``micro`` of optimizer step ``step``."""
    first = step * batch_size + micro * mb * world + rank * mb
    return examples[[order[g] for g in range(first, first + mb)]]
