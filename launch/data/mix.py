"""Which records of each source train and which are held out, how often an epoch draws each, and
the one seeded order they are mixed into: pure functions of (the record counts, the options, the
run's seed), so every process, resume and process count sees the same.

    train, held = split(records, fraction, seed, source)   # record indices
    drawn = draws(train, weight, seed, source)              # an epoch's records, in record order
    order = mixed(total, seed, shuffle)                     # the order packing takes the examples in
"""

from __future__ import annotations

import math

import numpy as np

MAX_DRAWN = 1 << 30
"""Examples one source may put in an epoch: its draws are 8-byte indices held at once (8 GiB here)."""
_SPLIT, _DRAW, _MIX = 1, 2, 3
"""What a generator is for: one stream each, so changing one option moves nothing else."""


def _rng(seed: int, purpose: int, source: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, purpose, source])


def held_out(records: int, fraction: float | None) -> int:
    """How many of ``records`` ``fraction`` holds out: ceil(fraction x records), as Hugging Face's
    ``train_test_split`` counts its test split."""
    return math.ceil(fraction * records) if fraction else 0


def split(records: int, fraction: float | None, seed: int, source: int) -> tuple[np.ndarray, np.ndarray]:
    """(the training records, the held-out records) of a source, each in record order."""
    held = np.sort(_rng(seed, _SPLIT, source).permutation(records)[: held_out(records, fraction)])
    return np.setdiff1d(np.arange(records), held), held


def drawn_count(records: int, weight: float) -> int:
    """Examples an epoch draws from ``records`` at ``weight``: round(weight x records), half up."""
    return math.floor(weight * records + 0.5)


def draws(train: np.ndarray, weight: float, seed: int, source: int) -> np.ndarray:
    """An epoch's draws of a source's training records: every record floor(weight) times, and a
    seeded sample of them for the rest of ``drawn_count``."""
    whole = math.floor(weight)
    rest = drawn_count(len(train), weight) - whole * len(train)
    extra = np.sort(_rng(seed, _DRAW, source).permutation(len(train))[:rest])
    return np.concatenate([np.tile(train, whole), train[extra]])


def mixed(total: int, seed: int, shuffle: bool) -> np.ndarray:
    """The order of an epoch's examples (all sources' one after another) into rows: seeded, or as they come."""
    return _rng(seed, _MIX).permutation(total) if shuffle else np.arange(total)
