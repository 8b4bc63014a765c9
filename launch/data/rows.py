"""Tokenized examples into ``seq_len`` rows: padded, cut from one stream, or packed whole (numpy only).

Examples come as one flat array of tokens (and one of labels) with each example's length. Every
layout returns (input_ids, labels, lengths, positions): [rows, seq_len] int32 arrays, the tokens
of each row before its padding, and position ids for ``whole`` (None for the others, whose
positions are 0..seq_len-1).
"""

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


def starts_of(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def gather(flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The tokens of examples (``starts``, ``lengths``) of ``flat``, one after another."""
    total = int(lengths.sum())
    within = np.arange(total) - np.repeat(starts_of(lengths), lengths)
    return flat[np.repeat(starts, lengths) + within]


def stream(ids, labels, lengths, seq_len, stats):
    """One stream cut into rows (the last partial row dropped); the first token of every example
    is no target, so no example learns to predict the next one from its end."""
    starts = starts_of(lengths)
    labels = labels.copy()
    labels[starts[lengths > 0]] = IGNORE
    n = len(ids) // seq_len
    stats.update(dropped_tokens=int(len(ids) - n * seq_len), truncated=0)
    return (ids[: n * seq_len].reshape(n, seq_len), labels[: n * seq_len].reshape(n, seq_len),
            np.full(n, seq_len, dtype=np.int32), None)


def pad(ids, labels, lengths, seq_len, stats):
    """One example a row: cut to seq_len or padded (input 0, labels -100, beyond ``lengths``)."""
    kept = np.minimum(lengths, seq_len)
    rows = np.arange(len(lengths))
    out_ids, out_labels = _place(ids, labels, lengths, kept, rows, np.zeros(len(lengths), np.int64), seq_len)
    stats.update(truncated=int((lengths > seq_len).sum()), dropped_tokens=int((lengths - kept).sum()))
    return out_ids, out_labels, kept.astype(np.int32), None


def whole(ids, labels, lengths, seq_len, stats):
    """Examples packed whole into rows, in their order, each into the row it fills best (best fit);
    one longer than ``seq_len`` is cut to a row of its own. Each example's first token is no target
    and its positions restart at 0; the padding after a row's last example counts from 0 again,
    so every example and the padding is a block of its own for the attention (``launch.data.examples``)."""
    kept = np.minimum(lengths, seq_len)
    row, col = best_fit(kept, seq_len)
    out_ids, out_labels = _place(ids, labels, lengths, kept, row, col, seq_len)
    out_labels[row, col] = IGNORE
    used = np.zeros(len(out_ids), np.int64)
    np.maximum.at(used, row, col + kept)
    positions = np.maximum(np.arange(seq_len)[None, :] - used[:, None], 0)
    r, c, within = _cells(kept, row, col)
    positions[r, c] = within
    stats.update(truncated=int((lengths > seq_len).sum()), dropped_tokens=int((lengths - kept).sum()))
    return out_ids, out_labels, used.astype(np.int32), positions.astype(np.int32)


def best_fit(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each example: the open row with the least room that holds it, else a new one."""
    rows_with = [[] for _ in range(seq_len + 1)]  # rows_with[c]: the rows with room for exactly c more tokens
    some = np.zeros(seq_len + 1, dtype=bool)
    row, col = np.empty(len(lengths), np.int64), np.empty(len(lengths), np.int64)
    count = 0
    for i, length in enumerate(lengths.tolist()):
        room = length + int(some[length:].argmax())
        if not some[room]:
            room, r, count = seq_len, count, count + 1
        else:
            r = rows_with[room].pop()
            some[room] = bool(rows_with[room])
        row[i], col[i] = r, seq_len - room
        if room - length > 0:
            rows_with[room - length].append(r)
            some[room - length] = True
    return row, col


def _place(ids, labels, lengths, kept, row, col, seq_len) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``seq_len`` holding the first ``kept`` tokens of each example at (``row``, ``col``)."""
    n = int(row.max()) + 1 if len(row) else 0
    out_ids = np.zeros((n, seq_len), dtype=np.int32)
    out_labels = np.full((n, seq_len), IGNORE, dtype=np.int32)
    r, c, within = _cells(kept, row, col)
    src = np.repeat(starts_of(lengths), kept) + within
    out_ids[r, c] = ids[src]
    out_labels[r, c] = labels[src]
    return out_ids, out_labels


def _cells(kept, row, col) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per kept token: its row, its column and its index within its example."""
    within = np.arange(int(kept.sum())) - np.repeat(starts_of(kept), kept)
    return np.repeat(row, kept), np.repeat(col, kept) + within, within
