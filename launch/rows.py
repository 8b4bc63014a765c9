"""Tokenized examples into ``seq_len`` rows, packed or padded (numpy only)."""

from __future__ import annotations

import numpy as np

IGNORE = -100
"""A label that carries no loss (Hugging Face's)."""


def ragged(enc, column: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat int32 values, lengths), without going through Python lists."""
    col = enc.data.column(column).combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    info = np.iinfo(np.int32)
    if values.size and (values.min() < info.min or values.max() > info.max):
        # The records' checks keep every id below the vocabulary; a value past int32 is never wrapped.
        raise ValueError(f"{column}: a value of {values.max() if values.max() > info.max else values.min()} does not "
                         f"fit the data cache's 32-bit ids")
    return values.astype(np.int32), np.diff(offsets).astype(np.int64)


def pack(ids, labels, lengths, seq_len, stats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One stream cut into rows (the last partial row dropped); the first token of every example
    is no target, so no example learns to predict the next one from its end."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    labels = labels.copy()
    labels[starts[lengths > 0]] = IGNORE
    n = len(ids) // seq_len
    stats.update(dropped_tokens=int(len(ids) - n * seq_len), truncated=0)
    return (ids[: n * seq_len].reshape(n, seq_len), labels[: n * seq_len].reshape(n, seq_len),
            np.full(n, seq_len, dtype=np.int32))


def pad(ids, labels, lengths, seq_len, stats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One example a row: cut to seq_len or padded (input 0, labels -100, beyond ``lengths``)."""
    n = len(lengths)
    out_ids = np.zeros((n, seq_len), dtype=np.int32)
    out_labels = np.full((n, seq_len), IGNORE, dtype=np.int32)
    kept = np.minimum(lengths, seq_len)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    # Row r takes flat[starts[r] : starts[r] + kept[r]]: one gather over every row at once.
    cols = np.arange(seq_len)
    inside = cols[None, :] < kept[:, None]
    src = (starts[:, None] + cols[None, :])[inside]
    out_ids[inside] = ids[src]
    out_labels[inside] = labels[src]
    stats.update(truncated=int((lengths > seq_len).sum()), dropped_tokens=int((lengths - kept).sum()))
    return out_ids, out_labels, kept.astype(np.int32)
