"""Training examples and their order: a pure function of (data, seed, global sample index).

The position of a run in its data is a count of samples, so any process count, any restart and
any phase boundary picks up exactly where the last optimizer step left off. The examples are the
rows ``launch.data.cache.prepare`` wrote once per run; every process maps them (no copy).

    cache = prepare(spec.data, spec.model.tokenizer, run_dir / "data-cache")
    examples = load_examples(cache)                        # memory-mapped rows (load_validation: the held-out)
    batch = micro_batch(examples, order, step, ...)        # {"input_ids", "labels", "attention_mask"}

Rows of examples packed whole (``data.layout == "whole"``) carry position ids that restart with every
example; their micro-batch is one flattened sequence with ``position_ids`` and no attention mask,
from which transformers builds a block-diagonal causal mask (``masking_utils``, SDPA and eager)
or runs varlen flash attention (``flash_attention_2``, ``launch.prepare.setup_model``): an
example attends to itself only, as ``DataCollatorWithFlattening`` arranges it. Transformers reads
packed position ids only where there is no KV cache: a phase's model has ``use_cache = False``.
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from launch.contract import faults
from launch.data.cache import IGNORE, ROWS, VALIDATION, DataError, prepare, read_stats

if TYPE_CHECKING:
    import torch

__all__ = ["IGNORE", "DataError", "Examples", "SampleOrder", "load_examples", "load_validation", "micro_batch",
           "prepare", "read_stats", "rows", "step_targets", "training_rows"]


@dataclass(frozen=True)
class Examples:
    """Rows of seq_len tokens (numpy arrays, memory-mapped when loaded from a cache)."""

    input_ids: np.ndarray
    """[rows, seq_len] token ids; 0 past ``lengths``."""
    labels: np.ndarray
    """[rows, seq_len], aligned with input_ids as in Hugging Face (the model shifts them); -100: no loss."""
    lengths: np.ndarray
    """[rows] tokens before the padding (seq_len when packed)."""
    targets: np.ndarray
    """[rows] tokens of the row that carry loss: ``(labels[:, 1:] != -100).sum(1)``."""
    positions: np.ndarray | None = None
    """[rows, seq_len] position ids of rows packed whole (each example's from 0); None: 0..seq_len-1."""
    sources: np.ndarray | None = None
    """[rows, seq_len] held-out rows of several sources: the source of each target token (-100 elsewhere)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @classmethod
    def of(cls, input_ids: np.ndarray, labels: np.ndarray | None = None, lengths: np.ndarray | None = None) -> Examples:
        """Rows held in memory (tests, tools); labels default to the inputs, lengths to full rows."""
        input_ids = np.asarray(input_ids)
        labels = np.array(input_ids) if labels is None else np.asarray(labels)
        lengths = np.full(len(input_ids), input_ids.shape[1]) if lengths is None else np.asarray(lengths)
        return cls(input_ids, labels, lengths, (labels[:, 1:] != IGNORE).sum(axis=1))


def load_examples(cache_dir: Path, name: str = ROWS) -> Examples:
    """The rows of a cache entry (``prepare``'s result), memory-mapped read-only: the pages are
    the page cache's, shared by every process that maps them."""
    return Examples(**_map_safetensors(Path(cache_dir) / name))


def load_validation(cache_dir: Path) -> Examples | None:
    """The held-out rows of a cache entry; None where the data holds none out."""
    return load_examples(cache_dir, VALIDATION) if (Path(cache_dir) / VALIDATION).exists() else None


_NP = {"I32": np.int32, "I64": np.int64}


def _map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only ``numpy.memmap`` (the format is an 8-byte
    header length, a JSON header with each tensor's dtype, shape and byte range, then the data)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        if begin == end:
            out[name] = np.zeros(t["shape"], dtype=_NP[t["dtype"]])
        else:
            out[name] = np.memmap(path, dtype=_NP[t["dtype"]], mode="r", offset=8 + n + begin, shape=tuple(t["shape"]))
    return out


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


def _indices(order: SampleOrder, step: int, batch_size: int, micro: int, rank: int, world: int, mb: int) -> list[int]:
    first = step * batch_size + micro * mb * world + rank * mb
    return [order[g] for g in range(first, first + mb)]


def micro_batch(examples: Examples, order: SampleOrder, step: int, batch_size: int, micro: int,
                rank: int, world: int, mb: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` feeds in micro-step ``micro`` of optimizer step ``step``: int64
    ``input_ids``, ``labels`` (-100 on padding and non-targets) and ``attention_mask`` [mb, seq_len],
    or its rows packed whole flattened with their ``position_ids`` (``rows``)."""
    batch = rows(examples, _indices(order, step, batch_size, micro, rank, world, mb))
    faults.point("data.micro_batch", batch=batch, step=step, rank=rank)
    return batch


def rows(examples: Examples, idx: list[int]) -> dict[str, torch.Tensor]:
    """Rows ``idx`` as a model batch (copies only these rows out of the cache): [len(idx), seq_len]
    with an attention mask over the padding, or, for rows packed whole, one flattened row
    [1, len(idx) x seq_len] with its position ids (see the module docstring). Flattening changes
    no loss: a row's first token is an example's first, never a target."""
    import torch  # here, not at the top: the datatool (``orchestrator plan``) reads examples without torch

    ids = torch.from_numpy(_take(examples.input_ids, idx).astype(np.int64))
    labels = torch.from_numpy(_take(examples.labels, idx).astype(np.int64))
    if examples.positions is not None:
        positions = torch.from_numpy(_take(examples.positions, idx).astype(np.int64))
        return {"input_ids": ids.reshape(1, -1), "labels": labels.reshape(1, -1),
                "position_ids": positions.reshape(1, -1)}
    lengths = torch.from_numpy(np.asarray(examples.lengths[idx], dtype=np.int64))
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _take(a: np.ndarray, idx: list[int]) -> np.ndarray:
    """Rows ``idx`` of ``a``. Rows of a mapped cache are read with pread, not through the mapping:
    where the kernel caches files in large folios (ext4 on Linux 6.x), one row read through a
    mapping maps up to 2 MB of page cache into the process, and the ranks of a run came to hold
    half of a 213 MB cache each (benchmarks/results/2026-12-01-data-prep-cpu/)."""
    if not isinstance(a, np.memmap):
        return np.asarray(a[idx])
    out = np.empty((len(idx), *a.shape[1:]), dtype=a.dtype)
    row = out[0].nbytes if len(idx) else 0
    with open(a.filename, "rb", buffering=0) as f:
        for k, i in enumerate(idx):
            out[k] = np.frombuffer(os.pread(f.fileno(), row, a.offset + int(i) * row), dtype=a.dtype).reshape(a.shape[1:])
    return out


def step_targets(examples: Examples, order: SampleOrder, step: int, batch_size: int) -> int:
    """Target tokens of optimizer step ``step`` over every rank and micro-step: the loss's
    denominator, which every rank counts alone (no collective)."""
    return int(sum(int(examples.targets[order[g]]) for g in range(step * batch_size, (step + 1) * batch_size)))


def training_rows(examples: Examples, order: SampleOrder, n: int) -> Iterator[tuple[list[int], list[int]]]:
    """The first ``n`` rows training feeds (global samples 0..n-1, in the run's order) as (input
    ids, labels), padding left out: for ``orchestrator data --show``. A target is
    ``labels[t] != -100`` for t >= 1 (the model predicts token t from the tokens before it)."""
    for g in range(min(n, len(examples))):
        i = order[g]
        k = int(examples.lengths[i])
        yield _take(examples.input_ids, [i])[0, :k].tolist(), _take(examples.labels, [i])[0, :k].tolist()
